"""The package's layers point down: no import cycle between taperay's modules, counting imports
inside functions too (a lazy import is still a dependency), and each folder imports only the
layers below it (docs/ARCHITECTURE.md: runtime <- scenegraph <- solvers <- tools)."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"taperay": "taperay", "runtime": "taperay.runtime", "scenegraph": "taperay.scenegraph",
           "solvers": "taperay.solvers", "tools": "taperay.tools", "scenes": "taperay.scenes"}
# a package may import from these (besides itself); taperay/__init__ loads everything lazily
MAY_IMPORT = {
    "taperay.runtime": set(),
    "taperay.scenegraph": {"taperay.runtime"},
    "taperay.scenes": {"taperay.runtime", "taperay.scenegraph", "taperay.solvers"},
    "taperay.solvers": {"taperay.runtime", "taperay.scenegraph"},
    "taperay.tools": {"taperay", "taperay.runtime", "taperay.scenegraph", "taperay.solvers", "taperay.scenes"},
}


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, pkg in FOLDERS.items():
        for f in (ROOT / folder).glob("*.py"):
            mods[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = f
    return mods


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its text (module level or not)."""
    mods = _modules()
    graph = {m: set() for m in mods}
    for m, f in mods.items():
        base = m if f.stem == "__init__" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = base.split(".")[: len(base.split(".")) - node.level + 1]
                    target = ".".join(parts + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                names = [target] + [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            graph[m] |= {n for n in names if n in mods and n != m}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def _package(module: str) -> str:
    return max((p for p in FOLDERS.values() if module == p or module.startswith(p + ".")), key=len)


@pytest.mark.slow
@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_a_layer_imports_only_the_layers_below_it(package):
    bad = [f"{m} imports {n}" for m, deps in import_graph().items() if _package(m) == package
           for n in deps if _package(n) not in MAY_IMPORT[package] | {package}]
    assert not bad, bad
