"""``taperay bench optimize``: the two shape-optimisation examples run as ``taperay optimize`` runs
them, each design's step timed by stage, with the objective history.

Examples: the heat sink (scenes/heat_sink.py: p-mean temperature at no more volume, TET10,
resolution 28) and the cantilever (scenes/cantilever.py: compliance at no more mass, TET10,
resolution 32), SLSQP, ``--repeat`` optimiser iterations at most (``max_steps``). A row per
design: nodes, the step's seconds split into mesh (surface + TetGen), solve (assembly + solve),
velocity (the node velocities: the JAX evaluation at the boundary faces, the boundary nodes'
least squares, the harmonic extension), adjoint (the adjoint solves) and shape
gradient (objective terms, dJ/dX, dJ/dtheta), the XLA compiles during the step, the objective and
the constraint. Also writes ``optimize-history.png``: each example's objective over the designs,
relative to its first.
"""
from __future__ import annotations

import time
from pathlib import Path

from .bench import BenchResult

EXAMPLES = (
    ("heat sink", "scenes/heat_sink.py", "max_temperature", "volume<=initial",
     {"base_thickness": (0.003, 0.01), "fin_half_thickness": (0.001, 0.003), "fin_height": (0.02, 0.04)},
     {"order": 2, "resolution": 28}),
    ("cantilever", "scenes/cantilever.py", "compliance", "mass<=initial",
     {"half_height": (0.008, 0.016), "half_width": (0.005, 0.011), "hole_radius": (0.003, 0.008)},
     {"order": 2, "resolution": 32}),
)
STAGES = (("mesh s", ("surface", "tets")), ("solve s", ("assembly", "solve")), ("velocity s", ("velocity",)),
          ("adjoint s", ("adjoint",)), ("shape gradient s", ("shape_gradient",)))


def _plot(path: Path, histories: dict) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for label, values in histories.items():
        ax.plot(range(len(values)), [v / values[0] for v in values], "o-", label=label)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("design")
    ax.set_ylabel("objective / first design's")
    ax.set_title("taperay bench optimize: objective per design")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def bench_optimize(opts) -> BenchResult:
    from taperay.runtime.jax_walker import compile_stats
    from taperay.solvers.optimize import optimize
    max_steps = max(1, opts.repeat)
    rows, notes, histories = [], [], {}
    for label, path, objective, constraint, bounds, options in EXAMPLES:
        compiles = [compile_stats()["compiles"]]

        def progress(rec, label=label):
            now = compile_stats()["compiles"]
            t = rec["timings"]
            row = {"example": label, "design": rec["step"], "nodes": rec["nodes"]}
            row.update({col: round(sum(t.get(k, 0.0) for k in keys), 3) for col, keys in STAGES})
            row.update({"step s": round(t["total"], 3), "jax compiles": now - compiles[-1],
                        "objective": rec["objective"], "constraint": rec["constraints"][0]["value"]})
            compiles.append(now)
            rows.append(row)

        t0 = time.perf_counter()
        res = optimize(path, objective, [constraint], bounds=bounds, max_steps=max_steps, progress=progress,
                       **options)
        seconds = time.perf_counter() - t0
        histories[label] = [r["objective"] for r in res.history]
        later = [r["step s"] for r in rows if r["example"] == label and r["design"] > 0]
        notes.append(f"{label}: {objective} {res.initial_value:.6g} -> {res.best_value:.6g} (best feasible) in "
                     f"{len(res.history)} designs, {seconds:.1f} s in all; steps after the first: median "
                     f"{sorted(later)[len(later) // 2] if later else float('nan'):.2f} s; scipy: {res.message}")
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    if _plot(out / "optimize-history.png", histories):
        notes.append(f"objective per design: {out / 'optimize-history.png'}")
    notes.append("the first design of a process pays the JAX compiles of the velocity program and the "
                 "imports; jax compiles: XLA compiles during that design's step")
    return BenchResult(rows, settings={"repeat": max_steps},
                       notes=notes)
