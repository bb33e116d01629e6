"""The JAX side of bench_grouped_gemm.py: the grouped implementations of one shape, the dense GEMM of the same
FLOPs, tokamax and ragged_dot_mgpu, and how one case is timed (its variants in one set of rounds,
benchmarks/loop_timing.py) and checked (an fp32 product on sampled rows, an exactly zero tail)."""
import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.grouped_gemm_cases import REPEAT, UNWRITTEN_TAIL, wanted
from benchmarks.grouped_gemm_report import save_json
from benchmarks.grouped_gemm_sweeps import sweep_backward, sweep_tilings, tiling_label
from benchmarks.grouped_gemm_torch import torch_variants
from benchmarks.loop_timing import time_call, time_rounds
from pallas_kernels._default_tuning import PINGPONG_TILING
from pallas_kernels.grouped_gemm import GemmTiling, default_tuning, grouped_gemm


def hbm_copy_gbps(elems=1 << 30):
    """HBM bandwidth as one elementwise pass over a 2 GiB bf16 buffer measures it (read + write), GB/s: the
    rate the table's HBM floor is charged at (an XLA fusion's pace, not the data sheet's 4.8 TB/s)."""
    a = jnp.zeros((elems,), jnp.bfloat16)
    t, _ = time_call(jax.jit(lambda a: a + jnp.bfloat16(1)), a)
    return round(2 * a.nbytes / t / 1e9, 1)


class SampledCheck:
    """fp32 reference of y = ragged_dot(x, w, sizes) on the first and last 64 rows of up to 4 non-empty
    groups (spread over the groups), computed on the host once per case; rows past sum(sizes) must be 0."""

    def __init__(self, x, w, sizes):
        self.x, self.w, self.sizes, self.m = x, w, np.asarray(sizes, np.int64), x.shape[0]
        self._ref = None

    def _build(self):
        starts = np.concatenate([[0], np.cumsum(self.sizes)])
        nonempty = np.flatnonzero(self.sizes > 0)
        pick = nonempty[np.unique(np.linspace(0, len(nonempty) - 1, min(4, len(nonempty))).round().astype(int))] \
            if len(nonempty) else nonempty
        groups, rows = [], []
        for g in pick:
            s, e = int(starts[g]), int(min(starts[g + 1], self.m))
            r = np.unique(np.concatenate([np.arange(s, min(s + 64, e)), np.arange(max(e - 64, s), e)]))
            groups.append(g)
            rows.append(r)
        self.rows = np.concatenate(rows).astype(np.int32) if rows else np.zeros((0,), np.int32)
        xs = np.asarray(jnp.take(self.x, jnp.asarray(self.rows), axis=0)).astype(np.float32)
        ws = np.asarray(jnp.take(self.w, jnp.asarray(np.asarray(groups, np.int32)), axis=0)).astype(np.float32)
        pieces, at = [], 0
        for i, r in enumerate(rows):
            pieces.append(xs[at:at + len(r)] @ ws[i])
            at += len(r)
        self._ref = np.concatenate(pieces) if pieces else np.zeros((0, self.w.shape[2]), np.float32)

    def error(self, y, tail_written=True):
        """(relative Frobenius error on the sampled rows, whether the tail is exactly zero or None: None also
        when the implementation leaves the tail unwritten on purpose)."""
        if self._ref is None:
            self._build()
        ys = np.asarray(jnp.take(y, jnp.asarray(self.rows), axis=0)).astype(np.float32)
        err = float(np.linalg.norm(ys - self._ref) / max(np.linalg.norm(self._ref), 1e-30))
        total = int(min(self.sizes.sum(), self.m))
        tail_ok = None if total >= self.m or not tail_written else not bool(jnp.any(y[total:] != 0))
        return err, tail_ok


def fwd_bwd(f):
    """jit of (x, w, dy, *rest) -> (y, dx, dw) for y = f(x, w, *rest)."""
    def run(x, w, dy, *rest):
        y, vjp = jax.vjp(lambda x, w: f(x, w, *rest), x, w)
        return (y, *vjp(dy))
    return jax.jit(run)


def _matmul(a, b):
    return a @ b


DENSE_FWD, DENSE_FWD_BWD = jax.jit(_matmul), fwd_bwd(_matmul)
DENSE_CACHE = {}   # (rows, K, N) -> {label: TFLOP/s} and the case that measured it


def jax_impls(m, k, n, g, args):
    """Grouped implementations for one shape, as f(x, w, group_sizes): group sizes are an argument, so a
    shape compiles once for all its routings."""
    interp = args.interpret
    impls = {"ours": lambda x, w, gs: grouped_gemm(x, w, gs, interpret=interp),
             "xla_ragged_dot": lambda x, w, gs: jax.lax.ragged_dot(x, w, gs)}
    # the other owner of the zero tail (GroupedGemmTuning.zero_tail), same tiles
    mask_tuning = dataclasses.replace(default_tuning(m, k, n, g), zero_tail="mask")
    impls["ours_mask_tail"] = lambda x, w, gs: grouped_gemm(x, w, gs, interpret=interp, tuning=mask_tuning)
    # nobody writes the tail (zero_tail='none'): torch._grouped_mm's contract, for a consumer that masks it
    none_tuning = dataclasses.replace(default_tuning(m, k, n, g), zero_tail="none")
    impls[UNWRITTEN_TAIL] = lambda x, w, gs: grouped_gemm(x, w, gs, interpret=interp, tuning=none_tuning)
    # the work tables by cumsum + searchsorted (GroupedGemmTuning.tables, the default before "fused"), same kernel
    impls["ours_scan_tables"] = lambda x, w, gs: grouped_gemm(
        x, w, gs, interpret=interp, tuning=dataclasses.replace(default_tuning(m, k, n, g), tables="scan"))
    # row tiles on one grid over all rows (GroupedGemmTuning.row_tiles, the default before "group"), same tiles
    impls["ours_grid_tiles"] = lambda x, w, gs: grouped_gemm(
        x, w, gs, interpret=interp, tuning=dataclasses.replace(default_tuning(m, k, n, g), row_tiles="grid"))
    # the forward tiles before the shape rule for large experts (64-wide K steps, four deep), where they differ
    base = default_tuning(m, k, n, g)
    if base.fwd.tile_k != 64:
        k64 = dataclasses.replace(base, fwd=dataclasses.replace(base.fwd, tile_k=64, max_concurrent_steps=4))
        impls["ours_k64"] = lambda x, w, gs: grouped_gemm(x, w, gs, interpret=interp, tuning=k64)
    # the input-gradient tiles before its long-reduction rule (64-wide steps over N, four deep), where they differ
    if base.dgrad.tile_k != 64:
        dk64 = dataclasses.replace(base, dgrad=dataclasses.replace(base.dgrad, tile_k=64, max_concurrent_steps=4))
        impls["ours_dgrad_k64"] = lambda x, w, gs: grouped_gemm(x, w, gs, interpret=interp, tuning=dk64)
    # the cooperative schedule where the default takes the ping-pong one (short reductions), same run
    coop = default_tuning(m, k, n, g, pingpong=False)
    if coop != base:
        impls["ours_cooperative"] = functools.partial(_with_tuning, interpret=interp, tuning=coop)
    # the ping-pong schedule (GemmTiling.schedule): each compute warpgroup on its own tiles, forward and dgrad
    for label, tm, tn, tk, depth in PINGPONG_TILES:
        if n % tn == 0 and k % tn == 0 and k % tk == 0 and n % tk == 0:
            pp = GemmTiling(tile_m=tm, tile_n=tn, tile_k=tk, max_concurrent_steps=depth, schedule="pingpong")
            tun = dataclasses.replace(base, fwd=pp, dgrad=pp)
            impls[label] = functools.partial(_with_tuning, interpret=interp, tuning=tun)
    # the H200's default tiles where this device's differ (pallas_kernels/_default_tuning.py's wide-output
    # ping-pong rule): on an H100, DeepSeek-V3 EP8's ping-pong input gradient, timed beside the cooperative default
    h200 = default_tuning(m, k, n, g, device_kind="NVIDIA H200")
    if h200 != base:
        impls["ours_h200_tuning"] = functools.partial(_with_tuning, interpret=interp, tuning=h200)
    # the weight gradient's ping-pong schedule (128 x 128 tiles of dw per warpgroup) on the default tuning
    if k % PINGPONG_TILING.tile_m == 0 and n % PINGPONG_TILING.tile_n == 0:
        impls["ours_pingpong_wgrad"] = functools.partial(
            _with_tuning, interpret=interp, tuning=dataclasses.replace(base, wgrad=PINGPONG_TILING))
    # the cooperative weight gradient on jax's per-item pipelines (the default before its ring, chain_items)
    if base.wgrad.chain_items:
        unchained = dataclasses.replace(base, wgrad=dataclasses.replace(base.wgrad, chain_items=False))
        impls["ours_unchained_wgrad"] = functools.partial(_with_tuning, interpret=interp, tuning=unchained)
    return impls


# (label, tile_m, tile_n, tile_k, depth): each compute warpgroup's tile; depth is cut by fit_smem if needed
PINGPONG_TILES = (("ours_pingpong", 128, 128, 64, 6), ("ours_pingpong_k128", 128, 128, 128, 3),
                  ("ours_pingpong_64x256", 64, 256, 64, 4))


def _with_tuning(x, w, gs, interpret, tuning):
    return grouped_gemm(x, w, gs, interpret=interpret, tuning=tuning)


def mgpu_fwd(gs, m, n):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    # grid_block_n=4 was its best in the smoke run (Mixtral: 592 vs 547 at 2 and 452 at 1)
    configs = [dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=gbn)
               for gbn in (4, 2, 1) if n % (128 * gbn) == 0][:1]
    return {f"jax_ragged_dot_mgpu[{c['grid_block_n']}]": jax.jit(
        functools.partial(ragged_dot_mgpu.ragged_dot, group_sizes=gs, **c)) for c in configs}


def import_tokamax():
    import types
    for mod in ("xprof", "xprof.cli", "xprof.cli.tools"):  # tokamax imports these for its own tools
        sys.modules.setdefault(mod, types.ModuleType(mod))
    sys.modules["xprof.cli.tools"].get_kernel_stats_tool = None
    import tokamax
    return tokamax


def measure_tokamax(row, record, gs, x, w, dy, flops, with_bwd):
    """tokamax's Mosaic ragged_dot untuned, then autotuned as its README shows: `tokamax.autotune(f, *args)`
    once per shape, and the calls run inside `with result:` (a fresh function each time, so no trace made
    before tuning is reused). Autotuning seconds are recorded."""
    tokamax = import_tokamax()
    make = lambda: (lambda x, w: tokamax.ragged_dot(x, w, gs, implementation="mosaic"))  # noqa: E731
    record("tokamax_mosaic_untuned/fwd", jax.jit(make()), (x, w), flops)
    variants = [("fwd", lambda: jax.jit(make()), (x, w), flops)]
    if with_bwd:
        variants.append(("fwd+bwd", lambda: fwd_bwd(make()), (x, w, dy), 3 * flops))
    for label, build, argv, nflop in variants:
        t0 = time.perf_counter()
        tuned = tokamax.autotune(build(), *argv, progress_bar=False)
        row.setdefault("tokamax_autotune_s", {})[label] = round(time.perf_counter() - t0, 1)
        print(f"  tokamax autotune {label}: {time.perf_counter() - t0:.1f} s", flush=True)
        with tuned:
            record(f"tokamax_mosaic_autotuned/{label}", build(), argv, nflop)


def _tflops(flop_per_s):
    v = flop_per_s / 1e12
    return round(v, 1) if v >= 10 else float(f"{v:.3g}")   # 3 digits for CPU-smoke sizes


def add_repeat_control(rounds):
    """Appends ours/fwd once more, last in the order (first in the reversed rounds): the spread between the two
    readings of one compiled call is what the row's verdicts can be trusted to."""
    for label, fn, argv, nflop, _ in list(rounds):
        if label == "ours/fwd":
            rounds.append((f"{REPEAT}/fwd", fn, argv, nflop, ""))


def past_deadline(args):
    return args.deadline is not None and time.perf_counter() > args.deadline


def measure_case(case, x, w, dy, impls, args, results, torch_server=None):
    m, k, n, g, name, routing = case["M"], case["K"], case["N"], case["G"], case["shape"], case["routing"]
    gs_np = np.asarray(case["group_sizes"], np.int32)
    gs = jnp.asarray(gs_np)
    useful = case["useful_rows"]
    flops = 2.0 * useful * k * n   # useful FLOPs: rows routed to a group (for padded, not the tail)
    row = dict(case, useful_gflop_per_gemm=round(flops / 1e9, 3), tflops={}, ms={}, errors={})
    check = SampledCheck(x, w, gs_np)

    rounds = []   # (label, fn, argv, nflop, check message): the case's main variants, timed round by round

    def fill(label, t, nflop, msg):
        row["tflops"][label] = _tflops(nflop / t)
        row["ms"][label] = round(t * 1e3, 4)
        print(f"  {name:20s} {routing:10s} {label:34s} {nflop / t / 1e12:7.1f} TFLOP/s "
              f"({t * 1e3:.3f} ms){msg}", flush=True)

    def record(label, fn, argv, nflop, do_check=True, interleave=False):
        """Times `label` now, or (interleave) compiles and checks it now and times it in the rounds below."""
        if not wanted(label, args):
            return
        if past_deadline(args):
            row["errors"][label] = "skipped: --time-budget-s reached"
            return
        try:
            if interleave:
                out = fn(*argv)
                jax.block_until_ready(out)
            else:
                t, out = time_call(fn, *argv)
            msg = ""
            if do_check and label.endswith("/fwd"):
                err, tail_ok = check.error(out[0] if isinstance(out, tuple) else out,
                                           tail_written=not label.startswith(UNWRITTEN_TAIL + "/"))
                row["errors"][label] = err
                msg = f"  rel err {err:.1e}"
                if tail_ok is not None:
                    row.setdefault("tail_zero", {})[label] = tail_ok
                    msg += "  tail zero" if tail_ok else "  TAIL NOT ZERO"
            if interleave:
                rounds.append((label, fn, argv, nflop, msg))
                return
            fill(label, t, nflop, msg)
            save_json(args, results + [row])  # a timeout keeps every finished number
        except Exception as e:  # noqa: BLE001  (one failing baseline must not stop the run)
            row["tflops"][label] = None
            row["errors"][label] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"  {name} {routing} {label} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)

    for label, fn in impls["fwd"].items():
        record(f"{label}/fwd", fn, (x, w, gs), flops, interleave=True)
    if any(wanted(f"jax_ragged_dot_mgpu[{i}]/fwd", args) for i in (1, 2, 4)):
        for label, fn in mgpu_fwd(gs, m, n).items():
            record(f"{label}/fwd", fn, (x, w), flops, interleave=True)
    for label, fn in impls["bwd"].items():
        record(f"{label}/fwd+bwd", fn, (x, w, dy, gs), 3 * flops, interleave=True)
    dense_key = measure_dense(row, case, x, w, dy, flops, record, args)
    if torch_server is not None and not past_deadline(args):   # torch._grouped_mm in the same rounds
        for label, loop, mult in torch_variants(torch_server, case, dense_key is not None, row):
            rounds.append((label, loop, None, mult * flops, ""))
    main_variants = len(rounds)
    sweeping = args.sweep and (name.startswith("goal") or args.suite) and not past_deadline(args)
    if sweeping:
        base = default_tuning(m, k, n, g)
        for cfg in sweep_tilings(n, k):   # forward tilings, in the same rounds
            tuning = dataclasses.replace(base, fwd=cfg)
            f = jax.jit(lambda x, w, gs, t=tuning: grouped_gemm(x, w, gs, tuning=t, interpret=args.interpret))
            record(f"ours[{tiling_label(cfg)}]/fwd", f, (x, w, gs), flops, interleave=True)
    if rounds and past_deadline(args):   # compiled and checked, but the budget is spent: no new timing; if it
        kept = main_variants if sweeping else 0   # ran out in the sweep, of the sweep only
        for label, *_ in rounds[kept:]:
            row["errors"][label] = "skipped: --time-budget-s reached"
        del rounds[kept:]
    if rounds:
        add_repeat_control(rounds)
        try:
            failed, per_loop, row["loop_iters"] = {}, {}, {}
            seconds = time_rounds([(label, fn, argv) for label, fn, argv, _, _ in rounds], errors=failed,
                                  per_loop=per_loop, loop_iters=row["loop_iters"])
            row["loop_ms"] = {label: [round(t * 1e3, 4) for t in v] for label, v in per_loop.items()}
            for label, _, _, nflop, msg in rounds:
                if label in seconds:
                    fill(label, seconds[label], nflop, msg)
                else:
                    row["tflops"][label] = None
                    row["errors"][label] = f"rounds: {failed[label]}"
                    print(f"  {name} {routing} {label} FAILED in the rounds: {failed[label]}", flush=True)
        except Exception as e:  # noqa: BLE001
            for label, *_ in rounds:
                row["tflops"][label] = None
                row["errors"][label] = f"rounds: {type(e).__name__}: {str(e)[:300]}"
            print(f"  {name} {routing} timing rounds FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        save_json(args, results + [row])
    cache_dense(row, case, dense_key)
    if args.sweep and (name.startswith("goal") or args.suite):
        sweep_backward(row, x, w, dy, gs, default_tuning(m, k, n, g), flops, record, args)
    if args.tokamax:
        try:
            measure_tokamax(row, record, gs, x, w, dy, flops, args.bwd)
        except Exception as e:  # noqa: BLE001
            row["errors"]["tokamax"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"  tokamax FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    results.append(row)


def measure_dense(row, case, x, w, dy, flops, record, args):
    """x[:useful rows] @ w[0]: one GEMM of the same (useful) FLOPs, in the case's timing rounds; timed once per
    (rows, K, N) (`cache_dense` keeps it for the other cases). Returns the key when it was timed here."""
    useful, k, n = case["useful_rows"], case["K"], case["N"]
    key = (useful, k, n)
    if useful == 0:
        return None
    if key in DENSE_CACHE:
        for label, v in DENSE_CACHE[key]["tflops"].items():
            row["tflops"][label] = v
            row["ms"][label] = DENSE_CACHE[key]["ms"].get(label)
        row["dense_measured_in"] = DENSE_CACHE[key]["case"]
        return None
    xd, w0, dyd = x[:useful], w[0], dy[:useful]
    record("dense_same_flops/fwd", DENSE_FWD, (xd, w0), flops, do_check=False, interleave=True)
    if args.bwd:
        record("dense_same_flops/fwd+bwd", DENSE_FWD_BWD, (xd, w0, dyd), 3 * flops, interleave=True)
    return key


def cache_dense(row, case, key):
    if key is None:
        return
    done = {lb: v for lb, v in row["tflops"].items()   # ours's process and the torch server's
            if lb.startswith(("dense_same_flops/", "torch_dense_same_flops/")) and v is not None}
    if done:
        DENSE_CACHE[key] = dict(tflops=done, ms={lb: row["ms"].get(lb) for lb in done},
                                case=f"{case['shape']}/{case['routing']}")
