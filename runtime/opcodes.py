"""The opcode table: the single source of truth for what every tape instruction means.

Every walker (the Numba twin, the WGSL kernels, the JAX walker) implements exactly the ops listed
here, with the field usage and semantics written in each ``OpSpec``, which also holds the per-op
data of the tools (conformance tolerance, the field function, the ``.vm`` name) and, for the
arithmetic ops reading registers, their rules per target (the twin's ``numba``, the GPU's
``wgsl``, the ``Interval`` rule, the dispatch ``rank``) from which ``runtime.op_codegen``
generates every walker's cases. Ops are numbered in declaration order, grouped by ``OpClass``;
the numbers and class ranges are generated into ``shaders/generated_tape.wgsl`` and
``runtime/op_numbers.py`` (``runtime.wgsl_header``), and tests fail when a generated file, a
kernel or the twin drift from the table (tests/test_op_table.py lists each place an op is missing).

Interpreter state (per evaluated point):
  * ``reg[]``  float32 registers, ``mat[]`` a material id per register (u32);
  * ``p``      the current local point (vec3) and ``scale`` (float, starts at 1): shape ops return
               ``prim(p) * scale``;
  * point stack of (p, scale) frames (PUSH / POP), depth <= STACK_CAP;
  * loop stack for pattern ops (REPEAT_* ... REPEAT_END), depth <= LOOP_CAP.
The value of the tape is ``reg[0]`` (material ``mat[0]``) after the last instruction.

Instruction fields (all u32, see ``runtime.tape.INSTR_DTYPE``): ``op dst a b c param aux jump``.
  dst        register written;  a, b, c  registers read;
  param      offset into the float32 parameter pool;  aux  material id / count;
  jump       instruction index (forward for CULL_BOX / REPEAT_*, back to the REPEAT_* for REPEAT_END).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

import numpy as np

STACK_CAP = 16   # point-stack frames a kernel holds
LOOP_CAP = 4     # nested pattern loops a kernel holds
REG_CAPS = (16, 64, 256)  # register-file variants built at startup (kernel capacity by registers)
MAX_POLY_VERTS = 1024     # vertices of one extruded / revolved profile
INSTANCE_REACH = (2.0 ** -12, 2.0 ** -14)   # INSTANCES' room for rounding in U' (relative, per |p|)
# level-0 pruning in dependency steps (prune.wgsl prune_wave, gpu_pruning.wave_schedule): the most
# records of a tape and values alive at once (workgroup memory) it holds, the most records a step;
# an operand descriptor is a value slot, WAVE_LEAF | the record of a VAR / CONST / INSTANCE_INDEX
# operand, or WAVE_NONE
WAVE_RECORDS = 8192
WAVE_SLOTS = 512
WAVE_WIDTH = 64
WAVE_LEAF = 1 << 31
WAVE_NONE = 0xFFFFFFFF


class Family(str, enum.Enum):
    ARITH = "arith"
    SHAPE = "shape"
    POINT = "point"
    COMBINE = "combine"
    PATTERN = "pattern"
    CULL = "cull"
    MATERIAL = "material"


class OpClass(enum.IntEnum):
    """An op's class: its family, with arithmetic split by the registers it reads. Ops are numbered
    class by class in this order, so each class is one range of numbers (``CLASS_RANGES``; in WGSL
    and the Numba kernels ``OP_<CLASS>_FIRST`` .. ``OP_<CLASS>_LAST``), which the kernels dispatch
    by: a new op declared with its class renumbers every op after it and no range test changes."""
    LEAF = 0
    UNARY = 1
    BINARY = 2
    TERNARY = 3
    SHAPE = 4
    POINT = 5
    COMBINE = 6
    PATTERN = 7
    CULL = 8
    MATERIAL = 9


class Op(enum.IntEnum):
    """The tape's opcodes, numbered 0, 1, 2 ... in the order declared here, which groups them by
    ``OpClass`` (checked at import); ``OPS[op]`` is each one's ``OpSpec``. The numbers change when
    an op is added: files store op names (``scenegraph/files.py``), kernels use generated constants."""

    def _generate_next_value_(name, start, count, last_values):
        return count

    # leaf: arithmetic reading no register (VAR_X, VAR_Y, VAR_Z first: kernels index the point by them)
    VAR_X = enum.auto()
    VAR_Y = enum.auto()
    VAR_Z = enum.auto()
    CONST = enum.auto()
    INSTANCE_INDEX = enum.auto()
    # unary: arithmetic reading register a (Fidget's .vm vocabulary, plus COPY)
    COPY = enum.auto()
    NEG = enum.auto()
    ABS = enum.auto()
    RECIP = enum.auto()
    SQRT = enum.auto()
    SQUARE = enum.auto()
    FLOOR = enum.auto()
    CEIL = enum.auto()
    ROUND = enum.auto()
    SIN = enum.auto()
    COS = enum.auto()
    TAN = enum.auto()
    ASIN = enum.auto()
    ACOS = enum.auto()
    ATAN = enum.auto()
    EXP = enum.auto()
    LN = enum.auto()
    NOT = enum.auto()
    # binary: arithmetic reading registers a and b
    ADD = enum.auto()
    SUB = enum.auto()
    MUL = enum.auto()
    DIV = enum.auto()
    MIN = enum.auto()
    MAX = enum.auto()
    ATAN2 = enum.auto()
    COMPARE = enum.auto()
    MOD = enum.auto()
    AND = enum.auto()
    OR = enum.auto()
    RAND = enum.auto()
    # ternary: arithmetic reading registers a, b and c
    MIX = enum.auto()
    # shapes: dst = prim(p) * scale, mat[dst] = aux
    SPHERE = enum.auto()
    BOX = enum.auto()
    ROUND_BOX = enum.auto()
    CYLINDER = enum.auto()
    CAPPED_CONE = enum.auto()
    CAPSULE = enum.auto()
    TORUS = enum.auto()
    ELLIPSOID = enum.auto()
    PLANE = enum.auto()
    EXTRUDE_POLY = enum.auto()
    REVOLVE_POLY = enum.auto()
    # point ops
    PUSH = enum.auto()
    POP = enum.auto()
    TRANSLATE = enum.auto()
    ROTATE = enum.auto()
    SCALE = enum.auto()
    MIRROR = enum.auto()
    ELONGATE = enum.auto()
    # combine ops and modifiers
    UNION = enum.auto()
    INTERSECT = enum.auto()
    DIFFERENCE = enum.auto()
    XOR = enum.auto()
    SMOOTH_UNION = enum.auto()
    SMOOTH_INTERSECT = enum.auto()
    SMOOTH_DIFFERENCE = enum.auto()
    OFFSET = enum.auto()
    SHELL = enum.auto()
    # patterns (domain repetition with neighbour checks, instance lists)
    REPEAT_LINEAR = enum.auto()
    REPEAT_POLAR = enum.auto()
    REPEAT_GRID = enum.auto()
    REPEAT_END = enum.auto()
    INSTANCES = enum.auto()
    # culling
    CULL_BOX = enum.auto()
    # material
    FIELD_RESULT = enum.auto()


@dataclass(frozen=True)
class Tolerance:
    """How far a walker's value may be from the twin's (``runtime.conformance``): |walker - twin| <=
    max(ulps * ulp(|twin|), abs_rel * scale), ``scale`` the magnitude of the inputs (the point
    cloud's extent), so results that cancel to ~0 are judged on the inputs' grid."""
    ulps: float
    abs_rel: float
    why: str


EXACT = Tolerance(2, 2.0 ** -22, "correctly rounded in WGSL; 1-2 ULP for contraction into fma")
GEOMETRIC = Tolerance(32, 2.0 ** -19, "shapes: sums of products + sqrt / division, cancellation at the surface")
_DIV = Tolerance(4, 2.0 ** -22, "WGSL: x / y within 2.5 ULP")
_SQRT = Tolerance(4, 2.0 ** -22, "WGSL: sqrt inherits 1/inverseSqrt (2 ULP) + division")
_TRIG = Tolerance(0, 2.0 ** -11, "WGSL: sin / cos absolute error 2^-11 on [-pi, pi] (arguments reduced there)")
_ATAN = Tolerance(4096, 2.0 ** -20, "WGSL: atan / atan2 (asin, acos inherit) within 4096 ULP")
_POLAR = Tolerance(4096, 2.0 ** -9, "polar copies rotated by WGSL sin / cos / atan2 (2^-11 absolute)")


@dataclass(frozen=True)
class Interval:
    """An arithmetic op's interval rule, from which ``runtime.op_codegen`` generates the twin's
    float32 interval case (runtime/interval_kernels.py ``_iv``), the GPU's (shaders/prune.wgsl ``iv_unary`` /
    ``iv_binary``) and ``runtime.intervals`` takes the float64 reference.

    ``monotone`` "increasing" / "decreasing": the interval of [lo, hi] is [f(lo), f(hi)] (or
    [f(hi), f(lo)]), f the op's scalar rule (``OpSpec.numba`` / ``OpSpec.wgsl``, ``reference`` in
    float64); NaN where the interval leaves ``domain`` (closed; also NaN operands). ``exact``: f is
    exact in float32 (floor, neg): the bounds are the scalar rule's own, unwidened; otherwise the
    twin computes f in float64 and rounds outward by ``WIDEN_ULPS``, the GPU widens f's float32
    value by its wide margin (prune.wgsl ``wide``) and clamps it into ``wgsl_range`` (WGSL constant
    expressions; None: no clamp).

    Otherwise the op keeps a hand-written named rule: ``numba`` and ``wgsl`` call it with the
    operand bounds ``{alo} {ahi} {blo} {bhi} {clo} {chi}`` (the twin's gives (lo, hi), or (lo, hi,
    choice) where ``chooses``; the GPU's an ``Iv``), and ``runtime.intervals`` holds its float64
    rule by op. ``takes_nan``: the rule itself handles NaN operands (AND / OR ignore a NaN operand
    they never select; NOT of anything, NaN included, is 0 or 1); the GPU's case of any other op
    answers NaN for a NaN operand first."""
    monotone: str | None = None
    exact: bool = False
    domain: tuple[float, float] = (-np.inf, np.inf)
    wgsl_range: tuple[str | None, str | None] = (None, None)
    numba: str | None = None
    wgsl: str | None = None
    chooses: bool = False
    takes_nan: bool = False


INCREASING_EXACT = Interval("increasing", exact=True)


@dataclass(frozen=True)
class OpSpec:
    """One op: what its record means, and the per-op data every walker and tool reads from here."""
    op: Op
    family: Family
    reads: tuple[str, ...]      # instruction fields holding register reads
    writes: bool                # writes reg[dst]
    n_params: int               # fixed parameter count (-1: variable, see ``doc``)
    doc: str
    reference: Callable | None = None   # canonical float64 numpy reference (arith / combine)
    tolerance: Tolerance = EXACT        # walker vs twin (runtime.conformance); WGSL's accuracy
    scale: float = 1.0                  # conformance's op tapes feed it the point times this
    # The arithmetic ops reading registers carry their rules per target; runtime.op_codegen
    # generates the walkers' cases from them (docs/ARCHITECTURE.md, "Adding an op"):
    # wgsl: the op in WGSL, {a} {b} {c} its float32 operands: the interpreter's unary() / binary()
    # case (unless ``wgsl_walk``) and the written-out WGSL of tools/baseline_wgsl.py
    wgsl: str | None = None
    # numba: the twin's float32 rule in Numba, {a} {b} {c} its float32 operands
    numba: str | None = None
    # numba_loop: where the twin's loop over a block is: "inline" (in arith_block), "libm" (in
    # the generated libm_block: a small function whose loop LLVM unswitches, for libm calls), or
    # the name of a hand-written block function called as name(regs, d, a, b, n) (MOD's fast block)
    numba_loop: str = "inline"
    # wgsl_walk: the WGSL tape walks (run_tape, packed.wgsl) run the op themselves (MIN / MAX:
    # materials; MOD: sub-steps), so unary() / binary() have no case for it
    wgsl_walk: bool = False
    interval: Interval | None = None    # its interval rule (Interval)
    rank: int = 0                       # dispatch order in the generated cases: hottest first
    field: str | None = None            # its function in scenegraph.fields (x, y, z expressions)
    vm: str | None = None               # its name in Fidget's .vm programs (scenegraph.vm)

    @property
    def op_class(self) -> OpClass:
        if self.family is Family.ARITH:
            return OpClass(len(self.reads))
        return OpClass[self.family.name]


def _compare(a, b):
    # by comparisons, not sign(a - b): compare(inf, inf) is 0 (inf - inf would be NaN)
    return np.where(np.isnan(a) | np.isnan(b), np.nan, np.where(a < b, -1.0, np.where(a > b, 1.0, 0.0)))


def _rem_euclid(a, b):
    r = np.fmod(a, b)
    return np.where(r < 0, r + np.abs(b), r)


def _smin(a, b, k):
    h = np.maximum(k - np.abs(a - b), 0.0) / k
    return np.minimum(a, b) - h * h * k * 0.25


def _rand(a, b):
    """Deterministic hash of two floats to [0, 1): the same integer hash on every walker."""
    x = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    y = np.asarray(b, np.float32).view(np.uint32).astype(np.uint64)
    h = (x * np.uint64(0x9E3779B1) ^ (y + np.uint64(0x7F4A7C15))) & np.uint64(0xFFFFFFFF)
    h = ((h ^ (h >> np.uint64(16))) * np.uint64(0x45D9F3B)) & np.uint64(0xFFFFFFFF)
    h = ((h ^ (h >> np.uint64(16))) * np.uint64(0x45D9F3B)) & np.uint64(0xFFFFFFFF)
    h = h ^ (h >> np.uint64(16))
    return (h >> np.uint64(8)).astype(np.float64) / float(1 << 24)


A, AB, ABC = ("a",), ("a", "b"), ("a", "b", "c")
_S = []


def _spec(op, family, reads, writes, n_params, doc, ref=None, **data):
    if "tolerance" not in data and family in (Family.SHAPE, Family.POINT, Family.PATTERN, Family.CULL):
        data["tolerance"] = GEOMETRIC
    _S.append(OpSpec(op, family, reads, writes, n_params, doc, ref, **data))


F = Family
_spec(Op.VAR_X, F.ARITH, (), True, 0, "reg[dst] = p.x", vm="var-x")
_spec(Op.VAR_Y, F.ARITH, (), True, 0, "reg[dst] = p.y", vm="var-y")
_spec(Op.VAR_Z, F.ARITH, (), True, 0, "reg[dst] = p.z", vm="var-z")
_spec(Op.CONST, F.ARITH, (), True, 1, "reg[dst] = param[0]", vm="const")
_spec(Op.INSTANCE_INDEX, F.ARITH, (), True, 0,
      "reg[dst] = index of the instance the innermost pattern loop is evaluating (0 outside loops)")
# The arithmetic ops reading registers: their rules per target (OpSpec.wgsl / numba / interval),
# ranked hottest first (rank: the order of the generated dispatches; SDF tapes are mostly MAX, SUB,
# ADD, MIN, COPY, NEG, SQUARE, SQRT, MUL). A named interval rule is a hand-written function of
# each target: runtime/interval_kernels.py _iv_*, shaders/prune.wgsl iv_*, runtime/intervals.py.
def _named(numba, wgsl, **kw):
    return Interval(numba=numba, wgsl=wgsl, **kw)


_spec(Op.COPY, F.ARITH, A, True, 0, "reg[dst] = reg[a]; mat[dst] = mat[a]", lambda a: a, wgsl="{a}", numba="{a}",
      interval=INCREASING_EXACT, rank=5)
_spec(Op.NEG, F.ARITH, A, True, 0, "-a", lambda a: -a, wgsl="-{a}", numba="-{a}",
      interval=Interval("decreasing", exact=True), rank=6, vm="neg")
_spec(Op.ABS, F.ARITH, A, True, 0, "|a|", np.abs, wgsl="abs({a})", numba="abs({a})",
      interval=_named("_iv_abs({alo}, {ahi})", "iv(max(max({alo}, -{ahi}), 0.0), max(-{alo}, {ahi}))"), rank=10,
      field="abs_", vm="abs")
_spec(Op.RECIP, F.ARITH, A, True, 0, "1/a", lambda a: 1.0 / a, tolerance=_DIV, wgsl="1.0 / {a}", numba="F1 / {a}",
      interval=_named("_iv_recip({alo}, {ahi})", "iv_recip({alo}, {ahi})"), rank=11, vm="recip")
_spec(Op.SQRT, F.ARITH, A, True, 0, "sqrt(a) (NaN below 0)", np.sqrt, tolerance=_SQRT, wgsl="sqrt({a})",
      numba="np.sqrt({a})", interval=_named("_iv_sqrt({alo}, {ahi})", "iv_sqrt({alo}, {ahi})"), rank=8,
      field="sqrt", vm="sqrt")
_spec(Op.SQUARE, F.ARITH, A, True, 0, "a*a", np.square, wgsl="{a} * {a}", numba="{a} * {a}",
      interval=_named("_iv_square({alo}, {ahi})", "iv_square({alo}, {ahi})"), rank=7, field="square", vm="square")
_spec(Op.FLOOR, F.ARITH, A, True, 0, "floor(a)", np.floor, wgsl="floor({a})", numba="np.floor({a})",
      interval=INCREASING_EXACT, rank=13, field="floor", vm="floor")
_spec(Op.CEIL, F.ARITH, A, True, 0, "ceil(a)", np.ceil, wgsl="ceil({a})", numba="np.ceil({a})",
      interval=INCREASING_EXACT, rank=14, field="ceil", vm="ceil")
_spec(Op.ROUND, F.ARITH, A, True, 0, "round half away from zero", lambda a: np.sign(a) * np.floor(np.abs(a) + 0.5),
      wgsl="round_away({a})", numba="round_away({a})", interval=INCREASING_EXACT, rank=15, field="round_", vm="round")
_spec(Op.SIN, F.ARITH, A, True, 0, "sin(a)", np.sin, tolerance=_TRIG, scale=6.0, wgsl="sin(reduce_angle({a}))",
      numba="np.sin({a})", numba_loop="libm", interval=_named("_iv_sincos({alo}, {ahi}, 0.0)", "iv_sincos({alo}, {ahi})"),
      rank=16, field="sin", vm="sin")
_spec(Op.COS, F.ARITH, A, True, 0, "cos(a)", np.cos, tolerance=_TRIG, scale=6.0, wgsl="cos(reduce_angle({a}))",
      numba="np.cos({a})", numba_loop="libm",
      interval=_named("_iv_sincos({alo}, {ahi}, PI64 / 2)", "iv_sincos({alo}, {ahi})"), rank=17, field="cos", vm="cos")
_spec(Op.TAN, F.ARITH, A, True, 0, "tan(a)", np.tan, scale=0.5, wgsl="tan(reduce_angle({a}))", numba="np.tan({a})",
      numba_loop="libm", interval=_named("_iv_tan({alo}, {ahi})", "iv_tan({alo}, {ahi})"), rank=18, field="tan", vm="tan",
      tolerance=Tolerance(64, 2.0 ** -10, "WGSL: tan inherits sin / cos (2^-11 absolute each) and a division"))
_spec(Op.ASIN, F.ARITH, A, True, 0, "asin(a) (NaN outside [-1,1])", np.arcsin, tolerance=_ATAN, scale=0.45,
      wgsl="asin({a})", numba="np.arcsin({a})", numba_loop="libm", interval=Interval("increasing", domain=(-1.0, 1.0)),
      rank=19, field="asin", vm="asin")
_spec(Op.ACOS, F.ARITH, A, True, 0, "acos(a) (NaN outside [-1,1])", np.arccos, tolerance=_ATAN, scale=0.45,
      wgsl="acos({a})", numba="np.arccos({a})", numba_loop="libm", interval=Interval("decreasing", domain=(-1.0, 1.0)),
      rank=20, field="acos", vm="acos")
_spec(Op.ATAN, F.ARITH, A, True, 0, "atan(a)", np.arctan, tolerance=_ATAN, wgsl="atan({a})", numba="np.arctan({a})",
      numba_loop="libm", interval=Interval("increasing", wgsl_range=("-HALF_PI_UP", "HALF_PI_UP")), rank=21,
      field="atan", vm="atan")
_spec(Op.EXP, F.ARITH, A, True, 0, "exp(a)", np.exp, wgsl="exp({a})", numba="np.exp({a})", numba_loop="libm",
      interval=Interval("increasing", wgsl_range=("0.0", None)), rank=22, field="exp", vm="exp",
      tolerance=Tolerance(16, 2.0 ** -22, "WGSL: exp within 3 + 2|x| ULP (|x| <= 3.1 here)"))
_spec(Op.LN, F.ARITH, A, True, 0, "ln(a) (NaN below 0, -inf at 0)", np.log, wgsl="log({a})", numba="np.log({a})",
      numba_loop="libm", interval=Interval("increasing", domain=(0.0, np.inf)), rank=23, field="ln", vm="ln",
      tolerance=Tolerance(4, 2.0 ** -21, "WGSL: log absolute 2^-21 on [0.5, 2], 3 ULP elsewhere"))
_spec(Op.NOT, F.ARITH, A, True, 0, "1 if a == 0 else 0", lambda a: (a == 0).astype(np.float64),
      wgsl="select(0.0, 1.0, {a} == 0.0)", numba="F1 if {a} == F0 else F0",
      interval=_named("_iv_not({alo}, {ahi})", "iv_not({alo}, {ahi})", takes_nan=True),
      rank=24, field="logical_not", vm="not")
_spec(Op.ADD, F.ARITH, AB, True, 0, "a + b", np.add, wgsl="{a} + {b}", numba="{a} + {b}",
      interval=_named("_iv_add({alo}, {ahi}, {blo}, {bhi})", "iv_add({alo}, {ahi}, {blo}, {bhi})"), rank=3, vm="add")
_spec(Op.SUB, F.ARITH, AB, True, 0, "a - b", np.subtract, wgsl="{a} - {b}", numba="{a} - {b}",
      interval=_named("_iv_add({alo}, {ahi}, -{bhi}, -{blo})", "iv_add({alo}, {ahi}, -{bhi}, -{blo})"), rank=2, vm="sub")
_spec(Op.MUL, F.ARITH, AB, True, 0, "a * b", np.multiply, wgsl="{a} * {b}", numba="{a} * {b}",
      interval=_named("_iv_mul({alo}, {ahi}, {blo}, {bhi})", "iv_mul({alo}, {ahi}, {blo}, {bhi})"), rank=9, vm="mul")
_spec(Op.DIV, F.ARITH, AB, True, 0, "a / b", np.divide, tolerance=_DIV, wgsl="{a} / {b}", numba="{a} / {b}",
      interval=_named("_iv_div({alo}, {ahi}, {blo}, {bhi})", "iv_div({alo}, {ahi}, {blo}, {bhi})"), rank=12, vm="div")
_spec(Op.MIN, F.ARITH, AB, True, 0, "min(a, b); mat of the smaller (a on ties)", np.minimum, wgsl="nmin({a}, {b})",
      numba="fmin({a}, {b})", wgsl_walk=True, rank=4, field="minimum", vm="min",
      interval=_named("_iv_minmax(MIN, {alo}, {ahi}, {blo}, {bhi})", "iv_minmax(true, {alo}, {ahi}, {blo}, {bhi})",
                   chooses=True))
_spec(Op.MAX, F.ARITH, AB, True, 0, "max(a, b); mat of the larger (a on ties)", np.maximum, wgsl="nmax({a}, {b})",
      numba="fmax({a}, {b})", wgsl_walk=True, rank=1, field="maximum", vm="max",
      interval=_named("_iv_minmax(MAX, {alo}, {ahi}, {blo}, {bhi})", "iv_minmax(false, {alo}, {ahi}, {blo}, {bhi})",
                   chooses=True))
_spec(Op.ATAN2, F.ARITH, AB, True, 0, "atan2(a, b) (a is y, b is x)", np.arctan2, tolerance=_ATAN,
      wgsl="atan2_full({a}, {b})", numba="np.arctan2({a}, {b})", rank=25, field="atan2", vm="atan2",
      interval=_named("_iv_atan2({alo}, {ahi}, {blo}, {bhi})", "iv_atan2({alo}, {ahi}, {blo}, {bhi})"))
_spec(Op.COMPARE, F.ARITH, AB, True, 0, "-1 if a<b, 0 if equal, 1 if a>b, NaN if either is NaN", _compare,
      wgsl="compare_values({a}, {b})", numba="compare_values({a}, {b})", rank=26, field="compare", vm="compare",
      interval=_named("_iv_compare({alo}, {ahi}, {blo}, {bhi})", "iv_compare({alo}, {ahi}, {blo}, {bhi})"))
_spec(Op.MOD, F.ARITH, AB, True, 0, "Euclidean remainder: r = fmod(a,b); r<0 ? r+|b| : r", _rem_euclid,
      wgsl="bl_mod({a}, {b})", numba="rem32({a}, {b})", numba_loop="mod_block", wgsl_walk=True, rank=27,
      field="mod", vm="mod",
      interval=_named("_iv_mod({alo}, {ahi}, {blo}, {bhi})", "iv_mod({alo}, {ahi}, {blo}, {bhi})"))
_spec(Op.AND, F.ARITH, AB, True, 0, "a == 0 ? a : b", lambda a, b: np.where(a == 0, a, b),
      wgsl="select({b}, {a}, {a} == 0.0)", numba="{a} if {a} == F0 else {b}", rank=28, field="select_and", vm="and",
      interval=_named("_iv_logic(AND, {alo}, {ahi}, {blo}, {bhi})", "iv_logic(true, {alo}, {ahi}, {blo}, {bhi})",
                   chooses=True, takes_nan=True))
_spec(Op.OR, F.ARITH, AB, True, 0, "a != 0 ? a : b", lambda a, b: np.where(a != 0, a, b),
      wgsl="select({b}, {a}, {a} != 0.0)", numba="{a} if {a} != F0 else {b}", rank=29, field="select_or", vm="or",
      interval=_named("_iv_logic(OR, {alo}, {ahi}, {blo}, {bhi})", "iv_logic(false, {alo}, {ahi}, {blo}, {bhi})",
                   chooses=True, takes_nan=True))
_spec(Op.RAND, F.ARITH, AB, True, 0, "deterministic integer hash of the bits of a and b, in [0,1)", _rand,
      wgsl="rand_bits(bitcast<u32>({a}), bitcast<u32>({b}))",
      numba="rand_bits(np.float32({a}).view(np.uint32), np.float32({b}).view(np.uint32))", rank=31,
      interval=_named("(F0, F1)", "iv(0.0, 1.0)"), vm="rand")
_spec(Op.MIX, F.ARITH, ABC, True, 0, "a + (b - a) * c", lambda a, b, c: a + (b - a) * c,
      wgsl="{a} + ({b} - {a}) * {c}", numba="{a} + ({b} - {a}) * {c}", rank=30, field="mix", vm="mix",
      interval=_named("_iv_mix({alo}, {ahi}, {blo}, {bhi}, {clo}, {chi})",
                   "iv_mix({alo}, {ahi}, {blo}, {bhi}, {clo}, {chi})"))

_spec(Op.SPHERE, F.SHAPE, (), True, 1, "[r]: |p| - r")
_spec(Op.BOX, F.SHAPE, (), True, 3, "[hx hy hz] half extents, exact")
_spec(Op.ROUND_BOX, F.SHAPE, (), True, 4, "[hx hy hz r]: box(h - r) - r, exact")
_spec(Op.CYLINDER, F.SHAPE, (), True, 2, "[r h]: capped cylinder on the z axis, radius r, z in [-h, h], exact")
_spec(Op.CAPPED_CONE, F.SHAPE, (), True, 3, "[h r1 r2]: z axis, radius r1 at z=-h, r2 at z=+h (iq's exact capped cone)")
_spec(Op.CAPSULE, F.SHAPE, (), True, 7, "[ax ay az bx by bz r]: segment a-b, radius r, exact")
_spec(Op.TORUS, F.SHAPE, (), True, 2, "[R r]: ring in the xy plane (axis z), exact")
_spec(Op.ELLIPSOID, F.SHAPE, (), True, 3, "[rx ry rz]: iq's bound k0*(k0-1)/k1, k0=|p/r|, k1=|p/r^2|")
_spec(Op.PLANE, F.SHAPE, (), True, 4, "[nx ny nz d]: half-space dot(p, n) - d (n unit), exact")
_spec(Op.EXTRUDE_POLY, F.SHAPE, (), True, -1,
      "[h, x0 y0 x1 y1 ...]: vertex count n in field a (not a register); closed polygon in xy "
      "(even-odd inside), extruded along z to [-h, h], exact")
_spec(Op.REVOLVE_POLY, F.SHAPE, (), True, -1,
      "[x0 y0 x1 y1 ...] vertex count n in field a; profile in (radius, z), revolved about z: "
      "poly(length(p.xy), p.z), exact")

_spec(Op.PUSH, F.POINT, (), False, 0, "push (p, scale)")
_spec(Op.POP, F.POINT, (), False, 0, "pop (p, scale)")
_spec(Op.TRANSLATE, F.POINT, (), False, 3, "[tx ty tz]: p = p - t (the child is moved by +t)")
_spec(Op.ROTATE, F.POINT, (), False, 4,
      "[w x y z] unit quaternion q rotating the child: p = conj(q) * p * q")
_spec(Op.SCALE, F.POINT, (), False, 1, "[s]: p = p / s; scale = scale * s")
_spec(Op.MIRROR, F.POINT, (), False, 4,
      "[nx ny nz d]: if dot(p,n) < d, p = p - 2 (dot(p,n) - d) n (child's half n.p >= d mirrored)")
_spec(Op.ELONGATE, F.POINT, (), False, 3, "[hx hy hz]: p = p - clamp(p, -h, h)")

_spec(Op.UNION, F.COMBINE, AB, True, 0, "min(a, b); mat of the smaller (a on ties)", np.minimum)
_spec(Op.INTERSECT, F.COMBINE, AB, True, 0, "max(a, b); mat of the larger (a on ties)", np.maximum)
_spec(Op.DIFFERENCE, F.COMBINE, AB, True, 0, "max(a, -b); mat of a", lambda a, b: np.maximum(a, -b))
_spec(Op.XOR, F.COMBINE, AB, True, 0, "max(min(a, b), -max(a, b)); mat of the smaller",
      lambda a, b: np.maximum(np.minimum(a, b), -np.maximum(a, b)))
_spec(Op.SMOOTH_UNION, F.COMBINE, AB, True, 1,
      "[k]: h = max(k-|a-b|,0)/k; min(a,b) - h*h*k/4; mat of the smaller", _smin, tolerance=GEOMETRIC)
_spec(Op.SMOOTH_INTERSECT, F.COMBINE, AB, True, 1, "[k]: -smin(-a, -b, k); mat of the larger",
      lambda a, b, k: -_smin(-a, -b, k), tolerance=GEOMETRIC)
_spec(Op.SMOOTH_DIFFERENCE, F.COMBINE, AB, True, 1, "[k]: -smin(-a, b, k); mat of a",
      lambda a, b, k: -_smin(-a, b, k), tolerance=GEOMETRIC)
_spec(Op.OFFSET, F.COMBINE, A, True, 1, "[r]: a - r (round / grow)", lambda a, r: a - r)
_spec(Op.SHELL, F.COMBINE, A, True, 1, "[t]: |a| - t", lambda a, t: np.abs(a) - t)

_spec(Op.REPEAT_LINEAR, F.PATTERN, (), False, 5,
      "[dx dy dz n e]: n copies at k*d (k=0..n-1); e = child half-extent along d. Evaluates the body "
      "for the nearest index c=clamp(round(t),0,n-1), t=dot(p,d)/dot(d,d), and its neighbour towards t; "
      "unchecked copies are bounded by min(|t-k|)*|d| - e. jump = index of the REPEAT_END.")
_spec(Op.REPEAT_POLAR, F.PATTERN, (), False, 5, tolerance=_POLAR, doc=
      "[n cx cy cz R]: n copies rotated by 2*pi*k/n about z; (c, R) the child's bounding sphere. "
      "Nearest sector and its neighbour are evaluated; unchecked sectors bounded by |p - rot_k c| - R.")
_spec(Op.REPEAT_GRID, F.PATTERN, (), False, 9,
      "[sx sy sz nx ny nz ex ey ez]: copies at (i*sx, j*sy, k*sz), i<nx, j<ny, k<nz; e the child's "
      "half extents. The 2x2x2 nearest cells are evaluated; unchecked cells bounded per axis by "
      "min(|t-k|)*s - e.")
_spec(Op.INSTANCES, F.PATTERN, (), False, 20,
      "Irregular instance list: aux = first BVH node (tape.bvh), a = BVH node count (not registers), "
      "jump = index of the REPEAT_END. BVH nodes are in depth-first preorder; node.skip is the index "
      "just past its subtree; node.instance >= 0 marks a leaf (index into tape.instances). Params "
      "[x0 y0 z0 x1 y1 z1  ax ay az bx by bz r  gx gy gz e nx ny nz  rep...]: the child's box; a "
      "capsule (segment ab, radius r) inside the child (r < 0: none); a grid of nx*ny*nz cells of "
      "edge e from g, x fastest, naming a representative instance each (nx*ny*nz more params, "
      "present when r >= 0). An instance's value is max(body, b, c): b the distance * scale from p "
      "to its leaf box, c from its local point to the child's box; U = max(0, |p_k - ab| - r) * "
      "scale of the representative k of the cell holding p (clamped into the grid) is at least the "
      "least instance value, so nothing farther than U' = U + 2^-12 * (U + r * s_k * scale) + 2^-14 * "
      "max|p| * scale (INSTANCE_REACH: room for rounding; +inf without a capsule) can hold it. Walk: "
      "accum = +inf; at node "
      "i, b = box distance * scale; if b >= accum or b > U': i = skip; elif leaf: the local point "
      "p = conj(q) * (p_saved - t) * q / s, scale = scale_saved * s, c as above; if max(b, c) >= "
      "accum or > U': i = i + 1, else evaluate the body there, accum = min(accum, max(body, b, c)), "
      "i = i + 1; else i = i + 1. A skipped node or leaf never holds the least value (exact). "
      "The value is the least max(body, b, c) over the leaves whatever order they are run in, so a "
      "walker may run any leaf with max(b, c) <= U' first and start accum from its value (the GPU "
      "runs the leaf that held its last walk's least value: interpreter.wgsl walk_hint; the twin "
      "the same along a ray: cpu.py's workspace hint); on an "
      "exact tie between two leaves the material may then be the other's. No output shows "
      "that: the GPU kernels that write a material (eval_points, surface) run one evaluation an "
      "invocation, with no hint; the GPU march, which keeps hints, runs without materials; the "
      "twin's hinted walks also visit what ties with the hinted leaf and precedes it in tree "
      "order, so they keep the first of tied leaves, as a walk without a hint does, and its "
      "march takes its hits' materials from its last step. "
      "INSTANCE_INDEX reads the instance index.")
_spec(Op.REPEAT_END, F.PATTERN, A, True, 0,
      "a = body result; accumulates min over iterations into reg[dst] (with the unchecked bound), "
      "REPEAT_*: a copy counts as max(body, copy bound), the copy bound being the distance * scale "
      "from the copy's point to the child's box (grid: half extents e), slab (linear: |p.d|/|d| <= e) "
      "or sphere (polar: c, R); a copy whose bound is >= the running minimum cannot change the value "
      "and may be skipped (exact; the GPU skips it, the twin skips it where a whole block may). "
      "jump = index of the REPEAT_* / INSTANCES that opened the loop; restores p and scale when "
      "done. The loop's running minimum lives in the loop frame, not in reg[dst]; bodies never "
      "write reg[dst]. For REPEAT_GRID, INSTANCE_INDEX is i + nx*(j + ny*k).")
_spec(Op.CULL_BOX, F.CULL, A, True, 7,
      "[x0 y0 z0 x1 y1 z1 m]: b = signed distance from p to the box * scale; ALWAYS reg[dst] = b, "
      "mat[dst] = aux; then if b >= reg[a] + m, jump. a is the running union. The flattener emits "
      "CULL_BOX(dst=t) <subtree into t+1> INTERSECT(t, a=t+1, b=t) and jumps to the UNION after it, "
      "so the subtree always counts as max(v, b): culled and unculled fields are equal exactly.")
_spec(Op.FIELD_RESULT, F.MATERIAL, A, True, 0,
      "reg[dst] = reg[a] * scale; mat[dst] = aux. Closes an arithmetic field: its value, computed "
      "from the local point, becomes a distance in the tape's units, with the field's material.")

OPS: dict[Op, OpSpec] = {s.op: s for s in _S}
assert set(OPS) == set(Op), set(Op) - set(OPS)


def _class_ranges() -> dict[OpClass, tuple[Op, Op]]:
    """Each class's first and last op; raises unless ``Op`` declares the classes one after another
    in ``OpClass`` order, and VAR_X, VAR_Y, VAR_Z as 0, 1, 2 (kernels index the point by them)."""
    for before, op in zip(Op, list(Op)[1:]):
        if OPS[op].op_class < OPS[before].op_class:
            raise ImportError(f"runtime.opcodes: Op.{op.name} ({OPS[op].op_class.name.lower()}) is declared "
                              f"after Op.{before.name} ({OPS[before].op_class.name.lower()}): declare each op "
                              f"with the other ops of its class, classes in OpClass order")
    if (Op.VAR_X, Op.VAR_Y, Op.VAR_Z) != (0, 1, 2):
        raise ImportError("runtime.opcodes: VAR_X, VAR_Y, VAR_Z must be the ops 0, 1, 2")
    ranges = {}
    for op in Op:
        first, _ = ranges.get(OPS[op].op_class, (op, op))
        ranges[OPS[op].op_class] = (first, op)
    missing = [c.name for c in OpClass if c not in ranges]
    if missing:
        raise ImportError(f"runtime.opcodes: classes without an op: {missing}")
    return ranges


# OpClass -> (first op, last op): the numbers a class covers, in the generated headers as
# OP_<CLASS>_FIRST / OP_<CLASS>_LAST (WGSL) and <CLASS>_FIRST / <CLASS>_LAST (the Numba kernels)
CLASS_RANGES: dict[OpClass, tuple[Op, Op]] = _class_ranges()


def numba_constants() -> dict[str, object]:
    """The constants of ``runtime/op_numbers.py``, which the Numba modules import (generated by
    ``runtime.wgsl_header``), by name."""
    out: dict[str, object] = {op.name: int(op) for op in Op}
    for cls, (first, last) in CLASS_RANGES.items():
        out[f"{cls.name}_FIRST"], out[f"{cls.name}_LAST"] = int(first), int(last)
    out.update(STACK_CAP=STACK_CAP, LOOP_CAP=LOOP_CAP, INSTANCE_REACH_REL=INSTANCE_REACH[0],
               INSTANCE_REACH_POS=INSTANCE_REACH[1])
    return out


def check_numba_constants(module_globals: dict, module: str) -> None:
    """Raises ImportError naming the constants where a module's numbers (from runtime/op_numbers.py)
    differ from the table (it was not regenerated after an edit of this file)."""
    stale = sorted(k for k, v in numba_constants().items() if module_globals.get(k) != v)
    if stale:
        raise ImportError(f"{module}: its generated op numbers differ from runtime.opcodes at {stale[:8]}: "
                          "run `python -m taperay.runtime.wgsl_header`")

# the field of REPEAT_* / CULL_BOX / REPEAT_END that holds the jump target
JUMPING = {Op.REPEAT_LINEAR, Op.REPEAT_POLAR, Op.REPEAT_GRID, Op.INSTANCES, Op.REPEAT_END, Op.CULL_BOX}
REPEATS = {Op.REPEAT_LINEAR: 2, Op.REPEAT_POLAR: 2, Op.REPEAT_GRID: 8,   # body evaluations per point
           Op.INSTANCES: 0}                                            # (0: as many as the BVH walk visits)
POLY_OPS = {Op.EXTRUDE_POLY: 1, Op.REVOLVE_POLY: 0}  # fixed params before the vertex list


# Derivatives where an op is not differentiable everywhere: what the JAX walker
# (runtime/jax_walker.py) returns, JAX's convention unless said otherwise. Ops not listed are
# smooth where their value is finite. "Selects" (the twin's MIN / MAX / UNION ... rule, a on
# ties) pass the derivative of the operand whose value they pass, so a tie takes a's, the operand
# whose material wins; shapes' inner max / min (box, cylinder caps, cone) are jnp.maximum /
# jnp.minimum, which split a tie's derivative equally. Norms inside shapes (|p|, |p.xy|, edge
# distances) have derivative 0 where they are 0 (a plain sqrt would give NaN).
DERIVATIVES: dict[Op, str] = {
    Op.FLOOR: "0", Op.CEIL: "0", Op.ROUND: "0", Op.NOT: "0", Op.COMPARE: "0", Op.RAND: "0",
    Op.INSTANCE_INDEX: "0",
    Op.ABS: "sign(a); 0 at a == 0",
    Op.SQRT: "1 / (2 sqrt(a)): +inf at 0, NaN below",
    Op.RECIP: "-1/a^2: inf at 0", Op.DIV: "inf / NaN where b == 0",
    Op.LN: "1/a: inf at 0", Op.ASIN: "inf at |a| == 1", Op.ACOS: "inf at |a| == 1",
    Op.ATAN2: "NaN at a == b == 0",
    Op.MIN: "select: the smaller's (a on ties)", Op.MAX: "select: the larger's (a on ties)",
    Op.AND: "select: a's where a == 0, else b's", Op.OR: "select: a's where a != 0, else b's",
    Op.MOD: "JAX's rem: d/da 1, d/db -trunc(a/b), plus d|b| where the remainder was negative",
    Op.UNION: "select (a on ties)", Op.INTERSECT: "select (a on ties)",
    Op.DIFFERENCE: "select between a and -b (a on ties)", Op.XOR: "selects, as its min / max",
    Op.SMOOTH_UNION: "smooth (h's max(., 0) is continuous in value and slope)",
    Op.SMOOTH_INTERSECT: "as SMOOTH_UNION", Op.SMOOTH_DIFFERENCE: "as SMOOTH_UNION",
    Op.SHELL: "sign(a) (0 at a == 0)",
    Op.MIRROR: "the branch taken (dot(p, n) < d: reflected)", Op.ELONGATE: "clamp: 0 w.r.t. p inside [-h, h]",
    Op.EXTRUDE_POLY: "the nearest edge's; the inside sign (a crossing count) 0",
    Op.REVOLVE_POLY: "as EXTRUDE_POLY",
    Op.REPEAT_LINEAR: "the cells (round / clamp) 0: the derivative of the copy or bound holding the minimum",
    Op.REPEAT_POLAR: "as REPEAT_LINEAR", Op.REPEAT_GRID: "as REPEAT_LINEAR",
    Op.INSTANCES: "the least leaf's (first in tree order on ties); instance transforms and BVH boxes are "
                  "not pool entries: no derivative w.r.t. them",
    Op.CULL_BOX: "b is smooth; the cull itself (a per-point select) 0",
}
