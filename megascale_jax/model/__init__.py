"""The MoE transformer (Flax NNX): transformer.py (embed / blocks / head_loss), attention.py, layers.py, moe/.

Parameters carry *logical* axis names (`sharding_names`, e.g. ('experts', 'embed', 'expert_ffn')); only
megascale_jax/parallel/plan.py maps them onto mesh axes. Modules never create sharded variables (Flax's
`flax_always_shard_variable` is switched off by megascale_jax/step.py, which builds the state): the step
creates the state directly with its shardings by jitting the initializer with `out_shardings` from the plan.
Model code calls no collective and opens no shard_map; the layout (parallel/layouts.py) does the talking.
"""
