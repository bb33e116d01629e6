"""bench_peers.py's JAX workers (`--worker jax-core | jax-extra`): the same-run dense GEMM, this project's Block
(one and two layers) and the stock-JAX block variants, each timed fwd+bwd and appended to the results file; a
worker's block variants are built first and then timed round by round.
JAX is imported only inside the functions, so the orchestrator can import this module without it; the repo
root is already on sys.path here (this module is imported as benchmarks.peers_jax_worker)."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import time
import traceback

from benchmarks.peers_plan import Shapes
from benchmarks.peers_worker_contract import emit, load_tokens

def _jax_setup(tiny: bool):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    return jax


# bench_peers variants of ours_block by kernels.swiglu
SWIGLU_VARIANTS = {"ours_block_separate_swiglu": "separate", "ours_block_fused_swiglu": "fused",
                   "ours_block_kernel_bwd_swiglu": "separate_pallas_bwd"}


def build_ours(shapes: Shapes, tiny: bool, layers: int, swiglu: str = "auto"):
    """This project's Block(s) and a jitted grad of a scalar of y w.r.t. params and x; `swiglu` the
    kernels.swiglu choice, resolved as the model's build resolves it (no remat here)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from megascale_jax.config import default_config
    from megascale_jax.model.moe.experts import resolve_dense_swiglu, resolve_swiglu
    from megascale_jax.model.transformer import Block, Kernels
    from megascale_jax.parallel.layouts import local_layout

    over = {"model.num_layers": 1}
    if tiny:
        over.update({"model.hidden": shapes.hidden, "model.num_heads": shapes.heads,
                     "model.num_kv_heads": shapes.kv_heads, "model.moe.expert_ffn": shapes.ffn,
                     "model.dense_ffn": shapes.ffn, "model.moe.num_experts": shapes.experts,
                     "model.moe.top_k": shapes.top_k})
    cfg = default_config("mixtral_small", **over)
    m = cfg.model
    assert (m.hidden, m.num_heads, m.num_kv_heads, m.moe.expert_ffn, m.moe.num_experts, m.moe.top_k) == (
        shapes.hidden, shapes.heads, shapes.kv_heads, shapes.ffn, shapes.experts, shapes.top_k), m
    on_gpu = jax.default_backend() == "gpu"
    gemm = "pallas" if on_gpu else "xla"
    why = dict(backend=jax.default_backend(), partitioned_by_xla=False, grouped_gemm=gemm, ffn=shapes.ffn,
               remat="none", macro_layer=False)
    kernels = Kernels(attention="cudnn" if on_gpu else "xla", grouped_gemm=gemm, swiglu=resolve_swiglu(swiglu, **why),
                      dense_swiglu=resolve_dense_swiglu(swiglu, **why))
    layout = local_layout(num_experts=m.moe.num_experts)
    blocks = [Block(m, moe=True, param_dtype=jnp.bfloat16, kernels=kernels, rngs=nnx.Rngs(i))
              for i in range(layers)]
    splits = [nnx.split(b, nnx.Param, ...) for b in blocks]
    graphdefs = [s[0] for s in splits]
    params = [s[1] for s in splits]
    rests = [s[2] for s in splits]

    def loss(params, x):
        y = x
        counts = []
        for gd, p, r in zip(graphdefs, params, rests):
            y, stats = nnx.merge(gd, p, r)(y, layout)
            counts.append(stats["tokens_per_expert"])
        return jnp.mean(y.astype(jnp.float32) ** 2), counts

    grad = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))
    return grad, params, kernels


def stock_fns(shapes: Shapes, attn_impl: str):
    """The stock-JAX block variants, copied from this project's ../shared/bench/stock_block.py (that file runs
    its benchmark at import) and parametrised by `shapes`: ragged / capacity / bound experts."""
    import jax
    import jax.numpy as jnp

    T, H, NQ, NKV, D, F, E, K = (shapes.tokens, shapes.hidden, shapes.heads, shapes.kv_heads, shapes.head_dim,
                                 shapes.ffn, shapes.experts, shapes.top_k)
    B, S = shapes.batch, shapes.seq
    DT = jnp.bfloat16

    def rms(x):
        xf = x.astype(jnp.float32)
        return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6)).astype(DT)

    def init():
        ks = jax.random.split(jax.random.key(0), 8)
        s = 0.02
        return dict(
            wq=jax.random.normal(ks[0], (H, NQ * D), DT) * s, wk=jax.random.normal(ks[1], (H, NKV * D), DT) * s,
            wv=jax.random.normal(ks[2], (H, NKV * D), DT) * s, wo=jax.random.normal(ks[3], (NQ * D, H), DT) * s,
            wr=jax.random.normal(ks[4], (H, E), jnp.float32) * s,
            wg=jax.random.normal(ks[5], (E, H, F), DT) * s, wu=jax.random.normal(ks[6], (E, H, F), DT) * s,
            wd=jax.random.normal(ks[7], (E, F, H), DT) * s)

    def attention(p, x):
        h = rms(x)
        q = (h @ p["wq"]).reshape(B, S, NQ, D)
        k = (h @ p["wk"]).reshape(B, S, NKV, D)
        v = (h @ p["wv"]).reshape(B, S, NKV, D)
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=attn_impl)
        return x + o.reshape(T, NQ * D) @ p["wo"]

    def route(p, h):
        probs = jax.nn.softmax(h.astype(jnp.float32) @ p["wr"], -1)
        w, idx = jax.lax.top_k(probs, K)
        return (w / w.sum(-1, keepdims=True)).astype(DT), idx

    def experts_ragged(p, h, w, idx):
        flat = idx.reshape(-1)
        order = jnp.argsort(flat)
        xs = h[order // K]
        gs = jnp.bincount(flat, length=E).astype(jnp.int32)
        a = jax.nn.silu(jax.lax.ragged_dot(xs, p["wg"], gs)) * jax.lax.ragged_dot(xs, p["wu"], gs)
        o = jax.lax.ragged_dot(a, p["wd"], gs)
        out = jnp.zeros_like(o).at[order].set(o).reshape(T, K, H)
        return (out * w[..., None]).sum(1)

    def experts_capacity(p, h, w, idx):
        c = T * K // E
        onehot = jax.nn.one_hot(idx, E, dtype=jnp.int32)  # T,K,E
        pos = jnp.cumsum(onehot.reshape(T * K, E), 0).reshape(T, K, E) * onehot - 1
        keep = (pos < c) & (pos >= 0)
        disp = (jax.nn.one_hot(jnp.where(keep, pos, -1), c, dtype=DT) * keep[..., None]).sum(1)  # T,E,C
        comb = (jax.nn.one_hot(jnp.where(keep, pos, -1), c, dtype=DT) * (keep * w[..., None])[..., None]).sum(1)
        xe = jnp.einsum("tec,th->ech", disp, h)
        a = jax.nn.silu(jnp.einsum("ech,ehf->ecf", xe, p["wg"])) * jnp.einsum("ech,ehf->ecf", xe, p["wu"])
        o = jnp.einsum("ecf,efh->ech", a, p["wd"])
        return jnp.einsum("tec,ech->th", comb, o)

    def experts_bound(p, h, w, idx):
        xe = jnp.tile(h, (K, 1)).reshape(E, T * K // E, H)
        a = jax.nn.silu(jnp.einsum("ech,ehf->ecf", xe, p["wg"])) * jnp.einsum("ech,ehf->ecf", xe, p["wu"])
        o = jnp.einsum("ecf,efh->ech", a, p["wd"]).reshape(K, T, H)
        return (o * jnp.moveaxis(w, 1, 0)[..., None]).sum(0)

    def block(p, x, experts):
        x = attention(p, x)
        h = rms(x)
        w, idx = route(p, h)
        return x + experts(p, h, w, idx)

    experts = {"ragged": experts_ragged, "capacity": experts_capacity, "bound": experts_bound}

    def grad_fn(kind):
        ex = experts[kind]
        return jax.jit(jax.grad(lambda p, x: jnp.mean(block(p, x, ex).astype(jnp.float32) ** 2), argnums=(0, 1)))
    return init, grad_fn


@contextlib.contextmanager
def _row_tiles(align):
    """Within the block, the grouped GEMM's default tunings with `row_tiles=align` (None: unchanged). The model
    takes the kernel's defaults (it has no tuning knob), so the A/B variant swaps the two default functions
    the kernel module calls, for the trace only."""
    if align is None:
        yield
        return
    import pallas_kernels.grouped_gemm as gg
    saved = gg.default_tuning, gg.default_kernel_tuning
    gg.default_tuning = lambda *a: dataclasses.replace(saved[0](*a), row_tiles=align)
    gg.default_kernel_tuning = lambda *a: dataclasses.replace(saved[1](*a), row_tiles=align)
    try:
        yield
    finally:
        gg.default_tuning, gg.default_kernel_tuning = saved


def _jax_rounds(jax, variants, n, reps, warmup=2):
    """{name: per-loop ms} for [(name, f, args)], each loop n calls between two syncs, the variants in turn in
    every round (after warm-up calls and one untimed round), so a drift of the GPU's pace falls on all alike:
    ours vs the bound is the goal's ratio, and timed one after another it carried the drift between them."""
    for _, f, args_ in variants:
        out = None
        for _ in range(warmup):
            out = f(*args_)
        jax.block_until_ready(out)
    per = {name: [] for name, _, _ in variants}
    for r in range(reps + 1):   # round 0 is not kept
        for name, f, args_ in variants:
            t0 = time.perf_counter()
            out = None
            for _ in range(n):
                out = f(*args_)
            jax.block_until_ready(out)
            if r:
                per[name].append((time.perf_counter() - t0) / n * 1e3)
    return per


def jax_worker(args, shapes: Shapes, names: list[str]):
    jax = _jax_setup(args.tiny)
    import jax.numpy as jnp
    import numpy as np

    env = jax_environment()
    emit(args.results, "_env_jax", ok=False, env=env, error="(environment record)")
    on_gpu = jax.default_backend() == "gpu"
    n, reps = (args.iters, args.reps) if not args.tiny else (2, 2)
    x_np = load_tokens(args.tokens, shapes)
    deadline = time.monotonic() + args.worker_budget_s
    rounds = []   # block variants, built and checked below, then timed round by round (_time_blocks)

    for name in names:
        left = deadline - time.monotonic()
        if left < 15 and not args.tiny:
            emit(args.results, name, ok=False, skipped=f"worker budget exhausted ({left:.0f} s left)",
                 error="budget")
            continue
        t_start = time.perf_counter()
        try:
            if name == "jax_dense_gemm":
                nn_ = 8192 if not args.tiny else 256
                a = jax.random.normal(jax.random.key(1), (nn_, nn_), jnp.bfloat16)
                f = jax.jit(lambda a: a @ a)
                per = _jax_rounds(jax, [(name, f, (a,))], n=max(n, 20) if not args.tiny else 2, reps=reps)[name]
                ms = statistics.median(per)
                emit(args.results, name, ok=True, ms=ms, per_loop_ms=per, n=nn_,
                     extra=f"{2 * nn_ ** 3 / ms / 1e9:.0f} TFLOP/s", wall_s=time.perf_counter() - t_start)
            elif name in ("ours_block", "ours_2layer", "ours_block_grid_tiles", *SWIGLU_VARIANTS):
                layers = 2 if name == "ours_2layer" else 1
                swiglu = SWIGLU_VARIANTS.get(name, "auto")   # ours_block: the default, as the trainer resolves it
                with _row_tiles("grid" if name == "ours_block_grid_tiles" else None):
                    grad, params, kernels = build_ours(shapes, args.tiny, layers, swiglu)
                    x = jnp.asarray(x_np, jnp.bfloat16)
                    # compiled under the tiles asked for; the Compiled object cannot retrace outside the context
                    compiled = grad.lower(params, x).compile()
                (g, gx), counts = compiled(params, x)
                counts = [np.asarray(c).tolist() for c in counts]
                finite = bool(np.isfinite(np.asarray(jnp.sum(gx.astype(jnp.float32)))))
                imb = [max(c) / (sum(c) / len(c)) for c in counts]
                del g, gx
                rounds.append((name, compiled, (params, x), t_start, dict(
                    kernels=dataclasses.asdict(kernels), tokens_per_expert=counts, max_over_mean_load=imb,
                    grads_finite=finite, compile_s=time.perf_counter() - t_start,
                    extra=f"load max/mean {max(imb):.2f}")))
            elif name.startswith("stock_"):
                kind = name.split("_", 1)[1]
                init, grad_fn = stock_fns(shapes, "cudnn" if on_gpu else "xla")
                p = init()
                x = jnp.asarray(x_np.reshape(shapes.tokens, shapes.hidden), jnp.bfloat16)
                f = grad_fn(kind)
                jax.block_until_ready(f(p, x))   # compiled (and any error raised) here, not in the rounds
                rounds.append((name, f, (p, x), t_start,
                               dict(extra="drops tokens" if kind == "capacity" else "")))
            else:
                emit(args.results, name, ok=False, error=f"unknown jax variant {name}")
        except Exception as e:  # noqa: BLE001 - one variant's failure must not stop the others
            emit(args.results, name, ok=False, error=f"{type(e).__name__}: {str(e)[:1500]}",
                 traceback=traceback.format_exc()[-4000:], wall_s=time.perf_counter() - t_start)
    _time_blocks(jax, args, rounds, n, reps)


def _time_blocks(jax, args, rounds, n, reps):
    """The block variants built by jax_worker, timed round by round (`_jax_rounds`) and emitted."""
    if not rounds:
        return
    t0 = time.perf_counter()
    try:
        per = _jax_rounds(jax, [(name, f, a) for name, f, a, _, _ in rounds], n, reps)
    except Exception as e:  # noqa: BLE001
        for name, *_ in rounds:
            emit(args.results, name, ok=False, error=f"timing rounds: {type(e).__name__}: {str(e)[:1500]}",
                 traceback=traceback.format_exc()[-4000:])
        return
    rounds_s = time.perf_counter() - t0
    for name, _, _, t_start, fields in rounds:
        emit(args.results, name, ok=True, ms=statistics.median(per[name]), per_loop_ms=per[name],
             timed_with=[r[0] for r in rounds], rounds_s=rounds_s, wall_s=time.perf_counter() - t_start, **fields)


def jax_environment() -> dict:
    try:
        from benchmarks.environment import environment
        return environment()
    except Exception as e:  # noqa: BLE001
        return {"error": repr(e)}
