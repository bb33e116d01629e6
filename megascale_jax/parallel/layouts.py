"""Layouts: where the model's communication goes, as three small strategies composed.

The model calls the same hooks in the same places under every plan; a Layout answers them:
  reductions  Reductions      token means / count sums: identity in the global (XLA) view, over the
                              (data, intra) axes when the step runs per device inside shard_map;
  attention   AttentionComm   LocalAttention | UlyssesAttention (SP: all-to-all sequence <-> heads around
                              the attention core; RingUlyssesAttention: those fused with the projections,
                              parallel/ring_attention.py) | MegatronAttention (TP: all-gather the sequence,
                              heads sharded in the weights, reduce-scatter the output projection);
  ffn         FFNDispatcher   LocalDispatch (the n = 1 sort) | AllToAllDispatch | AllGatherDispatch (EP:
                              whole experts per rank) | TensorParallelDispatch (TP: all-gather the
                              sequence, every expert's FFN width sharded, local sort, reduce-scatter).
`make_layout(plan, ...)` picks one of each. A new plan is one small class here, not a branch in every hook.
  block       None (autodiff) | MacroBlock (parallel.moe_layer='macro', parallel/overlap.py): the MoE block
              with its forward and backward written out over these same attention and ffn strategies.

Dispatcher contract (the seam the macro layer and the fused kernels build on):
    dispatch(x_TD, routing) -> (x_MD, group_sizes_G, residual)     rows sorted by (local) expert
    combine(y_MD, residual, weight_TK) -> y_TD                       weighted sum over k, in fp32
`residual` carries `dropped_tokens` and `tokens_per_expert`. `first_gemm_dispatch` / `last_gemm_combine`
default to dispatch-then-GEMM and GEMM-then-combine; a fused AG+GroupedGEMM or GroupedGEMM+RS kernel
overrides only the one that touches its GEMM. For the macro layer's hand-written backward a dispatcher also
answers as a plan and linear moves (parallel/token_routes.py): plan(idx_TK), send(x_TD, plan[, gradient]),
send_transpose(dx_MD, plan, T), combine_rows(y_MD, plan, weight_TK), weights_to_rows / rows_to_weights.

Every collective is called through parallel/collectives.py or parallel/expert_parallel.py; model code
calls none and opens no shard_map (the step does, parallel/plan.py names the axes).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
from jax import lax

from megascale_jax.parallel import collectives
from megascale_jax.parallel import expert_parallel as ep
from megascale_jax.parallel import token_routes as routes
from megascale_jax.parallel import ring_attention
from megascale_jax.parallel.expert_runs import DispatchExchange, ExpertRunsDispatch
from megascale_jax.parallel.overlap import MacroBlock
from megascale_jax.parallel.ring_dispatch import RingAllGatherDispatch
from megascale_jax.parallel.plan import (DATA, INTRA, AttentionPlan, DispatchDType, EPDispatch, FFNPlan, MoELayer,
                                         ParallelPlan, PlanKind)


def _varying(x, axes) -> tuple[str, ...]:
    """The mesh axes among `axes` along which x differs between devices (shard_map's vma type)."""
    vma = collectives.varying_axes(x)
    return tuple(a for a in axes if a in vma)


# ------------------------------------------------------------------------------------------ reductions
class Reductions(Protocol):
    def token_mean(self, x): """Mean over this device's tokens -> mean over the batch's tokens."""
    def batch_sum(self, counts): """Per-expert counts (already summed over the intra domain) -> batch sums."""
    def device_sum(self, x): """A per-device count -> the sum over all devices."""


@dataclasses.dataclass(frozen=True)
class GlobalReductions:
    """The global view (one device, or the XLA plan where the compiler partitions): already global."""

    def token_mean(self, x):
        return x

    def batch_sum(self, counts):
        return counts

    def device_sum(self, x):
        return x


@dataclasses.dataclass(frozen=True)
class DeviceReductions:
    """Per device inside shard_map over (data[, pipe], intra): every device returns the global value."""

    def token_mean(self, x):
        # Averaging over an axis x does not vary along is the identity (and an error for pmean under vma).
        return lax.pmean(x, _varying(x, (DATA, INTRA)))

    def batch_sum(self, counts):
        # Counts arrive already summed over the intra domain (the same on its n devices, but typed as
        # varying); pmax over intra makes them invariant without changing them, psum over data adds batches.
        counts = lax.pmax(counts, _varying(counts, (INTRA,)))
        return lax.psum(counts, _varying(counts, (DATA,)))

    def device_sum(self, x):
        return lax.psum(x, _varying(x, (DATA, INTRA)))


# ------------------------------------------------------------------------------------------ attention
class AttentionComm(Protocol):
    def attention_input(self, x_BSD): """The residual stream -> what the q/k/v projections read."""
    def positions(self, x_BSD): """Global token positions [B, S] of the rows the projections read."""
    def heads_in(self, q, k, v): """Projected q/k/v -> the layout the attention core runs on."""
    def heads_out(self, out): """The core's output -> the layout the output projection reads."""
    def proj_out(self, y_BSD): """The output projection -> the residual stream's layout."""
    def project_heads_in(self, x_BSD, project, w): """project(x, w, q_heads, kv_heads) -> q, k, v as the core reads."""
    def project_heads_out(self, out, project_out, wo): """project_out(o, wo, heads, dtype) of out -> residual layout."""


@dataclasses.dataclass(frozen=True)
class LocalAttention:
    def attention_input(self, x_BSD):
        return x_BSD

    def positions(self, x_BSD):
        batch, seq = x_BSD.shape[:2]
        return jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))

    def heads_in(self, q, k, v):
        return q, k, v

    def heads_out(self, out):
        return out

    def proj_out(self, y_BSD):
        return y_BSD

    # The hooks a fused GEMM+A2A / A2A+GEMM schedule overrides (parallel/ring_attention.py); unfused they are
    # the projections on all heads (head arguments None) and the moves above, in sequence.
    def project_heads_in(self, x_BSD, project, w):
        return self.heads_in(*project(x_BSD, w))

    def project_heads_out(self, out, project_out, wo):
        return self.proj_out(project_out(self.heads_out(out), wo))


@dataclasses.dataclass(frozen=True)
class UlyssesAttention(LocalAttention):
    """SP: the residual stream is sequence-sharded over `axis`; q/k/v go to head-sharded by all-to-all
    (k/v send each rank only the GQA kv heads its q heads use), the core sees the whole sequence, and the
    output comes back sequence-sharded. Attention weights are replicated."""
    num_heads: int = 0
    axis: str = INTRA

    def positions(self, x_BSD):
        batch, seq = x_BSD.shape[:2]
        offset = lax.axis_index(self.axis) * seq
        return jnp.broadcast_to(offset + jnp.arange(seq, dtype=jnp.int32), (batch, seq))

    def heads_in(self, q, k, v):
        return (collectives.seq_to_heads(q, self.axis), collectives.kv_seq_to_heads(k, self.axis, self.num_heads),
                collectives.kv_seq_to_heads(v, self.axis, self.num_heads))

    def heads_out(self, out):
        return collectives.heads_to_seq(out, self.axis)


@dataclasses.dataclass(frozen=True)
class RingUlyssesAttention(UlyssesAttention):
    """SP with the all-to-alls fused into the projections: GEMM+A2A and A2A+GEMM as n point-to-point steps,
    each projecting one peer rank's slice of heads (parallel/ring_attention.py); `exchange='mosaic'` runs each
    as one kernel: GEMM+A2A stores each tile into its destination (pallas_kernels/gemm_all_to_all.py), A2A+GEMM
    pushes the rows into the receivers while the GEMM sums the sources that arrived (all_to_all_gemm.py)."""
    exchange: str = ring_attention.AttentionExchange.RING

    def project_heads_in(self, x_BSD, project, w):
        return ring_attention.project_seq_to_heads_via(self.exchange, x_BSD, project, w, axis=self.axis,
                                                       num_heads=self.num_heads)

    def project_heads_out(self, out, project_out, wo):
        return ring_attention.project_heads_to_seq_via(self.exchange, out, project_out, wo, axis=self.axis)


@dataclasses.dataclass(frozen=True)
class MegatronAttention(LocalAttention):
    """TP with sequence parallelism: all-gather the sequence, heads sharded in the weights, reduce-scatter
    the output projection's partial sums back to sequence shards."""
    axis: str = INTRA

    def attention_input(self, x_BSD):
        return collectives.gather_seq(x_BSD, self.axis)

    def proj_out(self, y_BSD):
        return collectives.scatter_sum_seq(y_BSD, self.axis)


# ------------------------------------------------------------------------------------------ FFN dispatch
GemmFn = Callable[[jax.Array, jax.Array], jax.Array]   # (rows sorted by expert, group_sizes) -> rows


class FFNDispatcher(Protocol):
    def ffn_input(self, x_BSD): """The residual stream -> the tokens this device's FFN reads."""
    def ffn_output(self, y_BSD): """FFN output -> the residual stream's layout."""
    def dispatch(self, x_TD, routing) -> tuple[jax.Array, jax.Array, Any]: ...
    def combine(self, y_MD, residual, weight_TK) -> jax.Array: ...
    def first_gemm_dispatch(self, x_TD, routing, first_gemm: GemmFn): ...
    def last_gemm_combine(self, h_MF, group_sizes, residual, weight_TK, last_gemm: GemmFn): ...


@dataclasses.dataclass(frozen=True)
class LocalDispatch:
    """n = 1: sort the T*K assignments by expert on this device (capacity as the all_to_all at n = 1). In the
    global view, `capacity_groups` = the data-parallel size applies the capacity per device's tokens. `pallas_rows`
    (kernels.permute='pallas'): the local sort's row moves as Pallas kernels (parallel/permute.py): the gather into
    expert order and the weighted combine, forward and backward (the macro layer's hand-written send transpose stays
    XLA); the all_to_all dispatcher below uses them for its combine's weighted sum."""
    num_experts: int
    capacity_factor: float = 0.0
    capacity_groups: int = 1
    pallas_rows: bool = False

    def ffn_input(self, x_BSD):
        return x_BSD

    def ffn_output(self, y_BSD):
        return y_BSD

    def dispatch(self, x_TD, routing):
        num_tokens, top_k = routing.idx_TK.shape
        groups = self.capacity_groups
        capacity = (ep.rows_per_destination(num_tokens // groups, top_k, self.num_experts, 1, self.capacity_factor)
                    if self.capacity_factor else None)
        return ep.dispatch_local(x_TD, routing.idx_TK, num_experts=self.num_experts, capacity=capacity,
                                 groups=groups, pallas=self.pallas_rows)

    def combine(self, y_MD, residual, weight_TK):
        return ep.combine_local(y_MD, residual, weight_TK, self.pallas_rows)

    # The dispatch as a plan and linear moves (parallel/token_routes.py), for the macro layer's hand-written
    # backward: gradients travel along the forward's plan, each collective placed by parallel/overlap.py.
    def plan(self, idx_TK):
        num_tokens, top_k = idx_TK.shape
        capacity = (ep.rows_per_destination(num_tokens, top_k, self.num_experts, 1, self.capacity_factor)
                    if self.capacity_factor else None)
        return routes.plan_local(idx_TK, num_experts=self.num_experts, capacity=capacity)

    def send(self, x_TD, plan, *, gradient: bool = False):
        return routes.send_local(x_TD, plan, self.pallas_rows)

    def send_transpose(self, dx_MD, plan, num_tokens: int):
        return routes.send_local_transpose(dx_MD, plan, num_tokens)

    def combine_rows(self, y_MD, plan, weight_TK):
        return routes.combine_local(y_MD, plan, weight_TK, self.pallas_rows)

    def weights_to_rows(self, weight_TK, plan):
        return routes.assignments_to_rows_local(weight_TK.reshape(-1), plan)

    def rows_to_weights(self, s_M, plan, shape_TK):
        return routes.rows_to_assignments_local(s_M, plan).reshape(shape_TK)

    # The hooks a fused dispatch+GEMM kernel overrides; unfused they are the phases in sequence.
    def first_gemm_dispatch(self, x_TD, routing, first_gemm: GemmFn):
        """(first_gemm(x_MD, group_sizes), group_sizes, residual)."""
        with jax.named_scope("dispatch"):
            x_MD, group_sizes, residual = self.dispatch(x_TD, routing)
        with jax.named_scope("experts"):
            return first_gemm(x_MD, group_sizes), group_sizes, residual

    def last_gemm_combine(self, h_MF, group_sizes, residual, weight_TK, last_gemm: GemmFn):
        with jax.named_scope("experts"):
            y_MD = last_gemm(h_MF, group_sizes)
        with jax.named_scope("combine"):
            return self.combine(y_MD, residual, weight_TK)


@dataclasses.dataclass(frozen=True)
class TensorParallelDispatch(LocalDispatch):
    """TP FFN: every device holds all (gathered) tokens and an F/n slice of every expert (and of the shared
    and dense FFNs); the local sort runs on the gathered tokens, partial sums are reduce-scattered."""
    axis: str = INTRA

    def ffn_input(self, x_BSD):
        return collectives.gather_seq(x_BSD, self.axis)

    def ffn_output(self, y_BSD):
        return collectives.scatter_sum_seq(y_BSD, self.axis)


@dataclasses.dataclass(frozen=True)
class AllToAllDispatch(LocalDispatch):
    """EP by all-to-all: rows per destination rank in fixed buffers (dropless worst case, or capacity);
    `wire` = 'fp8' sends the payload as E4M3 with scales (parallel/fp8_exchange.py)."""
    axis: str = INTRA
    wire: str = DispatchDType.BF16

    def dispatch(self, x_TD, routing):
        num_tokens, top_k = routing.idx_TK.shape
        capacity = ep.rows_per_destination(num_tokens, top_k, self.num_experts, lax.axis_size(self.axis),
                                           self.capacity_factor or None)
        return ep.dispatch_all_to_all(x_TD, routing.idx_TK, axis=self.axis, num_experts=self.num_experts,
                                      capacity=capacity, wire=self.wire)

    def combine(self, y_MD, residual, weight_TK):
        return ep.combine_all_to_all(y_MD, residual, weight_TK, axis=self.axis, wire=self.wire,
                                     pallas=self.pallas_rows)

    def plan(self, idx_TK):
        num_tokens, top_k = idx_TK.shape
        capacity = ep.rows_per_destination(num_tokens, top_k, self.num_experts, lax.axis_size(self.axis),
                                           self.capacity_factor or None)
        return routes.plan_all_to_all(idx_TK, axis=self.axis, num_experts=self.num_experts, capacity=capacity)

    def send(self, x_TD, plan, *, gradient: bool = False):
        exchange = ep.gradient_exchange_for(self.wire) if gradient else ep.exchange_for(self.wire)
        return routes.send_all_to_all(x_TD, plan, axis=self.axis, exchange=exchange)

    def send_transpose(self, dx_MD, plan, num_tokens: int):
        return routes.send_all_to_all_transpose(dx_MD, plan, num_tokens, axis=self.axis,
                                                exchange=ep.gradient_exchange_for(self.wire))

    def combine_rows(self, y_MD, plan, weight_TK):
        return routes.combine_all_to_all(y_MD, plan, weight_TK, axis=self.axis, exchange=ep.exchange_for(self.wire),
                                         pallas=self.pallas_rows)

    def weights_to_rows(self, weight_TK, plan):
        return routes.assignments_to_rows_all_to_all(weight_TK.reshape(-1), plan, axis=self.axis)

    def rows_to_weights(self, s_M, plan, shape_TK):
        return routes.rows_to_assignments_all_to_all(s_M, plan, axis=self.axis).reshape(shape_TK)


@dataclasses.dataclass(frozen=True)
class AllGatherDispatch(LocalDispatch):
    """EP by all-gather + local scatter, back by local gather + reduce-scatter (better at large top-k)."""
    axis: str = INTRA

    def dispatch(self, x_TD, routing):
        return ep.dispatch_all_gather(x_TD, routing.idx_TK, axis=self.axis, num_experts=self.num_experts)

    def combine(self, y_MD, residual, weight_TK):
        return ep.combine_all_gather(y_MD, residual, weight_TK, axis=self.axis)

    def plan(self, idx_TK):
        return routes.plan_all_gather(idx_TK, axis=self.axis, num_experts=self.num_experts)

    def send(self, x_TD, plan, *, gradient: bool = False):
        return routes.send_all_gather(x_TD, plan, axis=self.axis)

    def send_transpose(self, dx_MD, plan, num_tokens: int):
        return routes.send_all_gather_transpose(dx_MD, plan, num_tokens, axis=self.axis)

    def combine_rows(self, y_MD, plan, weight_TK):
        return routes.combine_all_gather(y_MD, plan, weight_TK, axis=self.axis)

    def weights_to_rows(self, weight_TK, plan):
        return routes.assignments_to_rows_all_gather(weight_TK.reshape(-1), plan, axis=self.axis)

    def rows_to_weights(self, s_M, plan, shape_TK):
        num_tokens, top_k = shape_TK
        return routes.rows_to_assignments_all_gather(s_M, plan, num_tokens * top_k, axis=self.axis).reshape(shape_TK)


# ------------------------------------------------------------------------------------------ the layout
@dataclasses.dataclass(frozen=True)
class Layout:
    reductions: Reductions
    attention: AttentionComm
    ffn: FFNDispatcher
    block: Any = None    # the MoE block as one strategy (parallel/overlap.py MacroBlock); None = autodiff


def local_layout(num_experts: int, capacity_factor: float = 0.0) -> Layout:
    """One device (or the global view): no communication anywhere."""
    return Layout(GlobalReductions(), LocalAttention(), LocalDispatch(num_experts, capacity_factor))


def make_layout(plan: ParallelPlan, *, num_heads: int, num_experts: int, moe_layer: str = MoELayer.AUTODIFF,
                remat: str = "none", overlap_chunks: int = 1, attention_exchange: str = "ring",
                dispatch_exchange: str = "ring", pallas_rows: bool = False) -> Layout:
    """The layout `plan` calls for. Per device (manual plan or pipeline) reductions go over the mesh; the
    SP / TP / EP strategies exist only under the manual plan (under XLA the compiler communicates).
    moe_layer='macro' adds the macro block (parallel/overlap.py), which then owns the MoE blocks' remat;
    'fused' swaps the all_gather dispatcher for its ring schedule (parallel/ring_dispatch.py) and Ulysses SP
    attention for its fused GEMM+A2A / A2A+GEMM schedule (parallel/ring_attention.py; TP attention stays),
    whose GEMM+A2A moves its tiles as `attention_exchange` says (ring_attention.AttentionExchange), and the
    dispatch's rows as `dispatch_exchange` says (expert_runs.DispatchExchange: the ring, or (expert, source)
    runs in plain JAX or in the fused AG + grouped GEMM kernel)."""
    layout = _plain_layout(plan, num_heads=num_heads, num_experts=num_experts, pallas_rows=pallas_rows)
    if moe_layer == MoELayer.AUTODIFF:
        return layout
    if moe_layer == MoELayer.FUSED:
        if type(layout.ffn) is not AllGatherDispatch:
            raise ValueError("parallel.moe_layer='fused' tiles the all_gather dispatch into ring steps: set "
                             "parallel.ep_dispatch='all_gather' with the manual plan, ffn='ep' and intra > 1, "
                             "or moe_layer='autodiff'.")
        attention = layout.attention
        if type(attention) is UlyssesAttention:
            attention = RingUlyssesAttention(num_heads=attention.num_heads, axis=attention.axis,
                                             exchange=attention_exchange)
        ffn = (RingAllGatherDispatch(layout.ffn.num_experts) if dispatch_exchange == DispatchExchange.RING
               else ExpertRunsDispatch(layout.ffn.num_experts, exchange=dispatch_exchange))
        return dataclasses.replace(layout, attention=attention, ffn=ffn)
    if not plan.per_device or isinstance(layout.ffn, TensorParallelDispatch):
        raise ValueError(f"parallel.moe_layer='macro' writes out the per-device SP/TP-attention + EP-MoE block "
                         f"(plan={plan.kind}, ffn={plan.ffn}); use plan='manual' with ffn='ep', or moe_layer='autodiff'.")
    return dataclasses.replace(layout, block=MacroBlock(layout.attention, layout.ffn, layout.reductions,
                                                        remat=remat, chunks=overlap_chunks))


def _plain_layout(plan: ParallelPlan, *, num_heads: int, num_experts: int, pallas_rows: bool = False) -> Layout:
    reductions = DeviceReductions() if plan.per_device else GlobalReductions()
    if plan.kind != PlanKind.MANUAL or plan.intra == 1:
        groups = 1 if plan.per_device else plan.data   # the global view sees every data rank's tokens
        return Layout(reductions, LocalAttention(), LocalDispatch(num_experts, plan.capacity_factor, groups,
                                                                  pallas_rows))
    attention = (UlyssesAttention(num_heads=num_heads) if plan.attention == AttentionPlan.SP
                 else MegatronAttention())
    if plan.ffn == FFNPlan.TP:
        ffn = TensorParallelDispatch(num_experts, plan.capacity_factor, pallas_rows=pallas_rows)
    elif plan.dispatch == EPDispatch.ALL_GATHER:
        if pallas_rows:
            raise ValueError("config.kernels.permute='pallas' covers the local and all_to_all dispatches; this plan "
                             "uses the all_gather dispatch: set kernels.permute='xla' or 'auto', or "
                             "parallel.ep_dispatch='all_to_all'.")
        if plan.capacity_factor:
            raise ValueError(f"capacity_factor={plan.capacity_factor} applies to the all_to_all dispatch only; "
                             "all_gather is dropless: set config.model.moe.capacity_factor=0 or "
                             "config.parallel.ep_dispatch='all_to_all'.")
        ffn = AllGatherDispatch(num_experts)
    else:
        ffn = AllToAllDispatch(num_experts, plan.capacity_factor, pallas_rows=pallas_rows, wire=plan.dispatch_dtype)
    return Layout(reductions, attention, ffn)
