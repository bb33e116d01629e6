"""Where a profiled train step's GPU time goes: kernel time by category and how much communication is exposed.

`jax.profiler` writes `<dir>/plugins/profile/<run>/<host>.trace.json.gz` (Chrome trace format). Each GPU is a
process named like `/device:GPU:0`; its kernels are complete events (`"ph": "X"`, microseconds) on threads
named `Stream #N(...)`; other threads on the GPU process are derived views (XLA Ops, XLA Modules) that repeat
the same time and are skipped so nothing is counted twice.

`breakdown(trace, num_steps)` returns, per step and averaged over GPUs:
- `busy_ms`: union of all kernel intervals (the GPU is doing something);
- `comm_ms`: union of communication kernels (NCCL);
- `exposed_comm_ms`: communication time during which no compute kernel runs (what overlap failed to hide);
- `kernel_ms_by_category`: summed kernel time per category (gemm, attention, comm:<kind>, other);
- `top_kernels`: the largest kernels by name, so the categories can be checked by eye (with `sources`, each
  fusion's jax op and source line: benchmarks/hlo_sources.py).
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re

# Substrings of lower-cased kernel names, checked in order; the first that matches names the category.
_COMM_KINDS = (("alltoall", "all_to_all"), ("sendrecv", "send_recv"), ("allgather", "all_gather"),
               ("reducescatter", "reduce_scatter"), ("allreduce", "all_reduce"))
_CATEGORIES = (
    ("attention", ("flash", "fmha", "sdpa", "cudnn", "attention")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "wgmma", "matmul", "ragged", "_kernel_mgpu", "mosaic")),
)


def kernel_category(name: str) -> str:
    low = name.lower()
    if "nccl" in low:
        for spellings in _COMM_KINDS:
            if any(s in low for s in spellings):
                return "comm:" + spellings[0]
        return "comm:other"
    for category, needles in _CATEGORIES:
        if any(n in low for n in needles):
            return category
    return "other"


def latest_trace_file(profile_dir: str) -> str:
    files = glob.glob(os.path.join(profile_dir, "plugins", "profile", "*", "*.trace.json.gz"))
    if not files:
        raise FileNotFoundError(f"no *.trace.json.gz under {profile_dir}/plugins/profile: was the profiler run?")
    return max(files, key=os.path.getmtime)


def load_trace(path: str) -> dict:
    with gzip.open(path, "rb") as f:
        return json.load(f)


def gpu_stream_events(trace: dict) -> dict[int, list[dict]]:
    """Kernel events per GPU process id, from stream threads only."""
    events = trace.get("traceEvents", [])
    process_names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
                     if e.get("ph") == "M" and e.get("name") == "process_name"}
    thread_names = {(e["pid"], e["tid"]): e.get("args", {}).get("name", "") for e in events
                    if e.get("ph") == "M" and e.get("name") == "thread_name"}
    gpus = {pid for pid, name in process_names.items() if "gpu" in name.lower() and "device" in name.lower()}
    out: dict[int, list[dict]] = collections.defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in gpus:
            continue
        if thread_names.get((e["pid"], e.get("tid")), "").lower().startswith("stream"):
            out[e["pid"]].append(e)
    return out


def idle_gaps(events: list[dict], top: int = 10) -> dict:
    """Where one GPU's streams are all idle between its first and last kernel: the total, the count of gaps over
    5 us, and the `top` largest with the kernels on either side (what the GPU waited between)."""
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0.0), e.get("name", "")) for e in events)
    gaps, end, last = [], float("-inf"), ""
    for lo, hi, name in spans:
        if end != float("-inf") and lo > end:
            gaps.append((lo - end, last, name))
        if hi > end:
            end, last = hi, name
    return {"idle_us": round(sum(g for g, _, _ in gaps), 1), "gaps_over_5us": sum(g > 5 for g, _, _ in gaps),
            "largest": [{"us": round(g, 1), "after": a[:80], "before": b[:80]} for g, a, b in sorted(gaps)[::-1][:top]]}


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total


def subtract_length(base: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Length of union(base) not covered by union(cover)."""
    return union_length(base) - union_length(_intersections(_merged(base), _merged(cover)))


def _merged(intervals):
    out = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _intersections(a, b):
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def breakdown(trace: dict, num_steps: int, top: int = 25, sources: dict | None = None) -> dict:
    """`sources`: benchmarks/hlo_sources.instruction_sources of the traced program; each top kernel whose
    name is an HLO instruction then says which jax op and source line it came from ('source')."""
    per_gpu = gpu_stream_events(trace)
    if not per_gpu:
        raise ValueError("the trace has no GPU stream kernels (profiled on the CPU, or an unknown trace layout)")
    n = len(per_gpu) * num_steps
    by_category: dict[str, float] = collections.Counter()
    by_name: dict[str, float] = collections.Counter()
    sample_args: dict[str, dict] = {}   # one event's args per kernel name (the HLO op / scope it came from)
    busy = comm = exposed = 0.0
    for events in per_gpu.values():
        spans = [(e["ts"], e["ts"] + e.get("dur", 0.0), kernel_category(e.get("name", ""))) for e in events]
        comm_spans = [(lo, hi) for lo, hi, c in spans if c.startswith("comm")]
        compute_spans = [(lo, hi) for lo, hi, c in spans if not c.startswith("comm")]
        busy += union_length([(lo, hi) for lo, hi, _ in spans])
        comm += union_length(comm_spans)
        exposed += subtract_length(comm_spans, compute_spans)
        for e, (lo, hi, c) in zip(events, spans):
            by_category[c] += hi - lo
            by_name[e.get("name", "")] += hi - lo
            sample_args.setdefault(e.get("name", ""), {k: str(v)[:200] for k, v in (e.get("args") or {}).items()})
    ms = lambda us: round(us / n / 1e3, 3)  # noqa: E731 - per GPU per step, milliseconds

    def entry(k, v):
        source = source_of(k, sources)
        return {"name": k[:160], "category": kernel_category(k), "ms": ms(v), "args": sample_args.get(k, {}),
                **({"source": source} if source else {})}
    return {
        "num_gpus": len(per_gpu), "num_steps": num_steps,
        "busy_ms": ms(busy), "comm_ms": ms(comm), "exposed_comm_ms": ms(exposed),
        "kernel_ms_by_category": {k: ms(v) for k, v in sorted(by_category.items())},
        "top_kernels": [entry(k, v) for k, v in by_name.most_common(top)],
    }


def source_of(kernel_name: str, sources: dict | None) -> dict | None:
    """The HLO instruction a kernel was compiled from: the GPU trace names a fusion's kernel after the
    instruction with its '.N' suffix written '_N' (`input_reduce_fusion_31` is `input_reduce_fusion.31`)."""
    if not sources:
        return None
    return sources.get(kernel_name) or sources.get(re.sub(r"_(\d+)$", r".\1", kernel_name))


def other_by_source(top_kernels: list[dict]) -> dict[str, float]:
    """ms per source line of the listed non-GEMM, non-attention kernels ('unmapped' where no source is known;
    XLA reuses one compiled kernel for identical fusions, so a name's time can cover several lines' work)."""
    out: dict[str, float] = collections.Counter()
    for k in top_kernels:
        if k["category"] == "other":
            out[(k.get("source") or {}).get("where") or "unmapped"] += k["ms"]
    return {w: round(ms, 3) for w, ms in sorted(out.items(), key=lambda kv: -kv[1])}
