"""The macro layer (parallel.moe_layer='macro'): one attention + MoE block with its forward and backward
written out by hand (`jax.custom_vjp` over the block's parameter arrays), as MegaScale-MoE does.

Why by hand. Under autodiff the backward is whatever the transposes give, and what is kept is what autodiff
wants (or what a jax.checkpoint policy selects by name). Here each phase is explicit, so
  * the backward sends each chunk's input gradient home (the dispatch's transpose: all-to-all, or
    reduce-scatter for the all_gather dispatch) *before* computing that chunk's expert weight gradients,
    which do not depend on it: the collective and the grouped-GEMM wgrad can run at the same time, and the
    rematerialised activations (norms, routing, the re-sent tokens) depend only on kept values, so they can
    run under the backward's other collectives;
  * the forward's token exchange is split into `chunks` pieces along the tokens, each with its own plan:
    chunk i+1's dispatch does not depend on chunk i's GEMMs, so it can move meanwhile (barriers pin that
    order, since XLA's scheduler did not choose it: chunk i+1 is sent once chunk i's rows have arrived,
    chunk i is combined once chunk i+1's have, and that combine lands before chunk i+1's down GEMM);
  * the routing weights' gradient comes from the down GEMM's input gradient, <dy W_down^T, act> per row
    (equal to <dy, y> by linearity), so no expert output is kept for it;
  * remat is explicit (`train.remat`), per the paper's selective activation rematerialisation:
      none       keep every phase's pullback (what autodiff keeps);
      selective  keep the block input x, q/k/v before the Ulysses all-to-all, the attention core's output,
                 the residual stream after attention, and the expert gate / up GEMM outputs: the GEMM and
                 attention outputs, (2kf + 4 + 2/m) bsh/n elements (plus the shared experts' gate / up, and
                 with the shared-expert gate their output before it). Recompute the norms, the routing, the
                 SwiGLU activation, the q/k/v biases, the q/k norms (whose inputs, the q / k GEMM outputs,
                 are then recomputed too, as autodiff's 'selective' does) and the gate's sigmoid;
                 re-communicate the all-to-all outputs (q/k/v to heads, the core output back, the tokens to
                 their experts);
      full       keep x only and run the forward again in the backward.
Which independent work XLA actually places under each collective is the latency-hiding scheduler's choice
(launch/env.sh turns it on); tests/parallel/test_overlap_schedule.py reads it from the compiled HLO
(parallel/overlap_schedule.py): data independence on the CPU, the async start / done schedule on the GPU.

The model hands over its pieces (`MoEBlockMath`: norm, projections, attention core, router, grouped GEMM and
its dgrad / wgrad, in the modules' arithmetic) and its arrays (`MoEBlockWeights`), so model/ stays free of
collectives; the communication is the layout's: `attention` (parallel/layouts.py AttentionComm) and `ffn`,
a dispatcher with plan / send / send_transpose / combine_rows (parallel/token_routes.py).
The plain twin is the autodiff block; tests/parallel/test_overlap.py compares values and gradients.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from megascale_jax.parallel.collectives import match_varying

REMATS = ("none", "selective", "full")


class ExpertChunk(NamedTuple):
    """What the experts' backward needs of one forward chunk."""
    plan: Any                   # the dispatch plan (integers; parallel/token_routes.py)
    x_MD: Any                   # the dispatched tokens, or None where re-sent in the backward
    gate_MF: jax.Array          # the gate and up GEMM outputs
    up_MF: jax.Array
    activation: Any = None      # (act_MF, its pullback) when kept (remat 'none'); else recomputed from gate / up


class Pullbacks(NamedTuple):
    """Every phase's pullback (jax.vjp's function, a pytree of its residuals), plus the experts' chunks."""
    norm1: Any
    attention_input: Any
    qkv: Any
    heads_in: Any
    core: Any
    heads_out: Any
    out_proj: Any
    proj_out: Any
    norm2: Any
    route: Any
    weight_TK: jax.Array
    chunks: tuple
    shared_in: Any
    shared_out: Any
    shared_gate: Any


class Selected(NamedTuple):
    """remat='selective': what is kept (see the module docstring)."""
    q: jax.Array
    k: jax.Array
    v: jax.Array
    core_out: jax.Array
    x2: jax.Array
    chunks: tuple               # ExpertChunk with x_MD None
    shared_gate_up: Any
    shared_out: Any             # the shared experts' output before the gate (gated only: the gate's pullback)


@dataclasses.dataclass(frozen=True)
class MacroBlock:
    """layout.block: the MoE block as one strategy. Called by model/transformer.py Block with its pieces."""
    attention: Any              # AttentionComm
    ffn: Any                    # an EP / local dispatcher (plan, send, send_transpose, combine_rows, ...)
    reductions: Any
    remat: str = "none"
    chunks: int = 1

    def __post_init__(self):
        if self.remat not in REMATS:
            raise ValueError(f"train.remat={self.remat!r}: the macro layer knows {REMATS}")
        if self.chunks < 1:
            raise ValueError(f"parallel.overlap_chunks={self.chunks} must be >= 1")

    def __call__(self, math, weights, x_BSD):
        """(y_BSD, stats) as Block returns them; gradients by the hand-written backward."""
        out, aux, z, tokens_per_expert, dropped = _block_with_vjp(self, math)(x_BSD, weights)
        # Counts leave a custom_vjp with (zero) tangents attached; cut them, as autodiff's integer stats have none
        # (the reductions after this, e.g. a pmax, have no differentiation rule).
        return out, {"aux_loss": aux, "z_loss": z, "tokens_per_expert": lax.stop_gradient(tokens_per_expert),
                     "dropped_tokens": lax.stop_gradient(dropped)}


def _block_with_vjp(cfg: MacroBlock, math):
    @jax.custom_vjp
    def block(x_BSD, w):
        return _forward(cfg, math, x_BSD, w, keep=None)[0]

    def fwd(x_BSD, w):
        outs, saved = _forward(cfg, math, x_BSD, w, keep=cfg.remat)
        return outs, (x_BSD, w, saved)

    def bwd(res, cotangents):
        x_BSD, w, saved = res
        d_out, d_aux, d_z = cotangents[:3]
        if cfg.remat != "none":
            # Recomputation must not be merged with the forward (common-subexpression elimination would keep
            # the forward's values alive instead, as jax.checkpoint's prevent_cse guards against).
            x_BSD, saved = lax.optimization_barrier((x_BSD, saved))
        with jax.named_scope("macro_bwd/recompute"):
            pulls = _pullbacks(cfg, math, x_BSD, w, saved)
        dx, dw = _backward(cfg, math, w, pulls, d_out, d_aux, d_z)
        return dx, dw

    block.defvjp(fwd, bwd)
    return block


def _pull(keep: bool, fn, *args, has_aux=False):
    """fn(*args) and, when kept, its pullback."""
    if not keep:
        out = fn(*args)
        return (out[0], None, out[1]) if has_aux else (out, None)
    return jax.vjp(fn, *args, has_aux=has_aux)


def _chunks_of(x, count: int):
    if x.shape[0] % count:
        raise ValueError(f"parallel.overlap_chunks={count} must divide this device's {x.shape[0]} tokens")
    return jnp.split(x, count)


# --------------------------------------------------------------------------------------------------- forward
def _forward(cfg: MacroBlock, math, x_BSD, w, keep, pin: bool = True):
    """((out, aux, z, tokens_per_expert, dropped), saved): `saved` per `keep` (None: the primal alone).
    pin=False leaves out the chunk pipeline's barriers: for the backward's recomputation (remat 'full'), where
    a barrier would keep the otherwise dead expert outputs of all but the last chunk alive (XLA does not
    remove an optimization_barrier's unused outputs before scheduling)."""
    every = keep == "none"
    comm = cfg.attention
    with jax.named_scope("attention"):
        h1, p_norm1 = _pull(every, math.norm, x_BSD, w.attn_norm_D)
        a_in, p_ain = _pull(every, comm.attention_input, h1)
        positions = comm.positions(a_in)
        qkv = functools.partial(_qkv, math, positions)
        (q, k, v), p_qkv = _pull(every, qkv, a_in, w.qkv)
        (qh, kh, vh), p_heads_in = _pull(every, comm.heads_in, q, k, v)
        core_out, p_core = _pull(every, math.core, qh, kh, vh)
        o, p_heads_out = _pull(every, comm.heads_out, core_out)
        a, p_out_proj = _pull(every, math.out_proj, o, w.wo_HKD)
        a, p_proj_out = _pull(every, comm.proj_out, a)
        x2 = x_BSD + a
    with jax.named_scope("ffn"):
        h2, p_norm2 = _pull(every, math.norm, x2, w.ffn_norm_D)
        h2_TD = h2.reshape(-1, h2.shape[-1])
        route = functools.partial(_route, math, cfg.reductions.token_mean)
        (weight_TK, aux, z), p_route, idx_TK = _pull(every, route, h2_TD, w.router_DE, has_aux=True)
        y_TD, chunks, stats = _experts_forward(cfg, math, w, h2_TD, idx_TK, weight_TK, keep_all=every, pin=pin)
        shared = (None,) * 5
        if w.shared is not None:
            with jax.named_scope("shared_experts"):
                gate_up, p_shared_in = _pull(every, math.dense_in, h2_TD, *w.shared[:2])
                y_shared, p_shared_out = _pull(every, math.dense_out, *gate_up, w.shared[2])
                ungated = p_shared_gate = None
                if w.shared_gate_D1 is not None:   # Qwen2-MoE: sigmoid(h . w_gate) per token
                    ungated = y_shared
                    y_shared, p_shared_gate = _pull(every, math.shared_gate, h2_TD, w.shared_gate_D1, ungated)
                y_TD = y_TD + y_shared
                shared = (gate_up, p_shared_in, p_shared_out, p_shared_gate, ungated)
        out = x2 + y_TD.reshape(x2.shape)
    outs = (out, aux, z) + stats
    if keep is None or keep == "full":
        return outs, None
    if keep == "none":
        return outs, Pullbacks(p_norm1, p_ain, p_qkv, p_heads_in, p_core, p_heads_out, p_out_proj, p_proj_out,
                               p_norm2, p_route, weight_TK, chunks, *shared[1:4])
    return outs, Selected(q, k, v, core_out, x2, chunks, shared[0], shared[4])


def _qkv(math, positions, h, w_qkv):
    return math.qkv(h, w_qkv, positions)


def _route(math, token_mean, h_TD, w_DE):
    """The router with its differentiable outputs first and the expert ids as aux."""
    r = math.route(h_TD, w_DE, token_mean)
    return (r.weight_TK, r.aux_loss, r.z_loss), r.idx_TK


def _experts_forward(cfg: MacroBlock, math, w, h2_TD, idx_TK, weight_TK, *, keep_all: bool, pin: bool = True):
    """Dispatch -> gate / up / activation / down -> combine, in `cfg.chunks` pieces along the tokens: each
    piece's dispatch waits for the routing and (pin) for the previous piece's rows, so it moves while the
    previous piece's GEMMs run. Returns (y_TD, per-chunk ExpertChunk, (tokens_per_expert, dropped_tokens))."""
    ffn, e = cfg.ffn, w.experts
    pieces = zip(_chunks_of(h2_TD, cfg.chunks), _chunks_of(idx_TK, cfg.chunks), _chunks_of(weight_TK, cfg.chunks))
    ys, chunks, tokens_per_expert, dropped = [], [], 0, 0
    pending = None    # the previous chunk's (c, y_MD, plan, weight, x_MD): its combine waits for this chunk's rows

    def combine(c, y_MD, plan, weight):
        with jax.named_scope(f"chunk{c}/combine"):
            ys.append(ffn.combine_rows(y_MD, plan, weight))

    for c, (h_TD, idx, weight) in enumerate(pieces):
        with jax.named_scope(f"chunk{c}/dispatch"):
            plan = ffn.plan(idx)
            if pin and pending is not None:
                # Pin the pipeline, which XLA would otherwise not keep (seen in the GPU schedule: chunk 1's
                # exchange issued first with nothing under it; the all_gather dispatch's chunks merged into one
                # collective): this send starts once the previous chunk's rows have arrived ...
                h_TD, _ = lax.optimization_barrier((h_TD, pending[4]))
            x_MD = ffn.send(h_TD, plan)
        if pending is not None:
            # ... and must land before the previous chunk's combine: that chunk's GEMMs run meanwhile.
            y_prev = pending[1]
            if pin:
                with jax.named_scope(f"chunk{c}/pipeline_order"):
                    y_prev, x_MD = lax.optimization_barrier((y_prev, x_MD))
            combine(pending[0], y_prev, *pending[2:4])
        with jax.named_scope(f"chunk{c}/experts"):
            gate = math.expert_gemm(x_MD, e.gate_EDF, plan.group_sizes)
            up = math.expert_gemm(x_MD, e.up_EDF, plan.group_sizes)
            act, p_act = _pull(keep_all, math.activation, gate, up)
            if pin and c > 0:
                # ... and the previous chunk's combine lands before this chunk's down GEMM, so it runs under this
                # chunk's gate / up GEMMs (without it XLA's combiner merged every chunk's combine into one
                # reduce-scatter after the last chunk's GEMMs: seen in the GPU schedule of the all_gather dispatch).
                act, ys[-1] = lax.optimization_barrier((act, ys[-1]))
            y_MD = math.expert_gemm(act, e.down_EFD, plan.group_sizes)
        pending = (c, y_MD, plan, weight, x_MD)
        chunks.append(ExpertChunk(plan, x_MD if keep_all else None, gate, up, (act, p_act) if keep_all else None))
        tokens_per_expert = tokens_per_expert + plan.tokens_per_expert
        dropped = dropped + plan.dropped_tokens
    combine(*pending[:4])
    y_TD = ys[0] if len(ys) == 1 else jnp.concatenate(ys)
    return y_TD, tuple(chunks), (tokens_per_expert, dropped)


# --------------------------------------------------------------------------------------------------- recompute
def _pullbacks(cfg: MacroBlock, math, x_BSD, w, saved) -> Pullbacks:
    """The pullbacks the backward needs: kept (none), rebuilt from the kept tensors (selective: norms,
    routing and activations recomputed, all-to-all outputs re-communicated; every forward value a pullback
    does not need, e.g. a linear phase's output, is dead code XLA removes), or from x alone (full)."""
    if cfg.remat == "none":
        return saved
    if cfg.remat == "full":
        return _forward(cfg, math, x_BSD, w, keep="none", pin=False)[1]
    s: Selected = saved
    comm = cfg.attention
    h1, p_norm1 = jax.vjp(math.norm, x_BSD, w.attn_norm_D)
    a_in, p_ain = jax.vjp(comm.attention_input, h1)
    qkv = functools.partial(_qkv, math, comm.positions(a_in))
    _, p_qkv = jax.vjp(qkv, a_in, w.qkv)
    (qh, kh, vh), p_heads_in = jax.vjp(comm.heads_in, s.q, s.k, s.v)       # re-communicated
    _, p_core = jax.vjp(math.core, qh, kh, vh)                               # the core's own recomputation
    o, p_heads_out = jax.vjp(comm.heads_out, s.core_out)                      # re-communicated
    a, p_out_proj = jax.vjp(math.out_proj, o, w.wo_HKD)
    _, p_proj_out = jax.vjp(comm.proj_out, a)
    h2, p_norm2 = jax.vjp(math.norm, s.x2, w.ffn_norm_D)
    h2_TD = h2.reshape(-1, h2.shape[-1])
    route = functools.partial(_route, math, cfg.reductions.token_mean)
    (weight_TK, _, _), p_route, _ = jax.vjp(route, h2_TD, w.router_DE, has_aux=True)
    chunks = tuple(ch._replace(x_MD=cfg.ffn.send(h_TD, ch.plan))                # re-communicated
                   for ch, h_TD in zip(s.chunks, _chunks_of(h2_TD, cfg.chunks)))
    p_shared_in = p_shared_out = p_shared_gate = None
    if w.shared is not None:
        _, p_shared_in = jax.vjp(math.dense_in, h2_TD, *w.shared[:2])
        _, p_shared_out = jax.vjp(math.dense_out, *s.shared_gate_up, w.shared[2])
        if w.shared_gate_D1 is not None:   # the sigmoid recomputed; the kept output spares the down GEMM
            _, p_shared_gate = jax.vjp(math.shared_gate, h2_TD, w.shared_gate_D1, s.shared_out)
    return Pullbacks(p_norm1, p_ain, p_qkv, p_heads_in, p_core, p_heads_out, p_out_proj, p_proj_out, p_norm2,
                     p_route, weight_TK, chunks, p_shared_in, p_shared_out, p_shared_gate)


# --------------------------------------------------------------------------------------------------- backward
def _backward(cfg: MacroBlock, math, w, pulls: Pullbacks, d_out, d_aux, d_z):
    """(dx, d weights). FFN first (its dx exchanges issued before the expert weight gradients), then the
    attention half, each step the pullback of its forward phase."""
    num_tokens = d_out.shape[0] * d_out.shape[1]
    dy_TD = d_out.reshape(num_tokens, -1)
    d_h2_TD, d_weight_TK, d_experts = _experts_backward(cfg, math, w, pulls, dy_TD)
    with jax.named_scope("macro_bwd/router"):
        d_h2_route, d_router = pulls.route((d_weight_TK, d_aux, d_z))
        d_h2_TD = d_h2_TD + d_h2_route.astype(d_h2_TD.dtype)
    d_shared = d_gate_D1 = None
    if w.shared is not None:
        with jax.named_scope("macro_bwd/shared_experts"):
            d_y_shared = dy_TD
            if pulls.shared_gate is not None:
                d_h2_gate, d_gate_D1, d_y_shared = pulls.shared_gate(dy_TD)
                d_h2_TD = d_h2_TD + d_h2_gate
            d_gate, d_up, d_shared_down = pulls.shared_out(d_y_shared)
            d_h2_shared, d_shared_gate, d_shared_up = pulls.shared_in((d_gate, d_up))
            d_h2_TD = d_h2_TD + d_h2_shared
            d_shared = (d_shared_gate, d_shared_up, d_shared_down)
    with jax.named_scope("macro_bwd/attention"):
        dx2, d_ffn_norm = pulls.norm2(d_h2_TD.reshape(d_out.shape))
        dx2 = d_out + dx2
        (da,) = pulls.proj_out(dx2)
        do, d_wo = pulls.out_proj(da)
        (d_core,) = pulls.heads_out(do)
        dq, dk, dv = pulls.core(d_core)
        dq, dk, dv = pulls.heads_in((dq, dk, dv))
        d_ain, d_qkv = pulls.qkv((dq, dk, dv))
        (dh1,) = pulls.attention_input(d_ain)
        dx_attn, d_attn_norm = pulls.norm1(dh1)
    grads = type(w)(d_attn_norm, d_qkv, d_wo, d_ffn_norm, d_router, d_experts, d_shared, d_gate_D1)
    grads = jax.tree.map(lambda g, p: match_varying(g.astype(p.dtype), p, g), grads, w)
    return dx2 + dx_attn, grads


def _experts_backward(cfg: MacroBlock, math, w, pulls: Pullbacks, dy_TD):
    """Per chunk: dy rows to the experts, the down GEMM's dgrad, the routing weights' gradient, the
    activation's pullback, the first GEMMs' dgrad, then the dx exchange home, and only after it is issued the
    three weight gradients, which do not depend on it. Returns (d_h2_TD, d_weight_TK, expert weight grads)."""
    ffn, e = cfg.ffn, w.experts
    dgrad, wgrad = math.expert_gemm_grads()
    dt = dy_TD.dtype
    dxs, d_weights, d_gate_w, d_up_w, d_down_w = [], [], [], [], []
    for c, (ch, dy_c, weight_c) in enumerate(zip(pulls.chunks, _chunks_of(dy_TD, cfg.chunks),
                                                 _chunks_of(pulls.weight_TK, cfg.chunks))):
        gs = ch.plan.group_sizes
        with jax.named_scope(f"macro_bwd/chunk{c}/dy_exchange"):
            dy_MD = ffn.send(dy_c, ch.plan, gradient=True)          # unweighted: each row gets its token's dy
            weight_M = ffn.weights_to_rows(weight_c, ch.plan)
            # The re-sent tokens (selective) are needed only by this chunk's weight gradients, so XLA issues
            # their exchange last, where it takes the wgrads' place under the dx exchange and leaves that
            # exchange exposed (seen in the GPU schedule). Binding them to dy makes them arrive before the
            # chunk's dgrads: the re-send runs under the previous work, the wgrads under the dx exchange.
            x_MD, dy_MD = lax.optimization_barrier((ch.x_MD, dy_MD))
        with jax.named_scope(f"macro_bwd/chunk{c}/expert_dgrad"):
            act, p_act = ch.activation or jax.vjp(math.activation, ch.gate_MF, ch.up_MF)
            g_MF = dgrad(dy_MD, e.down_EFD.astype(dt), gs).astype(jnp.float32)
            d_weight_M = jnp.sum(g_MF * act.astype(jnp.float32), axis=-1)   # <dy W_down^T, act> = <dy, y>
            d_gate, d_up = p_act((weight_M[:, None] * g_MF).astype(act.dtype))
            dx_MD = dgrad(d_gate, e.gate_EDF.astype(dt), gs) + dgrad(d_up, e.up_EDF.astype(dt), gs)
        with jax.named_scope(f"macro_bwd/chunk{c}/dx_exchange"):
            dx_home = ffn.send_transpose(dx_MD, ch.plan, dy_c.shape[0])
        with jax.named_scope(f"macro_bwd/chunk{c}/routing_weight_grad_exchange"):   # [M] floats: small
            d_weights.append(ffn.rows_to_weights(d_weight_M, ch.plan, weight_c.shape))
        with jax.named_scope(f"macro_bwd/chunk{c}/expert_wgrad"):
            weighted_dy_MD = (weight_M[:, None] * dy_MD.astype(jnp.float32)).astype(dt)
            dw = (wgrad(act, weighted_dy_MD, gs), wgrad(x_MD, d_gate, gs), wgrad(x_MD, d_up, gs))
        # Nothing else needs the weight gradients until the step's end, so XLA's scheduler (bottom-up) spends
        # them on the attention backward's collectives and leaves the dx exchange with nothing under it (seen
        # in the GPU schedule). Binding them to the exchanged dx makes the attention backward wait for both,
        # and the wgrads are what is left to run while the dx exchange is in flight.
        dx_home, dw = lax.optimization_barrier((dx_home, dw))
        dxs.append(dx_home)
        d_down_w.append(dw[0])
        d_gate_w.append(dw[1])
        d_up_w.append(dw[2])
    total = lambda parts: functools.reduce(jnp.add, [p.astype(jnp.float32) for p in parts])   # noqa: E731
    d_h2_TD = dxs[0] if len(dxs) == 1 else jnp.concatenate(dxs)
    d_weight_TK = d_weights[0] if len(d_weights) == 1 else jnp.concatenate(d_weights)
    return d_h2_TD, d_weight_TK, type(e)(total(d_gate_w), total(d_up_w), total(d_down_w))
