"""Parameter and FLOP accounting from the config (analytic; tests check it against the built model).

Training FLOPs per token = 3 x forward (backward = 2 x forward):
  matmuls: 2 FLOPs per active matmul parameter per token (attention projections, the dense FFN, the shared
           experts, only the top-k routed experts, the router, the output head; the embedding lookup is free);
  attention core: QK^T and PV each 2*S*K per head per token, halved by the causal mask -> 2*S*H*K.
"""
from __future__ import annotations

import dataclasses


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


def _attention_params(m) -> int:
    head_dim = m.hidden // m.num_heads
    return m.hidden * head_dim * (2 * m.num_heads + 2 * m.num_kv_heads)


def model_size(m, seq_len: int) -> ModelSize:
    """Counts for ModelConfig `m` at training sequence length `seq_len`."""
    e = m.moe
    norms = 2 * m.hidden
    attn = _attention_params(m)
    dense_ffn = 3 * m.hidden * m.dense_ffn
    expert = 3 * m.hidden * e.expert_ffn
    shared = 3 * m.hidden * e.num_shared_experts * (e.shared_expert_ffn or e.expert_ffn)
    router = m.hidden * e.num_experts
    embed = m.vocab_size * m.hidden
    head = 0 if m.tie_embeddings else m.vocab_size * m.hidden
    dense_layer = attn + dense_ffn + norms
    moe_total = attn + e.num_experts * expert + shared + router + norms
    moe_active = attn + e.top_k * expert + shared + router + norms
    total = m.num_dense_layers * dense_layer + m.num_moe_layers * moe_total + embed + head + m.hidden
    active = m.num_dense_layers * dense_layer + m.num_moe_layers * moe_active + embed + head + m.hidden
    matmul_active = (m.num_dense_layers * (attn + dense_ffn) + m.num_moe_layers * (attn + e.top_k * expert + shared
                     + router) + m.vocab_size * m.hidden)
    attn_core = 2 * seq_len * m.num_heads * (m.hidden // m.num_heads) * m.num_layers
    flops = 3 * (2 * matmul_active + attn_core)
    return ModelSize(total, active, float(flops))
