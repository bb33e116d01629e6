"""model/layers.py's fast paths against their plain twins."""
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax.sharding import PartitionSpec as P

from megascale_jax.model.layers import cross_entropy, rms_norm, swiglu_activation


def test_cross_entropy_equals_optax_values_and_gradients():
    """The one-hot-mask target logit against optax's integer-label cross-entropy (take_along_axis), and its
    backward: elementwise (no scatter), so XLA can fuse the logits gradient with the cast."""
    kl, kt = jax.random.split(jax.random.key(0))
    logits = 4 * jax.random.normal(kl, (2, 16, 96), jnp.float32)
    targets = jax.random.randint(kt, (2, 16), 0, 96)

    def plain(x):
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(x, targets))

    ours, d_ours = jax.value_and_grad(lambda x: cross_entropy(x, targets))(logits)
    want, d_want = jax.value_and_grad(plain)(logits)
    np.testing.assert_allclose(ours, want, rtol=1e-6)
    np.testing.assert_allclose(d_ours, d_want, rtol=1e-5, atol=1e-8)
    backward = str(jax.make_jaxpr(jax.grad(lambda x: cross_entropy(x, targets)))(logits))
    assert "scatter" not in backward
    # bf16 logits (the GEMM's output dtype): the gradient comes back in bf16, the f32 gradient at those inputs
    # rounded once (|d| <= 1/32 here, bf16's step there is 1.2e-4)
    x16 = logits.astype(jnp.bfloat16)
    d_bf16 = jax.grad(lambda x: cross_entropy(x, targets))(x16)
    assert d_bf16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(d_bf16, np.float32), jax.grad(plain)(x16.astype(jnp.float32)), atol=2e-4)


def test_cross_entropy_of_a_target_outside_the_vocabulary_is_nan():
    """Not a silent zero: the step's non-finite check relies on it (tests/test_robustness.py)."""
    logits = jnp.zeros((1, 3, 8), jnp.float32)
    for bad in (8, -1):
        assert np.isnan(float(cross_entropy(logits, jnp.array([[0, bad, 2]]))))
    assert np.isfinite(float(cross_entropy(logits, jnp.array([[0, 7, 2]]))))


def _plain_rms_norm(x, scale, eps):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
            * scale.astype(jnp.float32)).astype(x.dtype)


def _plain_swiglu(gate, up):
    return jax.nn.silu(gate) * up


def _ulp_bf16(x):
    """bfloat16's spacing at |x| (8 significand bits), for the one-rounding bounds below."""
    return 2.0 ** (np.floor(np.log2(np.maximum(np.abs(np.asarray(x, np.float64)), 1e-30))) - 7)


def _inputs(shape, *scales, seed=0):
    keys = jax.random.split(jax.random.key(seed), len(scales))
    return [s * jax.random.normal(k, shape, jnp.float32) for k, s in zip(keys, scales)]


def test_rms_norm_backward_equals_autodiff():
    """The hand-written backward against autodiff of the same forward: float32 to rounding; with bfloat16
    activations (the model's), each gradient within one bfloat16 rounding of the float32 autodiff at the
    same inputs (the backward computes in float32 and rounds once)."""
    x, dy = _inputs((2, 8, 64), 3.0, 1.0)
    scale = 1.0 + 0.1 * jax.random.normal(jax.random.key(7), (64,), jnp.float32)
    for eps in (1e-6, 0.5):
        y, pull = jax.vjp(lambda a, s: rms_norm(a, s, eps), x, scale)
        y_plain, pull_plain = jax.vjp(lambda a, s: _plain_rms_norm(a, s, eps), x, scale)
        np.testing.assert_array_equal(y, y_plain)
        for got, want in zip(pull(dy), pull_plain(dy)):
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    x16, dy16 = x.astype(jnp.bfloat16), dy.astype(jnp.bfloat16)
    dx16, dscale16 = jax.vjp(lambda a, s: rms_norm(a, s, 1e-6), x16, scale)[1](dy16)
    dx32, dscale32 = jax.vjp(lambda a, s: _plain_rms_norm(a, s, 1e-6), x16.astype(jnp.float32), scale)[1](
        dy16.astype(jnp.float32))
    assert dx16.dtype == jnp.bfloat16 and dscale16.dtype == jnp.float32
    err = np.abs(np.asarray(dx16, np.float64) - np.asarray(dx32, np.float64))
    assert np.all(err <= _ulp_bf16(dx32) + 1e-6), err.max()
    np.testing.assert_allclose(dscale16, dscale32, rtol=1e-5, atol=1e-5)


def test_swiglu_activation_backward_equals_autodiff():
    """As above for silu(gate) * up: float32 to rounding, bfloat16 cotangents within one rounding of the
    float32 autodiff (autodiff in bfloat16 rounds at every step and misses that bound)."""
    gate, up, dh = _inputs((4, 256), 4.0, 2.0, 1.0, seed=1)
    h, pull = jax.vjp(swiglu_activation, gate, up)
    h_plain, pull_plain = jax.vjp(_plain_swiglu, gate, up)
    np.testing.assert_array_equal(h, h_plain)
    for got, want in zip(pull(dh), pull_plain(dh)):
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)
    args16 = [a.astype(jnp.bfloat16) for a in (gate, up, dh)]
    h16, pull16 = jax.vjp(swiglu_activation, *args16[:2])
    np.testing.assert_array_equal(h16, _plain_swiglu(*args16[:2]))
    want32 = jax.vjp(_plain_swiglu, *[a.astype(jnp.float32) for a in args16[:2]])[1](args16[2].astype(jnp.float32))
    for got, want in zip(pull16(args16[2]), want32):
        assert got.dtype == jnp.bfloat16
        err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
        assert np.all(err <= _ulp_bf16(want) + 1e-30), err.max()


def test_hand_written_backwards_inside_shard_map_equal_one_device():
    """Under shard_map with rows split over 8 devices and the norm scale replicated, the scale's cotangent is
    the sum over the devices (match_varying), so both gradients equal the one-device ones."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    x, gate, up = _inputs((16, 32), 2.0, 3.0, 1.5, seed=2)
    scale = 1.0 + 0.1 * jax.random.normal(jax.random.key(3), (32,), jnp.float32)

    def loss(x, scale, gate, up):
        return jnp.sum(jnp.sin(rms_norm(x, scale, 1e-6)) * swiglu_activation(gate, up))

    def local(x, scale, gate, up):
        return jax.lax.psum(loss(x, scale, gate, up), "d")

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P("d"), P(), P("d"), P("d")), out_specs=P())
    got = jax.grad(sharded, argnums=(0, 1, 2, 3))(x, scale, gate, up)
    want = jax.grad(loss, argnums=(0, 1, 2, 3))(x, scale, gate, up)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
