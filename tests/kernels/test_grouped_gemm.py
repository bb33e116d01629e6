"""Grouped GEMM kernel vs `lax.ragged_dot` in fp32: forward, input gradient, weight gradient; the public
`grouped_gemm_dgrad` / `grouped_gemm_wgrad` vs their `*_reference` twins, and the custom VJP built from them.

CPU: the Mosaic GPU kernels run in GPU interpret mode on small shapes; the interpreter fills every
buffer with NaN before the kernel runs, so an element the kernel never writes fails the comparison.
GPU (`-m gpu`, MEGASCALE_TEST_GPU=1): the same checks at larger shapes with the default tuning, the
output memory poisoned with NaN just before each run.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels._grouped_tiles as grouped_tiles
import pallas_kernels.grouped_gemm as gg
from pallas_kernels.grouped_gemm import (GemmTiling, GroupedGemmTuning, default_tuning, grouped_gemm,
                                         grouped_gemm_dgrad, grouped_gemm_dgrad_reference, grouped_gemm_reference,
                                         grouped_gemm_wgrad, grouped_gemm_wgrad_reference)
from pallas_kernels._default_tuning import PINGPONG_TILING, default_kernel_tuning

# Small tiles give many group boundaries per tile in few rows; both warpgroup splits are covered.
SMALL_TUNING = GroupedGemmTuning(
    fwd=GemmTiling(tile_m=64, tile_n=64, max_concurrent_steps=2, wg_split="n", grid_tile_width=2),
    dgrad=GemmTiling(tile_m=64, tile_n=64, max_concurrent_steps=2, wg_split="m", grid_tile_width=2),
    wgrad=GemmTiling(tile_m=64, tile_n=64, max_concurrent_steps=2, wg_split="m", grid_tile_width=2),
    num_sms=3)


def _random_problem(seed, m, k, n, group_sizes):
    kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
    g = len(group_sizes)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (g, k, n), jnp.float32).astype(jnp.bfloat16)
    dy = jax.random.normal(kd, (m, n), jnp.float32)
    return x, w, dy, jnp.asarray(group_sizes, jnp.int32)


def _rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got)), "non-finite output: an element was never written"
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def _ragged_dot_f32(x, w, group_sizes):
    return jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), group_sizes,
                              precision=jax.lax.Precision.HIGHEST)


def _check_fwd_bwd(x, w, dy, group_sizes, **kwargs):
    """fp32 output: products of bf16 values are exact in fp32, so y agrees to fp32 rounding; dx and dw
    come back in bf16 (the input dtypes), so they agree to bf16 rounding (~2^-9 relative)."""
    fn = lambda x, w: grouped_gemm(x, w, group_sizes, preferred_element_type=jnp.float32, **kwargs)  # noqa: E731

    @jax.jit   # one program: eagerly the interpreted kernels were ~90 small compiles
    def forward_and_backward(x, w, dy):
        y, vjp = jax.vjp(fn, x, w)
        return y, *vjp(dy)

    y, dx, dw = forward_and_backward(x, w, dy)
    ref_y, ref_vjp = jax.vjp(lambda x, w: _ragged_dot_f32(x, w, group_sizes), x.astype(jnp.float32),
                             w.astype(jnp.float32))
    ref_dx, ref_dw = ref_vjp(dy.astype(jnp.bfloat16).astype(jnp.float32))
    assert y.dtype == jnp.float32 and dx.dtype == x.dtype and dw.dtype == w.dtype
    assert _rel_err(y, ref_y) < 1e-5
    assert _rel_err(dx, ref_dx) < 4e-3
    assert _rel_err(dw, ref_dw) < 4e-3
    total = int(np.minimum(np.sum(np.asarray(group_sizes)), x.shape[0]))
    assert np.all(np.asarray(y)[total:] == 0.0), "rows past sum(group_sizes) must be exact zeros"
    assert np.all(np.asarray(dx)[total:] == 0.0)
    for g in np.flatnonzero(np.asarray(group_sizes) == 0):
        assert np.all(np.asarray(dw[g]) == 0.0), f"empty group {g} must get a zero weight gradient"


INTERPRET_CASES = {
    # empty groups, sizes off the tile, sum(group_sizes) < M (a zero tail), a group inside one tile
    "ragged_with_tail": (200, [50, 0, 7, 100, 0, 23]),
    # skewed: every token in one group, the others empty
    "all_in_one_group": (136, [0, 136, 0]),
    # fewer rows than one row tile, and rows not a multiple of 8: the launcher pads them (a group cut at M)
    "fewer_rows_than_a_tile": (40, [10, 0, 25, 9]),
    "rows_not_a_multiple_of_8": (203, [50, 0, 7, 100, 60]),
}


@pytest.mark.parametrize("zero_tail", ["kernel", "mask"])
@pytest.mark.parametrize("case", sorted(INTERPRET_CASES))
def test_interpret_forward_and_gradients_match_ragged_dot(case, zero_tail):
    m, sizes = INTERPRET_CASES[case]
    x, w, dy, group_sizes = _random_problem(sorted(INTERPRET_CASES).index(case), m, 128, 128, sizes)
    tuning = dataclasses.replace(SMALL_TUNING, zero_tail=zero_tail)
    _check_fwd_bwd(x, w, dy, group_sizes, interpret=True, tuning=tuning)


@pytest.mark.parametrize("zero_tail", ["kernel", "mask"])
def test_interpret_negative_sizes_count_as_zero_like_the_twin(zero_tail):
    """Negative group sizes (invalid, but traced values cannot be rejected) count as 0 in the kernels' tables
    and in the twin; the masked tail must use the same count (it once zeroed computed rows)."""
    x, w, dy, _ = _random_problem(8, 72, 128, 128, [0, 0, 0])
    gs = jnp.asarray([-5, 30, 7], jnp.int32)
    tuning = dataclasses.replace(SMALL_TUNING, zero_tail=zero_tail)
    f32 = dict(preferred_element_type=jnp.float32, interpret=True, tuning=tuning)
    got = (grouped_gemm(x, w, gs, **f32), grouped_gemm_dgrad(dy.astype(jnp.bfloat16), w, gs, **f32))
    want = (grouped_gemm_reference(x, w, gs, jnp.float32),
            grouped_gemm_dgrad_reference(dy.astype(jnp.bfloat16), w, gs, jnp.float32))
    for a, b in zip(got, want):
        assert _rel_err(a, b) < 1e-5
        assert np.all(np.asarray(a)[37:] == 0.0) and np.any(np.asarray(a)[25:30] != 0.0)


def _check_unwritten_tail(m, sizes, interpret, tuning):
    """zero_tail='none' (torch._grouped_mm's contract): rows past sum(sizes) of y and dx are not written,
    the computed rows equal the twin's, and the weight gradient stays exact with NaN in x's tail (its
    rows are deselected in SMEM; a 0/1 multiply would give NaN)."""
    x, w, dy, group_sizes = _random_problem(len(sizes) + m, m, 128, 128, sizes)
    total = sum(sizes)
    x_nan_tail = x.at[total:].set(jnp.nan)
    tuning = dataclasses.replace(tuning, zero_tail="none")
    fn = lambda x, w: grouped_gemm(x, w, group_sizes, preferred_element_type=jnp.float32,  # noqa: E731
                                   interpret=interpret, tuning=tuning)
    y, vjp = jax.vjp(fn, x_nan_tail, w)
    dx, dw = vjp(dy)
    ref_y, ref_vjp = jax.vjp(lambda x, w: _ragged_dot_f32(x, w, group_sizes), x.astype(jnp.float32),
                             w.astype(jnp.float32))
    ref_dx, ref_dw = ref_vjp(dy.astype(jnp.bfloat16).astype(jnp.float32))
    assert _rel_err(y[:total], ref_y[:total]) < 1e-5
    assert _rel_err(dx[:total], ref_dx[:total]) < 4e-3
    assert _rel_err(dw, ref_dw) < 4e-3
    return np.asarray(y[total:]), np.asarray(dx[total:])


def test_interpret_unwritten_tail_keeps_computed_rows_and_weight_gradient_exact():
    y_tail, dx_tail = _check_unwritten_tail(200, [50, 0, 7, 100, 0, 23], True, SMALL_TUNING)
    # The interpreter fills unwritten outputs with NaN: all NaN means no tail tile ran.
    assert np.all(np.isnan(y_tail)) and np.all(np.isnan(dx_tail)), "zero_tail='none' must skip the tail"


@pytest.mark.parametrize("zero_tail", ["kernel", "mask"])
def test_interpret_weight_gradient_ignores_nan_in_x_rows_outside_the_groups(zero_tail):
    """Also with a written tail: the wgrad kernel's row mask is a select, so x's tail may be an unwritten
    buffer (NaN) with the gradient exact."""
    x, w, dy, gs = _random_problem(11, 136, 128, 128, [40, 0, 57])
    tuning = dataclasses.replace(SMALL_TUNING, zero_tail=zero_tail)
    got = grouped_gemm_wgrad(x.at[97:].set(jnp.nan), dy.astype(jnp.bfloat16), gs,
                             preferred_element_type=jnp.float32, interpret=True, tuning=tuning)
    want = grouped_gemm_wgrad_reference(x, dy.astype(jnp.bfloat16), gs, jnp.float32)
    assert _rel_err(got, want) < 1e-5


PINGPONG_SMALL = GemmTiling(tile_m=64, tile_n=64, max_concurrent_steps=3, grid_tile_width=2, schedule="pingpong")

# Epilogue and K-tile variants of the small tiles: two staging slots (odd and even chunk counts per tile),
# 128-wide K steps. The tail case stores zero tiles straight from SMEM.
VARIANT_TUNINGS = {
    "epi_slots2": GroupedGemmTuning(
        fwd=GemmTiling(tile_m=64, tile_n=128, epi_tile_n=64, epi_slots=2, max_concurrent_steps=2, wg_split="n"),
        dgrad=GemmTiling(tile_m=64, tile_n=64, epi_tile_n=64, epi_slots=2, max_concurrent_steps=2, wg_split="m"),
        wgrad=GemmTiling(tile_m=64, tile_n=64, epi_slots=2, max_concurrent_steps=2, wg_split="m"), num_sms=3),
    "tile_k128": GroupedGemmTuning(
        fwd=GemmTiling(tile_m=64, tile_n=64, tile_k=128, max_concurrent_steps=2, wg_split="n"),
        dgrad=GemmTiling(tile_m=64, tile_n=64, tile_k=128, max_concurrent_steps=2, wg_split="m"),
        wgrad=SMALL_TUNING.wgrad, num_sms=3),
    # row tiles on one grid over all rows (a tile straddling a boundary computed once per group)
    "grid_row_tiles": dataclasses.replace(SMALL_TUNING, row_tiles="grid"),
    # the reduction split in two (fp32 partials summed by the launcher), plain and chained
    "split_k2": dataclasses.replace(SMALL_TUNING, fwd=dataclasses.replace(SMALL_TUNING.fwd, split_k=2),
                                    dgrad=dataclasses.replace(SMALL_TUNING.dgrad, split_k=2)),
    "split_k2_chained": dataclasses.replace(
        SMALL_TUNING, fwd=dataclasses.replace(SMALL_TUNING.fwd, split_k=2, chain_items=True),
        dgrad=dataclasses.replace(SMALL_TUNING.dgrad, split_k=2, chain_items=True)),
    # the ping-pong schedule (each warpgroup on its own work items, one ring of stages), forward and dgrad;
    # depth 3 over 4 K steps: the ring's stages and phases wrap inside and across items
    "pingpong": dataclasses.replace(SMALL_TUNING, fwd=PINGPONG_SMALL, dgrad=PINGPONG_SMALL),
    "pingpong_mask_tail": dataclasses.replace(SMALL_TUNING, fwd=PINGPONG_SMALL, dgrad=PINGPONG_SMALL,
                                              zero_tail="mask"),
    "pingpong_wgrad": dataclasses.replace(SMALL_TUNING, wgrad=PINGPONG_SMALL),
    # the cooperative weight gradient on one ring across items (chain_items), warpgroups along M and along N
    "chained_wgrad": dataclasses.replace(SMALL_TUNING, wgrad=dataclasses.replace(SMALL_TUNING.wgrad, chain_items=True)),
    "chained_wgrad_split_n": dataclasses.replace(
        SMALL_TUNING, wgrad=dataclasses.replace(SMALL_TUNING.wgrad, chain_items=True, wg_split="n")),
    # chained K pipelines across an SM's work items (START / STEADY / STOP), with and without a tail
    "chain_items": GroupedGemmTuning(
        fwd=dataclasses.replace(SMALL_TUNING.fwd, chain_items=True),
        dgrad=dataclasses.replace(SMALL_TUNING.dgrad, chain_items=True), wgrad=SMALL_TUNING.wgrad, num_sms=3),
}


# Ping-pong edge cases, each kernel against its twin with the interpreter's race detector on (it flags an SMEM
# stage written while read, e.g. a stage released before its wgmma): fewer K steps than ring stages, the
# shallowest ring, CTAs with no or one item (8 SMs) and one CTA with every item (1 SM), trailing empty groups.
PINGPONG_EDGE_CASES = {
    "k_steps_below_depth": (136, 128, 128, [40, 0, 57, 39], dict(), 3),
    "two_stages": (200, 256, 128, [50, 0, 7, 100, 0, 23], dict(max_concurrent_steps=2), 3),
    "ctas_with_no_or_one_item": (64, 128, 64, [30, 34], dict(), 8),
    "one_cta": (200, 256, 128, [50, 0, 7, 100, 0, 23], dict(), 1),
    "trailing_empty_groups": (160, 128, 128, [100, 60, 0, 0, 0], dict(), 3),
}


@pytest.mark.parametrize("case", sorted(PINGPONG_EDGE_CASES))
def test_interpret_pingpong_edge_cases_match_references_without_races(case, monkeypatch):
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as interpreter
    m, k, n, sizes, overrides, num_sms = PINGPONG_EDGE_CASES[case]
    monkeypatch.setattr(grouped_tiles, "INTERPRET_PARAMS", {"detect_races": True})
    cfg = dataclasses.replace(PINGPONG_SMALL, **overrides)
    tuning = GroupedGemmTuning(fwd=cfg, dgrad=cfg, wgrad=cfg, num_sms=num_sms)
    x, w, dy, group_sizes = _random_problem(31, m, k, n, sizes)
    dy = dy.astype(jnp.bfloat16)
    f32 = dict(preferred_element_type=jnp.float32, interpret=True, tuning=tuning)
    interpreter.reset_gpu_interpret_mode_state()
    try:
        assert _rel_err(grouped_gemm(x, w, group_sizes, **f32),
                        grouped_gemm_reference(x, w, group_sizes, jnp.float32)) < 1e-5
        _check_dgrad_wgrad(x, w, dy, group_sizes, interpret=True, tuning=tuning)   # fp32 outputs
        assert not interpreter.get_races().races_found, "the interpreter saw an SMEM race"
    finally:
        interpreter.reset_gpu_interpret_mode_state()


# The chained cooperative weight gradient's ring (both warpgroups on every stage) against its twin with the race
# detector on: a CTA with every item, CTAs with none or one, the shallowest ring, a ring deeper than most
# groups' token blocks, trailing empty groups. Warpgroups stacked along M (each masks its own x columns).
CHAINED_WGRAD_CASES = {
    "one_cta": (200, 256, 128, [50, 0, 7, 100, 0, 23], dict(), 1),
    "ctas_with_no_or_one_item": (64, 256, 64, [30, 34], dict(), 8),
    "two_stages": (200, 256, 128, [50, 0, 7, 100, 0, 23], dict(max_concurrent_steps=2), 3),
    "ring_deeper_than_groups": (160, 128, 128, [9, 70, 1, 80], dict(max_concurrent_steps=5), 2),
    "trailing_empty_groups": (160, 128, 128, [100, 60, 0, 0, 0], dict(), 3),
}


@pytest.mark.parametrize("case", sorted(CHAINED_WGRAD_CASES))
def test_interpret_chained_weight_gradient_edge_cases_match_reference_without_races(case, monkeypatch):
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as interpreter
    m, k, n, sizes, overrides, num_sms = CHAINED_WGRAD_CASES[case]
    monkeypatch.setattr(grouped_tiles, "INTERPRET_PARAMS", {"detect_races": True})
    cfg = dataclasses.replace(SMALL_TUNING.wgrad, chain_items=True, **{"max_concurrent_steps": 3, **overrides})
    tuning = dataclasses.replace(SMALL_TUNING, wgrad=cfg, num_sms=num_sms)
    x, _, dy, group_sizes = _random_problem(41, m, k, n, sizes)
    dy = dy.astype(jnp.bfloat16)
    interpreter.reset_gpu_interpret_mode_state()
    try:
        got = grouped_gemm_wgrad(x, dy, group_sizes, preferred_element_type=jnp.float32, interpret=True,
                                 tuning=tuning)
        assert _rel_err(got, grouped_gemm_wgrad_reference(x, dy, group_sizes, jnp.float32)) < 1e-5
        for g in np.flatnonzero(np.asarray(sizes) == 0):
            assert np.all(np.asarray(got[g]) == 0.0), f"empty group {g} must get a zero weight gradient"
        assert not interpreter.get_races().races_found, "the interpreter saw an SMEM race"
    finally:
        interpreter.reset_gpu_interpret_mode_state()


@pytest.mark.parametrize("variant", sorted(VARIANT_TUNINGS))
def test_interpret_tiling_variants_match_ragged_dot(variant):
    x, w, dy, group_sizes = _random_problem(3, 200, 256, 256, [50, 0, 7, 100, 0, 23])
    _check_fwd_bwd(x, w, dy, group_sizes, interpret=True, tuning=VARIANT_TUNINGS[variant])


def test_interpret_chained_tuning_when_no_depth_divides_the_k_steps():
    """Forward K = 384 in 128-wide steps: three, which no pipeline depth >= 2 divides, so it runs unchained at
    its full depth; the input gradient (two steps over N = 256) stays chained."""
    k128 = VARIANT_TUNINGS["tile_k128"]
    tuning = dataclasses.replace(k128, fwd=dataclasses.replace(k128.fwd, chain_items=True),
                                 dgrad=dataclasses.replace(k128.dgrad, chain_items=True))
    x, w, dy, group_sizes = _random_problem(4, 200, 384, 256, [50, 0, 7, 100, 0, 23])
    _check_fwd_bwd(x, w, dy, group_sizes, interpret=True, tuning=tuning)


def test_interpret_bf16_output_and_default_tuning():
    """Default (production) tiles in the interpreter, bf16 out, random sizes drawn fresh."""
    rng = np.random.default_rng(7)
    sizes = rng.multinomial(300, np.full(4, 0.25))
    sizes[rng.integers(4)] = 0
    x, w, _, group_sizes = _random_problem(11, 300, 128, 256, sizes)
    y = grouped_gemm(x, w, group_sizes, interpret=True)
    assert y.dtype == jnp.bfloat16
    assert _rel_err(y, _ragged_dot_f32(x, w, group_sizes)) < 4e-3


def test_smem_fit_drops_stages_then_halves_the_k_step():
    """A 128-wide K step with an fp32 output does not fit two stages of 128 x 256 tiles: fit_smem falls back
    to 64-wide steps (and more stages); bf16 output keeps the 128-wide step at two stages."""
    from pallas_kernels._grouped_tiles import SMEM_BUDGET, fit_smem

    cfg = GemmTiling(tile_k=128, max_concurrent_steps=4)
    stage = (cfg.cta_m + cfg.cta_n) * cfg.tile_k
    bf16 = fit_smem(cfg, stage, jnp.bfloat16)
    assert (bf16.tile_k, bf16.max_concurrent_steps) == (128, 2)
    f32 = fit_smem(cfg, stage, jnp.float32)
    assert f32.tile_k == 64 and f32.max_concurrent_steps >= 2
    out_bytes = 2 * f32.tile_m * f32.epi_tile_n * 4
    assert f32.max_concurrent_steps * (f32.cta_m + f32.cta_n) * 64 * 2 + out_bytes <= SMEM_BUDGET
    with pytest.raises(ValueError, match="SMEM"):
        fit_smem(GemmTiling(tile_m=256, tile_n=256, epi_tile_n=256, epi_slots=2), 4 * 256 * 64, jnp.float32)


def test_interpret_weight_gradient_when_only_k_is_a_multiple_of_128():
    """N = 64 (like a TP-split fine-grained expert, N = 704): dw takes the 128 x 64 tile pair."""
    x, w, dy, group_sizes = _random_problem(31, 160, 128, 64, [60, 0, 77])
    _check_fwd_bwd(x, w, dy, group_sizes, interpret=True)


def test_reference_twin_matches_ragged_dot_including_grads():
    x, w, dy, group_sizes = _random_problem(3, 40, 16, 24, [9, 0, 20, 5])
    x, w = x.astype(jnp.float32), w.astype(jnp.float32)
    got, got_vjp = jax.vjp(lambda x, w: grouped_gemm_reference(x, w, group_sizes), x, w)
    want, want_vjp = jax.vjp(lambda x, w: _ragged_dot_f32(x, w, group_sizes), x, w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_vjp(dy), want_vjp(dy)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(got)[34:] == 0.0)


def test_default_tuning_fits_the_paper_expert_shapes():
    for k, n in [(4096, 14336), (6144, 16384), (4096, 6400), (2048, 1408), (6400, 18304)]:
        t = default_tuning(8192, k, n, 8)
        assert n % t.fwd.cta_n == 0 and k % t.dgrad.cta_n == 0
        assert k % t.wgrad.cta_m == 0 and n % t.wgrad.cta_n == 0


@pytest.mark.parametrize("k, n, fwd_k, dgrad_k", [
    (4096, 14336, 128, 128),   # Mixtral gate/up: both reductions long (4096 / 14336), both outputs wide
    (14336, 4096, 128, 128),   # Mixtral down
    (7168, 2048, 128, 64),     # DeepSeek-V3: the input gradient reduces over 2048 only
    (2048, 768, 64, 64),       # Qwen3-30B-A3B: fine-grained, 64-wide steps four deep
])
def test_default_tuning_takes_128_wide_k_steps_for_long_reductions(k, n, fwd_k, dgrad_k):
    t = default_tuning(8192, k, n, 8, pingpong=False)   # the cooperative tiles (the ping-pong rule: below)
    assert (t.fwd.tile_k, t.dgrad.tile_k) == (fwd_k, dgrad_k)
    assert t.fwd.max_concurrent_steps == (2 if fwd_k == 128 else 4)
    # dgrad alone gets the same tiles, ping-pong rule included
    assert default_tuning(8192, k, n, 8).dgrad == default_kernel_tuning("dgrad", k, n, 8192, 8).dgrad


H200, H100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize("k, n, device, fwd, dgrad", [
    (4096, 14336, H200, "cooperative", "cooperative"),   # Mixtral gate/up: reductions 4096 / 14336
    (14336, 4096, H200, "cooperative", "cooperative"),   # Mixtral down
    (7168, 2048, H200, "cooperative", "pingpong"),       # DeepSeek-V3: the input gradient reduces over 2048 ...
    (7168, 2048, H100, "cooperative", "cooperative"),    # ... into 7168 columns: ping-pong only on the H200
    (2048, 7168, H200, "pingpong", "cooperative"),       # DeepSeek-V3 down: the forward likewise
    (2048, 7168, H100, "cooperative", "cooperative"),
    (7168, 2048, "cpu", "cooperative", "cooperative"),   # an untimed device: the wide output stays cooperative
    (2048, 768, H200, "pingpong", "pingpong"),           # Qwen3-30B-A3B
    (2048, 1408, H200, "pingpong", "pingpong"),          # DeepSeekMoE
    (2048, 1408, H100, "pingpong", "pingpong"),          # narrow outputs: ping-pong on every card
    (2048, 704, H200, "cooperative", "pingpong"),        # DeepSeekMoE over TP 2: 704 output columns, no multiple of 128
])
def test_default_tuning_takes_pingpong_for_short_reductions(k, n, device, fwd, dgrad):
    t = default_tuning(8192, k, n, 8, device_kind=device)
    assert (t.fwd.schedule, t.dgrad.schedule) == (fwd, dgrad)
    assert default_kernel_tuning("dgrad", k, n, 8192, 8, device_kind=device).dgrad == t.dgrad
    coop = default_tuning(8192, k, n, 8, pingpong=False)
    assert coop.fwd.schedule == coop.dgrad.schedule == "cooperative"
    for cfg, cols in ((t.fwd, n), (t.dgrad, k)):
        assert cols % cfg.cta_n == 0
        if cfg.schedule == "pingpong":   # one warpgroup's tile is one work item
            assert (cfg.cta_m, cfg.cta_n) == (cfg.tile_m, cfg.tile_n) and not cfg.chain_items


@pytest.mark.parametrize("m, g, k, n, schedule", [
    (49152, 64, 2048, 1408, "pingpong"),      # DeepSeekMoE EP1: 768 rows per group
    (65536, 128, 2048, 768, "pingpong"),      # Qwen3-30B-A3B EP1: 512
    (16384, 8, 4096, 14336, "cooperative"),   # Mixtral EP1: 2048
    (24576, 16, 4096, 14336, "cooperative"),  # Mixtral at 6144 tokens: 1536 (K 4096 is not narrow)
    (4096, 4, 4096, 14336, "pingpong"),       # Mixtral at 2048 tokens: 1024
    (98304, 64, 2048, 1408, "pingpong"),      # DeepSeekMoE at 16k tokens: 1536 (narrow: K 2048)
    (262144, 128, 2048, 768, "pingpong"),     # Qwen3 at 32k tokens: 2048
    (49152, 32, 7168, 2048, "cooperative"),   # DeepSeek-V3 EP8 at 6144 tokens: 1536
    (196608, 64, 2048, 1408, "cooperative"),  # DeepSeekMoE at 32k tokens: 3072
    (49152, 64, 2048, 704, "cooperative"),    # N = 704 is no multiple of the 128-wide tile
    (196608, 64, 1408, 2048, "cooperative"),  # DeepSeekMoE's down projection at 32k tokens: K 1408
])
def test_default_weight_gradient_takes_pingpong_for_small_groups(m, g, k, n, schedule):
    t = default_tuning(m, k, n, g)
    assert t.wgrad.schedule == schedule
    assert k % t.wgrad.cta_m == 0 and n % t.wgrad.cta_n == 0
    assert default_kernel_tuning("wgrad", k, n, m, g).wgrad == t.wgrad   # wgrad alone gets the same tiles
    assert default_tuning(m, k, n, g, pingpong=False).wgrad.schedule == "cooperative"
    # the cooperative weight gradient runs on the ring (chain_items) on the tiles it was timed on only
    timed_tiles = (t.wgrad.tile_m, t.wgrad.tile_n, t.wgrad.wg_split) == (128, 128, "m")
    assert t.wgrad.chain_items == (schedule == "cooperative" and timed_tiles)
    if n == 704:   # the 64-wide fallback keeps jax's pipelines
        assert not timed_tiles and not t.wgrad.chain_items
    if (k, n) == (1408, 2048):   # DeepSeekMoE's down projection: side-by-side warpgroups, not timed on the ring
        assert t.wgrad.wg_split == "n" and not t.wgrad.chain_items


@pytest.mark.parametrize("m, g, cta_rows", [(49152, 64, 128), (49152, 8, 256)])
def test_default_tuning_takes_128_row_ctas_for_few_rows_per_group(m, g, cta_rows):
    # DeepSeekMoE's N = 1408 is no multiple of 256: warpgroups stack along M (256-row CTAs) unless groups are
    # small (768 rows each at 64 groups), where a group's partly empty last tile would waste 128 rows
    t = default_tuning(m, 2048, 1408, g, pingpong=False)
    assert (t.fwd.cta_m, t.fwd.cta_n) == (cta_rows, 128)
    assert 1408 % t.fwd.cta_n == 0 and t.fwd.chain_items
    # side-by-side warpgroups: 128 rows already
    assert default_tuning(m, 2048, 4096, g, pingpong=False).fwd.cta_m == 128


@pytest.mark.parametrize("bad, match", [
    (dict(x=(64, 96)), "K=96 but w_GKN has K=128"),
    (dict(x_dtype=jnp.float32), "must share dtype"),
    (dict(sizes=(3,)), r"shape \(2,\)"),
    (dict(sizes_dtype=jnp.float32), "integer vector"),
    (dict(w=(2, 128, 96)), "96 must be a multiple of 64"),
    (dict(out=jnp.int8), "preferred_element_type"),
    (dict(zero_tail="both"), "zero_tail"),
    (dict(fwd=dict(split_k=4)), "K 128 is not a multiple of the tuning.fwd tile 256"),
    (dict(fwd=dict(split_k=0)), "tuning.fwd.split_k=0 must be an int >= 1"),
    (dict(wgrad=dict(split_k=2)), "tuning.wgrad.split_k=2 must be an int >= 1 and 1 for the weight gradient"),
    (dict(fwd=dict(schedule="bogus")), "tuning.fwd.schedule='bogus' must be one of"),
    (dict(fwd=dict(schedule="pingpong", split_k=2)), "tuning.fwd.schedule='pingpong' needs split_k=1"),
    (dict(fwd=dict(schedule="pingpong", max_concurrent_steps=1)), r"max_concurrent_steps=1 must be in \[2, 16\]"),
    (dict(wgrad=dict(schedule="pingpong", max_concurrent_steps=17)), r"max_concurrent_steps=17 must be in"),
    (dict(wgrad=dict(chain_items=True, max_concurrent_steps=1)), r"max_concurrent_steps=1 must be in .* chained"),
])
def test_bad_input_raises_clear_value_error(bad, match):
    x = jnp.zeros(bad.get("x", (64, 128)), bad.get("x_dtype", jnp.bfloat16))
    w = jnp.zeros(bad.get("w", (2, 128, 128)), jnp.bfloat16)
    sizes = jnp.zeros(bad.get("sizes", (2,)), bad.get("sizes_dtype", jnp.int32))
    tuning = None
    if "zero_tail" in bad:
        tuning = dataclasses.replace(default_tuning(64, 128, 128, 2), zero_tail=bad["zero_tail"])
    for kernel in ("fwd", "wgrad"):
        if kernel in bad:
            base = default_tuning(64, 128, 128, 2, pingpong=False)
            tuning = dataclasses.replace(base, **{kernel: dataclasses.replace(getattr(base, kernel), **bad[kernel])})
    with pytest.raises(ValueError, match=match):
        grouped_gemm(x, w, sizes, preferred_element_type=bad.get("out"), interpret=True, tuning=tuning)


# ----------------------------------------------------------------------------------------------------
# The public dgrad / wgrad entry points (a hand-written backward calls them with communication between)
# ----------------------------------------------------------------------------------------------------
def _check_dgrad_wgrad(x, w, dy, group_sizes, out_dtype=jnp.float32, **kwargs):
    """Kernel vs twin with the same fp32 accumulation: fp32 outputs agree to summation order, bf16
    outputs to one bf16 rounding."""
    (m, k), n, sizes = x.shape, w.shape[2], np.asarray(group_sizes)
    tol = 1e-5 if out_dtype == jnp.float32 else 4e-3
    dx = grouped_gemm_dgrad(dy, w, group_sizes, preferred_element_type=out_dtype, **kwargs)
    dw = grouped_gemm_wgrad(x, dy, group_sizes, preferred_element_type=out_dtype, **kwargs)
    assert dx.shape == (m, k) and dw.shape == (len(sizes), k, n) and dx.dtype == dw.dtype == out_dtype
    assert _rel_err(dx, grouped_gemm_dgrad_reference(dy, w, group_sizes, out_dtype)) < tol
    assert _rel_err(dw, grouped_gemm_wgrad_reference(x, dy, group_sizes, out_dtype)) < tol
    total = int(min(sum(sizes), m))
    assert np.all(np.asarray(dx)[total:] == 0.0), "dx rows past sum(group_sizes) must be exact zeros"
    for g in np.flatnonzero(sizes == 0):
        assert np.all(np.asarray(dw[g]) == 0.0), f"empty group {g} must get a zero weight gradient"


DGRAD_WGRAD_CASES = {
    # empty groups, a zero tail of 40 rows, groups inside one tile; small tiles, both tail owners
    "tail_small_tiles": (160, 128, 64, [30, 0, 5, 85, 0], dict(tuning=SMALL_TUNING)),
    "tail_mask": (160, 128, 64, [30, 0, 5, 85, 0], dict(tuning=dataclasses.replace(SMALL_TUNING, zero_tail="mask"))),
    # default tiles for each kernel alone (dgrad 128-wide over K, wgrad the 64 x 64 pair), bf16 out, a
    # cumulative size past M (cut at M), an empty first group
    "default_tiles_cut_at_m": (136, 128, 64, [0, 100, 60], dict(out_dtype=jnp.bfloat16)),
}


@pytest.mark.parametrize("case", sorted(DGRAD_WGRAD_CASES))
def test_interpret_dgrad_and_wgrad_match_their_references(case):
    m, k, n, sizes, kwargs = DGRAD_WGRAD_CASES[case]
    x, w, dy, group_sizes = _random_problem(sorted(DGRAD_WGRAD_CASES).index(case), m, k, n, sizes)
    _check_dgrad_wgrad(x, w, dy.astype(jnp.bfloat16), group_sizes, interpret=True, **kwargs)


def test_dgrad_and_wgrad_of_zero_rows_are_empty_and_zero():
    x, w, dy = (jnp.zeros(shape, jnp.bfloat16) for shape in [(0, 128), (3, 128, 64), (0, 64)])
    sizes = jnp.zeros((3,), jnp.int32)
    assert grouped_gemm_dgrad(dy, w, sizes, interpret=True).shape == (0, 128)
    dw = grouped_gemm_wgrad(x, dy, sizes, interpret=True)
    assert dw.shape == (3, 128, 64) and np.all(np.asarray(dw) == 0.0)


def test_custom_vjp_backward_calls_the_public_dgrad_and_wgrad(monkeypatch):
    """The backward is built from the two public functions (so it can be rebuilt with communication
    between them), and its gradients equal jax.grad of the reference twin. The backward looks the two
    names up in the module when it is traced, so spies set on the module see the calls."""
    calls = []

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        monkeypatch.setattr(gg, name, wrapped)

    spy("grouped_gemm_dgrad", grouped_gemm_dgrad)
    spy("grouped_gemm_wgrad", grouped_gemm_wgrad)
    x, w, dy, group_sizes = _random_problem(5, 136, 128, 128, [40, 0, 70])

    def loss(fn, x, w):
        return jnp.sum(fn(x, w, group_sizes).astype(jnp.float32) * dy)

    got = jax.grad(lambda x, w: loss(lambda *a: grouped_gemm(*a, interpret=True, tuning=SMALL_TUNING), x, w),
                   argnums=(0, 1))(x, w)
    assert sorted(calls) == ["grouped_gemm_dgrad", "grouped_gemm_wgrad"]
    want = jax.grad(lambda x, w: loss(grouped_gemm_reference, x, w), argnums=(0, 1))(x, w)
    for g, r in zip(got, want):
        assert g.dtype == r.dtype == jnp.bfloat16
        assert _rel_err(g, r) < 4e-3   # dy is cast to bf16 before the kernels; both round to bf16


@pytest.mark.parametrize("call, bad, match", [
    ("dgrad", dict(dy=(64, 96)), "dy_MN has N=96 but w_GKN has N=128"),
    ("dgrad", dict(dy_dtype=jnp.float32), "dy_MN and w_GKN must share dtype"),
    ("dgrad", dict(sizes=(3,)), r"group_sizes_G .* shape \(2,\)"),
    ("dgrad", dict(w=(2, 96, 128), dy=(64, 128)), "K=96 must be a multiple of 64"),
    ("dgrad", dict(zero_tail="both"), "zero_tail"),
    ("wgrad", dict(x=(32, 128)), "x_MK has M=32 rows but dy_MN has M=64"),
    ("wgrad", dict(x_dtype=jnp.float16), "x_MK and dy_MN must share dtype"),
    ("wgrad", dict(sizes_dtype=jnp.float32), "integer vector"),
    ("wgrad", dict(x=(64, 64), dy=(64, 64)), "weight gradient needs K=64 or N=64"),
    ("wgrad", dict(out=jnp.float16), "preferred_element_type"),
])
def test_dgrad_and_wgrad_bad_input_raise_clear_value_error(call, bad, match):
    dy = jnp.zeros(bad.get("dy", (64, 128)), bad.get("dy_dtype", jnp.bfloat16))
    sizes = jnp.zeros(bad.get("sizes", (2,)), bad.get("sizes_dtype", jnp.int32))
    tuning = dataclasses.replace(default_tuning(64, 128, 128, 2), zero_tail=bad["zero_tail"]) \
        if "zero_tail" in bad else None
    kwargs = dict(preferred_element_type=bad.get("out"), interpret=True, tuning=tuning)
    with pytest.raises(ValueError, match=match):
        if call == "dgrad":
            grouped_gemm_dgrad(dy, jnp.zeros(bad.get("w", (2, 128, 128)), jnp.bfloat16), sizes, **kwargs)
        else:
            grouped_gemm_wgrad(jnp.zeros(bad.get("x", (64, 128)), bad.get("x_dtype", jnp.bfloat16)), dy, sizes,
                               **kwargs)


# ----------------------------------------------------------------------------------------------------
# GPU (H200): real kernels, default tuning
# ----------------------------------------------------------------------------------------------------
def _poison_device_memory(nbytes):
    """Fill and free a NaN buffer so the allocator hands the kernel outputs dirty memory."""
    jnp.full((nbytes // 4,), jnp.nan, jnp.float32).block_until_ready()


@pytest.mark.gpu
@pytest.mark.parametrize("sizes", [
    [700, 0, 1500, 33, 0, 900, 1, 400],     # ragged with empty groups and a tail (sum 3534 < 4096)
    [0, 0, 4096, 0, 0, 0, 0, 0],             # all tokens in one group
    [512] * 8,                                # uniform, tile aligned
])
@pytest.mark.parametrize("zero_tail", ["kernel", "mask"])
def test_gpu_forward_and_gradients_match_ragged_dot(sizes, zero_tail):
    x, w, dy, group_sizes = _random_problem(sum(sizes) + len(sizes), 4096, 512, 1024, sizes)
    _poison_device_memory(64 << 20)
    tuning = dataclasses.replace(default_tuning(4096, 512, 1024, len(sizes)), zero_tail=zero_tail)
    _check_fwd_bwd(x, w, dy, group_sizes, tuning=tuning)


@pytest.mark.gpu
def test_gpu_unwritten_tail_keeps_computed_rows_and_weight_gradient_exact():
    _poison_device_memory(64 << 20)
    _check_unwritten_tail(4096, [700, 0, 1500, 33, 0, 900, 1, 400], False, default_tuning(4096, 128, 128, 8))


@pytest.mark.gpu
@pytest.mark.parametrize("fwd", [
    GemmTiling(epi_slots=2), GemmTiling(tile_k=128, max_concurrent_steps=3), GemmTiling(wg_split="m"),
    GemmTiling(tile_n=64, epi_slots=2, max_concurrent_steps=6), GemmTiling(tile_n=128, epi_tile_n=128),
    GemmTiling(chain_items=True), GemmTiling(chain_items=True, epi_slots=2, wg_split="m"),
    GemmTiling(max_concurrent_steps=6, schedule="pingpong"),
    GemmTiling(tile_k=128, max_concurrent_steps=3, schedule="pingpong"),
    GemmTiling(tile_m=64, tile_n=256, epi_slots=2, schedule="pingpong"),
], ids=["epi2", "k128", "split_m", "n64_epi2", "epi128", "chain", "chain_epi2_split_m", "pingpong",
        "pingpong_k128", "pingpong_64x256_epi2"])
def test_gpu_forward_tiling_variants_match_ragged_dot(fwd):
    """The forward tilings the shape table may choose, on ragged groups with a tail, dirty memory."""
    sizes = [700, 0, 1500, 33, 0, 900, 1, 400]
    x, w, dy, group_sizes = _random_problem(3, 4096, 512, 1024, sizes)
    _poison_device_memory(64 << 20)
    tuning = dataclasses.replace(default_tuning(4096, 512, 1024, len(sizes)), fwd=fwd, dgrad=fwd)
    _check_fwd_bwd(x, w, dy, group_sizes, tuning=tuning)


@pytest.mark.gpu
@pytest.mark.parametrize("k, n, sizes", [
    (2048, 704, [300, 0, 1000, 2796]),   # DeepSeekMoE expert FFN split over TP 2: N = 704 = 11 x 64
    (4096, 2048, [3000]),                # one expert per device, with a tail of zero rows
])
def test_gpu_tp_split_and_single_group_shapes(k, n, sizes):
    x, w, dy, group_sizes = _random_problem(k + n, 4096, k, n, sizes)
    _poison_device_memory(64 << 20)
    _check_fwd_bwd(x, w, dy, group_sizes)


@pytest.mark.gpu
def test_gpu_large_expert_default_tuning_bf16_forward():
    """K >= 4096, N >= 2048 take 128-wide K steps by default (bf16 output fits SMEM at two stages)."""
    assert default_tuning(4096, 4096, 2048, 4).fwd.tile_k == 128
    x, w, _, group_sizes = _random_problem(19, 4096, 4096, 2048, [1000, 0, 2500, 77])
    _poison_device_memory(64 << 20)
    y = grouped_gemm(x, w, group_sizes)
    assert _rel_err(y, _ragged_dot_f32(x, w, group_sizes)) < 4e-3
    assert np.all(np.asarray(y)[3577:] == 0)


@pytest.mark.gpu
def test_gpu_long_reduction_default_tuning_backward():
    """N >= 4096 with K >= 2048: the input gradient takes 128-wide steps over N by default; with the forward's
    64-wide steps (K = 2048) and the weight gradient, on ragged groups with a tail, dirty memory."""
    assert default_tuning(4096, 2048, 4096, 4).dgrad.tile_k == 128
    x, w, dy, group_sizes = _random_problem(23, 4096, 2048, 4096, [1000, 0, 2500, 77])
    _poison_device_memory(64 << 20)
    _check_fwd_bwd(x, w, dy, group_sizes)


@pytest.mark.gpu
def test_gpu_fine_grained_shape_bf16_forward():
    rng = np.random.default_rng(5)
    sizes = rng.multinomial(8192, rng.dirichlet(np.ones(16)))
    x, w, _, group_sizes = _random_problem(17, 8192, 2048, 1408, sizes)
    _poison_device_memory(64 << 20)
    y = grouped_gemm(x, w, group_sizes)
    assert _rel_err(y, _ragged_dot_f32(x, w, group_sizes)) < 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("weights_sharded", [True, False])
def test_gpu_kernel_inside_shard_map_matches_reference(weights_sharded):
    """Under shard_map (expert parallel: weights sharded; or replicated weights) the custom VJP's
    cotangents must carry the primals' varying axes, and replicated weights get summed gradients."""
    from jax.sharding import PartitionSpec as P

    from pallas_kernels.grouped_gemm import unsupported_reason

    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("e",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jax.random.normal(jax.random.key(0), (n * 256, 128), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (2 * n if weights_sharded else 2, 128, 256), jnp.bfloat16) * 0.1
    sizes = jnp.tile(jnp.array([100, 156], jnp.int32), n)
    assert unsupported_reason(x, w) is None

    def loss(fn, x, w):
        def local(x, w, gs):
            return jax.lax.psum(jnp.sum(fn(x, w, gs).astype(jnp.float32) ** 2), "e")
        w_spec = P("e") if weights_sharded else P()
        return jax.shard_map(local, mesh=mesh, in_specs=(P("e"), w_spec, P("e")), out_specs=P())(x, w, sizes)

    got = jax.jit(jax.grad(lambda x, w: loss(grouped_gemm, x, w), argnums=(0, 1)))(x, w)
    want = jax.jit(jax.grad(lambda x, w: loss(grouped_gemm_reference, x, w), argnums=(0, 1)))(x, w)
    for g, r in zip(got, want):
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        assert np.abs(g - r).max() <= 2e-2 * np.abs(r).max()    # bf16 outputs, fp32 accumulation


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_dgrad_and_wgrad_match_their_references(out_dtype):
    """DeepSeekMoE-like TP-split expert (N = 704 = 11 x 64): wgrad takes the 64 x 64 tile pair."""
    x, w, dy, group_sizes = _random_problem(23, 4096, 2048, 704, [700, 0, 1500, 33, 0, 900, 1, 400])
    dy = dy.astype(jnp.bfloat16)
    _poison_device_memory(64 << 20)
    _check_dgrad_wgrad(x, w, dy, group_sizes, out_dtype=out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_pingpong_weight_gradient_matches_its_reference(out_dtype):
    """The ping-pong weight gradient (each warpgroup on its own (group, K, N) tiles, a running step count over
    groups of any size, empty ones storing zeros) on ragged groups, dirty memory."""
    x, w, dy, group_sizes = _random_problem(29, 4096, 512, 1024, [700, 0, 1500, 33, 0, 900, 1, 400])
    tuning = dataclasses.replace(default_tuning(4096, 512, 1024, 8), wgrad=PINGPONG_TILING)
    _poison_device_memory(64 << 20)
    _check_dgrad_wgrad(x, w, dy.astype(jnp.bfloat16), group_sizes, out_dtype=out_dtype, tuning=tuning)


@pytest.mark.gpu
@pytest.mark.parametrize("wg_split", ["m", "n"])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_chained_weight_gradient_matches_its_reference(out_dtype, wg_split):
    """The cooperative weight gradient on one SMEM ring across items (chain_items: both warpgroups wait on one
    full barrier per stage, a stage freed by both releases) on ragged groups with 1- and 33-row groups and empty
    ones, on 4 CTAs (dozens of items each, every stage reused across items), dirty memory."""
    x, w, dy, group_sizes = _random_problem(43, 4096, 512, 1024, [700, 0, 1500, 33, 0, 900, 1, 400])
    base = default_tuning(4096, 512, 1024, 8, pingpong=False)
    tuning = dataclasses.replace(base, wgrad=dataclasses.replace(base.wgrad, chain_items=True, wg_split=wg_split),
                                 num_sms=4)
    _poison_device_memory(64 << 20)
    _check_dgrad_wgrad(x, w, dy.astype(jnp.bfloat16), group_sizes, out_dtype=out_dtype, tuning=tuning)


@pytest.mark.gpu
@pytest.mark.parametrize("k, n", [(128, 1024), (256, 128), (1024, 128)])
def test_gpu_pingpong_short_reductions_on_few_ctas(k, n):
    """The one-wgmma-in-flight release, which the CPU interpreter cannot check (it runs wgmma synchronously):
    reductions of 2-4 steps (forward over K, input gradient over N; the weight gradient's groups of 1 and 33
    rows take one) against a six-stage ring, on 4 CTAs so that each CTA runs dozens of items and every stage is
    reused across items and warpgroups; forward, input gradient and weight gradient, dirty memory."""
    pp = PINGPONG_TILING
    tuning = GroupedGemmTuning(fwd=pp, dgrad=pp, wgrad=pp, num_sms=4)
    for seed in range(3):
        x, w, dy, group_sizes = _random_problem(37 + seed, 4096, k, n, [700, 0, 1500, 33, 0, 900, 1, 400])
        _poison_device_memory(64 << 20)
        _check_fwd_bwd(x, w, dy, group_sizes, tuning=tuning)
