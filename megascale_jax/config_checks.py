"""Config validation: every choice and numeric range of the resolved config, checked before anything compiles.

The table of choices is generated from the consumers' StrEnums (the model's, the parallel layer's, the step's),
so a new option exists in one place. Every failure is a `ConfigError` whose one-line message names the key,
its legal values or range, and the fix. megascale_jax/config.py builds and resolves; this module judges.
"""
from __future__ import annotations

import math
from enum import StrEnum

from configs import plans as plan_recipes
from megascale_jax import data as data_lib
from megascale_jax.model.attention import AttentionImpl, AttentionKind
from megascale_jax.model.layers import CrossEntropyImpl, TiedHeadScale
from megascale_jax.model.moe.experts import GroupedGemmImpl, GroupedGemmTail, SwigluImpl
from megascale_jax.model.moe.router import RouterKind
from megascale_jax.model.transformer import Remat
from megascale_jax.optim import BF16_MIN_MOMENT_STEP, NonFinite
from megascale_jax.parallel.grad_comm import GradComm
from megascale_jax.parallel.permute import PermuteImpl
from megascale_jax.updaters import AdamWImpl
from megascale_jax.parallel.pipeline_schedules import Schedule, validate_schedule_args
from megascale_jax.parallel.expert_runs import DispatchExchange
from megascale_jax.parallel.ring_attention import AttentionExchange
from megascale_jax.parallel.plan import AttentionPlan, DispatchDType, EPDispatch, FFNPlan, MoELayer, PlanKind
from megascale_jax.parallel.zero import OptimizerSharding


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key and the fix."""


class DType(StrEnum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"


def _values(enum) -> tuple[str, ...]:
    return tuple(member.value for member in enum)


# The table of choices, generated from the consumers' enums. "" = taken from the plan recipe.
CHOICES = {
    "plan_recipe": tuple(plan_recipes.RECIPES),
    "parallel.plan": ("", *_values(PlanKind)), "parallel.attention": ("", *_values(AttentionPlan)),
    "parallel.ffn": ("", *_values(FFNPlan)), "parallel.ep_dispatch": _values(EPDispatch),
    "parallel.pipeline_schedule": _values(Schedule), "parallel.optimizer_sharding": _values(OptimizerSharding),
    "parallel.grad_comm": _values(GradComm), "parallel.dispatch_dtype": _values(DispatchDType),
    "parallel.moe_layer": _values(MoELayer), "model.tied_head_scale": _values(TiedHeadScale),
    "kernels.grouped_gemm": _values(GroupedGemmImpl), "kernels.attention": _values(AttentionImpl),
    "kernels.swiglu": _values(SwigluImpl), "kernels.grouped_gemm_tail": _values(GroupedGemmTail),
    "kernels.cross_entropy": _values(CrossEntropyImpl), "kernels.permute": _values(PermuteImpl),
    "kernels.adamw": _values(AdamWImpl),
    "parallel.attention_exchange": _values(AttentionExchange),
    "parallel.dispatch_exchange": _values(DispatchExchange),
    "model.attention_kind": _values(AttentionKind), "model.moe.router_kind": _values(RouterKind),
    "train.remat": _values(Remat), "train.nonfinite": _values(NonFinite), "train.param_dtype": _values(DType),
    "train.compute_dtype": _values(DType),
    "train.adam_moments_dtype": _values(DType),
    "data.source": tuple(data_lib.SOURCE_KINDS), "data.dtype": tuple(data_lib.TOKEN_FILE_DTYPES),
}


def _get(cfg, dotted: str):
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def check_choices(cfg) -> None:
    for dotted, options in CHOICES.items():
        value = _get(cfg, dotted)
        shown = ", ".join(repr(o) if o == "" else o for o in options)
        _check(value in options, f"config.{dotted}={value!r}; choose one of {shown}.")
    _check(cfg.parallel.intra >= 0, f"config.parallel.intra={cfg.parallel.intra}: use 0 (the plan recipe's "
           "choice) or a size >= 1.")


def validate(cfg) -> None:
    """Checks that a resolved config can work; raises ConfigError naming the key and the fix."""
    check_choices(cfg)
    m, e, p, t = cfg.model, cfg.model.moe, cfg.parallel, cfg.train
    for key in ("vocab_size", "num_layers", "hidden", "num_heads", "num_kv_heads"):
        _check(getattr(m, key) > 0, f"config.model.{key}={getattr(m, key)} must be positive.")
    _check(m.head_dim > 0, f"config.model.hidden={m.hidden} is not a multiple of num_heads={m.num_heads}, so "
           "config.model.head_dim=0 (hidden / num_heads) has no value; fix hidden or set head_dim explicitly.")
    _check(m.head_dim % 2 == 0, f"config.model.head_dim={m.head_dim} must be even for RoPE.")
    _check(m.num_heads % m.num_kv_heads == 0,
           f"config.model.num_heads={m.num_heads} is not a multiple of num_kv_heads={m.num_kv_heads} (GQA groups "
           "must be equal); pick num_kv_heads dividing num_heads.")
    _check(0 <= m.num_dense_layers < m.num_layers,
           f"config.model.num_dense_layers={m.num_dense_layers} must be within [0, num_layers={m.num_layers}) "
           "so that at least one layer is MoE.")
    _check(m.num_dense_layers == 0 or m.dense_ffn > 0, "config.model.dense_ffn must be > 0 with dense layers.")
    _check(e.num_experts > 0 and e.expert_ffn > 0, "config.model.moe.num_experts and expert_ffn must be > 0.")
    _check(1 <= e.top_k <= e.num_experts,
           f"config.model.moe.top_k={e.top_k} must be in [1, num_experts={e.num_experts}].")
    _check(e.num_shared_experts >= 0, "config.model.moe.num_shared_experts must be >= 0.")
    _check(not e.shared_expert_gate or e.num_shared_experts > 0,
           "config.model.moe.shared_expert_gate=True gates the shared experts' output, but num_shared_experts=0; "
           "set num_shared_experts >= 1 (Qwen2-MoE: 1 of shared_expert_ffn 5632) or shared_expert_gate=False.")
    _check(e.capacity_factor == 0 or e.capacity_factor > 0,
           f"config.model.moe.capacity_factor={e.capacity_factor}: use 0 (dropless) or a positive factor.")
    _check(e.balance_group_size >= 1 and e.num_experts % e.balance_group_size == 0,
           f"config.model.moe.balance_group_size={e.balance_group_size}: num_experts={e.num_experts} must be a "
           "multiple of the group size (0 = experts per EP rank, 1 = per expert).")
    _check(t.seq_len <= m.max_seq_len,
           f"config.train.seq_len={t.seq_len} exceeds config.model.max_seq_len={m.max_seq_len}; raise "
           "max_seq_len or shorten seq_len.")
    _check(t.steps > 0 and t.global_batch > 0 and t.seq_len > 0, "config.train.steps, global_batch and seq_len "
           "must be positive.")
    _check(0 <= t.warmup_steps <= t.steps, f"config.train.warmup_steps={t.warmup_steps} must be in [0, steps].")
    _check(t.scan_unroll >= 1, f"config.train.scan_unroll={t.scan_unroll} must be >= 1 (1 = one layer per loop "
           "iteration; >= num_layers unrolls the layer loop).")
    _check(t.microbatches >= 1, f"config.train.microbatches={t.microbatches} must be >= 1 (1 = no gradient "
           "accumulation).")
    _check(p.data == -1 or p.data >= 1, f"config.parallel.data={p.data}: use -1 (all remaining devices) or >= 1.")
    if p.data > 0:
        rows = t.microbatches * p.data
        _check(t.global_batch % rows == 0,
               f"config.train.global_batch={t.global_batch} is not divisible by train.microbatches x data = "
               f"{t.microbatches} x {p.data}; use a multiple of {rows}.")
    _validate_ranges(cfg)
    _validate_intra(cfg)
    _validate_step(cfg)
    _validate_dispatch_dtype(cfg)
    _validate_moe_layer(cfg)
    _validate_pipeline(cfg)
    _check(cfg.data.source != "tokens" or cfg.data.path,
           "config.data.source='tokens' needs config.data.path (a flat uint16/uint32 token file).")
    _check(m.vocab_size >= 256 or cfg.data.source != "text",
           f"config.model.vocab_size={m.vocab_size} is below the byte tokenizer's 256 for data.source='text'.")


def _in_range(dotted: str, value, ok: bool, legal: str, fix: str = "") -> None:
    _check(ok, f"config.{dotted}={value!r} is out of range: it must be {legal}{'; ' + fix if fix else ''}.")


def _validate_ranges(cfg) -> None:
    """Every numeric key with its legal range (NaN fails every comparison, so it is caught too)."""
    t, m, e, c, d, p = cfg.train, cfg.model, cfg.model.moe, cfg.checkpoint, cfg.data, cfg.parallel
    finite = math.isfinite
    _in_range("train.learning_rate", t.learning_rate, finite(t.learning_rate) and t.learning_rate >= 0,
              "a finite number >= 0")
    for key in ("b1", "b2"):
        value = getattr(t, key)
        _in_range(f"train.{key}", value, 0 <= value < 1, "in [0, 1)", "Adam's decay rates, e.g. 0.9 / 0.95")
        if t.adam_moments_dtype == DType.BFLOAT16:
            _in_range(f"train.{key}", value, 1 - value >= BF16_MIN_MOMENT_STEP,
                      f"<= {1 - BF16_MIN_MOMENT_STEP} with train.adam_moments_dtype='bfloat16' (a step moves the "
                      "moment by 1 - decay of itself, finer than bfloat16 keeps)",
                      "lower it or set train.adam_moments_dtype='float32'")
    _in_range("train.weight_decay", t.weight_decay, finite(t.weight_decay) and t.weight_decay >= 0, ">= 0")
    _in_range("train.grad_clip", t.grad_clip, finite(t.grad_clip) and t.grad_clip >= 0, ">= 0", "0 turns clipping off")
    _in_range("train.min_lr_ratio", t.min_lr_ratio, 0 <= t.min_lr_ratio <= 1, "in [0, 1]")
    _in_range("train.seed", t.seed, t.seed >= 0, ">= 0")
    _in_range("train.log_every", t.log_every, t.log_every >= 1, ">= 1")
    _in_range("train.eval_every", t.eval_every, t.eval_every >= 0, ">= 0", "0 turns eval off")
    if t.eval_every:
        _in_range("train.eval_batches", t.eval_batches, t.eval_batches >= 1, ">= 1 when eval is on",
                  "or set train.eval_every=0")
        _in_range("data.eval_fraction", d.eval_fraction, 0 < d.eval_fraction < 1, "in (0, 1) when eval is on",
                  "or set train.eval_every=0")
    _in_range("data.eval_fraction", d.eval_fraction, 0 <= d.eval_fraction < 1, "in [0, 1)")
    _in_range("train.loss_spike_factor", t.loss_spike_factor, t.loss_spike_factor > 1, "> 1")
    _in_range("checkpoint.keep", c.keep, c.keep >= 1, ">= 1", "resuming needs the newest checkpoint")
    _in_range("checkpoint.every", c.every, c.every >= 0, ">= 0", "0 = no periodic checkpoints")
    _in_range("profile.num_steps", cfg.profile.num_steps, cfg.profile.num_steps >= 1, ">= 1")
    for key in ("aux_loss_weight", "z_loss_weight"):
        value = getattr(e, key)
        _in_range(f"model.moe.{key}", value, finite(value) and value >= 0, "a finite number >= 0")
    _in_range("model.norm_eps", m.norm_eps, 0 < m.norm_eps < 1, "in (0, 1)")
    _in_range("model.rope_theta", m.rope_theta, finite(m.rope_theta) and m.rope_theta > 0, "> 0")
    _in_range("parallel.virtual_stages", p.virtual_stages, p.virtual_stages >= 1, ">= 1")
    _in_range("parallel.dispatch_crossover_top_k", p.dispatch_crossover_top_k, p.dispatch_crossover_top_k >= 0,
              ">= 0")


def _validate_pipeline(cfg) -> None:
    p, m = cfg.parallel, cfg.model
    if p.pipe == 1:
        return
    try:
        validate_schedule_args(p.pipeline_schedule, p.pipe, cfg.train.microbatches, p.virtual_stages)
    except ValueError as err:
        raise ConfigError(f"config.parallel.pipeline_schedule / train.microbatches / parallel.virtual_stages: "
                          f"{err}") from err
    _check(m.num_moe_layers >= p.pipe * p.virtual_stages, f"config.model.num_layers={m.num_layers} is fewer "
           f"than pipe x virtual_stages = {p.pipe * p.virtual_stages} layer chunks.")
    _check(p.plan == PlanKind.MANUAL or p.intra == 1, "config.parallel.pipe > 1 with intra > 1 needs "
           "config.parallel.plan='manual' (SP/EP inside each stage), e.g. --config.plan_recipe=megascale.")
    _check(m.moe.capacity_factor == 0, "config.parallel.pipe > 1 runs dropless only (the pipeline cannot "
           "return dropped-token counts yet); set config.model.moe.capacity_factor=0.")


def _validate_dispatch_dtype(cfg) -> None:
    p = cfg.parallel
    if p.dispatch_dtype == DispatchDType.BF16:
        return
    _check(p.plan == PlanKind.MANUAL and p.ffn == FFNPlan.EP and p.intra > 1
           and p.ep_dispatch == EPDispatch.ALL_TO_ALL,
           f"config.parallel.dispatch_dtype={p.dispatch_dtype!r} compresses the expert-parallel all-to-all, which "
           f"this plan does not run (plan={p.plan}, ffn={p.ffn}, intra={p.intra}, ep_dispatch={p.ep_dispatch}); "
           "use plan_recipe=megascale with intra > 1 and ep_dispatch='all_to_all', or dispatch_dtype='bf16'.")


def _validate_moe_layer(cfg) -> None:
    """The macro layer writes the manual plan's collectives out by hand; it has no XLA-plan form."""
    p = cfg.parallel
    _check(p.overlap_chunks >= 1, f"config.parallel.overlap_chunks={p.overlap_chunks} must be >= 1 (1 = the "
           "token exchange in one piece).")
    _check(p.overlap_chunks == 1 or p.moe_layer == MoELayer.MACRO, f"config.parallel.overlap_chunks="
           f"{p.overlap_chunks} chunks the macro layer's token exchange; set parallel.moe_layer='macro' or "
           "overlap_chunks=1.")
    if p.moe_layer == MoELayer.FUSED:
        _check(p.plan == PlanKind.MANUAL and p.ffn == FFNPlan.EP and p.ep_dispatch == EPDispatch.ALL_GATHER
               and p.intra > 1, "config.parallel.moe_layer='fused' runs the all_gather dispatch (and SP attention) as ring steps: it "
               f"needs plan='manual', ffn='ep', ep_dispatch='all_gather' and intra > 1 (got plan={p.plan!r}, "
               f"ffn={p.ffn!r}, ep_dispatch={p.ep_dispatch!r}, intra={p.intra}).")
    _check(p.attention_exchange == AttentionExchange.RING or (p.moe_layer == MoELayer.FUSED and
                                                               p.attention == AttentionPlan.SP),
           f"config.parallel.attention_exchange={p.attention_exchange!r} moves the fused schedule's GEMM+A2A and A2A+GEMM: it "
           "needs parallel.moe_layer='fused' with attention='sp'; set it to 'ring' otherwise.")
    _check(p.dispatch_exchange == DispatchExchange.RING or p.moe_layer == MoELayer.FUSED,
           f"config.parallel.dispatch_exchange={p.dispatch_exchange!r} moves the fused schedule's dispatch rows: it "
           "needs parallel.moe_layer='fused' (with ep_dispatch='all_gather'); set it to 'ring' otherwise.")
    if p.attention_exchange == AttentionExchange.MOSAIC:   # the kernels' tiles (gemm_all_to_all.py, all_to_all_gemm.py)
        t, m = cfg.train, cfg.model
        rows = t.global_batch // max(p.data * t.microbatches, 1) * t.seq_len // p.intra
        _check(rows % 256 == 0 and m.hidden % 64 == 0 and m.head_dim % 64 == 0,
               f"config.parallel.attention_exchange='mosaic' tiles each device's {rows} rows per microbatch "
               f"(global_batch / (data x microbatches) x seq_len / intra) by 256 and model.hidden={m.hidden}, "
               f"head_dim={m.head_dim} by 64: change train.seq_len / the batch, or use 'ring'.")
    if p.moe_layer != MoELayer.MACRO:
        return
    e, t = cfg.model.moe, cfg.train
    _check(p.plan == PlanKind.MANUAL, f"config.parallel.moe_layer='macro' needs the per-device step: set "
           f"config.parallel.plan='manual' (e.g. --config.plan_recipe=megascale), not {p.plan!r}.")
    _check(p.ffn == FFNPlan.EP or p.intra == 1, "config.parallel.moe_layer='macro' writes out expert "
           "parallelism (or the one-device sort); set config.parallel.ffn='ep' or moe_layer='autodiff'.")
    _check(e.capacity_factor == 0 or p.overlap_chunks == 1, f"config.model.moe.capacity_factor="
           f"{e.capacity_factor} with parallel.overlap_chunks={p.overlap_chunks}: capacity would apply per chunk, "
           "not per device; use overlap_chunks=1 or dropless (capacity_factor=0).")
    tokens = t.global_batch // max(p.data * t.microbatches, 1) * t.seq_len // p.intra
    _check(tokens % p.overlap_chunks == 0, f"config.parallel.overlap_chunks={p.overlap_chunks} must divide each "
           f"device's {tokens} tokens per microbatch (global_batch / (data x microbatches) x seq_len / intra).")


def _validate_step(cfg) -> None:
    """Compressed gradients and ZeRO-1 need the per-device step (manual plan, or a pipeline)."""
    p = cfg.parallel
    per_device = p.plan == PlanKind.MANUAL or p.pipe > 1
    _check(p.grad_comm == GradComm.FP32 or per_device, f"config.parallel.grad_comm={p.grad_comm!r} exchanges "
           "gradients per device; set config.parallel.plan='manual' (e.g. --config.plan_recipe=megascale) or "
           "grad_comm='fp32'.")
    _check(p.optimizer_sharding == OptimizerSharding.NONE or per_device, "config.parallel.optimizer_sharding="
           "'zero1' runs the step per device: set config.parallel.plan='manual' (e.g. --config.plan_recipe="
           "megascale).")


def _validate_intra(cfg) -> None:
    """Checks the intra-node domain (SP / EP / TP) against the model's shapes."""
    m, e, p, t = cfg.model, cfg.model.moe, cfg.parallel, cfg.train
    n = p.intra
    if n == 1:
        return
    if p.plan == PlanKind.XLA:
        _check(e.num_experts % n == 0, f"config.model.moe.num_experts={e.num_experts} is not divisible by "
               f"config.parallel.intra={n}; the XLA plan shards experts over the intra axis.")
        return
    if p.attention == AttentionPlan.SP:
        _check(m.num_heads % n == 0, f"SP attention: num_heads={m.num_heads} is not divisible by "
               f"config.parallel.intra={n}; choose intra dividing num_heads or attention='tp'.")
        _check(t.seq_len % n == 0, f"SP attention: config.train.seq_len={t.seq_len} is not divisible by "
               f"config.parallel.intra={n}.")
        _check(m.num_kv_heads % n == 0 or n % m.num_kv_heads == 0,
               f"SP attention: num_kv_heads={m.num_kv_heads} and intra={n} must divide one another.")
    else:
        _check(m.num_heads % n == 0 and m.num_kv_heads % n == 0,
               f"TP attention shards heads: num_heads={m.num_heads} and num_kv_heads={m.num_kv_heads} must be "
               f"divisible by config.parallel.intra={n}.")
        _check(t.seq_len % n == 0, f"TP attention (sequence-parallel): seq_len={t.seq_len} must be divisible by "
               f"config.parallel.intra={n}.")
    if p.ffn == FFNPlan.EP:
        _check(e.num_experts % n == 0, f"EP: num_experts={e.num_experts} is not divisible by "
               f"config.parallel.intra={n}; each rank must hold whole experts (or use ffn='tp').")
        _check(e.capacity_factor == 0 or p.ep_dispatch == EPDispatch.ALL_TO_ALL,
               f"config.model.moe.capacity_factor={e.capacity_factor} applies to the all_to_all dispatch only "
               "(all_gather is dropless); set capacity_factor=0 or parallel.ep_dispatch='all_to_all'.")
    else:
        _check(e.expert_ffn % n == 0, f"TP FFN: expert_ffn={e.expert_ffn} is not divisible by intra={n}.")
