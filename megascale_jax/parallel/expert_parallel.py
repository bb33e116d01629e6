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
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from megascale_jax.parallel import collectives
from megascale_jax.parallel import token_routes as routes

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
# The pairs: a plan and its moves (parallel/token_routes.py), each plan doubling as the combine's residual
# ----------------------------------------------------------------------------------------------------------


def exchange_for(wire: str):
    """The payload all-to-all: as is, or E4M3 on the wire (parallel/fp8_exchange.py)."""
    if wire == "fp8":
        from megascale_jax.parallel.fp8_exchange import exchange_tokens_fp8

        return exchange_tokens_fp8
    return collectives.exchange_tokens


def gradient_exchange_for(wire: str):
    """The all-to-all for gradients moved along a plan by a hand-written backward (parallel/overlap.py): as
    is, or E4M3 scaled per channel over row groups, as `exchange_tokens_fp8`'s own backward sends them."""
    if wire == "fp8":
        from megascale_jax.parallel.fp8_exchange import dequantize_channel_groups, quantize_channel_groups

        def exchange_gradients_fp8(g_NCD, axis):
            q, scale = quantize_channel_groups(g_NCD)
            return dequantize_channel_groups(collectives.exchange_tokens(q, axis),
                                             collectives.exchange_tokens(scale, axis), g_NCD.dtype)
        return exchange_gradients_fp8
    return collectives.exchange_tokens


def dispatch_local(x_TD, expert_idx_TK, *, num_experts: int, capacity: int | None = None, groups: int = 1,
                   pallas: bool = False):
    """Rows of x repeated per assignment, ordered by expert: (x_MD with M = T*K, group_sizes_E, plan).

    capacity: each of `groups` equal, contiguous blocks of tokens keeps only its first `capacity` rows in
    expert order (the all_to_all dispatch at n = 1: its one destination holds ceil(c*T*K) rows); the rest
    are dropped and counted. groups > 1 is the global view of a batch split over data-parallel devices, so
    the XLA plan drops exactly what each device's own dispatch would. None is dropless. Rows past
    sum(group_sizes) are junk the combine ignores."""
    plan = routes.plan_local(expert_idx_TK, num_experts=num_experts, capacity=capacity, groups=groups)
    return routes.send_local(x_TD, plan, pallas), plan.group_sizes, plan


def combine_local(y_MD, plan: routes.LocalPlan, weight_TK, pallas: bool = False):
    """Inverse of `dispatch_local` (a gather, not a scatter), then the weighted sum over k; x's dtype."""
    return routes.combine_local(y_MD, plan, weight_TK, pallas)


def dispatch_all_to_all(x_TD, expert_idx_TK, *, axis, num_experts: int, capacity: int, wire: str = "bf16"):
    """Sender packs (token, k) rows per destination rank, ordered by expert; one all_to_all; the receiver
    orders what arrived by local expert, then source rank (the paper's order). wire='fp8': the payload
    travels as E4M3 with per-token scales (gradients per channel on the way back).

    Returns (x_RD with R = n*C rows sorted by local expert, padding last; group_sizes_G; plan)."""
    plan = routes.plan_all_to_all(expert_idx_TK, axis=axis, num_experts=num_experts, capacity=capacity)
    return routes.send_all_to_all(x_TD, plan, axis=axis, exchange=exchange_for(wire)), plan.group_sizes, plan


def combine_all_to_all(y_sorted_RD, plan: routes.AllToAllPlan, weight_TK, *, axis, wire: str = "bf16",
                       pallas: bool = False):
    """Rows back to their source ranks (the mirror all_to_all), then the sender's weighted sum over k."""
    return routes.combine_all_to_all(y_sorted_RD, plan, weight_TK, axis=axis, exchange=exchange_for(wire),
                                     pallas=pallas)


def dispatch_all_gather(x_TD, expert_idx_TK, *, axis, num_experts: int):
    """All-gather tokens and routing, keep the rows routed to this rank's experts, sorted by expert
    (stably, so source order is kept). Returns (x_MD, group_sizes_G, plan)."""
    plan = routes.plan_all_gather(expert_idx_TK, axis=axis, num_experts=num_experts)
    return routes.send_all_gather(x_TD, plan, axis=axis), plan.group_sizes, plan


def combine_all_gather(y_sorted_MD, plan: routes.AllGatherPlan, weight_TK, *, axis):
    """Weight and sum the rows per gathered token into [n*T, D] in fp32, then reduce-scatter to [T, D]."""
    return routes.combine_all_gather(y_sorted_MD, plan, weight_TK, axis=axis)


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
