"""The package's layers point down: no import cycle between taperay's modules, counting imports
inside functions too (a lazy import is still a dependency), each folder imports only the layers
below it (docs/ARCHITECTURE.md: runtime <- scenegraph <- solvers <- tools), and inside runtime/
each module only modules of the layers below its own (RUNTIME_LAYERS). No module imports another
module's underscore names (``from taperay.x import _name``, ``x._name``): what crosses a module is
public. The tests read few private names (PRIVATE_READS_IN_TESTS at most): they check public
observables (``stats()``, ``info``, values, images)."""
import ast
import functools
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


# runtime's modules, lowest layer first: a module imports only modules of the layers before its
# own (docs/ARCHITECTURE.md, "Module layout"); the package's __init__ is outside the order
RUNTIME_LAYERS = [
    ("opcodes", "op_numbers", "jit_cache", "gpu_adapter", "memo"),
    ("tape", "op_codegen"),
    ("program", "intervals", "shading", "camera", "outputs", "resources", "environment", "gpu_guard"),
    ("lowering", "image", "wgsl_header", "twin_ops", "twin_threads"),   # the twin: scalar rules, threads,
    ("twin_shapes",),                                              # shape, point and combine ops,
    ("twin_patterns", "twin_instances", "twin_culls"),             # patterns, instance lists, split culls,
    ("twin_field",),                                               # the field over a block,
    ("twin_march",),                                               # march and light,
    ("twin",),                                                     # the interpreter and its entry points
    ("interval_kernels", "gpu_device"),                            # the twin's pruning, in layers:
    ("pruner",),                                                   # float32 intervals, the pruner,
    ("pruned_eval",),                                              # points and images,
    ("cells",),                                                    # march cells,
    ("pruned_march",),                                             # the march on them,
    ("pruning",),                                                  # and their public names
    ("compile_progress", "gpu_pruning", "path_tracing", "jax_cells"),
    ("cpu", "gpu", "jax_walker"),                                  # the walkers
    ("conformance",),                                              # grading, the GPU self-check
    ("walkers",),                                                  # the choice, the Walker protocol
]

# underscore names still taken across modules: (importing module, module taken from) -> names,
# each to be made public in the module that owns it (an entry that no longer occurs fails too).
# opcodes' is its owner's (issue #47)
_LEFT = {
    ("runtime.intervals", "runtime.opcodes"): "_rem_euclid",
    ("solvers.objectives", "solvers.shape"): "_blocks _geom _rule _scatter _stress",
    ("solvers.objectives", "solvers.study"): "_per_material",
    ("solvers.shape", "solvers.study"): "_per_material",
    ("tools.baseline_wgsl", "runtime.gpu_device"): "_shader_text",
}
UNDERSCORE_IMPORTS_LEFT = {(f"taperay.{m}", f"taperay.{o}", n) for (m, o), names in _LEFT.items() for n in names.split()}

# private names the tests read at most (tools: count_private_reads)
PRIVATE_READS_IN_TESTS = 8       # (lower it as reads go)


@functools.cache
def _modules() -> dict[str, Path]:
    mods = {}
    for folder, pkg in FOLDERS.items():
        for f in (ROOT / folder).glob("*.py"):
            mods[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = f
    return mods


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom in ``module`` (file ``path``) names."""
    if not node.level:
        return node.module or ""
    base = module if path.stem == "__init__" else module.rsplit(".", 1)[0]
    parts = base.split(".")[: len(base.split(".")) - node.level + 1]
    return ".".join(parts + ([node.module] if node.module else []))


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its text (module level or not)."""
    mods = _modules()
    graph = {m: set() for m in mods}
    for m, f in mods.items():
        for node in ast.walk(_tree(f)):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(m, f, node)
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


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_a_layer_imports_only_the_layers_below_it(package):
    bad = [f"{m} imports {n}" for m, deps in import_graph().items() if _package(m) == package
           for n in deps if _package(n) not in MAY_IMPORT[package] | {package}]
    assert not bad, bad


def layer_violations(graph: dict[str, set[str]], layers: list[tuple[str, ...]], package: str) -> list[str]:
    """Each import in ``graph`` by a module of ``package`` of a module of ``package`` that is not
    in a layer below its own, and each of its modules in no layer (the package itself aside)."""
    rank = {f"{package}.{name}": i for i, layer in enumerate(layers) for name in layer}
    out = [f"{m} is in no layer of RUNTIME_LAYERS (tests/test_layers.py): add it where its imports put it"
           for m in sorted(graph) if m.startswith(package + ".") and m not in rank]
    for m in sorted(set(graph) & set(rank)):
        for n in sorted(graph[m] & set(rank)):
            if rank[n] >= rank[m]:
                out.append(f"{m} (layer {rank[m]}) imports {n} (layer {rank[n]})")
    return out


def test_runtime_modules_import_only_the_layers_below_their_own():
    bad = layer_violations(import_graph(), RUNTIME_LAYERS, "taperay.runtime")
    assert not bad, "\n".join(bad)


def test_the_layer_check_finds_an_upward_import_and_a_module_in_no_layer():
    graph = {"p.a": set(), "p.b": {"p.a"}, "p.c": {"p.b"}, "p.d": set()}
    assert layer_violations(graph, [("a",), ("b", "c"), ("d",)], "p") == ["p.c (layer 1) imports p.b (layer 1)"]
    assert layer_violations(graph, [("a",), ("b",), ("c",)], "p") == [
        "p.d is in no layer of RUNTIME_LAYERS (tests/test_layers.py): add it where its imports put it"]


def underscore_imports(mods: dict[str, Path]) -> set[tuple[str, str, str]]:
    """(module, other module, name) for each underscore name (not a dunder) a module of ``mods``
    takes from another: ``from other import _name``, or ``other._name`` where ``other`` names a
    module of ``mods`` it imported."""
    found = set()
    for m, f in mods.items():
        aliases = {}
        for node in ast.walk(_tree(f)):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(m, f, node)
                for a in node.names:
                    if f"{target}.{a.name}" in mods:
                        aliases[a.asname or a.name] = f"{target}.{a.name}"
                    elif target in mods and target != m and a.name.startswith("_") and not a.name.startswith("__"):
                        found.add((m, target, a.name))
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in mods and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(_tree(f)):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and aliases[node.value.id] != m and node.attr.startswith("_") and not node.attr.startswith("__")):
                found.add((m, aliases[node.value.id], node.attr))
    return found


def test_no_module_imports_another_modules_underscore_names():
    found = underscore_imports(_modules())
    new = sorted(found - UNDERSCORE_IMPORTS_LEFT)
    assert not new, "underscore names taken across modules (make them public where they live): " + \
        ", ".join(f"{m} takes {o}.{n}" for m, o, n in new)
    gone = sorted(UNDERSCORE_IMPORTS_LEFT - found)
    assert not gone, f"no longer taken (drop them from UNDERSCORE_IMPORTS_LEFT): {gone}"


def test_the_underscore_check_finds_both_forms(tmp_path):
    (tmp_path / "a.py").write_text("_x = 1\ny = 2\n")
    (tmp_path / "b.py").write_text("from .a import _x, y\nfrom . import a\nprint(a._x, a.y)\n")
    mods = {"p.a": tmp_path / "a.py", "p.b": tmp_path / "b.py"}
    assert underscore_imports(mods) == {("p.b", "p.a", "_x")}


def count_private_reads(paths) -> list[tuple[str, int, str]]:
    """(file, line, name) for each private name a test reads: an attribute ``x._name``, a name
    ``from taperay... import _name``, or a string ``"_name"`` given to setattr / getattr /
    hasattr / delattr (monkeypatch's included). Dunders aside."""
    def private(name):
        return isinstance(name, str) and name.startswith("_") and not name.startswith("__")
    out = []
    for path in paths:
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Attribute) and private(node.attr):
                out.append((path.name, node.lineno, node.attr))
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("taperay"):
                out += [(path.name, node.lineno, a.name) for a in node.names if private(a.name)]
            elif isinstance(node, ast.Call) and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                fn = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
                if fn in ("getattr", "setattr", "hasattr", "delattr") and private(node.args[1].value):
                    out.append((path.name, node.lineno, node.args[1].value))
    return out


def test_the_tests_read_few_private_names():
    reads = count_private_reads(sorted((ROOT / "tests").glob("*.py")))
    assert len(reads) <= PRIVATE_READS_IN_TESTS, "\n".join(f"{f}:{n} {name}" for f, n, name in reads)
