"""The paper's Internal-352B MoE (MegaScale-MoE, arXiv 2505.11432, Table 2): 60 layers, hidden 4096, 32 heads,
GQA ratio m = 4 (8 KV heads), 32 experts of FFN 14336, top-3, sequence 8192, vocab 65536.
(Our count of this shape is ~341 B; the paper's 352 B name may include parts it does not publish.)

    python -m megascale_jax.train --config configs/internal_352b.py --config.parallel.pipe=12

runs the paper's plan (plan_recipe 'megascale': SP attention + EP experts over the node's GPUs);
add --config.plan_recipe=megatron_tp for the TP baseline (configs/plans.py lists the recipes).
"""
from configs import base


def get_config():
    c = base.get_config()
    c.name = "internal_352b"
    c.model.update(vocab_size=65536, num_layers=60, hidden=4096, num_heads=32, num_kv_heads=8,
                   dense_ffn=14336, rope_theta=1e6, max_seq_len=8192)
    c.model.moe.update(num_experts=32, top_k=3, expert_ffn=14336)
    base.large_scale_training(c, global_batch=512, seq_len=8192)
    return c
