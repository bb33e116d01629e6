"""Where does the scatter between readings of one kernel in one set of timing rounds come from? (issue 10)

bench_grouped_gemm.py reads ours/fwd twice per case (ours_repeat/fwd) and found the two up to 5% apart on
~0.9 ms calls, every loop apart, not drifting. This probe times one grouped GEMM forward as several variants
of one `time_rounds` call that differ in one thing each:
  same_a / same_b / same_c   the same jitted function and the same argument buffers, at other places
                             in the order (odd rounds run it reversed, later sets shuffle it)
  copied_args                the same function on copies of the arguments (other buffers, same values)
  separately_jitted          an identical function jitted on its own (its own executable)
  fwd+bwd                    a different, longer kernel between them (a neighbour of another kind)
and repeats the whole set of rounds with the order shuffled. A gap that follows the buffers or the
executable across orders is a property of the variant; one that follows the place in the order is not.

    python3 -m benchmarks.probe_timing_noise --out results.json
"""
from __future__ import annotations

import argparse
import json
import random
import statistics

import jax
import jax.numpy as jnp

from benchmarks.environment import environment
from benchmarks.grouped_gemm_jax_timing import fwd_bwd
from benchmarks.loop_timing import time_rounds
from pallas_kernels.grouped_gemm import grouped_gemm

SHAPES = {"deepseekmoe_16b_ep1_16k": (98304, 2048, 1408, 64), "qwen3_30b_a3b_ep1": (65536, 2048, 768, 128)}


def variants(m, k, n, g):
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (m, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(keys[1], (g, k, n), jnp.float32) / k ** 0.5).astype(jnp.bfloat16)
    dy = jax.random.normal(keys[2], (m, n), jnp.float32).astype(jnp.bfloat16)
    gs = jnp.full((g,), m // g, jnp.int32)
    fn = jax.jit(lambda x, w, gs: grouped_gemm(x, w, gs))
    twin = jax.jit(lambda x, w, gs: grouped_gemm(x, w, gs))
    copies = tuple(jnp.array(a, copy=True) for a in (x, w, gs))
    fb = fwd_bwd(lambda x, w, gs: grouped_gemm(x, w, gs))
    out = [("same_a", fn, (x, w, gs)), ("fwd+bwd", fb, (x, w, dy, gs)), ("same_b", fn, (x, w, gs)),
           ("copied_args", fn, copies), ("separately_jitted", twin, (x, w, gs)), ("same_c", fn, (x, w, gs))]
    for _, f, a in out:
        jax.block_until_ready(f(*a))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--orders", type=int, default=3, help="sets of rounds: the listed order, then shuffled")
    args = parser.parse_args()
    result = {"benchmark": "probe_timing_noise", "environment": environment(), "description": __doc__.strip(),
              "rounds": args.rounds, "shapes": {}}
    rng = random.Random(0)
    for name, (m, k, n, g) in SHAPES.items():
        base = variants(m, k, n, g)
        runs = []
        for i in range(args.orders):
            order = list(base) if i == 0 else rng.sample(base, len(base))
            per_loop = {}
            med = time_rounds(order, min_total_s=0.15, loops=args.rounds, per_loop=per_loop)
            ref = med["same_a"]
            runs.append({"order": [lb for lb, _, _ in order],
                         "ms": {lb: round(t * 1e3, 4) for lb, t in med.items()},
                         "vs_same_a": {lb: round(t / ref - 1, 4) for lb, t in med.items()},
                         "loop_ms": {lb: [round(t * 1e3, 4) for t in v] for lb, v in per_loop.items()}})
            print(name, "order", runs[-1]["order"], flush=True)
            print("  ", {lb: f"{v:+.2%}" for lb, v in runs[-1]["vs_same_a"].items()}, flush=True)
        fwd = [lb for lb, _, _ in base if lb != "fwd+bwd"]
        spread = [max(r["ms"][lb] for lb in fwd) / min(r["ms"][lb] for lb in fwd) - 1 for r in runs]
        result["shapes"][name] = {"m": m, "k": k, "n": n, "groups": g, "runs": runs,
                                  "fwd_spread_per_order": [round(s, 4) for s in spread],
                                  "median_fwd_spread": round(statistics.median(spread), 4)}
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
