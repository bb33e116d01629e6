"""The grouped GEMM's forward / input-gradient kernel body, shared by the kernels that run its work items:
`grouped_gemm.py` (on every SM) and `all_gather_grouped_gemm.py` (on the SMs the exchange leaves free, each
work item first waiting for the source ranks whose rows it reads).

    ragged_kernel(table_ref, num_valid_ref, x_gmem, w_gmem, out_gmem, cfg=..., transpose_w=...,
                  ctas=None, before_slot=None)

`ctas=(first, count)` runs the work items on CTAs [first, first + count) only (the others do something else
in the same kernel); `before_slot(slot)` runs in the memory warpgroup right before a work item's first load
(a semaphore wait: the rows of that slot are written by other ranks during the kernel); `store_tile(acc,
staging, slot, first_row, col0, rows)` replaces a computed tile's store (the warpgroup's fp32 accumulator, its
SMEM staging, the slot, its first row and column in the output, rows=(lo, count) of it that are the slot's)
with the caller's (grouped_gemm_reduce_scatter.py stores each source's rows into that rank's buffer).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._grouped_tiles import (NUM_COMPUTE_WGS, GemmTiling, epilogue_smem, stage_zeros, store_rows,
                                           swizzle_transforms, warpgroup_tile)
from pallas_kernels._pingpong_body import pingpong_kernel
from pallas_kernels._work_tables import ROW_ALIGN

__all__ = ["ragged_kernel"]


class _Step(NamedTuple):   # what the loop bodies read of plgpu.nd_loop's NDLoopInfo
    index: tuple
    local_index: object
    num_local_steps: object


def _cta_loop(num_items, ctas):
    """A decorator looping `body(info)` over this CTA's share of num_items: plgpu.nd_loop over every SM, or
    with ctas=(first, count) items cta - first, + count, ... on CTAs [first, first + count) (nd_loop's order)."""
    if ctas is None:
        return plgpu.nd_loop((num_items,), collective_axes="sm")
    first, count = ctas

    def decorator(body):
        mine = lax.axis_index("sm") - first
        # CTAs before `first` (mine < 0) take none: they run the kernel's other role
        upper = jnp.where(mine >= 0, jnp.maximum((num_items - mine + count - 1) // count, 0), 0)

        @pl.loop(0, upper)
        def _steps(i):
            body(_Step((mine + i * count,), i, upper))
    return decorator


def ragged_kernel(table_ref, num_valid_ref, x_gmem, w_gmem, out_gmem, *, cfg: GemmTiling, transpose_w: bool,
                  ctas=None, before_slot=None, store_tile=None):
    """out[rows of g] = x[rows of g] @ (w[g]ᵀ if transpose_w else w[g]); w is [G, K, N] or [G, N, K].

    Each SM runs its compute work items first, then its zero-tail items. With `cfg.chain_items` the
    compute items' K pipelines are chained (pipeline_state START / STEADY / STOP): the TMA warpgroup runs
    ahead into the next item's loads while the compute warpgroups store this item's tile, so the epilogue
    and the pipeline fill are hidden (they are a large share of an item when K is short: fine-grained
    experts). Without it each item's pipeline fills and drains on its own.

    With `cfg.split_k` = S > 1 every work item is S items, each over one S-th of K, storing an fp32 partial at
    rows ks * M of out_gmem [S * M, N] (the tail's zeros in every partial); the launcher sums them.
    `ctas`, `before_slot`, `store_tile`: see the module docstring (the hooks need an unsplit reduction).
    `cfg.schedule='pingpong'` runs `pingpong_kernel` instead (no hooks)."""
    if cfg.schedule == "pingpong":
        if ctas is not None or before_slot is not None or store_tile is not None:
            raise ValueError("tuning schedule='pingpong' takes no ctas / before_slot / store_tile hooks: use "
                             "schedule='cooperative' for the fused exchange kernels")
        return pingpong_kernel(table_ref, num_valid_ref, x_gmem, w_gmem, out_gmem, cfg=cfg, transpose_w=transpose_w)
    assert (before_slot is None and store_tile is None) or cfg.split_k == 1, "the hooks need split_k = 1"
    m, k = x_gmem.shape
    n = out_gmem.shape[1]
    splits = cfg.split_k
    n_iters = n // cfg.cta_n
    k_span = k // splits          # the reduction each item runs over
    k_iters = k_span // cfg.tile_k
    in_tf = swizzle_transforms(cfg.tile_k, x_gmem.dtype)
    w_block = (cfg.cta_n, cfg.tile_k) if transpose_w else (cfg.tile_k, cfg.cta_n)
    chain = cfg.chain_items and k_iters % cfg.max_concurrent_steps == 0

    def split_of(index, per_split):
        """(K split, item within the split) of a linear item index; no index arithmetic when unsplit."""
        return (index // per_split, index % per_split) if splits > 1 else (0, index)

    cur = {"slot": None}   # the work item's slot while its pipeline is traced (None: no waits, e.g. allocations)

    def x_index(kk):
        # traced where the memory warpgroup issues the x copies: the wait comes before the item's first load
        if before_slot is not None and cur["slot"] is not None:
            slot = cur["slot"]
            pl.when(kk == 0)(lambda: before_slot(slot))
        return 0, kk

    def pipeline(body, context, state=None):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k_iters,), memory_registers=40, wg_axis="wg",
            num_compute_wgs=NUM_COMPUTE_WGS, max_concurrent_steps=cfg.max_concurrent_steps,
            compute_context=context, pipeline_state=state,
            in_specs=[
                plgpu.BlockSpec((cfg.cta_m, cfg.tile_k), x_index, transforms=in_tf),
                plgpu.BlockSpec(w_block, (lambda kk: (0, kk)) if transpose_w else (lambda kk: (kk, 0)),
                                transforms=in_tf),
            ])

    ignore = lambda *_, **__: None  # noqa: E731  (allocations do not depend on the bodies)
    w_shape_ref = w_gmem.at[0, :cfg.cta_n, :k_span] if transpose_w else w_gmem.at[0, :k_span, :cfg.cta_n]
    allocs = pipeline(ignore, ignore).get_allocations(x_gmem.at[:cfg.cta_m, :k_span], w_shape_ref)

    @functools.partial(pl.run_scoped, allocs=allocs, collective_axes="wg",
                       out_smem=epilogue_smem(cfg, out_gmem.dtype))
    def _scope(allocs, out_smem):
        wg = lax.axis_index("wg")
        num_compute, num_tail = num_valid_ref[0], num_valid_ref[1]
        wg_m, wg_n, wg_row0, wg_col0 = warpgroup_tile(cfg, wg)

        def store(acc, slot, ni, ks, zeros_staged=False):
            """This warpgroup's part of work item (slot, ni) of K split ks: acc (fp32) or zeros (acc None)."""
            _, row0, lo, count = (table_ref[i, slot] for i in range(4))
            wlo = jnp.clip(lo - wg_row0, 0, cfg.tile_m)
            whi = jnp.clip(lo + count - wg_row0, 0, cfg.tile_m)
            if store_tile is not None and acc is not None:
                store_tile(acc, out_smem.at[wg], slot, row0 + wg_row0, ni * cfg.cta_n + wg_col0, (wlo, whi - wlo))
                return
            store_rows(acc, out_smem.at[wg], out_gmem, (ks * m if splits > 1 else 0) + row0 + wg_row0,
                       ni * cfg.cta_n + wg_col0, cfg, rows=(wlo, whi - wlo), zeros_staged=zeros_staged)

        def mma(_, x_smem, w_smem, acc_ref):
            w_op = w_smem.at[wg_n, :].transpose((1, 0)) if transpose_w else w_smem.at[:, wg_n]
            plgpu.wgmma(acc_ref, x_smem.at[wg_m], w_op)
            plgpu.wgmma_wait(0)
            return acc_ref

        @_cta_loop(num_compute * n_iters * splits, ctas)
        def _compute_items(info):
            # the splits outermost: the items running at a time are one split's, in the usual snake order
            ks, item = split_of(info.index[0], num_compute * n_iters)
            slot, ni = plgpu.planar_snake(item, (num_compute, n_iters), cfg.grid_minor, cfg.grid_tile_width)
            seg, row0 = table_ref[0, slot], pl.multiple_of(table_ref[1, slot], ROW_ALIGN)

            def context(eval_pipeline):
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((cfg.tile_m, cfg.tile_n), jnp.float32))
                def _acc(acc_ref):
                    eval_pipeline(acc_ref)
                    store(acc_ref[...], slot, ni, ks)

            k_part = pl.ds(pl.multiple_of(ks * k_span, cfg.tile_k), k_span) if splits > 1 else slice(None)
            x_tile = x_gmem.at[pl.ds(row0, cfg.cta_m), k_part]   # the table keeps every tile inside [0, M)
            w_cols = pl.ds(ni * cfg.cta_n, cfg.cta_n)
            w_tile = w_gmem.at[seg].at[w_cols, k_part] if transpose_w else w_gmem.at[seg].at[k_part, w_cols]
            # the slot is set only once the pipelines are built, so that jax's probe of the index maps while
            # building them traces no wait (as all_to_all_gemm.py sets its flag)
            if not chain:
                run = pipeline(mma, context)
                cur["slot"] = slot
                run(x_tile, w_tile, allocations=allocs)
                cur["slot"] = None
                return
            first, last = info.local_index == 0, info.local_index == info.num_local_steps - 1
            state = jnp.where(first, int(plgpu.PipelinePipeline.START),
                              jnp.where(last, int(plgpu.PipelinePipeline.STOP),
                                        int(plgpu.PipelinePipeline.STEADY)))
            plain, chained = pipeline(mma, context), pipeline(mma, context, state)
            cur["slot"] = slot
            # one item on this SM: a plain pipeline (it both fills and drains)
            pl.when(first & last)(lambda: plain(x_tile, w_tile, allocations=allocs))
            pl.when(jnp.logical_not(first & last))(lambda: chained(x_tile, w_tile, allocations=allocs))
            cur["slot"] = None

        # The zero tail (rows past sum(group_sizes)) is stored straight from zeros: no loads, no MMA, so an
        # expert-parallel receive buffer's unused rows cost one write. The staging SMEM is zeroed once, after
        # this SM's last compute item, and every tail store reads it with no wait between them.
        pl.when((wg < NUM_COMPUTE_WGS) & (num_tail > 0))(lambda: stage_zeros(out_smem.at[wg]))

        @_cta_loop(num_tail * n_iters * splits, ctas)
        def _tail_items(info):
            @pl.when(wg < NUM_COMPUTE_WGS)
            def _():
                ks, item = split_of(info.index[0], num_tail * n_iters)
                store(None, num_compute + item // n_iters, item % n_iters, ks, zeros_staged=True)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
