"""The fused EP dispatch's tables (pallas_kernels/_dispatch_tables.py) against a numpy reading of the layout: the
(expert, source)-ordered receive buffer, each sender's runs, and the sources each grouped-GEMM work slot waits for."""
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._dispatch_tables import receive_layout, send_runs, tile_sources
from pallas_kernels._work_tables import row_tile_table


def _counts(rng, n, p, g):
    """Routing counts [source, destination, expert] with empty runs, empty experts and a skewed source."""
    c = rng.integers(0, 40, (n, p, g))
    c[rng.random((n, p, g)) < 0.3] = 0
    c[:, :, rng.integers(g)] = 0
    c[rng.integers(n)] *= 3
    return c


def _receive_rows(counts_SG):
    """Numpy: the receive buffer's rows in order, as (expert, source, index within the run)."""
    return [(e, s, i) for e in range(counts_SG.shape[1]) for s in range(counts_SG.shape[0])
            for i in range(counts_SG[s, e])]


@pytest.mark.parametrize("n, g", [(2, 1), (4, 3), (8, 5)])
def test_receive_layout_orders_rows_by_expert_then_source(n, g):
    rng = np.random.default_rng(n * 10 + g)
    for _ in range(8):
        counts = _counts(rng, n, 1, g)[:, 0]
        sizes, run_start = (np.asarray(a) for a in receive_layout(jnp.asarray(counts)))
        rows = _receive_rows(counts)
        assert sizes.tolist() == counts.sum(0).tolist()
        for s in range(n):
            for e in range(g):
                if counts[s, e]:
                    assert rows[run_start[s, e]] == (e, s, 0)
                    assert rows[run_start[s, e] + counts[s, e] - 1] == (e, s, counts[s, e] - 1)


def test_send_runs_point_into_the_destinations_layouts():
    rng = np.random.default_rng(3)
    n, g = 4, 3
    counts = _counts(rng, n, n, g)
    for rank in range(n):
        send_start, dest_start, count = (np.asarray(a) for a in send_runs(jnp.asarray(counts), rank))
        assert count.tolist() == counts[rank].tolist()
        # the send buffer: this rank's rows sorted by destination, then expert, runs back to back
        order = [(p, e) for p in range(n) for e in range(g)]
        at = 0
        for p, e in order:
            assert send_start[p, e] == at
            at += counts[rank, p, e]
        for p in range(n):
            _, run_start = receive_layout(jnp.asarray(counts[:, p]))
            assert dest_start[p].tolist() == np.asarray(run_start)[rank].tolist()


@pytest.mark.parametrize("align", ["group", "grid"])
def test_tile_sources_are_the_sources_whose_rows_a_slot_stores(align):
    rng = np.random.default_rng(11)
    n, g, tile = 4, 3, 64
    for _ in range(6):
        counts = _counts(rng, n, 1, g)[:, 0]
        sizes, run_start = receive_layout(jnp.asarray(counts))
        m = max(tile, -(-int(np.asarray(sizes).sum() + 30) // 8) * 8)    # a zero tail after the rows
        table, num_valid = row_tile_table(sizes, m, tile, True, "fused", align)
        got = np.asarray(tile_sources(table, num_valid, run_start, jnp.asarray(counts)))
        rows = _receive_rows(counts)
        t = np.asarray(table)
        for slot in range(t.shape[1]):
            seg, row0, lo, count = t[:, slot]
            if slot >= int(num_valid[0]) or count == 0:
                assert got[:, slot].tolist() == [0, -1]          # tail and spare slots wait for nobody
                continue
            sources = {rows[r][1] for r in range(row0 + lo, row0 + lo + count)}
            assert all(rows[r][0] == seg for r in range(row0 + lo, row0 + lo + count))
            assert (got[0, slot], got[1, slot]) == (min(sources), max(sources)), (counts, slot)
