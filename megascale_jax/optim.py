"""Optimizer: optax AdamW with linear warmup + cosine decay; global-norm gradient clipping.

Weight decay applies to matrices only (ndim >= 2): norms' scales are left alone, as is customary.
Adam's moments are stored in `train.adam_moments_dtype` (float32, or bfloat16 as DeepSeek-V3 trains): the update
is computed in float32 either way; bfloat16 storage saves 4 of the 8 bytes a parameter the moments take and
8 of the ~28 bytes a parameter the update pass moves (one pass at HBM speed: 10.2 + 1.5 ms of deepseekmoe_small's
H200 step in float32).
Clipping is not part of the optax chain: the step's updaters (megascale_jax/updaters.py, parallel/zero.py)
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


# A stored moment moves by (1 - b) of itself per step; bfloat16 keeps 8 significant bits, so a step under half
# its spacing (2^-9..2^-8 of the value) rounds away: b2 = 0.999 adds 0.001 of the new square and is lost. 2^-7 is
# the bound config_checks enforces, with a margin.
BF16_MIN_MOMENT_STEP = 2.0 ** -7

ADAM_EPS = 1e-8   # optax.scale_by_adam's default, named for the fused update (megascale_jax/updaters.py)


def scale_by_adam(b1: float, b2: float, moments_dtype: str) -> optax.GradientTransformation:
    """optax.scale_by_adam with both moments stored in `moments_dtype` ('float32' | 'bfloat16', checked by
    config_checks): each update widens the stored moments to
    float32, runs optax's float32 arithmetic and rounds the new moments once. Why not optax's mu_dtype alone: it
    leaves the second moment in float32, and a moment held in bfloat16 during optax's update makes jax round the
    decay rates themselves to bfloat16 (0.9 -> 0.8984), a bias every step."""
    dtype = jnp.dtype(moments_dtype)
    adam = optax.scale_by_adam(b1=b1, b2=b2, eps=ADAM_EPS)
    if dtype == jnp.float32:
        return adam

    def stored(state, cast):
        return state._replace(mu=jax.tree.map(cast, state.mu), nu=jax.tree.map(cast, state.nu))

    def init(params):
        return stored(adam.init(params), lambda m: m.astype(dtype))

    def update(updates, state, params=None):
        updates, state = adam.update(updates, stored(state, lambda m: m.astype(jnp.float32)), params)
        return updates, stored(state, lambda m: m.astype(dtype))

    return optax.GradientTransformation(init, update)


def learning_rate_schedule(train_cfg) -> optax.Schedule:
    t = train_cfg
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=t.learning_rate, warmup_steps=t.warmup_steps,
        decay_steps=max(t.steps, t.warmup_steps + 1), end_value=t.learning_rate * t.min_lr_ratio)


def is_decayed(param) -> bool:
    """Whether weight decay applies to a parameter: matrices (ndim >= 2), not norms' scales or biases."""
    return param.ndim >= 2


def make_optimizer(train_cfg) -> optax.GradientTransformation:
    """AdamW on a parameter pytree (elementwise, so it runs on each device's shards as well): optax.adamw's
    chain (the same state structure: a checkpoint written by optax.adamw restores, float32 parameters and
    moments alike) with the moments stored as configured."""
    t = train_cfg
    decay_mask = lambda params: jax.tree.map(is_decayed, params)  # noqa: E731
    return optax.chain(scale_by_adam(t.b1, t.b2, t.adam_moments_dtype),
                       optax.add_decayed_weights(t.weight_decay, decay_mask),
                       optax.scale_by_learning_rate(learning_rate_schedule(t)))


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
    return optax.chain(scale_by_adam(t.b1, t.b2, t.adam_moments_dtype),
                       _masked_weight_decay(t.weight_decay, decay_mask_flat),
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


# ------------------------------------------------------------ make_optimizer's chain, for an update written out
# The fused update (megascale_jax/updaters.py, kernels.adamw='pallas') runs the chain's arithmetic itself and keeps
# its state: (scale_by_adam's (count, mu, nu), the masked weight decay's (empty), scale_by_schedule's (count)).
def adam_step_scalars(opt_state, train_cfg):
    """(learning rate, 1 - b1^t, 1 - b2^t) of the update `make_optimizer`'s chain makes from `opt_state`, as optax
    computes them (t = Adam's count after this step)."""
    adam, _, schedule_state = opt_state
    count = optax.safe_increment(adam.count)
    t = train_cfg
    return (learning_rate_schedule(t)(schedule_state.count).astype(jnp.float32),
            (1 - t.b1 ** count).astype(jnp.float32), (1 - t.b2 ** count).astype(jnp.float32))


def advanced_state(opt_state, mu, nu):
    """`make_optimizer`'s state after one update with the new moments `mu`, `nu`."""
    adam, decay, schedule_state = opt_state
    return (adam._replace(count=optax.safe_increment(adam.count), mu=mu, nu=nu), decay,
            schedule_state._replace(count=optax.safe_increment(schedule_state.count)))
