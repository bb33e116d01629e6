"""Bar chart of benchmarks/results/grouped_gemm_h200.json: TFLOP/s per shape and implementation.

    python benchmarks/plot_grouped_gemm.py benchmarks/results/grouped_gemm_h200.json
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

IMPLS = ["ours", "torch_grouped_mm", "jax_ragged_dot_mgpu", "xla_ragged_dot", "dense_same_flops"]


def value(tflops, impl, kind):
    for label, v in tflops.items():
        if label.split("[")[0].split("/")[0] == impl and label.endswith("/" + kind) and "ours[" not in label:
            return v or 0.0
    return 0.0


def main(path):
    data = json.load(open(path))
    rows = data["results"]
    names = [f"{r['shape']}\n{r['routing']}" for r in rows]
    fig, axes = plt.subplots(2, 1, figsize=(16, 9), sharex=True)
    width = 0.8 / len(IMPLS)
    for ax, kind in zip(axes, ["fwd", "fwd+bwd"]):
        for i, impl in enumerate(IMPLS):
            vals = [value(r["tflops"], impl, kind) for r in rows]
            ax.bar(np.arange(len(rows)) + i * width, vals, width, label=impl)
        ax.set_ylabel(f"{kind} TFLOP/s")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(ncol=len(IMPLS), fontsize=8)
    axes[1].set_xticks(np.arange(len(rows)) + 0.4, names, rotation=60, fontsize=7)
    env = data["environment"]
    fig.suptitle(f"Grouped GEMM, bf16, {env['device']}, jax {env['jax']}, torch {env.get('torch')}")
    fig.tight_layout()
    out = path.rsplit(".", 1)[0] + ".png"
    fig.savefig(out, dpi=90)
    print(out)


if __name__ == "__main__":
    main(sys.argv[1])
