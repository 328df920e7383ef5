"""``taperay bench sim``: the heat sink (scenes/heat_sink.py) simulated end to end, each stage timed,
and its largest system solved by each solver.

Small case: TET10 at the coarsest surface resolution that keeps the fins (about 11,000 nodes), the
first design (which also pays for imports and first calls) and novel designs (``fin_height`` and
``base_thickness`` changed through ``tape.set_param``: a new mesh, as an optimiser's next step
meets it; the median of ``--repeat``, at most 3), with nodes, DOF, the meshed volume (the scene's
exact volume is 3.168e-5 m³), the solver and the time of surface, tets, assembly and solve.

Large case (about 1 M DOF): meshed once (surface and TetGen timed; a novel design would repeat
minutes of TetGen), saved, and solved by ``taperay simulate --mesh`` in new processes: scipy (CG +
pyamg) and PETSc (CG + GAMG) under ``mpiexec -n 1`` and ``-n 2``, both with the two-level
preconditioner of TET10 systems (its P1 level by pyamg / GAMG), each row the assembly and solve
times the process reports (``--json``); a solve that fails is a note with its error. PETSc rows
need petsc4py and mpiexec (README: PETSc and MPI); without them the table says so.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .bench import BenchResult

# (label, order, surface resolution, surface method): resolution 20 is the coarsest at which the
# 3 mm fins stay (at 18 the surface loses half the volume: the fins fall between grid nodes)
CASES = (("about 11,000 nodes", 2, 20, "auto"), ("about 1 M DOF", 2, 160, "auto"))
STAGES = ("surface", "tets", "assembly", "solve")
SCENE = Path(__file__).resolve().parent.parent / "scenes" / "heat_sink.py"
NOVEL = ({"fin_height": 0.026, "base_thickness": 0.005}, {"fin_height": 0.028, "base_thickness": 0.0055},
         {"fin_height": 0.030, "base_thickness": 0.006})


def _run(tape, study, order: int, resolution: int, surface: str, walker):
    from taperay.solvers import simulate
    t0 = time.perf_counter()
    result = simulate(tape, study, order=order, resolution=resolution, walker=walker, surface=surface)
    return result, time.perf_counter() - t0


def _design_row(label: str, surface: str, design: str, result, seconds: float) -> dict:
    summary = result.summary()
    row = {"case": label, "surface": surface, "design": design, "nodes": summary["nodes"], "dof": summary["dof"],
           "volume": f"{result.mesh.volumes().sum():.4g}", "solver": summary["solver"], "total s": round(seconds, 3)}
    row.update({f"{s} s": round(summary["timings"][s], 3) for s in STAGES})
    return row


def failure_line(output: str) -> str:
    """The reason a `taperay` process gave (its "taperay: error:" line), not the banner mpiexec
    prints after it; the last line when the process gave none (a crash)."""
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("taperay: error:")]
    if errors:
        return errors[0].removeprefix("taperay: error:").strip()
    return lines[-1] if lines else "no output"


def _solver_rows(mesh_path: Path, settings: dict) -> tuple[list[dict], list[str]]:
    """The saved mesh solved by scipy's AMG in one process and by PETSc on 1 and 2 MPI ranks."""
    rows, notes = [], []
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    cli = [sys.executable, "-m", "taperay.tools.cli", "simulate", str(SCENE), "--mesh", str(mesh_path),
           "--walker", "cpu"]
    runs = [("scipy: CG + pyamg, two-level", [], "amg")]
    from importlib.util import find_spec
    has_petsc = all(find_spec(m) is not None for m in ("mpi4py", "petsc4py")) and shutil.which("mpiexec") is not None
    if has_petsc:
        runs += [(f"PETSc: CG + two-level (P1: GAMG), {n} rank{'s' if n > 1 else ''}", [shutil.which("mpiexec"), "-n", str(n)], "petsc")
                 for n in (1, 2)]
    else:
        notes.append("PETSc rows left out: petsc4py / mpi4py / mpiexec absent (README: PETSc and MPI)")
    with tempfile.TemporaryDirectory() as tmp:
        for label, launcher, solver in runs:
            summary_path = Path(tmp) / "summary.json"
            t0 = time.perf_counter()
            done = subprocess.run(launcher + cli + ["--solver", solver, "-o", str(Path(tmp) / "out.vtu"),
                                                    "--json", str(summary_path)], env=env, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if done.returncode != 0:
                notes.append(f"{label} failed: {failure_line(done.stderr or done.stdout)}")
                continue
            s = json.loads(summary_path.read_text())
            t = s["timings"]
            rows.append({"case": settings["large"], "surface": CASES[-1][3], "design": label, "nodes": s["nodes"],
                         "dof": s["dof"], "volume": "", "solver": f"{s['solver']} ({s['iterations']} it.)",
                         "total s": round(wall, 3),
                         "surface s": "", "tets s": "", "assembly s": round(t["assembly"], 3),
                         "solve s": round(t["solve"], 3)})
    notes.append("solver rows: the large case's mesh in a new process each (`taperay simulate --mesh`); "
                 "total = the process's wall time (imports, reading the mesh, writing the VTU included)")
    return rows, notes


def bench_sim(opts) -> BenchResult:
    from taperay.runtime.cpu import CpuWalker
    from taperay.scenegraph import flatten
    from taperay.scenes import heat_sink
    walker = CpuWalker()
    rows: list[dict] = []
    for label, order, resolution, surface in CASES[:-1]:
        tape = flatten(heat_sink.scene, source="heat_sink")
        first, first_s = _run(tape, heat_sink.study, order, resolution, surface, walker)
        novel = []
        for k in range(max(1, min(opts.repeat, 3 if resolution < 100 else 1))):
            for name, value in NOVEL[k].items():
                tape.set_param(name, value)
            novel.append(_run(tape, heat_sink.study, order, resolution, surface, walker))
        median = sorted(novel, key=lambda r: r[1])[len(novel) // 2]
        rows.append(_design_row(label, surface, "first design", first, first_s))
        rows.append(_design_row(label, surface, "novel design", *median))
    label, order, resolution, surface = CASES[-1]
    settings = {"scene": "scenes/heat_sink.py", "walker": "cpu", "cases": CASES, "large": label}
    from taperay.solvers.tetmesh import mesh_part
    mesh, stats, made = mesh_part(flatten(heat_sink.scene, source="heat_sink"), resolution, order, walker, surface)
    rows.append({"case": label, "surface": surface, "design": "first design: mesh only", "nodes": len(mesh.nodes),
                 "dof": len(mesh.nodes), "volume": f"{mesh.volumes().sum():.4g}", "solver": "",
                 "total s": round(made["surface"] + made["tets"], 3), "surface s": round(made["surface"], 3),
                 "tets s": round(made["tets"], 3), "assembly s": "", "solve s": ""})
    with tempfile.TemporaryDirectory() as tmp:
        mesh_path = Path(tmp) / "large.vtu"
        mesh.save(mesh_path)
        solver_rows, notes = _solver_rows(mesh_path, settings)
    rows += solver_rows
    small_novel = [r["total s"] for r in rows if r["design"] == "novel design" and r["case"] == CASES[0][0]
                   and r["surface"] == CASES[0][3]]
    return BenchResult(rows, settings=settings,
                       notes=["first design: includes the process's first calls (imports, the twin's grid "
                              "evaluation, TetGen's child start); novel design: the median of the designs with "
                              "other fin heights and base thicknesses",
                              f"novel design end to end at {CASES[0][0]}: {statistics.median(small_novel):.2f} s"] + notes)
