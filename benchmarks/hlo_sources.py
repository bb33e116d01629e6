"""Which source line each kernel of a compiled program came from: the optimized HLO's instruction names are the
kernel names a GPU trace shows (`loop_add_multiply_fusion`, `input_gather_reduce_fusion`, `sort_0_1`, ...),
and each instruction's metadata names the jax op and its stack frame.

    sources = instruction_sources(jax.jit(f).lower(*args).compile().as_text())
    sources["loop_add_multiply_fusion"]  ->  {"op": "jit(loss)/transpose(jvp(...))/mul",
                                              "where": "megascale_jax/model/moe/experts.py:88 (swiglu)"}

`where` is the innermost frame inside this project (megascale_jax/, pallas_kernels/, benchmarks/), else the
innermost frame. A fusion without metadata of its own takes its fused computation's root's; a Pallas Triton
kernel is also listed under the kernel name its custom call's backend_config gives (the name the trace shows).
gpu_trace.breakdown attaches these to its largest kernels, so a profile names the line that costs the time.
"""
from __future__ import annotations

import re

from megascale_jax.parallel.hlo_bytes import INSTRUCTION

PROJECT_DIRS = ("megascale_jax/", "pallas_kernels/", "benchmarks/")

_TABLE = re.compile(r"^(\d+) (.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_METADATA = re.compile(r"metadata=\{([^}]*)\}")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
# A Pallas (Triton) kernel is a custom call whose GPU trace name is the kernel's own, given in the call's
# backend_config as name = "..." (printed with or without spaces and escaped quotes), not the instruction's.
_TRITON_CALL = 'custom_call_target="__gpu$xla.gpu.triton"'
_KERNEL_NAME = re.compile(r'(?<![\w])name\s*=\s*\\?"([\w.\-]+)')
_SECTIONS = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def _frame_tables(lines):
    """The module header's tables, {section: {id: text}}: they follow the HloModule line, before any computation."""
    tables, section = {s: {} for s in _SECTIONS}, None
    for line in lines[1:]:
        if not line.strip():
            continue
        if line in _SECTIONS:
            section = line
            continue
        m = _TABLE.match(line)
        if section is None or not m:
            break
        tables[section][int(m.group(1))] = m.group(2).strip('"')
    return tables


def _field(text, key):
    m = re.search(key + r"=(\d+)", text)
    return int(m.group(1)) if m else None


def _resolve(frame_id, tables, cache):
    """'file:line (function)' of the frame chain's innermost project frame (else its innermost frame)."""
    if frame_id in cache:
        return cache[frame_id]
    chain, seen, fid = [], set(), frame_id
    while fid and fid not in seen and fid in tables["StackFrames"]:
        seen.add(fid)
        frame = tables["StackFrames"][fid]
        loc = tables["FileLocations"].get(_field(frame, "file_location_id") or -1, "")
        file = tables["FileNames"].get(_field(loc, "file_name_id") or -1, "?")
        func = tables["FunctionNames"].get(_field(loc, "function_name_id") or -1, "?")
        chain.append(f"{_short(file)}:{_field(loc, 'line')} ({func})")
        fid = _field(frame, "parent_frame_id")
    inside = [c for c in chain if any(d in c for d in PROJECT_DIRS)]
    cache[frame_id] = (inside or chain or [None])[0]
    return cache[frame_id]


def _short(path: str) -> str:
    for d in PROJECT_DIRS:
        if d in path:
            return path[path.index(d):]
    return path.rsplit("/site-packages/", 1)[-1]


def instruction_sources(hlo_text: str) -> dict[str, dict]:
    """{instruction name: {"op": jax op name, "where": source frame}} for every instruction with metadata."""
    lines = hlo_text.splitlines()
    tables, cache = _frame_tables(lines), {}
    out, calls, roots, computation, triton = {}, {}, {}, None, {}
    for line in lines:
        m = _COMPUTATION.match(line)
        if m and "=" not in line.split("{", 1)[0]:
            computation = m.group(1)
            continue
        m = INSTRUCTION.match(line)   # the HLO byte counter's instruction-line pattern
        if not m:
            continue
        name, meta = m.group("name"), _METADATA.search(line)
        called = _CALLS.search(line)
        if called:
            calls[name] = called.group(1)
        if meta:
            op, frame = _OP_NAME.search(meta.group(1)), _FRAME.search(meta.group(1))
            entry = {"op": op.group(1) if op else None,
                     "where": _resolve(int(frame.group(1)), tables, cache) if frame else None}
            out.setdefault(name, entry)
            if _TRITON_CALL in line and "backend_config=" in line:
                kernel = _KERNEL_NAME.search(line.split("backend_config=", 1)[1])
                if kernel:
                    triton.setdefault(kernel.group(1), []).append(entry)
            if line.lstrip().startswith("ROOT") and computation:
                roots[computation] = entry
    for name, computation in calls.items():   # a fusion with no metadata of its own: its root's
        if name not in out and computation in roots:
            out[name] = roots[computation]
    out.update({k: v for k, v in _triton_kernel_names(triton).items() if k not in out})
    return out


def _triton_kernel_names(entries_by_name: dict[str, list]) -> dict[str, dict]:
    """Trace names of the Triton kernels: a name given to n > 1 calls shows as name, name__1, ... name__{n-1},
    in an order the HLO does not tell, so all n are listed as one of the calls (their source line where they agree)."""
    out = {}
    for name, entries in entries_by_name.items():
        if len(entries) == 1:
            out[name] = entries[0]
            continue
        wheres = sorted({str(e["where"]) for e in entries})
        shared = {"op": f"one of {len(entries)} Triton calls named {name}",
                  "where": wheres[0] if len(wheres) == 1 else "one of: " + " | ".join(wheres)}
        out.update({name: shared, **{f"{name}__{i}": shared for i in range(1, len(entries))}})
    return out
