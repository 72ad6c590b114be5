"""The arrows of docs/layout.md, "Which way the imports point", read from the source: which package
imports which, the layers inside the trainer, and no import circle anywhere in the house.

Every import counts, at the top of a module, inside a function or under `if TYPE_CHECKING:`: a cycle that
only lazy or type-only imports keep from failing is still a cycle (sweep's report and tracking had one;
trainer.run's step, state, metrics and measurement had one with the loop, at type level)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("trainer", "sweep", "eval", "snakemake_executor_plugin_submitit")
FORBIDDEN = {"trainer": ("sweep", "snakemake", "mlflow"), "eval": ("trainer", "sweep")}


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


MODULES = {module_name(p): p for package in PACKAGES for p in (REPO / package).rglob("*.py")}


def imported_names(path: Path) -> set[str]:
    """Every name `path` imports from a module, anywhere in it, as `module.name`, and every module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}  # from sweep import axes
    return found


def imported_modules(path: Path) -> set[str]:
    """The house's modules `path` imports: `from package import module` imports that module, not the
    package's __init__ (which Python has already run, as the importer's own package, or runs first)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules = {f"{node.module}.{alias.name}" for alias in node.names} & MODULES.keys()
            found |= modules
            if len(modules) < len(node.names):
                found.add(node.module)
    return found & MODULES.keys()


def house_graph() -> dict[str, set[str]]:
    graph = {name: imported_modules(path) - {name} for name, path in MODULES.items()
             if not name.endswith("__main__")}
    return {name: {m for m in deps if m in graph} for name, deps in graph.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        for other in sorted(graph[name]):
            if other not in index:
                visit(other)
                low[name] = min(low[name], low[other])
            elif other in stack:
                low[name] = min(low[name], index[other])
        if low[name] == index[name]:
            component = []
            while not component or component[-1] != name:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return found


def test_the_arrows_point_the_way_design_says():
    for package, banned in FORBIDDEN.items():
        for path in (REPO / package).rglob("*.py"):
            bad = sorted(name for name in imported_names(path) if name.split(".")[0] in banned)
            assert not bad, f"{module_name(path)} imports {bad}"


def test_the_house_has_no_import_circle():
    graph = house_graph()
    assert cycles(graph) == []
    assert "trainer.run.step_batch" in graph["trainer.run.step"]  # the graph was read
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # and a circle is found


def _importers(prefix: str) -> dict[str, set[str]]:
    return {name: imported_names(path) for name, path in MODULES.items() if name.startswith(prefix)}


def test_the_trainer_is_layered():
    """The batch types are the bottom: models, objective and engines import them, not one another's;
    the objective reads no private name of the models; a run measures without importing the audits."""
    assert not {n for n in imported_names(MODULES["trainer.batch"]) if n.startswith("trainer")}
    for name, names in _importers("trainer.model").items():
        assert not {n for n in names if n.startswith(("trainer.objective", "trainer.rollout"))}, name
    for name, names in _importers("trainer.objective").items():
        private = {n for n in names if n.startswith("trainer.model") and n.rsplit(".", 1)[-1].startswith("_")}
        assert not private, f"{name} imports {private}"
    for name, names in _importers("trainer.run").items():
        assert not {n for n in names if n.startswith("trainer.audits")}, name
    assert "trainer.batch.PackedBatch" in imported_names(MODULES["trainer.model.logprobs"])  # the names were read


def test_only_the_loop_takes_the_whole_run():
    """The step's functions take what they use (the batch, the policies, the learner, the objective): no
    function of trainer/run/ outside loop.py has a parameter of type Run, or imports the loop."""
    for path in (REPO / "trainer" / "run").glob("*.py"):
        if path.name in ("loop.py", "__init__.py"):
            continue
        assert not {n for n in imported_names(path) if n.startswith("trainer.run.loop")}, path.name
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for arg in node.args.args + node.args.kwonlyargs:
                    annotation = ast.unparse(arg.annotation) if arg.annotation else ""
                    assert annotation.strip("'\"") != "Run", f"{path.name}: {node.name}({arg.arg}: Run)"


def _parses_an_error(node: ast.AST) -> bool:
    """`str(error).replace(...)`, `.partition`, `.split`, `.startswith`: reading an error's text for its key."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("replace", "partition", "split", "startswith")
            and isinstance(node.func.value, ast.Call) and getattr(node.func.value.func, "id", "") == "str"
            and any("error" in ast.unparse(arg).lower() for arg in node.func.value.args))


def test_no_config_error_is_rewritten_or_parsed_to_find_its_key():
    """A ConfigError carries its key as data (trainer/config_error.py): the config modules and the study read
    `error.key`, never the message's text. (Text from outside, a library's or a server's, is read where
    there is nothing else: MLflow's errors in sweep/tracking, the compiler's in trainer/rollout.)"""
    for name in [name for name in MODULES if name.startswith(("trainer.config", "trainer.objective", "sweep.study"))]:
        found = [ast.unparse(node) for node in ast.walk(ast.parse(MODULES[name].read_text())) if _parses_an_error(node)]
        assert not found, f"{name}: {found}"
    assert _parses_an_error(ast.parse('str(error).replace("ObjectiveConfig.", "objective.")').body[0].value)
