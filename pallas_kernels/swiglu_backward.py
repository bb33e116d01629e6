"""SwiGLU's activation h = silu(gate) * up with its backward in one Pallas (Triton backend) pass:

    d_gate = dh * up * s * (1 + gate * (1 - s)),   d_up = dh * gate * s,   s = sigmoid(gate)

read once from (gate, up, dh) and written once, in float32 rounded once to the inputs' dtype.

Why a kernel: XLA:GPU emits autodiff's backward of silu(gate) * up as two fusions per layer, one per cotangent, and
both read dh and gate. H100 profile of deepseekmoe_small (benchmarks/results/train_step_custom_vjp_norm_swiglu_1xh100.json
and its step HLO): the d_gate fusion (reads dh, gate, up) and the d_up fusion (reads dh and gate again) of its two
MoE layers are the kernels loop_convert_fusion_3 (1.40 ms: one compiled kernel run for both layers' d_gate),
_4 and _5 (0.53 ms each), 2.46 ms a step; a hand-written `jax.custom_vjp` with the same expression gave the same
fusions. Five [M, F] passes instead of seven.

The forward stays XLA's (one fusion, at HBM speed). `swiglu_with_kernel_backward(gate, up)` is a custom VJP whose
plain twin is autodiff of `jax.nn.silu(gate) * up` (tests/kernels/test_swiglu_backward.py: interpret mode on the
CPU, compiled on the GPU). The arrays are viewed flat ([M * F], contiguous, so the reshape is free) and cut
into BLOCK-element programs; the last one is masked.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.varying import match_varying, output_struct, vary_like

__all__ = ["swiglu_with_kernel_backward", "swiglu_backward", "BLOCK", "NUM_WARPS", "MAX_ELEMENTS"]

BLOCK = 4096      # elements per program: 16 bf16 per thread of 8 warps, 8 KB of each input
NUM_WARPS = 8
MAX_ELEMENTS = 2 ** 31 - 1   # a call's element indices are int32; larger arrays run as row blocks


def _backward_kernel(gate_ref, up_ref, dh_ref, d_gate_ref, d_up_ref, *, block: int, n: int):
    idx = pl.program_id(0) * block + jnp.arange(block)
    mask = idx < n
    g = plgpu.load(gate_ref.at[idx], mask=mask, other=0.0).astype(jnp.float32)
    u = plgpu.load(up_ref.at[idx], mask=mask, other=0.0).astype(jnp.float32)
    d = plgpu.load(dh_ref.at[idx], mask=mask, other=0.0).astype(jnp.float32)
    s = 1.0 / (1.0 + jnp.exp(-g))
    plgpu.store(d_gate_ref.at[idx], (d * u * s * (1.0 + g * (1.0 - s))).astype(d_gate_ref.dtype), mask=mask)
    plgpu.store(d_up_ref.at[idx], (d * g * s).astype(d_up_ref.dtype), mask=mask)


def swiglu_backward(gate, up, dh, *, interpret: bool = False, block: int = BLOCK, num_warps: int = NUM_WARPS,
                    max_elements: int = MAX_ELEMENTS):
    """(d_gate, d_up) of h = silu(gate) * up for the cotangent dh; all three of one shape, the outputs in gate's and
    up's dtypes. `block` (a power of 2): elements per program. Past `max_elements` (int32 indices) the leading axis
    is cut into blocks of at most that many elements, one call each, joined again (a copy XLA may fold away)."""
    if gate.shape != up.shape or gate.shape != dh.shape:
        raise ValueError(f"swiglu_backward: gate {gate.shape}, up {up.shape} and dh {dh.shape} must be one shape")
    if block & (block - 1):
        raise ValueError(f"swiglu_backward: block={block} must be a power of 2 (Triton's block sizes)")
    n = math.prod(gate.shape)
    if n > max_elements:
        return _in_row_blocks(gate, up, dh, interpret=interpret, block=block, num_warps=num_warps,
                              max_elements=max_elements)
    if n == 0:
        return jnp.zeros_like(gate), jnp.zeros_like(up)
    flat = [vary_like(a.reshape(n), gate, up, dh) for a in (gate, up, dh)]
    d_gate, d_up = pl.pallas_call(
        functools.partial(_backward_kernel, block=block, n=n), grid=(pl.cdiv(n, block),),
        out_shape=[output_struct((n,), gate.dtype, *flat), output_struct((n,), up.dtype, *flat)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps), interpret=interpret,
        name="swiglu_backward")(*flat)
    return d_gate.reshape(gate.shape), d_up.reshape(up.shape)


def _in_row_blocks(gate, up, dh, *, max_elements: int, **kernel):
    row = math.prod(gate.shape[1:])
    rows = max_elements // row
    if gate.ndim < 2 or rows == 0:
        raise ValueError(f"swiglu_backward: {gate.shape} has more than {max_elements} elements (int32 indices) and "
                         f"no leading axis whose rows fit that: reshape it to [rows, columns]")
    parts = [swiglu_backward(*(a[i:i + rows] for a in (gate, up, dh)), max_elements=max_elements, **kernel)
             for i in range(0, gate.shape[0], rows)]
    return tuple(jnp.concatenate([p[j] for p in parts]) for j in range(2))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def swiglu_with_kernel_backward(gate, up, interpret: bool = False):
    """silu(gate) * up in the inputs' dtype (XLA's forward); the backward is `swiglu_backward`."""
    return jax.nn.silu(gate) * up


def _vjp_forward(gate, up, interpret):
    return swiglu_with_kernel_backward(gate, up, interpret), (gate, up)


def _vjp_backward(interpret, residuals, dh):
    gate, up = residuals
    d_gate, d_up = swiglu_backward(gate, up, dh.astype(gate.dtype), interpret=interpret)
    return match_varying(d_gate, gate, dh, up), match_varying(d_up, up, dh, gate)


swiglu_with_kernel_backward.defvjp(_vjp_forward, _vjp_backward)
