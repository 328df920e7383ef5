"""The live viewer (tools/viewer.py, tools/view_window.py, tools/scene_runner.py): offscreen
frames through the same present pipeline and panel as the window, slider and topology edits with
no pipeline created, undo / redo, save as, slider ranges fixed at load (a real imgui drag past
the end among them), the panel on the first frame, watch mode in a child process, the command
line (no display: one line of error), and a screenshot of the real glfw window under Xvfb."""
import os
import shutil
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from taperay.runtime.shading import RenderSettings
from taperay.runtime.tape import TaperayError
from taperay.scenegraph import Material, Param, box, sphere, union
from taperay.scenegraph.files import load_file
from taperay.tools.cli import main
from taperay.tools.view_window import PANEL_MARGIN, SETTLE_S, offscreen_window, panel_width
from taperay.tools.viewer import PATTERN_COUNTS, Orbit, Viewer, default_range, edit_script

SIZE = (64, 48)
FAST = RenderSettings(shadows="off", ao_strength=0.0)


def _scene():
    body = box(Param("width", 1.2), 0.8, 0.5).material(Material("body", (0.3, 0.5, 0.8)))
    return union(body, sphere(Param("radius", 0.35)).translate(0.0, 0.0, 0.45))


def _viewer(walker, **kw) -> Viewer:
    return Viewer(_scene(), walker=walker, size=SIZE, settings=FAST, **kw)


def _draw(window) -> np.ndarray:
    window.changed()
    return np.asarray(window.canvas.draw())[..., :3].copy()


@pytest.mark.slow
def test_offscreen_viewer_end_to_end(walkers_all):
    """60 slider moves and 20 topology edits (a pattern count from 10 to 100,000 among them): no
    pipeline or shader module created after startup, each edit's frame differs from the one
    before where the edit changes what is visible, and undoing every edit gives back, frame by
    frame, the images seen before each edit."""
    window = offscreen_window(_viewer(walkers_all), panel=False)
    report_first = _draw(window)
    stats = window.kernels.stats      # (the GPU walker's kernel set; the twin's window presents on the process's)
    window.kernels.settle()
    start = (stats.pipelines_created, stats.shader_modules_created)
    images = [report_first]
    script = list(edit_script(window.viewer, 60, 20))
    assert sum(k == "topology" for k, _, _ in script) == 20
    labels = [label for kind, label, _ in script if kind == "topology"]
    assert any(f"{max(PATTERN_COUNTS):,}" in label for label in labels)
    changed = []
    for kind, label, apply in script:
        values = dict(window.viewer.params)
        apply()
        images.append(_draw(window))
        moved = [n for n, x in window.viewer.params.items() if n in values and x != values[n]]
        big = kind == "topology" or any(abs(window.viewer.params[n] - values[n]) > 0.05 * np.subtract(
            *window.viewer.param_range(n)[::-1]) for n in moved)
        changed.append((kind, label, bool(np.any(images[-1] != images[-2])) if big else None))
    assert (stats.pipelines_created, stats.shader_modules_created) == start
    # every slider move of more than 5 % of its range changes the picture (both parameters move
    # the silhouette)
    moves = [c for kind, _, c in changed if kind == "slider" and c is not None]
    assert len(moves) > 40 and all(moves), [x for x in changed if x[2] is False]
    # scene edits adding parts wider than a pixel change it
    visible = [(label, c) for kind, label, c in changed if label.startswith(("added a row of 10 ", "added a row of 100 "))]
    assert len(visible) >= 5 and all(c for _, c in visible), visible
    for i in range(len(script), 0, -1):
        assert window.viewer.undo()
        assert np.array_equal(_draw(window), images[i - 1]), f"undo of edit {i} ({script[i - 1][1]})"
    assert not window.viewer.undo()
    assert window.viewer.redo() and np.array_equal(_draw(window), images[1])


def test_undo_of_a_slider_move_gives_the_tape_back_bit_for_bit(walker_cpu):
    """A slider's value is held as the tape's pool holds it (float32), so that undoing a later
    move refits the tape to the same bits, bounds included (a float64 value would refit the
    bounds from digits the pool does not keep, and the picture after undo could move a pixel)."""
    v = _viewer(walker_cpu)
    v.set_param("radius", 0.8257051442451695)
    bounds, pool = v.tape.bounds.copy(), v.tape.params.copy()
    v.set_param("radius", 0.5)
    assert v.undo()
    assert np.array_equal(v.tape.bounds, bounds) and np.array_equal(v.tape.params, pool)
    assert v.params["radius"] == np.float32(0.8257051442451695)


def test_slider_drag_is_one_undo_step_and_undo_redo_restore_values(walker_cpu):
    v = _viewer(walker_cpu)
    r0 = v.params["radius"]
    for value in (0.36, 0.37, 0.38):
        v.set_param("radius", value, merge=True)
    v.set_param("width", 1.0)
    assert len(v.undo_stack) == 2 and v.undo_stack[0].label == "radius = 0.38"    # (the drag's last value)
    v.undo()
    v.undo()
    assert v.params["radius"] == pytest.approx(r0) and v.params["width"] == pytest.approx(1.2)
    v.redo()
    assert v.params["radius"] == pytest.approx(0.38)
    v.set_param("width", 1.1)
    assert not v.redo_stack      # a new edit drops what was undone


def _pointer(window, kind: str, x, y, buttons=(1,), draw: bool = True) -> None:
    """One pointer event of the left button through the offscreen canvas, handled at once (as
    rendercanvas delivers a window's), then a frame drawn where ``draw``."""
    window.canvas.submit_event(dict(event_type=kind, x=float(x), y=float(y), button=1, buttons=buttons,
                                    modifiers=()))
    window.canvas._process_events()
    if draw:
        window.canvas.draw()


def _press_and_drag(window, points) -> list:
    """Press the left button at the first of ``points``, move through the rest and let go, one
    frame drawn after each event (as rendercanvas delivers a window's pointer events); returns each
    frame's {name: (value, range)}."""
    seen = []

    def event(kind, x, y):
        _pointer(window, kind, x, y)
        v = window.viewer
        seen.append({name: (value, v.param_range(name)) for name, value in v.params.items()})

    event("pointer_move", *points[0])
    event("pointer_down", *points[0])
    for x, y in points[1:]:
        event("pointer_move", x, y)
    event("pointer_up", *points[-1])
    return seen


def _item_rects(monkeypatch, *widgets: str) -> dict:
    """{label (a slider's: its parameter's name): (min, max) corners} of each item imgui draws by
    the functions named ``widgets`` (default: its sliders), filled as frames draw."""
    from imgui_bundle import imgui
    rects = {}

    def recording(real):
        def item(label, *args):
            result = real(label, *args)
            rects[label.lstrip("#")] = (imgui.get_item_rect_min(), imgui.get_item_rect_max())
            return result
        return item

    for name in widgets or ("slider_float",):
        monkeypatch.setattr(imgui, name, recording(getattr(imgui, name)))
    return rects


@pytest.mark.slow
def test_a_press_the_panel_takes_still_asks_for_a_frame(walker_cpu, monkeypatch):
    """With the pointer over a slider, imgui takes the pointer's events (stops their propagation);
    the press must still ask the on-demand canvas for a frame, or imgui never sees it and, holding
    the pointer, takes every later event: the window's last frame stays on screen for good."""
    rects = _item_rects(monkeypatch)
    window = offscreen_window(Viewer("scenes/heat_sink.py", walker=walker_cpu, size=(320, 360), settings=FAST))
    window.canvas.draw()
    lo_xy, hi_xy = rects["fin_height"]
    x, y = (lo_xy.x + hi_xy.x) / 2, (lo_xy.y + hi_xy.y) / 2
    asked = []
    monkeypatch.setattr(window.canvas, "request_draw", lambda *a: asked.append(a))
    for kind in ("pointer_move", "pointer_down", "pointer_move", "pointer_up"):
        if kind == "pointer_down":
            window.canvas.draw()        # (the hover's frame: imgui now wants the pointer)
        before = len(asked)
        _pointer(window, kind, x, y, draw=False)
        assert len(asked) > before, kind
        x += 10


@pytest.mark.slow
def test_a_drag_beside_the_panel_turns_the_view_and_leaves_the_panel_in_place(walker_cpu):
    """Pointer events through the offscreen canvas, a frame each: a drag pressed just right of
    the panel's edge (where imgui's resize border reaches) turns the camera and leaves the panel
    where it is (it slid off the window's left edge); one pressed on the panel's background moves
    neither; one on its title bar moves the panel."""
    v = Viewer("scenes/heat_sink.py", walker=walker_cpu, size=(320, 360), settings=FAST)
    window = offscreen_window(v)
    window.canvas.draw()
    x0, y0, x1, y1 = start = window.panel_rect
    for press, turns in (((x1 + 1, (y0 + y1) / 2), True), ((x1 + 3, (y0 + y1) / 2), True),
                         ((x1 - 3, y1 - 4), False)):
        camera = v.orbit.camera().pack().copy()
        _press_and_drag(window, [(press[0] - 8 * i, press[1]) for i in range(12)])
        assert window.panel_rect[:2] == start[:2], press
        assert (not np.array_equal(v.orbit.camera().pack(), camera)) == turns, press
    camera = v.orbit.camera().pack().copy()
    _press_and_drag(window, [(x0 + 60 + 5 * i, y0 + 8) for i in range(8)])     # the title bar
    assert window.panel_rect[0] > start[0] and np.array_equal(v.orbit.camera().pack(), camera)


def _on_demand(window, monkeypatch):
    """Drive ``window`` as an on-demand loop draws it: ``settle()`` draws a frame for each frame
    asked for (``canvas.request_draw``) until none is (drafts while moving, then still)."""
    asked = []
    monkeypatch.setattr(window.canvas, "request_draw", lambda *a: asked.append(a))

    def settle():
        end = time.perf_counter() + 5 * SETTLE_S + 2.0
        while asked:
            assert time.perf_counter() < end, "the window keeps asking for frames"
            asked.clear()
            window.canvas.draw()
    return asked, settle


@pytest.mark.slow
def test_a_drag_right_after_a_click_on_a_panel_button_turns_the_view(walker_cpu, monkeypatch):
    """A quick click on "undo" (its press and release in one frame, as a real click often is): imgui
    takes one of them a frame, so the window must keep drawing until imgui has taken them all, and
    then draw what the click changed; else the button fires only at the next input, and imgui,
    still believing the pointer on its button, takes the next press on the view too, and that drag
    turns nothing. The window is driven as an on-demand loop draws: a frame for each frame asked
    for."""
    buttons = _item_rects(monkeypatch, "button")
    v = Viewer("scenes/heat_sink.py", walker=walker_cpu, size=(400, 560), settings=FAST)   # (the panel whole)
    window = offscreen_window(v)
    asked, settle = _on_demand(window, monkeypatch)
    drawn, real_frame = [], v.frame
    monkeypatch.setattr(v, "frame", lambda *a, **k: (drawn.append(v.params["fin_height"]), real_frame(*a, **k))[1])

    window.canvas.draw()
    settle()
    v.set_param("fin_height", v.param_range("fin_height")[1])
    window.changed()
    asked.append(())
    settle()
    _pointer(window, "pointer_move", 300, 340, buttons=(), draw=False)     # (a frame with the edit's line)
    settle()
    lo, hi = buttons["undo"]
    x, y = (lo.x + hi.x) / 2, (lo.y + hi.y) / 2
    _pointer(window, "pointer_move", x, y, buttons=(), draw=False)
    settle()
    _pointer(window, "pointer_down", x, y, draw=False)
    _pointer(window, "pointer_up", x, y, buttons=(), draw=False)      # (released before a frame)
    settle()
    assert not v.undo_stack, "the click did not undo"
    assert drawn[-1] == v.params["fin_height"], "the undo was not drawn"
    assert window.panel_rect[3] + 40 < 560
    y = window.panel_rect[3] + 40                                      # (below the panel)
    camera = v.orbit.camera().pack().copy()
    for kind, px, held in (("pointer_move", 200, ()), ("pointer_down", 200, (1,)), ("pointer_move", 180, (1,)),
                           ("pointer_move", 150, (1,)), ("pointer_up", 150, ())):
        _pointer(window, kind, px, y, buttons=held, draw=False)
        settle()
    assert not np.array_equal(v.orbit.camera().pack(), camera)


@pytest.mark.slow
def test_a_click_on_the_view_list_opens_it_without_further_input(walker_cpu, monkeypatch):
    """A click on the view combo with the pointer held still: its list (a popup window imgui shows
    a frame or two after the click) is on screen once the window stops asking for frames."""
    from imgui_bundle import imgui
    combos = _item_rects(monkeypatch, "combo")
    v = Viewer("scenes/heat_sink.py", walker=walker_cpu, size=(400, 560), settings=FAST)
    window = offscreen_window(v)
    asked, settle = _on_demand(window, monkeypatch)
    windows = []
    real_draw = window.canvas.draw

    def draw():
        real_draw()
        windows.append(imgui.get_draw_data().cmd_lists_count)
    monkeypatch.setattr(window.canvas, "draw", draw)
    window.canvas.draw()
    asked.append(())
    settle()
    lo, hi = combos["view"]
    x, y = (lo.x + hi.x) / 2, (lo.y + hi.y) / 2
    _pointer(window, "pointer_move", x, y, buttons=(), draw=False)
    settle()
    before = windows[-1]
    _pointer(window, "pointer_down", x, y, draw=False)
    _pointer(window, "pointer_up", x, y, buttons=(), draw=False)
    settle()
    assert windows[-1] > before, "the click did not open the view list"
    assert v.view == "shade"


@pytest.mark.slow
def test_a_press_on_a_slider_before_its_frame_never_turns_the_view(walker_cpu, monkeypatch):
    """A pointer that jumps onto a slider and presses before a frame is drawn there (slow frames,
    a jump of the pointer) reaches the orbit as well as the panel, which takes the drag's moves
    and its release (here left of the window): the view must not turn, neither during the drag
    nor when the pointer moves on with no button down."""
    rects = _item_rects(monkeypatch)
    v = Viewer("scenes/heat_sink.py", walker=walker_cpu, size=(320, 360), settings=FAST)
    window = offscreen_window(v)
    window.canvas.draw()
    lo_xy, hi_xy = rects["fin_height"]
    x, y = (lo_xy.x + hi_xy.x) / 2, (lo_xy.y + hi_xy.y) / 2
    camera = v.orbit.camera().pack().copy()

    _pointer(window, "pointer_move", 300, 300, buttons=())
    _pointer(window, "pointer_move", x, y, buttons=(), draw=False)      # the jump: no frame before the press
    _pointer(window, "pointer_down", x, y)
    for i in range(1, 40):
        _pointer(window, "pointer_move", x - 8 * i, y)
    _pointer(window, "pointer_up", x - 320, y)
    for px, py in ((250, 300), (200, 200), (260, 120)):
        _pointer(window, "pointer_move", px, py, buttons=())
    assert v.params["fin_height"] == pytest.approx(v.param_range("fin_height")[0])
    assert np.array_equal(v.orbit.camera().pack(), camera)


@pytest.mark.slow
def test_slider_drag_past_the_end_stays_in_the_range_fixed_at_load(walker_cpu, monkeypatch):
    """A real imgui drag of heat_sink's fin_height slider (pointer events through the offscreen
    canvas, one frame each) from its middle far past its right end and back past its left end:
    every frame's value lies in the range fixed when the scene loaded, the range never moves, the
    drag reaches both ends, the other sliders stay put, and the drag is one undo step."""
    rects = _item_rects(monkeypatch)
    v = Viewer("scenes/heat_sink.py", walker=walker_cpu, size=(320, 360), settings=FAST)
    loaded = {name: v.param_range(name) for name in v.params}
    assert loaded["fin_height"] == pytest.approx((0.25 * 0.03, 2.5 * 0.03))
    window = offscreen_window(v)
    window.canvas.draw()
    lo_xy, hi_xy = rects["fin_height"]
    y = (lo_xy.y + hi_xy.y) / 2
    right = [((lo_xy.x + hi_xy.x) / 2 + 6 * i, y) for i in range(60)]         # to 200+ px past the end
    left = [(right[-1][0] - 8 * i, y) for i in range(1, 80)]                  # back to 300+ px before it
    seen = _press_and_drag(window, right + left)
    for frame in seen:
        assert {name: r for name, (_, r) in frame.items()} == loaded
        for name, (value, (lo, hi)) in frame.items():
            assert lo <= value <= hi, (name, value, lo, hi)
    heights = [frame["fin_height"][0] for frame in seen]
    lo, hi = loaded["fin_height"]
    assert max(heights) == pytest.approx(hi) and min(heights) == pytest.approx(lo)
    assert v.params["base_thickness"] == pytest.approx(0.006)
    assert len(v.undo_stack) == 1 and v.undo() and v.params["fin_height"] == pytest.approx(0.03)
    assert v.param_range("fin_height") == loaded["fin_height"]
    # a slider value past the end (typed in, say) is clamped into the range as well
    window.set_param("fin_height", 10.0)
    assert v.params["fin_height"] == pytest.approx(hi)


def test_slider_ranges_are_fixed_at_load_through_edits_undo_and_scene_edits(walker_cpu):
    """Ranges come from the values the scene loaded with and stay through slider moves (even past
    the range), undo and redo; a scene edit keeps the ranges of the names it shares, gives its new
    names ranges of their own values (0 and negative ones too), and its undo / redo bring back the
    ranges of the scene they restore."""
    v = _viewer(walker_cpu)
    radius = v.param_range("radius")
    assert radius == pytest.approx((0.0875, 0.875)) and v.param_range("width") == pytest.approx((0.3, 3.0))
    for value in (0.8, 5.0, 0.01):
        v.set_param("radius", value)
        assert v.param_range("radius") == radius
    v.undo()
    assert v.params["radius"] == pytest.approx(5.0) and v.param_range("radius") == radius
    v.undo()
    v.redo()
    assert v.param_range("radius") == radius
    bumps = union(_scene(), sphere(Param("bump", 0.2)).translate(Param("shift", 0.0), 0.0, Param("drop", -0.4)))
    v.set_scene(bumps)
    assert v.param_range("radius") == radius and v.params["radius"] == pytest.approx(5.0)
    assert v.param_range("bump") == pytest.approx((0.05, 0.5))
    assert v.param_range("drop") == pytest.approx((-1.0, -0.1))
    lo, hi = v.param_range("shift")
    assert lo == -hi and 0.1 < hi < 10
    assert default_range(0.0, [[0, 0, 0], [0, 0, 0]]) == (-1e-3, 1e-3)
    edited = dict(bump=v.param_range("bump"), shift=(lo, hi))
    v.set_param("bump", 0.45)
    assert v.param_range("bump") == edited["bump"]
    v.undo()
    v.undo()                                                    # the scene edit
    with pytest.raises(TaperayError, match="no parameter named 'bump'"):
        v.param_range("bump")
    assert v.param_range("radius") == radius
    v.redo()
    assert v.param_range("bump") == edited["bump"] and v.param_range("shift") == edited["shift"]


def test_panel_is_drawn_on_the_first_frame_and_sized_to_the_window(walker_cpu):
    """The first offscreen frame of a window with the panel shows the panel (imgui measures a new
    window in a frame it hides: the window spends that frame before its first); in a 320-pixel
    window it takes about half the width at most (120 px, widened to fit heat_sink's longest name
    on one line), and right of it the frame is the walker's."""
    v = Viewer("scenes/heat_sink.py", walker=walker_cpu, size=(320, 200), settings=FAST)
    first = np.asarray(offscreen_window(v).canvas.draw())[..., :3].astype(int)
    plain = v.frame().astype(int)
    differs = np.nonzero((first != plain).any(axis=(0, 2)))[0]
    assert differs.size > 0 and differs.min() <= PANEL_MARGIN + 2
    assert differs.max() < 0.55 * 320
    panel = first[20:60, 15:100]
    assert panel.mean() < plain[20:60, 15:100].mean() - 40 and (panel > 200).any()
    assert (panel_width(320), panel_width(960), panel_width(4000)) == (120, 320, 360)
    assert panel_width(320, 150.0) == 150 and panel_width(100) == 100 - 2 * PANEL_MARGIN


def test_view_without_a_display_is_one_line_of_error(monkeypatch):
    """``taperay view`` with no display (none set, or one that does not answer) exits 2 with one
    line naming the scene and --offscreen, before any window is made (no glfw abort)."""
    pytest.importorskip("glfw")
    if not sys.platform.startswith("linux"):
        pytest.skip("DISPLAY / WAYLAND_DISPLAY are Linux's")
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    for display, reason in ((None, "(DISPLAY is not set)"), (":1234", ":1234")):
        if display is None:
            monkeypatch.delenv("DISPLAY", raising=False)
        else:
            monkeypatch.setenv("DISPLAY", display)
        run = subprocess.run([sys.executable, "-m", "taperay.tools.cli", "view", "scenes/heat_sink.py",
                              "--walker", "cpu"], capture_output=True, text=True, timeout=120)
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 2 and len(lines) == 1, run.stderr[-2000:]
        assert lines[0].startswith("taperay: error: heat_sink.py: no display to open a window on")
        assert reason in lines[0] and "--offscreen" in lines[0]


def test_frames_are_the_walkers_render(walker_cpu):
    """The viewer's frame is exactly the walker's render of its tape by the orbit camera (its
    primary rays ending within a pixel's footprint; with cone 0 at hit_eps, as `taperay render`
    draws), and the draft is the half-size render without shadows."""
    from dataclasses import replace
    v = Viewer(_scene(), walker=walker_cpu, size=SIZE)
    cam = v.orbit.camera()
    assert v.frame_settings().hit_cone == pytest.approx(cam.pixel_angle(SIZE[1]))
    assert v.frame_settings() == replace(v.settings, hit_cone=v.frame_settings().hit_cone)
    assert np.array_equal(v.frame(), walker_cpu.render(v.tape, cam, *SIZE, "shade", v.frame_settings()))
    exact = Viewer(_scene(), walker=walker_cpu, size=SIZE, cone=0)
    assert exact.frame_settings() == exact.settings
    assert np.array_equal(exact.frame(), walker_cpu.render(v.tape, cam, *SIZE, "shade", v.settings))
    assert exact.draft_settings().hit_cone == v.draft_settings().hit_cone > 0
    with pytest.raises(TaperayError, match="hit cone"):
        Viewer(_scene(), walker=walker_cpu, size=SIZE, cone=-1)
    draft = v.frame(draft=True)
    assert draft.shape == (SIZE[1] // 2, SIZE[0] // 2, 3)
    assert np.array_equal(draft, walker_cpu.render(v.tape, cam, SIZE[0] // 2, SIZE[1] // 2, "shade",
                                                   v.draft_settings()))


def test_a_draft_ends_its_rays_within_a_draft_pixel(walker_cpu):
    """The draft's primary rays hit within a draft pixel's footprint (hit_cone: the camera's
    angle of a row at the draft's height; the full frame's threshold untouched): on the
    showcase, fewer march steps than with the full frame's threshold, every hit of that
    threshold kept, and the rays that now hit (passing within a footprint of the part) on its
    outline: all but a few next to a pixel that hit before."""
    from dataclasses import replace
    v = Viewer("scenes/machined_part.py", walker=walker_cpu, size=(480, 320))
    cam, (w, h) = v.orbit.camera(), v.draft_size()
    assert v.settings.hit_cone == 0.0 and v.draft_settings().hit_cone == pytest.approx(cam.pixel_angle(h))
    cone = walker_cpu.march(v.tape, cam, w, h, settings=v.draft_settings())
    plain = walker_cpu.march(v.tape, cam, w, h, settings=replace(v.draft_settings(), hit_cone=0.0))
    assert cone["steps"].sum() < 0.9 * plain["steps"].sum()
    assert plain["hit"].mean() > 0.05 and not (plain["hit"] & ~cone["hit"]).any()
    extra, hits = cone["hit"] & ~plain["hit"], np.pad(plain["hit"], 1)
    beside_a_hit = np.zeros_like(extra)
    for dy in (-1, 0, 1):
        for dx in (-1, 0, 1):
            beside_a_hit |= hits[1 + dy:1 + dy + h, 1 + dx:1 + dx + w]
    assert extra.sum() > 20 and (extra & ~beside_a_hit).sum() <= 0.02 * extra.sum()


def test_present_pipeline_draws_the_walkers_image(walkers_all):
    """The window's texture holds the walker's image, pixel for pixel (the GPU walker's from its
    own buffer, never read back; the twin's uploaded)."""
    v = _viewer(walkers_all)
    window = offscreen_window(v, panel=False)
    shown = _draw(window)
    assert np.array_equal(shown, walkers_all.render(v.tape, v.orbit.camera(), *SIZE, "shade", v.frame_settings()))
    # the present pipeline is made once per device and format: a second window on the same
    # device makes none
    made = window.kernels.stats.pipelines_created
    again = offscreen_window(Viewer(_scene(), walker=walkers_all, size=SIZE, settings=FAST), panel=False)
    assert again.kernels is window.kernels and again.pipeline is window.pipeline
    assert window.kernels.present_formats == (window.format,)
    assert np.array_equal(_draw(again), shown) and window.kernels.stats.pipelines_created == made


def test_path_view_refines_while_still_and_restarts_after_any_change(walkers_all):
    """The path view adds PATH_SPP_PER_FRAME samples per full frame, its picture is the path
    image of those samples (the same sequence traced in one go), and a slider edit, a camera move
    or a topology edit starts it again; drafts are shaded frames; in a window it keeps drawing while
    it refines, and no pipeline is created by its edits."""
    from taperay.runtime.path_tracing import PathImage
    from taperay.tools.viewer import PATH_SPP_PER_FRAME
    v = _viewer(walkers_all, view="path")
    window = offscreen_window(v, panel=False)
    _draw(window)
    window.kernels.settle()
    made = window.kernels.stats.pipelines_created
    v.frame()
    v.frame()
    assert v.stats.path_samples == 3 * PATH_SPP_PER_FRAME and v.refining
    once = PathImage(walkers_all, v.tape, v.orbit.camera(), *SIZE, v.settings).add(3 * PATH_SPP_PER_FRAME)
    assert np.abs(v.frame().astype(int) - once.add(PATH_SPP_PER_FRAME).rgb8()).max() <= 1
    assert any("samples per pixel" in line for line in v.overlay_lines())
    for edit in (lambda: v.set_param("radius", 0.3), lambda: v.orbit.rotate(10.0, 0.0),
                 lambda: v.set_scene(union(_scene(), sphere(0.2).translate(0.8, 0.0, 0.0)))):
        edit()
        v.frame()
        assert v.stats.path_samples == PATH_SPP_PER_FRAME
    draft = v.frame(draft=True)
    assert np.array_equal(draft, walkers_all.render(v.tape, v.orbit.camera(), SIZE[0] // 2, SIZE[1] // 2, "shade",
                                                    v.draft_settings()))
    before = v.stats.path_samples
    window.draw()                                   # still: the window draws the next samples by itself
    window.draw()
    assert v.stats.path_samples > before
    assert window.kernels.stats.pipelines_created == made
    v.set_view("shade")
    assert not v.refining
    with pytest.raises(TaperayError, match="unknown view"):
        v.set_view("paths")


def test_orbit_moves_the_camera_and_keeps_the_target():
    o = Orbit.framing([[-1, -1, -1], [1, 1, 1]])
    eye0 = np.array(o.camera().eye)
    o.rotate(90, 0)
    assert np.linalg.norm(np.array(o.camera().eye) - eye0) > 1
    o.zoom(0.5)
    assert np.linalg.norm(np.array(o.camera().eye) - np.array(o.target)) == pytest.approx(o.distance)
    o.rotate(0, 500)
    assert o.elevation == 89.0
    o.pan(0.1, 0)
    assert np.array(o.target)[0] != 0 or np.array(o.target)[1] != 0
    with pytest.raises(TaperayError):
        o.zoom(0)


def test_save_as_writes_the_edited_scene_atomically(walker_cpu, tmp_path):
    v = _viewer(walker_cpu)
    v.set_param("radius", 0.5)
    saved = load_file(v.save_as(tmp_path / "edited.scene"))
    assert Viewer(saved, walker=walker_cpu, size=SIZE).params["radius"] == pytest.approx(0.5)
    v.save_as(tmp_path / "edited.tape")
    assert load_file(tmp_path / "edited.tape").params.tobytes() == v.tape.params.tobytes()
    with pytest.raises(TaperayError, match="save as .scene or .tape"):
        v.save_as(tmp_path / "edited.png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["edited.scene", "edited.tape"]


def test_bad_input_is_a_clear_error(walker_cpu, tmp_path):
    v = _viewer(walker_cpu)
    with pytest.raises(TaperayError, match="no parameter named 'depth'"):
        v.set_param("depth", 1.0)
    with pytest.raises(TaperayError, match="not a finite number"):
        v.set_param("radius", float("nan"))
    with pytest.raises(TaperayError, match="unknown view"):
        v.set_view("xray")
    bad = tmp_path / "ranges.py"
    bad.write_text("from taperay.scenegraph import sphere, Param\nscene = sphere(Param('r', 1))\nranges = {'r': (2, 1)}\n")
    with pytest.raises(TaperayError, match=r"ranges\['r'\].*lo < hi"):
        Viewer(bad, walker=walker_cpu, size=SIZE)


_RANGED = "from taperay.scenegraph import sphere, Param\nscene = sphere(Param('r', {r}))\nranges = {ranges}\n"


def test_scene_file_ranges_drive_the_sliders(walker_cpu, tmp_path):
    """A scene file's ``ranges`` are its sliders' ranges, through moves past them and undo; one
    naming no parameter or not holding the file's value is an error naming the file."""
    path = tmp_path / "ranged.py"
    path.write_text(_RANGED.format(r=1, ranges="{'r': (0.5, 3)}"))
    v = Viewer(path, walker=walker_cpu, size=SIZE)
    assert v.param_range("r") == (0.5, 3.0)
    v.set_param("r", 2.9)
    v.set_param("r", 7.0)
    v.undo()
    assert v.param_range("r") == (0.5, 3.0)
    path.write_text(_RANGED.format(r=0.03, ranges="{'r': (0.03, 0.06)}"))     # (0.03 is a float32 in the pool)
    assert Viewer(path, walker=walker_cpu, size=SIZE).param_range("r") == (0.03, 0.06)
    path.write_text(_RANGED.format(r=1, ranges="{'radius': (0.5, 3)}"))
    with pytest.raises(TaperayError, match=r"ranged.py: ranges\['radius'\] names no parameter.*its parameters: r"):
        Viewer(path, walker=walker_cpu, size=SIZE)
    path.write_text(_RANGED.format(r=4, ranges="{'r': (0.5, 3)}"))
    with pytest.raises(TaperayError, match=r"ranged.py: ranges\['r'\] = \(0.5, 3\) does not hold the parameter's value 4"):
        Viewer(path, walker=walker_cpu, size=SIZE)


def _save(path, text):
    """Write the scene file with a modification time a second later (the watcher compares them)."""
    path.write_text(text)
    os.utime(path, ns=(path.stat().st_mtime_ns + 1_000_000_000,) * 2)


def _draw_until_run_done(window):
    """Draw frames (the window polls its watcher in each) until the file's run has been taken in."""
    window.canvas.draw()                   # notices the save, starts the child
    while window.watcher.running:
        time.sleep(0.05)
        window.canvas.draw()


@pytest.mark.slow
def test_watch_reload_ranges_and_errors_on_stderr(walker_cpu, tmp_path, capsys):
    """A saved file's run (in its child process) brings its declared ranges, keeps the range of a
    name it shares and makes one for a new name; an error in a later save is printed on stderr as
    one line naming the file, shown in the panel, and leaves the scene and its ranges."""
    path = tmp_path / "live.py"
    path.write_text("from taperay.scenegraph import sphere, Param\nscene = sphere(Param('r', 1))\n")
    window = offscreen_window(Viewer(path, walker=walker_cpu, size=SIZE, settings=FAST), watch=True)
    v = window.viewer
    assert v.param_range("r") == (0.25, 2.5)
    _save(path, "from taperay.scenegraph import box, Param\n"
                "scene = box(Param('r', 1), Param('w', 0.5), Param('h', 0.2))\nranges = {'h': (0.1, 0.9)}\n")
    _draw_until_run_done(window)
    assert window.message == "" and set(v.params) == {"r", "w", "h"}
    assert v.stats.draft                   # the new scene's first frame is a draft ...
    time.sleep(SETTLE_S)
    window.canvas.draw()
    assert not v.stats.draft and v.stats.size == SIZE     # ... and the full frame follows once still
    assert (v.param_range("r"), v.param_range("w"), v.param_range("h")) == ((0.25, 2.5), (0.125, 1.25), (0.1, 0.9))
    records = len(v.tape.instrs)
    capsys.readouterr()
    _save(path, "raise ValueError('the fillet is too big\\nfor the fin')\n")
    _draw_until_run_done(window)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"taperay: watch: {path}") and "the fillet is too big" in err[0]
    assert window.message == err[0].removeprefix("taperay: watch: ")
    assert len(v.tape.instrs) == records and v.param_range("h") == (0.1, 0.9)
    _save(path, "from taperay.scenegraph import sphere, Param\nscene = sphere(Param('r', 1))\nranges = {'q': (0, 1)}\n")
    _draw_until_run_done(window)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{path}: ranges['q'] names no parameter" in err[0]


_GOOD = "from taperay.scenegraph import sphere, box, union\nscene = {body}\n"


@pytest.mark.slow
def test_watch_reruns_the_file_and_keeps_the_last_good_scene(walker_cpu, tmp_path):
    """Saves of the scene file re-run it in a child process: a good save replaces the scene (by a
    new tape), a raising one, an invalid one or one past the timeout leaves the last good scene and
    reports why."""
    path = tmp_path / "live.py"
    path.write_text(_GOOD.format(body="sphere(0.5)"))
    window = offscreen_window(Viewer(path, walker=walker_cpu, size=SIZE, settings=FAST), watch=True, panel=False)
    window.watcher.timeout = 20.0
    first = _draw(window)

    def save(text):
        path.write_text(text)
        os.utime(path, ns=(path.stat().st_mtime_ns + 1_000_000_000,) * 2)
        return window.watcher.wait()

    result = save(_GOOD.format(body="union(sphere(0.5), box(1.2, 0.2, 0.2))"))
    assert result is not None and not result.error and result.tape is not None
    window.viewer.set_scene(result.tape, label="saved")
    second = _draw(window)
    assert not np.array_equal(first, second)
    records = len(window.viewer.tape.instrs)

    result = save("raise ValueError('the fillet is too big')\n")
    assert "the fillet is too big" in result.error
    result = save(_GOOD.format(body="sphere(-1.0)"))
    assert result.error and result.tape is None
    window.watcher.timeout = 1.0
    result = save("import time\ntime.sleep(30)\n")
    assert "ran past 1 s" in result.error
    assert len(window.viewer.tape.instrs) == records and np.array_equal(_draw(window), second)


@pytest.mark.slow
def test_view_command_offscreen_reports_edits_and_screenshot(tmp_path, capsys):
    out, shot = tmp_path / "edits.json", tmp_path / "shot.png"
    code = main(["view", "scenes/heat_sink.py", "--walker", "cpu", "--offscreen", "--size", "320x200",
                 "--edits", "3", "--topology-edits", "2", "--json", str(out), "--screenshot", str(shot)])
    assert code == 0, capsys.readouterr().err
    import json
    report = json.loads(out.read_text())
    assert [r["kind"] for r in report["edits"]].count("topology") == 2 and len(report["edits"]) == 5
    assert all(r["latency_ms"] > 0 and r["pipelines_created"] == 0 for r in report["edits"])
    assert all(0 < r["edit_ms"] and r["edit_ms"] + r["frame_ms"] < r["latency_ms"] for r in report["edits"])
    from PIL import Image
    image = np.asarray(Image.open(shot))
    assert image.shape == (200, 320, 3) and image.std() > 0
    assert "slider:" in capsys.readouterr().out


def test_view_command_rejects_offscreen_options_without_offscreen(capsys):
    assert main(["view", "scenes/heat_sink.py", "--edits", "3"]) == 2
    assert "add --offscreen" in capsys.readouterr().err


def test_notebook_viewer_sliders_edit_the_scene(walker_cpu):
    pytest.importorskip("ipywidgets")
    pytest.importorskip("jupyter_rfb")
    from taperay.tools.view_window import notebook_viewer
    box_ = notebook_viewer(_scene(), walker=walker_cpu, size=SIZE)
    sliders = {w.description: w for w in box_.children if hasattr(w, "min")}
    assert set(sliders) == {"radius", "width"}
    sliders["radius"].value = 0.42
    assert box_.window.viewer.params["radius"] == pytest.approx(0.42)


@pytest.mark.slow
def test_window_screenshot_under_xvfb(tmp_path):
    """The real glfw window under Xvfb (``open_window``: the scene loaded in a thread, then the
    window): a frame of the scene with the panel's overlay, read back from the window's own
    texture; a scene that fails to load closes the window and raises its error. Without Xvfb it skips, except in CI (TAPERAY_REQUIRE_GPU=1),
    where test.sh installs it."""
    if shutil.which("Xvfb") is None:
        if os.environ.get("TAPERAY_REQUIRE_GPU") == "1":
            pytest.fail("TAPERAY_REQUIRE_GPU=1 but Xvfb is not installed (tools/setup_env.sh ensure_xvfb)")
        pytest.skip("Xvfb is not installed (apt-get install xvfb)")
    pytest.importorskip("glfw")
    pytest.importorskip("imgui_bundle")
    script = tmp_path / "shot.py"
    script.write_text(textwrap.dedent("""
        import numpy as np, sys
        from PIL import Image
        from taperay.runtime.shading import RenderSettings
        from taperay.runtime.tape import TaperayError
        from taperay.tools.viewer import Viewer
        from taperay.tools.view_window import open_window
        made, shots = [], []

        def make_viewer():
            made.append(Viewer("scenes/heat_sink.py", walker="cpu", size=(480, 320),
                               settings=RenderSettings(shadows="off", ao_strength=0.0)))
            return made[-1]

        def grab(window):
            # the texture the panel was drawn into, copied out before it is presented
            tex = window.context.get_current_texture()
            data = window.device.queue.read_texture(
                {"texture": tex, "origin": (0, 0, 0), "mip_level": 0},
                {"offset": 0, "bytes_per_row": tex.size[0] * 4}, tex.size)
            img = np.frombuffer(data, np.uint8).reshape(tex.size[1], tex.size[0], 4)[..., :3]
            shots.append(img[..., ::-1] if window.format.startswith("bgra") else img)

        def ready(window):
            def draw():
                window.draw()
                grab(window)
                if len(shots) >= 2:
                    window.canvas.close()
                else:
                    window.canvas.request_draw()
            window.canvas.request_draw(draw)

        open_window(make_viewer, "heat_sink.py", (480, 320), on_ready=ready)
        Image.fromarray(np.ascontiguousarray(shots[-1])).save(sys.argv[1])
        Image.fromarray(made[0].frame()).save(sys.argv[2])

        def broken():
            raise TaperayError("broken.py: the scene file raised ValueError: boom")
        try:
            open_window(broken, "broken.py", (320, 200))
        except TaperayError as e:
            print("raised:", e)
    """))
    shot, frame = tmp_path / "window.png", tmp_path / "frame.png"
    env = dict(os.environ)
    xvfb = subprocess.Popen(["Xvfb", ":97", "-screen", "0", "800x600x24"], stderr=subprocess.DEVNULL)
    try:
        env["DISPLAY"] = ":97"
        env.pop("WAYLAND_DISPLAY", None)
        run = subprocess.run([sys.executable, str(script), str(shot), str(frame)], cwd=os.getcwd(), env=env,
                             capture_output=True, text=True, timeout=240)
    finally:
        xvfb.terminate()
        xvfb.wait()
    assert run.returncode == 0, run.stderr[-3000:]
    assert "raised: broken.py: the scene file raised ValueError: boom" in run.stdout
    from PIL import Image
    img = np.asarray(Image.open(shot)).astype(int)
    render = np.asarray(Image.open(frame)).astype(int)
    assert img.shape == render.shape == (320, 480, 3)
    # right of the panel the window shows the walker's frame pixel for pixel, and there the
    # frame has the heat sink's fins (not just background)
    right = slice(PANEL_MARGIN + int(panel_width(480)) + 40, None)
    assert np.array_equal(img[:, right], render[:, right])
    assert render[:, right].std() > 10
    # the panel: imgui's dark window with the overlay's light text, over the frame
    panel = img[15:60, 15:int(panel_width(480)) - 15]
    assert panel.mean() < render[15:60, 15:int(panel_width(480)) - 15].mean() - 40 and (panel > 200).any()


def test_a_missing_viewer_package_is_one_line_naming_the_extra(monkeypatch):
    """./run.sh installs the runtime without the ``view`` extra: ``taperay view`` then says which
    package is missing and how to install it (it was an internal ModuleNotFoundError)."""
    import importlib.util
    from taperay.tools.view_window import need_view_packages
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "glfw" else real(name, *a))
    with pytest.raises(TaperayError, match=r"needs the optional package glfw: pip install 'taperay\[view\]'"):
        need_view_packages("glfw", "imgui_bundle")
    need_view_packages("imgui_bundle")
