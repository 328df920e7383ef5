"""The GPU walker against the CPU twin: every entry point, every view, the register variants, long
tapes (resumed dispatches, the iteration cap), refusals before dispatch, device loss, the adapter
CI requires, and the self-check the CLI trusts the GPU by. Images and point sets stay small:
lavapipe runs the interpreter on the CPU."""
import glob
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from conftest import gpu_required
from taperay.runtime import conformance as C
from taperay.runtime import gpu, gpu_device
from taperay.runtime.camera import auto_camera
from taperay.runtime.opcodes import Op
from taperay.runtime.shading import VIEWS, RenderSettings
from taperay.runtime.tape import TaperayError
from taperay.scenegraph import (Param, box, capsule, cylinder, flatten, smooth_union, sphere, torus,
                                union)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def scene():
    """Shapes, point ops, a smooth union, culled unions and linear / polar / grid patterns."""
    return flatten(union(
        smooth_union(sphere(Param("radius", 0.45)).translate(0.3, 0, 0),
                     box(0.3, 0.2, 0.4).rotate((0, 0, 1), 30), k=0.1),
        torus(0.5, 0.1).translate(0, 0, 0.5),
        capsule((0, 0, 0), (0.5, 0.5, 0), 0.1),
        sphere(0.1).linear_pattern((0.3, 0, 0), 5).translate(0, -0.8, 0),
        cylinder(0.05, 0.1).translate(0.6, 0, 0).polar_pattern(6).translate(0, 0, -0.6),
        box(0.05).grid_pattern((0.2, 0.2, 0.2), (3, 2, 2)).translate(-1, 0, 0)), source="test scene")


def _points(n, seed=0, lo=-1.5, hi=1.5):
    return np.random.default_rng(seed).uniform(lo, hi, (n, 3)).astype(np.float32)


def _agree(tape, ref, got, scale=1.5):
    """Within the conformance tolerance of the tape's ops (points in [-scale, scale]^3)."""
    return bool(C.within_tolerance(ref, got, C.scene_tolerance(tape), scale).all())


def _materials_agree(ref, got):
    return np.mean(ref != got) <= C.MATERIAL_MAX


# ---------------------------------------------------------------------------------- adapter
def test_lavapipe_is_present_when_ci_requires_the_gpu():
    """CI (TAPERAY_REQUIRE_GPU=1) must have Mesa's lavapipe installed and an adapter found, so
    the GPU tests run there. A machine whose adapter is a hardware GPU (the lent H200) runs them
    on that and needs no lavapipe."""
    if not gpu_required():
        pytest.skip("TAPERAY_REQUIRE_GPU is not 1")
    info = gpu.adapter_info()
    if info is not None and not info["software"]:
        assert gpu.GpuWalker.available()
        return
    icds = [f for d in ("/usr/share/vulkan/icd.d", "/etc/vulkan/icd.d", "/usr/local/share/vulkan/icd.d")
            for f in glob.glob(os.path.join(d, "lvp_icd*.json"))]
    assert icds, "Mesa lavapipe (mesa-vulkan-drivers) is not installed"
    assert info is not None, "no GPU adapter although lavapipe is installed"
    assert gpu.GpuWalker.available()


def test_adapter_info_names_the_adapter(walker_gpu):
    info = walker_gpu.info
    assert info["name"] and info["backend"]
    assert isinstance(info["software"], bool)
    text = (info["name"] + info["driver"]).lower()
    assert info["software"] == ("llvmpipe" in text or "lavapipe" in text or info["adapter_type"] == "CPU")
    assert walker_gpu.adapter_name.startswith(info["name"])


def test_a_walker_runs_on_the_device_context_it_is_given(walker_gpu, scene):
    """GpuWalker(context=...): the device, its limits and kernel set of that context, its own
    buffers; nothing is built for it."""
    made = walker_gpu.stats()["pipelines_created"]
    other = gpu.GpuWalker(context=walker_gpu.context)
    assert other.context is walker_gpu.context and other.kernels is walker_gpu.kernels
    assert other.device is walker_gpu.device and other.info == walker_gpu.info
    pts = _points(50, seed=12)
    np.testing.assert_array_equal(other.evaluate(scene, pts)[0], walker_gpu.evaluate(scene, pts)[0])
    assert other.stats()["points_evaluated"] == 50 and walker_gpu.stats()["pipelines_created"] == made


# ---------------------------------------------------------------------------------- agreement
def test_evaluate_matches_the_twin(walker_gpu, walker_cpu, scene):
    pts = _points(500)
    (dc, mc), (dg, mg) = walker_cpu.evaluate(scene, pts), walker_gpu.evaluate(scene, pts)
    assert dg.dtype == np.float32 and mg.dtype == np.uint32 and dg.shape == (500,)
    assert _agree(scene, dc, dg)
    assert _materials_agree(mc, mg)


def test_gradient_matches_the_twin(walker_gpu, walker_cpu, scene):
    pts = _points(60, seed=1)
    gg = walker_gpu.gradient(scene, pts)
    assert gg.shape == (60, 3) and gg.dtype == np.float32
    torus = C.op_tape(Op.TORUS, np.random.default_rng(2))
    tol = C.tape_tolerance(torus)
    for eps in (None, 0.01):
        gc, gg = walker_cpu.gradient(torus, pts, eps=eps), walker_gpu.gradient(torus, pts, eps=eps)
        e = eps or 1e-3 * float(np.linalg.norm(torus.bounds[1] - torus.bounds[0]))
        # a difference quotient: the field's tolerance at both taps over 2 eps, plus its rounding
        bound = 2 * tol.abs_rel * 1.5 / (2 * e) + 1e-5
        assert np.abs(gc - gg).max() <= bound


def test_field_image_matches_the_twin(walker_gpu, walker_cpu, scene):
    fc = walker_cpu.field_image(scene, 20, 14, rect=(-1.5, 1.2, -1.0, 1.3), z=0.1)
    fg = walker_gpu.field_image(scene, 20, 14, rect=(-1.5, 1.2, -1.0, 1.3), z=0.1)
    assert fg.shape == (14, 20)
    assert np.abs(fc - fg).max() <= 1e-5   # pixel centres computed in float32 vs float64


def test_march_matches_the_twin(walker_gpu, walker_cpu, scene):
    cam = auto_camera(scene.bounds)
    mc, mg = walker_cpu.march(scene, cam, 24, 18), walker_gpu.march(scene, cam, 24, 18)
    assert set(mc) <= set(mg)
    assert (mc["hit"] != mg["hit"]).mean() <= C.HIT_MASK_MAX
    both = mc["hit"] & mg["hit"]
    assert both.sum() > 20
    assert np.abs(mc["t"][both] - mg["t"][both]).max() <= 4 * RenderSettings().pack(scene)[1]
    assert _materials_agree(mc["mat"][both], mg["mat"][both])
    assert np.all(np.isinf(mg["t"][~mg["hit"]]))
    assert mg["steps"].dtype == np.int32


@pytest.mark.parametrize("view", VIEWS)
def test_every_view_matches_the_twin(walker_gpu, walker_cpu, scene, view):
    cam = auto_camera(scene.bounds, azimuth_deg=50)
    ic = walker_cpu.render(scene, cam, 24, 16, view=view)
    ig = walker_gpu.render(scene, cam, 24, 16, view=view)
    assert ig.shape == (16, 24, 3) and ig.dtype == np.uint8
    cmp = C.compare_images(ic, ig, levels=2)
    assert cmp["mismatch_fraction"] <= 0.02, cmp


def test_soft_shadows_and_no_ao_match_the_twin(walker_gpu, walker_cpu, scene):
    cam = auto_camera(scene.bounds)
    st = RenderSettings(shadows="soft", ao_strength=0.0, max_steps=64)
    cmp = C.compare_images(walker_cpu.render(scene, cam, 20, 14, settings=st),
                           walker_gpu.render(scene, cam, 20, 14, settings=st), levels=2)
    assert cmp["mismatch_fraction"] <= 0.02, cmp


def test_samples_accumulate_and_the_first_is_the_pixel_centre(walker_gpu, scene):
    cam = auto_camera(scene.bounds)
    one = walker_gpu.render(scene, cam, 16, 12, view="normals")
    four = walker_gpu.render(scene, cam, 16, 12, view="normals", samples=4)
    assert four.shape == one.shape
    assert not np.array_equal(one, four)   # silhouettes are averaged
    assert np.abs(one.astype(int) - four).mean() < 40
    with pytest.raises(TaperayError):
        walker_gpu.render(scene, cam, 16, 12, samples=0)


@pytest.mark.parametrize("n_regs", [10, 60, 248])
def test_each_register_variant_matches_the_twin(walker_gpu, walker_cpu, n_regs):
    tape = C.wide_tape(np.random.default_rng(n_regs), n_regs)
    assert gpu_device.variant_for(tape.n_regs) == min(c for c in (16, 64, 256) if c >= n_regs)
    pts = _points(64, seed=n_regs)
    assert _agree(tape, walker_cpu.evaluate(tape, pts)[0], walker_gpu.evaluate(tape, pts)[0])


# ---------------------------------------------------------------------------------- long tapes
def _long_tape(n_spheres):
    b = C.TapeBuilder()
    rng = np.random.default_rng(3)
    b.row(Op.SPHERE, 0, params=[0.2])
    for _ in range(n_spheres):
        b.row(Op.PUSH)
        b.row(Op.TRANSLATE, params=rng.uniform(-1.2, 1.2, 3))
        b.row(Op.SPHERE, 1, params=[rng.uniform(0.05, 0.3)])
        b.row(Op.POP)
        b.row(Op.UNION, 0, a=0, b=1)
    return b.tape(C.random_materials(rng), [[-1.6] * 3, [1.6] * 3], "long tape")


@pytest.mark.slow
def test_long_tape_march_resumes_and_matches_the_twin(walker_gpu, walker_cpu):
    """1201 records x up to 47 steps: more loop iterations than lavapipe runs in one invocation,
    so the march saves its state and is dispatched again."""
    tape = _long_tape(240)
    cam = auto_camera(tape.bounds)
    before = walker_gpu.resumed_dispatches
    mc, mg = walker_cpu.march(tape, cam, 16, 12), walker_gpu.march(tape, cam, 16, 12)
    assert mc["hit"].sum() > 10
    assert (mc["hit"] != mg["hit"]).mean() <= C.HIT_MASK_MAX
    assert np.abs(mc["steps"] - mg["steps"]).max() <= 2 and mg["steps"].max() > 40
    if walker_gpu.info["software"]:
        assert walker_gpu.resumed_dispatches > before


@pytest.mark.slow
def test_a_frame_left_unfinished_in_one_submission_runs_again_with_resumes(walker_gpu):
    """A frame runs in one submission where the last one finished every pixel; where its march
    leaves pixels unfinished there (the long tape on lavapipe's iteration budget) its passes run
    again with resumes, and give the image drawn that way from the start; a frame that finishes
    at once goes back to one submission."""
    if not walker_gpu.info["software"]:
        pytest.skip("a hardware adapter's budget finishes this tape in one dispatch")
    from taperay.scenegraph import flatten, sphere
    small, long = flatten(sphere(0.5)), _long_tape(240)
    cam = auto_camera(long.bounds)

    def waits():
        return walker_gpu.stats()["waits"]
    walker_gpu.render(small, None, 16, 12, cells=None)
    before, resumed = waits(), walker_gpu.resumed_dispatches
    tried = walker_gpu.render(long, cam, 16, 12, cells=None)      # at once, then again with resumes
    assert walker_gpu.resumed_dispatches > resumed and waits() - before > 2
    resumed = walker_gpu.resumed_dispatches
    again = walker_gpu.render(long, cam, 16, 12, cells=None)      # with resumes from the start
    assert walker_gpu.resumed_dispatches > resumed
    assert np.array_equal(tried, again) and len(np.unique(tried.reshape(-1, 3), axis=0)) > 4
    walker_gpu.render(small, None, 16, 12, cells=None)
    before = waits()
    walker_gpu.render(small, None, 16, 12, cells=None)
    assert waits() - before == 1


@pytest.mark.slow
def test_an_evaluation_past_the_iteration_cap_is_refused(walker_gpu):
    if not walker_gpu.info["software"]:
        pytest.skip("hardware adapters have no per-invocation loop limit")
    b = C.TapeBuilder()
    b.row(Op.CONST, 0, params=[0.0])
    b.row(Op.CONST, 1, params=[1.0])
    for _ in range(gpu_device.SOFTWARE_ITER_CAP):
        b.row(Op.ADD, 0, a=0, b=1)
    tape = b.tape(C.random_materials(np.random.default_rng(0)), [[-1] * 3, [1] * 3], "too long")
    with pytest.raises(TaperayError, match="too long: one evaluation of this tape needs more than"):
        walker_gpu.evaluate(tape, np.zeros((2, 3)))


# ---------------------------------------------------------------------------------- refusals
def test_tapes_beyond_the_kernels_are_refused_before_dispatch(walker_gpu, scene, monkeypatch):
    with pytest.raises(TaperayError, match="registers"):
        gpu_device.variant_for(257)
    small = dict(walker_gpu.context.limits, max_storage_buffer_binding_size=64)
    monkeypatch.setattr(walker_gpu.context, "limits", small)
    written = walker_gpu.stats()["tape_bytes_written"]
    with pytest.raises(TaperayError, match="binds at most 64 bytes"):
        walker_gpu.evaluate(scene, np.zeros((1, 3)))
    assert walker_gpu.stats()["tape_bytes_written"] == written


def test_point_sets_beyond_the_binding_limit_run_in_chunks(walker_gpu, walker_cpu, monkeypatch):
    tape = C.op_tape(Op.CAPSULE, np.random.default_rng(4))
    monkeypatch.setattr(walker_gpu.context, "limits", dict(walker_gpu.context.limits, max_storage_buffer_binding_size=2048))
    pts = _points(1000, seed=4)
    (dc, mc), (dg, mg) = walker_cpu.evaluate(tape, pts), walker_gpu.evaluate(tape, pts)
    assert _agree(tape, dc, dg) and _materials_agree(mc, mg)
    gc, gg = walker_cpu.gradient(tape, pts[:200]), walker_gpu.gradient(tape, pts[:200])
    assert gg.shape == (200, 3) and np.abs(gc - gg).max() <= 1e-2
    with pytest.raises(TaperayError, match="binds at most"):
        walker_gpu.render(tape, None, 64, 48)


def test_bad_arguments_raise_taperay_errors(walker_gpu, scene):
    with pytest.raises(TaperayError):
        walker_gpu.evaluate(scene, np.zeros((4, 2)))
    with pytest.raises(TaperayError):
        walker_gpu.field_image(scene, 0, 4)
    with pytest.raises(TaperayError):
        walker_gpu.render(scene, None, 8, 8, view="nope")
    d, m = walker_gpu.evaluate(scene, np.zeros((0, 3)))
    assert d.shape == (0,) and m.shape == (0,)


# ---------------------------------------------------------------------------------- edits
def test_set_param_writes_only_the_changed_bytes(walker_gpu, walker_cpu, scene):
    tape = replace(scene, refit=None)    # as read from a .tape file: no scene, no refit
    pts = _points(32, seed=5)
    walker_gpu.evaluate(tape, pts)
    before = walker_gpu.stats()["tape_bytes_written"]
    walker_gpu.set_param(tape, "radius", 0.4)
    assert walker_gpu.stats()["tape_bytes_written"] - before == 4 * len(tape.names["radius"])
    d_gpu = walker_gpu.evaluate(tape, pts)[0]
    assert walker_gpu.stats()["tape_bytes_written"] - before == 4 * len(tape.names["radius"])
    assert _agree(tape, walker_cpu.evaluate(tape, pts)[0], d_gpu)
    # from a scene, the edit also refits the cull boxes around the sphere: a few spans, not the tape
    walker_gpu.evaluate(scene, pts)
    before = walker_gpu.stats()["tape_bytes_written"]
    walker_gpu.set_param(scene, "radius", 0.6)
    written = walker_gpu.stats()["tape_bytes_written"] - before
    assert 4 * len(scene.names["radius"]) < written < scene.params.nbytes + scene.instrs.nbytes
    d_gpu = walker_gpu.evaluate(scene, pts)[0]
    assert walker_gpu.stats()["tape_bytes_written"] - before == written
    assert _agree(scene, walker_cpu.evaluate(scene, pts)[0], d_gpu)
    walker_gpu.set_param(scene, "radius", 0.45)


def test_a_frozen_tape_is_compared_once_and_its_edits_still_reach_the_gpu(walker_gpu, walker_cpu, scene,
                                                                          monkeypatch):
    """Every frame syncs the tape's buffers; a frozen tape's arrays that a buffer holds already are
    not compared again (gpu_device.Buffer.held), while a set_param edit (a new params array) and a
    tape with new arrays are."""
    tape = replace(scene, refit=None)
    pts = _points(32, seed=6)
    walker_gpu.evaluate(tape, pts)
    assert not tape.instrs.flags.writeable                 # (validated: frozen)

    def compared():                                        # (bytes of each tape array compared to a mirror)
        return {n: walker_gpu.stats()["bytes_compared"][n] for n in gpu.TAPE_ARRAYS}
    before = compared()
    walker_gpu.evaluate(tape, pts)
    walker_gpu.render(tape, None, 8, 6)
    assert compared() == before
    walker_gpu.set_param(tape, "radius", 0.35)
    d_gpu = walker_gpu.evaluate(tape, pts)[0]
    assert _agree(tape, walker_cpu.evaluate(tape, pts)[0], d_gpu)
    other = replace(tape, params=tape.params.copy())
    other.params[tape.names["radius"]] = 0.3
    before = compared()
    walker_gpu.evaluate(other, pts)
    after = compared()                                     # (new arrays: compared, the changed span written)
    assert after["params"] >= before["params"] + other.params.nbytes
    assert after["instrs"] == before["instrs"]             # (the same frozen instructions: not compared again)
    assert _agree(other, walker_cpu.evaluate(other, pts)[0], walker_gpu.evaluate(other, pts)[0])


def test_set_param_refits_a_culled_scene_on_the_gpu(walker_gpu, walker_cpu):
    from taperay.scenegraph import Param, flatten, sphere, union
    centres = np.random.default_rng(4).uniform(-2, 2, (12, 3))
    tape = flatten(union(*[sphere(Param("r", 0.15)).translate(*c) for c in centres]))
    pts = _points(64, seed=9) * 2
    walker_gpu.evaluate(tape, pts)
    before = walker_gpu.stats()["tape_bytes_written"]
    walker_gpu.set_param(tape, "r", 0.8)                 # past the cull boxes: they are refitted
    assert walker_gpu.stats()["tape_bytes_written"] - before > 4 * len(tape.names["r"])
    d_gpu = walker_gpu.evaluate(tape, pts)[0]
    d_cpu = walker_cpu.evaluate(tape, pts)[0]
    assert _agree(tape, d_cpu, d_gpu)
    brute = (np.linalg.norm(pts[:, None].astype(float) - centres[None], axis=2) - 0.8).min(1)
    np.testing.assert_allclose(d_cpu, brute, atol=2e-6)


def test_uploads_write_differences_and_grow_buffers_by_doubling(walker_gpu, scene):
    walker_gpu.upload(scene)
    before = walker_gpu.stats()["tape_bytes_written"]
    walker_gpu.upload(scene)
    assert walker_gpu.stats()["tape_bytes_written"] == before   # nothing changed, nothing written
    big = C.wide_tape(np.random.default_rng(9), 200)
    walker_gpu.upload(big)
    cap = walker_gpu.stats()["tape_buffer_bytes"]["instrs"]
    assert cap >= big.instrs.nbytes and cap & (cap - 1) == 0 and cap >= gpu_device.MIN_BUFFER


# ---------------------------------------------------------------------------------- failure
@pytest.mark.slow
def test_device_loss_is_a_taperay_error_and_the_next_call_rebuilds(walker_gpu, walker_cpu, scene):
    pts = _points(8, seed=7)
    walker_gpu.evaluate(scene, pts)
    old = walker_gpu.device
    old.destroy()
    with pytest.raises(gpu.GpuError, match="the GPU failed"):
        walker_gpu.evaluate(scene, pts)
    d = walker_gpu.evaluate(scene, pts)[0]      # a new device and kernel set
    assert walker_gpu.device is not old
    assert _agree(scene, walker_cpu.evaluate(scene, pts)[0], d)


@pytest.mark.slow
def test_self_check_passes_here_and_catches_a_wrong_gpu(walker_gpu):
    check = C.gpu_self_check(walker_gpu)
    assert check.passed, str(check)
    assert "passed" in str(check) and check.adapter == walker_gpu.adapter_name

    class Wrong:
        adapter_name = "broken"

        def render(self, tape, cam, w, h, view="shade"):
            img = walker_gpu.render(tape, cam, w, h, view=view)
            img[h // 3:, :] = 255 - img[h // 3:, :]
            return img

    bad = C.gpu_self_check(Wrong())
    assert not bad.passed and bad.mismatch_fraction > 0.3
    assert bad.first_pixel is not None and bad.first_pixel[0] >= C.SELF_CHECK_SIZE[1] // 3
    assert "FAILED" in str(bad)


def test_frames_and_kept_cell_images_wait_for_the_gpu_once_a_submission(walker_gpu, monkeypatch):
    """Each wait is a round trip to the GPU. A shaded frame whose march and light passes finish
    every pixel in their first dispatch waits once, its image read back with its passes; an
    image on kept cells once, its pixel pass and its bits together."""
    from taperay.scenegraph import flatten, sphere
    from taperay.scenegraph.vm import load_vm
    tape = flatten(sphere(0.5) | sphere(0.3).translate(0.6, 0, 0))
    prog = load_vm(Path(__file__).parent / "data" / "sphere.vm")
    def waits():
        return walker_gpu.stats()["waits"]
    walker_gpu.render(tape, None, 24, 18, cells=None)
    before, resumed = waits(), walker_gpu.resumed_dispatches
    frame = walker_gpu.render(tape, None, 24, 18, cells=None)
    assert walker_gpu.resumed_dispatches == resumed and waits() - before == 1
    walker_gpu.sign_image(prog, 32, 32, cells=(2, 2))       # (prunes the cells: a wait more)
    before = waits()
    kept = walker_gpu.sign_image(prog, 32, 32, cells=(2, 2))
    assert waits() - before == 1
    assert kept.any() and not kept.all() and frame.shape == (18, 24, 3)
