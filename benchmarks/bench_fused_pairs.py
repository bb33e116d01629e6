"""Each fused communication + GEMM pair against its unfused sequence, in one run, on every local device.

    python -m benchmarks.bench_fused_pairs --out $OUT/fused_pairs.json      # n = the machine's GPUs (>= 2)
    python -m benchmarks.bench_fused_pairs --tiny --out /tmp/pairs.json     # CPU smoke: twins and rings only

Pairs (issue 15; Mixtral-shaped attention by default: hidden 4096, 32 q / 8 kv heads of 128, `--tokens` per rank):
  * GEMM+A2A, the q/k/v projection into Ulysses' head layout: x [T, D] @ w [n, D, F] (F = the q/k/v columns one
    destination owns, (Hq + 2 Hkv) / n x head_dim), each destination's columns sent to it.
      unfused: one einsum, then `lax.all_to_all`   (pallas_kernels/gemm_all_to_all.py's twin)
      ring:    n steps, step j computes rank r + j's columns and ppermutes them there (the plain-JAX schedule)
      mosaic:  `gemm_all_to_all` (GPU, n >= 2)
  * A2A+GEMM, the output projection back to sequence chunks: x [n, T, Hq / n x head_dim] (rows per destination
    chunk) -> y [T, D] = sum_s x_s[r] @ wo[s].
      unfused: `lax.all_to_all`, then one einsum   (all_to_all_gemm.py's twin)
      ring:    n steps, step j receives rank r - j's rows by ppermute and adds their GEMM in fp32
      mosaic:  `all_to_all_gemm` (GPU, n >= 2)
The MoE pairs (Mixtral's experts by default: hidden 4096, FFN 14336, 8 experts over the n ranks, top-2,
`--moe-tokens` per rank, uniform random routing, the same on every variant):
  * AG + scatter + grouped GEMM, the gate GEMM of the received rows: each rank's routed rows in (destination,
    expert) order -> the receiver's (expert, source)-ordered rows @ its experts' weights.
      unfused: `receive_runs` (one all-to-all), then the grouped GEMM   (pallas on GPU, ragged_dot on CPU)
      mosaic:  `all_gather_grouped_gemm` (GPU, n >= 2)
  * grouped GEMM + gather + RS, the down GEMM with the way back: the received rows @ the down weights, each
    row returned to the rank (and row) it came from.
      unfused: the grouped GEMM, then `return_runs` (one all-to-all)
      mosaic:  `grouped_gemm_reduce_scatter` (GPU, n >= 2)
  On the CPU each also runs its kernel's all-gather twin ('twin'), an independent check of the unfused pair.
  Their ring forms (parallel/ring_dispatch.py) order rows by source, not by expert, so they are not in this table.
Every variant's output is checked against the unfused one (relative Frobenius error); timing as the grouped-GEMM
benchmark times (a loop of calls between two host syncs, median of loops, after a compiling warm-up), each
variant a jit of a shard_map over all devices. The bytes each rank sends are the same in every variant.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.environment import environment  # noqa: E402
from benchmarks.loop_timing import TIMING, time_call  # noqa: E402
from pallas_kernels.all_gather_grouped_gemm import all_gather_grouped_gemm, all_gather_grouped_gemm_reference  # noqa: E402
from pallas_kernels.all_to_all_gemm import all_to_all_gemm, all_to_all_gemm_reference  # noqa: E402
from pallas_kernels.gemm_all_to_all import gemm_all_to_all, gemm_all_to_all_reference  # noqa: E402
from pallas_kernels.grouped_gemm import grouped_gemm  # noqa: E402
from pallas_kernels.grouped_gemm_reduce_scatter import (grouped_gemm_reduce_scatter,  # noqa: E402
                                                        grouped_gemm_reduce_scatter_reference)
from pallas_kernels.run_exchange_reference import receive_runs, return_runs  # noqa: E402

AXIS = "x"


def ring_gemm_all_to_all(x_MD, w_NDF, *, axis):
    """GEMM+A2A as n point-to-point steps: step j computes destination r + j's columns and sends them there."""
    n, rank = lax.axis_size(axis), lax.axis_index(axis)
    slots = []
    for j in range(n):
        y = jnp.einsum("md,df->mf", x_MD, w_NDF[(rank + j) % n], preferred_element_type=jnp.float32)
        y = y.astype(x_MD.dtype)
        slots.append(y if j == 0 else lax.ppermute(y, axis, [(s, (s + j) % n) for s in range(n)]))
    # slot j holds what rank r - j computed for me: recv[s] is at j = (r - s) mod n
    stacked = jnp.stack(slots)
    return jnp.take(stacked, (rank - jnp.arange(n)) % n, axis=0)


def ring_all_to_all_gemm(x_NMK, w_NKD, *, axis):
    """A2A+GEMM as n point-to-point steps: step j receives rank r - j's rows for my chunk, adds their GEMM."""
    n, rank = lax.axis_size(axis), lax.axis_index(axis)
    acc = None
    for j in range(n):
        rows = x_NMK[(rank + j) % n]                                          # mine for rank r + j
        if j:
            rows = lax.ppermute(rows, axis, [(s, (s + j) % n) for s in range(n)])  # now rank r - j's for me
        part = jnp.einsum("mk,kd->md", rows, w_NKD[(rank - j) % n], preferred_element_type=jnp.float32)
        acc = part if acc is None else acc + part
    return acc.astype(x_NMK.dtype)


def _shapes(args, n):
    heads, kv, hd, dim = args.heads, args.kv_heads, args.head_dim, args.hidden
    for name, v in (("heads", heads), ("kv_heads", kv)):
        if v % n:
            raise SystemExit(f"--{name.replace('_', '-')}={v} must be divisible by the {n} devices")
    return dict(tokens_per_rank=args.tokens, hidden=dim, heads=heads, kv_heads=kv, head_dim=hd, ranks=n,
                qkv_cols_per_dest=(heads + 2 * kv) // n * hd, out_cols_per_source=heads // n * hd)


def _moe_problem(args, n, dtype):
    """Host-side routing (uniform top-k, seed 0) and each rank's send buffer: rows sorted by global expert."""
    t, k, e, d, f = args.moe_tokens, args.top_k, args.experts, args.hidden, args.expert_ffn
    if e % n:
        raise SystemExit(f"--experts={e} must be divisible by the {n} devices")
    g, rng = e // n, np.random.default_rng(0)
    idx = np.stack([np.argsort(rng.random((t, e)), axis=1)[:, :k] for _ in range(n)])       # [n, T, K]
    counts = np.stack([np.bincount(idx[r].reshape(-1), minlength=e).reshape(n, g) for r in range(n)])
    x = rng.standard_normal((n, t, d)).astype(np.float32)
    send = np.stack([x[r][np.argsort(idx[r].reshape(-1), kind="stable") // k] for r in range(n)])   # [n, T*K, D]
    source_rows = -(-t * min(k, g) // 8) * 8
    capacity = max(n * source_rows, 256)
    h = rng.standard_normal((n, capacity, f)).astype(np.float32)
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    return dict(send=cast(send.reshape(n * t * k, d)), counts=jnp.asarray(counts, jnp.int32), h=cast(h.reshape(-1, f)),
                w_up=cast(rng.standard_normal((e, d, f)) / np.sqrt(d)), w_down=cast(rng.standard_normal((e, f, d)) / np.sqrt(f)),
                source_rows=source_rows, capacity=capacity, rows=t * k, routed=t * k)


def _moe_pairs(args, n, on_gpu, put):
    """The two MoE pairs' arguments and variants (see the module docstring)."""
    prob = _moe_problem(args, n, jnp.bfloat16 if on_gpu else jnp.float32)
    cap, src, rows = prob["capacity"], prob["source_rows"], prob["rows"]
    gemm = grouped_gemm if on_gpu else jax.lax.ragged_dot

    def ag_unfused(send, counts, w, *, axis):
        recv, sizes = receive_runs(send, counts, axis=axis, capacity_per_source=src)
        recv = jnp.pad(recv, ((0, cap - recv.shape[0]), (0, 0)))
        return gemm(recv, w, sizes)

    def ag_mosaic(send, counts, w, *, axis):
        return all_gather_grouped_gemm(send, counts, w, axis=axis, capacity=cap, source_rows=src)[0]

    def rs_unfused(h, counts, w, *, axis):
        sizes = jnp.sum(counts[:, lax.axis_index(axis)], axis=0)
        return return_runs(gemm(h, w, sizes), counts, axis=axis, capacity_per_source=src, rows=rows)

    def rs_mosaic(h, counts, w, *, axis):
        return grouped_gemm_reduce_scatter(h, counts, w, axis=axis, rows=rows, source_rows=src)

    def ag_twin(send, counts, w, *, axis):   # the kernel's all-gather twin: an independent check on the CPU
        return all_gather_grouped_gemm_reference(send, counts, w, axis=axis, capacity=cap)[0]

    def rs_twin(h, counts, w, *, axis):
        return grouped_gemm_reduce_scatter_reference(h, counts, w, axis=axis, rows=rows)

    flops = 2 * prob["routed"] * args.hidden * args.expert_ffn   # per rank, on average (uniform routing)
    specs = (P(AXIS), P(), P(AXIS))
    mosaic = on_gpu and n >= 2
    third = lambda fused, twin: {"mosaic": fused} if mosaic else ({} if on_gpu else {"twin": twin})  # noqa: E731
    return {
        "ag_scatter_grouped_gemm": dict(args=(put(prob["send"], P(AXIS)), put(prob["counts"], P()),
                                              put(prob["w_up"], P(AXIS))), specs=specs, flops=flops,
                                        variants={"unfused": ag_unfused, **third(ag_mosaic, ag_twin)}),
        "grouped_gemm_gather_rs": dict(args=(put(prob["h"], P(AXIS)), put(prob["counts"], P()),
                                             put(prob["w_down"], P(AXIS))), specs=specs, flops=flops,
                                       variants={"unfused": rs_unfused, **third(rs_mosaic, rs_twin)}),
    }


def _variants(on_gpu: bool, n: int, fused, ring, twin):
    out = {"unfused": twin, "ring": ring}
    if on_gpu and n >= 2:
        out["mosaic"] = fused
    return out


def measure(args) -> dict:
    devices = jax.devices()
    n = len(devices)
    mesh = jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Explicit,))
    on_gpu = devices[0].platform == "gpu"
    shp = _shapes(args, n)
    t, dim, f, kcols = args.tokens, shp["hidden"], shp["qkv_cols_per_dest"], shp["out_cols_per_source"]
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    keys = jax.random.split(jax.random.key(0), 4)
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    normal = lambda i, shape, scale=1.0: (jax.random.normal(keys[i], shape, jnp.float32) * scale).astype(dtype)  # noqa: E731
    pairs = {
        "gemm_a2a": dict(
            args=(put(normal(0, (n * t, dim)), P(AXIS)),
                  put(normal(1, (n * n, dim, f), 1 / np.sqrt(dim)), P(AXIS))),
            specs=(P(AXIS), P(AXIS)), flops=2 * t * dim * f * n,
            variants=_variants(on_gpu, n, gemm_all_to_all, ring_gemm_all_to_all, gemm_all_to_all_reference)),
        "a2a_gemm": dict(
            args=(put(normal(2, (n * n, t, kcols)), P(AXIS)),
                  put(normal(3, (n, kcols, dim), 1 / np.sqrt(n * kcols)), P())),
            specs=(P(AXIS), P()), flops=2 * t * n * kcols * dim,
            variants=_variants(on_gpu, n, all_to_all_gemm, ring_all_to_all_gemm, all_to_all_gemm_reference)),
    }
    pairs.update(_moe_pairs(args, n, on_gpu, put))
    shp.update(moe_tokens_per_rank=args.moe_tokens, experts=args.experts, top_k=args.top_k, expert_ffn=args.expert_ffn)
    report = dict(benchmark="bench_fused_pairs", environment=environment(), shapes=shp, dtype=str(jnp.dtype(dtype)),
                  pairs={})
    if not (on_gpu and n >= 2):
        report["mosaic_skipped"] = f"the kernels need >= 2 GPUs; this run has {n} {devices[0].platform} device(s)"
    for pair, spec in pairs.items():
        rows, ref = {}, None
        for label, fn in spec["variants"].items():
            body = functools.partial(fn, axis=AXIS)
            # per device: gemm_a2a x [T, D], w [n, D, F] -> [n, T, F]; a2a_gemm x [n, T, K], w [n, K, D] -> [T, D];
            # the MoE pairs (rows, counts, weights) -> rows
            mapped = jax.shard_map(lambda *a, body=body: body(*a)[None], mesh=mesh, in_specs=spec["specs"],
                                   out_specs=P(AXIS), check_vma=label != "mosaic")
            call = jax.jit(mapped)
            try:
                seconds, out = time_call(call, *spec["args"])
            except Exception as err:  # noqa: BLE001  (one failing variant must not stop the others)
                rows[label] = dict(error=f"{type(err).__name__}: {str(err)[:300]}")
                print(f"{pair:9s} {label:8s} FAILED {type(err).__name__}: {str(err)[:200]}", flush=True)
                continue
            got = np.asarray(out, np.float64)
            ref = got if ref is None else ref
            err = float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))
            rate = spec["flops"] / seconds / 1e12
            rows[label] = dict(ms=round(seconds * 1e3, 4), tflops_per_rank=float(f"{rate:.4g}"), rel_err_vs_unfused=err)
            print(f"{pair:9s} {label:8s} {seconds * 1e3:9.3f} ms  rel err vs unfused {err:.1e}", flush=True)
        base = rows.get("unfused", {}).get("ms")
        for label, row in rows.items():
            if base and "ms" in row:
                row["speedup_vs_unfused"] = round(base / row["ms"], 3)
        report["pairs"][pair] = rows
    return report


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=1024, help="rows per rank and destination (sequence chunk x batch)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--moe-tokens", type=int, default=4096, help="tokens per rank of the MoE pairs")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-ffn", type=int, default=14336)
    p.add_argument("--tiny", action="store_true", help="small shapes for a CPU smoke run (8 heads of 8, hidden 64)")
    args = p.parse_args(argv)
    if args.tiny:
        args.tokens, args.hidden, args.heads, args.kv_heads, args.head_dim = 16, 64, 8, 8, 8
        args.moe_tokens, args.expert_ffn = 32, 32
        TIMING.update(min_total_s=0.0, loops=1, min_iters=1)
    report = measure(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=1)
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
