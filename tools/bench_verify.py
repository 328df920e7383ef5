"""``taperay bench verify``: the simulation's default path (``simulate`` with no options but the
resolution) checked against answers it did not compute, with the error against the cell size.

Cases:
- a hollow sphere (a = 0.4, b = 1; the cavity named by a skin 0.40 < r < 0.43 unioned in), fixed
  temperatures inside and out, against T = A + B / r: nodal RMS and largest error relative to the
  temperature difference, TET4 and TET10, three resolutions, and the observed order between them;
- a thick sphere (a = 0.5, b = 1) under internal pressure, held by no support, against Lamé's
  radial displacement (TET10: RMS relative to u_r(a));
- a cantilever 10 x 1 x 1 (E = 1000, nu = 0), clamped at x = 0, unit shear on its end, against
  Timoshenko's tip deflection 4.024 (TET10, the mean over the end face's nodes);
- exact volumes of the meshed part at the default resolution (96): a box off the grid planes, the
  box rotated 27 degrees, a sphere, and scenes/heat_sink.py (3.168e-5 m^3);
- shape derivatives (adjoint, through the JAX walker) of the heat sink (max temperature, volume;
  TET4, resolution 48) and the cantilever (compliance, mass; TET10, resolution 32) against central
  differences of the whole pipeline remeshed at theta (1 +- 5 %);
- the heat sink optimised (max temperature under volume <= initial, SLSQP, 8 steps at most, the
  bounds of docs/OPTIMIZATION.md): the exact volume of the best design (boxes: the plate and six
  fins, from its parameters) against the exact volume of the first, so the constraint is judged
  on the true shape, not on the meshes it was computed on.

Writes the table and ``verify.png`` (error against cell size, log-log).
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np

from taperay.runtime.tape import TaperayError

from .bench import BenchResult

ROOT = Path(__file__).resolve().parent.parent
SHELL_RESOLUTIONS = (16, 24, 32)
LAME_RESOLUTIONS = (8, 12, 16)
BEAM_RESOLUTIONS = (20, 40, 80)
TIMOSHENKO = 1000 / (3 * 1000 / 12) + 10 / (5 / 6 * 500 * 1)        # P L^3 / 3EI + P L / (kappa G A)


def _materials():
    from taperay.scenegraph import Material
    return Material("outer", (0.8, 0.3, 0.2)), Material("inner", (0.2, 0.3, 0.8))


def _shell_case(resolution: int, order: int) -> dict:
    import taperay as tr
    from taperay.scenegraph import difference, sphere, union
    from taperay.solvers import Heat, simulate
    outer, inner = _materials()
    a, b, skin = 0.4, 1.0, 0.03
    tape = tr.flatten(union(difference(sphere(b).material(outer), sphere(a + skin / 2)),
                            difference(sphere(a + skin).material(inner), sphere(a))))
    res = simulate(tape, Heat(conductivity=3.0, fixed_temperature={"inner": 100.0, "outer": 0.0}), order=order,
                   resolution=resolution)
    B = 100.0 / (1 / a - 1 / b)
    err = res.field - (-B / b + B / np.linalg.norm(res.mesh.nodes, axis=1))
    return {"error %": 100 * float(np.sqrt(np.mean(err ** 2))) / 100.0, "max error %": float(np.abs(err).max()),
            "nodes": len(res.mesh.nodes)}


def _lame_case(resolution: int) -> dict:
    import taperay as tr
    from taperay.scenegraph import difference, sphere, union
    from taperay.solvers import Elasticity, simulate
    outer, inner = _materials()
    a, b, E, nu, p = 0.5, 1.0, 1000.0, 0.3, 1.0
    tape = tr.flatten(union(difference(sphere(b).material(outer), sphere(0.75)),
                            difference(sphere(0.76).material(inner), sphere(a))))
    res = simulate(tape, Elasticity(E=E, nu=nu, pressure={"inner": p}, free_body=True), resolution=resolution)
    x = res.mesh.nodes
    r = np.linalg.norm(x, axis=1)
    ur = np.einsum("ij,ij->i", res.field, x) / r

    def exact(r):
        return p * a ** 3 / (E * (b ** 3 - a ** 3)) * ((1 - 2 * nu) * r + (1 + nu) * b ** 3 / (2 * r ** 2))
    return {"error %": 100 * float(np.sqrt(np.mean((ur - exact(r)) ** 2)) / exact(a)),
            "max error %": 100 * float(np.abs(ur - exact(r)).max() / exact(a)), "nodes": len(x)}


def beam_tape():
    """The 10 x 1 x 1 cantilever: its end faces named by half-spaces ("wall" at x = 0, "tip" at x = 10)."""
    import taperay as tr
    from taperay.scenegraph import Material, box, intersection, plane
    beam, wall, tip = (Material(n, c) for n, c in (("beam", (0.7, 0.7, 0.7)), ("wall", (0.4, 0.4, 0.4)),
                                                  ("tip", (0.8, 0.4, 0.2))))
    return tr.flatten(intersection(box(5.5, 0.5, 0.5).translate(5, 0, 0).material(beam),
                                   plane((-1, 0, 0), 0.0).material(wall), plane((1, 0, 0), 10.0).material(tip)))


def _beam_case(resolution: int) -> dict:
    from taperay.solvers import Elasticity, simulate
    res = simulate(beam_tape(), Elasticity(E=1000.0, nu=0.0, fixed={"wall": None}, traction={"tip": (0, 0, -1.0)}),
                   resolution=resolution)
    x = res.mesh.nodes
    end = np.isclose(x[:, 0], 10.0, atol=1e-6)
    delta = -float(res.field[end, 2].mean())
    return {"error %": 100 * (delta / TIMOSHENKO - 1), "value": delta, "nodes": len(x),
            "solver": res.summary()["solver"]}


def _volume_rows() -> list[dict]:
    import taperay as tr
    from taperay.scenegraph import box, sphere
    from taperay.scenegraph.loading import load_tape
    from taperay.solvers.tetmesh import mesh_part
    q = (math.cos(math.radians(13.5)), *(math.sin(math.radians(13.5)) * np.array([1, 2, 3]) / math.sqrt(14)))
    cases = [("box 2 x 1.2 x 0.8", tr.flatten(box(1, 0.6, 0.4).translate(0.013, 0.021, 0.007)), 1.92),
             ("the box rotated 27 degrees", tr.flatten(box(1, 0.6, 0.4).rotate_quat(*q)), 1.92),
             ("sphere r = 1", tr.flatten(sphere(1.0)), 4 / 3 * math.pi),
             ("scenes/heat_sink.py", load_tape(ROOT / "scenes" / "heat_sink.py"),
              heat_sink_volume(0.006, 0.0015, 0.03))]
    rows = []
    for label, tape, exact in cases:
        t0 = time.perf_counter()
        mesh, stats, _ = mesh_part(tape, 96)
        vol = float(mesh.volumes().sum())
        rows.append({"case": f"volume: {label}", "resolution": 96, "nodes": len(mesh.nodes),
                     "error %": 100 * (vol / exact - 1), "value": vol, "exact": exact,
                     "surface": "dc" if "fallback" not in stats else "mc (fallback)",
                     "seconds": round(time.perf_counter() - t0, 2)})
    return rows


def _derivative_rows() -> list[dict]:
    from taperay.solvers.objectives import Compliance, Mass, MaxTemperature, Volume
    from taperay.solvers.optimize import scene_inputs, tape_at, evaluate_design
    rows = []
    for scene, functions, order, resolution in (("heat_sink", [MaxTemperature(), Volume()], 1, 48),
                                                ("cantilever", [Compliance(), Mass()], 2, 32)):
        tape, study = scene_inputs(ROOT / "scenes" / f"{scene}.py", None)[:2]
        at = evaluate_design(tape, study, functions, order=order, resolution=resolution)
        for name in sorted(tape.names):
            v0 = float(tape.params[tape.names[name][0]])
            h = 0.05 * abs(v0)
            plus, minus = (evaluate_design(tape_at(tape, {name: v0 + s * h}), study, functions, order=order,
                                           resolution=resolution).values for s in (1, -1))
            for k, f in enumerate(functions):
                fd = (plus[k] - minus[k]) / (2 * h)
                adjoint = at.gradients[k][name]
                rows.append({"case": f"d {f.name} / d {name}: {scene}", "resolution": resolution,
                             "value": adjoint, "exact": fd,
                             "error %": 100 * (adjoint / fd - 1) if fd else float("nan")})
    return rows


def heat_sink_volume(base_thickness: float, fin_half_thickness: float, fin_height: float) -> float:
    """scenes/heat_sink.py's exact volume: the 60 x 40 mm plate and six fins rising above it."""
    width, depth, fins = 0.06, 0.04, 6
    return width * depth * base_thickness + fins * 2 * fin_half_thickness * depth * (fin_height - base_thickness)


def _optimize_row() -> dict:
    from taperay.solvers.optimize import optimize
    t0 = time.perf_counter()
    res = optimize(ROOT / "scenes" / "heat_sink.py", "max_temperature", constraints=["volume<=initial"],
                   bounds={"base_thickness": (0.003, 0.010), "fin_half_thickness": (0.001, 0.003),
                           "fin_height": (0.020, 0.040)}, max_steps=8)
    first, best = (heat_sink_volume(**{k: float(v) for k, v in p.items()}) for p in (res.history[0]["params"], res.best))
    return {"case": "optimum's exact volume over the first's: heat sink, volume <= initial", "resolution": 48,
            "value": best, "exact": first, "error %": 100 * (best / first - 1), "feasible": bool(res.best_feasible),
            "seconds": round(time.perf_counter() - t0, 2)}


def _observed_orders(rows: list[dict]) -> None:
    """Each row of a refinement series gets the observed order against the one before it:
    log(e_prev / e) / log(h_prev / h), with h proportional to 1 / resolution."""
    for prev, row in zip(rows, rows[1:]):
        if prev["case"] == row["case"] and all(math.isfinite(r["error %"]) and r["error %"] for r in (prev, row)):
            row["observed order"] = round(math.log(abs(prev["error %"] / row["error %"]))
                                          / math.log(row["resolution"] / prev["resolution"]), 2)


def _plot(path: Path, rows: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for case in dict.fromkeys(r["case"] for r in rows if "observed order" in r or "series" in r):
        series = [r for r in rows if r["case"] == case]
        series = [r for r in series if math.isfinite(r["error %"])]
        ax.loglog([1 / r["resolution"] for r in series], [abs(r["error %"]) for r in series], "o-", label=case)
    ax.set_xlabel("cell size (1 / resolution)")
    ax.set_ylabel("error, %")
    ax.set_title("taperay bench verify: the default path against analytic answers")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bench_verify(opts) -> BenchResult:
    from .bench import BenchProgress
    rows: list[dict] = []
    series = ([("hollow sphere T = A + B/r, TET4", lambda r: _shell_case(r, 1), SHELL_RESOLUTIONS),
               ("hollow sphere T = A + B/r, TET10", lambda r: _shell_case(r, 2), SHELL_RESOLUTIONS),
               ("Lame thick sphere u_r, TET10", _lame_case, LAME_RESOLUTIONS),
               ("cantilever tip vs Timoshenko 4.024, TET10", _beam_case, BEAM_RESOLUTIONS)])
    total = sum(len(r) for *_, r in series) + 3
    with BenchProgress("bench verify", total) as tick:
        for case, run, resolutions in series:
            for resolution in resolutions:
                t0 = time.perf_counter()
                try:
                    row = {"case": case, "resolution": resolution, **run(resolution), "series": True}
                except TaperayError as e:      # (a failure is a finding: its row says why)
                    row = {"case": case, "resolution": resolution, "error %": float("nan"), "failed": str(e)}
                row["seconds"] = round(time.perf_counter() - t0, 2)
                rows.append(row)
                tick()
        rows += _volume_rows()
        tick()
        rows += _derivative_rows()
        tick()
        rows.append(_optimize_row())
        tick()
    _observed_orders(rows)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    _plot(out / "verify.png", rows)
    for r in rows:
        r.pop("series", None)
    return BenchResult(rows, settings={}, notes=[
        "every case on simulate's defaults (surface auto: dual contouring with TetGen keeping its triangles, "
        "solver auto) but the resolution; errors in % (signed for the beam, volumes and derivatives)",
        f"plot: {out / 'verify.png'}"])
