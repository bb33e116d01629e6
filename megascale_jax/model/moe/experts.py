"""Routed experts: SwiGLU FFNs evaluated as grouped GEMMs over rows sorted by expert.

`grouped_gemm` is the one function boundary for the expert matmuls. Its reference is `jax.lax.ragged_dot`
(XLA; on GPU it becomes a dense masked GEMM, ~97 TFLOP/s at the Mixtral shape on an H200); `pallas` is our
Mosaic GPU kernel (pallas_kernels/grouped_gemm.py) with the same semantics.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from megascale_jax.model.layers import param

GROUPED_GEMM_IMPLEMENTATIONS = ("xla", "pallas", "auto")


def grouped_gemm(x_MK, w_GKN, group_sizes_G, implementation: str = "xla"):
    """y[m] = x[m] @ w[g(m)] for rows sorted by group; rows past sum(group_sizes) are zeros.

    `auto`: the Pallas kernel when it takes these operands (GPU, bf16/f16, K and N aligned), else XLA.
    """
    if implementation == "auto":
        from pallas_kernels.grouped_gemm import unsupported_reason

        usable = jax.default_backend() == "gpu" and unsupported_reason(x_MK, w_GKN) is None
        implementation = "pallas" if usable else "xla"
    if implementation == "xla":
        return jax.lax.ragged_dot(x_MK, w_GKN, group_sizes_G)
    if implementation == "pallas":
        from pallas_kernels.grouped_gemm import grouped_gemm as pallas_grouped_gemm

        return pallas_grouped_gemm(x_MK, w_GKN, group_sizes_G)
    raise ValueError(f"grouped GEMM implementation {implementation!r}; choose one of "
                     f"{', '.join(GROUPED_GEMM_IMPLEMENTATIONS)} (config.parallel.grouped_gemm).")




class SwiGLUExperts(nnx.Module):
    """E experts, each down(silu(x @ gate_e) * (x @ up_e)); under EP a rank holds E/n of them."""

    def __init__(self, num_experts: int, dim: int, ffn: int, param_dtype, rngs: nnx.Rngs):
        self.w_gate_EDF = param(rngs, (num_experts, dim, ffn), ("experts", "embed", "expert_ffn"), param_dtype)
        self.w_up_EDF = param(rngs, (num_experts, dim, ffn), ("experts", "embed", "expert_ffn"), param_dtype)
        self.w_down_EFD = param(rngs, (num_experts, ffn, dim), ("experts", "expert_ffn", "embed"), param_dtype)

    def __call__(self, x_MD, group_sizes_E, implementation: str = "xla"):
        """Rows of x sorted by (local) expert; `group_sizes` has one entry per expert held here."""
        dt = x_MD.dtype
        gate = grouped_gemm(x_MD, self.w_gate_EDF[...].astype(dt), group_sizes_E, implementation)
        up = grouped_gemm(x_MD, self.w_up_EDF[...].astype(dt), group_sizes_E, implementation)
        hidden = jax.nn.silu(gate) * up
        out = grouped_gemm(hidden, self.w_down_EFD[...].astype(dt), group_sizes_E, implementation)
        return checkpoint_name(out, "expert_out")
