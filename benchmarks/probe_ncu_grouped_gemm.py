"""Hardware counters of the grouped GEMM's kernels (forward, input and weight gradient) next to the dense GEMM of
the same FLOPs (issue 10).

The Qwen3-30B-A3B / DeepSeekMoE rows run at 0.8-0.9x the dense GEMM; the guess in the notes was operand
traffic: a 128 x 128 ping-pong item at K = 2048 reads 1 MB from L2 per ~9 us (64 FLOP per byte), where
cuBLAS's 256 x 128 tiles in 1 x 2 clusters (the `nvjet_sm90_tst_256x128_64x4_1x2` kernels of
profile_block_sources_1xh200.json) read half as much per FLOP. Nsight Compute reads, per kernel: duration,
SM clock, L2 / DRAM / SM throughput as a share of peak, L2 hit rate and the bytes through L2, so the guess
can be checked instead of argued. The same call also times every variant round by round without the
profiler (loop_timing.time_rounds), since ncu's replays flush caches and serialise launches.

    python3 -m benchmarks.probe_ncu_grouped_gemm --out results.json    # runs ncu on itself (--workload)

Variants per shape: ours with its default tuning, ours with the cooperative schedule where it differs, for the
weight gradient the cooperative tiles unchained and on one SMEM ring across items (`chain_items`), XLA's
dense dot of the same FLOPs, and jax's Pallas Hopper matmul on the dense shape with and
without a 2-CTA cluster sharing the w tile (TMA multicast inside the cluster: SM to SM, not NVLink).
"""
from __future__ import annotations

import argparse
import csv
import ctypes
import dataclasses
import io
import json
import math
import os
import subprocess
import sys

SHAPES = {  # name: (rows M, K, N, groups), uniform routing, as probe_gate_up_fusion's (EP 1, 8192 tokens x top-k)
    "qwen3_30b_a3b_ep1": (65536, 2048, 768, 128),
    "deepseekmoe_16b_ep1": (49152, 2048, 1408, 64),
    "mixtral_8x7b_ep1": (16384, 4096, 14336, 8),
    "deepseek_v3_ep8": (65536, 7168, 2048, 32),
}
KERNELS = r"regex:mosaic|nvjet|gemm|cutlass|xmma|sm90"   # the GEMM kernels; the work-table fusions are left out
SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "ComputeWorkloadAnalysis")
METRICS = ("gpu__time_duration.sum", "sm__cycles_elapsed.avg.per_second", "lts__t_bytes.sum",
           "dram__bytes_read.sum", "lts__t_sector_hit_rate.pct")   # (the gmma pipe metric read n/a here)


def _profiler(start: bool):
    """cuProfilerStart / Stop on the primary context of device 0 (the one XLA uses), so that ncu with
    --profile-from-start off sees only the timed calls, not the compiles' autotuning launches."""
    cuda = ctypes.CDLL("libcuda.so.1")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    calls = (("cuInit", lambda: cuda.cuInit(0)), ("cuDeviceGet", lambda: cuda.cuDeviceGet(ctypes.byref(dev), 0)),
             ("cuDevicePrimaryCtxRetain", lambda: cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)),
             ("cuCtxPushCurrent_v2", lambda: cuda.cuCtxPushCurrent_v2(ctx)),   # the header's name for it
             ("cuProfilerStart" if start else "cuProfilerStop",
              lambda: cuda.cuProfilerStart() if start else cuda.cuProfilerStop()),
             ("cuCtxPopCurrent_v2", lambda: cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))))
    for name, call in calls:
        rc = call()
        if rc:
            raise RuntimeError(f"CUDA driver call {name} failed with {rc}")


KINDS = ("fwd", "dgrad", "wgrad")   # the forward, the input gradient, the weight gradient


def _variants(name, kind):
    """[(label, jitted fn, args)] for one shape and kernel kind: ours with its default tiles, the cooperative
    schedule where it differs, for the weight gradient the cooperative tiles unchained and chained (each label
    only where its tiles differ from an earlier one's), then dense GEMMs of the same FLOPs."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    from pallas_kernels.grouped_gemm import default_tuning, grouped_gemm, grouped_gemm_dgrad, grouped_gemm_wgrad

    m, k, n, g = SHAPES[name]
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (m, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(keys[1], (g, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    dy = jax.random.normal(keys[2], (m, n), jnp.float32).astype(jnp.bfloat16)
    sizes = jnp.full((g,), m // g, jnp.int32)
    base, coop = default_tuning(m, k, n, g), default_tuning(m, k, n, g, pingpong=False)
    ours = {"fwd": (lambda t: lambda x, w, s: grouped_gemm(x, w, s, tuning=t), (x, w, sizes)),
            "dgrad": (lambda t: lambda dy, w, s: grouped_gemm_dgrad(dy, w, s, tuning=t), (dy, w, sizes)),
            "wgrad": (lambda t: lambda x, dy, s: grouped_gemm_wgrad(x, dy, s, tuning=t), (x, dy, sizes))}[kind]
    tunings = [("ours/default", base), ("ours/cooperative", coop)]
    if kind == "wgrad":   # the cooperative weight gradient on jax's per-item pipelines and on one SMEM ring
        tunings += [(f"ours/{label}", dataclasses.replace(coop, wgrad=dataclasses.replace(coop.wgrad, chain_items=c)))
                    for label, c in (("unchained", False), ("chained", True))]
    out, seen = [], []
    for label, tuning in tunings:   # a tuning equal to an earlier one (for this kernel) is not timed twice
        if getattr(tuning, kind) not in seen:
            seen.append(getattr(tuning, kind))
            out.append((label, jax.jit(ours[0](tuning)), ours[1]))
    # the dense GEMM of the same FLOPs: [M, K] x [K, N], [M, N] x [N, K], [K, M] x [M, N]
    a, b = {"fwd": (x, w[0]), "dgrad": (dy, w[0].T), "wgrad": (x.T, dy)}[kind]
    out.append(("dense/xla_dot", jax.jit(lambda a, b: a @ b), (a, b)))
    for label, cluster in (("dense/pallas_hopper", None), ("dense/pallas_hopper_cluster_m", hm.MatmulDimension.M)):
        if kind != "fwd" or n % 256:
            continue   # its CTA is 128 x 256 (two warpgroups along N); the forward's shape is enough
        cfg = hm.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4,
                              grid_minor_dim=hm.MatmulDimension.M, grid_tile_width=8,
                              wg_dimension=hm.MatmulDimension.N, cluster_dimension=cluster)
        out.append((label, jax.jit(lambda a, b, cfg=cfg: hm.matmul(a, b, None, cfg)), (a, b)))
    return out


SMI_FIELDS = ("clocks.sm", "power.draw", "clocks_event_reasons.active")


def sustained(fn, args, seconds=1.5):
    """One variant alone in a loop of `seconds` after a 0.3 s warm-up, nvidia-smi sampling every 50 ms: the
    median SM clock and power draw, the clock-event reasons seen (a bit mask: 0x4 is the software power
    cap), and the seconds per call. ncu times a kernel once, between replays; a loop of calls meets the
    700 W cap, and then energy per call, not cycles, sets the pace."""
    import statistics
    import time

    import jax

    def loop(duration):
        t0, calls = time.perf_counter(), 0
        while time.perf_counter() - t0 < duration:
            for _ in range(20):
                out = fn(*args)
            calls += 20
            jax.block_until_ready(out)
        return (time.perf_counter() - t0) / calls

    loop(0.3)
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"   # jax's device 0
    smi = subprocess.Popen(["nvidia-smi", "-i", gpu, f"--query-gpu={','.join(SMI_FIELDS)}",
                            "--format=csv,noheader,nounits", "-lms", "50"], stdout=subprocess.PIPE, text=True)
    per_call = loop(seconds)
    smi.terminate()
    samples = []
    for line in smi.communicate()[0].splitlines():
        fields = line.split(", ")
        try:   # a line with [N/A] or cut off by the terminate is skipped
            samples.append((float(fields[0]), float(fields[1]), fields[2]))
        except (IndexError, ValueError):
            continue
    samples = samples[2:] or samples   # the first samples can predate the loop's steady state
    clocks, watts = [c for c, _, _ in samples], [p for _, p, _ in samples]
    return {"seconds_per_call": per_call, "samples": len(samples),
            "sm_clock_mhz": statistics.median(clocks) if clocks else None,
            "power_w": statistics.median(watts) if watts else None,
            "clock_event_reasons": sorted({r for _, _, r in samples}),
            "joules_per_call": statistics.median(watts) * per_call if watts else None}


def workload(names, kinds, time_them: bool):
    """Compile and warm every variant, then (profiler on) one call of each in order; with `time_them` the
    variants are instead timed round by round, then each alone under nvidia-smi (`sustained`), and the
    results printed as one JSON line."""
    import statistics

    import jax

    from benchmarks.loop_timing import time_rounds

    order, timed, power, errors = [], {}, {}, {}
    for name, kind in ((name, kind) for name in names for kind in kinds):
        runnable = []
        for label, fn, args in _variants(name, kind):
            try:
                jax.block_until_ready(fn(*args))
                runnable.append((f"{name}/{kind}/{label}", fn, args))
            except Exception as err:  # noqa: BLE001 - a config a kernel rejects is recorded, not fatal
                print(json.dumps({"failed": f"{name}/{kind}/{label}",
                                  "error": f"{type(err).__name__}: {str(err)[:300]}"}))
        if time_them:
            times = {}
            time_rounds(runnable, min_total_s=0.3, loops=6, per_loop=times, errors=errors)
            timed.update({k: statistics.median(v) for k, v in times.items()})
            power.update({label: sustained(fn, args) for label, fn, args in runnable if label in times})
        else:
            _profiler(True)
            for label, fn, args in runnable:
                jax.block_until_ready(fn(*args))
                order.append(label)
            _profiler(False)
    print("PROBE_RESULT " + json.dumps({"order": order, "seconds": timed, "sustained": power,
                                        "errors": {k: str(v)[:300] for k, v in errors.items()}}), flush=True)


def _result_line(text, stderr=""):
    for line in text.splitlines():
        if line.startswith("PROBE_RESULT "):
            return json.loads(line[len("PROBE_RESULT "):])
    raise RuntimeError("the workload printed no PROBE_RESULT line; its output ends:\n" + text[-3000:] +
                       "\nstderr ends:\n" + stderr[-3000:])


def parse_ncu_csv(text):
    """ncu --csv --page details rows -> [{'kernel': name, 'metrics': {'Section/Metric (unit)': value}}] in
    launch order (the 'ID' column)."""
    start = text.find('"ID","Process ID"')
    if start < 0:
        raise RuntimeError("no ncu CSV table in the output; it ends:\n" + text[-3000:])
    kernels = {}
    for row in csv.DictReader(io.StringIO(text[start:])):
        if not row.get("ID", "").isdigit():
            continue
        entry = kernels.setdefault(int(row["ID"]), {"kernel": row["Kernel Name"], "grid": row.get("Grid Size"),
                                                    "block": row.get("Block Size"), "metrics": {}})
        unit = f" ({row['Metric Unit']})" if row.get("Metric Unit") else ""
        section = row.get("Section Name") or "metrics"
        value = row["Metric Value"].replace(",", "")
        try:
            value = float(value)
        except ValueError:
            pass
        entry["metrics"][f"{section}/{row['Metric Name']}{unit}"] = value
    return [kernels[i] for i in sorted(kernels)]


def attribute(order, kernels):
    """Each profiled variant's kernels: ours are the Mosaic kernels, the dense variants the others, in the
    order the workload ran them (each variant launches exactly one matching kernel; a mismatch is an error)."""
    if len(order) != len(kernels):
        raise RuntimeError(f"{len(kernels)} profiled kernels for {len(order)} variants: "
                           f"{[k['kernel'][:60] for k in kernels]}")
    out = {}
    for label, kernel in zip(order, kernels):
        mosaic = "mosaic" in kernel["kernel"]
        if mosaic != ("/ours/" in label or "/dense/pallas" in label):
            raise RuntimeError(f"variant {label} got kernel {kernel['kernel'][:80]}: the order is off")
        out[label] = kernel
    return out


def mma_flops_per_sm_cycle():
    """Hopper's dense bf16 rate per SM and clock (4096): the planner's peak, 989.4 TFLOP/s, is 132 SMs at
    1830 MHz. Imported here, not at the top: the planner imports jax, which this process must not start
    before it has turned preallocation off (main)."""
    from megascale_jax.planner.efficiency import H200_PEAK_TFLOPS

    return round(H200_PEAK_TFLOPS * 1e12 / (132 * 1830e6))


def summarize(label, kernel, seconds_unprofiled=None, sustained_row=None, num_sms=132):
    """The numbers the verdicts need from one profiled kernel: its time and rate under ncu, the SM clock, the
    elapsed cycles against the fewest the MMAs need on `num_sms` SMs (tiles, waves and stalls all count
    against it), the share of cycles the SMs were active, DRAM bytes and L2 load; and the whole call's
    time outside the profiler (work tables and launch gaps included, the GPU at its sustained clock)."""
    m_, k_, n_ = SHAPES[label.split("/")[0]][:3]
    flops = 2 * m_ * k_ * n_
    metric = {key.split("/", 1)[1]: v for key, v in kernel["metrics"].items()}
    ns, elapsed = metric.get("Duration (ns)"), metric.get("Elapsed Cycles (cycle)")
    ctas = math.prod(int(d) for d in kernel["grid"].strip("()").split(",")) if kernel.get("grid") else None
    out = {"kernel": kernel["kernel"], "ncu_ms": ns / 1e6 if ns else None,
           "ncu_tflops": flops / (ns * 1e-9) / 1e12 if ns else None,
           "sm_clock_mhz": metric.get("SM Frequency (hz)", 0) / 1e6 or None,
           "dram_read_gb": metric.get("dram__bytes_read.sum (byte)", 0) / 1e9 or None,
           "l2_throughput_pct": metric.get("L2 Cache Throughput (%)"), "l2_hit_pct": metric.get("L2 Hit Rate (%)"),
           "dram_throughput_pct": metric.get("DRAM Throughput (%)"),
           "sm_active_share": (metric["SM Active Cycles (cycle)"] / elapsed
                               if elapsed and "SM Active Cycles (cycle)" in metric else None)}
    # the cycle efficiency counts every SM of the GPU whatever the grid: idle SMs are a loss too
    out["mma_cycles_share"] = flops / (num_sms * mma_flops_per_sm_cycle()) / elapsed if elapsed else None
    out["grid_ctas"] = ctas
    if seconds_unprofiled:
        out.update(call_ms=seconds_unprofiled * 1e3, call_tflops=flops / seconds_unprofiled / 1e12)
    if sustained_row:
        out.update({f"sustained_{k}": sustained_row[k] for k in ("sm_clock_mhz", "power_w", "joules_per_call")})
        out["sustained_tflops"] = flops / sustained_row["seconds_per_call"] / 1e12
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--only", default="", help="comma list of shape names (default: all)")
    parser.add_argument("--kernels", default="fwd", help=f"comma list of {KINDS} (default: fwd)")
    parser.add_argument("--workload", action="store_true", help="internal: the profiled process")
    parser.add_argument("--time", action="store_true", help="internal: with --workload, time instead of profile")
    parser.add_argument("--ncu", default="ncu")
    args = parser.parse_args()
    names = [s for s in args.only.split(",") if s] or list(SHAPES)
    unknown = sorted(set(names) - set(SHAPES))
    if unknown:
        sys.exit(f"--only: unknown shape(s) {unknown}; choose from {sorted(SHAPES)}")
    kinds = [s for s in args.kernels.split(",") if s]
    if not kinds or set(kinds) - set(KINDS):
        sys.exit(f"--kernels: {args.kernels!r}; choose a comma list of {KINDS}")
    if args.workload:
        return workload(names, kinds, args.time)
    if not args.out:
        sys.exit("--out is required (the JSON to write)")
    # this process reads the environment (jax on the GPU) while the profiled one runs: no preallocation here
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    import jax

    from benchmarks.environment import environment

    me = [sys.executable, "-m", "benchmarks.probe_ncu_grouped_gemm", "--workload", "--only", ",".join(names),
          "--kernels", ",".join(kinds)]
    env = dict(os.environ)   # no preallocation (set above) in the children either: ncu's replays save memory
    timing = subprocess.run(me + ["--time"], env=env, capture_output=True, text=True)
    timed = _result_line(timing.stdout, timing.stderr)
    result = {"benchmark": "probe_ncu_grouped_gemm", "environment": environment(), "description": __doc__.strip(),
              "shapes": {n: dict(zip(("m", "k", "n", "groups"), SHAPES[n])) for n in names}, "kernels": kinds,
              "seconds_unprofiled": timed["seconds"], "sustained": timed["sustained"],
              "timing_errors": timed["errors"]}
    for attempt, extra in (("sections_and_metrics", ["--metrics", ",".join(METRICS)]), ("sections", [])):
        cmd = [args.ncu, "--clock-control", "none", "--profile-from-start", "off", "--kernel-name", KERNELS,
               "--csv", "--page", "details", *sum((["--section", s] for s in SECTIONS), []), *extra, *me]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True)
        try:
            kernels = parse_ncu_csv(run.stdout)
            result["ncu"] = {"attempt": attempt, "command": " ".join(cmd),
                             "variants": attribute(_result_line(run.stdout, run.stderr)["order"], kernels)}
            break
        except RuntimeError as err:
            result.setdefault("ncu_failures", []).append({"attempt": attempt, "rc": run.returncode,
                                                         "error": str(err)[-2000:], "stderr": run.stderr[-2000:]})
    sms = jax.devices()[0].core_count
    result["summary"] = {label: summarize(label, v, timed["seconds"].get(label), timed["sustained"].get(label), sms)
                         for label, v in result.get("ncu", {}).get("variants", {}).items()}
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    for label, row in result["summary"].items():
        print(label, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()
                                 if k != "kernel"}), row["kernel"][:48])
    print("failures:", json.dumps(result.get("ncu_failures", []))[:3000])


if __name__ == "__main__":
    main()
