"""The grouped GEMM's work tables (pallas_kernels/_grouped_tiles.py): the fused way of computing them (masked
sums, no scan, no while loop) gives exactly the tables the default way (cumsum + searchsorted) gives, on
random sizes with empty groups, tails, cumulative sizes past M and negative entries; and the kernels run on
the fused tables agree with the plain twin (interpret mode)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._work_tables import ROW_ALIGN, prefix_sum, row_tile_table, token_block_table
from pallas_kernels.grouped_gemm import (GemmTiling, GroupedGemmTuning, grouped_gemm, grouped_gemm_dgrad,
                                         grouped_gemm_dgrad_reference, grouped_gemm_reference, grouped_gemm_wgrad,
                                         grouped_gemm_wgrad_reference)


def _random_sizes(rng, batch, g, m):
    """A batch of size vectors of every kind the kernels must take."""
    kinds = [rng.multinomial(m, rng.dirichlet(np.ones(g)), size=batch // 4),        # sum == m
             rng.integers(0, 2 * m // g + 2, (batch // 4, g)),                     # short (tail) or cut at m
             np.where(rng.random((batch // 4, g)) < 0.5, 0, rng.integers(0, m // 2 + 1, (batch // 4, g))),
             rng.integers(-3, m // g + 3, (batch - 3 * (batch // 4), g))]           # negative entries
    return jnp.asarray(np.concatenate(kinds), jnp.int32)


@pytest.mark.parametrize("align", ["group", "grid"])
@pytest.mark.parametrize("g, m, tile", [(1, 104, 64), (7, 304, 64), (16, 1000, 128), (33, 264, 256)])
def test_fused_tables_equal_the_scan_tables(g, m, tile, align):
    sizes_BG = _random_sizes(np.random.default_rng(g * m + tile), 64, g, m)
    for tail in (True, False):
        fused, scan = (jax.jit(jax.vmap(lambda s, t=tail, mt=mt: row_tile_table(s, m, tile, t, mt, align)))(sizes_BG)
                       for mt in ("fused", "scan"))
        for a, b in zip(fused, scan):
            np.testing.assert_array_equal(a, b)
    tok = [jax.jit(jax.vmap(lambda s, mt=mt: token_block_table(s, m, tile, method=mt)))(sizes_BG)
           for mt in ("fused", "scan")]
    np.testing.assert_array_equal(*tok)


def test_fused_tables_on_the_qwen3_shape():
    """M = 65536 rows, 128 groups, 128-row tiles: the issue-10 shape's tables, uniform and padded."""
    m, g = 65536, 128
    for sizes in (np.full(g, m // g), np.full(g, m // (2 * g)), np.where(np.arange(g) % 2 == 0, 1024, 0)):
        gs = jnp.asarray(sizes, jnp.int32)
        fused, scan = (jax.jit(lambda s, mt=mt: row_tile_table(s, m, 128, method=mt))(gs) for mt in ("fused", "scan"))
        for a, b in zip(fused, scan):
            np.testing.assert_array_equal(a, b)
        assert int(fused[1][0]) == int(sizes.sum()) // 128 and int(fused[1][1]) == (m - int(sizes.sum())) // 128


def _slots(table, counts, m, tile):
    """Checks each valid slot's tile starts at a multiple of ROW_ALIGN inside [0, m - tile]; returns
    {segment: [rows stored by each of its slots]} and the segments of the slots in order."""
    table, counts = np.asarray(table), np.asarray(counts)
    rows, order = {}, []
    for slot in range(int(counts[0] + counts[1])):
        seg, row0, lo, count = table[:, slot]
        assert row0 % ROW_ALIGN == 0 and 0 <= row0 <= m - tile and 0 <= lo and lo + count <= tile and count > 0
        rows.setdefault(int(seg), []).append(list(range(row0 + lo, row0 + lo + count)))
        order.append(int(seg))
    return rows, order


@pytest.mark.parametrize("with_tail", [True, False])
@pytest.mark.parametrize("align", ["group", "grid"])
def test_row_tiles_cover_each_group_once_inside_the_rows(align, with_tail):
    """Against a numpy reading of the contract: the valid slots store every row of every segment exactly once
    (the tail as segment G, after all compute slots, and only with_tail), each tile reads rows inside [0, M)
    from a multiple of ROW_ALIGN (tiles past the end slide back); a grid-aligned table spends one slot per
    grid cell a segment touches, a group-aligned one at most cdiv(size + ROW_ALIGN - 1, tile) per segment and
    never more in all than the grid's."""
    rng = np.random.default_rng(5)
    for m, tile, g in [(304, 64, 7), (1000, 128, 16), (64, 64, 3), (264, 256, 33)]:
        for sizes in _random_sizes(rng, 16, g, m):
            table, counts = row_tile_table(jnp.asarray(sizes), m, tile, with_tail, "fused", align)
            grid_counts = row_tile_table(jnp.asarray(sizes), m, tile, with_tail, "fused", "grid")[1]
            ends = np.minimum(np.cumsum(np.maximum(sizes, 0)), m)   # cut at m; a negative size counts as 0
            starts = np.concatenate([[0], ends[:-1]])
            rows, order = _slots(table, counts, m, tile)
            assert all(s < g for s in order[:int(counts[0])]) and all(s == g for s in order[int(counts[0]):])
            bounds = list(zip(starts, ends)) + ([(ends[-1], m)] if with_tail else [])
            for seg, (lo, hi) in enumerate(bounds):
                per_slot = rows.get(seg, [])
                assert sorted(r for slot in per_slot for r in slot) == list(range(lo, hi)), (sizes, seg)
                cells = {r // tile for slot in per_slot for r in slot}
                if align == "grid":
                    assert len(per_slot) == len(cells)
                else:
                    assert len(per_slot) <= -(-(hi - lo + ROW_ALIGN - 1) // tile)
            assert int(counts[0] + counts[1]) <= int(grid_counts[0] + grid_counts[1])


@pytest.mark.parametrize("m, tile", [(100, 64), (32, 64)])
def test_row_tile_table_rejects_rows_it_cannot_tile(m, tile):
    with pytest.raises(ValueError, match="multiples of 8 with m >= tile"):
        row_tile_table(jnp.asarray([m], jnp.int32), m, tile)


def test_prefix_sum_is_cumsum():
    v = jnp.asarray(np.random.default_rng(1).integers(-50, 1000, 129), jnp.int32)
    np.testing.assert_array_equal(prefix_sum(v), jnp.cumsum(v))


def test_interpret_kernels_on_fused_tables_match_reference():
    """The fused tables drive all three kernels (forward, dgrad, wgrad) to the twins' results."""
    small = GemmTiling(tile_m=64, tile_n=64, max_concurrent_steps=2, wg_split="n", grid_tile_width=2)
    tuning = GroupedGemmTuning(fwd=small, dgrad=dataclasses.replace(small, wg_split="m"),
                               wgrad=dataclasses.replace(small, wg_split="m"), num_sms=3, tables="fused")
    kx, kw, kd = jax.random.split(jax.random.key(2), 3)
    x = jax.random.normal(kx, (200, 128), jnp.bfloat16)
    w = jax.random.normal(kw, (4, 128, 128), jnp.bfloat16)
    dy = jax.random.normal(kd, (200, 128), jnp.bfloat16)
    gs = jnp.asarray([50, 0, 77, 30], jnp.int32)   # an empty group, a tail of 43 rows
    f32 = dict(preferred_element_type=jnp.float32, interpret=True, tuning=tuning)
    got = (grouped_gemm(x, w, gs, **f32), grouped_gemm_dgrad(dy, w, gs, **f32), grouped_gemm_wgrad(x, dy, gs, **f32))
    want = (grouped_gemm_reference(x, w, gs, jnp.float32), grouped_gemm_dgrad_reference(dy, w, gs, jnp.float32),
            grouped_gemm_wgrad_reference(x, dy, gs, jnp.float32))
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-3)
    assert np.all(np.asarray(got[0])[157:] == 0.0) and np.all(np.asarray(got[1])[157:] == 0.0)
    assert np.all(np.asarray(got[2])[1] == 0.0)


@pytest.mark.parametrize("bad, match", [(dict(tables="while"), "tuning.tables"),
                                        (dict(row_tiles="rows"), "tuning.row_tiles")])
def test_bad_table_enums_raise(bad, match):
    x, w = jnp.zeros((64, 256), jnp.bfloat16), jnp.zeros((2, 256, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match=match):
        grouped_gemm(x, w, jnp.zeros((2,), jnp.int32), interpret=True, tuning=GroupedGemmTuning(**bad))


@pytest.mark.gpu
def test_gpu_fused_tables_equal_the_scan_tables():
    """The same equality compiled by XLA:GPU (its own fusions of the masked sums)."""
    sizes_BG = _random_sizes(np.random.default_rng(9), 64, 128, 65536)
    fused, scan = (jax.jit(jax.vmap(lambda s, mt=mt: row_tile_table(s, 65536, 128, method=mt)))(sizes_BG)
                   for mt in ("fused", "scan"))
    for a, b in zip(fused, scan):
        np.testing.assert_array_equal(a, b)
