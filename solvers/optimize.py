"""Shape optimisation over a scene's named parameters.

``evaluate_design`` meshes one design (surface -> tetrahedra), solves its study once, and returns
the value and dJ/dtheta of the objective and of every constraint (one adjoint solve each, one JAX
evaluation of the velocities at the mesh nodes). ``optimize`` drives scipy.optimize over it:
SLSQP when there are constraints, L-BFGS-B with bounds only. Parameters are scaled to [0, 1]
over their bounds, the objective by its starting value, each constraint by its bound; every
design is simulated once (the objective and its gradient share the solve: a cache per theta), and
its history record (feasibility included) is complete when the design is.

``run_optimize`` is what the command line calls: a scene file in, checked with the arguments before
any design; the optimised scene file and the history as JSON rewritten after every design (so an
interrupted or failed run keeps them, its status recorded), the convergence plot at the end.
``render_designs`` draws the first and the best design, framed on their meshed parts.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from taperay.runtime.outputs import check_output, write_atomic, write_text
from taperay.runtime.tape import Tape, TaperayError
from taperay.scenegraph.nodes import with_params

from .objectives import constraint_from, objective_from
from .shape import assemble, node_velocities, parameter_derivatives, shape_gradient
from .study import study_from
from .surface import default_walker
from .tetmesh import TetMesh, mesh_part

__all__ = ["Design", "evaluate_design", "shape_derivatives", "optimize", "OptimizeResult", "run_optimize",
           "plot_history", "render_designs", "save_optimized_scene", "with_params"]


@dataclass
class Design:
    """One evaluated design: parameter values, each function's value and dJ/dtheta (functions:
    the objective first, then the constraints), the mesh size, the meshed part's box ``extent``
    ([[x, y, z] min, max]) and stage timings (seconds)."""
    params: dict
    values: list
    gradients: list
    nodes: int
    elements: int
    extent: list
    timings: dict
    mesh: TetMesh | None = field(default=None, repr=False)
    field: np.ndarray | None = field(default=None, repr=False)


def tape_at(tape: Tape, params: dict) -> Tape:
    """A copy of ``tape`` with the named parameters ``params`` (name -> value) set; ``tape`` is
    left as it is."""
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
    extent = [mesh.nodes.min(0).tolist(), mesh.nodes.max(0).tolist()]
    return Design(params, values, grads, int(len(mesh.nodes)), int(len(mesh.elements)), extent, timings,
                  mesh if keep else None, u if keep else None)


def shape_derivatives(tape: Tape, study, objective, names=None, **options) -> tuple[float, dict]:
    """(value, {name: dJ/dname}) of one objective on one design (``evaluate_design``'s options)."""
    d = evaluate_design(tape, study, [objective], names, **options)
    return d.values[0], d.gradients[0]


# ---------------------------------------------------------------- the optimiser

@dataclass
class OptimizeResult:
    """``best``: the best feasible design's parameters (else the least infeasible: ``best_feasible``
    False), ``best_value``, ``best_step`` (its index in ``history``); ``history``: one dict per design
    simulated (step, params, objective, constraints, feasible, gradient norm, seconds, extent,
    iteration: whether the optimiser accepted it as an iterate); ``status``: "running" (a snapshot
    after a design), "finished", "interrupted" (Ctrl-C) or "failed"; ``message``: scipy's once
    finished, the error's when failed, else empty."""
    best: dict
    best_value: float
    best_step: int
    best_feasible: bool
    initial: dict
    initial_value: float
    history: list
    status: str
    message: str
    success: bool
    method: str
    objective: str
    constraints: list
    bounds: dict
    seconds: float

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in ("status", "objective", "constraints", "method", "bounds", "initial",
                                                "initial_value", "best", "best_value", "best_step", "best_feasible",
                                                "success", "message", "seconds", "history")}


def _default_bounds(tape: Tape, names) -> dict:
    out = {}
    for n in names:
        v = float(tape.params[tape.names[n]][0])
        out[n] = (0.5 * v, 1.5 * v) if v > 0 else ((1.5 * v, 0.5 * v) if v < 0 else (-1.0, 1.0))
    return out


def scene_inputs(tape_or_scene, study):
    """(tape, study, scene Node or None, the source's name for messages) from a Tape, a scene Node
    or a scene file path."""
    from taperay.scenegraph.flatten import flatten
    from taperay.scenegraph.nodes import Node
    scene = None
    if isinstance(tape_or_scene, (str, Path)):
        path = Path(tape_or_scene)
        source = str(path)
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
        tape = flatten(scene, source=source) if scene is not None else tape_or_scene
    elif isinstance(tape_or_scene, Node):
        scene, source = tape_or_scene, "the scene"
        tape = flatten(scene)
    elif isinstance(tape_or_scene, Tape):
        tape, source = tape_or_scene, "the tape"
        refit = getattr(tape, "refit", None)
        scene = getattr(refit, "scene", None)
    else:
        raise TaperayError(f"optimize: expected a Tape, a scene node or a scene file, got {type(tape_or_scene).__name__}")
    return tape, study, scene, source


def _check_max_steps(max_steps) -> int:
    if isinstance(max_steps, bool) or not isinstance(max_steps, (int, np.integer)) or max_steps < 1:
        raise TaperayError(f"max_steps {max_steps!r}: give a whole number of optimiser iterations, 1 or more")
    return int(max_steps)


def _check_problem(tape: Tape, study, obj, cons, bounds: dict | None, source: str) -> dict:
    """Refuse, before any design, what the study, the parameters or ``bounds`` cannot do (the error
    names ``source``); returns the bounds {name: (lo, hi)} (None: every named parameter within 0.5x
    .. 1.5x its value)."""
    for f in [obj] + [c.objective for c in cons]:
        if f.kind is None:
            continue
        if study is None:
            raise TaperayError(f"{source}: {f.name} needs a {f.kind} study and none is given (a scene .py "
                               "declares `study`; a .scene or .tape holds none: pass study=... in Python)")
        kind = study_from(study).kind
        if kind != f.kind:
            raise TaperayError(f"{source}: {f.name} needs a {f.kind} study; the scene's study is {kind}")
    if not tape.names:
        raise TaperayError(f"{source}: has no named parameters (Param) to optimise")
    bounds = dict(bounds) if bounds else _default_bounds(tape, sorted(tape.names))
    for k, (lo, hi) in bounds.items():
        if k not in tape.names:
            raise TaperayError(f"{source}: no parameter named {k!r} (have: {', '.join(sorted(tape.names))})")
        if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
            raise TaperayError(f"bounds {k}={lo}:{hi}: need finite lo < hi")
    return bounds


def optimize(tape_or_scene, objective, constraints=(), bounds: dict | None = None, max_steps: int = 20,
             progress: Callable[[dict], None] | None = None, study=None, order: int | None = None,
             resolution: int = 48, method: str | None = None, walker=None, tol: float = 1e-4,
             constraint_tol: float = 1e-3, checkpoint: Callable[[OptimizeResult], None] | None = None,
             **tet_options) -> OptimizeResult:
    """Minimise ``objective`` (an Objective or a name) over the named parameters in ``bounds``
    ({name: (lo, hi)}; None: every named parameter within 0.5x .. 1.5x its value) subject to
    ``constraints`` (Constraints or strings "volume<=initial"), with scipy.optimize: SLSQP where
    there are constraints, L-BFGS-B otherwise (``method`` overrides). ``study``: a Heat /
    Elasticity / dict (None: the scene file's ``study``). ``max_steps``: optimiser iterations (1 or
    more). A design is feasible when every constraint's relative violation is at most
    ``constraint_tol``. After each design is simulated, ``checkpoint(result)`` gets the result so far
    (status "running") and then ``progress(record)`` the design's history record."""
    from scipy.optimize import minimize
    t_start = time.perf_counter()
    max_steps = _check_max_steps(max_steps)
    obj = objective_from(objective)
    cons = [constraint_from(c) for c in constraints]
    tape, study, _, source = scene_inputs(tape_or_scene, study)
    bounds = _check_problem(tape, study, obj, cons, bounds, source)
    names = sorted(bounds)
    lo = np.array([float(bounds[k][0]) for k in names])
    hi = np.array([float(bounds[k][1]) for k in names])
    theta0 = np.array([float(tape.params[tape.names[k]][0]) for k in names])
    x0 = np.clip((theta0 - lo) / (hi - lo), 0, 1)
    functions = [obj] + [c.objective for c in cons]
    method = method or ("SLSQP" if cons else "L-BFGS-B")
    cache: dict = {}          # {rounded x: Design}
    records: dict = {}        # {rounded x: its history record}
    history: list = []
    bound_vals: list = []     # each constraint's bound, resolved on the first design

    def result(status: str, message: str = "", success: bool = False) -> OptimizeResult:
        best = _best(history)
        return OptimizeResult(best=best["params"], best_value=best["objective"], best_step=best["step"],
                              best_feasible=best["feasible"], initial=history[0]["params"],
                              initial_value=history[0]["objective"], history=list(history), status=status,
                              message=message, success=success, method=method, objective=obj.name,
                              constraints=[f"{c.objective.name} {c.op} {b:.6g}" for c, b in zip(cons, bound_vals)],
                              bounds={k: [float(bounds[k][0]), float(bounds[k][1])] for k in names},
                              seconds=time.perf_counter() - t_start)

    def design(x) -> Design:
        key = tuple(np.round(np.asarray(x, float), 12))
        d = cache.get(key)
        if d is None:
            theta = lo + np.clip(np.asarray(x, float), 0, 1) * (hi - lo)
            t = tape_at(tape, dict(zip(names, theta)))
            d = evaluate_design(t, study, functions, names, order=order, resolution=resolution, walker=walker,
                                **tet_options)
            cache[key] = d
            if not history:
                bound_vals.extend(c.resolve(v) for c, v in zip(cons, d.values[1:]))
            rec = _record(len(history), d, names, cons, bound_vals, hi - lo, constraint_tol)
            records[key] = rec
            history.append(rec)
            if checkpoint:
                checkpoint(result("running"))
            if progress:
                progress(rec)
        return d

    d0 = design(x0)
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

    def callback(xk, *args):
        rec = records.get(tuple(np.round(np.asarray(xk, float), 12)))
        if rec is not None:
            rec["iteration"] = True

    history[0]["iteration"] = True
    options = {"maxiter": max_steps}
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
    return result("finished", str(res.message), bool(res.success))


def _record(step, d: Design, names, cons, bound_vals, span, constraint_tol) -> dict:
    g = np.array([d.gradients[0][k] for k in names]) * span
    rec = {"step": step, "params": {k: d.params[k] for k in names}, "objective": d.values[0],
           "gradient": {k: d.gradients[0][k] for k in names}, "gradient_norm": float(np.linalg.norm(g)),
           "constraints": [], "seconds": d.timings.get("total", 0.0), "nodes": d.nodes, "elements": d.elements,
           "extent": d.extent, "iteration": False, "timings": dict(d.timings)}
    for c, v, b in zip(cons, d.values[1:], bound_vals):
        viol = max(0.0, (v - b) if c.op == "<=" else (b - v) if c.op == ">=" else abs(v - b))
        rec["constraints"].append({"name": c.objective.name, "op": c.op, "value": v, "bound": b,
                                   "violation": viol / (abs(b) or 1.0)})
    rec["feasible"] = all(c["violation"] <= constraint_tol for c in rec["constraints"])
    return rec


def _best(history) -> dict:
    """The feasible design of least objective, else the least infeasible (least summed violation)."""
    feasible = [r for r in history if r["feasible"]]
    if feasible:
        return min(feasible, key=lambda r: r["objective"])
    return min(history, key=lambda r: sum(c["violation"] for c in r["constraints"]))


# ---------------------------------------------------------------- outputs

def save_optimized_scene(scene, values: dict, path) -> None:
    """Save ``scene`` with its Params set to ``values`` as a .scene file (scenegraph.files.save_scene)."""
    from taperay.scenegraph.files import save_scene
    save_scene(with_params(scene, values), path)


def plot_history(result: OptimizeResult, path) -> bool:
    """A convergence plot (objective and constraints per simulated design, the parameters) as PNG,
    written atomically, through matplotlib (optional: returns False when it is not installed)."""
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
    try:
        write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    finally:
        plt.close(fig)
    return True


def render_designs(scene, result: OptimizeResult, paths: dict, walker, size=(640, 480)) -> list:
    """Render the first design (``paths["first"]``) and the best (``paths["best"]``) of ``result``
    with ``walker`` as PNG, both from one camera framing the union of their meshed parts' extents
    (a scene's own bounds may be far larger than its part: a half-space cut keeps the box it cut).
    Returns the paths written."""
    from taperay.runtime.image import write_png
    from taperay.scenegraph.flatten import flatten
    designs = {"first": result.history[0], "best": result.history[result.best_step]}
    extents = np.array([designs[label]["extent"] for label in paths], float)
    camera = _centred_camera([extents[:, 0].min(0), extents[:, 1].max(0)])
    written = []
    for label, path in paths.items():
        tape = flatten(with_params(scene, designs[label]["params"]))
        write_png(path, walker.render(tape, camera, *size))
        written.append(path)
    return written


def _centred_camera(box):
    """``auto_camera``'s view of the (2, 3) ``box``, moved across the view until the picture of the
    box's corners is centred (seen from above, the near bottom corners reach further from the
    picture's centre than the far top ones: aiming at the box's centre puts the part low)."""
    from taperay.runtime.camera import Camera, auto_camera
    camera = auto_camera(box)
    corners = np.array([[box[i][0], box[j][1], box[k][2]] for i in (0, 1) for j in (0, 1) for k in (0, 1)], float)
    for _ in range(4):
        fwd, right, up = camera.basis()
        eye, target = np.asarray(camera.eye, float), np.asarray(camera.target, float)
        rel = corners - eye
        depth = rel @ fwd
        x, y = (rel @ right) / depth, (rel @ up) / depth          # (tangents of the view angles)
        shift = ((x.min() + x.max()) / 2 * right + (y.min() + y.max()) / 2 * up) * np.linalg.norm(target - eye)
        camera = Camera(tuple(eye + shift), tuple(target + shift), camera.up, camera.fov_deg)
    return camera


class _RunFiles:
    """The files ``run_optimize`` keeps: after every design the best design's .scene (when the best
    changed) and the history JSON (status "running"), in that order, so the history never names a
    best that is not saved (about 4 ms for both); the plot (a matplotlib figure: 0.3-0.7 s, as much
    as a fifth to a half of a small design) only at the end, also when the run is interrupted or
    fails, with the history's status saying which."""

    def __init__(self, scene, out_scene, history_json, plot_png):
        self.scene, self.out_scene, self.history_json, self.plot_png = scene, out_scene, history_json, plot_png
        self.last: OptimizeResult | None = None
        self.saved_step: int | None = None

    def design_done(self, result: OptimizeResult) -> None:
        self.last = result
        self._write(result)

    def _write(self, result: OptimizeResult) -> None:
        if self.out_scene is not None and result.best_step != self.saved_step:
            save_optimized_scene(self.scene, result.best, self.out_scene)
            self.saved_step = result.best_step
        if self.history_json is not None:
            write_text(self.history_json, json.dumps(result.to_json(), indent=1, default=_json_default))

    def finish(self, result: OptimizeResult) -> None:
        self._write(result)
        if self.plot_png is not None:
            plot_history(result, self.plot_png)

    def stopped(self, error: BaseException) -> None:
        """The run ended early by ``error``: the last finished design's files, status "interrupted"
        (Ctrl-C) or "failed" (message: the error's). Nothing when no design finished."""
        if self.last is None:
            return
        if isinstance(error, KeyboardInterrupt):
            self.finish(dataclasses.replace(self.last, status="interrupted"))
        else:
            self.finish(dataclasses.replace(self.last, status="failed", message=str(error) or type(error).__name__))


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
    """The command line's optimisation: ``scene_path`` (a .py with ``scene`` and, for a simulated
    objective, ``study``; or a .scene, with study=... for one), ``objective`` a name
    (objectives.OBJECTIVES), ``constraint`` one string or a list ("volume<=initial", "mass<=0.2",
    "volume<=95%"), ``bounds`` {name: (lo, hi)} or strings "NAME=LO:HI". The arguments, the outputs
    and the scene are checked before any design. Writes ``out_scene`` (.scene with the best parameter
    values: a .tape input has no scene tree to write and is refused) and ``history_json`` after every
    design, ``plot_png`` at the end; on an interruption or an error, all three from the last finished
    design, then the exception goes on."""
    max_steps = _check_max_steps(max_steps)
    obj = objective_from(objective)
    cons = [constraint_from(c) for c in ([] if constraint is None else
                                          [constraint] if isinstance(constraint, str) else constraint)]
    bounds = _parse_bounds(bounds)
    outputs = [Path(p) for p in (out_scene, history_json, plot_png) if p is not None]
    inputs = (scene_path,) if isinstance(scene_path, (str, Path)) else ()
    targets = [check_output(p, inputs) for p in outputs]
    for i, t in enumerate(targets):
        if t in targets[:i]:
            raise TaperayError(f"{outputs[i]}: given as two outputs; give each its own file")
    tape, study, scene, source = scene_inputs(scene_path, options.pop("study", None))
    if out_scene is not None and scene is None:
        raise TaperayError(f"{source}: is a tape, with no scene tree to write the optimised design into; "
                           "optimize a scene .py (declaring `scene` and `study`) or a .scene file")
    bounds = _check_problem(tape, study, obj, cons, bounds, source)
    files = _RunFiles(scene, out_scene, history_json, plot_png)
    try:
        res = optimize(tape, obj, cons, bounds, max_steps, progress, study=study, order=order,
                       resolution=resolution, checkpoint=files.design_done, **options)
    except BaseException as e:
        files.stopped(e)
        raise
    files.finish(res)
    return res


def _json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    return str(o)
