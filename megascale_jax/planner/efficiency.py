"""Measured efficiencies, read from the committed JSON under benchmarks/results/ (H200, 2026-11-30).

Kernel rates (TFLOP/s on one H200) become fractions of the H200's dense BF16 peak and are applied to any
GPU's peak. Interpolation rule (GEMMs): the rate is piecewise linear in log(work per group) = log(M/G * K * N)
between the measured shapes (duplicates averaged), and clamped at the smallest / largest measured work.

Quantities the microbenchmarks do not give are derived from the profiled 2-GPU plan runs
(plans_2xh200.json, `profile`: GPU ms by kernel category, per step), each with a one-line derivation:
  attention rate      modeled attention-core FLOPs / 'attention' ms                  (median of 10 runs)
  elementwise eff.    modeled elementwise HBM bytes / ('other' ms x HBM bandwidth)   (median of 10 runs)
  EP tail cost        grouped-GEMM kernel ms, Mixtral SP+EP vs TP+TP (equal FLOPs)   (one pair; DeepSeek checks)
  NVLink achieved     comm ms ~ calls x latency + wire bytes / bandwidth             (least squares, 8 runs)
  XLA-async overlap   1 - exposed comm ms / comm ms, per recipe                     (median of 2 configs)
  host gap per step   step time - GPU busy time                                      (median of 10 runs)
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import statistics

import numpy as np

from megascale_jax.planner import workload as wl

RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results")
H200_PEAK_TFLOPS = 989.4
H200_HBM = 4.8e12
PLAN_NAMES = {"sp+ep": "megascale", "tp+tp": "megatron_tp", "tp+ep": "tp_ep", "sp+tp": "sp_tp", "xla": "xla"}
GROUPED_KEYS = {"pallas": "ours/fwd+bwd", "xla": "xla_ragged_dot/fwd+bwd"}


def _load(name: str) -> dict:
    with open(os.path.join(RESULTS, name)) as fh:
        return json.load(fh)


def _curve(points):
    """Sorted (log work, rate) with duplicate works averaged."""
    by = {}
    for work, rate in points:
        by.setdefault(round(math.log(work), 6), []).append(rate)
    return sorted((w, sum(r) / len(r)) for w, r in by.items())


def _interp(curve, work: float) -> tuple[float, bool]:
    x = math.log(max(work, 1.0))
    if x <= curve[0][0]:
        return curve[0][1], x < curve[0][0] - 1e-9
    if x >= curve[-1][0]:
        return curve[-1][1], x > curve[-1][0] + 1e-9
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0), False
    raise AssertionError("unreachable")


@functools.lru_cache(maxsize=None)
def _grouped_curve(impl: str):
    key = GROUPED_KEYS[impl]
    pts = [(r["M"] / r["G"] * r["K"] * r["N"], r["tflops"][key])
           for r in _load("grouped_gemm_h200.json")["results"] if r["routing"] == "uniform" and key in r["tflops"]]
    if impl == "pallas":   # G = 1 shapes: the model runs the grouped kernel at one expert per device
        pts += [(r["M"] * r["K"] * r["N"], r["tflops"]["ours_grouped_kernel/fwd+bwd"])
                for r in _load("grouped_gemm_single_group_h200.json")["results"]]
    return _curve(pts)


@functools.lru_cache(maxsize=None)
def _dense_curve():
    pts = [(r["M"] * r["K"] * r["N"], r["tflops"]["dense_same_flops/fwd+bwd"])
           for r in _load("grouped_gemm_h200.json")["results"]]
    pts += [(r["M"] * r["K"] * r["N"], r["tflops"]["dense_same_flops/fwd+bwd"])
            for r in _load("grouped_gemm_single_group_h200.json")["results"]]
    return _curve(pts)


@functools.lru_cache(maxsize=None)
def ragged_dot_expansion() -> float:
    """XLA's lax.ragged_dot on GPU runs a dense masked GEMM over all G groups: time = G x the dense GEMM of
    the whole [M, K] x [K, N]. Measured factor rate * G / dense rate (median over the measured shapes)."""
    rows = [r for r in _load("grouped_gemm_h200.json")["results"] if r["routing"] == "uniform" and r["G"] > 1]
    return statistics.median(r["tflops"]["xla_ragged_dot/fwd+bwd"] * r["G"] / r["tflops"]["dense_same_flops/fwd+bwd"]
                             for r in rows)


def grouped_gemm_efficiency(rows_per_group: float, k: int, n: int, impl: str = "pallas", groups: int = 1) -> float:
    """Fraction of dense BF16 peak a grouped GEMM (fwd+bwd) reaches at this per-group shape.

    pallas: interpolated in log(work per group) over our kernel's measured shapes. xla (lax.ragged_dot): the
    dense rate of the whole GEMM / G x the measured expansion factor (XLA computes every group densely)."""
    if impl == "xla" and groups > 1:
        return dense_gemm_efficiency(rows_per_group * groups, k, n) / groups * ragged_dot_expansion()
    return _interp(_grouped_curve("pallas"), rows_per_group * k * n)[0] / H200_PEAK_TFLOPS


def below_measured_range(g) -> bool:
    """Whether GEMM `g` (workload.Gemm) is smaller than every measured shape (its rate is then clamped)."""
    work = g.rows_per_group * g.k * g.n
    curve = _grouped_curve("pallas") if g.grouped else _dense_curve()
    return math.log(max(work, 1.0)) < curve[0][0] - 1e-9


def dense_gemm_efficiency(m: float, k: int, n: int) -> float:
    return _interp(_dense_curve(), m * k * n)[0] / H200_PEAK_TFLOPS


# ---------------------------------------------------------------------------------------------------------
# Quantities derived from the profiled plan runs
# ---------------------------------------------------------------------------------------------------------

def fwd_count(remat: str, tags: tuple) -> int:
    """Forward evaluations of an op whose recompute tags are `tags` under `remat` (1 + recompute)."""
    return 1 + (remat in tags)


def step_quantities(cfg, recipe: str, n: int, T: int, remat: str, padded: bool = True, impl: str = "pallas",
                    seq_len: int | None = None):
    """One microbatch step of T tokens on an intra group of n devices, per device, no pipeline:
    expert-GEMM seconds on an H200 at tail cost 0 and the tail's seconds per unit cost, other GEMM seconds,
    attention FLOPs, elementwise bytes (incl. optimizer and loss), wire bytes by kind."""
    sh = wl.Shape.from_config(cfg, seq_len)
    q = {"expert_s": 0.0, "tail_s": 0.0, "gemm_s": 0.0, "attn_flops": 0.0, "ew_bytes": 0.0, "wire": {},
         "calls": 1}   # + one (combined) all-reduce of the replicated parameters' gradients
    peak = H200_PEAK_TFLOPS * 1e12
    for dense, count in ((True, sh.dense_layers), (False, sh.moe_layers)):
        if not count:
            continue
        lw = wl.layer_work(sh, recipe, T, n, dense=dense, padded=padded)
        for g in lw.gemms:
            passes = fwd_count(remat, g.remat) + 2
            if g.grouped:
                rate = grouped_gemm_efficiency(g.rows_per_group, g.k, g.n, impl, g.groups) * peak
                q["expert_s"] += count * g.flops * passes / rate
                q["tail_s"] += count * g.flops * g.tail_rows_frac * (passes - 1) / rate
            else:
                q["gemm_s"] += count * g.flops * passes / (dense_gemm_efficiency(g.rows_per_group, g.k, g.n) * peak)
        q["attn_flops"] += count * lw.attn_flops * (fwd_count(remat, ("full",)) + 2)
        q["ew_bytes"] += count * (lw.ew_fwd * fwd_count(remat, ("full", "selective")) + lw.ew_bwd)
        for c in lw.comms:
            q["wire"][c.kind] = q["wire"].get(c.kind, 0.0) + count * c.bytes * (fwd_count(remat, c.remat) + 1)
            q["calls"] += count * c.calls * (fwd_count(remat, c.remat) + 1)
    head_tok = T if recipe == "xla" else T / n
    q["gemm_s"] += 3 * 2 * head_tok * sh.h * sh.vocab / (dense_gemm_efficiency(head_tok, sh.h, sh.vocab) * peak)
    q["ew_bytes"] += head_tok * sh.vocab * wl.LOSS_BYTES_PER_LOGIT
    p = wl.params_per_device(sh, recipe, n)
    local = sh.moe_layers * p["moe_layer"] + sh.dense_layers * p["dense_layer"] + p["embed_head"]
    rep = (sh.moe_layers * p["replicated_moe_layer"] + sh.dense_layers * p["replicated_dense_layer"]
           + p["replicated_embed_head"])
    q["ew_bytes"] += local * wl.OPTIMIZER_BYTES_PER_PARAM
    q["wire"]["ar"] = q["wire"].get("ar", 0.0) + 2 * (n - 1) / n * 4 * rep
    q["params_local"] = local
    return q


# Configs whose profiled runs the derived quantities may not use (leave-one-config-out checks): see derived_without.
_EXCLUDED: frozenset = frozenset()
DERIVATION_FILE = "plans_2xh200.json"


def derivation_labels() -> list[str]:
    """measured.py labels of the runs the derived quantities below are read from (with the current exclusions)."""
    return [f"{DERIVATION_FILE}:{run['config']}:{run['row']['plan']}" for run in profile_runs()]


@contextlib.contextmanager
def derived_without(*configs: str):
    """Derive every profile-based quantity without the profiled runs of `configs` (caches are rebuilt inside
    and again on exit), so a run of those configs can be predicted by parameters it did not produce."""
    global _EXCLUDED
    old = _EXCLUDED
    _EXCLUDED = frozenset(configs)
    _clear_caches()
    try:
        yield
    finally:
        _EXCLUDED = old
        _clear_caches()


def _clear_caches() -> None:
    for fn in (profile_runs, attention_efficiency, elementwise_efficiency, ep_tail_cost, link_fit, xla_async_hidden,
               host_gap_s):
        fn.cache_clear()


@functools.lru_cache(maxsize=None)
def profile_runs() -> tuple:
    """The profiled 2-GPU plan runs with their modeled quantities (less the configs in _EXCLUDED)."""
    from megascale_jax.config import default_config
    data = _load(DERIVATION_FILE)
    runs = []
    for r in data["results"]:
        if "profile" not in r or r["config"] in _EXCLUDED:
            continue
        cfg = default_config(r["config"])
        recipe = PLAN_NAMES[r["plan"]]
        n = r["overrides"]["parallel.intra"]
        q = step_quantities(cfg, recipe, n, r["global_batch"] * r["seq_len"], "full",   # both configs: remat full
                            seq_len=r["seq_len"])
        runs.append({"config": r["config"], "recipe": recipe, "row": r, "q": q, "n": n})
    return tuple(runs)


@functools.lru_cache(maxsize=None)
def attention_efficiency() -> float:
    rates = [run["q"]["attn_flops"] / (run["row"]["profile"]["kernel_ms_by_category"]["attention"] * 1e-3)
             for run in profile_runs()]
    return statistics.median(rates) / (H200_PEAK_TFLOPS * 1e12)


@functools.lru_cache(maxsize=None)
def elementwise_efficiency() -> float:
    eff = [run["q"]["ew_bytes"] / (run["row"]["profile"]["kernel_ms_by_category"]["other"] * 1e-3 * H200_HBM)
           for run in profile_runs()]
    return statistics.median(eff)


def _mosaic_ms(row) -> float:
    return sum(k["ms"] for k in row["profile"]["top_kernels"] if k["name"] == "anonymous_mosaic_gpu_kernel")


def tail_cost_implied(config: str) -> float:
    """EP tail cost tau solving t_EP / t_TP = (expert_s_EP + tau * tail_s_EP) / expert_s_TP for one config."""
    runs = {run["recipe"]: run for run in profile_runs() if run["config"] == config}
    ep, tp = runs["megascale"], runs["megatron_tp"]
    ratio = _mosaic_ms(ep["row"]) / _mosaic_ms(tp["row"])
    return (ratio * tp["q"]["expert_s"] - ep["q"]["expert_s"]) / ep["q"]["tail_s"]


@functools.lru_cache(maxsize=None)
def ep_tail_cost() -> float:
    """Cost of one padded row of the dropless EP buffer (fwd, dgrad) relative to a computed row, this code's
    grouped GEMM with zero_tail='kernel' (tail tiles stream their K loop of loads and skip the MMA). Read off
    the mixtral_small SP+EP / TP+TP pair (DeepSeek's pair implies 0.36, listed by --explain); the
    deepseekmoe_small pair when mixtral_small's runs are excluded."""
    configs = {run["config"] for run in profile_runs()}
    return tail_cost_implied("mixtral_small" if "mixtral_small" in configs else sorted(configs)[0])


@functools.lru_cache(maxsize=None)
def link_fit() -> tuple[float, float]:
    """(latency s per collective call, bytes/s) on 2 x H200 NVLink: least squares of the profiled NCCL
    kernel ms over the manual plans against (calls per step, modeled wire bytes per step)."""
    rows, ys = [], []
    for run in profile_runs():
        if run["recipe"] == "xla":
            continue
        rows.append([run["q"]["calls"], sum(run["q"]["wire"].values())])
        ys.append(run["row"]["profile"]["comm_ms"] * 1e-3)
    (alpha, inv_beta), *_ = np.linalg.lstsq(np.asarray(rows), np.asarray(ys), rcond=None)
    return float(alpha), float(1 / inv_beta)


def nvlink_achieved_h200() -> float:
    """GB/s one H200 sends over NVLink per direction in the profiled collectives (link_fit)."""
    return link_fit()[1] / 1e9


@functools.lru_cache(maxsize=None)
def xla_async_hidden() -> dict:
    """Fraction of communication time hidden behind compute by XLA's async collectives, per recipe."""
    out = {}
    for recipe in PLAN_NAMES.values():
        vals = [1 - run["row"]["profile"]["exposed_comm_ms"] / run["row"]["profile"]["comm_ms"]
                for run in profile_runs() if run["recipe"] == recipe]
        out[recipe] = statistics.median(vals)
    return out


@functools.lru_cache(maxsize=None)
def host_gap_s() -> float:
    gaps = [run["row"]["step_time_s_median"] - run["row"]["profile"]["busy_ms"] * 1e-3 for run in profile_runs()]
    return statistics.median(gaps)


def efficiency_sources() -> list[tuple[str, str, str]]:
    """(parameter, value, source) rows for --explain."""
    g = _grouped_curve("pallas")
    d = _dense_curve()
    rows = [
        ("grouped GEMM (ours, fwd+bwd)", f"{g[0][1]:.0f}..{g[-1][1]:.0f} TFLOP/s over {len(g)} shapes",
         "grouped_gemm_h200.json 'ours/fwd+bwd' uniform + grouped_gemm_single_group_h200.json; log-work interp"),
        ("grouped GEMM (xla ragged_dot)", f"dense rate / G x {ragged_dot_expansion():.2f}",
         "grouped_gemm_h200.json 'xla_ragged_dot/fwd+bwd' x G / 'dense_same_flops/fwd+bwd', median"),
        ("dense GEMM (fwd+bwd)", f"{d[0][1]:.0f}..{d[-1][1]:.0f} TFLOP/s over {len(d)} shapes",
         "grouped_gemm_h200.json 'dense_same_flops/fwd+bwd'; log-work interp"),
        ("attention (cuDNN, fwd+bwd)", f"{attention_efficiency() * H200_PEAK_TFLOPS:.0f} TFLOP/s",
         "plans_2xh200.json profiles: modeled core FLOPs / 'attention' ms, median of 10"),
        ("elementwise HBM efficiency", f"{elementwise_efficiency():.2f} of HBM peak",
         "plans_2xh200.json profiles: modeled bytes / ('other' ms x 4.8 TB/s), median of 10"),
        ("EP tail cost (zero_tail=kernel)", f"{ep_tail_cost():.2f} of a computed row (DeepSeek pair implies "
         f"{tail_cost_implied('deepseekmoe_small'):.2f})", "plans_2xh200.json mosaic kernel ms, SP+EP vs TP+TP"),
        ("NVLink achieved (H200)", f"{nvlink_achieved_h200():.0f} GB/s per direction, "
         f"{link_fit()[0] * 1e6:.0f} us per call", "plans_2xh200.json profiles: least squares of comm ms on "
         "(collective calls, modeled wire bytes) per step, 8 manual-plan runs"),
        ("XLA async overlap (this code)", ", ".join(f"{k} {v:.2f}" for k, v in xla_async_hidden().items()),
         "plans_2xh200.json profiles: 1 - exposed_comm_ms / comm_ms"),
        ("host gap per step", f"{host_gap_s() * 1e3:.1f} ms", "plans_2xh200.json: step time - GPU busy, median"),
        ("optimizer bytes / param", str(wl.OPTIMIZER_BYTES_PER_PARAM), "count: cast 6, wgrad cast 6, grad add 12, "
         "clip 4, AdamW 28 (fp32 master weights)"),
    ]
    return rows
