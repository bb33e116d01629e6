"""The training step: a gradient source (megascale_jax/gradients.py) composed with an updater, built once.

    step = updater(gradient_source(params, batch))

  gradient source  autodiff | accumulate(train.microbatches), differentiated w.r.t. the GEMM weights'
                       compute-dtype copies, which the state keeps (`compute_copies`)
                   | pipeline(parallel.pipeline_schedule)
  updater          (megascale_jax/updaters.py) replicated(grad_comm): reduce the gradient over 'data' (fp32
                       all-reduce, or bf16 / fp8 all-to-all + local fp32 sum + all-gather), clip by the global
                       norm, AdamW on each device's own shards of the parameters and optimizer state (optax's, or
                       with kernels.adamw='pallas' the unrolled stacks' GEMM weights per layer by a Pallas kernel
                       from gradients that autodiff returns per layer: gradients.LayerPieces);
                   zero1(grad_comm): parallel/zero.py (compressed reduce-scatter, this rank's slice of the
                       optimizer state, all-gather of the updated parameters).
Any source works with any updater. Under the manual plan and with a pipeline the whole step runs per
device inside ONE `jax.shard_map` over the mesh (the layout's collectives run there); under the XLA plan
it runs in the global view and the compiler partitions it.

`build(cfg)` plans the mesh, resolves the kernels, and derives the state's shapes and shardings from the
model's logical axes; `create_state` initialises the state directly with those shardings.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from megascale_jax import gradients
from megascale_jax.config import Config, DType
from megascale_jax.config_checks import ConfigError
from megascale_jax.model.attention import resolve_attention_impl
from megascale_jax.model.layers import resolve_cross_entropy
from megascale_jax.model.moe.experts import (resolve_dense_swiglu, resolve_grouped_gemm, resolve_grouped_gemm_tail,
                                             resolve_swiglu)
from megascale_jax.model.transformer import Kernels, Transformer, gemm_weight_copies, gemm_weights_of, \
    unrolled_stacks, with_gemm_weight_copies
from megascale_jax.optim import NonFinite, flat_decay_mask, learning_rate_schedule, make_flat_optimizer, \
    make_optimizer
from megascale_jax.parallel.collectives import varying_axes
from megascale_jax.parallel.expert_runs import DispatchExchange
from megascale_jax.parallel.layouts import Layout, make_layout
from megascale_jax.parallel.permute import PermuteImpl, resolve_permute
from megascale_jax.parallel.plan import DATA, INTRA, PIPE, FFNPlan, MoELayer, ParallelPlan, PlanKind
from megascale_jax.parallel.ring_attention import AttentionExchange
from megascale_jax.parallel.zero import OptimizerSharding, Zero1
from megascale_jax.updaters import AdamWImpl, LayerKernelAdamW, Replicated, ZeroOne, resolve_adamw

DTYPES = {DType.FLOAT32: jnp.float32, DType.BFLOAT16: jnp.bfloat16}

# The state's entry for the GEMM weights' compute-dtype copies. Why kept in the state: the update that writes the
# float32 parameters writes their copies in the same pass (XLA fuses the cast into AdamW's one pass per parameter),
# where casting them at the start of the next step is one more read of every float32 parameter (on an H100, 2.6 ms of
# deepseekmoe_small's 8 x 4096-token step for its 1.68 B parameters). The step's peak memory is unchanged (the cast
# copies were live through the forward and backward anyway); between steps they cost 2 bytes a parameter. Derived,
# so never checkpointed: `checkpointed` drops them and `resumed` casts them again.
COPIES = "compute_copies"

# ZeRO-1's flat vectors are padded to a multiple of this, so for every data-parallel size dividing 64 the state
# has the same global shapes and a checkpoint restores onto another data-parallel size (<= 8192 zeros a bucket).
ZERO_PAD_MULTIPLE = 64 * 128


def resolve_kernels(cfg: Config, plan: ParallelPlan) -> Kernels:
    """The kernel choices, resolved once for this backend, dtype and the per-device expert shapes."""
    backend, compute = jax.default_backend(), DTYPES[cfg.train.compute_dtype]
    tp_experts = plan.kind == PlanKind.MANUAL and plan.ffn == FFNPlan.TP
    ffn = cfg.model.moe.expert_ffn // (plan.intra if tp_experts else 1)
    grouped_gemm = resolve_grouped_gemm(cfg.kernels.grouped_gemm, backend=backend, dtype=compute,
                                        dim=cfg.model.hidden, ffn=ffn)
    # experts split over ranks: each rank's expert GEMMs run on a receive buffer sized for the worst routing
    expert_parallel = plan.kind == PlanKind.MANUAL and plan.ffn == FFNPlan.EP and plan.intra > 1
    try:
        partitioned_by_xla = not plan.per_device and plan.num_devices > 1
        tail = resolve_grouped_gemm_tail(cfg.kernels.grouped_gemm_tail, grouped_gemm=grouped_gemm,
                                         expert_parallel=expert_parallel)
        why = dict(backend=backend, partitioned_by_xla=partitioned_by_xla, grouped_gemm=grouped_gemm, ffn=ffn,
                   remat=cfg.train.remat, macro_layer=cfg.parallel.moe_layer == MoELayer.MACRO)
        swiglu = resolve_swiglu(cfg.kernels.swiglu, grouped_gemm_tail=tail, **why)
        dense_swiglu = resolve_dense_swiglu(cfg.kernels.swiglu, **why)
        cross_entropy = resolve_cross_entropy(cfg.kernels.cross_entropy, backend=backend,
                                              partitioned_by_xla=partitioned_by_xla)
        permute = resolve_permute(cfg.kernels.permute, backend=backend, partitioned_by_xla=partitioned_by_xla)
        adamw = resolve_adamw(cfg.kernels.adamw, backend=backend, partitioned_by_xla=partitioned_by_xla,
                              zero1=cfg.parallel.optimizer_sharding == OptimizerSharding.ZERO1,
                              copies=_keeps_copies(cfg, plan),
                              float32_params=DTYPES[cfg.train.param_dtype] == jnp.float32,
                              unrolled_stacks=unrolled_stacks(cfg.model, cfg.train.scan_unroll),
                              microbatches=cfg.train.microbatches)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return Kernels(attention=resolve_attention_impl(cfg.kernels.attention, backend=backend, compute_dtype=compute),
                   grouped_gemm=grouped_gemm, grouped_gemm_tail=tail, swiglu=swiglu, dense_swiglu=dense_swiglu,
                   cross_entropy=cross_entropy, permute=permute, adamw=adamw)


def _keeps_copies(cfg: Config, plan: ParallelPlan) -> bool:
    """Whether the state keeps the GEMM weights' compute-dtype copies (`COPIES`): compute narrower than the
    parameters, no pipeline (it casts per stage itself)."""
    return plan.pipe == 1 and DTYPES[cfg.train.compute_dtype] != DTYPES[cfg.train.param_dtype]


def check_attention_exchange(cfg: Config) -> None:
    """parallel.attention_exchange='mosaic' is a Mosaic GPU kernel: it needs a GPU backend and 16-bit compute,
    which only the build (not the config check) can see."""
    backend, compute = jax.default_backend(), DTYPES[cfg.train.compute_dtype]
    if cfg.parallel.dispatch_exchange == DispatchExchange.MOSAIC and (backend != "gpu" or compute != jnp.bfloat16):
        raise ConfigError(f"config.parallel.dispatch_exchange='mosaic' is a Mosaic GPU kernel for bf16 compute; this "
                          f"run has backend {backend!r} and compute_dtype {cfg.train.compute_dtype!r}: use 'runs'")
    if cfg.parallel.attention_exchange == AttentionExchange.MOSAIC and (backend != "gpu" or compute != jnp.bfloat16):
        raise ConfigError(f"config.parallel.attention_exchange='mosaic' is a Mosaic GPU kernel for bf16 compute; "
                          f"this run has backend {backend!r} and compute_dtype {cfg.train.compute_dtype!r}: use 'ring'")


def new_model(cfg: Config, kernels: Kernels = Kernels()) -> Transformer:
    return Transformer(cfg.model, param_dtype=DTYPES[cfg.train.param_dtype],
                       compute_dtype=DTYPES[cfg.train.compute_dtype], remat=cfg.train.remat, kernels=kernels,
                       scan_unroll=cfg.train.scan_unroll, rngs=nnx.Rngs(params=cfg.train.seed))


def _specs(shardings):
    """PartitionSpecs of a pytree of NamedShardings (shard_map's in_specs / out_specs)."""
    return jax.tree.map(lambda s: s.spec, shardings)


# --------------------------------------------------------------------------------------------- the trainer
@dataclasses.dataclass(frozen=True)
class Trainer:
    """Everything the loop needs that is built once: config, plan, mesh, model graph, layout, updater, state
    shapes and shardings."""
    cfg: Config
    plan: ParallelPlan
    mesh: jax.sharding.Mesh
    kernels: Kernels
    graphdef: nnx.GraphDef
    layout: Layout
    updater: Replicated | ZeroOne
    state_shardings: dict
    abstract_state: dict

    @property
    def param_specs(self):
        return _specs(self.state_shardings["params"])

    @property
    def copies_dtype(self):
        """The compute dtype where the state keeps the GEMM weights' copies in it (`COPIES`), else None."""
        return jax.tree.leaves(self.abstract_state[COPIES])[0].dtype if COPIES in self.abstract_state else None

    @property
    def checkpoint_abstract(self) -> dict:
        """The abstract state a checkpoint holds (`checkpointed`), the target to restore into."""
        return checkpointed(self.abstract_state)

    def batch_sharding(self) -> NamedSharding:
        return self.plan.batch_sharding(self.mesh)


def build(cfg: Config, devices=None) -> Trainer:
    """Plans the mesh and derives the state's shardings from the model's logical axes (nothing allocated)."""
    plan = ParallelPlan.from_config(cfg)
    mesh = plan.make_mesh(devices)
    kernels = resolve_kernels(cfg, plan)
    check_attention_exchange(cfg)
    abstract_model = nnx.eval_shape(lambda: new_model(cfg, kernels))
    graphdef, abstract_params = nnx.split(abstract_model)
    param_shardings = plan.param_shardings(nnx.get_partition_spec(abstract_params), mesh)
    param_specs = _specs(param_shardings)
    replicated = NamedSharding(mesh, P())
    if cfg.parallel.optimizer_sharding == OptimizerSharding.ZERO1:
        t = cfg.train
        shard_axes = (INTRA,) if mesh.shape[INTRA] > 1 else ()
        zero = Zero1(lambda segments, length: make_flat_optimizer(t, flat_decay_mask(segments, length)), DATA,
                     cfg.parallel.grad_comm, t.grad_clip or None, shard_axes=shard_axes,
                     pad_multiple=ZERO_PAD_MULTIPLE)
        updater = ZeroOne(zero, mesh)
        abstract_opt = jax.eval_shape(lambda p: updater.init(p, param_specs), abstract_params)
        opt_shardings = zero.state_shardings(mesh, abstract_opt)
    else:
        layer_kernel = (LayerKernelAdamW(cfg.train, unrolled_stacks(cfg.model, cfg.train.scan_unroll))
                        if kernels.adamw == AdamWImpl.PALLAS else None)
        updater = Replicated(make_optimizer(cfg.train), cfg.parallel.grad_comm, cfg.train.grad_clip or None,
                             plan.per_device, param_specs, layer_kernel)
        abstract_opt = jax.eval_shape(updater.init, abstract_params)
        opt_shardings = optax.tree_map_params(updater.optimizer, lambda _, s: s, abstract_opt, param_shardings,
                                              transform_non_params=lambda _: replicated)
    shardings = {"params": param_shardings, "opt_state": opt_shardings, "step": replicated, "nonfinite": replicated}
    abstract = {"params": abstract_params, "opt_state": abstract_opt, "step": jax.ShapeDtypeStruct((), jnp.int32),
                "nonfinite": jax.ShapeDtypeStruct((2,), jnp.int32)}
    compute = DTYPES[cfg.train.compute_dtype]
    if _keeps_copies(cfg, plan):
        shardings[COPIES] = gemm_weights_of(param_shardings)
        abstract[COPIES] = jax.eval_shape(lambda p: gemm_weight_copies(p, compute), abstract_params)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    layout = make_layout(plan, num_heads=cfg.model.num_heads, num_experts=cfg.model.moe.num_experts,
                         moe_layer=cfg.parallel.moe_layer, remat=cfg.train.remat,
                         overlap_chunks=cfg.parallel.overlap_chunks,
                         attention_exchange=cfg.parallel.attention_exchange,
                         dispatch_exchange=cfg.parallel.dispatch_exchange,
                         pallas_rows=kernels.permute == PermuteImpl.PALLAS)
    return Trainer(cfg, plan, mesh, kernels, graphdef, layout, updater, shardings, abstract)


def create_state(trainer: Trainer, params=None):
    """Initialises the state directly with its shardings: no full copy ever sits on one device. `params`
    (already laid out with the state's param shardings, e.g. imported weights) replaces the random init.

    state['nonfinite'] = [steps with a non-finite loss or gradient, the first such step (-1: none)]. Small
    entries come from numpy each time: a device_put of one shared jax array would hand every state the same
    buffer, which the donated step then deletes."""
    cfg, kernels, shardings = trainer.cfg, trainer.kernels, trainer.state_shardings
    if params is None:
        params = jax.jit(lambda: nnx.state(new_model(cfg, kernels)), out_shardings=shardings["params"])()
    if isinstance(trainer.updater, ZeroOne):
        opt_state = trainer.updater.init(params, trainer.param_specs)
    else:
        opt_state = jax.jit(trainer.updater.init, out_shardings=shardings["opt_state"])(params)
    return resumed(trainer, {"params": params, "opt_state": opt_state,
                             "step": jax.device_put(np.zeros((), np.int32), shardings["step"]),
                             "nonfinite": jax.device_put(np.array([0, -1], np.int32), shardings["nonfinite"])})


def checkpointed(state: dict) -> dict:
    """The part of the state a checkpoint holds: all but the derived GEMM-weight copies."""
    return {k: v for k, v in state.items() if k != COPIES}


def resumed(trainer: Trainer, state: dict) -> dict:
    """A checkpointed state (restored, created or imported) made whole: the GEMM weights' copies cast again."""
    if trainer.copies_dtype is None:
        return state
    cast = jax.jit(lambda p: gemm_weight_copies(p, trainer.copies_dtype), out_shardings=trainer.state_shardings[COPIES])
    return {**state, COPIES: cast(state["params"])}


def source_params(state: dict):
    """What the gradient source differentiates: the parameters, their GEMM weights as the state's copies."""
    return with_gemm_weight_copies(state["params"], state[COPIES]) if COPIES in state else state["params"]


def _all_finite(loss, grads, per_device: bool):
    """Whether the loss and every gradient element are finite, on every device (one scalar collective)."""
    ok = jnp.isfinite(loss)
    for g in jax.tree.leaves(grads):   # a sum is non-finite iff some element is (or the sum overflows)
        ok = ok & jnp.isfinite(jnp.sum(g.astype(jnp.float32)))
    if not per_device:
        return ok
    ok = ok.astype(jnp.int32)
    return lax.pmin(ok, tuple(varying_axes(ok))) > 0 if varying_axes(ok) else ok > 0


def gradient_source(trainer: Trainer) -> gradients.GradientSource:
    """autodiff, accumulate or pipeline, as the config says. The first two take `source_params(state)`."""
    cfg, plan = trainer.cfg, trainer.plan
    if plan.pipe > 1:
        p = cfg.parallel
        return gradients.pipeline(trainer.graphdef, trainer.layout, param_specs=trainer.param_specs,
                                  num_layers=cfg.model.num_moe_layers, num_stages=plan.pipe,
                                  schedule=p.pipeline_schedule, num_microbatches=cfg.train.microbatches,
                                  virtual_stages=p.virtual_stages, layers_over_pipe=plan.layers_over_pipe)
    single = gradients.autodiff(gradients.model_loss(trainer.graphdef, trainer.layout), per_device=plan.per_device)
    return gradients.accumulate(single, cfg.train.microbatches)


def _expert_load(metrics):
    load = jnp.sum(metrics.pop("tokens_per_expert"), axis=0).astype(jnp.float32)
    return jnp.max(load) / jnp.maximum(jnp.mean(load), 1.0)


def _per_device(trainer: Trainer, fn, in_specs, out_specs):
    """fn as one shard_map over the whole mesh when the step runs per device; else as it is."""
    if not trainer.plan.per_device:
        return fn
    return jax.shard_map(fn, mesh=trainer.mesh, in_specs=in_specs, out_specs=out_specs)


def make_train_step(trainer: Trainer):
    """jit(state, batch) -> (state, metrics); the state is donated."""
    source, updater = gradient_source(trainer), trainer.updater
    schedule = learning_rate_schedule(trainer.cfg.train)
    skip = trainer.cfg.train.nonfinite == NonFinite.SKIP

    copies_dtype = trainer.copies_dtype
    layer_kernel = getattr(updater, "layer_kernel", None)

    def update(params, grads, opt_state, copies):
        if layer_kernel is not None:   # the kernel writes the stacks' copies in its own pass
            return updater.step_with_copies(params, grads, opt_state, copies)
        params, opt_state, stats = updater.step(params, grads, opt_state)
        # The new copies from the new parameters in the same program: XLA writes them in AdamW's pass (COPIES).
        return params, opt_state, stats, (gemm_weight_copies(params, copies_dtype) if copies_dtype else {})

    def body(params, copies, opt_state, step, nonfinite, batch):
        # kernels.adamw='pallas': the stacks' GEMM weights differentiated per layer, their gradients in pieces
        pieces = gradients.in_layer_pieces(copies, layer_kernel.stacks) if layer_kernel is not None else copies
        loss, metrics, grads = source(with_gemm_weight_copies(params, pieces) if copies_dtype else params, batch)
        if isinstance(updater, Replicated):
            # An unrolled layer stack's gradients arrive as a concatenation of the layers' pieces, which XLA
            # fused into each consumer (norm, both Adam moments, the update) and then could not merge those
            # into one pass. Materialized once here, AdamW is one multi-output pass per parameter: on the H200
            # the expert weights' optimizer work went from 33.2 to 26.5 ms of a mixtral_small step
            # (benchmarks/results/train_step_profile_mixtral_small_1xh200.json). A scanned stack's gradients
            # are already one array (no concatenation to materialize); pieces (kernels.adamw='pallas') are each
            # materialized anyway, as the kernel's operands.
            grads = lax.optimization_barrier(grads)
        finite = _all_finite(loss, grads, trainer.plan.per_device)
        if skip:   # a cond, not a select: the skipped update costs nothing and reads no state twice
            params, opt_state, stats, copies = lax.cond(
                finite, lambda: update(params, grads, opt_state, copies),
                lambda: (params, opt_state, {"grad_norm": jnp.full((), jnp.nan, jnp.float32)}, copies))
        else:
            params, opt_state, stats, copies = update(params, grads, opt_state, copies)
        bad = (~finite).astype(jnp.int32)
        nonfinite = jnp.stack([nonfinite[0] + bad, jnp.where((nonfinite[1] < 0) & (bad > 0), step, nonfinite[1])])
        metrics.update(loss=loss, grad_norm=stats["grad_norm"], lr=schedule(step), nonfinite_steps=nonfinite[0])
        if "tokens_per_expert" in metrics:   # the pipeline returns only the weighted MoE loss (moe_loss)
            metrics["expert_load_max_over_mean"] = _expert_load(metrics)
        return params, copies, opt_state, nonfinite, metrics

    def step_fn(state, batch):
        param_specs = trainer.param_specs
        opt_specs = updater.state_specs(state["opt_state"], param_specs)
        copy_specs = gemm_weights_of(param_specs) if copies_dtype else {}
        run = _per_device(trainer, body, (param_specs, copy_specs, opt_specs, P(), P(), trainer.plan.batch_spec()),
                          (param_specs, copy_specs, opt_specs, P(), P()))
        params, copies, opt_state, nonfinite, metrics = run(state["params"], state.get(COPIES, {}), state["opt_state"],
                                                            state["step"], state["nonfinite"], batch)
        new = {"params": params, "opt_state": opt_state, "step": state["step"] + 1, "nonfinite": nonfinite}
        return ({**new, COPIES: copies} if copies_dtype else new), metrics

    batch = {"inputs": trainer.batch_sharding(), "targets": trainer.batch_sharding()}
    return jax.jit(step_fn, in_shardings=(trainer.state_shardings, batch),
                   out_shardings=(trainer.state_shardings, None), donate_argnums=0)


def loss_and_metrics(trainer: Trainer):
    """fn(params, batch) -> (loss, metrics) of the plain forward, per device where the step is (for eval,
    analysis and tests); global values out."""
    loss_fn = gradients.model_loss(trainer.graphdef, trainer.layout)
    if not trainer.plan.per_device:
        return loss_fn
    # The plain forward holds the whole model on every stage: layers sharded over 'pipe' come in gathered.
    specs = jax.tree.map(lambda s: P(*(None if e == PIPE else e for e in s)), trainer.param_specs,
                         is_leaf=lambda x: isinstance(x, P))
    return jax.shard_map(loss_fn, mesh=trainer.mesh, in_specs=(specs, trainer.plan.batch_spec()), out_specs=P())


def make_eval_step(trainer: Trainer):
    """jit(params, batch) -> the batch's mean cross-entropy."""
    fn = loss_and_metrics(trainer)
    batch = {"inputs": trainer.batch_sharding(), "targets": trainer.batch_sharding()}
    return jax.jit(lambda params, b: fn(params, b)[1]["ce"], in_shardings=(trainer.state_shardings["params"], batch))
