"""Who should write the zero tail of an expert-parallel receive buffer? (issue 10: "the zero tail costing nothing")

With the dropless all_to_all dispatch a rank receives n x T x min(K, local experts) rows, of which about T x K
are real: 75% of Mixtral's EP8 buffer and 87.5% of Qwen3-30B-A3B's are the tail. The expert FFN runs on the
whole buffer, as the model does (model/moe/experts.py: gate and up grouped GEMMs, silu(gate) * up, the down
grouped GEMM), and ends in what a combine does first (token_routes: select the real rows, weight them, in
fp32). Variants of GroupedGemmTuning.zero_tail for all three GEMMs:
  kernel  the grouped GEMM's tail tiles store zeros (one write of every tail row of every output)
  mask    the kernels skip the tail and a jnp.where zeroes it, which XLA can fuse into the consumer
('none' cannot run this chain: the SwiGLU backward turns an unwritten tail into a garbage cotangent that the
gate/up weight gradient multiplies.) Forward and forward+backward, round by round, outputs and gradients
compared; TFLOP/s of the real rows' FLOPs; the compiled HLO's fusion count per variant (an unfused select
would show up as extra fusions).

    python3 -m benchmarks.probe_tail_in_ffn --out $OUT/probe_tail_in_ffn.json
    python3 -m benchmarks.probe_tail_in_ffn --tiny --interpret --out /tmp/t.json   # CPU smoke
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.environment import environment
from benchmarks.loop_timing import time_rounds
from pallas_kernels.grouped_gemm import default_tuning, grouped_gemm

# name: (ranks n, tokens per rank T, top-k, local experts, hidden D, expert FFN F)
SHAPES = {"mixtral_8x7b_ep8": (8, 4096, 2, 1, 4096, 14336),
          "qwen3_30b_a3b_ep8": (8, 4096, 8, 16, 2048, 768)}
TINY = {"tiny_ep4": (4, 32, 2, 2, 128, 128)}
VARIANTS = ("kernel", "mask")


def buffer(n, t, k, g):
    """Rows of the receive buffer and its group sizes: the T x K real rows split evenly over the local experts
    (a rank's share of a uniform routing), the rest the tail."""
    rows = n * t * min(k, g)
    real = t * k
    return rows, np.full((g,), real // g, np.int32)


def ffn_loss(zero_tail, interpret):
    # every array is an argument: closed-over buffers become HLO constants (Qwen3's fp32 cotangent alone is 2 GiB,
    # which made a first H200 call's compiles crawl and the executable's text exceed protobuf's 2 GiB limit)
    def loss(x, wg, wu, wd, sizes, valid_M1, weight_M1, ct_MD):
        m, d = x.shape
        def gemm(a, w):
            tuning = dataclasses.replace(default_tuning(m, a.shape[1], w.shape[2], w.shape[0]), zero_tail=zero_tail)
            return grouped_gemm(a, w, sizes, interpret=interpret, tuning=tuning)
        h = jax.nn.silu(gemm(x, wg)) * gemm(x, wu)
        y = gemm(h, wd)
        contrib = jnp.where(valid_M1, y.astype(jnp.float32) * weight_M1, 0)   # a combine's first step
        return jnp.vdot(contrib, ct_MD)
    return loss


def probe(name, shape, interpret, rounds, kinds):
    n, t, k, g, d, f = shape
    rows, sizes_np = buffer(n, t, k, g)
    real = int(sizes_np.sum())
    keys = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(keys[0], (rows, d), jnp.float32)
    x = jnp.where(jnp.arange(rows)[:, None] < real, x, 0).astype(jnp.bfloat16)   # the dispatch sends zeros there
    wg, wu = ((jax.random.normal(kk, (g, d, f), jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16) for kk in keys[1:3])
    wd = (jax.random.normal(keys[3], (g, f, d), jnp.float32) / np.sqrt(f)).astype(jnp.bfloat16)
    valid = (jnp.arange(rows) < real)[:, None]
    weight = jax.random.uniform(keys[4], (rows, 1), jnp.float32)
    ct = jax.random.normal(keys[5], (rows, d), jnp.float32)
    sizes = jnp.asarray(sizes_np)
    fns, outs, fusions, compile_s = [], {}, {}, {}
    for zt in VARIANTS:
        loss = ffn_loss(zt, interpret)
        builders = {"fwd": lambda: jax.jit(loss), "fwd+bwd": lambda: jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))}
        for kind in kinds:
            fn = builders[kind]()
            args = (x, wg, wu, wd, sizes, valid, weight, ct)
            print(f"{name} {zt}/{kind}: compiling", flush=True)   # a first H200 run printed nothing in 230 s
            started = time.perf_counter()
            compiled = fn.lower(*args).compile()   # one compile, timed and counted
            compile_s[f"{zt}/{kind}"] = round(time.perf_counter() - started, 1)
            print(f"{name} {zt}/{kind}: compiled in {compile_s[f'{zt}/{kind}']} s", flush=True)
            fusions[f"{zt}/{kind}"] = compiled.as_text().count(" fusion(")
            outs[f"{zt}/{kind}"] = jax.block_until_ready(compiled(*args))
            fns.append((f"{zt}/{kind}", compiled, args))
    ref_val, ref_grads = outs["kernel/fwd+bwd"]
    val, grads = outs["mask/fwd+bwd"]
    finite = all(bool(jnp.all(jnp.isfinite(gr))) for gr in (*ref_grads, *grads))
    grad_diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))) for a, b in zip(ref_grads, grads))
    times = time_rounds(fns, loops=rounds, **({"min_total_s": 0.0, "min_iters": 1} if interpret else {}))
    flops = 2 * real * d * f * 3   # three GEMMs over the real rows
    variants = {label: {"ms": round(s * 1e3, 4), "tflops": round(flops * (3 if "bwd" in label else 1) / s / 1e12, 1),
                        "hlo_fusions": fusions[label], "compile_s": compile_s[label]} for label, s in times.items()}
    for label, v in variants.items():
        print(f"{name:18s} {label:14s} {v['tflops']:7.1f} TFLOP/s {v['ms']:9.3f} ms  fusions {v['hlo_fusions']}",
              flush=True)
    return {"ranks": n, "tokens_per_rank": t, "top_k": k, "local_experts": g, "D": d, "F": f, "rows": rows,
            "real_rows": real, "tail_share": round(1 - real / rows, 3), "variants": variants,
            "mask_over_kernel_speedup": {kd: round(variants[f"kernel/{kd}"]["ms"] / variants[f"mask/{kd}"]["ms"], 3)
                                         for kd in kinds},
            "losses_equal": bool(ref_val == val), "max_abs_grad_difference": grad_diff, "gradients_finite": finite}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--interpret", action="store_true")
    p.add_argument("--only", default="", help="comma list of shape names (default: all)")
    p.add_argument("--kinds", default="fwd,fwd+bwd",
                   help="comma list of fwd, fwd+bwd (each costs two compiles per shape; fwd+bwd must be one)")
    args = p.parse_args()
    doc = {"benchmark": "probe_tail_in_ffn", "environment": environment(), "description": __doc__.strip(),
           "rounds": args.rounds, "kinds": args.kinds, "shapes": {}}
    shapes = TINY if args.tiny else SHAPES
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if "fwd+bwd" not in kinds or not set(kinds) <= {"fwd", "fwd+bwd"}:
        raise SystemExit(f"--kinds {args.kinds!r}: give fwd+bwd (the gradients are compared), optionally fwd")
    unknown = [s for s in args.only.split(",") if s and s not in shapes]
    if unknown:
        raise SystemExit(f"--only: unknown shape(s) {unknown}; known: {sorted(shapes)}")
    for name in [s for s in args.only.split(",") if s] or list(shapes):
        shape = shapes[name]
        doc["shapes"][name] = probe(name, shape, args.interpret, args.rounds, kinds)
        with open(args.out, "w") as fh:
            json.dump(doc, fh, indent=1)


if __name__ == "__main__":
    main()
