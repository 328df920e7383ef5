"""Benchmark ``prune-cpu``: prospero.vm through the CPU twin's interval pruning (runtime.pruning).

Rows: the sign image (inside where f < 0) and the pruned float field image at 1024^2 and 4096^2,
evaluate_pruned at 2^20 random points of the square, the 3D march of a 3,000-record program (200
spheres, ``spheres_program``) at 480x360 by CpuWalker.march and by march_pruned for each (grid, levels)
of MARCH_CELLS (the same bits), and
the unpruned CpuWalker.field_image at 1024^2 for the ratio (one timed call: it takes seconds).
Each pruned row is the median of ``--repeat`` calls after one warm-up call (which also loads or
compiles the Numba kernels); the mean pruned tape length per tile level is reported beside it.
``--n`` is not used (the image sizes are fixed).
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np

from taperay.tools.bench import BenchResult, summarize, time_calls

PROSPERO = Path(__file__).resolve().parent.parent / "tests" / "data" / "prospero.vm"
SPHERES, MARCH_SIZE = 200, (480, 360)      # the 3D march rows: a union of spheres as a .vm program
MARCH_CELLS = ((8, 1), (4, 2), (8, 2))      # march_pruned's (grid, levels) rows


def spheres_program(n: int, seed: int = 0) -> str:
    """A 3D Fidget .vm program: the union (a chain of min) of n random spheres in [-1, 1]^3."""
    rng = np.random.default_rng(seed)
    lines = ["_x var-x", "_y var-y", "_z var-z"]
    for i, (c, r) in enumerate(zip(rng.uniform(-0.85, 0.85, (n, 3)), rng.uniform(0.05, 0.15, n))):
        for a, v in zip("xyz", c):
            lines += [f"c{a}{i} const {v:.6f}", f"d{a}{i} sub _{a} c{a}{i}", f"s{a}{i} square d{a}{i}"]
        lines += [f"q{i} add sx{i} sy{i}", f"w{i} add q{i} sz{i}", f"l{i} sqrt w{i}",
                  f"r{i} const {r:.6f}", f"f{i} sub l{i} r{i}"]
        if i:
            lines.append(f"m{i} min {'f0' if i == 1 else f'm{i - 1}'} f{i}")
    return "\n".join(lines) + "\n"


def bench_prune_cpu(opts) -> BenchResult:
    import numba

    from taperay.runtime.cpu import CpuWalker
    from taperay.runtime.pruning import DEFAULT_TILES, field_image_pruned, sign_image
    from taperay.scenegraph.vm import load_vm
    tape = load_vm(PROSPERO)
    rows = []
    for size in (1024, 4096):
        h = 1.0 / (size - 1)
        rect = (-1 - h, 1 + h, -1 - h, 1 + h)
        for name, fn in (("sign_image", sign_image), ("field_image_pruned", field_image_pruned)):
            stats: dict = {}
            fn(tape, size, size, rect, stats=stats)
            times = time_calls(lambda: fn(tape, size, size, rect), opts.repeat, warmup=0)
            s = summarize(times)
            rows.append({"what": f"{name} {size}", "size": size, "pruned": "yes", "median ms": s["median_ms"],
                         "min ms": s["min_ms"], "image tape": stats["image"],
                         "mean tape per level": " / ".join(f"{lv['tile']}px {lv['mean_length']:.0f}"
                                                           for lv in stats["levels"])})
    from taperay.runtime.pruning import evaluate_pruned
    pts = np.random.default_rng(opts.seed).uniform(-1, 1, (1 << 20, 3)).astype(np.float32)
    pts[:, 2] = 0
    evaluate_pruned(tape, pts)
    s = summarize(time_calls(lambda: evaluate_pruned(tape, pts), opts.repeat, warmup=0))
    rows.append({"what": "evaluate_pruned 1M points", "size": 1 << 20, "pruned": "yes",
                 "median ms": s["median_ms"], "min ms": s["min_ms"], "image tape": len(tape),
                 "mean tape per level": "8^3 voxels"})
    walker = CpuWalker()
    from taperay.runtime.camera import auto_camera
    from taperay.runtime.pruning import march_pruned
    spheres = load_vm(spheres_program(SPHERES))
    cam = auto_camera(spheres.bounds)
    marches = [("CpuWalker.march", walker.march, "-")] + [
        (f"march_pruned {g}^3 x {lv}", functools.partial(march_pruned, grid=g, levels=lv),
         f"{g}^3 cells" + (" / 4^3 sub-cells" if lv == 2 else "")) for g, lv in MARCH_CELLS]
    for name, march, cells in marches:
        march(spheres, cam, 32, 24)
        s = summarize(time_calls(lambda: march(spheres, cam, *MARCH_SIZE), opts.repeat, warmup=0))
        rows.append({"what": f"{name} {SPHERES} spheres {MARCH_SIZE[0]}x{MARCH_SIZE[1]}", "size": MARCH_SIZE[0],
                     "pruned": "no" if cells == "-" else "yes", "median ms": s["median_ms"],
                     "min ms": s["min_ms"], "image tape": len(spheres), "mean tape per level": cells})
    walker.field_image(tape, 64, 64)
    s = summarize(time_calls(lambda: walker.field_image(tape, 1024, 1024), 1, warmup=0))
    rows.append({"what": "CpuWalker.field_image 1024", "size": 1024, "pruned": "no", "median ms": s["median_ms"],
                 "min ms": s["min_ms"], "image tape": len(tape), "mean tape per level": "-"})
    return BenchResult(rows, settings={"repeat": opts.repeat, "tiles": list(DEFAULT_TILES),
                                       "records": len(tape)},
                       notes=["medians after one warm-up call; the unpruned row is one call",
                              f"numba threads {numba.get_num_threads()}, threading layer "
                              f"{numba.config.THREADING_LAYER}, OMP_WAIT_POLICY="
                              f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}: with the OpenMP layer "
                              "and the default wait policy, each parallel launch on a busy 2-core "
                              "machine can cost ~10 ms"],
                       chart=("what", "median ms"))
