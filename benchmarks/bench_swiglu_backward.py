"""SwiGLU's activation backward on the GPU: XLA's (autodiff of jax.nn.silu(gate) * up, as kernels.swiglu='separate'
runs it) against the Pallas kernel (pallas_kernels/swiglu_backward.py, kernels.swiglu='separate_pallas_bwd') at its
default tiles and a few others, timed round by round in one process (benchmarks/loop_timing.time_rounds).

    python -m benchmarks.bench_swiglu_backward --out $OUT/swiglu_backward.json

Shapes: the expert rows of deepseekmoe_small's step (8 x 4096 tokens, top-6: 196608 x 1408) and mixtral_small's
(16 x 4096, top-2: 131072 x 14336), bf16. The floor: the kernel's bytes (gate, up, dh read once, d_gate and d_up
written once: 5 arrays) over the bandwidth of a plain elementwise pass (a read and a write) of one array, measured
in the same rounds; each reading is also given as GB/s of those 5 arrays. Each variant's cotangents are checked
against XLA's float32 autodiff at the same bf16 inputs (the largest difference in bf16 steps).
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
from pallas_kernels.swiglu_backward import swiglu_backward

SHAPES = {"deepseekmoe_small": (196608, 1408), "mixtral_small": (131072, 14336)}
SWEEP = [(2048, 4), (8192, 8), (4096, 4), (16384, 8)]   # (elements per program, warps); the default is 4096, 8


def xla_backward(gate, up, dh):
    """Autodiff's pullback of silu(gate) * up: what kernels.swiglu='separate' runs."""
    return jax.vjp(lambda g, u: jax.nn.silu(g) * u, gate, up)[1](dh)


def kernel_backward(block=None, num_warps=None, interpret=False):
    kw = {k: v for k, v in (("block", block), ("num_warps", num_warps)) if v is not None}
    return lambda gate, up, dh: swiglu_backward(gate, up, dh, interpret=interpret, **kw)


@jax.jit
def _steps_off_on_device(got, want32):
    got, want = got.astype(jnp.float32), want32.astype(jnp.float32)
    step = jnp.exp2(jnp.floor(jnp.log2(jnp.maximum(jnp.abs(want), 1e-30))) - 7)
    return jnp.max(jnp.abs(got - want) / step)


def _steps_off(got, want32) -> float:
    """The largest |got - want| in units of bf16's spacing at |want|, on the device (the step's arrays hold up to
    1.9 G elements: a host copy in float64 took longer than the whole benchmark's time)."""
    return float(_steps_off_on_device(got, want32))


def bench_shape(name: str, shape, loops: int, sweep: bool = False, interpret: bool = False) -> dict:
    kg, ku, kd = jax.random.split(jax.random.key(0), 3)
    gate, up, dh = ((s * jax.random.normal(k, shape, jnp.float32)).astype(jnp.bfloat16)
                    for k, s in ((kg, 4.0), (ku, 2.0), (kd, 1.0)))
    variants = {"xla": xla_backward, "kernel": kernel_backward(interpret=interpret)}
    if sweep:
        variants.update({f"kernel_b{b}_w{w}": kernel_backward(b, w, interpret) for b, w in SWEEP})
    want = jax.jit(xla_backward)(*(a.astype(jnp.float32) for a in (gate, up, dh)))
    fns, errors, steps_off = {}, {}, {}
    for label, f in variants.items():   # a variant that does not compile is recorded and left out of the timing
        try:
            fns[label] = jax.jit(f)
            out = fns[label](gate, up, dh)
            steps_off[label] = max(_steps_off(o, w) for o, w in zip(out, want))
        except Exception as err:  # noqa: BLE001
            errors[label] = f"{type(err).__name__}: {str(err)[:400]}"
            fns.pop(label, None)
    del want
    copy = jax.jit(lambda x: x * jnp.bfloat16(2))   # one elementwise read + write of one array
    seconds = time_rounds([(k, f, (gate, up, dh)) for k, f in fns.items()] + [("copy", copy, (gate,))],
                          loops=loops, errors=errors)
    array_bytes = gate.size * gate.dtype.itemsize
    copy_gbps = 2 * array_bytes / seconds["copy"] / 1e9 if "copy" in seconds else None
    return {"shape": name, "rows": shape[0], "ffn": shape[1], "array_bytes": array_bytes, "errors": errors,
            "max_bf16_steps_from_float32": steps_off,
            "ms": {k: round(t * 1e3, 3) for k, t in seconds.items()},
            "five_arrays_gbps": {k: round(5 * array_bytes / t / 1e9, 1) for k, t in seconds.items() if k != "copy"},
            "elementwise_pass_gbps": round(copy_gbps, 1) if copy_gbps else None,
            "floor_ms": round(5 * array_bytes / copy_gbps / 1e6, 3) if copy_gbps else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {sorted(SHAPES)}")
    ap.add_argument("--loops", type=int, default=6)
    ap.add_argument("--scale", type=int, default=1, help="divide the row count by this (CPU smoke runs)")
    ap.add_argument("--sweep", action="store_true", help="also time the kernel at the SWEEP tiles")
    ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU smoke runs)")
    args = ap.parse_args()
    rows = []
    for name in args.shapes.split(","):
        if name not in SHAPES:
            raise SystemExit(f"--shapes: unknown shape {name!r}; choose from {sorted(SHAPES)}")
        m, f = SHAPES[name]
        rows.append(bench_shape(name, (m // args.scale, f), args.loops, args.sweep, args.interpret))
        print(json.dumps(rows[-1]), flush=True)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump({"benchmark": "bench_swiglu_backward", "environment": environment(), "results": rows}, fh,
                      indent=1)


if __name__ == "__main__":
    main()
