"""pallas_kernels/swiglu_backward.py against its plain twin, autodiff of jax.nn.silu(gate) * up: float32 to rounding,
bf16 within one rounding of the float32 autodiff at the same inputs (the kernel computes in float32 and rounds once),
sizes below, at and across a program's block, in interpret mode on the CPU and compiled on the GPU (`-m gpu`,
MEGASCALE_TEST_GPU=1) at an expert shape."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.swiglu_backward import BLOCK, swiglu_backward, swiglu_with_kernel_backward


def _plain(gate, up):
    return jax.nn.silu(gate) * up


def _inputs(shape, dtype, seed=0):
    kg, ku, kd = jax.random.split(jax.random.key(seed), 3)
    return [(s * jax.random.normal(k, shape, jnp.float32)).astype(dtype) for k, s in ((kg, 4.0), (ku, 2.0), (kd, 1.0))]


def _bf16_step(x):
    """bfloat16's spacing at |x| (8 significand bits)."""
    return 2.0 ** (np.floor(np.log2(np.maximum(np.abs(np.asarray(x, np.float64)), 1e-30))) - 7)


def _check(shape, dtype, interpret=True, **kw):
    gate, up, dh = _inputs(shape, dtype)
    h, pull = jax.vjp(lambda g, u: swiglu_with_kernel_backward(g, u, interpret), gate, up)
    np.testing.assert_array_equal(h, _plain(gate, up))
    got = pull(dh) if not kw else swiglu_backward(gate, up, dh, interpret=interpret, **kw)
    want = jax.vjp(_plain, gate.astype(jnp.float32), up.astype(jnp.float32))[1](dh.astype(jnp.float32))
    for g, w in zip(got, want):
        assert g.dtype == dtype and g.shape == shape
        if dtype == jnp.float32:
            np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-6)
        else:   # one rounding of the float32 value
            err = np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64))
            assert np.all(err <= _bf16_step(w)), float(err.max())


@pytest.mark.parametrize("shape", [(3, 5), (4, BLOCK // 4), (7, BLOCK // 4 + 3)])
def test_interpret_float32_matches_autodiff(shape):
    _check(shape, jnp.float32)


def test_interpret_bfloat16_is_one_rounding_of_float32_autodiff():
    _check((33, 1408), jnp.bfloat16)


def test_interpret_small_blocks_and_a_masked_tail():
    _check((9, 37), jnp.float32, block=64, num_warps=4)


def test_bad_shapes_and_blocks_are_refused():
    g = jnp.ones((4, 8))
    with pytest.raises(ValueError, match="one shape"):
        swiglu_backward(g, g, jnp.ones((4, 9)), interpret=True)
    with pytest.raises(ValueError, match="power of 2"):
        swiglu_backward(g, g, g, interpret=True, block=96)
    with pytest.raises(ValueError, match="int32"):   # no leading axis to cut along
        swiglu_backward(jnp.ones(40), jnp.ones(40), jnp.ones(40), interpret=True, max_elements=32)


def test_arrays_past_int32_indices_run_as_row_blocks():
    """Past `max_elements` (2**31 - 1: int32 indices; mixtral_small's 16 x 4096 step has 1.88 G expert elements)
    the rows are cut into blocks, one call each: the same values as one call; and a 2**31-element array lowers."""
    gate, up, dh = _inputs((23, 37), jnp.bfloat16)
    want = swiglu_backward(gate, up, dh, interpret=True, block=64)
    got = swiglu_backward(gate, up, dh, interpret=True, block=64, max_elements=5 * 37)   # 5 rows a call, 5 calls
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    big = jax.ShapeDtypeStruct((65536, 32768), jnp.bfloat16)   # 2**31 elements
    out = jax.eval_shape(lambda a: swiglu_backward(a, a, a), big)
    assert [o.shape for o in out] == [big.shape, big.shape]


def test_empty_rows():
    d_gate, d_up = swiglu_backward(*_inputs((0, 64), jnp.bfloat16), interpret=True)
    assert d_gate.shape == d_up.shape == (0, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096 + 17, 1408), (2048, 14336)])
def test_gpu_matches_autodiff(shape):
    _check(shape, jnp.bfloat16, interpret=False)


def test_the_train_step_with_the_kernel_backward_lowers_for_the_gpu(monkeypatch):
    """kernels.swiglu='separate_pallas_bwd' in the manual SP+EP step, lowered for CUDA on the CPU: the kernel becomes
    a Triton call inside the step's checked shard_map (its outputs typed as varying), in the backward only."""
    from tests.kernels.triton_lowering import MODEL_TRACES, lowered_train_step_for_cuda

    text = lowered_train_step_for_cuda(monkeypatch, swiglu="separate_pallas_bwd")
    calls = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
    # the scanned MoE layer's backward, once per traced model
    assert len(calls) == MODEL_TRACES and all('name = "swiglu_backward"' in c for c in calls), calls


@pytest.mark.parametrize("moe_layer", ["autodiff", "macro"])
def test_the_kernel_backward_lowers_for_dense_layers_and_shared_experts(monkeypatch, moe_layer):
    """A DeepSeekMoE-like stack (a dense first layer, shared experts) in the manual SP+EP step, lowered for CUDA on the
    CPU: a Triton call per activation's backward (the dense layer's, the experts' and the shared experts'), with
    the autodiff MoE layer and with the macro layer's hand-written backward."""
    from tests.kernels.triton_lowering import MODEL_TRACES, lowered_train_step_for_cuda

    overrides = {"model.num_layers": 3, "model.num_dense_layers": 1, "model.moe.num_shared_experts": 1,
                 "parallel.moe_layer": moe_layer}
    text = lowered_train_step_for_cuda(monkeypatch, overrides, swiglu="separate_pallas_bwd",
                                       dense_swiglu="separate_pallas_bwd")
    calls = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
    assert len(calls) == 3 * MODEL_TRACES and all('name = "swiglu_backward"' in c for c in calls), calls
