"""Expert-parallel MoE FFN over the n ranks of one mesh axis (called inside a `jax.shard_map` body).

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
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from megascale_jax.parallel import collectives

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
        return _ffn_all_to_all(x_TD, expert_idx_TK, weight_TK, local_experts_fn, axis, n, num_experts, capacity)
    return _ffn_all_gather(x_TD, expert_idx_TK, weight_TK, local_experts_fn, axis, n, num_experts)


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


def _inverse_permutation(perm_R):
    return jnp.zeros_like(perm_R).at[perm_R].set(jnp.arange(perm_R.shape[0], dtype=perm_R.dtype))


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


# ----------------------------------------------------------------------------------------------------------
# all_to_all dispatch
# ----------------------------------------------------------------------------------------------------------


def _ffn_all_to_all(x_TD, expert_idx_TK, weight_TK, local_experts_fn, axis, n, num_experts, capacity):
    num_tokens, top_k = expert_idx_TK.shape
    num_local = num_experts // n
    expert_A = _sentinel_invalid(expert_idx_TK.reshape(-1), num_experts)
    # Sorting by global expert groups rows by destination rank, then by local expert, tokens in order.
    order_A = jnp.argsort(expert_A, stable=True)
    counts_E = jnp.bincount(expert_A, length=num_experts + 1)[:num_experts].astype(jnp.int32)
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
    x_recv_NCD = collectives.exchange_tokens(x_send_NCD, axis)
    y_recv_NCD = _run_experts_on_received(x_recv_NCD, recv_counts_NG, local_experts_fn)
    y_back_NCD = collectives.exchange_tokens(y_recv_NCD, axis)

    # Where each (token, k) row sits in the returned buffers.
    dest_A = expert_A // num_local  # n for invalid ids
    pos_A = _inverse_permutation(order_A) - dest_start_N[jnp.minimum(dest_A, n - 1)]
    kept_A = (dest_A < n) & (pos_A < capacity)
    slot_A = jnp.where(kept_A, dest_A * capacity + pos_A, 0)
    y_AD = y_back_NCD.reshape(n * capacity, -1)[slot_A]
    y_TKD = jnp.where(kept_A[:, None], y_AD, 0).reshape(num_tokens, top_k, -1)
    y_TD = jnp.einsum("tkd,tk->td", y_TKD.astype(jnp.float32), weight_TK.astype(jnp.float32))

    stats = {
        "dropped_tokens": (expert_A.shape[0] - kept_N.sum()).astype(jnp.int32),
        "tokens_per_expert": collectives.sum_over(counts_E, axis),
    }
    return y_TD.astype(x_TD.dtype), stats


def _run_experts_on_received(x_recv_NCD, recv_counts_NG, local_experts_fn):
    """Orders received rows by local expert, then source rank; runs the experts; returns rows in place.

    Block s of x_recv_NCD holds, in its first sum(recv_counts_NG[s]) rows, source s's rows for local
    experts 0..G-1 in order; the rest is padding (zeros) and comes back as zeros.
    """
    n, capacity, _ = x_recv_NCD.shape
    num_local = recv_counts_NG.shape[1]
    ends_NG = jnp.cumsum(recv_counts_NG, axis=1)
    slot_C = jnp.arange(capacity, dtype=ends_NG.dtype)
    # Local expert of each received row; G marks padding.
    expert_NC = jax.vmap(lambda ends_G: jnp.searchsorted(ends_G, slot_C, side="right"))(ends_NG)
    source_N = jnp.arange(n)
    sort_key_R = (expert_NC * n + source_N[:, None]).reshape(-1)
    perm_R = jnp.argsort(sort_key_R, stable=True)

    x_sorted_RD = x_recv_NCD.reshape(n * capacity, -1)[perm_R]
    group_sizes_G = recv_counts_NG.sum(axis=0).astype(jnp.int32)
    y_sorted_RD = local_experts_fn(x_sorted_RD, group_sizes_G)
    y_recv_RD = y_sorted_RD[_inverse_permutation(perm_R)]
    valid_R = (expert_NC < num_local).reshape(-1)
    y_recv_RD = jnp.where(valid_R[:, None], y_recv_RD, 0).astype(x_recv_NCD.dtype)
    return y_recv_RD.reshape(x_recv_NCD.shape[:2] + y_recv_RD.shape[1:])


# ----------------------------------------------------------------------------------------------------------
# all_gather dispatch
# ----------------------------------------------------------------------------------------------------------


def _ffn_all_gather(x_TD, expert_idx_TK, weight_TK, local_experts_fn, axis, n, num_experts):
    num_tokens, top_k = expert_idx_TK.shape
    num_local = num_experts // n
    x_all_RD = collectives.gather_tokens(x_TD, axis)  # R = n*T tokens, rank-major
    expert_all_A = _sentinel_invalid(collectives.gather_tokens(expert_idx_TK, axis).reshape(-1), num_experts)
    weight_all_A = collectives.gather_tokens(weight_TK, axis).reshape(-1)

    local_A = expert_all_A - lax.axis_index(axis) * num_local
    is_local_A = (local_A >= 0) & (local_A < num_local)
    key_A = jnp.where(is_local_A, local_A, num_local)
    order_A = jnp.argsort(key_A, stable=True)  # local rows first, by expert, source order kept
    counts_G = jnp.bincount(key_A, length=num_local + 1)[:num_local].astype(jnp.int32)
    max_rows = n * num_tokens * min(top_k, num_local)
    group_sizes_G = _clip_cumulative(counts_G, max_rows)

    row_M = order_A[:max_rows]
    valid_M = jnp.arange(max_rows) < group_sizes_G.sum()
    token_M = row_M // top_k
    x_sorted_MD = jnp.where(valid_M[:, None], x_all_RD[token_M], 0).astype(x_TD.dtype)
    y_sorted_MD = local_experts_fn(x_sorted_MD, group_sizes_G)

    weight_M = jnp.where(valid_M, weight_all_A[row_M].astype(jnp.float32), 0)
    contrib_MD = y_sorted_MD.astype(jnp.float32) * weight_M[:, None]
    contrib_MD = jnp.where(valid_M[:, None], contrib_MD, 0)  # padding outputs may be anything
    y_all_RD = jnp.zeros(x_all_RD.shape, jnp.float32).at[token_M].add(contrib_MD)
    # Cast before the reduce-scatter: the wire carries activation bytes, as the all_to_all path does.
    y_TD = collectives.scatter_sum_tokens(y_all_RD.astype(x_TD.dtype), axis)

    own_expert_A = _sentinel_invalid(expert_idx_TK.reshape(-1), num_experts)
    stats = {
        "dropped_tokens": (counts_G.sum() - group_sizes_G.sum()
                           + jnp.sum(own_expert_A == num_experts)).astype(jnp.int32),
        "tokens_per_expert": jnp.bincount(expert_all_A, length=num_experts + 1)[:num_experts].astype(jnp.int32),
    }
    return y_TD, stats


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
