"""The arrows of docs/layout.md, "Which way the imports point", read from the source: which package
imports which, and no cycles inside sweep or the objective.

Every import counts, at the top of a module or inside a function: a cycle that only lazy imports
keep from failing is still a cycle (sweep.report and sweep.tracking had one)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FORBIDDEN = {"trainer": ("sweep", "snakemake", "mlflow"), "eval": ("trainer", "sweep")}


def imports(path: Path) -> set[str]:
    """Every module `path` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}  # from sweep import axes
    return found


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts)


def test_the_arrows_point_the_way_design_says():
    for package, banned in FORBIDDEN.items():
        for path in (REPO / package).rglob("*.py"):
            bad = sorted(name for name in imports(path) if name.split(".")[0] in banned)
            assert not bad, f"{module_name(path)} imports {bad}"


def _graph(package: str) -> dict[str, set[str]]:
    modules = {module_name(p): p for p in (REPO / package).rglob("*.py") if p.name != "__main__.py"}
    return {name: {m for m in imports(path) if m in modules and m != name} for name, path in modules.items()}


def _assert_acyclic(graph: dict[str, set[str]]) -> None:
    def visit(name: str, trail: list[str]) -> None:
        assert name not in trail, "import cycle: " + " -> ".join([*trail[trail.index(name):], name])
        for other in sorted(graph[name]):
            visit(other, [*trail, name])

    for name in sorted(graph):
        visit(name, [])


def test_the_sweep_modules_import_each_other_without_cycles():
    graph = _graph("sweep")
    _assert_acyclic(graph)
    assert graph["sweep.figures"] and "sweep.report" not in graph["sweep.figures"]  # the graph was read


def test_the_objective_modules_import_each_other_without_cycles():
    graph = {name: deps for name, deps in _graph("trainer").items() if name.startswith("trainer.objective.")}
    _assert_acyclic({name: {m for m in deps if m in graph} for name, deps in graph.items()})
    assert "trainer.objective.presets" in graph["trainer.objective.objective_config"]  # the graph was read
