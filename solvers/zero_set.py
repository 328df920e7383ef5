"""Walker-side helpers on a tape's zero set, shared by the surface methods and the tet mesher:
the default walker (the CPU twin), Newton projection of points onto the zero set, the first-order
distance of points to it, and the error of a grid on which the part has no inside."""
from __future__ import annotations

import numpy as np

from taperay.runtime.tape import Tape

__all__ = ["default_walker", "project_to_zero_set", "vertex_distances", "no_inside_message"]


def default_walker(walker=None):
    if walker is not None:
        return walker
    from taperay.runtime.cpu import CpuWalker
    return CpuWalker()


def project_to_zero_set(tape: Tape, points, walker=None, steps: int = 3, max_step: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Newton steps onto the tape's zero set: x <- x - f(x) grad / |grad|^2 (batched evaluate and
    gradient calls), each step at most ``max_step`` long. Returns (points, |f| after)."""
    walker = default_walker(walker)
    x = np.asarray(points, np.float64).copy()
    for _ in range(steps):
        d, _ = walker.evaluate(tape, x.astype(np.float32))
        g = np.asarray(walker.gradient(tape, x.astype(np.float32)), np.float64)
        g2 = np.einsum("ij,ij->i", g, g)
        ok = g2 > 1e-12
        step = np.zeros_like(x)
        step[ok] = -(d[ok].astype(np.float64) / g2[ok])[:, None] * g[ok]
        if max_step is not None:
            ln = np.linalg.norm(step, axis=1)
            big = ln > max_step
            step[big] *= (max_step / ln[big])[:, None]
        x += step
    d, _ = walker.evaluate(tape, x.astype(np.float32))
    return x, np.abs(d.astype(np.float64))


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
