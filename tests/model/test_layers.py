"""model/layers.py's fast paths against their plain twins."""
import jax
import jax.numpy as jnp
import numpy as np
import optax

from megascale_jax.model.layers import cross_entropy, token_cross_entropy


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


def _all_eqns(jaxpr):
    """Equations of a jaxpr and of the jaxprs inside its equations (a custom_vjp call's forward)."""
    for e in jaxpr.eqns:
        yield e
        for v in e.params.values():
            inner = getattr(v, "jaxpr", v)
            if hasattr(inner, "eqns"):
                yield from _all_eqns(inner)


def test_cross_entropy_forward_reads_the_logits_in_one_reduction():
    """One variadic reduce over V (max, scaled exp-sum, target logit), not logsumexp's max pass then sum pass."""
    logits, targets = jnp.zeros((2, 4, 32), jnp.bfloat16), jnp.zeros((2, 4), jnp.int32)
    eqns = list(_all_eqns(jax.make_jaxpr(token_cross_entropy)(logits, targets).jaxpr))
    reductions = [e for e in eqns if e.primitive.name.startswith("reduce")]
    assert [e.primitive.name for e in reductions] == ["reduce"], [e.primitive.name for e in eqns]
    assert len(reductions[0].invars) == 6 and reductions[0].params["dimensions"] == (2,)


def test_cross_entropy_per_token_matches_optax_at_extreme_logits():
    """Per token against optax where the running maximum meets -inf columns (masked vocabulary entries), a
    whole row at -inf but the target, huge logits, and bf16 inputs."""
    kl, kt = jax.random.split(jax.random.key(1))
    logits = 30 * jax.random.normal(kl, (3, 5, 200), jnp.float32)
    targets = jax.random.randint(kt, (3, 5), 0, 200)
    logits = logits.at[0, :, 100:].set(-jnp.inf)                     # masked tail: targets below 100 there
    targets = targets.at[0].set(targets[0] % 100)
    logits = logits.at[1, 2].set(-jnp.inf).at[1, 2, targets[1, 2]].set(5.0)
    logits = logits.at[2, 0].multiply(1e3)
    for x in (logits, logits.astype(jnp.bfloat16)):
        want = optax.softmax_cross_entropy_with_integer_labels(x.astype(jnp.float32), targets)
        np.testing.assert_allclose(token_cross_entropy(x, targets), want, rtol=2e-6, atol=2e-6)
    d = jax.grad(lambda x: jnp.sum(token_cross_entropy(x, targets)))(logits)
    d_want = jax.grad(lambda x: jnp.sum(optax.softmax_cross_entropy_with_integer_labels(x, targets)))(logits)
    np.testing.assert_allclose(d, d_want, rtol=1e-5, atol=1e-7)
    assert np.all(np.isfinite(np.asarray(d)))
