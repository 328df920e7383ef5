"""Planar sections of a tetrahedral mesh and a field on it: ``section`` cuts the mesh by a plane
normal to a coordinate axis (triangles in the plane, with the field interpolated along the cut
edges), ``plot_section`` draws one as a PNG coloured by the field with a colour bar (matplotlib,
an optional package: the extras ``sim`` and ``test`` carry it).

A TET10 is cut as its eight sub-tetrahedra on the corner and mid-edge nodes (four at the
corners, four around the diagonal between the mid-nodes of edges (0,1) and (2,3)), so the
picture shows the quadratic field at the mid-edge nodes; within each piece the field is linear.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from taperay.runtime.outputs import write_atomic
from taperay.runtime.tape import TaperayError

__all__ = ["Section", "section", "plot_section", "AXES"]

AXES = "xyz"
# the eight TET4 pieces of a TET10 (VTK node order: corners 0-3, mid-nodes 4=01 5=12 6=02 7=03 8=13 9=23)
TET10_PIECES = ((0, 4, 6, 7), (4, 1, 5, 8), (6, 5, 2, 9), (7, 8, 9, 3),
                (4, 9, 5, 6), (4, 9, 6, 7), (4, 9, 7, 8), (4, 9, 8, 5))
_EDGES = ((0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3))


@dataclass
class Section:
    """Triangles of a cut: ``points`` (T, 3, 2) in the plane's coordinates (the other two axes,
    in x-y-z order), ``values`` (T, 3) of the field at them; ``axis`` (0-2) and ``offset`` of the
    plane, ``labels`` the two in-plane axes' names."""
    points: np.ndarray
    values: np.ndarray
    axis: int
    offset: float

    @property
    def labels(self) -> tuple[str, str]:
        a, b = (i for i in range(3) if i != self.axis)
        return AXES[a], AXES[b]

    @property
    def area(self) -> float:
        p = self.points
        e1, e2 = p[:, 1] - p[:, 0], p[:, 2] - p[:, 0]
        return float(0.5 * np.abs(e1[:, 0] * e2[:, 1] - e1[:, 1] * e2[:, 0]).sum())


def _linear_tets(elements: np.ndarray) -> np.ndarray:
    if elements.shape[1] == 4:
        return elements
    return np.concatenate([elements[:, list(p)] for p in TET10_PIECES])


def section(nodes, elements, field, axis: int | str | None = None, offset: float | None = None) -> Section:
    """The cut of the mesh (``nodes`` (N, 3), ``elements`` (E, 4|10)) by the plane x_axis = offset,
    with the nodal ``field`` (N,) interpolated linearly along each cut edge. ``axis``: 0-2 or
    "x" / "y" / "z"; None: the axis whose cut through ``offset`` (default: the middle of the
    mesh's bounds along that axis) has the largest area."""
    nodes = np.asarray(nodes, float)
    field = np.asarray(field, float)
    if field.shape != (len(nodes),):
        raise TaperayError(f"section: the field needs one value per node ({len(nodes)}), got shape {field.shape}")
    if axis is None:
        cuts = [section(nodes, elements, field, k, offset) for k in range(3)]
        return max(cuts, key=lambda s: s.area)
    if isinstance(axis, str):
        if axis.lower() not in AXES:
            raise TaperayError(f"section: axis {axis!r} is none of x, y, z")
        axis = AXES.index(axis.lower())
    lo, hi = nodes[:, axis].min(), nodes[:, axis].max()
    if offset is None:
        offset = 0.5 * (lo + hi)
        offset = 0.0 if abs(offset) < 1e-6 * (hi - lo) else offset     # (a symmetric part: round-off)
    offset = float(offset)
    tets = _linear_tets(np.asarray(elements, np.int64))
    d = nodes[tets, axis] - offset                                           # (T, 4)
    pos = d >= 0
    cut = pos.any(1) & ~pos.all(1)
    tets, d, pos = tets[cut], d[cut], pos[cut]
    others = [i for i in range(3) if i != axis]
    pts, vals, crosses = [], [], []
    for a, b in _EDGES:                                                      # each edge's crossing
        t = d[:, a] / np.where(d[:, a] == d[:, b], 1.0, d[:, a] - d[:, b])
        xa, xb = nodes[tets[:, a]][:, others], nodes[tets[:, b]][:, others]
        pts.append(xa + t[:, None] * (xb - xa))
        vals.append(field[tets[:, a]] + t * (field[tets[:, b]] - field[tets[:, a]]))
        crosses.append(pos[:, a] != pos[:, b])
    pts, vals, crosses = np.stack(pts, 1), np.stack(vals, 1), np.stack(crosses, 1)   # (T, 6, 2) (T, 6) (T, 6)
    count = crosses.sum(1)
    tri_p, tri_v = [], []
    for k in (3, 4):                                                         # a triangle or a quadrilateral
        sel = count == k
        if not sel.any():
            continue
        idx = np.nonzero(crosses[sel])[1].reshape(-1, k)
        p = np.take_along_axis(pts[sel], idx[:, :, None], 1)
        v = np.take_along_axis(vals[sel], idx, 1)
        c = p.mean(1, keepdims=True)                                         # order around the centre
        order = np.argsort(np.arctan2(p[:, :, 1] - c[:, :, 1], p[:, :, 0] - c[:, :, 0]), 1)
        p = np.take_along_axis(p, order[:, :, None], 1)
        v = np.take_along_axis(v, order, 1)
        for tri in ((0, 1, 2),) if k == 3 else ((0, 1, 2), (0, 2, 3)):
            tri_p.append(p[:, list(tri)])
            tri_v.append(v[:, list(tri)])
    if not tri_p:
        raise TaperayError(f"section: the plane {AXES[axis]} = {offset:.6g} misses the mesh "
                           f"({AXES[axis]} spans {lo:.6g} .. {hi:.6g})")
    return Section(np.concatenate(tri_p), np.concatenate(tri_v), axis, offset)


def plot_section(cut: Section, path, label: str = "value", title: str | None = None, cmap: str = "inferno") -> Path:
    """Draw ``cut`` into the PNG ``path`` (another format matplotlib writes by its suffix): triangles
    shaded by the field (Gouraud), a colour bar named ``label``, the in-plane axes labelled; written
    as one ``runtime.outputs.write_atomic`` (the old file survives a failure). Needs matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.tri import Triangulation
    except ImportError:
        raise TaperayError("a section picture needs matplotlib: pip install 'taperay[sim]'") from None
    xy = cut.points.reshape(-1, 2)
    tri = Triangulation(xy[:, 0], xy[:, 1], np.arange(len(xy)).reshape(-1, 3))
    span = np.ptp(xy, 0)
    aspect = float(span[1] / span[0]) if span[0] > 0 else 1.0
    fig, ax = plt.subplots(figsize=(8, max(2.5, min(8, 7 * aspect + 1))), dpi=100)
    try:
        mesh = ax.tripcolor(tri, cut.values.ravel(), shading="gouraud", cmap=cmap)
        ax.set_aspect("equal")
        u, v = cut.labels
        ax.set_xlabel(u)
        ax.set_ylabel(v)
        ax.set_title(title or f"section {AXES[cut.axis]} = {cut.offset:.4g}")
        fig.colorbar(mesh, ax=ax, label=label, shrink=0.9)
        fig.tight_layout()
        path = Path(path)
        write_atomic(path, fig.savefig)
    finally:
        plt.close(fig)
    return path
