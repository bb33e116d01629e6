"""FP8 vs bf16 expert-parallel token exchange: the tiny model trained 300 steps under SP+EP over 4 of 8
simulated CPU devices, each way, through the real CLI; final losses and their ratio (issue: within 1%).

    python -m benchmarks.bench_dispatch_fp8 --steps 300 --out benchmarks/results/dispatch_fp8_tiny_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

import numpy as np

from benchmarks.bench_train import run_trainer, write_json
from benchmarks.environment import environment


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    payload = {"benchmark": "bench_dispatch_fp8", "environment": environment(), "config": "tiny_cpu", "steps": args.steps,
               "plan": "plan_recipe=megascale, intra=4 (SP attention + EP all_to_all), data=2", "runs": {}}
    for wire in ("bf16", "fp8"):
        with tempfile.TemporaryDirectory() as tmp:
            logged = run_trainer("tiny_cpu", {
                "plan_recipe": "megascale", "parallel.intra": 4, "parallel.dispatch_dtype": wire,
                "train.steps": args.steps, "train.eval_every": 0, "output.tensorboard": False,
                "output.dir": tmp}, tmp)
        payload["runs"][wire] = {"steps": [r["step"] for r in logged], "loss": [r["loss"] for r in logged]}
        write_json(args.out, payload)
    final = {w: float(np.mean(r["loss"][-3:])) for w, r in payload["runs"].items()}
    payload["final_loss_mean_last_3_logs"] = final
    payload["fp8_relative_to_bf16"] = final["fp8"] / final["bf16"] - 1
    write_json(args.out, payload)
    print(json.dumps({k: v for k, v in payload.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
