"""Printed and JSON reports of the planner: the paper's Table 3 predicted, the diagnostics of diagnose.py, our
own measurements by role, and benchmarks/results/planner_paper.json."""
from __future__ import annotations

import json

from megascale_jax.planner import cost, diagnose, efficiency, hardware, measured, paper, search, systems
from megascale_jax.planner import workload as wl


def fmt_plan(p: cost.Plan, gpus: int) -> str:
    sched = f"{p.schedule}" + (f"/v{p.virtual_stages}" if p.virtual_stages > 1 else "") if p.pipe > 1 else "-"
    disp = {"all_to_all": "a2a", "all_gather": "ag"}[p.ep_dispatch] if wl.RECIPES[p.recipe][1] == "ep" and p.intra > 1 else "-"
    remat = f"partial({p.recompute_layers})" if p.remat == "partial" else p.remat
    return (f"{search.RECIPE_NAMES[p.recipe]:5s} n={p.intra} pp={p.pipe:<2d} dp={p.data(gpus):<3d} {sched:14s} "
            f"M={p.microbatches:<3d} b={p.microbatch_size(gpus)} {disp:3s} remat={remat:10s} "
            f"{'zero1' if p.optimizer_sharding == 'zero1' else 'repl.'}/{p.grad_comm}")


def print_paper_rows(gpu_counts) -> list[dict]:
    print(f"\nPaper comparison ({paper.SOURCE}); MegaScale-MoE and Megatron-LM priced as the paper describes them, "
          f"pipe={paper.PIPE}, intra={paper.INTRA}, network 400 Gb/s per GPU (assumed). MFU on 989 TFLOPS with "
          f"our FLOP count of the config's shape (= the paper's accounting, diagnose.flop_accounting):")
    print(f"  {'GPUs':>5s} {'MegaScale':>10s} {'reported':>9s} {'error':>6s} {'MFU pred/rep':>12s} "
          f"{'Megatron':>9s} {'reported':>9s} {'error':>6s} {'ratio':>6s} {'reported':>8s} {'diff':>6s}")
    rows = []
    for g in gpu_counts:
        r = paper.row(g)
        rows.append(r)
        print(f"  {g:5d} {r['megascale']['tokens_per_s'] / 1e3:9.1f}k {r['reported_tokens_per_s'] / 1e3:8.1f}k "
              f"{r['error'] * 100:+5.0f}% {r['megascale']['mfu'] * 100:5.1f}/{r['reported_mfu'] * 100:4.1f}% "
              f"{r['megatron']['tokens_per_s'] / 1e3:8.1f}k {r['reported_megatron_tokens_per_s'] / 1e3:8.1f}k "
              f"{r['megatron_error'] * 100:+5.0f}% {r['ratio']:6.2f} {r['reported_ratio']:8.2f} "
              f"{r['ratio_error']:+6.2f} {'ok' if r['within'] else 'OUT'}/{'ok' if r['ratio_within'] else 'OUT'}")
        print(f"        MegaScale: {fmt_plan(cost.Plan(**r['megascale']['plan']), g)}")
        print(f"        Megatron:  {fmt_plan(cost.Plan(**r['megatron']['plan']), g)}")
    return rows


def diagnostics() -> dict:
    structure = diagnose.table3_structure()
    return {"flop_accounting": diagnose.flop_accounting(), "table3_structure": structure,
            "layer_shares": diagnose.layer_shares(structure), "table5_ablation_240": diagnose.ablation_240(),
            "sensitivity_1440": diagnose.sensitivity(1440)}


def print_diagnostics(d: dict) -> None:
    fa = d["flop_accounting"]
    print("\nFLOPs per token implied by §6.1's MFU (x GPUs x 989 TFLOPS / Table 3 tokens/s): "
          + ", ".join(f"{g} GPUs {v / 1e9:.1f} G" for g, v in fa["implied_flops_per_token"].items()))
    for c in fa["candidates"]:
        print(f"  {c['accounting']:78s} {c['params'] / 1e9:6.1f} B params {c['flops_per_token'] / 1e9:6.1f} G "
              f"({c['vs_implied'] * 100:+5.1f}%)")
    st = d["table3_structure"]
    print(f"\nTable 3's structure (DIAGNOSTIC, reads the rows; nothing feeds a prediction): iteration s = intercept + "
          f"slope x sequences per replica {st['sequences_per_replica']}; model fitted the same way (1F1B, b=1):")
    for name in ("megascale", "megatron"):
        v = st[name]
        print(f"  {name:9s} reported slope {v['slope_s'] * 1e3:6.1f} ms/sequence/stage ({v['per_layer_sequence_ms']:5.1f}"
              f" ms per layer), intercept {v['intercept_s']:.2f} s (1F1B b=1 bubble would be "
              f"{v['intercept_if_1f1b_b1_s']:.2f}); model slope {v['model_slope_s'] * 1e3:6.1f} "
              f"({v['model_per_layer_sequence_ms']:5.1f} ms per layer), intercept {v['model_intercept_s']:.2f} s; "
              f"slope ratio {v['slope_ratio_reported_over_model']:.2f}")
    ls = d["layer_shares"]
    mix, big = ls["mixtral_8x7b_h800_model"], ls["internal_352b_h800_model"]
    print(f"\nFlashAttention + GroupedGEMM share of a layer (§7: 'about one-third', Mixtral-8x7B on 32 H800): model "
          f"{mix['fa_gg_share'] * 100:.0f}% for Mixtral-8x7B, {big['fa_gg_share'] * 100:.0f}% for Internal-352B "
          f"({big['layer']:.1f} ms per layer-sequence: grouped {big['grouped_gemm']:.1f}, dense {big['dense_gemm']:.1f}"
          f", attention {big['attention']:.1f}, elementwise {big['elementwise']:.1f}, comm {big['comm']:.1f} of which "
          f"exposed {big['comm_exposed']:.2f}); if Table 3's {ls.get('internal_352b_table3_implied_layer_ms', 0):.1f}"
          f" ms: {ls.get('internal_352b_share_if_table3', 0) * 100:.0f}%")
    print("\nTable 5 (240 GPUs), normalized throughput reported / predicted: " + "; ".join(
        f"{a['step']} {a['reported']:.2f} / {a['predicted']:.2f}" for a in d["table5_ablation_240"]))
    print("\nSensitivity at 1440 GPUs (one assumption moved at a time):")
    for s in d["sensitivity_1440"]:
        print(f"  {s['what'][:92]:92s} MegaScale {s['megascale'] / 1e3:7.1f}k ({s['megascale_change'] * 100:+4.0f}%, "
              f"{s['error_vs_reported'] * 100:+4.0f}% vs reported) Megatron {s['megatron'] / 1e3:7.1f}k ratio "
              f"{s['ratio']:.2f}")


def print_measured(rows) -> None:
    for r in rows:
        flag = "ok" if r["ok"] else ("outlier (documented)" if r["outlier"] else "OUTSIDE")
        cv = f" cv {r['error_cv'] * 100:+6.1f}%" if r["role"] == "derivation" else " " * 11
        print(f"  {r['label']:56s} {r['role']:10s} measured {r['measured']:9.0f} predicted {r['predicted']:9.0f} "
              f"{r['error'] * 100:+6.1f}%{cv} {flag}")
    s = measured.summary(rows)
    for key, label in (("derivation_in_sample", "derivation rows, in sample"),
                       ("derivation_leave_one_config_out", "derivation rows, leave-one-config-out"),
                       ("held_out", "held-out rows")):
        v = s[key]
        print(f"  {label:40s} n={v['n']:2d} mean |error| {v['mean_abs'] * 100:4.1f}% max {v['max_abs'] * 100:4.1f}% "
              f"within 15%: {v['within']}/{v['n']}")


def explain() -> None:
    print("\nParameters and their sources:")
    for name, value, src in sources():
        print(f"  {name:34s} {value:>28s}  {src}")


def sources() -> list[tuple[str, str, str]]:
    return hardware.hardware_sources() + efficiency.efficiency_sources() + [
        ("overlap fused", f"{systems.FUSED:g}", systems.OVERLAP_SOURCE["fused"]),
        ("overlap inter_op", f"{systems.INTER_OP:g}", systems.OVERLAP_SOURCE["inter_op"]),
        ("Megatron-LM DP/PP overlap", f"{systems.INTER_OP:g}", systems.MEGATRON_DP_PP_SOURCE),
        ("paper network", "400 Gb/s per GPU", "assumption (not disclosed; Appendix A.1's typical 50 GB/s NIC); "
                                              "200 and 800 Gb/s in the sensitivity table"),
        ("Internal-352B shape", "Table 2 + 1 shared expert", "configs/internal_352b.py docstring: 352 B params "
                                                             "and §6.1's MFU (diagnose.flop_accounting)")]


def write_results(path: str) -> dict:
    rows = [paper.row(g) for g in paper.ROWS]
    comparison = measured.compare()
    diag = diagnostics()
    out = {"benchmark": "planner", "paper_source": paper.SOURCE, "paper_rows": rows,
           "paper_rows_1f1b": [paper.row(g, schedule="1f1b") for g in paper.ROWS],
           "ours_on_paper_cluster": {g: paper.ours_row(g) for g in paper.ROWS},
           "sensitivity_1440": diag.pop("sensitivity_1440"), "diagnostics": diag,
           "mixtral_8x7b_8xh200": {"zero_tail_kernel (today)": paper.mixtral_8xh200(True),
                                   "zero_tail_mask (tail skipped)": paper.mixtral_8xh200(False)},
           "measured_comparison": comparison, "measured_summary": measured.summary(comparison),
           "derivation_rows": efficiency.derivation_labels(),
           "sources": [{"parameter": a, "value": b, "source": c} for a, b, c in sources()],
           "assumptions": {"overlap_fused": systems.FUSED, "overlap_inter_op": systems.INTER_OP,
                           "paper_network_gbit": 400, "usable_hbm_fraction": hardware.USABLE_HBM_FRACTION}}
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1, default=float)
    return out
