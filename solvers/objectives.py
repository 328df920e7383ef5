"""Objectives of shape optimisation, each with the partial derivatives its adjoint needs.

An objective maps a solved system (``shape.System`` and its field u on the mesh) to
``(value, dJ/du or None, dJ/dX (N, 3))``: the partials with u and the node coordinates X held
in turn. ``shape.shape_gradient`` turns them into the total dJ/dX with one adjoint solve, and
``shape.parameter_derivatives`` into dJ/dtheta per named parameter.

Objectives: ``MeanTemperature``, ``MaxTemperature`` (a p-mean: a soft maximum), ``Compliance``
(f . u), ``MaxVonMises`` (a p-mean of the von Mises stress), ``Volume``, ``Mass`` (per-material
density). They combine: ``2 * a + b`` is a ``Weighted`` sum (one adjoint solve for the sum), and
``a <= 3.0`` / ``a >= ...`` / ``a == ...`` make a ``Constraint``. Volume and mass need no FEM
solve: they are integrals over the mesh, exact for the meshed domain, with dJ/dX = the mesh's
div V integrand (the volume form of int_boundary V . n dA).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

from taperay.runtime.tape import TaperayError

from . import fem
from .shape import System, load_shape_gradient, volume_integral_gradient, _geom, _rule, _blocks, _scatter, _stress

__all__ = ["Objective", "MeanTemperature", "MaxTemperature", "Compliance", "MaxVonMises", "Volume", "Mass",
           "Weighted", "Constraint", "objective_from", "constraint_from", "OBJECTIVES"]


class Objective:
    """Base class: ``kind`` is the study it needs ("heat", "elasticity") or None (geometry only);
    ``terms(system, u) -> (value, dJ/du (ndof,) or None, dJ/dX (N, 3))``."""
    kind: str | None = None
    name: str = "objective"

    def terms(self, sysm: System, u):
        raise NotImplementedError

    def __mul__(self, w):
        return Weighted([(float(w), self)])

    __rmul__ = __mul__

    def __add__(self, other):
        return Weighted(_parts(self) + _parts(other))

    def __le__(self, bound):
        return Constraint(self, "<=", bound)

    def __ge__(self, bound):
        return Constraint(self, ">=", bound)

    def constraint(self, op: str, bound):
        return Constraint(self, op, bound)

    def __repr__(self):
        return self.name


def _parts(o):
    return list(o.parts) if isinstance(o, Weighted) else [(1.0, o)]


def _measure(sysm: System, weight=None):
    """(int w dx, d/dX) over the mesh; w per element (None: 1). Exact for curved TET10 (degree 3)."""
    vol, dvol = sysm.volumes()
    el = sysm.mesh.elements
    if weight is None:
        return float(vol.sum()), _scatter(el.ravel(), dvol, len(sysm.mesh.nodes))
    wv = np.asarray(weight, float)
    return float(wv @ vol), _scatter(el.ravel(), wv[:, None, None] * dvol, len(sysm.mesh.nodes))


class Volume(Objective):
    """The volume of the meshed part (m^3)."""
    kind = None
    name = "volume"

    def terms(self, sysm, u):
        v, dX = _measure(sysm)
        return v, None, dX


@dataclass(repr=False)
class Mass(Objective):
    """sum over materials of density x volume; ``density`` a number or {material name: kg/m^3}
    (a '*' key is the default)."""
    density: float | dict = 1.0
    kind = None
    name = "mass"

    def terms(self, sysm, u):
        from .study import _per_material
        rho = _per_material(self.density, sysm.material_names, sysm.element_material, "density")
        v, dX = _measure(sysm, rho)
        return v, None, dX


def _field_at(sysm, u, Nq, e):
    U = np.asarray(u, float).reshape(len(sysm.mesh.nodes), -1)
    return U[e][:, :, 0] @ Nq


class MeanTemperature(Objective):
    """int T dx / int dx."""
    kind = "heat"
    name = "mean_temperature"

    def terms(self, sysm, u):
        el, nodes = sysm.mesh.elements, sysm.mesh.nodes
        deg = 2 * sysm.mesh.order
        I, dIX, dIu = volume_integral_gradient(nodes, el, deg,
                                               lambda Nq, e, blk: (_field_at(sysm, u, Nq, e), np.broadcast_to(Nq, (len(e), len(Nq)))))
        V, dVX = _measure(sysm)
        return I / V, dIu / V, dIX / V - I * dVX / V ** 2


@dataclass(repr=False)
class MaxTemperature(Objective):
    """A soft maximum of the temperature: the p-mean  Ts (int ((T - offset) / Ts)^p dx / int dx)^(1/p)
    + offset, Ts the largest nodal T - offset (a scale; the value does not depend on it). It is
    below the true maximum and approaches it as p grows. T - offset must be positive everywhere
    (temperatures above ``offset``, e.g. the ambient temperature)."""
    p: float = 8.0
    offset: float = 0.0
    kind = "heat"
    name = "max_temperature"

    def terms(self, sysm, u):
        el, nodes = sysm.mesh.elements, sysm.mesh.nodes
        T = np.asarray(u, float) - self.offset
        Ts = float(T.max())
        if not T.min() > 0:
            raise TaperayError(f"max_temperature: the p-mean needs T > {self.offset} everywhere "
                               f"(min T = {T.min() + self.offset:.6g}); set offset below the lowest temperature")
        p = float(self.p)

        def integrand(Nq, e, blk):
            t = (T[e] @ Nq) / Ts
            if np.any(t <= 0):
                raise TaperayError("max_temperature: T - offset <= 0 at a quadrature point")
            return t ** p, (p * t ** (p - 1) / Ts)[:, None] * Nq[None]
        I, dIX, dIu = volume_integral_gradient(nodes, el, 2 * sysm.mesh.order, integrand)
        V, dVX = _measure(sysm)
        J = Ts * (I / V) ** (1 / p)
        c = J / p
        return J + self.offset, c * dIu / I, c * (dIX / I - dVX / V)


class Compliance(Objective):
    """f . u: the work of the loads (elasticity; N m)."""
    kind = "elasticity"
    name = "compliance"

    def terms(self, sysm, u):
        uf = np.asarray(u, float).ravel()
        return float(sysm.f @ uf), sysm.f.copy(), load_shape_gradient(sysm, sysm.mesh.nodes, uf)


@dataclass(repr=False)
class MaxVonMises(Objective):
    """A soft maximum of the von Mises stress: the p-mean (int vm^p dx / int dx)^(1/p) at the
    stiffness quadrature points (Pa)."""
    p: float = 8.0
    kind = "elasticity"
    name = "max_von_mises"

    def terms(self, sysm, u):
        nodes, el = sysm.mesh.nodes, sysm.mesh.elements
        E, n = el.shape
        _, dNq, wts = _rule(n, 2 * sysm.mesh.order)
        U = np.asarray(u, float).reshape(-1, 3)
        lam_, mu_ = fem.lame(sysm.E, sysm.nu)
        p = float(self.p)
        # a scale: the largest vm at the quadrature points
        vals = []
        for stage in (0, 1):
            I = 0.0
            dX = np.zeros((len(nodes), 3))
            du = np.zeros((len(nodes), 3))
            for blk in _blocks(E):
                e = el[blk]
                X = nodes[e]
                ge = np.zeros((len(e), n, 3))
                gu_ = np.zeros((len(e), n, 3))
                for q in range(len(wts)):
                    det, G = _geom(X, dNq[q])
                    w = wts[q] * det
                    gu = np.einsum("eac,eaj->ecj", U[e], G)
                    s = _stress(gu, lam_[blk], mu_[blk])
                    dev = s - np.trace(s, axis1=1, axis2=2)[:, None, None] / 3 * np.eye(3)
                    vm = np.sqrt(np.maximum(1.5 * np.einsum("eij,eij->e", dev, dev), 1e-300))
                    if stage == 0:
                        vals.append(vm.max())
                        continue
                    t = vm / S
                    I += float(np.dot(w, t ** p))
                    # d(t^p)/d(grad u) = p t^(p-1) / S * dvm/dsigma : C : sym;  dvm/dsigma = 1.5 dev / vm
                    dvm = 1.5 * dev / vm[:, None, None]
                    A = 2 * mu_[blk][:, None, None] * dvm + (lam_[blk] * np.trace(dvm, axis1=1, axis2=2))[:, None, None] * np.eye(3)
                    coef = (w * p * t ** (p - 1) / S)[:, None, None]
                    B = coef * A                                   # d(w t^p)/d(grad u)_cj (symmetric)
                    gu_ += np.einsum("ecj,eaj->eac", B, G)
                    # geometry: w t^p div V  +  B : d(grad u), d(grad u)_cj = -(grad u)_cm V_m,j
                    ge += (w * t ** p)[:, None, None] * G - np.einsum("ecj,ecm,eaj->eam", B, gu, G)
                if stage == 1:
                    np.add.at(dX, e.ravel(), ge.reshape(-1, 3))
                    np.add.at(du, e.ravel(), gu_.reshape(-1, 3))
            if stage == 0:
                S = max(float(np.max(vals)), 1e-300)
        V, dVX = _measure(sysm)
        J = S * (I / V) ** (1 / p)
        c = J / p
        return J, c * du.ravel() / I, c * (dX / I - dVX / V)


@dataclass(repr=False)
class Weighted(Objective):
    """sum_k w_k J_k (one adjoint solve for the sum)."""
    parts: list = field(default_factory=list)

    @property
    def kind(self):
        kinds = {o.kind for _, o in self.parts} - {None}
        if len(kinds) > 1:
            raise TaperayError(f"a weighted sum mixes studies {sorted(kinds)}")
        return kinds.pop() if kinds else None

    @property
    def name(self):
        return " + ".join(f"{w:g}*{o.name}" if w != 1 else o.name for w, o in self.parts)

    def terms(self, sysm, u):
        val, du, dX = 0.0, None, None
        for w, o in self.parts:
            v, gu, gX = o.terms(sysm, u)
            val += w * v
            dX = w * gX if dX is None else dX + w * gX
            if gu is not None:
                gu = np.asarray(gu, float).ravel()
                du = w * gu if du is None else du + w * gu
        return val, du, dX


@dataclass
class Constraint:
    """``objective op bound`` with op "<=", ">=" or "==". ``bound`` a number, or "initial" (the
    starting design's value) or a string "NN%" (percent of the starting design's value)."""
    objective: Objective
    op: str
    bound: float | str

    def __post_init__(self):
        if self.op not in ("<=", ">=", "=="):
            raise TaperayError(f"constraint operator {self.op!r}: use <=, >= or ==")
        b = self.bound
        if not (isinstance(b, str) and b.strip().lower() == "initial"):
            number = b.strip().removesuffix("%") if isinstance(b, str) else b
            try:
                finite = math.isfinite(float(number))
            except (TypeError, ValueError):
                finite = False
            if not finite:
                raise TaperayError(f"bad constraint bound {b!r}: a finite number, 'initial' or 'NN%'")

    def resolve(self, initial: float) -> float:
        b = self.bound
        if isinstance(b, str):
            s = b.strip().lower()
            if s == "initial":
                return float(initial)
            if s.endswith("%"):
                return float(s[:-1]) / 100.0 * float(initial)
            return float(s)
        return float(b)

    def __str__(self):
        return f"{self.objective.name} {self.op} {self.bound}"


OBJECTIVES = {"mean_temperature": MeanTemperature, "max_temperature": MaxTemperature,
              "compliance": Compliance, "max_von_mises": MaxVonMises, "volume": Volume, "mass": Mass}


def objective_from(spec, **options) -> Objective:
    """An Objective from an Objective or a name (``OBJECTIVES``; e.g. "max_temperature"), options
    to its class (p=..., offset=..., density=...)."""
    if isinstance(spec, Objective):
        return spec
    name = str(spec).strip().lower().replace("-", "_")
    if name not in OBJECTIVES:
        raise TaperayError(f"unknown objective {spec!r} (known: {', '.join(sorted(OBJECTIVES))})")
    return OBJECTIVES[name](**options)


_CONSTRAINT = re.compile(r"^\s*([a-z_\-]+)\s*(<=|>=|==|=)\s*(\S+)\s*$", re.I)


def constraint_from(spec, **options) -> Constraint:
    """A Constraint from a Constraint or a string "NAME<=V" / "NAME>=V" / "NAME==V", V a number,
    "initial" or "NN%" (of the starting design's value)."""
    if isinstance(spec, Constraint):
        return spec
    m = _CONSTRAINT.match(str(spec))
    if not m:
        raise TaperayError(f"bad constraint {spec!r}: expected NAME<=VALUE (e.g. 'volume<=initial', 'mass<=0.2')")
    name, op, bound = m.groups()
    return Constraint(objective_from(name, **options), "==" if op == "=" else op, bound)
