"""Routed experts: SwiGLU FFNs as grouped GEMMs over rows sorted by expert, a pure function of explicit weights.

    swiglu_experts(x_MD, weights, group_sizes, gemm) = down(silu(x @ gate_e) * (x @ up_e))  per row group e

The weights are arguments, not closed over, so a hand-written backward (`jax.custom_vjp`, the macro
layer) can differentiate them, and a dispatcher can take the first (`expert_hidden`) or last
(`expert_output`) GEMM into a fused communication kernel.

`gemm` is one resolved implementation (`resolve_grouped_gemm`, chosen once when the model is built):
  xla     `jax.lax.ragged_dot` (on GPU a dense masked GEMM, ~97 TFLOP/s at the Mixtral shape on an H200;
          the reference everywhere);
  pallas  our Mosaic GPU kernel (pallas_kernels/grouped_gemm.py), same semantics.
`swiglu` says how the first GEMMs and the activation run (`resolve_swiglu`, also once):
  separate  two `gemm` calls, then silu(gate) * up (the twin; XLA fuses the activation into one pass);
  fused     pallas_kernels/grouped_swiglu.py: both GEMMs and the activation in one kernel (no pass that
            reads the two products back); its backward is the separate form's.
  separate_pallas_bwd  as separate, with the activation's backward in one Pallas pass
            (pallas_kernels/swiglu_backward.py) where XLA makes two that each read dh and gate.
"""
from __future__ import annotations

import dataclasses
from enum import StrEnum
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from pallas_kernels.varying import vary_like

from megascale_jax.model.layers import param, swiglu_activation


class GroupedGemmImpl(StrEnum):
    XLA = "xla"
    PALLAS = "pallas"
    AUTO = "auto"   # resolved at build time: pallas on GPU where the kernel takes the operands, else xla


GroupedGemm = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]   # (x_MK, w_GKN, group_sizes_G) -> y_MN


def resolve_grouped_gemm(choice: str, *, backend: str, dtype, dim: int, ffn: int, rows: int = 128) -> str:
    """`auto` -> 'pallas' on GPU when the kernel takes both expert GEMM shapes ([M, D] x [G, D, F] and
    [M, F] x [G, F, D]) in `dtype`, judged by the kernel's own `unsupported_reason` on abstract operands;
    else 'xla'. `ffn` is the per-device expert width (F / n under TP experts)."""
    if choice != GroupedGemmImpl.AUTO:
        return GroupedGemmImpl(choice).value
    if backend != "gpu":
        return GroupedGemmImpl.XLA.value
    from pallas_kernels.grouped_gemm import unsupported_reason

    def shape(*dims):
        return jax.ShapeDtypeStruct(dims, dtype)

    reasons = (unsupported_reason(shape(rows, dim), shape(1, dim, ffn)),
               unsupported_reason(shape(rows, ffn), shape(1, ffn, dim)))
    return (GroupedGemmImpl.PALLAS if all(r is None for r in reasons) else GroupedGemmImpl.XLA).value


class GroupedGemmTail(StrEnum):
    """Who zeroes the rows past sum(group_sizes) of the pallas kernel's outputs (GroupedGemmTuning.zero_tail).
    An expert-parallel receive buffer is mostly such rows (Mixtral EP8: 75%, Qwen3-30B-A3B EP8: 87.5%); there
    'mask' (the kernel skips them, a select that XLA fuses into the consumer zeroes them) ran the expert FFN
    fwd+bwd 1.035x / 1.235x faster than 'kernel' (tail tiles store zeros), gradients identical
    (benchmarks/results/probe_tail_in_ffn_h200.json). With no tail (one expert-parallel rank) they do the
    same kernel work and 'mask' adds a select, so `auto` keeps 'kernel' there. Kernels that run expert GEMMs
    with their own tiles keep writing the tail: the fused grouped_swiglu (kernels.swiglu='fused') and, with
    parallel.dispatch_exchange='mosaic', all_gather_grouped_gemm (gate GEMM) and grouped_gemm_reduce_scatter
    (down GEMM), whose backwards call dgrad / wgrad with their default tuning."""
    KERNEL = "kernel"
    MASK = "mask"
    AUTO = "auto"   # resolved at build time: mask for the pallas kernel on an expert-parallel plan, else kernel


def resolve_grouped_gemm_tail(choice: str, *, grouped_gemm: str, expert_parallel: bool) -> str:
    """`auto` -> 'mask' where the pallas kernel runs on receive buffers with a tail (`expert_parallel`: experts
    split over more than one rank), else 'kernel'. 'mask' with the xla implementation is an error: ragged_dot
    has no tail tiles to skip."""
    if choice == GroupedGemmTail.AUTO:
        return (GroupedGemmTail.MASK if grouped_gemm == GroupedGemmImpl.PALLAS and expert_parallel
                else GroupedGemmTail.KERNEL).value
    if choice == GroupedGemmTail.MASK and grouped_gemm != GroupedGemmImpl.PALLAS:
        raise ValueError(f"config.kernels.grouped_gemm_tail='mask' is an option of the pallas grouped GEMM and "
                         f"kernels.grouped_gemm resolved to {grouped_gemm!r}; use 'kernel' or 'auto'")
    return GroupedGemmTail(choice).value


def _pallas_tuning(zero_tail: str, m: int, k: int, n: int, g: int):
    """The kernel's default tiles for this shape with the resolved tail choice."""
    from pallas_kernels.grouped_gemm import default_tuning

    return dataclasses.replace(default_tuning(m, k, n, g), zero_tail=zero_tail)


def grouped_gemm_fn(implementation: str, zero_tail: str = GroupedGemmTail.KERNEL) -> GroupedGemm:
    """The function for a resolved implementation name (and, for pallas, a resolved GroupedGemmTail)."""
    if implementation == GroupedGemmImpl.XLA:
        return jax.lax.ragged_dot
    if implementation == GroupedGemmImpl.PALLAS:
        from pallas_kernels.grouped_gemm import grouped_gemm

        def pallas(x, w, group_sizes):
            tuning = _pallas_tuning(zero_tail, x.shape[0], x.shape[1], w.shape[2], w.shape[0])
            return grouped_gemm(x, w, group_sizes, tuning=tuning)
        return pallas
    raise ValueError(f"grouped GEMM implementation {implementation!r} is not resolved; choose one of "
                     f"xla, pallas (config.kernels.grouped_gemm; 'auto' is resolved by resolve_grouped_gemm).")


class SwigluImpl(StrEnum):
    """'auto' picks separate_pallas_bwd where it can run (a GPU, a per-device step or one device) and, for the experts,
    where their GEMMs' outputs are not masked (GroupedGemmTail.MASK: XLA would have to write the masked gate and up
    out for the kernel, the two passes it saves; the dense SwiGLUs keep it: resolve_dense_swiglu), else 'separate'.
    The kernel backward reads and writes each array once, at ~3.0 TB/s on an H100 where XLA's two backward fusions
    per activation took 4.9 ms of deepseekmoe_small's step against the kernels' 3.6 (benchmarks/results/train_step_swiglu_kernel_bwd_1xh100.json); the Mixtral block 35.64 vs 35.93 ms.
    'fused' is never picked: on the H200 it has not beaten the separate form (bench_grouped_swiglu_h200.json:
    Mixtral forward 6.13 vs 6.18 ms at its best tiles, fwd+bwd slower; the block 36.87 vs 36.39 ms)."""
    SEPARATE = "separate"
    FUSED = "fused"
    SEPARATE_PALLAS_BWD = "separate_pallas_bwd"
    AUTO = "auto"


def swiglu_unsupported_reason(choice: str, *, backend: str, partitioned_by_xla: bool, grouped_gemm: str, ffn: int,
                              remat: str, macro_layer: bool) -> str | None:
    """Why `choice` (a SwigluImpl) cannot (or should not) run for this model, or None. The fused op is one custom
    VJP: under a remat policy that keeps the GEMM outputs by name ('selective') it would be rerun whole (its GEMMs
    too) to get h back, and the macro layer writes its own backward from the separate calls. The kernel backward
    ('separate_pallas_bwd') runs there too: the macro layer takes the activation's pullback from
    MoEBlockMath.activation, which is layers.swiglu_activation. Both are per-device kernels: where the XLA
    compiler partitions the step over several devices (`partitioned_by_xla`) it would gather their operands
    whole."""
    if choice == SwigluImpl.SEPARATE:
        return None
    if backend != "gpu":
        return f"it is a GPU kernel and the backend is {backend!r}"
    if partitioned_by_xla:
        return "it is a per-device kernel and the XLA plan partitions the step over several devices"
    if choice == SwigluImpl.SEPARATE_PALLAS_BWD:
        return None
    if macro_layer:
        return "parallel.moe_layer='macro' writes the expert backward from the separate GEMM calls"
    if grouped_gemm != GroupedGemmImpl.PALLAS:
        return f"it is a Mosaic GPU kernel beside the pallas grouped GEMM, and kernels.grouped_gemm is {grouped_gemm!r}"
    if ffn % 128:
        return f"its tiles are 128 FFN columns wide and the per-device expert FFN is {ffn}"
    if remat == "selective":
        return "train.remat='selective' keeps the two GEMM outputs by name, which the fused op does not expose"
    return None


def resolve_swiglu(choice: str, *, grouped_gemm_tail: str = GroupedGemmTail.KERNEL, **why) -> str:
    """The choice, checked: one for which `swiglu_unsupported_reason(choice, **why)` names a reason is an error;
    'auto' as SwigluImpl says (`grouped_gemm_tail`: the resolved GroupedGemmTail)."""
    choice = SwigluImpl(choice)
    if choice == SwigluImpl.AUTO:
        kernel = SwigluImpl.SEPARATE_PALLAS_BWD
        runs = swiglu_unsupported_reason(kernel, **why) is None and grouped_gemm_tail != GroupedGemmTail.MASK
        return (kernel if runs else SwigluImpl.SEPARATE).value
    reason = swiglu_unsupported_reason(choice, **why)
    if reason:
        raise ValueError(f"config.kernels.swiglu={choice.value!r} cannot run here: {reason}; use 'separate'")
    return SwigluImpl(choice).value


def resolve_dense_swiglu(choice: str, **why) -> str:
    """The dense SwiGLUs' form (dense layers, shared experts) for kernels.swiglu=`choice` (checked by resolve_swiglu):
    the kernel backward for 'separate_pallas_bwd', and for 'auto' wherever it can run (a masked expert tail does not
    concern them); else 'separate' ('fused' is the experts' kernel)."""
    choice, kernel = SwigluImpl(choice), SwigluImpl.SEPARATE_PALLAS_BWD
    if choice == kernel or (choice == SwigluImpl.AUTO and swiglu_unsupported_reason(kernel, **why) is None):
        return kernel.value
    return SwigluImpl.SEPARATE.value


GemmGrad = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def grouped_gemm_grads(implementation: str, zero_tail: str = GroupedGemmTail.KERNEL) -> tuple[GemmGrad, GemmGrad]:
    """The backward of `grouped_gemm_fn(implementation)` as two separate calls, so a hand-written backward can
    put communication between them (parallel/overlap.py):
        dgrad(dy_MN, w_GKN, group_sizes_G) -> dx_MK     in dy's dtype
        wgrad(x_MK, dy_MN, group_sizes_G)  -> dw_GKN    in x's dtype
    xla: the transposes of `lax.ragged_dot` that autodiff uses; pallas: the kernel's own dgrad / wgrad entry
    points (the ones its custom VJP calls)."""
    if implementation == GroupedGemmImpl.XLA:
        # The pullback at a zero point (the product is linear; its unused forward is dead code), typed like the
        # cotangent inside shard_map so the transpose adds nothing over mesh axes: the caller types the result.
        def dgrad(dy_MN, w_GKN, group_sizes_G):
            x_MK = vary_like(jnp.zeros((dy_MN.shape[0], w_GKN.shape[1]), dy_MN.dtype), dy_MN, w_GKN)
            return jax.vjp(lambda x: jax.lax.ragged_dot(x, w_GKN, group_sizes_G), x_MK)[1](dy_MN)[0]

        def wgrad(x_MK, dy_MN, group_sizes_G):
            w_GKN = vary_like(jnp.zeros((group_sizes_G.shape[0], x_MK.shape[1], dy_MN.shape[1]), x_MK.dtype),
                              x_MK, dy_MN)
            return jax.vjp(lambda w: jax.lax.ragged_dot(x_MK, w, group_sizes_G), w_GKN)[1](dy_MN)[0]
        return dgrad, wgrad
    if implementation == GroupedGemmImpl.PALLAS:
        from pallas_kernels.grouped_gemm import grouped_gemm_dgrad, grouped_gemm_wgrad

        from pallas_kernels.grouped_gemm import default_kernel_tuning

        def dgrad(dy_MN, w_GKN, group_sizes_G):   # dgrad's own default tiles (as with tuning=None), the tail choice
            (g, k, n), m = w_GKN.shape, dy_MN.shape[0]
            tuning = dataclasses.replace(default_kernel_tuning("dgrad", k, n, m, g), zero_tail=zero_tail)
            return grouped_gemm_dgrad(dy_MN.astype(w_GKN.dtype), w_GKN, group_sizes_G,
                                      preferred_element_type=dy_MN.dtype, tuning=tuning)
        # the weight gradient has no tail (it reads only the groups' rows): its default tuning whatever zero_tail
        return (dgrad, lambda x, dy, gs: grouped_gemm_wgrad(x, dy.astype(x.dtype), gs, preferred_element_type=x.dtype))
    raise ValueError(f"grouped GEMM implementation {implementation!r} is not resolved; choose one of xla, pallas.")


class ExpertWeights(NamedTuple):
    gate_EDF: jax.Array
    up_EDF: jax.Array
    down_EFD: jax.Array


def expert_hidden(x_MD, weights: ExpertWeights, group_sizes_E, gemm: GroupedGemm, swiglu: str = "separate"):
    """The first expert GEMMs and the activation: silu(x @ gate_e) * (x @ up_e); `swiglu` a resolved
    SwigluImpl ('fused': one kernel, `gemm` unused)."""
    dt = x_MD.dtype
    if swiglu == SwigluImpl.FUSED:
        from pallas_kernels.grouped_swiglu import grouped_swiglu

        return grouped_swiglu(x_MD, weights.gate_EDF.astype(dt), weights.up_EDF.astype(dt), group_sizes_E)
    # Named for the selective remat policy (model/transformer.py): GEMM outputs are kept, the activation is not.
    gate = checkpoint_name(gemm(x_MD, weights.gate_EDF.astype(dt), group_sizes_E), "expert_gate")
    up = checkpoint_name(gemm(x_MD, weights.up_EDF.astype(dt), group_sizes_E), "expert_up")
    return swiglu_activation(gate, up, kernel_backward(swiglu))


def kernel_backward(swiglu: str) -> bool:
    """Whether the resolved SwigluImpl runs the activation's backward as the Pallas pass (layers.swiglu_activation)."""
    return swiglu == SwigluImpl.SEPARATE_PALLAS_BWD


@dataclasses.dataclass(frozen=True)
class FirstExpertGemms:
    """The experts' first GEMMs and activation as a dispatcher receives them: called as (x_MD, group_sizes) ->
    h_MF, or finished from the gate product by a dispatcher whose kernel computed it together with the
    exchange (pallas_kernels/all_gather_grouped_gemm.py): `from_gate(x_MD, gate_MF, group_sizes)`."""
    weights: ExpertWeights
    gemm: GroupedGemm
    swiglu: str = "separate"

    def __call__(self, x_MD, group_sizes_E):
        return expert_hidden(x_MD, self.weights, group_sizes_E, self.gemm, self.swiglu)

    def from_gate(self, x_MD, gate_MF, group_sizes_E):
        gate = checkpoint_name(gate_MF, "expert_gate")
        up = checkpoint_name(self.gemm(x_MD, self.weights.up_EDF.astype(x_MD.dtype), group_sizes_E), "expert_up")
        return swiglu_activation(gate, up, kernel_backward(self.swiglu))


@dataclasses.dataclass(frozen=True)
class LastExpertGemm:
    """The experts' last GEMM as a dispatcher receives it: called as (h_MF, group_sizes) -> y_MD; a dispatcher
    whose kernel runs it together with the way back (pallas_kernels/grouped_gemm_reduce_scatter.py) reads
    `weights` and names that kernel's output with `named`."""
    weights: ExpertWeights
    gemm: GroupedGemm

    def __call__(self, h_MF, group_sizes_E):
        return expert_output(h_MF, self.weights, group_sizes_E, self.gemm)

    @staticmethod
    def named(y):
        return checkpoint_name(y, "expert_out")


def expert_output(h_MF, weights: ExpertWeights, group_sizes_E, gemm: GroupedGemm):
    """The last expert GEMM: h @ down_e."""
    out = gemm(h_MF, weights.down_EFD.astype(h_MF.dtype), group_sizes_E)
    return checkpoint_name(out, "expert_out")


def swiglu_experts(x_MD, weights: ExpertWeights, group_sizes_E, gemm: GroupedGemm, swiglu: str = "separate"):
    """Rows of x sorted by (local) expert; `group_sizes` has one entry per expert held here; rows past
    sum(group_sizes) come out as zeros (xla) or unspecified (pallas) and are ignored by every combine."""
    h_MF = expert_hidden(x_MD, weights, group_sizes_E, gemm, swiglu)
    return expert_output(h_MF, weights, group_sizes_E, gemm)


class SwiGLUExperts(nnx.Module):
    """The E experts' parameters; under EP a rank holds E/n of them, under TP an F/n slice of each."""

    def __init__(self, num_experts: int, dim: int, ffn: int, param_dtype, rngs: nnx.Rngs):
        # Fan-in: the contracted dim of each expert's matmul, D for gate/up and F for down; never the expert
        # axis E, which is batched over, not contracted.
        self.w_gate_EDF = param(rngs, (num_experts, dim, ffn), ("experts", "embed", "expert_ffn"), param_dtype,
                                fan_in_axes=(1,))
        self.w_up_EDF = param(rngs, (num_experts, dim, ffn), ("experts", "embed", "expert_ffn"), param_dtype,
                              fan_in_axes=(1,))
        self.w_down_EFD = param(rngs, (num_experts, ffn, dim), ("experts", "expert_ffn", "embed"), param_dtype,
                                fan_in_axes=(1,))

    def weights(self) -> ExpertWeights:
        return ExpertWeights(self.w_gate_EDF[...], self.w_up_EDF[...], self.w_down_EFD[...])
