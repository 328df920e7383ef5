"""Tape -> watertight, oriented triangle surface.

``mesh_surface`` has two methods:

- ``"dc"``: dual contouring on an adaptive band, sharp features kept by a QEF per surface patch
  of a cell, manifold output (solvers.dual_contour owns it); ``taperay mesh``'s default.
- ``"mc"`` (the default here, which simulate and optimize use): the field sampled on the whole
  grid over the tape's bounds (one batched ``evaluate`` call), the zero set extracted by marching
  cubes (scikit-image's Lewiner variant), then each vertex moved onto the zero set by Newton steps
  along the walker's gradient (x <- x - f grad / |grad|^2, each step capped at half a cell); a
  vertex whose move would flip one of its triangles is reverted. Sharp edges are cut by up to about one cell (the vertices lie on
  the surface; the chords between them do not follow an edge that runs across a triangle).

Both report the largest distance of a vertex to the zero set (``vertex_distances``). The optional
packages (scikit-image, trimesh) are imported when a surface is made: the extra ``taperay[sim]``.

Also owns the resolution's check before any work (``check_resolution``): the smallest grid, and the
memory the grid, the surface and (for a simulation) the tetrahedra and the FEM system will need
(``resolution_memory``, an estimate from the sizes measured in docs/SIMULATION.md) against the
memory available now.
"""
from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from taperay.runtime import resources
from taperay.runtime.outputs import write_atomic
from taperay.runtime.tape import Tape, TaperayError

from .dual_contour import dual_contour
from .zero_set import default_walker, no_inside_message, project_to_zero_set, vertex_distances

__all__ = ["Surface", "mesh_surface", "material_names", "check_resolution", "resolution_memory", "DEFAULT_RESOLUTION",
           "MIN_RESOLUTION", "DEFAULT_METHOD", "METHODS",
           # the zero-set helpers, owned by solvers.zero_set
           "default_walker", "project_to_zero_set", "vertex_distances"]

DEFAULT_RESOLUTION = 96     # grid cells along the longest side of the tape's bounds
METHODS = ("dc", "mc")      # dual contouring, marching cubes
DEFAULT_METHOD = "mc"       # the FEM pipeline's: TetGen has failed on a dual-contoured surface (docs/SIMULATION.md)
PAD_CELLS = 2               # cells of margin around the bounds (the outer layer is forced outside)
MIN_RESOLUTION = 4          # fewer cells along the longest side resolve no part

# Memory per item, measured as peak resident memory over the run (2-core EPYC, docs/SIMULATION.md,
# "Checks before work") and rounded up: per grid node (marching cubes: the points, the field, the
# volume; dual contouring: the dense field, masks and configurations, the band's points), per
# surface triangle (vertices, faces, the projection's and distances' evaluations), per tetrahedron
# in TetGen's child, and per entry of an element matrix (COO triplets, CSR, the solver's copies).
GRID_BYTES_PER_NODE = {"mc": 32, "dc": 64}
SURFACE_BYTES_PER_TRIANGLE = {"mc": 250, "dc": 500}
TRIANGLES_PER_BOUNDS_FACE = 2.5   # triangles per cell face of the bounds' surface (1.6-2.2 measured on
                                  # solid parts; a lattice has many more: its estimate is low)
TETS_PER_TRIANGLE = 3.0           # TetGen's tetrahedra per surface triangle: 1.4-1.75 on the heat sink,
                                  # 2.1-3.3 on the cantilever, 6-9 on a sphere, more where TetGen
                                  # refines around short edges (machined_part: 22 at resolution 64)
TETGEN_BYTES_PER_TET = 400
FEM_BYTES_PER_ENTRY = 64


def _need(module: str):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise TaperayError(f"simulation needs the optional package {module!r}: pip install 'taperay[sim]'") from None


def material_names(tape: Tape) -> list[str]:
    """The name of each material id of ``tape`` (index = id): the scene's names, which flatten
    and tape files keep (``Tape.material_names``); a tape without them (a ``.vm`` program) gets
    "default" for id 0 and "material<i>" for the others."""
    if tape.material_names:
        return list(tape.material_names)
    return ["default" if i == 0 else f"material{i}" for i in range(len(tape.materials))]


@dataclass
class Surface:
    """A closed triangle mesh: ``vertices`` (V, 3) float64, ``faces`` (F, 3) int64, outward
    oriented (positive volume). ``stats`` holds how it was made (grid, spacing, seconds,
    max |field| at the vertices). ``unprojected``: marching cubes' vertices before they were moved
    onto the zero set (same faces; a grid-edge surface never intersects itself, so ``tet_mesh``
    meshes it when TetGen fails on the projected one)."""
    vertices: np.ndarray
    faces: np.ndarray
    stats: dict = field(default_factory=dict)
    unprojected: np.ndarray | None = None

    def trimesh(self):
        trimesh = _need("trimesh")
        return trimesh.Trimesh(self.vertices, self.faces, process=False)

    @property
    def volume(self) -> float:
        v = self.vertices[self.faces]
        return float(np.einsum("ij,ij->i", v[:, 0], np.cross(v[:, 1], v[:, 2])).sum() / 6.0)

    @property
    def area(self) -> float:
        v = self.vertices[self.faces]
        return float(0.5 * np.linalg.norm(np.cross(v[:, 1] - v[:, 0], v[:, 2] - v[:, 0]), axis=1).sum())

    @property
    def is_watertight(self) -> bool:
        """trimesh's test: every edge is shared by exactly two faces, with consistent winding."""
        m = self.trimesh()
        return bool(m.is_watertight and m.is_winding_consistent)

    def summary(self) -> dict:
        return {"vertices": int(len(self.vertices)), "triangles": int(len(self.faces)),
                "watertight": self.is_watertight, "volume": self.volume, "area": self.area, **self.stats}

    def save(self, path) -> None:
        """Write the mesh through trimesh (stl, obj, ply, glb, off, ...; by the file's suffix), as
        one ``runtime.outputs.write_atomic``: the old file survives a failure."""
        mesh = self.trimesh()
        kind = Path(path).suffix.lstrip(".").lower()

        def export(tmp: Path) -> None:
            try:
                mesh.export(str(tmp), file_type=kind)
            except (ValueError, KeyError) as e:         # (trimesh's word for a format it cannot write)
                raise TaperayError(f"{path}: trimesh cannot write a surface mesh as "
                                   f"{kind or 'a file without a suffix'} ({e})") from None
        write_atomic(path, export)


def _bounds(tape: Tape) -> tuple[np.ndarray, np.ndarray]:
    lo, hi = np.asarray(tape.bounds, np.float64)
    if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi)) and np.all(hi > lo)):
        raise TaperayError(f"the tape's bounds {tape.bounds.tolist()} do not frame a volume")
    return lo, hi


def _grid(tape: Tape, resolution: int):
    lo, hi = _bounds(tape)
    h = float((hi - lo).max()) / int(resolution)
    n = np.ceil((hi - lo) / h).astype(int) + 1 + 2 * PAD_CELLS
    origin = (lo + hi) / 2 - (n - 1) * h / 2
    return origin, h, n


def resolution_memory(resolution: int, tape: Tape | None = None, method: str = DEFAULT_METHOD,
                      order: int | None = None, components: int = 1) -> int:
    """Bytes of memory a surface (``order`` None) or a simulation (``order`` 1 or 2, ``components``
    1 for heat, 3 for elasticity) at ``resolution`` will need at its peak: an estimate. The grid
    spans ``tape``'s bounds (None: a cube); the surface is assumed to have about as many triangles
    as the bounds' surface has cell faces (``TRIANGLES_PER_BOUNDS_FACE``), the tetrahedra
    ``TETS_PER_TRIANGLE`` per triangle. ``method``: "mc", "dc" or "auto" (dual contouring's need)."""
    if tape is None:
        cells = np.full(3, float(resolution))
    else:
        lo, hi = _bounds(tape)
        cells = np.ceil((hi - lo) / float((hi - lo).max()) * resolution)
    nodes = float(np.prod(cells + 1 + 2 * PAD_CELLS))
    triangles = TRIANGLES_PER_BOUNDS_FACE * 2.0 * (cells[0] * cells[1] + cells[1] * cells[2] + cells[0] * cells[2])
    kind = "mc" if method == "mc" else "dc"
    need = GRID_BYTES_PER_NODE[kind] * nodes + SURFACE_BYTES_PER_TRIANGLE[kind] * triangles
    if order is not None:
        entries = ((4 if order == 1 else 10) * components) ** 2
        tets = TETS_PER_TRIANGLE * triangles
        need = max(need, tets * (TETGEN_BYTES_PER_TET + FEM_BYTES_PER_ENTRY * entries))
    return int(need)


def check_resolution(resolution, tape: Tape | None = None, *, method: str = DEFAULT_METHOD, study=None,
                     order: int | None = None, what: str = "resolution") -> int:
    """Refuse ``resolution`` before any work, with one ``TaperayError`` naming it as ``what`` (the
    CLI says "--resolution"): not a whole number, fewer than ``MIN_RESOLUTION`` cells, or more
    memory than is available now (``resolution_memory``, an estimate, against
    ``runtime.resources.available_memory``; the message gives the largest resolution that fits).
    ``tape``: the grid spans its bounds (None: a cube). ``method``: the surface ("mc", "dc",
    "auto"). ``study`` (a Heat or Elasticity): the tetrahedra and the FEM system of a simulation of
    ``order`` (default: 1 for heat, 2 for elasticity) are counted too. Returns the resolution."""
    if method not in (*METHODS, "auto"):
        raise TaperayError(f"unknown surface method {method!r} (choose from {', '.join(METHODS)}, auto)")
    if isinstance(resolution, float) and resolution.is_integer():
        resolution = int(resolution)
    try:
        resolution = operator.index(resolution)
    except TypeError:
        raise TaperayError(f"{what} {resolution!r}: must be a whole number of grid cells") from None
    if resolution < MIN_RESOLUTION:
        raise TaperayError(f"{what} {resolution}: at least {MIN_RESOLUTION} grid cells along the part's longest "
                           "side are needed")
    components = 1
    if study is not None:
        order = order or (1 if study.kind == "heat" else 2)
        components = 1 if study.kind == "heat" else 3
        if order not in (1, 2):
            raise TaperayError(f"order must be 1 (TET4) or 2 (TET10), got {order!r}")

    def need(r: int) -> int:
        return resolution_memory(r, tape, method, order if study is not None else None, components)

    have = resources.available_memory()
    wanted = need(resolution)
    if wanted <= have:
        return resolution
    fits, over = MIN_RESOLUTION - 1, resolution        # the largest resolution that fits: bisection
    while over - fits > 1:
        mid = (fits + over) // 2
        fits, over = (mid, over) if need(mid) <= have else (fits, mid)
    stage = "the grid and the surface" if study is None else "the grid, the tetrahedra and the FEM system"
    hint = (f"use {what} {fits} or less" if fits >= MIN_RESOLUTION
            else f"even {what} {MIN_RESOLUTION} does not fit; free some memory")
    raise TaperayError(f"{what} {resolution}: {stage} need about {resources.format_bytes(wanted)} of memory "
                       f"(an estimate), and {resources.format_bytes(have)} is available; {hint}")


def sample_grid(tape: Tape, resolution: int, walker=None):
    """The field on the grid nodes: (values (nx, ny, nz) float32, origin, spacing). One batched
    evaluate call; the outer layer is forced outside (positive) so the zero set is closed."""
    walker = default_walker(walker)
    origin, h, n = _grid(tape, resolution)
    axes = [(origin[i] + h * np.arange(n[i])).astype(np.float32) for i in range(3)]
    pts = np.stack(np.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3)
    d, _ = walker.evaluate(tape, pts)
    vol = np.asarray(d, np.float32).reshape(tuple(n))
    vol = np.where(np.isfinite(vol), vol, np.float32(h))
    for ax in range(3):
        sl = [slice(None)] * 3
        for end in (0, -1):
            sl[ax] = end
            vol[tuple(sl)] = np.maximum(vol[tuple(sl)], np.float32(h / 2))
    return vol, origin, h


def _normals(v, f):
    return np.cross(v[f[:, 1]] - v[f[:, 0]], v[f[:, 2]] - v[f[:, 0]])


def mesh_surface(tape: Tape, resolution: int = DEFAULT_RESOLUTION, walker=None, project: bool = True,
                 steps: int = 3, method: str = DEFAULT_METHOD) -> Surface:
    """The tape's zero set as a closed, oriented triangle mesh.

    ``resolution``: grid cells along the longest side of ``tape.bounds`` (cubic cells, at least two
    cells of margin, the outer layer forced outside). ``method``: ``"dc"`` dual contouring
    (solvers.dual_contour: adaptive band, QEF vertices, sharp edges kept, manifold) or ``"mc"``
    marching cubes on the whole grid, with ``project`` its vertices moved onto the zero set by
    ``steps`` Newton steps (``project`` and ``steps`` concern ``"mc"`` only). The field comes from
    ``walker`` (default: the CPU twin) in batched calls. ``stats["max_vertex_distance"]`` is the
    largest ``vertex_distances`` over the vertices. ``check_resolution`` runs first."""
    if method not in METHODS:
        raise TaperayError(f"unknown surface method {method!r} (choose from {', '.join(METHODS)})")
    resolution = check_resolution(resolution, tape, method=method)
    if method == "dc":
        return Surface(*dual_contour(tape, resolution, walker, PAD_CELLS))
    return _marching_cubes(tape, resolution, walker, project, steps)


def _marching_cubes(tape: Tape, resolution: int, walker, project: bool, steps: int) -> Surface:
    measure = _need("skimage.measure")
    walker = default_walker(walker)
    t0 = time.perf_counter()
    vol, origin, h = sample_grid(tape, resolution, walker)
    t_sample = time.perf_counter() - t0
    if not (vol < 0).any():
        raise TaperayError(no_inside_message(resolution, vol.size, h))
    verts, faces, _, _ = measure.marching_cubes(vol, level=0.0, spacing=(h, h, h), allow_degenerate=False,
                                                method="lewiner")
    verts = verts.astype(np.float64) + origin
    faces = faces.astype(np.int64)
    # merge coincident vertices (marching cubes can emit a vertex once per cell side)
    key, inv = np.unique(np.round(verts / (h * 1e-6)).astype(np.int64), axis=0, return_inverse=True)
    if len(key) < len(verts):
        merged = np.zeros((len(key), 3))
        merged[inv.ravel()] = verts
        verts, faces = merged, inv.ravel()[faces]
        faces = faces[(faces[:, 0] != faces[:, 1]) & (faces[:, 1] != faces[:, 2]) & (faces[:, 0] != faces[:, 2])]
    # orient outward: positive enclosed volume
    s = Surface(verts, faces)
    if s.volume < 0:
        faces = faces[:, ::-1].copy()
    t_mc = time.perf_counter() - t0 - t_sample
    grid_verts = verts if project else None
    if project:
        n0 = _normals(verts, faces)
        new, _ = project_to_zero_set(tape, verts, walker, steps=steps, max_step=0.5 * h)
        moved = np.ones(len(verts), bool)
        for _ in range(10):   # revert vertices of triangles that flipped or collapsed, until none do
            n1 = _normals(new, faces)
            bad = np.einsum("ij,ij->i", n0, n1) <= 1e-3 * np.einsum("ij,ij->i", n0, n0)
            if not bad.any():
                break
            back = np.unique(faces[bad])
            back = back[moved[back]]
            if not len(back):
                break
            new[back] = verts[back]
            moved[back] = False
        verts = new
    if not len(faces):
        raise TaperayError(f"marching cubes found no surface at resolution {resolution}: the part's inside is "
                           f"smaller than a grid cell ({h:.3g}); raise the resolution")
    surf = Surface(verts, faces, unprojected=grid_verts)
    surf.stats = {"method": "mc", "grid": list(vol.shape), "spacing": h, "seconds": time.perf_counter() - t0,
                  "sample_seconds": t_sample, "extract_seconds": t_mc,
                  "max_vertex_distance": float(vertex_distances(tape, verts, walker).max())}
    return surf
