"""The MoE FFN layer in the paper's phases: route -> dispatch -> experts -> combine, plus shared experts.

    route     the router (float32) picks top-k experts and weights per token, and the balance / z losses;
    dispatch  the layout's dispatcher sorts rows by expert: locally (one device, the XLA plan, TP experts)
              or across the intra-node domain (EP all-to-all / all-gather);
    experts   SwiGLU as grouped GEMMs over explicit weights (model/moe/experts.py);
    combine   rows back to their tokens, weighted sum over k in fp32;
    shared    shared experts, a dense SwiGLU on every token; with `shared_expert_gate` (Qwen2-MoE) its output is
              scaled per token by sigmoid(x . w_gate), w_gate [D, 1] (transformers' Qwen2MoeSparseMoeBlock).
Each phase runs under a `jax.named_scope` of its name (the analyzer and the profiles attribute by them).
The dispatcher runs dispatch -> first expert GEMM and last expert GEMM -> combine, so that a fused
communication + GEMM kernel can take over exactly those (parallel/layouts.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from megascale_jax.model.layers import DenseMLP, param
from megascale_jax.model.moe.experts import (FirstExpertGemms, LastExpertGemm, SwiGLUExperts, grouped_gemm_fn,
                                             kernel_backward)
from megascale_jax.model.moe.router import ROUTERS


class MoEFFN(nnx.Module):
    def __init__(self, dim: int, moe_cfg, param_dtype, rngs: nnx.Rngs, *, grouped_gemm: str = "xla",
                 grouped_gemm_tail: str = "kernel", swiglu: str = "separate", dense_swiglu: str = "separate"):
        """moe_cfg: a resolved MoEConfig (balance_group_size > 0). grouped_gemm, grouped_gemm_tail, swiglu:
        resolved implementations (model/moe/experts.py GroupedGemmImpl, GroupedGemmTail, SwigluImpl)."""
        e = moe_cfg
        self.num_experts, self.grouped_gemm, self.swiglu = e.num_experts, grouped_gemm, swiglu
        self.dense_swiglu = dense_swiglu   # the shared experts' (model/moe/experts.py resolve_dense_swiglu)
        self.grouped_gemm_tail = grouped_gemm_tail
        self.router = ROUTERS[e.router_kind](dim, e.num_experts, e.top_k, e.renormalize, e.balance_group_size,
                                             rngs)
        self.experts = SwiGLUExperts(e.num_experts, dim, e.expert_ffn, param_dtype, rngs)
        shared_ffn = e.num_shared_experts * (e.shared_expert_ffn or e.expert_ffn)
        # Shared experts are fused into one dense SwiGLU of the summed width (mathematically identical).
        self.shared = (DenseMLP(dim, shared_ffn, param_dtype, rngs, ffn_axis="ffn",
                                kernel_backward=kernel_backward(dense_swiglu)) if shared_ffn else None)
        self.shared_gated = bool(shared_ffn) and e.shared_expert_gate
        if self.shared_gated:   # contracted over D
            self.shared_gate_D1 = param(rngs, (dim, 1), ("embed", None), param_dtype, fan_in_axes=(0,))

    def __call__(self, x_BSD, layout):
        """Returns (y_BSD, stats) with stats: aux_loss, z_loss, tokens_per_expert, dropped_tokens."""
        x_BSD = layout.ffn.ffn_input(x_BSD)
        batch, seq, dim = x_BSD.shape
        x_TD = x_BSD.reshape(batch * seq, dim)
        with jax.named_scope("route"):
            routing = self.router(x_TD, layout.reductions.token_mean)
        gemm, weights = grouped_gemm_fn(self.grouped_gemm, self.grouped_gemm_tail), self.experts.weights()
        first = FirstExpertGemms(weights, gemm, self.swiglu)
        last = LastExpertGemm(weights, gemm)
        h_MF, group_sizes, residual = layout.ffn.first_gemm_dispatch(x_TD, routing, first)   # dispatch, experts
        y_TD = layout.ffn.last_gemm_combine(h_MF, group_sizes, residual, routing.weight_TK, last)  # experts, combine
        if self.shared is not None:
            with jax.named_scope("shared_experts"):
                y_TD = y_TD + self.shared_output(x_TD)
        stats = {"aux_loss": routing.aux_loss, "z_loss": routing.z_loss,
                 "tokens_per_expert": residual.tokens_per_expert, "dropped_tokens": residual.dropped_tokens}
        return layout.ffn.ffn_output(y_TD.reshape(batch, seq, dim)), stats


    def shared_output(self, x_TD):
        """The shared experts on every token, gated per token when `shared_expert_gate` is set. The gate is
        per token, so under TP experts (partial sums over the FFN width) scaling each partial sum is exact."""
        y_TD = self.shared(x_TD)
        if not self.shared_gated:
            return y_TD
        return gate_shared_output(x_TD, self.shared_gate_D1[...], y_TD)


def gate_shared_output(x_TD, w_gate_D1, y_TD):
    """Qwen2-MoE's shared-expert gate: y scaled per token by sigmoid(x . w_gate), the logit and the product in
    fp32, the output in y's dtype (also the macro layer's, model/transformer.py MoEBlockMath)."""
    logit_T1 = jnp.dot(x_TD, w_gate_D1.astype(x_TD.dtype), preferred_element_type=jnp.float32)
    return (jax.nn.sigmoid(logit_T1) * y_TD.astype(jnp.float32)).astype(y_TD.dtype)
