"""The dispatch permutations with gather backwards equal their plain twins (autodiff of x[idx]): values and
gradients, including inside jit and for an uneven (expert-sorted) order."""
import jax
import jax.numpy as jnp
import numpy as np

from megascale_jax.parallel.permute import inverse_permutation, permute_rows, repeat_rows_sorted


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
