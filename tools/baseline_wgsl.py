"""BENCHMARK-ONLY: a tape written out as specialised straight-line WGSL (the "compiled" baseline).

``taperay bench gpu`` compares the fixed tape interpreter with what a code-generating renderer
would do: write each scene out as its own code, with every parameter a literal the compiler can
fold, registers as locals and no instruction fetch. This module only produces text; it never
creates a shader module (``tools/bench_baseline.py`` does, for this baseline alone — the walkers
never compile per scene).

The written-out scene is a replacement for the interpreter's ``run_tape`` (``shaders/interpreter.wgsl``:
``fn run_tape(pin: vec3<f32>) -> Eval``): ``module_source(tape, kernel_file)`` is the GPU walker's
own module text for that kernel file (``runtime.gpu``'s concatenation of the committed shaders)
with ``run_tape`` swapped for the written-out function, so the written-out ``eval_points``,
``march``, ``light``, ``slice`` ... are the walker's kernels, line for line, around a different
scene function, and bind the walker's buffers. The written-out code calls the interpreter's
self-contained scalar and shape functions (``len3``, ``sd_box``, ``qrot_conj``, ``fmod_start``,
``poly_edge_acc``, ...) with literal arguments; its own helpers (``_HELPERS``: literal-parameter
capsule / torus, ...) are the Numba twin's formulas (``runtime/cpu.py``) in the twin's order of
operations, so it computes the twin's float32 results. An arithmetic op is written out as its
table entry says (``OpSpec.wgsl``, runtime/opcodes.py).
Straight-line means: arithmetic, shapes (polygon edges unrolled, vertices as literals), point ops,
combine ops, culls (as nested ``if`` blocks, or evaluated unconditionally with ``culls=False``)
and materials; an instance list (``INSTANCES`` ... ``REPEAT_END``) as its shared body written out
once as a function, and its BVH as nested ``if`` blocks over literal box distances, each leaf a
call with that instance's rigid transform and scale as literals (the interpreter's walk, unrolled).
Regular pattern loops (``REPEAT_LINEAR`` / ``POLAR`` / ``GRID``) are not written out; such tapes
raise ``TaperayError``. The written-out function never counts ``iters`` (it has no loop over records),
so the render kernels' per-dispatch budget never splits its march.
"""
from __future__ import annotations

import math

import numpy as np

from taperay.runtime.opcodes import OPS, Op, OpClass
from taperay.runtime.tape import Tape, TaperayError

__all__ = ["RUN_TAPE", "scene_function", "module_source", "splice"]

RUN_TAPE = "fn run_tape(pin: vec3<f32>) -> Eval {"   # the interpreter function the baseline replaces

_PATTERNS = {Op.REPEAT_LINEAR, Op.REPEAT_POLAR, Op.REPEAT_GRID, Op.REPEAT_END, Op.INSTANCES}

# the twin's scalar helpers (runtime/cpu.py) the interpreter has no self-contained function for
_HELPERS = """
// MOD: C's fmod by the interpreter's fmod_start and fmod_step, then Python's sign rule
fn bl_mod(a: f32, b: f32) -> f32 {
    let fs = fmod_start(a, b);
    if (!fs.steps) {
        return mod_value(fs.r, b);
    }
    var st = FmodStep(fs.ax, false, 0.0);
    while (!st.done) {
        st = fmod_step(st.r, fs.y, fs.ey, a, b);
    }
    return st.value;
}

fn bl_capsule(x: f32, y: f32, z: f32, ax: f32, ay: f32, az: f32, bx: f32, by: f32, bz: f32, r: f32) -> f32 {
    let pax = x - ax;
    let pay = y - ay;
    let paz = z - az;
    let bax = bx - ax;
    let bay = by - ay;
    let baz = bz - az;
    let bb = bax * bax + bay * bay + baz * baz;
    var h = 0.0;
    if (bb > 0.0) {
        h = pmin(pmax((pax * bax + pay * bay + paz * baz) / bb, 0.0), 1.0);
    }
    return len3(pax - bax * h, pay - bay * h, paz - baz * h) - r;
}

fn bl_torus(x: f32, y: f32, z: f32, big_r: f32, r: f32) -> f32 {
    let qx = len2(x, y) - big_r;
    return sqrt(qx * qx + z * z) - r;
}

fn bl_mirror(p: vec4<f32>, nx: f32, ny: f32, nz: f32, d: f32) -> vec4<f32> {
    let dp = p.x * nx + p.y * ny + p.z * nz;
    if (dp < d) {
        let k = 2.0 * (dp - d);
        return vec4<f32>(p.x - k * nx, p.y - k * ny, p.z - k * nz, p.w);
    }
    return p;
}

// an instance-list body's point conj(q) (p - t) q / s, scale * s (the interpreter's instance_point)
fn bl_instance_point(p: vec4<f32>, q: vec4<f32>, t: vec3<f32>, s: f32) -> vec4<f32> {
    let v = qrot_conj(q, p.xyz - t);
    return vec4<f32>(v.x / s, v.y / s, v.z / s, p.w * s);
}

// smin(x, y) = min(x, y) - h*h*k/4, h = max(k - |x - y|, 0) / k; times the sign sg
fn bl_smooth(x: f32, y: f32, k: f32, sg: f32) -> f32 {
    let h = pmax(k - abs(x - y), 0.0) / k;
    return sg * (nmin(x, y) - h * h * k * 0.25);
}
"""


def _lit(v) -> str:
    """A float32 as a WGSL literal whose value is exactly that float32."""
    f = float(np.float32(v))
    if math.isinf(f):
        return "inf()" if f > 0 else "(-inf())"
    text = repr(f)   # the shortest decimal of the (exact) float64 holding the float32
    return f"f32({text})" if f >= 0 else f"f32(({text}))"


def _lits(values) -> str:
    return ", ".join(_lit(v) for v in np.atleast_1d(values))


def _box_distance(lo, hi, point: str = "p") -> str:
    """The signed distance * scale from ``point`` (a vec4: position, scale) to the box [lo, hi],
    centre and half extents folded in float32 exactly as the interpreter forms them
    ((lo + hi) * 0.5, (hi - lo) * 0.5)."""
    lo, hi = np.asarray(lo, np.float32), np.asarray(hi, np.float32)
    c = (lo + hi) * np.float32(0.5)
    h = (hi - lo) * np.float32(0.5)
    q = point
    return (f"sd_box({q}.x - {_lit(c[0])}, {q}.y - {_lit(c[1])}, {q}.z - {_lit(c[2])}, "
            f"{_lit(h[0])}, {_lit(h[1])}, {_lit(h[2])}) * {q}.w")


class _Writer:
    """The records ``[start, stop)`` of a tape as the lines of one WGSL function body; an instance
    list's body becomes a function of its own (appended to ``functions``), called per instance."""

    def __init__(self, tape: Tape, culls: bool, functions: list[str], index: str = "0.0"):
        self.tape, self.culls = tape, culls
        self.cols = tape.as_columns().tolist()
        self.functions = functions
        self.index = index        # INSTANCE_INDEX: 0 outside an instance list, its argument inside
        self.lines: list[str] = []
        self.depth = 0            # point-stack depth
        self.max_depth = 0
        self.open_culls: list[int] = []   # jump targets of the open cull blocks
        self.indent = 0                   # BVH blocks open
        self.uses_poly = self.uses_bvh = False

    def emit(self, text: str):
        self.lines.append("    " * (1 + len(self.open_culls) + self.indent) + text)

    def function(self, header: str, prologue: str, start: int, stop: int, result: int) -> str:
        """``header`` (``fn ...(...) -> Eval {``), ``prologue`` (defines ``var p``), the records
        written out with their locals, and ``return Eval(r<result>, m<result>)``."""
        body = self.write(start, stop)
        decl = [f"    var r{i} = 0.0;\n    var m{i} = 0u;" for i in range(self.tape.n_regs)]
        decl += [f"    var s{d} = vec4<f32>(0.0);" for d in range(self.max_depth)]
        if self.uses_poly:
            decl += ["    var pq = vec2<f32>(0.0);", "    var pr = 0.0;"]
        if self.uses_bvh:
            decl += ["    var bb = 0.0;"]
        return "\n".join([header, "    " + prologue, *decl, *body, f"    return Eval(r{result}, m{result});", "}"])

    def prm(self, off: int, k: int) -> list[str]:
        return [_lit(v) for v in self.tape.params[off:off + k]]

    def poly(self, off: int, nv: int, x: str, y: str) -> str:
        """The polygon at params[off:off + 2 nv], its edges unrolled into ``pq``; returns the
        signed distance expression."""
        v = self.tape.params[off:off + 2 * nv].reshape(nv, 2)
        vx, vy = _lit(v[0, 0]), _lit(v[0, 1])
        self.emit(f"pq = vec2<f32>(({x} - {vx}) * ({x} - {vx}) + ({y} - {vy}) * ({y} - {vy}), 1.0);")
        for i in range(nv):
            j = i - 1 if i else nv - 1
            self.emit(f"pq = poly_edge_acc(pq, {x}, {y}, {_lit(v[i, 0])}, {_lit(v[i, 1])}, "
                      f"{_lit(v[j, 0])}, {_lit(v[j, 1])});")
        self.uses_poly = True
        return "pq.y * sqrt(pq.x)"

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
            return "bl_capsule(p.x, p.y, p.z, {}, {}, {}, {}, {}, {}, {})".format(*P(off, 7))
        if op is Op.TORUS:
            return "bl_torus(p.x, p.y, p.z, {}, {})".format(*P(off, 2))
        if op is Op.ELLIPSOID:
            return "sd_ellipsoid(p.x, p.y, p.z, {}, {}, {})".format(*P(off, 3))
        if op is Op.PLANE:
            nx, ny, nz, d = P(off, 4)
            return f"p.x * {nx} + p.y * {ny} + p.z * {nz} - {d}"
        if op is Op.EXTRUDE_POLY:
            return f"cap2({self.poly(off + 1, a, 'p.x', 'p.y')}, abs(p.z) - {P(off, 1)[0]})"
        if op is Op.REVOLVE_POLY:
            self.emit("pr = len2(p.x, p.y);")
            return self.poly(off, a, "pr", "p.z")
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
            self.emit("p = bl_mirror(p, {}, {}, {}, {});".format(*P(off, 4)))
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
            self.emit(f"m{dst} = {m}; r{dst} = bl_smooth({x}, {y}, {k}, {sg});")

    def write(self, start: int, stop: int) -> list[str]:
        i = start
        while i < stop:
            op_, dst, a, b, c, off, aux, jump = self.cols[i]
            while self.open_culls and self.open_culls[-1] == i:
                self.open_culls.pop()
                self.emit("}")
            op = Op(op_)
            if op is Op.INSTANCES:
                self.instances(i, aux, a, off, jump)
                i = jump + 1
                continue
            if op in _PATTERNS:
                raise TaperayError(f"{self.tape.source or 'tape'}: record {i}: {op.name}: the straight-line "
                                   "baseline does not write out pattern loops")
            if op in (Op.VAR_X, Op.VAR_Y, Op.VAR_Z):
                self.emit(f"r{dst} = p.{'xyz'[op - Op.VAR_X]}; m{dst} = 0u;")
            elif op is Op.CONST:
                self.emit(f"r{dst} = {self.prm(off, 1)[0]}; m{dst} = 0u;")
            elif op is Op.INSTANCE_INDEX:
                self.emit(f"r{dst} = {self.index}; m{dst} = 0u;")
            elif OPS[op].wgsl is not None:      # arithmetic: the table's expression
                value = OPS[op].wgsl.format(a=f"r{a}", b=f"r{b}", c=f"r{c}")
                mat = f"select(m{a}, m{b}, r{b} {'<' if op is Op.MIN else '>'} r{a})" \
                    if op in (Op.MIN, Op.MAX) else f"m{a}"
                self.emit(f"m{dst} = {mat}; r{dst} = {value};")
            elif OPS[op].op_class is OpClass.SHAPE:
                self.emit(f"r{dst} = ({self.shape(op, off, a)}) * p.w; m{dst} = {aux}u;")
            elif OPS[op].op_class is OpClass.POINT:
                self.point(op, off)
            elif OPS[op].op_class is OpClass.COMBINE:
                self.combine(op, dst, a, b, off)
            elif op is Op.CULL_BOX:
                self.cull(i, dst, a, off, aux, jump)
            elif op is Op.FIELD_RESULT:
                self.emit(f"r{dst} = r{a} * p.w; m{dst} = {aux}u;")
            else:
                raise TaperayError(f"{self.tape.source or 'tape'}: record {i}: {op.name} is not written out")
            i += 1
        while self.open_culls:
            self.open_culls.pop()
            self.emit("}")
        return self.lines

    def instances(self, i: int, first: int, count: int, off: int, end: int):
        """INSTANCES at record ``i`` (BVH nodes ``first .. first + count - 1``, parameters at
        ``off``, REPEAT_END at ``end``): the body as ``bl_instances_<i>(p, instance index)``, the
        BVH as nested ``if`` blocks over box distances against the running minimum and U' (the
        interpreter's walk: a subtree whose box is no nearer than the minimum, or farther than U',
        is skipped; U' from the interpreter's instances_reach over the uploaded parameters), each
        leaf a call with its placement as literals, unless its local point's distance to the
        child's box rules it out too; the minimum of max(body, leaf box, child box) lands in
        REPEAT_END's register."""
        _, dst, a = self.cols[end][:3]
        name = f"bl_instances_{i}"
        body = _Writer(self.tape, self.culls, self.functions, index="ii")
        self.functions.append(body.function(f"fn {name}(p_in: vec4<f32>, ii: f32) -> Eval {{", "var p = p_in;",
                                            i + 1, end, a))
        self.uses_bvh = True
        acc, mat, reach = f"acc{i}", f"accm{i}", f"reach{i}"
        self.emit(f"var {acc} = inf();")
        self.emit(f"var {mat} = 0u;")
        self.emit(f"let {reach} = instances_reach({off}u, p);")
        child_box = _box_distance(self.tape.params[off:off + 3], self.tape.params[off + 3:off + 6], "lp")
        nodes = self.tape.bvh
        place = self.tape.instances

        def node(k: int):
            nd = nodes[k]
            self.emit(f"bb = {_box_distance(nd['lo'], nd['hi'])};")
            self.emit(f"if (!(bb >= {acc}) && !(bb > {reach})) {{")
            self.indent += 1
            leaf = int(nd["instance"])
            if leaf >= 0:
                q, t, s = (_lits(place[leaf][f]) for f in ("q", "t", "s"))
                self.emit(f"let lp = bl_instance_point(p, vec4<f32>({q}), vec3<f32>({t}), {s});")
                self.emit(f"let bl = pmax(bb, {child_box});")
                self.emit(f"if (!(bl >= {acc}) && !(bl > {reach})) {{")
                self.emit(f"    let e = {name}(lp, {_lit(leaf)});")
                self.emit("    let v = pmax(e.d, bl);")
                self.emit(f"    if (v < {acc}) {{ {acc} = v; {mat} = e.mat; }}")
                self.emit("}")
            else:
                child = k + 1
                while child < int(nd["skip"]):
                    node(child)
                    child = int(nodes[child]["skip"])
            self.indent -= 1
            self.emit("}")

        k = first
        while k < first + count:
            node(k)
            k = int(nodes[k]["skip"])
        self.emit(f"r{dst} = {acc}; m{dst} = {mat};")

    def cull(self, i: int, dst: int, a: int, off: int, aux: int, jump: int):
        box = self.prm(off, 7)
        lo_hi = self.tape.params[off:off + 6]
        self.emit(f"r{dst} = {_box_distance(lo_hi[:3], lo_hi[3:])}; m{dst} = {aux}u;")
        if not self.culls:
            return
        if self.open_culls and jump > self.open_culls[-1]:
            raise TaperayError(f"{self.tape.source or 'tape'}: record {i}: cull blocks overlap; "
                               "the baseline writes out nested culls only")
        self.emit(f"if (!(r{dst} >= r{a} + {box[6]})) {{")
        self.open_culls.append(jump)


def scene_function(tape: Tape, culls: bool = True) -> str:
    """The helpers and ``fn run_tape(pin: vec3<f32>) -> Eval`` evaluating ``tape`` written out
    (the interpreter's ``run_tape`` contract: distance and material at ``pin``), after the
    functions of its instance-list bodies."""
    functions: list[str] = []
    main = _Writer(tape, culls, functions).function(RUN_TAPE, "var p = vec4<f32>(pin, 1.0);", 0, len(tape), 0)
    return "\n".join([_HELPERS, f"// {tape.source or 'tape'}: {len(tape)} records written out by "
                       "tools/baseline_wgsl.py", *functions, main]) + "\n"


def module_source(tape: Tape, kernel_file: str, culls: bool = True) -> str:
    """The GPU walker's module text for ``kernel_file`` (``kernels_points.wgsl``,
    ``kernels_render.wgsl``) with the interpreter's ``run_tape`` replaced by ``scene_function``:
    the same kernels, bindings and helpers, the tape written out."""
    return splice(scene_function(tape, culls), kernel_file)


def splice(scene: str, kernel_file: str) -> str:
    """``module_source`` from a ``scene_function`` text already written (one text, several files)."""
    from taperay.runtime import gpu_device
    from taperay.runtime.opcodes import REG_CAPS
    src = gpu_device._shader_text(kernel_file, REG_CAPS[0])   # the register file goes unused
    start = src.find("\n" + RUN_TAPE)
    if start < 0:
        raise TaperayError(f"shaders/interpreter.wgsl has no `{RUN_TAPE}` for the written-out baseline to replace")
    end = src.index("\n}\n", start + 1) + 3
    return src[:start + 1] + scene + src[end:]
