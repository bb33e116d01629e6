"""AdamW's update of one layer of a stacked parameter, in place, from that layer's own gradient: a Pallas
(Triton backend) kernel, plus `adamw_math`, the arithmetic it shares with its plain twin.

    adamw_layer_update(scalars, g_N, p_LN, m_LN, v_LN, copy_LN, layer=l)
        reads g (this layer's gradient, any float dtype) and row l of p / m / v; writes row l of p / m / v
        and of the parameter's compute-dtype copy; every other row is left as it was (the four stacked
        arrays are aliased to the outputs, so a chain of calls over l updates them in place).

Why: a fully unrolled layer stack's gradient arrives from autodiff as one piece per layer; for XLA's AdamW pass
they are first concatenated into the stacked [L, ...] array, a copy of every stacked gradient (on an H100 three
0.88 ms concatenations of deepseekmoe_small's expert weights per step, ~1.7 TB/s). Here each piece is read where it
is: one pass of 28 bytes a parameter (f32 p, m, v read and written, bf16 gradient and copy) instead of 32.

`scalars` is float32 [6]: the learning rate, Adam's two bias corrections 1 - b^t, the gradient's global norm,
the clipping threshold and whether to clip (1.0 / 0.0), computed once per step by the updater
(megascale_jax/updaters.py, LayerKernelAdamW). The arithmetic is optax.adamw's, in optax's order (`adamw_math`), so
the kernel equals the optax chain to float32 rounding (tests/kernels/test_adamw.py; on an H200 too).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.varying import output_struct, vary_like

__all__ = ["adamw_math", "clip_gradient", "adamw_layer_update", "adamw_layer_update_xla", "SCALARS", "BLOCK",
           "NUM_WARPS"]

SCALARS = ("lr", "bias1", "bias2", "norm", "max_norm", "clip")
BLOCK = 4096      # elements per program: 16 per thread of 8 warps, 16 KB of each float32 stream (its rows x
                  # columns: `_tile`)
NUM_WARPS = 8


def clip_gradient(g, norm, max_norm, clip):
    """optim.clip_by_norm's arithmetic: g scaled to max_norm where clipping is on and the norm reaches it."""
    return jnp.where((clip > 0) & (norm >= max_norm), (g / norm) * max_norm, g)


def adamw_math(p, g, m, v, lr, bias1, bias2, *, b1: float, b2: float, eps: float, weight_decay: float):
    """(p, m, v) after one AdamW step, all float32, in optax's order of operations (scale_by_adam,
    add_decayed_weights, scale_by_learning_rate, apply_updates); weight_decay 0.0 means none."""
    m = (1 - b1) * g + b1 * m
    v = (1 - b2) * (g * g) + b2 * v
    update = (m / bias1) / (jnp.sqrt(v / bias2) + eps)
    if weight_decay:
        update = update + weight_decay * p
    return p + (-lr) * update, m, v


def _tile(last: int, block: int) -> tuple[int, int]:
    """(rows, columns) of a program's tile of `block` elements over a last axis of `last`: the widest power-of-2
    column block that pads the axis by at most 1/8 (DeepSeekMoE's 1408 -> 3 x 512, not 2048 with 640 idle lanes),
    down to 128 columns; narrower axes take one block of their next power of 2."""
    cols = min(pl.next_power_of_2(last), block)
    while cols > 128 and pl.cdiv(last, cols) * cols * 8 > last * 9:
        cols //= 2
    return block // cols, cols


def _element_index(shape, block_rows: int, block_cols: int):
    """The indices of this program's [block_rows, block_cols] tile of an array of `shape` (one layer's row of the
    stack) seen as rows x its last axis, and the tile's in-bounds mask: each leading axis indexed by its own
    [rows, 1] array, the last one by a [1, cols] range (contiguous in memory, so Triton keeps wide loads)."""
    rows = pl.program_id(0) * block_rows + jnp.arange(block_rows)[:, None]
    cols = pl.program_id(1) * block_cols + jnp.arange(block_cols)[None, :]
    inside = (rows < math.prod(shape[:-1])) & (cols < shape[-1])
    leading, rest = [], rows
    for size in reversed(shape[:-1]):
        leading.insert(0, rest % size)
        rest = rest // size
    return (*leading, cols), inside


def _kernel(scalars_ref, g_ref, p_ref, m_ref, v_ref, *rest, layer: int, tile: tuple, with_copy: bool, hyper):
    p_out, m_out, v_out = rest[-4:-1] if with_copy else rest[-3:]
    c_out = rest[-1] if with_copy else None
    idx, inside = _element_index(g_ref.shape, *tile)
    row = (layer, *idx)
    lr, bias1, bias2, norm, max_norm, clip = (scalars_ref[i] for i in range(len(SCALARS)))
    g = plgpu.load(g_ref.at[idx], mask=inside, other=0.0).astype(jnp.float32)
    g = clip_gradient(g, norm, max_norm, clip)
    p = plgpu.load(p_ref.at[row], mask=inside, other=0.0)
    m = plgpu.load(m_ref.at[row], mask=inside, other=0.0).astype(jnp.float32)
    v = plgpu.load(v_ref.at[row], mask=inside, other=0.0).astype(jnp.float32)
    p, m, v = adamw_math(p, g, m, v, lr, bias1, bias2, **hyper)
    plgpu.store(p_out.at[row], p, mask=inside)
    plgpu.store(m_out.at[row], m.astype(m_out.dtype), mask=inside)
    plgpu.store(v_out.at[row], v.astype(v_out.dtype), mask=inside)
    if with_copy:
        plgpu.store(c_out.at[row], p.astype(c_out.dtype), mask=inside)


def adamw_layer_update(scalars, g, p, m, v, copy=None, *, layer: int, b1: float, b2: float, eps: float,
                       weight_decay: float, interpret: bool = False, block: int = BLOCK, num_warps: int = NUM_WARPS):
    """(p, m, v[, copy]) with row `layer` updated by one AdamW step from `g` (that row's gradient, shaped like
    it); the stacked arrays [L, ...] are aliased to the outputs. p float32; m / v float32 or bfloat16 (the
    update runs in float32 and rounds the stored moments once); copy: p's compute-dtype copy or None.

    The stacked arrays go to the kernel in their own shape, never reshaped: XLA inserts a copy at each end of an
    in-place call whose aliased operand is a reshape of a donated buffer (a compile of the train step on the CPU
    with an opaque aliased call in the kernel's place had 56 more full copies of the stacked p / m / v / copy
    with flattened operands, none without). So each program updates a [rows, columns] tile of the layer, seen
    as rows x its last axis; `block` elements a program."""
    if p.dtype != jnp.float32:
        raise ValueError(f"adamw_layer_update: parameters must be float32 (got {p.dtype}); the update is written "
                         f"for float32 masters with compute-dtype copies")
    stacked_like_p = m.shape == v.shape == p.shape and (copy is None or copy.shape == p.shape)
    if g.ndim < 1 or g.shape != p.shape[1:] or not stacked_like_p:
        raise ValueError(f"adamw_layer_update: gradient {g.shape} must be one row (at least 1-D) of the stacked "
                         f"parameter {p.shape}, moments {m.shape} / {v.shape} and copy "
                         f"{None if copy is None else copy.shape} shaped like it")
    if not 0 <= layer < p.shape[0]:
        raise ValueError(f"adamw_layer_update: layer {layer} outside the stack of {p.shape[0]}")
    if block & (block - 1):
        raise ValueError(f"adamw_layer_update: block={block} must be a power of 2 (Triton's block sizes)")
    stacked = [p, m, v] + ([] if copy is None else [copy])
    tile = _tile(g.shape[-1], block)
    operands = [scalars.astype(jnp.float32), g] + stacked
    operands = [vary_like(a, *operands) for a in operands]
    first_stacked = 2
    return tuple(pl.pallas_call(
        functools.partial(_kernel, layer=layer, tile=tile, with_copy=copy is not None,
                          hyper=dict(b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)),
        grid=(pl.cdiv(math.prod(g.shape[:-1]), tile[0]), pl.cdiv(g.shape[-1], tile[1])),
        out_shape=[output_struct(a.shape, a.dtype, *operands) for a in operands[first_stacked:]],
        input_output_aliases={first_stacked + i: i for i in range(len(stacked))},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps), interpret=interpret,
        name="adamw_layer_update")(*operands))


def adamw_layer_update_xla(scalars, g, p, m, v, copy=None, *, layer: int, b1: float, b2: float, eps: float,
                           weight_decay: float):
    """The plain twin of `adamw_layer_update` (same contract), in XLA: row `layer` read, updated, written back."""
    lr, bias1, bias2, norm, max_norm, clip = (scalars[i] for i in range(len(SCALARS)))
    g = clip_gradient(g.astype(jnp.float32), norm, max_norm, clip)
    new_p, new_m, new_v = adamw_math(p[layer], g, m[layer].astype(jnp.float32), v[layer].astype(jnp.float32), lr,
                                     bias1, bias2, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    out = (p.at[layer].set(new_p), m.at[layer].set(new_m.astype(m.dtype)), v.at[layer].set(new_v.astype(v.dtype)))
    return out + (() if copy is None else (copy.at[layer].set(new_p.astype(copy.dtype)),))
