"""MoE layer vs a naive per-token loop; router losses on hand-built inputs; dispatch round trip."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from megascale_jax.config import default_config
from megascale_jax.model.moe.layer import MoEFFN
from megascale_jax.model.moe.router import balance_loss, route
from megascale_jax.parallel.expert_parallel import combine_local, dispatch_local
from megascale_jax.parallel.layouts import local_layout


def _naive_moe(layer, x_TD):
    """Loops over tokens and their top-k experts, one expert FFN at a time (no sorting, no grouping)."""
    w = layer.router.w_DE[...]
    probs = np.asarray(jax.nn.softmax(x_TD @ w, axis=-1))
    top_k = layer.router.top_k
    gate, up, down = (np.asarray(a[...]) for a in (layer.experts.w_gate_EDF, layer.experts.w_up_EDF,
                                                   layer.experts.w_down_EFD))
    out = np.zeros_like(np.asarray(x_TD))
    for t, x in enumerate(np.asarray(x_TD)):
        experts = np.argsort(-probs[t], kind="stable")[:top_k]
        weights = probs[t][experts]
        if layer.router.renormalize:
            weights = weights / weights.sum()
        for e, wt in zip(experts, weights):
            h = x @ gate[e]
            out[t] += wt * ((h / (1 + np.exp(-h))) * (x @ up[e])) @ down[e]
    if layer.shared is not None:
        s = layer.shared
        h = np.asarray(x_TD) @ np.asarray(s.w_gate_DF[...])
        shared = ((h / (1 + np.exp(-h))) * (np.asarray(x_TD) @ np.asarray(s.w_up_DF[...]))) @ np.asarray(s.w_down_FD[...])
        if layer.shared_gated:   # Qwen2-MoE: sigmoid(x . w_gate) per token
            shared = shared / (1 + np.exp(-(np.asarray(x_TD) @ np.asarray(layer.shared_gate_D1[...]))))
        out += shared
    return out


@pytest.mark.parametrize("top_k,shared,renorm,gate", [(1, 0, True, False), (2, 0, True, False), (3, 1, False, False),
                                                      (8, 2, True, False), (4, 1, False, True)])
def test_moe_layer_matches_naive_loop(top_k, shared, renorm, gate):
    cfg = default_config("tiny_cpu", **{"model.moe.top_k": top_k, "model.moe.num_shared_experts": shared,
                                        "model.moe.renormalize": renorm, "model.moe.expert_ffn": 32,
                                        "model.moe.shared_expert_gate": gate})
    layer = MoEFFN(cfg.model.hidden, cfg.model.moe, jnp.float32, nnx.Rngs(top_k))
    x = jax.random.normal(jax.random.key(1), (2, 12, cfg.model.hidden), jnp.float32)
    y, stats = layer(x, local_layout(cfg.model.moe.num_experts))
    expected = _naive_moe(layer, x.reshape(-1, cfg.model.hidden)).reshape(x.shape)
    np.testing.assert_allclose(np.asarray(y), expected, rtol=2e-5, atol=2e-5)
    assert int(stats["tokens_per_expert"].sum()) == 24 * top_k
    assert int(stats["dropped_tokens"]) == 0


def test_sort_and_unsort_round_trip_with_uneven_groups():
    x = jnp.arange(6 * 4, dtype=jnp.float32).reshape(6, 4)
    idx = jnp.array([[3, 0], [3, 1], [3, 0], [3, 2], [3, 1], [3, 0]], jnp.int32)  # expert 3 takes every token
    xs, sizes, residual = dispatch_local(x, idx, num_experts=5)
    assert sizes.tolist() == [3, 2, 1, 6, 0]
    # Rows are grouped by expert, token order kept inside a group.
    np.testing.assert_array_equal(np.asarray(xs[:3]), np.asarray(x[jnp.array([0, 2, 5])]))
    weights = jnp.full((6, 2), 0.5)
    np.testing.assert_allclose(np.asarray(combine_local(xs, residual, weights)), np.asarray(x), rtol=1e-6)


def test_balance_loss_hand_built():
    # 4 tokens, 4 experts. Perfect balance: uniform probs, each expert gets one token -> loss 1.
    probs = jnp.full((4, 4), 0.25)
    idx = jnp.array([[0], [1], [2], [3]])
    assert float(balance_loss(probs, idx, group_size=1)) == pytest.approx(1.0)
    # Collapse: all mass and all tokens on expert 0 -> E * 1 * 1 = 4.
    probs = jnp.tile(jnp.array([1.0, 0, 0, 0]), (4, 1))
    idx = jnp.zeros((4, 1), jnp.int32)
    assert float(balance_loss(probs, idx, group_size=1)) == pytest.approx(4.0)
    # Grouped: experts {0,1} and {2,3} are two virtual experts. Tokens alternate between experts 0 and 1, so
    # per expert it is unbalanced (loss 2) but per group it is as unbalanced as a collapse onto group 0 (2).
    probs = jnp.tile(jnp.array([0.5, 0.5, 0, 0]), (4, 1))
    idx = jnp.array([[0], [1], [0], [1]])
    assert float(balance_loss(probs, idx, group_size=1)) == pytest.approx(4 * (0.5 * 0.5 + 0.5 * 0.5))
    assert float(balance_loss(probs, idx, group_size=2)) == pytest.approx(2.0)
    # Grouped balance that per-expert counting calls unbalanced: each group gets half the tokens.
    probs = jnp.tile(jnp.array([0.5, 0.0, 0.5, 0.0]), (4, 1))
    idx = jnp.array([[0], [2], [0], [2]])
    assert float(balance_loss(probs, idx, group_size=2)) == pytest.approx(1.0)
    assert float(balance_loss(probs, idx, group_size=1)) == pytest.approx(2.0)


def test_route_renormalises_and_z_loss():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.2, 0.0 + 1e-30]]))
    r = route(logits, top_k=2, renormalize=True, group_size=1)
    assert r.idx_TK.tolist() == [[0, 1]]
    np.testing.assert_allclose(np.asarray(r.weight_TK), [[0.625, 0.375]], rtol=1e-6)
    r2 = route(logits, top_k=2, renormalize=False, group_size=1)
    np.testing.assert_allclose(np.asarray(r2.weight_TK), [[0.5, 0.3]], rtol=1e-6)
    big = route(jnp.array([[10.0, 0.0]]), 1, True, 1)
    assert float(big.z_loss) == pytest.approx(float(jax.nn.logsumexp(jnp.array([10.0, 0.0])) ** 2), rel=1e-6)


def test_shared_expert_gate_scales_the_shared_output_per_token():
    """With the gate's weights zero, sigmoid(0) = 1/2 halves the shared output; the gate exists only when asked."""
    over = {"model.moe.num_shared_experts": 1, "model.moe.expert_ffn": 32}
    plain = MoEFFN(128, default_config("tiny_cpu", **over).model.moe, jnp.float32, nnx.Rngs(0))
    gated = MoEFFN(128, default_config("tiny_cpu", **over, **{"model.moe.shared_expert_gate": True}).model.moe,
                   jnp.float32, nnx.Rngs(0))
    assert not hasattr(plain, "shared_gate_D1") and gated.shared_gate_D1[...].shape == (128, 1)
    gated.shared_gate_D1[...] = jnp.zeros((128, 1))
    x = jax.random.normal(jax.random.key(2), (6, 128), jnp.float32)
    np.testing.assert_allclose(np.asarray(gated.shared_output(x)), 0.5 * np.asarray(plain.shared_output(x)),
                               rtol=1e-6, atol=1e-6)


def test_fused_swiglu_layer_equals_the_separate_form(monkeypatch):
    """kernels.swiglu='fused' (both first expert GEMMs and SwiGLU in one kernel, run here in the Pallas GPU
    interpreter) gives the layer's output and gradients of the separate form (two GEMMs, then the activation)."""
    import functools

    import pallas_kernels.grouped_swiglu as gsw

    interpreted = functools.partial(gsw.grouped_swiglu, interpret=True,
                                    tiling=gsw.SwigluTiling(cols=64, tile_k=64, stages=2, num_sms=3))
    monkeypatch.setattr(gsw, "grouped_swiglu", interpreted)
    cfg = default_config("tiny_cpu", **{"model.hidden": 128, "model.moe.expert_ffn": 128, "model.moe.top_k": 2})
    layout = local_layout(cfg.model.moe.num_experts)
    x = jax.random.normal(jax.random.key(1), (2, 40, 128), jnp.float32).astype(jnp.bfloat16)
    results = {}
    for swiglu in ("separate", "fused"):
        layer = MoEFFN(128, cfg.model.moe, jnp.bfloat16, nnx.Rngs(0), grouped_gemm="xla", swiglu=swiglu)
        graph, params = nnx.split(layer, nnx.Param)

        def loss(params, x, graph=graph):
            y, _ = nnx.merge(graph, params)(x, layout)
            return jnp.sum(y.astype(jnp.float32) ** 2), y

        (_, y), grads = jax.value_and_grad(loss, has_aux=True)(params, x)
        results[swiglu] = (y, grads)
    (y_sep, g_sep), (y_fused, g_fused) = results["separate"], results["fused"]
    rel = lambda a, b: float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))  # noqa: E731
    assert rel(y_fused, y_sep) < 1e-2
    for (path, a), b in zip(jax.tree.leaves_with_path(g_fused), jax.tree.leaves(g_sep)):
        assert rel(a, b) < 2e-2, jax.tree_util.keystr(path)


def test_swiglu_choice_resolves_by_what_can_run():
    from megascale_jax.model.moe.experts import resolve_swiglu

    ok = dict(grouped_gemm="pallas", ffn=14336, remat="none", macro_layer=False)
    assert resolve_swiglu("fused", **ok) == "fused" and resolve_swiglu("separate", **ok) == "separate"
    for change, reason in [(dict(grouped_gemm="xla"), "kernels.grouped_gemm is 'xla'"), (dict(ffn=1400), "1400"),
                           (dict(remat="selective"), "remat='selective'"), (dict(macro_layer=True), "macro")]:
        assert resolve_swiglu("separate", **{**ok, **change}) == "separate"
        with pytest.raises(ValueError, match=reason):
            resolve_swiglu("fused", **{**ok, **change})
