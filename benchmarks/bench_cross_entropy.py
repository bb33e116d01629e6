"""The loss head's cross-entropy on the GPU: the model's XLA form (model/layers.cross_entropy: jax.nn.logsumexp +
the one-hot target logit, autodiff) and its Pallas kernel (pallas_kernels/cross_entropy.py) against a one-pass
forward (one variadic reduction; tried for the model and measured slower) and optax's integer-label
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
from megascale_jax.model.layers import cross_entropy, pallas_cross_entropy

SHAPES = {"deepseekmoe_small": (8, 4096, 102400), "mixtral_small": (16, 4096, 32000)}


@jax.custom_vjp
def one_pass_cross_entropy(logits_BSV, targets_BS):
    """Mean cross-entropy whose forward reads the logits once: one variadic reduction over V carries the running
    max, the exp-sum scaled to it and the target's logit; the backward is autodiff's one pass (softmax - one-hot)."""
    return jnp.mean(_one_pass_fwd(logits_BSV, targets_BS)[0])


def _online_log_z_and_target(logits_BSV, targets_BS):
    x = logits_BSV.astype(jnp.float32)
    hit = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1) == targets_BS[..., None]

    def combine(a, b):   # (max, sum of exp(x - max), target logit) of two parts
        (m1, s1, t1), (m2, s2, t2) = a, b
        e = jnp.where(m1 == m2, 1.0, jnp.exp(-jnp.abs(m1 - m2)))   # both -inf: 1, no NaN from -inf + inf
        return jnp.maximum(m1, m2), jnp.where(m1 >= m2, s1 + s2 * e, s1 * e + s2), t1 + t2

    m, s, target = lax.reduce((x, jnp.ones_like(x), jnp.where(hit, x, 0.0)),
                              (jnp.float32(-jnp.inf), jnp.float32(0), jnp.float32(0)), combine, (x.ndim - 1,))
    return m + jnp.log(s), target


def _one_pass_fwd(logits_BSV, targets_BS):
    log_z, target = _online_log_z_and_target(logits_BSV, targets_BS)
    return log_z - target, (logits_BSV, targets_BS, log_z)


def _one_pass_bwd(residuals, g):
    logits_BSV, targets_BS, log_z = residuals
    x = logits_BSV.astype(jnp.float32)
    hit = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1) == targets_BS[..., None]
    d = (jnp.exp(x - log_z[..., None]) - hit.astype(jnp.float32)) * (g / targets_BS.size)
    return d.astype(logits_BSV.dtype), None


def _one_pass_vjp_fwd(logits_BSV, targets_BS):
    per_token, residuals = _one_pass_fwd(logits_BSV, targets_BS)
    return jnp.mean(per_token), residuals


one_pass_cross_entropy.defvjp(_one_pass_vjp_fwd, _one_pass_bwd)


def optax_cross_entropy(logits_BSV, targets_BS):
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits_BSV.astype(jnp.float32), targets_BS))


def model_cross_entropy(logits_BSV, targets_BS):
    """kernels.cross_entropy='xla': the model's form on the float32 view of the bf16 logits, as the head gives them."""
    return cross_entropy(logits_BSV.astype(jnp.float32), targets_BS)


VARIANTS = {"model": model_cross_entropy, "pallas": pallas_cross_entropy, "one_pass": one_pass_cross_entropy,
            "optax": optax_cross_entropy}


def pallas_tiles(chunk: int, num_warps: int):
    """The Pallas kernels at other tiles than their defaults (--sweep)."""
    from pallas_kernels.cross_entropy import cross_entropy_per_token

    def f(logits_BSV, targets_BS):
        b, s, v = logits_BSV.shape
        return jnp.mean(cross_entropy_per_token(logits_BSV.reshape(b * s, v), targets_BS.reshape(b * s), False,
                                                chunk, num_warps))
    return f


SWEEP = [(1024, 4), (4096, 4), (2048, 8), (4096, 8)]   # (columns per step, warps); the default is 2048, 4
# loss_and_scaled_logit_grad (the fused head's one kernel: loss and (softmax - one-hot) / a row scale, written to a
# new array here):
# (columns per step, warps), one program per row. Persistent grids of 132-1056 programs striding over the rows ran
# 8.4-13.9 ms at deepseekmoe_small's shape on an H100, one program per row 6.8 ms, and were removed
# (benchmarks/results/cross_entropy_fused_head_1xh100.json)
FUSED = [(2048, 4), (4096, 8), (4096, 16), (16384, 32)]


def fused_loss_and_grad(chunk: int, num_warps: int, interpret: bool = False, one_read: bool = True):
    """The fused kernel alone: the mean loss, d and its row scale (its whole [T, V] cost in the fused head; what
    remains of the backward there is a scale on the head GEMMs' [T, D] side). `one_read=False`: the kernel of
    kernels.cross_entropy='pallas_fused', which reads each row twice."""
    from pallas_kernels.cross_entropy import loss_and_scaled_logit_grad

    def f(logits_BSV, targets_BS):
        b, s, v = logits_BSV.shape
        loss, d, row_scale = loss_and_scaled_logit_grad(logits_BSV.reshape(b * s, v), targets_BS.reshape(b * s),
                                                        interpret, chunk, num_warps, alias=False,
                                                        one_read=one_read)
        return jnp.mean(loss), d, row_scale
    return f


def bench_shape(name: str, shape, loops: int, sweep: bool = False, interpret: bool = False) -> dict:
    """`interpret`: the fused kernel in Pallas interpret mode (the CPU test)."""
    b, s, v = shape
    kl, kt = jax.random.split(jax.random.key(0))
    logits = (4 * jax.random.normal(kl, (b, s, v), jnp.float32)).astype(jnp.bfloat16)
    targets = jax.random.randint(kt, (b, s), 0, v)
    fns, variants = {}, dict(VARIANTS)
    if sweep:
        variants.update({f"pallas_c{c}_w{w}": pallas_tiles(c, w) for c, w in SWEEP})
    for label, f in variants.items():
        fns[f"{label}/fwd"] = jax.jit(f)
        fns[f"{label}/fwd+bwd"] = jax.jit(jax.value_and_grad(f))
    for c, w in FUSED:
        fns[f"fused_c{c}_w{w}/fwd+bwd"] = jax.jit(fused_loss_and_grad(c, w, interpret))
    fns["fused_two_reads/fwd+bwd"] = jax.jit(fused_loss_and_grad(*FUSED[0], interpret, one_read=False))
    losses, errors = {}, {}
    for key in list(fns):   # a variant that does not compile is recorded and left out of the timing
        label, part = key.split("/")
        if key not in fns or (part == "fwd+bwd" and f"{label}/fwd" in fns):
            continue   # dropped with its forward, or loss read from the forward
        try:
            out = fns[key](logits, targets)
            losses[label] = float(out[0] if isinstance(out, tuple) else out)
        except Exception as err:  # noqa: BLE001
            errors[label] = f"{type(err).__name__}: {str(err)[:400]}"
            fns.pop(f"{label}/fwd", None), fns.pop(f"{label}/fwd+bwd")
    copy = jax.jit(lambda x: x * jnp.bfloat16(2))   # one elementwise read + write of the logits
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
    ap.add_argument("--sweep", action="store_true", help="also time the Pallas kernels at the SWEEP tiles")
    args = ap.parse_args()
    rows = []
    for name in args.shapes.split(","):
        if name not in SHAPES:
            raise SystemExit(f"--shapes: unknown shape {name!r}; choose from {sorted(SHAPES)}")
        b, s, v = SHAPES[name]
        rows.append(bench_shape(name, (b, s // args.scale, v), args.loops, args.sweep))
        print(json.dumps(rows[-1]), flush=True)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"benchmark": "bench_cross_entropy", "environment": environment(), "results": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
