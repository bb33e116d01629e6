"""Does a 2-CTA cluster with TMA multicast make a Pallas Mosaic GPU GEMM faster on this GPU? (issue 10)

Before building clusters into our grouped GEMM, measure the lever on the plain dense GEMM that jax ships
(`jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu`, the same warp-specialised design: 1 TMA warpgroup
+ 2 wgmma warpgroups) with `cluster_dimension` None / M / N, next to XLA's dot and our grouped GEMM on the
Mixtral expert shapes, in one run. Cluster multicast is on-chip (SM-to-SM distributed shared memory), not
NVLink multicast. Variants are interleaved round by round so clock drift hits all of them alike.

    python3 -m benchmarks.probe_cluster_multicast --out results.json
"""
from __future__ import annotations

import argparse
import json
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

from benchmarks.environment import environment
from benchmarks.loop_timing import time_call
from pallas_kernels.grouped_gemm import grouped_gemm

SHAPES = {"gate_up": (32768, 4096, 14336), "down": (32768, 14336, 4096)}  # M, K, N; Mixtral 8x7B experts


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--groups", type=int, default=8)
    args = parser.parse_args()
    result = {"benchmark": "probe_cluster_multicast", "environment": environment(),
              "description": __doc__.strip(), "rounds": args.rounds, "shapes": {}}
    for label, (m, k, n) in SHAPES.items():
        key = jax.random.key(0)
        a = jax.random.normal(key, (m, k), jnp.bfloat16)
        b = (jax.random.normal(jax.random.fold_in(key, 1), (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
        w = jnp.broadcast_to(b, (args.groups, k, n))  # every group the same weights: same math as the dot
        sizes = jnp.full((args.groups,), m // args.groups, jnp.int32)
        fns = {"xla_dot": jax.jit(lambda a, b: a @ b)}
        for name, cluster in (("pallas_dense", None), ("pallas_dense_cluster_m", hm.MatmulDimension.M),
                              ("pallas_dense_cluster_n", hm.MatmulDimension.N)):
            cfg = hm.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4,
                                  grid_minor_dim=hm.MatmulDimension.M, grid_tile_width=8,
                                  wg_dimension=hm.MatmulDimension.N, cluster_dimension=cluster)
            fns[name] = jax.jit(lambda a, b, cfg=cfg: hm.matmul(a, b, None, cfg))
        fns["ours_grouped_uniform"] = jax.jit(lambda a, b: grouped_gemm(a, w, sizes))
        ref = np.asarray(fns["xla_dot"](a, b)[:256].astype(jnp.float32))
        times, errors = {name: [] for name in fns}, {}
        for name, fn in fns.items():
            print(label, name, "compiling and checking", flush=True)   # a hang can then be placed
            try:
                y = fn(a, b)
                got = np.asarray(y[:256].astype(jnp.float32))
                errors[name] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
            except Exception as err:  # noqa: BLE001 - a config the kernel rejects is recorded, not fatal
                errors[name] = f"failed: {type(err).__name__}: {str(err)[:300]}"
        for _ in range(args.rounds):
            for name, fn in fns.items():
                if isinstance(errors[name], float):
                    times[name].append(time_call(fn, a, b, min_total_s=0.3, loops=1)[0])
        flops = 2 * m * k * n
        rows = {}
        for name in fns:
            if times[name]:
                med = statistics.median(times[name])
                rows[name] = {"ms": med * 1e3, "tflops": flops / med / 1e12,
                              "tflops_rounds": [flops / t / 1e12 for t in times[name]], "rel_error": errors[name]}
            else:
                rows[name] = {"error": errors[name]}
            print(label, name, rows[name].get("tflops", rows[name].get("error")), flush=True)
        result["shapes"][label] = {"m": m, "k": k, "n": n, "groups": args.groups, "variants": rows}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
