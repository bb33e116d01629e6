"""Qwen1.5-MoE-A2.7B (Qwen2-MoE architecture, Qwen team 2024): 24 layers, hidden 2048, 16 heads (MHA, head_dim
128) with q/k/v biases, 60 routed experts of FFN 1408, top-4, top-k probabilities NOT renormalised
(norm_topk_prob false), plus one shared expert of FFN 5632 scaled by sigmoid(x . w_gate); vocab 151936, untied.
14.3 B parameters, 2.7 B active (model card); ours: see tests/test_hf_families.py.

Source of every number: the model's config.json on the Hugging Face Hub (architectures Qwen2MoeForCausalLM,
hidden_size 2048, num_hidden_layers 24, num_attention_heads 16, num_key_value_heads 16, num_experts 60,
num_experts_per_tok 4, moe_intermediate_size 1408, shared_expert_intermediate_size 5632, intermediate_size 5632,
norm_topk_prob false, rms_norm_eps 1e-06, rope_theta 1000000.0, vocab_size 151936, tie_word_embeddings false,
max_position_embeddings 32768, use_sliding_window false, decoder_sparse_step 1, router_aux_loss_coef 0.001),
as quoted for Qwen/Qwen1.5-MoE-A2.7B-Chat(-GPTQ-Int4), which shares the base model's architecture; q/k/v biases:
transformers' Qwen2MoeConfig.qkv_bias defaults to True (the Hub config predates the key).

    python -m megascale_jax.convert import --hf /path/to/Qwen1.5-MoE-A2.7B --config configs/qwen2_moe_a2_7b.py --out ckpt
    python -m megascale_jax.train --config configs/qwen2_moe_a2_7b.py --config.checkpoint.dir=ckpt

Plan: the paper's SP + EP, but over 4 devices (parallel.intra=4), not the node's 8: 60 experts do not split
evenly over 8 ranks (EP holds whole experts per rank), and 4 divides both 60 experts and 16 heads. On an 8-GPU
node the other factor of 2 is data parallelism.
"""
from configs import base


def get_config():
    c = base.get_config()
    c.name = "qwen2_moe_a2_7b"
    c.model.update(vocab_size=151936, num_layers=24, hidden=2048, num_heads=16, num_kv_heads=16, qkv_bias=True,
                   dense_ffn=5632, rope_theta=1e6, norm_eps=1e-6, max_seq_len=32768)
    c.model.moe.update(num_experts=60, top_k=4, expert_ffn=1408, num_shared_experts=1, shared_expert_ffn=5632,
                       shared_expert_gate=True, renormalize=False, aux_loss_weight=0.001)
    base.large_scale_training(c)
    c.parallel.intra = 4
    return c
