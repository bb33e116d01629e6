"""Softmax top-k router with the grouped auxiliary balance loss and the router z-loss.

Balance loss (Switch / GShard form, per the paper computed over *groups* of experts): the experts of one
expert-parallel rank count as one virtual expert, because balancing whole GPUs is what evens out the
all-to-all and the grouped GEMM work. With num_groups = E / group_size,
    f_g = fraction of the T*K routed assignments that land in group g
    P_g = mean over tokens of the router probability mass of group g
    aux = num_groups * sum_g f_g * P_g            (= 1 when perfectly balanced)
group_size = 1 is the classic per-expert loss. z-loss = mean(logsumexp(logits)^2) keeps logits small.
"""
from __future__ import annotations

import dataclasses
from enum import StrEnum

import jax
import jax.numpy as jnp
from flax import nnx

from megascale_jax.model.layers import param


class RouterKind(StrEnum):
    SOFTMAX_TOPK = "softmax_topk"   # softmax over experts, top-k, optional renormalisation (Mixtral, Qwen)


@dataclasses.dataclass(frozen=True)
class Routing:
    idx_TK: jax.Array       # int32 expert ids, best first
    weight_TK: jax.Array    # float32 combine weights
    aux_loss: jax.Array     # scalar, balance loss (unweighted)
    z_loss: jax.Array       # scalar (unweighted)


jax.tree_util.register_dataclass(Routing)


def _local_mean(x):
    return x


def balance_loss(probs_TE, idx_TK, group_size: int, token_mean=_local_mean):
    """Grouped balance loss; group g holds experts [g*group_size, (g+1)*group_size).

    `token_mean` turns a mean over this device's tokens into the mean over all tokens of the batch (identity
    on one device), so f and P are global before their product, as on one device.
    """
    num_tokens, num_experts = probs_TE.shape
    num_groups = num_experts // group_size
    counts_E = jnp.zeros((num_experts,), jnp.float32).at[idx_TK.reshape(-1)].add(1.0)
    frac_G = token_mean(counts_E.reshape(num_groups, group_size).sum(-1) / idx_TK.size)
    prob_G = token_mean(probs_TE.reshape(num_tokens, num_groups, group_size).sum(-1).mean(0))
    return num_groups * jnp.sum(frac_G * prob_G)


@jax.checkpoint   # recomputed in the backward: saving the [T, K, E] mask would cost E/4 x idx's bytes a layer
def take_top_k(probs_TE, idx_TK):
    """probs at the chosen experts, [T, K], as a compare-select-sum over the E experts (exact: one term is
    nonzero, top_k never repeats an index). Why not top_k's own values: their gradient is a scatter-add into
    [T, E], which XLA:GPU ran at 1.36 ms for deepseekmoe_small's two MoE layers on an H200 (32k tokens, E = 64);
    this form's gradient is a select summed over K, elementwise."""
    chosen_TKE = idx_TK[..., None] == jnp.arange(probs_TE.shape[-1], dtype=idx_TK.dtype)
    return jnp.sum(jnp.where(chosen_TKE, probs_TE[..., None, :], 0.0), axis=-1)


def route(logits_TE, top_k: int, renormalize: bool, group_size: int, token_mean=_local_mean) -> Routing:
    """Pure routing math (float32), separated from the module so tests can feed hand-built logits."""
    logits_TE = logits_TE.astype(jnp.float32)
    probs_TE = jax.nn.softmax(logits_TE, axis=-1)
    _, idx_TK = jax.lax.top_k(jax.lax.stop_gradient(probs_TE), top_k)
    weight_TK = take_top_k(probs_TE, idx_TK)
    if renormalize:
        weight_TK = weight_TK / jnp.sum(weight_TK, axis=-1, keepdims=True)
    z_loss = token_mean(jnp.mean(jax.nn.logsumexp(logits_TE, axis=-1) ** 2))
    aux = balance_loss(probs_TE, idx_TK, group_size, token_mean)
    return Routing(idx_TK.astype(jnp.int32), weight_TK, aux, z_loss)


class Router(nnx.Module):
    """RouterKind.SOFTMAX_TOPK. (A sigmoid router with an aux-free bias would be a second class here.)"""

    def __init__(self, dim: int, num_experts: int, top_k: int, renormalize: bool, group_size: int,
                 rngs: nnx.Rngs):
        # Router weights stay float32 regardless of param dtype: the top-k choice is precision-sensitive.
        self.w_DE = param(rngs, (dim, num_experts), ("embed", None), jnp.float32, fan_in_axes=(0,))  # D
        self.top_k, self.renormalize, self.group_size = top_k, renormalize, group_size

    def __call__(self, x_TD, token_mean=_local_mean) -> Routing:
        return route(router_logits(x_TD, self.w_DE[...]), self.top_k, self.renormalize, self.group_size, token_mean)


def router_logits(x_TD, w_DE):
    """float32 logits [T, E] from float32 router weights (the top-k choice is precision-sensitive)."""
    return jnp.dot(x_TD.astype(jnp.float32), w_DE, preferred_element_type=jnp.float32)


ROUTERS = {RouterKind.SOFTMAX_TOPK: Router}
