"""The real MoE Transformer through the pipeline schedules (megascale_jax/gradients.py's `pipeline` source, run
per device in the step's shard_map) equals the single-device model: loss and grads.

Reference: `jax.value_and_grad` of `Transformer.loss` on one device with the local layout. With the balance
loss weighted the reference is the mean of `objective` over the same microbatches (rows m, m+M, ...),
because the balance loss is not linear in the tokens; with aux_loss_weight = 0 it is `objective` on
the whole batch (CE and z-loss are token means, so microbatching does not change them).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax import lax
from jax.sharding import PartitionSpec as P

from megascale_jax import step
from megascale_jax.config import ConfigError, default_config
from megascale_jax.parallel.layouts import local_layout
from megascale_jax.parallel.pipeline_schedules import schedule_summary
from megascale_jax.parallel.plan import DATA

SMALL = {"model.hidden": 32, "model.num_heads": 4, "model.num_kv_heads": 2, "model.moe.expert_ffn": 32,
         "model.num_layers": 4, "model.num_dense_layers": 0, "train.global_batch": 8, "train.seq_len": 16,
         "train.compute_dtype": "float32", "model.moe.balance_group_size": 1,
         "model.moe.aux_loss_weight": 0.1, "model.moe.z_loss_weight": 0.01}


def _model(**overrides):
    cfg = default_config("tiny_cpu", num_devices=1, **{**SMALL, **overrides})
    graphdef = nnx.split(nnx.eval_shape(lambda: step.new_model(cfg)))[0]
    params = jax.jit(lambda: nnx.state(step.new_model(cfg)))()   # one compiled init, not many eager ops
    tokens = jax.random.randint(jax.random.key(3), (cfg.train.global_batch, cfg.train.seq_len + 1), 0, 256)
    return cfg, graphdef, params, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


# The tied model also remats (selectively): layer_fn then runs under the model's checkpoint policy.
# "dense": a leading dense layer (DeepSeekMoE-style), which the first stage runs after the embedding.
MODELS = {False: {}, True: {"model.tie_embeddings": True, "train.remat": "selective"},
          "dense": {"model.num_layers": 5, "model.num_dense_layers": 1, "model.dense_ffn": 32}}


class _Lazy(dict):
    """Each model built (one compiled init) on first use: an xdist worker builds only those its cases need."""

    def __missing__(self, key):
        self[key] = _model(**MODELS[key])
        return self[key]


@pytest.fixture(scope="module")
def models():
    return _Lazy()


@pytest.fixture(scope="module")
def reference(models):
    """reference(tied, aux_weight, M) -> ((loss, ce), grads): the mean over M microbatches (rows m,
    m+M, ...) of `Transformer.loss` and its gradient, on one device; cached, several cases share one."""
    cache = {}

    def get(tied, aux_weight, num_microbatches):
        key = (tied, aux_weight, num_microbatches)
        if key not in cache:
            cfg, graphdef, params, batch = models[tied]
            graphdef = _with_aux_weight(cfg, aux_weight)

            def loss_of(params):
                def one(rows):
                    layout = local_layout(cfg.model.moe.num_experts)
                    total, metrics = nnx.merge(graphdef, params).loss(rows, layout)
                    return total, metrics["ce"]
                split = {k: jnp.swapaxes(v.reshape(-1, num_microbatches, v.shape[1]), 0, 1)
                         for k, v in batch.items()}
                totals, ces = jax.lax.map(one, split)   # (ragged_dot has no vmap rule)
                return totals.mean(), ces.mean()
            cache[key] = jax.jit(jax.value_and_grad(loss_of, has_aux=True))(params)
        return cache[key]
    return get


@pytest.mark.parametrize("schedule, data, pipe, intra, microbatches, virtual, tied, aux_weight", [
    ("1f1b", 2, 4, 1, 4, 1, True, 0.1),             # one layer per stage, tied embedding, remat
    ("gpipe", 2, 4, 1, 4, 1, False, 0.1),
    ("interleaved", 2, 2, 1, 2, 2, False, 0.1),     # 4 chunks of one layer on 2 stages
    ("1f1b", 2, 2, 2, 2, 1, False, 0.1),            # SP attention + EP experts over intra inside stages
    ("gpipe", 1, 2, 4, 2, 1, False, 0.1),           # ... SP over 4 with 2 kv heads, 2 experts per rank
    # A dense first layer on stage 0; no balance loss: the whole-batch objective exactly (one reference for both).
    ("1f1b", 2, 2, 1, 4, 1, "dense", 0.0),
    ("1f1b", 1, 2, 2, 2, 1, "dense", 0.0),          # ... with SP+EP inside the stages
])
def test_pipelined_model_equals_single_device(models, reference, schedule, data, pipe, intra,
                                              microbatches, virtual, tied, aux_weight):
    cfg, graphdef, params, batch = models[tied]
    reference_microbatches = 1 if aux_weight == 0.0 else microbatches
    (ref_loss, ref_ce), ref_grads = reference(tied, aux_weight, reference_microbatches)

    loss, metrics, grads = _pipelined(cfg, aux_weight, params, batch, **{
        "parallel.data": data, "parallel.pipe": pipe, "parallel.intra": intra,
        "parallel.plan": "manual" if intra > 1 else "xla", "parallel.pipeline_schedule": schedule,
        "train.microbatches": microbatches, "parallel.virtual_stages": virtual})

    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6)
    assert float(metrics["ce"]) == pytest.approx(float(ref_ce), rel=1e-6)
    assert float(metrics["moe_loss"]) == pytest.approx(float(ref_loss - ref_ce), rel=1e-5)
    assert float(metrics["moe_loss"]) > 0   # the MoE terms really flow through layer_fn's aux
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        name = jax.tree_util.keystr(path)
        assert got.shape == want.shape and got.dtype == jnp.float32, name
        scale = float(jnp.max(jnp.abs(want)))
        assert scale > 1e-6, name   # a zero gradient would pass trivially
        # fp32 sums in another order (per microbatch, per stage, per data rank): entries that are
        # small sums of cancelling terms get an absolute error of ~1e-5 of the leaf's largest entry.
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=5e-5 * scale,
                                   err_msg=name)


def test_balance_loss_is_per_microbatch(reference):
    """Why the weighted cases use the per-microbatch reference: the balance loss of the whole batch
    differs from the mean over microbatches, while CE does not."""
    (whole, whole_ce), _ = reference(False, 0.1, 1)
    (split, split_ce), _ = reference(False, 0.1, 4)
    assert float(whole_ce) == pytest.approx(float(split_ce), rel=1e-6)
    assert abs(float(whole) - float(split)) > 1e-6


def _with_aux_weight(cfg, aux_weight):
    moe = dataclasses.replace(cfg.model.moe, aux_loss_weight=aux_weight)
    model_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe=moe))
    return nnx.split(nnx.eval_shape(lambda: step.new_model(model_cfg)))[0]


def _pipelined(cfg, aux_weight, params, batch, **parallel):
    """(loss, metrics, grads) of the pipeline gradient source on 8 simulated devices, its per-device gradients
    averaged over 'data' (what every updater does first)."""
    overrides = {"train.global_batch": cfg.train.global_batch, "train.seq_len": cfg.train.seq_len,
                 "model.moe.aux_loss_weight": aux_weight, **parallel}
    overrides.update({f"model.{f}": getattr(cfg.model, f) for f in ("hidden", "num_heads", "num_kv_heads",
                      "num_layers", "num_dense_layers", "dense_ffn", "tie_embeddings")})
    overrides.update({"model.moe.expert_ffn": cfg.model.moe.expert_ffn, "train.remat": cfg.train.remat,
                      "train.compute_dtype": cfg.train.compute_dtype, "model.moe.balance_group_size": 1,
                      "model.moe.z_loss_weight": cfg.model.moe.z_loss_weight})
    devices = parallel["parallel.data"] * parallel["parallel.pipe"] * parallel["parallel.intra"]
    trainer = step.build(default_config("tiny_cpu", num_devices=devices, **overrides), jax.devices()[:devices])
    source = step.gradient_source(trainer)

    def body(p, b):
        loss, metrics, grads = source(p, b)
        return loss, metrics, jax.tree.map(lambda g: lax.pmean(g, DATA), grads)

    specs = trainer.param_specs
    run = jax.jit(jax.shard_map(body, mesh=trainer.mesh, in_specs=(specs, trainer.plan.batch_spec()),
                                out_specs=(P(), P(), specs)))
    params = jax.device_put(params, trainer.state_shardings["params"])
    batch = jax.device_put(batch, trainer.batch_sharding())
    return run(params, batch)


@pytest.mark.parametrize("overrides,needle", [
    ({"parallel.data": 2, "parallel.pipe": 2, "parallel.intra": 2, "parallel.plan": "xla"}, "needs config.parallel.plan='manual'"),
    ({"parallel.data": 4, "parallel.pipe": 2, "train.microbatches": 4}, "train.microbatches x data = 4 x 4"),
    ({"parallel.pipe": 2, "parallel.pipeline_schedule": "zb"}, "pipeline_schedule='zb'"),
])
def test_errors_name_the_argument(overrides, needle):
    """Bad pipeline arguments are config errors before anything is traced."""
    with pytest.raises(ConfigError, match=needle):
        default_config("tiny_cpu", num_devices=8, **{**SMALL, **overrides})


def test_bubble_report():
    report = schedule_summary("interleaved", 4, 8, 2)
    assert report["bubble_fraction_formula"] == pytest.approx(3 / 19)
    assert report["bubble_fraction_counted"] == pytest.approx(report["bubble_fraction_formula"])
