"""Plain-jnp twins of the grouped GEMM kernels (fp32 accumulation, G dense products): for CPUs and tests.

Each has the semantics of its kernel in `grouped_gemm.py` (which re-exports them): rows sorted by group,
group g owns rows [sum(sizes[:g]), sum(sizes[:g+1])), rows past sum(group_sizes) come out as zeros.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels._work_tables import group_bounds


def grouped_gemm_reference(x_MK, w_GKN, group_sizes_G, preferred_element_type=None):
    """Plain-jnp twin: one dense fp32-accumulated product per group, rows masked to their group
    (G times the FLOPs; for CPUs and tests)."""
    m = x_MK.shape[0]
    out_dtype = jnp.dtype(preferred_element_type or x_MK.dtype)
    starts, ends = group_bounds(group_sizes_G, m)
    rows = jnp.arange(m)[:, None]
    y_MN = jnp.zeros((m, w_GKN.shape[2]), jnp.float32)
    for g in range(w_GKN.shape[0]):
        in_group = (rows >= starts[g]) & (rows < ends[g])
        x_g = jnp.where(in_group, x_MK, jnp.zeros_like(x_MK))
        y_MN = y_MN + jnp.dot(x_g, w_GKN[g], preferred_element_type=jnp.float32,
                              precision=lax.Precision.HIGHEST)
    return y_MN.astype(out_dtype)


def grouped_gemm_dgrad_reference(dy_MN, w_GKN, group_sizes_G, preferred_element_type=None):
    """Twin of `grouped_gemm_dgrad`: the forward twin with each group's weight transposed."""
    return grouped_gemm_reference(dy_MN, jnp.swapaxes(w_GKN, 1, 2), group_sizes_G, preferred_element_type)


def grouped_gemm_wgrad_reference(x_MK, dy_MN, group_sizes_G, preferred_element_type=None):
    """Twin of `grouped_gemm_wgrad`: per group, x's rows outside the group zeroed, then x_MKᵀ @ dy_MN."""
    starts, ends = group_bounds(group_sizes_G, x_MK.shape[0])
    rows_GM = jnp.arange(x_MK.shape[0])[None, :]
    in_group_GM1 = ((rows_GM >= starts[:, None]) & (rows_GM < ends[:, None]))[:, :, None]
    dw = jnp.einsum("gmk,mn->gkn", jnp.where(in_group_GM1, x_MK, jnp.zeros_like(x_MK)), dy_MN,
                    preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
    return dw.astype(jnp.dtype(preferred_element_type or x_MK.dtype))
