"""Grouped GEMM + gather + RS in one Mosaic GPU kernel, the mirror of all_gather_grouped_gemm.py: the last expert
GEMM over the receive-ordered rows, each output tile's rows stored straight from the epilogue into the return
buffer of the source rank they came from, at the rows that rank sent them from.

A receiver's rows sit in (local expert, source rank) order (`_dispatch_tables.py`), so a row tile of one
expert holds the runs of one or two sources (`tile_sources`); for each, the epilogue stores the rows of that
run into the source's buffer (point-to-point `plgpu.remote_ref` TMA stores of 2^i-row boxes; never NVLink
multicast). The buffer is the source's send order (destination, expert), so after the kernel each rank holds
its own rows' expert outputs in the order it sent them, and the reduction over top-k (the RS) is a local
weighted sum in fp32 (parallel/expert_runs.py). Every computing warpgroup signals every peer once its stores
have landed; each rank's CTA 0 waits for all peers' signals before the kernel ends, so XLA reads only
finished rows. The zero tail is not computed (its rows belong to no source).

    ret_AD = grouped_gemm_reduce_scatter(h_RF, counts_SPG, w_GFD, axis=..., rows=T * K)

Twin: `grouped_gemm_reduce_scatter_reference` (the grouped GEMM's plain twin, an all-gather of every rank's
outputs, each of this rank's rows picked out). `return_rows_locally` runs the computing side with each peer's
stores landing in a local buffer instead (no semaphores, so the CPU interpreter runs it): the tests check the
run arithmetic there. Backward (custom VJP, `reduce_scatter_backward`): the return's transpose (`run_exchange_
reference.receive_runs`: the cotangents to the receive order, one all-to-all), then the grouped GEMM kernel's
dgrad and wgrad. Not yet run on several GPUs.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._dispatch_tables import receive_layout, receive_work, send_runs
from pallas_kernels._default_tuning import default_tuning
from pallas_kernels._grouped_tiles import (NUM_COMPUTE_WGS, GemmTiling, check_dtypes, fit_ragged_tiling,
                                           persistent_kernel, sm_count, store_rows)
from pallas_kernels._peer_checks import check_exchange_runnable
from pallas_kernels._ragged_body import ragged_kernel
from pallas_kernels._work_tables import ROW_ALIGN
from pallas_kernels.grouped_gemm import grouped_gemm_dgrad, grouped_gemm_wgrad
from pallas_kernels.grouped_gemm_reference import grouped_gemm_reference
from pallas_kernels.run_exchange_reference import receive_runs
from pallas_kernels.varying import match_varying, vary_like

__all__ = ["grouped_gemm_reduce_scatter", "grouped_gemm_reduce_scatter_reference", "reduce_scatter_backward",
           "return_rows_locally"]


def _return_table(counts_SPG, rank):
    """int32 [3, n, G] for receiver `rank`: each (source, expert) run's first receive row, the row of its
    first row in the source's send order, and its rows."""
    counts_SG = jnp.maximum(counts_SPG[:, rank, :], 0)
    _, run_start = receive_layout(counts_SG)
    back_start = jax.vmap(lambda s: send_runs(counts_SPG, s)[0][rank])(jnp.arange(counts_SPG.shape[0]))
    return jnp.stack([run_start, back_start, counts_SG]).astype(jnp.int32)


def _store_by_source(table_ref, tile_src_ref, back_ref, *, n: int, rank, cfg: GemmTiling, target):
    """The epilogue hook (`ragged_kernel(store_tile=...)`): the warpgroup's rows of the slot that belong to
    source s = rank + j, for each peer j whose run the slot covers, stored at their send-order rows."""
    def store_tile(acc, staging, slot, first_row, col0, rows):
        seg, lo_src, hi_src = table_ref[0, slot], tile_src_ref[0, slot], tile_src_ref[1, slot]
        wlo, wcount = rows
        for j in range(n):   # static: a peer's TMA descriptor is built from the rank alone
            s = lax.rem(rank + j, n)
            start, back, count = back_ref[0, s, seg], back_ref[1, s, seg], back_ref[2, s, seg]
            a = jnp.clip(start - first_row, wlo, wlo + wcount)          # the run's rows inside this tile part
            b = jnp.clip(start + count - first_row, wlo, wlo + wcount)
            pl.when((s >= lo_src) & (s <= hi_src) & (b > a))(functools.partial(
                store_rows, acc, staging, target(j), back - start + first_row, col0, cfg, rows=(a, b - a)))
    return store_tile


def _kernel(table_ref, num_valid_ref, tile_src_ref, back_ref, h_gmem, w_gmem, ret_gmem, *, cfg: GemmTiling, n: int,
            axis, rank=None):
    """h_gmem [R, F] receive-ordered rows, w_gmem [G, F, D]; ret_gmem [A, D] (the exchange: this rank's return
    buffer, written by the peers) or, with a static `rank` (local mode), [n, A, D] with peer j's stores in [j]."""
    local = rank is not None
    wg, cta = lax.axis_index("wg"), lax.axis_index("sm")
    if local:
        target = lambda j: ret_gmem.at[j]  # noqa: E731
    else:
        rank = lax.axis_index(axis)
        sems = [pl.get_global(plgpu.SemaphoreType.REGULAR) for _ in range(n)]   # peer j's stores count into [j]
        target = lambda j: ret_gmem if j == 0 else plgpu.remote_ref(ret_gmem, {axis: lax.rem(rank + j, n)})  # noqa: E731
    hook = _store_by_source(table_ref, tile_src_ref, back_ref, n=n, rank=rank, cfg=cfg, target=target)
    out_shape_ref = ret_gmem.at[0] if local else ret_gmem
    ragged_kernel(table_ref, num_valid_ref, h_gmem, w_gmem, out_shape_ref, cfg=cfg, transpose_w=False, store_tile=hook)
    if local:
        return

    @pl.when(wg < NUM_COMPUTE_WGS)
    def _signal():   # this warpgroup's stores have landed at their peers
        plgpu.wait_smem_to_gmem(0, wait_read_only=False)
        for j in range(n):
            dest = lax.rem(rank + j, n)
            if j == 0:
                pl.semaphore_signal(sems[0])
            else:
                pl.semaphore_signal(sems[j], device_id={axis: dest})

    @pl.when((cta == 0) & (wg == 0))
    def _wait():   # rank - j's warpgroups signalled sems[j] on this rank once each
        for j in range(n):
            pl.semaphore_wait(sems[j], NUM_COMPUTE_WGS * lax.axis_size("sm"))



def _validate(h_RF, counts_SPG, w_GFD, tiling):
    if h_RF.ndim != 2 or w_GFD.ndim != 3 or counts_SPG.ndim != 3:
        raise ValueError(f"h_RF must be [R, F], counts_SPG [n, n, G] and w_GFD [G, F, D]; got {h_RF.shape}, "
                         f"{counts_SPG.shape}, {w_GFD.shape}")
    (r, f), (g, f2, d) = h_RF.shape, w_GFD.shape
    if counts_SPG.shape[1:] != (counts_SPG.shape[0], g) or not jnp.issubdtype(counts_SPG.dtype, jnp.integer):
        raise ValueError(f"counts_SPG must be int [n, n, G={g}]; got {counts_SPG.dtype} {counts_SPG.shape}")
    if f != f2:
        raise ValueError(f"h_RF has F={f} but w_GFD has F={f2}; they must match")
    check_dtypes("h_RF", h_RF, "w_GFD", w_GFD, None)
    for name, dim in (("F", f), ("D (w_GFD dim 2)", d)):   # before the default tiles, which need both
        if dim % 64:
            raise ValueError(f"grouped_gemm_reduce_scatter: {name}={dim} must be a multiple of 64; pad it")
    cfg = fit_ragged_tiling(tiling or default_tuning(r, f, d, g, pingpong=False).fwd, f, h_RF.dtype)
    for name, dim, tile in (("D (w_GFD dim 2)", d, cfg.cta_n), ("F", f, cfg.tile_k), ("R (h_RF rows)", r, ROW_ALIGN)):
        if dim % tile:
            raise ValueError(f"grouped_gemm_reduce_scatter: {name}={dim} must be a multiple of {tile}; pad it")
    if r < cfg.cta_m or cfg.split_k != 1:
        raise ValueError(f"grouped_gemm_reduce_scatter: needs R={r} >= the row tile {cfg.cta_m} and tiling.split_k 1")
    return cfg


def _tables(counts_SPG, rank, capacity, cfg):
    """The receiver's work without the zero tail (its rows belong to no source) and the return table."""
    _, table, num_valid, tile_src = receive_work(counts_SPG, rank, capacity, cfg.cta_m, with_tail=False)
    return table, num_valid, tile_src, _return_table(counts_SPG, rank)


def grouped_gemm_reduce_scatter_reference(h_RF, counts_SPG, w_GFD, *, axis, rows: int):
    """The twin, inside shard_map over `axis`: y = h @ w per local expert (fp32 accumulation, h's dtype), every
    rank's y all-gathered, and for each of this rank's `rows` send-order rows (destination p, expert e) the
    output rank p computed for it; zeros past the rows it routed."""
    rank, n = lax.axis_index(axis), counts_SPG.shape[0]
    counts = jnp.maximum(counts_SPG, 0)
    group_sizes = jnp.sum(counts[:, rank, :], axis=0)
    y_all = lax.all_gather(grouped_gemm_reference(h_RF, w_GFD, group_sizes), axis)      # [n, R, D]
    run_start_P = jax.vmap(lambda p: receive_layout(counts[:, p, :])[1][rank])(jnp.arange(n))   # [n, G]
    mine = counts[rank].reshape(-1)                                                      # runs (p, e) in send order
    ends = jnp.cumsum(mine)
    q = jnp.arange(rows, dtype=jnp.int32)
    run = jnp.minimum(jnp.searchsorted(ends, q, side="right"), mine.shape[0] - 1)
    p, e = run // counts.shape[2], run % counts.shape[2]
    src = run_start_P[p, e] + q - (ends[run] - mine[run])
    out = y_all[p, jnp.clip(src, 0, h_RF.shape[0] - 1)]
    return jnp.where((q < ends[-1])[:, None], out, 0).astype(h_RF.dtype)


def grouped_gemm_reduce_scatter(h_RF, counts_SPG, w_GFD, *, axis, rows: int, tiling: GemmTiling | None = None,
                                num_sms: int | None = None, source_rows: int | None = None):
    """`grouped_gemm_reduce_scatter_reference(...)` as one kernel, inside shard_map over a mesh with `axis` (n
    ranks), one process driving all its GPUs. h_RF [R, F] bf16/f16: this rank's received rows in (expert, source)
    order (R a multiple of 8 and >= the row tile); counts_SPG [n, n, G] int, the same on every rank; w_GFD
    [G, F, D]. Returns [rows, D]: this rank's send-order rows' expert outputs (zeros past its routed rows).
    Differentiable (`reduce_scatter_backward`; `source_rows` bounds the rows one source routes to one rank, the
    all-to-all blocks of the backward: default `rows`)."""
    cfg = _validate(h_RF, counts_SPG, w_GFD, tiling)
    check_exchange_runnable("grouped_gemm_reduce_scatter", interpret=False, ranks=counts_SPG.shape[0],
                            operand="counts_SPG", axis=axis)
    source_rows = source_rows or -(-rows // ROW_ALIGN) * ROW_ALIGN
    return _exchanged(h_RF, counts_SPG, w_GFD, cfg, axis, rows, num_sms or sm_count(False), source_rows)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _exchanged(h_RF, counts_SPG, w_GFD, cfg, axis, rows, num_sms, source_rows):
    n, rank = counts_SPG.shape[0], lax.axis_index(axis)
    table, num_valid, tile_src, back = _tables(counts_SPG, rank, h_RF.shape[0], cfg)
    body = functools.partial(_kernel, cfg=cfg, n=n, axis=axis)
    ret = persistent_kernel(body, jax.ShapeDtypeStruct((rows, w_GFD.shape[2]), h_RF.dtype), num_sms, False)(
        table, num_valid, tile_src, back, h_RF, w_GFD)
    total = jnp.sum(jnp.maximum(counts_SPG[rank], 0))   # rows past the routed ones were never written
    ret = jnp.where(jnp.arange(rows)[:, None] < total, ret, jnp.zeros((), ret.dtype))
    return vary_like(ret, h_RF, w_GFD, axes=(axis,))


def _exchanged_fwd(h_RF, counts_SPG, w_GFD, cfg, axis, rows, num_sms, source_rows):
    return _exchanged(h_RF, counts_SPG, w_GFD, cfg, axis, rows, num_sms, source_rows), (h_RF, counts_SPG, w_GFD)


def _exchanged_bwd(cfg, axis, rows, num_sms, source_rows, residuals, d_ret):
    h_RF, counts_SPG, w_GFD = residuals
    dh, dw = reduce_scatter_backward(h_RF, counts_SPG, w_GFD, d_ret, axis=axis, source_rows=source_rows)
    return match_varying(dh, h_RF, d_ret), None, match_varying(dw, w_GFD, h_RF, d_ret)


def reduce_scatter_backward(h_RF, counts_SPG, w_GFD, d_ret_AD, *, axis, source_rows: int, dgrad=None, wgrad=None):
    """The cotangents of (h_RF, w_GFD) from the returned rows': those moved to the receive order (the return's
    transpose), then the GEMM's input and weight gradients. `dgrad` / `wgrad` as in all_gather_grouped_gemm's
    `dispatch_backward` (the kernel's by default)."""
    dgrad = dgrad or functools.partial(grouped_gemm_dgrad, preferred_element_type=h_RF.dtype)
    wgrad = wgrad or functools.partial(grouped_gemm_wgrad, preferred_element_type=w_GFD.dtype)
    d_y, group_sizes = receive_runs(d_ret_AD.astype(h_RF.dtype), counts_SPG, axis=axis, capacity_per_source=source_rows)
    r = h_RF.shape[0]   # every received row lies below r: the rest of the all-to-all's rows are zeros
    d_y = d_y[:r] if d_y.shape[0] >= r else jnp.pad(d_y, ((0, r - d_y.shape[0]), (0, 0)))
    return dgrad(d_y, w_GFD, group_sizes).astype(h_RF.dtype), wgrad(h_RF, d_y, group_sizes).astype(w_GFD.dtype)


_exchanged.defvjp(_exchanged_fwd, _exchanged_bwd)


def return_rows_locally(h_RF, counts_SPG, w_GFD, *, rank: int, rows: int, tiling: GemmTiling | None = None,
                        num_sms: int | None = None, interpret: bool = False):
    """The computing side alone, for tests: rank `rank`'s GEMM outputs for source rank + j land in out[j] (a
    local [rows, D] buffer standing for that source's return buffer); rows no store writes keep what the
    buffer held. No semaphores (the CPU interpreter runs it)."""
    cfg = _validate(h_RF, counts_SPG, w_GFD, tiling)
    n = counts_SPG.shape[0]
    table, num_valid, tile_src, back = _tables(counts_SPG, rank, h_RF.shape[0], cfg)
    body = functools.partial(_kernel, cfg=cfg, n=n, axis=None, rank=rank)
    out = jax.ShapeDtypeStruct((n, rows, w_GFD.shape[2]), h_RF.dtype)
    return persistent_kernel(body, out, num_sms or sm_count(interpret), interpret)(
        table, num_valid, tile_src, back, h_RF, w_GFD)
