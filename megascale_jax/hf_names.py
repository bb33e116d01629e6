"""Hugging Face Mixtral <-> megascale_jax: the config keys and the tensor name / layout table.

Checked against transformers' src/transformers/models/mixtral/modeling_mixtral.py (classic layout):
torch `nn.Linear` stores weight as [out, in] and computes x @ W.T, so every projection is transposed into
our [in, ...] layout; q/k/v split their out dim into (heads, head_dim) and o_proj its in dim. RoPE: HF Mixtral
applies `rotate_half` (the first and second halves of head_dim are the pair), as megascale_jax/model/layers.py
`rope` does, so q/k columns are NOT permuted (the Meta-checkpoint interleave permutation is undone already
by transformers' own convert_mixtral_weights_to_hf.py). The router (`gate`) is softmax over all experts,
top-k, renormalised: our `softmax_topk` router with renormalize=True.

Only the classic per-expert names (`block_sparse_moe.experts.{e}.w1/w2/w3`, the names of the checkpoints on
the Hub) are read; a fused layout (`experts.gate_up_proj` / `mlp.experts.*`, written by newer transformers)
is refused with a message naming it. Export writes the classic names, which every transformers version loads.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

ARCHITECTURE = "MixtralForCausalLM"
MODEL_TYPE = "mixtral"
FUSED_MARKERS = ("gate_up_proj", ".mlp.experts.", "experts.down_proj")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One leaf of our params: `path` in the param tree, the HF name template ({l} layer, {e} expert), the
    stacked leading axes of our leaf ('L', 'E'), and the layout `kind` of each HF tensor:
      copy  same layout ([V, D] embedding, [D] norm);
      T     2-D transpose (router, experts, head);
      qkv   [N*K, D] -> [D, N, K];
      o     [D, H*K] -> [H, K, D]."""
    path: tuple[str, ...]
    hf: str
    stack: tuple[str, ...]
    kind: str


def entries(tie_embeddings: bool) -> list[Entry]:
    blk, lay, moe = ("moe_blocks",), "model.layers.{l}.", "model.layers.{l}.block_sparse_moe."
    out = [
        Entry(("embed_tokens", "table_VD"), "model.embed_tokens.weight", (), "copy"),
        Entry(blk + ("attn_norm", "scale"), lay + "input_layernorm.weight", ("L",), "copy"),
        Entry(blk + ("attn", "wq_DHK"), lay + "self_attn.q_proj.weight", ("L",), "qkv"),
        Entry(blk + ("attn", "wk_DGK"), lay + "self_attn.k_proj.weight", ("L",), "qkv"),
        Entry(blk + ("attn", "wv_DGK"), lay + "self_attn.v_proj.weight", ("L",), "qkv"),
        Entry(blk + ("attn", "wo_HKD"), lay + "self_attn.o_proj.weight", ("L",), "o"),
        Entry(blk + ("ffn_norm", "scale"), lay + "post_attention_layernorm.weight", ("L",), "copy"),
        Entry(blk + ("ffn", "router", "w_DE"), moe + "gate.weight", ("L",), "T"),
        Entry(blk + ("ffn", "experts", "w_gate_EDF"), moe + "experts.{e}.w1.weight", ("L", "E"), "T"),
        Entry(blk + ("ffn", "experts", "w_up_EDF"), moe + "experts.{e}.w3.weight", ("L", "E"), "T"),
        Entry(blk + ("ffn", "experts", "w_down_EFD"), moe + "experts.{e}.w2.weight", ("L", "E"), "T"),
        Entry(("final_norm", "scale"), "model.norm.weight", (), "copy"),
    ]
    if not tie_embeddings:
        out.append(Entry(("head_DV",), "lm_head.weight", (), "T"))
    return out


def hf_name(entry: Entry, stack_index: tuple[int, ...]) -> str:
    return entry.hf.format(**dict(zip(("l", "e"), stack_index)))


def hf_shape(kind: str, inner: tuple[int, ...]) -> tuple[int, ...]:
    """The HF tensor's shape for our per-layer / per-expert `inner` shape."""
    if kind == "copy":
        return inner
    if kind == "T":
        return inner[::-1]
    if kind == "qkv":   # ours [D, N, K]
        return (inner[1] * inner[2], inner[0])
    if kind == "o":     # ours [H, K, D]
        return (inner[2], inner[0] * inner[1])
    raise KeyError(kind)


def read_ours(kind: str, w, inner: tuple[int, ...], sl: tuple[slice, ...]) -> np.ndarray:
    """Our block `[sl]` (slices over our inner shape) from the HF tensor `w` (a memmap: only the rows /
    columns needed are touched)."""
    if kind == "copy":
        return np.asarray(w[sl])
    if kind == "T":
        return np.asarray(w[sl[::-1]]).T
    if kind == "qkv":   # W [N*K, D] -> [D, N, K]; read the heads' rows and the D columns needed
        d, n, k = sl
        n0, n1, _ = n.indices(inner[1])
        block = np.asarray(w[n0 * inner[2]:n1 * inner[2], d])              # [n*K, d]
        return block.reshape(n1 - n0, inner[2], -1).transpose(2, 0, 1)[:, :, k]
    if kind == "o":     # W [D, H*K] -> [H, K, D]
        h, k, d = sl
        h0, h1, _ = h.indices(inner[0])
        block = np.asarray(w[d, h0 * inner[1]:h1 * inner[1]])              # [d, h*K]
        return block.reshape(-1, h1 - h0, inner[1]).transpose(1, 2, 0)[:, k, :]
    raise KeyError(kind)


def to_hf(kind: str, x: np.ndarray) -> np.ndarray:
    """One per-layer / per-expert block of ours -> the HF tensor."""
    if kind == "copy":
        return x
    if kind == "T":
        return x.T
    if kind == "qkv":
        return x.reshape(x.shape[0], -1).T
    if kind == "o":
        return x.reshape(-1, x.shape[-1]).T
    raise KeyError(kind)


# ------------------------------------------------------------------------------------------ config.json
def _rope_theta(hf: dict):
    params = hf.get("rope_parameters") or {}
    return hf.get("rope_theta", params.get("rope_theta", 1e6))


# (config.json key, our dotted key, getter of our value, default when config.json lacks the key)
DIMENSIONS: list[tuple[str, str, Callable, object]] = [
    ("vocab_size", "model.vocab_size", lambda m: m.vocab_size, None),
    ("hidden_size", "model.hidden", lambda m: m.hidden, None),
    ("intermediate_size", "model.moe.expert_ffn", lambda m: m.moe.expert_ffn, None),
    ("num_hidden_layers", "model.num_layers", lambda m: m.num_layers, None),
    ("num_attention_heads", "model.num_heads", lambda m: m.num_heads, None),
    ("num_key_value_heads", "model.num_kv_heads", lambda m: m.num_kv_heads, None),
    ("num_local_experts", "model.moe.num_experts", lambda m: m.moe.num_experts, None),
    ("num_experts_per_tok", "model.moe.top_k", lambda m: m.moe.top_k, None),
    ("head_dim", "model.hidden / model.num_heads", lambda m: m.head_dim, "derived"),
    ("rms_norm_eps", "model.norm_eps", lambda m: m.norm_eps, 1e-5),
    ("tie_word_embeddings", "model.tie_embeddings", lambda m: m.tie_embeddings, False),
]


def hf_value(hf: dict, key: str, default):
    if key == "rope_theta":
        return _rope_theta(hf)
    value = hf.get(key, default)
    return default if value is None and default is not None else value


def our_model_problems(m) -> list[str]:
    """Why our model config is not a Mixtral (each a 'key=value: reason' string)."""
    out = []
    if m.num_dense_layers:
        out.append(f"config.model.num_dense_layers={m.num_dense_layers}: Mixtral has no dense layers (set 0)")
    if m.moe.num_shared_experts:
        out.append(f"config.model.moe.num_shared_experts={m.moe.num_shared_experts}: Mixtral has none (set 0)")
    if m.attention_kind != "gqa":
        out.append(f"config.model.attention_kind={m.attention_kind!r}: Mixtral uses 'gqa'")
    if m.moe.router_kind != "softmax_topk" or not m.moe.renormalize:
        out.append("config.model.moe.router_kind/renormalize: Mixtral routes with 'softmax_topk', renormalize=True")
    if m.tie_embeddings:
        out.append("config.model.tie_embeddings=True: our tied head scales logits by 1/sqrt(hidden), "
                   "transformers' does not; use an untied config (Mixtral is untied)")
    return out


def export_config(m, torch_dtype: str) -> dict:
    """config.json for MixtralForCausalLM from our model config."""
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "vocab_size": m.vocab_size,
        "hidden_size": m.hidden, "intermediate_size": m.moe.expert_ffn, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads, "head_dim": m.head_dim,
        "num_local_experts": m.moe.num_experts, "num_experts_per_tok": m.moe.top_k,
        "rope_theta": float(m.rope_theta), "rms_norm_eps": float(m.norm_eps),
        "tie_word_embeddings": bool(m.tie_embeddings), "max_position_embeddings": m.max_seq_len,
        "hidden_act": "silu", "sliding_window": None, "attention_dropout": 0.0, "initializer_range": 0.02,
        "router_aux_loss_coef": float(m.moe.aux_loss_weight), "output_router_logits": False,
        "use_cache": True, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": torch_dtype,
    }
