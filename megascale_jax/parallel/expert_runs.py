"""Expert parallelism in runs: each rank sends its routed rows as (destination, local expert) runs, and a
receiver keeps them in (local expert, source rank) order, so that one grouped GEMM row tile depends on the
one or two sources whose runs it covers. This is the layout of the fused AG + scatter + grouped GEMM kernel
(pallas_kernels/all_gather_grouped_gemm.py; its tables in pallas_kernels/_dispatch_tables.py).

    plan_runs(idx_TK)                     the send order (the local sort by global expert id) and every rank's
                                          counts [source, destination, expert] (all-gathered: small ints)
    receive_runs / return_runs            the exchange each way in plain JAX, one all-to-all of per-rank blocks
                                          (pallas_kernels/run_exchange_reference.py: the kernels' twins)

`ExpertRunsDispatch` is the dispatcher (parallel/layouts.py FFNDispatcher) for `parallel.moe_layer='fused'`
with `parallel.dispatch_exchange` 'runs' (this module's plain exchange; runs anywhere, tested against the
unfused all_gather dispatch on 8 simulated devices) or 'mosaic' (GPU only: the gate GEMM fused with the
exchange, pallas_kernels/all_gather_grouped_gemm.py, and the down GEMM with the way back,
pallas_kernels/grouped_gemm_reduce_scatter.py; both backwards are their plain twins' for now). Dropless: a
receiver holds n x T x min(K, G) rows (every possible one).
"""
from __future__ import annotations

import dataclasses
from enum import StrEnum
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from megascale_jax.parallel import collectives
from megascale_jax.parallel.plan import INTRA
from pallas_kernels.run_exchange_reference import receive_runs, return_runs
from megascale_jax.parallel.token_routes import sentinel_invalid


class DispatchExchange(StrEnum):
    """How `moe_layer='fused'` moves the all_gather dispatch's rows (`parallel.dispatch_exchange`)."""
    RING = "ring"       # parallel/ring_dispatch.py: n ring steps, each step's GEMMs on one source's rows
    RUNS = "runs"       # this module: (expert, source)-ordered runs by one all-to-all (the kernel's twin)
    MOSAIC = "mosaic"   # pallas_kernels/all_gather_grouped_gemm.py: the runs pushed under the first GEMM (GPU)


class RunsPlan(NamedTuple):
    order_A: jax.Array           # [T*K] assignments (t*K + k) sorted by global expert: the send order
    counts_SPG: jax.Array        # [n, n, G] rows of source s for local expert e of rank p
    dropped_tokens: jax.Array    # assignments of this rank to no expert (ids outside [0, E))
    tokens_per_expert: jax.Array


def plan_runs(idx_TK, *, axis, num_experts: int) -> RunsPlan:
    n = lax.axis_size(axis)
    expert_A = sentinel_invalid(idx_TK.reshape(-1), num_experts)
    counts_PG = jnp.bincount(expert_A, length=num_experts + 1)[:num_experts].reshape(n, num_experts // n)
    counts_SPG = collectives.gather_tokens(counts_PG[None].astype(jnp.int32), axis)
    return RunsPlan(jnp.argsort(expert_A, stable=True), counts_SPG,
                    jnp.sum(expert_A == num_experts).astype(jnp.int32), jnp.sum(counts_SPG, axis=0).reshape(-1))


def source_capacity(num_tokens: int, top_k: int, num_local: int) -> int:
    """Rows one source can route to one rank (dropless), rounded up to 8."""
    return -(-num_tokens * min(top_k, num_local) // 8) * 8


@dataclasses.dataclass(frozen=True)
class ExpertRunsDispatch:
    """The all_gather dispatch's rows moved as runs (see the module docstring); `exchange` 'runs' or 'mosaic'.
    Residual: the RunsPlan."""
    num_experts: int
    axis: str = INTRA
    exchange: str = DispatchExchange.RUNS

    def ffn_input(self, x_BSD):
        return x_BSD

    def ffn_output(self, y_BSD):
        return y_BSD

    def _capacity(self, shape_TK) -> int:
        return source_capacity(*shape_TK, self.num_experts // lax.axis_size(self.axis))

    def _send(self, x_TD, routing):
        plan = plan_runs(routing.idx_TK, axis=self.axis, num_experts=self.num_experts)
        return x_TD[plan.order_A // routing.idx_TK.shape[1]], plan

    def dispatch(self, x_TD, routing):
        send_AD, plan = self._send(x_TD, routing)
        recv, group_sizes = receive_runs(send_AD, plan.counts_SPG, axis=self.axis,
                                         capacity_per_source=self._capacity(routing.idx_TK.shape))
        return recv, group_sizes, plan

    def combine(self, y_RD, plan: RunsPlan, weight_TK):
        """Rows back to their tokens, the weighted sum over k in fp32."""
        num_tokens, top_k = weight_TK.shape
        y_AD = return_runs(y_RD, plan.counts_SPG, axis=self.axis, capacity_per_source=self._capacity(weight_TK.shape),
                           rows=num_tokens * top_k)
        return self._weighted_sum(y_AD, plan, weight_TK)

    @staticmethod
    def _weighted_sum(y_AD, plan: RunsPlan, weight_TK):
        """Send-order rows back to their assignments, summed over k with the routing weights in fp32."""
        num_tokens, top_k = weight_TK.shape
        y_TKD = jnp.zeros_like(y_AD).at[plan.order_A].set(y_AD).reshape(num_tokens, top_k, -1)
        out = jnp.einsum("tkd,tk->td", y_TKD.astype(jnp.float32), weight_TK.astype(jnp.float32))
        return out.astype(y_AD.dtype)

    def first_gemm_dispatch(self, x_TD, routing, first_gemm):
        if self.exchange != DispatchExchange.MOSAIC:
            with jax.named_scope("dispatch"):
                recv, group_sizes, residual = self.dispatch(x_TD, routing)
            with jax.named_scope("experts"):
                return first_gemm(recv, group_sizes), group_sizes, residual
        from pallas_kernels.all_gather_grouped_gemm import all_gather_grouped_gemm

        with jax.named_scope("dispatch"):
            send_AD, plan = self._send(x_TD, routing)
        with jax.named_scope("experts"):   # the exchange runs under the gate GEMM, in one kernel
            rows = lax.axis_size(self.axis) * self._capacity(routing.idx_TK.shape)
            gate, recv, group_sizes = all_gather_grouped_gemm(
                send_AD, plan.counts_SPG, first_gemm.weights.gate_EDF.astype(x_TD.dtype), axis=self.axis,
                capacity=max(rows, 256), source_rows=self._capacity(routing.idx_TK.shape))   # >= one 256-row tile
            h = first_gemm.from_gate(recv, gate, group_sizes)
        return h[:rows], group_sizes, plan

    def last_gemm_combine(self, h_MF, group_sizes, plan: RunsPlan, weight_TK, last_gemm):
        if self.exchange != DispatchExchange.MOSAIC:
            with jax.named_scope("experts"):
                y_RD = last_gemm(h_MF, group_sizes)
            with jax.named_scope("combine"):
                return self.combine(y_RD, plan, weight_TK)
        from pallas_kernels.grouped_gemm_reduce_scatter import grouped_gemm_reduce_scatter

        num_tokens, top_k = weight_TK.shape
        with jax.named_scope("experts"):   # each output tile stored into the ranks its rows came from
            h_pad = jnp.pad(h_MF, ((0, max(256 - h_MF.shape[0], 0)), (0, 0)))   # at least one 256-row tile
            y_AD = last_gemm.named(grouped_gemm_reduce_scatter(
                h_pad, plan.counts_SPG, last_gemm.weights.down_EFD.astype(h_MF.dtype), axis=self.axis,
                rows=num_tokens * top_k, source_rows=self._capacity(weight_TK.shape)))
        with jax.named_scope("combine"):
            return self._weighted_sum(y_AD, plan, weight_TK)
