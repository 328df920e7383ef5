"""The opcode table drives every walker. For each op of ``runtime.opcodes``: every place that must
implement it has its case, and a failure lists, per op, the places still missing (the checklist of
docs/ARCHITECTURE.md, "Adding an op"). The numbering groups ops by class, and no kernel dispatches
by a range that names a particular op, so a new op cannot fall into another's branch."""
import ast
import dataclasses
import enum
import re
from pathlib import Path

import numpy as np
import pytest

from taperay.runtime import interval_kernels, intervals, jax_walker, op_codegen, twin_ops, wgsl_header
from taperay.runtime.intervals import INTERVAL_OPS
from taperay.runtime.opcodes import CLASS_RANGES, OPS, Family, Interval, Op, OpClass, OpSpec

ROOT = Path(__file__).resolve().parent.parent
READING = (OpClass.UNARY, OpClass.BINARY, OpClass.TERNARY)   # arithmetic ops reading registers


def _without_op_blocks(path: str, text: str) -> str:
    """``text`` without runtime.op_codegen's generated blocks (their dispatch is the generator's)."""
    for rel, name in op_codegen.BLOCKS:
        if rel == path:
            begin, end = (text.find(m) for m in op_codegen.block_markers(rel, name))
            text = text[:begin] + text[end:]
    return text


def _python(path: str, functions: str | None = None, comments: bool = False) -> str:
    """A module's code without generated block and (unless ``comments``) comments; with
    ``functions`` (a regex), only the functions whose names match it."""
    text = (ROOT / path).read_text()
    begin, end = text.find(wgsl_header.BLOCK_BEGIN), text.find(wgsl_header.BLOCK_END)
    if begin >= 0:
        text = text[:begin] + text[end + len(wgsl_header.BLOCK_END):]
    if functions is not None:
        tree = ast.parse(text)
        text = "\n".join(ast.get_source_segment(text, fn) for fn in tree.body
                         if isinstance(fn, ast.FunctionDef) and re.fullmatch(functions, fn.name))
    return text if comments else re.sub(r"#[^\n]*", "", text)


def _wgsl(path: str, function: str | None = None) -> str:
    text = re.sub(r"//[^\n]*", "", (ROOT / path).read_text())
    if function is not None:
        text = re.search(rf"\nfn {function}\(.*?\n}}\n", text, re.S).group(0)
    return text


# the twin's interpreter and the modules holding its op families' records
TWIN_MODULES = ["runtime/twin.py", "runtime/twin_shapes.py", "runtime/twin_patterns.py", "runtime/twin_instances.py",
                "runtime/twin_culls.py"]
TWIN = "\n".join(_python(m, comments=True) for m in TWIN_MODULES)   # (a final else names its op in a comment)
TWIN_ARITH = _python("runtime/twin_ops.py", r"arith_block|libm_block")
INTERVAL_IV = _python("runtime/interval_kernels.py", r"_iv\w*")
INTERPRETER = _wgsl("shaders/interpreter.wgsl")
IV_UNARY = _wgsl("shaders/prune.wgsl", "iv_unary")
IV_BINARY = _wgsl("shaders/prune.wgsl", "iv_binary")


def _has(name: str, code: str) -> bool:
    return re.search(rf"\b{name}\b", code) is not None


def places(op: Op) -> dict[str, bool]:
    """Each place ``op`` must appear -> whether it does."""
    spec, name = OPS[op], op.name
    reading = spec.op_class in READING
    found = {"shaders/interpreter.wgsl: its case (generated unary() / binary(), or run_tape)":
             _has(f"OP_{name}", INTERPRETER)}
    if reading:
        found["runtime/opcodes.py: OpSpec.numba and OpSpec.interval (the generated cases' rules)"] = \
            spec.numba is not None and spec.interval is not None
        found["runtime/twin_ops.py: its generated case in arith_block (regenerate)"] = _has(name, TWIN_ARITH)
        found["runtime/interval_kernels.py: its generated interval case in _iv (regenerate)"] = _has(name, INTERVAL_IV)
        prune_fn = "iv_unary" if spec.op_class is OpClass.UNARY else "iv_binary"
        found[f"shaders/prune.wgsl: its generated interval case in {prune_fn} (regenerate)"] = _has(
            f"OP_{name}", IV_UNARY if spec.op_class is OpClass.UNARY else IV_BINARY)
        found["runtime/opcodes.py: OpSpec.reference (float64 semantics)"] = spec.reference is not None
        found["runtime/intervals.py: a float64 interval rule (a monotone OpSpec.interval, or NAMED_RULES)"] = \
            op in INTERVAL_OPS
        found["runtime/opcodes.py: OpSpec.wgsl (tools/baseline_wgsl.py writes it out)"] = spec.wgsl is not None
        found["runtime/jax_walker.py: a value rule in _ARITH (or a numpy ufunc as reference)"] = \
            op in jax_walker._ARITH
    else:
        found["runtime/twin.py or its family's twin module: its case (or the comment naming a final else)"] = _has(name, TWIN)
    return found


def test_every_op_has_its_case_in_every_place():
    missing = {op.name: [p for p, ok in places(op).items() if not ok] for op in Op}
    missing = {k: v for k, v in missing.items() if v}
    assert not missing, "ops still missing places:\n" + "\n".join(
        f"  {op}: " + "; ".join(where) for op, where in missing.items())


def test_the_check_names_a_missing_place():
    """places() is not vacuous: code without an op's name misses it."""
    assert not _has("TANH_NOT_AN_OP", TWIN_ARITH)
    assert all(places(Op.SQRT).values()) and all(places(Op.SPHERE).values())
    assert _has("SQRT", TWIN_ARITH) and not _has("SQRT", _python("runtime/twin_ops.py", r"rand_bits"))


def test_classes_are_consecutive_ranges_in_class_order():
    numbers = [n for first, last in CLASS_RANGES.values() for n in range(first, last + 1)]
    assert numbers == list(range(len(Op)))
    for cls, (first, last) in CLASS_RANGES.items():
        assert all(OPS[Op(n)].op_class is cls for n in range(first, last + 1))
    assert {OPS[op].op_class for op in Op} == set(OpClass)


# Comparisons of an op with a particular op's number that may stay: VAR_X .. VAR_Z are pinned to
# 0 .. 2 (runtime.opcodes checks it). The generated blocks' range branches (unary() / binary(),
# _libm_block) are written from the table by runtime.op_codegen and are not scanned.
ALLOWED_NAMED_RANGES = {
    ("shaders/interpreter.wgsl", "VAR_Z"), ("shaders/packed.wgsl", "VAR_Z"), ("shaders/prune.wgsl", "VAR_Z"),
    ("runtime/interval_kernels.py", "VAR_Z"), ("runtime/pruned_eval.py", "VAR_Z"), ("runtime/twin.py", "VAR_Z"),
}
KERNELS = ["shaders/interpreter.wgsl", "shaders/packed.wgsl", "shaders/prune.wgsl", "shaders/kernels_render.wgsl",
           "shaders/kernels_points.wgsl", *TWIN_MODULES, "runtime/twin_ops.py", "runtime/interval_kernels.py",
           "runtime/pruner.py", "runtime/pruned_eval.py"]


def named_ranges(path: str) -> set[str]:
    """Op names that ``path`` compares an op with by <, <=, >, >= (class bounds aside)."""
    code = _without_op_blocks(path, (ROOT / path).read_text())
    code = re.sub(r"//[^\n]*", "", code) if path.endswith(".wgsl") else re.sub(r"#[^\n]*", "", code)
    prefix = "OP_" if path.endswith(".wgsl") else ""
    names = re.findall(rf"\bop\s*(?:<=|>=|<|>)\s*{prefix}([A-Z][A-Z0-9_]*)\b", code)
    names += re.findall(rf"\b{prefix}([A-Z][A-Z0-9_]*)\s*(?:<=|>=|<|>)\s*op\b", code)
    return {n for n in names if n in Op.__members__}


def test_kernels_dispatch_by_class_ranges_not_by_op_names():
    found = {(path, name) for path in KERNELS for name in named_ranges(path)}
    assert found <= ALLOWED_NAMED_RANGES, sorted(found - ALLOWED_NAMED_RANGES)
    assert named_ranges("runtime/twin.py") >= {"VAR_Z"}    # (the scan finds what is there)


# ----------------------------------------------------------------------------- generated backends
def _with(op: Op, **changes) -> dict:
    """A copy of the table with ``op``'s entry changed."""
    return {**OPS, op: dataclasses.replace(OPS[op], **changes)}


def test_an_op_without_a_rule_fails_at_generation():
    """No generated dispatch has a silent last branch: a missing rule is an error naming the op."""
    for changes in ({"interval": None}, {"numba": None}, {"wgsl": None},
                    {"interval": Interval(numba="_iv_add({alo}, {ahi}, {blo}, {bhi})")},
                    {"interval": Interval("increasing")}, {"rank": OPS[Op.SUB].rank}):
        for gen in op_codegen.BLOCKS.values():
            with pytest.raises(op_codegen.OpRuleError, match="ADD|ranks"):
                gen(_with(Op.ADD, **changes))


def _stand_in(name: str):
    """An opcode numbered after the table's last, named ``name`` (``name``_NEW where the table has one)."""
    name = name if name not in Op.__members__ else f"{name}_NEW"
    return enum.IntEnum("Extra", {name: len(Op)})[name]


def _exec_block(module, code: str, extra: dict) -> dict:
    """Run a generated Numba block as plain Python in a copy of its module's globals."""
    names = dict(vars(module), njit=lambda *a, **k: (lambda f: f), **extra)
    exec(compile(code, f"<generated {module.__name__}>", "exec"), names)
    return names


def test_a_new_op_is_one_table_entry():
    """TANH, added as one OpSpec (a stand-in opcode after the last), gets its twin loop, its twin
    interval, its float64 interval, and its WGSL value and interval cases from the generators;
    the twin's loop and interval run (as Python) and agree with numpy's tanh."""
    number = len(Op)
    tanh_op = _stand_in("TANH")
    spec = OpSpec(tanh_op, Family.ARITH, ("a",), True, 0, "tanh(a)", np.tanh, wgsl="tanh({a})",
                  numba="np.tanh({a})", numba_loop="libm", rank=max(s.rank for s in OPS.values()) + 1,
                  interval=Interval("increasing", wgsl_range=("-1.0", "1.0")))
    ops = {**OPS, tanh_op: spec}
    blocks = op_codegen.generated_blocks(ops)
    assert "np.tanh(x)" in blocks["runtime/twin_ops.py", "arith"]
    assert f"op == {tanh_op.name}" in blocks["runtime/twin_ops.py", "arith"]
    assert "rl, rh = np.tanh(lo), np.tanh(hi)" in blocks["runtime/interval_kernels.py", "intervals"]
    assert f"if (op == OP_{tanh_op.name}) {{ return tanh(va); }}" in blocks["shaders/interpreter.wgsl", "arith"]
    assert "let w = wide(tanh(lo), tanh(hi));" in blocks["shaders/prune.wgsl", "intervals"]
    assert "return iv(max(w.lo, -1.0), min(w.hi, 1.0));" in blocks["shaders/prune.wgsl", "intervals"]

    rng = np.random.default_rng(7)
    x = (rng.standard_normal(64) * 3).astype(np.float32)
    arith = _exec_block(twin_ops, blocks["runtime/twin_ops.py", "arith"], {tanh_op.name: number})
    regs = np.zeros((2, 64), np.float32)
    regs[0] = x
    arith["arith_block"](number, regs, 1, 0, 0, 0, 64)
    assert np.array_equal(regs[1], np.tanh(x))

    iv = _exec_block(interval_kernels, blocks["runtime/interval_kernels.py", "intervals"], {tanh_op.name: number})
    f64 = intervals.monotone_rule(spec)
    for lo, hi in [(-1.0, 2.0), (0.25, 0.5), (-30.0, -29.0)]:
        l32, h32, ch = iv["_iv"](number, np.float32(lo), np.float32(hi), 0, 0, 0, 0)
        inside = np.linspace(lo, hi, 101, dtype=np.float32)
        assert l32 <= np.tanh(inside).min() and h32 >= np.tanh(inside).max() and l32 < h32
        r_lo, r_hi = f64((np.array([lo]), np.array([hi])))
        assert l32 <= r_lo[0] <= r_hi[0] <= h32
    l32, h32, _ = iv["_iv"](number, np.float32(np.nan), np.float32(np.nan), 0, 0, 0, 0)
    assert np.isnan(l32) and np.isnan(h32)


def test_a_new_ops_wgsl_compiles(walker_gpu):
    """The GPU's generated cases of a stand-in TANH (one table entry) compile: the interval module
    (prelude, interpreter and prune.wgsl) with the op's constant and both generated blocks is
    valid WGSL on the adapter; a block naming an unknown function is not (the check can fail)."""
    from taperay.runtime import gpu_device
    from taperay.runtime.gpu_adapter import get_adapter
    from taperay.runtime.opcodes import REG_CAPS
    tanh_op = _stand_in("TANH")
    spec = OpSpec(tanh_op, Family.ARITH, ("a",), True, 0, "tanh(a)", np.tanh, wgsl="tanh({a})",
                  numba="np.tanh({a})", numba_loop="libm", rank=max(s.rank for s in OPS.values()) + 1,
                  interval=Interval("increasing", wgsl_range=("-1.0", "1.0")))
    blocks = op_codegen.generated_blocks({**OPS, tanh_op: spec})
    names = (*gpu_device.PRELUDE_BEFORE_REGCAP, wgsl_header.regcap_name(REG_CAPS[0]),
             *gpu_device.PRELUDE_AFTER_REGCAP, "prune.wgsl")
    texts = []
    for name in names:
        text = (wgsl_header.SHADER_DIR / name).read_text()
        for (path, block), body in blocks.items():
            if path == f"shaders/{name}":
                text = op_codegen.with_block(text, path, block, body)
        texts.append(text)
    source = "\n".join(texts) + f"\nconst OP_{tanh_op.name}: u32 = {len(Op)}u;\n"
    assert "return tanh(va);" in source and "wide(tanh(lo), tanh(hi))" in source
    device = get_adapter().request_device_sync()
    device.create_shader_module(code=source)
    with pytest.raises(Exception):
        device.create_shader_module(code=source.replace("return tanh(va);", "return tanhh(va);"))
