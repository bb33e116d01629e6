"""Grouped bar charts of a bench_grouped_gemm JSON: one panel per shape, bars per implementation, grouped by
routing, forward (solid) then forward+backward (hatched); the ours / torch._grouped_mm ratio over our bars.

    python benchmarks/plot_grouped_gemm.py benchmarks/results/grouped_gemm_h200.json [out.png]
    python benchmarks/plot_grouped_gemm.py $OUT/grouped_gemm_table.json     # --suite issue10 output

Works for every JSON the benchmark writes (--mode smoke/full, --suite issue10/tiny); missing numbers are
left out (no bar).
"""
import json
import math
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

IMPLS = ["ours", "torch_grouped_mm", "dense_same_flops", "ours_mask_tail", "jax_ragged_dot_mgpu",
         "xla_ragged_dot", "tokamax_mosaic_autotuned"]
COLORS = {"ours": "tab:blue", "torch_grouped_mm": "tab:orange", "dense_same_flops": "tab:gray",
          "ours_mask_tail": "tab:cyan", "jax_ragged_dot_mgpu": "tab:green", "xla_ragged_dot": "tab:red",
          "tokamax_mosaic_autotuned": "tab:purple"}
KINDS = ["fwd", "fwd+bwd"]


def value(tflops, impl, kind):
    """TFLOP/s of `impl` (label base, e.g. 'jax_ragged_dot_mgpu' for 'jax_ragged_dot_mgpu[4]/fwd'), or None;
    the tiling sweep's 'ours[...]' labels are not 'ours'."""
    for label, v in tflops.items():
        if label.split("/")[0].split("[")[0] == impl and label.endswith("/" + kind) and "ours[" not in label:
            return v
    return None


def main(path, out=None):
    data = json.load(open(path))
    rows = data["results"]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    impls = [i for i in IMPLS if any(value(r["tflops"], i, k) for r in rows for k in KINDS)]
    ncols = min(3, len(shapes))
    nrows = math.ceil(len(shapes) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.4 * ncols, 3.9 * nrows), squeeze=False)
    width = 0.8 / max(len(impls), 1)
    top = max([v or 0 for r in rows for v in r["tflops"].values() if isinstance(v, (int, float))] + [1.0])
    for ax, shape in zip(axes.flat, shapes):
        srows = [r for r in rows if r["shape"] == shape]
        groups = [(r, kind) for kind in KINDS for r in srows]   # all routings' fwd, then their fwd+bwd
        xs = np.arange(len(groups)) + np.array([0.5 if kind == "fwd+bwd" else 0.0 for _, kind in groups])
        for i, impl in enumerate(impls):
            vals = [value(r["tflops"], impl, kind) for r, kind in groups]
            for x, (r, kind), v in zip(xs, groups, vals):
                if v is None:
                    continue
                ax.bar(x + i * width, v, width, color=COLORS[impl], hatch="//" if kind == "fwd+bwd" else None,
                       edgecolor="white", linewidth=0.3, label=impl if (x, kind) == (xs[0], groups[0][1]) else None)
                torch_v = value(r["tflops"], "torch_grouped_mm", kind)
                if impl == "ours" and torch_v:
                    ax.text(x + i * width, v + top * 0.01, f"{v / torch_v:.2f}x", ha="center", va="bottom",
                            fontsize=6, rotation=90)
        r0 = srows[0]
        ax.set_title(f"{shape}: M={r0['M']} K={r0['K']} N={r0['N']} G={r0['G']}", fontsize=9)
        ax.set_xticks(xs + 0.4 - width / 2, [f"{r['routing']}\n{kind}" for r, kind in groups], fontsize=7)
        ax.set_ylim(0, top * 1.15)
        ax.set_ylabel("TFLOP/s (useful FLOPs)", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    for ax in list(axes.flat)[len(shapes):]:
        ax.set_visible(False)
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[i]) for i in impls]
    handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="black", hatch="//"))
    fig.legend(handles, impls + ["fwd+bwd (hatched)"], loc="upper right", ncol=len(impls) + 1, fontsize=8)
    env = data.get("environment", {})
    fig.suptitle(f"Grouped GEMM, bf16, {env.get('device')}, jax {env.get('jax')}, torch {env.get('torch')}"
                 f"  (label over ours: ours / torch._grouped_mm)", x=0.01, ha="left", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    out = out or path.rsplit(".", 1)[0] + ".png"
    fig.savefig(out, dpi=90)
    print(out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
