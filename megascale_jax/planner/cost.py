"""Cost of one training step of a plan on a cluster: compute, exposed communication, pipeline bubble,
data-parallel sync, optimizer, and memory per device (plans that do not fit are excluded with the reason).

Per layer and component (workload.py): compute time = FLOPs / (peak x measured efficiency for that kernel and
shape); elementwise time = bytes / (HBM bandwidth x measured elementwise efficiency); communication time =
wire bytes / achieved link bandwidth + latency, of which the system's overlap fraction is hidden (never
more than the compute it overlaps). Backward = 2x forward FLOPs; remat adds the recomputed forward (full:
everything, selective: what the system does not save); the pipeline's tick tables come from
`parallel.pipeline_schedules.build_schedule` and the step is the sum over ticks of the busiest stage.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from megascale_jax.model.accounting import model_size
from megascale_jax.parallel import grad_comm
from megascale_jax.parallel.pipeline_schedules import build_schedule
from megascale_jax.planner import efficiency as eff
from megascale_jax.planner import workload as wl

GB = 1e9
# parallel/pipeline.py (_StageProgram.tick): EVERY tick, whether or not it has a backward, adds a chunk
# gradient into the fp32 accumulators of the chunk, of `first` (embedding) and of `last` (head); a skipped
# branch returns materialised fp32 zeros. Per parameter: write the zeros or gradient 4, read accumulator 4,
# read gradient 4, write accumulator 4.
PIPELINE_TICK_BYTES = 16


@dataclasses.dataclass(frozen=True)
class Plan:
    recipe: str = "megascale"
    intra: int = 1
    pipe: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    microbatches: int = 1
    ep_dispatch: str = "all_to_all"
    remat: str = "none"
    optimizer_sharding: str = "none"
    grad_comm: str = "fp32"
    global_batch: int = 8
    recompute_layers: int = 0     # remat='partial': this many layers of each chunk fully recomputed, the rest
    #                               'selective' (Megatron-LM's --recompute-num-layers); systems.partial_remat

    def data(self, num_gpus: int) -> int:
        return num_gpus // (self.intra * self.pipe)

    def microbatch_size(self, num_gpus: int) -> int:
        return self.global_batch // (self.data(num_gpus) * self.microbatches)


@dataclasses.dataclass
class Estimate:
    plan: Plan
    system: str
    tokens_per_s: float
    mfu: float
    step_s: float
    breakdown: dict          # seconds: compute, exposed_comm, bubble, dp_sync, optimizer, host
    memory_gb: dict          # weights, activations, logits, total, usable
    fits: bool
    reason: str = ""
    notes: tuple = ()        # e.g. GEMMs below the measured shapes (rate clamped: optimistic)


@functools.lru_cache(maxsize=4096)
def _tables(schedule: str, stages: int, microbatches: int, virtual: int):
    s = build_schedule(schedule, stages, microbatches, virtual)
    return s.tables["f_on"].astype(float), s.tables["b_on"].astype(float), s.stash_slots, s.grad_slots


def layer_parts(lw, plan, sys, cluster, stage_recompute: bool = False) -> dict:
    """Seconds for one layer, one microbatch, by category -> (forward, backward incl. recompute): grouped GEMM,
    dense GEMM, attention core, elementwise, communication (before any overlap)."""
    peak = cluster.gpu.peak_bf16_tflops * 1e12
    rc = 1.0 if stage_recompute else 0.0
    parts = {"grouped_gemm": [0.0, 0.0], "dense_gemm": [0.0, 0.0]}
    for g in lw.gemms:
        if g.grouped:
            rate = eff.grouped_gemm_efficiency(g.rows_per_group, g.k, g.n, sys.grouped_gemm, g.groups) * peak
        else:
            rate = eff.dense_gemm_efficiency(g.rows_per_group, g.k, g.n) * peak
        t = g.flops / rate * (sys.expert_load if g.grouped and wl.RECIPES[plan.recipe][1] == "ep" else 1.0)
        tail = g.tail_rows_frac * sys.tail_cost if (g.grouped and sys.padded_dispatch) else 0.0
        fwd = t * (1 + tail)
        tags = g.remat if sys.selective == "ours" else tuple(x for x in g.remat if x != "selective")
        part = parts["grouped_gemm" if g.grouped else "dense_gemm"]
        part[0] += fwd
        part[1] += 2 * t + t * tail + (eff.fwd_count(plan.remat, tags) - 1 + rc) * fwd
    ta = lw.attn_flops / (eff.attention_efficiency() * sys.attention_speed * peak)
    parts["attention"] = [ta, 2 * ta + (eff.fwd_count(plan.remat, ("full", "selective") if sys.selective == "core"
                                                      else ("full",)) - 1 + rc) * ta]
    hbm = cluster.hbm_bw() * eff.elementwise_efficiency() * sys.elementwise_speed
    parts["elementwise"] = [lw.ew_fwd / hbm,
                            lw.ew_bwd / hbm + (eff.fwd_count(plan.remat, ("full", "selective")) - 1 + rc) * lw.ew_fwd / hbm]
    bw, lat = cluster.bandwidth(plan.intra, 1)
    cf = cb = 0.0
    for c in lw.comms:
        t = c.bytes / bw + lat * c.calls
        cf += t
        cb += t * (1 + eff.fwd_count(plan.remat, c.remat) - 1 + rc)
    parts["comm"] = [cf, cb]
    return {k: tuple(v) for k, v in parts.items()}


def _layer_times(lw, plan, sys, cluster, stage_recompute: bool):
    """(F compute, F exposed comm, B compute, B exposed comm) seconds for one layer, one microbatch."""
    parts = layer_parts(lw, plan, sys, cluster, stage_recompute)
    fc = sum(v[0] for k, v in parts.items() if k != "comm")
    bc = sum(v[1] for k, v in parts.items() if k != "comm")
    cf, cb = parts["comm"]
    hidden = sys.layer_hidden.get(plan.recipe, 0.0)
    fx = max(cf * (1 - hidden), cf - fc)
    bx = max(cb * (1 - hidden), cb - bc)
    if sys.fa_gg_share:   # a layer at least (attention + grouped GEMM) / share long; the rest as other ops, 1:2
        core = sum(parts["attention"]) + sum(parts["grouped_gemm"])
        extra = max(core / sys.fa_gg_share - (fc + fx + bc + bx), 0.0)
        fc, bc = fc + extra / 3, bc + 2 * extra / 3
    return fc, fx, bc, bx


def _stage_costs(sh, plan, sys, cluster, T):
    """Per-stage (F, B) seconds of one chunk-microbatch and the compute / exposed-comm parts."""
    n, S, V = plan.intra, plan.pipe, plan.virtual_stages
    rc = S > 1 and sys.pipeline_recompute
    lw = wl.layer_work(sh, plan.recipe, T, n, dispatch=plan.ep_dispatch, padded=sys.padded_dispatch)
    per_chunk = sh.moe_layers // (S * V)
    if plan.remat == "partial":
        k = plan.recompute_layers
        full = _layer_times(lw, dataclasses.replace(plan, remat="full"), sys, cluster, rc)
        rest = _layer_times(lw, dataclasses.replace(plan, remat="selective"), sys, cluster, rc)
        moe = [(k * a + (per_chunk - k) * b) / per_chunk for a, b in zip(full, rest)]
    else:
        moe = _layer_times(lw, plan, sys, cluster, rc)
    F_c = np.full(S, moe[0] * per_chunk)
    F_x = np.full(S, moe[1] * per_chunk)
    B_c = np.full(S, moe[2] * per_chunk)
    B_x = np.full(S, moe[3] * per_chunk)
    if sh.dense_layers:   # leading dense layers run on the first stage
        dplan = dataclasses.replace(plan, remat="selective") if plan.remat == "partial" else plan
        d = _layer_times(wl.layer_work(sh, plan.recipe, T, n, dense=True, padded=sys.padded_dispatch),
                         dplan, sys, cluster, rc)
        F_c[0] += d[0] * sh.dense_layers / V
        F_x[0] += d[1] * sh.dense_layers / V
        B_c[0] += d[2] * sh.dense_layers / V
        B_x[0] += d[3] * sh.dense_layers / V
    peak = cluster.gpu.peak_bf16_tflops * 1e12
    head_tok = T if plan.recipe == "xla" else T / n
    t_head = 2 * head_tok * sh.h * sh.vocab / (eff.dense_gemm_efficiency(head_tok, sh.h, sh.vocab) * peak)
    loss = head_tok * sh.vocab * wl.LOSS_BYTES_PER_LOGIT / (cluster.hbm_bw() * eff.elementwise_efficiency())
    F_c[-1] += t_head / V
    B_c[-1] += (2 * t_head + loss + (t_head if rc else 0.0)) / V
    return F_c, F_x, B_c, B_x


def _tick_overhead(sh, plan, cluster) -> float:
    p = wl.params_per_device(sh, plan.recipe, plan.intra)
    chunk = sh.moe_layers // (plan.pipe * plan.virtual_stages) * p["moe_layer"]
    touched = chunk + sh.dense_layers * p["dense_layer"] + p["embed_head"]
    return touched * PIPELINE_TICK_BYTES / (cluster.hbm_bw() * eff.elementwise_efficiency())


def _p2p_time(sh, plan, sys, cluster, T):
    if plan.pipe == 1:
        return 0.0
    bw, lat = cluster.bandwidth(plan.pipe, plan.intra)
    t = T / plan.intra * sh.h * wl.BF16 / bw + lat
    return t * (1 - sys.p2p_hidden)


def _sync(sh, plan, sys, cluster, p_local, p_rep, dp):
    """(seconds exposed, seconds total) of the per-step gradient reductions (intra replicated + data)."""
    n = plan.intra
    total = 0.0
    if n > 1 and p_rep:
        bw, lat = cluster.bandwidth(n, 1)
        total += 2 * (n - 1) / n * 4 * p_rep / bw + lat
    if dp > 1:
        bw, lat = cluster.bandwidth(dp, n * plan.pipe)
        if plan.optimizer_sharding == "zero1":
            wire = grad_comm.wire_bytes(int(p_local), dp, plan.grad_comm)
            wire += (dp - 1) / dp * sys.zero1_gather_bytes * p_local
        else:
            wire = 2 * (dp - 1) / dp * 4 * p_local
        total += wire / bw + 2 * lat
    return total * (1 - sys.dp_hidden), total


def _memory(sh, plan, sys, cluster, T, dp, stage_params, stash, grad_slots):
    n, S, V, M = plan.intra, plan.pipe, plan.virtual_stages, plan.microbatches
    zdp = dp if plan.optimizer_sharding == "zero1" else 1
    weights = stage_params * (sys.param_bytes + sys.optimizer_bytes / zdp)
    lw = wl.layer_work(sh, plan.recipe, T, n, dispatch=plan.ep_dispatch, padded=sys.padded_dispatch,
                       sar_formula=sys.sar_formula)
    unit = T / n * sh.h * wl.BF16
    per_chunk = sh.moe_layers // (S * V) + (sh.dense_layers if S > 1 else 0)
    work = lw.act_units["none"] if plan.remat != "none" else 0.0
    sel = "selective_core" if sys.selective == "core" else "selective"
    saved = lw.act_units[sel if plan.remat == "selective" else plan.remat] if plan.remat != "partial" else \
        (plan.recompute_layers * lw.act_units["full"] + (per_chunk - plan.recompute_layers) * lw.act_units[sel]) \
        / per_chunk
    if S == 1:
        act = sh.layers * saved + work
    elif sys.pipeline_recompute:
        act = stash + grad_slots + per_chunk * saved + work
    else:
        inflight = {"gpipe": M * V, "1f1b": S}.get(plan.schedule, S * (V + 1) - 1)
        act = inflight * per_chunk * saved + work
    head_tok = T if plan.recipe == "xla" else T / n
    logits = head_tok * sh.vocab * 8
    total = weights + act * unit + logits
    return {"weights": weights / GB, "activations": act * unit / GB, "logits": logits / GB,
            "total": total / GB, "usable": cluster.usable_hbm() / GB}


def validate(sh, plan, num_gpus: int, gpus_per_node: int) -> str:
    """'' if the plan can run on this model and cluster, else why not."""
    n, S, V, M = plan.intra, plan.pipe, plan.virtual_stages, plan.microbatches
    att, ffn = wl.RECIPES[plan.recipe]
    checks = [
        (n <= max(gpus_per_node, 1) and gpus_per_node % n == 0, f"intra={n} must divide the {gpus_per_node} GPUs of a node"),
        (num_gpus % (n * S) == 0, f"{num_gpus} GPUs not divisible by intra x pipe = {n * S}"),
        (ffn not in ("ep", "xla") or sh.experts % n == 0, f"{sh.experts} experts not divisible by intra={n}"),
        (att != "tp" or (sh.heads % n == 0 and sh.kv_heads % n == 0), f"TP attention needs heads % {n} == 0"),
        (att != "sp" or sh.heads % n == 0, f"SP attention needs heads % {n} == 0"),
        (ffn != "tp" or (sh.f % (64 * n) == 0 and (not sh.dense_layers or sh.dense_ffn % n == 0)),
         f"TP experts need FFN % (64 x {n}) == 0"),
        (sh.moe_layers % (S * V) == 0, f"{sh.moe_layers} MoE layers not divisible by pipe x virtual = {S * V}"),
        (S > 1 or (V == 1 and plan.schedule == "1f1b"), "pipe=1 takes schedule 1f1b, virtual_stages 1"),
        (plan.schedule != "interleaved" or (V >= 2 and M % S == 0), "interleaved needs V >= 2 and M % pipe == 0"),
        (plan.schedule == "interleaved" or V == 1, "virtual_stages > 1 needs the interleaved schedule"),
        (plan.grad_comm == "fp32" or plan.optimizer_sharding == "zero1", "bf16/fp8 grad_comm needs zero1"),
        (plan.remat != "partial" or 0 < plan.recompute_layers < sh.moe_layers // (S * V),
         "remat=partial needs 0 < recompute_layers < layers per chunk"),
    ]
    for ok, why in checks:
        if not ok:
            return why
    dp = plan.data(num_gpus)
    if plan.global_batch % (dp * M):
        return f"global_batch={plan.global_batch} not divisible by data x microbatches = {dp * M}"
    if plan.microbatch_size(num_gpus) * sh.seq % n:
        return f"microbatch tokens not divisible by intra={n}"
    return ""


def evaluate(sh: wl.Shape, plan: Plan, cluster, sys, flops_per_token: float) -> Estimate:
    """Step time, tokens/s, MFU, breakdown and memory of `plan` for model `sh` on `cluster` run by `sys`."""
    G = cluster.num_gpus
    why = validate(sh, plan, G, cluster.gpus_per_node)
    if plan.remat == "partial" and not sys.partial_remat:
        why = f"system '{sys.name}' has no partial recompute"
    if why:
        raise ValueError(why)
    dp, M, S, V = plan.data(G), plan.microbatches, plan.pipe, plan.virtual_stages
    T = plan.microbatch_size(G) * sh.seq
    F_c, F_x, B_c, B_x = _stage_costs(sh, plan, sys, cluster, T)
    F, B = F_c + F_x, B_c + B_x
    p2p = ticks = 0.0
    if S == 1:
        makespan, stash, gslots = M * (F[0] + B[0]), 0, 0
    else:
        f_on, b_on, stash, gslots = _tables(plan.schedule, S, M, V)
        tick = f_on * F[None, :] + b_on * B[None, :]
        busy = (f_on + b_on).max(axis=1) > 0
        makespan = float(tick.max(axis=1).sum())
        p2p = _p2p_time(sh, plan, sys, cluster, T) * busy.sum()
        if sys.pipeline_recompute:   # this code's executor: gradient accumulators touched on every tick
            ticks = f_on.shape[0] * _tick_overhead(sh, plan, cluster)
    busiest = int(np.argmax(F + B))
    compute = M * V * (F_c[busiest] + B_c[busiest])
    exposed = M * V * (F_x[busiest] + B_x[busiest])
    p = wl.params_per_device(sh, plan.recipe, plan.intra)
    stage_moe = sh.moe_layers // S * p["moe_layer"]
    first = stage_moe + sh.dense_layers * p["dense_layer"]
    if sys.pipeline_recompute or S == 1:   # this code replicates embedding + head on every stage
        stage_params = first + p["embed_head"]
        p_local = stage_params
    else:
        stage_params = max(first, stage_moe) + p["embed_head"] / 2
        p_local = stage_params
    p_rep = (sh.moe_layers // S * p["replicated_moe_layer"] + sh.dense_layers * p["replicated_dense_layer"]
             + p["replicated_embed_head"])
    sync_exposed, _ = _sync(sh, plan, sys, cluster, p_local, p_rep, dp)
    zdp = dp if plan.optimizer_sharding == "zero1" else 1
    opt_bytes = p_local * (wl.OPTIMIZER_BYTES_PER_PARAM - wl.ADAMW_BYTES_PER_PARAM + sys.adamw_bytes / zdp)
    optimizer = opt_bytes / (cluster.hbm_bw() * eff.elementwise_efficiency())
    host = eff.host_gap_s()
    step = makespan + p2p + ticks + sync_exposed + optimizer + host
    tokens = plan.global_batch * sh.seq
    tps = tokens / step
    mfu = tps * flops_per_token / (G * cluster.gpu.peak_bf16_tflops * 1e12)
    mem = _memory(sh, plan, sys, cluster, T, dp, stage_params, stash, gslots)
    fits = mem["total"] <= mem["usable"]
    reason = "" if fits else (f"needs {mem['total']:.1f} GB > {mem['usable']:.1f} GB usable (weights+optimizer "
                              f"{mem['weights']:.1f}, activations {mem['activations']:.1f}, logits {mem['logits']:.1f})")
    breakdown = {"compute": compute, "exposed_comm": exposed + p2p, "bubble": makespan - compute - exposed,
                 "pipeline_ticks": ticks, "dp_sync": sync_exposed, "optimizer": optimizer, "host": host}
    small = sorted({g.name for g in wl.layer_work(sh, plan.recipe, T, plan.intra, dispatch=plan.ep_dispatch,
                                                  padded=sys.padded_dispatch).gemms
                    if g.name != "router" and eff.below_measured_range(g)})
    notes = (f"below the measured GEMM shapes (rate clamped, optimistic): {', '.join(small)}",) if small else ()
    return Estimate(plan, sys.name, tps, mfu, step, breakdown, mem, fits, reason, notes)


def flops_per_token(cfg) -> float:
    return model_size(cfg.model, cfg.train.seq_len).train_flops_per_token
