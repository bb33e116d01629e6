"""The macro layer (parallel/overlap.py) == the autodiff block: outputs, stats and gradients, on 8 simulated
devices, for each dispatch mode, SP / TP / no attention communication, every remat setting and chunk count, and
the Qwen options (q/k/v biases, q/k norms, the shared-expert gate)."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from megascale_jax import step
from megascale_jax.config import ConfigError, default_config
from megascale_jax.model.transformer import Block, Kernels
from megascale_jax.parallel.layouts import make_layout
from megascale_jax.parallel.plan import DATA, INTRA, ParallelPlan

SMALL = {"model.hidden": 64, "model.num_heads": 4, "model.num_kv_heads": 2, "model.moe.expert_ffn": 32,
         "model.moe.num_experts": 8, "model.moe.num_shared_experts": 1, "model.moe.balance_group_size": 1}


def _block_grads(moe_layer, *, attention="sp", dispatch="all_to_all", remat="none", chunks=1, intra=4,
                 dtype=jnp.float32, top_k=2, wire="bf16", capacity_factor=0.0, cfg_overrides=None,
                 kernels=Kernels()):
    """(outputs, stats, grads of params and x) of one MoE block per device on a (data, 1, intra) mesh; the loss
    mixes the output with a fixed cotangent and the aux / z losses so every gradient path is exercised."""
    cfg = default_config("tiny_cpu", num_devices=1, **{**SMALL, "model.moe.top_k": top_k, **(cfg_overrides or {})})
    data = 8 // intra
    plan = ParallelPlan(data, 1, intra, "manual", attention, "ep", dispatch, capacity_factor,
                        dispatch_dtype=wire)
    mesh = plan.make_mesh(jax.devices())
    layout = make_layout(plan, num_heads=cfg.model.num_heads, num_experts=cfg.model.moe.num_experts,
                         moe_layer=moe_layer, remat=remat, overlap_chunks=chunks)
    block = _with_nonzero_extras(Block(cfg.model, True, jnp.float32, kernels, nnx.Rngs(3)))
    graphdef, params = nnx.split(block)
    param_specs = jax.tree.map(lambda s: plan.param_spec(tuple(s)), nnx.get_partition_spec(params),
                               is_leaf=lambda x: isinstance(x, P))
    x_spec = P(DATA, INTRA)
    x = jax.random.normal(jax.random.key(1), (2 * data, 16, cfg.model.hidden), jnp.float32).astype(dtype)
    cot = jax.random.normal(jax.random.key(2), x.shape, jnp.float32).astype(dtype)

    def per_device(params, x, cot):
        y, stats = nnx.merge(graphdef, params)(x, layout)
        loss = jnp.sum((y * cot).astype(jnp.float32)) + 0.3 * stats["aux_loss"] + 0.1 * stats["z_loss"]
        counts = {k: stats[k][None] for k in ("tokens_per_expert", "dropped_tokens")}   # one row per device
        return jax.lax.psum(loss, (DATA, INTRA)), y, {**stats, **counts}

    every = P((DATA, INTRA))
    sharded = jax.shard_map(per_device, mesh=mesh, in_specs=(param_specs, x_spec, x_spec),
                            out_specs=(P(), x_spec, {"aux_loss": P(), "z_loss": P(), "tokens_per_expert": every,
                                                     "dropped_tokens": every}))

    def loss(params, x):
        total, y, stats = sharded(params, x, cot)
        return total, (y, stats)

    params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs,
                                                 is_leaf=lambda x: isinstance(x, P)))
    x = jax.device_put(x, NamedSharding(mesh, x_spec))
    (total, (y, stats)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    return jax.device_get((total, y, stats, grads))


def _with_nonzero_extras(block):
    """Biases start at zero and q/k norm scales at one; move them off, so the forward really reads them."""
    a, key = block.attn, jax.random.key(4)
    extras = [getattr(a, name) for name in ("q_bias_HK", "k_bias_GK", "v_bias_GK") if a.qkv_bias]
    extras += [a.q_norm.scale, a.k_norm.scale] if a.qk_norm else []
    for i, variable in enumerate(extras):
        noise = 0.5 * jax.random.normal(jax.random.fold_in(key, i), variable.shape, jnp.float32)
        variable[...] = (variable[...] + noise).astype(variable.dtype)
    return block


def _assert_close(got, want, rtol):
    total_g, y_g, stats_g, grads_g = got
    total_w, y_w, stats_w, grads_w = want
    np.testing.assert_allclose(float(total_g), float(total_w), rtol=rtol)
    np.testing.assert_allclose(np.asarray(y_g, np.float32), np.asarray(y_w, np.float32), rtol=rtol, atol=rtol)
    np.testing.assert_array_equal(stats_g["tokens_per_expert"], stats_w["tokens_per_expert"])
    np.testing.assert_array_equal(stats_g["dropped_tokens"], stats_w["dropped_tokens"])
    for key in ("aux_loss", "z_loss"):
        np.testing.assert_allclose(float(stats_g[key]), float(stats_w[key]), rtol=rtol)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads_g), jax.tree.leaves(grads_w)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        scale = np.abs(w).max()
        assert scale > 0, jax.tree_util.keystr(path)   # every gradient path carries signal
        assert np.abs(g - w).max() <= rtol * scale, (jax.tree_util.keystr(path), np.abs(g - w).max() / scale)


@pytest.mark.parametrize("attention,dispatch,remat,chunks,intra", [
    ("sp", "all_to_all", "none", 1, 4),
    ("sp", "all_to_all", "selective", 2, 4),
    ("sp", "all_to_all", "full", 1, 4),
    ("sp", "all_gather", "none", 2, 4),
    ("sp", "all_gather", "selective", 1, 4),
    ("sp", "all_gather", "full", 2, 4),
    ("tp", "all_to_all", "selective", 2, 2),   # TP attention: heads sharded, all-gather / reduce-scatter
    ("sp", "all_to_all", "selective", 4, 1),   # one device per domain: the local sort, no collective
])
def test_macro_block_equals_autodiff_block(attention, dispatch, remat, chunks, intra):
    kwargs = dict(attention=attention, dispatch=dispatch, intra=intra)
    want = _autodiff(**kwargs)
    got = _block_grads("macro", remat=remat, chunks=chunks, **kwargs)
    _assert_close(got, want, rtol=2e-5)


def _autodiff(attention="sp", dispatch="all_to_all", intra=4):
    return _cached_autodiff(attention, dispatch, intra)


@functools.cache
def _cached_autodiff(attention, dispatch, intra):
    """The autodiff block's results, once per process for each setting: the references repeat across cases
    (SP all_to_all at intra 4 serves three remat / chunk cases and the fp8 test's bf16 wire, all_gather three)."""
    return _block_grads("autodiff", attention=attention, dispatch=dispatch, intra=intra)


QWEN = {"model.qkv_bias": True, "model.qk_norm": True, "model.moe.shared_expert_gate": True}   # SMALL: 1 shared


@functools.cache
def _qwen_autodiff():
    return _block_grads("autodiff", cfg_overrides=QWEN)   # once for the three remat settings


@pytest.mark.parametrize("remat,chunks", [("none", 1), ("selective", 2), ("full", 1)])
def test_macro_block_with_biases_qk_norm_and_shared_gate_equals_autodiff(remat, chunks):
    """Qwen2-MoE's q/k/v biases and sigmoid shared-expert gate, Qwen3-MoE's q/k norms, at once (SP, intra 4,
    all_to_all): the extra weights are in the gradients, nonzero (_assert_close) and equal."""
    want = _qwen_autodiff()
    got = _block_grads("macro", remat=remat, chunks=chunks, cfg_overrides=QWEN)
    names = {jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(got[3][0])}
    for extra in ("q_bias_HK", "k_bias_GK", "v_bias_GK", "q_norm", "k_norm", "shared_gate_D1"):
        assert any(extra in name for name in names), (extra, names)
    _assert_close(got, want, rtol=2e-5)


@pytest.mark.parametrize("moe_layer,remat,chunks", [("macro", "none", 1), ("macro", "selective", 2),
                                                    ("autodiff", "none", 1)])
def test_swiglu_kernel_backward_in_both_moe_layers_equals_autodiff(monkeypatch, moe_layer, remat, chunks):
    """kernels.swiglu='separate_pallas_bwd' reaches the experts' and the shared experts' activation in the macro layer
    (MoEBlockMath) and in the autodiff layer: every call of the kernel is counted and the outputs and gradients
    equal autodiff's. The kernel is stood in for by its formula in float32 (the Pallas interpreter's gathers do not
    type-check inside a checked shard_map; the kernel itself is compared with autodiff in
    tests/kernels/test_swiglu_backward.py, and lowered inside the step's shard_map for CUDA there)."""
    from pallas_kernels import swiglu_backward as kernel

    calls = []

    def formula(gate, up, dh, **_):
        calls.append(gate.shape)
        g, u, d = (a.astype(jnp.float32) for a in (gate, up, dh))
        s = jax.nn.sigmoid(g)
        return (d * u * s * (1 + g * (1 - s))).astype(gate.dtype), (d * g * s).astype(up.dtype)
    monkeypatch.setattr(kernel, "swiglu_backward", formula)
    got = _block_grads(moe_layer, remat=remat, chunks=chunks, kernels=Kernels(swiglu="separate_pallas_bwd",
                                                                          dense_swiglu="separate_pallas_bwd"))
    assert len(calls) == chunks + 1, calls   # the experts' activation (per chunk) and the shared experts'
    _assert_close(got, _autodiff(), rtol=2e-5)


def test_macro_block_in_bf16_matches_within_bf16_rounding():
    """bf16 activations: the macro layer rounds in other places (weights applied after the down GEMM's
    dgrad, fp32 sums over k), so the two agree to bf16 precision, not bitwise."""
    want = _block_grads("autodiff", dtype=jnp.bfloat16)
    got = _block_grads("macro", dtype=jnp.bfloat16, remat="selective", chunks=2)
    _assert_close(got, want, rtol=3e-2)


def test_macro_block_with_capacity_drops_what_autodiff_drops():
    kwargs = dict(capacity_factor=0.5, top_k=2)
    want = _block_grads("autodiff", **kwargs)
    assert int(np.sum(want[2]["dropped_tokens"])) > 0   # the capacity really binds
    _assert_close(_block_grads("macro", remat="selective", **kwargs), want, rtol=2e-5)


def test_macro_block_with_fp8_dispatch_stays_within_fp8_error_of_autodiff_fp8():
    """fp8 on the wire both ways (per-token forward, per-channel groups backward): the macro layer quantizes
    unweighted dy rows where autodiff quantizes weighted ones, so they agree to E4M3 precision; both are
    within the same distance of the bf16 wire."""
    bf16 = _autodiff()
    autodiff_fp8 = _block_grads("autodiff", wire="fp8")
    macro_fp8 = _block_grads("macro", wire="fp8", remat="selective", chunks=2)
    _assert_close(macro_fp8, autodiff_fp8, rtol=0.1)
    _assert_close(macro_fp8, bf16, rtol=0.1)


def _config(**overrides):
    base = {**SMALL, "parallel.plan": "manual", "parallel.intra": 4, "parallel.moe_layer": "macro"}
    return default_config("tiny_cpu", num_devices=8, **{**base, **overrides})


@pytest.mark.parametrize("overrides,key", [
    ({"parallel.ffn": "tp"}, "parallel.ffn"),
    ({"parallel.plan": "xla"}, "parallel.plan"),
    ({"model.moe.capacity_factor": 1.0, "parallel.overlap_chunks": 2}, "overlap_chunks"),
    ({"parallel.overlap_chunks": 3}, "overlap_chunks"),
    ({"parallel.moe_layer": "autodiff", "parallel.overlap_chunks": 2}, "overlap_chunks"),
])
def test_unsupported_macro_settings_are_config_errors_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key):
        _config(**overrides)


def test_macro_layer_accepts_the_qwen_families():
    """The published Qwen configs build with the macro layer (they were ConfigErrors): Qwen2-MoE with q/k/v
    biases and the gated shared expert, Qwen3-MoE with q/k norms."""
    macro = {"parallel.moe_layer": "macro", "parallel.plan": "manual"}
    qwen2 = default_config("qwen2_moe_a2_7b", num_devices=8, **macro)
    qwen3 = default_config("qwen3_30b_a3b", num_devices=8, **macro)
    assert qwen2.parallel.moe_layer == qwen3.parallel.moe_layer == "macro"
    assert qwen2.model.qkv_bias and qwen2.model.moe.shared_expert_gate and qwen3.model.qk_norm


def test_macro_model_trains_like_the_autodiff_model():
    """The whole model (a dense layer, two scanned MoE blocks, SP + EP over 4 of 8 devices): loss, metrics
    and every gradient equal; the scanned stack skips jax.checkpoint and the macro layer rematerialises."""
    def loss_and_grads(moe_layer):
        cfg = _config(**{"parallel.moe_layer": moe_layer, "train.remat": "selective", "model.num_layers": 3,
                         "model.num_dense_layers": 1, "model.dense_ffn": 64, "train.global_batch": 4,
                         "train.seq_len": 32, "train.compute_dtype": "float32"})
        trainer = step.build(cfg)
        params = step.create_state(trainer)["params"]
        tokens = jax.random.randint(jax.random.key(7), (4, 33), 0, 256)
        sharding = trainer.batch_sharding()
        batch = {"inputs": jax.device_put(tokens[:, :-1], sharding),
                 "targets": jax.device_put(tokens[:, 1:], sharding)}
        fn = step.loss_and_metrics(trainer)
        return jax.device_get(jax.jit(jax.value_and_grad(lambda p: fn(p, batch), has_aux=True))(params))

    (loss_a, metrics_a), grads_a = loss_and_grads("autodiff")
    (loss_m, metrics_m), grads_m = loss_and_grads("macro")
    assert float(loss_m) == pytest.approx(float(loss_a), rel=1e-6)
    np.testing.assert_array_equal(metrics_m["tokens_per_expert"], metrics_a["tokens_per_expert"])
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads_m), jax.tree.leaves(grads_a)):
        g, w = np.asarray(g), np.asarray(w)
        assert np.abs(g - w).max() <= 2e-5 * np.abs(w).max(), jax.tree_util.keystr(path)


def test_macro_layer_inside_pipeline_stages_trains_like_autodiff(tmp_path):
    """Two pipeline stages with SP + EP inside (the pipeline calls the same scan_body): 3 training steps."""
    from megascale_jax import train

    def losses(moe_layer):
        cfg = default_config("tiny_cpu", num_devices=8, **{
            "train.steps": 3, "train.warmup_steps": 1, "train.log_every": 1, "train.eval_every": 0,
            "output.tensorboard": False, "train.global_batch": 8, "train.seq_len": 32, "model.num_layers": 4,
            "parallel.pipe": 2, "train.microbatches": 2, "parallel.plan": "manual", "parallel.intra": 2,
            "parallel.moe_layer": moe_layer, "train.remat": "selective", "output.dir": str(tmp_path / moe_layer)})
        return [record["loss"] for record in train.run(cfg)]

    np.testing.assert_allclose(losses("macro"), losses("autodiff"), rtol=1e-5)
