"""Grouped GEMM on one H200: our Pallas Mosaic GPU kernel next to lax.ragged_dot, jax's ragged_dot_mgpu,
tokamax's ragged_dot, torch._grouped_mm (a torch subprocess) and the dense GEMM of the same FLOPs.

    python3 benchmarks/bench_grouped_gemm.py --mode smoke --out /tmp/smoke.json   # goal shapes, few impls
    python3 benchmarks/bench_grouped_gemm.py --mode full  --out results.json      # all shapes and impls
    python3 benchmarks/bench_grouped_gemm.py --suite issue10 --torch --torch-timeout-s 150 --time-budget-s 330 \
        --out $OUT/grouped_gemm_table.json                                          # issue 10's table
    python3 benchmarks/bench_grouped_gemm.py --suite issue10 --list                # its cases, no GPU
    python3 benchmarks/bench_grouped_gemm.py --suite tiny --interpret --out /tmp/t.json  # CPU smoke

Shapes (--mode): the two goal shapes of issue 4 (Mixtral-like M=32768 K=4096 N=14336 G=8; fine-grained
M=8192 K=4096 N=1408 G=16) and the up-projection of each of the paper's six models at EP=8 with
8192 tokens per GPU before dispatch: M = 8192 * top_k rows, G = experts / 8 local experts.
--suite issue10: the table of issue 10 (Mixtral 8x7B / 8x22B, DeepSeekMoE-16B, Qwen3-30B-A3B, DeepSeek-V3
at EP = 1 and 8, see ISSUE10_ROWS), ours (default tuning) vs torch._grouped_mm vs the dense GEMM of the same
FLOPs, with the ratios and the issue's verdict per row, also written as a markdown table next to the JSON.
Routing: uniform; skewed (one expert takes 40% of the rows, the rest split evenly); half_empty (every other
group has no rows, the rest split evenly); padded (half the rows routed uniformly, the other half a zero
tail, as in an expert-parallel dropless receive buffer at n = 2; `ours` and `ours_mask_tail` differ in
who writes that tail, see GroupedGemmTuning.zero_tail).
TFLOP/s counts useful FLOPs only: 2 * sum(group_sizes) * K * N per GEMM (for padded the real rows, not the
tail), 3 GEMMs for forward+backward, for every implementation (torch included). The dense baseline is
x[:sum(group_sizes)] @ w[0], i.e. the same FLOPs in one GEMM, its weight a [K, N] array of its own.
Group sizes are a runtime argument of the jitted functions, as in training (one compile per shape, not
per routing). Timing: a loop of calls between two host syncs (no sync per call), median of several loops,
after a warm-up call that compiles. Correctness: the forward of every grouped implementation is checked
against an fp32 product on sampled rows (the first and last rows of up to 4 non-empty groups) and the
rows past sum(group_sizes) must be exact zeros.
torch runs first, in a subprocess, before JAX takes the GPU (JAX preallocates most of its memory).
"""
import argparse
import collections
import dataclasses
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pallas_kernels.grouped_gemm import GemmTiling, default_tuning, grouped_gemm  # noqa: E402

GOAL_SHAPES = {"goal_mixtral": (32768, 4096, 14336, 8), "goal_fine_grained": (8192, 4096, 1408, 16)}
# (hidden, ffn, experts, top_k) as published; M = 8192 * top_k, G = experts // 8
MODELS = {"internal_352b": (4096, 14336, 32, 3), "mixtral_8x7b": (4096, 14336, 8, 2),
          "mixtral_8x22b": (6144, 16384, 8, 2), "phi_3_5_moe": (4096, 6400, 16, 2),
          "deepseekmoe_16b": (2048, 1408, 64, 6), "hunyuan_large": (6400, 18304, 16, 1)}
ROUTINGS = ("uniform", "skewed", "half_empty", "padded")

# ---------------------------------------------------------------------------------------------------
# Issue 10's table. Expert up-projection per device: x [M, K=hidden] @ w [G, K, N=expert FFN].
#   rows per device  M = tokens_per_device * top_k   (the EP all-to-all exchanges the routed copies of
#                        the tokens between devices and conserves their number, so at uniform routing
#                        every device receives T * top_k rows on average, for any EP)
#   local experts    G = experts / EP
# with T = 8192 tokens per device unless a row says otherwise.
# ---------------------------------------------------------------------------------------------------
TOKENS_PER_DEVICE = 8192
ISSUE10_MODELS = {  # (hidden K, expert FFN N, routed experts E, top_k)
    "mixtral_8x7b": (4096, 14336, 8, 2),
    "mixtral_8x22b": (6144, 16384, 8, 2),
    "deepseekmoe_16b": (2048, 1408, 64, 6),
    "qwen3_30b_a3b": (2048, 768, 128, 8),      # "Qwen3-30B-A3B-like" as the issue gives it
    "deepseek_v3": (7168, 2048, 256, 8),       # routed experts only (the shared expert is a dense GEMM)
}
# (model, EP, routings, tokens per device), in the order run. Every row gets uniform; skewed / half_empty /
# padded go to the three rows the issue's cases matter most for (Mixtral EP1, Qwen3 EP1, DeepSeek-V3 EP8),
# padded also to the other EP8 rows (the dropless receive buffer exists only with EP > 1) since its dense
# baseline is shared with the EP1 row. The last two rows go beyond the issue's minimum (EP8 for every
# model); --time-budget-s cuts them first.
ISSUE10_ROWS = [
    ("mixtral_8x7b", 1, ROUTINGS, TOKENS_PER_DEVICE),
    ("mixtral_8x7b", 8, ("uniform", "padded"), TOKENS_PER_DEVICE),
    ("mixtral_8x22b", 1, ("uniform",), TOKENS_PER_DEVICE),
    ("deepseekmoe_16b", 1, ("uniform",), TOKENS_PER_DEVICE),
    ("qwen3_30b_a3b", 1, ROUTINGS, TOKENS_PER_DEVICE),
    ("qwen3_30b_a3b", 8, ("uniform", "padded"), TOKENS_PER_DEVICE),
    ("deepseek_v3", 8, ROUTINGS, TOKENS_PER_DEVICE),
    ("mixtral_8x22b", 8, ("uniform",), TOKENS_PER_DEVICE),
    ("deepseekmoe_16b", 8, ("uniform",), TOKENS_PER_DEVICE),
]
# Estimated run time of `--suite issue10 --torch` on one H200 (compile costs guessed, not measured; the
# timed loops are ~0.15 s x 3 per timing): 20 cases over 9 shapes; 40 timings of ours (fwd, fwd+bwd) + 16 of
# the dense GEMM (timed once per distinct (rows, K, N): 8 of them) + 40 of torch.
#   JAX start ~10 s; torch subprocess (import, CUDA start, 20 cases x 2 x 53 calls) ~40 s;
#   compiles: ours 9 shapes x (fwd ~2 s + fwd+bwd ~4 s) + dense 8 x (~1 + ~2 s) ~80 s;
#   timed loops 56 x ~0.6 s ~35 s; data + sampled checks 9 shapes x ~2 s + 20 cases x ~0.5 s ~30 s.
#   Total ~3-3.5 min (`--list` prints the same rough model), inside 6; --time-budget-s 330 starts no new
#   timing after 330 s, so the JSON and the table are written even if compiles are much slower than guessed.
SUITES = {"issue10": dict(impls=("ours", "ours_k64", "dense_same_flops")), "tiny": dict(impls=("ours", "dense_same_flops"))}
# CPU smoke of the whole pipeline (interpret mode): tiny shapes, every routing, tile-aligned K and N
TINY_ROWS = {"tiny_g4": (512, 128, 256, 4), "tiny_g1": (256, 128, 256, 1)}


def model_shapes():
    return {name: (8192 * k, h, f, max(e // 8, 1)) for name, (h, f, e, k) in MODELS.items()}


def group_sizes_for(m, g, routing):
    """Rows per group (numpy int32, sorted-by-group layout) for M rows over G groups."""
    if routing == "padded":  # an expert-parallel dropless receive buffer at n = 2: half the rows are the tail
        sizes = np.full(g, (m // 2) // g)
        sizes[-1] += m // 2 - sizes.sum()
        return sizes.astype(np.int32)
    if routing == "half_empty" and g > 1:  # groups 1, 3, 5, ... get nothing, the others split M evenly
        full = np.arange(g) % 2 == 0
        sizes = np.where(full, m // int(full.sum()), 0)
        sizes[np.flatnonzero(full)[-1]] += m - sizes.sum()
        return sizes.astype(np.int32)
    if routing == "uniform" or g == 1:
        sizes = np.full(g, m // g)
    elif routing == "skewed":
        big = int(0.4 * m)
        sizes = np.full(g, (m - big) // (g - 1))
        sizes[0] = big
    else:
        raise ValueError(f"unknown routing {routing!r}; choose from {ROUTINGS}")
    sizes[-1] += m - sizes.sum()
    return sizes.astype(np.int32)


def routing_applies(routing, g):
    return g > 1 or routing in ("uniform", "padded")   # skewed / half_empty need two groups


def make_case(shape, m, k, n, g, routing, **extra):
    sizes = group_sizes_for(m, g, routing)
    return dict(shape=shape, routing=routing, **extra, M=m, K=k, N=n, G=g, group_sizes=sizes.tolist(),
                useful_rows=int(min(int(sizes.sum()), m)))


def build_cases(args):
    """The list of (shape, routing) cases, in the order run; no device needed."""
    routings_arg = args.routings.split(",") if args.routings else None
    for r in routings_arg or ():
        if r not in ROUTINGS:
            raise SystemExit(f"--routings: unknown routing {r!r}; choose from {ROUTINGS}")
    cases = []
    if args.suite == "issue10":
        for model, ep, routings, tokens in ISSUE10_ROWS:
            k, n, e, top_k = ISSUE10_MODELS[model]
            m, g = tokens * top_k, e // ep
            for routing in routings_arg or routings:
                if routing_applies(routing, g):
                    cases.append(make_case(f"{model}_ep{ep}", m, k, n, g, routing, model=model, ep=ep,
                                           tokens_per_device=tokens, top_k=top_k, experts=e))
    else:
        if args.suite == "tiny":
            shapes, default_routings = dict(TINY_ROWS), list(ROUTINGS)
        elif args.mode == "smoke":
            shapes, default_routings = dict(GOAL_SHAPES), ["uniform"]
        else:
            shapes, default_routings = {**GOAL_SHAPES, **model_shapes()}, ["uniform", "skewed"]
        for name, (m, k, n, g) in shapes.items():
            for routing in routings_arg or default_routings:
                if routing_applies(routing, g):
                    cases.append(make_case(name, m, k, n, g, routing))
    if args.only:  # in the order given (a run cut by a time limit then has the first ones)
        names = args.only.split(",")
        known = list(dict.fromkeys(c["shape"] for c in cases))
        unknown = [s for s in names if s not in known]
        if unknown:
            raise SystemExit(f"--only: unknown shapes {unknown}; choose from {known} (--mode full or --suite "
                             "for others)")
        cases = [c for s in names for c in cases if c["shape"] == s]
    return cases


def rle(sizes):
    """[4096, 4096, 0, 5] -> '2x4096,0,5'; [1024, 0, 1024, 0] -> '2x(1024,0)'."""
    if len(sizes) >= 4 and len(sizes) % 2 == 0 and len(set(sizes[0::2])) == 1 and len(set(sizes[1::2])) == 1 \
            and sizes[0] != sizes[1]:
        return f"{len(sizes) // 2}x({sizes[0]},{sizes[1]})"
    out = []
    for v in sizes:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return ",".join(f"{c}x{v}" if c > 1 else str(v) for v, c in out)


# ---------------------------------------------------------------------------------------------------
# Timing and checks
# ---------------------------------------------------------------------------------------------------
TIMING = dict(min_total_s=0.15, loops=3, min_iters=2)


def time_call(fn, *args, min_total_s=None, loops=None, min_iters=None):
    min_total_s = TIMING["min_total_s"] if min_total_s is None else min_total_s
    loops = TIMING["loops"] if loops is None else loops
    min_iters = TIMING["min_iters"] if min_iters is None else min_iters
    out = fn(*args)
    jax.block_until_ready(out)  # compile and warm up
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    iters = max(min_iters, min(50, int(min_total_s / max(time.perf_counter() - t0, 1e-5))))
    times = []
    for _ in range(loops):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times), out


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

    def error(self, y):
        """(relative Frobenius error on the sampled rows, whether the tail is exactly zero or None)."""
        if self._ref is None:
            self._build()
        ys = np.asarray(jnp.take(y, jnp.asarray(self.rows), axis=0)).astype(np.float32)
        err = float(np.linalg.norm(ys - self._ref) / max(np.linalg.norm(self._ref), 1e-30))
        total = int(min(self.sizes.sum(), self.m))
        tail_ok = None if total >= self.m else not bool(jnp.any(y[total:] != 0))
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
    # the forward tiles before the shape rule for large experts (64-wide K steps, four deep), where they differ
    base = default_tuning(m, k, n, g)
    if base.fwd.tile_k != 64:
        k64 = dataclasses.replace(base, fwd=dataclasses.replace(base.fwd, tile_k=64, max_concurrent_steps=4))
        impls["ours_k64"] = lambda x, w, gs: grouped_gemm(x, w, gs, interpret=interp, tuning=k64)
    # candidate input-gradient tiles (timed in fwd+bwd): chained pipelines, and 128-wide steps over a long N
    dgrad = dataclasses.replace(base.dgrad, chain_items=True)
    if n >= 4096 and k >= 2048 and n % 128 == 0 and dgrad.wg_split == "n":
        dgrad = dataclasses.replace(dgrad, tile_k=128, max_concurrent_steps=2)
    fast_dgrad = dataclasses.replace(base, dgrad=dgrad)
    impls["ours_dgrad_chain"] = lambda x, w, gs: grouped_gemm(x, w, gs, interpret=interp, tuning=fast_dgrad)
    return impls


def mgpu_fwd(gs, m, n):
    import functools
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


def wanted(label, args):
    """Whether to time an implementation label ('ours/fwd', 'jax_ragged_dot_mgpu[4]/fwd', ...)."""
    if args.impl_filter:
        return any(s in label for s in args.impl_filter)
    base = label.split("/")[0].split("[")[0]
    if args.suite:
        return base in SUITES[args.suite]["impls"]
    return not (base == "xla_ragged_dot" and args.mode == "smoke")


def _tflops(flop_per_s):
    v = flop_per_s / 1e12
    return round(v, 1) if v >= 10 else float(f"{v:.3g}")   # 3 digits for CPU-smoke sizes


def past_deadline(args):
    return args.deadline is not None and time.perf_counter() > args.deadline


def measure_case(case, x, w, dy, impls, args, results, torch_res):
    m, k, n, g, name, routing = case["M"], case["K"], case["N"], case["G"], case["shape"], case["routing"]
    gs_np = np.asarray(case["group_sizes"], np.int32)
    gs = jnp.asarray(gs_np)
    useful = case["useful_rows"]
    flops = 2.0 * useful * k * n   # useful FLOPs: rows routed to a group (for padded, not the tail)
    row = dict(case, useful_gflop_per_gemm=round(flops / 1e9, 3), tflops={}, ms={}, errors={})
    merge_torch(row, torch_res)
    check = SampledCheck(x, w, gs_np)

    def record(label, fn, argv, nflop, do_check=True):
        if not wanted(label, args):
            return
        if past_deadline(args):
            row["errors"][label] = "skipped: --time-budget-s reached"
            return
        try:
            t, out = time_call(fn, *argv)
            row["tflops"][label] = _tflops(nflop / t)
            row["ms"][label] = round(t * 1e3, 4)
            msg = ""
            if do_check and label.endswith("/fwd"):
                err, tail_ok = check.error(out[0] if isinstance(out, tuple) else out)
                row["errors"][label] = err
                msg = f"  rel err {err:.1e}"
                if tail_ok is not None:
                    row.setdefault("tail_zero", {})[label] = tail_ok
                    msg += "  tail zero" if tail_ok else "  TAIL NOT ZERO"
            print(f"  {name:20s} {routing:10s} {label:34s} {nflop / t / 1e12:7.1f} TFLOP/s "
                  f"({t * 1e3:.3f} ms){msg}", flush=True)
            save_json(args, results + [row])  # a timeout keeps every finished number
        except Exception as e:  # noqa: BLE001  (one failing baseline must not stop the run)
            row["tflops"][label] = None
            row["errors"][label] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"  {name} {routing} {label} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)

    for label, fn in impls["fwd"].items():
        record(f"{label}/fwd", fn, (x, w, gs), flops)
    if any(wanted(f"jax_ragged_dot_mgpu[{i}]/fwd", args) for i in (1, 2, 4)):
        for label, fn in mgpu_fwd(gs, m, n).items():
            record(f"{label}/fwd", fn, (x, w), flops)
    for label, fn in impls["bwd"].items():
        record(f"{label}/fwd+bwd", fn, (x, w, dy, gs), 3 * flops)
    measure_dense(row, case, x, w, dy, flops, record, args)
    if args.sweep and (name.startswith("goal") or args.suite) and routing in ("uniform", "half_empty"):
        for cfg in sweep_tilings(n, k):
            tuning = dataclasses.replace(default_tuning(m, k, n, g), fwd=cfg)
            f = jax.jit(lambda x, w, gs, t=tuning: grouped_gemm(x, w, gs, tuning=t, interpret=args.interpret))
            record(f"ours[{tiling_label(cfg)}]/fwd", f, (x, w, gs), flops)
    if args.tokamax:
        try:
            measure_tokamax(row, record, gs, x, w, dy, flops, args.bwd)
        except Exception as e:  # noqa: BLE001
            row["errors"]["tokamax"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"  tokamax FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    results.append(row)


def measure_dense(row, case, x, w, dy, flops, record, args):
    """x[:useful rows] @ w[0]: one GEMM of the same (useful) FLOPs; timed once per (rows, K, N)."""
    useful, k, n = case["useful_rows"], case["K"], case["N"]
    key = (useful, k, n)
    if useful == 0:
        return
    if key in DENSE_CACHE:
        for label, v in DENSE_CACHE[key]["tflops"].items():
            row["tflops"][label] = v
            row["ms"][label] = DENSE_CACHE[key]["ms"].get(label)
        row["dense_measured_in"] = DENSE_CACHE[key]["case"]
        return
    xd, w0, dyd = x[:useful], w[0], dy[:useful]
    record("dense_same_flops/fwd", DENSE_FWD, (xd, w0), flops, do_check=False)
    if args.bwd:
        record("dense_same_flops/fwd+bwd", DENSE_FWD_BWD, (xd, w0, dyd), 3 * flops)
    done = {lb: v for lb, v in row["tflops"].items() if lb.startswith("dense_same_flops/") and v is not None}
    if done:
        DENSE_CACHE[key] = dict(tflops=done, ms={lb: row["ms"].get(lb) for lb in done},
                                case=f"{case['shape']}/{case['routing']}")


def tiling_label(cfg):
    return (f"{cfg.wg_split}{cfg.tile_m}x{cfg.tile_n}k{cfg.tile_k}s{cfg.max_concurrent_steps}"
            f"m{cfg.grid_minor}w{cfg.grid_tile_width}e{cfg.epi_tile_n}x{cfg.epi_slots}"
            f"{'c' if cfg.chain_items else ''}")


def sweep_tilings(n, k):
    """Forward tilings to time against the default: warpgroup split, tile sizes, K step, pipeline depth,
    work order, epilogue staging (chunk width and slots), chained pipelines across work items. Only those
    that tile N and K exactly."""
    variants = [dict(), dict(epi_slots=2), dict(chain_items=True), dict(chain_items=True, epi_slots=2),
                dict(chain_items=True, grid_tile_width=16), dict(chain_items=True, wg_split="m"),
                dict(chain_items=True, tile_k=128, max_concurrent_steps=2),
                dict(tile_k=128, max_concurrent_steps=2), dict(wg_split="m"), dict(wg_split="m", epi_slots=2),
                dict(grid_minor=1), dict(tile_n=64, max_concurrent_steps=6, epi_slots=2)]
    out = []
    for v in variants:
        cfg = GemmTiling(**v)
        if n % cfg.cta_n == 0 and k % cfg.tile_k == 0:
            out.append(cfg)
    return out


# ---------------------------------------------------------------------------------------------------
# torch._grouped_mm, in a subprocess (torch is not imported into the JAX process)
# ---------------------------------------------------------------------------------------------------
TORCH_SCRIPT = r"""
import json, sys, torch
cases = json.loads(sys.argv[1])
print("TORCHENV" + json.dumps(dict(torch=torch.__version__, torch_cuda=torch.version.cuda,
                                   torch_device=torch.cuda.get_device_name())), flush=True)

def seconds(fn):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10): fn()
        b.record(); torch.cuda.synchronize(); times.append(a.elapsed_time(b) / 10 / 1e3)
    return sorted(times)[2]

data = {}
for c in cases:
    m, k, n, g, sizes = c["M"], c["K"], c["N"], c["G"], c["group_sizes"]
    res, err = {}, None
    try:
        if (m, k, n, g) not in data:   # one set of operands per shape, reused by its routings
            data.clear(); torch.cuda.empty_cache(); torch.manual_seed(0)
            data[(m, k, n, g)] = (
                torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True),
                torch.randn(g, k, n, device="cuda", dtype=torch.bfloat16, requires_grad=True),
                torch.randn(m, n, device="cuda", dtype=torch.bfloat16))
        x, w, dy = data[(m, k, n, g)]
        offs = torch.cumsum(torch.tensor(sizes, device="cuda", dtype=torch.int32), 0, dtype=torch.int32)
        def fwd(): return torch._grouped_mm(x, w, offs=offs)
        def fb():   # autograd.grad: dx and dw as outputs, no accumulation into .grad (no extra add kernels)
            y = torch._grouped_mm(x, w, offs=offs); return torch.autograd.grad(y, (x, w), dy)
        useful = min(sum(sizes), m)   # useful FLOPs only, as on the JAX side
        for label, fn, mult in (("fwd", fwd, 1), ("fwd+bwd", fb, 3)):
            v = mult * 2 * useful * k * n / seconds(fn) / 1e12
            res[label] = round(v, 1) if v >= 10 else float(f"{v:.3g}")
    except Exception as e:
        err = f"{type(e).__name__}: {str(e)[:300]}"
    print("JSONROW" + json.dumps(dict(shape=c["shape"], routing=c["routing"], tflops=res, error=err)), flush=True)
"""


def run_torch(cases, timeout_s):
    """{(shape, routing): {'tflops': {...}, 'error': ...}} plus the torch environment; never raises."""
    spec = [{k: c[k] for k in ("shape", "routing", "M", "K", "N", "G", "group_sizes")} for c in cases]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", TORCH_SCRIPT, json.dumps(spec)], capture_output=True,
                              text=True, timeout=timeout_s)
        stdout, stderr, note = proc.stdout, proc.stderr, f"rc {proc.returncode}"
    except subprocess.TimeoutExpired as e:   # keep the cases it finished
        dec = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
        stdout, stderr, note = dec(e.stdout), dec(e.stderr), f"timed out after {timeout_s} s"
    print(f"torch subprocess: {note}, {time.perf_counter() - t0:.1f} s", flush=True)
    if stderr.strip():
        print(stderr[-2000:], flush=True)
    out, env = {}, {}
    for ln in stdout.splitlines():
        if ln.startswith("TORCHENV"):
            env = json.loads(ln[len("TORCHENV"):])
        elif ln.startswith("JSONROW"):
            r = json.loads(ln[len("JSONROW"):])
            out[(r["shape"], r["routing"])] = r
            print(f"  torch {r['shape']:20s} {r['routing']:10s} {r['tflops']} {r['error'] or ''}", flush=True)
    missing = sum((c["shape"], c["routing"]) not in out for c in cases)
    if missing:
        err = f"torch subprocess {note}: {stderr.strip().splitlines()[-1][:300] if stderr.strip() else ''}"
        for c in cases:
            out.setdefault((c["shape"], c["routing"]), dict(tflops={}, error=err))
    env["torch_subprocess_s"] = round(time.perf_counter() - t0, 1)
    return out, env


def merge_torch(row, torch_res):
    r = torch_res.get((row["shape"], row["routing"]))
    if r is None:
        return
    for label, v in r["tflops"].items():
        row["tflops"][f"torch_grouped_mm/{label}"] = v
    if r.get("error"):
        row["errors"]["torch_grouped_mm"] = r["error"]


# ---------------------------------------------------------------------------------------------------
# Ratios, the issue's verdict, output
# ---------------------------------------------------------------------------------------------------
def _ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def finalize_row(row):
    t = row["tflops"]
    ours = {kd: t.get(f"ours/{kd}") for kd in ("fwd", "fwd+bwd")}
    row["ratios"] = {f"ours/{base}/{kd}": _ratio(ours[kd], t.get(f"{base}/{kd}"))
                     for base in ("torch_grouped_mm", "dense_same_flops") for kd in ("fwd", "fwd+bwd")}
    r = row["ratios"]
    vs_torch = [r[f"ours/torch_grouped_mm/{kd}"] for kd in ("fwd", "fwd+bwd")]
    vs_dense = r["ours/dense_same_flops/fwd"]
    row["verdict"] = {"ours>=torch_grouped_mm": None if None in vs_torch else all(v >= 1.0 for v in vs_torch),
                      "ours>=0.9x_dense_fwd": None if vs_dense is None else vs_dense >= 0.9}
    return row


def summary(results):
    def collect(key):
        vals = [(f"{r['shape']}/{r['routing']}", r["verdict"][key]) for r in results]
        return dict(all_rows_pass=bool(vals) and all(v is True for _, v in vals),
                    failing=[s for s, v in vals if v is False], missing=[s for s, v in vals if v is None])
    return {"rows": len(results), "ours>=torch_grouped_mm": collect("ours>=torch_grouped_mm"),
            "ours>=0.9x_dense_fwd": collect("ours>=0.9x_dense_fwd")}


def save_json(args, results):
    results = [finalize_row(r) for r in results]
    env = dict(args.environment, elapsed_s=round(time.perf_counter() - args.t_start, 1))
    with open(args.out, "w") as f:
        json.dump(dict(environment=env, suite=args.suite, mode=None if args.suite else args.mode,
                       tokens_per_device=TOKENS_PER_DEVICE if args.suite == "issue10" else None,
                       flops_note="useful FLOPs: 2*sum(group_sizes)*K*N per GEMM, 3 GEMMs for fwd+bwd",
                       summary=summary(results), results=results), f, indent=1)


def _fmt(v, ratio=False):
    if v is None:
        return "-"
    return f"{v:.2f}" if ratio else f"{v:.0f}" if v >= 10 else f"{v:.3g}"


def _ok(v):
    return {True: "yes", False: "NO", None: "-"}[v]


def markdown_table(results, env):
    head = ("| shape | routing | M | K | N | G | useful rows | fwd ours | fwd torch | fwd dense | ours/torch "
            "| ours/dense | f+b ours | f+b torch | f+b dense | ours/torch | ours/dense | >= torch | >= 0.9 dense fwd |")
    lines = [f"Grouped GEMM, bf16, TFLOP/s of useful FLOPs ({env.get('device')}, jax {env.get('jax')}, "
             f"torch {env.get('torch')}); ours = Pallas Mosaic GPU kernel, default tuning; torch = "
             "torch._grouped_mm; dense = one GEMM of the same FLOPs", "", head,
             "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        t, q, v = r["tflops"], r["ratios"], r["verdict"]
        cells = [r["shape"], r["routing"], r["M"], r["K"], r["N"], r["G"], r["useful_rows"]]
        for kd in ("fwd", "fwd+bwd"):
            cells += [_fmt(t.get(f"ours/{kd}")), _fmt(t.get(f"torch_grouped_mm/{kd}")),
                      _fmt(t.get(f"dense_same_flops/{kd}")), _fmt(q[f"ours/torch_grouped_mm/{kd}"], True),
                      _fmt(q[f"ours/dense_same_flops/{kd}"], True)]
        cells += [_ok(v["ours>=torch_grouped_mm"]), _ok(v["ours>=0.9x_dense_fwd"])]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    s = summary(results)
    for key in ("ours>=torch_grouped_mm", "ours>=0.9x_dense_fwd"):
        verdict = ("PASS on every row" if s[key]["all_rows_pass"] else "FAIL" if s[key]["failing"]
                   else "INCOMPLETE (no failing row, some numbers missing)")
        lines.append(f"\n{key}: {verdict}; failing {s[key]['failing'] or 'none'}; "
                     f"missing {s[key]['missing'] or 'none'}")
    return "\n".join(lines)


def environment(torch_env):
    import jaxlib
    dev = jax.devices()[0]
    info = dict(device=dev.device_kind, platform=dev.platform, num_sms=getattr(dev, "core_count", None),
                jax=jax.__version__, jaxlib=jaxlib.__version__, python=sys.version.split()[0],
                date=time.strftime("%Y-%m-%d %H:%M:%S"))
    for dist in importlib.metadata.distributions():   # the jax CUDA plugin, without importing it
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith("jax-cuda") or name.startswith("jax_cuda"):
            info[name] = dist.version
    try:
        info["torch"] = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        pass
    info.update(torch_env)
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,power.limit",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        if smi.returncode == 0 and smi.stdout.strip():
            info["nvidia_smi"] = smi.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        info["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
    return info


def print_cases(cases, args):
    print(f"{len(cases)} cases ({len({c['shape'] for c in cases})} shapes), in the order run:")
    print(f"{'#':>3} {'shape':20s} {'routing':10s} {'M':>6} {'K':>5} {'N':>6} {'G':>4} {'useful':>6} "
          f"{'GFLOP/GEMM':>10}  group sizes")
    for i, c in enumerate(cases):
        print(f"{i:3d} {c['shape']:20s} {c['routing']:10s} {c['M']:6d} {c['K']:5d} {c['N']:6d} {c['G']:4d} "
              f"{c['useful_rows']:6d} {2 * c['useful_rows'] * c['K'] * c['N'] / 1e9:10.1f}  {rle(c['group_sizes'])}")
    grouped = [b for b in ("ours", "ours_mask_tail", "xla_ragged_dot") if wanted(f"{b}/fwd", args)]
    kinds = 2 if args.bwd else 1
    n_grouped = len(cases) * len(grouped) * kinds
    dense_keys = {(c["useful_rows"], c["K"], c["N"]) for c in cases} if wanted("dense_same_flops/fwd", args) else set()
    n_shapes = len({c["shape"] for c in cases})
    print(f"timings: {n_grouped} grouped ({'+'.join(grouped) or 'none'}, fwd{' and fwd+bwd' if args.bwd else ''})"
          f" + {len(dense_keys) * kinds} dense ({len(dense_keys)} distinct (rows, K, N))"
          f" + {2 * len(cases) if args.torch else 0} torch")
    # rough model, compile costs guessed (not measured): see the estimate next to ISSUE10_ROWS
    est = (10 + (20 + 1.0 * len(cases) if args.torch else 0) + n_shapes * len(grouped) * (2 + 4 * (kinds - 1))
           + len(dense_keys) * (1 + 2 * (kinds - 1)) + 0.6 * (n_grouped + len(dense_keys) * kinds)
           + 2 * n_shapes + 0.5 * len(cases))
    print(f"rough GPU time estimate: {est / 60:.1f} min (guessed compile costs; real H200 run may differ)")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["smoke", "full"], default="smoke", help="shape set when no --suite")
    p.add_argument("--suite", choices=sorted(SUITES), default=None,
                   help="issue10: issue 10's table (ours, torch._grouped_mm with --torch, dense); "
                        "tiny: CPU smoke shapes (use with --interpret)")
    p.add_argument("--out", default=None, help="JSON path (a markdown table is written next to it)")
    p.add_argument("--list", action="store_true", help="print the cases and exit (no device needed)")
    p.add_argument("--only", default="", help="comma list of shape names, run in the order given")
    p.add_argument("--impls", default="", help="comma list of label substrings to time (overrides the suite's)")
    p.add_argument("--no-bwd", dest="bwd", action="store_false")
    p.add_argument("--sweep", action="store_true", help="also time alternative forward tilings")
    p.add_argument("--tokamax", action="store_true")
    p.add_argument("--torch", action="store_true", help="torch._grouped_mm in a subprocess, before JAX")
    p.add_argument("--torch-timeout-s", type=int, default=240)
    p.add_argument("--routings", default="",
                   help=f"comma list from {ROUTINGS}; default: the suite's per row, uniform,skewed for --mode "
                        "full, uniform for --mode smoke")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="start no new timing after this many seconds (the JSON and table are still written)")
    p.add_argument("--interpret", action="store_true",
                   help="run our kernel in the Pallas interpreter (CPU smoke; with --suite tiny)")
    args = p.parse_args()
    args.impl_filter = [s for s in args.impls.split(",") if s]
    cases = build_cases(args)
    if args.list:
        print_cases(cases, args)
        return
    if not args.out:
        p.error("--out is required (unless --list)")
    if args.interpret:
        TIMING.update(min_total_s=0.0, loops=1, min_iters=1)
    args.t_start = time.perf_counter()
    args.deadline = None if args.time_budget_s is None else args.t_start + args.time_budget_s
    print_cases(cases, args)
    torch_res, torch_env = run_torch(cases, args.torch_timeout_s) if args.torch else ({}, {})
    args.environment = environment(torch_env)
    print(args.environment, flush=True)
    results = []
    by_shape = collections.OrderedDict()
    for c in cases:
        by_shape.setdefault(c["shape"], []).append(c)
    for name, shape_cases in by_shape.items():
        m, k, n, g = (shape_cases[0][d] for d in ("M", "K", "N", "G"))
        if past_deadline(args):
            for c in shape_cases:
                row = dict(c, tflops={}, ms={}, errors={"all": "skipped: --time-budget-s reached"})
                merge_torch(row, torch_res)
                results.append(row)
            continue
        keys = jax.random.split(jax.random.key(zlib.crc32(name.encode()) % 2**31), 3)
        x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
        w = jax.random.normal(keys[1], (g, k, n), jnp.bfloat16)
        dy = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
        grouped = jax_impls(m, k, n, g, args)
        impls = dict(fwd={lb: jax.jit(f) for lb, f in grouped.items()},
                     bwd={lb: fwd_bwd(f) for lb, f in grouped.items()} if args.bwd else {})
        for c in shape_cases:
            measure_case(c, x, w, dy, impls, args, results, torch_res)
            save_json(args, results)
        del x, w, dy, impls
    save_json(args, results)
    table = markdown_table([finalize_row(r) for r in results], args.environment)
    md_path = args.out.rsplit(".", 1)[0] + ".md"
    with open(md_path, "w") as f:
        f.write(table + "\n")
    print(table)
    print(f"\nwrote {args.out} and {md_path} in {time.perf_counter() - args.t_start:.0f} s")


if __name__ == "__main__":
    main()
