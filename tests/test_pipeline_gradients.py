"""The real MoE Transformer through the pipeline schedules equals the single-device model: loss and grads.

Reference: `jax.value_and_grad` of `loss.objective` on one device with the LocalLayout. With the balance
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

from megascale_jax import train
from megascale_jax.config import default_config
from megascale_jax.model.layout import LocalLayout, layout_for
from megascale_jax.model.loss import objective
from megascale_jax.model.pipelined import bubble_report, pipeline_loss_and_grads
from megascale_jax.parallel.plan import ParallelPlan

SMALL = {"model.hidden": 32, "model.num_heads": 4, "model.num_kv_heads": 2, "model.moe.expert_ffn": 32,
         "model.num_layers": 4, "model.num_dense_layers": 0, "train.global_batch": 8, "train.seq_len": 16,
         "train.compute_dtype": "float32", "model.moe.balance_group_size": 1,
         "model.moe.aux_loss_weight": 0.1, "model.moe.z_loss_weight": 0.01}


def _model(**overrides):
    cfg = default_config("tiny_cpu", num_devices=1, **{**SMALL, **overrides})
    graphdef = nnx.split(nnx.eval_shape(lambda: train._new_model(cfg)))[0]
    params = jax.jit(lambda: nnx.state(train._new_model(cfg)))()   # one compiled init, not many eager ops
    tokens = jax.random.randint(jax.random.key(3), (cfg.train.global_batch, cfg.train.seq_len + 1), 0, 256)
    return cfg, graphdef, params, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


@pytest.fixture(scope="module")
def models():
    # The tied model also remats (selectively): layer_fn then runs under the model's checkpoint policy.
    # "dense": a leading dense layer (DeepSeekMoE-style), which the first stage runs after the embedding.
    return {False: _model(), True: _model(**{"model.tie_embeddings": True, "train.remat": "selective"}),
            "dense": _model(**{"model.num_layers": 5, "model.num_dense_layers": 1, "model.dense_ffn": 32})}


@pytest.fixture(scope="module")
def reference(models):
    """reference(tied, aux_weight, M) -> ((loss, ce), grads): the mean over M microbatches (rows m,
    m+M, ...) of `objective` and its gradient, on one device; cached, several cases share one."""
    cache = {}

    def get(tied, aux_weight, num_microbatches):
        key = (tied, aux_weight, num_microbatches)
        if key not in cache:
            cfg, graphdef, params, batch = models[tied]
            moe_cfg = dataclasses.replace(cfg.model.moe, aux_loss_weight=aux_weight)

            def loss_of(params):
                def one(rows):
                    total, metrics = objective(nnx.merge(graphdef, params), rows, LocalLayout(), moe_cfg)
                    return total, metrics["ce"]
                split = {k: jnp.swapaxes(v.reshape(-1, num_microbatches, v.shape[1]), 0, 1)
                         for k, v in batch.items()}
                totals, ces = jax.lax.map(one, split)   # (ragged_dot has no vmap rule)
                return totals.mean(), ces.mean()
            cache[key] = jax.jit(jax.value_and_grad(loss_of, has_aux=True))(params)
        return cache[key]
    return get


@pytest.mark.parametrize("schedule, data, pipe, intra, microbatches, virtual, tied, aux_weight", [
    ("1f1b", 2, 2, 1, 4, 1, False, 0.0),            # whole-batch objective exactly (no balance loss)
    ("1f1b", 2, 4, 1, 4, 1, True, 0.1),             # one layer per stage, tied embedding, remat
    ("gpipe", 2, 4, 1, 4, 1, False, 0.1),
    ("interleaved", 2, 2, 1, 2, 2, False, 0.1),     # 4 chunks of one layer on 2 stages
    ("1f1b", 2, 2, 2, 2, 1, False, 0.1),            # SP attention + EP experts over intra inside stages
    ("gpipe", 1, 2, 4, 2, 1, False, 0.1),           # ... SP over 4 with 2 kv heads, 2 experts per rank
    ("1f1b", 2, 2, 1, 4, 1, "dense", 0.1),          # a dense first layer on stage 0
    ("1f1b", 1, 2, 2, 2, 1, "dense", 0.1),          # ... with SP+EP inside the stages
])
def test_pipelined_model_equals_single_device(models, reference, schedule, data, pipe, intra,
                                              microbatches, virtual, tied, aux_weight):
    cfg, graphdef, params, batch = models[tied]
    moe_cfg = dataclasses.replace(cfg.model.moe, aux_loss_weight=aux_weight)
    reference_microbatches = 1 if aux_weight == 0.0 else microbatches
    (ref_loss, ref_ce), ref_grads = reference(tied, aux_weight, reference_microbatches)

    plan = ParallelPlan(data, pipe, intra, kind="manual" if intra > 1 else "xla")
    mesh = plan.make_mesh(jax.devices()[:plan.num_devices])
    layout = layout_for(cfg, plan, mesh)
    run = jax.jit(lambda p, b: pipeline_loss_and_grads(
        graphdef, p, b, mesh=mesh, moe_cfg=moe_cfg, layout=layout, schedule=schedule,
        num_microbatches=microbatches, virtual_stages=virtual))
    loss, metrics, grads = run(params, batch)

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


def test_errors_name_the_argument(models):
    cfg, graphdef, params, batch = models[False]
    plan = ParallelPlan(2, 2, 2, kind="xla")
    mesh = plan.make_mesh(jax.devices())

    def call(graphdef=graphdef, params=params, batch=batch, layout=LocalLayout(), mesh=mesh, **kw):
        kw = {"schedule": "1f1b", "num_microbatches": 2, **kw}
        return jax.eval_shape(lambda: pipeline_loss_and_grads(   # trace only: errors come first
            graphdef, params, batch, mesh=mesh, moe_cfg=cfg.model.moe, layout=layout, **kw))

    with pytest.raises(ValueError, match="needs the manual plan"):
        call()
    mesh = ParallelPlan(4, 2, 1).make_mesh(jax.devices())
    with pytest.raises(ValueError, match="num_microbatches=4"):
        call(mesh=mesh, num_microbatches=4)   # 8 rows cannot split into 4 x data=4
    with pytest.raises(ValueError, match="must both be"):
        call(mesh=mesh, batch={"inputs": batch["inputs"], "targets": batch["targets"][:, :-1]})
    with pytest.raises(ValueError, match="schedule='zb' is unknown"):
        call(mesh=mesh, schedule="zb")


def test_bubble_report():
    report = bubble_report("interleaved", 4, 8, 2)
    assert report["bubble_fraction_formula"] == pytest.approx(3 / 19)
    assert report["bubble_fraction_counted"] == pytest.approx(report["bubble_fraction_formula"])
