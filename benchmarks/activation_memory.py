"""Per-layer activation memory of a Mixtral-8x7B-shaped MoE layer under SP+EP, from the compiled step (simulated
devices, nothing runs), next to the paper's formulas (MegaScale-MoE, selective activation rematerialization):

    all kept   (2n + 2k + 3kf + 12 + 5/m) * bsh/n      selective   (2kf + 4 + 2/m) * bsh/n      (bf16 bytes x 2)

n intra size, k top-k, f = expert FFN / hidden, m = q heads / kv heads; b sequences per data rank, s sequence,
h hidden. Per layer = compiled temp bytes of the L = 2 step minus the L = 1 step (the difference is one layer's
saved activations plus its share of transient buffers).

    python -m benchmarks.activation_memory --devices 8 --out benchmarks/results/activation_memory_mixtral_n8.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.devices}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np

    from benchmarks.environment import environment
    from megascale_jax import step as step_lib
    from megascale_jax.config import default_config

    def temp_bytes(layers: int, remat: str) -> int:
        cfg = default_config("mixtral_8x7b", num_devices=args.devices, **{
            "model.num_layers": layers, "train.remat": remat, "train.global_batch": args.global_batch,
            "parallel.intra": args.devices, "model.moe.capacity_factor": 1.0})
        trainer = step_lib.build(cfg)
        shape = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.train.seq_len), np.int32,
                                     sharding=trainer.batch_sharding())
        compiled = step_lib.make_train_step(trainer).lower(trainer.abstract_state, {"inputs": shape, "targets": shape})
        return compiled.compile().memory_analysis().temp_size_in_bytes, cfg

    rows = {}
    for remat in ("none", "selective", "full"):
        one, cfg = temp_bytes(1, remat)
        two, _ = temp_bytes(2, remat)
        rows[remat] = {"temp_bytes_1_layer": one, "temp_bytes_2_layers": two, "per_layer_bytes": two - one}
        print(remat, rows[remat], flush=True)
    m, e, p, t = cfg.model, cfg.model.moe, cfg.parallel, cfg.train
    n, k, f, ratio = p.intra, e.top_k, e.expert_ffn / m.hidden, m.num_heads / m.num_kv_heads
    bsh_n = (t.global_batch // p.data) * t.seq_len * m.hidden / n
    formulas = {"none": (2 * n + 2 * k + 3 * k * f + 12 + 5 / ratio) * bsh_n * 2,
                "selective": (2 * k * f + 4 + 2 / ratio) * bsh_n * 2}
    payload = {"benchmark": "activation_memory", "environment": environment(), "config": "mixtral_8x7b",
               "shape": {"n": n, "k": k, "f": f, "m": ratio, "b_per_data_rank": t.global_batch // p.data,
                         "s": t.seq_len, "h": m.hidden, "capacity_factor": 1.0, "plan": "megascale (SP+EP)"},
               "measured": rows,
               "formula_bytes_per_layer": formulas,
               "measured_over_formula": {r: rows[r]["per_layer_bytes"] / formulas[r] for r in formulas},
               "selective_below_none": 1 - rows["selective"]["per_layer_bytes"] / rows["none"]["per_layer_bytes"]}
    with open(args.out, "w") as fh:
        json.dump(payload, fh, indent=1)
    print(json.dumps({k: v for k, v in payload.items() if k not in ("environment",)}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
