"""Every explicit collective of the model, behind a name that says what it is for.

All functions run inside a `jax.shard_map` body; `axis` is the mesh axis (one name, or a tuple of names) the
collective runs over, and n = `lax.axis_size(axis)`. Shapes in docstrings are per-rank (local) shapes.

Bytes on the wire are per rank, sent, for one call (forward); `itemsize` is the element size. Conventions:
all-to-all sends (n-1)/n of its buffer, all-gather sends its local shard to the n-1 others ((n-1) x local),
reduce-scatter sends (n-1)/n of its input, psum (ring) 2 (n-1)/n of its input. The backward of each is its
transpose (all-to-all <-> all-to-all, all-gather <-> reduce-scatter) and costs the same.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# The one home of the jax-version detail "which mesh axes does a value vary along" is the kernels' package
# (it sits below this one); re-exported here for the rest of megascale_jax.
from pallas_kernels.varying import match_varying, vary_like, varying_axes  # noqa: F401

# ----------------------------------------------------------------------------------------------------------
# Ulysses sequence parallelism (attention)
# ----------------------------------------------------------------------------------------------------------


def _require_divisible(size: int, n: int, what: str, fix: str) -> None:
    if size % n != 0:
        raise ValueError(f"{what} = {size} is not divisible by the axis size n = {n}; {fix}")


def seq_to_heads(x_BSHD: jax.Array, axis) -> jax.Array:
    """Ulysses all-to-all before attention: my sequence chunk with all heads -> full sequence, my heads.

    In:  [B, S/n, H, D], rank r holds positions [r*S/n, (r+1)*S/n) (contiguous chunks).
    Out: [B, S, H/n, D], rank r holds heads [r*H/n, (r+1)*H/n) for every position, in sequence order.
    Bytes per rank: (n-1)/n * B * (S/n) * H * D * itemsize.
    """
    n = lax.axis_size(axis)
    _require_divisible(x_BSHD.shape[2], n, "x_BSHD heads (dim 2)",
                       "choose a head count that is a multiple of the sequence-parallel size")
    return lax.all_to_all(x_BSHD, axis, split_axis=2, concat_axis=1, tiled=True)


def heads_to_seq(x_BSHD: jax.Array, axis) -> jax.Array:
    """Inverse of `seq_to_heads`, after attention: [B, S, H/n, D] -> [B, S/n, H, D].

    Bytes per rank: (n-1)/n * B * (S/n) * H * D * itemsize.
    """
    n = lax.axis_size(axis)
    _require_divisible(x_BSHD.shape[1], n, "x_BSHD sequence length (dim 1)",
                       "pad the sequence to a multiple of the sequence-parallel size")
    return lax.all_to_all(x_BSHD, axis, split_axis=1, concat_axis=2, tiled=True)


@dataclasses.dataclass(frozen=True)
class KvHeadLayout:
    """Static plan for sending GQA kv heads to the ranks whose q heads use them.

    slot_heads_NS[r]: the kv heads rank r receives (S slots, the same count for every rank, as a padded
        all-to-all needs); a rank that needs fewer than S heads gets its first needed head again in the
        spare slots (the only bytes sent that are not needed; zero when G % n == 0 or n % G == 0).
    q_slot_NQ[r, j]: the received slot that local q head j of rank r reads.
    expand_locally: the slot layout is not a plain GQA grouping of the local q heads, so after the
        all-to-all each rank copies its slots out to one kv head per local q head (local memory, no wire).
    """
    num_q_heads: int
    num_kv_heads: int
    axis_size: int
    slot_heads_NS: np.ndarray
    q_slot_NQ: np.ndarray
    expand_locally: bool

    @property
    def slots_per_rank(self) -> int:
        return self.slot_heads_NS.shape[1]

    @property
    def local_kv_heads(self) -> int:
        """kv heads each rank holds after `kv_seq_to_heads` (its local q heads use plain GQA over them)."""
        return self.q_slot_NQ.shape[1] if self.expand_locally else self.slots_per_rank

    def local_kv(self, k_recv_BSSD: jax.Array, rank) -> jax.Array:
        """The received slots [B, S, slots, D] of rank `rank` -> its local kv heads (plain GQA for its q heads)."""
        if not self.expand_locally:
            return k_recv_BSSD
        return jnp.take(k_recv_BSSD, jnp.asarray(self.q_slot_NQ)[rank], axis=2)

    def wire_bytes(self, batch: int, seq_len: int, head_dim: int, itemsize: int) -> int:
        """Bytes one rank sends for one of k or v: (n-1) * B * (S/n) * slots * D * itemsize."""
        n = self.axis_size
        return (n - 1) * batch * (seq_len // n) * self.slots_per_rank * head_dim * itemsize


def kv_head_layout(num_q_heads: int, num_kv_heads: int, axis_size: int) -> KvHeadLayout:
    """Which kv heads each rank needs for its q heads [r*Hq/n, (r+1)*Hq/n); q head h uses kv head h // m."""
    n = axis_size
    _require_divisible(num_q_heads, n, "num_q_heads", "choose a head count that is a multiple of n")
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads = {num_q_heads} is not a multiple of the kv head count "
                         f"{num_kv_heads}; GQA needs whole groups of q heads per kv head")
    group = num_q_heads // num_kv_heads
    q_per_rank = num_q_heads // n
    kv_of_q_NQ = np.arange(num_q_heads).reshape(n, q_per_rank) // group
    needed = [np.unique(row) for row in kv_of_q_NQ]  # sorted, since kv_of_q is monotone
    slots = max(len(heads) for heads in needed)
    slot_heads_NS = np.stack([np.concatenate([h, np.full(slots - len(h), h[0])]) for h in needed])
    q_slot_NQ = np.stack([np.searchsorted(h, row) for h, row in zip(needed, kv_of_q_NQ)])
    plain_gqa = (q_per_rank % slots == 0 and
                 np.array_equal(q_slot_NQ, np.broadcast_to(np.arange(q_per_rank) // (q_per_rank // slots),
                                                           q_slot_NQ.shape)))
    return KvHeadLayout(num_q_heads, num_kv_heads, n, slot_heads_NS.astype(np.int32),
                        q_slot_NQ.astype(np.int32), expand_locally=not plain_gqa)


def kv_seq_to_heads(k_BSGD: jax.Array, axis, num_q_heads: int) -> jax.Array:
    """Ulysses all-to-all for GQA keys or values, any kv head count G (also G < n, or G not dividing n).

    In:  [B, S/n, G, D], my sequence chunk with all G kv heads.
    Out: [B, S, G_loc, D] with G_loc = `kv_head_layout(num_q_heads, G, n).local_kv_heads`; the output of
         `seq_to_heads(q)` on the same rank ([B, S, Hq/n, D]) uses it as plain GQA: local q head j reads
         kv head j // (Hq/n // G_loc), which is what `jax.nn.dot_product_attention` does.
    Each rank receives only the kv heads its q heads use: with n | G that is G/n heads (a plain
    `seq_to_heads`); with G | n it is one head, replicated locally to n/G slots before the all-to-all, and
    autodiff sums the gradients of the replicas in the backward.
    Bytes per rank: (n-1) * B * (S/n) * slots * D * itemsize, slots = `layout.slots_per_rank`
    (G/n when n | G, 1 when G | n, otherwise the most kv heads one rank needs).
    """
    n = lax.axis_size(axis)
    layout = kv_head_layout(num_q_heads, k_BSGD.shape[2], n)
    slot_heads = layout.slot_heads_NS.reshape(-1)
    if np.array_equal(slot_heads, np.arange(k_BSGD.shape[2])):
        k_slots = k_BSGD  # n | G: every head goes to exactly one rank, no copy needed
    else:
        k_slots = jnp.take(k_BSGD, slot_heads, axis=2)
    k_recv = lax.all_to_all(k_slots, axis, split_axis=2, concat_axis=1, tiled=True)
    return layout.local_kv(k_recv, lax.axis_index(axis))


# ----------------------------------------------------------------------------------------------------------
# Megatron tensor-parallel baseline (sequence-parallel style)
# ----------------------------------------------------------------------------------------------------------


def gather_seq(x_BSD: jax.Array, axis, *, seq_dim: int = 1) -> jax.Array:
    """All-gather along the sequence before a column-parallel layer: [B, S/n, ...] -> [B, S, ...].

    Rank r's chunk lands at positions [r*S/n, (r+1)*S/n). Bytes per rank: (n-1) * local bytes.
    """
    return lax.all_gather(x_BSD, axis, axis=seq_dim, tiled=True)


def scatter_sum_seq(x_BSD: jax.Array, axis, *, seq_dim: int = 1) -> jax.Array:
    """Reduce-scatter along the sequence after a row-parallel layer: partial [B, S, ...] -> summed [B, S/n, ...].

    Bytes per rank: (n-1)/n * local input bytes.
    """
    n = lax.axis_size(axis)
    _require_divisible(x_BSD.shape[seq_dim], n, f"x_BSD sequence length (dim {seq_dim})",
                       "pad the sequence to a multiple of the tensor-parallel size")
    return lax.psum_scatter(x_BSD, axis, scatter_dimension=seq_dim, tiled=True)


def sum_over(x: jax.Array, axis) -> jax.Array:
    """All-reduce sum of partial results (row-parallel outputs, global counters). Bytes: 2 (n-1)/n * bytes."""
    return lax.psum(x, axis)


# ----------------------------------------------------------------------------------------------------------
# Expert parallelism (token dispatch / combine)
# ----------------------------------------------------------------------------------------------------------


def exchange_tokens(buf_NCD: jax.Array, axis) -> jax.Array:
    """All-to-all of per-destination buffers: in, row block d goes to rank d; out, row block s came from rank s.

    [n, C, ...] -> [n, C, ...]. Used both ways (dispatch and return) and for the per-expert counts.
    Bytes per rank: (n-1)/n * n * C * (row bytes) = (n-1) * C * row bytes.
    """
    n = lax.axis_size(axis)
    if buf_NCD.shape[0] != n:
        raise ValueError(f"buf_NCD has {buf_NCD.shape[0]} destination blocks (dim 0) but the axis has n = {n} "
                         "ranks; pack one block per destination rank")
    return lax.all_to_all(buf_NCD, axis, split_axis=0, concat_axis=0, tiled=True)


def exchange_counts(counts_NG: jax.Array, axis) -> jax.Array:
    """All-to-all of per-(destination, local expert) row counts: [n, G] int -> [n (source), G] int.

    Sent before the payload so the receiver knows where each expert's rows are. Bytes: (n-1) * G * 4.
    """
    return exchange_tokens(counts_NG, axis)


def gather_tokens(x_TD: jax.Array, axis) -> jax.Array:
    """All-gather tokens (or their routing) over the EP domain: [T, ...] -> [n*T, ...], rank-major.

    Bytes per rank: (n-1) * local bytes.
    """
    return lax.all_gather(x_TD, axis, axis=0, tiled=True)


def scatter_sum_tokens(y_TD: jax.Array, axis) -> jax.Array:
    """Reduce-scatter the experts' partial outputs back to the token owners: [n*T, ...] -> [T, ...].

    Bytes per rank: (n-1)/n * local input bytes = (n-1) * T * row bytes.
    """
    n = lax.axis_size(axis)
    _require_divisible(y_TD.shape[0], n, "y_TD rows (dim 0)", "pass the [n*T, D] output of gather_tokens")
    return lax.psum_scatter(y_TD, axis, scatter_dimension=0, tiled=True)


def ring_pass(x, axis, *, shift: int = 1):
    """Point-to-point ring step over the intra domain: rank i sends x (an array or a tuple of arrays) to rank
    i + shift (mod n) and receives rank i - shift's. One hop per step (shift 1) is what a fused AG+GEMM /
    GEMM+RS schedule moves while it computes; shift j is the j-th of the n - 1 direct sends an all-to-all
    splits into (a fused GEMM+A2A / A2A+GEMM schedule: on NVLink every pair of ranks is one hop apart).

    Bytes per rank: one local x.
    """
    n = lax.axis_size(axis)
    return lax.ppermute(x, axis, perm=[(i, (i + shift) % n) for i in range(n)])
