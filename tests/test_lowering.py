"""Lowering of scene tapes to arithmetic (runtime.lowering) and the renders that use it.

* every lowerable record (the primitives, the point ops, the combine ops, arithmetic fields):
  without cull boxes the lowered field equals the tape's everywhere (float32 rounding of the
  rewritten formulas apart), with its materials;
* with cull boxes (unions of many leaves) it equals the tape's wherever that is >= 0 and has
  its sign everywhere (the cull box only changes values inside a solid);
* convex polygons, patterns of at most UNROLL_MAX copies (written out: their union) and cuts of a
  part of several materials lower to the same field (a pattern's union at least its value);
* what it does not rewrite is NotLowerable, naming the record, and cell_tape says None;
* the twin's march_pruned of a lowered scene is CpuWalker.march bit for bit, materials too;
* GpuWalker.render of a scene tape runs the lowered tape on cells from its second render on: the
  same bits as the lowered tape's unpruned render, the twin's image of it (by the walkers' image
  contract), no kernel created; a flange of the showcase's kind (polygons, patterns, a cut of two
  materials) too; the twin renders a patterned scene tape on its own records.
"""
import numpy as np
import pytest

from taperay.runtime.camera import auto_camera
from taperay.runtime.conformance import compare_images
from taperay.runtime.lowering import NotLowerable, lower
from taperay.runtime.opcodes import Family, OPS, Op
from taperay.runtime.pruning import cell_tape, is_arithmetic, march_pruned
from taperay.runtime.tape import content_key, validate
from taperay.scenegraph import (Material, box, capped_cone, capsule, cylinder, difference, ellipsoid, extrude,
                                field, fields, flatten, intersection, plane, revolve, rounded_box,
                                smooth_difference, smooth_intersection, smooth_union, sphere, torus, union, xor)
from taperay.runtime.shading import RenderSettings

EXACT = RenderSettings(cell_skip=False)   # marches on cells without empty-space skipping: the whole tape's steps

RED, BLUE, GREEN = (Material("red", (0.8, 0.1, 0.1), 0.4), Material("blue", (0.1, 0.2, 0.8), 0.6),
                    Material("green", (0.1, 0.7, 0.2), 0.3))
TOL = 2e-5   # float32 rounding of the rewritten formulas, at scene sizes of a few units


def _points(tape, n=40000, seed=0):
    rng = np.random.default_rng(seed)
    lo, hi = tape.bounds.astype(np.float64)
    pad = 0.25 * (hi - lo) + 0.1
    return rng.uniform(lo - pad, hi + pad, (n, 3)).astype(np.float32)


def _leaf_scene():
    """Each lowerable primitive and point op once, combined by every lowerable combine op (two
    children each: no cull boxes)."""
    x, z = fields.x, fields.z
    wave = field(fields.sin(x * 3) * 0.1 + z - 0.2, bounds=((-1, -1, -1), (1, 1, 1)))
    parts = [
        difference(sphere(0.5), cylinder(0.2, 3.0).rotate((1, 0, 0), 30)).translate(-2, 0, 0).material(RED),
        box(0.4, 0.3, 0.2).rotate((1, 2, 3), 40).translate(-1, 0.5, 0).material(BLUE),
        rounded_box(0.4, 0.3, 0.3, 0.1).rotate((0, 1, 0), 25).translate(0, 0.5, 0),
        cylinder(0.3, 0.5).rotate((1, 0, 0), 70).translate(1, 0, 0.2).material(GREEN),
        torus(0.5, 0.15).scale(1.5).translate(2, 0, 0),
        capsule((0, 0, -0.5), (0.3, 0.2, 0.5), 0.2).translate(0, -1.5, 0).material(RED),
        sphere(0.4).elongate(0.3, 0.0, 0.2).translate(-1, -1.2, 0.3),
        box(0.3).translate(0.5, 0, 0).mirror((1, 0, 0), 0.0).translate(0, 1.5, 0).material(BLUE),
        wave.translate(0, 0, -1.5).material(GREEN),
    ]
    scene = parts[0]
    for part in parts[1:]:       # (an offset keeps unions binary: n-ary ones get cull boxes)
        scene = union(scene, part).offset(0.0)
    shaped = intersection(scene, box(3, 2.5, 2.5)).offset(0.02)
    top = union(shaped, sphere(0.3).shell(0.05).translate(0, 0, 1.5)).offset(0.0)
    return union(top, plane((0, 0, 1), -2.2).material(RED))


def test_every_lowerable_record_without_culls_gives_the_same_field_and_materials(walker_cpu):
    tape = flatten(_leaf_scene(), cull=False)
    assert not (tape.instrs["op"] == Op.CULL_BOX).any()
    ops = {Op(int(o)) for o in np.unique(tape.instrs["op"])}
    assert {Op.SPHERE, Op.BOX, Op.ROUND_BOX, Op.CYLINDER, Op.TORUS, Op.CAPSULE, Op.PLANE, Op.TRANSLATE,
            Op.ROTATE, Op.SCALE, Op.MIRROR, Op.ELONGATE, Op.UNION, Op.INTERSECT, Op.DIFFERENCE, Op.OFFSET,
            Op.SHELL, Op.FIELD_RESULT} <= ops
    low = validate(lower(tape))
    assert is_arithmetic(low, fields=True) and not is_arithmetic(tape, fields=True)
    assert {Op(int(o)) for o in np.unique(low.instrs["op"])} <= \
        {o for o in Op if OPS[o].family is Family.ARITH} | {Op.FIELD_RESULT, Op.UNION, Op.INTERSECT}
    assert low.materials.tobytes() == tape.materials.tobytes()
    assert np.array_equal(low.bounds, tape.bounds) and low.instance_count == tape.instance_count
    pts = _points(tape)
    f0, m0 = walker_cpu.evaluate(tape, pts)
    f1, m1 = walker_cpu.evaluate(low, pts)
    np.testing.assert_allclose(f1, f0, rtol=0, atol=TOL)
    assert np.mean(f0 < 0) > 0.02           # points inside too
    clear = np.abs(f0) > 1e-3                # (away from ties between parts)
    assert len(set(m0.tolist())) >= 3 and np.array_equal(m1[clear], m0[clear])


def test_culled_unions_lower_to_the_plain_union(walker_cpu):
    from taperay.tools.bench_gpu import primitive_scene
    tape = flatten(primitive_scene(60, seed=3))
    assert (tape.instrs["op"] == Op.CULL_BOX).sum() >= 10
    low = lower(tape)
    assert not (low.instrs["op"] == Op.CULL_BOX).any()
    pts = _points(tape, 60000)
    f0, m0 = walker_cpu.evaluate(tape, pts)
    f1, m1 = walker_cpu.evaluate(low, pts)
    out = f0 >= 0
    np.testing.assert_allclose(f1[out], f0[out], rtol=0, atol=TOL)
    far = np.abs(f0) > TOL
    assert np.array_equal(np.sign(f1[far]), np.sign(f0[far]))
    assert np.all(f1[~out] <= f0[~out] + TOL)   # inside, the cull box can only have made it shallower
    assert np.array_equal(m1[out & far], m0[out & far])


def test_smooth_ops_lower_to_the_twins_formula(walker_cpu):
    blob = smooth_union(sphere(0.6).material(RED), box(0.4).translate(0.7, 0, 0).material(BLUE),
                        cylinder(0.2, 0.8).rotate((1, 0, 0), 90).translate(0, 0.6, 0).material(GREEN), k=0.3)
    carved = smooth_difference(box(0.5).translate(0, 0, 2).material(BLUE), sphere(0.4).translate(0.3, 0, 2.3), k=0.15)
    lens = smooth_intersection(sphere(0.8).translate(0, 0, -1.6), sphere(0.8).translate(0, 0, -2.4), k=0.1)
    tape = flatten(union(blob, carved, lens.material(RED).translate(2, 0, 0)))
    ops = set(np.unique(tape.instrs["op"]).tolist())
    assert {Op.SMOOTH_UNION, Op.SMOOTH_INTERSECT, Op.SMOOTH_DIFFERENCE} <= ops
    low = lower(tape)
    pts = _points(tape, 60000)
    f0, m0 = walker_cpu.evaluate(tape, pts)
    f1, m1 = walker_cpu.evaluate(low, pts)
    out = f0 >= 0                 # (the smooth unions' children carry cull boxes: see the module doc)
    np.testing.assert_allclose(f1[out], f0[out], rtol=0, atol=TOL)
    far = np.abs(f0) > TOL
    assert np.array_equal(np.sign(f1[far]), np.sign(f0[far])) and np.mean(f0 < 0) > 0.01
    # materials at the surface. The tape's cull boxes carry the parent's material (0 here): away
    # from the surface a culled child reads as its box, and where a box face lies on the part's
    # face (the cylinder's caps) the box may win by a rounding; the lowered tape has no boxes
    near = (np.abs(f0) > 1e-4) & (np.abs(f0) < 0.03)
    parts = near & (m0 != 0)
    assert set(m1[near].tolist()) == {1, 2, 3} and np.mean(parts) > 0.95 * np.mean(near)
    assert np.array_equal(m1[parts], m0[parts])


HEXAGON = [(0.3 * np.cos(a), 0.3 * np.sin(a)) for a in np.arange(6) * np.pi / 3]


@pytest.mark.parametrize("name", ["extruded hexagon", "extruded hexagon, clockwise", "revolved profile",
                                  "linear pattern", "polar pattern", "grid pattern", "nested patterns",
                                  "difference of two materials", "smooth difference of two materials"])
def test_patterns_polygons_and_cuts_of_several_materials_lower_to_the_same_field(walker_cpu, name):
    """Convex polygons (extruded, revolved) lower to the twin's distance; patterns of at most
    UNROLL_MAX copies are written out (their union, so at least the pattern's value, which
    bounds the copies it does not evaluate, and equal to it where it evaluates them), each copy
    its INSTANCE_INDEX; a difference or smooth difference of a part of several materials gives
    the cut the part's material at each point."""
    two = union(sphere(1).material(RED), box(0.5).translate(1, 0, 0).material(BLUE))
    x, y, z = fields.x, fields.y, fields.z
    shaded = field(fields.instance_index * 0.01 + fields.sqrt(x * x + y * y + z * z) - 0.1,
                   bounds=((-0.2,) * 3, (0.2,) * 3))
    scene = {
        "extruded hexagon": extrude(HEXAGON, 0.5).rotate((1, 0, 0), 30).material(RED),
        "extruded hexagon, clockwise": extrude(HEXAGON[::-1], 0.2).material(RED),
        "revolved profile": revolve([(0.2, -0.5), (0.6, -0.3), (0.5, 0.4), (0.1, 0.5)]).material(BLUE),
        "linear pattern": shaded.linear_pattern((0.5, 0.1, 0), 7).material(GREEN),
        "polar pattern": cylinder(0.05, 0.2).translate(0.5, 0, 0).polar_pattern(8).material(RED),
        "grid pattern": box(0.1).grid_pattern((0.3, 0.3, 0.3), (3, 2, 2)).material(BLUE),
        "nested patterns": sphere(0.1).linear_pattern((0.3, 0, 0), 4).translate(0.6, 0, 0).polar_pattern(6),
        "difference of two materials": difference(two, sphere(0.3), box(0.2).translate(1.3, 0, 0)),
        "smooth difference of two materials": smooth_difference(two, sphere(0.4).translate(0.5, 0, 0.3), k=0.1),
    }[name]
    tape = flatten(scene)
    low = validate(lower(tape))
    assert is_arithmetic(low, fields=True)
    pts = _points(tape, 60000)
    f0, m0 = walker_cpu.evaluate(tape, pts)
    f1, m1 = walker_cpu.evaluate(low, pts)
    far = np.abs(f0) > TOL
    assert np.array_equal(np.sign(f1[far]), np.sign(f0[far])) and np.mean(f0 < 0) > 0.001
    if "pattern" in name:
        assert np.all(f1 >= f0 - TOL)
        assert np.mean(np.abs(f1 - f0) <= TOL) > 0.5
    else:
        np.testing.assert_allclose(f1, f0, rtol=0, atol=TOL)
    near = (np.abs(f0) > 1e-4) & (np.abs(f0) < 0.03)
    assert np.mean(near) > 0.001 and np.array_equal(m1[near], m0[near])


@pytest.mark.parametrize("scene,what", [
    (lambda: xor(sphere(1), box(0.5).translate(1, 0, 0)), "XOR"),
    (lambda: ellipsoid(1, 0.5, 0.3), "ELLIPSOID"),
    (lambda: capped_cone(1, 0.5, 0.2), "CAPPED_CONE"),
    (lambda: sphere(0.3).linear_pattern((1, 0, 0), 65), "REPEAT_LINEAR"),
    (lambda: cylinder(0.004, 1).grid_pattern((0.01, 0.01, 1), (1000, 1000, 1)), "REPEAT_GRID"),
    (lambda: sphere(0.05).linear_pattern((0.2, 0, 0), 9).grid_pattern((3, 3, 3), (3, 3, 1)), "REPEAT_LINEAR"),
    (lambda: extrude([(0, 0), (1, 0), (0.2, 0.2), (0, 1)], 0.5), "EXTRUDE_POLY"),
    (lambda: sphere(0.2).instances(np.eye(3)), "INSTANCES"),
])
def test_what_is_not_lowered_says_which_record(scene, what):
    tape = flatten(scene())
    with pytest.raises(NotLowerable, match=what) as e:
        lower(tape)
    assert e.value.record is not None and Op(int(tape.instrs["op"][e.value.record])).name == what
    assert cell_tape(tape) is None


def test_cell_tape_is_the_tape_itself_for_arithmetic_and_kept_per_content():
    arith = flatten(field(fields.x * fields.x + fields.y - 0.5))
    assert cell_tape(arith) is arith
    scene = flatten(union(*[sphere(0.2).translate(i, 0, 0) for i in range(8)]))
    first = cell_tape(scene)
    assert first is not None and cell_tape(flatten(union(*[sphere(0.2).translate(i, 0, 0) for i in range(8)]))) is first


def _material_scene():
    """30 rotated spheres, boxes and cylinders in three materials, packed close (a culled union)."""
    rng = np.random.default_rng(5)
    shapes = (lambda: sphere(rng.uniform(0.3, 0.6)), lambda: box(*rng.uniform(0.2, 0.5, 3)),
              lambda: cylinder(rng.uniform(0.2, 0.4), rng.uniform(0.3, 0.6)))
    mats = (RED, BLUE, GREEN)
    return union(*[shapes[i % 3]().rotate(rng.normal(size=3), rng.uniform(0, 180))
                   .translate(*rng.uniform(-1.5, 1.5, 3)).material(mats[i % 3]) for i in range(30)])


@pytest.mark.parametrize("levels", [1, 2])
def test_twin_march_pruned_of_a_lowered_scene_is_march_bit_for_bit(walker_cpu, levels):
    low = lower(flatten(_material_scene()))
    cam = auto_camera(low.bounds)
    ref = walker_cpu.march(low, cam, 40, 30)
    got = march_pruned(low, cam, 40, 30, EXACT, grid=4, levels=levels)
    assert ref["hit"].mean() > 0.1 and len(np.unique(ref["mat"][ref["hit"]])) >= 3
    for k in ("t", "hit", "steps", "mat", "grad"):
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)


def _flange_scene():
    """The showcase's features: a two-material body cut (smooth difference) by a polar pattern of
    holes (explicit copies), a linear pattern of convex hexagonal slots and a bore."""
    body = smooth_union(rounded_box(1.6, 1.1, 0.18, 0.08).material(RED),
                        cylinder(0.55, 0.45).translate(0, 0, 0.35).material(BLUE), k=0.2)
    slots = extrude(HEXAGON, 1.0).scale(0.4).translate(-1.3, -0.8, 0).linear_pattern((0, 0.4, 0), 5)
    holes = cylinder(0.09, 1.0).translate(0.8, 0, 0).polar_pattern(8)
    return smooth_difference(body, cylinder(0.3, 1.0), holes, slots, k=0.03)


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.parametrize("scene", [_material_scene, _flange_scene], ids=["material scene", "flange"])
def test_gpu_render_of_a_scene_runs_the_lowered_tape_on_cells(walker_gpu, walker_cpu, scene):
    tape = flatten(scene())
    low = walker_gpu.render_tape(tape)
    assert low is cell_tape(tape) and low is not tape
    assert walker_gpu.render_tape(tape, cells=None) is tape and walker_gpu.render_tape(tape, "slice") is tape
    cam = auto_camera(tape.bounds)
    # the first render of a tape's content is on its own records, the next ones on cells
    first = walker_gpu.render(tape, cam, 40, 30, view="normals", settings=EXACT)
    assert walker_gpu.stats()["kept_cells"] is None                      # (no cells were built for it)
    np.testing.assert_array_equal(first, walker_gpu.render(tape, cam, 40, 30, view="normals", cells=None,
                                                           settings=EXACT))
    for view in ("shade", "normals"):
        on_cells = walker_gpu.render(tape, cam, 40, 30, view=view, settings=EXACT)
        np.testing.assert_array_equal(on_cells, walker_gpu.render(low, cam, 40, 30, view=view, cells=None,
                                                                  settings=EXACT))
        # the twin's image of the same tape, by the walkers' image contract (equal on lavapipe;
        # a real GPU rounds a level here and there)
        cmp = compare_images(walker_cpu.render(low, cam, 40, 30, view=view, settings=EXACT), on_cells, levels=2)
        assert cmp["mismatch_fraction"] <= 0.02, cmp
        walker_gpu.render(tape, cam, 40, 30, view=view, settings=EXACT)
        assert walker_gpu.stats()["kept_cells"] is not None              # (on the lowered tape's cells)
    # the pipelines are made once per process, on first need (above, or by a test before it in
    # this process): the same renders again make none
    before = walker_gpu.stats()
    for view in ("shade", "normals"):
        walker_gpu.render(tape, cam, 40, 30, view=view, settings=EXACT)
    after = walker_gpu.stats()
    for k in ("shader_modules_created", "pipelines_created", "cache_misses"):
        assert after[k] == before[k], k


def test_a_sphere_reads_the_point_from_before_its_rotations(walker_cpu):
    turned = flatten(union(sphere(0.5).rotate((1, 2, 3), 40).rotate((0, 0, 1), 10).translate(1, 2, 3),
                           box(0.3).rotate((1, 0, 0), 30).translate(-1, 0, 0)).offset(0.0))
    plain = flatten(union(sphere(0.5).translate(1, 2, 3), box(0.3).rotate((1, 0, 0), 30).translate(-1, 0, 0))
                    .offset(0.0))
    low = lower(turned)
    assert len(low) == len(lower(plain)) < len(turned) + 45
    pts = _points(turned)
    np.testing.assert_allclose(walker_cpu.evaluate(low, pts)[0], walker_cpu.evaluate(turned, pts)[0], rtol=0, atol=TOL)


@pytest.mark.slow
@pytest.mark.gpu
def test_gpu_render_falls_back_when_the_lowered_cells_do_not_fit(walker_gpu, monkeypatch):
    import taperay.runtime.gpu as gpu
    tape = flatten(_material_scene())
    low = cell_tape(tape)
    cam = auto_camera(tape.bounds)
    walker_gpu.render(tape, cam, 32, 24, view="normals", settings=EXACT)          # (the first render: own records)
    walker_gpu.cells_too_large.clear()
    monkeypatch.setattr(gpu, "LOWERED_CELLS", (64, 2))             # 64^3 * 65 cells: past any limit
    on_march_cells = walker_gpu.render(tape, cam, 32, 24, view="normals", settings=EXACT)
    assert walker_gpu.cells_too_large == {(content_key(low), (64, 2))}
    np.testing.assert_array_equal(on_march_cells, walker_gpu.render(low, cam, 32, 24, view="normals", cells=None,
                                                                    settings=EXACT))
    monkeypatch.setattr(gpu, "MARCH_CELLS", (64, 2))
    walker_gpu.cells_too_large.clear()
    own = walker_gpu.render(tape, cam, 32, 24, view="normals", settings=EXACT)
    assert walker_gpu.cells_too_large == {(content_key(low), (64, 2))}   # (both tries were (64, 2))
    np.testing.assert_array_equal(own, walker_gpu.render(tape, cam, 32, 24, view="normals", cells=None, settings=EXACT))


def test_twin_render_of_a_scene_is_its_lowering_on_cells(walker_cpu):
    tape = flatten(_material_scene())
    low = lower(tape)
    cam = auto_camera(tape.bounds)
    image = walker_cpu.render(tape, cam, 40, 30, settings=EXACT)
    np.testing.assert_array_equal(image, walker_cpu.render(low, cam, 40, 30, cells=None, settings=EXACT))
    assert np.any(walker_cpu.render(tape, cam, 40, 30, view="depth", cells=None, settings=EXACT) != 0)


def test_twin_render_falls_back_to_the_tapes_own_records_past_the_cells_memory_cap(walker_cpu, monkeypatch):
    from taperay.runtime import cells, pruned_march
    from taperay.runtime.tape import CellsTooLarge
    tape = flatten(_material_scene())
    cam = auto_camera(tape.bounds)
    monkeypatch.setattr(cells, "CELL_TAPES_MAX_BYTES", 1 << 10)
    pruned_march.CELL_CACHE.clear()
    np.testing.assert_array_equal(walker_cpu.render(tape, cam, 24, 18, settings=EXACT),
                                  walker_cpu.render(tape, cam, 24, 18, cells=None, settings=EXACT))
    with pytest.raises(CellsTooLarge, match="march_pruned"):
        walker_cpu.render(tape, cam, 24, 18, cells=(4, 2))     # (asked for: not replaced silently)


def test_long_scene_tapes_are_not_lowered(monkeypatch):
    from taperay.runtime import cells
    tape = flatten(_material_scene())
    monkeypatch.setattr(cells, "LOWER_MAX_RECORDS", len(tape) - 1)
    assert cell_tape(tape) is None


def test_info_says_a_long_scene_tape_is_not_lowered(monkeypatch):
    from taperay.runtime import cells
    from taperay.tools.cli import tape_info
    tape = flatten(_material_scene())
    assert "lowering" in tape_info(tape)["march_cells"]
    monkeypatch.setattr(cells, "LOWER_MAX_RECORDS", len(tape) - 1)
    assert "too long to lower" in tape_info(tape)["march_cells"]


def test_twin_render_of_a_patterned_scene_is_on_its_own_records(walker_cpu, monkeypatch):
    """The twin marches a scene tape with patterns on its own records (its lowering writes the
    copies out: cells longer than the loop), though the tape has a lowering (the GPU's camera
    moves use it)."""
    from taperay.runtime import pruned_march
    tape = flatten(union(_material_scene(), sphere(0.1).linear_pattern((0.3, 0, 0), 8).translate(0, 0, 2)))
    assert cell_tape(tape) is not None
    calls = []
    monkeypatch.setattr(pruned_march, "march_pruned", lambda *a, **k: calls.append(1))
    cam = auto_camera(tape.bounds)
    image = walker_cpu.render(tape, cam, 32, 24, settings=EXACT)
    assert not calls
    np.testing.assert_array_equal(image, walker_cpu.render(tape, cam, 32, 24, cells=None, settings=EXACT))


@pytest.mark.parametrize("share,on_cells", [(1.0, True), (0.0, False)])
def test_twin_render_uses_cells_only_where_they_shorten_the_tape(walker_cpu, monkeypatch, share, on_cells):
    """With cells "auto" the twin marches on cells when their tapes are at most CELLS_PAY_SHARE of
    the tape's records (a 60-sphere program's keep a few percent), else on the tape itself: the
    same bits either way."""
    from taperay.runtime import pruned_march
    from taperay.runtime.shading import RenderSettings
    from taperay.scenegraph.vm import load_vm
    from taperay.tools.bench_prune import spheres_program
    tape = load_vm(spheres_program(60, seed=2))
    assert pruned_march.cells_shorten(tape, RenderSettings().pack(tape, "shade")) < 0.5
    calls = []
    marched = pruned_march.march_pruned
    monkeypatch.setattr(pruned_march, "march_pruned", lambda *a, **k: calls.append(1) or marched(*a, **k))
    monkeypatch.setattr(pruned_march, "CELLS_PAY_SHARE", share)
    cam = auto_camera(tape.bounds)
    image = walker_cpu.render(tape, cam, 32, 24, settings=EXACT)
    assert bool(calls) == on_cells
    np.testing.assert_array_equal(image, walker_cpu.render(tape, cam, 32, 24, cells=None, settings=EXACT))
