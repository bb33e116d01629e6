"""benchmarks/bench_cross_entropy.py on the CPU: every variant runs, computes the same loss, and is timed."""
import pytest

from benchmarks import bench_cross_entropy


def test_every_cross_entropy_variant_is_timed_and_agrees_on_the_loss(monkeypatch):
    import functools

    from megascale_jax.model.layers import pallas_cross_entropy
    monkeypatch.setitem(bench_cross_entropy.VARIANTS, "pallas", functools.partial(pallas_cross_entropy, interpret=True))
    monkeypatch.setattr(bench_cross_entropy, "FUSED", bench_cross_entropy.FUSED[:1])   # one tiling: the CPU's time
    row = bench_cross_entropy.bench_shape("tiny", (2, 8, 512), loops=2, interpret=True)
    assert row["errors"] == {}
    fused = [f"fused_c{c}_w{w}" for c, w in bench_cross_entropy.FUSED] + ["fused_two_reads"]
    assert set(row["ms"]) == ({f"{v}/{p}" for v in bench_cross_entropy.VARIANTS for p in ("fwd", "fwd+bwd")} |
                              {f"{f}/fwd+bwd" for f in fused} | {"copy"})
    losses = row["losses"]
    for f in fused:
        assert losses[f] == pytest.approx(losses["optax"], rel=1e-6)
    assert losses["one_pass"] == pytest.approx(losses["optax"], rel=1e-6)
    assert losses["model"] == pytest.approx(losses["optax"], rel=1e-6)
    assert losses["pallas"] == pytest.approx(losses["optax"], rel=1e-6)
    assert row["elementwise_pass_gbps"] > 0


def test_the_one_pass_variant_has_optax_gradients():
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    kl, kt = jax.random.split(jax.random.key(0))
    logits = 8 * jax.random.normal(kl, (2, 8, 300), jnp.float32)
    logits = logits.at[0, :, 200:].set(-jnp.inf)
    targets = jax.random.randint(kt, (2, 8), 0, 200)
    want = jax.value_and_grad(lambda x: jnp.mean(optax.softmax_cross_entropy_with_integer_labels(x, targets)))(logits)
    got = jax.value_and_grad(lambda x: bench_cross_entropy.one_pass_cross_entropy(x, targets))(logits)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-8)
