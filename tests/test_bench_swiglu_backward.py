"""benchmarks/bench_swiglu_backward.py on the CPU: every variant runs (the kernel in interpret mode), is timed, and
is within one bf16 rounding of float32 autodiff; XLA's bf16 autodiff, which rounds at several steps, is not."""
from benchmarks import bench_swiglu_backward


def test_every_variant_is_timed_and_checked_against_float32():
    row = bench_swiglu_backward.bench_shape("tiny", (48, 320), loops=2, sweep=True, interpret=True)
    assert row["errors"] == {}
    labels = {"xla", "kernel"} | {f"kernel_b{b}_w{w}" for b, w in bench_swiglu_backward.SWEEP}
    assert set(row["ms"]) == labels | {"copy"}
    steps = row["max_bf16_steps_from_float32"]
    assert all(steps[k] <= 1.0 for k in labels - {"xla"}), steps
    assert steps["xla"] > 1   # bf16 autodiff: several roundings (near-cancellations in d_gate)
    assert row["floor_ms"] > 0 and row["elementwise_pass_gbps"] > 0
