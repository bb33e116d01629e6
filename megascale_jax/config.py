"""Config: the ml_collections ConfigDict from configs/*.py becomes frozen dataclasses, once, resolved and validated.

This is the only library module that touches a ConfigDict. Library code receives the small dataclasses
below, already resolved: the plan recipe (configs/plans.py) into parallel.plan / attention / ffn / intra,
`ep_dispatch='auto'` into a mode, `balance_group_size=0` into a size, `parallel.data=-1` into a size. The
kernel choices (`kernels.*`) stay as chosen: `auto` needs the backend and the operand shapes and is
resolved by megascale_jax/step.py when the model is built. Choices are the StrEnums of their consumers.
Every check raises `ConfigError` naming the key and the fix, before anything compiles.
"""
from __future__ import annotations

import dataclasses
from enum import StrEnum
from typing import Any, Mapping

from configs import base as base_config
from configs import plans as plan_recipes
from megascale_jax import data as data_lib
from megascale_jax.model.attention import AttentionImpl, AttentionKind
from megascale_jax.model.moe.experts import GroupedGemmImpl
from megascale_jax.model.moe.router import RouterKind
from megascale_jax.model.transformer import Remat
from megascale_jax.parallel.grad_comm import GradComm
from megascale_jax.parallel.pipeline_schedules import Schedule, validate_schedule_args
from megascale_jax.parallel.plan import AttentionPlan, EPDispatch, FFNPlan, PlanKind
from megascale_jax.parallel.zero import OptimizerSharding


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key and the fix."""


class DType(StrEnum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    expert_ffn: int
    num_shared_experts: int
    shared_expert_ffn: int
    renormalize: bool
    router_kind: str
    aux_loss_weight: float
    z_loss_weight: float
    balance_group_size: int
    capacity_factor: float


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    attention_kind: str
    dense_ffn: int
    num_dense_layers: int
    rope_theta: float
    norm_eps: float
    tie_embeddings: bool
    max_seq_len: int
    moe: MoEConfig

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    data: int
    intra: int
    pipe: int
    pipeline_schedule: str
    virtual_stages: int
    plan: str
    attention: str
    ffn: str
    ep_dispatch: str
    dispatch_crossover_top_k: int
    optimizer_sharding: str
    grad_comm: str


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    grouped_gemm: str
    attention: str


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int
    global_batch: int
    microbatches: int
    seq_len: int
    learning_rate: float
    warmup_steps: int
    min_lr_ratio: float
    weight_decay: float
    b1: float
    b2: float
    grad_clip: float
    param_dtype: str
    compute_dtype: str
    remat: str
    scan_unroll: int
    seed: int
    log_every: int
    eval_every: int
    eval_batches: int


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: str
    path: str
    dtype: str
    eval_fraction: float
    cache_dir: str


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    dir: str
    every: int
    keep: int
    async_save: bool


@dataclasses.dataclass(frozen=True)
class OutputConfig:
    dir: str
    tensorboard: bool


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    start_step: int
    num_steps: int


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    plan_recipe: str
    model: ModelConfig
    parallel: ParallelConfig
    kernels: KernelConfig
    train: TrainConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    output: OutputConfig
    profile: ProfileConfig


_NESTED = {
    (Config, "model"): ModelConfig, (Config, "parallel"): ParallelConfig, (Config, "kernels"): KernelConfig,
    (Config, "train"): TrainConfig, (Config, "data"): DataConfig, (Config, "checkpoint"): CheckpointConfig,
    (Config, "output"): OutputConfig, (Config, "profile"): ProfileConfig, (ModelConfig, "moe"): MoEConfig,
}


def _build(cls, values: Mapping[str, Any], where: str):
    """Builds dataclass `cls` from a mapping; unknown or missing keys are errors."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"unknown config key(s) {', '.join(where + k for k in unknown)}; "
                          f"known keys here: {', '.join(sorted(fields))}. Fix the spelling or remove them.")
    missing = sorted(set(fields) - set(values))
    if missing:
        raise ConfigError(f"missing config key(s) {', '.join(where + k for k in missing)}; "
                          "start the config from configs/base.py (base.get_config()).")
    kwargs = {}
    for name in fields:
        sub = _NESTED.get((cls, name))
        kwargs[name] = _build(sub, values[name], f"{where}{name}.") if sub else values[name]
    return cls(**kwargs)


def from_config_dict(config_dict, num_devices: int | None = None) -> Config:
    """The one conversion from ConfigDict to frozen dataclasses: resolved, then validated. With
    `num_devices`, parallel.data = -1 is filled in and the mesh is checked against it."""
    values = config_dict.to_dict() if hasattr(config_dict, "to_dict") else dict(config_dict)
    cfg = _build(Config, values, "config.")
    _check_choices(cfg)
    cfg = resolve(cfg, num_devices)
    validate(cfg)
    return cfg


def default_config(name: str = "tiny_cpu", num_devices: int | None = None, **overrides) -> Config:
    """Loads configs/<name>.py; `overrides` are dotted keys, e.g. {'train.steps': 3}. For tests and scripts."""
    import importlib

    cd = importlib.import_module(f"configs.{name}").get_config()
    for dotted, value in overrides.items():
        node = cd
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node[p]
        if leaf not in node:
            raise ConfigError(f"unknown config key config.{dotted}")
        node[leaf] = value
    return from_config_dict(cd, num_devices)


# ------------------------------------------------------------------------------------------ resolution
def _node_size(num_devices: int | None) -> int:
    import jax

    local = jax.local_device_count()
    return min(local, num_devices) if num_devices else local


def resolve(cfg: Config, num_devices: int | None = None) -> Config:
    """Recipe -> plan / attention / ffn / intra (explicit keys win); auto dispatch; balance groups; data."""
    p, e = cfg.parallel, cfg.model.moe
    recipe = plan_recipes.RECIPES[cfg.plan_recipe]
    intra = p.intra or recipe["intra"]
    if intra == plan_recipes.NODE:
        intra = _node_size(num_devices)
    p = dataclasses.replace(p, plan=p.plan or recipe["plan"], attention=p.attention or recipe["attention"],
                            ffn=p.ffn or recipe["ffn"], intra=intra)
    if p.ep_dispatch == EPDispatch.AUTO:
        # The paper's crossover: all-gather + local scatter beats all-to-all above top-k 6 (Mixtral shapes).
        p = dataclasses.replace(p, ep_dispatch=(EPDispatch.ALL_GATHER if e.top_k > p.dispatch_crossover_top_k
                                                else EPDispatch.ALL_TO_ALL).value)
    if e.balance_group_size == 0:   # the experts of one EP rank count as one virtual expert
        _check(p.intra >= 1 and e.num_experts % p.intra == 0,
               f"config.model.moe.balance_group_size=0 means num_experts / intra, but num_experts="
               f"{e.num_experts} is not divisible by intra={p.intra}; set balance_group_size explicitly.")
        e = dataclasses.replace(e, balance_group_size=e.num_experts // p.intra)
    cfg = dataclasses.replace(cfg, parallel=p, model=dataclasses.replace(cfg.model, moe=e))
    return resolve_data_parallel(cfg, num_devices) if num_devices is not None else cfg


def resolve_data_parallel(cfg: Config, num_devices: int) -> Config:
    """Fills parallel.data = -1 with the devices left after intra and pipe, and checks the product."""
    p = cfg.parallel
    other = p.intra * p.pipe
    if p.intra < 1 or p.pipe < 1:
        raise ConfigError(f"config.parallel.intra={p.intra} and config.parallel.pipe={p.pipe} must be >= 1")
    if p.data == -1:
        if num_devices % other:
            raise ConfigError(f"{num_devices} devices cannot be split into parallel.intra={p.intra} x "
                              f"parallel.pipe={p.pipe} groups; choose sizes whose product divides {num_devices}.")
        p = dataclasses.replace(p, data=num_devices // other)
    if p.data * other != num_devices:
        raise ConfigError(f"mesh data={p.data} x intra={p.intra} x pipe={p.pipe} = {p.data * other} devices, "
                          f"but {num_devices} are present; set --config.parallel.data=-1 or sizes that multiply "
                          f"to {num_devices}.")
    return dataclasses.replace(cfg, parallel=p)


# ------------------------------------------------------------------------------------------ validation
def _values(enum) -> tuple[str, ...]:
    return tuple(member.value for member in enum)


# The table of choices, generated from the consumers' enums. "" = taken from the plan recipe.
CHOICES = {
    "plan_recipe": tuple(plan_recipes.RECIPES),
    "parallel.plan": ("", *_values(PlanKind)), "parallel.attention": ("", *_values(AttentionPlan)),
    "parallel.ffn": ("", *_values(FFNPlan)), "parallel.ep_dispatch": _values(EPDispatch),
    "parallel.pipeline_schedule": _values(Schedule), "parallel.optimizer_sharding": _values(OptimizerSharding),
    "parallel.grad_comm": _values(GradComm),
    "kernels.grouped_gemm": _values(GroupedGemmImpl), "kernels.attention": _values(AttentionImpl),
    "model.attention_kind": _values(AttentionKind), "model.moe.router_kind": _values(RouterKind),
    "train.remat": _values(Remat), "train.param_dtype": _values(DType), "train.compute_dtype": _values(DType),
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


def _check_choices(cfg: Config) -> None:
    for dotted, options in CHOICES.items():
        value = _get(cfg, dotted)
        shown = ", ".join(repr(o) if o == "" else o for o in options)
        _check(value in options, f"config.{dotted}={value!r}; choose one of {shown}.")
    _check(cfg.parallel.intra >= 0, f"config.parallel.intra={cfg.parallel.intra}: use 0 (the plan recipe's "
           "choice) or a size >= 1.")


def validate(cfg: Config) -> None:
    """Checks that a resolved config can work; raises ConfigError naming the key and the fix."""
    _check_choices(cfg)
    m, e, p, t = cfg.model, cfg.model.moe, cfg.parallel, cfg.train
    for key in ("vocab_size", "num_layers", "hidden", "num_heads", "num_kv_heads"):
        _check(getattr(m, key) > 0, f"config.model.{key}={getattr(m, key)} must be positive.")
    _check(m.hidden % m.num_heads == 0,
           f"config.model.hidden={m.hidden} is not num_heads={m.num_heads} x head_dim: hidden must be a multiple "
           "of num_heads (head_dim = hidden / num_heads).")
    _check(m.head_dim % 2 == 0, f"head_dim = hidden / num_heads = {m.head_dim} must be even for RoPE.")
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
    _validate_intra(cfg)
    _validate_step(cfg)
    _validate_pipeline(cfg)
    _check(cfg.data.source != "tokens" or cfg.data.path,
           "config.data.source='tokens' needs config.data.path (a flat uint16/uint32 token file).")
    _check(m.vocab_size >= 256 or cfg.data.source != "text",
           f"config.model.vocab_size={m.vocab_size} is below the byte tokenizer's 256 for data.source='text'.")


def _validate_pipeline(cfg: Config) -> None:
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


def _validate_step(cfg: Config) -> None:
    """Compressed gradients and ZeRO-1 need the per-device step (manual plan, or a pipeline)."""
    p = cfg.parallel
    per_device = p.plan == PlanKind.MANUAL or p.pipe > 1
    _check(p.grad_comm == GradComm.FP32 or per_device, f"config.parallel.grad_comm={p.grad_comm!r} exchanges "
           "gradients per device; set config.parallel.plan='manual' (e.g. --config.plan_recipe=megascale) or "
           "grad_comm='fp32'.")
    _check(p.optimizer_sharding == OptimizerSharding.NONE or per_device, "config.parallel.optimizer_sharding="
           "'zero1' runs the step per device: set config.parallel.plan='manual' (e.g. --config.plan_recipe="
           "megascale).")


def _validate_intra(cfg: Config) -> None:
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


def base_keys() -> set[str]:
    """Every dotted key of configs/base.py (for tests and docs)."""
    def walk(d, prefix):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from walk(v, prefix + k + ".")
            else:
                yield prefix + k
    return set(walk(base_config.get_config().to_dict(), ""))
