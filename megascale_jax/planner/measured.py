"""The planner against our own measurements: every committed tokens/s in benchmarks/results that a plan
describes (one-GPU train steps, the 2-GPU plan comparison, the 2-GPU pipeline runs), predicted by the cost
model with this code's system (`systems.ours`) on H200s.

Circularity, made explicit. Six parameters (attention rate, elementwise efficiency, EP tail cost, NVLink
latency + bandwidth, XLA overlap per recipe, host gap) are read off the profiles of the ten plans_2xh200.json
runs (efficiency.py); those runs are the "derivation" rows, and their in-sample error says little. Each row
therefore carries:
  error           prediction with every parameter derived from all profiled runs (what the planner uses)
  role            'derivation' (its profile fed the parameters) or 'held_out' (no parameter read from it)
  error_cv        derivation rows only: prediction with every profile-derived parameter re-derived WITHOUT
                  the runs of the row's own config (mixtral_small <-> deepseekmoe_small), a leave-one-config-
                  out check; for held-out rows it equals `error`
Kernel rates come from microbenchmarks (grouped_gemm_*.json), not from any row here.

Outliers are listed in OUTLIERS with the reason read from the profile data; nothing else is excluded.
"""
from __future__ import annotations

import statistics

from megascale_jax.planner import cost, efficiency, hardware, systems
from megascale_jax.planner import workload as wl

FILES = ("train_mixtral_small_1xh200.json", "train_tiny_1xh200.json", "plans_2xh200.json",
         "pipeline_2xh200.json", "train_step_1xh200.json", "train_remat_1xh200.json")
TOLERANCE = 0.15

# Remat of the configs when the runs were made (mixtral_small / deepseekmoe_small set remat='full', tiny_cpu
# keeps base's 'none'; commits 7783765, 8004cfe, 41c7dee); pinned so a later config edit cannot move the check.
MEASURED_REMAT = {"mixtral_small": "full", "deepseekmoe_small": "full", "tiny_cpu": "none"}
# train_step_1xh200.json: only the runs of main's committed defaults (run '4_main_defaults', 2026-12-01: remat
# 'none', layer loop unrolled, per the file's description); the earlier runs in that file are sweeps of code
# states that no longer exist (scanned loop, older permutations), which the model has no knob for.
TRAIN_STEP_RUNS = {"4_main_defaults": "none"}
# train_remat_1xh200.json: remat none vs selective at 16 / 32 x 4096 (each row sets train.remat); only the run of
# the code that keeps cuDNN's softmax statistics (run 1's selective reran the attention forward).
REMAT_RUNS = ("2_cudnn_stats_kept",)

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


def _plan_from_row(row, recipe: str, remat: str) -> cost.Plan:
    o = row["overrides"]
    return cost.Plan(recipe=recipe, intra=o.get("parallel.intra", 1), pipe=o.get("parallel.pipe", 1),
                     schedule=o.get("parallel.pipeline_schedule", "1f1b") if o.get("parallel.pipe", 1) > 1 else "1f1b",
                     microbatches=o.get("parallel.num_microbatches", o.get("train.microbatches", 1)), remat=remat,
                     global_batch=row["global_batch"])


def _rows(name: str, data: dict):
    """(label suffix, row, remat) for the rows of one results file that the model describes."""
    if name == "train_step_1xh200.json":
        for row in data["runs"]:
            if row.get("run") in TRAIN_STEP_RUNS:
                yield f"{row['config']}:{row['variant']}", row, TRAIN_STEP_RUNS[row["run"]]
        return
    if name == "train_remat_1xh200.json":
        for row in data["results"]:
            if row.get("run") in REMAT_RUNS and "tokens_per_s_median" in row:
                yield f"{row['config']}:{row['variant']}", row, row["overrides"]["train.remat"]
        return
    for row in data["results"]:
        if "tokens_per_s_median" not in row:
            continue
        if name == "plans_2xh200.json":
            label = f"{row['config']}:{row['plan']}"
        else:
            label = row["config"] + (":" + row.get("label", row.get("variant", "")) if "label" in row or
                                     row.get("variant", "default") != "default" else "")
        yield label, row, MEASURED_REMAT[row["config"]]


def cases() -> list[dict]:
    """[{label, file, plan, cfg, gpus, impl, measured}] for every measured run a plan describes."""
    from megascale_jax.config import default_config
    out = []
    for name in FILES:
        data = efficiency._load(name)
        for label, row, remat in _rows(name, data):
            cfg = default_config(row["config"])
            recipe = efficiency.PLAN_NAMES[row["plan"]] if name == "plans_2xh200.json" else "megascale"
            env = data.get("environment") or row.get("environment") or {}
            out.append({"label": f"{name}:{label}", "file": name, "cfg": cfg, "config": row["config"],
                        "gpus": env.get("num_devices", 1), "seq": row["seq_len"],
                        "plan": _plan_from_row(row, recipe, remat),
                        "impl": row["overrides"].get("parallel.grouped_gemm", "pallas"),
                        "measured": row["tokens_per_s_median"]})
    return out


def _predict(c) -> cost.Estimate:
    sh = wl.Shape.from_config(c["cfg"], c["seq"])
    cluster = hardware.make_cluster("h200", c["gpus"])
    return cost.evaluate(sh, c["plan"], cluster, systems.ours(c["impl"]), cost.flops_per_token(c["cfg"]))


def compare() -> list[dict]:
    """Predicted vs measured tokens/s for every case; 'ok' is within TOLERANCE (of the in-sample prediction)."""
    derivation = set(efficiency.derivation_labels())
    rows = []
    for c in cases():
        est = _predict(c)
        err = est.tokens_per_s / c["measured"] - 1
        role = "derivation" if c["label"] in derivation else "held_out"
        rows.append({"label": c["label"], "config": c["config"], "role": role, "measured": c["measured"],
                     "predicted": est.tokens_per_s, "error": err, "error_cv": err,
                     "ok": abs(err) <= TOLERANCE, "outlier": OUTLIERS.get(c["label"], ""),
                     "breakdown_ms": {k: v * 1e3 for k, v in est.breakdown.items()}, "step_ms": est.step_s * 1e3})
    by_label = {c["label"]: c for c in cases()}
    for config in sorted({r["config"] for r in rows if r["role"] == "derivation"}):
        with efficiency.derived_without(config):
            for r in rows:
                if r["role"] == "derivation" and r["config"] == config:
                    cv = _predict(by_label[r["label"]]).tokens_per_s
                    r["predicted_cv"], r["error_cv"] = cv, cv / r["measured"] - 1
    return rows


def summary(rows=None) -> dict:
    """Mean / max |error| per role: in-sample (derivation), leave-one-config-out (derivation, cv), held-out;
    outliers reported apart."""
    rows = rows if rows is not None else compare()

    def stats(errs):
        errs = [abs(e) for e in errs]
        return {"n": len(errs), "mean_abs": statistics.mean(errs) if errs else None,
                "max_abs": max(errs) if errs else None,
                "within": int(sum(e <= TOLERANCE for e in errs))}

    keep = [r for r in rows if not r["outlier"]]
    return {"derivation_in_sample": stats([r["error"] for r in keep if r["role"] == "derivation"]),
            "derivation_leave_one_config_out": stats([r["error_cv"] for r in keep if r["role"] == "derivation"]),
            "held_out": stats([r["error"] for r in keep if r["role"] == "held_out"]),
            "outliers": {r["label"]: r["error"] for r in rows if r["outlier"]}}
