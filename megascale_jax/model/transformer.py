"""Decoder-only MoE transformer: embed -> [dense blocks] -> MoE blocks -> norm -> logits.

Blocks of one kind are stacked (leading 'layers' axis on every parameter) and run with `jax.lax.scan`, so
compile time does not grow with depth. Remat of the scanned block follows `remat`:
  none       keep everything autodiff saves;
  full       keep only the block inputs, recompute the block in the backward pass;
  selective  keep what is expensive to recompute (q/k/v, the attention core, expert outputs) and recompute
             the cheap parts (norms, activations, routing) — the paper's selective rematerialisation.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from megascale_jax.model.attention import Attention
from megascale_jax.model.layers import DenseMLP, Embedding, RMSNorm, output_logits, param
from megascale_jax.model.moe.layer import MoEFFN

_STAT_KEYS = ("aux_loss", "z_loss", "tokens_per_expert", "dropped_tokens")


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + ffn(norm(x)); ffn is dense or MoE."""

    def __init__(self, cfg, moe: bool, group_size: int, param_dtype, rngs: nnx.Rngs):
        m = cfg
        self.attn_norm = RMSNorm(m.hidden, m.norm_eps, param_dtype)
        self.attn = Attention(m.hidden, m.num_heads, m.num_kv_heads, m.rope_theta, param_dtype, rngs)
        self.ffn_norm = RMSNorm(m.hidden, m.norm_eps, param_dtype)
        self.is_moe = moe
        if moe:
            self.ffn = MoEFFN(m.hidden, m.moe, group_size, param_dtype, rngs)
        else:
            self.ffn = DenseMLP(m.hidden, m.dense_ffn, param_dtype, rngs)

    def __call__(self, x_BSD, layout):
        # Named scopes reach the compiled HLO's op_name metadata; the communication analyzer attributes
        # collectives to components by them.
        kind = "moe_block" if self.is_moe else "dense_block"
        with jax.named_scope(f"{kind}/attention"):
            x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD), layout)
        with jax.named_scope(f"{kind}/ffn"):
            h = self.ffn_norm(x_BSD)
            if self.is_moe:
                y, stats = self.ffn(h, layout)
            else:
                h = layout.ffn_input(h)
                y = layout.ffn_output(self.ffn(h.reshape(-1, h.shape[-1])).reshape(h.shape))
                stats = None
        return x_BSD + y, stats


def _stacked_blocks(cfg, count: int, moe: bool, group_size: int, param_dtype, rngs: nnx.Rngs):
    """`count` blocks with parameters stacked on a leading axis (None when count == 0): logical 'layers' for
    the MoE stack (sharded over 'pipe' when a pipeline holds it), 'dense_layers' for the leading dense stack
    (which the first pipeline stage holds whole)."""
    if count == 0:
        return None

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0,
              transform_metadata={nnx.PARTITION_NAME: "layers" if moe else "dense_layers"})
    def create(rngs):
        return Block(cfg, moe, group_size, param_dtype, rngs)

    return create(rngs)


REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "selective": jax.checkpoint_policies.save_only_these_names("qkv", "attn_core", "expert_out"),
}


def run_stack(blocks, x_BSD, layout, remat: str):
    """Scans x through stacked blocks; returns x and per-layer stats stacked on a leading axis."""
    graphdef, state = nnx.split(blocks)

    def body(x, layer_state):
        y, stats = nnx.merge(graphdef, layer_state)(x, layout)
        return y, stats

    if remat != "none":
        body = jax.checkpoint(body, policy=REMAT_POLICIES[remat], prevent_cse=False)
    return jax.lax.scan(body, x_BSD, state)


class Transformer(nnx.Module):
    def __init__(self, cfg, *, param_dtype, compute_dtype, group_size: int, remat: str, rngs: nnx.Rngs):
        m = cfg
        self.cfg, self.compute_dtype, self.remat = m, compute_dtype, remat
        self.embed = Embedding(m.vocab_size, m.hidden, param_dtype, rngs)
        self.dense_blocks = _stacked_blocks(m, m.num_dense_layers, False, group_size, param_dtype, rngs)
        self.moe_blocks = _stacked_blocks(m, m.num_moe_layers, True, group_size, param_dtype, rngs)
        self.final_norm = RMSNorm(m.hidden, m.norm_eps, param_dtype)
        if not m.tie_embeddings:
            self.head_DV = param(rngs, (m.hidden, m.vocab_size), ("embed", "vocab"), param_dtype)

    def __call__(self, tokens_BS, layout):
        """Returns (logits_BSV float32, stats); stats['tokens_per_expert'] is [moe_layers, E]."""
        x = self.embed(tokens_BS, self.compute_dtype)
        if self.dense_blocks is not None:
            x, _ = run_stack(self.dense_blocks, x, layout, self.remat)
        x, stats = run_stack(self.moe_blocks, x, layout, self.remat)
        x = self.final_norm(x)
        if self.cfg.tie_embeddings:
            logits = self.embed.attend(x)
        else:
            logits = output_logits("bsd,dv->bsv", x, self.head_DV[...])
        return logits, stats
