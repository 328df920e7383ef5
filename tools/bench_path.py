"""``taperay bench path``: the path tracer's throughput (runtime/path_tracing.py, shaders/path.wgsl)
on the showcase (scenes/machined_part.py), the bolt bin (scenes/bolt_bin.py, 100,000 instances)
and prospero's slab (tests/data/prospero.vm, its 2D program extruded), on the walker asked for.

Per scene: ``PathImage.add(1)`` once (the pipelines or the Numba compile, the upload), then (on the
GPU, once the background has built the kernel set's other pipelines) ``--repeat`` samples per pixel
timed in one ``add``: Msamples/s (pixels x samples / s), seconds per sample per pixel and the time
to 256 spp at that rate (measured when ``--repeat`` is 256, else the rate's product, said so in the
row); on the GPU also the rounds per sample (path_trace and path_accumulate), the traces the
iteration budget paused and whether the paths marched on pruned cells (an arithmetic tape's march
cells, pruned once per image). Then the edits a user makes while it converges, each
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

from .bench import BenchResult, BenchProgress

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
    gpu = walker.name == "gpu"
    t0 = time.perf_counter()
    image = PathImage(walker, tape, None, w, h, path=settings).add(1)
    row["first sample s"] = time.perf_counter() - t0
    if gpu:
        walker.kernels.settle()         # (the pipelines the background builds after the first request: not timed)
    before = image.stats()
    t0 = time.perf_counter()
    image.add(spp)
    seconds = time.perf_counter() - t0
    if gpu:
        after = image.stats()
        row["rounds per spp"] = (after["rounds"] - before["rounds"]) / spp
        row["traces paused per spp"] = (after["pauses"] - before["pauses"]) / spp
        row["pruned cells"] = "yes" if after["cell_prunes"] else "no"
    row["Msamples/s"] = w * h * spp / seconds / 1e6
    row["s per spp"] = seconds / spp
    row[f"time to {TARGET_SPP} spp s"] = seconds / spp * TARGET_SPP
    row[f"{TARGET_SPP} spp"] = "measured" if spp == TARGET_SPP else "from the rate"
    made = walker.kernels.stats.pipelines_created if gpu else None
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
    with BenchProgress(f"path: {len(SCENES)} scenes at {w}x{h}, {spp} spp", len(SCENES)) as tick:
        for label, path in SCENES:
            row = {"scene": label, "walker": walker.name, "size": f"{w}x{h}", "spp": spp}
            try:
                _measure(walker, load_tape(path), path, w, h, spp, settings, row)
            except TaperayError as e:
                notes.append(f"{label}: not measured: {e}")
                row["Msamples/s"] = float("nan")
            rows.append(row)
            tick()
    machine = {"gpu": walker.adapter_name} if walker.name == "gpu" else {}
    notes += [f"first sample: the upload and the pipelines (GPU) or the Numba compile or cache load (twin) and "
              f"one sample per pixel; then (GPU: after the background built the other pipelines) {spp} samples "
              f"per pixel timed in one PathImage.add",
              "edits: each named material's colour, roughness and metallic (a buffer write), the first named "
              "parameter, and for .py scenes the scene with one more sphere (a new tape), each followed by one "
              "sample per pixel; pipelines created: the kernel set's counter across them (a pipeline is made once per register "
              "variant: a topology edit that needs another variant makes one, shown by 'register variants drawn')",
              f"lighting: PathSettings() defaults (white environment {settings.environment}, max_bounces "
              f"{settings.max_bounces}, roulette from {settings.roulette_from}, light samples on)"]
    return BenchResult(rows, machine=machine, notes=notes, chart=("scene", "Msamples/s"),
                       settings={"walker": walker.name, "size": f"{w}x{h}", "repeat": spp})


# ------------------------------------------------------------------------------------- Mitsuba 3
# the comparison scene: spheres and boxes on a slab, as (shape, centre, radius or half extents,
# material); both renderers build it from these rows (taperay's nodes, Mitsuba's own primitives)
COMPARISON_ROWS = (
    ("box", (0.0, 0.0, -0.1), (1.8, 1.4, 0.1), "floor"),
    ("sphere", (-0.95, -0.1, 0.42), 0.42, "red"),
    ("sphere", (0.0, 0.15, 0.45), 0.45, "metal"),
    ("sphere", (0.95, -0.2, 0.4), 0.4, "glass"),
    ("box", (0.55, 0.75, 0.25), (0.25, 0.25, 0.25), "blue"),
    ("sphere", (-0.5, 0.8, 0.18), 0.18, "lamp"),
)
COMPARISON_ENVIRONMENT = (0.5, 0.45, 0.4)
COMPARISON_CAMERA = dict(eye=(0.0, -4.6, 2.2), target=(0.0, 0.2, 0.3), fov_deg=32.0)
COMPARISON_MAX_BOUNCES = 12
MATCH_ROUNDING = 1e-5       # a tile of the environment alone: float32 against Mitsuba's rounding


def _comparison_materials():
    """The materials both renderers model alike: Lambertian (specular 0), a white GGX conductor
    (metallic 1, colour 1: F = 1), smooth glass and a black emitter."""
    from taperay.scenegraph import Material
    return {"floor": Material("floor", (0.6, 0.6, 0.6), specular=0.0),
            "red": Material("red", (0.8, 0.15, 0.1), specular=0.0),
            "blue": Material("blue", (0.15, 0.25, 0.8), specular=0.0),
            "metal": Material("metal", (1.0, 1.0, 1.0), 0.4, metallic=1.0),
            "glass": Material("glass", (1.0, 1.0, 1.0), transmission=1.0, ior=1.5),
            "lamp": Material("lamp", (0.0, 0.0, 0.0), emission=(6.0, 5.0, 4.0), specular=0.0)}


def comparison_scene():
    """(tape, camera) of the comparison scene in taperay."""
    from taperay.runtime.camera import Camera
    from taperay.scenegraph import box, flatten, sphere, union
    mats = _comparison_materials()
    nodes = [(sphere(size) if shape == "sphere" else box(*size)).translate(*centre).material(mats[m])
             for shape, centre, size, m in COMPARISON_ROWS]
    return flatten(union(*nodes), source="bench:path-mitsuba"), Camera(**COMPARISON_CAMERA)


def _mitsuba_scene(width: int, height: int, spp: int):
    """The comparison scene as Mitsuba 3 (scalar_rgb) loads it: its own sphere and cube shapes."""
    import mitsuba as mi
    mi.set_variant("scalar_rgb")
    T = mi.ScalarTransform4f

    def rgb(v):
        return {"type": "rgb", "value": list(v)}
    mats = _comparison_materials()
    scene = {"type": "scene", "integrator": {"type": "path", "max_depth": COMPARISON_MAX_BOUNCES},
             "sensor": {"type": "perspective", "fov": COMPARISON_CAMERA["fov_deg"], "fov_axis": "y",
                        "to_world": T().look_at(origin=list(COMPARISON_CAMERA["eye"]),
                                                target=list(COMPARISON_CAMERA["target"]), up=[0, 0, 1]),
                        "film": {"type": "hdrfilm", "width": width, "height": height, "pixel_format": "rgb",
                                 "rfilter": {"type": "box"}},
                        "sampler": {"type": "independent", "sample_count": spp}},
             "environment": {"type": "constant", "radiance": rgb(COMPARISON_ENVIRONMENT)}}
    for i, (shape, centre, size, name) in enumerate(COMPARISON_ROWS):
        m = mats[name]
        if m.transmission:
            bsdf = {"type": "dielectric", "int_ior": m.ior, "ext_ior": 1.0}
        elif m.metallic:
            bsdf = {"type": "roughconductor", "material": "none", "distribution": "ggx", "alpha": m.roughness ** 2,
                    "specular_reflectance": rgb(m.color)}
        else:
            bsdf = {"type": "diffuse", "reflectance": rgb(m.color)}
        if shape == "sphere":
            node = {"type": "sphere", "center": list(centre), "radius": size, "bsdf": bsdf}
        else:
            node = {"type": "cube", "to_world": T().translate(list(centre)) @ T().scale(list(size)), "bsdf": bsdf}
        if any(m.emission):
            node["emitter"] = {"type": "area", "radiance": rgb(m.emission)}
        scene[f"{i}_{name}"] = node
    return mi.load_dict(scene)


def mitsuba_tile_stats(width: int, height: int, spp: int, passes: int, tile: int, seed: int = 0):
    """Mitsuba's (image (H, W, 3), tile means, tile standard errors): ``passes`` renders of
    ``spp`` samples with independent seeds; a tile's mean luminance (mean over rgb) per pass, its
    mean and standard error over the passes."""
    import mitsuba as mi
    import numpy as np
    scene = _mitsuba_scene(width, height, spp)
    images = np.stack([np.array(mi.render(scene, seed=seed + k), np.float64) for k in range(passes)])
    th, tw = height // tile, width // tile
    lum = images[:, :th * tile, :tw * tile].mean(-1).reshape(passes, th, tile, tw, tile).mean((2, 4))
    return images.mean(0), lum.mean(0), lum.std(0, ddof=1) / np.sqrt(passes)


def compare_with_mitsuba(walker, width: int, height: int, spp: int, passes: int = 8, tile: int = 4,
                         seed: int = 0) -> dict:
    """taperay (``walker``, ``spp`` samples) against Mitsuba 3 (``passes`` x ``spp / passes``) on
    the comparison scene, per tile of mean luminance: ``ok`` where the two differ by at most 4
    combined standard errors (plus MATCH_ROUNDING: tiles of the environment alone have none), and
    ``z``, the difference over the combined standard error."""
    import numpy as np

    from taperay.runtime.path_tracing import PathImage, PathSettings
    tape, camera = comparison_scene()
    path = PathSettings(environment=COMPARISON_ENVIRONMENT, max_bounces=COMPARISON_MAX_BOUNCES, seed=seed)
    t0 = time.perf_counter()
    ours = PathImage(walker, tape, camera, width, height, path=path).add(spp)
    ours_s = time.perf_counter() - t0
    m_ours, se_ours = ours.tile_stats(tile)
    t0 = time.perf_counter()
    image, m_mi, se_mi = mitsuba_tile_stats(width, height, max(1, spp // passes), passes, tile, seed)
    mi_s = time.perf_counter() - t0
    diff, se = np.abs(m_ours - m_mi), np.hypot(se_ours, se_mi)
    noisy = se > MATCH_ROUNDING
    z = np.where(noisy, diff / np.where(noisy, se, 1.0), 0.0)
    return {"ok": diff <= 4 * se + MATCH_ROUNDING, "z": z, "taperay": ours.mean(), "mitsuba": image.astype(np.float32), "taperay s": ours_s,
            "mitsuba s": mi_s, "mean taperay": float(m_ours.mean()), "mean mitsuba": float(m_mi.mean())}


def bench_path_mitsuba(opts) -> BenchResult:
    """taperay against Mitsuba 3 on the comparison scene: per-tile agreement, both renderers'
    times, and the two pictures side by side (``<out>/path-mitsuba-pictures.png``: taperay left)."""
    import numpy as np
    from PIL import Image

    from taperay.runtime.walkers import walker as choose_walker

    from .cli import parse_size
    try:
        import mitsuba
    except ImportError:
        raise TaperayError("bench path-mitsuba: needs Mitsuba 3 (pip install mitsuba, or the 'compare' extra)") from None
    walker = choose_walker(opts.walker)
    w, h = parse_size(opts.size) if opts.size else (192, 128)
    spp, tile, passes = opts.repeat, 8, 8
    r = compare_with_mitsuba(walker, w, h, spp, passes=passes, tile=tile, seed=opts.seed)
    noisy = r["z"] > 0
    row = {"scene": "spheres and boxes on a slab", "walker": walker.name, "size": f"{w}x{h}", "spp": spp,
           "tiles": int(r["ok"].size), "tiles within 4 SE": float(r["ok"].mean()),
           "median z": float(np.median(r["z"][noisy])) if noisy.any() else float("nan"),
           "max z": float(r["z"].max()), "mean luminance taperay": r["mean taperay"],
           "mean luminance mitsuba": r["mean mitsuba"], "taperay s": r["taperay s"], "mitsuba s": r["mitsuba s"]}
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)

    def shown(a):
        return (np.clip(a, 0, 1) ** (1 / 2.2) * 255).round().astype(np.uint8)
    Image.fromarray(np.concatenate([shown(r["taperay"]), shown(r["mitsuba"])], 1)).save(out / "path-mitsuba-pictures.png")
    return BenchResult([row], machine={"mitsuba": mitsuba.__version__},
                       settings={"walker": walker.name, "size": f"{w}x{h}", "repeat": spp, "seed": opts.seed},
                       notes=[f"taperay: PathImage at {spp} spp (tile stats from its samples); Mitsuba 3 scalar_rgb, "
                              f"path integrator (max_depth {COMPARISON_MAX_BOUNCES}), box filter, {passes} passes of "
                              f"{max(1, spp // passes)} spp with independent seeds (a tile's standard error from the "
                              f"passes); tiles {tile}x{tile} of mean luminance (mean over rgb); z: the difference "
                              f"over the combined standard error (tiles of standard error <= {MATCH_ROUNDING}, the environment alone: z 0)",
                              f"pictures: {out / 'path-mitsuba-pictures.png'} (taperay left, Mitsuba right; "
                              "clamped, gamma 1/2.2)"])


# ------------------------------------------------------------------------------------- noise
NOISE_SIZE = (96, 64)
NOISE_REFERENCE_SPP = 2048
NOISE_SPPS = (16, 64)


def _rmse(image, reference) -> float:
    import numpy as np
    return float(np.sqrt(np.mean((np.asarray(image, np.float64) - reference) ** 2)))


def lamp_scene(radius: float = 0.25, emission: float = 8.0):
    """(tape, camera): a slab and a rough red sphere lit by an emitting sphere of ``radius`` and
    emission (1, 0.9, 0.75) ``emission`` above them."""
    from taperay.runtime.camera import Camera
    from taperay.scenegraph import Material, box, flatten, sphere, union
    lamp = Material("lamp", color=(0.0, 0.0, 0.0), emission=(emission, 0.9 * emission, 0.75 * emission), specular=0.0)
    floor = Material("floor", color=(0.7, 0.7, 0.7), specular=0.0)
    red = Material("red", color=(0.8, 0.2, 0.1), roughness=0.4)
    tape = flatten(union(box(1.6, 1.2, 0.1).material(floor), sphere(0.45).translate(-0.4, 0, 0.55).material(red),
                         sphere(radius).translate(0.5, 0.3, 0.9).material(lamp)))
    return tape, Camera((0.0, -4.5, 2.0), (0.0, 0.0, 0.45), fov_deg=30.0)


def emitter_rmse(walker, width: int, height: int, spps=NOISE_SPPS, reference_spp: int = NOISE_REFERENCE_SPP) -> list[dict]:
    """Rows of the RMSE against a ``reference_spp`` image (seed 7) of a small bright emitter
    (lamp_scene(0.1, 40)) in a black environment, with and without emitter samples (seed 1)."""
    from taperay.runtime.path_tracing import PathImage, PathSettings
    tape, camera = lamp_scene(0.1, 40.0)

    def image(emitters, seed, spp):
        path = PathSettings(environment=(0.0, 0.0, 0.0), seed=seed, emitter_samples=emitters)
        return PathImage(walker, tape, camera, width, height, path=path).add(spp).mean()
    reference = image(True, 7, reference_spp).astype("float64")
    rows = []
    for spp in spps:
        with_e, without = _rmse(image(True, 1, spp), reference), _rmse(image(False, 1, spp), reference)
        rows.append({"measure": "emitter samples", "scene": "small lamp, black environment", "walker": walker.name,
                     "size": f"{width}x{height}", "spp": spp, "reference spp": reference_spp,
                     "RMSE without": without, "RMSE with": with_e, "with / without": with_e / without})
    return rows


def sampler_rmse(walker, width: int, height: int, spps=NOISE_SPPS, reference_spp: int = NOISE_REFERENCE_SPP) -> list[dict]:
    """Rows of the RMSE (over pixels and rgb) against a ``reference_spp`` image (Sobol, seed 7)
    on the comparison scene, per sampler ("hash", "sobol"; seed 1) and spp of ``spps``."""
    from taperay.runtime.path_tracing import PathImage, PathSettings, SAMPLERS
    tape, camera = comparison_scene()

    def image(sampler, seed, spp):
        path = PathSettings(environment=COMPARISON_ENVIRONMENT, max_bounces=COMPARISON_MAX_BOUNCES, seed=seed,
                            sampler=sampler)
        return PathImage(walker, tape, camera, width, height, path=path).add(spp).mean()
    reference = image("sobol", 7, reference_spp).astype("float64")
    rows = []
    for spp in spps:
        errors = {s: _rmse(image(s, 1, spp), reference) for s in reversed(SAMPLERS)}
        rows.append({"measure": "sampler", "scene": "path-mitsuba comparison", "walker": walker.name,
                     "size": f"{width}x{height}", "spp": spp, "reference spp": reference_spp,
                     "RMSE hash": errors["hash"], "RMSE sobol": errors["sobol"],
                     "sobol / hash": errors["sobol"] / errors["hash"]})
    return rows


def bench_path_noise(opts) -> BenchResult:
    """The integrator's noise at equal spp, against a high-spp reference image: the Sobol sampler
    against the independent hash on the comparison scene; emitter samples against BSDF samples
    alone on a small emitter in the dark."""
    from taperay.runtime.walkers import walker as choose_walker

    from .cli import parse_size
    walker = choose_walker(opts.walker)
    w, h = parse_size(opts.size) if opts.size else NOISE_SIZE
    rows = sampler_rmse(walker, w, h) + emitter_rmse(walker, w, h)
    return BenchResult(rows, settings={"walker": walker.name, "size": f"{w}x{h}"},
                       notes=[f"RMSE over every pixel and channel of the mean radiance against a {NOISE_REFERENCE_SPP} "
                              "spp image of another seed (its own noise is part of each figure); the comparison scene "
                              "of bench path-mitsuba (diffuse, metal, glass, an emitter, constant environment); the "
                              "lamp scene: a sphere of radius 0.1 emitting (40, 36, 30) over a slab and a red sphere"])
