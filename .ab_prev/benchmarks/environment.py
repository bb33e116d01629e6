"""What every benchmark JSON records about where it ran: device, versions, date."""
from __future__ import annotations

import datetime
import platform

import jax
import jaxlib


def environment() -> dict:
    devices = jax.devices()
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device_kind": devices[0].device_kind,
        "platform": devices[0].platform,
        "num_devices": len(devices),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "python": platform.python_version(),
    }
    for name in ("flax", "optax", "orbax.checkpoint", "triton", "torch", "tokamax"):
        try:
            module = __import__(name, fromlist=["__version__"])
            info[name] = getattr(module, "__version__", "?")
        except Exception:  # noqa: BLE001 - a missing optional package is simply not recorded
            pass
    return info
