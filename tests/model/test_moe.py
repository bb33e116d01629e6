"""MoE layer vs a naive per-token loop; router losses on hand-built inputs; dispatch round trip."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from megascale_jax.config import default_config
from megascale_jax.model.moe.layer import MoEFFN
from megascale_jax.model.moe.router import balance_loss, route, take_top_k
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


def test_take_top_k_equals_top_k_values_and_their_gradient():
    """The router's gather of the chosen probabilities (a select, no scatter in its gradient) against
    lax.top_k's own values and their autodiff gradient (a scatter-add), exactly."""
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(0), (37, 16)), axis=-1)
    cotangent = jax.random.normal(jax.random.key(1), (37, 4))
    idx = jax.lax.top_k(probs, 4)[1]

    def plain(p):
        return jnp.sum(jax.lax.top_k(p, 4)[0] * cotangent)

    def ours(p):
        return jnp.sum(take_top_k(p, idx) * cotangent)

    np.testing.assert_array_equal(take_top_k(probs, idx), jax.lax.top_k(probs, 4)[0])
    np.testing.assert_array_equal(jax.grad(ours)(probs), jax.grad(plain)(probs))
    # what the backward keeps: the inputs, not the [T, K, E] mask (recomputed; a stacked layer loop keeps residuals)
    _, pull = jax.vjp(lambda p: take_top_k(p, idx), probs)
    assert all(r.size <= probs.size for r in jax.tree.leaves(pull)), [r.shape for r in jax.tree.leaves(pull)]


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

    ok = dict(backend="gpu", partitioned_by_xla=False, grouped_gemm="pallas", ffn=14336, remat="none",
              macro_layer=False)
    for choice in ("fused", "separate", "separate_pallas_bwd"):
        assert resolve_swiglu(choice, **ok) == choice
    for change, reason in [(dict(grouped_gemm="xla"), "kernels.grouped_gemm is 'xla'"), (dict(ffn=1400), "1400"),
                           (dict(remat="selective"), "remat='selective'"), (dict(macro_layer=True), "macro"),
                           (dict(backend="cpu"), "backend is 'cpu'"), (dict(partitioned_by_xla=True), "XLA plan")]:
        assert resolve_swiglu("separate", **{**ok, **change}) == "separate"
        with pytest.raises(ValueError, match=reason):
            resolve_swiglu("fused", **{**ok, **change})
    # the kernel backward needs only a GPU and a per-device step (any grouped GEMM, FFN width, remat, MoE layer)
    for change in (dict(grouped_gemm="xla"), dict(ffn=1400), dict(remat="selective"), dict(macro_layer=True)):
        assert resolve_swiglu("separate_pallas_bwd", **{**ok, **change}) == "separate_pallas_bwd"
    # auto: the kernel backward wherever it can run, unless the expert GEMM outputs are masked; else separate
    assert resolve_swiglu("auto", **ok) == "separate_pallas_bwd"
    assert resolve_swiglu("auto", **ok, grouped_gemm_tail="kernel") == "separate_pallas_bwd"
    assert resolve_swiglu("auto", **ok, grouped_gemm_tail="mask") == "separate"
    for change in (dict(backend="cpu"), dict(partitioned_by_xla=True)):
        assert resolve_swiglu("auto", **{**ok, **change}) == "separate"
    for change, reason in [(dict(backend="cpu"), "backend is 'cpu'"), (dict(partitioned_by_xla=True), "XLA plan")]:
        with pytest.raises(ValueError, match=reason):
            resolve_swiglu("separate_pallas_bwd", **{**ok, **change})


def test_experts_with_the_kernel_backward_equal_the_separate_form(monkeypatch):
    """kernels.swiglu='separate_pallas_bwd' (its Pallas backward in interpret mode) against 'separate': the
    experts' output and the gradients of x and all three weights, in bf16 (one rounding apart at most)."""
    from megascale_jax.model.moe import experts
    from pallas_kernels import swiglu_backward as kernel

    compiled = kernel.swiglu_backward
    monkeypatch.setattr(kernel, "swiglu_backward", lambda *a, **kw: compiled(*a, **{**kw, "interpret": True}))
    e, d, f, m = 4, 32, 48, 46   # 6 rows past the groups (the dropless buffer's tail)
    keys = jax.random.split(jax.random.key(5), 5)
    x = jax.random.normal(keys[0], (m, d), jnp.float32).astype(jnp.bfloat16)
    weights = experts.ExpertWeights(*(0.2 * jax.random.normal(k, s, jnp.float32) for k, s in
                                      zip(keys[1:4], ((e, d, f), (e, d, f), (e, f, d)))))
    group_sizes = jnp.array([10, 0, 17, 13], jnp.int32)
    dy = jax.random.normal(keys[4], (m, d), jnp.float32).astype(jnp.bfloat16)
    gemm = experts.grouped_gemm_fn("xla", "kernel")

    def run(swiglu):
        y, pull = jax.vjp(lambda x, w: experts.swiglu_experts(x, w, group_sizes, gemm, swiglu), x, weights)
        return y, pull(dy)
    (y, grads), (y_want, grads_want) = run("separate_pallas_bwd"), run("separate")
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_want, np.float32))
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_want)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.abs(a - b).max() <= 2e-2 * np.abs(b).max()


def test_grouped_gemm_tail_resolves_to_mask_only_for_pallas_under_expert_parallelism():
    from megascale_jax.model.moe.experts import resolve_grouped_gemm_tail

    assert resolve_grouped_gemm_tail("auto", grouped_gemm="pallas", expert_parallel=True) == "mask"
    assert resolve_grouped_gemm_tail("auto", grouped_gemm="pallas", expert_parallel=False) == "kernel"
    assert resolve_grouped_gemm_tail("auto", grouped_gemm="xla", expert_parallel=True) == "kernel"
    assert resolve_grouped_gemm_tail("kernel", grouped_gemm="pallas", expert_parallel=True) == "kernel"
    assert resolve_grouped_gemm_tail("mask", grouped_gemm="pallas", expert_parallel=False) == "mask"
    with pytest.raises(ValueError, match="grouped_gemm_tail='mask'.*'xla'"):
        resolve_grouped_gemm_tail("mask", grouped_gemm="xla", expert_parallel=True)


def test_masked_tail_experts_equal_the_kernel_tail_on_a_receive_buffer(monkeypatch):
    """The experts on an expert-parallel receive buffer (real rows, then a tail the dispatch filled with zeros)
    with grouped_gemm_tail 'mask' vs 'kernel' (Pallas GPU interpreter): the same outputs (zeros on the tail), the
    same gradients through the autodiff path and through the hand-written backward's dgrad / wgrad calls."""
    _check_masked_tail_experts(monkeypatch, interpret=True)


@pytest.mark.gpu
def test_gpu_masked_tail_experts_equal_the_kernel_tail_on_a_receive_buffer(monkeypatch):
    """The same on the GPU (the compiled kernels, the select in XLA's fusions)."""
    _check_masked_tail_experts(monkeypatch, interpret=False)


def _check_masked_tail_experts(monkeypatch, interpret):
    import functools

    import pallas_kernels.grouped_gemm as gg
    from megascale_jax.model.moe.experts import ExpertWeights, grouped_gemm_fn, grouped_gemm_grads, swiglu_experts

    seen = []   # (entry point, tuning.zero_tail) of every call: the choice must reach the kernel

    def interpreted(fn, name):
        def call(*args, tuning=None, **kwargs):
            seen.append((name, tuning.zero_tail))
            return fn(*args, tuning=tuning, **{**kwargs, "interpret": interpret})
        return call
    for name in ("grouped_gemm", "grouped_gemm_dgrad", "grouped_gemm_wgrad"):
        monkeypatch.setattr(gg, name, interpreted(getattr(gg, name), name))
    rows, real, d, f = 256, 96, 128, 128
    keys = jax.random.split(jax.random.key(0), 5)
    x = jnp.where(jnp.arange(rows)[:, None] < real, jax.random.normal(keys[0], (rows, d)), 0).astype(jnp.bfloat16)
    weights = ExpertWeights(*(jax.random.normal(k, shape, jnp.float32).astype(jnp.bfloat16) / 8
                              for k, shape in zip(keys[1:4], ((2, d, f), (2, d, f), (2, f, d)))))
    sizes = jnp.array([64, real - 64], jnp.int32)
    ct = jax.random.normal(keys[4], (rows, d), jnp.float32)

    def loss(x, weights, tail):
        y = swiglu_experts(x, weights, sizes, grouped_gemm_fn("pallas", tail))
        return jnp.vdot(y.astype(jnp.float32), ct), y

    results = {}
    for tail in ("kernel", "mask"):
        seen.clear()
        results[tail] = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, weights, tail)
        # three GEMMs forward, each one's custom VJP calling dgrad and wgrad with the forward's tuning
        assert sorted(seen) == sorted([(n, tail) for n in ("grouped_gemm", "grouped_gemm_dgrad",
                                                            "grouped_gemm_wgrad") for _ in range(3)])
    (_, y_kernel), grads_kernel = results["kernel"]
    (_, y_mask), grads_mask = results["mask"]
    assert not np.any(np.asarray(y_mask[real:], np.float32)) and np.any(np.asarray(y_mask[:real], np.float32))
    np.testing.assert_array_equal(np.asarray(y_mask, np.float32), np.asarray(y_kernel, np.float32))
    for a, b in zip(jax.tree.leaves(grads_mask), jax.tree.leaves(grads_kernel)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    dy = ct.astype(jnp.bfloat16)
    (dgrad_k, _), (dgrad_m, _) = grouped_gemm_grads("pallas", "kernel"), grouped_gemm_grads("pallas", "mask")
    seen.clear()
    dx_mask = dgrad_m(dy, weights.down_EFD, sizes)
    assert seen == [("grouped_gemm_dgrad", "mask")]
    assert not np.any(np.asarray(dx_mask[real:], np.float32))
    np.testing.assert_array_equal(np.asarray(dx_mask, np.float32),
                                  np.asarray(dgrad_k(dy, weights.down_EFD, sizes), np.float32))


def test_grouped_gemm_tail_reaches_the_layer_and_the_macro_layer_math():
    """The resolved tail choice is what the MoE layer and the hand-written backward's math call the kernel with."""
    from megascale_jax.model.transformer import Block, Kernels

    cfg = default_config("tiny_cpu")
    block = Block(cfg.model, True, jnp.float32, Kernels(grouped_gemm="pallas", grouped_gemm_tail="mask"), nnx.Rngs(0))
    assert block.ffn.grouped_gemm_tail == "mask" and block.macro_math().grouped_gemm_tail == "mask"
