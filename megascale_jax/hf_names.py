"""Hugging Face MoE families <-> megascale_jax: config.json keys and the tensor name / layout table.

Three families, checked against transformers 5.24's modeling_mixtral.py, modeling_qwen2_moe.py and
modeling_qwen3_moe.py (and their save_pretrained output, which writes the classic per-expert names):

  mixtral    MixtralForCausalLM   block_sparse_moe.gate / experts.{e}.w1 (gate) w3 (up) w2 (down); top-k
                                  probabilities always renormalised.
  qwen2_moe  Qwen2MoeForCausalLM  mlp.gate / experts.{e}.gate_proj up_proj down_proj, plus one shared expert
                                  (mlp.shared_expert.*) scaled by sigmoid(mlp.shared_expert_gate); biases on
                                  q/k/v (config.json qkv_bias, default True); norm_topk_prob (False for
                                  Qwen1.5-MoE-A2.7B: the top-k softmax probabilities are used as they are).
  qwen3_moe  Qwen3MoeForCausalLM  the Qwen2-MoE names without shared expert or biases, plus self_attn.q_norm /
                                  k_norm (RMSNorm over head_dim per head, before RoPE); head_dim 128 on hidden
                                  2048 with 32 heads (H*K != D); norm_topk_prob True.

Common to all: torch `nn.Linear` stores weight as [out, in] and computes x @ W.T, so every projection is
transposed into our [in, ...] layout; q/k/v split their out dim into (heads, head_dim) and o_proj its in dim.
RMSNorm is x * rsqrt(mean(x^2) + eps) * weight in float32 (eps inside the root), as megascale_jax/model/layers.py.
RoPE is `rotate_half` (the first and second halves of head_dim are the pair) with inv_freq = theta^(-2i/K), as
our `rope`, so q/k columns are NOT permuted. The router is softmax over all experts in float32, then top-k
(our `softmax_topk`, renormalize = norm_topk_prob). A fused expert layout (`experts.gate_up_proj`, transformers'
in-memory form) in a file is refused with a message naming it; export writes the classic names.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable

import numpy as np

# A name whose experts are not indexed per expert: experts.gate_up_proj, experts.down_proj, ...
FUSED_EXPERTS = re.compile(r"\.experts\.(?!\d+\.)")


@dataclasses.dataclass(frozen=True)
class Family:
    name: str                                   # config.json model_type
    architecture: str
    moe: str                                    # the MoE block's prefix inside a layer
    expert_names: tuple[str, str, str]          # gate, up, down projection names of one expert
    num_experts_key: str
    expert_ffn_key: str
    norm_eps_default: float


MIXTRAL = Family("mixtral", "MixtralForCausalLM", "block_sparse_moe.", ("w1", "w3", "w2"), "num_local_experts",
                 "intermediate_size", 1e-5)
QWEN2_MOE = Family("qwen2_moe", "Qwen2MoeForCausalLM", "mlp.", ("gate_proj", "up_proj", "down_proj"), "num_experts",
                   "moe_intermediate_size", 1e-6)
QWEN3_MOE = Family("qwen3_moe", "Qwen3MoeForCausalLM", "mlp.", ("gate_proj", "up_proj", "down_proj"), "num_experts",
                   "moe_intermediate_size", 1e-6)
FAMILIES = {f.name: f for f in (MIXTRAL, QWEN2_MOE, QWEN3_MOE)}


@dataclasses.dataclass(frozen=True)
class Entry:
    """One leaf of our params: `path` in the param tree, the HF name template ({l} layer, {e} expert), the
    stacked leading axes of our leaf ('L', 'E'), and the layout `kind` of each HF tensor:
      copy   same layout ([V, D] embedding, [D] / [K] norms);
      T      2-D transpose (router, experts, shared expert and its gate, head);
      qkv    [N*K, D] -> [D, N, K];
      o      [D, H*K] -> [H, K, D];
      heads  [N*K] -> [N, K] (q/k/v biases)."""
    path: tuple[str, ...]
    hf: str
    stack: tuple[str, ...]
    kind: str


def entries(m, family: Family) -> list[Entry]:
    """The table for our ModelConfig `m` in `family`'s names (which leaves exist follows `m`)."""
    blk, lay = ("moe_blocks",), "model.layers.{l}."
    moe, attn = lay + family.moe, lay + "self_attn."
    gate, up, down = family.expert_names
    L, LE = ("L",), ("L", "E")
    out = [
        Entry(("embed_tokens", "table_VD"), "model.embed_tokens.weight", (), "copy"),
        Entry(blk + ("attn_norm", "scale"), lay + "input_layernorm.weight", L, "copy"),
        Entry(blk + ("attn", "wq_DHK"), attn + "q_proj.weight", L, "qkv"),
        Entry(blk + ("attn", "wk_DGK"), attn + "k_proj.weight", L, "qkv"),
        Entry(blk + ("attn", "wv_DGK"), attn + "v_proj.weight", L, "qkv"),
        Entry(blk + ("attn", "wo_HKD"), attn + "o_proj.weight", L, "o"),
        Entry(blk + ("ffn_norm", "scale"), lay + "post_attention_layernorm.weight", L, "copy"),
        Entry(blk + ("ffn", "router", "w_DE"), moe + "gate.weight", L, "T"),
        Entry(blk + ("ffn", "experts", "w_gate_EDF"), moe + "experts.{e}." + gate + ".weight", LE, "T"),
        Entry(blk + ("ffn", "experts", "w_up_EDF"), moe + "experts.{e}." + up + ".weight", LE, "T"),
        Entry(blk + ("ffn", "experts", "w_down_EFD"), moe + "experts.{e}." + down + ".weight", LE, "T"),
        Entry(("final_norm", "scale"), "model.norm.weight", (), "copy"),
    ]
    if m.qkv_bias:
        out += [Entry(blk + ("attn", f"{p}_bias_{ax}"), attn + f"{p}_proj.bias", L, "heads")
                for p, ax in (("q", "HK"), ("k", "GK"), ("v", "GK"))]
    if m.qk_norm:
        out += [Entry(blk + ("attn", f"{p}_norm", "scale"), attn + f"{p}_norm.weight", L, "copy") for p in "qk"]
    if m.moe.num_shared_experts:
        out += [Entry(blk + ("ffn", "shared", ours), moe + f"shared_expert.{hf}.weight", L, "T")
                for ours, hf in (("w_gate_DF", "gate_proj"), ("w_up_DF", "up_proj"), ("w_down_FD", "down_proj"))]
    if m.moe.shared_expert_gate:
        out.append(Entry(blk + ("ffn", "shared_gate_D1"), moe + "shared_expert_gate.weight", L, "T"))
    if not m.tie_embeddings:
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
    if kind == "heads":  # ours [N, K]
        return (inner[0] * inner[1],)
    raise KeyError(kind)


def hf_slice(kind: str, inner: tuple[int, ...], sl: tuple[slice, ...]) -> tuple[slice, ...]:
    """The contiguous block of the HF tensor that holds our block `[sl]` (slices over our inner shape): what
    is read from disk; `to_ours` then lays it out."""
    if kind == "copy":
        return sl
    if kind == "T":
        return sl[::-1]
    if kind == "qkv":   # W [N*K, D]: the heads' rows, the D columns needed
        d, n, _ = sl
        n0, n1, _ = n.indices(inner[1])
        return slice(n0 * inner[2], n1 * inner[2]), d
    if kind == "o":     # W [D, H*K]
        h, _, d = sl
        h0, h1, _ = h.indices(inner[0])
        return d, slice(h0 * inner[1], h1 * inner[1])
    if kind == "heads":
        n, _ = sl
        n0, n1, _ = n.indices(inner[0])
        return (slice(n0 * inner[1], n1 * inner[1]),)
    raise KeyError(kind)


def to_ours(kind: str, raw, inner: tuple[int, ...], sl: tuple[slice, ...]):
    """Our block `[sl]` from `raw` = the HF tensor's `hf_slice` block. Array-API only (reshape, transpose,
    slicing), so it runs on numpy arrays and, inside jit, on the device."""
    if kind == "copy":
        return raw
    if kind == "T":
        return raw.T
    if kind == "qkv":   # [n*K, d] -> [d, n, K] -> [d, n, k]
        return raw.reshape(-1, inner[2], raw.shape[1]).transpose(2, 0, 1)[:, :, sl[2]]
    if kind == "o":     # [d, h*K] -> [h, K, d] -> [h, k, d]
        return raw.reshape(raw.shape[0], -1, inner[1]).transpose(1, 2, 0)[:, sl[1], :]
    if kind == "heads":  # [n*K] -> [n, k]
        return raw.reshape(-1, inner[1])[:, sl[1]]
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
    if kind == "heads":
        return x.reshape(-1)
    raise KeyError(kind)


# ------------------------------------------------------------------------------------------ config.json
def rope_theta(hf: dict):
    """transformers < 5 writes rope_theta at the top level, 5.x inside rope_parameters."""
    params = hf.get("rope_parameters") or {}
    return hf.get("rope_theta", params.get("rope_theta", 1e6))


def _shared_ffn(m) -> int:
    return m.moe.num_shared_experts * (m.moe.shared_expert_ffn or m.moe.expert_ffn)


# (config.json key, our dotted key, getter of our value, default when config.json lacks the key; "derived":
# hidden / heads as transformers derives head_dim)
Dimension = tuple[str, str, Callable, object]


def dimensions(family: Family) -> list[Dimension]:
    out: list[Dimension] = [
        ("vocab_size", "model.vocab_size", lambda m: m.vocab_size, None),
        ("hidden_size", "model.hidden", lambda m: m.hidden, None),
        (family.expert_ffn_key, "model.moe.expert_ffn", lambda m: m.moe.expert_ffn, None),
        ("num_hidden_layers", "model.num_layers", lambda m: m.num_layers, None),
        ("num_attention_heads", "model.num_heads", lambda m: m.num_heads, None),
        ("num_key_value_heads", "model.num_kv_heads", lambda m: m.num_kv_heads, None),
        (family.num_experts_key, "model.moe.num_experts", lambda m: m.moe.num_experts, None),
        ("num_experts_per_tok", "model.moe.top_k", lambda m: m.moe.top_k, None),
        ("head_dim", "model.head_dim", lambda m: m.head_dim, "derived"),
        ("rms_norm_eps", "model.norm_eps", lambda m: m.norm_eps, family.norm_eps_default),
        ("tie_word_embeddings", "model.tie_embeddings", lambda m: m.tie_embeddings, False),
        ("rope_theta", "model.rope_theta", lambda m: m.rope_theta, None),
    ]
    if family is not MIXTRAL:   # Mixtral always renormalises (no key)
        out.append(("norm_topk_prob", "model.moe.renormalize", lambda m: m.moe.renormalize, False))
    if family is QWEN2_MOE:
        out += [("shared_expert_intermediate_size", "model.moe.num_shared_experts x shared_expert_ffn", _shared_ffn,
                 None),
                ("qkv_bias", "model.qkv_bias", lambda m: m.qkv_bias, True)]
    return out


# transformers' attribute_map aliases: Qwen3MoeConfig 5.x writes the expert count as num_local_experts, the Hub's
# Qwen3 configs (4.51) as num_experts.
ALIASES = {"num_experts": "num_local_experts", "num_local_experts": "num_experts"}


def hf_value(hf: dict, key: str, default):
    if key == "rope_theta":
        return rope_theta(hf)
    if hf.get(key) is None and key in ALIASES:
        key = ALIASES[key]
    value = hf.get(key, default)
    return default if value is None and default is not None else value


def unsupported(hf: dict, family: Family, max_seq_len: int) -> list[str]:
    """config.json features our model does not have, each 'key=value'."""
    rope = (hf.get("rope_parameters") or {}).get("rope_type", "default")
    sliding = hf.get("sliding_window")
    if family is not MIXTRAL and not hf.get("use_sliding_window", False):
        sliding = None     # Qwen: sliding_window is set but ignored unless use_sliding_window
    checks = {"hidden_act": hf.get("hidden_act", "silu") == "silu",
              "rope_scaling": not hf.get("rope_scaling") and rope == "default",
              "sliding_window": not sliding or sliding >= max_seq_len,
              "mlp_only_layers": not hf.get("mlp_only_layers"),
              "decoder_sparse_step": hf.get("decoder_sparse_step", 1) == 1,
              "attention_bias": not hf.get("attention_bias", False)}
    return [f"{k}={hf.get(k, hf.get('rope_parameters'))!r}" for k, ok in checks.items() if not ok]


def family_of(m) -> Family:
    """The family our ModelConfig `m` exports as: q/k norms -> Qwen3-MoE, shared experts -> Qwen2-MoE, else
    Mixtral (`model_problems` then says what does not fit it)."""
    if m.qk_norm:
        return QWEN3_MOE
    if m.moe.num_shared_experts:
        return QWEN2_MOE
    return MIXTRAL


def model_problems(m, family: Family) -> list[str]:
    """Why our model config is not a `family` model (each a 'key=value: reason' string)."""
    out, e, name = [], m.moe, family.architecture
    if m.num_dense_layers:
        out.append(f"config.model.num_dense_layers={m.num_dense_layers}: {name} has no dense layers (set 0)")
    if m.attention_kind != "gqa" or e.router_kind != "softmax_topk":
        out.append(f"config.model.attention_kind / moe.router_kind: {name} uses 'gqa' and 'softmax_topk'")
    if m.tie_embeddings and m.tied_head_scale != "none":
        out.append("config.model.tie_embeddings=True with tied_head_scale='rsqrt_hidden': transformers' tied head is "
                   "unscaled; set config.model.tied_head_scale='none'")
    wants = {MIXTRAL: dict(qk_norm=False, qkv_bias=False, shared=0, gate=False, renormalize=True),
             QWEN2_MOE: dict(qk_norm=False, qkv_bias=True, shared=1, gate=True),
             QWEN3_MOE: dict(qk_norm=True, qkv_bias=False, shared=0, gate=False)}[family]
    ours = dict(qk_norm=m.qk_norm, qkv_bias=m.qkv_bias, shared=min(e.num_shared_experts, 1),
                gate=e.shared_expert_gate, renormalize=e.renormalize)
    shown = {"qk_norm": f"model.qk_norm={m.qk_norm}", "qkv_bias": f"model.qkv_bias={m.qkv_bias}",
             "shared": f"model.moe.num_shared_experts={e.num_shared_experts}",
             "gate": f"model.moe.shared_expert_gate={e.shared_expert_gate}",
             "renormalize": f"model.moe.renormalize={e.renormalize}"}
    for key, want in wants.items():
        if ours[key] != want:
            need = ("one shared expert" if want else "no shared expert") if key == "shared" else want
            out.append(f"config.{shown[key]}: {name} needs {need}")
    return out


def export_config(m, family: Family, torch_dtype: str) -> dict:
    """config.json for `family`'s CausalLM from our model config (the keys transformers 4.x and 5.x read)."""
    c = {"architectures": [family.architecture], "model_type": family.name, "vocab_size": m.vocab_size,
         "hidden_size": m.hidden, "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
         "num_key_value_heads": m.num_kv_heads, "head_dim": m.head_dim,
         family.num_experts_key: m.moe.num_experts, family.expert_ffn_key: m.moe.expert_ffn,
         "num_experts_per_tok": m.moe.top_k, "rope_theta": float(m.rope_theta), "rms_norm_eps": float(m.norm_eps),
         "tie_word_embeddings": bool(m.tie_embeddings), "max_position_embeddings": m.max_seq_len,
         "hidden_act": "silu", "sliding_window": None, "attention_dropout": 0.0, "initializer_range": 0.02,
         "router_aux_loss_coef": float(m.moe.aux_loss_weight), "output_router_logits": False, "use_cache": True,
         "torch_dtype": torch_dtype}
    if family is MIXTRAL:
        c.update(bos_token_id=1, eos_token_id=2)
        return c
    c.update(norm_topk_prob=bool(m.moe.renormalize), use_sliding_window=False, decoder_sparse_step=1,
             mlp_only_layers=[], max_window_layers=m.num_layers,
             # the dense-layer width transformers would use for mlp_only_layers (there are none)
             intermediate_size=m.dense_ffn)
    if family is QWEN2_MOE:
        c.update(shared_expert_intermediate_size=_shared_ffn(m), qkv_bias=bool(m.qkv_bias))
    else:
        c.update(attention_bias=False)
    return c
