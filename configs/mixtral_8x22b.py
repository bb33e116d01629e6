"""Mixtral-8x22B (Mistral AI): 56 layers, hidden 6144, 48 heads / 8 KV heads, 8 experts of FFN 16384,
top-2, vocab 32768. 141 B parameters, 39 B active.

    python -m megascale_jax.train --config configs/mixtral_8x22b.py --config.parallel.pipe=4

runs the paper's plan (plan_recipe 'megascale': SP attention + EP experts over the node's GPUs);
add --config.plan_recipe=megatron_tp for the TP baseline (configs/plans.py lists the recipes).
"""
from configs import base


def get_config():
    c = base.get_config()
    c.name = "mixtral_8x22b"
    c.model.update(vocab_size=32768, num_layers=56, hidden=6144, num_heads=48, num_kv_heads=8,
                   dense_ffn=16384, rope_theta=1e6, max_seq_len=65536)
    c.model.moe.update(num_experts=8, top_k=2, expert_ffn=16384)
    base.large_scale_training(c)
    return c
