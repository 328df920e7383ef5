"""Shape optimisation over a scene's named parameters.

``evaluate_design`` meshes one design (surface -> tetrahedra), solves its study once, and returns
the value and dJ/dtheta of the objective and of every constraint (one adjoint solve each, one JAX
evaluation of the velocities at the mesh nodes). ``optimize`` drives scipy.optimize over it:
SLSQP when there are constraints, L-BFGS-B with bounds only. Parameters are scaled to [0, 1]
over their bounds, the objective by its starting value, each constraint by its bound; every
design is simulated once (the objective and its gradient share the solve: a cache per theta).

``run_optimize`` is what the command line calls: a scene file in, the optimised scene file, the
history as JSON and a convergence plot out.
"""
from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from taperay.runtime.tape import Tape, TaperayError
from taperay.scenegraph.nodes import with_params

from .objectives import constraint_from, objective_from
from .shape import assemble, node_velocities, parameter_derivatives, shape_gradient
from .study import study_from
from .surface import default_walker
from .tetmesh import TetMesh, mesh_part

__all__ = ["Design", "evaluate_design", "shape_derivatives", "optimize", "OptimizeResult", "run_optimize",
           "plot_history", "save_optimized_scene", "with_params"]


@dataclass
class Design:
    """One evaluated design: parameter values, each function's value and dJ/dtheta (functions:
    the objective first, then the constraints), the mesh size and stage timings (seconds)."""
    params: dict
    values: list
    gradients: list
    nodes: int
    elements: int
    timings: dict
    mesh: TetMesh | None = field(default=None, repr=False)
    field: np.ndarray | None = field(default=None, repr=False)


def _tape_at(tape: Tape, params: dict) -> Tape:
    t = copy.copy(tape)
    for k, v in params.items():
        if not np.isclose(float(np.float32(v)), float(t.params[t.names[k]][0]), rtol=0, atol=0):
            t.set_param(k, float(v))
    return t


def evaluate_design(tape: Tape, study, functions, names=None, order: int | None = None, resolution: int = 48,
                    walker=None, mesh: TetMesh | None = None, keep: bool = False, **tet_options) -> Design:
    """Mesh ``tape`` (unless ``mesh`` is given), solve ``study`` once (None: geometry only, no
    solve) and differentiate each of ``functions`` (Objectives) w.r.t. the named parameters
    ``names`` (None: all)."""
    functions = [objective_from(f) for f in functions]
    kinds = {f.kind for f in functions} - {None}
    study = None if study is None else study_from(study)
    if kinds and (study is None or kinds != {study.kind}):
        raise TaperayError(f"objectives {[f.name for f in functions]} need a {'/'.join(sorted(kinds))} study, "
                           f"got {study.kind if study else 'none'}")
    walker = default_walker(walker)
    names = sorted(tape.names) if names is None else list(names)
    timings = {}
    t0 = time.perf_counter()
    if order is None:
        order = 2 if (study is not None and study.kind == "elasticity") else 1
    if mesh is None:
        mesh, _, made = mesh_part(tape, resolution, order, walker, **tet_options)
        timings.update(made)
    t1 = time.perf_counter()
    if study is None:
        from .shape import System
        from .surface import material_names
        from .study import element_materials
        sysm = System("heat", mesh, None, None, np.zeros(0, np.int64), np.zeros(0),
                      element_material=element_materials(tape, mesh.nodes, mesh.elements, walker),
                      material_names=material_names(tape))
        u = None
        timings["assembly"] = time.perf_counter() - t1
    else:
        sysm = assemble(tape, study, mesh, walker)
        timings["assembly"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        u = sysm.solve()
        timings["solve"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    V = node_velocities(tape, mesh.nodes, names, faces=mesh.boundary_faces(), elements=mesh.elements)
    timings["velocity"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    values, grads = [], []
    for f in functions:
        val, du, dX = f.terms(sysm, u)
        g = shape_gradient(sysm, u, (du, dX))
        values.append(float(val))
        grads.append(parameter_derivatives(g, V))
    timings["adjoint"] = sysm.info.get("adjoint_seconds", 0.0)              # the adjoint solves
    timings["shape_gradient"] = time.perf_counter() - t1 - timings["adjoint"]  # objective terms, dJ/dX, dJ/dtheta
    timings["total"] = time.perf_counter() - t0
    params = {k: float(tape.params[tape.names[k]][0]) for k in sorted(tape.names)}
    return Design(params, values, grads, int(len(mesh.nodes)), int(len(mesh.elements)), timings,
                  mesh if keep else None, u if keep else None)


def shape_derivatives(tape: Tape, study, objective, names=None, **options) -> tuple[float, dict]:
    """(value, {name: dJ/dname}) of one objective on one design (``evaluate_design``'s options)."""
    d = evaluate_design(tape, study, [objective], names, **options)
    return d.values[0], d.gradients[0]


# ---------------------------------------------------------------- the optimiser

@dataclass
class OptimizeResult:
    """``best``: the best feasible design's parameters (else the least infeasible); ``best_value``;
    ``history``: one dict per design simulated (step, params, objective, constraints, gradient norm,
    seconds, iteration: whether the optimiser accepted it as an iterate); ``message`` scipy's."""
    best: dict
    best_value: float
    initial: dict
    initial_value: float
    history: list
    message: str
    success: bool
    method: str
    objective: str
    constraints: list
    bounds: dict
    seconds: float

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in ("objective", "constraints", "method", "bounds", "initial", "initial_value",
                                                "best", "best_value", "success", "message", "seconds", "history")}


def _default_bounds(tape: Tape, names) -> dict:
    out = {}
    for n in names:
        v = float(tape.params[tape.names[n]][0])
        out[n] = (0.5 * v, 1.5 * v) if v > 0 else ((1.5 * v, 0.5 * v) if v < 0 else (-1.0, 1.0))
    return out


def _scene_inputs(tape_or_scene, study):
    """(tape, study, scene Node or None) from a Tape, a scene Node or a scene file path."""
    from taperay.scenegraph.flatten import flatten
    from taperay.scenegraph.nodes import Node
    scene = None
    if isinstance(tape_or_scene, (str, Path)):
        path = Path(tape_or_scene)
        if path.suffix.lower() == ".py":
            from taperay.scenegraph.loading import scene_namespace
            scene, ns = scene_namespace(path)
            study = study if study is not None else ns.get("study")
        else:
            from taperay.scenegraph.files import load_file
            obj = load_file(path)
            if isinstance(obj, Tape):
                tape_or_scene = obj
            else:
                scene = obj
        tape = flatten(scene, source=str(path)) if scene is not None else tape_or_scene
    elif isinstance(tape_or_scene, Node):
        scene = tape_or_scene
        tape = flatten(scene)
    elif isinstance(tape_or_scene, Tape):
        tape = tape_or_scene
        refit = getattr(tape, "refit", None)
        scene = getattr(refit, "scene", None)
    else:
        raise TaperayError(f"optimize: expected a Tape, a scene node or a scene file, got {type(tape_or_scene).__name__}")
    return tape, study, scene


def optimize(tape_or_scene, objective, constraints=(), bounds: dict | None = None, max_steps: int = 20,
             progress: Callable[[dict], None] | None = None, study=None, order: int | None = None,
             resolution: int = 48, method: str | None = None, walker=None, tol: float = 1e-4,
             constraint_tol: float = 1e-3, **tet_options) -> OptimizeResult:
    """Minimise ``objective`` (an Objective or a name) over the named parameters in ``bounds``
    ({name: (lo, hi)}; None: every named parameter within 0.5x .. 1.5x its value) subject to
    ``constraints`` (Constraints or strings "volume<=initial"), with scipy.optimize: SLSQP where
    there are constraints, L-BFGS-B otherwise (``method`` overrides). ``study``: a Heat /
    Elasticity / dict (None: the scene file's ``study``). ``max_steps``: optimiser iterations.
    ``progress(record)`` is called after each design is simulated (the history record)."""
    from scipy.optimize import minimize
    t_start = time.perf_counter()
    tape, study, _ = _scene_inputs(tape_or_scene, study)
    obj = objective_from(objective)
    cons = [constraint_from(c) for c in constraints]
    if study is None and (obj.kind is not None or any(c.objective.kind for c in cons)):
        raise TaperayError(f"objective {obj.name!r} needs a study (the scene file's `study`, or study=...)")
    bounds = dict(bounds) if bounds else _default_bounds(tape, sorted(tape.names))
    for k in bounds:
        if k not in tape.names:
            raise TaperayError(f"no parameter named {k!r} (have: {', '.join(sorted(tape.names)) or 'none'})")
    names = sorted(bounds)
    lo = np.array([float(bounds[k][0]) for k in names])
    hi = np.array([float(bounds[k][1]) for k in names])
    if np.any(hi <= lo):
        raise TaperayError("bounds: each needs lo < hi")
    theta0 = np.array([float(tape.params[tape.names[k]][0]) for k in names])
    x0 = np.clip((theta0 - lo) / (hi - lo), 0, 1)
    functions = [obj] + [c.objective for c in cons]
    cache: dict = {}
    history: list = []

    def design(x) -> Design:
        key = tuple(np.round(np.asarray(x, float), 12))
        d = cache.get(key)
        if d is None:
            theta = lo + np.clip(np.asarray(x, float), 0, 1) * (hi - lo)
            t = _tape_at(tape, dict(zip(names, theta)))
            d = evaluate_design(t, study, functions, names, order=order, resolution=resolution, walker=walker,
                                **tet_options)
            cache[key] = d
            rec = _record(len(history), d, names, obj, cons, bound_vals, hi - lo)
            rec["_key"] = key
            history.append(rec)
            if progress:
                progress(rec)
        return d

    bound_vals = None
    d0 = design(x0)
    bound_vals = [c.resolve(v) for c, v in zip(cons, d0.values[1:])]
    history[0].update(_record(0, d0, names, obj, cons, bound_vals, hi - lo))   # (now with the bounds)
    J0 = abs(d0.values[0]) or 1.0

    def fun(x):
        return design(x).values[0] / J0

    def jac(x):
        g = design(x).gradients[0]
        return np.array([g[k] for k in names]) * (hi - lo) / J0

    def cfun(i, sign):
        b = bound_vals[i]
        s = abs(b) or 1.0
        return (lambda x: sign * (b - design(x).values[1 + i]) / s,
                lambda x: -sign * np.array([design(x).gradients[1 + i][k] for k in names]) * (hi - lo) / s)

    scons = []
    for i, c in enumerate(cons):
        if c.op == "==":
            f, j = cfun(i, 1.0)
            scons.append({"type": "eq", "fun": f, "jac": j})
        else:
            f, j = cfun(i, 1.0 if c.op == "<=" else -1.0)
            scons.append({"type": "ineq", "fun": f, "jac": j})
    method = method or ("SLSQP" if scons else "L-BFGS-B")

    def callback(xk, *args):
        key = tuple(np.round(np.asarray(xk, float), 12))
        for rec in history:
            if rec.get("_key") == key:
                rec["iteration"] = True

    history[0]["iteration"] = True
    options = {"maxiter": int(max_steps)}
    if method.upper() == "SLSQP":
        options["ftol"] = tol
    elif method.upper() == "L-BFGS-B":
        options["ftol"] = tol
        options["gtol"] = 1e-6
    res = minimize(fun, x0, jac=jac, method=method, bounds=[(0.0, 1.0)] * len(names), constraints=scons,
                   callback=callback, options=options)
    # make sure scipy's final point is evaluated and recorded
    design(np.clip(res.x, 0, 1))
    callback(np.clip(res.x, 0, 1))
    for rec in history:
        rec.pop("_key", None)
    best = _best(history, cons, constraint_tol)
    return OptimizeResult(best=best["params"], best_value=best["objective"], initial=history[0]["params"],
                          initial_value=history[0]["objective"], history=history, message=str(res.message),
                          success=bool(res.success), method=method, objective=obj.name,
                          constraints=[f"{c.objective.name} {c.op} {b:.6g}" for c, b in zip(cons, bound_vals)],
                          bounds={k: [float(bounds[k][0]), float(bounds[k][1])] for k in names},
                          seconds=time.perf_counter() - t_start)


def _record(step, d: Design, names, obj, cons, bound_vals, span) -> dict:
    g = np.array([d.gradients[0][k] for k in names]) * span
    rec = {"step": step, "params": {k: d.params[k] for k in names}, "objective": d.values[0],
           "gradient": {k: d.gradients[0][k] for k in names}, "gradient_norm": float(np.linalg.norm(g)),
           "constraints": [], "feasible": True, "seconds": d.timings.get("total", 0.0),
           "nodes": d.nodes, "elements": d.elements, "iteration": False, "timings": dict(d.timings)}
    for c, v, b in zip(cons, d.values[1:], bound_vals or [None] * len(cons)):
        viol = 0.0 if b is None else max(0.0, (v - b) if c.op == "<=" else (b - v) if c.op == ">=" else abs(v - b))
        rel = viol / (abs(b) or 1.0) if b is not None else 0.0
        rec["constraints"].append({"name": c.objective.name, "op": c.op, "value": v, "bound": b, "violation": rel})
    return rec


def _best(history, cons, tol) -> dict:
    feas = [r for r in history if all(c["violation"] <= tol for c in r["constraints"])]
    for r in history:
        r["feasible"] = all(c["violation"] <= tol for c in r["constraints"])
    if feas:
        return min(feas, key=lambda r: r["objective"])
    return min(history, key=lambda r: sum(c["violation"] for c in r["constraints"]))


# ---------------------------------------------------------------- outputs

def save_optimized_scene(scene, values: dict, path) -> None:
    """Save ``scene`` with its Params set to ``values`` as a .scene file (scenegraph.files.save_scene)."""
    from taperay.scenegraph.files import save_scene
    save_scene(with_params(scene, values), path)


def plot_history(result: OptimizeResult, path) -> bool:
    """A convergence plot (objective and constraints per simulated design, the parameters) as PNG,
    through matplotlib (optional: returns False when it is not installed)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    h = result.history
    steps = [r["step"] for r in h]
    it = [r["step"] for r in h if r["iteration"]]
    fig, axes = plt.subplots(1, 2 + bool(result.constraints), figsize=(5 * (2 + bool(result.constraints)), 3.6))
    ax = axes[0]
    ax.plot(steps, [r["objective"] for r in h], "o-", color="0.6", ms=3, label="designs simulated")
    ax.plot(it, [h[s]["objective"] for s in it], "s-", color="C0", label="iterates")
    ax.set_xlabel("design")
    ax.set_ylabel(result.objective)
    ax.legend(fontsize=8)
    k = 1
    if result.constraints:
        ax = axes[k]
        for i, c in enumerate(result.constraints):
            ax.plot(steps, [r["constraints"][i]["value"] for r in h], "o-", ms=3, label=c)
            ax.axhline(h[0]["constraints"][i]["bound"], ls="--", color="k", lw=0.8)
        ax.set_xlabel("design")
        ax.legend(fontsize=8)
        k += 1
    ax = axes[k]
    for name in h[0]["params"]:
        lo, hi = result.bounds[name]
        ax.plot(steps, [(r["params"][name] - lo) / (hi - lo) for r in h], "o-", ms=3, label=name)
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("design")
    ax.set_ylabel("parameter (0 = lower bound, 1 = upper)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)
    plt.close(fig)
    return True


def _parse_bounds(bounds) -> dict | None:
    if bounds is None or isinstance(bounds, dict):
        return bounds
    out = {}
    for b in bounds:
        try:
            name, rng = str(b).split("=", 1)
            lo, hi = rng.split(":", 1)
            out[name.strip()] = (float(lo), float(hi))
        except ValueError:
            raise TaperayError(f"bad bounds {b!r}: expected NAME=LO:HI") from None
    return out


def run_optimize(scene_path, objective: str = "max_temperature", constraint=None, bounds=None, max_steps: int = 20,
                 out_scene=None, history_json=None, plot_png=None, progress=None, resolution: int = 48,
                 order: int | None = None, **options) -> OptimizeResult:
    """The command line's optimisation: ``scene_path`` (a .py with ``scene`` and ``study``, or a
    .scene), ``objective`` a name (objectives.OBJECTIVES), ``constraint`` one string or a list
    ("volume<=initial", "mass<=0.2", "volume<=95%"), ``bounds`` {name: (lo, hi)} or strings
    "NAME=LO:HI". Writes ``out_scene`` (.scene with the best parameter values), ``history_json``
    and ``plot_png`` where given."""
    tape, study, scene = _scene_inputs(scene_path, options.pop("study", None))
    cons = [] if constraint is None else ([constraint] if isinstance(constraint, str) else list(constraint))
    res = optimize(tape, objective, cons, _parse_bounds(bounds), max_steps, progress, study=study, order=order,
                   resolution=resolution, **options)
    if out_scene is not None:
        if scene is None:
            raise TaperayError("the optimised scene cannot be saved: the input has no scene tree (a .tape file)")
        save_optimized_scene(scene, res.best, out_scene)
    if history_json is not None:
        Path(history_json).write_text(json.dumps(res.to_json(), indent=1, default=_json_default))
    if plot_png is not None:
        plot_history(res, plot_png)
    return res


def _json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return str(o)
