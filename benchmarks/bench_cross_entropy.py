"""The loss head's cross-entropy on the GPU: our one-pass forward (model/layers.token_cross_entropy) against the
two-pass form it replaced (jax.nn.logsumexp + the one-hot target logit, autodiff) and optax's integer-label
cross-entropy, forward and forward + backward (the gradient w.r.t. the bf16 logits, as in the train step),
timed round by round in one process (benchmarks/loop_timing.time_rounds).

    python -m benchmarks.bench_cross_entropy --out $OUT/cross_entropy.json

Shapes: the logits of deepseekmoe_small's step (8 x 4096 tokens, vocabulary 102400) and mixtral_small's
(16 x 4096, 32000). The JSON also gives each reading as GB/s of one read of the logits, and the bandwidth of
a plain elementwise pass over the same array (a read and a write) for scale.
"""
from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import optax
from jax import lax

from benchmarks.environment import environment
from benchmarks.loop_timing import time_rounds
from megascale_jax.model.layers import cross_entropy

SHAPES = {"deepseekmoe_small": (8, 4096, 102400), "mixtral_small": (16, 4096, 32000)}


def two_pass_cross_entropy(logits_BSV, targets_BS):
    """The form model/layers.cross_entropy had before the one-pass forward (same values): logsumexp's max pass
    and exp-sum pass, the target logit by a one-hot mask; its gradient by autodiff."""
    logits = logits_BSV.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    vocab_V = lax.broadcasted_iota(jnp.int32, (logits.shape[-1],), 0)
    return jnp.mean(log_z - jnp.sum(jnp.where(vocab_V == targets_BS[..., None], logits, 0.0), axis=-1))


def optax_cross_entropy(logits_BSV, targets_BS):
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits_BSV.astype(jnp.float32), targets_BS))


VARIANTS = {"one_pass": cross_entropy, "two_pass": two_pass_cross_entropy, "optax": optax_cross_entropy}


def bench_shape(name: str, shape, loops: int) -> dict:
    b, s, v = shape
    kl, kt = jax.random.split(jax.random.key(0))
    logits = (4 * jax.random.normal(kl, (b, s, v), jnp.float32)).astype(jnp.bfloat16)
    targets = jax.random.randint(kt, (b, s), 0, v)
    fns = {}
    for label, f in VARIANTS.items():
        fns[f"{label}/fwd"] = jax.jit(f)
        fns[f"{label}/fwd+bwd"] = jax.jit(jax.value_and_grad(f))
    losses = {label: float(fns[f"{label}/fwd"](logits, targets)) for label in VARIANTS}
    copy = jax.jit(lambda x: x * jnp.bfloat16(2))   # one elementwise read + write of the logits
    errors: dict = {}
    seconds = time_rounds([(k, f, (logits, targets)) for k, f in fns.items()] + [("copy", copy, (logits,))],
                          loops=loops, errors=errors)
    nbytes = logits.size * logits.dtype.itemsize
    return {"shape": name, "tokens": b * s, "vocab": v, "logits_bytes": nbytes, "losses": losses, "errors": errors,
            "ms": {k: round(t * 1e3, 3) for k, t in seconds.items()},
            "logits_read_gbps": {k: round(nbytes / t / 1e9, 1) for k, t in seconds.items() if k != "copy"},
            "elementwise_pass_gbps": round(2 * nbytes / seconds["copy"] / 1e9, 1) if "copy" in seconds else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {sorted(SHAPES)}")
    ap.add_argument("--loops", type=int, default=6)
    ap.add_argument("--scale", type=int, default=1, help="divide the token count by this (CPU smoke runs)")
    args = ap.parse_args()
    rows = []
    for name in args.shapes.split(","):
        if name not in SHAPES:
            raise SystemExit(f"--shapes: unknown shape {name!r}; choose from {sorted(SHAPES)}")
        b, s, v = SHAPES[name]
        rows.append(bench_shape(name, (b, s // args.scale, v), args.loops))
        print(json.dumps(rows[-1]), flush=True)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"benchmark": "bench_cross_entropy", "environment": environment(), "results": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
