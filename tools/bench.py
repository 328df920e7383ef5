"""The benchmark harness behind ``taperay bench NAME``: one registry, timing, and the reports.

``BENCHMARKS`` maps a name to the function that measures it (``"module:function"``, imported only
when that benchmark runs). A benchmark function takes the parsed options (``n``, ``repeat``,
``seed``, ``out``) and returns a ``BenchResult``; the harness names the machine, writes
``<out>/<name>.json`` and ``<out>/<name>.md`` (plus ``<name>.png`` when the result asks for a bar
chart) and prints the table. Benchmarks measure; they never assert on time (tests don't either).

Built in: ``cpu-points`` — the CPU twin evaluating random points in the fixed scene
``(sphere(1.2) & box(1)) - three cylinders along x, y, z``; warm-up, then the median of repeats.
"""
from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from importlib import import_module
from pathlib import Path
from typing import Callable

from taperay.runtime.tape import TaperayError


@dataclass(frozen=True)
class Benchmark:
    target: str     # "module:function" taking the options and returning a BenchResult
    help: str


BENCHMARKS: dict[str, Benchmark] = {
    "assembly": Benchmark("taperay.tools.bench_assembly:bench_assembly",
                          "huge patterned assemblies: load-to-first-frame, frame time vs instances, culling"),
    "cpu-points": Benchmark("taperay.tools.bench:bench_cpu_points",
                            "CPU twin: points/s evaluating the fixed scene (sphere & box - 3 cylinders)"),
    "jax": Benchmark("taperay.tools.bench_jax:bench_jax",
                     "JAX walker: trace vs generic form, values and pool gradients at 64³, compiles per edit"),
    "gpu": Benchmark("taperay.tools.bench_gpu:bench_gpu",
                     "GPU walker: interpreter vs written-out WGSL, compile and evaluation times"),
    "prune-gpu": Benchmark("taperay.tools.bench_prune_gpu:bench_prune_gpu",
                           "GPU walker: prospero sign/field image with per-tile interval pruning vs unpruned, 1024² and 4096²"),
    "flatten": Benchmark("taperay.tools.bench:bench_flatten",
                         "flatten: patterns of 10^2..10^6 instances and an instance list of 10^5 (no per-instance Python)"),
    "optimize": Benchmark("taperay.tools.bench_optimize:bench_optimize",
                          "solvers: the heat-sink and cantilever optimisations, each step by stage (mesh, solve, "
                          "velocity, adjoint, shape gradient), objective history; --repeat N: optimiser steps"),
    "sim": Benchmark("taperay.tools.bench_sim:bench_sim",
                     "solvers: the heat sink end to end (surface, tets, assembly, solve), TET4 and TET10, first and novel designs"),
    "verify": Benchmark("taperay.tools.bench_verify:bench_verify",
                        "solvers: simulate's defaults against analytic answers (hollow sphere, Lame sphere, "
                        "Timoshenko beam, exact volumes, shape derivatives vs remeshed differences), error vs cell size"),
    "random-scenes": Benchmark("taperay.tools.bench_random_scenes:bench_random_scenes",
                               "solvers: 200 random CSG scenes through mesh and a heat simulate on the defaults: "
                               "closed, simulated or one clear error, crashes counted"),
    "surface": Benchmark("taperay.tools.bench_surface:bench_surface",
                         "solvers: dual contouring vs marching cubes at resolution 96 (sphere, boxes, two scenes): "
                         "closed manifold, volume error, vertex distance, box corners, band size, time"),
    "startup": Benchmark("taperay.tools.bench_startup:bench_startup",
                         "whole `taperay render` processes (showcase, prospero --2d), first on a new machine and later, stage split"),
    "view": Benchmark("taperay.tools.bench_view:bench_view",
                      "the live viewer offscreen: slider and topology edit -> frame presented, per scene, "
                      "pipelines created by edits"),
    "path": Benchmark("taperay.tools.bench_path:bench_path",
                      "path tracer: Msamples/s and time to 256 spp for the showcase, the bolt bin and prospero's "
                      "slab; pipelines created by material, parameter and topology edits; --repeat N: spp timed"),
    "path-mitsuba": Benchmark("taperay.tools.bench_path:bench_path_mitsuba",
                              "path tracer against Mitsuba 3 on spheres and boxes on a slab (diffuse, metal, glass, "
                              "emitter): per-tile agreement within noise, times, both pictures; --repeat N: spp"),
    "path-noise": Benchmark("taperay.tools.bench_path:bench_path_noise",
                            "path tracer: RMSE against a high-spp reference at equal spp, Sobol against the "
                            "independent hash sampler"),
    "prune-cpu": Benchmark("taperay.tools.bench_prune:bench_prune_cpu",
                           "CPU twin: prospero sign/field image with interval pruning, 1024² and 4096², and 1M points"),
}


@dataclass
class BenchResult:
    """What one benchmark measured: table rows (column -> value, in column order), the settings
    it ran with, notes for the reader, and machine facts beyond the CPU (e.g. the GPU adapter)."""
    rows: list[dict]
    settings: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    machine: dict = field(default_factory=dict)
    chart: tuple[str, str] | None = None     # (label column, value column) for a bar chart PNG


# ---------------------------------------------------------------------------------------------
# machine and timing

def machine_info() -> dict:
    """CPU model and core count (from /proc/cpuinfo where it exists), OS and Python."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": model or platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "os": platform.platform(),
            "python": platform.python_version()}
    try:
        import numba
        info["numba"] = numba.__version__
        info["numba_threads"] = numba.get_num_threads()
    except ImportError:
        pass
    return info


def time_calls(fn: Callable[[], object], repeat: int, warmup: int = 1, progress=None) -> list[float]:
    """Seconds per call of ``fn`` for ``repeat`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if progress is not None:
            progress()
    return times


def summarize(times: list[float]) -> dict:
    return {"median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3,
            "max_ms": max(times) * 1e3}


# ---------------------------------------------------------------------------------------------
# built-in benchmarks

def fixed_scene():
    """The cpu-points scene: sphere(1.2) & box(1), minus cylinders of radius .5 along z, y, x."""
    from taperay.scenegraph import box, cylinder, sphere
    bore = cylinder(0.5, 2)
    return ((sphere(1.2) & box(1)) - bore - bore.rotate((1, 0, 0), 90)
            - bore.rotate((0, 1, 0), 90))


def bench_cpu_points(opts) -> BenchResult:
    import numpy as np
    from taperay.runtime.cpu import CpuWalker
    from taperay.scenegraph import flatten
    tape = flatten(fixed_scene(), source="bench:cpu-points")
    rng = np.random.default_rng(opts.seed)
    pts = rng.uniform(tape.bounds[0], tape.bounds[1], (opts.n, 3)).astype(np.float32)
    walker = CpuWalker()
    with BenchProgress(f"cpu-points: {opts.n} points x {opts.repeat}", opts.repeat + 1) as tick:
        t0 = time.perf_counter()
        walker.evaluate(tape, pts)             # first call: includes the JIT compile
        first = time.perf_counter() - t0
        tick()
        times = time_calls(lambda: walker.evaluate(tape, pts), opts.repeat, warmup=0, progress=tick)
    stats = summarize(times)
    row = {"benchmark": "cpu-points", "walker": walker.name, "records": len(tape),
           "points": opts.n, "repeats": opts.repeat, "first call ms": first * 1e3,
           "median ms": stats["median_ms"], "min ms": stats["min_ms"], "max ms": stats["max_ms"],
           "Mpoints/s": opts.n / (stats["median_ms"] / 1e3) / 1e6}
    return BenchResult([row], settings={"n": opts.n, "repeat": opts.repeat, "seed": opts.seed},
                       notes=["first call includes Numba's JIT compile (and any cache load); "
                              "the median is over the repeats after it"])


def bench_flatten(opts) -> BenchResult:
    """Scene graph -> validated tape: grid patterns whose count grows 10^2..10^6 (the tape must
    not grow), and an instance list of 10^5 random poses (BVH built with numpy)."""
    import numpy as np
    from taperay.scenegraph import box, cylinder, flatten
    rows = []
    cases = [(f"plate minus {n}x{n} grid of holes",
              lambda n=n: box(10, 10, 0.5) - cylinder(0.004, 1).grid_pattern((0.01, 0.01, 1), (n, n, 1)))
             for n in (10, 100, 1000)]
    rng = np.random.default_rng(opts.seed)
    q = rng.normal(size=(100_000, 4))
    q /= np.linalg.norm(q, axis=1)[:, None]
    t = rng.uniform(-20, 20, (100_000, 3))
    cases.append(("instance list of 100000 bolts", lambda: (cylinder(0.02, 0.1) | box(0.04, 0.04, 0.02)).instances(t, q)))
    with BenchProgress(f"flatten: {len(cases)} scenes x {opts.repeat}", len(cases)) as tick:
        for name, build in cases:
            node = build()
            tape = flatten(node)
            stats = summarize(time_calls(lambda: flatten(node), opts.repeat))
            rows.append({"scene": name, "instances": tape.instance_count, "records": len(tape),
                         "BVH nodes": len(tape.bvh), "median ms": stats["median_ms"],
                         "min ms": stats["min_ms"], "max ms": stats["max_ms"]})
            tick()
    return BenchResult(rows, settings={"repeat": opts.repeat, "seed": opts.seed},
                       notes=["flatten includes validation; building the scene nodes is not timed"])


# ---------------------------------------------------------------------------------------------
# the harness

class BenchProgress:
    """A rich progress bar with an ETA on stderr; yields a tick() function."""

    def __init__(self, text: str, total: int):
        self.text, self.total = text, total

    def __enter__(self):
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), TimeRemainingColumn(),
                            console=Console(stderr=True), transient=True)
        self.bar.__enter__()
        task = self.bar.add_task(self.text, total=self.total)
        return lambda: self.bar.advance(task)

    def __exit__(self, *exc):
        return self.bar.__exit__(*exc)


def resolve(name: str) -> Callable:
    bench = BENCHMARKS[name]
    module, func = bench.target.split(":")
    try:
        return getattr(import_module(module), func)
    except (ImportError, AttributeError) as e:
        raise TaperayError(f"bench {name}: not available in this install ({e})") from None


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def _md(v) -> str:
    return _cell(v).replace("|", "\\|")


def columns(rows: list[dict]) -> list[str]:
    """Every column of the rows, in order of first appearance (rows may differ in columns)."""
    return list(dict.fromkeys(c for r in rows for c in r))


def markdown_table(rows: list[dict]) -> str:
    cols = columns(rows)
    lines = ["| " + " | ".join(map(_md, cols)) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_md(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def markdown(name: str, result: BenchResult, machine: dict) -> str:
    lines = [f"## taperay bench {name}", "",
             "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()), "",
             markdown_table(result.rows).rstrip("\n")]
    lines += [""] + [f"- {n}" for n in result.notes]
    return "\n".join(lines).rstrip() + "\n"


def bar_chart(path: Path, labels: list[str], values: list[float], title: str) -> None:
    """A plain horizontal bar chart PNG (Pillow only); a value that is not finite (a row not
    measured) gets no bar."""
    from PIL import Image, ImageDraw
    w, row_h, left = 720, 22, 260
    h = 40 + row_h * len(values)
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    d.text((10, 10), title, fill="black")
    vmax = max([v for v in values if math.isfinite(v)], default=0.0) or 1.0
    for i, (lab, v) in enumerate(zip(labels, values)):
        y = 34 + i * row_h
        bar = (w - left - 90) * v / vmax if math.isfinite(v) else 0.0
        d.text((10, y + 4), lab[:40], fill="black")
        if math.isfinite(v):
            d.rectangle([left, y + 2, left + bar, y + row_h - 4], fill=(70, 110, 180))
        d.text((left + bar + 6, y + 4), _cell(v), fill="black")
    img.save(path)


def report(name: str, result: BenchResult, out_dir: Path) -> list[Path]:
    """Write ``<name>.json``, ``<name>.md`` (and ``<name>.png``) into ``out_dir``."""
    machine = {**machine_info(), **result.machine}
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": name, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "command": f"taperay bench {name} " + " ".join(f"--{k} {v}" for k, v in result.settings.items()),
           "machine": machine, "settings": result.settings, "rows": result.rows, "notes": result.notes}
    paths = [out_dir / f"{name}.json", out_dir / f"{name}.md"]
    paths[0].write_text(json.dumps(doc, indent=2) + "\n")
    paths[1].write_text(markdown(name, result, machine))
    if result.chart and result.rows:
        label, value = result.chart
        paths.append(out_dir / f"{name}.png")
        bar_chart(paths[-1], [str(r[label]) for r in result.rows], [float(r[value]) for r in result.rows],
                  f"taperay bench {name}: {value}")
    return paths


def print_table(name: str, result: BenchResult) -> None:
    from rich.table import Table

    from .console import console
    cols = columns(result.rows)
    table = Table(*cols, title=f"taperay bench {name}", title_justify="left")
    for r in result.rows:
        table.add_row(*(_cell(r.get(c, "")) for c in cols))
    con = console()
    con.print(table)
    for n in result.notes:
        con.print(f"note: {n}")


def run(args) -> int:
    if args.n < 1 or args.repeat < 1:
        raise TaperayError("bench: --n and --repeat must be at least 1")
    result = resolve(args.name)(args)
    print_table(args.name, result)
    paths = report(args.name, result, Path(args.out))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def add_parser(subparsers, func) -> None:
    """The ``bench`` subcommand of the ``taperay`` parser."""
    p = subparsers.add_parser("bench", help="measure (writes JSON + a markdown table)",
                              description="Benchmarks: " + "; ".join(
                                  f"{k}: {b.help}" for k, b in BENCHMARKS.items()))
    p.add_argument("name", choices=list(BENCHMARKS), metavar="NAME",
                   help="one of: " + ", ".join(BENCHMARKS))
    p.add_argument("--n", type=int, default=1_000_000, help="points per evaluation (default 1000000)")
    p.add_argument("--repeat", type=int, default=7, help="timed repeats after warm-up (default 7)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--walker", choices=("cpu", "gpu"), default="cpu",
                   help="walker for benchmarks that render (assembly, startup, view, path); default cpu")
    p.add_argument("--size", default=None, metavar="WxH", help="frame size for benchmarks that render")
    p.add_argument("--forms", default=None, metavar="A,B",
                   help="jax: the JAX walker's forms to measure, of trace, generic, cells, default "
                        "(JaxWalker() as a user gets it); default: all")
    p.add_argument("-o", "--out", default="bench-out", metavar="DIR", help="output folder (default bench-out/)")
    p.set_defaults(func=func)
