"""Communication of each plan (the manual ones and XLA's propagation), read from compiled HLO (no GPU): elements and bytes one device sends per
MoE layer forward, by component, next to the paper's closed forms. Explains the measured plan ratios.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m benchmarks.analyze_plans \
        --config mixtral_small --intra 2 --out benchmarks/results/analyzer_mixtral_small_n2.json

Bytes are as XLA:CPU sends them (f32 on the wire); a GPU sends the bf16 compute dtype, half of that.
"""
from __future__ import annotations

import argparse

import jax

from benchmarks.bench_plans import PLANS
from benchmarks.bench_train import _parse_overrides, write_json
from benchmarks.environment import environment
from megascale_jax.analyze import analyze
from megascale_jax.config import default_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="mixtral_small")
    ap.add_argument("--intra", type=int, default=0, help="0 = all devices")
    ap.add_argument("--set", default="", help="extra overrides key=value,...")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    intra = args.intra or jax.device_count()
    rows, forms = {}, None
    for plan, overrides in PLANS.items():   # 'xla': what the SPMD partitioner inserts (XLA:CPU's choice)
        cfg = default_config(args.config, num_devices=jax.device_count(), **{
            "parallel.intra": intra, **overrides, **_parse_overrides(args.set)})
        report = analyze(cfg, full_step=False)
        forms = report["closed_forms"]
        rows[plan] = {part: {"wire_elements": v["wire_elements"], "wire_bytes_cpu": v["wire_bytes"], "ops": v["ops"]}
                      for part, v in report["per_layer_forward"].items()}
        print(plan, {part: round(v["wire_elements"] / 1e6, 2) for part, v in rows[plan].items()}, "M elements")
    write_json(args.out, {"benchmark": "analyze_plans", "config": args.config, "intra": intra,
                          "overrides": _parse_overrides(args.set), "environment": environment(),
                          "per_moe_layer_forward": rows, "closed_forms_elements": forms})


if __name__ == "__main__":
    main()
