"""bench_fused_pairs on the 8 simulated CPU devices: the ring schedules equal the unfused twins (so the
speedups it reports on GPUs compare the same function), the MoE pairs' unfused sequences equal their kernels'
all-gather twins, and the kernels are skipped with the reason."""
import json

from benchmarks import bench_fused_pairs


def test_tiny_run_checks_every_variant_against_the_unfused_pair(tmp_path):
    out = tmp_path / "pairs.json"
    bench_fused_pairs.main(["--tiny", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["shapes"]["ranks"] == 8
    assert set(report["pairs"]) == {"gemm_a2a", "a2a_gemm", "ag_scatter_grouped_gemm", "grouped_gemm_gather_rs"}
    for pair in ("ag_scatter_grouped_gemm", "grouped_gemm_gather_rs"):
        rows = report["pairs"].pop(pair)
        assert set(rows) == {"unfused", "twin"}, (pair, rows)   # no mosaic on the CPU
        assert rows["twin"]["rel_err_vs_unfused"] < 1e-5 and rows["unfused"]["ms"] > 0, (pair, rows)
    for pair, rows in report["pairs"].items():
        assert set(rows) == {"unfused", "ring"}, (pair, rows)   # no mosaic on the CPU
        assert rows["unfused"]["rel_err_vs_unfused"] == 0.0
        assert rows["ring"]["rel_err_vs_unfused"] < 1e-5, (pair, rows)
        assert rows["ring"]["ms"] > 0 and rows["ring"]["speedup_vs_unfused"] > 0
    assert "need >= 2 GPUs" in report["mosaic_skipped"]
