"""Initialisation scales: every parameter's std is the formula its contraction gives (1/sqrt(fan_in), fan_in
the product of the dims its einsum contracts), and the attention scores at init are O(1), not saturated.

The formula is written out here independently of the model code (STATED_STD), per parameter name, so a
parameter whose call site declares the wrong contracted dims, or a new parameter nobody declared, fails.
Sizes: Mixtral-8x7B's fan-ins are checked on modules that have them but whose other dims are small (hidden
4096 with vocab 256 and expert FFN 64, plus the FFN-14336 down projections on their own), because one real
Mixtral layer's experts are 5.6 GB in float32; the full shapes are checked abstractly (nnx.eval_shape).
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from megascale_jax.config import default_config
from megascale_jax.model.attention import Attention
from megascale_jax.model.layers import TRUNCATED_NORMAL_STD, DenseMLP, param, rope
from megascale_jax.model.moe.experts import SwiGLUExperts
from megascale_jax.model.transformer import Transformer
from megascale_jax.parallel.layouts import LocalAttention

REL_TOL = 0.05   # the brief: every std within 5% of its formula (>= 3.5 standard errors at the smallest size)


def stated_std(path: tuple[str, ...], m) -> float:
    """The std a parameter must have at init: 1/sqrt(its contracted dims), from the config alone.
    Raises for a parameter not listed, so a new parameter needs a stated formula here."""
    name, head_dim = path[-1], m.head_dim
    e = m.moe
    if name == "table_VD":
        return 1.0                                              # embedding: unit-variance inputs
    if name in ("wq_DHK", "wk_DGK", "wv_DGK", "head_DV", "w_DE", "w_gate_EDF", "w_up_EDF", "w_gate_DF",
                "w_up_DF", "shared_gate_D1"):
        return m.hidden ** -0.5                                 # all contract over the hidden size D
    if name == "wo_HKD":
        return (m.num_heads * head_dim) ** -0.5                 # "bshk,hkd": contracts H and K
    if name == "w_down_EFD":
        return e.expert_ffn ** -0.5                             # contracts F, never the expert axis E
    if name == "w_down_FD":
        if "dense_blocks" in path:
            return m.dense_ffn ** -0.5
        return (e.num_shared_experts * (e.shared_expert_ffn or e.expert_ffn)) ** -0.5   # fused shared experts
    if "_bias_" in name:
        return 0.0                                              # q/k/v biases start at zero, as transformers'
    raise AssertionError(f"no stated init std for parameter {'.'.join(path)}: add its formula to stated_std")


def _params(module):
    """{path: array} of a module's parameters (stacked ones keep their leading layers axis)."""
    return {tuple(map(str, p)): v[...] for p, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}


def _assert_std(name, value, want):
    got = float(np.std(np.asarray(value, np.float64)))
    assert abs(got / want - 1) < REL_TOL, f"{name}: std {got:.5g}, formula {want:.5g} ({got / want:.3f}x)"


def _model(cfg):
    return Transformer(cfg.model, param_dtype=jnp.float32, compute_dtype=jnp.float32, remat="none",
                       rngs=nnx.Rngs(0))


# ------------------------------------------------------------------ the param function itself
def test_truncated_normal_constant_is_the_std_of_the_truncated_unit_normal():
    """TRUNCATED_NORMAL_STD from the closed form equals the std computed by integrating the density."""
    x = np.linspace(-2.0, 2.0, 200_001)
    density = np.exp(-x * x / 2)
    variance = np.trapezoid(x * x * density, x) / np.trapezoid(density, x)
    assert TRUNCATED_NORMAL_STD == pytest.approx(math.sqrt(variance), rel=1e-7)
    assert TRUNCATED_NORMAL_STD == pytest.approx(0.8796, abs=1e-4)


@pytest.mark.parametrize("scale", [1.0, 0.02])
def test_param_std_is_the_stated_std_and_the_cut_is_at_two_unit_stds(scale):
    w = np.asarray(param(nnx.Rngs(0), (1 << 20,), (None,), jnp.float32, scale=scale)[...])
    assert np.std(w) == pytest.approx(scale, rel=5e-3)          # 1M samples: standard error ~0.07%
    assert np.abs(w).max() <= 2.0 * scale / TRUNCATED_NORMAL_STD * (1 + 1e-6)
    assert abs(np.mean(w)) < 5e-3 * scale


def test_param_fan_in_is_the_product_of_the_declared_dims():
    rngs = nnx.Rngs(0)
    w = param(rngs, (64, 4, 256), (None, None, None), jnp.float32, fan_in_axes=(0, 1))[...]
    _assert_std("fan_in (0, 1)", w, 256 ** -0.5)
    w = param(rngs, (8, 1024, 32), (None, None, None), jnp.float32, fan_in_axes=(1,))[...]
    _assert_std("fan_in (1,)", w, 1024 ** -0.5)


@pytest.mark.parametrize("kwargs", [{}, {"fan_in_axes": (0,), "scale": 1.0}, {"fan_in_axes": ()},
                                    {"fan_in_axes": (2,)}, {"fan_in_axes": (0, 0)}])
def test_param_requires_exactly_one_declared_scale(kwargs):
    """Nothing is guessed from the shape: without a declaration (or with a malformed one) param refuses."""
    with pytest.raises(ValueError):
        param(nnx.Rngs(0), (4, 4), (None, None), jnp.float32, **kwargs)


# ------------------------------------------------------------------ every parameter of a built model
@pytest.mark.parametrize("overrides", [
    {},                                                                          # tiny_cpu as trained
    {"model.num_layers": 3, "model.num_dense_layers": 1, "model.moe.num_shared_experts": 1,
     "model.tie_embeddings": True},                                              # dense stack, shared experts
    {"model.qkv_bias": True, "model.moe.num_shared_experts": 1, "model.moe.shared_expert_gate": True,
     "model.hidden": 1024},                                                      # Qwen2-MoE (gate: D = 1024 values)
    {"model.head_dim": 64, "model.qk_norm": True},                               # Qwen3-MoE: heads x K != D
], ids=["tiny_cpu", "tiny_cpu_dense_shared_tied", "qwen2_moe_like", "qwen3_moe_like"])
def test_every_parameter_std_matches_its_fan_in_tiny(overrides):
    cfg = default_config("tiny_cpu", **overrides)
    params = _params(_model(cfg))
    for path, value in params.items():
        if path[-1] == "scale":                                 # RMSNorm gains (q/k norms too) start at exactly 1
            assert np.all(np.asarray(value) == 1.0), path
            continue
        if stated_std(path, cfg.model) == 0.0:
            assert np.all(np.asarray(value) == 0.0), path
            continue
        _assert_std(".".join(path), value, stated_std(path, cfg.model))
        # Stacked layers (nnx.vmap): each layer alone has the std, i.e. the layers axis is not a fan-in.
        # (leaves of fewer than 1000 values per layer, the shared expert gate's D x 1, are checked over all
        # layers only: a std measured from n values has a relative sampling error of ~1/sqrt(2n))
        if path[0] in ("dense_blocks", "moe_blocks") and value[0].size >= 1000:
            for layer in value:
                _assert_std(".".join(path) + "[layer]", layer, stated_std(path, cfg.model))


def test_every_parameter_std_matches_its_fan_in_mixtral_8x7b():
    """Every Mixtral-8x7B parameter (names and per-layer shapes from the real config, abstractly) has, in a
    built module with the same contracted dims, the std Mixtral's formula gives."""
    real = default_config("mixtral_8x7b", **{"model.num_layers": 1})
    shapes = {tuple(map(str, p)): v.shape
              for p, v in nnx.to_flat_state(nnx.state(nnx.eval_shape(lambda: _model(real)), nnx.Param))}
    assert shapes[("moe_blocks", "attn", "wq_DHK")] == (1, 4096, 32, 128)
    assert shapes[("moe_blocks", "attn", "wk_DGK")] == (1, 4096, 8, 128)
    assert shapes[("moe_blocks", "ffn", "experts", "w_down_EFD")] == (1, 8, 14336, 4096)

    # Hidden 4096, heads 32 / 8 as Mixtral; vocab and expert FFN small (neither is a fan-in except down's).
    proxy = default_config("mixtral_8x7b", **{"model.num_layers": 1, "model.vocab_size": 256,
                                              "model.moe.expert_ffn": 64})
    params = _params(_model(proxy))
    assert params.keys() == shapes.keys()
    # Mixtral's expert down projection contracts F = 14336: built on its own with a small D.
    params[("moe_blocks", "ffn", "experts", "w_down_EFD")] = \
        SwiGLUExperts(1, 64, real.model.moe.expert_ffn, jnp.float32, nnx.Rngs(1)).w_down_EFD[...]
    for path, value in params.items():
        if path[-1] == "scale":
            assert np.all(np.asarray(value) == 1.0), path
            continue
        _assert_std(".".join(path), value, stated_std(path, real.model))


def test_dense_mlp_std_at_mixtral_fan_ins():
    """The dense SwiGLU (dense layers, shared experts) at D = 4096 and F = 14336, each with a small other dim."""
    wide_in = DenseMLP(4096, 64, jnp.float32, nnx.Rngs(0))
    _assert_std("w_gate_DF", wide_in.w_gate_DF[...], 4096 ** -0.5)
    _assert_std("w_up_DF", wide_in.w_up_DF[...], 4096 ** -0.5)
    _assert_std("w_down_FD", DenseMLP(64, 14336, jnp.float32, nnx.Rngs(1)).w_down_FD[...], 14336 ** -0.5)


# ------------------------------------------------------------------ attention scale at init
@pytest.mark.parametrize("dim,heads,kv_heads,theta", [(128, 4, 2, 10_000.0), (4096, 32, 8, 1e6)],
                         ids=["tiny_cpu", "mixtral_8x7b"])
def test_attention_scores_and_output_are_order_one_at_init(dim, heads, kv_heads, theta):
    """Scores q.k/sqrt(K) at init on unit-RMS inputs have std ~1 (softmax not saturated) and the attention
    output has RMS <= 1.

    Scores: x has unit-RMS rows (an RMSNorm output), W_q and W_k have independent entries of variance 1/D, so
    each q and k entry has variance |x|^2 / D = 1; RoPE rotates (q_2i, q_2i+1) pairs, keeping that. q and k
    come from independent weights: E[q_j k_j] = 0, E[q_j^2 k_j^2] = 1, and the K products are uncorrelated,
    so q.k/sqrt(K) has variance K / K = 1. Expected std 1; tolerance 10% (the estimate over B*H*S^2 scores
    and one weight draw is within ~2% here; the bug gave 35 at tiny shapes and ~200 at Mixtral's).

    Output: out_t = sum_s p_ts v_s with v entries of variance 1 and p a causal softmax row, so
    E[out_t^2] = E[sum_s p_ts^2] lies in [1/(t+1), 1] (uniform p to one-hot p); W_o with fan-in H*K keeps
    the variance. So mean_t 1/(t+1) <= RMS^2 <= 1 (10% slack each way); the bug gave ~17 at Mixtral shapes."""
    batch, seq = 2, 128
    m = default_config("tiny_cpu", **{"model.hidden": dim, "model.num_heads": heads, "model.num_kv_heads": kv_heads,
                                      "model.rope_theta": theta}).model
    attn = Attention(m, jnp.float32, nnx.Rngs(0), implementation="xla")
    x = jax.random.normal(jax.random.key(1), (batch, seq, dim))
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True))           # unit RMS per token
    positions = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
    q = rope(jnp.einsum("bsd,dhk->bshk", x, attn.wq_DHK[...]), positions, theta)
    k = rope(jnp.einsum("bsd,dgk->bsgk", x, attn.wk_DGK[...]), positions, theta)
    k = jnp.repeat(k, heads // kv_heads, axis=2)                             # query head h reads kv h // group
    scores = jnp.einsum("bshk,bthk->bhst", q, k) / math.sqrt(dim // heads)
    assert float(jnp.std(q)) == pytest.approx(1.0, rel=0.05)
    assert float(jnp.std(k)) == pytest.approx(1.0, rel=0.05)
    assert float(jnp.std(scores)) == pytest.approx(1.0, rel=0.10)

    out = attn(x, LocalAttention())
    rms = float(jnp.sqrt(jnp.mean(out * out)))
    lower = math.sqrt(float(np.mean(1.0 / np.arange(1, seq + 1))))
    assert 0.9 * lower < rms < 1.1, (rms, lower)
