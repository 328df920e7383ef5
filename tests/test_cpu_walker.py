"""The CPU twin as a renderer: marching against analytic ray-sphere answers, every view, the pixel
convention of ``runtime.camera``, the packed settings layout, field images and PNG writing."""
import numpy as np
import pytest
from PIL import Image

from conftest import evaluate_one_by_one
from taperay.runtime.camera import Camera, auto_camera
from taperay.runtime.image import write_png
from taperay.runtime.opcodes import Op
from taperay.runtime.shading import PACK_FIELDS, PACK_LEN, VIEWS, RenderSettings, unpack
from taperay.runtime.tape import INSTR_DTYPE, Tape, TaperayError, material_array

W, H = 64, 48
R = 0.8
MATS = material_array([(0.8, 0.3, 0.2), (0.2, 0.4, 0.8)], [0.4, 0.6])


def make_tape(rows, params, bounds):
    recs = np.array([tuple(int(v) for v in r) + (0,) * (8 - len(r)) for r in rows], INSTR_DTYPE)
    n_regs = 1 + int(max(max(r[1:5]) if len(r) > 1 else 0 for r in rows))
    return Tape(recs, np.array(params, np.float32), MATS, n_regs, np.array(bounds, np.float32))


SPHERE = make_tape([(Op.SPHERE, 0, 0, 0, 0, 0, 1)], [R], [[-R] * 3, [R] * 3])
CAM = Camera((0.4, -3.0, 0.6), (0.0, 0.0, 0.0), fov_deg=40)


def analytic(cam, w, h):
    """Ray-sphere hit t (inf on a miss) and each ray's closest approach to the centre."""
    eye, d = cam.rays(w, h)
    o, d = eye.astype(np.float64), d.astype(np.float64)
    b = d @ o
    closest = np.sqrt(np.maximum(o @ o - b * b, 0))
    disc = b * b - (o @ o - R * R)
    t = np.where(disc >= 0, -b - np.sqrt(np.maximum(disc, 0)), np.inf)
    return t, closest, d


def test_march_hit_mask_and_depth_match_the_analytic_sphere(walker_cpu):
    st = RenderSettings()
    mr = walker_cpu.march(SPHERE, CAM, W, H, st)
    t_ref, closest, d = analytic(CAM, W, H)
    clear = np.abs(closest - R) > 0.01                 # away from the silhouette
    assert np.array_equal(mr["hit"][clear], np.isfinite(t_ref)[clear])
    assert 0.2 < mr["hit"].mean() < 0.8
    both = mr["hit"] & np.isfinite(t_ref) & clear
    eps = float(unpack(st.pack(SPHERE), "hit_eps")[0])
    p = CAM.rays(W, H)[0].astype(np.float64) + np.where(both, t_ref, 0)[..., None] * d
    cos = np.abs(np.sum(p / R * d, -1))
    err = (t_ref[both] - mr["t"][both]) * cos[both]    # the march stops within eps of the surface
    assert np.all(err >= -1e-5) and np.all(err <= eps + 1e-5)
    assert np.all(np.isinf(mr["t"][~mr["hit"]]))
    n_ref = p / R
    assert np.all(np.sum(mr["normal"][both] * n_ref[both], -1) > 1 - 1e-4)
    assert np.all(mr["mat"][mr["hit"]] == 1)
    assert mr["steps"].dtype == np.int32 and mr["steps"].max() <= st.max_steps


def test_every_view_renders_an_image(walker_cpu):
    images = {}
    for view in VIEWS:
        img = walker_cpu.render(SPHERE, CAM, W, H, view)
        assert img.shape == (H, W, 3) and img.dtype == np.uint8
        assert len(np.unique(img.reshape(-1, 3), axis=0)) > (2 if view == "gradient" else 4), view
        images[view] = img
    hit = walker_cpu.march(SPHERE, CAM, W, H)["hit"]
    bg = images["shade"][0, 0]
    assert np.all(images["shade"][~hit] == bg)
    assert not np.any(np.all(images["shade"][hit] == bg, axis=-1))
    green = np.array([0.2, 0.75, 0.3]) * 255                       # |grad f| = 1 on a sphere
    assert np.mean(np.all(np.abs(images["gradient"][hit] - green) < 12, axis=-1)) > 0.95
    with pytest.raises(TaperayError):
        walker_cpu.render(SPHERE, CAM, W, H, "xray")


def test_section_view_caps_the_cut_with_the_cut_material(walker_cpu):
    st = RenderSettings(plane_normal=(0, -1, 0), plane_offset=0.0)   # keep y >= 0; cap faces -y
    mr = walker_cpu.march(SPHERE, CAM, W, H, st, view="section")
    eye, d = CAM.rays(W, H)
    t_plane = -eye[1] / d[..., 1]
    p = eye + t_plane[..., None] * d
    inside_disc = np.hypot(p[..., 0], p[..., 2]) < R - 0.02
    assert inside_disc.sum() > 50
    assert np.all(mr["hit"][inside_disc])
    assert np.allclose(mr["t"][inside_disc], t_plane[inside_disc], atol=1e-3)
    assert np.all(mr["normal"][inside_disc] @ np.array([0, -1, 0]) > 0.999)
    assert np.all(mr["mat"][inside_disc] == 1)


def test_hard_shadows_darken_the_floor_below_a_sphere(walker_cpu):
    floor_sphere = make_tape([(Op.BOX, 0, 0, 0, 0, 0, 0), (Op.PUSH,), (Op.TRANSLATE, 0, 0, 0, 0, 3),
                              (Op.SPHERE, 1, 0, 0, 0, 6, 1), (Op.POP,), (Op.UNION, 0, 0, 1)],
                             [2, 2, 0.1, 0, 0, 0.8, 0.5], [[-2, -2, -0.1], [2, 2, 1.3]])
    cam = Camera((0, -6, 4), (0, 0, 0.3))
    off = walker_cpu.render(floor_sphere, cam, W, H, "shade", RenderSettings(shadows="off", ao_strength=0,
                                                                               key_dir=(0, 0, 1)))
    on = walker_cpu.render(floor_sphere, cam, W, H, "shade", RenderSettings(shadows="hard", ao_strength=0,
                                                                              key_dir=(0, 0, 1)))
    soft = walker_cpu.render(floor_sphere, cam, W, H, "shade", RenderSettings(shadows="soft", ao_strength=0,
                                                                                key_dir=(0, 0, 1)))
    darker = off.astype(int).sum(-1) - on.astype(int).sum(-1)
    assert np.all(darker >= 0)
    assert (darker > 60).sum() > 20                    # the shadow disc under the sphere
    assert np.all(soft.astype(int).sum(-1) <= off.astype(int).sum(-1))


def test_field_image_is_y_up_with_pixel_centres(walker_cpu):
    plane_y = make_tape([(Op.PLANE, 0, 0, 0, 0, 0, 0)], [0, 1, 0, 0], [[-1] * 3, [1] * 3])
    plane_x = make_tape([(Op.PLANE, 0, 0, 0, 0, 0, 0)], [1, 0, 0, 0], [[-1] * 3, [1] * 3])
    fy = walker_cpu.field_image(plane_y, 8, 6, rect=(-1, 1, -3, 3))
    fx = walker_cpu.field_image(plane_x, 8, 6, rect=(-1, 1, -3, 3))
    assert fy.shape == (6, 8) and fy.dtype == np.float32
    assert np.allclose(fy[:, 0], [2.5, 1.5, 0.5, -0.5, -1.5, -2.5])      # row 0 is the top (y up)
    assert np.allclose(fx[0], -1 + (np.arange(8) + 0.5) * 0.25)         # column 0 is x0
    sph = walker_cpu.field_image(SPHERE, 5, 5, rect=(-1, 1, -1, 1), z=0.5)
    assert np.isclose(sph[2, 2], 0.5 - R)


def test_gradient_of_a_sphere_is_the_radial_unit_vector(walker_cpu):
    p = np.random.default_rng(3).uniform(-1.5, 1.5, (500, 3)).astype(np.float32)
    p = p[np.linalg.norm(p, axis=1) > 0.2]
    g = walker_cpu.gradient(SPHERE, p)
    assert g.shape == p.shape and g.dtype == np.float32
    assert np.allclose(g, p / np.linalg.norm(p, axis=1, keepdims=True), atol=2e-3)


def test_evaluate_shapes_and_errors(walker_cpu):
    d, m = walker_cpu.evaluate(SPHERE, np.zeros((0, 3), np.float32))
    assert d.shape == (0,) and m.shape == (0,)
    with pytest.raises(TaperayError):
        walker_cpu.evaluate(SPHERE, np.zeros((4, 2), np.float32))


def test_pixel_convention():
    cam = Camera((1.0, -4.0, 2.0), (0.0, 0.5, 0.0), fov_deg=50)
    eye, d = cam.rays(5, 3)
    fwd, right, up = cam.basis()
    assert np.allclose(np.linalg.norm(d, axis=-1), 1, atol=1e-6)
    assert np.allclose(d[1, 2], fwd, atol=1e-6)                  # the centre pixel looks forward
    assert np.all(d[0] @ up > 0) and np.all(d[2] @ up < 0)        # row 0 is the top
    assert np.all(d[:, 0] @ right < 0) and np.all(d[:, 4] @ right > 0)
    th = np.tan(np.radians(25))
    ndc = np.array([(2 * 4.5 / 5 - 1) * 5 / 3 * th, (1 - 2 * 0.5 / 3) * th])
    want = fwd + ndc[0] * right + ndc[1] * up
    assert np.allclose(d[0, 4], want / np.linalg.norm(want), atol=1e-6)
    pk = cam.pack()
    assert pk.dtype == np.float32 and pk.shape == (16,)
    assert np.allclose(pk[:3], cam.eye) and np.isclose(pk[3], th)
    assert np.allclose(pk[4:7], right) and np.allclose(pk[8:11], up) and np.allclose(pk[12:15], fwd)
    f32 = np.float32                    # the docstring's float32 formula in numpy: the same bits
    h, w = 37, 53
    col, row = np.arange(w, dtype=f32), np.arange(h, dtype=f32)
    ndc_x = (f32(2) * (col + f32(0.5)) / f32(w) - f32(1)) * (f32(w) / f32(h)) * pk[3]
    ndc_y = (f32(1) - f32(2) * (row + f32(0.5)) / f32(h)) * pk[3]
    want = pk[12:15] + ndc_x[None, :, None] * pk[4:7] + ndc_y[:, None, None] * pk[8:11]
    assert np.array_equal(cam.rays(w, h)[1], want / np.sqrt(np.sum(want * want, axis=-1, keepdims=True)))


def test_auto_camera_frames_the_bounds(walker_cpu):
    cam = auto_camera(SPHERE.bounds)
    mr = walker_cpu.march(SPHERE, cam, W, H)
    assert mr["hit"][H // 2, W // 2]
    assert not mr["hit"][0].any() and not mr["hit"][-1].any()
    assert not mr["hit"][:, 0].any() and not mr["hit"][:, -1].any()
    straight_down = auto_camera(SPHERE.bounds, elevation_deg=90)
    assert np.all(np.isfinite(straight_down.pack()))


def test_packed_settings_layout():
    offs = sorted(PACK_FIELDS.values())
    assert offs[0][0] == 0 and all(a + s == b for (a, s), (b, _) in zip(offs, offs[1:]))
    end = offs[-1][0] + offs[-1][1]
    assert PACK_LEN % 4 == 0 and end <= PACK_LEN < end + 4          # whole vec4s, the tail zero-padded
    assert not RenderSettings().pack(SPHERE)[end:].any()
    for name, (off, size) in PACK_FIELDS.items():          # a vec3 never straddles a vec4
        assert off // 4 == (off + size - 1) // 4, name
    st = RenderSettings(max_steps=99, hit_eps_rel=1e-3, shadows="soft")
    pk = st.pack(SPHERE, "section")
    diag = np.linalg.norm([2 * R] * 3)
    assert pk.shape == (PACK_LEN,) and pk.dtype == np.float32
    assert unpack(pk, "max_steps")[0] == 99 and np.isclose(unpack(pk, "hit_eps")[0], 1e-3 * diag)
    assert unpack(pk, "shadow_mode")[0] == 2 and unpack(pk, "section")[0] == 1
    assert unpack(pk, "view")[0] == VIEWS.index("section")
    assert np.allclose(unpack(pk, "box_lo"), -R - 0.05 * diag)
    with pytest.raises(TaperayError):
        RenderSettings(shadows="maybe")


def test_write_png_round_trips_atomically(tmp_path):
    img = np.random.default_rng(0).integers(0, 256, (7, 9, 3), dtype=np.uint8)
    path = write_png(tmp_path / "sub" / "a.png", img)
    assert np.array_equal(np.asarray(Image.open(path)), img)
    assert sorted(p.name for p in path.parent.iterdir()) == ["a.png"]
    with pytest.raises(TaperayError):
        write_png(tmp_path / "b.png", img.astype(np.float32))
    assert not (tmp_path / "b.png").exists()


def _split_cull_tapes():
    """Tapes whose culls split blocks: random scenes (nested culls, culls in pattern bodies), the
    grid pattern of a cell with nested culls (_culled_cell), and two culls whose subtrees the points that cull cannot ride
    through (a TRANSLATE outside any PUSH, a cull jumping past its enclosing cull's target),
    placed so that blocks split at both culls."""
    from taperay.runtime.conformance import random_tape
    from taperay.scenegraph import flatten
    rng = np.random.default_rng(7)
    tapes = [random_tape(rng, 5) for _ in range(12)] + [flatten(_culled_cell().grid_pattern((1, 1, 1), (3, 3, 3)))]
    box_a = [1.5, -1.0, -1.0, 2.5, 1.0, 1.0, 0.0]     # points near the origin cull at A ...
    box_b = [1.5, 1.5, -1.0, 2.5, 2.5, 1.0, 0.0]      # ... and points by A but far from B at B
    unbalanced = make_tape([(Op.SPHERE, 0, 0, 0, 0, 0, 0), (Op.CULL_BOX, 1, 0, 0, 0, 1, 1, 5),
                            (Op.TRANSLATE, 0, 0, 0, 0, 8), (Op.SPHERE, 2, 0, 0, 0, 11, 1),
                            (Op.INTERSECT, 1, 2, 1), (Op.UNION, 0, 0, 1), (Op.SPHERE, 1, 0, 0, 0, 12, 0),
                            (Op.UNION, 0, 0, 1)],
                           [0.5] + box_a + [2.0, 0.0, 0.0, 0.5, 0.4], [[-2] * 3, [2] * 3])
    overlapping = make_tape([(Op.SPHERE, 0, 0, 0, 0, 0, 0), (Op.SPHERE, 2, 0, 0, 0, 17, 0),
                             (Op.CULL_BOX, 1, 0, 0, 0, 1, 1, 5), (Op.CULL_BOX, 2, 0, 0, 0, 8, 1, 7),
                             (Op.SPHERE, 3, 0, 0, 0, 15, 1), (Op.SPHERE, 1, 0, 0, 0, 16, 1),
                             (Op.UNION, 0, 0, 1), (Op.UNION, 0, 0, 2)],
                            [0.5] + box_a + box_b + [0.3, 0.2, 0.7], [[-2] * 3, [2] * 3])
    return tapes + list(_live_after_target_tapes()) + [unbalanced, overlapping]


def _culled_cell():
    """A union of three clusters of three spheres: the flattener wraps the last two clusters and
    the last one in culls (nested), the spheres of a cluster in none (scenegraph.flatten,
    CHEAP_PRIMITIVES)."""
    from taperay.scenegraph import sphere, union
    clusters = [union(*(sphere(0.12).translate((0.3 * k - 0.3 + i * 0.05, 0.25 * i - 0.25, 0.0)) for k in range(3)))
                for i in range(3)]
    return union(*clusters)


def _live_after_target_tapes():
    """Two tapes whose culls' subtrees write a register (3) besides the cull's own that is read
    after the target before it is written again: straight after it, and at the top of the next
    copy of a pattern body (REPEAT_END's way back). The points that cull must get it back."""
    box = [-0.2, -1.0, -1.0, 1.0, 1.0, 1.0, 0.0]
    after = make_tape([(Op.SPHERE, 0, 0, 0, 0, 0, 0), (Op.SPHERE, 3, 0, 0, 0, 1, 1),
                       (Op.CULL_BOX, 1, 0, 0, 0, 3, 1, 5), (Op.SPHERE, 3, 0, 0, 0, 2, 1),
                       (Op.INTERSECT, 1, 3, 1), (Op.UNION, 0, 0, 1), (Op.UNION, 0, 0, 3)],
                      [0.5, 0.2, 0.7] + box, [[-2] * 3, [2] * 3])
    back = make_tape([(Op.SPHERE, 3, 0, 0, 0, 0, 1), (Op.REPEAT_LINEAR, 0, 0, 0, 0, 3, 0, 9),
                      (Op.COPY, 2, 3), (Op.SPHERE, 1, 0, 0, 0, 1, 0), (Op.CULL_BOX, 5, 1, 0, 0, 8, 1, 7),
                      (Op.SPHERE, 3, 0, 0, 0, 2, 1), (Op.INTERSECT, 5, 3, 5), (Op.UNION, 1, 1, 5),
                      (Op.UNION, 1, 1, 2), (Op.REPEAT_END, 0, 1, 0, 0, 0, 0, 1)],
                     [0.2, 0.5, 0.7, 1.5, 0.0, 0.0, 3.0, 1.2] + box, [[-2] * 3, [5] * 3])
    return after, back


def _cull_saves(tape):
    """runtime.twin_culls' analysis of the tape's culls: (per record, -1 or where its saves start;
    the saved registers; ...) (a unit of the interpreter, not a walker's observable)."""
    from taperay.runtime import twin_culls
    return twin_culls.cull_saves(tape.as_columns(), tape.n_regs, twin_culls.READS, twin_culls.WRITES)


def test_blocks_that_split_at_a_cull_give_the_values_of_points_evaluated_alone(walker_cpu):
    """A block whose points disagree at a cull runs its subtree for all of them and gives the
    points that cull their registers back at the target; values and materials must be those of
    each point evaluated alone, bit for bit, and the culls that cannot be ridden through fall
    back to point-by-point evaluation."""
    rng = np.random.default_rng(11)
    tapes = _split_cull_tapes()
    ridden = 0
    for tape in tapes:
        lo, hi = tape.bounds
        pts = rng.uniform(lo - 0.3, hi + 0.3, (300, 3)).astype(np.float32)
        d, m = walker_cpu.evaluate(tape, pts)
        d1, m1 = evaluate_one_by_one(walker_cpu, tape, pts)
        assert np.array_equal(d, d1, equal_nan=True), tape.source
        assert np.array_equal(m, m1), tape.source
        idx = _cull_saves(tape)[0]
        ridden += int((idx >= 0).sum())
    assert ridden >= 10                                         # culls the blocks ride through
    for tape in tapes[-2:]:                                     # ... and the fallback was needed
        cols = tape.as_columns()
        idx = _cull_saves(tape)[0]
        assert idx[int(np.flatnonzero(cols[:, 0] == Op.CULL_BOX)[0])] == -1


def test_a_split_cull_saves_the_registers_live_at_its_target():
    """_cull_saves keeps, of the registers a cull and its subtree write, those live at its
    target (runtime.twin_culls.live_in): register 3 in both tapes of _live_after_target_tapes, only
    the cull's own register in a grid pattern of _culled_cell (its other registers are written
    again before any read, also across the pattern's copies)."""
    from taperay.scenegraph import flatten

    def saved(tape):
        cols = tape.as_columns()
        idx, saves, _ = _cull_saves(tape)
        return [sorted(saves[k + 1:k + 1 + saves[k]].tolist()) for k in idx[cols[:, 0] == Op.CULL_BOX] if k >= 0]

    after, back = _live_after_target_tapes()
    assert saved(after) == [[1, 3]]
    assert saved(back) == [[3, 5]]
    cells = flatten(_culled_cell().grid_pattern((1, 1, 1), (3, 3, 3)))
    cols = cells.as_columns()
    culls = np.flatnonzero(cols[:, 0] == Op.CULL_BOX)
    assert len(culls) == 2
    assert saved(cells) == [[int(cols[i, 1])] for i in culls]


def test_split_cull_saves_are_kept_per_frozen_tape(walker_cpu):
    """split_culls computes a tape's cull saves (and their liveness pass) once while the tape
    holds the same frozen records; a writable copy of the records is analysed again."""
    from dataclasses import replace

    from taperay.runtime.twin_culls import split_culls
    from taperay.scenegraph import flatten
    tape = flatten(_culled_cell().grid_pattern((1, 1, 1), (3, 3, 3)))
    walker_cpu.evaluate(tape, np.zeros((4, 3), np.float32))          # (validates: freezes the tape)
    first = split_culls(tape, tape.as_columns())
    assert split_culls(tape, tape.as_columns()) is first
    copy = replace(tape, instrs=tape.instrs.copy())
    again = split_culls(copy, copy.as_columns())
    assert again is not first and all(np.array_equal(x, y) for x, y in zip(again, first))


def test_frames_and_points_do_not_depend_on_the_thread_count(walker_cpu, monkeypatch):
    """The march and light kernels' tiles and evaluate's chunks are independent: shared out over
    one, two or three threads (twin_threads.on_threads, round-robin), they give the same bits."""
    import taperay.runtime.twin_threads as twin_threads
    from taperay.scenegraph import flatten
    from taperay.scenes import lens_bench_1000
    scene = flatten(lens_bench_1000.scene)
    cam = auto_camera(scene.bounds)
    pts = np.random.default_rng(3).uniform(scene.bounds[0], scene.bounds[1], (3000, 3)).astype(np.float32)
    runs = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(twin_threads, "thread_count", lambda: threads)
        runs.append((walker_cpu.light(scene, cam, 70, 45), walker_cpu.evaluate(scene, pts)))
    for light, (d, m) in runs[1:]:
        for key in ("t", "hit", "steps", "mat", "grad", "shadow", "ao"):
            assert np.array_equal(light[key], runs[0][0][key], equal_nan=True), key
        assert np.array_equal(d, runs[0][1][0]) and np.array_equal(m, runs[0][1][1])


def test_the_stored_self_check_image_is_the_twins(request):
    """The GPU self-check compares with the twin's image of its reference scene as stored
    (runtime/self_check_reference.png); it must be what the twin draws now. After a deliberate
    change to the twin or the shading: ``pytest tests/test_cpu_walker.py -k stored --regenerate``."""
    from taperay.runtime import conformance as C
    if request.config.getoption("--regenerate"):
        C.write_self_check_reference()
    stored = C.self_check_reference()
    live = C.twin_self_check_image(C.reference_tape())
    assert stored.shape == live.shape == (C.SELF_CHECK_SIZE[1], C.SELF_CHECK_SIZE[0], 3)
    assert np.array_equal(stored, live), C.compare_images(live, stored, 0)


def test_written_images_get_a_new_files_usual_mode(tmp_path):
    import os
    mask = os.umask(0o022)
    os.umask(mask)
    path = write_png(tmp_path / "a.png", np.zeros((2, 3, 3), np.uint8))
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask


def test_parameter_differences_match_the_exact_derivatives_and_leave_the_tape_as_it_was(walker_cpu):
    """A sphere of radius r moved by a: f = |p - (a, 0, 0)| - r, so df/dr = -1 and df/da =
    -(x - a) / |p - (a, 0, 0)|; central differences of the twin's values match within float32
    rounding, and the parameters are set back."""
    from taperay.scenegraph import Param, flatten, sphere
    tape = flatten(sphere(Param("r", 0.5)).translate(Param("a", 0.2), 0, 0))
    pts = np.array([[1.0, 0.3, -0.2], [-0.4, 0.9, 0.5], [0.2, 0.0, 1.5]], np.float32)
    d = walker_cpu.parameter_differences(tape, pts)
    q = pts.astype(np.float64) - [0.2, 0.0, 0.0]
    np.testing.assert_allclose(d["r"], -1.0, atol=2e-3)
    np.testing.assert_allclose(d["a"], -q[:, 0] / np.linalg.norm(q, axis=1), atol=2e-3)
    assert tape.params[tape.names["r"][0]] == np.float32(0.5) and tape.params[tape.names["a"][0]] == np.float32(0.2)
