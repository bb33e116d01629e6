"""Tables of the fused expert-parallel dispatch (AG + scatter + grouped GEMM): where each source rank's rows land
in a receiver's buffer, where a sender finds and puts them, and which sources each grouped-GEMM work item waits for.

A receiver keeps its rows in (local expert, source rank) order: expert e's rows are one group of the grouped
GEMM (its weights read once for all sources), and inside the group the sources follow one another, so a row
tile of the group depends on the one or two sources whose runs it covers, not on all of them. Everything here
is plain jnp on small int32 tables, computed on every rank from the all-gathered routing counts
counts_SPG[s, p, e] (rows of source s routed to local expert e of rank p) before the kernel runs:
  * `receive_layout(counts_SG)`: a receiver's group sizes and the first row of each (source, expert) run;
  * `send_runs(counts_SPG, rank)`: for a sender, each (destination, expert) run's first row in its own
    (destination, expert)-sorted send buffer and in the destination's receive buffer;
  * `receive_work(counts_SPG, rank, ...)`: the three above as a receiver's grouped GEMM runs on them;
  * `tile_sources(...)`: for each work slot of `row_tile_table` over the receive buffer, the range of sources
    whose rows it stores (the sources the slot must wait for).
The kernel that consumes them is all_gather_grouped_gemm.py; parallel/expert_runs.py moves rows in the same
layout in plain JAX. The tables are tested against a numpy reading of the layout.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._work_tables import prefix_sum, row_tile_table


def _exclusive_prefix(v):
    return prefix_sum(v) - v


def receive_layout(counts_SG):
    """counts_SG [n, G] int (rows from source s for local expert e) -> (group_sizes_G [G], run_start_SG [n, G]):
    rows per local expert, and the first row of source s's run of expert e in the (expert, source)-ordered
    receive buffer (expert e starts at the sum of the sizes before it; its sources follow in rank order)."""
    counts = jnp.maximum(counts_SG.astype(jnp.int32), 0)
    group_sizes = jnp.sum(counts, axis=0, dtype=jnp.int32)
    expert_start = _exclusive_prefix(group_sizes)
    within = jax.vmap(_exclusive_prefix, in_axes=1, out_axes=1)(counts)   # sources before s, per expert
    return group_sizes, expert_start[None, :] + within


def send_runs(counts_SPG, rank):
    """For sender `rank`: (send_start_PG, dest_start_PG, count_PG), each [n_dest, G]: the first row of its run for
    (destination p, expert e) in its send buffer (its rows sorted by destination, then expert), the first row of
    that run in p's receive buffer (`receive_layout` of p), and the run's rows."""
    counts = jnp.maximum(counts_SPG.astype(jnp.int32), 0)
    count_PG = counts[rank]
    send_start = _exclusive_prefix(count_PG.reshape(-1)).reshape(count_PG.shape)
    dest_start = jax.vmap(lambda c_SG: receive_layout(c_SG)[1][rank], in_axes=1)(counts)
    return send_start, dest_start, count_PG


def tile_sources(table, num_valid, run_start_SG, counts_SG):
    """For each slot of `row_tile_table(group_sizes, ...)` over the receive buffer (table [4, S]: segment, first
    row, first stored row inside the tile, stored rows), the first and last source whose run of the slot's
    expert overlaps the rows the slot stores: int32 [2, S]. Slots that store no rows of an expert (the tail,
    spare slots) get the empty range (0, -1). Runs of one expert are consecutive in source order, so the
    sources a slot needs are inside this range; a source inside it with an empty run is waited for too, and that
    wait (all of that source's step for this rank) can end later than the rows need (a per-slot bitmask of the
    sources with rows would avoid it)."""
    counts = jnp.maximum(counts_SG.astype(jnp.int32), 0)
    n, num_groups = counts.shape
    seg, row0, lo, count = table
    slot = jnp.arange(table.shape[1], dtype=jnp.int32)
    is_expert = (slot < num_valid[0]) & (seg < num_groups) & (count > 0)
    e = jnp.minimum(seg, num_groups - 1)
    first_row, end_row = row0 + lo, row0 + lo + count
    start_SS = run_start_SG[:, e]                     # [n sources, S slots]
    end_SS = start_SS + counts[:, e]
    overlaps = (counts[:, e] > 0) & (start_SS < end_row[None, :]) & (end_SS > first_row[None, :])
    src = jnp.arange(n, dtype=jnp.int32)[:, None]
    first = jnp.min(jnp.where(overlaps, src, n), axis=0)
    last = jnp.max(jnp.where(overlaps, src, -1), axis=0)
    keep = is_expert & (last >= 0)
    return jnp.stack([jnp.where(keep, first, 0), jnp.where(keep, last, -1)]).astype(jnp.int32)


def receive_work(counts_SPG, rank, capacity: int, tile: int, with_tail: bool = True):
    """What a receiver's grouped GEMM runs on: (group_sizes_G, table, num_valid, tile_src): its rows per local
    expert, `row_tile_table` over its `capacity` receive rows in `tile`-row tiles (with or without the zero
    tail), and each slot's `tile_sources`."""
    counts_SG = jnp.maximum(counts_SPG[:, rank, :].astype(jnp.int32), 0)
    group_sizes, run_start = receive_layout(counts_SG)
    table, num_valid = row_tile_table(group_sizes, capacity, tile, with_tail=with_tail)
    return group_sizes, table, num_valid, tile_sources(table, num_valid, run_start, counts_SG)
