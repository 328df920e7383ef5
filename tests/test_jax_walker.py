"""The JAX walker (runtime/jax_walker.py) against the twin: values and materials per op, on random
and scene tapes, in both forms; gradients against the twin's central differences; forward mode
against reverse mode; the compile counter (edits compile nothing); bad input."""
import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("jax")

from taperay.runtime import conformance as C                      # noqa: E402
from taperay.runtime.jax_walker import (JaxWalker, cells_unsupported, compile_stats,  # noqa: E402
                                        generic_unsupported)
from taperay.runtime.opcodes import OPS, POLY_OPS, Family, Op      # noqa: E402
from taperay.runtime.tape import Tape, TaperayError                # noqa: E402
from taperay.scenegraph import Param, box, cylinder, flatten, smooth_union, sphere, torus  # noqa: E402


@pytest.fixture(scope="module")
def walker_generic():
    return JaxWalker(form="generic")


@pytest.fixture(scope="module")
def walker_trace():
    return JaxWalker(form="trace")


def _agree(cpu, walker, tape, propagation=1.0, n=256, seed=0):
    pts, scale = C.sample_points(tape, np.random.default_rng(seed), n)
    rd, rm = cpu.evaluate(tape, pts)
    gd, gm = walker.evaluate(tape, pts)
    assert gd.dtype == np.float32 and gm.dtype == np.uint32 and gd.shape == rd.shape
    ok = C.within_tolerance(rd, gd, C.tape_tolerance(tape, propagation), scale)
    bad = np.flatnonzero(~ok)
    assert ok.all(), f"{tape.source}: {bad.size} points differ, first {pts[bad[0]]}: {rd[bad[0]]} vs {gd[bad[0]]}"
    assert np.mean(rm != gm) <= C.MATERIAL_MAX, f"{tape.source}: materials differ at {np.mean(rm != gm):.1%}"


GENERIC_OPS = [op for op in Op if op not in POLY_OPS and op not in (Op.INSTANCES, Op.REPEAT_END)]
# (one capacity bucket: a tape with patterns has programs of its own)
RECORD_OPS = [op for op in GENERIC_OPS if OPS[op].family is not Family.PATTERN and op is not Op.INSTANCE_INDEX]


@pytest.mark.slow
@pytest.mark.parametrize("op", list(Op), ids=lambda o: o.name)
def test_trace_form_agrees_with_twin_per_op(walker_cpu, walker_trace, op):
    _agree(walker_cpu, walker_trace, C.op_tape(op, np.random.default_rng(int(op))))


@pytest.mark.slow
def test_generic_form_agrees_with_twin_per_op(walker_cpu, walker_generic):
    for op in GENERIC_OPS:
        tape = C.op_tape(op, np.random.default_rng(int(op)))
        assert generic_unsupported(tape) is None, op.name
        _agree(walker_cpu, walker_generic, tape)


@pytest.mark.slow
def test_trace_form_agrees_on_random_and_reference_tapes(walker_cpu, walker_trace):
    for k in range(4):
        _agree(walker_cpu, walker_trace, C.random_tape(np.random.default_rng([7, k])), C.SCENE_PROPAGATION, seed=k)
    _agree(walker_cpu, walker_trace, C.reference_tape(), C.SCENE_PROPAGATION)


def _patterned_scene():
    """Patterns of every kind, an instance list, a culled union, smooth blends and named params."""
    r = Param("r", 0.3)
    holes = cylinder(0.12, 1.0).grid_pattern((0.5, 0.5, 1.0), (3, 3, 1)).translate(-0.5, -0.5, 0)
    plate = box(1.0, 1.0, 0.2) - holes
    ring = sphere(r).translate(1.4, 0, 0).polar_pattern(6)
    row = torus(0.15, 0.05).linear_pattern((0.4, 0, 0), 5).translate(-0.8, 0, 0.6)
    rng = np.random.default_rng(3)
    t = rng.uniform(-1.2, 1.2, (12, 3))
    q = rng.normal(size=(12, 4))
    q /= np.linalg.norm(q, axis=1)[:, None]
    bolts = (cylinder(0.05, 0.15) | box(0.08, 0.08, 0.04)).instances(t, q)
    return smooth_union(plate, ring, k=0.1) | row | bolts


@pytest.mark.slow
def test_both_forms_agree_on_scene_tapes(walker_cpu, walker_trace, walker_generic):
    tape = flatten(_patterned_scene(), source="patterned scene")
    ops = set(tape.op_counts())
    assert {"REPEAT_GRID", "REPEAT_POLAR", "REPEAT_LINEAR", "INSTANCES"} <= ops
    _agree(walker_cpu, walker_trace, tape, C.SCENE_PROPAGATION, n=1024)
    plain = flatten(smooth_union(sphere(Param("r", 0.8)), box(0.5, 0.6, 0.7).translate(0.6, 0, 0), k=0.2)
                    - cylinder(0.2, 2.0), source="plain scene")
    _agree(walker_cpu, walker_generic, plain, C.SCENE_PROPAGATION, n=1024)
    with pytest.raises(TaperayError, match=r"record \d+: (REPEAT_\w+|INSTANCES) is not supported"):
        walker_generic.evaluate(tape, np.zeros((4, 3), np.float32))


def _patterns_only_scene():
    """Patterns of every kind (one nested in another, one with a cell of two copies along an axis)
    under smooth blends and a difference, with named parameters: no instance list."""
    r, pitch = Param("r", 0.3), Param("pitch", 0.5)
    holes = cylinder(0.12, 1.0).grid_pattern((pitch, 0.5, 1.0), (3, 2, 1)).translate(-0.5, -0.25, 0)
    plate = box(1.0, 1.0, 0.2) - holes
    ring = sphere(r).translate(1.4, 0, 0).polar_pattern(6)
    row = torus(0.15, 0.05).linear_pattern((0.4, 0, 0), 3).grid_pattern((0.5, 0.6, 1.0), (1, 2, 1))
    return smooth_union(plate, ring, k=0.1) | row.translate(-0.8, 0, 0.6)


@pytest.mark.slow
def test_generic_form_runs_patterns_as_the_trace_form(walker_cpu, walker_trace, walker_generic):
    tape = flatten(_patterns_only_scene(), source="patterns only")
    assert {"REPEAT_GRID", "REPEAT_POLAR", "REPEAT_LINEAR"} <= set(tape.op_counts())
    assert generic_unsupported(tape) is None
    assert "patterns" in cells_unsupported(tape)
    _agree(walker_cpu, walker_generic, tape, C.SCENE_PROPAGATION, n=1024)
    pts = np.random.default_rng(6).uniform(-1.6, 1.6, (800, 3)).astype(np.float32)
    a, b = walker_trace.value_and_grad(tape, pts), walker_generic.value_and_grad(tape, pts)
    # (XLA rounds a copy's arithmetic alike only where it fuses it alike: the trace evaluates the
    # copies stacked, the generic form one by one)
    np.testing.assert_array_max_ulp(a.value, b.value, maxulp=2)
    np.testing.assert_array_equal(a.material, b.material)
    np.testing.assert_allclose(a.dx, b.dx, atol=1e-5)
    # every pool entry's gradient finite (an axis of at most two copies leaves none unchecked: the
    # bound of the unchecked copies is +inf there, and its derivative must not be inf * 0)
    assert np.all(np.isfinite(a.dpool)) and np.all(np.isfinite(b.dpool))
    np.testing.assert_allclose(a.dpool, b.dpool, rtol=1e-4, atol=1e-3)
    for name in tape.names:
        np.testing.assert_allclose(a.per_point[name], b.per_point[name], atol=1e-5, err_msg=name)


def _smooth_scene():
    """Smooth in its parameters away from kinks: a smooth blend of a sphere and a moved box."""
    return smooth_union(sphere(Param("radius", 0.7)),
                        box(Param("hx", 0.4), 0.5, 0.3).translate(Param("dx", 0.5), 0.1, 0.0), k=Param("k", 0.3))


def _fd_points(tape, cpu, n=64):
    """Points off the surface, the medial kinks and the smooth blend's seams: where the twin's
    central differences along each axis agree with one-sided ones."""
    rng = np.random.default_rng(5)
    pts = rng.uniform(-1.3, 1.3, (4 * n, 3)).astype(np.float32)
    e = np.float32(1e-2)
    d0 = cpu.evaluate(tape, pts)[0]
    keep = np.ones(len(pts), bool)
    for ax in range(3):
        off = np.zeros(3, np.float32)
        off[ax] = e
        dp, dm = cpu.evaluate(tape, pts + off)[0], cpu.evaluate(tape, pts - off)[0]
        keep &= np.abs((dp - d0) - (d0 - dm)) < 1e-4       # second difference ~0: no kink within e
    return pts[keep][:n]


def _with_params(tape: Tape, params: np.ndarray) -> Tape:
    return dataclasses.replace(tape, params=params.astype(np.float32), refit=None)


def _twin_param_differences(cpu, tape: Tape, pts, slots, h: float = 1e-3) -> np.ndarray:
    """Central differences of the twin's values with the pool ``slots`` moved by +-h."""
    up, down = tape.params.astype(np.float64).copy(), tape.params.astype(np.float64).copy()
    up[slots] += h
    down[slots] -= h
    return (cpu.evaluate(_with_params(tape, up), pts)[0].astype(np.float64)
            - cpu.evaluate(_with_params(tape, down), pts)[0]) / (2 * h)


@pytest.mark.slow
@pytest.mark.parametrize("scene, walker", [("smooth scene", "walker_jax"), ("patterns only", "walker_generic")])
def test_gradients_agree_with_twin_finite_differences(request, walker_cpu, scene, walker):
    """The defaults on a smooth scene; the generic form on patterns (which "auto" traces there)."""
    tape = flatten({"smooth scene": _smooth_scene, "patterns only": _patterns_only_scene}[scene](), source=scene)
    pts = _fd_points(tape, walker_cpu)
    assert len(pts) >= 32
    g = request.getfixturevalue(walker).value_and_grad(tape, pts)
    np.testing.assert_allclose(g.value, walker_cpu.evaluate(tape, pts)[0], atol=1e-6)
    # spatial: the twin's central differences (eps 1e-3 of the bounds diagonal)
    np.testing.assert_allclose(g.dx, walker_cpu.gradient(tape, pts, eps=1e-3), atol=2e-3)
    # each named parameter: central differences of the twin with its pool slots moved by +-h
    assert set(g.per_point) == set(tape.names) and len(tape.names) >= 2
    for name, slots in tape.names.items():
        np.testing.assert_allclose(g.per_point[name], _twin_param_differences(walker_cpu, tape, pts, slots),
                                   atol=3e-3, err_msg=name)
        # the weighted pool gradient (weights 1) sums the per-point derivatives
        np.testing.assert_allclose(g.dnamed[name], g.per_point[name].sum(), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_forward_mode_agrees_with_reverse_mode(walker_jax, walker_generic):
    tape = flatten(_smooth_scene(), source="smooth scene")
    rng = np.random.default_rng(9)
    pts = rng.uniform(-1.2, 1.2, (300, 3)).astype(np.float32)
    w = rng.normal(size=300).astype(np.float32)
    u = rng.normal(size=len(tape.params)).astype(np.float32)
    for walker in (walker_jax, walker_generic):
        d, dpool = walker.vjp(tape, pts, w)
        d2, tangent = walker.jvp(tape, pts, u)
        np.testing.assert_array_equal(d, d2)
        np.testing.assert_allclose(np.dot(w.astype(np.float64), tangent), np.dot(dpool.astype(np.float64), u),
                                   rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(walker_jax.value_and_grad(tape, pts, weights=w).dpool, walker_jax.vjp(tape, pts, w)[1],
                               rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_generic_gradients_equal_the_trace_forms(walker_trace, walker_generic):
    tape = flatten(_smooth_scene() - cylinder(0.2, 2.0), source="smooth scene minus a bore")
    pts = np.random.default_rng(4).uniform(-1.2, 1.2, (500, 3)).astype(np.float32)
    a, b = walker_trace.value_and_grad(tape, pts), walker_generic.value_and_grad(tape, pts)
    np.testing.assert_array_equal(a.value, b.value)
    np.testing.assert_array_equal(a.material, b.material)
    np.testing.assert_allclose(a.dx, b.dx, atol=1e-5)
    np.testing.assert_allclose(a.dpool, b.dpool, rtol=1e-4, atol=1e-3)
    for name in tape.names:
        np.testing.assert_allclose(a.per_point[name], b.per_point[name], atol=1e-5)


@pytest.mark.slow
def test_moved_shapes_are_one_step_and_agree_with_the_trace_form(walker_cpu, walker_trace, walker_generic):
    """A shape moved alone (PUSH TRANSLATE shape POP) is one generic step (``MovedShape``): every
    record but PUSH / POP is one step, less one a moved shape; a translation serving two shapes
    stays a step of its own. Values agree with the twin within the conformance tolerances and
    are within 4 ULP of the trace form's (as without the fused step on these points: XLA rounds
    some shapes' arithmetic differently in the two forms), materials equal the trace form's,
    derivatives (point, pool, every name) to summation order."""
    from taperay.scenegraph import capped_cone, capsule, rounded_box, union
    r = Param("r", 0.3)
    moved = [sphere(r).translate(0.5, 0.1, -0.2), box(0.2, r, 0.25).translate(-0.4, 0.3, 0.1),
             capsule((0, 0, -0.2), (0, 0.1, 0.2), 0.15).translate(0.1, -0.5, 0.3),
             torus(0.3, 0.08).translate(-0.2, -0.3, -0.4), cylinder(0.15, 0.3).translate(0.3, 0.4, 0.5),
             capped_cone(0.3, 0.2, 0.05).translate(-0.5, 0.0, 0.5),
             rounded_box(0.2, 0.2, 0.2, 0.05).translate(0, 0, -0.6)]
    group = union(sphere(0.2), box(0.1, 0.3, 0.1)).translate(0.2, 0.2, 0.2)      # one translation, two shapes
    tape = flatten(smooth_union(union(*moved), group, k=0.1), source="moved shapes")
    pts = np.random.default_rng(7).uniform(-1.2, 1.2, (600, 3)).astype(np.float32)
    cells = JaxWalker(form="cells")
    cells.evaluate(tape, pts)
    records = [Op(c[0]) for c in tape.as_columns().tolist()]
    assert records.count(Op.TRANSLATE) == len(moved) + 1
    assert cells.cells_plan.n_steps == len(records) - records.count(Op.PUSH) - records.count(Op.POP) - len(moved)
    a, b = walker_trace.value_and_grad(tape, pts), walker_generic.value_and_grad(tape, pts)
    _agree(walker_cpu, walker_generic, tape)
    np.testing.assert_array_max_ulp(b.value, a.value, 4)
    np.testing.assert_array_equal(a.material, b.material)
    np.testing.assert_allclose(a.dx, b.dx, atol=1e-5)
    np.testing.assert_allclose(a.dpool, b.dpool, rtol=1e-4, atol=1e-3)
    for name in tape.names:
        np.testing.assert_allclose(a.per_point[name], b.per_point[name], atol=1e-5)


def test_edits_and_point_counts_compile_nothing(walker_trace, walker_generic):
    tape = flatten(_patterned_scene(), source="patterned scene")
    pts = np.random.default_rng(1).uniform(-1.5, 1.5, (3000, 3)).astype(np.float32)
    smooth = flatten(_smooth_scene(), source="smooth scene")
    walker_trace.evaluate(tape, pts)
    walker_trace.vjp(smooth, pts, np.ones(len(pts), np.float32))
    before = compile_stats()["compiles"]
    for k, r in enumerate(np.linspace(0.2, 0.35, 5)):       # parameter edits (refitted)
        tape.set_param("r", float(r))
        smooth.set_param("radius", float(r) + 0.4)
        walker_trace.evaluate(tape, pts[:4000 - 500 * k])    # new point counts inside the rung
        walker_trace.vjp(smooth, pts[:1000 + k], np.ones(1000 + k, np.float32))
    assert compile_stats()["compiles"] == before


def test_generic_topology_edits_within_a_bucket_compile_nothing(walker_cpu, walker_generic):
    rng = np.random.default_rng(2)
    pts = rng.uniform(-2, 2, (1000, 3)).astype(np.float32)
    walker_generic.evaluate(C.op_tape(Op.SPHERE, rng), pts)
    before = compile_stats()["compiles"]
    tapes = [C.op_tape(RECORD_OPS[int(k)], rng) for k in rng.integers(0, len(RECORD_OPS), 30)]
    for tape in tapes:                                       # 30 different structures, one bucket
        walker_generic.evaluate(tape, pts)
    assert compile_stats()["compiles"] == before
    _agree(walker_cpu, walker_generic, tapes[-1])


def test_bad_input_is_a_taperay_error(walker_jax):
    tape = C.op_tape(Op.SPHERE, np.random.default_rng(0))
    with pytest.raises(TaperayError, match=r"points must be \(N, 3\)"):
        walker_jax.evaluate(tape, np.zeros((4, 2), np.float32))
    with pytest.raises(TaperayError, match="no parameter named"):
        walker_jax.value_and_grad(tape, np.zeros((4, 3), np.float32), names=["nope"])
    with pytest.raises(TaperayError, match="unknown JAX walker form"):
        JaxWalker(form="fast")
    d, m = walker_jax.evaluate(tape, np.zeros((0, 3), np.float32))
    assert d.shape == (0,) and m.shape == (0,)


@pytest.mark.slow
def test_persistent_cache_serves_a_second_process(tmp_path):
    code = ("import numpy as np; from taperay.runtime.jax_walker import JaxWalker, compile_stats; "
            "from taperay.runtime.conformance import reference_tape; "
            "JaxWalker().evaluate(reference_tape(), np.zeros((10, 3), np.float32)); print(compile_stats()['cache_hits'])")
    env = dict(os.environ, TAPERAY_JAX_CACHE=str(tmp_path))
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
            for _ in range(2)]
    assert int(runs[0].stdout.split()[-1]) == 0 and int(runs[1].stdout.split()[-1]) >= 1
