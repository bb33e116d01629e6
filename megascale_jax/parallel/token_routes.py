"""Where each routed row goes and how it comes back: a dispatch split into its integer plan and linear moves.

A dispatch does two different things. From the routing alone it decides where every (token, k) assignment
goes (sorts, counts, the per-expert count exchange): the *plan*, integers, computed once. Then it moves rows
along that plan: gathers, one payload collective, a permutation. The moves are linear in the rows, so
their transposes are moves too, and a hand-written backward (the macro layer, parallel/overlap.py) can
send gradients along a plan without recomputing it and put each collective where it likes.

    plan_local / plan_all_to_all / plan_all_gather(expert_idx_TK, ...) -> *Plan  (a pytree of int arrays)
    send(x_TD, plan)            tokens -> rows sorted by (local) expert        x_MD
    send_transpose(dx_MD, plan) rows -> tokens, summed over k in fp32          dx_TD
    combine(y_MD, plan, w_TK)   rows -> tokens, weighted sum over k in fp32    y_TD
    assignments_to_rows(s_A, plan) / rows_to_assignments(s_M, plan)            per-assignment scalars (fp32)

A = T*K assignments, token-major (a = t*K + k); M rows of the sorted buffer. `exchange` is the payload
all-to-all (collectives.exchange_tokens, or the fp8 one); scalars always travel in fp32. Rows past
sum(group_sizes) are padding: zeros going in, ignored coming back. parallel/expert_parallel.py's
dispatch_* / combine_* are `plan + send` and `combine`, so the autodiff path and the macro layer share
one implementation of the bookkeeping.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from megascale_jax.parallel import collectives
from megascale_jax.parallel.permute import (gather_weighted_sum, inverse_permutation, kept_weighted_sum, permute_rows,
                                           repeat_rows_sorted)


# ----------------------------------------------------------------------------------------------------------
# Bookkeeping shared by the plans
# ----------------------------------------------------------------------------------------------------------
def sentinel_invalid(expert_A, num_experts):
    """Expert ids outside [0, E) become E, which sorts last, matches no rank, and is counted as dropped."""
    valid = (expert_A >= 0) & (expert_A < num_experts)
    return jnp.where(valid, expert_A, num_experts).astype(jnp.int32)


def clip_cumulative(counts_NG, capacity):
    """Per row, keep the first `capacity` rows in group order: counts of what survives, per group."""
    kept_cum = jnp.minimum(jnp.cumsum(counts_NG, axis=-1), capacity)
    return jnp.diff(kept_cum, axis=-1, prepend=0)


def _exclusive_cumsum(counts):
    return jnp.cumsum(counts) - counts


def sort_assignments(expert_idx_TK, num_experts: int):
    """The one argsort of routed assignments: (expert_A with invalid ids as E, order_A, counts_E).

    order_A lists the assignments by expert, token order kept inside an expert (stable), invalid ids last;
    counts_E counts the valid ones per expert."""
    expert_A = sentinel_invalid(expert_idx_TK.reshape(-1), num_experts)
    order_A = jnp.argsort(expert_A, stable=True)
    counts_E = jnp.bincount(expert_A, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    return expert_A, order_A, counts_E


def weighted_sum_over_k(y_AD, kept_A, weight_TK):
    """The combine's arithmetic: y_TD = sum_k weight[t, k] * y[t*K + k], in fp32; rows not kept contribute 0. The
    plain twin of permute.kept_weighted_sum and (after permute_rows) permute.gather_weighted_sum, which the combines
    run (the same values, smaller residuals)."""
    num_tokens, top_k = weight_TK.shape
    y_TKD = jnp.where(kept_A[:, None], y_AD, 0).reshape(num_tokens, top_k, -1)
    return jnp.einsum("tkd,tk->td", y_TKD.astype(jnp.float32), weight_TK.astype(jnp.float32))


def _sum_over_k(dx_AD, kept_A, num_tokens: int, dtype):
    dx_TKD = jnp.where(kept_A[:, None], dx_AD, 0).reshape(num_tokens, -1, dx_AD.shape[-1])
    return jnp.sum(dx_TKD.astype(jnp.float32), axis=1).astype(dtype)


# ----------------------------------------------------------------------------------------------------------
# n = 1: the local sort
# ----------------------------------------------------------------------------------------------------------
class LocalPlan(NamedTuple):
    order_A: jax.Array          # assignment of each sorted row
    kept_A: jax.Array           # assignment a is computed (valid id, within capacity)
    group_sizes: jax.Array      # rows per expert
    dropped_tokens: jax.Array
    tokens_per_expert: jax.Array


def plan_local(expert_idx_TK, *, num_experts: int, capacity: int | None = None, groups: int = 1) -> LocalPlan:
    """capacity: each of `groups` equal, contiguous blocks of tokens keeps only its first `capacity` rows in
    expert order (the all_to_all dispatch at n = 1); groups > 1 is the global view of a batch split over
    data-parallel devices. None is dropless."""
    expert_A, order_A, counts_E = sort_assignments(expert_idx_TK, num_experts)
    kept_A = expert_A < num_experts
    if capacity is not None:
        rows = expert_A.shape[0] // groups
        group_A = jnp.arange(expert_A.shape[0], dtype=jnp.int32) // rows
        # Rank of each assignment among its block's, in expert order; the first `capacity` stay.
        rank_A = inverse_permutation(jnp.argsort(group_A * (num_experts + 1) + expert_A, stable=True))
        kept_A = kept_A & (rank_A - group_A * rows < capacity)
        order_A = jnp.argsort(jnp.where(kept_A, expert_A, num_experts), stable=True)   # dropped rows last
    kept_E = jnp.bincount(jnp.where(kept_A, expert_A, num_experts), length=num_experts + 1)[:num_experts]
    dropped = (expert_A.shape[0] - kept_E.sum()).astype(jnp.int32)
    return LocalPlan(order_A, kept_A, kept_E.astype(jnp.int32), dropped, counts_E)


def send_local(x_TD, plan: LocalPlan, pallas: bool = False):
    """x_MD: each token's row once per assignment, in expert order (rows past the kept ones are junk). `pallas`:
    the row moves as Pallas kernels (kernels.permute; parallel/permute.py)."""
    return repeat_rows_sorted(x_TD, plan.order_A, plan.order_A.shape[0] // x_TD.shape[0], pallas)


def send_local_transpose(dx_MD, plan: LocalPlan, num_tokens: int):
    return _sum_over_k(dx_MD[inverse_permutation(plan.order_A)], plan.kept_A, num_tokens, dx_MD.dtype)


def combine_local(y_MD, plan: LocalPlan, weight_TK, pallas: bool = False):
    """Each assignment's row gathered back (the inverse permutation: a gather, not a scatter) inside the
    weighted sum over k; y's dtype. Twin: `permute_rows` + `weighted_sum_over_k` (tests/parallel/test_permute.py)."""
    rows_A = inverse_permutation(plan.order_A)
    return gather_weighted_sum(y_MD, rows_A, plan.order_A, plan.kept_A, weight_TK, pallas).astype(y_MD.dtype)


def assignments_to_rows_local(s_A, plan: LocalPlan):
    return s_A.astype(jnp.float32)[plan.order_A]


def rows_to_assignments_local(s_M, plan: LocalPlan):
    return jnp.where(plan.kept_A, s_M.astype(jnp.float32)[inverse_permutation(plan.order_A)], 0)


# ----------------------------------------------------------------------------------------------------------
# all_to_all: fixed [n, C] buffers per destination rank
# ----------------------------------------------------------------------------------------------------------
class AllToAllPlan(NamedTuple):
    assign_NC: jax.Array        # the assignment in each send slot (meaningful where send_valid_NC)
    send_valid_NC: jax.Array    # send slot holds a row (not padding)
    perm_R: jax.Array           # received row -> sorted row order (by local expert, then source rank)
    valid_R: jax.Array          # received row holds a token (not padding)
    slot_A: jax.Array           # where assignment a sits in the [n*C] send (and returned) buffer
    kept_A: jax.Array           # assignment a was sent (not dropped)
    group_sizes: jax.Array      # rows per local expert, over all sources
    dropped_tokens: jax.Array
    tokens_per_expert: jax.Array


def plan_all_to_all(expert_idx_TK, *, axis, num_experts: int, capacity: int) -> AllToAllPlan:
    """The sender orders its (token, k) rows per destination rank by expert; each destination buffer keeps
    its first `capacity` rows. One small all-to-all tells each receiver its per-(source, expert) counts."""
    n = lax.axis_size(axis)
    num_local = num_experts // n
    # Sorting by global expert groups rows by destination rank, then by local expert, tokens in order.
    expert_A, order_A, counts_E = sort_assignments(expert_idx_TK, num_experts)
    counts_NG = counts_E.reshape(n, num_local)
    kept_NG = clip_cumulative(counts_NG, capacity)
    kept_N = kept_NG.sum(axis=1)
    dest_start_N = _exclusive_cumsum(counts_NG.sum(axis=1))

    slot_C = jnp.arange(capacity)
    send_valid_NC = slot_C[None, :] < kept_N[:, None]
    sorted_pos_NC = jnp.minimum(dest_start_N[:, None] + slot_C[None, :], order_A.shape[0] - 1)
    recv_counts_NG = collectives.exchange_counts(kept_NG, axis)
    perm_R, valid_R, group_sizes_G = _receiver_order(recv_counts_NG, capacity)

    dest_A = expert_A // num_local  # n for invalid ids
    pos_A = inverse_permutation(order_A) - dest_start_N[jnp.minimum(dest_A, n - 1)]
    kept_A = (dest_A < n) & (pos_A < capacity)
    slot_A = jnp.where(kept_A, dest_A * capacity + pos_A, 0)
    return AllToAllPlan(order_A[sorted_pos_NC], send_valid_NC, perm_R, valid_R, slot_A, kept_A, group_sizes_G,
                        (expert_A.shape[0] - kept_N.sum()).astype(jnp.int32), collectives.sum_over(counts_E, axis))


def _receiver_order(recv_counts_NG, capacity: int):
    """Block s of the received [n, C] buffer holds, in its first sum(recv_counts_NG[s]) rows, source s's
    rows for local experts 0..G-1 in order; the rest is padding. Returns the permutation that sorts rows by
    (local expert, source), which rows are real, and the group sizes."""
    n, num_local = recv_counts_NG.shape
    ends_NG = jnp.cumsum(recv_counts_NG, axis=1)
    slot_C = jnp.arange(capacity, dtype=ends_NG.dtype)
    expert_NC = jax.vmap(lambda ends_G: jnp.searchsorted(ends_G, slot_C, side="right"))(ends_NG)  # G = padding
    sort_key_R = (expert_NC * n + jnp.arange(n)[:, None]).reshape(-1)
    perm_R = jnp.argsort(sort_key_R, stable=True)
    return perm_R, (expert_NC < num_local).reshape(-1), recv_counts_NG.sum(axis=0).astype(jnp.int32)


def _send_rows_all_to_all(rows_XD, index_NC, plan: AllToAllPlan, axis, exchange):
    n, capacity = plan.send_valid_NC.shape
    send_NCD = jnp.where(plan.send_valid_NC[..., None], rows_XD[index_NC], 0).astype(rows_XD.dtype)
    return permute_rows(exchange(send_NCD, axis).reshape(n * capacity, -1), plan.perm_R)


def _return_rows_all_to_all(y_RD, plan: AllToAllPlan, axis, exchange):
    """Sorted rows back to the slots they were sent from: [A, D] per assignment (unkept rows junk)."""
    n, capacity = plan.send_valid_NC.shape
    y_recv_RD = jnp.where(plan.valid_R[:, None], permute_rows(y_RD, inverse_permutation(plan.perm_R)), 0)
    y_back_NCD = exchange(y_recv_RD.astype(y_RD.dtype).reshape(n, capacity, -1), axis)
    return y_back_NCD.reshape(n * capacity, -1)[plan.slot_A]


def send_all_to_all(x_TD, plan: AllToAllPlan, *, axis, exchange=collectives.exchange_tokens):
    """x_RD, R = n*C rows sorted by local expert, then source rank; padding rows are zeros."""
    top_k = plan.slot_A.shape[0] // x_TD.shape[0]
    return _send_rows_all_to_all(x_TD, plan.assign_NC // top_k, plan, axis, exchange)


def send_all_to_all_transpose(dx_RD, plan: AllToAllPlan, num_tokens: int, *, axis,
                              exchange=collectives.exchange_tokens):
    """Transpose of `send_all_to_all`: each row's gradient goes back to the slot it came from (the mirror
    all-to-all) and every token sums its k rows in fp32: a gather, no scatter."""
    dx_AD = _return_rows_all_to_all(dx_RD, plan, axis, exchange)
    return _sum_over_k(dx_AD, plan.kept_A, num_tokens, dx_RD.dtype)


def combine_all_to_all(y_RD, plan: AllToAllPlan, weight_TK, *, axis, exchange=collectives.exchange_tokens,
                       pallas: bool = False):
    """Rows back to their source ranks (the mirror all_to_all), then the sender's weighted sum over k."""
    y_AD = _return_rows_all_to_all(y_RD, plan, axis, exchange)
    return kept_weighted_sum(y_AD, plan.kept_A, weight_TK, pallas).astype(y_RD.dtype)   # twin: weighted_sum_over_k


def assignments_to_rows_all_to_all(s_A, plan: AllToAllPlan, *, axis):
    """A per-assignment scalar (e.g. its routing weight) to the row that computes it: [R] fp32."""
    s_A1 = s_A.astype(jnp.float32)[:, None]
    return _send_rows_all_to_all(s_A1, plan.assign_NC, plan, axis, collectives.exchange_tokens)[:, 0]


def rows_to_assignments_all_to_all(s_R, plan: AllToAllPlan, *, axis):
    """A per-row scalar back to its assignment: [A] fp32, zero where the assignment was dropped."""
    s_A1 = _return_rows_all_to_all(s_R.astype(jnp.float32)[:, None], plan, axis, collectives.exchange_tokens)
    return jnp.where(plan.kept_A, s_A1[:, 0], 0)


# ----------------------------------------------------------------------------------------------------------
# all_gather: every rank sees every token, keeps the rows of its own experts
# ----------------------------------------------------------------------------------------------------------
class AllGatherPlan(NamedTuple):
    row_M: jax.Array            # gathered assignment (rank-major, a = t*K + k over n*T tokens) of each row
    token_M: jax.Array          # its gathered token, row_M // K
    valid_M: jax.Array          # sorted row is real (not past the group sizes)
    group_sizes: jax.Array
    dropped_tokens: jax.Array
    tokens_per_expert: jax.Array


def plan_all_gather(expert_idx_TK, *, axis, num_experts: int) -> AllGatherPlan:
    """All-gather the routing, keep the rows routed to this rank's experts, sorted by expert (stably, so
    source order is kept)."""
    num_tokens, top_k = expert_idx_TK.shape
    n = lax.axis_size(axis)
    num_local = num_experts // n
    expert_all_A = sentinel_invalid(collectives.gather_tokens(expert_idx_TK, axis).reshape(-1), num_experts)
    local_A = expert_all_A - lax.axis_index(axis) * num_local
    is_local_A = (local_A >= 0) & (local_A < num_local)
    key_A = jnp.where(is_local_A, local_A, num_local)
    order_A = jnp.argsort(key_A, stable=True)  # local rows first, by expert, source order kept
    counts_G = jnp.bincount(key_A, length=num_local + 1)[:num_local].astype(jnp.int32)
    max_rows = n * num_tokens * min(top_k, num_local)
    group_sizes_G = clip_cumulative(counts_G, max_rows)
    row_M = order_A[:max_rows]
    valid_M = jnp.arange(max_rows) < group_sizes_G.sum()
    own_expert_A = sentinel_invalid(expert_idx_TK.reshape(-1), num_experts)
    dropped = (counts_G.sum() - group_sizes_G.sum() + jnp.sum(own_expert_A == num_experts)).astype(jnp.int32)
    tokens_per_expert = jnp.bincount(expert_all_A, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    return AllGatherPlan(row_M, row_M // top_k, valid_M, group_sizes_G, dropped, tokens_per_expert)


def send_all_gather(x_TD, plan: AllGatherPlan, *, axis):
    """x_MD: the all-gathered tokens' rows for this rank's experts, sorted by expert; padding rows zeros."""
    x_all_RD = collectives.gather_tokens(x_TD, axis)  # n*T tokens, rank-major
    return jnp.where(plan.valid_M[:, None], x_all_RD[plan.token_M], 0).astype(x_TD.dtype)


def send_all_gather_transpose(dx_MD, plan: AllGatherPlan, num_tokens: int, *, axis):
    """Transpose of `send_all_gather`: rows summed per gathered token in fp32, reduce-scattered to owners."""
    n = lax.axis_size(axis)
    dx_all_RD = jnp.zeros((n * num_tokens, dx_MD.shape[-1]), jnp.float32).at[plan.token_M].add(
        jnp.where(plan.valid_M[:, None], dx_MD.astype(jnp.float32), 0))
    return collectives.scatter_sum_tokens(dx_all_RD.astype(dx_MD.dtype), axis)


def combine_all_gather(y_MD, plan: AllGatherPlan, weight_TK, *, axis):
    """Weight and sum the rows per gathered token into [n*T, D] in fp32, then reduce-scatter to [T, D]."""
    num_tokens = weight_TK.shape[0]
    n = lax.axis_size(axis)
    weight_all_A = collectives.gather_tokens(weight_TK, axis).reshape(-1)
    weight_M = jnp.where(plan.valid_M, weight_all_A[plan.row_M].astype(jnp.float32), 0)
    contrib_MD = jnp.where(plan.valid_M[:, None], y_MD.astype(jnp.float32) * weight_M[:, None], 0)
    y_all_RD = jnp.zeros((n * num_tokens, y_MD.shape[-1]), jnp.float32).at[plan.token_M].add(contrib_MD)
    # Cast before the reduce-scatter: the wire carries activation bytes, as the all_to_all path does.
    return collectives.scatter_sum_tokens(y_all_RD.astype(y_MD.dtype), axis)


def assignments_to_rows_all_gather(s_A, plan: AllGatherPlan, *, axis):
    s_all_A = collectives.gather_tokens(s_A.astype(jnp.float32), axis)
    return jnp.where(plan.valid_M, s_all_A[plan.row_M], 0)


def rows_to_assignments_all_gather(s_M, plan: AllGatherPlan, num_assignments: int, *, axis):
    """Per-row scalars to their assignments: placed in the gathered [n*A] layout, reduce-scattered (each
    assignment is computed on exactly one rank, so the sum is its value)."""
    n = lax.axis_size(axis)
    s_all_A = jnp.zeros((n * num_assignments,), jnp.float32).at[plan.row_M].add(
        jnp.where(plan.valid_M, s_M.astype(jnp.float32), 0))
    return collectives.scatter_sum_tokens(s_all_A, axis)
