"""Config: the ml_collections ConfigDict from configs/*.py becomes frozen dataclasses, once, resolved and validated.

This is the only library module that touches a ConfigDict. Library code receives the small dataclasses
below, already resolved: the plan recipe (configs/plans.py) into parallel.plan / attention / ffn / intra,
`ep_dispatch='auto'` into a mode, `balance_group_size=0` into a size, `parallel.data=-1` into a size. The
kernel choices (`kernels.*`) stay as chosen: `auto` needs the backend and the operand shapes and is
resolved by megascale_jax/step.py when the model is built. Choices are the StrEnums of their consumers.
Every check (megascale_jax/config_checks.py) raises `ConfigError` naming the key and the fix, before anything
compiles.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from configs import base as base_config
from configs import plans as plan_recipes
from megascale_jax.config_checks import CHOICES, ConfigError, DType, check_choices, validate  # noqa: F401
from megascale_jax.parallel.plan import EPDispatch


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    expert_ffn: int
    num_shared_experts: int
    shared_expert_ffn: int
    shared_expert_gate: bool
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
    head_dim: int          # resolved: never 0 after config.resolve
    qkv_bias: bool
    qk_norm: bool
    attention_kind: str
    dense_ffn: int
    num_dense_layers: int
    rope_theta: float
    norm_eps: float
    tie_embeddings: bool
    tied_head_scale: str
    max_seq_len: int
    moe: MoEConfig

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
    dispatch_dtype: str
    moe_layer: str
    overlap_chunks: int
    attention_exchange: str
    dispatch_exchange: str
    optimizer_sharding: str
    grad_comm: str


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    grouped_gemm: str
    attention: str
    swiglu: str
    grouped_gemm_tail: str
    cross_entropy: str
    permute: str
    adamw: str


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
    adam_moments_dtype: str
    grad_clip: float
    param_dtype: str
    compute_dtype: str
    remat: str
    scan_unroll: int
    nonfinite: str
    loss_spike_factor: float
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
    check_choices(cfg)
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
        if not (p.intra >= 1 and e.num_experts % p.intra == 0):
            raise ConfigError(f"config.model.moe.balance_group_size=0 means num_experts / intra, but num_experts="
                              f"{e.num_experts} is not divisible by intra={p.intra}; set balance_group_size "
                              "explicitly.")
        e = dataclasses.replace(e, balance_group_size=e.num_experts // p.intra)
    m = cfg.model
    # head_dim 0 = hidden / num_heads; left 0 (validate names hidden) when that does not divide.
    divides = m.num_heads > 0 and m.hidden % m.num_heads == 0
    head_dim = m.head_dim or (m.hidden // m.num_heads if divides else 0)
    cfg = dataclasses.replace(cfg, parallel=p, model=dataclasses.replace(m, moe=e, head_dim=head_dim))
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


def base_keys() -> set[str]:
    """Every dotted key of configs/base.py (for tests and docs)."""
    def walk(d, prefix):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from walk(v, prefix + k + ".")
            else:
                yield prefix + k
    return set(walk(base_config.get_config().to_dict(), ""))
