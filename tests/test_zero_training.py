"""ZeRO-1 and compressed gradient communication inside the trainer, against plain data parallelism."""
import os
import shutil

import jax
import numpy as np
import pytest

from megascale_jax import step, train
from megascale_jax.config import ConfigError, default_config

COMMON = {"train.steps": 3, "train.warmup_steps": 1, "train.log_every": 1, "train.eval_every": 0,
          "output.tensorboard": False, "train.global_batch": 8, "train.seq_len": 32}
ZERO = {"parallel.plan": "manual", "parallel.optimizer_sharding": "zero1"}


def _losses(tmp_path, name, **overrides):
    cfg = default_config("tiny_cpu", num_devices=8, **COMMON, **overrides, **{"output.dir": str(tmp_path / name)})
    return [l["loss"] for l in train.run(cfg)]


@pytest.fixture(scope="module")
def plain_losses(tmp_path_factory):
    """The float32 run with the default plan and replicated optimizer state: the reference of two tests below."""
    return _losses(tmp_path_factory.mktemp("plain_f32"), "plain")


def test_zero1_trains_equal_to_plain_data_parallel_and_compression_stays_close(tmp_path, plain_losses):
    plain = plain_losses
    np.testing.assert_allclose(_losses(tmp_path, "zero", **ZERO), plain, rtol=2e-6)
    for mode in ("bf16", "fp8"):
        compressed = _losses(tmp_path, mode, **ZERO, **{"parallel.grad_comm": mode})
        np.testing.assert_allclose(compressed, plain, rtol=1e-3)


def test_zero1_checkpoint_resumes_onto_another_data_parallel_size(tmp_path):
    """3 steps with data = 8, checkpoint, 3 more with data = 2 (the flat state's global shape does not depend
    on dp): the losses follow the uninterrupted 8-device run."""
    overrides = {**COMMON, **ZERO, "train.steps": 6, "checkpoint.every": 3, "checkpoint.async_save": False}
    cfg = lambda name, n: default_config("tiny_cpu", num_devices=n, **overrides, **{  # noqa: E731
        "output.dir": str(tmp_path / name), "checkpoint.dir": str(tmp_path / name / "ckpt")})
    straight = train.run(cfg("straight", 8))
    # The straight run's own step-3 checkpoint (a copy without step 6) is the one the 2-device run resumes from:
    # the same 8-device program wrote it as a run stopped at step 3 would (tests/test_train.py checks stop_after).
    assert sorted(os.listdir(tmp_path / "straight" / "ckpt")) == ["3", "6"]
    shutil.copytree(tmp_path / "straight" / "ckpt" / "3", tmp_path / "resumed" / "ckpt" / "3")
    second = train.run(cfg("resumed", 2), devices=jax.devices()[:2])
    assert [l["step"] for l in second] == [4, 5, 6]
    np.testing.assert_allclose([l["loss"] for l in straight[:3] + second], [l["loss"] for l in straight],
                               rtol=1e-5)


@pytest.mark.parametrize("intra", [1, 2])
def test_zero1_optimizer_state_per_device_falls_by_the_dp_size(intra):
    dp = 8 // intra
    plan = {"parallel.plan": "manual", "parallel.intra": intra}
    plain_cfg = default_config("tiny_cpu", num_devices=8, **COMMON, **plan)
    zero_cfg = default_config("tiny_cpu", num_devices=8, **COMMON, **{**plan, **ZERO})
    plain = step.create_state(step.build(plain_cfg))["opt_state"]
    zero = step.create_state(step.build(zero_cfg))["opt_state"]

    def per_device(leaf):
        return leaf.addressable_shards[0].data.nbytes

    def moments(state):  # Adam's first and second moments (what AdamW keeps per parameter)
        found = [x for x in jax.tree.leaves(state) if x.ndim >= 1 and x.dtype == np.float32]
        return found

    plain_bytes = sum(per_device(x) for x in moments(plain))
    zero_bytes = sum(per_device(x) for x in moments(zero))
    # Same moments, 1/dp of them on each device (up to the padding of the flat vectors to dp * 128).
    assert zero_bytes * dp == pytest.approx(plain_bytes, rel=0.01)
    groups = {key.split("/")[0] for key in zero}   # state keys are '<group>/<bucket>'
    assert groups == ({"shared", "sharded"} if intra > 1 else {"shared"})
    for key, state in zero.items():
        for leaf in jax.tree.leaves(state):
            if leaf.ndim:  # every state vector, the decay mask too, is sharded over data (and intra if sharded)
                assert per_device(leaf) * dp * (intra if key.startswith("sharded") else 1) == leaf.nbytes


@pytest.mark.parametrize("attention, ffn", [("sp", "ep"), ("tp", "tp")])
def test_zero1_with_an_intra_node_domain_equals_the_plain_manual_plan(tmp_path, attention, ffn):
    """intra = 2 x data = 4: each device flattens its own expert / TP shards; the grad norm counts weights
    replicated over 'intra' (SP attention) once. Losses and the clipped norm match the unsharded optimizer."""
    plan = {"parallel.plan": "manual", "parallel.intra": 2, "parallel.attention": attention,
            "parallel.ffn": ffn, "train.grad_clip": 0.05}   # small: every step clips, so the norm matters
    cfg = lambda name, **o: default_config("tiny_cpu", num_devices=8, **COMMON, **plan, **o,  # noqa: E731
                                           **{"output.dir": str(tmp_path / name)})
    plain = train.run(cfg("plain"))
    zero = train.run(cfg("zero", **{"parallel.optimizer_sharding": "zero1"}))
    assert all(l["grad_norm"] > 0.05 for l in plain)
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([l[key] for l in zero], [l[key] for l in plain], rtol=1e-5)


@pytest.mark.parametrize("overrides,needle", [
    ({"parallel.grad_comm": "bf16"}, "plan='manual'"),   # compressed exchange runs per device
    ({"parallel.optimizer_sharding": "zero1"}, "plan='manual'"),
])
def test_zero1_config_errors(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        default_config("tiny_cpu", **overrides)


def test_bfloat16_adam_moments_zero1_equals_replicated_and_follows_float32(tmp_path, plain_losses):
    """The moments stored in bfloat16 (train.adam_moments_dtype): ZeRO-1's flat slices update exactly as the
    replicated pytree does, and training follows the float32-moment run to bfloat16 rounding."""
    bf16 = {"train.adam_moments_dtype": "bfloat16"}
    replicated = _losses(tmp_path, "bf16_plain", **bf16)
    np.testing.assert_allclose(_losses(tmp_path, "bf16_zero", **ZERO, **bf16), replicated, rtol=2e-6)
    np.testing.assert_allclose(replicated, plain_losses, rtol=1e-3)   # the float32-moment run
    for plan in ({}, ZERO):   # the state's moments (all vectors but ZeRO-1's uint8 decay mask) are bfloat16
        opt_state = step.build(default_config("tiny_cpu", num_devices=8, **COMMON, **plan, **bf16)).abstract_state[
            "opt_state"]
        moments = [x for x in jax.tree.leaves(opt_state) if x.ndim >= 1 and x.dtype != np.uint8]
        assert moments and {x.dtype for x in moments} == {np.dtype("bfloat16")}
