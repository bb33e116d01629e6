"""Row permutations for token dispatch whose backward is a gather, not a scatter.

Autodiff of `x[idx]` is a scatter-add into a zero-filled buffer, because the compiler cannot know that `idx`
is a permutation; on the GPU those scatter fusions cost ~9 ms of a 350 ms Mixtral-shaped step (profile of
mixtral_small, 8 x 4096 tokens, one H200). Knowing the index structure, the transpose is a gather:

    permute_rows(x_RD, perm_R)                 y[r] = x[perm[r]]          dx = dy[inverse(perm)]
    repeat_rows_sorted(x_TD, order_A, top_k)   y[m] = x[order[m] // K]    dx[t] = sum_k dy[inverse(order)[t*K + k]]

(order_A a permutation of the T*K assignments, as dispatch sorts them). Plain twins: `x[perm]` and
`x[order // K]` under autodiff (tests/parallel/test_permute.py compares values and gradients).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def inverse_permutation(perm_R):
    return jnp.zeros_like(perm_R).at[perm_R].set(jnp.arange(perm_R.shape[0], dtype=perm_R.dtype))


@jax.custom_vjp
def permute_rows(x_RD, perm_R):
    """x[perm] for a permutation `perm` of x's rows."""
    return x_RD[perm_R]


def _permute_fwd(x_RD, perm_R):
    return x_RD[perm_R], perm_R


def _permute_bwd(perm_R, g_RD):
    return g_RD[inverse_permutation(perm_R)], None


permute_rows.defvjp(_permute_fwd, _permute_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def repeat_rows_sorted(x_TD, order_A, top_k: int):
    """x[order // top_k]: each token's row once per assignment, in the sorted assignment order."""
    return x_TD[order_A // top_k]


def _repeat_fwd(x_TD, order_A, top_k):
    return x_TD[order_A // top_k], order_A


def _repeat_bwd(top_k, order_A, g_AD):
    g_TKD = g_AD[inverse_permutation(order_A)].reshape(-1, top_k, g_AD.shape[-1])
    return jnp.sum(g_TKD.astype(jnp.float32), axis=1).astype(g_AD.dtype), None


repeat_rows_sorted.defvjp(_repeat_fwd, _repeat_bwd)
