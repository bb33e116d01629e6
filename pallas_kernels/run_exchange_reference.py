"""Plain-JAX twins of the fused expert-parallel exchanges' data movement (all_gather_grouped_gemm.py and
grouped_gemm_reduce_scatter.py): rows travel as (destination, local expert) runs and a receiver keeps them in
(local expert, source rank) order (the layout of `_dispatch_tables.py`). Each way is one all-to-all of
per-rank blocks of C rows (C >= the rows any source routes to one rank), inside shard_map over `axis`:

    receive_runs(send_AD, counts_SPG, axis=, capacity_per_source=C) -> (recv [n * C, D], group_sizes [G])
    return_runs(y_RD, counts_SPG, axis=, capacity_per_source=C, rows=A) -> [A, D] in send order

Each is the other's transpose (every routed row lands exactly once), which is how the kernels' backwards use
them. parallel/expert_runs.py runs them as `parallel.dispatch_exchange='runs'`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["receive_runs", "return_runs"]


def _exchange(buf_NCD, axis):
    """Block p goes to rank p; block s of the result came from rank s."""
    return lax.all_to_all(buf_NCD, axis, split_axis=0, concat_axis=0, tiled=True)


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
    got_SCD = _exchange(jnp.where(keep[..., None], send_AD[idx], 0), axis)
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
    back_PCD = _exchange(blocks, axis)          # back[p]: my rows that rank p computed
    totals_P = jnp.sum(counts_SPG[rank], axis=1)
    q = jnp.arange(rows, dtype=jnp.int32)
    p = jnp.minimum(jnp.searchsorted(jnp.cumsum(totals_P), q, side="right"), n - 1)
    ok = q < jnp.sum(totals_P)
    out = back_PCD[p, jnp.clip(q - _exclusive(totals_P)[p], 0, capacity_per_source - 1)]
    return jnp.where(ok[:, None], out, 0)
