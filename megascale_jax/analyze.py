"""Communication analyzer: compile a config's step for a mesh and put its collectives next to the paper.

    python -m megascale_jax.analyze --config configs/mixtral_8x7b.py --devices 8 \
        --config.parallel.plan=manual --config.parallel.intra=8 [--config.parallel.attention=tp]

No GPU is needed: `--devices N` simulates N CPU devices, and nothing is allocated (the step is lowered
from abstract shapes). Reported:
  * per MoE layer, forward, the elements one device sends, by component (attention / ffn), read from the
    compiled HLO of a one-layer copy of the model (same shapes; scanned layers would otherwise appear once
    per loop body), next to the paper's closed forms (MegaScale-MoE section 3; b micro-batch, s sequence,
    h hidden, n intra size, m = q heads / kv heads, k = top-k; counted in elements):
        TP attention 2bsh(n-1)/n            SP attention 2bsh(n-1)/n * (2 + 2/m)/n
        TP FFN       2bsh(n-1)/n            EP FFN       2k/n * bsh(n-1)/n
    Elements, not bytes, because XLA:CPU widens bf16 collectives to f32 on the wire (a GPU sends bf16);
    bytes at the compute dtype are elements x its itemsize.
    The SP attention form as printed is twice what Ulysses has to move: q and the output each cross once
    (bsh/n (n-1)/n), k and v a 1/m share of that, so SP = (2 + 2/m) bsh(n-1)/n^2, i.e. (1 + 1/m)/n of TP's
    volume rather than (2 + 2/m)/n. The HLO shows exactly the derived volume; both are listed.
  * compiled memory of the full config's train step, and compiled vs analytic FLOPs of the one-layer step
    (on the CPU the compiled count is higher: ragged_dot becomes a dense masked dot with G x the FLOPs and
    XLA attention computes the whole causal square).
Dropless EP all-to-all buffers are sized for the worst case (n x the average traffic); with
--config.model.moe.capacity_factor=1.0 the buffers hold the average and the bytes meet the formula.
"""
from __future__ import annotations

import os
import re
import sys


def _simulated_devices_from_argv() -> None:
    """--devices N must act before jax is imported: it sets XLA's host device count."""
    for i, arg in enumerate(sys.argv):
        value = arg.split("=", 1)[1] if arg.startswith("--devices=") else (
            sys.argv[i + 1] if arg == "--devices" and i + 1 < len(sys.argv) else None)
        if value:
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                       f" --xla_force_host_platform_device_count={int(value)}")
            os.environ.setdefault("JAX_PLATFORMS", "cpu")


if __name__ == "__main__":
    _simulated_devices_from_argv()

import dataclasses  # noqa: E402
from collections import defaultdict  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from megascale_jax import config as config_lib  # noqa: E402
from megascale_jax import step as step_lib  # noqa: E402
from megascale_jax.model.accounting import model_size  # noqa: E402
from megascale_jax.parallel.hlo_bytes import DTYPE_BYTES, parse_collectives  # noqa: E402

_OP_NAME = re.compile(r'op_name="([^"]*)"')
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
COMPONENTS = ("attention", "ffn")


def closed_forms(cfg) -> dict[str, float]:
    """Per-layer forward elements sent per device: the paper's forms, and the derived SP volume."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    n, k = p.intra, m.moe.top_k
    bs = (t.global_batch // p.data) * t.seq_len
    bsh = bs * m.hidden
    ratio = m.num_heads / m.num_kv_heads
    # What Ulysses moves: q and the attention output are heads x head_dim wide, k and v kv_heads x head_dim
    # (= (2 + 2/m) bsh when heads x head_dim = hidden, the paper's case; Qwen3-MoE's are wider than hidden).
    sp_width = 2 * m.num_heads * m.head_dim + 2 * m.num_kv_heads * m.head_dim
    return {
        "tp_attention": 2 * bsh * (n - 1) / n,
        "sp_attention": 2 * bsh * (n - 1) / n * (2 + 2 / ratio) / n,
        "sp_attention_derived": sp_width * bs * (n - 1) / n ** 2,
        "tp_ffn": 2 * bsh * (n - 1) / n,
        "ep_ffn": 2 * k / n * bsh * (n - 1) / n,
    }


def _component(op_name: str) -> str:
    for part in COMPONENTS:
        if f"/{part}/" in op_name:
            return part
    return "other"


def collectives_by_component(hlo_text: str, num_devices: int) -> dict[str, dict]:
    """Sums wire bytes per component (named scopes in op_name metadata) and lists the collectives."""
    op_names = {}
    for line in hlo_text.splitlines():
        name, op = _NAME.match(line), _OP_NAME.search(line)
        if name and op:
            op_names[name.group(1)] = op.group(1)
    out = defaultdict(lambda: {"wire_bytes": 0, "wire_elements": 0, "ops": []})
    for c in parse_collectives(hlo_text, num_devices):
        part = _component(op_names.get(c.name, ""))
        out[part]["wire_bytes"] += c.wire_bytes
        out[part]["wire_elements"] += c.wire_bytes / DTYPE_BYTES[c.dtypes[0]]
        out[part]["ops"].append(f"{c.kind}[{'/'.join(c.dtypes)}] x{c.group_size} {c.wire_bytes} B")
    return dict(out)


def _abstract_batch(trainer):
    t = trainer.cfg.train
    sharding = trainer.batch_sharding()
    shape = jax.ShapeDtypeStruct((t.global_batch, t.seq_len), jnp.int32, sharding=sharding)
    return {"inputs": shape, "targets": shape}


def _one_moe_layer(cfg):
    model = dataclasses.replace(cfg.model, num_layers=1, num_dense_layers=0)
    return dataclasses.replace(cfg, model=model)


def analyze(cfg, devices=None, *, full_step: bool = True) -> dict:
    """Compiles (from abstract shapes) and returns the report as a dict (see module docstring).

    full_step=False skips compiling the whole config's train step (memory is then not reported).
    """
    devices = list(jax.devices() if devices is None else devices)
    layer_cfg = _one_moe_layer(cfg)
    trainer = step_lib.build(layer_cfg, devices)
    fn = step_lib.loss_and_metrics(trainer)
    batch = _abstract_batch(trainer)
    forward = jax.jit(lambda p, b: fn(p, b)[0]).lower(trainer.abstract_state["params"], batch).compile()
    layer_step = step_lib.make_train_step(trainer).lower(trainer.abstract_state, batch).compile()
    memory = None
    if full_step:
        full = step_lib.build(cfg, devices)
        memory = step_lib.make_train_step(full).lower(full.abstract_state, _abstract_batch(full)).compile() \
            .memory_analysis()
    cost = layer_step.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    tokens = cfg.train.global_batch * cfg.train.seq_len
    p = cfg.parallel
    return {
        "config": cfg.name, "mesh": {"data": p.data, "pipe": p.pipe, "intra": p.intra},
        "environment": {"jax": jax.__version__, "devices": f"{len(devices)} x {devices[0].device_kind}"},
        "shapes": {"global_batch": cfg.train.global_batch, "seq_len": cfg.train.seq_len,
                   "hidden": cfg.model.hidden, "num_layers": cfg.model.num_layers,
                   "compute_dtype": cfg.train.compute_dtype},
        "plan": {"kind": p.plan, "attention": p.attention, "ffn": p.ffn, "dispatch": trainer.plan.dispatch,
                 "capacity_factor": cfg.model.moe.capacity_factor},
        "per_layer_forward": collectives_by_component(forward.as_text(), len(devices)),
        "closed_forms": closed_forms(cfg),
        "memory_per_device_bytes": {k: getattr(memory, k, None) for k in (
            "argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes")}
        if memory is not None else {},
        "one_layer_step_flops_per_device": {
            "compiled": cost.get("flops"),
            "analytic": model_size(layer_cfg.model, cfg.train.seq_len).train_flops_per_token * tokens
            / len(devices)},
    }


def expected_volumes(report: dict) -> dict[str, float | None]:
    """The paper's form for each component under the report's plan (None under the XLA plan)."""
    plan, forms = report["plan"], report["closed_forms"]
    if plan["kind"] != "manual":
        return {"attention": None, "ffn": None}
    return {"attention": forms[f"{plan['attention']}_attention"], "ffn": forms[f"{plan['ffn']}_ffn"]}


def format_report(report: dict) -> str:
    plan, forms = report["plan"], report["closed_forms"]
    expected = expected_volumes(report)
    lines = [f"{report['config']}: mesh {report['mesh']} plan {plan}",
             "per MoE layer, forward, elements sent per device:",
             f"{'component':<10} {'measured':>14} {'paper form':>14} {'ratio':>7}"]
    for part in (*COMPONENTS, "other"):
        got = report["per_layer_forward"].get(part, {"wire_elements": 0})["wire_elements"]
        want = expected.get(part)
        ratio = f"{got / want:7.3f}" if want else "      -"
        lines.append(f"{part:<10} {got:>14,.0f} {'-' if want is None else f'{want:,.0f}':>14} {ratio}")
    lines.append("closed forms (elements): " + ", ".join(f"{k} {v:,.0f}" for k, v in forms.items()))
    mem = report["memory_per_device_bytes"]
    lines.append("train step memory per device: " + ", ".join(
        f"{k.replace('_size_in_bytes', '')} {v / 2**20:,.1f} MiB" for k, v in mem.items() if v is not None))
    fl = report["one_layer_step_flops_per_device"]
    if fl["compiled"]:
        lines.append(f"one-layer step FLOPs/device: compiled {fl['compiled']:.3e}, analytic {fl['analytic']:.3e}")
    return "\n".join(lines)


def main() -> None:
    import json

    from absl import app, flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", "configs/tiny_cpu.py", "configs/<model>.py to analyze.")
    flags.DEFINE_integer("devices", None, "Simulated CPU devices (set before jax starts).")
    flags.DEFINE_string("json", None, "Also write the report as JSON here.")

    def run(argv):
        del argv
        try:
            cfg = config_lib.from_config_dict(flags.FLAGS.config, num_devices=jax.device_count())
        except config_lib.ConfigError as err:
            sys.exit(f"config error: {err}")
        report = analyze(cfg)
        print(format_report(report))
        if flags.FLAGS.json:
            with open(flags.FLAGS.json, "w") as f:
                json.dump(report, f, indent=1, default=str)

    app.run(run)


if __name__ == "__main__":
    main()
