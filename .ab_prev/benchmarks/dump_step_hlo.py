"""Writes the compiled (optimized, scheduled) HLO of a config's train step, so a profile's fusion names
(loop_add_fusion.12, ...) can be traced back to the ops and named scopes they came from.

    python -m benchmarks.dump_step_hlo --config mixtral_small --set train.global_batch=2 --out /tmp/step.hlo.txt
"""
from __future__ import annotations

import argparse

import jax
import numpy as np

from benchmarks.bench_train import _parse_overrides
from megascale_jax import step as step_lib
from megascale_jax.config import default_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="mixtral_small")
    ap.add_argument("--set", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cfg = default_config(args.config, num_devices=jax.device_count(), **_parse_overrides(args.set))
    trainer = step_lib.build(cfg)
    shape = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.train.seq_len), np.int32,
                                 sharding=trainer.batch_sharding())
    compiled = step_lib.make_train_step(trainer).lower(trainer.abstract_state, {"inputs": shape, "targets": shape}) \
        .compile()
    with open(args.out, "w") as f:
        f.write(compiled.as_text())
    print(f"wrote {args.out}: {len(compiled.as_text()) / 1e6:.1f} MB of HLO")


if __name__ == "__main__":
    main()
