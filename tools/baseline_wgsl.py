"""BENCHMARK-ONLY: a tape written out as specialised straight-line WGSL (the "compiled" baseline).

``taperay bench gpu`` compares the fixed tape interpreter with what a code-generating renderer
would do: write each scene out as its own kernel, with every parameter a literal the compiler can
fold, registers as locals and no instruction fetch. This module only produces text; it never
creates a shader module (``tools/bench*`` do, for this baseline alone — the walkers never compile
per scene).

The kernel, ``baseline_eval``, has the contract of the interpreter's ``eval_points`` (the same
bind group: ``points`` in, ``out_f`` distances and ``out_u`` material ids out, ``U.n_items``
points) and is appended to the interpreter's own prelude, so it calls the very helpers the
interpreter uses (``sd_box``, ``cap2``, ``qrot_conj``, ``nmin``, ...) and computes the same float32
results in the same order. Straight-line means: arithmetic, shapes, point ops, combine ops, culls
(as nested ``if`` blocks, or evaluated unconditionally with ``culls=False``) and materials. Pattern
loops (``REPEAT_*``, ``INSTANCES``) are not written out; such tapes raise ``TaperayError``.
Extruded / revolved profiles read their vertices from ``params`` (as a generated kernel would read
a constant table).
"""
from __future__ import annotations

import math

import numpy as np

from taperay.runtime.opcodes import REG_CAPS, Op
from taperay.runtime.tape import Tape, TaperayError

__all__ = ["ENTRY", "baseline_wgsl", "module_source"]

ENTRY = "baseline_eval"

_UNARY = {
    Op.NEG: "-{a}", Op.ABS: "abs({a})", Op.RECIP: "1.0 / {a}", Op.SQRT: "sqrt({a})",
    Op.SQUARE: "{a} * {a}", Op.FLOOR: "floor({a})", Op.CEIL: "ceil({a})", Op.ROUND: "round_away({a})",
    Op.SIN: "sin({a})", Op.COS: "cos({a})", Op.TAN: "tan({a})", Op.ASIN: "asin({a})",
    Op.ACOS: "acos({a})", Op.ATAN: "atan({a})", Op.EXP: "exp({a})", Op.LN: "log({a})",
    Op.NOT: "select(0.0, 1.0, {a} == 0.0)", Op.COPY: "{a}",
}
_BINARY = {
    Op.ADD: "{a} + {b}", Op.SUB: "{a} - {b}", Op.MUL: "{a} * {b}", Op.DIV: "{a} / {b}",
    Op.ATAN2: "atan2({a}, {b})", Op.AND: "select({b}, {a}, {a} == 0.0)",
    Op.OR: "select({b}, {a}, {a} != 0.0)",
    Op.RAND: "rand_bits(bitcast<u32>({a}), bitcast<u32>({b}))",
    Op.MOD: "mod_euclid({a}, {b})",
    Op.COMPARE: "compare({a}, {b})",
}
_PATTERNS = {Op.REPEAT_LINEAR, Op.REPEAT_POLAR, Op.REPEAT_GRID, Op.REPEAT_END, Op.INSTANCES}

# two helpers the interpreter writes inline inside its `arith` switch
_HELPERS = """
fn mod_euclid(a: f32, b: f32) -> f32 {
    let r = fmod_exact(a, b);
    return select(r, r + abs(b), r < 0.0);
}

fn compare(a: f32, b: f32) -> f32 {
    if (a < b) {
        return -1.0;
    }
    if (a > b) {
        return 1.0;
    }
    if (is_nan(a) || is_nan(b)) {
        return a + b;
    }
    return 0.0;
}
"""


def _lit(v) -> str:
    """A float32 as a WGSL literal whose value is exactly that float32."""
    f = float(np.float32(v))
    if math.isinf(f):
        return "inf()" if f > 0 else "(-inf())"
    text = repr(f)   # the shortest decimal of the (exact) float64 holding the float32
    return f"f32({text})" if f >= 0 else f"f32(({text}))"


class _Writer:
    def __init__(self, tape: Tape, culls: bool):
        self.tape, self.culls = tape, culls
        self.lines: list[str] = []
        self.depth = 0            # point-stack depth
        self.max_depth = 0
        self.open_culls: list[int] = []   # jump targets of the open cull blocks

    def emit(self, text: str):
        self.lines.append("    " * (1 + len(self.open_culls)) + text)

    def prm(self, off: int, k: int) -> list[str]:
        return [_lit(v) for v in self.tape.params[off:off + k]]

    def shape(self, op: Op, off: int, a: int) -> str:
        P = self.prm
        if op is Op.SPHERE:
            return f"len3(p.x, p.y, p.z) - {P(off, 1)[0]}"
        if op is Op.BOX:
            return "sd_box(p.x, p.y, p.z, {}, {}, {})".format(*P(off, 3))
        if op is Op.ROUND_BOX:
            hx, hy, hz, r = P(off, 4)
            return f"sd_box(p.x, p.y, p.z, {hx} - {r}, {hy} - {r}, {hz} - {r}) - {r}"
        if op is Op.CYLINDER:
            r, h = P(off, 2)
            return f"cap2(len2(p.x, p.y) - {r}, abs(p.z) - {h})"
        if op is Op.CAPPED_CONE:
            return "sd_capped_cone(p.x, p.y, p.z, {}, {}, {})".format(*P(off, 3))
        if op is Op.CAPSULE:
            return f"sd_capsule(p.x, p.y, p.z, {off}u)"
        if op is Op.TORUS:
            big, r = P(off, 2)
            return f"sd_torus_q(len2(p.x, p.y) - {big}, p.z, {r})"
        if op is Op.ELLIPSOID:
            return "sd_ellipsoid(p.x, p.y, p.z, {}, {}, {})".format(*P(off, 3))
        if op is Op.PLANE:
            nx, ny, nz, d = P(off, 4)
            return f"p.x * {nx} + p.y * {ny} + p.z * {nz} - {d}"
        if op is Op.EXTRUDE_POLY:
            return f"cap2(sd_poly({off + 1}u, {a}u, p.x, p.y), abs(p.z) - {P(off, 1)[0]})"
        if op is Op.REVOLVE_POLY:
            return f"sd_poly({off}u, {a}u, len2(p.x, p.y), p.z)"
        raise AssertionError(op)

    def point(self, op: Op, off: int):
        P = self.prm
        if op is Op.PUSH:
            self.emit(f"s{self.depth} = p;")
            self.depth += 1
            self.max_depth = max(self.max_depth, self.depth)
        elif op is Op.POP:
            self.depth -= 1
            self.emit(f"p = s{self.depth};")
        elif op is Op.TRANSLATE:
            tx, ty, tz = P(off, 3)
            self.emit(f"p = vec4<f32>(p.x - {tx}, p.y - {ty}, p.z - {tz}, p.w);")
        elif op is Op.ELONGATE:
            tx, ty, tz = P(off, 3)
            self.emit(f"p = vec4<f32>(p.x - pmin(pmax(p.x, -{tx}), {tx}), p.y - pmin(pmax(p.y, -{ty}), {ty}), "
                      f"p.z - pmin(pmax(p.z, -{tz}), {tz}), p.w);")
        elif op is Op.ROTATE:
            self.emit("p = vec4<f32>(qrot_conj(vec4<f32>({}, {}, {}, {}), p.xyz), p.w);".format(*P(off, 4)))
        elif op is Op.SCALE:
            s = P(off, 1)[0]
            self.emit(f"p = vec4<f32>(p.x / {s}, p.y / {s}, p.z / {s}, p.w * {s});")
        elif op is Op.MIRROR:
            nx, ny, nz, d = P(off, 4)
            self.emit(f"p = mirror_point(p, vec3<f32>({nx}, {ny}, {nz}), {d});")
        else:
            raise AssertionError(op)

    def combine(self, op: Op, dst: int, a: int, b: int, off: int):
        va, vb, ma, mb = f"r{a}", f"r{b}", f"m{a}", f"m{b}"
        if op in (Op.OFFSET, Op.SHELL):
            v = va if op is Op.OFFSET else f"abs({va})"
            self.emit(f"m{dst} = {ma}; r{dst} = {v} - {self.prm(off, 1)[0]};")
            return
        if op is Op.DIFFERENCE:
            self.emit(f"m{dst} = {ma}; r{dst} = nmax({va}, -{vb});")
            return
        mat_smaller, mat_larger = f"select({ma}, {mb}, {vb} < {va})", f"select({ma}, {mb}, {vb} > {va})"
        if op is Op.UNION:
            self.emit(f"m{dst} = {mat_smaller}; r{dst} = nmin({va}, {vb});")
        elif op is Op.INTERSECT:
            self.emit(f"m{dst} = {mat_larger}; r{dst} = nmax({va}, {vb});")
        elif op is Op.XOR:
            self.emit(f"m{dst} = {mat_smaller}; r{dst} = nmax(nmin({va}, {vb}), -nmax({va}, {vb}));")
        else:
            k = self.prm(off, 1)[0]
            x, y, sg, m = {Op.SMOOTH_UNION: (va, vb, "1.0", mat_smaller),
                           Op.SMOOTH_INTERSECT: (f"-{va}", f"-{vb}", "-1.0", mat_larger),
                           Op.SMOOTH_DIFFERENCE: (f"-{va}", vb, "-1.0", ma)}[op]
            self.emit(f"m{dst} = {m}; r{dst} = smooth_min_signed({x}, {y}, {k}, {sg});")

    def write(self) -> list[str]:
        cols = self.tape.as_columns().tolist()
        for i, (op_, dst, a, b, c, off, aux, jump) in enumerate(cols):
            while self.open_culls and self.open_culls[-1] == i:
                self.open_culls.pop()
                self.emit("}")
            op = Op(op_)
            if op in _PATTERNS:
                raise TaperayError(f"{self.tape.source or 'tape'}: record {i}: {op.name}: the straight-line "
                                   "baseline does not write out pattern loops")
            if op in (Op.VAR_X, Op.VAR_Y, Op.VAR_Z):
                self.emit(f"r{dst} = p.{'xyz'[op - Op.VAR_X]}; m{dst} = 0u;")
            elif op is Op.CONST:
                self.emit(f"r{dst} = {self.prm(off, 1)[0]}; m{dst} = 0u;")
            elif op is Op.INSTANCE_INDEX:     # outside any pattern loop: 0
                self.emit(f"r{dst} = 0.0; m{dst} = 0u;")
            elif op in (Op.MIN, Op.MAX):
                fn, cmp = ("nmin", "<") if op is Op.MIN else ("nmax", ">")
                self.emit(f"m{dst} = select(m{a}, m{b}, r{b} {cmp} r{a}); r{dst} = {fn}(r{a}, r{b});")
            elif op in _UNARY:
                self.emit(f"m{dst} = m{a}; r{dst} = {_UNARY[op].format(a=f'r{a}')};")
            elif op in _BINARY:
                self.emit(f"m{dst} = m{a}; r{dst} = {_BINARY[op].format(a=f'r{a}', b=f'r{b}')};")
            elif op is Op.MIX:
                self.emit(f"m{dst} = m{a}; r{dst} = r{a} + (r{b} - r{a}) * r{c};")
            elif Op.SPHERE <= op <= Op.REVOLVE_POLY:
                self.emit(f"r{dst} = ({self.shape(op, off, a)}) * p.w; m{dst} = {aux}u;")
            elif Op.PUSH <= op <= Op.ELONGATE:
                self.point(op, off)
            elif Op.UNION <= op <= Op.SHELL:
                self.combine(op, dst, a, b, off)
            elif op is Op.CULL_BOX:
                self.cull(i, dst, a, off, aux, jump)
            elif op is Op.SET_MATERIAL:
                self.emit(f"r{dst} = r{a}; m{dst} = {aux}u;")
            else:
                raise TaperayError(f"{self.tape.source or 'tape'}: record {i}: {op.name} is not written out")
        while self.open_culls:
            self.open_culls.pop()
            self.emit("}")
        return self.lines

    def cull(self, i: int, dst: int, a: int, off: int, aux: int, jump: int):
        x0, y0, z0, x1, y1, z1, m = (float(v) for v in self.tape.params[off:off + 7])
        box = self.prm(off, 7)
        c = [_lit(np.float32(np.float32(u) + np.float32(v)) * np.float32(0.5)) for u, v in ((x0, x1), (y0, y1), (z0, z1))]
        h = [_lit(np.float32(np.float32(v) - np.float32(u)) * np.float32(0.5)) for u, v in ((x0, x1), (y0, y1), (z0, z1))]
        self.emit(f"r{dst} = sd_box(p.x - {c[0]}, p.y - {c[1]}, p.z - {c[2]}, {h[0]}, {h[1]}, {h[2]}) * p.w; "
                  f"m{dst} = {aux}u;")
        if not self.culls:
            return
        if self.open_culls and jump > self.open_culls[-1]:
            raise TaperayError(f"{self.tape.source or 'tape'}: record {i}: cull blocks overlap; "
                               "the baseline writes out nested culls only")
        self.emit(f"if (!(r{dst} >= r{a} + {box[6]})) {{")
        self.open_culls.append(jump)


def baseline_wgsl(tape: Tape, culls: bool = True, entry: str = ENTRY) -> str:
    """The kernel ``entry`` evaluating ``tape`` written out (append it to ``module_source``'s
    prelude; ``module_source`` does both)."""
    w = _Writer(tape, culls)
    body = w.write()
    decl = [f"    var r{i} = 0.0;\n    var m{i} = 0u;" for i in range(tape.n_regs)]
    decl += [f"    var s{d} = vec4<f32>(0.0);" for d in range(w.max_depth)]
    return "\n".join([
        f"// {tape.source or 'tape'}: {len(tape)} records written out by tools/baseline_wgsl.py",
        _HELPERS,
        "fn sd_torus_q(qx: f32, z: f32, r: f32) -> f32 {\n    return sqrt(qx * qx + z * z) - r;\n}\n",
        "fn mirror_point(p: vec4<f32>, n: vec3<f32>, d: f32) -> vec4<f32> {",
        "    let dp = p.x * n.x + p.y * n.y + p.z * n.z;",
        "    if (dp < d) {",
        "        let k = 2.0 * (dp - d);",
        "        return vec4<f32>(p.x - k * n.x, p.y - k * n.y, p.z - k * n.z, p.w);",
        "    }",
        "    return p;",
        "}\n",
        "fn smooth_min_signed(x: f32, y: f32, k: f32, sg: f32) -> f32 {",
        "    let h = pmax(k - abs(x - y), 0.0) / k;",
        "    return sg * (nmin(x, y) - h * h * k * 0.25);",
        "}\n",
        "@compute @workgroup_size(WG)",
        f"fn {entry}(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,",
        "            @builtin(num_workgroups) nwg: vec3<u32>) {",
        "    let i = flat_index(wid, lid, nwg);",
        "    if (i >= U.n_items) {",
        "        return;",
        "    }",
        "    var p = vec4<f32>(points[3u * i], points[3u * i + 1u], points[3u * i + 2u], 1.0);",
        *decl,
        *body,
        "    out_f[i] = r0;",
        "    out_u[i] = m0;",
        "}",
    ]) + "\n"


def module_source(tape: Tape, culls: bool = True) -> str:
    """A whole shader module: the interpreter's prelude (the committed shader files the GPU
    walker concatenates, with the smallest register variant) followed by ``baseline_wgsl``."""
    from taperay.runtime import gpu
    from taperay.runtime.wgsl_header import regcap_name
    names = (*gpu.PRELUDE_BEFORE_REGCAP, regcap_name(REG_CAPS[0]), *gpu.PRELUDE_AFTER_REGCAP)
    prelude = "\n".join((gpu.SHADER_DIR / n).read_text() for n in names)
    return prelude + "\n" + baseline_wgsl(tape, culls)
