"""The MoE FFN: router.py (route), experts.py (pure grouped-GEMM experts), layer.py (the phases); the
dispatchers live in megascale_jax/parallel/layouts.py.

Shape legend used in names across the package:
  B batch, S sequence, D hidden (model dim), H query heads, G kv heads, K head dim (attention) or top-k (MoE),
  T tokens (B*S flattened), E experts, F expert FFN width, M rows of a dispatched (sorted) buffer,
  V vocabulary, n size of the intra-node domain.
So `idx_TK` is [tokens, top_k] expert indices and `w_EDF` an [experts, hidden, ffn] weight.
"""
