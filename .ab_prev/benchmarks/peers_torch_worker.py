"""bench_peers.py's torch worker (`--worker torch`): the torch dense GEMM and torchtitan's MoE block (one and two
layers, torch.compile as torchtitan applies it), timed fwd+bwd and appended to the results file. torch is
imported only inside the functions: it never shares a process with JAX."""
from __future__ import annotations

import sys
import time
import traceback

from benchmarks.peers_plan import Shapes
from benchmarks.peers_worker_contract import emit, time_loop

_TT_STUB_PREFIXES = ("datasets", "torchdata", "torchft", "tyro", "tokenizers")


def _install_stubs(prefixes, notes):
    """Last resort when a torchtitan import dependency that only its data / config / fault-tolerance code
    uses is missing: empty stand-in modules (never called by the benchmark), recorded in the notes."""
    import importlib.abc
    import importlib.machinery
    import types

    class _Stub(types.ModuleType):
        def __getattr__(self, attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return type(attr, (), {"__init__": lambda self, *a, **k: None,
                                   "__call__": lambda self, *a, **k: None})

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, fullname, path=None, target=None):
            if fullname.split(".")[0] in prefixes:
                return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
            return None

        def create_module(self, spec):
            m = _Stub(spec.name)
            m.__path__ = []
            return m

        def exec_module(self, module):
            pass

    sys.meta_path.insert(0, Finder())
    notes.append(f"torch worker: stand-in modules for {sorted(prefixes)} (missing; used only by torchtitan's "
                 "data / config / fault-tolerance code, not by the block)")


def _import_torchtitan(notes):
    import importlib
    missing = set()
    for _ in range(len(_TT_STUB_PREFIXES) + 1):
        try:
            from torchtitan.models.moe import MoEArgs
            from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
            from torchtitan.models.qwen3.model.model import TransformerBlock, precompute_rope_cache
            return MoEArgs, Qwen3ModelArgs, TransformerBlock, precompute_rope_cache
        except ModuleNotFoundError as e:
            top = (e.name or "").split(".")[0]
            if top not in _TT_STUB_PREFIXES or top in missing:
                raise
            missing.add(top)
            for k in [k for k in sys.modules if k.split(".")[0] in ("torchtitan", top)]:
                del sys.modules[k]
            _install_stubs({top}, notes)
            importlib.invalidate_caches()
    raise RuntimeError("torchtitan import did not settle")


def _apply_torchtitan_compile(model, notes):
    """torch.compile as torchtitan does it (apply_compile in models/llama4/infra/parallelize.py, which the
    qwen3 parallelize uses): per-TransformerBlock, MoE submodules other than the experts compiled fullgraph,
    the grouped-mm experts function compiled. Falls back to the same logic inline if that import fails."""
    import torch
    try:
        from torchtitan.config.job_config import Compile
        from torchtitan.models.llama4.infra.parallelize import apply_compile
        apply_compile(model, Compile(enable=True, components=["model", "loss"], backend="inductor"), False)
        return "torchtitan.models.llama4.infra.parallelize.apply_compile"
    except Exception as e:  # noqa: BLE001
        notes.append(f"torchtitan apply_compile unavailable ({type(e).__name__}: {str(e)[:300]}); "
                     "applied the same per-block compile inline")
    from torchtitan.models.moe import moe as moe_module
    torch._dynamo.config.capture_scalar_outputs = True
    for _, block in model.layers.named_children():
        for attr, sub in block.named_children():
            if isinstance(sub, moe_module.MoE):
                for a2, s2 in sub.named_children():
                    if a2 != "experts":
                        setattr(sub, a2, torch.compile(s2, backend="inductor", fullgraph=True))
            else:
                setattr(block, attr, torch.compile(sub, backend="inductor", fullgraph=True))
    moe_module._run_experts_grouped_mm = torch.compile(moe_module._run_experts_grouped_mm, backend="inductor",
                                                       fullgraph=True)
    return "inline copy of torchtitan apply_compile"


def torch_worker(args, shapes: Shapes, names: list[str]):
    notes = []
    t_start = time.perf_counter()
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        for name in names:
            emit(args.results, name, ok=False, error=f"torch import failed: {e!r}")
        return
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
           "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if dev == "cuda" else None}
    try:
        import triton
        env["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        pass
    try:
        from importlib.metadata import version
        env["torchtitan"] = version("torchtitan")
    except Exception as e:  # noqa: BLE001
        env["torchtitan"] = f"? ({e!r})"
    emit(args.results, "_env_torch", ok=False, env=env, error="(environment record)")
    n, reps = (args.iters, args.reps) if not args.tiny else (2, 2)

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    def bench(fn, n, reps, warmup=3):
        for _ in range(warmup):
            fn()
        sync()
        return time_loop(lambda k: [fn() for _ in range(k)], sync, n, reps)

    if "torch_dense_gemm" in names:
        try:
            nn_ = 8192 if not args.tiny else 256
            a = torch.randn(nn_, nn_, device=dev, dtype=torch.bfloat16)
            ms, per = bench(lambda: a @ a, n=max(n, 20) if not args.tiny else 2, reps=reps)
            emit(args.results, "torch_dense_gemm", ok=True, ms=ms, per_loop_ms=per, n=nn_,
                 extra=f"{2 * nn_ ** 3 / ms / 1e9:.0f} TFLOP/s")
            del a
        except Exception as e:  # noqa: BLE001
            emit(args.results, "torch_dense_gemm", ok=False, error=f"{type(e).__name__}: {e}"[:1500])

    tt_names = [nm for nm in names if nm.startswith("torchtitan")]
    if not tt_names:
        return
    try:
        import numpy as np
        MoEArgs, Qwen3ModelArgs, TransformerBlock, precompute_rope_cache = _import_torchtitan(notes)
        if dev == "cpu":
            _cpu_patches(notes)
        layers = 2 if "torchtitan_2layer" in tt_names else 1
        margs = Qwen3ModelArgs(
            dim=shapes.hidden, n_layers=layers, n_heads=shapes.heads, n_kv_heads=shapes.kv_heads,
            head_dim=shapes.head_dim, hidden_dim=shapes.ffn, norm_eps=shapes.norm_eps, rope_theta=shapes.rope_theta,
            qk_norm=False, max_seq_len=shapes.seq, depth_init=True, attn_type="sdpa", attn_mask_type="causal",
            moe_enabled=True, moe_inter_dim=shapes.ffn,
            moe_args=MoEArgs(num_experts=shapes.experts, num_shared_experts=0, score_func="softmax",
                             route_norm=True, route_scale=1.0, score_before_experts=False, top_k=shapes.top_k,
                             use_grouped_mm=True, load_balance_coeff=None))

        class Stack(torch.nn.Module):
            """The layers of torchtitan's Qwen3Model (its decoder block with MoE), no embedding / head."""

            def __init__(self):
                super().__init__()
                self.layers = torch.nn.ModuleDict({str(i): TransformerBlock(i, margs) for i in range(layers)})

            def forward(self, x, rope, num_layers):
                for i in range(num_layers):
                    x = self.layers[str(i)](x, rope, None)
                return x

        torch.manual_seed(0)
        with torch.device(dev), torch.no_grad():      # torchtitan's trainer initialises under no_grad
            model = Stack()
            for blk in model.layers.values():
                blk.init_weights(buffer_device=torch.device(dev))
        model = model.to(torch.bfloat16)
        rope = precompute_rope_cache(shapes.head_dim, shapes.seq, shapes.rope_theta).to(dev)
        compiled_by = _apply_torchtitan_compile(model, notes) if not args.no_compile else "eager"
        x = torch.from_numpy(np.load(args.tokens)).to(dev, torch.bfloat16).requires_grad_(True)
        emit(args.results, "_torch_build", ok=False, error="(build record)", compiled_by=compiled_by,
             build_s=time.perf_counter() - t_start)
    except Exception as e:  # noqa: BLE001
        for name in tt_names:
            emit(args.results, name, ok=False, error=f"build: {type(e).__name__}: {str(e)[:1500]}",
                 traceback=traceback.format_exc()[-4000:], notes=notes)
        return

    for name in tt_names:
        t0 = time.perf_counter()
        try:
            num_layers = 1 if name == "torchtitan_block" else 2
            params = [p for i in range(num_layers) for p in model.layers[str(i)].parameters()]

            def step():
                y = model(x, rope, num_layers)
                loss = (y.float() ** 2).mean()
                return torch.autograd.grad(loss, params + [x])

            for blk in model.layers.values():
                blk.moe.tokens_per_expert.zero_()
            g = step()                                   # compiles
            sync()
            compile_s = time.perf_counter() - t0
            counts = [blk.moe.tokens_per_expert.float().cpu().tolist() for blk in
                      list(model.layers.values())[:num_layers]]
            finite = bool(torch.isfinite(g[-1].float().sum()).item())
            del g
            ms, per = bench(step, n=n, reps=reps, warmup=2)
            imb = [max(c) / (sum(c) / len(c)) for c in counts]
            emit(args.results, name, ok=True, ms=ms, per_loop_ms=per, compiled_by=compiled_by,
                 tokens_per_expert=counts, max_over_mean_load=imb, grads_finite=finite, compile_s=compile_s,
                 param_dtype="bfloat16", notes=notes, wall_s=time.perf_counter() - t0,
                 peak_mem_gib=(torch.cuda.max_memory_allocated() / 2 ** 30) if dev == "cuda" else None,
                 extra=f"load max/mean {max(imb):.2f}")
        except Exception as e:  # noqa: BLE001
            emit(args.results, name, ok=False, error=f"{type(e).__name__}: {str(e)[:1500]}",
                 traceback=traceback.format_exc()[-4000:], notes=notes, wall_s=time.perf_counter() - t0)


def _cpu_patches(notes):
    """CPU-only (the --tiny smoke test): torchtitan's token-padding kernel is Triton (GPU); use its own CPU
    path, and histc over integer ids, which CUDA supports, as float."""
    import torch
    from torchtitan.models.moe import kernels, utils
    orig = kernels.generate_permute_indices

    def gpi(*a, **k):
        k["use_cpu"] = True
        return orig(*a, **k)
    utils.generate_permute_indices = gpi
    orig_histc = torch.histc

    def histc(x, *a, **k):
        if x.is_floating_point():
            return orig_histc(x, *a, **k)
        return orig_histc(x.float(), *a, **k).to(x.dtype)   # CUDA's histc keeps integer dtypes
    torch.histc = histc
    notes.append("CPU smoke test: torchtitan's CPU permute-indices path and float histc")
