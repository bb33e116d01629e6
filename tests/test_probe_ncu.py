"""The ncu probe's parsing and attribution (benchmarks/probe_ncu_grouped_gemm.py) on a CSV written as ncu writes
it; the profiling itself needs the GPU and runs there."""
import pytest

from benchmarks.probe_ncu_grouped_gemm import attribute, parse_ncu_csv, summarize

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"\n')


def _row(i, kernel, section, metric, unit, value):
    return (f'"{i}","1","python3","h","{kernel}","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0",'
            f'"{section}","{metric}","{unit}","{value}"\n')


def _csv():
    text = "==PROF== Connected to process 1\nPROBE_RESULT {}\n" + HEADER
    for i, kernel, ns, cycles in ((0, "anonymous_mosaic_gpu_kernel", "300,000", "444,500"),
                                  (1, "nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT", "263,328", "403,800")):
        text += _row(i, kernel, "GPU Speed Of Light Throughput", "Duration", "ns", ns)
        text += _row(i, kernel, "GPU Speed Of Light Throughput", "Elapsed Cycles", "cycle", cycles)
        text += _row(i, kernel, "GPU Speed Of Light Throughput", "SM Active Cycles", "cycle", "400,000")
        text += _row(i, kernel, "Command line profiler metrics", "gmma_pct", "", "n/a")
    return text


def test_parse_reads_each_kernel_in_launch_order_with_numbers_and_text():
    kernels = parse_ncu_csv(_csv())
    assert [k["kernel"][:6] for k in kernels] == ["anonym", "nvjet_"]
    m = kernels[0]["metrics"]
    assert m["GPU Speed Of Light Throughput/Duration (ns)"] == 300000.0      # thousands separators dropped
    assert m["Command line profiler metrics/gmma_pct"] == "n/a"               # a value ncu cannot read stays text


def test_attribute_and_summary():
    kernels = parse_ncu_csv(_csv())
    labels = ["qwen3_30b_a3b_ep1/fwd/ours/default", "qwen3_30b_a3b_ep1/fwd/dense/xla_dot"]
    got = attribute(labels, kernels)
    row = summarize(labels[0], got[labels[0]], seconds_unprofiled=370e-6)
    flops = 2 * 65536 * 2048 * 768
    assert row["ncu_tflops"] == pytest.approx(flops / 300e-6 / 1e12)
    assert row["mma_cycles_share"] == pytest.approx(flops / (132 * 4096) / 444500)
    assert row["sm_active_share"] == pytest.approx(400000 / 444500)
    assert row["call_tflops"] == pytest.approx(flops / 370e-6 / 1e12)
    assert row["grid_ctas"] == 132
    with pytest.raises(RuntimeError, match="order is off"):     # our label on cuBLAS's kernel
        attribute(labels[::-1], kernels)
    with pytest.raises(RuntimeError, match="2 profiled kernels for 1 variants"):
        attribute(labels[:1], kernels)
