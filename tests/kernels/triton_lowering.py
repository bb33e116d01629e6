"""The train step lowered for CUDA on the CPU with some kernels swapped in: Pallas's Triton lowering is told the GPU is
an H100, so a Triton kernel inside the manual plans' checked shard_map is typed and lowered as the GPU run will do it
(where a first GPU run can fail: an output with no varying type)."""
import dataclasses

import jax
import jax.numpy as jnp

# The model's forward and backward appear this many times in the lowered step: of its 2 microbatches the first is
# peeled off the accumulation loop (megascale_jax/gradients.py `accumulate`), the second is the loop's body.
MODEL_TRACES = 2


def lowered_train_step_for_cuda(monkeypatch, config_overrides=None, **kernels) -> str:
    """StableHLO text of the manual SP+EP step (tiny_cpu, bf16, 4-way intra, 2 microbatches, + `config_overrides`)
    with the resolved `kernels` fields replaced by `kernels` (e.g. cross_entropy='pallas')."""
    from jax._src.pallas.triton import gpu_info, pallas_call_registration

    from megascale_jax import step
    from megascale_jax.config import default_config

    h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: h100)
    resolve = step.resolve_kernels
    monkeypatch.setattr(step, "resolve_kernels", lambda cfg, plan: dataclasses.replace(resolve(cfg, plan), **kernels))
    cfg = default_config("tiny_cpu", num_devices=8, **{"train.compute_dtype": "bfloat16", "plan_recipe": "megascale",
                                                      "parallel.intra": 4, "train.microbatches": 2,
                                                      **(config_overrides or {})})
    trainer = step.build(cfg)
    state = jax.tree.map(lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                         jax.eval_shape(lambda: step.create_state(trainer)), trainer.state_shardings)
    tokens = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.train.seq_len), jnp.int32,
                                  sharding=trainer.batch_sharding())
    return step.make_train_step(trainer).trace(state, {"inputs": tokens, "targets": tokens}).lower(
        lowering_platforms=("cuda",)).as_text()
