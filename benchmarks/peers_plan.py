"""What bench_peers.py measures: the block's shapes (full and --tiny), the FLOPs every variant is charged (as
megascale_jax/model/accounting.py counts one layer), the variants and the worker each runs in, and the --list
plan. Standard library only: the orchestrator imports neither JAX nor torch."""
from __future__ import annotations

import dataclasses

PEAK_TFLOPS = 989.0          # H200 dense bf16 (no sparsity)

# why VARIANTS' maxtext_block is recorded as skipped rather than measured (peers.json and the notes carry it)
MAXTEXT_NOTE = (
    "MaxText not run (skipped, not measured). Found: the package index's maxtext 0.2.5 is a 13.6 MB "
    "pure-Python wheel with no base requirements; all 262 runtime pins sit under its 'cuda12' extra, which "
    "asks for jax>=0.11.1 (the image's 0.11.2 would do) but also for the CUDA 12 jax plugin "
    "(jax-cuda12-pjrt/-plugin; the image has the CUDA 13 one) and transformer-engine-cu12 / -jax (compiled, "
    "CUDA 12). Carried with --no-deps instead, the import closure of maxtext.layers.moe (read statically from "
    "the wheel) needs these packages that the GPU image lacks: aqtp, qwix, tokamax (itself needing pydantic, "
    "einshape, immutabledict, tensorboardx and an xprof stub), pydantic + pydantic-core (compiled), omegaconf "
    "(+ antlr4 runtime), grain (compiled), drjax, pathwaysutils, tensorboardX, librosa; and the layer is built "
    "from MaxText's full pydantic config (pyconfig over its base.yml) and a mesh. That chain was not "
    "assembled and verified on a CPU machine within this benchmark's preparation, and the one GPU call "
    "leaves no room to debug it there, so it is recorded here as not run rather than approximated. The "
    "stock-JAX 'stock_capacity' variant is the MaxText-style dispatch (capacity factor 1.0, one-hot einsums, "
    "drops tokens) that the published MaxText Mixtral number uses.")


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
    ("maxtext_block", "none", "MaxText MoE layer", 1),
]
WORKER_ORDER = ("jax-core", "torch", "jax-extra")
WORKER_SHARE = {"jax-core": 0.35, "torch": 0.65, "jax-extra": 1.0}   # share of the budget left when it starts


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
