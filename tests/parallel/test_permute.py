"""The dispatch permutations with gather backwards equal their plain twins (autodiff of x[idx]): values and
gradients, including inside jit and for an uneven (expert-sorted) order."""
import jax
import jax.numpy as jnp
import numpy as np

from megascale_jax.parallel.permute import (gather_weighted_sum, inverse_permutation, kept_weighted_sum, permute_rows,
                                           repeat_rows_sorted)
from megascale_jax.parallel.token_routes import weighted_sum_over_k


def test_permute_rows_equals_indexing_with_its_gradient():
    x = jax.random.normal(jax.random.key(0), (12, 5))
    perm = jax.random.permutation(jax.random.key(1), 12)
    w = jax.random.normal(jax.random.key(2), (12, 5))
    loss = lambda f: lambda x: jnp.sum(w * f(x) ** 2)  # noqa: E731
    np.testing.assert_array_equal(permute_rows(x, perm), x[perm])
    got = jax.jit(jax.grad(loss(lambda x: permute_rows(x, perm))))(x)
    want = jax.grad(loss(lambda x: x[perm]))(x)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_array_equal(inverse_permutation(perm)[perm], np.arange(12))


def test_repeat_rows_sorted_equals_indexing_with_its_gradient():
    top_k, tokens = 3, 7
    idx = jax.random.randint(jax.random.key(3), (tokens, top_k), 0, 4)
    order = jnp.argsort(idx.reshape(-1), stable=True)     # as dispatch sorts assignments by expert
    x = jax.random.normal(jax.random.key(4), (tokens, 6), jnp.float32)
    w = jax.random.normal(jax.random.key(5), (tokens * top_k, 6))
    loss = lambda f: lambda x: jnp.sum(w * jnp.sin(f(x)))  # noqa: E731
    np.testing.assert_array_equal(repeat_rows_sorted(x, order, top_k), x[order // top_k])
    got = jax.jit(jax.grad(loss(lambda x: repeat_rows_sorted(x, order, top_k))))(x)
    want = jax.grad(loss(lambda x: x[order // top_k]))(x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(got).min()) > 0   # every token received its K rows' gradient


def test_the_combines_equal_permute_then_sum_with_their_gradients():
    """The combine with the gather inside the sum (and a hand-written backward) against autodiff of permute_rows
    + weighted_sum_over_k, and kept_weighted_sum (no gather) against weighted_sum_over_k: bf16 rows, float32 weights, dropped assignments whose rows hold NaN (the junk a dropless
    buffer's unwritten tail may hold) contributing nothing to the output or to any gradient."""
    top_k, tokens, d = 3, 9, 8
    idx = jax.random.randint(jax.random.key(6), (tokens, top_k), 0, 5)
    kept = jax.random.bernoulli(jax.random.key(7), 0.8, (tokens * top_k,))
    order = jnp.argsort(jnp.where(kept, idx.reshape(-1), 5), stable=True)   # dropped assignments last
    rows = inverse_permutation(order)
    y = jax.random.normal(jax.random.key(8), (tokens * top_k, d), jnp.float32)
    y = jnp.where(kept[order][:, None], y, jnp.nan).astype(jnp.bfloat16)   # junk in the dropped rows
    weight = jax.nn.softmax(jax.random.normal(jax.random.key(9), (tokens, top_k)), axis=-1)
    g = jax.random.normal(jax.random.key(10), (tokens, d), jnp.float32)

    def fused(y, weight):
        return gather_weighted_sum(y, rows, order, kept, weight)

    def twin(y, weight):
        return weighted_sum_over_k(permute_rows(y, rows), kept, weight)
    assert not bool(jnp.all(kept)) and bool(jnp.any(kept))
    _assert_same_values_and_grads(fused, twin, y, weight, g)
    # kept_weighted_sum: rows already in assignment order (the all_to_all combine); junk in the dropped ones
    y_A = permute_rows(y, rows)
    _assert_same_values_and_grads(lambda y, w: kept_weighted_sum(y, kept, w),
                                  lambda y, w: weighted_sum_over_k(y, kept, w), y_A, weight, g)


def _assert_same_values_and_grads(fused, twin, y, weight, g):
    out, pull = jax.vjp(jax.jit(fused), y, weight)
    out_want, pull_want = jax.vjp(twin, y, weight)
    np.testing.assert_allclose(out, out_want, rtol=1e-6, atol=1e-6)
    for got, want in zip(pull(g), pull_want(g)):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.all(np.isfinite(got)) and np.abs(want).max() > 0
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
