"""Pipeline layouts and schedules: which layers live on which stage, and what each stage runs when.

Layout. The model's L layers are cut, in order, into C = num_stages * virtual_stages chunks; chunk c
sits on stage c % S as virtual slot v = c // S. Stage parameters are stored in that layout, every leaf
shaped [V, S, Lmax, ...] (Lmax = most layers in any chunk) and sharded over the pipeline axis on dim 1,
so a step never reshuffles parameters. Chunks with fewer than Lmax layers are padded with zero
parameters that an `active` mask turns into identity layers; their gradients are exactly zero.

Schedules are static tick tables (numpy, built at trace time): for every clock tick t and stage s,
which forward (F) and which backward (B) work item that stage runs. Work items are (microbatch m,
chunk c); with virtual stages a device holds non-adjacent chunks (circular / interleaved placement).

Tick model: every tick each stage may run one F and one B, then activations move one stage down and
cotangents one stage up (a `ppermute` each way). Stages run in lock step (SPMD), so a tick costs the
most work any stage does in it. Packing one F and one B per tick keeps every stage equally busy in
the steady state (a tick of strictly alternating F/B would cost max(F, B) per half-tick); the price is
that an activation waits 2(S*V - 1) ticks between its F and its B on stage 0, so the stash peaks at
S*(V+1) - 1 stage inputs per device (2S - 1 for 1F1B) -- set by the stages, never by the microbatches.

Times, with the chunk-order index i(m, v) = m % S + S*v + S*V*(m // S):
    F(m, v, s) at tick  s + i(m, v)
    B(m, v, s) at tick  D + (S-1-s) + i(m, V-1-v)          (the mirror image of the forward)
GPipe waits for every forward (D = M*V + S - 1); 1F1B / interleaved start the backward as soon as the
first microbatch has left the last chunk (D = S*V - 1), which is what bounds the stash.
The last chunk's F and B fall on the same tick in 1F1B; the executor always runs the last chunk's
forward inside its backward (the loss and its cotangent need it there anyway).

Shape legend: V virtual slots per stage, S stages, M microbatches, C chunks, L layers, T ticks.
"""
from __future__ import annotations

import dataclasses
from enum import StrEnum

import jax
import jax.numpy as jnp
import numpy as np

class Schedule(StrEnum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"


SCHEDULES = tuple(s.value for s in Schedule)

# Per-tick, per-stage integer fields of a schedule table; slot fields hold a buffer row index, where
# the row one past the last real slot is a scratch ("trash") row written when there is nothing to keep.
TABLE_FIELDS = (
    "f_on", "f_mb", "f_virtual", "f_slot",            # forward: active?, microbatch, virtual slot, stash row
    "b_on", "b_mb", "b_virtual", "b_slot", "b_gslot",  # backward: ... stash row of the input, cotangent row
    "recv_act_slot",                                  # stash row for the activation arriving this tick
    "recv_grad_slot",                                 # cotangent row for the cotangent arriving this tick
)


def validate_schedule_args(schedule: str, num_stages: int, num_microbatches: int,
                           virtual_stages: int) -> None:
    """Raise ValueError naming the argument and the fix when the combination cannot be scheduled."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is unknown; use one of {SCHEDULES}.")
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches),
                        ("virtual_stages", virtual_stages)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer.")
    if schedule == "interleaved":
        if virtual_stages < 2:
            raise ValueError(f"schedule='interleaved' needs virtual_stages >= 2 (got {virtual_stages}); "
                             "use schedule='1f1b' for one chunk per stage.")
        if num_microbatches % num_stages:
            raise ValueError(
                f"schedule='interleaved' runs microbatches in groups of num_stages={num_stages}, so "
                f"num_microbatches={num_microbatches} must be a multiple of it; use e.g. "
                f"{num_stages * max(1, round(num_microbatches / num_stages))} microbatches.")
    elif virtual_stages != 1:
        raise ValueError(f"virtual_stages={virtual_stages} needs schedule='interleaved' "
                         f"(schedule={schedule!r} places one chunk per stage); pass virtual_stages=1.")


def bubble_fraction(schedule: str, num_stages: int, num_microbatches: int,
                    virtual_stages: int = 1) -> float:
    """Idle fraction of each stage's time, from the closed-form formulas (F and B cost the same).

    GPipe and 1F1B: (S-1) / (M+S-1). Interleaved with V chunks per stage: (S-1) / (V*M+S-1), i.e. the
    warm-up/cool-down shrinks V-fold because each tick moves a chunk, 1/V of a stage.
    """
    validate_schedule_args(schedule, num_stages, num_microbatches, virtual_stages)
    s, m, v = num_stages, num_microbatches, virtual_stages
    return (s - 1) / (v * m + s - 1)


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
    """A schedule's tick tables. `tables[name]` has shape [num_ticks, num_stages] (int32)."""
    name: str
    num_stages: int
    num_microbatches: int
    virtual_stages: int
    fwd_tick_MC: np.ndarray       # [M, C] tick of F(m, c)
    bwd_tick_MC: np.ndarray       # [M, C] tick of B(m, c)
    tables: dict                  # field name -> int32 [T, S]
    stash_slots: int              # stage-input rows each device keeps (peak over stages)
    grad_slots: int               # received-cotangent rows each device keeps (peak over stages)

    @property
    def num_ticks(self) -> int:
        return int(self.tables["f_on"].shape[0])

    def counted_bubble_fraction(self) -> np.ndarray:
        """Per-stage idle fraction counted from the tables: a tick lasts as long as the busiest stage's
        work in it (F and B one unit each, lock step); idle = makespan - own work. Shape [S]."""
        work_TS = self.tables["f_on"] + self.tables["b_on"]
        makespan = work_TS.max(axis=1).sum()
        return 1.0 - work_TS.sum(axis=0) / makespan


def build_schedule(schedule: str, num_stages: int, num_microbatches: int,
                   virtual_stages: int = 1) -> PipelineSchedule:
    """Build and self-check the tick tables of `schedule` (see the module docstring for the timing)."""
    validate_schedule_args(schedule, num_stages, num_microbatches, virtual_stages)
    S, M, V = num_stages, num_microbatches, virtual_stages
    C = S * V
    m_M = np.arange(M)[:, None]
    chunk_C = np.arange(C)[None, :]
    stage_C, virtual_C = chunk_C % S, chunk_C // S

    def chunk_order(m, v):
        return m % S + S * v + S * V * (m // S)

    delay = M * V + S - 1 if schedule == "gpipe" else S * V - 1
    fwd_MC = stage_C + chunk_order(m_M, virtual_C)
    bwd_MC = delay + (S - 1 - stage_C) + chunk_order(m_M, V - 1 - virtual_C)
    _check_dependencies(fwd_MC, bwd_MC, V)

    num_ticks = int(bwd_MC.max()) + 1
    stash_MC, stash_slots = _allocate_slots(
        alloc_MC=fwd_MC - 1, free_MC=bwd_MC, stage_C=stage_C[0], num_stages=S)
    grad_alloc_MC = np.full_like(bwd_MC, -2)   # the last chunk receives no cotangent: never allocated
    grad_alloc_MC[:, :-1] = bwd_MC[:, 1:]
    grad_MC, grad_slots = _allocate_slots(
        alloc_MC=grad_alloc_MC, free_MC=bwd_MC, stage_C=stage_C[0], num_stages=S)
    tables = _fill_tables(fwd_MC, bwd_MC, stash_MC, grad_MC, num_ticks, S, V,
                          trash_stash=stash_slots, trash_grad=grad_slots)
    return PipelineSchedule(schedule, S, M, V, fwd_MC, bwd_MC, tables, stash_slots, grad_slots)


def schedule_summary(schedule: str, num_stages: int, num_microbatches: int,
                     virtual_stages: int = 1) -> dict:
    """Plain numbers about a schedule, for benchmark JSON next to measured tokens/s."""
    sched = build_schedule(schedule, num_stages, num_microbatches, virtual_stages)
    return {"schedule": schedule, "num_stages": num_stages, "num_microbatches": num_microbatches,
            "virtual_stages": virtual_stages, "ticks": sched.num_ticks,
            "stash_rows_per_device": sched.stash_slots, "grad_rows_per_device": sched.grad_slots,
            "bubble_fraction_formula": bubble_fraction(schedule, num_stages, num_microbatches, virtual_stages),
            "bubble_fraction_counted": float(sched.counted_bubble_fraction().max())}


def _check_dependencies(fwd_MC: np.ndarray, bwd_MC: np.ndarray, virtual_stages: int) -> None:
    """Every F follows its upstream F, every B its downstream B, each by at least one tick (one hop);
    a chunk's B never precedes its F; a stage runs at most one F and one B per tick. A failure here is
    a bug in the timing formulas, not user error."""
    ok = (np.all(fwd_MC[:, 1:] >= fwd_MC[:, :-1] + 1)
          and np.all(bwd_MC[:, :-1] >= bwd_MC[:, 1:] + 1)
          and np.all(bwd_MC >= fwd_MC))
    # One F and one B per stage and tick; arrivals are then unique too (one sender per direction).
    S = fwd_MC.shape[1] // virtual_stages
    stage_MC = np.broadcast_to(np.arange(fwd_MC.shape[1]) % S, fwd_MC.shape)
    for tick_MC in (fwd_MC, bwd_MC):
        busy_TS = np.zeros((int(bwd_MC.max()) + 1, S), np.int64)
        np.add.at(busy_TS, (tick_MC, stage_MC), 1)
        ok = ok and busy_TS.max() <= 1
    if not ok:
        raise RuntimeError("pipeline schedule violates a data dependency (internal error)")


def _allocate_slots(alloc_MC, free_MC, stage_C, num_stages):
    """Give each (m, c) a buffer row on its stage, live from the end of tick alloc to the end of tick
    free (rows freed at a tick's end are reusable by arrivals at that same end). alloc == -2 means the
    item needs no row. Returns (slot_MC, rows needed = peak over stages)."""
    slot_MC = np.full(alloc_MC.shape, -1, dtype=np.int64)
    peak = 0
    for stage in range(num_stages):
        items = [(m, c) for m in range(alloc_MC.shape[0]) for c in np.flatnonzero(stage_C == stage)
                 if alloc_MC[m, c] != -2]
        events = sorted([(int(free_MC[i]), 0, i) for i in items] + [(int(alloc_MC[i]), 1, i) for i in items])
        free_rows, used = [], 0
        for _, is_alloc, item in events:
            if is_alloc:
                slot_MC[item] = free_rows.pop(0) if free_rows else used
                used = max(used, slot_MC[item] + 1)
            else:
                free_rows.append(int(slot_MC[item]))
                free_rows.sort()
        peak = max(peak, used)
    return slot_MC, int(peak)


def _fill_tables(fwd_MC, bwd_MC, stash_MC, grad_MC, num_ticks, S, V, trash_stash, trash_grad):
    tables = {name: np.zeros((num_ticks, S), np.int32) for name in TABLE_FIELDS}
    for name, trash in (("f_slot", trash_stash), ("b_slot", trash_stash), ("b_gslot", trash_grad),
                        ("recv_act_slot", trash_stash), ("recv_grad_slot", trash_grad)):
        tables[name][:] = trash
    M, C = fwd_MC.shape
    for m in range(M):
        for c in range(C):
            s, v = c % S, c // S
            tf, tb = fwd_MC[m, c], bwd_MC[m, c]
            _put(tables, tf, s, f_on=1, f_mb=m, f_virtual=v, f_slot=stash_MC[m, c])
            _put(tables, tb, s, b_on=1, b_mb=m, b_virtual=v, b_slot=stash_MC[m, c],
                 b_gslot=grad_MC[m, c] if c < C - 1 else trash_grad)
            if c > 0:   # the activation of (m, c) arrives from stage (c-1) % S at the end of its F tick
                _put(tables, fwd_MC[m, c - 1], s, recv_act_slot=stash_MC[m, c])
            if c < C - 1:   # the cotangent of (m, c)'s output arrives at the end of (m, c+1)'s B tick
                _put(tables, bwd_MC[m, c + 1], s, recv_grad_slot=grad_MC[m, c])
    return tables


def _put(tables, tick, stage, **values):
    for name, value in values.items():
        tables[name][tick, stage] = value


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """layers_per_chunk[c] layers go to chunk c (stage c % num_stages, virtual slot c // num_stages)."""
    num_stages: int
    virtual_stages: int
    layers_per_chunk: tuple[int, ...]

    def __post_init__(self):
        for name in ("num_stages", "virtual_stages"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"StageLayout {name}={value!r} must be a positive integer.")
        chunks = self.num_stages * self.virtual_stages
        if len(self.layers_per_chunk) != chunks:
            raise ValueError(
                f"layers_per_chunk has {len(self.layers_per_chunk)} entries but num_stages * "
                f"virtual_stages = {chunks}; give one layer count per chunk (chunk c = v*S + s).")
        if any(int(n) < 0 for n in self.layers_per_chunk) or sum(self.layers_per_chunk) < 1:
            raise ValueError(f"layers_per_chunk={self.layers_per_chunk} needs non-negative counts "
                             "and at least one layer in total.")

    @classmethod
    def balanced(cls, num_layers: int, num_stages: int, virtual_stages: int = 1) -> "StageLayout":
        """Split num_layers as evenly as possible; the first num_layers % C chunks get one extra layer
        (the last stage also runs the head, so it is the one to keep light)."""
        chunks = num_stages * virtual_stages
        if num_layers < chunks:
            raise ValueError(
                f"num_layers={num_layers} cannot fill num_stages * virtual_stages = {chunks} chunks; "
                "use fewer stages or virtual stages, or pass StageLayout(layers_per_chunk=...) with "
                "explicit zeros for layer-free chunks.")
        base, extra = divmod(num_layers, chunks)
        return cls(num_stages, virtual_stages, tuple(base + (c < extra) for c in range(chunks)))

    @property
    def num_layers(self) -> int:
        return int(sum(self.layers_per_chunk))

    @property
    def max_layers(self) -> int:
        return max(1, max(self.layers_per_chunk))

    def _layer_index_VSL(self) -> tuple[np.ndarray, np.ndarray]:
        """For each padded position, the global layer it holds, and whether it is a real layer."""
        V, S, Lmax = self.virtual_stages, self.num_stages, self.max_layers
        index_VSL = np.zeros((V, S, Lmax), np.int32)
        active_VSL = np.zeros((V, S, Lmax), bool)
        start = 0
        for c, count in enumerate(self.layers_per_chunk):
            v, s = divmod(c, S)
            index_VSL[v, s, :count] = np.arange(start, start + count)
            active_VSL[v, s, :count] = True
            start += count
        return index_VSL, active_VSL

    def active_mask(self) -> np.ndarray:
        """bool [V, S, Lmax]: True where a padded position holds a real layer."""
        return self._layer_index_VSL()[1]

    def to_stage_layout(self, layers_L):
        """Stacked layer params (leaves [L, ...]) -> stage layout (leaves [V, S, Lmax, ...], zero pads)."""
        index_VSL, active_VSL = self._layer_index_VSL()
        # Equal chunks in layer order are a plain reshape: with the layers sharded in blocks over the
        # pipeline axis (and one chunk per stage) every stage already holds its own layers, no gather.
        in_order = bool(active_VSL.all()) and np.array_equal(index_VSL.reshape(-1), np.arange(self.num_layers))

        def one(leaf):
            if leaf.shape[0] != self.num_layers:
                raise ValueError(f"a layer parameter has leading dim {leaf.shape[0]} but the layout "
                                 f"holds {self.num_layers} layers; stack one entry per layer.")
            if in_order:
                return leaf.reshape(index_VSL.shape + leaf.shape[1:])
            gathered = jnp.take(leaf, index_VSL, axis=0)
            keep = active_VSL.reshape(active_VSL.shape + (1,) * (leaf.ndim - 1))
            return jnp.where(keep, gathered, jnp.zeros((), leaf.dtype))
        return jax.tree.map(one, layers_L)

    def from_stage_layout(self, stages_VSL):
        """Inverse of to_stage_layout: leaves [V, S, Lmax, ...] -> [L, ...] (padding dropped; it holds
        only zeros, which tests check)."""
        index_VSL, active_VSL = self._layer_index_VSL()
        order = np.argsort(index_VSL[active_VSL], kind="stable")

        def one(leaf):
            return leaf[jnp.asarray(active_VSL)][order]
        return jax.tree.map(one, stages_VSL)
