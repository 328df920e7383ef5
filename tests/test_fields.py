"""Custom fields as scene nodes: Python expressions and .vm programs, transformed, patterned,
combined with primitives and given materials."""
from pathlib import Path

import numpy as np
import pytest

from taperay.runtime.tape import TaperayError
from taperay.scenegraph import Material, field, flatten, node_from_dict, sphere, union, vm_field
from taperay.scenegraph.fields import atan2, cos, maximum, minimum, sin, sqrt, x, y, z

DATA = Path(__file__).parent / "data"
RNG = np.random.default_rng(11)


def gyroid_np(p):
    return np.sin(p[:, 0]) * np.cos(p[:, 1]) + np.sin(p[:, 1]) * np.cos(p[:, 2]) + np.sin(p[:, 2]) * np.cos(p[:, 0])


def test_expression_field_matches_numpy(walker_cpu):
    expr = sin(x) * cos(y) + sin(y) * cos(z) + sin(z) * cos(x)
    t = flatten(field(expr, bounds=((-3,) * 3, (3,) * 3)))
    pts = RNG.uniform(-3, 3, (5000, 3)).astype(np.float32)
    d, _ = walker_cpu.evaluate(t, pts)
    np.testing.assert_allclose(d, gyroid_np(pts.astype(np.float64)), atol=2e-6)


def test_shared_subexpressions_are_computed_once():
    r = sqrt(x * x + y * y)
    t = flatten(field(maximum(r - 1, -(r - 0.5))))
    assert t.op_counts()["SQRT"] == 1


def test_field_is_a_node_like_any_other(walker_cpu):
    ball = field(sqrt(x * x + y * y + z * z) - 0.25, bounds=((-0.25,) * 3, (0.25,) * 3))
    red = Material("red", (1, 0, 0))
    s = union(ball.material(red).translate(1, 0, 0).linear_pattern((1, 0, 0), 4), sphere(0.25).translate(0, 2, 0))
    t = flatten(s)
    centres = np.array([[1, 0, 0], [2, 0, 0], [3, 0, 0], [4, 0, 0], [0, 2, 0]], np.float64)
    pts = RNG.uniform(-1, 5, (4000, 3))
    expected = (np.linalg.norm(pts[:, None] - centres[None], axis=2) - 0.25).min(1)
    d, m = walker_cpu.evaluate(t, pts.astype(np.float32))
    assert np.all(d <= expected + 2e-6)                # the pattern is a bound far away
    near = np.abs(expected) < 0.2                      # and exact near the surface
    np.testing.assert_allclose(d[near], expected[near], rtol=1e-5, atol=2e-6)
    _, m = walker_cpu.evaluate(t, centres.astype(np.float32))
    assert m.tolist() == [1, 1, 1, 1, 0]


def test_vm_program_as_a_scaled_node(walker_cpu):
    node = vm_field(DATA / "tanglecube.vm", bounds=((-3,) * 3, (3,) * 3)).scale(0.5)
    t, plain = flatten(node), flatten(vm_field(DATA / "tanglecube.vm"))
    pts = RNG.uniform(-1, 1, (2000, 3)).astype(np.float32)
    d, _ = walker_cpu.evaluate(t, pts)
    ref, _ = walker_cpu.evaluate(plain, pts * 2)
    np.testing.assert_allclose(d, ref * 0.5, rtol=1e-6, atol=1e-6)


def test_field_round_trips_through_scene_dicts():
    s = field(atan2(y, x) + minimum(x, z)).translate(0, 1, 0)
    assert flatten(node_from_dict(s.to_dict())).instrs.tobytes() == flatten(s).instrs.tobytes()


def test_bad_fields_are_refused():
    with pytest.raises(TaperayError, match="arithmetic ops only"):
        field(flatten(sphere(1)))
    with pytest.raises(TaperayError, match="numbers and expressions"):
        field(x + "one")
    with pytest.raises(TaperayError, match=r"\*\* 2 only"):
        field(x ** 3)
