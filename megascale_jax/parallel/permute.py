"""Row permutations for token dispatch whose backward is a gather, not a scatter.

Autodiff of `x[idx]` is a scatter-add into a zero-filled buffer, because the compiler cannot know that `idx`
is a permutation; on the GPU those scatter fusions cost ~9 ms of a 350 ms Mixtral-shaped step (profile of
mixtral_small, 8 x 4096 tokens, one H200). Knowing the index structure, the transpose is a gather:

    permute_rows(x_RD, perm_R)                 y[r] = x[perm[r]]          dx = dy[inverse(perm)]
    repeat_rows_sorted(x_TD, order_A, top_k)   y[m] = x[order[m] // K]    dx[t] = sum_k dy[inverse(order)[t*K + k]]
    gather_weighted_sum(y_RD, rows_A, ...)     out[t] = sum_k w[t, k] * y[rows[t*K + k]]   (the combine)
    kept_weighted_sum(y_AD, kept_A, w)         the same for rows in assignment order (the all_to_all combine)

(order_A a permutation of the T*K assignments, as dispatch sorts them). Plain twins: `x[perm]`, `x[order // K]`
and `permute_rows` + the weighted sum, under autodiff (tests/parallel/test_permute.py compares values and
gradients).

The last three take `pallas` (kernels.permute, resolved by `resolve_permute`): their forward and backward row moves
run as the Pallas kernels of pallas_kernels/row_gather.py instead of XLA gathers; the XLA bodies here are their
twins (tests/kernels/test_row_gather.py).
"""
from __future__ import annotations

import functools
from enum import StrEnum

import jax
import jax.numpy as jnp
from pallas_kernels.varying import match_varying, per_device_refusal


class PermuteImpl(StrEnum):
    XLA = "xla"         # the gathers below as XLA ops, any backend
    PALLAS = "pallas"   # pallas_kernels/row_gather.py (GPU, per device)
    AUTO = "auto"       # resolved at build time (`resolve_permute`)


def resolve_permute(choice: str, *, backend: str, partitioned_by_xla: bool) -> str:
    """`auto` -> 'xla' everywhere: on an H200 the kernels were no faster than XLA's gathers in the step
    (benchmarks/results/train_step_row_kernels_1xh200.json), so they are never chosen for you.
    'pallas' off the GPU or under the XLA plan on several devices (a per-device kernel would be gathered whole) is
    an error."""
    if choice == PermuteImpl.AUTO:
        return PermuteImpl.XLA.value
    where = per_device_refusal(backend=backend, partitioned_by_xla=partitioned_by_xla)
    if choice == PermuteImpl.PALLAS and where:
        raise ValueError(f"config.kernels.permute='pallas' is a per-device GPU kernel and this run has {where}; "
                         f"use 'xla' or 'auto'")
    return PermuteImpl(choice).value


def _row_kernels():
    from pallas_kernels import row_gather   # GPU kernels: imported where used
    return row_gather


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def repeat_rows_sorted(x_TD, order_A, top_k: int, pallas: bool = False):
    """x[order // top_k]: each token's row once per assignment, in the sorted assignment order."""
    return _repeat_fwd(x_TD, order_A, top_k, pallas)[0]


def _repeat_fwd(x_TD, order_A, top_k, pallas):
    if pallas:
        return _row_kernels().gather_rows_sum(x_TD, (order_A // top_k)[:, None]), order_A
    return x_TD[order_A // top_k], order_A


def _repeat_bwd(top_k, pallas, order_A, g_AD):
    rows_TK = inverse_permutation(order_A).reshape(-1, top_k)
    if pallas:
        return _row_kernels().gather_rows_sum(g_AD, rows_TK), None
    g_TKD = g_AD[rows_TK]
    return jnp.sum(g_TKD.astype(jnp.float32), axis=1).astype(g_AD.dtype), None


repeat_rows_sorted.defvjp(_repeat_fwd, _repeat_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def gather_weighted_sum(y_RD, rows_A, assignment_R, kept_A, weight_TK, pallas: bool = False):
    """out[t] = sum_k weight[t, k] * y[rows[t*K + k]] over the kept assignments (a dropped one adds 0, whatever
    its row holds), in float32: the combine of a sorted expert buffer. `rows_A` (row of each assignment) and
    `assignment_R` (assignment in each row) are inverse permutations.

    Why not autodiff of `permute_rows` + the sum: for its backward it keeps the gathered rows, their mask and their
    float32 copy ([A, D] each); here the forward gathers inside the sum and keeps only y itself, and the backward
    gathers again for the weights' gradient. Measured: time unchanged (deepseekmoe_small on an H100, the
    combine's kernels 1.68 vs 1.69 ms a step), the step's temporary memory 36 MB (2.3%) smaller in a CPU compile of a
    small top-6 config (benchmarks/results/train_step_swiglu_kernel_bwd_1xh100.json)."""
    return _gather_weighted_sum(y_RD, rows_A, kept_A, weight_TK, pallas)


def _rows_or_identity(rows_A, kept_A):
    """y's row of each assignment; None (y already in assignment order): 0, 1, ..."""
    return jnp.arange(kept_A.shape[0], dtype=jnp.int32) if rows_A is None else rows_A


def _gathered_kept(y_RD, rows_A, kept_A, top_k):
    """y's row of each assignment (rows_A None: y is in assignment order), 0 where dropped, float32 [T, K, D]."""
    y_AD = jnp.where(kept_A[:, None], y_RD if rows_A is None else y_RD[rows_A], 0).astype(jnp.float32)
    return y_AD.reshape(-1, top_k, y_RD.shape[-1])


def _gather_weighted_sum(y_RD, rows_A, kept_A, weight_TK, pallas=False):
    if pallas:
        idx_TK = jnp.where(kept_A, _rows_or_identity(rows_A, kept_A), -1).reshape(weight_TK.shape)
        return _row_kernels().gather_rows_sum(y_RD, idx_TK, weight_TK.astype(jnp.float32), jnp.float32)
    y_TKD = _gathered_kept(y_RD, rows_A, kept_A, weight_TK.shape[1])
    return jnp.einsum("tkd,tk->td", y_TKD, weight_TK.astype(jnp.float32))


def _gws_fwd(y_RD, rows_A, assignment_R, kept_A, weight_TK, pallas):
    return (_gather_weighted_sum(y_RD, rows_A, kept_A, weight_TK, pallas),
            (y_RD, rows_A, assignment_R, kept_A, weight_TK))


def _gws_bwd(pallas, residuals, g_TD):
    y_RD, rows_A, assignment_R, kept_A, weight_TK = residuals
    top_k = weight_TK.shape[1]
    g_TD = g_TD.astype(jnp.float32)
    if pallas:   # one pass per token: its K rows' dots with g (the weights' gradient) and their cotangents
        w_TK = jnp.where(kept_A, weight_TK.reshape(-1).astype(jnp.float32), 0).reshape(weight_TK.shape)
        d_y, d_weight = _row_kernels().combine_backward(y_RD, _rows_or_identity(rows_A, kept_A).reshape(w_TK.shape),
                                                        w_TK, g_TD)
        d_weight = jnp.where(kept_A.reshape(weight_TK.shape), d_weight, 0)   # a dropped row's dot is junk
        return (match_varying(d_y, y_RD, g_TD, weight_TK), None, None, None,
                match_varying(d_weight.astype(weight_TK.dtype), weight_TK, g_TD, y_RD))
    d_weight = jnp.einsum("tkd,td->tk", _gathered_kept(y_RD, rows_A, kept_A, top_k), g_TD)
    # row r held assignment a = assignment[r] of token a // K: its cotangent is weight[a] * g[a // K] (0 if dropped)
    w_A = jnp.where(kept_A, weight_TK.reshape(-1).astype(jnp.float32), 0)
    if assignment_R is None:   # y in assignment order
        d_y = (w_A[:, None] * jnp.repeat(g_TD, top_k, axis=0)).astype(y_RD.dtype)
    else:
        d_y = (w_A[assignment_R][:, None] * g_TD[assignment_R // top_k]).astype(y_RD.dtype)
    return (match_varying(d_y, y_RD, g_TD, weight_TK), None, None, None,
            match_varying(d_weight.astype(weight_TK.dtype), weight_TK, g_TD, y_RD))


gather_weighted_sum.defvjp(_gws_fwd, _gws_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def kept_weighted_sum(y_AD, kept_A, weight_TK, pallas: bool = False):
    """`gather_weighted_sum` for rows already in assignment order (the all_to_all combine's returned rows): the same
    sum; its backward keeps y in its own dtype where autodiff of the plain twin (token_routes.weighted_sum_over_k)
    keeps the masked rows and their float32 copy, [T*K, D] each, until the backward. A CPU compile of the manual
    SP+EP step (8 devices, intra 4, all_to_all dispatch, top-6, hidden 256): 86.7 vs 89.0 MB of temporaries."""
    return _gather_weighted_sum(y_AD, None, kept_A, weight_TK, pallas)


def _kws_fwd(y_AD, kept_A, weight_TK, pallas):
    return _gather_weighted_sum(y_AD, None, kept_A, weight_TK, pallas), (y_AD, kept_A, weight_TK)


def _kws_bwd(pallas, residuals, g_TD):
    y_AD, kept_A, weight_TK = residuals
    d_y, _, _, _, d_weight = _gws_bwd(pallas, (y_AD, None, None, kept_A, weight_TK), g_TD)
    return d_y, None, d_weight


kept_weighted_sum.defvjp(_kws_fwd, _kws_bwd)
