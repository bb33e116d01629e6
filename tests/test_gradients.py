"""Gradient accumulation (megascale_jax/gradients.py `accumulate`) equals the whole batch in one step: loss,
gradients and the update, under the XLA plan and under manual SP+EP on 8 simulated devices.

The balance loss is a product of two token means, computed per microbatch (as in every pipeline), so it is
switched off here; CE and the z-loss are token means and accumulate exactly.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from megascale_jax import gradients, step
from megascale_jax.config import default_config
from megascale_jax.parallel.plan import DATA

COMMON = {"model.hidden": 32, "model.num_heads": 4, "model.num_kv_heads": 2, "model.moe.expert_ffn": 32,
          "model.num_layers": 2, "model.moe.num_shared_experts": 1, "train.global_batch": 32, "train.seq_len": 16,
          "train.compute_dtype": "float32", "model.moe.aux_loss_weight": 0.0, "model.moe.z_loss_weight": 0.01,
          "train.warmup_steps": 0, "train.grad_clip": 0.0}
PLANS = {"xla": {}, "sp+ep": {"plan_recipe": "megascale", "parallel.intra": 4}}


def _batch(trainer):
    t = trainer.cfg.train
    tokens = jax.random.randint(jax.random.key(5), (t.global_batch, t.seq_len + 1), 0, 256)
    return jax.device_put({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, trainer.batch_sharding())


def _loss_and_grads(trainer, state, batch):
    """The configured gradient source; per device its gradients averaged over 'data' (the updaters' first step)."""
    source = step.gradient_source(trainer)
    if not trainer.plan.per_device:
        return jax.jit(source)(step.source_params(state), batch)

    def body(params, batch):
        loss, metrics, grads = source(params, batch)
        # in float32, as the updaters reduce (GEMM weights' gradients come in bf16 from their compute copies)
        return loss, metrics, jax.tree.map(lambda g: lax.pmean(g.astype(np.float32), DATA), grads)

    specs = trainer.param_specs
    return jax.jit(jax.shard_map(body, mesh=trainer.mesh, in_specs=(specs, trainer.plan.batch_spec()),
                                 out_specs=(P(), P(), specs)))(step.source_params(state), batch)


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_four_microbatches_equal_the_whole_batch(plan):
    results = {}
    for microbatches in (1, 4):
        cfg = default_config("tiny_cpu", num_devices=8, **{**COMMON, **PLANS[plan], "train.microbatches": microbatches})
        trainer = step.build(cfg)
        state, batch = step.create_state(trainer), _batch(trainer)
        loss, metrics, grads = _loss_and_grads(trainer, state, batch)
        before = jax.device_get(state["params"])   # the step donates the state
        new_state, step_metrics = step.make_train_step(trainer)(state, batch)
        results[microbatches] = (float(loss), jax.device_get(metrics), jax.device_get(grads),
                                 jax.device_get(new_state["params"]), jax.device_get(step_metrics), before)
    (loss1, m1, g1, p1, s1, before), (loss4, m4, g4, p4, s4, _) = results[1], results[4]
    assert loss4 == pytest.approx(loss1, rel=1e-6)
    assert float(m4["ce"]) == pytest.approx(float(m1["ce"]), rel=1e-6)
    assert float(m4["z_loss"]) == pytest.approx(float(m1["z_loss"]), rel=1e-6)
    # Counts add up over microbatches: every one of the 32 x 16 x top-2 assignments once.
    np.testing.assert_array_equal(m4["tokens_per_expert"], m1["tokens_per_expert"])
    assert int(np.sum(m1["tokens_per_expert"])) == 32 * 16 * 2 * cfg.model.num_layers
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(g4), jax.tree.leaves(g1)):
        scale = float(np.abs(want).max())
        assert scale > 1e-6, jax.tree_util.keystr(path)   # a zero gradient would pass trivially
        # fp32 sums in another order: entries that are small sums of cancelling terms differ by ~1e-6 of the max.
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))
    assert float(s4["grad_norm"]) == pytest.approx(float(s1["grad_norm"]), rel=1e-5)
    moved = 0
    lr = cfg.train.learning_rate
    for got, want, before in zip(jax.tree.leaves(p4), jax.tree.leaves(p1), jax.tree.leaves(before)):
        # Adam's first step is lr * g / (|g| + eps): where g is ~0 it swings with the gradient's last bits
        # (the gradients matched above), so: all but 0.1% of the elements within 1% of lr, none beyond 2 lr.
        diff = np.abs(np.asarray(got) - np.asarray(want))
        assert np.mean(diff <= 1e-5 * np.abs(want) + 1e-2 * lr) >= 0.999 and diff.max() <= 2 * lr
        moved += int(np.any(np.asarray(want) != np.asarray(before)))
    assert moved > 0   # the update really changed the parameters


EXPERT_WEIGHTS = ("w_gate_EDF", "w_up_EDF", "w_down_EFD")


@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize("plan", sorted(PLANS))
def test_gradients_on_the_gemm_weights_compute_copies_equal_the_float32_parameters_gradients(plan, microbatches):
    """bf16 compute, 1 or 2 microbatches: the step's source differentiates w.r.t. the GEMM weights' bf16 copies. The
    XLA dots' weights and every uncast leaf get the plain float32 source's gradients bit for bit (the model casts
    those weights before each GEMM: both are the same bf16 GEMM outputs, with 2 microbatches summed in float32). The expert weights
    here run lax.ragged_dot (the CPU's grouped GEMM), whose transpose for a float32 operand rounds less: theirs
    agree to bf16 rounding (on the GPU the Pallas kernel's weight gradient is bf16 either way)."""
    from megascale_jax.model.transformer import GEMM_WEIGHTS

    cfg = default_config("tiny_cpu", num_devices=8, **{**COMMON, **PLANS[plan], "train.compute_dtype": "bfloat16",
                                                      "train.microbatches": microbatches})
    trainer = step.build(cfg)
    state, batch = step.create_state(trainer), _batch(trainer)
    _, _, ours = _loss_and_grads(trainer, state, batch)
    if microbatches == 1 and not trainer.plan.per_device:   # as the source returns them (no reduction here)
        bf16 = {jax.tree_util.keystr(p).split("'")[-2] for p, g in jax.tree_util.tree_leaves_with_path(ours)
                if g.dtype == jnp.bfloat16}
        assert bf16 == set(GEMM_WEIGHTS), bf16   # the tiny model has every kind: attention, experts, shared, head
    plain = gradients.accumulate(gradients.autodiff(gradients.model_loss(trainer.graphdef, trainer.layout),
                                                    per_device=trainer.plan.per_device),
                                 cfg.train.microbatches)
    original = step.gradient_source, step.source_params
    try:
        step.gradient_source, step.source_params = (lambda _: plain), (lambda s: s["params"])
        _, _, want = _loss_and_grads(trainer, state, batch)
    finally:
        step.gradient_source, step.source_params = original
    exact = 0
    for (path, got), w in zip(jax.tree_util.tree_leaves_with_path(ours), jax.tree.leaves(want)):
        name, got, w = jax.tree_util.keystr(path), np.asarray(got), np.asarray(w)
        assert w.dtype == np.float32, name
        got = got.astype(np.float32)
        scale = float(np.abs(w).max())
        assert scale > 0, name
        if any(e in name for e in EXPERT_WEIGHTS):
            np.testing.assert_allclose(got, w, atol=2 ** -8 * scale, err_msg=name)
        else:
            np.testing.assert_array_equal(got, w, err_msg=name)
            exact += any(n in name for n in GEMM_WEIGHTS)
    assert exact == 8   # attention (4), the shared expert (3), the head


def test_the_gemm_weights_are_cast_and_nothing_else():

    from megascale_jax.model.transformer import cast_gemm_weights

    cfg = default_config("tiny_cpu", num_devices=8, **COMMON)
    params = step.create_state(step.build(cfg))["params"]
    cast = cast_gemm_weights(params, jnp.bfloat16)
    names = {jax.tree_util.keystr(p): x.dtype for p, x in jax.tree_util.tree_leaves_with_path(cast)}
    bf16 = sorted(n.split("'")[-2] for n, d in names.items() if d == jnp.bfloat16)
    assert bf16 == sorted(["head_DV", "wq_DHK", "wk_DGK", "wv_DGK", "wo_HKD", "w_gate_EDF", "w_up_EDF", "w_down_EFD",
                           "w_gate_DF", "w_up_DF", "w_down_FD"]), bf16
    assert all(d == jnp.float32 for n, d in names.items() if any(k in n for k in ("table_VD", "router", "scale")))


@pytest.mark.parametrize("plan,nonfinite", [("xla", "stop"), ("sp+ep", "skip")])
def test_the_state_keeps_the_gemm_weights_copies_of_its_parameters(plan, nonfinite):
    """bf16 compute: the step writes the GEMM weights' bf16 copies with the update, and they stay the cast of the
    state's float32 parameters (after create_state, every step, and a skipped non-finite step); the step equals the
    plain twin that casts the float32 parameters at its start. Checkpoints hold no copies; `resumed` casts them."""

    from megascale_jax.model.transformer import gemm_weight_copies

    cfg = default_config("tiny_cpu", num_devices=8, **{**COMMON, **PLANS[plan], "train.compute_dtype": "bfloat16",
                                                      "train.nonfinite": nonfinite})
    trainer = step.build(cfg)
    assert trainer.copies_dtype == jnp.bfloat16 and step.COPIES not in trainer.checkpoint_abstract

    def cast_of_params(state):
        return jax.device_get(gemm_weight_copies(state["params"], jnp.bfloat16))

    def assert_copies_are_the_cast(state):
        got, want = jax.device_get(state[step.COPIES]), cast_of_params(state)
        assert jax.tree.structure(got) == jax.tree.structure(want) and len(jax.tree.leaves(got)) == 11
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert a.dtype == jnp.bfloat16
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    state, batch = step.create_state(trainer), _batch(trainer)
    assert_copies_are_the_cast(state)
    # The plain twin: the copies cast from the float32 parameters at the step's start (what the state carries over).
    twin = {k: v for k, v in jax.device_get(state).items()}
    twin = step.resumed(trainer, step.checkpointed(jax.device_put(twin, trainer.state_shardings)))
    train_step = step.make_train_step(trainer)
    for _ in range(2):
        state, metrics = train_step(state, batch)
        assert_copies_are_the_cast(state)
        twin = step.resumed(trainer, step.checkpointed(twin))   # a fresh cast, as a restore does
        twin, twin_metrics = train_step(twin, batch)
        assert float(metrics["loss"]) == float(twin_metrics["loss"])
        for a, b in zip(jax.tree.leaves(jax.device_get(state["params"])), jax.tree.leaves(jax.device_get(twin["params"]))):
            np.testing.assert_array_equal(a, b)
    before = jax.device_get(state)
    bad = {"inputs": batch["inputs"], "targets": batch["targets"]}
    poisoned = dict(state, params=jax.tree.map(lambda x: x * np.float32(np.inf) if x.ndim == 1 else x, state["params"]))
    state, _ = train_step(poisoned, bad)
    if nonfinite == "skip":   # the skipped update leaves parameters and copies as they were
        for a, b in zip(jax.tree.leaves(jax.device_get(state[step.COPIES])), jax.tree.leaves(before[step.COPIES])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert_copies_are_the_cast(state)


@pytest.mark.parametrize("microbatches, loops", [(2, 0), (4, 1)])
def test_the_first_microbatch_starts_the_accumulator(microbatches, loops):
    """The first microbatch is peeled off the accumulation loop (its gradient, scaled, is the accumulator's start:
    no zero-filled float32 carry); with 2 microbatches no loop is left in the compiled program, so XLA sees both
    bf16 gradients in one sum. The mean is exact: the scaled sum equals the gradients' mean."""
    params = {"w": jnp.linspace(-1, 1, 64 * 32, dtype=jnp.float32).reshape(64, 32).astype(jnp.bfloat16)}
    batch = {"inputs": jax.random.normal(jax.random.key(0), (8, 64)), "targets": jnp.zeros((8, 64))}

    def single(p, b):
        def loss(p):
            return jnp.mean((b["inputs"].astype(jnp.bfloat16) @ p["w"]).astype(jnp.float32) ** 2), {"m": 1.0}
        (value, metrics), grads = jax.value_and_grad(loss, has_aux=True)(p)
        return value, metrics, grads

    source = gradients.accumulate(single, microbatches)
    compiled = jax.jit(source).lower(params, batch).compile().as_text()
    assert compiled.count(" while(") == loops
    loss, _, grads = jax.jit(source)(params, batch)
    parts = [single(params, jax.tree.map(lambda x: x[m], gradients.split_microbatches(batch, microbatches)))
             for m in range(microbatches)]
    assert grads["w"].dtype == jnp.float32
    np.testing.assert_allclose(grads["w"], sum(np.float32(g["w"]) for _, _, g in parts) / microbatches, rtol=1e-6)
    np.testing.assert_allclose(loss, sum(float(v) for v, _, _ in parts) / microbatches, rtol=1e-6)
