"""Enumerate the plans a cluster admits, price each with the cost model, rank them, emit config overrides.

Dimensions: recipe (attention sp|tp x ffn ep|tp, and the XLA plan) x intra-node size x pipeline stages x
schedule x virtual stages x microbatches x EP dispatch x remat x ZeRO-1 x gradient precision. Plans that do
not fit in memory are kept aside with the reason.
"""
from __future__ import annotations

import dataclasses
import itertools

from megascale_jax.planner import cost
from megascale_jax.planner import workload as wl

MAX_MICROBATCH_SEQUENCES = 8
RECIPE_NAMES = {"megascale": "SP+EP", "megatron_tp": "TP+TP", "tp_ep": "TP+EP", "sp_tp": "SP+TP", "xla": "XLA"}


def _divisors(x: int) -> list[int]:
    return [d for d in range(1, x + 1) if x % d == 0]


def _remats(sh, pipe: int, virtual: int, partial: bool):
    """(remat, recompute_layers) choices: none / selective / full, and with `partial` every count of fully
    recomputed layers per chunk between none and all."""
    out = [("none", 0), ("selective", 0), ("full", 0)]
    if partial:
        out += [("partial", k) for k in range(1, sh.moe_layers // (pipe * virtual))]
    return out


def enumerate_plans(sh: wl.Shape, num_gpus: int, gpus_per_node: int, global_batch: int, recipes=None,
                    fixed: dict | None = None, partial_remat: bool = False):
    """Every valid Plan; `fixed` pins fields (e.g. {'pipe': 15, 'intra': 8})."""
    fixed = fixed or {}
    recipes = recipes or list(wl.RECIPES)
    intras = [n for n in (1, 2, 4, 8, 16) if n <= min(gpus_per_node, num_gpus) and gpus_per_node % n == 0]
    for recipe, n in itertools.product(recipes, intras):
        if n == 1 and recipe != "megascale" and "megascale" in recipes:
            continue   # at n = 1 every recipe is the same program
        for pipe in _divisors(sh.moe_layers):
            if num_gpus % (n * pipe):
                continue
            dp = num_gpus // (n * pipe)
            if global_batch % dp:
                continue
            per_replica = global_batch // dp
            scheds = [("1f1b", 1)] if pipe == 1 else (
                [("1f1b", 1), ("gpipe", 1)] + [("interleaved", v) for v in _divisors(sh.moe_layers // pipe)
                                               if 2 <= v <= 4])
            for (sched, v), m in itertools.product(scheds, _divisors(per_replica)):
                if per_replica // m > MAX_MICROBATCH_SEQUENCES:
                    continue
                dispatches = ["all_to_all", "all_gather"] if wl.RECIPES[recipe][1] == "ep" and n > 1 else ["all_to_all"]
                for disp, (remat, k) in itertools.product(dispatches, _remats(sh, pipe, v, partial_remat)):
                    for zero, gc in (("none", "fp32"), ("zero1", "fp32"), ("zero1", "bf16"), ("zero1", "fp8")):
                        if zero == "zero1" and dp == 1:
                            continue
                        plan = cost.Plan(recipe, n, pipe, sched, v, m, disp, remat, zero, gc, global_batch, k)
                        if any(getattr(plan, k) != val for k, val in fixed.items()):
                            continue
                        if not cost.validate(sh, plan, num_gpus, gpus_per_node):
                            yield plan


def rank(sh, cluster, system, global_batch: int, flops_per_token: float, recipes=None, fixed=None):
    """(fitting estimates, best first; excluded estimates with reasons)."""
    fits, excluded = [], []
    for plan in enumerate_plans(sh, cluster.num_gpus, cluster.gpus_per_node, global_batch, recipes, fixed,
                                system.partial_remat):
        est = cost.evaluate(sh, plan, cluster, system, flops_per_token)
        (fits if est.fits else excluded).append(est)
    fits.sort(key=lambda e: -e.tokens_per_s)
    excluded.sort(key=lambda e: -e.tokens_per_s)
    return fits, excluded


def best(sh, cluster, system, global_batch, flops_per_token, recipe, fixed=None):
    fits, excluded = rank(sh, cluster, system, global_batch, flops_per_token, [recipe], fixed)
    return fits[0] if fits else None


def overrides(plan: cost.Plan) -> list[str]:
    """The plan as `python -m megascale_jax.train` flags (keys of the post-refactor config)."""
    out = [f"--config.plan_recipe={plan.recipe}", f"--config.parallel.intra={plan.intra}",
           f"--config.parallel.pipe={plan.pipe}"]
    if plan.pipe > 1:
        out += [f"--config.parallel.pipeline_schedule={plan.schedule}",
                f"--config.parallel.virtual_stages={plan.virtual_stages}"]
    out += [f"--config.train.microbatches={plan.microbatches}"]
    if wl.RECIPES[plan.recipe][1] == "ep" and plan.intra > 1:
        out += [f"--config.parallel.ep_dispatch={plan.ep_dispatch}"]
    # this code has no partial recompute: a 'partial' plan (paper systems only) maps to its nearest, 'full'
    remat = "full" if plan.remat == "partial" else plan.remat
    out += [f"--config.train.remat={remat}", f"--config.parallel.optimizer_sharding={plan.optimizer_sharding}",
            f"--config.parallel.grad_comm={plan.grad_comm}", f"--config.train.global_batch={plan.global_batch}"]
    return out


def parse_overrides(flags: list[str]) -> dict:
    """'--config.a.b=v' flags -> {'a.b': typed v}."""
    out = {}
    for flag in flags:
        key, value = flag.removeprefix("--config.").split("=", 1)
        out[key] = int(value) if value.lstrip("-").isdigit() else value
    return out


def describe(est: cost.Estimate) -> dict:
    """JSON-ready summary of one estimate."""
    p = est.plan
    return {"recipe": p.recipe, "layout": RECIPE_NAMES[p.recipe], "plan": dataclasses.asdict(p),
            "system": est.system, "tokens_per_s": est.tokens_per_s, "mfu": est.mfu, "step_s": est.step_s,
            "breakdown_s": dict(est.breakdown), "memory_gb": dict(est.memory_gb), "fits": est.fits,
            "reason": est.reason, "notes": list(est.notes), "overrides": overrides(p)}
