"""Test setup: 8 simulated CPU devices, set before jax is imported anywhere.

Every sharded component is tested against the single-device computation on these devices.
GPU-only tests carry the `gpu` marker and are skipped (with a reason) where no GPU is present.
"""
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu" if os.environ.get("MEGASCALE_TEST_GPU") != "1" else "")

import jax  # noqa: E402  (must come after XLA_FLAGS)
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


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
