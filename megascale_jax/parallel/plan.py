"""ParallelPlan: the only place where mesh axis names exist.

Mesh axes, outermost first (devices of one NVLink domain are adjacent, innermost):
  data   data parallelism (replicas of the whole pipeline)
  pipe   pipeline stages (across nodes)
  intra  the intra-node domain of n devices: SP attention + EP experts (or the TP baselines)

Model code names *logical* axes on its parameters ('experts', 'embed', 'heads', ...); `logical_rules` maps
them onto these mesh axes, per plan:
  xla     parameters and the batch are annotated, XLA's sharding propagation (Shardy) decides the rest;
  manual  the step runs per device inside one jax.shard_map; parallel/layouts.py places the collectives.
"""
from __future__ import annotations

import dataclasses
from enum import StrEnum

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

DATA, PIPE, INTRA = "data", "pipe", "intra"
MESH_AXES = (DATA, PIPE, INTRA)


class PlanKind(StrEnum):
    XLA = "xla"          # annotate parameters and the batch; Shardy propagation decides the rest
    MANUAL = "manual"    # the step runs per device in one shard_map; parallel/layouts.py communicates


class AttentionPlan(StrEnum):
    SP = "sp"    # Ulysses sequence parallelism: all-to-all between sequence- and head-sharded layouts
    TP = "tp"    # Megatron tensor parallelism (with sequence parallelism): heads sharded in the weights


class FFNPlan(StrEnum):
    EP = "ep"    # expert parallelism: whole experts per rank, tokens exchanged
    TP = "tp"    # Megatron: every expert's FFN width sharded


class DispatchDType(StrEnum):
    """What the expert-parallel token exchange carries on the wire (parallel/expert_parallel.py)."""
    BF16 = "bf16"   # the activations as they are (the compute dtype)
    FP8 = "fp8"     # E4M3 with scales alongside, one byte per element; sums stay fp32


class MoELayer(StrEnum):
    """How the MoE block's communication meets its compute (parallel/overlap.py, parallel/ring_dispatch.py)."""
    AUTODIFF = "autodiff"   # JAX differentiates the block; XLA's scheduler places the collectives
    MACRO = "macro"         # forward and backward written out, each collective beside independent compute
    FUSED = "fused"         # ring schedules: dispatch + first GEMM, last GEMM + combine (ring_dispatch.py) and the
    #                         Ulysses all-to-alls inside the q/k/v and output projections (ring_attention.py)


class EPDispatch(StrEnum):
    ALL_TO_ALL = "all_to_all"
    ALL_GATHER = "all_gather"
    AUTO = "auto"   # resolved by config.py (all_gather above the top-k crossover); never reaches a plan


@dataclasses.dataclass(frozen=True)
class ParallelPlan:
    data: int
    pipe: int
    intra: int
    kind: str = PlanKind.XLA
    attention: str = AttentionPlan.SP   # manual only
    ffn: str = FFNPlan.EP               # manual only
    dispatch: str = EPDispatch.ALL_TO_ALL   # resolved, never auto
    capacity_factor: float = 0.0
    layers_over_pipe: bool = False
    dispatch_dtype: str = DispatchDType.BF16   # the EP all-to-all payload on the wire   # stacked layers sharded in blocks over `pipe` (each stage its own)

    @classmethod
    def from_config(cls, cfg) -> "ParallelPlan":
        """From a resolved config (config.py resolved the recipe, intra and `auto` dispatch)."""
        p = cfg.parallel
        # Block sharding of the layers matches the stages when every stage holds one contiguous chunk.
        # ZeRO-1 keeps the layers replicated over 'pipe': its flat groups are laid out per intra rank only.
        layers_over_pipe = (p.pipe > 1 and p.virtual_stages == 1 and cfg.model.num_moe_layers % p.pipe == 0
                            and p.optimizer_sharding == "none")
        return cls(p.data, p.pipe, p.intra, p.plan, p.attention, p.ffn, p.ep_dispatch,
                   cfg.model.moe.capacity_factor, layers_over_pipe, p.dispatch_dtype)

    @property
    def per_device(self) -> bool:
        """Whether the step runs per device inside one shard_map (the manual plan, and any pipeline)."""
        return self.kind == PlanKind.MANUAL or self.pipe > 1

    @property
    def num_devices(self) -> int:
        return self.data * self.pipe * self.intra

    def make_mesh(self, devices=None) -> Mesh:
        """A (data, pipe, intra) mesh; intra innermost so one domain sits on adjacent (same-node) devices."""
        devices = list(jax.devices() if devices is None else devices)
        if len(devices) != self.num_devices:
            raise ValueError(f"the plan needs data x pipe x intra = {self.data} x {self.pipe} x {self.intra} = "
                             f"{self.num_devices} devices but {len(devices)} were given; set config.parallel.* "
                             "to sizes that multiply to the device count (data=-1 fills in the rest).")
        grid = np.asarray(devices, dtype=object).reshape(self.data, self.pipe, self.intra)
        return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * 3)

    def logical_rules(self) -> dict[str, str | None]:
        """Logical parameter axis -> mesh axis (None = replicated)."""
        rules: dict[str, str | None] = {"layers": PIPE if self.layers_over_pipe else None}
        if self.intra > 1 and (self.kind == "xla" or self.ffn == "ep"):
            rules["experts"] = INTRA            # whole experts per rank (EP)
        if self.kind == "manual" and self.ffn == "tp":
            rules["expert_ffn"] = INTRA         # Megatron-style: expert FFN width sharded
            rules["ffn"] = INTRA                # ... and so are shared experts and dense layers
        if self.kind == "manual" and self.attention == "tp":
            rules["heads"] = INTRA
            rules["kv_heads"] = INTRA
        return rules

    def param_spec(self, logical_axes) -> P:
        rules = self.logical_rules()
        return P(*(rules.get(name) if name else None for name in logical_axes))

    def batch_spec(self) -> P:
        """[batch, sequence] token arrays: batch over data; under the manual plan sequence over intra."""
        return P(DATA, INTRA if self.kind == "manual" else None)

    def batch_sharding(self, mesh: Mesh) -> NamedSharding:
        return NamedSharding(mesh, self.batch_spec())

    def param_shardings(self, logical_specs, mesh: Mesh):
        """Maps a pytree of logical PartitionSpecs (nnx.get_partition_spec) to NamedShardings."""
        return jax.tree.map(lambda spec: NamedSharding(mesh, self.param_spec(tuple(spec))), logical_specs,
                            is_leaf=lambda x: isinstance(x, P))
