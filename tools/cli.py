"""The ``taperay`` command line: ``render``, ``eval``, ``grad``, ``info``, ``conform``, ``mesh``,
``simulate``, ``optimize`` and ``bench``.

Owns argument parsing (the walker itself is chosen by ``taperay.runtime.walkers``), the "what it
did" report with per-stage timings, and the error contract: every error a user can cause ends as one line
``taperay: error: <file>: <reason>`` on stderr with exit status 2 (never a traceback); a keyboard
interrupt exits 130 quietly. Heavy modules (numpy, numba, wgpu) are imported lazily so that
``taperay --help`` is fast.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from pathlib import Path

from taperay.runtime.outputs import write_atomic, write_text
from taperay.runtime.tape import TaperayError

from .console import console, step

MESH_SUFFIXES = (".stl", ".obj", ".ply", ".glb", ".off")
# host memory an image takes while it is drawn, bytes a pixel (peak RSS of `render --walker cpu` at
# two sizes, 2-core EPYC: 84 for the shaded view, 103 for the path tracer's), with a margin
IMAGE_BYTES_PER_PIXEL = 120
VIEWS = ("shade", "normals", "depth", "steps", "gradient", "slice", "section")
WALKERS = ("auto", "cpu", "gpu")   # runtime.walkers.WALKER_KINDS (not imported here: --help stays fast)
VIEW_CONE_PIXELS = 1.0             # tools.viewer.CONE_PIXELS (likewise)


class UsageError(TaperayError):
    """Bad command-line arguments (reported like every other user error)."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is the one-line ``taperay: error: ...`` of every other error."""

    def error(self, message):
        raise UsageError(f"{message} (see `{self.prog} --help`)")


# ---------------------------------------------------------------------------------------------
# small helpers shared by the commands

class Stopwatch:
    """Named stage timings in the order they ran."""

    def __init__(self):
        self.stages: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.stages[name] = self.stages.get(name, 0.0) + time.perf_counter() - t0

    def summary(self) -> str:
        parts = [f"{k} {_fmt_seconds(v)}" for k, v in self.stages.items()]
        return ", ".join(parts) + f" (total {_fmt_seconds(sum(self.stages.values()))})"


def _fmt_seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def check_cone(pixels: float) -> None:
    """A --cone width (pixels' footprint, RenderSettings.hit_cone) the commands accept."""
    if not 0 <= pixels < 1000:
        raise UsageError(f"--cone {pixels}: the hit cone's width in pixels must lie in [0, 1000)")


def parse_size(text: str) -> tuple[int, int]:
    """``WxH`` or ``N`` (square) -> (width, height)."""
    parts = text.lower().split("x")
    try:
        if len(parts) == 1:
            w = h = int(parts[0])
        elif len(parts) == 2:
            w, h = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise UsageError(f"--size {text!r}: expected WxH or N, e.g. 640x480") from None
    if not (1 <= w <= 16384 and 1 <= h <= 16384):
        raise UsageError(f"--size {text!r}: width and height must be in 1..16384")
    return w, h


def load_scene(path: str, watch: Stopwatch, balance_chains: bool = False):
    """Load and flatten a scene source, timing ``load`` and ``flatten/validate`` separately where
    the source has both stages (a Python scene); other sources are validated while loading
    (``balance_chains``: as load_tape's)."""
    from taperay.scenegraph import flatten
    from taperay.scenegraph.loading import load_scene_module, load_tape
    p = Path(path)
    if p.suffix.lower() == ".py" and p.is_file():
        with watch.stage("load"):
            node = load_scene_module(p)
        with watch.stage("flatten/validate"):
            return flatten(node, source=str(p))
    with watch.stage("load+validate"):
        return load_tape(p, balance_chains)


def apply_sets(tape, sets: list[str] | None, watch: Stopwatch | None = None):
    """Each ``NAME=VALUE`` of ``--set`` written into the tape's named parameter (``Tape.set_param``,
    refitting a scene's bounds); the tape."""
    for item in sets or ():
        name, eq, value = item.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = None
        if not eq or not name.strip() or number is None or not math.isfinite(number):
            raise UsageError(f"--set {item!r}: expected NAME=VALUE with a finite number, e.g. --set radius=0.4")
        with watch.stage("set") if watch else contextlib.nullcontext():
            try:
                tape.set_param(name.strip(), number)
            except TaperayError as e:
                raise TaperayError(f"{tape.source or 'scene'}: --set {item}: {e}") from None
    return tape


# folders made for this command's outputs, removed again (when still empty) if it fails
_made_folders: list[Path] = []


def _output_path(path: str, *inputs) -> Path:
    """An output named on the command line, checked before any work (``runtime.outputs.check_output``:
    a regular file or nothing, none of ``inputs``), its folder made (and removed again should the
    command fail)."""
    from taperay.runtime.outputs import check_output
    out = Path(path)
    folder = check_output(out, inputs).parent
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for made in reversed(missing):
        made.mkdir(exist_ok=True)      # (exist_ok: the ranks of an MPI run make it together)
        _made_folders.append(made)
    return out


def _remove_made_folders() -> None:
    while _made_folders:
        try:
            _made_folders.pop().rmdir()
        except OSError:          # (not empty, or gone)
            pass


# ---------------------------------------------------------------------------------------------
# walkers

def _walker_label(walker) -> str:
    adapter = getattr(walker, "adapter_name", None)
    return f"{walker.name} ({adapter})" if adapter else walker.name


def _pipeline_seconds(walker) -> float:
    """Seconds the GPU walker's requests have waited for pipelines to be made (0 for the twin)."""
    kernels = getattr(walker, "kernels", None)
    return kernels.stats.build_seconds if kernels is not None else 0.0


def _split_pipelines(watch: Stopwatch, stage: str, seconds: float) -> None:
    """Move ``seconds`` of ``stage`` (waiting for GPU pipelines) into a "pipelines" stage just before it."""
    if seconds <= 0:
        return
    stages = list(watch.stages.items())
    watch.stages.clear()
    for name, spent in stages:
        if name == stage:
            watch.stages["pipelines"] = seconds
            spent -= seconds
        watch.stages[name] = spent


# ---------------------------------------------------------------------------------------------
# commands

def _path_settings(args):
    """The PathSettings of ``render --view path``'s --environment (R,G,B or an .hdr / .pfm file)
    and --max-bounces; None for the other views (which take neither)."""
    if args.view != "path":
        if args.environment is not None or args.max_bounces is not None:
            raise UsageError("--environment and --max-bounces go with --view path")
        return None
    from taperay.runtime.path_tracing import PathSettings
    kw = {}
    if args.max_bounces is not None:
        if not 1 <= args.max_bounces <= 1024:
            raise UsageError(f"--max-bounces {args.max_bounces}: the bounce limit must lie in 1..1024")
        kw["max_bounces"] = args.max_bounces
    env = args.environment
    if env is not None and Path(env).suffix.lower() in (".hdr", ".pic", ".pfm"):
        from taperay.runtime.environment import EnvironmentMap
        kw["environment_map"] = EnvironmentMap.read(env)
    elif env is not None:
        try:
            rgb = tuple(float(v) for v in env.split(","))
        except ValueError:
            rgb = ()
        if len(rgb) != 3 or not all(0 <= v < float("inf") for v in rgb):
            raise UsageError(f"--environment {env}: give R,G,B (three finite numbers >= 0) or an .hdr / .pfm file")
        kw["environment"] = rgb
    return PathSettings(**kw)


def _environment_file(args) -> str | None:
    """``--environment``'s file, when it names one (an input like the scene)."""
    env = getattr(args, "environment", None)
    return env if env is not None and Path(env).suffix.lower() in (".hdr", ".pic", ".pfm") else None


def check_image_memory(w: int, h: int, what: str) -> None:
    """Refuse an image whose host buffers (about ``IMAGE_BYTES_PER_PIXEL`` bytes a pixel on either
    walker) outgrow the memory available now."""
    from taperay.runtime.resources import check_memory
    check_memory(w * h * IMAGE_BYTES_PER_PIXEL, f"{what} {w}x{h}", "give a smaller size")


def cmd_render(args) -> int:
    w, h = parse_size(args.size)
    out = _output_path(args.output, args.scene, _environment_file(args))
    if args.two_d and args.view != "shade":
        raise UsageError("--2d draws the field image; it takes no --view")
    check_cone(args.cone)
    if args.view == "path" and args.cone:
        raise UsageError("--view path marches with hit_eps; it takes no --cone")
    if not 1 <= args.spp <= 1 << 16:
        raise UsageError(f"--spp {args.spp}: samples per pixel must lie in 1..65536")
    path_settings = _path_settings(args)
    check_image_memory(w, h, "--size")
    from taperay.runtime.walkers import prepare, run_on, walker as choose_walker
    prepare(args.walker, progress=True, build_rest=False)    # (the device opens while the scene loads)
    watch = Stopwatch()
    from taperay.runtime import gpu_device
    gpu_device.build_in_background(False)       # one frame: the GPU makes only the pipelines it draws with
    # a 2D image on the GPU prunes faster with shallow MIN / MAX chains (the twin slower: runtime.program)
    tape = apply_sets(load_scene(args.scene, watch, balance_chains=args.two_d and args.walker != "cpu"),
                      args.set, watch)
    notes: list[str] = []
    with watch.stage("walker"):
        walker = choose_walker(args.walker, log=notes.append, progress=True, step=step)
    waited = _pipeline_seconds(walker)

    def frame(wk, w=w, h=h):
        if args.two_d:
            if wk.name == "gpu":      # (tile levels for the balanced chains)
                from taperay.runtime.gpu_pruning import image_tiles
                return inside_to_rgb(wk.sign_image(tape, w, h, rect=grid_rect(w, h), tiles=image_tiles(w, h)))
            return inside_to_rgb(wk.sign_image(tape, w, h, rect=grid_rect(w, h)))
        from taperay.runtime.camera import auto_camera
        from taperay.runtime.shading import RenderSettings
        cam = auto_camera(tape.bounds)
        settings = RenderSettings(hit_cone=args.cone * cam.pixel_angle(h)) if args.cone else None
        if args.view == "path":
            from taperay.runtime.path_tracing import PathImage
            return PathImage(wk, tape, cam, w, h, path=path_settings).add(args.spp).rgb8()
        return wk.render(tape, cam, w, h, settings=settings, view=args.view)

    if walker.name == "cpu":   # the twin's first compile (or its load from the disk cache) on a 2x2
        with watch.stage("compile"):    # frame, outside the spinner, so that its progress line shows
            frame(walker, 2, 2)
    with step(f"rendering {w}x{h}"), watch.stage("frame"):
        walker, rgb = run_on(walker, args.walker, frame, log=notes.append)
    _split_pipelines(watch, "frame", _pipeline_seconds(walker) - waited)
    with watch.stage("write"):
        from taperay.runtime.image import write_png
        write_png(out, rgb)
    con = console()
    for n in notes:
        con.print(n)
    con.print(f"scene:     {args.scene}")
    con.print(f"records:   {len(tape)} instructions, {len(tape.params)} parameters, "
              f"{tape.instance_count} instances")
    con.print(f"walker:    {_walker_label(walker)}")
    con.print(f"image:     {out} ({w}x{h}, {'2d field' if args.two_d else args.view})")
    if getattr(walker, "kernels", None) is not None:
        con.print(f"pipelines: {len(walker.kernels)} GPU pipelines made (of {len(walker.kernels.keys())})")
    con.print(f"timings:   {watch.summary()}")
    if walker.name == "cpu":
        con.print("           (the first run after an install also compiles the CPU twin with Numba; "
                  "later runs load it from the on-disk cache)")
    return 0


def grid_rect(w: int, h: int) -> tuple[float, float, float, float]:
    """The field-image rect whose pixel CENTRES run from -1 to 1 inclusive on both axes (the
    Prospero challenge's grid, ``linspace(-1, 1, n)``): half a sample step beyond [-1, 1]."""
    ex = 1.0 / (w - 1) if w > 1 else 0.0
    ey = 1.0 / (h - 1) if h > 1 else 0.0
    return (-1.0 - ex, 1.0 + ex, -1.0 - ey, 1.0 + ey)


def inside_to_rgb(inside):
    """A 2D program's inside mask (H, W) bool (f < 0; row 0 at the top, y up) -> white on black
    (H, W, 3) uint8."""
    import numpy as np
    inside = np.asarray(inside)
    if inside.ndim != 2:
        raise TaperayError(f"field image has shape {inside.shape}, expected (H, W)")
    return np.repeat((inside.astype(np.uint8) * 255)[:, :, None], 3, axis=2)


# host memory a point takes through eval / grad: the float32 copy, the values, normals and
# gradients written out, the walker's own arrays (bytes, with a margin)
POINT_BYTES = 128


def read_points(path: str):
    """An (N, 3) array of finite real numbers from a .npy file as contiguous float32, or a one-line
    error (the header's shape checked against the file and the memory before anything is read)."""
    import numpy as np
    p = Path(path)
    if not p.is_file():
        raise TaperayError(f"{p}: no such file")
    try:       # (mapped first: a header that declares more rows than the file holds fails here)
        pts = np.load(p, allow_pickle=False, mmap_mode="r")
    except (ValueError, OSError, EOFError) as e:
        raise TaperayError(f"{p}: not a readable .npy array ({_error_line(e)})") from None
    if not isinstance(pts, np.ndarray):
        raise TaperayError(f"{p}: holds an archive, not one (N, 3) array")
    if pts.ndim != 2 or pts.shape[1] != 3:
        raise TaperayError(f"{p}: points must have shape (N, 3), got {pts.shape}")
    if pts.dtype.kind not in "fiu":
        raise TaperayError(f"{p}: points must be real numbers, got dtype {pts.dtype}")
    if len(pts) == 0:
        raise TaperayError(f"{p}: holds no points")
    from taperay.runtime.resources import check_memory
    check_memory(len(pts) * POINT_BYTES, f"{p}: {len(pts):,} points", "split the file")
    pts = np.ascontiguousarray(pts, np.float32)
    bad = ~np.isfinite(pts).all(axis=1)
    if bad.any():
        n = int(bad.sum())
        raise TaperayError(f"{p}: {n:,} point{' is' if n == 1 else 's are'} NaN or infinite (the first in row "
                           f"{int(np.argmax(bad))}); give finite coordinates")
    return pts


def cmd_eval(args) -> int:
    import numpy as np
    from taperay.runtime.walkers import prepare, run_on, walker as choose_walker
    out = _output_path(args.output, args.scene, args.points)
    pts = read_points(args.points)
    prepare(args.walker, progress=True, build_rest=False)    # (the device opens while the scene loads)
    watch = Stopwatch()
    from taperay.runtime import gpu_device
    gpu_device.build_in_background(False)       # one evaluation: only its own pipelines
    tape = apply_sets(load_scene(args.scene, watch), args.set, watch)
    notes: list[str] = []
    with watch.stage("walker"):
        walker = choose_walker(args.walker, log=notes.append, progress=True, step=step)
    waited = _pipeline_seconds(walker)
    with step(f"evaluating {len(pts)} points"), watch.stage("evaluate"):
        walker, (dist, _) = run_on(walker, args.walker, lambda wk: wk.evaluate(tape, pts), log=notes.append)
    _split_pipelines(watch, "evaluate", _pipeline_seconds(walker) - waited)
    values = np.asarray(dist, np.float32).reshape(len(pts))
    with watch.stage("write"):
        write_atomic(out, lambda tmp: np.save(tmp, values))
    con = console()
    for n in notes:
        con.print(n)
    con.print(f"{len(pts)} distances of {args.scene} -> {out} on {_walker_label(walker)}")
    con.print(f"timings:   {watch.summary()}")
    return 0


def cmd_grad(args) -> int:
    import numpy as np
    if Path(args.output).suffix.lower() != ".npz":
        raise UsageError(f"{args.output}: the gradients are written as one .npz file")
    out = _output_path(args.output, args.scene, args.points)
    watch = Stopwatch()
    pts = read_points(args.points)
    tape = apply_sets(load_scene(args.scene, watch), args.set, watch)
    with step(f"differentiating at {len(pts)} points"), watch.stage("gradients"):
        if args.walker == "jax":
            from taperay.runtime.jax_walker import JaxWalker
            g = JaxWalker().value_and_grad(tape, pts)
            value, grad, per_name = g.value, g.dx, g.per_point
        else:
            from taperay.runtime.cpu import CpuWalker
            twin = CpuWalker()
            value, _ = twin.evaluate(tape, pts)
            grad, per_name = twin.gradient(tape, pts), twin.parameter_differences(tape, pts)
    norm = np.linalg.norm(grad, axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        normal = np.where(norm > 0, grad / norm, 0.0).astype(np.float32)
    arrays = {"value": np.asarray(value, np.float32), "normal": normal, "gradient": np.asarray(grad, np.float32)}
    clash = sorted(set(per_name) & set(arrays))
    if clash:
        raise TaperayError(f"{args.scene}: parameter names {clash} clash with the file's own arrays")
    arrays.update({name: np.asarray(v, np.float32) for name, v in per_name.items()})
    with watch.stage("write"):
        write_atomic(out, lambda tmp: np.savez(tmp, **arrays))
    con = console()
    con.print(f"{len(pts)} values, normals and d/d of {len(per_name)} named parameters "
              f"({', '.join(sorted(per_name)) or 'none'}) of {args.scene} -> {out} "
              f"({'JAX, exact' if args.walker == 'jax' else 'CPU twin, central differences'})")
    con.print(f"timings:   {watch.summary()}")
    return 0


def _f32(x) -> float:
    """A float32 as the shortest Python float that reads back to it (0.09, not 0.0900000036)."""
    import numpy as np
    return float(str(np.float32(x)))


def tape_info(tape) -> dict:
    """The numbers ``taperay info`` reports, as plain JSON-able values."""
    return {
        "source": tape.source,
        "records": len(tape),
        "ops": dict(sorted(tape.op_counts().items(), key=lambda kv: -kv[1])),
        "parameters": len(tape.params),
        "named_parameters": {k: _f32(tape.params[v[0]]) for k, v in sorted(tape.names.items())},
        "materials": len(tape.materials),
        "registers": int(tape.n_regs),
        "instances": int(tape.instance_count),
        "bounds": [[_f32(x) for x in corner] for corner in tape.bounds],
        "march_cells": _march_cells_info(tape),
        "instance_lists": _instance_lists_info(tape),
    }


def _instance_lists_info(tape) -> list[dict]:
    """Per INSTANCES record: its record index, instance and BVH node counts, and the bound its walk
    starts from (opcodes.py: a capsule inside the body and a grid of representatives), or why it
    has none."""
    import numpy as np
    from taperay.runtime.opcodes import Op
    out = []
    for i in np.flatnonzero(tape.instrs["op"] == Op.INSTANCES):
        rec = tape.instrs[i]
        prm, first, count = int(rec["param"]), int(rec["aux"]), int(rec["a"])
        nodes = tape.bvh[first:first + count]
        head = tape.params[prm:prm + 20]
        entry = {"record": int(i), "instances": int((nodes["instance"] >= 0).sum()), "bvh_nodes": count}
        if head[12] >= 0:
            dims = [int(v) for v in head[17:20]]
            entry["bound"] = (f"capsule of radius {_f32(head[12]):.4g} inside the body; grid of "
                              f"{dims[0]} x {dims[1]} x {dims[2]} representatives")
        else:
            entry["bound"] = ("none: no capsule inside the body is known (none in its shapes, none proven on "
                              "its lowering to arithmetic, or the tape was flattened unculled): each walk "
                              "starts from +inf")
        out.append(entry)
    return out


def _march_cells_info(tape) -> str:
    """Whether the GPU's render prunes this tape on march cells, and as what: the walkers' own
    decision (GpuWalker.render_tape, cells.cell_tape), with the lowering's reason where it has
    none."""
    from taperay.runtime.gpu import GpuWalker
    from taperay.runtime.lowering import NotLowerable, lower
    from taperay.runtime.cells import LOWER_MAX_RECORDS
    from taperay.runtime.pruning import PRUNE_MIN_RECORDS, is_arithmetic
    if len(tape) < PRUNE_MIN_RECORDS:
        return f"none: fewer than {PRUNE_MIN_RECORDS} records (too short to gain)"
    run = GpuWalker.render_tape(tape)
    if run is not tape:
        return f"its lowering to arithmetic ({len(run)} records, runtime.lowering)"
    if is_arithmetic(tape, fields=True):
        return "the tape itself (arithmetic)"
    if len(tape) > LOWER_MAX_RECORDS:
        return f"none: more than {LOWER_MAX_RECORDS} records (too long to lower on the host)"
    try:                        # (refused by the lowering: its reason)
        lower(tape)
    except NotLowerable as e:
        return f"none: {e}"
    raise AssertionError("cells.cell_tape refused a tape that lowers")


def cmd_info(args) -> int:
    import json
    watch = Stopwatch()
    info = tape_info(load_scene(args.scene, watch))
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    from rich.table import Table
    con = console()
    con.print(f"[bold]{args.scene}[/]: {info['records']} records, {info['instances']} instances, "
              f"{info['parameters']} parameters, {info['materials']} materials, "
              f"{info['registers']} registers")
    lo, hi = info["bounds"]
    con.print("bounds: [" + ", ".join(f"{a:.4g}..{b:.4g}" for a, b in zip(lo, hi)) + "]")
    con.print(f"GPU march cells: {info['march_cells']}")
    for lst in info["instance_lists"]:
        con.print(f"instance list (record {lst['record']}): {lst['instances']} instances, "
                  f"{lst['bvh_nodes']} BVH nodes; bound: {lst['bound']}")
    ops = Table("op", "records", title="records by op", title_justify="left")
    for name, count in info["ops"].items():
        ops.add_row(name, str(count))
    con.print(ops)
    if info["named_parameters"]:
        named = Table("name", "value", title="named parameters", title_justify="left")
        for name, value in info["named_parameters"].items():
            named.add_row(name, f"{value:.6g}")
        con.print(named)
    con.print(f"loaded in {watch.summary()}")
    return 0


def cmd_conform(args) -> int:
    if (args.scene is None) == (args.random is None):
        raise UsageError("conform takes a SCENE or --random N (one of them)")
    if args.random is not None and args.random < 0:
        raise UsageError("--random N needs N >= 0")
    walkers = [w.strip() for w in args.walkers.split(",") if w.strip()] if args.walkers else None
    watch = Stopwatch()
    tape = load_scene(args.scene, watch) if args.scene is not None else None
    from taperay.runtime import conformance
    with step("grading the walkers against the CPU twin"), watch.stage("conform"):
        if tape is not None:
            report = conformance.conform_tape(tape, walkers=walkers, seed=args.seed)
        else:
            report = conformance.conform_random(args.random, walkers=walkers, seed=args.seed)
    con = console()
    if not report.walkers:
        con.print("nothing compared: no walker besides the CPU twin (the reference) is available"
                  + (f" among {args.walkers}" if args.walkers else ""))
        return 0
    con.print(report.table())
    for line in report.failures():
        con.print(f"[red]failed:[/] {line}")
    verdict = "[green]PASS[/]: every tolerance held" if report.passed else "[bold red]FAIL[/]: tolerances broken"
    con.print(f"{verdict} (walkers {', '.join(report.walkers)} vs cpu; {watch.summary()})")
    return 0 if report.passed else 1


def _sim_walker(args, notes: list[str], watch: Stopwatch):
    from taperay.runtime.walkers import walker as choose_walker
    with watch.stage("walker"):
        return choose_walker(args.walker, log=notes.append, progress=True, step=step)


def cmd_mesh(args) -> int:
    from taperay.solvers import check_resolution, mesh_surface
    watch = Stopwatch()
    if Path(args.output).suffix.lower() not in MESH_SUFFIXES:
        raise UsageError(f"{args.output}: a surface mesh is written as one of {', '.join(MESH_SUFFIXES)}")
    out = _output_path(args.output, args.scene)
    check_resolution(args.resolution, what="--resolution")
    tape = apply_sets(load_scene(args.scene, watch), args.set, watch)
    check_resolution(args.resolution, tape, method=args.method, what="--resolution")
    notes: list[str] = []
    walker = _sim_walker(args, notes, watch)
    with step(f"surface at resolution {args.resolution} ({args.method})"), watch.stage("surface"), \
            _errors_of(Path(args.scene)):
        surface = mesh_surface(tape, args.resolution, walker, method=args.method)
    with watch.stage("write"):
        surface.save(out)
    con = console()
    for n in notes:
        con.print(n)
    s = surface.summary()
    con.print(f"surface:   {s['triangles']:,} triangles, {'watertight' if s['watertight'] else 'NOT watertight'}, "
              f"volume {s['volume']:.6g}, area {s['area']:.6g} -> {out} on {_walker_label(walker)}")
    con.print(f"vertices:  {s['vertices']:,} by {'dual contouring' if args.method == 'dc' else 'marching cubes'}, "
              f"max distance to the surface {s['max_vertex_distance']:.3g} ({s['max_vertex_distance'] / s['spacing']:.3g} cells)")
    con.print(f"timings:   {watch.summary()}")
    return 0


def cmd_simulate(args) -> int:
    import json
    from taperay.scenegraph import flatten
    from taperay.scenegraph.loading import scene_namespace
    from taperay.solvers import check_resolution, check_study, simulate, simulate_petsc
    from taperay.solvers.tetmesh import SURFACE_NAMES
    watch = Stopwatch()
    path = Path(args.scene)
    if path.suffix.lower() != ".py" or not path.is_file():
        raise UsageError(f"{path}: simulate needs a Python scene file that declares `study` beside `scene`")
    section_plane = _section_plane(args.section_plane)
    if args.section_plane and not args.section:
        raise UsageError("--section-plane places the cut of --section: add --section CUT.png")
    if not args.mesh:
        check_resolution(args.resolution, what="--resolution")      # (the bounds and the memory once loaded)
    outputs = _simulate_outputs(args)
    with watch.stage("load"):
        node, ns = scene_namespace(path)
    if "study" not in ns:
        raise TaperayError(f"{path}: declares no `study` (e.g. study = Heat(conductivity=..., convection={{...}}))")
    with watch.stage("flatten/validate"):
        tape = flatten(node, source=str(path))
    apply_sets(tape, args.set, watch)
    try:
        study = check_study(tape, ns["study"])
    except TaperayError as e:
        raise TaperayError(f"{path}: study: {e}") from None
    if not args.mesh:
        check_resolution(args.resolution, tape, method=args.surface, study=study, order=args.order, what="--resolution")
    if args.solver == "petsc":
        from taperay.solvers.distributed import mpi_rank
        if mpi_rank() != 0:   # a helper rank of mpiexec: it assembles and solves its rows, rank 0 reports
            try:
                simulate_petsc(tape, study, order=args.order, resolution=args.resolution, surface=args.surface)
            except TaperayError:      # raised on every rank alike (distributed._agree): rank 0 prints it
                return 2
            return 0
    mesh = _given_mesh(args, watch)
    out = outputs["output"]
    notes: list[str] = []
    walker = _sim_walker(args, notes, watch)
    con = console()
    for n in notes:
        con.print(n)
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    stages = (["surface", "tets"] if mesh is None else []) + ["assembly", "solve"]
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console(stderr=True), transient=True) as bar:
        task = bar.add_task(f"{study.kind}: {stages[0]}", total=None)

        def progress(stage, seconds):
            con.print(f"  {stage:<9} {_fmt_seconds(seconds)}")
            following = stages[stages.index(stage) + 1:] if stage in stages else []
            bar.update(task, description=f"{study.kind}: {following[0] if following else 'done'}")

        with watch.stage("simulate"), _errors_of(path):
            if args.solver == "petsc":
                result = simulate_petsc(tape, study, order=args.order, resolution=args.resolution, walker=walker,
                                        progress=progress, mesh=mesh, surface=args.surface)
            else:
                result = simulate(tape, study, order=args.order, resolution=args.resolution, walker=walker,
                                  progress=progress, solver=args.solver, mesh=mesh, surface=args.surface)
    with watch.stage("write"):
        result.save_vtu(out)
        summary = result.summary()
        if args.json:
            write_text(outputs["json"], json.dumps(summary, indent=2, default=float) + "\n")
        if args.section:
            cut = result.save_section(outputs["section"], *section_plane)
    ranks = f" on {summary['ranks']} MPI rank{'s' if summary.get('ranks') != 1 else ''}" if "ranks" in summary else ""
    con.print(f"mesh:      {summary['nodes']:,} nodes, {summary['elements']:,} TET{4 if summary['order'] == 1 else 10}, "
              f"{summary['dof']:,} DOF, solver {summary['solver']}{ranks} ({summary['iterations']} iterations)")
    if summary.get("solver_note"):
        con.print(f"solver:    {summary['solver_note']}", markup=False)
    surf = result.surface_stats
    if surf:
        how = SURFACE_NAMES.get(surf.get("method"), str(surf.get("method")))
        grid = f" at resolution {surf['resolution']}" if surf.get("resolution") not in (None, args.resolution) else ""
        con.print(f"surface:   {how}{grid}, {surf['triangles']:,} triangles, volume {surf['volume']:.6g}"
                  + (f" (tried first: {surf['fallback']})" if "fallback" in surf else ""),
                  markup=False)
    if study.kind == "heat":
        con.print(f"result:    temperature max {summary['max_temperature']:.4g}, mean {summary['mean_temperature']:.4g}, "
                  f"min {summary['min_temperature']:.4g} -> {out}")
    else:
        con.print(f"result:    max displacement {summary['max_displacement']:.4g}, max von Mises "
                  f"{summary['max_von_mises']:.4g} -> {out}")
    b, q = summary["boundary"], summary["quality"]
    if b is None:
        con.print("boundary:  not measured against the scene")
    else:
        worst = f", the farthest node {b['worst_node']['node']}" if b["off_zero_set"] else ""
        faces = ", ".join(f"{name} {n:,}" for name, n in sorted(b["faces"].items()))
        con.print(f"boundary:  {b['nodes']:,} nodes, at most {b['max_distance']:.3g} ({b['max_distance_cells']:.3g} cells) "
                  f"from the zero set, {b['off_zero_set']:,} off it{worst}; faces: {faces}", markup=False)
    con.print(f"quality:   dihedral angles {q['min_dihedral']:.3g} to {q['max_dihedral']:.4g} degrees, "
              f"{q['below_5_degrees']:,} elements below 5")
    for line in summary["warnings"]:
        con.print(f"warning:   {line}", markup=False)
    if args.section:
        con.print(f"section:   {'xyz'[cut.axis]} = {cut.offset:.4g}, {len(cut.values):,} triangles -> {args.section}")
    con.print(f"timings:   {watch.summary()}")
    return 0


def _simulate_outputs(args) -> dict[str, Path]:
    """``simulate``'s outputs checked before any work: the result in a format meshio writes, the
    JSON summary and the section picture, none of them an input or another of them."""
    import meshio
    suffix = Path(args.output).suffix.lower()
    if suffix not in meshio.extension_to_filetypes:
        raise UsageError(f"{args.output}: the result is written by meshio, which knows no {suffix or 'suffix-less'} "
                         "files; give e.g. result.vtu (ParaView)")
    if args.section and Path(args.section).suffix.lower() != ".png":
        raise UsageError(f"{args.section}: the section picture is written as a .png file")
    inputs = [args.scene, args.mesh]
    named = {"output": args.output, "json": args.json, "section": args.section}
    outputs = {}
    for key, given in named.items():
        if given:
            outputs[key] = _output_path(given, *inputs)
            inputs.append(given)      # (two outputs may not be one file)
    return outputs


@contextlib.contextmanager
def _errors_of(path: Path):
    """A user error raised inside names ``path`` first (the scene it came from)."""
    try:
        yield
    except TaperayError as e:
        if str(e).startswith(str(path)):
            raise
        raise TaperayError(f"{path}: {e}") from None


def _given_mesh(args, watch):
    """``--mesh``: the tetrahedral mesh to solve on (its order must agree with ``--order``), else None."""
    if not args.mesh:
        return None
    from taperay.solvers import TetMesh
    path = Path(args.mesh)
    if not path.is_file():
        raise UsageError(f"{path}: no such mesh file")
    with watch.stage("read mesh"):
        mesh = TetMesh.load(path)
    if args.order and args.order != mesh.order:
        raise UsageError(f"{path}: holds TET{4 if mesh.order == 1 else 10} elements, but --order {args.order} was given")
    return mesh


def _section_plane(text: str | None) -> tuple[str | None, float | None]:
    """``--section-plane``: "y" or "y=0.01" -> (axis, offset); None -> (None, None)."""
    if not text:
        return None, None
    axis, _, value = text.partition("=")
    if axis.strip().lower() not in ("x", "y", "z"):
        raise UsageError(f"--section-plane {text!r}: the axis is x, y or z (e.g. y or y=0.01)")
    try:
        return axis.strip().lower(), (float(value) if value.strip() else None)
    except ValueError:
        raise UsageError(f"--section-plane {text!r}: {value!r} is not a number") from None


def cmd_optimize(args) -> int:
    from taperay.solvers.optimize import render_designs, run_optimize
    from taperay.solvers.objectives import OBJECTIVES
    watch = Stopwatch()
    if args.objective not in OBJECTIVES:
        raise UsageError(f"--objective {args.objective!r}: choose from {', '.join(sorted(OBJECTIVES))}")
    if args.max_steps < 1:
        raise UsageError(f"--max-steps {args.max_steps}: give 1 or more optimiser iterations")
    from taperay.solvers import check_resolution
    check_resolution(args.resolution, what="--resolution")   # (each design's simulate checks its memory)
    out = _output_path(args.output, args.scene)
    if out.suffix.lower() != ".scene":
        raise UsageError(f"{out}: the optimised design is written as a .scene file")
    image_paths = {label: out.with_name(f"{out.stem}-{label}.png") for label in ("first", "best")} if args.images else {}
    for path in image_paths.values():
        _output_path(str(path), args.scene, args.json, args.plot)
    con = console()
    finished = []

    def progress(record):
        finished.append(record["step"])
        cons = "; ".join(f"{c['name']} {c['value']:.4g} {c['op']} {c['bound']:.4g}" for c in record["constraints"])
        con.print(f"  design {record['step']:>2}: {args.objective} {record['objective']:.6g}"
                  + (f", {cons}" if cons else "") + f", |gradient| {record['gradient_norm']:.3g}, "
                  f"{record['seconds']:.1f} s" + ("" if record["feasible"] else " (infeasible)"))

    try:
        with watch.stage("optimize"):
            res = run_optimize(args.scene, objective=args.objective, constraint=args.constraint, bounds=args.bounds,
                               max_steps=args.max_steps, out_scene=out, history_json=args.json, plot_png=args.plot,
                               progress=progress, resolution=args.resolution, order=args.order, surface=args.surface)
    except KeyboardInterrupt:
        if finished:
            kept = ", ".join(str(p) for p in (out, args.json, args.plot) if p)
            con.print(f"interrupted after {len(finished)} designs: kept the best so far and the history ({kept})")
        raise
    images = []
    if image_paths:
        from taperay.runtime.walkers import walker as choose_walker
        from taperay.scenegraph.files import load_scene_file
        with watch.stage("images"):
            images = render_designs(load_scene_file(out), res, image_paths, choose_walker("auto"))
    con.print(f"{args.objective}: {res.initial_value:.6g} -> {res.best_value:.6g} in {len(res.history)} designs "
              f"({res.method}, {'converged' if res.success else res.message})")
    con.print("best:      " + ", ".join(f"{k} = {v:.6g}" for k, v in res.best.items()) + f" -> {out}"
              + ("" if res.best_feasible else " (infeasible: no design met the constraints; the least violating)"))
    for extra in [args.json, args.plot, *images]:
        if extra:
            con.print(f"wrote:     {extra}")
    con.print(f"timings:   {watch.summary()}")
    return 0


def cmd_view(args) -> int:
    w, h = parse_size(args.size)
    check_cone(args.cone)
    if args.edits < 0 or args.topology_edits < 0:
        raise UsageError("--edits and --topology-edits count edits: give numbers >= 0")
    if (args.edits or args.topology_edits or args.json or args.screenshot) and not args.offscreen:
        raise UsageError("--edits, --topology-edits, --json and --screenshot draw offscreen: add --offscreen")
    screenshot = _output_path(args.screenshot, args.scene) if args.screenshot else None
    report_json = _output_path(args.json, args.scene, args.screenshot) if args.json else None
    from taperay.runtime.walkers import prepare, walker as choose_walker
    prepare(args.walker)        # (the device opens while the viewer's modules import and the scene loads)
    from .view_window import offscreen_window, open_window, run_offscreen_edits
    from .viewer import Viewer
    con = console()

    def make_viewer():
        notes: list[str] = []
        viewer = Viewer(args.scene, walker=choose_walker(args.walker, log=notes.append), size=(w, h),
                        view=args.view, cone=args.cone)
        for n in notes:
            con.print(n)
        con.print(f"viewer:    {args.scene} on the {_walker_label(viewer.walker)} walker")
        if not args.offscreen:
            con.print("viewer:    drag to orbit, shift-drag to pan, wheel to zoom, ctrl-z / ctrl-y to undo / redo")
        return viewer

    if not args.offscreen:
        open_window(make_viewer, Path(args.scene).name, (w, h), watch=args.watch)
        return 0
    window = offscreen_window(make_viewer(), watch=args.watch)

    def progress(i, n, row):
        con.print(f"edit {i}/{n}: {row['edit']:<34} {row['latency_ms']:8.1f} ms  "
                  f"(edit {row['edit_ms']:.1f} ms, frame {row['frame_ms']:.1f} ms, "
                  f"pipelines created {row['pipelines_created']})")

    report = run_offscreen_edits(window, args.edits, args.topology_edits, progress=progress)
    report["scene"] = args.scene
    if args.screenshot:
        import numpy as np
        from taperay.runtime.image import write_png
        write_png(screenshot, np.asarray(window.canvas.draw())[..., :3])
        con.print(f"screenshot: {args.screenshot}")
    if args.json:
        import json
        write_text(report_json, json.dumps(report, indent=1))
        con.print(f"json:      {args.json}")
    con.print(_view_summary(report))
    return 0


def _view_summary(report: dict) -> str:
    """One line per edit kind: the median latency (and its edit's and frame's), the worst, and
    the pipelines the edits created."""
    import numpy as np
    lines = [f"startup:   first frame {report['startup']['first_frame_ms']:.1f} ms, "
             f"{report['startup']['pipelines_created']} pipelines created"]
    for kind in ("slider", "topology"):
        rows = [r for r in report["edits"] if r["kind"] == kind]
        if rows:
            lat = np.array([r["latency_ms"] for r in rows])
            lines.append(f"{kind + ':':<10} {len(rows)} edits, edit -> frame median {np.median(lat):.1f} ms "
                         f"(the edit {np.median([r['edit_ms'] for r in rows]):.1f}, the frame "
                         f"{np.median([r['frame_ms'] for r in rows]):.1f}), max {lat.max():.1f} ms; "
                         f"pipelines created {sum(r['pipelines_created'] for r in rows)}")
    return "\n".join(lines)


def cmd_bench(args) -> int:
    from . import bench
    return bench.run(args)


# ---------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="taperay", description="3D scenes as records: render, evaluate and "
                     "check tapes on the CPU twin or the GPU.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    def walker_arg(p):
        p.add_argument("--walker", choices=WALKERS, default="auto",
                       help="auto (default): the GPU when a hardware adapter exists and passes its "
                       "self-check against the CPU twin, else the CPU twin; gpu also takes a software "
                       "adapter (Mesa lavapipe)")

    def surface_arg(p, what):
        p.add_argument("--surface", choices=("auto", "dc", "mc"), default="auto",
                       help=f"the surface TetGen fills for {what}: auto (default): dual contouring (sharp edges kept, "
                            "its triangles kept as the boundary), and marching cubes where TetGen fails on it; "
                            "dc: dual contouring alone; mc: marching cubes alone")

    def set_arg(p):
        p.add_argument("--set", action="append", metavar="NAME=VALUE",
                       help="set a named parameter before the work (repeatable)")

    p = sub.add_parser("render", help="render a scene to a PNG")
    p.add_argument("scene", metavar="SCENE", help="a scene .py (exposing `scene`), .scene, .tape or .vm file")
    p.add_argument("-o", "--output", required=True, metavar="OUT.png")
    walker_arg(p)
    set_arg(p)
    p.add_argument("--size", default="800x600", metavar="WxH", help="image size, WxH or N for NxN (default 800x600)")
    p.add_argument("--view", choices=(*VIEWS, "path"), default="shade",
                   help="what to draw (path: the path tracer, runtime/path_tracing.py, with --spp samples)")
    p.add_argument("--spp", type=int, default=16, metavar="N",
                   help="--view path: samples per pixel (default 16)")
    p.add_argument("--environment", metavar="R,G,B|FILE",
                   help="--view path: the environment's radiance, linear R,G,B, or an equirectangular .hdr / "
                   ".pfm map, z up (default 1,1,1)")
    p.add_argument("--max-bounces", type=int, metavar="N", help="--view path: hits after which a path ends (default 8)")
    p.add_argument("--2d", dest="two_d", action="store_true",
                   help="draw the field image of a 2D program: inside (f<0) white on black, x,y in [-1,1], y up")
    p.add_argument("--cone", type=float, default=0.0, metavar="PIXELS",
                   help="cone marching: a primary ray ends where the field is below PIXELS pixels' footprint "
                   "(RenderSettings.hit_cone), so thin and sub-pixel parts cost fewer steps (default 0: hit_eps)")
    p.set_defaults(func=cmd_render)

    p = sub.add_parser("eval", help="evaluate distances at points")
    p.add_argument("scene", metavar="SCENE")
    p.add_argument("points", metavar="POINTS.npy", help="an (N, 3) float array")
    p.add_argument("-o", "--output", required=True, metavar="VALUES.npy", help="(N,) float32 distances")
    walker_arg(p)
    set_arg(p)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("grad", help="values, normals and derivatives w.r.t. named parameters at points")
    p.add_argument("scene", metavar="SCENE")
    p.add_argument("points", metavar="POINTS.npy", help="an (N, 3) float array")
    p.add_argument("-o", "--output", required=True, metavar="GRADS.npz",
                   help="value (N,), normal (N, 3), gradient (N, 3) and one (N,) array per named parameter")
    p.add_argument("--walker", choices=("jax", "cpu"), default="jax",
                   help="jax (default): exact derivatives; cpu: the twin's central differences")
    set_arg(p)
    p.set_defaults(func=cmd_grad)

    p = sub.add_parser("info", help="records, parameters, bounds and instances of a scene")
    p.add_argument("scene", metavar="SCENE")
    p.add_argument("--json", action="store_true", help="print a JSON object")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("conform", help="run a scene or random tapes on every walker and compare")
    p.add_argument("scene", metavar="SCENE", nargs="?")
    p.add_argument("--random", type=int, metavar="N", help="N random tapes instead of a scene")
    p.add_argument("--seed", type=int, default=0, help="seed for --random")
    p.add_argument("--walkers", metavar="LIST", help="comma-separated walkers (default: every available one)")
    p.set_defaults(func=cmd_conform)

    p = sub.add_parser("mesh", help="extract a watertight surface mesh of a scene")
    p.add_argument("scene", metavar="SCENE")
    p.add_argument("-o", "--output", required=True, metavar="PART.stl", help="stl, obj, ply, glb or off")
    p.add_argument("--resolution", type=int, default=96, help="grid cells along the longest side (default 96)")
    p.add_argument("--method", choices=("dc", "mc"), default="dc",
                   help="dc: dual contouring, sharp edges kept (default); mc: marching cubes + projection")
    walker_arg(p)
    set_arg(p)
    p.set_defaults(func=cmd_mesh)

    p = sub.add_parser("simulate", help="solve the heat or elasticity study a scene declares")
    p.add_argument("scene", metavar="SCENE.py", help="a Python scene declaring `study` beside `scene`")
    p.add_argument("-o", "--output", required=True, metavar="RESULT.vtu", help="the mesh and its fields (ParaView)")
    p.add_argument("--json", metavar="SUMMARY.json", help="write the summary as JSON")
    p.add_argument("--order", type=int, choices=(1, 2), help="TET4 (1) or TET10 (2); default: 1 for heat, 2 for elasticity")
    p.add_argument("--resolution", type=int, default=96, help="surface grid cells along the longest side (default 96)")
    surface_arg(p, "the study")
    p.add_argument("--mesh", metavar="MESH.vtu", help="solve on this tetrahedral mesh (tetra / tetra10 cells, any "
                   "format meshio reads, e.g. an earlier result.vtu) instead of meshing the scene")
    p.add_argument("--solver", choices=("auto", "direct", "amg", "petsc"), default="auto",
                   help="auto (default): a direct solve up to 20,000 unknowns, CG with pyamg above; "
                        "petsc: CG + GAMG over MPI ranks (mpiexec -n N taperay simulate ...; README: PETSc and MPI)")
    p.add_argument("--section", metavar="SECTION.png",
                   help="a picture of the temperature / von Mises stress on a planar cut, with a colour bar")
    p.add_argument("--section-plane", metavar="AXIS[=VALUE]",
                   help="the cut: x, y or z, at VALUE (default: the middle); default: the axis whose cut is largest")
    walker_arg(p)
    set_arg(p)
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("view", help="open a scene in the live viewer (sliders, views, undo, watch mode)")
    p.add_argument("scene", metavar="SCENE", help="a scene .py (exposing `scene`), .scene, .tape or .vm file")
    walker_arg(p)
    p.add_argument("--size", default="1280x720", metavar="WxH", help="frame size (default 1280x720)")
    p.add_argument("--view", choices=(*VIEWS, "path"), default="shade",
                   help="path: progressive path tracing, refined while the camera is still")
    p.add_argument("--watch", action="store_true",
                   help="re-run the scene .py file in a child process on each save; an error leaves the last "
                   "good scene on screen")
    p.add_argument("--cone", type=float, default=VIEW_CONE_PIXELS, metavar="PIXELS",
                   help="cone marching: a primary ray ends where the field is below PIXELS pixels' footprint "
                   f"(RenderSettings.hit_cone; default {VIEW_CONE_PIXELS:g}; 0: at hit_eps, as `taperay render` draws; "
                   "drafts at least one of their pixels)")
    p.add_argument("--offscreen", action="store_true", help="draw the same frames without a window (scripts, tests)")
    p.add_argument("--edits", type=int, default=0, metavar="N", help="offscreen: N scripted slider moves")
    p.add_argument("--topology-edits", type=int, default=0, metavar="M",
                   help="offscreen: M scripted scene edits (a row of 10 to 100,000 spheres added, cut, removed)")
    p.add_argument("--json", metavar="OUT.json", help="offscreen: per-edit latencies and pipeline creations")
    p.add_argument("--screenshot", metavar="OUT.png", help="offscreen: the last frame with its panel")
    p.set_defaults(func=cmd_view)

    p = sub.add_parser("optimize", help="optimise a scene's named parameters for its study")
    p.add_argument("scene", metavar="SCENE", help="a Python scene declaring `study` (a .scene for the volume and mass objectives)")
    p.add_argument("--objective", required=True, help="max_temperature, mean_temperature, compliance, "
                   "max_von_mises, volume or mass")
    p.add_argument("--constraint", action="append", metavar="EXPR",
                   help="e.g. 'volume<=initial', 'mass<=0.2', 'volume<=95%%' (repeatable)")
    p.add_argument("--bounds", action="append", metavar="NAME=LO:HI",
                   help="a parameter's range (repeatable; default 0.5x..1.5x its value)")
    p.add_argument("--max-steps", type=int, default=20, help="optimiser iterations at most (default 20)")
    p.add_argument("--resolution", type=int, default=48, help="surface grid cells along the longest side (default 48)")
    p.add_argument("--order", type=int, choices=(1, 2), help="TET4 (1) or TET10 (2)")
    surface_arg(p, "every design")
    p.add_argument("-o", "--output", required=True, metavar="BEST.scene", help="the optimised scene")
    p.add_argument("--json", metavar="HISTORY.json", help="every design's parameters, values and gradients")
    p.add_argument("--plot", metavar="HISTORY.png", help="the convergence plot")
    p.add_argument("--images", action="store_true",
                   help="also render the first and the best design beside the output (NAME-first.png, NAME-best.png)")
    p.set_defaults(func=cmd_optimize)

    from . import bench
    bench.add_parser(sub, cmd_bench)
    return parser


def _version() -> str:
    from taperay import __version__
    return f"taperay {__version__}"


def _error_line(e: BaseException) -> str:
    """The error as one line (driver messages span several)."""
    text = f"{e.filename}: {e.strerror or e}" if isinstance(e, OSError) and e.filename is not None else str(e)
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 a check failed, 2 a user error,
    130 interrupted)."""
    _made_folders.clear()
    code = 2
    try:
        args = build_parser().parse_args(argv)
        code = args.func(args)
        return code
    except KeyboardInterrupt:
        code = 130
        return code
    except BrokenPipeError:      # (the reader left early: `taperay info --json | head`); as SIGPIPE would
        _silence_stdout()
        code = 141
        return code
    except (TaperayError, OSError) as e:
        print(f"taperay: error: {_error_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:  # a bug, not the user's fault: still one line unless asked for more
        if os.environ.get("TAPERAY_DEBUG"):
            raise
        print(f"taperay: error: internal error: {type(e).__name__}: {_error_line(e)} "
              "(set TAPERAY_DEBUG=1 for the traceback)", file=sys.stderr)
        return 2
    finally:
        if code != 0:
            _remove_made_folders()


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that flushing what is left of it fails no more."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def run() -> None:
    """The ``taperay`` console script: ``main()``, then, once the standard streams are flushed,
    exit without the interpreter's teardown (freeing every module, Numba's and LLVM's among them,
    and the GPU device: about 0.3 s that the operating system does at exit anyway). A process that
    used MPI (``simulate --solver petsc``) exits the usual way: MPI must be finalised."""
    code = main()
    if "mpi4py.MPI" in sys.modules:
        sys.exit(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:          # (a reader that left early: `taperay ... | head`)
            pass
    os._exit(code)


if __name__ == "__main__":
    run()
