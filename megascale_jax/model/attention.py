"""GQA causal self-attention with RoPE.

Per-family options (megascale_jax/config.py ModelConfig): `head_dim` may differ from hidden / num_heads (Qwen3-MoE:
32 heads of 128 on hidden 2048), so q/o are [D, H, K] / [H, K, D] with H*K != D; `qkv_bias` adds biases to the
q/k/v projections (Qwen2-MoE); `qk_norm` RMS-normalises each head of q and k over head_dim, after the projection
and before RoPE, with one learned scale of size head_dim shared by the heads (Qwen3-MoE; transformers'
Qwen3MoeAttention applies q_norm / k_norm to the [.., heads, head_dim] view in the same place).

The attention core (softmax(QK^T)V) is `jax.nn.dot_product_attention`: cuDNN flash attention on GPU with
bf16, XLA elsewhere (resolved once at build time, `resolve_attention_impl`). The layout's attention
strategy wraps the core with its communication (parallel/layouts.py: none, the Ulysses all-to-alls, or
Megatron's gather / reduce-scatter; parallel/ring_attention.py: the all-to-alls fused with the projections,
which it then runs per slice of heads); the projection arithmetic never changes.
"""
from __future__ import annotations

import dataclasses
from enum import StrEnum

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from megascale_jax.model.layers import RMSNorm, param, rms_norm, rope


class AttentionKind(StrEnum):
    GQA = "gqa"     # grouped-query attention with RoPE (MHA when kv heads = heads). MLA would be a second class.


class AttentionImpl(StrEnum):
    XLA = "xla"
    CUDNN = "cudnn"
    AUTO = "auto"   # resolved at build time: cudnn on GPU with bf16 compute, else xla


def resolve_attention_impl(choice: str, *, backend: str, compute_dtype) -> str:
    if choice != AttentionImpl.AUTO:
        return AttentionImpl(choice).value
    gpu_bf16 = backend == "gpu" and jnp.dtype(compute_dtype) == jnp.bfloat16
    return (AttentionImpl.CUDNN if gpu_bf16 else AttentionImpl.XLA).value


def attention_core(q_BSHD, k_BSGD, v_BSGD, implementation: str):
    """Causal attention; k/v may have fewer heads (GQA), which dot_product_attention handles natively."""
    out = jax.nn.dot_product_attention(q_BSHD, k_BSGD, v_BSGD, is_causal=True, implementation=implementation)
    return checkpoint_name(out, "attn_core")


class Attention(nnx.Module):
    def __init__(self, m, param_dtype, rngs: nnx.Rngs, *, implementation: str = "xla"):
        """m: a resolved ModelConfig (hidden, num_heads, num_kv_heads, head_dim, qkv_bias, qk_norm, norm_eps,
        rope_theta)."""
        dim, num_heads, num_kv_heads, head_dim = m.hidden, m.num_heads, m.num_kv_heads, m.head_dim
        # Fan-in: the contracted dims of each einsum: D for q/k/v ("bsd,dhk"), H*K for o ("bshk,hkd").
        # With unit-RMS x, q and k then have unit-variance entries and q.k/sqrt(K) has std ~1 at init.
        self.wq_DHK = param(rngs, (dim, num_heads, head_dim), ("embed", "heads", "head_dim"), param_dtype,
                            fan_in_axes=(0,))
        self.wk_DGK = param(rngs, (dim, num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), param_dtype,
                            fan_in_axes=(0,))
        self.wv_DGK = param(rngs, (dim, num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), param_dtype,
                            fan_in_axes=(0,))
        self.wo_HKD = param(rngs, (num_heads, head_dim, dim), ("heads", "head_dim", "embed"), param_dtype,
                            fan_in_axes=(0, 1))
        if m.qkv_bias:   # zero at init, as transformers initialises Linear biases
            bias = lambda heads, axis: nnx.Param(jnp.zeros((heads, head_dim), param_dtype),  # noqa: E731
                                                 out_sharding=(axis, "head_dim"), eager_sharding=False)
            self.q_bias_HK, self.k_bias_GK, self.v_bias_GK = (bias(num_heads, "heads"), bias(num_kv_heads, "kv_heads"),
                                                              bias(num_kv_heads, "kv_heads"))
        if m.qk_norm:
            self.q_norm = RMSNorm(head_dim, m.norm_eps, param_dtype, axis="head_dim")
            self.k_norm = RMSNorm(head_dim, m.norm_eps, param_dtype, axis="head_dim")
        self.qkv_bias, self.qk_norm = m.qkv_bias, m.qk_norm
        self.rope_theta, self.implementation = m.rope_theta, implementation

    def qkv_weights(self) -> dict:
        """The arrays the q/k/v projections read, handed over explicitly: a strategy that projects per slice of
        heads (parallel/ring_attention.py) uses them n times and retypes them once for shard_map, so that their
        gradients are summed locally and reduced over the mesh once."""
        w = {"wq": self.wq_DHK[...], "wk": self.wk_DGK[...], "wv": self.wv_DGK[...]}
        if self.qkv_bias:
            w.update(q_bias=self.q_bias_HK[...], k_bias=self.k_bias_GK[...], v_bias=self.v_bias_GK[...])
        if self.qk_norm:
            w.update(q_norm=self.q_norm.scale[...], k_norm=self.k_norm.scale[...])
        return w

    @staticmethod
    def qkv_columns(w, q_heads=None, kv_heads=None):
        """wq / wk / wv of the heads `q_heads` / `kv_heads` (int arrays; None: all): what the projection GEMMs read."""
        pick = lambda a, heads: a if heads is None else jnp.take(a, heads, axis=1)  # noqa: E731
        return pick(w["wq"], q_heads), pick(w["wk"], kv_heads), pick(w["wv"], kv_heads)

    def finish_qkv(self, positions_BS, q, k, v, w, q_heads=None, kv_heads=None):
        """The projection GEMMs' outputs (of those heads) -> q, k, v as the core reads them: + biases, per-head
        RMSNorm of q and k, RoPE at the rows' global positions; the tensors the remat policies call 'qkv'.
        Per token and head, so it may run before or after a sequence <-> heads exchange."""
        pick = lambda a, heads: a if heads is None else jnp.take(a, heads, axis=0)  # noqa: E731
        if self.qkv_bias:
            dt = q.dtype
            q, k, v = (q + pick(w["q_bias"], q_heads).astype(dt), k + pick(w["k_bias"], kv_heads).astype(dt),
                       v + pick(w["v_bias"], kv_heads).astype(dt))
        if self.qk_norm:   # RMSNorm's arithmetic on the explicit scales
            q, k = rms_norm(q, w["q_norm"], self.q_norm.eps), rms_norm(k, w["k_norm"], self.k_norm.eps)
        q, k = rope(q, positions_BS, self.rope_theta), rope(k, positions_BS, self.rope_theta)
        return checkpoint_name(q, "qkv"), checkpoint_name(k, "qkv"), checkpoint_name(v, "qkv")

    def project_rope(self, positions_BS, x_BSD, w, q_heads=None, kv_heads=None):
        """q, k, v in the compute dtype of the heads `q_heads` / `kv_heads` (None: all): the projection GEMMs,
        then `finish_qkv`. `w`: `qkv_weights()`."""
        q, k, v = project_qkv(x_BSD, *self.qkv_columns(w, q_heads, kv_heads))
        return self.finish_qkv(positions_BS, q, k, v, w, q_heads, kv_heads)

    def __call__(self, x_BSD, comm):
        """`comm`: the layout's attention strategy (parallel/layouts.py). It owns the communication around the
        core and may own the projection GEMMs (tiled by rank, as a fused GEMM+A2A / A2A+GEMM does), so it gets
        them as pure functions of explicit weights (`QKVProjection`); unfused it calls each once on all heads."""
        x_BSD = comm.attention_input(x_BSD)
        project = QKVProjection(self, comm.positions(x_BSD))
        q, k, v = comm.project_heads_in(x_BSD, project, self.qkv_weights())
        out = attention_core(q, k, v, self.implementation)
        return comm.project_heads_out(out, project_out_heads, self.wo_HKD[...])


@dataclasses.dataclass(frozen=True)
class QKVProjection:
    """The q/k/v projection an attention strategy runs. A call `project(x, w, q_heads, kv_heads)` is all of it at
    the strategy's own rows (`positions_BS`); `columns` and `finish` are its two halves, for a strategy whose
    GEMM is a kernel of its own that also moves the result (pallas_kernels/gemm_all_to_all.py): it finishes
    the received rows at their positions."""
    attention: Attention
    positions_BS: jax.Array

    def __call__(self, x_BSD, w, q_heads=None, kv_heads=None):
        return self.attention.project_rope(self.positions_BS, x_BSD, w, q_heads, kv_heads)

    def columns(self, w, q_heads=None, kv_heads=None):
        return self.attention.qkv_columns(w, q_heads, kv_heads)

    def finish(self, positions_BS, q, k, v, w, q_heads=None, kv_heads=None):
        return self.attention.finish_qkv(positions_BS, q, k, v, w, q_heads, kv_heads)


def project_qkv(x_BSD, wq_DHK, wk_DGK, wv_DGK):
    """The q / k / v projections in x's dtype (no bias, norm or RoPE)."""
    dt = x_BSD.dtype
    q = jnp.einsum("bsd,dhk->bshk", x_BSD, wq_DHK.astype(dt))
    k = jnp.einsum("bsd,dgk->bsgk", x_BSD, wk_DGK.astype(dt))
    return q, k, jnp.einsum("bsd,dgk->bsgk", x_BSD, wv_DGK.astype(dt))


def project_out_heads(o_BSHK, wo_HKD, heads=None, out_dtype=None):
    """`project_out` of the heads `heads` (int array, None: all) of o, with wo's rows of those heads."""
    return project_out(o_BSHK, wo_HKD if heads is None else jnp.take(wo_HKD, heads, axis=0), out_dtype)


def project_out(o_BSHK, wo_HKD, out_dtype=None):
    """The output projection [.., heads, head_dim] -> [.., D] in o's dtype, or in `out_dtype` (a sum over slices
    of heads keeps its partials in fp32: the GEMM's accumulator, not rounded to o's dtype)."""
    return jnp.einsum("bshk,hkd->bsd", o_BSHK, wo_HKD.astype(o_BSHK.dtype), preferred_element_type=out_dtype)


ATTENTIONS = {AttentionKind.GQA: Attention}
