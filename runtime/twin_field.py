"""The CPU twin's field over a block of points: the workspace and the call of the interpreter.

Owns the per-chunk scratch of the interpreter (``workspace``; ``WS_*`` name the entries the
drivers use), the points per block (``BLOCK``) and ``field_block``: the field at a block's points
by the interpreter that the kernel tape carries as a function value (runtime.twin.kernel_tape),
point by point where a cull split the block beyond what its points can ride through, capped by a
section plane. The evaluation, march, light and path kernels all reach the interpreter this way.
"""
from __future__ import annotations

import numpy as np

from .jit_cache import njit
from .op_numbers import LOOP_CAP, STACK_CAP
from .twin_culls import CULL_CAP
from .twin_ops import F0, JIT_OPTIONS as _JIT

__all__ = ["BLOCK", "WS_PIN", "WS_OUT_D", "WS_OUT_M", "WS_HINT", "workspace", "field_block"]

BLOCK = 256   # points per block (and 16 x 16 pixel tiles); 256 measured faster than 64 and 128
WS_PIN, WS_OUT_D, WS_OUT_M, WS_HINT = 0, 1, 2, 19     # the workspace entries the drivers use by name
# The drivers between a kernel and the interpreter (field_block here, runtime.twin_march's
# trace_rays, gradients, tile_setup) are inlined into their callers in Numba's IR
# (inline="always"): a jitted function of its own is compiled with everything it calls linked in,
# re-optimised and turned into machine code, so each such level compiled the interpreter once more
# (a quarter of a cold compile: PERFORMANCE.md, cold compile).


@njit(**_JIT)
def workspace(n_regs, B, n_save):
    """Per-chunk scratch: (pin, out_d, out_m, regs, mats, p, pstack, lp, lacc, lmat, lbound, lcopy,
    lcell, lint, cmask, cdead, csave_v, csave_m, cframe, hint, swaps); cmask .. cframe hold split culls
    (n_save: the most registers a cull's subtree writes, cull_saves); hint (2, B) each point's
    INSTANCES walk hint (record + 1, BVH leaf + 1; 0: none), which _run_block reads and updates:
    the callers that evaluate the steps of one ray at one position keep it, the others clear it;
    swaps (2, B) the column swaps of a compacted instance list (compact_instances). regs and mats
    have a row past the tape's registers: _run_block's scratch row (scratch_row)."""
    k = CULL_CAP if n_save > 0 else 0
    return (np.zeros((3, B), np.float32), np.zeros(B, np.float32), np.zeros(B, np.uint32),
            np.zeros((n_regs + 1, B), np.float32), np.zeros((n_regs + 1, B), np.uint32),
            np.zeros((4, B), np.float32), np.zeros((STACK_CAP, 4, B), np.float32),
            np.zeros((LOOP_CAP, 4, B), np.float32), np.zeros((LOOP_CAP, B), np.float32),
            np.zeros((LOOP_CAP, B), np.uint32), np.zeros((LOOP_CAP, B), np.float32),
            np.zeros((LOOP_CAP, B), np.float32),
            np.zeros((LOOP_CAP, 6, B), np.int64), np.zeros((LOOP_CAP, 8), np.int64),
            np.zeros((CULL_CAP + 1, B), np.bool_), np.zeros(B, np.int32),
            np.empty((k, n_save, B), np.float32), np.empty((k, n_save, B), np.uint32),
            np.zeros((CULL_CAP, 2), np.int64), np.zeros((2, B), np.int64), np.zeros((2, B), np.int64))


@njit(inline="always", **_JIT)
def field_block(tp, n, ws, ws1, sec):
    """The field at ws.pin[:, :n] (capped by the section half-space when sec[0] != 0), by the
    interpreter that tp carries (kernel_tape)."""
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
