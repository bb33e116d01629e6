"""Decoder-only MoE transformer, written as the stages every execution path composes:

    embed       token embedding + the leading dense blocks     (a pipeline's first stage)
    blocks      the scanned MoE stack                           (split over a pipeline's stages)
    head_loss   final norm + output logits + cross-entropy     (a pipeline's last stage)

`loss` composes them for the plain path; the pipeline (megascale_jax/gradients.py) calls the same methods
on its parts of the state, and each block through `scan_body`, the one place remat is applied. Losses
follow one convention: every value a stage returns is the global mean over the batch, reduced by the
layout's reductions (identity in the global view, over the mesh when running per device).

Blocks of one kind are stacked (leading 'layers' axis on every parameter) and run with `jax.lax.scan`, so
compile time does not grow with depth. Remat of the scanned block follows `remat`:
  none       keep everything autodiff saves;
  full       keep only the block inputs, recompute the block in the backward pass;
  selective  keep what is expensive to recompute (GEMM and attention outputs: q/k/v, the attention core, the
             residual stream after attention, the expert gate / up / down GEMMs) and recompute the cheap parts
             (norms, activations, routing) and re-communicate what a collective produced (the Ulysses and
             dispatch all-to-alls) — the paper's selective rematerialisation.
With a macro layer (parallel.moe_layer='macro') the layout's `block` strategy runs each MoE block with its
forward and backward written out (parallel/overlap.py) and owns its remat: `scan_body` then applies no
jax.checkpoint to the MoE stack, and `Block` hands the macro layer its pure pieces (`MoEBlockMath`) and its
parameter arrays (`MoEBlockWeights`), so nothing under model/ needs to know about the macro layer's collectives.
"""
from __future__ import annotations

import dataclasses
from enum import StrEnum

import jax
import jax.numpy as jnp
from flax import nnx

from typing import Callable, NamedTuple

from jax.ad_checkpoint import checkpoint_name

from megascale_jax.model.attention import ATTENTIONS, attention_core, project_out
from megascale_jax.model.layers import (CrossEntropyImpl, DenseMLP, Embedding, RMSNorm, cross_entropy, output_logits,
                                        pallas_cross_entropy, pallas_head_cross_entropy, param, rms_norm,
                                        swiglu_activation, swiglu_in, swiglu_out)
from megascale_jax.model.moe.experts import ExpertWeights, grouped_gemm_fn, grouped_gemm_grads, kernel_backward
from megascale_jax.model.moe.layer import MoEFFN, gate_shared_output
from megascale_jax.model.moe.router import Routing, route, router_logits


class Remat(StrEnum):
    NONE = "none"
    FULL = "full"
    SELECTIVE = "selective"


# The weights the model reads only as GEMM operands cast to the compute dtype (`w.astype(x.dtype)`): attention
# projections, dense and expert FFN matrices, the untied head. Not the router (float32 logits), norms' scales,
# biases, the shared-expert gate, or the embedding table (a gather whose gradient is a scatter-add, which in
# bf16 would lose frequent tokens' small updates). The train step keeps their compute-dtype copies in its state
# (megascale_jax/step.py) and differentiates w.r.t. them.
GEMM_WEIGHTS = frozenset({"wq_DHK", "wk_DGK", "wv_DGK", "wo_HKD", "w_gate_EDF", "w_up_EDF", "w_down_EFD",
                          "w_gate_DF", "w_up_DF", "w_down_FD", "head_DV"})


def _is_gemm_weight(path, _value) -> bool:
    return any(isinstance(k, str) and k in GEMM_WEIGHTS for k in path)


def gemm_weights_of(params):
    """The GEMM_WEIGHTS leaves of a parameter state (or of a tree of its shardings) alone, as an nnx.State."""
    gemm, _ = params.split(_is_gemm_weight, ...)
    return gemm


def gemm_weight_copies(params, dtype):
    """`gemm_weights_of(params)` cast to `dtype`."""
    return jax.tree.map(lambda x: x.astype(dtype), gemm_weights_of(params))


def with_gemm_weight_copies(params, copies):
    """`params` with its GEMM_WEIGHTS leaves replaced by `copies` (`gemm_weight_copies`' structure)."""
    _, rest = params.split(_is_gemm_weight, ...)
    return nnx.merge_state(rest, copies)


def cast_gemm_weights(params, dtype):
    """The parameter state with the GEMM_WEIGHTS leaves cast to `dtype`, the rest as they are."""
    return with_gemm_weight_copies(params, gemm_weight_copies(params, dtype))


CUDNN_ATTENTION_FWD = "dot_product_attention_fwd"   # jax's cuDNN flash-attention forward primitive(s)


def _saves_cudnn_attention_forward(prim, *_, **__) -> bool:
    """Keep every output of the cuDNN attention forward: the output (already kept as attn_core) and its softmax
    statistics ([B, H, S] fp32, 2/head_dim of the bf16 output's bytes). Naming the output alone leaves the
    statistics unnamed, and the backward then reruns the whole attention forward to get them back (profile of
    mixtral_small 16 x 4096, attention ms per step: none 37.5, selective 46.9 before, 39.4 with this (none 38.5 in
    that run): benchmarks/results/train_remat_1xh200.json)."""
    return prim.name.startswith(CUDNN_ATTENTION_FWD)


REMAT_POLICIES = {
    Remat.NONE: None,
    Remat.FULL: jax.checkpoint_policies.nothing_saveable,
    # The paper's selection (GEMM and attention outputs; named in model/attention.py, Block, model/moe/experts.py).
    # expert_out stays too: autodiff takes the routing weights' gradient from the expert outputs (the macro
    # layer takes it from the down GEMM's input gradient instead and keeps nothing of it).
    Remat.SELECTIVE: jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.save_only_these_names(
            "qkv", "attn_core", "attn_residual", "expert_gate", "expert_up", "expert_out"),
        _saves_cudnn_attention_forward),
}


@dataclasses.dataclass(frozen=True)
class Kernels:
    """Resolved kernel implementations (never 'auto'): attention core, expert grouped GEMM, and how the
    experts' first GEMMs and SwiGLU run."""
    attention: str = "xla"        # model/attention.py AttentionImpl
    grouped_gemm: str = "xla"     # model/moe/experts.py GroupedGemmImpl
    grouped_gemm_tail: str = "kernel"   # model/moe/experts.py GroupedGemmTail (pallas only)
    swiglu: str = "separate"      # model/moe/experts.py SwigluImpl (the experts)
    dense_swiglu: str = "separate"   # the dense layers' and shared experts' (resolve_dense_swiglu)
    cross_entropy: str = "xla"    # model/layers.py CrossEntropyImpl
    permute: str = "xla"          # parallel/permute.py PermuteImpl (read by the layout's dispatcher, not the model)
    adamw: str = "xla"            # updaters.py AdamWImpl (read by the train step's updater, not the model)


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + ffn(norm(x)); ffn is dense or MoE."""

    def __init__(self, cfg, moe: bool, param_dtype, kernels: Kernels, rngs: nnx.Rngs):
        m = cfg
        self.attn_norm = RMSNorm(m.hidden, m.norm_eps, param_dtype)
        self.attn = ATTENTIONS[m.attention_kind](m, param_dtype, rngs, implementation=kernels.attention)
        self.ffn_norm = RMSNorm(m.hidden, m.norm_eps, param_dtype)
        self.is_moe = moe
        if moe:
            self.ffn = MoEFFN(m.hidden, m.moe, param_dtype, rngs, grouped_gemm=kernels.grouped_gemm,
                              grouped_gemm_tail=kernels.grouped_gemm_tail, swiglu=kernels.swiglu,
                              dense_swiglu=kernels.dense_swiglu)
        else:
            self.ffn = DenseMLP(m.hidden, m.dense_ffn, param_dtype, rngs,
                                kernel_backward=kernel_backward(kernels.dense_swiglu))

    def __call__(self, x_BSD, layout):
        # Named scopes reach the compiled HLO's op_name metadata; the communication analyzer attributes
        # collectives to components by them.
        kind = "moe_block" if self.is_moe else "dense_block"
        if self.is_moe and getattr(layout, "block", None) is not None:
            with jax.named_scope(kind):   # the macro layer: forward and backward written out
                return layout.block(self.macro_math(), self.macro_weights(), x_BSD)
        with jax.named_scope(f"{kind}/attention"):
            x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD), layout.attention)
            x_BSD = checkpoint_name(x_BSD, "attn_residual")
        with jax.named_scope(f"{kind}/ffn"):
            h = self.ffn_norm(x_BSD)
            if self.is_moe:
                y, stats = self.ffn(h, layout)
            else:
                h = layout.ffn.ffn_input(h)
                y = layout.ffn.ffn_output(self.ffn(h.reshape(-1, h.shape[-1])).reshape(h.shape))
                stats = None
        return x_BSD + y, stats

    def macro_weights(self) -> "MoEBlockWeights":
        """This MoE block's parameter arrays (gradients flow back through these reads)."""
        f = self.ffn
        shared = None if f.shared is None else (f.shared.w_gate_DF[...], f.shared.w_up_DF[...], f.shared.w_down_FD[...])
        return MoEBlockWeights(self.attn_norm.scale[...], self.attn.qkv_weights(), self.attn.wo_HKD[...],
                               self.ffn_norm.scale[...], f.router.w_DE[...], f.experts.weights(), shared,
                               f.shared_gate_D1[...] if f.shared_gated else None)

    def macro_math(self) -> "MoEBlockMath":
        r = self.ffn.router
        return MoEBlockMath(self.attn_norm.eps, self.attn.implementation, r.top_k, r.renormalize, r.group_size,
                            self.ffn.grouped_gemm, self.ffn.grouped_gemm_tail, self.attn.project_rope,
                            kernel_backward(self.ffn.swiglu), kernel_backward(self.ffn.dense_swiglu))


class MoEBlockWeights(NamedTuple):
    """A MoE block's parameter arrays, in the layouts their modules hold them (param dtype)."""
    attn_norm_D: jax.Array
    qkv: dict                     # Attention.qkv_weights(): wq, wk, wv (+ q/k/v biases, q/k norm scales)
    wo_HKD: jax.Array
    ffn_norm_D: jax.Array
    router_DE: jax.Array
    experts: ExpertWeights
    shared: tuple | None          # (w_gate_DF, w_up_DF, w_down_FD) of the fused shared experts, or None
    shared_gate_D1: jax.Array | None = None   # the shared experts' sigmoid gate (model.moe.shared_expert_gate)


@dataclasses.dataclass(frozen=True)
class MoEBlockMath:
    """A MoE block's pieces as pure functions of explicit arrays, in the arithmetic of its modules (RMSNorm,
    Attention, Router, the experts), for a hand-written forward and backward (parallel/overlap.py). The macro
    layer's test compares the two paths, so a change to a module that is not mirrored here fails there."""
    norm_eps: float
    attention_impl: str
    top_k: int
    renormalize: bool
    balance_group_size: int
    grouped_gemm: str
    grouped_gemm_tail: str
    # Attention.project_rope(positions, x, w): the module's own projections (+ biases, q/k norms) and RoPE on
    # explicit weights; it reads only the module's static settings, no Variable.
    project_rope: Callable = dataclasses.field(compare=False)
    swiglu_kernel_backward: bool = False   # the experts' activation backward as the kernel (Kernels.swiglu)
    dense_kernel_backward: bool = False    # the shared experts' (Kernels.dense_swiglu)

    def norm(self, x, scale):
        return rms_norm(x, scale, self.norm_eps)

    def qkv(self, h_BSD, w_qkv, positions_BS):
        """Attention's projections and RoPE (before any communication); `w_qkv`: MoEBlockWeights.qkv."""
        return self.project_rope(positions_BS, h_BSD, w_qkv)

    def core(self, q, k, v):
        return attention_core(q, k, v, self.attention_impl)

    def out_proj(self, o_BSHK, wo_HKD):
        return project_out(o_BSHK, wo_HKD)

    def route(self, h_TD, w_DE, token_mean) -> Routing:
        """Router: float32 logits, softmax top-k, balance and z losses (token means through `token_mean`)."""
        return route(router_logits(h_TD, w_DE), self.top_k, self.renormalize, self.balance_group_size, token_mean)

    def expert_gemm(self, x_MK, w_GKN, group_sizes):
        return grouped_gemm_fn(self.grouped_gemm, self.grouped_gemm_tail)(x_MK, w_GKN.astype(x_MK.dtype), group_sizes)

    def expert_gemm_grads(self):
        """(dgrad(dy_MN, w_GKN, gs) -> dx_MK, wgrad(x_MK, dy_MN, gs) -> dw_GKN): the grouped GEMM's backward
        in two calls, so a collective can run between them."""
        return grouped_gemm_grads(self.grouped_gemm, self.grouped_gemm_tail)

    def activation(self, gate, up):
        """The experts' SwiGLU activation: silu(gate) * up."""
        return swiglu_activation(gate, up, self.swiglu_kernel_backward)

    def dense_in(self, h_TD, w_gate_DF, w_up_DF):
        """The shared experts' first GEMMs (layers.DenseMLP)."""
        return swiglu_in(h_TD, w_gate_DF, w_up_DF)

    def dense_out(self, gate, up, w_down_FD):
        return swiglu_out(gate, up, w_down_FD, self.dense_kernel_backward)

    def shared_gate(self, h_TD, w_gate_D1, y_TD):
        """The shared experts' output scaled per token by sigmoid(h . w_gate) (model/moe/layer.py)."""
        return gate_shared_output(h_TD, w_gate_D1, y_TD)


def _stacked_blocks(cfg, count: int, moe: bool, param_dtype, kernels: Kernels, rngs: nnx.Rngs):
    """`count` blocks with parameters stacked on a leading axis (None when count == 0): logical 'layers' for
    the MoE stack (sharded over 'pipe' when a pipeline holds it), 'dense_layers' for the leading dense stack
    (which the first pipeline stage holds whole)."""
    if count == 0:
        return None

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0,
              transform_metadata={nnx.PARTITION_NAME: "layers" if moe else "dense_layers"})
    def create(rngs):
        return Block(cfg, moe, param_dtype, kernels, rngs)

    return create(rngs)


def unrolled_stacks(model_cfg, scan_unroll: int) -> tuple:
    """The parameter keys of the layer stacks `Transformer._scan` runs as straight-line code (no loop: every layer
    unrolled), whose gradients autodiff builds from one piece per layer."""
    sizes = {"dense_blocks": model_cfg.num_dense_layers, "moe_blocks": model_cfg.num_moe_layers}
    return tuple(name for name, count in sizes.items() if 0 < count <= scan_unroll)


def scan_body(stack: nnx.Module, layout, remat: str, unrolled: bool = False):
    """(body(x, layer_state) -> (x, stats), the stack's state): one block of a stacked stack, with the remat
    policy applied. The one place remat is applied: the plain scan and the pipeline's layers both use it.

    unrolled: the caller runs the blocks as straight-line code (no loop between a block's forward and its
    backward). Then the recomputation must be protected from common-subexpression elimination, or XLA
    merges it with the forward and silently keeps every activation (measured: remat 'full' then ran as
    fast as 'none'); inside a loop the loop boundary already separates them (prevent_cse=False is cheaper)."""
    graphdef, state = nnx.split(stack)   # a stacked Block's graph merges with one layer's state

    def body(x, layer_state):
        return nnx.merge(graphdef, layer_state)(x, layout)

    macro_owns_remat = getattr(stack, "is_moe", False) and getattr(layout, "block", None) is not None
    if remat != Remat.NONE and not macro_owns_remat:
        body = jax.checkpoint(body, policy=REMAT_POLICIES[remat], prevent_cse=unrolled)
    return body, state


class Transformer(nnx.Module):
    def __init__(self, cfg, *, param_dtype, compute_dtype, remat: str, kernels: Kernels = Kernels(),
                 scan_unroll: int = 1, rngs: nnx.Rngs):
        """cfg: a resolved ModelConfig. kernels: resolved implementations (megascale_jax/step.py picks them).
        scan_unroll: layers per iteration of the scanned stacks (>= the layer count: no loop at all)."""
        m = cfg
        self.cfg, self.compute_dtype, self.remat, self.scan_unroll = m, compute_dtype, remat, scan_unroll
        self.cross_entropy_impl = kernels.cross_entropy
        self.embed_tokens = Embedding(m.vocab_size, m.hidden, param_dtype, rngs, m.tied_head_scale)
        self.dense_blocks = _stacked_blocks(m, m.num_dense_layers, False, param_dtype, kernels, rngs)
        self.moe_blocks = _stacked_blocks(m, m.num_moe_layers, True, param_dtype, kernels, rngs)
        self.final_norm = RMSNorm(m.hidden, m.norm_eps, param_dtype)
        if not m.tie_embeddings:
            self.head_DV = param(rngs, (m.hidden, m.vocab_size), ("embed", "vocab"), param_dtype,
                                 fan_in_axes=(0,))   # contracted over D

    # ------------------------------------------------------------------ stages
    def embed(self, tokens_BS, layout):
        """Token embedding, then the leading dense blocks (stage 0 of a pipeline holds them whole)."""
        x = self.embed_tokens(tokens_BS, self.compute_dtype)
        if self.dense_blocks is not None:
            x, _ = self._scan(self.dense_blocks, x, layout)
        return x

    def blocks(self, x_BSD, layout):
        """The MoE stack; returns x and per-layer stats stacked on a leading [layers] axis."""
        return self._scan(self.moe_blocks, x_BSD, layout)

    def _scan(self, stack, x_BSD, layout):
        num_layers = jax.tree.leaves(nnx.state(stack))[0].shape[0]
        body, state = scan_body(stack, layout, self.remat, unrolled=self.scan_unroll >= num_layers)
        return jax.lax.scan(body, x_BSD, state, unroll=min(self.scan_unroll, num_layers))

    def logits(self, x_BSD, dtype=jnp.float32):
        """Final norm and output head -> logits in `dtype` (None: the compute dtype)."""
        x_BSD, w, w_is_VD = self.head_operands(x_BSD)
        return output_logits("bsd,vd->bsv" if w_is_VD else "bsd,dv->bsv", x_BSD, w, dtype)

    def head_operands(self, x_BSD):
        """The output head's GEMM: (input after the final norm, weight, whether it is [V, D] (the tied table))."""
        x_BSD = self.final_norm(x_BSD)
        if self.cfg.tie_embeddings:
            return self.embed_tokens.head_input(x_BSD), self.embed_tokens.table_VD[...], True
        return x_BSD, self.head_DV[...], False

    def head_loss(self, x_BSD, targets_BS, layout):
        """Mean token cross-entropy over the whole batch (on every device)."""
        if self.cross_entropy_impl in (CrossEntropyImpl.PALLAS_FUSED, CrossEntropyImpl.PALLAS_FUSED_ONE_READ):
            x_BSD, w, w_is_VD = self.head_operands(x_BSD)
            one_read = self.cross_entropy_impl == CrossEntropyImpl.PALLAS_FUSED_ONE_READ
            return layout.reductions.token_mean(pallas_head_cross_entropy(x_BSD, w, targets_BS, w_is_VD,
                                                                          one_read=one_read))
        if self.cross_entropy_impl == CrossEntropyImpl.PALLAS:
            return layout.reductions.token_mean(pallas_cross_entropy(self.logits(x_BSD, None), targets_BS))
        return layout.reductions.token_mean(cross_entropy(self.logits(x_BSD), targets_BS))

    def moe_loss(self, stats):
        """aux_w * aux + z_w * z, per layer (or averaged over a leading layers axis)."""
        e = self.cfg.moe
        return e.aux_loss_weight * jnp.mean(stats["aux_loss"]) + e.z_loss_weight * jnp.mean(stats["z_loss"])

    # ------------------------------------------------------------------ compositions
    def __call__(self, tokens_BS, layout):
        """Returns (logits_BSV float32, stats); stats['tokens_per_expert'] is [moe_layers, E]."""
        x, stats = self.blocks(self.embed(tokens_BS, layout), layout)
        return self.logits(x), stats

    def loss(self, batch, layout):
        """(total loss, metrics): ce + weighted MoE losses; metrics ce, aux_loss, z_loss (layer means),
        tokens_per_expert [layers, E] and dropped_tokens summed over the batch. Global on every device."""
        x, stats = self.blocks(self.embed(batch["inputs"], layout), layout)
        ce = self.head_loss(x, batch["targets"], layout)
        metrics = {"ce": ce, "aux_loss": jnp.mean(stats["aux_loss"]), "z_loss": jnp.mean(stats["z_loss"]),
                   "tokens_per_expert": layout.reductions.batch_sum(stats["tokens_per_expert"]),
                   "dropped_tokens": layout.reductions.device_sum(jnp.sum(stats["dropped_tokens"]))}
        return ce + self.moe_loss(stats), metrics
