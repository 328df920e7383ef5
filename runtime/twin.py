"""The CPU twin's interpreter: the Numba float32 block interpreter that runs a tape, the reference.

Owns the interpreter (``_run_block``), the evaluation kernel, the tape as the kernels' arguments
(``kernel_tape``) and the plain functions over them (``evaluate_field``, ``march``,
``light_pass``, ``field_image``) that ``runtime.cpu.CpuWalker`` and the pruned drivers call. Every
op of ``runtime.opcodes`` is implemented by the interpreter and the twin modules it calls exactly
as its ``OpSpec`` says; where the table leaves a detail open, the choice written below is the
reference and the other walkers must match it. The twin's modules, one job each:

  * runtime.twin_ops: the scalar rules and arithmetic loops (generated from the table);
  * runtime.twin_shapes: the shape distances, the point rotation, and the shape, point and
    combine records over a block;
  * runtime.twin_patterns: REPEAT_* frames, copies and bounds, and a pattern's REPEAT_END;
  * runtime.twin_instances: INSTANCES' BVH walk, its opening and REPEAT_END, and the compaction
    of a block;
  * runtime.twin_culls: the registers a split CULL_BOX gives back (liveness), the cull record;
  * runtime.twin_field: the workspace and the field over a block (the interpreter's callers);
  * runtime.twin_march: sphere tracing, normals, shadows and AO (shared with the path tracer);
  * runtime.twin_threads: the pool of threads the kernels run on.

Execution model: a *block interpreter*. Points are cut into blocks of ``BLOCK`` (chunks of
blocks shared out round-robin to a pool of threads, one workspace per chunk: on_threads); for
each instruction one tight loop runs over the block, so dispatch is paid per block and the loops
vectorise. Registers are ``(n_regs, BLOCK)`` float32 (+ u32 material ids); ``p`` and ``scale``
are per point (rows x, y, z, scale). The march and light kernels' blocks are 16 x 16 pixel
tiles, shared out round-robin in row order, so that each thread's share spreads over the
picture. The value loops of the arithmetic ops that read registers are ``arith_block``, shared
with runtime.pruned_eval's point interpreter (the interpreter keeps their material ids). Control
flow:

  * REPEAT_LINEAR / POLAR / GRID run the same number of body iterations at every point (only the
    instance each point evaluates differs), so they run blockwise;
  * INSTANCES walks the BVH per point, from the bound of its grid cell's representative
    (instances_reach); the body runs blockwise while any point still has a leaf to evaluate.
    When half of the block's points have finished, an outermost list (no pattern frame or split
    cull around it) moves the others to the front of the block (compact_instances: each point's
    rows swapped, the swaps logged) and runs the body for those only; when it closes, and before
    a point-by-point fallback, the swaps are undone in reverse, so the block is in its own order
    again. Elsewhere finished points ride along, their results ignored. A point whose workspace
    hint names a leaf of this record (the leaf that held the least value at the last walk of the
    same ray: the march's steps, gradient taps, a shadow ray, AO taps) runs that leaf first, as
    the GPU's walk_hint does: the running minimum then starts near the answer and the walk skips
    more.
    Neither the value nor the material depends on it: a hinted walk also visits the nodes and
    leaves that tie with the hinted leaf's value and precede it in tree order (ties_first), so
    every walk keeps the first of tied leaves, as one without a hint does;
  * CULL_BOX jumps when every point of the block culls, falls through when none does. Where the
    block splits, the points that cull ride through the subtree with the others and get back, at
    the jump target, the registers they held at the cull (cull_saves lists those each subtree
    writes that are live at the target, live_in); a point that culls is "dead" meanwhile:
    deeper culls and pattern copies count only the live points. A subtree that leaves ``p``
    changed at the cull's stack depth, holds a cull jumping past its own target, or splits more
    than ``CULL_CAP`` deep re-runs the block point by point (blocks of one never split).
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

import numpy as np

from .jit_cache import array_type_facts, function_value, load_numba, njit, quiet_function_types
from .camera import Camera
from .opcodes import check_numba_constants
from .shading import RenderSettings, compile_shading, unpack
from .tape import Tape, TaperayError, VALIDATED
from .twin_culls import cull_record, cull_returns, split_culls
from .twin_field import BLOCK, WS_HINT, WS_OUT_D, WS_OUT_M, WS_PIN, field_block, workspace
from .twin_instances import compact_instances, instances_open, instances_step, undo_swaps, walk_nodes
from .twin_march import light_kernel, march_kernel
from .twin_ops import F0, F1, INF, JIT_OPTIONS as _JIT, arith_block, fmin, row_back, scratch_row
from .twin_patterns import copy_bound, instance_indices, loop_enter, loop_point, pattern_step
from .twin_shapes import combine_record, point_record, shape_record
from .twin_threads import on_threads, thread_count

__all__ = ["BLOCK", "evaluate_field", "march", "light_pass", "field_image", "kernel_tape", "settings_value",
           "section_words"]

# The opcode numbers, class ranges and capacities (runtime/op_numbers.py, generated from
# runtime.opcodes). Numba freezes globals into its on-disk cache, which notices edits to THIS file
# only: the generated block names the numbers' hash, so a renumbering edits this file and its
# cached kernels recompile. tests/test_wgsl_header.py fails when either drifts from the table.
from .op_numbers import *  # noqa: E402,F403
# ---- BEGIN GENERATED by taperay.runtime.wgsl_header from runtime/opcodes.py: do not edit ----
# op numbers 646c8c7b0e37f6ff: runtime/op_numbers.py, imported above
# ---- END GENERATED ----
check_numba_constants(globals(), __name__)


# ----------------------------------------------------------------------------- the interpreter
@njit(**_JIT)
def _run_block(cols, params, bvhf, bvhi, inst, csidx, csregs, n, ws, helpers):
    """Evaluate the tape at ws.pin[:, :n] into ws.out_d / ws.out_m. False if a cull split the
    block where its points cannot ride through the subtree (see the module docstring). helpers:
    the per-block helpers it calls, as function values (_block_helpers)."""
    loop_enter_fn, copy_bound_fn, compact_fn, undo_fn = helpers
    pin, out_d, out_m, regs, mats, p, pstack, lp, lacc, lmat, lbound, lcopy, lcell, lint, \
        cmask, cdead, csave_v, csave_m, cframe, hint, swaps = ws
    for j in range(n):
        p[0, j], p[1, j], p[2, j], p[3, j] = pin[0, j], pin[1, j], pin[2, j], F1
        cdead[j] = 0
    sp = np.int64(0)
    nswap = np.int64(0)    # the swaps of a compacted outermost instance list (compact_instances)
    lsp = np.int64(0)      # (counters passed to jitted calls start as int64: see runtime.twin_ops, JIT_OPTIONS)
    csp = 0
    pc = 0
    n_ins = cols.shape[0]
    while pc < n_ins:
        csp = cull_returns(pc, csp, n, csregs, cframe, cmask, csave_v, csave_m, regs, mats, cdead)
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
                    instance_indices(lsp - 1, n, params, lcell, lint, regs[dst])
                else:
                    for j in range(n):
                        regs[dst, j] = F0
                for j in range(n):
                    mats[dst, j] = 0
            else:
                out = scratch_row(regs, dst, a, b, c)
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
                arith_block(op, regs, out, a, b, c, n)
                row_back(regs, out, dst, n)
                row_back(mats, out, dst, n)
        elif op <= SHAPE_LAST:
            shape_record(op, dst, a, prm, aux, n, params, p, regs, mats)
        elif op <= POINT_LAST:
            sp = point_record(op, prm, n, params, p, pstack, sp)
        elif op <= COMBINE_LAST:
            combine_record(op, dst, a, b, c, prm, n, params, regs, mats)
        elif op == REPEAT_END:                                        # ---- patterns
            L = lsp - 1
            if lint[L, 3] == INSTANCES:
                again, n, nswap = instances_step(L, a, n, csp, sp, nswap, params, p, pstack, lp, lacc, lmat, lbound,
                                                 lcopy, lcell, lint, regs, mats, cdead, hint, swaps, bvhf, bvhi, inst,
                                                 compact_fn, undo_fn)
            else:
                again = pattern_step(L, a, n, params, p, lp, lacc, lmat, lcopy, lcell, lint, cdead, regs, mats,
                                     copy_bound_fn)
            if again:
                nxt = lint[L, 0] + 1
            else:
                for j in range(n):
                    regs[dst, j] = fmin(lacc[L, j], lbound[L, j]) if lint[L, 3] != INSTANCES else lacc[L, j]
                    mats[dst, j] = lmat[L, j]
                    for r in range(4):
                        p[r, j] = lp[L, r, j]
                lsp -= 1
        elif op <= PATTERN_LAST:
            L = lsp
            lsp += 1
            lint[L, 0], lint[L, 3], lint[L, 4] = pc, op, prm
            for j in range(n):
                lacc[L, j] = INF
                lmat[L, j] = 0
            if op == INSTANCES:
                if instances_open(pc, L, prm, aux, a, n, params, p, lp, lbound, lcopy, lcell, lint, cdead, hint, bvhf,
                                  bvhi, inst) == 0:      # no leaf anywhere: the loop's value is +inf
                    end_pc = np.int64(cols[pc, 7])
                    for j in range(n):
                        regs[cols[end_pc, 1], j] = INF
                        mats[cols[end_pc, 1], j] = 0
                    lsp -= 1
                    nxt = end_pc + 1
            else:
                loop_enter_fn(op, prm, params, n, L, p, lp, lbound, lcell, lint)
                loop_point(L, np.int64(0), n, params, p, lp, lcell, lint)
                copy_bound_fn(L, n, params, p, lint, lcopy)
        elif op == CULL_BOX:
            nxt, csp, whole = cull_record(pc, dst, a, prm, aux, n, cols, params, csidx, csregs, csp, p, regs, mats,
                                          cmask, cdead, csave_v, csave_m, cframe)
            if not whole:
                undo_fn(nswap, sp, swaps, regs, mats, p, pstack, lp, lacc, lmat, lbound, lcopy, lcell, cdead, hint)
                return False
        else:                                                         # ---- FIELD_RESULT
            for j in range(n):
                regs[dst, j] = regs[a, j] * p[3, j]
                mats[dst, j] = aux
        pc = nxt
    for j in range(n):
        out_d[j] = regs[0, j]
        out_m[j] = mats[0, j]
    return True


# ----------------------------------------------------------------------------- the kernels' tape
@njit(nogil=True, **_JIT)
def _eval_kernel(tp, n_regs, sec, pts, out_d, out_m, max_chunks, thread, n_threads):
    """Thread ``thread``'s share (every n_threads-th chunk of blocks) of the field at pts."""
    N = pts.shape[0]
    nblocks = (N + BLOCK - 1) // BLOCK
    nchunks = min(nblocks, max_chunks)
    for ch in range(thread, nchunks, n_threads):
        ws = workspace(n_regs, np.int64(BLOCK), tp[7])
        ws1 = workspace(n_regs, np.int64(1), np.int64(0))
        pin, hint = ws[WS_PIN], ws[WS_HINT]
        for blk in range(ch * nblocks // nchunks, (ch + 1) * nblocks // nchunks):
            s = blk * BLOCK
            n = min(BLOCK, N - s)
            for j in range(n):
                pin[0, j], pin[1, j], pin[2, j] = pts[s + j, 0], pts[s + j, 1], pts[s + j, 2]
                hint[0, j] = 0                   # (unrelated points: no hint)
            field_block(tp, n, ws, ws1, sec)
            for j in range(n):
                out_d[s + j] = ws[WS_OUT_D][j]
                out_m[s + j] = ws[WS_OUT_M][j]


def kernel_tape(tape: Tape):
    """The tape as the kernels' arguments: (instr columns, params, the BVH as walk_nodes gives
    it, instances, cull_saves' index, saves and width, and _run_block as a function value). The
    kernels call the interpreter through that value (jit_cache.function_value): called by name, it
    would be linked into each kernel and optimised and generated again for each (a third of a
    cold compile); this way it is compiled once, on a cold cache by a helper process while this
    one compiles the kernels. The value is made before cull_saves runs, so that the helper
    starts first."""
    inst = np.ascontiguousarray(tape.instances)
    cols = np.ascontiguousarray(tape.as_columns())
    head = (cols, np.ascontiguousarray(tape.params, np.float32), *walk_nodes(tape),
            inst.view(np.float32).reshape(-1, 8))
    helpers, run_block = _interpreter_values(head)
    quiet_function_types()                         # (the kernels' calls type the values' tuple)
    return (*head, *split_culls(tape, cols), helpers, run_block)


_INTERPRETER_VALUES: dict = {}     # the head arrays' type facts -> (_block_helpers' values, _run_block's)


def _interpreter_values(head: tuple) -> tuple:
    """_block_helpers' function values and _run_block's for kernel_tape's ``head`` arrays, made once
    per process and the arrays' Numba types (jit_cache.array_type_facts): typing the examples at
    every call would cost about 1 ms a call on a 2-core EPYC."""
    key = tuple(array_type_facts(a) for a in head)
    values = _INTERPRETER_VALUES.get(key)
    if values is None:
        no_saves = np.empty(0, np.int64)           # (cull_saves' index and saves: int64 arrays)
        ws = workspace.py_func(1, 1, 1)
        helpers = _block_helpers(head[1], ws)
        run_block = function_value(_run_block, "boolean", *head, no_saves, no_saves, np.int64(0), ws, helpers)
        values = _INTERPRETER_VALUES[key] = (helpers, run_block)
    return values


def _block_helpers(params, ws) -> tuple:
    """Helpers _run_block calls, as function values for the argument types it passes (params and
    the workspace ws's arrays): a loop's entry and its copies' bound, an outermost instance list's
    compaction and its undoing. Linked into the interpreter they would be compiled, optimised and
    generated again in the helper process's compile, the critical path of a cold render; this way
    this process compiles them, in the time it would otherwise wait for the helper (the kernels'
    first run, before that wait). Only these: the process compiles the march, light and shading
    kernels meanwhile, and more would make it the critical path instead (docs/PERFORMANCE.md,
    "Cold compile"). Each is called once per loop or list step and block, not per point."""
    p, pstack, lp, lacc, lmat, lbound, lcopy, lcell, lint = ws[5], ws[6], ws[7], ws[8], ws[9], ws[10], ws[11], \
        ws[12], ws[13]
    regs, mats, cdead, hint, swaps = ws[3], ws[4], ws[15], ws[19], ws[20]
    i, op = np.int64(0), np.uint32(0)
    moved = (i, swaps, regs, mats, p, pstack, lp, lacc, lmat, lbound, lcopy, lcell, cdead, hint)   # (from sp)
    return (function_value(loop_enter, "none", op, i, params, i, i, p, lp, lbound, lcell, lint, helper=False),
            function_value(copy_bound, "none", i, i, params, p, lint, lcopy, helper=False),
            function_value(compact_instances, "UniTuple(int64, 2)", i, i, i, *moved, helper=False),
            function_value(undo_swaps, "none", i, *moved, helper=False))


_NO_SECTION = np.zeros(5, np.float32)


def evaluate_field(tape: Tape, points: np.ndarray, sec=_NO_SECTION) -> tuple[np.ndarray, np.ndarray]:
    """(N,) float32 values and (N,) uint32 material ids of the validated tape at (N, 3) points
    (``sec``: a section plane's packed words, values max(f, plane) where its flag is set)."""
    VALIDATED.check(tape)
    tp = kernel_tape(tape)
    pts = np.ascontiguousarray(np.asarray(points, np.float32).reshape(-1, 3))
    d = np.empty(len(pts), np.float32)
    m = np.empty(len(pts), np.uint32)
    if len(pts):
        on_threads(_eval_kernel, tp, tape.n_regs, sec, pts, d, m, 16 * thread_count())
    return d, m


def march(tape: Tape, camera: Camera, width: int, height: int, settings: RenderSettings, view: str) -> dict:
    """Primary rays by the camera's pixel convention (CpuWalker.march)."""
    packed = settings.pack(tape, view)
    VALIDATED.check(tape)
    tp = kernel_tape(tape)
    eye, dirs = camera.rays(width, height)
    out = dict(t=np.empty((height, width), np.float32), hit=np.empty((height, width), bool),
               steps=np.empty((height, width), np.int32), mat=np.empty((height, width), np.uint32),
               grad=np.empty((height, width, 3), np.float32), normal=np.empty((height, width, 3), np.float32))
    if tp[-1].compiling_elsewhere():    # (an empty cache: the light pass's and the shading's kernels
        _compile(light_kernel, *_light_args(tp, tape.n_regs, packed, eye, dirs, out["t"], out["grad"],
                                            out["t"], out["t"]))    # too, while the helper compiles
        compile_shading(view)                                       # the interpreter)
    rule = (settings_value(packed, "hit_eps"), settings_value(packed, "hit_cone"),
            int(settings_value(packed, "max_steps")), settings_value(packed, "step_scale"), F0)
    on_threads(march_kernel, tp, tape.n_regs, section_words(packed), _view(packed, eye, dirs), rule,
               settings_value(packed, "normal_eps"),
               tuple(out[k] for k in ("t", "hit", "steps", "mat", "grad", "normal")))
    out["dirs"], out["eye"] = dirs, eye
    return out


def light_pass(tape: Tape, packed: np.ndarray, mr: dict) -> dict:
    """The key light's visibility and ambient occlusion at a march's hits, on the tape's own
    records: shadow and ao (H, W) float32 (1 on misses)."""
    VALIDATED.check(tape)
    tp = kernel_tape(tape)
    h, w = mr["t"].shape
    shadow = np.empty((h, w), np.float32)
    ao = np.empty((h, w), np.float32)
    on_threads(light_kernel, *_light_args(tp, tape.n_regs, packed, mr["eye"], mr["dirs"], mr["t"], mr["grad"],
                                          shadow, ao))
    return dict(shadow=shadow, ao=ao)


def _view(packed, eye, dirs) -> tuple:
    """The march and light kernels' view: (eye, ray directions, the march box (2, 3))."""
    return eye, dirs, settings_value(packed, "box_lo", "box_hi").reshape(2, 3)


def _light_args(tp, n_regs, packed, eye, dirs, t, grad, shadow, ao) -> tuple:
    """light_kernel's arguments but the thread's."""
    mode = int(settings_value(packed, "shadow_mode"))
    rule = (settings_value(packed, "hit_eps"), F0, int(settings_value(packed, "shadow_steps")),
            settings_value(packed, "step_scale"), settings_value(packed, "soft_k") if mode == 2 else F0)
    light = (mode, settings_value(packed, "key_dir"), settings_value(packed, "ao_strength"),
             settings_value(packed, "ao_dist"))
    return tp, n_regs, section_words(packed), _view(packed, eye, dirs), rule, light, (t, grad), (shadow, ao)


def _compile(kernel, *args) -> None:
    """Compile (or load from the disk cache) ``kernel`` for these arguments and on_threads' two
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


def settings_value(packed: np.ndarray, *names: str):
    v = unpack(packed, *names)
    return v[0] if len(v) == 1 else v


def section_words(packed: np.ndarray) -> np.ndarray:
    return np.concatenate([[settings_value(packed, "section")],
                           settings_value(packed, "plane_n", "plane_d")]).astype(np.float32)
