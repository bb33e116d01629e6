"""The single-device layout: where the model's communication hooks do nothing.

A layout tells the model how its layers are laid out over devices. The model calls the same hooks in the
same places under every plan; this one is used on one device and under the XLA plan (where the compiler
inserts the communication). The manual SP / TP / EP layouts live in megascale_jax/parallel/layouts.py.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from megascale_jax.model.moe.dispatch import sort_by_expert, unsort_and_combine


@dataclasses.dataclass(frozen=True)
class LocalLayout:
    attention_impl: str = "xla"     # xla | cudnn (jax.nn.dot_product_attention's implementation)
    grouped_gemm: str = "xla"       # xla | pallas | auto (see model/moe/experts.py)

    def evaluate(self, fn, params, batch):
        """Runs fn(params, batch) -> (loss, metrics); on one device / under XLA, directly."""
        return fn(params, batch)

    def token_mean(self, x):
        """Mean over this device's tokens -> mean over the batch's tokens."""
        return x

    def batch_sum(self, counts):
        """Per-expert counts already summed over the intra domain -> summed over the whole batch."""
        return counts

    def device_sum(self, x):
        """A per-device count -> the sum over all devices."""
        return x

    def attention_input(self, x_BSD):
        return x_BSD

    def positions(self, x_BSD):
        batch, seq = x_BSD.shape[:2]
        return jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))

    def attention_in(self, q, k, v):
        return q, k, v

    def attention_out(self, out):
        return out

    def attention_proj_out(self, y_BSD):
        return y_BSD

    def ffn_input(self, x_BSD):
        return x_BSD

    def ffn_output(self, y_BSD):
        return y_BSD

    def expert_ffn(self, x_TD, routing, experts, num_experts: int):
        """Dropless: every routed assignment is computed. Returns (y_TD, dropped=0, tokens_per_expert)."""
        x_sorted, group_sizes, order = sort_by_expert(x_TD, routing.idx_TK, num_experts)
        y_sorted = experts(x_sorted, group_sizes, self.grouped_gemm)
        y_TD = unsort_and_combine(y_sorted, order, routing.weight_TK)
        return y_TD, jnp.zeros((), jnp.int32), routing.tokens_per_expert_E


def layout_for(cfg, plan, mesh):
    """The layout a config and plan call for: local hooks under the XLA plan, shard_map hooks under manual."""
    attention_impl = cfg.parallel.attention_impl
    if attention_impl == "auto":
        gpu_bf16 = jax.default_backend() == "gpu" and cfg.train.compute_dtype == "bfloat16"
        attention_impl = "cudnn" if gpu_bf16 else "xla"
    grouped = cfg.parallel.grouped_gemm   # 'auto' is decided per call, by operand shapes and dtype
    if plan.kind == "xla":
        return LocalLayout(attention_impl=attention_impl, grouped_gemm=grouped)
    from megascale_jax.model.manual_layout import ManualLayout

    return ManualLayout(attention_impl=attention_impl, grouped_gemm=grouped, plan=plan, mesh=mesh,
                        num_heads=cfg.model.num_heads)
