"""The experts' first GEMMs + SwiGLU: fused in one kernel (pallas_kernels/grouped_swiglu.py, several tilings)
vs the separate form (two grouped GEMM kernel calls, then silu(gate) * up in XLA), one H200, one process,
timed round by round (loop_timing.time_rounds), forward and forward+backward.

    python3 -m benchmarks.bench_grouped_swiglu --out $OUT/grouped_swiglu.json

TFLOP/s count the two GEMMs' useful FLOPs (2 x 2 M D F per forward, x3 with the backward).
"""
from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.environment import environment
from benchmarks.loop_timing import time_rounds
from pallas_kernels.grouped_gemm import grouped_gemm
from pallas_kernels.grouped_swiglu import SwigluTiling, grouped_swiglu, grouped_swiglu_with_products

# (name, rows M, hidden D, expert FFN F, experts G): the issue-10 table's EP1 shapes, uniform routing
SHAPES = [("mixtral_8x7b_ep1", 16384, 4096, 14336, 8), ("deepseekmoe_16b_ep1", 49152, 2048, 1408, 64),
          ("qwen3_30b_a3b_ep1", 65536, 2048, 768, 128)]
TILINGS = {"k64s4": SwigluTiling(), "k128s2": SwigluTiling(tile_k=128, stages=2),
           "k64s4_epi2": SwigluTiling(epi_slots=2), "k64s4_unchained": SwigluTiling(chain_items=False),
           "k64s3": SwigluTiling(stages=3)}


def separate(x, wg, wu, gs):
    return jax.nn.silu(grouped_gemm(x, wg, gs)) * grouped_gemm(x, wu, gs)


def fwd_bwd(f):
    def run(x, wg, wu, gs, dh):
        h, pull = jax.vjp(lambda x, a, b: f(x, a, b, gs), x, wg, wu)
        return pull(dh)
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="", help="comma list of shape names")
    ap.add_argument("--tilings", default=",".join(TILINGS), help=f"comma list from {list(TILINGS)}")
    args = ap.parse_args()
    rows = []
    for name, m, d, f, g in SHAPES:
        if args.only and name not in args.only.split(","):
            continue
        ks = jax.random.split(jax.random.key(0), 4)
        x = jax.random.normal(ks[0], (m, d), jnp.bfloat16)
        wg, wu = ((jax.random.normal(k, (g, d, f), jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16) for k in ks[1:3])
        dh = jax.random.normal(ks[3], (m, f), jnp.bfloat16)
        gs = jnp.full((g,), m // g, jnp.int32)
        flops = 2 * 2 * m * d * f
        fwd = {"separate": jax.jit(separate)}
        for label in args.tilings.split(","):
            t = TILINGS[label]
            fwd[f"fused_{label}"] = jax.jit(lambda x, a, b, s, t=t: grouped_swiglu_with_products(x, a, b, s, tiling=t)[0])
        ref = np.asarray(fwd["separate"](x, wg, wu, gs), np.float32)
        errors = {}
        for label, fn in fwd.items():
            got = np.asarray(fn(x, wg, wu, gs), np.float32)
            errors[label] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        bwd = {"separate": jax.jit(fwd_bwd(separate)),
               "fused_default": jax.jit(fwd_bwd(lambda x, a, b, s: grouped_swiglu(x, a, b, s)))}
        variants = [(f"{k}/fwd", v, (x, wg, wu, gs)) for k, v in fwd.items()]
        variants += [(f"{k}/fwd+bwd", v, (x, wg, wu, gs, dh)) for k, v in bwd.items()]
        seconds = time_rounds(variants)
        row = {"shape": name, "M": m, "D": d, "F": f, "G": g, "routing": "uniform",
               "ms": {k: s * 1e3 for k, s in seconds.items()},
               "tflops": {k: (3 if k.endswith("bwd") else 1) * flops / s / 1e12 for k, s in seconds.items()},
               "rel_err_vs_separate_fwd": errors}
        rows.append(row)
        print(name, {k: f"{v:.3f} ms" for k, v in row["ms"].items()}, flush=True)
        doc = {"benchmark": "bench_grouped_swiglu", "environment": environment(), "description": __doc__,
               "rows": rows}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(doc, fh, indent=1)


if __name__ == "__main__":
    main()
