"""Bar chart of benchmarks/bench_peers.py's JSON: TFLOP/s (and MFU vs 989) per variant, same-run dense GEMM rates
as dashed lines, the two goal ratios in the title.

    python3 benchmarks/plot_peers.py benchmarks/results/peers_1xh200.json [out.png]
"""
from __future__ import annotations

import json
import sys

BLOCK_ORDER = ["ours_block", "ours_block_grid_tiles", "stock_bound", "torchtitan_block", "stock_capacity",
               "stock_ragged", "maxtext_block", "maxtext_block_tokamax", "ours_2layer", "torchtitan_2layer"]


def bars(doc: dict) -> list[tuple[str, float, float]]:
    """(name, TFLOP/s, MFU) of the measured block variants, in a fixed order."""
    out = []
    for name in BLOCK_ORDER:
        r = doc["variants"].get(name) or {}
        if r.get("ok") and r.get("tflops") is not None:
            out.append((name, r["tflops"], r["mfu"]))
    return out


def plot(doc: dict, path: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = bars(doc)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    colors = {"ours": "tab:blue", "stock": "tab:gray", "torchtitan": "tab:orange", "maxtext": "tab:green"}
    names = [d[0] for d in data]
    ax.bar(names, [d[1] for d in data], color=[colors.get(n.split("_")[0], "tab:gray") for n in names])
    for i, (_, tf, mfu) in enumerate(data):
        ax.text(i, tf, f"{tf:.0f}\n{mfu:.1%}", ha="center", va="bottom", fontsize=8)
    for key, style in (("jax_dense_gemm", "--"), ("torch_dense_gemm", ":")):
        r = doc["variants"].get(key) or {}
        if r.get("ok") and r.get("tflops"):
            ax.axhline(r["tflops"], ls=style, color="k", lw=0.8, label=f"{key} {r['tflops']:.0f}")
    v = doc["verdicts"]

    def fmt(x):
        return "n/a" if x is None else f"{x:.2f}x"
    s = doc["shapes"]
    ax.set_title(f"Mixtral-shaped block fwd+bwd, {s['layout']} tokens, {(doc['environment'].get('jax') or {}).get('device_kind', '')}\n"
                 f"ours/bound {fmt(v['ours_over_bound'])} (goal 0.95), ours/torchtitan "
                 f"{fmt(v['ours_over_torchtitan'])} (goal 1.15), ours/MaxText {fmt(v.get('ours_over_maxtext'))}",
                 fontsize=9)
    ax.set_ylabel("TFLOP/s (model FLOPs)")
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    src = argv[0] if argv else "benchmarks/results/peers_1xh200.json"
    dst = argv[1] if len(argv) > 1 else src.rsplit(".", 1)[0] + ".png"
    with open(src) as f:
        doc = json.load(f)
    print(plot(doc, dst))


if __name__ == "__main__":
    main()
