"""Walker-side helpers on a tape's zero set, shared by the surface methods and the tet mesher:
the default walker (the CPU twin), the projection of points onto the zero set (Newton steps that
must lower |f|, and for a point they leave off it, the nearest change of sign along its line), the
first-order distance of points to it, and the error of a grid on which the part has no inside."""
from __future__ import annotations

import numpy as np

from taperay.runtime.tape import Tape

__all__ = ["default_walker", "project_to_zero_set", "search_line", "vertex_distances", "no_inside_message"]


def default_walker(walker=None):
    if walker is not None:
        return walker
    from taperay.runtime.cpu import CpuWalker
    return CpuWalker()


def project_to_zero_set(tape: Tape, points, walker=None, steps: int = 3, max_step: float | None = None,
                        tol: float | None = None, directions=None, reach: float | None = None,
                        ) -> tuple[np.ndarray, np.ndarray]:
    """Points moved onto the tape's zero set. Returns (points, |f| after).

    Newton steps x <- x - f grad / |grad|^2 (batched evaluate and gradient calls), each at most
    ``max_step`` long; a step that does not lower |f| is not taken (where two pieces of a union
    or a difference meet inside the part, the gradient of one leads to a ridge of the field, not
    to its zero set). A point whose |f| is still above ``tol`` (default: a thousandth of
    ``max_step``) then takes the zero set nearest to where it started along its line
    ``directions`` (the surface normal of its own sheet; default: its gradient there):
    ``SEARCH_SAMPLES`` samples each way up to ``reach`` (default: ``steps`` x ``max_step``) find
    the first change of sign on either side, the nearer is solved by false position
    (``search_line``, to a thousandth of ``tol``). A point with no change of sign within reach
    keeps the better of its Newton point and its start."""
    walker = default_walker(walker)
    start = np.asarray(points, np.float64)
    x = start.copy()
    d = _values(tape, walker, x)
    for _ in range(steps):
        g = np.asarray(walker.gradient(tape, x.astype(np.float32)), np.float64)
        g2 = np.einsum("ij,ij->i", g, g)
        ok = g2 > 1e-12
        step = np.zeros_like(x)
        step[ok] = -(d[ok] / g2[ok])[:, None] * g[ok]
        if max_step is not None:
            ln = np.linalg.norm(step, axis=1)
            big = ln > max_step
            step[big] *= (max_step / ln[big])[:, None]
        moving = np.flatnonzero(ok)
        if not len(moving):
            break
        trial = x[moving] + step[moving]
        dt = _values(tape, walker, trial)
        better = np.abs(dt) < np.abs(d[moving])
        x[moving[better]] = trial[better]
        d[moving[better]] = dt[better]
    if tol is None:
        tol = 1e-3 * max_step if max_step is not None else 0.0
    reach = steps * max_step if reach is None and max_step is not None else reach
    stuck = np.flatnonzero(np.abs(d) > tol)
    if len(stuck) and reach:
        if directions is None:
            line = np.asarray(walker.gradient(tape, start[stuck].astype(np.float32)), np.float64)
        else:
            line = np.asarray(directions, np.float64)[stuck]
        found, fx = search_line(tape, start[stuck], line, reach, walker, 1e-3 * tol)
        keep = np.abs(fx) < np.abs(d[stuck])
        x[stuck[keep]] = found[keep]
        d[stuck[keep]] = fx[keep]
    return x, np.abs(d)


SEARCH_SAMPLES = 8      # samples each way along a line in ``search_line``
FALSE_POSITION_STEPS = 40


def search_line(tape: Tape, start, directions, reach: float, walker=None, tol: float = 0.0, both_ways: bool = True
                ) -> tuple[np.ndarray, np.ndarray]:
    """The zero set nearest to each start point along its line ``start + t direction``, 0 < |t| <=
    ``reach`` (t > 0 only unless ``both_ways``): ``SEARCH_SAMPLES`` samples each way (one batched
    evaluate) find the first change of sign from the start's on each side; the nearer bracket is
    solved by false position (Illinois; batched, until |f| <= ``tol`` or ``FALSE_POSITION_STEPS``).
    A line with no change of sign within reach returns its start. Returns (points, f there)."""
    walker = default_walker(walker)
    start = np.asarray(start, np.float64)
    u = np.asarray(directions, np.float64)
    u = u / np.maximum(np.linalg.norm(u, axis=1, keepdims=True), 1e-300)
    n, k = len(start), SEARCH_SAMPLES
    ways = (1.0, -1.0) if both_ways else (1.0,)
    # t = 0 (the start) then k samples out, per way: (ways, k + 1)
    t = np.array([w * reach * np.arange(k + 1) / k for w in ways])
    f0 = _values(tape, walker, start)
    out_pts = start[:, None, None] + t[None, :, 1:, None] * u[:, None, None]
    ft = np.concatenate([np.broadcast_to(f0[:, None, None], (n, len(ways), 1)),
                         _values(tape, walker, out_pts.reshape(-1, 3)).reshape(n, len(ways), k)], 2)
    crossed = ft[:, :, 1:] * np.sign(f0)[:, None, None] <= 0
    first = np.where(crossed.any(2), crossed.argmax(2) + 1, k + 1)          # (n, ways): sample index
    way = first.argmin(1)
    idx = first[np.arange(n), way]
    rows = np.flatnonzero((idx <= k) & (f0 != 0))
    way, idx = way[rows], idx[rows]
    ta, fa = t[way, idx - 1], ft[rows, way, idx - 1]          # the bracket: the sample before the change
    tb, fb = t[way, idx], ft[rows, way, idx]                  # and the first one past it
    ts, fs = tb.copy(), fb.copy()
    live = np.abs(fb) > tol
    for _ in range(FALSE_POSITION_STEPS):
        if not live.any():
            break
        i = np.flatnonzero(live)
        tm = (ta[i] * fb[i] - tb[i] * fa[i]) / (fb[i] - fa[i])
        fm = _values(tape, walker, start[rows[i]] + tm[:, None] * u[rows[i]])
        flip = fm * fb[i] < 0            # the zero lies between tm and the latest end: that end is kept,
        ta[i] = np.where(flip, tb[i], ta[i])        # else the kept end's value is halved (Illinois)
        fa[i] = np.where(flip, fb[i], 0.5 * fa[i])
        tb[i], fb[i] = tm, fm
        ts[i], fs[i] = tm, fm
        live[i] = np.abs(fm) > tol
    out, fout = start.copy(), f0.copy()
    out[rows] = start[rows] + ts[:, None] * u[rows]
    fout[rows] = fs
    return out, fout


def _values(tape: Tape, walker, points) -> np.ndarray:
    """The field at ``points`` as float64 (one batched evaluate in float32)."""
    d, _ = walker.evaluate(tape, np.asarray(points, np.float32))
    return np.asarray(d, np.float64)


def vertex_distances(tape: Tape, points, walker=None) -> np.ndarray:
    """The distance of each point to the tape's zero set to first order: |f| / max(|grad f|, 1)
    (batched evaluate and gradient calls). For a distance field (|grad f| <= 1) that is |f|, which
    stays finite where the gradient vanishes (the medial plane of a part thinner than the
    gradient's step); a steeper field is scaled by its gradient."""
    walker = default_walker(walker)
    pts = np.asarray(points, np.float32)
    if not len(pts):
        return np.zeros(0)
    d, _ = walker.evaluate(tape, pts)
    g = np.linalg.norm(np.asarray(walker.gradient(tape, pts), np.float64), axis=1)
    return np.abs(np.asarray(d, np.float64)) / np.maximum(g, 1.0)


def no_inside_message(resolution: int, nodes: int, spacing: float) -> str:
    """The error of a grid on which the part has no inside (both surface methods raise it)."""
    return (f"nothing to mesh: the part has no inside on the grid (all {nodes:,} points sampled at resolution "
            f"{resolution}, spacing {spacing:.3g}, lie outside it); the scene is empty (a difference or "
            "intersection that removes everything?) or thinner than a grid cell (raise the resolution)")
