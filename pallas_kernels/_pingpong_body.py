"""The grouped GEMM's kernel bodies on one SMEM ring across work items: the ping-pong schedule
(`GemmTiling.schedule='pingpong'`) and the chained cooperative weight gradient (`chain_items=True`).

    pingpong_kernel(table_ref, num_valid_ref, x_gmem, w_gmem, out_gmem, cfg=..., transpose_w=...)
    ring_weight_grad_kernel(table_ref, x_gmem, dy_gmem, dw_gmem, cfg=...)    (both schedules)

Same work tables, same stores and the same results as the cooperative bodies (`ragged_kernel` in
_ragged_body.py, `_weight_grad_kernel` in grouped_gemm.py); what differs is who computes a tile. In the
cooperative schedule both compute warpgroups share one CTA tile, so while they run the epilogue (fp32
accumulator -> bf16 -> SMEM -> TMA store) no MMA runs on the SM. Here each compute warpgroup owns whole work
items (tile_m x tile_n; the CTA's items alternate between them), so one warpgroup's epilogue runs while the
other's MMAs do. That pays where an item's reduction is short and the epilogue a large share of it.

The memory warpgroup fills one ring of `max_concurrent_steps` SMEM stages (`_Ring`) in item order. Barriers:
  * `full[c * S + s]`: stage s holds the next reduction step of compute warpgroup c (two TMA copies arrive).
    One array per warpgroup because a waiter's phase is tracked per thread (a bit flipped on every wait):
    a warpgroup must see every phase of the barriers it waits on, so it waits only on its own.
  * `empty[s]`: whichever warpgroup read stage s released it; the memory warpgroup waits for it before
    the stage's next copy (it is the only waiter, so it sees every phase).
A warpgroup keeps one wgmma group in flight (it waits for step k-1 after issuing step k, then releases k-1's
stage): unlike the cooperative schedule no second warpgroup fills the MMA pipe between its steps.

No hooks (`ctas`, `before_slot`, `store_tile`) and no split_k: the fused exchange kernels keep the
cooperative schedule.

The chained weight gradient (`ring_weight_grad_kernel` with a cooperative cfg) is the cooperative one
(`_weight_grad_kernel`'s tiles: both compute warpgroups on one CTA tile) on the same ring, so that the memory
warpgroup runs on into the next item's token blocks while the compute warpgroups store this item's tile: the
pipeline fill between items is hidden (jax's pipelines chain only static grids, and a group's token blocks are
a traced count). Both warpgroups read every stage, so there is one full-barrier array, which both wait on in
order (each sees every phase), and a stage's `empty` barrier counts both releases.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._grouped_tiles import (NUM_COMPUTE_WGS, PINGPONG_MAX_STAGES, PINGPONG_MIN_STAGES, GemmTiling,
                                           epilogue_smem, stage_zeros, store_rows, swizzle_transforms, warpgroup_tile,
                                           weight_grad_step)
from pallas_kernels._work_tables import ROW_ALIGN

__all__ = ["pingpong_kernel", "ring_weight_grad_kernel"]

MEMORY_REGISTERS = 40     # what the TMA-issuing warpgroup keeps, as in jax's warp-specialised pipelines
COMPUTE_REGISTERS = 232   # (512 - 40) / 2 rounded down to a multiple of 8: each holds a 128 x 128 fp32 tile


class _Ring(NamedTuple):
    """The SMEM stages both operands cycle through, and their barriers (see the module docstring)."""
    a_smem: object
    b_smem: object
    full: object
    empty: object

    @property
    def stages(self):
        return self.a_smem.shape[0]

    def load(self, owner, step, a_src, b_src):
        """Memory warpgroup: the CTA's reduction step `step` (counted over all its items) for the full-barrier
        array `owner` (a compute warpgroup's own; 0 on a shared ring)."""
        stage = lax.rem(step, self.stages)
        pl.when(step >= self.stages)(lambda: plgpu.barrier_wait(self.empty.at[stage]))
        barrier = self.full.at[owner * self.stages + stage]
        plgpu.copy_gmem_to_smem(a_src, self.a_smem.at[stage], barrier)
        plgpu.copy_gmem_to_smem(b_src, self.b_smem.at[stage], barrier)

    def drain(self, total_steps):
        """Memory warpgroup, after its last load: waits for the releases not yet waited for (the last
        `stages` steps), so that no barrier is left mid-phase and no stage is being read when the kernel ends."""
        @pl.loop(jnp.maximum(total_steps - self.stages, 0), total_steps)
        def _drain(step):
            plgpu.barrier_wait(self.empty.at[lax.rem(step, self.stages)])

    def accumulate(self, owner, step0, num_steps, acc_ref, mma):
        """A compute warpgroup: steps [step0, step0 + num_steps) of full-barrier array `owner` into acc_ref;
        `mma(acc_ref, index, a, b)` issues the wgmma of one stage's tiles (index: the step within the item).
        Every stage read is released."""
        def k_step(kk, acc_ref):
            stage = lax.rem(step0 + kk, self.stages)
            plgpu.barrier_wait(self.full.at[owner * self.stages + stage])
            mma(acc_ref, kk, self.a_smem.at[stage], self.b_smem.at[stage])
            plgpu.wgmma_wait(1)   # step kk - 1 is done: its stage can be refilled
            pl.when(kk > 0)(lambda: plgpu.barrier_arrive(self.empty.at[lax.rem(step0 + kk - 1, self.stages)]))
            return acc_ref

        acc_ref = lax.fori_loop(0, num_steps, k_step, acc_ref)
        plgpu.wgmma_wait(0)
        pl.when(num_steps > 0)(
            lambda: plgpu.barrier_arrive(self.empty.at[lax.rem(step0 + num_steps - 1, self.stages)]))
        return acc_ref


def _ring_scope(a_block, a_dtype, b_block, b_dtype, stages, transforms, out_smem, shared=False):
    """pl.run_scoped over the ring (operand blocks `a_block`, `b_block`) and the epilogue staging: a decorator
    whose body takes (ring, out_smem). `shared`: both compute warpgroups read every stage (one full-barrier
    array; a stage is free once both released it)."""
    assert PINGPONG_MIN_STAGES <= stages <= PINGPONG_MAX_STAGES, stages   # check_tiling's bounds
    full_arrays, releases = (1, NUM_COMPUTE_WGS) if shared else (NUM_COMPUTE_WGS, 1)

    def decorator(body):
        @functools.partial(
            pl.run_scoped, collective_axes="wg",
            a_smem=plgpu.SMEM((stages, *a_block), a_dtype, transforms=transforms[0]),
            b_smem=plgpu.SMEM((stages, *b_block), b_dtype, transforms=transforms[1]),
            full=plgpu.Barrier(num_arrivals=2, num_barriers=full_arrays * stages),   # two copies per stage
            empty=plgpu.Barrier(num_arrivals=releases, num_barriers=stages), out_smem=out_smem)
        def _scope(a_smem, b_smem, full, empty, out_smem):
            body(_Ring(a_smem, b_smem, full, empty), out_smem)
    return decorator


def _owner(info):   # the CTA's items alternate between the compute warpgroups
    return lax.rem(info.local_index, NUM_COMPUTE_WGS)


def _memory_role():
    plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")


def _compute_role():
    plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")


def pingpong_kernel(table_ref, num_valid_ref, x_gmem, w_gmem, out_gmem, *, cfg: GemmTiling, transpose_w: bool):
    """out[rows of g] = x[rows of g] @ (w[g]ᵀ if transpose_w else w[g]); w is [G, K, N] or [G, N, K]."""
    assert cfg.schedule == "pingpong" and cfg.split_k == 1, cfg
    k, n = x_gmem.shape[1], out_gmem.shape[1]
    tm, tn, tk = cfg.tile_m, cfg.tile_n, cfg.tile_k
    n_iters, k_iters = n // tn, k // tk
    tf = swizzle_transforms(tk, x_gmem.dtype)
    w_block = (tn, tk) if transpose_w else (tk, tn)

    @_ring_scope((tm, tk), x_gmem.dtype, w_block, w_gmem.dtype, cfg.max_concurrent_steps, (tf, tf),
                 epilogue_smem(cfg, out_gmem.dtype))
    def _scope(ring, out_smem):
        wg = lax.axis_index("wg")
        num_compute, num_tail = num_valid_ref[0], num_valid_ref[1]

        def item_tile(index):
            """(table slot, column tile) of compute item `index`, in the cooperative kernel's snake order."""
            return plgpu.planar_snake(index, (num_compute, n_iters), cfg.grid_minor, cfg.grid_tile_width)

        @pl.when(wg == NUM_COMPUTE_WGS)
        def _memory():
            _memory_role()

            @plgpu.nd_loop((num_compute * n_iters,), collective_axes="sm")
            def _items(info):
                slot, ni = item_tile(info.index[0])
                seg, row0 = table_ref[0, slot], pl.multiple_of(table_ref[1, slot], ROW_ALIGN)
                w_cols = pl.ds(ni * tn, tn)

                @pl.loop(0, k_iters)
                def _steps(kk):
                    k_cols = pl.ds(pl.multiple_of(kk * tk, tk), tk)
                    w_tile = w_gmem.at[seg].at[w_cols, k_cols] if transpose_w else w_gmem.at[seg].at[k_cols, w_cols]
                    ring.load(_owner(info), info.local_index * k_iters + kk, x_gmem.at[pl.ds(row0, tm), k_cols],
                              w_tile)

                pl.when(info.local_index == info.num_local_steps - 1)(
                    lambda: ring.drain((info.local_index + 1) * k_iters))

        @pl.when(wg < NUM_COMPUTE_WGS)
        def _compute():
            _compute_role()

            def store(acc, slot, ni, zeros_staged=False):
                _, row0, lo, count = (table_ref[i, slot] for i in range(4))
                store_rows(acc, out_smem.at[wg], out_gmem, row0, ni * tn, cfg, rows=(lo, count),
                           zeros_staged=zeros_staged)

            def mma(acc_ref, _, x_smem, w_smem):
                plgpu.wgmma(acc_ref, x_smem, w_smem.transpose((1, 0)) if transpose_w else w_smem)

            @plgpu.nd_loop((num_compute * n_iters,), collective_axes="sm")
            def _items(info):
                @pl.when(_owner(info) == wg)
                def _mine():
                    slot, ni = item_tile(info.index[0])

                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tm, tn), jnp.float32))
                    def _acc(acc_ref):
                        acc_ref = ring.accumulate(wg, info.local_index * k_iters, k_iters, acc_ref, mma)
                        store(acc_ref[...], slot, ni)

            # The zero tail as in ragged_kernel (rows past sum(group_sizes), no loads, no MMA), its items
            # alternating between the two compute warpgroups like the compute items.
            pl.when(num_tail > 0)(lambda: stage_zeros(out_smem.at[wg]))

            @plgpu.nd_loop((num_tail * n_iters,), collective_axes="sm")
            def _tail(info):
                @pl.when(_owner(info) == wg)
                def _mine():
                    item = info.index[0]
                    store(None, num_compute + item // n_iters, item % n_iters, zeros_staged=True)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def ring_weight_grad_kernel(table_ref, x_gmem, dy_gmem, dw_gmem, *, cfg: GemmTiling):
    """dw[g] = x[rows of g]ᵀ @ dy[rows of g]; tile_m runs over K, tile_n over N, tile_k over tokens. An item's
    reduction is its group's token blocks (token_block_table gives an empty group one block, masked whole, so
    it stores zeros; a count of zero would too), so both sides count the CTA's steps with a running sum over
    its items. `cfg.schedule='pingpong'`: an item is one warpgroup's tile_m x tile_n, the items alternating
    between them; cooperative with `cfg.chain_items`: both warpgroups on every item (CTA tile cta_m x cta_n,
    each its `warpgroup_tile` part, as `_weight_grad_kernel`), every stage of the ring read by both."""
    pingpong = cfg.schedule == "pingpong"
    assert pingpong or cfg.chain_items, cfg
    num_groups, k, n = dw_gmem.shape
    cm, cn, tk = cfg.cta_m, cfg.cta_n, cfg.tile_k     # a ping-pong item's cta_m x cta_n is tile_m x tile_n
    k_iters, n_iters = k // cm, n // cn
    transforms = (swizzle_transforms(64, x_gmem.dtype), swizzle_transforms(64, dy_gmem.dtype))

    def item_tile(info):
        g = info.index[0]
        ki, ni = plgpu.planar_snake(info.index[1], (k_iters, n_iters), cfg.grid_minor, cfg.grid_tile_width)
        return g, ki, ni

    def barriers(info):   # whose full barriers the item's stages arrive on
        return _owner(info) if pingpong else 0

    @_ring_scope((tk, cm), x_gmem.dtype, (tk, cn), dy_gmem.dtype, cfg.max_concurrent_steps, transforms,
                 epilogue_smem(cfg, dw_gmem.dtype), shared=not pingpong)
    def _scope(ring, out_smem):
        wg = lax.axis_index("wg")

        @pl.when(wg == NUM_COMPUTE_WGS)
        def _memory():
            _memory_role()

            @plgpu.nd_loop((num_groups, k_iters * n_iters), collective_axes="sm", init_carry=jnp.int32(0))
            def total(info, carry):
                g, ki, ni = item_tile(info)
                first, num_blocks = table_ref[0, g], table_ref[1, g]

                @pl.loop(0, num_blocks)
                def _steps(t):
                    tokens = pl.ds(pl.multiple_of((first + t) * tk, tk), tk)
                    ring.load(barriers(info), carry + t, x_gmem.at[tokens, pl.ds(ki * cm, cm)],
                              dy_gmem.at[tokens, pl.ds(ni * cn, cn)])
                return carry + num_blocks

            ring.drain(total)

        @pl.when(wg < NUM_COMPUTE_WGS)
        def _compute():
            _compute_role()
            part = None if pingpong else warpgroup_tile(cfg, wg)   # a ping-pong warpgroup owns its whole item

            @plgpu.nd_loop((num_groups, k_iters * n_iters), collective_axes="sm", init_carry=jnp.int32(0))
            def _items(info, carry):
                g, ki, ni = item_tile(info)
                first, num_blocks, start, end = (table_ref[i, g] for i in range(4))

                def mma(acc_ref, t, x_smem, dy_smem):
                    x_mine = x_smem if part is None else x_smem.at[:, part.rows]
                    dy_mine = dy_smem if part is None else dy_smem.at[:, part.cols]
                    weight_grad_step(acc_ref, x_mine, dy_mine, t, num_blocks, (first + t) * tk, start, end)

                def run():
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((cfg.tile_m, cfg.tile_n), jnp.float32))
                    def _acc(acc_ref):
                        acc = ring.accumulate(wg if pingpong else 0, carry, num_blocks, acc_ref, mma)[...]
                        row0, col0 = (ki * cm, ni * cn) if part is None else \
                            (ki * cm + part.row0, ni * cn + part.col0)
                        store_rows(acc, out_smem.at[wg], dw_gmem.at[g], row0, col0, cfg)

                pl.when(_owner(info) == wg)(run) if pingpong else run()
                return carry + num_blocks

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
