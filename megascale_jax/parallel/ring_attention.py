"""Ulysses attention with its all-to-alls fused into the projections: GEMM+A2A before, A2A+GEMM after.

Ulysses SP (parallel/layouts.py UlyssesAttention) projects q/k/v for all heads of its sequence chunk, then an
all-to-all sends each rank its heads for every chunk; after the core a second all-to-all brings the output
back to sequence chunks for the output projection. Here each all-to-all is split into its n - 1 direct sends
(`collectives.ring_pass` with shift j, point to point), and the projection GEMM is tiled by the rank at the
other end, as in the paper's fused kernels:

  GEMM+A2A (`project_seq_to_heads`): at step j rank r computes q/k/v of the heads of destination rank
      r + j (its q heads, and the kv slots `collectives.kv_head_layout` gives it, GQA with G < n included)
      from its own sequence chunk, and sends them to r + j while it receives rank r - j's chunk of its own
      heads; step 0 is its own heads, no send. The chunks land at their sequence positions.
  A2A+GEMM (`project_heads_to_seq`): at step j rank r sends its heads' output for the sequence chunk of rank
      r + j there and receives rank r - j's heads for its own chunk, whose partial output projection (rank
      r - j's slice of wo) it adds to an fp32 accumulator; step 0 is its own heads.

So each step's transfer depends on one GEMM tile only, and XLA may run it under the next step's GEMM. This is
the plain-JAX form (same tiling and order) of the fused kernels; `parallel.moe_layer='fused'` selects it
together with the MoE ring (parallel/ring_dispatch.py).

Bytes on the wire are exactly the unfused all-to-alls': per rank (n-1) B (S/n) (Hq/n + 2 slots) K for q/k/v and
(n-1) B (S/n) (Hq/n) K for the output, in the compute dtype (measured in the compiled HLO). Nothing is summed
on the wire (the sends move whole tiles), so bf16 there rounds nothing; the sums are local and in fp32: the
output projection's partials (its GEMMs write fp32, as a fused kernel's accumulator; their backward GEMMs keep
bf16 operands, `_fp32_partial`), and in the backward the
n per-step cotangents of the block input x. A ring of partial output sums (GEMM+RS) would instead send all of D
per token per hop: n x the elements, in fp32. The kv slots of GQA with G < n are recomputed for each
destination that needs them (n x slots kv heads in place of G; the unfused path sends the same slots).

The weights come in explicitly and are retyped as varying over the mesh once (`collectives.vary_like`): used n
times as replicated values, each use would carry its own gradient all-reduce (n x the weight-gradient bytes).

Same results as UlyssesAttention (tests/parallel/test_ring_attention.py: fp32 to 1e-4, bf16 near its error).
"""
from __future__ import annotations

from enum import StrEnum
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from megascale_jax.parallel import collectives


class AttentionExchange(StrEnum):
    """How the fused schedule's GEMM+A2A moves its tiles (`parallel.attention_exchange`)."""
    RING = "ring"       # `project_seq_to_heads`: n point-to-point sends (ppermute), each after its step's GEMM
    # `project_seq_to_heads_by_kernel` with pallas_kernels/gemm_all_to_all.py and `project_heads_to_seq_by_kernel`
    # with pallas_kernels/all_to_all_gemm.py (GPU, bf16)
    MOSAIC = "mosaic"


# project(x_BSD, w, q_heads, kv_heads) -> (q_BSHK, k_BSGK, v_BSGK) of those heads (int arrays; None: all)
ProjectFn = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]
# project_out(o_BSHK, wo_HKD, heads, out_dtype) -> partial y_BSD of those heads, in out_dtype
ProjectOutFn = Callable[..., jax.Array]


def project_seq_to_heads(x_BSD, project: ProjectFn, w: Any, *, axis, num_heads: int):
    """GEMM+A2A: x [B, S/n, D] (rank r's sequence chunk) -> q [B, S, Hq/n, K], k / v [B, S, G_loc, K] exactly
    as `collectives.seq_to_heads` / `kv_seq_to_heads` of `project(x, w)` (all heads); see the module docstring."""
    n, rank = lax.axis_size(axis), lax.axis_index(axis)
    num_kv = jax.eval_shape(project, x_BSD, w)[1].shape[2]   # shapes only: no computation
    layout = collectives.kv_head_layout(num_heads, num_kv, n)
    per_rank, slot_heads_NS = num_heads // n, jnp.asarray(layout.slot_heads_NS)
    w = jax.tree.map(lambda a: collectives.vary_like(a, x_BSD), w)
    # x in fp32 once, cast back per step (exact): in the backward the n steps' dgrads of x add in fp32.
    x32 = x_BSD.astype(jnp.float32)
    blocks = []   # block j: q/k/v of my heads for the sequence chunk of rank r - j
    for j in range(n):
        dest = (rank + j) % n
        qkv = project(x32.astype(x_BSD.dtype), w, dest * per_rank + jnp.arange(per_rank), slot_heads_NS[dest])
        blocks.append(qkv if j == 0 else collectives.ring_pass(qkv, axis, shift=j))
    chunk_order = (rank - jnp.arange(n)) % n   # the block that holds sequence chunk s
    q, k, v = (_in_sequence_order([b[i] for b in blocks], chunk_order) for i in range(3))
    return q, layout.local_kv(k, rank), layout.local_kv(v, rank)


def project_seq_to_heads_via(exchange: str, x_BSD, project, w: Any, *, axis, num_heads: int):
    """GEMM+A2A moved as `exchange` (AttentionExchange) says."""
    if exchange == AttentionExchange.MOSAIC:
        from pallas_kernels.gemm_all_to_all import gemm_all_to_all   # GPU kernels load only where used
        return project_seq_to_heads_by_kernel(x_BSD, project, w, axis=axis, num_heads=num_heads,
                                              exchange=gemm_all_to_all)
    return project_seq_to_heads(x_BSD, project, w, axis=axis, num_heads=num_heads)


def project_seq_to_heads_by_kernel(x_BSD, project, w: Any, *, axis, num_heads: int, exchange: Callable):
    """GEMM+A2A as one kernel (`exchange`: pallas_kernels/gemm_all_to_all.py's `gemm_all_to_all`, or its twin
    `gemm_all_to_all_reference` where the kernel cannot run): the projection columns of every destination rank
    stacked [n, D, C] (its q heads, then its kv slots for k and for v), x @ those columns stored by the kernel
    straight into each destination at the sender's slot; the receiver then adds biases / norms / RoPE at the
    received rows' positions (`project.finish`, per token and head, so after the exchange is the same
    arithmetic; the positions are the senders' own, gathered: B x S int32). Same results as
    `project_seq_to_heads`; the same bytes in one exchange, plus the positions."""
    n, rank = lax.axis_size(axis), lax.axis_index(axis)
    batch, chunk, dim = x_BSD.shape
    w = jax.tree.map(lambda a: collectives.vary_like(a, x_BSD), w)   # one weight-gradient reduction, as above
    num_kv = w["wk"].shape[1]
    layout = collectives.kv_head_layout(num_heads, num_kv, n)
    q_heads_NQ = np.arange(num_heads).reshape(n, num_heads // n)
    per_dest = [jnp.concatenate(project.columns(w, q_heads_NQ[p], layout.slot_heads_NS[p]), axis=1) for p in range(n)]
    heads, head_dim = per_dest[0].shape[1:]                          # Q + 2 S head columns of K each
    w_NDC = jnp.stack([c.reshape(dim, heads * head_dim) for c in per_dest]).astype(x_BSD.dtype)
    recv_NMC = exchange(x_BSD.reshape(batch * chunk, dim), w_NDC, axis=axis)   # recv[s]: rank s's chunk
    qkv = jnp.moveaxis(recv_NMC.reshape(n, batch, chunk, heads, head_dim), 0, 1).reshape(
        batch, n * chunk, heads, head_dim)                           # chunk s at its sequence position
    q_count, slots = q_heads_NQ.shape[1], layout.slot_heads_NS.shape[1]
    q, k, v = qkv[:, :, :q_count], qkv[:, :, q_count:q_count + slots], qkv[:, :, q_count + slots:]
    positions = collectives.gather_seq(project.positions_BS, axis)   # each received chunk's own positions
    q, k, v = project.finish(positions, q, k, v, w, jnp.asarray(q_heads_NQ)[rank],
                             jnp.asarray(layout.slot_heads_NS)[rank])
    return q, layout.local_kv(k, rank), layout.local_kv(v, rank)


def _in_sequence_order(blocks, chunk_order):
    """n blocks [B, S/n, h, K] (block j: sequence chunk of rank r - j) -> [B, S, h, K] in sequence order."""
    stacked = jnp.take(jnp.stack(blocks), chunk_order, axis=0)      # [n, B, S/n, h, K], chunk s at s
    n, batch, chunk = stacked.shape[:3]
    return jnp.moveaxis(stacked, 0, 1).reshape(batch, n * chunk, *stacked.shape[3:])


def project_heads_to_seq(o_BSHK, project_out: ProjectOutFn, wo: Any, *, axis):
    """A2A+GEMM: o [B, S, Hq/n, K] (rank r's heads) -> y [B, S/n, D] for rank r's chunk, all heads summed,
    equal to `project_out(collectives.heads_to_seq(o), wo)`; partial sums in fp32, y in o's dtype."""
    n, rank = lax.axis_size(axis), lax.axis_index(axis)
    batch, seq, per_rank = o_BSHK.shape[:3]
    if seq % n:
        raise ValueError(f"o_BSHK sequence length {seq} (dim 1) is not divisible by n = {n}; pad the sequence")
    wo = jax.tree.map(lambda a: collectives.vary_like(a, o_BSHK), wo)
    o_BNCHK = o_BSHK.reshape(batch, n, seq // n, *o_BSHK.shape[2:])
    acc_BSD = None
    for j in range(n):
        piece = lax.dynamic_index_in_dim(o_BNCHK, (rank + j) % n, axis=1, keepdims=False)  # for rank r + j
        if j:
            piece = collectives.ring_pass(piece, axis, shift=j)   # now rank r - j's heads, my chunk
        part = _fp32_partial(project_out, piece, wo, ((rank - j) % n) * per_rank + jnp.arange(per_rank))
        acc_BSD = part if acc_BSD is None else acc_BSD + part
    return acc_BSD.astype(o_BSHK.dtype)


def project_heads_to_seq_via(exchange: str, o_BSHK, project_out: ProjectOutFn, wo_HKD, *, axis):
    """A2A+GEMM moved as `exchange` (AttentionExchange) says. The kernel computes the plain output projection
    (model/attention.py's `project_out_heads`: no bias), so `project_out` is used by the ring schedule only."""
    if exchange == AttentionExchange.MOSAIC:
        from pallas_kernels.all_to_all_gemm import all_to_all_gemm   # GPU kernels load only where used
        return project_heads_to_seq_by_kernel(o_BSHK, wo_HKD, axis=axis, exchange=all_to_all_gemm)
    return project_heads_to_seq(o_BSHK, project_out, wo_HKD, axis=axis)


def project_heads_to_seq_by_kernel(o_BSHK, wo_HKD, *, axis, exchange: Callable):
    """A2A+GEMM as one kernel (`exchange`: pallas_kernels/all_to_all_gemm.py's `all_to_all_gemm`, or its twin
    `all_to_all_gemm_reference` where the kernel cannot run): o [B, S, Hq/n, K] (rank r's heads) as rows per
    destination chunk [n, B S/n, Hq/n K] (batch-major within a chunk) and wo's rows by source rank
    [n, Hq/n K, D] (rank s holds heads s Hq/n ..); the kernel sends each destination its rows and sums every
    source's product for this rank's chunk (fp32 accumulator, o's dtype out) -> y [B, S/n, D]. Equal to
    `project_heads_to_seq(o, project_out_heads, wo)`, the same bytes on the wire."""
    n = lax.axis_size(axis)
    batch, seq, per_rank, head_dim = o_BSHK.shape
    if seq % n:
        raise ValueError(f"o_BSHK sequence length {seq} (dim 1) is not divisible by n = {n}; pad the sequence")
    dim = wo_HKD.shape[-1]
    wo_HKD = collectives.vary_like(wo_HKD, o_BSHK)   # one weight-gradient reduction, as in the ring schedule
    cols = per_rank * head_dim
    x_NMK = jnp.moveaxis(o_BSHK.reshape(batch, n, seq // n, cols), 1, 0).reshape(n, batch * (seq // n), cols)
    y_MD = exchange(x_NMK, wo_HKD.astype(o_BSHK.dtype).reshape(n, cols, dim), axis=axis)
    return y_MD.reshape(batch, seq // n, dim)


def _fp32_partial(project_out: ProjectOutFn, piece, wo, heads):
    """`project_out(piece, wo, heads)` with an fp32 output (a partial of the fp32 accumulator), whose backward
    first casts the cotangent back to piece's dtype: that cotangent is the output's (one compute-dtype tensor,
    cast up by the final cast's transpose), so nothing is lost, and the dgrad / wgrad GEMMs keep
    compute-dtype operands (left fp32, the GPU would run them as mixed fp32 x bf16 GEMMs). `heads` is an
    argument, not a closure: closed-over traced values of a custom_vjp become extra inputs that an AOT-compiled
    caller does not pass."""
    @jax.custom_vjp
    def partial(piece, wo, heads):
        return project_out(piece, wo, heads, jnp.float32)

    def forward(piece, wo, heads):
        return partial(piece, wo, heads), (piece, wo, heads)

    def backward(residuals, g):
        piece, wo, heads = residuals
        _, pull = jax.vjp(lambda p, w: project_out(p, w, heads), piece, wo)
        return (*pull(g.astype(piece.dtype)), None)   # integer head ids: no cotangent

    partial.defvjp(forward, backward)
    return partial(piece, wo, heads)
