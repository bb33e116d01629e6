"""All-to-all + GEMM kernel (pallas_kernels/all_to_all_gemm.py) against its twin.

CPU: the twin's meaning on 4 simulated devices (y_r = sum_s x_s[r] @ w[s], from the global arrays) and its
equality with the ring schedule (parallel/ring_attention.py's project_heads_to_seq, a plain output
projection); the kernel's compute side (exchange=False) in GPU interpret mode against an fp32 einsum, both
warpgroup splits; the one-line errors. The interpreter has no semaphores or remote refs, so the exchange
itself runs on the GPU. GPU (`-m gpu`, MEGASCALE_TEST_GPU=1): the compute side for real at Mixtral's
output-projection shapes; the exchange compiled for a mock topology of 2 and 8 GPUs. A one-rank mesh cannot
run the kernel: with its global semaphores it takes Mosaic's collective path, which for one device is NVSHMEM,
absent from this XLA ("NVSHMEM is not supported in XLA", H200, 2026-12-01, even with no remote ref in the
kernel), so running it against the twin needs >= 2 GPUs (the last test; skipped on fewer).
"""
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from megascale_jax.parallel.ring_attention import project_heads_to_seq
from pallas_kernels.all_to_all_gemm import all_to_all_gemm, all_to_all_gemm_reference, default_tiling
from pallas_kernels.grouped_gemm import GemmTiling
from tests.kernels.exchange_reports import (assert_equals_twin, compile_report, report_in_subprocess,
                                            twin_report)


def _operands(seed, n, m, k, d):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (n, m, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (n, k, d), jnp.float32) / np.sqrt(n * k)).astype(jnp.bfloat16)
    return x, w


def _f32(a):
    return np.asarray(a, np.float64)


def test_twin_sums_every_ranks_rows_for_my_chunk():
    n, m, k, d = 4, 8, 6, 10
    x_all = jax.random.normal(jax.random.key(0), (n, n, m, k), jnp.float32)   # rank s's x_NMK
    w = jax.random.normal(jax.random.key(1), (n, k, d), jnp.float32)          # replicated
    mesh = jax.make_mesh((n,), ("x",), axis_types=(AxisType.Explicit,))
    twin = jax.shard_map(lambda x, w: all_to_all_gemm_reference(x[0], w, axis="x")[None], mesh=mesh,
                         in_specs=(P("x"), P()), out_specs=P("x"))
    got = twin(jax.device_put(x_all, NamedSharding(mesh, P("x"))), w)          # [r, m, d]
    want = jnp.einsum("srmk,skd->rmd", x_all, w)
    np.testing.assert_allclose(_f32(got), _f32(want), rtol=2e-6, atol=2e-6)


def test_twin_equals_the_ring_schedule_of_the_output_projection():
    """The kernel's rows are the ring schedule's: o [B, S, h, K] of rank r's heads, as x_NMK[p] = o[:, chunk p]
    (batch-major rows), and wo [H*K, D] as w_NKD[s] = the rows of rank s's heads."""
    n, batch, seq, h, hd, dim = 4, 2, 16, 2, 8, 24
    o_all = jax.random.normal(jax.random.key(2), (n, batch, seq, h, hd), jnp.float32)   # rank s's heads
    wo = jax.random.normal(jax.random.key(3), (n * h * hd, dim), jnp.float32)
    mesh = jax.make_mesh((n,), ("x",), axis_types=(AxisType.Explicit,))

    def project_out(piece, wo, heads, out_dtype=None):
        rows = wo.reshape(n * h, hd, dim)[heads]                                    # [h, K, D] of `heads`
        return jnp.einsum("bshk,hkd->bsd", piece, rows, preferred_element_type=out_dtype)

    def kernel_rows(o, wo):
        o_NMK = jnp.moveaxis(o.reshape(batch, n, seq // n, h * hd), 1, 0).reshape(n, batch * seq // n, h * hd)
        return all_to_all_gemm_reference(o_NMK, wo.reshape(n, h * hd, dim), axis="x").reshape(batch, seq // n, dim)

    # jit: one program each (an eager shard_map runs op by op, ~130 small compiles for the two).
    run = lambda f: jax.jit(jax.shard_map(lambda o, wo: f(o[0], wo)[None], mesh=mesh,  # noqa: E731
                                          in_specs=(P("x"), P()), out_specs=P("x")))
    put = jax.device_put(o_all, NamedSharding(mesh, P("x")))
    ring = run(lambda o, wo: project_heads_to_seq(o, project_out, wo, axis="x"))(put, wo)
    np.testing.assert_allclose(_f32(run(kernel_rows)(put, wo)), _f32(ring), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tiling", [
    GemmTiling(tile_m=64, tile_n=64, max_concurrent_steps=2, wg_split="n", grid_tile_width=2),
    GemmTiling(tile_m=64, tile_n=64, max_concurrent_steps=2, wg_split="m", grid_tile_width=2),
], ids=["split_n", "split_m"])
@pytest.mark.parametrize("n, m, d", [(3, 128, 256), (2, 256, 128)], ids=["3-sources", "2-sources"])
def test_compute_side_in_the_interpreter_equals_the_summed_gemms(tiling, n, m, d):
    """3 simulated SMs, every source's K steps in one pipeline per item."""
    x, w = _operands(n + m, n, m, 128, d)
    got = all_to_all_gemm(x, w, axis=None, exchange=False, interpret=True, tiling=tiling)
    want = jnp.einsum("smk,skd->md", x.astype(jnp.float32), w.astype(jnp.float32))
    assert got.shape == (m, d) and got.dtype == jnp.bfloat16
    assert np.all(np.isfinite(_f32(got))), "an element was never written (the interpreter fills with NaN)"
    np.testing.assert_allclose(_f32(got), _f32(want), rtol=1e-2, atol=1e-2)   # bf16 output rounding


@pytest.mark.parametrize("shape, kwargs, message", [
    ((2, 200, 128, 256), {}, "M (rows per destination)=200 must be a multiple"),
    ((2, 256, 96, 256), {}, "K=96 must be a multiple"),
    ((2, 256, 128, 96), {}, "D=96 must be a multiple of 64"),
    ((2, 256, 128, 256), {"interpret": True}, "needs exchange=False"),
])
def test_bad_operands_get_one_line_errors(shape, kwargs, message):
    n, m, k, d = shape
    x, w = _operands(0, n, m, k, d)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        all_to_all_gemm(x, w, axis="x", **kwargs)


def test_default_tiling_takes_the_widest_tile_that_divides_d():
    assert default_tiling(4096).cta_n == 256 and default_tiling(640).cta_n == 128


@pytest.mark.gpu
@pytest.mark.parametrize("n, m, k, d", [(8, 1024, 512, 4096), (2, 4096, 2048, 4096)])
def test_gpu_compute_side_equals_the_summed_gemms(n, m, k, d):
    """Mixtral's output projection per rank at n = 8 (1024 rows, 512 head columns per source) and n = 2, run
    for real: the tiles and source order the exchange uses, on local rows."""
    x, w = _operands(m + k, n, m, k, d)
    got = jax.jit(functools.partial(all_to_all_gemm, axis=None, exchange=False))(x, w)
    want = jnp.einsum("smk,skd->md", x, w, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(_f32(got), _f32(want), rtol=1e-2, atol=1e-2)


def _exchange_compile_report(topology: str) -> dict:
    """Compile only, for a mock topology of several GPUs (the one real GPU compiles, nothing runs)."""
    jax.config.update("jax_mock_gpu_topology", topology)
    jax.config.update("jax_cuda_visible_devices", "0")
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("x",), axis_types=(AxisType.Explicit,))
    x = jax.ShapeDtypeStruct((n * n, 1024, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("x")))
    w = jax.ShapeDtypeStruct((n, 512, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    fn = jax.shard_map(lambda x, w: all_to_all_gemm(x, w, axis="x")[None], mesh=mesh, in_specs=(P("x"), P()),
                       out_specs=P("x"), check_vma=False)
    return compile_report(jax.jit(fn), x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("topology", ["1x2x1", "1x8x1"])
def test_gpu_exchange_kernel_compiles_for_several_gpus(topology):
    """The exchange (remote_ref stores from the sending CTAs, per-step semaphores, waits inside the GEMM's
    loads) lowers through XLA's collective metadata for 2 and 8 ranks. Running it: the test below."""
    report = report_in_subprocess(__file__, topology, timeout=120, compile_only=True)
    assert report["devices"] == int(topology.split("x")[1]) and report["mosaic_calls"] >= 1, report
    assert report["collective_metadata"], report


def _exchange_run_report() -> dict:
    """On every local GPU (n ranks): the exchange's forward and gradients against the twin's."""
    n = jax.device_count()
    m, k, d = 1024, 512, 4096
    keys = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(keys[0], (n * n, m, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(keys[1], (n, k, d), jnp.float32) / np.sqrt(n * k)).astype(jnp.bfloat16)
    mesh = jax.make_mesh((n,), ("x",), axis_types=(AxisType.Explicit,))
    x, w = jax.device_put(x, NamedSharding(mesh, P("x"))), jax.device_put(w, NamedSharding(mesh, P()))
    wrap = lambda fn: jax.jit(jax.shard_map(lambda x, w: fn(x, w, axis="x")[None], mesh=mesh,  # noqa: E731
                                            in_specs=(P("x"), P()), out_specs=P("x")))
    return twin_report(wrap(all_to_all_gemm), wrap(all_to_all_gemm_reference), x, w, keys[2])


@pytest.mark.gpu
def test_gpus_exchange_equals_the_twin_forward_and_gradients():
    """Several GPUs only (n >= 2 ranks), in a subprocess with a timeout: a wrong semaphore count hangs the
    kernel rather than failing it. The gradients check the custom VJP's wiring (its backward is the twin's)."""
    if jax.device_count() < 2:
        pytest.skip(f"the exchange needs >= 2 GPUs, this machine has {jax.device_count()}")
    assert_equals_twin(report_in_subprocess(__file__, "run", timeout=300))


if __name__ == "__main__":   # the reports the GPU tests above run in a subprocess
    report = _exchange_run_report() if sys.argv[1] == "run" else _exchange_compile_report(sys.argv[1])
    print(json.dumps(report))
