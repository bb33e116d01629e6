"""ZeRO-1 data parallelism: optimizer state sharded over the data-parallel (DP) axis.

Layout. The parameter pytree is flattened once into one vector of length L = padded_length(n, dp, block)
(zero padding). Rank r of the DP axis owns the contiguous slice [r*L/dp, (r+1)*L/dp) and holds the optax
state of that slice only; outside shard_map those state arrays are global [L] arrays sharded
`P(axis)` (scalars such as Adam's step count are replicated). Parameters stay replicated over DP.

One step (inside shard_map, every rank passing its LOCAL fp32-accumulated gradient):
  1. reduce-scatter the flat gradient through `grad_comm` (fp32 | bf16 | fp8), divide by dp -> mean slice;
  2. global gradient norm = sqrt(psum over DP of the slices' squared norms) (a norm of one slice would clip
     each rank differently), clip exactly as `optax.clip_by_global_norm` does;
  3. the inner optax optimizer updates this rank's parameter slice;
  4. all-gather the updated slices (fp32) into the replicated parameters.

The inner optimizer sees a flat 1-D slice, so it must act elementwise (adam/adamw/sgd/lion, schedules,
plain weight decay). Transformations that need the pytree structure or the whole vector — global-norm
clipping (done here instead), per-leaf masks, factored (adafactor) statistics — do not fit.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.flatten_util
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from megascale_jax.parallel import grad_comm

AxisName = grad_comm.AxisName


def _axis_size_in_mesh(mesh: jax.sharding.Mesh, axis: AxisName) -> int:
    names = (axis,) if isinstance(axis, str) else tuple(axis)
    missing = [a for a in names if a not in mesh.shape]
    if missing:
        raise ValueError(f"axis={axis!r}: {missing} not in the mesh axes {tuple(mesh.shape)}")
    size = 1
    for a in names:
        size *= mesh.shape[a]
    return size


@dataclasses.dataclass(frozen=True)
class Zero1:
    """ZeRO-1 optimizer wrapper. See the module docstring for the layout and the step.

    optimizer: an elementwise optax transformation (e.g. `optax.adamw(3e-4, weight_decay=0.1)`).
    axis: the DP mesh axis name (or tuple of names), e.g. 'data'.
    mode: gradient communication, one of grad_comm.GRAD_COMM_MODES.
    max_grad_norm: clip the global gradient norm to this value (None: no clipping).
    """
    optimizer: optax.GradientTransformation
    axis: AxisName
    mode: str = "fp32"
    max_grad_norm: float | None = None
    block_size: int = 128

    def __post_init__(self):
        if self.mode not in grad_comm.GRAD_COMM_MODES:
            raise ValueError(f"mode={self.mode!r}; use one of {grad_comm.GRAD_COMM_MODES}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={self.max_grad_norm} must be > 0 (or None to disable clipping)")
        if not isinstance(self.optimizer, optax.GradientTransformation):
            raise ValueError(f"optimizer must be an optax.GradientTransformation, got {type(self.optimizer)}")

    # ---- layout -------------------------------------------------------------------------------------
    def flat_length(self, params, dp: int) -> int:
        """Padded length L of the flat parameter vector for `dp` ranks."""
        num = sum(x.size for x in jax.tree.leaves(params))
        return grad_comm.padded_length(num, dp, self.block_size)

    def _flatten_padded(self, tree, length: int):
        flat, unravel = jax.flatten_util.ravel_pytree(tree)
        return grad_comm.pad_flat(flat, length), unravel, flat.shape[0]

    # ---- outside shard_map --------------------------------------------------------------------------
    def init(self, params, mesh: jax.sharding.Mesh):
        """Optimizer state for the flat padded parameters, each array sharded `P(axis)` over `mesh`.

        Call outside shard_map (params may be replicated or host arrays). Every device ends up with the
        1/dp slice of each state array that `step` will update.
        """
        dp = _axis_size_in_mesh(mesh, self.axis)
        length = self.flat_length(params, dp)
        flat_dtype = jax.eval_shape(lambda p: jax.flatten_util.ravel_pytree(p)[0], params).dtype
        flat_shape = jax.ShapeDtypeStruct((length,), flat_dtype)
        shardings = self.state_shardings(mesh, jax.eval_shape(self.optimizer.init, flat_shape))

        def init_flat(p):
            return self.optimizer.init(self._flatten_padded(p, length)[0])

        return jax.jit(init_flat, out_shardings=shardings)(params)

    def state_specs(self, opt_state) -> Any:
        """PartitionSpecs of the sharded state (for shard_map in_specs/out_specs): P(axis) for vectors."""
        return jax.tree.map(lambda x: P(self.axis) if jnp.ndim(x) >= 1 else P(), opt_state)

    def state_shardings(self, mesh: jax.sharding.Mesh, opt_state) -> Any:
        return jax.tree.map(lambda spec: NamedSharding(mesh, spec), self.state_specs(opt_state),
                            is_leaf=lambda x: isinstance(x, P))

    # ---- inside shard_map ---------------------------------------------------------------------------
    def step(self, params, grads_local, opt_state):
        """Inside shard_map over `axis`: one ZeRO-1 update.

        params: replicated pytree (every rank the same values). grads_local: this rank's gradient, same
        structure (cast to fp32). opt_state: this rank's slice, as laid out by `init` / `state_specs`.
        Returns (new replicated params, new opt_state slice, stats) with stats = {'grad_norm': global
        norm before clipping, 'clip_scale': factor applied (1.0 = not clipped)}, both replicated.
        """
        dp = lax.axis_size(self.axis)
        length = self.flat_length(params, dp)
        flat_params, unravel, num = self._flatten_padded(params, length)
        flat_grads, _, _ = self._flatten_padded(
            jax.tree.map(lambda g: g.astype(jnp.float32), grads_local), length)

        grad_slice = grad_comm.reduce_scatter_gradients(
            flat_grads, axis=self.axis, mode=self.mode, block_size=self.block_size) / dp
        grad_norm = jnp.sqrt(lax.psum(jnp.sum(jnp.square(grad_slice)), self.axis))
        grad_slice, clip_scale = self._clip(grad_slice, grad_norm)

        slice_len = length // dp
        rank = lax.axis_index(self.axis)
        param_slice = lax.dynamic_slice_in_dim(flat_params, rank * slice_len, slice_len)
        updates, new_state = self.optimizer.update(grad_slice.astype(param_slice.dtype), opt_state, param_slice)
        new_slice = optax.apply_updates(param_slice, updates)
        new_flat = lax.all_gather(new_slice, self.axis, tiled=True, to='invarying')[:num]
        stats = {"grad_norm": grad_norm, "clip_scale": clip_scale}
        return unravel(new_flat), new_state, stats

    def _clip(self, grad_slice, grad_norm):
        """Same arithmetic as optax.clip_by_global_norm, with the norm taken over all DP slices."""
        if self.max_grad_norm is None:
            return grad_slice, jnp.ones((), jnp.float32)
        clipped = grad_norm >= self.max_grad_norm
        scale = jnp.where(clipped, self.max_grad_norm / grad_norm, 1.0).astype(jnp.float32)
        return jnp.where(clipped, (grad_slice / grad_norm) * self.max_grad_norm, grad_slice), scale


def replicated_twin(zero: Zero1) -> optax.GradientTransformation:
    """The plain-DP optimizer that ZeRO-1 must match: clip by global norm, then the inner optimizer,
    applied to the full (already DP-averaged) gradient with replicated state."""
    if zero.max_grad_norm is None:
        return zero.optimizer
    return optax.chain(optax.clip_by_global_norm(zero.max_grad_norm), zero.optimizer)


def per_device_bytes(tree) -> int:
    """Bytes that ONE device (the first one) holds of a pytree of jax Arrays: shards, not global sizes."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        if not isinstance(leaf, jax.Array):
            continue
        device = min(leaf.sharding.addressable_devices, key=lambda d: d.id)
        total += sum(s.data.nbytes for s in leaf.addressable_shards if s.device == device)
    return total
