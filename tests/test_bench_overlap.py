"""bench_overlap's trace reading on a real CPU profile (4 simulated devices) and on a hand-built trace."""
import glob
import gzip
import json

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from benchmarks import bench_overlap


@pytest.fixture(scope="module")
def cpu_trace(tmp_path_factory):
    """3 profiled calls of a program with two all-to-alls and two matmuls per device, on 4 devices."""
    mesh = jax.make_mesh((4,), ("i",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])

    def body(x, w):
        y = jax.lax.all_to_all(x, "i", 0, 0, tiled=True)
        z = jnp.tanh(y @ w) @ w
        return jax.lax.all_to_all(z, "i", 0, 0, tiled=True)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("i"), P()), out_specs=P("i")))
    x, w = jnp.ones((1024, 256)), jnp.full((256, 256), 0.01)
    f(x, w).block_until_ready()   # compile outside the profile
    out = tmp_path_factory.mktemp("profile")
    jax.profiler.start_trace(str(out))
    for _ in range(3):
        f(x, w).block_until_ready()
    jax.profiler.stop_trace()
    path, = glob.glob(str(out / "plugins" / "profile" / "*" / "*.trace.json.gz"))
    with gzip.open(path) as fh:
        return json.load(fh)


def test_cpu_trace_counts_each_devices_collectives(cpu_trace):
    out = bench_overlap.exposed_communication(cpu_trace, num_steps=3)
    assert out["devices"] == 4
    # Independently from the raw events: per device, the summed all-to-all time (one device's thunks of one
    # kind do not overlap each other) and the number of all-to-alls (2 per call x 3 calls).
    for device, row in out["per_device"].items():
        ordinal = device.split(":")[1]
        a2a = [e for e in cpu_trace["traceEvents"] if e.get("ph") == "X"
               and (e.get("args") or {}).get("device_ordinal") == ordinal
               and bench_overlap._opcode(e["args"].get("hlo_op", "")) == "all-to-all"]
        assert len(a2a) == 6
        assert row["comm_ms"] == pytest.approx(sum(e["dur"] for e in a2a) / 3 / 1e3, rel=1e-3, abs=1e-4)
        assert 0 <= row["exposed_comm_ms"] <= row["comm_ms"] + 1e-9
        assert row["comm_ms"] < row["busy_ms"]   # the matmuls are busy time too
    halved = bench_overlap.exposed_communication(cpu_trace, num_steps=6)
    assert halved["comm_ms"] == pytest.approx(out["comm_ms"] / 2, rel=1e-3, abs=1e-4)


def test_exposed_communication_on_a_hand_built_cpu_trace():
    def op(device, hlo_op, ts, dur):
        return {"ph": "X", "pid": 1, "tid": 1, "name": hlo_op, "ts": ts, "dur": dur,
                "args": {"device_ordinal": str(device), "hlo_op": hlo_op}}
    trace = {"traceEvents": [
        op(0, "fusion.1", 0, 100), op(0, "all-to-all.3", 50, 100),        # 50 hidden, 50 exposed
        op(0, "while.2", 0, 1000),                                         # a container: not compute
        {"ph": "X", "pid": 1, "tid": 1, "name": "end: all-to-all.3", "ts": 150, "dur": 0,
         "args": {"device_ordinal": "0", "hlo_op": "all-to-all.3"}},
        op(1, "all-gather", 0, 40), op(1, "dot.7", 40, 60),                # 40 exposed
    ]}
    out = bench_overlap.exposed_communication(trace, num_steps=1)
    assert out["per_device"]["cpu:0"] == {"busy_ms": 0.15, "comm_ms": 0.1, "exposed_comm_ms": 0.05}
    assert out["per_device"]["cpu:1"] == {"busy_ms": 0.1, "comm_ms": 0.04, "exposed_comm_ms": 0.04}
    assert out["exposed_comm_ms"] == pytest.approx(0.045)


def test_gpu_traces_go_through_gpu_trace_kernel_selection():
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #7(Compute)"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 9, "args": {"name": "XLA Ops"}}]
    kernels = [{"ph": "X", "pid": 1, "tid": 7, "name": "sm90_xmma_gemm_bf16", "ts": 0, "dur": 100},
               {"ph": "X", "pid": 1, "tid": 7, "name": "ncclDevKernel_AllToAll", "ts": 80, "dur": 60},
               {"ph": "X", "pid": 1, "tid": 9, "name": "fusion.1", "ts": 0, "dur": 900}]   # derived: skipped
    out = bench_overlap.exposed_communication({"traceEvents": meta + kernels}, num_steps=1)
    assert out["devices"] == 1
    assert (out["busy_ms"], out["comm_ms"], out["exposed_comm_ms"]) == pytest.approx((0.14, 0.06, 0.04))
