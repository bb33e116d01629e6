"""Checkpoints never hold non-finite state; a bad checkpoint directory is a one-line error up front."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from megascale_jax import checkpoint
from megascale_jax.checkpoint import Checkpointer, CheckpointError, check_writable, nonfinite_leaves


def _state(bad: float | None = None):
    """Params, optimizer moments, integer step and a key; `bad` (NaN/Inf) goes into two leaves."""
    state = {
        "params": {"embed": jnp.ones((16, 8)), "w": jnp.ones((8, 4), jnp.bfloat16)},
        "opt": (jnp.zeros((16, 8)), jnp.int32(3)),
        "step": jnp.int32(5),
        "rng": jax.random.key(0),
    }
    if bad is not None:
        state["params"]["w"] = state["params"]["w"].at[2, 3].set(bad)
        state["opt"] = (state["opt"][0].at[15, 0].set(bad), state["opt"][1])
    return state


def _error(fn, *args, **kwargs) -> str:
    with pytest.raises(CheckpointError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def _step_folders(directory) -> list[str]:
    return sorted(d for d in os.listdir(directory) if d[0].isdigit())


# --------------------------------------------------------------------------------- nonfinite_leaves
def test_nonfinite_leaves_names_floating_leaves_with_nan_or_inf():
    assert nonfinite_leaves(_state()) == []
    assert nonfinite_leaves(_state(float("nan"))) == ["opt/0", "params/w"]
    assert nonfinite_leaves(_state(float("-inf"))) == ["opt/0", "params/w"]
    host = {"a": np.array([1.0, np.inf]), "b": 2.5, "c": np.arange(3), "d": float("nan")}
    assert nonfinite_leaves(host) == ["a", "d"]
    assert nonfinite_leaves({}) == [] and nonfinite_leaves({"empty": jnp.zeros((0, 3))}) == []


def test_nonfinite_leaves_on_sharded_arrays_one_call_per_mesh(monkeypatch):
    mesh = jax.make_mesh((4, 2), ("data", "expert"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    sharded = NamedSharding(mesh, P("data", "expert"))
    w = jnp.ones((16, 8)).at[15, 7].set(jnp.nan)  # only the last device's shard holds it
    tree = {"w": jax.device_put(w, sharded), "ok": jax.device_put(jnp.ones((8, 4)), sharded),
            "scalar": jax.device_put(jnp.float32(jnp.inf), NamedSharding(mesh, P())),
            "elsewhere": jax.device_put(jnp.full((3,), jnp.nan), SingleDeviceSharding(jax.devices()[5]))}
    assert len(tree["w"].addressable_shards) == 8
    calls = []
    real = checkpoint._nonfinite_flags
    monkeypatch.setattr(checkpoint, "_nonfinite_flags", lambda leaves: calls.append(len(leaves)) or real(leaves))
    assert nonfinite_leaves(tree) == ["elsewhere", "scalar", "w"]
    assert sorted(calls) == [1, 3]  # one reduction for the mesh, one for the other device
    calls.clear()
    assert nonfinite_leaves({"w": tree["w"], "ok": tree["ok"]}) == ["w"] and calls == [2]


# -------------------------------------------------------------------------------------------- save
def test_save_refuses_a_nan_state_and_writes_nothing(tmp_path):
    with Checkpointer(str(tmp_path), save_every=1, keep=3, async_save=True) as ckpt:
        message = _error(ckpt.save, 20, _state(float("nan")), {"step": 20})
        assert message == (f"refusing to save step 20 to {tmp_path}: the state is not finite (NaN/Inf in "
                           "opt/0, params/w); nothing was written.")
        _error(ckpt.maybe_save, 21, _state(float("inf")), {})
        ckpt.wait()
        assert ckpt.all_steps() == [] and _step_folders(tmp_path) == []
        ckpt.save(1, _state(), {"v": 1})
        assert "nothing was written" in _error(ckpt.save, 1, _state(float("nan")), {"v": 2}, force=True)
        restored, extra = ckpt.restore(_state())  # the step it would have replaced is intact
    assert extra == {"v": 1} and nonfinite_leaves(restored) == []
    assert _step_folders(tmp_path) == ["1"]


def test_refused_save_lists_at_most_three_leaves(tmp_path):
    tree = {f"w{i}": jnp.full((2,), jnp.nan) for i in range(5)}
    with Checkpointer(str(tmp_path), save_every=1, keep=1, async_save=False) as ckpt:
        assert "(NaN/Inf in w0, w1, w2 and 2 more leaves)" in _error(ckpt.save, 3, tree, {})


# ----------------------------------------------------------------------------------------- restore
def _write_unchecked(ckpt, step, state, monkeypatch):
    """What an older version (or other code) could have left on disk: a NaN state."""
    with monkeypatch.context() as patch:
        patch.setattr(checkpoint, "nonfinite_leaves", lambda tree: [])
        ckpt.save(step, state, {"step": step})
    ckpt.wait()


def test_restore_refuses_a_nan_checkpoint_and_names_the_earlier_step(tmp_path, monkeypatch):
    with Checkpointer(str(tmp_path), save_every=1, keep=5, async_save=False) as ckpt:
        ckpt.save(10, _state(), {"step": 10})
        _write_unchecked(ckpt, 20, _state(float("nan")), monkeypatch)
        assert ckpt.all_steps() == [10, 20]
        message = _error(ckpt.restore, _state())
        assert message == (
            f"checkpoint step 20 in {tmp_path} holds a non-finite state (NaN/Inf in opt/0, params/w); "
            f"restore an earlier step with step=10 (saved steps: [10, 20]), or delete "
            f"{os.path.join(tmp_path, '20')} so the run resumes from step 10.")
        restored, extra = ckpt.restore(_state(), step=10)
    assert extra == {"step": 10} and nonfinite_leaves(restored) == []


def test_restore_refuses_a_nan_checkpoint_with_no_earlier_step(tmp_path, monkeypatch):
    with Checkpointer(str(tmp_path), save_every=1, keep=5, async_save=False) as ckpt:
        _write_unchecked(ckpt, 5, _state(float("inf")), monkeypatch)
    with Checkpointer(str(tmp_path), save_every=1, keep=5) as resumed:  # a restarted run
        message = _error(resumed.restore, _state())
    assert f"checkpoint step 5 in {tmp_path} holds a non-finite state" in message
    assert "no earlier step is kept" in message and "--config.checkpoint.dir" in message


# ---------------------------------------------------------------------------------- check_writable
def test_check_writable_creates_a_missing_folder(tmp_path):
    target = tmp_path / "run" / "ckpt"
    check_writable(str(target))
    assert target.is_dir() and os.listdir(target) == []  # the probe file is gone


def test_check_writable_on_a_file_path(tmp_path):
    file_path = tmp_path / "ckpt"
    file_path.write_text("not a folder")
    message = _error(check_writable, str(file_path))
    assert message == (f"checkpoint.dir {file_path} is a file, not a directory; set "
                       "--config.checkpoint.dir to a folder (it is created if missing).")
    message = _error(check_writable, str(file_path / "sub"))
    assert "cannot be created (Not a directory)" in message and "--config.checkpoint.dir" in message
    assert "is a file" in _error(Checkpointer, str(file_path), save_every=1, keep=1)
    assert "--config.checkpoint.dir" in _error(check_writable, "")


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="root ignores permission bits, so a read-only folder is writable for it")
def test_check_writable_on_a_read_only_folder(tmp_path):
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o500)
    try:
        message = _error(check_writable, str(read_only))
        assert f"checkpoint.dir {read_only} is not writable (Permission denied)" in message
        assert "cannot be created (Permission denied)" in _error(check_writable, str(read_only / "sub"))
    finally:
        read_only.chmod(0o700)
