"""GEMM + all-to-all kernel (pallas_kernels/gemm_all_to_all.py) against its twin.

CPU: the twin's meaning on 4 simulated devices (recv[s] = x_s @ w_s[r], from the global arrays); the kernel's
compute side (exchange=False) in GPU interpret mode against an fp32 einsum, both warpgroup splits; the
one-line errors. The interpreter has no semaphores or remote refs, so the exchange itself runs on the GPU:
GPU (`-m gpu`, MEGASCALE_TEST_GPU=1): the compute side for real at Mixtral's shapes; the exchange compiled
for a mock topology of 2 and 8 GPUs. A one-rank mesh cannot run the exchange: Mosaic GPU reaches peers
through XLA's collective metadata only for meshes of more than one device, and falls back to NVSHMEM, which
this XLA build does not have ("NVSHMEM is not supported in XLA", jax 0.11.2 on the H200; a kernel with global
semaphores takes that path even without a remote ref, tests/kernels/test_all_to_all_gemm.py). So running it,
forward and gradients against the twin, needs >= 2 GPUs (the last test; skipped on fewer).
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

from pallas_kernels.gemm_all_to_all import default_tiling, gemm_all_to_all, gemm_all_to_all_reference
from pallas_kernels.grouped_gemm import GemmTiling
from tests.kernels.exchange_reports import (assert_equals_twin, compile_report, hlo_report,
                                            report_in_subprocess, twin_report)


def _operands(seed, n, m, d, f):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, d), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (n, d, f), jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16)
    return x, w


def _f32(a):
    return np.asarray(a, np.float64)


def test_twin_delivers_each_ranks_rows_for_my_columns():
    n, m, d, f = 4, 8, 16, 12
    x_all = jax.random.normal(jax.random.key(0), (n, m, d), jnp.float32)     # rank s's rows
    w_all = jax.random.normal(jax.random.key(1), (n, n, d, f), jnp.float32)  # rank s's w_NDF
    mesh = jax.make_mesh((n,), ("x",), axis_types=(AxisType.Explicit,))
    twin = jax.shard_map(lambda x, w: gemm_all_to_all_reference(x[0], w[0], axis="x")[None], mesh=mesh,
                         in_specs=(P("x"), P("x")), out_specs=P("x"))
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P("x")))  # noqa: E731
    got = twin(put(x_all), put(w_all))                                       # [r, s, m, f]
    want = jnp.einsum("smd,srdf->rsmf", x_all, w_all)
    np.testing.assert_allclose(_f32(got), _f32(want), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("tiling", [
    GemmTiling(tile_m=64, tile_n=64, max_concurrent_steps=2, wg_split="n", grid_tile_width=2),
    GemmTiling(tile_m=64, tile_n=64, max_concurrent_steps=2, wg_split="m", grid_tile_width=2),
], ids=["split_n", "split_m"])
@pytest.mark.parametrize("m, f", [(256, 256), (128, 128)], ids=["16-items-per-step", "2-items-per-step"])
def test_compute_side_in_the_interpreter_equals_the_per_destination_gemms(tiling, m, f):
    """3 simulated SMs: with 2 items per step an SM's items span destination steps (one loop over all)."""
    n, d = 3, 128
    x, w = _operands(0, n, m, d, f)
    got = gemm_all_to_all(x, w, axis=None, exchange=False, interpret=True, tiling=tiling)
    want = jnp.einsum("md,ndf->nmf", x.astype(jnp.float32), w.astype(jnp.float32))
    assert got.shape == (n, m, f) and got.dtype == jnp.bfloat16
    assert np.all(np.isfinite(_f32(got))), "an element was never written (the interpreter fills with NaN)"
    np.testing.assert_allclose(_f32(got), _f32(want), rtol=1e-2, atol=1e-2)   # bf16 output rounding


@pytest.mark.parametrize("shape, kwargs, message", [
    ((2, 200, 128, 256), {}, "M (rows of x_MD)=200 must be a multiple"),
    ((2, 256, 128, 96), {}, "F=96 must be a multiple of 64"),
    ((2, 256, 128, 256), {"interpret": True}, "needs exchange=False"),
])
def test_bad_operands_get_one_line_errors(shape, kwargs, message):
    n, m, d, f = shape
    x, w = _operands(0, n, m, d, f)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        gemm_all_to_all(x, w, axis="x", **kwargs)


def test_default_tiling_takes_the_widest_tile_that_divides_f():
    assert default_tiling(768).cta_n == 256 and default_tiling(640).cta_n == 128


@pytest.mark.gpu
@pytest.mark.parametrize("n, m, d, f", [(8, 4096, 4096, 768), (2, 2048, 2048, 3072)])
def test_gpu_compute_side_equals_the_per_destination_gemms(n, m, d, f):
    """Mixtral's q/k/v columns per destination at n = 8 (768) and n = 2 (3072), run for real: the tiles, the
    step order and the epilogue the exchange uses, with local stores."""
    x, w = _operands(m + f, n, m, d, f)
    got = jax.jit(functools.partial(gemm_all_to_all, axis=None, exchange=False))(x, w)
    want = jnp.einsum("md,ndf->nmf", x, w, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(_f32(got), _f32(want), rtol=1e-2, atol=1e-2)


def _exchange_compile_report(topology: str) -> dict:
    """Compile only, for a mock topology of several GPUs (the one real GPU compiles, nothing runs): the
    exchange kernel inside shard_map over all of them (the forward: the backward is the twin's XLA)."""
    jax.config.update("jax_mock_gpu_topology", topology)
    jax.config.update("jax_cuda_visible_devices", "0")
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("x",), axis_types=(AxisType.Explicit,))
    x = jax.ShapeDtypeStruct((n * 1024, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P("x")))
    w = jax.ShapeDtypeStruct((n * n, 4096, 768), jnp.bfloat16, sharding=NamedSharding(mesh, P("x")))
    fn = jax.shard_map(lambda x, w: gemm_all_to_all(x, w, axis="x")[None], mesh=mesh, in_specs=(P("x"), P("x")),
                       out_specs=P("x"), check_vma=False)
    return compile_report(jax.jit(fn), x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("topology", ["1x2x1", "1x8x1"])
def test_gpu_exchange_kernel_compiles_for_several_gpus(topology):
    """The exchange (remote_ref stores, semaphores) lowers through XLA's collective metadata for 2 and 8
    ranks. Running it needs as many GPUs: the test below."""
    report = report_in_subprocess(__file__, topology, timeout=120, compile_only=True)
    assert report["devices"] == int(topology.split("x")[1]) and report["mosaic_calls"] >= 1, report
    assert report["collective_metadata"], report


def _exchange_run_report() -> dict:
    """On every local GPU (n ranks): the exchange's forward and gradients against the twin's."""
    n = jax.device_count()
    m, d, f = 2048, 4096, 768
    keys = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(keys[0], (n * m, d), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(keys[1], (n * n, d, f), jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16)
    mesh = jax.make_mesh((n,), ("x",), axis_types=(AxisType.Explicit,))
    x, w = (jax.device_put(a, NamedSharding(mesh, P("x"))) for a in (x, w))
    wrap = lambda fn: jax.jit(jax.shard_map(lambda x, w: fn(x, w, axis="x")[None], mesh=mesh,  # noqa: E731
                                            in_specs=(P("x"), P("x")), out_specs=P("x")))
    return twin_report(wrap(gemm_all_to_all), wrap(gemm_all_to_all_reference), x, w, keys[2])


@pytest.mark.gpu
def test_gpus_exchange_equals_the_twin_forward_and_gradients():
    """Several GPUs only (n >= 2 ranks), in a subprocess with a timeout: a wrong semaphore count hangs the
    kernel rather than failing it. The gradients check the custom VJP's wiring (its backward is the twin's)."""
    if jax.device_count() < 2:
        pytest.skip(f"the exchange needs >= 2 GPUs, this machine has {jax.device_count()}")
    assert_equals_twin(report_in_subprocess(__file__, "run", timeout=300))


def _fused_block_compile_report() -> dict:
    """Compile only, 8 mock GPUs (data 2 x intra 4): a MoE block's forward + backward with
    parallel.moe_layer='fused' and parallel.attention_exchange='mosaic' (bf16 activations, the expert GEMMs
    in XLA so that the only Mosaic kernel is this one)."""
    jax.config.update("jax_mock_gpu_topology", "1x8x1")
    jax.config.update("jax_cuda_visible_devices", "0")
    from megascale_jax.model.transformer import Kernels
    from tests.parallel.test_overlap_schedule import block_step_hlo
    shape = {"model.hidden": 256, "model.num_heads": 8, "model.num_kv_heads": 2, "model.head_dim": 64,
             "model.moe.expert_ffn": 256, "model.moe.num_experts": 8, "model.max_seq_len": 512, "train.seq_len": 512}
    hlo = block_step_hlo(dispatch="all_gather", chunks=1, remat="none", moe_layer="fused", shape=shape, batch=2,
                         seq=512, dtype="bfloat16",
                         kernels=Kernels(attention="cudnn", grouped_gemm="xla"), attention_exchange="mosaic")
    return hlo_report(hlo)


@pytest.mark.gpu
def test_gpu_fused_block_with_the_mosaic_exchange_compiles_for_8_gpus():
    """The model path (layouts' RingUlyssesAttention(exchange='mosaic') -> ring_attention's kernel schedule ->
    this kernel) lowers inside the per-device step's shard_map with its typing, forward and backward."""
    report = report_in_subprocess(__file__, "block", timeout=150, compile_only=True)
    assert report["mosaic_calls"] >= 1 and report["collective_metadata"], report


if __name__ == "__main__":   # the reports the GPU tests above run in a subprocess
    reports = {"block": _fused_block_compile_report, "run": _exchange_run_report}
    report = reports[sys.argv[1]]() if sys.argv[1] in reports else _exchange_compile_report(sys.argv[1])
    print(json.dumps(report))
