"""Phi-3.5-MoE (Microsoft, arXiv 2404.14219): 32 layers, hidden 4096, 32 heads / 8 KV heads, 16 experts of
FFN 6400, top-2, vocab 32064. 41.9 B parameters, 6.6 B active.

    python -m megascale_jax.train --config configs/phi35_moe.py

runs the paper's plan (plan_recipe 'megascale': SP attention + EP experts over the node's GPUs);
add --config.plan_recipe=megatron_tp for the TP baseline (configs/plans.py lists the recipes).
"""
from configs import base


def get_config():
    c = base.get_config()
    c.name = "phi35_moe"
    c.model.update(vocab_size=32064, num_layers=32, hidden=4096, num_heads=32, num_kv_heads=8,
                   dense_ffn=6400, rope_theta=1e4, max_seq_len=131072)
    c.model.moe.update(num_experts=16, top_k=2, expert_ffn=6400)
    base.large_scale_training(c)
    return c
