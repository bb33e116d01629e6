"""The MoE FFN layer: router -> dispatch -> experts -> combine, plus optional shared experts.

The routed part goes through `layout.expert_ffn`, which on one device (and under the XLA plan) is the local
dropless sort / grouped GEMM / unsort, and under the manual EP plan the expert-parallel exchange.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from megascale_jax.model.layers import DenseMLP
from megascale_jax.model.moe.experts import SwiGLUExperts
from megascale_jax.model.moe.router import Router


class MoEFFN(nnx.Module):
    def __init__(self, dim: int, moe_cfg, group_size: int, param_dtype, rngs: nnx.Rngs):
        e = moe_cfg
        self.num_experts = e.num_experts
        self.router = Router(dim, e.num_experts, e.top_k, e.renormalize, group_size, rngs)
        self.experts = SwiGLUExperts(e.num_experts, dim, e.expert_ffn, param_dtype, rngs)
        shared_ffn = e.num_shared_experts * (e.shared_expert_ffn or e.expert_ffn)
        # Shared experts are fused into one dense SwiGLU of the summed width (mathematically identical).
        self.shared = DenseMLP(dim, shared_ffn, param_dtype, rngs, ffn_axis="ffn") if shared_ffn else None

    def __call__(self, x_BSD, layout):
        """Returns (y_BSD, stats) with stats: aux_loss, z_loss, tokens_per_expert, dropped_tokens."""
        x_BSD = layout.ffn_input(x_BSD)
        batch, seq, dim = x_BSD.shape
        x_TD = x_BSD.reshape(batch * seq, dim)
        routing = self.router(x_TD, layout.token_mean)
        y_TD, dropped, tokens_per_expert = layout.expert_ffn(x_TD, routing, self.experts, self.num_experts)
        if self.shared is not None:
            y_TD = y_TD + self.shared(x_TD)
        stats = {"aux_loss": routing.aux_loss, "z_loss": routing.z_loss,
                 "tokens_per_expert": tokens_per_expert, "dropped_tokens": dropped}
        return layout.ffn_output(y_TD.reshape(batch, seq, dim)), stats
