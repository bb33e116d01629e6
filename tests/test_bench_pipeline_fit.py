"""The pipeline benchmark's tick fit recovers tick time, overhead and bubble from exact step times."""
import pytest

from benchmarks.bench_pipeline import fit_ticks


@pytest.mark.parametrize("stages", [2, 4])
def test_fit_recovers_tick_overhead_and_bubble(stages):
    tick, overhead, counts = 0.05, 0.02, [2, 4, 8]
    times = [(m + stages - 1) * tick + overhead for m in counts]
    fit = fit_ticks(stages, counts, times)
    assert fit["tick_s"] == pytest.approx(tick)
    assert fit["overhead_s"] == pytest.approx(overhead)
    for m, t in zip(counts, times):
        assert fit["measured_bubble"][str(m)] == pytest.approx((stages - 1) * tick / t)
