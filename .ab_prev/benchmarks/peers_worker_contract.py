"""What bench_peers.py's workers share with the orchestrator and with each other: the input tokens file (the same
activations for every framework), the JSON-lines file each result is appended to as soon as it is measured
(so a crash loses only the variant that was running), and the timed loop every framework is measured by."""
from __future__ import annotations

import json
import os
import statistics
import time

from benchmarks.peers_plan import Shapes

def read_jsonl(path: str) -> dict:
    out = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    out[rec["name"]] = rec
    return out


def emit(path: str, name: str, **rec):
    rec = {"name": name, **rec}
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")
    if name.startswith("_"):
        print(f"[{name}] recorded", flush=True)
    elif rec.get("ok"):
        print(f"[{name}] {rec['ms']:.3f} ms {rec.get('extra', '')}", flush=True)
    else:
        print(f"[{name}] FAILED: {rec.get('error', '')[:400]}", flush=True)


def time_loop(run_n, sync, n: int, reps: int) -> tuple[float, list]:
    """Median over `reps` loops of `n` calls between two syncs; ms per call."""
    per = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        run_n(n)
        sync()
        per.append((time.perf_counter() - t0) / n * 1e3)
    return statistics.median(per), per


def load_tokens(path: str, shapes: Shapes):
    import numpy as np
    x = np.load(path)
    assert x.shape == (shapes.batch, shapes.seq, shapes.hidden), x.shape
    return x


def make_tokens(path: str, shapes: Shapes):
    """The same input activations for every framework: float32 N(0, 1), seed 0, [B, S, D]."""
    import numpy as np
    x = np.random.default_rng(0).standard_normal((shapes.batch, shapes.seq, shapes.hidden), dtype=np.float32)
    np.save(path, x)
