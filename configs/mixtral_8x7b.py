"""Mixtral-8x7B (Mistral AI, arXiv 2401.04088): 32 layers, hidden 4096, 32 heads / 8 KV heads,
8 experts of FFN 14336, top-2, vocab 32000. 46.7 B parameters, 12.9 B active.

    python -m megascale_jax.train --config configs/mixtral_8x7b.py

runs the paper's plan (plan_recipe 'megascale': SP attention + EP experts over the node's GPUs);
add --config.plan_recipe=megatron_tp for the TP baseline (configs/plans.py lists the recipes).
"""
from configs import base


def get_config():
    c = base.get_config()
    c.name = "mixtral_8x7b"
    c.model.update(vocab_size=32000, num_layers=32, hidden=4096, num_heads=32, num_kv_heads=8,
                   dense_ffn=14336, rope_theta=1e6, max_seq_len=32768)
    c.model.moe.update(num_experts=8, top_k=2, expert_ffn=14336)
    base.large_scale_training(c)
    return c
