"""model/layers.py's fast paths against their plain twins."""
import jax
import jax.numpy as jnp
import numpy as np
import optax

from megascale_jax.model.layers import cross_entropy


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


def test_dense_mlp_with_the_kernel_backward_equals_autodiff(monkeypatch):
    """DenseMLP(kernel_backward=True) (dense layers and shared experts under kernels.swiglu='separate_pallas_bwd'):
    the Pallas backward (interpret mode) is called and the output and every gradient equal autodiff's in bf16 (one
    rounding apart)."""
    from flax import nnx

    from megascale_jax.model.layers import DenseMLP
    from pallas_kernels import swiglu_backward as kernel

    compiled, calls = kernel.swiglu_backward, []

    def interpreted(*args, **kwargs):
        calls.append(args[0].shape)
        return compiled(*args, **{**kwargs, "interpret": True})
    monkeypatch.setattr(kernel, "swiglu_backward", interpreted)
    x = jax.random.normal(jax.random.key(0), (24, 32), jnp.float32).astype(jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(1), (24, 32), jnp.float32).astype(jnp.bfloat16)

    def run(kernel_backward):
        graphdef, params = nnx.split(DenseMLP(32, 40, jnp.float32, nnx.Rngs(2), kernel_backward=kernel_backward))
        y, pull = jax.vjp(lambda p, x: nnx.merge(graphdef, p)(x), params, x)
        return y, pull(dy)
    (y, grads), (y_want, grads_want) = run(True), run(False)
    assert calls == [(24, 40)]
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_want, np.float32))
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_want)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.abs(b).max() > 0 and np.abs(a - b).max() <= 2e-2 * np.abs(b).max()
