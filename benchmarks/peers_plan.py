"""What bench_peers.py measures: the block's shapes (full and --tiny), the FLOPs every variant is charged (as
megascale_jax/model/accounting.py counts one layer), the variants and the worker each runs in, and the --list
plan. Standard library only: the orchestrator imports neither JAX nor torch."""
from __future__ import annotations

import dataclasses

PEAK_TFLOPS = 989.0          # H200 dense bf16 (no sparsity)

# how the maxtext_* variants are built and run (peers.json's notes carry it)
MAXTEXT_NOTE = (
    "MaxText 0.2.5's own Mixtral decoder layer (maxtext.models.mixtral.MixtralDecoderLayer, built by its pyconfig "
    "over base.yml with model_name=mixtral-8x7b on a 1-device mesh, bf16 weights and activations, no remat), "
    "attention cudnn_flash_jax (its cuDNN path through JAX's cuDNN SDPA; cudnn_flash_te needs transformer-engine, "
    "which the image lacks and MaxText pins as a CUDA 12 build), dropless MoE (sparse_matmul, no expert "
    "parallelism; MaxText's moe_has_overflow flag checked before timing). maxtext_block: megablox off, tokamax off,"
    " i.e. jax.lax.ragged_dot, the path of MaxText's configs/gpu/models/mixtral_8x7b.yml; maxtext_block_tokamax: "
    "use_tokamax_gmm (tokamax's Mosaic GPU ragged_dot), the dropless choice of its moe_configuration.md. Installed "
    "without MaxText's 'cuda12' extra from .whl/maxtext (benchmarks/get_maxtext_wheels.sh) into a site directory of"
    " the MaxText worker's own; modules imported only for features the layer never runs (xprof, pathwaysutils, "
    "grain, PIL, MaxText's HF checkpoint loader) are empty stubs in that process "
    "(benchmarks/peers_maxtext_worker.py).")


# ------------------------------------------------------------------------------------------ shapes / FLOPs
@dataclasses.dataclass(frozen=True)
class Shapes:
    batch: int = 1
    seq: int = 8192
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    ffn: int = 14336
    experts: int = 8
    top_k: int = 2
    rope_theta: float = 1e6
    norm_eps: float = 1e-5

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


FULL = Shapes()
TINY = Shapes(batch=1, seq=128, hidden=128, heads=4, kv_heads=2, head_dim=32, ffn=256, experts=8, top_k=2)


def layer_flops_fwd(s: Shapes) -> dict:
    """Forward FLOPs of one block, by part, as megascale_jax/model/accounting.py counts them."""
    t = s.tokens
    proj = 2 * t * s.hidden * (2 * s.heads * s.head_dim + 2 * s.kv_heads * s.head_dim)   # q, k, v, o
    attn_core = t * 2 * s.seq * s.heads * s.head_dim          # QK^T + PV, 2*S*K each per head, halved (causal)
    experts = 2 * t * s.top_k * 3 * s.hidden * s.ffn          # gate, up, down of the top-k experts
    router = 2 * t * s.hidden * s.experts
    return {"projections": proj, "attention_core": attn_core, "experts": experts, "router": router,
            "total": proj + attn_core + experts + router}


def train_flops(s: Shapes, layers: int = 1) -> float:
    return 3.0 * layers * layer_flops_fwd(s)["total"]


def rate(flops: float, ms: float | None) -> dict:
    if not ms:
        return {"tflops": None, "mfu": None}
    tf = flops / (ms * 1e-3) / 1e12
    return {"tflops": tf, "mfu": tf / PEAK_TFLOPS}


# ------------------------------------------------------------------------------------------ the plan
# (name, worker, description, layers)
VARIANTS = [
    ("jax_dense_gemm", "jax-core", "JAX dense bf16 GEMM 8192^3, the same-run GEMM rate", 0),
    ("ours_block", "jax-core", "this project's Block (cuDNN attention + Pallas Mosaic GPU grouped GEMM, "
                               "dropless, kernels.swiglu='auto', the default: separate_pallas_bwd on a GPU), "
                               "fwd+bwd", 1),
    ("ours_block_separate_swiglu", "jax-core", "ours_block with kernels.swiglu='separate' (two grouped GEMM "
                                               "calls, then silu(gate) * up), fwd+bwd", 1),
    ("ours_block_fused_swiglu", "jax-core", "ours_block with kernels.swiglu='fused' (both first expert GEMMs "
                                            "and SwiGLU in one kernel), fwd+bwd", 1),
    ("ours_block_kernel_bwd_swiglu", "jax-core", "ours_block with kernels.swiglu='separate_pallas_bwd' (the "
                                                 "activation's backward as one Pallas pass), fwd+bwd", 1),
    ("stock_bound", "jax-core", "stock JAX block, experts as evenly split dense batched GEMMs (same FLOPs): "
                                "the dense-equivalent bound", 1),
    ("torch_dense_gemm", "torch", "torch dense bf16 GEMM 8192^3", 0),
    ("torchtitan_block", "torch", "torchtitan qwen3 TransformerBlock (its MoE: GroupedExperts on "
                                  "torch._grouped_mm, its SDPA wrapper, cuDNN first), torchtitan apply_compile "
                                  "(torch.compile inductor), bf16 params, fwd+bwd", 1),
    ("torchtitan_2layer", "torch", "two torchtitan blocks, fwd+bwd", 2),
    ("ours_2layer", "jax-extra", "two of this project's Blocks unrolled, fwd+bwd", 2),
    ("ours_block_grid_tiles", "jax-core", "ours_block with the grouped GEMM's row tiles on one grid over all "
                                           "rows (GroupedGemmTuning.row_tiles='grid', the default before "
                                           "'group'), fwd+bwd", 1),
    ("stock_capacity", "jax-extra", "stock JAX block, capacity-factor-1.0 one-hot einsum dispatch "
                                    "(MaxText-style, drops tokens)", 1),
    ("stock_ragged", "jax-extra", "stock JAX block, dropless jax.lax.ragged_dot", 1),
    ("maxtext_block", "maxtext", "MaxText's Mixtral decoder layer (cudnn_flash_jax attention, dropless "
                                 "sparse_matmul MoE on jax.lax.ragged_dot: its GPU Mixtral config), fwd+bwd", 1),
    ("maxtext_block_tokamax", "maxtext", "maxtext_block with use_tokamax_gmm (tokamax's Mosaic GPU ragged_dot, "
                                         "its docs' dropless choice), fwd+bwd", 1),
]
WORKER_ORDER = ("jax-core", "torch", "jax-extra", "maxtext")
# share of the budget left when a worker starts; the last worker with selected variants takes all that is left
WORKER_SHARE = {"jax-core": 0.35, "torch": 0.65, "jax-extra": 0.6, "maxtext": 1.0}
MAXTEXT_MOE = {"maxtext_block": "ragged_dot", "maxtext_block_tokamax": "tokamax"}   # the worker's `moe` argument


def plan_text(args, shapes: Shapes) -> str:
    f = layer_flops_fwd(shapes)
    lines = [f"shapes: {shapes.batch} x {shapes.seq} tokens (T={shapes.tokens}), hidden {shapes.hidden}, "
             f"{shapes.heads} q / {shapes.kv_heads} kv heads of {shapes.head_dim}, {shapes.experts} experts "
             f"of FFN {shapes.ffn}, top-{shapes.top_k}, bf16, causal",
             f"FLOPs per layer fwd: {f['total'] / 1e12:.3f} T (proj {f['projections'] / 1e12:.3f}, attention "
             f"core {f['attention_core'] / 1e12:.3f}, experts {f['experts'] / 1e12:.3f}, router "
             f"{f['router'] / 1e12:.4f}); fwd+bwd {train_flops(shapes) / 1e12:.3f} T",
             f"budget {args.budget_s:.0f} s; workers in order {', '.join(WORKER_ORDER)} (each a subprocess)"]
    for name, worker, desc, _ in VARIANTS:
        skip = "" if selected(args, name) else "  [not selected]"
        lines.append(f"  {name:18s} [{worker:9s}] {desc}{skip}")
    return "\n".join(lines)


def selected(args, name: str) -> bool:
    return not args.only or name in args.only.split(",")
