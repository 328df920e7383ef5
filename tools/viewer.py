"""The live viewer's model: one scene on one walker, the orbit camera, the view, edits with undo
and redo, "save as", and the figures its overlay shows (frame time, records, instances, pipelines
created since startup, the latency of the last edit).

No window here. ``tools/view_window.py`` presents a ``Viewer`` in a desktop window, a Jupyter
widget or offscreen; ``tools/scene_runner.py`` re-runs a scene file in a child process for
``--watch``. An edit is a buffer write: a named parameter writes its pool slots
(``walker.set_param``; the tape's refit emits anew only the nodes holding the parameter), a new
scene re-flattens, copying the records of the nodes it keeps from the last flatten (flatten's
``reuse``), and uploads the spans of the tape that changed.
Frames march their primary rays until the field is below a pixel's footprint (``CONE_PIXELS``,
RenderSettings.hit_cone; ``cone=0``: at hit_eps, as ``taperay render`` draws); while something
moves, drafts are drawn: half the size each way, no shadows or ambient occlusion, the cone at
least a draft pixel.
The "path" view is progressive: each full frame adds ``PATH_SPP_PER_FRAME`` path-traced samples
per pixel to the picture (runtime.path_tracing.PathImage) up to ``PATH_MAX_SPP``; any edit, camera
move or resize starts it again, and while something moves the drafts are shaded frames.

Each named parameter's slider range is fixed when its scene loads: the scene file's ``ranges``
entry, else made once from the value it loaded with (``default_range``). A slider move, undo and
redo leave the ranges alone; a scene edit keeps the ranges of the names it shares with the scene
before and makes ranges for its new names (a scene edit's undo brings back the ranges before).

    >>> v = Viewer("scenes/heat_sink.py", walker="cpu", size=(320, 180))
    >>> v.set_param("fin_height", 0.04); image = v.frame()
    >>> v.undo(); v.save_as("heat_sink_edited.scene")
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from taperay.runtime.camera import Camera, auto_camera
from taperay.runtime.shading import VIEWS, RenderSettings
from taperay.runtime.tape import Tape, TaperayError
from taperay.runtime.walkers import walker as make_walker
from taperay.scenegraph.files import save_scene, save_tape
from taperay.scenegraph.flatten import flatten
from taperay.scenegraph.loading import SOURCE_SUFFIXES, load_tape, scene_namespace
from taperay.scenegraph.nodes import Node, with_params

__all__ = ["Orbit", "Viewer", "FrameStats", "DRAFT_SCALE", "edit_script", "PATTERN_COUNTS", "VIEWER_VIEWS",
           "PATH_SPP_PER_FRAME", "PATH_MAX_SPP", "declared_ranges", "default_range"]

PATTERN_COUNTS = (10, 100, 1_000, 10_000, 100_000)    # edit_script's pattern counts, in turn
DRAFT_SCALE = 2          # a draft frame (while the camera or a slider moves) is this much smaller each way
CONE_PIXELS = 1.0        # primary rays end within this many pixels' footprint of a surface (hit_cone)
VIEWER_VIEWS = (*VIEWS, "path")
PATH_SPP_PER_FRAME = 2   # samples per pixel each full frame of the path view adds
PATH_MAX_SPP = 1024      # the path view stops refining here
MIN_ELEVATION, MAX_ELEVATION = -89.0, 89.0


@dataclass
class Orbit:
    """A camera orbiting ``target`` (z up): azimuth from the front (-y) towards +x, elevation up
    from the xy plane, in degrees; the same convention as runtime.camera.auto_camera."""
    target: tuple[float, float, float]
    distance: float
    azimuth: float = 35.0
    elevation: float = 25.0
    fov_deg: float = 40.0

    @classmethod
    def framing(cls, bounds, azimuth: float = 35.0, elevation: float = 25.0, fov_deg: float = 40.0) -> "Orbit":
        """The orbit whose camera is auto_camera's for the (2, 3) ``bounds`` box."""
        try:
            cam = auto_camera(bounds, azimuth, elevation, fov_deg)
        except TaperayError as e:
            raise TaperayError(f"viewer: {e}") from None
        distance = float(np.linalg.norm(np.subtract(cam.eye, cam.target)))
        return cls(cam.target, distance, azimuth, elevation, fov_deg)

    def camera(self) -> Camera:
        az, el = math.radians(self.azimuth), math.radians(self.elevation)
        offset = np.array([math.cos(el) * math.sin(az), -math.cos(el) * math.cos(az), math.sin(el)])
        eye = np.asarray(self.target, float) + self.distance * offset
        return Camera(tuple(eye.tolist()), tuple(self.target), (0.0, 0.0, 1.0), self.fov_deg)

    def rotate(self, d_azimuth: float, d_elevation: float) -> None:
        self.azimuth = (self.azimuth + d_azimuth) % 360.0
        self.elevation = min(MAX_ELEVATION, max(MIN_ELEVATION, self.elevation + d_elevation))

    def pan(self, dx: float, dy: float) -> None:
        """Move the target across the view by (dx, dy) view heights (right, up)."""
        _, right, up = self.camera().basis()
        height = 2 * self.distance * math.tan(math.radians(self.fov_deg) / 2)
        self.target = tuple((np.asarray(self.target) + height * (dx * right + dy * up)).tolist())

    def zoom(self, factor: float) -> None:
        """Distance times ``factor`` (< 1 comes closer)."""
        if not (factor > 0 and math.isfinite(factor)):
            raise TaperayError(f"viewer: zoom factor {factor} must be a positive number")
        self.distance = max(self.distance * factor, 1e-6)


@dataclass
class _Edit:
    """One undoable step: a parameter's value, or the whole scene (tape, node and slider ranges)."""
    label: str
    param: str | None = None
    before: object = None
    after: object = None


@dataclass
class FrameStats:
    """What the overlay shows about the last frame."""
    frame_ms: float = 0.0              # the walker's frame, host clock
    records: int = 0
    instances: int = 0
    pipelines_created: int = 0         # by the walker since the viewer started (0 on the twin)
    shader_modules_created: int = 0
    last_edit: str = ""
    last_edit_ms: float | None = None  # edit -> frame presented
    flatten_ms: float | None = None    # the last scene edit's flatten (or the scene file's run)
    draft: bool = False
    size: tuple[int, int] = (0, 0)
    path_samples: int = 0              # the path view's samples per pixel so far (0 in other views)
    edits: list[dict] = field(default_factory=list)   # every edit's figures, in order


class Viewer:
    """A scene on a walker with a camera, a view and undoable edits (see the module docstring).

    ``source``: a scene path (.py, .scene, .tape, .vm), a scene ``Node`` or a ``Tape``. A .py
    file may define ``ranges = {"name": (lo, hi)}`` beside ``scene`` for its sliders (each
    holding the parameter's value in the file).
    ``walker``: "auto" | "cpu" | "gpu" or a walker object. ``cone``: a frame's primary rays end
    where the field is below this many pixels' footprint (RenderSettings.hit_cone; 0: at
    ``settings``' hit_eps, as ``taperay render`` draws; a draft's at least its own pixel's)."""

    def __init__(self, source, walker="auto", size: tuple[int, int] = (960, 540), view: str = "shade",
                 settings: RenderSettings | None = None, log=None, cone: float = CONE_PIXELS):
        self.walker = make_walker(walker, log=log) if isinstance(walker, str) else walker
        self.size = _checked_size(size)
        if not 0 <= cone < 1000:
            raise TaperayError(f"viewer: the hit cone's width {cone} pixels must lie in [0, 1000)")
        self.cone = cone
        self.settings = settings or RenderSettings()
        self.view = "shade"
        self.set_view(view)
        self.path: Path | None = None
        self.node: Node | None = None
        self.tape, declared = self._open(source)
        self._ranges = _slider_ranges(self.tape, declared, {})
        self.orbit = Orbit.framing(self.tape.bounds)
        self.undo_stack: list[_Edit] = []
        self.redo_stack: list[_Edit] = []
        self.stats = FrameStats()
        self._pending: tuple[str, float] | None = None     # (label, clock) of an edit not yet on screen
        self._generation = 0                                # counts edits: a path image is of one
        self._path = None                                   # (key, PathImage) of the path view
        self._start_counts = self._kernel_counts()

    # -- the scene
    def _open(self, source) -> tuple[Tape, dict[str, tuple[float, float]]]:
        """The source's tape and the slider ranges its scene file declares."""
        if isinstance(source, Tape):
            return source, {}
        if isinstance(source, Node):
            self.node = source
            return flatten(source, source="viewer"), {}
        path = Path(source)
        self.path = path
        if path.suffix.lower() == ".py" and path.exists():
            self.node, ns = scene_namespace(path)
            tape = flatten(self.node, source=str(path))
            return tape, declared_ranges(path, ns.get("ranges", {}), tape)
        if path.suffix.lower() == ".scene" and path.exists():
            from taperay.scenegraph.files import load_scene_file
            self.node = load_scene_file(path)
            return flatten(self.node, source=str(path)), {}
        if path.suffix.lower() not in SOURCE_SUFFIXES:
            raise TaperayError(f"{path}: unknown scene type (expected one of {', '.join(SOURCE_SUFFIXES)})")
        return load_tape(path), {}

    @property
    def params(self) -> dict[str, float]:
        """The named parameters and their current values."""
        return _param_values(self.tape)

    def param_range(self, name: str) -> tuple[float, float]:
        """A slider's (lo, hi), fixed when the parameter's scene loaded (see the module docstring)."""
        if name not in self._ranges:
            raise TaperayError(f"viewer: no parameter named {name!r} (have: {', '.join(self._ranges) or 'none'})")
        return self._ranges[name]

    # -- edits
    def set_param(self, name: str, value: float, merge: bool = False) -> None:
        """A slider move: write the parameter's slots (the tape refits what it bounds). ``merge``
        folds it into the last undo step when that moved the same parameter (one drag, one step)."""
        if name not in self.tape.names:
            raise TaperayError(f"viewer: no parameter named {name!r} (have: {', '.join(sorted(self.tape.names)) or 'none'})")
        value = float(value)
        if not math.isfinite(value):
            raise TaperayError(f"viewer: parameter {name} = {value} is not a finite number")
        value = float(np.float32(value))      # what the tape's pool holds, so that undo gives this tape back
        before = self.params[name]
        last = self.undo_stack[-1] if self.undo_stack else None
        label = f"{name} = {value:.6g}"
        if merge and last is not None and last.param == name and not self.redo_stack:
            last.after, last.label = value, label
        else:
            self._push(_Edit(label, name, before, value))
        self._apply_param(name, value, label)

    def _apply_param(self, name: str, value: float, label: str) -> None:
        t0 = time.perf_counter()
        self.walker.set_param(self.tape, name, value)
        self._generation += 1
        self._pending = (label, t0)
        self.stats.flatten_ms = None

    def set_scene(self, scene, label: str = "scene edit", flatten_ms: float | None = None,
                  ranges: dict[str, tuple[float, float]] | None = None) -> None:
        """A topology edit: a new scene ``Node`` (flattened here) or ``Tape`` (flattened already,
        e.g. by the scene file's child process; ``flatten_ms`` its cost, reported apart). Named
        parameters the new scene shares with the current one keep their current (slider) values
        and slider ranges; ``ranges`` (checked by ``declared_ranges``, e.g. the saved file's)
        replace those they name, and the other new names get a ``default_range`` of the value
        the new scene gives them. The walker uploads the spans that changed on the next frame."""
        t0 = time.perf_counter()
        kept = self.params
        if isinstance(scene, Node):
            node = scene
            tape = flatten(scene, source=str(self.path or "viewer"), params=kept, reuse=self.tape)
            flatten_ms = 1e3 * (time.perf_counter() - t0)
        elif isinstance(scene, Tape):
            tape, node = scene, None
            for name in kept.keys() & tape.names.keys():
                tape.set_param(name, kept[name])
        else:
            raise TaperayError(f"viewer: a scene edit takes a Node or a Tape, got {type(scene).__name__}")
        new_ranges = _slider_ranges(tape, ranges or {}, self._ranges)
        self._push(_Edit(label, None, (self.tape, self.node, self._ranges), (tape, node, new_ranges)))
        self._apply_scene(tape, node, new_ranges, label, t0, flatten_ms)

    def _apply_scene(self, tape: Tape, node: Node | None, ranges: dict[str, tuple[float, float]], label: str,
                     t0: float, flatten_ms: float | None) -> None:
        self.tape, self.node, self._ranges = tape, node, ranges
        self._generation += 1
        self._pending = (label, t0)
        self.stats.flatten_ms = flatten_ms

    def _push(self, edit: _Edit) -> None:
        self.undo_stack.append(edit)
        self.redo_stack.clear()

    def undo(self) -> bool:
        """Step back one edit; False when there is none."""
        return self._step(self.undo_stack, self.redo_stack, "before", "undo")

    def redo(self) -> bool:
        """Redo the last undone edit; False when there is none."""
        return self._step(self.redo_stack, self.undo_stack, "after", "redo")

    def _step(self, source: list, target: list, which: str, word: str) -> bool:
        if not source:
            return False
        edit = source.pop()
        target.append(edit)
        label = f"{word} {edit.label}"
        if edit.param is not None:
            self._apply_param(edit.param, getattr(edit, which), label)
        else:
            tape, node, ranges = getattr(edit, which)
            self._apply_scene(tape, node, ranges, label, time.perf_counter(), None)
        return True

    def set_view(self, view: str) -> None:
        if view not in VIEWER_VIEWS:
            raise TaperayError(f"viewer: unknown view {view!r}; views are {', '.join(VIEWER_VIEWS)}")
        self.view = view

    @property
    def refining(self) -> bool:
        """The path view has fewer than PATH_MAX_SPP samples of the current scene and camera: more
        full frames improve it."""
        return self.view == "path" and (self._path is None or self._path[0] != self._path_key()
                                        or self._path[1].samples < PATH_MAX_SPP)

    def save_as(self, path) -> Path:
        """Write the scene as it is now, atomically: a ``.scene`` file (the scene tree, with the
        parameters' current values) when the viewer holds one, or a ``.tape`` file."""
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix == ".scene":
            if self.node is None:
                raise TaperayError(f"{path}: this scene has no scene tree (it came from a tape or a .vm "
                                   "program); save it as .tape")
            save_scene(with_params(self.node, self.params), path)
        elif suffix == ".tape":
            save_tape(self.tape, path)
        else:
            raise TaperayError(f"{path}: save as .scene or .tape, not {suffix or 'no suffix'!r}")
        return path

    # -- frames
    def draft_size(self) -> tuple[int, int]:
        w, h = self.size
        return max(1, w // DRAFT_SCALE), max(1, h // DRAFT_SCALE)

    def frame_settings(self) -> RenderSettings:
        """A full frame's settings: ``settings`` with primary rays that end within ``cone``
        pixels' footprint of a surface (RenderSettings.hit_cone: rays grazing an edge or passing
        through sub-pixel detail stop there instead of creeping along it)."""
        return self._coned(self.settings, self.cone, self.size[1])

    def draft_settings(self) -> RenderSettings:
        """A moving frame's settings: no shadows, no ambient occlusion, primary rays that end
        within max(``cone``, 1) draft pixels' footprint of a surface."""
        return self._coned(replace(self.settings, shadows="off", ao_strength=0.0), max(self.cone, 1.0),
                           self.draft_size()[1])

    def _coned(self, settings: RenderSettings, pixels: float, height: int) -> RenderSettings:
        if pixels == 0:
            return settings
        cone = min(0.5, pixels * self.orbit.camera().pixel_angle(height))
        return replace(settings, hit_cone=max(settings.hit_cone, cone))

    def frame(self, draft: bool = False) -> np.ndarray:
        """The current image, (H, W, 3) uint8, read back to the host (offscreen use, the twin's
        window and tests). ``draft``: the smaller, unshadowed frame drawn while something moves."""
        w, h = self.draft_size() if draft else self.size
        t0 = time.perf_counter()
        if self.view == "path" and not draft:
            image = self._path_frame()
        else:
            image = self.walker.render(self.tape, self.orbit.camera(), w, h,
                                       "shade" if self.view == "path" else self.view,
                                       self.draft_settings() if draft else self.frame_settings())
        self._frame_done(t0, draft, (w, h))
        return image

    def _path_key(self) -> tuple:
        return self._generation, self.orbit.camera(), self.size

    def _path_frame(self) -> np.ndarray:
        """The path view's next picture: PATH_SPP_PER_FRAME more samples of the same scene and
        camera, or the first ones of a new path image after anything changed."""
        from taperay.runtime.path_tracing import PathImage
        key = self._path_key()
        if self._path is None or self._path[0] != key:
            self._path = (key, PathImage(self.walker, self.tape, key[1], *self.size, self.settings))
        image = self._path[1]
        if image.samples < PATH_MAX_SPP:
            image.add(min(PATH_SPP_PER_FRAME, PATH_MAX_SPP - image.samples))
        return image.rgb8()

    def frame_on_device(self, draft: bool = False):
        """The current image left on the GPU: (wgpu buffer, byte offset, width, height), as
        GpuWalker.render_on_device (the GPU walker only)."""
        if not hasattr(self.walker, "render_on_device"):
            raise TaperayError(f"viewer: the {self.walker.name} walker draws on the host; use frame()")
        if self.view == "path" and not draft:
            raise TaperayError("viewer: the path view accumulates on the host; use frame()")
        w, h = self.draft_size() if draft else self.size
        t0 = time.perf_counter()
        buf, offset = self.walker.render_on_device(self.tape, self.orbit.camera(), w, h,
                                                   "shade" if self.view == "path" else self.view,
                                                   self.draft_settings() if draft else self.frame_settings())
        self._frame_done(t0, draft, (w, h))
        return buf, offset, w, h

    def _frame_done(self, t0: float, draft: bool, size: tuple[int, int]) -> None:
        s = self.stats
        s.frame_ms = 1e3 * (time.perf_counter() - t0)
        s.records, s.instances = len(self.tape.instrs), int(self.tape.instance_count)
        s.draft, s.size = draft, size
        s.path_samples = self._path[1].samples if self.view == "path" and self._path is not None and not draft else 0
        counts = self._kernel_counts()
        s.pipelines_created = counts[0] - self._start_counts[0]
        s.shader_modules_created = counts[1] - self._start_counts[1]

    def presented(self) -> None:
        """Called by the presenter once the frame is on screen: closes the pending edit's latency."""
        if self._pending is None:
            return
        label, t0 = self._pending
        self._pending = None
        s = self.stats
        s.last_edit, s.last_edit_ms = label, 1e3 * (time.perf_counter() - t0)
        s.edits.append(dict(edit=label, latency_ms=s.last_edit_ms, frame_ms=s.frame_ms, flatten_ms=s.flatten_ms,
                            records=s.records, instances=s.instances, pipelines_created=s.pipelines_created))

    def _kernel_counts(self) -> tuple[int, int]:
        st = self.walker.stats()
        return int(st.get("pipelines_created", 0)), int(st.get("shader_modules_created", 0))

    def overlay_lines(self) -> list[str]:
        """The overlay's text, one line each."""
        s = self.stats
        lines = [f"{self.walker.name} walker  {s.size[0]}x{s.size[1]}{' draft' if s.draft else ''}  "
                 f"frame {s.frame_ms:.1f} ms",
                 f"records {s.records:,}  instances {s.instances:,}",
                 f"pipelines created since startup {s.pipelines_created}"]
        if s.last_edit_ms is not None:
            lines.append(f"last edit {s.last_edit_ms:.1f} ms  ({s.last_edit})")
        if s.flatten_ms is not None:
            lines.append(f"scene rebuilt in {s.flatten_ms:.1f} ms")
        if self.view == "path" and not s.draft:
            lines.append(f"path: {s.path_samples} samples per pixel" + ("" if self.refining else " (done)"))
        return lines


def _checked_size(size) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in size)
    except (TypeError, ValueError):
        raise TaperayError(f"viewer: size must be (width, height), got {size!r}") from None
    if not (1 <= w <= 16384 and 1 <= h <= 16384):
        raise TaperayError(f"viewer: size {w}x{h} must lie in 1..16384 each way")
    return w, h


def _param_values(tape: Tape) -> dict[str, float]:
    return {name: float(tape.params[slots[0]]) for name, slots in sorted(tape.names.items()) if slots}


def declared_ranges(path, ranges, tape: Tape) -> dict[str, tuple[float, float]]:
    """A scene file's ``ranges`` ({name: (lo, hi)}) checked against its ``tape``: each a finite
    lo < hi holding the value the file gives a parameter of that name."""
    if not isinstance(ranges, dict):
        raise TaperayError(f"{path}: `ranges` must be a dict {{name: (lo, hi)}}, got {type(ranges).__name__}")
    values = _param_values(tape)
    out = {}
    for name, r in ranges.items():
        try:
            lo, hi = (float(v) for v in r)
        except (TypeError, ValueError):
            raise TaperayError(f"{path}: ranges[{name!r}] must be (lo, hi), got {r!r}") from None
        if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
            raise TaperayError(f"{path}: ranges[{name!r}] = ({lo}, {hi}) needs finite lo < hi")
        if name not in values:
            raise TaperayError(f"{path}: ranges[{name!r}] names no parameter of the scene "
                               f"(its parameters: {', '.join(values) or 'none'})")
        if not np.float32(lo) <= values[name] <= np.float32(hi):      # (the pool holds float32)
            raise TaperayError(f"{path}: ranges[{name!r}] = ({lo:g}, {hi:g}) does not hold the parameter's "
                               f"value {values[name]:g}")
        out[name] = (lo, hi)
    return out


def default_range(value: float, bounds) -> tuple[float, float]:
    """A slider's range made from a parameter's value: a quarter to two and a half times it
    (either sign), or, for 0, ± a tenth of the diagonal of the scene's ``bounds`` (at least 1e-3)."""
    if value != 0:
        lo, hi = sorted((0.25 * value, 2.5 * value))
        return lo, hi
    b = np.asarray(bounds, float).reshape(2, 3)
    reach = max(0.1 * float(np.linalg.norm(b[1] - b[0])), 1e-3)
    return -reach, reach


def _slider_ranges(tape: Tape, declared: dict, kept: dict) -> dict[str, tuple[float, float]]:
    """The slider range of each named parameter of ``tape``: ``declared`` (by its scene file),
    else ``kept`` (the scene before's, for a name it shares), else the default_range of the
    value the tape gives it."""
    return {name: declared.get(name) or kept.get(name) or default_range(value, tape.bounds)
            for name, value in _param_values(tape).items()}


def edit_script(viewer: Viewer, slider_moves: int, topology_edits: int):
    """Scripted edits for the offscreen viewer (``taperay view --offscreen --edits N``, the tests):
    ``slider_moves`` parameter writes spread over the scene's named parameters and their ranges,
    interleaved with ``topology_edits`` scene edits of the scene as opened: a row of small spheres
    added along the bounds' x edge with a pattern count cycling through PATTERN_COUNTS (10 to
    100,000), every third one cut away instead (difference: a boolean swapped), every fourth back
    to the scene as opened (the part removed). Yields (kind, label, apply) with ``apply()``
    making the edit; topology edits need a scene tree (none for a tape or .vm source)."""
    from taperay.scenegraph.nodes import difference, sphere, union
    names = list(viewer.params)
    base = viewer.node
    if topology_edits and base is None:
        raise TaperayError("viewer: topology edits need a scene tree (a .py or .scene source), not a tape")
    if slider_moves and not names:
        raise TaperayError("viewer: slider moves need named parameters; this scene has none")
    b = np.asarray(viewer.tape.bounds, float).reshape(2, 3)
    extent = b[1] - b[0]
    total = slider_moves + topology_edits
    topology_at = {int((j + 0.5) * total / topology_edits) for j in range(topology_edits)}
    kinds = ["topology" if i in topology_at else "slider" for i in range(total)]
    slider_i = topo_i = 0
    for kind in kinds:
        if kind == "slider":
            name = names[slider_i % len(names)]
            lo, hi = viewer.param_range(name)
            value = lo + (hi - lo) * (0.5 + 0.45 * math.sin(1.7 * slider_i + 0.3))
            slider_i += 1
            yield "slider", f"{name} = {value:.6g}", (lambda name=name, value=value: viewer.set_param(name, value))
            continue
        count = PATTERN_COUNTS[topo_i % len(PATTERN_COUNTS)]
        if topo_i % 4 == 3:
            node, label = base, "part removed"
        else:
            step = float(extent[0]) / count
            row = sphere(0.35 * step).linear_pattern((step, 0.0, 0.0), count).translate(
                float(b[0, 0]) + 0.5 * step, float(b[0, 1]), float(b[1, 2]))
            node = difference(base, row) if topo_i % 3 == 2 else union(base, row)
            label = f"{'cut' if topo_i % 3 == 2 else 'added'} a row of {count:,} spheres"
        topo_i += 1
        yield "topology", label, (lambda node=node, label=label: viewer.set_scene(node, label=label))
