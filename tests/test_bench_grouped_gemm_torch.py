"""CPU tests of benchmarks/grouped_gemm_torch.py, the torch server bench_grouped_gemm.py --torch times
torch._grouped_mm in: its protocol, its loops taking turns with ours in the timing rounds, a hung or failing
server costing one timeout and leaving ours timed, and its labels in a measured row. torch is not installed on
the CPU machine: a stand-in backend (the protocol's other side) takes its place."""
import argparse
import io
import json
import re
import sys
import time

import jax.numpy as jnp
import pytest

from benchmarks import grouped_gemm_torch as gt
from benchmarks.loop_timing import time_rounds

STAND_IN = r'''
import sys, time
from benchmarks.grouped_gemm_torch import serve
log, mode = sys.argv[1], sys.argv[2]
print("a line that is not the protocol's", flush=True)
class StandIn:
    def env(self): return dict(torch="stand-in")
    def case(self, dense, **shape):
        return dict(labels=["fwd", "fwd+bwd"] + (["dense/fwd"] if dense else []),
                    errors={} if dense else {"dense/fwd": "RuntimeError: no dense today"})
    def length(self, label, min_total_s, min_iters): return dict(iters=min_iters)
    def loop(self, label, iters):
        if mode == "hang": time.sleep(60)
        if mode == "crash": sys.exit(3)
        with open(log, "a") as f: f.write("torch:" + label + "\n")
        return dict(s=0.001 * (2 if label == "fwd+bwd" else 1))
serve(StandIn())
'''
CASE = dict(M=256, K=64, N=128, G=2, group_sizes=[100, 28], useful_rows=128)


def _server(tmp_path, mode="ok", timeout_s=30):
    log = tmp_path / "log"
    log.write_text("")
    return gt.TorchServer(timeout_s, argv=[sys.executable, "-c", STAND_IN, str(log), mode]), log


def _local(log):
    def fn(a):
        with open(log, "a") as f:
            f.write("ours\n")
        return a + 1
    return fn


class _Backend:
    def env(self):
        return {"torch": "x"}

    def loop(self, label, iters):
        if label == "bad":
            raise RuntimeError("CUDA out of memory")
        return {"s": 0.5}


def test_serve_answers_env_first_then_each_request_and_survives_a_failing_one():
    reqs = [dict(op="loop", label="fwd", iters=3), dict(op="loop", label="bad", iters=1), dict(op="rm -rf"),
            dict(op="loop", label="fwd", iters=1), dict(op="quit"), dict(op="loop", label="fwd", iters=1)]
    out = io.StringIO()
    gt.serve(_Backend(), io.StringIO("".join(json.dumps(r) + "\n" for r in reqs)), out)
    lines = out.getvalue().splitlines()
    assert all(ln.startswith(gt.PREFIX) for ln in lines)
    got = [json.loads(ln[len(gt.PREFIX):]) for ln in lines]
    assert got[0] == {"ok": True, "env": {"torch": "x"}}
    assert got[1] == {"ok": True, "s": 0.5}
    assert not got[2]["ok"] and "CUDA out of memory" in got[2]["error"]
    assert not got[3]["ok"] and "unknown op 'rm -rf'" in got[3]["error"]
    assert got[4] == {"ok": True, "s": 0.5}
    assert got[5] == {"ok": True} and len(got) == 6   # nothing is answered after quit


def test_torch_loops_take_turns_with_ours_round_by_round(tmp_path):
    server, log = _server(tmp_path)
    try:
        assert server.env == {"torch": "stand-in"}
        row = dict(errors={})
        variants = gt.torch_variants(server, CASE, True, row)
        assert [(lb, mult) for lb, _, mult in variants] == [
            ("torch_grouped_mm/fwd", 1), ("torch_grouped_mm/fwd+bwd", 3), ("torch_dense_same_flops/fwd", 1)]
        ours = _local(log)
        got = time_rounds([("ours", ours, (jnp.ones(3),))] + [(lb, loop, None) for lb, loop, _ in variants[:2]],
                          min_total_s=0.0, loops=2, min_iters=1)
    finally:
        server.close()
    assert got["torch_grouped_mm/fwd"] == pytest.approx(0.001) and got["torch_grouped_mm/fwd+bwd"] == 0.002
    entries = log.read_text().split()
    rounds = entries[entries.index("torch:fwd") - 1:]   # after ours's loop-length probe (two calls)
    order = ["ours", "torch:fwd", "torch:fwd+bwd"]
    assert rounds == order + order[::-1] + order   # a warm-up round and two timed ones, the second reversed
    assert server.proc.poll() is not None


def test_setup_errors_land_under_the_row_label(tmp_path):
    server, _ = _server(tmp_path)
    try:
        row = dict(errors={})
        labels = [lb for lb, _, _ in gt.torch_variants(server, CASE, False, row)]
    finally:
        server.close()
    assert labels == ["torch_grouped_mm/fwd", "torch_grouped_mm/fwd+bwd"]
    assert row["errors"] == {"torch_dense_same_flops/fwd": "RuntimeError: no dense today"}


@pytest.mark.parametrize("mode", ["hang", "crash"])
def test_a_hung_or_dead_server_costs_one_wait_and_ours_is_still_timed(tmp_path, mode):
    server, log = _server(tmp_path, mode, timeout_s=2)
    try:
        row = dict(errors={})
        variants = gt.torch_variants(server, CASE, False, row)
        failed = {}
        t0 = time.perf_counter()
        got = time_rounds([("ours", _local(log), (jnp.ones(3),))] + [(lb, loop, None) for lb, loop, _ in variants],
                          min_total_s=0.0, loops=2, min_iters=1, errors=failed)
        waited = time.perf_counter() - t0
    finally:
        server.close()
    assert set(got) == {"ours"} and got["ours"] > 0
    reason = "no reply to loop within 2 s" if mode == "hang" else "ended (rc 3) during loop"
    assert set(failed) == {"torch_grouped_mm/fwd", "torch_grouped_mm/fwd+bwd"}
    assert all(reason in msg for msg in failed.values()), failed
    assert waited < 2 * 2 + 3   # the second label fails at once: the server is known dead
    with pytest.raises(gt.TorchServerError, match=re.escape(reason)):
        server.request("loop", label="fwd", iters=1)
    later = dict(errors={})   # the next case: no torch variants, the reason in its row
    assert gt.torch_variants(server, CASE, True, later) == [] and reason in later["errors"]["torch_grouped_mm"]


def test_measure_case_puts_torch_into_the_rows_rounds(tmp_path):
    """A tiny interpret-mode case with the stand-in server: ours, the dense GEMM and torch are timed in one set
    of rounds and torch's numbers land under the table's labels, charged the same useful FLOPs."""
    import jax

    from benchmarks.grouped_gemm_jax_timing import jax_impls, measure_case
    from benchmarks.loop_timing import TIMING
    server, log = _server(tmp_path)
    args = argparse.Namespace(interpret=True, impl_filter=["ours/", "dense"], suite=None, mode="smoke",
                              deadline=None, bwd=False, sweep=False, tokamax=False, out=str(tmp_path / "r.json"),
                              environment={}, t_start=time.perf_counter())
    old = dict(TIMING)
    TIMING.update(min_total_s=0.0, loops=1, min_iters=1)
    try:
        m, k, n, g = CASE["M"], CASE["K"], CASE["N"], CASE["G"]
        x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
        w = jax.random.normal(jax.random.key(1), (g, k, n), jnp.bfloat16)
        dy = jnp.zeros((m, n), jnp.bfloat16)
        impls = dict(fwd={"ours": jax.jit(jax_impls(m, k, n, g, args)["ours"])}, bwd={})
        results = []
        measure_case(dict(CASE, shape="tiny_torch", routing="uniform"), x, w, dy, impls, args, results, server)
    finally:
        TIMING.clear()
        TIMING.update(old)
        server.close()
    row = results[0]
    flops = 2 * CASE["useful_rows"] * k * n
    assert row["ms"]["torch_grouped_mm/fwd"] == 1.0 and row["ms"]["torch_grouped_mm/fwd+bwd"] == 2.0
    assert row["ms"]["torch_dense_same_flops/fwd"] == 1.0
    assert row["tflops"]["torch_grouped_mm/fwd+bwd"] == pytest.approx(3 * flops / 0.002 / 1e12, rel=1e-2)
    assert row["tflops"]["ours/fwd"] > 0 and row["tflops"]["dense_same_flops/fwd"] > 0
    assert row["errors"]["ours/fwd"] < 2e-2   # the sampled check ran
    # ours/fwd read a second time at the other end of the order: the row's noise on one kernel
    assert row["ms"]["ours_repeat/fwd"] > 0 and set(row["loop_ms"]) >= {"ours/fwd", "ours_repeat/fwd",
                                                                         "torch_grouped_mm/fwd"}
