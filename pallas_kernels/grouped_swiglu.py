"""The experts' first GEMMs and SwiGLU in one Mosaic GPU kernel: `h = silu(x @ gate[g]) * (x @ up[g])` per row
group g, with the two products `gate`, `up` also written out (the backward needs them).

Separately (model/moe/experts.py, `swiglu='separate'`) this is two grouped GEMM calls that each read x and
write their output, then an elementwise pass that reads both outputs back and writes h: on the Mixtral
block that pass was 0.36 ms of 36 per call at HBM speed (profile_block_1xh200.json, `loop_multiply_fusion`).
Here one work item is a (row tile of one group, 128 FFN columns) pair: each of the 2 compute warpgroups owns
64 of the tile's 128 rows and two fp32 accumulators of 64 x 128, one per weight, fed by the same x rows (one
x load for both products), and its epilogue rounds both to x's dtype, forms h from them in fp32 and stores
the three tiles. Both products are m64n128 wgmmas, so the shared-memory traffic per FLOP is the plain
kernel's (a 128 x 256 CTA tile). Rows past sum(group_sizes) are zeros in all three outputs (SwiGLU of zero
rows is zero), stored from SMEM with no loads, as the plain kernel's tail. Work tables, tiles, the ragged
epilogue: `_work_tables.py`, `_grouped_tiles.py` (shared with grouped_gemm.py).

    h, gate, up = grouped_swiglu_with_products(x_MD, w_gate_GDF, w_up_GDF, group_sizes_G)
    h = grouped_swiglu(x_MD, w_gate_GDF, w_up_GDF, group_sizes_G)          # differentiable

Twin: `grouped_swiglu_reference` (two `grouped_gemm_reference` products, each rounded to x's dtype, then
silu(gate) * up in fp32). Backward (custom VJP): the activation's derivative from the saved products
(elementwise, as autodiff of the separate form writes it), then the grouped GEMM kernels' dgrad / wgrad
for each weight (two dgrads summed, two wgrads), exactly the separate form's backward.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._grouped_tiles import (NUM_COMPUTE_WGS, GemmTiling, check_dtypes, check_group_sizes, epilogue_smem,
                                           fit_ragged_tiling, persistent_kernel, sm_count, stage_zeros, store_rows,
                                           swizzle_transforms)
from pallas_kernels._work_tables import ROW_ALIGN, TABLE_METHODS, cut_group_sizes, row_tile_table
from pallas_kernels.grouped_gemm import grouped_gemm_dgrad, grouped_gemm_wgrad
from pallas_kernels.grouped_gemm_reference import grouped_gemm_reference
from pallas_kernels.varying import match_varying, vary_like

__all__ = ["SwigluTiling", "grouped_swiglu", "grouped_swiglu_with_products", "grouped_swiglu_reference"]


@dataclasses.dataclass(frozen=True)
class SwigluTiling:
    """Tiles of the fused kernel: a CTA computes 2 x rows_per_wg rows by `cols` FFN columns of both products;
    K steps of `tile_k`, `stages` deep; chained pipelines across an SM's items (as the plain forward's
    default); `epi_slots` SMEM staging buffers per warpgroup for the three outputs' stores (see GemmTiling);
    `tables` how the work tables are computed (`row_tile_table`). `num_sms=None`: the device's."""
    rows_per_wg: int = 64
    cols: int = 128
    # 128-wide K steps two deep: the fastest swept (bench_grouped_swiglu_h200.json; Mixtral forward 6.13 ms vs
    # 6.59 at 64-wide steps four deep, DeepSeekMoE 1.05 vs 1.12)
    tile_k: int = 128
    stages: int = 2
    chain_items: bool = True
    epi_slots: int = 1
    tables: str = "fused"
    num_sms: int | None = None

    def gemm_tiling(self) -> GemmTiling:
        """As the shared helpers see it: warpgroups stacked along M, each storing tile_m x cols tiles."""
        return GemmTiling(tile_m=self.rows_per_wg, tile_n=self.cols, tile_k=self.tile_k,
                          max_concurrent_steps=self.stages, wg_split="m", epi_tile_n=64,
                          epi_slots=self.epi_slots, chain_items=self.chain_items)


def _kernel(table_ref, num_valid_ref, x_gmem, wg_gmem, wu_gmem, h_gmem, g_gmem, u_gmem, *, cfg: GemmTiling):
    """h / gate / up [M, F] for x [M, D] and gate / up weights [G, D, F]; cfg.cta_m rows by cfg.tile_n columns
    per work item, warpgroup wg owning rows [wg * tile_m, (wg + 1) * tile_m) of the item."""
    k = x_gmem.shape[1]
    n_iters = h_gmem.shape[1] // cfg.tile_n
    k_iters = k // cfg.tile_k
    tf = swizzle_transforms(cfg.tile_k, x_gmem.dtype)
    chain = cfg.chain_items and k_iters % cfg.max_concurrent_steps == 0

    def pipeline(body, context, state=None):
        w_spec = plgpu.BlockSpec((cfg.tile_k, cfg.tile_n), lambda kk: (kk, 0), transforms=tf)
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k_iters,), memory_registers=40, wg_axis="wg", num_compute_wgs=NUM_COMPUTE_WGS,
            max_concurrent_steps=cfg.max_concurrent_steps, compute_context=context, pipeline_state=state,
            in_specs=[plgpu.BlockSpec((cfg.cta_m, cfg.tile_k), lambda kk: (0, kk), transforms=tf), w_spec, w_spec])

    ignore = lambda *_, **__: None  # noqa: E731  (allocations do not depend on the bodies)
    w_shape_ref = wg_gmem.at[0, :, :cfg.tile_n]
    allocs = pipeline(ignore, ignore).get_allocations(x_gmem.at[:cfg.cta_m], w_shape_ref, w_shape_ref)

    @functools.partial(pl.run_scoped, allocs=allocs, collective_axes="wg",
                       out_smem=epilogue_smem(cfg, h_gmem.dtype))
    def _scope(allocs, out_smem):
        wg = lax.axis_index("wg")
        num_compute, num_tail = num_valid_ref[0], num_valid_ref[1]
        my_rows, wg_row0 = pl.ds(wg * cfg.tile_m, cfg.tile_m), wg * cfg.tile_m

        def store(tiles, slot, ni, zeros_staged=False):
            """This warpgroup's rows of work item (slot, ni) of each output: fp32 tiles (h, gate, up), or zeros."""
            _, row0, lo, count = (table_ref[i, slot] for i in range(4))
            wlo = jnp.clip(lo - wg_row0, 0, cfg.tile_m)
            whi = jnp.clip(lo + count - wg_row0, 0, cfg.tile_m)
            for tile, out_gmem in zip(tiles, (h_gmem, g_gmem, u_gmem)):
                store_rows(tile, out_smem.at[wg], out_gmem, row0 + wg_row0, ni * cfg.tile_n, cfg,
                           rows=(wlo, whi - wlo), zeros_staged=zeros_staged)

        def mma(_, x_smem, wg_smem, wu_smem, accs):
            acc_g, acc_u = accs
            plgpu.wgmma(acc_g, x_smem.at[my_rows], wg_smem)
            plgpu.wgmma(acc_u, x_smem.at[my_rows], wu_smem)
            plgpu.wgmma_wait(0)
            return accs

        @plgpu.nd_loop((num_compute * n_iters,), collective_axes="sm")
        def _compute_items(info):
            slot, ni = plgpu.planar_snake(info.index[0], (num_compute, n_iters), cfg.grid_minor, cfg.grid_tile_width)
            seg, row0 = table_ref[0, slot], pl.multiple_of(table_ref[1, slot], ROW_ALIGN)

            def context(eval_pipeline):
                acc_shape = plgpu.ACC((cfg.tile_m, cfg.tile_n), jnp.float32)

                @functools.partial(pl.run_scoped, acc_g=acc_shape, acc_u=acc_shape)
                def _accs(acc_g, acc_u):
                    eval_pipeline((acc_g, acc_u))
                    # the products as the separate form keeps them (rounded to x's dtype), h from those in fp32
                    gate = acc_g[...].astype(x_gmem.dtype).astype(jnp.float32)
                    up = acc_u[...].astype(x_gmem.dtype).astype(jnp.float32)
                    store((gate * jax.nn.sigmoid(gate) * up, gate, up), slot, ni)

            x_tile = x_gmem.at[pl.ds(row0, cfg.cta_m)]   # the table keeps every tile inside [0, M)
            cols = pl.ds(ni * cfg.tile_n, cfg.tile_n)
            operands = (x_tile, wg_gmem.at[seg].at[:, cols], wu_gmem.at[seg].at[:, cols])
            if not chain:
                pipeline(mma, context)(*operands, allocations=allocs)
                return
            first, last = info.local_index == 0, info.local_index == info.num_local_steps - 1
            state = jnp.where(first, int(plgpu.PipelinePipeline.START),
                              jnp.where(last, int(plgpu.PipelinePipeline.STOP), int(plgpu.PipelinePipeline.STEADY)))
            pl.when(first & last)(lambda: pipeline(mma, context)(*operands, allocations=allocs))
            pl.when(jnp.logical_not(first & last))(
                lambda: pipeline(mma, context, state)(*operands, allocations=allocs))

        # the zero tail of all three outputs: stores of staged zeros, no loads (as grouped_gemm.py's tail)
        pl.when((wg < NUM_COMPUTE_WGS) & (num_tail > 0))(lambda: stage_zeros(out_smem.at[wg]))

        @plgpu.nd_loop((num_tail * n_iters,), collective_axes="sm")
        def _tail_items(info):
            @pl.when(wg < NUM_COMPUTE_WGS)
            def _():
                item = info.index[0]
                store((None, None, None), num_compute + item // n_iters, item % n_iters, zeros_staged=True)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _launch(x, w_gate, w_up, group_sizes, tiling: SwigluTiling, interpret: bool):
    m, k = x.shape
    f = w_gate.shape[2]
    cfg = fit_ragged_tiling(tiling.gemm_tiling(), k, x.dtype, operand_cols=2 * tiling.cols)   # x + both weights
    # rows padded to a multiple of ROW_ALIGN and at least one tile, as grouped_gemm.py's launcher does
    m_run = max(-(-m // ROW_ALIGN) * ROW_ALIGN, cfg.cta_m)
    x_in, sizes = x, group_sizes
    if m_run > m:
        x_in, sizes = jnp.pad(x, ((0, m_run - m), (0, 0))), cut_group_sizes(group_sizes, m, method=tiling.tables)
    table, num_valid = row_tile_table(sizes, m_run, cfg.cta_m, with_tail=True, method=tiling.tables)
    out = jax.ShapeDtypeStruct((m_run, f), x.dtype)
    kernel = persistent_kernel(functools.partial(_kernel, cfg=cfg), (out, out, out), tiling.num_sms or sm_count(interpret),
                               interpret)
    return tuple(o[:m] for o in kernel(table, num_valid, x_in, w_gate, w_up))


def _validate(x_MD, w_gate_GDF, w_up_GDF, group_sizes_G, tiling):
    if x_MD.ndim != 2 or w_gate_GDF.ndim != 3 or w_up_GDF.shape != w_gate_GDF.shape:
        raise ValueError(f"x_MD must be [M, D] and w_gate_GDF, w_up_GDF both [G, D, F]; got x {x_MD.shape}, "
                         f"gate {w_gate_GDF.shape}, up {w_up_GDF.shape}")
    (_, d), (g, d2, f) = x_MD.shape, w_gate_GDF.shape
    if d != d2:
        raise ValueError(f"x_MD has D={d} but the weights have D={d2}; they must match")
    check_group_sizes(group_sizes_G, g)
    check_dtypes("x_MD", x_MD, "w_gate_GDF", w_gate_GDF, None)
    check_dtypes("x_MD", x_MD, "w_up_GDF", w_up_GDF, None)
    tiling = tiling or SwigluTiling()
    if tiling.tables not in TABLE_METHODS:
        raise ValueError(f"tiling.tables must be one of {TABLE_METHODS}, got {tiling.tables!r}")
    for name, dim, tile in (("F (w_gate_GDF dim 2)", f, tiling.cols), ("D", d, tiling.tile_k)):
        if dim % tile:
            raise ValueError(f"grouped_swiglu: {name}={dim} must be a multiple of the tile {tile}; pad the weights "
                             "or use the separate form (model.moe swiglu='separate')")
    return tiling


def grouped_swiglu_reference(x_MD, w_gate_GDF, w_up_GDF, group_sizes_G):
    """The twin: (h, gate, up) with gate, up = x @ w per group rounded to x's dtype, h = silu(gate) * up in
    fp32, rounded to x's dtype; rows past sum(group_sizes) zero."""
    gate = grouped_gemm_reference(x_MD, w_gate_GDF, group_sizes_G)
    up = grouped_gemm_reference(x_MD, w_up_GDF, group_sizes_G)
    h = jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)
    return h.astype(x_MD.dtype), gate, up


def grouped_swiglu_with_products(x_MD, w_gate_GDF, w_up_GDF, group_sizes_G, *, interpret=False, tiling=None):
    """(h, gate, up), each [M, F] in x's dtype, in one kernel (not differentiated: `grouped_swiglu` is).
    x_MD [M, D] bf16/f16 rows sorted by group; w_gate_GDF, w_up_GDF [G, D, F] same dtype; group_sizes_G [G]
    int (>= 0). D a multiple of tiling.tile_k (128), F of tiling.cols (128). Per device, like grouped_gemm."""
    tiling = _validate(x_MD, w_gate_GDF, w_up_GDF, group_sizes_G, tiling)
    if x_MD.shape[0] == 0:
        empty = jnp.zeros((0, w_gate_GDF.shape[2]), x_MD.dtype)
        return empty, empty, empty
    outs = _launch(x_MD, w_gate_GDF, w_up_GDF, group_sizes_G.astype(jnp.int32), tiling, bool(interpret))
    return tuple(vary_like(o, x_MD, w_gate_GDF, w_up_GDF, group_sizes_G) for o in outs)


def grouped_swiglu(x_MD, w_gate_GDF, w_up_GDF, group_sizes_G, *, interpret=False, tiling=None):
    """silu(x @ gate[g]) * (x @ up[g]) per row group, [M, F] in x's dtype, differentiable in x and both
    weights (the backward is the separate form's: see the module docstring). Arguments as
    `grouped_swiglu_with_products`."""
    tiling = _validate(x_MD, w_gate_GDF, w_up_GDF, group_sizes_G, tiling)
    return _swiglu(x_MD, w_gate_GDF, w_up_GDF, group_sizes_G.astype(jnp.int32), bool(interpret), tiling)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _swiglu(x, w_gate, w_up, group_sizes, interpret, tiling):
    return grouped_swiglu_with_products(x, w_gate, w_up, group_sizes, interpret=interpret, tiling=tiling)[0]


def _swiglu_fwd(x, w_gate, w_up, group_sizes, interpret, tiling):
    h, gate, up = grouped_swiglu_with_products(x, w_gate, w_up, group_sizes, interpret=interpret, tiling=tiling)
    return h, (x, w_gate, w_up, group_sizes, gate, up)


def _swiglu_bwd(interpret, tiling, residuals, dh):
    x, w_gate, w_up, group_sizes, gate, up = residuals
    # the activation's derivative as autodiff of silu(gate) * up writes it (rows past the groups: zero products)
    _, pull = jax.vjp(lambda g, u: jax.nn.silu(g) * u, gate, up)
    d_gate, d_up = pull(dh.astype(gate.dtype))
    kw = dict(preferred_element_type=x.dtype, interpret=interpret)
    dx = (grouped_gemm_dgrad(d_gate, w_gate, group_sizes, **kw).astype(jnp.float32)
          + grouped_gemm_dgrad(d_up, w_up, group_sizes, **kw).astype(jnp.float32)).astype(x.dtype)
    dw_gate = grouped_gemm_wgrad(x, d_gate, group_sizes, preferred_element_type=w_gate.dtype, interpret=interpret)
    dw_up = grouped_gemm_wgrad(x, d_up, group_sizes, preferred_element_type=w_up.dtype, interpret=interpret)
    return (match_varying(dx, x, dh, w_gate, w_up, group_sizes), match_varying(dw_gate, w_gate, x, dh, group_sizes),
            match_varying(dw_up, w_up, x, dh, group_sizes), np.zeros(group_sizes.shape, jax.dtypes.float0))


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)
