"""Updaters: (params, grads, opt_state) -> (params, opt_state, stats), the second half of the train step
(megascale_jax/step.py composes them with a gradient source).

  Replicated   the optimizer state sharded like the parameters (replicated over 'data'): reduce the gradient over
               'data' as `parallel.grad_comm` says, clip by the global norm, optax's AdamW on each device's shards.
               With `layer_kernel` (kernels.adamw='pallas') `step_with_copies` runs the same update with the unrolled
               layer stacks' GEMM weights updated by pallas_kernels/adamw.py from their per-layer gradient pieces
               (gradients.LayerPieces), which writes the weights' compute-dtype copies in the same pass.
  ZeroOne      ZeRO-1 (parallel/zero.py): compressed reduce-scatter, this rank's slice of the state, all-gather.
"""
from __future__ import annotations

import dataclasses
from enum import StrEnum
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from megascale_jax.gradients import is_layer_pieces
from megascale_jax.optim import ADAM_EPS, adam_step_scalars, advanced_state, clip_by_norm, is_decayed
from megascale_jax.parallel import grad_comm
from megascale_jax.parallel.collectives import varying_axes
from megascale_jax.parallel.plan import DATA
from megascale_jax.parallel.zero import Zero1
from pallas_kernels.varying import per_device_refusal


class AdamWImpl(StrEnum):
    AUTO = "auto"
    XLA = "xla"        # optax's chain; XLA fuses it into one pass per parameter
    PALLAS = "pallas"  # the unrolled stacks' GEMM weights by pallas_kernels/adamw.py, from per-layer gradients


def resolve_adamw(choice: str, *, backend: str, partitioned_by_xla: bool, zero1: bool, copies: bool,
                  float32_params: bool, unrolled_stacks: tuple, microbatches: int) -> str:
    """`auto` -> 'pallas' where it can run and the step has one microbatch, else 'xla'. What it removes is the
    concatenation of an unrolled stack's per-layer gradients, which exists only without gradient accumulation (the
    accumulation adds each microbatch's pieces into stacked buffers). Measured on one H100, each pair in one call
    (benchmarks/results/train_step_adamw_1xh100.json, train_step_adamw_mixtral_1xh100.json,
    train_step_adamw_microbatches_1xh100.json):
    deepseekmoe_small 8 x 4096, GPU-busy 188.06 vs 191.02 ms a step, 163.5k vs 161.8k tokens/s (the kernel's calls
    12.0 ms against XLA's 11.5 for the same weights plus the 2.68 ms concatenation); mixtral_small 8 x 4096, 356.2
    vs 358.8 ms, 88.8k vs 88.3k; deepseekmoe_small 16 x 4096 in 2 microbatches, 383.6 vs 381.0 ms, 167.5k vs
    168.3k (no gain: nothing to remove). 'pallas' where it cannot run or would have nothing to do is a one-line
    error."""
    refusals = [per_device_refusal(backend=backend, partitioned_by_xla=partitioned_by_xla),
                zero1 and "parallel.optimizer_sharding='zero1' (it updates flat slices of the state)",
                not float32_params and "train.param_dtype other than float32 (the kernel updates float32 masters)",
                not copies and ("no compute-dtype copies of the GEMM weights (train.compute_dtype equal to "
                                "train.param_dtype, or a pipeline)"),
                not unrolled_stacks and ("no fully unrolled layer stack (train.scan_unroll below the layer count: "
                                         "a scanned stack's gradient is one array already)")]
    why = next((r for r in refusals if r), None)
    if choice == AdamWImpl.AUTO:
        return (AdamWImpl.XLA if why or microbatches > 1 else AdamWImpl.PALLAS).value
    if choice == AdamWImpl.PALLAS and why:
        raise ValueError(f"config.kernels.adamw='pallas' updates the unrolled layer stacks' GEMM weights per layer "
                         f"on a GPU and this run has {why}; use 'xla' or 'auto'")
    return AdamWImpl(choice).value


def _adamw_kernels():
    """pallas_kernels.adamw, looked up at each use so that tests can put its interpreted form or its XLA twin in
    the kernel's place (the updater is built inside the trainer, out of a test's reach)."""
    from pallas_kernels import adamw
    return adamw


@dataclasses.dataclass(frozen=True)
class LayerKernelAdamW:
    """make_optimizer's AdamW (optim.py) written out, for kernels.adamw='pallas': the GEMM weights whose gradients
    arrive as LayerPieces by the Pallas kernel, one call per layer updating that row of the stacked parameter, both
    moments and the compute copy in place; every other leaf by the same arithmetic in XLA (`adamw_math`). The state
    keeps optax's structure (optim.advanced_state), so checkpoints are those of the optax update."""
    train_cfg: Any
    stacks: tuple       # the top-level parameter keys of the unrolled layer stacks

    def hyper(self, param) -> dict:
        """The update's constants for one leaf (weight decay as make_optimizer's mask says)."""
        t = self.train_cfg
        return dict(b1=t.b1, b2=t.b2, eps=ADAM_EPS, weight_decay=t.weight_decay if is_decayed(param) else 0.0)

    def update(self, params, grads, opt_state, copies, norm, max_grad_norm):
        """(params, opt_state, copies) after one step from the reduced gradient (pieces in their dtype) and its
        global norm; `copies` updated in place for the pieces' leaves, cast from the new parameters for the rest."""
        lr, bias1, bias2 = adam_step_scalars(opt_state, self.train_cfg)
        clip = max_grad_norm is not None
        scalars = jnp.stack([lr, bias1, bias2, norm, jnp.float32(max_grad_norm if clip else 1.0), jnp.float32(clip)])
        adam, kernels = opt_state[0], _adamw_kernels()
        leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
        copy_at = dict(jax.tree_util.tree_flatten_with_path(copies)[0])
        new_p, new_m, new_v, new_copy = [], [], [], {}
        for (path, p), g, m, v in zip(leaves, treedef.flatten_up_to(grads), treedef.flatten_up_to(adam.mu),
                                      treedef.flatten_up_to(adam.nu), strict=True):
            hyper = self.hyper(p)
            if is_layer_pieces(g):
                c = copy_at[path]
                for layer, piece in enumerate(g.pieces):
                    p, m, v, c = kernels.adamw_layer_update(scalars, piece, p, m, v, c, layer=layer, **hyper)
                new_copy[path] = c
            else:
                g = clip_by_norm(g, norm, max_grad_norm)
                p_f32, m_f32, v_f32 = kernels.adamw_math(p, g, m.astype(jnp.float32), v.astype(jnp.float32), lr,
                                                         bias1, bias2, **hyper)
                p, m, v = p_f32.astype(p.dtype), m_f32.astype(m.dtype), v_f32.astype(v.dtype)
                if path in copy_at:
                    new_copy[path] = p.astype(copy_at[path].dtype)
            new_p.append(p)
            new_m.append(m)
            new_v.append(v)
        copies = jax.tree_util.tree_unflatten(jax.tree.structure(copies), [new_copy[path] for path in copy_at])
        opt_state = advanced_state(opt_state, treedef.unflatten(new_m), treedef.unflatten(new_v))
        return treedef.unflatten(new_p), opt_state, copies


@dataclasses.dataclass(frozen=True)
class Replicated:
    """Optimizer state sharded like the parameters (replicated over 'data'). Per device it first reduces
    the gradient over 'data' as `mode` says; the global norm sums every leaf over the axes it is sharded on."""
    optimizer: optax.GradientTransformation     # elementwise (AdamW): runs on each device's shards
    mode: str
    max_grad_norm: float | None
    per_device: bool
    param_specs: Any
    layer_kernel: LayerKernelAdamW | None = None   # kernels.adamw='pallas': `step_with_copies` runs it

    def init(self, params):
        return self.optimizer.init(params)

    def state_specs(self, opt_state, param_specs):
        return optax.tree_map_params(self.optimizer, lambda _, s: s, opt_state, param_specs,
                                     transform_non_params=lambda _: P())

    def step(self, params, grads, opt_state):
        grads, norm = self._reduced(grads)
        grads = clip_by_norm(grads, norm, self.max_grad_norm)
        updates, opt_state = self.optimizer.update(jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params),
                                                   opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"grad_norm": norm}

    def step_with_copies(self, params, grads, opt_state, copies):
        """`step` by `layer_kernel`: (params, opt_state, stats, new copies). `grads` holds the unrolled stacks'
        GEMM weights as LayerPieces (gradients.in_layer_pieces); `copies` are the GEMM weights' compute-dtype
        copies."""
        grads, norm = self._reduced(grads, keep_pieces=True)
        params, opt_state, copies = self.layer_kernel.update(params, grads, opt_state, copies, norm,
                                                             self.max_grad_norm)
        return params, opt_state, {"grad_norm": norm}, copies

    def _reduced(self, grads, keep_pieces: bool = False):
        """(the gradient in float32, reduced over 'data' as `mode` says where the step runs per device, its global
        norm). keep_pieces: LayerPieces stay in their dtype (the kernel widens them as it reads; a cast here would
        be a pass of its own) where nothing but a mean over one float32 rank would touch them: that mean, which
        only types them as replicated over 'data', then runs in their dtype. A compressed exchange (bf16 / fp8)
        rounds the gradient even on one rank, so there they are widened and exchanged like every leaf."""
        one_exact_rank = not self.per_device or (lax.axis_size(DATA) == 1 and self.mode == grad_comm.GradComm.FP32)
        keep = keep_pieces and one_exact_rank
        grads = jax.tree.map(lambda g: g if keep and is_layer_pieces(g) else
                             jax.tree.map(lambda x: x.astype(jnp.float32), g), grads, is_leaf=is_layer_pieces)
        if self.per_device:
            grads = _reduce_over_data(grads, self.mode)
        return grads, _global_norm(grads, self.param_specs if self.per_device else None)


def _reduce_over_data(grads, mode: str):
    """Mean over 'data'. fp32: the compiler's all-reduce. bf16 / fp8: grad_comm's all-to-all + local fp32
    sum + all-gather, one flat vector per group of leaves of one shard_map type (each gathered result must
    be typed like its leaves: replicated over 'data', varying where the leaf is sharded)."""
    if mode == grad_comm.GradComm.FP32:
        return jax.tree.map(lambda g: lax.pmean(g, DATA), grads)
    leaves, treedef = jax.tree.flatten(grads)
    groups: dict[frozenset, list[int]] = {}
    for i, g in enumerate(leaves):
        groups.setdefault(varying_axes(g) - {DATA}, []).append(i)
    out = list(leaves)
    for indices in groups.values():
        reduced = grad_comm.all_reduce_gradients([leaves[i] for i in indices], axis=DATA, mode=mode)
        for i, g in zip(indices, reduced):
            out[i] = g
    return treedef.unflatten(out)


def _global_norm(grads, param_specs):
    """sqrt(sum of squares) over the whole model: per device, each leaf's local sum is added over the mesh
    axes its spec shards it on (experts over 'intra', layers over 'pipe'), so every element counts once. A leaf
    given as LayerPieces sums its pieces (widened to float32 where they are read)."""
    if param_specs is None and not any(is_layer_pieces(g) for g in jax.tree.leaves(grads, is_leaf=is_layer_pieces)):
        return optax.tree.norm(grads)   # the global view's norm as optax computes it (the XLA plan's, unchanged)
    leaves = jax.tree.leaves(grads, is_leaf=is_layer_pieces)
    specs = ([None] * len(leaves) if param_specs is None
             else jax.tree.leaves(param_specs, is_leaf=lambda x: isinstance(x, P)))
    total = jnp.zeros((), jnp.float32)
    for g, spec in zip(leaves, specs, strict=True):
        squares = sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(g))
        used = () if spec is None else tuple(a for entry in spec if entry is not None
                                             for a in ((entry,) if isinstance(entry, str) else entry))
        total = total + (lax.psum(squares, used) if used else squares)
    return jnp.sqrt(total)


@dataclasses.dataclass(frozen=True)
class ZeroOne:
    """ZeRO-1 (parallel/zero.py) as an updater; it reduces the local gradients itself."""
    zero: Zero1
    mesh: jax.sharding.Mesh

    def init(self, params, param_specs):
        return self.zero.init(params, self.mesh, param_specs)

    def state_specs(self, opt_state, param_specs):
        return self.zero.state_specs(opt_state)

    def step(self, params, grads, opt_state):
        params, opt_state, stats = self.zero.step(params, grads, opt_state)
        return params, opt_state, {"grad_norm": stats["grad_norm"]}


