"""Parameter and FLOP accounting, read off the built model's abstract shapes (`nnx.eval_shape`: no memory).

Training FLOPs per token = 3 x forward (backward = 2 x forward):
  matmuls: 2 FLOPs per active matmul parameter per token (attention projections, the dense FFN, the shared
           experts and their gate, only the top-k routed experts, the router, the output head; the embedding
           lookup is free; biases and norm scales are elementwise, not matmuls);
  attention core: QK^T and PV each 2*S*K per head per token, halved by the causal mask -> 2*S*H*K, with K the
           model's head_dim (which need not be hidden / heads: Qwen3-MoE has 32 x 128 on hidden 2048).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class ModelSize:
    total_params: int
    active_params: int          # parameters touched per token (top-k routed experts only)
    train_flops_per_token: float

    def summary(self) -> str:
        return (f"{_human(self.total_params)} parameters, {_human(self.active_params)} active, "
                f"{_human(self.train_flops_per_token)}FLOP/token (train)")


def _human(x: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} "


def _abstract_params(m):
    """The built model's parameters as shapes only (nothing allocated): {path: shape}."""
    from flax import nnx

    from megascale_jax.model.transformer import Transformer

    model = nnx.eval_shape(lambda: Transformer(m, param_dtype=jnp.float32, compute_dtype=jnp.float32,
                                               remat="none", rngs=nnx.Rngs(0)))
    return {jax.tree_util.keystr(path): leaf.shape
            for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model))}


def model_size(m, seq_len: int) -> ModelSize:
    """Counts for ModelConfig `m` at training sequence length `seq_len`, read off the built model's shapes:
    routed-expert leaves count top_k / num_experts of their size as active; the embedding table is a
    lookup (no FLOPs) unless it is tied to the output head."""
    e = m.moe
    shapes = _abstract_params(m)
    total = active = matmul_active = 0
    for path, shape in shapes.items():
        size = int(np.prod(shape))
        share = e.top_k / e.num_experts if "['experts']" in path else 1.0
        total += size
        active += round(size * share)
        is_lookup = "['embed_tokens']" in path and not m.tie_embeddings
        stacked = "['moe_blocks']" in path or "['dense_blocks']" in path   # a leading [layers] axis
        is_bias = "_bias_" in path            # q/k/v biases are [heads, head_dim]: 2-D, but added, not multiplied
        if len(shape) - stacked >= 2 and not is_lookup and not is_bias:   # matrices; norms' scales are not matmuls
            matmul_active += size * share
    attn_core = 2 * seq_len * m.num_heads * m.head_dim * m.num_layers
    flops = 3 * (2 * matmul_active + attn_core)
    return ModelSize(total, active, float(flops))
