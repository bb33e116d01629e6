"""Work tables of the grouped GEMM kernels: which rows each persistent work item covers. Plain jnp on short int32
vectors, computed on device before each launch and read by the kernels' persistent loops (and by sibling
kernels that run grouped GEMM tiles).
  * `group_bounds` / `cut_group_sizes` (rows of each group as the kernels count them), `prefix_sum` (a prefix sum
    XLA fuses with its neighbours);
  * `row_tile_table` (forward, input gradient: row tiles aligned to each group or to one grid, the zero tail
    after them), `token_block_table` (weight gradient: each group's token blocks).
The module is private (underscore); its names are not, because sibling kernels import them.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl


def group_bounds(group_sizes_G, m):
    """[start, end) rows of each group, cut at m as ragged_dot cuts them; a negative size (invalid input the
    kernels cannot reject, the sizes being traced) counts as 0, so no bound ever leaves [0, m]."""
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes_G.astype(jnp.int32), 0)), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return starts, ends


def prefix_sum(v_G):
    """Inclusive prefix sums of a short int32 vector as one masked sum over a [G, G] square: plain
    elementwise + reduce, which XLA fuses with the ops around it (jnp.cumsum is a scan of its own)."""
    j = jnp.arange(v_G.shape[0], dtype=jnp.int32)
    return jnp.sum(jnp.where(j[None, :] <= j[:, None], v_G[None, :], 0), axis=1, dtype=jnp.int32)


def _fused_group_bounds(group_sizes_G, m):
    """`group_bounds` with the prefix sum as `prefix_sum` (same values)."""
    sizes = jnp.maximum(group_sizes_G.astype(jnp.int32), 0)
    inclusive = prefix_sum(sizes)
    return jnp.minimum(inclusive - sizes, m), jnp.minimum(inclusive, m)


def cut_group_sizes(group_sizes_G, m, method: str = "fused"):
    """The group sizes as the kernels count them: a negative size as 0, the cumulative sizes cut at m."""
    starts, ends = (_fused_group_bounds if _table_method(method) == "fused" else group_bounds)(group_sizes_G, m)
    return ends - starts


TABLE_METHODS = ("scan", "fused")


def _table_method(method: str) -> str:
    if method not in TABLE_METHODS:
        raise ValueError(f"work table method must be one of {TABLE_METHODS}, got {method!r}")
    return method


ROW_TILE_ALIGNMENTS = ("group", "grid")
# A tile's first row is a multiple of this: the swizzled SMEM tiles are 8 rows tall, and Mosaic GPU slices the
# input only at whole SMEM tiles (an unaligned dynamic row offset fails its layout inference).
ROW_ALIGN = 8


def row_tile_table(group_sizes_G, m: int, tile: int, with_tail: bool = True, method: str = "fused",
                   align: str = "group"):
    """int32 [4, S]: for each (segment, row tile) work slot its segment, the tile's first row, the first row
    of the segment inside the tile and the segment's row count in it; and int32 [2], the numbers of compute
    slots and of zero-tail slots after them. Segment G is the tail past sum(group_sizes): it is stored as zeros.
    `align` says where a segment's tiles start: 'group' at its own first row rounded down to a multiple of
    ROW_ALIGN (cdiv(size + that remainder, tile) tiles; only the first and last can hold rows of the
    neighbours), 'grid' on one grid of tiles over all rows (a tile straddling a boundary is one slot per
    segment). Every tile starts at a multiple of ROW_ALIGN, and one that would run past row m starts at the
    last such row that keeps it inside (its segment's rows then start at lo > 0): so m must be a multiple of
    ROW_ALIGN and >= tile (the launcher pads its input to that). S = cdiv(m, tile) + G + 1 slots are allocated;
    the valid ones never exceed cdiv(m, tile) + G (brute-forced on small sizes; a group-aligned origin is never
    below the grid's). The kernel loops over the valid slots only, so spare ones cost nothing and do not
    unbalance the SMs.
    `method` only says how the same table is computed: 'scan' (jnp.cumsum + jnp.searchsorted, whose default
    method is a while loop of log2(G + 2) steps), 'fused' (the prefix sums and the slot -> segment search as
    masked sums over [G, G] and [S, G + 1] squares: elementwise + reduce, which XLA fuses into a few kernels)."""
    if align not in ROW_TILE_ALIGNMENTS:
        raise ValueError(f"row tile alignment must be one of {ROW_TILE_ALIGNMENTS}, got {align!r}")
    if m % ROW_ALIGN or m < tile or tile % ROW_ALIGN:
        raise ValueError(f"row_tile_table needs rows m={m} and tile={tile} to be multiples of {ROW_ALIGN} with "
                         "m >= tile; pad the rows (the grouped GEMM launcher does)")
    num_groups = group_sizes_G.shape[0]
    fused = _table_method(method) == "fused"
    starts, ends = (_fused_group_bounds if fused else group_bounds)(group_sizes_G, m)
    starts = jnp.concatenate([starts, ends[-1:]])
    ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
    origin = (starts // (ROW_ALIGN if align == "group" else tile)) * (ROW_ALIGN if align == "group" else tile)
    n_tiles = jnp.where(ends > starts, pl.cdiv(ends - origin, tile), 0)   # tile i starts at origin + i * tile
    inclusive = prefix_sum(n_tiles) if fused else jnp.cumsum(n_tiles)
    slot = jnp.arange(pl.cdiv(m, tile) + num_groups + 1, dtype=jnp.int32)
    if fused:   # searchsorted(side='right'): how many inclusive ends are <= slot
        seg = jnp.sum(inclusive[None, :] <= slot[:, None], axis=1, dtype=jnp.int32)
    else:
        seg = jnp.searchsorted(inclusive, slot, side="right").astype(jnp.int32)
    valid = seg <= num_groups
    seg = jnp.minimum(seg, num_groups)
    tile_start = origin[seg] + (slot - (inclusive[seg] - n_tiles[seg])) * tile
    row0 = jnp.minimum(tile_start, m - tile)      # a tile past row m slides back inside (m - tile is aligned)
    lo = jnp.maximum(starts[seg], tile_start) - row0
    count = jnp.where(valid, jnp.minimum(ends[seg], tile_start + tile) - jnp.maximum(starts[seg], tile_start), 0)
    table = jnp.stack([seg, jnp.where(valid, row0, 0), jnp.where(valid, lo, 0), count]).astype(jnp.int32)
    # Valid slots come first, the tail's last: [compute slots, tail slots] (no tail slots when with_tail is off).
    counts = jnp.stack([inclusive[-2], inclusive[-1] - inclusive[-2] if with_tail else jnp.int32(0)])
    return table, counts.astype(jnp.int32)


def token_block_table(group_sizes_G, m: int, tile: int, method: str = "fused"):
    """int32 [4, G]: each group's first token block, block count (at least 1, so an empty group still
    writes its zeros), and [start, end) rows — the rows outside are masked in the first/last block."""
    starts, ends = (_fused_group_bounds if _table_method(method) == "fused" else group_bounds)(group_sizes_G, m)
    first = starts // tile
    n_blocks = jnp.maximum(pl.cdiv(ends, tile) - first, 1)
    return jnp.stack([first, n_blocks, starts, ends]).astype(jnp.int32)
