"""Closed surface -> tetrahedra (TET4 / TET10) through TetGen, in a child process.

TetGen comes from the PyPI ``tetgen`` package (MIT wrapper around TetGen's own AGPL-3.0 source):
the optional extra ``taperay[sim]``. It runs in a child Python process (solvers._tetgen_child): a
self-intersecting surface can abort TetGen's process outright (``malloc(): invalid size``, exit
134). On failure the surface is repaired with pymeshfix (also in a child) and meshed once more;
if that fails too, ``tet_mesh`` raises one TaperayError naming both causes.

Node order of a TET10 here is VTK's (meshio "tetra10"): corners 0-3, then mid-edge nodes of the
edges (0,1), (1,2), (0,2), (0,3), (1,3), (2,3). TetGen's ``order=2`` columns 4-9 are the edges
(2,3), (0,3), (0,1), (1,2), (1,3), (0,2); ``tet_mesh`` does not trust that list: it finds each
column's edge from the coordinates and permutes.

Mesh files go through meshio: ``write_mesh`` (``TetMesh.save``, ``Result.save_vtu``) writes one
atomically (runtime.outputs), ``TetMesh.load`` reads one with meshio's own printing held back.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from taperay.runtime.outputs import write_atomic
from taperay.runtime.tape import Tape, TaperayError

from .fem import TET10_EDGES, TET_FACES, dihedral_angles, shape_derivatives
from .tet_improve import improve_mesh

__all__ = ["TetMesh", "tet_mesh", "mesh_part", "write_mesh", "dihedral_angles", "PART_SURFACES", "DEFAULT_PART_SURFACE", "box_mesh", "to_order2", "TET10_EDGES",
           "TETGEN_ORDER2_EDGES", "project_boundary_nodes"]

TETGEN_ORDER2_EDGES = ((2, 3), (0, 3), (0, 1), (1, 2), (1, 3), (0, 2))  # TetGen's columns 4..9
# [a, b]: the column of the mid-edge node between corners a and b (TET10_EDGES lists each pair ascending)
_EDGE_COLUMN = np.array([[4 + TET10_EDGES.index((min(a, b), max(a, b))) if a != b else 0 for b in range(4)]
                         for a in range(4)], np.int64)


@dataclass
class TetMesh:
    """``nodes`` (N, 3) float64; ``elements`` (E, 4) or (E, 10) int64, positively oriented, node
    order as VTK's; ``stats``: how it was made."""
    nodes: np.ndarray
    elements: np.ndarray
    stats: dict = field(default_factory=dict)

    @property
    def order(self) -> int:
        return 1 if self.elements.shape[1] == 4 else 2

    def boundary_faces(self) -> np.ndarray:
        """(F, 3) corner triples (TET4) or (F, 6) triangles with mid-edge nodes (ab, bc, ca) (TET10)
        of the faces that belong to one element only, oriented outward."""
        return boundary_faces(self.elements)

    def volumes(self) -> np.ndarray:
        x = self.nodes[self.elements[:, :4]]
        return np.einsum("ij,ij->i", x[:, 1] - x[:, 0], np.cross(x[:, 2] - x[:, 0], x[:, 3] - x[:, 0])) / 6.0

    def save(self, path) -> None:
        """The mesh through meshio (VTU, Gmsh, ...: by the suffix; ``write_mesh``)."""
        write_mesh(path, self)

    @classmethod
    def load(cls, path) -> "TetMesh":
        """A tetrahedral mesh from any file meshio reads (``save``'s VTU, Gmsh, ...): its tetra or
        tetra10 cells (VTK node order), oriented positively; other cells are ignored. A file meshio
        cannot read is one TaperayError with meshio's reason (meshio prints nothing)."""
        meshio = _need("meshio")
        with _quiet() as said:
            try:
                m = meshio.read(str(path))
            # meshio raises ReadError, or parsers' own errors, or prints its readers' errors and
            # calls sys.exit(1) when no reader for the suffix could read the file
            except (Exception, SystemExit) as e:
                if isinstance(e, SystemExit):
                    why = " ".join(said()) or "no reader for its suffix could read it"
                elif isinstance(e, meshio.ReadError):
                    why = str(e)
                else:
                    why = f"{type(e).__name__}: {e}"
                raise TaperayError(f"{path}: not a tetrahedral mesh meshio can read ({why})") from None
        blocks = {c.type: c.data for c in m.cells if c.type in ("tetra", "tetra10")}
        if len(blocks) != 1:
            raise TaperayError(f"{path}: needs tetra or tetra10 cells (one kind), found "
                               f"{', '.join(sorted({c.type for c in m.cells})) or 'no cells'}")
        (kind, elements), = blocks.items()
        mesh = cls(np.asarray(m.points, float)[:, :3], np.asarray(elements, np.int64), {"file": str(path)})
        flipped = mesh.volumes() < 0
        if flipped.any():          # swap corners 1 and 2 (and the mid-edge nodes that follow them)
            swap = [0, 2, 1, 3] + ([] if kind == "tetra" else [6, 5, 4, 7, 9, 8])
            mesh.elements[flipped] = mesh.elements[flipped][:, swap]
        if np.any(mesh.volumes() <= 0):
            raise TaperayError(f"{path}: {int(np.count_nonzero(mesh.volumes() <= 0))} tetrahedra are flat")
        return mesh


def _need(module: str):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise TaperayError(f"simulation needs the optional package {module!r}: pip install 'taperay[sim]'") from None


@contextlib.contextmanager
def _quiet():
    """meshio's printing (its readers' errors on stdout, rich's "Error:" / "Warning:" lines on
    stderr) and Python warnings held back; yields a function that returns the lines it printed,
    "Error:" / "Warning:" prefixes dropped."""
    out, err = io.StringIO(), io.StringIO()

    def said() -> list[str]:
        lines = (out.getvalue() + err.getvalue()).splitlines()
        return [ln.strip().removeprefix("Error:").removeprefix("Warning:").strip() for ln in lines if ln.strip()]

    width = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100000"         # (rich wraps meshio's lines at the console's width)
    try:
        with warnings.catch_warnings(record=True), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            warnings.simplefilter("ignore")
            yield said
    finally:
        if width is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = width


def write_mesh(path, mesh: TetMesh, point_data: dict | None = None) -> None:
    """``mesh`` (tetra or tetra10 cells) and its ``point_data`` through meshio, in the format the
    suffix of ``path`` names, as one ``runtime.outputs.write_atomic`` (the old file survives a
    failure). A format meshio cannot write is one TaperayError."""
    meshio = _need("meshio")
    cells = [("tetra" if mesh.order == 1 else "tetra10", mesh.elements)]
    data = meshio.Mesh(mesh.nodes, cells, point_data=point_data or {})

    def write(tmp: Path) -> None:
        with _quiet():
            try:
                meshio.write(str(tmp), data)
            except meshio.ReadError:                 # (meshio's error for a suffix it knows no format of)
                raise TaperayError(f"{path}: meshio knows no mesh format with the suffix "
                                   f"{Path(path).suffix or '(none)'!r}") from None
            except meshio.WriteError as e:
                raise TaperayError(f"{path}: meshio cannot write this mesh ({e})") from None
    write_atomic(path, write)


def boundary_faces(elements: np.ndarray) -> np.ndarray:
    """The faces of ``elements`` that belong to one element only (TetMesh.boundary_faces)."""
    corners = np.concatenate([elements[:, list(f)] for f in TET_FACES])     # (4E, 3)
    key = np.sort(corners, axis=1)
    n = int(key.max()) + 1 if len(key) else 1
    if n ** 3 < 2 ** 63:        # one int64 a face, ordered as its sorted rows: a 1-D sort, not unique(axis=0)
        key = (key[:, 0].astype(np.int64) * n + key[:, 1]) * n + key[:, 2]
        order = np.argsort(key)
        ordered = key[order]
        differs = ordered[1:] != ordered[:-1]
        alone = np.ones(len(key), bool)
        alone[1:] &= differs
        alone[:-1] &= differs
        once = order[alone]     # (in the order of their keys, as np.unique gives them)
    else:
        _, first, counts = np.unique(key, axis=0, return_index=True, return_counts=True)
        once = first[counts == 1]
    tris = corners[once]
    if elements.shape[1] == 4:
        return tris
    elem = once % len(elements)
    local = np.array(TET_FACES)[once // len(elements)]                      # (F, 3) local corners
    mids = np.stack([_EDGE_COLUMN[local[:, i], local[:, (i + 1) % 3]] for i in range(3)], 1)
    return np.concatenate([tris, elements[elem[:, None], mids]], 1)


def orient(nodes: np.ndarray, elements: np.ndarray) -> np.ndarray:
    """Elements with negative volume get corners 1 and 2 swapped (and their mid-edge nodes)."""
    x = nodes[elements[:, :4]]
    vol = np.einsum("ij,ij->i", x[:, 1] - x[:, 0], np.cross(x[:, 2] - x[:, 0], x[:, 3] - x[:, 0]))
    el = elements.copy()
    neg = vol < 0
    perm = [0, 2, 1, 3] + ([6, 5, 4, 7, 9, 8] if elements.shape[1] == 10 else [])
    el[neg] = el[neg][:, perm]
    return el


def to_order2(nodes: np.ndarray, tets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """TET4 -> TET10: one new node at the midpoint of each unique edge."""
    e = np.sort(np.concatenate([tets[:, list(p)] for p in TET10_EDGES]), axis=1)     # (6E, 2)
    n = np.int64(len(nodes))
    key, inv = np.unique(e[:, 0] * n + e[:, 1], return_inverse=True)   # (one int64 an edge: a 1-D sort)
    mid = len(nodes) + inv.ravel().reshape(6, len(tets)).T
    new_nodes = np.concatenate([nodes, 0.5 * (nodes[key // n] + nodes[key % n])])
    return new_nodes, np.concatenate([tets, mid], 1)


def box_mesh(n=(4, 4, 4), lo=(0.0, 0.0, 0.0), hi=(1.0, 1.0, 1.0), order: int = 1) -> TetMesh:
    """A structured tetrahedral mesh of a box: n cubes per axis, each cut into the six Kuhn
    tetrahedra around its main diagonal (conforming across cubes)."""
    n = np.broadcast_to(np.asarray(n, int), (3,))
    lo, hi = np.asarray(lo, float), np.asarray(hi, float)
    axes = [np.linspace(lo[i], hi[i], n[i] + 1) for i in range(3)]
    nodes = np.stack(np.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3)
    idx = np.arange(len(nodes)).reshape(*(n + 1))
    base = np.stack(np.meshgrid(*[np.arange(k) for k in n], indexing="ij"), -1).reshape(-1, 3)
    tets = []
    from itertools import permutations
    for perm in permutations(range(3)):
        p = base.copy()
        verts = [idx[p[:, 0], p[:, 1], p[:, 2]]]
        for ax in perm:
            p = p.copy()
            p[:, ax] += 1
            verts.append(idx[p[:, 0], p[:, 1], p[:, 2]])
        tets.append(np.stack(verts, 1))
    tets = orient(nodes, np.concatenate(tets))
    if order == 2:
        nodes, tets = to_order2(nodes, tets)
    return TetMesh(nodes, tets.astype(np.int64), {"kind": "structured box", "cells": n.tolist()})


def _signal_name(number: int) -> str:
    import signal
    try:
        return f"signal {number} ({signal.Signals(number).name})"
    except ValueError:
        return f"signal {number}"


def run_child(mode: str, vertices, faces, options: dict | None, timeout: float) -> tuple[dict | None, str]:
    """TetGen's ``mode`` ("tet" or "repair") on the surface in a child process (_tetgen_child):
    (its arrays, "") or (None, why it failed, timed out or died)."""
    with tempfile.TemporaryDirectory(prefix="taperay-tetgen-") as tmp:
        src, dst = Path(tmp) / "in.npz", Path(tmp) / "out.npz"
        np.savez(src, vertices=np.asarray(vertices, np.float64), faces=np.asarray(faces, np.int64), mode=mode,
                 options=json.dumps(options or {}))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        try:
            proc = subprocess.run([sys.executable, "-m", "taperay.solvers._tetgen_child", str(src), str(dst)],
                                  capture_output=True, text=True, timeout=timeout, env=env,
                                  cwd=tmp)   # (TetGen may write _skipped.* files into its cwd)
        except subprocess.TimeoutExpired:
            return None, f"{mode}: no answer within {timeout:.0f} s"
        if proc.returncode != 0 or not dst.exists():
            tail = " ".join((proc.stderr or "").strip().splitlines()[-3:])
            if proc.returncode == 3:
                return None, f"{mode} failed: {tail}"
            how = (f"killed by {_signal_name(-proc.returncode)}" if proc.returncode < 0 else f"exit {proc.returncode}")
            return None, f"{mode}: the child process died ({how}){': ' + tail if tail else ''}"
        with np.load(dst) as out:
            return {k: out[k] for k in out.files}, ""


def winding_number(vertices: np.ndarray, faces: np.ndarray, points: np.ndarray) -> np.ndarray:
    """Generalised winding number of closed oriented triangle surfaces at ``points`` (1 inside a
    positively oriented closed surface, 0 outside; van Oosterom-Strackee solid angles)."""
    a, b, c = (vertices[faces[:, i]][None] - np.asarray(points, float)[:, None] for i in range(3))
    la, lb, lc = (np.linalg.norm(x, axis=2) for x in (a, b, c))
    num = np.einsum("pfi,pfi->pf", a, np.cross(b, c))
    den = la * lb * lc + np.einsum("pfi,pfi->pf", a, b) * lc + np.einsum("pfi,pfi->pf", b, c) * la \
        + np.einsum("pfi,pfi->pf", c, a) * lb
    return np.arctan2(num, den).sum(1) / (2 * np.pi)


def hole_points(vertices: np.ndarray, faces: np.ndarray) -> list[list[float]]:
    """One point inside each cavity of a closed, outward-oriented surface: each connected
    component whose enclosed volume is negative bounds a cavity (TetGen fills cavities unless told
    a point in each). The point sits a little off one of the component's faces, along the face's
    normal, where the whole surface's winding number is 0 and the component's is -1."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components
    nv = len(vertices)
    ij = np.concatenate([faces[:, [0, 1]], faces[:, [1, 2]], faces[:, [2, 0]]])
    ncomp, label = connected_components(coo_matrix((np.ones(len(ij)), (ij[:, 0], ij[:, 1])), shape=(nv, nv)),
                                        directed=False)
    if ncomp == 1:
        return []
    flab = label[faces[:, 0]]
    holes = []
    for k in range(ncomp):
        fk = faces[flab == k]
        if not len(fk):
            continue
        x = vertices[fk]
        if np.einsum("ij,ij->i", x[:, 0], np.cross(x[:, 1], x[:, 2])).sum() >= 0:
            continue                                        # an outer boundary, not a cavity
        nrm = np.cross(x[:, 1] - x[:, 0], x[:, 2] - x[:, 0])
        area2 = np.linalg.norm(nrm, axis=1)
        order = np.argsort(-area2)[:20]                     # try the largest faces
        for fi in order:
            edge = min(np.linalg.norm(x[fi, 1] - x[fi, 0]), np.linalg.norm(x[fi, 2] - x[fi, 1]),
                       np.linalg.norm(x[fi, 0] - x[fi, 2]))
            for eps in (0.3, 0.1, 0.03):
                p = x[fi].mean(0) + eps * edge * nrm[fi] / area2[fi]
                if abs(winding_number(vertices, faces, p[None])[0]) < 0.5 \
                        and winding_number(vertices, fk, p[None])[0] < -0.5:
                    holes.append(p.tolist())
                    break
            else:
                continue
            break
    return holes


def _signed_volume(v, f) -> float:
    x = np.asarray(v, float)[np.asarray(f, np.int64)]
    return float(np.einsum("ij,ij->i", x[:, 0], np.cross(x[:, 1], x[:, 2])).sum() / 6.0)


def _reorder_tetgen_order2(nodes: np.ndarray, elems: np.ndarray) -> np.ndarray:
    """Permute the 6 mid-edge columns into VTK order, finding each column's edge by coordinates."""
    corners = nodes[elems[:, :4]]
    out = elems.copy()
    for j in range(6):
        col = nodes[elems[:, 4 + j]]
        errs = [np.abs(col - 0.5 * (corners[:, a] + corners[:, b])).max() for a, b in TET10_EDGES]
        k = int(np.argmin(errs))
        if errs[k] > 1e-9 * max(1.0, np.abs(nodes).max()):
            raise TaperayError(f"TetGen's order-2 column {4 + j} is no edge's midpoint")
        out[:, 4 + k] = elems[:, 4 + j]
    return out


def tet_mesh(surface, order: int = 1, quality: bool = True, minratio: float = 2.0, mindihedral: float = 0.0,
             maxvolume: float | None = None, fixedvolume: bool | None = None, tape: Tape | None = None,
             walker=None, timeout: float = 300.0, repair: bool = True, keep_boundary: bool = False,
             improve: bool = True, interior: np.ndarray | None = None) -> TetMesh:
    """Tetrahedra filling a closed surface (``surface.vertices``, ``surface.faces``; a Surface or
    anything with those two arrays).

    ``order``: 1 (TET4) or 2 (TET10). ``quality``, ``minratio`` (radius-edge bound), ``mindihedral``
    (degrees) are TetGen's quality switches; ``maxvolume`` bounds each tetrahedron's volume
    (TetGen reads it only with ``fixedvolume``, which is switched on when a ``maxvolume`` is given
    and ``fixedvolume`` is not said). ``keep_boundary``: TetGen's ``-Y``, the surface's triangles
    are the mesh's boundary faces as they are (no points added on them, so no refinement runs away
    along a finely cut surface and no boundary point needs moving). ``interior``: (P, 3) points
    inside the part that become nodes as they are (TetGen's Delaunay insertion of isolated input
    vertices; any that fall outside the surface are dropped). ``improve``: TetGen's TET4 mesh
    improved by ``tet_improve.improve_mesh`` (slivers removed by flips, smoothing and inserted
    interior nodes; the boundary as it is) before mid-edge nodes are made; ``stats["improvement"]``
    says what it did. With ``tape``, boundary nodes (TET10 mid-edge nodes, TetGen's points on
    facets) are moved onto the tape's zero set (``project_boundary_nodes``). TetGen runs in a child process;
    when it fails on a surface that carries ``unprojected`` vertices (marching cubes' own), those are
    meshed instead; otherwise, or failing that too, the surface is repaired (pymeshfix) and retried
    once, then a TaperayError names the causes."""
    if order not in (1, 2):
        raise TaperayError(f"order must be 1 (TET4) or 2 (TET10), got {order!r}")
    t0 = time.perf_counter()
    v, f = np.asarray(surface.vertices, np.float64), np.asarray(surface.faces, np.int64)
    if fixedvolume is None:
        fixedvolume = maxvolume is not None
    holes = hole_points(v, f)
    opts = {"holes": holes, "order": 1, "quality": bool(quality), "minratio": float(minratio), "mindihedral": float(mindihedral),
            "fixedvolume": bool(fixedvolume), "quiet": True, "nowarning": True, "nobisect": bool(keep_boundary)}
    if maxvolume is not None:
        opts["maxvolume"] = float(maxvolume)
    if interior is not None and len(interior):
        v = np.concatenate([v, np.asarray(interior, np.float64).reshape(-1, 3)])
    # TetGen meshes order 1; mid-edge nodes are made here (TetGen's order=2 gives the same nodes; its
    # column order is checked by tests/test_solvers.py against TETGEN_ORDER2_EDGES)
    out, why = run_child("tet", v, f, opts, timeout)
    repaired = unprojected = False
    fallback = getattr(surface, "unprojected", None)
    if out is None and fallback is not None:
        # thin walls: the projection can make two sheets cross, which kills TetGen; the grid-edge
        # surface cannot cross itself, and the boundary projection below moves its nodes afterwards
        # as far as no element spoils
        out, why_grid = run_child("tet", np.asarray(fallback, np.float64), f, opts, timeout)
        if out is not None:
            unprojected = True
        else:
            why = f"{why}; unprojected surface: {why_grid}"
    if out is None and repair:
        fixed, why_fix = run_child("repair", v, f, None, timeout)
        if fixed is None:
            raise TaperayError(f"TetGen could not mesh the surface ({why}); repairing it failed too ({why_fix})")
        repaired = True
        v0 = _signed_volume(v, f)
        v1 = _signed_volume(fixed["vertices"], fixed["faces"])
        if not (abs(v1 - v0) <= 0.05 * abs(v0)):
            raise TaperayError(f"TetGen could not mesh the surface ({why}); pymeshfix's repair changed the "
                               f"enclosed volume from {v0:.6g} to {v1:.6g}, so it is not trusted "
                               "(is the surface self-intersecting?)")
        out, why2 = run_child("tet", fixed["vertices"], fixed["faces"], opts, timeout)
        if out is None:
            raise TaperayError(f"TetGen could not mesh the surface ({why}), nor the surface repaired by "
                               f"pymeshfix ({why2}); is the surface self-intersecting or open?")
    elif out is None:
        raise TaperayError(f"TetGen could not mesh the surface ({why})")
    nodes, elems = out["nodes"], out["elements"].astype(np.int64)
    if not len(elems):
        raise TaperayError("TetGen returned no tetrahedra")
    # drop nodes no element uses (TetGen keeps every input vertex)
    used = np.unique(elems)
    remap = np.full(len(nodes), -1, np.int64)
    remap[used] = np.arange(len(used))
    nodes, elems = nodes[used], remap[elems]
    elems = orient(nodes, elems)
    tetgen_seconds = time.perf_counter() - t0
    improvement = None
    if improve:
        fixed = np.zeros(len(nodes), bool)
        fixed[boundary_faces(elems)] = True
        nodes, elems, improvement = improve_mesh(nodes, elems, fixed)
    if order == 2:
        nodes, elems = to_order2(nodes, elems)
    mesh = TetMesh(nodes, elems, {"tetgen_seconds": tetgen_seconds, "repaired": repaired, "unprojected": unprojected,
                                  "elements": int(len(elems)), "nodes": int(len(nodes)), "improvement": improvement,
                                  "interior_points": 0 if interior is None else int(len(interior))})
    if tape is not None:
        mesh.stats["projected_nodes"] = project_boundary_nodes(mesh, tape, walker, cell=getattr(surface, "stats", {}).get("spacing"))
    return mesh


INTERIOR_CELLS = 2.5    # the spacing of the interior lattice ("lattice"), in cells of the surface's grid
INTERIOR_MARGIN = 0.6   # ... and how far inside its points lie, in lattice spacings (by the field's value)
INTERIORS = ("lattice", "tetgen")


def interior_lattice(tape: Tape, spacing: float, walker=None, lo=None, hi=None) -> np.ndarray:
    """(P, 3) interior nodes for TetGen: body-centred cubic lattices over ``tape.bounds`` (or
    ``lo``..``hi``), the first of ``spacing`` where the tape's field lies below ``-INTERIOR_MARGIN``
    spacings (inside the part, away from its surface), each next one twice as coarse where the
    field lies below ``-INTERIOR_MARGIN`` of its own spacing, which the finer one leaves there:
    well-spaced nodes, graded from the surface inwards, whose Delaunay tetrahedra are the
    lattices' own (dihedral angles 60 and 90 degrees) away from the surface and the grading."""
    from .zero_set import default_walker
    walker = default_walker(walker)
    lo = np.asarray(tape.bounds[0] if lo is None else lo, np.float64)
    hi = np.asarray(tape.bounds[1] if hi is None else hi, np.float64)
    kept = []
    deeper = None
    while True:
        axes = [np.arange(lo[i] + 0.5 * spacing, hi[i], spacing) for i in range(3)]
        corners = np.stack(np.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3)
        points = np.concatenate([corners, corners + 0.5 * spacing])
        if not len(points):
            break
        field = np.asarray(walker.evaluate(tape, points.astype(np.float32))[0], np.float64)
        inside = field < -INTERIOR_MARGIN * spacing
        if not inside.any():
            break
        if deeper is not None:          # (the finer lattice's points where this one takes over)
            kept[-1] = kept[-1][deeper > -INTERIOR_MARGIN * spacing]
        kept.append(points[inside])
        deeper = field[inside]
        spacing *= 2.0
    return np.concatenate(kept) if kept else np.zeros((0, 3))


PART_SURFACES = ("auto", "dc", "mc")
SURFACE_NAMES = {"dc": "dual contouring", "mc": "marching cubes"}
DEFAULT_PART_SURFACE = "auto"
FLAT_DEGREES = 1e-3     # a dual-contoured part's mesh with a dihedral angle below this is refused
REFINE_FACTORS = (1.25, 1.5)   # "auto": finer grids dual contouring is tried on before marching cubes


def _fits(tape: Tape, resolution: int, order: int) -> bool:
    """Whether a part meshed at ``resolution`` and an elasticity system on it (the larger kind)
    fit in the memory available now (``surface.resolution_memory``'s estimate)."""
    from taperay.runtime.resources import available_memory
    from .surface import resolution_memory
    return resolution_memory(resolution, tape, "dc", order, 3) <= available_memory()


def mesh_part(tape: Tape, resolution: int, order: int = 1, walker=None, surface: str = DEFAULT_PART_SURFACE,
              progress=None, interior: str = "lattice", **tet_options) -> tuple[TetMesh, dict, dict]:
    """The part ``tape`` describes as tetrahedra: its surface (``mesh_surface`` at ``resolution``),
    then ``tet_mesh`` (``tet_options``; boundary nodes projected onto the zero set). ``surface``:
    "auto" (the default): dual contouring (sharp edges kept, vertices on the zero set) meshed by
    TetGen with its triangles kept as the boundary faces (``keep_boundary``); where TetGen cannot
    mesh that (a dual-contoured surface can cross itself near walls thinner than about two cells,
    or TetGen leaves flat tetrahedra across one: ``FLAT_DEGREES``), dual contouring on finer grids
    (``REFINE_FACTORS`` times the resolution, while they fit in memory), then marching cubes at the
    resolution; ``stats["fallback"]`` says why and ``stats["resolution"]`` which grid made the
    surface. "dc": dual contouring alone; "mc": marching cubes alone (when TetGen fails on it, its
    own grid vertices). ``interior`` (a dual-contoured surface's): "lattice" (the default) gives
    TetGen ``interior_lattice``'s points from ``INTERIOR_CELLS`` cells apart, and its radius-edge
    refinement (``quality``, ``minratio``) fills the band by the surface; "tetgen" leaves the
    whole interior to that refinement. ``progress(stage, seconds)`` is called once the mesh is
    made, for "surface" and "tets". Returns (mesh, the surface's stats (method, resolution, triangles, volume, ...),
    timings {"surface", "tets"} in seconds)."""
    from .surface import mesh_surface
    if surface not in PART_SURFACES:
        raise TaperayError(f"unknown surface {surface!r} (choose from {', '.join(PART_SURFACES)})")
    if interior not in INTERIORS:
        raise TaperayError(f"unknown interior {interior!r} (choose from {', '.join(INTERIORS)})")
    timings: dict[str, float] = {}
    failures = []
    attempts = [(surface, resolution)]
    if surface == "auto":
        finer = [math.ceil(resolution * k) for k in REFINE_FACTORS]
        attempts = ([("dc", resolution)] + [("dc", r) for r in finer if _fits(tape, r, order)]
                    + [("mc", resolution)])
    for method, grid in attempts:
        t0 = time.perf_counter()
        surf = mesh_surface(tape, grid, walker, method=method)
        timings["surface"] = timings.get("surface", 0.0) + time.perf_counter() - t0
        t0 = time.perf_counter()
        options = dict(tet_options)
        if method == "dc" and interior == "lattice":
            spacing = INTERIOR_CELLS * surf.stats["spacing"]
            options["interior"] = interior_lattice(tape, spacing, walker, surf.vertices.min(0), surf.vertices.max(0))
        try:
            mesh = tet_mesh(surf, order=order, tape=tape, walker=walker, keep_boundary=method == "dc", **options)
            flat = int(np.count_nonzero(dihedral_angles(mesh.nodes, mesh.elements).min(1) < FLAT_DEGREES))
            if method == "dc" and flat:     # (the surface's points nearly coplanar across a wall a cell thin)
                raise TaperayError(f"TetGen left {flat} flat tetrahedra (a dihedral angle below {FLAT_DEGREES} "
                                   "degrees), whose system cannot be solved")
        except TaperayError as e:
            failures.append(f"{SURFACE_NAMES[method]} at resolution {grid}: {e}")
            continue
        finally:
            timings["tets"] = timings.get("tets", 0.0) + time.perf_counter() - t0
        stats = {k: v for k, v in surf.stats.items() if not k.endswith("seconds")}
        stats.update(triangles=int(len(surf.faces)), volume=surf.volume, resolution=grid)
        if failures:
            stats["fallback"] = failures[0]
        for stage, seconds in timings.items():
            if progress:
                progress(stage, seconds)
        return mesh, stats, timings
    spacing = surf.stats.get("spacing")
    hint = (f"; a wall thinner than about two grid cells ({2 * spacing:.3g} at resolution {resolution}) makes the "
            f"surface cross itself: raise the resolution (e.g. to {2 * resolution})" if spacing else "")
    raise TaperayError(("; ".join(failures) if len(failures) > 1 else failures[0]) + hint)


_DETJ_POINTS = np.array([[0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1],
                         *[0.5 * (np.eye(4)[a] + np.eye(4)[b])[1:] for a, b in TET10_EDGES], [0.25, 0.25, 0.25]])
_DETJ_CHUNK = 16384     # elements a block (its nine (chunk, 11) Jacobian entries: 13 MB; measured fastest)


def min_detj(nodes: np.ndarray, elements: np.ndarray) -> np.ndarray:
    """Smallest Jacobian determinant of each element over its corners and mid-edge nodes."""
    d = shape_derivatives(elements.shape[1], _DETJ_POINTS).transpose(2, 1, 0)   # d[b, n, q]
    out = np.empty(len(elements))
    for s in range(0, len(elements), _DETJ_CHUNK):
        x = nodes[elements[s:s + _DETJ_CHUNK]].transpose(2, 0, 1)                # x[a, e, n]
        j = [[x[a] @ d[b] for b in range(3)] for a in range(3)]                 # J[a][b]: (e, Q)
        det = (j[0][0] * (j[1][1] * j[2][2] - j[1][2] * j[2][1])
               - j[0][1] * (j[1][0] * j[2][2] - j[1][2] * j[2][0])
               + j[0][2] * (j[1][0] * j[2][1] - j[1][1] * j[2][0]))
        out[s:s + _DETJ_CHUNK] = det.min(1)
    return out


BOUNDARY_TOLERANCE_CELLS = 1e-3   # a boundary node farther than this from the zero set (in cells) is off it
MIN_STEP_SHARE = 1.0 / 8.0         # a boundary node held back takes half its step, a quarter, an eighth, or none


def _node_normals(nodes: np.ndarray, faces: np.ndarray) -> np.ndarray:
    """(N, 3) unit normals of the nodes of boundary ``faces`` (outward; the area-weighted mean of
    the normals of the straight-sided faces that hold the node, corners and mid-edge nodes alike);
    zero for nodes on no face."""
    x = nodes[faces[:, :3]]
    n = np.cross(x[:, 1] - x[:, 0], x[:, 2] - x[:, 0])
    out = np.zeros((len(nodes), 3))
    for col in range(faces.shape[1]):
        np.add.at(out, faces[:, col], n)
    return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-300)


def _material_agrees(tape: Tape, walker, points, which, node_of_pair, material_of_pair) -> np.ndarray:
    """For the boundary nodes ``which`` (placed at ``points``): is the tape's material there one of
    the materials of the node's faces (pairs of node index and face material)?"""
    mat = np.full(int(node_of_pair.max()) + 1, -1, np.int64)
    mat[which] = np.asarray(walker.evaluate(tape, np.asarray(points, np.float32))[1], np.int64)
    agree = np.zeros(len(mat), bool)
    np.logical_or.at(agree, node_of_pair, mat[node_of_pair] == material_of_pair)
    return agree[which]


def project_boundary_nodes(mesh: TetMesh, tape: Tape, walker=None, steps: int = 3, cell: float | None = None) -> int:
    """Move the nodes of boundary faces onto the tape's zero set: TET10 mid-edge nodes, the points
    TetGen inserted on the surface's facets, and any surface vertex that is still off it. Returns
    how many nodes moved; ``mesh.stats["boundary_projection"]`` says what happened to the others.

    ``cell``: the length "a cell" means here (default: the median length of the boundary faces'
    edges). Each node goes by ``zero_set.project_to_zero_set``: Newton steps of at most a quarter
    cell that must lower |f|, and a node they leave more than ``BOUNDARY_TOLERANCE_CELLS`` off the
    zero set takes the nearest zero along its own sheet's normal (the faces' around it), within a
    cell. A node that ends where the tape's material (the nearest leaf's) is none of its faces'
    (read at their straight-sided centroids: what its neighbours say) has landed on another
    piece's sheet: it takes the nearest zero along its normal from where it started instead, and
    where that is not its faces' material either it goes back to its start (``wrong_sheet_left``).
    Then the nodes of an element whose smallest Jacobian would drop below a quarter of its own take
    half their steps, then a quarter, an eighth, none, repeatedly, as holding one back can spoil
    another (``held_back``: those left farther off the zero set than the tolerance)."""
    from .zero_set import default_walker, project_to_zero_set, search_line
    walker = default_walker(walker)
    faces = mesh.boundary_faces()
    bnodes = np.unique(faces)
    la = np.linalg.norm(mesh.nodes[faces[:, 0]] - mesh.nodes[faces[:, 1]], axis=1)
    cell = cell or (float(np.median(la)) if len(la) else 1.0)
    tol = BOUNDARY_TOLERANCE_CELLS * cell
    old = mesh.nodes[bnodes].copy()
    normals = _node_normals(mesh.nodes, faces)[bnodes]
    centroids = mesh.nodes[faces[:, :3]].mean(1)
    face_mat = np.asarray(walker.evaluate(tape, centroids.astype(np.float32))[1], np.int64)
    node_of_pair = np.searchsorted(bnodes, faces.ravel())
    mat_of_pair = np.repeat(face_mat, faces.shape[1])
    new, _ = project_to_zero_set(tape, old, walker, steps=steps, max_step=0.25 * cell, tol=tol, directions=normals,
                                 reach=cell)
    every = np.arange(len(bnodes))
    stray = left = np.flatnonzero(~_material_agrees(tape, walker, new, every, node_of_pair, mat_of_pair))
    if len(stray):               # the nearer zero along the normal, out or in, whose material agrees
        found, dist = [], []
        for way in (1.0, -1.0):
            pts, f = search_line(tape, old[stray], way * normals[stray], cell, walker, 1e-3 * tol, both_ways=False)
            fits = _material_agrees(tape, walker, pts, stray, node_of_pair, mat_of_pair) & (np.abs(f) <= tol)
            found.append(pts)
            dist.append(np.where(fits, np.linalg.norm(pts - old[stray], axis=1), np.inf))
        out = dist[0] <= dist[1]
        fixed = np.isfinite(np.minimum(dist[0], dist[1]))
        new[stray] = np.where(fixed[:, None], np.where(out[:, None], found[0], found[1]), old[stray])
        left = stray[~fixed]
    check = np.nonzero(np.isin(mesh.elements, bnodes).any(1))[0]
    before = np.zeros(len(mesh.elements))
    before[check] = min_detj(mesh.nodes, mesh.elements[check])
    mesh.nodes[bnodes] = new
    step = new - old
    share = (np.linalg.norm(step, axis=1) > 0).astype(float)     # of its step each node takes
    # an element that would lose 3/4 of its smallest Jacobian: its nodes halve their steps. A node
    # held back can spoil a neighbour that kept its step, so the elements around the nodes held back
    # are checked again; each round halves at least one step, down to none, and an element whose
    # nodes take no step is as it was
    while len(check):
        bad = check[min_detj(mesh.nodes, mesh.elements[check]) <= 0.25 * before[check]]
        back = np.flatnonzero(np.isin(bnodes, mesh.elements[bad]) & (share > 0))
        if not len(back):
            break
        share[back] = np.where(share[back] > MIN_STEP_SHARE, 0.5 * share[back], 0.0)
        mesh.nodes[bnodes[back]] = old[back] + share[back, None] * step[back]
        check = np.nonzero(np.isin(mesh.elements, bnodes[back]).any(1))[0]
    moved = share > 0
    short = (1.0 - share) * np.linalg.norm(step, axis=1) > tol
    mesh.stats["boundary_projection"] = {
        "nodes": int(len(bnodes)), "moved": int(moved.sum()), "held_back": int(np.count_nonzero(short)),
        "wrong_sheet_fixed": int(len(stray) - len(left)), "wrong_sheet_left": int(len(left)), "cell": cell}
    return int(moved.sum())
