"""Grouped GEMM on one H200: our Pallas Mosaic GPU kernel next to lax.ragged_dot, jax's ragged_dot_mgpu,
tokamax's ragged_dot, torch._grouped_mm (a torch server process, timed in the same rounds) and the dense GEMM
of the same FLOPs.

    python3 benchmarks/bench_grouped_gemm.py --mode smoke --out /tmp/smoke.json   # goal shapes, few impls
    python3 benchmarks/bench_grouped_gemm.py --mode full  --out results.json      # all shapes and impls
    python3 benchmarks/bench_grouped_gemm.py --suite issue10 --torch --torch-timeout-s 150 --time-budget-s 330 \
        --out $OUT/grouped_gemm_table.json                                          # issue 10's table
    python3 benchmarks/bench_grouped_gemm.py --suite issue10 --list                # its cases, no GPU
    python3 benchmarks/bench_grouped_gemm.py --suite tiny --interpret --out /tmp/t.json  # CPU smoke
    python3 benchmarks/bench_grouped_gemm.py --suite issue10 --only qwen3_30b_a3b_ep1,qwen3_30b_a3b_ep8 --torch \
        --impls ours/,ours_scan_tables/,dense --out $OUT/grouped_gemm_tables.json   # work tables before/after

Shapes (--mode): the two goal shapes of issue 4 (Mixtral-like M=32768 K=4096 N=14336 G=8; fine-grained
M=8192 K=4096 N=1408 G=16) and the up-projection of each of the paper's six models at EP=8 with
8192 tokens per GPU before dispatch: M = 8192 * top_k rows, G = experts / 8 local experts.
--suite issue10: the table of issue 10 (Mixtral 8x7B / 8x22B, DeepSeekMoE-16B, Qwen3-30B-A3B, DeepSeek-V3
at EP = 1 and 8, see grouped_gemm_cases.ISSUE10_ROWS), ours (default tuning) vs torch._grouped_mm vs the dense
GEMM of the same FLOPs, with the ratios and the issue's verdict per row, also written as a markdown table next
to the JSON.
Routing: uniform; skewed (one expert takes 40% of the rows, the rest split evenly); half_empty (every other
group has no rows, the rest split evenly); padded (half the rows routed uniformly, the other half a zero
tail, as in an expert-parallel dropless receive buffer at n = 2; `ours` and `ours_mask_tail` differ in
who writes that tail, see GroupedGemmTuning.zero_tail).
TFLOP/s counts useful FLOPs only: 2 * sum(group_sizes) * K * N per GEMM (for padded the real rows, not the
tail), 3 GEMMs for forward+backward, for every implementation (torch included). The dense baseline is
x[:sum(group_sizes)] @ w[0], i.e. the same FLOPs in one GEMM, its weight a [K, N] array of its own.
Group sizes are a runtime argument of the jitted functions, as in training (one compile per shape, not
per routing). Timing: a loop of calls between two host syncs (no sync per call), median of several loops,
after a warm-up call that compiles. Correctness: the forward of every grouped implementation is checked
against an fp32 product on sampled rows (the first and last rows of up to 4 non-empty groups) and the
rows past sum(group_sizes) must be exact zeros.
With --torch, torch runs in a server subprocess started before JAX takes the GPU; each case's torch labels are
variants of the case's timing rounds next to ours and the dense GEMM (one loop of each per round), so a
drift of the GPU's pace falls on both sides alike. Until 2026-12-04 torch ran first in a process of its own,
and its verdicts moved by a few percent between runs on unchanged kernels. Every case's rounds also time
ours/fwd twice (`ours_repeat/fwd`, the other end of the order): the gap between the two readings of one
kernel is the row's noise, written as `same_kernel_spread`, and a verdict that misses by less is marked so.
Modules: grouped_gemm_cases.py (shapes, routings, suites, --list), grouped_gemm_jax_timing.py (the JAX
implementations, checks, one case's rounds), loop_timing.py (loops and rounds), grouped_gemm_sweeps.py
(--sweep's variants), grouped_gemm_torch.py (the torch server and its client), grouped_gemm_report.py
(ratios, verdicts, JSON, markdown).
"""
import argparse
import collections
import os
import sys
import time
import zlib

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.grouped_gemm_cases import ROUTINGS, SUITES, build_cases, print_cases  # noqa: E402
from benchmarks.grouped_gemm_jax_timing import (fwd_bwd, hbm_copy_gbps, jax_impls, measure_case,  # noqa: E402
                                                past_deadline)
from benchmarks.grouped_gemm_report import environment, finalize_row, markdown_table, save_json  # noqa: E402
from benchmarks.grouped_gemm_torch import TorchServer, TorchServerError  # noqa: E402
from benchmarks.loop_timing import TIMING  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["smoke", "full"], default="smoke", help="shape set when no --suite")
    p.add_argument("--suite", choices=sorted(SUITES), default=None,
                   help="issue10: issue 10's table (ours, torch._grouped_mm with --torch, dense); "
                        "tiny: CPU smoke shapes (use with --interpret)")
    p.add_argument("--out", default=None, help="JSON path (a markdown table is written next to it)")
    p.add_argument("--list", action="store_true", help="print the cases and exit (no device needed)")
    p.add_argument("--only", default="", help="comma list of shape names, run in the order given")
    p.add_argument("--impls", default="", help="comma list of label substrings to time (overrides the suite's)")
    p.add_argument("--no-bwd", dest="bwd", action="store_false")
    p.add_argument("--sweep", action="store_true", help="also time alternative forward tilings")
    p.add_argument("--tokens-per-device", type=int, default=None,
                   help="issue10 suite: tokens per device before dispatch (default 8192); fewer tokens give fewer "
                        "tiles than SMs, where the sweep's split-K tilings matter")
    p.add_argument("--tokamax", action="store_true")
    p.add_argument("--torch", action="store_true",
                   help="torch._grouped_mm (in a server process) in the same timing rounds as ours")
    p.add_argument("--torch-timeout-s", type=int, default=240,
                   help="the longest wait for one reply of the torch server (start, a case's setup, a loop)")
    p.add_argument("--routings", default="",
                   help=f"comma list from {ROUTINGS}; default: the suite's per row, uniform,skewed for --mode "
                        "full, uniform for --mode smoke")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="start no new timing after this many seconds (the JSON and table are still written)")
    p.add_argument("--interpret", action="store_true",
                   help="run our kernel in the Pallas interpreter (CPU smoke; with --suite tiny)")
    args = p.parse_args()
    args.impl_filter = [s for s in args.impls.split(",") if s]
    cases = build_cases(args)
    if args.list:
        print_cases(cases, args)
        return
    if not args.out:
        p.error("--out is required (unless --list)")
    if args.interpret:
        TIMING.update(min_total_s=0.0, loops=1, min_iters=1)
    args.t_start = time.perf_counter()
    args.deadline = None if args.time_budget_s is None else args.t_start + args.time_budget_s
    print_cases(cases, args)
    torch_server, torch_env = None, {}
    if args.torch:
        try:
            torch_server = TorchServer(args.torch_timeout_s)
            torch_env = torch_server.env
        except TorchServerError as e:   # the JAX side still runs; every torch cell says why it is empty
            torch_env = {"torch_server_error": str(e)}
            print(f"torch server did not start: {e}", flush=True)
    args.environment = environment(torch_env)
    args.environment["hbm_copy_gbps"] = None if args.interpret else hbm_copy_gbps()
    print(args.environment, flush=True)
    results = []
    by_shape = collections.OrderedDict()
    for c in cases:
        by_shape.setdefault(c["shape"], []).append(c)
    for name, shape_cases in by_shape.items():
        m, k, n, g = (shape_cases[0][d] for d in ("M", "K", "N", "G"))
        if past_deadline(args):
            for c in shape_cases:
                results.append(dict(c, tflops={}, ms={}, errors={"all": "skipped: --time-budget-s reached"}))
            continue
        keys = jax.random.split(jax.random.key(zlib.crc32(name.encode()) % 2**31), 3)
        x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
        w = jax.random.normal(keys[1], (g, k, n), jnp.bfloat16)
        dy = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
        grouped = jax_impls(m, k, n, g, args)
        impls = dict(fwd={lb: jax.jit(f) for lb, f in grouped.items()},
                     bwd={lb: fwd_bwd(f) for lb, f in grouped.items()} if args.bwd else {})
        for c in shape_cases:
            measure_case(c, x, w, dy, impls, args, results, torch_server)
            save_json(args, results)
        del x, w, dy, impls
    if torch_server is not None:
        torch_server.close()
        if torch_server.dead:
            args.environment["torch_server_error"] = torch_server.dead
    save_json(args, results)
    table = markdown_table([finalize_row(r, args.environment["hbm_copy_gbps"]) for r in results], args.environment)
    md_path = args.out.rsplit(".", 1)[0] + ".md"
    with open(md_path, "w") as f:
        f.write(table + "\n")
    print(table)
    print(f"\nwrote {args.out} and {md_path} in {time.perf_counter() - args.t_start:.0f} s")


if __name__ == "__main__":
    main()
