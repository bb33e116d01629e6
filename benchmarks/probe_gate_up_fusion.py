"""Would one grouped GEMM over a [G, D, 2F] gate|up weight beat the two [G, D, F] GEMMs? (issue 10)

The expert FFN runs gate = x @ w_gate[g] and up = x @ w_up[g] as two grouped GEMM calls over the same rows.
One call over the concatenated weight reads the rows once per column band instead of twice, builds its work
tables once and, for narrow experts (Qwen3's F = 768), has twice the column tiles per row tile. Timed here on
our kernel at the issue's shapes, forward and forward + backward (for the pair: both calls' gradients, dx
summed), each ending in silu(gate) * up as the model does; variants interleaved round by round
(loop_timing.time_rounds: one loop of >= 0.3 s of each per round, odd rounds reversed); the outputs
are compared. No model change is made from this
alone: the [E, D, 2F] layout changes the checkpoint format.

    python3 -m benchmarks.probe_gate_up_fusion --out results.json
"""
from __future__ import annotations

import argparse
import json
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.environment import environment
from benchmarks.loop_timing import time_rounds
from pallas_kernels.grouped_gemm import grouped_gemm

SHAPES = {  # name: (rows M, D, F, groups), uniform routing (EP 1, 8192 tokens x top-k)
    "mixtral_8x7b_ep1": (16384, 4096, 14336, 8),
    "deepseekmoe_16b_ep1": (49152, 2048, 1408, 64),
    "qwen3_30b_a3b_ep1": (65536, 2048, 768, 128),
}


# Both variants end in the consumer the model has, silu(gate) * up, so neither pays for materialising its
# outputs in a form the model would not (returning the fused call's two halves as jit outputs copies them).
def _pair(x, wg, wu, sizes):
    return jax.nn.silu(grouped_gemm(x, wg, sizes)) * grouped_gemm(x, wu, sizes)


def _fused(x, wgu, sizes):
    y = grouped_gemm(x, wgu, sizes)
    f = y.shape[1] // 2
    return jax.nn.silu(y[:, :f]) * y[:, f:]


def _loss(fn):
    def loss(x, *ws, sizes, dy):
        return jnp.vdot(fn(x, *ws, sizes).astype(jnp.float32), dy.astype(jnp.float32))
    return loss


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds (even: odd rounds run reversed)")
    parser.add_argument("--only", default="", help="comma list of shape names (default: all)")
    args = parser.parse_args()
    wanted = [s for s in args.only.split(",") if s] or list(SHAPES)
    result = {"benchmark": "probe_gate_up_fusion", "environment": environment(), "description": __doc__.strip(),
              "rounds": args.rounds, "shapes": {}}
    for name in wanted:
        m, d, f, g = SHAPES[name]
        keys = jax.random.split(jax.random.key(0), 5)
        x = jax.random.normal(keys[0], (m, d), jnp.float32).astype(jnp.bfloat16)
        wg, wu = ((jax.random.normal(k, (g, d, f), jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16) for k in keys[1:3])
        wgu = jnp.concatenate([wg, wu], axis=2)
        dy = jax.random.normal(keys[3], (m, f), jnp.float32).astype(jnp.bfloat16)
        sizes = jnp.full((g,), m // g, jnp.int32)
        fns = {
            "pair/fwd": (jax.jit(lambda x, a, b: _pair(x, a, b, sizes)), (x, wg, wu)),
            "fused/fwd": (jax.jit(lambda x, w: _fused(x, w, sizes)), (x, wgu)),
            # value_and_grad: the loss is linear in the outputs, so a bare grad would let XLA drop the forward
            "pair/fwd+bwd": (jax.jit(jax.value_and_grad(lambda x, a, b: _loss(_pair)(x, a, b, sizes=sizes, dy=dy),
                                                        argnums=(0, 1, 2))), (x, wg, wu)),
            "fused/fwd+bwd": (jax.jit(jax.value_and_grad(lambda x, w: _loss(_fused)(x, w, sizes=sizes, dy=dy),
                                                         argnums=(0, 1))), (x, wgu)),
        }
        print(name, "compiling and checking", flush=True)   # a first run printed nothing in 200 s: say where it is
        pair, fused = fns["pair/fwd"][0](x, wg, wu), fns["fused/fwd"][0](x, wgu)
        same = bool(jnp.array_equal(pair, fused))
        for fn, fargs in fns.values():   # compiled before the rounds
            jax.block_until_ready(fn(*fargs))
        print(name, "timing", flush=True)
        times = {}
        time_rounds([(k, fn, fargs) for k, (fn, fargs) in fns.items()], min_total_s=0.3, loops=args.rounds,
                    per_loop=times)
        flops = 2 * m * d * (2 * f)
        rows = {}
        for k, ts in times.items():
            med = statistics.median(ts)
            work = flops * (3 if "bwd" in k else 1)
            rows[k] = {"ms": med * 1e3, "tflops": work / med / 1e12, "ms_rounds": [t * 1e3 for t in ts]}
            print(name, k, f"{rows[k]['tflops']:.1f} TFLOP/s {rows[k]['ms']:.3f} ms", flush=True)
        result["shapes"][name] = {"m": m, "d": d, "f": f, "groups": g, "outputs_bit_identical": same,
                                  "variants": rows,
                                  "fused_over_pair": {p: rows[f"pair/{p}"]["ms"] / rows[f"fused/{p}"]["ms"]
                                                      for p in ("fwd", "fwd+bwd")}}
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
