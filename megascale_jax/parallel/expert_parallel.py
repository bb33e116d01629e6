"""Token dispatch and combine for the MoE FFN: the local sort (n = 1) and expert parallelism over the n
ranks of one mesh axis (called inside a `jax.shard_map` body).

Each mode is a pair `dispatch_*(x_TD, expert_idx_TK, ...) -> (x_MD, group_sizes, residual)` and
`combine_*(y_MD, residual, weight_TK, ...) -> y_TD`, so the experts between them are the caller's (the MoE
layer's, with explicit weights; a fused kernel may take over the first or last GEMM). The dispatchers in
parallel/layouts.py wrap these pairs; `expert_parallel_ffn` composes one pair with an experts function.

Layout: rank r holds the G = E/n whole experts [r*G, (r+1)*G) and its own T tokens (sequence-sharded).
Two dispatch paths that compute the same thing (the test checks they agree with `moe_ffn_reference`):

- 'all_to_all': route locally, pack (token, k) rows per destination rank ordered by expert, exchange the
  per-(source, expert) counts, then the padded payload with `lax.all_to_all`; the receiver orders rows by
  expert, then by source rank (the paper's order), runs its experts, and sends the rows back the same way.
  The sender applies the routing weights and sums over k in fp32.
- 'all_gather': all-gather tokens and routing, pick the rows routed to local experts (sorted by expert,
  stably, so source order is kept), run the experts, weight and sum them per token into [n*T, D] in fp32,
  and reduce-scatter back to [T, D]. Better when top-k is large.

Buffers are static: dropless buffers hold the worst case of T * min(K, G) rows per destination, which is
exact when a token's K experts are distinct (as `lax.top_k` routing gives). Rows that do not fit (capacity
overflow, or repeated experts in one token beyond the bound) and expert ids outside [0, E) are dropped and
counted in stats['dropped_tokens'], never silently.

Bytes on the wire per rank: `expert_parallel_wire_bytes` (forward; the backward repeats the payload
collectives, transposed). The dropless all_to_all buffers carry n x the average traffic (padding);
capacity_factor trades that for counted drops.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from megascale_jax.parallel import collectives
from megascale_jax.parallel.permute import inverse_permutation, permute_rows, repeat_rows_sorted

DISPATCH_MODES = ("all_to_all", "all_gather")

LocalExpertsFn = Callable[[jax.Array, jax.Array], jax.Array]  # (x_MD, group_sizes_G) -> y_MD


def expert_parallel_ffn(x_TD, expert_idx_TK, weight_TK, local_experts_fn: LocalExpertsFn, *, axis,
                        num_experts: int, dispatch: str, capacity_factor: float | None = None):
    """MoE FFN with expert parallelism over `axis`; returns (y_TD, stats).

    x_TD [T, D]: this rank's tokens. expert_idx_TK [T, K] int: global expert ids. weight_TK [T, K]: routing
    weights (gradients flow to them). local_experts_fn(x_MD, group_sizes_G) -> y_MD runs this rank's G = E/n
    experts on rows sorted by local expert (jax.lax.ragged_dot layout; rows past sum(group_sizes) are
    padding and their outputs are ignored). y_TD [T, D] has x's dtype.
    capacity_factor (all_to_all only): c gives ceil(c*T*K/n) rows per destination; None is dropless. Each
        destination keeps its first rows in (expert, token, k) order, so its highest experts drop first.
    stats: 'dropped_tokens' int32 scalar, (token, k) rows dropped on this rank (0 when dropless): counted
               by the token's owner on the all_to_all path, by the expert's owner for all_gather overflow
               (ids outside [0, E) always by the owner);
           'tokens_per_expert' int32 [E], routed rows per expert summed over the axis (before any drop).
    Sharding: call inside shard_map with x_TD, expert_idx_TK, weight_TK sharded over `axis` on T and the
    expert weights captured by local_experts_fn sharded over `axis` on E.
    """
    n = lax.axis_size(axis)
    capacity = _validate(x_TD, expert_idx_TK, weight_TK, n, num_experts, dispatch, capacity_factor)
    if dispatch == "all_to_all":
        x_MD, group_sizes, residual = dispatch_all_to_all(x_TD, expert_idx_TK, axis=axis, num_experts=num_experts,
                                                          capacity=capacity)
        y_TD = combine_all_to_all(local_experts_fn(x_MD, group_sizes), residual, weight_TK, axis=axis)
    else:
        x_MD, group_sizes, residual = dispatch_all_gather(x_TD, expert_idx_TK, axis=axis, num_experts=num_experts)
        y_TD = combine_all_gather(local_experts_fn(x_MD, group_sizes), residual, weight_TK, axis=axis)
    stats = {"dropped_tokens": residual.dropped_tokens, "tokens_per_expert": residual.tokens_per_expert}
    return y_TD.astype(x_TD.dtype), stats


def _validate(x_TD, expert_idx_TK, weight_TK, n, num_experts, dispatch, capacity_factor) -> int:
    """Checks the arguments; returns the all_to_all rows per destination buffer."""
    if dispatch not in DISPATCH_MODES:
        raise ValueError(f"dispatch = {dispatch!r}; use one of {DISPATCH_MODES}")
    if x_TD.ndim != 2:
        raise ValueError(f"x_TD must be [T, D], got shape {x_TD.shape}; flatten batch and sequence first")
    if expert_idx_TK.ndim != 2 or expert_idx_TK.shape[0] != x_TD.shape[0]:
        raise ValueError(f"expert_idx_TK must be [T, K] with T = {x_TD.shape[0]}, got {expert_idx_TK.shape}")
    if not jnp.issubdtype(expert_idx_TK.dtype, jnp.integer):
        raise ValueError(f"expert_idx_TK must hold integer expert ids, got dtype {expert_idx_TK.dtype}")
    if weight_TK.shape != expert_idx_TK.shape:
        raise ValueError(f"weight_TK shape {weight_TK.shape} must equal expert_idx_TK shape {expert_idx_TK.shape}")
    if num_experts <= 0 or num_experts % n != 0:
        raise ValueError(f"num_experts = {num_experts} must be a positive multiple of the EP size n = {n} "
                         "(each rank holds whole experts)")
    if capacity_factor is not None and dispatch != "all_to_all":
        raise ValueError("capacity_factor applies to dispatch='all_to_all' only; all_gather is dropless, "
                         "pass capacity_factor=None")
    num_tokens, top_k = expert_idx_TK.shape
    return rows_per_destination(num_tokens, top_k, num_experts, n, capacity_factor)


def rows_per_destination(num_tokens: int, top_k: int, num_experts: int, axis_size: int,
                         capacity_factor: float | None = None) -> int:
    """Rows in each all_to_all per-destination buffer (C): T*min(K, G) dropless, else ceil(c*T*K/n)."""
    dropless_rows = num_tokens * min(top_k, num_experts // axis_size)
    if capacity_factor is None:
        return dropless_rows
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor = {capacity_factor} must be > 0 (or None for dropless)")
    # Larger buffers than the worst case would only send padding.
    return min(math.ceil(capacity_factor * num_tokens * top_k / axis_size), dropless_rows)


def expert_parallel_wire_bytes(*, num_tokens: int, top_k: int, num_experts: int, axis_size: int, hidden: int,
                               dispatch: str, itemsize: int, weight_itemsize: int = 4,
                               capacity_factor: float | None = None) -> dict[str, int]:
    """Bytes one rank sends in one forward call of `expert_parallel_ffn`, per collective (T tokens per rank).

    all_to_all: counts (n-1)*G*4; dispatch and return (n-1)*C*D*itemsize each; tokens_per_expert psum
        2*(n-1)/n*E*4.
    all_gather: tokens (n-1)*T*D*itemsize, expert ids (n-1)*T*K*4, weights (n-1)*T*K*weight_itemsize;
        reduce-scatter of outputs (n-1)*T*D*itemsize.
    The backward sends the payload ones again (all-to-all <-> all-to-all, all-gather <-> reduce-scatter).
    """
    n, T, K = axis_size, num_tokens, top_k
    if dispatch == "all_to_all":
        rows = rows_per_destination(T, K, num_experts, n, capacity_factor)
        return {"counts": (n - 1) * (num_experts // n) * 4,
                "dispatch": (n - 1) * rows * hidden * itemsize,
                "return": (n - 1) * rows * hidden * itemsize,
                "tokens_per_expert": 2 * (n - 1) * num_experts * 4 // n}
    if dispatch == "all_gather":
        return {"tokens": (n - 1) * T * hidden * itemsize, "expert_ids": (n - 1) * T * K * 4,
                "weights": (n - 1) * T * K * weight_itemsize, "reduce_scatter": (n - 1) * T * hidden * itemsize}
    raise ValueError(f"dispatch = {dispatch!r}; use one of {DISPATCH_MODES}")


# ----------------------------------------------------------------------------------------------------------
# Routing helpers (local, no communication)
# ----------------------------------------------------------------------------------------------------------


_inverse_permutation = inverse_permutation


def _sentinel_invalid(expert_A, num_experts):
    """Expert ids outside [0, E) become E, which sorts last, matches no rank, and is counted as dropped."""
    valid = (expert_A >= 0) & (expert_A < num_experts)
    return jnp.where(valid, expert_A, num_experts).astype(jnp.int32)


def _clip_cumulative(counts_NG, capacity):
    """Per row, keep the first `capacity` rows in group order: counts of what survives, per group."""
    kept_cum = jnp.minimum(jnp.cumsum(counts_NG, axis=-1), capacity)
    return jnp.diff(kept_cum, axis=-1, prepend=0)


def _exclusive_cumsum(counts):
    return jnp.cumsum(counts) - counts


def sort_assignments(expert_idx_TK, num_experts: int):
    """The one argsort of routed assignments: (expert_A with invalid ids as E, order_A, counts_E).

    A = T*K assignments (token-major, a = t*K + k). order_A lists them by expert, token order kept inside
    an expert (stable), invalid ids last; counts_E counts the valid ones per expert."""
    expert_A = _sentinel_invalid(expert_idx_TK.reshape(-1), num_experts)
    order_A = jnp.argsort(expert_A, stable=True)
    counts_E = jnp.bincount(expert_A, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    return expert_A, order_A, counts_E


def weighted_sum_over_k(y_AD, kept_A, weight_TK):
    """The one combine: y_TD = sum_k weight[t, k] * y[t*K + k], in fp32; rows not kept contribute 0."""
    num_tokens, top_k = weight_TK.shape
    y_TKD = jnp.where(kept_A[:, None], y_AD, 0).reshape(num_tokens, top_k, -1)
    return jnp.einsum("tkd,tk->td", y_TKD.astype(jnp.float32), weight_TK.astype(jnp.float32))


# ----------------------------------------------------------------------------------------------------------
# n = 1: the local sort (one device, the XLA plan, TP experts on gathered tokens)
# ----------------------------------------------------------------------------------------------------------


class LocalResidual(NamedTuple):
    order_A: jax.Array          # assignment of each sorted row
    kept_A: jax.Array           # valid expert id (invalid ids are dropped and counted)
    dropped_tokens: jax.Array
    tokens_per_expert: jax.Array


def dispatch_local(x_TD, expert_idx_TK, *, num_experts: int, capacity: int | None = None, groups: int = 1):
    """Rows of x repeated per assignment, ordered by expert: (x_MD with M = T*K, group_sizes_E, residual).

    capacity: each of `groups` equal, contiguous blocks of tokens keeps only its first `capacity` rows in
    expert order (the all_to_all dispatch at n = 1: its one destination holds ceil(c*T*K) rows); the rest
    are dropped and counted. groups > 1 is the global view of a batch split over data-parallel devices, so
    the XLA plan drops exactly what each device's own dispatch would. None is dropless. Rows past
    sum(group_sizes) are junk the combine ignores."""
    top_k = expert_idx_TK.shape[-1]
    expert_A, order_A, counts_E = sort_assignments(expert_idx_TK, num_experts)
    kept_A = expert_A < num_experts
    if capacity is not None:
        rows = expert_A.shape[0] // groups
        group_A = jnp.arange(expert_A.shape[0], dtype=jnp.int32) // rows
        # Rank of each assignment among its block's, in expert order; the first `capacity` stay.
        rank_A = _inverse_permutation(jnp.argsort(group_A * (num_experts + 1) + expert_A, stable=True))
        kept_A = kept_A & (rank_A - group_A * rows < capacity)
        order_A = jnp.argsort(jnp.where(kept_A, expert_A, num_experts), stable=True)   # dropped rows last
    kept_E = jnp.bincount(jnp.where(kept_A, expert_A, num_experts), length=num_experts + 1)[:num_experts]
    dropped = (expert_A.shape[0] - kept_E.sum()).astype(jnp.int32)
    return (repeat_rows_sorted(x_TD, order_A, top_k), kept_E.astype(jnp.int32),
            LocalResidual(order_A, kept_A, dropped, counts_E))


def combine_local(y_MD, residual: LocalResidual, weight_TK):
    """Inverse of `dispatch_local` (a gather, not a scatter), then the weighted sum over k; x's dtype."""
    y_AD = permute_rows(y_MD, _inverse_permutation(residual.order_A))
    return weighted_sum_over_k(y_AD, residual.kept_A, weight_TK).astype(y_MD.dtype)


# ----------------------------------------------------------------------------------------------------------
# all_to_all dispatch
# ----------------------------------------------------------------------------------------------------------


class AllToAllResidual(NamedTuple):
    perm_R: jax.Array           # received row -> sorted row order (by local expert, then source rank)
    valid_R: jax.Array          # received row holds a token (not padding)
    slot_A: jax.Array           # where assignment a sits in the returned [n*C] buffer
    kept_A: jax.Array           # assignment a was sent (not dropped)
    dropped_tokens: jax.Array
    tokens_per_expert: jax.Array


def _exchange(wire: str):
    """The payload all-to-all: as is, or E4M3 on the wire (parallel/fp8_exchange.py)."""
    if wire == "fp8":
        from megascale_jax.parallel.fp8_exchange import exchange_tokens_fp8

        return exchange_tokens_fp8
    return collectives.exchange_tokens


def dispatch_all_to_all(x_TD, expert_idx_TK, *, axis, num_experts: int, capacity: int, wire: str = "bf16"):
    """Sender packs (token, k) rows per destination rank, ordered by expert; one all_to_all; the receiver
    orders what arrived by local expert, then source rank (the paper's order). wire='fp8': the payload
    travels as E4M3 with per-token scales (gradients per channel on the way back).

    Returns (x_RD with R = n*C rows sorted by local expert, padding last; group_sizes_G; residual)."""
    num_tokens, top_k = expert_idx_TK.shape
    n = lax.axis_size(axis)
    num_local = num_experts // n
    # Sorting by global expert groups rows by destination rank, then by local expert, tokens in order.
    expert_A, order_A, counts_E = sort_assignments(expert_idx_TK, num_experts)
    counts_NG = counts_E.reshape(n, num_local)
    kept_NG = _clip_cumulative(counts_NG, capacity)
    kept_N = kept_NG.sum(axis=1)
    dest_start_N = _exclusive_cumsum(counts_NG.sum(axis=1))

    slot_C = jnp.arange(capacity)
    send_valid_NC = slot_C[None, :] < kept_N[:, None]
    sorted_pos_NC = jnp.minimum(dest_start_N[:, None] + slot_C[None, :], order_A.shape[0] - 1)
    token_NC = order_A[sorted_pos_NC] // top_k
    x_send_NCD = jnp.where(send_valid_NC[..., None], x_TD[token_NC], 0).astype(x_TD.dtype)

    recv_counts_NG = collectives.exchange_counts(kept_NG, axis)
    x_recv_NCD = _exchange(wire)(x_send_NCD, axis)
    perm_R, valid_R, group_sizes_G = _receiver_order(recv_counts_NG, capacity)
    x_sorted_RD = permute_rows(x_recv_NCD.reshape(n * capacity, -1), perm_R)

    # Where each (token, k) row will sit in the returned buffers.
    dest_A = expert_A // num_local  # n for invalid ids
    pos_A = _inverse_permutation(order_A) - dest_start_N[jnp.minimum(dest_A, n - 1)]
    kept_A = (dest_A < n) & (pos_A < capacity)
    slot_A = jnp.where(kept_A, dest_A * capacity + pos_A, 0)
    residual = AllToAllResidual(perm_R, valid_R, slot_A, kept_A,
                                (expert_A.shape[0] - kept_N.sum()).astype(jnp.int32),
                                collectives.sum_over(counts_E, axis))
    return x_sorted_RD, group_sizes_G, residual


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


def combine_all_to_all(y_sorted_RD, residual: AllToAllResidual, weight_TK, *, axis, wire: str = "bf16"):
    """Rows back to their source ranks (the mirror all_to_all), then the sender's weighted sum over k."""
    n = lax.axis_size(axis)
    y_recv_RD = jnp.where(residual.valid_R[:, None], permute_rows(y_sorted_RD, _inverse_permutation(residual.perm_R)),
                          0)
    y_back_NCD = _exchange(wire)(y_recv_RD.astype(y_sorted_RD.dtype).reshape(n, -1, y_recv_RD.shape[-1]), axis)
    y_AD = y_back_NCD.reshape(-1, y_back_NCD.shape[-1])[residual.slot_A]
    return weighted_sum_over_k(y_AD, residual.kept_A, weight_TK).astype(y_sorted_RD.dtype)


# ----------------------------------------------------------------------------------------------------------
# all_gather dispatch
# ----------------------------------------------------------------------------------------------------------


class AllGatherResidual(NamedTuple):
    row_M: jax.Array            # gathered assignment of each sorted row
    valid_M: jax.Array          # sorted row is real (not past the group sizes)
    dropped_tokens: jax.Array
    tokens_per_expert: jax.Array


def dispatch_all_gather(x_TD, expert_idx_TK, *, axis, num_experts: int):
    """All-gather tokens and routing, keep the rows routed to this rank's experts, sorted by expert
    (stably, so source order is kept). Returns (x_MD, group_sizes_G, residual)."""
    num_tokens, top_k = expert_idx_TK.shape
    n = lax.axis_size(axis)
    num_local = num_experts // n
    x_all_RD = collectives.gather_tokens(x_TD, axis)  # R = n*T tokens, rank-major
    expert_all_A = _sentinel_invalid(collectives.gather_tokens(expert_idx_TK, axis).reshape(-1), num_experts)

    local_A = expert_all_A - lax.axis_index(axis) * num_local
    is_local_A = (local_A >= 0) & (local_A < num_local)
    key_A = jnp.where(is_local_A, local_A, num_local)
    order_A = jnp.argsort(key_A, stable=True)  # local rows first, by expert, source order kept
    counts_G = jnp.bincount(key_A, length=num_local + 1)[:num_local].astype(jnp.int32)
    max_rows = n * num_tokens * min(top_k, num_local)
    group_sizes_G = _clip_cumulative(counts_G, max_rows)

    row_M = order_A[:max_rows]
    valid_M = jnp.arange(max_rows) < group_sizes_G.sum()
    x_sorted_MD = jnp.where(valid_M[:, None], x_all_RD[row_M // top_k], 0).astype(x_TD.dtype)
    own_expert_A = _sentinel_invalid(expert_idx_TK.reshape(-1), num_experts)
    dropped = (counts_G.sum() - group_sizes_G.sum() + jnp.sum(own_expert_A == num_experts)).astype(jnp.int32)
    tokens_per_expert = jnp.bincount(expert_all_A, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    return x_sorted_MD, group_sizes_G, AllGatherResidual(row_M, valid_M, dropped, tokens_per_expert)


def combine_all_gather(y_sorted_MD, residual: AllGatherResidual, weight_TK, *, axis):
    """Weight and sum the rows per gathered token into [n*T, D] in fp32, then reduce-scatter to [T, D]."""
    num_tokens, top_k = weight_TK.shape
    n = lax.axis_size(axis)
    weight_all_A = collectives.gather_tokens(weight_TK, axis).reshape(-1)
    weight_M = jnp.where(residual.valid_M, weight_all_A[residual.row_M].astype(jnp.float32), 0)
    contrib_MD = jnp.where(residual.valid_M[:, None], y_sorted_MD.astype(jnp.float32) * weight_M[:, None], 0)
    y_all_RD = jnp.zeros((n * num_tokens, y_sorted_MD.shape[-1]), jnp.float32).at[residual.row_M // top_k].add(
        contrib_MD)
    # Cast before the reduce-scatter: the wire carries activation bytes, as the all_to_all path does.
    return collectives.scatter_sum_tokens(y_all_RD.astype(y_sorted_MD.dtype), axis)


# ----------------------------------------------------------------------------------------------------------
# Single-device reference
# ----------------------------------------------------------------------------------------------------------


def moe_ffn_reference(x_TD, expert_idx_TK, weight_TK, expert_fn: Callable[[jax.Array, jax.Array], jax.Array],
                      num_experts: int):
    """Plain MoE FFN on one device: a loop runs every expert on every token; routing masks the results.

    expert_fn(e, x_TD) -> y_TD applies expert e (e is a traced int32 scalar: index weights with it).
    No capacity, nothing dropped; fp32 accumulate. Expert ids outside [0, E) contribute nothing.
    """
    y_ETD = lax.map(lambda e: expert_fn(e, x_TD).astype(jnp.float32), jnp.arange(num_experts))
    routed_TKE = expert_idx_TK[..., None] == jnp.arange(num_experts)
    weight_TE = jnp.sum(jnp.where(routed_TKE, weight_TK[..., None], 0), axis=1).astype(jnp.float32)
    return jnp.einsum("etd,te->td", y_ETD, weight_TE).astype(x_TD.dtype)
