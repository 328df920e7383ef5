"""The CPU twin's interpreter: the Numba float32 kernels that run a tape, the reference semantics.

Owns the jitted kernels and the plain functions over them (``evaluate_field``, ``march``,
``light_pass``, ``field_image``) that ``runtime.cpu.CpuWalker`` and ``runtime.pruning`` both call. Every op of ``runtime.opcodes`` is implemented here exactly as its ``OpSpec`` says;
where the table leaves a detail open, this module's choice (written below) is the reference and
the other walkers must match it.

Execution model: a *block interpreter*. Points are cut into blocks of ``BLOCK`` (chunks of
blocks shared out round-robin to a pool of threads, one workspace per chunk: _on_threads); for
each instruction one tight loop runs over the block, so dispatch is paid per block and the loops
vectorise. Registers are ``(n_regs, BLOCK)`` float32 (+ u32 material ids); ``p`` and ``scale``
are per point (rows x, y, z, scale). The march and light kernels' blocks are 16 x 16 pixel
tiles, shared out round-robin in row order, so that each thread's share spreads over the
picture. The value loops of the arithmetic ops that read registers are ``_arith_block``, shared
with runtime.pruning's point interpreter (the interpreter keeps their material ids). Control
flow:

  * REPEAT_LINEAR / POLAR / GRID run the same number of body iterations at every point (only the
    instance each point evaluates differs), so they run blockwise;
  * INSTANCES walks the BVH per point, from the bound of its grid cell's representative
    (_instances_reach); the body runs blockwise while any point still has a leaf to evaluate.
    When half of the block's points have finished, an outermost list (no pattern frame or split
    cull around it) moves the others to the front of the block (_compact_instances: each point's
    rows swapped, the swaps logged) and runs the body for those only; when it closes, and before
    a point-by-point fallback, the swaps are undone in reverse, so the block is in its own order
    again. Elsewhere finished points ride along, their results ignored. A point whose workspace
    hint names a leaf of this record (the leaf that held the least value at the last walk of the
    same ray: the march's steps, gradient taps, a shadow ray, AO taps) runs that leaf first, as
    the GPU's walk_hint does: the running minimum then starts near the answer and the walk skips
    more.
    Neither the value nor the material depends on it: a hinted walk also visits the nodes and
    leaves that tie with the hinted leaf's value and precede it in tree order (_ties_first), so
    every walk keeps the first of tied leaves, as one without a hint does;
  * CULL_BOX jumps when every point of the block culls, falls through when none does. Where the
    block splits, the points that cull ride through the subtree with the others and get back, at
    the jump target, the registers they held at the cull (_cull_saves lists those each subtree
    writes that are live at the target, _live_in); a point that culls is "dead" meanwhile:
    deeper culls and pattern copies count only the live points. A subtree that leaves ``p``
    changed at the cull's stack depth, holds a cull jumping past its own target, or splits more
    than ``_CULL_CAP`` deep re-runs the block point by point (blocks of one never split).
    Either way the results never depend on how points are grouped.

Choices where the op table is silent (the reference behaviour):
  * material of arithmetic results: ops reading register a carry ``mat[a]`` (MIN / MAX and the
    combine ops follow their own rule); VAR_*, CONST, INSTANCE_INDEX write material 0.
    OFFSET / SHELL carry mat[a].
  * MIN / MAX / UNION / INTERSECT / XOR propagate NaN (as numpy's minimum / maximum).
  * ROUND is computed exactly in float32: r = floor(|a|); r += 1 if |a| - r >= 0.5; sign of a.
  * COMPARE by comparisons (compare(inf, inf) = 0).
  * capsule with a == b is a sphere (h = 0); ellipsoid at its centre is -min(r); a zero-length
    polygon edge contributes its vertex distance.
  * CULL_BOX box distance: c = (lo + hi) * 0.5, h = (hi - lo) * 0.5, b = box(p - c, h) * scale.
  * REPEAT_LINEAR: t = dot(p, d) / dot(d, d); c = clamp(round(t'), 0, n-1) with t' = clamp(t, -1, n);
    the neighbour is c + 1 if t' >= c else c - 1, or the other side when that leaves 0..n-1 (one
    iteration when n == 1). Iteration 0 evaluates c, iteration 1 the neighbour, with p - k * d.
    The unchecked bound is min(|t - k|, k = lo-1, hi+1 inside 0..n-1) * |d| - e (times the loop's
    scale); the result is min(body minimum, bound), material of the body minimum (first on ties).
  * REPEAT_POLAR: s = (atan2(p.y, p.x) - atan2(c.y, c.x)) * n / (2 pi); r = round(s); sectors
    r and r + (s >= r ? 1 : -1), taken mod n (Euclidean). Copy k is the body rotated by
    theta_k = (2 pi * k) / n about z, evaluated at p' = Rz(-theta_k) p. Unchecked sectors (n >= 3)
    are lo - 1 and hi + 1 (mod n): bound = min |p - Rz(theta_k) c| - R.
  * REPEAT_GRID: per axis as REPEAT_LINEAR with d = s * e_axis (an axis with n == 1 has one
    cell and no bound); iterations enumerate the chosen cells x fastest; the bound is the min over
    axes.
  * INSTANCES: an instance's value carries the body's material.
Registers are not cleared between blocks: the validator proves no register is read unwritten.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .jit_cache import function_value, load_numba, njit
from .camera import Camera
from .opcodes import OPS, Op, check_numba_constants
from .shading import RenderSettings, unpack
from .tape import Tape, TaperayError, VALIDATED

__all__ = ["BLOCK", "evaluate_field", "march", "light_pass", "field_image"]

BLOCK = 256   # points per block (and 16 x 16 pixel tiles); 256 measured faster than 64 and 128

# The opcode numbers, class ranges and capacities (runtime/op_numbers.py, generated from
# runtime.opcodes). Numba freezes globals into its on-disk cache, which notices edits to THIS file
# only: the generated block names the numbers' hash, so a renumbering edits this file and its
# cached kernels recompile. tests/test_wgsl_header.py fails when either drifts from the table.
from .op_numbers import *  # noqa: E402,F403
# ---- BEGIN GENERATED by taperay.runtime.wgsl_header from runtime/opcodes.py: do not edit ----
# op numbers 3feab31dfaae9336: runtime/op_numbers.py, imported above
# ---- END GENERATED ----
check_numba_constants(globals(), __name__)
_CULL_CAP = 8                       # culls split at once in one block (deeper: point by point)
_COMPACT_MIN = 16                   # blocks this small run their instance lists without compacting

_f = np.float32
F0, F1, F2, F4, FH, FQ = _f(0), _f(1), _f(2), _f(4), _f(0.5), _f(0.25)
INF = _f(np.inf)
REACH_REL, REACH_POS = _f(INSTANCE_REACH_REL), _f(INSTANCE_REACH_POS)   # INSTANCES' U' (opcodes.py)
TWO_PI = _f(2 * np.pi)
TWO_24 = 16777216.0            # float64: below it an integer quotient times a float32 is exact
_JIT = dict(cache=True, error_model="numpy", fastmath=False)
# The drivers between a kernel and _run_block (_field, _trace, _gradients, _tile_setup) are inlined
# into their callers in Numba's IR (inline="always"): a jitted function of its own is compiled with
# everything it calls linked in, re-optimised and turned into machine code, so each such level
# compiled the interpreter once more (a quarter of a cold compile: PERFORMANCE.md, cold compile).
# An int literal (or a counter that starts as one: ``n = 0; n += 1``) passed to a jitted function
# makes Numba compile that function, and everything it calls with the argument, once more for the
# literal type (Literal[int](0)) besides int64. So such arguments and counters are np.int64(...):
# a cold compile of the twin's kernels took a third longer with the extra copies (PERFORMANCE.md).


# ----------------------------------------------------------------------------- scalar helpers
@njit(**_JIT)
def _fmin(a, b):
    return b if (b < a or b != b) else a


@njit(**_JIT)
def _fmax(a, b):
    return b if (b > a or b != b) else a


@njit(**_JIT)
def _round(x):
    ax = abs(x)
    r = np.floor(ax)
    if ax - r >= FH:
        r += F1
    return r if x >= F0 else -r


@njit(**_JIT)
def _rem32(x, b):
    """MOD's rule: r = fmod(x, b); r < 0 ? r + |b| : r, in float32."""
    r = np.fmod(x, b)
    return r + abs(b) if r < F0 else r


@njit(**_JIT)
def _len3(x, y, z):
    return np.sqrt(x * x + y * y + z * z)


@njit(forceinline=True, **_JIT)
def _box(x, y, z, hx, hy, hz):
    qx, qy, qz = abs(x) - hx, abs(y) - hy, abs(z) - hz
    outside = _len3(max(qx, F0), max(qy, F0), max(qz, F0))
    return outside + min(max(qx, max(qy, qz)), F0)


@njit(**_JIT)
def _cap2(dx, dy):
    """Capped 2D profile: min(max(dx, dy), 0) + |max((dx, dy), 0)|."""
    ox, oy = max(dx, F0), max(dy, F0)
    return min(max(dx, dy), F0) + np.sqrt(ox * ox + oy * oy)


@njit(**_JIT)
def _capped_cone(x, y, z, h, r1, r2):
    qx = np.sqrt(x * x + y * y)
    qy = z
    k2x, k2y = r2 - r1, F2 * h
    cax = qx - min(qx, r1 if qy < F0 else r2)
    cay = abs(qy) - h
    t = ((r2 - qx) * k2x + (h - qy) * k2y) / (k2x * k2x + k2y * k2y)
    t = min(max(t, F0), F1)
    cbx = qx - r2 + k2x * t
    cby = qy - h + k2y * t
    s = -F1 if (cbx < F0 and cay < F0) else F1
    return s * np.sqrt(min(cax * cax + cay * cay, cbx * cbx + cby * cby))


@njit(forceinline=True, **_JIT)
def _capsule(x, y, z, ax, ay, az, bx, by, bz, r):
    pax, pay, paz = x - ax, y - ay, z - az
    bax, bay, baz = bx - ax, by - ay, bz - az
    bb = bax * bax + bay * bay + baz * baz
    h = F0
    if bb > F0:
        h = min(max((pax * bax + pay * bay + paz * baz) / bb, F0), F1)
    return _len3(pax - bax * h, pay - bay * h, paz - baz * h) - r


@njit(**_JIT)
def _ellipsoid(x, y, z, rx, ry, rz):
    k0 = _len3(x / rx, y / ry, z / rz)
    k1 = _len3(x / (rx * rx), y / (ry * ry), z / (rz * rz))
    if k1 == F0:
        return -min(rx, min(ry, rz))
    return k0 * (k0 - F1) / k1


@njit(**_JIT)
def _poly(params, off, nv, x, y):
    """Signed distance to the closed polygon params[off : off + 2 nv] (even-odd inside)."""
    v0x, v0y = params[off], params[off + 1]
    d = (x - v0x) * (x - v0x) + (y - v0y) * (y - v0y)
    s = F1
    j = nv - 1
    for i in range(nv):
        vix, viy = params[off + 2 * i], params[off + 2 * i + 1]
        vjx, vjy = params[off + 2 * j], params[off + 2 * j + 1]
        ex, ey = vjx - vix, vjy - viy
        wx, wy = x - vix, y - viy
        ee = ex * ex + ey * ey
        t = F0
        if ee > F0:
            t = min(max((wx * ex + wy * ey) / ee, F0), F1)
        bx, by = wx - ex * t, wy - ey * t
        d = min(d, bx * bx + by * by)
        c1 = y >= viy
        c2 = y < vjy
        c3 = ex * wy > ey * wx
        if (c1 and c2 and c3) or ((not c1) and (not c2) and (not c3)):
            s = -s
        j = i
    return s * np.sqrt(d)


@njit(**_JIT)
def _qrot_conj(w, qx, qy, qz, x, y, z):
    """conj(q) * v * q for a unit quaternion q = (w, qx, qy, qz)."""
    ux, uy, uz = -qx, -qy, -qz
    tx = F2 * (uy * z - uz * y)
    ty = F2 * (uz * x - ux * z)
    tz = F2 * (ux * y - uy * x)
    return (x + w * tx + (uy * tz - uz * ty),
            y + w * ty + (uz * tx - ux * tz),
            z + w * tz + (ux * ty - uy * tx))


@njit(**_JIT)
def _rand(a, b):
    x = np.uint64(a)
    y = np.uint64(b)
    m = np.uint64(0xFFFFFFFF)
    h = ((x * np.uint64(0x9E3779B1)) ^ (y + np.uint64(0x7F4A7C15))) & m
    h = ((h ^ (h >> np.uint64(16))) * np.uint64(0x45D9F3B)) & m
    h = ((h ^ (h >> np.uint64(16))) * np.uint64(0x45D9F3B)) & m
    h = h ^ (h >> np.uint64(16))
    return _f(h >> np.uint64(8)) / _f(16777216.0)


@njit(**_JIT)
def _compare(va, vb):
    """COMPARE: -1, 0 or 1 by comparisons (compare(inf, inf) = 0), NaN if either is NaN."""
    r = F0
    if va < vb:
        r = -F1
    elif va > vb:
        r = F1
    elif va != va or vb != vb:
        r = va + vb
    return r


@njit(**_JIT)
def _mod_block(regs, d, a, b, n):
    """regs[d, :n] = _rem32(regs[a], regs[b]) bit for bit, for _arith_block, without a libm call
    per lane (fmodf: about 5 ns a lane here; the Menger sponge runs 21 MODs a point). Where every
    lane has |a| / |b| < 2^24 and |b| finite, each lane runs in float64, branch free, so the loop
    vectorises. floor(|a| / |b|) in float64 is the true quotient's integer part: a quotient of
    float32 values that is not an integer m lies at least 2^-24 from it, far beyond float64's
    rounding below 2^24. Then m * |b| (24 x 24 bits) and |a| - m * |b| (fmod(|a|, |b|), a float32)
    are exact; fmod's sign is a's, and MOD adds |b| to a negative remainder (|b| - r in float64,
    rounded once more to float32: the same as float32's subtraction, 53 >= 2 * 24 + 2 bits).
    Any other block (b 0 or infinite, a NaN or huge) takes _rem32 lane by lane.
    tests/test_cpu_primitives.py compares MOD with numpy's fmod on random bit patterns."""
    fast = True
    for j in range(n):
        ab = abs(np.float64(regs[b, j]))
        fast &= (abs(np.float64(regs[a, j])) / ab < TWO_24) & (ab < np.inf)
    if not fast:
        for j in range(n):
            regs[d, j] = _rem32(regs[a, j], regs[b, j])
        return
    for j in range(n):
        xd = np.float64(regs[a, j])
        ab = abs(np.float64(regs[b, j]))
        ax = abs(xd)
        r = ax - np.floor(ax / ab) * ab
        neg = xd < 0.0
        res = np.float32(ab - r) if neg & (r != 0.0) else np.float32(r)
        regs[d, j] = -res if neg & (r == 0.0) else res


# The arithmetic ops' loops, generated from the table's rules (OpSpec.numba, numba_loop, rank)
# by runtime.op_codegen; MOD's _mod_block and the scalar helpers above are the named rules.
# The disk cache is keyed on the sources of every jitted module (runtime.jit_cache.source_key), so
# an edit here recompiles runtime.pruning's cached callers too.
# ---- BEGIN GENERATED arith by taperay.runtime.op_codegen from runtime/opcodes.py: do not edit ----
@njit(**_JIT)
def _libm_block(op, regs, d, a, n):
    """regs[d, :n] = op(regs[a, :n]) for SIN COS TAN ASIN ACOS ATAN EXP LN (float32 libm), for _arith_block. The op is
    chosen per lane, but in a function this small LLVM unswitches the loop (one loop per op, as
    fast as writing them out); inlined into _arith_block it did not (~20% slower on
    trigonometric tapes), so _arith_block calls it."""
    for j in range(n):
        x = regs[a, j]
        if op <= TAN:
            r = np.sin(x) if op == SIN else (np.cos(x) if op == COS else np.tan(x))
        elif op <= ATAN:
            r = np.arcsin(x) if op == ASIN else (np.arccos(x) if op == ACOS else np.arctan(x))
        else:
            r = np.exp(x) if op == EXP else np.log(x)
        regs[d, j] = r


# forceinline (LLVM alwaysinline): a call per op is slower where blocks hold few points (the
# march's late steps, march_pruned's cells: _run_block at 8 points ~25% per op), and Numba's IR
# inlining (inline="always") adds an atomic refcount increment / decrement of ``regs`` per op.
# No array views inside (RAND takes its bits from scalar views), so the body needs no refcounting.
@njit(forceinline=True, **_JIT)
def _arith_block(op, regs, d, a, b, c, n):
    """regs[d, :n] = op(regs[a], regs[b], regs[c]) lane by lane, for the arithmetic ops that read
    registers: the twin's float32 rule of each (OpSpec.numba), shared by _run_block and
    runtime.pruning's point interpreter, hottest first (OpSpec.rank). Values only: VAR_* / CONST /
    INSTANCE_INDEX (they read the point, the parameters, the pattern frame) and material ids are
    the callers'."""
    if op == MAX:
        for j in range(n):
            regs[d, j] = _fmax(regs[a, j], regs[b, j])
    elif op == SUB:
        for j in range(n):
            regs[d, j] = regs[a, j] - regs[b, j]
    elif op == ADD:
        for j in range(n):
            regs[d, j] = regs[a, j] + regs[b, j]
    elif op == MIN:
        for j in range(n):
            regs[d, j] = _fmin(regs[a, j], regs[b, j])
    elif op == COPY:
        for j in range(n):
            regs[d, j] = regs[a, j]
    elif op == NEG:
        for j in range(n):
            regs[d, j] = -regs[a, j]
    elif op == SQUARE:
        for j in range(n):
            regs[d, j] = regs[a, j] * regs[a, j]
    elif op == SQRT:
        for j in range(n):
            regs[d, j] = np.sqrt(regs[a, j])
    elif op == MUL:
        for j in range(n):
            regs[d, j] = regs[a, j] * regs[b, j]
    elif op == ABS:
        for j in range(n):
            regs[d, j] = abs(regs[a, j])
    elif op == RECIP:
        for j in range(n):
            regs[d, j] = F1 / regs[a, j]
    elif op == DIV:
        for j in range(n):
            regs[d, j] = regs[a, j] / regs[b, j]
    elif op == FLOOR:
        for j in range(n):
            regs[d, j] = np.floor(regs[a, j])
    elif op == CEIL:
        for j in range(n):
            regs[d, j] = np.ceil(regs[a, j])
    elif op == ROUND:
        for j in range(n):
            regs[d, j] = _round(regs[a, j])
    elif op == SIN or op == COS or op == TAN or op == ASIN or op == ACOS or op == ATAN or op == EXP or op == LN:
        _libm_block(op, regs, d, a, n)
    elif op == NOT:
        for j in range(n):
            regs[d, j] = F1 if regs[a, j] == F0 else F0
    elif op == ATAN2:
        for j in range(n):
            regs[d, j] = np.arctan2(regs[a, j], regs[b, j])
    elif op == COMPARE:
        for j in range(n):
            regs[d, j] = _compare(regs[a, j], regs[b, j])
    elif op == MOD:
        _mod_block(regs, d, a, b, n)
    elif op == AND:
        for j in range(n):
            regs[d, j] = regs[a, j] if regs[a, j] == F0 else regs[b, j]
    elif op == OR:
        for j in range(n):
            regs[d, j] = regs[a, j] if regs[a, j] != F0 else regs[b, j]
    elif op == MIX:
        for j in range(n):
            regs[d, j] = regs[a, j] + (regs[b, j] - regs[a, j]) * regs[c, j]
    elif op == RAND:
        for j in range(n):
            regs[d, j] = _rand(np.float32(regs[a, j]).view(np.uint32), np.float32(regs[b, j]).view(np.uint32))
# ---- END GENERATED arith ----


@njit(**_JIT)
def _cells(t, cnt):
    """Nearest index c, its neighbour c2 and min |t - k| over the unchecked k (inf if none)."""
    tc = t if t >= _f(-1) else _f(-1)        # clamped (NaN-safe) for choosing the cells only
    if tc > _f(cnt):
        tc = _f(cnt)
    c = min(max(np.int64(_round(tc)), 0), cnt - 1)
    step = 1 if tc >= _f(c) else -1
    c2 = c + step
    if c2 < 0 or c2 > cnt - 1:
        c2 = c - step
    if cnt == 1:
        c2 = c
    lo, hi = min(c, c2), max(c, c2)
    bnd = INF
    if lo - 1 >= 0:
        bnd = abs(t - _f(lo - 1))
    if hi + 1 <= cnt - 1:
        bnd = min(bnd, abs(_f(hi + 1) - t))
    return c, c2, bnd


# ----------------------------------------------------------------------------- workspace
WS_PIN, WS_OUT_D, WS_OUT_M, WS_HINT = 0, 1, 2, 19     # the workspace entries the drivers use by name


@njit(**_JIT)
def _workspace(n_regs, B, n_save):
    """Per-chunk scratch: (pin, out_d, out_m, regs, mats, p, pstack, lp, lacc, lmat, lbound, lcopy,
    lcell, lint, cmask, cdead, csave_v, csave_m, cframe, hint, swaps); cmask .. cframe hold split culls
    (n_save: the most registers a cull's subtree writes, _cull_saves); hint (2, B) each point's
    INSTANCES walk hint (record + 1, BVH leaf + 1; 0: none), which _run_block reads and updates:
    the callers that evaluate the steps of one ray at one position keep it, the others clear it;
    swaps (2, B) the column swaps of a compacted instance list (_compact_instances). regs and mats
    have a row past the tape's registers: _run_block's scratch row (_scratch_row)."""
    k = _CULL_CAP if n_save > 0 else 0
    return (np.zeros((3, B), np.float32), np.zeros(B, np.float32), np.zeros(B, np.uint32),
            np.zeros((n_regs + 1, B), np.float32), np.zeros((n_regs + 1, B), np.uint32),
            np.zeros((4, B), np.float32), np.zeros((STACK_CAP, 4, B), np.float32),
            np.zeros((LOOP_CAP, 4, B), np.float32), np.zeros((LOOP_CAP, B), np.float32),
            np.zeros((LOOP_CAP, B), np.uint32), np.zeros((LOOP_CAP, B), np.float32),
            np.zeros((LOOP_CAP, B), np.float32),
            np.zeros((LOOP_CAP, 6, B), np.int64), np.zeros((LOOP_CAP, 8), np.int64),
            np.zeros((_CULL_CAP + 1, B), np.bool_), np.zeros(B, np.int32),
            np.empty((k, n_save, B), np.float32), np.empty((k, n_save, B), np.uint32),
            np.zeros((_CULL_CAP, 2), np.int64), np.zeros((2, B), np.int64), np.zeros((2, B), np.int64))


@njit(**_JIT)
def _live_in(cols, reads, writes):
    """live[q]: the registers live on entry to record q (bit r % 64 of word r // 64): read on some
    path from q before they are written; row n is the end of the tape, where register 0 (the
    value) is read. Paths: the next record, a cull's jump, a pattern's way past its body (taken
    as possible for every pattern), and REPEAT_END's way back to its body. reads[op, f]: field
    a / b / c of op is a register read; writes[op]: op writes reg[dst] (runtime.opcodes)."""
    n = cols.shape[0]
    live = np.zeros((n + 1, 4), np.uint64)
    live[n, 0] = np.uint64(1)
    word = np.zeros(4, np.uint64)
    changed = True
    while changed:                     # (backward passes to a fixed point: loops need a few)
        changed = False
        for q in range(n - 1, -1, -1):
            op, jump = cols[q, 0], np.int64(cols[q, 7])
            other = -1
            if op == CULL_BOX:
                other = jump
            elif PATTERN_FIRST <= op <= PATTERN_LAST:
                other = jump + 1       # (a pattern past its REPEAT_END; REPEAT_END back to its body)
            for w in range(4):
                word[w] = live[q + 1, w] | (live[other, w] if other >= 0 else np.uint64(0))
            if writes[op]:
                r = cols[q, 1]
                word[r >> 6] &= ~(np.uint64(1) << np.uint64(r & 63))
            for f in range(3):
                if reads[op, f]:
                    r = cols[q, 2 + f]
                    word[r >> 6] |= np.uint64(1) << np.uint64(r & 63)
            for w in range(4):
                if word[w] != live[q, w]:
                    live[q, w] = word[w]
                    changed = True
    return live


@njit(**_JIT)
def _cull_saves(cols, n_regs, reads, writes):
    """(index, saves, width): index[i] is -1, or, for a CULL_BOX whose subtree a split block may run
    for the points that cull, an offset k into ``saves``: saves[k] = count, saves[k + 1 : k + 1 +
    count] = the registers the cull and its subtree write that are live at the jump target
    (_live_in: restored there for those points; the others are written again before any read);
    width, the largest count (0: no cull can split a block). A subtree
    qualifies when it leaves p as it found it at the cull's stack depth (point ops there only
    inside PUSH / POP or a pattern body, which restores p) and every cull inside it jumps no
    further than its own target. reads / writes: _live_in's."""
    n = cols.shape[0]
    live = _live_in(cols, reads, writes)
    idx = np.full(n, -1, np.int64)
    out = np.zeros(1, np.int64)
    used = 0
    width = 0
    seen = np.zeros(max(n_regs, 1), np.bool_)
    for i in range(n):
        if cols[i, 0] != CULL_BOX:
            continue
        target = np.int64(cols[i, 7])
        seen[:] = False
        seen[cols[i, 1]] = True
        depth, loops, clean = 0, 0, True
        for q in range(i + 1, min(target, n)):
            op = cols[q, 0]
            if op == PUSH:
                depth += 1
            elif op == POP:
                depth -= 1
                if depth < 0:
                    clean = False
            elif POINT_FIRST <= op <= POINT_LAST and depth == 0 and loops == 0:   # (not PUSH / POP)
                clean = False
            elif PATTERN_FIRST <= op <= PATTERN_LAST and op != REPEAT_END:
                loops += 1
            elif op == REPEAT_END:
                loops -= 1
            elif op == CULL_BOX and cols[q, 7] > target:
                clean = False
            if not clean:
                break
            if writes[op]:
                seen[cols[q, 1]] = True
        if not clean:
            continue
        for r in range(n_regs):
            if (live[target, r >> 6] >> np.uint64(r & 63)) & np.uint64(1) == np.uint64(0):
                seen[r] = False
        cnt = 0
        for r in range(n_regs):
            if seen[r]:
                cnt += 1
        if used + 1 + cnt > out.shape[0]:
            grown = np.zeros(2 * (used + 1 + cnt), np.int64)
            grown[:used] = out[:used]
            out = grown
        idx[i] = used
        out[used] = cnt
        width = max(width, cnt)
        w = used + 1
        for r in range(n_regs):
            if seen[r]:
                out[w] = r
                w += 1
        used = w
    return idx, out[:max(used, 1)], width


# ----------------------------------------------------------------------------- patterns
@njit(**_JIT)
def _loop_enter(op, prm, params, n, L, p, lp, lbound, lcell, lint):
    """Open pattern frame L at the current p: choose each point's cells and unchecked bound."""
    for j in range(n):
        for r in range(4):
            lp[L, r, j] = p[r, j]
    n_iter = 1
    if op == REPEAT_LINEAR:
        dx, dy, dz = params[prm], params[prm + 1], params[prm + 2]
        cnt, e = np.int64(params[prm + 3]), params[prm + 4]
        dd = dx * dx + dy * dy + dz * dz
        dlen = np.sqrt(dd)
        n_iter = 1 if cnt == 1 else 2
        for j in range(n):
            t = (p[0, j] * dx + p[1, j] * dy + p[2, j] * dz) / dd
            c, c2, bnd = _cells(t, cnt)
            lcell[L, 0, j], lcell[L, 1, j] = c, c2
            lbound[L, j] = (bnd * dlen - e) * p[3, j]
    elif op == REPEAT_POLAR:
        cnt = np.int64(params[prm])
        cx, cy, cz, R = params[prm + 1], params[prm + 2], params[prm + 3], params[prm + 4]
        phic = np.arctan2(cy, cx)
        fcnt = _f(cnt)
        n_iter = 1 if cnt == 1 else 2
        for j in range(n):
            x, y, z = p[0, j], p[1, j], p[2, j]
            s = (np.arctan2(y, x) - phic) * fcnt / TWO_PI
            r = np.int64(_round(s))
            step = 1 if s >= _f(r) else -1
            lcell[L, 0, j] = r % cnt
            lcell[L, 1, j] = (r + step) % cnt
            bnd = INF
            if cnt >= 3:
                for k in (min(r, r + step) - 1, max(r, r + step) + 1):
                    th = TWO_PI * _f(k % cnt) / fcnt
                    cs, sn = np.cos(th), np.sin(th)
                    bnd = min(bnd, _len3(x - (cs * cx - sn * cy), y - (sn * cx + cs * cy), z - cz))
            lbound[L, j] = (bnd - R) * p[3, j]
    else:  # REPEAT_GRID
        for j in range(n):
            lbound[L, j] = INF
        for ax in range(3):
            s = params[prm + ax]
            cnt, e = np.int64(params[prm + 3 + ax]), params[prm + 6 + ax]
            if cnt == 1:
                for j in range(n):
                    lcell[L, 2 * ax, j], lcell[L, 2 * ax + 1, j] = 0, 0
                continue
            n_iter *= 2
            for j in range(n):
                c, c2, bnd = _cells(p[ax, j] / s, cnt)
                lcell[L, 2 * ax, j], lcell[L, 2 * ax + 1, j] = c, c2
                lbound[L, j] = min(lbound[L, j], (bnd * abs(s) - e) * p[3, j])
    lint[L, 1] = n_iter
    lint[L, 2] = 0


@njit(**_JIT)
def _grid_rows(it, params, prm):
    """The lcell rows holding the x, y and z cell indices that grid iteration ``it`` evaluates (x
    fastest over the axes of count > 1; an axis of count 1 has cell 0 in both its rows), the
    same for every point of the block."""
    sel = it
    r0, r1, r2 = 0, 2, 4
    if np.int64(params[prm + 3]) != 1:
        r0 = sel & 1
        sel >>= 1
    if np.int64(params[prm + 4]) != 1:
        r1 = 2 + (sel & 1)
        sel >>= 1
    if np.int64(params[prm + 5]) != 1:
        r2 = 4 + (sel & 1)
    return r0, r1, r2


@njit(**_JIT)
def _loop_point(L, it, n, params, p, lp, lcell, lint):
    """Set p (and scale) for iteration ``it`` of pattern frame L."""
    op, prm = lint[L, 3], lint[L, 4]
    if op == REPEAT_LINEAR:
        dx, dy, dz = params[prm], params[prm + 1], params[prm + 2]
        for j in range(n):
            k = _f(lcell[L, it, j])
            p[0, j] = lp[L, 0, j] - k * dx
            p[1, j] = lp[L, 1, j] - k * dy
            p[2, j] = lp[L, 2, j] - k * dz
            p[3, j] = lp[L, 3, j]
    elif op == REPEAT_POLAR:
        fcnt = _f(params[prm])
        for j in range(n):
            th = TWO_PI * _f(lcell[L, it, j]) / fcnt
            cs, sn = np.cos(th), np.sin(th)
            x, y = lp[L, 0, j], lp[L, 1, j]
            p[0, j] = cs * x + sn * y
            p[1, j] = cs * y - sn * x
            p[2, j] = lp[L, 2, j]
            p[3, j] = lp[L, 3, j]
    else:
        r0, r1, r2 = _grid_rows(it, params, prm)
        sx, sy, sz = params[prm], params[prm + 1], params[prm + 2]
        for j in range(n):
            p[0, j] = lp[L, 0, j] - _f(lcell[L, r0, j]) * sx
            p[1, j] = lp[L, 1, j] - _f(lcell[L, r1, j]) * sy
            p[2, j] = lp[L, 2, j] - _f(lcell[L, r2, j]) * sz
            p[3, j] = lp[L, 3, j]


@njit(**_JIT)
def _copy_bound(L, n, params, p, lint, lcopy):
    """lcopy[L] = the bound of the copy p (set by _loop_point) evaluates: the distance, times the
    scale, to the child's box (grid: half extents e), slab (linear: |p . d| / |d| <= e) or sphere
    (polar: centre c, radius R). A copy's value is max(body, this bound), so a copy whose bound is
    >= the running minimum cannot change the pattern's value (the GPU skips it)."""
    op, prm = lint[L, 3], lint[L, 4]
    if op == REPEAT_LINEAR:
        dx, dy, dz, e = params[prm], params[prm + 1], params[prm + 2], params[prm + 4]
        dlen = np.sqrt(dx * dx + dy * dy + dz * dz)
        for j in range(n):
            lcopy[L, j] = (abs(p[0, j] * dx + p[1, j] * dy + p[2, j] * dz) / dlen - e) * p[3, j]
    elif op == REPEAT_POLAR:
        cx, cy, cz, R = params[prm + 1], params[prm + 2], params[prm + 3], params[prm + 4]
        for j in range(n):
            lcopy[L, j] = (_len3(p[0, j] - cx, p[1, j] - cy, p[2, j] - cz) - R) * p[3, j]
    else:
        ex, ey, ez = params[prm + 6], params[prm + 7], params[prm + 8]
        for j in range(n):
            lcopy[L, j] = _box(p[0, j], p[1, j], p[2, j], ex, ey, ez) * p[3, j]


@njit(**_JIT)
def _instance_indices(L, n, params, lcell, lint, out):
    """out[:n] = the index of the copy pattern frame L evaluates at each point (INSTANCE_INDEX;
    a grid's rows chosen once, as _loop_point does)."""
    op = lint[L, 3]
    if op == INSTANCES:
        for j in range(n):
            out[j] = _f(lcell[L, 1, j])
    elif op == REPEAT_GRID:
        prm = lint[L, 4]
        r0, r1, r2 = _grid_rows(lint[L, 2], params, prm)
        nx, ny = np.int64(params[prm + 3]), np.int64(params[prm + 4])
        for j in range(n):
            out[j] = _f(lcell[L, r0, j] + nx * (lcell[L, r1, j] + ny * lcell[L, r2, j]))
    else:
        it = lint[L, 2]
        for j in range(n):
            out[j] = _f(lcell[L, it, j])


# The instance lists' helpers below (and _box, _capsule) are forceinline: _run_block calls them
# per point, several a leaf, and as calls they cost an instance list of one sphere 133-138 ns a
# point against 78-84 inlined (the same bits; the cold compile the same; docs/ASSEMBLIES.md).
@njit(forceinline=True, **_JIT)
def _instance_local(k, x, y, z, inst):
    """The point (x, y, z) in instance k's frame: conj(q) * (p - t) * q / s."""
    s = inst[k, 7]
    lx, ly, lz = _qrot_conj(inst[k, 0], inst[k, 1], inst[k, 2], inst[k, 3], x - inst[k, 4], y - inst[k, 5],
                           z - inst[k, 6])
    return lx / s, ly / s, lz / s


@njit(forceinline=True, **_JIT)
def _grid_cell(v, lo, edge, count):
    """The cell of coordinate v on a grid axis, clamped into 0 .. count - 1 (NaN: 0)."""
    c = (v - lo) / edge
    if not c >= F0:
        return np.int64(0)
    if c >= count:
        return count - 1
    return min(np.int64(c), count - 1)


@njit(forceinline=True, **_JIT)
def _instances_reach(prm, x, y, z, sc, params, inst):
    """INSTANCES' U' at (x, y, z, sc) (opcodes.py): the representative of the grid cell holding the
    point bounds the least instance value from above; +inf without a capsule."""
    r = params[prm + 12]
    if r < F0:
        return INF
    nx, ny, nz = np.int64(params[prm + 17]), np.int64(params[prm + 18]), np.int64(params[prm + 19])
    e = params[prm + 16]
    cx = _grid_cell(x, params[prm + 13], e, nx)
    cy = _grid_cell(y, params[prm + 14], e, ny)
    cz = _grid_cell(z, params[prm + 15], e, nz)
    k = np.int64(params[prm + 20 + (cz * ny + cy) * nx + cx])
    lx, ly, lz = _instance_local(k, x, y, z, inst)
    ws = inst[k, 7] * sc
    u = max(_capsule(lx, ly, lz, params[prm + 6], params[prm + 7], params[prm + 8], params[prm + 9],
                     params[prm + 10], params[prm + 11], r) * ws, F0)
    return u + REACH_REL * (u + r * ws) + REACH_POS * max(abs(x), max(abs(y), abs(z))) * sc


@njit(forceinline=True, **_JIT)
def _node_distance(node, x, y, z, sc, bvhf):
    """b: the distance * sc from (x, y, z) to BVH node ``node``'s box (_walk_nodes' arrays)."""
    return _box(x - bvhf[node, 0], y - bvhf[node, 1], z - bvhf[node, 2],
                bvhf[node, 4], bvhf[node, 5], bvhf[node, 6]) * sc


@njit(forceinline=True, **_JIT)
def _child_distance(k, x, y, z, sc, prm, params, inst):
    """c: the distance * scale from instance k's local point of (x, y, z, sc) to the child's box
    (INSTANCES' params prm .. prm + 5)."""
    lx, ly, lz = _instance_local(k, x, y, z, inst)
    x0, y0, z0, x1, y1, z1 = (params[prm], params[prm + 1], params[prm + 2], params[prm + 3],
                              params[prm + 4], params[prm + 5])
    return _box(lx - (x0 + x1) * FH, ly - (y0 + y1) * FH, lz - (z0 + z1) * FH,
                (x1 - x0) * FH, (y1 - y0) * FH, (z1 - z0) * FH) * (inst[k, 7] * sc)


@njit(forceinline=True, **_JIT)
def _ties_first(v, node, acc, best):
    """v equals the running minimum acc and a leaf at or after ``node`` may precede ``best``, the
    leaf holding acc, in tree order. The walks keep the first of tied leaves in tree order, so a
    hinted walk (best the hinted leaf, run first) ends where a walk without a hint does."""
    return v == acc and node < best


@njit(forceinline=True, **_JIT)
def _walk_skips(b, node, acc, best, reach):
    """A node or leaf ``node`` of bound b cannot change the walk's answer: b > reach (U'), or b >=
    the running minimum acc (held by leaf ``best``; -1: none yet) unless it ties and may precede
    ``best`` (_ties_first). NaN never skips."""
    return (b >= acc and not _ties_first(b, node, acc, best)) or b > reach


@njit(forceinline=True, **_JIT)
def _bvh_seek(node, end, x, y, z, sc, acc, best, reach, prm, params, bvhf, bvhi, inst, hinted):
    """Walk the BVH (_walk_nodes' arrays) from ``node`` to the next leaf to evaluate; returns
    (node or end, the leaf's bound max(b, c)): nodes whose box distance b _walk_skips are
    skipped, and so are leaves whose max(b, c) does, c being the distance from their local point
    to the child's box, and the leaf ``hinted`` (already run; -1: none)."""
    while node < end:
        b = _node_distance(node, x, y, z, sc, bvhf)
        if _walk_skips(b, node, acc, best, reach):
            node = np.int64(bvhi[node, 3])
        elif bvhi[node, 7] >= 0 and node != hinted:
            b = max(b, _child_distance(bvhi[node, 7], x, y, z, sc, prm, params, inst))
            if _walk_skips(b, node, acc, best, reach):
                node += 1
            else:
                return node, b
        else:
            node += 1
    return end, INF


@njit(forceinline=True, **_JIT)
def _instance_point(L, j, node, p, lp, lcell, bvhi, inst):
    """p = conj(q) * (p_saved - t) * q / s, scale = scale_saved * s for the leaf ``node``."""
    k = bvhi[node, 7]
    lcell[L, 0, j] = node
    lcell[L, 1, j] = k
    p[0, j], p[1, j], p[2, j] = _instance_local(k, lp[L, 0, j], lp[L, 1, j], lp[L, 2, j], inst)
    p[3, j] = lp[L, 3, j] * inst[k, 7]


@njit(**_JIT)
def _swap_columns(i, k, sp, regs, mats, p, pstack, lp, lacc, lmat, lbound, lcopy, lcell, cdead, hint):
    """Exchange points i and k of the block: every per-point row an outermost instance list (frame
    0) reads (the registers, p, the point stack to depth sp, the frame's rows, cdead, hint)."""
    for r in range(regs.shape[0]):
        regs[r, i], regs[r, k] = regs[r, k], regs[r, i]
        mats[r, i], mats[r, k] = mats[r, k], mats[r, i]
    for r in range(4):
        p[r, i], p[r, k] = p[r, k], p[r, i]
        for s in range(sp):
            pstack[s, r, i], pstack[s, r, k] = pstack[s, r, k], pstack[s, r, i]
    for r in range(4):
        lp[0, r, i], lp[0, r, k] = lp[0, r, k], lp[0, r, i]
    lacc[0, i], lacc[0, k] = lacc[0, k], lacc[0, i]
    lmat[0, i], lmat[0, k] = lmat[0, k], lmat[0, i]
    lbound[0, i], lbound[0, k] = lbound[0, k], lbound[0, i]
    lcopy[0, i], lcopy[0, k] = lcopy[0, k], lcopy[0, i]
    for r in range(6):
        lcell[0, r, i], lcell[0, r, k] = lcell[0, r, k], lcell[0, r, i]
    cdead[i], cdead[k] = cdead[k], cdead[i]
    for r in range(2):
        hint[r, i], hint[r, k] = hint[r, k], hint[r, i]


@njit(**_JIT)
def _compact_instances(n, end, nswap, sp, swaps, regs, mats, p, pstack, lp, lacc, lmat, lbound, lcopy, lcell,
                       cdead, hint):
    """Move the points of the outermost instance list (frame 0) that still have a leaf to run
    (lcell[0, 0] < end) to the front of the block, logging each swap in swaps from nswap; returns
    (how many are in front, nswap). The body then runs for those only."""
    i, k = np.int64(0), n - 1
    while True:
        while i < k and lcell[0, 0, i] < end:
            i += 1
        while i < k and lcell[0, 0, k] >= end:
            k -= 1
        if i >= k:
            break
        _swap_columns(i, k, sp, regs, mats, p, pstack, lp, lacc, lmat, lbound, lcopy, lcell, cdead, hint)
        swaps[0, nswap], swaps[1, nswap] = i, k
        nswap += 1
    m = np.int64(0)
    while m < n and lcell[0, 0, m] < end:
        m += 1
    return m, nswap


@njit(**_JIT)
def _undo_swaps(nswap, sp, swaps, regs, mats, p, pstack, lp, lacc, lmat, lbound, lcopy, lcell, cdead, hint):
    """Put the points of a compacted block back in their places (the swaps in reverse)."""
    for q in range(nswap - 1, -1, -1):
        _swap_columns(swaps[0, q], swaps[1, q], sp, regs, mats, p, pstack, lp, lacc, lmat, lbound, lcopy,
                      lcell, cdead, hint)


# ----------------------------------------------------------------------------- the interpreter
@njit(forceinline=True, **_JIT)
def _scratch_row(regs, dst, a, b, c):
    """The row a record reading registers a, b, c writes: dst, or the scratch row past the tape's
    registers (the last) where dst is one of them. A loop reading and writing one row does not
    vectorise: LLVM cannot prove at compile time that rows dst and a are equal or apart, and its
    runtime check sends overlapping rows to the scalar loop (4-6x slower a lane here; register
    allocation writes in place most of the time)."""
    return regs.shape[0] - 1 if dst == a or dst == b or dst == c else dst


@njit(forceinline=True, **_JIT)
def _row_back(rows, out, dst, n):
    """Copy a record's result from the scratch row ``out`` to its register ``dst`` (values, or
    material ids)."""
    if out != dst:
        for j in range(n):
            rows[dst, j] = rows[out, j]


@njit(**_JIT)
def _run_block(cols, params, bvhf, bvhi, inst, csidx, csregs, n, ws, helpers):
    """Evaluate the tape at ws.pin[:, :n] into ws.out_d / ws.out_m. False if a cull split the
    block where its points cannot ride through the subtree (see the module docstring). helpers:
    the per-block helpers it calls, as function values (_block_helpers)."""
    _loop_enter, _copy_bound = helpers
    pin, out_d, out_m, regs, mats, p, pstack, lp, lacc, lmat, lbound, lcopy, lcell, lint, \
        cmask, cdead, csave_v, csave_m, cframe, hint, swaps = ws
    for j in range(n):
        p[0, j], p[1, j], p[2, j], p[3, j] = pin[0, j], pin[1, j], pin[2, j], F1
        cdead[j] = 0
    sp = np.int64(0)
    nswap = np.int64(0)    # the swaps of a compacted outermost instance list (_compact_instances)
    lsp = np.int64(0)      # (counters passed to jitted calls start as int64: see _JIT)
    csp = 0
    pc = 0
    n_ins = cols.shape[0]
    while pc < n_ins:
        while csp > 0 and cframe[csp - 1, 0] == pc:     # a split cull's target: its points return
            csp -= 1
            k = cframe[csp, 1]
            back = cmask[csp]
            for s in range(csregs[k]):      # (register by register, selects over the block: vectorised)
                r = csregs[k + 1 + s]
                for j in range(n):
                    regs[r, j] = csave_v[csp, s, j] if back[j] else regs[r, j]
                    mats[r, j] = csave_m[csp, s, j] if back[j] else mats[r, j]
            for j in range(n):
                cdead[j] -= np.int32(back[j])
        op = cols[pc, 0]
        dst, a, b, c = cols[pc, 1], cols[pc, 2], cols[pc, 3], cols[pc, 4]
        prm, aux = np.int64(cols[pc, 5]), cols[pc, 6]
        nxt = pc + 1
        if op <= TERNARY_LAST:                                        # ---- arithmetic
            if op == CONST or op <= VAR_Z:
                if op == CONST:
                    v = params[prm]
                    for j in range(n):
                        regs[dst, j] = v
                else:                                                 # VAR_X / VAR_Y / VAR_Z
                    for j in range(n):
                        regs[dst, j] = p[op, j]
                for j in range(n):
                    mats[dst, j] = 0
            elif op == INSTANCE_INDEX:
                if lsp > 0:
                    _instance_indices(lsp - 1, n, params, lcell, lint, regs[dst])
                else:
                    for j in range(n):
                        regs[dst, j] = F0
                for j in range(n):
                    mats[dst, j] = 0
            else:
                out = _scratch_row(regs, dst, a, b, c)
                if op == MIN:   # materials first (dst may be a or b): both loaded, then one selected
                    for j in range(n):
                        ma, mb = mats[a, j], mats[b, j]
                        mats[out, j] = mb if regs[b, j] < regs[a, j] else ma
                elif op == MAX:
                    for j in range(n):
                        ma, mb = mats[a, j], mats[b, j]
                        mats[out, j] = mb if regs[b, j] > regs[a, j] else ma
                else:
                    for j in range(n):
                        mats[out, j] = mats[a, j]
                _arith_block(op, regs, out, a, b, c, n)
                _row_back(regs, out, dst, n)
                _row_back(mats, out, dst, n)
        elif op <= SHAPE_LAST:                                        # ---- shapes
            for j in range(n):
                mats[dst, j] = aux
            if op == SPHERE:
                r = params[prm]
                for j in range(n):
                    regs[dst, j] = (_len3(p[0, j], p[1, j], p[2, j]) - r) * p[3, j]
            elif op == BOX or op == ROUND_BOX:
                hx, hy, hz = params[prm], params[prm + 1], params[prm + 2]
                rr = params[prm + 3] if op == ROUND_BOX else F0
                for j in range(n):
                    regs[dst, j] = (_box(p[0, j], p[1, j], p[2, j], hx - rr, hy - rr, hz - rr) - rr) * p[3, j]
            elif op == CYLINDER:
                r, h = params[prm], params[prm + 1]
                for j in range(n):
                    x, y = p[0, j], p[1, j]
                    regs[dst, j] = _cap2(np.sqrt(x * x + y * y) - r, abs(p[2, j]) - h) * p[3, j]
            elif op == CAPPED_CONE:
                h, r1, r2 = params[prm], params[prm + 1], params[prm + 2]
                for j in range(n):
                    regs[dst, j] = _capped_cone(p[0, j], p[1, j], p[2, j], h, r1, r2) * p[3, j]
            elif op == CAPSULE:
                ax, ay, az = params[prm], params[prm + 1], params[prm + 2]
                bx, by, bz, r = params[prm + 3], params[prm + 4], params[prm + 5], params[prm + 6]
                for j in range(n):
                    regs[dst, j] = _capsule(p[0, j], p[1, j], p[2, j], ax, ay, az, bx, by, bz, r) * p[3, j]
            elif op == TORUS:
                R, r = params[prm], params[prm + 1]
                for j in range(n):
                    x, y = p[0, j], p[1, j]
                    qx = np.sqrt(x * x + y * y) - R
                    z = p[2, j]
                    regs[dst, j] = (np.sqrt(qx * qx + z * z) - r) * p[3, j]
            elif op == ELLIPSOID:
                rx, ry, rz = params[prm], params[prm + 1], params[prm + 2]
                for j in range(n):
                    regs[dst, j] = _ellipsoid(p[0, j], p[1, j], p[2, j], rx, ry, rz) * p[3, j]
            elif op == PLANE:
                nx, ny, nz, d = params[prm], params[prm + 1], params[prm + 2], params[prm + 3]
                for j in range(n):
                    regs[dst, j] = (p[0, j] * nx + p[1, j] * ny + p[2, j] * nz - d) * p[3, j]
            elif op == EXTRUDE_POLY:
                h = params[prm]
                for j in range(n):
                    d2 = _poly(params, prm + 1, np.int64(a), p[0, j], p[1, j])
                    regs[dst, j] = _cap2(d2, abs(p[2, j]) - h) * p[3, j]
            elif op == REVOLVE_POLY:
                for j in range(n):
                    x, y = p[0, j], p[1, j]
                    regs[dst, j] = _poly(params, prm, np.int64(a), np.sqrt(x * x + y * y), p[2, j]) * p[3, j]
        elif op <= POINT_LAST:                                        # ---- point ops
            if op == PUSH:
                for r in range(4):
                    for j in range(n):
                        pstack[sp, r, j] = p[r, j]
                sp += 1
            elif op == POP:
                sp -= 1
                for r in range(4):
                    for j in range(n):
                        p[r, j] = pstack[sp, r, j]
            elif op == TRANSLATE or op == ELONGATE:
                tx, ty, tz = params[prm], params[prm + 1], params[prm + 2]
                if op == TRANSLATE:
                    for j in range(n):
                        p[0, j] -= tx
                        p[1, j] -= ty
                        p[2, j] -= tz
                else:
                    for j in range(n):
                        p[0, j] -= min(max(p[0, j], -tx), tx)
                        p[1, j] -= min(max(p[1, j], -ty), ty)
                        p[2, j] -= min(max(p[2, j], -tz), tz)
            elif op == ROTATE:
                w, qx, qy, qz = params[prm], params[prm + 1], params[prm + 2], params[prm + 3]
                for j in range(n):
                    p[0, j], p[1, j], p[2, j] = _qrot_conj(w, qx, qy, qz, p[0, j], p[1, j], p[2, j])
            elif op == SCALE:
                s = params[prm]
                for j in range(n):
                    p[0, j] /= s
                    p[1, j] /= s
                    p[2, j] /= s
                    p[3, j] *= s
            elif op == MIRROR:
                nx, ny, nz, d = params[prm], params[prm + 1], params[prm + 2], params[prm + 3]
                for j in range(n):
                    dp = p[0, j] * nx + p[1, j] * ny + p[2, j] * nz
                    if dp < d:
                        k = F2 * (dp - d)
                        p[0, j] -= k * nx
                        p[1, j] -= k * ny
                        p[2, j] -= k * nz
        elif op <= COMBINE_LAST:                                      # ---- combine
            out = _scratch_row(regs, dst, a, b, c)
            if op == OFFSET or op == SHELL:
                r = params[prm]
                for j in range(n):
                    va = regs[a, j]
                    regs[out, j] = (va if op == OFFSET else abs(va)) - r
                    mats[out, j] = mats[a, j]
            elif op == UNION or op == INTERSECT or op == XOR:
                for j in range(n):
                    va, vb = regs[a, j], regs[b, j]
                    ma, mb = mats[a, j], mats[b, j]
                    if op == UNION:
                        regs[out, j] = _fmin(va, vb)
                        mats[out, j] = mb if vb < va else ma
                    elif op == INTERSECT:
                        regs[out, j] = _fmax(va, vb)
                        mats[out, j] = mb if vb > va else ma
                    else:
                        regs[out, j] = _fmax(_fmin(va, vb), -_fmax(va, vb))
                        mats[out, j] = mb if vb < va else ma
            elif op == DIFFERENCE:
                for j in range(n):
                    regs[out, j] = _fmax(regs[a, j], -regs[b, j])
                    mats[out, j] = mats[a, j]
            else:   # smooth ops: smin(x, y) = min(x, y) - h*h*k/4, h = max(k - |x - y|, 0) / k
                k = params[prm]
                for j in range(n):
                    va, vb = regs[a, j], regs[b, j]
                    ma, mb = mats[a, j], mats[b, j]
                    if op == SMOOTH_UNION:
                        x, y, sg = va, vb, F1
                        mats[out, j] = mb if vb < va else ma
                    elif op == SMOOTH_INTERSECT:
                        x, y, sg = -va, -vb, -F1
                        mats[out, j] = mb if vb > va else ma
                    else:                              # SMOOTH_DIFFERENCE
                        x, y, sg = -va, vb, -F1
                        mats[out, j] = ma
                    h = max(k - abs(x - y), F0) / k
                    regs[out, j] = sg * (_fmin(x, y) - h * h * k * FQ)
            _row_back(regs, out, dst, n)
            _row_back(mats, out, dst, n)
        elif op <= PATTERN_LAST:                                      # ---- patterns
            if op == REPEAT_END:
                L = lsp - 1
                it = lint[L, 2]
                if lint[L, 3] == INSTANCES:
                    end = lint[L, 6]
                    active = 0
                    for j in range(n):
                        node = lcell[L, 0, j]
                        if node >= end:
                            continue
                        v = max(regs[a, j], lbound[L, j])
                        if v < lacc[L, j] or _ties_first(v, node, lacc[L, j], lcell[L, 4, j]):
                            lacc[L, j] = v
                            lmat[L, j] = mats[a, j]
                            lcell[L, 4, j] = node
                        if node == lcell[L, 2, j]:    # the hinted leaf ran: now the walk from the root
                            node = lint[L, 5] - 1
                        node, bb = _bvh_seek(node + 1, end, lp[L, 0, j], lp[L, 1, j], lp[L, 2, j],
                                             lp[L, 3, j], lacc[L, j], lcell[L, 4, j], lcopy[L, j], lint[L, 4], params,
                                             bvhf, bvhi, inst, lcell[L, 2, j])
                        lcell[L, 0, j] = node
                        lbound[L, j] = bb
                        if node < end:
                            active += 1
                            _instance_point(L, j, node, p, lp, lcell, bvhi, inst)
                        else:
                            for r in range(4):
                                p[r, j] = lp[L, r, j]
                            if lcell[L, 4, j] >= 0:   # the next walk of this point runs it first
                                hint[0, j] = lint[L, 0] + 1
                                hint[1, j] = lcell[L, 4, j] + 1
                    again = active > 0
                    if again and L == 0 and csp == 0 and 2 * active <= n and n >= _COMPACT_MIN:
                        n, nswap = _compact_instances(n, end, nswap, sp, swaps, regs, mats, p, pstack, lp, lacc,
                                                      lmat, lbound, lcopy, lcell, cdead, hint)
                    elif not again and L == 0:      # the whole block again, in its own order
                        _undo_swaps(nswap, sp, swaps, regs, mats, p, pstack, lp, lacc, lmat, lbound, lcopy,
                                    lcell, cdead, hint)
                        nswap = np.int64(0)
                        n = lint[L, 7]
                else:
                    for j in range(n):
                        v = max(regs[a, j], lcopy[L, j])
                        if it == 0 or v < lacc[L, j]:
                            lacc[L, j] = v
                            lmat[L, j] = mats[a, j]
                    it += 1
                    while it < lint[L, 1]:   # the next copy some point of the block needs
                        _loop_point(L, it, n, params, p, lp, lcell, lint)
                        _copy_bound(L, n, params, p, lint, lcopy)
                        needed = False
                        for j in range(n):
                            if cdead[j] == 0 and not lcopy[L, j] >= lacc[L, j]:
                                needed = True
                                break
                        if needed:
                            break
                        it += 1
                    lint[L, 2] = it
                    again = it < lint[L, 1]
                if again:
                    nxt = lint[L, 0] + 1
                else:
                    for j in range(n):
                        regs[dst, j] = _fmin(lacc[L, j], lbound[L, j]) if lint[L, 3] != INSTANCES else lacc[L, j]
                        mats[dst, j] = lmat[L, j]
                        for r in range(4):
                            p[r, j] = lp[L, r, j]
                    lsp -= 1
            else:
                L = lsp
                lsp += 1
                lint[L, 0], lint[L, 3], lint[L, 4] = pc, op, prm
                for j in range(n):
                    lacc[L, j] = INF
                    lmat[L, j] = 0
                if op == INSTANCES:
                    first, end = np.int64(aux), np.int64(aux) + np.int64(a)
                    lint[L, 5], lint[L, 6], lint[L, 7] = first, end, n
                    lint[L, 2] = 0
                    active = 0
                    for j in range(n):
                        for r in range(4):
                            lp[L, r, j] = p[r, j]
                        # lcell rows: 0 the leaf running, 1 its instance, 2 the hinted leaf (run
                        # first, skipped by the walk; -1 none), 4 the leaf holding the minimum
                        lcell[L, 2, j], lcell[L, 4, j] = -1, -1
                        if cdead[j] > 0:         # (its value is thrown away at a cull's target)
                            node, bb = end, INF
                        else:
                            x, y, z, sc = p[0, j], p[1, j], p[2, j], p[3, j]
                            lcopy[L, j] = _instances_reach(prm, x, y, z, sc, params, inst)
                            node, bb = end, INF
                            h = hint[1, j] - 1
                            if hint[0, j] == pc + 1 and first <= h < end and bvhi[h, 7] >= 0:
                                bb = max(_node_distance(h, x, y, z, sc, bvhf),
                                         _child_distance(bvhi[h, 7], x, y, z, sc, prm, params, inst))
                                if bb <= lcopy[L, j]:         # the hinted leaf first
                                    node = h
                                    lcell[L, 2, j] = h
                            if node == end:
                                node, bb = _bvh_seek(first, end, x, y, z, sc, INF, np.int64(-1), lcopy[L, j], prm, params,
                                                     bvhf, bvhi, inst, np.int64(-1))
                        lcell[L, 0, j] = node
                        lcell[L, 1, j] = 0
                        lbound[L, j] = bb
                        if node < end:
                            active += 1
                            _instance_point(L, j, node, p, lp, lcell, bvhi, inst)
                    if active == 0:      # no leaf anywhere: the loop's value is +inf
                        end_pc = np.int64(cols[pc, 7])
                        for j in range(n):
                            regs[cols[end_pc, 1], j] = INF
                            mats[cols[end_pc, 1], j] = 0
                        lsp -= 1
                        nxt = end_pc + 1
                else:
                    _loop_enter(op, prm, params, n, L, p, lp, lbound, lcell, lint)
                    _loop_point(L, np.int64(0), n, params, p, lp, lcell, lint)
                    _copy_bound(L, n, params, p, lint, lcopy)
        elif op == CULL_BOX:                                          # ---- cull
            x0, y0, z0 = params[prm], params[prm + 1], params[prm + 2]
            x1, y1, z1, m = params[prm + 3], params[prm + 4], params[prm + 5], params[prm + 6]
            cx, cy, cz = (x0 + x1) * FH, (y0 + y1) * FH, (z0 + z1) * FH
            hx, hy, hz = (x1 - x0) * FH, (y1 - y0) * FH, (z1 - z0) * FH
            culled, dead = 0, 0
            split = cmask[csp]                 # (the mask of the frame this split may open)
            for j in range(n):
                bb = _box(p[0, j] - cx, p[1, j] - cy, p[2, j] - cz, hx, hy, hz) * p[3, j]
                split[j] = False
                if cdead[j] > 0:
                    dead += 1
                elif bb >= regs[a, j] + m:
                    culled += 1
                    split[j] = True
                regs[dst, j] = bb
                mats[dst, j] = aux
            if culled + dead == n:
                nxt = np.int64(cols[pc, 7])
            elif culled > 0:
                k = csidx[pc]
                if k < 0 or csp >= _CULL_CAP:
                    _undo_swaps(nswap, sp, swaps, regs, mats, p, pstack, lp, lacc, lmat, lbound, lcopy, lcell,
                                cdead, hint)
                    return False
                cframe[csp, 0], cframe[csp, 1] = np.int64(cols[pc, 7]), k
                for s in range(csregs[k]):      # (every point's rows: plain copies, vectorised)
                    r = csregs[k + 1 + s]
                    for j in range(n):
                        csave_v[csp, s, j] = regs[r, j]
                        csave_m[csp, s, j] = mats[r, j]
                for j in range(n):
                    cdead[j] += np.int32(split[j])
                csp += 1
        else:                                                         # ---- FIELD_RESULT
            for j in range(n):
                regs[dst, j] = regs[a, j] * p[3, j]
                mats[dst, j] = aux
        pc = nxt
    for j in range(n):
        out_d[j] = regs[0, j]
        out_m[j] = mats[0, j]
    return True


# ----------------------------------------------------------------------------- drivers
@njit(inline="always", **_JIT)
def _field(tp, n, ws, ws1, sec):
    """The field at ws.pin[:, :n] (capped by the section half-space when sec[0] != 0), by the
    interpreter that tp carries (_kernel_tape)."""
    cols, params, bvhf, bvhi, inst, csidx, csregs, _, helpers, run_block = tp
    pin, out_d, out_m, hint = ws[WS_PIN], ws[WS_OUT_D], ws[WS_OUT_M], ws[WS_HINT]
    if not run_block(cols, params, bvhf, bvhi, inst, csidx, csregs, n, ws, helpers):
        pin1, hint1 = ws1[WS_PIN], ws1[WS_HINT]
        for j in range(n):
            pin1[0, 0], pin1[1, 0], pin1[2, 0] = pin[0, j], pin[1, j], pin[2, j]
            hint1[0, 0], hint1[1, 0] = hint[0, j], hint[1, j]
            run_block(cols, params, bvhf, bvhi, inst, csidx, csregs, np.int64(1), ws1, helpers)
            out_d[j], out_m[j] = ws1[WS_OUT_D][0], ws1[WS_OUT_M][0]
            hint[0, j], hint[1, j] = hint1[0, 0], hint1[1, 0]
    if sec[0] != F0:
        for j in range(n):
            pv = pin[0, j] * sec[1] + pin[1, j] * sec[2] + pin[2, j] * sec[3] - sec[4]
            if pv > out_d[j]:
                out_d[j] = pv


@njit(nogil=True, **_JIT)
def _eval_kernel(tp, n_regs, sec, pts, out_d, out_m, max_chunks, thread, n_threads):
    """Thread ``thread``'s share (every n_threads-th chunk of blocks) of the field at pts."""
    N = pts.shape[0]
    nblocks = (N + BLOCK - 1) // BLOCK
    nchunks = min(nblocks, max_chunks)
    for ch in range(thread, nchunks, n_threads):
        ws = _workspace(n_regs, np.int64(BLOCK), tp[7])
        ws1 = _workspace(n_regs, np.int64(1), np.int64(0))
        pin, hint = ws[WS_PIN], ws[WS_HINT]
        for blk in range(ch * nblocks // nchunks, (ch + 1) * nblocks // nchunks):
            s = blk * BLOCK
            n = min(BLOCK, N - s)
            for j in range(n):
                pin[0, j], pin[1, j], pin[2, j] = pts[s + j, 0], pts[s + j, 1], pts[s + j, 2]
                hint[0, j] = 0                   # (unrelated points: no hint)
            _field(tp, n, ws, ws1, sec)
            for j in range(n):
                out_d[s + j] = ws[WS_OUT_D][j]
                out_m[s + j] = ws[WS_OUT_M][j]


@njit(**_JIT)
def _hit_threshold(eps, cone, t):
    """A march's hit threshold at t: eps, or with a hit cone (RenderSettings.hit_cone, cone > 0)
    max(eps, cone t) (kernels_render.wgsl trace_step, packed.wgsl cell_find)."""
    return max(eps, cone * t) if cone > 0 else eps


@njit(inline="always", **_JIT)
def _trace(tp, sec, ws, ws1, n, ro, rd, t, tfar, eps, cone, max_steps, step_scale, soft_k,
           steps, hit, mat, res, idx, rhint):
    """Sphere-trace n rays from t to tfar: hit when f < eps, or with cone > 0 when f <
    max(eps, cone t) (RenderSettings.hit_cone). soft_k > 0 also tracks the penumbra
    res = min(1, k * f / t) (iq's soft shadow). rhint (2, n): each ray's INSTANCES walk hint
    (_workspace), carried from step to step, read at the start and left as the last step's."""
    pin, out_d, out_m, hint = ws[WS_PIN], ws[WS_OUT_D], ws[WS_OUT_M], ws[WS_HINT]
    na = np.int64(0)
    for i in range(n):
        steps[i] = 0
        hit[i] = False
        mat[i] = 0
        res[i] = F1
        if t[i] <= tfar[i]:
            idx[na] = i
            na += 1
    while na > 0:
        for q in range(na):
            i = idx[q]
            for r in range(3):
                pin[r, q] = ro[r, i] + t[i] * rd[r, i]
            hint[0, q], hint[1, q] = rhint[0, i], rhint[1, i]
        _field(tp, na, ws, ws1, sec)
        m = np.int64(0)
        for q in range(na):
            i = idx[q]
            rhint[0, i], rhint[1, i] = hint[0, q], hint[1, q]
            d = out_d[q]
            steps[i] += 1
            if d < _hit_threshold(eps, cone, t[i]):
                hit[i] = True
                mat[i] = out_m[q]
                res[i] = F0
                continue
            if soft_k > F0 and t[i] > F0:
                res[i] = min(res[i], soft_k * d / t[i])
            t[i] += d * step_scale
            if not t[i] <= tfar[i] or steps[i] >= max_steps:
                continue
            idx[m] = i
            m += 1
        na = m


@njit(**_JIT)
def _slab(o, d, box):
    """Entry and exit t of the ray o + t d through the box (t0 > t1: no intersection)."""
    t0, t1 = -INF, INF
    for r in range(3):
        if d[r] == F0:
            if o[r] < box[0, r] or o[r] > box[1, r]:
                return INF, -INF
            continue
        ta = (box[0, r] - o[r]) / d[r]
        tb = (box[1, r] - o[r]) / d[r]
        t0 = max(t0, min(ta, tb))
        t1 = min(t1, max(ta, tb))
    return max(t0, F0), t1


_TETRA = np.array([[1, -1, -1], [-1, -1, 1], [-1, 1, -1], [1, 1, 1]], np.float32)


@njit(inline="always", **_JIT)
def _gradients(tp, sec, ws, ws1, n, px, neps, grad):
    """grad[:, i] = sum_k k f(px_i + neps k) / (4 neps) over the tetrahedron taps k."""
    pin, out_d = ws[WS_PIN], ws[WS_OUT_D]
    for i in range(n):
        grad[0, i], grad[1, i], grad[2, i] = F0, F0, F0
    for tap in range(4):
        for i in range(n):
            for r in range(3):
                pin[r, i] = px[r, i] + neps * _TETRA[tap, r]
        _field(tp, n, ws, ws1, sec)
        for i in range(n):
            for r in range(3):
                grad[r, i] += _TETRA[tap, r] * out_d[i]
    for i in range(n):
        for r in range(3):
            grad[r, i] /= F4 * neps


_TW, _TH = 16, BLOCK // 16    # the march / light kernels' pixel tiles (BLOCK pixels each)


@njit(**_JIT)
def _tile_count(dirs):
    """Tiles of _TW x _TH pixels covering the (H, W, 3) ray directions."""
    return ((dirs.shape[1] + _TW - 1) // _TW) * ((dirs.shape[0] + _TH - 1) // _TH)


@njit(inline="always", **_JIT)
def _tile_setup(tile, dirs, n_regs, n_save):
    """Tile ``tile`` (row-major) of the march / light kernels: its pixel rows r0:r1 and columns
    c0:c1 and its scratch: (r0, r1, c0, c1, ws, ws1, ro, rd, v3, t, tfar, steps, hit, mat, res,
    idx, pix, rhint), ws / ws1 the workspaces of _field, the rest per ray (ro, rd, v3: (3,
    BLOCK); pix: (2, BLOCK) row, col; rhint: (2, BLOCK) the rays' walk hints, none yet)."""
    H, W = dirs.shape[0], dirs.shape[1]
    ntx = (W + _TW - 1) // _TW
    r0, c0 = (tile // ntx) * _TH, (tile % ntx) * _TW
    return (r0, min(r0 + _TH, H), c0, min(c0 + _TW, W),
            _workspace(n_regs, np.int64(BLOCK), n_save), _workspace(n_regs, np.int64(1), np.int64(0)),
            np.empty((3, BLOCK), np.float32), np.empty((3, BLOCK), np.float32),
            np.empty((3, BLOCK), np.float32), np.empty(BLOCK, np.float32), np.empty(BLOCK, np.float32),
            np.empty(BLOCK, np.int32), np.empty(BLOCK, np.bool_), np.empty(BLOCK, np.uint32),
            np.empty(BLOCK, np.float32), np.empty(BLOCK, np.int64), np.empty((2, BLOCK), np.int64),
            np.zeros((2, BLOCK), np.int64))


@njit(nogil=True, **_JIT)
def _march_kernel(tp, n_regs, sec, eye, dirs, box, eps, cone, neps, max_steps, step_scale, out_t, out_hit,
                  out_steps, out_mat, out_grad, out_normal, thread, n_threads):
    """Thread ``thread``'s tiles (every n_threads-th, row-major) of the march."""
    n_save = tp[7]
    for tile in range(thread, _tile_count(dirs), n_threads):
        r0, r1, c0, c1, ws, ws1, ro, rd, grad, t, tfar, steps, hit, mat, res, idx, pix, rhint = \
            _tile_setup(tile, dirs, n_regs, n_save)
        n = np.int64(0)
        for row in range(r0, r1):
            for col in range(c0, c1):
                d = dirs[row, col]
                t0, t1 = _slab(eye, d, box)
                for r in range(3):
                    ro[r, n] = eye[r]
                    rd[r, n] = d[r]
                t[n], tfar[n] = t0, t1
                pix[0, n], pix[1, n] = row, col
                n += 1
        _trace(tp, sec, ws, ws1, n, ro, rd, t, tfar, eps, cone, max_steps, step_scale, F0,
               steps, hit, mat, res, idx, rhint)
        m = np.int64(0)
        for i in range(n):
            row, col = pix[0, i], pix[1, i]
            out_hit[row, col] = hit[i]
            out_t[row, col] = t[i] if hit[i] else INF
            out_steps[row, col] = steps[i]
            out_mat[row, col] = mat[i]
            for r in range(3):
                out_grad[row, col, r] = F0
                out_normal[row, col, r] = F0
            if hit[i]:
                idx[m] = i
                for r in range(3):
                    ro[r, m] = eye[r] + t[i] * rd[r, i]
                m += 1
        hint = ws[WS_HINT]      # (the hit's material is the trace's: the instance lists' walks keep
        for q in range(m):      # the first of tied leaves, hinted or not, as the GPU's surface pass)
            hint[0, q], hint[1, q] = rhint[0, idx[q]], rhint[1, idx[q]]     # (the gradient taps keep it)
        _gradients(tp, sec, ws, ws1, m, ro, neps, grad)
        for q in range(m):
            i = idx[q]
            gl = np.sqrt(grad[0, q] * grad[0, q] + grad[1, q] * grad[1, q] + grad[2, q] * grad[2, q])
            for r in range(3):
                out_grad[pix[0, i], pix[1, i], r] = grad[r, q]
                if gl > F0:                      # (no gradient: normal 0)
                    out_normal[pix[0, i], pix[1, i], r] = grad[r, q] / gl


@njit(nogil=True, **_JIT)
def _light_kernel(tp, n_regs, sec, eye, dirs, box, eps, shadow_steps, step_scale, shadow_mode,
                  soft_k, key_dir, ao_strength, ao_dist, in_t, in_grad, out_shadow, out_ao, thread, n_threads):
    """Key-light visibility (occlusion march from p + 4 eps n) and 5-tap ambient occlusion, on
    thread ``thread``'s tiles (every n_threads-th, row-major)."""
    n_save = tp[7]
    for tile in range(thread, _tile_count(dirs), n_threads):
        r0, r1, c0, c1, ws, ws1, ro, rd, nrm, t, tfar, steps, hit, mat, res, idx, pix, rhint = \
            _tile_setup(tile, dirs, n_regs, n_save)
        occ = np.zeros(BLOCK, np.float32)
        n = np.int64(0)
        for row in range(r0, r1):
            for col in range(c0, c1):
                out_shadow[row, col] = F1
                out_ao[row, col] = F1
                th = in_t[row, col]
                if not th < INF:
                    continue
                g = in_grad[row, col]
                gl = _len3(g[0], g[1], g[2])
                if not gl > F0:
                    gl = F1
                for r in range(3):
                    nrm[r, n] = g[r] / gl
                    ro[r, n] = eye[r] + th * dirs[row, col, r] + F4 * eps * nrm[r, n]
                    rd[r, n] = key_dir[r]
                pix[0, n], pix[1, n] = row, col
                n += 1
        if n == 0:
            continue
        if shadow_mode > 0:
            o = np.empty(3, np.float32)
            for i in range(n):
                o[0], o[1], o[2] = ro[0, i], ro[1, i], ro[2, i]
                t[i] = F0
                tfar[i] = _slab(o, key_dir, box)[1]
            _trace(tp, sec, ws, ws1, n, ro, rd, t, tfar, eps, F0, shadow_steps, step_scale,
                   soft_k if shadow_mode == 2 else F0, steps, hit, mat, res, idx, rhint)
            for i in range(n):
                out_shadow[pix[0, i], pix[1, i]] = F0 if hit[i] else max(min(res[i], F1), F0)
        if ao_strength > F0:
            pin, out_d, hint = ws[WS_PIN], ws[WS_OUT_D], ws[WS_HINT]
            for i in range(n):
                hint[0, i] = 0               # (the taps along the normal keep their own)
            wsum = F0
            w = F1
            for tap in range(5):
                h = ao_dist * _f(tap + 1) / _f(5)
                wsum += w
                for i in range(n):
                    for r in range(3):
                        pin[r, i] = ro[r, i] - F4 * eps * nrm[r, i] + h * nrm[r, i]
                _field(tp, n, ws, ws1, sec)
                for i in range(n):
                    occ[i] += w * max(h - out_d[i], F0) / h
                w *= FH
            for i in range(n):
                out_ao[pix[0, i], pix[1, i]] = max(F1 - ao_strength * occ[i] / wsum, F0)


# ----------------------------------------------------------------------------- the walker
_WRITES = np.array([op in OPS and OPS[Op(op)].writes for op in range(256)], np.bool_)
_READS = np.array([[op in OPS and f in OPS[Op(op)].reads for f in "abc"] for op in range(256)], np.bool_)


def _thread_count() -> int:
    """Threads the twin's kernels run on: Numba's (NUMBA_NUM_THREADS, default every core)."""
    return load_numba().get_num_threads()


_POOL: dict = {}      # (pid, threads) -> ThreadPoolExecutor


def _on_threads(kernel, *args):
    """kernel(*args, thread, n_threads) on each of _thread_count() threads, returning when all
    are done. The kernels are nogil loops over their share of the work, called from a pool of
    Python threads rather than written as Numba parallel loops: each parallel loop adds three
    wrappers that link, re-optimise and re-generate the whole interpreter again, a quarter of a
    cold compile (docs/PERFORMANCE.md)."""
    n = _thread_count()
    if n == 1:
        kernel(*args, 0, 1)
        return
    key = (os.getpid(), n)            # (a forked child makes its own pool)
    if key not in _POOL:
        _POOL[key] = ThreadPoolExecutor(n, thread_name_prefix="taperay-twin")
    for done in [_POOL[key].submit(kernel, *args, k, n) for k in range(n)]:
        done.result()


def _walk_nodes(tape: Tape) -> tuple[np.ndarray, np.ndarray]:
    """The tape's BVH as _bvh_seek walks it: f32 / i32 views of one (N, 8) array, each node's box
    centre (lo + hi) / 2 at columns 0-2 and half size (hi - lo) / 2 at 4-6, its skip and instance
    words at 3 and 7 as in the tape. The centres and half sizes are the float32 operations the
    walk used to do at every node it visited (the GPU's, bit for bit). Kept on the tape while it
    holds the same frozen BVH array (a copy of it: 64 MB for 2,000,000 nodes), as content_key is."""
    def make():
        nodes = np.ascontiguousarray(tape.bvh).view(np.float32).reshape(-1, 8)
        walk = nodes.copy()
        lo, hi = nodes[:, 0:3], nodes[:, 4:7]
        with np.errstate(over="ignore", invalid="ignore"):    # (inf / NaN where the walk made them)
            walk[:, 0:3] = (lo + hi) * FH
            walk[:, 4:7] = (hi - lo) * FH
        walk.flags.writeable = False
        return walk, walk.view(np.int32)
    return _kept(tape, "_walk_nodes", tape.bvh, make)


def _split_culls(tape: Tape, cols: np.ndarray) -> tuple:
    """_cull_saves' (index, saves, width) of the tape's records, kept on the tape while it holds
    the same frozen records (the liveness behind them is a pass over every record and register:
    once per tape, not once per call), as _walk_nodes keeps the BVH's."""
    return _kept(tape, "_split_culls", tape.instrs, lambda: _cull_saves(cols, tape.n_regs, _READS, _WRITES))


def _kept(tape: Tape, name: str, source: np.ndarray, make):
    """``make()``, kept on the tape under ``name`` while the tape holds the same frozen ``source``
    array (a writable one may change in place: made again at every call)."""
    memo = tape.__dict__.get(name)
    if memo is not None and memo[0] is source and not source.flags.writeable:
        return memo[1]
    value = make()
    tape.__dict__[name] = (source, value)
    return value


def _kernel_tape(tape: Tape):
    """The tape as the kernels' arguments: (instr columns, params, the BVH as _walk_nodes gives
    it, instances, _cull_saves' index, saves and width, and _run_block as a function value). The
    kernels call the interpreter through that value (jit_cache.function_value): called by name, it
    would be linked into each kernel and optimised and generated again for each (a third of a
    cold compile); this way it is compiled once, on a cold cache by a helper process while this
    one compiles the kernels. The value is made before _cull_saves runs, so that the helper
    starts first."""
    inst = np.ascontiguousarray(tape.instances)
    cols = np.ascontiguousarray(tape.as_columns())
    head = (cols, np.ascontiguousarray(tape.params, np.float32), *_walk_nodes(tape),
            inst.view(np.float32).reshape(-1, 8))
    no_saves = np.empty(0, np.int64)           # (_cull_saves' index and saves: int64 arrays)
    ws = _workspace.py_func(1, 1, 1)
    helpers = _block_helpers(head[1], ws)
    run_block = function_value(_run_block, "boolean", *head, no_saves, no_saves, np.int64(0), ws, helpers)
    return (*head, *_split_culls(tape, cols), helpers, run_block)


def _block_helpers(params, ws) -> tuple:
    """Per-block helpers _run_block calls (a loop's entry and its copies' bound), as function values
    for the argument types it passes (params and the workspace ws's arrays). Linked into the
    interpreter they would be compiled, optimised and generated again in the helper process's
    compile, the critical path of a cold render; this way this process compiles them, in the time
    it would otherwise wait for the helper (the kernels' first run, before that wait). Only these
    two: the process compiles the march and light kernels meanwhile, and more would make it the
    critical path instead (docs/PERFORMANCE.md, "Cold compile"). A call per loop and block."""
    p, lp, lbound, lcopy, lcell, lint = ws[5], ws[7], ws[10], ws[11], ws[12], ws[13]
    i, op = np.int64(0), np.uint32(0)
    return (function_value(_loop_enter, "none", op, i, params, i, i, p, lp, lbound, lcell, lint, helper=False),
            function_value(_copy_bound, "none", i, i, params, p, lint, lcopy, helper=False))


_NO_SECTION = np.zeros(5, np.float32)


def evaluate_field(tape: Tape, points: np.ndarray, sec=_NO_SECTION) -> tuple[np.ndarray, np.ndarray]:
    """(N,) float32 values and (N,) uint32 material ids of the validated tape at (N, 3) points
    (``sec``: a section plane's packed words, values max(f, plane) where its flag is set)."""
    VALIDATED.check(tape)
    tp = _kernel_tape(tape)
    pts = np.ascontiguousarray(np.asarray(points, np.float32).reshape(-1, 3))
    d = np.empty(len(pts), np.float32)
    m = np.empty(len(pts), np.uint32)
    if len(pts):
        _on_threads(_eval_kernel, tp, tape.n_regs, sec, pts, d, m, 16 * _thread_count())
    return d, m


def march(tape: Tape, camera: Camera, width: int, height: int, settings: RenderSettings, view: str) -> dict:
    """Primary rays by the camera's pixel convention (CpuWalker.march)."""
    packed = settings.pack(tape, view)
    VALIDATED.check(tape)
    tp = _kernel_tape(tape)
    eye, dirs = camera.rays(width, height)
    box = _packed(packed, "box_lo", "box_hi").reshape(2, 3)
    out = dict(t=np.empty((height, width), np.float32), hit=np.empty((height, width), bool),
               steps=np.empty((height, width), np.int32), mat=np.empty((height, width), np.uint32),
               grad=np.empty((height, width, 3), np.float32), normal=np.empty((height, width, 3), np.float32))
    if tp[-1].compiling_elsewhere():    # (an empty cache: the light pass's kernel too, while the
        _compile(_light_kernel, *_light_args(tp, tape.n_regs, packed, eye, dirs, out["t"], out["grad"],
                                             out["t"], out["t"]))    # helper compiles the interpreter)
    _on_threads(_march_kernel, tp, tape.n_regs, _section(packed), eye, dirs, box, _packed(packed, "hit_eps"),
                _packed(packed, "hit_cone"), _packed(packed, "normal_eps"), int(_packed(packed, "max_steps")),
                _packed(packed, "step_scale"), out["t"], out["hit"], out["steps"], out["mat"], out["grad"],
                out["normal"])
    out["dirs"], out["eye"] = dirs, eye
    return out


def light_pass(tape: Tape, packed: np.ndarray, mr: dict) -> dict:
    """The key light's visibility and ambient occlusion at a march's hits, on the tape's own
    records: shadow and ao (H, W) float32 (1 on misses)."""
    VALIDATED.check(tape)
    tp = _kernel_tape(tape)
    h, w = mr["t"].shape
    shadow = np.empty((h, w), np.float32)
    ao = np.empty((h, w), np.float32)
    _on_threads(_light_kernel, *_light_args(tp, tape.n_regs, packed, mr["eye"], mr["dirs"], mr["t"], mr["grad"],
                                            shadow, ao))
    return dict(shadow=shadow, ao=ao)


def _light_args(tp, n_regs, packed, eye, dirs, t, grad, shadow, ao) -> tuple:
    """_light_kernel's arguments but the thread's."""
    return (tp, n_regs, _section(packed), eye, dirs, _packed(packed, "box_lo", "box_hi").reshape(2, 3),
            _packed(packed, "hit_eps"), int(_packed(packed, "shadow_steps")), _packed(packed, "step_scale"),
            int(_packed(packed, "shadow_mode")), _packed(packed, "soft_k"), _packed(packed, "key_dir"),
            _packed(packed, "ao_strength"), _packed(packed, "ao_dist"), t, grad, shadow, ao)


def _compile(kernel, *args) -> None:
    """Compile (or load from the disk cache) ``kernel`` for these arguments and _on_threads' two
    thread numbers, without running it."""
    numba = load_numba()
    kernel.compile(tuple(numba.typeof(a) for a in args) + (numba.types.int64, numba.types.int64))


def field_image(tape: Tape, width: int, height: int, rect=(-1.0, 1.0, -1.0, 1.0), z: float = 0.0) -> np.ndarray:
    """(H, W) float32 field on the plane z = const; rect = (x0, x1, y0, y1); pixel centres;
    row 0 is y = y1 (the top, y up), column 0 is x = x0."""
    x0, x1, y0, y1 = (float(v) for v in rect)
    if width < 1 or height < 1:
        raise TaperayError(f"field_image: size {width}x{height} must be at least 1x1")
    xs = x0 + (np.arange(width) + 0.5) / width * (x1 - x0)
    ys = y1 - (np.arange(height) + 0.5) / height * (y1 - y0)
    X, Y = np.meshgrid(xs, ys)
    pts = np.stack([X, Y, np.full_like(X, z)], -1).reshape(-1, 3)
    return evaluate_field(tape, pts)[0].reshape(height, width)


def _packed(packed: np.ndarray, *names: str):
    v = unpack(packed, *names)
    return v[0] if len(v) == 1 else v


def _section(packed: np.ndarray) -> np.ndarray:
    return np.concatenate([[_packed(packed, "section")], _packed(packed, "plane_n", "plane_d")]).astype(np.float32)
