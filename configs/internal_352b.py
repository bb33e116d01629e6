"""The paper's Internal-352B MoE (MegaScale-MoE, arXiv 2505.11432, Table 2): 60 layers, hidden 4096, 32 heads,
GQA ratio m = 4 (8 KV heads), 32 routed experts of FFN 14336, top-3, sequence 8192, vocab 65536 -- plus ONE
SHARED EXPERT of FFN 14336, which Table 2 does not list but the paper's own totals require:
  * parameters: Table 2's shape alone counts 341.3 B; with one shared expert 351.9 B -- the "352B" of the
    title, abstract and Table 3 (a 33rd routed expert would also give 352 B, but not the FLOPs below);
  * FLOPs: §6.1 gives MegaScale-MoE's MFU as 32.48% (240 GPUs) and 27.89% (1,440 GPUs) on 989 TFLOPS (Table 4)
    at 272.9k and 1407.7k tokens/s (Table 3), i.e. 282.5 and 282.2 GFLOP per token; our count (causal
    attention, 3 x forward, megascale_jax/model/accounting.py) gives 219.1 GFLOP for Table 2's shape and
    282.5 GFLOP with the shared expert (Megatron-LM's formula, non-causal attention: 231.1 / 294.5);
  * Table 2 lists routed experts only: it gives Hunyuan-Large as "16 experts, top-1" and DeepSeekMoE as
    "64 experts, top-6", both of which also have shared experts (1 and 2; configs/hunyuan_large.py,
    configs/deepseekmoe_16b.py).
--config.model.moe.num_shared_experts=0 gives Table 2's literal shape (the planner's sensitivity shows both).

    python -m megascale_jax.train --config configs/internal_352b.py --config.parallel.pipe=12

runs the paper's plan (plan_recipe 'megascale': SP attention + EP experts over the node's GPUs);
add --config.plan_recipe=megatron_tp for the TP baseline (configs/plans.py lists the recipes).
"""
from configs import base


def get_config():
    c = base.get_config()
    c.name = "internal_352b"
    c.model.update(vocab_size=65536, num_layers=60, hidden=4096, num_heads=32, num_kv_heads=8,
                   dense_ffn=14336, rope_theta=1e6, max_seq_len=8192)
    c.model.moe.update(num_experts=32, top_k=3, expert_ffn=14336, num_shared_experts=1, shared_expert_ffn=14336)
    base.large_scale_training(c, global_batch=512, seq_len=8192)
    return c
