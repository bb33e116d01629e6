"""CPU tests of benchmarks/bench_peers.py's pure parts (its plan, results and worker-contract modules): FLOP
counting, verdicts, table, JSON shape, the CLI, the orchestrator's imports, the plot."""
import json
import os
import subprocess
import sys

import pytest

from benchmarks import bench_peers as bp
from benchmarks import peers_plan as plan
from benchmarks import peers_results as results
from benchmarks import peers_worker_contract as contract

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_flops_match_accounting_convention():
    f = plan.layer_flops_fwd(plan.FULL)
    t, d = 8192, 4096
    assert f["projections"] == 2 * t * d * (2 * 32 * 128 + 2 * 8 * 128)
    assert f["attention_core"] == 2 * t * t * 32 * 128           # 2*S*H*K per token, causal-halved
    assert f["experts"] == 6 * t * 2 * d * 14336
    assert f["router"] == 2 * t * d * 8
    assert plan.train_flops(plan.FULL) == 3 * f["total"]
    assert plan.train_flops(plan.FULL, layers=2) == 2 * plan.train_flops(plan.FULL)
    # the stock block's count (../shared/bench/stock_block.py) is the same without the router
    stock = 2 * t * d * (2 * 32 * 128 + 2 * 8 * 128) + 2 * t * t * 32 * 128 + 6 * t * 2 * d * 14336
    assert f["total"] - f["router"] == stock


def test_flops_match_model_accounting():
    from megascale_jax.config import default_config
    from megascale_jax.model.accounting import model_size
    m = default_config("mixtral_small", **{"model.num_layers": 1}).model
    size = model_size(m, seq_len=8192)
    embed_head = 3 * 2 * m.hidden * m.vocab_size                  # the output head (the embedding is a lookup)
    assert size.train_flops_per_token * 8192 - embed_head * 8192 == pytest.approx(plan.train_flops(plan.FULL),
                                                                                   rel=1e-9)


def _results(ours, bound, tt, o2=None, t2=None, dense=None):
    r = {"ours_block": {"ok": True, "ms": ours}, "stock_bound": {"ok": True, "ms": bound},
         "torchtitan_block": {"ok": True, "ms": tt}}
    if o2:
        r["ours_2layer"] = {"ok": True, "ms": o2}
    if t2:
        r["torchtitan_2layer"] = {"ok": True, "ms": t2}
    if dense:
        r["jax_dense_gemm"] = {"ok": True, "ms": dense, "n": 8192}
    return r


def test_verdicts():
    v = results.verdicts(_results(ours=40.0, bound=38.0, tt=48.0, o2=80.0, t2=100.0, dense=1.5), plan.FULL)
    assert v["ours_over_bound"] == pytest.approx(0.95)
    assert v["goal_bound"]["met"] is True
    assert v["ours_over_torchtitan"] == pytest.approx(1.2)
    assert v["goal_torchtitan"]["ahead"] is True and v["goal_torchtitan"]["met"] is True
    assert v["ours_over_torchtitan_2layer"] == pytest.approx(1.25)
    assert v["ours_over_same_run_dense_gemm_rate"] > 0
    v = results.verdicts(_results(ours=40.0, bound=30.0, tt=42.0), plan.FULL)
    assert v["goal_bound"]["met"] is False
    assert v["goal_torchtitan"]["ahead"] is True and v["goal_torchtitan"]["met"] is False


def test_verdicts_missing_variants_are_none():
    v = results.verdicts({"ours_block": {"ok": True, "ms": 40.0},
                          "torchtitan_block": {"ok": False, "error": "x"}}, plan.FULL)
    assert v["ours_over_torchtitan"] is None and v["goal_torchtitan"]["met"] is None
    assert v["goal_bound"]["met"] is None


def test_assemble_json_shape_and_table():
    res = _results(ours=36.0, bound=33.0, tt=45.0, dense=1.5)
    res["maxtext_block"] = {"ok": True, "ms": 180.0}
    res["maxtext_block_tokamax"] = {"ok": True, "ms": 72.0}
    doc = results.assemble(res, plan.FULL, {"jax": {"device_kind": "H200"}}, ["n"], tiny=False)
    doc = json.loads(json.dumps(doc))
    assert set(doc) >= {"environment", "shapes", "flops", "variants", "verdicts", "notes", "peak_tflops"}
    assert doc["shapes"]["layout"] == "1 x 8192" and doc["shapes"]["tokens"] == 8192
    assert set(doc["variants"]) == {v[0] for v in plan.VARIANTS}
    ours = doc["variants"]["ours_block"]
    assert ours["tflops"] == pytest.approx(plan.train_flops(plan.FULL) / 36e-3 / 1e12)
    assert ours["mfu"] == pytest.approx(ours["tflops"] / 989.0)
    assert doc["variants"]["jax_dense_gemm"]["tflops"] == pytest.approx(2 * 8192 ** 3 / 1.5e-3 / 1e12)
    assert doc["variants"]["torchtitan_2layer"]["ok"] is False
    assert doc["verdicts"]["ours_over_maxtext"] == pytest.approx(2.0)          # against its faster variant
    assert doc["verdicts"]["maxtext_fastest"] == "maxtext_block_tokamax"
    assert doc["variants"]["maxtext_block"]["mfu"] == pytest.approx(ours["mfu"] / 5.0)
    text = results.table(doc)
    assert "ours / bound" in text and "ours_block" in text and "ours / MaxText        = 2.000x" in text
    res["maxtext_block_tokamax"] = {"ok": False, "error": "x"}
    assert results.verdicts(res, plan.FULL)["ours_over_maxtext"] == pytest.approx(5.0)


def test_jsonl_roundtrip(tmp_path):
    p = str(tmp_path / "r.jsonl")
    contract.emit(p, "ours_block", ok=True, ms=1.0)
    contract.emit(p, "stock_bound", ok=False, error="boom")
    with open(p, "a") as f:
        f.write('{"name": "trunc')                                 # a worker killed mid-write
    got = contract.read_jsonl(p)
    assert got["ours_block"]["ms"] == 1.0 and got["stock_bound"]["error"] == "boom"


def test_plan_and_cli(capsys):
    assert bp.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "1 x 8192 tokens" in out and "torchtitan_block" in out and "maxtext_block" in out
    assert bp.main(["--dry-run", "--tiny", "--only", "ours_block"]) == 0
    assert "[not selected]" in capsys.readouterr().out


def test_orchestrator_imports_neither_jax_nor_torch():
    """The orchestrator and every module it imports (the workers' included) load JAX / torch only inside the
    functions that run in a worker subprocess, so a JAX crash cannot take the orchestrator down with it."""
    code = ("import sys; import benchmarks.bench_peers; "
            "print(sorted(m for m in ('jax', 'torch', 'numpy', 'flax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_script_runs_as_a_plain_file_without_pythonpath(tmp_path):
    """`python3 benchmarks/bench_peers.py` (also how the workers start) finds its sibling modules by itself."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_peers.py"), "--list"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    assert "maxtext_block" in out.stdout


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks import plot_peers
    doc = results.assemble(_results(ours=36.0, bound=33.0, tt=45.0, dense=1.5), plan.FULL, {}, [], tiny=False)
    assert [b[0] for b in plot_peers.bars(doc)] == ["ours_block", "stock_bound", "torchtitan_block"]
    path = plot_peers.plot(doc, str(tmp_path / "p.png"))
    assert os.path.getsize(path) > 0


def test_maxtext_without_its_wheels_is_recorded_as_not_run(tmp_path):
    """No MaxText wheels: its variants are recorded as not run, with the fetch command, and no worker starts."""
    out = tmp_path / "peers.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_peers.py"), "--tiny", "--only",
                    "maxtext_block,maxtext_block_tokamax", "--maxtext-wheels", str(tmp_path / "none"),
                    "--out", str(out)], cwd=ROOT, capture_output=True, text=True, check=True, timeout=120)
    doc = json.loads(out.read_text())
    for name in ("maxtext_block", "maxtext_block_tokamax"):
        assert doc["variants"][name]["ok"] is False
        assert "get_maxtext_wheels.sh" in doc["variants"][name]["skipped"]
    assert doc["verdicts"]["ours_over_maxtext"] is None


MAXTEXT_WHEELS = os.path.join(ROOT, ".whl", "maxtext")


def _one_device_env() -> dict:
    """The worker's environment: one CPU device (not the suite's 8), LLVM at -O0 as in the suite (see conftest.py:
    it compiles faster; the tests check what the workers record, not how fast their code runs)."""
    return {**os.environ, "XLA_FLAGS": "--xla_backend_optimization_level=0"}


@pytest.mark.skipif(not os.path.isdir(MAXTEXT_WHEELS) or not os.listdir(MAXTEXT_WHEELS),
                    reason="MaxText's wheels are not in .whl/maxtext (bash benchmarks/get_maxtext_wheels.sh)")
def test_tiny_maxtext_worker_runs_its_layer_dropless(tmp_path):
    """MaxText's Mixtral layer end to end on the CPU through the orchestrator (its wheels installed for its worker
    alone): built from its config, finite output and nonzero gradients, MaxText's own overflow flag read (no
    token dropped), timed. The tokamax variant has no CPU kernel (tokamax picks its TPU one there): an error
    record, not a crash of the worker."""
    out = tmp_path / "peers.json"
    env = _one_device_env()
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_peers.py"), "--tiny", "--only",
                    "maxtext_block,maxtext_block_tokamax", "--workdir", str(tmp_path / "work"), "--out", str(out)],
                   cwd=ROOT, env=env, capture_output=True, text=True, check=True, timeout=400)
    doc = json.loads(out.read_text())
    mt = doc["variants"]["maxtext_block"]
    assert mt["ok"], mt.get("error")
    assert mt["ms"] > 0 and mt["grads_nonzero"] and mt["output_finite"] and mt["grads_finite"]
    assert mt["dropless"] and not mt["tokens_dropped"] and mt["overflow_flags"] >= 1
    assert sum(mt["tokens_per_expert"]) == plan.TINY.tokens * plan.TINY.top_k
    assert mt["kernels"] == {"attention": "dot_product", "moe": "ragged_dot"} and mt["maxtext_version"] == "0.2.5"
    assert doc["variants"]["maxtext_block_tokamax"]["ok"] is False
    assert "TPU" in doc["variants"]["maxtext_block_tokamax"]["error"]


def test_tiny_jax_worker_times_the_block_variants_round_by_round(tmp_path):
    """The JAX worker end to end on the CPU (tiny shapes, xla kernels): the dense GEMM and the three block
    variants of jax-core all come back measured, the blocks from one set of timing rounds."""
    out = tmp_path / "peers.json"
    env = _one_device_env()   # one CPU device, as a user runs it
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_peers.py"), "--tiny", "--only",
                    "jax_dense_gemm,ours_block,ours_block_grid_tiles,stock_bound", "--out", str(out)],
                   cwd=ROOT, env=env, capture_output=True, text=True, check=True, timeout=300)
    variants = json.loads(out.read_text())["variants"]
    blocks = ["ours_block", "stock_bound", "ours_block_grid_tiles"]
    for name in ["jax_dense_gemm", *blocks]:
        assert variants[name]["ok"], (name, variants[name].get("error"))
        assert variants[name]["ms"] > 0 and len(variants[name]["per_loop_ms"]) == 2
    assert all(sorted(variants[b]["timed_with"]) == sorted(blocks) for b in blocks)
