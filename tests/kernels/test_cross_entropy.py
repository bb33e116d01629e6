"""pallas_kernels/cross_entropy.py against its plain twin, the model's XLA cross-entropy (model/layers.py):
values and bf16 logit gradients in interpret mode on the CPU (vocabularies below, at and across the column
chunk, masked -inf columns, a whole chunk masked, a target outside the vocabulary), the same compiled on the
GPU (`-m gpu`, MEGASCALE_TEST_GPU=1) at the configs' vocabularies, and the model's loss with either."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from megascale_jax.model.layers import (CrossEntropyImpl, cross_entropy, pallas_cross_entropy,
                                        pallas_head_cross_entropy, resolve_cross_entropy)
from pallas_kernels.cross_entropy import CHUNK, cross_entropy_per_token
from tests.kernels.triton_lowering import MODEL_TRACES, lowered_train_step_for_cuda


def _case(tokens, vocab, seed=0, scale=8.0):
    kl, kt = jax.random.split(jax.random.key(seed))
    logits = (scale * jax.random.normal(kl, (1, tokens, vocab), jnp.float32)).astype(jnp.bfloat16)
    return logits, jax.random.randint(kt, (1, tokens), 0, vocab)


def _both(logits, targets, interpret):
    def xla(x):
        return cross_entropy(x.astype(jnp.float32), targets)

    def ours(x):
        return pallas_cross_entropy(x, targets, interpret=interpret)
    return jax.value_and_grad(ours)(logits), jax.value_and_grad(xla)(logits)


def _check(logits, targets, interpret=True):
    (v, d), (v_want, d_want) = _both(logits, targets, interpret)
    assert d.dtype == jnp.bfloat16
    np.testing.assert_allclose(float(v), float(v_want), rtol=2e-6)
    d, d_want = np.asarray(d, np.float32), np.asarray(d_want, np.float32)
    # both round the same float32 gradient to bf16: at most one bf16 step apart (2^-8 relative)
    np.testing.assert_allclose(d, d_want, rtol=2 ** -7, atol=1e-9)
    assert np.all(np.isfinite(d))


@pytest.mark.parametrize("vocab", [300, CHUNK, CHUNK + 1, 3 * CHUNK - 5])
def test_interpret_matches_the_xla_cross_entropy(vocab):
    _check(*_case(3, vocab))


def test_interpret_masked_columns_and_a_whole_masked_chunk():
    logits, targets = _case(4, 3 * CHUNK)
    logits = logits.at[0, :, : CHUNK + 7].set(-jnp.inf)          # the first chunk and more: all -inf
    targets = targets.at[0].set(CHUNK + 7 + targets[0] % 100)
    logits = logits.at[0, 1, 2 * CHUNK:].set(-jnp.inf)
    _check(logits, targets)


def test_interpret_an_infinite_logit_gives_the_plain_forms_infinite_loss():
    """+inf in a row: log Z and the loss are +inf in both forms (no inf - inf inside the kernel's shift); the other
    rows are unchanged."""
    logits, targets = _case(3, 3000)
    logits = logits.at[0, 1, 2500].set(jnp.inf)
    ours = cross_entropy_per_token(logits[0], targets[0], True)
    want = optax.softmax_cross_entropy_with_integer_labels(logits[0].astype(jnp.float32), targets[0])
    assert float(ours[1]) == float(want[1]) == float("inf")
    np.testing.assert_allclose(np.asarray(ours)[[0, 2]], np.asarray(want)[[0, 2]], rtol=2e-6)


def test_chunk_must_be_a_power_of_two():
    logits, targets = _case(2, 300)
    with pytest.raises(ValueError, match="chunk=1000 must be a power of 2"):
        cross_entropy_per_token(logits[0], targets[0], True, 1000)


def test_interpret_target_outside_the_vocabulary_is_nan():
    logits, targets = _case(3, 500)
    for bad in (500, -1):
        loss = cross_entropy_per_token(logits[0], targets[0].at[1].set(bad), True)
        assert np.isnan(float(loss[1])) and np.all(np.isfinite(np.asarray(loss)[[0, 2]]))


def test_resolution_by_backend_and_plan():
    assert resolve_cross_entropy("auto", backend="gpu", partitioned_by_xla=False) == \
        CrossEntropyImpl.PALLAS_FUSED_ONE_READ
    assert resolve_cross_entropy("pallas", backend="gpu", partitioned_by_xla=False) == CrossEntropyImpl.PALLAS
    assert resolve_cross_entropy("auto", backend="gpu", partitioned_by_xla=True) == CrossEntropyImpl.XLA
    assert resolve_cross_entropy("auto", backend="cpu", partitioned_by_xla=False) == CrossEntropyImpl.XLA
    assert resolve_cross_entropy("xla", backend="gpu", partitioned_by_xla=False) == CrossEntropyImpl.XLA
    with pytest.raises(ValueError, match="kernels.cross_entropy='pallas'.*backend 'cpu'"):
        resolve_cross_entropy("pallas", backend="cpu", partitioned_by_xla=False)
    with pytest.raises(ValueError, match="XLA plan on several devices"):
        resolve_cross_entropy("pallas", backend="gpu", partitioned_by_xla=True)


@pytest.mark.parametrize("impl, tied", [("pallas", False), ("pallas_fused", False), ("pallas_fused", True),
                                        ("pallas_fused_one_read", False), ("pallas_fused_one_read", True)])
def test_the_models_loss_and_gradients_with_the_pallas_cross_entropy(monkeypatch, impl, tied):
    """The tiny model in bf16 compute: kernels.cross_entropy 'pallas', 'pallas_fused' and 'pallas_fused_one_read'
    (interpret mode; the fused heads with the untied head and the tied table) against 'xla', the loss and every
    parameter's gradient."""
    from flax import nnx

    from megascale_jax import step
    from megascale_jax.config import default_config
    from megascale_jax.model import transformer
    from megascale_jax.parallel.layouts import local_layout

    monkeypatch.setattr(transformer, "pallas_cross_entropy", functools.partial(pallas_cross_entropy, interpret=True))
    monkeypatch.setattr(transformer, "pallas_head_cross_entropy",
                        functools.partial(pallas_head_cross_entropy, interpret=True))
    cfg = default_config("tiny_cpu", num_devices=8, **{"train.compute_dtype": "bfloat16",
                                                      "model.tie_embeddings": tied})
    layout = local_layout(num_experts=cfg.model.moe.num_experts)
    tokens = jax.random.randint(jax.random.key(3), (2, 33), 0, cfg.model.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    results = {}
    for choice in ("xla", impl):
        model = step.new_model(cfg, transformer.Kernels(cross_entropy=choice))
        graphdef, params = nnx.split(model)

        def loss(p):
            return nnx.merge(graphdef, p).loss(batch, layout)[0]
        results[choice] = jax.value_and_grad(loss)(params)
    (v, g), (v_want, g_want) = results[impl], results["xla"]
    assert float(v) == pytest.approx(float(v_want), rel=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g), jax.tree.leaves(g_want)):
        scale = float(np.abs(b).max())
        np.testing.assert_allclose(a, b, atol=2e-2 * scale, err_msg=jax.tree_util.keystr(path))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, vocab", [(512, 102400), (1024, 32000), (256, 151936)])
def test_gpu_matches_the_xla_cross_entropy(tokens, vocab):
    _check(*_case(tokens, vocab, scale=4.0), interpret=False)


def _inside_shard_map(interpret: bool, check_vma: bool):
    """The loss and logits gradient computed per device inside shard_map, as the manual plans' step runs it,
    against the XLA form outside."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("data",))
    logits, targets = _case(16 * n, 3000)
    logits, targets = logits.reshape(n, 16, 3000), targets.reshape(n, 16)
    v_want, d_want = jax.value_and_grad(lambda x: cross_entropy(x.astype(jnp.float32), targets))(logits)
    logits, targets = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (logits, targets))

    def per_device(x, t):   # this device's mean and its gradient: no collective in the differentiated part
        v, d = jax.value_and_grad(lambda x: pallas_cross_entropy(x, t, interpret=interpret))(x)
        return v[None], d
    run = jax.shard_map(per_device, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=(P("data"), P("data")),
                        check_vma=check_vma)
    v, d = jax.jit(run)(logits, targets)
    v, d = jnp.mean(v), np.asarray(d, np.float32) / n   # the global mean of equal-sized shards, and its gradient
    np.testing.assert_allclose(float(v), float(v_want), rtol=2e-6)
    np.testing.assert_allclose(d, np.asarray(d_want, np.float32), rtol=2 ** -7, atol=1e-9)


def test_interpret_inside_shard_map():
    """check_vma off: jax's Pallas interpreter loses the varying type of its grid loop's carry inside a checked
    shard_map (an interpreter limitation); the compiled kernel's typing is checked on the GPU below."""
    _inside_shard_map(interpret=True, check_vma=False)


@pytest.mark.gpu
def test_gpu_inside_a_checked_shard_map():
    _inside_shard_map(interpret=False, check_vma=True)


def test_the_train_step_with_the_pallas_cross_entropy_lowers_for_the_gpu(monkeypatch):
    """The manual SP+EP step with kernels.cross_entropy='pallas', lowered for CUDA on the CPU: both kernels become
    Triton calls inside the step's checked shard_map. This is where the first GPU run failed (an output with no
    varying type)."""
    text = lowered_train_step_for_cuda(monkeypatch, cross_entropy="pallas")
    assert text.count("__gpu$xla.gpu.triton") == 2 * MODEL_TRACES   # the forward and the backward kernel
