"""Expert parallelism as ring schedules: AG + scatter + grouped GEMM, and grouped GEMM + gather + RS.

The all_gather dispatch (parallel/layouts.py AllGatherDispatch) first gathers every rank's tokens, then runs
the expert GEMMs; its combine runs the last GEMM, then reduce-scatters. Here both are tiled by source rank
into n steps of a ring (`collectives.ring_pass`, point to point): at step j a rank computes the first GEMMs on
the rows of the tokens that arrived from rank r - j while the next rank's tokens move; on the way back, at
step j it computes the last GEMM for the tokens of rank r - j - 1, adds them to the partial sums for that rank
that arrived, and passes them on, so after n steps each rank holds its own tokens' outputs. Rows are ordered by source
rank, then by expert, so each step depends on one rank's tokens only. This is the plain-JAX form (with the
same order) of the fused communication + GEMM kernels of the paper: XLA may run each ring step's transfer
under the previous step's GEMMs. `parallel.moe_layer='fused'` selects it for `ep_dispatch='all_gather'`.

Same results as AllGatherDispatch (tests/parallel/test_ring_dispatch.py, fp32 to 1e-4): dropless, every routed
row computed once, combine in fp32. Both rings carry fp32 (twice the unfused bf16 bytes): every hop adds (the
combine's partial sums forward, the tokens' cotangents backward), and bf16 there rounds n - 1 times. In bf16
the expert weights' gradients are n per-step partials, each rounded to bf16 before their fp32 sum (2-3x the
unfused error, measured); a fused kernel keeps that sum in its fp32 accumulator.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from megascale_jax.parallel import collectives
from megascale_jax.parallel import expert_parallel as ep
from megascale_jax.parallel.plan import INTRA
from megascale_jax.parallel.token_routes import sentinel_invalid

GemmFn = Callable[[jax.Array, jax.Array], jax.Array]   # (rows sorted by expert, group_sizes) -> rows


class RingPlan(NamedTuple):
    rows_NC: jax.Array          # per source rank: its assignments (t*K + k) routed here, sorted by local expert
    valid_NC: jax.Array         # row c of source s is real (c < rows routed here from s)
    counts_NG: jax.Array        # rows per (source rank, local expert): each step's group sizes
    weight_NC: jax.Array        # the routing weight of each row (fp32; 0 on padding)
    dropped_tokens: jax.Array
    tokens_per_expert: jax.Array


def plan_ring(expert_idx_TK, weight_TK, *, axis, num_experts: int) -> RingPlan:
    """From the all-gathered routing (small: T*K ints and floats per rank): for each source rank the rows
    of this rank's experts, sorted stably by expert; C = T * min(K, local experts) rows per source hold
    every possible one (dropless)."""
    num_tokens, top_k = expert_idx_TK.shape
    n = lax.axis_size(axis)
    num_local = num_experts // n
    expert_NA = sentinel_invalid(collectives.gather_tokens(expert_idx_TK[None], axis).reshape(n, -1), num_experts)
    weight_NA = collectives.gather_tokens(weight_TK.astype(jnp.float32)[None], axis).reshape(n, -1)
    local_NA = expert_NA - lax.axis_index(axis) * num_local
    key_NA = jnp.where((local_NA >= 0) & (local_NA < num_local), local_NA, num_local)
    order_NA = jnp.argsort(key_NA, axis=1, stable=True)
    capacity = num_tokens * min(top_k, num_local)
    rows_NC = order_NA[:, :capacity]
    counts_NG = jax.vmap(lambda k: jnp.bincount(k, length=num_local + 1)[:num_local])(key_NA).astype(jnp.int32)
    valid_NC = jnp.arange(capacity)[None, :] < counts_NG.sum(axis=1, keepdims=True)
    weight_NC = jnp.where(valid_NC, jnp.take_along_axis(weight_NA, rows_NC, axis=1), 0)
    own_invalid = jnp.sum(sentinel_invalid(expert_idx_TK.reshape(-1), num_experts) == num_experts)
    tokens_per_expert = jnp.bincount(expert_NA.reshape(-1), length=num_experts + 1)[:num_experts]
    return RingPlan(rows_NC, valid_NC, counts_NG, weight_NC, own_invalid.astype(jnp.int32),
                    tokens_per_expert.astype(jnp.int32))


@dataclasses.dataclass(frozen=True)
class RingAllGatherDispatch:
    """The all_gather dispatcher (parallel/layouts.py FFNDispatcher) whose first and last expert GEMMs run as
    ring schedules (see the module docstring); `dispatch` / `combine` alone are the unfused all_gather pair."""
    num_experts: int
    axis: str = INTRA

    def ffn_input(self, x_BSD):
        return x_BSD

    def ffn_output(self, y_BSD):
        return y_BSD

    def dispatch(self, x_TD, routing):
        return ep.dispatch_all_gather(x_TD, routing.idx_TK, axis=self.axis, num_experts=self.num_experts)

    def combine(self, y_MD, residual, weight_TK):
        return ep.combine_all_gather(y_MD, residual, weight_TK, axis=self.axis)

    def first_gemm_dispatch(self, x_TD, routing, first_gemm: GemmFn):
        """h rows in step order (block j: the tokens of source rank r - j), the per-step group sizes, the plan."""
        n, top_k = lax.axis_size(self.axis), routing.idx_TK.shape[1]
        with jax.named_scope("dispatch"):
            plan = plan_ring(routing.idx_TK, routing.weight_TK, axis=self.axis, num_experts=self.num_experts)
            source_j = [(lax.axis_index(self.axis) - j) % n for j in range(n)]
        # fp32 on the ring: the backward sums each token's row cotangents hop by hop along it, and n - 1
        # roundings to bf16 measured 4x the unfused path's gradient error (tests/parallel/test_ring_dispatch.py).
        blocks, x_from = [], x_TD.astype(jnp.float32)
        for j in range(n):
            with jax.named_scope("experts"):
                rows = plan.rows_NC[source_j[j]] // top_k
                x_CD = jnp.where(plan.valid_NC[source_j[j]][:, None], x_from[rows], 0).astype(x_TD.dtype)
                blocks.append(first_gemm(x_CD, plan.counts_NG[source_j[j]]))
            if j < n - 1:
                with jax.named_scope("dispatch"):
                    x_from = collectives.ring_pass(x_from, self.axis)
        return jnp.stack(blocks), plan.counts_NG, plan

    def last_gemm_combine(self, h_NCF, group_sizes, plan: RingPlan, weight_TK, last_gemm: GemmFn):
        """At step j: the last GEMM for destination rank r - j - 1 (its rows are step block j + 1 mod n), its
        weighted sum over k in fp32 added to the partial sums that arrived (they hold that destination's sums
        from the ranks before), passed on to r + 1; the last step (j = n - 1) is this rank's own tokens. The weights come from the plan (gathered with the routing); weight_TK
        gives the token count and top-k."""
        del group_sizes
        n = lax.axis_size(self.axis)
        num_tokens, top_k = weight_TK.shape
        acc_TD = None
        for j in range(n):
            dest = (lax.axis_index(self.axis) - j - 1) % n
            with jax.named_scope("experts"):
                y_CD = last_gemm(h_NCF[(j + 1) % n], plan.counts_NG[dest])
            with jax.named_scope("combine"):
                contrib_CD = jnp.where(plan.valid_NC[dest][:, None],
                                       y_CD.astype(jnp.float32) * plan.weight_NC[dest][:, None], 0)
                part_TD = jnp.zeros((num_tokens, y_CD.shape[-1]), jnp.float32).at[
                    plan.rows_NC[dest] // top_k].add(contrib_CD)
                acc_TD = part_TD if acc_TD is None else acc_TD + part_TD
                if j < n - 1:   # partial sums in fp32 on the ring (each hop adds; see first_gemm_dispatch)
                    acc_TD = collectives.ring_pass(acc_TD, self.axis)
        return acc_TD.astype(h_NCF.dtype)
