"""Tiny MoE on the CPU, trained on the built-in real-text corpus (byte-level tokens).

    python -m megascale_jax.train --config configs/tiny_cpu.py

Expected: on 2 CPU cores, 300 steps in about a minute; the train loss falls from ~5.5 to ~1.8 and the eval
loss to ~2.1, +-0.05 across CPUs (measured 2026-12-01: 1.78 / 2.09). Runs on any device count (data parallel
over all of them).
"""
from configs import base


def get_config():
    c = base.get_config()
    c.name = "tiny_cpu"
    c.model.update(vocab_size=256, num_layers=2, hidden=128, num_heads=4, num_kv_heads=2,
                   dense_ffn=256, max_seq_len=256)
    c.model.moe.update(num_experts=8, top_k=2, expert_ffn=128)
    c.train.update(steps=300, global_batch=16, seq_len=128, learning_rate=3e-3, warmup_steps=20,
                   compute_dtype="float32", log_every=25, eval_every=100, eval_batches=2)
    return c
