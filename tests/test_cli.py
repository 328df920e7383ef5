"""The `taperay` command line: render / eval / info / bench run end to end, and every user error
is one line `taperay: error: ...` with exit status 2 and no traceback."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from taperay.tools import cli

TINY_SCENE = """
from taperay.scenegraph import box, sphere
scene = sphere(0.6) | box(0.3).translate(0.7, 0, 0)
"""

# a disc of radius 0.4 centred at (0, 0.5): in the field image it lies in the upper half
DISC_UP = """
from taperay.scenegraph import sphere
scene = sphere(0.4).translate(0, 0.5, 0)
"""


@pytest.fixture
def scene_file(tmp_path):
    path = tmp_path / "tiny.py"
    path.write_text(TINY_SCENE)
    return path


def run_cli(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def load_tape(path):
    from taperay.scenegraph.loading import load_tape as load
    return load(path)


def test_render_writes_png_and_reports(capsys, scene_file, tmp_path):
    out_png = tmp_path / "sub" / "tiny.png"
    rc, out, err = run_cli(capsys, "render", scene_file, "-o", out_png, "--size", "64x48", "--walker", "cpu")
    assert rc == 0, err
    img = np.asarray(Image.open(out_png))
    assert img.shape == (48, 64, 3) and img.dtype == np.uint8
    assert img.std() > 0          # the object is in view, not a blank frame
    for word in ("records", "instances", "walker", "64x48", "frame", "write"):
        assert word in out


def test_render_with_a_hit_cone(capsys, scene_file, tmp_path):
    """--cone K renders with RenderSettings.hit_cone = K pixels' angle: the twin's own render with
    that setting; a negative width is a usage error."""
    from taperay.runtime.camera import auto_camera
    from taperay.runtime.cpu import CpuWalker
    from taperay.runtime.shading import RenderSettings
    from taperay.tools.cli import Stopwatch, load_scene
    rc, out, err = run_cli(capsys, "render", scene_file, "-o", tmp_path / "c.png", "--size", "64x48",
                           "--walker", "cpu", "--cone", "2")
    assert rc == 0, err
    tape = load_scene(str(scene_file), Stopwatch())
    cam = auto_camera(tape.bounds)
    want = CpuWalker().render(tape, cam, 64, 48, settings=RenderSettings(hit_cone=2 * cam.pixel_angle(48)))
    np.testing.assert_array_equal(np.asarray(Image.open(tmp_path / "c.png")), want)
    rc, out, err = run_cli(capsys, "render", scene_file, "-o", tmp_path / "d.png", "--cone", "-1")
    assert rc == 2 and "--cone" in err
    rc, out, err = run_cli(capsys, "view", scene_file, "--offscreen", "--cone", "1000")
    assert rc == 2 and "--cone 1000.0" in err


@pytest.mark.gpu
def test_render_on_gpu_walker(capsys, walker_gpu, scene_file, tmp_path):
    rc, out, err = run_cli(capsys, "render", scene_file, "-o", tmp_path / "g.png", "--size", "32x24", "--walker", "gpu")
    assert rc == 0, err
    assert f"walker:    gpu ({walker_gpu.adapter_name})" in out
    assert np.asarray(Image.open(tmp_path / "g.png")).shape == (24, 32, 3)


def test_auto_walker_names_its_choice(capsys, scene_file, tmp_path):
    rc, out, err = run_cli(capsys, "render", scene_file, "-o", tmp_path / "a.png", "--size", "16x12")
    assert rc == 0, err
    walker_lines = [ln for ln in out.splitlines() if ln.startswith("walker:")]
    assert walker_lines[-1] in ("walker:    cpu",) or walker_lines[-1].startswith("walker:    gpu (")
    if walker_lines[-1] == "walker:    cpu":     # the CPU twin only with a reason
        assert walker_lines[0].startswith("walker:    cpu, because ")


def test_render_2d_field_image_has_y_up(capsys, tmp_path):
    scene = tmp_path / "disc.py"
    scene.write_text(DISC_UP)
    out_png = tmp_path / "disc.png"
    rc, _, err = run_cli(capsys, "render", scene, "-o", out_png, "--2d", "--size", "32", "--walker", "cpu")
    assert rc == 0, err
    img = np.asarray(Image.open(out_png))
    assert img.shape == (32, 32, 3)
    assert set(np.unique(img)) <= {0, 255}
    # y = +0.5 is a quarter of the way down from the top; y = -0.5 three quarters
    assert img[8, 16].tolist() == [255, 255, 255]
    assert img[24, 16].tolist() == [0, 0, 0]


@pytest.mark.slow
def test_render_2d_prospero_matches_the_challenge_image(capsys, tmp_path):
    """The Prospero challenge at 1024x1024: the reference image exactly (132,033 inside pixels)."""
    data = os.path.join(os.path.dirname(__file__), "data")
    rc, out, err = run_cli(capsys, "render", os.path.join(data, "prospero.vm"), "--2d", "--size", "1024",
                           "-o", tmp_path / "p.png", "--walker", "cpu")
    assert rc == 0, err
    got = np.asarray(Image.open(tmp_path / "p.png"))
    want = np.asarray(Image.open(os.path.join(data, "prospero_1024.png")))
    assert got.shape == (1024, 1024, 3)
    np.testing.assert_array_equal(got[:, :, 0], want)


@pytest.mark.slow
def test_render_2d_prospero_on_the_gpu_is_the_twins_image(capsys, tmp_path, walker_gpu):
    """--2d on the GPU loads the program with balanced MIN chains and prunes with image_tiles'
    levels: the twin's image (the program as written), pixel for pixel."""
    path = os.path.join(os.path.dirname(__file__), "data", "prospero.vm")
    images = []
    for walker in ("cpu", "gpu"):
        rc, out, err = run_cli(capsys, "render", path, "--2d", "--size", "192x160", "-o", tmp_path / f"{walker}.png",
                               "--walker", walker)
        assert rc == 0, err
        images.append(np.asarray(Image.open(tmp_path / f"{walker}.png")))
    assert 0.05 < (images[0] == 255).mean() < 0.5
    np.testing.assert_array_equal(images[0], images[1])


def test_eval_round_trip_matches_cpu_walker(capsys, scene_file, tmp_path):
    from taperay.runtime.cpu import CpuWalker
    pts = np.random.default_rng(1).uniform(-1.5, 1.5, (500, 3))   # float64 in: converted
    np.save(tmp_path / "pts.npy", pts)
    rc, _, err = run_cli(capsys, "eval", scene_file, tmp_path / "pts.npy", "-o", tmp_path / "d.npy",
                         "--walker", "cpu")
    assert rc == 0, err
    got = np.load(tmp_path / "d.npy")
    assert got.dtype == np.float32 and got.shape == (500,)
    want, _ = CpuWalker().evaluate(load_tape(scene_file), pts.astype(np.float32))
    np.testing.assert_array_equal(got, want)
    inside = np.linalg.norm(pts, axis=1) < 0.5
    assert np.all(got[inside] < 0)


PARAM_SCENE = """
from taperay.scenegraph import Param, sphere
scene = sphere(Param("r", 0.5))
"""


@pytest.mark.parametrize("walker", ["cpu", "gpu"])
def test_eval_set_edits_named_parameters_on_every_walker(capsys, tmp_path, walker, request):
    request.getfixturevalue(f"walker_{walker}")       # (skips where the GPU walker is absent)
    (tmp_path / "r.py").write_text(PARAM_SCENE)
    np.save(tmp_path / "pts.npy", np.array([[0, 0, 2.0], [0, 1.0, 0]]))
    rc, _, err = run_cli(capsys, "eval", tmp_path / "r.py", tmp_path / "pts.npy", "-o", tmp_path / "d.npy",
                         "--walker", walker, "--set", "r=0.75")
    assert rc == 0, err
    np.testing.assert_allclose(np.load(tmp_path / "d.npy"), [1.25, 0.25], atol=1e-6)


@pytest.mark.parametrize("arg, fragment", [("r", "expected NAME=VALUE"), ("r=big", "expected NAME=VALUE"),
                                           ("radius=1", "no parameter named 'radius'")])
def test_a_bad_set_is_one_error_line(capsys, tmp_path, arg, fragment):
    (tmp_path / "r.py").write_text(PARAM_SCENE)
    np.save(tmp_path / "pts.npy", np.zeros((1, 3)))
    rc, _, err = run_cli(capsys, "eval", tmp_path / "r.py", tmp_path / "pts.npy", "-o", tmp_path / "d.npy",
                         "--walker", "cpu", "--set", arg)
    assert rc == 2 and err.startswith("taperay: error:") and fragment in err and "Traceback" not in err


def test_info_json(capsys, scene_file):
    rc, out, err = run_cli(capsys, "info", scene_file, "--json")
    assert rc == 0, err
    info = json.loads(out)
    tape = load_tape(scene_file)
    assert info["records"] == len(tape)
    assert info["instances"] == tape.instance_count == 2
    assert info["parameters"] == len(tape.params)
    assert info["registers"] == tape.n_regs
    np.testing.assert_allclose(info["bounds"], tape.bounds, rtol=1e-6)
    assert sum(info["ops"].values()) == len(tape)
    assert info["ops"]["SPHERE"] == 1 and info["ops"]["BOX"] == 1


@pytest.mark.parametrize("body,says", [
    ("union(*[sphere(0.2).translate(i, 0, 0) for i in range(12)])", "its lowering to arithmetic"),
    ("union(*[sphere(0.2).translate(i, 0, 0) for i in range(12)], sphere(0.3).linear_pattern((1, 0, 0), 65))",
     "REPEAT_LINEAR of 65 copies (written out up to 64)"),
    ("union(*[sphere(0.2).translate(i, 0, 0).material(Material('m%d' % (i % 2), (1, i % 2, 0), 0.5))"
     " for i in range(12)], extrude([(0, 0), (1, 0), (0.2, 0.2), (0, 1)], 0.2))",
     "EXTRUDE_POLY: a polygon that is not convex"),
    ("sphere(0.5)", "fewer than 64 records"),
    ("field(fields.x * fields.x + fields.y * fields.y + fields.z * fields.z - 0.25 + 0 * ("
     + " + ".join(["fields.x"] * 70) + "))", "the tape itself (arithmetic)"),
])
def test_info_says_whether_the_gpu_render_prunes_on_march_cells(capsys, tmp_path, body, says):
    scene = tmp_path / "s.py"
    scene.write_text("from taperay.scenegraph import Material, extrude, field, fields, sphere, union\n"
                     f"scene = {body}\n")
    rc, out, err = run_cli(capsys, "info", scene, "--json")
    assert rc == 0, err
    assert says in json.loads(out)["march_cells"]


def test_info_reports_each_instance_lists_bound_or_why_it_has_none(capsys, tmp_path):
    scene = tmp_path / "i.py"
    scene.write_text("import numpy as np\nfrom taperay.scenegraph import cylinder, extrude, union\n"
                     "t = np.random.default_rng(0).uniform(-3, 3, (50, 3))\n"
                     "scene = union(cylinder(0.1, 0.4).instances(t), "
                     "extrude([(0, 0), (1, 0), (0.2, 0.2), (0, 1)], 0.2).instances(t + 7))\n")
    rc, out, err = run_cli(capsys, "info", scene, "--json")
    assert rc == 0, err
    bounded, unbounded = json.loads(out)["instance_lists"]
    assert bounded["instances"] == unbounded["instances"] == 50 and bounded["bvh_nodes"] == 99
    assert bounded["bound"].startswith("capsule of radius 0.1 inside the body; grid of")
    assert unbounded["bound"].startswith("none: no capsule inside the body is known")
    rc, out, err = run_cli(capsys, "info", scene)
    assert rc == 0, err
    assert "instance list (record" in out and "50 instances, 99 BVH nodes" in out


def test_info_table_names_parameters(capsys, tmp_path):
    scene = tmp_path / "p.py"
    scene.write_text("from taperay.scenegraph import Param, sphere\nscene = sphere(Param('radius', 0.75))\n")
    rc, out, err = run_cli(capsys, "info", scene)
    assert rc == 0, err
    assert "radius" in out and "0.75" in out and "SPHERE" in out


def test_bench_cpu_points_writes_json_and_markdown(capsys, tmp_path):
    rc, out, err = run_cli(capsys, "bench", "cpu-points", "--n", "3000", "--repeat", "2", "-o", tmp_path)
    assert rc == 0, err
    doc = json.loads((tmp_path / "cpu-points.json").read_text())
    assert doc["machine"]["cores"] >= 1 and doc["machine"]["cpu"]
    (row,) = doc["rows"]
    assert row["points"] == 3000 and row["repeats"] == 2
    assert row["min ms"] <= row["median ms"] <= row["max ms"]
    md = (tmp_path / "cpu-points.md").read_text()
    assert "| benchmark |" in md and "Mpoints/s" in md and doc["machine"]["cpu"] in md
    assert "cpu-points" in out


@pytest.mark.slow
@pytest.mark.gpu
def test_bench_gpu_compares_interpreter_with_written_out_code(capsys, walker_gpu, tmp_path, monkeypatch):
    from taperay.runtime.pruning import PRUNE_MIN_RECORDS
    from taperay.tools import bench_gpu
    # the 12-primitive scene alone (software adapters run 4 and 12): long enough for the pruned
    # cells, so its frames compare all three renders; each scene's written-out kernels are a
    # lavapipe JIT of their own, and the shorter scene's row proves nothing the longer one does not
    if walker_gpu.info["software"]:
        monkeypatch.setattr(bench_gpu, "SOFTWARE_SIZES", (12,))
    rc, out, err = run_cli(capsys, "bench", "gpu", "--n", "200", "--repeat", "1", "-o", tmp_path)
    assert rc == 0, err
    doc = json.loads((tmp_path / "gpu.json").read_text())
    assert doc["machine"]["gpu"] == walker_gpu.info["name"]
    assert len(doc["rows"]) >= 1 and max(row["records"] for row in doc["rows"]) >= PRUNE_MIN_RECORDS
    for row in doc["rows"]:
        assert row["points"] == 200
        assert row["max abs difference"] <= 1e-5   # a few ULP of fields up to ~20
        frame_views = [k[:-len(" written-out frame ms")] for k in row if k.endswith(" written-out frame ms")]
        if row["scene"] == "prospero.vm":     # (hardware only: a 2D program, measured by its points alone)
            assert not frame_views
            continue
        assert frame_views and all(f"{v} frame ms" in row and f"{v} frame ratio" in row for v in frame_views)
        # the written-out code computes the tape's values exactly; the lowered scene (on cells)
        # differs from them by float32 rounding: a silhouette pixel at most here and there; with
        # empty-space skipping, hits move within hit_eps (compared in every view but steps: on the
        # H200, 0.2-0.4 % of 1920x1080 pixels; without skipping 0.003 %, with it 23 % of steps)
        assert row["frame px differing (unpruned)"] == 0 and row["written-out frame compile s"] > 0
        w, h = map(int, doc["settings"]["frame"].split("x"))
        assert row["frame px differing (cells)"] <= 0.01 * len(frame_views) * w * h
        skipped_views = len([v for v in frame_views if v != "steps"])
        assert row["frame px differing (cells, cell skip)"] <= 0.01 * skipped_views * w * h
    assert (tmp_path / "gpu.md").is_file() and (tmp_path / "gpu.png").is_file()


def test_bench_scene_is_sphere_and_box_minus_three_bores():
    from taperay.runtime.cpu import CpuWalker
    from taperay.scenegraph import flatten
    from taperay.tools.bench import fixed_scene
    tape = flatten(fixed_scene())
    pts = np.array([[0, 0, 0], [0.9, 0.9, 0.9], [0.75, 0.75, 0.0], [0.0, 0.75, 0.75], [0.75, 0, 0.75],
                    [1.1, 0, 0]], np.float32)
    d, _ = CpuWalker().evaluate(tape, pts)
    # centre: inside all three bores; the corner (0.9,0.9,0.9) is outside the sphere of 1.2;
    # (0.75,0.75,0) is solid; the other two edge points are solid by symmetry; x=1.1 is outside the box
    assert d[0] > 0 and d[1] > 0 and d[5] > 0
    assert d[2] < 0 and d[3] < 0 and d[4] < 0
    np.testing.assert_allclose(d[2:5], d[2], rtol=1e-6)


@pytest.mark.gpu
def test_conform_scene_on_gpu(capsys, walker_gpu, scene_file):
    rc, out, err = run_cli(capsys, "conform", scene_file, "--walkers", "gpu")
    assert rc == 0, out + err
    assert "PASS" in out and "gpu" in out


def test_conform_exit_status_is_the_verdict(capsys, scene_file, monkeypatch):
    from taperay.runtime import conformance

    class FailedReport:
        walkers, passed = ["gpu"], False

        def table(self):
            return "the table"

        def failures(self):
            return ["scene tiny on gpu"]
    monkeypatch.setattr(conformance, "conform_tape", lambda tape, walkers=None, seed=0: FailedReport())
    rc, out, err = run_cli(capsys, "conform", scene_file)
    assert rc == 1
    assert "FAIL" in out and "scene tiny on gpu" in out


def test_conform_with_only_the_reference_compares_nothing(capsys, scene_file):
    rc, out, err = run_cli(capsys, "conform", scene_file, "--walkers", "cpu")
    assert rc == 0 and "nothing compared" in out


def _write(path, data):
    path.write_bytes(data) if isinstance(data, bytes) else path.write_text(data)
    return path


ERROR_CASES = {
    "missing scene": lambda t: (["info", t / "nope.py"], "nope.py"),
    "unknown suffix": lambda t: (["info", _write(t / "scene.txt", "hello")], "scene.txt"),
    "garbage tape": lambda t: (["info", _write(t / "bad.tape", b"\x00\x01garbage\xff" * 10)], "bad.tape"),
    "py without scene": lambda t: (["info", _write(t / "empty.py", "x = 1\n")], "empty.py"),
    "scene raises": lambda t: (["info", _write(t / "boom.py", "raise RuntimeError('boom')\n")], "boom.py"),
    "bad points shape": lambda t: (["eval", _write(t / "s.py", TINY_SCENE), _npy(t / "p2.npy", np.zeros((4, 2))),
                                    "-o", t / "o.npy"], "p2.npy"),
    "unreadable npy": lambda t: (["eval", _write(t / "s.py", TINY_SCENE), _write(t / "junk.npy", b"not numpy"),
                                  "-o", t / "o.npy"], "junk.npy"),
    "missing npy": lambda t: (["eval", _write(t / "s.py", TINY_SCENE), t / "none.npy", "-o", t / "o.npy"], "none.npy"),
    "bad size": lambda t: (["render", _write(t / "s.py", TINY_SCENE), "-o", t / "x.png", "--size", "big"], "--size"),
    "bad view": lambda t: (["render", _write(t / "s.py", TINY_SCENE), "-o", t / "x.png", "--view", "fancy"], "fancy"),
    "unknown command": lambda t: (["paint", "x"], "paint"),
    "bad bench": lambda t: (["bench", "nothing"], "nothing"),
    "bad bench forms": lambda t: (["bench", "jax", "--forms", "cells,fastest", "-o", t], "fastest"),
    "conform needs a source": lambda t: (["conform"], "--random"),
    "unknown walker": lambda t: (["conform", _write(t / "s.py", TINY_SCENE), "--walkers", "warp"], "warp"),
    "2d with a view": lambda t: (["render", _write(t / "s.py", TINY_SCENE), "-o", t / "x.png", "--2d",
                                  "--view", "normals"], "--2d"),
}


def _npy(path, arr):
    np.save(path, arr)
    return path


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_user_errors_are_one_line_exit_2(capsys, tmp_path, case):
    argv, needle = ERROR_CASES[case](tmp_path)
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("taperay: error: ") and needle in lines[0]
    assert "Traceback" not in err


@pytest.mark.slow
def test_console_entry_point_error_exit_status(tmp_path):
    """The real process: `python -m taperay.tools.cli` exits 2 with one stderr line."""
    proc = subprocess.run([sys.executable, "-m", "taperay.tools.cli", "info", str(tmp_path / "gone.vm")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"taperay: error: {tmp_path / 'gone.vm'}: no such file"]


@pytest.mark.slow
def test_console_entry_point_leaves_with_its_output_flushed(tmp_path, scene_file):
    """The console script exits without the interpreter's teardown (cli.run): status 0, every
    line of the report on stdout and the image written."""
    out = tmp_path / "x.png"
    proc = subprocess.run([sys.executable, "-m", "taperay.tools.cli", "render", scene_file, "--walker", "cpu",
                           "--size", "8x6", "-o", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip().splitlines()[-1].startswith("           (the first run after an install")
    assert "timings:" in proc.stdout and out.is_file()


def test_keyboard_interrupt_exits_130_quietly(capsys, scene_file, monkeypatch):
    def interrupted(tape):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "tape_info", interrupted)
    rc, out, err = run_cli(capsys, "info", scene_file)
    assert rc == 130 and err == ""


def test_internal_errors_are_one_line_too(capsys, scene_file, monkeypatch):
    def broken(tape):
        raise RuntimeError("driver said:\n  something\n  on several lines")
    monkeypatch.setattr(cli, "tape_info", broken)
    rc, out, err = run_cli(capsys, "info", scene_file)
    assert rc == 2
    (line,) = err.strip().splitlines()
    assert line.startswith("taperay: error: internal error: RuntimeError: driver said:")
    assert "Traceback" not in err


@pytest.mark.parametrize("text,size", [("64x48", (64, 48)), ("1024", (1024, 1024)), ("3X2", (3, 2))])
def test_parse_size(text, size):
    assert cli.parse_size(text) == size


def test_bench_tables_show_columns_that_only_later_rows_have():
    from taperay.tools.bench import markdown_table
    table = markdown_table([{"what": "image", "ms": 1.5}, {"what": "points", "ms": 2.0, "host ms": 0.25}])
    head, _, first, second = table.splitlines()
    assert head == "| what | ms | host ms |"
    assert first == "| image | 1.5 |  |" and second == "| points | 2 | 0.25 |"


def test_bench_bar_charts_leave_rows_not_measured_without_a_bar(tmp_path):
    """A NaN row (a GPU time a software adapter could not take) gets no bar; the chart is still
    written (it used to raise, after the whole benchmark had run)."""
    from PIL import Image

    from taperay.tools.bench import bar_chart
    bar_chart(tmp_path / "c.png", ["measured", "not measured"], [2.0, float("nan")], "t")
    img = np.asarray(Image.open(tmp_path / "c.png").convert("RGB"))
    bar = (img == (70, 110, 180)).all(-1)        # the bars' colour
    assert bar[34:56].any() and not bar[56:78].any()


def test_mesh_writes_a_watertight_surface_and_reports_it(capsys, tmp_path):
    import trimesh
    from taperay.solvers import mesh_surface
    rc, out, err = run_cli(capsys, "mesh", "scenes/heat_sink.py", "-o", tmp_path / "hs.stl", "--resolution", "32",
                           "--walker", "cpu", "--set", "fin_height=0.02")
    assert rc == 0, err
    part = trimesh.load(tmp_path / "hs.stl")
    assert part.is_watertight and "watertight" in out and f"{len(part.faces):,} triangles" in out
    tape = load_tape("scenes/heat_sink.py")
    tape.set_param("fin_height", 0.02)
    assert abs(part.volume - mesh_surface(tape, 32, method="dc").volume) <= 1e-6 * part.volume
    assert "max distance to the surface" in out


@pytest.mark.slow
def test_simulate_writes_a_vtu_and_a_summary(capsys, tmp_path):
    import meshio
    rc, out, err = run_cli(capsys, "simulate", "scenes/heat_sink.py", "-o", tmp_path / "hs.vtu", "--resolution", "24",
                           "--walker", "cpu", "--json", tmp_path / "hs.json")
    assert rc == 0, err
    summary = json.loads((tmp_path / "hs.json").read_text())
    result = meshio.read(tmp_path / "hs.vtu")
    assert len(result.points) == summary["nodes"] and summary["dof"] == summary["nodes"]
    assert np.isclose(result.point_data["temperature"].max(), summary["max_temperature"])
    for stage in ("surface", "tets", "assembly", "solve"):
        assert stage in out and stage in summary["timings"]


@pytest.mark.parametrize("scene, fragment", [("scenes/machined_part.py", "declares no `study`"),
                                             ("tests/data/sphere.vm", "needs a Python scene file")])
def test_simulate_without_a_study_is_one_error_line(capsys, tmp_path, scene, fragment):
    rc, _, err = run_cli(capsys, "simulate", scene, "-o", tmp_path / "x.vtu", "--walker", "cpu")
    assert rc == 2 and err.startswith("taperay: error:") and fragment in err


@pytest.mark.slow
@pytest.mark.parametrize("walker", ["jax", "cpu"])
def test_grad_writes_values_normals_and_parameter_derivatives(capsys, tmp_path, walker):
    (tmp_path / "r.py").write_text(PARAM_SCENE)
    pts = np.random.default_rng(4).uniform(-1, 1, (300, 3))
    pts = pts[np.linalg.norm(pts, axis=1) > 0.1]
    np.save(tmp_path / "pts.npy", pts)
    rc, out, err = run_cli(capsys, "grad", tmp_path / "r.py", tmp_path / "pts.npy", "-o", tmp_path / "g.npz",
                           "--walker", walker, "--set", "r=0.6")
    assert rc == 0, err
    g = np.load(tmp_path / "g.npz")
    assert sorted(g.files) == ["gradient", "normal", "r", "value"]
    radius = np.linalg.norm(pts, axis=1)
    np.testing.assert_allclose(g["value"], radius - 0.6, atol=1e-6)
    np.testing.assert_allclose(g["normal"], pts / radius[:, None], atol=1e-3 if walker == "cpu" else 1e-5)
    np.testing.assert_allclose(g["r"], -1.0, atol=1e-3 if walker == "cpu" else 1e-6)


@pytest.mark.slow
def test_optimize_writes_the_best_scene_history_and_plot(capsys, tmp_path):
    from taperay.scenegraph.files import load_scene_file
    rc, out, err = run_cli(capsys, "optimize", "scenes/heat_sink.py", "--objective", "max_temperature",
                           "--constraint", "volume<=initial", "--bounds", "fin_height=0.02:0.04", "--max-steps", "1",
                           "-o", tmp_path / "best.scene", "--json", tmp_path / "h.json", "--plot", tmp_path / "h.png")
    assert rc == 0, err
    history = json.loads((tmp_path / "h.json").read_text())
    assert history["objective"] == "max_temperature" and len(history["history"]) >= 1
    assert "design  0: max_temperature" in out and "|gradient|" in out
    best = load_scene_file(tmp_path / "best.scene").params()
    assert best["fin_height"] == pytest.approx(history["best"]["fin_height"])
    assert (tmp_path / "h.png").stat().st_size > 1000


def test_optimize_refuses_an_unknown_objective(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "optimize", "scenes/heat_sink.py", "--objective", "beauty", "-o", tmp_path / "b.scene")
    assert rc == 2 and "choose from" in err


PATTERN_SCENE = """
from taperay.scenegraph import Param, box
scene = box(Param("h", 0.2), 0.3, 0.4).linear_pattern((1.0, 0, 0), 3)
"""


@pytest.mark.slow
def test_grad_of_a_pattern_counts_the_slots_its_refit_derives(capsys, tmp_path):
    """Just outside a face of a patterned box, d value / d h is -1 (the face moves out by dh): the
    box's own half extent and the pattern's extent, which the refit derives from h, carry it
    together (their values tie there: each passes half). Off the face by 0.01: on it, the box's
    own kink (outside and inside branches equal) splits the derivative by JAX's tie rule."""
    (tmp_path / "p.py").write_text(PATTERN_SCENE)
    rng = np.random.default_rng(2)
    faces = np.stack([np.repeat([0.21, 1.21, 2.21], 20), rng.uniform(-0.25, 0.25, 60), rng.uniform(-0.35, 0.35, 60)], 1)
    np.save(tmp_path / "pts.npy", faces)
    results = {}
    for walker in ("jax", "cpu"):
        rc, _, err = run_cli(capsys, "grad", tmp_path / "p.py", tmp_path / "pts.npy", "-o", tmp_path / f"{walker}.npz",
                             "--walker", walker)
        assert rc == 0, err
        results[walker] = np.load(tmp_path / f"{walker}.npz")
    np.testing.assert_allclose(results["jax"]["value"], 0.01, atol=1e-6)
    np.testing.assert_allclose(results["jax"]["h"], -1.0, atol=1e-5)
    np.testing.assert_allclose(results["cpu"]["h"], -1.0, atol=1e-3)


def test_the_command_lines_copies_of_runtime_names_match_them():
    """cli.py holds copies of a few runtime names so that --help imports nothing heavy: each
    equals the name it copies."""
    from taperay.runtime.shading import VIEWS
    from taperay.runtime.walkers import WALKER_KINDS
    from taperay.tools.viewer import CONE_PIXELS
    assert (cli.VIEWS, cli.WALKERS, cli.VIEW_CONE_PIXELS) == (VIEWS, WALKER_KINDS, CONE_PIXELS)
