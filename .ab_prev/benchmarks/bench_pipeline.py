"""Pipeline parallelism on real devices: tokens/s and the bubble of each schedule against plain data parallelism.

    python -m benchmarks.bench_pipeline --config mixtral_small --stages 2 --microbatches 2,4,8 \
        --schedules gpipe,1f1b --out benchmarks/results/pipeline_2xh200.json

Every run keeps the microbatch fixed (`--microbatch-size` sequences) so the global batch is M microbatches.
A schedule of S stages takes (M + S - 1) ticks, so its step time is T(M) = (M + S - 1)·t + c (t: one
microbatch forward+backward on one stage, c: per-step work outside the ticks such as the optimizer). The
least-squares line through the measured T(M) gives t (slope) and c (intercept - (S-1)·t); the measured bubble
at M is (S-1)·t / T(M), printed next to the formula (S-1)/(M+S-1). The data-parallel baseline runs the same
model with every device holding all layers (`parallel.data` = devices) at the largest global batch.
"""
from __future__ import annotations

import argparse

import jax
import numpy as np

from benchmarks.bench_train import bench_config, write_json
from benchmarks.environment import environment
from megascale_jax.parallel.pipeline_schedules import schedule_summary as bubble_report

BENCHMARK = "bench_pipeline"


def fit_ticks(num_stages: int, microbatches: list[int], step_times: list[float]) -> dict:
    """Tick time t and per-step overhead c from T(M) = (M + S - 1)·t + c (needs two or more M)."""
    slope, intercept = np.polyfit(np.asarray(microbatches, float), np.asarray(step_times, float), 1)
    overhead = intercept - (num_stages - 1) * slope
    return {"tick_s": float(slope), "overhead_s": float(overhead),
            "measured_bubble": {str(m): float((num_stages - 1) * slope / t) for m, t in zip(microbatches, step_times)}}


def _row_summary(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in ("losses", "tokens_per_s_intervals")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="mixtral_small")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--microbatches", default="2,4,8")
    ap.add_argument("--schedules", default="gpipe,1f1b")
    ap.add_argument("--microbatch-size", type=int, default=1, help="sequences per microbatch")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--log-every", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    stages, counts = args.stages, [int(m) for m in args.microbatches.split(",")]
    results, fits = [], {}

    def save():
        write_json(args.out, {"benchmark": BENCHMARK, "environment": environment(), "config": args.config,
                              "stages": stages, "microbatch_size": args.microbatch_size, "results": results,
                              "fits": fits})

    def run(label: str, overrides: dict, extra: dict) -> dict:
        try:
            row = bench_config(args.config, args.steps, args.log_every, overrides)
        except Exception as err:  # noqa: BLE001 - a failed run is recorded next to the others
            row = {"config": args.config, "overrides": overrides, "error": f"{type(err).__name__}: {err}"[:800]}
        row.update(label=label, **extra)
        results.append(row)
        print(_row_summary(row), flush=True)
        save()
        return row

    data = jax.device_count()
    run("data_parallel", {"parallel.data": data, "parallel.pipe": 1, "parallel.intra": 1,
                          "train.global_batch": max(counts) * args.microbatch_size * data}, {})
    for schedule in args.schedules.split(","):
        rows = []
        for m in counts:
            bubble = bubble_report(schedule, stages, m)
            rows.append(run(f"{schedule}_m{m}", {
                "parallel.data": data // stages, "parallel.pipe": stages, "parallel.intra": 1,
                "parallel.pipeline_schedule": schedule, "train.microbatches": m,
                "train.global_batch": m * args.microbatch_size * (data // stages)},
                {"schedule": schedule, "num_microbatches": m,
                 "bubble_formula": bubble["bubble_fraction_formula"],
                 "bubble_counted": bubble["bubble_fraction_counted"]}))
        ok = [r for r in rows if r.get("step_time_s_median")]
        if len(ok) >= 2:
            fits[schedule] = fit_ticks(stages, [r["num_microbatches"] for r in ok],
                                       [r["step_time_s_median"] for r in ok])
            print(schedule, fits[schedule], flush=True)
            save()


if __name__ == "__main__":
    main()
