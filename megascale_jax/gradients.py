"""Gradient sources: (params, batch) -> (loss, metrics, grads), one of

    autodiff     jax.value_and_grad of the model's loss (embed -> blocks -> head_loss);
    accumulate   the same over M microbatches in a `lax.scan` with an FP32 accumulator: one optimizer
                 update per step whatever M is, activation memory of one microbatch;
                 Both take the parameters with the GEMM weights as the state's compute-dtype copies
                 (megascale_jax/step.py `source_params`), cast once per step, not once per microbatch inside
                 the loss: their per-microbatch gradients are the bf16 GEMMs' outputs (as they were with the
                 cast inside the model: bit for bit for XLA's dots, tests/test_gradients.py), at half the bytes
                 for what reads them (the unrolled stack's concatenation and, with one microbatch, the
                 non-finite check, the global norm and AdamW's read; with several, `accumulate` sums them in
                 float32). The macro MoE layer's expert weight gradients, summed over its chunks, are rounded
                 to bf16 once more, as the autodiff path's already were;
    pipeline     the microbatches through parallel/pipeline.py's schedule (GPipe / 1F1B / interleaved), its
                 stages calling the model's own embed / scanned block / head_loss on their parts of the state.

Convention (what megascale_jax/updaters.py's updaters expect). In the global view (XLA plan) grads are the
gradient. Per device (inside the step's shard_map) grads are this device's contribution such that the
MEAN over 'data' is the gradient: already summed over 'intra' and 'pipe' wherever a parameter is
replicated there, NOT reduced over 'data' (the updater does that its own way: all-reduce, compressed
exchange, ZeRO-1 reduce-scatter). loss and metrics are the global values on every device.

Microbatch m holds the (local) batch rows m, m + M, m + 2M, ...: with the batch sharded over 'data' in
contiguous blocks, that is the same split of the global batch on any number of data ranks.

Layer pieces (`in_layer_pieces`, kernels.adamw='pallas'): a leaf of a fully unrolled layer stack may be given as
`LayerPieces`, one array per layer, which the loss stacks again (`model_loss`). Its gradient then arrives as
pieces too: XLA folds the unrolled scan's stacking of the layers' cotangents into the slices it is cut back into,
so the concatenation of every stacked gradient (a copy of each, which the optimizer then reads) is never built.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from megascale_jax.model.transformer import scan_body
from megascale_jax.parallel.collectives import vary_like, varying_axes
from megascale_jax.parallel.pipeline import PipelineParams, pipeline_local_value_and_grad
from megascale_jax.parallel.pipeline_schedules import StageLayout
from megascale_jax.parallel.plan import DATA, INTRA, PIPE

GradientSource = Callable  # (params, batch) -> (loss, metrics, grads)
SUMMED_METRICS = ("tokens_per_expert", "dropped_tokens")   # counts add over microbatches; the rest average


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class LayerPieces:
    """A stacked [L, ...] leaf as its L per-layer arrays (a pytree node: its pieces are the leaves)."""
    pieces: tuple

    def tree_flatten(self):
        return self.pieces, None

    @classmethod
    def tree_unflatten(cls, _, pieces):
        return cls(tuple(pieces))


def is_layer_pieces(x) -> bool:
    return isinstance(x, LayerPieces)


def in_layer_pieces(tree, stacks):
    """`tree` (a parameter state or a part of it) with the leaves under the top-level keys `stacks` (layer stacks,
    leading axis = layer) as LayerPieces; None or () leaves it as it is."""
    def split(path, x):
        if stacks and isinstance(path[0], jax.tree_util.DictKey) and path[0].key in stacks:
            return LayerPieces(tuple(x[i] for i in range(x.shape[0])))
        return x
    return jax.tree_util.tree_map_with_path(split, tree)


def stacked(tree):
    """`tree` with every LayerPieces stacked back into one array."""
    return jax.tree.map(lambda x: jnp.stack(x.pieces) if is_layer_pieces(x) else x, tree, is_leaf=is_layer_pieces)


def model_loss(graphdef, layout):
    """loss_fn(params, batch) -> (loss, metrics): the model's plain forward (model/transformer.py); leaves given
    as LayerPieces are stacked inside, so their gradient comes out in pieces."""
    return lambda params, batch: nnx.merge(graphdef, stacked(params)).loss(batch, layout)


def autodiff(loss_fn, *, per_device: bool) -> GradientSource:
    def source(params, batch):
        if not per_device:
            (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
            return loss, metrics, grads
        dp = lax.axis_size(DATA)
        # Varying copies: the gradient stays this device's own (no implicit psum over 'data'); x dp turns the
        # global mean's gradient into the local contribution whose mean over 'data' is the gradient.
        local = jax.tree.map(lambda p: lax.pcast(p, DATA, to="varying"), params)

        def scaled(p):
            loss, metrics = loss_fn(p, batch)
            return loss * dp, (loss, metrics)

        (_, (loss, metrics)), grads = jax.value_and_grad(scaled, has_aux=True)(local)
        return loss, metrics, grads
    return source


def split_microbatches(batch, num_microbatches: int):
    """{'inputs', 'targets'} [B, S] -> [M, B/M, S], microbatch m = rows m, m + M, ..."""
    def one(x_BS):
        return jnp.swapaxes(x_BS.reshape(x_BS.shape[0] // num_microbatches, num_microbatches, -1), 0, 1)
    return jax.tree.map(one, batch)


def accumulate(single: GradientSource, num_microbatches: int) -> GradientSource:
    """`single` over M microbatches; loss and averaged metrics are microbatch means, counts are sums, grads
    the fp32 mean. Equal to one step on the whole batch where the loss is a token mean (CE, z-loss); the
    balance loss is a product of two token means and is computed per microbatch, as in every pipeline.

    The first microbatch is peeled off the loop: it starts the accumulator (g * 1/M in float32) instead of adding
    into a zero-filled one, so no pass writes zeros and none reads them back. With M = 2 the loop left has one trip,
    which XLA removes (no while loop in the compiled step): the two microbatches' bf16 gradients meet in one
    elementwise sum that XLA can fuse with what reads it, where the loop over a zeroed carry took a fill and two
    read-add-write passes of float32 (4 + 10 + 10 bytes a parameter). The price is compile time: the model's
    forward and backward are in the program twice (the tiny CPU config's 2-microbatch step: 4.3 s vs 3.8 s)."""
    if num_microbatches == 1:
        return single

    def source(params, batch):
        microbatches = split_microbatches(batch, num_microbatches)
        # the mean's 1/M inside the accumulating pass: a separate scaling pass over every gradient after the loop
        # was 2.9 ms of a 4-microbatch deepseekmoe_small step on an H100 (results_one_pass_ce_acc4 in
        # benchmarks/results/train_step_profile_deepseekmoe_small_1xh100.json); exact for M a power of 2
        scale = 1.0 / num_microbatches

        def scaled_in_float32(result):
            loss, metrics, grads = result
            rest = jax.tree.map(lambda v: v.astype(jnp.float32) if _is_float(v) else v,
                                jax.tree.map(jnp.asarray, (loss, metrics)))
            return rest, jax.tree.map(lambda g: g.astype(jnp.float32) * scale, grads)

        def body(acc, microbatch):
            (rest, grads), (acc_rest, acc_grads) = scaled_in_float32(single(params, microbatch)), acc
            return (jax.tree.map(jnp.add, acc_rest, rest), jax.tree.map(jnp.add, acc_grads, grads)), None

        first = scaled_in_float32(single(params, jax.tree.map(lambda x: x[0], microbatches)))
        (loss, metrics), grads = lax.scan(body, first, jax.tree.map(lambda x: x[1:], microbatches))[0]
        metrics = {k: v if k in SUMMED_METRICS else v * scale for k, v in metrics.items()}
        return loss * scale, metrics, grads
    return source


def _is_float(a) -> bool:
    return jnp.issubdtype(a.dtype, jnp.floating)


def pipeline(graphdef, layout, *, param_specs, num_layers: int, num_stages: int, schedule: str,
             num_microbatches: int, virtual_stages: int, layers_over_pipe: bool) -> GradientSource:
    """Per device only: the microbatches through the pipeline schedule over mesh axis 'pipe'.

    The model's one graphdef serves every stage: a stage merges it with the whole local state and takes
    gradients only with respect to its own part (`first`: embedding and dense blocks, `stages`: its chunk
    of MoE blocks, `last`: final norm and head), so embed / scan_body / head_loss are the plain path's."""
    stage_layout = StageLayout.balanced(num_layers, num_stages, virtual_stages)

    def source(params, batch):
        model = nnx.merge(graphdef, params)
        layer_body, _ = scan_body(model.moe_blocks, layout, model.remat)
        tied = "head_DV" not in params
        first_keys = ("embed_tokens",) + (("dense_blocks",) if "dense_blocks" in params else ())
        last_keys = ("final_norm", "embed_tokens" if tied else "head_DV")

        def with_part(part):
            return nnx.merge(graphdef, nnx.State({**params, **part}))

        def first_fn(first, tokens_BS):
            return with_part(first).embed(tokens_BS, layout)

        def layer_fn(layer_state, x_BSD):
            y_BSD, stats = layer_body(x_BSD, layer_state)
            return y_BSD, model.moe_loss(stats) / num_layers

        def last_fn(last, x_BSD, targets_BS):
            # Typed per device like the MoE losses, which the executor's scan carry types so (see below).
            return vary_like(with_part(last).head_loss(x_BSD, targets_BS, layout), x_BSD)

        def split(params):
            return PipelineParams({k: params[k] for k in first_keys},
                                  _this_stage(params["moe_blocks"], stage_layout, layers_over_pipe),
                                  {k: params[k] for k in last_keys})

        microbatches = split_microbatches(batch, num_microbatches)
        result = pipeline_local_value_and_grad(
            first_fn, layer_fn, last_fn, split(params), (microbatches["inputs"], microbatches["targets"]),
            layout=stage_layout, schedule=schedule, axis=PIPE, batch_axes=(DATA,), inner_axes=(INTRA,),
            has_aux=True)
        grads = _onto_params(params, result.grads, first_keys, last_keys,
                             lambda blocks: _this_stage(blocks, stage_layout, layers_over_pipe))
        # Every stage loss is the global mean, typed as varying over (data, intra): the executor then seeds it
        # on each of those dp x n devices, and the typing's transpose adds the n x dp copies. Summed over the
        # replicas of a leaf (_sum_partials), the mean over 'data' is then n x the gradient: scale by 1/n.
        inner = lax.axis_size(INTRA)
        grads = jax.tree.map(lambda g, spec: _sum_partials(g, spec) / inner, grads, param_specs)
        # The losses are global means already (head_loss, the router's token means), typed per device.
        loss, moe_loss = (lax.pmean(x, tuple(varying_axes(x))) for x in (result.loss, result.aux_loss))
        return loss + moe_loss, {"ce": loss, "moe_loss": moe_loss}, grads
    return source


def _onto_params(params, parts: PipelineParams, first_keys, last_keys, this_stage):
    """The pipeline's gradients of (first, stages, last) as a gradient of `params`: the tied embedding's
    two parts added, the stage chunk put back where `this_stage` took it from (its transpose)."""
    out = {k: parts.first[k] for k in first_keys}
    for k in last_keys:
        out[k] = jax.tree.map(jnp.add, out[k], parts.last[k]) if k in out else parts.last[k]
    # vjp wants the primal typed like its cotangent (varying over the mesh axes the pipeline's gradients are).
    blocks = jax.tree.map(lambda a, g: vary_like(a.astype(jnp.float32), g), params["moe_blocks"],
                          _like_blocks(params["moe_blocks"], parts.stages))
    _, pull_back = jax.vjp(this_stage, blocks)
    (out["moe_blocks"],) = pull_back(parts.stages)
    leaves = [leaf for k in params for leaf in jax.tree.leaves(out[k])]
    return jax.tree.unflatten(jax.tree.structure(params), leaves)


def _like_blocks(blocks, stage_grads):
    """One stage-gradient leaf per block leaf (same tree), to read the shard_map types from."""
    return jax.tree.map(lambda _, g: g, blocks, stage_grads)


def _this_stage(blocks, stage_layout: StageLayout, layers_over_pipe: bool):
    """This device's [V, 1, Lmax, ...] chunk of the MoE stack: its local block shard when the layers are
    sharded over 'pipe', else cut from the whole stack."""
    if layers_over_pipe:
        return jax.tree.map(lambda a: a[None, None], blocks)
    stage = lax.axis_index(PIPE)
    return jax.tree.map(lambda a: lax.dynamic_slice_in_dim(stage_layout.to_stage_layout(a), stage, 1, axis=1),
                        blocks)


def _sum_partials(grad, spec):
    """The pipeline keeps every gradient per device: a leaf replicated over 'pipe' or 'intra' holds a partial
    gradient on each of those ranks (its own layers, its own tokens); sum them there."""
    used = {name for entry in spec if entry is not None
            for name in ((entry,) if isinstance(entry, str) else entry)}
    axes = tuple(a for a in (PIPE, INTRA) if a not in used and a in varying_axes(grad))
    return lax.psum(grad, axes) if axes else grad
