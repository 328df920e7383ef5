"""``taperay bench surface``: dual contouring against marching cubes at the default resolution.

Cases: a sphere, a box whose faces lie off the grid planes, the same box rotated, and the example
scenes heat_sink and machined_part, each meshed by ``mesh_surface`` with ``method="dc"`` and
``"mc"`` on the CPU twin (``--walker gpu``: the GPU walker). Per row: triangles, whether every edge
has exactly two triangles with consistent winding, the volume's error against the exact volume
(where one is known), the largest vertex distance to the surface (``vertex_distances``, in cells),
for the boxes the largest distance from a box corner to its nearest vertex (in cells: whether the
corners are kept), for dual contouring the share of the grid's nodes evaluated, and the median
time of ``--repeat`` calls (at most 3) after a warm-up.
"""
from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np

from .bench import BenchResult, time_calls

RESOLUTION = 96
HALF = np.array([1.0, 0.6, 0.4])
SHIFT = np.array([0.013, -0.007, 0.004])
AXIS, DEGREES = (1.0, 2.0, 3.0), 27.0
SCENES = Path(__file__).resolve().parent.parent / "scenes"


def _rotation(axis, degrees) -> np.ndarray:
    a = np.asarray(axis, float) / np.linalg.norm(axis)
    k = np.array([[0, -a[2], a[1]], [a[2], 0, -a[0]], [-a[1], a[0], 0]])
    t = np.radians(degrees)
    return np.eye(3) + np.sin(t) * k + (1 - np.cos(t)) * k @ k


def _cases():
    """(label, node, exact volume or None, box frame of a vertex array or None)."""
    from taperay.scenegraph import box, sphere
    from taperay.scenegraph.loading import load_scene_module
    rot = _rotation(AXIS, DEGREES)
    return [("sphere r=1", sphere(1.0), 4 / 3 * np.pi, None),
            ("box 2x1.2x0.8 off the grid", box(*HALF).translate(*SHIFT), float(np.prod(2 * HALF)), lambda v: v - SHIFT),
            ("the box rotated 27 deg", box(*HALF).rotate(AXIS, DEGREES), float(np.prod(2 * HALF)), lambda v: v @ rot),
            ("heat_sink", load_scene_module(SCENES / "heat_sink.py"), None, None),
            ("machined_part", load_scene_module(SCENES / "machined_part.py"), None, None)]


def _closed_manifold(faces) -> bool:
    directed = faces[:, [0, 1, 1, 2, 2, 0]].reshape(-1, 2)
    _, undirected = np.unique(np.sort(directed, 1), axis=0, return_counts=True)
    _, once = np.unique(directed, axis=0, return_counts=True)
    return bool((undirected == 2).all() and (once == 1).all())


def bench_surface(opts) -> BenchResult:
    from taperay.runtime.walkers import walker as choose_walker
    from taperay.scenegraph import flatten
    from taperay.solvers import mesh_surface
    walker = choose_walker(getattr(opts, "walker", "cpu"))
    repeat = max(1, min(opts.repeat, 3))
    corners = np.array([[x, y, z] for x in (-1, 1) for y in (-1, 1) for z in (-1, 1)]) * HALF
    rows = []
    for label, node, volume, box_frame in _cases():
        tape = flatten(node)
        for method in ("dc", "mc"):
            surf = mesh_surface(tape, RESOLUTION, walker, method=method)
            times = time_calls(lambda: mesh_surface(tape, RESOLUTION, walker, method=method), repeat, warmup=0)
            h = surf.stats["spacing"]
            row = {"surface": label, "method": method, "triangles": len(surf.faces),
                   "closed manifold": _closed_manifold(surf.faces),
                   "volume error %": 100 * (surf.volume / volume - 1) if volume else float("nan"),
                   "max vertex distance (cells)": surf.stats["max_vertex_distance"] / h,
                   "corner gap (cells)": float("nan"), "nodes evaluated %": float("nan"),
                   "median s": statistics.median(times)}
            if box_frame is not None:
                v = box_frame(surf.vertices)
                row["corner gap (cells)"] = float(np.linalg.norm(v[None] - corners[:, None], axis=2).min(1).max() / h)
            if method == "dc":
                row["nodes evaluated %"] = 100 * surf.stats["evaluated_nodes"] / surf.stats["full_grid_nodes"]
            rows.append(row)
    return BenchResult(rows, settings={"repeat": repeat, "walker": walker.name},
                       notes=[f"resolution {RESOLUTION} (mesh_surface's default); times: median of {repeat} calls "
                              "after one untimed call",
                              "nan: not applicable (no exact volume, no box corners, marching cubes samples the "
                              "whole grid)"])
