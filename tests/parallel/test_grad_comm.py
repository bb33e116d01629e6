"""grad_comm (fp32 | bf16 | fp8 DP gradient reduction) and hlo_bytes (collective bytes from HLO text).

Error bounds, per element of the reduced sum s = sum_r g_r (each contribution is rounded ONCE, then
summed in fp32, so errors add up over ranks and never compound):
  bf16: round-to-nearest with 8 significant bits -> |err_r| <= 2^-8 |g_r|   (unit roundoff u = 2^-8 incl.
        the implicit bit; we use 2^-8 to leave room for ties), so |s_bf16 - s| <= 2^-8 sum_r |g_r|.
  fp8 e4m3 with scale = block amax / 448: normal numbers keep 4 significant bits -> 2^-4 |g_r|; values
        under the smallest normal (2^-6 * scale) are on a grid of 2^-9 * scale -> abs error 2^-10 * scale.
  Plus fp32 summation slack (1e-6 relative to sum |g_r|).
"""
import jax
import numpy as np
import pytest
from jax import P, lax

from megascale_jax.parallel import grad_comm, hlo_bytes

DP = 8
BLOCK = 128
LENGTH = DP * BLOCK * 6  # 6 fp8 blocks per rank slice


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((DP,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))


@pytest.fixture(scope="module")
def per_rank_grads():
    """[dp, L] local gradients with block magnitudes spread over 6 decades, one all-zero block, tiny values."""
    rng = np.random.default_rng(0)
    g = rng.standard_normal((DP, LENGTH)).astype(np.float32)
    block_scale = 10.0 ** rng.uniform(-4, 2, size=(DP, LENGTH // BLOCK))
    g *= np.repeat(block_scale, BLOCK, axis=1).astype(np.float32)
    g[:, 3 * BLOCK:4 * BLOCK] = 0.0
    g[:, 5 * BLOCK:5 * BLOCK + 7] = 1e-30  # far below fp8's subnormal step: must not become NaN
    return g


def _reduce(mesh, grads_RL, mode):
    fn = jax.shard_map(lambda x: grad_comm.reduce_scatter_gradients(x[0], axis="data", mode=mode)[None],
                       mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    sharded = jax.device_put(grads_RL, jax.NamedSharding(mesh, P("data")))
    out = np.asarray(jax.jit(fn)(sharded))
    return out.reshape(-1), jax.jit(fn).lower(sharded).compile().as_text()


@pytest.fixture(scope="module")
def reduced(mesh, per_rank_grads):
    return {mode: _reduce(mesh, per_rank_grads, mode) for mode in grad_comm.GRAD_COMM_MODES}


def test_fp32_equals_exact_sum(reduced, per_rank_grads):
    exact = per_rank_grads.astype(np.float64).sum(0)
    np.testing.assert_allclose(reduced["fp32"][0], exact, rtol=1e-5, atol=1e-6 * np.abs(per_rank_grads).sum(0).max())


@pytest.mark.parametrize("mode", ["bf16", "fp8"])
def test_compressed_equals_plain_twin(reduced, per_rank_grads, mode):
    twin = np.concatenate([np.asarray(grad_comm.reduce_scatter_gradients_reference(
        per_rank_grads, r, mode=mode, block_size=BLOCK)) for r in range(DP)])
    sum_abs = np.abs(per_rank_grads).sum(0)
    np.testing.assert_array_less(np.abs(reduced[mode][0] - twin), 1e-6 * sum_abs + 1e-35)


def _error_bound(per_rank_grads, mode):
    sum_abs = np.abs(per_rank_grads).astype(np.float64).sum(0)
    if mode == "bf16":
        return 2.0 ** -8 * sum_abs + 1e-6 * sum_abs
    amax_RN = np.abs(per_rank_grads).reshape(DP, -1, BLOCK).max(-1)
    subnormal_step_RL = np.repeat(2.0 ** -10 * amax_RN / grad_comm.FP8_MAX, BLOCK, axis=1)
    return 2.0 ** -4 * sum_abs + subnormal_step_RL.sum(0) + 1e-6 * sum_abs


@pytest.mark.parametrize("mode", ["bf16", "fp8"])
def test_compression_error_within_rounding_bound(reduced, per_rank_grads, mode):
    exact = per_rank_grads.astype(np.float64).sum(0)
    err = np.abs(reduced[mode][0] - exact)
    assert np.all(np.isfinite(reduced[mode][0]))
    np.testing.assert_array_less(err, _error_bound(per_rank_grads, mode) + 1e-35)
    rel = float(np.linalg.norm(np.asarray(reduced[mode][0]) - exact) / np.linalg.norm(exact))
    print(f"\n{mode}: relative L2 error of the reduced gradient vs exact sum = {rel:.3e}")
    assert rel > 0, "no rounding happened: the payload was not compressed"
    assert rel < {"bf16": 2.0 ** -8, "fp8": 2.0 ** -4}[mode]
    np.testing.assert_array_equal(reduced[mode][0][3 * BLOCK:4 * BLOCK], 0.0)  # zero block stays exactly 0


def test_hlo_wire_bytes_half_and_under_30_percent(reduced):
    totals = {m: hlo_bytes.collective_bytes(reduced[m][1]) for m in grad_comm.GRAD_COMM_MODES}
    assert set(totals["fp32"]) == {"reduce-scatter"}
    assert set(totals["bf16"]) == {"all-to-all"} and set(totals["fp8"]) == {"all-to-all"}
    fp32_bytes = totals["fp32"]["reduce-scatter"]
    assert fp32_bytes == 4 * LENGTH
    assert totals["bf16"]["all-to-all"] / fp32_bytes == 0.5
    fp8_ratio = totals["fp8"]["all-to-all"] / fp32_bytes
    assert fp8_ratio <= 0.30 and fp8_ratio == pytest.approx((1 + 4 / BLOCK) / 4)
    for mode in grad_comm.GRAD_COMM_MODES:
        wire = hlo_bytes.collective_bytes(reduced[mode][1], field="wire_bytes")
        assert sum(wire.values()) == grad_comm.wire_bytes(LENGTH, DP, mode, BLOCK)
    fp8_dtypes = {d for c in hlo_bytes.parse_collectives(reduced["fp8"][1]) for d in c.dtypes}
    assert fp8_dtypes == {"u8", "f32"}  # one byte per element + the fp32 block scales


def test_all_reduce_gradients_gives_the_mean_of_a_pytree(mesh):
    """The plain-DP form the step's replicated updater uses: a pytree of local gradients -> their mean."""
    rng = np.random.default_rng(1)
    grads_R = {"w": rng.standard_normal((DP, 5, 7)).astype(np.float32),
               "b": rng.standard_normal((DP, 3)).astype(np.float32)}

    spec = jax.tree.map(lambda _: P("data"), grads_R)
    sharded = jax.device_put(grads_R, jax.tree.map(lambda s: jax.NamedSharding(mesh, s), spec))
    mean = jax.tree.map(lambda x: x.mean(0), grads_R)
    for mode, rtol in (("fp32", 1e-6), ("bf16", 2 ** -8)):
        def reduce(g, mode=mode):
            return grad_comm.all_reduce_gradients(jax.tree.map(lambda x: x[0], g), axis="data", mode=mode)
        got = jax.jit(jax.shard_map(reduce, mesh=mesh, in_specs=(spec,), out_specs=P()))(sharded)
        for key in mean:   # bf16: each contribution rounded once -> error <= 2^-8 of the mean of |g|
            bound = rtol * np.abs(grads_R[key]).mean(0) + 1e-7
            assert np.all(np.abs(np.asarray(got[key]) - mean[key]) <= bound), (mode, key)


def test_bad_arguments_raise(mesh):
    with pytest.raises(ValueError, match="mode="):
        grad_comm.wire_bytes(10, 2, "int4")
    with pytest.raises(ValueError, match="padded_length"):
        _reduce(mesh, np.zeros((DP, DP * BLOCK + DP), np.float32), "bf16")
    with pytest.raises(ValueError, match="block_size"):
        grad_comm.padded_length(10, 2, block_size=0)
    assert grad_comm.padded_length(1, DP, BLOCK) == DP * BLOCK
    assert grad_comm.padded_length(DP * BLOCK + 1, DP, BLOCK) == 2 * DP * BLOCK


# ---- hlo_bytes -----------------------------------------------------------------------------------------

def test_parse_collectives_on_compiled_cpu_hlo():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)

    def body(x):  # x: f32[1, 64] per device = 256 bytes
        a = lax.all_gather(x, "model", tiled=True)
        b = lax.psum(x, "data")
        c = lax.ppermute(x, "model", [(i, (i + 1) % 4) for i in range(4)])
        d = lax.psum_scatter(x.reshape(-1), "model", tiled=True)
        return a.sum() + b.sum() + c.sum() + d.sum()

    x = jax.device_put(np.ones((8, 64), np.float32), jax.NamedSharding(mesh, P(("data", "model"))))
    text = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("data", "model")), out_specs=P(),
                                 check_vma=False)).lower(x).compile().as_text()
    found = {c.kind: c for c in hlo_bytes.parse_collectives(text)}
    assert set(found) == {"all-gather", "all-reduce", "collective-permute", "reduce-scatter"}
    assert (found["all-gather"].buffer_bytes, found["all-gather"].group_size) == (1024, 4)
    assert found["all-gather"].wire_bytes == 768
    assert (found["all-reduce"].buffer_bytes, found["all-reduce"].group_size) == (256, 2)
    assert found["all-reduce"].wire_bytes == 256  # 2 * (g-1)/g * 256
    assert (found["reduce-scatter"].operand_bytes, found["reduce-scatter"].result_bytes) == (256, 64)
    assert found["collective-permute"].num_pairs == 8 and found["collective-permute"].wire_bytes == 256


# Lines of compiled HLO from 2 H200s (jax 0.11.2, launch/env.sh flags): async start/done pairs and
# operands that are named, not typed.
_GPU_HLO = """
  %param.1 = f32[4,256]{1,0} parameter(0), sharding={mesh['data'=2], [{'data'}, {}]}
  %bitcast.4 = f32[1024]{0} bitcast(%param.1)
  %bitcast.3.0 = f32[2,1024]{1,0} bitcast(%loop_select_fusion)
  %bitcast.2.0 = u8[2,1024,128]{2,1,0} bitcast(%loop_convert_fusion)
  %all-to-all-start.1 = ((f32[2,1024]{1,0}), f32[2,1024]{1,0}) all-to-all-start(%bitcast.3.0), channel_id=1, replica_groups=mesh['data'=2] {'data'}, dimensions={0}
  %all-to-all-done.1 = f32[2,1024]{1,0} all-to-all-done(%all-to-all-start.1)
  %all_to_all.6.2 = u8[2,1024,128]{2,1,0} all-to-all(%bitcast.2.0), channel_id=1, replica_groups=mesh['data'=2] {'data'}, dimensions={0}
  %all-gather-start = (f32[4,256]{1,0}, f32[8,256]{1,0}) all-gather-start(%param.1), channel_id=2, replica_groups=[1,2]<=[2], dimensions={0}
  %all-gather-done = f32[8,256]{1,0} all-gather-done(%all-gather-start)
  %reduce-scatter-start = ((f32[1024]{0}), f32[512]{0}) reduce-scatter-start(%bitcast.4), channel_id=1, replica_groups={{0,1}}, use_global_device_ids=true, dimensions={0}, to_apply=%region_4.0
  %reduce-scatter-done = f32[512]{0} reduce-scatter-done(%reduce-scatter-start)
"""


def test_parse_collectives_gpu_async_counted_once():
    found = hlo_bytes.parse_collectives(_GPU_HLO)
    assert [(c.kind, c.is_async) for c in found] == [
        ("all-to-all", True), ("all-to-all", False), ("all-gather", True), ("reduce-scatter", True)]
    assert all(c.group_size == 2 for c in found)
    assert hlo_bytes.collective_bytes(_GPU_HLO) == {
        "all-to-all": 2 * 1024 * 4 + 2 * 1024 * 128, "all-gather": 8 * 256 * 4, "reduce-scatter": 4096}
    with pytest.raises(ValueError, match="field="):
        hlo_bytes.collective_bytes(_GPU_HLO, field="bytes")
