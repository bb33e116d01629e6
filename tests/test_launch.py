"""Launch scripts (syntax, dry-run rendering, env.sh contents) and single-process distributed helpers.

The 2-process x 4-device run is in tests/parallel/test_zero.py (test_two_processes_match_one_process).
"""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from megascale_jax.parallel import distributed

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "launch"
SCRIPTS = ["env.sh", "slurm_train.sbatch", "local.sh"]
FAKE_SLURM = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "8",
              "SLURM_CPUS_PER_TASK": "12"}


def _bash(script: str, env_extra: dict, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(env_extra)
    return subprocess.run(["bash", script, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("name", SCRIPTS)
def test_scripts_parse(name):
    result = subprocess.run(["bash", "-n", str(LAUNCH / name)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_env_sh_sets_required_variables(tmp_path):
    shown = subprocess.run(
        ["bash", "-c", "source launch/env.sh && env"], cwd=REPO, capture_output=True, text=True,
        env={"PATH": os.environ["PATH"], "HOME": str(tmp_path), "XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    env = dict(line.split("=", 1) for line in shown.stdout.splitlines() if "=" in line)
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["NVSHMEM_DISABLE_NVLS"] == "1"
    flags = env["XLA_FLAGS"].split()
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags
    assert flags[0] == "--xla_force_host_platform_device_count=2", "the caller's XLA_FLAGS must be kept"
    assert "nvshmem" not in env["XLA_FLAGS"], "NVSHMEM is opt-in (MEGASCALE_NVSHMEM=1)"


def test_env_sh_every_setting_has_a_reason():
    for line in (LAUNCH / "env.sh").read_text().splitlines():
        code = line.split("#", 1)[0].strip()
        if re.match(r"(export \w+=|--xla_)", code):
            assert "#" in line and line.split("#", 1)[1].strip(), f"no reason given for: {line!r}"


def test_env_sh_xla_flags_known_to_installed_xla(tmp_path):
    """XLA aborts at start-up on an unknown XLA_FLAGS entry, also for GPU flags on the CPU backend."""
    code = "import jax, jax.numpy as jnp; print(float(jnp.arange(4.0).sum()))"
    result = subprocess.run(
        ["bash", "-c", f"source launch/env.sh && {shlex.quote(sys.executable)} -c {shlex.quote(code)}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={"PATH": os.environ["PATH"], "HOME": str(tmp_path), "JAX_PLATFORMS": "cpu",
             "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla_cache")})
    assert result.returncode == 0 and result.stdout.strip() == "6.0", result.stderr[-2000:]


def test_sbatch_dry_run_renders_srun_command():
    result = _bash("launch/slurm_train.sbatch", {**FAKE_SLURM, "DRY_RUN": "1", "CONFIG": "configs/tiny_cpu.py",
                                                 "SLURM_SUBMIT_DIR": str(REPO)},
                   "--steps", "10", "--name", "two words")
    assert result.returncode == 0, result.stderr
    cmd = shlex.split(result.stdout)
    srun_opts, program = cmd[:cmd.index("python")], cmd[cmd.index("python"):]
    assert srun_opts[0] == "srun"
    assert {"--nodes=2", "--ntasks-per-node=8", "--ntasks=16", "--kill-on-bad-exit=1"} <= set(srun_opts)
    assert not any(o.startswith("--gpus-per-task") for o in srun_opts), \
        "each task must see every GPU of its node: jax picks GPU SLURM_LOCALID itself"
    assert program == ["python", "-m", "megascale_jax.train", "--config", "configs/tiny_cpu.py",
                       "--steps", "10", "--name", "two words"]
    assert "NCCL_NVLS_ENABLE=0" in result.stderr


def test_sbatch_requires_config_and_allocation():
    no_config = _bash("launch/slurm_train.sbatch", {**FAKE_SLURM, "DRY_RUN": "1"})
    assert no_config.returncode != 0 and "CONFIG" in no_config.stderr
    no_slurm = _bash("launch/slurm_train.sbatch", {"DRY_RUN": "1", "CONFIG": "configs/tiny_cpu.py"})
    assert no_slurm.returncode != 0 and "SLURM" in no_slurm.stderr


def test_local_dry_run_renders_single_process_command():
    result = _bash("launch/local.sh", {"DRY_RUN": "1", "CONFIG": "configs/tiny_cpu.py"}, "--steps", "5")
    assert result.returncode == 0, result.stderr
    cmd = shlex.split(result.stdout)
    assert "srun" not in cmd
    assert cmd[1:] == ["-m", "megascale_jax.train", "--config", "configs/tiny_cpu.py", "--steps", "5"]


def test_initialize_single_process_is_a_noop(monkeypatch, capsys):
    for var in [v for v in os.environ if v.startswith("SLURM_")]:
        monkeypatch.delenv(var)
    info = distributed.initialize()
    assert (info.source, info.process_id, info.num_processes, info.global_devices) == ("single", 0, 1, 8)
    assert capsys.readouterr().out.count("\n") == 1
    assert distributed.initialize("localhost:1", 1, 0, verbose=False).source == "single"


@pytest.mark.parametrize("args,match", [
    (("localhost:1234", None, 0), "num_processes"),
    (("localhost:1234", 2, 2), "process_id=2"),
    (("localhost", 2, 0), "host:port"),
])
def test_initialize_rejects_bad_flags(args, match):
    with pytest.raises(ValueError, match=match):
        distributed.initialize(*args)
