"""Jitted calls take no int literals: Numba compiles a callee once more, with everything it calls,
for each literal-typed argument (``f(x, 0)``, or a counter ``n = 0; n += 1`` passed on), which
made a cold compile of the twin a third longer (docs/PERFORMANCE.md, cold compile). Such
arguments are written ``np.int64(...)``. Module-level constants are allowed: a few small functions
take an op code that way on purpose."""
import ast
from pathlib import Path

import pytest

RUNTIME = Path(__file__).resolve().parent.parent / "runtime"
JIT_MODULES = sorted(p for p in RUNTIME.glob("*.py") if "@njit" in p.read_text())


def _is_jitted(fn: ast.FunctionDef) -> bool:
    for dec in fn.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if isinstance(target, ast.Name) and target.id == "njit":
            return True
    return False


def _int_literal(node: ast.AST) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    return isinstance(node, ast.Constant) and type(node.value) is int


def _literal_counters(fn: ast.FunctionDef) -> set[str]:
    """Names that some assignment in fn sets to an int literal (alone or in a tuple)."""
    names = set()
    for node in ast.walk(fn):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            pairs = [(target, node.value)]
            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                pairs = list(zip(target.elts, node.value.elts))
            names |= {t.id for t, v in pairs if isinstance(t, ast.Name) and _int_literal(v)}
    return names


def literal_arguments(path: Path) -> list[str]:
    """'file:line: call(...) argument' for each int literal, or counter started as one, passed
    from a jitted function of the module to another jitted function of it."""
    tree = ast.parse(path.read_text())
    jitted = {fn.name: fn for fn in tree.body if isinstance(fn, ast.FunctionDef) and _is_jitted(fn)}
    found = []
    for fn in jitted.values():
        counters = _literal_counters(fn)
        for call in ast.walk(fn):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in jitted):
                continue
            for arg in call.args:
                if _int_literal(arg) or (isinstance(arg, ast.Name) and arg.id in counters):
                    found.append(f"{path.name}:{call.lineno}: {call.func.id}(... {ast.unparse(arg)} ...)")
    return found


@pytest.mark.slow
@pytest.mark.parametrize("path", JIT_MODULES, ids=lambda p: p.name)
def test_jitted_calls_take_no_int_literals(path):
    assert literal_arguments(path) == []


def test_the_check_finds_literals_and_counters(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from numba import njit\n"
                   "@njit(cache=True)\ndef f(a, n):\n    return a + n\n"
                   "@njit\ndef g(a):\n    n = 0\n    for i in range(3):\n        n += 1\n"
                   "    k = int(a)\n    return f(a, 1) + f(a, n) + f(a, -2) + f(a, k)\n")
    assert sorted(s.split(": ", 1)[1] for s in literal_arguments(src)) == [
        "f(... -2 ...)", "f(... 1 ...)", "f(... n ...)"]
    assert len(JIT_MODULES) >= 3          # cpu, pruning, shading at least
