"""Pipeline schedules: tables, bubble, stash bounds, errors, and sharded == single-device numerics.

The model is a tiny residual MLP: an embedding (first_fn), tanh blocks with a small aux loss
(layer_fn), and a softmax cross-entropy head (last_fn), all fp32.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import AxisType, PartitionSpec as P

from megascale_jax.parallel.pipeline import (
    PipelineParams, pipeline_value_and_grad, sequential_value_and_grad)
from megascale_jax.parallel.pipeline_schedules import (
    StageLayout, bubble_fraction, build_schedule, schedule_summary, validate_schedule_args)

D, F, VOCAB, B, T = 8, 16, 11, 4, 3


def first_fn(p, tokens_BT):
    return p["emb"][tokens_BT]


def layer_with_aux(p, x_BTD):
    y_BTD = x_BTD + jnp.tanh(x_BTD @ p["w1"] + p["b1"]) @ p["w2"]
    return y_BTD, 0.01 * jnp.mean(y_BTD ** 2)


def layer_plain(p, x_BTD):
    return layer_with_aux(p, x_BTD)[0]


def last_fn(p, x_BTD, targets_BT):
    return optax.softmax_cross_entropy_with_integer_labels(x_BTD @ p["wo"], targets_BT).mean()


def make_model(layout, num_microbatches, seed=0):
    """Params in stage layout, the same layers stacked [L, ...], and (tokens, targets) [M, B, T]."""
    rng = np.random.default_rng(seed)
    L = layout.num_layers
    layers_L = {"w1": rng.normal(size=(L, D, F)) / D ** 0.5, "b1": 0.1 * rng.normal(size=(L, F)),
                "w2": rng.normal(size=(L, F, D)) / F ** 0.5}
    layers_L = {k: jnp.asarray(v, jnp.float32) for k, v in layers_L.items()}
    params = PipelineParams(first={"emb": jnp.asarray(rng.normal(size=(VOCAB, D)), jnp.float32)},
                            stages=layout.to_stage_layout(layers_L),
                            last={"wo": jnp.asarray(rng.normal(size=(D, VOCAB)) / D ** 0.5, jnp.float32)})
    shape = (num_microbatches, B, T)
    microbatches = (jnp.asarray(rng.integers(0, VOCAB, shape), jnp.int32),
                    jnp.asarray(rng.integers(0, VOCAB, shape), jnp.int32))
    return params, layers_L, microbatches


@functools.partial(jax.jit, static_argnames=("has_aux", "layer_fn"))
def plain_value_and_grad(first, layers_L, last, microbatches, has_aux, layer_fn=layer_with_aux):
    """The model written out plainly: no stages, no masks, no scans; layers in order."""
    def objective(first, layers_L, last):
        def per_microbatch(tokens, targets):
            x, aux = first_fn(first, tokens), 0.0
            for l in range(layers_L["w1"].shape[0]):
                x, a = layer_fn(jax.tree.map(lambda w: w[l], layers_L), x)
                aux = aux + (a if has_aux else 0.0)
            return last_fn(last, x, targets), aux
        losses, auxes = jax.vmap(per_microbatch)(*microbatches)
        return losses.mean() + auxes.mean(), (losses.mean(), auxes.mean())
    (_, (loss, aux)), grads = jax.value_and_grad(objective, argnums=(0, 1, 2), has_aux=True)(
        first, layers_L, last)
    return loss, aux, grads


def make_mesh(data, pipe):
    return jax.make_mesh((data, pipe), ("data", "pipe"), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices()[:data * pipe])


# ---------------------------------------------------------------- schedule tables (no compilation)

def _valid_configs():
    for schedule in ("gpipe", "1f1b", "interleaved"):
        for S in (1, 2, 3, 4):
            for M in range(1, 10):
                for V in ((1,) if schedule != "interleaved" else (2, 3)):
                    try:
                        validate_schedule_args(schedule, S, M, V)
                    except ValueError:
                        continue
                    yield schedule, S, M, V


def test_counted_bubble_matches_formula():
    checked = 0
    for schedule, S, M, V in _valid_configs():
        counted = build_schedule(schedule, S, M, V).counted_bubble_fraction()
        np.testing.assert_allclose(counted, bubble_fraction(schedule, S, M, V), rtol=0, atol=1e-12)
        checked += 1
    assert checked > 60
    assert bubble_fraction("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("interleaved", 4, 8, 2) == pytest.approx(3 / 19)
    summary = schedule_summary("1f1b", 2, 8)
    assert summary["bubble_fraction_counted"] == pytest.approx(summary["bubble_fraction_formula"])
    assert summary["stash_rows_per_device"] == 3 and summary["ticks"] == 8 + 2 * 2 - 2


def test_stash_bounded_by_stages_not_microbatches():
    S = 4
    one_f_one_b = [build_schedule("1f1b", S, M).stash_slots for M in (4, 8, 16, 64)]
    gpipe = [build_schedule("gpipe", S, M).stash_slots for M in (4, 8, 16, 64)]
    interleaved = [build_schedule("interleaved", S, M, 2).stash_slots for M in (8, 16, 64)]
    assert max(one_f_one_b) <= 2 * S - 1 and one_f_one_b[1:] == [2 * S - 1] * 3
    assert gpipe == [4, 8, 16, 64]
    assert interleaved == [S * (2 + 1) - 1] * 3   # S*(V+1) - 1, like 1F1B's 2S - 1


def test_tables_route_every_item_to_the_right_buffer_rows():
    """Replay the tables with (microbatch, chunk) tags instead of arrays: every F and B must find the
    input (and cotangent) of exactly the item it runs, and every item runs F and B once."""
    for schedule, S, M, V in _valid_configs():
        sched = build_schedule(schedule, S, M, V)
        C, tab = S * V, sched.tables
        stash = [dict() for _ in range(S)]
        grads = [dict() for _ in range(S)]
        done_f, done_b = set(), set()
        for t in range(sched.num_ticks):
            sent_down, sent_up = [None] * S, [None] * S
            for s in range(S):
                if tab["f_on"][t, s]:
                    m, c = int(tab["f_mb"][t, s]), int(tab["f_virtual"][t, s]) * S + s
                    if c == 0:
                        stash[s][int(tab["f_slot"][t, s])] = (m, 0)
                    assert stash[s].get(int(tab["f_slot"][t, s])) == (m, c)
                    sent_down[(s + 1) % S] = (m, c + 1) if c + 1 < C else None
                    done_f.add((m, c))
                if tab["b_on"][t, s]:
                    m, c = int(tab["b_mb"][t, s]), int(tab["b_virtual"][t, s]) * S + s
                    assert stash[s].get(int(tab["b_slot"][t, s])) == (m, c)
                    if c < C - 1:
                        assert grads[s].get(int(tab["b_gslot"][t, s])) == (m, c)
                    sent_up[(s - 1) % S] = (m, c - 1) if c > 0 else None
                    done_b.add((m, c))
            for s in range(S):
                if sent_down[s] is not None:
                    stash[s][int(tab["recv_act_slot"][t, s])] = sent_down[s]
                if sent_up[s] is not None:
                    grads[s][int(tab["recv_grad_slot"][t, s])] = sent_up[s]
        everything = {(m, c) for m in range(M) for c in range(C)}
        assert done_f == everything and done_b == everything, (schedule, S, M, V)


@pytest.mark.parametrize("args, match", [
    (("zb", 2, 4, 1), "schedule='zb' is unknown"),
    (("interleaved", 2, 4, 1), "needs virtual_stages >= 2"),
    (("1f1b", 2, 4, 2), "needs schedule='interleaved'"),
    (("interleaved", 4, 6, 2), "multiple of it; use e.g. 8"),
    (("gpipe", 2, 0, 1), "num_microbatches=0"),
])
def test_schedule_errors(args, match):
    with pytest.raises(ValueError, match=match):
        build_schedule(*args)


def test_layout_split_round_trip_and_errors():
    layout = StageLayout.balanced(5, 2)
    assert layout.layers_per_chunk == (3, 2)
    assert layout.active_mask().tolist() == [[[True, True, True], [True, True, False]]]
    layers_L = {"w": jnp.arange(5 * 2, dtype=jnp.float32).reshape(5, 2) + 1}
    stages = layout.to_stage_layout(layers_L)
    assert stages["w"].shape == (1, 2, 3, 2) and float(stages["w"][0, 1, 2].sum()) == 0.0
    np.testing.assert_array_equal(layout.from_stage_layout(stages)["w"], layers_L["w"])
    interleaved = StageLayout.balanced(8, 2, 2)   # chunk c = v*S + s holds layers 2c, 2c+1
    np.testing.assert_array_equal(
        interleaved.to_stage_layout(jnp.arange(8))[1, 0], jnp.array([4, 5]))
    with pytest.raises(ValueError, match="cannot fill"):
        StageLayout.balanced(3, 2, 2)
    with pytest.raises(ValueError, match="one layer count per chunk"):
        StageLayout(2, 1, (1, 2, 3))
    with pytest.raises(ValueError, match="non-negative"):
        StageLayout(2, 1, (3, -1))
    with pytest.raises(ValueError, match="stack one entry per layer"):
        layout.to_stage_layout({"w": jnp.zeros((4, 2))})


def test_call_errors_name_the_argument():
    layout = StageLayout.balanced(4, 2)
    params, _, microbatches = make_model(layout, 2)
    mesh = make_mesh(2, 2)

    def call(**overrides):
        kwargs = dict(mesh=mesh, layout=layout, schedule="1f1b", axis="pipe", batch_axes=("data",),
                      has_aux=True, params=params, microbatches=microbatches, layer_fn=layer_with_aux)
        kwargs.update(overrides)
        return pipeline_value_and_grad(first_fn, kwargs.pop("layer_fn"), last_fn, kwargs.pop("params"),
                                       kwargs.pop("microbatches"), **kwargs)

    with pytest.raises(ValueError, match="layout.num_stages=4"):
        call(layout=StageLayout.balanced(4, 4))
    with pytest.raises(ValueError, match="axis='stage' is not a mesh axis"):
        call(axis="stage")
    with pytest.raises(ValueError, match=r"params.stages\['b1'\].*to_stage_layout"):
        call(params=params._replace(stages=jax.tree.map(lambda a: a[0], params.stages)))
    with pytest.raises(ValueError, match="divisible by the batch axes' size 2"):
        call(microbatches=jax.tree.map(lambda a: a[:, :3], microbatches))
    with pytest.raises(ValueError, match="layer_fn must return an activation"):
        call(layer_fn=lambda p, x: (x[..., :2], 0.0))


# ---------------------------------------------------------------- pipelined == single device

def _assert_matches_plain(result, layers_L, params, microbatches, layout, has_aux,
                          layer_fn=layer_with_aux):
    loss, aux, (d_first, d_layers_L, d_last) = plain_value_and_grad(
        params.first, layers_L, params.last, microbatches, has_aux, layer_fn)
    want = PipelineParams(d_first, layout.to_stage_layout(d_layers_L), d_last)
    np.testing.assert_allclose(result.loss, loss, rtol=1e-6)
    np.testing.assert_allclose(result.aux_loss, aux, rtol=1e-6, atol=1e-9)
    assert (float(aux) > 0) == has_aux
    for got, ref in zip(jax.tree.leaves(result.grads), jax.tree.leaves(want)):
        assert got.shape == ref.shape and got.dtype == jnp.float32
        assert float(jnp.max(jnp.abs(ref))) > 1e-3   # a zero gradient would pass trivially
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)   # padded layers: exactly 0 == 0


def test_sequential_twin_equals_plain_model():
    layout = StageLayout(2, 2, (2, 0, 1, 2))   # interleaved order, a layer-free chunk, padding
    params, layers_L, mbs = make_model(layout, 3)
    result = jax.jit(lambda p, mb: sequential_value_and_grad(
        first_fn, layer_with_aux, last_fn, p, mb, layout=layout, has_aux=True))(params, mbs)
    _assert_matches_plain(result, layers_L, params, mbs, layout, has_aux=True)


@pytest.mark.parametrize("schedule, pipe, data, virtual, microbatches, layers_per_chunk, has_aux", [
    ("gpipe", 2, 1, 1, 2, (2, 2), True),                  # M == S, no data axis
    ("gpipe", 4, 2, 1, 8, (1, 1, 1, 1), False),           # M > S, dp=2
    ("1f1b", 2, 4, 1, 2, (3, 2), False),                  # M == S, 5 layers on 2 stages, dp=4
    ("1f1b", 4, 2, 1, 4, (2, 1, 1, 1), True),             # M == S, uneven
    ("1f1b", 4, 2, 1, 6, (2, 2, 1, 0), True),             # M > S, head-only last stage
    ("interleaved", 2, 4, 2, 4, (1, 1, 1, 1), True),      # M > S
    ("interleaved", 4, 2, 2, 4, (1,) * 7 + (2,), True),   # M == S, 9 layers in 8 chunks
])
def test_pipeline_equals_plain_model(schedule, pipe, data, virtual, microbatches, layers_per_chunk,
                                    has_aux):
    layout = StageLayout(pipe, virtual, layers_per_chunk)
    params, layers_L, mbs = make_model(layout, microbatches)
    mesh = make_mesh(data, pipe)
    layer_fn = layer_with_aux if has_aux else layer_plain
    batch_axes = ("data",) if data > 1 else ()
    result = jax.jit(lambda p, mb: pipeline_value_and_grad(
        first_fn, layer_fn, last_fn, p, mb, mesh=mesh, layout=layout, schedule=schedule,
        axis="pipe", batch_axes=batch_axes, has_aux=has_aux))(params, mbs)
    _assert_matches_plain(result, layers_L, params, mbs, layout, has_aux)


def mixing_layer(p, x_BTD):
    """Mixes along the sequence, so sequence parallelism needs a collective (the plain form)."""
    y_BTD = x_BTD + jnp.tanh(x_BTD.mean(axis=1, keepdims=True) @ p["w1"] + p["b1"]) @ p["w2"]
    return y_BTD, 0.01 * jnp.mean(y_BTD ** 2)


def test_pipeline_with_sequence_parallel_inner_axis():
    """Stages whose layers split the sequence over an inner 'seq' axis and call psum themselves
    (the shape of the SP/EP plan inside a stage), with dp=2 and pp=2 on (2, 2, 2) devices."""
    seq_size, seq_len = 2, 4

    def sp_layer(p, x_BtD):   # t = this rank's seq_len / seq_size positions
        mean_B1D = lax.psum(x_BtD.sum(axis=1, keepdims=True), "seq") / seq_len
        y_BtD = x_BtD + jnp.tanh(mean_B1D @ p["w1"] + p["b1"]) @ p["w2"]
        return y_BtD, 0.01 * jnp.sum(y_BtD ** 2) / (y_BtD.size * seq_size)   # this rank's share

    def sp_last(p, x_BtD, targets_Bt):   # this rank's share of the mean token loss
        losses_Bt = optax.softmax_cross_entropy_with_integer_labels(x_BtD @ p["wo"], targets_Bt)
        return losses_Bt.sum() / (losses_Bt.size * seq_size)

    layout = StageLayout(2, 1, (2, 1))
    params, layers_L, _ = make_model(layout, 1)
    rng = np.random.default_rng(1)
    mbs = tuple(jnp.asarray(rng.integers(0, VOCAB, (2, B, seq_len)), jnp.int32) for _ in range(2))
    mesh = jax.make_mesh((2, 2, seq_size), ("data", "pipe", "seq"), axis_types=(AxisType.Auto,) * 3)
    spec = P(None, "data", "seq")
    result = jax.jit(lambda p, mb: pipeline_value_and_grad(
        first_fn, sp_layer, last_fn=sp_last, params=p, microbatches=mb, mesh=mesh, layout=layout,
        schedule="1f1b", axis="pipe", batch_axes=("data",), inner_axes=("seq",),
        microbatch_specs=(spec, spec), has_aux=True))(params, mbs)
    _assert_matches_plain(result, layers_L, params, mbs, layout, True, layer_fn=mixing_layer)


# ---------------------------------------------------------------- compiled memory

def test_compiled_memory_1f1b_flat_gpipe_grows(record_property):
    """Temp bytes of the compiled step at 4 and 16 microbatches: the 1F1B stash is sized by the stage
    count, GPipe's by the microbatch count (12 more stage inputs of act_bytes each)."""
    pipe, d_model, batch, seq = 2, 64, 8, 16
    layout = StageLayout.balanced(4, pipe)
    mesh = make_mesh(1, pipe)
    f32 = jnp.float32
    params = PipelineParams(
        first={"emb": jax.ShapeDtypeStruct((VOCAB, d_model), f32)},
        stages={"w1": jax.ShapeDtypeStruct((1, pipe, 2, d_model, F), f32),
                "b1": jax.ShapeDtypeStruct((1, pipe, 2, F), f32),
                "w2": jax.ShapeDtypeStruct((1, pipe, 2, F, d_model), f32)},
        last={"wo": jax.ShapeDtypeStruct((d_model, VOCAB), f32)})
    act_bytes = batch * seq * d_model * 4

    def temp_bytes(schedule, num_microbatches):
        mbs = (jax.ShapeDtypeStruct((num_microbatches, batch, seq), jnp.int32),) * 2
        step = jax.jit(lambda p, mb: pipeline_value_and_grad(
            first_fn, layer_plain, last_fn, p, mb, mesh=mesh, layout=layout, schedule=schedule,
            axis="pipe"))
        return step.lower(params, mbs).compile().memory_analysis().temp_size_in_bytes

    sizes = {(s, m): temp_bytes(s, m) for s in ("1f1b", "gpipe") for m in (4, 16)}
    record_property("temp_bytes", {f"{s}/M={m}": v for (s, m), v in sizes.items()})
    print("compiled temp bytes:", sizes, "activation bytes:", act_bytes)
    assert sizes["1f1b", 16] <= sizes["1f1b", 4] + act_bytes // 2
    assert sizes["gpipe", 16] >= sizes["gpipe", 4] + 10 * act_bytes
