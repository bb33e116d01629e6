"""Pipeline stages in the trainer: training with parallel.pipe = 2 equals training without (aux loss off, since
the balance loss is computed per microbatch), alone and with SP+EP inside the stages."""
import jax
import numpy as np
import pytest

from megascale_jax import step, train
from megascale_jax.config import ConfigError, default_config

COMMON = {"train.steps": 3, "train.warmup_steps": 1, "train.log_every": 1, "train.eval_every": 0,
          "output.tensorboard": False, "train.global_batch": 8, "train.seq_len": 32,
          "model.moe.aux_loss_weight": 0.0, "model.num_layers": 4}


def _losses(tmp_path, name, **overrides):
    cfg = default_config("tiny_cpu", num_devices=8, **{**COMMON, **overrides, "output.dir": str(tmp_path / name)})
    return [l["loss"] for l in train.run(cfg)]


def test_two_stage_pipeline_trains_like_no_pipeline(tmp_path):
    plain = _losses(tmp_path, "plain")
    piped = _losses(tmp_path, "pp", **{"parallel.pipe": 2, "train.microbatches": 2})
    np.testing.assert_allclose(piped, plain, rtol=1e-5)


def test_leading_dense_layer_trains_on_the_first_stage_with_sp_ep_inside_the_stages(tmp_path):
    """DeepSeekMoE-style: one dense layer before the MoE stack; stage 0 runs it after the embedding, with SP+EP
    inside the stages. (The dense first stage under the XLA plan: tests/test_pipeline_gradients.py's dense
    1f1b case, gradients against one device.)"""
    dense = {"model.num_layers": 5, "model.num_dense_layers": 1, "model.dense_ffn": 256}
    plain = _losses(tmp_path, "plain", **dense)
    sp_ep = _losses(tmp_path, "pp_sp_ep", **dense, **{"parallel.pipe": 2, "train.microbatches": 2,
                                                      "parallel.plan": "manual", "parallel.intra": 2})
    # Summation order differs (all-to-alls, per-stage partial sums); Adam's normalised steps carry it on.
    np.testing.assert_allclose(sp_ep, plain, rtol=5e-5)


def test_pipeline_stages_hold_only_their_layers():
    cfg = default_config("tiny_cpu", num_devices=8, **COMMON, **{"parallel.pipe": 2, "train.microbatches": 2})
    state = step.create_state(step.build(cfg))
    for part in ("params", "opt_state"):
        blocks = [x for x in jax.tree.leaves(state[part]) if x.ndim and x.shape[0] == cfg.model.num_layers]
        assert blocks
        for leaf in blocks:   # [layers, ...] split in two along the layers: half the bytes on each device
            assert leaf.addressable_shards[0].data.nbytes * 2 == leaf.nbytes


@pytest.mark.parametrize("overrides,needle", [
    ({"parallel.pipe": 2, "parallel.intra": 2}, "plan='manual'"),
    ({"parallel.pipe": 2, "train.microbatches": 3}, "train.microbatches x data"),
    ({"parallel.pipe": 2, "parallel.pipeline_schedule": "zigzag"}, "pipeline_schedule"),
])
def test_pipeline_config_errors(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        default_config("tiny_cpu", num_devices=8, **{"model.num_layers": 4, **overrides})
