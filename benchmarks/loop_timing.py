"""Timing a jitted call on the GPU without a sync per call: a loop of calls between two host syncs, the median of
several loops after an untimed one (`time_call`), and several variants of one problem timed round by round
(`time_rounds`, which also takes another process's loops: grouped_gemm_torch.TorchLoop). Used by every
benchmark that compares kernels in one run."""
import statistics
import time

import jax

# bench_grouped_gemm.main lowers these under --interpret (the interpreter is slow): a timing is then a compile,
# a loop-length probe, one untimed and one timed call
TIMING = dict(min_total_s=0.15, loops=6, min_iters=2)   # an even number of loops: see time_rounds
MAX_ITERS = 2000   # a loop lasts >= min_total_s up to this many calls (a 0.2 ms call: 750 per loop)


def _settings(min_total_s, loops, min_iters):
    return (TIMING["min_total_s"] if min_total_s is None else min_total_s,
            TIMING["loops"] if loops is None else loops, TIMING["min_iters"] if min_iters is None else min_iters)


def _loop_length(fn, args, min_total_s, min_iters):
    """Calls per loop so that a loop lasts >= min_total_s (compiles fn first); also returns the output."""
    out = fn(*args)
    jax.block_until_ready(out)  # compile
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return max(min_iters, min(MAX_ITERS, int(min_total_s / max(time.perf_counter() - t0, 1e-5)))), out


def _loop(fn, args, iters):
    """Seconds per call of one loop of `iters` calls between two syncs, and the last output."""
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters, out


def time_call(fn, *args, min_total_s=None, loops=None, min_iters=None):
    """Median seconds per call over `loops` loops of calls between two syncs, each loop >= min_total_s, after
    one untimed loop of the same length. The untimed loop matters for short calls: timed right after a
    compile (the GPU idle), identical tiles timed first read up to 8% below the second timing of the same case
    (grouped_gemm_table_h200.json of 2026-12-02 before this rule, 10 ms loops of at most 50 calls)."""
    min_total_s, loops, min_iters = _settings(min_total_s, loops, min_iters)
    iters, out = _loop_length(fn, args, min_total_s, min_iters)
    _loop(fn, args, iters)   # warms up, not kept
    times = []
    for _ in range(loops):
        t, out = _loop(fn, args, iters)
        times.append(t)
    return statistics.median(times), out


class LocalLoop:
    """A jitted call and its arguments as a time_rounds variant (the other kind: grouped_gemm_torch.TorchLoop,
    whose loops run in the torch server)."""

    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def length(self, min_total_s, min_iters):
        return _loop_length(self.fn, self.args, min_total_s, min_iters)[0]

    def loop(self, iters):
        return _loop(self.fn, self.args, iters)[0]


def time_rounds(variants, min_total_s=None, loops=None, min_iters=None, errors=None, per_loop=None,
                loop_iters=None):
    """Several variants of one problem timed round by round: {label: median seconds per call}.

    `variants` is [(label, fn, args)], each already compiled, or [(label, runner, None)] with a runner's
    `length` / `loop` (TorchLoop). Every round runs one loop (>= min_total_s) of each variant in turn, after one
    untimed round, so a drift of the GPU's pace (clocks, temperature, an idle host-side pause before a variant)
    falls on all of them alike. Timed one after another instead, the same tiles read 2.7-5% apart depending on
    their place in the order (grouped_gemm_table_h200.json, 2026-12-02). Odd rounds run the variants in reverse
    order, so over an even number of rounds each variant is as often first as last: with torch's loops in the
    rounds (another process's CUDA context), the same kernel twice in one set of rounds, always first and
    always later in the order, read up to 7% apart (2026-12-04). With an `errors` dict a variant that raises is
    left out of the later rounds, its error stored there and its label missing from the result; without one
    the exception propagates. A `per_loop` dict receives every timed loop's seconds per call, in round order,
    and a `loop_iters` dict each variant's calls per loop (from its own one-call probe: a probe taken while
    the GPU idles after compiles sets a shorter loop; kept so that a gap between readings of one kernel can be
    checked against it)."""
    min_total_s, loops, min_iters = _settings(min_total_s, loops, min_iters)
    runners = {label: fn if args is None else LocalLoop(fn, args) for label, fn, args in variants}
    times, iters = {label: [] for label in runners}, {}

    def attempt(label, call):
        if errors is None:
            return call()
        try:
            return call()
        except Exception as e:  # noqa: BLE001
            errors[label] = f"{type(e).__name__}: {str(e)[:300]}"
            runners.pop(label)
            times.pop(label)
            return None
    for label, runner in list(runners.items()):
        iters[label] = attempt(label, lambda: runner.length(min_total_s, min_iters))
    for r in range(loops + 1):   # round 0 warms up and is not kept
        order = list(runners.items())
        for label, runner in order[::-1] if r % 2 else order:
            t = attempt(label, lambda: runner.loop(iters[label]))
            if r and t is not None:
                times[label].append(t)
    if per_loop is not None:
        per_loop.update(times)
    if loop_iters is not None:
        loop_iters.update({label: iters[label] for label in times})
    return {label: statistics.median(v) for label, v in times.items()}
