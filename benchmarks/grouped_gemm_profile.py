"""Where one grouped GEMM forward call's time goes on the GPU: the Mosaic kernel itself, the XLA kernels that
build its work tables before it, and the gaps between them, next to the time per call a loop of calls measures.

    python3 benchmarks/grouped_gemm_profile.py --out $OUT/grouped_gemm_profile.json            # Qwen3 EP1 + EP8
    python3 benchmarks/grouped_gemm_profile.py --shapes qwen3_30b_a3b_ep1 --routings padded --variants ours,kernel_only

Shapes are issue 10's (benchmarks/grouped_gemm_cases.py), group sizes a runtime argument as in training. For
each (shape, variant, routing): the untraced time per call (a loop of `--loop` calls between two host syncs,
median of 5 loops), then `--calls` calls under jax.profiler, cut into calls at
the Mosaic kernel (the kernel name with the most GPU time): per call the kernel's duration, each kernel that
ran between the previous call's kernel and this one (name, HLO op, duration), the idle gaps between them, and
the start-to-start period of the Mosaic kernel. Medians over the calls (the first traced call is dropped).

Variants: ours (default tuning), ours_scan_tables (the work tables by cumsum + searchsorted: the default before
'fused'),
kernel_only (the tables computed once outside the timed function: the kernel alone, what removing all table
work could give), ours_mask_tail (zero_tail='mask': the kernel skips the tail, a select writes it), split_m
(256 x 128 CTA tiles, warpgroups along M), minor1 (column tiles vary fastest in the work order).
"""
import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import gpu_trace  # noqa: E402
from benchmarks.environment import environment  # noqa: E402
from benchmarks.grouped_gemm_cases import ISSUE10_MODELS, TOKENS_PER_DEVICE, group_sizes_for  # noqa: E402
from benchmarks.grouped_gemm_jax_timing import SampledCheck  # noqa: E402
import pallas_kernels.grouped_gemm as gg  # noqa: E402
from pallas_kernels._grouped_tiles import fit_ragged_tiling  # noqa: E402
from pallas_kernels._work_tables import row_tile_table  # noqa: E402

VARIANTS = ("ours", "ours_scan_tables", "kernel_only", "ours_mask_tail", "split_m", "minor1")


def shape_of(name):
    model, ep = name.rsplit("_ep", 1)
    k, n, e, top_k = ISSUE10_MODELS[model]
    return TOKENS_PER_DEVICE * top_k, k, n, e // int(ep)


def build_variant(name, m, k, n, g, interpret):
    """(jitted fn, fn(x, w, gs) -> its arguments): the arguments may hold tables made outside the timing."""
    base = gg.default_tuning(m, k, n, g)
    tunings = {"ours": base, "ours_scan_tables": dataclasses.replace(base, tables="scan"),
               "ours_mask_tail": dataclasses.replace(base, zero_tail="mask"),
               "split_m": dataclasses.replace(base, fwd=dataclasses.replace(base.fwd, wg_split="m")),
               "minor1": dataclasses.replace(base, fwd=dataclasses.replace(base.fwd, grid_minor=1))}
    if name in tunings:
        t = tunings[name]
        return jax.jit(lambda x, w, gs: gg.grouped_gemm(x, w, gs, interpret=interpret, tuning=t)), \
            lambda x, w, gs: (x, w, gs)
    if name != "kernel_only":
        raise SystemExit(f"unknown variant {name!r}; choose from {VARIANTS}")
    cfg = fit_ragged_tiling(base.fwd, k, jnp.bfloat16)
    sms = gg._num_sms(base, interpret)
    # the launcher's work tables alone (m is a multiple of 8 and >= one tile at every profiled shape)
    tables = jax.jit(lambda gs: row_tile_table(gs, m, cfg.cta_m, with_tail=True, align=base.row_tiles))
    fn = jax.jit(lambda x, w, t, nv: gg.ragged_launch(x, w, t, nv, jnp.bfloat16, cfg, False, sms, interpret))
    return fn, lambda x, w, gs: (x, w, *jax.block_until_ready(tables(gs)))


def host_ms_per_call(fn, argv, loop, loops=5):
    jax.block_until_ready(fn(*argv))
    times = []
    for _ in range(loops):
        t0 = time.perf_counter()
        for _ in range(loop):
            out = fn(*argv)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / loop * 1e3)
    return statistics.median(times), times


def decompose_calls(events):
    """Kernel events of one GPU (dicts with name, ts, dur in us; args optional), cut into calls at the main
    kernel (the name with the most total time). Returns per call: main kernel us, the kernels between the
    previous main kernel's end and this one's start, the gaps, and the main kernel's start-to-start period."""
    events = sorted(events, key=lambda e: e["ts"])
    totals = {}
    for e in events:
        totals[e["name"]] = totals.get(e["name"], 0.0) + e.get("dur", 0.0)
    main_name = max(totals, key=totals.get)
    mains = [i for i, e in enumerate(events) if e["name"] == main_name]
    calls = []
    for a, b in zip(mains, mains[1:]):
        prev, cur = events[a], events[b]
        between = [e for e in events[a + 1:b]]
        edges = [prev["ts"] + prev["dur"]] + [x for e in between for x in (e["ts"], e["ts"] + e["dur"])] + [cur["ts"]]
        gaps = [max(edges[i + 1] - edges[i], 0.0) for i in range(0, len(edges), 2)]
        calls.append(dict(main_us=cur["dur"], period_us=cur["ts"] - prev["ts"],
                          pre=[dict(name=e["name"], op=_op(e), us=e["dur"]) for e in between], gaps_us=gaps))
    return main_name, calls


def _op(e):
    args = e.get("args") or {}
    return str(args.get("hlo_op") or args.get("long_name") or "")[:80]


def summarize(main_name, calls):
    """Medians over calls; the pre kernels by position (the calls run the same program, so positions align
    when every call has the same number of kernels; otherwise only the totals are given)."""
    med = lambda v: round(statistics.median(v), 2) if v else None  # noqa: E731
    same = len({len(c["pre"]) for c in calls}) == 1
    out = dict(main_kernel=main_name[:120], calls=len(calls), main_us=med([c["main_us"] for c in calls]),
               period_us=med([c["period_us"] for c in calls]),
               pre_kernels_us=med([sum(p["us"] for p in c["pre"]) for c in calls]),
               gaps_us=med([sum(c["gaps_us"]) for c in calls]),
               n_pre_kernels=sorted({len(c["pre"]) for c in calls}))
    if same and calls:
        out["pre"] = [dict(name=p["name"][:100], op=p["op"], us=med([c["pre"][i]["us"] for c in calls]))
                      for i, p in enumerate(calls[0]["pre"])]
        out["gap_each_us"] = [med([c["gaps_us"][i] for c in calls]) for i in range(len(calls[0]["gaps_us"]))]
    return out


def trace_calls(fn, argv, calls):
    with tempfile.TemporaryDirectory() as tmp:
        jax.block_until_ready(fn(*argv))
        jax.profiler.start_trace(tmp)
        for _ in range(calls):
            out = fn(*argv)
        jax.block_until_ready(out)
        jax.profiler.stop_trace()
        trace = gpu_trace.load_trace(gpu_trace.latest_trace_file(tmp))
    per_gpu = gpu_trace.gpu_stream_events(trace)
    events = max(per_gpu.values(), key=len)
    main_name, cs = decompose_calls([dict(name=e.get("name", ""), ts=e["ts"], dur=e.get("dur", 0.0),
                                          args=e.get("args")) for e in events])
    return summarize(main_name, cs[1:]), cs[1:3]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default="qwen3_30b_a3b_ep1,qwen3_30b_a3b_ep8")
    p.add_argument("--routings", default="padded,half_empty,uniform")
    p.add_argument("--variants", default="ours,ours_scan_tables,kernel_only")
    p.add_argument("--mask-tail-padded", action="store_true", help="also ours_mask_tail on padded")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--loop", type=int, default=50)
    p.add_argument("--time-budget-s", type=float, default=None)
    p.add_argument("--interpret", action="store_true", help="CPU smoke: tiny shapes, no trace")
    args = p.parse_args()
    t0 = time.perf_counter()
    doc = dict(environment=environment(), rows=[])
    for shape in args.shapes.split(","):
        m, k, n, g = (512, 128, 256, 4) if args.interpret else shape_of(shape)
        keys = jax.random.split(jax.random.key(0), 2)
        x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
        w = jax.random.normal(keys[1], (g, k, n), jnp.bfloat16)
        for variant in args.variants.split(",") + (["ours_mask_tail"] if args.mask_tail_padded else []):
            fn, make_args = build_variant(variant, m, k, n, g, args.interpret)
            routings = ["padded"] if variant == "ours_mask_tail" else args.routings.split(",")
            for routing in routings:
                if args.time_budget_s is not None and time.perf_counter() - t0 > args.time_budget_s:
                    print(f"time budget reached: skip {shape} {variant} {routing}", flush=True)
                    continue
                sizes = group_sizes_for(m, g, routing)
                argv = make_args(x, w, jnp.asarray(sizes))
                useful = int(min(sizes.sum(), m))
                row = dict(shape=shape, variant=variant, routing=routing, M=m, K=k, N=n, G=g, useful_rows=useful)
                try:
                    ms, loops = host_ms_per_call(fn, argv, 1 if args.interpret else args.loop,
                                                 1 if args.interpret else 5)
                    row["rel_err"], row["tail_zero"] = SampledCheck(x, w, sizes).error(fn(*argv))
                    flop = 2.0 * useful * k * n
                    row.update(host_ms_per_call=round(ms, 4), host_loops_ms=[round(v, 4) for v in loops],
                               host_tflops=round(flop / ms / 1e9, 1))
                    if not args.interpret:
                        row["trace"], row["sample_calls"] = trace_calls(fn, argv, args.calls)
                        row["kernel_tflops"] = round(flop / row["trace"]["main_us"] / 1e6, 1)
                    tr = row.get("trace", {})
                    print(f"{shape:18s} {variant:17s} {routing:10s} host {ms * 1e3:7.1f} us/call "
                          f"({row['host_tflops']:.0f} TFLOP/s) | kernel {tr.get('main_us')} us, pre kernels "
                          f"{tr.get('pre_kernels_us')} us x{tr.get('n_pre_kernels')}, gaps {tr.get('gaps_us')} us, "
                          f"period {tr.get('period_us')} us | err {row['rel_err']:.1e} tail0 {row['tail_zero']}",
                          flush=True)
                except Exception as e:  # noqa: BLE001  (one failing variant must not stop the profile)
                    row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                    print(f"{shape} {variant} {routing} FAILED {row['error']}", flush=True)
                doc["rows"].append(row)
                with open(args.out, "w") as f:
                    json.dump(doc, f, indent=1)
        del x, w
    print(f"wrote {args.out} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
