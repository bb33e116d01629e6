"""Checkpointer: round trips, retention, resume, resharding onto other meshes, clear errors."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from megascale_jax.checkpoint import Checkpointer


def _make_state(seed: int = 0):
    """A train-state-shaped pytree: mixed dtypes, nesting, a tuple, typed and raw keys."""
    rng = np.random.default_rng(seed)
    return {
        "params": {
            "embed": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32),
            "layers": [
                {"w_DF": jnp.asarray(rng.normal(size=(8, 24)), jnp.bfloat16)},
                {"w_DF": jnp.asarray(rng.normal(size=(8, 24)), jnp.bfloat16)},
            ],
        },
        "opt": (jnp.asarray(rng.normal(size=(16, 8)), jnp.float32), jnp.int32(7 + seed)),
        "step": jnp.int32(100 + seed),
        "rng": jax.random.key(seed),
        "rng_rbg_8": jax.random.split(jax.random.key(seed, impl="rbg"), 8),
        "rng_raw": jax.random.PRNGKey(seed),
    }


def _abstract(state, sharding_for):
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_for(x)), state)


def _assert_same(restored, expected):
    assert jax.tree.structure(restored) == jax.tree.structure(expected)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(expected)):
        assert got.dtype == want.dtype and got.shape == want.shape
        if jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key):
            assert jax.random.key_impl(got) == jax.random.key_impl(want)
            got, want = jax.random.key_data(got), jax.random.key_data(want)
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                      np.asarray(want.astype(jnp.float32)))


def _mesh_8():
    return jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))


def test_round_trip_mixed_dtypes_and_keys(tmp_path):
    state = _make_state()
    extra = {"data_position": 1234, "config": {"name": "tiny", "lr": 3e-3}}
    with Checkpointer(str(tmp_path), save_every=10, keep=3, async_save=False) as ckpt:
        ckpt.save(100, state, extra)
        device = SingleDeviceSharding(jax.devices()[0])
        restored, restored_extra = ckpt.restore(_abstract(state, lambda x: device))
    _assert_same(restored, state)
    assert restored_extra == extra
    assert jax.random.key_impl(restored["rng_rbg_8"]) == "rbg"
    # The restored key still drives jax.random exactly like the original one.
    np.testing.assert_array_equal(jax.random.uniform(restored["rng"], (4,)),
                                  jax.random.uniform(state["rng"], (4,)))


def test_keep_last_k_and_latest_step(tmp_path):
    state = _make_state()
    with Checkpointer(str(tmp_path), save_every=2, keep=2, async_save=False) as ckpt:
        assert ckpt.latest_step() is None
        saved = [s for s in range(1, 9) if ckpt.maybe_save(s, state, {"s": s})]
        assert saved == [2, 4, 6, 8]
        assert ckpt.latest_step() == 8
        assert ckpt.all_steps() == [6, 8]
    assert sorted(int(d) for d in os.listdir(tmp_path) if d.isdigit()) == [6, 8]


def test_maybe_save_force_zero_interval_and_existing_step(tmp_path):
    state = _make_state()
    with Checkpointer(str(tmp_path), save_every=0, keep=5, async_save=False) as ckpt:
        assert not ckpt.maybe_save(10, state, {})            # 0 = no periodic saves
        assert ckpt.maybe_save(3, state, {"v": 1}, force=True)
        assert not ckpt.maybe_save(3, state, {"v": 2}, force=True)  # already on disk: skipped
        with pytest.raises(ValueError, match="already saved.*force=True"):
            ckpt.save(3, state, {"v": 2})
        replacement = _make_state(seed=1)
        ckpt.save(3, replacement, {"v": 3}, force=True)
        restored, extra = ckpt.restore(replacement)           # concrete arrays work as target
    assert extra == {"v": 3}
    _assert_same(restored, replacement)


def test_async_save_wait_then_resume_in_new_checkpointer(tmp_path):
    state = _make_state()
    ckpt = Checkpointer(str(tmp_path), save_every=5, keep=2, async_save=True)
    assert ckpt.maybe_save(5, state, {"data_position": 5})
    donated = _make_state()  # same values, own buffers
    assert ckpt.maybe_save(10, donated, {"data_position": 10})
    for leaf in jax.tree.leaves(donated):  # what a jitted step with donate_argnums does next
        leaf.delete()
    ckpt.wait()
    ckpt.close()
    resumed = Checkpointer(str(tmp_path), save_every=5, keep=2)
    assert resumed.latest_step() == 10
    device = SingleDeviceSharding(jax.devices()[0])
    restored, extra = resumed.restore(_abstract(state, lambda x: device))
    assert extra == {"data_position": 10}
    _assert_same(restored, state)
    _, extra_5 = resumed.restore(_abstract(state, lambda x: device), step=5)
    assert extra_5 == {"data_position": 5}
    resumed.close()


def _sharded_spec(x):
    """Shard dim 0 over the 8 devices when it divides; replicate the rest (scalars, tiny keys)."""
    return P("x") if x.ndim >= 1 and x.shape[0] % 8 == 0 else P()


def test_restore_one_device_onto_8_way_mesh_and_back(tmp_path):
    state = jax.device_put(_make_state(), jax.devices()[0])
    mesh = _mesh_8()
    sharded = lambda x: NamedSharding(mesh, _sharded_spec(x))  # noqa: E731
    with Checkpointer(str(tmp_path / "one"), save_every=1, keep=1, async_save=False) as ckpt:
        ckpt.save(1, state, {})
        restored, _ = ckpt.restore(_abstract(state, sharded))
    _assert_same(restored, state)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        assert got.sharding == sharded(want)
    assert len(restored["params"]["embed"].addressable_shards) == 8
    assert restored["params"]["embed"].addressable_shards[0].data.shape == (2, 8)

    # And back: written from 8 shards, read onto one device.
    one_device = SingleDeviceSharding(jax.devices()[3])
    with Checkpointer(str(tmp_path / "eight"), save_every=1, keep=1, async_save=True) as ckpt:
        ckpt.save(2, restored, {})
        back, _ = ckpt.restore(_abstract(state, lambda x: one_device))
    _assert_same(back, state)
    assert all(x.sharding == one_device for x in jax.tree.leaves(back))


def test_restore_onto_a_different_2d_mesh(tmp_path):
    state = _make_state()
    mesh_8 = _mesh_8()
    mesh_4x2 = jax.make_mesh((4, 2), ("data", "expert"),
                             axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    with Checkpointer(str(tmp_path), save_every=1, keep=1, async_save=False) as ckpt:
        ckpt.save(1, jax.device_put(state, jax.tree.map(
            lambda x: NamedSharding(mesh_8, _sharded_spec(x)), state)), {})
        def sharding_4x2(x):
            split = x.ndim == 2 and x.shape[0] % 4 == 0
            return NamedSharding(mesh_4x2, P("data", "expert") if split else P())
        restored, _ = ckpt.restore(_abstract(state, sharding_4x2))
    _assert_same(restored, state)
    w = restored["params"]["layers"][0]["w_DF"]
    assert w.sharding.spec == P("data", "expert") and w.sharding.mesh.shape["expert"] == 2
    assert w.addressable_shards[0].data.shape == (2, 12)


def _saved(tmp_path, state):
    ckpt = Checkpointer(str(tmp_path), save_every=1, keep=1, async_save=False)
    ckpt.save(1, state, {})
    return ckpt


def test_mismatch_errors_name_the_leaf(tmp_path):
    state = _make_state()
    device = SingleDeviceSharding(jax.devices()[0])
    target = _abstract(state, lambda x: device)
    with _saved(tmp_path, state) as ckpt:
        wrong_shape = jax.tree.map(lambda x: x, target)
        wrong_shape["params"]["embed"] = jax.ShapeDtypeStruct((32, 8), jnp.float32, sharding=device)
        with pytest.raises(ValueError, match=r"(?s)params/embed: checkpoint has float32\[16, 8\], "
                                             r"target wants float32\[32, 8\].*new --config"):
            ckpt.restore(wrong_shape)

        wrong_dtype = jax.tree.map(lambda x: x, target)
        wrong_dtype["opt"] = (jax.ShapeDtypeStruct((16, 8), jnp.bfloat16, sharding=device),
                              target["opt"][1])
        with pytest.raises(ValueError, match=r"opt/0: checkpoint has float32"):
            ckpt.restore(wrong_dtype)

        other_key_impl = dict(target, rng=jax.ShapeDtypeStruct(
            (), jax.random.key(0, impl="rbg").dtype, sharding=device))
        with pytest.raises(ValueError, match=r"rng: checkpoint has uint32\[2\]"):
            ckpt.restore(other_key_impl)

        new_leaf = jax.ShapeDtypeStruct((3,), jnp.float32, sharding=device)
        more_leaves = dict(target, new_leaf=new_leaf)
        fewer_leaves = {k: v for k, v in target.items() if k != "step"}
        with pytest.raises(ValueError, match="new_leaf: in the target but not in the checkpoint"):
            ckpt.restore(more_leaves)
        with pytest.raises(ValueError, match="step: in the checkpoint but not in the target"):
            ckpt.restore(fewer_leaves)


def test_bad_input_errors(tmp_path):
    state = _make_state()
    with Checkpointer(str(tmp_path / "empty"), save_every=1, keep=1) as empty:
        with pytest.raises(ValueError, match="no checkpoint to restore"):
            empty.restore(state)
    with _saved(tmp_path / "full", state) as ckpt:
        with pytest.raises(ValueError, match=r"step=7 is not in .*saved steps: \[1\]"):
            ckpt.restore(state, step=7)
        no_sharding = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        with pytest.raises(ValueError, match="abstract_state leaf .* has no sharding"):
            ckpt.restore(no_sharding)
        with pytest.raises(ValueError, match=r"extra\['pos'\] is not JSON-serialisable"):
            ckpt.save(2, state, {"pos": np.arange(3)})
        assert ckpt.all_steps() == [1]                      # the failed save wrote nothing
    for kwargs, name in (({"save_every": -1, "keep": 1}, "save_every"),
                         ({"save_every": 1, "keep": 0}, "keep")):
        with pytest.raises(ValueError, match=name):
            Checkpointer(str(tmp_path / "x"), **kwargs)
    with pytest.raises(ValueError, match="directory is empty"):
        Checkpointer("", save_every=1, keep=1)


def test_extra_is_plain_json_on_disk(tmp_path):
    """A person or script can read the data position without jax: <dir>/<step>/extra/metadata."""
    with _saved(tmp_path, {"w": jnp.ones((2,))}) as ckpt:
        ckpt.save(2, {"w": jnp.ones((2,))}, {"data_position": 42})
    with open(tmp_path / "2" / "extra" / "metadata") as f:
        assert json.load(f) == {"data_position": 42}


def test_flax_nnx_and_optax_state_round_trip(tmp_path):
    """The trainer's real state types (nnx.State of Variables, optax namedtuples) come back intact."""
    import optax
    from flax import nnx

    params = nnx.state(nnx.Linear(8, 16, rngs=nnx.Rngs(0)), nnx.Param)
    optimizer = optax.adamw(1e-3)
    opt_state = optimizer.update(jax.tree.map(jnp.ones_like, params), optimizer.init(params),
                                 params)[1]
    state = {"params": params, "opt": opt_state, "step": jnp.int32(1), "rng": jax.random.key(2)}
    mesh = _mesh_8()
    target = _abstract(state, lambda x: NamedSharding(mesh, _sharded_spec(x)))
    with _saved(tmp_path, state) as ckpt:
        restored, _ = ckpt.restore(target)
    assert isinstance(restored["params"], nnx.State)
    assert type(restored["opt"][0]) is type(opt_state[0])  # ScaleByAdamState, not a dict
    _assert_same(restored, state)
    assert restored["params"]["kernel"][...].sharding == NamedSharding(mesh, P("x"))


def test_half_written_step_of_a_crashed_run_is_ignored(tmp_path):
    state = {"w": jnp.arange(3.0)}
    with _saved(tmp_path, state) as ckpt:
        pass
    crashed = tmp_path / "2.orbax-checkpoint-tmp" / "state"  # orbax's in-progress folder name
    crashed.mkdir(parents=True)
    (crashed / "partial").write_text("cut off")
    with Checkpointer(str(tmp_path), save_every=1, keep=2, async_save=False) as resumed:
        assert resumed.latest_step() == 1
        restored, _ = resumed.restore(state)
        resumed.save(2, {"w": jnp.arange(3.0) + 1}, {"ok": True})
        assert resumed.all_steps() == [1, 2]
        assert resumed.restore(state)[1] == {"ok": True}
    np.testing.assert_array_equal(restored["w"], state["w"])
