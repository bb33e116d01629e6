"""Qwen3-30B-A3B (Qwen3-MoE, Qwen team 2025): 48 layers, hidden 2048, 32 query heads / 4 KV heads of head_dim 128
(32 x 128 = 4096 != hidden: q/o project 2048 <-> 4096), RMSNorm on each head of q and k before RoPE, 128 experts
of FFN 768, top-8 renormalised (norm_topk_prob true), no shared expert, no biases; vocab 151936, untied.
30.5 B parameters, 3.3 B active (model card); ours: see tests/test_hf_families.py.

Source of every number: Qwen/Qwen3-30B-A3B's config.json on the Hugging Face Hub (architectures
Qwen3MoeForCausalLM, hidden_size 2048, num_hidden_layers 48, num_attention_heads 32, num_key_value_heads 4,
head_dim 128, num_experts 128, num_experts_per_tok 8, moe_intermediate_size 768, intermediate_size 6144,
norm_topk_prob true, attention_bias false, rms_norm_eps 1e-06, rope_theta 1000000.0, rope_scaling null,
vocab_size 151936, tie_word_embeddings false, max_position_embeddings 40960, use_sliding_window false,
decoder_sparse_step 1, mlp_only_layers [], router_aux_loss_coef 0.001, transformers_version 4.51.0).

    python -m megascale_jax.convert import --hf /path/to/Qwen3-30B-A3B --config configs/qwen3_30b_a3b.py --out ckpt
    python -m megascale_jax.train --config configs/qwen3_30b_a3b.py --config.checkpoint.dir=ckpt

runs the paper's plan (plan_recipe 'megascale': SP attention + EP experts over the node's GPUs; 32 heads, 4 KV
heads and 128 experts all fit n = 8); add --config.plan_recipe=megatron_tp for the TP baseline (TP needs
intra dividing the 4 KV heads).
"""
from configs import base


def get_config():
    c = base.get_config()
    c.name = "qwen3_30b_a3b"
    c.model.update(vocab_size=151936, num_layers=48, hidden=2048, num_heads=32, num_kv_heads=4, head_dim=128,
                   qk_norm=True, dense_ffn=6144, rope_theta=1e6, norm_eps=1e-6, max_seq_len=40960)
    c.model.moe.update(num_experts=128, top_k=8, expert_ffn=768, renormalize=True, aux_loss_weight=0.001)
    base.large_scale_training(c)
    return c
