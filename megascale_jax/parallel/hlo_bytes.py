"""Collectives and their bytes, read from HLO text (`jax.jit(f).lower(...).compile().as_text()`).

`parse_collectives(hlo_text)` lists every all-to-all, ragged-all-to-all, all-gather, reduce-scatter,
all-reduce, collective-permute and collective-broadcast, with its operand and result dtypes/shapes and the
replica-group size. Async pairs are counted once: `*-start` is kept and `*-done` dropped; generic
`async-start/update/done` wrappers are dropped because the collective inside their wrapped computation
is itself listed. Compiled HLO prints operands by name only, so operand shapes are looked up from the
defining instruction.

Byte conventions (per participating device):
  operand_bytes / result_bytes  sizes of the instruction's inputs / outputs (tuples summed)
  buffer_bytes                  the full, un-scattered buffer: max(operand, result) (for async starts the
                                result tuple also holds the operands, so it is derived from the operands)
  wire_bytes                    bytes one device sends with the usual algorithms: ring reduce-scatter,
                                all-gather and all-to-all send (g-1)/g of the buffer, ring all-reduce twice
                                that, collective-permute / broadcast the whole operand.
"""
from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

COLLECTIVE_KINDS = ("all-to-all", "ragged-all-to-all", "all-gather", "reduce-scatter", "all-reduce",
                    "collective-permute", "collective-broadcast")

DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8,
    "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1,
    "f8e3m4": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5, "token": 0,
}

INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
OPCODE = re.compile(r"(?:^|[\s)\]}])(?P<op>[a-z][a-z0-9\-]*)\(")
_ARRAY_SHAPE = re.compile(r"\b(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[0-9,]*)\]")
_OPERAND_NAME = re.compile(r"%([\w.\-]+)")
_EXPLICIT_GROUPS = re.compile(r"replica_groups=\{(?P<groups>(?:\{[0-9,]*\},?)*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(?P<dims>[0-9,]+)\]<=")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[(?P<axes>[^\]]*)\]\s*\{(?P<used>[^}]*)\}")


@dataclasses.dataclass(frozen=True)
class ArrayShape:
    dtype: str
    dims: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown HLO dtype {self.dtype!r}; add it to DTYPE_BYTES in hlo_bytes.py")
        count = 1
        for d in self.dims:
            count *= d
        return int(count * DTYPE_BYTES[self.dtype])


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str                         # one of COLLECTIVE_KINDS
    name: str                         # HLO instruction name
    is_async: bool                    # a *-start op (its *-done was not counted)
    operands: tuple[ArrayShape, ...]
    results: tuple[ArrayShape, ...]   # for async starts: the raw result tuple (operands + outputs + ctx)
    group_size: int | None            # devices per replica group; None if not stated (all devices)
    num_pairs: int | None = None      # collective-permute: number of source->target pairs

    @property
    def operand_bytes(self) -> int:
        return sum(s.nbytes for s in self.operands)

    @property
    def result_bytes(self) -> int:
        return sum(s.nbytes for s in self.results)

    @property
    def buffer_bytes(self) -> int:
        if not self.is_async:
            return max(self.operand_bytes, self.result_bytes)
        if self.kind == "all-gather" and self.group_size:
            return self.operand_bytes * self.group_size
        return self.operand_bytes

    @property
    def dtypes(self) -> tuple[str, ...]:
        return tuple(sorted({s.dtype for s in self.operands}))

    @property
    def wire_bytes(self) -> int:
        if self.kind in ("collective-permute", "collective-broadcast"):
            return self.operand_bytes
        g = self.group_size
        if not g:
            raise ValueError(f"{self.name}: replica group size unknown; pass num_devices to parse_collectives")
        ring_fraction = (g - 1) / g
        factor = 2 * ring_fraction if self.kind == "all-reduce" else ring_fraction
        return int(round(self.buffer_bytes * factor))


def _parse_shapes(text: str) -> tuple[ArrayShape, ...]:
    return tuple(ArrayShape(m["dtype"], tuple(int(d) for d in m["dims"].split(",") if d))
                 for m in _ARRAY_SHAPE.finditer(text))


def _split_call(rest: str):
    """'SHAPE op(args), attrs' -> (shape_text, op, args_text, attrs_text), or None if no call."""
    match = OPCODE.search(rest)
    if match is None:
        return None
    open_at = match.end() - 1
    depth = 0
    for i in range(open_at, len(rest)):
        depth += {"(": 1, ")": -1}.get(rest[i], 0)
        if depth == 0:
            return rest[:match.start("op")], match["op"], rest[open_at + 1:i], rest[i + 1:]
    return rest[:match.start("op")], match["op"], rest[open_at + 1:], ""


def _group_size(attrs: str, num_devices: int | None) -> int | None:
    if m := _EXPLICIT_GROUPS.search(attrs):
        groups = re.findall(r"\{([0-9,]*)\}", m["groups"])
        if groups and groups[0]:
            return len(groups[0].split(","))
        return num_devices  # replica_groups={} means one group of every device
    if m := _IOTA_GROUPS.search(attrs):
        return int(m["dims"].split(",")[-1])
    if m := _MESH_GROUPS.search(attrs):
        sizes = {k.strip().strip("'\""): int(v) for k, v in
                 (item.split("=") for item in m["axes"].split(",") if "=" in item)}
        used = [a.strip().strip("'\"") for a in m["used"].split(",") if a.strip()]
        size = 1
        for axis in used:
            size *= sizes[axis]
        return size
    return num_devices


def _kind_of(op: str) -> tuple[str, bool] | None:
    if op.endswith("-done") or op.startswith("async-"):
        return None
    is_async = op.endswith("-start")
    kind = op[: -len("-start")] if is_async else op
    return (kind, is_async) if kind in COLLECTIVE_KINDS else None


def parse_collectives(hlo_text: str, num_devices: int | None = None) -> list[Collective]:
    """Every collective in `hlo_text` (all computations), in text order. See the module docstring."""
    shapes_by_name: dict[str, tuple[ArrayShape, ...]] = {}
    pending = []
    for line in hlo_text.splitlines():
        inst = INSTRUCTION.match(line)
        if inst is None:
            continue
        call = _split_call(inst["rest"])
        if call is None:
            continue
        shape_text, op, args, attrs = call
        shapes_by_name[inst["name"]] = _parse_shapes(shape_text)
        if (kind := _kind_of(op)) is not None:
            pending.append((inst["name"], kind, shape_text, args, attrs))
    collectives = []
    for name, (kind, is_async), shape_text, args, attrs in pending:
        inline = _parse_shapes(args)  # HLO printed with operand shapes (e.g. before compilation)
        operands = inline or tuple(s for ref in _OPERAND_NAME.findall(args) for s in shapes_by_name.get(ref, ()))
        pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
        collectives.append(Collective(
            kind=kind, name=name, is_async=is_async, operands=operands, results=_parse_shapes(shape_text),
            group_size=_group_size(attrs, num_devices),
            num_pairs=len(re.findall(r"\{\d+,\d+", pairs.group(0))) if pairs else None))
    return collectives


def collective_bytes(hlo_text: str, num_devices: int | None = None, field: str = "buffer_bytes") -> dict[str, int]:
    """Total `field` ('buffer_bytes' | 'operand_bytes' | 'result_bytes' | 'wire_bytes') per collective kind."""
    if field not in ("buffer_bytes", "operand_bytes", "result_bytes", "wire_bytes"):
        raise ValueError(f"field={field!r}; use buffer_bytes, operand_bytes, result_bytes or wire_bytes")
    totals: dict[str, int] = defaultdict(int)
    for c in parse_collectives(hlo_text, num_devices):
        totals[c.kind] += getattr(c, field)
    return dict(totals)
