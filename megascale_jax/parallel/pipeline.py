"""Pipeline-parallel loss and gradients: a `lax.scan` over clock ticks inside `jax.shard_map`.

The model is given as three functions, generic over what they compute (nothing here imports the model):
    first_fn(first_params, inputs_mb)          -> act        embedding; runs on stage 0
    layer_fn(layer_params, act)                -> act        one layer (or (act, aux) with has_aux=True)
    last_fn(last_params, act, targets_mb)      -> loss       head + loss (scalar mean); last stage
`act` may be any pytree of arrays; every layer keeps its shapes and dtypes.

Every schedule (see pipeline_schedules.py) runs through one executor. Each tick, each stage runs at
most one forward (F) and one backward (B) work item, each under `lax.cond` so idle work costs nothing:
  F: take the stage input (first_fn's output on chunk 0, else the stashed arrival), run the chunk's
     layers, send the result one stage down.
  B: recompute the chunk from its stashed input with `jax.vjp` (the stash holds inputs only, so its
     size is one activation per in-flight item), pull the cotangent back (on the last chunk from
     last_fn's loss, else from the cotangent received from the stage below), accumulate the chunk's
     parameter gradients in FP32, send the input cotangent one stage up; on chunk 0 also pull it
     through first_fn.
Activations go down and cotangents up by one `ppermute` each per tick. The stash and the cotangent
buffer are fixed-size arrays whose rows the schedule assigns statically, so their size is what the
schedule needs: M*V for GPipe, S*(V+1) - 1 for 1F1B/interleaved whatever M is.

Sharding: params.stages leaves [V, S, Lmax, ...] sharded P(None, axis); params.first / params.last
replicated; microbatch leaves [M, B, ...] replicated over `axis`, B sharded over `batch_axes`.
Returned gradients have the params' structure and sharding, in float32.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from megascale_jax.parallel.collectives import varying_axes
from megascale_jax.parallel.pipeline_schedules import StageLayout, build_schedule


class PipelineParams(NamedTuple):
    first: Any    # first_fn's params (replicated over the pipeline axis)
    stages: Any   # layer params in stage layout: leaves [V, S, Lmax, ...]
    last: Any     # last_fn's params (replicated over the pipeline axis)


class PipelineResult(NamedTuple):
    loss: jax.Array       # mean over microbatches (and data ranks) of last_fn's loss
    aux_loss: jax.Array   # mean over microbatches of the summed per-layer aux losses (0 without has_aux)
    grads: PipelineParams  # d(loss + aux_loss)/d(params), float32


def chunk_forward(layer_fn, has_aux, chunk_params_L, active_L, act):
    """Run one chunk's Lmax layer slots over `act`; padded slots (active False) are skipped.
    Returns (act, summed aux loss as float32 scalar)."""
    def one_layer(carry, layer):
        x, aux = carry
        params, active = layer

        def apply(x):
            out = layer_fn(params, x)
            y, a = out if has_aux else (out, jnp.zeros_like(aux))
            return _match_varying(y, x), _match_varying(jnp.asarray(a, jnp.float32), aux)

        y, a = lax.cond(active, apply, lambda x: (x, jnp.zeros_like(aux)), x)
        return (y, aux + a), None

    aux0 = jnp.zeros_like(jax.tree.leaves(act)[0], dtype=jnp.float32, shape=())
    (act, aux), _ = lax.scan(one_layer, (act, aux0), (chunk_params_L, active_L))
    return act, aux


def _index(tree, i):
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _write(tree, i, value):
    return jax.tree.map(lambda a, v: lax.dynamic_update_index_in_dim(a, v.astype(a.dtype), i, 0), tree, value)


def _to_varying(tree, axes):
    """Mark values as differing across the manual `axes` so vjp and scan carries stay per-device (a
    gradient wrt a replicated value would otherwise be all-reduced at every tick)."""
    def one(x):
        missing = tuple(a for a in axes if a not in varying_axes(x))
        return lax.pcast(x, missing, to="varying") if missing else x
    return jax.tree.map(one, tree)


def _match_varying(tree, like):
    """Give `tree` the manual axes `like` varies over: a value psum'd over an inner axis inside a
    user function is invariant there, but must flow through the same scan carry and cond. (pcast's
    transpose is a psum, which is right for shares: n equal shares count n times.)"""
    def one(x, ref):
        missing = tuple(a for a in varying_axes(ref) if a not in varying_axes(x))
        return lax.pcast(x, missing, to="varying") if missing else x
    return jax.tree.map(one, tree, like)


def _zeros_f32(tree):
    return jax.tree.map(lambda a: jnp.zeros_like(a, dtype=jnp.float32), tree)


def _f32(tree):
    return jax.tree.map(lambda a: a.astype(jnp.float32), tree)


class _StageProgram:
    """One device's part of a schedule: its stage index, its local params, and the tick body."""

    def __init__(self, fns, params, microbatches, *, layout, schedule, axis, manual_axes, has_aux):
        self.first_fn, self.layer_fn, self.last_fn = fns
        self.has_aux, self.axis, self.schedule = has_aux, axis, schedule
        self.S, self.V = layout.num_stages, layout.virtual_stages
        self.scale = 1.0 / schedule.num_microbatches
        self.stage = lax.axis_index(axis)
        self.first = _to_varying(params.first, manual_axes)
        self.last = _to_varying(params.last, manual_axes)
        self.stages_VL = _to_varying(jax.tree.map(lambda a: a[:, 0], params.stages), manual_axes)
        mask_VSL = jnp.asarray(layout.active_mask())
        self.active_VL = lax.dynamic_index_in_dim(mask_VSL, self.stage, axis=1, keepdims=False)
        self.inputs_M, self.targets_M = microbatches
        self.manual_axes = manual_axes

    def is_first(self, v):
        return (self.stage == 0) & (v == 0)

    def is_last(self, v):
        return (self.stage == self.S - 1) & (v == self.V - 1)

    def forward(self, r, stash):
        v = r["f_virtual"]
        x = lax.cond(self.is_first(v),
                     lambda: _to_varying(self.first_fn(self.first, _index(self.inputs_M, r["f_mb"])),
                                         self.manual_axes),
                     lambda: _index(stash, r["f_slot"]))
        y, _ = chunk_forward(self.layer_fn, self.has_aux, _index(self.stages_VL, v),
                             _index(self.active_VL, v), x)
        return y, x

    def skip_forward(self, r, stash):
        zeros = jax.tree.map(lambda a: jnp.zeros_like(a[0]), stash)
        return zeros, zeros

    def backward(self, r, stash, gbuf):
        v, mb = r["b_virtual"], r["b_mb"]
        active_L = _index(self.active_VL, v)
        run_chunk = functools.partial(chunk_forward, self.layer_fn, self.has_aux)
        (y, aux), chunk_vjp = jax.vjp(lambda p, x: run_chunk(p, active_L, x),
                                      _index(self.stages_VL, v), _index(stash, r["b_slot"]))
        targets = _index(self.targets_M, mb)

        def from_loss():
            loss, loss_vjp = jax.vjp(lambda lp, y: self.last_fn(lp, y, targets), self.last, y)
            d_last, g_y = loss_vjp(jnp.full_like(loss, self.scale))
            return g_y, _f32(d_last), _to_varying(loss.astype(jnp.float32), self.manual_axes)

        def from_below():
            return _index(gbuf, r["b_gslot"]), _zeros_f32(self.last), jnp.zeros_like(aux)

        g_y, d_last, loss = lax.cond(self.is_last(v), from_loss, from_below)
        d_chunk, g_x = chunk_vjp((g_y, jnp.full_like(aux, self.scale)))
        inputs = _index(self.inputs_M, mb)

        def through_first():
            _, first_vjp = jax.vjp(lambda fp: self.first_fn(fp, inputs), self.first)
            return _f32(first_vjp(g_x)[0])

        d_first = lax.cond(self.is_first(v), through_first, lambda: _zeros_f32(self.first))
        return g_x, _f32(d_chunk), d_first, d_last, loss, aux

    def skip_backward(self, r, stash, gbuf):
        zero = jnp.zeros_like(self.stage, dtype=jnp.float32)
        zero = _to_varying(zero, self.manual_axes)
        return (jax.tree.map(lambda a: jnp.zeros_like(a[0]), gbuf),
                _zeros_f32(_index(self.stages_VL, 0)), _zeros_f32(self.first), _zeros_f32(self.last),
                zero, zero)

    def shift(self, tree, down: bool):
        """Move `tree` one stage down (activations) or up (cotangents); with virtual stages the ring
        closes, because the last stage feeds stage 0's next chunk."""
        if self.S == 1:
            return tree
        pairs = [(s, s + 1) for s in range(self.S - 1)] + ([(self.S - 1, 0)] if self.V > 1 else [])
        if not down:
            pairs = [(dst, src) for src, dst in pairs]
        return lax.ppermute(tree, self.axis, pairs)

    def tick(self, carry, row_S):
        stash, gbuf, acc = carry
        r = {name: lax.dynamic_index_in_dim(col, self.stage, keepdims=False) for name, col in row_S.items()}
        f_on = (r["f_on"] == 1) & ~self.is_last(r["f_virtual"])   # the last chunk's F runs inside its B
        y, x_in = lax.cond(f_on, self.forward, self.skip_forward, r, stash)
        keep_slot = jnp.where(f_on & self.is_first(r["f_virtual"]), r["f_slot"], self.schedule.stash_slots)
        stash = _write(stash, keep_slot, x_in)   # chunk 0 stashes first_fn's output for its B
        g_x, d_chunk, d_first, d_last, loss, aux = lax.cond(
            r["b_on"] == 1, self.backward, self.skip_backward, r, stash, gbuf)
        v = r["b_virtual"]
        acc = {
            "stages": jax.tree.map(lambda a, d: _write(a, v, _index(a, v) + d), acc["stages"], d_chunk),
            "first": jax.tree.map(jnp.add, acc["first"], d_first),
            "last": jax.tree.map(jnp.add, acc["last"], d_last),
            "loss": acc["loss"] + loss, "aux": acc["aux"] + aux,
        }
        stash = _write(stash, r["recv_act_slot"], self.shift(y, down=True))
        gbuf = _write(gbuf, r["recv_grad_slot"], self.shift(g_x, down=False))
        return (stash, gbuf, acc), None

    def run(self):
        act = jax.eval_shape(self.first_fn, self.first, _index(self.inputs_M, 0))
        act_zeros = _to_varying(jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), act), self.manual_axes)
        _check_layer_keeps_shape(self.layer_fn, self.has_aux, _index(_index(self.stages_VL, 0), 0), act_zeros)

        def buffer(rows):   # one extra row: the trash row that absorbs writes nobody reads
            return _to_varying(jax.tree.map(lambda a: jnp.zeros((rows + 1,) + a.shape, a.dtype), act),
                               self.manual_axes)

        zero = _to_varying(jnp.zeros((), jnp.float32), self.manual_axes)
        acc = {"stages": _zeros_f32(self.stages_VL), "first": _zeros_f32(self.first),
               "last": _zeros_f32(self.last), "loss": zero, "aux": zero}
        xs = {name: jnp.asarray(table) for name, table in self.schedule.tables.items()}
        carry = (buffer(self.schedule.stash_slots), buffer(self.schedule.grad_slots), acc)
        (_, _, acc), _ = lax.scan(self.tick, carry, xs)
        return acc


def _check_layer_keeps_shape(layer_fn, has_aux, layer_params, act):
    out = jax.eval_shape(layer_fn, layer_params, act)
    out = out[0] if has_aux else out
    same = jax.tree.structure(out) == jax.tree.structure(act) and all(
        (o.shape, o.dtype) == (a.shape, a.dtype) for o, a in zip(jax.tree.leaves(out), jax.tree.leaves(act)))
    if not same:
        raise ValueError(f"layer_fn must return an activation shaped like first_fn's output {act}, got "
                         f"{out}; make the layers shape-preserving (with has_aux=True return (act, aux)).")


def pipeline_local_value_and_grad(first_fn: Callable, layer_fn: Callable, last_fn: Callable,
                                  params: PipelineParams, microbatches, *, layout: StageLayout,
                                  schedule: str, axis: str, batch_axes: tuple[str, ...] = (),
                                  inner_axes: tuple[str, ...] = (), has_aux: bool = False) -> PipelineResult:
    """Per-device body: call inside a `jax.shard_map` manual over `axis`, `batch_axes`, `inner_axes`.

    Takes local shards (params.stages leaves [V, 1, Lmax, ...]); returns this rank's loss and
    gradients, already summed over the pipeline axis but NOT reduced over `batch_axes` (so a caller
    can reduce them its own way: ZeRO reduce-scatter, compressed exchange) nor over `inner_axes`.
    """
    num_microbatches = jax.tree.leaves(microbatches)[0].shape[0]
    sched = build_schedule(schedule, layout.num_stages, num_microbatches, layout.virtual_stages)
    program = _StageProgram((first_fn, layer_fn, last_fn), params, microbatches, layout=layout,
                            schedule=sched, axis=axis, manual_axes=(axis, *batch_axes, *inner_axes),
                            has_aux=has_aux)
    acc = program.run()
    grads = PipelineParams(
        first=lax.psum(acc["first"], axis),   # only stage 0 holds a nonzero part
        stages=jax.tree.map(lambda a: a[:, None], acc["stages"]),
        last=lax.psum(acc["last"], axis))     # only the last stage holds a nonzero part
    loss = lax.psum(acc["loss"], axis) * program.scale
    aux = lax.psum(acc["aux"], axis) * program.scale
    return PipelineResult(loss, aux, grads)


def pipeline_param_specs(params: PipelineParams, axis: str) -> PipelineParams:
    """PartitionSpecs of a PipelineParams tree: stages sharded over `axis` on dim 1, the rest replicated."""
    return PipelineParams(first=jax.tree.map(lambda _: P(), params.first),
                          stages=jax.tree.map(lambda _: P(None, axis), params.stages),
                          last=jax.tree.map(lambda _: P(), params.last))


def pipeline_value_and_grad(first_fn: Callable, layer_fn: Callable, last_fn: Callable,
                            params: PipelineParams, microbatches, *, mesh, layout: StageLayout,
                            schedule: str, axis: str, batch_axes: tuple[str, ...] = (),
                            inner_axes: tuple[str, ...] = (), param_specs: PipelineParams | None = None,
                            microbatch_specs=None, has_aux: bool = False) -> PipelineResult:
    """Mean loss over microbatches and its gradients, pipelined over mesh axis `axis`.

    microbatches = (inputs, targets), pytrees whose leaves are [M, B, ...]: M microbatches of B
    examples; B is sharded over `batch_axes` (data parallelism; loss and grads are averaged over it).
    schedule: 'gpipe' | '1f1b' | 'interleaved' (the latter needs layout.virtual_stages >= 2 and M a
    multiple of the stage count). Call under `jax.jit`.

    inner_axes: mesh axes used inside a stage (sequence / expert parallelism). They are manual too:
    the three functions see local shards and call collectives over these axes themselves. last_fn's
    loss and layer_fn's aux are this inner rank's SHARE (e.g. local token-loss sum / global token
    count); the shares are summed over the inner axes. param_specs / microbatch_specs say how leaves
    are split over them (defaults: pipeline_param_specs, and P(None, batch_axes)). Gradients are
    summed over the inner axes a leaf is replicated over.
    (A nested shard_map inside layer_fn does not lower under this one's autodiff in jax 0.11.2.)
    """
    batch_axes, inner_axes = tuple(batch_axes), tuple(inner_axes)
    _validate(params, microbatches, mesh=mesh, layout=layout, axis=axis, batch_axes=batch_axes,
              inner_axes=inner_axes, default_batch_split=microbatch_specs is None)
    build_schedule(schedule, layout.num_stages, jax.tree.leaves(microbatches)[0].shape[0],
                   layout.virtual_stages)   # fail early, outside shard_map, on a bad combination
    if microbatch_specs is None:
        batch_spec = P(None, batch_axes if batch_axes else None)
        microbatch_specs = jax.tree.map(lambda _: batch_spec, microbatches)
    param_specs = pipeline_param_specs(params, axis) if param_specs is None else param_specs

    def body(params, microbatches):
        result = pipeline_local_value_and_grad(
            first_fn, layer_fn, last_fn, params, microbatches, layout=layout, schedule=schedule,
            axis=axis, batch_axes=batch_axes, inner_axes=inner_axes, has_aux=has_aux)
        grads = jax.tree.map(lambda g, spec: _sum_over_replicated(g, spec, inner_axes),
                             result.grads, param_specs)
        loss, aux = (lax.psum(x, inner_axes) if inner_axes else x for x in result[:2])
        result = PipelineResult(loss, aux, grads)
        return lax.pmean(result, batch_axes) if batch_axes else result

    out_specs = PipelineResult(P(), P(), param_specs)
    return jax.shard_map(body, mesh=mesh, in_specs=(param_specs, microbatch_specs), out_specs=out_specs,
                         axis_names={axis, *batch_axes, *inner_axes})(params, microbatches)


def _sum_over_replicated(grad, spec, inner_axes):
    """A leaf replicated over an inner axis got a partial gradient on each of its ranks: sum them."""
    used = {name for entry in spec if entry is not None
            for name in ((entry,) if isinstance(entry, str) else entry)}
    replicated = tuple(name for name in inner_axes if name not in used)
    return lax.psum(grad, replicated) if replicated else grad


def _validate(params, microbatches, *, mesh, layout, axis, batch_axes, inner_axes, default_batch_split):
    if axis not in mesh.shape:
        raise ValueError(f"axis={axis!r} is not a mesh axis {tuple(mesh.shape)}; pass the pipeline axis name.")
    if mesh.shape[axis] != layout.num_stages:
        raise ValueError(f"mesh axis {axis!r} has {mesh.shape[axis]} devices but layout.num_stages="
                         f"{layout.num_stages}; build the StageLayout with num_stages={mesh.shape[axis]}.")
    for name in batch_axes + inner_axes:
        if name not in mesh.shape or name == axis:
            raise ValueError(f"batch_axes / inner_axes entry {name!r} must be a mesh axis other than "
                             f"{axis!r}; mesh axes are {tuple(mesh.shape)}.")
    want = (layout.virtual_stages, layout.num_stages, layout.max_layers)
    for path, leaf in jax.tree_util.tree_leaves_with_path(params.stages):
        if tuple(leaf.shape[:3]) != want:
            raise ValueError(f"params.stages{jax.tree_util.keystr(path)} has shape {leaf.shape}; stage "
                             f"params need leading dims (V, S, Lmax) = {want}: build them with "
                             "layout.to_stage_layout(stacked_layer_params).")
    if not isinstance(microbatches, (tuple, list)) or len(microbatches) != 2:
        raise ValueError("microbatches must be an (inputs, targets) pair of pytrees with leaves [M, B, ...].")
    leaves = jax.tree.leaves(microbatches)
    data_size = 1
    for name in batch_axes if default_batch_split else ():
        data_size *= mesh.shape[name]
    for leaf in leaves:
        if leaf.ndim < 2 or leaf.shape[0] != leaves[0].shape[0] or leaf.shape[1] % data_size:
            raise ValueError(
                f"every microbatch leaf must be [M, B, ...] with one M (here {leaves[0].shape[0]}) and B "
                f"divisible by the batch axes' size {data_size}; got a leaf of shape {leaf.shape}.")


def sequential_value_and_grad(first_fn: Callable, layer_fn: Callable, last_fn: Callable,
                              params: PipelineParams, microbatches, *, layout: StageLayout,
                              has_aux: bool = False) -> PipelineResult:
    """The plain twin: the same loss and gradients without a pipeline (plain autodiff, chunks in
    order on whatever devices hold the arrays). Same conventions as pipeline_value_and_grad."""
    active_VSL = jnp.asarray(layout.active_mask())
    S = layout.num_stages

    def objective(params):
        def one_microbatch(microbatch):
            inputs, targets = microbatch
            x, aux = first_fn(params.first, inputs), jnp.zeros((), jnp.float32)
            for chunk in range(layout.num_stages * layout.virtual_stages):
                v, s = divmod(chunk, S)
                x, a = chunk_forward(layer_fn, has_aux, jax.tree.map(lambda l: l[v, s], params.stages),
                                     active_VSL[v, s], x)
                aux = aux + a
            return last_fn(params.last, x, targets).astype(jnp.float32), aux

        losses, auxes = lax.map(one_microbatch, tuple(microbatches))
        return losses.mean() + auxes.mean(), (losses.mean(), auxes.mean())

    (_, (loss, aux)), grads = jax.value_and_grad(objective, has_aux=True)(params)
    return PipelineResult(loss, aux, _f32(grads))
