"""Expert parallelism in runs: each rank sends its routed rows as (destination, local expert) runs, and a
receiver keeps them in (local expert, source rank) order, so that one grouped GEMM row tile depends on the
one or two sources whose runs it covers. This is the layout of the fused AG + scatter + grouped GEMM kernel
(pallas_kernels/all_gather_grouped_gemm.py; its tables in pallas_kernels/_dispatch_tables.py).

    plan_runs(idx_TK)                     the send order (the local sort by global expert id) and every rank's
                                          counts [source, destination, expert] (all-gathered: small ints)
    receive_runs(send_AD, counts_SPG)     the exchange in plain JAX: one all-to-all of per-destination blocks,
                                          then each source's runs placed at their receive rows
    return_runs(y_RD, counts_SPG)         the way back: each source's rows gathered out of the runs, one
                                          all-to-all, then back in send order

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


def _exclusive(v, axis=-1):
    return jnp.cumsum(v, axis=axis) - v


def _receive_rows(counts_SG, capacity: int):
    """For each receive row: its source, its index in that source's block (the source's rows for this rank in
    expert order), and whether it holds a row (the tail does not). Runs sit in (expert, source) order."""
    n, g = counts_SG.shape
    ends = jnp.cumsum(counts_SG.T.reshape(-1))                      # run k = e * n + s
    row = jnp.arange(capacity, dtype=jnp.int32)
    k = jnp.searchsorted(ends, row, side="right").astype(jnp.int32)
    valid = k < n * g
    k = jnp.minimum(k, n * g - 1)
    e, s = k // n, k % n
    in_run = row - (ends[k] - counts_SG[s, e])
    return s, _exclusive(counts_SG, axis=1)[s, e] + in_run, valid


def receive_runs(send_AD, counts_SPG, *, axis, capacity_per_source: int):
    """This rank's receive buffer [n * C, D] in (expert, source) order (zeros past its rows) and its rows per
    local expert, from every rank's send buffer in (destination, expert) order (C = capacity_per_source)."""
    rank, n = lax.axis_index(axis), counts_SPG.shape[0]
    mine_PG = counts_SPG[rank]
    base_P = _exclusive(jnp.sum(mine_PG, axis=1))
    i = jnp.arange(capacity_per_source, dtype=jnp.int32)
    keep = i[None, :] < jnp.sum(mine_PG, axis=1)[:, None]
    idx = jnp.minimum(base_P[:, None] + i[None, :], send_AD.shape[0] - 1)
    got_SCD = collectives.exchange_tokens(jnp.where(keep[..., None], send_AD[idx], 0), axis)
    counts_SG = counts_SPG[:, rank]
    s, j, valid = _receive_rows(counts_SG, n * capacity_per_source)
    recv = jnp.where(valid[:, None], got_SCD[s, jnp.minimum(j, capacity_per_source - 1)], 0)
    return recv.astype(send_AD.dtype), jnp.sum(counts_SG, axis=0)


def return_runs(y_RD, counts_SPG, *, axis, capacity_per_source: int, rows: int):
    """The way back: [rows, D] in this rank's send order (zeros for rows past its routed ones) from every
    rank's receive-ordered [n * C, D] outputs."""
    rank, n = lax.axis_index(axis), counts_SPG.shape[0]
    counts_SG = counts_SPG[:, rank]
    # source s's block for this rank: its runs (e, s) in expert order
    i = jnp.arange(capacity_per_source, dtype=jnp.int32)
    cum_SG = jnp.cumsum(counts_SG, axis=1)
    e_SC = jax.vmap(lambda c: jnp.searchsorted(c, i, side="right"))(cum_SG).astype(jnp.int32)
    keep = e_SC < counts_SG.shape[1]
    e_SC = jnp.minimum(e_SC, counts_SG.shape[1] - 1)
    run_start = (_exclusive(jnp.sum(counts_SG, axis=0))[None, :] + _exclusive(counts_SG, axis=0))   # [n, G]
    src = jnp.arange(n)[:, None]
    row_SC = run_start[src, e_SC] + i[None, :] - (cum_SG - counts_SG)[src, e_SC]
    blocks = jnp.where(keep[..., None], y_RD[jnp.where(keep, row_SC, 0)], 0)
    back_PCD = collectives.exchange_tokens(blocks, axis)          # back[p]: my rows that rank p computed
    totals_P = jnp.sum(counts_SPG[rank], axis=1)
    q = jnp.arange(rows, dtype=jnp.int32)
    p = jnp.minimum(jnp.searchsorted(jnp.cumsum(totals_P), q, side="right"), n - 1)
    ok = q < jnp.sum(totals_P)
    out = back_PCD[p, jnp.clip(q - _exclusive(totals_P)[p], 0, capacity_per_source - 1)]
    return jnp.where(ok[:, None], out, 0)


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
                capacity=max(rows, 256))   # at least one 256-row tile
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
                rows=num_tokens * top_k))
        with jax.named_scope("combine"):
            return self._weighted_sum(y_AD, plan, weight_TK)
