"""pallas_kernels/row_gather.py (kernels.permute='pallas') against its plain twins, the XLA gathers of
parallel/permute.py: the kernels alone, and the dispatch's and combines' custom VJPs with either body (values and
gradients; dropped assignments whose rows hold NaN), in interpret mode on the CPU; the tiny model's loss and
gradients; the CUDA lowering of the manual step (the kernels as Triton calls in its checked shard_map); compiled
on the GPU (`-m gpu`)."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megascale_jax.parallel import permute
from megascale_jax.parallel.permute import (PermuteImpl, gather_weighted_sum, inverse_permutation, kept_weighted_sum,
                                           repeat_rows_sorted, resolve_permute)
from pallas_kernels import row_gather
from pallas_kernels.row_gather import combine_backward, gather_rows_sum
from tests.kernels.triton_lowering import lowered_train_step_for_cuda


@pytest.fixture
def interpreted(monkeypatch):
    """The kernels in interpret mode wherever parallel/permute.py calls them (it reaches them as attributes of the
    module it imports, which is this one)."""
    assert permute._row_kernels() is row_gather
    for name in ("gather_rows_sum", "combine_backward"):
        monkeypatch.setattr(row_gather, name, functools.partial(getattr(row_gather, name), interpret=True))


def _routing(tokens=9, top_k=3, d=300, experts=5, seed=0, drop=0.2):
    ks = jax.random.split(jax.random.key(seed), 5)
    idx = jax.random.randint(ks[0], (tokens, top_k), 0, experts)
    kept = jax.random.bernoulli(ks[1], 1 - drop, (tokens * top_k,))
    order = jnp.argsort(jnp.where(kept, idx.reshape(-1), experts), stable=True)   # dropped assignments last
    y = jax.random.normal(ks[2], (tokens * top_k, d), jnp.float32)
    y = jnp.where(kept[order][:, None], y, jnp.nan).astype(jnp.bfloat16)   # junk in the dropped rows
    weight = jax.nn.softmax(jax.random.normal(ks[3], (tokens, top_k)), axis=-1)
    g = jax.random.normal(ks[4], (tokens, d), jnp.float32)
    return order, kept, y, weight, g


@pytest.mark.parametrize("block_d", [128, 2048])
def test_interpret_gather_rows_sum_matches_xla(block_d):
    """D = 300: across (128) and within (2048) one column block; weighted K = 3 with skipped (-1) rows holding NaN,
    and an unweighted K = 1 gather."""
    order, kept, y, weight, _ = _routing()
    rows = inverse_permutation(order)
    idx = jnp.where(kept, rows, -1).reshape(weight.shape)
    got = gather_rows_sum(y, idx, weight, jnp.float32, interpret=True, block_d=block_d)
    gathered = jnp.where((idx >= 0)[..., None], y[jnp.maximum(idx, 0)], 0).astype(jnp.float32)
    np.testing.assert_allclose(got, jnp.einsum("tkd,tk->td", gathered, weight), rtol=1e-6, atol=1e-6)
    assert bool(jnp.all(jnp.isfinite(got)))
    plain = gather_rows_sum(y, order[:, None] // 3, interpret=True, block_d=block_d)
    assert plain.dtype == y.dtype
    np.testing.assert_array_equal(np.asarray(plain, np.float32), np.asarray(y[order // 3], np.float32))


@pytest.mark.parametrize("block_d", [128, 2048])
def test_interpret_combine_backward_matches_xla(block_d):
    order, kept, _, weight, g = _routing(drop=0.0)
    y = jax.random.normal(jax.random.key(11), (order.shape[0], 300)).astype(jnp.bfloat16)
    rows_TK = inverse_permutation(order).reshape(weight.shape)
    d_y, d_w = combine_backward(y, rows_TK, weight, g, interpret=True, block_d=block_d)
    np.testing.assert_allclose(d_w, jnp.einsum("tkd,td->tk", y[rows_TK].astype(jnp.float32), g), rtol=1e-5,
                               atol=1e-5)
    want = jnp.zeros(y.shape, jnp.float32).at[rows_TK.reshape(-1)].set(
        (weight[..., None] * g[:, None, :]).reshape(-1, y.shape[1]))
    np.testing.assert_array_equal(np.asarray(d_y, np.float32), np.asarray(want.astype(jnp.bfloat16), np.float32))
    with pytest.raises(ValueError, match="must permute y's"):
        combine_backward(y[:-1], rows_TK, weight, g, interpret=True)
    with pytest.raises(ValueError, match="block_d=100 must be a power of 2"):
        combine_backward(y, rows_TK, weight, g, interpret=True, block_d=100)


def _values_and_grads(f, *args, g):
    return jax.value_and_grad(lambda *a: jnp.sum(g * f(*a).astype(jnp.float32)), range(len(args)))(*args)


def _assert_close(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, rtol=2 ** -7, atol=1e-5 * max(1.0, float(np.abs(b).max())))


def test_interpret_dispatch_and_combines_match_their_xla_bodies(interpreted):
    order, kept, y, weight, g = _routing()
    rows = inverse_permutation(order)
    tokens, top_k = weight.shape
    x = jax.random.normal(jax.random.key(12), (tokens, y.shape[1])).astype(jnp.bfloat16)
    g_rows = jax.random.normal(jax.random.key(13), (tokens * top_k, y.shape[1]))
    for pallas in (True, False):
        assert repeat_rows_sorted(x, order, top_k, pallas).shape == (tokens * top_k, y.shape[1])
    _assert_close(_values_and_grads(lambda x: repeat_rows_sorted(x, order, top_k, True), x, g=g_rows),
                  _values_and_grads(lambda x: repeat_rows_sorted(x, order, top_k, False), x, g=g_rows))
    _assert_close(_values_and_grads(lambda y, w: gather_weighted_sum(y, rows, order, kept, w, True), y, weight, g=g),
                  _values_and_grads(lambda y, w: gather_weighted_sum(y, rows, order, kept, w, False), y, weight, g=g))
    y_A = y[rows]
    _assert_close(_values_and_grads(lambda y, w: kept_weighted_sum(y, kept, w, True), y_A, weight, g=g),
                  _values_and_grads(lambda y, w: kept_weighted_sum(y, kept, w, False), y_A, weight, g=g))


def _combine_inside_shard_map(check_vma: bool, d: int = 40):
    """Per device, as the manual plans run it: tokens split over the devices, each device's combine (kernels vs
    XLA gathers) with its values and gradients."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("data",))
    parts = [_routing(tokens=4, d=d, seed=s) for s in range(n)]
    order, kept, y, weight, g = (jnp.stack([p[i] for p in parts]) for i in range(5))

    def per_device(order, kept, y, weight, g, pallas):
        rows = inverse_permutation(order[0])
        v, grads = _values_and_grads(lambda y, w: gather_weighted_sum(y, rows, order[0], kept[0], w, pallas),
                                     y[0], weight[0], g=g[0])
        return v[None], grads[0][None], grads[1][None]
    args = [jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (order, kept, y, weight, g)]
    results = [jax.jit(jax.shard_map(functools.partial(per_device, pallas=pallas), mesh=mesh, in_specs=P("data"),
                                     out_specs=P("data"), check_vma=check_vma))(*args) for pallas in (True, False)]
    _assert_close(*results)


def test_interpret_combine_inside_shard_map(interpreted):
    """check_vma off: jax's Pallas interpreter loses the varying type of its grid loop's carry inside a checked
    shard_map (see test_cross_entropy.py); the typing is checked by the CUDA lowering below and on the GPU."""
    _combine_inside_shard_map(check_vma=False)


@pytest.mark.gpu
def test_gpu_combine_inside_a_checked_shard_map():
    _combine_inside_shard_map(check_vma=True, d=2048)


def test_resolution_by_backend_and_plan():
    assert resolve_permute("auto", backend="gpu", partitioned_by_xla=False) == PermuteImpl.XLA   # measured: not faster
    assert resolve_permute("pallas", backend="gpu", partitioned_by_xla=False) == PermuteImpl.PALLAS
    assert resolve_permute("auto", backend="gpu", partitioned_by_xla=True) == PermuteImpl.XLA
    assert resolve_permute("auto", backend="cpu", partitioned_by_xla=False) == PermuteImpl.XLA
    with pytest.raises(ValueError, match="kernels.permute='pallas'.*backend 'cpu'"):
        resolve_permute("pallas", backend="cpu", partitioned_by_xla=False)
    with pytest.raises(ValueError, match="XLA plan on several devices"):
        resolve_permute("pallas", backend="gpu", partitioned_by_xla=True)


def test_the_models_loss_and_gradients_with_the_row_kernels(interpreted, capacity_factor=0.5):
    """The tiny model in bf16 (local dispatch with a capacity that drops some assignments, so both the kept and the
    dropped rows' paths run): the layout's row moves as kernels against XLA's gathers."""
    from flax import nnx

    from megascale_jax import step
    from megascale_jax.config import default_config
    from megascale_jax.parallel.layouts import LocalDispatch, local_layout

    cfg = default_config("tiny_cpu", num_devices=8, **{"train.compute_dtype": "bfloat16"})
    # Compiled whole (init, then loss and gradients), not op by op: eagerly the model was ~200 small compiles.
    graphdef = nnx.split(nnx.eval_shape(lambda: step.new_model(cfg)))[0]
    params = jax.jit(lambda: nnx.state(step.new_model(cfg)))()
    tokens = jax.random.randint(jax.random.key(3), (2, 33), 0, cfg.model.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    results = []
    for pallas in (True, False):
        layout = dataclasses.replace(local_layout(num_experts=cfg.model.moe.num_experts), ffn=LocalDispatch(
            cfg.model.moe.num_experts, capacity_factor=capacity_factor, pallas_rows=pallas))
        loss = lambda p: nnx.merge(graphdef, p).loss(batch, layout)  # noqa: E731
        results.append(jax.jit(jax.value_and_grad(loss, has_aux=True))(params))
    ((v, metrics), grads), ((v_want, _), grads_want) = results
    assert float(v) == pytest.approx(float(v_want), rel=1e-5)
    assert int(metrics["dropped_tokens"]) > 0   # the masking ran
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads_want)):
        np.testing.assert_allclose(a, b, atol=2e-2 * float(np.abs(b).max()), err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("intra", [4, 1])
def test_the_train_step_with_the_row_kernels_lowers_for_the_gpu(monkeypatch, intra):
    """The manual step with kernels.permute='pallas', lowered for CUDA on the CPU, in its checked shard_map: over
    4 ranks (all_to_all dispatch) the combine's weighted sum and its backward become Triton calls; on 1 (the local
    sort) also the dispatch's gather and its backward's sum (two more gather_rows_sum calls per MoE layer)."""
    text = lowered_train_step_for_cuda(monkeypatch, {"parallel.intra": intra}, permute="pallas")
    gathers, backwards = text.count('name = "gather_rows_sum"'), text.count('name = "combine_backward"')
    assert backwards > 0 and gathers == (3 if intra == 1 else 1) * backwards


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, top_k, d", [(4096, 6, 2048), (2048, 2, 4096), (1024, 8, 7168)])
def test_gpu_kernels_match_xla(tokens, top_k, d):
    order, kept, y, weight, g = _routing(tokens=tokens, top_k=top_k, d=d, experts=16)
    rows = inverse_permutation(order)
    x = jax.random.normal(jax.random.key(12), (tokens, d)).astype(jnp.bfloat16)
    g_rows = jax.random.normal(jax.random.key(13), (tokens * top_k, d))
    _assert_close(_values_and_grads(lambda x: repeat_rows_sorted(x, order, top_k, True), x, g=g_rows),
                  _values_and_grads(lambda x: repeat_rows_sorted(x, order, top_k, False), x, g=g_rows))
    _assert_close(_values_and_grads(lambda y, w: gather_weighted_sum(y, rows, order, kept, w, True), y, weight, g=g),
                  _values_and_grads(lambda y, w: gather_weighted_sum(y, rows, order, kept, w, False), y, weight, g=g))



def test_the_all_gather_dispatch_refuses_the_row_kernels(monkeypatch):
    """kernels.permute='pallas' with a plan whose dispatcher has no kernel path (all_gather, and moe_layer='fused'
    which needs it): a one-line error at build time, not a silently ignored choice."""
    from megascale_jax import step
    from megascale_jax.config import default_config

    resolve = step.resolve_kernels
    monkeypatch.setattr(step, "resolve_kernels", lambda cfg, plan: dataclasses.replace(resolve(cfg, plan),
                                                                                       permute="pallas"))
    cfg = default_config("tiny_cpu", num_devices=8, **{"plan_recipe": "megascale", "parallel.intra": 4,
                                                      "parallel.ep_dispatch": "all_gather"})
    with pytest.raises(ValueError, match="kernels.permute='pallas' covers the local and all_to_all dispatches"):
        step.build(cfg)
