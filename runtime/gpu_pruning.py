"""The GPU walker's interval-pruned passes (shaders/prune.wgsl + packed.wgsl): ``GpuPrunedPasses``,
the object a ``GpuWalker`` (runtime/gpu.py) holds as its ``pruned`` and serves the public names
of, and the host side of its cells and tiles.

Owns pruned 2D images over one to four tile levels (``sign_image``, ``field_image_pruned``,
``prune_levels``; ``tile_levels``, ``level_tile_counts``) or on image cells kept for the images of
the same tape after the first (``cells``: ``IMAGE_CELLS``, ``image_cell_box``), their pixel
passes in the register variant their renumbered tapes need (``_pixel_variant``) and sign images
read back as bits (``sign_bit_words``), pruned point sets over cells of the
points (``evaluate_pruned``, ``prune_levels_points``; ``point_cells``, the host's counting sort of
the points by cell, through Numba), march / light / render of arithmetic tapes and scene fields
(pruning.FIELD_OPS, their materials from the cells' tapes too) over hierarchical 3D cells of
the march box (``march_cells``, the ``_cells`` pipelines; ``march_cells_for``, ``frame_cells``,
``march_cell_levels``; the path tracer's, ``path_cells``), all with
their arena grown when it overflows, and the cells kept in out_u for the next frame or image;
level 0 of all of them in dependency steps
(``wave_schedule``: the host's plan of an arithmetic tape's records, which prune.wgsl
``prune_wave`` runs a workgroup a tile; ``start_wave_planner``; ``WAVE_MAX_TILES``); and the
passes that runtime/gpu.py's ``GpuProfiler`` times, set up and not run (``image_passes``,
``points_passes``, ``march_cell_passes``).

The passes are dispatched through the walker's public plumbing; no WGSL is formatted here.
"""
from __future__ import annotations

import functools
import threading

import numpy as np

from .gpu_device import (BUILD_COMPANIONS, KERNEL_CONSTANTS, PATH_F_WORDS, PATH_U_WORDS, builds_in_background,
                         variant_for)
from .gpu_guard import guarded
from .jit_cache import load_numba
from .opcodes import OPS, WAVE_RECORDS, WAVE_SLOTS, WAVE_WIDTH, Op
from .pruning import (PRUNE_MIN_RECORDS, compact_records, grid_cell_boxes, grid_ijk, is_arithmetic,
                      sub_cell_ijk)
from .shading import RenderSettings, unpack
from .tape import INSTR_DTYPE, CellsTooLarge, Tape, TaperayError, content_key, point_array

# Pruned images (shaders/prune.wgsl): default tile levels, coarse to fine (pixels); at most
# MAX_TILE_LEVELS (their sizes fill one vec4 of the uniforms); header words per tile (packed.wgsl
# HEADER_WORDS); the counters' words (prune.wgsl): the arena's bump pointer and refusals, the most
# registers a finest tile's tape uses, the pixels refused for want of registers.
PRUNE_TILES = (64, 16, 4)
MAX_TILE_LEVELS = 4
PRUNE_HEADER_WORDS = 5
PRUNE_ARENA, PRUNE_ARENA_FULL, PRUNE_REGS, PRUNE_REGS_REFUSED = 2, 3, 4, 5


def image_tiles(width: int, height: int) -> tuple[int, ...]:
    """Tile levels for a pruned image of a tape whose MIN / MAX chains are balanced
    (``load_vm(..., balance_chains=True)``, as ``taperay render --2d`` loads): level 0 the
    smallest power of two from 32 px giving at most WAVE_MAX_TILES tiles (level 0 runs in
    dependency steps up to there), then quarters of it down to 8 px. Prospero on the H200
    (docs/PERFORMANCE.md, prune-gpu): (32, 8) at 1024^2, 0.95 ms of GPU time against
    1.18 with PRUNE_TILES; (128, 32, 8) at 4096^2, 1.79 against 5.02. A tape as written (chains)
    does better with PRUNE_TILES at 1024^2: its level 0 takes a step per link of its chain."""
    size = 32
    while level_tile_counts((size,), width, height)[0] > WAVE_MAX_TILES:
        size *= 2
    levels = [size]
    while levels[-1] // 4 >= 8 and len(levels) < MAX_TILE_LEVELS:
        levels.append(levels[-1] // 4)
    return tuple(levels)


def tile_levels(tiles) -> tuple[int, ...]:
    """The tile levels of a pruned image: ``tiles`` is one size or sizes coarse to fine, pixels."""
    sizes = (tiles,) if isinstance(tiles, (int, np.integer)) else tuple(tiles)
    if not 1 <= len(sizes) <= MAX_TILE_LEVELS:
        raise TaperayError(f"pruned image: {len(sizes)} tile levels; give 1 to {MAX_TILE_LEVELS} sizes")
    if not all(isinstance(s, (int, np.integer)) and 1 <= s <= 1 << 16 for s in sizes):
        raise TaperayError(f"pruned image: tile sizes {sizes} must be whole numbers of pixels in 1..65536")
    if any(b >= a for a, b in zip(sizes, sizes[1:])):
        raise TaperayError(f"pruned image: tile sizes {sizes} must shrink from level to level")
    return tuple(int(s) for s in sizes)


# Pruned point evaluation (GpuWalker.evaluate_pruned): level-0 cells over the points' bounding box
# (at most POINT_CELLS, and at most one per POINT_MIN_PER_CELL points), each finer level splitting
# a cell 4 ways per axis the points span; the points buffer's words per point (x y z, cell, index);
# points per dispatch (the index is a float: exact below 2^24).
POINT_CELLS = 1024
POINT_MIN_PER_CELL = 256
POINT_WORDS = 5
POINT_CHUNK = 1 << 24


def _grid_coord(x, lo, scale, top):
    """clamp(floor((x - lo) * scale), 0, top) (NaN: 0)."""
    t = (np.float64(x) - lo) * scale
    if not t > 0.0:
        return 0
    if t >= top:
        return np.int64(top)
    return np.int64(t)


def _bucket_points(pts, lo, scale, g0, shift, fan, n_levels, n_tiles, offsets, out_words):
    """Counting sort of the points by finest cell. Per point and axis r the finest-grid
    coordinate i_r = _grid_coord(x, lo, scale, g0[r] << shift - 1); the
    level-0 cell (i >> shift) over the g0 grid, then per finer level m the digit of the
    4-way split (fan[r] is 4 or 1). out_words: the level table, the boxes of every cell of
    every level (lo.xyz hi.xyz; empty: +inf / -inf; NaN along an axis holding a NaN), then
    per sorted point x y z, its finest cell, its index q (floats). Returns nothing."""
    N = pts.shape[0]
    qq = fan[0] * fan[1] * fan[2]
    fine = np.empty(N, np.int64)
    top = np.empty(3, np.float64)
    for r in range(3):
        top[r] = (g0[r] << shift) - 1
    for q in range(N):
        i0 = _grid_coord(pts[q, 0], lo[0], scale[0], top[0])
        i1 = _grid_coord(pts[q, 1], lo[1], scale[1], top[1])
        i2 = _grid_coord(pts[q, 2], lo[2], scale[2], top[2])
        c = ((i2 >> shift) * g0[1] + (i1 >> shift)) * g0[0] + (i0 >> shift)
        for m in range(1, n_levels):
            sh = 2 * (n_levels - 1 - m)
            c = c * qq + (((i2 >> sh) & 3) * fan[1] + ((i1 >> sh) & 3)) * fan[0] + ((i0 >> sh) & 3)
        fine[q] = c
    nf = n_tiles[n_levels - 1]
    count = np.zeros(nf + 1, np.int64)
    for q in range(N):
        count[fine[q] + 1] += 1
    for c in range(nf):
        count[c + 1] += count[c]
    for l in range(4):
        out_words[l] = l
    for l in range(n_levels):
        for t in range(n_tiles[l]):
            b = 4 + 6 * (offsets[l] + t)
            for r in range(3):
                out_words[b + r] = np.inf
                out_words[b + 3 + r] = -np.inf
    base = 4 + 6 * (offsets[n_levels - 1] + n_tiles[n_levels - 1])
    for q in range(N):
        c = fine[q]
        at = count[c]
        count[c] += 1
        w = base + POINT_WORDS * at
        b = 4 + 6 * (offsets[n_levels - 1] + c)
        for r in range(3):
            x = pts[q, r]
            out_words[w + r] = x
            if x != x:
                out_words[b + r] = np.nan
                out_words[b + 3 + r] = np.nan
            else:   # (a NaN bound stays NaN: both compares are false)
                if x < out_words[b + r]:
                    out_words[b + r] = x
                if x > out_words[b + 3 + r]:
                    out_words[b + 3 + r] = x
        out_words[w + 3] = c
        out_words[w + 4] = q
    for l in range(n_levels - 2, -1, -1):   # a cell's box: the union of its sub-cells'
        for t in range(n_tiles[l]):
            b = 4 + 6 * (offsets[l] + t)
            for k in range(qq):
                s = 4 + 6 * (offsets[l + 1] + t * qq + k)
                if out_words[s] > out_words[s + 3]:
                    continue   # empty
                for r in range(3):
                    a, z = out_words[s + r], out_words[s + 3 + r]
                    if a != a or out_words[b + r] != out_words[b + r]:
                        out_words[b + r] = np.nan
                        out_words[b + 3 + r] = np.nan
                    else:
                        out_words[b + r] = min(out_words[b + r], a)
                        out_words[b + 3 + r] = max(out_words[b + 3 + r], z)


def _finite_bounds(pts, lo, hi):
    """lo, hi: per axis the range of the finite coordinates (0, 0 where there is none)."""
    for r in range(3):
        lo[r], hi[r] = np.inf, -np.inf
    for q in range(pts.shape[0]):
        for r in range(3):
            x = np.float64(pts[q, r])
            if x - x == 0.0:    # finite
                lo[r] = min(lo[r], x)
                hi[r] = max(hi[r], x)
    for r in range(3):
        if lo[r] > hi[r]:
            lo[r], hi[r] = 0.0, 0.0


_point_jit: tuple | None = None


def _point_kernels():
    """(_finite_bounds, _bucket_points) through Numba, compiled on first use (cached on disk)."""
    global _point_jit
    if _point_jit is None:
        from numba import njit
        jit = njit(cache=True, error_model="numpy", fastmath=False)
        global _grid_coord
        _grid_coord = jit(_grid_coord)
        _point_jit = (jit(_finite_bounds), jit(_bucket_points))
    return _point_jit


def point_cells(pts: np.ndarray, levels: int, cells: int):
    """The cell levels of evaluate_pruned over (N, 3) float32 points: (tiles per level, the points
    buffer's float32 words: level table, cell boxes, sorted points with their cell and index;
    the word where the points start). Level 0: a grid over the bounding box of the finite
    coordinates, about ``cells`` cells shared among the axes the points span; each finer level
    splits a cell 4 ways per such axis (levels whose cells would outnumber the points 4 to 1, or
    beyond MAX_TILE_LEVELS, are dropped). A cell's box is the range of
    its points, so every point lies in its cell's box exactly."""
    n = len(pts)
    pts = np.ascontiguousarray(pts, np.float32)
    bounds, bucket = _point_kernels()
    lo, hi = np.zeros(3), np.zeros(3)
    bounds(pts, lo, hi)
    span = hi > lo
    d = int(span.sum())
    target = max(1, int(cells))
    per_axis = max(1, int(round(target ** (1.0 / d)))) if d else 1
    g0 = np.where(span, per_axis, 1).astype(np.int64)
    levels = max(1, min(levels, MAX_TILE_LEVELS)) if d else 1
    fan = np.where(span, 4, 1).astype(np.int64)
    qq = int(fan.prod())
    while levels > 1 and int(g0.prod()) * qq ** (levels - 1) > 4 * max(n, 1):
        levels -= 1
    shift = 2 * (levels - 1)
    scale = np.where(span, (g0 << shift) / np.where(span, hi - lo, 1.0), 0.0)
    n_tiles = np.array([int(g0.prod()) * qq ** m for m in range(levels)], np.int64)
    offsets = np.concatenate([[0], np.cumsum(n_tiles)[:-1]]).astype(np.int64)
    first = 4 + 6 * int(n_tiles.sum())
    words = np.empty(first + POINT_WORDS * n, np.float32)
    bucket(pts, lo, scale.astype(np.float64), g0, shift, fan, levels, n_tiles, offsets, words)
    return [int(c) for c in n_tiles], words, first


# Pruned march and light (GpuWalker.march / light / render of an arithmetic tape): MARCH_CELLS =
# (g0, levels), g0^3 level-0 cells over the march box, each finer level splitting a cell 4 x 4 x 4
# (packed.wgsl cell_eval); "auto" prunes tapes of at least pruning.PRUNE_MIN_RECORDS records.
MARCH_CELLS = (8, 2)
# A scene tape's lowering (GpuWalker.render) runs on LOWERED_CELLS first, then on MARCH_CELLS where
# those exceed the binding limit: its tape is longer and its primitives small against the box
# (H200, 1,000 primitives at 1920x1080: shade 295 -> 220 ms of GPU time, normals 128 -> 91 ms,
# an arena of 285 M words against 143 M).
LOWERED_CELLS = (16, 2)
# Image cells (sign_image / field_image_pruned with ``cells``): g0^2 level-0 cells over the
# image's rectangle in the plane z, each finer level splitting a cell 4 x 4; kept for the images
# of the same tape after it (at 1024^2, IMAGE_CELLS' finest cells are 4 pixels wide).
IMAGE_CELLS = (16, 3)
# out_u words kept after the image cells' arena for sign images' bits (sign_bit_words): those of a
# 2048^2 image; a larger image's prunes the cells again, with room for its own
IMAGE_BITS_WORDS = 2 * (2048 // 8) ** 2
CELL_DESCRIPTOR_WORDS = 10


@functools.lru_cache(maxsize=8)
def march_cells_cached(lo: tuple, hi: tuple, g0: int, levels: int, flat: bool = False, base: int = 0):
    """march_cells with ``base`` as the headers' first word in out_u, read-only and kept: the
    points buffer, once synced to the words, does not compare them again when the same cells are
    pruned again (gpu.Buffer.held)."""
    counts, words, desc = march_cells(lo, hi, g0, levels, flat)
    words[desc + 8:desc + 9].view(np.uint32)[0] = base
    words.flags.writeable = False
    return counts, words, desc


def march_box_cells(packed: np.ndarray, cells: tuple[int, int], base: int):
    """march_cells_cached over the march box of the packed render settings (the same box each
    frame: kept)."""
    lo, hi = np.asarray(unpack(packed, "box_lo", "box_hi"), np.float64).reshape(2, 3)
    return march_cells_cached(tuple(lo), tuple(hi), *cells, base=base)


def march_cells(lo, hi, g0: int, levels: int, flat: bool = False):
    """The cells of a pruned march over the box lo..hi: (cells per level, the points buffer's
    float32 words, the descriptor's first word; packed.wgsl cell_eval reads them). Level 0: g0^3
    grid cells (id i + g0 (j + g0 k)) and the outside cell (box NaN); level m + 1: 64 sub-cells per
    level-m cell (the outside cell's empty). A grid cell's box is the twin's
    (pruning.grid_cell_boxes) in float32, clipped to its parent's box: a sub-cell's tape, pruned
    from its parent's over its box, is exact wherever it is used. ``flat``: the cells of an image
    in the plane z = lo.z = hi.z, g0^2 at level 0 and 16 sub-cells per cell, their boxes exactly
    z along z."""
    lo, hi = np.asarray(lo, np.float64), np.asarray(hi, np.float64)
    size0 = np.where(hi > lo, (hi - lo) / g0, 1.0)
    kids = 16 if flat else 64
    ijk = grid_ijk(g0, flat)
    grid_boxes, boxes = [], []
    for m in range(levels):
        box = np.concatenate(grid_cell_boxes(lo, hi, size0 / 4.0 ** m, ijk), 1).astype(np.float32)
        if flat:
            box[:, 2] = box[:, 5] = np.float32(lo[2])
        if m:   # within the parent's box
            parent = np.repeat(grid_boxes[-1], kids, 0)
            box[:, :3] = np.maximum(box[:, :3], parent[:, :3])
            box[:, 3:] = np.minimum(box[:, 3:], parent[:, 3:])
        grid_boxes.append(box)
        outside = np.full((1, 6), np.nan, np.float32) if m == 0 else \
            np.tile(np.array([np.inf] * 3 + [-np.inf] * 3, np.float32), (kids * len(boxes[-1]) - len(box), 1))
        boxes.append(np.concatenate([box, outside]))
        if m + 1 < levels:
            ijk = sub_cell_ijk(ijk, flat)
    desc = 4 + 6 * sum(len(b) for b in boxes)
    words = np.empty(desc + CELL_DESCRIPTOR_WORDS, np.float32)
    words[:4] = np.arange(4)
    words[4:desc] = np.concatenate(boxes).ravel()
    words[desc:desc + 3] = lo
    words[desc + 3:desc + 6] = size0 / 4.0 ** (levels - 1)
    words[desc + 6:].view(np.uint32)[:] = g0, levels, 0, flat   # (the header base: set by march_cells_cached)
    return [len(b) for b in boxes], words, desc


def image_cell_box(rect, z: float) -> tuple[tuple, tuple]:
    """The box (lo, hi) of the flat image cells over ``rect`` (x0 x1 y0 y1) in the plane z."""
    x0, x1, y0, y1 = (float(v) for v in rect)
    return (min(x0, x1), min(y0, y1), float(z)), (max(x0, x1), max(y0, y1), float(z))


def sign_bit_words(width: int, height: int) -> int:
    """out_u words of a sign image's bits (prune.wgsl sign_bits): two per 8 x 8 pixel block."""
    return 2 * -(-width // 8) * -(-height // 8)


def level_tile_counts(sizes: tuple[int, ...], width: int, height: int) -> list[int]:
    """Tiles per level: level 0 covers the image; a level-l tile has ceil(size_l / size_l+1)^2
    sub-tiles (runtime/pruning.py's nesting; those beyond the image are empty)."""
    counts = [-(-width // sizes[0]) * -(-height // sizes[0])]
    for a, b in zip(sizes, sizes[1:]):
        counts.append(counts[-1] * (-(-a // b)) ** 2)
    return counts



def arena_guess(tape: Tape, level0_tiles: int, tiles: int, kernel: str) -> int:
    """The arena words first given to ``kernel``'s pruning passes (prune_tiles / prune_cells /
    prune_image_cells) of ``tiles`` tiles (or cells), of which ``level0_tiles`` prune the whole
    tape (an overflow grows it and runs them again): a level-0 tile's scratch (a nibble a record)
    and a sixteenth of the tape, and per tile 64 words and, where the kernel takes the union rule
    (gpu.KERNEL_CONSTANTS' UNION_BOUND: on the levels after the first), the sides of a
    thirty-second of the tape's MIN / MAX records, three words each."""
    ops = tape.instrs["op"]
    union_bound = KERNEL_CONSTANTS.get(kernel, {}).get("UNION_BOUND", False)
    minmax = int(np.isin(ops, (Op.MIN, Op.MAX, Op.UNION, Op.INTERSECT)).sum()) if union_bound else 0
    return level0_tiles * (len(ops) // 4 + 8) + tiles * (64 + 3 * (minmax // 32))


# ---- level 0 in dependency steps (prune.wgsl prune_wave) -------------------------------------
def _wave_plan(code, leaf_bits, reads, max_slots, width, affinity):
    """The dependency-step schedule of an arithmetic tape's records ((n, 5) op dst a b c, scene
    fields as their arithmetic ops; ``leaf_bits``: a CONST's value bits; ``reads[op]``: the
    registers op reads, OP_READS): (rows (m, 8) uint32 as
    prune_wave reads them after the tape, slots used), or (empty rows, slots) when more than
    ``max_slots`` values are alive at once.
    Each record's operands are the records that last wrote their registers before it; only the
    records the result depends on are scheduled; a non-leaf record runs at the latest step before
    its readers' with fewer than ``width`` records (which keeps few values alive), or a few steps
    earlier where one runs its op (``affinity``; a step's records sorted by op), and its value
    takes a free slot (the last freed), free again after the last step that reads it (the
    result's: never)."""
    n = code.shape[0]
    none = np.uint32(0xFFFFFFFF)
    n_reads = np.zeros(n, np.int64)
    prod = np.full((n, 3), -1, np.int64)
    writer = np.full(256, -1, np.int64)
    for k in range(n):
        op = code[k, 0]
        r = reads[op]
        n_reads[k] = r
        for j in range(r):
            prod[k, j] = writer[code[k, 2 + j] & 0xFF]
        writer[code[k, 1]] = k
    root = writer[0]
    alive = np.zeros(n, np.bool_)
    if root >= 0:
        alive[root] = True
    for k in range(n - 1, -1, -1):
        if alive[k]:
            for j in range(n_reads[k]):
                if prod[k, j] >= 0:
                    alive[prod[k, j]] = True
    # steps counted back from the last (back), each record in reverse order at the latest one
    # before its readers' that has room for it (width: at most ``width`` records a step), or up
    # to ``affinity`` steps earlier, where a step with room already runs its op (fewer kinds of
    # interval op a step), but no earlier than its producers allow (depth: its earliest step)
    depth = np.zeros(n, np.int64)
    for k in range(n):
        if alive[k] and n_reads[k] > 0:
            for j in range(n_reads[k]):
                p = prod[k, j]
                if p >= 0 and n_reads[p] > 0:
                    depth[k] = max(depth[k], depth[p] + 1)
    deepest = depth.max() if n else 0
    ops = np.zeros(n + 1, np.int64)        # the ops of a step's records, a bit each
    back = np.zeros(n, np.int64)
    need = np.zeros(n, np.int64)           # 1 + the latest reader's back step
    room = np.full(n + 1, width, np.int64)
    nxt = np.arange(n + 1)                 # of a full step: one further back, where room may be
    last = 0
    for k in range(n - 1, -1, -1):
        if alive[k] and n_reads[k] > 0:
            b = need[k]
            r = b
            while room[r] == 0:
                r = nxt[r]
            while b != r:                  # (the full steps passed now lead to r)
                b, nxt[b] = nxt[b], r
            bit = np.int64(1) << code[k, 0]
            if ops[r] & bit == 0:
                for q in range(r + 1, min(r + affinity, deepest - depth[k]) + 1):
                    if room[q] > 0 and ops[q] & bit != 0:
                        r = q
                        break
            ops[r] |= bit
            room[r] -= 1
            if room[r] == 0:
                nxt[r] = r + 1
            back[k] = r
            last = max(last, r)
            b = r
            for j in range(n_reads[k]):
                p = prod[k, j]
                if p >= 0:
                    need[p] = max(need[p], b + 1)
    step = last - back
    end = step.copy()
    for k in range(n):
        if alive[k] and n_reads[k] > 0:
            for j in range(n_reads[k]):
                p = prod[k, j]
                if p >= 0 and n_reads[p] > 0:
                    end[p] = max(end[p], step[k])
    if root >= 0:
        end[root] = last + 1
    inner = np.array([k for k in range(n) if alive[k] and n_reads[k] > 0], np.int64)
    leaves = np.array([k for k in range(n) if alive[k] and n_reads[k] == 0], np.int64)
    n_steps = last + 1 if inner.size else 0
    order = inner[np.argsort(step[inner] * 64 + code[inner, 0], kind="mergesort")]
    # slots: a value read last at step e is free from step e + 1
    slot = np.full(n, -1, np.int64)
    free = np.zeros(inner.size + 1, np.int64)
    n_free = 0
    used = 0
    by_end = inner[np.argsort(end[inner], kind="mergesort")]
    fi = 0
    for k in order:
        while fi < by_end.size and end[by_end[fi]] < step[k]:
            free[n_free] = slot[by_end[fi]]
            n_free += 1
            fi += 1
        if n_free:
            n_free -= 1
            slot[k] = free[n_free]
        else:
            slot[k] = used
            used += 1
    if used > max_slots:
        return np.zeros((0, 8), np.uint32), used
    # operands: (descriptor, kind, value) = (slot, 0, 0) | (leaf, 1, CONST bits) | (leaf, 2, VAR
    # axis) | (leaf or none, 3, 0: INSTANCE_INDEX's value, or no record wrote the register)
    desc = np.full(n + 1, none, np.uint32)      # desc[-1]: no producer
    kind = np.full(n + 1, 3, np.uint32)
    value = np.zeros(n + 1, np.uint32)
    for k in leaves:
        desc[k] = np.uint32(k) | np.uint32(1 << 31)
        op = code[k, 0]
        if op == 3:                             # CONST
            kind[k], value[k] = 1, leaf_bits[k]
        elif op <= 2:                           # VAR_X, VAR_Y, VAR_Z
            kind[k], value[k] = 2, op
    for k in order:
        desc[k], kind[k] = np.uint32(slot[k]), 0
    consts = 1 + width * n_steps
    rows = np.zeros((consts + n, 8), np.uint32)
    rows[0, 0] = n_steps
    rows[0, 1] = desc[root]
    rows[0, 2] = kind[root]
    rows[0, 3] = value[root] if kind[root] else desc[root]
    rows[0, 4] = used
    lane = 0
    for i in range(order.size):
        k = order[i]
        if i and step[order[i - 1]] != step[k]:
            lane = 0
        at = 1 + width * step[k] + lane
        lane += 1
        rows[at, 0] = code[k, 0] | (code[k, 1] << 8) | (code[k, 2] << 16) | (code[k, 3] << 24)
        word = k | (slot[k] << 13) | (1 << 28)
        for j in range(3):
            p = prod[k, j] if j < n_reads[k] else -1
            word |= np.int64(kind[p]) << (22 + 2 * j)
            rows[at, 2 + j] = value[p] if kind[p] else slot[p]
            mark = 0xFFFF if desc[p] == none else desc[p] & 0xFFFF
            rows[at, 6 + j // 2] |= np.uint32(mark) << np.uint32(16 * (j % 2))
            rows[consts + k, j] = value[p]
        rows[at, 1] = word
    return rows, used


OP_READS = np.array([len(OPS[op].reads) for op in Op], np.int64)   # registers each op reads (_wave_plan)
WAVE_KERNELS = {"prune_tiles": "prune_wave", "prune_cells": "prune_wave_cells", "prune_image_cells": "prune_wave_cells"}
if WAVE_RECORDS > 1 << 13 or WAVE_SLOTS > 1 << 9:   # (a schedule row's fields: prune.wgsl wave_entry)
    raise ImportError("runtime.gpu_pruning: WAVE_RECORDS or WAVE_SLOTS exceed the schedule rows' fields")
# prune_wave's level 0 up to this many tiles (GpuWalker.wave_max_tiles); past it, where every
# invocation of the GPU is busy, prune_tiles' serial walks cost less (docs/PERFORMANCE.md)
WAVE_MAX_TILES = 1024
# how many steps earlier _wave_plan may move a record into a step that runs its op: prospero's
# steps run 3.6 kinds of op instead of 4.6, level 0 about 8 % faster on the H200 (PERFORMANCE.md)
WAVE_AFFINITY = 8


class WavePlanner:
    """The process's planner of level 0 in dependency steps: ``jit``, ``_wave_plan`` through Numba
    once compiled (or loaded from its disk cache); ``loader``, the thread compiling it (None: not
    started); ``schedules``, wave_schedule's rows kept per tape content."""

    def __init__(self):
        self.jit = None
        self.loader: threading.Thread | None = None
        self.schedules: dict[int, np.ndarray | None] = {}

    def _load(self):
        plan = load_numba().njit(cache=True)(_wave_plan)      # (Numba's cache folder set: jit_cache)
        plan(np.zeros((1, 5), np.int64), np.zeros(1, np.uint32), OP_READS, WAVE_SLOTS, WAVE_WIDTH, WAVE_AFFINITY)
        self.jit = plan

    def start(self) -> threading.Thread:
        """Compiles the planner (Numba: about 0.4-1 s to load from its disk cache, 4 s to compile
        on a fresh machine) in a thread of its own, once; returns the thread."""
        if self.loader is None:
            self.loader = threading.Thread(target=self._load, name="taperay wave planner")
            self.loader.start()
        return self.loader


WAVE_PLANNER = WavePlanner()


def start_wave_planner() -> threading.Thread:
    """WAVE_PLANNER.start(). The GPU context of a hardware adapter runs it while its kernels
    build, and waits for it before the first frame: running on, it took the GIL from the first
    frames (on a fresh H200 host, a 69 ms frame read 400 ms)."""
    return WAVE_PLANNER.start()


BUILD_COMPANIONS.append(start_wave_planner)


def wave_schedule(tape: Tape, wait: bool = False) -> np.ndarray | None:
    """The instrs buffer of a tape pruned by prune_wave at level 0: its records, then the rows
    of their dependency-step schedule (INSTR_DTYPE; ``_wave_plan``); None when level 0 is pruned
    by prune_tiles' serial walks instead: a tape of non-arithmetic ops, longer than WAVE_RECORDS
    or keeping more than WAVE_SLOTS values alive at once, or while the planner is still being
    compiled (WAVE_PLANNER.start; ``wait``: until it is). Kept per tape content."""
    key = content_key(tape)
    planner = WAVE_PLANNER
    if key not in planner.schedules:
        rows = None
        if 0 < len(tape.instrs) <= WAVE_RECORDS and is_arithmetic(tape, fields=True):
            if planner.jit is None:
                if not wait and not builds_in_background():
                    return None     # (a one-shot command: serial walks, no planner compile to wait for)
                planner.start()
                if not wait:
                    return None     # (not kept: a later call may find the planner ready)
                planner.loader.join()
            code, imm = compact_records(tape)
            plan, _ = planner.jit(code.astype(np.int64), imm.view(np.uint32), OP_READS, WAVE_SLOTS, WAVE_WIDTH,
                                WAVE_AFFINITY)
            if len(plan):
                rows = np.concatenate([tape.instrs, plan.view(INSTR_DTYPE).reshape(-1)])
                rows.flags.writeable = False    # (kept: a buffer synced to it is not compared again)
        if len(planner.schedules) > 64:
            planner.schedules.clear()
        planner.schedules[key] = rows
    return planner.schedules[key]


class GpuPrunedPasses:
    """The pruned passes of one ``GpuWalker`` (runtime/gpu.py), which holds them as its ``pruned``
    and serves their public methods, knobs and counters as its own (``walker.sign_image`` is
    ``walker.pruned.sign_image``; ``walker.arena_words = 0`` sets ``walker.pruned.arena_words``).

    They dispatch through the walker's public plumbing: ``upload``, ``uniforms``,
    ``prepare_outputs``, ``submit`` / ``check_counters`` (the counters read in
    ``last_counters``), ``run_and_read``, ``read_output``, its buffers ``tape_buffers``,
    ``points_buffer``, ``out_f``, ``out_u``, and its unpruned ``evaluate`` / ``field_image`` for
    tapes that do not prune. Public for ``GpuProfiler`` (runtime/gpu.py), which times what they
    dispatch: ``image_passes``, ``points_passes``, ``march_cell_passes``, ``checked_chunk``.

    State, set again by ``reset`` (a new device context after a device loss): the knobs
    ``arena_words`` / ``point_arena_words`` / ``cell_arena_words`` (the arenas of pruned images,
    point sets and cells, grown on overflow), ``wave_max_tiles``, ``pixel_variant_cap`` and
    ``cells_too_large``; the counters ``image_cell_builds``, ``march_cell_builds`` and
    ``register_refusals``; the cells out_u holds for the next frame or image (``frame_cells``,
    ``path_cells``, ``_image_cells``; ``drop_kept_cells``, ``kept_cells_facts``).
    """

    def __init__(self, walker):
        self.walker = walker
        self.reset()

    def reset(self):
        """Forgets what was learnt on the walker's device: the arenas, the kept cells, the cells
        past the binding limit; the counters start from 0."""
        self.arena_words = 0                # pruned images: the arena grown to after an overflow
        self.point_arena_words = 0          # evaluate_pruned: the same
        self.cell_arena_words = 0           # pruned march cells: the same
        self._kept = None                   # (key, descriptor word, ...) of the cells out_u holds
        self.image_cell_builds = 0          # image cells pruned (not kept from an earlier image)
        self.march_cell_builds = 0          # march cells pruned (frames, march_cell_levels, timings, paths)
        self.register_refusals = 0          # pixel passes run again in the tape's own variant
        # the most registers a pruned image's pixel pass runs with (None: what its finest tapes
        # need); lower, the pixels whose tapes need more are refused and the pass runs again in
        # the tape's own variant (register_refusals): the fallback, testable on any tape
        self.pixel_variant_cap: int | None = None
        self._tile_counters = None          # the counters after the last pruned image's tile passes
        self.cells_too_large: set[tuple] = set()   # (content_key of a lowered tape, cells) past the limit
        # prune_wave for a level 0 of at most this many tiles; none on a software rasteriser, whose
        # barriers cost more than the serial walks (lavapipe: level 0 at 4 tiles 29 ms, against 6)
        self.wave_max_tiles = 0 if self.walker.context.info["software"] else WAVE_MAX_TILES

    def _tile_passes(self, tape: Tape, kernel: str, counts: list[int], outside: int = 0) -> list[tuple]:
        """The passes (kernel, invocations, level) of ``kernel`` (prune_tiles / prune_cells /
        prune_image_cells) over tile levels of ``counts`` tiles; level 0 by its prune_wave
        pipeline, a workgroup a tile, when it has at most ``wave_max_tiles`` tiles besides its
        ``outside`` ones (the cells' outside cell: so 32^2 image cells qualify) and ``tape`` a
        schedule (wave_schedule, then written after the records in the instrs buffer)."""
        passes = [(kernel, c, level) for level, c in enumerate(counts)]
        rows = wave_schedule(tape) if counts[0] - outside <= self.wave_max_tiles else None
        if rows is not None:
            self.walker.tape_buffers["instrs"].sync(rows)
            passes[0] = (WAVE_KERNELS[kernel], counts[0], 0)
        return passes

    def _pruned_setup(self, tape: Tape, width: int, height: int, rect, z: float, tiles, sign: bool):
        """(variant, passes, uniforms, arena words) of a pruned image: prune_tiles once per tile
        level, coarse to fine, then pruned_image over 8 x 8 pixel blocks; out_u holds the tile
        headers, an arena of ``self.arena_words`` (shaders/prune.wgsl), then a sign image's
        bits."""
        if width < 1 or height < 1:
            raise TaperayError(f"pruned image: size {width}x{height} must be at least 1x1")
        sizes = tile_levels(tiles)
        variant = self.walker.upload(tape)
        counts = level_tile_counts(sizes, width, height)
        header = PRUNE_HEADER_WORDS * sum(counts)
        limit = self.walker.context.limits["max_storage_buffer_binding_size"] // 4
        if header + len(tape.instrs) + (sign_bit_words(width, height) if sign else 0) > limit:
            raise TaperayError(f"pruned image: tiles {sizes} at {width}x{height} make {sum(counts)} tiles, whose "
                               f"headers alone exceed the adapter's {limit >> 18} MiB binding limit; use larger tiles")
        # the arena grown to after an overflow, else a guess per image (arena_guess)
        guess = arena_guess(tape, counts[0], sum(counts), "prune_tiles")
        bits = sign_bit_words(width, height) if sign else 0
        arena = min(self.arena_words or guess, limit - header - bits)
        n = width * height
        self.walker.prepare_outputs(n, header + arena + bits)
        camera = np.zeros(16, np.float32)
        camera[:len(sizes)] = sizes
        u = self.walker.uniforms(tape, n, width, height, rect=[float(v) for v in rect],
                           extra=(z, len(sizes), 1.0 if sign else 0.0, 0), camera=camera)
        u[20] = arena                       # U.camera[1].x: the arena's size in words
        u[23] = header + arena              # U.camera[1].w: the sign image's bits, after the arena
        self.walker.points_buffer.sync(np.arange(MAX_TILE_LEVELS, dtype=np.float32))   # the levels the passes copy
        blocks = -(-width // 8) * -(-height // 8)
        passes = self._tile_passes(tape, "prune_tiles", counts) + [("pruned_image", 64 * blocks)]
        return variant, passes, u, arena

    def _pruned_image(self, tape: Tape, width: int, height: int, rect, z: float, tiles,
                      sign: bool) -> np.ndarray:
        """The tile levels in one submission, then the pixel pass in the register variant that
        holds the finest tiles' renumbered tapes (_pixel_variant; a pixel refused for want of
        registers has the pass run again in the tape's own) with the image read back in the same
        submission (_image_read: the values in out_f, a sign image's bits in out_u; _image_result
        makes the image of them). When a tile
        found no arena room the tiles are discarded and run again with a larger arena (kept for
        later calls), up to the adapter's binding limit, past which it is a TaperayError. The
        counters after the tile passes stay in ``_tile_counters``."""
        while True:
            variant, passes, u, arena = self._pruned_setup(tape, width, height, rect, z, tiles, sign)
            self.walker.submit(passes[:-1], variant, u)
            self.walker.check_counters(tape)
            c = self.walker.last_counters
            if not c[PRUNE_ARENA_FULL]:
                break
            limit = self.walker.context.limits["max_storage_buffer_binding_size"] // 4
            header = PRUNE_HEADER_WORDS * sum(level_tile_counts(tile_levels(tiles), width, height))
            if header + arena + (sign_bit_words(width, height) if sign else 0) >= limit:
                raise TaperayError(f"{tape.source or 'tape'}: the pruned tapes of tiles {tile_levels(tiles)} at "
                                   f"{width}x{height} need more than the adapter's {limit >> 18} MiB binding "
                                   "limit; use larger tiles or the CPU walker")
            self.arena_words = max(2 * arena, int(c[PRUNE_ARENA]))
        self._tile_counters = c
        return self._pixel_pass(tape, passes[-1:], self._pixel_variant(variant, c[PRUNE_REGS]), variant, u,
                                self._image_read(width, height, sign, int(u[23])))

    def _pixel_pass(self, tape: Tape, passes: list[tuple[str, int]], pixel_variant: int, variant: int,
                    u: np.ndarray, read: tuple) -> np.ndarray:
        """Runs a pixel pass over pruned tapes in ``pixel_variant`` and reads ``read`` back
        (GpuWalker.run_and_read: one submission, one wait); where a pixel was refused for want of
        registers (prune.wgsl packed_pixel), again in the tape's own ``variant``."""
        out = self.walker.run_and_read(tape, passes, pixel_variant, u, read)
        if self.walker.last_counters[PRUNE_REGS_REFUSED] and pixel_variant != variant:
            self.register_refusals += 1
            out = self.walker.run_and_read(tape, passes, variant, u, read)
        return out

    def _image_read(self, width: int, height: int, sign: bool, bits_at: int) -> tuple:
        """What a pixel pass's image reads back (_pixel_pass' ``read``): a sign image's bits in
        out_u from word ``bits_at`` (1 bit a pixel, not a float), else out_f's values."""
        if sign:
            return self.walker.out_u, np.uint32, sign_bit_words(width, height), bits_at
        return self.walker.out_f, np.float32, width * height, 0

    @staticmethod
    def _image_result(width: int, height: int, sign: bool, words: np.ndarray) -> np.ndarray:
        """The image from what _image_read read: a sign image (H, W) bool, else (H, W) float32."""
        if not sign:
            return words.reshape(height, width)
        bx, by = -(-width // 8), -(-height // 8)
        rows = words.view(np.uint8).reshape(by, bx, 8).transpose(0, 2, 1).reshape(8 * by, bx)   # a byte a block row
        return np.unpackbits(rows, axis=1, count=width, bitorder="little")[:height].view(bool)

    def _pixel_variant(self, variant: int, regs: int) -> int:
        """The register variant of a pixel pass over pruned tapes: the smallest holding ``regs``,
        the most registers a finest tile's renumbered tape uses (counted by the pruning), at
        most the tape's own ``variant`` and ``pixel_variant_cap``."""
        chosen = min(variant, variant_for(max(int(regs), 1)))
        return chosen if self.pixel_variant_cap is None else min(chosen, self.pixel_variant_cap)

    @guarded
    def sign_image(self, tape: Tape, width: int, height: int, rect=(-1.0, 1.0, -1.0, 1.0),
                   z: float = 0.0, tiles=PRUNE_TILES, cells=None) -> np.ndarray:
        """(H, W) bool: True where the field is < 0, with field_image's pixel centres. Arithmetic
        tapes are pruned on the GPU (shaders/prune.wgsl) per tile of each level of ``tiles`` (one
        size, or sizes coarse to fine, pixels; each level prunes its parent's pruned tape): tiles
        whose interval is decided are filled without evaluating below them, the others' pixels
        evaluate their finest tile's pruned tape (exact: the values of field_image). With
        ``cells`` (g0, levels), e.g. IMAGE_CELLS, on flat cells over ``rect`` instead, pruned once
        and kept for the images of the same tape after it (_image_cells: panning or zooming in,
        at any size, prunes nothing). Other tapes: field_image < 0."""
        if not is_arithmetic(tape):
            return self.walker.field_image(tape, width, height, rect, z) < 0
        if cells is not None:
            words = self._cells_image(tape, width, height, rect, z, cells, True)
        else:
            words = self._pruned_image(tape, width, height, rect, z, tiles, True)
        return self._image_result(width, height, True, words)

    @guarded
    def field_image_pruned(self, tape: Tape, width: int, height: int, rect=(-1.0, 1.0, -1.0, 1.0),
                           z: float = 0.0, tiles=PRUNE_TILES, cells=None) -> np.ndarray:
        """(H, W) float32 field, every pixel evaluated with its finest tile's pruned tape (tile
        levels as sign_image), or its cell's (``cells`` as sign_image): bit-identical to
        field_image. Non-arithmetic tapes: field_image."""
        if not is_arithmetic(tape):
            return self.walker.field_image(tape, width, height, rect, z)
        if cells is not None:
            values = self._cells_image(tape, width, height, rect, z, cells, False)
        else:
            values = self._pruned_image(tape, width, height, rect, z, tiles, False)
        return self._image_result(width, height, False, values)

    def drop_kept_cells(self):
        """Forgets the pruned cells kept from the last frame or image: the next one on cells
        prunes them again (as after an edit). The walker calls it before a pass that may
        overwrite them (``GpuWalker.encode``)."""
        self._kept = None

    def kept_cells_facts(self) -> dict | None:
        """The cells kept in out_u (GpuWalker.stats' ``kept_cells``): None, or their "kind"
        (frame, image, path) and, for an image's, its pixel pass's "variant"."""
        kept = self._kept        # (frame: (key, desc); path: (key, desc, u); image: ((key, box), desc, variant, tail))
        if kept is None:
            return None
        kind = {2: "frame", 3: "path", 4: "image"}[len(kept)]
        return {"kind": kind, "variant": int(kept[2])} if kind == "image" else {"kind": kind}

    def _held(self) -> tuple:
        """What cells kept in out_u depend on besides their own inputs: the bytes written to the
        walker's tape buffers, and which out_u and points buffers it has (a grown one is new)."""
        w = self.walker
        return w.tape_bytes_written, id(w.out_u.buffer), id(w.points_buffer.buffer)

    def frame_cells(self, tape: Tape, packed: np.ndarray, variant: int, n: int, cells: tuple[int, int]) -> int:
        """The descriptor word (U.extra.x of the _cells kernels) of a frame's march cells for n
        pixels: pruned now (_prune_cells), or kept from the last frame of the same tape bytes,
        settings, cells and size while no other pass has run (a camera that moves re-uses them)."""
        def key():   # (after a pruning, which may grow the buffers)
            return ("frame", id(tape), packed.tobytes(), cells, n, *self._held())
        if self._kept is None or self._kept[0] != key():
            desc = self._prune_cells(tape, packed, variant, n, cells)[0]
            self._kept = (key(), desc)
        return self._kept[1]

    def _cells_image_setup(self, tape: Tape, width: int, height: int, rect, z: float, cells, sign: bool):
        """(variant, passes, uniforms) of an image on flat cells: the cells pruned or kept
        (_image_cells), then cells_image over 8 x 8 pixel blocks."""
        if width < 1 or height < 1:
            raise TaperayError(f"pruned image: size {width}x{height} must be at least 1x1")
        ok = (isinstance(cells, tuple) and len(cells) == 2 and all(isinstance(v, (int, np.integer)) for v in cells)
              and 1 <= cells[0] <= 1024 and 1 <= cells[1] <= MAX_TILE_LEVELS)
        if not ok:
            raise TaperayError(f"image cells must be (g0 in 1..1024, levels in 1..{MAX_TILE_LEVELS}), got {cells!r}")
        cells = (int(cells[0]), int(cells[1]))
        variant = self.walker.upload(tape)
        n = width * height
        desc, pixel_variant, bits_at = self._image_cells(tape, variant, n, rect, z, cells,
                                                         sign_bit_words(width, height))
        u = self.walker.uniforms(tape, n, width, height, rect=[float(v) for v in rect],
                           extra=(0.0, 0.0, 1.0 if sign else 0.0, 0))
        u[12] = desc                        # U.extra.x: the bits of the cell descriptor's word
        u[23] = bits_at                     # U.camera[1].w: the sign image's bits, after the arena
        return pixel_variant, [("cells_image", 64 * -(-width // 8) * -(-height // 8))], u

    def _cells_image(self, tape: Tape, width: int, height: int, rect, z: float, cells, sign: bool) -> np.ndarray:
        """An image on flat cells (sign: decided cells are -1 / 1), read back with its pixel pass
        (as _pruned_image). The pixel pass runs in
        the register variant _image_cells chose; should a pixel find a cell whose tape needs more
        registers (the outside cell, the whole tape, where a pixel centre lies in no grid cell's
        box), the pass is run again in the tape's own variant."""
        pixel_variant, passes, u = self._cells_image_setup(tape, width, height, rect, z, cells, sign)
        return self._pixel_pass(tape, passes, pixel_variant, self.walker.upload(tape), u,
                                self._image_read(width, height, sign, int(u[23])))

    @guarded
    def prune_levels(self, tape: Tape, width: int, height: int, rect=(-1.0, 1.0, -1.0, 1.0),
                     z: float = 0.0, tiles=PRUNE_TILES, sign: bool = False) -> list[dict]:
        """Runs the pruned image of an arithmetic tape and reads back its tile headers: per level,
        the tile size, tiles, tiles decided inside / outside, tiles with a pruned tape and their
        mean length in records and the most registers one uses (renumbered: prune.wgsl
        renumber_registers); plus (in each entry) the arena words the image used."""
        self._pruned_image(tape, width, height, rect, z, tiles, sign)
        sizes = tile_levels(tiles)
        counts = level_tile_counts(sizes, width, height)
        hdr = self.walker.read_output("u", PRUNE_HEADER_WORDS * sum(counts)).reshape(-1, PRUNE_HEADER_WORDS)
        used = int(self._tile_counters[PRUNE_ARENA])
        out, at = [], 0
        for size, count in zip(sizes, counts):
            h = hdr[at:at + count]
            at += count
            cls = h[:, 2]   # prune.wgsl: 0 ambiguous, 1 inside, 2 outside, 3 failed, 4 empty
            taped = cls == 0 if sign else cls <= 2
            out.append(dict(tile=size, tiles=int((cls != 4).sum()), inside=int((cls == 1).sum()),
                            outside=int((cls == 2).sum()), with_tape=int(taped.sum()),
                            mean_length=float(h[taped, 1].mean()) if taped.any() else 0.0,
                     registers=int(h[taped, 3].max()) if taped.any() else 0, arena_words=used))
        return out

    def _point_chunk(self) -> int:
        """Points per evaluate_pruned dispatch: their words, their cells' boxes and headers (finer
        levels: at most 4 cells a point, 16/3 over the levels, plus level 0's) fit the binding
        limit, the index fits a float."""
        limit = self.walker.context.limits["max_storage_buffer_binding_size"] // 4
        return max(1, min(POINT_CHUNK, limit // (POINT_WORDS + 6 * 6 + 3 * 6)))

    def _points_setup(self, tape: Tape, pts: np.ndarray, cells, levels: int):
        """(variant, passes, uniforms, arena words, header words) of the pruned points of one chunk
        (the points buffer written: level table, cell boxes, sorted points): prune_tiles once
        per cell level, coarse to fine, then pruned_points (shaders/prune.wgsl, points mode)."""
        variant = self.walker.upload(tape)
        n = len(pts)
        if cells is None:
            cells = min(POINT_CELLS, max(1, n // POINT_MIN_PER_CELL))
        counts, words, first = point_cells(pts, levels, cells)
        header = PRUNE_HEADER_WORDS * sum(counts)
        limit = self.walker.context.limits["max_storage_buffer_binding_size"] // 4
        if header + len(tape.instrs) > limit or len(words) > limit or sum(counts) >= 1 << 24:
            raise TaperayError(f"evaluate_pruned: {sum(counts)} cells for {n} points exceed the adapter's "
                               f"{limit >> 18} MiB binding limit; use fewer cells")
        self.walker.points_buffer.ensure(4 * len(words))
        self.walker.points_buffer.write(0, words)
        self.walker.points_buffer.mirror = np.zeros(0, np.uint8)    # (the next sync writes everything)
        boxes = words[4:first].reshape(-1, 6)
        filled = int((~(boxes[:, 0] > boxes[:, 3])).sum())
        filled0 = int((~(boxes[:counts[0], 0] > boxes[:counts[0], 3])).sum())
        guess = arena_guess(tape, filled0, filled, "prune_tiles")
        arena = min(self.point_arena_words or guess, limit - header)
        self.walker.prepare_outputs(n, header + arena)
        camera = np.zeros(16, np.float32)
        camera[:len(counts)] = counts       # points mode: the cells of each level
        u = self.walker.uniforms(tape, n, extra=(0.0, len(counts), 2.0, 0), camera=camera)
        u[20] = arena                       # U.camera[1].x: the arena's size in words
        u[21] = first                       # U.camera[1].y: the points' first word
        passes = self._tile_passes(tape, "prune_tiles", counts) + [("pruned_points", n)]
        return variant, passes, u, arena, header

    def _pruned_points(self, tape: Tape, pts: np.ndarray, cells, levels: int) -> np.ndarray:
        """One chunk's values in the caller's order; the arena grown and the points run again when
        a cell found no room (as _pruned_image)."""
        while True:
            variant, passes, u, arena, header = self._points_setup(tape, pts, cells, levels)
            self.walker.submit(passes, variant, u)
            self.walker.check_counters(tape)
            c = self.walker.last_counters
            if not c[PRUNE_ARENA_FULL]:
                return self.walker.read_output("f", len(pts))
            limit = self.walker.context.limits["max_storage_buffer_binding_size"] // 4
            if header + arena >= limit:
                raise TaperayError(f"{tape.source or 'tape'}: the pruned tapes of {len(pts)} points' cells need "
                                   f"more than the adapter's {limit >> 18} MiB binding limit; use fewer cells "
                                   "or GpuWalker.evaluate")
            self.point_arena_words = max(2 * arena, int(c[PRUNE_ARENA]))

    @staticmethod
    def _point_args(cells, levels):
        if cells is not None and not (isinstance(cells, (int, np.integer)) and 1 <= cells <= 1 << 22):
            raise TaperayError(f"evaluate_pruned: cells must be a whole number in 1..{1 << 22}, got {cells!r}")
        if not (isinstance(levels, (int, np.integer)) and 1 <= levels <= MAX_TILE_LEVELS):
            raise TaperayError(f"evaluate_pruned: levels must be 1..{MAX_TILE_LEVELS}, got {levels!r}")

    def checked_chunk(self, points, cells, levels: int, what: str) -> np.ndarray:
        """``points`` as one chunk of evaluate_pruned ((N, 3) float32, contiguous), with ``cells``
        and ``levels`` checked as evaluate_pruned checks them; a TaperayError naming ``what``
        unless 1 <= N <= the points of one dispatch."""
        self._point_args(cells, levels)
        pts = np.ascontiguousarray(point_array(points, what, np.float32))
        if not 1 <= len(pts) <= self._point_chunk():
            raise TaperayError(f"{what}: 1..{self._point_chunk()} points, got {len(pts)}")
        return pts

    @guarded
    def evaluate_pruned(self, tape: Tape, points, cells: int | None = None,
                        levels: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """(N,) float32 values and (N,) uint32 material ids at the (N, 3) points, as evaluate, bit
        for bit. An arithmetic tape is pruned on the GPU (shaders/prune.wgsl) per cell of a grid
        over the points' bounding box: the host sorts the points by cell (counting sort) and finds
        each cell's box (the range of its points); prune_tiles prunes the full tape over each
        level-0 cell's box (``cells`` of them, default min(POINT_CELLS, N / POINT_MIN_PER_CELL),
        shared among the axes the points span), each of ``levels`` - 1 finer levels its parent's
        tape over 4 sub-cells per such axis; pruned_points runs each point on its finest cell's
        tape, a warp's points sharing a cell. Other tapes: evaluate."""
        pts = point_array(points, "evaluate_pruned")
        self._point_args(cells, levels)
        if not is_arithmetic(tape) or len(pts) == 0:
            return self.walker.evaluate(tape, pts)
        pts = np.ascontiguousarray(pts, np.float32)
        chunk = self._point_chunk()
        d = np.concatenate([self._pruned_points(tape, pts[s:s + chunk], cells, levels)
                            for s in range(0, len(pts), chunk)])
        return d, np.zeros(len(pts), np.uint32)

    @guarded
    def prune_levels_points(self, tape: Tape, points, cells: int | None = None, levels: int = 1) -> list[dict]:
        """evaluate_pruned of an arithmetic tape (one chunk of points), then its cells' headers read
        back: per level, the cells, cells with points, decided inside / outside, the mean pruned
        tape length in records over the cells with points and the most registers one uses; plus
        the arena words used."""
        pts = self.checked_chunk(points, cells, levels, "prune_levels_points")
        self.evaluate_pruned(tape, pts, cells, levels)
        _, passes, _, _, _ = self._points_setup(tape, pts, cells, levels)   # (the same cells)
        return [dict(cells=len(h), with_points=int(taped.sum()), inside=int((h[:, 2] == 1).sum()),
                     outside=int((h[:, 2] == 2).sum()),
                     mean_length=float(h[taped, 1].mean()) if taped.any() else 0.0,
                     registers=int(h[taped, 3].max()) if taped.any() else 0, arena_words=used)
                for h, taped, used in self._cell_headers([p[1] for p in passes[:-1]], 0)]

    def _cell_headers(self, counts: list[int], base: int):
        """Per level of points-mode cells (``counts`` of them, headers from out_u word ``base``):
        its (cells, 3) headers, which cells have a pruned tape, the arena words used."""
        hdr = self.walker.read_output("u", PRUNE_HEADER_WORDS * sum(counts), base).reshape(-1, PRUNE_HEADER_WORDS)
        used = int(self.walker.last_counters[PRUNE_ARENA])
        out, at = [], 0
        for count in counts:
            h = hdr[at:at + count]
            at += count
            out.append((h, h[:, 2] <= 2, used))   # prune.wgsl: 0 ambiguous, 1 inside, 2 outside, 3 failed, 4 empty
        return out

    @guarded
    def image_cell_levels(self, tape: Tape, width: int, height: int, rect=(-1.0, 1.0, -1.0, 1.0),
                          z: float = 0.0, cells=IMAGE_CELLS, sign: bool = False) -> list[dict]:
        """Runs the image of an arithmetic tape on flat cells (sign_image / field_image_pruned with
        ``cells``) and reads the cells' headers back: per level, the cells, those decided inside /
        outside, those with a pruned tape, their mean length in records and the most registers one
        uses, plus the arena words used."""
        if not is_arithmetic(tape):
            raise TaperayError(f"{tape.source or 'tape'}: image cells are for arithmetic tapes only")
        self._cells_image(tape, width, height, rect, z, cells, sign)
        counts = march_cells(*image_cell_box(rect, z), *cells, flat=True)[0]
        return [dict(cells=len(h), inside=int((h[:, 2] == 1).sum()), outside=int((h[:, 2] == 2).sum()),
                     with_tape=int(taped.sum()), mean_length=float(h[taped, 1].mean()) if taped.any() else 0.0,
                     registers=int(h[taped, 3].max()) if taped.any() else 0, arena_words=used)
                for h, taped, used in self._cell_headers(counts, 0)]

    @guarded
    def march_cell_levels(self, tape: Tape, settings: RenderSettings | None = None, view: str = "shade",
                          cells=MARCH_CELLS) -> list[dict]:
        """Prunes an arithmetic tape over the cells of its march box (as march does) and reads
        their headers back: per level, the cells, those with a pruned tape (the outside cell's
        empty sub-cells have none), their mean length in records and the most registers one uses,
        plus the arena words used."""
        cells = self.march_cells_for(tape, cells)
        if cells is None:
            raise TaperayError(f"{tape.source or 'tape'}: march cells are for arithmetic tapes only")
        variant = self.walker.upload(tape)
        counts = self._prune_cells(tape, (settings or RenderSettings()).pack(tape, view), variant, 0, cells)[1]
        return [dict(cells=len(h), with_tape=int(taped.sum()),
                     mean_length=float(h[taped, 1].mean()) if taped.any() else 0.0,
                     registers=int(h[taped, 3].max()) if taped.any() else 0, arena_words=used)
                for h, taped, used in self._cell_headers(counts, 0)]

    @staticmethod
    def march_cells_for(tape: Tape, cells) -> tuple[int, int] | None:
        """The (g0, levels) of a pruned march of ``tape``, or None: ``cells`` None (off), "auto"
        (MARCH_CELLS for arithmetic tapes, scene fields allowed (pruning.FIELD_OPS), of at least
        PRUNE_MIN_RECORDS records) or (g0, levels) (any such tape)."""
        if cells is None or not is_arithmetic(tape, fields=True):
            return None
        if isinstance(cells, str) and cells == "auto":
            return MARCH_CELLS if len(tape.instrs) >= PRUNE_MIN_RECORDS else None
        ok = (isinstance(cells, tuple) and len(cells) == 2 and all(isinstance(v, (int, np.integer)) for v in cells)
              and 1 <= cells[0] <= 64 and 1 <= cells[1] <= MAX_TILE_LEVELS)
        if not ok:
            raise TaperayError(f"cells must be None, 'auto' or (g0 in 1..64, levels in 1..{MAX_TILE_LEVELS}), "
                               f"got {cells!r}")
        return int(cells[0]), int(cells[1])

    def _prune_cells(self, tape: Tape, packed: np.ndarray, variant: int, n: int, cells: tuple[int, int],
                     paths: int = 0):
        """Prunes ``tape`` over the cells (march_cells) of the march box in ``packed``
        (_prune_cell_grid): for a frame of n pixels the headers and arena in out_u after the
        pixels' outputs (from word 9n); for the path tracer's ``paths`` (n 0) from word 0, with
        their state's words free after the arena. Returns what _prune_cell_grid does: the cell
        descriptor word in the points buffer (U.extra.x of the _cells kernels) first."""
        self.march_cell_builds += 1
        layout = march_box_cells(packed, cells, 9 * n)
        if paths:
            return self._prune_cell_grid(tape, variant, layout, (PATH_F_WORDS * paths, 0),
                                         f"the march cells {cells} for {paths} paths", "prune_cells",
                                         PATH_U_WORDS * paths)
        return self._prune_cell_grid(tape, variant, layout, (8 * n, n),
                                     f"the march cells {cells} at {n} pixels", "prune_cells")

    def path_cells(self, tape: Tape, packed: np.ndarray, variant: int, paths: int) -> tuple:
        """The path tracer's cells for a wave of ``paths`` paths: (the cells' descriptor word in
        points or None, the cells' layout words for points' start, the first out_u word of the
        paths' state, whether the cells were pruned now); out_f / out_u sized for the state. An
        arithmetic tape of at least PRUNE_MIN_RECORDS records is pruned over its march cells
        (MARCH_CELLS; _prune_cells, into out_u from word 0, the state after the arena), or its
        cells kept from the last call for the same tape bytes, settings and wave while nothing
        else used out_u; other tapes, or cells past the binding limit (remembered), run without."""
        cells = self.march_cells_for(tape, "auto")
        if cells is not None and (content_key(tape), cells) not in self.cells_too_large:
            layout_words = march_box_cells(packed, cells, 0)[1]

            def key():   # what the kept cells depend on
                return ("path", id(tape), packed.tobytes(), paths, *self._held())
            kept = self._kept
            if kept is not None and kept[0] == key():
                return kept[1], layout_words, kept[2], False
            try:
                desc, _, _, _, u_base = self._prune_cells(tape, packed, variant, 0, cells, paths=paths)
            except CellsTooLarge:
                self.cells_too_large.add((content_key(tape), cells))
            else:
                self._kept = (key(), desc, u_base)
                return desc, layout_words, u_base, True
        self.walker.prepare_outputs(PATH_F_WORDS * paths, PATH_U_WORDS * paths)
        self._kept = None                        # (the paths' state overwrites out_u)
        return None, np.zeros(0, np.float32), 0, False

    def _prune_cell_grid(self, tape: Tape, variant: int, layout, outputs: tuple[int, int], what: str,
                         kernel: str, tail: int = 0):
        """Prunes ``tape`` over the cells of ``layout`` (march_cells_cached's (counts, words,
        descriptor word), the words naming ``base``, the headers' first word): ``kernel``
        (prune_cells / prune_image_cells: prune_tiles folding constant operands) once per level
        (points mode) in a submission of its own, the headers and arena in out_u from word
        ``base``, out_f and the accumulator sized for ``outputs`` (their words and texels),
        ``tail`` words of out_u kept free after the arena, the arena grown and the cells run
        again on overflow. Returns the descriptor word, the cells per level, the (passes,
        uniforms) that pruned them, the most registers a finest cell's tape uses and the first
        word after the arena."""
        counts, words, desc = layout
        levels = len(counts)
        base = int(words[desc + 8:desc + 9].view(np.uint32)[0])
        header = PRUNE_HEADER_WORDS * sum(counts)
        limit = self.walker.context.limits["max_storage_buffer_binding_size"] // 4
        if base + header + tail + len(tape.instrs) > limit or len(words) > limit or sum(counts) >= 1 << 24:
            raise CellsTooLarge(f"{what}: {sum(counts)} cells exceed the adapter's {limit >> 18} MiB binding limit; "
                                "use fewer cells or levels")
        self.walker.points_buffer.sync(words)
        kids = counts[1] // counts[0] if levels > 1 else 1
        # (the outside cell's empty sub-cells not counted)
        filled = 1 + sum((counts[0] - 1) * kids ** m for m in range(levels))
        camera = np.zeros(16, np.float32)
        camera[:levels] = counts
        u = self.walker.uniforms(tape, 0, extra=(0.0, levels, 2.0, 0), camera=camera)
        u[22] = base                        # U.camera[1].z: the headers' first word
        passes = self._tile_passes(tape, kernel, counts, outside=1)
        while True:
            guess = arena_guess(tape, counts[0], filled, kernel)
            arena = min(self.cell_arena_words or guess, limit - base - header - tail)
            self.walker.prepare_outputs(outputs[0], base + header + arena + tail, outputs[1])
            u[20] = arena                   # U.camera[1].x: the arena's size in words
            self.walker.submit(passes, variant, u)
            self.walker.check_counters(tape)
            c = self.walker.last_counters
            if not c[PRUNE_ARENA_FULL]:
                return desc, counts, (passes, u), int(c[PRUNE_REGS]), base + header + arena
            if base + header + arena + tail >= limit:
                raise CellsTooLarge(f"{tape.source or 'tape'}: the pruned tapes of {what} need more than the "
                                    f"adapter's {limit >> 18} MiB binding limit; use fewer cells")
            self.cell_arena_words = max(2 * arena, int(c[PRUNE_ARENA]))

    def _image_cells(self, tape: Tape, variant: int, n: int, rect, z: float, cells,
                     bits: int) -> tuple[int, int, int]:
        """The descriptor word of ``tape``'s flat cells (march_cells, flat) over ``rect`` in the
        plane z, pruned into out_u from word 0 (_prune_cell_grid), or kept from an earlier image;
        the register variant of the pixel pass (the smallest that holds every finest cell's
        renumbered registers); the first out_u word after the arena, with room for ``bits``
        words of a sign image's bits (IMAGE_BITS_WORDS kept there, or more when pruning for a
        larger image). Kept while nothing but cells_image (and a frame's passes on its
        own kept cells, which replace these) has run, for the same tape bytes, z and cells and a
        rectangle inside the kept one (so a view that pans or zooms in, at any size, keeps them)."""
        lo, hi = image_cell_box(rect, z)

        def key():   # what kept cells depend on besides their rectangle
            return ("image", id(tape), np.float32(z), cells, *self._held())
        kept = self._kept
        if kept is not None and kept[0][0] == key():
            k_lo, k_hi = kept[0][1]
            inside = all(k_lo[r] <= lo[r] and hi[r] <= k_hi[r] for r in range(2))
            if inside and 4 * (kept[3] + bits) <= self.walker.out_u.capacity:
                self.walker.prepare_outputs(n, 1)
                return kept[1], kept[2], kept[3]
        layout = march_cells_cached(lo, hi, *cells, flat=True)
        desc, _, _, regs, tail_at = self._prune_cell_grid(tape, variant, layout, (n, 0), f"the image cells {cells}",
                                                          "prune_image_cells", max(bits, IMAGE_BITS_WORDS))
        self.image_cell_builds += 1
        self._kept = ((key(), (lo, hi)), desc, self._pixel_variant(variant, regs), tail_at)
        return self._kept[1:]

    @staticmethod
    def on_cells(tape: Tape, passes: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """A frame's passes on the pruned cell tapes: march, surface and light as their _cells
        pipelines; the surface pass only where scene fields' FIELD_RESULT records give materials
        (an arithmetic tape's material is 0 everywhere), its materials from the cells' tapes."""
        materials = bool((tape.instrs["op"] == Op.FIELD_RESULT).any())
        return [(k + "_cells" if k in ("march", "surface", "light") else k, m) for k, m in passes
                if k != "surface" or materials]

    # -- what GpuProfiler (runtime/gpu.py) times: the passes of one request, set up and not run
    def image_passes(self, tape: Tape, width: int, height: int, rect, z: float, tiles, cells, sign: bool,
                     tile_passes_only: bool, levels: int | None) -> tuple[int, list[tuple], np.ndarray]:
        """(variant, passes, uniforms) of a pruned image (sign_image with ``sign``, else
        field_image_pruned), after one run that sizes the arena: on flat ``cells`` (g0, levels)
        where given (the cells pruned or kept, then cells_image), else over ``tiles``. With
        ``tile_passes_only`` the passes that prune alone: the cells' prune_image_cells passes,
        or the prune_tiles passes (with ``levels``, only those of the first ``levels`` tile
        levels)."""
        if cells is not None:
            variant, passes, u = self._cells_image_setup(tape, width, height, rect, z, cells, sign)
            if tile_passes_only:
                layout = march_cells_cached(*image_cell_box(rect, z), *cells, flat=True)
                variant = self.walker.upload(tape)     # (the pruning's, not the pixel pass's)
                passes, u = self._prune_cell_grid(tape, variant, layout, (width * height, 0), "image cells",
                                                  "prune_image_cells")[2]
            return variant, passes, u
        self._pruned_image(tape, width, height, rect, z, tiles, sign)   # sizes the arena
        variant, passes, u, _ = self._pruned_setup(tape, width, height, rect, z, tiles, sign)
        passes[-1] = (*passes[-1], None, self._pixel_variant(variant, self._tile_counters[PRUNE_REGS]))
        if tile_passes_only:
            passes = passes[:-1] if levels is None else passes[:max(1, min(levels, len(passes) - 1))]
        return variant, passes, u

    def points_passes(self, tape: Tape, pts: np.ndarray, cells, levels: int) -> tuple[int, list[tuple], np.ndarray]:
        """(variant, passes, uniforms) of evaluate_pruned over one chunk of points (checked_chunk),
        after one evaluate_pruned that sizes the arena: the cell levels' prune_tiles passes and
        pruned_points, the points buffer written."""
        self.evaluate_pruned(tape, pts, cells, levels)   # sizes the arena
        variant, passes, u, _, _ = self._points_setup(tape, pts, cells, levels)
        return variant, passes, u

    def march_cell_passes(self, tape: Tape, packed: np.ndarray, variant: int, n: int,
                          cells: tuple[int, int]) -> tuple[int, list[tuple], np.ndarray]:
        """A frame's march cells for n pixels pruned now: (their descriptor word, the passes that
        pruned them, their uniforms)."""
        desc, _, (passes, u), _, _ = self._prune_cells(tape, packed, variant, n, cells)
        return desc, passes, u
