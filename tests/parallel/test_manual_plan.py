"""The manual SP/TP x EP/TP plans on 8 simulated devices equal the single-device model: loss and gradients."""
import chex
import jax
import numpy as np
import pytest

from megascale_jax import step
from megascale_jax.config import default_config

SMALL = {"model.hidden": 64, "model.num_heads": 4, "model.num_kv_heads": 2, "model.moe.expert_ffn": 32,
         "model.num_layers": 2, "model.num_dense_layers": 1, "model.dense_ffn": 64,
         "model.moe.num_shared_experts": 1, "train.global_batch": 4, "train.seq_len": 32,
         "train.compute_dtype": "float32", "model.moe.balance_group_size": 1}


def _loss_and_grads(overrides, devices):
    cfg = default_config("tiny_cpu", num_devices=len(devices), **{**SMALL, **overrides})
    trainer = step.build(cfg, devices)
    params = step.create_state(trainer)["params"]
    tokens = jax.random.randint(jax.random.key(7), (cfg.train.global_batch, cfg.train.seq_len + 1), 0, 256)
    sharding = trainer.batch_sharding()
    batch = {"inputs": jax.device_put(tokens[:, :-1], sharding), "targets": jax.device_put(tokens[:, 1:], sharding)}
    fn = step.loss_and_metrics(trainer)
    value_and_grad = jax.jit(jax.value_and_grad(lambda p: fn(p, batch), has_aux=True))
    (loss, metrics), grads = value_and_grad(params)
    return float(loss), jax.device_get(metrics), jax.device_get(grads)


@pytest.fixture(scope="module")
def reference():
    cache = {}

    def get(top_k):
        if top_k not in cache:
            cache[top_k] = _loss_and_grads({"model.moe.top_k": top_k}, jax.devices()[:1])
        return cache[top_k]
    return get


@pytest.mark.parametrize("attention,ffn,dispatch,top_k,data,intra", [
    ("sp", "ep", "all_to_all", 2, 2, 4),   # the paper's plan; kv heads 2 < SP size 4
    ("sp", "ep", "all_gather", 2, 2, 4),
    ("sp", "ep", "all_to_all", 1, 1, 8),   # kv heads 2 < SP size 8, one expert per device
    ("sp", "ep", "all_gather", 8, 4, 2),   # top-k = E
    ("tp", "tp", "all_to_all", 2, 2, 4),   # the Megatron baseline
    ("tp", "ep", "all_to_all", 2, 4, 2),
    ("sp", "tp", "all_to_all", 2, 2, 4),
])
def test_manual_plan_equals_single_device(reference, attention, ffn, dispatch, top_k, data, intra):
    overrides = {}
    if attention == "tp" and intra > 2:
        overrides = {"model.num_kv_heads": 4}   # TP shards kv heads: they must divide by intra
    if intra == 8:
        overrides = {"model.num_heads": 8}      # SP over 8 needs 8 q heads; kv heads stay 2 < 8
    ref_loss, ref_metrics, ref_grads = reference(top_k) if not overrides else \
        _loss_and_grads({"model.moe.top_k": top_k, **overrides}, jax.devices()[:1])
    loss, metrics, grads = _loss_and_grads(
        {"model.moe.top_k": top_k, "parallel.plan": "manual", "parallel.attention": attention,
         "parallel.ffn": ffn, "parallel.ep_dispatch": dispatch, "parallel.intra": intra, **overrides},
        jax.devices())
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for key in ("ce", "aux_loss", "z_loss"):
        assert float(metrics[key]) == pytest.approx(float(ref_metrics[key]), rel=1e-5), key
    np.testing.assert_array_equal(metrics["tokens_per_expert"], ref_metrics["tokens_per_expert"])
    assert int(metrics["dropped_tokens"]) == 0
    chex.assert_trees_all_close(grads, ref_grads, rtol=2e-4, atol=1e-5)


def test_training_with_the_manual_plan_matches_the_xla_plan(tmp_path):
    from megascale_jax.train import run

    common = {**SMALL, "train.steps": 3, "train.warmup_steps": 1, "train.log_every": 1, "train.eval_every": 0,
              "output.tensorboard": False, "train.global_batch": 8}
    xla = run(default_config("tiny_cpu", num_devices=8, **common, **{"output.dir": str(tmp_path / "x")}))
    manual = run(default_config("tiny_cpu", num_devices=8, **common, **{
        "output.dir": str(tmp_path / "m"), "parallel.plan": "manual", "parallel.intra": 4}))
    np.testing.assert_allclose([l["loss"] for l in manual], [l["loss"] for l in xla], rtol=2e-5)


@pytest.mark.gpu
@pytest.mark.skip(reason="on 2 H200s (2026-11-30) XLA segfaulted compiling the single-device bf16 reference "
                  "of this test; un-skip when investigating (the issue notes have the log)")
@pytest.mark.parametrize("attention,ffn", [("sp", "ep"), ("tp", "tp"), ("tp", "ep"), ("sp", "tp")])
def test_gpu_manual_plan_with_the_pallas_kernel_matches_one_device(attention, ffn):
    """On the GPUs present: the manual plan with the Pallas grouped GEMM vs one device with lax.ragged_dot."""
    n = len(jax.devices())
    if n < 2:
        pytest.skip("needs 2 or more GPUs")
    gpu = {"train.compute_dtype": "bfloat16", "model.hidden": 256, "model.num_heads": 4, "model.num_kv_heads": 2,
           "model.moe.expert_ffn": 256, "model.dense_ffn": 256, "train.seq_len": 128}
    _, ref_metrics, ref = _loss_and_grads({**gpu, "kernels.grouped_gemm": "xla"}, jax.devices()[:1])
    _, metrics, got = _loss_and_grads({**gpu, "kernels.grouped_gemm": "pallas", "parallel.plan": "manual",
                                       "parallel.attention": attention, "parallel.ffn": ffn,
                                       "parallel.intra": 2}, jax.devices()[:2])
    assert float(metrics["ce"]) == pytest.approx(float(ref_metrics["ce"]), rel=1e-2)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(ref)):
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        assert np.abs(g - r).max() <= 5e-2 * np.abs(r).max() + 1e-6, jax.tree_util.keystr(path)
