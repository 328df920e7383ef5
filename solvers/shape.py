"""Shape derivatives of FEM quantities with respect to a scene's named parameters.

Method (the volume form, through the discrete system): the FEM residual R(u, X) of a study is
differentiated exactly with respect to the mesh's node coordinates X (isoparametric: a node
motion dX moves each element by V = sum_a N_a dX_a, so d(det J) = det J div V and
d(grad N_b) = -grad V^T grad N_b at every quadrature point). For an objective J(u, X),

    dJ/dX = dJ/dX|_u - lambda^T dR/dX,      K^T lambda = dJ/du  (lambda = 0 on fixed dofs),

one adjoint solve per objective. A named parameter theta moves the boundary with the normal
velocity V_n = -(df/dtheta) / |grad f| (the JAX evaluator's df/dtheta and grad f at the boundary
faces' centroids; each boundary node moves with the faces around it, ``node_velocities``), the
interior nodes with the harmonic extension of the boundary nodes' motion; then
dJ/dtheta = sum_nodes dJ/dX_n . V_n. This is the domain (volume) form of the shape derivative:
every element contributes, not only the boundary faces.

Everything here is numpy / scipy on the mesh; JAX evaluates only the tape, in calls of one fixed
point count (a new mesh compiles nothing). The derivative is exact for the discrete problem on a
fixed mesh topology: it agrees with finite differences of the pipeline whose nodes are moved by
h V (tests/test_optimize.py).

Included: heat (conduction, volumetric source per element, heat flux and convection on boundary
faces, fixed temperatures), elasticity (stiffness, constant body force, traction and pressure on
boundary faces, fixed displacements). The boundary faces keep the materials they were given on
the unperturbed mesh (a material boundary moving along the surface is not differentiated).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp

from taperay.runtime.tape import Tape, TaperayError

from . import fem
from .study import _per_material, mesh_materials, study_from
from .surface import default_walker
from .tetmesh import TET10_EDGES, TetMesh

__all__ = ["System", "assemble", "node_velocities", "shape_gradient", "parameter_derivatives",
           "stiffness_shape_gradient", "load_shape_gradient", "moved_mesh"]


# ---------------------------------------------------------------- the assembled problem

@dataclass
class System:
    """A study assembled on a mesh, with everything needed to assemble it again on moved nodes
    (same topology, same element and face materials) and to differentiate it w.r.t. the nodes.

    kind "heat" | "elasticity"; ``k``, ``s`` (heat) or ``E``, ``nu`` (elasticity) per element;
    face sets: ``flux`` [(faces, q)], ``convection`` [(faces, h, T_inf)], ``traction``
    [(faces, (tx, ty, tz))], ``pressure`` [(faces, p)]; ``body_force``; fixed dofs and values."""
    kind: str
    mesh: TetMesh
    K: sp.csr_matrix
    f: np.ndarray
    fixed: np.ndarray
    values: np.ndarray
    k: np.ndarray | None = None
    s: np.ndarray | None = None
    E: np.ndarray | None = None
    nu: np.ndarray | None = None
    body_force: np.ndarray | None = None
    flux: list = field(default_factory=list)
    convection: list = field(default_factory=list)
    traction: list = field(default_factory=list)
    pressure: list = field(default_factory=list)
    element_material: np.ndarray | None = None
    material_names: list = field(default_factory=list)
    solver: str = "auto"
    _factor: object = field(default=None, repr=False)
    _free: np.ndarray | None = field(default=None, repr=False)
    _volumes: tuple | None = field(default=None, repr=False)
    info: dict = field(default_factory=dict)

    @property
    def ncomp(self) -> int:
        return 1 if self.kind == "heat" else 3

    # -------------------------------------------------------------- solving
    def _prepare(self):
        if self._free is None:
            free = np.ones(self.K.shape[0], bool)
            free[self.fixed] = False
            self._free = free
        return self._free

    def _solve_free(self, rhs: np.ndarray) -> np.ndarray:
        free = self._prepare()
        nfree = int(free.sum())
        method = self.solver
        if method == "auto":
            method = "direct" if nfree <= fem.DIRECT_MAX_DOF * 4 else "amg"
        if method == "direct":
            if self._factor is None:
                self._factor = fem.symmetric_lu(self.K[free][:, free])
            x = self._factor.solve(rhs)
            if not np.all(np.isfinite(x)):
                raise TaperayError("the linear solve failed (direct); is the problem constrained?")
            return x
        # iterative: through fem.solve_linear, the fixed dofs held at 0 (rhs is the free dofs' own
        # load); the mesh gives a TET10 system its two-level preconditioner
        load = np.zeros(self.K.shape[0])
        load[free] = rhs
        near = fem.rigid_body_modes(self.mesh.nodes) if self.kind == "elasticity" else None
        u, _ = fem.solve_linear(self.K, load, self.fixed, np.zeros(len(self.fixed)), method, near, mesh=self.mesh)
        return u[free]

    def solve(self) -> np.ndarray:
        """The field (N,) or (N, 3) with the fixed values imposed."""
        t0 = time.perf_counter()
        free = self._prepare()
        u = np.zeros(self.K.shape[0])
        u[self.fixed] = self.values
        rhs = self.f[free] - self.K[free][:, ~free] @ u[~free]
        u[free] = self._solve_free(rhs)
        r = self.K[free] @ u - self.f[free]
        self.info.update(dofs=int(len(u)), free=int(free.sum()), solve_seconds=time.perf_counter() - t0,
                         residual=float(np.linalg.norm(r) / max(np.linalg.norm(rhs), 1e-300)))
        return u if self.kind == "heat" else u.reshape(-1, 3)

    def adjoint(self, rhs: np.ndarray) -> np.ndarray:
        """lambda with K lambda = rhs on the free dofs, lambda = 0 on the fixed ones (K symmetric)."""
        t0 = time.perf_counter()
        free = self._prepare()
        rhs = np.asarray(rhs, float).ravel()
        lam = np.zeros(self.K.shape[0])
        lam[free] = self._solve_free(rhs[free])
        self.info["adjoint_seconds"] = self.info.get("adjoint_seconds", 0.0) + time.perf_counter() - t0
        return lam if self.kind == "heat" else lam.reshape(-1, 3)

    # -------------------------------------------------------------- derivatives w.r.t. the nodes
    def residual_shape_gradient(self, u, lam) -> np.ndarray:
        """(N, 3): d/dX [lam^T R(u, X)], R = K(X) u - f(X) (u and lam held fixed)."""
        nodes = self.mesh.nodes
        g = stiffness_shape_gradient(self, nodes, u, lam)
        g -= load_shape_gradient(self, nodes, lam)
        for faces, h, _ in self.convection:      # int h lam T dA (the convection matrix)
            g += _face_scalar_gradient(nodes, faces, 2 * self.mesh.order, lambda N, F: h * (F(lam) * F(u)))
        return g

    def build(self) -> None:
        """K and f on the mesh's current nodes."""
        _build(self)

    def volumes(self) -> tuple[np.ndarray, np.ndarray]:
        """``element_volumes`` on the current nodes (computed once: the volume and the mass
        objectives, and the p-means' denominators, share them)."""
        if self._volumes is None:
            self._volumes = element_volumes(self.mesh.nodes, self.mesh.elements)
        return self._volumes

    def load_dot(self, c) -> float:
        return float(np.dot(np.asarray(c, float).ravel(), self.f))


def assemble(tape: Tape, study, mesh: TetMesh, walker=None, solver: str = "auto", build: bool = True,
             materials: tuple | None = None) -> System:
    """The study's system on ``mesh``: materials of elements and boundary faces from the tape (as
    ``simulate`` does; ``materials``: ``mesh_materials``' result where the caller has it), the
    stiffness, the loads and the fixed dofs (``build=False``: the terms only, K and f left None,
    for an assembly distributed over ranks)."""
    study = study_from(study)
    walker = default_walker(walker)
    names, faces, emat, faces_of = materials or mesh_materials(tape, mesh, walker)

    sysm = System(study.kind, mesh, None, None, None, None, element_material=emat, material_names=names, solver=solver)
    fixed, vals = [], []
    if study.kind == "heat":
        sysm.k = _per_material(study.conductivity, names, emat, "conductivity")
        sysm.s = _per_material(study.source, names, emat, "source")
        sysm.flux = [(faces_of(n, "heat_flux"), float(q)) for n, q in study.heat_flux.items()]
        sysm.convection = [(faces_of(n, "convection"), float(h), float(t)) for n, (h, t) in study.convection.items()]
        for name, T in study.fixed_temperature.items():
            nd = np.unique(faces_of(name, "fixed_temperature"))
            fixed.append(nd)
            vals.append(np.full(len(nd), float(T)))
    else:
        sysm.E = _per_material(study.E, names, emat, "E")
        sysm.nu = _per_material(study.nu, names, emat, "nu")
        sysm.body_force = None if study.body_force is None else np.asarray(study.body_force, float)
        sysm.traction = [(faces_of(n, "traction"), np.asarray(t, float)) for n, t in study.traction.items()]
        sysm.pressure = [(faces_of(n, "pressure"), float(p)) for n, p in study.pressure.items()]
        for name, comp in study.fixed.items():
            nd = np.unique(faces_of(name, "fixed"))
            comp = (0.0, 0.0, 0.0) if comp is None or comp is True else comp
            for i, c in enumerate(comp):
                if c is not None:
                    fixed.append(3 * nd + i)
                    vals.append(np.full(len(nd), float(c)))
        if study.free_body:
            raise TaperayError("shape derivatives of a free body (free_body=True) are not built; give supports")
        if not fixed:
            raise TaperayError("elasticity study: no fixed support; the part would float")
    fixed_dofs = np.concatenate(fixed) if fixed else np.zeros(0, np.int64)
    fixed_vals = np.concatenate(vals) if vals else np.zeros(0)
    if len(fixed_dofs):
        fixed_dofs, idx = np.unique(fixed_dofs[::-1], return_index=True)
        fixed_vals = fixed_vals[::-1][idx]
    sysm.fixed, sysm.values = fixed_dofs.astype(np.int64), fixed_vals
    if build:
        sysm.build()
    return sysm


def _build(sysm: System) -> None:
    """K and f of ``sysm`` on its mesh's current nodes (fem.py's assembly)."""
    nodes, el = sysm.mesh.nodes, sysm.mesh.elements
    N = len(nodes)
    if sysm.kind == "heat":
        # (the source as (E, 1): fem._volume_load cannot broadcast a per-element (E,) array to (m, 1))
        K, f = fem.heat_system(nodes, el, sysm.k, sysm.s[:, None])
        for faces, q in sysm.flux:
            f = f + fem.face_load(nodes, faces, q, 1, N)
        for faces, h, tinf in sysm.convection:
            K = K + fem.face_mass(nodes, faces, h, N)
            f = f + fem.face_load(nodes, faces, h * tinf, 1, N)
    else:
        K, f = fem.elasticity_system(nodes, el, sysm.E, sysm.nu, sysm.body_force)
        for faces, t in sysm.traction:
            f = f + fem.face_load(nodes, faces, t, 3, N)
        for faces, p in sysm.pressure:
            f = f + fem.face_load(nodes, faces, lambda x, n, p=p: -p * n, 3, N)
    sysm.K, sysm.f = sp.csr_matrix(K), np.asarray(f, float)
    sysm._factor = sysm._volumes = None


def moved_mesh(sysm: System, displacement) -> System:
    """The same system (topology, materials, face sets, fixed dofs) on nodes + displacement:
    what a finite difference with the mesh topology held fixed assembles."""
    from dataclasses import replace
    mesh = TetMesh(sysm.mesh.nodes + np.asarray(displacement, float), sysm.mesh.elements, dict(sysm.mesh.stats))
    new = replace(sysm, mesh=mesh, _factor=None, _free=None, _volumes=None, info={})
    _build(new)
    return new


# ---------------------------------------------------------------- element integrals and their node derivatives

def _rule(n: int, degree: int):
    pts, wts = fem.tet_rule(degree)
    return fem.shape_functions(n, pts), fem.shape_derivatives(n, pts), wts


def _blocks(E: int, size: int = 20_000):
    for s in range(0, E, size):
        yield slice(s, min(E, s + size))


def _geom(X, dN):
    """(det J (m,), dN/dx (m, n, 3)) of the elements with node coordinates X (m, n, 3) at one
    quadrature point (dN: (n, 3) reference derivatives); J's inverse from its cofactors (the rows'
    cross products), which for 3 x 3 blocks is several times faster than numpy.linalg."""
    J = np.matmul(X.transpose(0, 2, 1), dN)                 # J_ij = sum_a X_ai dN_aj
    r0, r1, r2 = J[:, 0], J[:, 1], J[:, 2]
    c0, c1, c2 = np.cross(r1, r2), np.cross(r2, r0), np.cross(r0, r1)
    det = np.einsum("ei,ei->e", r0, c0)
    if np.any(det <= 0):
        raise TaperayError(f"{int(np.count_nonzero(det <= 0))} elements are inverted or flat (Jacobian <= 0)")
    inv = np.stack([c0, c1, c2], -1) / det[:, None, None]
    return det, np.matmul(dN, inv)


def stiffness_shape_gradient(sysm: System, nodes, u, lam) -> np.ndarray:
    """(N, 3): d/dX of lam^T K(X) u over the elements (conduction or elasticity stiffness), with
    fem.py's quadrature (degree 2(p - 1))."""
    el = sysm.mesh.elements
    E, n = el.shape
    p = 1 if n == 4 else 2
    _, dNq, wts = _rule(n, 2 * p - 2)
    out = np.zeros((len(nodes), 3))
    heat = sysm.kind == "heat"
    U = np.asarray(u, float).reshape(len(nodes), -1)
    L = np.asarray(lam, float).reshape(len(nodes), -1)
    if not heat:
        lam_, mu_ = fem.lame(sysm.E, sysm.nu)
    for blk in _blocks(E):
        e = el[blk]
        X = nodes[e]
        Ue, Le = U[e], L[e]                    # (m, n, c)
        ge = np.zeros((len(e), n, 3))
        for q in range(len(wts)):
            det, G = _geom(X, dNq[q])
            w = wts[q] * det
            if heat:
                gT = np.matmul(Ue.transpose(0, 2, 1), G)[:, 0]          # (m, 3)
                gL = np.matmul(Le.transpose(0, 2, 1), G)[:, 0]
                kw = (w * sysm.k[blk])[:, None, None]
                ge += kw * (np.einsum("ei,ei->e", gL, gT)[:, None, None] * G
                            - np.matmul(G, gT[:, :, None]) * gL[:, None, :]
                            - np.matmul(G, gL[:, :, None]) * gT[:, None, :])
            else:
                gu = np.matmul(Ue.transpose(0, 2, 1), G)               # du_c/dx_j (m, 3 c, 3 j)
                gl = np.matmul(Le.transpose(0, 2, 1), G)
                su = _stress(gu, lam_[blk], mu_[blk])
                sl = _stress(gl, lam_[blk], mu_[blk])
                W = np.einsum("eij,eij->e", su, gl)            # sigma(u) : grad(lam) = sigma(u) : eps(lam)
                # d/dX_am = W G_am - (grad u^T sigma(lam) G_a)_m - (grad lam^T sigma(u) G_a)_m
                #         = W G_am - (G (sigma(lam)^T grad u + sigma(u)^T grad lam))_am
                B = np.matmul(sl.transpose(0, 2, 1), gu) + np.matmul(su.transpose(0, 2, 1), gl)
                ge += w[:, None, None] * (W[:, None, None] * G - np.matmul(G, B))
        out += _scatter(e.ravel(), ge, len(nodes))
    return out


def _stress(grad, lam, mu):
    eps = 0.5 * (grad + grad.transpose(0, 2, 1))
    tr = np.trace(eps, axis1=1, axis2=2)
    return 2 * mu[:, None, None] * eps + (lam * tr)[:, None, None] * np.eye(3)


def _scatter(index, values, n: int) -> np.ndarray:
    """sum of ``values`` (k, c) rows into n rows by ``index`` (k,) (bincount per column: several
    times faster than numpy.add.at)."""
    values = values.reshape(len(index), -1)
    return np.stack([np.bincount(index, values[:, c], minlength=n) for c in range(values.shape[1])], 1)


def _adjugates(X, dNq):
    """(det J (Q, m), adj J (Q, m, 3, 3)) at every quadrature point (dNq (Q, n, 3)) of the elements
    with node coordinates X (m, n, 3); adj J = det J J^-1, its columns the rows' cross products."""
    J = np.matmul(X.transpose(0, 2, 1)[None], dNq[:, None])              # (Q, m, 3, 3)
    r0, r1, r2 = J[..., 0, :], J[..., 1, :], J[..., 2, :]
    adj = np.stack([np.cross(r1, r2), np.cross(r2, r0), np.cross(r0, r1)], -1)
    det = np.einsum("qei,qei->qe", r0, adj[..., 0])
    if np.any(det <= 0):
        raise TaperayError(f"{int(np.count_nonzero((det <= 0).any(0)))} elements are inverted or flat (Jacobian <= 0)")
    return det, adj


def _blocks_for(E: int, points: int):
    """Element blocks small enough that a (points, block, 3, 3) array stays near 2 M entries."""
    return _blocks(E, max(1024, 200_000 // max(points, 1)))


def volume_integral_gradient(nodes, elements, degree: int, integrand):
    """(value, dvalue/dX (N, 3), dvalue/du as the integrand asks) of sum_e int g dx, where
    ``integrand(Nq (n,), e_slice)`` -> (g (m,) at the quadrature point, c (m, n) or None:
    dg/du_a coefficients). Returns value, dX (N, 3), du (N,).

    With g held fixed, d/dX_a of w g det J = w g det J G_a = w g dN_a adj J: the elements' sum
    over the quadrature points is one matrix product (dN (n, 3Q) by the weighted adjugates)."""
    E, n = elements.shape
    Nq, dNq, wts = _rule(n, degree)
    Q = len(wts)
    dN_flat = dNq.transpose(1, 0, 2).reshape(n, 3 * Q)                 # [a, 3q + j] = dN_q,aj
    dX = np.zeros((len(nodes), 3))
    du = np.zeros(len(nodes))
    total = 0.0
    for blk in _blocks_for(E, Q):
        e = elements[blk]
        det, adj = _adjugates(nodes[e], dNq)
        w = wts[:, None] * det                                          # (Q, m)
        g = np.empty_like(w)
        gu = None
        for q in range(Q):
            g[q], c = integrand(Nq[q], e, blk)
            if c is not None:
                gu = w[q][:, None] * c if gu is None else gu + w[q][:, None] * c
        total += float(np.einsum("qe,qe->", w, g))
        A = (wts[:, None] * g)[:, :, None, None] * adj                    # (Q, m, 3 j, 3 i)
        ge = np.matmul(dN_flat, A.transpose(1, 0, 2, 3).reshape(len(e), 3 * Q, 3))
        idx = e.ravel()
        dX += _scatter(idx, ge, len(nodes))
        if gu is not None:
            du += _scatter(idx, gu, len(nodes))[:, 0]
    return total, dX, du


def element_volumes(nodes, elements) -> tuple[np.ndarray, np.ndarray]:
    """(volume (E,), its derivative w.r.t. each element's nodes (E, n, 3)), exact for curved TET10
    (degree 3) and TET4 (degree 1)."""
    E, n = elements.shape
    _, dNq, wts = _rule(n, 1 if n == 4 else 3)
    Q = len(wts)
    dN_flat = dNq.transpose(1, 0, 2).reshape(n, 3 * Q)
    vol = np.empty(E)
    dvol = np.empty((E, n, 3))
    for blk in _blocks_for(E, Q):
        det, adj = _adjugates(nodes[elements[blk]], dNq)
        vol[blk] = wts @ det
        A = wts[:, None, None, None] * adj
        dvol[blk] = np.matmul(dN_flat, A.transpose(1, 0, 2, 3).reshape(-1, 3 * Q, 3))
    return vol, dvol


def load_shape_gradient(sysm: System, nodes, c) -> np.ndarray:
    """(N, 3): d/dX of c^T f(X) (the study's volume and face loads)."""
    el = sysm.mesh.elements
    n = el.shape[1]
    p = 1 if n == 4 else 2
    C = np.asarray(c, float).reshape(len(nodes), -1)
    out = np.zeros((len(nodes), 3))
    if sysm.kind == "heat":
        if np.any(sysm.s != 0):
            s = sysm.s
            _, g, _ = volume_integral_gradient(nodes, el, 2 * p,
                                               lambda Nq, e, blk: (s[blk] * (C[e][:, :, 0] @ Nq), None))
            out += g
        for faces, q in sysm.flux:
            out += _face_scalar_gradient(nodes, faces, 2 * p, lambda N, F: q * F(C[:, 0]))
        for faces, h, tinf in sysm.convection:
            out += _face_scalar_gradient(nodes, faces, 2 * p, lambda N, F: h * tinf * F(C[:, 0]))
    else:
        if sysm.body_force is not None and np.any(sysm.body_force != 0):
            b = sysm.body_force
            _, g, _ = volume_integral_gradient(nodes, el, 2 * p,
                                               lambda Nq, e, blk: (np.einsum("a,eac,c->e", Nq, C[e], b), None))
            out += g
        for faces, t in sysm.traction:
            out += _face_scalar_gradient(nodes, faces, 2 * p, lambda N, F: F(C) @ t)
        for faces, pr in sysm.pressure:
            out += _face_vector_gradient(nodes, faces, 2 * p + 2, lambda N, F: -pr * F(C))
    return out


def _face_setup(nodes, faces, degree):
    m = faces.shape[1]
    pts, wts = fem.tri_rule(degree)
    N, dN = fem.tri_shape_functions(m, pts)
    X = nodes[faces]
    t1 = np.einsum("qa,fai->fqi", dN[:, :, 0], X)
    t2 = np.einsum("qa,fai->fqi", dN[:, :, 1], X)
    return N, dN, wts, t1, t2


def _face_scalar_gradient(nodes, faces, degree, g) -> np.ndarray:
    """d/dX of sum over faces of int g dA, g(N, F) -> (F, Q) with F(v) interpolating nodal v
    (N,) or (N, c) at the face quadrature points; g is held fixed (only the area element moves)."""
    out = np.zeros((len(nodes), 3))
    if not len(faces):
        return out
    N, dN, wts, t1, t2 = _face_setup(nodes, faces, degree)
    nrm = np.cross(t1, t2)
    jac = np.linalg.norm(nrm, axis=2)
    nh = nrm / np.maximum(jac, 1e-300)[:, :, None]

    def F(v):
        v = np.asarray(v, float)
        return np.einsum("qa,fa...->fq...", N, v[faces])
    val = np.asarray(g(N, F), float) * wts[None]            # (F, Q)
    a = np.cross(t2, nh)                                    # d jac / d t1
    b = np.cross(nh, t1)                                    # d jac / d t2
    ge = np.einsum("fq,qa,fqi->fai", val, dN[:, :, 0], a) + np.einsum("fq,qa,fqi->fai", val, dN[:, :, 1], b)
    np.add.at(out, faces.ravel(), ge.reshape(-1, 3))
    return out


def _face_vector_gradient(nodes, faces, degree, g) -> np.ndarray:
    """d/dX of sum over faces of int g . n dA = sum_q w g . (t1 x t2), g(N, F) -> (F, Q, 3) held fixed."""
    out = np.zeros((len(nodes), 3))
    if not len(faces):
        return out
    N, dN, wts, t1, t2 = _face_setup(nodes, faces, degree)

    def F(v):
        v = np.asarray(v, float)
        return np.einsum("qa,fa...->fq...", N, v[faces])
    G = np.asarray(g(N, F), float) * wts[None, :, None]     # (F, Q, 3)
    a = np.cross(t2, G)                                     # g . (dt1 x t2) = dt1 . (t2 x g)
    b = np.cross(G, t1)                                     # g . (t1 x dt2) = dt2 . (g x t1)
    ge = np.einsum("qa,fqi->fai", dN[:, :, 0], a) + np.einsum("qa,fqi->fai", dN[:, :, 1], b)
    np.add.at(out, faces.ravel(), ge.reshape(-1, 3))
    return out


# ---------------------------------------------------------------- velocities from the tape

VELOCITY_CHUNK = 1 << 14    # points per JAX call: every design's evaluations have this one shape


def _jax_walker(walker=None):
    if walker is not None and hasattr(walker, "value_and_grad"):
        return walker
    from taperay.runtime.jax_walker import JaxWalker
    global _JAX
    try:
        return _JAX
    except NameError:
        _JAX = JaxWalker()
        return _JAX


def _field_rates(tape: Tape, points, names, walker) -> tuple[np.ndarray, dict]:
    """(grad f (n, 3), {name: df/dname (n,)}) at ``points``, float64, from calls of exactly
    ``VELOCITY_CHUNK`` points each (the last one padded with copies of its first point): the JAX
    evaluator's programs are specialised to the point count, so a mesh of any size reuses the one
    program its first call compiled (one forward-mode pass per name inside it)."""
    w = _jax_walker(walker)
    n = len(points)
    dx = np.empty((n, 3))
    rates = {nm: np.empty(n) for nm in names}
    chunk = np.empty((VELOCITY_CHUNK, 3), np.float32)
    for s in range(0, n, VELOCITY_CHUNK):
        part = points[s:s + VELOCITY_CHUNK]
        m = len(part)
        chunk[:m] = part
        chunk[m:] = part[0]
        g = w.value_and_grad(tape, chunk, names=names)
        dx[s:s + m] = g.dx[:m]
        for nm in names:
            rates[nm][s:s + m] = g.per_point[nm][:m]
    return dx, rates


def node_velocities(tape: Tape, nodes, names=None, walker=None, faces=None, min_grad: float = 1e-3,
                    rank_tol: float = 0.05, elements=None) -> dict:
    """name -> (N, 3) velocity at ``nodes``: V = -(df/dtheta) grad f / |grad f|^2 (the JAX
    evaluator's forward-mode df/dtheta and exact grad f, float32, returned as float64); where
    |grad f| < min_grad (a singular point of the field) V is 0.

    With ``faces`` (the mesh's boundary faces), each boundary node's V is instead the least-squares
    V with n_k . V = V_n,k for the faces k around it, n_k and V_n,k = -(df/dtheta)/|grad f| taken
    at each face's centroid: on a sharp edge or corner, where a node lies on two or three smooth
    pieces of the surface, V then moves it with all of them (a lone gradient at the node would
    follow one piece only, and the area of a face bounded by a moving edge would not change).
    Directions whose eigenvalue of sum n_k n_k^T is below ``rank_tol`` times the largest are left
    out (a smooth, gently curved surface: V = V_n n).

    With ``elements`` too, the interior nodes' V is the harmonic extension of the boundary nodes'
    (one Laplace solve, its factorisation shared by every component and name): the level-set V
    inside a part jumps across the medial surface (the nearest face changes), and a jump inside
    the mesh costs the volume form its accuracy (a spherical shell, TET10: 1.4 % / 0.6 % / 0.5 %
    off the exact derivative with the level-set V, 0.1 % or better with the harmonic one).
    The tape is then evaluated at the face centroids only (no node's V comes from the field).
    The derivative is that of the discrete problem for either field (the boundary nodes decide
    the continuous derivative; the interior only its discretisation error)."""
    names = sorted(tape.names) if names is None else list(names)
    if not names:
        return {}
    nodes = np.asarray(nodes, np.float64)
    N = len(nodes)
    with_faces = faces is not None and len(faces)
    if not with_faces:
        dx, rates = _field_rates(tape, nodes, names, walker)
        g2 = np.einsum("ij,ij->i", dx, dx)
        ok = g2 > min_grad ** 2
        inv = np.zeros_like(g2)
        inv[ok] = 1.0 / g2[ok]
        return {nm: -(rates[nm] * inv)[:, None] * dx for nm in names}
    faces = np.asarray(faces, np.int64)
    cent = nodes[faces[:, :3]].mean(1)
    if elements is None:        # interior nodes: the level-set V, so the nodes are evaluated too
        dx, rates = _field_rates(tape, np.concatenate([nodes, cent]), names, walker)
        g2 = np.einsum("ij,ij->i", dx[:N], dx[:N])
        ok = g2 > min_grad ** 2
        inv = np.zeros_like(g2)
        inv[ok] = 1.0 / g2[ok]
        out = {nm: -(rates[nm][:N] * inv)[:, None] * dx[:N] for nm in names}
        dx, rates = dx[N:], {nm: r[N:] for nm, r in rates.items()}
    else:
        dx, rates = _field_rates(tape, cent, names, walker)
        out = {nm: np.zeros((N, 3)) for nm in names}
    # boundary nodes: least squares over the faces around each node
    gn = np.sqrt(np.einsum("ij,ij->i", dx, dx))
    fok = gn > min_grad
    nrm = np.zeros((len(faces), 3))
    nrm[fok] = dx[fok] / gn[fok, None]
    rows = faces.ravel()
    fidx = np.repeat(np.arange(len(faces)), faces.shape[1])
    M = np.zeros((N, 3, 3))
    np.add.at(M, rows, nrm[fidx][:, :, None] * nrm[fidx][:, None, :])
    bnodes = np.unique(rows)
    lam, U = np.linalg.eigh(M[bnodes])                       # ascending
    keep = lam > rank_tol * lam[:, -1:]
    invl = np.where(keep, 1.0 / np.where(keep, lam, 1.0), 0.0)
    P = np.einsum("nij,nj,nkj->nik", U, invl, U)              # pseudo-inverse of M at each boundary node
    for nm in names:
        vn = np.zeros(len(faces))
        vn[fok] = -rates[nm][fok] / gn[fok]
        r = np.zeros((N, 3))
        np.add.at(r, rows, nrm[fidx] * vn[fidx][:, None])
        out[nm][bnodes] = np.einsum("nij,nj->ni", P, r[bnodes])
    if elements is not None:
        _harmonic_extension(nodes, np.asarray(elements, np.int64), bnodes, out)
    return out


def _harmonic_extension(nodes, elements, bnodes, fields: dict) -> None:
    """Replace the interior rows of each (N, 3) field by the solution of Laplace's equation with
    the boundary rows as Dirichlet data (in place). The solve is on the corner nodes (linear
    elements over the same tetrahedra); a TET10 mid-edge node inside the part then takes the mean
    of its edge's two ends (the linear field there): about a sixth of the unknowns of the
    quadratic Laplacian, and as smooth."""
    if not fields:
        return
    names = list(fields)
    corners = elements[:, :4]
    on_boundary = np.zeros(len(nodes), bool)
    on_boundary[bnodes] = True
    is_corner = np.zeros(len(nodes), bool)
    is_corner[corners.ravel()] = True
    inner, fixed = is_corner & ~on_boundary, is_corner & on_boundary
    if inner.any():
        K, _ = fem.heat_system(nodes, corners, 1.0)
        B = np.concatenate([fields[nm][fixed] for nm in names], 1)          # (boundary corners, 3 * names)
        X = fem.symmetric_lu(K[inner][:, inner]).solve(-(K[inner][:, fixed] @ B))
        for k, nm in enumerate(names):
            fields[nm][inner] = X[:, 3 * k:3 * k + 3]
    if elements.shape[1] == 10:
        mid = elements[:, 4:].ravel()
        ends = np.array(TET10_EDGES).T
        a, b = elements[:, ends[0]].ravel(), elements[:, ends[1]].ravel()
        keep = ~on_boundary[mid]
        for nm in names:
            fields[nm][mid[keep]] = 0.5 * (fields[nm][a[keep]] + fields[nm][b[keep]])


def shape_gradient(sysm: System, u, objective_terms) -> np.ndarray:
    """dJ/dX (N, 3) of an objective whose partials are ``objective_terms`` = (dJ/du, dJ/dX|_u):
    one adjoint solve when dJ/du is not zero."""
    dJdu, dJdX = objective_terms
    total = np.array(dJdX, float, copy=True)
    if dJdu is not None and np.any(dJdu != 0):
        lam = sysm.adjoint(dJdu)
        total -= sysm.residual_shape_gradient(u, lam)
    return total


def parameter_derivatives(dJdX: np.ndarray, velocities: dict) -> dict:
    """name -> dJ/dtheta = sum over nodes of dJ/dX_n . V_n."""
    return {nm: float(np.einsum("ij,ij->", dJdX, V)) for nm, V in velocities.items()}
