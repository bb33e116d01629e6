"""Multi-process start-up and process-local data.

`initialize` starts `jax.distributed` from explicit flags, or from SLURM's environment (one process per
task; jax reads SLURM_NTASKS / SLURM_PROCID / SLURM_LOCALID and gives each task the GPU numbered
SLURM_LOCALID), and does nothing for a single process. Each process then loads only its slice of the
global batch (`process_batch_slice`) and `make_global_array` assembles the global, sharded array.
"""
from __future__ import annotations

import dataclasses
import os

import jax

_SLURM_TASKS = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    process_id: int
    num_processes: int
    local_devices: int
    global_devices: int
    source: str  # 'single' | 'explicit' | 'slurm'

    def describe(self) -> str:
        return (f"distributed[{self.source}]: process {self.process_id}/{self.num_processes}, "
                f"{self.local_devices} local / {self.global_devices} global devices "
                f"({jax.devices()[0].platform})")


def _slurm_num_tasks() -> int | None:
    if "SLURM_JOB_ID" not in os.environ or "SLURM_PROCID" not in os.environ:
        return None
    for var in _SLURM_TASKS:
        if var in os.environ:
            return int(os.environ[var])
    return None


def _validate_explicit(coordinator, num_processes, process_id) -> None:
    given = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    missing = [k for k, v in given.items() if v is None]
    if missing:
        raise ValueError(f"explicit multi-process start needs coordinator, num_processes and process_id; "
                         f"missing {missing} (or pass none of them to use SLURM / a single process)")
    if num_processes < 1:
        raise ValueError(f"num_processes={num_processes} must be >= 1")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id} must be in [0, num_processes={num_processes})")
    if ":" not in coordinator:
        raise ValueError(f"coordinator={coordinator!r} must be 'host:port', e.g. 'localhost:12355'")


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, verbose: bool = True) -> ProcessInfo:
    """Start jax.distributed when there is more than one process; prints one line per process.

    - all three arguments given: explicit start (num_processes == 1 is a no-op);
    - none given, inside an srun step with > 1 task: jax auto-detects SLURM;
    - otherwise: single process, nothing to start.
    Must run before any jax computation. Calling it again after a start is a no-op.
    """
    explicit = any(v is not None for v in (coordinator, num_processes, process_id))
    if explicit:
        _validate_explicit(coordinator, num_processes, process_id)
    source = "single"
    if jax.distributed.is_initialized():
        source = "explicit" if explicit else ("slurm" if _slurm_num_tasks() else "explicit")
    elif explicit and num_processes > 1:
        jax.distributed.initialize(coordinator, num_processes, process_id)
        source = "explicit"
    elif not explicit and (_slurm_num_tasks() or 1) > 1:
        jax.distributed.initialize()
        source = "slurm"
    info = ProcessInfo(jax.process_index(), jax.process_count(), jax.local_device_count(),
                       jax.device_count(), source)
    if verbose:
        print(info.describe(), flush=True)
    return info
