"""Conformance: the random tape generator covers every op with valid tapes, the tolerance table
covers every op, the measures (ULPs, hit masks, first differing point / record) find what they
should, and the GPU walker conforms to the twin on random tapes (small counts: lavapipe)."""
import numpy as np
import pytest

from taperay.runtime import conformance as C
from taperay.runtime.opcodes import Op
from taperay.runtime.tape import validate


def test_tolerance_table_covers_every_op():
    assert set(C.TOLERANCES) == set(Op)
    for tol in C.TOLERANCES.values():
        assert tol.ulps >= 0 and tol.abs_rel > 0 and tol.why


@pytest.mark.parametrize("op", list(Op), ids=lambda o: o.name)
def test_op_tape_is_valid_and_uses_its_op(op):
    tape = C.op_tape(op, np.random.default_rng(int(op)))
    validate(tape)
    assert op.name in tape.op_counts()


def test_random_tapes_are_valid_and_cover_the_scene_ops():
    seen = set()
    for i in range(40):
        tape = C.random_tape(np.random.default_rng([7, i]))
        validate(tape)
        seen |= set(tape.op_counts())
    wanted = {"SPHERE", "BOX", "UNION", "SMOOTH_UNION", "PUSH", "ROTATE", "REPEAT_LINEAR", "REPEAT_POLAR",
              "REPEAT_GRID", "INSTANCES", "REPEAT_END", "CULL_BOX", "INSTANCE_INDEX", "FIELD_RESULT",
              "OFFSET", "SHELL", "EXTRUDE_POLY", "REVOLVE_POLY"}
    assert wanted <= seen


def test_random_tapes_are_reproducible_from_the_seed():
    a = C.random_tape(np.random.default_rng([3, 1]))
    b = C.random_tape(np.random.default_rng([3, 1]))
    assert np.array_equal(a.instrs, b.instrs) and np.array_equal(a.params, b.params)


def test_ulp_distance():
    one = np.float32(1)
    assert C.ulp_distance(one, np.nextafter(one, np.float32(2))) == 1
    assert C.ulp_distance(np.float32(-0.0), np.float32(0.0)) == 0
    assert C.ulp_distance(np.nextafter(np.float32(0), np.float32(-1)), np.nextafter(np.float32(0), one)) == 2
    assert C.ulp_distance(np.float32(np.nan), np.float32(np.nan)) == 0
    assert C.ulp_distance(np.float32(np.nan), one) > 1 << 30


class _Skewed:
    """The twin with one op answering wrong (by ``delta``) and every march miss-shifted: a walker
    conformance must catch, naming the op, the first point and the first record."""
    name = "skewed"
    capabilities = frozenset({"evaluate", "render"})

    def __init__(self, cpu, op: Op, delta: float):
        self.cpu, self.op, self.delta = cpu, op, delta

    def evaluate(self, tape, pts):
        d, m = self.cpu.evaluate(tape, pts)
        if int(self.op) in tape.instrs["op"]:
            d = d + np.float32(self.delta) * (np.asarray(pts)[:, 0] > 0)
        return d, m

    def march(self, tape, cam, w, h, settings=None):
        out = self.cpu.march(tape, cam, w, h, settings)
        out["hit"] = out["hit"].copy()
        out["hit"][: h // 2] = ~out["hit"][: h // 2]
        return out


@pytest.mark.slow
def test_a_wrong_walker_fails_with_its_first_point_record_and_pixel(walker_cpu):
    tape = C.op_tape(Op.TORUS, np.random.default_rng(1))
    report = C.conform_tape(tape, graded={"skewed": _Skewed(walker_cpu, Op.TORUS, 0.01)}, n_points=64,
                            image=(12, 10))
    assert not report.passed
    (scene,) = report.scenes
    pts, _ = C.sample_points(tape, np.random.default_rng(0), 64)
    assert scene.field.first_point == int(np.flatnonzero(pts[:, 0] > 0)[0])
    assert scene.field.first_record == 0            # the torus record
    assert scene.hit_mismatch > C.HIT_MASK_MAX and scene.first_pixel[0] == 0
    assert report.failures() == [f"scene {scene.field.name} on skewed"]
    good = C.conform_tape(tape, graded={"twin": walker_cpu}, n_points=64, image=(12, 10))
    assert good.passed and good.scenes[0].field.ulp_hist[0] == 64


def test_table_renders(walker_cpu):
    from rich.console import Console
    report = C.conform_tape(C.reference_tape(), graded={"twin": walker_cpu}, n_points=32, image=(8, 6))
    console = Console(width=200, record=True)
    console.print(report.table())
    text = console.export_text()
    assert "per scene" in text and "self-check scene" in text and "yes" in text


@pytest.mark.slow
@pytest.mark.gpu
def test_gpu_conforms_on_random_tapes(walker_gpu):
    report = C.conform_random(2, seed=11, n_points=48, image=(12, 9), graded={"gpu": walker_gpu})
    assert len(report.ops) == len(Op) and len(report.scenes) == 3
    assert report.passed, report.failures()


@pytest.mark.needs("evaluate")
def test_walkers_conform_on_the_reference_scene(walkers_graded):
    """Points on every walker graded; the march image on those that render."""
    report = C.conform_tape(C.reference_tape(), n_points=96, image=(20, 15),
                            graded={walkers_graded.name: walkers_graded})
    assert report.passed, report.failures()
    (scene,) = report.scenes
    assert scene.pixels == (20 * 15 if "render" in walkers_graded.capabilities else 0)
    assert scene.hit_mismatch <= C.HIT_MASK_MAX


def test_a_grazing_ray_is_told_from_hits_and_misses(walker_cpu):
    """Random scene #480 (seed 0): the ray of pixel (6, 9) of the 24 x 18 conformance march passes
    within 0.89 hit_eps of the surface between the twin's samples (a miss on the twin; a hit on the
    H200, whose samples round otherwise): grazing. A pixel inside the silhouette and one of
    background far from it are not; so a walker flipping them fails (the skewed walker above)."""
    from taperay.runtime.camera import auto_camera
    from taperay.runtime.shading import RenderSettings
    tape = C.random_tape(np.random.default_rng([0, 480]))
    cam, settings = auto_camera(tape.bounds), RenderSettings()
    m = walker_cpu.march(tape, cam, 24, 18, settings)
    assert not m["hit"][6, 9]
    hit_px = tuple(np.argwhere(m["hit"])[len(np.argwhere(m["hit"])) // 2])
    miss_px = (0, 0)
    assert m["hit"][hit_px] and not m["hit"][miss_px]
    band = C.scene_tolerance(tape).abs_rel * 2.0
    assert C.grazing_pixels(tape, cam, 24, 18, settings, [(6, 9), hit_px, miss_px], band).tolist() == [True, False, False]
