"""ZeRO-1 and compressed gradient communication inside the trainer, against plain data parallelism."""
import jax
import numpy as np
import pytest

from megascale_jax import train
from megascale_jax.config import ConfigError, default_config

COMMON = {"train.steps": 3, "train.warmup_steps": 1, "train.log_every": 1, "train.eval_every": 0,
          "output.tensorboard": False, "train.global_batch": 8, "train.seq_len": 32}
ZERO = {"parallel.plan": "manual", "parallel.optimizer_sharding": "zero1"}


def _losses(tmp_path, name, **overrides):
    cfg = default_config("tiny_cpu", num_devices=8, **COMMON, **overrides, **{"output.dir": str(tmp_path / name)})
    return [l["loss"] for l in train.run(cfg)]


def test_zero1_trains_equal_to_plain_data_parallel_and_compression_stays_close(tmp_path):
    plain = _losses(tmp_path, "plain")
    np.testing.assert_allclose(_losses(tmp_path, "zero", **ZERO), plain, rtol=2e-6)
    for mode in ("bf16", "fp8"):
        compressed = _losses(tmp_path, mode, **ZERO, **{"parallel.grad_comm": mode})
        np.testing.assert_allclose(compressed, plain, rtol=1e-3)


def test_zero1_optimizer_state_per_device_falls_by_the_dp_size():
    plain_cfg = default_config("tiny_cpu", num_devices=8, **COMMON)
    zero_cfg = default_config("tiny_cpu", num_devices=8, **COMMON, **ZERO)
    plain = train.create_state(train.build_trainer(plain_cfg))["opt_state"]
    zero = train.create_state(train.build_trainer(zero_cfg))["opt_state"]

    def per_device(leaf):
        return leaf.addressable_shards[0].data.nbytes

    def moments(state):  # Adam's first and second moments (what AdamW keeps per parameter)
        found = [x for x in jax.tree.leaves(state) if x.ndim >= 1 and x.dtype == np.float32]
        return found

    plain_bytes = sum(per_device(x) for x in moments(plain))
    zero_bytes = sum(per_device(x) for x in moments(zero))
    # Same moments, one eighth on each device (up to the padding of the flat vector to dp * 128).
    assert zero_bytes * 8 == pytest.approx(plain_bytes, rel=0.01)
    for leaf in jax.tree.leaves(zero):
        if leaf.ndim:
            assert per_device(leaf) * 8 == leaf.nbytes   # every state vector, the decay mask too, is sharded


@pytest.mark.parametrize("overrides,needle", [
    ({"parallel.grad_comm": "bf16"}, "optimizer_sharding='zero1'"),
    ({"parallel.optimizer_sharding": "zero1"}, "plan='manual'"),
    ({**ZERO, "parallel.intra": 2}, "intra=2"),
])
def test_zero1_config_errors(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        default_config("tiny_cpu", **overrides)
