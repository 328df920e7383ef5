"""The CPU twin op by op against independent float64 closed forms written here (not imported),
and every arithmetic op reading registers against the opcode table's float64 reference
(``OpSpec.reference``), so an op added to the table is graded here without an edit of this file.

Tolerance: |twin - reference| <= max(1e-5 |reference|, 1e-6): 1e-5 relative with an absolute floor
of 1e-6 near zero (float32 rounding of |p| ~ 2 alone is ~2e-7). References are evaluated on the
float32-rounded inputs. Tapes are built by hand with ``TapeBuilder`` (records + parameter pool).
"""
import math

import numpy as np
import pytest

from taperay.runtime.opcodes import OPS, Op, OpClass
from taperay.runtime.pruning import evaluate_pruned
from taperay.runtime.tape import INSTR_DTYPE, Tape, TapeError, material_array

RNG = np.random.default_rng(7)


class TapeBuilder:
    def __init__(self):
        self.rows, self.params = [], []

    def op(self, op, dst=0, a=0, b=0, c=0, params=(), aux=0, jump=0):
        off = len(self.params) if len(params) else 0
        self.params += [float(v) for v in params]
        self.rows.append([int(op), dst, a, b, c, off, aux, jump])
        return len(self.rows) - 1

    def tape(self, n_regs=None, bounds=((-2, -2, -2), (2, 2, 2))):
        n_regs = n_regs or 1 + max(max(r[1], r[2], r[3], r[4]) for r in self.rows)
        mats = material_array([(0.5, 0.5, 0.5)] * 8, 0.5)
        return Tape(np.array([tuple(r) for r in self.rows], INSTR_DTYPE),
                    np.array(self.params or [0.0], np.float32), mats, n_regs, np.array(bounds, np.float32))


def close(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    err = np.abs(got - ref)
    tol = np.maximum(1e-5 * np.abs(ref), 1e-6)
    bad = ~(err <= tol)
    assert not bad.any(), f"{bad.sum()} of {bad.size} off; worst at {np.argmax(np.where(bad, err, 0))}: " \
                          f"got {got[bad][:3]}, want {ref[bad][:3]}"


def shape_points(ref, n=3000, extent=2.0):
    """Random points around the shape: uniform, plus ones pulled onto / just off the surface."""
    p = RNG.uniform(-extent, extent, (n, 3))
    q = p.copy()
    for _ in range(4):   # move towards the zero set with numerical gradients of the reference
        e = 1e-6
        g = np.stack([(ref(q + e * np.eye(3)[i]) - ref(q - e * np.eye(3)[i])) / (2 * e) for i in range(3)], -1)
        gl = np.linalg.norm(g, axis=-1, keepdims=True)
        q = q - ref(q)[:, None] * g / np.where(gl > 0, gl, 1) ** 2
    q = q[np.all(np.isfinite(q), axis=1)]
    near = q[: n // 2] + RNG.normal(scale=1e-3, size=(len(q[: n // 2]), 3))
    return np.concatenate([p, q, near]).astype(np.float32)


# ----------------------------------------------------------------------------- references (float64)
def r_sphere(p, r):
    return np.linalg.norm(p, axis=-1) - r


def r_box(p, h):
    h = np.asarray(h, float)
    outside = np.linalg.norm(p - np.clip(p, -h, h), axis=-1)
    inside = np.min(h - np.abs(p), axis=-1)
    return np.where(np.all(np.abs(p) <= h, axis=-1), -inside, outside)


def r_seg2(q, a, b):
    ab = b - a
    t = np.clip(np.sum((q - a) * ab, -1) / max(np.dot(ab, ab), 1e-300), 0, 1)
    return np.linalg.norm(q - a - t[:, None] * ab, axis=-1)


def r_poly2(q, verts):
    """Signed distance to a closed polygon, inside by crossing-number parity."""
    v = np.asarray(verts, float)
    d = np.min([r_seg2(q, v[i], v[(i + 1) % len(v)]) for i in range(len(v))], axis=0)
    inside = np.zeros(len(q), bool)
    for i in range(len(v)):
        (x0, y0), (x1, y1) = v[i], v[(i + 1) % len(v)]
        with np.errstate(divide="ignore", invalid="ignore"):
            crosses = ((y0 > q[:, 1]) != (y1 > q[:, 1])) & \
                      (q[:, 0] < x0 + (q[:, 1] - y0) * (x1 - x0) / (y1 - y0))
        inside ^= crosses
    return np.where(inside, -d, d)


def rho_z(p):
    return np.stack([np.hypot(p[:, 0], p[:, 1]), p[:, 2]], -1)


def quat_matrix(q):
    w, x, y, z = q
    return np.array([[1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
                     [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
                     [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)]])


HEX = [(0.8 * math.cos(a), 0.8 * math.sin(a)) for a in np.arange(6) * math.pi / 3]
L_SHAPE = [(0, 0), (1.2, 0), (1.2, 0.4), (0.4, 0.4), (0.4, 1.1), (0, 1.1)]   # concave
PROFILE = [(0.3, -0.6), (0.9, -0.6), (0.9, -0.2), (0.5, 0.1), (0.9, 0.5), (0.3, 0.5)]  # (radius, z)

SHAPES = {
    "sphere": (Op.SPHERE, [0.9], 0, lambda p: r_sphere(p, 0.9)),
    "box": (Op.BOX, [0.7, 0.4, 1.1], 0, lambda p: r_box(p, [0.7, 0.4, 1.1])),
    "round_box": (Op.ROUND_BOX, [0.7, 0.5, 0.9, 0.15], 0, lambda p: r_box(p, [0.55, 0.35, 0.75]) - 0.15),
    "cylinder": (Op.CYLINDER, [0.6, 0.9], 0,
                 lambda p: _cap_profile(np.hypot(p[:, 0], p[:, 1]) - 0.6, np.abs(p[:, 2]) - 0.9)),
    "capped_cone": (Op.CAPPED_CONE, [0.8, 0.9, 0.3], 0,
                    lambda p: r_poly2(rho_z(p), [(-0.9, -0.8), (0.9, -0.8), (0.3, 0.8), (-0.3, 0.8)])),  # axial section
    "capsule": (Op.CAPSULE, [-0.5, 0.2, -0.4, 0.6, -0.1, 0.7, 0.35], 0,
                lambda p: _seg3(p, [-0.5, 0.2, -0.4], [0.6, -0.1, 0.7]) - 0.35),
    "torus": (Op.TORUS, [1.0, 0.3], 0, lambda p: np.hypot(np.hypot(p[:, 0], p[:, 1]) - 1.0, p[:, 2]) - 0.3),
    "ellipsoid": (Op.ELLIPSOID, [1.1, 0.6, 0.8], 0, lambda p: _ellipsoid(p, [1.1, 0.6, 0.8])),
    "plane": (Op.PLANE, [0.48, 0.6, 0.64, 0.3], 0, lambda p: p @ np.array([0.48, 0.6, 0.64]) - 0.3),
    "extrude_hex": (Op.EXTRUDE_POLY, [0.5, *np.ravel(HEX)], 6, lambda p: _extrude(p, HEX, 0.5)),
    "extrude_concave": (Op.EXTRUDE_POLY, [0.3, *np.ravel(L_SHAPE)], 6, lambda p: _extrude(p, L_SHAPE, 0.3)),
    "revolve": (Op.REVOLVE_POLY, list(np.ravel(PROFILE)), 6, lambda p: r_poly2(rho_z(p), PROFILE)),
}


def _cap_profile(dx, dy):
    """Distance to the region {dx <= 0, dy <= 0} (corner at the origin)."""
    outside = np.hypot(np.maximum(dx, 0), np.maximum(dy, 0))
    return np.where((dx <= 0) & (dy <= 0), np.maximum(dx, dy), outside)


def _seg3(p, a, b):
    a, b = np.asarray(a, float), np.asarray(b, float)
    t = np.clip((p - a) @ (b - a) / np.dot(b - a, b - a), 0, 1)
    return np.linalg.norm(p - a - t[:, None] * (b - a), axis=-1)


def _ellipsoid(p, r):
    r = np.asarray(r, float)
    k0 = np.linalg.norm(p / r, axis=-1)
    k1 = np.linalg.norm(p / r ** 2, axis=-1)
    return k0 * (k0 - 1) / k1


def _extrude(p, verts, h):
    return _cap_profile(r_poly2(p[:, :2], verts), np.abs(p[:, 2]) - h)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_shape_matches_closed_form(walker_cpu, name):
    op, prm, nverts, ref = SHAPES[name]
    tb = TapeBuilder()
    tb.op(op, 0, a=nverts, params=prm, aux=3)
    pts = shape_points(ref)
    d, m = walker_cpu.evaluate(tb.tape(), pts)
    close(d, ref(pts.astype(np.float64)))
    assert np.all(m == 3)


def test_the_near_surface_sampling_reaches_the_surface():
    pts = shape_points(SHAPES["capped_cone"][3])
    assert np.sum(np.abs(SHAPES["capped_cone"][3](pts.astype(np.float64))) < 1e-2) > 1000


# ----------------------------------------------------------------------------- point ops
def _child_box(tb, dst=0, aux=0):
    tb.op(Op.BOX, dst, params=[0.5, 0.3, 0.2], aux=aux)


BOXREF = lambda p: r_box(p, [0.5, 0.3, 0.2])   # noqa: E731
Q = np.array([0.8, 0.2, -0.4, 0.4]) / np.linalg.norm([0.8, 0.2, -0.4, 0.4])
N_MIRROR = np.array([0.6, 0.0, 0.8])

POINT_CASES = {
    "translate": ([(Op.TRANSLATE, [0.3, -0.2, 0.5])], lambda p: BOXREF(p - [0.3, -0.2, 0.5])),
    "rotate": ([(Op.ROTATE, Q)], lambda p: BOXREF(p @ quat_matrix(Q))),       # R^T p, row-wise
    "scale": ([(Op.SCALE, [1.7])], lambda p: BOXREF(p / 1.7) * 1.7),
    "mirror": ([(Op.MIRROR, [*N_MIRROR, 0.25])],
               lambda p: BOXREF(np.where((p @ N_MIRROR < 0.25)[:, None],
                                         p - 2 * (p @ N_MIRROR - 0.25)[:, None] * N_MIRROR, p))),
    "elongate": ([(Op.ELONGATE, [0.4, 0.0, 0.3])],
                 lambda p: BOXREF(p - np.clip(p, [-0.4, 0, -0.3], [0.4, 0, 0.3]))),
    "translate_rotate_scale": ([(Op.TRANSLATE, [0.1, 0.2, 0.3]), (Op.ROTATE, Q), (Op.SCALE, [0.6])],
                               lambda p: BOXREF(((p - [0.1, 0.2, 0.3]) @ quat_matrix(Q)) / 0.6) * 0.6),
}


@pytest.mark.parametrize("name", sorted(POINT_CASES))
def test_point_op_matches_closed_form(walker_cpu, name):
    ops, ref = POINT_CASES[name]
    tb = TapeBuilder()
    tb.op(Op.PUSH)
    for op, prm in ops:
        tb.op(op, params=prm)
    _child_box(tb)
    tb.op(Op.POP)
    tb.op(Op.SPHERE, 1, params=[0.25])          # after POP: p is the world point again
    tb.op(Op.UNION, 0, a=0, b=1)
    pts = RNG.uniform(-1.5, 1.5, (4000, 3)).astype(np.float32)
    d, _ = walker_cpu.evaluate(tb.tape(), pts)
    p64 = pts.astype(np.float64)
    close(d, np.minimum(ref(p64), r_sphere(p64, 0.25)))


# ----------------------------------------------------------------------------- combine ops
def _two_spheres(tb, op, k=None, mats=(1, 2)):
    tb.op(Op.SPHERE, 0, params=[0.8], aux=mats[0])
    tb.op(Op.PUSH)
    tb.op(Op.TRANSLATE, params=[0.0, 0.0, 0.9])
    tb.op(Op.SPHERE, 1, params=[0.6], aux=mats[1])
    tb.op(Op.POP)
    tb.op(op, 0, a=0, b=1, params=[] if k is None else [k])


def _spheres_ref(p):
    return r_sphere(p, 0.8), r_sphere(p - [0, 0, 0.9], 0.6)


def _smin(a, b, k):
    h = np.maximum(k - np.abs(a - b), 0) / k
    return np.minimum(a, b) - h * h * k / 4


COMBINE = {
    Op.UNION: (None, lambda a, b: np.minimum(a, b), "smaller"),
    Op.INTERSECT: (None, lambda a, b: np.maximum(a, b), "larger"),
    Op.DIFFERENCE: (None, lambda a, b: np.maximum(a, -b), "a"),
    Op.XOR: (None, lambda a, b: np.maximum(np.minimum(a, b), -np.maximum(a, b)), "smaller"),
    Op.SMOOTH_UNION: (0.4, lambda a, b: _smin(a, b, 0.4), "smaller"),
    Op.SMOOTH_INTERSECT: (0.4, lambda a, b: -_smin(-a, -b, 0.4), "larger"),
    Op.SMOOTH_DIFFERENCE: (0.4, lambda a, b: -_smin(-a, b, 0.4), "a"),
}


@pytest.mark.parametrize("op", list(COMBINE), ids=lambda o: o.name)
def test_combine_op_value_and_material(walker_cpu, op):
    k, ref, rule = COMBINE[op]
    tb = TapeBuilder()
    _two_spheres(tb, op, k)
    pts = RNG.uniform(-1.6, 1.6, (5000, 3)).astype(np.float32)
    d, m = walker_cpu.evaluate(tb.tape(), pts)
    a, b = _spheres_ref(pts.astype(np.float64))
    close(d, ref(a, b))
    sure = np.abs(a - b) > 1e-5            # away from ties, where float32 may order differently
    want = {"smaller": np.where(b < a, 2, 1), "larger": np.where(b > a, 2, 1), "a": np.ones_like(a)}[rule]
    assert np.array_equal(m[sure], want[sure])


def _zero_set_rz(f_rz, lo=(-0.05, -1.5), hi=(1.6, 2.2), step=2e-3):
    """Dense points of the zero set of an axisymmetric field given in (rho, z), by linear
    interpolation of sign changes along the lines of a fine grid."""
    r = np.arange(lo[0], hi[0], step)
    z = np.arange(lo[1], hi[1], step)
    R, Z = np.meshgrid(r, z, indexing="ij")
    F = f_rz(R, Z)
    out = []
    for axis in (0, 1):
        f0, f1 = (F[:-1], F[1:]) if axis == 0 else (F[:, :-1], F[:, 1:])
        r0, r1 = (R[:-1], R[1:]) if axis == 0 else (R[:, :-1], R[:, 1:])
        z0, z1 = (Z[:-1], Z[1:]) if axis == 0 else (Z[:, :-1], Z[:, 1:])
        s = (f0 < 0) != (f1 < 0)
        t = f0[s] / (f0[s] - f1[s])
        out.append(np.stack([r0[s] + t * (r1[s] - r0[s]), z0[s] + t * (z1[s] - z0[s])], -1))
    return np.concatenate(out), step


@pytest.mark.parametrize("op", [Op.SMOOTH_UNION, Op.SMOOTH_INTERSECT, Op.SMOOTH_DIFFERENCE], ids=lambda o: o.name)
def test_smooth_ops_never_overestimate_the_distance(walker_cpu, op):
    k, ref, _ = COMBINE[op]
    tb = TapeBuilder()
    _two_spheres(tb, op, k)

    def f_rz(rho, z):
        return ref(np.hypot(rho, z) - 0.8, np.hypot(rho, z - 0.9) - 0.6)

    zero, step = _zero_set_rz(f_rz)
    pts = RNG.uniform(-1.6, 1.6, (1500, 3)).astype(np.float32)
    d, _ = walker_cpu.evaluate(tb.tape(), pts)
    rz = rho_z(pts.astype(np.float64))
    dist = np.array([np.min(np.linalg.norm(zero - q, axis=1)) for q in rz])
    assert np.all(np.abs(d) <= dist + step)
    if op is Op.SMOOTH_UNION:
        a, b = _spheres_ref(pts.astype(np.float64))
        assert np.all(d <= np.minimum(a, b) + 1e-6)


def test_offset_shell_set_material(walker_cpu):
    tb = TapeBuilder()
    tb.op(Op.BOX, 0, params=[0.5, 0.6, 0.7], aux=2)
    tb.op(Op.OFFSET, 1, a=0, params=[0.1])
    tb.op(Op.SHELL, 2, a=0, params=[0.05])
    tb.op(Op.FIELD_RESULT, 3, a=2, aux=5)
    tb.op(Op.UNION, 0, a=1, b=3)
    pts = RNG.uniform(-1.2, 1.2, (4000, 3)).astype(np.float32)
    d, m = walker_cpu.evaluate(tb.tape(), pts)
    b = r_box(pts.astype(np.float64), [0.5, 0.6, 0.7])
    off, shell = b - 0.1, np.abs(b) - 0.05
    close(d, np.minimum(off, shell))
    sure = np.abs(off - shell) > 1e-5
    assert np.array_equal(m[sure], np.where(shell < off, 5, 2)[sure])


# ----------------------------------------------------------------------------- arithmetic
def _rand_ref(a, b):
    """The RAND hash written out with Python integers (32-bit wrapping)."""
    out = []
    for x, y in zip(np.asarray(a, np.float32).view(np.uint32), np.asarray(b, np.float32).view(np.uint32)):
        h = ((int(x) * 0x9E3779B1) ^ (int(y) + 0x7F4A7C15)) & 0xFFFFFFFF
        h = ((h ^ (h >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
        h = ((h ^ (h >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
        h ^= h >> 16
        out.append((h >> 8) / 2.0 ** 24)
    return np.array(out)


def _round_exact(a):
    """Round half away from zero on exact (float64) values of float32 inputs."""
    a = np.asarray(a, float)
    r = np.floor(np.abs(a))
    r = np.where(np.abs(a) - r >= 0.5, r + 1, r)
    return np.copysign(r, a)


UNARY = {
    Op.NEG: (lambda a: -a, (-3, 3)), Op.ABS: (np.abs, (-3, 3)), Op.RECIP: (lambda a: 1 / a, (0.2, 3)),
    Op.SQRT: (np.sqrt, (0, 9)), Op.SQUARE: (np.square, (-3, 3)), Op.FLOOR: (np.floor, (-3, 3)),
    Op.CEIL: (np.ceil, (-3, 3)), Op.ROUND: (_round_exact, (-3, 3)), Op.SIN: (np.sin, (-6, 6)),
    Op.COS: (np.cos, (-6, 6)), Op.TAN: (np.tan, (-1.4, 1.4)), Op.ASIN: (np.arcsin, (-1, 1)),
    Op.ACOS: (np.arccos, (-1, 1)), Op.ATAN: (np.arctan, (-5, 5)), Op.EXP: (np.exp, (-5, 5)),
    Op.LN: (np.log, (0.01, 9)), Op.NOT: (lambda a: (a == 0).astype(float), (-2, 2)),
    Op.COPY: (lambda a: a, (-3, 3)),
}
BINARY = {
    Op.ADD: np.add, Op.SUB: np.subtract, Op.MUL: np.multiply, Op.DIV: np.divide,
    Op.MIN: np.minimum, Op.MAX: np.maximum, Op.ATAN2: np.arctan2,
    Op.COMPARE: lambda a, b: np.where(a < b, -1.0, np.where(a > b, 1.0, np.where(a == b, 0.0, np.nan))),
    Op.MOD: lambda a, b: np.where(np.fmod(a, b) < 0, np.fmod(a, b) + np.abs(b), np.fmod(a, b)),
    Op.AND: lambda a, b: np.where(a == 0, a, b), Op.OR: lambda a, b: np.where(a != 0, a, b),
    Op.RAND: _rand_ref,
}


def _xyz_tape(ops):
    """reg1 = x, reg2 = y, reg3 = z, then ``ops`` (callables adding records), result in reg0."""
    tb = TapeBuilder()
    tb.op(Op.VAR_X, 1)
    tb.op(Op.VAR_Y, 2)
    tb.op(Op.VAR_Z, 3)
    ops(tb)
    return tb.tape()


def _specials(lo, hi):
    s = np.array([0.0, -0.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 0.49999997, -0.49999997, 1.0, -1.0], np.float32)
    return s[(s >= lo) & (s <= hi)]


@pytest.mark.parametrize("op", list(UNARY), ids=lambda o: o.name)
def test_unary_arith(walker_cpu, op):
    ref, (lo, hi) = UNARY[op]
    x = np.concatenate([RNG.uniform(lo, hi, 3000).astype(np.float32), _specials(lo, hi)])
    if lo < 0 < hi:
        x = np.concatenate([x, np.zeros(5, np.float32)])
    pts = np.stack([x, np.zeros_like(x), np.zeros_like(x)], -1)
    tape = _xyz_tape(lambda tb: tb.op(op, 0, a=1))
    d, _ = walker_cpu.evaluate(tape, pts)
    close(d, ref(x.astype(np.float64)))


@pytest.mark.parametrize("op", list(BINARY), ids=lambda o: o.name)
def test_binary_arith(walker_cpu, op):
    a = RNG.uniform(-3, 3, 3000).astype(np.float32)
    b = RNG.uniform(-3, 3, 3000).astype(np.float32)
    if op in (Op.DIV, Op.MOD):
        b = np.where(np.abs(b) < 0.1, 0.5, b).astype(np.float32)
    if op in (Op.AND, Op.OR, Op.COMPARE, Op.MIN, Op.MAX):       # zeros and ties
        a[:300] = 0
        b[300:600] = a[300:600]
    pts = np.stack([a, b, np.zeros_like(a)], -1)
    d, _ = walker_cpu.evaluate(_xyz_tape(lambda tb: tb.op(op, 0, a=1, b=2)), pts)
    if op is Op.RAND:
        assert np.array_equal(d.astype(np.float64), _rand_ref(a, b))
    else:
        close(d, BINARY[op](a.astype(np.float64), b.astype(np.float64)))


TABLE_OPS = [op for op, spec in OPS.items()
             if spec.op_class in (OpClass.UNARY, OpClass.BINARY, OpClass.TERNARY) and spec.reference is not None]


@pytest.mark.parametrize("op", TABLE_OPS, ids=lambda o: o.name)
def test_arith_op_against_the_table_reference(walker_cpu, op):
    """The twin's value of each arithmetic op on x, y, z in [-3, 3] times ``OpSpec.scale``
    (operands a, b, c): NaN where the table's float64 reference is NaN, elsewhere within 1e-5
    relative to max(|reference|, 1) (inputs are O(1): a cancellation is judged on their grid)."""
    spec = OPS[op]
    pts = (RNG.uniform(-3, 3, (3000, 3)) * spec.scale).astype(np.float32)
    d, _ = walker_cpu.evaluate(_xyz_tape(lambda tb: tb.op(op, 0, a=1, b=2, c=3)), pts)
    with np.errstate(all="ignore"):
        ref = np.asarray(spec.reference(*(pts[:, i].astype(np.float64) for i in range(len(spec.reads)))), float)
    nan = np.isnan(ref)
    assert np.isnan(d[nan]).all(), f"{op.name}: a number where the reference is NaN"
    got, want = d[~nan].astype(np.float64), ref[~nan]
    same_inf = np.isinf(want) & (got == want)
    err = np.where(same_inf, 0.0, np.abs(got - want))
    bad = ~(err <= 1e-5 * np.maximum(np.abs(want), 1.0))
    assert not bad.any(), f"{op.name}: {bad.sum()} of {bad.size} off, e.g. got {got[bad][:3]}, want {want[bad][:3]}"


def _random_float32_bits(n):
    return RNG.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)


def test_mod_is_fmods_rule_bit_for_bit(walker_cpu):
    """MOD against numpy's float32 fmod (+ |b| where negative) bit for bit, on random bit patterns
    of a and b: blocks whose every lane takes the twin's float64 path (|a| / |b| < 2^24, sorted to
    the front: close exponents, quotients on and one float next to integers, tape-like thirds) and
    mixed blocks that take fmod lane by lane (zeros, infinities, NaN, huge quotients)."""
    n = 1 << 16
    b = _random_float32_bits(6 * n)
    a = np.concatenate([
        (b[:n] * RNG.uniform(-3, 3, n)).astype(np.float32),                      # close exponents
        (b[n:2 * n] * RNG.integers(-2 ** 23, 2 ** 23, n)).astype(np.float32),    # integer quotients
        _random_float32_bits(4 * n)])
    a[n:2 * n:2] = np.nextafter(a[n:2 * n:2], np.float32(np.inf))                 # and just off them
    small_a = (RNG.integers(-60, 60, n) / 3).astype(np.float32)
    small_b = (RNG.integers(-9, 10, n) / 3).astype(np.float32)
    a, b = np.concatenate([small_a, a]), np.concatenate([small_b, b])
    with np.errstate(all="ignore"):
        fast = (np.abs(a.astype(np.float64)) / np.abs(b.astype(np.float64)) < 2 ** 24) & np.isfinite(b)
    order = np.argsort(~fast, kind="stable")
    a, b = a[order], b[order]
    assert fast.sum() > 4 * n and (~fast).sum() > n
    d, _ = walker_cpu.evaluate(_xyz_tape(lambda tb: tb.op(Op.MOD, 0, a=1, b=2)), np.stack([a, b, a], -1))
    with np.errstate(all="ignore"):
        r = np.fmod(a, b)
        ref = np.where(r < 0, (r + np.abs(b)).astype(np.float32), r)
    same = (d.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(d) & np.isnan(ref))
    assert same.all(), f"{(~same).sum()} lanes differ, first a={a[~same][0]!r} b={b[~same][0]!r}"


def test_records_writing_a_register_they_read_give_the_values_of_fresh_registers(walker_cpu):
    """The twin writes a record whose destination is one of its operands through a scratch row
    (runtime.twin_ops.scratch_row), and so does pruning's point interpreter. A random tape written in place over registers 1..5, reading 6 (the
    highest, so a scratch row that was a register would clobber it), gives bit for bit the values
    of the same program with a fresh register per record (SSA). The six registers are summed, so
    any clobbered one shows."""
    ops = [Op.ADD, Op.SUB, Op.MIN, Op.MAX, Op.ABS, Op.NEG, Op.MIX]   # (values stay finite)
    in_place, fresh = TapeBuilder(), TapeBuilder()
    for tb in (in_place, fresh):
        tb.op(Op.VAR_X, 1)
        tb.op(Op.VAR_Y, 2)
        tb.op(Op.VAR_Z, 3)
        for k in (4, 5, 6):
            tb.op(Op.ADD, k, a=k - 3, b=1 + k % 3)
    current = {r: r for r in range(1, 7)}       # the logical register -> its fresh register
    nxt = 7
    for _ in range(240):
        op = ops[RNG.integers(len(ops))]
        d = int(RNG.integers(1, 6))
        a, b, c = (int(v) for v in RNG.integers(1, 7, 3))
        a = d if RNG.random() < 0.6 else a
        in_place.op(op, d, a=a, b=b, c=c)
        fresh.op(op, nxt, a=current[a], b=current[b], c=current[c])
        current[d] = nxt
        nxt += 1
    for tb, regs in ((in_place, list(range(1, 7))), (fresh, [current[r] for r in range(1, 7)])):
        tb.op(Op.ADD, 0, a=regs[0], b=regs[5])
        for r in regs[1:5]:
            tb.op(Op.ADD, 0, a=0, b=r)
    pts = RNG.uniform(-2, 2, (5000, 3)).astype(np.float32)
    want, _ = walker_cpu.evaluate(fresh.tape(), pts)
    assert np.isfinite(want).mean() > 0.5
    for how, got in (("the twin's interpreter", walker_cpu.evaluate(in_place.tape(), pts)[0]),
                     ("pruning's point interpreter", evaluate_pruned(in_place.tape(), pts)[0])):
        same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
        assert same.all(), f"{how}: {(~same).sum()} of {len(pts)} points differ"


def test_mix_const_and_nan_rules(walker_cpu):
    a, b, c = (RNG.uniform(-2, 2, 2000).astype(np.float32) for _ in range(3))
    pts = np.stack([a, b, c], -1)
    d, _ = walker_cpu.evaluate(_xyz_tape(lambda tb: tb.op(Op.MIX, 0, a=1, b=2, c=3)), pts)
    close(d, a.astype(float) + (b.astype(float) - a) * c)

    def nan_ops(tb):
        tb.op(Op.CONST, 4, params=[-1.0])
        tb.op(Op.SQRT, 5, a=4)                 # NaN
        tb.op(Op.NOT, 6, a=5)                  # 0 (NaN is not 0)
        tb.op(Op.AND, 7, a=5, b=1)             # x (NaN is not 0)
        tb.op(Op.ADD, 0, a=6, b=7)
    pts = np.array([[0.5, 0, 0], [-2, 0, 0]], np.float32)
    d, _ = walker_cpu.evaluate(_xyz_tape(nan_ops), pts)
    close(d, [0.5, -2])
    tb = TapeBuilder()
    tb.op(Op.CONST, 1, params=[-1.0])
    tb.op(Op.SQRT, 2, a=1)
    tb.op(Op.VAR_X, 3)
    for o in (Op.COMPARE, Op.MIN, Op.MAX, Op.OR):
        tb.op(o, 0, a=2, b=3)
        assert np.isnan(walker_cpu.evaluate(tb.tape(), np.ones((1, 3), np.float32))[0][0]), o.name
        tb.rows.pop()


def test_compare_and_round_specials(walker_cpu):
    x = np.array([0.5, -0.5, 1.5, -1.5, 2.5, 0.49999997, -0.49999997, 2.4999998, -0.0], np.float32)
    d, _ = walker_cpu.evaluate(_xyz_tape(lambda tb: tb.op(Op.ROUND, 0, a=1)),
                               np.stack([x, 0 * x, 0 * x], -1))
    assert d.tolist() == [1.0, -1.0, 2.0, -2.0, 3.0, 0.0, -0.0, 2.0, -0.0]
    a = np.array([1, 2, 3, -np.inf], np.float32)
    b = np.array([2, 2, 1, -np.inf], np.float32)
    d, _ = walker_cpu.evaluate(_xyz_tape(lambda tb: tb.op(Op.COMPARE, 0, a=1, b=2)),
                               np.stack([a, b, np.zeros_like(a)], -1))
    assert d.tolist() == [-1.0, 0.0, 1.0, 0.0]


# ----------------------------------------------------------------------------- patterns
def _pattern_tape(op, prm, radius, body=None):
    tb = TapeBuilder()
    begin = tb.op(op, params=prm)
    if body:
        body(tb)
    elif op is Op.REPEAT_POLAR:            # the child sits at the bounding-sphere centre
        tb.op(Op.PUSH)
        tb.op(Op.TRANSLATE, params=prm[1:4])
        tb.op(Op.SPHERE, 1, params=[radius], aux=4)
        tb.op(Op.POP)
    else:
        tb.op(Op.SPHERE, 1, params=[radius], aux=4)
    end = tb.op(Op.REPEAT_END, 0, a=1, jump=begin)
    tb.rows[begin][7] = end
    return tb.tape()


def _centres(op, prm):
    if op is Op.REPEAT_LINEAR:
        return np.arange(int(prm[3]))[:, None] * np.array(prm[:3])
    if op is Op.REPEAT_POLAR:
        th = 2 * np.pi * np.arange(int(prm[0])) / int(prm[0])
        c = np.array(prm[1:4])
        return np.stack([np.cos(th) * c[0] - np.sin(th) * c[1], np.sin(th) * c[0] + np.cos(th) * c[1],
                         np.full_like(th, c[2])], -1)
    i, j, k = np.meshgrid(*(np.arange(int(n)) for n in prm[3:6]), indexing="ij")
    return np.stack([i.ravel() * prm[0], j.ravel() * prm[1], k.ravel() * prm[2]], -1)


PATTERNS = {   # (op, params for a sphere child of radius r that fits its cell, r, point box)
    "linear": (Op.REPEAT_LINEAR, [0.5, 0.2, 0.0, 7, 0.3], 0.3, ((-0.6, -0.5, -0.4), (3.6, 1.7, 0.4))),
    "polar": (Op.REPEAT_POLAR, [9, 1.2, 0.0, 0.1, 0.3], 0.3, ((-2, -2, -1), (2, 2, 1))),
    "polar_offcentre": (Op.REPEAT_POLAR, [5, 0.8, 0.9, 0.0, 0.35], 0.35, ((-2, -2, -1), (2, 2, 1))),
    "grid": (Op.REPEAT_GRID, [0.6, 0.5, 0.7, 4, 3, 2, 0.25, 0.25, 0.25], 0.25, ((-1, -1, -1), (2.8, 1.9, 1.6))),
    "grid_flat": (Op.REPEAT_GRID, [0.6, 0.5, 1.0, 5, 1, 1, 0.25, 0.25, 0.25], 0.25, ((-1, -1, -1), (3.4, 1, 1))),
}


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_pattern_equals_brute_force_where_the_child_fits(walker_cpu, name):
    op, prm, r, (lo, hi) = PATTERNS[name]
    tape = _pattern_tape(op, prm, r)
    pts = RNG.uniform(lo, hi, (6000, 3)).astype(np.float32)
    d, m = walker_cpu.evaluate(tape, pts)
    c = _centres(op, prm)
    brute = np.min(np.linalg.norm(pts.astype(float)[:, None] - c[None], axis=-1), axis=1) - r
    assert np.all(d <= brute + np.maximum(1e-5 * np.abs(brute), 1e-6))    # always a bound
    if op is Op.REPEAT_POLAR:
        near = np.ones(len(d), bool)           # a sphere child: the sector bound is exact
    else:                                      # exact within one spacing of the copies
        spacing = min(np.linalg.norm(prm[:3]) if op is Op.REPEAT_LINEAR else
                      min(abs(s) for s, n in zip(prm[:3], prm[3:6]) if n > 1), 10)
        near = brute < spacing - r
    assert near.sum() > 600
    close(d[near], brute[near])
    assert np.all(m == 4)


@pytest.mark.parametrize("name", ["linear", "grid", "polar"])
def test_pattern_is_a_bound_when_the_child_overflows_its_cell(walker_cpu, name):
    op, prm, r, (lo, hi) = PATTERNS[name]
    big = 2.2 * r                                   # overlapping copies
    prm = list(prm)
    if op is Op.REPEAT_LINEAR:
        prm[4] = big
    elif op is Op.REPEAT_GRID:
        prm[6:9] = [big] * 3
    else:
        prm[4] = big
    tape = _pattern_tape(op, prm, big)
    pts = RNG.uniform(lo, hi, (4000, 3)).astype(np.float32)
    d, _ = walker_cpu.evaluate(tape, pts)
    brute = np.min(np.linalg.norm(pts.astype(float)[:, None] - _centres(op, prm)[None], axis=-1), axis=1) - big
    assert np.all(d <= brute + np.maximum(1e-5 * np.abs(brute), 1e-6))
    assert np.mean(np.abs(d - brute) < 1e-5) > 0.25     # not vacuous: often still exact


def test_a_copy_counts_as_at_least_its_bound(walker_cpu):
    # a body far below its copies' bounds: each copy counts as max(body, bound), the pattern as the
    # smallest over the evaluated copies (nearest and neighbour), so the value is the distance
    # to the nearer of the two copies' slabs |x - 100 k| <= 10
    def body(tb):
        tb.op(Op.CONST, 1, params=[-1000.0])
    tape = _pattern_tape(Op.REPEAT_LINEAR, [100.0, 0.0, 0.0, 7, 10.0], 0.0, body)
    x = np.array([0.0, 5.0, 30.0, 149.0, 251.0, 620.0, 700.0, -50.0])
    got, _ = walker_cpu.evaluate(tape, np.stack([x, 0 * x, 0 * x], 1).astype(np.float32))
    nearest = np.clip(np.floor(x / 100 + 0.5), 0, 6)
    assert got.tolist() == (np.abs(x - 100 * nearest) - 10).tolist()


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_pattern_blocks_skip_copies_without_changing_a_bit(walker_cpu, name):
    # the twin skips a copy when every point of a block has a bound >= its running minimum; a
    # point evaluated alone skips whenever its own bound allows: the bits must not differ
    op, prm, r, (lo, hi) = PATTERNS[name]
    tape = _pattern_tape(op, prm, r)
    pts = RNG.uniform(lo, hi, (3000, 3)).astype(np.float32)
    d, m = walker_cpu.evaluate(tape, pts)
    alone = [walker_cpu.evaluate(tape, pts[i:i + 1]) for i in range(0, 3000, 60)]
    assert np.array_equal(d[::60], np.concatenate([a[0] for a in alone]))
    assert np.array_equal(m[::60], np.concatenate([a[1] for a in alone]))


def test_instance_index_reports_the_evaluated_copies(walker_cpu):
    # copies 100 apart along x, child slab e = 0: a copy's bound is |t - k| * 100 and the unchecked
    # bound 100 * (distance to the nearest unchecked index). The body, index + y (y is the same in
    # every copy), lies between the two, so the value is y + the smallest evaluated index.
    prm = [100.0, 0.0, 0.0, 7, 0.0]

    def body(tb):
        tb.op(Op.INSTANCE_INDEX, 2)
        tb.op(Op.VAR_Y, 3)
        tb.op(Op.ADD, 1, a=2, b=3)
    tape = _pattern_tape(Op.REPEAT_LINEAR, prm, 0.0, body)
    t = np.array([0.2, 0.7, 2.3, 2.5, 3.9, 5.6, 6.4, 8.0, -1.0], np.float64)
    c = np.clip(np.floor(t + 0.5), 0, 6)                           # the nearest copy (round half up)
    nb = c + np.where(t >= c, 1, -1)                               # and its neighbour towards t
    nb = np.where((nb < 0) | (nb > 6), c - np.where(t >= c, 1, -1), nb)
    far = 100 * np.maximum(np.abs(t - c), np.abs(t - nb))          # largest evaluated copy bound
    k = np.arange(7)
    unchecked = (k[None] < np.minimum(c, nb)[:, None]) | (k[None] > np.maximum(c, nb)[:, None])
    unchecked_bound = 100 * np.where(unchecked, np.abs(t[:, None] - k), np.inf).min(1)
    y = np.ceil(far) + 1
    assert np.all(y + 6 < unchecked_bound)                         # the window the test relies on
    pts = np.stack([t * 100, y, np.zeros_like(t)], 1).astype(np.float32)
    got, _ = walker_cpu.evaluate(tape, pts)
    assert got.tolist() == (y + np.minimum(c, nb)).tolist()


def test_grid_instance_index_is_linear_index(walker_cpu):
    # cells 100 apart, child boxes of zero size: a cell's bound is its distance from the point; the
    # body 170 - index lies between the evaluated cells' bounds and the unchecked bound, so the
    # value is 170 - the largest evaluated index
    prm = [100.0, 100.0, 100.0, 3, 4, 2, 0.0, 0.0, 0.0]

    def body(tb):
        tb.op(Op.INSTANCE_INDEX, 2)
        tb.op(Op.CONST, 3, params=[170.0])
        tb.op(Op.SUB, 1, a=3, b=2)
    tape = _pattern_tape(Op.REPEAT_GRID, prm, 0.1, body)
    pts = np.array([[20, 20, 20], [160, 270, 90], [200, 300, 100]], np.float32)
    got, _ = walker_cpu.evaluate(tape, pts)
    # cells per axis: (0,1) (0,1) (0,1) -> max index 1 + 3*(1 + 4*1); (1,2) (2,3) (0,1) -> 2 + 3*(3 + 4);
    # (2,1) (3,2) (1,0) -> 2 + 3*(3 + 4*1)
    assert (170 - got).tolist() == [1 + 3 * 5, 2 + 3 * 7, 2 + 3 * 7]


def test_nested_patterns_and_point_stack_inside_bodies(walker_cpu):
    tb = TapeBuilder()
    outer = tb.op(Op.REPEAT_LINEAR, params=[0, 0, 1.0, 3, 0.2])
    inner = tb.op(Op.REPEAT_POLAR, params=[6, 0.6, 0, 0, 0.2])
    tb.op(Op.PUSH)
    tb.op(Op.TRANSLATE, params=[0.6, 0, 0])
    tb.op(Op.SPHERE, 3, params=[0.2], aux=1)
    tb.op(Op.POP)
    e_in = tb.op(Op.REPEAT_END, 2, a=3, jump=inner)
    e_out = tb.op(Op.REPEAT_END, 0, a=2, jump=outer)
    tb.rows[inner][7], tb.rows[outer][7] = e_in, e_out
    pts = RNG.uniform(-1, 3, (3000, 3)).astype(np.float32)
    d, _ = walker_cpu.evaluate(tb.tape(), pts)
    th = 2 * np.pi * np.arange(6) / 6
    c = np.array([[0.6 * np.cos(a), 0.6 * np.sin(a), z] for z in range(3) for a in th])
    brute = np.min(np.linalg.norm(pts.astype(float)[:, None] - c[None], axis=-1), axis=1) - 0.2
    near = brute < 0.3
    assert np.all(d <= brute + 1e-5)
    close(d[near], brute[near])


# ----------------------------------------------------------------------------- culling
def _sphere_union(culled: bool, centres, r=0.2):
    """union of spheres; with culled=True each child after the first sits in a CULL_BOX record
    written as the flattener does: CULL(t) <child into t+1> INTERSECT(t, t+1, t) -> UNION."""
    tb = TapeBuilder()
    for i, c in enumerate(centres):
        dst = 0 if i == 0 else (2 if culled else 1)
        cull = None
        if i and culled:
            cull = tb.op(Op.CULL_BOX, 1, a=0, params=[*(np.array(c) - r), *(np.array(c) + r), 0.0], aux=i % 4)
        tb.op(Op.PUSH)
        tb.op(Op.TRANSLATE, params=c)
        tb.op(Op.SPHERE, dst, params=[r], aux=i % 4)
        tb.op(Op.POP)
        if i and culled:
            tb.op(Op.INTERSECT, 1, a=2, b=1)
        if i:
            u = tb.op(Op.UNION, 0, a=0, b=1)
            if cull is not None:
                tb.rows[cull][7] = u
    return tb.tape()


def test_cull_box_results_equal_unculled_results(walker_cpu):
    centres = RNG.uniform(-1.5, 1.5, (40, 3))
    pts = RNG.uniform(-2, 2, (20000, 3)).astype(np.float32)
    pts[:5000] = np.sort(pts[:5000], axis=0)         # coherent runs: whole blocks cull together
    a, ma = walker_cpu.evaluate(_sphere_union(True, centres), pts)
    b, mb = walker_cpu.evaluate(_sphere_union(False, centres), pts)
    assert np.array_equal(a, b) and np.array_equal(ma, mb)
    one = np.concatenate([walker_cpu.evaluate(_sphere_union(True, centres), p[None])[0] for p in pts[:300]])
    assert np.array_equal(one, a[:300])               # grouping never changes a result


def test_instances_op_matches_explicit_transforms(walker_cpu):
    from taperay.runtime.tape import BVH_DTYPE, INSTANCE_DTYPE
    q = RNG.normal(size=(3, 4))
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    t = RNG.uniform(-1, 1, (3, 3))
    s = np.array([0.5, 1.0, 1.5])
    inst = np.zeros(3, INSTANCE_DTYPE)
    inst["q"], inst["t"], inst["s"] = q, t, s
    h = np.array([0.3, 0.2, 0.1])
    ext = [np.abs(quat_matrix(q[i])) @ (h * s[i]) for i in range(3)]
    lo = np.array([t[i] - ext[i] for i in range(3)])
    hi = np.array([t[i] + ext[i] for i in range(3)])
    bvh = np.zeros(5, BVH_DTYPE)           # root, inner(0, 1), leaf 0, leaf 1, leaf 2
    boxes = [(lo.min(0), hi.max(0)), (lo[:2].min(0), hi[:2].max(0)), (lo[0], hi[0]), (lo[1], hi[1]), (lo[2], hi[2])]
    for i, (bl, bh) in enumerate(boxes):
        bvh[i]["lo"], bvh[i]["hi"] = bl, bh
    bvh["skip"] = [5, 4, 3, 4, 5]
    bvh["instance"] = [-1, -1, 0, 1, 2]
    tb = TapeBuilder()
    # the child's box, a capsule inside the box along x, a grid of one cell naming instance 0
    begin = tb.op(Op.INSTANCES, a=5, aux=0, params=[*-h, *h, -0.2, 0, 0, 0.2, 0, 0, 0.1, 0, 0, 0, 10, 1, 1, 1, 0])
    tb.op(Op.BOX, 1, params=h, aux=2)
    end = tb.op(Op.REPEAT_END, 0, a=1, jump=begin)
    tb.rows[begin][7] = end
    tape = tb.tape()
    tape.instances, tape.bvh = inst, bvh
    pts = RNG.uniform(-1.6, 1.6, (4000, 3)).astype(np.float32)
    d, m = walker_cpu.evaluate(tape, pts)
    p = pts.astype(float)
    each = [r_box(((p - t[i]) @ quat_matrix(q[i])) / s[i], h) * s[i] for i in range(3)]
    box_d = [r_box(p - (lo[i] + hi[i]) / 2, (hi[i] - lo[i]) / 2) for i in range(3)]
    exact = np.min(each, axis=0)
    assert np.all(d <= exact + 1e-5)                          # max(body, leaf box) <= the box's field
    near = exact < 0.05
    close(d[near], np.min(np.maximum(each, box_d), axis=0)[near])
    assert np.all(m == 2)


def test_invalid_tape_is_rejected(walker_cpu):
    tb = TapeBuilder()
    tb.op(Op.ADD, 0, a=1, b=2)
    with pytest.raises(TapeError):
        walker_cpu.evaluate(tb.tape(n_regs=3), np.zeros((1, 3), np.float32))


def test_every_op_is_exercised_by_this_file():
    """Each op has a test of its own here, or (an arithmetic op reading registers) the table-driven one."""
    import inspect
    import sys
    src = inspect.getsource(sys.modules[__name__])
    missing = [o.name for o in Op if f"Op.{o.name}" not in src and o not in TABLE_OPS]
    assert not missing, missing
