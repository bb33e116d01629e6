"""DeepSeekMoE-16B (DeepSeek-AI, arXiv 2401.06066): 28 layers, hidden 2048, 16 heads (MHA), fine-grained
experts: 64 routed of FFN 1408, top-6, plus 2 shared experts of FFN 1408; the first layer is dense
(FFN 10944); vocab 102400. 16.4 B parameters, 2.8 B active.

    python -m megascale_jax.train --config configs/deepseekmoe_16b.py

runs the paper's plan (plan_recipe 'megascale': SP attention + EP experts over the node's GPUs);
add --config.plan_recipe=megatron_tp for the TP baseline (configs/plans.py lists the recipes).
"""
from configs import base


def get_config():
    c = base.get_config()
    c.name = "deepseekmoe_16b"
    c.model.update(vocab_size=102400, num_layers=28, hidden=2048, num_heads=16, num_kv_heads=16,
                   dense_ffn=10944, num_dense_layers=1, rope_theta=1e4, max_seq_len=4096)
    c.model.moe.update(num_experts=64, top_k=6, expert_ffn=1408, num_shared_experts=2,
                       shared_expert_ffn=1408, renormalize=False)
    base.large_scale_training(c, learning_rate=4.2e-4)
    return c
