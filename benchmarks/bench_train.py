"""Train-step throughput of whole configs, side by side in one process: tokens/s, step time, MFU.

    python -m benchmarks.bench_train --configs tiny_cpu,mixtral_small --steps 30 \
        --set kernels.grouped_gemm=xla --out benchmarks/results/train_baseline_h200.json

Each config runs the real trainer, `python -m megascale_jax.train` (synthetic or real data as configured), in a
subprocess for `--steps` steps, logging every `--log-every`, and reads its metrics.jsonl; throughput is the
median over log intervals after the first (the first interval includes compilation). `--variant
NAME:key=value,...` adds runs of the same configs with overrides, e.g. `--variant xla:kernels.grouped_gemm=xla`.
"""
from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

import jax

from benchmarks import gpu_trace
from benchmarks.environment import environment
from benchmarks.hlo_sources import instruction_sources
from megascale_jax.config import default_config
from megascale_jax.metrics import peak_flops_per_device
from megascale_jax.model.accounting import model_size


def _parse_overrides(text: str) -> dict:
    out = {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=", 1)
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exhausted|Interrupt)\b.*")


def failure_summary(stderr: str, tail: int = 600) -> str:
    """The failed run's exception line first (the last line that names one, e.g. 'jax.errors.JaxRuntimeError:
    RESOURCE_EXHAUSTED: ...'), then the end of its stderr: a cut traceback alone does not say what failed."""
    lines = [line for line in stderr.splitlines() if _EXCEPTION_LINE.match(line)]
    head = lines[-1][:600] if lines else "(no exception line in stderr)"
    return f"{head} | stderr ends: {stderr[-tail:]}"


def run_trainer(name: str, overrides: dict, out_dir: str, hlo_dump_dir: str | None = None) -> list[dict]:
    """`python -m megascale_jax.train --config configs/<name>.py --config.<key>=<value> ...` as a user runs it;
    returns its logged train records (metrics.jsonl). A failed run raises with the tail of its stderr.
    `hlo_dump_dir`: XLA writes the train step's compiled HLO there (see `step_sources`)."""
    flags = [f"--config.{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in overrides.items()]
    cmd = [sys.executable, "-m", "megascale_jax.train", f"--config=configs/{name}.py", *flags]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    if hlo_dump_dir:
        env["XLA_FLAGS"] = " ".join(filter(None, [env.get("XLA_FLAGS"), f"--xla_dump_to={hlo_dump_dir}",
                                                  "--xla_dump_hlo_as_text", "--xla_dump_hlo_module_re=jit_step_fn"]))
    proc = subprocess.run(cmd, stderr=subprocess.PIPE, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"{name} {' '.join(flags)} exited {proc.returncode}: {failure_summary(proc.stderr)}")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r.get("split") == "train"]


def step_hlo(dump_dir: str) -> str:
    """The train step's optimized HLO text in an XLA dump (the largest `jit_step_fn` module, should the trainer
    have compiled more than one)."""
    dumps = glob.glob(os.path.join(dump_dir, "*jit_step_fn*after_optimizations.txt"))
    if not dumps:
        raise FileNotFoundError(f"no *jit_step_fn*after_optimizations.txt in {dump_dir}: "
                                "did XLA_FLAGS reach the trainer?")
    with open(max(dumps, key=os.path.getsize)) as f:
        return f.read()


def step_sources(dump_dir: str) -> dict:
    """benchmarks/hlo_sources.instruction_sources of the train step's optimized HLO in an XLA dump."""
    return instruction_sources(step_hlo(dump_dir))


def bench_config(name: str, steps: int, log_every: int, overrides: dict, profile_steps: int = 0,
                 profile_top: int = 25, with_sources: bool = False, hlo_copy: str | None = None) -> dict:
    """`profile_steps` > 0 traces that many steps at the end of the run (after compilation and warm-up) and adds
    the GPU time breakdown of `benchmarks.gpu_trace` as row["profile"]; `with_sources` also names each listed
    kernel's jax op and source line (from an XLA dump of the step) and sums the non-GEMM ones by line;
    `hlo_copy`: with `with_sources`, the step's optimized HLO is also written there, gzipped (to read a fusion)."""
    profile = {"profile.start_step": steps - profile_steps, "profile.num_steps": profile_steps} if profile_steps \
        else {}
    with tempfile.TemporaryDirectory() as tmp:
        overrides = {"train.steps": steps, "train.log_every": log_every, "train.eval_every": 0,
                     "train.warmup_steps": min(5, steps), "output.dir": tmp, "output.tensorboard": False,
                     **profile, **overrides}
        cfg = default_config(name, num_devices=jax.device_count(), **overrides)   # errors before the run
        dump_dir = os.path.join(tmp, "xla") if profile_steps and with_sources else None
        logged = run_trainer(name, overrides, tmp, dump_dir)
        breakdown = gpu_trace.breakdown(gpu_trace.load_trace(gpu_trace.latest_trace_file(
            os.path.join(tmp, "profile"))), profile_steps, top=profile_top,
            sources=step_sources(dump_dir) if dump_dir else None) if profile_steps else None
        if dump_dir and hlo_copy:
            with gzip.open(hlo_copy, "wt") as f:
                f.write(step_hlo(dump_dir))
        if breakdown and dump_dir:
            breakdown["other_top_kernels_ms_by_source"] = gpu_trace.other_by_source(breakdown["top_kernels"])
    rates = [l["tokens_per_s"] for l in logged[1:] if l.get("tokens_per_s")]
    size = model_size(cfg.model, cfg.train.seq_len)
    tokens_per_s = statistics.median(rates) if rates else None
    peak = peak_flops_per_device(jax.devices()[0])
    tokens_per_step = cfg.train.global_batch * cfg.train.seq_len
    return {
        "config": name, "overrides": {k: v for k, v in overrides.items() if k != "output.dir"}, "steps": steps,
        "global_batch": cfg.train.global_batch, "seq_len": cfg.train.seq_len,
        "total_params": size.total_params, "active_params": size.active_params,
        "train_flops_per_token": size.train_flops_per_token,
        "tokens_per_s_median": tokens_per_s,
        "step_time_s_median": tokens_per_step / tokens_per_s if tokens_per_s else None,
        "tflops_per_device": size.train_flops_per_token * tokens_per_s / jax.device_count() / 1e12
        if tokens_per_s else None,
        "mfu": size.train_flops_per_token * tokens_per_s / jax.device_count() / peak if tokens_per_s and peak
        else None,
        "losses": [round(l["loss"], 4) for l in logged],
        "tokens_per_s_intervals": rates,
        **({"profile": breakdown} if breakdown else {}),
    }


BENCHMARK = "bench_train"


def write_json(path: str, payload: dict) -> None:
    """Rewritten after every run so a run cut short by a time limit still leaves its finished rows."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="tiny_cpu")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--set", default="", help="overrides for every run: key=value,key=value")
    ap.add_argument("--variant", action="append", default=[], help="NAME:key=value,... (extra runs)")
    ap.add_argument("--no-default", action="store_true", help="run only the --variant rows")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="trace the last N steps of each run and add benchmarks/gpu_trace.py's breakdown")
    ap.add_argument("--profile-top", type=int, default=25, help="kernels listed by name in each profile")
    ap.add_argument("--hlo-sources", action="store_true",
                    help="with --profile-steps: name each listed kernel's jax op and source line (XLA dump)")
    ap.add_argument("--save-hlo", action="store_true",
                    help="with --hlo-sources: write each run's step HLO next to --out "
                         "(<out>.<config>.<variant>.hlo.gz)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.hlo_sources and not args.profile_steps:
        ap.error("--hlo-sources names the profiled kernels' sources: give --profile-steps N too")
    if args.save_hlo and not args.hlo_sources:
        ap.error("--save-hlo writes the HLO that --hlo-sources dumps: give --hlo-sources too")
    common = _parse_overrides(args.set)
    variants = ([] if args.no_default else [("default", {})]) + [(v.split(":", 1)[0], _parse_overrides(v.split(":", 1)[1]))
                                    for v in args.variant]
    results = []
    for name in args.configs.split(","):
        for variant, extra in variants:
            try:
                row = bench_config(name, args.steps, args.log_every, {**common, **extra}, args.profile_steps,
                                   args.profile_top, args.hlo_sources,
                                   f"{args.out}.{name}.{variant}.hlo.gz" if args.save_hlo else None)
            except Exception as err:  # noqa: BLE001 - record the failure next to the other results
                row = {"config": name, "overrides": {**common, **extra}, "error": f"{type(err).__name__}: {err}"[:1600]}
            row["variant"] = variant
            results.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("losses", "tokens_per_s_intervals")}),
                  flush=True)
            write_json(args.out, {"benchmark": BENCHMARK, "environment": environment(), "results": results})


if __name__ == "__main__":
    main()
