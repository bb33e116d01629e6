"""Nothing lost, nothing silent: non-finite steps (stop | skip), capacity drops counted under every plan, and
user errors as one line before anything compiles."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megascale_jax import step, train
from megascale_jax.checkpoint import Checkpointer, nonfinite_leaves
from megascale_jax.config import default_config

SMALL = {"train.global_batch": 8, "train.seq_len": 32, "train.warmup_steps": 0, "train.log_every": 1,
         "train.eval_every": 0, "output.tensorboard": False}


def _batch(cfg, trainer, seed, poison=False):
    tokens = jax.random.randint(jax.random.key(seed), (cfg.train.global_batch, cfg.train.seq_len + 1), 0, 256)
    targets = tokens[:, 1:]
    if poison:   # a target id outside the vocabulary: its cross-entropy (and every gradient) is NaN
        targets = targets.at[0, 0].set(cfg.model.vocab_size)
    return jax.device_put({"inputs": tokens[:, :-1], "targets": targets}, trainer.batch_sharding())


@pytest.mark.parametrize("plan", [{}, {"parallel.plan": "manual", "parallel.intra": 2}])
def test_skip_leaves_the_state_as_if_the_bad_batch_were_absent(plan):
    cfg = default_config("tiny_cpu", num_devices=8, **{**SMALL, **plan, "train.nonfinite": "skip"})
    trainer = step.build(cfg)
    train_step = step.make_train_step(trainer)

    def run(steps):   # steps: [(step number, poisoned?)]; the step counter picks the learning rate
        state = step.create_state(trainer)
        for number, poisoned in steps:
            state = {**state, "step": jax.device_put(jnp.int32(number), trainer.state_shardings["step"])}
            state, metrics = train_step(state, _batch(cfg, trainer, number, poisoned))
        return jax.device_get(state), jax.device_get(metrics)

    skipped, metrics = run([(0, False), (1, False), (2, True), (3, False)])
    absent, _ = run([(0, False), (1, False), (3, False)])
    assert int(metrics["nonfinite_steps"]) == 1 and list(skipped["nonfinite"]) == [1, 2]
    assert not nonfinite_leaves(skipped["params"]) and not nonfinite_leaves(skipped["opt_state"])
    for got, want in zip(jax.tree.leaves(skipped["params"]) + jax.tree.leaves(skipped["opt_state"]),
                         jax.tree.leaves(absent["params"]) + jax.tree.leaves(absent["opt_state"])):
        np.testing.assert_array_equal(got, want)


def test_a_diverging_run_stops_and_never_checkpoints_nan(tmp_path):
    """A learning rate of 1e9 without clipping: the loss goes to NaN within a few steps. The run stops with
    the step and the last good checkpoint, and every checkpoint on disk is finite."""
    ckpt_dir = tmp_path / "ckpt"
    cfg = default_config("tiny_cpu", num_devices=8, **{
        **SMALL, "train.steps": 30, "train.learning_rate": 1e9, "train.grad_clip": 0.0, "train.log_every": 5,
        "checkpoint.dir": str(ckpt_dir), "checkpoint.every": 1, "checkpoint.async_save": False,
        "output.dir": str(tmp_path / "out")})
    with pytest.raises(train.DivergenceError, match=r"step (\d+): the loss or a gradient is not finite") as err:
        train.run(cfg)
    first_bad = int(err.value.args[0].split()[1].rstrip(":"))
    assert "Last good checkpoint" in str(err.value)
    saved = Checkpointer(str(ckpt_dir), save_every=1, keep=3, async_save=False)
    assert saved.all_steps() and max(saved.all_steps()) <= first_bad   # state after step k is saved as k + 1
    trainer = step.build(cfg)
    for number in saved.all_steps():
        state, _ = saved.restore(trainer.checkpoint_abstract, step=number)   # restore itself refuses NaN
        assert not nonfinite_leaves(state)


def _capacity_run(plan, devices, factor=0.25):
    cfg = default_config("tiny_cpu", num_devices=devices, **{**SMALL, **plan, "model.moe.capacity_factor": factor})
    trainer = step.build(cfg, jax.devices()[:devices])
    params = step.create_state(trainer)["params"]
    loss, metrics = jax.jit(step.loss_and_metrics(trainer))(params, _batch(cfg, trainer, 0))
    return cfg, trainer, float(loss), jax.device_get(metrics)


@pytest.mark.parametrize("devices", [1, 8])
def test_capacity_drops_equal_under_the_xla_and_the_manual_plan(devices):
    """capacity_factor = 0.25 on one device or 8 data-parallel ones: each device's tokens keep ceil(c T K) rows
    per layer (highest experts drop first); the XLA plan's global view drops and counts exactly the same."""
    cfg, trainer, xla_loss, xla = _capacity_run({}, devices)
    _, _, manual_loss, manual = _capacity_run({"parallel.plan": "manual"}, devices)
    t, k, layers = cfg.train.global_batch * cfg.train.seq_len, cfg.model.moe.top_k, cfg.model.num_moe_layers
    rows = t * k // devices
    assert int(xla["dropped_tokens"]) == int(manual["dropped_tokens"]) == layers * devices * (rows - int(np.ceil(0.25 * rows)))
    assert xla_loss == pytest.approx(manual_loss, rel=1e-5)
    _, _, dropless_loss, _ = _capacity_run({}, devices, factor=0.0)
    assert abs(xla_loss - dropless_loss) > 1e-4   # the drops change the computation: not ignored
    assert int(np.sum(xla["tokens_per_expert"])) == layers * t * k   # routed before any drop


def test_capacity_drops_are_counted_under_expert_parallelism():
    """EP all_to_all over 4 ranks: each destination holds ceil(c T K / n) rows of each source; counted."""
    cfg, _, _, metrics = _capacity_run({"parallel.plan": "manual", "parallel.intra": 4}, 8)
    t, k, layers = cfg.train.global_batch * cfg.train.seq_len, cfg.model.moe.top_k, cfg.model.num_moe_layers
    assert 0 < int(metrics["dropped_tokens"]) < layers * t * k


def _cli(*args):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    return subprocess.run([sys.executable, "-m", "megascale_jax.train", "--config", "configs/tiny_cpu.py", *args],
                          capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("args, needle", [
    (["--config.model.hiden=3"], "unknown config key config.model.hiden; did you mean config.model.hidden?"),
    (["--config.train.learning_rate=-1"], "config.train.learning_rate=-1.0 is out of range"),
    (["--config.train.b2=1.5"], "config.train.b2=1.5 is out of range"),
    (["--config.train.log_every=0"], "config.train.log_every=0 is out of range"),
    (["--config.checkpoint.keep=0"], "config.checkpoint.keep=0 is out of range"),
    (["--config.data.source=tokens", "--config.data.path=/nonexistent.bin"], "data error: token file"),
])
def test_user_errors_are_one_line_before_compiling(tmp_path, args, needle):
    proc = _cli(*args, f"--config.output.dir={tmp_path}")
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert needle in lines[-1] and "Traceback" not in proc.stderr, proc.stderr[-2000:]
