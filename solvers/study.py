"""Studies on scenes: ``Heat`` and ``Elasticity`` declarations whose boundary conditions name the
scene's materials, and ``simulate(tape, study)``: surface -> tetrahedra -> assembly -> solve.

A study checks its own values when it is made and again in ``study_from`` (finite numbers,
E > 0, -1 < nu < 0.5, conductivity > 0, convection coefficients >= 0, vectors of three);
``check_study(tape, study)`` checks it against a scene (every material it names exists; an
elasticity study has supports or is a free body). ``simulate`` runs both and
``surface.check_resolution`` before any meshing.

A boundary face belongs to the material the tape reports at the face's centroid (the leaf nearest
to it); an element to the material at its centroid. Names come from ``surface.material_names``.
``simulate`` checks the mesh against the scene (``boundary_check``: every boundary node's distance
to the zero set, the faces per name, those that include a node off it; ``mesh_quality``: dihedral
angles) and the Result's summary reports both, with a warning when a node is off the zero set.
"""
from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass, field, fields
from typing import Callable, Iterator

import numpy as np
import scipy.sparse as sp

from taperay.runtime.tape import Tape, TaperayError

from . import fem
from .surface import DEFAULT_RESOLUTION, check_resolution, default_walker, material_names, vertex_distances
from .tetmesh import BOUNDARY_TOLERANCE_CELLS, DEFAULT_PART_SURFACE, TetMesh, dihedral_angles, mesh_part

__all__ = ["Heat", "Elasticity", "Result", "simulate", "study_from", "check_study", "face_materials",
           "element_materials", "mesh_materials", "boundary_check", "boundary_warnings", "surface_warnings",
           "dihedral_angles", "mesh_quality"]


# ---------------------------------------------------------------- checking a study's values

def _number(value, where: str) -> float:
    """``value`` as a float; a TaperayError naming ``where`` unless it is a finite real number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TaperayError(f"{where} = {value!r}: must be a number")
    if not math.isfinite(float(value)):
        raise TaperayError(f"{where} = {value!r}: must be a finite number")
    return float(value)


def _triple(value, where: str, free: bool = False) -> list[float | None]:
    """Three finite numbers (``free``: None allowed for a component)."""
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__len__") or len(value) != 3:
        raise TaperayError(f"{where} = {value!r}: must be three numbers (x, y, z)"
                           + (", None for a free component" if free else ""))
    return [None if free and v is None else _number(v, where) for v in value]


def _named(mapping, where: str) -> Iterator[tuple[str, object]]:
    """(``where['name']``, value) for each entry of a dict keyed by material name."""
    if not isinstance(mapping, dict):
        raise TaperayError(f"{where} = {mapping!r}: must be a dict {{material name: value}}")
    for name, value in mapping.items():
        if not isinstance(name, str):
            raise TaperayError(f"{where}: the key {name!r} is not a material name (a str)")
        yield f"{where}[{name!r}]", value


def _per_material_entries(value, where: str) -> Iterator[tuple[str, object]]:
    """A number for every material, or a dict of them by name (``"*"``: the default)."""
    return _named(value, where) if isinstance(value, dict) else iter([(where, value)])


def _positive(value, where: str, what: str) -> None:
    if not _number(value, where) > 0:
        raise TaperayError(f"{where} = {value!r}: {what} must be > 0")


class _Study:
    """What Heat and Elasticity share: checking their values when made, and the materials they name."""

    def __post_init__(self):
        self.check()     # (each study's own: one TaperayError naming the first bad field and its value)

    def material_references(self) -> list[tuple[str, str]]:
        """(field, material name) for every material the study names (the ``"*"`` default aside)."""
        out = []
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, dict):
                out += [(f.name, name) for name in value if name != "*"]
        return out


@dataclass
class Heat(_Study):
    """Steady heat conduction, -div(k grad T) = s. Every dict is keyed by material name; a plain
    number for ``conductivity`` / ``source`` applies to every material.

    conductivity  W/(m K) per material, > 0;  source  W/m^3 per material (volumetric);
    fixed_temperature  {name: T};  heat_flux  {name: q} W/m^2 flowing INTO the part;
    convection  {name: (h W/(m^2 K) >= 0, T_inf)}."""
    conductivity: float | dict = 1.0
    source: float | dict = 0.0
    fixed_temperature: dict = field(default_factory=dict)
    heat_flux: dict = field(default_factory=dict)
    convection: dict = field(default_factory=dict)
    kind = "heat"

    def check(self) -> "Heat":
        for where, k in _per_material_entries(self.conductivity, "Heat conductivity"):
            _positive(k, where, "the conductivity")
        for where, s in _per_material_entries(self.source, "Heat source"):
            _number(s, where)
        for name in ("fixed_temperature", "heat_flux"):
            for where, v in _named(getattr(self, name), f"Heat {name}"):
                _number(v, where)
        for where, pair in _named(self.convection, "Heat convection"):
            if isinstance(pair, (str, bytes, dict)) or not hasattr(pair, "__len__") or len(pair) != 2:
                raise TaperayError(f"{where} = {pair!r}: must be (h, T_inf)")
            if _number(pair[0], where) < 0:
                raise TaperayError(f"{where} = {pair!r}: the coefficient h must be >= 0")
            _number(pair[1], where)
        return self


@dataclass
class Elasticity(_Study):
    """Linear isotropic elasticity. ``E`` (Pa, > 0) and ``nu`` (-1 < nu < 0.5) per material (or one
    number); fixed  {name: None (all components 0) | (ux, uy, uz) with None for a free component};
    traction  {name: (tx, ty, tz)} force per area;  pressure  {name: p} (acts along -normal);
    body_force  (fx, fy, fz) force per volume;  free_body  True for a part held by no support
    whose loads balance (a vessel under internal pressure): the displacement is the one with no
    rigid-body motion (orthogonal to the three translations and three rotations)."""
    E: float | dict = 1.0
    nu: float | dict = 0.3
    fixed: dict = field(default_factory=dict)
    traction: dict = field(default_factory=dict)
    pressure: dict = field(default_factory=dict)
    body_force: tuple | None = None
    free_body: bool = False
    kind = "elasticity"

    def check(self) -> "Elasticity":
        for where, e in _per_material_entries(self.E, "Elasticity E"):
            _positive(e, where, "Young's modulus")
        for where, nu in _per_material_entries(self.nu, "Elasticity nu"):
            if not -1.0 < _number(nu, where) < 0.5:
                raise TaperayError(f"{where} = {nu!r}: Poisson's ratio must lie in -1 < nu < 0.5 (0.5, "
                                   "incompressible, has no solution in displacements)")
        for where, comp in _named(self.fixed, "Elasticity fixed"):
            if comp is not None and comp is not True and all(c is None for c in _triple(comp, where, free=True)):
                raise TaperayError(f"{where} = {comp!r}: fixes no component (None for all, or a value for some)")
        for where, t in _named(self.traction, "Elasticity traction"):
            _triple(t, where)
        for where, p in _named(self.pressure, "Elasticity pressure"):
            _number(p, where)
        if self.body_force is not None:
            _triple(self.body_force, "Elasticity body_force")
        if not isinstance(self.free_body, bool):
            raise TaperayError(f"Elasticity free_body = {self.free_body!r}: must be True or False")
        return self


STUDIES = {"heat": Heat, "elasticity": Elasticity}


def study_from(obj) -> Heat | Elasticity:
    """A study from a Heat / Elasticity, or from a plain dict ``{"type": "heat" | "elasticity", ...}``
    (what a scene file declares: scene files import no solvers); its values checked (``check``)."""
    if isinstance(obj, (Heat, Elasticity)):
        return obj.check()
    if isinstance(obj, dict):
        d = dict(obj)
        kind = str(d.pop("type", d.pop("kind", ""))).lower()
        if kind not in STUDIES:
            raise TaperayError(f"a study dict needs 'type': 'heat' or 'elasticity' (got {kind!r})")
        cls = STUDIES[kind]
        known = {f.name for f in fields(cls)}
        bad = set(d) - known
        if bad:
            raise TaperayError(f"{kind} study: unknown keys {sorted(bad)} (known: {sorted(known)})")
        return cls(**d)
    raise TaperayError(f"not a study: {type(obj).__name__}")


def check_study(tape: Tape, study) -> Heat | Elasticity:
    """``study_from(study)`` checked against the scene ``tape`` before any meshing: every material
    it names is one of the tape's (``material_names``; the error lists them), a heat study fixes
    a temperature or has convection, and an elasticity study has supports (``fixed``) or says
    ``free_body=True``, not both. Returns the study."""
    study = study_from(study)
    names = material_names(tape)
    missing = [f"the study's {what}: the scene has no material named {name!r}"
               for what, name in study.material_references() if name not in names]
    if missing:
        raise TaperayError(f"{'; '.join(missing)} (its materials: {', '.join(sorted(set(names)))})")
    if study.kind == "heat" and not study.fixed_temperature and not any(h > 0 for h, _ in study.convection.values()):
        raise TaperayError("heat study: no fixed_temperature and no convection with h > 0; the temperature "
                           "would be set only up to a constant (and no steady state exists unless the heat "
                           "in balances the heat out)")
    if study.kind == "elasticity":
        if study.free_body and study.fixed:
            raise TaperayError("elasticity study: free_body=True means no supports, but `fixed` names some")
        if not study.free_body and not study.fixed:
            raise TaperayError("elasticity study: no fixed support; the part would float "
                               "(a part whose loads balance may say free_body=True)")
    return study


# ---------------------------------------------------------------- materials of faces and elements

def face_materials(tape: Tape, nodes, faces, walker=None) -> np.ndarray:
    """Material id of each boundary face: the tape's material at the face centroid."""
    walker = default_walker(walker)
    c = np.asarray(nodes)[np.asarray(faces)[:, :3]].mean(1)
    return np.asarray(walker.evaluate(tape, c.astype(np.float32))[1], np.int64)


def element_materials(tape: Tape, nodes, elements, walker=None) -> np.ndarray:
    walker = default_walker(walker)
    c = np.asarray(nodes)[np.asarray(elements)[:, :4]].mean(1)
    return np.asarray(walker.evaluate(tape, c.astype(np.float32))[1], np.int64)


def mesh_materials(tape: Tape, mesh: TetMesh, walker=None, resolution: int | None = None):
    """(material names, boundary faces, each element's material id, ``faces_of(name, what)``: the
    boundary faces carrying material ``name``; ``what`` names the boundary condition in errors,
    ``resolution`` the grid the mesh was made on, where known, in the error for a name no face
    carries)."""
    names = material_names(tape)
    faces = mesh.boundary_faces()
    fmat = face_materials(tape, mesh.nodes, faces, walker)
    emat = element_materials(tape, mesh.nodes, mesh.elements, walker)
    present = set(np.unique(fmat).tolist())

    def faces_of(name, what):
        return faces[np.isin(fmat, _ids(names, name, present, what, resolution))]
    return names, faces, emat, faces_of


# ---------------------------------------------------------------- the mesh checked against the scene

SLIVER_DEGREES = fem.SLIVER_DEGREES    # an element with a dihedral angle below this is counted (``mesh_quality``)


def _name(names: list[str], i: int) -> str:
    return names[i] if i < len(names) else f"material{i}"


def boundary_check(tape: Tape, mesh: TetMesh, faces=None, walker=None, cell: float | None = None) -> dict:
    """Every boundary node (corners and TET10 mid-edge nodes) measured against the tape: its
    distance to the zero set (``vertex_distances``, |f| / max(|grad f|, 1), through ``walker``) in
    model units and in ``cell``s (default: the median edge of the boundary faces); a node farther
    than ``tetmesh.BOUNDARY_TOLERANCE_CELLS`` cells is off the zero set. Each boundary face's
    material is read from the tape at the face (``face_materials``). Returns the counts of faces per
    material name, the nodes off the zero set, the worst node, the faces per name that include a
    node off it, and what ``project_boundary_nodes`` did (``mesh.stats``, where it ran);
    ``boundary_warnings`` words it."""
    walker = default_walker(walker)
    names = material_names(tape)
    faces = mesh.boundary_faces() if faces is None else faces
    bnodes = np.unique(faces)
    if cell is None:
        cell = float(np.median(np.linalg.norm(mesh.nodes[faces[:, 0]] - mesh.nodes[faces[:, 1]], axis=1)))
    dist = vertex_distances(tape, mesh.nodes[bnodes], walker)
    off = dist > BOUNDARY_TOLERANCE_CELLS * cell
    off_node = np.zeros(len(mesh.nodes), bool)
    off_node[bnodes[off]] = True
    fmat = face_materials(tape, mesh.nodes, faces, walker)
    touched = off_node[faces].any(1)
    per_name: dict[str, int] = {}
    with_off: dict[str, int] = {}
    for i in np.unique(fmat):
        nm = _name(names, int(i))
        per_name[nm] = per_name.get(nm, 0) + int(np.count_nonzero(fmat == i))
        if touched[fmat == i].any():
            with_off[nm] = with_off.get(nm, 0) + int(np.count_nonzero(touched[fmat == i]))
    w = int(np.argmax(dist))
    worst_mat = int(walker.evaluate(tape, mesh.nodes[bnodes[w]][None].astype(np.float32))[1][0])
    report = {"nodes": int(len(bnodes)), "cell": cell, "tolerance_cells": BOUNDARY_TOLERANCE_CELLS,
              "max_distance": float(dist[w]), "max_distance_cells": float(dist[w] / cell),
              "off_zero_set": int(off.sum()),
              "worst_node": {"node": int(bnodes[w]), "position": mesh.nodes[bnodes[w]].tolist(),
                             "distance": float(dist[w]), "cells": float(dist[w] / cell),
                             "material": _name(names, worst_mat)},
              "faces": per_name, "faces_with_nodes_off": with_off,
              "projection": dict(mesh.stats.get("boundary_projection") or {})}
    return report


def boundary_warnings(report: dict) -> list[str]:
    """``boundary_check``'s findings as warning lines: none when every boundary node is on the zero
    set; else one naming how many are off, the farthest, the faces per material name that include
    them and what the meshing said (nodes the element-quality guard held back, nodes with no zero
    of their faces' material near them)."""
    if not report.get("off_zero_set"):
        return []
    proj, worst = report["projection"], report["worst_node"]
    said = [f"the element-quality guard held {proj['held_back']:,} boundary nodes back from the zero set"] \
        if proj.get("held_back") else []
    said += [f"{proj['wrong_sheet_left']:,} boundary nodes found no zero of their faces' material near them"] \
        if proj.get("wrong_sheet_left") else []
    at = ", ".join(f"{c:.4g}" for c in worst["position"])
    faces = ", ".join(f"{nm!r} {k:,} of {report['faces'][nm]:,}"
                      for nm, k in sorted(report["faces_with_nodes_off"].items()))
    return [f"{report['off_zero_set']:,} of {report['nodes']:,} boundary nodes lie off the zero set (more than "
            f"{report['tolerance_cells']:g} cell; the farthest {worst['distance']:.3g} = {worst['cells']:.3g} cells, "
            f"node {worst['node']} at ({at}), {worst['material']!r}); faces that include them: {faces}"
            + "".join(f"; {s}" for s in said)]


def surface_warnings(stats: dict) -> list[str]:
    """A warning line when ``mesh_part`` fell back to marching cubes (``stats["fallback"]``): its
    surface cuts the part's sharp edges and corners, so volumes, areas and the fields near them are
    less accurate than dual contouring's; none otherwise."""
    if stats.get("method") != "mc" or "fallback" not in stats:
        return []
    return [f"the surface is marching cubes' at resolution {stats.get('resolution')} ({stats['fallback']}); "
            "marching cubes cuts sharp edges and corners, so volumes, areas and the "
            "field near them are less accurate (a wall thinner than about two cells is the usual cause: raise the "
            "resolution)"]


def mesh_quality(mesh: TetMesh) -> dict:
    """The smallest and largest dihedral angle of the elements (degrees) and how many elements have
    one below ``SLIVER_DEGREES``."""
    a = dihedral_angles(mesh.nodes, mesh.elements)
    return {"min_dihedral": float(a.min()), "max_dihedral": float(a.max()),
            "below_5_degrees": int(np.count_nonzero(a.min(1) < SLIVER_DEGREES))}


def _ids(names: list[str], name: str, present: set[int], what: str, resolution: int | None = None) -> np.ndarray:
    ids = [i for i, n in enumerate(names) if n == name]
    if not ids:
        raise TaperayError(f"the study's {what}: the scene has no material named {name!r} (its materials: "
                           f"{', '.join(sorted(set(names)))})")
    if not present & set(ids):
        grid = (f" at resolution {resolution} (raise the resolution, e.g. to {2 * resolution})" if resolution
                else " (raise the resolution)")
        raise TaperayError(f"the study's {what} on material {name!r}: no boundary face of the mesh carries that "
                           f"material; is that part inside another (not on the outside), or thinner than a grid cell"
                           f"{grid}?")
    return np.array(ids)


def _per_material(value, names: list[str], mats: np.ndarray, what: str) -> np.ndarray:
    if not isinstance(value, dict):
        return np.full(len(mats), float(value))
    out = np.full(len(mats), np.nan)
    for i in np.unique(mats):
        nm = names[i] if i < len(names) else f"material{i}"
        if nm in value:
            out[mats == i] = float(value[nm])
        elif "*" in value:
            out[mats == i] = float(value["*"])
    if np.isnan(out).any():
        missing = sorted({names[i] for i in np.unique(mats[np.isnan(out)])})
        raise TaperayError(f"the study's {what} has no value for the part's material(s) {missing} (give them, "
                           "or a '*' default)")
    return out


# ---------------------------------------------------------------- result

@dataclass
class Result:
    """A solved study: the mesh, the field (temperature (N,) or displacement (N, 3)), von Mises
    stress at the nodes (elasticity), stage timings (seconds), solver information and the boundary
    checked against the scene (``boundary_check``; empty where nothing checked it)."""
    kind: str
    mesh: TetMesh
    field: np.ndarray
    timings: dict
    solver: dict
    stress: np.ndarray | None = None
    surface_stats: dict = field(default_factory=dict)
    boundary: dict = field(default_factory=dict)

    def summary(self) -> dict:
        s = {"study": self.kind, "order": self.mesh.order, "nodes": int(len(self.mesh.nodes)),
             "elements": int(len(self.mesh.elements)), "dof": int(self.solver.get("dofs", 0)),
             "solver": self.solver.get("method"), "iterations": int(self.solver.get("iterations", 0)),
             "residual": self.solver.get("residual"), "timings": dict(self.timings)}
        if "ranks" in self.solver:
            s["ranks"] = int(self.solver["ranks"])
        if "note" in self.solver:       # why the solver named is not the one asked for ("amg → direct")
            s["solver_note"] = self.solver["note"]
        if self.kind == "heat":
            s.update(max_temperature=float(self.field.max()), min_temperature=float(self.field.min()),
                     mean_temperature=float(_volume_mean(self.mesh, self.field)))
        else:
            mag = np.linalg.norm(self.field, axis=1)
            s.update(max_displacement=float(mag.max()),
                     max_von_mises=float(self.stress.max()) if self.stress is not None else None)
        s.update(boundary=self.boundary or None, quality=mesh_quality(self.mesh),
                 warnings=surface_warnings(self.surface_stats) + boundary_warnings(self.boundary))
        return s

    def save_vtu(self, path) -> None:
        """The mesh and its fields as VTU (ParaView; or any format meshio writes, by the suffix),
        through meshio, as one ``runtime.outputs.write_atomic``: the old file survives a failure."""
        from .tetmesh import write_mesh
        data = {"temperature": self.field} if self.kind == "heat" else {"displacement": self.field}
        if self.stress is not None:
            data["von_mises"] = self.stress
        write_mesh(path, self.mesh, data)

    def save_section(self, path, axis=None, offset: float | None = None):
        """A PNG of the temperature (heat) or von Mises stress (elasticity) on a planar cut of the
        mesh, with a colour bar (``section.section``: ``axis`` "x" / "y" / "z", None for the cut of
        largest area; ``offset`` the plane's coordinate, None for the middle). Returns the Section."""
        from .section import plot_section, section
        heat = self.kind == "heat"
        cut = section(self.mesh.nodes, self.mesh.elements, self.field if heat else self.stress, axis, offset)
        plot_section(cut, path, "temperature" if heat else "von Mises stress",
                     f"{'temperature' if heat else 'von Mises stress'}, section "
                     f"{'xyz'[cut.axis]} = {cut.offset:.4g}")
        return cut


def _volume_mean(mesh: TetMesh, T: np.ndarray) -> float:
    vol = mesh.volumes()
    return float((T[mesh.elements[:, :4]].mean(1) * vol).sum() / vol.sum())


# ---------------------------------------------------------------- the pipeline

def simulate(tape: Tape, study, order: int | None = None, resolution: int = DEFAULT_RESOLUTION, walker=None,
             progress: Callable[[str, float], None] | None = None, solver: str = "auto", mesh: TetMesh | None = None,
             surface: str = DEFAULT_PART_SURFACE, **tet_options) -> Result:
    """Solve ``study`` (Heat, Elasticity, or a study dict) on the part ``tape`` describes.

    Stages: surface and tets (``tetmesh.mesh_part`` at ``resolution``; ``surface`` "auto" (the
    default: dual contouring with its triangles kept as the boundary, marching cubes where TetGen
    fails on it), "dc" or "mc" alone; ``order`` 1 or 2,
    default 1 for heat, 2 for elasticity, which locks in shear on TET4; ``tet_options`` go to
    tet_mesh), assembly, solve (``solver``: "auto", "direct", "amg"; PETSc over MPI ranks is
    ``solvers.distributed.simulate_petsc``). A ready ``mesh`` skips the first two stages.
    ``progress(stage, seconds)`` is called after each stage. Before any of them: ``check_study``
    and (without ``mesh``) ``surface.check_resolution``, memory of the tetrahedra included."""
    study = check_study(tape, study)
    if solver not in fem.SOLVER_METHODS:
        raise TaperayError(f"unknown solver method {solver!r} ({', '.join(fem.SOLVER_METHODS)})")
    order = order or (1 if study.kind == "heat" else 2)
    if mesh is None:
        check_resolution(resolution, tape, method=surface, study=study, order=order)
    walker = default_walker(walker)
    timings: dict[str, float] = {}
    surf_stats: dict = {}

    def done(stage, t0):
        timings[stage] = time.perf_counter() - t0
        if progress:
            progress(stage, timings[stage])

    if mesh is None:
        mesh, surf_stats, made = mesh_part(tape, resolution, order, walker, surface, progress, **tet_options)
        timings.update(made)
    t0 = time.perf_counter()
    names, faces, emat, faces_of = mesh_materials(tape, mesh, walker, surf_stats.get("resolution"))
    boundary = boundary_check(tape, mesh, faces, walker, surf_stats.get("spacing"))

    N = len(mesh.nodes)
    if study.kind == "heat":
        k = _per_material(study.conductivity, names, emat, "conductivity")
        s = _per_material(study.source, names, emat, "source")
        K, f = fem.heat_system(mesh.nodes, mesh.elements, k, s)
        for name, q in study.heat_flux.items():
            f += fem.face_load(mesh.nodes, faces_of(name, "heat_flux"), float(q), 1, N)
        for name, (h, tinf) in study.convection.items():
            fc = faces_of(name, "convection")
            K = K + fem.face_mass(mesh.nodes, fc, float(h), N)
            f += fem.face_load(mesh.nodes, fc, float(h) * float(tinf), 1, N)
        fixed, vals = [], []
        for name, T in study.fixed_temperature.items():
            nd = np.unique(faces_of(name, "fixed_temperature"))
            fixed.append(nd)
            vals.append(np.full(len(nd), float(T)))
        near_null = None
    else:
        Ev = _per_material(study.E, names, emat, "E")
        nuv = _per_material(study.nu, names, emat, "nu")
        K, f = fem.elasticity_system(mesh.nodes, mesh.elements, Ev, nuv, study.body_force)
        for name, t in study.traction.items():
            f += fem.face_load(mesh.nodes, faces_of(name, "traction"), np.asarray(t, float), 3, N)
        for name, p in study.pressure.items():
            f += fem.face_load(mesh.nodes, faces_of(name, "pressure"), lambda x, n, p=float(p): -p * n, 3, N)
        fixed, vals = [], []
        for name, comp in study.fixed.items():
            nd = np.unique(faces_of(name, "fixed"))
            comp = (0.0, 0.0, 0.0) if comp is None or comp is True else comp
            for i, c in enumerate(comp):
                if c is not None:
                    fixed.append(3 * nd + i)
                    vals.append(np.full(len(nd), float(c)))
        near_null = fem.rigid_body_modes(mesh.nodes)
    free_body = study.kind == "elasticity" and study.free_body
    fixed_dofs = np.concatenate(fixed) if fixed else np.zeros(0, np.int64)
    fixed_vals = np.concatenate(vals) if vals else np.zeros(0)
    if len(fixed_dofs):   # a node in two fixed sets: the last one wins
        fixed_dofs, idx = np.unique(fixed_dofs[::-1], return_index=True)
        fixed_vals = fixed_vals[::-1][idx]
    done("assembly", t0)
    t0 = time.perf_counter()
    u, info = fem.solve_linear(sp.csr_matrix(K), f, fixed_dofs, fixed_vals, solver, near_null, free_body=free_body,
                               mass_modes=fem.mass_weighted_modes(mesh.nodes, mesh.elements) if free_body else None,
                               mesh=mesh)
    stress = None
    if study.kind == "elasticity":
        u = u.reshape(-1, 3)
        stress = fem.von_mises(fem.nodal_stress(mesh.nodes, mesh.elements, u, Ev, nuv))
    done("solve", t0)
    return Result(study.kind, mesh, u, timings, info, stress, surf_stats, boundary)
