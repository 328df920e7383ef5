"""March cells: an arithmetic tape pruned once for every cell of a 3D grid over a box (Numba).

Owns ``CellTapes`` (the tapes of a grid^3 grid's cells and, with two levels, of each cell's
4 x 4 x 4 sub-cells; points evaluated each on its finest cell's tape; the cells' interval lower
bounds for empty-space skipping, ``CellTapes.skip_to``), the grids' cell coordinates and boxes
(``grid_ijk``, ``sub_cell_ijk``, ``grid_cell_boxes``: the GPU's march and image cells use them
too) and ``cell_tape``, the tape march cells prune for a scene tape: itself when arithmetic
(scene fields allowed), else its lowering (``runtime.lowering``).
"""
from __future__ import annotations

import numpy as np

from .interval_kernels import LANES, NAN, box_intervals, box_rows, boxes_group
from .jit_cache import compile_ahead, njit, prange
from .lowering import NotLowerable, lower
from .memo import Kept
from .pruned_eval import counting_sort, eval_run
from .pruner import checked_records, is_arithmetic, prune_records
from .tape import CellsTooLarge, Tape, content_key
from .twin_march import hit_threshold
from .twin_ops import JIT_OPTIONS as _JIT
from .twin_threads import on_threads

__all__ = ["CellTapes", "cell_tape", "grid_ijk", "sub_cell_ijk", "grid_cell_boxes", "CELL_TAPES_MAX_BYTES",
           "LOWER_MAX_RECORDS"]

CELL_TAPES_MAX_BYTES = 512 << 20    # march_pruned's pruned tapes, all cells together
_CELL_TAPE = Kept(16)   # content key -> the lowered tape (None: not lowerable)
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
    return _CELL_TAPE.get(content_key(tape), lambda: _lowered(tape))


def _lowered(tape: Tape) -> Tape | None:
    try:
        return lower(tape)
    except NotLowerable:
        return None


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


@njit(nogil=True, **_JIT)
def _prune_cells(code, imm, n_regs, choices, sides, tcodes, timms, starts, thread, n_threads):
    """Thread ``thread``'s cells' (every n_threads-th) pruned tapes: cell c (column c of choices,
    sides[:, :, c]) into tcodes[c] / timms[c] from starts[c] on."""
    n = code.shape[0]
    for c in range(thread, choices.shape[1], n_threads):
        starts[c] = prune_records(code, imm, np.int64(0), n, choices[:, c], sides[:, :, c], np.empty(n_regs, np.bool_),
                                  (tcodes[c], timms[c], np.empty(n, np.int32)))


@njit(**_JIT)
def _subcells_of(tcode, timm, start, n_regs, boxes, write, sub, first):
    """The 64 sub-cells (boxes: (6, 64)) of one cell whose pruned tape is tcode / timm [start, n),
    into ``sub`` (offsets, fcode, fimm, lengths, lower): their tapes' lengths into
    lengths[first:first + 64], or with ``write`` the tapes into fcode / fimm from
    offsets[first + k] (the lengths pass and the writing pass must agree: both are deterministic);
    either pass writes their intervals' lower bounds into lower[first:...]."""
    offsets, fcode, fimm, lengths, lower = sub
    n = tcode.shape[0]
    box = np.empty((6, LANES), np.float32)
    lo = np.zeros((n_regs, LANES), np.float32)    # (zeros: the result never depends on stale memory)
    hi = np.zeros((n_regs, LANES), np.float32)
    ch = np.zeros((n, LANES), np.uint8)
    sd = np.zeros((n, 3, LANES), np.float32)
    out_lo = np.empty(64, np.float32)
    out_hi = np.empty(64, np.float32)
    choices = np.zeros((n, 64), np.uint8)
    sides = np.zeros((n, 3, 64), np.float32)
    for g in range(0, 64, LANES):
        boxes_group(tcode, timm, start, n, boxes, g, (box, lo, hi, ch, sd), (out_lo, out_hi, choices, sides))
    lower[first:first + 64] = out_lo
    live = np.empty(n_regs, np.bool_)
    oc = np.empty((n, 5), np.int32)
    oi = np.empty(n, np.float32)
    src = np.empty(n, np.int32)
    for k in range(64):
        w = prune_records(tcode, timm, start, n, choices[:, k], sides[:, :, k], live, (oc, oi, src))
        if not write:
            lengths[first + k] = n - w
        else:
            o = offsets[first + k]
            fcode[o:o + n - w] = oc[w:]
            fimm[o:o + n - w] = oi[w:]


@njit(nogil=True, **_JIT)
def _prune_subcells(tcodes, timms, starts, n_regs, sub_boxes, write, offsets, fcode, fimm, lengths, lower, thread,
                    n_threads):
    """The 64 sub-cells of thread ``thread``'s grid cells c (every n_threads-th; sub-cell boxes
    sub_boxes[:, 64 c : 64 c + 64]), each pruned from cell c's pruned tape (tcodes[c] / timms[c]
    from starts[c]): their lengths into ``lengths``, or with ``write`` the sub-tapes into fcode /
    fimm from offsets[64 c + k]; their intervals' lower bounds into ``lower`` (empty-space
    skipping)."""
    for c in range(thread, tcodes.shape[0] - 1, n_threads):    # (not the outside cell: no sub-cells)
        boxes = np.ascontiguousarray(sub_boxes[:, 64 * c:64 * c + 64])   # (C: one boxes_group signature)
        _subcells_of(tcodes[c], timms[c], starts[c], n_regs, boxes, write, (offsets, fcode, fimm, lengths, lower),
                     64 * c)


_SEGMENT_RUNS = 256


@njit(parallel=True, **_JIT)
def _cells_points_kernel(fcode, fimm, first, end, n_regs, pts, order, seg, ids, block, out):
    """Per segment u (points order[seg[u]:seg[u+1]], all in cell ids[u]): that cell's tape,
    fcode / fimm [first[id], end[id]). Segments go in runs of about 1 / _SEGMENT_RUNS of them per
    parallel task (few points a segment: scratch is allocated per run, not per segment). A
    parallel loop: a march calls it at every step, where the twin's threads cost 3-8 % of a
    frame."""
    n_seg = seg.shape[0] - 1
    runs = min(n_seg, _SEGMENT_RUNS)
    for r in prange(runs):
        work = np.empty((n_regs + 5, block), np.float32)
        for u in range(r * n_seg // runs, (r + 1) * n_seg // runs):
            c = ids[u]
            eval_run(fcode, fimm, first[c], end[c], pts, order[seg[u]:seg[u + 1]], work, out)


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
    order, count, used = counting_sort(vid, G3 + 1)
    seg = np.empty(used + 1, np.int64)
    ids = np.empty(used, np.int64)
    u = 0
    for v in range(G3 + 1):
        if count[v + 1] > count[v]:
            seg[u], ids[u] = count[v], v
            u += 1
    seg[used] = N
    return order, seg, ids


class CellTapes:
    """An arithmetic tape pruned for every cell of a grid^3 grid over a box (each cell's box grown
    by a rounding margin) and, with ``levels`` 2, again for each of a cell's 4 x 4 x 4 sub-cells
    (from the cell's pruned tape), plus the whole tape (an all-undecided column) for points
    outside the grid, pruned once: ``evaluate`` gives CpuWalker.evaluate's values bit for bit,
    each point on its finest cell's tape. The finest tapes are packed one after another in
    ``fcode`` / ``fimm``; tape t is [first[t], end[t]) (the outside cell's last)."""

    def __init__(self, tape: Tape, lo, hi, grid: int, levels: int = 1):
        self.code, self.imm = checked_records(tape, "march_pruned", fields=True)
        self.n_regs, self.grid, self.levels = tape.n_regs, grid, levels
        n = len(self.code)
        aheads = _kernels_ahead(self.code, self.imm, self.n_regs, levels)    # (on an empty cache)
        lo, hi = np.asarray(lo, np.float64), np.asarray(hi, np.float64)
        self.lo = lo.astype(np.float32)
        size = np.where(hi > lo, (hi - lo) / grid, 1.0)
        c_lo, c_hi = grid_cell_boxes(lo, hi, size, grid_ijk(grid))
        c_lower, _, choices, sides = box_intervals(self.code, self.imm, 0, self.n_regs, box_rows(c_lo, c_hi))
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
        on_threads(_prune_cells, self.code, self.imm, self.n_regs, self.choices, sides, tcodes, timms, starts)
        for ahead in aheads:
            ahead.wait()
        if levels == 1:
            tapes = [(tcodes[c, starts[c]:], timms[c, starts[c]:]) for c in range(n_cells)]
            self.fcode = np.ascontiguousarray(np.concatenate([t[0] for t in tapes]))
            self.fimm = np.ascontiguousarray(np.concatenate([t[1] for t in tapes]))
            lengths = n - starts
        else:
            s_lo, s_hi = grid_cell_boxes(lo, hi, size / 4, sub_cell_ijk(grid_ijk(grid)))
            sub = box_rows(s_lo, s_hi)
            sub_lengths = np.empty(sub.shape[1], np.int64)     # sub-cell k of cell c: index 64 c + k
            s_lower = np.empty(sub.shape[1], np.float32)
            on_threads(_prune_subcells, tcodes, timms, starts, self.n_regs, sub, False, sub_lengths, tcodes[0],
                       timms[0], sub_lengths, s_lower)
            levels_lower.append((s_lo.astype(np.float32), s_hi.astype(np.float32), s_lower))
            lengths = np.append(sub_lengths, n - starts[-1])
            if int(lengths.sum()) * 24 > CELL_TAPES_MAX_BYTES:
                raise CellsTooLarge(f"march_pruned: the {len(sub_lengths)} sub-cells' tapes need "
                                   f"{int(lengths.sum()) * 24 / 2**20:.0f} MB (at most "
                                   f"{CELL_TAPES_MAX_BYTES >> 20} MB): use a smaller grid or one level")
            offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
            self.fcode = np.empty((int(lengths.sum()), 5), np.int32)
            self.fimm = np.empty(len(self.fcode), np.float32)
            on_threads(_prune_subcells, tcodes, timms, starts, self.n_regs, sub, True, offsets, self.fcode, self.fimm,
                       sub_lengths, s_lower)
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
            table = (self.lo, self.cell, self.fine, self.grid, self.levels, self.skip_lo, self.skip_hi, self.skip_lower)
            _skip_kernel((o, d, t), live, pts, table, (np.float32(eps), np.float32(scale), np.float32(cone)), out)
        return out

    def evaluate(self, pts: np.ndarray) -> np.ndarray:
        pts = np.ascontiguousarray(pts, np.float32)
        out = np.empty(len(pts), np.float32)
        if len(pts):
            order, seg, ids = _bucket_cells(pts, self.lo, self.cell, self.fine)
            _cells_points_kernel(self.fcode, self.fimm, self.first, self.end, self.n_regs, pts, order, seg,
                                 self.tape_of[ids], 64, out)
        return out


def _kernels_ahead(code, imm, n_regs, levels) -> list:
    """Helper processes compiling the kernels a CellTapes build and its evaluation run after the
    box intervals (the sub-cells' pruning with ``levels`` 2, the points' evaluation), by the
    argument types they will get (none started where the disk cache holds them: jit_cache.compile_ahead)."""
    i, ints, f32 = np.int64(0), np.empty(0, np.int64), np.empty(0, np.float32)
    tcodes, timms = np.empty((0,) + code.shape, code.dtype), np.empty((0, len(imm)), imm.dtype)
    kernels = [(_cells_points_kernel, (code, imm, ints, ints, n_regs, np.empty((0, 3), np.float32), ints, ints, ints,
                                       64, f32))]
    if levels == 2:
        kernels.append((_prune_subcells, (tcodes, timms, ints, n_regs, np.empty((6, 0), np.float32), True, ints, code,
                                          imm, ints, f32, i, i)))
    return [compile_ahead(k, *args) for k, args in kernels]


@njit(**_JIT)
def _skip_kernel(rays, live, pts, table, rule, out):
    """CellTapes.skip_to for every point: out[q] for the step of ray live[q] (``rays``: o, d, t)
    at pts[q], by ``rule`` (eps, scale, cone); ``table`` (lo, cell, fine, grid, levels, box_lo,
    box_hi, lower): the finest grid's origin, cell size and count, the coarse grid and the levels,
    and the boxes and lower bounds of level 0 (grid^3 cells) then, with levels 2, of the sub-cells
    (64 a cell, sub-cell k of cell c at grid^3 + 64 c + k)."""
    o, d, t = rays
    lo, cell, fine, grid, levels, box_lo, box_hi, lower = table
    eps, scale, cone = rule
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
                if not low >= hit_threshold(eps, cone, cand):
                    continue
                if cand > best:
                    best = cand
        out[q] = best
