"""Named parallel plans ("recipes"): how the intra-node domain is used. Pick one with
`--config.plan_recipe=NAME`; explicit `--config.parallel.plan/attention/ffn/intra` overrides win over it.

    xla          annotations on parameters and the batch, XLA's sharding propagation decides (intra 1)
    megascale    the paper's plan: manual, Ulysses SP attention + EP experts over the node's devices
    megatron_tp  the Megatron baseline: manual, TP attention + TP experts over the node's devices
    tp_ep        manual, TP attention + EP experts
    sp_tp        manual, SP attention + TP experts

intra = "node" means the devices of one host (jax.local_device_count(), at most the device count): one
NVLink domain on a GPU node. megascale_jax/config.py resolves the recipe once, into the frozen config.
"""

NODE = "node"

RECIPES = {
    "xla": {"plan": "xla", "attention": "sp", "ffn": "ep", "intra": 1},
    "megascale": {"plan": "manual", "attention": "sp", "ffn": "ep", "intra": NODE},
    "megatron_tp": {"plan": "manual", "attention": "tp", "ffn": "tp", "intra": NODE},
    "tp_ep": {"plan": "manual", "attention": "tp", "ffn": "ep", "intra": NODE},
    "sp_tp": {"plan": "manual", "attention": "sp", "ffn": "tp", "intra": NODE},
}
