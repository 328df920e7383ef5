"""The modelling API and flatten: structure, bounds, patterns, culling, parameters, errors."""
from dataclasses import replace

import numpy as np
import pytest

from taperay.runtime.camera import Camera
from taperay.runtime.tape import Op, TaperayError, validate
from taperay.scenegraph import (Material, Param, box, capsule, cylinder, difference, flatten,
                                node_from_dict, plane, smooth_union, sphere, torus, union)

RNG = np.random.default_rng(7)


def brute_union_of_spheres(points, centres, r):
    d = np.linalg.norm(points[:, None, :] - centres[None], axis=2) - r
    return d.min(1)


def test_grid_pattern_of_a_million_is_a_handful_of_records():
    small = flatten(cylinder(0.004, 1).grid_pattern((0.01, 0.01, 1), (10, 10, 1)))
    huge = flatten(cylinder(0.004, 1).grid_pattern((0.01, 0.01, 1), (1000, 1000, 1)))
    assert len(huge) == len(small) <= 8
    assert huge.instance_count == 1_000_000
    assert huge.op_counts()["REPEAT_GRID"] == 1


def test_union_of_many_leaves_gets_cull_records_and_registers_grow_logarithmically():
    """Each of the BVH's 1,023 inner nodes wraps its second half in a cull, except halves of at
    most two primitives (512 single spheres, 256 pairs): 255 culls."""
    leaves = [sphere(0.1).translate(i, j, 0) for i in range(32) for j in range(32)]
    t = flatten(union(*leaves))
    assert t.op_counts()["CULL_BOX"] == 255
    assert t.n_regs <= 2 * 10 + 2
    plain = flatten(union(*leaves), cull=False)
    cull_params = plain.params[plain.instrs["param"][plain.instrs["op"] == Op.CULL_BOX] + 6]
    assert np.all(np.isinf(cull_params))


def test_culls_wrap_groups_of_more_than_two_primitives_and_any_costlier_child():
    """A union of three capsules (the strut lattice's cell) is chained without culls; a union of
    three parts that are not single primitives (a difference each) keeps its culls; six spheres
    split into two halves of three, and only the second half is wrapped."""
    from taperay.scenegraph.flatten import CHEAP_PRIMITIVES
    assert CHEAP_PRIMITIVES == 2
    struts = union(capsule((0, 0, 0), (1, 0, 0), 0.1), capsule((0, 0, 0), (0, 1, 0), 0.1),
                   capsule((0, 0, 0), (0, 0, 1), 0.1))
    assert "CULL_BOX" not in flatten(struts).op_counts()
    parts = union(*[(box(0.4, 0.4, 0.4) - sphere(0.45)).translate(i, 0, 0) for i in range(3)])
    assert flatten(parts).op_counts()["CULL_BOX"] == 2
    spheres = union(*[sphere(0.1).translate(i, 0, 0) for i in range(3)])
    assert flatten(spheres.translate(0, 0, 1) | spheres).op_counts()["CULL_BOX"] == 1


def test_named_parameters_share_stable_slots():
    r = Param("radius", 0.5)
    t = flatten(sphere(r).translate(1, 0, 0) | sphere(r))
    assert set(t.names) == {"radius"} and len(t.names["radius"]) == 2
    assert t.set_param("radius", 0.25) is False        # nothing culled: only its slots change
    assert np.all(t.params[t.names["radius"]] == np.float32(0.25))
    with pytest.raises(TaperayError, match="no parameter named"):
        t.set_param("nope", 1)


def test_editing_a_parameter_refits_cull_boxes_and_stays_exact(walker_cpu):
    centres = RNG.uniform(-3, 3, (16, 3))
    scene = lambda r: union(*[sphere(r).translate(*c) for c in centres])
    t = flatten(scene(Param("r", 0.2)))
    assert t.set_param("r", 0.9) is True               # the spheres outgrew their cull boxes
    pts = RNG.uniform(-4, 4, (20000, 3)).astype(np.float32)
    d, _ = walker_cpu.evaluate(t, pts)
    assert np.array_equal(d, walker_cpu.evaluate(flatten(scene(Param("r", 0.9))), pts)[0])
    np.testing.assert_allclose(d, brute_union_of_spheres(pts, centres, 0.9), atol=2e-6)
    assert t.set_param("r", 0.9) is False              # the same value again: nothing to refit


def test_editing_a_patterned_part_refits_the_pattern_or_refuses(walker_cpu):
    scene = lambda r: box(21, 21, 0.2) - cylinder(r, 1).grid_pattern((1.0, 1.0, 1.0), (20, 20, 1))
    t = flatten(scene(Param("hole", 0.2)))
    t.set_param("hole", 0.45)
    pts = RNG.uniform(-1, 21, (20000, 3)).astype(np.float32)
    assert np.array_equal(walker_cpu.evaluate(t, pts)[0],
                          walker_cpu.evaluate(flatten(scene(Param("hole", 0.45))), pts)[0])
    before = t.params.copy()
    with pytest.raises(TaperayError):
        t.set_param("hole", 5.0)   # 400 copies overlapping far past a neighbour: refused by flatten
    assert np.array_equal(t.params, before)             # refused edits leave the tape as it was


def _same_tape(a, b) -> bool:
    return (a.instrs.tobytes() == b.instrs.tobytes() and a.params.tobytes() == b.params.tobytes()
            and a.materials.tobytes() == b.materials.tobytes() and a.bounds.tobytes() == b.bounds.tobytes()
            and a.instances.tobytes() == b.instances.tobytes() and a.bvh.tobytes() == b.bvh.tobytes()
            and a.names == b.names and a.n_regs == b.n_regs and a.instance_count == b.instance_count
            and a.material_names == b.material_names)


def _emitted_nodes(monkeypatch) -> list:
    """The kinds of the nodes flatten emits anew (not copied from its memo), as they go."""
    import sys
    emitter = sys.modules["taperay.scenegraph.flatten"]._Emitter
    made, emit_node = [], emitter.emit_node
    monkeypatch.setattr(emitter, "emit_node", lambda self, n, *a: made.append(n.kind) or emit_node(self, n, *a))
    return made


def _parametric_scenes():
    from taperay.scenegraph import Param as P
    r, k, n = P("r", 0.2), P("k", 0.1), P("gap", 0.6)
    red = Material("red", (1, 0, 0))
    bolts = cylinder(r, 0.5).translate(1, 0, 0).polar_pattern(6)
    return {
        "culled union": union(*[sphere(r).translate(i, (i * 7) % 5, 0) for i in range(12)],
                              box(0.3, 0.3, 0.3).material(red).translate(0, 0, 2)),
        "plate with holes": smooth_union(box(2, 2, 0.2), torus(1, 0.1).translate(0, 0, 0.3), k=k) - bolts
        - cylinder(0.05, 1).grid_pattern((n, n, 1.0), (4, 4, 1)).translate(-1, -1, 0),
        "nested": union(*[(box(0.4, 0.4, 0.4) - sphere(r)).material(red if i % 2 else Material("blue", (0, 0, 1)))
                          .translate(i, 0, 0) for i in range(5)], capsule((0, 0, 0), (0, 0, 1), k)),
    }


@pytest.mark.parametrize("name", ["culled union", "plate with holes", "nested", "machined_part", "cantilever",
                                  "heat_sink", "lens_bench_1000"])
def test_a_refit_gives_the_tape_a_fresh_flatten_gives(name):
    """Tape.set_param's refit copies the records of the nodes its parameter is not in from the
    last flatten: after every edit (each parameter in turn, back and forth, refused values among
    them), the tape equals, array for array, a fresh flatten of the scene with those values."""
    from pathlib import Path
    from taperay.scenegraph.loading import load_scene_module
    scenes = Path(__file__).resolve().parent.parent / "scenes"
    scene = _parametric_scenes()[name] if name in _parametric_scenes() else load_scene_module(scenes / f"{name}.py")
    tape = flatten(scene)
    values = {v.name: v.value for n in scene.walk() for v in n.numbers if isinstance(v, Param)}
    rng = np.random.default_rng(3)
    for step in range(12):
        name = sorted(values)[step % len(values)]
        value = values[name] * float(rng.choice([0.5, 0.8, 1.25, 1.0, 30.0]))
        try:
            tape.set_param(name, value)
        except TaperayError:
            continue
        values[name] = value
        assert _same_tape(tape, flatten(scene, params=values)), (step, name, value)


def test_a_refit_emits_only_the_nodes_holding_its_parameter(monkeypatch):
    """Twelve parts, one of them holding the parameter: a refit emits that part and the union
    above it anew; the other eleven parts' records are copied."""
    r = Param("r", 0.2)
    parts = [(box(0.4, 0.4, 0.4) - sphere(0.45)).translate(i, 0, 0) for i in range(11)]
    scene = union(*parts, sphere(r).translate(0, 2, 0))
    tape = flatten(scene)
    made = _emitted_nodes(monkeypatch)
    tape.set_param("r", 0.3)
    assert made == ["union", "transform", "sphere"]
    assert _same_tape(tape, flatten(scene, params={"r": 0.3}))


def test_a_topology_edit_reuses_the_records_of_the_scene_it_keeps(monkeypatch):
    """flatten(new, reuse=old tape): the kept part (emitted first, at the same place) is copied,
    the tape equals a fresh flatten's; an instance list whose placements could still change (a
    view of another array) is emitted anew each time."""
    from taperay.scenegraph import Node
    from taperay.scenegraph.nodes import placements
    base = box(3, 0.5, 0.5) - union(*[sphere(0.3).translate(i - 2.5, 0, 0) for i in range(6)])
    old = flatten(base)
    row = sphere(0.1).linear_pattern((0.5, 0, 0), 10).translate(0, 2, 0)
    made = _emitted_nodes(monkeypatch)
    new = flatten(union(base, row), reuse=old)
    assert made[0] == "union" and "difference" not in made and "sphere" in made     # (the row's)
    assert _same_tape(new, flatten(union(base, row)))
    owner = np.array(placements(RNG.uniform(-2, 2, (50, 3))))
    bolts = Node("instances", (), (sphere(0.05),), None, owner[:])   # (a view: its owner may change it)
    first = flatten(union(base, bolts))
    owner["t"][:, 0] += 10.0
    made.clear()
    moved = flatten(union(base, bolts), reuse=first)
    assert "instances" in made and "difference" not in made
    assert _same_tape(moved, flatten(union(base, bolts)))


def test_scene_dict_round_trip_gives_the_same_tape():
    s = smooth_union(box(1, 2, 0.5).material(Material("red", (1, 0, 0))),
                     torus(1, 0.2).rotate((1, 0, 0), 30), k=0.3) - capsule((0, 0, 0), (1, 1, 1), 0.2)
    a, b = flatten(s), flatten(node_from_dict(s.to_dict()))
    assert a.instrs.tobytes() == b.instrs.tobytes() and a.params.tobytes() == b.params.tobytes()
    assert a.materials.tobytes() == b.materials.tobytes()


@pytest.mark.parametrize("build, message", [
    (lambda: sphere(-1), "must be > 0"),
    (lambda: box(1, 1, 0), "must be > 0"),
    (lambda: sphere(float("nan")), "finite"),
    (lambda: sphere("big"), "expected a number"),
    (lambda: sphere(1).linear_pattern((0, 0, 0), 3), "step vector is zero"),
    (lambda: sphere(1).grid_pattern((1, 1, 1), (2, 0.5, 1)), "whole numbers"),
    (lambda: sphere(1).rotate((0, 0, 0), 30), "axis is zero"),
    (lambda: union(), "at least one child"),
    (lambda: flatten("not a node"), "expected a scene node"),
    (lambda: flatten(plane().linear_pattern((1, 0, 0), 3)), "unbounded"),
    (lambda: flatten(sphere(1).linear_pattern((0.1, 0, 0), 1000)), "reaches past its neighbouring cell"),
    (lambda: node_from_dict({"kind": "teapot"}), "unknown node kind"),
    (lambda: node_from_dict({"kind": "sphere", "numbers": [True]}), "bad number"),
    (lambda: node_from_dict([1, 2]), "must be a map"),
])
def test_bad_scenes_raise_the_projects_error(build, message):
    with pytest.raises(TaperayError, match=message):
        build()


def test_deep_nesting_is_refused_cleanly():
    s = sphere(1)
    for _ in range(300):
        s = s | sphere(1).translate(1, 0, 0)    # left-deep binary unions flatten into one n-ary union
    assert flatten(s).n_regs < 30
    deep = sphere(1)
    for _ in range(300):
        deep = difference(sphere(2), deep)      # each level needs one more register
    with pytest.raises(TaperayError, match="registers"):
        flatten(deep)


def test_flattened_tapes_validate_and_are_deterministic():
    s = union(*[sphere(0.2).translate(*RNG.normal(size=3)) for _ in range(50)])
    a, b = flatten(s), flatten(s)
    assert a.instrs.tobytes() == b.instrs.tobytes()
    validate(a)


# -- semantics, graded on the CPU twin ---------------------------------------------------------
def test_a_chain_of_transforms_shares_one_push_and_pop(walker_cpu):
    red, blue = Material("red", (1, 0, 0)), Material("blue", (0, 0, 1))
    part = (box(0.3, 0.2, 0.1).material(blue).rotate((1, 1, 0), 30).scale(1.5).material(red)
            .mirror((1, 0, 0)).translate(0.2, 0, 0))
    t = flatten(part)
    ops = [Op(int(o)) for o in t.instrs["op"]]
    assert ops.count(Op.PUSH) == ops.count(Op.POP) == 1
    assert ops == [Op.PUSH, Op.TRANSLATE, Op.MIRROR, Op.SCALE, Op.ROTATE, Op.BOX, Op.POP]
    # the same chain with a PUSH / POP per node (what flatten emitted before) gives the same bits
    nested = t.instrs.copy()
    rows = [nested[0], nested[1], nested[0], nested[2], nested[0], nested[3], nested[0], nested[4],
            nested[5], nested[6], nested[6], nested[6], nested[6]]
    u = replace(t, instrs=np.array(rows, dtype=t.instrs.dtype))
    pts = RNG.uniform(-1, 1, (3000, 3)).astype(np.float32)
    d, m = walker_cpu.evaluate(t, pts)
    du, mu = walker_cpu.evaluate(u, pts)
    assert np.array_equal(d, du) and np.array_equal(m, mu)
    blue_id = [tuple(c) for c in t.materials["color"].tolist()].index((0.0, 0.0, 1.0))
    assert set(np.unique(m).tolist()) == {blue_id}   # the innermost material wins, as before


def test_union_of_spheres_matches_brute_force(walker_cpu):
    centres = RNG.uniform(-3, 3, (60, 3))
    t = flatten(union(*[sphere(0.3).translate(*c) for c in centres]))
    pts = RNG.uniform(-4, 4, (4000, 3))
    d, _ = walker_cpu.evaluate(t, pts.astype(np.float32))
    np.testing.assert_allclose(d, brute_union_of_spheres(pts, centres, 0.3), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("kind", ["linear", "polar", "grid"])
def test_patterns_equal_the_explicit_union_of_their_copies(walker_cpu, kind):
    part = capsule((0, 0, 0), (0.1, 0.05, 0.2), 0.08)
    if kind == "linear":
        pat, explicit = part.linear_pattern((0.5, 0.1, 0), 9), [part.translate(0.5 * k, 0.1 * k, 0) for k in range(9)]
    elif kind == "polar":
        moved = part.translate(1.2, 0, 0)
        pat, explicit = moved.polar_pattern(12), [moved.rotate((0, 0, 1), 30 * k) for k in range(12)]
    else:
        pat = part.grid_pattern((0.4, 0.5, 0.6), (5, 4, 3))
        explicit = [part.translate(0.4 * i, 0.5 * j, 0.6 * k) for i in range(5) for j in range(4) for k in range(3)]
    t_pat, t_exp = flatten(pat), flatten(union(*explicit))
    assert len(t_pat) < 16      # (the loop, the body, and a linear or grid pattern's own box)
    lo, hi = t_exp.bounds
    pts = RNG.uniform(lo - 0.5, hi + 0.5, (20000, 3)).astype(np.float32)
    d_pat, _ = walker_cpu.evaluate(t_pat, pts)
    d_exp, _ = walker_cpu.evaluate(t_exp, pts)
    # a bound everywhere, the same sign everywhere, and exact near the surface
    assert np.all(d_pat <= d_exp + 1e-5)
    assert np.array_equal(d_pat < 0, d_exp < 0)
    near = np.abs(d_exp) < 0.1
    np.testing.assert_allclose(d_pat[near], d_exp[near], atol=2e-6)


def _dense_row():
    """10,000 spheres 0.001 apart along x (0..10), each of radius 0.00035."""
    return sphere(0.00035).linear_pattern((0.001, 0, 0), 10_000)


@pytest.mark.needs("evaluate")
def test_a_dense_pattern_reads_its_distance_beside_it(walkers_all):
    """A pattern's bound for the copies it does not evaluate counts only the distance along its
    axes; its box bounds it besides, so beside a dense row (and a grid) the field is about the
    distance, not a tenth of a spacing."""
    ball = sphere(0.5).translate(5, 4, 0)
    grid = sphere(0.003).grid_pattern((0.01, 0.01, 0.01), (100, 100, 3))
    for pattern, near in ((_dense_row(), lambda p: np.hypot(p[:, 1], p[:, 2]) - 0.00035),
                          (grid, lambda p: np.maximum(p[:, 2] - 0.02 - 0.003, 0))):
        t = flatten(union(pattern, ball))
        pts = np.stack([RNG.uniform(0.2, 0.8, 500), RNG.uniform(0.2, 0.8, 500), RNG.uniform(1, 3, 500)], 1)
        d, _ = walkers_all.evaluate(t, pts.astype(np.float32))
        true = np.minimum(near(pts), np.linalg.norm(pts - (5, 4, 0), axis=1) - 0.5)
        assert np.all(d <= true + 1e-4)
        assert np.all(d >= true - 0.02), float(np.min(d - true))
    # cut away by a plain difference the pattern keeps its loop alone (a bound too low, negated,
    # only over-states the field inside the material)
    boxed = flatten(union(box(1), _dense_row())).op_counts()
    cut = flatten(difference(box(1), _dense_row())).op_counts()
    assert boxed.get("INTERSECT") == 1 and "INTERSECT" not in cut and cut["BOX"] == 1


def test_a_dense_row_beside_a_ball_is_marched_as_a_thin_rod(walkers_all):
    """The picture of the row beside a ball matches that of a capsule along the row (sub-pixel
    either way at this distance): a pattern bounded only along its axis read as near across the
    march box, and rays stopped there as hits."""
    ball = sphere(2).translate(5, 4, 0)
    cam = Camera((5, -25, 8), (5, 1, 0), fov_deg=40)
    hits = []
    for rod in (_dense_row(), capsule((0, 0, 0), (10, 0, 0), 0.00035)):
        m = walkers_all.march(flatten(union(rod, ball)), cam, 96, 64)
        hits.append(np.asarray(m["hit"]))
    assert 0.01 < hits[1].mean() < 0.3
    assert (hits[0] != hits[1]).mean() <= 0.01, (hits[0].mean(), hits[1].mean())


@pytest.mark.parametrize("scene_name", ["machined_part", "bolt_plate", "optics_bench"])
def test_culled_field_equals_unculled(walker_cpu, scene_name):
    from taperay.scenegraph.loading import load_scene_module
    from pathlib import Path
    node = load_scene_module(Path(__file__).parents[1] / "scenes" / f"{scene_name}.py")
    culled, plain = flatten(node), flatten(node, cull=False)
    lo, hi = culled.bounds
    pts = RNG.uniform(lo - 0.3 * (hi - lo), hi + 0.3 * (hi - lo), (100_000, 3)).astype(np.float32)
    a, _ = walker_cpu.evaluate(culled, pts)
    b, _ = walker_cpu.evaluate(plain, pts)
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def test_bounds_hold_the_surface(walker_cpu):
    s = smooth_union(box(1, 0.5, 0.3), sphere(0.6).translate(1, 0, 0), k=0.4).rotate((1, 1, 0), 40).translate(2, 0, 0)
    t = flatten(s)
    lo, hi = t.bounds.astype(np.float64)
    pts = RNG.uniform(lo - 1, hi + 1, (50000, 3))
    outside = np.any((pts < lo) | (pts > hi), axis=1)
    d, _ = walker_cpu.evaluate(t, pts.astype(np.float32))
    assert np.all(d[outside] > -1e-6)
    assert np.any(d[~outside] < 0)


def random_poses(n, rng):
    q = rng.normal(size=(n, 4))
    return rng.uniform(-3, 3, (n, 3)), q / np.linalg.norm(q, axis=1)[:, None], rng.uniform(0.5, 1.5, n)


def test_instance_list_flattens_to_a_fixed_number_of_records():
    t, q, s = random_poses(5000, np.random.default_rng(1))
    tape = flatten(capsule((0, 0, 0), (0, 0, 0.2), 0.05).instances(t, q, s))
    assert len(tape) <= 4 and tape.instance_count == 5000 and len(tape.bvh) == 2 * 5000 - 1


def test_instance_list_equals_explicit_union_and_culling_is_exact(walker_cpu):
    rng = np.random.default_rng(3)
    t, q, s = random_poses(300, rng)
    part = union(box(0.1, 0.05, 0.2), sphere(0.08).translate(0, 0, 0.2))
    listed = part.instances(t, q, s)
    explicit = union(*[part.scale(si).rotate_quat(*qi).translate(*ti) for ti, qi, si in zip(t, q, s)])
    pts = rng.uniform(-4, 4, (20000, 3)).astype(np.float32)
    d_list, _ = walker_cpu.evaluate(flatten(listed), pts)
    d_plain, _ = walker_cpu.evaluate(flatten(listed, cull=False), pts)
    d_exp, _ = walker_cpu.evaluate(flatten(explicit, cull=False), pts)
    np.testing.assert_allclose(d_list, d_plain, atol=1e-6, rtol=0)
    np.testing.assert_allclose(d_list, d_exp, atol=5e-6, rtol=1e-5)
