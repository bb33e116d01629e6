"""Multi-process training on localhost: 2 processes x 4 CPU devices train exactly like 1 process x 8 devices,
with plain data parallelism and with ZeRO-1 + BF16 gradient communication; checkpoints move between the two."""
import json
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest

ARGS = ["--config", "configs/tiny_cpu.py", "--config.train.warmup_steps=1",
        "--config.train.global_batch=8", "--config.train.seq_len=32", "--config.train.log_every=1",
        "--config.train.eval_every=0", "--config.output.tensorboard=False"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _train(out, processes: int, extra=(), timeout=300, steps=4, cache=None):
    """`cache`: a compilation cache directory for a 1-process run, so that a test's 1-process runs of the same
    program (a straight run and its resumed twin) compile it once; a hit is the executable XLA built for the
    identical HLO. The 2-process runs compile their own (their processes would write the same entries at once)."""
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={8 // processes} --xla_backend_optimization_level=0"}
    if cache is not None and processes == 1:
        env.update(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.3")
    base = [sys.executable, "-m", "megascale_jax.train", *ARGS, f"--config.train.steps={steps}",
            f"--config.output.dir={out}", *extra]
    port = _free_port()
    cmds = [base] if processes == 1 else [
        base + [f"--coordinator=localhost:{port}", f"--num_processes={processes}", f"--process_id={i}"]
        for i in range(processes)]
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in cmds]
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (stdout, stderr) in zip(procs, outputs):
        assert p.returncode == 0, stderr[-3000:]
    lines = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    return [l["loss"] for l in lines if l["split"] == "train"], outputs[0][0]


def test_two_processes_of_four_devices_equal_one_process_of_eight_with_zero1_bf16(tmp_path):
    """3 steps: the third loss follows the second update, which reads the sharded moments the first one wrote
    (a step of the 2-process run costs ~0.9 s on 2 CPU cores: its collectives go between the processes)."""
    extra = ("--config.parallel.plan=manual", "--config.parallel.optimizer_sharding=zero1",
             "--config.parallel.grad_comm=bf16")
    single = _train(str(tmp_path / "one"), 1, extra, steps=3)[0]
    multi, stdout = _train(str(tmp_path / "two"), 2, extra, steps=3)
    assert len(single) == 3
    assert "2 process(es)" in stdout and "data=8" in stdout
    np.testing.assert_allclose(multi, single, rtol=1e-5)


def test_two_processes_equal_one_and_their_checkpoint_resumes_in_one(tmp_path):
    """Plain data parallelism: 2 processes x 4 devices train like 1 x 8; the 2-process run's step-2 checkpoint,
    resumed in 1 process, continues it exactly (the same 2-process run serves both checks). The resumed run
    needs 2 steps after the checkpoint: step 3's loss reads the restored parameters, step 4's the restored
    moments and schedule position too."""
    cache = tmp_path / "compilation_cache"   # the resumed run's step is the straight 1-process run's program
    single = _train(str(tmp_path / "one"), 1, cache=cache)[0]
    ckpt = ["--config.checkpoint.every=2", "--config.checkpoint.keep=2"]
    multi, stdout = _train(str(tmp_path / "two"), 2, ckpt + [f"--config.checkpoint.dir={tmp_path / 'ckpt'}"])
    assert "2 process(es)" in stdout and "data=8" in stdout
    np.testing.assert_allclose(multi, single, rtol=1e-5)
    # Resume from the step-2 checkpoint alone (a copy without step 4); steps 0 and 1 used the same 4-step
    # learning-rate schedule the resumed run follows.
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["2", "4"]
    shutil.copytree(tmp_path / "ckpt" / "2", tmp_path / "ckpt2" / "2")
    resumed, stdout = _train(str(tmp_path / "b"), 1, ckpt + [f"--config.checkpoint.dir={tmp_path / 'ckpt2'}"],
                             cache=cache)
    assert "resumed from" in stdout and "at step 2" in stdout
    np.testing.assert_allclose(multi[:2] + resumed, single, rtol=1e-5)


def test_hf_import_in_two_processes_equals_one_process(tmp_path):
    """`convert import` under 2 processes x 4 devices (SP+EP over intra 4): each process builds only its own
    devices' blocks; the checkpoint it writes holds the same parameters as a 1-process import."""
    import jax
    from megascale_jax import config as config_lib, step
    from megascale_jax.checkpoint import Checkpointer

    tiny = {"model.vocab_size": 256, "model.hidden": 64, "model.num_heads": 4, "model.num_kv_heads": 2,
            "model.num_layers": 2, "model.moe.num_experts": 4, "model.moe.top_k": 2, "model.moe.expert_ffn": 32,
            "model.rope_theta": 10000.0, "model.norm_eps": 1e-5, "train.global_batch": 2, "train.seq_len": 16,
            "plan_recipe": "megascale", "parallel.intra": 4}
    hf = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf", "mixtral")
    flags_ = ["--config", "configs/tiny_cpu.py", *[f"--config.{k}={v}" for k, v in tiny.items()], "--hf", hf]
    port = _free_port()
    outs = {}
    for processes in (1, 2):
        out = str(tmp_path / f"ckpt{processes}")
        env = {**os.environ, "PYTHONPATH": os.getcwd(), "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": f"--xla_force_host_platform_device_count={8 // processes} --xla_backend_optimization_level=0"}
        base = [sys.executable, "-m", "megascale_jax.convert", "import", *flags_, "--out", out]
        cmds = [base] if processes == 1 else [
            base + [f"--coordinator=localhost:{port}", f"--num_processes={processes}", f"--process_id={i}"]
            for i in range(processes)]
        procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for c in cmds]
        try:
            results = [p.communicate(timeout=300) for p in procs]
        finally:
            for p in procs:
                p.kill()
        for p, (_, stderr) in zip(procs, results):
            assert p.returncode == 0, stderr[-3000:]
        outs[processes] = out
    cfg = config_lib.default_config("tiny_cpu", jax.device_count(), **tiny)
    trainer = step.build(cfg)
    restored = {}
    for processes, out in outs.items():
        with Checkpointer(out, save_every=0, keep=1, async_save=False) as ckpt:
            restored[processes], _ = ckpt.restore(trainer.checkpoint_abstract)
    one, two = (jax.tree.leaves(restored[n]["params"]) for n in (1, 2))
    assert len(one) == len(two) > 10
    for a, b in zip(one, two):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert max(float(np.abs(np.asarray(a)).max()) for a in one) > 0   # real weights, not zeros
