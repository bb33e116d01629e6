"""Local (single-device) dispatch: sort the T*K routed assignments by expert, and undo it.

This is the dropless path used on one device and under the XLA plan. The expert-parallel exchanges across
ranks live in megascale_jax/parallel/expert_parallel.py and reuse the same grouped-GEMM experts.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def sort_by_expert(x_TD, idx_TK, num_experts: int):
    """Rows of x repeated per assignment and ordered by expert (stable: token order kept within an expert).

    Returns (x_MD with M = T*K, group_sizes_E int32, order_M) where order_M[m] is the flat assignment index
    (token * K + k) of row m.
    """
    top_k = idx_TK.shape[-1]
    flat = idx_TK.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    x_sorted = jnp.take(x_TD, order // top_k, axis=0)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return x_sorted, group_sizes, order


def unsort_and_combine(y_MD, order_M, weight_TK):
    """Inverse of `sort_by_expert`, then the routing-weighted sum over the K assignments of each token."""
    num_tokens, top_k = weight_TK.shape
    y_flat = jnp.zeros_like(y_MD).at[order_M].set(y_MD)
    y_TKD = y_flat.reshape(num_tokens, top_k, -1)
    out = jnp.einsum("tkd,tk->td", y_TKD.astype(jnp.float32), weight_TK.astype(jnp.float32))
    return out.astype(y_MD.dtype)
