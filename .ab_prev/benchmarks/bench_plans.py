"""Parallel plans side by side on the same model and devices: tokens/s, step time and MFU of the four manual
combinations (SP+EP, TP+TP, TP+EP, SP+TP) and the XLA-propagation plan, in one process.

    python -m benchmarks.bench_plans --configs mixtral_small,deepseekmoe_small --intra 2 \
        --out benchmarks/results/plans_2xh200.json

Every run uses the real trainer (`benchmarks.bench_train.bench_config`); the intra-node domain is
`--intra` devices (all of them by default). `--profile-steps 2` also traces the last two steps of each run and
records where the GPU time goes (GEMM, attention, each collective, exposed communication). Plot with `python -m benchmarks.plot_plans <json>`.
"""
from __future__ import annotations

import argparse
import json
import os

import jax

from benchmarks.bench_train import _parse_overrides, bench_config, write_json
from benchmarks.environment import environment

BENCHMARK = "bench_plans"
PLANS = {
    "xla": {"plan_recipe": "xla"},                 # configs/plans.py
    "sp+ep": {"plan_recipe": "megascale"},
    "tp+tp": {"plan_recipe": "megatron_tp"},
    "tp+ep": {"plan_recipe": "tp_ep"},
    "sp+tp": {"plan_recipe": "sp_tp"},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="mixtral_small")
    ap.add_argument("--plans", default=",".join(PLANS))
    ap.add_argument("--intra", type=int, default=0, help="intra-node domain size (0 = all devices)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--log-every", type=int, default=3)
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="trace the last N steps of each run and record the GPU time breakdown (gpu_trace)")
    ap.add_argument("--set", default="", help="overrides for every run: key=value,key=value")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    intra = args.intra or jax.device_count()
    results = []
    for name in args.configs.split(","):
        for plan in args.plans.split(","):
            overrides = {"parallel.intra": intra, **PLANS[plan], **_parse_overrides(args.set)}
            try:
                row = bench_config(name, args.steps, args.log_every, overrides, args.profile_steps)
            except Exception as err:  # noqa: BLE001 - a plan that fails is recorded, not hidden
                row = {"config": name, "overrides": overrides, "error": f"{type(err).__name__}: {err}"[:800]}
            row["plan"] = plan
            results.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("losses", "tokens_per_s_intervals")}),
                  flush=True)
            write_json(args.out, {"benchmark": BENCHMARK, "environment": environment(), "intra": intra,
                                   "results": results})


if __name__ == "__main__":
    main()
