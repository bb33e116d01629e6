"""ZeRO-1: optimizer state bytes per device fall by dp; training equals plain DP; 2 processes == 1 process.

Run as a module (`python -m tests.parallel.test_zero worker PORT PID OUT`) it is the worker of the
multi-process test: 2 processes x 4 simulated CPU devices against 1 process x 8.
"""
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import P

from megascale_jax.parallel import distributed, grad_comm, zero

DP = 8
D_IN, D_HIDDEN = 16, 64
BATCH = 64
STEPS = 3
REPO = Path(__file__).resolve().parents[2]


def replicated_twin(zero_opt: zero.Zero1) -> optax.GradientTransformation:
    """The plain-DP optimizer that ZeRO-1 must match: clip by global norm, then the inner optimizer,
    applied to the full (already DP-averaged) gradient with replicated state."""
    if zero_opt.max_grad_norm is None:
        return zero_opt.optimizer
    return optax.chain(optax.clip_by_global_norm(zero_opt.max_grad_norm), zero_opt.optimizer)


def per_device_bytes(tree) -> int:
    """Bytes that ONE device (the first one) holds of a pytree of jax Arrays: shards, not global sizes."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        if not isinstance(leaf, jax.Array):
            continue
        device = min(leaf.sharding.addressable_devices, key=lambda d: d.id)
        total += sum(s.data.nbytes for s in leaf.addressable_shards if s.device == device)
    return total


def make_params(d_in=D_IN, d_hidden=D_HIDDEN):
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w1": jax.random.normal(k1, (d_in, d_hidden)) / np.sqrt(d_in), "b1": jnp.zeros((d_hidden,)),
            "w2": jax.random.normal(k2, (d_hidden, d_in)) / np.sqrt(d_hidden), "b2": jnp.full((d_in,), 0.1)}


def make_batch():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, D_IN)).astype(np.float32)
    return x, np.tanh(x[:, ::-1] * 2.0).astype(np.float32)


def loss_fn(params, x, y):
    h = jax.nn.gelu(x @ params["w1"] + params["b1"])
    return jnp.mean(jnp.square(h @ params["w2"] + params["b2"] - y))


def make_zero(mode, max_grad_norm=0.05, bucket_elements=1 << 28):
    # max_grad_norm well below the initial norm (~1), so clipping is active and the global-norm psum matters.
    return zero.Zero1(optax.adamw(1e-2, weight_decay=0.1), axis="data", mode=mode, max_grad_norm=max_grad_norm,
                      bucket_elements=bucket_elements)


def zero_train(mesh, params, x_global, y_global, mode, steps=STEPS, bucket_elements=1 << 28):
    """ZeRO-1 steps with the batch sharded over 'data'; returns (params, clip scales, per-device state bytes)."""
    opt = make_zero(mode, bucket_elements=bucket_elements)
    opt_state = opt.init(params, mesh)
    specs = opt.state_specs(opt_state)

    def step(p, s, x, y):
        grads = jax.grad(loss_fn)(p, x, y)  # local batch: each rank's gradient differs
        return opt.step(p, grads, s)

    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                                 out_specs=(P(), specs, P())))
    params = jax.device_put(params, jax.NamedSharding(mesh, P()))
    clip_scales = []
    for _ in range(steps):
        params, opt_state, stats = step(params, opt_state, x_global, y_global)
        clip_scales.append(float(stats["clip_scale"].addressable_shards[0].data))
    return params, clip_scales, per_device_bytes(opt_state)


def plain_train(params, x, y, mode_like: zero.Zero1, steps=STEPS):
    """Single device, full batch, replicated optax state: what data parallelism must reproduce."""
    tx = replicated_twin(mode_like)
    state = tx.init(params)

    @jax.jit
    def step(p, s):
        updates, s = tx.update(jax.grad(loss_fn)(p, x, y), s, p)
        return optax.apply_updates(p, updates), s

    for _ in range(steps):
        params, state = step(params, state)
    return params, state


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((DP,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))


@pytest.fixture(scope="module")
def zero_runs(mesh):
    x, y = make_batch()
    sharding = jax.NamedSharding(mesh, P("data"))
    xg, yg = jax.device_put(x, sharding), jax.device_put(y, sharding)
    return {mode: zero_train(mesh, make_params(), xg, yg, mode) for mode in grad_comm.GRAD_COMM_MODES}


@pytest.fixture(scope="module")
def plain_run():
    x, y = make_batch()
    return plain_train(make_params(), x, y, make_zero("fp32"))[0]


def _max_rel(a_tree, b_tree):
    return max(float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))
               for a, b in zip(jax.tree.leaves(a_tree), jax.tree.leaves(b_tree)))


def test_zero1_fp32_equals_plain_dp(zero_runs, plain_run):
    want = plain_run
    got, clip_scales, _ = zero_runs["fp32"]
    assert all(s < 1.0 for s in clip_scales), "clipping never triggered: the global-norm path is untested"
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=2e-5, atol=2e-6), got, want)


def test_zero1_in_several_buckets_equals_plain_dp(mesh, plain_run):
    """bucket_elements=1000 cuts the 2128 parameters (leaf order b1 64, b2 16, w1 1024, w2 1024) into
    buckets of 1000, 1000 and 128 elements, splitting w1 and w2 across buckets: each bucket has its own
    flat vector, reduce-scatter and state; the result is the same training."""
    x, y = make_batch()
    sharding = jax.NamedSharding(mesh, P("data"))
    got, clip_scales, _ = zero_train(mesh, make_params(), jax.device_put(x, sharding), jax.device_put(y, sharding),
                                     "fp32", bucket_elements=1000)
    opt_state = make_zero("fp32", bucket_elements=1000).init(make_params(), mesh)
    assert sorted(opt_state) == ["shared/0", "shared/1", "shared/2"]
    assert all(s < 1.0 for s in clip_scales)   # the norm over all buckets decides the clipping
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=2e-5, atol=2e-6), got, plain_run)


@pytest.mark.parametrize("mode,bound", [("bf16", 1e-2), ("fp8", 5e-2)])
def test_zero1_compressed_close_to_plain_dp(zero_runs, plain_run, mode, bound):
    """Error bound: after clipping, Adam's first steps move each weight by ~lr * g/|g|; a relative
    gradient error e changes the parameter UPDATES by about e (bf16 2^-8, fp8 2^-4 worst case,
    much less on average); measured on the parameter change from the initial values."""
    init, want = make_params(), plain_run
    got = zero_runs[mode][0]
    delta_got = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), got, init)
    delta_want = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), want, init)
    rel = _max_rel(delta_got, delta_want)
    print(f"\n{mode}: max relative error of the parameter change after {STEPS} steps vs fp32 = {rel:.2e}")
    assert 0 < rel < bound


def test_optimizer_state_bytes_fall_by_dp(mesh):
    params = make_params(d_in=64, d_hidden=128)  # 16576 values -> padded 17408: 5% padding
    opt = make_zero("fp32")
    sharded = opt.init(params, mesh)
    replicated = jax.device_put(replicated_twin(opt).init(params), jax.NamedSharding(mesh, P()))
    zero_bytes, plain_bytes = per_device_bytes(sharded), per_device_bytes(replicated)
    padded = opt.flat_length(params, DP)
    scalar_bytes = 4  # adam's step count, replicated in both
    assert (zero_bytes - scalar_bytes) * DP * 16576 == (plain_bytes - scalar_bytes) * padded
    assert plain_bytes / DP <= zero_bytes <= 1.06 * plain_bytes / DP
    for leaf in jax.tree.leaves(sharded):
        if leaf.ndim:
            assert leaf.sharding.spec == P("data") and leaf.addressable_shards[0].data.shape == (padded // DP,)


def test_zero1_rejects_bad_arguments():
    with pytest.raises(ValueError, match="mode="):
        zero.Zero1(optax.adam(1e-3), axis="data", mode="fp16")
    with pytest.raises(ValueError, match="max_grad_norm"):
        zero.Zero1(optax.adam(1e-3), axis="data", max_grad_norm=0.0)
    with pytest.raises(ValueError, match="axis="):
        zero.Zero1(optax.adam(1e-3), axis="dp").init(make_params(), jax.make_mesh((8,), ("data",)))


# ---- multi-process: 2 processes x 4 CPU devices == 1 process x 8 --------------------------------------

def _worker(port: int, process_id: int, out_path: str) -> None:
    jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py does
    distributed.initialize(f"localhost:{port}", 2, process_id)
    mesh = jax.make_mesh((DP,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    x, y = make_batch()
    rows = slice(32 * process_id, 32 * (process_id + 1))   # this process's 4 devices hold data ranks 4p..4p+3
    sharding = jax.NamedSharding(mesh, P("data"))
    assert {d.id for d in jax.local_devices()} == {d.id for d in mesh.devices[4 * process_id:4 * (process_id + 1)]}
    xg = jax.make_array_from_process_local_data(sharding, x[rows], (BATCH, D_IN))
    yg = jax.make_array_from_process_local_data(sharding, y[rows], (BATCH, D_IN))
    result = {}
    for mode in grad_comm.GRAD_COMM_MODES:
        params = zero_train(mesh, make_params(), xg, yg, mode)[0]
        for name, leaf in params.items():
            result[f"{mode}/{name}"] = np.asarray(leaf.addressable_shards[0].data)
    if process_id == 0:
        np.savez(out_path, **result)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_match_one_process(zero_runs, tmp_path):
    out = tmp_path / "two_process.npz"
    port = _free_port()
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.parallel.test_zero", "worker", str(port), str(i),
                               str(out)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=180)[0])
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n---\n".join(logs)[-4000:]
    assert "process 1/2, 4 local / 8 global devices" in logs[1]
    got = np.load(out)
    for mode in grad_comm.GRAD_COMM_MODES:
        want = zero_runs[mode][0]
        for name, leaf in want.items():
            np.testing.assert_allclose(got[f"{mode}/{name}"], np.asarray(leaf), rtol=1e-5, atol=1e-6,
                                       err_msg=f"{mode}/{name}")


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "worker":
    _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
