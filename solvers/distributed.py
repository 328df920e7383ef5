"""A study solved by PETSc over MPI ranks: ``mpiexec -n N taperay simulate SCENE --solver petsc``
(``simulate_petsc``, the same pipeline as ``study.simulate``).

Rank 0 makes the mesh (surface, TetGen, the materials of faces and elements: ``shape.assemble``
without building the matrix), renumbers the nodes along the mesh's longest axis so that each
rank's contiguous range of nodes is one slab of the part, and broadcasts the mesh and the study's
terms. Every rank then assembles the rows of the nodes it owns, from the elements and boundary
faces that touch them (fem.py's vectorised assembly, so the rows are complete and no entry crosses
ranks), hands them to a distributed PETSc AIJ matrix, imposes the fixed values symmetrically
(``zeroRowsColumns``) and solves by conjugate gradients preconditioned by GAMG (with the rigid-body
modes as near-null space for elasticity). The field is gathered on rank 0 in the mesh's own node
order; the other ranks get None.

petsc4py and mpi4py are optional and not a pip extra: petsc4py builds against an installed PETSc
(README, "PETSc and MPI"; tools/setup_env.sh's ensure_petsc). The default install never imports them.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from taperay.runtime.tape import Tape, TaperayError

from .surface import DEFAULT_RESOLUTION, check_resolution, default_walker
from .tetmesh import DEFAULT_PART_SURFACE, TetMesh, mesh_part

__all__ = ["mpi_rank", "solve_petsc", "simulate_petsc", "slab_order", "PETSC_RTOL"]

PETSC_RTOL = 1e-10          # CG's relative residual |b - A x| / |b| at which the solve stops
_INSTALL = ("the PETSc solver needs petsc4py and mpi4py built against a PETSc: "
            "apt-get install libpetsc-real-dev, then "
            "PETSC_DIR=/usr/lib/petscdir/petsc3.18/x86_64-linux-gnu-real pip install --no-build-isolation "
            "'petsc4py==3.18.5' mpi4py (README: PETSc and MPI)")


def _petsc():
    try:
        import petsc4py
        petsc4py.init()
        from petsc4py import PETSc
    except ImportError as e:
        raise TaperayError(f"{_INSTALL} ({e})") from None
    return PETSc


def _comm():
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise TaperayError(f"{_INSTALL} ({e})") from None
    return MPI.COMM_WORLD


def mpi_rank() -> int:
    """This process's rank in MPI's world (0 when not started by mpiexec)."""
    return _comm().Get_rank()


def slab_order(nodes: np.ndarray) -> np.ndarray:
    """A permutation of the nodes (new -> old) sorted along the longest side of their bounding box:
    contiguous ranges of it are slabs, so a rank's nodes share few elements with another's."""
    nodes = np.asarray(nodes, float)
    axis = int(np.argmax(np.ptp(nodes, axis=0)))
    return np.argsort(nodes[:, axis], kind="stable")


def _ranges(n_nodes: int, size: int) -> np.ndarray:
    return np.linspace(0, n_nodes, size + 1).round().astype(np.int64)


def _renumber(system, perm: np.ndarray) -> dict:
    """The study's terms with nodes renumbered by ``perm`` (new -> old), as a picklable dict."""
    inv = np.empty_like(perm)
    inv[perm] = np.arange(len(perm))
    bs = system.ncomp
    fixed = np.asarray(system.fixed, np.int64)
    return {
        "kind": system.kind, "bs": bs,
        "nodes": system.mesh.nodes[perm], "elements": inv[system.mesh.elements],
        "k": system.k, "s": system.s, "E": system.E, "nu": system.nu, "body_force": system.body_force,
        "flux": [(inv[f], q) for f, q in system.flux],
        "convection": [(inv[f], h, t) for f, h, t in system.convection],
        "traction": [(inv[f], t) for f, t in system.traction],
        "pressure": [(inv[f], p) for f, p in system.pressure],
        "fixed": bs * inv[fixed // bs] + fixed % bs, "values": np.asarray(system.values, float),
    }


def _owned_rows(terms: dict, lo: int, hi: int):
    """(CSR matrix of the rows, load) of the dofs of nodes lo..hi-1, assembled from the elements and
    faces that touch those nodes only."""
    from .shape import System

    def touching(items):
        return np.any((items >= lo) & (items < hi), axis=1)

    el = terms["elements"]
    mine = touching(el)
    faces = {key: [(f[touching(f)], *rest) for f, *rest in terms[key]]
             for key in ("flux", "convection", "traction", "pressure")}
    per_element = {key: (None if terms[key] is None else np.asarray(terms[key])[mine]) for key in ("k", "s", "E", "nu")}
    part = System(terms["kind"], TetMesh(terms["nodes"], el[mine]), None, None, terms["fixed"], terms["values"],
                  body_force=terms["body_force"], **per_element, **faces)
    part.build()
    bs = terms["bs"]
    rows = part.K[bs * lo:bs * hi].tocsr()
    rows.sort_indices()
    return rows, part.f[bs * lo:bs * hi]


def solve_petsc(terms: dict, rtol: float = PETSC_RTOL) -> tuple[np.ndarray | None, dict]:
    """Assemble this rank's rows of ``terms`` (``_renumber``'s dict, the same on every rank), solve
    across all ranks, gather the field on rank 0. Returns (u in the terms' node order on rank 0 and
    None elsewhere, info: method, dofs, ranks, iterations, residual, seconds, assembly_seconds)."""
    PETSc = _petsc()
    comm = PETSc.COMM_WORLD
    rank, size = comm.getRank(), comm.getSize()
    t0 = time.perf_counter()
    bs, nodes = terms["bs"], terms["nodes"]
    n_nodes = len(nodes)
    bounds = _ranges(n_nodes, size)
    lo, hi = int(bounds[rank]), int(bounds[rank + 1])
    rows, f_local = _owned_rows(terms, lo, hi)
    nloc, ndof = bs * (hi - lo), bs * n_nodes
    A = PETSc.Mat().createAIJ(size=((nloc, ndof), (nloc, ndof)), bsize=bs,
                              csr=(rows.indptr.astype(PETSc.IntType), rows.indices.astype(PETSc.IntType),
                                   rows.data), comm=comm)
    A.assemble()
    x, b = A.createVecs()
    b.setArray(f_local)
    fixed, values = terms["fixed"], terms["values"]
    own = (fixed >= bs * lo) & (fixed < bs * hi)
    x.set(0.0)
    x.setValues(fixed[own].astype(PETSc.IntType), values[own])
    x.assemble()
    A.zeroRowsColumns(fixed[own].astype(PETSc.IntType), diag=1.0, x=x, b=b)
    if bs == 3:
        coords = PETSc.Vec().createWithArray(np.ascontiguousarray(nodes[lo:hi]).ravel(), size=(nloc, ndof),
                                             bsize=3, comm=comm)
        A.setNearNullSpace(PETSc.NullSpace().createRigidBody(coords))
    assembly_seconds = time.perf_counter() - t0
    ksp = PETSc.KSP().create(comm)
    ksp.setOperators(A)
    ksp.setType("cg")
    ksp.getPC().setType("gamg")
    ksp.setNormType(PETSc.KSP.NormType.UNPRECONDITIONED)      # rtol bounds the true residual
    ksp.setTolerances(rtol=rtol, atol=0.0, max_it=2000)
    ksp.setInitialGuessNonzero(True)
    ksp.setFromOptions()
    ksp.solve(b, x)
    reason = ksp.getConvergedReason()
    r = b.duplicate()
    A.mult(x, r)
    r.aypx(-1.0, b)
    residual = r.norm() / max(b.norm(), 1e-300)
    scatter, whole = PETSc.Scatter.toZero(x)
    scatter.scatter(x, whole)
    u = whole.getArray().copy() if rank == 0 else None
    info = {"method": "petsc", "dofs": int(ndof), "free": int(ndof - len(fixed)), "ranks": int(size),
            "iterations": int(ksp.getIterationNumber()), "residual": float(residual),
            "seconds": time.perf_counter() - t0, "assembly_seconds": assembly_seconds}
    for obj in (scatter, whole, r, x, b, A, ksp):
        obj.destroy()
    if reason < 0 or not np.isfinite(residual) or residual > 1e-6:
        raise TaperayError(f"the PETSc solve failed (KSP reason {reason}, relative residual {residual:.3g}); "
                           "is the problem constrained (a fixed temperature or convection, enough supports)?")
    return u, info


def simulate_petsc(tape: Tape, study, order: int | None = None, resolution: int = DEFAULT_RESOLUTION, walker=None,
                   progress: Callable[[str, float], None] | None = None, mesh=None, surface: str = DEFAULT_PART_SURFACE,
                   **tet_options):
    """``study.simulate`` with PETSc as the solver, called on every rank of MPI's world (the same
    arguments on each): rank 0 returns the Result, the others None. Stage timings are rank 0's. The
    study is checked against the scene on every rank, the resolution on rank 0, before meshing."""
    from . import fem
    from .shape import assemble
    from .study import Result, boundary_check, check_study

    study = check_study(tape, study)
    order = order or (1 if study.kind == "heat" else 2)
    if study.kind == "elasticity" and study.free_body:
        raise TaperayError("the PETSc solver does not take free_body=True studies; use --solver auto")
    comm = _comm()
    rank = comm.Get_rank()
    timings: dict[str, float] = {}
    surf_stats: dict = {}

    terms = system = perm = None
    failure = None
    if rank == 0:
        try:
            walker = default_walker(walker)
            if mesh is None:      # (memory is rank 0's to check: it alone meshes)
                check_resolution(resolution, tape, method=surface, study=study, order=order)
                mesh, surf_stats, made = mesh_part(tape, resolution, order, walker, surface, progress, **tet_options)
                timings.update(made)
            t0 = time.perf_counter()
            boundary = boundary_check(tape, mesh, walker=walker, cell=surf_stats.get("spacing"))
            system = assemble(tape, study, mesh, walker, build=False)
            perm = slab_order(mesh.nodes)
            terms = _renumber(system, perm)
        except TaperayError as e:
            failure = str(e)
    failure = comm.bcast(failure, root=0)
    if failure is not None:
        raise TaperayError(failure)
    terms = comm.bcast(terms, root=0)
    prepared = time.perf_counter()
    u, info = solve_petsc(terms)
    if rank != 0:
        return None
    timings["assembly"] = prepared - t0 + info["assembly_seconds"]
    if progress:
        progress("assembly", timings["assembly"])
    field = np.empty_like(u)
    bs = terms["bs"]
    field.reshape(-1, bs)[perm] = u.reshape(-1, bs)
    stress = None
    t1 = time.perf_counter()
    if study.kind == "elasticity":
        field = field.reshape(-1, 3)
        stress = fem.von_mises(fem.nodal_stress(mesh.nodes, mesh.elements, field, system.E, system.nu))
    timings["solve"] = info["seconds"] - info["assembly_seconds"] + time.perf_counter() - t1
    if progress:
        progress("solve", timings["solve"])
    return Result(study.kind, mesh, field, timings, info, stress, surf_stats, boundary)
