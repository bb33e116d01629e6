"""Two panels from a bench_pipeline JSON: tokens/s per schedule against microbatches (data-parallel baseline as a
line), and the measured bubble (from the fitted tick time) against the formula (S-1)/(M+S-1).

    python -m benchmarks.plot_pipeline benchmarks/results/pipeline_2xh200.json   # writes the .png beside it
"""
from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot(path: str) -> str:
    data = json.load(open(path))
    rows = [r for r in data["results"] if r.get("tokens_per_s_median")]
    schedules = list(dict.fromkeys(r["schedule"] for r in rows if "schedule" in r))
    fig, (ax_rate, ax_bubble) = plt.subplots(1, 2, figsize=(10, 4))
    for schedule in schedules:
        mine = sorted((r for r in rows if r.get("schedule") == schedule), key=lambda r: r["num_microbatches"])
        ms = [r["num_microbatches"] for r in mine]
        ax_rate.plot(ms, [r["tokens_per_s_median"] / 1e3 for r in mine], "o-", label=schedule)
        measured = data["fits"].get(schedule, {}).get("measured_bubble", {})
        ax_bubble.plot(ms, [measured.get(str(m)) for m in ms], "o-", label=f"{schedule} measured")
        ax_bubble.plot(ms, [r["bubble_formula"] for r in mine], "k--", alpha=0.4)
    for r in rows:
        if r.get("label") == "data_parallel":
            ax_rate.axhline(r["tokens_per_s_median"] / 1e3, color="gray", ls=":",
                            label=f"data parallel (batch {r['global_batch']})")
    ticks = sorted({r["num_microbatches"] for r in rows if "num_microbatches" in r})
    ax_rate.set(xlabel="microbatches", ylabel="tokens/s (thousands)", xticks=ticks)
    ax_bubble.set(xlabel="microbatches", ylabel="bubble fraction (dashed: (S-1)/(M+S-1))", xticks=ticks)
    ax_rate.legend(fontsize=8)
    ax_bubble.legend(fontsize=8)
    env = data["environment"]
    fig.suptitle(f"{data['config']}: {data['stages']} pipeline stages on {env['num_devices']} x {env['device_kind']}")
    fig.tight_layout()
    out = path.rsplit(".", 1)[0] + ".png"
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    print(plot(sys.argv[1]))
