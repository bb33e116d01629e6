"""AG + scatter + grouped GEMM in one Mosaic GPU kernel: the expert-parallel dispatch's rows are pushed into
their receivers' buffers by a few CTAs while the other CTAs run the first expert GEMM over the rows that have
landed.

Each rank holds its tokens' rows sorted by (destination rank, local expert) (`send_MD`: the local sort, the
scatter of the unfused all_gather dispatch moved to the sending side, so a row travels only to the rank whose
expert needs it). Receivers keep rows in (local expert, source rank) order (`_dispatch_tables.py`): a grouped
GEMM row tile then depends on the one or two sources whose runs it covers, not on all n. `send_ctas` CTAs push
this rank's runs, step j to rank r + j (the ranks write distinct peers at a time), in TMA boxes of 128 rows (a
run's last rows as a binary ladder of 64, 32, ..., 1), HBM -> SMEM -> the peer's HBM, point to point over
NVLink (`plgpu.remote_ref`; never NVLink multicast), and signal the peer's step-j semaphore once per CTA and
step (after which each sending CTA waits for every peer's signals too, so that no signal lands after the
kernel ends). The other CTAs run the grouped GEMM work items (`_ragged_body.py`, the plain kernel's body) over
the receive buffer; a work item's memory warpgroup waits, right before its first load, for the sources its rows
come from (`tile_sources`; a non-decrementing wait, so every item may wait). A wait covers a source's whole
step for this rank (all its experts' runs), not one run; steps are ordered so that the ranks write distinct
peers at a time when they run in step.

    y_RN, recv_RD, group_sizes_G = all_gather_grouped_gemm(send_MD, counts_SPG, w_GDN, axis=...)

Twin: `all_gather_grouped_gemm_reference` (all-gather of the send buffers, a gather into the receive order,
then the grouped GEMM's plain twin). Backward (custom VJP, `dispatch_backward`): the grouped GEMM kernel's
dgrad and wgrad on the receive buffer, then the exchange's transpose (`run_exchange_reference.return_runs`,
one all-to-all back to the send order). With `exchange=False` the kernel is the compute side alone (the grouped
GEMM on the CTAs the exchange leaves free, over a receive buffer given as input): the only form the CPU
interpreter runs besides `push_runs_locally` (the sending side alone, each step's pushes landing in a local
buffer), which tests the run and box arithmetic on the CPU. The backward is the twin's (custom VJP).
Not yet run on several GPUs (only compiled for a mock topology): the exchange is never chosen for you.
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
from pallas_kernels._grouped_tiles import GemmTiling, check_dtypes, fit_ragged_tiling, persistent_kernel, sm_count
from pallas_kernels._peer_checks import check_exchange_runnable
from pallas_kernels._ragged_body import ragged_kernel
from pallas_kernels._work_tables import ROW_ALIGN, prefix_sum
from pallas_kernels.grouped_gemm import grouped_gemm_dgrad, grouped_gemm_wgrad
from pallas_kernels.grouped_gemm_reference import grouped_gemm_reference
from pallas_kernels.run_exchange_reference import return_runs
from pallas_kernels.varying import match_varying, vary_like

__all__ = ["all_gather_grouped_gemm", "all_gather_grouped_gemm_reference", "dispatch_backward", "push_runs_locally",
           "DEFAULT_SEND_CTAS", "SEND_ROWS"]

SEND_ROWS = 128          # rows of one pushed box; a run's remainder goes as boxes of 64, 32, ..., 1 rows
DEFAULT_SEND_CTAS = 8    # of the H200's 132 SMs, as all_to_all_gemm.py (untuned: needs several GPUs)
_LADDER = tuple(1 << b for b in range(SEND_ROWS.bit_length() - 2, -1, -1))   # 64, 32, ..., 1


def _send_cols(d: int) -> int:
    return 256 if d % 256 == 0 else 128


def _runs_table(counts_SPG, rank, d: int, send_ctas: int):
    """int32 [4, n, G] for sender `rank`: each (destination, expert) run's first row in the send buffer, its
    first row in the destination's receive buffer, its rows, and the number of push units (128-row chunks x
    column boxes) before it among that destination's runs (units are dealt to the sending CTAs round robin)."""
    send_start, dest_start, count = send_runs(counts_SPG, rank)
    units = (count + SEND_ROWS - 1) // SEND_ROWS * (d // _send_cols(d))
    unit0 = jax.vmap(lambda u: prefix_sum(u) - u)(units)
    return jnp.stack([send_start, dest_start, count, unit0 % send_ctas]).astype(jnp.int32)


def _push_runs(send_gmem, runs_ref, bufs, loaded, *, n: int, rank, cta, send_ctas: int, target, signal, drain=None):
    """One sending CTA (warpgroup 0): for each step j its units of the runs for rank + j, each box loaded
    into SMEM and stored into `target(j, dest)` at the run's receive rows; then `signal(j, dest)` (None: no
    signal); at the end `drain()`. Two SMEM slots: a box's load waits only for the store two boxes back to have
    read its slot. Each load is waited for at once (one load and one store in flight per CTA): untuned; a ring of
    loads running ahead, as all_to_all_gemm.py's sender keeps, is the first thing to try when it is measured."""
    d = send_gmem.shape[1]
    cols_box = _send_cols(d)
    col_boxes = d // cols_box
    num_experts = runs_ref.shape[2]

    for j in range(n):   # static: a peer's TMA descriptor is built from the rank alone
        dest = lax.rem(rank + j, n)
        out = target(j, dest)

        def push(src_row, dst_row, rows: int, cols, pushed):
            slot = lax.rem(pushed, 2)
            buf = bufs.at[slot].at[pl.ds(0, rows)]
            plgpu.copy_gmem_to_smem(send_gmem.at[pl.ds(src_row, rows), cols], buf, loaded.at[slot])
            plgpu.barrier_wait(loaded.at[slot])
            plgpu.copy_smem_to_gmem(buf, out.at[pl.ds(dst_row, rows), cols])
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)

        def run_units(e, pushed):
            send0, dest0, count, unit0 = (runs_ref[i, dest, e] for i in range(4))
            units = (count + SEND_ROWS - 1) // SEND_ROWS * col_boxes
            first = lax.rem(cta - unit0 + send_ctas, send_ctas)   # this CTA's first unit of the run

            def unit(t, pushed):
                u = first + t * send_ctas
                row0, cols = (u // col_boxes) * SEND_ROWS, pl.ds((u % col_boxes) * cols_box, cols_box)
                rows = jnp.minimum(count - row0, SEND_ROWS)
                full = rows == SEND_ROWS
                pl.when(full)(functools.partial(push, send0 + row0, dest0 + row0, SEND_ROWS, cols, pushed))
                pushed, off = pushed + full.astype(jnp.int32), jnp.int32(0)
                for bit in _LADDER:   # the run's last rows: one box per set bit
                    has = jnp.logical_not(full) & ((rows & bit) != 0)
                    pl.when(has)(functools.partial(push, send0 + row0 + off, dest0 + row0 + off, bit, cols, pushed))
                    pushed, off = pushed + has.astype(jnp.int32), off + jnp.where(has, bit, 0)
                return pushed

            return lax.fori_loop(0, jnp.maximum((units - first + send_ctas - 1) // send_ctas, 0), unit, pushed)

        pushed = lax.fori_loop(0, num_experts, run_units, jnp.int32(0))
        del pushed
        plgpu.wait_smem_to_gmem(0, wait_read_only=False)   # this step's boxes have landed
        if signal is not None:
            signal(j, dest)
    if drain is not None:
        drain()


def _sender_scope(body):
    """The sending CTA's SMEM (allocated by all warpgroups, as multithreaded kernels require), warpgroup 0 copies."""
    def run(send_gmem, *args, **kwargs):
        cols = _send_cols(send_gmem.shape[1])

        @functools.partial(pl.run_scoped, bufs=plgpu.SMEM((2, SEND_ROWS, cols), send_gmem.dtype),
                           loaded=plgpu.Barrier(num_barriers=2), collective_axes="wg")
        def _scope(bufs, loaded):
            pl.when(lax.axis_index("wg") == 0)(lambda: body(send_gmem, *args, bufs, loaded, **kwargs))
    return run


def _kernel(table_ref, num_valid_ref, tile_src_ref, runs_ref, x_gmem, w_gmem, y_gmem, recv_gmem=None, *,
            cfg: GemmTiling, n: int, axis, exchange: bool, num_sms: int, send_ctas: int):
    """x_gmem: with the exchange the send buffer [M, D] (runs for destination p, expert e in (p, e) order), the
    pushed rows landing in recv_gmem [R, D]; without it the receive buffer itself. y_gmem [R, N]."""
    cta = lax.axis_index("sm")
    if not exchange:   # the first send_ctas CTAs idle (they would push the runs)
        pl.when(cta >= send_ctas)(lambda: ragged_kernel(table_ref, num_valid_ref, x_gmem, w_gmem, y_gmem, cfg=cfg,
                                                        transpose_w=False, ctas=(send_ctas, num_sms - send_ctas)))
        return
    rank = lax.axis_index(axis)
    # one semaphore per step (each get_global is its own allocation): step j's senders count into sems[j]
    sems = [pl.get_global(plgpu.SemaphoreType.REGULAR) for _ in range(n)]

    def signal(j, dest):
        if j == 0:
            pl.semaphore_signal(sems[0])        # this rank's own rows: a local signal
        else:
            pl.semaphore_signal(sems[j], device_id={axis: dest})

    def drain():
        # Every sender signals every peer, but a receiver's work items wait only for the sources they read: this
        # rank must not end its kernel while a peer's signal is still on its way into this launch's semaphores
        # (they are a per-call scratch buffer, dropped after it). Non-decrementing, like the items' waits.
        for j in range(n):
            pl.semaphore_wait(sems[j], send_ctas, decrement=False)

    def wait_for_sources(slot):   # source s = rank - j arrived when its step-j senders have all signalled
        first, last = tile_src_ref[0, slot], tile_src_ref[1, slot]
        for j in range(n):
            s = lax.rem(rank - j + n, n)
            pl.when((s >= first) & (s <= last))(lambda j=j: pl.semaphore_wait(sems[j], send_ctas, decrement=False))

    target = lambda j, dest: recv_gmem if j == 0 else plgpu.remote_ref(recv_gmem, {axis: dest})  # noqa: E731
    pl.when(cta < send_ctas)(lambda: _sender_scope(_push_runs)(
        x_gmem, runs_ref, n=n, rank=rank, cta=cta, send_ctas=send_ctas, target=target, signal=signal, drain=drain))
    pl.when(cta >= send_ctas)(lambda: ragged_kernel(
        table_ref, num_valid_ref, recv_gmem, w_gmem, y_gmem, cfg=cfg, transpose_w=False,
        ctas=(send_ctas, num_sms - send_ctas), before_slot=wait_for_sources))



def _validate(send_MD, counts_SPG, w_GDN, capacity, tiling, send_ctas):
    if send_MD.ndim != 2 or w_GDN.ndim != 3 or counts_SPG.ndim != 3:
        raise ValueError(f"send_MD must be [M, D], counts_SPG [n, n, G] and w_GDN [G, D, N]; got {send_MD.shape}, "
                         f"{counts_SPG.shape}, {w_GDN.shape}")
    (_, d), (g, d2, nn) = send_MD.shape, w_GDN.shape
    if counts_SPG.shape[1:] != (counts_SPG.shape[0], g) or not jnp.issubdtype(counts_SPG.dtype, jnp.integer):
        raise ValueError(f"counts_SPG must be int [n, n, G={g}] (rows of source s for expert e of rank p); got "
                         f"{counts_SPG.dtype} {counts_SPG.shape}")
    if d != d2:
        raise ValueError(f"send_MD has D={d} but w_GDN has D={d2}; they must match")
    check_dtypes("send_MD", send_MD, "w_GDN", w_GDN, None)
    if d % 128:   # the pushed boxes are 128 or 256 columns wide
        raise ValueError(f"all_gather_grouped_gemm: D={d} must be a multiple of 128; pad it")
    cfg = fit_ragged_tiling(tiling or default_tuning(capacity, d, nn, g, pingpong=False).fwd, d, send_MD.dtype)
    for name, dim, tile in (("N (w_GDN dim 2)", nn, cfg.cta_n), ("D", d, cfg.tile_k), ("capacity", capacity, ROW_ALIGN)):
        if dim % tile:
            raise ValueError(f"all_gather_grouped_gemm: {name}={dim} must be a multiple of {tile}; pad it")
    if capacity < cfg.cta_m:
        raise ValueError(f"all_gather_grouped_gemm: capacity={capacity} must be >= the row tile {cfg.cta_m}")
    if cfg.split_k != 1:
        raise ValueError("all_gather_grouped_gemm: tiling.split_k must be 1 (a work item waits before its first K step)")
    if send_ctas < 0:
        raise ValueError(f"send_ctas={send_ctas} must be >= 0")
    return cfg


def all_gather_grouped_gemm_reference(send_MD, counts_SPG, w_GDN, *, axis, capacity: int):
    """The twin, inside shard_map over `axis`: every rank's send buffer all-gathered, this rank's receive
    buffer gathered from it in (expert, source) order, then the grouped GEMM (fp32 accumulation, x's dtype).
    Returns (y_RN, recv_RD, group_sizes_G); rows past sum(group_sizes) are zeros in both."""
    rank, n = lax.axis_index(axis), counts_SPG.shape[0]
    all_send = lax.all_gather(send_MD, axis)                       # [n, M, D]
    counts_SG = jnp.maximum(counts_SPG[:, rank, :], 0)
    group_sizes, run_start = receive_layout(counts_SG)
    send_start = jax.vmap(lambda s: send_runs(counts_SPG, s)[0][rank])(jnp.arange(n))   # [n sources, G]
    row = jnp.arange(capacity)
    # the (source, expert) run holding each receive row: runs are disjoint, so one matches (or none: the tail)
    in_run = (row[:, None, None] >= run_start[None]) & (row[:, None, None] < (run_start + counts_SG)[None])
    hit = jnp.any(in_run, axis=(1, 2))
    flat = jnp.argmax(in_run.reshape(capacity, -1), axis=1)
    s, e = flat // counts_SG.shape[1], flat % counts_SG.shape[1]
    src_row = send_start[s, e] + row - run_start[s, e]
    recv = jnp.where(hit[:, None], all_send[s, jnp.where(hit, src_row, 0)], 0).astype(send_MD.dtype)
    return grouped_gemm_reference(recv, w_GDN, group_sizes), recv, group_sizes


def all_gather_grouped_gemm(send_MD, counts_SPG, w_GDN, *, axis, capacity: int, tiling: GemmTiling | None = None,
                            exchange: bool = True, num_sms: int | None = None, send_ctas: int = DEFAULT_SEND_CTAS,
                            source_rows: int | None = None, interpret: bool = False):
    """`all_gather_grouped_gemm_reference(...)` as one kernel, inside shard_map over a mesh that has `axis` (n
    ranks), one process driving all of its GPUs. send_MD [M, D] bf16/f16: this rank's routed rows sorted by
    (destination rank, its local expert); counts_SPG [n, n, G] int: rows of source s for local expert e of rank
    p, the same on every rank (all-gathered routing counts); w_GDN [G, D, N] this rank's experts. `capacity`
    rows of receive buffer (>= the most rows any rank can get; a multiple of 8). Returns (y_RN, recv_RD,
    group_sizes_G): the first expert GEMM of the received rows, the rows themselves (for the GEMMs that read
    them too), this rank's rows per local expert. Differentiable (`dispatch_backward`; `source_rows` bounds the
    rows one source routes to one rank, the all-to-all blocks of the backward: default all of send_MD's).
    `exchange=False`: the compute side alone, send_MD then being this rank's receive buffer [capacity, D]
    (returns y only; not differentiated; runs in the CPU interpreter)."""
    cfg = _validate(send_MD, counts_SPG, w_GDN, capacity, tiling, send_ctas)
    n = counts_SPG.shape[0]
    if not exchange:
        sms = num_sms or sm_count(interpret)
        if send_MD.shape[0] != capacity or not 0 <= send_ctas < sms:
            raise ValueError(f"exchange=False takes the receive buffer [capacity={capacity}, D] (got "
                             f"{send_MD.shape}) and 0 <= send_ctas < {sms} (got {send_ctas})")
        rank = lax.axis_index(axis) if axis is not None else 0
        _, table, num_valid, tile_src = receive_work(counts_SPG, rank, capacity, cfg.cta_m)
        body = functools.partial(_kernel, cfg=cfg, n=n, axis=axis, exchange=False, num_sms=sms, send_ctas=send_ctas)
        runs = jnp.zeros((4, n, w_GDN.shape[0]), jnp.int32)
        y = persistent_kernel(body, jax.ShapeDtypeStruct((capacity, w_GDN.shape[2]), send_MD.dtype), sms, interpret)(
            table, num_valid, tile_src, runs, send_MD, w_GDN)
        return vary_like(y, send_MD, w_GDN)
    check_exchange_runnable("all_gather_grouped_gemm", interpret=interpret, ranks=n, operand="counts_SPG", axis=axis)
    sms = num_sms or sm_count(False)
    if not 0 < send_ctas < sms:
        raise ValueError(f"send_ctas={send_ctas} must be between 1 and the SM count - 1 ({sms - 1})")
    source_rows = source_rows or -(-send_MD.shape[0] // ROW_ALIGN) * ROW_ALIGN
    return _exchanged(send_MD, counts_SPG, w_GDN, cfg, axis, capacity, sms, send_ctas, source_rows)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8))
def _exchanged(send_MD, counts_SPG, w_GDN, cfg, axis, capacity, num_sms, send_ctas, source_rows):
    n, rank = counts_SPG.shape[0], lax.axis_index(axis)
    group_sizes, table, num_valid, tile_src = receive_work(counts_SPG, rank, capacity, cfg.cta_m)
    runs = _runs_table(counts_SPG, rank, send_MD.shape[1], send_ctas)
    body = functools.partial(_kernel, cfg=cfg, n=n, axis=axis, exchange=True, num_sms=num_sms, send_ctas=send_ctas)
    # the receive buffer is an output: remote refs reach a kernel's own buffers only
    out_types = (jax.ShapeDtypeStruct((capacity, w_GDN.shape[2]), send_MD.dtype),
                 jax.ShapeDtypeStruct((capacity, send_MD.shape[1]), send_MD.dtype))
    y, recv = persistent_kernel(body, out_types, num_sms, False)(table, num_valid, tile_src, runs, send_MD, w_GDN)
    total = jnp.sum(group_sizes)   # the receive buffer's tail was never written: zeros, as the twin's
    recv = jnp.where(jnp.arange(capacity)[:, None] < total, recv, jnp.zeros((), recv.dtype))
    # typed as varying along the inputs' axes and `axis` (a Pallas call's outputs come back typed replicated)
    return tuple(vary_like(o, send_MD, w_GDN, axes=(axis,)) for o in (y, recv)) + (group_sizes,)


def _exchanged_fwd(send_MD, counts_SPG, w_GDN, cfg, axis, capacity, num_sms, send_ctas, source_rows):
    outs = _exchanged(send_MD, counts_SPG, w_GDN, cfg, axis, capacity, num_sms, send_ctas, source_rows)
    return outs, (send_MD, counts_SPG, w_GDN, outs[1], outs[2])


def _exchanged_bwd(cfg, axis, capacity, num_sms, send_ctas, source_rows, residuals, cotangents):
    send_MD, counts_SPG, w_GDN, recv_RD, group_sizes = residuals
    d_send, dw = dispatch_backward(send_MD, counts_SPG, w_GDN, recv_RD, group_sizes, *cotangents[:2], axis=axis,
                                   source_rows=source_rows)
    return match_varying(d_send, send_MD, *cotangents[:2]), None, match_varying(dw, w_GDN, recv_RD, cotangents[0])


def dispatch_backward(send_MD, counts_SPG, w_GDN, recv_RD, group_sizes_G, dy_RN, drecv_RD, *, axis, source_rows: int,
                      dgrad=None, wgrad=None):
    """The cotangents of (send_MD, w_GDN) from those of the kernel's outputs (y, recv): the input gradient of the
    GEMM plus recv's own, moved back to the send order (the exchange's transpose), and the weight gradient.
    `dgrad(dy, w, sizes)` / `wgrad(x, dy, sizes)`: the grouped GEMM kernel's (default) or its twins' (tests)."""
    dgrad = dgrad or functools.partial(grouped_gemm_dgrad, preferred_element_type=jnp.float32)
    wgrad = wgrad or functools.partial(grouped_gemm_wgrad, preferred_element_type=w_GDN.dtype)
    dy = dy_RN.astype(send_MD.dtype)
    d_recv = dgrad(dy, w_GDN, group_sizes_G).astype(jnp.float32) + drecv_RD.astype(jnp.float32)
    d_send = return_runs(d_recv.astype(send_MD.dtype), counts_SPG, axis=axis, capacity_per_source=source_rows,
                         rows=send_MD.shape[0])
    return d_send, wgrad(recv_RD, dy, group_sizes_G).astype(w_GDN.dtype)


_exchanged.defvjp(_exchanged_fwd, _exchanged_bwd)


def push_runs_locally(send_MD, counts_SPG, *, rank: int, capacity: int, send_ctas: int = 3, interpret: bool = False):
    """The sending side alone, for tests: rank `rank`'s pushes of step j land in out[j] (a local [capacity, D]
    buffer standing for rank rank + j's receive buffer) instead of that peer; rows no run writes are left as
    the buffer held them. One launch of send_ctas CTAs, no semaphores (so the CPU interpreter runs it)."""
    n, d = counts_SPG.shape[0], send_MD.shape[1]
    if d % 128:
        raise ValueError(f"push_runs_locally: D={d} must be a multiple of 128")
    runs = _runs_table(counts_SPG, rank, d, send_ctas)

    def body(runs_ref, send_gmem, out_gmem):
        _sender_scope(_push_runs)(send_gmem, runs_ref, n=n, rank=rank, cta=lax.axis_index("sm"), send_ctas=send_ctas,
                                  target=lambda j, dest: out_gmem.at[j], signal=None)

    return persistent_kernel(body, jax.ShapeDtypeStruct((n, capacity, d), send_MD.dtype), send_ctas, interpret)(
        runs, send_MD)
