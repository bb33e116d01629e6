"""GQA causal self-attention with RoPE.

The attention core (softmax(QK^T)V) is `jax.nn.dot_product_attention`: cuDNN flash attention on GPU, XLA
elsewhere. Under the manual SP plan, `layout.seq_to_heads` / `heads_to_seq` wrap the core with the
Ulysses all-to-alls (see megascale_jax/parallel/layouts.py); the projections never change.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from megascale_jax.model.layers import param, rope


def attention_core(q_BSHD, k_BSGD, v_BSGD, implementation: str):
    """Causal attention; k/v may have fewer heads (GQA), which dot_product_attention handles natively."""
    out = jax.nn.dot_product_attention(q_BSHD, k_BSGD, v_BSGD, is_causal=True, implementation=implementation)
    return checkpoint_name(out, "attn_core")


class Attention(nnx.Module):
    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, rope_theta: float, param_dtype,
                 rngs: nnx.Rngs):
        head_dim = dim // num_heads
        self.wq_DHK = param(rngs, (dim, num_heads, head_dim), ("embed", "heads", "head_dim"), param_dtype)
        self.wk_DGK = param(rngs, (dim, num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), param_dtype)
        self.wv_DGK = param(rngs, (dim, num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), param_dtype)
        self.wo_HKD = param(rngs, (num_heads, head_dim, dim), ("heads", "head_dim", "embed"), param_dtype,
                            scale=(num_heads * head_dim) ** -0.5)
        self.rope_theta = rope_theta

    def __call__(self, x_BSD, layout):
        """`layout` decides the communication (none on one device; SP / TP hooks under the manual plan)."""
        x_BSD = layout.attention_input(x_BSD)
        positions_BS = layout.positions(x_BSD)
        dt = x_BSD.dtype
        q = jnp.einsum("bsd,dhk->bshk", x_BSD, self.wq_DHK[...].astype(dt))
        k = jnp.einsum("bsd,dgk->bsgk", x_BSD, self.wk_DGK[...].astype(dt))
        v = jnp.einsum("bsd,dgk->bsgk", x_BSD, self.wv_DGK[...].astype(dt))
        q, k = rope(q, positions_BS, self.rope_theta), rope(k, positions_BS, self.rope_theta)
        q, k, v = checkpoint_name(q, "qkv"), checkpoint_name(k, "qkv"), checkpoint_name(v, "qkv")
        q, k, v = layout.attention_in(q, k, v)
        out = attention_core(q, k, v, layout.attention_impl)
        out = layout.attention_out(out)
        return layout.attention_proj_out(jnp.einsum("bshk,hkd->bsd", out, self.wo_HKD[...].astype(dt)))
