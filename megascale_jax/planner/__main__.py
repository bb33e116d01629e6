"""Planner CLI: rank the parallel plans for a model on a cluster, print the best with their predicted tokens/s,
MFU, step breakdown and memory, the Megatron-style baseline and the ratios, and the config overrides.

    python -m megascale_jax.planner --config configs/internal_352b.py --gpus 1440 --gpu h800 --global-batch 720
    python -m megascale_jax.planner --config configs/mixtral_8x7b.py --gpus 8 --gpu h200 --emit
    python -m megascale_jax.planner --paper-table --explain      # the paper's rows, sensitivity, sources
    python -m megascale_jax.planner --write benchmarks/results/planner_paper.json
"""
from __future__ import annotations

import argparse
import os

from megascale_jax.planner import cost, hardware, measured, paper, report, search, systems
from megascale_jax.planner import workload as wl

SYSTEMS = {"ours": systems.ours, "megascale": systems.megascale, "megatron": systems.megatron}


def _fmt_est(e: cost.Estimate, gpus: int) -> str:
    b = e.breakdown
    other = b["dp_sync"] + b["optimizer"] + b["host"]
    ticks = f" + ticks {b['pipeline_ticks']:.3f}" if b["pipeline_ticks"] else ""
    return (f"{report.fmt_plan(e.plan, gpus)} | {e.tokens_per_s / 1e3:8.1f}k tok/s MFU {e.mfu * 100:4.1f}% | step "
            f"{e.step_s:7.3f}s = compute {b['compute']:.3f} + comm {b['exposed_comm']:.3f} + bubble "
            f"{b['bubble']:.3f}{ticks} + dp/opt {other:.3f} | mem {e.memory_gb['total']:5.1f}/"
            f"{e.memory_gb['usable']:.0f} GB")


def _config_name(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


def plan_cluster(args) -> None:
    from megascale_jax.config import default_config
    over = {}
    if args.global_batch:
        over["train.global_batch"] = args.global_batch
    if args.seq_len:
        over["train.seq_len"] = args.seq_len
    cfg = default_config(_config_name(args.config), **over)
    sh, fpt = wl.Shape.from_config(cfg), cost.flops_per_token(cfg)
    cluster = hardware.make_cluster(args.gpu, args.gpus, args.gpus_per_node, args.net_gbit)
    # Our own system as the config sets it up; the others are as their papers describe them.
    system = (systems.ours(moments_dtype=cfg.train.adam_moments_dtype) if args.system == "ours"
              else SYSTEMS[args.system]())
    gb = cfg.train.global_batch
    print(f"model {cfg.name}: {sh.layers} layers, h {sh.h}, {sh.experts} experts top-{sh.top_k}, seq {sh.seq}, "
          f"{fpt / 1e9:.1f} GFLOP/token; global batch {gb} sequences")
    print(f"cluster: {cluster.num_gpus} x {cluster.gpu.name} ({cluster.nodes} node(s) x {cluster.gpus_per_node}), "
          f"network {cluster.net_gbit:g} Gb/s per GPU; system '{system.name}': {system.notes}")
    fits, excluded = search.rank(sh, cluster, system, gb, fpt)
    print(f"\n{len(fits)} plans fit, {len(excluded)} excluded by memory. Best {args.top}:")
    for e in fits[:args.top]:
        print("  " + _fmt_est(e, cluster.num_gpus))
    node = min(cluster.gpus_per_node, cluster.num_gpus)
    print(f"\nbest per layout at intra={node} (same system):")
    best = {}
    for r in wl.RECIPES:
        e = next((x for x in fits if x.plan.recipe == r and x.plan.intra == node), None)
        if e:
            best[r] = e
            print(f"  {_fmt_est(e, cluster.num_gpus)}")
    base_sys = systems.baseline_for(system)
    base_fits, _ = search.rank(sh, cluster, base_sys, gb, fpt, ["megatron_tp"], {"grad_comm": "fp32", "intra": node})
    if fits and base_fits:
        base = base_fits[0]
        print(f"\nMegatron-style baseline (TP inside the node, no SP+EP, no overlap, fp32 gradients; system "
              f"'{base_sys.name}'):\n  {_fmt_est(base, cluster.num_gpus)}")
        print(f"ratios: best / baseline {fits[0].tokens_per_s / base.tokens_per_s:.2f}"
              + (f"; SP+EP / TP+TP (same system) {best['megascale'].tokens_per_s / best['megatron_tp'].tokens_per_s:.2f}"
                 if "megascale" in best and "megatron_tp" in best else ""))
    if excluded:
        seen = []
        for e in excluded:
            if len(seen) == 3:
                break
            seen.append(f"{report.fmt_plan(e.plan, cluster.num_gpus)}: {e.reason}")
        print("\nexcluded, e.g.:\n  " + "\n  ".join(seen))
    if fits and fits[0].notes:
        print("\nnote on the best plan: " + "; ".join(fits[0].notes))
    if fits:
        print("\nbest plan as overrides:\n  python -m megascale_jax.train --config " + args.config + " "
              + " ".join(search.overrides(fits[0].plan)))
    if (cfg.name, args.gpu, gb, sh.seq) == (paper.CONFIG, paper.GPU, paper.GLOBAL_BATCH, paper.SEQ) \
            and args.gpus in paper.ROWS:
        report.print_paper_rows([args.gpus])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/internal_352b.py", help="configs/<name>.py or <name>")
    ap.add_argument("--gpus", type=int, default=1440)
    ap.add_argument("--gpu", default="h800", choices=sorted(hardware.GPUS))
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--net-gbit", type=float, default=None, help="network per GPU (default: the GPU's typical)")
    ap.add_argument("--global-batch", type=int, default=0, help="sequences per step (default: the config's)")
    ap.add_argument("--seq-len", type=int, default=0)
    ap.add_argument("--system", default="ours", choices=sorted(SYSTEMS),
                    help="ours = this code as measured (its plans are what --emit prints); megascale / megatron "
                         "= the paper's systems")
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--emit", action="store_true", help="print the best plan as train overrides (always shown)")
    ap.add_argument("--explain", action="store_true", help="print every parameter with its source")
    ap.add_argument("--paper-table", action="store_true",
                    help="all five paper rows, the diagnostics of each factor and the sensitivity (diagnose.py)")
    ap.add_argument("--measured", action="store_true",
                    help="predictions vs our committed measurements, by role (derivation / held out)")
    ap.add_argument("--write", default="", help="write the planner JSON (paper rows, Mixtral choice, ...)")
    args = ap.parse_args()
    if args.paper_table:
        report.print_paper_rows(list(paper.ROWS))
        report.print_diagnostics(report.diagnostics())
    elif args.measured:
        report.print_measured(measured.compare())
    elif args.write:
        report.write_results(args.write)
        print(f"wrote {args.write}")
    else:
        plan_cluster(args)
    if args.explain:
        report.explain()


if __name__ == "__main__":
    main()
