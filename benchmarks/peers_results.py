"""bench_peers.py's verdicts on the two goals (ours against the dense-equivalent bound, and against torchtitan),
the peers.json document assembled from the per-variant results, and the text table printed at the end."""
from __future__ import annotations

import dataclasses

from benchmarks.peers_plan import PEAK_TFLOPS, VARIANTS, Shapes, layer_flops_fwd, rate, train_flops

GOAL_BOUND = 0.95            # ours >= 0.95 x the same-run dense-equivalent bound
GOAL_TORCHTITAN = 1.15       # ours >= 1.15 x torchtitan (and > 1.0 to be "ahead")


def verdicts(results: dict, shapes: Shapes) -> dict:
    """The two goals, from per-variant results {name: {"ms": ...}}."""
    def ms(name):
        r = results.get(name) or {}
        return r.get("ms") if r.get("ok") else None

    ours, bound, tt = ms("ours_block"), ms("stock_bound"), ms("torchtitan_block")
    out = {"ours_over_bound": (bound / ours) if ours and bound else None,
           "ours_over_torchtitan": (tt / ours) if ours and tt else None}
    o2, t2 = ms("ours_2layer"), ms("torchtitan_2layer")
    out["ours_over_torchtitan_2layer"] = (t2 / o2) if o2 and t2 else None
    # MaxText: its faster dropless path of the two that ran (which one is named)
    mt = min(((ms(nm), nm) for nm in ("maxtext_block", "maxtext_block_tokamax") if ms(nm)), default=(None, None))
    out["ours_over_maxtext"] = (mt[0] / ours) if ours and mt[0] else None
    out["maxtext_fastest"] = mt[1]
    grid = ms("ours_block_grid_tiles")   # the same block, row tiles on one grid (the A/B of the tile layout)
    out["ours_grid_tiles_over_ours"] = (grid / ours) if grid and ours else None
    dense = ms("jax_dense_gemm")
    if dense and ours:
        n = 8192
        dense_tflops = 2 * n ** 3 / (dense * 1e-3) / 1e12
        out["ours_over_same_run_dense_gemm_rate"] = rate(train_flops(shapes), ours)["tflops"] / dense_tflops
    r = out["ours_over_bound"]
    out["goal_bound"] = {"target": f">= {GOAL_BOUND}x the same-run dense-equivalent bound (stock_bound)",
                         "ratio": r, "met": None if r is None else r >= GOAL_BOUND}
    r = out["ours_over_torchtitan"]
    out["goal_torchtitan"] = {"target": f"ahead of torchtitan's block (> 1.0x; goal >= {GOAL_TORCHTITAN}x)",
                              "ratio": r, "ahead": None if r is None else r > 1.0,
                              "met": None if r is None else r >= GOAL_TORCHTITAN}
    return out


def assemble(results: dict, shapes: Shapes, env: dict, notes: list, tiny: bool) -> dict:
    variants = {}
    for name, worker, desc, layers in VARIANTS:
        r = dict(results.get(name) or {"ok": False, "skipped": "not run (budget, not selected, or crashed)"})
        r.setdefault("description", desc)
        r["worker"] = worker
        if r.get("ok") and layers:
            r.update(rate(train_flops(shapes, layers), r["ms"]))
            r["layers"] = layers
        elif r.get("ok") and name.endswith("dense_gemm"):
            n = r.get("n", 8192)
            r.update(rate(2.0 * n ** 3, r["ms"]))
        variants[name] = r
    f = layer_flops_fwd(shapes)
    return {"benchmark": "bench_peers", "tiny": tiny, "environment": env,
            "shapes": dataclasses.asdict(shapes) | {"tokens": shapes.tokens,
                                                     "layout": f"{shapes.batch} x {shapes.seq}"},
            "flops": {"per_layer_fwd": f, "per_layer_fwd_bwd": train_flops(shapes),
                      "convention": "megascale_jax/model/accounting.py: 2/active matmul param/token (proj, "
                                    "top-k experts, router) + attention core 2*S*H*K/token (causal-halved); "
                                    "fwd+bwd = 3x fwd; every variant charged the same model FLOPs"},
            "peak_tflops": PEAK_TFLOPS, "variants": variants, "verdicts": verdicts(results, shapes),
            "notes": notes}


def table(doc: dict) -> str:
    rows = [f"{'variant':20s} {'ms':>9s} {'TFLOP/s':>8s} {'MFU':>6s}  note"]
    for name, r in doc["variants"].items():
        if r.get("ok"):
            tf = f"{r['tflops']:.0f}" if r.get("tflops") is not None else "-"
            mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
            rows.append(f"{name:20s} {r['ms']:9.3f} {tf:>8s} {mfu:>6s}  {r.get('extra', '')}")
        else:
            why = r.get("error") or r.get("skipped") or "?"
            rows.append(f"{name:20s} {'-':>9s} {'-':>8s} {'-':>6s}  {why[:110]}")
    v = doc["verdicts"]

    def fmt(x):
        return "n/a" if x is None else f"{x:.3f}x"
    rows.append(f"ours / bound          = {fmt(v['ours_over_bound'])}  goal >= {GOAL_BOUND}: "
                f"{v['goal_bound']['met']}")
    rows.append(f"ours / torchtitan     = {fmt(v['ours_over_torchtitan'])}  ahead: {v['goal_torchtitan']['ahead']}"
                f"; goal >= {GOAL_TORCHTITAN}: {v['goal_torchtitan']['met']}")
    rows.append(f"ours / torchtitan 2L  = {fmt(v['ours_over_torchtitan_2layer'])}")
    rows.append(f"ours / MaxText        = {fmt(v['ours_over_maxtext'])}  (its faster variant: {v['maxtext_fastest']})")
    return "\n".join(rows)
