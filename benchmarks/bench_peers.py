"""Peers benchmark: one Mixtral-shaped MoE block fwd+bwd (GQA causal attention + top-2 of 8 dropless experts),
and the same 2-layer stack, in this project, torchtitan's MoE block (torch.compile), MaxText's Mixtral layer, the
stock JAX variants and the dense-equivalent bound. Same shapes, same input tokens, one device call.

    python3 benchmarks/bench_peers.py --out $OUT/peers.json          # on the GPU machine
    python3 benchmarks/bench_peers.py --list                          # the plan, no JAX / torch import
    python3 benchmarks/bench_peers.py --tiny --out /tmp/peers.json   # tiny shapes, CPU fallbacks (xla)

Shapes (default): T = 8192 tokens as 1 x 8192 (batch 1, sequence 8192), hidden 4096, 32 q / 8 kv heads of
128, 8 experts of FFN 14336, top-2, bf16, causal. FLOPs as megascale_jax/model/accounting.py counts one layer:
2 per active matmul parameter per token (q/k/v/o projections, the top-2 experts' three GEMMs, the router) plus
the attention core 2*S*H*K per token (causal halving included); fwd+bwd = 3 x fwd. Every variant is charged
the same FLOPs (the model FLOPs of the block), so TFLOP/s ratios are time ratios.

Robustness: the orchestrator imports neither JAX nor torch; each group runs in its own subprocess
(`--worker jax-core | torch | jax-extra | maxtext`) with a timeout cut from one global budget (--budget-s), each
variant inside its own try/except, and every result is appended to a JSON-lines file as soon as it is measured, so
a crash or a timeout loses only the variant that was running. peers.json is rewritten after every group.
torch never shares a process with JAX (and JAX runs with XLA_PYTHON_CLIENT_PREALLOCATE=false); MaxText runs in
a process of its own with its wheels (.whl/maxtext, benchmarks/get_maxtext_wheels.sh) installed for it alone.
Modules: this file is the orchestrator and the workers' entry point; peers_plan.py (shapes, FLOPs, variants),
peers_worker_contract.py (tokens, results file, timed loop), peers_jax_worker.py, peers_torch_worker.py,
peers_maxtext_worker.py, peers_results.py (verdicts, peers.json, table).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:   # run as a plain script (and as its own workers): the sibling modules import as benchmarks.*
    sys.path.insert(0, REPO)
from benchmarks.peers_jax_worker import jax_worker  # noqa: E402
from benchmarks.peers_maxtext_worker import maxtext_worker  # noqa: E402
from benchmarks.peers_plan import (FULL, MAXTEXT_NOTE, TINY, VARIANTS, WORKER_ORDER, WORKER_SHARE,  # noqa: E402
                                   Shapes, plan_text, selected)
from benchmarks.peers_results import assemble, table  # noqa: E402
from benchmarks.peers_torch_worker import torch_worker  # noqa: E402
from benchmarks.peers_worker_contract import make_tokens, read_jsonl  # noqa: E402


def orchestrate(args, shapes: Shapes):
    out_path = args.out
    os.makedirs(os.path.dirname(os.path.abspath(out_path)) or ".", exist_ok=True)
    import tempfile
    work = args.workdir or tempfile.mkdtemp(prefix="bench_peers_")      # the 128 MiB token file stays out of $OUT
    os.makedirs(work, exist_ok=True)
    results_path = os.path.join(os.path.dirname(os.path.abspath(out_path)), "peers_results.jsonl")
    if os.path.exists(results_path):
        os.remove(results_path)
    tokens_path = os.path.join(work, "tokens.npy")
    t_begin = time.monotonic()
    notes = [f"tokens: {shapes.batch} x {shapes.seq} (batch x sequence); the same float32 N(0,1) activations "
             "(numpy seed 0) are the block input in JAX and torch, cast to bf16",
             "each framework initialises its own weights (routing differs; tokens_per_expert recorded per run)",
             "JAX timing: a loop of calls between two syncs after warm-up, median of loops; torch: the same "
             "with torch.cuda.synchronize",
             "stock_* variants: ../shared/bench/stock_block.py (no RoPE, no aux losses); ours and torchtitan "
             "have RoPE", MAXTEXT_NOTE]
    try:
        make_tokens(tokens_path, shapes)
    except Exception as e:  # noqa: BLE001
        notes.append(f"token file failed: {e!r}")
    env = {"orchestrator_python": sys.version.split()[0]}
    results = {}

    def write():
        got = read_jsonl(results_path)
        for k in ("_env_jax", "_env_torch"):
            if k in got:
                env[k[5:]] = got[k].get("env")
        if "_torch_build" in got:
            env["torch_build"] = {k: got["_torch_build"].get(k) for k in ("compiled_by", "build_s")}
        merged = {k: v for k, v in got.items() if not k.startswith("_")}
        merged.update({k: v for k, v in results.items() if k not in merged})
        env["elapsed_s"] = time.monotonic() - t_begin
        doc = assemble(merged, shapes, env, notes, args.tiny)
        with open(out_path, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        return doc

    names_of = {w: [nm for nm, vw, _, _ in VARIANTS if vw == w and selected(args, nm)] for w in WORKER_ORDER}
    for i, worker in enumerate(WORKER_ORDER):
        names = names_of[worker]
        if not names:
            continue
        left = args.budget_s - (time.monotonic() - t_begin)
        last = not any(names_of[w] for w in WORKER_ORDER[i + 1:])
        cap = left * (1.0 if last else WORKER_SHARE[worker])
        if worker == "jax-core":
            cap = max(cap, min(left, 150.0))
        if cap < 20 and not args.tiny:
            for nm in names:
                results[nm] = {"ok": False, "skipped": f"global budget exhausted ({left:.0f} s left)"}
            continue
        cmd = [args.python if worker != "torch" else (args.torch_python or args.python),
               os.path.abspath(__file__), "--worker", worker, "--names", ",".join(names), "--results",
               results_path, "--tokens", tokens_path, "--iters", str(args.iters), "--reps", str(args.reps),
               "--worker-budget-s", str(max(cap - 10, 10))]
        if args.tiny:
            cmd.append("--tiny")
        if args.no_compile:
            cmd.append("--no-compile")
        envv = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1")
        envv["PYTHONPATH"] = os.pathsep.join([p for p in (envv.get("PYTHONPATH", ""), REPO) if p])
        if worker == "maxtext":
            site, why_not = maxtext_site(args, work)
            if why_not:
                for nm in names:
                    results[nm] = {"ok": False, "skipped": why_not}
                notes.append(why_not)
                write()
                continue
            envv["PYTHONPATH"] = os.pathsep.join([site, envv["PYTHONPATH"]])   # first: its pins over the image's
        print(f"== worker {worker}: {names} (timeout {cap:.0f} s, {left:.0f} s of budget left)", flush=True)
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, env=envv, timeout=cap, cwd=REPO)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        got = read_jsonl(results_path)
        for nm in names:
            if nm not in got:
                results[nm] = {"ok": False, "error": f"worker {worker} ended ({rc}) before this variant finished"}
        if rc != 0:
            notes.append(f"worker {worker} exit {rc} after {time.monotonic() - t0:.0f} s")
        write()
    doc = write()
    print(table(doc), flush=True)
    print(f"wrote {out_path} ({time.monotonic() - t_begin:.0f} s)", flush=True)
    return doc


def maxtext_site(args, work: str) -> tuple[str | None, str | None]:
    """MaxText's wheels (.whl/maxtext) installed into a site directory only the MaxText worker sees, so its
    typing-extensions / jinja2 / packaging never shadow the image's in the other workers. (site, None) or
    (None, why not)."""
    import glob
    wheels = sorted(glob.glob(os.path.join(args.maxtext_wheels, "*.whl")))
    if not wheels:
        return None, (f"maxtext_* not run: no wheels in {args.maxtext_wheels} (fetch them with "
                      "`bash benchmarks/get_maxtext_wheels.sh` and carry .whl)")
    site = os.path.join(work, "maxtext_site")
    cmd = [args.python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", site,
           *wheels]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return None, f"maxtext_* not run: installing {args.maxtext_wheels} failed: {proc.stderr.strip()[-600:]}"
    return site, None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", os.path.join(REPO, "runs")), "peers.json"))
    # 560: a device call may run 600 s; with every variant selected (MaxText's two included: 25-60 s each on an H100
    # with their compiles and the pip install of their wheels) 390 left the last workers short
    p.add_argument("--budget-s", type=float, default=560.0, help="global wall-clock budget for all workers")
    # 20, not 5: a loop of 5 timed the block at 36.4 ms per call where its trace shows 34.9 ms of GPU work and 48 us
    # idle per call, so the loop's ends (first dispatch, final sync) were ~1.5 ms per call (profile_block_1xh200.json)
    p.add_argument("--iters", type=int, default=20, help="calls per timed loop")
    # 5, not 3: in two runs one of ours_block's loops was 18-31% slower than the rest (peers_1xh200.json,
    # peers_block_dgrad_tiles_1xh200.json); with 3 loops one such loop is a third of the sample
    p.add_argument("--reps", type=int, default=5, help="timed loops (median)")
    p.add_argument("--only", default="", help="comma list of variant names")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test; xla fallbacks)")
    p.add_argument("--list", action="store_true", help="print the plan and exit")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the command lines, run nothing")
    p.add_argument("--no-compile", action="store_true", help="torchtitan in eager mode (debug)")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--torch-python", default="", help="interpreter for the torch worker (default --python)")
    p.add_argument("--workdir", default="")
    p.add_argument("--maxtext-wheels", default=os.path.join(REPO, ".whl", "maxtext"),
                   help="MaxText's wheels, installed for its worker only (benchmarks/get_maxtext_wheels.sh)")
    # worker-only
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    p.add_argument("--names", default="", help=argparse.SUPPRESS)
    p.add_argument("--results", default="", help=argparse.SUPPRESS)
    p.add_argument("--tokens", default="", help=argparse.SUPPRESS)
    p.add_argument("--worker-budget-s", type=float, default=1e9, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    shapes = TINY if args.tiny else FULL
    if args.worker:
        names = [nm for nm in args.names.split(",") if nm]
        if args.worker == "torch":
            torch_worker(args, shapes, names)
        elif args.worker == "maxtext":
            maxtext_worker(args, shapes, names)
        else:
            jax_worker(args, shapes, names)
        return 0
    if args.list or args.dry_run:
        print(plan_text(args, shapes))
        if args.dry_run:
            print(f"would write {args.out}; workers run as: {args.python} {os.path.abspath(__file__)} "
                  "--worker <jax-core|torch|jax-extra> --names ... (XLA_PYTHON_CLIENT_PREALLOCATE=false)")
        return 0
    orchestrate(args, shapes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
