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


# The package's folders are its layers, top to bottom; a module imports only from its own folder or
# from a folder on a lower floor. integrations/ holds third-party model code the package never imports.
FLOORS = {
    "lightning_gpipe": 8,  # the public surface
    "strategy": 7,  # Lightning glue
    "state": 6,  # checkpoint files and starting weights
    "partition": 5,
    "tools": 5,
    "engine": 4,  # one stage running its schedule column
    "transport": 3,  # messages between ranks
    "balance": 2,
    "schedule": 1,  # pure data
    "errors": 0,
    "_compat": 0,
    "_lightning": 0,
}
OPTIONAL = {"matplotlib", "hydra", "__main__"}  # imported where used: the package runs without them


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_folders_import_only_downward():
    upward = []
    for module, targets in import_graph().items():
        if _folder(module) == "integrations":
            continue
        for target in targets:
            here, there = _folder(module), _folder(target)
            if there == "integrations" or (here != there and FLOORS[there] >= FLOORS[here]):
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_every_folder_has_a_floor():
    folders = {_folder(m) for m in import_graph()}
    assert folders - {"integrations"} == set(FLOORS)


def test_no_import_inside_a_function_but_optional_dependencies():
    inside = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = [node.module or ""]
                else:
                    continue
                if any(n.split(".")[0] not in OPTIONAL for n in names):
                    inside.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert inside == []


def test_no_module_is_over_450_lines():
    long = {
        str(p.relative_to(PACKAGE.parent)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 450
    }
    assert long == {}


LIGHTNING = {
    "pytorch_lightning",
    "lightning",
    "lightning_fabric",
    "lightning_utilities",
    "torchmetrics",
    "hydra",
}
WITH_LIGHTNING = {"lightning_gpipe", "strategy", "state", "_lightning"}  # the glue and the checkpoint files


def test_only_the_glue_and_the_checkpoint_files_import_lightning():
    """The engine, the transport, the schedules, the partition and the tools run without Lightning."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        if _folder(module) in WITH_LIGHTNING | {"integrations"}:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            if any(n.split(".")[0] in LIGHTNING or n.startswith("lightning_gpipe._lightning") for n in names):
                found.append(f"{module}: {names[0]}")
    assert found == []
