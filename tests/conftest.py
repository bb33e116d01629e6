"""Test setup: 8 simulated CPU devices, set before jax is imported anywhere.

Every sharded component is tested against the single-device computation on these devices.
GPU-only tests carry the `gpu` marker and are skipped (with a reason) where no GPU is present.
"""
import atexit
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu" if os.environ.get("MEGASCALE_TEST_GPU") != "1" else "")

# On the CPU the suite's time is mostly XLA compiling many small programs, and most of a compile is LLVM
# optimizing the generated kernels: LLVM at -O0 compiles them ~30-50% faster (a tiny_cpu train step 9.0 -> 6.4 s,
# its init 5.1 -> 2.1 s) and runs these tests' small programs about as fast. Only LLVM's code generation changes:
# the HLO and XLA's own passes (fusion, sharding, collectives: what the tests and the HLO byte counts check) are
# the same, and without fast-math LLVM keeps IEEE float semantics at every level. Not on GPU runs (the GPU tests
# and benchmarks measure the real build); an explicit level in XLA_FLAGS wins.
if os.environ.get("MEGASCALE_TEST_GPU") != "1" and "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

import jax  # noqa: E402  (must come after XLA_FLAGS)
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# Many tests compile the very same program (the same model init, the same train step of a straight run and of
# its resumed twin): a compilation cache of this test run's own, new each session and deleted at exit, compiles
# each program once. A hit is the executable XLA built for the identical HLO and options, so nothing a test checks
# changes. The pytest-xdist workers share the controller's cache (the directory travels in an environment variable
# the controller sets before it starts them); a size limit makes jax lock each read and write (with `filelock`),
# so a worker never reads a file the other is still writing. Set through jax.config, so subprocesses that tests
# start do not use it.
_CACHE_ENV = "MEGASCALE_TEST_COMPILATION_CACHE"
if "PYTEST_XDIST_WORKER" in os.environ and os.environ.get(_CACHE_ENV):
    _COMPILATION_CACHE = os.environ[_CACHE_ENV]                  # the controller owns (and deletes) it
else:
    _COMPILATION_CACHE = tempfile.mkdtemp(prefix="megascale-jax-test-cache-")
    os.environ[_CACHE_ENV] = _COMPILATION_CACHE
    atexit.register(shutil.rmtree, _COMPILATION_CACHE, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _COMPILATION_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.3)
jax.config.update("jax_compilation_cache_max_size", 8 << 30)   # never reached; turns on the locking


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (run on the GPU machine)")
    config.addinivalue_line("markers", "slow: takes more than ~20 s on 2 CPU cores")


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="GPU-only test: no GPU here (run with MEGASCALE_TEST_GPU=1 on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
