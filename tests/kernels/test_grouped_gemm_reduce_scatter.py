"""Grouped GEMM + gather + RS (`pallas_kernels/grouped_gemm_reduce_scatter.py`): the computing side's stores by
source (`return_rows_locally`, GPU interpret mode: the interpreter fills buffers with NaN, so a row stored where
it must not be, or not stored, shows), the twin vs numpy and the round trip with the dispatch twin on 4 simulated
devices, bad input. GPU (`-m gpu`): the exchange compiled for a mock topology of 2 and 8 GPUs (running it needs
>= 2 GPUs).
"""
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from pallas_kernels.all_gather_grouped_gemm import all_gather_grouped_gemm_reference
from pallas_kernels.grouped_gemm import GemmTiling
from pallas_kernels.grouped_gemm_reduce_scatter import (grouped_gemm_reduce_scatter,
                                                        grouped_gemm_reduce_scatter_reference, return_rows_locally)
from pallas_kernels.grouped_gemm_reference import grouped_gemm_reference
from tests.kernels.exchange_reports import compile_report, report_in_subprocess
from tests.kernels.test_all_gather_grouped_gemm import _counts, _send_starts

SMALL = GemmTiling(tile_m=64, tile_n=64, max_concurrent_steps=2, wg_split="n", grid_tile_width=2)


def _run_starts(counts, rank):
    """Numpy: the first receive row of each (source, expert) run on `rank`, runs in (expert, source) order."""
    n, _, g = counts.shape
    starts, row = np.zeros((n, g), np.int64), 0
    for e in range(g):
        for s in range(n):
            starts[s, e], row = row, row + counts[s, rank, e]
    return starts


def test_interpret_each_sources_rows_land_at_its_send_order_rows_and_nowhere_else():
    """One of three ranks (it stores to every peer, itself included), runs longer than a 64-row tile."""
    n, g = 3, 2
    rng = np.random.default_rng(23)
    counts = _counts(rng, n, g, 50)
    f, d = 128, 128
    capacity = max(-(-int(max(counts[:, p].sum() for p in range(n))) // 8) * 8 + 16, 64)
    rows = int(counts.sum(axis=(1, 2)).max()) + 8
    w = jnp.asarray(rng.standard_normal((g, f, d)) / np.sqrt(f), jnp.bfloat16)
    send_starts = _send_starts(counts)
    for rank in (1,):
        h = jnp.asarray(rng.standard_normal((capacity, f)), jnp.bfloat16)
        y = np.asarray(grouped_gemm_reference(h, w, jnp.asarray(counts[:, rank].sum(0), jnp.int32), jnp.float32))
        out = np.asarray(return_rows_locally(h, jnp.asarray(counts, jnp.int32), w, rank=rank, rows=rows, tiling=SMALL,
                                             num_sms=3, interpret=True), np.float32)
        run_starts = _run_starts(counts, rank)
        for j in range(n):
            s = (rank + j) % n
            want = np.full((rows, d), np.nan, np.float32)
            for e in range(g):
                c = counts[s, rank, e]
                want[send_starts[s, rank, e]:][:c] = y[run_starts[s, e]:][:c]
            written = ~np.isnan(want)
            assert np.array_equal(~np.isnan(out[j]), written), f"rank {rank} peer {j}: rows written elsewhere"
            np.testing.assert_allclose(out[j][written], want[written], rtol=2e-2, atol=2e-2)


def test_twin_round_trip_gives_each_rank_its_rows_outputs_on_four_devices():
    """The dispatch twin then this twin: each rank gets, in its send order, its rows times its experts' weights."""
    n, g, d, f = 4, 2, 16, 24
    rng = np.random.default_rng(5)
    counts = _counts(rng, n, g, 10)
    m = int(counts.sum(axis=(1, 2)).max()) + 8
    sends = rng.standard_normal((n, m, d)).astype(np.float32)
    capacity = int(max(counts[:, p].sum() for p in range(n))) + 8
    w_up = rng.standard_normal((n, g, d, f)).astype(np.float32)
    w_down = rng.standard_normal((n, g, f, d)).astype(np.float32)
    mesh = jax.make_mesh((n,), ("x",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:n])

    def both(x, c, wu, wd):
        h, _, _ = all_gather_grouped_gemm_reference(x[0], c, wu[0], axis="x", capacity=capacity)
        return grouped_gemm_reduce_scatter_reference(h, c, wd[0], axis="x", rows=m)[None]

    fn = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=(P("x"), P(), P("x"), P("x")), out_specs=P("x")))
    put = lambda a, spec: jax.device_put(jnp.asarray(a), NamedSharding(mesh, spec))  # noqa: E731
    got = np.asarray(fn(put(sends, P("x")), put(counts.astype(np.int32), P()), put(w_up, P("x")), put(w_down, P("x"))))
    for r in range(n):
        q = 0
        for p in range(n):
            for e in range(g):
                c = counts[r, p, e]
                want = sends[r, q:q + c] @ w_up[p, e] @ w_down[p, e]
                np.testing.assert_allclose(got[r, q:q + c], want, rtol=1e-4, atol=1e-4)
                q += c
        assert np.all(got[r, q:] == 0.0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(f=96), "F=96 must be a multiple of 64"),
    (dict(r=100), "R \\(h_RF rows\\)=100 must be a multiple of 8"),
    (dict(counts_shape=(2, 3, 2)), "counts_SPG must be int \\[n, n, G=2\\]"),
    (dict(exchange=True), "backend is 'cpu'"),
])
def test_bad_input_raises_clear_value_error(kwargs, match):
    f, r = kwargs.get("f", 128), kwargs.get("r", 256)
    h = jnp.zeros((r, f), jnp.bfloat16)
    counts = jnp.zeros(kwargs.get("counts_shape", (2, 2, 2)), jnp.int32)
    w = jnp.zeros((2, f, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match=match):
        if kwargs.get("exchange"):
            grouped_gemm_reduce_scatter(h, counts, w, axis=None, rows=64)
        else:
            return_rows_locally(h, counts, w, rank=0, rows=64, interpret=True)


@pytest.mark.gpu
def test_gpu_each_sources_rows_land_at_its_send_order_rows():
    """The computing side for real on one GPU (each peer's stores into a local buffer, no semaphores), the
    default tiles at Mixtral's down projection width, 4 ranks."""
    n, g, f, d = 4, 2, 2048, 4096
    rng = np.random.default_rng(4)
    counts = _counts(rng, n, g, 700)
    rank = 2
    capacity = -(-int(counts[:, rank].sum()) // 8) * 8 + 256
    rows = int(counts.sum(axis=(1, 2)).max()) + 8
    h = jnp.asarray(rng.standard_normal((capacity, f)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((g, f, d)) / np.sqrt(f), jnp.bfloat16)
    y = np.asarray(grouped_gemm_reference(h, w, jnp.asarray(counts[:, rank].sum(0), jnp.int32), jnp.float32))
    out = np.asarray(jax.jit(lambda h, c, w: return_rows_locally(h, c, w, rank=rank, rows=rows))(
        h, jnp.asarray(counts, jnp.int32), w), np.float32)
    send_starts, run_starts = _send_starts(counts), _run_starts(counts, rank)
    for j in range(n):
        s = (rank + j) % n
        for e in range(g):
            c = counts[s, rank, e]
            np.testing.assert_allclose(out[j][send_starts[s, rank, e]:][:c], y[run_starts[s, e]:][:c],
                                       rtol=2e-2, atol=2e-2)


def _exchange_compile_report(topology: str) -> dict:
    """Compile only, for a mock topology of several GPUs (the one real GPU compiles, nothing runs)."""
    jax.config.update("jax_mock_gpu_topology", topology)
    jax.config.update("jax_cuda_visible_devices", "0")
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("x",), axis_types=(AxisType.Explicit,))
    h = jax.ShapeDtypeStruct((n * 4096, 14336), jnp.bfloat16, sharding=NamedSharding(mesh, P("x")))
    counts = jax.ShapeDtypeStruct((n, n, 1), jnp.int32, sharding=NamedSharding(mesh, P()))
    w = jax.ShapeDtypeStruct((n, 14336, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P("x")))
    body = functools.partial(grouped_gemm_reduce_scatter, axis="x", rows=8192)
    fn = jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P(), P("x")), out_specs=P("x"), check_vma=False)
    return compile_report(jax.jit(fn), h, counts, w)


@pytest.mark.gpu
@pytest.mark.parametrize("topology", ["1x2x1", "1x8x1"])
def test_gpu_exchange_kernel_compiles_for_several_gpus(topology):
    """The stores by source (remote_ref TMA stores from the epilogue), the signals and the final waits lower
    through XLA's collective metadata for 2 and 8 ranks (Mixtral's down projection at EP n)."""
    report = report_in_subprocess(__file__, topology, timeout=180, compile_only=True)
    assert report["devices"] == int(topology.split("x")[1]) and report["mosaic_calls"] >= 1, report
    assert report["collective_metadata"], report


if __name__ == "__main__":   # the report the GPU test above runs in a subprocess
    print(json.dumps(_exchange_compile_report(sys.argv[1])))


def test_backward_equals_autodiff_of_the_twin_on_four_devices():
    """The kernel's custom VJP (`reduce_scatter_backward`: the return's transpose, then the GEMM gradients), run
    with the grouped GEMM's plain twins, against autodiff of the all-gather twin."""
    from pallas_kernels.grouped_gemm_reduce_scatter import reduce_scatter_backward
    from pallas_kernels.grouped_gemm_reference import grouped_gemm_dgrad_reference, grouped_gemm_wgrad_reference

    n, g, f, d = 4, 3, 16, 8
    rng = np.random.default_rng(13)
    counts = _counts(rng, n, g, 9)
    rows = int(counts.sum(axis=(1, 2)).max()) + 8
    capacity = int(max(counts[:, p].sum() for p in range(n))) + 8
    source_rows = -(-int(counts.sum(axis=2).max()) // 8) * 8
    h = rng.standard_normal((n, capacity, f)).astype(np.float32)
    w = rng.standard_normal((n, g, f, d)).astype(np.float32)
    d_ret = rng.standard_normal((n, rows, d)).astype(np.float32)
    mesh = jax.make_mesh((n,), ("x",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:n])
    twin = functools.partial(grouped_gemm_reduce_scatter_reference, axis="x", rows=rows)

    def both(h, c, w, d_ret):
        h, w, d_ret = h[0], w[0], d_ret[0]
        _, pull = jax.vjp(lambda h, w: twin(h, c, w), h, w)
        want = pull(d_ret)
        got = reduce_scatter_backward(h, c, w, d_ret, axis="x", source_rows=source_rows,
                                      dgrad=grouped_gemm_dgrad_reference, wgrad=grouped_gemm_wgrad_reference)
        return tuple(a[None] for a in (*want, *got))

    fn = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=(P("x"), P(), P("x"), P("x")), out_specs=P("x")))
    put = lambda a, spec: jax.device_put(jnp.asarray(a), NamedSharding(mesh, spec))  # noqa: E731
    want_dh, want_dw, got_dh, got_dw = fn(put(h, P("x")), put(counts.astype(np.int32), P()), put(w, P("x")),
                                          put(d_ret, P("x")))
    np.testing.assert_allclose(np.asarray(got_dh), np.asarray(want_dh), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(got_dw), np.asarray(want_dw), rtol=1e-4, atol=1e-4)
    assert float(np.abs(np.asarray(want_dh)).max()) > 0
