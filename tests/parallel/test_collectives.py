"""Collectives == single-device computations: Ulysses all-to-alls, GQA kv heads, TP gather/scatter, EP moves."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from megascale_jax.parallel import collectives as C

N = 8
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((N,), ("x",), axis_types=(AxisType.Explicit,))


def _sharded(mesh, body, in_specs, out_specs):
    """jit(shard_map(body)) that first moves its (unsharded) inputs onto in_specs, as Explicit axes need."""
    mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)

    def run(*args):
        return mapped(*(jax.reshard(a, NamedSharding(mesh, s)) for a, s in zip(args, in_specs)))
    return run


def _normal(seed, shape):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


# ----------------------------------------------------------------------------------------------------------
# Ulysses


def test_seq_to_heads_is_a_reshape_and_heads_to_seq_inverts_it(mesh):
    B, S, H, D = 2, 16, 16, 4
    x = _normal(0, (B, S, H, D))

    def body(x_local):
        by_heads = C.seq_to_heads(x_local, "x")
        return by_heads[None], C.heads_to_seq(by_heads, "x")

    per_rank, round_trip = jax.jit(_sharded(mesh, body, (P(None, "x"),), (P("x"), P(None, "x"))))(x)
    # Rank r: all S positions (in order), heads [r*H/n, (r+1)*H/n).
    want = np.moveaxis(np.asarray(x).reshape(B, S, N, H // N, D), 2, 0)
    np.testing.assert_array_equal(per_rank, want)
    np.testing.assert_array_equal(round_trip, x)


def test_seq_to_heads_rejects_head_count_not_divisible(mesh):
    body = lambda x: C.seq_to_heads(x, "x")
    with pytest.raises(ValueError, match="heads.*multiple of the sequence-parallel size"):
        _sharded(mesh, body, (P(None, "x"),), P(None, "x"))(jnp.zeros((1, 16, 12, 4)))


def test_kv_head_layout_sends_only_needed_heads():
    plain = C.kv_head_layout(num_q_heads=16, num_kv_heads=16, axis_size=8)  # n | G: plain Ulysses
    assert plain.slots_per_rank == 2 and not plain.expand_locally
    np.testing.assert_array_equal(plain.slot_heads_NS, np.arange(16).reshape(8, 2))
    few = C.kv_head_layout(num_q_heads=8, num_kv_heads=2, axis_size=8)  # G | n: one head per rank
    np.testing.assert_array_equal(few.slot_heads_NS[:, 0], [0, 0, 0, 0, 1, 1, 1, 1])
    assert few.local_kv_heads == 1
    assert few.wire_bytes(batch=2, seq_len=64, head_dim=128, itemsize=2) == 7 * 2 * 8 * 1 * 128 * 2
    # Hq=24, G=12, n=8: rank 0 has q heads 0,1,2 -> kv heads 0,0,1; 2 slots, no padding, local expand.
    odd = C.kv_head_layout(num_q_heads=24, num_kv_heads=12, axis_size=8)
    assert odd.slots_per_rank == 2 and odd.expand_locally and odd.local_kv_heads == 3
    np.testing.assert_array_equal(odd.slot_heads_NS[:2], [[0, 1], [1, 2]])
    np.testing.assert_array_equal(odd.q_slot_NQ[:2], [[0, 0, 1], [0, 1, 1]])
    with pytest.raises(ValueError, match="num_q_heads = 24 is not a multiple of the kv head count 5"):
        C.kv_head_layout(num_q_heads=24, num_kv_heads=5, axis_size=8)
    with pytest.raises(ValueError, match="num_q_heads = 12 is not divisible"):
        C.kv_head_layout(num_q_heads=12, num_kv_heads=4, axis_size=8)


def _attention(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [
    (8, 1), (8, 2), (8, 4), (8, 8), (16, 1), (16, 2), (16, 4), (16, 8),
    (24, 6), (24, 12),  # kv heads neither dividing nor divisible by n: padded slots, local expand
])
def test_ulysses_gqa_attention_matches_single_device(mesh, num_q_heads, num_kv_heads):
    B, S, D = 1, 16, 4
    q = _normal(1, (B, S, num_q_heads, D))
    k, v = _normal(2, (B, S, num_kv_heads, D)), _normal(3, (B, S, num_kv_heads, D))
    cot = _normal(4, (B, S, num_q_heads, D))
    layout = C.kv_head_layout(num_q_heads, num_kv_heads, N)

    def sp_attention(q, k, v):
        q_heads = C.seq_to_heads(q, "x")
        k_heads = C.kv_seq_to_heads(k, "x", num_q_heads)
        out = C.heads_to_seq(_attention(q_heads, k_heads, C.kv_seq_to_heads(v, "x", num_q_heads)), "x")
        return out, k_heads[None]

    seq = P(None, "x")
    sharded = _sharded(mesh, sp_attention, (seq, seq, seq), (seq, P("x")))

    @jax.jit
    def outputs_and_grads(q, k, v):  # one compile for both sides: these tests must stay fast
        (got_out, k_per_rank), got_vjp = jax.vjp(sharded, q, k, v)
        want_out, want_vjp = jax.vjp(_attention, q, k, v)
        return got_out, k_per_rank, got_vjp((cot, jnp.zeros_like(k_per_rank))), want_out, want_vjp(cot)

    got_out, k_per_rank, got_grads, want_out, want_grads = outputs_and_grads(q, k, v)
    np.testing.assert_allclose(got_out, want_out, **TOL)
    k_per_rank = np.asarray(k_per_rank)
    # Each rank holds exactly the kv heads its q heads use (the backward summed the replicas' gradients).
    q_per_rank = num_q_heads // N
    kv_of_q = np.arange(num_q_heads).reshape(N, q_per_rank) // (num_q_heads // num_kv_heads)
    assert k_per_rank.shape[3] == layout.local_kv_heads
    for r in range(N):
        local_kv_of_q = np.arange(q_per_rank) // (q_per_rank // layout.local_kv_heads)
        np.testing.assert_array_equal(k_per_rank[r][:, :, local_kv_of_q], np.asarray(k)[:, :, kv_of_q[r]])
    for got, want in zip(got_grads, want_grads):
        np.testing.assert_allclose(got, want, **TOL)


# ----------------------------------------------------------------------------------------------------------
# Megatron TP baseline


def test_tensor_parallel_mlp_matches_single_device(mesh):
    """Column-parallel w1, row-parallel w2; sequence-parallel (gather/scatter) and plain (psum) variants."""
    B, S, D, F = 2, 16, 4, 32
    x, w1, w2, cot = _normal(5, (B, S, D)), _normal(6, (D, F)), _normal(7, (F, D)), _normal(8, (B, S, D))
    mlp = lambda x, w1, w2: jax.nn.gelu(x @ w1) @ w2

    def seq_parallel(x, w1, w2):
        return C.scatter_sum_seq(mlp(C.gather_seq(x, "x"), w1, w2), "x")

    def replicated_tokens(x, w1, w2):
        return C.sum_over(mlp(x, w1, w2), "x")

    cases = [(seq_parallel, P(None, "x")), (replicated_tokens, P())]
    want = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(mlp(*a) * cot), (0, 1, 2)))(x, w1, w2)
    for body, x_spec in cases:
        sharded = _sharded(mesh, body, (x_spec, P(None, "x"), P("x")), x_spec)
        got = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(sharded(*a) * cot), (0, 1, 2)))(x, w1, w2)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(g, w, **TOL)


# ----------------------------------------------------------------------------------------------------------
# Expert-parallel data movement


def test_expert_parallel_moves(mesh):
    T, D = 3, 2
    # Rank r's block d holds the value 100*r + d: after the exchange rank d's block r must hold it.
    blocks = np.add.outer(100 * np.arange(N), np.arange(N)).astype(np.float32)
    buf = np.broadcast_to(blocks[:, :, None, None], (N, N, T, D)).reshape(N * N, T, D)
    tokens = _normal(9, (N * T, D))

    def body(buf, counts, tokens):
        return (C.exchange_tokens(buf, "x"), C.exchange_counts(counts, "x"),
                C.gather_tokens(tokens, "x")[None], C.scatter_sum_tokens(C.gather_tokens(tokens, "x"), "x"))

    spec = P("x")
    exchanged, counts, gathered, summed = jax.jit(_sharded(mesh, body, (spec,) * 3, (spec,) * 4))(
        jnp.asarray(buf), jnp.asarray(blocks, jnp.int32).reshape(N * N, 1), tokens)
    np.testing.assert_array_equal(np.asarray(exchanged).reshape(N, N, T, D)[..., 0, 0], blocks.T)
    np.testing.assert_array_equal(np.asarray(counts).reshape(N, N), blocks.T)
    np.testing.assert_array_equal(gathered, np.broadcast_to(tokens, (N, N * T, D)))
    np.testing.assert_allclose(summed, N * tokens, **TOL)
    with pytest.raises(ValueError, match="buf_NCD has 4 destination blocks"):
        _sharded(mesh, lambda b: C.exchange_tokens(b, "x"), (spec,), spec)(jnp.zeros((N * 4, 2)))
