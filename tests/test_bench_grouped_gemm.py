"""CPU tests of benchmarks/bench_grouped_gemm.py: the cases it runs (issue 10's table, the routings' group sizes),
the --list plan, the ratios and verdicts, and one tiny interpret-mode run end to end (JSON and markdown)."""
import argparse
import json
import os
import subprocess
import sys

from benchmarks import grouped_gemm_cases as cases
from benchmarks import grouped_gemm_report as report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_grouped_gemm.py")


def _bench(*flags, cwd):
    """The script as the GPU machine runs it: a plain file, here without PYTHONPATH (it finds the repo itself)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, SCRIPT, *flags], cwd=cwd, env=env, capture_output=True, text=True,
                          check=True).stdout


def test_issue10_cases():
    got = cases.build_cases(argparse.Namespace(suite="issue10", mode="smoke", routings="", only=""))
    assert len(got) == 20 and len({c["shape"] for c in got}) == 9
    first = got[0]
    assert (first["shape"], first["routing"], first["M"], first["K"], first["N"], first["G"]) == (
        "mixtral_8x7b_ep1", "uniform", 8192 * 2, 4096, 14336, 8)
    for c in got:
        total = sum(c["group_sizes"])
        assert len(c["group_sizes"]) == c["G"] and c["useful_rows"] == total
        assert total == (c["M"] // 2 if c["routing"] == "padded" else c["M"])   # padded: half is the zero tail
    assert not any(c["G"] == 1 and c["routing"] in ("skewed", "half_empty") for c in got)


def test_group_sizes_and_rle():
    assert cases.group_sizes_for(16, 4, "half_empty").tolist() == [8, 0, 8, 0]
    assert cases.group_sizes_for(10, 4, "skewed").tolist() == [4, 2, 2, 2]
    assert cases.rle([4096, 4096, 0, 5]) == "2x4096,0,5"
    assert cases.rle([1024, 0, 1024, 0]) == "2x(1024,0)"


def test_list_cli(tmp_path):
    out = _bench("--suite", "issue10", "--list", cwd=tmp_path)
    assert out.startswith("20 cases (9 shapes), in the order run:")
    assert "mixtral_8x7b_ep1     uniform     16384  4096  14336    8  16384     1924.1  8x2048" in out
    assert "+ 0 torch" in out
    assert "+ 40 torch" in _bench("--suite", "issue10", "--torch", "--list", cwd=tmp_path)


def test_ratios_verdicts_and_table():
    row = dict(shape="s", routing="uniform", M=8, K=8, N=8, G=1, useful_rows=8, ratios={}, verdict={},
               tflops={"ours/fwd": 500.0, "ours/fwd+bwd": 450.0, "torch_grouped_mm/fwd": 400.0,
                       "torch_grouped_mm/fwd+bwd": 460.0, "dense_same_flops/fwd": 540.0})
    report.finalize_row(row)
    assert row["ratios"]["ours/torch_grouped_mm/fwd"] == 1.25
    assert row["ratios"]["ours/dense_same_flops/fwd+bwd"] is None
    same = "ours>=torch_grouped_mm_same_tail_contract"
    assert row["verdict"] == {"ours>=torch_grouped_mm": False, "ours>=0.9x_dense_fwd": True, same: False}
    s = report.summary([row])
    assert s["ours>=torch_grouped_mm"]["failing"] == ["s/uniform"] and s["ours>=0.9x_dense_fwd"]["all_rows_pass"]
    table = report.markdown_table([row], {"device": "cpu"})
    assert "| s | uniform | 8 | 8 | 8 | 1 | 8 | 500 | 400 | 540 | - | 1.25 | 0.93 |" in table   # no torch dense
    assert table.splitlines()[4].endswith("| NO | yes | - | - | NO | - |")   # no HBM bandwidth, no repeat
    assert "ours>=torch_grouped_mm: FAIL; failing ['s/uniform']" in table


def test_a_verdict_missed_by_less_than_the_same_kernel_spread_is_marked():
    """ours/fwd read twice in one set of rounds (500 and 520: a 4% spread): missing torch by 2% is within that
    noise, missing it by 10% or 0.9x dense by 10% is not."""
    t = {"ours/fwd": 500.0, "ours_repeat/fwd": 520.0, "ours/fwd+bwd": 450.0, "torch_grouped_mm/fwd": 510.0,
         "torch_grouped_mm/fwd+bwd": 440.0, "dense_same_flops/fwd": 540.0}
    near = report.finalize_row(dict(shape="n", routing="uniform", M=8, K=8, N=8, G=1, useful_rows=8, tflops=t))
    assert near["same_kernel_spread"] == 0.04
    assert near["verdict"]["ours>=torch_grouped_mm"] is False and near["missed_within_spread"] == {
        "ours>=torch_grouped_mm": True, "ours>=torch_grouped_mm_same_tail_contract": True,
        "ours>=0.9x_dense_fwd": False}   # 500 / 540 = 0.93 passes: nothing missed
    far = report.finalize_row(dict(shape="f", routing="uniform", M=8, K=8, N=8, G=1, useful_rows=8,
                                   tflops=dict(t, **{"torch_grouped_mm/fwd": 560.0, "dense_same_flops/fwd": 620.0})))
    assert far["missed_within_spread"]["ours>=torch_grouped_mm"] is False   # 500 / 560 = 0.89
    assert far["missed_within_spread"]["ours>=0.9x_dense_fwd"] is False     # 500 / 620 = 0.81 < 0.9 * 0.96
    s = report.summary([near, far])
    assert s["ours>=torch_grouped_mm"]["failing"] == ["n/uniform", "f/uniform"]
    assert s["ours>=torch_grouped_mm"]["failing_within_same_kernel_spread"] == ["n/uniform"]
    assert report.markdown_table([near], {}).splitlines()[4].endswith("| 4.0% |")


def test_same_tail_contract_verdict_uses_the_unwritten_tail_only_where_there_is_a_tail():
    """torch leaves the tail unwritten: on a row with one, the second verdict compares ours with zero_tail='none';
    on a row without, it is the plain verdict."""
    t = {"ours/fwd": 500.0, "ours/fwd+bwd": 450.0, "torch_grouped_mm/fwd": 520.0, "torch_grouped_mm/fwd+bwd": 440.0,
         "ours_unwritten_tail/fwd": 530.0, "ours_unwritten_tail/fwd+bwd": 460.0}
    padded = report.finalize_row(dict(shape="p", routing="padded", M=16, K=8, N=8, G=1, useful_rows=8, tflops=t))
    assert padded["verdict"]["ours>=torch_grouped_mm"] is False
    assert padded["verdict"]["ours>=torch_grouped_mm_same_tail_contract"] is True
    assert padded["ratios"]["ours_unwritten_tail/torch_grouped_mm/fwd"] == round(530 / 520, 3)
    full = report.finalize_row(dict(shape="u", routing="uniform", M=8, K=8, N=8, G=1, useful_rows=8, tflops=t))
    assert full["verdict"]["ours>=torch_grouped_mm_same_tail_contract"] is False   # ours/fwd 500 < 520
    s = report.summary([padded, full])
    assert s["ours>=torch_grouped_mm_same_tail_contract"]["failing"] == ["u/uniform"]


def test_hbm_floor_counts_non_empty_groups_routed_rows_and_the_whole_output():
    """Qwen3 EP1 padded: 128 non-empty weights of 2048 x 768, 32768 routed rows, 65536 output rows (half of them
    the zero tail); an empty group's weight is never read."""
    row = dict(shape="q", routing="padded", M=65536, K=2048, N=768, G=128, useful_rows=32768,
               group_sizes=[256] * 128, ratios={}, verdict={}, tflops={"ours/fwd": 490.0}, ms={"ours/fwd": 0.21})
    want = 2 * (128 * 2048 * 768 + 32768 * 2048 + 65536 * 768)
    assert report.hbm_floor_bytes(row) == want == 637_534_208
    report.finalize_row(row, hbm_gbps=3500.0)
    assert row["hbm_floor"] == dict(bytes=want, ms_fwd=round(want / 3.5e12 * 1e3, 4),
                                    share_of_ours_fwd=round(want / 3.5e12 * 1e3 / 0.21, 3))
    assert 0.86 < row["hbm_floor"]["share_of_ours_fwd"] < 0.87
    half = dict(row, group_sizes=[512, 0] * 64)
    assert report.hbm_floor_bytes(half) == want - 2 * 64 * 2048 * 768
    table = report.markdown_table([row], {"device": "gpu", "hbm_copy_gbps": 3500.0})
    assert table.splitlines()[-7].endswith("| 0.182 | 0.87 | - | - |") and "(3500.0 GB/s)" in table
    report.finalize_row(no_bw := dict(row, hbm_floor=None))
    assert no_bw["hbm_floor"] is None   # no bandwidth measured (the interpreter): no floor


def test_tiny_interpret_run_writes_json_and_markdown(tmp_path):
    """Our kernel (interpreter) and the dense GEMM on the smallest shape with a zero tail, forward only."""
    out = str(tmp_path / "gg.json")
    _bench("--suite", "tiny", "--interpret", "--impls", "ours/,ours_unwritten_tail/,dense", "--no-bwd",
           "--only", "tiny_g1", "--routings", "padded", "--out", out, cwd=tmp_path)
    doc = json.load(open(out))
    assert list(doc) == ["environment", "suite", "mode", "tokens_per_device", "flops_note", "summary", "results"]
    assert doc["suite"] == "tiny" and doc["summary"]["rows"] == 1
    (row,) = doc["results"]
    assert set(row["tflops"]) == {"ours/fwd", "ours_repeat/fwd", "ours_unwritten_tail/fwd", "dense_same_flops/fwd"}
    assert row["errors"]["ours/fwd"] < 1e-2 and row["tail_zero"] == {"ours/fwd": True}   # not asked of unwritten
    assert row["errors"]["ours_unwritten_tail/fwd"] < 1e-2
    assert set(row["verdict"]) == {"ours>=torch_grouped_mm", "ours>=0.9x_dense_fwd",
                                   "ours>=torch_grouped_mm_same_tail_contract"}
    md = open(str(tmp_path / "gg.md")).read()
    assert "| tiny_g1 | padded | 256 | 128 | 256 | 1 | 128 |" in md and "ours>=0.9x_dense_fwd:" in md


def test_profile_cuts_a_trace_into_calls():
    """benchmarks/grouped_gemm_profile.py: kernels between two Mosaic kernels are that call's table kernels,
    idle time between them its gaps (a synthetic trace of three calls, microseconds)."""
    from benchmarks.grouped_gemm_profile import decompose_calls, summarize

    events = []
    for i in range(3):
        t = 1000.0 * i
        events += [dict(name="fusion_1", ts=t, dur=3.0), dict(name="fusion_2", ts=t + 5.0, dur=2.0),
                   dict(name="mosaic_kernel", ts=t + 10.0, dur=900.0, args={"hlo_op": "custom-call.1"})]
    main, calls = decompose_calls(events)
    assert main == "mosaic_kernel" and len(calls) == 2
    assert calls[0]["main_us"] == 900.0 and calls[0]["period_us"] == 1000.0
    assert [p["name"] for p in calls[0]["pre"]] == ["fusion_1", "fusion_2"]
    assert calls[0]["gaps_us"] == [90.0, 2.0, 3.0]   # 910 -> 1000, 1003 -> 1005, 1007 -> 1010
    s = summarize(main, calls)
    assert (s["main_us"], s["pre_kernels_us"], s["gaps_us"], s["period_us"]) == (900.0, 5.0, 95.0, 1000.0)
    assert [p["us"] for p in s["pre"]] == [3.0, 2.0] and s["n_pre_kernels"] == [2]


def test_timing_rounds_alternate_the_variants():
    """time_rounds runs one loop of each variant per round (after a warm-up round), so the variants share
    every stretch of the GPU's pace, in reverse order every other round, so none is always first; each gets
    the median of its own loops, and per_loop every timed loop."""
    import jax.numpy as jnp

    from benchmarks.loop_timing import time_rounds
    log = []

    def variant(tag):
        def fn(a):
            log.append(tag)
            return a + 1
        return fn
    per_loop, iters = {}, {}
    got = time_rounds([("a", variant("a"), (jnp.ones(3),)), ("b", variant("b"), (jnp.ones(3),))],
                      min_total_s=0.0, loops=3, min_iters=2, per_loop=per_loop, loop_iters=iters)
    assert iters == {"a": 2, "b": 2}
    assert set(got) == {"a", "b"} and all(t > 0 for t in got.values())
    loops = log[4:]   # after the loop-length probes (2 calls per variant), 4 rounds of 2 calls each
    assert loops == ["a", "a", "b", "b", "b", "b", "a", "a"] * 2
    assert {k: len(v) for k, v in per_loop.items()} == {"a": 3, "b": 3}   # the warm-up round is not kept
    assert got["a"] == sorted(per_loop["a"])[1]


def test_sweep_tilings_name_every_variant_apart_and_include_the_pingpong_ring():
    """--sweep times its forward tilings in one set of rounds keyed by label: two variants under one label
    would overwrite each other, so the label must carry the schedule as well as the tiles."""
    from benchmarks.grouped_gemm_sweeps import sweep_tilings, tiling_label
    cfgs = sweep_tilings(768, 2048)   # Qwen3-30B-A3B's up-projection
    labels = [tiling_label(c) for c in cfgs]
    assert len(set(labels)) == len(labels)
    pp = [lb for lb, c in zip(labels, cfgs) if c.schedule == "pingpong"]
    assert pp[0] == "pp128x128k64s6m0w8" and {"pp128x128k64s4m0w8", "pp128x128k64s6m1w8"} <= set(pp)
    assert len(pp) == 6 and not any(lb.startswith("pp") for lb, c in zip(labels, cfgs) if c.schedule != "pingpong")


def test_a_failing_variant_leaves_the_rounds_and_their_records():
    """With an errors dict, a variant that raises in its loop is dropped from the later rounds: its label is
    in errors and in none of the results (medians, per-loop times, loop lengths); the others are timed."""
    import jax.numpy as jnp

    from benchmarks.loop_timing import time_rounds
    calls = {"n": 0}

    def flaky(a):
        calls["n"] += 1
        if calls["n"] > 3:   # the loop-length probe's two calls and the first loop's one pass
            raise RuntimeError("lost the device")
        return a + 1
    failed, per_loop, iters = {}, {}, {}
    got = time_rounds([("ok", lambda a: a + 1, (jnp.ones(3),)), ("flaky", flaky, (jnp.ones(3),))],
                      min_total_s=0.0, loops=2, min_iters=1, errors=failed, per_loop=per_loop, loop_iters=iters)
    assert set(got) == set(per_loop) == set(iters) == {"ok"} and len(per_loop["ok"]) == 2
    assert failed == {"flaky": "RuntimeError: lost the device"}


def test_a_budget_spent_in_the_sweep_costs_the_sweep_only(monkeypatch, tmp_path):
    """--sweep's tilings join the case's rounds; when --time-budget-s runs out while they compile, the case's
    own variants (compiled before) are still timed and only the sweep's are marked skipped."""
    import jax
    import jax.numpy as jnp

    from benchmarks import grouped_gemm_jax_timing as gjt
    from benchmarks.loop_timing import TIMING
    from pallas_kernels.grouped_gemm import GemmTiling
    spent = {"now": False}

    def label(cfg):
        spent["now"] = True   # the budget runs out as the sweep starts
        return "swept"
    monkeypatch.setattr(gjt, "sweep_tilings", lambda n, k: [GemmTiling(tile_m=64, tile_n=64, wg_split="m")])
    monkeypatch.setattr(gjt, "tiling_label", label)
    monkeypatch.setattr(gjt, "past_deadline", lambda args: spent["now"])
    monkeypatch.setattr(gjt, "sweep_backward", lambda *a, **k: None)
    monkeypatch.setitem(TIMING, "min_total_s", 0.0)
    monkeypatch.setitem(TIMING, "loops", 2)
    monkeypatch.setitem(TIMING, "min_iters", 1)
    args = argparse.Namespace(interpret=True, impl_filter=["ours/", "ours[", "dense"], suite="tiny", mode="smoke",
                              deadline=None, bwd=False, sweep=True, tokamax=False, out=str(tmp_path / "r.json"),
                              environment={}, t_start=0.0)
    m, k, n, g = 256, 64, 128, 2
    x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (g, k, n), jnp.bfloat16)
    case = dict(shape="tiny_sweep", routing="uniform", M=m, K=k, N=n, G=g, group_sizes=[128, 128], useful_rows=m)
    impls = dict(fwd={"ours": jax.jit(gjt.jax_impls(m, k, n, g, args)["ours"])}, bwd={})
    results = []
    gjt.measure_case(case, x, w, jnp.zeros((m, n), jnp.bfloat16), impls, args, results)
    row = results[0]
    assert row["errors"]["ours[swept]/fwd"] == "skipped: --time-budget-s reached"
    assert row["tflops"]["ours/fwd"] > 0 and row["tflops"]["ours_repeat/fwd"] > 0
    assert row["tflops"]["dense_same_flops/fwd"] > 0 and "ours[swept]/fwd" not in row["tflops"]


def test_the_unchained_weight_gradient_is_offered_where_the_default_chains_it():
    """`ours_unchained_wgrad` (jax's per-item pipelines) is the twin timed against the default's ring where the
    weight gradient is cooperative (Mixtral's 2048 rows per group); small groups take ping-pong, no twin."""
    import types

    from benchmarks.grouped_gemm_jax_timing import jax_impls
    from pallas_kernels.grouped_gemm import default_tuning

    args = types.SimpleNamespace(interpret=True)
    assert default_tuning(16384, 4096, 14336, 8).wgrad.chain_items
    unchained = jax_impls(16384, 4096, 14336, 8, args)["ours_unchained_wgrad"]
    assert unchained.keywords["tuning"].wgrad.chain_items is False
    assert default_tuning(65536, 2048, 768, 128).wgrad.schedule == "pingpong"
    assert "ours_unchained_wgrad" not in jax_impls(65536, 2048, 768, 128, args)


def test_the_h200_tiles_are_offered_where_this_devices_default_differs():
    """On a device other than the H200 (here the CPU), DeepSeek-V3 EP8's default input gradient is cooperative
    (the wide-output rule) and `ours_h200_tuning` times the H200's ping-pong one beside it; Mixtral's shapes have
    the same tiles on every card, so no such variant."""
    import types

    from benchmarks.grouped_gemm_jax_timing import jax_impls
    from pallas_kernels.grouped_gemm import default_tuning

    args = types.SimpleNamespace(interpret=True)
    dsv3 = jax_impls(65536, 7168, 2048, 32, args)
    assert default_tuning(65536, 7168, 2048, 32).dgrad.schedule == "cooperative"
    assert dsv3["ours_h200_tuning"].keywords["tuning"].dgrad.schedule == "pingpong"
    assert "ours_h200_tuning" not in jax_impls(16384, 4096, 14336, 8, args)
