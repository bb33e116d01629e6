"""Plot the planner JSON: predicted vs reported throughput for the paper's strong-scaling table, the
predicted step-time breakdown per GPU count, and the predicted vs reported MegaScale / Megatron ratio.

    python -m megascale_jax.planner --write benchmarks/results/planner_paper.json
    python -m benchmarks.plot_planner benchmarks/results/planner_paper.json   # writes the .png beside it
"""
from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot(path: str) -> str:
    data = json.load(open(path))
    rows = data["paper_rows"]
    gpus = [r["gpus"] for r in rows]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.4))
    rep = [r["reported_tokens_per_s"] / 1e3 for r in rows]
    ax1.plot(gpus, rep, "ko-", label="MegaScale-MoE, reported")
    ax1.fill_between(gpus, [0.85 * x for x in rep], [1.15 * x for x in rep], color="k", alpha=0.08, label="±15%")
    ax1.plot(gpus, [r["megascale"]["tokens_per_s"] / 1e3 for r in rows], "C0s--", label="MegaScale-MoE, predicted")
    ax1.plot(gpus, [r["reported_tokens_per_s"] / r["reported_ratio"] / 1e3 for r in rows], "o-", color="0.5",
             label="Megatron-LM, reported (throughput / ratio)")
    ax1.plot(gpus, [r["megatron"]["tokens_per_s"] / 1e3 for r in rows], "C1s--", label="Megatron-LM, predicted")
    ours = data.get("ours_on_paper_cluster", {})
    if ours:
        ax1.plot(gpus, [ours[str(g)]["tokens_per_s"] / 1e3 for g in gpus], "C2^:", label="this code, predicted")
    ax1.set_xlabel("H800 GPUs")
    ax1.set_ylabel("tokens/s (thousands)")
    ax1.set_title("Internal-352B strong scaling (global batch 720 x 8192)")
    ax1.legend(fontsize=7)

    parts = [("compute", "compute"), ("exposed_comm", "exposed comm"), ("bubble", "pipeline bubble"),
             ("dp_sync", "DP sync"), ("optimizer", "optimizer"), ("pipeline_ticks", "per-tick overhead")]
    x = range(len(rows))
    for sysname, offset, hatch in (("megascale", -0.2, ""), ("megatron", 0.2, "//")):
        bottom = [0.0] * len(rows)
        steps = [r[sysname]["step_s"] for r in rows]
        for j, (key, label) in enumerate(parts):
            vals = [r[sysname]["breakdown_s"].get(key, 0.0) / t for r, t in zip(rows, steps)]
            ax2.bar([i + offset for i in x], vals, 0.38, bottom=bottom, color=f"C{j}", hatch=hatch,
                    label=label if sysname == "megascale" else None)
            bottom = [b + v for b, v in zip(bottom, vals)]
        for i, t in zip(x, steps):
            ax2.text(i + offset, 1.01, f"{t:.1f}s", ha="center", va="bottom", fontsize=6)
    ax2.set_xticks(list(x), [str(g) for g in gpus])
    ax2.set_xlabel("H800 GPUs (left bar MegaScale-MoE, hatched Megatron-LM)")
    ax2.set_ylabel("share of the predicted step (labels: step time)")
    ax2.set_ylim(0, 1.12)
    ax2.set_title("predicted breakdown per step")
    ax2.legend(fontsize=7)

    ax3.plot(gpus, [r["reported_ratio"] for r in rows], "ko-", label="reported")
    ax3.fill_between(gpus, [r["reported_ratio"] - 0.2 for r in rows], [r["reported_ratio"] + 0.2 for r in rows],
                     color="k", alpha=0.08, label="±0.2")
    ax3.plot(gpus, [r["ratio"] for r in rows], "C3s--", label="predicted")
    for s in data.get("sensitivity_1440", []):
        if s["what"].startswith("network 200"):
            ax3.plot([1440], [s["ratio"]], "C4v", label="predicted, 200 Gb/s network")
    ax3.set_xlabel("H800 GPUs")
    ax3.set_ylabel("MegaScale-MoE / Megatron-LM")
    ax3.set_ylim(1.0, 2.6)
    ax3.set_title("speed-up over Megatron-LM")
    ax3.legend(fontsize=7)
    out = path.rsplit(".", 1)[0] + ".png"
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return out


if __name__ == "__main__":
    print(plot(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/planner_paper.json"))
