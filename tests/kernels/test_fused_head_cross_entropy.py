"""The fused output head (pallas_kernels/cross_entropy.py: `loss_and_scaled_logit_grad`,
`head_cross_entropy_per_token`; kernels.cross_entropy='pallas_fused') against its unfused twin, the head's einsum
followed by `cross_entropy_per_token`: the kernel's loss and softmax - one-hot (its d times its row scale, including
rows whose reference moves and non-finite rows) against the two-kernel forward and backward, the
head's value and x / w gradients (both weight layouts, per-token cotangents) against the twin and a float32
reference, in interpret mode on the CPU; the CUDA lowering (one Triton call, the logits aliased to their gradient);
compiled on the GPU (`-m gpu`). The model's loss and gradients with it: test_cross_entropy.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megascale_jax.model.layers import CrossEntropyImpl, resolve_cross_entropy
from pallas_kernels.cross_entropy import (CHUNK, cross_entropy_per_token, head_cross_entropy_per_token,
                                          loss_and_scaled_logit_grad)
from tests.kernels.triton_lowering import MODEL_TRACES, lowered_train_step_for_cuda


def _logits(tokens, vocab, seed=0, scale=8.0):
    kl, kt = jax.random.split(jax.random.key(seed))
    logits = (scale * jax.random.normal(kl, (tokens, vocab), jnp.float32)).astype(jnp.bfloat16)
    return logits, jax.random.randint(kt, (tokens,), 0, vocab)


def _check_kernel(logits, targets, interpret=True, one_read=True, **tiles):
    loss, d, row_scale = loss_and_scaled_logit_grad(logits, targets, interpret, one_read=one_read, **tiles)
    want = cross_entropy_per_token(logits, targets, interpret)
    d_want = jax.grad(lambda x: jnp.sum(cross_entropy_per_token(x, targets, interpret)))(logits)   # cotangent 1
    assert d.dtype == logits.dtype and d.shape == logits.shape and row_scale.shape == targets.shape
    # log Z - the target's logit: where the two nearly cancel (a confident row) both carry log Z's float32 rounding,
    # ~1 ulp of the largest logit (7.6e-6 at 90), computed in different orders
    np.testing.assert_allclose(np.asarray(loss), np.asarray(want), rtol=2e-6, atol=2e-5)
    # each rounds the same real number to bf16 once (ours before the row scale, the twin after), each within half a
    # bf16 step (2^-8 of the value): within 2^-7 of each other; a probability below 1e-28 may underflow in one
    ours = np.asarray(d, np.float32) * np.asarray(row_scale)[:, None]
    np.testing.assert_allclose(ours, np.asarray(d_want, np.float32), rtol=2 ** -7 + 1e-5, atol=1e-28)
    if not one_read:   # the two-read form stores softmax - one-hot itself: the twin's bf16 values exactly
        assert np.all(np.asarray(row_scale) == 1.0)
        np.testing.assert_array_equal(np.asarray(d, np.float32), np.asarray(d_want, np.float32))
    else:   # d itself, relative to (softmax - one-hot) / row_scale in float64: every stored value down to 1e-37,
        # within one bf16 rounding, two for values stored before R moved (rounded, then rescaled and rounded)
        x = np.asarray(logits, np.float64)
        top = x.max(axis=1, keepdims=True)
        p = np.exp(x - top - np.log(np.exp(x - top).sum(axis=1, keepdims=True)))
        t = np.asarray(targets)
        hit = (np.arange(x.shape[1])[None, :] == t[:, None]) & ((t >= 0) & (t < x.shape[1]))[:, None]
        want_d = (p - hit) / np.asarray(row_scale, np.float64)[:, None]
        np.testing.assert_allclose(np.asarray(d, np.float64), want_d, rtol=2 ** -7 + 1e-5, atol=1e-37)
    return loss, ours


@pytest.mark.parametrize("one_read", [True, False])
@pytest.mark.parametrize("vocab", [300, CHUNK, CHUNK + 1, 3 * CHUNK - 5])
def test_interpret_loss_and_grad_match_the_two_kernels(vocab, one_read):
    logits, targets = _logits(7, vocab)
    # the first and last columns as targets: the target's one-lane store at both ends, in a last partial chunk
    _check_kernel(logits, targets.at[0].set(vocab - 1).at[1].set(0), one_read=one_read)


@pytest.mark.parametrize("one_read", [True, False])
def test_interpret_masked_columns_a_masked_chunk_and_a_target_outside_the_vocabulary(one_read):
    logits, targets = _logits(4, 3 * CHUNK)
    logits = logits.at[0, : CHUNK + 7].set(-jnp.inf)
    targets = targets.at[0].set(CHUNK + 7 + targets[0] % 100)
    logits = logits.at[1, 2 * CHUNK:].set(-jnp.inf)
    _check_kernel(logits, targets, one_read=one_read)
    loss, _, _ = loss_and_scaled_logit_grad(logits, targets.at[2].set(3 * CHUNK), True, one_read=one_read)
    assert np.isnan(float(loss[2])) and np.all(np.isfinite(np.asarray(loss)[[0, 1, 3]]))


def test_interpret_rows_whose_reference_moves(interpret=True):
    """The reference R is the first chunk's maximum m0 + 16; a logit past R + 40 moves it. Row 0: one logit at
    m0 + 58 moves R once (the first chunk, stored then, is rescaled: its largest values land at ~e^-74, well inside
    bf16's range, so _check_kernel's relative check of d sees them); row 1: a second logit 58 above the first moves
    it again (the first logit's stored value rescaled to ~e^-74). Row 2's target is its largest logit, 7 above the
    next, so its softmax - 1 (~ -e^-7) cancels: the target column's value must not lose it. Row 3 is the same
    without a move (the control)."""
    logits, targets = _logits(4, 4 * CHUNK, scale=2.0)
    m0 = logits[:, :CHUNK].astype(jnp.float32).max(axis=1)
    first = (m0 + 58).astype(jnp.bfloat16)
    second = (first.astype(jnp.float32) + 58).astype(jnp.bfloat16)
    assert bool(jnp.all(first.astype(jnp.float32) > m0 + 56)) and float(second[1]) > float(first[1]) + 56
    logits = logits.at[0, 2 * CHUNK + 5].set(first[0])
    logits = logits.at[1, CHUNK + 9].set(first[1]).at[1, 3 * CHUNK + 1].set(second[1])
    logits = logits.at[2, 3 * CHUNK + 3].set(90.0).at[2, 2 * CHUNK + 11].set(83.0)
    targets = targets.at[1].set(CHUNK + 9).at[2].set(3 * CHUNK + 3).at[3].set(17)
    logits = logits.at[3, 17].set(30.0).at[3, 500].set(23.0)
    _, ours = _check_kernel(logits, targets, interpret)
    assert -2e-3 < ours[2, 3 * CHUNK + 3] < -5e-4 and -2e-3 < ours[3, 17] < -5e-4


def test_interpret_non_finite_rows_give_a_non_finite_loss_as_the_plain_form():
    logits, targets = _logits(4, 2 * CHUNK + 3)
    logits = logits.at[0, CHUNK + 1].set(jnp.inf).at[1, 5].set(jnp.nan).at[2].set(-jnp.inf)
    targets = targets.at[0].set(0)
    loss, _, _ = loss_and_scaled_logit_grad(logits, targets, True)
    want = cross_entropy_per_token(logits, targets, True)
    assert float(loss[0]) == float(want[0]) == np.inf
    assert np.isnan(float(loss[1])) and np.isnan(float(want[1]))
    assert np.isnan(float(loss[2])) and np.isnan(float(want[2]))
    assert np.isfinite(float(loss[3])) and float(loss[3]) == pytest.approx(float(want[3]), rel=2e-6)


def test_chunk_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="chunk=1000 must be a power of 2"):
        loss_and_scaled_logit_grad(*_logits(2, 300), True, 1000)


def _head_case(tokens=24, dim=64, vocab=3000, seed=1):
    kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (tokens, dim), jnp.float32).astype(jnp.bfloat16)
    w = (0.3 * jax.random.normal(kw, (dim, vocab), jnp.float32)).astype(jnp.bfloat16)
    g = jax.random.uniform(kg, (tokens,), jnp.float32, 0.1, 1.0)    # per-token cotangents (a weighted mean)
    return x, w, _logits(tokens, vocab, seed)[1], g


def _value_and_grads(loss_fn, x, w, g):
    return jax.value_and_grad(lambda x, w: jnp.sum(g * loss_fn(x, w)), (0, 1))(x, w)


@pytest.mark.parametrize("one_read", [True, False])
@pytest.mark.parametrize("w_is_VD", [False, True])
def test_interpret_head_matches_its_unfused_twin_and_a_float32_reference(w_is_VD, one_read):
    x, w_DV, targets, g = _head_case()
    w = w_DV.T if w_is_VD else w_DV
    fused = _value_and_grads(lambda x, w: head_cross_entropy_per_token(x, w, targets, w_is_VD, True, one_read), x, w,
                             g)
    twin = _value_and_grads(lambda x, w: cross_entropy_per_token(
        jnp.einsum("td,vd->tv" if w_is_VD else "td,dv->tv", x, w), targets, True), x, w, g)

    def reference(x, w):
        logits = jnp.einsum("td,vd->tv" if w_is_VD else "td,dv->tv", x, w)
        return jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, targets[:, None], 1)[:, 0]
    exact = _value_and_grads(reference, x.astype(jnp.float32), w.astype(jnp.float32), g)
    # the two-read kernel computes log Z as the twin does (bitwise); the one-read one as R + log(sum) (~1 ulp apart)
    assert float(fused[0]) == (pytest.approx(float(twin[0]), rel=1e-6) if one_read else float(twin[0]))
    for (grad, grad_twin, grad_exact) in zip(fused[1], twin[1], exact[1]):
        assert grad.dtype == jnp.bfloat16
        scale = float(jnp.abs(grad_exact).max())
        errors = [float(jnp.abs(a.astype(jnp.float32) - grad_exact).max()) / scale for a in (grad, grad_twin)]
        # each rounds the gradient to bf16 in a different place (the twin: g * d; the fused head: d, then g * x
        # or the float32 GEMM output): both within a few bf16 steps (2^-8) of float32, the fused one no worse
        assert errors[0] < 2 ** -6 and errors[1] < 2 ** -6
        assert errors[0] <= 1.5 * errors[1]
        np.testing.assert_allclose(np.asarray(grad, np.float32), np.asarray(grad_twin, np.float32),
                                   atol=2 ** -6 * scale)


def _head_inside_shard_map(interpret: bool, check_vma: bool):
    """Per device as the manual plans run it: x and targets split over the devices, w replicated. In a checked
    shard_map the weight's cotangent is summed over the axis by the VJP itself (match_varying: the transpose of w's
    replication); unchecked, the test sums it. Either way the result equals the unsplit head's."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("data",))
    x, w, targets, _ = _head_case(tokens=4 * n)
    want = jax.value_and_grad(lambda x, w: jnp.sum(head_cross_entropy_per_token(x, w, targets, False, interpret)),
                              (0, 1))(x, w)

    def per_device(x, w, t):
        v, (dx, dw) = jax.value_and_grad(
            lambda x, w: jnp.sum(head_cross_entropy_per_token(x, w, t, False, interpret)), (0, 1))(x, w)
        return jax.lax.psum(v, "data"), dx, (dw if check_vma else jax.lax.psum(dw, "data"))
    run = jax.shard_map(per_device, mesh=mesh, in_specs=(P("data"), P(), P("data")), out_specs=(P(), P("data"), P()),
                        check_vma=check_vma)
    sharded = (jax.device_put(x, NamedSharding(mesh, P("data"))), w,
               jax.device_put(targets, NamedSharding(mesh, P("data"))))
    v, dx, dw = jax.jit(run)(*sharded)
    np.testing.assert_allclose(float(v), float(want[0]), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(want[1][0], np.float32))
    np.testing.assert_allclose(np.asarray(dw, np.float32), np.asarray(want[1][1], np.float32), rtol=2 ** -7,
                               atol=2 ** -7 * float(jnp.abs(want[1][1].astype(jnp.float32)).max()))


def test_interpret_head_inside_shard_map():
    """check_vma off: jax's Pallas interpreter loses the varying type of its grid loop's carry inside a checked
    shard_map (see test_cross_entropy.py); the checked typing is the CUDA lowering's below and the GPU test's."""
    _head_inside_shard_map(interpret=True, check_vma=False)


@pytest.mark.gpu
def test_gpu_head_inside_a_checked_shard_map_sums_the_weight_gradient():
    _head_inside_shard_map(interpret=False, check_vma=True)


def test_resolution_of_the_fused_head():
    assert resolve_cross_entropy("pallas_fused", backend="gpu", partitioned_by_xla=False) == \
        CrossEntropyImpl.PALLAS_FUSED
    with pytest.raises(ValueError, match="kernels.cross_entropy='pallas_fused'.*backend 'cpu'"):
        resolve_cross_entropy("pallas_fused", backend="cpu", partitioned_by_xla=False)
    with pytest.raises(ValueError, match="XLA plan on several devices"):
        resolve_cross_entropy("pallas_fused", backend="gpu", partitioned_by_xla=True)
    assert resolve_cross_entropy("pallas_fused_one_read", backend="gpu", partitioned_by_xla=False) == \
        CrossEntropyImpl.PALLAS_FUSED_ONE_READ
    with pytest.raises(ValueError, match="kernels.cross_entropy='pallas_fused_one_read'.*backend 'cpu'"):
        resolve_cross_entropy("pallas_fused_one_read", backend="cpu", partitioned_by_xla=False)


@pytest.mark.parametrize("impl", ["pallas_fused", "pallas_fused_one_read"])
def test_the_train_step_with_the_fused_head_lowers_for_the_gpu(monkeypatch, impl):
    """The manual SP+EP step with kernels.cross_entropy='pallas_fused' (or its one-read kernel), lowered for CUDA on
    the CPU: one Triton call (the backward is the head's two GEMMs), its logits operand aliased to its gradient
    output."""
    text = lowered_train_step_for_cuda(monkeypatch, cross_entropy=impl)
    assert text.count("__gpu$xla.gpu.triton") == MODEL_TRACES
    assert "cross_entropy_loss_and_grad" in text and "output_operand_alias" in text


@pytest.mark.gpu
@pytest.mark.parametrize("one_read", [True, False])
@pytest.mark.parametrize("tokens, vocab", [(512, 102400), (1024, 32000), (300, 151936)])
def test_gpu_kernel_matches_the_two_kernels(tokens, vocab, one_read):
    _check_kernel(*_logits(tokens, vocab, scale=4.0), interpret=False, one_read=one_read)


@pytest.mark.gpu
def test_gpu_rows_whose_reference_moves():
    test_interpret_rows_whose_reference_moves(interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("one_read", [True, False])
@pytest.mark.parametrize("w_is_VD", [False, True])
def test_gpu_head_matches_its_twin(w_is_VD, one_read):
    x, w, targets, g = _head_case(tokens=512, dim=256, vocab=32000)
    w = w.T if w_is_VD else w
    fused = _value_and_grads(lambda x, w: head_cross_entropy_per_token(x, w, targets, w_is_VD, False, one_read),
                             x, w, g)
    twin = _value_and_grads(lambda x, w: cross_entropy_per_token(
        jnp.einsum("td,vd->tv" if w_is_VD else "td,dv->tv", x, w), targets), x, w, g)
    np.testing.assert_allclose(float(fused[0]), float(twin[0]), rtol=1e-5)
    for a, b in zip(fused[1], twin[1]):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   atol=2 ** -6 * float(jnp.abs(b.astype(jnp.float32)).max()))
