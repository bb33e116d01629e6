"""Peak host memory of `convert` importing a mixtral_small-sized Hugging Face checkpoint (3.2 B parameters, BF16
on disk, ~6.3 GB) onto 8 simulated CPU devices under the paper's plan (SP + EP, intra 8), next to the largest
single tensor; and the loss of the streamed weights next to the same weights loaded in one piece.

    python -m benchmarks.hf_import_rss --dir /tmp/hf_rss --out benchmarks/results/hf_import_rss_cpu.json

Three steps, each measured process its own subprocess (a clean baseline; VmHWM is per process):
  write      a random checkpoint in Mixtral's layout (own seeded generator, one tensor at a time) into --dir;
  stream     convert.load_params (what `convert import` runs before saving), then the loss on one batch;
  one_piece  every leaf read whole into numpy, laid out and device_put with its sharding, then the same loss.
The checkpoint is deleted at the end (--keep leaves it).

What "peak" means on simulated CPU devices: device buffers ARE host memory, so the imported parameters (with
their replicas: attention, embedding and head are replicated over the 8 SP ranks) are part of the RSS. The reader's
own cost is therefore peak RSS - (RSS before the import + bytes of the device arrays it produced); on a GPU host
the device bytes would not be in the RSS at all. The import is checked against both readings of the bound:
peak < baseline + 1.5 x largest tensor (raw: cannot hold here, the params alone are GBs) and the same with the
baseline counting the produced device arrays. Parameters are kept in bfloat16 (train.param_dtype; exact from BF16
on disk): float32 params with their replicas would need ~22 GB, more than this 23 GiB machine can spare. Saving
the train state (orbax, plus a fresh Adam state of 2 x params in float32) is not measured for the same reason.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import zlib

DEVICES = 8
OVERRIDES = {"plan_recipe": "megascale", "parallel.intra": DEVICES, "train.param_dtype": "bfloat16",
             "train.global_batch": 1, "train.seq_len": 128}


def _setup_jax():
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
    os.environ["JAX_PLATFORMS"] = "cpu"


def _status(field: str) -> int:
    """/proc/self/status field in bytes (VmRSS now, VmHWM the peak so far)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


# Only to try the script out on smaller shapes: extra dotted overrides as JSON.
OVERRIDES.update(json.loads(os.environ.get("HF_IMPORT_RSS_OVERRIDES", "{}")))
CONFIG = "mixtral_small"


def _config():
    from megascale_jax.config import default_config
    return default_config(CONFIG, DEVICES, **OVERRIDES)


def _batch(trainer, vocab: int):
    import jax
    import numpy as np
    tokens = np.random.default_rng(1).integers(0, vocab, (1, 129)).astype(np.int32)
    sh = trainer.batch_sharding()
    return {"inputs": jax.device_put(tokens[:, :-1], sh), "targets": jax.device_put(tokens[:, 1:], sh)}


def _loss(trainer, params) -> float:
    import jax

    from megascale_jax import step as step_lib
    return float(jax.jit(step_lib.loss_and_metrics(trainer))(params, _batch(trainer, trainer.cfg.model.vocab_size))[0])


def _device_bytes(params) -> int:
    import jax
    return sum(s.data.nbytes for leaf in jax.tree.leaves(params) for s in leaf.addressable_shards)


# ----------------------------------------------------------------------------------------------- steps
def write(directory: str) -> dict:
    """A random Mixtral-layout checkpoint of mixtral_small's shapes, BF16, one tensor generated at a time."""
    import ml_dtypes
    import numpy as np

    from megascale_jax import convert, hf_names
    from megascale_jax import step as step_lib
    cfg = _config()
    trainer = step_lib.build(cfg)
    plan = convert._plan(cfg, trainer.abstract_state["params"], hf_names.MIXTRAL)
    tensors, largest = [], 0
    for entry, _, stack, inner in plan:
        shape = hf_names.hf_shape(entry.kind, inner)
        for idx in np.ndindex(*stack):
            tensors.append((hf_names.hf_name(entry, idx), shape, np.dtype(ml_dtypes.bfloat16)))
            largest = max(largest, int(np.prod(shape)) * 2)

    def tensor(name):   # its own seeded generator per tensor: reproducible, independent of the write order
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        shape = next(s for n, s, _ in tensors if n == name)
        scale = 1.0 if name.endswith("norm.weight") else 0.02
        x = rng.standard_normal(shape, dtype=np.float32) * scale
        return (x + 1.0 if name.endswith("norm.weight") else x).astype(ml_dtypes.bfloat16)

    os.makedirs(directory, exist_ok=True)
    start = time.time()
    files = convert.write_safetensors(directory, tensors, tensor, max_shard_bytes=2 << 30)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_names.export_config(cfg.model, hf_names.MIXTRAL, "bfloat16"), f)
    disk = sum(os.path.getsize(os.path.join(directory, n)) for n in files)
    return {"tensors": len(tensors), "largest_tensor_bytes": largest, "checkpoint_bytes": disk, "shards": len(files),
            "parameters": disk // 2, "write_s": round(time.time() - start, 1)}


def stream(directory: str) -> dict:
    """convert.load_params on 8 devices; RSS before, peak during, device bytes produced; then the loss."""
    import jax

    from megascale_jax import convert
    from megascale_jax import step as step_lib
    cfg = _config()
    trainer = step_lib.build(cfg)
    jax.block_until_ready(jax.device_put(0.0))   # the runtime's own buffers before the baseline
    baseline = _status("VmRSS")
    start = time.time()
    params = jax.block_until_ready(convert.load_params(directory, cfg, trainer))
    seconds = time.time() - start
    peak = _status("VmHWM")
    return {"baseline_rss_bytes": baseline, "peak_rss_bytes": peak, "rss_after_bytes": _status("VmRSS"),
            "device_bytes": _device_bytes(params), "import_s": round(seconds, 1), "loss": _loss(trainer, params)}


def one_piece(directory: str) -> dict:
    """The same weights, every leaf read whole (all its HF tensors stacked) and device_put with its sharding."""
    import jax
    import numpy as np

    from megascale_jax import convert, hf_names
    from megascale_jax import step as step_lib
    cfg = _config()
    trainer = step_lib.build(cfg)
    ckpt = convert.HFCheckpoint(directory)
    abstract = trainer.abstract_state["params"]
    arrays = {}
    for entry, leaf, stack, inner in convert._plan(cfg, abstract, hf_names.MIXTRAL):
        full = tuple(slice(0, d) for d in inner)
        blocks = [hf_names.to_ours(entry.kind, ckpt.read(hf_names.hf_name(entry, idx)), inner, full)
                  for idx in np.ndindex(*stack)]
        whole = np.stack(blocks).reshape(leaf.shape).astype(leaf.dtype) if stack else blocks[0].astype(leaf.dtype)
        del blocks
        arrays[entry.path] = jax.device_put(whole, leaf.sharding)
        del whole
    params = jax.tree_util.tree_map_with_path(
        lambda path, _: arrays[tuple(k.key for k in path if hasattr(k, "key"))], abstract)
    return {"peak_rss_bytes": _status("VmHWM"), "loss": _loss(trainer, params)}


STEPS = {"write": write, "stream": stream, "one_piece": one_piece}


def _run(name: str, directory: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    r = subprocess.run([sys.executable, "-m", "benchmarks.hf_import_rss", "--step", name, "--dir", directory],
                       env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"step {name} failed:\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/hf_import_rss")
    ap.add_argument("--out")
    ap.add_argument("--step", choices=sorted(STEPS), help="(internal) run one step in this process")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint in --dir")
    args = ap.parse_args()
    _setup_jax()
    if args.step:
        print(json.dumps(STEPS[args.step](args.dir)))
        return
    if os.path.exists(args.dir) and os.listdir(args.dir):
        raise SystemExit(f"--dir {args.dir} is not empty")
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(args.dir))).free
    if free < 10 << 30:
        raise SystemExit(f"{free / 2**30:.1f} GiB free next to --dir; the checkpoint needs ~6.3 GB (want 10)")
    try:
        written = _run("write", args.dir)
        print("write", written, flush=True)
        streamed = _run("stream", args.dir)
        print("stream", streamed, flush=True)
        whole = _run("one_piece", args.dir)
        print("one_piece", whole, flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    largest, base, peak = written["largest_tensor_bytes"], streamed["baseline_rss_bytes"], streamed["peak_rss_bytes"]
    with_params = base + streamed["device_bytes"]
    report = {
        "question": "peak host RSS of convert.load_params (mixtral_small, BF16 on disk, 8 simulated CPU devices, "
                    "SP+EP intra 8) vs one HF tensor; streamed loss == one-piece loss",
        "config": CONFIG, "overrides": OVERRIDES, "checkpoint": written,
        "baseline_rss_bytes": base, "largest_tensor_bytes": largest, "peak_rss_bytes": peak,
        "device_bytes": streamed["device_bytes"], "reader_overhead_bytes": peak - with_params,
        "reader_overhead_in_largest_tensors": round((peak - with_params) / largest, 3),
        "peak_below_baseline_plus_1.5x_largest": peak < base + 1.5 * largest,
        "peak_below_baseline_plus_device_bytes_plus_1.5x_largest": peak < with_params + 1.5 * largest,
        "import_s": streamed["import_s"], "loss_streamed": streamed["loss"], "loss_one_piece": whole["loss"],
        "losses_equal": streamed["loss"] == whole["loss"], "one_piece_peak_rss_bytes": whole["peak_rss_bytes"],
    }
    from benchmarks.environment import environment
    report["environment"] = environment()
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
