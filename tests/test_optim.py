"""The optimizer: optax's AdamW with the moments stored as configured; the flat optimizer's weight-decay mask,
laid out as ZeRO-1 buckets lay out parameters."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from megascale_jax.config import ConfigError, default_config
from megascale_jax.optim import flat_decay_mask, learning_rate_schedule, make_optimizer, scale_by_adam


def test_flat_decay_mask_marks_matrix_elements_and_leaves_padding_undecayed():
    # a matrix piece of 3 elements, a vector of 2, a 3-d piece of 4, then 3 elements of padding
    mask = flat_decay_mask([(2, 3), (1, 2), (3, 4)], 12)
    assert mask.dtype == np.uint8
    np.testing.assert_array_equal(mask, [1, 1, 1, 0, 0, 1, 1, 1, 1, 0, 0, 0])


def _grads_and_params(seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    params = {"w": jax.random.normal(keys[0], (16, 8)), "scale": jnp.ones((8,))}
    grads = [jax.tree.map(lambda p, k=k: 1e-3 * jax.random.normal(k, p.shape), params)
             for k in jax.random.split(keys[1], 4)]
    return params, grads


def _run(optimizer, params, grads):
    state = optimizer.init(params)
    for g in grads:
        updates, state = optimizer.update(g, state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def test_float32_moments_are_optax_adamw_exactly():
    cfg = default_config("tiny_cpu")
    params, grads = _grads_and_params()
    ours = make_optimizer(cfg.train)
    adamw = optax.adamw(learning_rate_schedule(cfg.train), b1=cfg.train.b1, b2=cfg.train.b2,
                        weight_decay=cfg.train.weight_decay, mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p))
    assert jax.tree.structure(ours.init(params)) == jax.tree.structure(adamw.init(params))   # checkpoints carry over
    jax.tree.map(np.testing.assert_array_equal, _run(ours, params, grads), _run(adamw, params, grads))


def test_bfloat16_moments_are_float32_adam_with_its_moments_rounded_after_each_update():
    """The exact twin: optax's float32 scale_by_adam whose moments are rounded to bfloat16 after every update.
    Moments far from zero (a gradient of mean 1) make any rounding of the decay rates themselves show."""
    params, grads = _grads_and_params()
    grads = [jax.tree.map(lambda g: 1.0 + 300 * g, gs) for gs in grads * 2]   # 8 updates
    ours, plain = scale_by_adam(0.9, 0.95, "bfloat16"), optax.scale_by_adam(0.9, 0.95)
    rounded = lambda m: m.astype(jnp.bfloat16).astype(jnp.float32)   # noqa: E731
    state, ref = ours.init(params), plain.init(params)
    for g in grads:
        updates, state = ours.update(g, state, params)
        ref_updates, ref = plain.update(g, ref, params)
        ref = ref._replace(mu=jax.tree.map(rounded, ref.mu), nu=jax.tree.map(rounded, ref.nu))
        jax.tree.map(np.testing.assert_array_equal, updates, ref_updates)
    for stored, want in zip(jax.tree.leaves((state.mu, state.nu)), jax.tree.leaves((ref.mu, ref.nu))):
        assert stored.dtype == jnp.bfloat16
        np.testing.assert_array_equal(stored.astype(jnp.float32), want)


def test_bfloat16_moments_follow_the_float32_run():
    f32 = default_config("tiny_cpu", **{"train.warmup_steps": 1}).train
    bf16 = default_config("tiny_cpu", **{"train.warmup_steps": 1, "train.adam_moments_dtype": "bfloat16"}).train
    params, grads = _grads_and_params()
    (p32, _), (p16, state16) = _run(make_optimizer(f32), params, grads), _run(make_optimizer(bf16), params, grads)
    assert {x.dtype for x in jax.tree.leaves((state16[0].mu, state16[0].nu))} == {jnp.dtype(jnp.bfloat16)}
    for a, b, p in zip(jax.tree.leaves(p16), jax.tree.leaves(p32), jax.tree.leaves(params)):
        assert a.dtype == jnp.float32
        moved = np.abs(np.asarray(b) - np.asarray(p)).max()
        assert moved > 0 and np.abs(np.asarray(a) - np.asarray(b)).max() < 0.02 * moved   # within bf16 rounding


@pytest.mark.parametrize("key", ["b1", "b2"])
def test_bfloat16_moments_refuse_decays_finer_than_bfloat16(key):
    with pytest.raises(ConfigError, match=rf"config.train.{key}=0.999 is out of range.*adam_moments_dtype='float32'"):
        default_config("tiny_cpu", **{f"train.{key}": 0.999, "train.adam_moments_dtype": "bfloat16"})
    default_config("tiny_cpu", **{f"train.{key}": 0.99, "train.adam_moments_dtype": "bfloat16"})
