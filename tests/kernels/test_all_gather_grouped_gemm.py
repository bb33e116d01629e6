"""AG + scatter + grouped GEMM (`pallas_kernels/all_gather_grouped_gemm.py`): the sending side's runs and boxes
(`push_runs_locally`, GPU interpret mode: the interpreter fills buffers with NaN, so a row pushed where it must
not be, or not pushed, shows), the compute side on the CPUs the exchange leaves free vs the plain twin, the
twin's receive layout vs numpy on 4 simulated devices, bad input. GPU (`-m gpu`): the compute side for real,
and the exchange compiled for a mock topology of 2 and 8 GPUs; running the exchange needs >= 2 GPUs.
"""
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from pallas_kernels.all_gather_grouped_gemm import (all_gather_grouped_gemm, all_gather_grouped_gemm_reference,
                                                    push_runs_locally)
from pallas_kernels.grouped_gemm_reference import grouped_gemm_reference
from tests.kernels.exchange_reports import compile_report, report_in_subprocess


def _counts(rng, n, g, high):
    """Routing counts [source, destination, expert]: empty runs, one empty expert, runs longer than 128 rows."""
    c = rng.integers(0, high, (n, n, g))
    c[rng.random((n, n, g)) < 0.25] = 0
    c[:, :, rng.integers(g)] = 0
    return c


def _send_starts(counts):
    """Numpy: sender s's first row of its (destination, expert) run, its rows sorted by (destination, expert)."""
    n, _, g = counts.shape
    return np.stack([np.concatenate([[0], np.cumsum(counts[s].reshape(-1))[:-1]]).reshape(n, g) for s in range(n)])


def _expected_receive(sends, counts, rank, capacity):
    """Numpy: rank's receive buffer in (expert, source) order, NaN past the last row."""
    starts = _send_starts(counts)
    rows = [sends[s][starts[s, rank, e] + i] for e in range(counts.shape[2]) for s in range(counts.shape[0])
            for i in range(counts[s, rank, e])]
    out = np.full((capacity, sends[0].shape[1]), np.nan, np.float32)
    out[:len(rows)] = np.asarray(rows, np.float32).reshape(len(rows), -1)
    return out


def _sends(rng, counts, d):
    return [rng.standard_normal((max(int(counts[s].sum()), 8), d)).astype(np.float32) for s in range(counts.shape[0])]


@pytest.mark.parametrize("n, g, d", [(4, 3, 256), (2, 2, 384)])
def test_interpret_pushes_land_each_run_at_its_receive_rows_and_nowhere_else(n, g, d):
    rng = np.random.default_rng(n * 10 + g)
    counts = _counts(rng, n, g, 150)
    sends = _sends(rng, counts, d)
    capacity = int(max(counts[:, p].sum() for p in range(n))) + 16
    starts = _send_starts(counts)
    for rank in range(n):
        send = jnp.asarray(sends[rank], jnp.bfloat16)
        out = np.asarray(push_runs_locally(send, jnp.asarray(counts, jnp.int32), rank=rank, capacity=capacity,
                                           interpret=True), np.float32)
        for j in range(n):
            dest = (rank + j) % n
            want = np.full((capacity, d), np.nan, np.float32)
            run_start = 0
            for e in range(g):
                for s in range(n):
                    c = counts[s, dest, e]
                    if s == rank:
                        want[run_start:run_start + c] = np.asarray(send, np.float32)[starts[s, dest, e]:][:c]
                    run_start += c
            np.testing.assert_array_equal(out[j], want, err_msg=f"rank {rank} step {j}")


def test_interpret_compute_side_equals_the_grouped_gemm_twin():
    """exchange=False: the grouped GEMM on CTAs [send_ctas, num_sms) over a receive buffer in (expert, source)
    order, its rows past the groups zeros."""
    rng = np.random.default_rng(3)
    n, g, d, nn = 3, 3, 128, 128
    counts = _counts(rng, n, g, 60)
    capacity = max(-(-(int(counts[:, 0].sum()) + 40) // 8) * 8, 256)   # a multiple of 8, >= the 256-row tile
    recv = jnp.asarray(rng.standard_normal((capacity, d)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((g, d, nn)) / np.sqrt(d), jnp.bfloat16)
    y = all_gather_grouped_gemm(recv, jnp.asarray(counts, jnp.int32), w, axis=None, capacity=capacity,
                                exchange=False, send_ctas=1, interpret=True)
    sizes = jnp.asarray(counts[:, 0].sum(0), jnp.int32)
    want = grouped_gemm_reference(recv, w, sizes, jnp.float32)
    got = np.asarray(y, np.float32)
    assert np.all(np.isfinite(got)), "an output row was never written"
    np.testing.assert_allclose(got, np.asarray(want), rtol=2e-2, atol=2e-2)
    assert np.all(got[int(sizes.sum()):] == 0.0)


def test_twin_receives_rows_in_expert_then_source_order_on_four_devices():
    """The twin's receive buffer vs numpy, and the model's plain exchange (parallel/expert_runs.py receive_runs,
    which the dispatcher's way back, return_runs, reads in the same layout) vs the twin's."""
    from megascale_jax.parallel.expert_runs import receive_runs

    n, g, d, nn = 4, 2, 16, 8
    rng = np.random.default_rng(7)
    counts = _counts(rng, n, g, 12)
    sends = _sends(rng, counts, d)
    m = max(s.shape[0] for s in sends)
    send_NMD = np.stack([np.pad(s, ((0, m - s.shape[0]), (0, 0))) for s in sends])
    capacity = int(max(counts[:, p].sum() for p in range(n))) + 8
    w = rng.standard_normal((n, g, d, nn)).astype(np.float32)
    mesh = jax.make_mesh((n,), ("x",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:n])
    twin = functools.partial(all_gather_grouped_gemm_reference, axis="x", capacity=capacity)
    cap = -(-int(counts.max(axis=(1, 2), initial=0).max() * g) // 8) * 8   # >= any source's rows for one rank

    def both(x, c, w):
        plain = receive_runs(x[0], c, axis="x", capacity_per_source=cap)[0][:capacity]
        return tuple(o[None] for o in (*twin(x[0], c, w[0]), plain))

    fn = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=(P("x"), P(), P("x")), out_specs=P("x")))
    put = lambda a, spec: jax.device_put(jnp.asarray(a), NamedSharding(mesh, spec))  # noqa: E731
    y, recv, sizes, plain = (np.asarray(a) for a in fn(put(send_NMD, P("x")), put(counts.astype(np.int32), P()),
                                                       put(w, P("x"))))
    np.testing.assert_array_equal(plain, recv)
    for r in range(n):
        want = _expected_receive(sends, counts, r, capacity)
        total = int(counts[:, r].sum())
        np.testing.assert_array_equal(recv[r][:total], want[:total])
        assert np.all(recv[r][total:] == 0.0) and sizes[r].tolist() == counts[:, r].sum(0).tolist()
        np.testing.assert_allclose(y[r], np.asarray(grouped_gemm_reference(jnp.asarray(recv[r]), jnp.asarray(w[r]),
                                                                           jnp.asarray(sizes[r]))), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs, match", [
    (dict(d=96), "D=96 must be a multiple of 128"),
    (dict(capacity=100), "capacity=100 must be a multiple of 8"),
    (dict(counts_shape=(2, 3, 2)), "counts_SPG must be int \\[n, n, G=2\\]"),
    (dict(exchange=True), "needs exchange=False"),
])
def test_bad_input_raises_clear_value_error(kwargs, match):
    d, capacity = kwargs.get("d", 128), kwargs.get("capacity", 256)
    send = jnp.zeros((capacity, d), jnp.bfloat16)
    counts = jnp.zeros(kwargs.get("counts_shape", (2, 2, 2)), jnp.int32)
    w = jnp.zeros((2, d, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match=match):
        all_gather_grouped_gemm(send, counts, w, axis=None, capacity=capacity, interpret=True,
                                exchange=kwargs.get("exchange", False), send_ctas=1)


@pytest.mark.gpu
def test_gpu_compute_side_equals_the_grouped_gemm_twin():
    rng = np.random.default_rng(1)
    n, g, d, nn = 8, 4, 2048, 1408
    counts = _counts(rng, n, g, 700)
    capacity = -(-int(counts[:, 0].sum()) // 8) * 8 + 1024
    recv = jnp.asarray(rng.standard_normal((capacity, d)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((g, d, nn)) / np.sqrt(d), jnp.bfloat16)
    y = jax.jit(functools.partial(all_gather_grouped_gemm, axis=None, capacity=capacity, exchange=False))(
        recv, jnp.asarray(counts, jnp.int32), w)
    sizes = jnp.asarray(counts[:, 0].sum(0), jnp.int32)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(grouped_gemm_reference(recv, w, sizes, jnp.float32)),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_gpu_pushes_land_each_run_at_its_receive_rows():
    """The sending side for real on one GPU (each step's pushes into a local buffer, no semaphores): Mixtral's
    hidden size, 4 ranks, runs of up to ~1000 rows (full 128-row boxes and ladders)."""
    rng = np.random.default_rng(2)
    n, g, d = 4, 2, 4096
    counts = _counts(rng, n, g, 1000)
    sends = _sends(rng, counts, d)
    capacity = -(-int(max(counts[:, p].sum() for p in range(n))) // 8) * 8 + 64
    starts = _send_starts(counts)
    rank = 1
    send = jnp.asarray(sends[rank], jnp.bfloat16)
    push = jax.jit(lambda s, c: push_runs_locally(s, c, rank=rank, capacity=capacity, send_ctas=8))
    out = np.asarray(push(send, jnp.asarray(counts, jnp.int32)), np.float32)
    for j in range(n):
        dest, run_start = (rank + j) % n, 0
        for e in range(g):
            for s in range(n):
                c = counts[s, dest, e]
                if s == rank:
                    np.testing.assert_array_equal(out[j][run_start:run_start + c],
                                                  np.asarray(send, np.float32)[starts[s, dest, e]:][:c])
                run_start += c


def _exchange_compile_report(topology: str) -> dict:
    """Compile only, for a mock topology of several GPUs (the one real GPU compiles, nothing runs)."""
    jax.config.update("jax_mock_gpu_topology", topology)
    jax.config.update("jax_cuda_visible_devices", "0")
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("x",), axis_types=(AxisType.Explicit,))
    send = jax.ShapeDtypeStruct((n * 4096, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P("x")))
    counts = jax.ShapeDtypeStruct((n, n, 1), jnp.int32, sharding=NamedSharding(mesh, P()))
    w = jax.ShapeDtypeStruct((n, 4096, 14336), jnp.bfloat16, sharding=NamedSharding(mesh, P("x")))
    body = functools.partial(all_gather_grouped_gemm, axis="x", capacity=n * 4096)
    fn = jax.shard_map(lambda x, c, w: body(x, c, w)[0], mesh=mesh, in_specs=(P("x"), P(), P("x")),
                       out_specs=P("x"), check_vma=False)
    return {**compile_report(jax.jit(fn), send, counts, w), "dispatcher": _dispatcher_compile_report(mesh, n)}


def _dispatcher_compile_report(mesh, n):
    """The model's dispatcher with dispatch_exchange='mosaic' (parallel/expert_runs.py): the layer's experts and
    their gradients through both kernels (this one and grouped_gemm_reduce_scatter.py), compiled for the same
    mock topology."""
    from megascale_jax.model.moe.experts import ExpertWeights, FirstExpertGemms, LastExpertGemm, grouped_gemm_fn
    from megascale_jax.model.moe.router import Routing
    from megascale_jax.parallel.expert_runs import ExpertRunsDispatch

    t, d, f, e, k = 2048, 1024, 1536, 2 * n, 2
    dispatcher = ExpertRunsDispatch(e, axis="x", exchange="mosaic")
    gemm = grouped_gemm_fn("pallas")

    def loss(x, idx, wts, gate, up, down):
        weights = ExpertWeights(gate, up, down)
        routing = Routing(idx, wts, jnp.float32(0), jnp.float32(0))
        h, sizes, plan = dispatcher.first_gemm_dispatch(x, routing, FirstExpertGemms(weights, gemm))
        y = dispatcher.last_gemm_combine(h, sizes, plan, wts, LastExpertGemm(weights, gemm))
        return jnp.sum(y.astype(jnp.float32) ** 2)

    def step(x, idx, wts, gate, up, down):
        return jax.grad(loss, argnums=(0, 3, 4, 5))(x[0], idx[0], wts[0], gate, up, down)[0][None]

    sd = lambda shape, dtype, spec: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))  # noqa: E731
    args = (sd((n, t, d), jnp.bfloat16, P("x")), sd((n, t, k), jnp.int32, P("x")), sd((n, t, k), jnp.float32, P("x")),
            sd((e, d, f), jnp.bfloat16, P("x")), sd((e, d, f), jnp.bfloat16, P("x")), sd((e, f, d), jnp.bfloat16, P("x")))
    fn = jax.shard_map(step, mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x"), check_vma=False)
    return compile_report(jax.jit(fn), *args)


@pytest.mark.gpu
@pytest.mark.parametrize("topology", ["1x2x1", "1x8x1"])
def test_gpu_exchange_kernel_compiles_for_several_gpus(topology):
    """The exchange (runs pushed by remote_ref TMA stores, per-step semaphores, waits before each work item's
    first load) lowers through XLA's collective metadata for 2 and 8 ranks (Mixtral's expert shape at EP n)."""
    report = report_in_subprocess(__file__, topology, timeout=180, compile_only=True)
    assert report["devices"] == int(topology.split("x")[1]) and report["mosaic_calls"] >= 1, report
    assert report["collective_metadata"], report
    layer = report["dispatcher"]   # the model's dispatcher (dispatch_exchange='mosaic'), forward and backward
    assert layer["mosaic_calls"] >= 1 and layer["collective_metadata"], layer


if __name__ == "__main__":   # the report the GPU test above runs in a subprocess
    print(json.dumps(_exchange_compile_report(sys.argv[1])))


def test_backward_equals_autodiff_of_the_twin_on_four_devices():
    """The kernel's custom VJP (`dispatch_backward`: GEMM gradients on the receive buffer, then the exchange's
    transpose), run with the grouped GEMM's plain twins, against autodiff of the all-gather twin."""
    from pallas_kernels.all_gather_grouped_gemm import dispatch_backward
    from pallas_kernels.grouped_gemm_reference import grouped_gemm_dgrad_reference, grouped_gemm_wgrad_reference

    n, g, d, nn = 4, 3, 16, 8
    rng = np.random.default_rng(11)
    counts = _counts(rng, n, g, 9)
    m = int(counts.sum(axis=(1, 2)).max()) + 8
    capacity = int(max(counts[:, p].sum() for p in range(n))) + 8
    source_rows = -(-int(counts.sum(axis=2).max()) // 8) * 8
    send = rng.standard_normal((n, m, d)).astype(np.float32)
    w = rng.standard_normal((n, g, d, nn)).astype(np.float32)
    dy = rng.standard_normal((n, capacity, nn)).astype(np.float32)
    drecv = rng.standard_normal((n, capacity, d)).astype(np.float32)
    mesh = jax.make_mesh((n,), ("x",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:n])
    twin = functools.partial(all_gather_grouped_gemm_reference, axis="x", capacity=capacity)

    def both(x, c, w, dy, drecv):
        x, w, dy, drecv = x[0], w[0], dy[0], drecv[0]
        _, recv, sizes = twin(x, c, w)
        _, pull = jax.vjp(lambda x, w: twin(x, c, w)[:2], x, w)
        want = pull((dy, drecv))
        got = dispatch_backward(x, c, w, recv, sizes, dy, drecv, axis="x", source_rows=source_rows,
                                dgrad=grouped_gemm_dgrad_reference, wgrad=grouped_gemm_wgrad_reference)
        return tuple(a[None] for a in (*want, *got))

    fn = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=(P("x"), P(), P("x"), P("x"), P("x")), out_specs=P("x")))
    put = lambda a, spec: jax.device_put(jnp.asarray(a), NamedSharding(mesh, spec))  # noqa: E731
    want_dx, want_dw, got_dx, got_dw = fn(put(send, P("x")), put(counts.astype(np.int32), P()), put(w, P("x")),
                                          put(dy, P("x")), put(drecv, P("x")))
    np.testing.assert_allclose(np.asarray(got_dx), np.asarray(want_dx), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(got_dw), np.asarray(want_dw), rtol=1e-4, atol=1e-4)
    assert float(np.abs(np.asarray(want_dx)).max()) > 0
