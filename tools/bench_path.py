"""``taperay bench path``: the path tracer's throughput (runtime/path_tracing.py, shaders/path.wgsl)
on the showcase (scenes/machined_part.py), the bolt bin (scenes/bolt_bin.py, 100,000 instances)
and prospero's slab (tests/data/prospero.vm, its 2D program extruded), on the walker asked for.

Per scene: ``PathImage.add(1)`` once (the pipeline or the Numba compile, the upload), then
``--repeat`` samples per pixel timed in one ``add``: Msamples/s (pixels x samples / s), seconds
per sample per pixel and the time to 256 spp at that rate (measured when ``--repeat`` is 256,
else the rate's product, said so in the row). Then the edits a user makes while it converges, each
followed by one more sample: every named material's colour, roughness and metallic, a named
parameter, and a topology edit (the scene with one more sphere, a new tape of the same register
variant): the pipelines they created, counted by the kernel set (the rule is none; the twin has no
pipelines: "-"). Sizes: ``--size``, else 1920x1080 on a hardware GPU and 96x54 on the twin or a
software adapter. Default lighting: PathSettings() (white environment, light samples on).
"""
from __future__ import annotations

import time
from pathlib import Path

from taperay.runtime.tape import TaperayError

from .bench import BenchResult, _progress

ROOT = Path(__file__).resolve().parent.parent
SCENES = (("showcase", ROOT / "scenes" / "machined_part.py"), ("bolt bin", ROOT / "scenes" / "bolt_bin.py"),
          ("prospero slab", ROOT / "tests" / "data" / "prospero.vm"))
TARGET_SPP = 256


def _edits(walker, tape, path: Path):
    """The edits of one scene, as (what, function making it and returning the tape to draw)."""
    from taperay.scenegraph import flatten, sphere, union
    from taperay.scenegraph.loading import load_scene_module
    edits = []
    for name in sorted({n for n in tape.material_names if n}):
        edits.append((f"material {name}", lambda n=name: (walker.set_material(tape, n, color=(0.9, 0.3, 0.2),
                                                                             roughness=0.2, metallic=1.0), tape)[1]))
    if tape.names:
        pname = sorted(tape.names)[0]
        value = float(tape.params[tape.names[pname][0]])
        edits.append((f"parameter {pname}", lambda: (walker.set_param(tape, pname, value * 1.01), tape)[1]))
    if path.suffix == ".py":
        lo, hi = tape.bounds
        centre = (lo + hi) / 2
        r = float((hi - lo).max()) * 0.1
        edits.append(("topology (+1 sphere)",
                      lambda: flatten(union(load_scene_module(path), sphere(r).translate(*centre)))))
    return edits


def _measure(walker, tape, path: Path, w: int, h: int, spp: int, settings, row: dict) -> None:
    """One scene's row: the first sample, ``spp`` timed samples, then the edits' pipelines."""
    from taperay.runtime.gpu_device import variant_for
    from taperay.runtime.path_tracing import PathImage
    row["records"] = len(tape.instrs)
    t0 = time.perf_counter()
    image = PathImage(walker, tape, None, w, h, path=settings).add(1)
    row["first sample s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    image.add(spp)
    seconds = time.perf_counter() - t0
    row["Msamples/s"] = w * h * spp / seconds / 1e6
    row["s per spp"] = seconds / spp
    row[f"time to {TARGET_SPP} spp s"] = seconds / spp * TARGET_SPP
    row[f"{TARGET_SPP} spp"] = "measured" if spp == TARGET_SPP else "from the rate"
    made = walker.kernels.stats.pipelines_created if walker.name == "gpu" else None
    edits = _edits(walker, tape, path)
    regs = {tape.n_regs}
    for _, edit in edits:
        drawn = edit()
        regs.add(drawn.n_regs)
        PathImage(walker, drawn, None, w, h, path=settings).add(1)
    row["edits"] = len(edits)
    row["register variants drawn"] = len({variant_for(n) for n in regs})
    row["pipelines created by edits"] = walker.kernels.stats.pipelines_created - made if made is not None else "-"


def bench_path(opts) -> BenchResult:
    from taperay.runtime.path_tracing import PathSettings
    from taperay.runtime.walkers import walker as choose_walker
    from taperay.scenegraph.loading import load_tape

    from .cli import parse_size
    walker = choose_walker(opts.walker)
    hardware = walker.name == "gpu" and not walker.info.get("software")
    w, h = parse_size(opts.size) if opts.size else ((1920, 1080) if hardware else (96, 54))
    spp = opts.repeat
    rows, notes = [], []
    settings = PathSettings()
    with _progress(f"path: {len(SCENES)} scenes at {w}x{h}, {spp} spp", len(SCENES)) as tick:
        for label, path in SCENES:
            row = {"scene": label, "walker": walker.name, "size": f"{w}x{h}", "spp": spp}
            try:
                _measure(walker, load_tape(path), path, w, h, spp, settings, row)
            except TaperayError as e:
                notes.append(f"{label}: not measured: {e}")
            rows.append(row)
            tick()
    machine = {"gpu": walker.adapter_name} if walker.name == "gpu" else {}
    notes += [f"first sample: the upload and the pipeline (GPU) or the Numba compile or cache load (twin) and "
              f"one sample per pixel; then {spp} samples per pixel timed in one PathImage.add",
              "edits: each named material's colour, roughness and metallic (a buffer write), the first named "
              "parameter, and for .py scenes the scene with one more sphere (a new tape), each followed by one "
              "sample per pixel; pipelines created: the kernel set's counter across them (a pipeline is made once per register "
              "variant: a topology edit that needs another variant makes one, shown by 'register variants drawn')",
              f"lighting: PathSettings() defaults (white environment {settings.environment}, max_bounces "
              f"{settings.max_bounces}, roulette from {settings.roulette_from}, light samples on)"]
    return BenchResult(rows, machine=machine, notes=notes, chart=("scene", "Msamples/s"),
                       settings={"walker": walker.name, "size": f"{w}x{h}", "repeat": spp})
