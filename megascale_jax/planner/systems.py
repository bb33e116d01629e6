"""Implementations the cost model can price: this code as measured, and the two systems of the paper.

A plan (layout, pipeline, remat, ...) says WHAT runs; a system says how well the implementation runs it:
padded dispatch buffers or exact ones, how much communication each overlap mechanism hides, whether the
pipeline recomputes a stage's forward in its backward, and the bytes per parameter it keeps.

Overlap is a stated fraction per mechanism, of the communication time, capped by the compute it can hide
behind:
  none      0
  xla_async this code: XLA's async collectives, measured per recipe on 2 x H200 (efficiency.xla_async_hidden)
  inter_op  the paper's hand-ordered macro layer: ASSUMED 0.5 (not measured; sensitivity printed)
  fused     the paper's tiled comm+GEMM kernels: ASSUMED 0.9 (not measured; the paper reports 1.2-4.7x per
            fused pair, i.e. the pair runs near max(comm, compute); sensitivity printed)
"""
from __future__ import annotations

import dataclasses

from megascale_jax.planner import efficiency
from megascale_jax.planner import workload as wl

INTER_OP = 0.5
FUSED = 0.9
OVERLAP_SOURCE = {"inter_op": "assumption (the paper gives no hidden fraction for its inter-operator overlap)",
                  "fused": "assumption (paper: fused pairs 1.2-4.7x faster than sequential, Comet 1.96x per "
                           "MoE layer -- consistent with most of the communication hidden)"}


@dataclasses.dataclass(frozen=True)
class System:
    name: str
    padded_dispatch: bool        # dropless EP buffers hold the worst case (n x average rows)
    tail_cost: float             # cost of a padded row relative to a computed one (fwd, dgrad)
    layer_hidden: dict           # recipe -> hidden fraction of the per-layer collectives
    dp_hidden: float             # hidden fraction of the data-parallel gradient sync
    p2p_hidden: float            # hidden fraction of the pipeline sends
    pipeline_recompute: bool     # the backward tick re-runs the stage forward (stash holds inputs only)
    param_bytes: float           # weights + gradients, bytes per parameter
    optimizer_bytes: float       # optimizer state (+ fp32 master copy), bytes per parameter (ZeRO-1 shards it)
    zero1_gather_bytes: int      # bytes per parameter all-gathered after a sharded update
    sar_formula: bool            # activation memory from the paper's SP+EP formulas
    grouped_gemm: str = "pallas"
    adamw_bytes: float = wl.ADAMW_BYTES_PER_PARAM   # the update pass's HBM bytes a parameter (read p, g, m, v;
    #                                                 write p, m, v)
    expert_load: float = 1.0     # busiest device's routed rows / the mean under EP (1 = balanced; the paper
    #                              drops tokens over a per-device capacity it does not state)
    attention_speed: float = 1.0     # attention-core rate relative to our measured cuDNN rate (sensitivity)
    elementwise_speed: float = 1.0   # elementwise HBM efficiency relative to our measured one (sensitivity)
    partial_remat: bool = False      # can fully recompute some layers of a chunk (Megatron-LM's
    #                                  --recompute-method block --recompute-num-layers; MegaScale-MoE is built on it)
    fa_gg_share: float = 0.0         # > 0: a layer takes at least (attention + grouped GEMM) / this (sensitivity:
    #                                  the paper's §7 profile, 'about one-third'); 0 = off
    selective: str = "ours"      # what remat='selective' recomputes: ours (router, elementwise, dense-FFN gate/up),
    #                              sar (elementwise only, the paper's SAR), core (attention core, Megatron)
    notes: str = ""


def ours(grouped_gemm: str = "pallas", tail: bool = True, moments_dtype: str = "float32") -> System:
    """This code (main at 0a0a90b) as measured: fp32 master weights and gradients, Adam moments fp32 (or
    `train.adam_moments_dtype`'s bfloat16: 2 bytes a moment, 8 fewer bytes a parameter in the update pass)."""
    moment = {"float32": 4.0, "bfloat16": 2.0}[moments_dtype]   # config_checks.DType's values
    return System("ours", padded_dispatch=True, tail_cost=efficiency.ep_tail_cost() if tail else 0.0,
                  layer_hidden=efficiency.xla_async_hidden(), dp_hidden=0.0, p2p_hidden=0.0,
                  pipeline_recompute=True, param_bytes=8.0, optimizer_bytes=2 * moment, zero1_gather_bytes=4,
                  adamw_bytes=wl.ADAMW_BYTES_PER_PARAM - 4 * (4.0 - moment),
                  sar_formula=False, grouped_gemm=grouped_gemm, selective="ours",
                  notes="padded dropless EP buffers" + ("" if tail else " (tail rows skipped)") + "; XLA async "
                        "overlap; lock-step pipeline ticks with stage recompute; gradient sync after the backward")


def megascale() -> System:
    """MegaScale-MoE as the paper describes it: exact-size dispatch, fused comm+GEMM kernels for the SP and
    EP collectives, inter-operator overlap for DP sync and pipeline sends, SAR activation memory, bf16
    weights with fp32 gradients and fp32 master + Adam states."""
    hidden = {r: FUSED for r in ("megascale", "tp_ep", "sp_tp")}
    hidden.update(megatron_tp=INTER_OP, xla=0.0)
    return System("megascale", padded_dispatch=False, tail_cost=0.0, layer_hidden=hidden, dp_hidden=INTER_OP,
                  p2p_hidden=INTER_OP, pipeline_recompute=False, param_bytes=6.0, optimizer_bytes=12.0,
                  zero1_gather_bytes=2, sar_formula=True, selective="sar", partial_remat=True,
                  notes="the paper's system (arXiv 2505.11432); overlap fractions are assumptions")


MEGATRON_DP_PP_SOURCE = ("paper §6.1: 'both systems in the evaluation enable the communication-computation overlap "
                         "techniques from MegaScale [19] for data and pipeline parallelism'")


def megatron() -> System:
    """The paper's Megatron-LM baseline: TP inside the node, no SP+EP, nothing inside a layer overlapped; the
    data- and pipeline-parallel overlap of MegaScale (NSDI '24) on, as for MegaScale-MoE (MEGATRON_DP_PP_SOURCE)."""
    return System("megatron", padded_dispatch=False, tail_cost=0.0,
                  layer_hidden={r: 0.0 for r in efficiency.PLAN_NAMES.values()}, dp_hidden=INTER_OP,
                  p2p_hidden=INTER_OP, pipeline_recompute=False, param_bytes=6.0, optimizer_bytes=12.0,
                  zero1_gather_bytes=2, sar_formula=False, selective="core", partial_remat=True,
                  notes="TP attention + TP experts, no overlap inside the layer; MegaScale's DP/PP overlap")


def baseline_for(sys: System) -> System:
    """The Megatron-style baseline priced like `sys`: the paper's Megatron for the paper's systems, this code
    with every overlap switched off for `ours` (its DP sync and pipeline sends are never overlapped anyway)."""
    if sys.name in ("megascale", "megatron"):
        return megatron()
    return dataclasses.replace(sys, name=sys.name + "-no-overlap", dp_hidden=0.0, p2p_hidden=0.0,
                               layer_hidden={r: 0.0 for r in sys.layer_hidden},
                               notes=sys.notes + "; no overlap")


def with_overlap(sys: System, fused: float, inter_op: float) -> System:
    """The paper system with other overlap fractions (for the sensitivity table)."""
    hidden = {r: (fused if v == FUSED else inter_op if v == INTER_OP else v) for r, v in sys.layer_hidden.items()}
    return dataclasses.replace(sys, layer_hidden=hidden,
                               dp_hidden=inter_op if sys.dp_hidden else 0.0,
                               p2p_hidden=inter_op if sys.p2p_hidden else 0.0)
