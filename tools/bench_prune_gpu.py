"""Benchmark ``prune-gpu``: prospero.vm's 2D image on the GPU walker with per-tile interval pruning
(``GpuWalker.sign_image`` / ``field_image_pruned``, shaders/prune.wgsl) against the unpruned
``field_image`` kernel, in one run on one device.

Rows: per image size (1024^2 and 4096^2) the sign image and the pruned field image for a few tile
sizes, and the unpruned field image (pruning off). Each row is the median of ``--repeat`` calls
after one warm-up call (which, on drivers that compile lazily, also compiles the pipeline); every
call includes the uniform upload, both dispatches and reading the image back. On a software
adapter (Mesa lavapipe) the sizes are cut to 128^2 and 1024^2 and the unpruned row to 128^2 (the
run says so): the numbers that matter come from a real GPU, with the machine named.
``--n`` is not used.
"""
from __future__ import annotations

from pathlib import Path

from taperay.runtime.tape import TaperayError

from .bench import BenchResult, _progress, summarize, time_calls

PROSPERO = Path(__file__).resolve().parent.parent / "tests" / "data" / "prospero.vm"
HARDWARE = {"sizes": (1024, 4096), "tiles": (32, 64, 128), "unpruned_max": 4096}
SOFTWARE = {"sizes": (128, 1024), "tiles": (32, 64), "unpruned_max": 128}


def _rect(n: int) -> tuple[float, float, float, float]:
    """Pixel centres at linspace(-1, 1, n) (the reference image's grid)."""
    h = 1.0 / (n - 1)
    return (-1 - h, 1 + h, -1 - h, 1 + h)


def bench_prune_gpu(opts) -> BenchResult:
    from taperay.runtime import gpu
    from taperay.scenegraph.vm import load_vm
    if not gpu.GpuWalker.available():
        raise TaperayError("bench prune-gpu: no GPU adapter on this machine")
    walker = gpu.GpuWalker(progress=True)
    info = gpu.adapter_info()
    plan = SOFTWARE if info["software"] else HARDWARE
    tape = load_vm(PROSPERO)
    notes = ["each row: median of the repeats after one warm-up call; times include the uniform "
             "upload, the dispatches and reading the image back (the tape is uploaded once)",
             "sign image: tiles decided by their interval are filled without evaluating pixels; "
             "pruned field: every pixel runs its tile's pruned tape (bit-identical to field_image)"]
    if info["software"]:
        notes.append(f"software adapter ({info['name']}): sizes {plan['sizes']} and the unpruned row at "
                     f"{plan['unpruned_max']}^2 only; measure on a real GPU for the numbers that matter")
    cases = []
    for size in plan["sizes"]:
        for tile in plan["tiles"]:
            limit = walker.info["limits"]["max_storage_buffer_binding_size"]
            if 8 * -(-size // tile) ** 2 * (len(tape) + 1) > limit:
                notes.append(f"{size}^2 with {tile} px tiles skipped: its pruned tapes exceed the "
                             f"adapter's {limit >> 20} MiB binding limit")
                continue
            cases.append((size, "sign image", tile, "yes",
                          lambda s=size, t=tile: walker.sign_image(tape, s, s, _rect(s), tile=t)))
            cases.append((size, "field image", tile, "yes",
                          lambda s=size, t=tile: walker.field_image_pruned(tape, s, s, _rect(s), tile=t)))
        if size <= plan["unpruned_max"]:
            cases.append((size, "field image", "-", "no",
                          lambda s=size: walker.field_image(tape, s, s, _rect(s))))
    rows = []
    unpruned = {}
    with _progress(f"prune-gpu: {len(cases)} cases x {opts.repeat}", len(cases) * (opts.repeat + 1)) as tick:
        for size, what, tile, pruned, fn in cases:
            s = summarize(time_calls(fn, opts.repeat, warmup=1, progress=tick))
            tick()
            rows.append({"what": f"{what} {size} tile {tile}" if pruned == "yes" else f"{what} {size} unpruned",
                         "size": size, "image": what, "pruning": pruned, "tile px": tile,
                         "median ms": s["median_ms"], "min ms": s["min_ms"], "max ms": s["max_ms"]})
            if pruned == "no":
                unpruned[size] = s["median_ms"]
    for r in rows:
        base = unpruned.get(r["size"])
        r["speed-up vs unpruned"] = base / r["median ms"] if base and r["pruning"] == "yes" else "-"
    stats = walker.stats()
    notes.append(f"pipelines created after startup: {stats['pipelines_created'] - len(walker.kernels)} "
                 f"(cache misses {stats['cache_misses']})")
    return BenchResult(rows, settings={"repeat": opts.repeat, "records": len(tape)}, notes=notes,
                       machine={"gpu": info["name"], "gpu_driver": info["driver"], "gpu_backend": info["backend"],
                                "gpu_software": info["software"]},
                       chart=("what", "median ms"))
