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
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

__all__ = ["collapse_short_edges"]

_FLIP_COS = 0.1     # a triangle whose normal turns by more than ~84 degrees in a collapse is folded


def _cross(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cross products of (k, 3) arrays (np.cross's products, without its axis moves)."""
    return np.stack([a[:, 1] * b[:, 2] - a[:, 2] * b[:, 1], a[:, 2] * b[:, 0] - a[:, 0] * b[:, 2],
                     a[:, 0] * b[:, 1] - a[:, 1] * b[:, 0]], axis=1)


def _normals(x: np.ndarray) -> np.ndarray:
    """Unnormalised normals of the (k, 3, 3) triangles ``x``."""
    return _cross(x[:, 1] - x[:, 0], x[:, 2] - x[:, 0])


def _sharpness(v: np.ndarray, tris: np.ndarray) -> float:
    """How sharply a vertex's faces turn: 1 - the least cosine between a face normal and their mean."""
    n = _normals(v[tris])
    n = n / np.maximum(np.sqrt((n * n).sum(1)), 1e-300)[:, None]
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
