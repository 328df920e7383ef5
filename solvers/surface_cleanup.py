"""A closed triangle surface made fit for TetGen's boundary-preserving mode (``-Y``: the surface's
triangles become the tetrahedra's boundary faces as they are, with no points added on them).

Dual contouring places one vertex per surface patch in a cell; where two patches' vertices are
pressed onto the same cell corner or edge they can lie 1e-15 of a cell apart, joined by an edge of
that length, and TetGen dies on the near-duplicate points (``malloc(): corrupted top size``).
``collapse_short_edges`` merges the two ends of every edge shorter than a tolerance, under the
link condition (the surface stays a closed 2-manifold: the ends' common neighbours are exactly the
two triangles' far corners) and only where no remaining triangle turns over. The merged vertex
takes the position of the end whose faces turn more sharply (a corner or a crease rather than a
flat face), so sharp features stay where dual contouring put them.

``mend_thin_triangles`` then removes the folds, caps and thin triangles that remain where a
feature line runs along the grid (the heat sink's fin roots at resolution 40) or a part is about a
cell thin: a cap (one angle near 180 degrees, its apex on its long edge: a T-junction)
takes the apex into the neighbour across that edge, which is split there (no vertex moves, the
surface changes by the cap's sliver of volume); a thin triangle in a flat pair (normals within
``FLAT_DEGREES``) has the pair's shared edge flipped where that raises the pair's least angle.
A fold (two neighbours whose normals are opposite, one lying inside the other: a flap of no
volume where a cell's vertex sits inside a part thinner than the cell) has its shared edge flipped,
which leaves the larger triangle less the smaller. Caps and folds on the boundary make TetGen's
``-Y`` mesh keep flat tetrahedra on them.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

__all__ = ["collapse_short_edges", "mend_thin_triangles", "triangle_angles"]

_FLIP_COS = 0.1     # a triangle whose normal turns by more than ~84 degrees in a collapse is folded
CAP_DEGREES = 175.0     # a triangle with an angle above this is a cap: its apex lies on its long edge
FLAT_DEGREES = 2.0      # two triangles whose normals differ by less than this are one flat piece
THIN_DEGREES = 5.0      # triangles with a smaller angle are mended where they can be
FOLD_GAP = 1e-3         # a fold's far corner lies within this fraction of the pair's size of the other's plane


def _cross(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cross products of (k, 3) arrays (np.cross's products, without its axis moves)."""
    return np.stack([a[:, 1] * b[:, 2] - a[:, 2] * b[:, 1], a[:, 2] * b[:, 0] - a[:, 0] * b[:, 2],
                     a[:, 0] * b[:, 1] - a[:, 1] * b[:, 0]], axis=1)


def _normals(x: np.ndarray) -> np.ndarray:
    """Unnormalised normals of the (k, 3, 3) triangles ``x``."""
    return _cross(x[:, 1] - x[:, 0], x[:, 2] - x[:, 0])


def _unit_normals(x: np.ndarray) -> np.ndarray:
    """Unit normals of the (k, 3, 3) triangles ``x`` (zero for a degenerate one)."""
    n = _normals(x)
    return n / np.maximum(np.sqrt((n * n).sum(1)), 1e-300)[:, None]


def _sharpness(v: np.ndarray, tris: np.ndarray) -> float:
    """How sharply a vertex's faces turn: 1 - the least cosine between a face normal and their mean."""
    n = _unit_normals(v[tris])
    mean = n.sum(0)
    mean /= max(np.sqrt(mean @ mean), 1e-300)
    return float(1.0 - (n @ mean).min())


def collapse_short_edges(vertices: np.ndarray, faces: np.ndarray, tolerance: float) -> tuple[np.ndarray, np.ndarray, int]:
    """Collapse every edge shorter than ``tolerance`` that can be collapsed safely (module
    docstring), shortest first. Returns (vertices, faces, collapsed edges); unused vertices are
    dropped and faces renumbered. A closed, consistently oriented 2-manifold stays one."""
    v = np.array(vertices, np.float64)
    f = np.array(faces, np.int64)
    edges = np.concatenate([f[:, [0, 1]], f[:, [1, 2]], f[:, [2, 0]]])
    length = np.linalg.norm(v[edges[:, 0]] - v[edges[:, 1]], axis=1)
    short = np.flatnonzero(length < tolerance)
    if not len(short):
        return v, f, 0
    incident: dict[int, set[int]] = defaultdict(set)      # (of the short edges' ends: no other is read)
    for t, corner in zip(*np.nonzero(np.isin(f, np.unique(edges[short])))):
        incident[int(f[t, corner])].add(int(t))
    alive = np.ones(len(f), bool)
    collapsed = 0
    for k in short[np.argsort(length[short])]:
        a, b = (int(x) for x in edges[k])
        if a == b or not incident[a] or not incident[b] or np.linalg.norm(v[a] - v[b]) >= tolerance:
            continue
        shared = incident[a] & incident[b]
        if len(shared) != 2:
            continue
        far = {int(x) for t in shared for x in f[t]} - {a, b}
        ring_a = {int(x) for t in incident[a] for x in f[t]} - {a}
        ring_b = {int(x) for t in incident[b] for x in f[t]} - {b}
        if ring_a & ring_b != far:              # the link condition
            continue
        keep = v[a] if _sharpness(v, f[list(incident[a])]) >= _sharpness(v, f[list(incident[b])]) else v[b]
        if _folds(v, f, (incident[a] | incident[b]) - shared, (a, b), keep):
            continue
        v[a] = keep
        for t in shared:
            alive[t] = False
            for x in f[t]:
                incident[int(x)].discard(t)
        for t in incident[b]:
            f[t][f[t] == b] = a
            incident[a].add(t)
        incident[b] = set()
        collapsed += 1
    f = f[alive]
    used, renumbered = np.unique(f, return_inverse=True)
    return v[used], renumbered.reshape(-1, 3), collapsed


def _folds(v: np.ndarray, f: np.ndarray, tris: set[int], ends: tuple[int, int], to: np.ndarray) -> bool:
    """Whether moving both ``ends`` to ``to`` turns one of ``tris`` over (or flattens it to a line)."""
    if not tris:
        return False
    corners = f[list(tris)]
    before = v[corners]
    after = before.copy()
    after[(corners == ends[0]) | (corners == ends[1])] = to
    nb, na = _normals(before), _normals(after)
    scale = np.sqrt((nb * nb).sum(1)) * np.sqrt((na * na).sum(1))
    return bool(np.any((scale == 0) | ((nb * na).sum(1) <= _FLIP_COS * scale)))


def triangle_angles(x: np.ndarray) -> np.ndarray:
    """(k, 3) angles in degrees at the corners of the (k, 3, 3) triangles ``x``."""
    out = []
    for i in range(3):
        u, w = x[:, (i + 1) % 3] - x[:, i], x[:, (i + 2) % 3] - x[:, i]
        c = _cross(u, w)
        out.append(np.degrees(np.arctan2(np.sqrt((c * c).sum(1)), (u * w).sum(1))))
    return np.stack(out, 1)


class _EditableSurface:
    """A triangle surface that mending changes a few triangles at a time: the input's triangles
    and their edge index as numpy arrays (a closed surface's edges, sorted), the triangles made and
    the edges changed since then in Python lists and a dict (memory only for what changed)."""

    def __init__(self, vertices: np.ndarray, faces: np.ndarray):
        self.v = vertices
        self.faces = [np.asarray(faces, np.int64)]              # the input, then one row per triangle made
        self.alive = np.ones(len(faces), bool).tolist()
        self.n = len(vertices)
        ends = np.sort(np.concatenate([faces[:, [0, 1]], faces[:, [1, 2]], faces[:, [2, 0]]]), 1)
        key = ends[:, 0] * self.n + ends[:, 1]
        order = np.argsort(key, kind="stable")
        self.keys, self.key_tris = key[order], np.tile(np.arange(len(faces)), 3)[order]
        self.changed: dict[int, set[int]] = {}
        self.made: list[int] = []                              # triangles made, for the caller's queue
        self.removed: set[tuple] = set()                       # (sorted corners of the triangles removed)

    def tri(self, t: int) -> list[int]:
        base = len(self.faces[0])
        return self.faces[0][t].tolist() if t < base else self.faces[t - base + 1]

    def edge_tris(self, a: int, b: int) -> set[int]:
        key = min(a, b) * self.n + max(a, b)
        if key in self.changed:
            return self.changed[key]
        lo, hi = np.searchsorted(self.keys, [key, key + 1])
        return set(self.key_tris[lo:hi].tolist())

    def across(self, t: int, a: int, b: int) -> int | None:
        """The one other triangle on edge (a, b) of ``t``, or None."""
        others = self.edge_tris(a, b) - {t}
        return next(iter(others)) if len(others) == 1 else None

    def has_edge(self, a: int, b: int) -> bool:
        return bool(self.edge_tris(a, b))

    def _edges(self, tri: list[int]):
        for i in range(3):
            a, b = tri[i], tri[(i + 1) % 3]
            key = min(a, b) * self.n + max(a, b)
            yield key, self.edge_tris(a, b)

    def fresh(self, new: list[list[int]]) -> bool:
        """Whether none of the triangles ``new`` was removed before (mending never makes a
        triangle again, so it cannot go round in circles: caps along a line of vertices could)."""
        return not any(tuple(sorted(tri)) in self.removed for tri in new)

    def replace(self, old: tuple[int, int], new: list[list[int]]) -> None:
        for t in old:
            self.alive[t] = False
            self.removed.add(tuple(sorted(self.tri(t))))
            for key, tris in self._edges(self.tri(t)):
                self.changed[key] = tris - {t}
        for tri in new:
            t = len(self.alive)
            self.faces.append(tri)
            self.alive.append(True)
            for key, tris in self._edges(tri):
                self.changed[key] = tris | {t}
            self.made.append(t)

    def unit_normal(self, tri: list[int]) -> np.ndarray:
        n = _normals(self.v[tri][None])[0]
        return n / max(float(np.sqrt(n @ n)), 1e-300)

    def result(self) -> np.ndarray:
        base = self.faces[0][np.array(self.alive[:len(self.faces[0])], bool)]
        made = [tri for tri, keep in zip(self.faces[1:], self.alive[len(self.faces[0]):]) if keep]
        return np.concatenate([base, np.array(made, np.int64).reshape(-1, 3)])


def mend_thin_triangles(vertices: np.ndarray, faces: np.ndarray) -> tuple[np.ndarray, dict]:
    """Unfold folds, split caps into their neighbours and flip thin triangles' edges in flat pairs
    (module docstring) until no fold is left and no triangle below ``THIN_DEGREES`` can be mended.
    Returns (faces, {"unfolds", "cap_splits", "flips"}); vertices are neither moved nor added, and
    at most 4 F changes are made for F triangles, and no triangle once removed is made again. A
    closed, consistently oriented 2-manifold stays one: an edge that already exists is never made
    again."""
    v = np.asarray(vertices, np.float64)
    faces = np.asarray(faces, np.int64)
    s = _EditableSurface(v, faces)
    flat_cos = np.cos(np.radians(FLAT_DEGREES))
    done = {"unfolds": 0, "cap_splits": 0, "flips": 0}

    def unfold(t: int) -> bool:
        """Flip an edge of ``t`` across which the surface folds back onto itself where one
        triangle of the pair lies inside the other: the pair becomes the larger one less the
        smaller, as two triangles with the larger one's orientation."""
        tri = s.tri(t)
        n_t = s.unit_normal(tri)
        for i in range(3):
            a, b, c = tri[i], tri[(i + 1) % 3], tri[(i + 2) % 3]
            u = s.across(t, a, b)
            if u is None or n_t @ s.unit_normal(s.tri(u)) > -flat_cos:
                continue
            d = next(x for x in s.tri(u) if x != a and x != b)
            span = max(float(np.ptp(v[[a, b, c, d]], axis=0).max()), 1e-300)
            if (c == d or s.has_edge(c, d) or abs(n_t @ (v[d] - v[a])) > FOLD_GAP * span
                    or not (_inside(v, s.tri(u), v[c]) or _inside(v, tri, v[d]))
                    or not s.fresh([[a, d, c], [c, d, b]])):
                continue            # (opposite normals a wall apart are the two sides of a thin part)
            s.replace((t, u), [[a, d, c], [c, d, b]])      # (either way round: the outer one's orientation)
            done["unfolds"] += 1
            return True
        return False

    queue = [int(t) for t in np.flatnonzero(_mendable(s, flat_cos) | _on_folds(s))]
    budget = 4 * len(faces)         # (a bound on the changes, so the loop ends)
    while queue and sum(done.values()) < budget:
        t = queue.pop()
        if s.alive[t] and not unfold(t):
            _mend_one(s, t, flat_cos, done)
        queue.extend(s.made)
        s.made.clear()
    return s.result(), done


def _mendable(s: _EditableSurface, flat_cos: float) -> np.ndarray:
    """(F,) whether ``_mend_one`` may change each of the input's triangles as they stand: a cap,
    or a thin triangle whose flip across its long edge passes ``_mend_one``'s tests (the pair and
    the flipped pair flat, the least angle raised), vectorised: mending looks at these, the folds
    and the triangles its changes make."""
    f = s.faces[0]
    angles = triangle_angles(s.v[f])
    out = angles.max(1) >= CAP_DEGREES
    t = np.flatnonzero((angles.min(1) < THIN_DEGREES) & ~out)
    k = angles[t].argmax(1)
    p, a, b = f[t, k], f[t, (k + 1) % 3], f[t, (k + 2) % 3]
    key = np.minimum(a, b) * s.n + np.maximum(a, b)
    lo = np.minimum(np.searchsorted(s.keys, key), len(s.keys) - 2)
    pair = s.keys[lo + 1] == key                              # (a closed surface: two triangles an edge)
    u = np.where(s.key_tris[lo] == t, s.key_tris[lo + 1], s.key_tris[lo])
    c = f[u].sum(1) - a - b                                   # (u's corner off the edge)
    n_t, n_u = _unit_normals(s.v[f[t]]), _unit_normals(s.v[f[u]])
    new = [np.stack([p, a, c], 1), np.stack([c, b, p], 1)]
    flat = pair & ((n_t * n_u).sum(1) >= flat_cos)
    for tris in new:
        n = _unit_normals(s.v[tris])
        flat &= ((n * n_t).sum(1) >= flat_cos) & ((n * n_u).sum(1) >= flat_cos)
    before = np.minimum(angles[t].min(1), angles[u].min(1))
    after = np.minimum(*(triangle_angles(s.v[tris]).min(1) for tris in new))
    out[t] = flat & (after > 1.01 * before)
    return out


def _mend_one(s: _EditableSurface, t: int, flat_cos: float, done: dict) -> None:
    """Split triangle ``t`` into its neighbour if it is a cap, or flip its long edge if it is
    thin, flat with its neighbour, and the flip raises the pair's least angle."""
    tri = s.tri(t)
    angles = triangle_angles(s.v[tri][None])[0]
    if angles.min() >= THIN_DEGREES:
        return
    k = int(np.argmax(angles))
    p, a, b = tri[k], tri[(k + 1) % 3], tri[(k + 2) % 3]      # apex p, long edge a -> b
    u = s.across(t, a, b)
    if u is None:
        return
    c = next(x for x in s.tri(u) if x != a and x != b)          # u runs b -> a -> c
    if c == p or s.has_edge(p, c) or not s.fresh([[b, p, c], [p, a, c]]):
        return          # (a cap split and a flip make the same two triangles)
    if angles[k] >= CAP_DEGREES:
        s.replace((t, u), [[b, p, c], [p, a, c]])
        done["cap_splits"] += 1
        return
    n_t, n_u = s.unit_normal(tri), s.unit_normal(s.tri(u))
    new = [[p, a, c], [c, b, p]]
    normals = [s.unit_normal(x) for x in new]
    if n_t @ n_u < flat_cos or min(n @ m for n in normals for m in (n_t, n_u)) < flat_cos:
        return
    before = min(angles.min(), triangle_angles(s.v[s.tri(u)][None]).min())
    if triangle_angles(s.v[new]).min() <= 1.01 * before:
        return
    s.replace((t, u), new)
    done["flips"] += 1


def _inside(v: np.ndarray, tri: list[int], x: np.ndarray) -> bool:
    """Whether ``x``, taken into the plane of triangle ``tri``, lies in the triangle or on its sides."""
    p = v[tri]
    e1, e2, r = p[1] - p[0], p[2] - p[0], x - p[0]
    m = np.array([[e1 @ e1, e1 @ e2], [e1 @ e2, e2 @ e2]])
    det = float(np.linalg.det(m))
    if det <= 0.0:
        return False
    s, t = np.linalg.solve(m, [r @ e1, r @ e2])
    eps = 1e-9
    return bool(s >= -eps and t >= -eps and s + t <= 1.0 + eps)


def _on_folds(s: _EditableSurface) -> np.ndarray:
    """(F,) whether each of the input's triangles has a neighbour whose normal is nearly opposite."""
    n = _unit_normals(s.v[s.faces[0]])
    same = s.keys[1:] == s.keys[:-1]
    a, b = s.key_tris[:-1][same], s.key_tris[1:][same]
    folded = (n[a] * n[b]).sum(1) < -np.cos(np.radians(FLAT_DEGREES))
    out = np.zeros(len(n), bool)
    out[a[folded]] = out[b[folded]] = True
    return out
