"""Benchmark ``assembly``: issue 5's huge patterned assemblies on one walker (CPU twin or GPU).

Measures, per scene of scenes/ (lens bench x1000, plate with 10^6 holes, 10^6-strut lattice,
level-7 Menger sponge, 100,000 bolts in a bin):

  * load-to-first-frame from a saved ``.tape`` file: file read + decode, validation, upload
    (GPU buffer writes; the CPU twin reads the arrays in place, so none) and the first frame;
    walker startup (Numba kernel load / GPU kernel creation, then a tiny tape's frame at the
    bench's size, which allocates the frame buffers) is excluded and reported on its own row; a
    GPU walker draws that tiny tape for BUSY_S seconds before each load (keep_busy), as a viewer
    does, so the GPU's clocks are not those of an idle GPU;
  * the steady frame time (median of ``--repeat`` frames after the first);
  * frame time against instance count, 10 to 10^6, for a grid pattern (plate holes), a 3D grid
    (strut lattice) and an instance list (bolt bin), as render draws them and with a one-pixel
    hit cone (``RenderSettings.hit_cone``), written as a log-scale plot
    (``assembly-scaling.png``, needs matplotlib: ``pip install taperay[bench]``);
  * the bolt bin with culling on and off: field evaluation at random points in the bin for the
    full 100,000 bolts, and frames of a 2,000-bolt bin (unculled, every point tests every
    bolt's box, so the full bin cannot be framed in reasonable time);
  * GPU only: the bolt bin against the written-out WGSL baseline (``tools/baseline_wgsl.py``:
    the bolt body as one function, the BVH as nested ``if`` blocks, each bolt's placement as
    literals) at 10 .. 100,000 bolts: text size, compile (+ first dispatch) seconds, frame and
    point times of both, their largest difference. Each count runs in a child process killed
    after ``--baseline-limit`` seconds (default 600) plus ``CHILD_OVERHEAD_S`` for its startup,
    text generation and measuring; a count whose compile is predicted (a power law through the
    compiles measured so far, against the text size) to exceed the limit is not compiled, and
    neither is any larger one — the table says which, and why.

Frames are 1920x1080 on the GPU; on the CPU twin the default is 480x270 (a 1080p frame of the
bolt bin takes minutes there) and the report says so. Run: ``taperay bench assembly`` (options
``--walker cpu|gpu``, ``--size WxH``, ``--repeat``, ``-o DIR``) or
``python -m taperay.tools.bench_assembly`` with the same options.
"""
from __future__ import annotations

import argparse
import json
import math
import runpy
import tempfile
import time
from pathlib import Path

import numpy as np

from taperay.runtime.tape import TaperayError, validate
from taperay.tools.bench import BenchResult, markdown_table, report, summarize, time_calls

SCENES_DIR = Path(__file__).resolve().parent.parent / "scenes"
SCENES = ("lens_bench_1000", "plate_million_holes", "strut_lattice", "menger_sponge", "bolt_bin")
COUNTS = (10, 100, 1_000, 10_000, 100_000, 1_000_000)
# series for the scaling plot: scene -> (what is counted, builder arguments for ~count instances)
SERIES = {
    "plate_million_holes": ("holes (grid pattern)", lambda c: {"n": max(1, round(math.sqrt(c)))}),
    "strut_lattice": ("struts (3D grid pattern)", lambda c: {"n": max(1, round((c / 3) ** (1 / 3)))}),
    "bolt_bin": ("bolts (instance list, BVH)", lambda c: {"n": c}),
}
DEFAULT_SIZE = {"gpu": (1920, 1080), "cpu": (480, 270)}
CULL_POINTS = 2_000          # random points in the full bolt bin, culling on and off
CULL_FRAME_BOLTS = 2_000     # bolts in the bin framed with culling on and off
CULL_FRAME_SIZE = (160, 90)
PARTS = ("load", "scaling", "culling", "baseline")   # what bench_assembly measures (--parts)
BASELINE_COUNTS = (10, 100, 1_000, 10_000, 100_000)   # bolts, against the written-out baseline
BASELINE_LIMIT_S = 600.0     # compile seconds beyond which a count is not compiled (or is killed)
CHILD_OVERHEAD_S = 180.0     # a child's walker startup, text generation and measuring, on top
BASELINE_POINTS = {"hardware": 100_000, "software": 2_000}
BUSY_S = 0.5                 # GPU: seconds of frames drawn before each load (keep_busy)


def scene_module(name: str) -> dict:
    return runpy.run_path(str(SCENES_DIR / f"{name}.py"))


def make_walker(name: str):
    if name == "cpu":
        from taperay.runtime.cpu import CpuWalker
        return CpuWalker()
    if name == "gpu":
        try:
            from taperay.runtime.gpu import GpuWalker
        except ImportError as e:
            raise TaperayError(f"bench assembly: the GPU walker is not available ({e})") from None
        if not GpuWalker.available():
            raise TaperayError("bench assembly: no GPU adapter (use --walker cpu)")
        return GpuWalker()
    raise TaperayError(f"bench assembly: unknown walker {name!r} (cpu or gpu)")


def parse_size(text) -> tuple[int, int]:
    if isinstance(text, tuple):
        return text
    try:
        w, h = (int(v) for v in str(text).lower().split("x"))
    except ValueError:
        raise TaperayError(f"bench assembly: size {text!r} is not WIDTHxHEIGHT") from None
    if w < 1 or h < 1:
        raise TaperayError(f"bench assembly: size {text!r} must be at least 1x1")
    return w, h


def upload(walker, tape) -> None:
    """Make ``tape`` resident on the walker (GPU buffer writes; nothing for the CPU twin)."""
    if hasattr(walker, "upload"):
        walker.upload(tape)


def kernels_created(walker) -> int | None:
    """Shader modules + pipelines the walker has created so far (None: it has no kernels)."""
    st = walker.stats()
    if "pipelines_created" not in st:
        return None
    return st["shader_modules_created"] + st["pipelines_created"]


def _tiny_tape():
    from taperay.scenegraph import flatten, sphere
    return flatten(sphere(1.0) | sphere(0.5).translate(1, 0, 0), source="bench:startup")


def startup(walker, size) -> float:
    """Seconds to make the walker ready: kernel load / creation, then a tiny tape's frame at
    ``size`` (W, H), which allocates the buffers of frames of that size, as a viewer does when
    its window opens and before any file is loaded."""
    tiny = _tiny_tape()
    t0 = time.perf_counter()
    upload(walker, tiny)
    walker.render(tiny, None, *size)
    return time.perf_counter() - t0


def keep_busy(walker, size, seconds: float = BUSY_S) -> None:
    """Frames of the tiny tape for ``seconds``, as a viewer draws while the user opens a file:
    a GPU left idle lowers its clocks, and its next frames are slower (the H200: 100-125 ms more
    for a frame or two after 2 s idle, docs/PERFORMANCE.md)."""
    tiny = _tiny_tape()
    upload(walker, tiny)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        walker.render(tiny, None, *size)


def load_to_first_frame(walker, path: Path, size, repeat: int) -> dict:
    """Time each step from a saved tape file to its first frame, then the steady frame. A GPU
    walker draws (keep_busy) until the file is opened."""
    from taperay.scenegraph.files import load_tape_file
    w, h = size
    if hasattr(walker, "upload"):
        keep_busy(walker, size)
    created = kernels_created(walker)
    t0 = time.perf_counter()
    tape = load_tape_file(path)                 # read + decode + validate
    t1 = time.perf_counter()
    validate(tape)                              # once more, alone: the validation share
    t2 = time.perf_counter()
    upload(walker, tape)
    t3 = time.perf_counter()
    walker.render(tape, None, w, h)
    t4 = time.perf_counter()
    created = None if created is None else kernels_created(walker) - created
    steady = summarize(time_calls(lambda: walker.render(tape, None, w, h), repeat, warmup=0))
    check = t2 - t1
    return {"instances": tape.instance_count, "records": len(tape), "file MB": path.stat().st_size / 2 ** 20,
            "read ms": (t1 - t0 - check) * 1e3, "validate ms": check * 1e3, "upload ms": (t3 - t2) * 1e3,
            "first frame ms": (t4 - t3) * 1e3, "load-to-first-frame ms": (t4 - t0 - check) * 1e3,
            "frame ms (median)": steady["median_ms"], "kernels created": "-" if created is None else created}


def scaling(walker, size, repeat: int, counts=COUNTS, series=tuple(SERIES)) -> list[dict]:
    """Frame time (median) against instance count for each series, as render draws it and with
    a hit cone a pixel wide (RenderSettings.hit_cone = Camera.pixel_angle: cone marching, which
    ends rays at sub-pixel parts), in the same run. Each also gets what its picture asks of the
    march (one more march of the same frame): the share of pixels hit, the primary steps a
    pixel, and the frame time over those steps (ns a step: what the field costs where the rays
    go, shading included, apart from how much of the picture the parts fill)."""
    from taperay.runtime.camera import auto_camera
    from taperay.runtime.shading import RenderSettings
    from taperay.scenegraph import flatten
    rows = []
    for name in series:
        what, args = SERIES[name]
        build = scene_module(name)["build"]
        for count in counts:
            tape = flatten(build(**args(count)), source=f"{name}:{count}")
            upload(walker, tape)
            camera = auto_camera(tape.bounds)
            cone = RenderSettings(hit_cone=camera.pixel_angle(size[1]))
            ms = {}
            for label, settings in (("", None), (", 1 px cone", cone)):
                walker.render(tape, None, *size, settings=settings)
                frame_ms = summarize(time_calls(lambda: walker.render(tape, None, *size, settings=settings),
                                                repeat, warmup=0))["median_ms"]
                march = walker.march(tape, camera, *size, settings=settings)
                ms[f"frame ms{label} (median)"] = frame_ms
                if not label:
                    ms["pixels hit %"] = 100.0 * float(march["hit"].mean())
                ms[f"steps a pixel{label}"] = float(march["steps"].mean())
                ms[f"frame ns a step{label}"] = frame_ms * 1e6 / max(int(march["steps"].sum()), 1)
            rows.append({"series": name, "counted": what, "target": count, "instances": tape.instance_count,
                         "records": len(tape), **ms})
    return rows


def culling(walker, repeat: int) -> list[dict]:
    """The bolt bin with culling on and off: points of the full bin, frames of a small bin."""
    from taperay.scenegraph import flatten
    build = scene_module("bolt_bin")["build"]
    rng = np.random.default_rng(0)
    rows = []
    full = build()
    for cull in (True, False):
        tape = flatten(full, cull=cull)
        pts = rng.uniform(tape.bounds[0], tape.bounds[1], (CULL_POINTS, 3)).astype(np.float32)
        walker.evaluate(tape, pts[:1])
        stats = summarize(time_calls(lambda: walker.evaluate(tape, pts), 1 if not cull else repeat, warmup=0))
        rows.append({"what": f"evaluate {CULL_POINTS} points", "bolts": len(tape.instances),
                     "culling": "on" if cull else "off", "ms (median)": stats["median_ms"]})
    small = build(CULL_FRAME_BOLTS)
    for cull in (True, False):
        tape = flatten(small, cull=cull)
        upload(walker, tape)
        walker.render(tape, None, *CULL_FRAME_SIZE)
        stats = summarize(time_calls(lambda: walker.render(tape, None, *CULL_FRAME_SIZE), repeat, warmup=0))
        rows.append({"what": "frame {}x{}".format(*CULL_FRAME_SIZE), "bolts": len(tape.instances),
                     "culling": "on" if cull else "off", "ms (median)": stats["median_ms"]})
    return rows


def predict_compile_seconds(measured: list[tuple[int, float]], chars: int) -> float | None:
    """Compile seconds of a ``chars``-long text from the (chars, seconds) compiled so far: a
    power law through the last two (exponent at least 1: compiles never get cheaper per
    character), proportional from a single one; None before any."""
    if not measured:
        return None
    c1, s1 = measured[-1]
    exponent = 1.0
    if len(measured) > 1:
        c0, s0 = measured[-2]
        if c1 > c0 and s0 > 0 and s1 > 0:
            exponent = max(1.0, math.log(s1 / s0) / math.log(c1 / c0))
    return s1 * (chars / c1) ** exponent


def written_out_row(n: int, size, repeat: int, n_points: int) -> dict:
    """One count of the written-out comparison, in the calling process (``written_out`` runs it
    in a child): the bolt bin of ``n`` bolts compiled as written-out WGSL (points and frame
    kernels) and timed against the interpreter on the same walker."""
    from taperay.scenegraph import flatten
    from taperay.tools.bench_baseline import FRAME_KERNELS, POINT_KERNELS, BaselineKernel
    walker = make_walker("gpu")
    tape = flatten(scene_module("bolt_bin")["build"](n), source=f"bolt_bin:{n}")
    kernel = BaselineKernel(walker, tape, kernels=POINT_KERNELS + FRAME_KERNELS)
    pts = np.random.default_rng(0).uniform(tape.bounds[0], tape.bounds[1], (n_points, 3)).astype(np.float32)
    row = {"text MB": kernel.source_chars / 2 ** 20, "generate s": kernel.generate_seconds,
           "compile s": kernel.compile_seconds, "first dispatch s": kernel.first_dispatch_seconds}
    times = {}
    for what, fn in (("interpreter frame ms", lambda: walker.render(tape, None, *size)),
                     ("written-out frame ms", lambda: kernel.render(None, *size)),
                     ("interpreter points ms", lambda: walker.evaluate(tape, pts)),
                     ("written-out points ms", lambda: kernel.evaluate(pts))):
        times[what] = summarize(time_calls(fn, repeat))["median_ms"]
    diff = float(np.max(np.abs(walker.evaluate(tape, pts)[0] - kernel.evaluate(pts)[0])))
    return {**row, **times, "frame ratio": times["interpreter frame ms"] / times["written-out frame ms"],
            "points": n_points, "max abs difference": diff}


def written_out(walker, size, repeat: int, limit_s: float = BASELINE_LIMIT_S,
                counts=BASELINE_COUNTS) -> tuple[list[dict], str]:
    """The bolt bin against the written-out baseline at growing ``counts``: each count in a child
    process (so a compile past the limit can be killed), counts predicted past ``limit_s`` not
    compiled. Returns the rows and a note on what was and was not compiled."""
    import subprocess
    import sys
    from taperay.scenegraph import flatten
    from taperay.tools.baseline_wgsl import scene_function
    software = walker.info["software"]
    n_points = BASELINE_POINTS["software" if software else "hardware"]
    build = scene_module("bolt_bin")["build"]
    measured: list[tuple[int, float]] = []
    rows, stopped = [], None
    for n in counts:
        tape = flatten(build(n), source=f"bolt_bin:{n}")
        row = {"bolts": n, "records": len(tape), "BVH nodes": len(tape.bvh)}
        if stopped:
            rows.append({**row, "status": f"not compiled ({stopped})"})
            continue
        chars = len(scene_function(tape))
        predicted = predict_compile_seconds(measured, chars)
        row["predicted compile s"] = "-" if predicted is None else predicted
        if predicted is not None and predicted > limit_s:
            stopped = f"a smaller count was predicted past {limit_s:g} s"
            rows.append({**row, "status": f"not compiled: predicted {predicted:.3g} s > {limit_s:g} s "
                                          f"for {chars / 2 ** 20:.1f} MB of scene text"})
            continue
        code = ("import json, sys; from taperay.tools.bench_assembly import written_out_row as f; "
                "print(json.dumps(f(*json.loads(sys.argv[1]))))")
        args = json.dumps([n, list(size), repeat, n_points])
        try:
            done = subprocess.run([sys.executable, "-c", code, args], capture_output=True, text=True,
                                  timeout=limit_s + CHILD_OVERHEAD_S)
        except subprocess.TimeoutExpired:
            stopped = f"a smaller count ran past {limit_s + CHILD_OVERHEAD_S:g} s"
            rows.append({**row, "status": f"killed after {limit_s + CHILD_OVERHEAD_S:g} s (compile limit "
                                          f"{limit_s:g} s + {CHILD_OVERHEAD_S:g} s startup, generation, "
                                          "measuring)"})
            continue
        if done.returncode != 0:
            stopped = "a smaller count failed"
            tail = (done.stderr.strip().splitlines() or ["no message"])[-1]
            rows.append({**row, "status": f"failed: {tail}"})
            continue
        result = json.loads(done.stdout.strip().splitlines()[-1])
        measured.append((chars, result["compile s"] + result["first dispatch s"]))
        rows.append({**row, **result, "status": "measured"})
    compiled = [r["bolts"] for r in rows if r["status"] == "measured"]
    note = (f"written-out baseline (bolt bin, {size[0]}x{size[1]} shade frames, {n_points} points): compiled "
            f"and measured at {', '.join(map(str, compiled)) or 'no count'} bolts"
            + ("" if len(compiled) == len(rows) else
               f"; not at {', '.join(str(r['bolts']) for r in rows if r['status'] != 'measured')} bolts "
               f"(see the status column)")
            + f"; compile = shader modules + pipelines (eval_points, march, light), limit {limit_s:g} s")
    return rows, note


def plot(rows: list[dict], path: Path, title: str) -> str | None:
    """Log-log plot of frame time against instance count; returns a note when it is skipped."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install 'taperay[bench]')"
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), dpi=120)
    for ax, (key, cone_key, ylabel) in zip(axes, (
            ("frame ms (median)", "frame ms, 1 px cone (median)", "frame time, ms (median)"),
            ("frame ns a step", "frame ns a step, 1 px cone", "frame time / primary steps, ns"))):
        for i, (name, (what, _)) in enumerate(SERIES.items()):
            for k, style, label in ((key, "-", what), (cone_key, "--", f"{what}, 1 px cone")):
                pts = [(r["instances"], r[k]) for r in rows if r["series"] == name and k in r]
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", color=f"C{i}", label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("instances the tape stands for")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None


def bench_assembly(opts) -> BenchResult:
    """The ``taperay bench assembly`` entry: load-to-first-frame rows (the table), plus the
    scaling and culling measurements written beside it (JSON settings and the plot)."""
    from taperay.scenegraph import flatten
    from taperay.scenegraph.files import save_tape
    walker_name = getattr(opts, "walker", "cpu")
    size = parse_size(getattr(opts, "size", None) or DEFAULT_SIZE[walker_name])
    repeat = max(1, opts.repeat)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = set(getattr(opts, "parts", None) or PARTS)
    walker = make_walker(walker_name)
    rows = [{"scene": "(walker startup)", "instances": "", "records": "", "file MB": "", "read ms": "",
             "validate ms": "", "upload ms": "", "first frame ms": startup(walker, size) * 1e3,
             "load-to-first-frame ms": "", "frame ms (median)": "", "kernels created": ""}]
    with tempfile.TemporaryDirectory() as tmp:
        for name in SCENES if "load" in parts else ():
            path = Path(tmp) / f"{name}.tape"
            save_tape(flatten(scene_module(name)["scene"], source=name), path)
            rows.append({"scene": name, **load_to_first_frame(walker, path, size, repeat)})
    scale_rows = scaling(walker, size, repeat) if "scaling" in parts else []
    cull_rows = culling(walker, repeat) if "culling" in parts else []
    extras = [(stem, r) for stem, r in (("assembly-scaling", scale_rows), ("assembly-culling", cull_rows)) if r]
    baseline_note = "written-out baseline: not measured (it runs on the GPU walker only: --walker gpu)"
    if "baseline" not in parts:
        baseline_note = "written-out baseline: not measured (not among --parts)"
    elif walker_name == "gpu":
        base_rows, baseline_note = written_out(walker, size, repeat,
                                               float(getattr(opts, "baseline_limit", BASELINE_LIMIT_S)))
        extras.append(("assembly-baseline", base_rows))
    machine = {"walker": walker_name}
    if walker_name == "gpu":
        machine["gpu"] = walker.adapter_name
    notes = [f"frames {size[0]}x{size[1]}" + (" (the CPU twin's default; the issue's 1920x1080 is the GPU "
                                                "default, pass --size 1920x1080 to use it here)"
                                                if walker_name == "cpu" and size == DEFAULT_SIZE["cpu"] else ""),
             "load-to-first-frame = read + validate + upload + first frame; walker startup (kernel load or "
             "creation, then a tiny tape's frame at this size, which allocates the frame buffers: first row) "
             "is excluded; 'read' is the file read and decode, the tape then validated "
             "once (validation timed alone)",
             f"GPU: the walker draws the startup's tiny tape for {BUSY_S} s before each load, as a viewer "
             "draws while a file is opened (an idle GPU's next frames are slower: its clocks come down)",
             "the CPU twin has no upload (it reads the arrays in place); its first frame also hashes the "
             "tape to cache its validation",
             f"frame ms (median) over {repeat} frames after the first",
             "kernels created: shader modules + pipelines the GPU walker created from reading the file to "
             "the first frame (must be 0; '-' on the CPU twin)"]
    for stem, extra in extras:
        (out / f"{stem}.json").write_text(json.dumps({"settings": {"walker": walker_name, "size": list(size),
                                                                    "repeat": repeat}, "rows": extra}, indent=2) + "\n")
        (out / f"{stem}.md").write_text(markdown_table(extra))
    if scale_rows:
        skipped = plot(scale_rows, out / "assembly-scaling.png",
                       f"taperay bench assembly: frame time vs instances ({walker_name}, {size[0]}x{size[1]})")
        notes.append(f"frame time against instance count, 10 to 10^6: {out / 'assembly-scaling.md'} (.json)"
                     + ("; " + skipped if skipped else f", plotted in {out / 'assembly-scaling.png'}"))
    if cull_rows:
        notes.append(f"bolt bin with culling on and off: {out / 'assembly-culling.md'} (.json)")
    notes.append(baseline_note + (f": {out / 'assembly-baseline.md'} (.json)"
                                  if walker_name == "gpu" and "baseline" in parts else ""))
    notes.append(f"parts measured: {', '.join(p for p in PARTS if p in parts)}")
    return BenchResult(rows, settings={"walker": walker_name, "size": f"{size[0]}x{size[1]}", "repeat": repeat},
                       notes=notes, machine=machine)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m taperay.tools.bench_assembly", description=__doc__.split("\n")[0])
    p.add_argument("--walker", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--size", default=None, metavar="WxH", help="frame size (default 1920x1080 on gpu, 480x270 on cpu)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("-o", "--out", default="bench-out", metavar="DIR")
    p.add_argument("--baseline-limit", type=float, default=BASELINE_LIMIT_S, metavar="S",
                   help="compile seconds past which the written-out baseline is not compiled (default 600)")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                   help="what to measure (default all): load-to-first-frame, scaling, culling, baseline")
    opts = p.parse_args(argv)
    result = bench_assembly(opts)
    paths = report("assembly", result, Path(opts.out))
    print(Path(paths[1]).read_text())
    print("wrote " + ", ".join(str(q) for q in paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
