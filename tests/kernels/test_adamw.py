"""pallas_kernels/adamw.py: the per-layer AdamW kernel equals its arithmetic run by XLA and optax's chain (interpret
mode on the CPU, compiled on the GPU); the train step with kernels.adamw='pallas' equals the optax step."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pallas_kernels import adamw

B1, B2, WD = 0.9, 0.95, 0.1


def _stack(layers=3, shape=(5, 37), moments=jnp.float32, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    p = jax.random.normal(k[0], (layers, *shape), jnp.float32)
    m = (jax.random.normal(k[1], p.shape) * 0.1).astype(moments)
    v = (jax.random.uniform(k[2], p.shape) * 0.01).astype(moments)
    g = jax.random.normal(k[3], p.shape).astype(jnp.bfloat16)
    return p, m, v, g


def _optax_reference(p, m, v, g, count, lr, max_norm=None):
    """optax's adamw chain (as optim.make_optimizer builds it) on the whole stack, from float32 moments."""
    chain = optax.chain(optax.scale_by_adam(B1, B2), optax.add_decayed_weights(WD),
                        optax.scale_by_learning_rate(lambda _: lr))
    state = chain.init(p)
    state = (state[0]._replace(count=jnp.int32(count), mu=m.astype(jnp.float32), nu=v.astype(jnp.float32)),
             *state[1:])
    g = g.astype(jnp.float32)
    if max_norm is not None:
        g = optax.clip_by_global_norm(max_norm).update(g, optax.EmptyState())[0]
    updates, state = chain.update(g, state, p)
    return optax.apply_updates(p, updates), state[0].mu, state[0].nu


def _kernel_chain(p, m, v, g, count, lr, max_norm=None, **kw):
    norm = jnp.sqrt(jnp.sum(jnp.square(g.astype(jnp.float32))))
    bias1, bias2 = (1 - B1 ** jnp.int32(count + 1)), (1 - B2 ** jnp.int32(count + 1))
    scalars = jnp.stack([jnp.float32(lr), bias1, bias2, norm, jnp.float32(max_norm or 1.0),
                         jnp.float32(max_norm is not None)])
    copy = jnp.zeros(p.shape, jnp.bfloat16)
    for layer in range(p.shape[0]):
        p, m, v, copy = adamw.adamw_layer_update(scalars, g[layer], p, m, v, copy, layer=layer, b1=B1, b2=B2,
                                                 eps=1e-8, weight_decay=WD, **kw)
    return p, m, v, copy


def _check(kw, moments=jnp.float32, max_norm=None, shape=(5, 37)):
    p, m, v, g = _stack(moments=moments, shape=shape)
    want_p, want_m, want_v = _optax_reference(p, m, v, g, count=4, lr=3e-3, max_norm=max_norm)
    got_p, got_m, got_v, copy = jax.jit(functools.partial(_kernel_chain, count=4, lr=3e-3, max_norm=max_norm,
                                                          **kw))(p, m, v, g)
    np.testing.assert_allclose(got_p, want_p, rtol=1e-6, atol=1e-7)
    tol = dict(rtol=1e-2, atol=1e-6) if moments == jnp.bfloat16 else dict(rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(got_m.astype(jnp.float32), want_m, **tol)
    np.testing.assert_allclose(got_v.astype(jnp.float32), want_v, **tol)
    assert got_m.dtype == moments and got_v.dtype == moments
    np.testing.assert_array_equal(copy, got_p.astype(jnp.bfloat16))   # the copy is the new parameter, rounded
    assert not np.allclose(got_p, p)   # the update moved every row


@pytest.mark.parametrize("max_norm", [None, 1.0])
@pytest.mark.parametrize("moments", [jnp.float32, jnp.bfloat16])
def test_interpret_kernel_equals_optax(moments, max_norm):
    """Layers of 5 x 37 in tiles of 1 x 64: a masked tail in every row."""
    _check(dict(interpret=True, block=64), moments=moments, max_norm=max_norm)


@pytest.mark.parametrize("shape, block", [((4, 3, 24), 128),    # tiles of 4 rows x 32: 12 rows over 3 tiles
                                          ((3, 2, 200), 128),   # a row in two column blocks, the second partial
                                          ((37,), 64)])         # a 1-D layer: one row, the tile's others masked
def test_interpret_tiles_of_stacked_rows_equal_optax(shape, block):
    """An expert weight's layer [E, D, F]: the leading axes unravelled from the tile's rows, the last one a column
    block; every element updated once, none outside the layer."""
    _check(dict(interpret=True, block=block), max_norm=1.0, shape=shape)


def test_the_stacked_arrays_reach_the_kernel_unreshaped():
    """A reshape of an aliased operand makes XLA copy the donated state at both ends of the in-place call; the
    kernel takes the stacked arrays as they are (its operands are the function's own arguments)."""
    p, m, v, g = _stack(shape=(2, 8, 24))
    copy = p.astype(jnp.bfloat16)
    jaxpr = jax.make_jaxpr(functools.partial(adamw.adamw_layer_update, layer=1, b1=B1, b2=B2, eps=1e-8,
                                             weight_decay=WD))(jnp.ones(6), g[1], p, m, v, copy).jaxpr
    (call,) = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
    assert call.invars[2:] == jaxpr.invars[2:], [e.primitive.name for e in jaxpr.eqns]
    assert call.outvars == jaxpr.outvars


@pytest.mark.gpu
@pytest.mark.parametrize("moments", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(64, 1408 + 3), (8, 256, 1408)])
def test_gpu_kernel_equals_optax(moments, shape):
    _check({}, moments=moments, max_norm=1.0, shape=shape)


# ------------------------------------------------------------------------------------------ the train step
@pytest.fixture
def interpreted(monkeypatch):
    """The kernel in interpret mode where the updater reaches it (megascale_jax/updaters.py `_adamw_kernels`)."""
    from megascale_jax import updaters

    class Interpreted:
        adamw_math = staticmethod(adamw.adamw_math)
        adamw_layer_update = staticmethod(functools.partial(adamw.adamw_layer_update, interpret=True))
    monkeypatch.setattr(updaters, "_adamw_kernels", lambda: Interpreted)


def _steps_side_by_side(monkeypatch, steps=2, devices=1, stacks=("moe_blocks",), gradient_rtol=0.0, **overrides):
    """tiny_cpu in bf16 with both layers unrolled and no warmup (every step moves the parameters), trained `steps`
    steps by the optax update; at every step the kernel's update (kernels.adamw forced to 'pallas': the resolver
    refuses it off the GPU) runs from the same state, and each pair of (metrics, new state) is checked equal. From
    the same state: a parameter whose last float32 bit differs may round to another bf16 copy, which would then move
    the next gradients apart."""
    import dataclasses

    from megascale_jax import step
    from megascale_jax.config import default_config

    cfg = default_config("tiny_cpu", num_devices=devices, **{"train.compute_dtype": "bfloat16", "train.scan_unroll": 2,
                                                            "train.warmup_steps": 0, **overrides})
    resolve, trainers = step.resolve_kernels, {}
    for impl in ("xla", "pallas"):
        monkeypatch.setattr(step, "resolve_kernels",
                            lambda c, p, impl=impl: dataclasses.replace(resolve(c, p), adamw=impl))
        trainers[impl] = step.build(cfg, devices=jax.devices()[:devices])
    assert trainers["pallas"].updater.layer_kernel.stacks == stacks
    state = step.create_state(trainers["xla"])
    train_steps = {impl: step.make_train_step(t) for impl, t in trainers.items()}
    rng = np.random.default_rng(0)
    for _ in range(steps):
        tokens = jnp.asarray(rng.integers(0, cfg.model.vocab_size, (cfg.train.global_batch, cfg.train.seq_len)),
                             jnp.int32)
        batch = {"inputs": tokens, "targets": tokens}
        (want, want_metrics), (got, got_metrics) = (train_steps[impl](jax.tree.map(jnp.copy, state), batch)
                                                    for impl in ("xla", "pallas"))
        assert float(want_metrics["lr"]) > 0
        _assert_same_step(state, want, want_metrics, got, got_metrics, gradient_rtol)
        state = want


def _assert_same_step(start, want, want_metrics, got, got_metrics, gradient_rtol):
    """Same loss, norm, optimizer state and parameter updates (to float32 rounding, or to `gradient_rtol` where the
    gradients themselves may differ by that); each run's compute copies are its own new parameters rounded."""
    from megascale_jax import step
    from megascale_jax.model.transformer import gemm_weight_copies

    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(got_metrics[key], want_metrics[key], rtol=max(1e-6, gradient_rtol))
    for key in ("params", "opt_state", "step", "nonfinite"):
        for x, y, x0 in zip(jax.tree.leaves(got[key]), jax.tree.leaves(want[key]), jax.tree.leaves(start[key]),
                            strict=True):
            stored = x.dtype
            x, y, x0 = np.asarray(x, np.float32), np.asarray(y, np.float32), np.asarray(x0, np.float32)
            # A stored float32 parameter is its own value rounded: one program's fused multiply-add (XLA:CPU chooses
            # per machine and per fusion) moves it by one unit in its last place, however small the update.
            rounding = np.spacing(np.maximum(np.abs(x0), np.abs(y))) if key == "params" else 0.0
            if key == "params":   # the updates themselves: a parameter moves by ~lr, far under its own size
                x, y = x - x0, y - x0
            # bfloat16 moments: a float32 result one bit apart may round to the neighbouring bfloat16 value.
            # Gradients apart by gradient_rtol: by that fraction of the leaf's largest value (a sum of microbatches
            # that cancel keeps each one's rounding).
            scale = np.abs(y).max()
            rtol, atol = ((max(2 ** -7, gradient_rtol), max(1e-4, gradient_rtol) * scale) if stored == jnp.bfloat16
                          else (max(2e-6, gradient_rtol),
                                (1e-6 if key == "params" else 0) * scale + gradient_rtol * scale + 1e-12))
            apart = np.abs(x - y) > atol + rtol * np.abs(y) + rounding
            if gradient_rtol and key == "params":
                # Adam's first steps move an element by ~lr * sign(its gradient): where the gradient is ~0, a last-bit
                # difference flips the direction. So: all but one element in 10^3 within the tolerance (a wrong
                # learning rate, bias correction or clip would move them all)
                assert apart.mean() <= 1e-3, (key, apart.mean())
            else:
                worst = np.unravel_index(np.argmax(np.abs(x - y) - rtol * np.abs(y) - rounding), x.shape)
                assert not apart.any(), (key, x.shape, f"{apart.mean():.2%} apart", worst, x[worst], y[worst])
    # In the CPU interpreter XLA may compute the kernel's new parameter once for the copy and once for the stored
    # value, one float32 bit apart (a fused multiply-add in one fusion only); where that bit decides the rounding the
    # copy is the neighbouring bf16 value: allowed for one element in 10^4, one bf16 step at most. On the GPU the
    # kernel rounds the very value it stores.
    for name, state in (("optax", want), ("kernel", got)):
        for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(state[step.COPIES])[0],
                                jax.tree.leaves(gemm_weight_copies(state["params"], jnp.bfloat16)), strict=True):
            x, y, where = np.asarray(x, np.float32), np.asarray(y, np.float32), f"{name} {jax.tree_util.keystr(path)}"
            apart = x != y
            assert apart.mean() <= 1e-4, where
            np.testing.assert_allclose(x[apart], y[apart], rtol=2 ** -7, err_msg=where)


def test_train_steps_with_the_kernel_equal_optax(interpreted, monkeypatch):
    """Clipped at every step (grad_clip under the norm): parameters, moments, counts and the compute copies equal
    the optax step's."""
    _steps_side_by_side(monkeypatch, **{"train.grad_clip": 0.05})


def test_bfloat16_moments_microbatches_and_a_dense_stack(interpreted, monkeypatch):
    """bfloat16 moments, two microbatches (the pieces accumulated in float32), a leading dense layer (its own
    unrolled stack) and no clipping. Looser by a bf16 step: XLA may keep a piece's weight gradient in float32 where
    it feeds the accumulation directly (xla_allow_excess_precision, on by default), which the stacked gradient's
    concatenation rounds to bf16 first (checked: with the flag off both agree to float32 rounding)."""
    _steps_side_by_side(monkeypatch, stacks=("dense_blocks", "moe_blocks"), gradient_rtol=2 ** -6,
                        **{"train.adam_moments_dtype": "bfloat16", "train.microbatches": 2, "train.grad_clip": 0.0,
                           "model.num_layers": 3, "model.num_dense_layers": 1})


@pytest.fixture
def xla_twin(monkeypatch):
    """The kernel's plain twin (`adamw_layer_update_xla`, same contract) where the updater reaches the kernel: the
    updater's own logic under a mesh, where jax's Pallas interpreter cannot run inside the step's checked shard_map
    (it loses the varying type of its grid loop's carry; the kernel's typing there is checked by the CUDA lowering
    below and on the GPU)."""
    from megascale_jax import updaters

    class Twin:
        adamw_math = staticmethod(adamw.adamw_math)
        adamw_layer_update = staticmethod(adamw.adamw_layer_update_xla)
    monkeypatch.setattr(updaters, "_adamw_kernels", lambda: Twin)


@pytest.mark.parametrize("overrides", [
    # data 2 x intra 2: the pieces reduced over 'data', the experts' part of the norm summed over 'intra'
    {"parallel.intra": 2, "train.grad_clip": 0.05, "devices": 4},
    # data 1 x intra 2, as one GPU runs it: the update inside the skip cond (its other branch returns the state as
    # it was: both typed alike); a compressed exchange, which rounds the gradient even on one rank; the macro layer
    {"parallel.intra": 2, "train.nonfinite": "skip", "parallel.grad_comm": "fp8", "parallel.moe_layer": "macro",
     "devices": 2},
], ids=["data2-intra2", "data1-skip-fp8-macro"])
def test_per_device(xla_twin, monkeypatch, overrides):
    overrides = dict(overrides)
    _steps_side_by_side(monkeypatch, devices=overrides.pop("devices"), plan_recipe="megascale", **overrides)


def test_the_train_step_with_the_kernel_lowers_for_the_gpu(monkeypatch):
    """Inside the manual step's checked shard_map (intra 4, 2 microbatches) the kernel is typed and lowered for
    CUDA: one call per layer for each of the MoE stack's GEMM weights."""
    from tests.kernels.triton_lowering import lowered_train_step_for_cuda

    text = lowered_train_step_for_cuda(monkeypatch, {"train.scan_unroll": 2}, adamw="pallas")
    gemm_weights_in_the_stack = 7   # wq, wk, wv, wo and the experts' gate, up, down
    assert text.count('"adamw_layer_update"') == 2 * gemm_weights_in_the_stack


def test_kernel_equals_its_xla_twin():
    p, m, v, g = _stack()
    scalars = jnp.array([3e-3, 0.3, 0.05, 20.0, 1.0, 1.0], jnp.float32)
    copy = jnp.zeros(p.shape, jnp.bfloat16)
    hyper = dict(layer=1, b1=B1, b2=B2, eps=1e-8, weight_decay=WD)
    got = adamw.adamw_layer_update(scalars, g[1], p, m, v, copy, interpret=True, block=64, **hyper)
    want = adamw.adamw_layer_update_xla(scalars, g[1], p, m, v, copy, **hyper)
    for x, y in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=1e-6, atol=1e-8)
    np.testing.assert_array_equal(got[0][0], p[0])   # rows other than `layer` untouched
    np.testing.assert_array_equal(got[3][2], copy[2])


def test_resolution():
    from megascale_jax.updaters import resolve_adamw

    ok = dict(backend="gpu", partitioned_by_xla=False, zero1=False, copies=True, float32_params=True,
              unrolled_stacks=("moe_blocks",), microbatches=1)
    assert resolve_adamw("auto", **ok) == "pallas"
    assert resolve_adamw("auto", **{**ok, "microbatches": 2}) == "xla"       # accumulated: no concatenation to remove
    assert resolve_adamw("pallas", **{**ok, "microbatches": 2}) == "pallas"
    assert resolve_adamw("pallas", **ok) == "pallas"
    assert resolve_adamw("xla", **ok) == "xla"
    for why, change in [("backend 'cpu'", dict(backend="cpu")), ("zero1", dict(zero1=True)),
                        ("no compute-dtype copies", dict(copies=False)),
                        ("param_dtype other than float32", dict(float32_params=False)),
                        ("train.scan_unroll", dict(unrolled_stacks=())),
                        ("the XLA plan on several devices", dict(partitioned_by_xla=True))]:
        assert resolve_adamw("auto", **{**ok, **change}) == "xla", why   # auto falls back where pallas is refused
        with pytest.raises(ValueError, match=why):
            resolve_adamw("pallas", **{**ok, **change})


def test_no_concatenation_of_the_stacked_gradients(xla_twin, monkeypatch):
    """What the pieces are for: in the compiled step (CPU, the kernel's XLA twin in its place) the optax update
    concatenates each stacked GEMM weight's per-layer gradients into a bf16 [2, ...] array; with kernels.adamw=
    'pallas' no such concatenation is left."""
    import dataclasses

    from megascale_jax import step
    from megascale_jax.config import default_config

    cfg = default_config("tiny_cpu", num_devices=1, **{"train.compute_dtype": "bfloat16", "train.scan_unroll": 2})
    resolve, concatenated = step.resolve_kernels, {}
    for impl in ("xla", "pallas"):
        monkeypatch.setattr(step, "resolve_kernels",
                            lambda c, p, impl=impl: dataclasses.replace(resolve(c, p), adamw=impl))
        trainer = step.build(cfg, devices=jax.devices()[:1])
        stacked = {f"bf16[{','.join(map(str, leaf.shape))}]"
                   for leaf in jax.tree.leaves(trainer.abstract_state[step.COPIES]["moe_blocks"])}
        tokens = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.train.seq_len), jnp.int32)
        text = step.make_train_step(trainer).lower(trainer.abstract_state, {"inputs": tokens, "targets": tokens}
                                                   ).compile().as_text()
        concatenated[impl] = {line.split("=")[1].split("{")[0].strip() for line in text.splitlines()
                              if " concatenate(" in line} & stacked
    assert len(concatenated["xla"]) >= 4, concatenated   # experts [2, 8, 128, 128], attention projections
    assert not concatenated["pallas"], concatenated
