"""The CPU twin's walker: ``CpuWalker``, the reference walker (Numba, float32).

Owns the walker API over the twin's kernels (runtime/twin.py: the interpreter and its semantics)
and the choice of where a render marches: on the tape's own records or on interval-pruned cells
(runtime/pruned_march.py, runtime/cells.py). Every array it returns is float32 / uint32 / int32.
"""
from __future__ import annotations

import numpy as np

from . import compile_progress, jit_cache, pruned_eval, pruned_march, twin
from .camera import Camera, auto_camera
from .cells import cell_tape
from .shading import RenderSettings, compose, to_rgb8, unpack
from .tape import CellsTooLarge, Tape, TaperayError, gradient_eps, point_array

__all__ = ["CpuWalker"]


class CpuWalker:
    """The Numba reference walker (float32): evaluate, gradient, march, light, render, field and
    sign images of any validated tape.

        >>> d, mat = CpuWalker().evaluate(flatten(sphere(1)), [[0, 0, 2]])   # d == [1.]
    """

    name = "cpu"
    capabilities = frozenset({"evaluate", "gradient", "render"})   # (runtime.walkers.CAPABILITIES)

    def __init__(self, progress: bool = False):
        """``progress``: show the kernels' first compile on stderr by the clock, for the whole
        process (runtime.compile_progress); a load from the disk cache shows nothing."""
        if progress:
            compile_progress.show_compile_progress()
        self._counts = {"points_evaluated": 0, "images_rendered": 0}

    def stats(self) -> dict:
        """``points_evaluated`` (by ``evaluate``), ``images_rendered`` (by ``render``) and
        ``numba_loaded`` (whether this process has loaded Numba for the twin's kernels)."""
        return dict(self._counts, numba_loaded=jit_cache.numba_loaded())

    @staticmethod
    def available() -> bool:
        """Always: the twin needs only Numba."""
        return True

    def set_param(self, tape: Tape, name: str, value) -> None:
        """Set a named parameter on ``tape`` (``Tape.set_param``, refitting its bounds when it came
        from a scene); the twin holds no copy of the tape, so the next call sees the edit."""
        tape.set_param(name, value)

    def set_material(self, tape: Tape, name: str, **fields) -> None:
        """Set fields of the material ``name`` on ``tape`` (``Tape.set_material``); the next call
        sees the edit."""
        tape.set_material(name, **fields)

    def evaluate(self, tape: Tape, points) -> tuple[np.ndarray, np.ndarray]:
        """(N,) float32 distances and (N,) uint32 material ids at the (N, 3) points."""
        pts = point_array(points, "evaluate")
        self._counts["points_evaluated"] += len(pts)
        return twin.evaluate_field(tape, pts)

    def gradient(self, tape: Tape, points, eps: float | None = None) -> np.ndarray:
        """(N, 3) float32 central differences; eps defaults to 1e-3 of the bounds diagonal."""
        pts = point_array(points, "gradient", np.float32)
        e = gradient_eps(tape, eps)
        off = np.concatenate([np.eye(3, dtype=np.float32) * e, -np.eye(3, dtype=np.float32) * e])
        d, _ = twin.evaluate_field(tape, (pts[:, None, :] + off[None]).reshape(-1, 3))
        d = d.reshape(-1, 6)
        return ((d[:, :3] - d[:, 3:]) / (np.float32(2) * e)).astype(np.float32)

    def parameter_differences(self, tape: Tape, points, rel: float = 1e-3) -> dict[str, np.ndarray]:
        """{name: (N,) float32 d value / d name} at the (N, 3) points for every named parameter,
        by central differences of the twin's values (a step of ``rel`` of the parameter's size, at
        least 1e-4; the tape's value is set back afterwards). The JAX walker's ``value_and_grad``
        gives them exactly."""
        pts = point_array(points, "parameter_differences", np.float32)
        out = {}
        for name, slots in tape.names.items():
            theta = float(tape.params[slots[0]])
            h = max(abs(theta) * rel, 1e-4)
            try:
                tape.set_param(name, theta + h)
                up, _ = twin.evaluate_field(tape, pts)
                tape.set_param(name, theta - h)
                down, _ = twin.evaluate_field(tape, pts)
            finally:
                tape.set_param(name, theta)
            out[name] = ((up.astype(np.float64) - down) / (2 * h)).astype(np.float32)
        return out

    def march(self, tape: Tape, camera: Camera, width: int, height: int,
              settings: RenderSettings | None = None, view: str = "shade") -> dict:
        """Primary rays by the camera's pixel convention. Returns t (H,W) f32 (inf = miss), hit,
        steps int32, mat uint32, grad (H,W,3) f32 (field gradient at the hit) and normal."""
        return twin.march(tape, camera, width, height, settings or RenderSettings(), view)

    def light(self, tape: Tape, camera: Camera, width: int, height: int,
              settings: RenderSettings | None = None, view: str = "shade") -> dict:
        """March, then the key light's visibility and ambient occlusion, on the tape's own
        records (GpuWalker.light with cells None): the march dict plus shadow and ao (H, W)
        float32 (1 on misses)."""
        settings = settings or RenderSettings()
        mr = self.march(tape, camera, width, height, settings, view)
        return {**mr, **twin.light_pass(tape, settings.pack(tape, view), mr)}

    def render(self, tape: Tape, camera: Camera | None, width: int, height: int, view: str = "shade",
               settings: RenderSettings | None = None, cells="auto") -> np.ndarray:
        """(H, W, 3) uint8 image of ``view`` (one of shading.VIEWS). ``cells``: "auto" marches and
        lights a tape of at least pruned_eval.PRUNE_MIN_RECORDS records on pruned cells
        (runtime.pruned_march.march_pruned / light_pruned, bit for bit ``march`` and the light pass):
        an arithmetic tape (scene fields allowed) itself, another scene tape without patterns as its
        lowering to arithmetic where it has one (runtime.cells.cell_tape, as GpuWalker.render), by
        the tape's own records where the cells would exceed their memory cap or do not shorten the
        tape to pruned_march.CELLS_PAY_SHARE of its records; (grid, levels) the same with that grid
        (CellsTooLarge past the cap); None never (``march`` itself stays the unpruned reference)."""
        auto = isinstance(cells, str) and cells == "auto"
        if not (cells is None or auto or (isinstance(cells, tuple) and len(cells) == 2)):
            raise TaperayError(f"cells must be None, 'auto' or (grid, levels), got {cells!r}")
        settings = settings or RenderSettings()
        packed = settings.pack(tape, view)       # rejects unknown views
        camera = camera or auto_camera(tape.bounds)
        self._counts["images_rendered"] += 1
        if view == "slice":
            eye, dirs = camera.rays(width, height)
            pts, valid = _plane_points(eye, dirs, packed)
            f, _ = twin.evaluate_field(tape, pts[valid])
            field = np.full(valid.shape, np.nan, np.float32)
            field[valid] = f
            return to_rgb8(compose("slice", packed, tape.materials, camera.pack(), dirs, slice_field=field))
        run = None
        # (a tape with patterns: its lowering writes the copies out, so its cells can hold more
        # records than its own loop runs, the showcase's 96 on average against its 78; "auto"
        # marches it on its own records)
        if cells is not None and not (auto and (len(tape.instrs) < pruned_eval.PRUNE_MIN_RECORDS
                                                or tape.has_patterns())):
            run = cell_tape(tape)
        if run is not None and auto:
            try:
                if pruned_march.cells_shorten(run, packed) > pruned_march.CELLS_PAY_SHARE:
                    run = None                 # (cells that barely shorten it: the tape's own records)
            except CellsTooLarge:
                run = None                     # (the cells of a long tape: the tape's own records)
        light = None
        if run is not None:                    # (with a grid given, CellsTooLarge past the cap)
            grid = {} if auto else dict(grid=cells[0], levels=cells[1])
            mr = pruned_march.march_pruned(run, camera, width, height, settings, view, **grid)
            if view in ("shade", "section"):
                light = pruned_march.light_pruned(run, packed, mr, **grid)     # (run has tape's bounds)
        else:
            mr = self.march(tape, camera, width, height, settings, view)
            if view in ("shade", "section"):
                light = twin.light_pass(tape, packed, mr)
        return to_rgb8(compose(view, packed, tape.materials, camera.pack(), mr["dirs"], march=mr, light=light))

    def sign_image(self, tape: Tape, width: int, height: int, rect=(-1.0, 1.0, -1.0, 1.0),
                   z: float = 0.0) -> np.ndarray:
        """(H, W) bool, True where the field is < 0, with field_image's pixel centres; arithmetic
        tapes by per-tile interval pruning (runtime.pruned_eval), others by the unpruned field."""
        return pruned_eval.sign_image(tape, width, height, rect, z)

    def field_image(self, tape: Tape, width: int, height: int, rect=(-1.0, 1.0, -1.0, 1.0),
                    z: float = 0.0) -> np.ndarray:
        """(H, W) float32 field on the plane z = const; rect = (x0, x1, y0, y1); pixel centres;
        row 0 is y = y1 (the top, y up), column 0 is x = x0."""
        return twin.field_image(tape, width, height, rect, z)


def _plane_points(eye, dirs, packed):
    """Where each pixel's ray meets the slice plane, and whether that lies in the march box."""
    n, d = unpack(packed, "plane_n"), unpack(packed, "plane_d")[0]
    box = unpack(packed, "box_lo", "box_hi").reshape(2, 3)
    denom = dirs @ n
    with np.errstate(divide="ignore", invalid="ignore"):
        t = (d - eye @ n) / denom
    pts = (eye + t[..., None] * dirs).astype(np.float32)
    valid = (t > 0) & np.isfinite(t) & np.all((pts >= box[0]) & (pts <= box[1]), axis=-1)
    return pts, valid
