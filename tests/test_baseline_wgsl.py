"""The benchmark-only written-out WGSL baseline (tools/baseline_wgsl.py, tools/bench_baseline.py):
it computes what the CPU twin computes, and renders the interpreter's frames, so `taperay bench gpu`
compares equal work."""
import os

import numpy as np
import pytest

from taperay.runtime.tape import TaperayError
from taperay.scenegraph import (Material, box, capped_cone, capsule, ellipsoid, extrude, flatten, plane,
                                revolve, rounded_box, smooth_difference, smooth_intersection,
                                smooth_union, sphere, torus, union)
from taperay.scenegraph.loading import load_tape
from taperay.tools.baseline_wgsl import RUN_TAPE, module_source, scene_function
from taperay.tools.bench import fixed_scene

RED, GREEN = Material("red", (1, 0, 0)), Material("green", (0, 1, 0))


def every_straight_line_family():
    """Every shape, point op, combine op and modifier, under culls and several materials."""
    parts = [
        sphere(0.3).translate(-1, 0, 0).material(RED),
        box(0.2, 0.3, 0.1).rotate((1, 1, 0), 30).translate(1, 0, 0),
        rounded_box(0.3, 0.2, 0.2, 0.05).translate(0, 1, 0).material(GREEN),
        capped_cone(0.3, 0.2, 0.1).translate(0, -1, 0),
        capsule((0, 0, 0), (0.3, 0.2, 0.1), 0.1).translate(0, 0, 1),
        torus(0.3, 0.05).translate(0, 0, -1),
        ellipsoid(0.3, 0.2, 0.1).translate(1, 1, 0).scale(1.3),
        extrude([(0, 0), (0.3, 0), (0.1, 0.3)], 0.1).translate(-1, -1, 0),
        revolve([(0.1, -0.2), (0.3, 0), (0.1, 0.2)]).translate(1, -1, 0),
        sphere(0.2).elongate(0.1, 0, 0).translate(-1, 1, 0).mirror((1, 0, 0), 0.5),
        (sphere(0.3) ^ box(0.2)).translate(0.5, 0.5, 0.5),
        sphere(0.3).shell(0.02).offset(0.01).translate(-0.5, -0.5, -0.5),
        smooth_intersection(sphere(0.3), box(0.25), k=0.1).translate(0.5, -0.5, 0.5),
        smooth_difference(box(0.3), sphere(0.2), k=0.05).translate(-0.5, 0.5, -0.5).material(RED),
    ]
    return smooth_union(union(*parts), plane((0, 0, 1), -1.5), k=0.1)


TAPES = {
    "families": lambda: flatten(every_straight_line_family(), source="families"),
    "bench scene": lambda: flatten(fixed_scene(), source="bench scene"),
    "tanglecube.vm": lambda: load_tape(os.path.join(os.path.dirname(__file__), "data", "tanglecube.vm")),
    "hi.vm": lambda: load_tape(os.path.join(os.path.dirname(__file__), "data", "hi.vm")),
}


@pytest.mark.parametrize("name", sorted(TAPES))
def test_text_inlines_parameters_and_fetches_no_instructions(name):
    text = scene_function(TAPES[name]())
    assert "instrs[" not in text and "params[" not in text and text.count("fn run_tape(") == 1


@pytest.mark.parametrize("kernel_file", ["kernels_points.wgsl", "kernels_render.wgsl"])
def test_module_is_the_walkers_with_run_tape_replaced(kernel_file):
    from taperay.runtime import gpu_device
    tape = TAPES["bench scene"]()
    module = module_source(tape, kernel_file)
    walkers = gpu_device._shader_text(kernel_file, 16)
    assert module.count(RUN_TAPE) == 1 and module.count("fn run_tape(") == 1
    head, tail = walkers.split("\n" + RUN_TAPE)
    assert module.startswith(head) and module.endswith(tail[tail.index("\n}\n") + 3:])
    assert scene_function(tape) in module


def test_culls_become_nested_blocks():
    tape = TAPES["families"]()
    assert tape.op_counts()["CULL_BOX"] > 1
    assert scene_function(tape).count("if (!(") == tape.op_counts()["CULL_BOX"]
    assert "if (!(" not in scene_function(tape, culls=False)


def bolt_bin(n: int):
    import runpy
    build = runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "scenes", "bolt_bin.py"))["build"]
    return flatten(build(n), source=f"bolt bin {n}")


def test_instance_list_is_one_body_function_and_a_bvh_of_nested_blocks():
    tape = bolt_bin(20)
    text = scene_function(tape)
    assert text.count("fn bl_instances_") == 1
    assert text.count("let lp = bl_instance_point(") == text.count("bl_instances_6(lp, ") == len(tape.instances) == 20
    assert text.count("if (!(bb >= acc6) && !(bb > reach6))") == len(tape.bvh)
    assert text.count("let reach6 = instances_reach(") == 1
    assert "bvh[" not in text and "instances[" not in text


def test_pattern_tapes_are_refused():
    tape = flatten(sphere(0.2).linear_pattern((1, 0, 0), 4))
    with pytest.raises(TaperayError, match="pattern"):
        scene_function(tape)


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(TAPES))
@pytest.mark.parametrize("culls", [True, False])
def test_baseline_matches_cpu_twin(walker_gpu, walker_cpu, name, culls):
    from taperay.tools.bench_baseline import BaselineKernel
    tape = TAPES[name]()
    pts = np.random.default_rng(3).uniform(tape.bounds[0] - 0.2, tape.bounds[1] + 0.2, (4000, 3)).astype(np.float32)
    kernel = BaselineKernel(walker_gpu, tape, culls=culls)
    d, m = kernel.evaluate(pts)
    want_d, want_m = walker_cpu.evaluate(tape, pts)
    # float32 with literals folded by the shader compiler: a few ULP of the field's scale
    scale = float(np.abs(want_d).max())
    np.testing.assert_allclose(d, want_d, rtol=1e-5, atol=1e-6 * max(scale, 1.0))
    np.testing.assert_array_equal(m, want_m)


def three_primitives():
    """Three overlapping primitives of three materials: silhouettes, shadows and material edges."""
    return union(sphere(0.6).material(RED), box(0.5, 0.3, 0.4).rotate((1, 1, 0), 25).translate(0.6, 0, 0),
                 rounded_box(0.2, 0.6, 0.2, 0.05).translate(-0.3, 0.4, 0.2).material(GREEN))


@pytest.mark.gpu
def test_written_out_frames_equal_the_interpreters(walker_gpu):
    """Every view at 48x27: the written-out kernels are the walker's kernels around a scene function
    of the interpreter's float32 operations in its order, so where the driver keeps each operation
    as written (Mesa's lavapipe) the frames are equal byte for byte. A driver may fuse a written-out
    multiply and add into one rounding (WGSL has no way to forbid it; the interpreter's values pass
    through its register array, so they are not fused): on the H200 the gradient view's colours
    differed by one level in 11 of 1,296 pixels. There, colours within one level on at most 2 % of
    the pixels."""
    from taperay.runtime.shading import VIEWS
    from taperay.tools.bench_baseline import WRITTEN_OUT_KERNELS, BaselineKernel
    tape = flatten(three_primitives(), source="three primitives")
    interpreter_march = walker_gpu.kernels.pipeline("march", walker_gpu.upload(tape))
    kernel = BaselineKernel(walker_gpu, tape, kernels=WRITTEN_OUT_KERNELS)
    hits = walker_gpu.march(tape, None, 48, 27)["hit"]
    assert 0.1 < hits.mean() < 0.9
    for view in VIEWS:
        want = walker_gpu.render(tape, None, 48, 27, view=view)
        got = kernel.render(None, 48, 27, view)
        if walker_gpu.info["software"]:
            np.testing.assert_array_equal(got, want, err_msg=view)
        else:
            assert np.abs(got.astype(int) - want).max() <= 1, view
            assert np.any(got != want, axis=-1).mean() <= 0.02, view
    assert walker_gpu.kernels.pipeline("march", kernel.variant) is interpreter_march   # put back


def test_render_refuses_kernels_not_written_out():
    from taperay.tools.bench_baseline import BaselineKernel
    with pytest.raises(TaperayError, match="choose from"):
        BaselineKernel(None, None, kernels=("prune_tiles",))


@pytest.mark.slow
@pytest.mark.gpu
def test_written_out_instance_list_equals_the_interpreter(walker_gpu):
    """A bin of 20 bolts (one INSTANCES record over a BVH): the written-out walk gives the
    interpreter's field and materials exactly (the same float32 operations in the same order) and
    so the same frame."""
    from taperay.tools.bench_baseline import FRAME_KERNELS, POINT_KERNELS, BaselineKernel
    tape = bolt_bin(20)
    kernel = BaselineKernel(walker_gpu, tape, kernels=POINT_KERNELS + FRAME_KERNELS)
    pts = np.random.default_rng(5).uniform(tape.bounds[0], tape.bounds[1], (5000, 3)).astype(np.float32)
    d, m = kernel.evaluate(pts)
    want_d, want_m = walker_gpu.evaluate(tape, pts)
    assert float(np.max(np.abs(d - want_d))) <= 1e-6
    np.testing.assert_array_equal(m, want_m)
    np.testing.assert_array_equal(kernel.render(None, 48, 27, "normals"),
                                  walker_gpu.render(tape, None, 48, 27, view="normals"))


def test_compile_prediction_is_a_power_law_of_at_least_one():
    from taperay.tools.bench_assembly import predict_compile_seconds
    assert predict_compile_seconds([], 1000) is None
    assert predict_compile_seconds([(1000, 2.0)], 3000) == pytest.approx(6.0)
    assert predict_compile_seconds([(1000, 1.0), (2000, 4.0)], 4000) == pytest.approx(16.0)   # exponent 2
    assert predict_compile_seconds([(1000, 4.0), (2000, 1.0)], 4000) == pytest.approx(2.0)    # never below 1


@pytest.mark.slow
@pytest.mark.gpu
def test_assembly_bench_compiles_in_a_child_and_stops_at_the_predicted_limit(walker_gpu):
    """The bolt bin against the written-out baseline: the first count is compiled and measured in a
    child process; with a limit no compile can meet, the next is predicted past it and not compiled,
    and neither is any after it (no timing is asserted)."""
    from taperay.tools.bench_assembly import written_out
    rows, note = written_out(walker_gpu, (16, 9), 1, limit_s=1e-6, counts=(10, 20, 40))
    assert [r["status"].split(":")[0] for r in rows] == ["measured", "not compiled", "not compiled (a smaller "
                                                         "count was predicted past 1e-06 s)"]
    assert rows[0]["max abs difference"] <= 1e-6 and rows[0]["compile s"] > 0
    assert "measured at 10 bolts" in note and "not at 20, 40 bolts" in note


@pytest.mark.slow
@pytest.mark.gpu
def test_written_out_frames_run_the_tapes_own_records_not_its_lowering(walker_gpu):
    """GpuWalker.render draws a scene tape it has seen before as its lowering on cells; the
    baseline's render must still run the written-out kernels of the tape itself."""
    from taperay.tools.bench_baseline import FRAME_KERNELS, BaselineKernel
    from taperay.tools.bench_gpu import primitive_scene
    tape = flatten(primitive_scene(12, seed=1), source="12 primitives")
    assert walker_gpu.render_tape(tape) is not tape                       # (a lowerable tape)
    kernel = BaselineKernel(walker_gpu, tape, kernels=FRAME_KERNELS)
    for _ in range(2):
        walker_gpu.render(tape, None, 32, 18, view="normals")             # (seen: lowered from now on)
    walker_gpu.drop_kept_cells()
    image = kernel.render(None, 32, 18, "normals")
    assert walker_gpu.stats()["kept_cells"] is None                                 # no cells were built or used
    np.testing.assert_array_equal(image, walker_gpu.render(tape, None, 32, 18, view="normals", cells=None))
