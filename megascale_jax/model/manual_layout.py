"""The manual plan's layout: the model runs per device inside one `jax.shard_map` over the whole mesh.

Inside the intra-node domain (mesh axis `intra`, n devices) the residual stream is sequence-sharded and
  attention 'sp'  Ulysses: q/k/v all-to-all from sequence- to head-sharded, attention on the full sequence
                  with H/n heads, all-to-all back; attention weights replicated (gradients psum'd by
                  shard_map's autodiff);
  attention 'tp'  Megatron with sequence parallelism: all-gather the sequence, heads sharded in the weights,
                  reduce-scatter the output projection's partial sums back to sequence shards;
  ffn 'ep'        whole experts per device, tokens exchanged by all-to-all or all-gather
                  (megascale_jax/parallel/expert_parallel.py);
  ffn 'tp'        all-gather the sequence, expert (and shared / dense) FFN width sharded in the weights,
                  local dispatch, reduce-scatter the partial sums.
The batch is sharded over `data`; losses and counts are averaged / summed over the devices so every
device returns the global values, and gradients match the single-device model.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from megascale_jax.model.layout import LocalLayout
from megascale_jax.parallel import collectives
from megascale_jax.parallel.expert_parallel import expert_parallel_ffn
from megascale_jax.parallel.plan import DATA, INTRA, PIPE, ParallelPlan


def _without(spec: P, axis: str) -> P:
    return P(*(None if entry == axis else entry for entry in spec))


def _varying(x, axes) -> tuple[str, ...]:
    """The mesh axes among `axes` along which x differs between devices (shard_map's vma type)."""
    vma = collectives.varying_axes(x)
    return tuple(a for a in axes if a in vma)


@dataclasses.dataclass(frozen=True)
class ManualLayout(LocalLayout):
    plan: ParallelPlan | None = None
    mesh: jax.sharding.Mesh | None = None
    num_heads: int = 0

    # ------------------------------------------------------------------ running per device
    def evaluate(self, fn, params, batch):
        """Runs fn per device in shard_map: params by their logical axes, the batch as (data, intra)."""
        # The whole model runs here (no pipeline): layers sharded over 'pipe' come in gathered.
        param_specs = jax.tree.map(lambda spec: _without(self.plan.param_spec(tuple(spec)), PIPE),
                                   nnx.get_partition_spec(params), is_leaf=lambda x: isinstance(x, P))
        batch_specs = jax.tree.map(lambda _: self.plan.batch_spec(), batch)
        run = jax.shard_map(fn, mesh=self.mesh, in_specs=(param_specs, batch_specs), out_specs=P())
        return run(params, batch)

    def token_mean(self, x):
        # Averaging over an axis x does not vary along is the identity (and an error for pmean under vma).
        return lax.pmean(x, _varying(x, (DATA, INTRA)))

    def batch_sum(self, counts):
        # Counts arrive already summed over the intra domain (the same on its n devices, but typed as
        # varying); pmax over intra makes them invariant without changing them, psum over data adds batches.
        counts = lax.pmax(counts, _varying(counts, (INTRA,)))
        return lax.psum(counts, _varying(counts, (DATA,)))

    def device_sum(self, x):
        return lax.psum(x, _varying(x, (DATA, INTRA)))

    # ------------------------------------------------------------------ attention
    @property
    def _sp(self) -> bool:
        return self.plan.attention == "sp"

    def attention_input(self, x_BSD):
        return x_BSD if self._sp else collectives.gather_seq(x_BSD, INTRA)

    def positions(self, x_BSD):
        batch, seq = x_BSD.shape[:2]
        offset = lax.axis_index(INTRA) * seq if self._sp else 0
        return jnp.broadcast_to(offset + jnp.arange(seq, dtype=jnp.int32), (batch, seq))

    def attention_in(self, q, k, v):
        if not self._sp:
            return q, k, v
        return (collectives.seq_to_heads(q, INTRA), collectives.kv_seq_to_heads(k, INTRA, self.num_heads),
                collectives.kv_seq_to_heads(v, INTRA, self.num_heads))

    def attention_out(self, out):
        return collectives.heads_to_seq(out, INTRA) if self._sp else out

    def attention_proj_out(self, y_BSD):
        return y_BSD if self._sp else collectives.scatter_sum_seq(y_BSD, INTRA)

    # ------------------------------------------------------------------ FFN
    @property
    def _ep(self) -> bool:
        return self.plan.ffn == "ep"

    def ffn_input(self, x_BSD):
        return x_BSD if self._ep else collectives.gather_seq(x_BSD, INTRA)

    def ffn_output(self, y_BSD):
        return y_BSD if self._ep else collectives.scatter_sum_seq(y_BSD, INTRA)

    def expert_ffn(self, x_TD, routing, experts, num_experts: int):
        if not self._ep:
            # TP: every device holds all (gathered) tokens and an F/n slice of every expert.
            return super().expert_ffn(x_TD, routing, experts, num_experts)
        y, stats = expert_parallel_ffn(
            x_TD, routing.idx_TK, routing.weight_TK,
            lambda x_MD, group_sizes: experts(x_MD, group_sizes, self.grouped_gemm),
            axis=INTRA, num_experts=num_experts, dispatch=self.plan.dispatch,
            capacity_factor=self.plan.capacity_factor or None)
        return y, stats["dropped_tokens"], stats["tokens_per_expert"]
