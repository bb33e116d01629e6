"""Optimizer: optax AdamW with linear warmup + cosine decay and global-norm gradient clipping.

Weight decay applies to matrices only (ndim >= 2): norms' scales are left alone, as is customary.
"""
from __future__ import annotations

import jax
import optax


def learning_rate_schedule(train_cfg) -> optax.Schedule:
    t = train_cfg
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=t.learning_rate, warmup_steps=t.warmup_steps,
        decay_steps=max(t.steps, t.warmup_steps + 1), end_value=t.learning_rate * t.min_lr_ratio)


def make_optimizer(train_cfg) -> optax.GradientTransformation:
    t = train_cfg
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(t.grad_clip) if t.grad_clip > 0 else optax.identity(),
        optax.adamw(learning_rate_schedule(t), b1=t.b1, b2=t.b2, weight_decay=t.weight_decay, mask=decay_mask),
    )
