"""Grouped GEMM for Hopper: `y[M,N] = x[M,K] @ w[g][K,N]` for the rows of group g (Pallas Mosaic GPU).

Semantics are those of `jax.lax.ragged_dot(x, w, group_sizes)`: rows are sorted by group, group g owns
rows [sum(sizes[:g]), sum(sizes[:g+1])), rows past sum(group_sizes) come out as zeros, and a cumulative
size past M is cut at M exactly as ragged_dot cuts it (those rows do not exist).

Three kernels, one persistent warp-specialised design (1 TMA warpgroup feeding 2 wgmma warpgroups):
  * `_ragged_kernel`      forward and input gradient: work items are (row tile of one group, column tile);
                          a row tile straddling a group boundary is computed once per group and each pass
                          stores only its own rows (TMA stores of 2^i rows, a binary ladder).
  * `_weight_grad_kernel` `dw[g] = x_gᵀ · dy_g`: work items are (group, K tile, N tile); the reduction runs
                          over the group's token blocks, rows of neighbouring groups masked in SMEM.
`grouped_gemm` wires them with `jax.custom_vjp`; `grouped_gemm_reference` is the plain-jnp twin.
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

_NUM_COMPUTE_WGS = 2
_SUPPORTED_IN_DTYPES = (jnp.bfloat16, jnp.float16)
_SMEM_BUDGET = 227 * 1024 - 2048  # Hopper's per-block opt-in limit, less room for the pipeline barriers
_INTERPRET_NUM_SMS = 3  # a few simulated SMs exercise the persistent loop without 132 CPU threads


@dataclasses.dataclass(frozen=True)
class GemmTiling:
    """Tiles of one kernel. Each of the 2 compute warpgroups owns a `tile_m x tile_n` accumulator;
    `wg_split` says whether they sit side by side along N (CTA tile tile_m x 2*tile_n) or along M."""

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    max_concurrent_steps: int = 4
    wg_split: str = "n"
    grid_minor: int = 0      # 0: row tiles vary fastest in the work order (w tiles reused from L2)
    grid_tile_width: int = 8  # band width of the snake order over (row tiles, column tiles)
    epi_tile_n: int = 64     # output columns staged through SMEM per TMA store

    @property
    def cta_m(self) -> int:
        return self.tile_m * (_NUM_COMPUTE_WGS if self.wg_split == "m" else 1)

    @property
    def cta_n(self) -> int:
        return self.tile_n * (_NUM_COMPUTE_WGS if self.wg_split == "n" else 1)


@dataclasses.dataclass(frozen=True)
class GroupedGemmTuning:
    """Per-kernel tiles: forward `fwd`, input gradient `dgrad`, weight gradient `wgrad` (its tile_m runs
    over K, tile_n over N, tile_k over tokens). `num_sms=None` reads the device's SM count.

    `zero_tail` says who writes the zero rows past sum(group_sizes) of y and dx: 'kernel' (its tail tiles
    stream their K loop of loads and skip only the MMA) or 'mask' (the kernels skip those tiles and a
    jnp.where zeroes them; XLA can fuse the select into the consumer, a standalone call pays one pass over
    the output). A long tail (expert-parallel dropless buffers are n x the average rows) is where they
    differ; `benchmarks/bench_grouped_gemm.py --routings padded` times both."""

    fwd: GemmTiling = GemmTiling()
    dgrad: GemmTiling = GemmTiling()
    wgrad: GemmTiling = GemmTiling(max_concurrent_steps=4, wg_split="m")
    num_sms: int | None = None
    zero_tail: str = "kernel"


def _fit_tiling(base: GemmTiling, n_cols: int, name: str) -> GemmTiling:
    """Widest CTA tile along N that divides `n_cols` (TMA blocks must not straddle the edge)."""
    for split, tile_n in (("n", 128), ("m", 128), ("m", 64)):
        if n_cols % (tile_n * (_NUM_COMPUTE_WGS if split == "n" else 1)) == 0:
            return dataclasses.replace(base, wg_split=split, tile_n=tile_n, epi_tile_n=min(64, tile_n))
    raise ValueError(f"{name}={n_cols} must be a multiple of 64; pad the weights to a multiple of 64")


def _fit_wgrad_tiling(base: GemmTiling, k: int, n: int) -> GemmTiling:
    """dw tiles are (K rows x N columns); the widest pair of warpgroup tiles that divides both."""
    for split, tile_m, tile_n in (("m", 128, 128), ("n", 128, 128), ("m", 64, 128), ("n", 64, 64), ("m", 64, 64)):
        cta_m = tile_m * (_NUM_COMPUTE_WGS if split == "m" else 1)
        cta_n = tile_n * (_NUM_COMPUTE_WGS if split == "n" else 1)
        if k % cta_m == 0 and n % cta_n == 0:
            return dataclasses.replace(base, wg_split=split, tile_m=tile_m, tile_n=tile_n, epi_tile_n=64)
    raise ValueError(f"weight gradient needs K={k} or N={n} to be a multiple of 128 (the other of 64); "
                     "pad the weights")


def default_tuning(m: int, k: int, n: int, num_groups: int) -> GroupedGemmTuning:
    """Defaults by shape: the widest CTA tile that divides the output (forward writes N columns, dgrad
    K columns, wgrad K x N). Measured on the H200 (benchmarks/results/grouped_gemm_h200.json), the
    swept alternatives were not faster: Mixtral-like fwd 638-676 TFLOP/s vs 674 for the default,
    fine-grained 377-421 vs 441 (run-to-run spread is about 5%)."""
    del m, num_groups
    fwd = _fit_tiling(GemmTiling(), n, "N")
    dgrad = _fit_tiling(GemmTiling(), k, "K")
    wgrad = _fit_wgrad_tiling(GemmTiling(), k, n)
    return GroupedGemmTuning(fwd=fwd, dgrad=dgrad, wgrad=wgrad)


# ----------------------------------------------------------------------------------------------------
# Work-item tables (plain jnp, computed on device before the kernels run)
# ----------------------------------------------------------------------------------------------------
def _group_bounds(group_sizes_G, m):
    """[start, end) rows of each group, cut at m as ragged_dot cuts them."""
    ends = jnp.minimum(jnp.cumsum(group_sizes_G.astype(jnp.int32)), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return starts, jnp.maximum(ends, starts)


def _row_tile_table(group_sizes_G, m: int, tile: int, with_tail: bool = True):
    """int32 [4, S]: for each (segment, row tile) work slot its segment, tile index, first row inside the
    tile and row count; and int32 [1], the number of valid slots. Segment G is the tail past
    sum(group_sizes): it is stored as zeros. S = cdiv(m, tile) + G bounds the slot count (each boundary
    adds at most one tile); the kernel loops over the valid slots only, so spare ones cost nothing and
    do not unbalance the SMs."""
    num_groups = group_sizes_G.shape[0]
    starts, ends = _group_bounds(group_sizes_G, m)
    starts = jnp.concatenate([starts, ends[-1:]])
    ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
    first = starts // tile
    n_tiles = jnp.where(ends > starts, (ends - 1) // tile - first + 1, 0)
    inclusive = jnp.cumsum(n_tiles)
    slot = jnp.arange(pl.cdiv(m, tile) + num_groups, dtype=jnp.int32)
    seg = jnp.searchsorted(inclusive, slot, side="right").astype(jnp.int32)
    valid = seg <= num_groups
    seg = jnp.minimum(seg, num_groups)
    block = first[seg] + slot - (inclusive[seg] - n_tiles[seg])
    lo = jnp.maximum(starts[seg], block * tile) - block * tile
    hi = jnp.minimum(ends[seg], block * tile + tile) - block * tile
    count = jnp.where(valid, hi - lo, 0)
    table = jnp.stack([seg, jnp.where(valid, block, 0), lo, count]).astype(jnp.int32)
    # Valid slots come first, the tail's last; their number (without the tail's when with_tail is False).
    return table, (inclusive[-1:] if with_tail else inclusive[-2:-1]).astype(jnp.int32)


def _token_block_table(group_sizes_G, m: int, tile: int):
    """int32 [4, G]: each group's first token block, block count (at least 1, so an empty group still
    writes its zeros), and [start, end) rows — the rows outside are masked in the first/last block."""
    starts, ends = _group_bounds(group_sizes_G, m)
    first = starts // tile
    n_blocks = jnp.maximum(pl.cdiv(ends, tile) - first, 1)
    return jnp.stack([first, n_blocks, starts, ends]).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------------
# Kernel bodies
# ----------------------------------------------------------------------------------------------------
def _swizzle_transforms(minor_elems: int, dtype):
    swizzle = plgpu.find_swizzle(minor_elems * jnp.dtype(dtype).itemsize * 8)
    elems = swizzle // jnp.dtype(dtype).itemsize
    return plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle)


def _store_rows(acc, out_smem, out_gmem, row0, col0, cfg: GemmTiling, rows=None):
    """Stores this warpgroup's accumulator at out_gmem[row0:, col0:]; `rows=(lo, count)` keeps only rows
    [lo, lo+count). TMA boxes are static, so a ragged count is written as a sum of powers of two, one
    store per set bit (rows=None: the whole tile in one store)."""
    wg_rows = out_smem.shape[0]
    for ni in range(cfg.tile_n // cfg.epi_tile_n):
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous stores have read out_smem
        out_smem[...] = acc[:, ni * cfg.epi_tile_n:(ni + 1) * cfg.epi_tile_n].astype(out_smem.dtype)
        plgpu.commit_smem()
        cols = pl.ds(col0 + ni * cfg.epi_tile_n, cfg.epi_tile_n)
        if rows is None:
            plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[pl.ds(row0, wg_rows), cols])
            continue
        start, count = rows
        bit = 1 << (wg_rows.bit_length() - 1)
        while bit:
            pl.when((count & bit) != 0)(functools.partial(
                plgpu.copy_smem_to_gmem, out_smem.at[pl.ds(start, bit)],
                out_gmem.at[pl.ds(row0 + start, bit), cols]))
            start = start + (count & bit)
            bit >>= 1


def _ragged_kernel(table_ref, num_valid_ref, x_gmem, w_gmem, out_gmem, *, cfg: GemmTiling,
                   transpose_w: bool):
    """out[rows of g] = x[rows of g] @ (w[g]ᵀ if transpose_w else w[g]); w is [G, K, N] or [G, N, K]."""
    m, k = x_gmem.shape
    n = out_gmem.shape[1]
    num_groups = w_gmem.shape[0]
    n_iters = n // cfg.cta_n
    in_tf = _swizzle_transforms(cfg.tile_k, x_gmem.dtype)
    w_block = (cfg.cta_n, cfg.tile_k) if transpose_w else (cfg.tile_k, cfg.cta_n)
    slot_ref = [jnp.int32(0)]  # set per work item; the index map reads it when the pipeline is traced

    def pipeline(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k // cfg.tile_k,), memory_registers=40, wg_axis="wg",
            num_compute_wgs=_NUM_COMPUTE_WGS, max_concurrent_steps=cfg.max_concurrent_steps,
            compute_context=context,
            in_specs=[
                plgpu.BlockSpec((cfg.cta_m, cfg.tile_k), lambda kk: (slot_ref[0], kk), transforms=in_tf),
                plgpu.BlockSpec(w_block, (lambda kk: (0, kk)) if transpose_w else (lambda kk: (kk, 0)),
                                transforms=in_tf),
            ])

    ignore = lambda *_, **__: None  # noqa: E731  (allocations do not depend on the bodies)
    w_shape_ref = w_gmem.at[0, :cfg.cta_n, :] if transpose_w else w_gmem.at[0, :, :cfg.cta_n]
    allocs = pipeline(ignore, ignore).get_allocations(x_gmem, w_shape_ref)

    @functools.partial(pl.run_scoped, allocs=allocs, collective_axes="wg",
                       out_smem=plgpu.SMEM((_NUM_COMPUTE_WGS, cfg.tile_m, cfg.epi_tile_n), out_gmem.dtype))
    def _scope(allocs, out_smem):
        wg = lax.axis_index("wg")

        num_slots = num_valid_ref[0]

        @plgpu.nd_loop((num_slots * n_iters,), collective_axes="sm")
        def _work(info):
            slot, ni = plgpu.planar_snake(info.index[0], (num_slots, n_iters), cfg.grid_minor,
                                          cfg.grid_tile_width)
            seg, block, lo, count = (table_ref[i, slot] for i in range(4))
            is_tail = seg == num_groups
            wg_m = pl.ds(wg * cfg.tile_m, cfg.tile_m) if cfg.wg_split == "m" else slice(None)
            wg_n = pl.ds(wg * cfg.tile_n, cfg.tile_n) if cfg.wg_split == "n" else slice(None)
            wg_row0 = wg * cfg.tile_m if cfg.wg_split == "m" else 0
            wg_col0 = wg * cfg.tile_n if cfg.wg_split == "n" else 0

            def context(eval_pipeline):
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((cfg.tile_m, cfg.tile_n), jnp.float32))
                def _acc(acc_ref):
                    eval_pipeline(acc_ref)
                    wlo = jnp.clip(lo - wg_row0, 0, cfg.tile_m)
                    whi = jnp.clip(lo + count - wg_row0, 0, cfg.tile_m)
                    _store_rows(acc_ref[...], out_smem.at[wg], out_gmem, block * cfg.cta_m + wg_row0,
                                ni * cfg.cta_n + wg_col0, cfg, rows=(wlo, whi - wlo))

            def mma(_, x_smem, w_smem, acc_ref):
                w_op = w_smem.at[wg_n, :].transpose((1, 0)) if transpose_w else w_smem.at[:, wg_n]

                @pl.when(jnp.logical_not(is_tail))  # the tail stays at the zero-initialised accumulator
                def _():
                    plgpu.wgmma(acc_ref, x_smem.at[wg_m], w_op)
                plgpu.wgmma_wait(0)
                return acc_ref

            @pl.when(count > 0)
            def _():
                slot_ref[0] = block
                w_cols = pl.ds(ni * cfg.cta_n, cfg.cta_n)
                w_g = w_gmem.at[jnp.minimum(seg, num_groups - 1)]
                w_tile = w_g.at[w_cols, :] if transpose_w else w_g.at[:, w_cols]
                pipeline(mma, context)(x_gmem, w_tile, allocations=allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _mask_token_rows(ref, row0, start, end):
    """Zeroes rows of an SMEM tile whose token index is outside [start, end) (neighbouring groups or
    rows past the end). A multiply by the 0/1 mask: those rows must hold finite values."""
    vals = ref[...]
    rows = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, vals.shape, 0), plgpu.Layout.WGMMA) + row0
    keep = (rows >= start) & (rows < end)
    ref[...] = vals * keep.astype(vals.dtype)
    plgpu.commit_smem()


def _weight_grad_kernel(table_ref, x_gmem, dy_gmem, dw_gmem, *, cfg: GemmTiling):
    """dw[g] = x[rows of g]ᵀ @ dy[rows of g]; tile_m runs over K, tile_n over N, tile_k over tokens."""
    num_groups, k, n = dw_gmem.shape
    k_iters, n_iters = k // cfg.cta_m, n // cfg.cta_n
    tf_x = _swizzle_transforms(64, x_gmem.dtype)  # both tiles are >= 64 wide along their minor dim
    tf_dy = _swizzle_transforms(64, dy_gmem.dtype)
    cur = {}

    def pipeline(body, context, num_blocks):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(num_blocks,), memory_registers=40, wg_axis="wg",
            num_compute_wgs=_NUM_COMPUTE_WGS, max_concurrent_steps=cfg.max_concurrent_steps,
            compute_context=context,
            in_specs=[
                plgpu.BlockSpec((cfg.tile_k, cfg.cta_m), lambda t: (cur["first"] + t, cur["ki"]),
                                transforms=tf_x),
                plgpu.BlockSpec((cfg.tile_k, cfg.cta_n), lambda t: (cur["first"] + t, cur["ni"]),
                                transforms=tf_dy),
            ])

    ignore = lambda *_, **__: None  # noqa: E731
    cur.update(first=jnp.int32(0), ki=jnp.int32(0), ni=jnp.int32(0))
    # a traced block count keeps all max_concurrent_steps buffers (a static 1 would shrink them)
    allocs = pipeline(ignore, ignore, jnp.int32(1)).get_allocations(x_gmem, dy_gmem)

    @functools.partial(pl.run_scoped, allocs=allocs, collective_axes="wg",
                       out_smem=plgpu.SMEM((_NUM_COMPUTE_WGS, cfg.tile_m, cfg.epi_tile_n), dw_gmem.dtype))
    def _scope(allocs, out_smem):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((num_groups, k_iters * n_iters), collective_axes="sm")
        def _work(info):
            g = info.index[0]
            ki, ni = plgpu.planar_snake(info.index[1], (k_iters, n_iters), cfg.grid_minor,
                                        cfg.grid_tile_width)
            first, num_blocks, start, end = (table_ref[i, g] for i in range(4))
            wg_k = pl.ds(wg * cfg.tile_m, cfg.tile_m) if cfg.wg_split == "m" else slice(None)
            wg_n = pl.ds(wg * cfg.tile_n, cfg.tile_n) if cfg.wg_split == "n" else slice(None)
            wg_row0 = wg * cfg.tile_m if cfg.wg_split == "m" else 0
            wg_col0 = wg * cfg.tile_n if cfg.wg_split == "n" else 0

            def context(eval_pipeline):
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((cfg.tile_m, cfg.tile_n), jnp.float32))
                def _acc(acc_ref):
                    eval_pipeline(acc_ref)
                    _store_rows(acc_ref[...], out_smem.at[wg], dw_gmem.at[g], ki * cfg.cta_m + wg_row0,
                                ni * cfg.cta_n + wg_col0, cfg)

            def mma(idx, x_smem, dy_smem, acc_ref):
                x_mine = x_smem.at[:, wg_k]
                step = idx[0]
                row0 = (first + step) * cfg.tile_k
                # only the first and last blocks can hold rows of other groups
                pl.when((step == 0) | (step == num_blocks - 1))(
                    lambda: _mask_token_rows(x_mine, row0, start, end))
                plgpu.wgmma(acc_ref, x_mine.transpose((1, 0)), dy_smem.at[:, wg_n])
                plgpu.wgmma_wait(0)
                return acc_ref

            cur.update(first=first, ki=ki, ni=ni)
            pipeline(mma, context, num_blocks)(x_gmem, dy_gmem, allocations=allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


# ----------------------------------------------------------------------------------------------------
# Launchers, validation, custom VJP
# ----------------------------------------------------------------------------------------------------
def _launch(body, out_shape, out_dtype, num_sms, interpret, *operands):
    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
        grid=(num_sms,), grid_names=("sm",), num_threads=_NUM_COMPUTE_WGS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else False)
    return kernel(*operands)


def _num_sms(tuning: GroupedGemmTuning, interpret: bool) -> int:
    if tuning.num_sms is not None:
        return tuning.num_sms
    return _INTERPRET_NUM_SMS if interpret else jax.devices()[0].core_count


def _fit_smem(cfg: GemmTiling, stage_elems: int, out_dtype) -> GemmTiling:
    """Drops pipeline stages until the input buffers plus the epilogue staging fit in SMEM (an fp32
    output doubles the staging)."""
    out_bytes = _NUM_COMPUTE_WGS * cfg.tile_m * cfg.epi_tile_n * jnp.dtype(out_dtype).itemsize
    steps = cfg.max_concurrent_steps
    while steps > 2 and steps * stage_elems * 2 + out_bytes > _SMEM_BUDGET:
        steps -= 1
    return dataclasses.replace(cfg, max_concurrent_steps=steps)


def _ragged_matmul(x, w, group_sizes, out_dtype, cfg, transpose_w, num_sms, interpret, zero_tail="kernel"):
    m = x.shape[0]
    cfg = _fit_smem(cfg, (cfg.cta_m + cfg.cta_n) * cfg.tile_k, out_dtype)
    n = w.shape[1] if transpose_w else w.shape[2]
    table, num_valid = _row_tile_table(group_sizes, m, cfg.cta_m, with_tail=zero_tail == "kernel")
    body = functools.partial(_ragged_kernel, cfg=cfg, transpose_w=transpose_w)
    out = _launch(body, (m, n), out_dtype, num_sms, interpret, table, num_valid, x, w)
    if zero_tail == "kernel":
        return out
    rows_M1 = jnp.arange(m, dtype=jnp.int32)[:, None]   # rows the kernel did not write hold garbage
    return jnp.where(rows_M1 < jnp.sum(group_sizes), out, jnp.zeros((), out.dtype))


def _weight_grad(x, dy, group_sizes, out_dtype, cfg, num_sms, interpret):
    cfg = _fit_smem(cfg, (cfg.cta_m + cfg.cta_n) * cfg.tile_k, out_dtype)
    table = _token_block_table(group_sizes, x.shape[0], cfg.tile_k)
    body = functools.partial(_weight_grad_kernel, cfg=cfg)
    shape = (group_sizes.shape[0], x.shape[1], dy.shape[1])
    return _launch(body, shape, out_dtype, num_sms, interpret, table, x, dy)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _grouped_gemm(x, w, group_sizes, out_dtype, interpret, tuning):
    sms = _num_sms(tuning, interpret)
    y = _ragged_matmul(x, w, group_sizes, out_dtype, tuning.fwd, False, sms, interpret, tuning.zero_tail)
    return _vary_like(y, x, w, group_sizes)


def _grouped_gemm_fwd(x, w, group_sizes, out_dtype, interpret, tuning):
    return _grouped_gemm(x, w, group_sizes, out_dtype, interpret, tuning), (x, w, group_sizes)


def _varying_axes(x) -> frozenset:
    """Mesh axes x varies along inside shard_map (empty outside); jax 0.11 keeps them in `aval.mat`."""
    aval = jax.typeof(x)
    if hasattr(aval, "vma"):
        return frozenset(aval.vma)
    mat = getattr(aval, "mat", None)
    return frozenset(mat.varying) if mat is not None else frozenset()


def _vary_like(out, *inputs):
    """Types a kernel output as varying along every mesh axis its inputs vary along (the standard rule):
    the Mosaic GPU call returns values typed as replicated inside shard_map even when they differ."""
    axes = frozenset().union(*(_varying_axes(a) for a in inputs)) - _varying_axes(out)
    return lax.pcast(out, tuple(sorted(axes)), to="varying") if axes else out


def _match_varying(cotangent, primal, *computed_from):
    """Gives a cotangent its primal's shard_map type, as custom_vjp requires: axes along which the
    contributions differ (those of `computed_from`) but the primal is replicated are summed, the
    transpose of replication; axes the primal varies along are kept."""
    want = _varying_axes(primal)
    have = frozenset().union(*(_varying_axes(a) for a in computed_from))
    if have - want:
        cotangent = lax.psum(_vary_like(cotangent, *computed_from), tuple(sorted(have - want)))
    return _vary_like(cotangent, primal)


def _grouped_gemm_bwd(out_dtype, interpret, tuning, residuals, dy):
    x, w, group_sizes = residuals
    dy = dy.astype(x.dtype)  # wgmma takes both operands in one dtype; accumulation stays fp32
    sms = _num_sms(tuning, interpret)
    dx = _ragged_matmul(dy, w, group_sizes, x.dtype, tuning.dgrad, True, sms, interpret, tuning.zero_tail)
    dw = _weight_grad(x, dy, group_sizes, w.dtype, tuning.wgrad, sms, interpret)
    return (_match_varying(dx, x, dy, w, group_sizes), _match_varying(dw, w, x, dy, group_sizes),
            np.zeros(group_sizes.shape, jax.dtypes.float0))


_grouped_gemm.defvjp(_grouped_gemm_fwd, _grouped_gemm_bwd)


def _check_tiling(name: str, cfg: GemmTiling, dims_and_tiles, what: str):
    if cfg.wg_split not in ("m", "n"):
        raise ValueError(f"tuning.{name}.wg_split must be 'm' or 'n', got {cfg.wg_split!r}")
    if cfg.tile_n % cfg.epi_tile_n:
        raise ValueError(f"tuning.{name}.epi_tile_n={cfg.epi_tile_n} must divide tile_n={cfg.tile_n}")
    for label, dim, tile in dims_and_tiles:
        if dim % tile:
            raise ValueError(f"{what}: {label} {dim} is not a multiple of the tuning.{name} tile {tile}; pad "
                             "the weights (K and N to multiples of 64) or pass another tuning")


def _validate(x_MK, w_GKN, group_sizes_G, preferred_element_type, tuning):
    if x_MK.ndim != 2 or w_GKN.ndim != 3:
        raise ValueError(f"x_MK must be [M, K] and w_GKN [G, K, N]; got x {x_MK.shape}, w {w_GKN.shape}")
    (m, k), (g, k2, n) = x_MK.shape, w_GKN.shape
    if k != k2:
        raise ValueError(f"x_MK has K={k} but w_GKN has K={k2}; they must match")
    if group_sizes_G.shape != (g,) or not jnp.issubdtype(group_sizes_G.dtype, jnp.integer):
        raise ValueError(f"group_sizes_G must be an integer vector of shape ({g},) (one size per weight "
                         f"group); got {group_sizes_G.dtype} {group_sizes_G.shape}")
    if x_MK.dtype != w_GKN.dtype or x_MK.dtype not in _SUPPORTED_IN_DTYPES:
        raise ValueError(f"x_MK and w_GKN must share dtype bfloat16 or float16; got {x_MK.dtype} and "
                         f"{w_GKN.dtype}: cast them (the kernel accumulates in float32 either way)")
    out_dtype = jnp.dtype(preferred_element_type or x_MK.dtype)
    if out_dtype not in (jnp.dtype(x_MK.dtype), jnp.dtype(jnp.float32)):
        raise ValueError(f"preferred_element_type must be None, {x_MK.dtype} or float32; got {out_dtype}")
    tuning = tuning or default_tuning(m, k, n, g)
    fwd, dgrad, wgrad = tuning.fwd, tuning.dgrad, tuning.wgrad
    _check_tiling("fwd", fwd, [("N", n, fwd.cta_n), ("K", k, fwd.tile_k)], "forward")
    _check_tiling("dgrad", dgrad, [("K", k, dgrad.cta_n), ("N", n, dgrad.tile_k)], "input gradient")
    _check_tiling("wgrad", wgrad, [("K", k, wgrad.cta_m), ("N", n, wgrad.cta_n)], "weight gradient")
    if tuning.zero_tail not in ("kernel", "mask"):
        raise ValueError(f"tuning.zero_tail must be 'kernel' or 'mask', got {tuning.zero_tail!r}")
    return out_dtype, tuning


def unsupported_reason(x_MK, w_GKN) -> str | None:
    """Why the kernel cannot take these operands (dtype, alignment), or None when it can."""
    try:
        _validate(x_MK, w_GKN, jnp.zeros((w_GKN.shape[0],), jnp.int32), None, None)
    except ValueError as err:
        return str(err)
    return None


def grouped_gemm(x_MK, w_GKN, group_sizes_G, preferred_element_type=None, interpret=False, tuning=None):
    """`lax.ragged_dot(x_MK, w_GKN, group_sizes_G)` on Hopper, differentiable in x and w.

    x_MK [M, K] bf16/f16 rows sorted by group; w_GKN [G, K, N] same dtype; group_sizes_G [G] int32 (>= 0).
    K and N must be multiples of 64. Output [M, N] in `preferred_element_type` (None: x's dtype, or
    float32), fp32 accumulation; rows past sum(group_sizes_G) are zeros. Gradients come back in x's and
    w's dtypes; the weight gradient masks foreign rows by a 0/1 multiply, so x and the cotangent must be
    finite everywhere (also past sum(group_sizes_G)). Not sharded inside: call it per device (e.g. in shard_map over the expert axis).
    `interpret=True` runs the Mosaic GPU kernels in the CPU interpreter (tests); `tuning` overrides
    `default_tuning(M, K, N, G)`.
    """
    out_dtype, tuning = _validate(x_MK, w_GKN, group_sizes_G, preferred_element_type, tuning)
    if x_MK.shape[0] == 0:
        return jnp.zeros((0, w_GKN.shape[2]), out_dtype)
    return _grouped_gemm(x_MK, w_GKN, group_sizes_G.astype(jnp.int32), out_dtype, bool(interpret), tuning)


def grouped_gemm_reference(x_MK, w_GKN, group_sizes_G, preferred_element_type=None):
    """Plain-jnp twin: one dense fp32-accumulated product per group, rows masked to their group
    (G times the FLOPs; for CPUs and tests)."""
    m = x_MK.shape[0]
    out_dtype = jnp.dtype(preferred_element_type or x_MK.dtype)
    starts, ends = _group_bounds(group_sizes_G, m)
    rows = jnp.arange(m)[:, None]
    y_MN = jnp.zeros((m, w_GKN.shape[2]), jnp.float32)
    for g in range(w_GKN.shape[0]):
        in_group = (rows >= starts[g]) & (rows < ends[g])
        x_g = jnp.where(in_group, x_MK, jnp.zeros_like(x_MK))
        y_MN = y_MN + jnp.dot(x_g, w_GKN[g], preferred_element_type=jnp.float32,
                              precision=lax.Precision.HIGHEST)
    return y_MN.astype(out_dtype)
