"""Hunyuan-Large (Tencent, arXiv 2411.02265): 64 layers, hidden 6400, 80 heads / 8 KV heads, 16 routed
experts of FFN 18304, top-1, plus 1 shared expert of FFN 18304; vocab 128512. 389 B parameters, 52 B active.
(Hunyuan's cross-layer KV sharing is not modelled; it changes the KV parameter count by well under 1%.)

    python -m megascale_jax.train --config configs/hunyuan_large.py --config.parallel.pipe=8

runs the paper's plan (plan_recipe 'megascale': SP attention + EP experts over the node's GPUs);
add --config.plan_recipe=megatron_tp for the TP baseline (configs/plans.py lists the recipes).
"""
from configs import base


def get_config():
    c = base.get_config()
    c.name = "hunyuan_large"
    c.model.update(vocab_size=128512, num_layers=64, hidden=6400, num_heads=80, num_kv_heads=8,
                   dense_ffn=18304, rope_theta=1e4, max_seq_len=32768)
    c.model.moe.update(num_experts=16, top_k=1, expert_ffn=18304, num_shared_experts=1,
                       shared_expert_ffn=18304, renormalize=False)
    base.large_scale_training(c)
    return c
