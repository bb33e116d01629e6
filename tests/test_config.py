"""Every config loads and validates; each bad value gets an error that names the key and the fix."""
import pathlib

import pytest
from ml_collections import ConfigDict

from megascale_jax import config as config_lib
from megascale_jax.config import ConfigError, default_config

CONFIG_NAMES = sorted(p.stem for p in pathlib.Path("configs").glob("*.py") if p.stem not in ("__init__", "plans"))
PAPER_MODELS = ("mixtral_8x7b", "mixtral_8x22b", "phi35_moe", "deepseekmoe_16b", "hunyuan_large", "internal_352b")


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_every_config_loads_and_validates(name):
    cfg = default_config(name)
    assert cfg.name in (name, "base")
    assert cfg.model.num_heads % cfg.model.num_kv_heads == 0
    # The intra-node domain of the paper (8 GPUs) validates for every model, under both plans; Qwen1.5-MoE's
    # 60 experts split over at most 4 expert-parallel ranks of a power-of-two node.
    intra = {"base": 2, "tiny_cpu": 2, "qwen2_moe_a2_7b": 4}.get(name, 8)
    for plan in ("xla", "manual"):
        config_lib.validate(default_config(name, **{"parallel.intra": intra, "parallel.plan": plan}))


def test_base_config_keys_all_reach_the_dataclasses():
    cfg = default_config("base")
    for dotted in config_lib.base_keys():
        node = cfg
        for part in dotted.split("."):
            node = getattr(node, part)


@pytest.mark.parametrize("overrides,needle", [
    ({"model.num_kv_heads": 3}, "num_kv_heads"),
    ({"model.moe.top_k": 9}, "top_k"),
    ({"model.hidden": 130}, "hidden"),
    ({"parallel.plan": "magic"}, "parallel.plan"),
    ({"train.seq_len": 4096}, "max_seq_len"),
    ({"model.moe.balance_group_size": 3}, "balance_group_size"),
    ({"parallel.intra": 8, "parallel.plan": "manual", "model.num_heads": 4, "model.num_kv_heads": 2},
     "num_heads"),
    ({"parallel.intra": 3, "parallel.plan": "manual", "model.num_heads": 6, "model.num_kv_heads": 3,
      "model.hidden": 96, "train.seq_len": 96}, "num_experts"),
    ({"data.source": "tokens"}, "data.path"),
    ({"model.num_dense_layers": 2}, "num_dense_layers"),
    ({"parallel.attention_exchange": "nccl"}, "parallel.attention_exchange"),
    ({"kernels.grouped_gemm_tail": "zeros"}, "kernels.grouped_gemm_tail"),
])
def test_bad_values_raise_clear_errors(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        default_config("tiny_cpu", **overrides)


def test_unknown_key_is_an_error():
    cd = __import__("configs.tiny_cpu", fromlist=["x"]).get_config()
    cd.model.hiden = 3  # typo
    with pytest.raises(ConfigError, match="config.model.hiden"):
        config_lib.from_config_dict(cd)
    with pytest.raises(ConfigError, match="unknown config key"):
        default_config("tiny_cpu", **{"train.stepz": 3})


def test_missing_key_is_an_error():
    cd = ConfigDict({"name": "x"})
    with pytest.raises(ConfigError, match="missing config key"):
        config_lib.from_config_dict(cd)


def test_mesh_against_device_count():
    cd = __import__("configs.tiny_cpu", fromlist=["x"]).get_config()
    cfg = config_lib.from_config_dict(cd, num_devices=8)
    assert cfg.parallel.data == 8
    cd.parallel.intra = 3
    with pytest.raises(ConfigError, match="cannot be split"):
        config_lib.from_config_dict(cd, num_devices=8)
    cd.parallel.intra, cd.parallel.data = 2, 2
    with pytest.raises(ConfigError, match="devices"):
        config_lib.from_config_dict(cd, num_devices=8)
    cd.parallel.data, cd.train.global_batch = -1, 6
    with pytest.raises(ConfigError, match="global_batch"):
        config_lib.from_config_dict(cd, num_devices=8)


def test_dispatch_auto_follows_the_top_k_crossover():
    assert default_config("tiny_cpu", **{"model.moe.top_k": 6}).parallel.ep_dispatch == "all_to_all"
    assert default_config("tiny_cpu", **{"model.moe.top_k": 7}).parallel.ep_dispatch == "all_gather"
    assert default_config("tiny_cpu", **{"parallel.ep_dispatch": "all_gather"}).parallel.ep_dispatch \
        == "all_gather"


@pytest.mark.parametrize("name", PAPER_MODELS)
def test_paper_models_run_the_papers_plan_on_a_node(name):
    """As their docstrings launch them, on 8 devices (one simulated node): manual SP attention + EP experts
    over all 8; --config.plan_recipe picks another plan, explicit parallel keys override a recipe."""
    cfg = default_config(name, num_devices=8)
    p = cfg.parallel
    assert (cfg.plan_recipe, p.plan, p.attention, p.ffn, p.intra, p.data) == ("megascale", "manual", "sp", "ep", 8, 1)
    tp = default_config(name, num_devices=8, plan_recipe="megatron_tp").parallel
    assert (tp.plan, tp.attention, tp.ffn, tp.intra) == ("manual", "tp", "tp", 8)
    mixed = default_config(name, num_devices=8, **{"parallel.attention": "tp", "parallel.intra": 4}).parallel
    assert (mixed.plan, mixed.attention, mixed.ffn, mixed.intra, mixed.data) == ("manual", "tp", "ep", 4, 2)


def test_choices_come_from_the_consumers_enums():
    from megascale_jax.model.transformer import Remat
    from megascale_jax.parallel.plan import EPDispatch

    assert config_lib.CHOICES["train.remat"] == tuple(r.value for r in Remat)
    assert config_lib.CHOICES["parallel.ep_dispatch"] == tuple(d.value for d in EPDispatch)
    with pytest.raises(ConfigError, match="plan_recipe='megatron'; choose one of xla, megascale"):
        default_config("tiny_cpu", plan_recipe="megatron")


def test_grouped_gemm_tail_auto_masks_only_expert_parallel_pallas_runs():
    """kernels.grouped_gemm_tail='auto' resolves to 'mask' for the pallas kernel on an EP plan over 2 ranks (its
    receive buffers are mostly tail), to 'kernel' on one rank; 'mask' where the kernel is xla is a ConfigError."""
    from megascale_jax.parallel.plan import ParallelPlan
    from megascale_jax.step import resolve_kernels

    ep2 = {"parallel.intra": 2, "parallel.plan": "manual", "parallel.ffn": "ep", "parallel.attention": "sp"}
    for overrides, tail in [({**ep2, "kernels.grouped_gemm": "pallas"}, "mask"),
                            ({"kernels.grouped_gemm": "pallas"}, "kernel"), (ep2, "kernel")]:   # tiny_cpu's fp32: auto -> xla
        cfg = default_config("tiny_cpu", **overrides)
        assert resolve_kernels(cfg, ParallelPlan.from_config(cfg)).grouped_gemm_tail == tail, overrides
    cfg = default_config("tiny_cpu", **{"kernels.grouped_gemm_tail": "mask"})
    with pytest.raises(ConfigError, match="grouped_gemm_tail='mask'"):
        resolve_kernels(cfg, ParallelPlan.from_config(cfg))


def test_swiglu_auto_takes_the_kernel_backward_on_a_gpu_unless_the_expert_outputs_are_masked(monkeypatch):
    """kernels.swiglu='auto' on a (faked) GPU backend: 'separate_pallas_bwd' on one rank; under expert parallelism
    with the pallas kernel (its outputs masked: grouped_gemm_tail resolves to 'mask') only for the dense SwiGLUs
    (dense layers, shared experts); 'separate' on the CPU. An explicit choice is kept for the experts."""
    from megascale_jax import step
    from megascale_jax.parallel.plan import ParallelPlan

    def swiglu(**overrides):   # (the experts', the dense layers' and shared experts')
        cfg = default_config("tiny_cpu", **overrides)
        kernels = step.resolve_kernels(cfg, ParallelPlan.from_config(cfg))
        return kernels.swiglu, kernels.dense_swiglu
    kernel = "separate_pallas_bwd"
    assert swiglu() == ("separate", "separate")   # the CPU
    monkeypatch.setattr(step.jax, "default_backend", lambda: "gpu")
    ep2 = {"parallel.intra": 2, "parallel.plan": "manual", "parallel.ffn": "ep", "parallel.attention": "sp"}
    assert swiglu() == (kernel, kernel)
    assert swiglu(**{**ep2, "kernels.grouped_gemm": "pallas"}) == ("separate", kernel)   # only the experts' masked
    tail_written = {"kernels.grouped_gemm": "pallas", "kernels.grouped_gemm_tail": "kernel"}
    assert swiglu(**ep2, **tail_written) == (kernel, kernel)
    assert swiglu(**{"kernels.swiglu": "separate"}) == ("separate", "separate")
    assert swiglu(**{"kernels.swiglu": "fused", "kernels.grouped_gemm": "pallas"}) == ("fused", "separate")
