"""Expert-parallel FFN == single-device masked MoE FFN: values and gradients, both dispatch paths."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from megascale_jax.parallel import hlo_bytes
from megascale_jax.parallel.expert_parallel import (expert_parallel_ffn, expert_parallel_wire_bytes,
                                                    moe_ffn_reference)

N = 8
T_LOCAL, D, F = 4, 8, 16
TOL = dict(rtol=1e-5, atol=1e-5)


def _mesh_1d():
    return jax.make_mesh((N,), ("x",), axis_types=(AxisType.Explicit,))


def _swiglu(x, w_gate, w_up, w_down):
    return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down


def _ragged_swiglu(w_gate_GDF, w_up_GDF, w_down_GFD):
    """The model's kind of local_experts_fn: a closure over this rank's expert weights."""
    def run(x_MD, group_sizes_G):
        gate = jax.lax.ragged_dot(x_MD, w_gate_GDF, group_sizes_G)
        up = jax.lax.ragged_dot(x_MD, w_up_GDF, group_sizes_G)
        return jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down_GFD, group_sizes_G)
    return run


def _problem(seed, num_tokens, num_experts, top_k, route=None):
    keys = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(keys[0], (num_tokens, D), jnp.float32)
    logits = jax.random.normal(keys[1], (num_tokens, num_experts))
    weight, idx = jax.lax.top_k(jax.nn.softmax(logits), top_k)
    if route is not None:  # forced routing, e.g. every token to one expert
        idx = jnp.broadcast_to(jnp.asarray(route, jnp.int32), (num_tokens, top_k))
    params = tuple(0.3 * jax.random.normal(k, s) for k, s in zip(
        keys[2:5], [(num_experts, D, F), (num_experts, D, F), (num_experts, F, D)]))
    cot = jax.random.normal(keys[5], (num_tokens, D))
    return x, idx.astype(jnp.int32), weight, params, cot


def _reference_loss(x, idx, weight, params, cot, num_experts):
    expert_fn = lambda e, x_TD: _swiglu(x_TD, *(p[e] for p in params))
    y = moe_ffn_reference(x, idx, weight, expert_fn, num_experts)
    return jnp.sum(y * cot), y


GRAD_ARGNUMS = (0, 2, 3)  # x, routing weights, expert weights
_reference_value_and_grad = jax.jit(jax.value_and_grad(_reference_loss, GRAD_ARGNUMS, has_aux=True),
                                    static_argnums=5)


def _sharded_loss(mesh, token_spec, expert_axis, num_experts, dispatch, capacity_factor=None):
    """Loss of the sharded FFN plus its stats; tokens sharded by token_spec, experts over expert_axis."""
    def body(x, idx, weight, w_gate, w_up, w_down, cot):
        y, stats = expert_parallel_ffn(x, idx, weight, _ragged_swiglu(w_gate, w_up, w_down), axis=expert_axis,
                                       num_experts=num_experts, dispatch=dispatch,
                                       capacity_factor=capacity_factor)
        stats = {"dropped_tokens": stats["dropped_tokens"][None],
                 "tokens_per_expert": stats["tokens_per_expert"][None]}
        return jnp.sum(y * cot)[None], y, stats

    expert_spec = P(expert_axis)
    sharded = jax.shard_map(
        body, mesh=mesh,
        in_specs=(token_spec, token_spec, token_spec, expert_spec, expert_spec, expert_spec, token_spec),
        out_specs=(token_spec, token_spec, token_spec))

    explicit = all(t == AxisType.Explicit for t in mesh.axis_types)

    def place(a, spec):  # Explicit axes: inputs must carry the shardings shard_map expects; Auto reshards
        return jax.reshard(a, NamedSharding(mesh, spec)) if explicit else a

    def loss(x, idx, weight, params, cot):
        to_tokens = lambda a: place(a, token_spec)
        params = [place(p, expert_spec) for p in params]
        partial_losses, y, stats = sharded(to_tokens(x), to_tokens(idx), to_tokens(weight), *params,
                                           to_tokens(cot))
        return jnp.sum(partial_losses), (y, stats)
    return loss


def _check_against_reference(loss, reference, problem):
    """Asserts the sharded output, loss and gradients equal the reference's; returns the sharded stats."""
    (value, (y, stats)), grads = jax.jit(jax.value_and_grad(loss, GRAD_ARGNUMS, has_aux=True))(*problem)
    (ref_value, ref_y), ref_grads = reference
    np.testing.assert_allclose(y, ref_y, **TOL)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(got, want, **TOL)
    return stats


CASES = [  # (top_k, num_experts, forced route)
    (1, 8, None), (2, 16, None), (8, 8, None), (8, 16, None),
    (1, 8, [5]),        # every token to one expert: one rank gets all rows
    (2, 16, [3, 2]),    # every token to the two experts of rank 1
]


@pytest.mark.parametrize("top_k,num_experts,route", CASES)
def test_matches_single_device(top_k, num_experts, route):
    """Both dispatch paths (the fast one and its plain twin) against one reference, dropless."""
    problem = _problem(top_k * 100 + num_experts, N * T_LOCAL, num_experts, top_k, route)
    reference = _reference_value_and_grad(*problem, num_experts)
    want_counts = np.bincount(np.asarray(problem[1]).reshape(-1), minlength=num_experts)
    for dispatch in ("all_to_all", "all_gather"):
        loss = _sharded_loss(_mesh_1d(), P("x"), "x", num_experts, dispatch)
        stats = _check_against_reference(loss, reference, problem)
        np.testing.assert_array_equal(stats["dropped_tokens"], np.zeros(N))
        np.testing.assert_array_equal(stats["tokens_per_expert"], np.tile(want_counts, (N, 1)))


def test_second_mesh_axis():
    """EP over 4 ranks of a 2x4 (data, expert) mesh: each data row is an independent EP group.

    Auto axes here (as parallel/plan.py builds them), Explicit in the other tests.
    """
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)
    num_experts, top_k = 8, 2
    problem = _problem(7, 8 * T_LOCAL, num_experts, top_k)
    reference = _reference_value_and_grad(*problem, num_experts)
    idx = np.asarray(problem[1]).reshape(2, -1)  # the two data groups' tokens
    for dispatch in ("all_to_all", "all_gather"):
        loss = _sharded_loss(mesh, P(("data", "expert")), "expert", num_experts, dispatch)
        counts = np.asarray(_check_against_reference(loss, reference, problem)["tokens_per_expert"])
        for group in range(2):
            want = np.bincount(idx[group], minlength=num_experts)
            np.testing.assert_array_equal(counts[group * 4:(group + 1) * 4], np.tile(want, (4, 1)))


def test_capacity_drops_counted_exactly():
    """Hand-built routing, E=16 (G=2 per rank), K=2, T=4, c=4: ceil(4*4*2/8) = 4 rows per destination.

    Kept rows are the first 4 per destination in (expert, token) order; the rest are dropped and counted.
    """
    num_experts, top_k = 16, 2
    x, _, weight, params, cot = _problem(3, N * T_LOCAL, num_experts, top_k)
    idx = np.zeros((N, T_LOCAL, top_k), np.int32)
    idx[0] = [1, 0]                                          # 8 rows to rank 0: 4 kept, 4 dropped
    idx[1] = [[0, 1], [1, 0], [0, 1], [2, 3]]               # 6 rows to rank 0: 4 kept, 2 dropped
    for r in range(2, N):                                    # 2 rows to each of 4 ranks
        idx[r] = [[2 * ((r + t) % N), 2 * ((r + t) % N) + 1] for t in range(T_LOCAL)]
    # Kept rows are the first 4 per destination in (expert, token) order.
    kept = np.ones_like(idx, bool)
    kept[0, :, 0] = False                                    # rank 0: all expert-1 rows
    kept[1, 2, 1], kept[1, 1, 0] = False, False              # rank 1: expert-1 rows of tokens 1 and 2
    idx, kept = idx.reshape(-1, top_k), kept.reshape(-1, top_k)

    loss = _sharded_loss(_mesh_1d(), P("x"), "x", num_experts, "all_to_all", capacity_factor=4.0)
    (value, (y, stats)), grads = jax.jit(jax.value_and_grad(loss, GRAD_ARGNUMS, has_aux=True))(
        x, jnp.asarray(idx), weight, params, cot)
    np.testing.assert_array_equal(stats["dropped_tokens"], [4, 2, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(np.asarray(stats["tokens_per_expert"])[0], np.bincount(idx.reshape(-1), minlength=16))
    # Dropped rows contribute nothing: same as the reference with their weight set to zero.
    kept_weight = jnp.where(kept, weight, 0)
    (ref_value, _), ref_grads = _reference_value_and_grad(x, jnp.asarray(idx), kept_weight, params, cot,
                                                          num_experts)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    np.testing.assert_allclose(grads[0], ref_grads[0], **TOL)
    np.testing.assert_allclose(grads[1], jnp.where(kept, ref_grads[1], 0), **TOL)
    for got, want in zip(grads[2], ref_grads[2]):
        np.testing.assert_allclose(got, want, **TOL)


def test_out_of_range_expert_ids_are_counted_not_silent():
    """Ids outside [0, E) reach no expert, contribute nothing, and are counted as dropped on their rank."""
    num_experts, top_k = 8, 2
    x, idx, weight, params, cot = _problem(13, N * T_LOCAL, num_experts, top_k)
    idx = idx.at[0, 0].set(-1).at[1, 1].set(num_experts).at[N * T_LOCAL - 1, 0].set(99)
    (_, ref_y), _ = _reference_value_and_grad(x, idx, weight, params, cot, num_experts)
    for dispatch in ("all_to_all", "all_gather"):
        loss = _sharded_loss(_mesh_1d(), P("x"), "x", num_experts, dispatch)
        _, (y, stats) = jax.jit(loss)(x, idx, weight, params, cot)
        np.testing.assert_allclose(y, ref_y, **TOL)
        np.testing.assert_array_equal(stats["dropped_tokens"], [2, 0, 0, 0, 0, 0, 0, 1])


@pytest.mark.parametrize("change,message", [
    (dict(dispatch="ragged"), "dispatch = 'ragged'; use one of"),
    (dict(capacity_factor=1.0, dispatch="all_gather"), "capacity_factor applies to dispatch='all_to_all' only"),
    (dict(capacity_factor=0.0), "capacity_factor = 0.0 must be > 0"),
    (dict(num_experts=12), "num_experts = 12 must be a positive multiple of the EP size n = 8"),
    (dict(weight_TK=jnp.zeros((4, 3))), r"weight_TK shape \(4, 3\) must equal expert_idx_TK shape \(4, 2\)"),
    (dict(expert_idx_TK=jnp.zeros((4, 2))), "expert_idx_TK must hold integer expert ids"),
])
def test_bad_arguments_are_named(change, message):
    kwargs = dict(x_TD=jnp.zeros((4, D)), expert_idx_TK=jnp.zeros((4, 2), jnp.int32), weight_TK=jnp.zeros((4, 2)),
                  num_experts=16, dispatch="all_to_all", capacity_factor=None) | change
    arrays = {k: kwargs.pop(k) for k in ("x_TD", "expert_idx_TK", "weight_TK")}

    def body(x_TD, expert_idx_TK, weight_TK):
        return expert_parallel_ffn(x_TD, expert_idx_TK, weight_TK, lambda x, g: x, axis="x", **kwargs)[0]

    sharded = jax.shard_map(body, mesh=_mesh_1d(), in_specs=P(), out_specs=P(), check_vma=False)
    with pytest.raises(ValueError, match=message):
        jax.eval_shape(sharded, *arrays.values())


@pytest.mark.parametrize("dispatch,capacity_factor", [("all_to_all", None), ("all_to_all", 1.5),
                                                      ("all_gather", None)])
def test_wire_bytes_formula_matches_compiled_hlo(dispatch, capacity_factor):
    """The formulas the communication analyzer uses equal what the compiled forward program sends."""
    num_experts, top_k = 16, 2
    x, idx, weight, params, _ = _problem(11, N * T_LOCAL, num_experts, top_k)
    mesh = _mesh_1d()

    def body(x, idx, weight, *params):
        y, stats = expert_parallel_ffn(x, idx, weight, _ragged_swiglu(*params), axis="x",
                                       num_experts=num_experts, dispatch=dispatch, capacity_factor=capacity_factor)
        return y, stats["tokens_per_expert"][None]  # keep the stats' collective in the program

    specs = (P("x"),) * 6
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, idx, weight, *params), specs)]
    sharded = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P("x"), P("x")))
    hlo = jax.jit(sharded).lower(*args).compile().as_text()
    measured = sum(hlo_bytes.collective_bytes(hlo, num_devices=N, field="wire_bytes").values())
    formula = expert_parallel_wire_bytes(num_tokens=T_LOCAL, top_k=top_k, num_experts=num_experts, axis_size=N,
                                         hidden=D, dispatch=dispatch, itemsize=4, capacity_factor=capacity_factor)
    assert measured == sum(formula.values()), (hlo_bytes.collective_bytes(hlo, N, "wire_bytes"), formula)
