"""Dual contouring of a tape's zero set: ``dual_contour`` (``mesh_surface(method="dc")``).

Owns the band, the Hermite data, the cell vertices and the faces:

- The band: a coarse grid of blocks (``BLOCK`` cells a side) is evaluated at its corners; a block
  is kept when its corners change sign or none is farther from the zero set than the block's
  diagonal (times ``LIPSCHITZ_MARGIN``); only the kept blocks' fine nodes are evaluated. The band
  then grows until every sign-change edge has its four cells inside it, so the surface cannot end
  at the band's side. The outer layer of the grid is forced outside (the zero set is closed).
- Hermite data: on every sign-change edge the crossing is found by false-position steps (Illinois),
  each step one batched ``evaluate`` call over all edges, kept ``CROSSING_MARGIN`` of the edge off
  its ends (a surface through a grid node would otherwise give the cells around it one shared
  point), and the walker's ``gradient`` there gives the normal (``_normals``: a shorter step
  where a crease is close).
- Vertices: one per connected surface patch inside a cell, not one per cell. The patches are the
  marching-cubes edge groups, with one fixed rule on ambiguous faces (the inside corners are kept
  apart), which depends on the face alone and so agrees between the two cells sharing it. Each
  vertex minimises its quadratic error sum (n_i . (x - p_i))^2 about the mass point, by an
  eigen-decomposition of A^T A with singular values below ``QEF_TRUNCATION`` of the largest
  dropped, kept inside its cell (an active set: ``_solve_qef``); a vertex left on its cell's side
  is moved onto the zero set by Newton steps within the cell.
- Faces: one quad per sign-change edge through the vertices of its four cells, oriented so its
  normal points from the edge's inside end to its outside end, split into two triangles along the
  diagonal whose triangles face the edge's direction best. Where one patch crosses an ambiguous
  face twice and its neighbour's patch does too, the two quads' shared mesh edge would carry four
  triangles: there a vertex is added on that face for each of the two crossings, and those quads
  become fans around their edge's crossing point, so every mesh edge has exactly two triangles.
- Cleanup: edges shorter than ``COLLAPSE_CELLS`` of a cell (two patches' vertices pressed onto
  one cell corner) are collapsed (``surface_cleanup``), keeping the surface a closed manifold;
  then every vertex farther than ``SNAP_CELLS`` of a cell from the zero set (a QEF point where the
  patch curves) takes up to three Newton steps onto it, each at most a quarter cell, kept where
  it ends closer. Folds, caps and thin flat pairs left where a feature line runs along the grid
  or a part is a cell thin are mended (``surface_cleanup.mend_thin_triangles``; no vertex moves),
  and the short edges that makes (or the moves above made) collapsed, twice at most.

Everything is vectorised over cells and edges (numpy); the tables (256 sign configurations) are
built once at import.
"""
from __future__ import annotations

import time

import numpy as np

from taperay.runtime.tape import Tape, TaperayError

from .surface_cleanup import collapse_short_edges, mend_thin_triangles
from .zero_set import default_walker, no_inside_message, project_to_zero_set, vertex_distances

__all__ = ["dual_contour", "BLOCK", "LIPSCHITZ_MARGIN", "QEF_TRUNCATION"]

BLOCK = 4                 # fine cells along a side of a band block
LIPSCHITZ_MARGIN = 1.0    # a block is kept if no corner is farther than this times its diagonal (a distance
                          # bound reaches no farther; the growth step catches fields that do)
QEF_TRUNCATION = 0.1      # singular values below this fraction of the largest are dropped
CROSSING_STEPS = 8        # false-position steps per sign-change edge
CROSSING_MARGIN = 1e-4    # crossings are kept this fraction of an edge away from its ends
GRADIENT_EPS = 0.01       # central-difference step of the normals, in cells
COLLAPSE_CELLS = 0.05     # edges shorter than this (in cells) are collapsed (surface_cleanup)
SNAP_CELLS = 1e-3         # vertices farther than this (in cells) from the zero set are moved onto it
KINK_ANGLE = 0.01         # radians: a normal turning more than this at a tenth of the step is at a crease

# corner c of a cell sits at offset (c & 1, c >> 1 & 1, c >> 2 & 1); edge e runs from corner
# _E0[e] to _E1[e] = _E0[e] + (1 << _EAX[e])
_CORNER = np.array([[c & 1, c >> 1 & 1, c >> 2 & 1] for c in range(8)], np.int64)
_EDGE_LIST = [(c, c | 1 << a, a) for a in range(3) for c in range(8) if not c >> a & 1]
_E0 = np.array([e[0] for e in _EDGE_LIST])
_E1 = np.array([e[1] for e in _EDGE_LIST])
_EAX = np.array([e[2] for e in _EDGE_LIST])
_EDGE_AT = np.full((3, 8), -1, np.int64)      # (axis, lower corner) -> local edge
_EDGE_AT[_EAX, _E0] = np.arange(12)


def _edge_groups() -> tuple[np.ndarray, np.ndarray]:
    """(256, 12) patch index of each sign-change edge per configuration (-1: no crossing) and the
    (256,) patch counts. Configuration bit c is set when corner c is inside (f < 0)."""
    groups = np.full((256, 12), -1, np.int8)
    counts = np.zeros(256, np.int64)
    for cfg in range(256):
        inside = [cfg >> c & 1 for c in range(8)]
        crossing = [inside[_E0[e]] != inside[_E1[e]] for e in range(12)]
        parent = list(range(12))

        def find(e):
            while parent[e] != e:
                e = parent[e]
            return e

        for a in range(3):
            for side in (0, 1):
                face = [e for e in range(12) if _EAX[e] != a and (_E0[e] >> a & 1) == side and crossing[e]]
                if len(face) == 2:
                    parent[find(face[0])] = find(face[1])
                elif len(face) == 4:      # ambiguous: each inside corner is cut off on its own
                    for c in range(8):
                        if (c >> a & 1) == side and inside[c]:
                            pair = [e for e in face if c in (_E0[e], _E1[e])]
                            parent[find(pair[0])] = find(pair[1])
        roots: dict[int, int] = {}
        for e in range(12):
            if crossing[e]:
                groups[cfg, e] = roots.setdefault(find(e), len(roots))
        counts[cfg] = len(roots)
    return groups, counts


_GROUPS, _COUNTS = _edge_groups()


class _Grid:
    """The fine grid: ``n`` nodes per axis from ``origin`` at spacing ``h``, cells a multiple of
    BLOCK, at least ``pad`` cells of margin around the tape's bounds."""

    def __init__(self, tape: Tape, resolution: int, pad: int):
        lo, hi = np.asarray(tape.bounds, np.float64)
        if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi)) and np.all(hi > lo)):
            raise TaperayError(f"the tape's bounds {tape.bounds.tolist()} do not frame a volume")
        self.h = h = float((hi - lo).max()) / int(resolution)
        cells = np.ceil((hi - lo) / h).astype(np.int64) + 2 * pad
        cells = -(-cells // BLOCK) * BLOCK
        self.blocks = cells // BLOCK
        self.n = cells + 1
        self.origin = (lo + hi) / 2 - cells * h / 2
        self.stride = np.array([self.n[1] * self.n[2], self.n[2], 1], np.int64)

    def ids(self, ijk):
        return ijk @ self.stride

    def ijk(self, ids):
        ids = np.asarray(ids, np.int64)
        return np.stack([ids // self.stride[0], ids // self.stride[1] % self.n[1], ids % self.n[2]], -1)

    def points(self, ijk):
        return self.origin + np.asarray(ijk, np.float64) * self.h


class _Field:
    """The field on the fine grid's nodes, dense float32 (NaN where not evaluated: outside the band)."""

    def __init__(self, grid: _Grid, tape: Tape, walker):
        self.grid, self.tape, self.walker = grid, tape, walker
        self.values = np.full(int(np.prod(grid.n)), np.nan, np.float32)
        self.evaluated = 0

    def sample(self, ijk) -> np.ndarray:
        """The field at grid nodes ``ijk`` (one evaluate call), the grid's outer layer forced
        outside, non-finite values read as outside."""
        g = self.grid
        if not len(ijk):
            return np.zeros(0, np.float32)
        d, _ = self.walker.evaluate(self.tape, g.points(ijk).astype(np.float32))
        d = np.asarray(d, np.float32)
        d = np.where(np.isfinite(d), d, np.float32(g.h))
        outer = ((ijk == 0) | (ijk == g.n - 1)).any(1)
        d[outer] = np.maximum(d[outer], np.float32(g.h / 2))
        self.evaluated += len(ijk)
        return d

    def fill(self, block_mask) -> None:
        """Evaluate every node of the blocks in ``block_mask`` not evaluated yet."""
        cells = np.zeros(tuple(self.grid.n - 1), bool)
        for ax in range(3):
            block_mask = np.repeat(block_mask, BLOCK, axis=ax)
        cells[...] = block_mask
        nodes = np.zeros(tuple(self.grid.n), bool)
        for dx, dy, dz in _CORNER:
            nodes[dx:dx + cells.shape[0], dy:dy + cells.shape[1], dz:dz + cells.shape[2]] |= cells
        new = np.flatnonzero(nodes.ravel() & np.isnan(self.values))
        self.values[new] = self.sample(self.grid.ijk(new))

    def __getitem__(self, ids) -> np.ndarray:
        return self.values[ids].astype(np.float64)


def _initial_blocks(grid: _Grid, field: _Field) -> np.ndarray:
    """(blocks) bool: blocks whose corners change sign or all lie within LIPSCHITZ_MARGIN block
    diagonals of the zero set."""
    nb = grid.blocks
    corners = np.stack(np.meshgrid(*[np.arange(k + 1) for k in nb], indexing="ij"), -1).reshape(-1, 3)
    vals = field.sample(corners * BLOCK).reshape(tuple(nb + 1))
    cv = np.stack([vals[dx:dx + nb[0], dy:dy + nb[1], dz:dz + nb[2]] for dx, dy, dz in _CORNER])
    reach = LIPSCHITZ_MARGIN * np.sqrt(3.0) * BLOCK * grid.h
    return ((cv < 0).any(0) & (cv >= 0).any(0)) | (np.abs(cv).max(0) <= reach)


def _surface_cells(grid: _Grid, field: _Field):
    """Cells with evaluated corners that change sign: (lower-corner ijk, configuration), in id order."""
    vals = field.values.reshape(tuple(grid.n))
    inside = vals < 0
    known = ~np.isnan(vals)
    c = grid.n - 1
    cfg = np.zeros(tuple(c), np.int64)
    ok = np.ones(tuple(c), bool)
    for bit, (dx, dy, dz) in enumerate(_CORNER):
        cfg |= inside[dx:dx + c[0], dy:dy + c[1], dz:dz + c[2]].astype(np.int64) << bit
        ok &= known[dx:dx + c[0], dy:dy + c[1], dz:dz + c[2]]
    cells = np.argwhere(ok & (cfg != 0) & (cfg != 255))
    return cells, cfg[tuple(cells.T)]


def _band(grid: _Grid, field: _Field):
    """Grow the band until the four cells around every sign-change edge lie in it. Returns the
    surface cells (ijk, configuration), sorted by cell id, and the number of band blocks."""
    blocks = _initial_blocks(grid, field)
    while True:
        field.fill(blocks)
        cells, cfg = _surface_cells(grid, field)
        edges = np.unique(_cell_edges(grid, cells, cfg)[2])
        around = _around_cells(grid, edges).reshape(-1, 3) // BLOCK
        missing = ~blocks[tuple(around.T)]
        if not missing.any():
            return cells, cfg, int(blocks.sum())
        blocks[tuple(around[missing].T)] = True


def _cell_edges(grid: _Grid, cells, cfg):
    """The sign-change edges of ``cells``: (cell index, local edge, edge key) per crossing; an edge's
    key is 3 * (its lower node's id) + its axis."""
    ci, le = np.nonzero(_GROUPS[cfg] >= 0)
    lower = grid.ids(cells[ci] + _CORNER[_E0[le]])
    return ci, le, 3 * lower + _EAX[le]


# the four cells around an edge along axis a, counter-clockwise seen from +a: their lower corners
# are the edge's lower node minus du along u = a + 1 and dv along v = a + 2 (mod 3)
_RING = ((1, 1), (0, 1), (0, 0), (1, 0))


def _around_cells(grid: _Grid, keys):
    """(E, 4, 3) lower corners of the four cells around each edge (``_RING`` order)."""
    keys = np.asarray(keys, np.int64)
    axis = keys % 3
    u, v = (axis + 1) % 3, (axis + 2) % 3
    out = np.repeat(grid.ijk(keys // 3)[:, None, :], 4, 1)
    rows = np.arange(len(keys))
    for k, (du, dv) in enumerate(_RING):
        out[rows, k, u] -= du
        out[rows, k, v] -= dv
    return out


def _around_local_edges(axis):
    """(E, 4) the edge's local index in each of its four cells (``_RING`` order)."""
    u, v = (axis + 1) % 3, (axis + 2) % 3
    local = np.empty((len(axis), 4), np.int64)
    for k, (du, dv) in enumerate(_RING):
        local[:, k] = _EDGE_AT[axis, (du << u) | (dv << v)]
    return local


def _crossings(grid: _Grid, field: _Field, keys) -> np.ndarray:
    """The zero crossing on each sign-change edge (E, 3): Illinois false position, one batched
    evaluate per step."""
    axis = keys % 3
    lower = keys // 3
    p0 = grid.points(grid.ijk(lower))
    step = np.zeros((len(keys), 3))
    step[np.arange(len(keys)), axis] = grid.h
    fa = field[lower]
    fb = field[lower + grid.stride[axis]]
    a, b = np.zeros(len(keys)), np.ones(len(keys))
    last = np.zeros(len(keys), np.int8)       # which end moved last: -1 a, +1 b
    for _ in range(CROSSING_STEPS):
        t = np.clip(a - fa * (b - a) / (fb - fa), a, b)
        ft, _ = field.walker.evaluate(field.tape, (p0 + t[:, None] * step).astype(np.float32))
        ft = np.where(np.isfinite(ft), np.asarray(ft, np.float64), grid.h)
        same_a = (ft < 0) == (fa < 0)
        # Illinois: halve the stale end's value when the same end moves twice running
        fb = np.where(same_a & (last == -1), fb / 2, fb)
        fa = np.where(~same_a & (last == 1), fa / 2, fa)
        a, fa = np.where(same_a, t, a), np.where(same_a, ft, fa)
        b, fb = np.where(same_a, b, t), np.where(same_a, fb, ft)
        last = np.where(same_a, -1, 1).astype(np.int8)
    t = np.clip(a - fa * (b - a) / (fb - fa), a, b)
    # a crossing at a node (a surface through a grid node) would put the vertices of all the cells
    # around it on one point: keep each crossing off the ends of its edge
    t = np.clip(t, CROSSING_MARGIN, 1 - CROSSING_MARGIN)
    return p0 + t[:, None] * step


def _normals(grid: _Grid, field: _Field, points, keys) -> np.ndarray:
    """Unit gradients of the field at ``points`` by the walker's central differences, step
    GRADIENT_EPS of a cell; where a crease lies within that step (the gradient at a tenth of the
    step turns by more than KINK_ANGLE) the shorter step's. Where the gradient vanishes: the
    edge's own direction from its inside end to its outside end."""
    def unit(eps):
        g = np.asarray(field.walker.gradient(field.tape, points.astype(np.float32), eps=eps), np.float64)
        ln = np.linalg.norm(g, axis=1)
        ok = np.isfinite(ln) & (ln > 1e-12)
        return g / np.where(ok, ln, 1.0)[:, None], ok

    wide, ok = unit(GRADIENT_EPS * grid.h)
    narrow, ok_narrow = unit(0.1 * GRADIENT_EPS * grid.h)
    crease = ok_narrow & (np.einsum("ij,ij->i", wide, narrow) < np.cos(KINK_ANGLE))
    n = np.where(crease[:, None], narrow, wide)
    ok |= crease
    axis = keys % 3
    fallback = np.zeros_like(n)
    fallback[np.arange(len(keys)), axis] = np.where(field[keys // 3] < 0, 1.0, -1.0)
    return np.where(ok[:, None], n, fallback)


def _truncated_solve(m, r):
    """Batched m^-1 r for symmetric (V, 3, 3) ``m``, eigenvalues below QEF_TRUNCATION^2 of the
    largest dropped (singular values of A below QEF_TRUNCATION of the largest, for m = A^T A)."""
    lam, q = np.linalg.eigh(m)
    keep = lam >= QEF_TRUNCATION ** 2 * lam[:, -1:]
    inv = np.where(keep, 1.0 / np.where(keep, lam, 1.0), 0.0)
    return np.einsum("vij,vj,vkj,vk->vi", q, inv, q, r)


def _solve_qef(vertex, points, normals, lo, hi):
    """Per vertex: the minimiser of sum (n . (x - p))^2 over its crossings within its cell
    [lo, hi], about their mass point (``_truncated_solve``). A coordinate the minimiser leaves the
    cell by is fixed on the cell's side and the rest solved again (an active set, at most three
    rounds), so a crease that grazes the cell is followed inside it. Returns the vertices and
    which of them ended on their cell's boundary."""
    n_vertices = len(lo)
    count = np.bincount(vertex, minlength=n_vertices).astype(np.float64)
    mass = np.stack([np.bincount(vertex, points[:, i], n_vertices) for i in range(3)], 1) / count[:, None]
    nn = normals[:, :, None] * normals[:, None, :]
    ata = np.stack([np.bincount(vertex, nn[:, i, j], n_vertices) for i in range(3) for j in range(3)], 1)
    ata = ata.reshape(-1, 3, 3)
    w = np.einsum("ij,ij->i", normals, points - mass[vertex])
    atb = np.stack([np.bincount(vertex, normals[:, i] * w, n_vertices) for i in range(3)], 1)
    lo, hi = lo - mass, hi - mass
    y = _truncated_solve(ata, atb)
    fixed = np.zeros((n_vertices, 3), bool)
    y_fixed = np.zeros((n_vertices, 3))
    for _ in range(3):
        out = ((y < lo) | (y > hi)) & ~fixed
        rows = np.flatnonzero(out.any(1))
        if not len(rows):
            break
        y_fixed[rows] = np.where(out[rows], np.clip(y[rows], lo[rows], hi[rows]), y_fixed[rows])
        fixed[rows] |= out[rows]
        fix = fixed[rows]
        free = ~fix
        m = ata[rows] * (free[:, :, None] & free[:, None, :])
        # a fixed coordinate's row weighs as much as the free block's largest eigenvalue: kept, and
        # the truncation stays relative to the free block
        weight = np.maximum(np.linalg.eigvalsh(m)[:, -1:], 1e-300)
        m = m + fix[:, :, None] * np.eye(3) * weight[:, :, None]
        r = np.where(fix, weight * y_fixed[rows], atb[rows] - np.einsum("vij,vj->vi", ata[rows], y_fixed[rows] * fix))
        y[rows] = _truncated_solve(m, r)
    inside = np.clip(y, lo, hi)
    return mass + inside, fixed.any(1) | (np.abs(inside - y).max(1) > 0)


def _triangulate_quads(verts, quads, axis_dir):
    """Two triangles per quad (v0 v1 v2 v3, counter-clockwise about ``axis_dir``), split along the
    diagonal whose worse triangle faces ``axis_dir`` better."""
    def facing(tri):
        p = verts[tri]
        n = np.cross(p[:, 1] - p[:, 0], p[:, 2] - p[:, 0])
        ln = np.linalg.norm(n, axis=1)
        return np.einsum("ij,ij->i", n, axis_dir) / np.maximum(ln, 1e-300) * (ln > 0)

    a = [quads[:, [0, 1, 2]], quads[:, [0, 2, 3]]]
    b = [quads[:, [0, 1, 3]], quads[:, [1, 2, 3]]]
    use_a = np.minimum(facing(a[0]), facing(a[1])) >= np.minimum(facing(b[0]), facing(b[1]))
    first = np.where(use_a[:, None], a[0], b[0])
    second = np.where(use_a[:, None], a[1], b[1])
    return np.concatenate([first, second])


def dual_contour(tape: Tape, resolution: int, walker=None, pad: int = 2) -> tuple[np.ndarray, np.ndarray, dict]:
    """The tape's zero set as a closed, manifold, outward-oriented triangle mesh by dual contouring
    on an adaptive band (see the module docstring): (vertices (V, 3) float64, faces (F, 3) int64,
    stats). ``resolution``: cells along the longest side of ``tape.bounds`` (``mesh_surface``
    checks it first: ``surface.check_resolution``); ``pad``: cells of margin at least. ``stats``
    records the grid (nodes per axis, spacing, origin), the nodes evaluated (coarse and band)
    against the full grid's, each stage's seconds, the vertices added on crowded faces and the
    largest ``surface.vertex_distances`` of a vertex."""
    walker = default_walker(walker)
    t0 = time.perf_counter()
    grid = _Grid(tape, resolution, pad)
    field = _Field(grid, tape, walker)
    cells, cfg, n_blocks = _band(grid, field)
    t_band = time.perf_counter()
    if not len(cells):
        if not (field.values < 0).any():
            raise TaperayError(no_inside_message(resolution, field.evaluated, grid.h))
        raise TaperayError(f"dual contouring found no surface at resolution {resolution}: the part's inside is "
                           f"smaller than a grid cell ({grid.h:.3g}); raise the resolution")

    # Hermite data on the sign-change edges
    ci, le, cell_keys = _cell_edges(grid, cells, cfg)
    keys = np.unique(cell_keys)
    cross = _crossings(grid, field, keys)
    normals = _normals(grid, field, cross, keys)
    t_hermite = time.perf_counter()

    # one vertex per patch, placed by its QEF and clamped to its cell
    base = np.concatenate([[0], np.cumsum(_COUNTS[cfg])])
    n_cell_verts = int(base[-1])
    vertex = base[ci] + _GROUPS[cfg[ci], le]
    edge_of = np.searchsorted(keys, cell_keys)
    cell_of_vertex = np.repeat(np.arange(len(cells)), _COUNTS[cfg])
    lo = grid.points(cells[cell_of_vertex])
    verts, clamped = _solve_qef(vertex, cross[edge_of], normals[edge_of], lo, lo + grid.h)
    if clamped.any():
        # the QEF's best point in the cell is still off it: back onto the zero set, within the cell
        moved, _ = project_to_zero_set(tape, verts[clamped], walker, steps=3, max_step=0.5 * grid.h)
        verts[clamped] = np.clip(moved, lo[clamped], lo[clamped] + grid.h)

    # one quad per sign-change edge, counter-clockwise about the edge's axis, then oriented
    axis = keys % 3
    around = grid.ids(_around_cells(grid, keys).reshape(-1, 3)).reshape(-1, 4)
    pos = np.searchsorted(grid.ids(cells), around)
    quads = base[pos] + _GROUPS[cfg[pos], _around_local_edges(axis)]
    lower_inside = field[keys // 3] < 0
    axis_dir = np.zeros((len(keys), 3))
    axis_dir[np.arange(len(keys)), axis] = np.where(lower_inside, 1.0, -1.0)
    quads = np.where(lower_inside[:, None], quads, quads[:, ::-1])

    # mesh edges that four quads would share (one patch crossing an ambiguous face twice on both
    # sides): a vertex on that face per crossing, keyed by the edge's inside end
    a, b = quads, np.roll(quads, -1, axis=1)
    pair = np.minimum(a, b) * n_cell_verts + np.maximum(a, b)
    uniq, inv, cnt = np.unique(pair.ravel(), return_inverse=True, return_counts=True)
    crowded = (cnt[inv] > 2).reshape(quads.shape)
    extra_pts = np.zeros((0, 3))
    mid = np.full(quads.shape, -1, np.int64)
    if crowded.any():
        inside_end = np.where(lower_inside, keys // 3, keys // 3 + grid.stride[axis])
        qi, si = np.nonzero(crowded)
        side_key = np.stack([pair[qi, si], inside_end[qi]], 1)
        skeys, sinv = np.unique(side_key, axis=0, return_inverse=True)
        sinv = sinv.ravel()
        m = len(skeys)
        extra_pts = np.stack([np.bincount(sinv, cross[qi, i], m) for i in range(3)], 1) / np.bincount(sinv, None, m)[:, None]
        mid[qi, si] = len(verts) + sinv
    fan = (mid >= 0).any(1)
    tris = [_triangulate_quads(verts, quads[~fan], axis_dir[~fan])]
    if fan.any():
        fq, fm = quads[fan], mid[fan]
        centre = len(verts) + len(extra_pts) + np.arange(len(fq))
        for i in range(4):
            nxt = fq[:, (i + 1) % 4]
            has = fm[:, i] >= 0
            tris.append(np.stack([centre, fq[:, i], np.where(has, fm[:, i], nxt)], 1))
            tris.append(np.stack([centre, fm[:, i], nxt], 1)[has])
        verts = np.concatenate([verts, extra_pts, cross[fan]])
    else:
        verts = np.concatenate([verts, extra_pts])
    faces = np.concatenate(tris).astype(np.int64)
    # vertices of two patches pressed onto one cell corner can lie 1e-15 cells apart: merged
    verts, faces, collapsed = collapse_short_edges(verts, faces, COLLAPSE_CELLS * grid.h)
    dist = vertex_distances(tape, verts, walker)
    off = np.flatnonzero(dist > SNAP_CELLS * grid.h)     # (a QEF point on a curved patch lies off it)
    if len(off):
        moved, _ = project_to_zero_set(tape, verts[off], walker, steps=3, max_step=0.25 * grid.h)
        moved_dist = vertex_distances(tape, moved, walker)
        closer = moved_dist < dist[off]
        verts[off[closer]] = moved[closer]
        dist[off[closer]] = moved_dist[closer]
    # mending joins vertices that no edge joined (and the moves above can press two together): the
    # short edges that makes are collapsed, and what that leaves thin is mended once more
    mended = {}
    for _ in range(2):
        faces, done = mend_thin_triangles(verts, faces)
        mended = {k: mended.get(k, 0) + n for k, n in done.items()}
        verts, faces, again = collapse_short_edges(verts, faces, COLLAPSE_CELLS * grid.h)
        collapsed += again
        if not again:
            break
        dist = vertex_distances(tape, verts, walker)
    t_mesh = time.perf_counter()

    full = int(np.prod(grid.n))
    stats = {"method": "dc", "grid": grid.n.tolist(), "spacing": grid.h, "origin": grid.origin.tolist(),
             "band_blocks": n_blocks, "evaluated_nodes": field.evaluated, "full_grid_nodes": full,
             "seconds": time.perf_counter() - t0, "band_seconds": t_band - t0,
             "hermite_seconds": t_hermite - t_band, "extract_seconds": t_mesh - t_hermite,
             "face_vertices": int(len(extra_pts)), "collapsed_edges": collapsed, **mended,
             "max_vertex_distance": float(dist.max())}
    return verts, faces, stats
