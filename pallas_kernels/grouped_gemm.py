"""Grouped GEMM for Hopper: `y[M,N] = x[M,K] @ w[g][K,N]` for the rows of group g (Pallas Mosaic GPU).

Semantics are those of `jax.lax.ragged_dot(x, w, group_sizes)`: rows are sorted by group, group g owns
rows [sum(sizes[:g]), sum(sizes[:g+1])), rows past sum(group_sizes) come out as zeros (unless tuning.zero_tail="none"), and a cumulative
size past M is cut at M exactly as ragged_dot cuts it (those rows do not exist).

Two kernel bodies (three launches), one persistent warp-specialised design (1 TMA warpgroup, 2 wgmma):
  * `ragged_kernel`       forward and input gradient (in _ragged_body.py, shared with the fused EP dispatch
                          kernel all_gather_grouped_gemm.py): work items are (row tile of one group, column tile);
                          a group's tiles start at its first row rounded down to a multiple of 8
                          (`row_tiles='group'`; or on one grid over all rows, a straddling tile computed once
                          per group), and each item stores only its group's rows (TMA stores of 2^i rows, a
                          binary ladder).
  * `_weight_grad_kernel` `dw[g] = x_gᵀ · dy_g`: work items are (group, K tile, N tile); the reduction runs
                          over the group's token blocks, rows of neighbouring groups masked in SMEM.
Both have a ping-pong twin in _pingpong_body.py (`GemmTiling.schedule='pingpong'`: each compute warpgroup on
its own work items), which the default tuning takes for short reductions; the weight gradient's cooperative
tiles also run there on one SMEM ring across items (`chain_items`, the default on its 256 x 128 CTA tiles).
Public entry points, each validated and each with a plain-jnp `*_reference` twin (grouped_gemm_reference.py):
`grouped_gemm` (differentiable: `jax.custom_vjp`), `grouped_gemm_dgrad` and `grouped_gemm_wgrad`. The
custom VJP's backward is exactly those two calls, so a hand-written backward can put communication
(an all-to-all, a reduce-scatter) between them. Elsewhere: tiles and tunings in `_grouped_tiles.py`
(their defaults by shape in `_default_tuning.py`),
work tables in `_work_tables.py` (both shared with sibling kernels); shard_map varying-axes typing in `varying.py`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._default_tuning import default_kernel_tuning, default_tuning
from pallas_kernels._grouped_tiles import (NUM_COMPUTE_WGS, GemmTiling, GroupedGemmTuning, check_dtypes,
                                           check_group_sizes, check_tiling, check_tuning_enums, epilogue_smem,
                                           fit_ragged_tiling, fit_smem, persistent_kernel, sm_count,
                                           store_rows, swizzle_transforms, warpgroup_tile, weight_grad_step)
from pallas_kernels._pingpong_body import ring_weight_grad_kernel
from pallas_kernels._ragged_body import ragged_kernel
from pallas_kernels._work_tables import ROW_ALIGN, cut_group_sizes, row_tile_table, token_block_table
from pallas_kernels.grouped_gemm_reference import (grouped_gemm_dgrad_reference, grouped_gemm_reference,
                                                   grouped_gemm_wgrad_reference)
from pallas_kernels.varying import match_varying, vary_like

__all__ = ["GemmTiling", "GroupedGemmTuning", "default_tuning", "unsupported_reason", "grouped_gemm",
           "grouped_gemm_dgrad", "grouped_gemm_wgrad", "grouped_gemm_reference",
           "grouped_gemm_dgrad_reference", "grouped_gemm_wgrad_reference"]


# ----------------------------------------------------------------------------------------------------
# Kernel bodies
# ----------------------------------------------------------------------------------------------------
def _weight_grad_kernel(table_ref, x_gmem, dy_gmem, dw_gmem, *, cfg: GemmTiling):
    """dw[g] = x[rows of g]ᵀ @ dy[rows of g]; tile_m runs over K, tile_n over N, tile_k over tokens."""
    num_groups, k, n = dw_gmem.shape
    k_iters, n_iters = k // cfg.cta_m, n // cfg.cta_n
    tf_x = swizzle_transforms(64, x_gmem.dtype)  # both tiles are >= 64 wide along their minor dim
    tf_dy = swizzle_transforms(64, dy_gmem.dtype)
    cur = {}

    def pipeline(body, context, num_blocks):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(num_blocks,), memory_registers=40, wg_axis="wg",
            num_compute_wgs=NUM_COMPUTE_WGS, max_concurrent_steps=cfg.max_concurrent_steps,
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
                       out_smem=epilogue_smem(cfg, dw_gmem.dtype))
    def _scope(allocs, out_smem):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((num_groups, k_iters * n_iters), collective_axes="sm")
        def _work(info):
            g = info.index[0]
            ki, ni = plgpu.planar_snake(info.index[1], (k_iters, n_iters), cfg.grid_minor,
                                        cfg.grid_tile_width)
            first, num_blocks, start, end = (table_ref[i, g] for i in range(4))
            wg_k, wg_n, wg_row0, wg_col0 = warpgroup_tile(cfg, wg)

            def context(eval_pipeline):
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((cfg.tile_m, cfg.tile_n), jnp.float32))
                def _acc(acc_ref):
                    eval_pipeline(acc_ref)
                    store_rows(acc_ref[...], out_smem.at[wg], dw_gmem.at[g], ki * cfg.cta_m + wg_row0,
                                ni * cfg.cta_n + wg_col0, cfg)

            def mma(idx, x_smem, dy_smem, acc_ref):
                step = idx[0]
                weight_grad_step(acc_ref, x_smem.at[:, wg_k], dy_smem.at[:, wg_n], step, num_blocks,
                                 (first + step) * cfg.tile_k, start, end)
                plgpu.wgmma_wait(0)
                return acc_ref

            cur.update(first=first, ki=ki, ni=ni)
            pipeline(mma, context, num_blocks)(x_gmem, dy_gmem, allocations=allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


# ----------------------------------------------------------------------------------------------------
# Launchers (one persistent grid over the SMs)
# ----------------------------------------------------------------------------------------------------
def _launch(body, out_shape, out_dtype, num_sms, interpret, *operands):
    return persistent_kernel(body, jax.ShapeDtypeStruct(out_shape, out_dtype), num_sms, interpret)(*operands)


def _num_sms(tuning: GroupedGemmTuning, interpret: bool) -> int:
    if tuning.num_sms is not None:
        return tuning.num_sms
    return sm_count(interpret)


def ragged_launch(x, w, table, num_valid, out_dtype, cfg, transpose_w, num_sms, interpret):
    """The forward / input-gradient kernel alone, on work tables made by `row_tile_table` (cfg fitted by
    `fit_ragged_tiling`, its cta_m the tables' tile)."""
    n = w.shape[1] if transpose_w else w.shape[2]
    body = functools.partial(ragged_kernel, cfg=cfg, transpose_w=transpose_w)
    if cfg.split_k == 1:
        return _launch(body, (x.shape[0], n), out_dtype, num_sms, interpret, table, num_valid, x, w)
    partials = _launch(body, (cfg.split_k * x.shape[0], n), jnp.float32, num_sms, interpret, table, num_valid, x, w)
    return jnp.sum(partials.reshape(cfg.split_k, x.shape[0], n), axis=0).astype(out_dtype)


def _ragged_matmul(x, w, group_sizes, out_dtype, cfg, transpose_w, num_sms, interpret, zero_tail="kernel",
                   tables="scan", row_tiles="group"):
    m, k = x.shape
    cfg = fit_ragged_tiling(cfg, k, jnp.float32 if cfg.split_k > 1 else out_dtype)
    # Every tile reads cta_m rows inside the input from a multiple of ROW_ALIGN (row_tile_table slides the last
    # ones back), so rows are padded up to that multiple and to one tile: a copy of x, only for such row counts
    # (the model's are multiples of 8). The pad rows' outputs are cut off again, whatever group they fall in.
    m_run = max(-(-m // ROW_ALIGN) * ROW_ALIGN, cfg.cta_m)
    x_in, sizes = x, group_sizes
    if m_run > m:   # the sizes cut at m first, so that no group reaches into the pad rows
        x_in, sizes = jnp.pad(x, ((0, m_run - m), (0, 0))), cut_group_sizes(group_sizes, m, method=tables)
    table, num_valid = row_tile_table(sizes, m_run, cfg.cta_m, with_tail=zero_tail == "kernel",
                                      method=tables, align=row_tiles)
    out = ragged_launch(x_in, w, table, num_valid, out_dtype, cfg, transpose_w, num_sms, interpret)[:m]
    if zero_tail in ("kernel", "none"):   # written by the tail tiles, or left unwritten on purpose
        return out
    rows_M1 = jnp.arange(m, dtype=jnp.int32)[:, None]   # rows the kernel did not write hold garbage
    total = jnp.sum(jnp.maximum(group_sizes, 0))   # as the tables count rows (a negative size as 0)
    return jnp.where(rows_M1 < total, out, jnp.zeros((), out.dtype))


def _weight_grad(x, dy, group_sizes, out_dtype, cfg, num_sms, interpret, tables="scan"):
    cfg = fit_smem(cfg, (cfg.cta_m + cfg.cta_n) * cfg.tile_k, out_dtype)
    table = token_block_table(group_sizes, x.shape[0], cfg.tile_k, method=tables)
    ring = cfg.schedule == "pingpong" or cfg.chain_items   # one SMEM ring across items (_pingpong_body.py)
    kernel = ring_weight_grad_kernel if ring else _weight_grad_kernel
    body = functools.partial(kernel, cfg=cfg)
    shape = (group_sizes.shape[0], x.shape[1], dy.shape[1])
    return _launch(body, shape, out_dtype, num_sms, interpret, table, x, dy)


# ----------------------------------------------------------------------------------------------------
# Validation (one-line ValueErrors that name the argument and the fix)
# ----------------------------------------------------------------------------------------------------
def _validate(x_MK, w_GKN, group_sizes_G, preferred_element_type, tuning):
    """The forward commits to its backward, so all three kernels' tiles are checked here."""
    if x_MK.ndim != 2 or w_GKN.ndim != 3:
        raise ValueError(f"x_MK must be [M, K] and w_GKN [G, K, N]; got x {x_MK.shape}, w {w_GKN.shape}")
    (m, k), (g, k2, n) = x_MK.shape, w_GKN.shape
    if k != k2:
        raise ValueError(f"x_MK has K={k} but w_GKN has K={k2}; they must match")
    check_group_sizes(group_sizes_G, g)
    out_dtype = check_dtypes("x_MK", x_MK, "w_GKN", w_GKN, preferred_element_type)
    tuning = tuning or default_tuning(m, k, n, g)
    fwd, dgrad, wgrad = tuning.fwd, tuning.dgrad, tuning.wgrad
    check_tiling("fwd", fwd, [("N", n, fwd.cta_n), ("K", k, fwd.tile_k * fwd.split_k)], "forward")
    check_tiling("dgrad", dgrad, [("K", k, dgrad.cta_n), ("N", n, dgrad.tile_k * dgrad.split_k)], "input gradient")
    check_tiling("wgrad", wgrad, [("K", k, wgrad.cta_m), ("N", n, wgrad.cta_n)], "weight gradient", split=False)
    check_tuning_enums(tuning)
    return out_dtype, tuning


def _validate_dgrad(dy_MN, w_GKN, group_sizes_G, preferred_element_type, tuning):
    if dy_MN.ndim != 2 or w_GKN.ndim != 3:
        raise ValueError(f"dy_MN must be [M, N] and w_GKN [G, K, N]; got dy {dy_MN.shape}, w {w_GKN.shape}")
    n, (g, k, n2) = dy_MN.shape[1], w_GKN.shape
    if n != n2:
        raise ValueError(f"dy_MN has N={n} but w_GKN has N={n2}; they must match")
    check_group_sizes(group_sizes_G, g)
    out_dtype = check_dtypes("dy_MN", dy_MN, "w_GKN", w_GKN, preferred_element_type)
    tuning = tuning or default_kernel_tuning("dgrad", k, n, dy_MN.shape[0], g)
    check_tiling("dgrad", tuning.dgrad, [("K", k, tuning.dgrad.cta_n),
                                         ("N", n, tuning.dgrad.tile_k * tuning.dgrad.split_k)], "input gradient")
    check_tuning_enums(tuning)
    return out_dtype, tuning


def _validate_wgrad(x_MK, dy_MN, group_sizes_G, preferred_element_type, tuning):
    if x_MK.ndim != 2 or dy_MN.ndim != 2:
        raise ValueError(f"x_MK must be [M, K] and dy_MN [M, N]; got x {x_MK.shape}, dy {dy_MN.shape}")
    (m, k), (m2, n) = x_MK.shape, dy_MN.shape
    if m != m2:
        raise ValueError(f"x_MK has M={m} rows but dy_MN has M={m2}; they must match (row r of dy_MN is "
                         "the cotangent of row r of grouped_gemm's output)")
    check_group_sizes(group_sizes_G, group_sizes_G.shape[0] if group_sizes_G.ndim == 1 else "G")
    out_dtype = check_dtypes("x_MK", x_MK, "dy_MN", dy_MN, preferred_element_type)
    tuning = tuning or default_kernel_tuning("wgrad", k, n, m, group_sizes_G.shape[0])
    check_tiling("wgrad", tuning.wgrad, [("K", k, tuning.wgrad.cta_m), ("N", n, tuning.wgrad.cta_n)],
                 "weight gradient", split=False)
    check_tuning_enums(tuning)
    return out_dtype, tuning


# ----------------------------------------------------------------------------------------------------
# Public entry points and the custom VJP
# ----------------------------------------------------------------------------------------------------
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
    float32), fp32 accumulation; rows past sum(group_sizes_G) are zeros (with `tuning.zero_tail='none'`
    unwritten: see GroupedGemmTuning). Gradients come back in x's and w's dtypes; the weight gradient
    selects each group's rows of x (x may hold anything elsewhere) but multiplies them with all rows of
    its token blocks of the cotangent, so the cotangent must be finite everywhere (also past
    sum(group_sizes_G)). Not sharded inside: call it per device (e.g. in
    shard_map over the expert axis). `interpret=True` runs the Mosaic GPU kernels in the CPU interpreter
    (tests); `tuning` overrides `default_tuning(M, K, N, G)`.
    """
    out_dtype, tuning = _validate(x_MK, w_GKN, group_sizes_G, preferred_element_type, tuning)
    if x_MK.shape[0] == 0:
        return jnp.zeros((0, w_GKN.shape[2]), out_dtype)
    return _grouped_gemm(x_MK, w_GKN, group_sizes_G.astype(jnp.int32), out_dtype, bool(interpret), tuning)


def grouped_gemm_dgrad(dy_MN, w_GKN, group_sizes_G, *, preferred_element_type=None, interpret=False,
                       tuning=None):
    """Input gradient of `grouped_gemm`: `dx[rows of g] = dy[rows of g] @ w[g]ᵀ`, [M, K].

    dy_MN [M, N] in w_GKN's dtype (bf16/f16: cast an fp32 cotangent first); w_GKN [G, K, N];
    group_sizes_G [G] int. K must be a multiple of 64. Output in `preferred_element_type` (None: dy's
    dtype, or float32); rows past sum(group_sizes_G) are zeros (unwritten with `tuning.zero_tail='none'`).
    Per device like `grouped_gemm`; inside
    shard_map the output is typed as varying along its inputs' axes. Uses `tuning.dgrad` (its tile_k
    runs over N) and `tuning.zero_tail`; None: `default_tuning`'s dgrad tiles.
    """
    out_dtype, tuning = _validate_dgrad(dy_MN, w_GKN, group_sizes_G, preferred_element_type, tuning)
    if dy_MN.shape[0] == 0:
        return vary_like(jnp.zeros((0, w_GKN.shape[1]), out_dtype), dy_MN, w_GKN, group_sizes_G)
    dx = _ragged_matmul(dy_MN, w_GKN, group_sizes_G.astype(jnp.int32), out_dtype, tuning.dgrad, True,
                        _num_sms(tuning, interpret), bool(interpret), tuning.zero_tail, tuning.tables,
                        tuning.row_tiles)
    return vary_like(dx, dy_MN, w_GKN, group_sizes_G)


def grouped_gemm_wgrad(x_MK, dy_MN, group_sizes_G, *, preferred_element_type=None, interpret=False,
                       tuning=None):
    """Weight gradient of `grouped_gemm`: `dw[g] = x[rows of g]ᵀ @ dy[rows of g]`, [G, K, N].

    x_MK [M, K] and dy_MN [M, N] in one dtype (bf16/f16); group_sizes_G [G] int. K or N must be a
    multiple of 128, the other of 64. Groups with no rows get zeros; x's rows of other groups and past
    sum(group_sizes_G) are deselected in SMEM (x may hold anything there, e.g. an unwritten tail), dy's
    are not (0 * NaN is NaN), so dy must be finite everywhere. Output in
    `preferred_element_type` (None: x's dtype, or float32). Per device, typed like `grouped_gemm_dgrad`;
    a weight replicated over a mesh axis needs its gradient summed over that axis by the caller.
    Uses `tuning.wgrad`; None: `default_tuning`'s wgrad tiles.
    """
    out_dtype, tuning = _validate_wgrad(x_MK, dy_MN, group_sizes_G, preferred_element_type, tuning)
    shape = (group_sizes_G.shape[0], x_MK.shape[1], dy_MN.shape[1])
    if x_MK.shape[0] == 0:
        return vary_like(jnp.zeros(shape, out_dtype), x_MK, dy_MN, group_sizes_G)
    dw = _weight_grad(x_MK, dy_MN, group_sizes_G.astype(jnp.int32), out_dtype, tuning.wgrad,
                      _num_sms(tuning, interpret), bool(interpret), tuning.tables)
    return vary_like(dw, x_MK, dy_MN, group_sizes_G)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _grouped_gemm(x, w, group_sizes, out_dtype, interpret, tuning):
    sms = _num_sms(tuning, interpret)
    y = _ragged_matmul(x, w, group_sizes, out_dtype, tuning.fwd, False, sms, interpret, tuning.zero_tail,
                       tuning.tables, tuning.row_tiles)
    return vary_like(y, x, w, group_sizes)


def _grouped_gemm_fwd(x, w, group_sizes, out_dtype, interpret, tuning):
    return _grouped_gemm(x, w, group_sizes, out_dtype, interpret, tuning), (x, w, group_sizes)


def _grouped_gemm_bwd(out_dtype, interpret, tuning, residuals, dy):
    x, w, group_sizes = residuals
    dy = dy.astype(x.dtype)  # wgmma takes both operands in one dtype; accumulation stays fp32
    dx = grouped_gemm_dgrad(dy, w, group_sizes, preferred_element_type=x.dtype, interpret=interpret,
                            tuning=tuning)
    dw = grouped_gemm_wgrad(x, dy, group_sizes, preferred_element_type=w.dtype, interpret=interpret,
                            tuning=tuning)
    return (match_varying(dx, x, dy, w, group_sizes), match_varying(dw, w, x, dy, group_sizes),
            np.zeros(group_sizes.shape, jax.dtypes.float0))


_grouped_gemm.defvjp(_grouped_gemm_fwd, _grouped_gemm_bwd)
