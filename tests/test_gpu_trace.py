"""The profile breakdown on a hand-built trace: categories, unions, exposed communication, derived lines skipped."""
import gzip
import json

import jax
import jax.numpy as jnp
import pytest

from benchmarks import gpu_trace


def _trace():
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:1"}},
        {"ph": "M", "name": "process_name", "pid": 9, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #7(Compute)"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8, "args": {"name": "Stream #8(Nccl)"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 99, "args": {"name": "XLA Ops"}},
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": 7, "args": {"name": "Stream #7(Compute)"}},
        {"ph": "M", "name": "thread_name", "pid": 9, "tid": 1, "args": {"name": "python"}},
    ]

    def kernel(pid, tid, name, ts, dur):
        return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}

    events = [
        # GPU 0: a GEMM 0..100 us, attention 150..200, an all-to-all 80..180 (80..100 and 150..180 hidden).
        kernel(1, 7, "sm90_xmma_gemm_bf16", 0, 100),
        kernel(1, 7, "cudnn_generated_fort_native_sdpa", 150, 50),
        kernel(1, 8, "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage)", 80, 100),
        kernel(1, 99, "fusion.3", 0, 1000),            # a derived line: must not be counted
        kernel(9, 1, "ncclDevKernel_AllGather", 0, 1000),  # a host thread: must not be counted
        # GPU 1: an elementwise fusion 0..40 and an all-gather 40..100, fully exposed.
        kernel(2, 7, "loop_add_fusion", 0, 40),
        kernel(2, 7, "ncclDevKernel_AllGather_RING_LL", 40, 60),
    ]
    return {"traceEvents": meta + events}


def test_breakdown_counts_stream_kernels_and_exposed_communication():
    out = gpu_trace.breakdown(_trace(), num_steps=1)
    assert out["num_gpus"] == 2
    # busy: GPU0 union [0,200) = 200 us; GPU1 [0,100) = 100 us -> mean 150 us = 0.15 ms.
    assert out["busy_ms"] == pytest.approx(0.150)
    # comm: GPU0 100 us, GPU1 60 us -> 0.08 ms; exposed: GPU0 100..150 = 50 us, GPU1 60 us -> 0.055 ms.
    assert out["comm_ms"] == pytest.approx(0.080)
    assert out["exposed_comm_ms"] == pytest.approx(0.055)
    cats = out["kernel_ms_by_category"]
    assert cats == pytest.approx({"gemm": 0.05, "attention": 0.025, "comm:sendrecv": 0.05,
                                  "comm:allgather": 0.03, "other": 0.02})


def test_breakdown_divides_by_steps_and_reads_the_written_file(tmp_path):
    run = tmp_path / "plugins" / "profile" / "2026_11_30"
    run.mkdir(parents=True)
    with gzip.open(run / "host.trace.json.gz", "wt") as f:
        json.dump(_trace(), f)
    path = gpu_trace.latest_trace_file(str(tmp_path))
    out = gpu_trace.breakdown(gpu_trace.load_trace(path), num_steps=2)
    assert out["busy_ms"] == pytest.approx(0.075)


def test_breakdown_rejects_a_trace_without_gpu_kernels(tmp_path):
    with pytest.raises(ValueError, match="no GPU stream kernels"):
        gpu_trace.breakdown({"traceEvents": []}, num_steps=1)
    with pytest.raises(FileNotFoundError, match="profiler"):
        gpu_trace.latest_trace_file(str(tmp_path))


@pytest.mark.parametrize("name, category", [
    ("ncclDevKernel_AllToAll", "comm:alltoall"), ("ncclDevKernel_ReduceScatter_Sum_bf16", "comm:reducescatter"),
    ("nvjet_tst_128x256_64x4", "gemm"), ("gemm_fusion_dot_3", "gemm"), ("input_reduce_fusion", "other"),
])
def test_kernel_categories(name, category):
    assert gpu_trace.kernel_category(name) == category


def test_idle_gaps_are_the_time_no_kernel_runs_with_their_neighbours():
    events = [{"ts": 0, "dur": 100, "name": "a"}, {"ts": 80, "dur": 40, "name": "b"},   # overlap: no gap
              {"ts": 123, "dur": 7, "name": "c"}, {"ts": 160, "dur": 10, "name": "d"}]
    gaps = gpu_trace.idle_gaps(events, top=1)
    assert gaps["idle_us"] == 33.0 and gaps["gaps_over_5us"] == 1   # 120..123 (3 us) and 130..160 (30 us)
    assert gaps["largest"] == [{"us": 30.0, "after": "c", "before": "d"}]


def _silu_product(x, w):
    return jnp.sum(jax.nn.silu(x @ w) * x)   # the line the fusions below must point at


def test_instruction_sources_name_the_jax_op_and_line_of_each_fusion():
    import inspect

    from benchmarks.hlo_sources import instruction_sources
    text = jax.jit(jax.grad(_silu_product)).lower(jnp.ones((16, 16)), jnp.ones((16, 16))).compile().as_text()
    sources = instruction_sources(text)
    line = inspect.getsourcelines(_silu_product)[1] + 1
    fusions = {k: v for k, v in sources.items() if "fusion" in k}
    assert fusions, sorted(sources)
    for name, src in fusions.items():   # every fusion of this program comes from that one line
        assert src["where"].endswith(f"test_gpu_trace.py:{line} (_silu_product)"), (name, src)
        assert src["op"].startswith("jit(_silu_product)/"), (name, src)
    assert any("silu" in v["op"] for v in fusions.values())


def test_breakdown_attaches_sources_to_the_kernels_they_name():
    sources = {"loop_add_fusion": {"op": "jit(f)/add", "where": "megascale_jax/x.py:3 (f)"}}
    top = {k["name"]: k for k in gpu_trace.breakdown(_trace(), num_steps=1, sources=sources)["top_kernels"]}
    assert top["loop_add_fusion"]["source"] == sources["loop_add_fusion"]
    assert "source" not in top["sm90_xmma_gemm_bf16"]


def test_kernel_names_with_an_underscore_suffix_find_their_dotted_hlo_instruction():
    sources = {"input_reduce_fusion.31": {"op": "jit(f)/reduce_max", "where": "megascale_jax/x.py:9 (g)"},
               "loop_add_fusion": {"op": "jit(f)/add", "where": "megascale_jax/x.py:3 (f)"}}
    assert gpu_trace.source_of("input_reduce_fusion_31", sources) == sources["input_reduce_fusion.31"]
    assert gpu_trace.source_of("loop_add_fusion", sources) == sources["loop_add_fusion"]
    assert gpu_trace.source_of("input_reduce_fusion_32", sources) is None
    kernels = [{"name": "a", "category": "other", "ms": 2.0, "source": sources["loop_add_fusion"]},
               {"name": "b", "category": "other", "ms": 1.5},
               {"name": "c", "category": "other", "ms": 0.5, "source": sources["loop_add_fusion"]},
               {"name": "d", "category": "gemm", "ms": 9.0, "source": sources["loop_add_fusion"]}]
    assert gpu_trace.other_by_source(kernels) == {"megascale_jax/x.py:3 (f)": 2.5, "unmapped": 1.5}


def test_bench_train_reads_the_trainers_step_hlo_for_kernel_sources(tmp_path):
    """The trainer, run as bench_train runs it with an XLA dump, leaves the step's optimized HLO, whose
    fusions name this project's source lines (on the GPU the same names are the profile's kernels)."""
    from benchmarks.bench_train import run_trainer, step_sources
    overrides = {"train.steps": 2, "train.warmup_steps": 1, "train.eval_every": 0, "output.dir": str(tmp_path),
                 "output.tensorboard": False}
    logged = run_trainer("tiny_cpu", overrides, str(tmp_path), hlo_dump_dir=str(tmp_path / "xla"))
    assert [r["step"] for r in logged][-1] == 2
    sources = step_sources(str(tmp_path / "xla"))
    wheres = {v["where"] for k, v in sources.items() if "fusion" in k and v["where"]}
    assert any(w.startswith("megascale_jax/model/") for w in wheres), sorted(wheres)[:20]
    with pytest.raises(FileNotFoundError, match="jit_step_fn"):
        step_sources(str(tmp_path / "nothing"))


@pytest.mark.parametrize("flags, message", [(["--hlo-sources"], "give --profile-steps"),
                                            (["--profile-steps", "2", "--save-hlo"], "give --hlo-sources")])
def test_bench_train_refuses_source_flags_that_would_do_nothing(flags, message, monkeypatch, capsys):
    import sys

    from benchmarks import bench_train
    monkeypatch.setattr(sys, "argv", ["bench_train", "--out", "x.json", *flags])
    with pytest.raises(SystemExit):
        bench_train.main()
    assert message in capsys.readouterr().err


def test_a_pallas_triton_kernel_is_found_under_its_own_name():
    """The trace names a Pallas Triton kernel after the `name` in its custom call's backend_config (its HLO
    instruction is folded into a command buffer), printed with or without escaped quotes."""
    from benchmarks.hlo_sources import instruction_sources
    meta = 'metadata={op_name="jit(step)/pallas_call" source_file="/x/megascale_jax/model/layers.py" source_line=9}'
    text = "\n".join([
        "HloModule jit_step", "",
        "ENTRY %main (p: bf16[8,16]) -> f32[8] {",
        '  %custom-call.3 = f32[8] custom-call(%p), custom_call_target="__gpu$xla.gpu.triton", '
        f'{meta}, backend_config={{debug = false, ir = "\\4D\\4C", name = "cross_entropy_forward", num_warps = 4}}',
        '  %custom-call.4 = f32[8] custom-call(%p), custom_call_target="__gpu$xla.gpu.triton", '
        f'{meta}, backend_config="{{grid_x = 8 : i32, name = \\"cross_entropy_backward\\"}}"',
        '  ROOT %custom-call.5 = f32[8] custom-call(%p), custom_call_target="other", '
        f'{meta}, backend_config={{name = "not_a_triton_kernel"}}',
        "}"])
    sources = instruction_sources(text)
    assert sources["cross_entropy_forward"] == sources["custom-call.3"]
    assert sources["cross_entropy_backward"] == sources["custom-call.4"]
    assert sources["cross_entropy_forward"]["op"] == "jit(step)/pallas_call"
    assert "not_a_triton_kernel" not in sources and "num_warps" not in sources


def test_triton_kernels_sharing_a_name_are_listed_under_each_trace_name():
    """Three calls of one Pallas kernel (the SwiGLU backward of the experts, the dense layer and the shared experts)
    show in the trace as swiglu_backward, swiglu_backward__1 and __2; all three are listed, with the common source
    line, or with every line where the calls come from different ones."""
    from benchmarks.hlo_sources import instruction_sources

    def module(lines):
        call = ('  %custom-call.{i} = bf16[8] custom-call(%p), custom_call_target="__gpu$xla.gpu.triton", '
                'metadata={{op_name="jit(step)/pallas_call" stack_frame_id={frame}}}, '
                'backend_config={{name = "swiglu_backward", num_warps = 8}}')
        return "\n".join([
            "HloModule jit_step", "", "FileNames", '1 "/x/megascale_jax/model/layers.py"', "FunctionNames",
            '1 "swiglu_activation"', "FileLocations",
            "1 {file_name_id=1 function_name_id=1 line=201 end_line=201 column=1 end_column=9}",
            "2 {file_name_id=1 function_name_id=1 line=7 end_line=7 column=1 end_column=9}", "StackFrames",
            "1 {file_location_id=1 parent_frame_id=0}", "2 {file_location_id=2 parent_frame_id=0}", "",
            "ENTRY %main (p: bf16[8]) -> bf16[8] {",
            *[("  ROOT " if i == len(lines) else "") + call.format(i=i, frame=f).lstrip()
              for i, f in enumerate(lines, 1)], "}"])
    sources = instruction_sources(module([1, 1, 1]))
    names = ("swiglu_backward", "swiglu_backward__1", "swiglu_backward__2")
    assert all(sources[n]["where"] == "megascale_jax/model/layers.py:201 (swiglu_activation)" for n in names), sources
    assert sources["swiglu_backward"]["op"] == "one of 3 Triton calls named swiglu_backward"
    assert "swiglu_backward__3" not in sources
    differing = instruction_sources(module([1, 2]))["swiglu_backward__1"]["where"]
    assert differing == ("one of: megascale_jax/model/layers.py:201 (swiglu_activation) | "
                         "megascale_jax/model/layers.py:7 (swiglu_activation)")


def test_a_failed_training_run_is_reported_by_its_exception_line():
    """bench_train records a failed run by the exception's own line, before the end of its stderr (a cut
    traceback said only 'in device_get' for an H100 run of mixtral_small)."""
    from benchmarks.bench_train import failure_summary

    stderr = "\n".join(["Traceback (most recent call last):", '  File "x.py", line 3, in device_get',
                        "    return tree_map(_device_get, x)",
                        "jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory allocating 1234 bytes.",
                        "", "During handling ...", "    " + "frame " * 400])
    summary = failure_summary(stderr)
    assert summary.startswith("jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory")
    assert summary.endswith(stderr[-600:])
    assert failure_summary("segfault\n").startswith("(no exception line in stderr)")
