"""megascale_jax.convert: Hugging Face Mixtral safetensors <-> orbax, on a tiny random checkpoint of our own.

No torch / transformers here: the fixture is written with safetensors.numpy in the HF names and layouts
(megascale_jax/hf_names.py documents them), in 2 shards + index + config.json.
"""
import json
import os
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from megascale_jax import config as config_lib
from megascale_jax import convert, hf_names, step
from megascale_jax.checkpoint import Checkpointer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {"model.vocab_size": 256, "model.hidden": 64, "model.num_heads": 4, "model.num_kv_heads": 2,
        "model.num_layers": 2, "model.moe.num_experts": 4, "model.moe.expert_ffn": 32,
        "train.global_batch": 8, "train.seq_len": 16, "train.compute_dtype": "float32"}
SHARDED = {"plan_recipe": "megascale", "parallel.intra": 4}
V, D, H, G, K, L, E, F = 256, 64, 4, 2, 16, 2, 4, 32
ONE = jax.devices()[:1]


def tiny_cfg(devices, **extra):
    return config_lib.default_config("tiny_cpu", devices, **{**TINY, **extra})


def hf_tensors(seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    w = lambda *s: (rng.standard_normal(s) * 0.1).astype(dtype)  # noqa: E731
    out = {"model.embed_tokens.weight": w(V, D), "model.norm.weight": (1 + w(D)).astype(dtype),
           "lm_head.weight": w(V, D)}
    for i in range(L):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (1 + w(D)).astype(dtype),
                    p + "post_attention_layernorm.weight": (1 + w(D)).astype(dtype),
                    p + "self_attn.q_proj.weight": w(H * K, D), p + "self_attn.k_proj.weight": w(G * K, D),
                    p + "self_attn.v_proj.weight": w(G * K, D), p + "self_attn.o_proj.weight": w(D, H * K),
                    p + "block_sparse_moe.gate.weight": w(E, D)})
        for e in range(E):
            q = p + f"block_sparse_moe.experts.{e}."
            out.update({q + "w1.weight": w(F, D), q + "w3.weight": w(F, D), q + "w2.weight": w(D, F)})
    return out


def hf_config(**over):
    c = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": V, "hidden_size": D,
         "intermediate_size": F, "num_hidden_layers": L, "num_attention_heads": H, "num_key_value_heads": G,
         "num_local_experts": E, "num_experts_per_tok": 2, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
         "tie_word_embeddings": False, "max_position_embeddings": 256, "hidden_act": "silu",
         "sliding_window": None, "torch_dtype": "float32"}
    c.update(over)
    return c


def write_hf(directory, tensors, config):
    os.makedirs(directory, exist_ok=True)
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, os.path.join(directory, file))
        weight_map.update({n: file for n in part})
    with open(os.path.join(directory, convert.INDEX), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return str(directory)


def numpy_params(tensors, abstract):
    """The same mapping done in one piece in numpy (independent of the streaming reader)."""
    t = {k: np.asarray(v, np.float32) for k, v in tensors.items()}
    lay = lambda name: np.stack([t[f"model.layers.{i}.{name}"] for i in range(L)])  # noqa: E731
    exp = lambda w: np.stack([np.stack([t[f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight"].T  # noqa: E731
                                        for e in range(E)]) for i in range(L)])
    ours = {
        ("embed_tokens", "table_VD"): t["model.embed_tokens.weight"], ("final_norm", "scale"): t["model.norm.weight"],
        ("head_DV",): t["lm_head.weight"].T,
        ("moe_blocks", "attn_norm", "scale"): lay("input_layernorm.weight"),
        ("moe_blocks", "ffn_norm", "scale"): lay("post_attention_layernorm.weight"),
        ("moe_blocks", "attn", "wq_DHK"): lay("self_attn.q_proj.weight").transpose(0, 2, 1).reshape(L, D, H, K),
        ("moe_blocks", "attn", "wk_DGK"): lay("self_attn.k_proj.weight").transpose(0, 2, 1).reshape(L, D, G, K),
        ("moe_blocks", "attn", "wv_DGK"): lay("self_attn.v_proj.weight").transpose(0, 2, 1).reshape(L, D, G, K),
        ("moe_blocks", "attn", "wo_HKD"): lay("self_attn.o_proj.weight").transpose(0, 2, 1).reshape(L, H, K, D),
        ("moe_blocks", "ffn", "router", "w_DE"): lay("block_sparse_moe.gate.weight").transpose(0, 2, 1),
        ("moe_blocks", "ffn", "experts", "w_gate_EDF"): exp("w1"),
        ("moe_blocks", "ffn", "experts", "w_up_EDF"): exp("w3"),
        ("moe_blocks", "ffn", "experts", "w_down_EFD"): exp("w2"),
    }
    return jax.tree_util.tree_map_with_path(
        lambda p, a: jax.device_put(ours[tuple(k.key for k in p if hasattr(k, "key"))], a.sharding), abstract)


def batch_loss(trainer, params):
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, V, (8, 17)).astype(np.int32)
    sh = trainer.batch_sharding()
    batch = {"inputs": jax.device_put(tokens[:, :-1], sh), "targets": jax.device_put(tokens[:, 1:], sh)}
    return float(jax.jit(step.loss_and_metrics(trainer))(params, batch)[0])


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return write_hf(tmp_path_factory.mktemp("hf"), hf_tensors(), hf_config())


@pytest.mark.parametrize("devices,extra", [(8, SHARDED), (8, {**SHARDED, "parallel.optimizer_sharding": "zero1"}),
                                           (1, {})], ids=["8dev_megascale_intra4", "8dev_zero1", "1dev"])
def test_import_matches_numpy_mapping_and_export_roundtrips(hf_dir, tmp_path, devices, extra):
    cfg = tiny_cfg(devices, **extra)
    trainer = step.build(cfg, jax.devices()[:devices])
    params = convert.load_params(hf_dir, cfg, trainer)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(trainer.abstract_state["params"])):
        assert got.sharding == want.sharding and got.shape == want.shape and got.dtype == want.dtype
    reference = numpy_params(hf_tensors(), trainer.abstract_state["params"])
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reference)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(batch_loss(trainer, params), batch_loss(trainer, reference), rtol=1e-5)

    # the full path: checkpoint on disk, restored as train.run does, exported
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "export")
    convert.import_hf(hf_dir, cfg, ckpt, devices=jax.devices()[:devices])
    with Checkpointer(ckpt, save_every=0, keep=1, async_save=False) as c:
        state, extra_json = c.restore(trainer.checkpoint_abstract)   # what train.run does on resume
    assert int(state["step"]) == 0 and extra_json["step"] == 0
    np.testing.assert_allclose(batch_loss(trainer, state["params"]), batch_loss(trainer, reference), rtol=1e-5)
    convert.export_hf(ckpt, cfg, out, max_shard_bytes=200_000, devices=jax.devices()[:devices])
    assert_same_checkpoint(hf_dir, out)


def assert_same_checkpoint(src, out):
    with open(os.path.join(out, convert.INDEX)) as f:
        weight_map = json.load(f)["weight_map"]
    assert len(set(weight_map.values())) > 1                       # sharded
    src_ckpt = convert.HFCheckpoint(src)
    assert set(weight_map) == set(src_ckpt.tensors)
    back = convert.HFCheckpoint(out)
    for name, file in weight_map.items():
        with safe_open(os.path.join(out, file), "np") as f:        # the real safetensors reader, BF16 included
            got = f.get_slice(name)[:]
        want = src_ckpt.read(name)
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), name
        assert back.read(name).tobytes() == want.tobytes(), name
    with open(os.path.join(out, "config.json")) as f:
        exported = json.load(f)
    with open(os.path.join(src, "config.json")) as f:
        original = json.load(f)
    for key in ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "num_local_experts", "num_experts_per_tok"):
        assert exported[key] == original[key], key


def test_bf16_checkpoint_roundtrips_byte_exact(tmp_path):
    """BF16 (what Mixtral ships) -> fp32 params (exact) -> export --dtype bfloat16: the same bytes."""
    src = write_hf(tmp_path / "hf", hf_tensors(dtype=ml_dtypes.bfloat16), hf_config(torch_dtype="bfloat16"))
    cfg = tiny_cfg(1)
    convert.import_hf(src, cfg, str(tmp_path / "ckpt"), devices=ONE)
    convert.export_hf(str(tmp_path / "ckpt"), cfg, str(tmp_path / "out"), dtype="bfloat16", max_shard_bytes=100_000,
                      devices=ONE)
    assert_same_checkpoint(src, str(tmp_path / "out"))


def _error(tmp_path, src, match, **cfg_extra):
    out = tmp_path / "never"
    with pytest.raises(ValueError, match=match) as err:
        convert.import_hf(str(src), tiny_cfg(1, **cfg_extra), str(out), devices=ONE)
    assert "\n" not in str(err.value)
    assert not out.exists()
    return str(err.value)


def test_wrong_architecture(tmp_path):
    src = write_hf(tmp_path / "hf", hf_tensors(), hf_config(architectures=["Qwen2MoeForCausalLM"],
                                                            model_type="qwen2_moe"))
    _error(tmp_path, src, r"is a Qwen2MoeForCausalLM but --config tiny_cpu is not: config.model.qkv_bias=False: "
                          r"Qwen2MoeForCausalLM needs True")
    other = write_hf(tmp_path / "hf2", hf_tensors(), hf_config(architectures=["DeepseekV2ForCausalLM"],
                                                               model_type="deepseek_v2"))
    _error(tmp_path, other, r"model_type='deepseek_v2' is not supported; supported: MixtralForCausalLM \(mixtral\), "
                            r"Qwen2MoeForCausalLM \(qwen2_moe\), Qwen3MoeForCausalLM \(qwen3_moe\)")


def test_missing_shard(tmp_path):
    src = write_hf(tmp_path / "hf", hf_tensors(), hf_config())
    os.remove(os.path.join(src, "model-00002-of-00002.safetensors"))
    _error(tmp_path, src, r"shard model-00002-of-00002.safetensors .* missing.*download it again")


def test_truncated_shard(tmp_path):
    src = write_hf(tmp_path / "hf", hf_tensors(), hf_config())
    shard = os.path.join(src, "model-00001-of-00002.safetensors")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    _error(tmp_path, src, r"model-00001-of-00002.safetensors is not a readable safetensors file .*re-download it")


def test_reader_slices_bf16_blocks(tmp_path):
    """safe_open's get_slice reads BF16 blocks as ml_dtypes.bfloat16, bit for bit (what the reader relies on)."""
    w = (np.arange(48, dtype=np.float32).reshape(6, 8) / 7).astype(ml_dtypes.bfloat16)
    os.makedirs(tmp_path / "one")
    save_file({"w": w}, str(tmp_path / "one" / convert.SINGLE))
    block = convert.HFCheckpoint(str(tmp_path / "one")).read("w", (slice(2, 5), slice(1, 7)))
    assert block.dtype == ml_dtypes.bfloat16 and block.tobytes() == np.ascontiguousarray(w[2:5, 1:7]).tobytes()


def test_dimension_mismatch_names_the_key(tmp_path, hf_dir):
    _error(tmp_path, hf_dir, r"hidden_size=64 but config.model.hidden=128; .*--config.model.hidden=64",
           **{"model.hidden": 128})


def test_shape_mismatch_in_weights(tmp_path):
    tensors = hf_tensors()
    tensors["model.layers.1.block_sparse_moe.experts.2.w2.weight"] = np.zeros((D, F + 1), np.float32)
    src = write_hf(tmp_path / "hf", tensors, hf_config())
    _error(tmp_path, src, r"experts.2.w2.weight has shape \[64, 33\], expected \[64, 32\]")


def test_unreadable_dtype_and_lossy_cast(tmp_path):
    tensors = hf_tensors()
    tensors["model.norm.weight"] = np.ones(D, np.int8)
    src = write_hf(tmp_path / "hf", tensors, hf_config())
    _error(tmp_path, src, r"model.norm.weight has dtype I8; only F32, BF16 and F16")
    lossy = write_hf(tmp_path / "hf2", hf_tensors(), hf_config())
    _error(tmp_path, lossy, r"is F32 but our param is BF16, a lossy cast; pass --cast", **{"train.param_dtype": "bfloat16"})


def test_fused_experts_layout_is_named(tmp_path):
    tensors = {k: v for k, v in hf_tensors().items() if ".experts." not in k}
    for i in range(L):
        tensors[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.zeros((E, 2 * F, D), np.float32)
    src = write_hf(tmp_path / "hf", tensors, hf_config())
    _error(tmp_path, src, r"fused .*gate_up_proj.*not supported")


def test_cli_import_then_export(tmp_path, hf_dir):
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    overrides = [f"--config.{k}={v}" for k, v in TINY.items()]
    base = [sys.executable, "-m", "megascale_jax.convert"]
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    r = subprocess.run(base + ["import", f"--hf={hf_dir}", "--config=configs/tiny_cpu.py", *overrides,
                               f"--out={ckpt}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "imported" in r.stdout
    r = subprocess.run(base + ["export", f"--ckpt={ckpt}", "--config=configs/tiny_cpu.py", *overrides,
                               f"--hf={out}", "--max_shard_bytes=200000"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_checkpoint(hf_dir, out)
    r = subprocess.run(base + ["import", f"--hf={hf_dir}", "--config=configs/tiny_cpu.py", *overrides,
                               "--config.model.num_layers=3", f"--out={tmp_path / 'bad'}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("convert error: ")
    assert "num_hidden_layers=2 but config.model.num_layers=3" in r.stderr
    assert not (tmp_path / "bad").exists()
