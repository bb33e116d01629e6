"""Exposed communication per step, autodiff vs the macro layer vs the fused schedule (parallel.moe_layer), from a
profile of the real trainer, on however many devices the machine has.

    python -m benchmarks.bench_overlap --config mixtral_small --steps 12 --profile-steps 3 \
        --set parallel.intra=2 --out benchmarks/results/overlap_2xh200.json

Each variant (`autodiff`; `macro` with overlap_chunks 1 and `--chunks`; `fused` with the all_gather dispatch as
ring steps, `fused_runs` with its rows as (expert, source) runs, `fused_mosaic` with the fused kernels for both
the dispatch and the attention exchanges (GPU, >= 2 devices; only when named in --variants)) runs `python -m megascale_jax.train` in a
subprocess (benchmarks/bench_train.py's `run_trainer`) with `--profile` over the last `--profile-steps` steps;
`exposed_communication` then reads the trace: per device, the union of communication intervals, the part of
it during which no compute runs (exposed), and the busy time, per step. GPU traces are read as
benchmarks/gpu_trace.py reads them (kernels on stream threads, NCCL kernels = communication); CPU traces
(simulated devices) from the thunk executor's per-op events, collectives named by their HLO opcode; on the
CPU collectives are synchronous, so the CPU figures test the parser, not the overlap.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import tempfile

from benchmarks import gpu_trace
from benchmarks.bench_train import _parse_overrides, run_trainer, write_json
from benchmarks.environment import environment

CPU_COLLECTIVES = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute",
                   "ragged-all-to-all", "collective-broadcast")
# Thunks that contain other thunks: their spans would cover the collectives inside them.
CPU_CONTAINERS = ("while", "conditional", "call")


def _opcode(hlo_op: str) -> str:
    """'all-to-all.12' -> 'all-to-all'; 'fusion.3' -> 'fusion'."""
    head, _, tail = hlo_op.rpartition(".")
    return head if head and tail.isdigit() else hlo_op


def device_spans(trace: dict) -> dict[str, list[tuple[float, float, bool]]]:
    """{device: [(start_us, end_us, is_communication)]} from a GPU trace (stream kernels) or, if it has none,
    a CPU trace (thunk events carrying `device_ordinal` and `hlo_op`)."""
    per_gpu = gpu_trace.gpu_stream_events(trace)   # the same kernel selection as gpu_trace.breakdown
    if per_gpu:
        return {f"gpu:{pid}": [(e["ts"], e["ts"] + e.get("dur", 0.0),
                                gpu_trace.kernel_category(e.get("name", "")).startswith("comm")) for e in events]
                for pid, events in per_gpu.items()}
    out: dict[str, list] = collections.defaultdict(list)
    for e in trace.get("traceEvents", []):
        args = e.get("args") or {}
        if e.get("ph") != "X" or "device_ordinal" not in args or "hlo_op" not in args:
            continue
        op = _opcode(args["hlo_op"])
        if op in CPU_CONTAINERS or e.get("name", "").startswith("end: "):
            continue
        out[f"cpu:{args['device_ordinal']}"].append((e["ts"], e["ts"] + e.get("dur", 0.0), op in CPU_COLLECTIVES))
    return dict(out)


def exposed_communication(trace: dict, num_steps: int) -> dict:
    """Per step, averaged over devices (ms): busy (any op), communication, and exposed communication (when
    no compute op runs on that device); per device as well."""
    spans = device_spans(trace)
    if not spans:
        raise ValueError("the trace has no device ops (no GPU stream kernels, no CPU thunk events)")
    per_device = {}
    for device, items in sorted(spans.items()):
        comm = [(lo, hi) for lo, hi, is_comm in items if is_comm]
        compute = [(lo, hi) for lo, hi, is_comm in items if not is_comm]
        per_device[device] = {
            "busy_ms": gpu_trace.union_length([(lo, hi) for lo, hi, _ in items]) / num_steps / 1e3,
            "comm_ms": gpu_trace.union_length(comm) / num_steps / 1e3,
            "exposed_comm_ms": gpu_trace.subtract_length(comm, compute) / num_steps / 1e3,
        }
    mean = {k: round(statistics.mean(d[k] for d in per_device.values()), 4) for k in next(iter(per_device.values()))}
    return {"devices": len(per_device), "num_steps": num_steps, **mean,
            "per_device": {d: {k: round(v, 4) for k, v in row.items()} for d, row in per_device.items()}}


def run_variant(config: str, steps: int, profile_steps: int, overrides: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run = {"train.steps": steps, "train.log_every": max(1, (steps - profile_steps) // 3), "train.eval_every": 0,
               "train.warmup_steps": min(5, steps), "output.dir": tmp, "output.tensorboard": False,
               "profile.start_step": steps - profile_steps, "profile.num_steps": profile_steps, **overrides}
        logged = run_trainer(config, run, tmp)
        trace = gpu_trace.load_trace(gpu_trace.latest_trace_file(os.path.join(tmp, "profile")))
    rates = [r["tokens_per_s"] for r in logged[1:] if r.get("tokens_per_s")]
    return {"config": config, "overrides": overrides, "tokens_per_s_median": statistics.median(rates) if rates else None,
            "final_loss": logged[-1]["loss"] if logged else None,
            "profile": exposed_communication(trace, profile_steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="mixtral_small")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--chunks", type=int, default=2, help="overlap_chunks of the chunked macro variant")
    ap.add_argument("--set", default="", help="overrides for every run: key=value,key=value")
    ap.add_argument("--variants", default="autodiff,macro,macro_chunks,fused,fused_runs",
                    help="comma list from autodiff, macro, macro_chunks, fused, fused_runs, fused_mosaic")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    common = {"plan_recipe": "megascale", **_parse_overrides(args.set)}
    fused = {"parallel.moe_layer": "fused", "parallel.ep_dispatch": "all_gather"}
    known = {"autodiff": {"parallel.moe_layer": "autodiff"}, "macro": {"parallel.moe_layer": "macro"},
             "macro_chunks": {"parallel.moe_layer": "macro", "parallel.overlap_chunks": args.chunks}, "fused": fused,
             "fused_runs": {**fused, "parallel.dispatch_exchange": "runs"},
             "fused_mosaic": {**fused, "parallel.dispatch_exchange": "mosaic", "parallel.attention_exchange": "mosaic"}}
    names = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {sorted(known)}")
    variants = [(f"macro_chunks{args.chunks}" if v == "macro_chunks" else v, known[v]) for v in names]
    rows = []
    for name, extra in variants:
        try:
            row = run_variant(args.config, args.steps, args.profile_steps, {**common, **extra})
        except Exception as err:  # noqa: BLE001 - record the failure next to the other rows
            row = {"config": args.config, "overrides": {**common, **extra}, "error": f"{type(err).__name__}: {err}"[:800]}
        rows.append({"variant": name, **row})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "profile"}
                         | {"profile": {k: v for k, v in row.get("profile", {}).items() if k != "per_device"}}),
              flush=True)
        write_json(args.out, {"benchmark": "bench_overlap", "environment": environment(), "results": rows})


if __name__ == "__main__":
    main()
