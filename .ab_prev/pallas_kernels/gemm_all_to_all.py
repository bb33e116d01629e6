"""GEMM + all-to-all in one Mosaic GPU kernel: each output tile is stored straight into the peer that needs it.

Ulysses attention projects q/k/v for all heads of its sequence chunk and then all-to-alls them so that each
rank holds its heads for the whole sequence. Here the projection is computed per destination rank p (the
columns p receives, `w_NDF[p]`) and each finished tile is written by TMA into p's receive buffer, at the
sender's slot: the exchange is the GEMM's epilogue, so it runs under the next tiles' MMAs, with no separate
all-to-all and no staging copy. Point to point only (`plgpu.remote_ref` + semaphores, one process driving
the node's GPUs; never NVLink multicast).

    recv_NMF = gemm_all_to_all(x_MD, w_NDF, axis=...)   # inside shard_map over `axis` (n ranks)
    recv_NMF[s] = x_s @ w_s[r]                          # rank s's rows, the columns rank r (this one) owns

Work order: one persistent loop over the SMs takes the n destination steps' items in order, step j sending
to rank r + j, so the ranks write to distinct peers at a time (no rank is every sender's target at once);
inside a step the (row tile, column tile) items follow the grouped GEMM's band order. The step is a static
branch (one pipeline per destination): Mosaic builds a peer's TMA descriptor on the host, so the peer must be
a function of the rank alone ("Failed to recompute the async_copy peer id on the host" otherwise).
Completion: after its last store each compute warpgroup of every CTA signals every rank's semaphore once;
CTA 0 of each rank waits for all n x CTAs x 2 signals, so the kernel (and the receive buffer) is complete
when it returns.

Twin: `gemm_all_to_all_reference` (einsum + `lax.all_to_all`); the kernel with `exchange=False` is the
compute side alone (out[p] = x @ w[p], local), which also runs in the CPU interpreter (semaphores and
remote refs do not). The backward is the twin's (XLA: the all-to-all back, then the two GEMMs); the plain
schedule with the same order is parallel/ring_attention.py's `project_seq_to_heads`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._grouped_tiles import (NUM_COMPUTE_WGS, SUPPORTED_IN_DTYPES, GemmTiling, epilogue_smem,
                                           fit_smem, fit_tiling, sm_count, store_rows, swizzle_transforms,
                                           warpgroup_mma, warpgroup_tile)
from pallas_kernels._peer_checks import check_exchange_runnable
from pallas_kernels.varying import vary_like

__all__ = ["gemm_all_to_all", "gemm_all_to_all_reference", "default_tiling"]


def default_tiling(f: int) -> GemmTiling:
    """The widest CTA tile along the per-destination columns F, 64-wide K steps four deep (the grouped
    GEMM's forward defaults for experts of this size)."""
    return fit_tiling(GemmTiling(), f, "F")


def _kernel(x_gmem, w_gmem, out_gmem, *, cfg: GemmTiling, axis, exchange: bool, num_sms: int):
    n, m, f = out_gmem.shape
    k = x_gmem.shape[1]
    m_iters, n_iters, k_iters = m // cfg.cta_m, f // cfg.cta_n, k // cfg.tile_k
    in_tf = swizzle_transforms(cfg.tile_k, x_gmem.dtype)
    cur = {"mi": jnp.int32(0)}   # set per work item; the x BlockSpec's index map reads it when traced

    def pipeline(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k_iters,), memory_registers=40, wg_axis="wg", num_compute_wgs=NUM_COMPUTE_WGS,
            max_concurrent_steps=cfg.max_concurrent_steps, compute_context=context,
            in_specs=[plgpu.BlockSpec((cfg.cta_m, cfg.tile_k), lambda kk: (cur["mi"], kk), transforms=in_tf),
                      plgpu.BlockSpec((cfg.tile_k, cfg.cta_n), lambda kk: (kk, 0), transforms=in_tf)])

    ignore = lambda *_, **__: None  # noqa: E731  (allocations do not depend on the bodies)
    allocs = pipeline(ignore, ignore).get_allocations(x_gmem, w_gmem.at[0, :, :cfg.cta_n])
    rank = lax.axis_index(axis) if exchange else None
    # one semaphore per kernel (each get_global is its own allocation): every rank's warpgroups count into it
    sem = pl.get_global(plgpu.SemaphoreType.REGULAR) if exchange else None

    @functools.partial(pl.run_scoped, allocs=allocs, collective_axes="wg",
                       out_smem=epilogue_smem(cfg, out_gmem.dtype))
    def _scope(allocs, out_smem):
        wg = lax.axis_index("wg")
        tile = warpgroup_tile(cfg, wg)
        wg_row0, wg_col0 = tile.row0, tile.col0
        mma = warpgroup_mma(tile)

        def run_item(step, mi, ni):
            if exchange:        # step j: the columns of rank r + j, stored into its buffer at my slot
                dest = lax.rem(rank + step, n)
                target = plgpu.remote_ref(out_gmem, {axis: dest}).at[rank]
            else:               # the compute side alone: slot p holds x @ w[p]
                dest = step
                target = out_gmem.at[dest]

            def context(eval_pipeline):
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((cfg.tile_m, cfg.tile_n), jnp.float32))
                def _acc(acc_ref):
                    eval_pipeline(acc_ref)
                    store_rows(acc_ref[...], out_smem.at[wg], target, mi * cfg.cta_m + wg_row0,
                               ni * cfg.cta_n + wg_col0, cfg)

            cur["mi"] = mi
            pipeline(mma, context)(x_gmem, w_gmem.at[dest].at[:, pl.ds(ni * cfg.cta_n, cfg.cta_n)],
                                   allocations=allocs)

        # One loop over all steps' items, so the SMs stay busy across step boundaries; the step is a static
        # branch because a peer's TMA descriptor is built on the host, from the rank alone.
        items = m_iters * n_iters

        @plgpu.nd_loop((n * items,), collective_axes="sm")
        def _items(info):
            step = info.index[0] // items
            mi, ni = plgpu.planar_snake(info.index[0] % items, (m_iters, n_iters), cfg.grid_minor, cfg.grid_tile_width)
            for j in range(n):
                pl.when(step == j)(functools.partial(run_item, j, mi, ni))

        if exchange:
            @pl.when(wg < NUM_COMPUTE_WGS)
            def _signal():
                plgpu.wait_smem_to_gmem(0, wait_read_only=False)   # this warpgroup's stores have landed
                for peer in range(n):
                    pl.semaphore_signal(sem, device_id={axis: peer})

            @pl.when((wg == 0) & (lax.axis_index("sm") == 0))
            def _wait():   # every rank's CTAs have stored into my buffer
                pl.semaphore_wait(sem, n * num_sms * NUM_COMPUTE_WGS)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _validate(x_MD, w_NDF, cfg):
    if x_MD.ndim != 2 or w_NDF.ndim != 3:
        raise ValueError(f"x_MD must be [M, D] and w_NDF [n, D, F]; got x {x_MD.shape}, w {w_NDF.shape}")
    (m, k), (_, k2, f) = x_MD.shape, w_NDF.shape
    if k != k2:
        raise ValueError(f"x_MD has D={k} but w_NDF has D={k2}; they must match")
    if x_MD.dtype != w_NDF.dtype or x_MD.dtype not in SUPPORTED_IN_DTYPES:
        raise ValueError(f"x_MD and w_NDF must share dtype bfloat16 or float16; got {x_MD.dtype} and {w_NDF.dtype}")
    cfg = cfg or default_tiling(f)
    for name, dim, tile in (("M (rows of x_MD)", m, cfg.cta_m), ("F (w_NDF dim 2)", f, cfg.cta_n),
                            ("D", k, cfg.tile_k)):
        if dim % tile:
            raise ValueError(f"gemm_all_to_all: {name}={dim} must be a multiple of the tile {tile}; pad it")
    return fit_smem(cfg, (cfg.cta_m + cfg.cta_n) * cfg.tile_k, x_MD.dtype)


def _launch(x_MD, w_NDF, cfg, axis, exchange, num_sms, interpret):
    n, _, f = w_NDF.shape
    body = functools.partial(_kernel, cfg=cfg, axis=axis, exchange=exchange, num_sms=num_sms)
    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((n, x_MD.shape[0], f), x_MD.dtype),
        grid=(num_sms,), grid_names=("sm",), num_threads=NUM_COMPUTE_WGS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else False)
    return kernel(x_MD, w_NDF)


def gemm_all_to_all_reference(x_MD, w_NDF, *, axis):
    """The twin: every destination's GEMM (fp32 accumulation, x's dtype out), then one all-to-all."""
    y_NMF = jnp.einsum("md,ndf->nmf", x_MD, w_NDF, preferred_element_type=jnp.float32).astype(x_MD.dtype)
    return lax.all_to_all(y_NMF, axis, 0, 0)


def gemm_all_to_all(x_MD, w_NDF, *, axis, tiling: GemmTiling | None = None, exchange: bool = True,
                    num_sms: int | None = None, interpret: bool = False):
    """`gemm_all_to_all_reference(x_MD, w_NDF, axis=axis)` as one kernel, inside `shard_map` over a mesh that
    has `axis` (n = w_NDF.shape[0] ranks along it; check_vma on or off), with one process driving all of the
    mesh's GPUs. x_MD [M, D] bf16/f16, w_NDF [n, D, F] same dtype; M a multiple of the CTA tile's rows, F of
    its columns (`default_tiling(F)`: 128 x 256 when 256 divides F, else 256 x 128), D of 64. Differentiable:
    the backward is the twin's. `exchange=False` runs the compute side alone (out[p] = x @ w[p], no
    communication, not differentiated; the only form the CPU interpreter can run)."""
    cfg = _validate(x_MD, w_NDF, tiling)
    if not exchange:
        out = _launch(x_MD, w_NDF, cfg, axis, False, num_sms or sm_count(interpret), interpret)
        return vary_like(out, x_MD, w_NDF)
    check_exchange_runnable("gemm_all_to_all", interpret=interpret, ranks=w_NDF.shape[0], operand="w_NDF",
                            axis=axis)
    return _exchanged(x_MD, w_NDF, cfg, axis, num_sms or sm_count(False))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _exchanged(x_MD, w_NDF, cfg, axis, num_sms):
    # typed as varying along the inputs' axes and `axis` (a Pallas call's outputs come back typed replicated)
    return vary_like(_launch(x_MD, w_NDF, cfg, axis, True, num_sms, False), x_MD, w_NDF, axes=(axis,))


def _exchanged_fwd(x_MD, w_NDF, cfg, axis, num_sms):
    return _exchanged(x_MD, w_NDF, cfg, axis, num_sms), (x_MD, w_NDF)


def _exchanged_bwd(cfg, axis, num_sms, residuals, g_NMF):
    x_MD, w_NDF = residuals
    _, pull = jax.vjp(functools.partial(gemm_all_to_all_reference, axis=axis), x_MD, w_NDF)
    return pull(g_NMF.astype(x_MD.dtype))


_exchanged.defvjp(_exchanged_fwd, _exchanged_bwd)
