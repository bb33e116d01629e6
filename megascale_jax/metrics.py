"""What the trainer reports: MFU, a metrics log (JSONL + TensorBoard), a progress bar, a step timer.

MFU (model FLOPs utilisation) = model FLOPs per token x tokens/s / (devices x dense peak FLOP/s).
The model FLOPs come from the model (6 x active params + attention, no rematerialisation counted);
the peak comes from `PEAK_BF16_FLOPS`, looked up from `jax.Device.device_kind`. Where the peak is
unknown (CPU, an unlisted GPU) MFU is None and printed as "n/a" rather than guessed.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import sys
import time
from typing import Any, Callable, Iterator, Mapping, TextIO

import jax
import numpy as np
from tqdm import tqdm

log = logging.getLogger(__name__)

# Dense bf16 peak FLOP/s per device (dense, no sparsity: NVIDIA's data sheets print the 2:4
# structured-sparsity figure first, which is twice these). H800 is the export H100: same SXM
# compute, less NVLink bandwidth.
PEAK_BF16_FLOPS: dict[str, float] = {
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100 SXM": 989e12,
    "H200": 989e12,
    "H800": 989e12,
    "A100": 312e12,
}

# device_kind tokens that pick a table row, most specific first. SXM H100s report only the chip and
# memory ("NVIDIA H100 80GB HBM3"), so "H100" alone means SXM once PCIe and NVL are ruled out.
# Matching whole tokens keeps "GH200" (a Grace-Hopper superchip) from passing for an "H200".
_KIND_TOKENS: tuple[tuple[frozenset[str], str], ...] = (
    (frozenset({"H100", "PCIE"}), "H100 PCIe"),
    (frozenset({"H100", "NVL"}), "H100 NVL"),
    (frozenset({"H100"}), "H100 SXM"),
    (frozenset({"H200"}), "H200"),
    (frozenset({"H800"}), "H800"),
    (frozenset({"A100"}), "A100"),
)


def peak_flops_per_device(device: Any) -> float | None:
    """Dense bf16 peak FLOP/s of a `jax.Device` (or a device_kind string); None if unknown/CPU.

    Accepts the strings jax reports, e.g. 'NVIDIA H200', 'NVIDIA H100 80GB HBM3', 'H100-SXM5-80GB'.
    """
    if isinstance(device, str):
        kind = device
    else:
        if getattr(device, "platform", None) == "cpu":
            return None
        kind = getattr(device, "device_kind", None)
        if not isinstance(kind, str):
            raise ValueError(f"device={device!r} has no device_kind string; pass a jax.Device "
                             "(e.g. jax.devices()[0]) or its device_kind.")
    tokens = set(re.split(r"[^A-Z0-9]+", kind.upper()))
    for required, name in _KIND_TOKENS:
        if required <= tokens:
            return PEAK_BF16_FLOPS[name]
    return None


def model_flops_utilization(flops_per_token: float, tokens_per_second: float | None,
                            num_devices: int, peak_per_device: float | None) -> float | None:
    """Fraction (0..1) of the devices' dense peak the model's FLOPs use.

    None when the peak is unknown (CPU) or no rate was measured yet (the compile step).
    """
    if flops_per_token <= 0:
        raise ValueError(f"flops_per_token={flops_per_token} must be > 0 (model FLOPs per token, "
                         "forward + backward).")
    if tokens_per_second is not None and tokens_per_second < 0:
        raise ValueError(f"tokens_per_second={tokens_per_second} must be >= 0.")
    if num_devices < 1:
        raise ValueError(f"num_devices={num_devices} must be >= 1 (jax.device_count()).")
    if peak_per_device is None or tokens_per_second is None:
        return None
    if peak_per_device <= 0:
        raise ValueError(f"peak_per_device={peak_per_device} must be > 0 FLOP/s (None if unknown).")
    return flops_per_token * tokens_per_second / (num_devices * peak_per_device)


def format_mfu(mfu: float | None) -> str:
    """'41.3%', or 'n/a' when the peak (hence MFU) is unknown."""
    return "n/a" if mfu is None else f"{100.0 * mfu:.1f}%"


def format_rate(tokens_per_second: float | None) -> str:
    """'1.41M tok/s'; 'n/a' before the first timed window."""
    if tokens_per_second is None:
        return "n/a tok/s"
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if tokens_per_second >= scale:
            return f"{tokens_per_second / scale:.2f}{suffix} tok/s"
    return f"{tokens_per_second:.1f} tok/s"


def _format_loss(loss: float | None) -> str:
    return "n/a" if loss is None else f"{loss:.4f}"


# ---- metrics log ---------------------------------------------------------------------------------

_RESERVED_KEYS = ("step", "split", "time")
_tensorboard_notice_given = False


def _to_float(name: str, value: Any) -> float | None:
    """Python float of a scalar (python, numpy, or jax; a jax value costs one host sync).

    None stays None: a value not measured yet (MFU on CPU, tokens/s of the compile step).
    """
    if value is None:
        return None
    array = np.asarray(value)
    if array.size != 1 or not (np.issubdtype(array.dtype, np.number) or array.dtype == bool):
        raise ValueError(f"metric {name!r} must be a numeric scalar, got {type(value).__name__} "
                         f"of shape {array.shape}; reduce it first (e.g. x.mean()).")
    return float(array.reshape(()))


def _json_number(value: float | None) -> float | str | None:
    # Strict JSON has no NaN/Infinity; strings keep the information and float("nan") reads it back.
    return value if value is None or math.isfinite(value) else str(value)


class MetricsWriter:
    """Appends `{"step", "split", "time", **values}` per call to `out_dir/metrics.jsonl`, and the
    same scalars to TensorBoard (`out_dir/tensorboard/`, tag "split/name") if tensorboardX imports.
    A None value (not measured) is written as JSON null and has no TensorBoard point.

    Only the primary process writes (`primary` defaults to `jax.process_index() == 0`), so a
    multi-node run does not interleave lines in one file. Non-finite values are written as the
    strings "nan" / "inf" / "-inf". After a resume the steps past the checkpoint are run again and
    appear again in the JSONL: readers keep the last line per (step, split). `purge_step` (the
    resumed step) makes TensorBoard hide its stale events past that step.
    """

    def __init__(self, out_dir: str, *, tensorboard: bool = True, primary: bool | None = None,
                 purge_step: int | None = None):
        if not out_dir:
            raise ValueError("out_dir is empty: pass the run's output folder (config.output.dir).")
        self.primary = jax.process_index() == 0 if primary is None else primary
        self.jsonl_path = os.path.join(out_dir, "metrics.jsonl")
        self._jsonl: TextIO | None = None
        self._tensorboard = None
        if not self.primary:
            return
        os.makedirs(out_dir, exist_ok=True)
        self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")
        if tensorboard:
            self._tensorboard = _open_tensorboard(os.path.join(out_dir, "tensorboard"), purge_step)

    @property
    def has_tensorboard(self) -> bool:
        return self._tensorboard is not None

    def write(self, step: int, values: Mapping[str, Any], *, split: str = "train") -> None:
        """One record: values are numeric scalars (or None); `split` is e.g. "train" or "eval"."""
        if not split:
            raise ValueError("split is empty: name the record's split, e.g. 'train' or 'eval'.")
        clash = [k for k in values if k in _RESERVED_KEYS]
        if clash:
            raise ValueError(f"metric names {clash} clash with the record's own keys "
                             f"{_RESERVED_KEYS}; rename them.")
        floats = {name: _to_float(name, value) for name, value in values.items()}
        if not self.primary:
            return
        if self._jsonl is None:
            raise ValueError("write() after close(): this MetricsWriter is closed.")
        record = {"step": int(step), "split": split, "time": time.time()}
        record.update({name: _json_number(v) for name, v in floats.items()})
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()  # a crashed run still has every line up to the crash
        if self._tensorboard is not None:
            for name, value in floats.items():
                if value is not None:
                    self._tensorboard.add_scalar(f"{split}/{name}", value, int(step))

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _open_tensorboard(logdir: str, purge_step: int | None):
    global _tensorboard_notice_given
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        if not _tensorboard_notice_given:
            _tensorboard_notice_given = True
            log.warning("tensorboardX is not installed: metrics go to metrics.jsonl only "
                        "(pip install tensorboardX for TensorBoard event files).")
        return None
    return SummaryWriter(logdir=logdir, purge_step=purge_step, flush_secs=30)


# ---- progress bar --------------------------------------------------------------------------------

class ProgressBar:
    """Loss, tokens/s, MFU and ETA of a training run.

    On a terminal: a tqdm bar redrawn in place (tqdm's own ETA). Not a terminal (CI, SLURM logs,
    a pipe): redrawing would write a carriage-return soup, so instead one compact line is printed
    when at least `line_every` steps passed since the previous line, and always at the last step:
        step 120/1000 | loss 3.2140 | 12.34k tok/s | MFU 41.3% | ETA 0:05:12
    The ETA there extrapolates the steps/s seen since the first update (so after compilation).
    """

    def __init__(self, total_steps: int, start_step: int = 0, *, line_every: int = 10,
                 file: TextIO | None = None, clock: Callable[[], float] = time.perf_counter):
        if total_steps < 1:
            raise ValueError(f"total_steps={total_steps} must be >= 1.")
        if not 0 <= start_step <= total_steps:
            raise ValueError(f"start_step={start_step} must be in [0, total_steps={total_steps}].")
        if line_every < 1:
            raise ValueError(f"line_every={line_every} must be >= 1.")
        self.total_steps, self.line_every = total_steps, line_every
        self._file = sys.stdout if file is None else file
        self._clock = clock
        self.is_tty = bool(getattr(self._file, "isatty", lambda: False)())
        self._bar = tqdm(total=total_steps, initial=start_step, file=self._file, unit="step",
                         dynamic_ncols=True, disable=not self.is_tty)
        self._last_step, self._last_line_step = start_step, start_step
        self._first_update: tuple[int, float] | None = None

    def update(self, step: int, loss: float | None, tokens_per_s: float | None,
               mfu: float | None) -> None:
        """Report that `step` is done (step counts from 1; the bar ends at total_steps)."""
        if step < self._last_step:
            raise ValueError(f"step={step} went backwards (last update was {self._last_step}).")
        now = self._clock()
        if self._first_update is None:
            self._first_update = (step, now)
        fields = (_format_loss(loss), format_rate(tokens_per_s), format_mfu(mfu))
        if self.is_tty:
            self._bar.set_postfix_str(f"loss {fields[0]} | {fields[1]} | MFU {fields[2]}",
                                      refresh=False)
            self._bar.update(step - self._last_step)
        elif step - self._last_line_step >= self.line_every or step == self.total_steps:
            print(f"step {step}/{self.total_steps} | loss {fields[0]} | {fields[1]} | "
                  f"MFU {fields[2]} | ETA {self._eta(step, now)}", file=self._file, flush=True)
            self._last_line_step = step
        self._last_step = step

    def _eta(self, step: int, now: float) -> str:
        first_step, first_time = self._first_update
        if step <= first_step:
            return "n/a"
        seconds_per_step = (now - first_time) / (step - first_step)
        return tqdm.format_interval(seconds_per_step * (self.total_steps - step))

    def message(self, text: str) -> None:
        """A line of its own (e.g. an eval result) that does not break the bar on a terminal."""
        if self.is_tty:
            self._bar.write(text, file=self._file)
        else:
            print(text, file=self._file, flush=True)

    def close(self) -> None:
        self._bar.close()


# ---- step timer ----------------------------------------------------------------------------------

class StepTimer:
    """Tokens/s between log steps, without syncing the host every step.

    Steps are dispatched asynchronously, so wall time means something only after blocking on a
    step's outputs, which `lap(step, outputs)` does; call it at log steps only. The first lap just
    starts the clock (returns None), so compilation and the first step are never counted; each
    later lap returns the rate over the steps since the previous lap. Work that is not training
    (eval, a blocking checkpoint) goes inside `with timer.excluded(outputs):` and its wall time
    is taken out of the current window.

        timer = StepTimer(tokens_per_step=global_batch * seq_len)
        for step in range(start, total):
            state, metrics = train_step(state, batch)
            if (step + 1) % log_every == 0 or step == start:
                tokens_per_s = timer.lap(step + 1, metrics)   # None on the first lap
            if eval_now:
                with timer.excluded(state):
                    eval_loss = run_eval(state)
    """

    def __init__(self, tokens_per_step: int, *, clock: Callable[[], float] = time.perf_counter):
        if tokens_per_step < 1:
            raise ValueError(f"tokens_per_step={tokens_per_step} must be >= 1 "
                             "(global batch size x sequence length).")
        self.tokens_per_step = tokens_per_step
        self._clock = clock
        self._lap_step: int | None = None
        self._lap_time = 0.0
        self._excluded_seconds = 0.0
        self.seconds_per_step: float | None = None  # over the last measured window

    def lap(self, step: int, outputs: Any = None) -> float | None:
        """Blocks on `outputs` (the step's results); tokens/s since the last lap.

        None on the first lap, and when `step` repeats the previous lap's (that restarts the clock).
        """
        jax.block_until_ready(outputs)
        now = self._clock()
        if self._lap_step is not None and step < self._lap_step:
            raise ValueError(f"step={step} is before the previous lap's step {self._lap_step}.")
        if self._lap_step is None or step == self._lap_step:
            self._lap_step, self._lap_time, self._excluded_seconds = step, now, 0.0
            return None
        elapsed = now - self._lap_time - self._excluded_seconds
        if elapsed <= 0:
            return None  # a coarse clock that did not move: keep the window open, steps and all
        steps = step - self._lap_step
        self._lap_step, self._lap_time, self._excluded_seconds = step, now, 0.0
        self.seconds_per_step = elapsed / steps
        return steps * self.tokens_per_step / elapsed

    @contextlib.contextmanager
    def excluded(self, outputs: Any = None) -> Iterator[None]:
        """Wall time inside the block does not count; blocks on `outputs` (training in flight)
        first so that the training steps still running are not excluded with it."""
        jax.block_until_ready(outputs)
        start = self._clock()
        try:
            yield
        finally:
            if self._lap_step is not None:
                self._excluded_seconds += self._clock() - start
