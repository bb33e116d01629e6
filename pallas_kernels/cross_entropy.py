"""Token cross-entropy over a large vocabulary as Pallas (Triton backend) passes over the bf16 logits:

    forward   one read: per row a running max and exp-sum over column chunks (one exponential per logit) and the
              target's logit -> log Z and the target logit, float32 [T];
    backward  one read and one write: d logits = g (exp(x - log Z) - one-hot), in the logits' dtype;
    fused     `loss_and_scaled_logit_grad`: both in one read and one write, d = (softmax - one-hot) / a per-row
              scale written over the logits, for `head_cross_entropy_per_token` (the output head's GEMM and the
              loss as one custom VJP whose backward scales the GEMMs' [T, D] side by the cotangent and that row
              scale: kernels.cross_entropy='pallas_fused_one_read'; with `one_read=False` the form that stores
              softmax - one-hot itself and reads each row twice, kernels.cross_entropy='pallas_fused').

Why not XLA's: jax.nn.logsumexp is a max pass and an exp-sum pass over the logits, and XLA's exp-sum and backward
passes run well below HBM speed: on an H200, 4.3 ms for the forward and 4.7 ms for the backward of
deepseekmoe_small's 32768 x 102400 logits (6.7 GB in bf16; benchmarks/results/train_step_h200_compute_copies.json),
where a plain elementwise pass moves ~2x those bytes per ms. Alone on an H100 the kernels take 2.52 vs 4.79 ms
forward and 7.10 vs 9.70 ms forward + backward (benchmarks/results/cross_entropy_1xh100.json). Both use an
accurate exponential (Triton lowers jnp.exp to __nv_expf); the forward's gain is one read instead of two.

`cross_entropy_per_token(logits_TV, targets_T)` is a custom VJP; its plain twin is the model's XLA form
(megascale_jax/model/layers.cross_entropy), compared in tests/kernels/test_cross_entropy.py (interpret mode
on the CPU, compiled on the GPU); the fused head's twin is `cross_entropy_per_token` of the same GEMM
(tests/kernels/test_fused_head_cross_entropy.py). A target outside the vocabulary gives NaN, as the plain form does.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.varying import match_varying, output_struct, vary_like

__all__ = ["cross_entropy_per_token", "head_cross_entropy_per_token", "loss_and_scaled_logit_grad", "CHUNK",
           "NUM_WARPS"]

CHUNK = 2048      # columns per loop step: 2048 bf16 = 4 KB per row and step, 16 per thread of 4 warps
NUM_WARPS = 4


def _row_statistics(x_ref, target, chunk: int):
    """(log Z, the target's logit) of one row ref, float32, in one read over column chunks."""
    n = x_ref.shape[0]

    def body(i, carry):
        m, s, hit = carry
        cols = i * chunk + jnp.arange(chunk)
        x = plgpu.load(x_ref.at[cols], mask=cols < n, other=-jnp.inf).astype(jnp.float32)
        m_new = jnp.maximum(m, jnp.max(x))
        # as jax.nn.logsumexp: a non-finite maximum shifts by 0. -inf: every column so far is masked (nothing to
        # add, no -inf + inf); +inf: log Z is +inf, the loss +inf, as in the plain form
        shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        s = s * jnp.exp(m - shift) + jnp.sum(jnp.exp(x - shift))
        return m_new, s, hit + jnp.where(cols == target, x, 0.0)

    m, s, hit = jax.lax.fori_loop(0, pl.cdiv(n, chunk), body,
                                  (jnp.float32(-jnp.inf), jnp.float32(0.0), jnp.zeros((chunk,), jnp.float32)))
    return m + jnp.log(s), jnp.sum(hit)


def _forward_kernel(x_ref, target_ref, log_z_ref, target_logit_ref, *, chunk: int):
    log_z_ref[...], target_logit_ref[...] = _row_statistics(x_ref, target_ref[...], chunk)


def _backward_kernel(x_ref, target_ref, log_z_ref, g_ref, dx_ref, *, chunk: int):
    n = x_ref.shape[0]
    target, log_z, g = target_ref[...], log_z_ref[...], g_ref[...]

    @pl.loop(0, pl.cdiv(n, chunk))
    def _(i):
        cols = i * chunk + jnp.arange(chunk)
        mask = cols < n
        x = plgpu.load(x_ref.at[cols], mask=mask, other=0.0).astype(jnp.float32)
        d = (jnp.exp(x - log_z) - jnp.where(cols == target, 1.0, 0.0)) * g
        plgpu.store(dx_ref.at[cols], d.astype(dx_ref.dtype), mask=mask)


# The fused kernel's reference (`_loss_and_grad_kernel`): its row is stored as exp(x - R) for a reference R set from
# the first chunk with a finite maximum, R = that maximum + REFERENCE_MARGIN, and moved (the chunks already stored
# read again and rescaled) only where a later chunk's maximum passes R + HEADROOM. So every stored value is at most
# e^HEADROOM (~2e17), the target's (p - 1) / row_scale at most the row's sum (V e^HEADROOM, ~2e22 at V = 102400):
# the head GEMMs' float32 sums over a row cannot overflow, and the products are at gradient scale. As R is at most the
# row's maximum + REFERENCE_MARGIN, a value underflows (exp below e^-87) only where its logit is more than 71 below
# that maximum: a probability under e^-71 ~ 1e-31, which the bf16 softmax of the form before kept and no GEMM sum
# can see. A real row moves R only if one of its logits is 56 above the first chunk's largest; a test builds one.
REFERENCE_MARGIN = 16.0
HEADROOM = 40.0


def _loss_and_grad_kernel(x_ref, target_ref, d_ref, log_z_ref, target_logit_ref, row_scale_ref, *, chunk: int):
    """One row, one read: per chunk e = exp(x - R), summed into the row's exp-sum and stored over the chunk when
    d_ref aliases x_ref (each chunk is read before it is written, by this program alone). Then log Z = R + log s,
    row_scale = 1 / s, so softmax = e * row_scale, and the target's column gets (softmax - 1) / row_scale: the
    caller scales d by row_scale, which the head folds into its [T, D] side. Non-finite logits give a non-finite
    log Z (+inf, or NaN for NaN), as the plain form does; their d is then meaningless, as the loss is."""
    n, target = x_ref.shape[0], target_ref[...]

    def shift_of(r):   # the subtrahend of exp(x - .): 0 while no finite reference exists
        return jnp.where(jnp.isfinite(r), r, 0.0)

    def body(i, carry):
        r, s, hit = carry
        cols = i * chunk + jnp.arange(chunk)
        mask = cols < n
        x = plgpu.load(x_ref.at[cols], mask=mask, other=-jnp.inf).astype(jnp.float32)
        top = jnp.max(x)
        # a finite maximum past the headroom moves R (also the first finite one, R = -inf); a non-finite one sets
        # R to itself once (+inf or NaN); R = NaN never moves again
        moves = ~(top <= r + HEADROOM) & ~jnp.isnan(r)
        r_new = jnp.where(moves, top + REFERENCE_MARGIN, r)
        # R = -inf: every stored value and s are 0 (all earlier logits -inf), nothing to rescale; a non-finite R:
        # the row's d is meaningless (the loss is not finite)
        finite_move = jnp.isfinite(r) & jnp.isfinite(r_new)
        factor = jnp.where(finite_move, jnp.exp(r - r_new), 1.0)

        def rescale_stored_chunks():   # chunks 0..i-1, stored against the old reference, against the new one
            @pl.loop(0, pl.cdiv(n, chunk))
            def _(j):
                cols_j = j * chunk + jnp.arange(chunk)
                mask_j = cols_j < i * chunk
                old = plgpu.load(d_ref.at[cols_j], mask=mask_j, other=0.0).astype(jnp.float32)
                plgpu.store(d_ref.at[cols_j], (old * factor).astype(d_ref.dtype), mask=mask_j)

        jax.lax.cond(moves & finite_move, rescale_stored_chunks, lambda: None)
        e = jnp.exp(x - shift_of(r_new))
        # the target's column too (no `cols != target` in the mask: Triton would not vectorize a store masked by
        # a comparison with a scalar); the one-lane store after the loop writes its value over it
        plgpu.store(d_ref.at[cols], e.astype(d_ref.dtype), mask=mask)
        return r_new, s * factor + jnp.sum(e), hit + jnp.where(cols == target, x, 0.0)

    r, s, hit = jax.lax.fori_loop(0, pl.cdiv(n, chunk), body, (jnp.float32(-jnp.inf), jnp.float32(0.0),
                                                               jnp.zeros((chunk,), jnp.float32)))
    target_logit = jnp.sum(hit)
    log_z_ref[...] = jnp.where(jnp.isfinite(r), r + jnp.log(s), r)
    target_logit_ref[...] = target_logit
    row_scale_ref[...] = 1.0 / s
    # (softmax - 1) / row_scale at the target = exp(x_t - R) - s; one lane of the target's chunk stores it, over the
    # loop's e_t: the same lane of the same layout as the loop's store (so the same thread), and after the loop's
    # cross-warp reductions (barriers) in any case
    base = jax.lax.div(jnp.clip(target, 0, n - 1), chunk) * chunk   # non-negative: a plain division
    cols = base + jnp.arange(chunk)
    value = jnp.exp(target_logit - shift_of(r)) - s
    plgpu.store(d_ref.at[cols], jnp.full((chunk,), value).astype(d_ref.dtype),
                mask=(cols == target) & (target >= 0) & (target < n))


def _loss_and_grad_two_reads_kernel(x_ref, target_ref, d_ref, log_z_ref, target_logit_ref, row_scale_ref, *,
                                    chunk: int):
    """`_loss_and_grad_kernel`'s form before it (kernels.cross_entropy='pallas_fused'): the forward's statistics,
    then d = exp(x - log Z) - one-hot itself (row_scale 1) over the same row, stored over it when d_ref aliases
    x_ref: a second read of the row (each chunk read before it is written, by this program alone)."""
    n, target = x_ref.shape[0], target_ref[...]
    log_z, target_logit = _row_statistics(x_ref, target, chunk)
    log_z_ref[...], target_logit_ref[...], row_scale_ref[...] = log_z, target_logit, jnp.float32(1.0)
    chunks = pl.cdiv(n, chunk)

    @pl.loop(0, chunks)
    def _(j):   # last chunk first, the most recently read (on an H100 6.83 ms against 6.95 in the forward order,
        #         two calls whose two-kernel reference both read 7.24 ms)
        cols = (chunks - 1 - j) * chunk + jnp.arange(chunk)
        mask = cols < n
        x = plgpu.load(x_ref.at[cols], mask=mask, other=0.0).astype(jnp.float32)
        d = jnp.exp(x - log_z) - jnp.where(cols == target, 1.0, 0.0)
        plgpu.store(d_ref.at[cols], d.astype(d_ref.dtype), mask=mask)


def _row_spec(v):
    return pl.BlockSpec((None, v), lambda t: (t, 0))


_SCALAR = pl.BlockSpec((None,), lambda t: (t,))


def _forward(logits_TV, targets_T, interpret: bool, chunk: int, num_warps: int):
    t, v = logits_TV.shape
    logits_TV, targets_T = (vary_like(a, logits_TV, targets_T) for a in (logits_TV, targets_T))
    out = output_struct((t,), jnp.float32, logits_TV, targets_T)
    return pl.pallas_call(
        functools.partial(_forward_kernel, chunk=chunk), grid=(t,),
        in_specs=[_row_spec(v), _SCALAR], out_specs=[_SCALAR, _SCALAR], out_shape=[out, out],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps), interpret=interpret,
        name="cross_entropy_forward")(logits_TV, targets_T)


def _backward(logits_TV, targets_T, log_z_T, g_T, interpret: bool, chunk: int, num_warps: int):
    t, v = logits_TV.shape
    operands = [vary_like(a, logits_TV, targets_T, log_z_T, g_T) for a in (logits_TV, targets_T, log_z_T, g_T)]
    return pl.pallas_call(
        functools.partial(_backward_kernel, chunk=chunk), grid=(t,),
        in_specs=[_row_spec(v), _SCALAR, _SCALAR, _SCALAR], out_specs=_row_spec(v),
        out_shape=output_struct(logits_TV.shape, logits_TV.dtype, *operands),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps), interpret=interpret,
        name="cross_entropy_backward")(*operands)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def cross_entropy_per_token(logits_TV, targets_T, interpret: bool = False, chunk: int = CHUNK,
                            num_warps: int = NUM_WARPS):
    """float32 [T]: log Z - the target's logit per row of `logits_TV` ([T, V], any float dtype; the gradient
    comes back in it). `interpret`: Pallas interpret mode (the CPU tests); `chunk` (a power of 2) and
    `num_warps`: the kernels' columns per loop step and warps per row (bench_cross_entropy sweeps them)."""
    if chunk & (chunk - 1):
        raise ValueError(f"cross_entropy_per_token: chunk={chunk} must be a power of 2 (Triton's block sizes)")
    return _vjp_forward(logits_TV, targets_T, interpret, chunk, num_warps)[0]


def _vjp_forward(logits_TV, targets_T, interpret, chunk, num_warps):
    targets_T = targets_T.astype(jnp.int32)
    log_z, target_logit = _forward(logits_TV, targets_T, interpret, chunk, num_warps)
    in_vocab = (targets_T >= 0) & (targets_T < logits_TV.shape[1])
    return log_z - jnp.where(in_vocab, target_logit, jnp.nan), (logits_TV, targets_T, log_z)


def _vjp_backward(interpret, chunk, num_warps, residuals, g_T):
    logits_TV, targets_T, log_z = residuals
    d_logits = _backward(logits_TV, targets_T, log_z, g_T.astype(jnp.float32), interpret, chunk, num_warps)
    return match_varying(d_logits, logits_TV, d_logits), None


cross_entropy_per_token.defvjp(_vjp_forward, _vjp_backward)


def loss_and_scaled_logit_grad(logits_TV, targets_T, interpret: bool = False, chunk: int = CHUNK,
                               num_warps: int = NUM_WARPS, alias: bool = True, one_read: bool = True):
    """(float32 [T] loss as `cross_entropy_per_token`, d [T, V] in the logits' dtype, float32 [T] row_scale) with
    softmax - one-hot = row_scale[:, None] * d, from one kernel that reads each row once and writes d over the
    logits (input_output_aliases: XLA copies them first only if they are used after this call). The loss's gradient
    w.r.t. the logits is (g * row_scale)[:, None] * d for a cotangent g; in `head_cross_entropy_per_token` that
    per-row factor moves onto the head GEMMs' [T, D] side, so the logits take one kernel and no second [T, V] array
    is alive at once. d rounds each value to bf16 once, as softmax - one-hot in bf16 does, twice only for values
    stored before a row's reference moved (the reference R: `REFERENCE_MARGIN`). The form before this one stored
    softmax - one-hot itself, which needs log Z before the first store: a second read of the row (on an H100 ~3
    elementwise passes' time, 6.83 ms at 32768 x 102400; benchmarks/results/cross_entropy_fused_head_1xh100.json);
    `one_read=False` runs that form (row_scale 1).
    `alias=False` writes d to a new array (bench_cross_entropy: a jitted function's argument is not donated, so an
    alias would copy it first)."""
    t, v = logits_TV.shape
    if chunk & (chunk - 1):
        raise ValueError(f"loss_and_scaled_logit_grad: chunk={chunk} must be a power of 2 (Triton's block sizes)")
    targets_T = targets_T.astype(jnp.int32)
    logits_TV, targets_T = (vary_like(a, logits_TV, targets_T) for a in (logits_TV, targets_T))
    scalar = output_struct((t,), jnp.float32, logits_TV, targets_T)
    d, log_z, target_logit, row_scale = pl.pallas_call(
        functools.partial(_loss_and_grad_kernel if one_read else _loss_and_grad_two_reads_kernel, chunk=chunk),
        grid=(t,),
        in_specs=[_row_spec(v), _SCALAR], out_specs=[_row_spec(v), _SCALAR, _SCALAR, _SCALAR],
        out_shape=[output_struct(logits_TV.shape, logits_TV.dtype, logits_TV, targets_T), scalar, scalar, scalar],
        input_output_aliases={0: 0} if alias else {}, compiler_params=plgpu.CompilerParams(num_warps=num_warps),
        interpret=interpret, name="cross_entropy_loss_and_grad")(logits_TV, targets_T)
    in_vocab = (targets_T >= 0) & (targets_T < v)
    return log_z - jnp.where(in_vocab, target_logit, jnp.nan), d, row_scale


def _head_logits(x_TD, w, w_is_VD: bool):
    return jnp.einsum("td,vd->tv" if w_is_VD else "td,dv->tv", x_TD, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def head_cross_entropy_per_token(x_TD, w, targets_T, w_is_VD: bool = False, interpret: bool = False,
                                 one_read: bool = True):
    """float32 [T]: `cross_entropy_per_token(x_TD @ W)` with W = w ([D, V]), or w.T where `w_is_VD` (a tied
    embedding table [V, D]); x and w in the compute dtype. The output head's GEMM and the loss as one custom VJP
    (the forward writes the logits' gradient up to the cotangent; see `loss_and_scaled_logit_grad`). Its plain twin is
    `cross_entropy_per_token` of the same einsum (tests/kernels/test_fused_head_cross_entropy.py). `one_read`: the
    kernel that reads the logits once (kernels.cross_entropy='pallas_fused_one_read'), else twice ('pallas_fused')."""
    return cross_entropy_per_token(_head_logits(x_TD, w, w_is_VD), targets_T, interpret)


def _head_forward(x_TD, w, targets_T, w_is_VD, interpret, one_read):
    loss_T, d_TV, row_scale_T = loss_and_scaled_logit_grad(_head_logits(x_TD, w, w_is_VD), targets_T, interpret,
                                                           one_read=one_read)
    return loss_T, (x_TD, w, d_TV, row_scale_T)


def _head_backward(w_is_VD, interpret, one_read, residuals, g_T):
    """d logits = g'[:, None] * d with g' = g * row_scale, so d x = g' * (d @ W^T) (the float32 GEMM output scaled,
    then rounded) and d W = (g' * x)^T @ d: the scale costs a [T, D] pass, not a [T, V] one."""
    x_TD, w, d_TV, row_scale_T = residuals
    g = (g_T.astype(jnp.float32) * row_scale_T)[:, None]
    dx = jnp.einsum("tv,vd->td" if w_is_VD else "tv,dv->td", d_TV, w, preferred_element_type=jnp.float32)
    dx = (dx * g).astype(x_TD.dtype)
    xg = (x_TD.astype(jnp.float32) * g).astype(x_TD.dtype)
    dw = jnp.einsum("tv,td->vd" if w_is_VD else "td,tv->dv", *((d_TV, xg) if w_is_VD else (xg, d_TV)))
    return match_varying(dx, x_TD, dx), match_varying(dw.astype(w.dtype), w, dw), None


head_cross_entropy_per_token.defvjp(_head_forward, _head_backward)
