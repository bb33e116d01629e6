"""All-to-all + GEMM in one Mosaic GPU kernel: the exchange's rows are pushed into the receivers' buffers
by a few CTAs while the others run the GEMM over the sources that have already arrived.

Ulysses attention ends with each rank holding its heads for the whole sequence; the output projection of
rank r's sequence chunk needs every rank's heads: y_r = sum_s o_s[chunk r] @ wo[s] (wo[s]: the rows of rank
s's heads). Here `send_ctas` CTAs push this rank's rows for each destination p straight into p's receive
buffer, at this rank's slot (TMA: HBM -> SMEM -> p's HBM, point to point over NVLink), step j to rank r + j
so that the ranks write distinct peers at a time, and signal p's step-j semaphore once per CTA and step.
The other CTAs run the GEMM over K = n x (heads per rank x head dim) with the sources in step order (own rows
first: they arrive by a local copy), and a work item's memory warpgroup waits for step j's signals right
before its first load of source j (a non-decrementing wait, so every item may wait). The exchange runs under
the GEMM of what has arrived; there is no separate all-to-all kernel and no staging copy in XLA.
Point to point only (`plgpu.remote_ref` + semaphores, one process driving the node's GPUs; never NVLink
multicast).

    y_MD = all_to_all_gemm(x_NMK, w_NKD, axis=...)   # inside shard_map over `axis` (n ranks)
    y_MD = sum_s x_s[r] @ w[s]                       # x_s[r]: rank s's rows for my chunk; w[s]: its K rows

Twin: `all_to_all_gemm_reference` (`lax.all_to_all`, then one einsum); with `exchange=False` the kernel is
the compute side alone (y = sum_s x[s] @ w[s] on local rows, all CTAs computing), the only form the CPU
interpreter runs (it has no semaphores or remote refs). The backward is the twin's (custom VJP); the plain
schedule with ppermute rings is parallel/ring_attention.py's `project_heads_to_seq`.
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

__all__ = ["all_to_all_gemm", "all_to_all_gemm_reference", "default_tiling", "SEND_BOX", "DEFAULT_SEND_CTAS"]

SEND_BOX = (128, 64)     # rows x columns of one pushed TMA box (16 KiB of bf16, 128-byte swizzle)
SEND_SLOTS = 4           # boxes in flight per sending CTA (loads run SEND_SLOTS - 1 ahead of the stores)
DEFAULT_SEND_CTAS = 8    # of the H200's 132 SMs: ~6% of the GEMM's rate lent to the exchange


def default_tiling(d: int) -> GemmTiling:
    """The widest CTA tile along the output columns D, 64-wide K steps four deep."""
    return fit_tiling(GemmTiling(), d, "D")


def _send(x_gmem, recv_gmem, sems, *, n: int, axis, cta, send_ctas: int):
    """One sending CTA (warpgroup 0 copies; the buffers are allocated by all warpgroups, as multithreaded
    kernels require): for each step j, its share of the boxes of x[r + j] (rows of x_gmem [n * M, K]) into
    rank r + j's receive buffer at slot r; then one signal of that rank's step-j semaphore."""
    @functools.partial(pl.run_scoped, buf=plgpu.SMEM((SEND_SLOTS, *SEND_BOX), x_gmem.dtype,
                                                     transforms=swizzle_transforms(SEND_BOX[1], x_gmem.dtype)),
                       loaded=plgpu.Barrier(num_barriers=SEND_SLOTS), collective_axes="wg")
    def _scope(buf, loaded):
        pl.when(lax.axis_index("wg") == 0)(functools.partial(_send_steps, x_gmem, recv_gmem, sems, buf, loaded,
                                                             n=n, axis=axis, cta=cta, send_ctas=send_ctas))


def _send_steps(x_gmem, recv_gmem, sems, buf, loaded, *, n: int, axis, cta, send_ctas: int):
    m, k = x_gmem.shape[0] // n, x_gmem.shape[1]
    rank = lax.axis_index(axis)
    box_m, box_k = SEND_BOX
    per_row = k // box_k
    boxes = (m // box_m) * per_row
    mine = (boxes - cta + send_ctas - 1) // send_ctas   # boxes cta, cta + send_ctas, ...
    for j in range(n):   # static: a peer's TMA descriptor is built on the host, from the rank alone
        dest = lax.rem(rank + j, n)
        target = recv_gmem if j == 0 else plgpu.remote_ref(recv_gmem, {axis: dest})

        def box(i):
            b = cta + i * send_ctas
            return pl.ds((b // per_row) * box_m, box_m), pl.ds((b % per_row) * box_k, box_k)

        def load(i):
            rows, cols = box(i)
            plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(dest * m, m)].at[rows, cols], buf.at[i % SEND_SLOTS],
                                    loaded.at[i % SEND_SLOTS])

        @pl.loop(0, jnp.minimum(mine, SEND_SLOTS - 1))
        def _prologue(i):
            load(i)

        @pl.loop(0, mine)
        def _boxes(i):
            plgpu.barrier_wait(loaded.at[i % SEND_SLOTS])
            rows, cols = box(i)
            plgpu.copy_smem_to_gmem(buf.at[i % SEND_SLOTS], target.at[pl.ds(rank * m, m)].at[rows, cols])
            # box i + SLOTS - 1 reuses the slot of box i - 1, whose store must have read it
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            pl.when(i + SEND_SLOTS - 1 < mine)(lambda: load(i + SEND_SLOTS - 1))

        plgpu.wait_smem_to_gmem(0, wait_read_only=False)   # this step's boxes have landed
        if j == 0:   # this rank's own rows: a local signal
            pl.semaphore_signal(sems[0])
        else:
            pl.semaphore_signal(sems[j], device_id={axis: dest})


def _kernel(x_gmem, w_gmem, y_gmem, recv_gmem=None, *, cfg: GemmTiling, n: int, axis, exchange: bool,
            num_sms: int, send_ctas: int):
    """x_gmem [n * M, K] (rows for destination p at p * M), w_gmem [n * K, D], y_gmem [M, D]; with the exchange
    recv_gmem [n * M, K] (rank s's rows at s * M)."""
    m, k = x_gmem.shape[0] // n, x_gmem.shape[1]
    d = y_gmem.shape[1]
    m_iters, n_iters, k_iters = m // cfg.cta_m, d // cfg.cta_n, k // cfg.tile_k
    in_tf = swizzle_transforms(cfg.tile_k, x_gmem.dtype)
    rank = lax.axis_index(axis) if exchange else None
    # one semaphore per step (each get_global is its own allocation): step j's senders count into sems[j]
    sems = [pl.get_global(plgpu.SemaphoreType.REGULAR) for _ in range(n)] if exchange else None
    rows_gmem = recv_gmem if exchange else x_gmem   # [n * M, K]: source s at rows s * M
    cur = {"mi": jnp.int32(0), "wait": False}   # set per work item; the index maps read them when traced

    def source(kk):   # the source rank of K step kk: step order, own rows first
        j = kk // k_iters
        return lax.rem(rank - j + n, n) if exchange else j

    def x_index(kk):
        # Only in the traced copy issue (the memory warpgroup), not when jax probes the map: before the first
        # load of source j's rows, wait until all its sending CTAs have signalled (j = 0 too: this rank's own
        # rows reach the receive buffer by a local copy). Non-decrementing, so every work item may wait; the
        # TMA loads after the wait read what the peers' TMA stores wrote, as in jax's all_gather_lhs_matmul.
        if cur["wait"]:
            for j in range(n):
                @pl.when(kk == j * k_iters)
                def _wait_for_source():
                    pl.semaphore_wait(sems[j], send_ctas, decrement=False)
        return source(kk) * m_iters + cur["mi"], kk % k_iters

    def pipeline(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(n * k_iters,), memory_registers=40, wg_axis="wg", num_compute_wgs=NUM_COMPUTE_WGS,
            max_concurrent_steps=cfg.max_concurrent_steps, compute_context=context,
            in_specs=[plgpu.BlockSpec((cfg.cta_m, cfg.tile_k), x_index, transforms=in_tf),
                      plgpu.BlockSpec((cfg.tile_k, cfg.cta_n), lambda kk: (source(kk) * k_iters + kk % k_iters, 0),
                                      transforms=in_tf)])

    w_cols = lambda ni: w_gmem.at[:, pl.ds(ni * cfg.cta_n, cfg.cta_n)]  # noqa: E731
    ignore = lambda *_, **__: None  # noqa: E731  (allocations do not depend on the bodies)
    compute_ctas = num_sms - send_ctas if exchange else num_sms
    cta = lax.axis_index("sm")

    def compute():
        allocs = pipeline(ignore, ignore).get_allocations(rows_gmem, w_cols(0))

        @functools.partial(pl.run_scoped, allocs=allocs, collective_axes="wg",
                           out_smem=epilogue_smem(cfg, y_gmem.dtype))
        def _scope(allocs, out_smem):
            wg = lax.axis_index("wg")
            tile = warpgroup_tile(cfg, wg)
            wg_row0, wg_col0 = tile.row0, tile.col0
            mma = warpgroup_mma(tile)

            @pl.loop(cta - (num_sms - compute_ctas), m_iters * n_iters, step=compute_ctas)
            def _items(item):
                mi, ni = plgpu.planar_snake(item, (m_iters, n_iters), cfg.grid_minor, cfg.grid_tile_width)

                def context(eval_pipeline):
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((cfg.tile_m, cfg.tile_n), jnp.float32))
                    def _acc(acc_ref):
                        eval_pipeline(acc_ref)
                        store_rows(acc_ref[...], out_smem.at[wg], y_gmem, mi * cfg.cta_m + wg_row0,
                                   ni * cfg.cta_n + wg_col0, cfg)

                cur["mi"] = mi
                run = pipeline(mma, context)
                cur["wait"] = exchange
                run(rows_gmem, w_cols(ni), allocations=allocs)
                cur["wait"] = False

    if exchange:
        pl.when(cta < send_ctas)(lambda: _send(x_gmem, recv_gmem, sems, n=n, axis=axis, cta=cta, send_ctas=send_ctas))

        pl.when(cta >= send_ctas)(compute)
    else:
        compute()
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _validate(x_NMK, w_NKD, cfg):
    if x_NMK.ndim != 3 or w_NKD.ndim != 3:
        raise ValueError(f"x_NMK must be [n, M, K] and w_NKD [n, K, D]; got x {x_NMK.shape}, w {w_NKD.shape}")
    (n, m, k), (n2, k2, d) = x_NMK.shape, w_NKD.shape
    if (n, k) != (n2, k2):
        raise ValueError(f"x_NMK [n={n}, M, K={k}] and w_NKD [n={n2}, K={k2}, D] must agree in n and K")
    if x_NMK.dtype != w_NKD.dtype or x_NMK.dtype not in SUPPORTED_IN_DTYPES:
        raise ValueError(f"x_NMK and w_NKD must share dtype bfloat16 or float16; got {x_NMK.dtype} and {w_NKD.dtype}")
    cfg = cfg or default_tiling(d)
    for name, dim, tile in (("M (rows per destination)", m, cfg.cta_m), ("M (rows per destination)", m, SEND_BOX[0]),
                            ("D (w_NKD dim 2)", d, cfg.cta_n), ("K", k, cfg.tile_k), ("K", k, SEND_BOX[1])):
        if dim % tile:
            raise ValueError(f"all_to_all_gemm: {name}={dim} must be a multiple of the tile {tile}; pad it")
    return fit_smem(cfg, (cfg.cta_m + cfg.cta_n) * cfg.tile_k, x_NMK.dtype)


def _launch(x_NMK, w_NKD, cfg, axis, exchange, num_sms, send_ctas, interpret):
    n, m, k = x_NMK.shape
    body = functools.partial(_kernel, cfg=cfg, n=n, axis=axis, exchange=exchange, num_sms=num_sms,
                             send_ctas=send_ctas)
    y_type = jax.ShapeDtypeStruct((m, w_NKD.shape[2]), x_NMK.dtype)
    # the receive buffer is an output: remote refs reach a kernel's own buffers only
    out_type = (y_type, jax.ShapeDtypeStruct((n * m, k), x_NMK.dtype)) if exchange else y_type
    kernel = plgpu.kernel(
        body, out_type=out_type,
        grid=(num_sms,), grid_names=("sm",), num_threads=NUM_COMPUTE_WGS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else False)
    out = kernel(x_NMK.reshape(n * m, k), w_NKD.reshape(n * k, -1))
    return out[0] if exchange else out


def all_to_all_gemm_reference(x_NMK, w_NKD, *, axis):
    """The twin: one all-to-all (recv[s] = rank s's rows for this rank), then the GEMM over all sources
    (fp32 accumulation, x's dtype out)."""
    recv_NMK = lax.all_to_all(x_NMK, axis, 0, 0)
    return jnp.einsum("smk,skd->md", recv_NMK, w_NKD, preferred_element_type=jnp.float32).astype(x_NMK.dtype)


def all_to_all_gemm(x_NMK, w_NKD, *, axis, tiling: GemmTiling | None = None, exchange: bool = True,
                    num_sms: int | None = None, send_ctas: int = DEFAULT_SEND_CTAS, interpret: bool = False):
    """`all_to_all_gemm_reference(x_NMK, w_NKD, axis=axis)` as one kernel, inside `shard_map` over a mesh that
    has `axis` (n = x_NMK.shape[0] ranks along it), with one process driving all of the mesh's GPUs.
    x_NMK [n, M, K] (x[p]: this rank's rows for destination p) bf16/f16, w_NKD [n, K, D] same dtype (w[s]:
    the K rows that multiply source s's columns); M a multiple of 128 and of the CTA tile's rows, D of its
    columns (`default_tiling(D)`), K of 64. Differentiable: the backward is the twin's. `send_ctas` CTAs push
    the exchange, the rest compute. `exchange=False` runs the compute side alone (y = sum_s x[s] @ w[s],
    local, not differentiated; the only form the CPU interpreter can run)."""
    cfg = _validate(x_NMK, w_NKD, tiling)
    if not exchange:
        out = _launch(x_NMK, w_NKD, cfg, axis, False, num_sms or sm_count(interpret), 0, interpret)
        return vary_like(out, x_NMK, w_NKD)
    check_exchange_runnable("all_to_all_gemm", interpret=interpret, ranks=x_NMK.shape[0], operand="x_NMK",
                            axis=axis)
    sms = num_sms or sm_count(False)
    if not 0 < send_ctas < sms:
        raise ValueError(f"send_ctas={send_ctas} must be between 1 and the SM count - 1 ({sms - 1})")
    return _exchanged(x_NMK, w_NKD, cfg, axis, sms, send_ctas)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _exchanged(x_NMK, w_NKD, cfg, axis, num_sms, send_ctas):
    # typed as varying along the inputs' axes and `axis` (a Pallas call's outputs come back typed replicated)
    return vary_like(_launch(x_NMK, w_NKD, cfg, axis, True, num_sms, send_ctas, False), x_NMK, w_NKD, axes=(axis,))


def _exchanged_fwd(x_NMK, w_NKD, cfg, axis, num_sms, send_ctas):
    return _exchanged(x_NMK, w_NKD, cfg, axis, num_sms, send_ctas), (x_NMK, w_NKD)


def _exchanged_bwd(cfg, axis, num_sms, send_ctas, residuals, g_MD):
    x_NMK, w_NKD = residuals
    _, pull = jax.vjp(functools.partial(all_to_all_gemm_reference, axis=axis), x_NMK, w_NKD)
    return pull(g_MD.astype(x_NMK.dtype))


_exchanged.defvjp(_exchanged_fwd, _exchanged_bwd)
