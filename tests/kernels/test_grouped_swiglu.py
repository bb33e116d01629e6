"""Fused first expert GEMMs + SwiGLU (`pallas_kernels/grouped_swiglu.py`) vs its twin: the three outputs
(h, gate, up), rows past sum(group_sizes) exact zeros, the gradients of h vs autodiff of the twin, bad input.

CPU: GPU interpret mode on small shapes (the interpreter fills every buffer with NaN first, so a row the
kernel never writes fails). GPU (`-m gpu`, MEGASCALE_TEST_GPU=1): the default tiles at a Mixtral-like width.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_swiglu import (SwigluTiling, grouped_swiglu, grouped_swiglu_reference,
                                           grouped_swiglu_with_products)

# 64 columns per item (F = 128: two column tiles), two 64-wide K steps two deep (chained), 3 simulated SMs
SMALL = SwigluTiling(cols=64, tile_k=64, stages=2, num_sms=3)


def _problem(seed, m, d, f, sizes):
    kx, kg, ku, kd = jax.random.split(jax.random.key(seed), 4)
    g = len(sizes)
    x = jax.random.normal(kx, (m, d), jnp.float32).astype(jnp.bfloat16)
    w_gate = (jax.random.normal(kg, (g, d, f), jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16)
    w_up = (jax.random.normal(ku, (g, d, f), jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16)
    dh = jax.random.normal(kd, (m, f), jnp.float32).astype(jnp.bfloat16)
    return x, w_gate, w_up, dh, jnp.asarray(sizes, jnp.int32)


def _rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got)), "non-finite output: an element was never written"
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


CASES = {
    "ragged_with_tail": (200, [50, 0, 7, 100, 0, 23]),           # empty groups, sizes off the tile, a tail
    "rows_not_a_multiple_of_8": (203, [50, 0, 7, 100, 60]),      # padded by the launcher, the last group cut
    "fewer_rows_than_a_tile": (40, [10, 0, 25, 9]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_interpret_outputs_match_the_twin(case):
    m, sizes = CASES[case]
    x, w_gate, w_up, _, gs = _problem(sorted(CASES).index(case), m, 128, 128, sizes)
    got = grouped_swiglu_with_products(x, w_gate, w_up, gs, interpret=True, tiling=SMALL)
    want = grouped_swiglu_reference(x, w_gate, w_up, gs)
    total = int(min(sum(max(s, 0) for s in sizes), m))
    for name, a, b in zip(("h", "gate", "up"), got, want):
        assert a.shape == (m, 128) and a.dtype == jnp.bfloat16, name
        # both round the same fp32-accumulated products to bf16; h is formed from those in fp32
        assert _rel_err(a, b) < 4e-3, name
        assert np.all(np.asarray(a, np.float32)[total:] == 0.0), f"{name}: rows past sum(group_sizes) must be zeros"


def test_interpret_gradients_match_autodiff_of_the_twin():
    x, w_gate, w_up, dh, gs = _problem(5, 200, 128, 128, [50, 0, 7, 100, 0, 23])
    h, pull = jax.vjp(lambda x, a, b: grouped_swiglu(x, a, b, gs, interpret=True, tiling=SMALL), x, w_gate, w_up)
    want_h, want_pull = jax.vjp(lambda x, a, b: grouped_swiglu_reference(x, a, b, gs)[0], x, w_gate, w_up)
    assert _rel_err(h, want_h) < 4e-3
    for name, a, b in zip(("dx", "dw_gate", "dw_up"), pull(dh), want_pull(dh)):
        assert a.dtype == jnp.bfloat16, name
        assert _rel_err(a, b) < 1e-2, name
    assert np.all(np.asarray(pull(dh)[1][1], np.float32) == 0.0), "an empty group's weights get zero gradients"


def test_interpret_default_tiles_unchained_when_no_depth_divides_the_k_steps():
    """D = 384: three 128-wide K steps, which no depth >= 2 divides, so the default (chained) tiles run unchained."""
    x, w_gate, w_up, _, gs = _problem(9, 150, 384, 128, [70, 0, 80])
    got = grouped_swiglu_with_products(x, w_gate, w_up, gs, interpret=True, tiling=SwigluTiling(num_sms=3))
    for a, b in zip(got, grouped_swiglu_reference(x, w_gate, w_up, gs)):
        assert _rel_err(a, b) < 4e-3


@pytest.mark.parametrize("bad, match", [
    (dict(x=(64, 128), w=(2, 96, 128)), "D=128 but the weights have D=96"),
    (dict(x=(64, 128), w=(2, 128, 96)), "F .* must be a multiple of the tile 128"),
    (dict(x=(64, 128), w=(2, 128, 128), up=(2, 128, 256)), "both \\[G, D, F\\]"),
    (dict(x=(64, 128), w=(2, 128, 128), dtype=jnp.float32), "bfloat16 or float16"),
    (dict(x=(64, 128), w=(2, 128, 128), sizes=3), "shape \\(2,\\)"),
])
def test_bad_input_raises_clear_value_error(bad, match):
    dtype = bad.get("dtype", jnp.bfloat16)
    x = jnp.zeros(bad["x"], dtype)
    w = jnp.zeros(bad["w"], dtype)
    up = jnp.zeros(bad.get("up", bad["w"]), dtype)
    gs = jnp.zeros((bad.get("sizes", bad["w"][0]),), jnp.int32)
    with pytest.raises(ValueError, match=match):
        grouped_swiglu(x, w, up, gs, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("sizes", [[1000, 0, 3000, 96], [4096, 0, 0, 0]])
def test_gpu_outputs_and_gradients_match_the_twin(sizes):
    x, w_gate, w_up, dh, gs = _problem(1, 4096 + 256, 1024, 1536, sizes)
    got = jax.jit(lambda *a: grouped_swiglu_with_products(*a))(x, w_gate, w_up, gs)
    want = jax.jit(grouped_swiglu_reference)(x, w_gate, w_up, gs)
    total = min(sum(sizes), x.shape[0])
    for name, a, b in zip(("h", "gate", "up"), got, want):
        assert _rel_err(a, b) < 4e-3, name
        assert np.all(np.asarray(a, np.float32)[total:] == 0.0), name
    grads = jax.jit(lambda *a: jax.vjp(lambda x, u, v: grouped_swiglu(x, u, v, gs), *a)[1](dh))(x, w_gate, w_up)
    want_grads = jax.jit(lambda *a: jax.vjp(lambda x, u, v: grouped_swiglu_reference(x, u, v, gs)[0], *a)[1](dh))(
        x, w_gate, w_up)
    for name, a, b in zip(("dx", "dw_gate", "dw_up"), grads, want_grads):
        assert _rel_err(a, b) < 1e-2, name
