"""Lowering of scene tapes to arithmetic: primitives, rigid transforms and CSG rewritten as
arithmetic records closed by FIELD_RESULT, so that interval pruning (``runtime.pruning``, the
GPU's march cells) applies to ordinary scenes, not only to imported programs.

``lower(tape)`` walks the tape once, keeping the current point as three SSA nodes of x, y, z:
the point ops (PUSH / POP / TRANSLATE / ROTATE as its 3x3 matrix / SCALE / MIRROR / ELONGATE)
become arithmetic on them, and the scale is a number (without patterns it is the same at every
point). Each primitive's formula (the twin's, ``runtime.cpu``) is written on that point, times
the scale, closed by FIELD_RESULT with the primitive's material; a sphere reads the point from
before the rotations that directly precede it. UNION and INTERSECT stay (they prune as MIN /
MAX); DIFFERENCE is ``max(a, FIELD_RESULT(-b))`` with a's material (when a has one material);
OFFSET and SHELL are SUB / ABS (which carry their first operand's material); the smooth ops are
the twin's formula (SMOOTH_DIFFERENCE, too, for an ``a`` of one material). A DIFFERENCE or
SMOOTH_DIFFERENCE of an ``a`` of several materials is written so that SUB carries a's material
at each point: ``a - min(a + b, 0)`` (plus the blend). A convex polygon (EXTRUDE_POLY,
REVOLVE_POLY) is the twin's distance to its nearest edge outside and the largest distance to an
edge's line inside, chosen by that distance's sign. A REPEAT_* loop of at most ``UNROLL_MAX``
copies (all loops around it together) is written out: its body walked once a copy, with the
copy's point and INSTANCE_INDEX, and the copies' union. The program is hash-consed and
register-allocated by ``runtime.program``.

What changes: the flattener's CULL_BOX records are dropped. A culled subtree counts as
``max(v, box distance)``, which differs from ``v`` only inside the solid, where the box is
nearer than the surface; the lowered field is the plain union of the scene's primitives (the
same zero set, the same sign everywhere, the same values outside every solid up to float32
rounding of the rewritten formulas). A pattern's record bounds the copies it does not evaluate
from below; its written-out union has their values, so it reads at least the pattern's value
outside the copies. Tapes with instance lists, XOR, capped cones, ellipsoids, polygons that are
not convex or patterns of more copies are not lowered (``NotLowerable`` says which record).
"""
from __future__ import annotations

import numpy as np

from .opcodes import OPS, Family, Op
from .program import Program, program_tape
from .tape import Tape, TaperayError, param_count, pattern_counts, quat_matrices

__all__ = ["lower", "first_unlowered", "NotLowerable", "LOWERED_OPS"]


class NotLowerable(TaperayError):
    """The tape holds a record the lowering does not rewrite (``record`` its index)."""

    def __init__(self, reason: str, record: int | None = None):
        self.reason, self.record = reason, record
        super().__init__(f"record {record}: {reason}" if record is not None else reason)


LOWERED_OPS = frozenset({o for o in Op if OPS[o].family is Family.ARITH} | {
    Op.FIELD_RESULT, Op.SPHERE, Op.BOX, Op.ROUND_BOX, Op.CYLINDER, Op.TORUS, Op.PLANE, Op.CAPSULE,
    Op.PUSH, Op.POP, Op.TRANSLATE, Op.ROTATE, Op.SCALE, Op.MIRROR, Op.ELONGATE, Op.CULL_BOX,
    Op.UNION, Op.INTERSECT, Op.DIFFERENCE, Op.OFFSET, Op.SHELL, Op.SMOOTH_UNION, Op.SMOOTH_INTERSECT,
    Op.SMOOTH_DIFFERENCE, Op.REPEAT_LINEAR, Op.REPEAT_POLAR, Op.REPEAT_GRID, Op.REPEAT_END, Op.EXTRUDE_POLY,
    Op.REVOLVE_POLY})
_TWO_PI = np.float32(2 * np.pi)   # the twin's TWO_PI
UNROLL_MAX = 64          # copies of a pattern (all its loops together) written out; more: NotLowerable


def first_unlowered(tape: Tape) -> int | None:
    """The index of the first record whose op ``lower`` does not rewrite, or None (a scan of
    the op column: a DIFFERENCE of several materials is found by ``lower`` itself)."""
    bad = np.flatnonzero(~np.isin(tape.instrs["op"], np.array(sorted(LOWERED_OPS), np.uint32)))
    return int(bad[0]) if len(bad) else None


_CULLED = -1   # register value of a CULL_BOX: only the INTERSECT that closes its subtree reads it


class _Writer:
    """SSA nodes of one program, with the folding of identities (x - 0, x * 1)."""

    def __init__(self):
        self.prog = Program()

    def const(self, v) -> int:
        v32 = np.float32(v)
        return self.prog.node(Op.CONST, (), float(v32), int(v32.view(np.uint32)))

    def is_const(self, n: int, v: float) -> bool:
        return self.prog.ops[n] == Op.CONST and self.prog.consts[n] == np.float32(v)

    def op(self, op: Op, *args: int, aux: int = 0) -> int:
        return self.prog.node(op, tuple(args), aux=aux)

    def sub(self, a: int, b: int) -> int:
        return a if self.is_const(b, 0) else self.op(Op.SUB, a, b)

    def subc(self, a: int, v: float) -> int:
        return self.sub(a, self.const(v))

    def mulc(self, a: int, v: float) -> int:
        return a if np.float32(v) == 1 else self.op(Op.MUL, a, self.const(v))

    def add(self, *xs: int) -> int:
        total = xs[0]
        for x in xs[1:]:
            total = self.op(Op.ADD, total, x)
        return total

    def length(self, *xs: int) -> int:
        return self.op(Op.SQRT, self.add(*(self.op(Op.SQUARE, x) for x in xs)))

    def max0(self, a: int) -> int:
        return self.op(Op.MAX, a, self.const(0))

    def min0(self, a: int) -> int:
        return self.op(Op.MIN, a, self.const(0))

    def dot(self, p: tuple[int, ...], n) -> int:
        """p . n for a constant n, zero components left out (0 when n is 0)."""
        terms = [self.mulc(pi, ni) for pi, ni in zip(p, n) if np.float32(ni) != 0]
        return self.add(*terms) if terms else self.const(0)


def _shape(w: _Writer, op: Op, p: tuple[int, int, int], prm: np.ndarray) -> int:
    """The unscaled value of one primitive of LOWERED_OPS at p (the twin's formula)."""
    x, y, z = p

    def box(hx, hy, hz):
        q = [w.subc(w.op(Op.ABS, c), h) for c, h in zip(p, (hx, hy, hz))]
        outside = w.length(*(w.max0(c) for c in q))
        return w.add(outside, w.min0(w.op(Op.MAX, q[0], w.op(Op.MAX, q[1], q[2]))))

    def cap2(dx, dy):
        return w.add(w.min0(w.op(Op.MAX, dx, dy)), w.length(w.max0(dx), w.max0(dy)))

    if op == Op.SPHERE:
        return w.subc(w.length(x, y, z), prm[0])
    if op in (Op.BOX, Op.ROUND_BOX):
        r = prm[3] if op == Op.ROUND_BOX else np.float32(0)
        return w.subc(box(*(np.float32(h - r) for h in prm[:3])), r)
    if op == Op.CYLINDER:
        return cap2(w.subc(w.length(x, y), prm[0]), w.subc(w.op(Op.ABS, z), prm[1]))
    if op == Op.TORUS:
        return w.subc(w.length(w.subc(w.length(x, y), prm[0]), z), prm[1])
    if op == Op.PLANE:
        return w.subc(w.dot(p, prm[:3]), prm[3])
    if op == Op.CAPSULE:
        a, b, r = prm[:3], prm[3:6], prm[6]
        pa = [w.subc(c, v) for c, v in zip(p, a)]
        ba = (b - a).astype(np.float32)
        bb = np.float32(ba @ ba)
        if bb > 0:
            h = w.op(Op.DIV, w.dot(tuple(pa), ba), w.const(bb))
            h = w.op(Op.MIN, w.max0(h), w.const(1))
            pa = [w.sub(c, w.op(Op.MUL, h, w.const(v))) if v != 0 else c for c, v in zip(pa, ba)]
        return w.subc(w.length(*pa), r)
    if op == Op.EXTRUDE_POLY:
        return cap2(_convex_polygon(w, x, y, prm[1:].reshape(-1, 2)), w.subc(w.op(Op.ABS, z), prm[0]))
    if op == Op.REVOLVE_POLY:
        return _convex_polygon(w, w.length(x, y), z, prm.reshape(-1, 2))
    raise AssertionError(op)


def _convex_polygon(w: _Writer, x: int, y: int, xy: np.ndarray) -> int:
    """The signed distance to a convex polygon (vertices ``xy``, (n, 2) float32, either turn) at
    (x, y): outside, the distance to the nearest edge (the twin's, sqrt of the least squared
    distance to a segment); inside, the largest signed distance to an edge's line (the same
    number: inside a convex polygon the nearest edge's line is the nearest boundary), chosen by
    that largest line distance's sign. NotLowerable for a polygon that is not convex."""
    n = len(xy)
    e = np.roll(xy, -1, axis=0).astype(np.float64) - xy
    turns = e[:, 0] * np.roll(e[:, 1], -1) - e[:, 1] * np.roll(e[:, 0], -1)
    if n < 3 or not np.any(turns) or not (np.all(turns >= 0) or np.all(turns <= 0)):
        raise NotLowerable("a polygon that is not convex")
    outward = 1.0 if turns.sum() > 0 else -1.0       # (counter-clockwise: the right normal points out)
    d2 = lines = None
    for i in range(n):
        vi, ei = xy[i], (xy[(i + 1) % n] - xy[i]).astype(np.float32)
        ee = np.float32(ei @ ei)
        if ee == 0:
            continue
        wx, wy = w.subc(x, vi[0]), w.subc(y, vi[1])
        t = w.op(Op.MIN, w.max0(w.op(Op.DIV, w.dot((wx, wy), ei), w.const(ee))), w.const(1))
        bx = w.sub(wx, w.op(Op.MUL, t, w.const(ei[0]))) if ei[0] != 0 else wx
        by = w.sub(wy, w.op(Op.MUL, t, w.const(ei[1]))) if ei[1] != 0 else wy
        sq = w.add(w.op(Op.SQUARE, bx), w.op(Op.SQUARE, by))
        d2 = sq if d2 is None else w.op(Op.MIN, d2, sq)
        nrm = outward * np.array([ei[1], -ei[0]], np.float64) / np.sqrt(float(ee))
        line = w.dot((wx, wy), nrm)
        lines = line if lines is None else w.op(Op.MAX, lines, line)
    outside = w.op(Op.MIN, w.max0(w.op(Op.COMPARE, lines, w.const(0))), w.const(1))    # 1 outside, else 0
    return w.add(w.min0(lines), w.op(Op.MUL, outside, w.op(Op.SQRT, d2)))


def _pattern_copies(op: Op, prm: np.ndarray) -> list[tuple]:
    """The copies of a REPEAT_* record, as the twin places them: (INSTANCE_INDEX, the translation
    subtracted from the point (linear, grid), the (cos, sin) of the rotation about z (polar))."""
    if op == Op.REPEAT_LINEAR:
        return [(k, np.float32(k) * prm[:3], None) for k in range(int(prm[3]))]
    if op == Op.REPEAT_POLAR:
        n = int(prm[0])
        turns = [_TWO_PI * np.float32(k) / np.float32(n) for k in range(n)]
        return [(k, None, (np.cos(th), np.sin(th))) for k, th in enumerate(turns)]
    nx, ny, nz = (int(c) for c in prm[3:6])
    return [(i + nx * (j + ny * k), np.array([i, j, k], np.float32) * prm[:3], None)
            for k in range(nz) for j in range(ny) for i in range(nx)]


def _point_op(w: _Writer, op: Op, point: tuple[int, int, int], scale: float, prm: np.ndarray):
    """The point and scale after one point op (the twin's rule, as arithmetic)."""
    if op == Op.TRANSLATE:
        return tuple(w.subc(c, t) for c, t in zip(point, prm)), scale
    if op == Op.ROTATE:
        # p -> conj(q) p q: the transpose of q's rotation, in float64
        inverse = quat_matrices(np.asarray(prm, np.float64)[None])[0].T
        return tuple(w.dot(point, row.astype(np.float32)) for row in inverse), scale
    if op == Op.SCALE:
        return tuple(w.op(Op.DIV, c, w.const(prm[0])) for c in point), scale * float(prm[0])
    if op == Op.ELONGATE:
        return tuple(w.sub(c, w.op(Op.MIN, w.op(Op.MAX, c, w.const(-h)), w.const(h)))
                     for c, h in zip(point, prm)), scale
    # MIRROR: p - 2 min(p.n - d, 0) n (the child's half n.p >= d mirrored)
    k = w.min0(w.subc(w.dot(point, prm[:3]), prm[3]))
    return tuple(w.sub(c, w.op(Op.MUL, k, w.const(2 * ni))) if np.float32(ni) != 0 else c
                 for c, ni in zip(point, prm[:3])), scale


def _smooth(w: _Writer, op: Op, a: int, b: int, k) -> int:
    """The twin's smooth ops: sg * (min(x, y) - h*h*k/4), h = max(k - |x - y|, 0) / k, with
    (x, y, sg) = (a, b, 1) (union), (-a, -b, -1) (intersection), (-a, b, -1) (difference); MIN
    gives the material of the smaller x / y (a on ties), SUB and NEG carry it."""
    x = a if op == Op.SMOOTH_UNION else w.op(Op.NEG, a)
    y = w.op(Op.NEG, b) if op == Op.SMOOTH_INTERSECT else b
    h = w.op(Op.DIV, w.max0(w.op(Op.SUB, w.const(k), w.op(Op.ABS, w.op(Op.SUB, x, y)))), w.const(k))
    t = w.mulc(w.op(Op.MUL, w.op(Op.MUL, h, h), w.const(k)), 0.25)
    v = w.op(Op.SUB, w.op(Op.MIN, x, y), t)
    return v if op == Op.SMOOTH_UNION else w.op(Op.NEG, v)


def _smooth_cut(w: _Writer, a: int, b: int, k) -> int:
    """The twin's smooth difference -smin(-a, b, k) = max(a, -b) + h*h*k/4, h = max(k - |a + b|,
    0) / k, written so that a's material, whichever it is at the point, is carried (a - min(a +
    b, 0) is max(a, -b), plus t as minus -t: SUB carries its first operand's material, and the
    program may swap a commutative op's operands): for an ``a`` of several materials."""
    ab = w.op(Op.ADD, a, b)
    h = w.op(Op.DIV, w.max0(w.op(Op.SUB, w.const(k), w.op(Op.ABS, ab))), w.const(k))
    t = w.mulc(w.op(Op.MUL, w.op(Op.MUL, h, h), w.const(k)), 0.25)
    return w.op(Op.SUB, w.op(Op.SUB, a, w.min0(ab)), w.op(Op.NEG, t))


def lower(tape: Tape) -> Tape:
    """``tape``'s field as an arithmetic tape of scene fields (see the module docstring), with the
    same materials, bounds, instance count and source; not validated here (the walkers validate
    every tape before they run it). ``NotLowerable`` when a record has no arithmetic form here."""
    bad = first_unlowered(tape)
    if bad is not None:
        raise NotLowerable(f"{Op(int(tape.instrs['op'][bad])).name} has no arithmetic form here", bad)
    w = _Writer()
    ins, params = tape.instrs, tape.params
    var = (w.op(Op.VAR_X), w.op(Op.VAR_Y), w.op(Op.VAR_Z))
    point, scale = var, 1.0
    copy_index, copies_above = 0, 1       # the copy of the innermost written-out pattern; copies of those around
    # the point before the trailing run of ROTATEs: a sphere is the same after rotations about its
    # centre, so it reads this one (fewer records, intervals not widened by the rotation)
    unrotated = var
    stack: list[tuple] = []
    regs: dict[int, int] = {}
    mats: dict[int, frozenset] = {}       # node -> the materials its value may carry

    def read(i: int, r: int) -> int:
        if r not in regs or regs[r] == _CULLED:
            raise NotLowerable(f"{Op(int(ins['op'][i])).name} reads register {r}, which holds no lowered value", i)
        return regs[r]

    def closed(i: int, value: int, aux: int) -> int:
        n = w.op(Op.FIELD_RESULT, w.mulc(value, scale), aux=aux)
        mats[n] = frozenset([aux])
        return n

    def unrolled(i: int, op: Op, prm: np.ndarray) -> int:
        """A REPEAT_* loop written out: its body walked once a copy with the copy's point, the
        copies' union into the REPEAT_END's register; returns the record after the REPEAT_END."""
        nonlocal point, unrotated, copy_index, copies_above
        end = int(ins["jump"][i])
        count = int(np.prod(pattern_counts(op, prm).astype(np.int64)))
        if count * copies_above > UNROLL_MAX:     # (checked before the copies are listed: a grid may hold 10^6)
            raise NotLowerable(f"{op.name} of {count * copies_above} copies (written out up to {UNROLL_MAX})", i)
        copies = _pattern_copies(op, prm)
        outer = (point, unrotated, copy_index, copies_above)
        copies_above *= len(copies)
        union = None
        for index, offset, turn in copies:
            if turn is None:
                point = tuple(w.subc(c, o) for c, o in zip(outer[0], offset))
                unrotated = point
            else:
                cs, sn = turn
                x, y, z = outer[0]
                point, unrotated = (w.dot((x, y, z), (cs, sn, 0)), w.dot((x, y, z), (-sn, cs, 0)), z), outer[1]
            copy_index = index
            walk(i + 1, end)
            value = read(end, int(ins["a"][end]))
            if union is None:
                union = value
            else:
                joined = w.op(Op.UNION, union, value)
                mats[joined] = mats[union] | mats[value]
                union = joined
        point, unrotated, copy_index, copies_above = outer
        regs[int(ins["dst"][end])] = union
        return end + 1

    def walk(lo: int, hi: int) -> None:
        """Lower the records lo .. hi - 1."""
        nonlocal point, scale, unrotated
        i = lo
        while i < hi:
            op = Op(int(ins["op"][i]))
            dst, a, b, prm_at, aux = (int(ins[k][i]) for k in ("dst", "a", "b", "param", "aux"))
            spec = OPS[op]
            prm = params[prm_at:prm_at + param_count(spec, a)]
            fam = spec.family
            if fam is Family.ARITH:
                if op in (Op.VAR_X, Op.VAR_Y, Op.VAR_Z):
                    regs[dst] = point[op - Op.VAR_X]
                elif op == Op.CONST:
                    regs[dst] = w.const(prm[0])
                elif op == Op.INSTANCE_INDEX:
                    regs[dst] = w.const(copy_index)           # (the copy a written-out pattern is on)
                else:
                    regs[dst] = w.op(op, *(read(i, int(ins[f][i])) for f in spec.reads))
                mats[regs[dst]] = mats.get(regs[dst], frozenset([0]))
            elif op == Op.FIELD_RESULT:
                regs[dst] = closed(i, read(i, a), aux)
            elif fam is Family.SHAPE:
                try:
                    regs[dst] = closed(i, _shape(w, op, unrotated if op == Op.SPHERE else point, prm), aux)
                except NotLowerable as e:
                    raise NotLowerable(f"{op.name}: {e.reason}", i) from None
            elif fam is Family.PATTERN:
                i = unrolled(i, op, prm)
                continue
            elif op == Op.PUSH:
                stack.append((point, unrotated, scale))
            elif op == Op.POP:
                point, unrotated, scale = stack.pop()
            elif op in (Op.TRANSLATE, Op.ROTATE, Op.SCALE, Op.ELONGATE, Op.MIRROR):
                point, scale = _point_op(w, op, point, scale, prm)
                if op != Op.ROTATE:
                    unrotated = point
            elif op == Op.CULL_BOX:
                regs[dst] = _CULLED
            elif op == Op.INTERSECT and regs.get(b) == _CULLED:
                regs[dst] = read(i, a)                        # the subtree, without its cull box
            elif op in (Op.UNION, Op.INTERSECT):
                va, vb = read(i, a), read(i, b)
                regs[dst] = w.op(op, va, vb)
                mats[regs[dst]] = mats[va] | mats[vb]
            elif op == Op.DIFFERENCE:
                va, vb = read(i, a), read(i, b)
                if len(mats[va]) == 1:
                    cut = w.op(Op.FIELD_RESULT, w.op(Op.NEG, vb), aux=next(iter(mats[va])))
                    regs[dst] = w.op(Op.INTERSECT, va, cut)
                else:      # max(a, -b) as a - min(a + b, 0): SUB carries a's material, whichever it is
                    regs[dst] = w.op(Op.SUB, va, w.min0(w.op(Op.ADD, va, vb)))
                mats[regs[dst]] = mats[va]
            elif op in (Op.SMOOTH_UNION, Op.SMOOTH_INTERSECT, Op.SMOOTH_DIFFERENCE):
                va, vb = read(i, a), read(i, b)
                if op == Op.SMOOTH_DIFFERENCE and len(mats[va]) != 1:
                    regs[dst] = _smooth_cut(w, va, vb, prm[0])
                else:
                    if op == Op.SMOOTH_DIFFERENCE:
                        vb = w.op(Op.FIELD_RESULT, vb, aux=next(iter(mats[va])))   # (b's value, a's material)
                    regs[dst] = _smooth(w, op, va, vb, prm[0])
                mats[regs[dst]] = mats[va] if op == Op.SMOOTH_DIFFERENCE else mats[va] | mats[vb]
            elif op in (Op.OFFSET, Op.SHELL):
                va = read(i, a)
                regs[dst] = w.subc(va if op == Op.OFFSET else w.op(Op.ABS, va), prm[0])
                mats[regs[dst]] = mats[va]
            else:
                raise AssertionError(op)    # (first_unlowered lets only LOWERED_OPS through)
            i += 1

    walk(0, len(ins))
    root = read(len(ins) - 1, 0) if len(ins) else None
    if root is None:
        raise NotLowerable("an empty tape")
    # (not validated here: every walker validates a tape before it runs it)
    out = program_tape(w.prog, root, tape.source, materials=tape.materials, reorder=False, check=False)
    return Tape(out.instrs, out.params, tape.materials, out.n_regs, tape.bounds,
                instance_count=tape.instance_count, source=tape.source)
