"""Bar chart of a bench_plans JSON: tokens/s and MFU per plan, one group per config.

    python -m benchmarks.plot_plans benchmarks/results/plans_2xh200.json   # writes the .png beside it
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
    configs = list(dict.fromkeys(r["config"] for r in rows))
    plans = list(dict.fromkeys(r["plan"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(plans)
    for j, plan in enumerate(plans):
        for i, cfg in enumerate(configs):
            match = [r for r in rows if r["config"] == cfg and r["plan"] == plan]
            if not match:
                continue
            r = match[0]
            x = i + j * width
            ax.bar(x, r["tokens_per_s_median"] / 1e3, width, color=f"C{j}", label=plan if i == 0 else None)
            ax.text(x, r["tokens_per_s_median"] / 1e3, f"{100 * r['mfu']:.0f}%", ha="center", va="bottom",
                    fontsize=7)
    env = data["environment"]
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(configs))], configs)
    ax.set_ylabel("tokens/s (thousands); labels: MFU")
    ax.set_title(f"plans on {env['num_devices']} x {env['device_kind']}, intra = {data.get('intra')}")
    ax.legend()
    out = path.rsplit(".", 1)[0] + ".png"
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return out


if __name__ == "__main__":
    print(plot(sys.argv[1]))
