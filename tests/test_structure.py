"""The package's shape, read from its source: imports point one way, pallas_kernels -> parallel -> model ->
step -> train, with no cycle; nothing imports `train`; model code calls no collective and opens no shard_map."""
import ast
import functools
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = ["pallas_kernels", "megascale_jax.parallel", "megascale_jax.model", "megascale_jax.step",
          "megascale_jax.train"]
COLLECTIVES = {"psum", "pmean", "pmax", "pmin", "all_gather", "all_to_all", "psum_scatter", "ppermute",
               "pshuffle", "ragged_all_to_all", "axis_index", "axis_size", "pcast", "pbroadcast"}


@functools.cache
def _modules():
    """{dotted module name: parsed source} for every module of the two packages."""
    out = {}
    for package in ("megascale_jax", "pallas_kernels"):
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = ast.parse(path.read_text(), str(path))
    return out


def _imports(tree, modules=()) -> set[str]:
    """Project modules a module imports; `from pkg import sub` names the submodule, not pkg's __init__."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & set(modules)
            found |= subs if len(subs) == len(node.names) else subs | {node.module}
    return {f for f in found if f.split(".")[0] in ("megascale_jax", "pallas_kernels")}


def _layer(name: str) -> int | None:
    for i, prefix in enumerate(LAYERS):
        if name == prefix or name.startswith(prefix + "."):
            return i
    return None


def test_imports_point_one_way_without_cycles():
    modules = _modules()
    graph = {name: {m for m in _imports(tree, modules) if m in modules} for name, tree in modules.items()}
    backwards = [(a, b) for a, targets in graph.items() for b in targets
                 if _layer(a) is not None and _layer(b) is not None and _layer(b) > _layer(a)]
    assert not backwards, f"imports against pallas_kernels -> parallel -> model -> step -> train: {backwards}"
    state: dict[str, int] = {}   # 1 on the stack, 2 done

    def visit(node, stack):
        state[node] = 1
        for nxt in graph[node]:
            assert state.get(nxt) != 1, f"import cycle: {' -> '.join(stack + [node, nxt])}"
            if nxt not in state:
                visit(nxt, stack + [node])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [])
    # Not vacuous: the layers really are connected downwards (step -> model, step -> parallel, parallel -> kernels).
    downward = {(_layer(a), _layer(b)) for a, targets in graph.items() for b in targets
                if _layer(a) is not None and _layer(b) is not None and _layer(b) < _layer(a)}
    assert {(3, 2), (3, 1), (1, 0)} <= downward, downward


def test_nothing_imports_train():
    offenders = [name for name, tree in _modules().items()
                 if name != "megascale_jax.train" and "megascale_jax.train" in _imports(tree, _modules())]
    for path in (ROOT / "benchmarks").rglob("*.py"):
        if "megascale_jax.train" in _imports(ast.parse(path.read_text()), _modules()):
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, offenders


def test_model_calls_no_collective_and_opens_no_shard_map():
    calls = []
    for name, tree in _modules().items():
        if not name.startswith("megascale_jax.model"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and (node.attr in COLLECTIVES or node.attr == "shard_map"):
                calls.append(f"{name}: .{node.attr}")
            if isinstance(node, ast.ImportFrom) and node.module in ("jax.lax", "jax.experimental.shard_map"):
                calls.append(f"{name}: from {node.module} import ...")
    assert not calls, calls
    # ...while the layouts, which the model calls, do communicate: the scan above would see them if misplaced.
    layouts = _modules()["megascale_jax.parallel.layouts"]
    assert any(isinstance(n, ast.Attribute) and n.attr in COLLECTIVES for n in ast.walk(layouts))
