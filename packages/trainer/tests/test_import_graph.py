"""The trainer's modules import one another without a cycle — counting imports inside functions, which hide a cycle
from Python until the function first runs — and the schema is a leaf (it names what pieces own by import path)."""

import ast
from pathlib import Path

import lorarl.trainer

SOURCES = Path(lorarl.trainer.__file__).resolve().parent
PACKAGE = "lorarl.trainer"


def module_name(path: Path) -> str:
    parts = path.relative_to(SOURCES).with_suffix("").parts
    return ".".join((PACKAGE, *parts)).removesuffix(".__init__")


def trainer_imports(path: Path, modules: set[str]) -> set[str]:
    """The trainer modules `path` imports, anywhere in it (`from a.b import c` counts a.b.c when that is a module)."""
    named: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            named.add(node.module)
            named.update(f"{node.module}.{alias.name}" for alias in node.names)
    itself = module_name(path)
    return {name for name in named if name in modules and name != itself}


def import_graph() -> dict[str, set[str]]:
    paths = sorted(SOURCES.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    return {module_name(path): trainer_imports(path, modules) for path in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` (its modules in order, the first repeated at the end), or None."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return None
        for imported in sorted(graph[module]):
            if cycle := visit(imported, [*path, module]):
                return cycle
        done.add(module)
        return None

    for module in sorted(graph):
        if cycle := visit(module, []):
            return cycle
    return None


def test_no_trainer_module_imports_itself_through_others():
    graph = import_graph()
    assert len(graph) > 40  # the walk found the modules
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_schema_is_a_leaf():
    assert import_graph()[f"{PACKAGE}.schema"] == {f"{PACKAGE}.registry"}
    assert import_graph()[f"{PACKAGE}.registry"] == set()


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
