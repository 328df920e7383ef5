"""Studies on scenes: ``Heat`` and ``Elasticity`` declarations whose boundary conditions name the
scene's materials, and ``simulate(tape, study)``: surface -> tetrahedra -> assembly -> solve.

A boundary face belongs to the material the tape reports at the face's centroid (the leaf nearest
to it); an element to the material at its centroid. Names come from ``surface.material_names``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Callable

import numpy as np
import scipy.sparse as sp

from taperay.runtime.tape import Tape, TaperayError

from . import fem
from .surface import DEFAULT_RESOLUTION, default_walker, material_names
from .tetmesh import TetMesh, mesh_part

__all__ = ["Heat", "Elasticity", "Result", "simulate", "study_from", "face_materials", "element_materials",
           "mesh_materials"]


@dataclass
class Heat:
    """Steady heat conduction, -div(k grad T) = s. Every dict is keyed by material name; a plain
    number for ``conductivity`` / ``source`` applies to every material.

    conductivity  W/(m K) per material;  source  W/m^3 per material (volumetric);
    fixed_temperature  {name: T};  heat_flux  {name: q} W/m^2 flowing INTO the part;
    convection  {name: (h W/(m^2 K), T_inf)}."""
    conductivity: float | dict = 1.0
    source: float | dict = 0.0
    fixed_temperature: dict = field(default_factory=dict)
    heat_flux: dict = field(default_factory=dict)
    convection: dict = field(default_factory=dict)
    kind = "heat"


@dataclass
class Elasticity:
    """Linear isotropic elasticity. ``E`` (Pa) and ``nu`` per material (or one number);
    fixed  {name: None (all components 0) | (ux, uy, uz) with None for a free component};
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


STUDIES = {"heat": Heat, "elasticity": Elasticity}


def study_from(obj) -> Heat | Elasticity:
    """A study from a Heat / Elasticity, or from a plain dict ``{"type": "heat" | "elasticity", ...}``
    (what a scene file declares: scene files import no solvers)."""
    if isinstance(obj, (Heat, Elasticity)):
        return obj
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


def mesh_materials(tape: Tape, mesh: TetMesh, walker=None):
    """(material names, boundary faces, each element's material id, ``faces_of(name, what)``: the
    boundary faces carrying material ``name``; ``what`` names the boundary condition in errors)."""
    names = material_names(tape)
    faces = mesh.boundary_faces()
    fmat = face_materials(tape, mesh.nodes, faces, walker)
    emat = element_materials(tape, mesh.nodes, mesh.elements, walker)
    present = set(np.unique(fmat).tolist())

    def faces_of(name, what):
        return faces[np.isin(fmat, _ids(names, name, present, what))]
    return names, faces, emat, faces_of


def _ids(names: list[str], name: str, present: set[int], what: str) -> np.ndarray:
    ids = [i for i, n in enumerate(names) if n == name]
    if not ids:
        raise TaperayError(f"{what}: the scene has no material named {name!r} (materials: "
                           f"{', '.join(sorted(set(names)))})")
    if not present & set(ids):
        raise TaperayError(f"{what}: no boundary face of the mesh carries material {name!r}; "
                           "is that part exposed, or finer than the grid?")
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
        raise TaperayError(f"{what}: no value for material(s) {missing} (give them, or a '*' default)")
    return out


def _check_supports(study: Elasticity, fixed: list) -> None:
    if study.free_body and fixed:
        raise TaperayError("elasticity study: free_body=True means no supports, but `fixed` names some")
    if not study.free_body and not fixed:
        raise TaperayError("elasticity study: no fixed support; the part would float "
                           "(a part whose loads balance may say free_body=True)")


# ---------------------------------------------------------------- result

@dataclass
class Result:
    """A solved study: the mesh, the field (temperature (N,) or displacement (N, 3)), von Mises
    stress at the nodes (elasticity), stage timings (seconds) and solver information."""
    kind: str
    mesh: TetMesh
    field: np.ndarray
    timings: dict
    solver: dict
    stress: np.ndarray | None = None
    surface_stats: dict = field(default_factory=dict)

    def summary(self) -> dict:
        s = {"study": self.kind, "order": self.mesh.order, "nodes": int(len(self.mesh.nodes)),
             "elements": int(len(self.mesh.elements)), "dof": int(self.solver.get("dofs", 0)),
             "solver": self.solver.get("method"), "iterations": int(self.solver.get("iterations", 0)),
             "residual": self.solver.get("residual"), "timings": dict(self.timings)}
        if "ranks" in self.solver:
            s["ranks"] = int(self.solver["ranks"])
        if self.kind == "heat":
            s.update(max_temperature=float(self.field.max()), min_temperature=float(self.field.min()),
                     mean_temperature=float(_volume_mean(self.mesh, self.field)))
        else:
            mag = np.linalg.norm(self.field, axis=1)
            s.update(max_displacement=float(mag.max()),
                     max_von_mises=float(self.stress.max()) if self.stress is not None else None)
        return s

    def save_vtu(self, path) -> None:
        """The mesh and its fields as VTU (ParaView), through meshio."""
        from .tetmesh import _need
        meshio = _need("meshio")
        cell = "tetra" if self.mesh.order == 1 else "tetra10"
        data = {"temperature": self.field} if self.kind == "heat" else {"displacement": self.field}
        if self.stress is not None:
            data["von_mises"] = self.stress
        meshio.write(str(path), meshio.Mesh(self.mesh.nodes, [(cell, self.mesh.elements)], point_data=data))

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
             surface: str = "mc", **tet_options) -> Result:
    """Solve ``study`` (Heat, Elasticity, or a study dict) on the part ``tape`` describes.

    Stages: surface and tets (``tetmesh.mesh_part`` at ``resolution``; ``surface`` "mc" (marching
    cubes), "dc" (dual contouring) or "auto" (dual contouring, marching cubes where TetGen fails); ``order`` 1 or 2,
    default 1 for heat, 2 for elasticity, which locks in shear on TET4; ``tet_options`` go to
    tet_mesh), assembly, solve (``solver``: "auto", "direct", "amg"; PETSc over MPI ranks is
    ``solvers.distributed.simulate_petsc``). A ready ``mesh`` skips the first two stages.
    ``progress(stage, seconds)`` is called after each stage."""
    study = study_from(study)
    order = order or (1 if study.kind == "heat" else 2)
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
    names, faces, emat, faces_of = mesh_materials(tape, mesh, walker)

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
    if study.kind == "elasticity":
        _check_supports(study, fixed)
    fixed_dofs = np.concatenate(fixed) if fixed else np.zeros(0, np.int64)
    fixed_vals = np.concatenate(vals) if vals else np.zeros(0)
    if len(fixed_dofs):   # a node in two fixed sets: the last one wins
        fixed_dofs, idx = np.unique(fixed_dofs[::-1], return_index=True)
        fixed_vals = fixed_vals[::-1][idx]
    done("assembly", t0)
    t0 = time.perf_counter()
    u, info = fem.solve_linear(sp.csr_matrix(K), f, fixed_dofs, fixed_vals, solver, near_null, free_body=free_body)
    stress = None
    if study.kind == "elasticity":
        u = u.reshape(-1, 3)
        stress = fem.von_mises(fem.nodal_stress(mesh.nodes, mesh.elements, u, Ev, nuv))
    done("solve", t0)
    return Result(study.kind, mesh, u, timings, info, stress, surf_stats)
