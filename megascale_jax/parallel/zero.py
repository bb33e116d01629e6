"""ZeRO-1 data parallelism: optimizer state sharded over the data-parallel (DP) axis.

Layout. The parameters (of one bucket, see Groups and Buckets) are flattened into one vector of length
L = n rounded up to a multiple of dp * block (and of `pad_multiple`), zero padded. Rank r of the DP axis
owns the contiguous slice [r*L/dp, (r+1)*L/dp) and holds the optax state of that slice only; outside
shard_map those state arrays are global [L] arrays sharded `P(axis)` (scalars such as Adam's step count are
replicated). Parameters stay replicated over DP.

One step (inside shard_map, every rank passing its LOCAL fp32-accumulated gradient):
  1. reduce-scatter the flat gradient through `grad_comm` (fp32 | bf16 | fp8), divide by dp -> mean slice;
  2. global gradient norm = sqrt(psum over DP of the slices' squared norms) (a norm of one slice would clip
     each rank differently), clip exactly as `optax.clip_by_global_norm` does;
  3. the inner optax optimizer updates this rank's parameter slice;
  4. all-gather the updated slices (fp32) into the replicated parameters.

Groups. Under expert or tensor parallelism some parameters are sharded along other mesh axes (`shard_axes`,
the intra-node axis) and differ between devices there, while others (attention weights under SP, norms,
the router) are replicated along them. Each device flattens each group of its own leaves separately, group
'shared' (replicated along shard_axes) and group 'sharded', because one array has one shard_map type: the
shared group's state and updated parameters stay replicated over shard_axes (state spec P(axis)); the
sharded group's state is laid out P((*shard_axes, axis)). The global gradient norm sums the shared group
over `axis` and the sharded group over `axis` and shard_axes, so every parameter counts once. Without
shard_axes everything is one 'shared' group.

Buckets. Each group's leaves, raveled and laid end to end in leaf order, are cut into buckets of at most
`bucket_elements` elements (a stacked expert weight of several billion elements spans several buckets), each
flattened and reduce-scattered on its own: every offset is static or below 2^31, and no collective carries
the whole model in one message. Optimizer state is {'<group>/<n>': optax state of that bucket}.

The inner optimizer sees a flat 1-D slice, so it must act elementwise (adam/adamw/sgd/lion, schedules,
plain weight decay). Transformations that need the pytree structure or the whole vector — global-norm
clipping (done here instead), per-leaf masks, factored (adafactor) statistics — do not fit.
"""
from __future__ import annotations

import dataclasses
import math
from enum import StrEnum
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from megascale_jax.parallel import grad_comm
from megascale_jax.parallel.collectives import varying_axes

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


class OptimizerSharding(StrEnum):
    NONE = "none"      # optimizer state sharded like the parameters, replicated over data
    ZERO1 = "zero1"    # optimizer state sharded over data (this module)


SHARED, SHARDED = "shared", "sharded"


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One flat vector's contents: (leaf index, first element, end element) ranges of raveled leaves, in order."""
    pieces: tuple[tuple[int, int, int], ...]

    @property
    def size(self) -> int:
        return sum(stop - start for _, start, stop in self.pieces)


def _group(key: str) -> str:
    """The group ('shared' | 'sharded') of a bucket key '<group>/<n>'."""
    return key.split("/")[0]


OptimizerFactory = Callable[[list, int], optax.GradientTransformation]


@dataclasses.dataclass(frozen=True)
class Zero1:
    """ZeRO-1 optimizer wrapper. See the module docstring for the layout and the step.

    optimizer: an elementwise optax transformation (e.g. `optax.adamw(3e-4, weight_decay=0.1)`), or a function
        (segments, padded length) -> transformation for state that depends on the flat layout (the trainer's
        weight-decay mask); segments are (ndim of the leaf, elements of it in this bucket), in bucket order.
    axis: the DP mesh axis name (or tuple of names), e.g. 'data'.
    mode: gradient communication, one of grad_comm.GRAD_COMM_MODES.
    max_grad_norm: clip the global gradient norm to this value (None: no clipping).
    shard_axes: mesh axes along which some parameters are sharded (e.g. ('intra',)); () if none are.
    bucket_elements: the most elements one flat bucket holds (2^28: 1 GiB of fp32 gradient).
    pad_multiple: flat vectors are padded to a multiple of lcm(dp * block_size, pad_multiple). With a
        pad_multiple that dp * block_size divides for every dp you run (e.g. 64 * block_size for dp in
        1, 2, 4, ..., 64), the state's global shapes do not depend on dp, so a checkpoint restores onto another
        data-parallel size. 0: pad to dp * block_size only (least padding).
    """
    optimizer: optax.GradientTransformation | OptimizerFactory
    axis: AxisName
    mode: str = "fp32"
    max_grad_norm: float | None = None
    block_size: int = 128
    shard_axes: tuple[str, ...] = ()
    bucket_elements: int = 1 << 28
    pad_multiple: int = 0

    def __post_init__(self):
        if self.pad_multiple < 0:
            raise ValueError(f"pad_multiple={self.pad_multiple} must be >= 0")
        if not 0 < self.bucket_elements < 2**31:
            raise ValueError(f"bucket_elements={self.bucket_elements} must be in (0, 2^31) (int32 indices)")
        if self.mode not in grad_comm.GRAD_COMM_MODES:
            raise ValueError(f"mode={self.mode!r}; use one of {grad_comm.GRAD_COMM_MODES}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={self.max_grad_norm} must be > 0 (or None to disable clipping)")
        if not (isinstance(self.optimizer, optax.GradientTransformation) or callable(self.optimizer)):
            raise ValueError(f"optimizer must be an optax.GradientTransformation (or a factory of one), got "
                             f"{type(self.optimizer)}")
        if set(self._axes) & set(self.shard_axes):
            raise ValueError(f"shard_axes={self.shard_axes} must not contain the ZeRO axis {self.axis!r}")

    @property
    def _axes(self) -> tuple[str, ...]:
        return (self.axis,) if isinstance(self.axis, str) else tuple(self.axis)

    # ---- layout -------------------------------------------------------------------------------------
    def flat_length(self, params, dp: int) -> int:
        """Padded length L of the flat vector of `params` (a pytree or one group's leaves) for `dp` ranks."""
        return self._padded(sum(x.size for x in jax.tree.leaves(params)), dp)

    def _padded(self, size: int, dp: int) -> int:
        """size rounded up to a multiple of lcm(dp * block_size, pad_multiple) (at least one multiple)."""
        quantum = math.lcm(dp * self.block_size, max(self.pad_multiple, 1))
        return max(quantum, -(-size // quantum) * quantum)

    def optimizer_for(self, bucket: Bucket, leaves, length: int) -> optax.GradientTransformation:
        if isinstance(self.optimizer, optax.GradientTransformation):
            return self.optimizer
        return self.optimizer([(leaves[i].ndim, stop - start) for i, start, stop in bucket.pieces], length)

    def _bucket_plan(self, sharded_flags, sizes) -> dict[str, Bucket]:
        """The buckets '<group>/<n>' (see Buckets): static element ranges of the group's leaves, in order."""
        out = {}
        for group, sharded in ((SHARED, False), (SHARDED, True)):
            buckets, used = [[]], 0
            for i, (flag, size) in enumerate(zip(sharded_flags, sizes)):
                start = 0
                while flag == sharded and start < size:
                    if used == self.bucket_elements:
                        buckets.append([])
                        used = 0
                    take = min(size - start, self.bucket_elements - used)
                    buckets[-1].append((i, start, start + take))
                    used, start = used + take, start + take
            out.update({f"{group}/{n}": Bucket(tuple(b)) for n, b in enumerate(buckets) if b})
        return out

    def _flatten(self, bucket: Bucket, leaves, length: int, dtype=None):
        """The bucket's pieces laid end to end (in `dtype`, default their common type), zero-padded."""
        dtype = dtype or jnp.result_type(*(leaves[i] for i, _, _ in bucket.pieces))
        flat = jnp.concatenate([leaves[i].reshape(-1)[start:stop].astype(dtype)
                                for i, start, stop in bucket.pieces])
        return grad_comm.pad_flat(flat, length)

    def _sharded_by_spec(self, spec) -> bool:
        named = {a for entry in spec if entry is not None for a in ((entry,) if isinstance(entry, str) else entry)}
        return self._shard_flag(named & set(self.shard_axes))

    def _sharded_by_type(self, leaf) -> bool:
        return self._shard_flag(varying_axes(leaf) & set(self.shard_axes))

    def _shard_flag(self, along: set) -> bool:
        if along and along != set(self.shard_axes):
            raise ValueError(f"a parameter sharded along {sorted(along)} but not all of shard_axes="
                             f"{self.shard_axes}: pass only the axes every sharded parameter uses")
        return bool(along)

    # ---- outside shard_map --------------------------------------------------------------------------
    def init(self, params, mesh: jax.sharding.Mesh, param_specs=None):
        """Optimizer state {group: optax state} of each group's flat padded parameters, every vector sharded
        as `state_specs` says; `param_specs` (default: replicated) says how `params` are sharded.

        Call outside shard_map. Every device ends up with the 1/dp slice of its groups' state that `step`
        will update; each computes only that slice.
        """
        dp = _axis_size_in_mesh(mesh, self.axis)
        if self.shard_axes:
            _axis_size_in_mesh(mesh, self.shard_axes)
        param_specs = param_specs if param_specs is not None else jax.tree.map(lambda _: P(), params)
        spec_leaves = jax.tree.leaves(param_specs, is_leaf=lambda x: isinstance(x, P))
        sharded_flags = [self._sharded_by_spec(s) for s in spec_leaves]

        def init_local(p):
            leaves, rank, state = jax.tree.leaves(p), lax.axis_index(self.axis), {}
            for key, bucket in self._bucket_plan(sharded_flags, [x.size for x in leaves]).items():
                length = self._padded(bucket.size, dp)
                n = length // dp
                state[key] = jax.tree.map(
                    lambda x, n=n: lax.dynamic_slice_in_dim(x, rank * n, n) if jnp.ndim(x) >= 1 else x,
                    self.optimizer_for(bucket, leaves, length).init(self._flatten(bucket, leaves, length)))
            return state

        def run(p):
            out_specs = self.state_specs(jax.eval_shape(
                jax.shard_map(init_local, mesh=mesh, in_specs=(param_specs,), out_specs=P(), check_vma=False), p))
            return jax.shard_map(init_local, mesh=mesh, in_specs=(param_specs,), out_specs=out_specs)(p)

        return jax.jit(run)(params)

    def state_specs(self, opt_state) -> Any:
        """PartitionSpecs of the state (for shard_map in_specs/out_specs): vectors of group 'shared' are
        P(axis), of group 'sharded' P((*shard_axes, axis)); scalars (Adam's count) are replicated."""
        vector = {SHARED: P(self.axis), SHARDED: P(tuple(self.shard_axes) + self._axes)}
        return {key: jax.tree.map(lambda x, v=vector[_group(key)]: v if jnp.ndim(x) >= 1 else P(), s)
                for key, s in opt_state.items()}

    def state_shardings(self, mesh: jax.sharding.Mesh, opt_state) -> Any:
        return jax.tree.map(lambda spec: NamedSharding(mesh, spec), self.state_specs(opt_state),
                            is_leaf=lambda x: isinstance(x, P))

    # ---- inside shard_map ---------------------------------------------------------------------------
    def step(self, params, grads_local, opt_state):
        """Inside shard_map over `axis` (and shard_axes): one ZeRO-1 update.

        params: this device's parameters (replicated over `axis`). grads_local: this rank's gradient, same
        structure (cast to fp32). opt_state: this rank's slices, as laid out by `init` / `state_specs`.
        Returns (new params, new opt_state, stats) with stats = {'grad_norm': global norm before clipping,
        'clip_scale': factor applied (1.0 = not clipped)}, both replicated.
        """
        dp = lax.axis_size(self.axis)
        leaves, treedef = jax.tree.flatten(params)
        grad_leaves = treedef.flatten_up_to(grads_local)
        plan = self._bucket_plan([self._sharded_by_type(x) for x in leaves], [x.size for x in leaves])
        rank = lax.axis_index(self.axis)

        grad_slices, norm_sq = {}, jnp.zeros((), jnp.float32)
        for key, bucket in plan.items():
            length = self._padded(bucket.size, dp)
            flat_grads = self._flatten(bucket, grad_leaves, length, jnp.float32)
            grad_slices[key] = grad_comm.reduce_scatter_gradients(
                flat_grads, axis=self.axis, mode=self.mode, block_size=self.block_size) / dp
            along = self._axes + (tuple(self.shard_axes) if _group(key) == SHARDED else ())
            norm_sq = norm_sq + lax.psum(jnp.sum(jnp.square(grad_slices[key])), along)
        grad_norm = jnp.sqrt(norm_sq)

        pieces, new_state, clip_scale = {i: [] for i in range(len(leaves))}, {}, jnp.ones((), jnp.float32)
        for key, bucket in plan.items():
            length = self._padded(bucket.size, dp)
            grad_slice, clip_scale = self._clip(grad_slices[key], grad_norm)
            n = length // dp
            param_slice = lax.dynamic_slice_in_dim(self._flatten(bucket, leaves, length), rank * n, n)
            updates, new_state[key] = self.optimizer_for(bucket, leaves, length).update(
                grad_slice.astype(param_slice.dtype), opt_state[key], param_slice)
            new_slice = optax.apply_updates(param_slice, updates)
            new_flat = lax.all_gather(new_slice, self.axis, tiled=True, to='invarying')
            offset = 0
            for i, start, stop in bucket.pieces:
                pieces[i].append(new_flat[offset:offset + stop - start])
                offset += stop - start
        new_leaves = [jnp.concatenate(pieces[i]).reshape(x.shape).astype(x.dtype) if pieces[i] else x
                      for i, x in enumerate(leaves)]
        stats = {"grad_norm": grad_norm, "clip_scale": clip_scale}
        return treedef.unflatten(new_leaves), new_state, stats

    def _clip(self, grad_slice, grad_norm):
        """Same arithmetic as optax.clip_by_global_norm, with the norm taken over all DP slices."""
        if self.max_grad_norm is None:
            return grad_slice, jnp.ones((), jnp.float32)
        clipped = grad_norm >= self.max_grad_norm
        scale = jnp.where(clipped, self.max_grad_norm / grad_norm, 1.0).astype(jnp.float32)
        return jnp.where(clipped, (grad_slice / grad_norm) * self.max_grad_norm, grad_slice), scale
