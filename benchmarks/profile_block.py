"""Where one Mixtral-shaped block's fwd+bwd spends its GPU time: the same block bench_peers.py times as
`ours_block` (attention + top-2 of 8, dropless, 1 x 8192 tokens), traced for a few calls and broken down by
benchmarks/gpu_trace.py (GEMM / attention / other, the largest kernels with the HLO op and the source line
they came from: benchmarks/hlo_sources.py).

    python -m benchmarks.profile_block --out $OUT/profile_block.json

One GPU; the JSON holds the environment, the shapes, the wall time per call and the breakdown per call.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time

from benchmarks import gpu_trace
from benchmarks.hlo_sources import instruction_sources
from benchmarks.environment import environment
from benchmarks.peers_jax_worker import build_ours
from benchmarks.peers_plan import FULL, TINY


def profile_block(calls: int, tiny: bool, top: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    shapes = TINY if tiny else FULL
    grad, params, kernels = build_ours(shapes, tiny, layers=1)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((shapes.batch, shapes.seq, shapes.hidden)),
                    jnp.bfloat16)
    grad = grad.lower(params, x).compile()   # compiled once: the executable timed is the one read for its sources
    sources = instruction_sources(grad.as_text())   # fusion name -> jax op, line
    out = None
    for _ in range(3):                                   # compile + warm up
        out = grad(params, x)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(calls):
        out = grad(params, x)
    jax.block_until_ready(out)
    wall_ms = (time.perf_counter() - t0) / calls * 1e3
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp)
        for _ in range(calls):
            out = grad(params, x)
        jax.block_until_ready(out)
        jax.profiler.stop_trace()
        trace = gpu_trace.load_trace(gpu_trace.latest_trace_file(tmp)) if jax.default_backend() == "gpu" else None
    per_gpu = gpu_trace.gpu_stream_events(trace) if trace else {}
    return {"shapes": dataclasses.asdict(shapes), "calls": calls,
            "idle_gaps_all_calls": {pid: gpu_trace.idle_gaps(ev, top) for pid, ev in per_gpu.items()},
            "kernels": {"attention": kernels.attention, "grouped_gemm": kernels.grouped_gemm},
            "wall_ms_per_call_untraced": wall_ms,
            "breakdown_per_call": gpu_trace.breakdown(trace, calls, top=top, sources=sources) if trace else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test: no GPU trace)")
    args = ap.parse_args()
    result = {"benchmark": "profile_block", "environment": environment(),
              **profile_block(args.calls, args.tiny, args.top)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    b = result["breakdown_per_call"]
    print(f"wall {result['wall_ms_per_call_untraced']:.2f} ms/call", json.dumps(b and b["kernel_ms_by_category"]))


if __name__ == "__main__":
    main()
