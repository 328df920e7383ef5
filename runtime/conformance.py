"""Conformance: every available walker graded against the CPU twin, per op and per scene.

Owns the tolerance table (``TOLERANCES``, each op's ``OpSpec.tolerance`` from runtime.opcodes: a few
ULP for exactly-rounded ops, WGSL's stated accuracy for sqrt / exp / sin / atan ...), the seeded generator of random valid tapes over every op
(``op_tape`` one per op, ``random_tape`` composite scenes, ``wide_tape`` for the large register
variants), the measurements (max abs / rel error, ULP histogram, material mismatches, hit-mask
disagreement, rays that graze the surface aside (``grazing_pixels``), depth error where both hit,
first differing point / pixel and the first top-level record whose value differs there) and
``ConformanceReport`` (``.passed``, ``.table()`` for rich), and the GPU's self-check against the
twin (``gpu_self_check``) that ``taperay.runtime.walkers.walker("auto")`` runs before it trusts a GPU.

    conform_tape(tape)              one scene on every walker
    conform_random(n, seed=0)       one tape per op + n random scenes + a wide-register tape
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .camera import auto_camera
from .cpu import CpuWalker
from .opcodes import OPS, REG_CAPS, Family, Op, Tolerance
from .pruning import ray_slabs
from .shading import RenderSettings, unpack
from .tape import BVH_DTYPE, INSTANCE_DTYPE, INSTR_DTYPE, MATERIAL_DTYPE, Tape, TapeError, TaperayError, validate

__all__ = ["Tolerance", "TOLERANCES", "ConformanceReport", "OpResult", "SceneResult", "conform_tape",
           "conform_random", "tape_tolerance", "scene_tolerance", "within_tolerance", "op_tape", "random_tape", "wide_tape", "reference_tape", "available_walkers",
           "compare_images", "ulp_distance", "ULP_BINS", "grazing_pixels", "SelfCheck", "gpu_self_check",
           "sample_points", "random_materials", "TapeBuilder"]


# ----------------------------------------------------------------------------------- tolerances
# each op's tolerance is in its table entry (OpSpec.tolerance: WGSL's stated accuracy)
TOLERANCES: dict[Op, Tolerance] = {op: spec.tolerance for op, spec in OPS.items()}
SCENE_PROPAGATION = 4.0   # a composite tape may compound its ops' errors: tolerance x this factor
HIT_MASK_MAX = 0.001      # fraction of pixels whose hit / miss may differ (issue 3: at most 0.1 %),
                          # grazing rays aside (grazing_pixels)
GRAZING_SPACING = 0.25    # grazing_pixels samples a ray every GRAZING_SPACING * hit_eps
GRAZING_MAX_PIXELS = 64   # hit mismatches of a scene examined for grazing rays (more: all count)
DEPTH_TOL_EPS = 4.0       # depth error where both hit, in units of the march's hit_eps
MATERIAL_MAX = 0.01       # fraction of points whose material may differ (ties decided by rounding)
ULP_BINS = (0, 1, 2, 4, 16, 256, 4096, 1 << 20)   # histogram edges: [0], [1], [2, 3], [4, 15], ...


def tape_tolerance(tape: Tape, propagation: float = 1.0) -> Tolerance:
    """The largest tolerance of the ops a tape uses, times ``propagation`` (a one-op tape: 1; a
    composite scene, whose ops compound their errors: SCENE_PROPAGATION)."""
    ops = [Op(int(o)) for o in np.unique(tape.instrs["op"])]
    return Tolerance(propagation * max(TOLERANCES[o].ulps for o in ops),
                     propagation * max(TOLERANCES[o].abs_rel for o in ops),
                     f"largest tolerance of its ops x {propagation:g}")


def scene_tolerance(tape: Tape) -> Tolerance:
    return tape_tolerance(tape, SCENE_PROPAGATION)


# ----------------------------------------------------------------------------------- measures
def _ordered(x: np.ndarray) -> np.ndarray:
    """float32 -> int64 keys whose differences count representable floats between values."""
    i = np.asarray(x, np.float32).view(np.int32).astype(np.int64)
    return np.where(i < 0, -(i & 0x7FFFFFFF), i)


def ulp_distance(a, b) -> np.ndarray:
    """Floats between a and b (0 when equal, both NaN, or equal infinities; huge when one is NaN)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    d = np.abs(_ordered(a) - _ordered(b))
    na, nb = np.isnan(a), np.isnan(b)
    return np.where(na & nb, 0, np.where(na | nb, 1 << 40, d))


def _ulp_of(x: np.ndarray) -> np.ndarray:
    x = np.abs(np.asarray(x, np.float32))
    return np.spacing(np.where(np.isfinite(x), x, np.float32(0)), dtype=np.float32).astype(np.float64)


def within_tolerance(ref: np.ndarray, got: np.ndarray, tol: Tolerance, scale: float) -> np.ndarray:
    """Per value: equal (NaN counts as equal to NaN), or within ``tol`` at input magnitude ``scale``."""
    ref64, got64 = ref.astype(np.float64), got.astype(np.float64)
    same = (ref == got) | (np.isnan(ref) & np.isnan(got))
    with np.errstate(invalid="ignore"):
        err = np.abs(ref64 - got64)
        ok = err <= np.maximum(tol.ulps * _ulp_of(ref), tol.abs_rel * scale)
    return same | (ok & np.isfinite(err))


def _histogram(ulps: np.ndarray) -> list[int]:
    edges = list(ULP_BINS) + [1 << 62]
    return [int(np.count_nonzero((ulps >= lo) & (ulps < hi))) for lo, hi in zip(edges[:-1], edges[1:])]


def _errors(ref: np.ndarray, got: np.ndarray) -> tuple[float, float]:
    fin = np.isfinite(ref) & np.isfinite(got)
    if not fin.any():
        return 0.0, 0.0
    e = np.abs(ref[fin].astype(np.float64) - got[fin].astype(np.float64))
    rel = e / np.maximum(np.abs(ref[fin].astype(np.float64)), 1e-30)
    return float(e.max()), float(rel.max())


def compare_images(ref: np.ndarray, got: np.ndarray, levels: int) -> dict:
    """8-bit images: fraction of pixels differing by more than ``levels``, the max difference and
    the first such pixel (row, col)."""
    d = np.abs(ref.astype(np.int32) - got.astype(np.int32)).max(axis=-1)
    bad = d > levels
    first = np.argwhere(bad)
    return dict(mismatch_fraction=float(bad.mean()), max_level_difference=int(d.max(initial=0)),
                first_pixel=tuple(int(v) for v in first[0]) if len(first) else None)


# ----------------------------------------------------------------------------------- results
@dataclass
class OpResult:
    """One op's tape (or a scene's points) on one walker against the twin."""
    name: str
    walker: str
    points: int
    max_abs: float
    max_rel: float
    ulp_hist: list[int]
    material_mismatch: float
    tolerance: Tolerance
    failing: int                      # points outside the tolerance
    first_point: int | None           # index of the first failing point
    first_record: int | None = None   # first top-level record differing at that point
    error: str | None = None          # the walker raised instead of answering

    @property
    def passed(self) -> bool:
        return self.error is None and self.failing == 0 and self.material_mismatch <= MATERIAL_MAX


@dataclass
class SceneResult:
    """A scene: its point evaluation plus a small march image against the twin's."""
    field: OpResult
    pixels: int
    hit_mismatch: float               # fraction of pixels whose hit / miss differs, grazing rays aside
    depth_max_err: float
    depth_tol: float
    first_pixel: tuple[int, int] | None
    grazing: int = 0                  # pixels whose hit / miss differs on a grazing ray (grazing_pixels)

    @property
    def passed(self) -> bool:
        return (self.field.passed and self.hit_mismatch <= HIT_MASK_MAX
                and self.depth_max_err <= self.depth_tol)


@dataclass
class ConformanceReport:
    ops: list[OpResult] = field(default_factory=list)
    scenes: list[SceneResult] = field(default_factory=list)
    walkers: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.ops) and all(s.passed for s in self.scenes)

    def failures(self) -> list[str]:
        out = [f"op {r.name} on {r.walker}: {r.error or f'{r.failing} points beyond tolerance'}"
               for r in self.ops if not r.passed]
        out += [f"scene {s.field.name} on {s.field.walker}" for s in self.scenes if not s.passed]
        return out

    def table(self):
        """rich renderables: a per-op table and a per-scene table."""
        from rich.console import Group
        from rich.table import Table
        hist_head = " ".join(_bin_label(i) for i in range(len(ULP_BINS)))
        ops = Table(title=f"per op (walkers {', '.join(self.walkers) or 'none besides cpu'} vs cpu)")
        for col in ("op", "walker", "pts", "max abs", "max rel", f"ULP histogram ({hist_head})",
                    "mat", "tolerance", "first point / record", "ok"):
            ops.add_column(col, justify="right" if col not in ("op", "walker", "tolerance") else "left")
        for r in self.ops:
            ops.add_row(*_op_cells(r))
        scenes = Table(title="per scene")
        for col in ("scene", "walker", "pts", "max abs", f"ULP histogram ({hist_head})", "hit mask diff",
                    "depth err / tol", "first point / record", "first pixel", "ok"):
            scenes.add_column(col, justify="left" if col in ("scene", "walker") else "right")
        for s in self.scenes:
            c = _op_cells(s.field)
            scenes.add_row(c[0], c[1], c[2], c[3], c[5],
                           f"{100 * s.hit_mismatch:.2f}%" + (f" (+{s.grazing} grazing)" if s.grazing else ""),
                           f"{s.depth_max_err:.2e} / {s.depth_tol:.1e}", c[8],
                           "-" if s.first_pixel is None else f"{s.first_pixel}", _ok(s.passed))
        return Group(ops, scenes)


def _bin_label(i: int) -> str:
    lo = ULP_BINS[i]
    hi = ULP_BINS[i + 1] - 1 if i + 1 < len(ULP_BINS) else None
    return f"{lo}" if hi == lo else (f"{lo}-{hi}" if hi is not None else f">={lo}")


def _ok(passed: bool) -> str:
    return "[green]yes[/]" if passed else "[bold red]NO[/]"


def _op_cells(r: OpResult) -> list[str]:
    first = "-" if r.first_point is None else (
        f"pt {r.first_point}" + ("" if r.first_record is None else f" / rec {r.first_record}"))
    if r.error:
        return [r.name, r.walker, str(r.points), "-", "-", r.error[:60], "-", "-", "-", _ok(False)]
    return [r.name, r.walker, str(r.points), f"{r.max_abs:.2e}", f"{r.max_rel:.2e}",
            " ".join(str(v) for v in r.ulp_hist), f"{100 * r.material_mismatch:.1f}%",
            f"{r.tolerance.ulps:g} ULP | {r.tolerance.abs_rel:.1e} x scale", first, _ok(r.passed)]


# ----------------------------------------------------------------------------------- walkers
def available_walkers(names: list[str] | None = None) -> dict:
    """The walkers to grade against the twin, by name: every available one (``names`` None) or
    exactly ``names`` (an unavailable one is then an error)."""
    wanted = [n for n in (names or list(WALKERS)) if n != "cpu"]
    out = {}
    for name in wanted:
        if name not in WALKERS:
            raise TaperayError(f"unknown walker {name!r} (walkers: cpu, {', '.join(WALKERS)})")
        try:
            walker_cls = WALKERS[name]()
        except ImportError as e:
            if names:
                raise TaperayError(f"walker {name} is not installed: {e}") from None
            continue
        if walker_cls.available():
            out[name] = walker_cls()
        elif names:
            raise TaperayError(f"walker {name} is unavailable on this machine")
    return out


def _gpu_walker():
    from .gpu import GpuWalker
    return GpuWalker


def _jax_walker():
    from .jax_walker import JaxWalker
    return JaxWalker


# walkers graded against the twin: name -> () -> walker class (imported lazily)
WALKERS = {"gpu": _gpu_walker, "jax": _jax_walker}


# ----------------------------------------------------------------------------------- grading
def sample_points(tape: Tape, rng: np.random.Generator, n: int) -> tuple[np.ndarray, float]:
    """``n`` uniform random points in the tape's bounds grown by a quarter and 0.1 each side, and
    the largest coordinate magnitude there (at least 1: the scale of the tolerances)."""
    b = tape.bounds.astype(np.float64)
    lo, hi = b[0] - 0.25 * (b[1] - b[0]) - 0.1, b[1] + 0.25 * (b[1] - b[0]) + 0.1
    pts = rng.uniform(lo, hi, (n, 3)).astype(np.float32)
    return pts, float(max(np.abs(lo).max(), np.abs(hi).max(), 1.0))


def grade_points(name: str, walker_name: str, pts: np.ndarray, scale: float,
                 ref: tuple[np.ndarray, np.ndarray], got: tuple[np.ndarray, np.ndarray],
                 tol: Tolerance) -> OpResult:
    """One walker's (distances, materials) at ``pts`` against the twin's ``ref``."""
    (rd, rm), (gd, gm) = ref, got
    ok = within_tolerance(rd, gd, tol, scale)
    bad = np.flatnonzero(~ok)
    max_abs, max_rel = _errors(rd, gd)
    return OpResult(name, walker_name, len(pts), max_abs, max_rel, _histogram(ulp_distance(rd, gd)),
                    float(np.mean(rm != gm)) if len(rm) else 0.0, tol, int(bad.size),
                    int(bad[0]) if bad.size else None)


def first_differing_record(tape: Tape, point: np.ndarray, cpu, walker, tol: Tolerance,
                           scale: float) -> int | None:
    """The first top-level record (outside pattern loops) whose written value differs between the
    twin and ``walker`` at ``point``: each probe is the tape's prefix ending in a COPY of that
    record's register to register 0, with culls disarmed (an infinite margin leaves values equal)."""
    depth = 0
    pts = np.asarray(point, np.float32).reshape(1, 3)
    for k, rec in enumerate(tape.instrs):
        op = Op(int(rec["op"]))
        if op in (Op.REPEAT_LINEAR, Op.REPEAT_POLAR, Op.REPEAT_GRID, Op.INSTANCES):
            depth += 1
        elif op is Op.REPEAT_END:
            depth -= 1
        if depth or not OPS[op].writes:
            continue
        probe = _probe_tape(tape, k)
        if probe is None:
            continue
        r, g = cpu.evaluate(probe, pts)[0], walker.evaluate(probe, pts)[0]
        if not within_tolerance(r, g, tol, scale)[0]:
            return k
    return None


def _probe_tape(tape: Tape, k: int) -> Tape | None:
    ins = np.concatenate([tape.instrs[:k + 1], np.zeros(1, INSTR_DTYPE)])
    ins[k + 1]["op"], ins[k + 1]["a"] = int(Op.COPY), tape.instrs[k]["dst"]
    params = tape.params.copy()
    for i in np.flatnonzero(ins["op"][:k + 1] == int(Op.CULL_BOX)):
        params[ins[i]["param"] + 6] = np.inf
        ins[i]["jump"] = min(int(ins[i]["jump"]), k + 1)
    probe = Tape(ins, params, tape.materials, tape.n_regs, tape.bounds, instances=tape.instances,
                 bvh=tape.bvh, source=f"{tape.source} (probe of record {k})")
    try:
        return validate(probe)
    except TapeError:
        return None


def _run(walker, fn: str, *args):
    try:
        return getattr(walker, fn)(*args), None
    except Exception as e:   # a walker that raises is a conformance failure, reported as such
        return None, f"{type(e).__name__}: {e}"


def conform_tape(tape: Tape, walkers: list[str] | None = None, seed: int = 0, n_points: int = 256,
                 image: tuple[int, int] = (24, 18), name: str | None = None,
                 report: ConformanceReport | None = None, graded: dict | None = None) -> ConformanceReport:
    """Grade ``tape`` as a scene on every walker: points (field + material) and a march image.
    ``graded`` gives the walker objects by name (default: ``available_walkers(walkers)``)."""
    validate(tape)
    cpu = CpuWalker()
    ws = available_walkers(walkers) if graded is None else graded
    report = report or ConformanceReport(walkers=list(ws))
    rng = np.random.default_rng(seed)
    pts, scale = sample_points(tape, rng, n_points)
    tol = scene_tolerance(tape)
    ref = cpu.evaluate(tape, pts)
    cam = auto_camera(tape.bounds)
    settings = RenderSettings()
    w, h = image
    ref_m = cpu.march(tape, cam, w, h, settings)
    eps = float(settings.pack(tape)[1])
    depth_tol = DEPTH_TOL_EPS * eps
    label = name or tape.source or "tape"
    for wname, walker in ws.items():
        got, err = _run(walker, "evaluate", tape, pts)
        if err:
            res = OpResult(label, wname, len(pts), 0, 0, [], 0, tol, len(pts), None, error=err)
            report.scenes.append(SceneResult(res, w * h, 1.0, np.inf, depth_tol, None))
            continue
        res = grade_points(label, wname, pts, scale, ref, got, tol)
        if res.first_point is not None:
            res.first_record = first_differing_record(tape, pts[res.first_point], cpu, walker, tol, scale)
        if "render" not in walker.capabilities:   # (a walker of points only, e.g. jax: no image)
            report.scenes.append(SceneResult(res, 0, 0.0, 0.0, depth_tol, None))
            continue
        got_m, err = _run(walker, "march", tape, cam, w, h, settings)
        if err:
            res.error = err
            report.scenes.append(SceneResult(res, w * h, 1.0, np.inf, depth_tol, None))
            continue
        hit_diff = ref_m["hit"] != got_m["hit"]
        grazing = np.zeros_like(hit_diff)
        differ = np.argwhere(hit_diff)
        if 0 < len(differ) <= GRAZING_MAX_PIXELS:
            band = tol.abs_rel * scale + tol.ulps * float(np.spacing(np.float32(eps)))
            grazing[tuple(differ.T)] = grazing_pixels(tape, cam, w, h, settings, differ, band)
        both = ref_m["hit"] & got_m["hit"]
        derr = np.abs(ref_m["t"][both].astype(np.float64) - got_m["t"][both])
        depth_bad = np.zeros_like(both)
        depth_bad[both] = derr > depth_tol
        first = np.argwhere((hit_diff & ~grazing) | depth_bad)
        report.scenes.append(SceneResult(res, w * h, float((hit_diff & ~grazing).mean()),
                                         float(derr.max(initial=0.0)), depth_tol,
                                         tuple(int(v) for v in first[0]) if len(first) else None,
                                         int(grazing.sum())))
    return report


def conform_random(n: int, walkers: list[str] | None = None, seed: int = 0, n_points: int = 256,
                   image: tuple[int, int] = (24, 18), graded: dict | None = None) -> ConformanceReport:
    """One tape per op (graded with the largest tolerance of its ops: the op itself, or e.g. the
    polar pattern a REPEAT_END closes), ``n`` random composite scenes and a tape
    wide enough for the largest register variant, on every available walker (or ``graded``)."""
    ws = available_walkers(walkers) if graded is None else graded
    report = ConformanceReport(walkers=list(ws))
    cpu = CpuWalker()
    rng = np.random.default_rng(seed)
    for op in Op:
        tape = op_tape(op, rng)
        pts, scale = sample_points(tape, rng, n_points)
        ref = cpu.evaluate(tape, pts)
        tol = tape_tolerance(tape)
        for wname, walker in ws.items():
            got, err = _run(walker, "evaluate", tape, pts)
            if err:
                report.ops.append(OpResult(op.name, wname, len(pts), 0, 0, [], 0, tol, len(pts), None, error=err))
                continue
            res = grade_points(op.name, wname, pts, scale, ref, got, tol)
            if res.first_point is not None:
                res.first_record = first_differing_record(tape, pts[res.first_point], cpu, walker, tol, scale)
            report.ops.append(res)
    for i in range(n):
        tape = random_tape(np.random.default_rng([seed, i]))
        conform_tape(tape, seed=seed + i, n_points=n_points, image=image, name=f"random #{i} (seed {seed})",
                     report=report, graded=ws)
    conform_tape(wide_tape(np.random.default_rng([seed, n]), max(REG_CAPS) - 8), seed=seed, n_points=n_points,
                 image=image, name=f"wide ({max(REG_CAPS) - 8} registers)", report=report, graded=ws)
    return report


def grazing_pixels(tape: Tape, cam, width: int, height: int, settings, pixels, band: float) -> np.ndarray:
    """For the pixels (row, col) ``pixels`` of a ``width`` x ``height`` march: whether the ray
    grazes the surface. The twin's field is sampled every GRAZING_SPACING hit_eps along the ray's
    march segment (the march box, t >= 0); the ray grazes where the least sample lies within
    [-band - spacing, hit_eps + band] (``band``: the field's tolerance). A march decides such a ray
    by whether one of its own samples falls below hit_eps, and the least value along it lies
    between the march's samples: walkers whose samples differ by rounding may decide it either
    way. A ray that clearly meets the surface, or clearly passes it by, is not grazing."""
    packed = settings.pack(tape)
    eps = float(unpack(packed, "hit_eps")[0])
    box = np.asarray(unpack(packed, "box_lo", "box_hi"), np.float32).reshape(2, 3)
    eye, dirs = cam.rays(width, height)
    eye = np.asarray(eye, np.float32)
    dirs = np.asarray(dirs, np.float32).reshape(height, width, 3)
    spacing = GRAZING_SPACING * eps
    cpu = CpuWalker()
    out = np.zeros(len(pixels), bool)
    for k, (r, c) in enumerate(np.asarray(pixels).reshape(-1, 2)):
        t0, t1 = (float(v[0]) for v in ray_slabs(eye[None], dirs[r, c][None], box))
        if not t0 <= t1:
            continue
        t = np.linspace(t0, t1, int(np.ceil((t1 - t0) / spacing)) + 2).astype(np.float32)
        least = float(np.nanmin(cpu.evaluate(tape, eye + t[:, None] * dirs[r, c])[0]))
        out[k] = -band - spacing <= least <= eps + band
    return out


# ----------------------------------------------------------------------------------- tapes
class TapeBuilder:
    """Emit records and parameters; registers at and above a node's ``dst`` are its scratch."""

    def __init__(self):
        self.rows: list[list[int]] = []
        self.params: list[float] = []
        self.n_regs = 1
        self.instances: list[np.ndarray] = []
        self.bvh: list[np.ndarray] = []

    def pool(self, values) -> int:
        off = len(self.params)
        self.params.extend(float(v) for v in values)
        return off

    def row(self, op: Op, dst=0, a=0, b=0, c=0, params=(), aux=0, jump=0, param=None) -> int:
        p = self.pool(params) if param is None else param
        used = [dst] if OPS[op].writes else []
        used += [r for f, r in zip("abc", (a, b, c)) if f in OPS[op].reads]
        self.n_regs = max(self.n_regs, max(used, default=0) + 1)
        self.rows.append([int(op), dst, a, b, c, p, aux, jump])
        return len(self.rows) - 1

    def tape(self, materials: np.ndarray, bounds, source: str) -> Tape:
        ins = np.zeros(len(self.rows), INSTR_DTYPE)
        ins.view(np.uint32).reshape(-1, 8)[:] = np.asarray(self.rows, np.uint32)
        inst = np.concatenate(self.instances) if self.instances else np.zeros(0, INSTANCE_DTYPE)
        bvh = np.concatenate(self.bvh) if self.bvh else np.zeros(0, BVH_DTYPE)
        params = np.asarray(self.params or [0.0], np.float32)
        return validate(Tape(ins, params, materials, self.n_regs, np.asarray(bounds, np.float32),
                             source=source, instances=inst, bvh=bvh))


def random_materials(rng: np.random.Generator, n: int = 4) -> np.ndarray:
    """``n`` materials of random colour and roughness (the random tapes')."""
    m = np.zeros(n, MATERIAL_DTYPE)
    m["color"] = rng.uniform(0.1, 0.9, (n, 3))
    m["roughness"] = rng.uniform(0.1, 0.9, n)
    return m


def _quat(rng: np.random.Generator) -> np.ndarray:
    q = rng.normal(size=4)
    return q / np.linalg.norm(q)


def _polygon(rng: np.random.Generator, n: int, r0: float, r1: float, centre=(0.0, 0.0)) -> np.ndarray:
    ang = np.sort(rng.uniform(0, 2 * np.pi, n))
    rad = rng.uniform(r0, r1, n)
    return np.stack([centre[0] + rad * np.cos(ang), centre[1] + rad * np.sin(ang)], 1)


_BOUNDED_SHAPES = (Op.SPHERE, Op.BOX, Op.ROUND_BOX, Op.CYLINDER, Op.CAPPED_CONE, Op.CAPSULE, Op.TORUS,
                   Op.ELLIPSOID, Op.EXTRUDE_POLY, Op.REVOLVE_POLY)   # (planes: op_tape only)


def _shape(b: TapeBuilder, rng: np.random.Generator, op: Op, dst: int, mat: int, size: float = 0.5):
    u = lambda lo, hi, k=None: rng.uniform(lo * size, hi * size, k)   # noqa: E731
    if op is Op.SPHERE:
        b.row(op, dst, params=[u(0.3, 1)], aux=mat)
    elif op is Op.BOX:
        b.row(op, dst, params=u(0.2, 1, 3), aux=mat)
    elif op is Op.ROUND_BOX:
        h = u(0.3, 1, 3)
        b.row(op, dst, params=[*h, 0.5 * h.min() * rng.uniform()], aux=mat)
    elif op is Op.CYLINDER:
        b.row(op, dst, params=[u(0.2, 0.8), u(0.2, 1)], aux=mat)
    elif op is Op.CAPPED_CONE:
        b.row(op, dst, params=[u(0.2, 1), u(0, 0.8), u(0, 0.8)], aux=mat)
    elif op is Op.CAPSULE:
        b.row(op, dst, params=[*u(-1, 1, 3), *u(-1, 1, 3), u(0.1, 0.4)], aux=mat)
    elif op is Op.TORUS:
        b.row(op, dst, params=[u(0.5, 1), u(0.1, 0.4)], aux=mat)
    elif op is Op.ELLIPSOID:
        b.row(op, dst, params=u(0.3, 1, 3), aux=mat)
    elif op is Op.PLANE:
        n = rng.normal(size=3)
        b.row(op, dst, params=[*(n / np.linalg.norm(n)), u(-0.5, 0.5)], aux=mat)
    elif op is Op.EXTRUDE_POLY:
        nv = int(rng.integers(3, 12))
        b.row(op, dst, a=nv, params=[u(0.2, 1), *_polygon(rng, nv, 0.3 * size, size).ravel()], aux=mat)
    else:   # REVOLVE_POLY: profile in (radius >= 0, z)
        nv = int(rng.integers(3, 10))
        b.row(op, dst, a=nv, params=_polygon(rng, nv, 0.2 * size, 0.5 * size, (0.6 * size, 0.0)).ravel(), aux=mat)


def _point_op(b: TapeBuilder, rng: np.random.Generator, op: Op):
    if op is Op.TRANSLATE:
        b.row(op, params=rng.uniform(-0.5, 0.5, 3))
    elif op is Op.ROTATE:
        b.row(op, params=_quat(rng))
    elif op is Op.SCALE:
        b.row(op, params=[rng.uniform(0.5, 2.0)])
    elif op is Op.MIRROR:
        n = rng.normal(size=3)
        b.row(op, params=[*(n / np.linalg.norm(n)), rng.uniform(-0.3, 0.3)])
    elif op is Op.ELONGATE:
        b.row(op, params=rng.uniform(0, 0.4, 3))


def _pattern_open(b: TapeBuilder, rng: np.random.Generator, op: Op, size: float) -> int:
    if op is Op.REPEAT_LINEAR:
        d = rng.normal(size=3)
        d = d / np.linalg.norm(d) * rng.uniform(1.2, 2.0) * size
        return b.row(op, params=[*d, int(rng.integers(1, 6)), size])
    if op is Op.REPEAT_POLAR:
        c = [rng.uniform(1.5, 2.5) * size, rng.uniform(-0.3, 0.3) * size, 0.0]
        return b.row(op, params=[int(rng.integers(1, 9)), *c, size])
    if op is Op.REPEAT_GRID:
        s = rng.uniform(1.2, 2.0, 3) * size
        return b.row(op, params=[*s, *rng.integers(1, 4, 3), size, size, size])
    return _instances_open(b, rng, size)


def _instances_open(b: TapeBuilder, rng: np.random.Generator, size: float) -> int:
    """An INSTANCES record over k random placements: a root node over the leaves (preorder)."""
    k = int(rng.integers(1, 6))
    inst = np.zeros(k, INSTANCE_DTYPE)
    inst["q"] = [_quat(rng) for _ in range(k)]
    inst["t"] = rng.uniform(-1.5, 1.5, (k, 3)) * size
    inst["s"] = rng.uniform(0.5, 1.5, k)
    first_inst = sum(len(a) for a in b.instances)
    first_node = sum(len(a) for a in b.bvh)
    nodes = np.zeros(k + 1, BVH_DTYPE)
    reach = (1.8 * size * inst["s"])[:, None]
    nodes["lo"][1:], nodes["hi"][1:] = inst["t"] - reach, inst["t"] + reach
    nodes["lo"][0], nodes["hi"][0] = nodes["lo"][1:].min(0), nodes["hi"][1:].max(0)
    nodes["skip"] = first_node + np.arange(1, k + 2)
    nodes["skip"][0] = first_node + k + 1
    nodes["instance"] = [-1, *range(first_inst, first_inst + k)]
    b.instances.append(inst)
    b.bvh.append(nodes)
    # the child's box; half the time an inner ball (the body gets a sphere of that radius unioned
    # in: _node) and a 2 x 2 x 2 grid of random representatives, else no capsule
    head = [*[-1.8 * size] * 3, *[1.8 * size] * 3, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    if rng.uniform() < 0.5:
        reps = rng.integers(first_inst, first_inst + k, 8)
        head += [rng.uniform(0.2, 0.5) * size, *rng.uniform(-1.5, 0.0, 3) * size, rng.uniform(0.3, 1.5) * size,
                 2, 2, 2, *reps]
    else:
        head += [-1.0, 0.0, 0.0, 0.0, 1.0, 0, 0, 0]
    return b.row(Op.INSTANCES, a=k + 1, aux=first_node, params=head)


def _node(b: TapeBuilder, rng: np.random.Generator, dst: int, depth: int, loops: int, size: float) -> None:
    """A random field into register ``dst`` (scratch: registers above it)."""
    mat = int(rng.integers(0, 4))
    choice = rng.uniform()
    if depth <= 0 or choice < 0.3:
        _shape(b, rng, _BOUNDED_SHAPES[int(rng.integers(len(_BOUNDED_SHAPES)))], dst, mat, size)
    elif choice < 0.45:
        b.row(Op.PUSH)
        for op in rng.choice([Op.TRANSLATE, Op.ROTATE, Op.SCALE, Op.MIRROR, Op.ELONGATE],
                             int(rng.integers(1, 3)), replace=False):
            _point_op(b, rng, Op(op))
        _node(b, rng, dst, depth - 1, loops, size)
        b.row(Op.POP)
    elif choice < 0.7:
        _node(b, rng, dst, depth - 1, loops, size)
        _node(b, rng, dst + 1, depth - 1, loops, size)
        op = Op(rng.choice([Op.UNION, Op.INTERSECT, Op.DIFFERENCE, Op.XOR, Op.SMOOTH_UNION,
                            Op.SMOOTH_INTERSECT, Op.SMOOTH_DIFFERENCE]))
        k = [rng.uniform(0.05, 0.3) * size] if op.name.startswith("SMOOTH") else []
        b.row(op, dst, a=dst, b=dst + 1, params=k)
    elif choice < 0.78:
        _node(b, rng, dst, depth - 1, loops, size)
        op = Op.OFFSET if rng.uniform() < 0.5 else Op.SHELL
        b.row(op, dst, a=dst, params=[rng.uniform(0.0, 0.1) * size])
    elif choice < 0.86 and loops > 0:
        op = Op(rng.choice([Op.REPEAT_LINEAR, Op.REPEAT_POLAR, Op.REPEAT_GRID, Op.INSTANCES]))
        begin = _pattern_open(b, rng, op, size * 0.5)
        _node(b, rng, dst + 1, depth - 1, loops - 1, size * 0.5)
        if rng.uniform() < 0.5:   # an instance-dependent body: + INSTANCE_INDEX * 0.01
            b.row(Op.INSTANCE_INDEX, dst + 2)
            b.row(Op.CONST, dst + 3, params=[0.01 * size])
            b.row(Op.MUL, dst + 2, a=dst + 2, b=dst + 3)
            b.row(Op.ADD, dst + 1, a=dst + 1, b=dst + 2)
        inner = b.params[b.rows[begin][5] + 12] if op is Op.INSTANCES else -1.0
        if inner >= 0:   # the inner ball's sphere, so that the ball is inside the body
            b.row(Op.SPHERE, dst + 2, params=[inner], aux=mat)
            b.row(Op.UNION, dst + 1, a=dst + 1, b=dst + 2)
        end = b.row(Op.REPEAT_END, dst, a=dst + 1, jump=begin)
        b.rows[begin][7] = end
    elif choice < 0.94:
        # the flattener's culled union: CULL_BOX(t) <child into t+1> INTERSECT(t) -> UNION(run)
        _node(b, rng, dst, depth - 1, loops, size)
        lo = rng.uniform(-1.5, -0.2, 3) * size
        cull = b.row(Op.CULL_BOX, dst + 1, a=dst, params=[*lo, *(lo + rng.uniform(0.2, 1.5, 3) * size),
                                                         rng.uniform(0, 0.05) * size], aux=mat)
        _node(b, rng, dst + 2, depth - 1, loops, size)
        b.row(Op.INTERSECT, dst + 1, a=dst + 2, b=dst + 1)
        b.rows[cull][7] = b.row(Op.UNION, dst, a=dst, b=dst + 1)
    else:
        _node(b, rng, dst, depth - 1, loops, size)
        b.row(Op.FIELD_RESULT, dst, a=dst, aux=mat)


def random_tape(rng: np.random.Generator, depth: int = 4) -> Tape:
    """A random valid scene over the shape, point, combine, pattern, cull and material ops."""
    b = TapeBuilder()
    _node(b, rng, 0, depth, 2, 1.0)
    return b.tape(random_materials(rng), [[-2.0, -2.0, -2.0], [2.0, 2.0, 2.0]], "random")


def wide_tape(rng: np.random.Generator, n_regs: int) -> Tape:
    """Spheres in registers 0..n_regs-1, min-reduced: a tape that needs the largest variant."""
    b = TapeBuilder()
    centres = rng.uniform(-1.2, 1.2, (n_regs, 3))
    for r in range(n_regs):
        b.row(Op.PUSH)
        b.row(Op.TRANSLATE, params=centres[r])
        b.row(Op.SPHERE, r, params=[rng.uniform(0.05, 0.3)], aux=r % 4)
        b.row(Op.POP)
    for r in range(n_regs - 1, 0, -1):
        b.row(Op.UNION, r - 1, a=r - 1, b=r)
    return b.tape(random_materials(rng), [[-1.6] * 3, [1.6] * 3], f"wide {n_regs}")




def op_tape(op: Op, rng: np.random.Generator) -> Tape:
    """A small tape whose value is dominated by ``op`` applied to the point (or a shape there)."""
    b = TapeBuilder()
    spec = OPS[op]
    fam = spec.family
    bounds = [[-2.0] * 3, [2.0] * 3]
    if fam is Family.ARITH and op not in (Op.INSTANCE_INDEX,):
        if op in (Op.VAR_X, Op.VAR_Y, Op.VAR_Z):
            b.row(op, 0)
        elif op is Op.CONST:
            b.row(Op.CONST, 0, params=[rng.uniform(-2, 2)])
        else:
            # x, y, z in [-3.1, 3.1] times the table's scale (sin / cos reach |x| ~ 19, past
            # the [-pi, pi] WGSL states accuracy on: the interpreter reduces their arguments;
            # asin / acos also see |x| > 1)
            s = spec.scale
            for r, var in enumerate((Op.VAR_X, Op.VAR_Y, Op.VAR_Z)):
                b.row(var, r + 1)
                b.row(Op.CONST, 4, params=[s])
                b.row(Op.MUL, r + 1, a=r + 1, b=4)
            if op in (Op.AND, Op.OR, Op.NOT):   # zeros where the point's x < 0
                b.row(Op.CONST, 4, params=[0.0])
                b.row(Op.MAX, 1, a=1, b=4)
            b.row(op, 0, a=1, b=2, c=3)
    elif op is Op.INSTANCE_INDEX or fam is Family.PATTERN:
        kind = op if op in (Op.REPEAT_LINEAR, Op.REPEAT_POLAR, Op.REPEAT_GRID, Op.INSTANCES) else \
            Op(rng.choice([Op.REPEAT_LINEAR, Op.REPEAT_POLAR, Op.REPEAT_GRID, Op.INSTANCES]))
        begin = _pattern_open(b, rng, kind, 0.4)
        _shape(b, rng, Op.BOX, 1, 1, 0.4)
        b.row(Op.INSTANCE_INDEX, 2)
        b.row(Op.CONST, 3, params=[0.02])
        b.row(Op.MUL, 2, a=2, b=3)
        b.row(Op.ADD, 1, a=1, b=2)
        b.rows[begin][7] = b.row(Op.REPEAT_END, 0, a=1, jump=begin)
    elif fam is Family.SHAPE:
        _shape(b, rng, op, 0, 1, 1.0)
    elif fam is Family.POINT:
        b.row(Op.PUSH)
        if op not in (Op.PUSH, Op.POP):
            _point_op(b, rng, op)
        _shape(b, rng, Op.BOX, 0, 1, 1.0)
        b.row(Op.POP)
    elif fam is Family.COMBINE:
        _shape(b, rng, Op.SPHERE, 0, 1, 1.0)
        b.row(Op.PUSH)
        _point_op(b, rng, Op.TRANSLATE)
        _shape(b, rng, Op.BOX, 1, 2, 1.0)
        b.row(Op.POP)
        k = [rng.uniform(0.05, 0.5)] if spec.n_params else []
        b.row(op, 0, a=0, b=1, params=k)
    elif fam is Family.CULL:
        _shape(b, rng, Op.SPHERE, 0, 1, 0.6)
        cull = b.row(Op.CULL_BOX, 1, a=0, params=[0.2, -0.5, -0.5, 1.4, 0.5, 0.5, 0.0], aux=2)
        b.row(Op.PUSH)
        b.row(Op.TRANSLATE, params=[0.8, 0.0, 0.0])
        _shape(b, rng, Op.BOX, 2, 2, 0.5)
        b.row(Op.POP)
        b.row(Op.INTERSECT, 1, a=2, b=1)
        b.rows[cull][7] = b.row(Op.UNION, 0, a=0, b=1)
    else:   # FIELD_RESULT
        _shape(b, rng, Op.TORUS, 1, 1, 1.0)
        b.row(Op.FIELD_RESULT, 0, a=1, aux=3)
    return b.tape(random_materials(rng), bounds, f"op {op.name}")


def reference_tape() -> Tape:
    """The fixed scene the GPU self-check renders: every shape family, point ops, smooth and culled
    combines, a linear and a polar pattern and an instance list (seeded, so always the same)."""
    rng = np.random.default_rng(20240601)
    b = TapeBuilder()
    _shape(b, rng, Op.ROUND_BOX, 0, 0, 1.2)
    b.row(Op.PUSH)
    b.row(Op.TRANSLATE, params=[0.0, 0.0, 0.9])
    b.row(Op.SPHERE, 1, params=[0.45], aux=1)
    b.row(Op.POP)
    b.row(Op.SMOOTH_UNION, 0, a=0, b=1, params=[0.2])
    begin = _pattern_open(b, rng, Op.REPEAT_POLAR, 0.25)
    b.row(Op.CYLINDER, 2, params=[0.12, 0.9], aux=2)
    b.rows[begin][7] = b.row(Op.REPEAT_END, 1, a=2, jump=begin)
    b.row(Op.DIFFERENCE, 0, a=0, b=1)
    cull = b.row(Op.CULL_BOX, 1, a=0, params=[-1.6, -1.6, -1.4, 1.6, -1.0, -0.6, 0.0], aux=3)
    b.row(Op.PUSH)
    b.row(Op.TRANSLATE, params=[-1.2, -1.3, -1.0])
    begin = _pattern_open(b, rng, Op.REPEAT_LINEAR, 0.3)
    b.row(Op.TORUS, 3, params=[0.2, 0.07], aux=3)
    b.rows[begin][7] = b.row(Op.REPEAT_END, 2, a=3, jump=begin)
    b.row(Op.POP)
    b.row(Op.INTERSECT, 1, a=2, b=1)
    b.rows[cull][7] = b.row(Op.UNION, 0, a=0, b=1)
    begin = _instances_open(b, rng, 0.3)
    _shape(b, rng, Op.CAPPED_CONE, 2, 2, 0.3)
    b.rows[begin][7] = b.row(Op.REPEAT_END, 1, a=2, jump=begin)
    b.row(Op.UNION, 0, a=0, b=1)
    return b.tape(random_materials(rng), [[-1.8] * 3, [1.8] * 3], "self-check scene")


# ----------------------------------------------------------------------------------- GPU self-check
@dataclass
class SelfCheck:
    """GPU vs CPU on a small render: passed when the images agree within the tolerances."""
    passed: bool
    mismatch_fraction: float          # pixels differing by more than ``level_tolerance``
    max_level_difference: int
    first_pixel: tuple[int, int] | None
    adapter: str
    seconds: float
    detail: dict = field(default_factory=dict)

    def __str__(self) -> str:
        where = f", first at row/col {self.first_pixel}" if self.first_pixel else ""
        return (f"{'passed' if self.passed else 'FAILED'} on {self.adapter}: "
                f"{100 * self.mismatch_fraction:.2f}% of pixels differ (max {self.max_level_difference} "
                f"levels{where}) in {self.seconds:.2f} s")


SELF_CHECK_SIZE = (40, 30)
SELF_CHECK_MAX_FRACTION = 0.02   # pixels allowed to differ (silhouettes, shadow edges)
SELF_CHECK_LEVELS = 2            # 8-bit levels a pixel may differ by (float32 vs float64 colour)


# the twin's shaded SELF_CHECK_SIZE image of reference_tape(), stored so that a self-check on the
# reference scene needs no twin compile (tests/test_gpu_walker.py checks it against the live twin;
# write_self_check_reference() makes it again)
SELF_CHECK_REFERENCE = Path(__file__).with_name("self_check_reference.png")


def self_check_reference() -> np.ndarray:
    """(H, W, 3) uint8: the twin's image of the self-check's reference scene, as stored."""
    from PIL import Image
    return np.asarray(Image.open(SELF_CHECK_REFERENCE).convert("RGB"))


def twin_self_check_image(tape: Tape) -> np.ndarray:
    """The twin's shaded SELF_CHECK_SIZE image of ``tape``, by gpu_self_check's camera."""
    w, h = SELF_CHECK_SIZE
    return CpuWalker().render(tape, auto_camera(tape.bounds), w, h, view="shade")


def write_self_check_reference() -> None:
    """Render the reference scene on the twin and store it as SELF_CHECK_REFERENCE."""
    from .image import write_png
    write_png(SELF_CHECK_REFERENCE, twin_self_check_image(reference_tape()))


def gpu_self_check(walker=None, tape: Tape | None = None) -> SelfCheck:
    """Render a small shaded image of ``tape`` on the GPU and compare it with the CPU twin's,
    reporting how far they disagree. Default: conformance's reference scene, which uses every op
    family, against the twin's image of it as stored (SELF_CHECK_REFERENCE: no Numba compile in a
    new install); another tape is rendered on the twin too."""
    from .gpu import GpuError, GpuWalker     # (wgpu is optional: imported where a GPU is graded)
    t0 = time.perf_counter()
    walker = walker or GpuWalker()
    stored = tape is None
    tape = tape or reference_tape()
    w, h = SELF_CHECK_SIZE
    cam = auto_camera(tape.bounds)
    try:
        gpu_img = walker.render(tape, cam, w, h, view="shade")
    except GpuError as e:
        return SelfCheck(False, 1.0, 255, None, walker.adapter_name, time.perf_counter() - t0, {"error": str(e)})
    cpu_img = self_check_reference() if stored else twin_self_check_image(tape)
    cmp = compare_images(cpu_img, gpu_img, SELF_CHECK_LEVELS)
    passed = cmp["mismatch_fraction"] <= SELF_CHECK_MAX_FRACTION
    return SelfCheck(passed, cmp["mismatch_fraction"], cmp["max_level_difference"], cmp["first_pixel"],
                     walker.adapter_name, time.perf_counter() - t0, cmp)
