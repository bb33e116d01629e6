"""The token dispatch's and combine's row moves as Pallas (Triton backend) kernels, one program per output row,
whole rows read and written in column chunks:

    gather_rows_sum(src_RD, idx_NK, weight_NK)   out[n] = sum_k weight[n, k] * src[idx[n, k]]  (float32 sum)
                                                 idx < 0 adds nothing and its row is never read
    combine_backward(y_RD, rows_NK, weight_NK, g_ND)
                                                 d_weight[n, k] = <y[rows[n, k]], g[n]>  (float32)
                                                 d_y[rows[n, k]] = weight[n, k] * g[n]   (rows a permutation)

Why: XLA's gathers of these rows ran at ~1.0-1.2 TB/s on an H100 (deepseekmoe_small's step, top-6: the dispatch's
gather 0.68 ms and the combine's weights gradient 0.84 ms per layer, each moving ~0.9 GB), a third of the HBM
speed, while each row here is 2-14 KB of contiguous bytes. parallel/permute.py's custom VJPs call these for
`kernels.permute='pallas'`; their XLA bodies are the plain twins (tests/kernels/test_row_gather.py).
Status: equal to the twins in the CPU interpreter and on an H200, but not faster in the step: in deepseekmoe_small's
H200 profile the row kernels took about what the XLA gathers and the fusions around them did (busy 178.2 vs 179.1 ms,
benchmarks/results/train_step_row_kernels_1xh200.json), so `kernels.permute='auto'` does not pick them.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.varying import output_struct, vary_like

__all__ = ["gather_rows_sum", "combine_backward", "BLOCK_D", "NUM_WARPS"]

BLOCK_D = 2048     # columns per step: 4 KB of a bf16 row, 16 per thread of 4 warps
NUM_WARPS = 4


def _block(d: int, block_d: int) -> int:
    if block_d & (block_d - 1):
        raise ValueError(f"row_gather: block_d={block_d} must be a power of 2 (Triton's block sizes)")
    return min(block_d, pl.next_power_of_2(d))


def _gather_sum_kernel(src_ref, idx_ref, *rest, top_k: int, block_d: int, weighted: bool):
    w_ref, out_ref = rest if weighted else (None, rest[0])
    n = pl.program_id(0)
    d = src_ref.shape[1]
    rows = [idx_ref[n, k] for k in range(top_k)]
    weights = [w_ref[n, k].astype(jnp.float32) for k in range(top_k)] if weighted else None

    @pl.loop(0, pl.cdiv(d, block_d))
    def _(j):
        cols = j * block_d + jnp.arange(block_d)
        in_row = cols < d
        acc = jnp.zeros((block_d,), jnp.float32)
        for k in range(top_k):
            x = plgpu.load(src_ref.at[jnp.maximum(rows[k], 0), cols], mask=in_row & (rows[k] >= 0),
                           other=0.0).astype(jnp.float32)
            acc = acc + (x * weights[k] if weighted else x)
        plgpu.store(out_ref.at[n, cols], acc.astype(out_ref.dtype), mask=in_row)


def gather_rows_sum(src_RD, idx_NK, weight_NK=None, out_dtype=None, *, interpret: bool = False,
                    block_d: int = BLOCK_D, num_warps: int = NUM_WARPS):
    """[N, D] in `out_dtype` (default src's): out[n] = sum_k weight[n, k] * src[idx[n, k]], summed in float32,
    weight 1 where `weight_NK` is None; an idx < 0 adds nothing (its row, junk or NaN, is not read)."""
    n, top_k = idx_NK.shape
    d = src_RD.shape[1]
    operands = [src_RD, idx_NK.astype(jnp.int32)] + ([] if weight_NK is None else [weight_NK])
    operands = [vary_like(a, *operands) for a in operands]
    return pl.pallas_call(
        functools.partial(_gather_sum_kernel, top_k=top_k, block_d=_block(d, block_d),
                          weighted=weight_NK is not None),
        grid=(n,), out_shape=output_struct((n, d), out_dtype or src_RD.dtype, *operands),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps), interpret=interpret,
        name="gather_rows_sum")(*operands)


def _combine_backward_kernel(y_ref, rows_ref, w_ref, g_ref, d_y_ref, d_w_ref, *, top_k: int, block_d: int):
    n = pl.program_id(0)
    d = y_ref.shape[1]
    rows = [rows_ref[n, k] for k in range(top_k)]
    weights = [w_ref[n, k].astype(jnp.float32) for k in range(top_k)]

    def body(j, dots):
        cols = j * block_d + jnp.arange(block_d)
        in_row = cols < d
        g = plgpu.load(g_ref.at[n, cols], mask=in_row, other=0.0).astype(jnp.float32)
        new = []
        for k in range(top_k):
            y = plgpu.load(y_ref.at[rows[k], cols], mask=in_row, other=0.0).astype(jnp.float32)
            new.append(dots[k] + jnp.sum(y * g))
            plgpu.store(d_y_ref.at[rows[k], cols], (weights[k] * g).astype(d_y_ref.dtype), mask=in_row)
        return tuple(new)

    dots = jax.lax.fori_loop(0, pl.cdiv(d, block_d), body, tuple(jnp.float32(0.0) for _ in range(top_k)))
    for k in range(top_k):
        d_w_ref[n, k] = dots[k]


def combine_backward(y_RD, rows_NK, weight_NK, g_ND, *, interpret: bool = False, block_d: int = BLOCK_D,
                     num_warps: int = NUM_WARPS):
    """The weighted combine's backward in one pass per token: (d_y [R, D] in y's dtype, d_weight [N, K] float32)
    with d_weight[n, k] = <y[rows[n, k]], g[n]> and d_y[rows[n, k]] = weight[n, k] * g[n]. `rows` must be a
    permutation of y's R = N*K rows (each written exactly once); a dropped assignment carries weight 0 (its row
    gets zeros; its d_weight is whatever the dot gives, for the caller to mask)."""
    n, top_k = rows_NK.shape
    r, d = y_RD.shape
    if r != n * top_k:
        raise ValueError(f"combine_backward: rows_NK {rows_NK.shape} must permute y's {r} rows")
    operands = [y_RD, rows_NK.astype(jnp.int32), weight_NK, g_ND]
    operands = [vary_like(a, *operands) for a in operands]
    return pl.pallas_call(
        functools.partial(_combine_backward_kernel, top_k=top_k, block_d=_block(d, block_d)), grid=(n,),
        out_shape=[output_struct((r, d), y_RD.dtype, *operands), output_struct((n, top_k), jnp.float32, *operands)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps), interpret=interpret,
        name="combine_backward")(*operands)
