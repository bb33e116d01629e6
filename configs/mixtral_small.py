"""A Mixtral-8x7B-shaped model cut to 2 layers: the same per-layer shapes (hidden 4096, 32/8 heads, 8 experts
of FFN 14336, top-2), small enough to train on one H200 with synthetic tokens. Used for GPU baselines.

    python -m megascale_jax.train --config configs/mixtral_small.py
"""
from configs import mixtral_8x7b


def get_config():
    c = mixtral_8x7b.get_config()
    c.name = "mixtral_small"
    c.model.num_layers = 2
    c.data.source = "synthetic"
    c.train.update(global_batch=2, seq_len=4096, steps=30, warmup_steps=5, log_every=5, eval_every=0,
                   remat="full")
    return c
