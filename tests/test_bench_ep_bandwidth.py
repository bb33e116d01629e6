"""bench_ep_bandwidth on the 8 simulated CPU devices: every exchange returns each token's own row through
dispatch + combine (so its GB/s on GPUs time a correct round trip), the fp8 wire within its quantization, and
the byte counts the rates are made of."""
import json

from benchmarks import bench_ep_bandwidth


def test_tiny_run_round_trips_every_exchange_and_counts_its_bytes(tmp_path):
    out = tmp_path / "ep.json"
    bench_ep_bandwidth.main(["--tiny", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["ranks"] == 8 and [(r["hidden"], r["top_k"]) for r in report["rows"]] == [(64, 2), (64, 8)]
    for row in report["rows"]:
        v = row["variants"]
        assert set(v) == set(bench_ep_bandwidth.VARIANTS), v
        assert v["all_to_all"]["rel_err_vs_input"] < 1e-5 and v["runs"]["rel_err_vs_input"] < 1e-5, v
        assert 0 < v["all_to_all_fp8"]["rel_err_vs_input"] < 0.06, v   # E4M3: ~2^-4 relative per element
        n, t, k, d = row["ranks"], row["tokens_per_rank"], row["top_k"], row["hidden"]
        assert row["routed_bytes_per_gpu"] == int(2 * t * k * (n - 1) / n * d * 4)   # fp32 on the CPU
        assert row["wire_bytes_per_gpu"] == 2 * (n - 1) * row["rows_per_destination"] * d * 4
        assert all(e["ms"] > 0 and e["wire_gbps"] > 0 for e in v.values())
