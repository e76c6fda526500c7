"""The package layering: no import circles between modules, no package importing one above it, a policy core with
no torch and no threads, and pages allocated only through the KV package's manager."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1] / "nodeserve"

# Lowest first: a package may import its own modules and those of packages on an earlier line only.
LAYERS = [
    {"kernels", "tokenizer", "device"},
    {"config"},
    {"attention"},
    {"model"},
    {"kv"},
    {"core"},
    {"sampling", "workloads", "goodput", "metrics"},
    {"speculative"},
    {"runtime"},
    {"plan"},
    {"server"},
    {"cli", "__main__"},
]
RANK = {p: i for i, layer in enumerate(LAYERS) for p in layer}


def _module(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.AST, type_checking: bool = False) -> set[str]:
    """nodeserve modules a file imports when it runs (function-level ones too), and its `if TYPE_CHECKING:` ones
    only when type_checking."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if not type_checking and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for child in node.body for n in ast.walk(child)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nodeserve"):
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}  # `from nodeserve.x import module`
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("nodeserve")}
    return out


def _graph(type_checking: bool = False) -> dict[str, set[str]]:
    files = {_module(p): p for p in ROOT.rglob("*.py")}
    return {m: {i for i in _runtime_imports(ast.parse(p.read_text()), type_checking) if i in files and i != m}
            for m, p in files.items()}


def _package(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def _upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((m, i) for m, imports in graph.items() for i in imports
                  if _package(m) and _package(i) and RANK[_package(i)] > RANK[_package(m)])


def test_no_module_import_circles():
    """`if TYPE_CHECKING:` imports count: a circle only for the type checker is still two modules each needing the
    other to be read."""
    graph = _graph(type_checking=True)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(path[path.index(n):] + [n] if n in path else [m, n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_no_package_imports_one_above_it():
    assert _upward(_graph()) == []
    assert set(RANK) >= {_package(m) for m in _graph() if _package(m)}  # every package has a layer


def test_no_package_imports_one_above_it_even_for_types():
    """`if TYPE_CHECKING:` imports count too: a package naming a type from one above it still depends on it (the
    import circles reviewers see), so lower packages declare a Protocol of what they use instead (attention/base.py)."""
    assert _upward(_graph(type_checking=True)) == []


def test_the_policy_core_imports_no_torch_and_starts_no_thread():
    code = ("import sys, threading, pkgutil, importlib, nodeserve.core as c\n"
            "for m in pkgutil.iter_modules(c.__path__): importlib.import_module('nodeserve.core.' + m.name)\n"
            "import nodeserve.plan.simulate\n"
            "print('torch' in sys.modules, threading.active_count())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "1"]


def test_pages_are_allocated_only_through_the_kv_manager():
    """Nothing outside kv/ reaches into the manager's free list or reference counts."""
    offenders = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if p.parent.name != "kv"
                 and any(s in p.read_text() for s in ("._free", "._refcount", "._evictable"))]
    assert offenders == []


# Collaborators and callbacks an object is given: through its constructor, never set on it afterwards by another one
WIRING = {"events", "loader", "fetch", "transfers", "slack_lending", "placer", "admission", "order", "disk",
          "tiers", "router", "lending", "scheduler", "kv"}


def test_no_module_wires_another_objects_collaborators_after_construction():
    """`x.on_* = ...` or `x.<collaborator> = ...` on anything but self: each object gets what it depends on in its
    constructor (runtime/node.py builds the node in order), or through a method named for it (use_policy)."""
    offenders = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
            for t in targets:
                for a in ast.walk(t):
                    if (isinstance(a, ast.Attribute) and isinstance(a.ctx, ast.Store)
                            and not (isinstance(a.value, ast.Name) and a.value.id in ("self", "cls"))
                            and (a.attr.startswith("on_") or a.attr in WIRING)):
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(t)}")
    assert offenders == []


def test_every_module_is_named_in_the_architecture_doc():
    """docs/architecture.md's map names each module (its path under nodeserve/, or its file name on a line of its
    package's modules)."""
    doc = (ROOT.parent / "docs" / "architecture.md").read_text()
    missing = [str(p.relative_to(ROOT)) for p in sorted(ROOT.rglob("*.py"))
               if str(p.relative_to(ROOT)) not in doc and p.name not in doc]
    assert missing == []
