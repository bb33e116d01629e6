"""torch._grouped_mm for bench_grouped_gemm.py: the script a torch subprocess runs (torch never enters the JAX
process, and runs before JAX takes the GPU) and its launcher, which keeps whatever cases finished before a
crash or a timeout. It also times torch's dense GEMM of the same FLOPs: set against the JAX process's dense
GEMM of the same problem (both cuBLAS), it says whether the two processes ran the GPU at the same pace."""
import json
import subprocess
import sys
import time

TORCH_SCRIPT = r"""
import json, sys, torch
cases = json.loads(sys.argv[1])
print("TORCHENV" + json.dumps(dict(torch=torch.__version__, torch_cuda=torch.version.cuda,
                                   torch_device=torch.cuda.get_device_name())), flush=True)

def seconds(fn):
    # as the JAX side times: loops of >= 0.15 s (at most 2000 calls), one untimed, then the median of 5
    for _ in range(3): fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(); fn(); b.record(); torch.cuda.synchronize()
    iters = max(2, min(2000, int(0.15 / max(a.elapsed_time(b) / 1e3, 1e-5))))
    times = []
    for i in range(6):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters): fn()
        b.record(); torch.cuda.synchronize()
        if i: times.append(a.elapsed_time(b) / iters / 1e3)
    return sorted(times)[2]

data, dense_done = {}, {}
for c in cases:
    m, k, n, g, sizes = c["M"], c["K"], c["N"], c["G"], c["group_sizes"]
    res, err, dense_err = {}, None, None
    try:
        if (m, k, n, g) not in data:   # one set of operands per shape, reused by its routings
            data.clear(); torch.cuda.empty_cache(); torch.manual_seed(0)
            data[(m, k, n, g)] = (
                torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True),
                torch.randn(g, k, n, device="cuda", dtype=torch.bfloat16, requires_grad=True),
                torch.randn(m, n, device="cuda", dtype=torch.bfloat16))
        x, w, dy = data[(m, k, n, g)]
        offs = torch.cumsum(torch.tensor(sizes, device="cuda", dtype=torch.int32), 0, dtype=torch.int32)
        def fwd(): return torch._grouped_mm(x, w, offs=offs)
        def fb():   # autograd.grad: dx and dw as outputs, no accumulation into .grad (no extra add kernels)
            y = torch._grouped_mm(x, w, offs=offs); return torch.autograd.grad(y, (x, w), dy)
        useful = min(sum(sizes), m)   # useful FLOPs only, as on the JAX side
        # the same-FLOP dense GEMM in this process (a clock check): [useful, K] @ [K, N], dx and dw by autograd
        xd, wd = x[:useful].detach().requires_grad_(), w[0].detach().requires_grad_()
        def dense(): return xd @ wd
        def dense_fb(): y = xd @ wd; return torch.autograd.grad(y, (xd, wd), dy[:useful])
        def time_all(timed):
            for label, fn, mult in timed:
                v = mult * 2 * useful * k * n / seconds(fn) / 1e12
                res[label] = round(v, 1) if v >= 10 else float(f"{v:.3g}")
        time_all([("fwd", fwd, 1), ("fwd+bwd", fb, 3)])
        if (useful, k, n) not in dense_done:   # once per distinct dense problem, as on the JAX side
            try:   # a failure here must not lose the grouped numbers above
                time_all([("dense/fwd", dense, 1), ("dense/fwd+bwd", dense_fb, 3)])
                dense_done[(useful, k, n)] = {l: res[l] for l in res if l.startswith("dense/")}
            except Exception as e:   # reported under its own name; not cached, so a later case retries it
                dense_err = f"{type(e).__name__}: {str(e)[:300]}"
        res.update(dense_done.get((useful, k, n), {}))
    except Exception as e:
        err = f"{type(e).__name__}: {str(e)[:300]}"
    print("JSONROW" + json.dumps(dict(shape=c["shape"], routing=c["routing"], tflops=res, error=err,
                                      dense_error=dense_err)), flush=True)
"""


def run_torch(cases, timeout_s):
    """{(shape, routing): {'tflops': {...}, 'error': ...}} plus the torch environment; never raises."""
    spec = [{k: c[k] for k in ("shape", "routing", "M", "K", "N", "G", "group_sizes")} for c in cases]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", TORCH_SCRIPT, json.dumps(spec)], capture_output=True,
                              text=True, timeout=timeout_s)
        stdout, stderr, note = proc.stdout, proc.stderr, f"rc {proc.returncode}"
    except subprocess.TimeoutExpired as e:   # keep the cases it finished
        dec = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
        stdout, stderr, note = dec(e.stdout), dec(e.stderr), f"timed out after {timeout_s} s"
    print(f"torch subprocess: {note}, {time.perf_counter() - t0:.1f} s", flush=True)
    if stderr.strip():
        print(stderr[-2000:], flush=True)
    out, env = {}, {}
    for ln in stdout.splitlines():
        if ln.startswith("TORCHENV"):
            env = json.loads(ln[len("TORCHENV"):])
        elif ln.startswith("JSONROW"):
            r = json.loads(ln[len("JSONROW"):])
            out[(r["shape"], r["routing"])] = r
            print(f"  torch {r['shape']:20s} {r['routing']:10s} {r['tflops']} {r['error'] or ''}", flush=True)
    missing = sum((c["shape"], c["routing"]) not in out for c in cases)
    if missing:
        err = f"torch subprocess {note}: {stderr.strip().splitlines()[-1][:300] if stderr.strip() else ''}"
        for c in cases:
            out.setdefault((c["shape"], c["routing"]), dict(tflops={}, error=err))
    env["torch_subprocess_s"] = round(time.perf_counter() - t0, 1)
    return out, env


def merge_torch(row, torch_res):
    r = torch_res.get((row["shape"], row["routing"]))
    if r is None:
        return
    for label, v in r["tflops"].items():   # dense/...: torch's own same-FLOP dense GEMM (cuBLAS), same process
        name = f"torch_dense_same_flops/{label[6:]}" if label.startswith("dense/") else f"torch_grouped_mm/{label}"
        row["tflops"][name] = v
    if r.get("error"):
        row["errors"]["torch_grouped_mm"] = r["error"]
    if r.get("dense_error"):
        row["errors"]["torch_dense_same_flops"] = r["dense_error"]
