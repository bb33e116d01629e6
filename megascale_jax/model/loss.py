"""Training objective: next-token cross-entropy + weighted MoE balance and z losses.

Aux losses and metrics are returned as values (no mutable collections).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy(logits_BSV, targets_BS):
    """Mean token cross-entropy in float32."""
    logits = logits_BSV.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets_BS[..., None], axis=-1)[..., 0]
    return jnp.mean(log_z - target_logit)


def objective(model, batch, layout, moe_cfg):
    """Returns (total loss, metrics). Metrics: ce, aux_loss, z_loss (layer means), tokens_per_expert, dropped.

    Under a manual layout this runs per device inside shard_map: `layout.token_mean` / `batch_sum` /
    `device_sum` turn this device's values into the batch's, so every device returns the global loss.
    """
    logits, stats = model(batch["inputs"], layout)
    ce = layout.token_mean(cross_entropy(logits, batch["targets"]))
    aux, z = jnp.mean(stats["aux_loss"]), jnp.mean(stats["z_loss"])
    total = ce + moe_cfg.aux_loss_weight * aux + moe_cfg.z_loss_weight * z
    metrics = {"ce": ce, "aux_loss": aux, "z_loss": z,
               "tokens_per_expert": layout.batch_sum(stats["tokens_per_expert"]),
               "dropped_tokens": layout.device_sum(jnp.sum(stats["dropped_tokens"]))}
    return total, metrics
