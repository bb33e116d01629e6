"""Grouped GEMM on one H200: our Pallas Mosaic GPU kernel next to lax.ragged_dot, jax's ragged_dot_mgpu,
tokamax's ragged_dot, torch._grouped_mm (a torch subprocess) and the dense GEMM of the same FLOPs.

    python3 benchmarks/bench_grouped_gemm.py --mode smoke --out /tmp/smoke.json   # goal shapes, few impls
    python3 benchmarks/bench_grouped_gemm.py --mode full  --out results.json      # all shapes and impls

Shapes: the two goal shapes of issue 4 (Mixtral-like M=32768 K=4096 N=14336 G=8; fine-grained
M=8192 K=4096 N=1408 G=16) and the up-projection of each of the paper's six models at EP=8 with
8192 tokens per GPU before dispatch: M = 8192 * top_k rows, G = experts / 8 local experts.
Routing: uniform, skewed (one expert takes 40% of the rows, the rest split evenly), and padded (half the rows
routed uniformly, the other half a zero tail, as in an expert-parallel dropless buffer at n = 2; `ours` and
`ours_mask_tail` differ in who writes that tail, see GroupedGemmTuning.zero_tail).
TFLOP/s counts 2*M*K*N per GEMM (3 GEMMs for forward+backward). Timing: a loop of calls between two
host syncs (no sync per call), median of several loops, after a warm-up call that compiles.
"""
import argparse
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import time

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


def model_shapes():
    return {name: (8192 * k, h, f, max(e // 8, 1)) for name, (h, f, e, k) in MODELS.items()}


def group_sizes_for(m, g, routing):
    if routing == "padded":  # an expert-parallel dropless receive buffer at n = 2: half the rows are the tail
        return jnp.asarray(np.full(g, (m // 2) // g), jnp.int32)
    if routing == "uniform" or g == 1:
        sizes = np.full(g, m // g)
    else:
        big = int(0.4 * m)
        sizes = np.full(g, (m - big) // (g - 1))
        sizes[0] = big
    sizes[-1] += m - sizes.sum()
    return jnp.asarray(sizes, jnp.int32)


def time_call(fn, *args, min_total_s=0.15, loops=3):
    out = fn(*args)
    jax.block_until_ready(out)  # compile and warm up
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    iters = max(2, min(50, int(min_total_s / max(time.perf_counter() - t0, 1e-5))))
    times = []
    for _ in range(loops):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times), out


def fwd_bwd(f):
    def run(x, w, dy):
        y, vjp = jax.vjp(f, x, w)
        return (y, *vjp(dy))
    return jax.jit(run)


def jax_impls(gs, with_bwd, tuning=None):
    ours = lambda x, w: grouped_gemm(x, w, gs, tuning=tuning)  # noqa: E731
    xla = lambda x, w: jax.lax.ragged_dot(x, w, gs)  # noqa: E731
    dense = lambda x, w: x @ w[0]  # noqa: E731
    impls = {"ours": ours, "xla_ragged_dot": xla, "dense_same_flops": dense}
    if tuning is None:  # the other owner of the zero tail (GroupedGemmTuning.zero_tail), same tiles
        impls["ours_mask_tail"] = lambda x, w: grouped_gemm(x, w, gs, tuning=dataclasses.replace(  # noqa: E731
            default_tuning(x.shape[0], x.shape[1], w.shape[2], w.shape[0]), zero_tail="mask"))
    fwd = {k: jax.jit(f) for k, f in impls.items()}
    bwd = {k: fwd_bwd(f) for k, f in impls.items()} if with_bwd else {}
    return fwd, bwd


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


def measure_shape(name, shape, routing, args, results, impl_filter):
    m, k, n, g = shape
    gs = group_sizes_for(m, g, routing)
    keys = jax.random.split(jax.random.key(hash((name, routing)) % 2**31), 3)
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    w = jax.random.normal(keys[1], (g, k, n), jnp.bfloat16)
    dy = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
    flops = 2.0 * int(np.sum(np.asarray(gs))) * k * n   # useful FLOPs: rows routed to a group
    row = dict(shape=name, routing=routing, M=m, K=k, N=n, G=g, group_sizes=np.asarray(gs).tolist(),
               tflops={}, errors={})
    ref = jax.jit(lambda x, w: jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32))(x, w)

    def record(label, fn, argv, nflop, check=True):
        if impl_filter and not any(s in label for s in impl_filter):
            return
        try:
            t, out = time_call(fn, *argv)
            row["tflops"][label] = round(nflop / t / 1e12, 1)
            if check and label.endswith("fwd") and "dense" not in label:
                y = out[0] if isinstance(out, tuple) else out
                err = float(jnp.linalg.norm(y.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
                row["errors"][label] = err
            print(f"  {name:20s} {routing:8s} {label:34s} {nflop / t / 1e12:7.1f} TFLOP/s", flush=True)
            save_json(args.out, args.environment, results + [row])  # a timeout keeps every finished number
        except Exception as e:  # noqa: BLE001  (one failing baseline must not stop the run)
            row["tflops"][label] = None
            row["errors"][label] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"  {name} {routing} {label} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)

    fwd, bwd = jax_impls(gs, args.bwd)
    for label, fn in fwd.items():
        if (label == "xla_ragged_dot" and args.mode == "smoke") or (label.startswith("dense") and routing == "padded"):
            continue   # (dense over all M rows is not the same FLOPs as the padded problem)
        record(f"{label}/fwd", fn, (x, w), flops)
    for label, fn in mgpu_fwd(gs, m, n).items():
        record(f"{label}/fwd", fn, (x, w), flops)
    for label, fn in bwd.items():
        if (label == "xla_ragged_dot" and args.mode == "smoke") or (label.startswith("dense") and routing == "padded"):
            continue
        record(f"{label}/fwd+bwd", fn, (x, w, dy), 3 * flops)
    if args.sweep and name.startswith("goal") and routing == "uniform":
        for cfg in sweep_tilings(n):
            tuning = default_tuning(m, k, n, g)
            tuning = type(tuning)(fwd=cfg, dgrad=tuning.dgrad, wgrad=tuning.wgrad)
            f = jax.jit(lambda x, w, t=tuning: grouped_gemm(x, w, gs, tuning=t))
            record(f"ours[{cfg.wg_split}{cfg.tile_m}x{cfg.tile_n}s{cfg.max_concurrent_steps}"
                   f"m{cfg.grid_minor}w{cfg.grid_tile_width}]/fwd", f, (x, w), flops)
    if args.tokamax:
        try:
            measure_tokamax(row, record, gs, x, w, dy, flops, args.bwd)
        except Exception as e:  # noqa: BLE001
            row["errors"]["tokamax"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"  tokamax FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    results.append(row)


def sweep_tilings(n):
    out = []
    for split, tm, tn, steps, minor, width in [("n", 128, 128, 4, 0, 8), ("n", 128, 128, 4, 1, 8),
                                                ("n", 128, 128, 3, 0, 16), ("m", 128, 128, 4, 0, 8),
                                                ("n", 128, 64, 6, 0, 8), ("m", 64, 128, 5, 0, 8)]:
        cfg = GemmTiling(tile_m=tm, tile_n=tn, max_concurrent_steps=steps, wg_split=split,
                         grid_minor=minor, grid_tile_width=width)
        if n % cfg.cta_n == 0:
            out.append(cfg)
    return out


TORCH_SCRIPT = r"""
import json, sys, torch
shapes = json.loads(sys.argv[1]); out = []
for s in shapes:
    m, k, n, sizes = s["M"], s["K"], s["N"], s["group_sizes"]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(len(sizes), k, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    offs = torch.cumsum(torch.tensor(sizes, device="cuda", dtype=torch.int32), 0, dtype=torch.int32)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    def fwd(): return torch._grouped_mm(x, w, offs=offs)
    def fb():
        y = torch._grouped_mm(x, w, offs=offs); y.backward(dy); return y
    res = {}
    for label, fn, mult in (("fwd", fwd, 1), ("fwd+bwd", fb, 3)):
        for _ in range(3): fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(10): fn()
            b.record(); torch.cuda.synchronize(); times.append(a.elapsed_time(b) / 10 / 1e3)
        times.sort()
        res[label] = round(mult * 2 * m * k * n / times[2] / 1e12, 1)
    out.append(dict(shape=s["shape"], routing=s["routing"], tflops=res))
    print("torch", s["shape"], s["routing"], res, flush=True)
print("JSON" + json.dumps(out))
"""


def run_torch(results):
    spec = [{k: r[k] for k in ("shape", "routing", "M", "K", "N", "group_sizes")} for r in results]
    proc = subprocess.run([sys.executable, "-c", TORCH_SCRIPT, json.dumps(spec)], capture_output=True,
                          text=True, timeout=300)
    print(proc.stdout[-3000:], proc.stderr[-2000:], flush=True)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("JSON")]
    by_key = {(t["shape"], t["routing"]): t["tflops"] for t in json.loads(line[0][4:])} if line else {}
    for r in results:
        for label, v in by_key.get((r["shape"], r["routing"]), {}).items():
            r["tflops"][f"torch_grouped_mm/{label}"] = v


def save_json(path, env, results):
    with open(path, "w") as f:
        json.dump(dict(environment=env, results=results), f, indent=1)


def environment():
    import jaxlib
    dev = jax.devices()[0]
    info = dict(device=dev.device_kind, num_sms=getattr(dev, "core_count", None), jax=jax.__version__,
                jaxlib=jaxlib.__version__, date=time.strftime("%Y-%m-%d %H:%M:%S"))
    try:
        import torch
        info["torch"] = torch.__version__
    except ImportError:
        pass
    return info


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["smoke", "full"], default="smoke")
    p.add_argument("--out", required=True)
    p.add_argument("--only", default="", help="comma list of shape names")
    p.add_argument("--impls", default="", help="comma list of label substrings to time")
    p.add_argument("--no-bwd", dest="bwd", action="store_false")
    p.add_argument("--sweep", action="store_true", help="also time alternative forward tilings")
    p.add_argument("--tokamax", action="store_true")
    p.add_argument("--torch", action="store_true")
    p.add_argument("--routings", default="uniform,skewed")
    args = p.parse_args()
    shapes = dict(GOAL_SHAPES) if args.mode == "smoke" else {**GOAL_SHAPES, **model_shapes()}
    if args.only:  # in the order given (a run cut by a time limit then has the first ones)
        unknown = [k for k in args.only.split(",") if k not in shapes]
        if unknown:
            raise SystemExit(f"--only: unknown shapes {unknown}; choose from {sorted(shapes)} (--mode full for all)")
        shapes = {k: shapes[k] for k in args.only.split(",")}
    routings = ["uniform"] if args.mode == "smoke" else args.routings.split(",")
    results, env = [], environment()
    args.environment = env
    print(env, flush=True)
    impl_filter = [s for s in args.impls.split(",") if s]
    for name, shape in shapes.items():
        for routing in routings:
            if routing == "skewed" and shape[3] == 1:
                continue
            measure_shape(name, shape, routing, args, results, impl_filter)
            save_json(args.out, env, results)
    if args.torch:
        run_torch(results)
    save_json(args.out, env, results)
    for r in results:
        print(r["shape"], r["routing"], json.dumps(r["tflops"]))


if __name__ == "__main__":
    main()
