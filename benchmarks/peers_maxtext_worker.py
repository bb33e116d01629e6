"""bench_peers's MaxText block (`maxtext_block`): MaxText's own Mixtral decoder layer (maxtext.models.mixtral.
MixtralDecoderLayer: RMSNorm, GQA attention with RoPE, RMSNorm, RoutedMoE top-2 of 8), configured by MaxText's pyconfig
over its base.yml with model_name=mixtral-8x7b, built on a 1-device mesh, bf16 weights and activations, timed fwd+bwd
as peers_jax_worker.build_ours times ours: jit(grad(mean(y.float32 ** 2))) w.r.t. params and x, no remat.

Kernels (MaxText 0.2.5, read from src/maxtext/layers/{attention_op,moe}.py):
- attention: on a GPU `cudnn_flash_jax`, MaxText's cuDNN flash path through JAX's own cuDNN SDPA
  (jax._src.cudnn.fused_attention_stablehlo, causal, BTNH); `cudnn_flash_te` (its base GPU config) needs
  transformer-engine, which the image lacks. On a CPU `dot_product` (MaxText's plain einsum attention).
- MoE, dropless: sparse_matmul=True, megablox=False, use_tokamax_gmm=False (moe="ragged_dot", the default): the
  path of MaxText's own configs/gpu/models/mixtral_8x7b.yml (megablox: false; sparse_matmul is on by default and
  then capacity_factor is unused), i.e. sort by expert + jax.lax.ragged_dot for wi_0 / wi_1 / wo. moe="tokamax"
  sets use_tokamax_gmm=True, the dropless choice MaxText's docs/explanations/moe_configuration.md recommends
  (tokamax.ragged_dot, implementation="mosaic"); it cannot run on a CPU, so only "ragged_dot" was checked there.
  Dropless is checked twice: by the config (sparse path, no expert parallelism, no ragged buffer cap) and at run
  time by MaxText's own `moe_has_overflow` flag, sown by RoutedMoE.

Run it in its own process (it registers stub modules, below): bench_peers.py's `--worker maxtext` (`maxtext_worker`),
or alone, `python benchmarks/peers_maxtext_worker.py --results R.jsonl [--tiny] [--tokens T.npy]`, with MaxText's
wheels (benchmarks/get_maxtext_wheels.sh) installed on PYTHONPATH; bench_peers.py installs them for its worker."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import tempfile
import time
import traceback
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:   # run as a script: the sibling modules import as benchmarks.*
    sys.path.insert(0, REPO)
from benchmarks.peers_plan import FULL, MAXTEXT_MOE, TINY, Shapes  # noqa: E402
from benchmarks.peers_worker_contract import emit, load_tokens, make_tokens, time_loop  # noqa: E402


def _stub_absent_modules() -> list[str]:
    """Empty modules for imports MaxText (or tokamax) makes at import time for features this layer never runs, each
    package stubbed only where it is absent. None of them is on the layer's compute path."""
    done = []

    def stub(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules[name] = m
        done.append(name)
        return m

    def absent(name):
        return name not in sys.modules and importlib.util.find_spec(name) is None

    class _NoSuchType:   # for isinstance checks against a stubbed class: never true
        pass

    if absent("xprof"):   # tokamax's own benchmarking helpers (kernel stats from a profile); long dependency chain
        stub("xprof"), stub("xprof.cli"), stub("xprof.cli.tools", get_kernel_stats_tool=None)
    if absent("pathwaysutils"):   # maxtext.utils.elastic_utils: Pathways (TPU multi-slice) elastic training; its
        # import pulls fastapi / uvicorn / requests. num_slices=1 is set below, so elastic_utils is never asked.
        stub("pathwaysutils", is_pathways_backend_used=lambda: False)
        stub("pathwaysutils.elastic"), stub("pathwaysutils.elastic.elastic")
        stub("pathwaysutils.elastic.manager", Manager=_NoSuchType)
    if absent("grain"):   # maxtext.common.grain_utility: checkpointing of grain data-loader iterators (compiled
        # package with array_record / portpicker behind it); no data loader here
        g = stub("grain", DatasetIterator=_NoSuchType)
        g.python = stub("grain.python", PyGrainCheckpointHandler=_NoSuchType)
        g.experimental = stub("grain.experimental", ElasticIterator=_NoSuchType)
    if absent("PIL"):   # maxtext.multimodal.utils: image loading for multimodal models (pillow is a 7 MB wheel)
        stub("PIL"), stub("PIL.Image")
    # maxtext.common.checkpointing imports MaxText's HF safetensors checkpoint loader, which imports transformers +
    # huggingface_hub (and builds HF config objects at import); no checkpoint is loaded here, so it is always stubbed
    stub("maxtext.checkpoint_conversion.utils.load_dynamic", load_safetensors_dynamic_state=None)
    return done


def maxtext_config(shapes: Shapes, tiny: bool, on_gpu: bool, attention: str, moe: str):
    """MaxText's config: base.yml + models/mixtral-8x7b.yml (+ the TINY dimensions), one layer's worth of overrides."""
    from maxtext.configs import pyconfig
    over = dict(
        model_name="mixtral-8x7b", run_name="peers_maxtext_block", hardware="gpu" if on_gpu else "cpu",
        base_output_directory=os.path.join(tempfile.gettempdir(), "maxtext_output"), enable_checkpointing=False,
        dataset_type="synthetic", skip_jax_distributed_system=True,   # one process, one device: no coordinator
        num_slices=1, per_device_batch_size=shapes.batch, max_target_length=shapes.seq,
        dtype="bfloat16", weight_dtype="bfloat16",                    # base.yml stores weights in float32
        attention=attention, scan_layers=False,
        sparse_matmul=True, megablox=False, use_tokamax_gmm=(moe == "tokamax"), capacity_factor=-1.0)
    if tiny:   # mixtral-8x7b.yml sets these; overriding them needs override_model_config
        over.update(override_model_config=True, base_emb_dim=shapes.hidden, base_num_query_heads=shapes.heads,
                    base_num_kv_heads=shapes.kv_heads, head_dim=shapes.head_dim, base_mlp_dim=shapes.ffn,
                    base_moe_mlp_dim=shapes.ffn, num_experts=shapes.experts, num_experts_per_tok=shapes.top_k)
    cfg = pyconfig.initialize([""], **over)
    got = (cfg.emb_dim, cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim, cfg.num_experts,
           cfg.num_experts_per_tok, float(cfg.rope_max_timescale), float(cfg.normalization_layer_epsilon))
    want = (shapes.hidden, shapes.heads, shapes.kv_heads, shapes.head_dim, shapes.ffn, shapes.experts, shapes.top_k,
            shapes.rope_theta, shapes.norm_eps)
    assert got == want, (got, want)
    # dropless by construction: the sparse (sorted, ragged) path, no expert parallelism (so no all-to-all buffer)
    # and no ragged-buffer cap; capacity_factor is read only by the dense path, and is off (-1) anyway
    dropless = bool(cfg.sparse_matmul and cfg.ragged_buffer_factor <= 0 and cfg.ici_expert_parallelism in (1, -1)
                    and cfg.capacity_factor <= 0 and not cfg.use_random_routing)
    return cfg, dropless


def build_maxtext(shapes: Shapes, tiny: bool, attention: str | None = None, moe: str = "ragged_dot"):
    """MaxText's Mixtral layer on a 1-device mesh; returns (grad, fwd_check, params, info). grad as build_ours's."""
    stubs = _stub_absent_modules()
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from flax.core.spmd import logical_axis_rules

    import maxtext
    from maxtext.models import mixtral
    from maxtext.utils import maxtext_utils

    on_gpu = jax.default_backend() == "gpu"
    attention = attention or ("cudnn_flash_jax" if on_gpu else "dot_product")
    cfg, dropless = maxtext_config(shapes, tiny, on_gpu, attention, moe)
    mesh = maxtext_utils.get_mesh_from_config(cfg, jax.devices()[:1])
    B, S = shapes.batch, shapes.seq
    seg = jnp.ones((B, S), jnp.int32)                                    # one packed segment per row: plain causal
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))

    @contextlib.contextmanager
    def ctx():   # MaxText's train step runs its model under its mesh and its logical-axis rules
        with jax.set_mesh(mesh), logical_axis_rules(cfg.logical_axis_rules):
            yield

    with ctx():
        layer = mixtral.MixtralDecoderLayer(cfg, mesh, "train", rngs=nnx.Rngs(0))
    gd, params, rest = nnx.split(layer, nnx.Param, ...)

    def apply(p, x):
        m = nnx.merge(gd, p, rest)
        y, _ = m(x, seg, pos, True, "train")   # inputs, segment ids, positions, deterministic, model_mode
        return y, m

    def loss(p, x):
        return jnp.mean(apply(p, x)[0].astype(jnp.float32) ** 2)

    def fwd_check(p, x):
        """y, MaxText's own overflow flags (sown by RoutedMoE), and the router's top-k counts: the layer's sublayers
        re-run up to the gate, as MixtralDecoderLayer.__call__ runs them."""
        y, m = apply(p, x)
        flags = [leaf for path, v in nnx.to_flat_state(nnx.state(m, nnx.Intermediate)) if "moe_has_overflow" in path
                 for leaf in jax.tree.leaves(v)]
        lnx = m.pre_self_attention_layer_norm(x)
        a, _ = m.self_attention(lnx, lnx, pos, decoder_segment_ids=seg, deterministic=True, model_mode="train")
        logits, _ = m.MoeBlock_0.gate(m.post_self_attention_layer_norm(x + a))
        idx = jax.lax.top_k(logits, shapes.top_k)[1]
        return y, flags, jnp.bincount(idx.reshape(-1), length=shapes.experts)

    x0 = jax.ShapeDtypeStruct((B, S, shapes.hidden), jnp.bfloat16)
    with ctx():   # traced and compiled under MaxText's mesh and logical-axis rules
        grad = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x0).compile()
        check = jax.jit(fwd_check).lower(params, x0).compile()
    moe_path = {"ragged_dot": "sparse_matmul: sort by expert + jax.lax.ragged_dot (megablox off, tokamax off)",
                "tokamax": "sparse_matmul: sort by expert + tokamax.ragged_dot(implementation='mosaic')"}[moe]
    info = dict(maxtext_version=getattr(maxtext, "__version__", None) or _dist_version("maxtext"),
                attention=attention, moe=moe, moe_path=moe_path, dropless_config=dropless, stubs=stubs,
                config={k: getattr(cfg, k) for k in (
                    "sparse_matmul", "megablox", "use_tokamax_gmm", "capacity_factor", "ragged_buffer_factor",
                    "dtype", "weight_dtype", "float32_qk_product", "float32_logits", "load_balance_loss_weight")})
    info["config"] = {k: str(v) if not isinstance(v, (bool, int, float, str)) else v for k, v in info["config"].items()}
    return grad, check, params, info


def _dist_version(name):
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def run(shapes: Shapes, tiny: bool, tokens_path: str, results_path: str, budget_s: float = 600.0, n: int = 20,
        reps: int = 5, name: str = "maxtext_block", attention: str | None = None, moe: str = "ragged_dot"):
    """Build, check (finite output, nonzero grads, no dropped tokens), time with time_loop, emit one record."""
    t_start = time.perf_counter()
    try:
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        import jax
        import jax.numpy as jnp
        import numpy as np

        from benchmarks.environment import environment   # imports jax: here, not at the module's import
        x = jnp.asarray(load_tokens(tokens_path, shapes), jnp.bfloat16)
        grad, check, params, info = build_maxtext(shapes, tiny, attention, moe)
        compile_s = time.perf_counter() - t_start
        y, flags, counts = check(params, x)
        out_finite = bool(np.isfinite(np.asarray(y, np.float32)).all())
        dropped = True if not flags else bool(any(np.asarray(f).any() for f in flags))   # no flag: not verified
        counts = np.asarray(counts).tolist()
        g, gx = grad(params, x)
        gsum = [float(jnp.sum(jnp.abs(a.astype(jnp.float32)))) for a in jax.tree.leaves((g, gx))]
        grads_finite, grads_nonzero = all(np.isfinite(gsum)), all(s > 0 for s in gsum)
        if not (out_finite and grads_finite and grads_nonzero and info["dropless_config"]) or dropped:
            raise RuntimeError(f"check failed: output finite {out_finite}, grads finite {grads_finite}, nonzero "
                               f"{grads_nonzero}, dropless config {info['dropless_config']}, tokens dropped {dropped} "
                               f"({len(flags)} flags)")
        state = {}

        def run_n(k):
            for _ in range(k):
                state["out"] = grad(params, x)

        def sync():
            jax.block_until_ready(state.get("out"))

        t0 = time.perf_counter()
        run_n(2)   # warm-up; its time bounds the loop count by what is left of the budget
        sync()
        per_call = (time.perf_counter() - t0) / 2
        left = budget_s - (time.perf_counter() - t_start)
        n = max(1, min(n, int(left / max(per_call, 1e-6) / (reps + 1))))
        ms, per = time_loop(run_n, sync, n, reps)
        imb = max(counts) / (sum(counts) / len(counts))
        emit(results_path, name, ok=True, ms=ms, per_loop_ms=per, n=n, reps=reps, compile_s=compile_s,
             wall_s=time.perf_counter() - t_start, output_finite=out_finite, grads_finite=grads_finite,
             grads_nonzero=grads_nonzero, tokens_dropped=dropped, overflow_flags=len(flags),
             dropless=not dropped and info["dropless_config"],
             tokens_per_expert=counts, max_over_mean_load=imb, kernels=dict(attention=info["attention"], moe=moe),
             env=environment(), **info,
             extra=f"MaxText {info['maxtext_version']} {info['attention']} + {moe}, dropless, load max/mean {imb:.2f}")
    except Exception as e:  # noqa: BLE001 - the failure is the record
        emit(results_path, name, ok=False, error=f"{type(e).__name__}: {str(e)[:1500]}",
             traceback=traceback.format_exc()[-4000:], wall_s=time.perf_counter() - t_start)


def maxtext_worker(args, shapes: Shapes, names: list[str]):
    """bench_peers.py's `--worker maxtext`: each maxtext_* variant in turn (MAXTEXT_MOE names its MoE path), sharing
    the worker's budget; the orchestrator has put MaxText's site directory on PYTHONPATH."""
    n, reps = (args.iters, args.reps) if not args.tiny else (2, 2)
    deadline = time.monotonic() + args.worker_budget_s
    for i, name in enumerate(names):
        left = deadline - time.monotonic()
        if left < 30 and not args.tiny:
            emit(args.results, name, ok=False, skipped=f"worker budget exhausted ({left:.0f} s left)", error="budget")
            continue
        run(shapes, args.tiny, args.tokens, args.results, left / (len(names) - i), n, reps, name,
            moe=MAXTEXT_MOE[name])


if __name__ == "__main__":
    import argparse
    p = argparse.ArgumentParser(description="MaxText's Mixtral layer fwd+bwd, one JSON line appended to --results")
    p.add_argument("--results", required=True)
    p.add_argument("--tokens", default="", help="peers token file (default: made here, numpy seed 0)")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=600.0)
    p.add_argument("--name", default="maxtext_block")
    p.add_argument("--attention", default=None, help="MaxText attention kernel (default: cudnn_flash_jax on GPU)")
    p.add_argument("--moe", default="ragged_dot", choices=("ragged_dot", "tokamax"))
    a = p.parse_args()
    sh = TINY if a.tiny else FULL
    tokens = a.tokens or os.path.join(tempfile.mkdtemp(prefix="peers_maxtext_"), "tokens.npy")
    if not a.tokens:
        make_tokens(tokens, sh)
    run(sh, a.tiny, tokens, a.results, a.budget_s, a.iters, a.reps, a.name, a.attention, a.moe)
