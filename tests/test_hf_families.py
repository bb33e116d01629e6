"""The three Hugging Face MoE families against transformers' own logits, from committed fixtures.

tests/fixtures/hf/<family>/ holds a tiny random MixtralForCausalLM / Qwen2MoeForCausalLM / Qwen3MoeForCausalLM
saved by transformers' save_pretrained and its logits on a fixed batch (tests/fixtures/make_hf_fixtures.py wrote
them, with torch; this test needs neither torch nor transformers). For each family: `convert import` ->
our float32 logits within 1e-4 x max|logit| of transformers' (one device), the sharded loss (SP+EP, and TP for
Qwen2-MoE) equal to the cross-entropy of transformers' logits, and `convert export` giving back the same bytes
and config.json fields. Then bad input per family, and the published parameter counts of the full-size configs.
"""
import json
import os
import shutil
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from megascale_jax import config as config_lib
from megascale_jax import convert, step
from megascale_jax.checkpoint import Checkpointer
from megascale_jax.model.accounting import model_size

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")
TINY = {"model.vocab_size": 256, "model.hidden": 64, "model.num_heads": 4, "model.num_kv_heads": 2,
        "model.num_layers": 2, "model.moe.num_experts": 4, "model.moe.top_k": 2, "model.moe.expert_ffn": 32,
        "model.rope_theta": 10000.0, "train.global_batch": 2, "train.seq_len": 16,
        "train.compute_dtype": "float32"}
# What sets each family apart, as our config keys (the values the fixture script gave transformers).
FAMILY = {
    "mixtral": {"model.norm_eps": 1e-5},
    "qwen2_moe": {"model.norm_eps": 1e-6, "model.qkv_bias": True, "model.moe.num_shared_experts": 1,
                  "model.moe.shared_expert_ffn": 48, "model.moe.shared_expert_gate": True,
                  "model.moe.renormalize": False},
    "qwen3_moe": {"model.norm_eps": 1e-6, "model.head_dim": 32, "model.qk_norm": True},
}
# name -> (devices, overrides); the batch of 2 rows needs data parallelism <= 2
PLANS = {"megascale_intra4": (8, {"plan_recipe": "megascale", "parallel.intra": 4}),
         "megatron_tp_intra2": (2, {"plan_recipe": "megatron_tp", "parallel.intra": 2})}
ONE = jax.devices()[:1]


def cfg_for(family, devices, **extra):
    return config_lib.default_config("tiny_cpu", devices, **{**TINY, **FAMILY[family], **extra})


def fixture(family):
    data = np.load(os.path.join(FIXTURES, family, "logits.npz"))
    return os.path.join(FIXTURES, family), data["tokens"], data["logits"]


def our_logits(trainer, params, tokens):
    model = nnx.merge(trainer.graphdef, params)
    return np.asarray(jax.jit(lambda t: model(t, trainer.layout)[0])(tokens))


def targets_for(tokens):
    """Next tokens, the last position wrapping to the first (any target works: logits are causal)."""
    return np.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)


def cross_entropy(logits, targets):
    logits = logits.astype(np.float64)
    top = logits.max(-1, keepdims=True)
    log_z = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    return float(np.mean(log_z - np.take_along_axis(logits, targets[..., None], -1)[..., 0]))


@pytest.mark.parametrize("family", list(FAMILY))
def test_logits_match_transformers(family):
    hf_dir, tokens, want = fixture(family)
    cfg = cfg_for(family, 1)
    trainer = step.build(cfg, ONE)
    got = our_logits(trainer, convert.load_params(hf_dir, cfg, trainer), tokens)
    diff = float(np.max(np.abs(got - want)))
    scale = float(np.max(np.abs(want)))
    print(f"{family}: max |ours - transformers| = {diff:.3g}, max |logit| = {scale:.3g}")
    assert diff <= 1e-4 * scale, (family, diff, scale)
    assert scale > 1.0   # the random model is not degenerate (the bound above is not trivially met)


@pytest.mark.parametrize("family,plan", [(f, "megascale_intra4") for f in FAMILY]
                         + [("qwen2_moe", "megatron_tp_intra2")])
def test_import_sharded_loss_and_export_roundtrip(family, plan, tmp_path):
    hf_dir, tokens, want = fixture(family)
    count, overrides = PLANS[plan]
    devices = jax.devices()[:count]
    cfg = cfg_for(family, count, **overrides)
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "export")
    convert.import_hf(hf_dir, cfg, ckpt, devices=devices)
    trainer = step.build(cfg, devices)
    with Checkpointer(ckpt, save_every=0, keep=1, async_save=False) as c:
        state, _ = c.restore(trainer.checkpoint_abstract)          # what train.run does on resume
    targets = targets_for(tokens)
    sh = trainer.batch_sharding()
    batch = {"inputs": jax.device_put(tokens, sh), "targets": jax.device_put(targets, sh)}
    _, metrics = jax.jit(step.loss_and_metrics(trainer))(state["params"], batch)
    np.testing.assert_allclose(float(metrics["ce"]), cross_entropy(want, targets), rtol=2e-5)

    convert.export_hf(ckpt, cfg, out, max_shard_bytes=200_000, devices=devices)
    assert_same_tensors(hf_dir, out)
    with open(os.path.join(out, "config.json")) as f:
        exported = json.load(f)
    original = json.load(open(os.path.join(hf_dir, "config.json")))
    # the exported config.json passes the same checks against the same --config, as the same family
    assert convert.check_config(exported, cfg, "exported") is convert.check_config(original, cfg, "fixture")
    for key in ("architectures", "model_type", "vocab_size", "hidden_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "num_experts_per_tok", "rms_norm_eps",
                "tie_word_embeddings", "moe_intermediate_size", "norm_topk_prob", "shared_expert_intermediate_size",
                "qkv_bias", "head_dim"):
        if original.get(key) is not None:
            assert exported[key] == original[key], key


def test_cli_import_export_qwen3(tmp_path):
    """`python -m megascale_jax.convert import | export` on the Qwen3-MoE fixture (the CLI's own flag path)."""
    hf_dir = fixture("qwen3_moe")[0]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    flags = [f"--config.{k}={v}" for k, v in {**TINY, **FAMILY["qwen3_moe"]}.items()]
    base = [sys.executable, "-m", "megascale_jax.convert"]
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    for argv in (["import", f"--hf={hf_dir}", f"--out={ckpt}"],
                 ["export", f"--ckpt={ckpt}", f"--hf={out}", "--max_shard_bytes=200000"]):
        r = subprocess.run(base + argv + ["--config=configs/tiny_cpu.py", *flags], cwd=root, env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
    assert_same_tensors(hf_dir, out)


def assert_same_tensors(src, out):
    a, b = convert.HFCheckpoint(src), convert.HFCheckpoint(out)
    assert set(a.tensors) == set(b.tensors)
    assert len({f for f, _, _ in b.tensors.values()}) > 1     # sharded
    for name in a.tensors:
        x, y = a.read(name), b.read(name)
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), name


def test_bf16_qwen3_roundtrips_byte_exact(tmp_path):
    """BF16 tensors (as the Hub ships) read through safe_open get_slice into fp32 params (exact), exported back
    as bfloat16: the same bytes."""
    hf_dir, _, _ = fixture("qwen3_moe")
    src = tmp_path / "bf16"
    os.makedirs(src)
    ckpt = convert.HFCheckpoint(hf_dir)
    save_file({n: ckpt.read(n).astype(ml_dtypes.bfloat16) for n in ckpt.tensors}, str(src / convert.SINGLE))
    shutil.copy(os.path.join(hf_dir, "config.json"), src / "config.json")
    cfg = cfg_for("qwen3_moe", 1)
    convert.import_hf(str(src), cfg, str(tmp_path / "ckpt"), devices=ONE)
    convert.export_hf(str(tmp_path / "ckpt"), cfg, str(tmp_path / "out"), dtype="bfloat16", max_shard_bytes=100_000,
                      devices=ONE)
    assert_same_tensors(str(src), str(tmp_path / "out"))


# --------------------------------------------------------------------------------------------- bad input
def _error(tmp_path, src, family, match, **extra):
    out = tmp_path / "never"
    with pytest.raises(convert.ConvertError, match=match) as err:
        convert.import_hf(str(src), cfg_for(family, 1, **extra), str(out), devices=ONE)
    assert "\n" not in str(err.value)
    assert not out.exists()


def _copy(tmp_path, family, name="hf"):
    return shutil.copytree(os.path.join(FIXTURES, family), tmp_path / name)


def test_checkpoint_of_another_family(tmp_path):
    _error(tmp_path, fixture("qwen3_moe")[0], "qwen2_moe",
           r"is a Qwen3MoeForCausalLM but --config tiny_cpu is not: config.model.qk_norm=False")
    _error(tmp_path, fixture("qwen2_moe")[0], "mixtral",
           r"is a Qwen2MoeForCausalLM but --config tiny_cpu is not: config.model.qkv_bias=False")
    _error(tmp_path, fixture("mixtral")[0], "qwen3_moe",
           r"is a MixtralForCausalLM but --config tiny_cpu is not: config.model.qk_norm=True")


def test_missing_shard_qwen2(tmp_path):
    src = _copy(tmp_path, "qwen2_moe")
    os.remove(src / "model-00002-of-00002.safetensors")
    _error(tmp_path, src, "qwen2_moe", r"shard model-00002-of-00002.safetensors .* missing.*download it again")


def test_head_dim_and_router_mismatch_name_the_keys(tmp_path):
    _error(tmp_path, fixture("qwen3_moe")[0], "qwen3_moe",
           r"head_dim=32 but config.model.head_dim=16; .*--config.model.head_dim=32", **{"model.head_dim": 16})
    _error(tmp_path, fixture("qwen2_moe")[0], "qwen2_moe",
           r"norm_topk_prob=False but config.model.moe.renormalize=True", **{"model.moe.renormalize": True})


def test_shape_and_dtype_mismatch_in_weights(tmp_path):
    src = _copy(tmp_path, "qwen3_moe")
    ckpt = convert.HFCheckpoint(str(src))
    name = "model.layers.1.self_attn.k_norm.weight"
    file = ckpt.tensors[name][0]
    tensors = {n: ckpt.read(n) for n, (f, _, _) in ckpt.tensors.items() if f == file}
    tensors[name] = np.ones(16, np.float32)
    save_file(tensors, str(src / file))
    _error(tmp_path, src, "qwen3_moe", r"k_norm.weight has shape \[16\], expected \[32\]")
    _error(tmp_path, fixture("qwen2_moe")[0], "qwen2_moe", r"is F32 but our param is BF16, a lossy cast; pass --cast",
           **{"train.param_dtype": "bfloat16"})


def test_sliding_window_is_refused(tmp_path):
    src = _copy(tmp_path, "qwen2_moe")
    hf = json.load(open(src / "config.json"))
    hf.update(use_sliding_window=True, sliding_window=8)
    json.dump(hf, open(src / "config.json", "w"))
    _error(tmp_path, src, "qwen2_moe", r"sliding_window=8 is not supported")


# ------------------------------------------------------------------------------------ published sizes
# (config, published total, published active): the model cards' rounded figures (Qwen1.5-MoE-A2.7B: "14.3B
# parameters in total and 2.7B activated"; Qwen3-30B-A3B: "30.5B total, 3.3B activated"). Active counts the
# embedding table and the head, as the cards do (Qwen1.5-MoE: 2.0 B non-embedding of 2.7 B). Tolerance: 2%
# relative: the cards give two to three significant digits and do not say how they round (ours for Qwen3-30B-A3B
# is 3.353 B active, which the card's 3.3 B truncates rather than rounds).
PUBLISHED = [("qwen2_moe_a2_7b", 14.3e9, 2.7e9), ("qwen3_30b_a3b", 30.5e9, 3.3e9)]


@pytest.mark.parametrize("name,total,active", PUBLISHED)
def test_parameter_counts_match_published(name, total, active):
    cfg = config_lib.default_config(name, 8)
    size = model_size(cfg.model, cfg.train.seq_len)
    print(f"{name}: {size.total_params / 1e9:.3f} B total, {size.active_params / 1e9:.3f} B active")
    assert abs(size.total_params - total) <= 0.02 * total, size.total_params
    assert abs(size.active_params - active) <= 0.02 * active, size.active_params


# --------------------------------------------------------------------------------------------- tied head
def _rewrite_lm_head(src, dst, head):
    """A copy of fixture `src` whose lm_head.weight is `head` (None: dropped, the index updated)."""
    from safetensors.numpy import load_file

    shutil.copytree(src, dst)
    index_path = os.path.join(dst, "model.safetensors.index.json")
    index = json.load(open(index_path))
    shard = os.path.join(dst, index["weight_map"]["lm_head.weight"])
    tensors = load_file(shard)
    if head is None:
        del tensors["lm_head.weight"], index["weight_map"]["lm_head.weight"]
        json.dump(index, open(index_path, "w"))
    else:
        tensors["lm_head.weight"] = head
    save_file(tensors, shard, metadata={"format": "pt"})
    return dst


def test_tied_hf_head_imports_as_transformers_ties_it(tmp_path):
    """transformers ties lm_head to embed_tokens without scaling: a tied checkpoint (no lm_head tensor,
    tie_word_embeddings true) under tie_embeddings=True, tied_head_scale='none' gives exactly the logits of the
    untied model whose lm_head is a copy of embed_tokens; our default scale ('rsqrt_hidden') is refused."""
    from safetensors import safe_open

    hf_dir, tokens, _ = fixture("mixtral")
    index = json.load(open(os.path.join(hf_dir, "model.safetensors.index.json")))
    with safe_open(os.path.join(hf_dir, index["weight_map"]["model.embed_tokens.weight"]), "numpy") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
    untied = _rewrite_lm_head(hf_dir, tmp_path / "untied", embed.copy())
    tied = _rewrite_lm_head(hf_dir, tmp_path / "tied", None)
    config = json.load(open(tied / "config.json"))
    config["tie_word_embeddings"] = True
    json.dump(config, open(tied / "config.json", "w"))

    cfg_untied = cfg_for("mixtral", 1)
    want = our_logits(step.build(cfg_untied, ONE), convert.load_params(str(untied), cfg_untied,
                                                                         step.build(cfg_untied, ONE)), tokens)
    cfg_tied = cfg_for("mixtral", 1, **{"model.tie_embeddings": True, "model.tied_head_scale": "none"})
    trainer = step.build(cfg_tied, ONE)
    got = our_logits(trainer, convert.load_params(str(tied), cfg_tied, trainer), tokens)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(np.max(np.abs(want))))
    assert float(np.max(np.abs(want))) > 1.0
    _error(tmp_path, tied, "mixtral", r"tied_head_scale", **{"model.tie_embeddings": True})
