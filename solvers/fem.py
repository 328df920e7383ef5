"""Finite elements on TET4 / TET10 meshes: steady heat conduction and linear elasticity.

Assembly is vectorised over elements (einsum over blocks of elements, one COO -> CSR conversion);
quadrature rules are collapsed Gauss-Jacobi products on the reference tetrahedron / triangle,
exact to the degree asked: stiffness 2(p-1) (exact for straight-sided elements), loads, boundary
mass and sources 2p (callables: 2p + 2). Node order: VTK's (``TET10_EDGES``, ``TET_FACES``; the
elements' ``dihedral_angles``).

Low-level API (meshes and face / node sets): ``heat_system``, ``elasticity_system``,
``face_load``, ``face_mass``, ``solve_linear`` (the sparse solve: ``symmetric_lu``, ``amg_cg`` and
the fallback from one to the other; TET10's two-level preconditioner, ``p1_prolongation`` and
``sliver_blocks``; the rounding floor of an iterative solve, ``rounding_floor`` and ``floor_note``,
which the PETSc path (solvers.distributed) shares). The study layer (``Heat``, ``Elasticity``,
boundary conditions by material name) is in solvers.study.
"""
from __future__ import annotations

import math
import time
import warnings
from functools import lru_cache

import numpy as np
import scipy.sparse as sp

from taperay.runtime.resources import available_memory, format_bytes
from taperay.runtime.tape import TaperayError

__all__ = ["tet_rule", "tri_rule", "shape_functions", "shape_derivatives", "tri_shape_functions",
           "heat_system", "elasticity_system", "face_load", "face_mass", "solve_linear", "rigid_body_modes",
           "nodal_stress", "von_mises", "amg_cg", "symmetric_lu", "direct_memory", "p1_prolongation", "sliver_blocks",
           "dihedral_angles", "TET10_EDGES", "TET_FACES",
           "rounding_floor", "floor_note", "DIRECT_MAX_DOF", "SOLVER_METHODS", "FLOOR_FACTOR", "SLIVER_DEGREES"]

DIRECT_MAX_DOF = 20_000     # "auto": the direct solver up to this many free dofs, AMG-CG above
SOLVER_METHODS = ("auto", "direct", "amg")
RESIDUAL_LIMIT = 1e-6       # a direct solution whose true relative residual is above this is refused
AMG_RTOL = 1e-10            # AMG-CG's target true relative residual |b - A x| / |b|
AMG_RESIDUAL_LIMIT = 1e-8   # AMG-CG's best iterate is kept up to this; above it, the direct solver takes over
AMG_MAXITER = 500
AMG_CHECK = 10              # iterations between true residuals
AMG_STALL = 50              # iterations without the best true residual halving: stalled
AMG_COARSE = 500            # smoothed aggregation's coarsest level: at most this many unknowns
FLOOR_FACTOR = 10           # CG stops within this factor of its rounding floor's estimate (where above rtol):
                            # a normwise backward error of about 10 epsilon
SLIVER_DEGREES = 5.0        # two-level smoother: elements with a dihedral angle below this (or above 180 less
                            # this) are solved exactly (heat sink, 1 M DOF: 285 CG iterations -> 20); the
                            # mesh's quality report counts them too (study.mesh_quality)
LU_FILL, LU_BYTES = 0.3, 24  # direct_memory: measured 0.24-0.28 and 19-21 B on TET10 systems of 37k-161k dofs
ELEMENT_BLOCK = 20_000      # elements per vectorised assembly block (bounds the temporaries)


# ---------------------------------------------------------------- quadrature

def _gj01(n: int, alpha: int):
    """Gauss-Jacobi on [0, 1] for the weight (1 - s)^alpha."""
    from scipy.special import roots_jacobi
    x, w = roots_jacobi(n, alpha, 0)
    return (x + 1) / 2, w / 2 ** (alpha + 1)


@lru_cache(maxsize=None)
def tet_rule(degree: int) -> tuple[np.ndarray, np.ndarray]:
    """Points (Q, 3) and weights (Q,) on the reference tetrahedron (volume 1/6), exact for
    polynomials of total degree ``degree``. degree <= 1: the centroid; 2: the symmetric 4-point
    rule (TET10's stiffness, half the points of the product rule)."""
    if degree <= 1:
        return np.array([[0.25, 0.25, 0.25]]), np.array([1 / 6])
    if degree == 2:
        a, b = (5 + 3 * math.sqrt(5)) / 20, (5 - math.sqrt(5)) / 20
        bary = np.full((4, 4), b) + np.eye(4) * (a - b)
        return bary[:, 1:], np.full(4, 1 / 24)
    n = math.ceil((degree + 1) / 2)
    a, wa = _gj01(n, 0)
    b, wb = _gj01(n, 1)
    c, wc = _gj01(n, 2)
    A, B, C = np.meshgrid(a, b, c, indexing="ij")
    W = np.einsum("i,j,k->ijk", wa, wb, wc)
    pts = np.stack([A * (1 - B) * (1 - C), B * (1 - C), C], -1).reshape(-1, 3)
    return pts, W.ravel()


@lru_cache(maxsize=None)
def tri_rule(degree: int) -> tuple[np.ndarray, np.ndarray]:
    """Points (Q, 2) and weights on the reference triangle (area 1/2), exact to ``degree``."""
    if degree <= 1:
        return np.array([[1 / 3, 1 / 3]]), np.array([0.5])
    n = math.ceil((degree + 1) / 2)
    a, wa = _gj01(n, 0)
    b, wb = _gj01(n, 1)
    A, B = np.meshgrid(a, b, indexing="ij")
    return np.stack([A * (1 - B), B], -1).reshape(-1, 2), np.outer(wa, wb).ravel()


# ---------------------------------------------------------------- shape functions

TET10_EDGES = ((0, 1), (1, 2), (0, 2), (0, 3), (1, 3), (2, 3))          # columns 4..9 (VTK): each edge's ends
# faces of a positively oriented tet, outward, as local corner triples (opposite corner 0, 1, 2, 3)
TET_FACES = ((1, 2, 3), (0, 3, 2), (0, 1, 3), (0, 2, 1))
_DL = np.array([[-1.0, -1.0, -1.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])


def _bary(pts):
    pts = np.atleast_2d(np.asarray(pts, float))
    return np.concatenate([1 - pts.sum(1, keepdims=True), pts], 1)


def shape_functions(n: int, pts) -> np.ndarray:
    """(Q, n) values of the TET4 (n=4) or TET10 (n=10) shape functions at reference points."""
    L = _bary(pts)
    if n == 4:
        return L
    return np.concatenate([L * (2 * L - 1), np.stack([4 * L[:, a] * L[:, b] for a, b in TET10_EDGES], 1)], 1)


def shape_derivatives(n: int, pts) -> np.ndarray:
    """(Q, n, 3) reference derivatives of the shape functions."""
    L = _bary(pts)
    Q = len(L)
    if n == 4:
        return np.broadcast_to(_DL, (Q, 4, 3)).copy()
    corner = (4 * L - 1)[:, :, None] * _DL[None]
    mid = np.stack([4 * (L[:, a, None] * _DL[b] + L[:, b, None] * _DL[a]) for a, b in TET10_EDGES], 1)
    return np.concatenate([corner, mid], 1)


def tri_shape_functions(n: int, pts) -> tuple[np.ndarray, np.ndarray]:
    """Values (Q, n) and reference derivatives (Q, n, 2) of the 3- or 6-node triangle (corners,
    then mid-edge nodes of (0,1), (1,2), (2,0))."""
    pts = np.atleast_2d(np.asarray(pts, float))
    M = np.concatenate([1 - pts.sum(1, keepdims=True), pts], 1)
    dM = np.array([[-1.0, -1.0], [1.0, 0.0], [0.0, 1.0]])
    if n == 3:
        return M, np.broadcast_to(dM, (len(M), 3, 2)).copy()
    edges = ((0, 1), (1, 2), (2, 0))
    N = np.concatenate([M * (2 * M - 1), np.stack([4 * M[:, a] * M[:, b] for a, b in edges], 1)], 1)
    dN = np.concatenate([(4 * M - 1)[:, :, None] * dM[None],
                         np.stack([4 * (M[:, a, None] * dM[b] + M[:, b, None] * dM[a]) for a, b in edges], 1)], 1)
    return N, dN


# ---------------------------------------------------------------- geometry at quadrature points

def _geometry(X: np.ndarray, dN: np.ndarray):
    """X (E, n, 3) element nodes, dN (n, 3) reference derivatives at one point ->
    (detJ (E,), G (E, n, 3) physical derivatives). J's inverse comes from its cofactors (cross
    products of its rows), several times faster than numpy.linalg's batched 3 x 3 inverse."""
    J = np.matmul(X.transpose(0, 2, 1), dN)                 # J_ij = sum_a X_ai dN_aj
    r0, r1, r2 = J[:, 0], J[:, 1], J[:, 2]
    c0, c1, c2 = np.cross(r1, r2), np.cross(r2, r0), np.cross(r0, r1)
    det = np.einsum("ei,ei->e", r0, c0)
    if np.any(det <= 0):
        raise TaperayError(f"{int(np.count_nonzero(det <= 0))} elements are inverted or flat (Jacobian <= 0)")
    return det, np.matmul(dN, np.stack([c0, c1, c2], -1) / det[:, None, None])


def _per_element(value, E: int, what: str) -> np.ndarray:
    v = np.asarray(value, float)
    if v.ndim == 0:
        return np.full(E, float(v))
    if v.shape != (E,):
        raise TaperayError(f"{what}: expected a number or one value per element ({E}), got shape {v.shape}")
    return v


def _blocks(E: int, size: int = ELEMENT_BLOCK):
    for s in range(0, E, size):
        yield slice(s, min(E, s + size))


def _coo(elements_dofs: list, values: list, ndof: int) -> sp.csr_matrix:
    """The CSR matrix of the element matrices summed; 32-bit indices where they fit (the 1 M-DOF
    TET10 heat system: 7.2-7.6 s against 11.5-15.7 s with 64-bit ones)."""
    index = np.int32 if ndof < 2 ** 31 else np.int64
    rows = np.concatenate([np.repeat(d.astype(index), d.shape[1], axis=1).ravel() for d in elements_dofs])
    cols = np.concatenate([np.tile(d.astype(index), (1, d.shape[1])).ravel() for d in elements_dofs])
    data = np.concatenate([v.ravel() for v in values])
    return sp.coo_matrix((data, (rows, cols)), shape=(ndof, ndof)).tocsr()


def _volume_load(nodes, elements, value, ncomp: int, degree_extra: int = 0) -> np.ndarray:
    """sum over elements of int N_a value (value: per element array (E,) / (E, ncomp), a constant,
    or a callable of points (M, 3) -> (M,) / (M, ncomp))."""
    E, n = elements.shape
    p = 1 if n == 4 else 2
    deg = 2 * p + (2 if callable(value) else 0) + degree_extra
    pts, wts = tet_rule(deg)
    Nq = shape_functions(n, pts)
    dNq = shape_derivatives(n, pts)
    f = np.zeros((len(nodes), ncomp))
    for blk in _blocks(E):
        el = elements[blk]
        X = nodes[el]
        fe = np.zeros((len(el), n, ncomp))
        for q in range(len(wts)):
            det, _ = _geometry(X, dNq[q])
            if callable(value):
                xq = np.einsum("a,eai->ei", Nq[q], X)
                val = np.asarray(value(xq), float).reshape(len(el), ncomp)
            else:
                v = np.asarray(value, float)
                per_element = v.ndim and v.shape[0] == E
                val = np.broadcast_to(v[blk].reshape(len(el), -1) if per_element else v, (len(el), ncomp))
            fe += (wts[q] * det)[:, None, None] * Nq[q][None, :, None] * val[:, None, :]
        np.add.at(f, el.ravel(), fe.reshape(-1, ncomp))
    return f if ncomp > 1 else f[:, 0]


# ---------------------------------------------------------------- heat

def heat_system(nodes, elements, conductivity, source=0.0) -> tuple[sp.csr_matrix, np.ndarray]:
    """Stiffness K (N, N) of -div(k grad T) = s and the load of ``source`` s. ``conductivity``: a
    number or one per element; ``source``: a number, one per element, or a callable of points."""
    nodes = np.asarray(nodes, float)
    elements = np.asarray(elements, np.int64)
    E, n = elements.shape
    k = _per_element(conductivity, E, "conductivity")
    pts, wts = tet_rule(2 * (1 if n == 4 else 2) - 2)
    dNq = shape_derivatives(n, pts)
    dofs, vals = [], []
    for blk in _blocks(E):
        el = elements[blk]
        X = nodes[el]
        Ke = np.zeros((len(el), n, n))
        for q in range(len(wts)):
            det, G = _geometry(X, dNq[q])
            Ke += (wts[q] * det * k[blk])[:, None, None] * np.matmul(G, G.transpose(0, 2, 1))
        dofs.append(el)
        vals.append(Ke)
    K = _coo(dofs, vals, len(nodes))
    f = np.zeros(len(nodes))
    if callable(source) or np.any(np.asarray(source) != 0):
        f = _volume_load(nodes, elements, source, 1)
    return K, f


# ---------------------------------------------------------------- elasticity

def lame(E, nu):
    E, nu = np.asarray(E, float), np.asarray(nu, float)
    return E * nu / ((1 + nu) * (1 - 2 * nu)), E / (2 * (1 + nu))


def elasticity_system(nodes, elements, E, nu, body_force=None) -> tuple[sp.csr_matrix, np.ndarray]:
    """Stiffness K (3N, 3N) of linear isotropic elasticity (dof 3 * node + component) and the load
    of ``body_force`` (force per volume: a 3-vector, (E, 3) per element, or a callable)."""
    nodes = np.asarray(nodes, float)
    elements = np.asarray(elements, np.int64)
    Ne, n = elements.shape
    lam, mu = lame(_per_element(E, Ne, "E"), _per_element(nu, Ne, "nu"))
    pts, wts = tet_rule(2 * (1 if n == 4 else 2) - 2)
    dNq = shape_derivatives(n, pts)
    dofs, vals = [], []
    for blk in _blocks(Ne, max(1, ELEMENT_BLOCK * 16 // (n * n))):
        el = elements[blk]
        X = nodes[el]
        m = len(el)
        Ke = np.zeros((m, n, 3, n, 3))
        for q in range(len(wts)):
            det, G = _geometry(X, dNq[q])
            w = wts[q] * det
            g = G.reshape(m, 3 * n)
            T = (g[:, :, None] * g[:, None, :]).reshape(m, n, 3, n, 3)        # G[a,i] G[b,j]
            Ke += (w * lam[blk])[:, None, None, None, None] * T
            Ke += (w * mu[blk])[:, None, None, None, None] * T.transpose(0, 1, 4, 3, 2)   # G[a,j] G[b,i]
            GG = np.matmul(G, G.transpose(0, 2, 1)) * (w * mu[blk])[:, None, None]
            for i in range(3):
                Ke[:, :, i, :, i] += GG
        dofs.append((3 * el[:, :, None] + np.arange(3)).reshape(len(el), -1))
        vals.append(Ke.reshape(len(el), 3 * n, 3 * n))
    K = _coo(dofs, vals, 3 * len(nodes))
    f = np.zeros(3 * len(nodes))
    if body_force is not None and (callable(body_force) or np.any(np.asarray(body_force) != 0)):
        f = _volume_load(nodes, elements, body_force, 3).ravel()
    return K, f


def rigid_body_modes(nodes) -> np.ndarray:
    """(3N, 6): three translations and three rotations about the centroid (pyamg's near-null space)."""
    x = np.asarray(nodes, float) - np.asarray(nodes, float).mean(0)
    N = len(x)
    B = np.zeros((N, 3, 6))
    for i in range(3):
        B[:, i, i] = 1.0
    # rotations: e_k x x
    B[:, 1, 3], B[:, 2, 3] = -x[:, 2], x[:, 1]
    B[:, 0, 4], B[:, 2, 4] = x[:, 2], -x[:, 0]
    B[:, 0, 5], B[:, 1, 5] = -x[:, 1], x[:, 0]
    return B.reshape(3 * N, 6)


def mass_weighted_modes(nodes, elements) -> np.ndarray:
    """(3N, 6): M B for ``rigid_body_modes``' B and the consistent mass matrix M, column j holding
    ∫ N_a b_j dV (b_j the mode's displacement field), by quadrature exact for the elements."""
    nodes = np.asarray(nodes, float)
    centre = nodes.mean(0)

    def mode(j):
        if j < 3:
            return lambda x: np.broadcast_to(np.eye(3)[j], x.shape)
        return lambda x: np.cross(np.eye(3)[j - 3], x - centre)
    return np.stack([_volume_load(nodes, elements, mode(j), 3).ravel() for j in range(6)], 1)


def nodal_stress(nodes, elements, u, E, nu) -> np.ndarray:
    """(N, 6) stress (xx, yy, zz, yz, xz, xy) at the nodes: each element's stress at its own nodes,
    averaged over the elements that share a node."""
    nodes = np.asarray(nodes, float)
    elements = np.asarray(elements, np.int64)
    Ne, n = elements.shape
    lam, mu = lame(_per_element(E, Ne, "E"), _per_element(nu, Ne, "nu"))
    ref = np.array([[0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1]] +
                   ([] if n == 4 else [list(0.5 * (np.eye(4)[a] + np.eye(4)[b])[1:]) for a, b in TET10_EDGES]), float)
    dN = shape_derivatives(n, ref)
    U = np.asarray(u, float).reshape(-1, 3)[elements]        # (E, n, 3)
    X = nodes[elements]
    acc = np.zeros((len(nodes), 6))
    cnt = np.zeros(len(nodes))
    for k in range(n):
        J = np.einsum("eai,aj->eij", X, dN[k])
        G = np.einsum("aj,eji->eai", dN[k], np.linalg.inv(J))
        grad = np.einsum("eai,eaj->eij", U, G)               # du_i/dx_j
        eps = 0.5 * (grad + grad.transpose(0, 2, 1))
        tr = np.trace(eps, axis1=1, axis2=2)
        s = 2 * mu[:, None, None] * eps + (lam * tr)[:, None, None] * np.eye(3)
        v = np.stack([s[:, 0, 0], s[:, 1, 1], s[:, 2, 2], s[:, 1, 2], s[:, 0, 2], s[:, 0, 1]], 1)
        np.add.at(acc, elements[:, k], v)
        np.add.at(cnt, elements[:, k], 1)
    return acc / np.maximum(cnt, 1)[:, None]


def von_mises(s: np.ndarray) -> np.ndarray:
    xx, yy, zz, yz, xz, xy = s.T
    return np.sqrt(0.5 * ((xx - yy) ** 2 + (yy - zz) ** 2 + (zz - xx) ** 2) + 3 * (yz ** 2 + xz ** 2 + xy ** 2))


# ---------------------------------------------------------------- boundary faces

def _face_geometry(nodes, faces, degree):
    """Quadrature on boundary faces (F, 3|6): (N (Q, m), points (F, Q, 3), weights*area (F, Q),
    unit outward normals (F, Q, 3))."""
    m = faces.shape[1]
    pts, wts = tri_rule(degree)
    N, dN = tri_shape_functions(m, pts)
    X = nodes[faces]                                         # (F, m, 3)
    xq = np.einsum("qa,fai->fqi", N, X)
    t1 = np.einsum("qa,fai->fqi", dN[:, :, 0], X)
    t2 = np.einsum("qa,fai->fqi", dN[:, :, 1], X)
    nrm = np.cross(t1, t2)
    jac = np.linalg.norm(nrm, axis=2)
    return N, xq, wts[None] * jac, nrm / np.maximum(jac, 1e-300)[:, :, None]


def face_load(nodes, faces, value, ncomp: int = 1, ndof_nodes: int | None = None) -> np.ndarray:
    """sum over faces of int N_a value dA: ``value`` a number / ncomp-vector, or a callable
    (points (F, Q, 3), normals (F, Q, 3)) -> (F, Q) or (F, Q, ncomp). Returns (N,) or (N * ncomp,)."""
    nodes = np.asarray(nodes, float)
    faces = np.asarray(faces, np.int64)
    Nn = ndof_nodes or len(nodes)
    f = np.zeros((Nn, ncomp))
    if not len(faces):
        return f.ravel() if ncomp > 1 else f[:, 0]
    p = 1 if faces.shape[1] == 3 else 2
    N, xq, wj, nrm = _face_geometry(nodes, faces, 2 * p + (2 if callable(value) else 0))
    if callable(value):
        val = np.asarray(value(xq, nrm), float).reshape(len(faces), len(N), ncomp)
    else:
        val = np.broadcast_to(np.asarray(value, float).reshape(1, 1, -1), (len(faces), len(N), ncomp))
    fe = np.einsum("fq,qa,fqc->fac", wj, N, val)
    np.add.at(f, faces.ravel(), fe.reshape(-1, ncomp))
    return f.ravel() if ncomp > 1 else f[:, 0]


def face_mass(nodes, faces, coefficient, n_nodes: int) -> sp.csr_matrix:
    """sum over faces of int h N_a N_b dA (convection's matrix), h a number."""
    faces = np.asarray(faces, np.int64)
    if not len(faces):
        return sp.csr_matrix((n_nodes, n_nodes))
    p = 1 if faces.shape[1] == 3 else 2
    N, _, wj, _ = _face_geometry(np.asarray(nodes, float), faces, 2 * p)
    Me = float(coefficient) * np.einsum("fq,qa,qb->fab", wj, N, N)
    return _coo([faces], [Me], n_nodes)


# ---------------------------------------------------------------- solving

def solve_linear(K: sp.csr_matrix, f: np.ndarray, fixed: np.ndarray | None = None, values: np.ndarray | None = None,
                 method: str = "auto", near_null: np.ndarray | None = None, rtol: float = AMG_RTOL,
                 free_body: bool = False, maxiter: int | None = None,
                 mass_modes: np.ndarray | None = None, mesh=None) -> tuple[np.ndarray, dict]:
    """Solve K u = f with u[fixed] = values (eliminated); K symmetric, positive definite on the
    free dofs. ``method``: "direct" (``symmetric_lu``; refused with one TaperayError before the
    factorisation where ``direct_memory`` exceeds the memory available), "amg" (``amg_cg``: CG
    preconditioned by pyamg smoothed aggregation, ``near_null`` its B; when it fails, the direct
    solver if ``direct_memory`` fits the memory available, else one TaperayError), "auto" (direct
    up to DIRECT_MAX_DOF free dofs, else amg). ``free_body``: K is singular by exactly the columns of
    ``near_null`` (an elastic part with no supports: its rigid-body modes) and u is the solution
    orthogonal to them; f must be orthogonal to them too (the loads balance), else TaperayError.
    ``mass_modes`` (``mass_weighted_modes``): the free body's rigid motion is then the one that
    keeps its centre of mass and mean rotation (M-orthogonal: ∫ b·u dV = 0 for each mode b), a
    property of the part rather than of where the mesh's nodes happen to lie.
    ``rtol`` and ``maxiter`` (None: AMG_MAXITER) are AMG-CG's. ``mesh``: the TetMesh K was
    assembled on (1 or 3 dofs a node); a TET10 mesh gives AMG-CG its two-level preconditioner
    (``p1_prolongation``, ``sliver_blocks``). Returns (u, info: method ("amg → direct" after a
    fallback, with ``note`` saying why; ``note`` also where AMG-CG stopped at the rounding floor
    above ``rtol``), dofs, free, iterations, residual (the true |f - K u| / |f| on the free dofs),
    seconds)."""
    if method not in SOLVER_METHODS:
        raise TaperayError(f"unknown solver method {method!r} ({', '.join(SOLVER_METHODS)})")
    if free_body:
        return _solve_free_body(K, f, near_null, method, rtol, maxiter, mass_modes, mesh)
    t0 = time.perf_counter()
    ndof = K.shape[0]
    u = np.zeros(ndof)
    free = np.ones(ndof, bool)
    if fixed is not None and len(fixed):
        fixed = np.asarray(fixed, np.int64)
        u[fixed] = values
        free[fixed] = False
    if not free.any():
        return u, {"method": "none", "dofs": ndof, "free": 0, "iterations": 0, "residual": 0.0, "seconds": 0.0}
    Kff = K[free][:, free].tocsr()
    rhs = f[free] - K[free][:, ~free] @ u[~free]
    nfree = int(free.sum())
    if method == "auto":
        method = "direct" if nfree <= DIRECT_MAX_DOF else "amg"
    info = {"method": method, "dofs": ndof, "free": nfree, "iterations": 0}
    # a singular or indefinite system makes SuperLU and pyamg warn (and numpy, on the NaN that
    # follows); the residual checks report it as one error instead. The warnings are recorded and
    # dropped: pyamg switches some of its own warnings to "always" on every call
    with warnings.catch_warnings(record=True), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        if method == "amg":
            B = None if near_null is None else np.asarray(near_null, float)[free]
            coarse = None if mesh is None or mesh.elements.shape[1] != 10 else _coarse_space(mesh, ndof, free)
            x, info["iterations"], residual, failure, note = amg_cg(Kff, rhs, B, rtol, maxiter or AMG_MAXITER, coarse)
            if coarse is not None:
                info["preconditioner"] = "two-level"
            if note:
                info["note"] = note
            if failure:
                need, have = direct_memory(Kff), available_memory()
                if need > have:
                    raise TaperayError(f"the linear solve failed (amg: {failure}), and the direct solver would need "
                                       f"about {format_bytes(need)} of memory (an estimate), {format_bytes(have)} "
                                       "available; use --solver petsc (CG + GAMG over MPI ranks)")
                x, residual = _direct(Kff, rhs, f"amg: {failure}; direct")
                info.update(method="amg → direct", note=f"{failure}; solved by the direct solver instead")
        else:
            need, have = direct_memory(Kff), available_memory()
            if need > have:
                raise TaperayError(f"the direct solver would need about {format_bytes(need)} of memory for "
                                   f"{nfree:,} free DOF (an estimate), {format_bytes(have)} available; use "
                                   "--solver amg (CG + pyamg) or --solver petsc (CG + GAMG over MPI ranks)")
            x, residual = _direct(Kff, rhs, "direct")
    u[free] = x
    info["residual"] = residual
    info["seconds"] = time.perf_counter() - t0
    return u, info


def _direct(A: sp.csr_matrix, b: np.ndarray, what: str) -> tuple[np.ndarray, float]:
    """(x, true relative residual) by ``symmetric_lu``; TaperayError("the linear solve failed
    (<what>: ...)") for a singular matrix or a residual above RESIDUAL_LIMIT."""
    try:
        x = symmetric_lu(A).solve(b)
    except RuntimeError:          # SuperLU: "Factor is exactly singular"
        raise TaperayError(f"the linear solve failed ({what}: the matrix is singular); is the problem constrained "
                           "(a fixed temperature or convection, enough supports)?") from None
    residual = _relative_residual(A, x, b)
    if not residual <= RESIDUAL_LIMIT:
        raise TaperayError(f"the linear solve failed ({what}: relative residual {residual:.3g}); is the problem "
                           "constrained (a fixed temperature or convection, enough supports)?")
    return x, residual


def _relative_residual(A, x: np.ndarray, b: np.ndarray) -> float:
    """|b - A x| / |b| (0 for b = 0 and x = 0; NaN propagates)."""
    nb = np.linalg.norm(b)
    r = np.linalg.norm(b - A @ x)
    return float(r / nb) if nb > 0 else float(r if r > 0 else 0.0)


def symmetric_lu(A):
    """SuperLU of a symmetric positive definite matrix, ordered for A + A^T (minimum degree) with
    diagonal pivots: on the cantilever's TET10 stiffness (161k dofs) 39 s and 3.6 GB against
    spsolve's (COLAMD) 248 s and 4.6 GB."""
    from scipy.sparse.linalg import splu
    return splu(sp.csc_matrix(A), permc_spec="MMD_AT_PLUS_A", diag_pivot_thresh=0.0, options={"SymmetricMode": True})


def direct_memory(A: sp.spmatrix) -> int:
    """Bytes ``symmetric_lu`` needs for A (n x n), an estimate: LU_FILL * nnz(A) * n^(1/3) entries
    in the factors (fill in 3D meshes grows about as n^(1/3) per entry of A), LU_BYTES each."""
    n = A.shape[0]
    return int(LU_BYTES * LU_FILL * A.nnz * n ** (1 / 3))


def p1_prolongation(elements: np.ndarray, n_nodes: int, bs: int = 1,
                    fixed: np.ndarray | None = None) -> tuple[sp.csr_matrix, np.ndarray]:
    """TET10 -> its P1 space on the corner nodes: P (bs n_nodes, bs n_corners) and the fine dof of
    each coarse dof (corners in ascending node order, components inner). A corner node keeps its
    value, a mid-edge node takes the mean of its edge's two ends, per component. ``fixed`` (dofs):
    their rows, and the columns of fixed corner dofs, are zero but for a 1 joining a fixed corner
    dof to its own coarse dof (P^T A P then keeps a system whose fixed rows are unit rows regular
    and uncoupled; drop those rows and columns for the free dofs' P)."""
    elements = np.asarray(elements, np.int64)
    corners = np.unique(elements[:, :4])
    coarse = np.full(n_nodes, -1, np.int64)
    coarse[corners] = np.arange(len(corners))
    mids, first = np.unique(elements[:, 4:].ravel(), return_index=True)
    ends = elements[:, np.array(TET10_EDGES)].reshape(-1, 2)[first]
    rows = np.concatenate([corners, mids, mids])
    cols = np.concatenate([coarse[corners], coarse[ends[:, 0]], coarse[ends[:, 1]]])
    vals = np.concatenate([np.ones(len(corners)), np.full(2 * len(mids), 0.5)])
    rows, cols = (bs * rows[:, None] + np.arange(bs)).ravel(), (bs * cols[:, None] + np.arange(bs)).ravel()
    vals = np.repeat(vals, bs)
    fine_of = (bs * corners[:, None] + np.arange(bs)).ravel()
    if fixed is not None and len(fixed):
        held = np.zeros(bs * n_nodes, bool)
        held[np.asarray(fixed, np.int64)] = True
        keep = ~held[rows] & ~held[fine_of[cols]] | (rows == fine_of[cols])
        rows, cols, vals = rows[keep], cols[keep], vals[keep]
    return sp.csr_matrix((vals, (rows, cols)), shape=(bs * n_nodes, len(fine_of))), fine_of


def dihedral_angles(nodes, elements) -> np.ndarray:
    """(E, 6) dihedral angles in degrees of each element's straight-sided corner tetrahedron."""
    x = np.asarray(nodes)[np.asarray(elements)[:, :4]]
    n = np.stack([np.cross(x[:, b] - x[:, a], x[:, c] - x[:, a]) for a, b, c in TET_FACES], 1)
    n /= np.maximum(np.linalg.norm(n, axis=2, keepdims=True), 1e-300)
    pairs = [(i, j) for i in range(4) for j in range(i + 1, 4)]
    cos = np.stack([np.einsum("ij,ij->i", n[:, i], n[:, j]) for i, j in pairs], 1)
    return 180.0 - np.degrees(np.arccos(np.clip(cos, -1.0, 1.0)))    # (outward normals)


def sliver_blocks(nodes: np.ndarray, elements: np.ndarray, bs: int = 1) -> np.ndarray:
    """(S, bs n) the dofs of each element with a dihedral angle below SLIVER_DEGREES or above 180
    less it: the two-level smoother solves exactly on their union. A nearly flat element makes its
    nodes' differences far stiffer than any neighbour's, modes that Gauss-Seidel and the P1 level
    both leave (on a 1 M-DOF heat sink mesh with 1,450 such elements of 531,028, CG took 285
    iterations without that solve and 20 with it)."""
    angles = dihedral_angles(nodes, elements)
    el = np.asarray(elements, np.int64)[(angles.min(1) < SLIVER_DEGREES) | (angles.max(1) > 180 - SLIVER_DEGREES)]
    return (bs * el[:, :, None] + np.arange(bs)).reshape(len(el), bs * el.shape[1])


def _coarse_space(mesh, ndof: int, free: np.ndarray):
    """(P, B's coarse rows, the sliver elements' dofs) of a TET10 ``mesh``, on the free dofs."""
    n = len(mesh.nodes)
    bs = ndof // n if n else 0
    if bs not in (1, 3) or bs * n != ndof:
        raise TaperayError(f"the matrix has {ndof} rows, not 1 or 3 per node of the mesh ({n} nodes)")
    P, fine_of = p1_prolongation(mesh.elements, n, bs)
    index = np.cumsum(free) - 1
    coarse_free = free[fine_of]
    sliver = np.unique(sliver_blocks(mesh.nodes, mesh.elements, bs))
    return P[free][:, coarse_free].tocsr(), index[fine_of[coarse_free]], index[sliver[free[sliver]]]


def _smoothed_aggregation(A: sp.csr_matrix, B: np.ndarray | None):
    """pyamg's smoothed aggregation V-cycle as a preconditioner (``amg_cg``'s settings), coarsened
    to at most AMG_COARSE unknowns, solved there by a dense pseudo-inverse. (pyamg counts its
    ``max_coarse`` in blocks, one a column of B on the coarse levels: counted so, the P1 level of the
    80-resolution cantilever (17,442 dofs) stopped at 2,808 unknowns, whose pseudo-inverse took
    8-42 s of the solve.)"""
    import pyamg
    nodal = B is not None and B.shape[1] == 6 and len(B) % 3 == 0 and \
        np.array_equal(B[:, :3].reshape(-1, 3, 3), np.broadcast_to(np.eye(3), (len(B) // 3, 3, 3)))
    ml = pyamg.smoothed_aggregation_solver(
        A.tobsr(blocksize=(3, 3)) if nodal else A, B=B, symmetry="hermitian",
        smooth="energy", presmoother=("block_gauss_seidel", {"sweep": "forward"}),
        postsmoother=("block_gauss_seidel", {"sweep": "backward"}),
        max_coarse=max(1, AMG_COARSE // (1 if B is None else B.shape[1])))
    return ml.aspreconditioner(cycle="V")


def _two_level(A: sp.csr_matrix, B: np.ndarray | None, coarse):
    """The TET10 two-level preconditioner: one symmetric Gauss-Seidel sweep and an exact solve on
    the sliver elements' dofs (``symmetric_lu`` of A's block there), the coarse correction
    P M_c P^T r by a smoothed aggregation V-cycle on P^T A P (near-null space: B's rows at the
    corner dofs, which P reproduces: constants and rigid motions are linear), then the same two in
    reverse order (symmetric)."""
    from pyamg.relaxation.relaxation import gauss_seidel
    from scipy.sparse.linalg import LinearOperator
    P, coarse_rows, sliver = coarse
    R = P.T.tocsr()
    Mc = _smoothed_aggregation((R @ A @ P).tocsr(), None if B is None else B[coarse_rows])
    rows = A[sliver].tocsr()
    lu = symmetric_lu(rows[:, sliver]) if len(sliver) else None

    def apply(r):
        x = np.zeros_like(r)
        gauss_seidel(A, x, r, sweep="symmetric")
        if lu is not None:
            x[sliver] += lu.solve(r[sliver] - rows @ x)
        x += P @ (Mc @ (R @ (r - A @ x)))
        if lu is not None:
            x[sliver] += lu.solve(r[sliver] - rows @ x)
        gauss_seidel(A, x, r, sweep="symmetric")
        return x
    return LinearOperator(A.shape, apply, dtype=float)


def rounding_floor(abs_rows: sp.csr_matrix, abs_x: np.ndarray, abs_b: np.ndarray, nb: float, total=float) -> float:
    """An estimate of the least true relative residual float64 allows at x: epsilon times
    |(|A| |x| + |b|)| / |b| over the rows given (each row's sum loses about epsilon times the sum
    of its terms' magnitudes: the normwise backward error's measure). ``abs_rows``: |A|'s rows,
    their columns matching ``abs_x``; ``total`` sums the squares over all parts (an MPI
    allreduce where the rows are a rank's)."""
    bound = abs_rows @ abs_x + abs_b
    return float(np.finfo(float).eps * np.sqrt(total(float(bound @ bound))) / nb)


def floor_note(solver: str, why: str, best: float, iterations: int, floor: float) -> str:
    """How an iterative solve ended against its rounding floor (``rounding_floor``)."""
    where = f"within {FLOOR_FACTOR} times" if best <= FLOOR_FACTOR * floor else "above"
    return (f"{solver} {why} at relative residual {best:.2g} after {iterations} iteration{'s' if iterations != 1 else ''}, "
            f"{where} this system's rounding floor (about {floor:.2g}: float64's epsilon times |A| |x| against |b|)")


def amg_cg(A: sp.csr_matrix, b: np.ndarray, B: np.ndarray | None = None, rtol: float = AMG_RTOL,
           maxiter: int = AMG_MAXITER, coarse=None) -> tuple[np.ndarray, int, float, str | None, str | None]:
    """A x = b (A symmetric positive definite) by CG with a symmetric multigrid preconditioner.
    Without ``coarse``: one V-cycle of pyamg's smoothed aggregation (energy-minimising
    prolongation, near-null space ``B`` (None: constants; elasticity: the rigid-body modes on the
    free dofs), forward Gauss-Seidel before and backward after; where B's rows come in node triples
    (its first three columns the translations, one 1 per row, as ``rigid_body_modes`` makes them:
    no node has only some of its dofs fixed), whole nodes are aggregated (BSR, 3 x 3 blocks)).
    With ``coarse`` (a TET10 system: ``solve_linear`` makes it from the mesh), the two-level
    preconditioner of ``_two_level``: the P1 space on the corner nodes, solved by that V-cycle.

    The stopping test is the true residual |b - A x| / |b|, computed every AMG_CHECK iterations
    and when CG's own (updated) residual passes the target: converged at ``rtol``, or within
    FLOOR_FACTOR of the rounding floor (``rounding_floor``, estimated at each new best) where that
    lies above ``rtol`` (never above RESIDUAL_LIMIT); stalled when its best value has not halved in
    AMG_STALL iterations, or when CG's own residual passed the target and the true one did not
    (round-off: the two have parted); broken down when p.Ap <= 0 or a value is not finite; or
    ``maxiter``. Returns (the iterate of least true residual, iterations, that residual, None or
    why it failed (that residual is above AMG_RESIDUAL_LIMIT and the floor's bound), None or the
    note of a stop above ``rtol`` (``floor_note``))."""
    try:
        import pyamg  # noqa: F401
    except ImportError:
        raise TaperayError("the AMG solver needs pyamg: pip install 'taperay[sim]'") from None
    nb = np.linalg.norm(b)
    x = np.zeros_like(b)
    if nb == 0:
        return x, 0, 0.0, None, None
    try:
        M = _smoothed_aggregation(A, B) if coarse is None else _two_level(A, B, coarse)
    except (ValueError, ArithmeticError, RuntimeError, np.linalg.LinAlgError) as e:
        return x, 0, 1.0, f"pyamg's setup failed ({e})", None
    r = b.copy()
    z = M @ r
    p = z.copy()
    rz = r @ z
    best, best_x, last = 1.0, x.copy(), 1.0
    halved_at, halved = 0, 1.0          # the iteration at which the best residual last halved, and that value
    target, floor, abs_A = rtol, 0.0, None
    why = None
    it = 0
    while it < maxiter:
        it += 1
        Ap = A @ p
        pAp = p @ Ap
        if not pAp > 0 or not np.isfinite(pAp):
            why = "broke down (the preconditioned system is not positive definite)"
            break
        alpha = rz / pAp
        x += alpha * p
        r -= alpha * Ap
        updated_converged = np.linalg.norm(r) <= target * nb
        if updated_converged or it % AMG_CHECK == 0 or it == maxiter:
            last = np.linalg.norm(b - A @ x) / nb
            if not np.isfinite(last):
                why = "broke down (a value is not finite)"
                break
            if last < best:
                best, best_x = last, x.copy()
                if best > rtol:
                    abs_A = abs(A) if abs_A is None else abs_A
                    floor = rounding_floor(abs_A, np.abs(x), np.abs(b), nb)
                    target = max(rtol, min(FLOOR_FACTOR * floor, RESIDUAL_LIMIT))
            if best <= target:
                break
            if best <= halved / 2:
                halved_at, halved = it, best
            if updated_converged or it - halved_at >= AMG_STALL:
                why = "stalled"
                break
        z = M @ r
        rz_next = r @ z
        p = z + (rz_next / rz) * p
        rz = rz_next
    if why is None and best <= target:
        why = "reached the rounding floor"
    elif why is None:
        why = f"reached its {maxiter}-iteration limit"
    elif why == "stalled" and last > 1:
        why = "diverged"
    if best <= rtol:
        return best_x, it, float(best), None, None
    if best <= AMG_RESIDUAL_LIMIT or best <= min(FLOOR_FACTOR * floor, RESIDUAL_LIMIT):
        return best_x, it, float(best), None, f"{floor_note('AMG-CG', why, best, it, floor)}; the target {rtol:g} is not reached"
    return best_x, it, float(best), (f"AMG-CG {why} at relative residual {best:.2g} after {it} "
                                     f"iteration{'s' if it != 1 else ''}"), None


def _solve_free_body(K: sp.csr_matrix, f: np.ndarray, B: np.ndarray | None, method: str, rtol: float,
                     maxiter: int | None, W: np.ndarray | None, mesh):
    """K u = f, W^T u = 0 (W: the mass-weighted modes, else B) for a K whose null space is spanned by
    B's columns (no fixed dofs): the dofs where B's rows are most independent (QR with column
    pivoting on B^T, one per column of B) are held at 0, which makes the system regular; that
    solution, less its rigid motion (B c with W^T (u - B c) = 0), is u."""
    from scipy.linalg import qr
    if B is None:
        raise TaperayError("a free body's solve needs its rigid-body modes (near_null)")
    Q, _ = np.linalg.qr(np.asarray(B, float))                 # orthonormal basis of the null space
    unbalanced = np.linalg.norm(Q.T @ f)
    if unbalanced > 1e-8 * max(np.linalg.norm(f), 1e-300):
        raise TaperayError(f"a free body's loads must balance (no supports take a net force or moment): "
                           f"{unbalanced / np.linalg.norm(f):.3g} of the load is net force or moment")
    held = np.sort(qr(Q.T, mode="r", pivoting=True)[1][:Q.shape[1]])
    u, info = solve_linear(K, f, held, np.zeros(len(held)), method, B, rtol, maxiter=maxiter, mesh=mesh)
    if W is None:
        u = u - Q @ (Q.T @ u)
    else:
        u = u - B @ np.linalg.solve(W.T @ B, W.T @ u)
    info["residual"] = _relative_residual(K, u, f)
    if not info["residual"] <= RESIDUAL_LIMIT:
        raise TaperayError(f"the linear solve failed ({info['method']}: relative residual {info['residual']:.3g})")
    return u, info
