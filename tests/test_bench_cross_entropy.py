"""benchmarks/bench_cross_entropy.py on the CPU: every variant runs, computes the same loss, and is timed."""
import pytest

from benchmarks import bench_cross_entropy


def test_every_cross_entropy_variant_is_timed_and_agrees_on_the_loss():
    row = bench_cross_entropy.bench_shape("tiny", (2, 8, 512), loops=2)
    assert row["errors"] == {}
    assert set(row["ms"]) == {f"{v}/{p}" for v in bench_cross_entropy.VARIANTS for p in ("fwd", "fwd+bwd")} | {"copy"}
    losses = row["losses"]
    assert losses["one_pass"] == pytest.approx(losses["optax"], rel=1e-6)
    assert losses["two_pass"] == pytest.approx(losses["optax"], rel=1e-6)
    assert row["elementwise_pass_gbps"] > 0
