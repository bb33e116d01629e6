"""Which mesh axes a value varies along inside `shard_map`, and the two typing rules kernels need.

The one home of this jax-version detail: jax 0.11 keeps the axes in `jax.typeof(x).mat.varying`, other
versions in `jax.typeof(x).vma`. Kernels sit below `megascale_jax`, so `megascale_jax.parallel.collectives`
imports `varying_axes` from here rather than the other way round.

  * `varying_axes(x)`: the axes (empty outside shard_map).
  * `vary_like(out, *inputs)`: a Pallas call returns its outputs typed as replicated even when they
    differ between devices; this types them as varying along every axis their inputs vary along.
  * `match_varying(cotangent, primal, *computed_from)`: a `jax.custom_vjp` backward must give each
    cotangent its primal's type; this sums over the axes the primal is replicated on.
  * `output_struct(shape, dtype, *inputs)`: a `pl.pallas_call` (Triton backend) output's type inside a
    checked shard_map must say how it varies: along every axis its inputs vary along.
  * `per_device_refusal(backend, partitioned_by_xla)`: where a per-device GPU kernel cannot run (the one rule the
    kernel choices' resolvers share).
"""
from __future__ import annotations

import jax
from jax import lax


def varying_axes(x) -> frozenset:
    """Mesh axes along which x differs between devices inside shard_map (empty outside, or for constants)."""
    aval = jax.typeof(x)
    if hasattr(aval, "vma"):
        return frozenset(aval.vma)
    mat = getattr(aval, "mat", None)
    return frozenset(mat.varying) if mat is not None else frozenset()


def vary_like(out, *inputs, axes=()):
    """`out` typed as varying along every mesh axis its inputs vary along (the standard rule for an
    elementwise-like dependence) and along `axes` (a collective's output differs between the ranks of its
    axis even for replicated inputs); a no-op outside shard_map or when it already is."""
    axes = frozenset(axes).union(*(varying_axes(a) for a in inputs)) - varying_axes(out)
    return lax.pcast(out, tuple(sorted(axes)), to="varying") if axes else out


def match_varying(cotangent, primal, *computed_from):
    """Gives a cotangent its primal's shard_map type, as custom_vjp requires: axes along which the
    contributions differ (those of `computed_from`) but the primal is replicated are summed, the
    transpose of replication; axes the primal varies along are kept."""
    want = varying_axes(primal)
    have = frozenset().union(*(varying_axes(a) for a in computed_from))
    if have - want:
        cotangent = lax.psum(vary_like(cotangent, *computed_from), tuple(sorted(have - want)))
    return vary_like(cotangent, primal)


def output_struct(shape, dtype, *inputs) -> jax.ShapeDtypeStruct:
    """`jax.ShapeDtypeStruct(shape, dtype)` for a pallas_call output computed from `inputs`: inside shard_map typed
    as varying along every mesh axis they vary along (shard_map's type check requires it stated), outside as is."""
    mat = getattr(jax.typeof(inputs[0]), "mat", None)
    axes = frozenset().union(*(varying_axes(a) for a in inputs))
    if mat is None:   # another jax version's typing (`.vma`): say so rather than return an untyped output
        if axes:
            raise NotImplementedError(f"output_struct: this jax has no ManualAxisType (.mat); inputs vary over {axes}")
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat.update(varying=axes))


def per_device_refusal(*, backend: str, partitioned_by_xla: bool) -> str | None:
    """Why a per-device Pallas GPU kernel cannot run in this build ('backend ...' or 'the XLA plan on several
    devices', for an error message), or None. Under the XLA plan on several devices the compiler partitions the
    step, and a custom kernel's operands would be gathered whole onto each device."""
    if backend != "gpu":
        return f"backend {backend!r}"
    return "the XLA plan on several devices" if partitioned_by_xla else None
