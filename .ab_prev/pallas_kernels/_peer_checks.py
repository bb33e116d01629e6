"""What every kernel that reaches peers (`plgpu.remote_ref` stores, semaphores on other devices) checks before
it is built, with one-line errors that name the fix: kernels `gemm_all_to_all.py` and `all_to_all_gemm.py`."""
from __future__ import annotations

import jax
from jax import lax


def check_exchange_runnable(kernel: str, *, interpret: bool, ranks: int, operand: str, axis) -> None:
    """`kernel(exchange=True)` can run here: not in the interpreter (it has no semaphores or remote refs), on
    a GPU backend, one process driving all the mesh's GPUs, and `ranks` (the leading dim of `operand`) equal
    to the size of `axis` (inside shard_map)."""
    if interpret:
        raise ValueError(f"{kernel}(interpret=True) needs exchange=False: the interpreter has no semaphores or "
                         "remote refs")
    if jax.default_backend() != "gpu":
        raise ValueError(f"{kernel}(exchange=True) is a Mosaic GPU kernel; the backend is "
                         f"{jax.default_backend()!r}: use {kernel}_reference there")
    # Not yet run with several processes (Mosaic reaches peers through XLA's collective metadata). A mock
    # topology (compile-only tests) reports one process per mock host, but nothing runs there.
    if jax.process_count() > 1 and not jax.config.values.get("jax_mock_gpu_topology"):
        raise ValueError(f"{kernel}(exchange=True) needs one process driving all GPUs; this job has "
                         f"{jax.process_count()} processes: use the ring exchange (parallel.attention_exchange='ring')")
    if ranks != lax.axis_size(axis):
        raise ValueError(f"{operand} has {ranks} ranks in dim 0 but axis {axis!r} has {lax.axis_size(axis)}; "
                         "they must match")
