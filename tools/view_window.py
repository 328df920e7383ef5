"""``taperay view``: a ``Viewer`` (tools/viewer.py) presented on a rendercanvas canvas — a desktop
window (glfw), a Jupyter widget (jupyter-rfb) or offscreen — with an imgui panel (imgui-bundle
through wgpu-py's ImguiRenderer): sliders for the named parameters, the view menu, undo / redo /
save, and the overlay. The panel is a third of the window's width (``panel_width``: between
``PANEL_MIN_WIDTH`` and ``PANEL_MAX_WIDTH``, or as wide as the longest parameter name needs, never
wider than the window), as tall as its contents up to the window's height (then it scrolls),
folds away by its title bar's arrow and is drawn from the first frame. Each slider has its
parameter's full name on the line above it and the range the viewer fixed when the scene loaded;
a slider move is clamped into that range.

With the GPU walker the frame never leaves the GPU: the walker's resolve writes the image's bytes
into its own buffer and the present pipeline (shaders/present.wgsl, the kernel set's one render
pipeline: ``KernelSet.present_pipeline``) draws them onto the window's texture. The CPU twin's
image is uploaded into the viewer's buffer and drawn by the same pipeline, on the process's
device. While the camera or a slider moves, and after a watched file's new scene, frames are
drafts (half size, no shadows); once still for ``SETTLE_S`` the full frame follows. ``--watch`` polls the scene file and re-runs it in
a child process (tools/scene_runner.py); a failure leaves the last good scene on screen, shows
the error in the panel (wrapped to its width) and prints it on stderr as one line.

``open_window`` checks for a display before it makes the glfw window: without one it raises
TaperayError (the command line prints it as one line).
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

from taperay.runtime import gpu_device
from taperay.runtime.tape import TaperayError

from .scene_runner import SceneWatcher, one_line
from .viewer import VIEWER_VIEWS, Viewer

__all__ = ["ViewWindow", "need_view_packages", "SETTLE_S", "notebook_viewer", "offscreen_window", "open_window", "panel_width",
           "run_offscreen_edits"]

PANEL_FRACTION = 1 / 3   # the panel's width, of the window's
PANEL_MIN_WIDTH = 120    # pixels, unless the window is narrower
PANEL_MAX_WIDTH = 360
PANEL_MARGIN = 8         # between the panel and the window's edges
SETTLE_S = 0.15          # still this long after the last move: draw the full frame
INPUT_DRAW_ORDER = -100  # the handler asking for a frame on input runs before imgui's (-99)
FRAMES_AFTER_INPUT = 2   # frames drawn after an input's own: imgui shows a popup a frame or two after the click
# the image's bytes are display-ready (sRGB-encoded): an 8-bit format without conversion
PRESENT_FORMATS = ("bgra8unorm", "rgba8unorm")


def panel_width(window_width: float, names_width: float = 0.0) -> float:
    """The panel's width in a window ``window_width`` logical pixels wide: PANEL_FRACTION of it,
    within PANEL_MIN_WIDTH .. PANEL_MAX_WIDTH, widened to ``names_width`` (what the longest
    parameter name needs on one line), never wider than the window less its margins."""
    width = max(min(max(PANEL_FRACTION * window_width, PANEL_MIN_WIDTH), PANEL_MAX_WIDTH), names_width)
    return max(min(width, window_width - 2 * PANEL_MARGIN), 1.0)


def _configure(context, device) -> str:
    """Configure the canvas context for the first of PRESENT_FORMATS it takes; that format."""
    import wgpu
    usage = wgpu.TextureUsage.RENDER_ATTACHMENT | wgpu.TextureUsage.COPY_SRC    # (screenshots read it)
    for texture_format in PRESENT_FORMATS:
        try:
            context.configure(device=device, format=texture_format, usage=usage)
            return texture_format
        except ValueError:
            continue
    raise TaperayError(f"view: the canvas takes none of the formats {', '.join(PRESENT_FORMATS)}")


class ViewWindow:
    """A ``Viewer`` on a rendercanvas ``canvas``: input, panel, progressive frames, watch mode.

    ``watch``: re-run the scene's .py file on each save (timeout ``watch_timeout`` s)."""

    def __init__(self, viewer: Viewer, canvas, watch: bool = False, watch_timeout: float = 30.0, panel: bool = True):
        import wgpu
        self.viewer = viewer
        self.canvas = canvas
        # the GPU walker's kernel set, or (the twin's window) the process's: its device presents
        self.kernels = getattr(viewer.walker, "kernels", None) or gpu_device.kernels()
        self.device = self.kernels.device
        self.context = canvas.get_wgpu_context()
        self.format = _configure(self.context, self.device)
        self.pipeline = self.kernels.present_pipeline(self.format)
        self.uniform = self.device.create_buffer(size=32, usage=wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST)
        self._host_image = None          # the twin's frames: the viewer's upload buffer
        self._bind = None                # (buffer id, bind group)
        self._image = None               # (buffer, offset, w, h) of the last frame drawn
        self._dirty = True               # the scene, view or camera changed since the last full frame
        self._moved_at = 0.0             # the clock of the last move (camera or slider)
        self._drag = None                # (button, x, y) while the pointer drags
        self.watcher = SceneWatcher(viewer.path, timeout=watch_timeout) if watch else None
        self.message = ""                # the last error or note, shown in the panel
        self.imgui = None
        self._panel_content = 0.0        # the panel's contents' height in the last frame
        self._panel_resized = False      # ... differed from the frame before: draw one more to fit it
        self._frames_after_input = 0     # frames still to draw after the last input's own
        self.panel_rect = None           # the panel's (x0, y0, x1, y1) in the last frame drawn
        if panel:
            from wgpu.utils.imgui import ImguiRenderer
            self.imgui = ImguiRenderer(self.device, canvas, render_target_format=self.format)
            self.imgui.set_gui(self._panel)
            self._measure_panel()
        canvas.add_event_handler(self._on_pointer, "pointer_down", "pointer_up", "pointer_move")
        canvas.add_event_handler(self._on_wheel, "wheel")
        canvas.add_event_handler(self._on_key, "key_down")
        # (an on-demand canvas draws when asked: every input may change the panel or the view. This
        # handler runs before the panel's (order -99), which stops the events it takes: imgui reads
        # them in the next frame, so a press on a slider that asked for no frame was never seen, and
        # the panel, still holding the pointer, took every event after it)
        canvas.add_event_handler(self._on_input, "pointer_down", "pointer_up", "pointer_move",
                                 "wheel", "key_down", "key_up", "char", "resize", order=INPUT_DRAW_ORDER)
        canvas.request_draw(self.draw)

    # -- input
    def changed(self) -> None:
        """The scene, view or camera changed: the next frame is drawn in full (not a draft)."""
        self._dirty = True

    def moved(self) -> None:
        """Something moved (camera, slider): drafts until still, then the full frame."""
        self._moved_at = time.perf_counter()
        self._dirty = True

    def _on_input(self, event) -> None:
        """Any input: a frame now, and ``FRAMES_AFTER_INPUT`` after it for the panel (imgui shows
        what a click opened, a combo's list, in the frames after the click's)."""
        self._frames_after_input = FRAMES_AFTER_INPUT
        self.canvas.request_draw()

    def _on_pointer(self, event) -> None:
        """Orbit (left button) and pan (other buttons, or shift) drags. The panel stops the events
        it takes, but a press on it before a frame has drawn it under the pointer (slow frames,
        a jump of the pointer) reaches here too: a press on the panel's rect starts no drag, and
        a drag ends on a move without its button (its release taken by the panel)."""
        kind = event["event_type"]
        if kind == "pointer_down":
            x, y = event["x"], event["y"]
            r = self.panel_rect
            on_panel = r is not None and r[0] <= x <= r[2] and r[1] <= y <= r[3]
            self._drag = None if on_panel else (event["button"], x, y, "Shift" in event.get("modifiers", ()))
        elif kind == "pointer_up" or (self._drag is not None and self._drag[0] not in event.get("buttons", ())):
            self._drag = None
        elif self._drag is not None:
            button, x0, y0, shift = self._drag
            dx, dy = event["x"] - x0, event["y"] - y0
            self._drag = (button, event["x"], event["y"], shift)
            h = max(self.canvas.get_logical_size()[1], 1)
            if button == 1 and not shift:
                self.viewer.orbit.rotate(-0.4 * dx, 0.4 * dy)
            else:
                self.viewer.orbit.pan(-dx / h, dy / h)
            self.moved()

    def _on_wheel(self, event) -> None:
        self.viewer.orbit.zoom(1.0015 ** event["dy"])
        self.moved()

    def _on_key(self, event) -> None:
        mods = event.get("modifiers", ())
        key = event["key"].lower()
        if "Control" not in mods:
            return
        if key == "z" and "Shift" not in mods:
            self.undo()
        elif key in ("y", "z"):
            self.redo()

    def undo(self) -> None:
        if self.viewer.undo():
            self._dirty = True

    def redo(self) -> None:
        if self.viewer.redo():
            self._dirty = True

    def set_param(self, name: str, value: float, merge: bool = True) -> None:
        """A slider move: ``value`` clamped into the parameter's range (Viewer.param_range)."""
        lo, hi = self.viewer.param_range(name)
        self.viewer.set_param(name, min(max(float(value), lo), hi), merge=merge)
        self.moved()

    def set_view(self, view: str) -> None:
        self.viewer.set_view(view)
        self._dirty = True

    # -- frames
    def draw(self) -> None:
        """One canvas frame: poll the watched file, render if anything changed (a draft while
        moving), present, draw the panel. Requests the next frame while work remains."""
        self._poll_watch()
        moving = time.perf_counter() - self._moved_at < SETTLE_S
        refine = self.viewer.refining and not moving
        if self._dirty or self._image is None or (self._image_is_draft and not moving) or refine:
            self._render(draft=moving)
            self._dirty = False
        self._present()
        if self.imgui is not None:
            self.imgui.render()
        self.viewer.presented()
        after_input = self._frames_after_input > 0
        self._frames_after_input = max(self._frames_after_input - 1, 0)
        if (moving or self._image_is_draft or self.watcher is not None or self.viewer.refining
                or self._panel_resized or self._panel_input_queued() or self._dirty or after_input):
            self.canvas.request_draw()        # (dirty here: the panel changed the scene or view)

    def _panel_input_queued(self) -> bool:
        """Whether imgui left input events for its next frame: it takes a frame's events one
        button change at a time (a click's press and release in successive frames), so a
        release, and a move after it, wait for another frame; without one, the panel's button
        fires only at the next input, and imgui, still believing the pointer on the panel, takes
        the next press on the view too."""
        if self.imgui is None:
            return False
        from imgui_bundle import imgui
        return len(imgui.get_current_context().input_events_queue) > 0

    @property
    def _image_is_draft(self) -> bool:
        return self._image is not None and (self._image[2], self._image[3]) != self.viewer.size

    def _render(self, draft: bool) -> None:
        v = self.viewer
        try:
            if hasattr(v.walker, "render_on_device") and (draft or v.view != "path"):
                self._image = v.frame_on_device(draft)
            else:
                self._image = self._upload(v.frame(draft))
        except TaperayError as e:
            self.message = str(e)

    def _upload(self, rgb: np.ndarray):
        """The twin's image into the viewer's buffer, as the words present.wgsl reads."""
        import wgpu
        h, w = rgb.shape[:2]
        data = np.zeros(-(-3 * w * h // 4) * 4, np.uint8)
        data[:3 * w * h] = rgb.reshape(-1)
        if self._host_image is None or self._host_image.size < data.nbytes:
            self._host_image = self.device.create_buffer(
                size=max(data.nbytes, 16), usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST)
        self.device.queue.write_buffer(self._host_image, 0, data)
        return self._host_image, 0, w, h

    def _present(self) -> None:
        import wgpu
        texture = self.context.get_current_texture()
        encoder = self.device.create_command_encoder()
        rp = encoder.begin_render_pass(color_attachments=[{
            "view": texture.create_view(), "resolve_target": None, "clear_value": (0.1, 0.1, 0.1, 1),
            "load_op": wgpu.LoadOp.clear, "store_op": wgpu.StoreOp.store}])
        if self._image is not None:
            buf, offset, w, h = self._image
            tw, th = texture.size[0], texture.size[1]
            self.device.queue.write_buffer(self.uniform, 0, np.array([w, h, tw, th, offset // 4, 0, 0, 0], np.uint32))
            if self._bind is None or self._bind[0] is not buf:
                group = self.device.create_bind_group(layout=self.pipeline.get_bind_group_layout(0), entries=[
                    {"binding": 0, "resource": {"buffer": buf, "offset": 0, "size": buf.size}},
                    {"binding": 1, "resource": {"buffer": self.uniform, "offset": 0, "size": 32}}])
                self._bind = (buf, group)
            rp.set_pipeline(self.pipeline)
            rp.set_bind_group(0, self._bind[1])
            rp.draw(3)
        rp.end()
        self.device.queue.submit([encoder.finish()])

    # -- watch mode
    def _poll_watch(self) -> None:
        if self.watcher is None:
            return
        result = self.watcher.poll()
        if result is None:
            return
        if result.error:
            self._watch_error(result.error)
            return
        try:
            self.viewer.set_scene(result.tape, label=f"{self.viewer.path.name} saved", flatten_ms=result.run_ms,
                                  ranges=result.ranges)
        except TaperayError as e:
            self._watch_error(str(e))
            return
        self.message = ""
        self.moved()                 # a draft at once, the full frame once nothing changes

    def _watch_error(self, error: str) -> None:
        """A failed re-run of the watched file: in the panel, and on stderr as one line naming the file."""
        line = one_line(error)
        if str(self.viewer.path) not in line:
            line = f"{self.viewer.path}: {line}"
        self.message = line
        print(f"taperay: watch: {line}", file=sys.stderr, flush=True)

    # -- the panel
    def _measure_panel(self) -> None:
        """One imgui frame of the panel, not drawn: imgui hides a new window sized to its contents
        for the frame that measures them, and this is that frame, so the first drawn frame shows
        the panel."""
        from imgui_bundle import imgui
        imgui.set_current_context(self.imgui.imgui_context)
        imgui.get_io().display_size = self.canvas.get_logical_size()
        imgui.new_frame()
        try:
            self._panel()
        finally:
            imgui.end_frame()

    def _panel(self) -> None:
        from imgui_bundle import imgui
        v = self.viewer
        window_w, window_h = self.canvas.get_logical_size()
        style = imgui.get_style()
        names = max((imgui.calc_text_size(name).x for name in v.params), default=0.0)
        width = panel_width(window_w, names + 2 * style.window_padding.x + style.scrollbar_size)
        imgui.set_next_window_pos((PANEL_MARGIN, PANEL_MARGIN), imgui.Cond_.first_use_ever)
        imgui.set_next_window_size((width, 0), imgui.Cond_.always)     # (height 0: fit the contents)
        imgui.set_next_window_size_constraints((width, 0), (width, max(window_h - 2 * PANEL_MARGIN, 1)))
        imgui.set_next_window_bg_alpha(0.8)
        # (no resize borders: the panel's size is set here each frame, and a drag on a border just
        # outside it moved the panel off the window instead; it moves by its title bar only)
        imgui.get_io().config_windows_move_from_title_bar_only = True
        expanded, _ = imgui.begin("taperay", None, imgui.WindowFlags_.no_resize)
        pos, size = imgui.get_window_pos(), imgui.get_window_size()
        self.panel_rect = (pos.x, pos.y, pos.x + size.x, pos.y + size.y)
        if expanded:
            self._panel_contents()
        # (imgui fits a window to its contents of the frame before)
        content = imgui.get_cursor_pos_y() if expanded else 0.0
        self._panel_resized, self._panel_content = content != self._panel_content, content
        imgui.end()

    def _panel_contents(self) -> None:
        from imgui_bundle import imgui
        v = self.viewer
        for line in v.overlay_lines():
            imgui.text_wrapped(line)
        imgui.separator()
        imgui.text("view")
        imgui.set_next_item_width(-1)
        current = VIEWER_VIEWS.index(v.view)
        changed, chosen = imgui.combo("##view", current, list(VIEWER_VIEWS))
        if changed and chosen != current:
            self.set_view(VIEWER_VIEWS[chosen])
        for name, value in v.params.items():
            lo, hi = v.param_range(name)
            imgui.text_wrapped(name)
            imgui.set_next_item_width(-1)
            changed, new = imgui.slider_float(f"##{name}", value, lo, hi, "%.5g", imgui.SliderFlags_.always_clamp)
            if changed:
                self.set_param(name, new, merge=imgui.is_mouse_dragging(0) or not imgui.is_item_activated())
        if imgui.button("undo"):
            self.undo()
        imgui.same_line()
        if imgui.button("redo"):
            self.redo()
        if v.path is not None and imgui.button("save as .scene" if v.node is not None else "save as .tape"):
            self._save_next_to_source()
        if self.watcher is not None:
            imgui.text_wrapped(f"watching {v.path.name}" + (" (running)" if self.watcher.running else ""))
        if self.message:
            imgui.push_style_color(imgui.Col_.text, imgui.ImVec4(1.0, 0.45, 0.35, 1.0))
            imgui.text_wrapped(self.message)
            imgui.pop_style_color()

    def _save_next_to_source(self) -> None:
        v = self.viewer
        suffix = ".scene" if v.node is not None else ".tape"
        target = v.path.with_name(v.path.stem + "_edited" + suffix)
        try:
            v.save_as(target)
            self.message = f"saved {target}"
        except TaperayError as e:
            self.message = str(e)


def notebook_viewer(source, walker="auto", size=(640, 360), view="shade"):
    """The viewer in Jupyter: a jupyter-rfb canvas with ipywidgets sliders for the named
    parameters and a view menu. Returns the widget (display it as a cell's last value)."""
    import ipywidgets
    from rendercanvas.jupyter import RenderCanvas
    viewer = Viewer(source, walker=walker, size=size, view=view)
    canvas = RenderCanvas(size=size)
    window = ViewWindow(viewer, canvas, panel=False)
    sliders = []
    for name, value in viewer.params.items():
        lo, hi = viewer.param_range(name)
        slider = ipywidgets.FloatSlider(value=value, min=lo, max=hi, step=(hi - lo) / 200, description=name,
                                        continuous_update=True, readout_format=".4g")
        slider.observe(lambda change, name=name: (window.set_param(name, change["new"]), canvas.request_draw()),
                       names="value")
        sliders.append(slider)
    menu = ipywidgets.Dropdown(options=list(VIEWER_VIEWS), value=viewer.view, description="view")
    menu.observe(lambda change: (window.set_view(change["new"]), canvas.request_draw()), names="value")
    box = ipywidgets.VBox([canvas, menu, *sliders])
    box.window = window          # the window behind the widget, for scripts
    return box


def offscreen_window(viewer: Viewer, watch: bool = False, panel: bool = True) -> ViewWindow:
    """The window drawn offscreen (rendercanvas's offscreen canvas): ``window.canvas.draw()``
    draws one frame exactly as the desktop window would and returns it (H, W, 4) uint8."""
    if panel:
        need_view_packages("imgui_bundle")
    from rendercanvas.offscreen import RenderCanvas
    canvas = RenderCanvas(size=viewer.size, pixel_ratio=1)
    return ViewWindow(viewer, canvas, watch=watch, panel=panel)


def open_window(make_viewer, title: str, size: tuple[int, int], watch: bool = False, on_ready=None) -> None:
    """The desktop window (glfw), until it is closed. ``make_viewer()`` (choosing the walker,
    loading the scene) and the first frame, which creates the kernels it needs, run in a thread
    while the window stays responsive and its title shows the time spent; an error there closes
    the window and is raised here. ``on_ready(window)`` is called with the ViewWindow once it
    exists (scripts, tests). Without a display to open it on, raises TaperayError before any
    window is made."""
    import threading
    _check_display(title)
    from rendercanvas.glfw import RenderCanvas, loop
    canvas = RenderCanvas(size=size, title=f"taperay - {title}", update_mode="ondemand")
    state: dict = {}

    def prepare():
        try:
            viewer = make_viewer()
            on_device = hasattr(viewer.walker, "render_on_device") and viewer.view != "path"
            viewer.frame_on_device() if on_device else viewer.frame()
            state["viewer"] = viewer
        except Exception as e:     # re-raised in the caller's thread once the window is closed
            state["error"] = e

    started = time.perf_counter()
    threading.Thread(target=prepare, name="taperay-view-startup", daemon=True).start()

    def waiting():
        if "viewer" in state:
            window = ViewWindow(state["viewer"], canvas, watch=watch)
            if on_ready is not None:
                on_ready(window)
        elif "error" in state:
            canvas.close()
        else:
            canvas.set_title(f"taperay - {title}: loading and building kernels, "
                             f"{time.perf_counter() - started:.1f} s")
            loop.call_later(0.1, waiting)

    loop.call_later(0.05, waiting)
    loop.run()
    if "error" in state:
        raise state["error"]


def need_view_packages(*modules: str) -> None:
    """Raise TaperayError naming the viewer's optional packages that are not installed (the
    ``view`` extra: glfw for the window, imgui-bundle for the panel)."""
    import importlib.util
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        names = ", ".join({"imgui_bundle": "imgui-bundle"}.get(m, m) for m in missing)
        raise TaperayError(f"taperay view needs the optional package{'s' if len(missing) > 1 else ''} {names}: "
                           "pip install 'taperay[view]' (or, in this checkout, .venv/bin/pip install -e '.[view]')")


def _check_display(title: str) -> None:
    """Raise TaperayError unless glfw can open a window: the viewer's packages missing, on Linux
    neither DISPLAY nor WAYLAND_DISPLAY set, or glfw failing to start (a display that does not
    answer)."""
    import warnings

    need_view_packages("glfw", "imgui_bundle")
    import glfw
    advice = "use --offscreen to draw without a window (with --screenshot OUT.png for a picture), or run under xvfb-run"
    if sys.platform.startswith("linux") and not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        raise TaperayError(f"{title}: no display to open a window on (DISPLAY is not set); {advice}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", glfw.GLFWError)     # (the reason is read below)
        started = glfw.init()
    if not started:
        _, description = glfw.get_error()
        reason = description.decode(errors="replace") if description else "glfw could not start"
        raise TaperayError(f"{title}: no display to open a window on ({one_line(reason)}); {advice}")


def run_offscreen_edits(window: ViewWindow, slider_moves: int, topology_edits: int, progress=None,
                        draft: bool = False) -> dict:
    """Drive ``window`` (offscreen) through viewer.edit_script's edits, one full frame each, and
    measure each edit to its frame: ``latency_ms`` from the edit's start to ``canvas.draw()``
    returning the presented image (read back to the host: an upper bound of the on-screen
    latency), of which ``edit_ms`` the edit itself (a slider's refit and upload, a topology
    edit's flatten and more), the walker's ``frame_ms`` and the rest the present and read-back;
    a topology edit's ``flatten_ms``, and the pipelines and
    shader modules created (walker and present) by that edit. The first frame is the startup;
    the GPU walker's background build of the rest of its kernel set is waited for before the
    edits, so that what they count is theirs. ``draft``: each edit's frame is the draft the
    window draws first (while a slider is dragged, after a watched file's new scene: half size,
    no shadows) instead of the full frame."""
    from .viewer import edit_script
    v = window.viewer

    def created() -> tuple[int, int]:
        st = window.kernels.stats
        return st.pipelines_created, st.shader_modules_created

    t0 = time.perf_counter()
    first = np.asarray(window.canvas.draw())
    startup = dict(first_frame_ms=1e3 * (time.perf_counter() - t0), pipelines_created=created()[0],
                   shader_modules_created=created()[1], nonblank=bool(first[..., :3].std() > 0))
    kernels = getattr(v.walker, "kernels", None)
    if kernels is not None:        # the rest of the kernel set, built in the background meanwhile
        t0 = time.perf_counter()
        kernels.settle()
        startup.update(background_wait_ms=1e3 * (time.perf_counter() - t0), pipelines_total=created()[0])
    rows = []
    script = list(edit_script(v, slider_moves, topology_edits))
    for i, (kind, label, apply) in enumerate(script):
        before = created()
        t0 = time.perf_counter()
        apply()
        edit_ms = 1e3 * (time.perf_counter() - t0)
        window._dirty = True
        window._moved_at = time.perf_counter() if draft else 0.0
        np.asarray(window.canvas.draw())
        latency = 1e3 * (time.perf_counter() - t0)
        after = created()
        s = v.stats
        rows.append(dict(kind=kind, edit=label, latency_ms=latency, edit_ms=edit_ms, frame_ms=s.frame_ms,
                         flatten_ms=s.flatten_ms if kind == "topology" else None, records=s.records,
                         instances=s.instances, pipelines_created=after[0] - before[0],
                         shader_modules_created=after[1] - before[1]))
        if progress is not None:
            progress(i + 1, len(script), rows[-1])
    return dict(walker=v.walker.name, size=list(v.size), view=v.view, draft=draft, startup=startup, edits=rows)
