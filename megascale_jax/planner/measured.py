"""The planner against our own measurements: every committed tokens/s in benchmarks/results that a plan
describes (one-GPU train steps, the 2-GPU plan comparison, the 2-GPU pipeline runs), predicted by the cost
model with this code's system (`systems.ours`) on H200s.

Outliers are listed in OUTLIERS with the reason read from the profile data; nothing else is excluded.
"""
from __future__ import annotations

from megascale_jax.planner import cost, efficiency, hardware, systems
from megascale_jax.planner import workload as wl

FILES = ("train_mixtral_small_1xh200.json", "train_tiny_1xh200.json", "plans_2xh200.json",
         "pipeline_2xh200.json")
TOLERANCE = 0.15

# Remat of the configs when the runs were made (mixtral_small / deepseekmoe_small set remat='full', tiny_cpu
# keeps base's 'none'; commits 7783765, 8004cfe, 41c7dee); pinned so a later config edit cannot move the check.
MEASURED_REMAT = {"mixtral_small": "full", "deepseekmoe_small": "full", "tiny_cpu": "none"}

# label -> reason. Only cases whose cause the committed profile data shows.
OUTLIERS = {
    "train_tiny_1xh200.json:tiny_cpu": (
        "launch-bound: 4.5 GFLOP per step in 2.1 ms (0.2% MFU, fp32 compute). The cost model has no "
        "per-kernel launch term; its only fixed cost is the measured host gap per step (step - GPU busy in the "
        "plans_2xh200.json profiles, 2.2-6.6 ms), which is itself larger than this whole step."),
    "pipeline_2xh200.json:mixtral_small:data_parallel": (
        "XLA plan with the batch sharded over data (intra = 1). The profiled XLA-plan run (plans_2xh200.json, "
        "mixtral_small:xla) shows the grouped-GEMM kernel at 70.0 ms = 2.1x TP+TP's per-device 32.9 ms: XLA's "
        "partitioner runs the grouped GEMM on the rows of both devices instead of splitting them. The same "
        "replication here adds one device's expert work (276 ms) to the modeled 525 ms: 800 ms vs 837 ms "
        "measured (-4%). Not built into the model: this run has no profile to confirm it."),
}


def _plan_from_row(row, recipe: str) -> cost.Plan:
    o = row["overrides"]
    return cost.Plan(recipe=recipe, intra=o.get("parallel.intra", 1), pipe=o.get("parallel.pipe", 1),
                     schedule=o.get("parallel.pipeline_schedule", "1f1b") if o.get("parallel.pipe", 1) > 1 else "1f1b",
                     microbatches=o.get("parallel.num_microbatches", 1), remat=MEASURED_REMAT[row["config"]],
                     global_batch=row["global_batch"])


def cases() -> list[dict]:
    """[{label, file, plan, cfg, gpus, system, measured}] for every measured run a plan describes."""
    from megascale_jax.config import default_config
    out = []
    for name in FILES:
        data = efficiency._load(name)
        for i, row in enumerate(data["results"]):
            if "tokens_per_s_median" not in row:
                continue
            cfg = default_config(row["config"])
            o = row["overrides"]
            if name == "plans_2xh200.json":
                recipe, label = efficiency.PLAN_NAMES[row["plan"]], f"{row['config']}:{row['plan']}"
            else:   # intra = 1 in these runs: every recipe is the same program
                recipe = "megascale"
                label = row["config"] + (":" + row.get("label", row.get("variant", "")) if "label" in row or
                                         row.get("variant", "default") != "default" else "")
            gpus = data["environment"]["num_devices"]
            impl = o.get("parallel.grouped_gemm", "pallas")
            out.append({"label": f"{name}:{label}", "file": name, "cfg": cfg, "gpus": gpus, "seq": row["seq_len"],
                        "plan": _plan_from_row(row, recipe), "system": systems.ours(impl),
                        "measured": row["tokens_per_s_median"]})
    return out


def compare() -> list[dict]:
    """Predicted vs measured tokens/s for every case; 'ok' is within TOLERANCE."""
    rows = []
    for c in cases():
        sh = wl.Shape.from_config(c["cfg"], c["seq"])
        cluster = hardware.make_cluster("h200", c["gpus"])
        est = cost.evaluate(sh, c["plan"], cluster, c["system"], cost.flops_per_token(c["cfg"]))
        err = est.tokens_per_s / c["measured"] - 1
        rows.append({"label": c["label"], "measured": c["measured"], "predicted": est.tokens_per_s,
                     "error": err, "ok": abs(err) <= TOLERANCE, "outlier": OUTLIERS.get(c["label"], ""),
                     "breakdown_ms": {k: v * 1e3 for k, v in est.breakdown.items()}, "step_ms": est.step_s * 1e3})
    return rows
