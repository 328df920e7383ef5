"""``taperay bench random-scenes``: 200 random CSG scenes made through the public modelling API
(booleans, smooth blends, shells, patterns, thin walls), each meshed as ``taperay mesh`` does (dual
contouring at resolution 32) and simulated as ``taperay simulate`` does (a heat study on the
defaults at resolution 24, where dual contouring that TetGen refuses is tried on finer grids, then
marching cubes): every scene must end closed and manifold, simulated, or with one clear error; a
crash (any other exception) is counted apart. ``--seed S``: scenes S .. S + 199.

``random_scene(rng)`` is the generator (the tests run a few of its scenes).
"""
from __future__ import annotations

import time
from collections import Counter

import numpy as np

from taperay.runtime.tape import TaperayError

from .bench import BenchResult, BenchProgress

SCENES = 200
MESH_RESOLUTION = 32
SIM_RESOLUTION = 24
FINER = "dual contouring on a finer grid"
FALLBACK = "marching cubes (fallback)"


def _primitive(rng):
    from taperay.scenegraph import box, cylinder, sphere, torus
    kind = rng.integers(4)
    if kind == 0:
        node = sphere(rng.uniform(0.2, 0.6))
    elif kind == 1:
        node = box(*rng.uniform(0.1, 0.5, 3))
    elif kind == 2:
        node = cylinder(rng.uniform(0.1, 0.4), rng.uniform(0.2, 0.6))
    else:
        node = torus(rng.uniform(0.3, 0.5), rng.uniform(0.05, 0.15))
    return node.rotate(tuple(rng.normal(size=3)), rng.uniform(0, 180)).translate(*rng.uniform(-0.5, 0.5, 3))


def _tree(rng, depth: int):
    from taperay.scenegraph import difference, intersection, union
    if depth == 0 or rng.random() < 0.3:
        return _primitive(rng)
    a, b = _tree(rng, depth - 1), _tree(rng, depth - 1)
    kind = rng.integers(7)
    if kind == 0:
        return union(a, b)
    if kind == 1:
        return difference(a, b)
    if kind == 2:
        return intersection(a, b)
    if kind == 3:
        return a.smooth_union(b, rng.uniform(0.05, 0.2))
    if kind == 4:
        return a.smooth_difference(b, rng.uniform(0.02, 0.1))
    if kind == 5:
        return union(a, b.shell(rng.uniform(0.02, 0.08)))          # thin walls
    return union(a, b.linear_pattern((rng.uniform(0.2, 0.4), 0, 0), int(rng.integers(2, 4))))


def random_scene(rng):
    """A random part (material "cool") with a small sphere of material "hot" unioned in, and the
    heat study that names both (the hot sphere held at 1, convection to 0 elsewhere)."""
    from taperay.scenegraph import Material, sphere, union
    from taperay.solvers import Heat
    cool, hot = Material("cool", (0.2, 0.3, 0.9)), Material("hot", (0.9, 0.2, 0.1))
    node = union(_tree(rng, 3).material(cool), sphere(0.15).material(hot).translate(*rng.uniform(-0.3, 0.3, 3)))
    return node, Heat(conductivity=1.0, fixed_temperature={"hot": 1.0}, convection={"cool": (1.0, 0.0)})


def run_scene(seed: int) -> dict:
    """One scene through mesh and simulate: a row of what happened."""
    import taperay as tr
    from taperay.solvers import mesh_surface, simulate
    node, study = random_scene(np.random.default_rng(seed))
    row = {"seed": seed}
    t0 = time.perf_counter()
    try:
        tape = tr.flatten(node)
        surf = mesh_surface(tape, MESH_RESOLUTION, method="dc")
        row["mesh"] = "closed manifold" if surf.is_watertight else "NOT closed"
    except TaperayError as e:
        row["mesh"], row["message"] = "error", str(e)
    except Exception as e:          # (a crash: what this benchmark exists to find)
        row["mesh"], row["message"] = "crash", f"{type(e).__name__}: {e}"
    try:
        result = simulate(tape, study, resolution=SIM_RESOLUTION)
        surf = result.surface_stats
        row["simulate"] = ("ok" if "fallback" not in surf else FINER if surf["method"] == "dc" else FALLBACK)
    except TaperayError as e:
        row["simulate"] = "error"
        row.setdefault("message", str(e))
    except Exception as e:
        row["simulate"] = "crash"
        row["message"] = f"{type(e).__name__}: {e}"
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


def bench_random_scenes(opts) -> BenchResult:
    rows = []
    with BenchProgress(f"random-scenes: {SCENES} scenes", SCENES) as tick:
        for seed in range(opts.seed, opts.seed + SCENES):
            rows.append(run_scene(seed))
            tick()
    mesh, sim = Counter(r["mesh"] for r in rows), Counter(r["simulate"] for r in rows)
    summary = [{"stage": f"mesh (dual contouring, resolution {MESH_RESOLUTION})", **mesh},
               {"stage": f"simulate (heat, defaults, resolution {SIM_RESOLUTION})", **sim}]
    notes = [f"seed {r['seed']}: {r['mesh']} / {r['simulate']}: {r.get('message', '')[:300]}"
             for r in rows if r["mesh"] != "closed manifold" or r["simulate"] not in ("ok", FINER, FALLBACK)]
    return BenchResult(summary, settings={"seed": opts.seed}, notes=notes)
