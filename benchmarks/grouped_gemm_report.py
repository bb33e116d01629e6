"""What bench_grouped_gemm.py writes: per-row ratios and issue 10's verdicts, the summary over rows, the JSON (with
the environment it ran in) and the markdown table next to it."""
import importlib.metadata
import json
import os
import subprocess
import sys
import time

import jax

from benchmarks.grouped_gemm_cases import REPEAT, SAME_TAIL_VERDICT, TOKENS_PER_DEVICE, UNWRITTEN_TAIL


def _ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def hbm_floor_bytes(row):
    """The least HBM traffic of one forward call: every non-empty group's weight once, the routed rows of x
    once, the whole output once (its zero tail included). Fine-grained experts reach it: Qwen3 EP1 reads 403 MB
    of weights per call whatever the routing, as much as its x and output together."""
    active = sum(1 for s in row["group_sizes"] if s > 0)
    return 2 * (active * row["K"] * row["N"] + row["useful_rows"] * row["K"] + row["M"] * row["N"])


def finalize_row(row, hbm_gbps=None):
    """Ratios and verdicts; with `hbm_gbps` (an elementwise pass's bandwidth, same process) also the forward's
    HBM floor (hbm_floor_bytes at that bandwidth) and its share of our forward time."""
    t = row["tflops"]
    if hbm_gbps:
        floor_bytes = hbm_floor_bytes(row)
        floor_ms = floor_bytes / (hbm_gbps * 1e9) * 1e3
        row["hbm_floor"] = dict(bytes=floor_bytes, ms_fwd=round(floor_ms, 4),
                                share_of_ours_fwd=_ratio(floor_ms, row["ms"].get("ours/fwd")))
    ours = {kd: t.get(f"ours/{kd}") for kd in ("fwd", "fwd+bwd")}
    row["ratios"] = {f"ours/{base}/{kd}": _ratio(ours[kd], t.get(f"{base}/{kd}"))
                     for base in ("torch_grouped_mm", "dense_same_flops") for kd in ("fwd", "fwd+bwd")}
    r = row["ratios"]
    vs_torch = [r[f"ours/torch_grouped_mm/{kd}"] for kd in ("fwd", "fwd+bwd")]
    vs_dense = r["ours/dense_same_flops/fwd"]
    row["verdict"] = {"ours>=torch_grouped_mm": None if None in vs_torch else all(v >= 1.0 for v in vs_torch),
                      "ours>=0.9x_dense_fwd": None if vs_dense is None else vs_dense >= 0.9}
    # torch._grouped_mm leaves rows past sum(group_sizes) unwritten; ours writes zeros there by default. The
    # same contract on both sides: where a row has a tail, ours with zero_tail='none' (if it was timed).
    if row["M"] > row["useful_rows"] and any(f"{UNWRITTEN_TAIL}/{kd}" in t for kd in ("fwd", "fwd+bwd")):
        same = [_ratio(t.get(f"{UNWRITTEN_TAIL}/{kd}"), t.get(f"torch_grouped_mm/{kd}")) for kd in ("fwd", "fwd+bwd")]
        r.update({f"{UNWRITTEN_TAIL}/torch_grouped_mm/{kd}": v for kd, v in zip(("fwd", "fwd+bwd"), same)})
    else:
        same = vs_torch
    row["verdict"][SAME_TAIL_VERDICT] = None if None in same else all(v >= 1.0 for v in same)
    # the rounds' noise: one compiled call read twice (ours/fwd and ours_repeat/fwd); a verdict missed by less
    # than this cannot tell the two sides apart
    a, b = t.get("ours/fwd"), t.get(f"{REPEAT}/fwd")
    spread = row["same_kernel_spread"] = round(abs(a - b) / min(a, b), 3) if a and b else None
    worst = {"ours>=torch_grouped_mm": (vs_torch, 1.0), SAME_TAIL_VERDICT: (same, 1.0),
             "ours>=0.9x_dense_fwd": ([vs_dense], 0.9)}
    row["missed_within_spread"] = {} if spread is None else {
        key: row["verdict"][key] is False and min(v) >= bar * (1 - spread) for key, (v, bar) in worst.items()}
    return row


def summary(results):
    def collect(key):
        vals = [(f"{r['shape']}/{r['routing']}", r["verdict"][key]) for r in results]
        within = [f"{r['shape']}/{r['routing']}" for r in results if r.get("missed_within_spread", {}).get(key)]
        return dict(all_rows_pass=bool(vals) and all(v is True for _, v in vals),
                    failing=[s for s, v in vals if v is False], missing=[s for s, v in vals if v is None],
                    failing_within_same_kernel_spread=within)
    return {"rows": len(results), "ours>=torch_grouped_mm": collect("ours>=torch_grouped_mm"),
            SAME_TAIL_VERDICT: collect(SAME_TAIL_VERDICT), "ours>=0.9x_dense_fwd": collect("ours>=0.9x_dense_fwd")}


def save_json(args, results):
    results = [finalize_row(r, args.environment.get("hbm_copy_gbps")) for r in results]
    env = dict(args.environment, elapsed_s=round(time.perf_counter() - args.t_start, 1))
    with open(args.out, "w") as f:
        json.dump(dict(environment=env, suite=args.suite, mode=None if args.suite else args.mode,
                       tokens_per_device=(getattr(args, "tokens_per_device", None) or TOKENS_PER_DEVICE)
                       if args.suite == "issue10" else None,
                       flops_note="useful FLOPs: 2*sum(group_sizes)*K*N per GEMM, 3 GEMMs for fwd+bwd",
                       summary=summary(results), results=results), f, indent=1)


def _fmt(v, ratio=False):
    if v is None:
        return "-"
    return f"{v:.2f}" if ratio else f"{v:.0f}" if v >= 10 else f"{v:.3g}"


def _ok(v):
    return {True: "yes", False: "NO", None: "-"}[v]


def markdown_table(results, env):
    head = ("| shape | routing | M | K | N | G | useful rows | fwd ours | fwd torch | fwd dense | fwd dense (torch) "
            "| ours/torch | ours/dense | f+b ours | f+b torch | f+b dense | ours/torch | ours/dense | >= torch "
            "| >= 0.9 dense fwd | fwd HBM floor ms | floor / ours fwd | >= torch, tail unwritten as torch's "
            "| same-kernel spread |")
    lines = [f"Grouped GEMM, bf16, TFLOP/s of useful FLOPs ({env.get('device')}, jax {env.get('jax')}, "
             f"torch {env.get('torch')}); ours = Pallas Mosaic GPU kernel, default tuning; torch = "
             "torch._grouped_mm; dense = one GEMM of the same FLOPs (in the JAX process; 'dense (torch)': the "
             "same GEMM in the torch server process, in the same timing rounds: where the two dense columns "
             "differ, the two processes did not see the same GPU); HBM floor = the least bytes of a forward call "
             "(non-empty groups' weights, routed x rows, the whole output) at the bandwidth of one elementwise pass "
             f"in the JAX process ({env.get('hbm_copy_gbps') or '-'} GB/s); same-kernel spread = the gap between "
             "two readings of ours/fwd (one compiled call at both ends of each round's order): the rounds' noise",
             "", head,
             "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        t, q, v = r["tflops"], r["ratios"], r["verdict"]
        cells = [r["shape"], r["routing"], r["M"], r["K"], r["N"], r["G"], r["useful_rows"]]
        for kd in ("fwd", "fwd+bwd"):
            cells += [_fmt(t.get(f"ours/{kd}")), _fmt(t.get(f"torch_grouped_mm/{kd}")),
                      _fmt(t.get(f"dense_same_flops/{kd}"))]
            cells += [_fmt(t.get("torch_dense_same_flops/fwd"))] if kd == "fwd" else []
            cells += [_fmt(q[f"ours/torch_grouped_mm/{kd}"], True), _fmt(q[f"ours/dense_same_flops/{kd}"], True)]
        floor = r.get("hbm_floor") or {}
        cells += [_ok(v["ours>=torch_grouped_mm"]), _ok(v["ours>=0.9x_dense_fwd"]), _fmt(floor.get("ms_fwd")),
                  _fmt(floor.get("share_of_ours_fwd"), True), _ok(v.get(SAME_TAIL_VERDICT)),
                  "-" if r.get("same_kernel_spread") is None else f"{100 * r['same_kernel_spread']:.1f}%"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    s = summary(results)
    for key in ("ours>=torch_grouped_mm", SAME_TAIL_VERDICT, "ours>=0.9x_dense_fwd"):
        verdict = ("PASS on every row" if s[key]["all_rows_pass"] else "FAIL" if s[key]["failing"]
                   else "INCOMPLETE (no failing row, some numbers missing)")
        lines.append(f"\n{key}: {verdict}; failing {s[key]['failing'] or 'none'} (of them missed by less than "
                     f"the row's same-kernel spread: {s[key]['failing_within_same_kernel_spread'] or 'none'}); "
                     f"missing {s[key]['missing'] or 'none'}")
    return "\n".join(lines)


def environment(torch_env):
    import jaxlib
    dev = jax.devices()[0]
    info = dict(device=dev.device_kind, platform=dev.platform, num_sms=getattr(dev, "core_count", None),
                jax=jax.__version__, jaxlib=jaxlib.__version__, python=sys.version.split()[0],
                date=time.strftime("%Y-%m-%d %H:%M:%S"))
    for dist in importlib.metadata.distributions():   # the jax CUDA plugin, without importing it
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith("jax-cuda") or name.startswith("jax_cuda"):
            info[name] = dist.version
    try:
        info["torch"] = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        pass
    info.update(torch_env)
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,power.limit",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        if smi.returncode == 0 and smi.stdout.strip():
            info["nvidia_smi"] = smi.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        info["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
    return info
