"""Benchmark ``prune-gpu``: prospero.vm's 2D image on the GPU walker with hierarchical per-tile
interval pruning (``GpuWalker.sign_image`` / ``field_image_pruned``, shaders/prune.wgsl) against the
unpruned ``field_image`` kernel, in one run on one device.

The image and point rows load prospero with its MIN chains balanced (``load_vm(...,
balance_chains=True)``, as ``taperay render --2d`` does); the frame rows as written.

Rows: per image size (1024^2 and 4096^2) the sign image and the pruned field image for a few tile
level settings (sizes coarse to fine, each level pruning its parent's pruned tape), and the
unpruned field image (pruning off). Columns:

* wall: the median / min / max of ``--repeat`` calls after one warm-up call (which, on drivers that
  compile lazily, also compiles the pipelines, and grows the pruning arena); every call includes
  the uniform upload, the dispatches and reading the image back (the tape is uploaded once);
* GPU: ``GpuProfiler.image_seconds``, the median of 3 measurements, each (t_K - t_1) / (K - 1) where
  t_K is the time from submitting K images' passes, encoded in one command buffer beforehand, to
  their completion: no host work and no read-back (K aims at ~0.25 s of work, 2..16); "tile
  passes" the same for the prune_tiles passes alone, so "pixel pass" is the difference, and "level 0
  pass" the same for level 0's pass alone (over the full tape: in dependency steps, prune_wave,
  where the walker takes them; "serial walks": prune_tiles' walks, in the same run). (Timestamp
  queries would need the device opened with that feature; this does not depend on it.)
* the mean pruned tape length per level (records; in the sign image over the tiles that still
  have a tape, i.e. not decided), read back from the tile headers (``GpuWalker.prune_levels``),
  and the most registers a finest tile's tape uses after pruning renumbered them (the pixel pass
  runs in the smallest register variant holding them).

Image cell rows: the same images on flat image cells (``sign_image(..., cells=(g0, levels))``:
g0^2 cells over the image's rectangle, each level splitting a cell 4 x 4), which the first image of
a tape prunes and the images after it keep (a viewer's pans, zooms and resizes): wall and GPU ms
of an image on kept cells (GPU: the cells_image pass alone), the GPU ms of pruning the cells, and
the first image's wall (its cells dropped before each call) and GPU ms (pruning + pixels; again
with level 0 by the serial walks).

Point rows (issue 4's point evaluator): 2^20 random points in [-1, 1]^2 x {0} (``--seed``, as
``bench prune-cpu``), ``GpuWalker.evaluate_pruned`` for a few (level-0 cells, levels) settings
against the unpruned ``GpuWalker.evaluate``. wall: as above, every call including the host
bucketing (a Numba counting sort of the points by cell, with the cells' boxes), the upload of the
points and the read-back of the values; "host bucketing ms" is that bucketing alone
(``gpu_pruning.point_cells``, median of the repeats); GPU: ``GpuProfiler.points_seconds`` (the same K
method, no host work, upload or read-back); mean tape length per level over the cells holding
points (``GpuWalker.prune_levels_points``).

Frame rows (issue 4's 3D march): ``render`` (shade view, auto camera) at 1920x1080 of prospero (a 2D
program, so an extruded slab of text) and of ``spheres_program(SPHERES)``, unpruned and on the
pruned tapes of g0^3 x levels march cells (``GpuWalker.march`` cells); wall per render call
(pruning the cells, the frame, reading the image back); GPU: ``GpuProfiler.frame_seconds`` (the
cell passes and the frame's passes, each by the K method); mean tape length per cell level
(``GpuWalker.march_cell_levels``); whether each pruned frame equals the unpruned one bit for bit.

On a software adapter (Mesa lavapipe) the size is cut to 128^2 and the settings to three, the
points to 2^12, the frames to 64x48 (the run says so): the numbers that matter come from a real GPU, with the machine
named. ``--n`` is not used.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from pathlib import Path

import numpy as np

from taperay.runtime.tape import TaperayError

from .bench import BenchResult, BenchProgress, summarize, time_calls

PROSPERO = Path(__file__).resolve().parent.parent / "tests" / "data" / "prospero.vm"
HARDWARE = {"sizes": (1024, 4096), "tiles": ((32,), (32, 8), (64, 16, 4), (128, 32, 8), (128, 32, 8, 2)),
            "image_cells": ((16, 3), (16, 2), (32, 2), (32, 3), (8, 4)), "points": 1 << 20,
            "cells": ((1024, 1), (256, 2), (1024, 2)),
            "frame": (1920, 1080), "march_cells": ((8, 1), (4, 2), (8, 2), (4, 3))}
SOFTWARE = {"sizes": (128,), "tiles": ((32,), (32, 8), (64, 16, 4)), "image_cells": ((4, 2),), "points": 1 << 12,
            "cells": ((16, 1), (16, 2)),
            "frame": (64, 48), "march_cells": ((4, 1), (4, 2))}
SPHERES = 200   # the 3D frame rows' second program: spheres_program(SPHERES), 15 records a sphere
GPU_MEASUREMENTS = 3
GPU_TARGET_S = 0.25
WARM_UP_S = 1.0     # GPU work before the first measurement (_warm_up)


def _profiler(walker):
    """runtime.gpu's GpuProfiler of ``walker`` (imported when a GPU benchmark runs)."""
    from taperay.runtime.gpu import GpuProfiler
    return GpuProfiler(walker)


def _rect(n: int) -> tuple[float, float, float, float]:
    """Pixel centres at linspace(-1, 1, n) (the reference image's grid)."""
    h = 1.0 / (n - 1)
    return (-1 - h, 1 + h, -1 - h, 1 + h)


def _warm_up(walker, tape, size: int) -> None:
    """Unpruned field images, back to back, for WARM_UP_S: a GPU idle before the run clocks up
    during its first measurements (on the H200 a first row without it read 4.18 ms
    for a sign image whose passes take about 1 ms in a warm process)."""
    until = time.perf_counter() + WARM_UP_S
    while time.perf_counter() < until:
        _profiler(walker).image_seconds(tape, size, size, _rect(size), repeat=2)


@contextlib.contextmanager
def _serial_level0(walker):
    """Level 0 by prune_tiles' serial walks (GpuWalker.wave_max_tiles 0) inside the block."""
    most = walker.wave_max_tiles
    walker.wave_max_tiles = 0
    try:
        yield
    finally:
        walker.wave_max_tiles = most


def _gpu_ms(walker, tape, size: int, wall_ms: float, **kw) -> float:
    k = int(min(16, max(2, round(GPU_TARGET_S * 1e3 / max(wall_ms, 1e-3)))))
    return 1e3 * statistics.median(
        _profiler(walker).image_seconds(tape, size, size, _rect(size), repeat=k, **kw)
        for _ in range(GPU_MEASUREMENTS))


def bench_prune_gpu(opts) -> BenchResult:
    from taperay.runtime import gpu
    from taperay.scenegraph.vm import load_vm
    if not gpu.GpuWalker.available():
        raise TaperayError("bench prune-gpu: no GPU adapter on this machine")
    walker = gpu.GpuWalker(progress=True)
    info = gpu.adapter_info()
    plan = SOFTWARE if info["software"] else HARDWARE
    tape = load_vm(PROSPERO, balance_chains=True)     # (the frame rows load it as written)
    notes = ["wall: median of the repeats after one warm-up call, including the uniform upload, the "
             "dispatches and reading the image back (the tape is uploaded once)",
             f"before the first row the GPU renders unpruned field images for {WARM_UP_S:g} s (from idle, "
             "its first measurements read high)",
             f"GPU: median of {GPU_MEASUREMENTS} x (t_K - t_1) / (K - 1), t_K = K images' passes encoded "
             "beforehand in one command buffer, from submit to completion (no host work, no read-back); "
             "tile passes: the pruning passes alone; pixel pass = GPU - tile passes; level 0 pass: "
             "level 0's pass alone (in dependency steps, prune_wave, where the walker takes them: at most "
             f"{gpu.WAVE_MAX_TILES} tiles); 'serial walks': level 0 by prune_tiles' walks, in the same run",
             "sign image: tiles decided at any level are filled without evaluating below them; pruned "
             "field: every pixel runs its finest tile's pruned tape (bit-identical to field_image)",
             "mean tape length per level: records, coarse to fine (sign image: over the undecided tiles)"]
    if info["software"]:
        notes.append(f"software adapter ({info['name']}): {plan['sizes']} px and {len(plan['tiles'])} tile "
                     f"settings only, {plan['points']} points; measure on a real GPU for the numbers that matter")
    cases = []
    for size in plan["sizes"]:
        for tiles in plan["tiles"]:
            for what, sign in (("sign image", True), ("field image", False)):
                cases.append((size, what, tiles, sign))
        cases.append((size, "field image", None, False))
    rows = []
    unpruned = {}
    _warm_up(walker, tape, plan["sizes"][0])
    with BenchProgress(f"prune-gpu: {len(cases)} cases x {opts.repeat}", len(cases) * (opts.repeat + 2)) as tick:
        for size, what, tiles, sign in cases:
            rect = _rect(size)
            if tiles is None:
                def fn(s=size, r=rect):
                    return walker.field_image(tape, s, s, r)
            elif sign:
                def fn(s=size, r=rect, t=tiles):
                    return walker.sign_image(tape, s, s, r, tiles=t)
            else:
                def fn(s=size, r=rect, t=tiles):
                    return walker.field_image_pruned(tape, s, s, r, tiles=t)
            try:
                wall = summarize(time_calls(fn, opts.repeat, warmup=1, progress=tick))
            except TaperayError as e:   # e.g. tile headers / arena beyond the binding limit
                notes.append(f"{what} {size}^2 tiles {tiles} skipped: {e}")
                tick(), tick()
                continue
            tick()
            gpu_ms = _gpu_ms(walker, tape, size, wall["median_ms"], tiles=tiles, sign=sign)
            tick()
            row = {"what": f"{what} {size} " + ("tiles " + "/".join(map(str, tiles)) if tiles else "unpruned"),
                   "size": size, "image": what, "pruning": "yes" if tiles else "no",
                   "tiles px": "/".join(map(str, tiles)) if tiles else "-",
                   "wall median ms": wall["median_ms"], "wall min ms": wall["min_ms"],
                   "wall max ms": wall["max_ms"], "GPU ms": gpu_ms, "tile passes GPU ms": "-",
                   "pixel pass GPU ms": "-", "level 0 pass GPU ms": "-", "level 0 pass GPU ms, serial walks": "-",
                   "mean tape length per level": "-"}
            if tiles:
                passes = _gpu_ms(walker, tape, size, wall["median_ms"], tiles=tiles, sign=sign,
                                 tile_passes_only=True)
                level0 = _gpu_ms(walker, tape, size, wall["median_ms"], tiles=tiles, sign=sign,
                                 tile_passes_only=True, levels=1)
                with _serial_level0(walker):
                    serial = _gpu_ms(walker, tape, size, wall["median_ms"], tiles=tiles, sign=sign,
                                     tile_passes_only=True, levels=1)
                levels = walker.prune_levels(tape, size, size, rect, tiles=tiles, sign=sign)
                row.update({"tile passes GPU ms": passes, "pixel pass GPU ms": gpu_ms - passes,
                            "level 0 pass GPU ms": level0, "level 0 pass GPU ms, serial walks": serial,
                            "mean tape length per level": " / ".join(f"{lv['mean_length']:.0f}" for lv in levels),
                            "finest tapes' registers": levels[-1]["registers"]})
            else:
                unpruned[size] = (wall["median_ms"], gpu_ms)
            rows.append(row)
    for r in rows:
        base = unpruned.get(r["size"])
        ok = base and r["pruning"] == "yes"
        r["wall speed-up vs unpruned"] = base[0] / r["wall median ms"] if ok else "-"
        r["GPU speed-up vs unpruned"] = base[1] / r["GPU ms"] if ok and r["GPU ms"] > 0 else "-"
    rows += _image_cell_rows(walker, tape, plan, opts, notes, unpruned)
    rows += _point_rows(walker, tape, plan, opts, notes)
    rows += _frame_rows(walker, load_vm(PROSPERO), plan, opts, notes)
    stats = walker.stats()
    notes.append(f"pipelines created after startup: {stats['pipelines_created'] - len(walker.kernels)} "
                 f"(cache misses {stats['cache_misses']})")
    return BenchResult(rows, settings={"repeat": opts.repeat, "records": len(tape), "points": plan["points"], "seed": opts.seed,
                                       "gpu_measurements": GPU_MEASUREMENTS},
                       notes=notes,
                       machine={"gpu": info["name"], "gpu_driver": info["driver"], "gpu_backend": info["backend"],
                                "gpu_software": info["software"]},
                       chart=("what", "GPU ms"))


def _image_cell_rows(walker, tape, plan, opts, notes, unpruned) -> list[dict]:
    """The sign and field images on flat image cells (``cells`` (g0, levels) of sign_image) for
    each setting of plan["image_cells"]: the images after the first, on the kept cells, and the
    first image of the tape, which prunes them."""
    notes.append("image cells g0 x levels: g0^2 cells over the image's rectangle, each level splitting a cell "
                 "4 x 4, pruned by the first image of the tape and kept for the images after it (pans, zooms, "
                 "other sizes); wall / GPU ms: an image on the kept cells (GPU: the cells_image pass); tile "
                 "passes GPU ms: pruning the cells (the first image's GPU ms adds the two); first image wall "
                 "ms: median of the repeats of an image whose cells were dropped just before")
    cases = [(size, cells, what, sign) for size in plan["sizes"] for cells in plan["image_cells"]
             for what, sign in (("sign image", True), ("field image", False))]
    rows = []
    with BenchProgress(f"prune-gpu image cells: {len(cases)} cases x {opts.repeat}",
                   len(cases) * (2 * opts.repeat + 2)) as tick:
        for size, cells, what, sign in cases:
            rect = _rect(size)
            image = walker.sign_image if sign else walker.field_image_pruned

            def fn(s=size, r=rect, c=cells, f=image):
                return f(tape, s, s, r, cells=c)

            def first(s=size, r=rect, c=cells, f=image):
                walker.drop_kept_cells()
                return f(tape, s, s, r, cells=c)
            try:
                wall = summarize(time_calls(fn, opts.repeat, warmup=1, progress=tick))
                wall_first = summarize(time_calls(first, opts.repeat, warmup=0, progress=tick))
            except TaperayError as e:   # e.g. cells beyond the binding limit
                notes.append(f"{what} {size}^2 image cells {cells} skipped: {e}")
                tick(), tick()
                continue
            gpu_ms = _gpu_ms(walker, tape, size, wall["median_ms"], cells=cells, sign=sign)
            tick()
            build_ms = _gpu_ms(walker, tape, size, wall_first["median_ms"], cells=cells, sign=sign,
                               tile_passes_only=True)
            with _serial_level0(walker):
                build_serial = _gpu_ms(walker, tape, size, wall_first["median_ms"], cells=cells, sign=sign,
                                       tile_passes_only=True)
            tick()
            base = unpruned.get(size)
            rows.append({"what": f"{what} {size} image cells {cells[0]}^2 x {cells[1]} (kept)", "size": size,
                         "image": what, "pruning": "yes", "tiles px": f"{cells[0]}^2 cells x {cells[1]} levels",
                         "wall median ms": wall["median_ms"], "wall min ms": wall["min_ms"],
                         "wall max ms": wall["max_ms"], "GPU ms": gpu_ms, "tile passes GPU ms": build_ms,
                         "pixel pass GPU ms": gpu_ms, "level 0 pass GPU ms": "-",
                         "level 0 pass GPU ms, serial walks": "-",
                         "mean tape length per level": "-", "first image wall ms": wall_first["median_ms"],
                         "first image GPU ms": build_ms + gpu_ms,
                         "first image GPU ms, level 0 by serial walks": build_serial + gpu_ms,
                         "wall speed-up vs unpruned": base[0] / wall["median_ms"] if base else "-",
                         "GPU speed-up vs unpruned": base[1] / gpu_ms if base and gpu_ms > 0 else "-"})
    return rows


def _point_rows(walker, tape, plan, opts, notes) -> list[dict]:
    """evaluate_pruned per (cells, levels) setting and the unpruned evaluate, at plan["points"]
    random points of [-1, 1]^2 x {0}."""
    from taperay.runtime.gpu_pruning import point_cells
    n = plan["points"]
    pts = np.random.default_rng(opts.seed).uniform(-1, 1, (n, 3)).astype(np.float32)
    pts[:, 2] = 0
    notes.append(f"points: {n} random points of [-1, 1]^2 x {{0}}; wall includes the host bucketing, the "
                 "upload of the points and the read-back of the values; GPU: GpuProfiler.points_seconds (no host "
                 "work, upload or read-back)")
    cases = [(c, lv) for c, lv in plan["cells"]] + [None]
    rows = []
    base = None
    exact = True
    ref = None
    with BenchProgress(f"prune-gpu points: {len(cases)} cases x {opts.repeat}", len(cases) * (opts.repeat + 2)) as tick:
        for case in reversed(cases):   # the unpruned one first (the speed-ups' base, the reference)
            if case is None:
                def fn():
                    return walker.evaluate(tape, pts)
            else:
                def fn(c=case):
                    return walker.evaluate_pruned(tape, pts, cells=c[0], levels=c[1])
            try:
                values = fn()[0]
                wall = summarize(time_calls(fn, opts.repeat, warmup=0, progress=tick))
            except TaperayError as e:
                notes.append(f"points {case} skipped: {e}")
                tick(), tick()
                continue
            tick()
            if case is None:
                ref = values
            elif ref is not None:
                exact &= bool((values.view(np.uint32) == ref.view(np.uint32)).all())
            k = int(min(16, max(2, round(GPU_TARGET_S * 1e3 / max(wall["median_ms"], 1e-3)))))
            gpu_ms = 1e3 * statistics.median(
                _profiler(walker).points_seconds(tape, pts, pruned=case is not None,
                                                 cells=case[0] if case else None,
                                                 levels=case[1] if case else 1, repeat=k)
                for _ in range(GPU_MEASUREMENTS))
            tick()
            row = {"what": f"evaluate {n} points " + (f"cells {case[0]} levels {case[1]}" if case else "unpruned"),
                   "size": n, "image": "points", "pruning": "yes" if case else "no",
                   "tiles px": f"{case[0]} cells x {case[1]} levels" if case else "-",
                   "wall median ms": wall["median_ms"], "wall min ms": wall["min_ms"],
                   "wall max ms": wall["max_ms"], "GPU ms": gpu_ms, "tile passes GPU ms": "-",
                   "pixel pass GPU ms": "-", "level 0 pass GPU ms": "-", "mean tape length per level": "-",
                   "host bucketing ms": "-"}
            if case:
                host = []
                for _ in range(max(1, opts.repeat)):
                    t0 = time.perf_counter()
                    point_cells(pts, case[1], case[0])
                    host.append(time.perf_counter() - t0)
                levels = walker.prune_levels_points(tape, pts, cells=case[0], levels=case[1])
                row.update({"host bucketing ms": 1e3 * statistics.median(host),
                            "mean tape length per level": " / ".join(f"{lv['mean_length']:.0f}" for lv in levels)})
            else:
                base = (wall["median_ms"], gpu_ms)
            rows.append(row)
    rows.reverse()
    for r in rows:
        ok = base and r["pruning"] == "yes"
        r["wall speed-up vs unpruned"] = base[0] / r["wall median ms"] if ok else "-"
        r["GPU speed-up vs unpruned"] = base[1] / r["GPU ms"] if ok and r["GPU ms"] > 0 else "-"
    notes.append(f"points: evaluate_pruned bit-identical to evaluate at every point: {exact}")
    return rows


def _frame_rows(walker, prospero, plan, opts, notes) -> list[dict]:
    """3D frames (render, shade view, auto camera) of prospero (a 2D program: an extruded slab of
    text; its chains as written, as every 3D program's) and spheres_program(SPHERES), on the
    pruned cell tapes for each (g0, levels) of plan["march_cells"] and unpruned."""
    from taperay.scenegraph.vm import load_vm

    from .bench_prune import spheres_program
    w, h = plan["frame"]
    notes.append(f"frames: render(view='shade') at {w}x{h}, auto camera; cells g0 x levels: g0^3 cells over the "
                 "march box, each level splitting a cell 4 x 4 x 4; wall includes pruning the cells, the "
                 "frame and reading the image back; GPU: GpuProfiler.frame_seconds (cells: the prune_cells passes "
                 "over the cells; frame: march, light, shade, resolve); mean tape length per level over the "
                 "cells with a tape")
    rows = []
    programs = (("prospero", prospero), (f"{SPHERES} spheres", load_vm(spheres_program(SPHERES, seed=opts.seed))))
    cases = [(name, tape, c) for name, tape in programs for c in [None, *plan["march_cells"]]]
    exact = True
    with BenchProgress(f"prune-gpu frames: {len(cases)} cases x {opts.repeat}", len(cases) * (opts.repeat + 2)) as tick:
        ref = base = None
        for name, tape, cells in cases:
            def fn(t=tape, c=cells):
                return walker.render(t, None, w, h, cells=c)
            try:
                image = fn()
                wall = summarize(time_calls(fn, opts.repeat, warmup=0, progress=tick))
            except TaperayError as e:
                notes.append(f"frame {name} cells {cells} skipped: {e}")
                tick(), tick()
                continue
            if cells is None:
                ref, base = image, None
            else:
                exact &= ref is not None and bool(np.array_equal(image, ref))
            k = int(min(8, max(2, round(GPU_TARGET_S * 1e3 / max(wall["median_ms"], 1e-3)))))
            try:
                gpu_ms = [_profiler(walker).frame_seconds(tape, None, w, h, cells=cells, repeat=k)
                          for _ in range(GPU_MEASUREMENTS if wall["median_ms"] < 200 else 1)]
                cell_ms = 1e3 * statistics.median(g["cells"] for g in gpu_ms)
                frame_ms = 1e3 * statistics.median(g["frame"] for g in gpu_ms)
            except TaperayError as e:   # a frame resumed over several dispatches (software adapters)
                notes.append(f"frame {name} cells {cells}: no GPU time: {e}")
                cell_ms = frame_ms = float("nan")
            tick()
            row = {"what": f"frame {name} " + (f"cells {cells[0]}^3 x {cells[1]} levels" if cells else "unpruned"),
                   "size": f"{w}x{h}", "image": "3D frame", "pruning": "yes" if cells else "no",
                   "tiles px": f"{cells[0]}^3 cells x {cells[1]} levels" if cells else "-",
                   "wall median ms": wall["median_ms"], "wall min ms": wall["min_ms"],
                   "wall max ms": wall["max_ms"], "GPU ms": cell_ms + frame_ms,
                   "tile passes GPU ms": cell_ms if cells else "-", "pixel pass GPU ms": frame_ms,
                   "level 0 pass GPU ms": "-", "mean tape length per level": "-", "host bucketing ms": "-"}
            if cells:
                levels = walker.march_cell_levels(tape, cells=cells)
                row["mean tape length per level"] = " / ".join(f"{lv['mean_length']:.0f}" for lv in levels)
                if base:
                    row["wall speed-up vs unpruned"] = base[0] / wall["median_ms"]
                    row["GPU speed-up vs unpruned"] = base[1] / row["GPU ms"] if row["GPU ms"] > 0 else "-"
            else:
                base = (wall["median_ms"], row["GPU ms"])
                row["mean tape length per level"] = f"{len(tape.instrs)} (whole tape)"
            tick()
            rows.append(row)
    notes.append(f"frames: every pruned frame bit-identical to the unpruned frame: {exact}")
    return rows
