"""`pallas_kernels.varying` on the 8 simulated CPU devices: the axes read inside shard_map, and the two
typing rules the grouped GEMM's custom VJP relies on (its GPU test checks them with the real kernel)."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from pallas_kernels.varying import match_varying, vary_like, varying_axes


def _mesh():
    return jax.make_mesh((2, 4), ("e", "d"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def test_varying_axes_inside_and_outside_shard_map():
    seen = {}

    def local(x, w):
        seen.update(x=varying_axes(x), w=varying_axes(w), const=varying_axes(jnp.ones(3)),
                    like=varying_axes(vary_like(w, x, w)))
        return x

    jax.shard_map(local, mesh=_mesh(), in_specs=(P(("e", "d")), P("d")), out_specs=P(("e", "d")))(
        jnp.zeros(8), jnp.zeros(4))
    assert seen == dict(x={"e", "d"}, w={"d"}, const=frozenset(), like={"e", "d"})
    assert varying_axes(jnp.zeros(3)) == frozenset()
    assert vary_like(jnp.zeros(3), jnp.ones(3)).shape == (3,)   # a no-op outside shard_map


def test_match_varying_sums_over_axes_the_primal_is_replicated_on():
    """A cotangent computed from values that differ along e and d, for a primal varying along d only:
    summed over e (the transpose of replicating the primal along e), kept per device along d."""
    x = jnp.arange(8, dtype=jnp.float32)

    def local(x, w):
        ct = match_varying(x * 10.0, w, x)
        assert varying_axes(ct) == varying_axes(w) == {"d"}
        return ct

    got = jax.shard_map(local, mesh=_mesh(), in_specs=(P(("e", "d")), P("d")), out_specs=P("d"))(
        x, jnp.zeros(4))
    np.testing.assert_array_equal(got, 10.0 * (x[:4] + x[4:]))   # device (e, d) holds x[4e + d]


def test_per_device_refusal_names_where_a_per_device_kernel_cannot_run():
    from pallas_kernels.varying import per_device_refusal

    assert per_device_refusal(backend="gpu", partitioned_by_xla=False) is None
    assert per_device_refusal(backend="cpu", partitioned_by_xla=False) == "backend 'cpu'"
    assert per_device_refusal(backend="gpu", partitioned_by_xla=True) == "the XLA plan on several devices"
