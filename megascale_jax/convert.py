"""Hugging Face MoE checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE) <-> megascale_jax orbax checkpoints.

    python -m megascale_jax.convert import --hf DIR --config configs/mixtral_8x7b.py --out CKPT [--cast]
    python -m megascale_jax.convert export --ckpt CKPT --config configs/mixtral_8x7b.py --hf OUT [--dtype bfloat16]

`import` reads DIR/config.json and the safetensors shards named by DIR/model.safetensors.index.json (or one
DIR/model.safetensors), picks the family from config.json's model_type, checks the architecture and every
dimension against --config, maps names and layouts (megascale_jax/hf_names.py) and writes step 0 of a train
state (the imported params, a fresh optimizer state) into CKPT: `python -m megascale_jax.train --config ...
--config.checkpoint.dir=CKPT` resumes from it. `export` restores CKPT's newest step and writes sharded
safetensors + index + config.json that transformers' <Family>ForCausalLM loads (classic per-expert names); the
family follows --config (q/k norms: Qwen3-MoE, shared experts: Qwen2-MoE, else Mixtral).

Streaming: every leaf is `jax.make_array_from_callback`, whose callback builds that index's block on the device
that holds it, one HF tensor at a time: `safe_open(...).get_slice(name)[rows, cols]` reads only the block's bytes
(BF16 included: safetensors 0.8 returns ml_dtypes.bfloat16 arrays), the raw block goes to the device, and a
jitted layout + cast writes it into the donated device buffer in place. Replicas of a block are device-to-device
copies. The shard file is opened per read and closed after, so its mmap'd pages leave the process's RSS.
Host memory beyond the params stays below one HF tensor: benchmarks/hf_import_rss.py measured 40.6 MB above
baseline + the device arrays (0.16 x the largest 262 MB tensor) for a 3.2 B-parameter BF16 checkpoint on 8 CPU
devices (benchmarks/results/hf_import_rss_cpu.json).

Every check runs before anything is written: architecture, dimensions (one line naming the config.json key
and our key), missing shard files, missing / unexpected / fused-layout tensors, shapes and dtypes. Dtypes:
F32 / BF16 / F16 are read; a cast to train.param_dtype that loses bits (F32 -> bf16) needs --cast.
Export is single-process (it gathers one tensor at a time to the host).
"""
from __future__ import annotations

import json
import os
import struct
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from megascale_jax import hf_names

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DTYPES = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16)}
NAMES = {v: k for k, v in DTYPES.items()}
# Exact casts: (from, to). Anything else between float dtypes needs --cast.
EXACT = {("BF16", "F32"), ("F16", "F32")}
SUPPORTED = ", ".join(f"{f.architecture} ({f.name})" for f in hf_names.FAMILIES.values())


class ConvertError(ValueError):
    """A checkpoint that cannot be converted; one line naming the file / key and the fix."""


# ----------------------------------------------------------------------------------------- safetensors io
def _open(path: str):
    try:
        return safe_open(path, framework="numpy")
    except (SafetensorError, OSError) as err:
        raise ConvertError(f"{path} is not a readable safetensors file ({' '.join(str(err).split())}); "
                           "re-download it.") from None


class HFCheckpoint:
    """The tensors of a (sharded) safetensors checkpoint: name -> (file, dtype, shape), from the headers only.
    Nothing is read until `read`."""

    def __init__(self, directory: str):
        self.directory = directory
        index = os.path.join(directory, INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map") or {}
            files = sorted(set(weight_map.values()))
        elif os.path.isfile(os.path.join(directory, SINGLE)):
            weight_map, files = None, [SINGLE]
        else:
            raise ConvertError(f"{directory} has neither {INDEX} nor {SINGLE}; point --hf at the folder "
                               "holding the checkpoint's *.safetensors files.")
        missing = [f for f in files if not os.path.isfile(os.path.join(directory, f))]
        if missing:
            raise ConvertError(f"shard {missing[0]} named by {index} is missing from {directory} "
                               f"({len(missing)} of {len(files)} shards missing); download it again.")
        self.tensors = {}
        for file in files:
            with _open(os.path.join(directory, file)) as f:
                for name in f.keys():
                    part = f.get_slice(name)
                    self.tensors[name] = (file, part.get_dtype(), tuple(part.get_shape()))
        if weight_map is not None:
            absent = [n for n, f in weight_map.items() if self.tensors.get(n, (f,))[0] != f]
            if absent:
                raise ConvertError(f"{index} puts {absent[0]} in {weight_map[absent[0]]}, which does not hold it; "
                                   "the index and shards are from different downloads: download again.")

    def read(self, name: str, block: tuple[slice, ...] | None = None) -> np.ndarray:
        """Tensor `name`, or only its `block` (contiguous slices): safetensors reads just those bytes."""
        file = self.tensors[name][0]
        with _open(os.path.join(self.directory, file)) as f:   # closed after: its mmap leaves our RSS
            part = f.get_slice(name)
            return part[block] if block is not None else part[:]


def write_safetensors(directory: str, plan: list[tuple[str, tuple, np.dtype]], tensor, max_shard_bytes: int):
    """Streams `plan` (name, shape, dtype) into shards of at most ~max_shard_bytes; `tensor(name)` yields one
    numpy array at a time. Writes the index json. Returns the shard file names.

    Why not safetensors.numpy.save_file: it takes a whole shard as a dict of arrays and serialises it into one
    bytes object first, so a 5 GB shard (transformers' default) would hold ~2 x 5 GB on the host; this writer
    holds one tensor. The files are the same format (the tests read them back with safe_open)."""
    shards, size = [[]], 0
    for item in plan:
        nbytes = int(np.prod(item[1])) * item[2].itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0
    for file, items in zip(names, shards):
        head, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, dtype in items:
            nbytes = int(np.prod(shape)) * dtype.itemsize
            head[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = file
        total += offset
        raw = json.dumps(head, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(os.path.join(directory, file), "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for name, shape, dtype in items:
                x = np.ascontiguousarray(tensor(name), dtype=dtype)
                assert x.shape == tuple(shape), (name, x.shape, shape)
                f.write(x.tobytes())
    with open(os.path.join(directory, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return names


# ----------------------------------------------------------------------------------------------- checks
def check_config(hf: dict, cfg, where: str) -> hf_names.Family:
    """The family of config.json `hf`; raises ConvertError (one line) unless it has exactly `cfg`'s model."""
    arch, mtype = hf.get("architectures") or [], hf.get("model_type")
    family = hf_names.FAMILIES.get(mtype)
    if family is None or family.architecture not in arch:
        raise ConvertError(f"{where}: architectures={arch} model_type={mtype!r} is not supported; supported: "
                           f"{SUPPORTED}.")
    problems = hf_names.model_problems(cfg.model, family)
    if problems:
        raise ConvertError(f"{where} is a {family.architecture} but --config {cfg.name} is not: {problems[0]}.")
    m = cfg.model
    for key, ours, get, default in hf_names.dimensions(family):
        if default == "derived":
            default = hf.get("hidden_size", 0) // max(hf.get("num_attention_heads", 1), 1)
        value = hf_names.hf_value(hf, key, default)
        if value is None:
            raise ConvertError(f"{where} lacks {key}; it is not a complete {family.architecture} config.json.")
        mine = get(m)
        same = np.isclose(float(value), float(mine), rtol=1e-9) if isinstance(mine, float) else value == mine
        if not same:
            raise ConvertError(f"{where}: {key}={value} but config.{ours}={mine}; pass the --config that "
                               f"matches this checkpoint (or --config.{ours.split(' ')[0]}={value}).")
    bad = hf_names.unsupported(hf, family, m.max_seq_len)
    if bad:
        raise ConvertError(f"{where}: {bad[0]} is not supported (our model: silu, plain RoPE, full attention up to "
                           f"max_seq_len={m.max_seq_len}, every layer MoE, no o_proj bias).")
    return family


def _plan(cfg, abstract_params, family) -> list[tuple[hf_names.Entry, object, tuple, tuple]]:
    """(entry, abstract leaf, stack shape, inner shape) for every leaf of our params, checked to cover them."""
    flat = {tuple(k.key for k in path if hasattr(k, "key")): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params)[0]}
    out = []
    for entry in hf_names.entries(cfg.model, family):
        leaf = flat.pop(entry.path)
        n = len(entry.stack)
        out.append((entry, leaf, tuple(leaf.shape[:n]), tuple(leaf.shape[n:])))
    if flat:
        raise ConvertError(f"params {sorted(flat)} have no {family.architecture} name; the converter cannot map them.")
    return out


def _expected(plan) -> dict[str, tuple]:
    names = {}
    for entry, _, stack, inner in plan:
        for idx in np.ndindex(*stack):
            names[hf_names.hf_name(entry, idx)] = (hf_names.hf_shape(entry.kind, inner), entry)
    return names


def check_tensors(ckpt: HFCheckpoint, plan, param_dtype: dict, cast: bool, family) -> None:
    """Every expected tensor is present with the right shape and a readable dtype; no unknown tensor."""
    expected = _expected(plan)
    names = set(ckpt.tensors)
    fused = sorted(n for n in names if hf_names.FUSED_EXPERTS.search(n))
    if fused:
        raise ConvertError(f"{ckpt.directory} stores experts fused ({fused[0]}): this layout (transformers' in-memory "
                           "form) is not supported; save the model with per-expert experts.N.* tensors.")
    missing = sorted(set(expected) - names)
    if missing:
        raise ConvertError(f"{ckpt.directory} lacks tensor {missing[0]} ({len(missing)} missing); the checkpoint is "
                           f"incomplete or not this {family.architecture}: download it again or pass the matching "
                           "--config.")
    extra = sorted(names - set(expected) - {"lm_head.weight"})  # a tied HF checkpoint may still carry lm_head
    if extra:
        raise ConvertError(f"{ckpt.directory} holds {extra[0]} ({len(extra)} unexpected tensors) which our "
                           f"{family.architecture} has no place for (biases? another architecture?); it cannot be "
                           "imported losslessly.")
    for name, (shape, entry) in expected.items():
        file, dtype, got = ckpt.tensors[name]
        if got != shape:
            raise ConvertError(f"{file}: {name} has shape {list(got)}, expected {list(shape)} for --config "
                               "(config.json and the weights disagree); the checkpoint is corrupt or mixed.")
        if dtype not in DTYPES:
            raise ConvertError(f"{file}: {name} has dtype {dtype}; only F32, BF16 and F16 can be imported "
                               "(dequantise the checkpoint first).")
        target = NAMES[np.dtype(param_dtype[entry.path])]
        if dtype != target and (dtype, target) not in EXACT and not cast:
            raise ConvertError(f"{file}: {name} is {dtype} but our param is {target}, a lossy cast; pass --cast, or "
                               f"set --config.train.param_dtype to match.")


# ----------------------------------------------------------------------------------------------- import
def _bounds(index, shape) -> tuple[tuple[int, int], ...]:
    """An index (slices) as hashable (start, stop) pairs: the key replicas of one block share."""
    return tuple(s.indices(d)[:2] for s, d in zip(index, shape))


def _write_block(buf, raw, at, *, kind, inner, bounds):
    """buf[at] = our layout of the raw HF block, cast to buf's dtype (in place: buf is donated)."""
    sl = tuple(slice(*b) for b in bounds)
    block = hf_names.to_ours(kind, raw, inner, sl).astype(buf.dtype)
    block = block.reshape((1,) * (buf.ndim - block.ndim) + block.shape)
    return jax.lax.dynamic_update_slice(buf, block, at)


_write = jax.jit(_write_block, static_argnames=("kind", "inner", "bounds"), donate_argnums=0)


def _device_block(ckpt, entry, stack, inner, bounds, dtype, device):
    """Our leaf's block `bounds` built on `device` one HF tensor at a time (host memory: one raw HF block)."""
    n = len(stack)
    ranges = [range(a, b) for a, b in bounds[:n]]
    inner_bounds = bounds[n:]
    shape = tuple(b - a for a, b in bounds)
    read = hf_names.hf_slice(entry.kind, inner, tuple(slice(*b) for b in inner_bounds))
    buf = jnp.zeros(shape, dtype, device=device)
    for pos in np.ndindex(*[len(r) for r in ranges]):
        name = hf_names.hf_name(entry, tuple(r[p] for r, p in zip(ranges, pos)))
        raw = jax.device_put(ckpt.read(name, read), device)
        at = tuple(jnp.int32(p) for p in pos + (0,) * len(inner))
        buf = _write(buf, raw, at, kind=entry.kind, inner=inner, bounds=inner_bounds)
        del raw
    return buf


def _import_leaf(ckpt, entry, leaf, stack, inner):
    """The global array of one leaf: make_array_from_callback asks for each device's index in the order of
    addressable_devices_indices_map; each distinct block is built once on the first device that needs it and
    copied device-to-device to its replicas."""
    sharding, dtype = leaf.sharding, np.dtype(leaf.dtype)
    owners: dict[tuple, list] = {}
    for device, index in sharding.addressable_devices_indices_map(leaf.shape).items():
        owners.setdefault(_bounds(index, leaf.shape), []).append(device)
    built = {}

    def block(index):
        key = _bounds(index, leaf.shape)
        device = owners[key].pop(0) if owners.get(key) else None
        if key not in built:
            built[key] = _device_block(ckpt, entry, stack, inner, key, dtype, device)
        here = built[key]
        return here if device is None or here.devices() == {device} else jax.device_put(here, device)
    return jax.make_array_from_callback(leaf.shape, sharding, block)


def load_params(hf_dir: str, cfg, trainer, cast: bool = False):
    """Validates `hf_dir` against `cfg`, then streams it into `trainer`'s param shardings. Returns params."""
    where = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(where):
        raise ConvertError(f"{where} is missing; point --hf at a Hugging Face checkpoint folder.")
    with open(where) as f:
        family = check_config(json.load(f), cfg, where)
    ckpt = HFCheckpoint(hf_dir)
    abstract = trainer.abstract_state["params"]
    plan = _plan(cfg, abstract, family)
    check_tensors(ckpt, plan, {e.path: leaf.dtype for e, leaf, _, _ in plan}, cast, family)
    arrays = {e.path: _import_leaf(ckpt, e, leaf, stack, inner) for e, leaf, stack, inner in plan}
    return jax.tree_util.tree_map_with_path(
        lambda path, _: arrays[tuple(k.key for k in path if hasattr(k, "key"))], abstract)


def import_hf(hf_dir: str, cfg, out: str, cast: bool = False, devices=None) -> None:
    from megascale_jax import step as step_lib
    from megascale_jax.checkpoint import Checkpointer
    if os.path.isdir(out) and os.listdir(out):
        raise ConvertError(f"--out {out} is not empty; pass a new folder (train resumes from its newest step).")
    if jax.process_count() > 1:   # every process has checked --out before any of them writes into it
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("convert import: --out checked")
    trainer = step_lib.build(cfg, devices)
    params = load_params(hf_dir, cfg, trainer, cast)   # every check raises before anything is written
    ckpt = Checkpointer(out, save_every=0, keep=1, async_save=False)
    extra = {"step": 0, "config": cfg.name, "imported_from": os.path.abspath(hf_dir)}
    ckpt.save(0, step_lib.checkpointed(step_lib.create_state(trainer, params)), extra)   # fresh optimizer state for the imported weights
    ckpt.close()


# ----------------------------------------------------------------------------------------------- export
def export_hf(ckpt_dir: str, cfg, out: str, dtype: str | None = None, max_shard_bytes: int = 5 << 30,
              devices=None) -> list[str]:
    from megascale_jax import step as step_lib
    from megascale_jax.checkpoint import Checkpointer
    family = hf_names.family_of(cfg.model)
    problems = hf_names.model_problems(cfg.model, family)
    if problems:
        raise ConvertError(f"--config {cfg.name} exports as {family.architecture} but does not fit it: {problems[0]}.")
    if os.path.isdir(out) and os.listdir(out):
        raise ConvertError(f"--hf {out} is not empty; pass a new folder for the exported checkpoint.")
    trainer = step_lib.build(cfg, devices)
    with Checkpointer(ckpt_dir, save_every=0, keep=1, async_save=False) as ckpt:
        state, _ = ckpt.restore(trainer.checkpoint_abstract)
    plan = _plan(cfg, state["params"], family)
    out_dtype = {e.path: np.dtype(dtype) if dtype else np.dtype(leaf.dtype) for e, leaf, _, _ in plan}
    flat = {tuple(k.key for k in p if hasattr(k, "key")): x
            for p, x in jax.tree_util.tree_flatten_with_path(state["params"])[0]}
    source, tensors = {}, []
    for entry, leaf, stack, inner in plan:
        for idx in np.ndindex(*stack):
            name = hf_names.hf_name(entry, idx)
            source[name] = (entry, idx)
            tensors.append((name, hf_names.hf_shape(entry.kind, inner), out_dtype[entry.path]))

    def tensor(name):   # one tensor on the host at a time
        entry, idx = source[name]
        x = np.asarray(jax.device_get(flat[entry.path][idx] if idx else flat[entry.path]))
        return hf_names.to_hf(entry.kind, x)
    os.makedirs(out, exist_ok=True)
    files = write_safetensors(out, tensors, tensor, max_shard_bytes)
    torch_dtype = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}[
        str(np.dtype(dtype or cfg.train.param_dtype))]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf_names.export_config(cfg.model, family, torch_dtype), f, indent=2)
    return files


# ------------------------------------------------------------------------------------------------- CLI
def _define_flags():
    from absl import flags
    from ml_collections import config_flags
    config_flags.DEFINE_config_file("config", None, "configs/<model>.py of the model (dotted overrides allowed).")
    flags.DEFINE_string("hf", None, "import: the Hugging Face checkpoint folder; export: the folder to write.")
    flags.DEFINE_string("out", None, "import: the (new, empty) orbax checkpoint folder to write.")
    flags.DEFINE_string("ckpt", None, "export: the orbax checkpoint folder (its newest step is exported).")
    flags.DEFINE_bool("cast", False, "import: allow lossy dtype casts (e.g. F32 weights into bf16 params).")
    flags.DEFINE_string("dtype", None, "export: dtype of the written tensors (default: the param dtype).")
    flags.DEFINE_integer("max_shard_bytes", 5 << 30, "export: start a new safetensors shard above this size.")
    # import under several processes (each reads only the blocks of its own devices); SLURM is detected too
    flags.DEFINE_string("coordinator", None, "import: host:port of process 0 (multi-process without SLURM).")
    flags.DEFINE_integer("num_processes", None, "import: process count (multi-process without SLURM).")
    flags.DEFINE_integer("process_id", None, "import: this process's index (multi-process without SLURM).")


def main(argv) -> None:
    from absl import flags
    from megascale_jax import config as config_lib
    from megascale_jax.checkpoint import CheckpointError
    f = flags.FLAGS
    usage = ("usage: python -m megascale_jax.convert import --hf DIR --config CFG --out CKPT | "
             "export --ckpt CKPT --config CFG --hf OUT")
    command = argv[1] if len(argv) == 2 else None
    need = {"import": ("hf", "out"), "export": ("ckpt", "hf")}.get(command)
    if need is None or f.config is None or any(not getattr(f, k) for k in need):
        print(f"convert error: {usage}", file=sys.stderr)
        sys.exit(2)
    from megascale_jax.parallel import distributed
    try:
        info = distributed.initialize(f.coordinator, f.num_processes, f.process_id, verbose=False)
    except ValueError as err:
        print(f"convert error: {err}", file=sys.stderr)
        sys.exit(2)
    if command == "export" and info.num_processes > 1:
        print("convert error: export runs in one process (it gathers one tensor at a time to the host); start it "
              "without --num_processes / outside srun, on a machine that sees the checkpoint.", file=sys.stderr)
        sys.exit(2)
    try:
        cfg = config_lib.from_config_dict(f.config, num_devices=jax.device_count())
        if command == "import":
            import_hf(f.hf, cfg, f.out, cast=f.cast)
            print(f"imported {f.hf} into {f.out} (step 0); train with --config.checkpoint.dir={f.out}")
        else:
            files = export_hf(f.ckpt, cfg, f.hf, dtype=f.dtype, max_shard_bytes=f.max_shard_bytes)
            print(f"exported {f.ckpt} to {f.hf} ({len(files)} shards + config.json)")
    except (ConvertError, config_lib.ConfigError, CheckpointError) as err:
        print(f"convert error: {' '.join(str(err).split())}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    from absl import app
    _define_flags()
    app.run(main)
