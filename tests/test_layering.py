"""Imports flow one way: every etmlx module imports only its own layer or those below, and no two modules
import each other, even through a chain (imports inside functions count too: a lazy import is still a
dependency, it only hides it).

The layers, lowest first, are the architecture docs/architecture.md's Layout section draws. A module belongs to the
layer with the longest matching prefix.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "backends" / "mlx"

LAYERS = [
    "serialization",
    "runtime",
    "custom_kernel_ops",
    "exporter.edge_target", "exporter.dtypes", "exporter.fusion", "exporter.builder", "exporter.ops", "exporter",
    "llm", "llm.sampler", "llm.distributed", "llm.decoder", "llm.builtin",
    "serve",
    "cli",
]
# Paths that must stay free of the exporter (import time and memory of the decode loop; issue 11).
NO_EXPORTER = ["runtime", "llm.decoder.loop", "llm.decoder.meta", "llm.decoder.step_inputs", "llm.decoder.tokenizer_files",
               "serve"]


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).with_suffix("")
        if "generated" in rel.parts:
            continue
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """etmlx modules (relative to backends.mlx) that `path` imports anywhere in its body."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import mod` depends on mod; `from mod import name` on mod
            names = [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if not name.startswith("backends.mlx."):
                continue
            rel = name[len("backends.mlx."):]
            while rel and rel not in MODULES:  # `from pkg import name` where name is not a module
                rel = rel.rpartition(".")[0]
            if rel:
                out.add(rel)
    return out


GRAPH = {name: _imports(path) - {name} for name, path in MODULES.items()}


def _layer(module: str) -> int | None:
    best = None
    for i, prefix in enumerate(LAYERS):
        if module == prefix or module.startswith(prefix + "."):
            if best is None or len(prefix) > len(LAYERS[best]):
                best = i
    return best


def test_every_module_has_a_layer():
    assert [m for m in MODULES if m and _layer(m) is None] == []


def test_no_module_imports_a_higher_layer():
    upward = [f"{m} ({LAYERS[_layer(m)]}) imports {d} ({LAYERS[_layer(d)]})"
              for m, deps in GRAPH.items() if m for d in deps if d and _layer(d) > _layer(m)]
    assert upward == []


def test_no_import_cycles():
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for dep in sorted(GRAPH.get(node, ())):
            if state.get(dep) == "open":
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_decode_and_serve_paths_never_reach_the_exporter():
    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for dep in GRAPH.get(todo.pop(), ()):
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        return seen

    starts = [m for m in MODULES if any(m == p or m.startswith(p + ".") for p in NO_EXPORTER)]
    bad = {m: sorted(d for d in reach(m) if d.startswith("exporter")) for m in starts}
    assert {m: d for m, d in bad.items() if d} == {}


def test_the_checker_sees_a_cycle_and_an_upward_import():
    """Control: the rules above would fail on a graph that breaks them."""
    assert _layer("serve.engine") > _layer("llm.decoder.loop") > _layer("llm.sampler.config")
    assert _imports(PACKAGE / "exporter" / "fusion" / "plan.py") >= {"exporter.fusion.rms_norm"}


def test_the_package_never_imports_the_benchmarks():
    """benchmarks/ is outside the shipped package; only the CLI's `etmlx bench` hook loads it, by path."""
    found = []
    for path in [*PACKAGE.rglob("*.py"), *(REPO / "etmlx").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "benchmarks" or n.startswith("benchmarks.") for n in names):
                found.append(str(path.relative_to(REPO)))
    assert sorted(set(found)) == ["backends/mlx/cli/main.py"]
