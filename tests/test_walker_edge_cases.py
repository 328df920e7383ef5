"""Edge cases found by `taperay conform --random 2000`, graded on every walker against the twin."""
import numpy as np
import pytest

from taperay.runtime.conformance import random_tape, scene_tolerance, within_tolerance
from taperay.runtime.tape import INSTR_DTYPE, MATERIAL_DTYPE, Op, Tape


@pytest.mark.needs("evaluate")
def test_atan2_of_signed_zeros_is_ieee_on_every_walker(walkers_all):
    """atan2 of signed zeros as IEEE 754 (and numpy) define it: +-0 and +-pi, bit for bit."""
    ins = np.zeros(3, INSTR_DTYPE)
    ins["op"] = [Op.VAR_Y, Op.VAR_X, Op.ATAN2]
    ins["dst"] = [1, 2, 0]
    ins["a"][2], ins["b"][2] = 1, 2
    tape = Tape(ins, np.zeros(1, np.float32), np.zeros(1, MATERIAL_DTYPE), 3, [[-1] * 3, [1] * 3])
    pts = np.array([[0, 0, 0], [-0.0, 0, 0], [0, -0.0, 0], [-0.0, -0.0, 0]], np.float32)
    got, _ = walkers_all.evaluate(tape, pts)
    ieee = np.arctan2(pts[:, 1], pts[:, 0]).astype(np.float32)
    assert got.view(np.uint32).tolist() == ieee.view(np.uint32).tolist()


@pytest.mark.needs("evaluate")     # (graded against the twin: the twin itself is not)
def test_polar_pattern_at_its_axis_picks_the_twins_sectors(walkers_graded, walker_cpu):
    # random scene #1100 of seed 0: an ELONGATE maps the point onto the polar axis, where the
    # sector angle is atan2(0, 0); the body's value depends on INSTANCE_INDEX. The body's own
    # float32 arithmetic may round otherwise on a GPU (2 ulp on the H200), so the value is graded
    # as conformance grades the scene; another sector's instance is another value.
    tape = random_tape(np.random.default_rng([0, 1100]))
    pts = np.array([[0.17702772, -0.13378888, 0.11711745]], np.float32)
    got, want = walkers_graded.evaluate(tape, pts), walker_cpu.evaluate(tape, pts)
    assert within_tolerance(want[0], got[0], scene_tolerance(tape), 1.0).all(), (got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_sign_image_is_the_field_below_zero_on_every_walker(walkers_all):
    from pathlib import Path

    from taperay.scenegraph.vm import load_vm
    tape = load_vm(Path(__file__).parent / "data" / "hi.vm")
    rect = (-1.1, 1.05, -0.95, 1.2)
    inside = walkers_all.sign_image(tape, 96, 80, rect)
    assert inside.dtype == bool and inside.shape == (80, 96)
    assert np.array_equal(inside, walkers_all.field_image(tape, 96, 80, rect) < 0)
    assert 0 < inside.sum() < inside.size
