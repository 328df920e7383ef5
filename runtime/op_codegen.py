"""The arithmetic ops' backends, generated from the opcode table (as Fidget does).

Owns the generated blocks that run the arithmetic ops reading registers (``OpClass`` UNARY,
BINARY, TERNARY) from their ``OpSpec`` rules (``numba``, ``numba_loop``, ``wgsl``, ``wgsl_walk``,
``interval``, ``rank``):

  * ``runtime/twin_ops.py`` block ``arith``: ``libm_block`` and ``arith_block``, the twin's loop of
    each op over a block of points, hottest first;
  * ``runtime/interval_kernels.py`` block ``intervals``: ``_iv_monotone64`` (the monotone ops computed in
    float64 and rounded outward) and ``_iv``, the twin's float32 interval of each op;
  * ``shaders/interpreter.wgsl`` block ``arith``: ``unary()`` and ``binary()``, the GPU's cases;
  * ``shaders/prune.wgsl`` block ``intervals``: ``iv_unary()`` and ``iv_binary()``.

A monotone op's cases are written from its scalar rule; any other op's from the named rule its
``Interval`` calls (a hand-written function of each target). An op without a rule for a target
raises ``OpRuleError`` here, at generation: no generated dispatch has a silent last branch.
``runtime.wgsl_header`` writes and checks these blocks with its generated files
(``python -m taperay.runtime.wgsl_header``; ``--check`` reports a stale block as drift).
"""
from __future__ import annotations

import math

from .opcodes import OPS, Family, Interval, Op, OpClass, OpSpec

__all__ = ["OpRuleError", "arith_ops", "BLOCKS", "generated_blocks", "with_block", "block_markers"]

READING = (OpClass.UNARY, OpClass.BINARY, OpClass.TERNARY)   # arithmetic ops reading registers
GROUP = 6          # WGSL unary() / binary(): ops tested per range branch (op <= OP_<last>)
LIBM_GROUP = 3     # the twin's _libm_block: ops per range branch
IV_NAMES = ("alo", "ahi", "blo", "bhi", "clo", "chi")


class OpRuleError(ValueError):
    """An op of the table lacks (or has an inconsistent) rule for a generated backend."""


def arith_ops(ops: dict[Op, OpSpec] | None = None) -> list[OpSpec]:
    """The arithmetic ops that read registers, hottest first (rank, then number); raises
    ``OpRuleError`` naming each op whose rules are missing or inconsistent."""
    ops = OPS if ops is None else ops
    specs = [s for s in ops.values() if s.family is Family.ARITH and s.op_class in READING]
    problems = []
    for s in specs:
        name, iv = s.op.name, s.interval
        if s.numba is None:
            problems.append(f"{name}: no OpSpec.numba (the twin's float32 rule)")
        if s.wgsl is None:
            problems.append(f"{name}: no OpSpec.wgsl (the GPU's rule)")
        if iv is None:
            problems.append(f"{name}: no OpSpec.interval (monotone, or a named rule)")
        elif iv.monotone is not None:
            if iv.monotone not in ("increasing", "decreasing"):
                problems.append(f"{name}: Interval.monotone {iv.monotone!r} (increasing / decreasing)")
            if s.op_class is not OpClass.UNARY:
                problems.append(f"{name}: a monotone interval rule needs one operand; give it a named rule")
            if iv.exact and iv.domain != (-math.inf, math.inf):
                problems.append(f"{name}: an exact monotone rule has no domain")
        elif iv.numba is None or iv.wgsl is None:
            problems.append(f"{name}: its named interval rule needs Interval.numba and Interval.wgsl")
        if s.numba_loop not in ("inline", "libm") and not s.numba_loop.isidentifier():
            problems.append(f"{name}: numba_loop {s.numba_loop!r}")
    ranks = [s.rank for s in specs]
    if len(set(ranks)) != len(ranks):
        problems.append(f"ranks are not distinct: {sorted(ranks)}")
    if problems:
        raise OpRuleError("runtime.opcodes: " + "; ".join(problems))
    return sorted(specs, key=lambda s: (s.rank, int(s.op)))


def _fill(template: str, names: dict[str, str]) -> str:
    return template.format(**names)


def _operands(fmt: str) -> dict[str, str]:
    return {r: fmt.format(r) for r in "abc"}


def _chunks(specs: list[OpSpec], size: int) -> list[list[OpSpec]]:
    by_number = sorted(specs, key=lambda s: int(s.op))
    return [by_number[i:i + size] for i in range(0, len(by_number), size)]


# ----------------------------------------------------------------------------- the twin
def numba_arith(ops: dict[Op, OpSpec] | None = None) -> str:
    """runtime/twin_ops.py's block: ``libm_block`` and ``arith_block``."""
    specs = arith_ops(ops)
    libm = [s for s in specs if s.numba_loop == "libm"]
    out = []
    if libm:
        names = " ".join(s.op.name for s in sorted(libm, key=lambda s: int(s.op)))
        out += ["@njit(**_JIT)",
                "def libm_block(op, regs, d, a, n):",
                f'    """regs[d, :n] = op(regs[a, :n]) for {names} (float32 libm), for arith_block. The op is',
                "    chosen per lane, but in a function this small LLVM unswitches the loop (one loop per op, as",
                "    fast as writing them out); inlined into arith_block it did not (~20% slower on",
                '    trigonometric tapes), so arith_block calls it."""',
                "    for j in range(n):",
                "        x = regs[a, j]"]
        chunks = _chunks(libm, LIBM_GROUP)
        for i, chunk in enumerate(chunks):
            exprs = [_fill(s.numba, {"a": "x", "b": "x", "c": "x"}) for s in chunk]
            expr = exprs[-1]
            for k in range(len(chunk) - 2, -1, -1):
                inner = expr if k == len(chunk) - 2 else f"({expr})"
                expr = f"{exprs[k]} if op == {chunk[k].op.name} else {inner}"
            if len(chunks) == 1:
                out.append(f"        r = {expr}")
            elif i == 0:
                out += [f"        if op <= {chunk[-1].op.name}:", f"            r = {expr}"]
            elif i < len(chunks) - 1:
                out += [f"        elif op <= {chunk[-1].op.name}:", f"            r = {expr}"]
            else:
                out += ["        else:", f"            r = {expr}"]
        out += ["        regs[d, j] = r", "", ""]
    out += ["# forceinline (LLVM alwaysinline): a call per op is slower where blocks hold few points (the",
            "# march's late steps, march_pruned's cells: _run_block at 8 points ~25% per op), and Numba's IR",
            "# inlining (inline=\"always\") adds an atomic refcount increment / decrement of ``regs`` per op.",
            "# No array views inside (RAND takes its bits from scalar views), so the body needs no refcounting.",
            "@njit(forceinline=True, **_JIT)",
            "def arith_block(op, regs, d, a, b, c, n):",
            '    """regs[d, :n] = op(regs[a], regs[b], regs[c]) lane by lane, for the arithmetic ops that read',
            "    registers: the twin's float32 rule of each (OpSpec.numba), shared by the interpreter",
            "    (runtime.twin) and the pruned point interpreter, hottest first (OpSpec.rank). Values only:",
            "    VAR_* / CONST / INSTANCE_INDEX (they read the point, the parameters, the pattern frame) and",
            '    material ids are the callers\'."""']
    first, libm_done = True, False
    for s in specs:
        if s.numba_loop == "libm":
            if libm_done:
                continue
            libm_done = True
            cond = " or ".join(f"op == {x.op.name}" for x in libm)
            body = ["        libm_block(op, regs, d, a, n)"]
        else:
            cond = f"op == {s.op.name}"
            if s.numba_loop == "inline":
                expr = _fill(s.numba, _operands("regs[{}, j]"))
                body = ["        for j in range(n):", f"            regs[d, j] = {expr}"]
            else:
                body = [f"        {s.numba_loop}(regs, d, a, b, n)"]
        out.append(f"    {'if' if first else 'elif'} {cond}:")
        out += body
        first = False
    return "\n".join(out)


def _py_domain(iv: Interval, lo: str, hi: str) -> str | None:
    tests = []
    if iv.domain[0] != -math.inf:
        tests.append(f"{lo} < {float(iv.domain[0])!r}")
    if iv.domain[1] != math.inf:
        tests.append(f"{hi} > {float(iv.domain[1])!r}")
    return " or ".join(tests) or None


def numba_intervals(ops: dict[Op, OpSpec] | None = None) -> str:
    """runtime/interval_kernels.py's block: ``_iv_monotone64`` and ``_iv``."""
    specs = arith_ops(ops)
    mono64 = [s for s in specs if s.interval.monotone and not s.interval.exact]
    out = []
    if mono64:
        names = " ".join(s.op.name for s in mono64)
        out += ["@njit(**_JIT)",
                "def _iv_monotone64(op, alo, ahi):",
                f'    """{names}: monotone, computed in float64 at the bounds (NaN outside the',
                '    domain), rounded outward to float32 + WIDEN_ULPS."""',
                "    if alo != alo or ahi != ahi:",
                "        return NAN, NAN",
                "    lo, hi = np.float64(alo), np.float64(ahi)",
                "    rl, rh = np.nan, np.nan"]
        for i, s in enumerate(mono64):
            out.append(f"    {'if' if i == 0 else 'elif'} op == {s.op.name}:")
            dom = _py_domain(s.interval, "lo", "hi")
            if dom:
                out += [f"        if {dom}:", "            return NAN, NAN"]
            fl, fh = (_fill(s.numba, {"a": v, "b": v, "c": v}) for v in ("lo", "hi"))
            if s.interval.monotone == "decreasing":
                fl, fh = fh, fl
            out.append(f"        rl, rh = {fl}, {fh}")
        out += ["    return _lo32(rl, _WIDEN), _hi32(rh, _WIDEN)", "", ""]
    out += ["@njit(**_JIT)",
            "def _iv(op, alo, ahi, blo, bhi, clo, chi):",
            '    """One interval op on scalars: (lo, hi, choice), hottest first (OpSpec.rank). VAR_* / CONST /',
            "    INSTANCE_INDEX are the caller's (they read the box and the parameter pool). An op of no case",
            '    (validate() rejects such tapes) gets the NaN interval: it may be anything."""',
            "    ch = _CH_BOTH"]
    names = {n: n for n in IV_NAMES}
    for i, s in enumerate(specs):
        iv = s.interval
        out.append(f"    {'if' if i == 0 else 'elif'} op == {s.op.name}:")
        if iv.monotone and iv.exact:
            fl, fh = (_fill(s.numba, {"a": v, "b": v, "c": v}) for v in ("alo", "ahi"))
            if iv.monotone == "decreasing":
                fl, fh = fh, fl
            out.append(f"        lo, hi = {fl}, {fh}")
        elif iv.monotone:
            out.append(f"        lo, hi = _iv_monotone64({s.op.name}, alo, ahi)")
        elif iv.chooses:
            out.append(f"        return {_fill(iv.numba, names)}")
        else:
            out.append(f"        lo, hi = {_fill(iv.numba, names)}")
    out += ["    else:",
            "        lo, hi = NAN, NAN",
            "    if lo != lo or hi != hi:",
            "        return NAN, NAN, ch",
            "    return lo, hi, ch"]
    return "\n".join(out)


# ----------------------------------------------------------------------------- WGSL
def _wgsl_float(x: float) -> str:
    return repr(float(x))


def _wgsl_groups(specs: list[OpSpec], case) -> list[str]:
    """Range branches of at most GROUP ops by number (op <= OP_<last>), hottest first inside."""
    chunks = _chunks(specs, GROUP)
    rank = {s.op: i for i, s in enumerate(specs)}
    out = []
    for i, chunk in enumerate(chunks):
        indent = "    " if len(chunks) == 1 else "        "
        if len(chunks) > 1:
            last = chunk[-1].op.name
            out.append(f"    if (op <= OP_{last}) {{" if i == 0 else
                       (f"    }} else if (op <= OP_{last}) {{" if i < len(chunks) - 1 else "    } else {"))
        for s in sorted(chunk, key=lambda s: rank[s.op]):
            out += [indent + line for line in case(s)]
    if len(chunks) > 1:
        out.append("    }")
    return out


def wgsl_arith(ops: dict[Op, OpSpec] | None = None) -> str:
    """shaders/interpreter.wgsl's block: ``unary()`` and ``binary()`` (ternary ops in binary())."""
    specs = [s for s in arith_ops(ops) if not s.wgsl_walk]
    out = ["// the arithmetic ops' cases (OpSpec.wgsl), range branches by number, hottest first inside;",
           "// ops of OpSpec.wgsl_walk (MIN, MAX: materials; MOD: sub-steps) are run_tape's and packed.wgsl's",
           "fn unary(op: u32, va: f32) -> f32 {"]
    vals = {"a": "va", "b": "vb", "c": "vc"}
    out += _wgsl_groups([s for s in specs if s.op_class is OpClass.UNARY],
                        lambda s: [f"if (op == OP_{s.op.name}) {{ return {_fill(s.wgsl, vals)}; }}"])
    out += ["    return unknown_op();", "}", "",
            "fn binary(op: u32, va: f32, vb: f32, vc: f32) -> f32 {"]
    out += _wgsl_groups([s for s in specs if s.op_class is not OpClass.UNARY],
                        lambda s: [f"if (op == OP_{s.op.name}) {{ return {_fill(s.wgsl, vals)}; }}"])
    out += ["    return unknown_op();", "}"]
    return "\n".join(out)


def _wgsl_monotone(s: OpSpec) -> list[str]:
    iv = s.interval
    fl, fh = (_fill(s.wgsl, {"a": v, "b": v, "c": v}) for v in ("lo", "hi"))
    if iv.monotone == "decreasing":
        fl, fh = fh, fl
    if iv.exact:
        return [f"if (op == OP_{s.op.name}) {{ return iv({fl}, {fh}); }}"]
    out = [f"if (op == OP_{s.op.name}) {{"]
    tests = []
    if iv.domain[0] != -math.inf:
        tests.append(f"lo < {_wgsl_float(iv.domain[0])}")
    if iv.domain[1] != math.inf:
        tests.append(f"hi > {_wgsl_float(iv.domain[1])}")
    if tests:
        out.append(f"    if ({' || '.join(tests)}) {{ return iv_nan(); }}")
    lo_clamp, hi_clamp = iv.wgsl_range
    if lo_clamp is None and hi_clamp is None:
        out.append(f"    return wide({fl}, {fh});")
    else:
        out.append(f"    let w = wide({fl}, {fh});")
        lo = "w.lo" if lo_clamp is None else f"max(w.lo, {lo_clamp})"
        hi = "w.hi" if hi_clamp is None else f"min(w.hi, {hi_clamp})"
        out.append(f"    return iv({lo}, {hi});")
    out.append("}")
    return out


def wgsl_intervals(ops: dict[Op, OpSpec] | None = None) -> str:
    """shaders/prune.wgsl's block: ``iv_unary()`` and ``iv_binary()`` (ternary ops in iv_binary())."""
    specs = arith_ops(ops)
    unary = [s for s in specs if s.op_class is OpClass.UNARY]
    rest = [s for s in specs if s.op_class is not OpClass.UNARY]
    uvals = dict(zip(IV_NAMES, ("lo", "hi", "lo", "hi", "lo", "hi")))
    bvals = {n: n for n in IV_NAMES}
    out = ["// the arithmetic ops' intervals (OpSpec.interval), hottest first",
           "fn iv_unary(op: u32, lo: f32, hi: f32) -> Iv {"]
    for s in unary:
        if s.interval.takes_nan:
            out.append(f"    if (op == OP_{s.op.name}) {{ return {_fill(s.interval.wgsl, uvals)}; }}")
    out += ["    if (is_nan(lo)) {",
            "        return iv_nan();   // (WGSL's min / max of a NaN are unspecified: never reached with one)",
            "    }"]
    for s in unary:
        if s.interval.takes_nan:
            continue
        lines = _wgsl_monotone(s) if s.interval.monotone else \
            [f"if (op == OP_{s.op.name}) {{ return {_fill(s.interval.wgsl, uvals)}; }}"]
        out += ["    " + line for line in lines]
    out += ["    return iv_nan();", "}", "",
            "fn iv_binary(op: u32, alo: f32, ahi: f32, blo: f32, bhi: f32, clo: f32, chi: f32) -> Iv {"]
    own = [s for s in rest if s.interval.takes_nan]
    for s in own:
        out.append(f"    if (op == OP_{s.op.name}) {{ return {_fill(s.interval.wgsl, bvals)}; }}")
    out += ["    if (is_nan(alo) || is_nan(blo)) {", "        return iv_nan();", "    }"]
    for s in rest:
        if not s.interval.takes_nan:
            out.append(f"    if (op == OP_{s.op.name}) {{ return {_fill(s.interval.wgsl, bvals)}; }}")
    out += ["    return iv_nan();", "}"]
    return "\n".join(out)


# ----------------------------------------------------------------------------- the blocks
# (path from the repository root, block name) -> its generator
BLOCKS = {("runtime/twin_ops.py", "arith"): numba_arith,
          ("runtime/interval_kernels.py", "intervals"): numba_intervals,
          ("shaders/interpreter.wgsl", "arith"): wgsl_arith,
          ("shaders/prune.wgsl", "intervals"): wgsl_intervals}


def block_markers(path: str, name: str) -> tuple[str, str]:
    c = "//" if path.endswith(".wgsl") else "#"
    return (f"{c} ---- BEGIN GENERATED {name} by taperay.runtime.op_codegen from runtime/opcodes.py: do not edit ----",
            f"{c} ---- END GENERATED {name} ----")


def with_block(text: str, path: str, name: str, body: str) -> str:
    """``text`` (the source at ``path``) with its block ``name`` replaced by ``body``."""
    begin, end = block_markers(path, name)
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < i:
        raise ValueError(f"{path}: no generated block {name!r} ({begin!r} ... {end!r})")
    return text[:i] + begin + "\n" + body + "\n" + text[j:]


def generated_blocks(ops: dict[Op, OpSpec] | None = None) -> dict[tuple[str, str], str]:
    """(path, block name) -> the block's body generated from ``ops`` (the table by default)."""
    return {key: gen(ops) for key, gen in BLOCKS.items()}
