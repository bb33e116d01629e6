"""The step's compositions: any gradient source with any updater (megascale_jax/step.py).

  * pipeline + ZeRO-1 trains exactly like pipeline + replicated optimizer state;
  * plain data parallelism with bf16 / fp8 gradient exchange (all-to-all + local fp32 sum + all-gather) stays
    within the error the ZeRO-1 path states for the same compression (tests/test_zero_training.py: rtol 1e-3
    of the fp32 losses over 3 steps), and really sends the compressed bytes.
"""
import jax
import numpy as np
import pytest

from megascale_jax import step, train
from megascale_jax.config import default_config
from megascale_jax.parallel.hlo_bytes import parse_collectives

COMMON = {"train.steps": 3, "train.warmup_steps": 1, "train.log_every": 1, "train.eval_every": 0,
          "output.tensorboard": False, "train.global_batch": 8, "train.seq_len": 32}


def _run(tmp_path, name, **overrides):
    cfg = default_config("tiny_cpu", num_devices=8, **{**COMMON, **overrides, "output.dir": str(tmp_path / name)})
    return train.run(cfg)


def test_pipeline_with_zero1_equals_pipeline_with_replicated_state(tmp_path):
    pipe = {"parallel.pipe": 2, "train.microbatches": 2, "model.num_layers": 4, "model.moe.aux_loss_weight": 0.0,
            "parallel.plan": "manual", "train.grad_clip": 0.05}   # small clip: every step clips, the norm matters
    replicated = _run(tmp_path, "replicated", **pipe)
    zero = _run(tmp_path, "zero", **pipe, **{"parallel.optimizer_sharding": "zero1"})
    assert all(l["grad_norm"] > 0.05 for l in replicated)
    for key in ("loss", "grad_norm"):   # fp32 sums in another order (ZeRO-1 keeps the layers replicated over 'pipe')
        np.testing.assert_allclose([l[key] for l in zero], [l[key] for l in replicated], rtol=5e-5)


def _gradient_wire_dtypes(cfg) -> set:
    trainer = step.build(cfg)
    shape = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.train.seq_len), np.int32,
                                 sharding=trainer.batch_sharding())
    text = step.make_train_step(trainer).lower(trainer.abstract_state, {"inputs": shape, "targets": shape}) \
        .compile().as_text()
    return {d for c in parse_collectives(text, 8) if c.kind == "all-to-all" for d in c.dtypes}


PLAIN = {"parallel.plan": "manual"}   # intra 1: plain data parallelism over 8 devices, per device


def test_plain_data_parallel_compressed_gradients(tmp_path):
    """bf16 and fp8 against one fp32 run (in one test: a module fixture would run once per xdist worker)."""
    fp32 = [l["loss"] for l in _run(tmp_path, "fp32", **PLAIN)]
    for mode, wire in (("bf16", "u16"), ("fp8", "u8")):
        compressed = [l["loss"] for l in _run(tmp_path, mode, **PLAIN, **{"parallel.grad_comm": mode})]
        np.testing.assert_allclose(compressed, fp32, rtol=1e-3, err_msg=mode)
        assert compressed != fp32, mode   # the compression is really on
        cfg = default_config("tiny_cpu", num_devices=8, **{**COMMON, **PLAIN, "parallel.grad_comm": mode})
        assert wire in _gradient_wire_dtypes(cfg), mode   # one (two) byte(s) per element on the wire
