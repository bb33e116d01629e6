"""Expert-parallel dispatch + combine bandwidth per GPU, next to NCCL's all-to-all of the same bytes, in one run
on every local device (issue 15's EP bandwidth figure).

    python -m benchmarks.bench_ep_bandwidth --out $OUT/ep_bandwidth.json     # n = the machine's GPUs (>= 2)
    python -m benchmarks.bench_ep_bandwidth --tiny --out /tmp/ep.json         # CPU smoke (8 simulated devices)

For each hidden size (`--hidden`, default 4096 and 7168) and top-k (`--top-k`, default 2 and 8), T tokens per
rank (`--tokens`), E experts (`--experts`, default 8 per rank), uniform random routing (seed 0), bf16 on GPU:
  all_to_all      the model's dispatcher (parallel/layouts.py AllToAllDispatch): dispatch, then combine of the
                  same rows (no expert compute), dropless per-destination buffers of C = T x min(K, G) rows
  all_to_all_fp8  the same with the E4M3 payload (parallel.dispatch_dtype='fp8')
  runs            parallel/expert_runs.py's exchange (rows as (destination, expert) runs), dispatch + combine
  nccl            two `lax.all_to_all`s of an [n, C, D] buffer: the all_to_all dispatcher's wire bytes, moved
                  with nothing else around them
Per row: ms per dispatch + combine (median of loops, as the grouped GEMM benchmark times), the routed bytes per
GPU (rows that leave the rank, both ways: 2 x T x K x (n-1)/n x D x itemsize) and the GB/s they make, and the
wire bytes per GPU (parallel/expert_parallel.py expert_parallel_wire_bytes: the buffers, padding included) and
their GB/s. `--plot` writes a bar chart beside the JSON.
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
from megascale_jax.model.moe.router import Routing  # noqa: E402
from megascale_jax.parallel.expert_parallel import expert_parallel_wire_bytes, rows_per_destination  # noqa: E402
from megascale_jax.parallel.expert_runs import ExpertRunsDispatch  # noqa: E402
from megascale_jax.parallel.layouts import AllToAllDispatch  # noqa: E402
from megascale_jax.parallel.plan import INTRA  # noqa: E402

VARIANTS = ("all_to_all", "all_to_all_fp8", "runs", "nccl")


def _round_trip(dispatcher):
    """dispatch -> combine with identity experts: y_TD = sum_k w_k x_t (the same rows come back)."""
    def run(x_TD, idx_TK, w_TK):
        routing = Routing(idx_TK, w_TK, jnp.float32(0), jnp.float32(0))
        x_MD, _, residual = dispatcher.dispatch(x_TD, routing)
        return dispatcher.combine(x_MD, residual, w_TK)
    return run


def _nccl(rows: int, n: int):
    """The all_to_all dispatcher's two buffer exchanges alone: [n, C, D] there and back."""
    def run(x_TD, idx_TK, w_TK):
        del idx_TK, w_TK
        buf = jnp.resize(x_TD, (n, rows, x_TD.shape[1]))   # C rows per destination, filled from the tokens
        there = lax.all_to_all(buf, INTRA, 0, 0, tiled=True)
        back = lax.all_to_all(there, INTRA, 0, 0, tiled=True)
        return back.reshape(-1, x_TD.shape[1])[:x_TD.shape[0]]
    return run


def measure_row(mesh, n, hidden, top_k, args, dtype):
    t, e = args.tokens, args.experts or 8 * n
    rng = np.random.default_rng(0)
    idx = np.argsort(rng.random((n * t, e)), axis=1)[:, :top_k].astype(np.int32)
    put = lambda a, spec: jax.device_put(jnp.asarray(a), NamedSharding(mesh, spec))  # noqa: E731
    x = put(rng.standard_normal((n * t, hidden)).astype(np.float32).astype(dtype), P(INTRA))
    w = put(np.full((n * t, top_k), 1.0 / top_k, np.float32), P(INTRA))
    idx = put(idx, P(INTRA))
    itemsize = jnp.dtype(dtype).itemsize
    rows = rows_per_destination(t, top_k, e, n)
    wire = expert_parallel_wire_bytes(num_tokens=t, top_k=top_k, num_experts=e, axis_size=n, hidden=hidden,
                                      dispatch="all_to_all", itemsize=itemsize)
    routed = 2 * t * top_k * (n - 1) / n * hidden * itemsize
    fns = {"all_to_all": _round_trip(AllToAllDispatch(e)), "all_to_all_fp8": _round_trip(AllToAllDispatch(e, wire="fp8")),
           "runs": _round_trip(ExpertRunsDispatch(e)), "nccl": _nccl(rows, n)}
    row = dict(hidden=hidden, top_k=top_k, experts=e, tokens_per_rank=t, ranks=n, rows_per_destination=rows,
               routed_bytes_per_gpu=int(routed), wire_bytes_per_gpu=int(wire["dispatch"] + wire["return"]),
               variants={})
    ref = None
    for label in args.variants.split(","):
        mapped = jax.shard_map(fns[label], mesh=mesh, in_specs=(P(INTRA),) * 3, out_specs=P(INTRA), check_vma=False)
        try:
            seconds, out = time_call(jax.jit(mapped), x, idx, w)
        except Exception as err:  # noqa: BLE001 - one failing variant must not stop the others
            row["variants"][label] = dict(error=f"{type(err).__name__}: {str(err)[:300]}")
            continue
        got = np.asarray(out, np.float64)
        entry = dict(ms=float(f"{seconds * 1e3:.4g}"), routed_gbps=float(f"{routed / seconds / 1e9:.4g}"),
                     wire_gbps=float(f"{row['wire_bytes_per_gpu'] / seconds / 1e9:.4g}"))
        if label != "nccl":   # the round trip returns each token's own row (the weights sum to 1)
            ref = got if ref is None else ref
            entry["rel_err_vs_all_to_all"] = float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))
            entry["rel_err_vs_input"] = float(np.linalg.norm(got - np.asarray(x, np.float64)) /
                                              np.linalg.norm(np.asarray(x, np.float64)))
        row["variants"][label] = entry
        print(f"h={hidden} k={top_k} {label:15s} {seconds * 1e3:8.3f} ms  routed {entry['routed_gbps']:8.4g} GB/s  "
              f"wire {entry['wire_gbps']:8.4g} GB/s", flush=True)
    return row


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    labels = [f"h{r['hidden']} k{r['top_k']}" for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(VARIANTS)
    for j, v in enumerate(VARIANTS):
        vals = [r["variants"].get(v, {}).get("wire_gbps", 0.0) for r in rows]
        ax.bar([i + j * width for i in range(len(rows))], vals, width, label=v, color=f"C{j}")
    ax.set_xticks([i + width * (len(VARIANTS) - 1) / 2 for i in range(len(rows))], labels)
    ax.set_ylabel("wire GB/s per GPU (dispatch + combine)")
    ax.set_title(f"EP exchange, {report['ranks']} x {report['environment']['device_kind']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--hidden", default="4096,7168")
    p.add_argument("--top-k", default="2,8")
    p.add_argument("--experts", type=int, default=0, help="0: 8 per rank")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list from {VARIANTS}")
    p.add_argument("--plot", action="store_true")
    p.add_argument("--tiny", action="store_true", help="small shapes for a CPU smoke run")
    args = p.parse_args(argv)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; choose from {VARIANTS}")
    if args.tiny:
        args.tokens, args.hidden, args.top_k = 16, "64", "2,8"
        TIMING.update(min_total_s=0.0, loops=1, min_iters=1)
    devices = jax.devices()
    n = len(devices)
    mesh = jax.make_mesh((n,), (INTRA,), axis_types=(AxisType.Explicit,))
    dtype = jnp.bfloat16 if devices[0].platform == "gpu" else jnp.float32
    report = dict(benchmark="bench_ep_bandwidth", environment=environment(), ranks=n, dtype=str(jnp.dtype(dtype)),
                  description=__doc__, rows=[])
    if n < 2:
        report["note"] = "one device: nothing leaves the rank, the rates measure local copies only"
    for hidden in (int(h) for h in args.hidden.split(",")):
        for top_k in (int(k) for k in args.top_k.split(",")):
            report["rows"].append(measure_row(mesh, n, hidden, top_k, args, dtype))
            os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
            with open(args.out, "w") as fh:
                json.dump(report, fh, indent=1)
    if args.plot:
        try:
            plot(report, os.path.splitext(args.out)[0] + ".png")
        except ImportError as err:   # matplotlib is not a dependency of the package (the GPU image has it)
            print(f"no plot: {err}")
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
