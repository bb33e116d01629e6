"""DeepSeekMoE-16B's layer shapes cut to 3 layers (the dense first layer + 2 fine-grained MoE layers: 64
experts of FFN 1408, top-6, 2 shared experts), synthetic tokens. For plan benchmarks on a few GPUs.

    python -m megascale_jax.train --config configs/deepseekmoe_small.py --config.parallel.intra=2
"""
from configs import deepseekmoe_16b


def get_config():
    c = deepseekmoe_16b.get_config()
    c.name = "deepseekmoe_small"
    c.model.num_layers = 3
    c.data.source = "synthetic"
    # As mixtral_small: no remat, the (2-layer) MoE loop unrolled; 8 x 4096 tokens: ~167k tokens/s, 50% MFU on
    # one H200 (benchmarks/results/train_step_1xh200.json).
    c.train.update(global_batch=8, seq_len=4096, steps=30, warmup_steps=5, log_every=5, eval_every=0,
                   remat="none", scan_unroll=2)
    return c
