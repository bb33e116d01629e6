"""The MoE transformer (Flax NNX).

Parameters carry *logical* axis names (`sharding_names`, e.g. ('experts', 'embed', 'expert_ffn')); only
megascale_jax/parallel/plan.py maps them onto mesh axes. Flax's eager variable sharding is switched off so
that creating a module never needs a mesh: the trainer creates the state directly with its shardings by
jitting the initializer with `out_shardings` from the plan.
"""
import flax

flax.config.update("flax_always_shard_variable", False)
