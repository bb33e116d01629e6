"""torch._grouped_mm for bench_grouped_gemm.py, timed in the same rounds as ours.

torch never enters the JAX process: it runs in a server subprocess (`python -m benchmarks.grouped_gemm_torch
--serve`) that holds one case's operands and times loops on request, one JSON line in, one out. The JAX side
puts each torch label into the case's timing rounds (loop_timing.time_rounds) as a `TorchLoop`,
so torch and ours alternate loop by loop and share every stretch of the GPU's pace. Before this, torch ran
first in a process of its own and its verdicts moved by a few percent from run to run on unchanged kernels
(grouped_gemm_table_pingpong_h200.md: Mixtral EP1 ours/torch 0.96 vs 1.01-1.05 in the run before).
Only one process issues work at a time (each request waits for its reply), so they never share the SMs.
The server also times torch's dense GEMM of the same FLOPs (both sides cuBLAS): next to the JAX process's
dense GEMM of the same problem it says whether the two processes saw the same GPU."""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = "TORCHRPC "   # protocol lines on the server's stdout; anything else it prints is passed through
OPS = ("case", "length", "loop")
MAX_ITERS = 2000       # as the JAX side: a loop lasts >= min_total_s up to this many calls
LABELS = {"fwd": "torch_grouped_mm/fwd", "fwd+bwd": "torch_grouped_mm/fwd+bwd",
          "dense/fwd": "torch_dense_same_flops/fwd", "dense/fwd+bwd": "torch_dense_same_flops/fwd+bwd"}


class TorchGroupedMM:
    """The server's backend: one case's torch callables (grouped forward, forward + backward, and on request
    the same-FLOP dense GEMM), each timed as the JAX side times: calls between two syncs, host clock."""

    def __init__(self):
        import torch
        self.torch, self.shape, self.data, self.fns = torch, None, None, {}

    def env(self):
        t = self.torch
        return dict(torch=t.__version__, torch_cuda=t.version.cuda, torch_device=t.cuda.get_device_name())

    def case(self, M, K, N, G, group_sizes, useful_rows, dense):
        t = self.torch
        if self.shape != (M, K, N, G):   # one set of operands per shape, reused by its routings
            self.data = self.fns = None
            t.cuda.empty_cache()
            t.manual_seed(0)
            self.data = (t.randn(M, K, device="cuda", dtype=t.bfloat16, requires_grad=True),
                         t.randn(G, K, N, device="cuda", dtype=t.bfloat16, requires_grad=True),
                         t.randn(M, N, device="cuda", dtype=t.bfloat16))
            self.shape = (M, K, N, G)
        x, w, dy = self.data
        offs = t.cumsum(t.tensor(group_sizes, device="cuda", dtype=t.int32), 0, dtype=t.int32)
        fns = {"fwd": lambda: t._grouped_mm(x, w, offs=offs),
               # autograd.grad: dx and dw as outputs, no accumulation into .grad (no extra add kernels)
               "fwd+bwd": lambda: t.autograd.grad(t._grouped_mm(x, w, offs=offs), (x, w), dy)}
        if dense:   # [useful, K] @ [K, N], dx and dw by autograd
            xd, wd = x[:useful_rows].detach().requires_grad_(), w[0].detach().requires_grad_()
            fns["dense/fwd"] = lambda: xd @ wd
            fns["dense/fwd+bwd"] = lambda: t.autograd.grad(xd @ wd, (xd, wd), dy[:useful_rows])
        self.fns, errors = {}, {}
        for label, fn in fns.items():   # warm up each (cuBLAS heuristics, allocator); a failure is per label
            try:
                fn()
                t.cuda.synchronize()
                self.fns[label] = fn
            except Exception as e:  # noqa: BLE001
                errors[label] = f"{type(e).__name__}: {str(e)[:300]}"
        return dict(labels=list(self.fns), errors=errors)

    def _loop(self, fn, iters):
        self.torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        self.torch.cuda.synchronize()
        return (time.perf_counter() - t0) / iters

    def length(self, label, min_total_s, min_iters):
        dt = self._loop(self.fns[label], 1)
        return dict(iters=max(min_iters, min(MAX_ITERS, int(min_total_s / max(dt, 1e-5)))))

    def loop(self, label, iters):
        return dict(s=self._loop(self.fns[label], iters))


def serve(backend, stdin=None, stdout=None):
    """The server loop: the backend's env first, then one reply per request until 'quit' or end of input.
    A failing request answers its error and the server goes on."""
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout

    def reply(**kv):
        stdout.write(PREFIX + json.dumps(kv) + "\n")
        stdout.flush()
    reply(ok=True, env=backend.env())
    for line in stdin:
        req = json.loads(line)
        op = req.pop("op")
        if op == "quit":
            reply(ok=True)
            return
        try:
            if op not in OPS:
                raise ValueError(f"unknown op {op!r}; one of {OPS}")
            reply(ok=True, **getattr(backend, op)(**req))
        except Exception as e:  # noqa: BLE001
            reply(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")


class TorchServerError(RuntimeError):
    pass


class TorchServer:
    """The JAX side's handle on the server process. A request that fails raises TorchServerError; one that
    gets no reply within `timeout_s` (or finds the process gone) also ends the server, and every later
    request raises the same reason at once, so a hung torch costs one timeout, not one per case."""

    def __init__(self, timeout_s, argv=None):
        self.timeout_s, self.dead = timeout_s, None
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(argv or [sys.executable, "-m", "benchmarks.grouped_gemm_torch", "--serve"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO, env=env)
        self.replies = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.env = self._reply("start")["env"]

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                self.replies.put(json.loads(line[len(PREFIX):]))
            else:
                print("torch server: " + line.rstrip(), flush=True)
        self.replies.put(None)   # end of output: the process ended

    def _reply(self, what):
        try:
            rep = self.replies.get(timeout=self.timeout_s)
        except queue.Empty:
            self._end(f"torch server: no reply to {what} within {self.timeout_s} s")
        if rep is None:
            self._end(f"torch server ended (rc {self.proc.wait()}) during {what}")
        if not rep["ok"]:
            raise TorchServerError(f"torch server: {what}: {rep['error']}")
        return rep

    def _end(self, reason):
        self.dead = reason
        self.proc.kill()
        raise TorchServerError(reason)

    def request(self, op, **kv):
        if self.dead:
            raise TorchServerError(self.dead)
        try:
            self.proc.stdin.write(json.dumps(dict(op=op, **kv)) + "\n")
            self.proc.stdin.flush()
        except OSError as e:
            self._end(f"torch server: cannot send {op}: {e}")
        return self._reply(op)

    def close(self):
        if not self.dead and self.proc.poll() is None:
            try:
                self.request("quit")
            except TorchServerError:
                pass
        self.proc.kill()
        self.proc.wait()


class TorchLoop:
    """One torch label as a time_rounds variant: its loops run in the server."""

    def __init__(self, server, label):
        self.server, self.label = server, label

    def length(self, min_total_s, min_iters):
        return self.server.request("length", label=self.label, min_total_s=min_total_s, min_iters=min_iters)["iters"]

    def loop(self, iters):
        return self.server.request("loop", label=self.label, iters=iters)["s"]


def torch_variants(server, case, dense, row):
    """The case's torch labels as (row label, TorchLoop, FLOP multiple of one GEMM) for its timing rounds;
    setup failures land in row['errors'] under the row label."""
    try:
        rep = server.request("case", dense=dense, **{k: case[k] for k in ("M", "K", "N", "G", "group_sizes",
                                                                         "useful_rows")})
    except TorchServerError as e:
        row["errors"]["torch_grouped_mm"] = str(e)
        return []
    for label, err in rep["errors"].items():
        row["errors"][LABELS[label]] = err
    return [(LABELS[label], TorchLoop(server, label), 3 if label.endswith("fwd+bwd") else 1)
            for label in rep["labels"]]


if __name__ == "__main__":
    if sys.argv[1:] != ["--serve"]:
        sys.exit("usage: python -m benchmarks.grouped_gemm_torch --serve (started by bench_grouped_gemm.py --torch)")
    serve(TorchGroupedMM())
