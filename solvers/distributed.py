"""A study solved by PETSc over MPI ranks: ``mpiexec -n N taperay simulate SCENE --solver petsc``
(``simulate_petsc``, the same pipeline as ``study.simulate``).

Rank 0 makes the mesh (surface, TetGen, the materials of faces and elements: ``shape.assemble``
without building the matrix), renumbers the nodes along the mesh's longest axis so that each
rank's contiguous range of nodes is one slab of the part, and broadcasts the mesh and the study's
terms. Every rank then assembles the rows of the nodes it owns, from the elements and boundary
faces that touch them (fem.py's vectorised assembly, so the rows are complete and no entry crosses
ranks), hands them to a distributed PETSc AIJ matrix, imposes the fixed values symmetrically
(``zeroRowsColumns``) and solves by conjugate gradients preconditioned by GAMG (with the rigid-body
modes as near-null space for elasticity); a TET10 system by the two-level preconditioner
(``_two_level``: PCMG over the P1 space on the corner nodes, whose operator GAMG solves, with
symmetric SOR and exact solves on the sliver elements' dofs as the TET10 level's smoother, as
``fem.amg_cg`` does), stopped on the true residual: at ``PETSC_RTOL``, or at the system's rounding
floor (``fem.rounding_floor``) where that lies above it (``_TrueResidualTest``). The field is
gathered on rank 0 in the mesh's own node order; the other ranks get None. A failure in one
rank's own work is raised on every rank (``_agree``), so that none is left in a collective step.

petsc4py and mpi4py are optional and not a pip extra: petsc4py builds against an installed PETSc
(README, "PETSc and MPI"; tools/setup_env.sh's ensure_petsc). The default install never imports them.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from taperay.runtime.tape import Tape, TaperayError

from . import fem
from .fem import AMG_CHECK, AMG_RESIDUAL_LIMIT, AMG_RTOL, AMG_STALL, FLOOR_FACTOR, RESIDUAL_LIMIT
from .surface import DEFAULT_RESOLUTION, check_resolution, default_walker
from .tetmesh import DEFAULT_PART_SURFACE, TetMesh, mesh_part

__all__ = ["mpi_rank", "solve_petsc", "simulate_petsc", "slab_order", "renumber", "PETSC_RTOL"]

PETSC_RTOL = AMG_RTOL       # CG's true relative residual |b - A x| / |b| at which the solve stops
PETSC_MAXITER = 2000
# GAMG's smoother on every level of a heat (scalar) system: symmetric SOR (PCSOR's default, local
# to each rank) in one Richardson step. GAMG's own default, Chebyshev on eigenvalue estimates, made
# the preconditioner indefinite on the heat sink's 1 M-DOF TET10 system (KSP DIVERGED_INDEFINITE_PC
# after 15 iterations). Elasticity keeps GAMG's default: with SOR, GAMG's setup failed on 2 ranks
# (KSP DIVERGED_PCSETUP_FAILED on the tests' shell)
GAMG_SMOOTHER = {"mg_levels_ksp_type": "richardson", "mg_levels_pc_type": "sor"}

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


def renumber(system, perm: np.ndarray) -> dict:
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


def _agree(comm, failure: tuple[str, str] | None) -> None:
    """Raise on every rank the first rank's failure ((exception type, message) or None on each rank),
    so that no rank enters a collective step that another has left: a failure in one rank's own
    work reaches the user once, from rank 0, as the reason itself."""
    failures = comm.allgather(failure)
    for rank, failed in enumerate(failures):
        if failed is not None:
            kind, message = failed
            if kind == "TaperayError":
                raise TaperayError(message)
            where = f" on rank {rank}" if len(failures) > 1 else ""
            raise TaperayError(f"internal error{where}: {kind}: {message}")


def _local(comm, work: Callable):
    """``work()`` on this rank, its failure (any exception) agreed on by all ranks (``_agree``)."""
    try:
        value, failure = work(), None
    except TaperayError as e:
        value, failure = None, ("TaperayError", str(e))
    except Exception as e:        # (MemoryError, a bug): every rank stops, none waits in a collective
        value, failure = None, (type(e).__name__, str(e))
    _agree(comm, failure)
    return value


class _RoundingFloor:
    """``fem.rounding_floor`` at x over the free rows of all ranks (|b| that of the free rows),
    from this rank's CSR rows (global columns) and load; x's entries in those columns come
    through one scatter."""

    def __init__(self, PETSc, rows, f_local: np.ndarray, fixed_local: np.ndarray, x, nb: float):
        columns, compact = np.unique(rows.indices, return_inverse=True)
        free = np.ones(len(f_local), bool)
        free[fixed_local] = False
        self.rows = type(rows)((np.abs(rows.data), compact, rows.indptr), shape=(rows.shape[0], len(columns)))[free]
        self.load = np.abs(f_local)[free]
        self.nb, self.mpi = nb, PETSc.COMM_WORLD.tompi4py()
        self.local = PETSc.Vec().createSeq(len(columns), comm=PETSc.COMM_SELF)
        index = PETSc.IS().createGeneral(columns.astype(PETSc.IntType), comm=PETSc.COMM_SELF)
        self.scatter = PETSc.Scatter().create(x, index, self.local, None)
        index.destroy()

    def __call__(self, x) -> float:
        self.scatter.scatter(x, self.local)
        return fem.rounding_floor(self.rows, np.abs(self.local.getArray()), self.load, self.nb, self.mpi.allreduce)

    def destroy(self):
        self.scatter.destroy()
        self.local.destroy()


class _TrueResidualTest:
    """KSP's convergence test on the true residual |b - A x| / |b_free| (b_free: b on the dofs that
    are not fixed), computed every AMG_CHECK iterations, when CG's own (updated) residual first
    passes the target and at the iteration limit. Converged at ``rtol``, or at the rounding floor
    (``_RoundingFloor``, estimated at each new best) where that is above ``rtol``: within
    FLOOR_FACTOR of it (never above RESIDUAL_LIMIT); stalled when its best value has not halved in
    AMG_STALL iterations. Unlike ``fem.amg_cg``, CG's own residual passing the target while the true
    one has not is no stop: near the floor the true one may still be falling (on 2 ranks, the 1
    M-DOF heat sink's was 3e-8 there and 1.1e-8 some iterations later). The iterate of least true
    residual is kept in ``best_x``. Every rank takes the same decision (the norms are global)."""

    def __init__(self, PETSc, A, b, x, nb: float, rtol: float, maxiter: int, floor: _RoundingFloor):
        self.PETSc, self.A, self.b, self.nb, self.rtol, self.maxiter = PETSc, A, b, nb, rtol, maxiter
        self.floor_of = floor
        self.r, self.best_x = x.duplicate(), x.copy()
        self.best, self.last, self.halved, self.halved_at, self.floor = 1.0, 1.0, 1.0, 0, 0.0
        self.target = rtol
        self.parted = False          # CG's own residual passed the target, the true one did not
        self.why: str | None = None

    def __call__(self, ksp, its: int, rnorm: float) -> int:
        Reason = self.PETSc.KSP.ConvergedReason
        if its == 0:
            return Reason.ITERATING
        passed = rnorm <= self.target * self.nb and not self.parted
        if not (passed or its % AMG_CHECK == 0 or its >= self.maxiter):
            return Reason.ITERATING
        x = ksp.getSolution()
        self.A.mult(x, self.r)                # (KSP's buildResidual gives CG's updated residual)
        self.r.aypx(-1.0, self.b)
        self.last = self.r.norm() / self.nb
        if not np.isfinite(self.last):
            self.why = "broke down (a value is not finite)"
            return Reason.DIVERGED_NANORINF
        if self.last < self.best:
            self.best = self.last
            x.copy(self.best_x)
            self.floor = self.floor_of(x)
            self.target = max(self.rtol, min(FLOOR_FACTOR * self.floor, RESIDUAL_LIMIT))
        if self.best <= self.target:
            return Reason.CONVERGED_RTOL
        if self.best <= self.halved / 2:
            self.halved_at, self.halved = its, self.best
        self.parted = self.parted or passed
        if its - self.halved_at >= AMG_STALL:
            self.why = "stalled"
            return Reason.CONVERGED_ITS       # (stopped by this test; the result is judged after the solve)
        return Reason.ITERATING

    def destroy(self):
        self.r.destroy()
        self.best_x.destroy()


def solve_petsc(terms: dict, rtol: float = PETSC_RTOL, maxiter: int = PETSC_MAXITER) -> tuple[np.ndarray | None, dict]:
    """Assemble this rank's rows of ``terms`` (``renumber``'s dict, the same on every rank), solve
    across all ranks by CG + GAMG, gather the field on rank 0. The stopping test is the true
    relative residual (``_TrueResidualTest``). The iterate of least true residual is the result
    when that residual is at most ``rtol`` (converged), ``fem.AMG_RESIDUAL_LIMIT`` or FLOOR_FACTOR
    times the rounding floor's estimate (``_RoundingFloor``; never above ``fem.RESIDUAL_LIMIT``, the
    direct solver's limit); above ``rtol``, ``info["note"]`` says why CG stopped and where the
    residual stands against the floor. Otherwise every rank raises one TaperayError with the
    reason; so does every rank when one rank's own assembly fails (``_agree``). Returns
    (u in the terms' node order on rank 0 and None elsewhere, info: method, dofs, free, ranks,
    iterations, residual, seconds, assembly_seconds[, note])."""
    PETSc = _petsc()
    comm = PETSc.COMM_WORLD
    mpi = comm.tompi4py()
    rank, size = comm.getRank(), comm.getSize()
    t0 = time.perf_counter()
    bs, nodes = terms["bs"], terms["nodes"]
    n_nodes = len(nodes)
    bounds = _ranges(n_nodes, size)
    lo, hi = int(bounds[rank]), int(bounds[rank + 1])
    rows, f_local = _local(mpi, lambda: _owned_rows(terms, lo, hi))
    nloc, ndof = bs * (hi - lo), bs * n_nodes
    A = PETSc.Mat().createAIJ(size=((nloc, ndof), (nloc, ndof)), bsize=bs,
                              csr=(rows.indptr.astype(PETSc.IntType), rows.indices.astype(PETSc.IntType),
                                   rows.data), comm=comm)
    A.assemble()
    x, b = A.createVecs()
    b.setArray(f_local)
    fixed, values = terms["fixed"], terms["values"]
    own = fixed[(fixed >= bs * lo) & (fixed < bs * hi)]
    own_values = values[(fixed >= bs * lo) & (fixed < bs * hi)]
    x.set(0.0)
    x.setValues(own.astype(PETSc.IntType), own_values)
    x.assemble()
    A.zeroRowsColumns(own.astype(PETSc.IntType), diag=1.0, x=x, b=b)
    if bs == 3:
        coords = PETSc.Vec().createWithArray(np.ascontiguousarray(nodes[lo:hi]).ravel(), size=(nloc, ndof),
                                             bsize=3, comm=comm)
        A.setNearNullSpace(PETSc.NullSpace().createRigidBody(coords))
    b_free = b.copy()
    b_free.setValues(own.astype(PETSc.IntType), np.zeros(len(own)))
    b_free.assemble()
    nb = b_free.norm()
    two_level = terms["elements"].shape[1] == 10
    level = _local(mpi, lambda: _p1_level(terms, lo, hi)) if two_level else None
    assembly_seconds = time.perf_counter() - t0
    ksp = PETSc.KSP().create(comm)
    ksp.setOperators(A)
    ksp.setType("cg")
    settings = {}
    if two_level:
        coarse_objects, settings = _two_level(PETSc, ksp.getPC(), A, level)
    else:
        coarse_objects = ()
        ksp.getPC().setType("gamg")
    if bs == 1:
        settings.update({("mg_coarse_" if two_level else "") + key: value for key, value in GAMG_SMOOTHER.items()})
    ksp.setNormType(PETSc.KSP.NormType.UNPRECONDITIONED)      # the updated residual, compared with the true one
    ksp.setTolerances(rtol=0.0, atol=0.0, max_it=maxiter)
    ksp.setInitialGuessNonzero(True)
    options = PETSc.Options()
    chosen = [key for key in settings if not options.hasName(key)]   # (PETSC_OPTIONS may choose)
    for key in chosen:
        options.setValue(key, settings[key])
    ksp.setFromOptions()
    ksp.setUp()
    floor_of = _RoundingFloor(PETSc, rows, f_local, own - bs * lo, x, nb)
    test = _TrueResidualTest(PETSc, A, b, x, nb, rtol, maxiter, floor_of)
    iterations, reason = 0, 0
    if nb > 0:
        ksp.setConvergenceTest(test)
        ksp.solve(b, x)
        reason, iterations = ksp.getConvergedReason(), ksp.getIterationNumber()
        test.best_x.copy(x)
    for key in chosen:     # (read as late as the first solve: GAMG's levels, the blocks' LU. The options
        options.delValue(key)  # database is the process's: a later solve starts afresh)
    best = test.best if nb > 0 else 0.0
    floor = (test.floor or floor_of(x)) if best > rtol else 0.0
    scatter, whole = PETSc.Scatter.toZero(x)
    scatter.scatter(x, whole)
    u = whole.getArray().copy() if rank == 0 else None
    info = {"method": "petsc", "dofs": int(ndof), "free": int(ndof - len(fixed)), "ranks": int(size),
            "iterations": int(iterations), "residual": float(best),
            "seconds": time.perf_counter() - t0, "assembly_seconds": assembly_seconds}
    why = test.why
    preconditioner = {"gamg": "GAMG", "hypre": "hypre", "mg": "two-level (P1: GAMG)"}.get(ksp.getPC().getType(),
                                                                                       ksp.getPC().getType())
    if ksp.getPC().getType() == "mg":       # (unless PETSC_OPTIONS chose another)
        info["preconditioner"] = "two-level"
    for obj in (test, floor_of, scatter, whole, b_free, x, b, A, ksp, *coarse_objects):
        obj.destroy()
    if best <= rtol:
        return u, info
    Reason = PETSc.KSP.ConvergedReason
    if why is None and reason == Reason.CONVERGED_RTOL:
        why = "reached the rounding floor"
    elif why is None:
        why = (f"reached its {maxiter}-iteration limit" if reason == Reason.DIVERGED_MAX_IT
               else f"stopped ({_reason_name(PETSc, reason)})")
    elif why == "stalled" and test.last > 1:
        why = "diverged"
    what = fem.floor_note(f"CG + {preconditioner}", why, best, iterations, floor)
    if best <= AMG_RESIDUAL_LIMIT or best <= min(FLOOR_FACTOR * floor, RESIDUAL_LIMIT):
        info["note"] = f"{what}; the target {rtol:g} is not reached"
        return u, info
    constrained = reason in (Reason.DIVERGED_INDEFINITE_MAT, Reason.DIVERGED_BREAKDOWN) or why == "diverged"
    raise TaperayError(f"the PETSc solve failed ({what})" + ("; is the problem constrained (a fixed temperature or "
                                                             "convection, enough supports)?" if constrained else ""))


def _p1_level(terms: dict, lo: int, hi: int):
    """This rank's part of the TET10 two-level preconditioner: its rows of ``fem.p1_prolongation``
    (CSR, global columns; the fixed dofs held), the coarse dofs it owns (those of its corner nodes:
    a contiguous range, the corners being numbered in the slabs' node order) out of all, their
    corners' coordinates, and the dofs of the sliver elements (``fem.sliver_blocks``) whose first
    node is its own."""
    bs, nodes, elements = terms["bs"], terms["nodes"], terms["elements"]
    P, fine_of = fem.p1_prolongation(elements, len(nodes), bs, terms["fixed"])
    rows = P[bs * lo:bs * hi].tocsr()
    rows.sort_indices()
    clo, chi = (int(i) for i in np.searchsorted(fine_of, [bs * lo, bs * hi]))
    mine = (elements[:, 0] >= lo) & (elements[:, 0] < hi)
    sliver = np.unique(fem.sliver_blocks(nodes, elements[mine], bs))
    return rows, (clo, chi, len(fine_of)), nodes[fine_of[clo:chi:bs] // bs], sliver


def _two_level(PETSc, pc, A, level) -> tuple[tuple, dict]:
    """``pc`` made the TET10 two-level preconditioner (PCMG, two levels): the interpolation P from
    ``_p1_level``, the coarse operator P^T A P solved by GAMG (elasticity: the corners' rigid-body
    modes as its near-null space), and on the TET10 level one Richardson step of a symmetric
    composite: symmetric SOR (local to each rank) and an exact (LU) solve on the sliver elements'
    dofs (PCASM, one subdomain a rank). Returns (the objects to destroy after the solve, the options
    to set before ``setFromOptions``)."""
    rows, (clo, chi, ncoarse), corners, sliver = level
    comm = A.getComm()
    mpi = comm.tompi4py()
    bs = A.getBlockSize()
    (nloc, ndof), _ = A.getSizes()
    P = PETSc.Mat().createAIJ(size=((nloc, ndof), (chi - clo, ncoarse)), bsize=bs,
                              csr=(rows.indptr.astype(PETSc.IntType), rows.indices.astype(PETSc.IntType), rows.data),
                              comm=comm)
    P.assemble()
    Ac = A.ptap(P)
    objects = [P, Ac]
    if bs == 3:
        coords = PETSc.Vec().createWithArray(np.ascontiguousarray(corners).ravel(), size=(chi - clo, ncoarse),
                                             bsize=3, comm=comm)
        Ac.setNearNullSpace(PETSc.NullSpace().createRigidBody(coords))
        objects.append(coords)
    pc.setType("mg")
    pc.setMGLevels(2)
    pc.setMGType(PETSc.PC.MGType.MULTIPLICATIVE)
    pc.setMGInterpolation(1, P)
    coarse = pc.getMGCoarseSolve()
    coarse.setOperators(Ac)
    coarse.setType("preonly")
    coarse.getPC().setType("gamg")
    smoother = pc.getMGSmoother(1)
    smoother.setType("richardson")
    smoother.setTolerances(max_it=1)
    relax = smoother.getPC()
    settings = {}
    if mpi.allreduce(len(sliver)) == 0:
        relax.setType("sor")
        return tuple(objects), settings
    relax.setType("composite")
    relax.setCompositeType(PETSc.PC.CompositeType.SYMMETRIC_MULTIPLICATIVE)
    relax.addCompositePCType("sor")
    relax.addCompositePCType("asm")
    blocks = relax.getCompositePC(1)
    blocks.setASMType(PETSc.PC.ASMType.BASIC)
    index = PETSc.IS().createGeneral(sliver.astype(PETSc.IntType), comm=PETSc.COMM_SELF)
    blocks.setASMLocalSubdomains(1, [index])
    objects.append(index)
    prefix = blocks.getOptionsPrefix() or ""
    settings.update({prefix + "sub_ksp_type": "preonly", prefix + "sub_pc_type": "lu"})
    return tuple(objects), settings


def _reason_name(PETSc, reason: int) -> str:
    names = {getattr(PETSc.KSP.ConvergedReason, n): n for n in dir(PETSc.KSP.ConvergedReason) if n.isupper()}
    return names.get(reason, str(reason))


def simulate_petsc(tape: Tape, study, order: int | None = None, resolution: int = DEFAULT_RESOLUTION, walker=None,
                   progress: Callable[[str, float], None] | None = None, mesh=None, surface: str = DEFAULT_PART_SURFACE,
                   **tet_options):
    """``study.simulate`` with PETSc as the solver, called on every rank of MPI's world (the same
    arguments on each): rank 0 returns the Result, the others None. Stage timings are rank 0's. The
    study is checked against the scene on every rank, the resolution on rank 0, before meshing."""
    from .shape import assemble
    from .study import Result, boundary_check, check_study, mesh_materials

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
            materials = mesh_materials(tape, mesh, walker, surf_stats.get("resolution"))   # (the faces found once)
            boundary = boundary_check(tape, mesh, materials[1], walker, surf_stats.get("spacing"))
            system = assemble(tape, study, mesh, walker, build=False, materials=materials)
            perm = slab_order(mesh.nodes)
            terms = renumber(system, perm)
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
