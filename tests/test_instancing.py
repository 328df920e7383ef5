"""Instance lists' bound (scenegraph.instancing): the capsule inside a body, the grid of
representatives, the validator's checks of both, and exactness of the walk that starts from
them on random assemblies (culled == unculled on every walker)."""
import dataclasses

import numpy as np
import pytest

from taperay.runtime.opcodes import Op

from taperay.runtime.tape import TapeError, validate
from taperay.scenegraph import (Param, box, capsule, cylinder, difference, extrude, field, fields, flatten, intersection,
                                smooth_union, sphere, union)
from taperay.scenegraph.flatten import inner_capsule
from taperay.scenegraph.instancing import build_bvh, instance_params, placements
from taperay.scenes.bolt_bin import bolt


def random_quats(rng, n):
    q = rng.normal(size=(n, 4))
    return q / np.linalg.norm(q, axis=1, keepdims=True)


BODIES = {
    "sphere": lambda: sphere(0.7),
    "box": lambda: box(0.3, 0.8, 0.5),
    "cylinder": lambda: cylinder(0.2, 0.9),
    "capsule": lambda: capsule((0.1, -0.4, 0.2), (-0.3, 0.5, 0.0), 0.25),
    "moved": lambda: box(0.2, 0.1, 0.6).rotate((1, 2, 3), 40).scale(1.7).translate(0.3, -0.2, 0.5),
    "union": lambda: union(sphere(0.2).translate(1, 0, 0), cylinder(0.3, 0.6).rotate((1, 0, 0), 90)),
    "smooth union": lambda: smooth_union(sphere(0.4), box(0.2, 0.2, 0.9).translate(0.5, 0, 0), k=0.2),
    "bolt": bolt,
    # proven numerically (proven_inner_ball): no shape rule reaches inside these
    "difference": lambda: difference(box(1.0), sphere(0.5)),
    "intersection": lambda: intersection(box(1.0), sphere(1.2)),
    "plate with a hole": lambda: difference(box(1, 1, 0.2), cylinder(0.3, 0.5)).rotate((1, 1, 0), 30),
}


def capsule_points(a, b, r, n, rng):
    """n points inside the capsule (a, b, r), on its boundary shrunk by 1e-4 r and within."""
    t = rng.uniform(0, 1, (n, 1))
    d = rng.normal(size=(n, 3))
    d /= np.linalg.norm(d, axis=1, keepdims=True)
    return a + t * (b - a) + d * r * (1 - 1e-4) * np.sqrt(rng.uniform(0, 1, (n, 1)))


@pytest.mark.parametrize("name", sorted(BODIES))
def test_inner_capsule_lies_inside_its_solid(name, walker_cpu):
    node = BODIES[name]()
    a, b, r = inner_capsule(node)
    assert r > 0
    pts = capsule_points(a, b, r, 20_000, np.random.default_rng(1)).astype(np.float32)
    d, _ = walker_cpu.evaluate(flatten(node), pts)
    assert d.max() <= 1e-6, f"a point of the capsule lies {d.max()} outside the solid"


@pytest.mark.parametrize("node", [
    extrude([(0, 0), (1, 0), (0.2, 0.2), (0, 1)], 0.2),                        # not lowered (not convex)
    field(fields.x * fields.x + fields.y * fields.y + fields.z * fields.z - 0.25, bounds=((-1, -1, -1), (1, 1, 1))),
    difference(sphere(1.0), sphere(0.995)),
], ids=["extrude", "arithmetic field", "thin shell"])
def test_inner_capsule_is_unknown_where_no_rule_proves_one(node):
    """An extrusion the lowering refuses (a polygon not convex), an arithmetic field (its values
    need not stay below the true distance) and a shell too thin for any sampled point to lie
    inside it."""
    assert inner_capsule(node) is None


def test_grid_names_an_instance_of_the_list_in_every_cell_the_nearest_where_occupied():
    rng = np.random.default_rng(2)
    inst = placements(rng.uniform(-5, 5, (3000, 3)), random_quats(rng, 3000), rng.uniform(0.5, 1.5, 3000))
    a, b, r = inner_capsule(bolt())
    prm = instance_params(np.array([[-0.06, -0.06, -0.12], [0.06, 0.06, 0.15]]), (a, b, r), inst, first_instance=7)
    lo, edge, dims = prm[13:16], prm[16], prm[17:20].astype(int)
    reps = prm[20:].astype(int)
    assert len(reps) == dims.prod() and 1000 <= dims.prod() <= 3000
    assert reps.min() >= 7 and reps.max() < 7 + 3000
    # where a cell holds capsule centres, its representative is the one nearest the cell's centre
    from taperay.runtime.tape import quat_matrices
    centres = inst["t"] + inst["s"][:, None] * (quat_matrices(inst["q"].astype(np.float64)) @ ((a + b) / 2))
    cell = np.minimum(((centres - lo) / edge).astype(int), dims - 1)
    flat = (cell[:, 2] * dims[1] + cell[:, 1]) * dims[0] + cell[:, 0]
    offset = np.linalg.norm(centres - (lo + (cell + 0.5) * edge), axis=1)
    for c in np.unique(flat)[:200]:
        members = np.flatnonzero(flat == c)
        assert reps[c] - 7 == members[np.argmin(offset[members])]


@pytest.mark.parametrize("n", [1, 2, 3, 7, 1000])
def test_bvh_splits_every_node_at_the_median_of_its_longest_centre_axis(n):
    """build_bvh: preorder with skip indices, every leaf once, each box the union of its
    children's, and each node's leaves split in halves (left: the lower half) along the axis on
    which their box centres spread most; here a flat spread, as the bolt bin's."""
    rng = np.random.default_rng(n)
    centres = rng.uniform((-10, -10, -1), (10, 10, 1), (n, 3))
    half = rng.uniform(0.05, 0.3, (n, 3))
    boxes = np.stack([centres - half, centres + half], axis=1)
    bvh = build_bvh(boxes, first_node=5, first_instance=3)
    assert len(bvh) == 2 * n - 1
    leaves = bvh["instance"][bvh["instance"] >= 0]
    assert sorted(leaves) == list(range(3, 3 + n))

    def subtree(i):            # (preorder index, leaf instances, box) of node i, checked on the way
        nd = bvh[i]
        if nd["instance"] >= 0:
            assert nd["skip"] == i + 1 + 5
            np.testing.assert_array_equal(nd["lo"], boxes[nd["instance"] - 3, 0].astype(np.float32))
            return [nd["instance"] - 3]
        left = subtree(i + 1)
        right_at = 2 * len(left) - 1 + i + 1
        assert bvh[i + 1]["skip"] == right_at + 5
        right = subtree(right_at)
        both = left + right
        assert nd["skip"] == i + 2 * len(both) - 1 + 5 and len(left) == len(both) // 2
        np.testing.assert_array_equal(nd["lo"], np.minimum(bvh[i + 1]["lo"], bvh[right_at]["lo"]))
        np.testing.assert_array_equal(nd["hi"], np.maximum(bvh[i + 1]["hi"], bvh[right_at]["hi"]))
        c = boxes[both].mean(1)
        axis = np.argmax(np.ptp(c, axis=0))
        assert boxes[left].mean(1)[:, axis].max() <= boxes[right].mean(1)[:, axis].min()
        return both

    assert len(subtree(0)) == n


def random_assembly(seed: int, n: int = 300):
    """n random copies, at random poses and scales, of a random union of moved primitives."""
    rng = np.random.default_rng(seed)
    kinds = [lambda: sphere(rng.uniform(0.1, 0.4)), lambda: box(*rng.uniform(0.05, 0.4, 3)),
             lambda: cylinder(rng.uniform(0.05, 0.3), rng.uniform(0.1, 0.5))]
    parts = [kinds[int(rng.integers(3))]().rotate(tuple(rng.normal(size=3)), rng.uniform(0, 180))
             .translate(*rng.uniform(-0.3, 0.3, 3)) for _ in range(int(rng.integers(1, 4)))]
    body = union(*parts) if len(parts) > 1 else parts[0]
    if seed % 2:     # a bored body: its ball is proven numerically
        body = difference(body, sphere(0.1).translate(*rng.uniform(-0.2, 0.2, 3)))
    spread = rng.uniform(1.0, 4.0)
    return union(box(spread, spread, 0.1).translate(0, 0, -spread - 0.5),
                 body.instances(rng.uniform(-spread, spread, (n, 3)), random_quats(rng, n), rng.uniform(0.5, 2.0, n)))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_random_assemblies_culled_equal_unculled(seed, walkers_all, walker_cpu):
    """The walk from the representative's bound never changes the field or the material (the
    unculled tape has no bound and no inner-box rejection), on every walker."""
    scene = random_assembly(seed)
    tape, plain = flatten(scene), flatten(scene, cull=False)
    assert tape.params[tape.instrs["param"][tape.instrs["op"] == Op.INSTANCES][0] + 12] > 0   # the bound is on
    rng = np.random.default_rng(seed + 100)
    lo, hi = tape.bounds.astype(np.float64)
    pts = rng.uniform(lo - 0.5, hi + 0.5, (4000, 3))
    centres = tape.instances["t"][rng.integers(0, len(tape.instances), 4000)]
    near = centres + rng.normal(scale=0.2, size=(4000, 3))        # near and inside the copies
    pts = np.concatenate([pts, near]).astype(np.float32)
    d, m = walkers_all.evaluate(tape, pts)
    d0, m0 = walker_cpu.evaluate(plain, pts)
    np.testing.assert_allclose(d, d0, rtol=0, atol=2e-6)
    assert np.array_equal(m, m0)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_walk_hints_leave_marches_and_light_as_the_twins(seed, walker_gpu, walker_cpu):
    """The GPU walk runs first the leaf that held the last walk's minimum (interpreter.wgsl
    walk_hint: along a ray, over its gradient taps, its shadow ray and ambient occlusion taps);
    the field it gives must stay the twin's (whose walks carry hints too: test_the_twins_hinted_march_...)."""
    tape, cam = dense_pile(seed)
    gpu, cpu = walker_gpu.light(tape, cam, 48, 36, cells=None), walker_cpu.light(tape, cam, 48, 36)
    assert cpu["hit"].mean() > 0.3 and cpu["steps"][cpu["hit"]].mean() > 8
    # Tolerances: rounding (an H200 fuses multiply-adds where the twin does not) moved t by up to
    # 1.2e-4 relative, ambient occlusion by 3.5e-3 and one pixel's step count in 1,728 there
    # (lavapipe: 2.2e-7, 3.3e-5, none); a walk that restarted past the hinted leaf instead of at
    # the root moved t by 0.6, shadow and occlusion by 1, and half the step counts.
    assert np.mean(gpu["hit"] != cpu["hit"]) <= 1 / 400
    both = gpu["hit"] & cpu["hit"]
    np.testing.assert_allclose(gpu["t"][both], cpu["t"][both], rtol=1e-3, atol=1e-6)
    assert np.mean(gpu["steps"] != cpu["steps"]) <= 1 / 100
    np.testing.assert_allclose(gpu["shadow"][both], cpu["shadow"][both], atol=1e-2)
    np.testing.assert_allclose(gpu["ao"][both], cpu["ao"][both], atol=1e-2)


def dense_pile(seed: int, n: int = 400):
    """A dense pile of random bodies over a floor, seen from above: most rays pass near many
    copies, so most of their walks start from a hint."""
    from taperay.runtime.camera import Camera
    rng = np.random.default_rng(seed)
    body = union(box(0.3, 0.1, 0.1), cylinder(0.08, 0.4).rotate((1, 0, 0), 90).translate(0.2, 0, 0))
    scene = union(box(3, 3, 0.1).translate(0, 0, -1.2),
                  body.instances(rng.uniform((-2.5, -2.5, -1), (2.5, 2.5, 1), (n, 3)), random_quats(rng, n),
                                 rng.uniform(0.7, 1.3, n)))
    return flatten(scene), Camera((2.5, -3.5, 4.5), (0.0, 0.0, -0.3), fov_deg=40)


@pytest.mark.parametrize("seed", range(2))
def test_the_twins_hinted_march_takes_the_steps_of_walks_without_hints(seed, walker_cpu):
    """The twin's march carries each ray's walk hint from step to step and into its gradient
    taps (twin.py, as the GPU does). Its depths, hits, step counts, gradients and materials must
    be bit for bit those of the same steps taken by ``evaluate``, whose walks have no hint."""
    from taperay.runtime.twin_march import TETRA, slab
    from taperay.runtime.shading import RenderSettings, unpack
    tape, cam = dense_pile(seed)
    w, h = 40, 30
    mr = walker_cpu.march(tape, cam, w, h)
    packed = RenderSettings().pack(tape, "shade")
    box_lohi = unpack(packed, "box_lo", "box_hi").reshape(2, 3)
    eps, step_scale, neps = (np.float32(unpack(packed, k)[0]) for k in ("hit_eps", "step_scale", "normal_eps"))
    max_steps = int(unpack(packed, "max_steps")[0])
    eye, dirs = cam.rays(w, h)
    dirs = dirs.reshape(-1, 3)
    span = np.array([slab(eye, d, box_lohi) for d in dirs], np.float32)
    t, tfar = span[:, 0].copy(), span[:, 1]
    steps, hit = np.zeros(len(t), np.int32), np.zeros(len(t), bool)
    live = np.flatnonzero(t <= tfar)
    while live.size:
        d, _ = walker_cpu.evaluate(tape, eye + t[live, None] * dirs[live])
        steps[live] += 1
        hit[live] = d < eps
        go = live[d >= eps]
        t[go] += d[d >= eps] * step_scale
        live = go[(t[go] <= tfar[go]) & (steps[go] < max_steps)]
    assert hit.mean() > 0.3 and steps[hit].mean() > 8
    assert np.array_equal(mr["hit"].ravel(), hit) and np.array_equal(mr["steps"].ravel(), steps)
    assert np.array_equal(mr["t"].ravel()[hit], t[hit])
    at = eye + t[hit, None] * dirs[hit]
    grad = np.zeros_like(at)
    for tap in TETRA:
        grad += tap * walker_cpu.evaluate(tape, at + neps * tap)[0][:, None]
    assert np.array_equal(mr["grad"].reshape(-1, 3)[hit], grad / (np.float32(4) * neps))
    assert np.array_equal(mr["mat"].ravel()[hit], walker_cpu.evaluate(tape, at)[1])


@pytest.mark.parametrize("seed", range(2))
def test_compacted_instance_lists_give_the_values_of_points_alone(seed, walker_cpu):
    """Where half of a block's points have no leaf left to run, the twin moves the others to the
    front and runs the body for those only (twin.py, _compact_instances), and puts every point back
    when the list closes. Values, materials and the walk hints the march carries on must be those
    of each point evaluated alone (blocks of one never compact), bit for bit: at random points and
    at points along rays, as the march meets them."""
    from conftest import evaluate_one_by_one
    tape, cam = dense_pile(seed, 600)
    rng = np.random.default_rng(seed)
    lo, hi = tape.bounds
    mr = walker_cpu.march(tape, cam, 32, 24)
    eye, dirs = cam.rays(32, 24)
    dirs = dirs.reshape(-1, 3)
    ts = mr["t"].ravel()
    near = eye + np.where(np.isfinite(ts), ts, 0)[:, None] * dirs
    pts = np.concatenate([rng.uniform(lo, hi, (400, 3)), near, near + rng.normal(0, 0.05, near.shape)])
    d, m = walker_cpu.evaluate(tape, pts.astype(np.float32))
    d1, m1 = evaluate_one_by_one(walker_cpu, tape, pts.astype(np.float32))
    assert np.array_equal(d, d1) and np.array_equal(m, m1)


@pytest.mark.slow
def test_leaves_that_tie_give_the_twins_material_on_the_gpu(walker_gpu, walker_cpu):
    """Where two leaves tie exactly, the material is the first leaf's in tree order on the twin.
    The GPU's hinted walks may take the other one; the kernels that write a material must not
    show it (they evaluate once an invocation, before any hint). Pairs of copies of a body whose
    red and blue spheres swap places under a half turn about z: around the spheres every point
    ties; each copy's green bar, on one side only, makes a ray's hint either copy."""
    from taperay.runtime.camera import Camera
    from taperay.scenegraph import Material
    mats = [Material(c, rgb, 0.5) for c, rgb in (("red", (0.8, 0.1, 0.1)), ("blue", (0.1, 0.2, 0.8)),
                                                  ("green", (0.1, 0.7, 0.2)))]
    body = union(sphere(0.3).translate(-0.5, 0, 0).material(mats[0]),
                 sphere(0.3).translate(0.5, 0, 0).material(mats[1]),
                 box(0.12, 0.35, 0.12).translate(0, 0.75, 0).material(mats[2]))
    rng = np.random.default_rng(3)
    spots = np.repeat(rng.uniform((-2.2, -2.2, -0.4), (2.2, 2.2, 0.4), (12, 3)), 2, axis=0)
    half_turns = np.tile([[1.0, 0, 0, 0], [0, 0, 0, 1.0]], (12, 1))
    tape = flatten(body.instances(spots, half_turns))
    cam = Camera((0.5, -4.0, 5.0), (0.0, 0.0, 0.0), fov_deg=45)
    gpu, cpu = walker_gpu.march(tape, cam, 64, 48, cells=None), walker_cpu.march(tape, cam, 64, 48)
    both = gpu["hit"] & cpu["hit"]
    assert both.mean() > 0.1
    ids = {int(m) for m in cpu["mat"][both]}
    assert len(ids) >= 2                                   # both sphere materials are seen
    pts = rng.uniform(tape.bounds[0], tape.bounds[1], (4000, 3)).astype(np.float32)
    (dg, mg), (dc, mc) = walker_gpu.evaluate(tape, pts), walker_cpu.evaluate(tape, pts)
    np.testing.assert_allclose(dg, dc, rtol=0, atol=1e-6)
    # Lavapipe gives the twin's bits: no material differs. An H200 rounds the two copies' values
    # apart by an ulp at some tied points (it fuses multiply-adds in their rotations), which
    # picks the other copy: 1 of 869 pixels and 9 of 4,000 points there. A walk that took the
    # last tied leaf instead of the first gives the other material on 62 % of these pixels.
    assert np.mean(gpu["mat"][both] != cpu["mat"][both]) <= 1 / 100
    assert np.mean(mg != mc) <= 1 / 100


def test_validator_refuses_a_representative_outside_the_list_and_a_bad_grid():
    tape = flatten(union(sphere(0.3).instances(np.eye(3) * 2), sphere(0.2).instances(-np.eye(3) * 2)))
    first = tape.instrs["param"][tape.instrs["op"] == Op.INSTANCES]
    assert len(first) == 2
    params = tape.params.copy()
    params[first[0] + 20] = 4          # an instance of the other list
    with pytest.raises(TapeError, match="not an instance of its list"):
        validate(dataclasses.replace(tape, params=params))
    params[first[0] + 20] = 0
    params[first[0] + 17] = 0.5        # a count that is not whole
    with pytest.raises(TapeError, match="whole counts"):
        validate(dataclasses.replace(tape, params=params))


def test_an_edited_body_gets_the_bound_of_its_edited_shape(walker_cpu):
    """Tape.set_param refits the tape by flattening again with the new value; the ball proven
    inside the body must be proven for that value too (a ball inside the sphere of radius 1 lies
    outside the sphere of radius 0.4)."""
    rng = np.random.default_rng(0)
    scene = (sphere(Param("r", 1.0)) - box(0.2)).instances(rng.uniform(-3, 3, (200, 3)))
    tape, plain = flatten(scene), flatten(scene, cull=False)
    tape.set_param("r", 0.4)
    plain.set_param("r", 0.4)
    prm = tape.instrs["param"][tape.instrs["op"] == Op.INSTANCES][0]
    a, r = tape.params[prm + 6:prm + 9].astype(np.float64), float(tape.params[prm + 12])
    assert r > 0 and np.linalg.norm(a) + r <= 0.4
    pts = rng.uniform(-4, 4, (20_000, 3)).astype(np.float32)
    d, m = walker_cpu.evaluate(tape, pts)
    d0, m0 = walker_cpu.evaluate(plain, pts)
    np.testing.assert_allclose(d, d0, rtol=0, atol=2e-6)
    assert np.array_equal(m, m0)


def test_an_edit_without_the_scene_turns_the_bound_off(tmp_path, walker_cpu):
    """A tape read from a file cannot prove a ball inside its edited body again: an edit turns its
    instance lists' bounds off (walks from +inf), so the field stays the unculled one."""
    from taperay.scenegraph.files import load_file, save_tape
    rng = np.random.default_rng(1)
    scene = (sphere(Param("r", 1.0)) - box(0.2)).instances(rng.uniform(-3, 3, (200, 3)))
    save_tape(flatten(scene), tmp_path / "s.tape")
    save_tape(flatten(scene, cull=False), tmp_path / "plain.tape")
    tape, plain = load_file(tmp_path / "s.tape"), load_file(tmp_path / "plain.tape")
    prm = tape.instrs["param"][tape.instrs["op"] == Op.INSTANCES][0]
    assert tape.refit is None and tape.params[prm + 12] > 0
    assert tape.set_param("r", 0.4) is True          # (more than the slots changed: upload them)
    assert tape.params[prm + 12] < 0
    plain.set_param("r", 0.4)
    pts = rng.uniform(-4, 4, (20_000, 3)).astype(np.float32)
    d, m = walker_cpu.evaluate(tape, pts)
    d0, m0 = walker_cpu.evaluate(plain, pts)
    np.testing.assert_allclose(d, d0, rtol=0, atol=2e-6)
    assert np.array_equal(m, m0)


def test_the_twins_hinted_walk_keeps_the_first_of_tied_leaves(walker_cpu):
    """Two copies of a two-material body that coincide, the second turned half a turn about z:
    at every point their values are equal, bit for bit, and their materials differ. A walk
    hinted at either leaf must give the material of the first in tree order, as a walk without
    a hint does (and the GPU's surface pass): the twin's march takes its hits' materials from its
    last, hinted step (twin_instances.ties_first)."""
    from taperay.runtime import twin, twin_field
    from taperay.scenegraph import Material
    red, blue = Material("red", (0.8, 0.1, 0.1)), Material("blue", (0.1, 0.2, 0.8))
    body = union(sphere(0.5).translate(0, 0.1, 0).material(red), sphere(0.5).translate(0, -0.1, 0).material(blue))
    tape = flatten(body.instances(np.zeros((2, 3)), [(1, 0, 0, 0), (0, 0, 0, 1)]))
    walker_cpu.evaluate(tape, np.zeros((1, 3), np.float32))   # (validated, so frozen, as the kernels take it)
    pc = int(np.flatnonzero(tape.instrs["op"] == Op.INSTANCES)[0])
    tp = twin.kernel_tape(tape)
    first, end = int(tp[0][pc, 6]), int(tp[0][pc, 6] + tp[0][pc, 2])
    leaves = [k for k in range(first, end) if tp[3][k, 7] >= 0]
    assert len(leaves) == 2
    rng = np.random.default_rng(3)
    pts = rng.uniform(-0.7, 0.7, (256, 3)).astype(np.float32)
    pts[:, 1] = np.where(np.abs(pts[:, 1]) < 0.05, 0.3, pts[:, 1])      # off the plane y = 0
    d0, m0 = walker_cpu.evaluate(tape, pts)
    one = [walker_cpu.evaluate(flatten(body.instances(np.zeros((1, 3)), [q])), pts) for q in ((1, 0, 0, 0), (0, 0, 0, 1))]
    assert np.array_equal(one[0][0], one[1][0]) and np.all(one[0][1] != one[1][1])    # every point ties
    for leaf in leaves:
        ws = twin_field.workspace(tape.n_regs, np.int64(len(pts)), tp[7])
        ws1 = twin_field.workspace(tape.n_regs, np.int64(1), np.int64(0))
        ws[twin_field.WS_PIN][:] = pts.T
        ws[twin_field.WS_HINT][0], ws[twin_field.WS_HINT][1] = pc + 1, leaf + 1
        twin_field.field_block(tp, np.int64(len(pts)), ws, ws1, np.zeros(5, np.float32))
        assert np.array_equal(ws[twin_field.WS_OUT_D][:len(pts)], d0)
        assert np.array_equal(ws[twin_field.WS_OUT_M][:len(pts)], m0), f"hinted at leaf {leaf}"


def test_an_instance_list_is_built_once_per_content_and_flattens_as_if_built_anew(monkeypatch):
    """Topology edits elsewhere in a scene re-flatten an instance list from its remembered bounds,
    BVH and grid (``built_cache_stats`` counts hits, no builds); each tape equals the one flattened
    with nothing remembered, with the offsets of where the list lands (here also twice in one tape),
    and a list whose placements changed is built again."""
    from taperay.scenegraph import instancing
    rng = np.random.default_rng(3)
    n = 400
    t, q, s = rng.uniform(-5, 5, (n, 3)), random_quats(rng, n), rng.uniform(0.8, 1.2, n)
    parts = bolt().instances(t, q, s)
    moved = t.copy()
    moved[17] += 0.01
    edits = [union(parts, sphere(1.0)),
             union(parts, sphere(1.0).translate(0, 0, 3), parts.translate(20, 0, 0)),
             union(bolt().instances(t, q, s), box(1.0)),                 # the same content, new arrays
             union(bolt().instances(moved, q, s), box(1.0))]
    counts = []
    tapes = []
    for scene in edits:
        before = instancing.built_cache_stats()
        tapes.append(flatten(scene))
        after = instancing.built_cache_stats()
        counts.append((after["hits"] - before["hits"], after["builds"] - before["builds"]))
    # (bounds, BVH and grid of a list: three builds or hits; the first list's bounds serve its copy)
    assert counts[0] == (0, 3) and counts[1][1] == 0 and counts[1][0] >= 3, counts
    assert counts[2] == (3, 0) and counts[3] == (0, 3), counts
    monkeypatch.setattr(instancing, "_remembered", lambda key, build: build())
    for scene, tape in zip(edits, tapes):
        fresh = flatten(scene)
        for name in ("instrs", "params", "bvh", "instances"):
            np.testing.assert_array_equal(getattr(tape, name), getattr(fresh, name), err_msg=name)


def test_a_reflattened_instance_list_is_neither_copied_nor_validated_again(monkeypatch, walker_cpu):
    """Placements are read-only; a scene with one instance list holds its placements and its
    remembered BVH themselves (a topology edit elsewhere copies neither), and a flattened tape is
    validated once: the walker drawing it finds it validated."""
    from taperay.runtime import tape as tape_module
    rng = np.random.default_rng(5)
    n = 300
    parts = bolt().instances(rng.uniform(-5, 5, (n, 3)), random_quats(rng, n), rng.uniform(0.8, 1.2, n))
    assert not parts.array.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        parts.array["s"][0] = 2.0
    a, b = flatten(union(parts, sphere(1.0))), flatten(union(parts, box(1.0)))
    assert a.bvh is b.bvh and a.instances is parts.array and b.instances is parts.array
    assert not a.bvh.flags.writeable
    unculled = flatten(union(parts, sphere(1.0)), cull=False)       # (its inner boxes rewritten: a copy)
    assert unculled.bvh is not a.bvh and np.array_equal(unculled.bvh["skip"], a.bvh["skip"])
    calls = []
    real = tape_module.validate
    monkeypatch.setattr(tape_module, "validate", lambda *args, **kw: calls.append(1) or real(*args, **kw))
    tape = flatten(union(parts, sphere(2.5)))
    assert len(calls) == 1
    d, _ = walker_cpu.evaluate(tape, rng.uniform(-5, 5, (64, 3)).astype(np.float32))
    assert len(calls) == 1 and np.all(np.isfinite(d))
