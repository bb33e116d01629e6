"""Small building blocks: parameters with logical axes, RMSNorm, RoPE, embedding, output logits, cross-entropy,
dense SwiGLU MLP."""
from __future__ import annotations

import math
from enum import StrEnum

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from pallas_kernels.varying import per_device_refusal


def _truncated_normal_std(bound: float) -> float:
    """Std of a standard normal truncated to [-bound, bound]: sqrt(1 - 2 b phi(b) / (Phi(b) - Phi(-b))),
    with phi the standard normal density and Phi(b) - Phi(-b) = erf(b / sqrt(2)). 0.8796 for b = 2."""
    density = math.exp(-bound * bound / 2) / math.sqrt(2 * math.pi)
    return math.sqrt(1.0 - 2.0 * bound * density / math.erf(bound / math.sqrt(2)))


TRUNCATION = 2.0                                        # in units of the underlying unit normal
TRUNCATED_NORMAL_STD = _truncated_normal_std(TRUNCATION)


def param(rngs: nnx.Rngs, shape, axes: tuple[str | None, ...], dtype, *,
          fan_in_axes: tuple[int, ...] | None = None, scale: float | None = None) -> nnx.Param:
    """A truncated-normal parameter whose std is exactly `scale`, or 1/sqrt(fan_in) with fan_in the product
    of the dims `fan_in_axes` (positions in `shape`: the dims the weight is contracted over in its einsum).

    Exactly one of the two is given, by every caller: the contracted dims cannot be guessed from the shape
    (the last-but-one dim is the hidden size of a [D, F] weight but the head count of a [D, H, K] one, which
    made q 10x and k/v 20x too large at Mixtral shapes and saturated the softmax at init). A layer stacked with
    nnx.vmap calls this with the per-layer shape, so the positions never include the layers axis.

    jax.random.truncated_normal(-2, 2) has std TRUNCATED_NORMAL_STD (0.88), not 1: the draw is divided by it
    so the stated std is the parameter's std (the cut then lies at +-2.27 std, as in flax's
    variance_scaling initialisers).

    Logical axes only, never a sharding at creation (eager_sharding=False): creating a module needs no mesh;
    megascale_jax/step.py creates the state with its shardings by jitting the initializer."""
    if (fan_in_axes is None) == (scale is None):
        raise ValueError(f"param of shape {shape}: give exactly one of fan_in_axes (the contracted dims) or scale")
    if scale is None:
        if not fan_in_axes or any(not 0 <= a < len(shape) for a in fan_in_axes) \
                or len(set(fan_in_axes)) != len(fan_in_axes):
            raise ValueError(f"fan_in_axes {fan_in_axes} are not distinct dims of shape {shape}")
        scale = math.prod(shape[a] for a in fan_in_axes) ** -0.5
    unit = jax.random.truncated_normal(rngs.params(), -TRUNCATION, TRUNCATION, shape, jnp.float32)
    value = (scale / TRUNCATED_NORMAL_STD) * unit
    return nnx.Param(value.astype(dtype), out_sharding=axes, eager_sharding=False)


class RMSNorm(nnx.Module):
    """RMSNorm over the last dim, computed in float32 (cheap, and bf16 variance loses precision), output in the
    input dtype. `axis`: the scale's logical axis ("embed" for the residual stream, "head_dim" for Qwen3's
    per-head q/k norms)."""

    def __init__(self, dim: int, eps: float, param_dtype, axis: str = "embed"):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), out_sharding=(axis,), eager_sharding=False)
        self.eps = eps

    def __call__(self, x):
        return rms_norm(x, self.scale[...], self.eps)


def rms_norm(x, scale, eps: float):
    """RMSNorm over the last dim in float32, output in x's dtype (RMSNorm's arithmetic, on explicit arrays)."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rope(x_BSHD, positions_BS, theta: float):
    """Rotary position embedding (rotate-half form) on the last dim; positions are global token indices."""
    half = x_BSHD.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions_BS[..., None].astype(jnp.float32) * freq           # [B, S, half]
    sin, cos = jnp.sin(angle)[:, :, None, :], jnp.cos(angle)[:, :, None, :]
    x1, x2 = jnp.split(x_BSHD.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BSHD.dtype)


class TiedHeadScale(StrEnum):
    RSQRT_HIDDEN = "rsqrt_hidden"   # logits of the tied head scaled by 1/sqrt(hidden) (see Embedding.head_input)
    NONE = "none"                   # unscaled, as Hugging Face ties the head


class Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, param_dtype, rngs: nnx.Rngs,
                 tied_head_scale: str = TiedHeadScale.RSQRT_HIDDEN):
        self.table_VD = param(rngs, (vocab, dim), ("vocab", "embed"), param_dtype, scale=1.0)
        self.tied_head_scale = TiedHeadScale(tied_head_scale)

    def __call__(self, tokens_BS, dtype):
        return jnp.take(self.table_VD[...], tokens_BS, axis=0).astype(dtype)

    def head_input(self, x_BSD):
        """The tied output head's GEMM input (its weight is the table): x scaled by 1/sqrt(dim). Why: the table is
        initialised with std 1 (right for inputs), so the unscaled product of a unit-RMS hidden state with it has
        logits of std sqrt(dim): a first loss of ~28 nats at dim 128, vocab 256. TiedHeadScale.NONE leaves it
        out, as Hugging Face's tied models expect."""
        if self.tied_head_scale == TiedHeadScale.RSQRT_HIDDEN:
            x_BSD = x_BSD * jnp.asarray(x_BSD.shape[-1] ** -0.5, x_BSD.dtype)
        return x_BSD


def output_logits(equation: str, x_BSD, w, dtype=jnp.float32):
    """Output-layer logits as float32 for the loss, from a GEMM in the compute dtype (fp32 accumulation,
    output rounded to the compute dtype, as Megatron does). Why not a float32 GEMM output: its cotangent is
    float32, so both backward GEMMs would run in float32, which XLA lowers to TF32 GEMMs at half the bf16
    rate; the 2-H200 profiles (benchmarks/results/plans_2xh200.json) showed them as the largest kernels
    after the expert GEMMs (DeepSeek-like: 17-22 ms of a 100-120 ms step). `dtype=None` leaves them in the
    compute dtype (for the Pallas cross-entropy, which reads the bf16 logits itself)."""
    logits = jnp.einsum(equation, x_BSD, w.astype(x_BSD.dtype))
    return logits if dtype is None else logits.astype(dtype)


class CrossEntropyImpl(StrEnum):
    XLA = "xla"         # `cross_entropy` below (logsumexp + one-hot target logit, autodiff), any backend
    PALLAS = "pallas"   # pallas_kernels/cross_entropy.py: one read forward, one pass backward (GPU, per device)
    # pallas_kernels/cross_entropy.head_cross_entropy_per_token: the head GEMM and the loss as one custom VJP whose
    # forward kernel writes softmax - one-hot over the logits (GPU, per device; `pallas` is its unfused twin)
    PALLAS_FUSED = "pallas_fused"
    # the same head with a kernel that reads the logits once and stores (softmax - one-hot) / a per-row scale
    # (pallas_kernels/cross_entropy.loss_and_scaled_logit_grad); `auto`'s choice on a GPU per device
    PALLAS_FUSED_ONE_READ = "pallas_fused_one_read"
    AUTO = "auto"       # resolved at build time (`resolve_cross_entropy`)


def resolve_cross_entropy(choice: str, *, backend: str, partitioned_by_xla: bool) -> str:
    """`auto` -> 'pallas_fused_one_read' on GPU where each device runs its own program (one device, or the manual
    plans' and the pipelines' shard_map), else 'xla'. Measured inside deepseekmoe_small's train step (8 x 4096 tokens,
    102400-word vocabulary, one H100, same call): the loss head's softmax passes 7.4 ms (forward 2.7, backward 4.7)
    against the XLA form's 9.9, 166.5k against 165.5k tokens/s (benchmarks/results/train_step_cross_entropy_1xh100
    .json); 'pallas_fused' 6.9 ms in one kernel, and one [T, V] array less in the backward
    (benchmarks/results/cross_entropy_fused_head_1xh100.json); 'pallas_fused_one_read' 4.9-5.0 ms against
    'pallas_fused''s 6.9-7.0 in two calls of opposite order, 165.8-166.9k against 163.6-164.1k tokens/s, and 1.58
    against 2.24 ms in mixtral_small (benchmarks/results/train_step_cross_entropy_one_read_1xh100.json).
    Where the XLA compiler partitions the step over several devices (the XLA plan without a pipeline) a custom
    kernel would be gathered whole: 'pallas' there, or off the GPU, is an error."""
    where = per_device_refusal(backend=backend, partitioned_by_xla=partitioned_by_xla)
    if choice == CrossEntropyImpl.AUTO:
        return (CrossEntropyImpl.XLA if where else CrossEntropyImpl.PALLAS_FUSED_ONE_READ).value
    if choice in (CrossEntropyImpl.PALLAS, CrossEntropyImpl.PALLAS_FUSED, CrossEntropyImpl.PALLAS_FUSED_ONE_READ) \
            and where:
        raise ValueError(f"config.kernels.cross_entropy={choice!r} is a per-device GPU kernel and this run has {where}; "
                         f"use 'xla' or 'auto'")
    return CrossEntropyImpl(choice).value


def pallas_cross_entropy(logits_BSV, targets_BS, interpret: bool = False):
    """`cross_entropy`'s value from pallas_kernels/cross_entropy.py, on logits in the compute dtype."""
    from pallas_kernels.cross_entropy import cross_entropy_per_token

    b, s, v = logits_BSV.shape
    return jnp.mean(cross_entropy_per_token(logits_BSV.reshape(b * s, v), targets_BS.reshape(b * s), interpret))


def pallas_head_cross_entropy(x_BSD, w, targets_BS, w_is_VD: bool, interpret: bool = False, *, one_read: bool):
    """`cross_entropy`'s value of the logits x @ w (w: [D, V]; [V, D] where `w_is_VD`, a tied table), the head
    GEMM and the loss as one custom VJP (pallas_kernels/cross_entropy.head_cross_entropy_per_token); `one_read`:
    its kernel that reads the logits once (kernels.cross_entropy='pallas_fused_one_read')."""
    from pallas_kernels.cross_entropy import head_cross_entropy_per_token

    b, s, d = x_BSD.shape
    return jnp.mean(head_cross_entropy_per_token(x_BSD.reshape(b * s, d), w.astype(x_BSD.dtype),
                                                 targets_BS.reshape(b * s), w_is_VD, interpret, one_read))


def cross_entropy(logits_BSV, targets_BS):
    """Mean token cross-entropy in float32 over the tokens given (this device's, when per device)."""
    logits = logits_BSV.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    # The target's logit by a one-hot mask, not take_along_axis: the same value (one term, exact), but its
    # gradient is elementwise, so the logits gradient (softmax - one-hot) can be one pass fused with the cast
    # to the GEMM's dtype. take_along_axis's transpose was a scatter into the f32 [B, S, V] gradient, then a
    # separate cast pass: 6.3 ms of a mixtral_small step on the H200 (train_step_profile_mixtral_small_1xh200
    # .json, loop_multiply_fusion + wrapped_convert.4). After the change the HLO has no scatter there and the
    # step's non-GEMM time fell 82.8 -> 79.7 ms (the same file's after_cross_entropy_mask).
    # A one-pass forward (one variadic reduction carrying the running max, the scaled exp-sum and the target
    # logit) was tried and measured slower: 6.1 vs 5.0 ms of the deepseekmoe_small step on an H100, the same
    # alone (4.67 vs 4.71 ms; benchmarks/results/cross_entropy_1xh100.json): XLA's reduction did not get faster
    # for reading the logits once, and the variadic combiner adds work per element. The Pallas kernel
    # (kernels.cross_entropy) does read them once at 2.52 ms.
    # A target outside the vocabulary matches no column: its logit is NaN (as take_along_axis's fill), so the
    # loss is NaN and the step's non-finite check catches it instead of training on a silent zero.
    num_classes = logits.shape[-1]
    vocab_V = lax.broadcasted_iota(jnp.int32, (num_classes,), 0)
    target_logit = jnp.sum(jnp.where(vocab_V == targets_BS[..., None], logits, 0.0), axis=-1)
    in_vocab = (targets_BS >= 0) & (targets_BS < num_classes)
    return jnp.mean(log_z - jnp.where(in_vocab, target_logit, jnp.nan))


class DenseMLP(nnx.Module):
    """SwiGLU MLP: down(silu(x @ gate) * (x @ up)). Used for dense layers and shared experts."""

    def __init__(self, dim: int, ffn: int, param_dtype, rngs: nnx.Rngs, ffn_axis: str = "ffn",
                 kernel_backward: bool = False):
        self.kernel_backward = kernel_backward   # the activation's backward as one Pallas pass (swiglu_activation)
        # Fan-in: the contracted dim of each matmul (D for gate/up, F for down).
        self.w_gate_DF = param(rngs, (dim, ffn), ("embed", ffn_axis), param_dtype, fan_in_axes=(0,))
        self.w_up_DF = param(rngs, (dim, ffn), ("embed", ffn_axis), param_dtype, fan_in_axes=(0,))
        self.w_down_FD = param(rngs, (ffn, dim), (ffn_axis, "embed"), param_dtype, fan_in_axes=(0,))

    def __call__(self, x_TD):
        gate, up = swiglu_in(x_TD, self.w_gate_DF[...], self.w_up_DF[...])
        return swiglu_out(gate, up, self.w_down_FD[...], self.kernel_backward)


def swiglu_in(x_TD, w_gate_DF, w_up_DF):
    """SwiGLU's first GEMMs in x's dtype: (x @ gate, x @ up)."""
    dt = x_TD.dtype
    return x_TD @ w_gate_DF.astype(dt), x_TD @ w_up_DF.astype(dt)


def swiglu_activation(gate, up, kernel_backward: bool = False):
    """silu(gate) * up; `kernel_backward` (kernels.swiglu='separate_pallas_bwd'): its backward is one Pallas pass
    (pallas_kernels/swiglu_backward.py: the same values, fewer passes than XLA's two backward fusions)."""
    if kernel_backward:
        from pallas_kernels.swiglu_backward import swiglu_with_kernel_backward

        return swiglu_with_kernel_backward(gate, up)
    return jax.nn.silu(gate) * up


def swiglu_out(gate, up, w_down_FD, kernel_backward: bool = False):
    """SwiGLU's activation and last GEMM: (silu(gate) * up) @ down."""
    return swiglu_activation(gate, up, kernel_backward) @ w_down_FD.astype(gate.dtype)
