"""Entry point: flags -> config -> distributed init -> mesh -> state (created sharded) -> jitted step -> loop.

    python -m megascale_jax.train --config configs/tiny_cpu.py [--config.train.steps=50] [--profile]

The default config is the tiny CPU model on the built-in real-text corpus.
"""
from __future__ import annotations

import dataclasses
import os
import sys

from absl import app, flags
from ml_collections import config_flags

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from megascale_jax import config as config_lib
from megascale_jax import data as data_lib
from megascale_jax import metrics as metrics_lib
from megascale_jax.checkpoint import Checkpointer
from megascale_jax.model.accounting import model_size
from megascale_jax.model.layout import layout_for
from megascale_jax.model.loss import objective
from megascale_jax.model.pipelined import bubble_report, pipeline_loss_and_grads
from megascale_jax.model.transformer import Transformer
from megascale_jax.optim import flat_decay_mask, learning_rate_schedule, make_flat_optimizer, make_optimizer
from megascale_jax.parallel import distributed
from megascale_jax.parallel.plan import DATA, INTRA, ParallelPlan
from megascale_jax.parallel.zero import Zero1

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


# ----------------------------------------------------------------------------------------------- state
@dataclasses.dataclass(frozen=True)
class Trainer:
    """Everything the loop needs that is built once: config, plan, mesh, model graph, optimizer, shardings."""
    cfg: config_lib.Config
    plan: ParallelPlan
    mesh: jax.sharding.Mesh
    graphdef: nnx.GraphDef
    optimizer: optax.GradientTransformation
    state_shardings: dict
    abstract_state: dict
    layout: object
    zero: Zero1 | None = None   # ZeRO-1 (config.parallel.optimizer_sharding='zero1'): wraps `optimizer`


def _new_model(cfg) -> Transformer:
    return Transformer(cfg.model, param_dtype=DTYPES[cfg.train.param_dtype],
                       compute_dtype=DTYPES[cfg.train.compute_dtype],
                       group_size=config_lib.balance_group_size(cfg), remat=cfg.train.remat,
                       rngs=nnx.Rngs(params=cfg.train.seed))


def build_trainer(cfg: config_lib.Config, devices=None) -> Trainer:
    """Plans the mesh and derives the state's shardings from the model's logical axes (nothing allocated)."""
    plan = ParallelPlan.from_config(cfg)
    mesh = plan.make_mesh(devices)
    optimizer = make_optimizer(cfg.train)

    def init_state():
        graphdef, params = nnx.split(_new_model(cfg))
        return graphdef, {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), jnp.int32)}

    graphdef, abstract = _abstract(init_state)
    param_shardings = plan.param_shardings(nnx.get_partition_spec(abstract["params"]), mesh)
    replicated = NamedSharding(mesh, P())
    zero = None
    if cfg.parallel.optimizer_sharding == "zero1":
        zero, abstract["opt_state"], opt_shardings = _zero1(cfg, abstract["params"], param_shardings, mesh)
    else:
        opt_shardings = optax.tree_map_params(optimizer, lambda _, s: s, abstract["opt_state"], param_shardings,
                                              transform_non_params=lambda _: replicated)
    shardings = {"params": param_shardings, "opt_state": opt_shardings, "step": replicated}
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    return Trainer(cfg, plan, mesh, graphdef, optimizer, shardings, abstract, layout_for(cfg, plan, mesh), zero)


# ZeRO-1's flat vectors are padded to a multiple of this, so for every data-parallel size dividing 64 the state
# has the same global shapes and a checkpoint restores onto another data-parallel size (<= 8192 zeros a bucket).
ZERO_PAD_MULTIPLE = 64 * 128


def _specs(shardings):
    """PartitionSpecs of a pytree of NamedShardings (shard_map's in_specs / out_specs)."""
    return jax.tree.map(lambda s: s.spec, shardings)


def _zero1(cfg, abstract_params, param_shardings, mesh):
    """ZeRO-1 over the data axis: the optimizer and the shapes/shardings of its flat, sharded state.

    Each device flattens its own parameter shards (experts or TP slices differ along 'intra': Zero1's
    shard_axes), so the weight-decay mask is built per group from the leaves each device holds."""
    shard_axes = (INTRA,) if mesh.shape[INTRA] > 1 else ()
    optimizer = lambda segments, length: make_flat_optimizer(cfg.train, flat_decay_mask(segments, length))  # noqa: E731
    zero = Zero1(optimizer, DATA, cfg.parallel.grad_comm, cfg.train.grad_clip or None, shard_axes=shard_axes,
                 pad_multiple=ZERO_PAD_MULTIPLE)
    abstract_opt = jax.eval_shape(lambda p: zero.init(p, mesh, _specs(param_shardings)), abstract_params)
    return zero, abstract_opt, zero.state_shardings(mesh, abstract_opt)


def _abstract(init_state):
    """Shapes of the state without computing it; the graphdef comes from the same trace."""
    captured = {}

    def state_only():
        graphdef, state = init_state()
        captured["graphdef"] = graphdef
        return state

    abstract = jax.eval_shape(state_only)
    return captured["graphdef"], abstract


def create_state(trainer: Trainer):
    """Initialises the state directly with its shardings: no full copy ever sits on one device."""
    cfg, optimizer = trainer.cfg, trainer.optimizer

    if trainer.zero is not None:
        params = jax.jit(lambda: nnx.state(_new_model(cfg)), out_shardings=trainer.state_shardings["params"])()
        return {"params": params,
                "opt_state": trainer.zero.init(params, trainer.mesh, _specs(trainer.state_shardings["params"])),
                "step": jax.device_put(jnp.zeros((), jnp.int32), trainer.state_shardings["step"])}

    def init():
        params = nnx.state(_new_model(cfg))
        return {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), jnp.int32)}

    return jax.jit(init, out_shardings=trainer.state_shardings)()


# ------------------------------------------------------------------------------------------------ step
def model_objective(graphdef, layout, moe_cfg):
    """fn(params, batch) -> (loss, metrics) for `layout.evaluate` (which may run it per device)."""
    return lambda params, batch: objective(nnx.merge(graphdef, params), batch, layout, moe_cfg)


def _expert_load(metrics):
    load = jnp.sum(metrics.pop("tokens_per_expert"), axis=0).astype(jnp.float32)
    return jnp.max(load) / jnp.maximum(jnp.mean(load), 1.0)


def _zero1_step_fn(trainer: Trainer):
    """The whole step per device: local gradients, then ZeRO-1's compressed reduce-scatter and update."""
    cfg, zero, layout = trainer.cfg, trainer.zero, trainer.layout
    loss_fn = model_objective(trainer.graphdef, layout, cfg.model.moe)
    schedule = learning_rate_schedule(cfg.train)

    def body(params, opt_state, step, batch):
        dp = lax.axis_size(DATA)
        # Varying copies: their gradients stay this device's own (no implicit psum), as ZeRO-1 wants.
        local = jax.tree.map(lambda p: lax.pcast(p, DATA, to="varying"), params)

        def scaled(p):  # the loss is the global mean; x dp makes each device's gradient its local sum
            loss, metrics = loss_fn(p, batch)
            return loss * dp, (loss, metrics)

        (_, (loss, metrics)), grads = jax.value_and_grad(scaled, has_aux=True)(local)
        params, opt_state, stats = zero.step(params, grads, opt_state)
        metrics.update(loss=loss, grad_norm=stats["grad_norm"], lr=schedule(step),
                       expert_load_max_over_mean=_expert_load(metrics))
        return params, opt_state, metrics

    def step_fn(state, batch):
        param_specs = _specs(trainer.state_shardings["params"])
        opt_specs = zero.state_specs(state["opt_state"])
        batch_spec = trainer.plan.batch_spec()
        run = jax.shard_map(body, mesh=trainer.mesh, in_specs=(param_specs, opt_specs, P(), batch_spec),
                            out_specs=(param_specs, opt_specs, P()))
        params, opt_state, metrics = run(state["params"], state["opt_state"], state["step"], batch)
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    return step_fn


def _pipeline_loss_and_grads(trainer: Trainer, params, batch):
    """Loss and gradients through the pipeline schedule (config.parallel.pipe > 1)."""
    p = trainer.cfg.parallel
    loss, metrics, grads = pipeline_loss_and_grads(
        trainer.graphdef, params, batch, mesh=trainer.mesh, moe_cfg=trainer.cfg.model.moe, layout=trainer.layout,
        schedule=p.pipeline_schedule, num_microbatches=p.num_microbatches, virtual_stages=p.virtual_stages)
    return loss, metrics, jax.tree.map(lambda g, w: g.astype(w.dtype), grads, params)


def make_train_step(trainer: Trainer):
    cfg, graphdef, layout, optimizer = trainer.cfg, trainer.graphdef, trainer.layout, trainer.optimizer
    schedule = learning_rate_schedule(cfg.train)
    loss_fn = model_objective(graphdef, layout, cfg.model.moe)

    def step_fn(state, batch):
        if cfg.parallel.pipe > 1:
            loss, metrics, grads = _pipeline_loss_and_grads(trainer, state["params"], batch)
        else:
            loss_of = lambda params: layout.evaluate(loss_fn, params, batch)  # noqa: E731
            (loss, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(state["params"])
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics.update(loss=loss, grad_norm=optax.tree.norm(grads), lr=schedule(state["step"]))
        if "tokens_per_expert" in metrics:   # the pipeline returns only the weighted MoE loss (moe_loss)
            metrics["expert_load_max_over_mean"] = _expert_load(metrics)
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    if trainer.zero is not None:
        step_fn = _zero1_step_fn(trainer)
    batch_sharding = trainer.plan.batch_sharding(trainer.mesh)
    return jax.jit(step_fn, in_shardings=(trainer.state_shardings, {"inputs": batch_sharding,
                   "targets": batch_sharding}), out_shardings=(trainer.state_shardings, None), donate_argnums=0)


def make_eval_step(trainer: Trainer):
    cfg, graphdef, layout = trainer.cfg, trainer.graphdef, trainer.layout
    loss_fn = model_objective(graphdef, layout, cfg.model.moe)

    def eval_fn(params, batch):
        return layout.evaluate(loss_fn, params, batch)[1]["ce"]

    batch_sharding = trainer.plan.batch_sharding(trainer.mesh)
    return jax.jit(eval_fn, in_shardings=(trainer.state_shardings["params"],
                                          {"inputs": batch_sharding, "targets": batch_sharding}))


def global_batch(sampler: data_lib.BatchSampler, step: int, split: str, sharding: NamedSharding):
    """Assembles the global batch; each process computes only the rows of its own devices."""
    shape = (sampler.global_batch, sampler.seq_len)
    cache = {}

    def rows(index):
        key = index[0].indices(shape[0])[:2]
        if key not in cache:
            cache[key] = sampler.batch_for_rows(step, range(*key), split=split)
        return cache[key]

    return {name: jax.make_array_from_callback(shape, sharding, lambda idx, n=name: rows(idx)[n][:, idx[1]])
            for name in ("inputs", "targets")}


# ------------------------------------------------------------------------------------------------ loop
def run(cfg: config_lib.Config, *, profile: bool = False, devices=None, stop_after: int | None = None) -> list[dict]:
    """Trains `cfg` on `devices` (default all); returns the logged train metrics (one dict per log step).

    Resumes from the newest checkpoint in config.checkpoint.dir when there is one. `stop_after` ends the run
    early at that step (what a preemption does), without changing the schedule, which follows train.steps.
    """
    trainer = build_trainer(cfg, devices)
    out_dir = cfg.output.dir or os.path.join("runs", cfg.name)
    source = data_lib.make_source(cfg.data.source, path=cfg.data.path, dtype=cfg.data.dtype,
                                  vocab_size=cfg.model.vocab_size, seed=cfg.train.seed,
                                  cache_dir=cfg.data.cache_dir or None)
    sampler = data_lib.BatchSampler(source, cfg.train.seq_len, cfg.train.global_batch, cfg.train.seed,
                                    cfg.data.eval_fraction)
    size = model_size(cfg.model, cfg.train.seq_len)
    peak = metrics_lib.peak_flops_per_device(jax.devices()[0])
    _banner(cfg, trainer, size, peak, source)

    ckpt = Checkpointer(cfg.checkpoint.dir, save_every=cfg.checkpoint.every, keep=cfg.checkpoint.keep,
                        async_save=cfg.checkpoint.async_save) if cfg.checkpoint.dir else None
    if ckpt is not None and ckpt.latest_step() is not None:
        state, extra = ckpt.restore(trainer.abstract_state)
        print(f"resumed from {cfg.checkpoint.dir} at step {extra['step']}", flush=True)
    else:
        state = create_state(trainer)
    start = int(jax.device_get(state["step"]))

    train_step, eval_step = make_train_step(trainer), make_eval_step(trainer)
    batch_sharding = trainer.plan.batch_sharding(trainer.mesh)
    writer = metrics_lib.MetricsWriter(out_dir, tensorboard=cfg.output.tensorboard, purge_step=start or None) \
        if jax.process_index() == 0 else None
    bar = metrics_lib.ProgressBar(cfg.train.steps, start) if jax.process_index() == 0 else None
    timer = metrics_lib.StepTimer(tokens_per_step=cfg.train.global_batch * cfg.train.seq_len)
    profile_start = cfg.profile.start_step if cfg.profile.start_step >= 0 else (5 if profile else -1)
    logged = []
    for step in range(start, min(cfg.train.steps, stop_after or cfg.train.steps)):
        if step == profile_start:
            jax.block_until_ready(state)   # the trace starts at a step boundary, not inside the previous step
            jax.profiler.start_trace(os.path.join(out_dir, "profile"))
        state, metrics = train_step(state, global_batch(sampler, step, "train", batch_sharding))
        if step == profile_start + cfg.profile.num_steps - 1 and profile_start >= 0:
            jax.block_until_ready(state)
            jax.profiler.stop_trace()
        done = step + 1
        if done % cfg.train.log_every == 0 or done == cfg.train.steps or done == start + 1:
            record = {k: float(v) for k, v in jax.device_get(metrics).items()}
            tokens_per_s = timer.lap(done, metrics)
            record["tokens_per_s"] = tokens_per_s
            record["mfu"] = metrics_lib.model_flops_utilization(size.train_flops_per_token, tokens_per_s,
                                                                trainer.mesh.devices.size, peak)
            logged.append({"step": done, **record})
            if writer:
                writer.write(done, record, split="train")
                bar.update(done, record["loss"], tokens_per_s, record["mfu"])
        if cfg.train.eval_every and (done % cfg.train.eval_every == 0 or done == cfg.train.steps):
            with timer.excluded(state):
                ce = np.mean([float(eval_step(state["params"], global_batch(sampler, i, "eval", batch_sharding)))
                              for i in range(cfg.train.eval_batches)])
            if writer:
                writer.write(done, {"ce": ce}, split="eval")
                bar.message(f"step {done}: eval loss {ce:.4f}")
        if ckpt is not None:
            ckpt.maybe_save(done, state, {"step": done, "config": cfg.name})
    if ckpt is not None:
        ckpt.wait()
        ckpt.close()
    if writer:
        bar.close()
        writer.close()
    return logged


def _banner(cfg, trainer, size, peak, source) -> None:
    if jax.process_index() != 0:
        return
    p = trainer.plan
    lines = [
        f"megascale-jax | config {cfg.name} | jax {jax.__version__} | {jax.process_count()} process(es)",
        f"devices: {trainer.mesh.devices.size} x {jax.devices()[0].device_kind} "
        f"(peak {'n/a' if peak is None else f'{peak / 1e12:.0f} TFLOP/s bf16'})",
        f"mesh: data={p.data} pipe={p.pipe} intra={p.intra} | plan {p.kind} (attention {p.attention}, "
        f"ffn {p.ffn}, dispatch {p.dispatch})" + _pipeline_banner(cfg),
        f"model: {size.summary()}",
        f"data: {getattr(source, 'description', type(source).__name__)} | batch {cfg.train.global_batch} x "
        f"{cfg.train.seq_len} tokens",
    ]
    print("\n".join(lines), flush=True)


def define_flags() -> None:
    """Command-line flags; defined only when this module is the program (others import it freely)."""
    config_flags.DEFINE_config_file("config", "configs/tiny_cpu.py", "configs/<model>.py to train.")
    flags.DEFINE_bool("profile", False, "Trace steps [5, 8) with jax.profiler (unless config.profile.start_step "
                      "is set) into <output>/profile.")
    flags.DEFINE_string("coordinator", None, "host:port of process 0 (multi-host without SLURM).")
    flags.DEFINE_integer("num_processes", None, "Process count (multi-host without SLURM).")
    flags.DEFINE_integer("process_id", None, "This process's index (multi-host without SLURM).")


def _pipeline_banner(cfg) -> str:
    p = cfg.parallel
    if p.pipe == 1:
        return ""
    bubble = bubble_report(p.pipeline_schedule, p.pipe, p.num_microbatches, p.virtual_stages)
    return (f" | pipeline {p.pipeline_schedule}, {p.num_microbatches} microbatches, virtual {p.virtual_stages}, "
            f"bubble {bubble['bubble_fraction_formula']:.1%}")


def main(argv) -> None:
    del argv
    f = flags.FLAGS
    distributed.initialize(f.coordinator, f.num_processes, f.process_id)
    try:
        cfg = config_lib.from_config_dict(f.config, num_devices=jax.device_count())
    except config_lib.ConfigError as err:
        sys.exit(f"config error: {err}")
    run(cfg, profile=f.profile)


if __name__ == "__main__":
    define_flags()
    app.run(main)
