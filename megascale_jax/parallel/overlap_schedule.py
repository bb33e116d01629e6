"""What a compiled program lets run under each collective, read from its HLO text (`compiled.as_text()`).

The macro layer (parallel/overlap.py) orders its phases so that independent work exists next to every
collective; whether it overlaps is decided by XLA. Two questions, answered from the compiled HLO rather
than assumed:

  independent(module, collective, compute)   no data path between them either way (so a scheduler *may*
                                             run them at the same time); works on any backend, also on
                                             XLA:CPU, whose collectives are synchronous;
  compute_under(module, collective, compute) in a *scheduled* module (GPU, with async collectives), the
                                             compute instructions placed between each matching
                                             collective's start and its done: what the latency-hiding
                                             scheduler actually overlapped.

Instructions are matched by the named scopes in their `op_name` metadata (the macro layer names every
phase: 'macro_bwd/chunk0/dx_exchange', 'macro_bwd/chunk0/expert_wgrad', 'ffn/chunk1/dispatch', ...); a
fusion is named by its root (XLA's metadata), an async wrapper by what it wraps, a collective that XLA's
combiner merged from several by each of theirs (XLA writes 'prefix/(a/b:c/d)' for 'prefix/a/b' + 'prefix/c/d').
Async forms: `<kind>-start` / `<kind>-done` and `async-start` / `async-done` wrapping a collective.
"""
from __future__ import annotations

import dataclasses
import re

from megascale_jax.parallel.hlo_bytes import COLLECTIVE_KINDS, INSTRUCTION, OPCODE

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_OP_NAME = re.compile(r'op_name="(?P<op_name>[^"]*)"')
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|branch_computations)=\{?(?P<names>%?[\w.\-]+(?:,\s*%?[\w.\-]+)*)\}?")


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    opcode: str
    operands: tuple[str, ...]
    op_name: str
    calls: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class HloModule:
    computations: dict[str, list[Instruction]]   # instructions in text order: the schedule, when scheduled
    entry: str
    is_scheduled: bool

    def scopes(self, instruction: Instruction) -> str:
        """The op_name of an instruction (a fusion's is its root's); an async wrapper or a call without its own
        also carries those of the computations it calls."""
        if instruction.op_name and instruction.opcode != "async-start":
            return instruction.op_name
        names, stack, seen = [instruction.op_name], list(instruction.calls), set()
        while stack:
            computation = stack.pop()
            if computation in seen or computation not in self.computations:
                continue
            seen.add(computation)
            for inner in self.computations[computation]:
                names.append(inner.op_name)
                stack.extend(inner.calls)
        return "\n".join(names)

    def collective_kind(self, instruction: Instruction) -> str | None:
        """The collective an instruction starts (or is), else None."""
        op = instruction.opcode
        for kind in COLLECTIVE_KINDS:
            if op in (kind, f"{kind}-start"):
                return kind
        if op == "async-start":
            for computation in instruction.calls:
                for inner in self.computations.get(computation, []):
                    if inner.opcode in COLLECTIVE_KINDS:
                        return inner.opcode
        return None


def expand_combined(op_name: str) -> list[str]:
    """The op_names a combined instruction stands for: 'p/(a/x:b/y)' -> ['p/a/x', 'p/b/y'] (recursively);
    any other name -> [name]. The group is a parenthesis opened at the start or after '/' that closes at the
    end of the name and holds a top-level ':' (a scope such as 'jvp(f)' has none)."""
    for start, ch in enumerate(op_name):
        if ch != "(" or (start and op_name[start - 1] != "/"):
            continue
        depth, splits = 0, []
        for end in range(start, len(op_name)):
            depth += {"(": 1, ")": -1}.get(op_name[end], 0)
            if depth == 1 and op_name[end] == ":":
                splits.append(end)
            if depth == 0:
                break
        if depth == 0 and end == len(op_name) - 1 and splits:
            bounds = [start] + splits + [end]
            return [name for a, b in zip(bounds, bounds[1:])
                    for name in expand_combined(op_name[:start] + op_name[a + 1:b])]
    return [op_name]


def parse(hlo_text: str) -> HloModule:
    computations: dict[str, list[Instruction]] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        stripped = line.strip()
        if current is None:
            header = _HEADER.match(stripped)
            if header and not stripped.startswith("HloModule"):
                current = header.group("name")
                computations[current] = []
                if stripped.startswith("ENTRY"):
                    entry = current
            continue
        if stripped == "}":
            current = None
            continue
        match = INSTRUCTION.match(line)
        if not match:
            continue
        rest = match.group("rest")
        opcode = OPCODE.search(rest)
        if not opcode:
            continue
        args = rest[opcode.end():]
        depth, end = 1, 0
        for end, ch in enumerate(args):   # the operand list is up to the matching parenthesis
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                break
        operands = tuple(re.findall(r"%([\w.\-]+)", args[:end]))
        op_name = _OP_NAME.search(rest)
        calls = tuple(n.strip().lstrip("%") for m in _CALLS.finditer(rest[opcode.end() + end:])
                      for n in m.group("names").split(","))
        names = "\n".join(expand_combined(op_name.group("op_name"))) if op_name else ""
        computations[current].append(Instruction(match.group("name"), opcode.group("op"), operands, names, calls))
    return HloModule(computations, entry, "is_scheduled=true" in hlo_text.split("\n", 1)[0])


_BOOKKEEPING = ("get-tuple-element", "bitcast", "parameter", "tuple", "constant", "copy-start", "copy-done")


def _matching(module: HloModule, computation: str, scope: str, collective: bool):
    for i, ins in enumerate(module.computations[computation]):
        if ins.opcode.endswith("-done") or ins.opcode in _BOOKKEEPING:
            continue
        if (module.collective_kind(ins) is not None) == collective and scope in module.scopes(ins):
            yield i, ins


def independent(module: HloModule, collective_scope: str, compute_scope: str) -> list[tuple[str, str, bool]]:
    """[(collective, compute, independent)] for every pair of a collective whose scopes contain
    `collective_scope` and a non-collective instruction whose scopes contain `compute_scope`, in the same
    computation; independent = neither depends on the other through data."""
    out = []
    for computation, instructions in module.computations.items():
        collectives = list(_matching(module, computation, collective_scope, True))
        computes = list(_matching(module, computation, compute_scope, False))
        if not collectives or not computes:
            continue
        operands = {ins.name: ins.operands for ins in instructions}
        users: dict[str, list[str]] = {}
        for ins in instructions:
            for op in ins.operands:
                users.setdefault(op, []).append(ins.name)

        def reach(start, edges):
            seen, stack = set(), [start]
            while stack:
                for nxt in edges.get(stack.pop(), ()):
                    if nxt not in seen:
                        seen.add(nxt)
                        stack.append(nxt)
            return seen

        for _, c in collectives:
            # An async collective's result is its done: follow users from the done as well as the start.
            ancestors, descendants = reach(c.name, operands), reach(c.name, users)
            for _, g in computes:
                out.append((c.name, g.name, g.name not in ancestors and g.name not in descendants))
    return out


def compute_under(module: HloModule, collective_scope: str, compute_scope: str) -> dict[str, list[str]]:
    """{async collective start: [compute instructions scheduled between it and its done]} for the collectives
    whose scopes contain `collective_scope`, counting compute whose scopes contain `compute_scope`."""
    out = {}
    for computation, instructions in module.computations.items():
        for i, start in _matching(module, computation, collective_scope, True):
            if not start.opcode.endswith("-start"):
                continue   # synchronous: nothing runs under it
            done = next((j for j, ins in enumerate(instructions)
                         if ins.opcode.endswith("-done") and start.name in ins.operands), None)
            if done is None:
                continue
            out[start.name] = [ins.name for ins in instructions[i + 1:done]
                               if module.collective_kind(ins) is None and not ins.opcode.endswith("-done")
                               and ins.opcode not in _BOOKKEEPING and compute_scope in module.scopes(ins)]
    return out
