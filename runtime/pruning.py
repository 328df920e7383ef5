"""Interval arithmetic and per-tile tape pruning on the CPU (Numba): the fast path for math tapes.

Owns the float32 interval evaluator of arithmetic-only tapes, the pruner that shortens a tape
for one tile, and the drivers built on them: ``sign_image`` / ``field_image_pruned`` (2D, the
plane z = const, hierarchical tiles), ``evaluate_pruned`` (points in 3D, bucketed into voxels) and
``march_pruned`` (the 3D march, every step's points on the tapes of a fixed grid of cells).

Interval evaluation (``runtime.intervals`` is the float64 reference it implements):
  * an interval is a float32 pair (lo, hi); "may be NaN" is lo = hi = NaN and propagates by the
    reference's rules (AND / OR ignore a NaN operand they never select);
  * it contains every value the point interpreter (``runtime.cpu``) computes for points in the
    box, and the exact real values too. Rounding is outward and at least one float32 ulp where
    a bound may be inexact: add / sub scale the rounded bound by (1 -/+ 2^-23) (a float32 sum
    that rounds to 0 or a subnormal is exact and is kept, so 0 stays 0); mul / square bound the
    exact float64 products; recip / div / mod widen by an ulp; sqrt (correctly rounded, exact at
    0) and the transcendental ops (computed in float64) widen by ``WIDEN_ULPS``; exact ops (neg,
    abs, floor, ceil, round, min, max, compare, not, and, or) are not widened. Widening uses
    arithmetic (``_wdn`` / ``_wup``), not nextafter, with a 2^-60 floor that keeps widened
    zeros out of the slow subnormal range;
  * "may be NaN" is also raised where a point can be NaN although the reference's endpoint
    formulas say it cannot: inf - inf inside add / sub (e.g. [1, inf] + [-inf, -1]), 0 * inf
    inside mul ([-1, 1] * [1, inf]) and tan of an infinite bound. Pruning relies on it: a
    MIN / MAX decided on a NaN point would not be exact;
  * MIN / MAX / AND / OR record a choice per instruction (``intervals.choice``: CHOICE_A /
    CHOICE_B where the op equals one operand on the whole box, ties to a, CHOICE_BOTH otherwise).

Pruning (``prune``): a backward liveness pass over the tape (registers are reused: not SSA). A
decided MIN / MAX / AND / OR becomes COPY dst <- chosen operand, or disappears when dst is the
chosen operand; instructions whose result is never read are dropped. Register numbering is kept,
so the pruned tape is run by the same interpreter and gives bit-identical values (and material
ids) at every point of the box: a decided op returns its chosen operand bit for bit (the point
rule ``_fmin`` / ``_fmax`` returns a on ties, b only where b < a).

The union bound (``_union_bound``): a MIN compares each operand with its sibling alone, but in
a union (a tree of MINs, each inner one read once, by a MIN) an operand matters only where it
is below every other operand of the whole union. The interval pass keeps each MIN / MAX
record's sides (a's and b's far bounds: lower for MIN, upper for MAX; the result's near bound:
upper for MIN, lower for MAX); the backward pass hands each operand of a live MIN the bound h =
min(the bound its own reader handed it, its result's upper bound), which is at least the
union's value everywhere in the box, and drops an operand whose lower bound exceeds h (MAX:
mirrored). Such an operand is above the union's value everywhere, so the union's value, and
its material, stay bit for bit; a value read a second time (by anything) gets no bound. The
march cells (``march_pruned``), whose tapes run every step of every frame, take the rule; the
per-call images and points do not (an empty sides array): there keeping the sides costs their
interval passes more than the shorter tapes save (docs/PERFORMANCE.md, ideas not kept), as
on the GPU (prune.wgsl UNION_BOUND), where the cells' first level does without it too (its
dependency steps, prune_wave, ran slower for the rule's code alone).

Hierarchical tiles (2D), one parallel launch per image: the whole image is evaluated once and
pruned; then the top tiles (first entry of ``tiles``, in pixels) are evaluated together in lanes
of ``_LANES`` boxes; each top tile (prange) is pruned and walked depth first: its children (next entry of ``tiles``) are evaluated together with the parent's
pruned tape, pruned again, and the last level's tiles evaluate their pixels with their own
pruned tape. A tile's box is the range of its float32 pixel centres (exactly the points the
image evaluates), so decisions hold at every pixel. ``sign_image`` fills tiles whose interval is
entirely < 0 (inside) or >= 0 (outside) without evaluating pixels; ``field_image_pruned``
evaluates every pixel with its tile's pruned tape and equals ``CpuWalker.field_image`` bit for
bit. ``evaluate_pruned`` buckets points into a grid of voxels over the tape bounds (points
outside fall into the edge voxels) and prunes per voxel, the voxel box being the points' range.

Pixel / point evaluation runs this module's arithmetic-only block interpreter, which handles
VAR_* / CONST / INSTANCE_INDEX itself and runs every other op with the CPU twin's own per-op block
code (``runtime.cpu._arith_block``, the loops the twin's interpreter runs; MOD's rule ``_rem32``,
used by the interval MOD too, is the twin's as well); tests check it against
``CpuWalker.evaluate`` bit for bit. Arithmetic-only tapes
have material 0 everywhere (VAR_*, CONST, INSTANCE_INDEX write 0; every other op carries an
operand's material). Tapes with any op outside ``Family.ARITH`` (shapes, point ops, combine,
patterns, culls, materials) are not pruned: every entry point falls back to ``CpuWalker``, except
that ``march_pruned`` also takes scene fields (FIELD_OPS: the values prune as COPY / MIN / MAX,
the materials at the hits come from the full tape). ``cell_tape`` gives the tape the GPU's render
prunes for a scene tape: itself, or its lowering (``runtime.lowering``).
"""
from __future__ import annotations

import numpy as np

from . import twin
from .intervals import CHOICE_A, CHOICE_B, CHOICE_BOTH, WIDEN_ULPS
from .jit_cache import njit, prange
from .lowering import NotLowerable, lower
from .opcodes import OPS, Family, Op, check_numba_constants
from .shading import RenderSettings
from .tape import CellsTooLarge, Tape, TaperayError, content_key, point_array, validate
from .twin import _arith_block, _hit_threshold, _packed, _rem32, _round, _row_back, _scratch_row, _section

__all__ = ["is_arithmetic", "compact_records", "light_pruned", "cell_tape", "interval_eval", "interval_op", "prune", "sign_image",
           "field_image_pruned", "evaluate_pruned", "march_pruned", "cells_shorten", "DEFAULT_TILES",
           "CELLS_PAY_SHARE"]

DEFAULT_TILES = (256, 64, 16)   # 2D tile sizes in pixels, coarse to fine
# CpuWalker.render's "auto" marches on cells only where their tapes are at most this share of the
# whole tape (cells_shorten): the wavefront's per-step bucketing must be paid for. The level-7
# Menger sponge's cells keep 0.68 of its records, and its frames ran 20 % slower on them (twin,
# 2 cores, 320x180, 122-126 against 103-104 ms); 100 lowered primitives keep 0.11, Prospero 0.05.
CELLS_PAY_SHARE = 0.5

# The opcode numbers, class ranges and capacities (runtime/op_numbers.py, generated from
# runtime.opcodes). Numba freezes globals into its on-disk cache, which notices edits to THIS file
# only: the generated block names the numbers' hash, so a renumbering edits this file and its
# cached kernels recompile. tests/test_wgsl_header.py fails when either drifts from the table.
from .op_numbers import *  # noqa: E402,F403
# ---- BEGIN GENERATED by taperay.runtime.wgsl_header from runtime/opcodes.py: do not edit ----
# op numbers 3feab31dfaae9336: runtime/op_numbers.py, imported above
# ---- END GENERATED ----
check_numba_constants(globals(), __name__)
_CH_BOTH, _CH_A, _CH_B, _WIDEN = 0, 1, 2, 2

if (_CH_BOTH, _CH_A, _CH_B, _WIDEN) != (CHOICE_BOTH, CHOICE_A, CHOICE_B, WIDEN_ULPS):
    raise ImportError("runtime.pruning: choice codes differ from runtime.intervals")

_f = np.float32
F0, F1 = _f(0), _f(1)
INF, NAN = _f(np.inf), _f(np.nan)
PI64 = np.pi
_JIT = dict(cache=True, error_model="numpy", fastmath=False)


# ----------------------------------------------------------------------------- rounding helpers
_EPS, _TINY, _FMAX = _f(2.0 ** -23), _f(2.0 ** -60), _f(np.finfo(np.float32).max)


@njit(**_JIT)
def _wdn(x):
    """A float32 below x by at least one ulp: x - |x| 2^-23 - 2^-60 (+inf becomes the largest
    float). Branch-free, unlike nextafter. The 2^-60 also keeps widened zeros far from the
    subnormal range, whose arithmetic is ~100x slower on x86 (a product of two widened zeros
    stays normal). The hot paths here are written without data-dependent branches: interval
    outcomes vary from lane to lane, and mispredicted branches cost more than the arithmetic."""
    r = x * (F1 - np.copysign(_EPS, x)) - _TINY
    return _FMAX if r == INF else r


@njit(**_JIT)
def _wup(x):
    r = x * (F1 + np.copysign(_EPS, x)) + _TINY
    return -_FMAX if r == -INF else r


@njit(**_JIT)
def _sum_dn(s):
    """A lower bound of the exact sum whose float32 rounding is ``s``: one float32 addition is
    exact when its result is 0 or subnormal (kept), else s - |s| 2^-23 is at least an ulp below
    (infinities are kept). Zero staying zero matters: sqrt(x^2 + y^2) must not see -0 - ulp."""
    return s * (F1 - np.copysign(_EPS, s))


@njit(**_JIT)
def _sum_up(s):
    return s * (F1 + np.copysign(_EPS, s))


@njit(**_JIT)
def _f32_dn(x):
    """A float32 lower bound of the float64 x (the rounded value, or one step below it)."""
    r = _f(x)
    return r if r <= x else _wdn(r)


@njit(**_JIT)
def _f32_up(x):
    r = _f(x)
    return r if r >= x else _wup(r)


@njit(**_JIT)
def _lo32(x, ulps):
    """A float32 lower bound of the float64 ``x``, widened by ``ulps`` more float32 ulps."""
    r = _f32_dn(x)
    for _ in range(ulps):
        r = _wdn(r)
    return r


@njit(**_JIT)
def _hi32(x, ulps):
    r = _f32_up(x)
    for _ in range(ulps):
        r = _wup(r)
    return r


@njit(**_JIT)
def _nan2(alo, ahi, blo, bhi):
    return alo != alo or ahi != ahi or blo != blo or bhi != bhi


@njit(**_JIT)
def _has0(lo, hi):
    return lo <= F0 and hi >= F0


# ----------------------------------------------------------------------------- interval ops
@njit(**_JIT)
def _iv_add(alo, ahi, blo, bhi):
    bad = ((ahi == INF) & (blo == -INF)) | ((alo == -INF) & (bhi == INF))    # inf - inf
    lo, hi = _sum_dn(alo + blo), _sum_up(ahi + bhi)        # NaN operands give NaN bounds
    return (NAN if bad else lo), (NAN if bad else hi)


@njit(**_JIT)
def _iv_mul(alo, ahi, blo, bhi):
    zero_inf = (((alo <= F0) & (ahi >= F0)) & ((blo == -INF) | (bhi == INF))) | \
        (((blo <= F0) & (bhi >= F0)) & ((alo == -INF) | (ahi == INF)))       # 0 * inf inside
    nan = zero_inf | (alo != alo) | (blo != blo)
    al, ah, bl, bh = np.float64(alo), np.float64(ahi), np.float64(blo), np.float64(bhi)
    p0, p1, p2, p3 = al * bl, al * bh, ah * bl, ah * bh     # exact in float64
    lo, hi = _f32_dn(min(min(p0, p1), min(p2, p3))), _f32_up(max(max(p0, p1), max(p2, p3)))
    return (NAN if nan else lo), (NAN if nan else hi)


@njit(**_JIT)
def _iv_div(alo, ahi, blo, bhi):
    if _nan2(alo, ahi, blo, bhi):
        return NAN, NAN
    if _has0(blo, bhi):
        if _has0(alo, ahi):
            return NAN, NAN   # 0 / 0
        return -INF, INF
    if (alo == -INF or ahi == INF) and (blo == -INF or bhi == INF):
        return NAN, NAN       # inf / inf
    q0, q1, q2, q3 = alo / blo, alo / bhi, ahi / blo, ahi / bhi
    return _wdn(min(min(q0, q1), min(q2, q3))), _wup(max(max(q0, q1), max(q2, q3)))


@njit(**_JIT)
def _iv_abs(lo, hi):
    return max(max(lo, -hi), F0), max(-lo, hi)          # (NaN bounds: the caller's)


@njit(**_JIT)
def _iv_square(lo, hi):
    l, h = _iv_abs(lo, hi)
    l64, h64 = np.float64(l), np.float64(h)
    l, h = max(_f32_dn(l64 * l64), F0), _f32_up(h64 * h64)  # exact in float64; never below 0
    nan = lo != lo
    return (NAN if nan else l), (NAN if nan else h)


@njit(**_JIT)
def _iv_recip(lo, hi):
    if lo != lo or hi != hi or (lo == F0 and hi == F0):
        return NAN, NAN
    if _has0(lo, hi):
        return -INF, INF
    return _wdn(F1 / hi), _wup(F1 / lo)


@njit(**_JIT)
def _iv_sqrt(lo, hi):
    l, h = np.sqrt(max(lo, F0)), np.sqrt(hi)                 # correctly rounded; 0 is exact
    for _ in range(_WIDEN):
        l, h = _wdn(l), _wup(h)
    l, h = max(l, F0), (h if hi > F0 else F0)
    nan = (lo < F0) | (lo != lo)
    return (NAN if nan else l), (NAN if nan else h)


@njit(**_JIT)
def _sin_range(lo, hi, shift):
    """Range of sin(x + shift) over [lo, hi] in float64 (endpoints evaluated as sin or cos)."""
    if shift == 0.0:
        s_lo, s_hi = np.sin(lo), np.sin(hi)
    else:
        s_lo, s_hi = np.cos(lo), np.cos(hi)
    lo, hi = lo + shift, hi + shift
    wide = (hi - lo) >= 2 * PI64
    has_max = np.floor((hi - PI64 / 2) / (2 * PI64)) >= np.ceil((lo - PI64 / 2) / (2 * PI64))
    has_min = np.floor((hi + PI64 / 2) / (2 * PI64)) >= np.ceil((lo + PI64 / 2) / (2 * PI64))
    out_lo = -1.0 if (wide or has_min) else min(s_lo, s_hi)
    out_hi = 1.0 if (wide or has_max) else max(s_lo, s_hi)
    return out_lo, out_hi


@njit(**_JIT)
def _iv_sincos(alo, ahi, shift):
    """SIN (shift 0) / COS (shift pi/2) in float64, rounded outward to float32 + WIDEN_ULPS."""
    if alo != alo or ahi != ahi:
        return NAN, NAN
    lo, hi = np.float64(alo), np.float64(ahi)
    if np.isinf(lo) or np.isinf(hi):
        return NAN, NAN
    rl, rh = _sin_range(lo, hi, shift)
    return _lo32(rl, _WIDEN), _hi32(rh, _WIDEN)


@njit(**_JIT)
def _iv_tan(alo, ahi):
    """TAN in float64, rounded outward to float32 + WIDEN_ULPS; (-inf, inf) across a pole."""
    if alo != alo or ahi != ahi:
        return NAN, NAN
    lo, hi = np.float64(alo), np.float64(ahi)
    if np.isinf(lo) or np.isinf(hi):
        return NAN, NAN
    rl, rh = np.tan(lo), np.tan(hi)
    pole = np.floor((hi - PI64 / 2) / PI64) >= np.ceil((lo - PI64 / 2) / PI64)
    if pole or (hi - lo) >= PI64 or rl > rh:
        return -INF, INF
    return _lo32(rl, _WIDEN), _hi32(rh, _WIDEN)


@njit(**_JIT)
def _iv_atan2(alo, ahi, blo, bhi):
    """ATAN2(y = a, x = b) in float64 from the corners, rounded outward to float32 + WIDEN_ULPS;
    [-pi, pi] where the box may hold the branch cut or the origin."""
    if _nan2(alo, ahi, blo, bhi):
        return NAN, NAN
    lo, hi = np.float64(alo), np.float64(ahi)
    xl, xh = np.float64(blo), np.float64(bhi)
    if lo > 0.0 or hi < 0.0 or xl > 0.0:
        c0, c1 = np.arctan2(lo, xl), np.arctan2(lo, xh)
        c2, c3 = np.arctan2(hi, xl), np.arctan2(hi, xh)
        rl, rh = min(min(c0, c1), min(c2, c3)), max(max(c0, c1), max(c2, c3))
    else:
        rl, rh = -PI64, PI64
    return _lo32(rl, _WIDEN), _hi32(rh, _WIDEN)


@njit(**_JIT)
def _iv_mod(alo, ahi, blo, bhi):
    if _nan2(alo, ahi, blo, bhi) or _has0(blo, bhi) or np.isinf(alo) or np.isinf(ahi):
        return NAN, NAN
    if blo == bhi and blo > F0:
        # one period (no multiple of b in (alo, ahi]) iff width < b and rem(alo) < rem(ahi), in
        # exact arithmetic; both tests are done with monotone float64 rounding, strictly.
        b = np.float64(blo)
        r_lo, r_hi = np.fmod(np.float64(alo), b), np.fmod(np.float64(ahi), b)
        r_lo = r_lo + b if r_lo < 0.0 else r_lo
        r_hi = r_hi + b if r_hi < 0.0 else r_hi
        if alo == ahi or (np.float64(ahi) - np.float64(alo) < b and r_lo < r_hi):
            return _wdn(_rem32(alo, blo)), _wup(_rem32(ahi, blo))
    return F0, _wup(max(abs(blo), abs(bhi)))


@njit(**_JIT)
def _iv_compare(alo, ahi, blo, bhi):
    if _nan2(alo, ahi, blo, bhi):
        return NAN, NAN
    lt, gt = ahi < blo, alo > bhi
    eq = alo == ahi and blo == bhi and alo == blo
    lo = F1 if gt else (F0 if eq else -F1)
    hi = -F1 if lt else (F0 if eq else F1)
    if not lt and not gt and not eq:
        if alo >= bhi:
            lo = F0
        if ahi <= blo:
            hi = F0
    return lo, hi


@njit(**_JIT)
def _iv_not(alo, ahi):
    """NOT: 1 where a may be 0, 0 where a may be non-zero; a may be NaN (anything): 0 or 1."""
    if alo != alo or ahi != ahi:
        return F0, F1
    return (F1 if alo == F0 and ahi == F0 else F0), (F1 if _has0(alo, ahi) else F0)


@njit(**_JIT)
def _iv_logic(op, alo, ahi, blo, bhi):
    """AND / OR by the reference's rules, with the choice."""
    if alo != alo or ahi != ahi:
        return NAN, NAN, _CH_BOTH
    nonzero = alo > F0 or ahi < F0
    zero_only = alo == F0 and ahi == F0
    bnan = blo != blo or bhi != bhi
    if op == AND:
        ch = _CH_B if nonzero else (_CH_A if zero_only else _CH_BOTH)
        if zero_only:
            return F0, F0, ch
        if bnan:
            return NAN, NAN, ch
        if nonzero:
            return blo, bhi, ch
        return min(F0, blo), max(F0, bhi), ch
    ch = _CH_A if nonzero else (_CH_B if zero_only else _CH_BOTH)      # OR
    if nonzero:
        return alo, ahi, ch
    if bnan:
        return NAN, NAN, ch
    if zero_only:
        return blo, bhi, ch
    return min(alo, blo), max(ahi, bhi), ch


@njit(**_JIT)
def _iv_minmax(op, alo, ahi, blo, bhi):
    """MIN / MAX with the choice: CHOICE_A (1) where a decides, CHOICE_B (2) where b does; the
    comparisons are false on NaN bounds, giving CHOICE_BOTH (0)."""
    nan = (alo != alo) | (blo != blo)          # (a NaN interval has both bounds NaN)
    if op == MIN:
        pick_a, pick_b = ahi <= blo, bhi < alo
        lo, hi = min(alo, blo), min(ahi, bhi)
    else:
        pick_a, pick_b = alo >= bhi, blo > ahi
        lo, hi = max(alo, blo), max(ahi, bhi)
    ch = np.uint8(pick_a) | (np.uint8(pick_b) << np.uint8(1))
    return (NAN if nan else lo), (NAN if nan else hi), ch


@njit(**_JIT)
def _iv_mix(alo, ahi, blo, bhi, clo, chi):
    """MIX: a + (b - a) * c, rounded step by step like the points."""
    dl, dh = _iv_add(blo, bhi, -ahi, -alo)
    ml, mh = _iv_mul(dl, dh, clo, chi)
    return _iv_add(alo, ahi, ml, mh)


# The arithmetic ops' intervals, generated from the table's rules (OpSpec.interval, rank) by
# runtime.op_codegen: the monotone ops' cases from their scalar rules, the others calling the
# named rules above (_iv_add, _iv_minmax, ...).
# ---- BEGIN GENERATED intervals by taperay.runtime.op_codegen from runtime/opcodes.py: do not edit ----
@njit(**_JIT)
def _iv_monotone64(op, alo, ahi):
    """ASIN ACOS ATAN EXP LN: monotone, computed in float64 at the bounds (NaN outside the
    domain), rounded outward to float32 + WIDEN_ULPS."""
    if alo != alo or ahi != ahi:
        return NAN, NAN
    lo, hi = np.float64(alo), np.float64(ahi)
    rl, rh = np.nan, np.nan
    if op == ASIN:
        if lo < -1.0 or hi > 1.0:
            return NAN, NAN
        rl, rh = np.arcsin(lo), np.arcsin(hi)
    elif op == ACOS:
        if lo < -1.0 or hi > 1.0:
            return NAN, NAN
        rl, rh = np.arccos(hi), np.arccos(lo)
    elif op == ATAN:
        rl, rh = np.arctan(lo), np.arctan(hi)
    elif op == EXP:
        rl, rh = np.exp(lo), np.exp(hi)
    elif op == LN:
        if lo < 0.0:
            return NAN, NAN
        rl, rh = np.log(lo), np.log(hi)
    return _lo32(rl, _WIDEN), _hi32(rh, _WIDEN)


@njit(**_JIT)
def _iv(op, alo, ahi, blo, bhi, clo, chi):
    """One interval op on scalars: (lo, hi, choice), hottest first (OpSpec.rank). VAR_* / CONST /
    INSTANCE_INDEX are the caller's (they read the box and the parameter pool). An op of no case
    (validate() rejects such tapes) gets the NaN interval: it may be anything."""
    ch = _CH_BOTH
    if op == MAX:
        return _iv_minmax(MAX, alo, ahi, blo, bhi)
    elif op == SUB:
        lo, hi = _iv_add(alo, ahi, -bhi, -blo)
    elif op == ADD:
        lo, hi = _iv_add(alo, ahi, blo, bhi)
    elif op == MIN:
        return _iv_minmax(MIN, alo, ahi, blo, bhi)
    elif op == COPY:
        lo, hi = alo, ahi
    elif op == NEG:
        lo, hi = -ahi, -alo
    elif op == SQUARE:
        lo, hi = _iv_square(alo, ahi)
    elif op == SQRT:
        lo, hi = _iv_sqrt(alo, ahi)
    elif op == MUL:
        lo, hi = _iv_mul(alo, ahi, blo, bhi)
    elif op == ABS:
        lo, hi = _iv_abs(alo, ahi)
    elif op == RECIP:
        lo, hi = _iv_recip(alo, ahi)
    elif op == DIV:
        lo, hi = _iv_div(alo, ahi, blo, bhi)
    elif op == FLOOR:
        lo, hi = np.floor(alo), np.floor(ahi)
    elif op == CEIL:
        lo, hi = np.ceil(alo), np.ceil(ahi)
    elif op == ROUND:
        lo, hi = _round(alo), _round(ahi)
    elif op == SIN:
        lo, hi = _iv_sincos(alo, ahi, 0.0)
    elif op == COS:
        lo, hi = _iv_sincos(alo, ahi, PI64 / 2)
    elif op == TAN:
        lo, hi = _iv_tan(alo, ahi)
    elif op == ASIN:
        lo, hi = _iv_monotone64(ASIN, alo, ahi)
    elif op == ACOS:
        lo, hi = _iv_monotone64(ACOS, alo, ahi)
    elif op == ATAN:
        lo, hi = _iv_monotone64(ATAN, alo, ahi)
    elif op == EXP:
        lo, hi = _iv_monotone64(EXP, alo, ahi)
    elif op == LN:
        lo, hi = _iv_monotone64(LN, alo, ahi)
    elif op == NOT:
        lo, hi = _iv_not(alo, ahi)
    elif op == ATAN2:
        lo, hi = _iv_atan2(alo, ahi, blo, bhi)
    elif op == COMPARE:
        lo, hi = _iv_compare(alo, ahi, blo, bhi)
    elif op == MOD:
        lo, hi = _iv_mod(alo, ahi, blo, bhi)
    elif op == AND:
        return _iv_logic(AND, alo, ahi, blo, bhi)
    elif op == OR:
        return _iv_logic(OR, alo, ahi, blo, bhi)
    elif op == MIX:
        lo, hi = _iv_mix(alo, ahi, blo, bhi, clo, chi)
    elif op == RAND:
        lo, hi = (F0, F1)
    else:
        lo, hi = NAN, NAN
    if lo != lo or hi != hi:
        return NAN, NAN, ch
    return lo, hi, ch
# ---- END GENERATED intervals ----


_LANES = 16     # boxes interval-evaluated together (one loop per record over them)


@njit(**_JIT)
def _interval_lanes(code, imm, start, end, box, lo, hi, choices, sides):
    """Evaluate tape records code[start:end] over ``_LANES`` boxes at once (a compile-time trip
    count: the lane loops unroll and vectorise; unused lanes repeat a box).

    box: (6, _LANES) float32 rows x_lo x_hi y_lo y_hi z_lo z_hi; lo / hi: (n_regs, _LANES)
    scratch; choices: (>=end, _LANES) uint8, written for MIN / MAX / AND / OR records; sides:
    (>=end, 3, _LANES) float32, written for MIN / MAX records (their union sides, ``_prune``), or
    empty (0, 3, _LANES): not kept. The result interval of lane k is (lo[0, k], hi[0, k])."""
    keep = sides.shape[0] > 0
    for i in range(start, end):
        op, d, a, b = code[i, 0], code[i, 1], code[i, 2], code[i, 3]
        if op == MAX:
            for k in range(_LANES):
                ahi, bhi = hi[a, k], hi[b, k]
                lo[d, k], hi[d, k], choices[i, k] = _iv_minmax(MAX, lo[a, k], ahi, lo[b, k], bhi)
                if keep:
                    sides[i, 0, k], sides[i, 1, k], sides[i, 2, k] = ahi, bhi, lo[d, k]
        elif op == SUB:
            for k in range(_LANES):
                lo[d, k], hi[d, k] = _iv_add(lo[a, k], hi[a, k], -hi[b, k], -lo[b, k])
        elif op == CONST:
            v = imm[i]
            for k in range(_LANES):
                lo[d, k], hi[d, k] = v, v
        elif op == ADD:
            for k in range(_LANES):
                lo[d, k], hi[d, k] = _iv_add(lo[a, k], hi[a, k], lo[b, k], hi[b, k])
        elif op == MIN:
            for k in range(_LANES):
                alo, blo = lo[a, k], lo[b, k]
                lo[d, k], hi[d, k], choices[i, k] = _iv_minmax(MIN, alo, hi[a, k], blo, hi[b, k])
                if keep:
                    sides[i, 0, k], sides[i, 1, k], sides[i, 2, k] = alo, blo, hi[d, k]
        elif op == NEG:
            for k in range(_LANES):
                lo[d, k], hi[d, k] = -hi[a, k], -lo[a, k]
        elif op == SQUARE:
            for k in range(_LANES):
                lo[d, k], hi[d, k] = _iv_square(lo[a, k], hi[a, k])
        elif op == SQRT:
            for k in range(_LANES):
                lo[d, k], hi[d, k] = _iv_sqrt(lo[a, k], hi[a, k])
        elif op == COPY:
            for k in range(_LANES):
                lo[d, k], hi[d, k] = lo[a, k], hi[a, k]
        elif op == MUL:
            for k in range(_LANES):
                lo[d, k], hi[d, k] = _iv_mul(lo[a, k], hi[a, k], lo[b, k], hi[b, k])
        elif op <= VAR_Z:
            for k in range(_LANES):
                lo[d, k], hi[d, k] = box[2 * op, k], box[2 * op + 1, k]
        elif op == INSTANCE_INDEX:
            for k in range(_LANES):
                lo[d, k], hi[d, k] = F0, F0
        else:
            c = code[i, 4]
            for k in range(_LANES):
                lo[d, k], hi[d, k], choices[i, k] = _iv(op, lo[a, k], hi[a, k], lo[b, k], hi[b, k],
                                                        lo[c, k], hi[c, k])


# ----------------------------------------------------------------------------- pruning
# the union bound a reader passes (_read): none, a MIN's upper bound, a MAX's lower bound
_BOUND_NONE, _BOUND_MIN, _BOUND_MAX = np.uint8(0), np.uint8(1), np.uint8(2)


@njit(**_JIT)
def _read(r, kind, bound, live, rkind, rbound):
    """Backward liveness: a record reads register r. Its first reader (going backward: its last)
    hands r the union bound it passes (kind: _BOUND_MIN / _BOUND_MAX, or _BOUND_NONE); a second
    reader clears it (r's value is then read by more than the union)."""
    if live[r]:
        rkind[r] = _BOUND_NONE
    else:
        live[r] = True
        rkind[r] = kind
        rbound[r] = bound


@njit(**_JIT)
def _union_bound(op, ch, far_a, far_b, near, dkind, dbound):
    """A live MIN / MAX record's union rule (module docstring): its bound h (the union's upper
    bound for MIN, lower for MAX: the one its reader passed, tightened by its own result's
    ``near`` bound) and its choice, where an operand whose far bound lies beyond h is dropped.
    Returns (kind passed to its operands, h, choice); _BOUND_NONE where its interval may be NaN."""
    kind = _BOUND_MIN if op == MIN else _BOUND_MAX
    if near != near:
        return _BOUND_NONE, F0, ch
    h = near
    if dkind == kind:
        h = min(dbound, near) if op == MIN else max(dbound, near)
    if ch == _CH_BOTH:
        if (far_a > h) if op == MIN else (far_a < h):
            ch = _CH_B
        elif (far_b > h) if op == MIN else (far_b < h):
            ch = _CH_A
    return kind, h, ch


@njit(**_JIT)
def _prune(code, imm, start, end, choice_row, side_row, live, out_code, out_imm, out_src):
    """Backward liveness over code[start:end] with one box's choices and MIN / MAX sides
    (side_row: (n, 3); NaN rows, or an empty (0, 3) side_row: no union rule); the pruned records are written to out_code /
    out_imm (out_src: the index each came from) ending at index ``end``; returns their first
    index. live: (n_regs,) bool scratch."""
    live[:] = False
    live[0] = True
    rkind = np.zeros(live.shape[0], np.uint8)
    rbound = np.empty(live.shape[0], np.float32)
    w = end
    for i in range(end - 1, start - 1, -1):
        op, d = code[i, 0], code[i, 1]
        if not live[d]:
            continue
        live[d] = False
        a, b = code[i, 2], code[i, 3]
        if op == MIN or op == MAX or op == AND or op == OR:
            ch = choice_row[i]
            kind, h = _BOUND_NONE, F0
            if (op == MIN or op == MAX) and side_row.shape[0] > 0:
                kind, h, ch = _union_bound(op, ch, side_row[i, 0], side_row[i, 1], side_row[i, 2], rkind[d],
                                           rbound[d])
            if ch != _CH_BOTH:
                src = a if ch == _CH_A else b
                _read(src, kind, h, live, rkind, rbound)
                if src == d:
                    continue
                w -= 1
                out_code[w, 0], out_code[w, 1], out_code[w, 2] = COPY, d, src
                out_code[w, 3], out_code[w, 4] = 0, 0
                out_imm[w] = F0
                out_src[w] = i
                continue
            w -= 1
            for f in range(5):
                out_code[w, f] = code[i, f]
            out_imm[w] = imm[i]
            out_src[w] = i
            _read(a, kind, h, live, rkind, rbound)
            _read(b, kind, h, live, rkind, rbound)
            continue
        w -= 1
        for f in range(5):
            out_code[w, f] = code[i, f]
        out_imm[w] = imm[i]
        out_src[w] = i
        if op > LEAF_LAST:                           # reads a; binary ops b; ternary c
            _read(a, _BOUND_NONE, F0, live, rkind, rbound)
            if op >= BINARY_FIRST:
                _read(b, _BOUND_NONE, F0, live, rkind, rbound)
                if op >= TERNARY_FIRST:
                    _read(code[i, 4], _BOUND_NONE, F0, live, rkind, rbound)
    return w


# ----------------------------------------------------------------------------- point interpreter
@njit(**_JIT)
def _eval_points(code, imm, start, end, regs, px, py, pz, n, out):
    """Arithmetic-only block interpreter: code[start:end] at n points; out[:n] = reg 0.
    The ops reading registers are runtime.cpu's ``_arith_block`` (the twin's own code); one that
    writes a register it reads writes the scratch row past the tape's registers first (regs has
    one row more: runtime.cpu._scratch_row says why)."""
    for i in range(start, end):
        op, d = code[i, 0], code[i, 1]
        if op == CONST:
            v = imm[i]
            for j in range(n):
                regs[d, j] = v
        elif op <= VAR_Z:
            q = px if op == VAR_X else (py if op == VAR_Y else pz)
            for j in range(n):
                regs[d, j] = q[j]
        elif op == INSTANCE_INDEX:
            for j in range(n):
                regs[d, j] = F0
        else:
            a, b, c = code[i, 2], code[i, 3], code[i, 4]
            t = _scratch_row(regs, d, a, b, c)
            _arith_block(op, regs, t, a, b, c, n)
            _row_back(regs, t, d, n)
    for j in range(n):
        out[j] = regs[0, j]


# ----------------------------------------------------------------------------- drivers
@njit(**_JIT)
def _boxes_group(code, imm, start, end, boxes, t0, box, lo, hi, ch, sd, out_lo, out_hi, out_choices, out_sides):
    """Interval-evaluate boxes[:, t0 : t0 + _LANES] (fewer at the end) into out_lo / out_hi /
    out_choices[start:end, t0:...] / out_sides[start:end, :, t0:...], with the scratch box / lo /
    hi / ch / sd of one lane group."""
    K = min(_LANES, boxes.shape[1] - t0)
    for k in range(_LANES):
        for r in range(6):
            box[r, k] = boxes[r, t0 + min(k, K - 1)]
    _interval_lanes(code, imm, start, end, box, lo, hi, ch, sd)
    for k in range(K):
        out_lo[t0 + k], out_hi[t0 + k] = lo[0, k], hi[0, k]
    for i in range(start, end):
        for k in range(K):
            out_choices[i, t0 + k] = ch[i, k]
        if (code[i, 0] == MIN or code[i, 0] == MAX) and out_sides.shape[0] > 0:
            for f in range(3):
                for k in range(K):
                    out_sides[i, f, t0 + k] = sd[i, f, k]


@njit(parallel=True, **_JIT)
def _lanes_kernel(code, imm, start, end, n_regs, boxes, out_lo, out_hi, choices, sides):
    """Interval-evaluate code[start:end] over every box (column of ``boxes``), in lane groups."""
    T = boxes.shape[1]
    for g in prange((T + _LANES - 1) // _LANES):
        _boxes_group(code, imm, start, end, boxes, g * _LANES, np.empty((6, _LANES), np.float32),
                     np.empty((n_regs, _LANES), np.float32), np.empty((n_regs, _LANES), np.float32),
                     np.empty((code.shape[0], _LANES), np.uint8), np.empty((code.shape[0], 3, _LANES), np.float32),
                     out_lo, out_hi, choices, sides)


@njit(**_JIT)
def _span(v, i0, i1):
    """Range of v[i0:i1] (a monotone run of float32 pixel centres)."""
    a, b = v[i0], v[i1 - 1]
    return min(a, b), max(a, b)


@njit(**_JIT)
def _leaf_pixels(code, imm, start, end, regs, px, py, pz, buf, xs, ys, zf, r0, r1, c0, c1,
                 field, sign, mode):
    n = np.int64(0)      # (int64 counters and arguments: runtime.cpu's _JIT)
    for r in range(r0, r1):
        for c in range(c0, c1):
            px[n], py[n], pz[n] = xs[c], ys[r], zf
            n += 1
    _eval_points(code, imm, start, end, regs, px, py, pz, n, buf)
    k = 0
    for r in range(r0, r1):
        for c in range(c0, c1):
            if mode == 0:
                field[r, c] = buf[k]
            else:
                sign[r, c] = buf[k] < F0
            k += 1


@njit(parallel=True, **_JIT)
def _image_kernel(code0, imm0, n_regs, tiles, xs, ys, zf, mode, field, sign, stats):
    """The whole image in one parallel launch (see the module docstring). mode 0: field, 1: sign.
    Serial: the image box and then the top tiles (``_LANES`` at a time) are interval-evaluated;
    parallel: each top tile is walked depth first. stats[t, l] += (tapes pruned, their total
    length) at level l for top tile t; stats[0, L] = (1, image tape length)."""
    H, W = ys.shape[0], xs.shape[0]
    L = tiles.shape[0]
    s0 = tiles[0]
    ntx, nty = (W + s0 - 1) // s0, (H + s0 - 1) // s0
    n_top = ntx * nty
    n = code0.shape[0]
    end = n
    code, imm = np.empty_like(code0), np.empty_like(imm0)
    lo = np.empty((n_regs, _LANES), np.float32)
    hi = np.empty((n_regs, _LANES), np.float32)
    box = np.empty((6, _LANES), np.float32)
    ch = np.empty((n, _LANES), np.uint8)
    sd = np.empty((0, 3, _LANES), np.float32)       # (images prune without the union rule)
    live = np.empty(n_regs, np.bool_)
    src = np.empty(n, np.int32)
    boxes = np.empty((6, max(n_top, 1)), np.float32)
    boxes[0, 0], boxes[1, 0] = _span(xs, np.int64(0), W)
    boxes[2, 0], boxes[3, 0] = _span(ys, np.int64(0), H)
    boxes[4, 0], boxes[5, 0] = zf, zf
    top_choices = np.empty((n, n_top), np.uint8)
    top_sides = np.empty((0, 3, n_top), np.float32)
    top_lo = np.empty(n_top, np.float32)
    top_hi = np.empty(n_top, np.float32)
    _boxes_group(code0, imm0, np.int64(0), n, boxes[:, :1].copy(), np.int64(0), box, lo, hi, ch, sd, top_lo,
                 top_hi, top_choices, top_sides)
    start = _prune(code0, imm0, np.int64(0), n, top_choices[:, 0], top_sides[:, :, 0], live, code, imm, src)
    stats[0, L, 0], stats[0, L, 1] = 1, end - start
    for t in range(n_top):
        a0, b0 = (t // ntx) * s0, (t % ntx) * s0
        boxes[0, t], boxes[1, t] = _span(xs, b0, min(b0 + s0, W))
        boxes[2, t], boxes[3, t] = _span(ys, a0, min(a0 + s0, H))
        boxes[4, t], boxes[5, t] = zf, zf
    for t0 in range(0, n_top, _LANES):
        _boxes_group(code, imm, start, end, boxes, t0, box, lo, hi, ch, sd, top_lo, top_hi, top_choices, top_sides)
    kmax = 1
    for l in range(L - 1):
        q = (tiles[l] + tiles[l + 1] - 1) // tiles[l + 1]
        kmax = max(kmax, q * q)
    groups = (kmax + _LANES - 1) // _LANES
    pmax = tiles[L - 1] * tiles[L - 1]
    for t in prange(n_top):
        r0, c0 = (t // ntx) * s0, (t % ntx) * s0
        r1, c1 = min(r0 + s0, H), min(c0 + s0, W)
        if mode == 1 and top_hi[t] < F0:
            sign[r0:r1, c0:c1] = True
            continue
        if mode == 1 and top_lo[t] >= F0:
            sign[r0:r1, c0:c1] = False
            continue
        tcode = np.empty((L, n, 5), np.int32)
        timm = np.empty((L, n), np.float32)
        tsrc = np.empty(n, np.int32)
        tstart = np.empty(L, np.int64)
        live = np.empty(n_regs, np.bool_)
        choices = np.empty((L, groups, n, _LANES), np.uint8)
        sides = np.empty((L, groups, 0, 3, _LANES), np.float32)
        lo = np.empty((n_regs, _LANES), np.float32)
        hi = np.empty((n_regs, _LANES), np.float32)
        clo = np.empty((L, groups * _LANES), np.float32)
        chi = np.empty((L, groups * _LANES), np.float32)
        box = np.empty((6, _LANES), np.float32)
        tr = np.empty((L, 4), np.int64)      # tile at each level: r0 r1 c0 c1
        kq = np.empty((L, 2), np.int64)      # children per row, children count
        idx = np.zeros(L, np.int64)
        regs = np.empty((n_regs + 1, pmax), np.float32)      # (+ _eval_points' scratch row)
        px = np.empty(pmax, np.float32)
        py = np.empty(pmax, np.float32)
        pz = np.empty(pmax, np.float32)
        buf = np.empty(pmax, np.float32)
        tstart[0] = _prune(code, imm, start, end, top_choices[:, t], top_sides[:, :, t], live, tcode[0], timm[0], tsrc)
        stats[t, 0, 0] += 1
        stats[t, 0, 1] += end - tstart[0]
        if L == 1:
            _leaf_pixels(tcode[0], timm[0], tstart[0], end, regs, px, py, pz, buf, xs, ys, zf,
                         r0, r1, c0, c1, field, sign, mode)
            continue
        tr[0, 0], tr[0, 1], tr[0, 2], tr[0, 3] = r0, r1, c0, c1
        l = 0
        descend = True
        while l >= 0:
            if descend:          # evaluate the children of the tile at level l with its tape
                cs = tiles[l + 1]
                nr = (tr[l, 1] - tr[l, 0] + cs - 1) // cs
                nc = (tr[l, 3] - tr[l, 2] + cs - 1) // cs
                kq[l, 0], kq[l, 1] = nc, nr * nc
                for g in range(groups):
                    for q in range(_LANES):      # lanes past the last child repeat it
                        k = min(g * _LANES + q, nr * nc - 1)
                        a0 = tr[l, 0] + (k // nc) * cs
                        b0 = tr[l, 2] + (k % nc) * cs
                        box[0, q], box[1, q] = _span(xs, b0, min(b0 + cs, tr[l, 3]))
                        box[2, q], box[3, q] = _span(ys, a0, min(a0 + cs, tr[l, 1]))
                        box[4, q], box[5, q] = zf, zf
                    _interval_lanes(tcode[l], timm[l], tstart[l], end, box, lo, hi, choices[l, g], sides[l, g])
                    for q in range(_LANES):
                        clo[l, g * _LANES + q], chi[l, g * _LANES + q] = lo[0, q], hi[0, q]
                idx[l] = 0
                descend = False
            if idx[l] >= kq[l, 1]:
                l -= 1
                continue
            k = idx[l]
            idx[l] += 1
            cs = tiles[l + 1]
            a0 = tr[l, 0] + (k // kq[l, 0]) * cs
            b0 = tr[l, 2] + (k % kq[l, 0]) * cs
            a1, b1 = min(a0 + cs, tr[l, 1]), min(b0 + cs, tr[l, 3])
            if mode == 1 and chi[l, k] < F0:
                sign[a0:a1, b0:b1] = True
                continue
            if mode == 1 and clo[l, k] >= F0:
                sign[a0:a1, b0:b1] = False
                continue
            tstart[l + 1] = _prune(tcode[l], timm[l], tstart[l], end, choices[l, k // _LANES, :, k % _LANES],
                                   sides[l, k // _LANES, :, :, k % _LANES], live,
                                   tcode[l + 1], timm[l + 1], tsrc)
            stats[t, l + 1, 0] += 1
            stats[t, l + 1, 1] += end - tstart[l + 1]
            if l + 1 == L - 1:
                _leaf_pixels(tcode[l + 1], timm[l + 1], tstart[l + 1], end, regs, px, py, pz, buf,
                             xs, ys, zf, a0, a1, b0, b1, field, sign, mode)
            else:
                l += 1
                tr[l, 0], tr[l, 1], tr[l, 2], tr[l, 3] = a0, a1, b0, b1
                descend = True


PRUNE_MIN_RECORDS = 64     # shorter tapes do not gain from pruning: evaluate_pruned skips its voxel pass,
                           # and the walkers' renders do not march on cells ("auto")


@njit(**_JIT)
def _counting_sort(vid, n_ids):
    """The indices of vid (ids in 0..n_ids-1) sorted by id, stably: (order, count, used), id v's
    run being order[count[v]:count[v + 1]], ``used`` the number of ids that occur."""
    count = np.zeros(n_ids + 1, np.int64)
    for q in range(vid.shape[0]):
        count[vid[q] + 1] += 1
    used = 0
    for v in range(n_ids):
        used += count[v + 1] > 0
        count[v + 1] += count[v]
    order = np.empty(vid.shape[0], np.int64)
    fill = count[:-1].copy()
    for q in range(vid.shape[0]):
        order[fill[vid[q]]] = q
        fill[vid[q]] += 1
    return order, count, used


@njit(**_JIT)
def _bucket(pts, lo, cell, grid):
    """Counting sort of the points into grid^3 voxels (clamped; NaN coordinates to voxel 0).
    Returns (order, seg, boxes): voxel v of the non-empty ones holds order[seg[v]:seg[v+1]],
    and boxes[:, v] is its points' range (NaN where a coordinate is NaN)."""
    N = pts.shape[0]
    vid = np.empty(N, np.int64)
    for q in range(N):
        v = 0
        for r in range(2, -1, -1):
            t = np.floor((pts[q, r] - lo[r]) / cell[r])
            i = 0 if not t > 0 else (grid - 1 if t > grid - 1 else np.int64(t))
            v = v * grid + i
        vid[q] = v
    order, count, used = _counting_sort(vid, grid * grid * grid)
    seg = np.empty(used + 1, np.int64)
    boxes = np.empty((6, used), np.float32)
    u = 0
    for v in range(grid * grid * grid):
        if count[v + 1] == count[v]:
            continue
        seg[u] = count[v]
        for r in range(3):
            a, b = INF, -INF
            for j in range(count[v], count[v + 1]):
                x = pts[order[j], r]
                if x != x:
                    a, b = NAN, NAN
                    break
                a, b = min(a, x), max(b, x)
            boxes[2 * r, u], boxes[2 * r + 1, u] = a, b
        u += 1
    seg[used] = N
    return order, seg, boxes


@njit(**_JIT)
def _eval_run(tcode, timm, s, end, pts, order, b, e, work, out):
    """out[order[b:e]] = the tape tcode / timm [s, end) at those points, in blocks of
    work.shape[1] points; work: (n_regs + 5, block) scratch (the registers and _eval_points'
    scratch row, then x y z and the values of a block)."""
    block = work.shape[1]
    px, py, pz, buf = work[-4], work[-3], work[-2], work[-1]
    regs = work[:-4]
    for b0 in range(b, e, block):
        m = min(block, e - b0)
        for j in range(m):
            q = order[b0 + j]
            px[j], py[j], pz[j] = pts[q, 0], pts[q, 1], pts[q, 2]
        _eval_points(tcode, timm, s, end, regs, px, py, pz, m, buf)
        for j in range(m):
            out[order[b0 + j]] = buf[j]


@njit(parallel=True, **_JIT)
def _points_kernel(code, imm, start, end, n_regs, pts, order, seg, choices, sides, block, out):
    """Per voxel v (points order[seg[v]:seg[v+1]]): prune with choices[:, v] and sides[:, :, v],
    evaluate in blocks."""
    n = code.shape[0]
    for v in prange(seg.shape[0] - 1):
        tcode = np.empty((n, 5), np.int32)
        timm = np.empty(n, np.float32)
        s = _prune(code, imm, start, end, choices[:, v], sides[:, :, v], np.empty(n_regs, np.bool_), tcode, timm,
                   np.empty(n, np.int32))
        _eval_run(tcode, timm, s, end, pts, order, seg[v], seg[v + 1], np.empty((n_regs + 5, block), np.float32),
                  out)


@njit(parallel=True, **_JIT)
def _prune_cells(code, imm, n_regs, choices, sides, tcodes, timms, starts):
    """Every cell's pruned tape: cell c (column c of choices, sides[:, :, c]) into tcodes[c] /
    timms[c] from starts[c] on."""
    n = code.shape[0]
    for c in prange(choices.shape[1]):
        starts[c] = _prune(code, imm, np.int64(0), n, choices[:, c], sides[:, :, c], np.empty(n_regs, np.bool_), tcodes[c],
                           timms[c], np.empty(n, np.int32))


@njit(**_JIT)
def _subcells_of(tcode, timm, start, n_regs, boxes, write, offsets, fcode, fimm, lengths, lower, first):
    """The 64 sub-cells (boxes: (6, 64)) of one cell whose pruned tape is tcode / timm [start, n):
    their tapes' lengths into lengths[first:first + 64], or with ``write`` the tapes into
    fcode / fimm from offsets[first + k] (the lengths pass and the writing pass must agree: both
    are deterministic); either pass writes their intervals' lower bounds into lower[first:...]."""
    n = tcode.shape[0]
    box = np.empty((6, _LANES), np.float32)
    lo = np.zeros((n_regs, _LANES), np.float32)    # (zeros: the result never depends on stale memory)
    hi = np.zeros((n_regs, _LANES), np.float32)
    ch = np.zeros((n, _LANES), np.uint8)
    sd = np.zeros((n, 3, _LANES), np.float32)
    out_lo = np.empty(64, np.float32)
    out_hi = np.empty(64, np.float32)
    choices = np.zeros((n, 64), np.uint8)
    sides = np.zeros((n, 3, 64), np.float32)
    for g in range(0, 64, _LANES):
        _boxes_group(tcode, timm, start, n, boxes, g, box, lo, hi, ch, sd, out_lo, out_hi, choices, sides)
    lower[first:first + 64] = out_lo
    live = np.empty(n_regs, np.bool_)
    oc = np.empty((n, 5), np.int32)
    oi = np.empty(n, np.float32)
    src = np.empty(n, np.int32)
    for k in range(64):
        w = _prune(tcode, timm, start, n, choices[:, k], sides[:, :, k], live, oc, oi, src)
        if not write:
            lengths[first + k] = n - w
        else:
            o = offsets[first + k]
            fcode[o:o + n - w] = oc[w:]
            fimm[o:o + n - w] = oi[w:]


@njit(parallel=True, **_JIT)
def _prune_subcells(tcodes, timms, starts, n_regs, sub_boxes, write, offsets, fcode, fimm, lengths, lower):
    """The 64 sub-cells of each grid cell c (sub-cell boxes sub_boxes[:, 64 c : 64 c + 64]), each
    pruned from cell c's pruned tape (tcodes[c] / timms[c] from starts[c]): their lengths into
    ``lengths``, or with ``write`` the sub-tapes into fcode / fimm from offsets[64 c + k]; their
    intervals' lower bounds into ``lower`` (empty-space skipping). (No None arguments: Numba's
    parallel loops mishandle them.)"""
    for c in prange(tcodes.shape[0] - 1):      # (not the outside cell: it has no sub-cells)
        boxes = np.ascontiguousarray(sub_boxes[:, 64 * c:64 * c + 64])   # (C: one _boxes_group signature)
        _subcells_of(tcodes[c], timms[c], starts[c], n_regs, boxes, write, offsets, fcode, fimm, lengths, lower,
                     64 * c)


_SEGMENT_RUNS = 256


@njit(parallel=True, **_JIT)
def _cells_points_kernel(fcode, fimm, first, end, n_regs, pts, order, seg, ids, block, out):
    """Per segment u (points order[seg[u]:seg[u+1]], all in cell ids[u]): that cell's tape,
    fcode / fimm [first[id], end[id]). Segments go in runs of about 1 / _SEGMENT_RUNS of them per
    parallel task (few points a segment: scratch is allocated per run, not per segment)."""
    n_seg = seg.shape[0] - 1
    runs = min(n_seg, _SEGMENT_RUNS)
    for r in prange(runs):
        work = np.empty((n_regs + 5, block), np.float32)
        for u in range(r * n_seg // runs, (r + 1) * n_seg // runs):
            c = ids[u]
            _eval_run(fcode, fimm, first[c], end[c], pts, order, seg[u], seg[u + 1], work, out)


# ----------------------------------------------------------------------------- Python API
FIELD_OPS = {Op.FIELD_RESULT: Op.COPY, Op.UNION: Op.MIN, Op.INTERSECT: Op.MAX}


def is_arithmetic(tape: Tape, fields: bool = False) -> bool:
    """Whether every record of ``tape`` is an arithmetic op (the tapes this module prunes). With
    ``fields``, the records of scene fields and their unions / intersections are allowed too
    (FIELD_OPS): in a tape with no transforms (a tape of these ops has none) FIELD_RESULT's value
    is reg[a] * 1, a COPY, and UNION / INTERSECT are MIN / MAX with the same value and material
    rules, so their values prune as those ops' do (the GPU's pruned march does so), while their
    materials need the full tape."""
    ops = np.unique(tape.instrs["op"])
    ok = set(FIELD_OPS) if fields else set()
    return all(int(o) in Op._value2member_map_ and (OPS[Op(int(o))].family is Family.ARITH or Op(int(o)) in ok)
               for o in ops)


_CELL_TAPE: dict[int, Tape | None] = {}
LOWER_MAX_RECORDS = 16384   # longer scene tapes are not lowered (host Python: about 0.35 s per 8,000 records)


def cell_tape(tape: Tape) -> Tape | None:
    """The tape whose values march cells prune for ``tape`` (both walkers' renders use it): the
    tape itself when it is arithmetic (scene fields allowed), else its lowering to arithmetic
    (``runtime.lowering``; kept per tape content, the same object while the content stays) when
    it has one and is at most LOWER_MAX_RECORDS records long, else None."""
    if is_arithmetic(tape, fields=True):
        return tape
    if len(tape.instrs) > LOWER_MAX_RECORDS:
        return None
    key = content_key(tape)
    if key not in _CELL_TAPE:
        if len(_CELL_TAPE) > 16:
            _CELL_TAPE.clear()
        try:
            _CELL_TAPE[key] = lower(tape)
        except NotLowerable:
            _CELL_TAPE[key] = None
    return _CELL_TAPE[key]


_COMPACT: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}


def _checked(tape: Tape, what: str, fields: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Validate an arithmetic-only tape (once per content) and return its compact records:
    (n, 5) int32 op dst a b c and the (n,) float32 CONST values. With ``fields``, a tape of
    scene fields too, their records given as FIELD_OPS's arithmetic ops (the same values; the
    materials are the caller's, from the full tape)."""
    key = (content_key(tape), fields)
    if key not in _COMPACT:
        validate(tape)
        if not is_arithmetic(tape, fields):
            raise TaperayError(f"{what}: {tape.source or 'the tape'} holds non-arithmetic ops; "
                               "only arithmetic-only tapes are pruned")
        if len(_COMPACT) > 64:
            _COMPACT.clear()
        _COMPACT[key] = compact_records(tape)
    return _COMPACT[key]


def compact_records(tape: Tape) -> tuple[np.ndarray, np.ndarray]:
    """An arithmetic tape's records as (n, 5) int32 op dst a b c, scene fields' records as
    FIELD_OPS's arithmetic ops, and the (n,) float32 values of its CONSTs (0 elsewhere)."""
    ins = tape.instrs
    code = np.ascontiguousarray(np.stack([ins[f] for f in ("op", "dst", "a", "b", "c")], 1), np.int32)
    for field_op, op in FIELD_OPS.items():
        code[code[:, 0] == field_op, 0] = op
    imm = np.zeros(len(ins), np.float32)
    const = ins["op"] == Op.CONST
    imm[const] = tape.params[ins["param"][const]]
    return code, imm


def _boxes(lo, hi) -> np.ndarray:
    lo = np.asarray(lo, np.float32).reshape(-1, 3)
    hi = np.asarray(hi, np.float32).reshape(-1, 3)
    if lo.shape != hi.shape:
        raise TaperayError(f"interval boxes: lo {lo.shape} and hi {hi.shape} differ")
    return np.ascontiguousarray(np.stack([lo[:, 0], hi[:, 0], lo[:, 1], hi[:, 1], lo[:, 2], hi[:, 2]]))


def _lanes(code, imm, start, n_regs, boxes, keep_sides: bool = True):
    """Intervals (T,) lo, hi, choices (n, T) and MIN / MAX sides (n, 3, T; NaN on other records;
    without ``keep_sides`` (0, 3, T): none) of code[start:] over the T boxes."""
    T = boxes.shape[1]
    out_lo, out_hi = np.empty(T, np.float32), np.empty(T, np.float32)
    choices = np.zeros((len(code), T), np.uint8)
    sides = np.full((len(code) if keep_sides else 0, 3, T), NAN, np.float32)
    if T:
        _lanes_kernel(code, imm, start, len(code), n_regs, boxes, out_lo, out_hi, choices, sides)
    return out_lo, out_hi, choices, sides


def interval_eval(tape: Tape, lo, hi, fields: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                     np.ndarray]:
    """Interval-evaluate an arithmetic tape (with ``fields``, scene fields allowed: a lowering's)
    over K boxes [lo, hi] ((K, 3) or (3,) each). Returns the value intervals (K,) lo, (K,) hi
    (NaN, NaN: may be NaN), (K, n) uint8 choices (CHOICE_A / CHOICE_B / CHOICE_BOTH per MIN /
    MAX / AND / OR record, else 0) and (K, n, 3) float32 sides (per MIN / MAX record: a's and b's
    far bounds and the result's near bound, the union rule's; NaN on other records)."""
    code, imm = _checked(tape, "interval_eval", fields)
    lo, hi, choices, sides = _lanes(code, imm, 0, tape.n_regs, _boxes(lo, hi))
    return lo, hi, np.ascontiguousarray(choices.T), np.ascontiguousarray(sides.transpose(2, 0, 1))


@njit(**_JIT)
def _interval_op_kernel(op, a, b, c, out):
    for i in range(a.shape[1]):
        out[0, i], out[1, i], ch = _iv(op, a[0, i], a[1, i], b[0, i], b[1, i], c[0, i], c[1, i])
        out[2, i] = ch


def interval_op(op: Op, a, b=None, c=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One op of the float32 evaluator on arrays of intervals: a = (lo, hi) (b, c likewise where
    the op reads them); NaN bounds mean "may be NaN". Returns (lo, hi, choice) arrays. Only for
    the arithmetic ops with operands (VAR_* / CONST / INSTANCE_INDEX read the box / the pool)."""
    op = Op(op)
    if OPS[op].family is not Family.ARITH or not OPS[op].reads:
        raise TaperayError(f"interval_op: {op.name} is not an arithmetic op with operands")
    bounds = [np.asarray(x, np.float32) for iv in (a, b, c) for x in (iv if iv is not None else (0, 0))]
    shape = np.broadcast_shapes(*(x.shape for x in bounds))
    flat = [np.ascontiguousarray(np.broadcast_to(x, shape).ravel()) for x in bounds]
    ivs = [np.stack(flat[i:i + 2]) for i in (0, 2, 4)]
    out = np.empty((3, ivs[0].shape[1]), np.float32)
    _interval_op_kernel(int(op), *ivs, out)
    return out[0].reshape(shape), out[1].reshape(shape), out[2].astype(np.uint8).reshape(shape)


def prune(tape: Tape, choices, sides=None) -> Tape:
    """The tape shortened by one box's ``choices`` ((n,) uint8 from ``interval_eval``) and, with
    its ``sides`` ((n, 3) from ``interval_eval``), by the union rule too: same registers,
    parameter pool, materials and bounds; exact at every point of that box."""
    code, imm = _checked(tape, "prune")
    row = np.ascontiguousarray(np.asarray(choices, np.uint8).reshape(-1))
    if row.shape != (len(code),):
        raise TaperayError(f"prune: {row.shape[0]} choices for a tape of {len(code)} records")
    side_row = np.empty((0, 3), np.float32) if sides is None else \
        np.ascontiguousarray(np.asarray(sides, np.float32))
    if sides is not None and side_row.shape != (len(code), 3):
        raise TaperayError(f"prune: sides of shape {side_row.shape} for a tape of {len(code)} records "
                           f"(needs ({len(code)}, 3))")
    out_code, src = np.empty_like(code), np.empty(len(code), np.int32)
    s = _prune(code, imm, 0, len(code), row, side_row, np.empty(tape.n_regs, np.bool_), out_code,
               np.empty_like(imm), src)
    kept = tape.instrs[src[s:]].copy()               # param / aux / jump of the source records
    for f, col in zip(("op", "dst", "a", "b", "c"), out_code[s:].T):
        kept[f] = col
    became_copy = kept["op"] != tape.instrs["op"][src[s:]]
    kept["param"][became_copy] = 0
    return Tape(kept, tape.params.copy(), tape.materials.copy(), tape.n_regs, tape.bounds.copy(),
                dict(tape.names), tape.instance_count, tape.source)


def _pixel_centres(width, height, rect, z):
    """float32 pixel centres exactly as CpuWalker.field_image computes them."""
    x0, x1, y0, y1 = (float(v) for v in rect)
    xs = (x0 + (np.arange(width) + 0.5) / width * (x1 - x0)).astype(np.float32)
    ys = (y1 - (np.arange(height) + 0.5) / height * (y1 - y0)).astype(np.float32)
    return xs, ys, np.float32(z)


def _image(tape: Tape, width, height, rect, z, tiles, mode, stats):
    if width < 1 or height < 1:
        raise TaperayError(f"pruned image: size {width}x{height} must be at least 1x1")
    tiles = np.asarray(tiles, np.int64).reshape(-1)
    if tiles.size < 1 or np.any(tiles < 1) or np.any(tiles[1:] > tiles[:-1]):
        raise TaperayError(f"pruned image: tile sizes {tiles.tolist()} must be positive and non-increasing")
    code, imm = _checked(tape, "pruned image")
    xs, ys, zf = _pixel_centres(width, height, rect, z)
    field = np.empty((height, width) if mode == 0 else (0, 0), np.float32)
    sign = np.empty((height, width) if mode == 1 else (0, 0), np.bool_)
    n_top = -(-width // int(tiles[0])) * -(-height // int(tiles[0]))
    st = np.zeros((n_top, len(tiles) + 1, 2), np.int64)
    _image_kernel(code, imm, tape.n_regs, tiles, xs, ys, zf, mode, field, sign, st)
    if stats is not None:
        tot = st[:, :-1].sum(0)
        stats.clear()
        stats.update(records=len(code), image=int(st[0, -1, 1]),
                     levels=[dict(tile=int(s), tapes=int(c), mean_length=float(t) / c if c else 0.0)
                             for s, (c, t) in zip(tiles, tot)])
    return field if mode == 0 else sign


def sign_image(tape: Tape, width: int, height: int, rect=(-1.0, 1.0, -1.0, 1.0), z: float = 0.0,
               tiles=DEFAULT_TILES, stats: dict | None = None) -> np.ndarray:
    """(H, W) bool: True where the field is < 0 (inside), on the plane z = const with
    CpuWalker.field_image's pixel centres (rect = (x0, x1, y0, y1), row 0 = y1). Tiles whose
    interval is decided are filled without evaluating pixels. ``stats`` (a dict) receives the
    number and mean length of the pruned tapes per level. Non-arithmetic tapes: field < 0 of
    the unpruned CpuWalker."""
    if not is_arithmetic(tape):
        return twin.field_image(tape, width, height, rect, z) < 0
    return _image(tape, width, height, rect, z, tiles, 1, stats)


def field_image_pruned(tape: Tape, width: int, height: int, rect=(-1.0, 1.0, -1.0, 1.0),
                       z: float = 0.0, tiles=DEFAULT_TILES, stats: dict | None = None) -> np.ndarray:
    """(H, W) float32 field, every pixel evaluated with its tile's pruned tape: bit-identical to
    CpuWalker.field_image (same arguments). Non-arithmetic tapes: CpuWalker.field_image."""
    if not is_arithmetic(tape):
        return twin.field_image(tape, width, height, rect, z)
    return _image(tape, width, height, rect, z, tiles, 0, stats)


def evaluate_pruned(tape: Tape, points, grid: int = 8, block: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """(N,) float32 values and (N,) uint32 material ids at (N, 3) points, as CpuWalker.evaluate
    (bit for bit): points are bucketed into grid^3 voxels over the tape bounds, each voxel's
    tape is pruned over the range of its points (tapes under ``PRUNE_MIN_RECORDS`` records are
    evaluated in plain chunks). Non-arithmetic tapes: CpuWalker.evaluate."""
    pts = point_array(points, "evaluate_pruned")
    if not is_arithmetic(tape):
        return twin.evaluate_field(tape, pts)
    if grid < 1 or block < 1:
        raise TaperayError(f"evaluate_pruned: grid {grid} and block {block} must be at least 1")
    code, imm = _checked(tape, "evaluate_pruned")
    pts = np.ascontiguousarray(pts, np.float32)
    out = np.empty(len(pts), np.float32)
    if len(pts) == 0:
        return out, np.zeros(0, np.uint32)
    if len(code) < PRUNE_MIN_RECORDS:       # too short to gain: chunks, nothing decided
        seg = np.linspace(0, len(pts), min(len(pts), 64) + 1).astype(np.int64)
        order = np.arange(len(pts), dtype=np.int64)
        choices = np.zeros((len(code), len(seg) - 1), np.uint8)
        sides = np.empty((0, 3, len(seg) - 1), np.float32)
    else:
        lo = tape.bounds[0].astype(np.float32)
        cell = np.where(tape.bounds[1] > lo, (tape.bounds[1] - lo) / np.float32(grid), 1).astype(np.float32)
        order, seg, vbox = _bucket(pts, lo, cell, grid)
        _, _, choices, sides = _lanes(code, imm, 0, tape.n_regs, vbox, keep_sides=False)
    _points_kernel(code, imm, 0, len(code), tape.n_regs, pts, order, seg, choices, sides, block, out)
    return out, np.zeros(len(pts), np.uint32)


# ----------------------------------------------------------------------------- the 3D march
@njit(**_JIT)
def _bucket_cells(pts, lo, cell, grid):
    """Counting sort of the points into the cells of a fixed grid^3 grid (cell id
    i + grid (j + grid k)); points outside the grid (or NaN) get id grid^3. Returns (order, seg,
    ids): segment u holds order[seg[u]:seg[u + 1]], all in cell ids[u]."""
    N = pts.shape[0]
    G3 = grid * grid * grid
    vid = np.empty(N, np.int64)
    for q in range(N):
        v = 0
        for r in range(2, -1, -1):
            t = np.floor((pts[q, r] - lo[r]) / cell[r])
            if not (t >= 0 and t <= grid - 1):
                v = -1
                break
            v = v * grid + np.int64(t)
        vid[q] = G3 if v < 0 else v
    order, count, used = _counting_sort(vid, G3 + 1)
    seg = np.empty(used + 1, np.int64)
    ids = np.empty(used, np.int64)
    u = 0
    for v in range(G3 + 1):
        if count[v + 1] > count[v]:
            seg[u], ids[u] = count[v], v
            u += 1
    seg[used] = N
    return order, seg, ids


def grid_ijk(grid: int, flat: bool = False) -> np.ndarray:
    """(grid^3, 3) integer coordinates (i, j, k) of the cells of a grid^3 grid, in id order
    i + grid (j + grid k) (the cells of march_pruned and of the GPU's march cells, and the 64
    sub-cells of a cell with grid 4); ``flat``: the grid^2 cells (i, j, 0) of a grid in the plane
    (the GPU's image cells)."""
    c = np.arange(grid ** (2 if flat else 3))
    return np.stack([c % grid, c // grid % grid, c // (grid * grid)], 1)


def sub_cell_ijk(ijk: np.ndarray, flat: bool = False) -> np.ndarray:
    """The coordinates, one level finer, of the 64 sub-cells of each cell in ``ijk`` (sub-cell k
    of cell c at row 64 c + k); ``flat``: the 16 sub-cells in the plane (row 16 c + k)."""
    sub = grid_ijk(4, flat)
    return (ijk[:, None, :] * np.array([4, 4, 1 if flat else 4]) + sub[None]).reshape(-1, 3)


def grid_cell_boxes(lo, hi, size, ijk) -> tuple[np.ndarray, np.ndarray]:
    """float64 (lo, hi) boxes of the cells ``ijk`` of a grid from ``lo`` with cells of ``size``:
    their extent grown by 1e-4 of ``size`` plus 1e-6 of |lo| + |hi| (``hi`` the grid's far corner),
    so that a point whose rounded cell index names a neighbour still lies in the box. A sub-cell's
    margin is smaller than its parent's, so its box lies inside the parent's (and stays inside
    after rounding to float32, rounding being monotone)."""
    margin = 1e-4 * size + 1e-6 * (np.abs(lo) + np.abs(hi))
    return lo + ijk * size - margin, lo + (ijk + 1) * size + margin


def light_pruned(tape: Tape, packed: np.ndarray, mr: dict, grid: int = 4, levels: int = 2) -> dict:
    """The twin's light pass (cpu._light_kernel: the key light's occlusion march from p + 4 eps n,
    5-tap ambient occlusion) of march_pruned's result ``mr``, bit for bit, every evaluation on
    march_pruned's cells (kept from the march). Returns shadow and ao (H, W) float32 (1 on
    misses)."""
    field = _pruned_field(tape, packed, grid, levels)
    box = np.asarray(_packed(packed, "box_lo", "box_hi"), np.float32).reshape(2, 3)
    eps, step_scale, soft_k, ao_strength, ao_dist = (np.float32(_packed(packed, k)) for k in
                                                     ("hit_eps", "step_scale", "soft_k", "ao_strength", "ao_dist"))
    key_dir = np.asarray(_packed(packed, "key_dir"), np.float32)
    shadow_steps, shadow_mode = int(_packed(packed, "shadow_steps")), int(_packed(packed, "shadow_mode"))
    h, w = mr["t"].shape
    shadow = np.ones(h * w, np.float32)
    ao = np.ones(h * w, np.float32)
    th_all = mr["t"].reshape(-1)
    at = np.flatnonzero(th_all < np.inf)
    if at.size:
        th = th_all[at]
        g = mr["grad"].reshape(-1, 3)[at]
        gl = np.sqrt(g[:, 0] * g[:, 0] + g[:, 1] * g[:, 1] + g[:, 2] * g[:, 2])
        gl = np.where(gl > 0, gl, np.float32(1))
        nrm = g / gl[:, None]
        dirs = np.asarray(mr["dirs"], np.float32).reshape(-1, 3)[at]
        lift = np.float32(4) * eps
        ro = np.asarray(mr["eye"], np.float32) + th[:, None] * dirs + lift * nrm
        if shadow_mode > 0:
            rd = np.broadcast_to(key_dir, ro.shape)
            tfar = ray_slabs(ro, rd, box)[1]
            t = np.zeros(len(at), np.float32)
            hard = shadow_mode == 1                          # (0 off, 1 hard, 2 soft: shading.SHADOW_MODES)
            skip = march_cell_tapes(tape, packed, grid, levels) if hard and _packed(packed, "cell_skip") else None
            _, hit, res = _wavefront(field, ro, rd, t, tfar, eps, shadow_steps, step_scale,
                                     soft_k if shadow_mode == 2 else np.float32(0), skip)
            one = np.where(np.float32(1) < res, np.float32(1), res)
            shadow[at] = np.where(hit, np.float32(0), np.where(np.float32(0) > one, np.float32(0), one))
        if ao_strength > 0:
            occ = np.zeros(len(at), np.float32)
            wsum, wt = np.float32(0), np.float32(1)
            for tap in range(5):
                hh = ao_dist * np.float32(tap + 1) / np.float32(5)
                wsum += wt
                d = field((ro - lift * nrm) + hh * nrm)
                gap = hh - d
                occ += wt * np.where(np.float32(0) > gap, np.float32(0), gap) / hh
                wt *= np.float32(0.5)
            v = np.float32(1) - ao_strength * occ / wsum
            ao[at] = np.where(np.float32(0) > v, np.float32(0), v)
    return dict(shadow=shadow.reshape(h, w), ao=ao.reshape(h, w))


class CellTapes:
    """An arithmetic tape pruned for every cell of a grid^3 grid over a box (each cell's box grown
    by a rounding margin) and, with ``levels`` 2, again for each of a cell's 4 x 4 x 4 sub-cells
    (from the cell's pruned tape), plus the whole tape (an all-undecided column) for points
    outside the grid, pruned once: ``evaluate`` gives CpuWalker.evaluate's values bit for bit,
    each point on its finest cell's tape. The finest tapes are packed one after another in
    ``fcode`` / ``fimm``; tape t is [first[t], end[t]) (the outside cell's last)."""

    def __init__(self, tape: Tape, lo, hi, grid: int, levels: int = 1):
        self.code, self.imm = _checked(tape, "march_pruned", fields=True)
        self.n_regs, self.grid, self.levels = tape.n_regs, grid, levels
        n = len(self.code)
        lo, hi = np.asarray(lo, np.float64), np.asarray(hi, np.float64)
        self.lo = lo.astype(np.float32)
        size = np.where(hi > lo, (hi - lo) / grid, 1.0)
        c_lo, c_hi = grid_cell_boxes(lo, hi, size, grid_ijk(grid))
        c_lower, _, choices, sides = _lanes(self.code, self.imm, 0, self.n_regs, _boxes(c_lo, c_hi))
        # empty-space skipping (skip_to): each level's boxes (float32, as the lookup's) and the
        # lower bounds of the intervals over them (level 0, then with levels 2 the sub-cells)
        levels_lower = [(c_lo.astype(np.float32), c_hi.astype(np.float32), c_lower)]
        self.choices = np.ascontiguousarray(np.concatenate([choices, np.zeros((n, 1), np.uint8)], 1))
        sides = np.ascontiguousarray(np.concatenate([sides, np.full((n, 3, 1), NAN, np.float32)], 2))
        n_cells = self.choices.shape[1]
        if n_cells * n * 24 > CELL_TAPES_MAX_BYTES:
            raise CellsTooLarge(f"march_pruned: {n_cells - 1} cells of a {n}-record tape need "
                               f"{n_cells * n * 24 / 2**20:.0f} MB of pruned tapes "
                               f"(at most {CELL_TAPES_MAX_BYTES >> 20} MB): use a smaller grid")
        tcodes = np.empty((n_cells, n, 5), np.int32)
        timms = np.empty((n_cells, n), np.float32)
        starts = np.empty(n_cells, np.int64)
        _prune_cells(self.code, self.imm, self.n_regs, self.choices, sides, tcodes, timms, starts)
        if levels == 1:
            tapes = [(tcodes[c, starts[c]:], timms[c, starts[c]:]) for c in range(n_cells)]
            self.fcode = np.ascontiguousarray(np.concatenate([t[0] for t in tapes]))
            self.fimm = np.ascontiguousarray(np.concatenate([t[1] for t in tapes]))
            lengths = n - starts
        else:
            s_lo, s_hi = grid_cell_boxes(lo, hi, size / 4, sub_cell_ijk(grid_ijk(grid)))
            sub = _boxes(s_lo, s_hi)
            sub_lengths = np.empty(sub.shape[1], np.int64)     # sub-cell k of cell c: index 64 c + k
            s_lower = np.empty(sub.shape[1], np.float32)
            _prune_subcells(tcodes, timms, starts, self.n_regs, sub, False, sub_lengths, tcodes[0], timms[0],
                            sub_lengths, s_lower)
            levels_lower.append((s_lo.astype(np.float32), s_hi.astype(np.float32), s_lower))
            lengths = np.append(sub_lengths, n - starts[-1])
            if int(lengths.sum()) * 24 > CELL_TAPES_MAX_BYTES:
                raise CellsTooLarge(f"march_pruned: the {len(sub_lengths)} sub-cells' tapes need "
                                   f"{int(lengths.sum()) * 24 / 2**20:.0f} MB (at most "
                                   f"{CELL_TAPES_MAX_BYTES >> 20} MB): use a smaller grid or one level")
            offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
            self.fcode = np.empty((int(lengths.sum()), 5), np.int32)
            self.fimm = np.empty(len(self.fcode), np.float32)
            _prune_subcells(tcodes, timms, starts, self.n_regs, sub, True, offsets, self.fcode, self.fimm, sub_lengths,
                            s_lower)
            self.fcode[offsets[-1]:] = tcodes[-1, starts[-1]:]
            self.fimm[offsets[-1]:] = timms[-1, starts[-1]:]
        self.skip_lo, self.skip_hi, self.skip_lower = (np.ascontiguousarray(np.concatenate(x))
                                                       for x in zip(*levels_lower))
        self.end = np.cumsum(lengths).astype(np.int64)
        self.first = self.end - lengths
        self.fine = grid * 4 ** (levels - 1)
        self.cell = (size / 4 ** (levels - 1)).astype(np.float32)
        # finest grid id i + G (j + G k) -> its tape; id G^3 (outside the grid) -> the last
        f = np.arange(self.fine ** 3)
        i, j, k = f % self.fine, f // self.fine % self.fine, f // (self.fine * self.fine)
        if levels == 1:
            table = f
        else:
            table = ((i >> 2) + grid * ((j >> 2) + grid * (k >> 2))) * 64 + (i & 3) + 4 * ((j & 3) + 4 * (k & 3))
        self.tape_of = np.append(table, len(lengths) - 1).astype(np.int64)

    def skip_to(self, o: np.ndarray, d: np.ndarray, t: np.ndarray, live: np.ndarray, pts: np.ndarray, eps,
                scale, cone=0.0) -> np.ndarray:
        """Empty-space skipping, the GPU's rule (packed.wgsl cell_find): for the tracing steps of
        the rays ``live`` (o + t d, ``o`` one row for every ray or a row per ray) at ``pts``
        ((len(live), 3) float32), the t a ray may move on to without a field value: the furthest,
        over the cells of every level on the point's way down (an index one past the grid's
        faces names the boundary cell) whose box holds it and whose
        interval's lower bound L is at least ``eps`` (no point of the box is a hit), of
        T = max(t + L ``scale``, the t where the ray leaves the box), where L is also at least the
        hit threshold at T (``cone`` > 0: max(eps, cone T), RenderSettings.hit_cone); -1 where no
        cell proves it."""
        out = np.empty(len(live), np.float32)
        if len(live):
            _skip_kernel(o, d, t, live, pts, self.lo, self.cell, self.fine, self.grid, self.levels, self.skip_lo,
                         self.skip_hi, self.skip_lower, np.float32(eps), np.float32(scale), np.float32(cone), out)
        return out

    def evaluate(self, pts: np.ndarray) -> np.ndarray:
        pts = np.ascontiguousarray(pts, np.float32)
        out = np.empty(len(pts), np.float32)
        if len(pts):
            order, seg, ids = _bucket_cells(pts, self.lo, self.cell, self.fine)
            _cells_points_kernel(self.fcode, self.fimm, self.first, self.end, self.n_regs, pts, order, seg,
                                 self.tape_of[ids], 64, out)
        return out


@njit(**_JIT)
def _skip_kernel(o, d, t, live, pts, lo, cell, fine, grid, levels, box_lo, box_hi, lower, eps, scale, cone, out):
    """CellTapes.skip_to for every point: out[q] for the step of ray live[q] at pts[q]; the
    boxes and lower bounds of level 0 (grid^3 cells) then, with levels 2, of the sub-cells (64 a
    cell, sub-cell k of cell c at grid^3 + 64 c + k)."""
    one_origin = o.shape[0] == 1
    shift = 2 * (levels - 1)
    n0 = grid * grid * grid
    for q in range(live.size):
        i = live[q]
        r0 = 0 if one_origin else i
        best = np.float32(-1)
        fx = np.floor((pts[q, 0] - lo[0]) / cell[0])
        fy = np.floor((pts[q, 1] - lo[1]) / cell[1])
        fz = np.floor((pts[q, 2] - lo[2]) / cell[2])
        if fx >= -1 and fx <= fine and fy >= -1 and fy <= fine and fz >= -1 and fz <= fine:
            # (a point within rounding of the grid's faces has index -1 or fine: it is looked up
            # in the boundary cell, whose grown box decides, as on either side of inner faces)
            ix = np.int64(min(max(fx, 0), fine - 1))
            iy = np.int64(min(max(fy, 0), fine - 1))
            iz = np.int64(min(max(fz, 0), fine - 1))
            c = (ix >> shift) + grid * ((iy >> shift) + grid * (iz >> shift))
            for m in range(levels):
                if m == 1:
                    c = n0 + 64 * c + (ix & 3) + 4 * ((iy & 3) + 4 * (iz & 3))
                low = lower[c]
                if not low >= eps:           # (NaN: may be NaN)
                    continue
                held = True
                for r in range(3):
                    if not (pts[q, r] >= box_lo[c, r] and pts[q, r] <= box_hi[c, r]):
                        held = False
                if not held:
                    continue
                exit = np.float32(np.inf)
                for r in range(3):
                    dr = d[i, r]
                    if dr > 0:
                        x = (box_hi[c, r] - o[r0, r]) / dr
                    elif dr < 0:
                        x = (box_lo[c, r] - o[r0, r]) / dr
                    else:
                        continue
                    if x < exit:
                        exit = x
                step = t[i] + low * scale
                cand = exit if exit > step else step
                if not low >= _hit_threshold(eps, cone, cand):
                    continue
                if cand > best:
                    best = cand
        out[q] = best


_TETRA = np.array([[1, -1, -1], [-1, -1, 1], [-1, 1, -1], [1, 1, 1]], np.float32)
CELL_TAPES_MAX_BYTES = 512 << 20    # march_pruned's pruned tapes, all cells together
CELL_CACHE: dict[tuple, CellTapes] = {}   # march_pruned: the last (tape content, box, grid, levels)'s cells


def march_cell_tapes(tape: Tape, packed: np.ndarray, grid: int, levels: int) -> CellTapes:
    """march_pruned's cells of ``tape`` over the march box of ``packed`` (kept per tape content,
    box, grid and levels)."""
    box = np.asarray(_packed(packed, "box_lo", "box_hi"), np.float32).reshape(2, 3)
    key = (content_key(tape), box.tobytes(), grid, levels)
    if key not in CELL_CACHE:
        CELL_CACHE.clear()          # (one: the cells of a big tape take up to CELL_TAPES_MAX_BYTES)
        CELL_CACHE[key] = CellTapes(tape, box[0], box[1], grid, levels)
    return CELL_CACHE[key]


def cells_shorten(tape: Tape, packed: np.ndarray, grid: int = 4, levels: int = 2) -> float:
    """The mean length of march_pruned's finest cell tapes (the grid's, not the outside cell's)
    over the length of ``tape``: what a step on cells runs, as a share of the whole tape. The
    cells are built (and kept) to find out; CellsTooLarge past their memory cap."""
    cells = march_cell_tapes(tape, packed, grid, levels)
    return float(np.mean((cells.end - cells.first)[:-1])) / max(len(tape.instrs), 1)


def _pruned_field(tape: Tape, packed: np.ndarray, grid: int, levels: int):
    """The field of ``tape`` (arithmetic, scene fields allowed) on march_pruned's cells over the
    march box of ``packed`` (kept per tape content and box), capped by the section half-space as
    the twin's _field: a function of (N, 3) float32 points."""
    sec = _section(packed)
    cells = march_cell_tapes(tape, packed, grid, levels)

    def field(p):
        d = cells.evaluate(p)
        if sec[0] != 0:
            pv = p[:, 0] * sec[1] + p[:, 1] * sec[2] + p[:, 2] * sec[3] - sec[4]
            d = np.where(pv > d, pv, d)
        return d
    return field


def ray_slabs(ro: np.ndarray, rd: np.ndarray, box: np.ndarray):
    """The twin's _slab for every ray (N, 3) at once: entry max(t0, 0) and exit t1 (inf, -inf
    where a ray parallel to a slab lies outside it)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        t0 = np.full(len(rd), -np.inf, np.float32)
        t1 = np.full(len(rd), np.inf, np.float32)
        miss = np.zeros(len(rd), bool)
        for r in range(3):
            flat = rd[:, r] == 0
            miss |= flat & ((ro[:, r] < box[0, r]) | (ro[:, r] > box[1, r]))
            ta = (box[0, r] - ro[:, r]) / rd[:, r]
            tb = (box[1, r] - ro[:, r]) / rd[:, r]
            t0 = np.where(flat, t0, np.maximum(t0, np.minimum(ta, tb)))
            t1 = np.where(flat, t1, np.minimum(t1, np.maximum(ta, tb)))
        return (np.where(miss, np.float32(np.inf), np.maximum(t0, np.float32(0))),
                np.where(miss, np.float32(-np.inf), t1))


@njit(**_JIT)
def _wavefront_points(ro, rd, t, live, out):
    """out[q] = ro + t rd of ray live[q] (ro: one row for every ray, or a row per ray)."""
    one_origin = ro.shape[0] == 1
    for q in range(live.size):
        i = live[q]
        o = 0 if one_origin else i
        for r in range(3):
            out[q, r] = ro[o, r] + t[i] * rd[i, r]


@njit(**_JIT)
def _wavefront_advance(live, d, t, tfar, steps, hit, res, eps, cone, max_steps, step_scale, soft_k, out_live):
    """One step of the rays ``live`` with their field values d, by _trace's rules; the rays still
    marching into out_live, in order; returns how many."""
    m = 0
    for q in range(live.size):
        i = live[q]
        steps[i] += 1
        dq = d[q]
        if dq < _hit_threshold(eps, cone, t[i]):
            hit[i] = True
            res[i] = 0
            continue
        if soft_k > 0:
            tg = t[i]
            pen = soft_k * dq / tg if tg > 0 else res[i]
            if pen < res[i]:
                res[i] = pen
        t[i] += dq * step_scale
        if t[i] <= tfar[i] and steps[i] < max_steps:
            out_live[m] = i
            m += 1
    return m


def _wavefront(field, ro, rd, t, tfar, eps, max_steps: int, step_scale, soft_k, cells: CellTapes | None = None,
               cone=0.0):
    """The twin's _trace for every ray at once, a step at a time (``cone``: _trace's): ``t`` advanced in place;
    returns steps, hit and the soft-shadow penumbra res (iq's min(1, k f / t) where soft_k > 0).
    ``ro`` is (3,) or (N, 3). The steps' bookkeeping is Numba (_wavefront_points / _advance).
    With ``cells`` (empty-space skipping, RenderSettings.cell_skip; hard shadows and primary rays
    only), a step whose point lies in a cell proven empty moves on to CellTapes.skip_to without
    a field value, and counts as a step, as the GPU's march on cells does (kernels_render.wgsl
    skip_step)."""
    steps = np.zeros(len(rd), np.int32)
    hit = np.zeros(len(rd), bool)
    res = np.ones(len(rd), np.float32)
    origins = np.asarray(ro, np.float32).reshape(-1, 3)
    live = np.flatnonzero(t <= tfar)
    spare = np.empty_like(live)
    pts = np.empty((live.size, 3), np.float32)
    while live.size:
        step_pts = pts[:live.size]
        _wavefront_points(origins, rd, t, live, step_pts)
        jumped = live[:0]
        if cells is not None:
            to = cells.skip_to(origins, rd, t, live, step_pts, eps, step_scale, cone)
            jump = to >= 0
            if jump.any():
                j = live[jump]
                steps[j] += 1
                t[j] = to[jump]
                jumped = j[(t[j] <= tfar[j]) & (steps[j] < max_steps)]
                live, step_pts = live[~jump], step_pts[~jump]
        d = field(step_pts)
        m = _wavefront_advance(live, d, t, tfar, steps, hit, res, np.float32(eps), np.float32(cone), max_steps,
                               np.float32(step_scale), np.float32(soft_k), spare)
        if jumped.size:
            live, spare = np.sort(np.concatenate([spare[:m], jumped])), np.empty_like(spare)
        else:
            live, spare = spare[:m], live
    return steps, hit, res


def march_pruned(tape: Tape, camera, width: int, height: int, settings=None, view: str = "shade",
                 grid: int = 4, levels: int = 2) -> dict:
    """CpuWalker.march of an arithmetic tape, bit for bit, with every evaluation on a pruned tape:
    the march box is cut into grid^3 cells, each interval-evaluated and pruned once (kept: 24
    bytes per record and cell, and kept for the next call on the same tape content and box), with
    ``levels`` 2 each cell's 4 x 4 x 4 sub-cells again from the cell's tape, and each step's
    points are bucketed by finest cell and run on its tape (points outside the box on the whole
    tape).
    The rays advance together, a step at a time (a wavefront), by the twin's rules (_trace,
    _slab, _gradients: the same float32 operations in the same order). Scene fields (FIELD_OPS)
    are pruned too, their materials at the hits taken from the full tape. Other tapes:
    CpuWalker.march."""
    if not is_arithmetic(tape, fields=True):
        return twin.march(tape, camera, width, height, settings or RenderSettings(), view)
    if grid < 1 or levels not in (1, 2):
        raise TaperayError(f"march_pruned: grid {grid} must be at least 1 and levels {levels} 1 or 2")
    settings = settings or RenderSettings()
    packed = settings.pack(tape, view)
    box = np.asarray(_packed(packed, "box_lo", "box_hi"), np.float32).reshape(2, 3)
    eps, neps, step_scale = (np.float32(_packed(packed, k)) for k in ("hit_eps", "normal_eps", "step_scale"))
    max_steps = int(_packed(packed, "max_steps"))
    sec = _section(packed)
    field = _pruned_field(tape, packed, grid, levels)
    skip = march_cell_tapes(tape, packed, grid, levels) if _packed(packed, "cell_skip") else None
    eye_out, dirs = camera.rays(width, height)
    eye = np.asarray(eye_out, np.float32)
    rd = np.ascontiguousarray(dirs, np.float32).reshape(-1, 3)
    t, tfar = ray_slabs(np.broadcast_to(eye, rd.shape), rd, box)
    steps, hit, _ = _wavefront(field, eye, rd, t, tfar, eps, max_steps, step_scale, np.float32(0), skip,
                               np.float32(_packed(packed, "hit_cone")))
    grad = np.zeros((len(rd), 3), np.float32)
    at = np.flatnonzero(hit)
    if at.size:                                                 # the twin's _gradients
        px = eye + t[at, None] * rd[at]
        g = np.zeros((at.size, 3), np.float32)
        for k in _TETRA:
            g += k * field(px + neps * k)[:, None]
        grad[at] = g / (np.float32(4) * neps)
    mat = np.zeros(len(rd), np.uint32)
    if at.size and (tape.instrs["op"] == Op.FIELD_RESULT).any():    # the twin's material at the hit
        mat[at] = twin.evaluate_field(tape, eye + t[at, None] * rd[at], sec)[1]
    shape = (height, width)
    g = grad.reshape(height, width, 3)
    norm = np.linalg.norm(g, axis=-1, keepdims=True)
    return dict(t=np.where(hit, t, np.float32(np.inf)).reshape(shape), hit=hit.reshape(shape),
                steps=steps.reshape(shape), mat=mat.reshape(shape), grad=g,
                normal=np.where(norm > 0, g / np.where(norm > 0, norm, 1), 0).astype(np.float32),
                dirs=dirs, eye=eye_out)
