"""The package's import graph has no cycle (every import counted, also those inside functions)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_gpipe"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = PACKAGE.parent / Path(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def import_graph() -> dict[str, set[str]]:
    """``module -> modules of the package it imports``."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name, edges = _module_name(path), set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name.startswith("lightning_gpipe")}
            elif (
                isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_gpipe")
            ):
                for alias in node.names:  # ``from package import module`` imports the module
                    sub = f"{node.module}.{alias.name}"
                    edges.add(sub if _is_module(sub) else node.module)
        graph[name] = {e for e in edges if e != name}
    return graph


def test_import_graph_covers_the_package():
    graph = import_graph()
    assert {"lightning_gpipe", "lightning_gpipe.strategy.strategy", "lightning_gpipe.state.optimizer"} <= set(
        graph
    )
    assert all(target in graph for targets in graph.values() for target in targets)


def test_import_graph_has_no_cycle():
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                cycle = path[path.index(target) :] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
