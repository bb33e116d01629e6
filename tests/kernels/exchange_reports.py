"""What the exchange kernels' GPU tests share (tests/kernels/test_gemm_all_to_all.py, test_all_to_all_gemm.py):
their reports run in a subprocess of the test file (a mock GPU topology is set before jax starts, and a wrong
semaphore count hangs a kernel rather than failing it, so a timeout must end it), the compile report of a
lowered program, and the run report of a kernel against its twin."""
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def report_in_subprocess(test_file: str, arg: str, *, timeout: int, compile_only: bool = False) -> dict:
    """`python test_file arg` on the GPU (JAX_PLATFORMS dropped); its last stdout line is the JSON report."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    if compile_only:   # nothing is timed: skip autotuning
        env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0"
    proc = subprocess.run([sys.executable, os.path.abspath(test_file), arg], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def hlo_report(text: str) -> dict:
    """The Mosaic GPU calls in a compiled program's text and whether they reach peers through XLA's
    collective metadata."""
    return {"mosaic_calls": text.count("mosaic_gpu"),
            "collective_metadata": re.search(r"uses_xla_collective_metadata\W+true", text) is not None}


def compile_report(jitted, *args) -> dict:
    """`hlo_report` of jitted(*args) compiled on every (mock) device, and the device count."""
    return {"devices": jax.device_count(), **hlo_report(jitted.lower(*args).compile().as_text())}


def _f32(a):
    return np.asarray(a, np.float64)


def twin_report(fused, twin, x, w, key) -> dict:
    """fused(x, w) against twin(x, w): the forward, a second launch (same bits), and the gradients of a
    random linear loss in x and w (the custom VJP's wiring)."""
    got, want = _f32(fused(x, w)), _f32(twin(x, w))
    again = _f32(fused(x, w))
    dy = jax.random.normal(key, got.shape, jnp.float32).astype(jnp.bfloat16)
    loss = lambda fn: lambda x, w: jnp.sum(fn(x, w).astype(jnp.float32) * dy)  # noqa: E731
    grads = [jax.jit(jax.grad(loss(fn), argnums=(0, 1)))(x, w) for fn in (fused, twin)]
    return {"devices": jax.device_count(), "max_abs_err": float(np.max(np.abs(got - want))),
            "max_abs_ref": float(np.max(np.abs(want))), "repeat_identical": bool(np.array_equal(again, got)),
            "grad_max_rel_err": max(float(np.max(np.abs(_f32(a) - _f32(b))) / np.max(np.abs(_f32(b))))
                                    for a, b in zip(*grads))}


def assert_equals_twin(report: dict) -> None:
    assert report["devices"] >= 2 and report["repeat_identical"], report
    assert report["max_abs_err"] <= 1e-2 * max(1.0, report["max_abs_ref"]), report   # bf16 output rounding
    assert report["grad_max_rel_err"] < 2e-2, report
