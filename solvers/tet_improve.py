"""Tetrahedral mesh improvement after TetGen: slivers and other flat tetrahedra removed by local
operations, as in Klingner and Shewchuk, "Aggressive tetrahedral mesh improvement" (2007), with
the boundary left exactly as it is.

``improve_mesh(nodes, elements, fixed)`` works on a TET4 mesh (positively oriented, as
``tet_mesh`` makes it) and returns a new one. The quality of a tetrahedron is the smallest sine
of its six dihedral angles (``quality``, ``min_sine``): small for slivers, caps, needles and
wedges alike, negative for an inverted one. The elements below each of ``TARGETS`` in turn
(10 degrees) are improved worst first, each by the first of these that raises the
smallest quality of the elements it replaces and leaves no more of them below the target, half
of it or a quarter of it (``MeshRegion.better``):

- edge removal: the tetrahedra around one of its edges (a closed ring of at most ``MAX_RING``)
  replaced by the best triangulation of the ring's polygon joined to the edge's two ends (the
  3-2 flip is the ring of three); an edge on a boundary face has no closed ring and is kept;
- the 2-3 flip: it and its neighbour across an interior face replaced by three tetrahedra around
  the edge joining the two far corners;
- contraction: one of its corners that is not fixed removed, its edge to a neighbour contracted
  onto the neighbour (TetGen leaves interior points 1e-6 apart near the surface);
- smoothing: one of its corners that is not fixed moved by a nonsmooth ascent of the smallest
  quality of the tetrahedra around it (``_smooth_kernel``, Numba);
- vertex insertion: a new interior node at its centroid, the cavity of the tetrahedra whose
  circumspheres hold that point (grown until every face of the cavity sees it, never across a
  boundary face) filled by tetrahedra to the new node, which is then smoothed.

Fixed nodes (the nodes of boundary faces) never move and are never removed, no operation
crosses or makes a boundary face (a face with no tetrahedron behind it is never flipped), every
new tetrahedron is positively oriented and the tetrahedra fill the same region: the boundary
faces stay the surface's triangles and the volume is kept to rounding. The work is local: only
the tetrahedra at the nodes within one ring of the bad ones are taken out (``MeshRegion``, a
mutable mesh of Python dicts), improved, and put back, so a large mesh with few bad elements
costs little more than one vectorised quality sweep.

What it cannot mend: the tetrahedra on a boundary triangle with an angle near 0 or 180 degrees
(dual contouring makes a few, along creases and on flat faces): any tetrahedron on such a face is
flat, whatever its fourth corner.
"""
from __future__ import annotations

import heapq
import math
import time

import numpy as np

from taperay.runtime.jit_cache import njit

__all__ = ["improve_mesh", "MeshRegion", "quality", "min_sine", "TARGETS", "MAX_RING"]

# the elements with a dihedral angle below 10 degrees (or above 170) are worked on. A second pass
# at 15 (targets=(10, 15)) brings the hollow sphere and the cantilever to 15 degrees, but costs three
# times as long (heat sink at resolution 80: 8.2 s against 2.6 s) and leaves as many below 10;
# aiming at 15 at once leaves more below 5 (machined_part at 48: 97 against 41), the operations
# around the slivers that cannot be mended making new ones
TARGETS = (10.0,)
TRIES = 3               # times one tetrahedron is worked on in a pass
MAX_RING = 8            # edge removal: rings of at most this many tetrahedra
ROUNDS = 2              # passes per target, each picking the bad elements afresh (machined_part at 48:
                        # 126 below 10 degrees after one, 115 after two or four)
SMOOTH_STEPS = 12       # ascent steps per vertex smoothing
CAVITY_CAP = 40         # vertex insertion: the most tetrahedra a cavity may take
CONTRACT_NEAREST = 3    # contraction: the neighbours tried (all of them: heat sink at 80, 5.5 of 13 s)

# even permutations of a tetrahedron's corners that put corner i first (the orientation kept), and
# so the face opposite each corner, outward (tetmesh.TET_FACES, which cannot be imported here:
# tetmesh imports this module)
_FIRST = ((0, 1, 2, 3), (1, 0, 3, 2), (2, 0, 1, 3), (3, 0, 2, 1))
_FACES = tuple(p[1:] for p in _FIRST)
# the six edges of a tetrahedron and, for each, the two corners not on it (whose opposite faces meet there)
_EDGES = ((0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3))
_OTHER = ((2, 3), (1, 3), (1, 2), (0, 3), (0, 2), (0, 1))


def min_sine(nodes: np.ndarray, elements: np.ndarray) -> np.ndarray:
    """(E,) the smallest sine of each element's six dihedral angles (negative: inverted), vectorised."""
    x = np.asarray(nodes, float)[np.asarray(elements)[:, :4]]
    vol6 = np.einsum("ij,ij->i", x[:, 1] - x[:, 0], np.cross(x[:, 2] - x[:, 0], x[:, 3] - x[:, 0]))
    area2 = np.stack([np.linalg.norm(np.cross(x[:, b] - x[:, a], x[:, c] - x[:, a]), axis=1)
                      for a, b, c in _FACES], 1)                                # twice each face's area
    out = np.full(len(x), np.inf)
    for (i, j), (k, m) in zip(_EDGES, _OTHER):       # edge ij lies on the faces opposite k and m
        length = np.linalg.norm(x[:, j] - x[:, i], axis=1)
        out = np.minimum(out, vol6 * length / np.maximum(area2[:, k] * area2[:, m], 1e-300))
    return out


@njit(cache=True)
def _norm_cross(x1, y1, z1, x2, y2, z2):
    return math.sqrt((y1 * z2 - z1 * y2) ** 2 + (z1 * x2 - x1 * z2) ** 2 + (x1 * y2 - y1 * x2) ** 2)


@njit(cache=True)
def quality(p, q, r, s):
    """The smallest sine of the dihedral angles of the tetrahedron (p, q, r, s) (3-tuples or
    arrays), or -1 when it is flat or inverted: sin = 3 V l / (2 A A') at an edge of length l
    whose two faces have areas A and A'."""
    ux, uy, uz = q[0] - p[0], q[1] - p[1], q[2] - p[2]
    vx, vy, vz = r[0] - p[0], r[1] - p[1], r[2] - p[2]
    wx, wy, wz = s[0] - p[0], s[1] - p[1], s[2] - p[2]
    vol6 = ux * (vy * wz - vz * wy) + uy * (vz * wx - vx * wz) + uz * (vx * wy - vy * wx)
    if not vol6 > 0.0:
        return -1.0
    ax, ay, az = r[0] - q[0], r[1] - q[1], r[2] - q[2]
    bx, by, bz = s[0] - q[0], s[1] - q[1], s[2] - q[2]
    cx, cy, cz = s[0] - r[0], s[1] - r[1], s[2] - r[2]
    f0 = _norm_cross(ax, ay, az, bx, by, bz)          # twice the areas of the faces opposite p, q, r, s
    f1 = _norm_cross(vx, vy, vz, wx, wy, wz)
    f2 = _norm_cross(ux, uy, uz, wx, wy, wz)
    f3 = _norm_cross(ux, uy, uz, vx, vy, vz)
    if not min(min(f0, f1), min(f2, f3)) > 0.0:
        return 0.0                                    # (a face's area lost to rounding)
    lpq = math.sqrt(ux * ux + uy * uy + uz * uz)
    lpr = math.sqrt(vx * vx + vy * vy + vz * vz)
    lps = math.sqrt(wx * wx + wy * wy + wz * wz)
    lqr = math.sqrt(ax * ax + ay * ay + az * az)
    lqs = math.sqrt(bx * bx + by * by + bz * bz)
    lrs = math.sqrt(cx * cx + cy * cy + cz * cz)
    return vol6 * min(min(lpq / (f2 * f3), lpr / (f1 * f3)), min(min(lps / (f1 * f2), lqr / (f0 * f3)),
                                                               min(lqs / (f0 * f2), lrs / (f0 * f1))))


@njit(cache=True)
def _star_qualities(p, opp, out):
    for i in range(opp.shape[0]):
        out[i] = quality(p, opp[i, 0], opp[i, 1], opp[i, 2])
    return out


@njit(cache=True)
def _smooth_kernel(x0, opp, target, size, steps):
    """Nonsmooth ascent of the smallest quality of the tetrahedra (p, opp[i]) from p = x0: each
    step goes along the least-norm point of the hull of the active elements' gradients (forward
    differences; the steepest ascent of their minimum), halving the step until the minimum rises
    and no more elements lie below ``target``. Returns (p, whether it moved)."""
    k = opp.shape[0]
    p = x0.copy()
    qs = _star_qualities(p, opp, np.empty(k))
    trial_q = np.empty(k)
    grads = np.empty((k, 3))
    h = 1e-7 * size
    moved = False
    for _ in range(steps):
        cur = qs.min()
        below = np.sum(qs < target)
        na = 0
        for i in range(k):
            if qs[i] <= cur + 1e-3:
                for axis in range(3):
                    pp = p.copy()
                    pp[axis] += h
                    grads[na, axis] = (quality(pp, opp[i, 0], opp[i, 1], opp[i, 2]) - qs[i]) / h
                na += 1
        d = grads[0].copy()                           # least-norm point of the hull (Frank-Wolfe)
        for _fw in range(30):
            if na == 1:
                break
            best, j = np.inf, 0
            for i in range(na):
                dot = grads[i, 0] * d[0] + grads[i, 1] * d[1] + grads[i, 2] * d[2]
                if dot < best:
                    best, j = dot, i
            diff = grads[j] - d
            den = diff[0] * diff[0] + diff[1] * diff[1] + diff[2] * diff[2]
            if den < 1e-300:
                break
            t = -(d[0] * diff[0] + d[1] * diff[1] + d[2] * diff[2]) / den
            if t <= 0.0:
                break
            d += min(t, 1.0) * diff
        norm = math.sqrt(d[0] * d[0] + d[1] * d[1] + d[2] * d[2])
        if norm < 1e-12:
            break
        step = 0.5 * size / norm
        went = False
        while step * norm > 1e-6 * size:
            trial = p + step * d
            _star_qualities(trial, opp, trial_q)
            if trial_q.min() > cur and np.sum(trial_q < target) <= below \
                    and np.sum(trial_q < 0.5 * target) <= np.sum(qs < 0.5 * target) \
                    and np.sum(trial_q < 0.25 * target) <= np.sum(qs < 0.25 * target):
                p = trial
                qs[:] = trial_q
                went = moved = True
                break
            step *= 0.5
        if not went:
            break
    return p, moved


def _orient(p, q, r, s) -> float:
    ux, uy, uz = q[0] - p[0], q[1] - p[1], q[2] - p[2]
    vx, vy, vz = r[0] - p[0], r[1] - p[1], r[2] - p[2]
    wx, wy, wz = s[0] - p[0], s[1] - p[1], s[2] - p[2]
    return ux * (vy * wz - vz * wy) + uy * (vz * wx - vx * wz) + uz * (vx * wy - vy * wx)


@njit(cache=True)
def _in_sphere(a, b, c, d, e) -> bool:
    """Whether e lies inside the circumsphere of the positively oriented tetrahedron (a, b, c, d)
    (the 4 x 4 determinant of the corners' offsets from e and their squared lengths, expanded)."""
    ax, ay, az = a[0] - e[0], a[1] - e[1], a[2] - e[2]
    bx, by, bz = b[0] - e[0], b[1] - e[1], b[2] - e[2]
    cx, cy, cz = c[0] - e[0], c[1] - e[1], c[2] - e[2]
    dx, dy, dz = d[0] - e[0], d[1] - e[1], d[2] - e[2]
    ab = ax * by - bx * ay
    bc = bx * cy - cx * by
    cd = cx * dy - dx * cy
    da = dx * ay - ax * dy
    ac = ax * cy - cx * ay
    bd = bx * dy - dx * by
    abc = az * bc - bz * ac + cz * ab
    bcd = bz * cd - cz * bd + dz * bc
    cda = cz * da + dz * ac + az * cd
    dab = dz * ab + az * bd + bz * da
    alift = ax * ax + ay * ay + az * az
    blift = bx * bx + by * by + bz * bz
    clift = cx * cx + cy * cy + cz * cz
    dlift = dx * dx + dy * dy + dz * dz
    return (dlift * abc - clift * dab) + (blift * cda - alift * bcd) < 0.0


_EVEN = {(0, 1, 2, 3), (0, 2, 3, 1), (0, 3, 1, 2), (1, 0, 3, 2), (1, 2, 0, 3), (1, 3, 2, 0),
         (2, 0, 1, 3), (2, 1, 3, 0), (2, 3, 0, 1), (3, 0, 2, 1), (3, 1, 0, 2), (3, 2, 1, 0)}


class MeshRegion:
    """The tetrahedra ``elements`` (rows of node numbers into ``nodes``) as a mutable mesh:
    ``tets`` {id: corner 4-tuple}, ``star`` {node: set of ids}, ``x`` {node: coordinates}.
    Nodes in ``free`` may move or be contracted away (their whole star must be here and they lie
    on no boundary face); inserted nodes are numbered from ``next_node`` on (``new_points``);
    ``target``: the sine of the dihedral angle the operations aim at."""

    def __init__(self, nodes: np.ndarray, elements: np.ndarray, free: set, next_node: int, target: float):
        self.target = target
        self.levels = (0.25 * target, 0.5 * target, target)
        self.tets: dict[int, tuple] = {}
        self.star: dict[int, set] = {}
        self.x: dict[int, tuple] = {}
        self.free = free
        self.next_id = 0
        self.next_node = next_node
        self.new_points: list[int] = []
        for t in elements.tolist():
            self.add(tuple(t))
        for v in self.star:
            self.x[v] = tuple(nodes[v].tolist())

    def add(self, t: tuple) -> int:
        k = self.next_id
        self.next_id += 1
        self.tets[k] = t
        for v in t:
            self.star.setdefault(v, set()).add(k)
        return k

    def remove(self, k: int) -> tuple:
        t = self.tets.pop(k)
        for v in t:
            self.star[v].discard(k)
        return t

    def better(self, old: list[float], new: list[float]) -> bool:
        """Whether qualities ``new`` may replace ``old``: a higher smallest one, and no more of them
        below the target, half of it or a quarter of it (a sliver nudged up a little must not
        leave more bad elements behind)."""
        return min(new) > min(old) and all(sum(q < t for q in new) <= sum(q < t for q in old) for t in self.levels)

    def same_volume(self, old: list[tuple], new: list[tuple]) -> bool:
        """Whether tetrahedra ``new`` fill as much as ``old`` (to 1e-9 of it): with every new one
        positively oriented, a cavity that folded over itself would fill more."""
        x = self.x
        v0, v1 = (sum(_orient(x[t[0]], x[t[1]], x[t[2]], x[t[3]]) for t in ts) for ts in (old, new))
        return abs(v1 - v0) <= 1e-9 * abs(v0)

    def q(self, t: tuple) -> float:
        x = self.x
        return quality(x[t[0]], x[t[1]], x[t[2]], x[t[3]])

    def neighbour(self, k: int, face: tuple) -> int | None:
        """The other tetrahedron on ``face`` (3 nodes of tet k), or None (a boundary face or the region's border)."""
        s = self.star
        other = (s[face[0]] & s[face[1]] & s[face[2]]) - {k}
        return next(iter(other)) if other else None

    def replace(self, old: list[int], new: list[tuple]) -> list[int]:
        for k in old:
            self.remove(k)
        return [self.add(t) for t in new]

    # ---------------------------------------------------------------- operations
    def ring(self, a: int, b: int) -> list[int] | None:
        """The nodes around edge ab in order, such that every (a, b, r_i, r_i+1) is positively
        oriented; None when the ring is open (a boundary edge, or the region's border)."""
        succ = {}
        for k in self.star[a] & self.star[b]:
            t = self.tets[k]
            i, j = t.index(a), t.index(b)
            c, d = [m for m in range(4) if m != i and m != j]
            succ[t[c] if (i, j, c, d) in _EVEN else t[d]] = t[d] if (i, j, c, d) in _EVEN else t[c]
        if len(succ) < 3:
            return None
        start = next(iter(succ))
        out = [start]
        while True:
            nxt = succ.get(out[-1])
            if nxt is None:
                return None
            if nxt == start:
                break
            out.append(nxt)
            if len(out) > len(succ):
                return None
        return out if len(out) == len(succ) else None

    def remove_edge(self, a: int, b: int) -> list[int] | None:
        """Edge removal (module docstring); the new tetrahedra's ids, or None where no
        triangulation raises the ring's smallest quality."""
        r = self.ring(a, b)
        if r is None or len(r) > MAX_RING:
            return None
        m = len(r)
        old = list(self.star[a] & self.star[b])
        before = [self.q(self.tets[k]) for k in old]
        x = self.x
        xa, xb = x[a], x[b]
        tri: dict = {}

        def tq(i, k, j):
            key = (i, k, j)
            if key not in tri:
                p, q_, s = x[r[i]], x[r[k]], x[r[j]]
                tri[key] = min(quality(p, q_, s, xb), quality(p, s, q_, xa))
            return tri[key]
        best = [[math.inf] * m for _ in range(m)]
        cut = [[-1] * m for _ in range(m)]
        for span in range(2, m):
            for i in range(m - span):
                j = i + span
                for k in range(i + 1, j):
                    v = min(best[i][k], best[k][j], tq(i, k, j))
                    if v > best[i][j] or cut[i][j] < 0:
                        best[i][j], cut[i][j] = v, k
        if not best[0][m - 1] > min(before):
            return None
        new, stack = [], [(0, m - 1)]
        while stack:
            i, j = stack.pop()
            if j - i < 2:
                continue
            k = cut[i][j]
            new += [(r[i], r[k], r[j], b), (r[i], r[j], r[k], a)]
            stack += [(i, k), (k, j)]
        if not self.better(before, [self.q(t) for t in new]):
            return None
        return self.replace(old, new)

    def flip23(self, k: int, face: tuple) -> list[int] | None:
        """The 2-3 flip across ``face`` of tet k (module docstring), or None."""
        n = self.neighbour(k, face)
        if n is None:
            return None
        t = self.tets[k]
        d = next(v for v in t if v not in face)
        e = next(v for v in self.tets[n] if v not in face)
        a, b, c = face
        if _orient(self.x[a], self.x[b], self.x[c], self.x[d]) < 0:
            b, c = c, b                                   # (a, b, c, d) positively oriented
        new = [(e, d, a, b), (e, d, b, c), (e, d, c, a)]
        if not self.better([self.q(t), self.q(self.tets[n])], [self.q(s) for s in new]):
            return None
        return self.replace([k, n], new)

    def smooth(self, v: int) -> bool:
        """Move free node v up the smallest quality of its star (``_smooth_kernel``); whether it moved."""
        x = self.x
        opp = self._star(v)[2]
        size = float(np.sqrt(((opp - np.asarray(x[v])) ** 2).sum(2)).min())
        p, moved = _smooth_kernel(np.asarray(x[v], np.float64), opp, self.target, size, SMOOTH_STEPS)
        if moved:
            x[v] = tuple(p.tolist())
        return bool(moved)

    def _star(self, v: int) -> tuple[list[int], np.ndarray, np.ndarray]:
        """The ids of v's star, its tetrahedra's other corners (k, 3) in the order that keeps
        (v, a, b, c) positively oriented, and their coordinates (k, 3, 3)."""
        ks = list(self.star[v])
        others = np.array([[t[j] for j in _FIRST[t.index(v)][1:]] for t in (self.tets[k] for k in ks)])
        x = self.x
        return ks, others, np.array([[x[u] for u in row] for row in others.tolist()])

    def contract(self, v: int) -> list[int] | None:
        """Free node v removed by contracting one of its edges onto the other end w (the
        tetrahedra on the edge dropped, v replaced by w in the rest of its star; the best of its
        ``CONTRACT_NEAREST`` nearest neighbours); the new tetrahedra's ids, or None."""
        ks, others, opp = self._star(v)
        before = [self.q(self.tets[k]) for k in ks]
        trials = []
        link = np.unique(others)
        gap = np.linalg.norm(np.array([self.x[u] for u in link.tolist()]) - np.asarray(self.x[v]), axis=1)
        for w in link[np.argsort(gap)[:CONTRACT_NEAREST]].tolist():
            keep = ~(others == w).any(1)
            if not keep.any():
                continue
            qs = _star_qualities(np.asarray(self.x[w], np.float64), opp[keep], np.empty(int(keep.sum())))
            if qs.min() > min(before):
                trials.append((-qs.min(), w, keep, qs))
        for _, w, keep, qs in sorted(trials, key=lambda trial: trial[0]):
            new = [(w,) + tuple(row) for row in others[keep].tolist()]
            old = [self.tets[k] for k in ks]
            if self.better(before, qs.tolist()) and self.same_volume(old, new):
                ids = self.replace(ks, new)
                self.free.discard(v)
                del self.star[v]
                return ids
        return None

    def insert(self, k: int) -> list[int] | None:
        """Vertex insertion at tet k's centroid (module docstring), or None."""
        t = self.tets[k]
        x = self.x
        p = tuple(sum(x[v][i] for v in t) / 4.0 for i in range(3))
        cavity = {k}
        frontier = [k]
        while frontier:                                  # Bowyer-Watson: circumspheres that hold p
            c = frontier.pop()
            ct = self.tets[c]
            for f in _FACES:
                n = self.neighbour(c, tuple(ct[i] for i in f))
                if n is not None and n not in cavity:
                    nt = self.tets[n]
                    if _in_sphere(x[nt[0]], x[nt[1]], x[nt[2]], x[nt[3]], p):
                        cavity.add(n)
                        frontier.append(n)
                        if len(cavity) > CAVITY_CAP:
                            return None
        while True:                                      # grown until every face sees p
            faces, blocked = [], None
            for c in cavity:
                ct = self.tets[c]
                for f in _FACES:
                    face = tuple(ct[i] for i in f)   # outward
                    n = self.neighbour(c, face)
                    if n in cavity:
                        continue
                    if _orient(x[face[0]], x[face[2]], x[face[1]], p) <= 0:
                        blocked = n if n is not None else -1
                        break
                    faces.append(face)
                if blocked is not None:
                    break
            if blocked is None:
                break
            if blocked < 0 or len(cavity) >= CAVITY_CAP:
                return None
            cavity.add(blocked)
        old = [self.tets[c] for c in cavity]
        before = [self.q(t) for t in old]
        v = self.next_node
        x[v] = p
        ids = self.replace(list(cavity), [(f[0], f[2], f[1], v) for f in faces])
        self.free.add(v)
        self.smooth(v)
        if self.better(before, [self.q(self.tets[i]) for i in ids]) \
                and self.same_volume(old, [self.tets[i] for i in ids]):
            self.next_node += 1
            self.new_points.append(v)
            return ids
        self.replace(ids, old)                           # undone
        self.free.discard(v)
        del x[v], self.star[v]
        return None


def _improve_one(region: MeshRegion, k: int) -> tuple[str, list[int]] | None:
    """The first operation that improves tet k (module docstring): its name and the ids of the
    tetrahedra it made or moved, or None."""
    t = region.tets[k]
    for i, j in _EDGES:
        new = region.remove_edge(t[i], t[j])
        if new:
            return ("edge removal", new)
    for f in _FACES:
        new = region.flip23(k, tuple(t[i] for i in f))
        if new:
            return ("2-3 flip", new)
    for v in t:
        if v in region.free:
            new = region.contract(v)
            if new:
                return ("contraction", new)
    moved = [v for v in t if v in region.free and region.smooth(v)]
    if moved:
        return ("smoothing", list(set().union(*(region.star[v] for v in moved))))
    new = region.insert(k)
    return ("insertion", new) if new else None


def _improve_round(nodes: np.ndarray, el: np.ndarray, q: np.ndarray, on_boundary: np.ndarray, target: float,
                   done: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """One pass over the elements of quality below ``target`` (worst first) in the region around
    them; returns (nodes, elements, qualities, operations done)."""
    bad = np.flatnonzero(q < target)
    if not len(bad):
        return nodes, el, q, 0
    near = np.zeros(len(nodes), bool)
    near[el[bad]] = True
    near[el[near[el].any(1)]] = True                 # the nodes within one ring of the bad elements
    inside = near[el].any(1)                         # every tetrahedron at one of those
    region = MeshRegion(nodes, el[inside], set(np.flatnonzero(near & ~on_boundary).tolist()), len(nodes), target)
    local = np.cumsum(inside) - 1
    heap = [(float(q[b]), int(local[b])) for b in bad]
    heapq.heapify(heap)
    tries: dict[frozenset, int] = {}
    worked = 0
    while heap:
        _, k = heapq.heappop(heap)
        if k not in region.tets:
            continue
        key = frozenset(region.tets[k])
        tries[key] = tries.get(key, 0) + 1
        if tries[key] > TRIES:
            continue
        res = _improve_one(region, k)
        if res is None:
            continue
        name, ids = res
        done[name] = done.get(name, 0) + 1
        worked += 1
        for i in ids:
            if i in region.tets:
                qi = region.q(region.tets[i])
                if qi < target:
                    heapq.heappush(heap, (qi, i))
    moved = [v for v in region.free if v < len(nodes) and v in region.star]
    nodes = nodes.copy()
    nodes[moved] = np.array([region.x[v] for v in moved], np.float64).reshape(-1, 3)
    added = np.array([region.x[v] for v in region.new_points], np.float64).reshape(-1, 3)
    nodes = np.concatenate([nodes, added])
    new = np.array(list(region.tets.values()), np.int64).reshape(-1, 4)
    return (nodes, np.concatenate([el[~inside], new]), np.concatenate([q[~inside], min_sine(nodes, new)]),
            worked)


def improve_mesh(nodes: np.ndarray, elements: np.ndarray, fixed: np.ndarray, targets: tuple = TARGETS,
                 rounds: int = ROUNDS) -> tuple[np.ndarray, np.ndarray, dict]:
    """The TET4 mesh (``nodes``, ``elements``) with its elements whose smallest dihedral angle
    lies below each of ``targets`` (degrees) in turn improved (module docstring), in at most
    ``rounds`` passes each. ``fixed``: (N,) bool, the nodes that stay where they are (the nodes
    of boundary faces). Returns (nodes, elements, stats): the input's nodes in their order, less
    those contracted away, then the new interior nodes; stats: the operations done {name:
    count}, ``nodes_added``, ``nodes_removed``, ``seconds``."""
    t0 = time.perf_counter()
    nodes = np.array(nodes, np.float64)
    n_input = len(nodes)
    el = np.asarray(elements, np.int64)[:, :4]
    on_boundary = np.asarray(fixed, bool)
    q = min_sine(nodes, el)
    done: dict[str, int] = {}
    for degrees in targets:
        for _ in range(rounds):
            nodes, el, q, worked = _improve_round(nodes, el, q, np.concatenate(
                [on_boundary, np.zeros(len(nodes) - n_input, bool)]), math.sin(math.radians(degrees)), done)
            if not worked:
                break
    used = np.unique(el)                             # (contracted nodes dropped)
    remap = np.full(len(nodes), -1, np.int64)
    remap[used] = np.arange(len(used))
    return nodes[used], remap[el], {"operations": done, "nodes_added": int(len(nodes) - n_input),
                                    "nodes_removed": int(len(nodes) - len(used)),
                                    "seconds": time.perf_counter() - t0}
