"""Entry point: flags -> config -> distributed init -> step.build (mesh, state shardings) -> loop (log, eval,
checkpoint). The step itself is megascale_jax/step.py; nothing imports this module but its tests.

    python -m megascale_jax.train --config configs/tiny_cpu.py [--config.train.steps=50] [--profile]

The default config is the tiny CPU model on the built-in real-text corpus.
"""
from __future__ import annotations

import collections
import difflib
import importlib.util
import os
import re
import statistics
import sys

from absl import app, flags
from ml_collections import config_flags

import jax
import numpy as np
from jax.sharding import NamedSharding

from megascale_jax import config as config_lib
from megascale_jax import data as data_lib
from megascale_jax import metrics as metrics_lib
from megascale_jax import step as step_lib
from megascale_jax.checkpoint import Checkpointer, CheckpointError
from megascale_jax.model.accounting import model_size
from megascale_jax.parallel import distributed
from megascale_jax.parallel.pipeline_schedules import schedule_summary


def global_batch(sampler: data_lib.BatchSampler, step: int, split: str, sharding: NamedSharding):
    """Assembles the global batch; each process computes only the rows of its own devices."""
    shape = (sampler.global_batch, sampler.seq_len)
    cache = {}

    def rows(index):
        key = index[0].indices(shape[0])[:2]
        if key not in cache:
            cache[key] = sampler.batch_for_rows(step, range(*key), split=split)
        return cache[key]

    return {name: jax.make_array_from_callback(shape, sharding, lambda idx, n=name: rows(idx)[n][:, idx[1]])
            for name in ("inputs", "targets")}


class DivergenceError(RuntimeError):
    """A step's loss or gradient was not finite under train.nonfinite='stop'; the message says where and what next."""


def _check_finite(cfg, state, done: int, ckpt) -> int:
    """Number of non-finite steps so far (one small device read, only at log / checkpoint / last steps);
    under 'stop' any is a DivergenceError naming the step and the last good checkpoint."""
    count, first = (int(x) for x in jax.device_get(state["nonfinite"]))
    if count and cfg.train.nonfinite == "stop":
        good = ckpt.latest_step() if ckpt is not None else None
        where = f"{cfg.checkpoint.dir} step {good}" if good is not None else "none (no checkpoint.dir or none saved)"
        raise DivergenceError(
            f"step {first}: the loss or a gradient is not finite (train.nonfinite='stop'); stopped after step {done}, "
            f"no checkpoint written from it. Last good checkpoint: {where}. Restart from it with a lower "
            "train.learning_rate (or tighter train.grad_clip), or set --config.train.nonfinite=skip.")
    return count


# ------------------------------------------------------------------------------------------------ loop
def run(cfg: config_lib.Config, *, profile: bool = False, devices=None, stop_after: int | None = None) -> list[dict]:
    """Trains `cfg` on `devices` (default all); returns the logged train metrics (one dict per log step).

    Resumes from the newest checkpoint in config.checkpoint.dir when there is one. `stop_after` ends the run
    early at that step (what a preemption does), without changing the schedule, which follows train.steps.
    """
    trainer = step_lib.build(cfg, devices)
    out_dir = cfg.output.dir or os.path.join("runs", cfg.name)
    source = data_lib.make_source(cfg.data.source, path=cfg.data.path, dtype=cfg.data.dtype,
                                  vocab_size=cfg.model.vocab_size, seed=cfg.train.seed,
                                  cache_dir=cfg.data.cache_dir or None)
    sampler = data_lib.BatchSampler(source, cfg.train.seq_len, cfg.train.global_batch, cfg.train.seed,
                                    cfg.data.eval_fraction)
    size = model_size(cfg.model, cfg.train.seq_len)
    peak = metrics_lib.peak_flops_per_device(jax.devices()[0])
    _banner(cfg, trainer, size, peak, source)

    ckpt = Checkpointer(cfg.checkpoint.dir, save_every=cfg.checkpoint.every, keep=cfg.checkpoint.keep,
                        async_save=cfg.checkpoint.async_save) if cfg.checkpoint.dir else None
    if ckpt is not None and ckpt.latest_step() is not None:
        state, extra = ckpt.restore(trainer.checkpoint_abstract)
        state = step_lib.resumed(trainer, state)
        print(f"resumed from {cfg.checkpoint.dir} at step {extra['step']}", flush=True)
    else:
        state = step_lib.create_state(trainer)
    start = int(jax.device_get(state["step"]))

    train_step, eval_step = step_lib.make_train_step(trainer), step_lib.make_eval_step(trainer)
    batch_sharding = trainer.batch_sharding()
    writer = metrics_lib.MetricsWriter(out_dir, tensorboard=cfg.output.tensorboard, purge_step=start or None) \
        if jax.process_index() == 0 else None
    bar = metrics_lib.ProgressBar(cfg.train.steps, start) if jax.process_index() == 0 else None
    timer = metrics_lib.StepTimer(tokens_per_step=cfg.train.global_batch * cfg.train.seq_len)
    profile_start = cfg.profile.start_step if cfg.profile.start_step >= 0 else (5 if profile else -1)
    logged, recent_losses, spikes = [], collections.deque(maxlen=20), 0
    for step in range(start, min(cfg.train.steps, stop_after or cfg.train.steps)):
        if step == profile_start:
            jax.block_until_ready(state)   # the trace starts at a step boundary, not inside the previous step
            jax.profiler.start_trace(os.path.join(out_dir, "profile"))
        state, metrics = train_step(state, global_batch(sampler, step, "train", batch_sharding))
        if step == profile_start + cfg.profile.num_steps - 1 and profile_start >= 0:
            jax.block_until_ready(state)
            jax.profiler.stop_trace()
        done = step + 1
        last = done == min(cfg.train.steps, stop_after or cfg.train.steps)
        saving = ckpt is not None and cfg.checkpoint.every and done % cfg.checkpoint.every == 0
        if done % cfg.train.log_every == 0 or last or done == start + 1 or saving:
            _check_finite(cfg, state, done, ckpt)
        if done % cfg.train.log_every == 0 or done == cfg.train.steps or done == start + 1:
            record = {k: float(v) for k, v in jax.device_get(metrics).items()}
            # Loss spikes are reported, not acted on: above loss_spike_factor x the median of recent logged losses.
            if len(recent_losses) >= 3 and record["loss"] > cfg.train.loss_spike_factor * statistics.median(recent_losses):
                spikes += 1
            recent_losses.append(record["loss"])
            record["loss_spikes"] = spikes
            tokens_per_s = timer.lap(done, metrics)
            record["tokens_per_s"] = tokens_per_s
            record["mfu"] = metrics_lib.model_flops_utilization(size.train_flops_per_token, tokens_per_s,
                                                                trainer.mesh.devices.size, peak)
            logged.append({"step": done, **record})
            if writer:
                writer.write(done, record, split="train")
                bar.update(done, record["loss"], tokens_per_s, record["mfu"])
        if cfg.train.eval_every and (done % cfg.train.eval_every == 0 or done == cfg.train.steps):
            with timer.excluded(state):
                ce = np.mean([float(eval_step(state["params"], global_batch(sampler, i, "eval", batch_sharding)))
                              for i in range(cfg.train.eval_batches)])
            if writer:
                writer.write(done, {"ce": ce}, split="eval")
                bar.message(f"step {done}: eval loss {ce:.4f}")
        if ckpt is not None:
            ckpt.maybe_save(done, step_lib.checkpointed(state), {"step": done, "config": cfg.name})
    if ckpt is not None:
        ckpt.wait()
        ckpt.close()
    if writer:
        bar.close()
        writer.close()
    return logged


def _banner(cfg, trainer, size, peak, source) -> None:
    if jax.process_index() != 0:
        return
    p = trainer.plan
    lines = [
        f"megascale-jax | config {cfg.name} | jax {jax.__version__} | {jax.process_count()} process(es)",
        f"devices: {trainer.mesh.devices.size} x {jax.devices()[0].device_kind} "
        f"(peak {'n/a' if peak is None else f'{peak / 1e12:.0f} TFLOP/s bf16'})",
        f"mesh: data={p.data} pipe={p.pipe} intra={p.intra} | recipe {cfg.plan_recipe}: plan {p.kind} (attention "
        f"{p.attention}, ffn {p.ffn}, dispatch {p.dispatch}) | MoE layer {cfg.parallel.moe_layer}"
        f"{f' ({cfg.parallel.overlap_chunks} chunks)' if cfg.parallel.overlap_chunks > 1 else ''}"
        f"{_fused_exchanges(cfg)}, remat {cfg.train.remat} | kernels: attention {trainer.kernels.attention}, "
        f"grouped GEMM {trainer.kernels.grouped_gemm} (tail {trainer.kernels.grouped_gemm_tail}), "
        f"swiglu {trainer.kernels.swiglu} (dense {trainer.kernels.dense_swiglu}), loss {trainer.kernels.cross_entropy}, "
        f"row moves {trainer.kernels.permute}, adamw {trainer.kernels.adamw}" + _steps_banner(cfg),
        f"model: {size.summary()}",
        f"data: {getattr(source, 'description', type(source).__name__)} | batch {cfg.train.global_batch} x "
        f"{cfg.train.seq_len} tokens",
    ]
    print("\n".join(lines), flush=True)


def define_flags() -> None:
    """Command-line flags; defined only when this module is the program (others import it freely)."""
    config_flags.DEFINE_config_file("config", "configs/tiny_cpu.py", "configs/<model>.py to train.")
    flags.DEFINE_bool("profile", False, "Trace steps [5, 8) with jax.profiler (unless config.profile.start_step "
                      "is set) into <output>/profile.")
    flags.DEFINE_string("coordinator", None, "host:port of process 0 (multi-host without SLURM).")
    flags.DEFINE_integer("num_processes", None, "Process count (multi-host without SLURM).")
    flags.DEFINE_integer("process_id", None, "This process's index (multi-host without SLURM).")
    flags.DEFINE_bool("debug", False, "Show the traceback of user errors (config, data, checkpoint, divergence).")


def _fused_exchanges(cfg) -> str:
    """' (dispatch ..., attention ...)' for the fused schedule: how its rows and tiles move."""
    p = cfg.parallel
    return f" (dispatch {p.dispatch_exchange}, attention {p.attention_exchange})" if p.moe_layer == "fused" else ""


def _steps_banner(cfg) -> str:
    p, t = cfg.parallel, cfg.train
    optimizer = f" | optimizer {p.optimizer_sharding}, gradients {p.grad_comm}"
    if p.pipe == 1:
        accumulate = f" | {t.microbatches} microbatches accumulated" if t.microbatches > 1 else ""
        return accumulate + optimizer
    bubble = schedule_summary(p.pipeline_schedule, p.pipe, t.microbatches, p.virtual_stages)
    return (f" | pipeline {p.pipeline_schedule}, {t.microbatches} microbatches, virtual {p.virtual_stages}, "
            f"bubble {bubble['bubble_fraction_formula']:.1%}" + optimizer)


# User errors end the run with one line and exit code 2 (3 for divergence); --debug shows the traceback.
USER_ERRORS = ((config_lib.ConfigError, "config error"), (data_lib.DataError, "data error"),
               (CheckpointError, "checkpoint error"), (DivergenceError, "diverged"))


def main(argv) -> None:
    del argv
    f = flags.FLAGS
    distributed.initialize(f.coordinator, f.num_processes, f.process_id)
    try:
        run(config_lib.from_config_dict(f.config, num_devices=jax.device_count()), profile=f.profile)
    except tuple(kind for kind, _ in USER_ERRORS) as err:
        if f.debug:
            raise
        label = next(name for kind, name in USER_ERRORS if isinstance(err, kind))
        print(f"{label}: {' '.join(str(err).split())}", file=sys.stderr, flush=True)
        sys.exit(3 if isinstance(err, DivergenceError) else 2)


def precheck_config_overrides(argv: list[str]) -> str | None:
    """The one-line error for a `--config.<key>=` override naming no key of the config file, before absl's
    flag parser turns it into chained tracebacks; None when every override names a known key."""
    path = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if path is None and "--config" in argv[:-1]:
        path = argv[argv.index("--config") + 1]
    path = (path or "configs/tiny_cpu.py").split(":")[0]
    if not os.path.isfile(path):
        return f"config error: --config={path} is not a file; pass a config such as configs/tiny_cpu.py"
    spec = importlib.util.spec_from_file_location("_megascale_user_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    known = _dotted_keys(module.get_config().to_dict())
    for arg in argv:
        match = re.match(r"--config\.([\w.]+)(=|$)", arg)
        if match and match.group(1) not in known:
            close = difflib.get_close_matches(match.group(1), sorted(known), n=1)
            hint = f"; did you mean config.{close[0]}?" if close else "; configs/base.py lists every key"
            return f"config error: unknown config key config.{match.group(1)}{hint}"
    return None


def _dotted_keys(tree: dict, prefix: str = "") -> set[str]:
    out = set()
    for key, value in tree.items():
        out |= _dotted_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key}
    return out


if __name__ == "__main__":
    define_flags()
    problem = None if "--debug" in sys.argv else precheck_config_overrides(sys.argv[1:])
    if problem:
        print(problem, file=sys.stderr)
        sys.exit(2)
    app.run(main)
