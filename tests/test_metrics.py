"""Metrics: peak lookup, MFU arithmetic, JSONL + TensorBoard log, progress bar, step timer."""
import glob
import io
import json
import logging
import struct
import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megascale_jax import metrics
from megascale_jax.metrics import (
    MetricsWriter, ProgressBar, StepTimer, format_mfu, format_rate, model_flops_utilization,
    peak_flops_per_device)


@pytest.mark.parametrize("kind, peak", [
    ("NVIDIA H200", 989e12),
    ("NVIDIA H100 80GB HBM3", 989e12),
    ("H100-SXM5-80GB", 989e12),
    ("NVIDIA H800", 989e12),
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA A100 80GB PCIe", 312e12),
    ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA GH200 480GB", None),   # not an H200: whole tokens only
    ("cpu", None),
    ("NVIDIA GeForce RTX 4090", None),
])
def test_peak_lookup_from_device_kind(kind, peak):
    assert peak_flops_per_device(kind) == peak
    assert peak_flops_per_device(SimpleNamespace(platform="gpu", device_kind=kind)) == peak


def test_peak_is_none_on_cpu_devices_and_bad_device_is_an_error():
    assert peak_flops_per_device(jax.devices()[0]) is None
    # The platform decides, whatever the kind string says.
    assert peak_flops_per_device(SimpleNamespace(platform="cpu", device_kind="NVIDIA H200")) is None
    with pytest.raises(ValueError, match="device_kind"):
        peak_flops_per_device(SimpleNamespace(platform="gpu"))


def test_mfu_arithmetic_on_hand_numbers():
    # 6e9 FLOP/token x 1e5 tok/s = 6e14 FLOP/s, over 8 x 1e15 peak = 7.5 %.
    assert model_flops_utilization(6e9, 1e5, 8, 1e15) == pytest.approx(0.075, rel=1e-12)
    # One H200 at its dense peak: 989e12 / 1e9 FLOP per token = 989k tok/s is exactly 100 %.
    peak = peak_flops_per_device("NVIDIA H200")
    assert model_flops_utilization(1e9, 989e3, 1, peak) == pytest.approx(1.0, rel=1e-12)
    assert model_flops_utilization(6e9, 1e5, 8, None) is None
    assert model_flops_utilization(6e9, None, 8, 1e15) is None   # no rate yet (compile step)
    assert format_mfu(None) == "n/a"
    assert format_mfu(0.075) == "7.5%"
    assert format_rate(1.41e6) == "1.41M tok/s" and format_rate(None) == "n/a tok/s"
    for args, name in (((0, 1e5, 8, 1e15), "flops_per_token"), ((6e9, -1, 8, 1e15), "tokens_per"),
                       ((6e9, 1e5, 0, 1e15), "num_devices"), ((6e9, 1e5, 8, 0.0), "peak_per")):
        with pytest.raises(ValueError, match=name):
            model_flops_utilization(*args)


def _read_tensorboard_scalars(logdir):
    """{tag: [(step, value)]} from tensorboardX event files (TFRecord framing, Event protos)."""
    from tensorboardX.proto import event_pb2
    scalars = {}
    for path in glob.glob(f"{logdir}/events.out.tfevents*"):
        data = open(path, "rb").read()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4  # length, its crc, payload, payload crc
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_metrics_writer_jsonl_and_tensorboard(tmp_path):
    with MetricsWriter(str(tmp_path)) as writer:
        assert writer.has_tensorboard
        writer.write(10, {"loss": jnp.float32(2.5), "dropped_tokens": np.int64(3), "lr": 1e-3,
                          "grad_norm": float("nan"), "mfu": None})
        writer.write(10, {"loss": jnp.asarray([1.25])}, split="eval")
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [set(r) for r in records] == [
        {"step", "split", "time", "loss", "dropped_tokens", "lr", "grad_norm", "mfu"},
        {"step", "split", "time", "loss"}]
    train, evaluation = records
    assert (train["step"], train["split"], train["loss"], train["dropped_tokens"]) == \
        (10, "train", 2.5, 3.0)
    assert train["grad_norm"] == "nan" and np.isnan(float(train["grad_norm"]))
    assert train["mfu"] is None                          # not measured: null, not a made-up 0
    assert evaluation == {"step": 10, "split": "eval", "time": evaluation["time"], "loss": 1.25}
    scalars = _read_tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars["train/loss"] == [(10, 2.5)]
    assert scalars["eval/loss"] == [(10, 1.25)]
    assert scalars["train/lr"][0][1] == pytest.approx(1e-3)
    assert "train/mfu" not in scalars


def test_metrics_writer_appends_and_rejects_bad_values(tmp_path):
    with MetricsWriter(str(tmp_path), tensorboard=False) as writer:
        assert not writer.has_tensorboard
        writer.write(1, {"loss": 3.0})
        with pytest.raises(ValueError, match="'loss' must be a numeric scalar"):
            writer.write(2, {"loss": jnp.ones((2,))})
        with pytest.raises(ValueError, match="clash"):
            writer.write(2, {"step": 2})
    with MetricsWriter(str(tmp_path), tensorboard=False) as writer:  # a resumed run appends
        writer.write(2, {"loss": 2.0})
    steps = [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    assert not glob.glob(str(tmp_path / "tensorboard" / "*"))


def test_metrics_writer_without_tensorboardx_and_on_non_primary(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # makes the import fail
    monkeypatch.setattr(metrics, "_tensorboard_notice_given", False)
    with caplog.at_level(logging.WARNING, logger="megascale_jax.metrics"):
        for run in ("a", "b"):
            with MetricsWriter(str(tmp_path / run)) as writer:
                assert not writer.has_tensorboard
                writer.write(1, {"loss": 1.0})
    assert sum("tensorboardX is not installed" in r.message for r in caplog.records) == 1
    assert (tmp_path / "b" / "metrics.jsonl").read_text().count("\n") == 1
    with MetricsWriter(str(tmp_path / "other_host"), primary=False) as writer:
        writer.write(1, {"loss": 1.0})
    assert not (tmp_path / "other_host").exists()


class _FakeClock:
    def __init__(self, step_seconds):
        self.now, self.step_seconds = 0.0, step_seconds

    def __call__(self):
        self.now += self.step_seconds
        return self.now


def test_progress_bar_without_tty_prints_compact_lines():
    out = io.StringIO()  # isatty() is False, as in CI logs
    bar = ProgressBar(30, 0, line_every=10, file=out, clock=_FakeClock(2.0))
    for step in range(1, 31):
        bar.update(step, loss=4.0 - step / 10, tokens_per_s=12345.0 if step > 1 else None,
                   mfu=None)
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and "\r" not in out.getvalue()
    # Clock advances 2 s per update; ETA at step 10 = 20 steps left x 2 s.
    assert lines[0] == "step 10/30 | loss 3.0000 | 12.35k tok/s | MFU n/a | ETA 00:40"
    assert lines[2].startswith("step 30/30 | loss 1.0000") and lines[2].endswith("ETA 00:00")


def test_progress_bar_resume_tty_and_errors():
    out = io.StringIO()
    bar = ProgressBar(30, 25, line_every=10, file=out)
    bar.update(26, 2.0, 1e3, 0.4)
    bar.message("step 30: eval loss 1.6000")
    bar.update(30, 1.5, 1e3, 0.4)   # the last step always prints
    assert out.getvalue().splitlines() == [
        "step 30: eval loss 1.6000",
        "step 30/30 | loss 1.5000 | 1.00k tok/s | MFU 40.0% | ETA 00:00"]
    with pytest.raises(ValueError, match="went backwards"):
        bar.update(29, 1.0, 1e3, 0.4)

    class _Terminal(io.StringIO):
        def isatty(self):
            return True
    terminal = _Terminal()
    bar = ProgressBar(5, 0, file=terminal)
    assert bar.is_tty
    for step in range(1, 6):
        bar.update(step, 2.0, 2e6, None)
    bar.message("eval loss 1.9")
    bar.close()
    assert "5/5" in terminal.getvalue() and "MFU n/a" in terminal.getvalue()
    assert "eval loss 1.9\n" in terminal.getvalue()
    with pytest.raises(ValueError, match="start_step"):
        ProgressBar(5, 6)


class _Output:
    """A step output that counts how often the host waited on it."""
    syncs = 0

    def block_until_ready(self):
        _Output.syncs += 1
        return self


def test_step_timer_excludes_the_first_step_and_excluded_work():
    clock = _FakeClock(0.0)
    timer = StepTimer(tokens_per_step=1000, clock=clock)
    _Output.syncs = 0
    clock.now = 100.0                                  # the first step compiled for 100 s
    assert timer.lap(1, _Output()) is None             # first lap: starts the clock only
    clock.now += 4 * 0.5                               # steps 2..5, 0.5 s each
    assert timer.lap(5, _Output()) == pytest.approx(4 * 1000 / 2.0)
    assert _Output.syncs == 2                          # the host waited only at the two laps
    assert timer.seconds_per_step == pytest.approx(0.5)

    clock.now += 5 * 0.5                               # steps 6..10
    with timer.excluded(_Output()):
        clock.now += 30.0                              # an eval: not training time
    clock.now += 10 * 0.5                              # steps 11..20
    assert timer.lap(20, {"loss": jnp.float32(1.0)}) == pytest.approx(15 * 1000 / 7.5)
    assert timer.lap(20) is None                       # same step again: restarts the clock
    with pytest.raises(ValueError, match="before the previous lap"):
        timer.lap(19)
    with pytest.raises(ValueError, match="tokens_per_step"):
        StepTimer(0)
