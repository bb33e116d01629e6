"""The MoE Transformer through the pipeline schedules: an adapter from the NNX model to parallel/pipeline.py.

The model's state is cut into the pipeline's three parts:
    first   {'embed'[, 'dense_blocks']}                first_fn: token embedding and the leading dense
                                                       layers (stage 0, which holds them whole)
    stages  'moe_blocks' ([L, ...] -> StageLayout [V, S, Lmax, ...], sharded over 'pipe')
                                                       layer_fn: one Block -> (act, weighted MoE losses)
    last    {'final_norm', 'head_DV' | tied 'embed'}   last_fn: final norm, logits, cross-entropy
With tied embeddings the table sits in both `first` and `last`; its two gradients are added.

Loss. Each microbatch's total is ce + aux_w * mean_layers(aux) + z_w * mean_layers(z), and the step's
loss is the mean over microbatches (as `loss.objective` on each microbatch, averaged). CE and the z-loss
are token means, so with equal microbatches that equals `objective` on the whole batch. The balance loss
is NOT linear in the tokens (a product of two token means), so it is computed per microbatch -- over all
of the microbatch's tokens, across data and intra ranks, via `layout.token_mean` -- and matches `objective`
on the whole batch only when num_microbatches == 1 (the per-microbatch reference is exact).

Microbatch m holds the batch rows m, m + M, m + 2M, ...: with the batch sharded over 'data' in
contiguous blocks, every data rank then already holds its part of every microbatch (no reshuffle).

Mesh: (data, pipe, intra) from parallel/plan.py. The pipeline's shard_map is manual over all three:
'pipe' is the pipeline axis, 'data' the batch axis, 'intra' the inner axis. With the ManualLayout the
Block's SP / EP hooks call their collectives over 'intra' directly inside it (its `evaluate` wrapper is
not used: a nested shard_map does not lower); with the LocalLayout 'intra' must have size 1.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from megascale_jax.model.layers import output_logits
from megascale_jax.model.layout import LocalLayout
from megascale_jax.model.loss import cross_entropy
from megascale_jax.model.manual_layout import ManualLayout
from megascale_jax.model.transformer import REMAT_POLICIES, run_stack
from megascale_jax.parallel.collectives import varying_axes
from megascale_jax.parallel.pipeline import PipelineParams, pipeline_value_and_grad
from megascale_jax.parallel.pipeline_schedules import StageLayout, schedule_summary
from megascale_jax.parallel.plan import DATA, INTRA, PIPE


def bubble_report(schedule: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> dict:
    """Ticks, stash rows and bubble fraction of a schedule (pipeline_schedules.schedule_summary)."""
    return schedule_summary(schedule, num_stages, num_microbatches, virtual_stages)


@dataclasses.dataclass(frozen=True)
class DataMeanLayout(LocalLayout):
    """The LocalLayout inside the pipeline's shard_map, where each data rank sees only its rows: token
    means (the router's balance and z statistics) are averaged over 'data', so a microbatch's balance
    loss is computed over all of its tokens, as the ManualLayout does."""

    def token_mean(self, x):
        return lax.pmean(x, DATA) if DATA in varying_axes(x) else x


def pipeline_loss_and_grads(graphdef, params, batch, *, mesh, moe_cfg, layout, schedule: str,
                            num_microbatches: int, virtual_stages: int = 1):
    """Loss, metrics and gradients of the model, pipelined over mesh axis 'pipe'. Call under jax.jit.

    graphdef, params: `nnx.split(model)` of a Transformer (leading dense layers run on stage 0).
    batch: {'inputs', 'targets'} int32 [B, S]; B divisible by num_microbatches * data, S by intra
      under the ManualLayout. Sharding in: anything (the pipeline reshards to P(None, data[, intra])).
    layout: LocalLayout (mesh intra == 1) or ManualLayout (SP / EP / TP over 'intra' inside each stage).
    schedule: 'gpipe' | '1f1b' | 'interleaved' (the latter with virtual_stages >= 2).
    Returns (loss, metrics, grads): loss = mean over microbatches of ce + weighted MoE losses;
      metrics = {'ce', 'moe_loss'} (moe_loss = the weighted aux + z term); grads has params' structure,
      float32, sharded as the pipeline leaves them (moe_blocks gathered back to [L, ...]).
    """
    model = nnx.merge(graphdef, params)
    num_layers = _validate(model, params, batch, mesh=mesh, layout=layout, num_microbatches=num_microbatches)
    manual = isinstance(layout, ManualLayout)
    block_layout = layout if manual else DataMeanLayout(layout.attention_impl, layout.grouped_gemm)
    stage_layout = StageLayout.balanced(num_layers, mesh.shape[PIPE], virtual_stages)
    tied = "head_DV" not in params

    def split(params):
        head = "embed" if tied else "head_DV"
        first = {"embed": params["embed"]}
        if "dense_blocks" in params:
            first["dense_blocks"] = params["dense_blocks"]
        last = {"final_norm": params["final_norm"], head: params[head]}
        return PipelineParams(first, stage_layout.to_stage_layout(params["moe_blocks"]), last)

    pipe_params = split(params)
    first_fn, layer_fn, last_fn = _stage_functions(model, block_layout, moe_cfg, num_layers,
                                                   mesh.shape[INTRA], tied)
    seq_axis = INTRA if manual else None
    token_spec = P(None, DATA, seq_axis)
    result = pipeline_value_and_grad(
        first_fn, layer_fn, last_fn, pipe_params, _microbatches(batch, num_microbatches),
        mesh=mesh, layout=stage_layout, schedule=schedule, axis=PIPE, batch_axes=(DATA,),
        inner_axes=(INTRA,), param_specs=_param_specs(pipe_params, layout, manual),
        microbatch_specs=(token_spec, token_spec), has_aux=True)
    # split() only selects and re-lays-out leaves (linear), so its transpose maps the pipeline's
    # gradients back onto params' exact structure, adding the tied embedding's two parts.
    _, pull_back = jax.vjp(split, jax.tree.map(lambda a: a.astype(jnp.float32), params))
    (grads,) = pull_back(result.grads)
    metrics = {"ce": result.loss, "moe_loss": result.aux_loss}
    return result.loss + result.aux_loss, metrics, grads


def _stage_functions(model, block_layout, moe_cfg, num_layers: int, intra_size: int, tied: bool):
    """first_fn, layer_fn, last_fn over the split state. Losses are this intra rank's share (the
    pipeline sums shares over 'intra'): local CE mean / intra_size; the MoE terms are already global
    (token_mean), so each rank contributes 1 / intra_size of them."""
    embed_def = nnx.split(model.embed)[0]
    dense_def = nnx.split(model.dense_blocks)[0] if model.dense_blocks is not None else None
    norm_def = nnx.split(model.final_norm)[0]
    block_def = nnx.split(model.moe_blocks)[0]   # a stacked Block's graph merges with one layer's state
    compute_dtype = model.compute_dtype
    moe_scale = 1.0 / (num_layers * intra_size)

    def first_fn(first, tokens_BS):
        x_BSD = nnx.merge(embed_def, first["embed"])(tokens_BS, compute_dtype)
        if dense_def is not None:   # dense blocks have no MoE losses
            x_BSD, _ = run_stack(nnx.merge(dense_def, first["dense_blocks"]), x_BSD, block_layout, model.remat)
        return x_BSD

    def block(layer_state, x_BSD):
        y_BSD, stats = nnx.merge(block_def, layer_state)(x_BSD, block_layout)
        moe = moe_cfg.aux_loss_weight * stats["aux_loss"] + moe_cfg.z_loss_weight * stats["z_loss"]
        return y_BSD, moe * moe_scale

    if model.remat != "none":
        block = jax.checkpoint(block, policy=REMAT_POLICIES[model.remat], prevent_cse=False)

    def last_fn(last, x_BSD, targets_BS):
        x_BSD = nnx.merge(norm_def, last["final_norm"])(x_BSD)
        if tied:
            logits = nnx.merge(embed_def, last["embed"]).attend(x_BSD)
        else:
            logits = output_logits("bsd,dv->bsv", x_BSD, last["head_DV"][...])
        return cross_entropy(logits, targets_BS) / intra_size

    return first_fn, block, last_fn


def _microbatches(batch, num_microbatches: int):
    """[B, S] -> [M, B/M, S] with microbatch m = rows m, m + M, ... (keeps each data rank's rows local)."""
    def one(x_BS):
        return jnp.swapaxes(x_BS.reshape(x_BS.shape[0] // num_microbatches, num_microbatches, -1), 0, 1)
    return one(batch["inputs"]), one(batch["targets"])


def _param_specs(pipe_params: PipelineParams, layout, manual: bool) -> PipelineParams | None:
    """Under the ManualLayout, leaves are split over 'intra' by their logical axes (experts for EP,
    heads / FFN width for TP); stage leaves add (V, S over 'pipe', Lmax) in front of a layer's axes."""
    if not manual:
        return None
    plan = layout.plan

    def spec(logical):
        return plan.param_spec(tuple(logical))

    def is_spec(x):
        return isinstance(x, P)

    def stage_spec(logical):   # logical = ('layers', *one layer's axes)
        return P(None, PIPE, None, *spec(tuple(logical)[1:]))

    return PipelineParams(
        first=jax.tree.map(spec, nnx.get_partition_spec(pipe_params.first), is_leaf=is_spec),
        stages=jax.tree.map(stage_spec, nnx.get_partition_spec(pipe_params.stages), is_leaf=is_spec),
        last=jax.tree.map(spec, nnx.get_partition_spec(pipe_params.last), is_leaf=is_spec))


def _validate(model, params, batch, *, mesh, layout, num_microbatches: int) -> int:
    """Raise ValueError naming the argument and the fix; returns the number of MoE layers."""
    for name in (DATA, PIPE, INTRA):
        if name not in mesh.shape:
            raise ValueError(f"mesh axes {tuple(mesh.shape)} lack {name!r}; build the mesh with "
                             "ParallelPlan(...).make_mesh().")
    if isinstance(layout, ManualLayout):
        if layout.plan.capacity_factor and layout.plan.ffn == "ep":
            raise ValueError(f"config.model.moe.capacity_factor={layout.plan.capacity_factor}: the pipeline "
                             "cannot return the dropped-token count; use 0 (dropless) with pipe > 1.")
    elif type(layout) is not LocalLayout:
        raise ValueError(f"layout={type(layout).__name__} is not supported; pass a LocalLayout or a "
                         "ManualLayout (model/layout.py::layout_for).")
    elif mesh.shape[INTRA] != 1:
        raise ValueError(f"mesh intra={mesh.shape[INTRA]} needs the manual plan (ManualLayout) inside "
                         "pipeline stages; use parallel.plan='manual' or intra=1.")
    inputs, targets = batch["inputs"], batch["targets"]
    if inputs.ndim != 2 or inputs.shape != targets.shape:
        raise ValueError(f"batch['inputs'] {inputs.shape} and batch['targets'] {targets.shape} must both be "
                         "[B, S] of the same shape.")
    rows = num_microbatches * mesh.shape[DATA]
    if not isinstance(num_microbatches, int) or num_microbatches < 1 or inputs.shape[0] % rows:
        raise ValueError(f"num_microbatches={num_microbatches!r}: the batch of {inputs.shape[0]} rows must "
                         f"split into num_microbatches x data = {rows} equal parts; pick a divisor.")
    seq_split = mesh.shape[INTRA] if isinstance(layout, ManualLayout) else 1
    if inputs.shape[1] % seq_split:
        raise ValueError(f"batch sequence length {inputs.shape[1]} must divide by intra={seq_split} "
                         "(sequence parallelism); change train.seq_len.")
    return jax.tree.leaves(params["moe_blocks"])[0].shape[0]
