"""Optimizer: optax AdamW with linear warmup + cosine decay; global-norm gradient clipping.

Weight decay applies to matrices only (ndim >= 2): norms' scales are left alone, as is customary.
Clipping is not part of the optax chain: the step's updaters (megascale_jax/step.py, parallel/zero.py)
compute the global norm themselves, because per device each holds only shards of the gradient.
"""
from __future__ import annotations

from enum import StrEnum

import jax
import jax.numpy as jnp
import numpy as np
import optax


class NonFinite(StrEnum):
    """What a step with a non-finite loss or gradient does (megascale_jax/step.py detects it on device)."""
    STOP = "stop"    # the update is applied as computed; the loop stops at its next sync, never checkpointing it
    SKIP = "skip"    # parameters and optimizer state stay as they were; the step is counted


def learning_rate_schedule(train_cfg) -> optax.Schedule:
    t = train_cfg
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=t.learning_rate, warmup_steps=t.warmup_steps,
        decay_steps=max(t.steps, t.warmup_steps + 1), end_value=t.learning_rate * t.min_lr_ratio)


def make_optimizer(train_cfg) -> optax.GradientTransformation:
    """AdamW on a parameter pytree (elementwise, so it runs on each device's shards as well)."""
    t = train_cfg
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    return optax.adamw(learning_rate_schedule(t), b1=t.b1, b2=t.b2, weight_decay=t.weight_decay, mask=decay_mask)


def clip_by_norm(grads, norm, max_norm: float | None):
    """optax.clip_by_global_norm's arithmetic with the norm given (a global norm over sharded leaves)."""
    if max_norm is None:
        return grads
    clipped = norm >= max_norm
    return jax.tree.map(lambda g: jnp.where(clipped, (g / norm) * max_norm, g), grads)


def make_flat_optimizer(train_cfg, decay_mask_flat) -> optax.GradientTransformation:
    """AdamW for ZeRO-1's flat parameter slices, equal to `make_optimizer` (ZeRO-1 clips by the global norm
    itself). The weight-decay mask is a flat 0/1 vector kept *in the optimizer
    state*, so ZeRO-1 shards it with the other state and each rank decays exactly its slice's matrices."""
    t = train_cfg
    return optax.chain(optax.scale_by_adam(b1=t.b1, b2=t.b2), _masked_weight_decay(t.weight_decay, decay_mask_flat),
                       optax.scale_by_learning_rate(learning_rate_schedule(t)))


def _masked_weight_decay(weight_decay: float, mask_flat) -> optax.GradientTransformation:
    def init(params):
        del params
        return {"decay_mask": jnp.asarray(mask_flat, jnp.uint8)}   # 1 byte per parameter

    def update(updates, state, params):
        return updates + weight_decay * state["decay_mask"].astype(params.dtype) * params, state

    return optax.GradientTransformation(init, update)


def flat_decay_mask(segments, length: int):
    """uint8 [length]: 1 on elements of matrices (ndim >= 2), 0 elsewhere and on the padding, for a flat
    vector laid out as `segments` = [(ndim of the leaf, elements of it), ...] in order (a ZeRO-1 bucket).
    Computed from the segment boundaries on device, so no constant of the vector's length (gigabytes at
    paper scale) enters the program."""
    ends = np.cumsum([count for _, count in segments])
    decay = np.array([ndim >= 2 for ndim, _ in segments] + [False], np.uint8)   # the last entry: the padding
    segment = jnp.searchsorted(jnp.asarray(ends, jnp.int32), jnp.arange(length, dtype=jnp.int32), side="right")
    return jnp.asarray(decay)[segment]
