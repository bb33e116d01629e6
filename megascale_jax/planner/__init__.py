"""Cost model and planner: choose the parallel plan for a cluster and predict what it delivers.

    python -m megascale_jax.planner --config configs/internal_352b.py --gpus 1440 --gpu h800 --global-batch 720

Modules: hardware (GPU table + clusters, every number with its source), efficiency (kernel rates and
overheads read from benchmarks/results/*.json), workload (per-layer FLOPs, bytes, collectives, activations),
systems (this code as measured; the paper's MegaScale-MoE and Megatron-LM), cost (step time and memory of a
plan), search (enumeration, ranking, config overrides), paper (the paper's tables), diagnose (each factor of
the paper comparison checked, the sensitivity, what stays unexplained), measured (our own runs, derivation vs
held-out rows), report (printed and JSON output).
"""
from megascale_jax.planner.cost import Estimate, Plan, evaluate
from megascale_jax.planner.hardware import GPUS, Cluster, make_cluster
from megascale_jax.planner.search import enumerate_plans, overrides, rank

__all__ = ["Estimate", "Plan", "evaluate", "GPUS", "Cluster", "make_cluster", "enumerate_plans", "overrides", "rank"]
