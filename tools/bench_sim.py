"""``taperay bench sim``: the heat sink (scenes/heat_sink.py) simulated end to end, each stage timed.

Rows: TET4 and TET10 at a few surface resolutions, each for the first design (which also pays for
imports and first calls) and for a novel design (``fin_height`` and ``base_thickness`` changed
through ``tape.set_param``: a new mesh, as an optimiser's next step meets it), with nodes, DOF,
the solver used and the time of surface, tets, assembly and solve. Medians of ``--repeat`` novel
designs (at least 1).
"""
from __future__ import annotations

import statistics
import time

from .bench import BenchResult

CASES = ((1, 32), (1, 64), (2, 32), (2, 48))      # (order, surface resolution)
STAGES = ("surface", "tets", "assembly", "solve")


def _run(tape, study, order: int, resolution: int, walker) -> tuple[dict, float]:
    from taperay.solvers import simulate
    t0 = time.perf_counter()
    result = simulate(tape, study, order=order, resolution=resolution, walker=walker)
    return result.summary(), time.perf_counter() - t0


def bench_sim(opts) -> BenchResult:
    from taperay.runtime.cpu import CpuWalker
    from taperay.scenegraph import flatten
    from taperay.scenes import heat_sink
    walker = CpuWalker()
    rows = []
    for order, resolution in CASES:
        tape = flatten(heat_sink.scene, source="heat_sink")
        first, first_s = _run(tape, heat_sink.study, order, resolution, walker)
        novel = []
        for k in range(max(1, min(opts.repeat, 3))):
            tape.set_param("fin_height", 0.026 + 0.002 * k)
            tape.set_param("base_thickness", 0.005 + 0.0005 * k)
            novel.append(_run(tape, heat_sink.study, order, resolution, walker))
        median = sorted(novel, key=lambda r: r[1])[len(novel) // 2]
        for label, (summary, seconds) in (("first design", (first, first_s)), ("novel design", median)):
            row = {"case": f"TET{4 if order == 1 else 10}, resolution {resolution}", "design": label,
                   "nodes": summary["nodes"], "dof": summary["dof"], "solver": summary["solver"],
                   "total s": round(seconds, 3)}
            row.update({f"{s} s": round(summary["timings"][s], 3) for s in STAGES})
            rows.append(row)
    novel_totals = [r["total s"] for r in rows if r["design"] == "novel design"]
    return BenchResult(rows, settings={"scene": "scenes/heat_sink.py", "walker": "cpu", "cases": CASES},
                       notes=["first design: includes the process's first calls (imports, the twin's grid "
                              "evaluation, TetGen's child start); novel design: the median of "
                              f"{max(1, min(opts.repeat, 3))} designs with other fin heights and base thicknesses",
                              f"novel designs end to end: {statistics.median(novel_totals):.2f} s median over the cases"])
