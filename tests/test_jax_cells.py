"""The JAX walker's cell form (runtime/jax_cells.py): each cell of points runs only the records
that can matter there. Its values, materials and derivatives equal the unpruned generic form's
(and agree with the twin and with its central differences); edits of parameters and of the
topology inside a bucket compile nothing; tapes without a Lipschitz bound run the generic form."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("jax")

from taperay.runtime import conformance as C                          # noqa: E402
from taperay.runtime import jax_cells                                 # noqa: E402
from taperay.runtime.jax_walker import JaxWalker, cells_unsupported, compile_stats  # noqa: E402
from taperay.runtime.opcodes import Op                                # noqa: E402
from taperay.scenegraph import (Param, box, capsule, ellipsoid, flatten, smooth_union, sphere,  # noqa: E402
                                torus, union)


def _scene(parts: int = 12, seed: int = 3, variant: int | None = None, blended: int | None = None):
    """Moved spheres, boxes and capsules blended in pairs and unioned (flatten adds culled
    unions); ``variant`` k: part k a torus (a topology edit); ``blended`` n: only the first n
    pairs blended, the other parts unioned alone (fewer steps, the same parameters)."""
    rng = np.random.default_rng(seed)
    nodes = []
    for i in range(parts):
        r = Param(f"r{i}", float(rng.uniform(0.15, 0.3)))
        kind = i % 3
        shape = (torus(r, 0.05) if variant == i else sphere(r) if kind == 0 else box(r, 0.15, 0.1) if kind == 1
                 else capsule((0, 0, -0.1), (0, 0, 0.1), r))
        nodes.append(shape.translate(*rng.uniform(-1.5, 1.5, 3)))
    pairs = [smooth_union(a, b, k=0.1) for a, b in zip(nodes[0::2], nodes[1::2])]
    if blended is None:
        return union(*pairs)
    return union(*pairs[:blended], *nodes[2 * blended:])


def _lattice(tape, n=16, jitter=0.0, seed=0):
    lo, hi = tape.bounds
    axes = [np.linspace(lo[k], hi[k], n, dtype=np.float32) for k in range(3)]
    pts = np.stack(np.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3)
    if jitter:
        pts = pts + np.random.default_rng(seed).uniform(-jitter, jitter, pts.shape).astype(np.float32)
    return pts


@pytest.fixture(scope="module")
def walker_cells():
    """Cells of about 64 points (many cells on a few thousand points) in pieces of 512."""
    return JaxWalker(form="cells", cell_layout=jax_cells.CellLayout(cell_points=64, piece=512, per_call=16))


@pytest.fixture(scope="module")
def walker_generic():
    return JaxWalker(form="generic")


def test_cells_prune_and_equal_the_generic_form(walker_cells, walker_generic, walker_cpu):
    tape = flatten(_scene(), source="blended pairs")
    pts = _lattice(tape, 16, jitter=0.05)
    assert walker_cells.form_for(tape, True, len(pts)) == "cells"
    d, m = walker_cells.evaluate(tape, pts)
    plan = walker_cells.cells_plan
    n_steps = plan.n_steps
    assert plan.n_cells > 20 and plan.kept.min() < 0.5 * n_steps and plan.kept.mean() < 0.9 * n_steps   # it prunes
    gd, gm = walker_generic.evaluate(tape, pts)
    np.testing.assert_array_equal(d, gd)
    np.testing.assert_array_equal(m, gm)
    assert m.dtype == np.uint32
    # and the twin, within the conformance tolerances
    rd, rm = walker_cpu.evaluate(tape, pts)
    assert C.within_tolerance(rd, d, C.tape_tolerance(tape, C.SCENE_PROPAGATION), 1.0).all()
    assert np.mean(rm != m) <= C.MATERIAL_MAX
    # reverse mode: the values and the weighted pool gradient
    w = np.random.default_rng(1).normal(size=len(pts)).astype(np.float32)
    cv, cp = walker_cells.vjp(tape, pts, w)
    gv, gp = walker_generic.vjp(tape, pts, w)
    np.testing.assert_array_equal(cv, gv)
    np.testing.assert_allclose(cp, gp, rtol=1e-4, atol=1e-4 * np.abs(gp).max())
    # value_and_grad: df/dx, the pool gradient and forward mode per name
    names = ["r0", "r3", "r7"]
    a, b = walker_cells.value_and_grad(tape, pts, weights=w, names=names), \
        walker_generic.value_and_grad(tape, pts, weights=w, names=names)
    np.testing.assert_array_equal(a.value, b.value)
    np.testing.assert_array_equal(a.material, b.material)
    np.testing.assert_allclose(a.dx, b.dx, atol=1e-6)
    np.testing.assert_allclose(a.dpool, b.dpool, rtol=1e-4, atol=1e-4 * np.abs(b.dpool).max())
    for nm in names:
        np.testing.assert_allclose(a.per_point[nm], b.per_point[nm], atol=1e-6, err_msg=nm)
        np.testing.assert_allclose(a.dnamed[nm], b.dnamed[nm], rtol=1e-4, atol=1e-4)
    # unit weights (the default): df/dx read from the weighted sweep itself equals a sweep's with ones
    unit, generic_unit = (w_.value_and_grad(tape, pts, names=names) for w_ in (walker_cells, walker_generic))
    np.testing.assert_array_equal(unit.dx, a.dx)
    np.testing.assert_allclose(unit.dpool, generic_unit.dpool, rtol=1e-4, atol=1e-4 * np.abs(generic_unit.dpool).max())


def test_points_changed_in_place_are_bucketed_again(walker_cells, walker_generic):
    """The points' bucketing is kept by content (loops call with the same points): the same array
    changed in place gives the new points' cells and values, not the kept ones."""
    tape = flatten(_scene(), source="blended pairs")
    pts = _lattice(tape, 16, jitter=0.05)
    w = np.random.default_rng(2).normal(size=len(pts)).astype(np.float32)
    walker_cells.vjp(tape, pts, w)
    pts[:] = pts[::-1] * np.float32(0.5)            # other points, a smaller box: other cells
    cv, cp = walker_cells.vjp(tape, pts, w)
    gv, gp = walker_generic.vjp(tape, pts, w)
    np.testing.assert_array_equal(cv, gv)
    np.testing.assert_allclose(cp, gp, rtol=1e-4, atol=1e-4 * np.abs(gp).max())


def test_point_layout_puts_each_point_in_one_slot_of_its_cells_pieces():
    """Clustered points (cells of many more points than a piece: several pieces a cell): every
    point sits in exactly one valid slot, of a piece of its own cell, with its coordinates; the
    layout is found again for an equal copy of the points and made anew once they change."""
    rng = np.random.default_rng(5)
    pts = np.concatenate([rng.normal(0, 0.05, (3000, 3)), rng.uniform(-1, 1, (2000, 3))]).astype(np.float32)
    lay = jax_cells.point_layout(pts, cell_points=256, piece=64)
    assert np.array_equal(np.sort(lay.point_index), np.arange(len(pts)))
    assert lay.valid.sum() == len(pts) and np.bincount(lay.cell_of).max() > 1
    flat = lay.piece_points.reshape(-1, 3)
    np.testing.assert_array_equal(flat[lay.point_slot], pts[lay.point_index])
    cell = np.empty(len(pts), np.int64)
    cell[lay.order] = np.repeat(np.arange(len(lay.counts)), lay.counts)
    slot_piece = lay.point_slot // 64
    assert np.array_equal(cell[lay.point_index], lay.cell_of[slot_piece])
    assert jax_cells.point_layout(pts.copy(), cell_points=256, piece=64) is lay
    pts[7] += 0.5
    assert jax_cells.point_layout(pts, cell_points=256, piece=64) is not lay


_SPREAD = """
import sys, json
import numpy as np
sys.path.insert(0, sys.argv[1])
import jax
from test_jax_cells import _scene, _lattice
from taperay.runtime.jax_walker import JaxWalker
from taperay.scenegraph import flatten
tape = flatten(_scene(), source="blended pairs")
pts = _lattice(tape, 48, jitter=0.05)
w = np.random.default_rng(1).normal(size=len(pts)).astype(np.float32)
cells, generic = JaxWalker(form="cells"), JaxWalker(form="generic")
(d, m), (gd, gm) = cells.evaluate(tape, pts), generic.evaluate(tape, pts)
(cv, cp), (gv, gp) = cells.vjp(tape, pts, w), generic.vjp(tape, pts, w)
a, b = (x.value_and_grad(tape, pts, weights=w, names=["r0", "r3"]) for x in (cells, generic))
rel = lambda u, v: float(np.abs(u - v).max() / np.abs(v).max())
print(json.dumps({"devices": jax.device_count(), "pieces": len(cells.cells_plan.n_groups),
                  "values": bool(np.array_equal(d, gd) and np.array_equal(cv, gv) and np.array_equal(a.value, gd)),
                  "materials": bool(np.array_equal(m, gm) and np.array_equal(a.material, b.material)),
                  "dpool": max(rel(cp, gp), rel(a.dpool, b.dpool)), "dx": float(np.abs(a.dx - b.dx).max()),
                  "per_point": max(float(np.abs(a.per_point[n] - b.per_point[n]).max()) for n in ("r0", "r3"))}))
"""


@pytest.mark.slow
def test_cells_spread_over_host_devices_equal_the_generic_form():
    """The cell form's pieces split over two host devices (as on a 2-core machine outside the
    suite): the same values, materials and derivatives as the generic form's."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", TAPERAY_JAX_CACHE="0")
    out = subprocess.run([sys.executable, "-c", _SPREAD, str(Path(__file__).parent)], env=env, capture_output=True,
                         text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["devices"] == 2 and got["pieces"] > 2 * jax_cells.CPU_LAYOUT.per_call    # (more than one call)
    assert got["values"] and got["materials"]
    assert got["dpool"] < 1e-4 and got["dx"] < 1e-6 and got["per_point"] < 1e-6


def test_names_swept_in_batches_equal_one_sweep(monkeypatch, walker_cells):
    """Forward tangents of many names in batches (at most TANGENT_FILES_BYTES of row files at once,
    so that every name of a large tape fits a device): the same per-name derivatives as all names
    swept together. One name's files here (8 KiB a row, 128 rows): batches of two."""
    tape = flatten(_scene(), source="blended pairs")
    pts = _lattice(tape, 16, jitter=0.05, seed=4)
    names = ["r0", "r1", "r2", "r5", "r9"]
    whole = walker_cells.value_and_grad(tape, pts, names=names)
    monkeypatch.setattr(jax_cells, "TANGENT_FILES_BYTES", 2 * 4 * 128 * jax_cells.CPU_LAYOUT.piece)
    batched = JaxWalker(form="cells").value_and_grad(tape, pts, names=names)
    np.testing.assert_array_equal(batched.value, whole.value)
    for nm in names:
        np.testing.assert_allclose(batched.per_point[nm], whole.per_point[nm], rtol=1e-6, atol=1e-7, err_msg=nm)


def test_cells_gradients_agree_with_twin_finite_differences(walker_cells, walker_cpu):
    tape = flatten(_scene(), source="blended pairs")
    pts = _lattice(tape, 16, jitter=0.05, seed=2)
    g = walker_cells.value_and_grad(tape, pts, names=["r0", "r1", "r4"])
    h = 1e-3
    for name in ("r0", "r1", "r4"):
        up, down = tape.params.astype(np.float64).copy(), tape.params.astype(np.float64).copy()
        up[tape.names[name]] += h
        down[tape.names[name]] -= h
        fd = (walker_cpu.evaluate(dataclasses.replace(tape, params=up.astype(np.float32), refit=None), pts)[0]
              .astype(np.float64)
              - walker_cpu.evaluate(dataclasses.replace(tape, params=down.astype(np.float32), refit=None), pts)[0]) / (2 * h)
        # per point, away from the kinks (where one-sided differences disagree) ...
        smooth = np.abs(fd) < 2.0
        assert smooth.mean() > 0.95
        close = np.abs(g.per_point[name][smooth] - fd[smooth]) < 3e-3
        assert close.mean() > 0.99, name
        # ... and the total (the sum over the points: kinks are a few points)
        assert abs(g.dnamed[name] - fd.sum()) <= 0.02 * max(1.0, abs(fd.sum())), name


def test_cells_edits_compile_nothing(walker_cells):
    tape = flatten(_scene(), source="blended pairs")
    pts = _lattice(tape, 16)
    w = np.ones(len(pts), np.float32)
    walker_cells.evaluate(tape, pts)
    walker_cells.vjp(tape, pts, w)
    before = compile_stats()["compiles"]
    rng = np.random.default_rng(7)
    for k in range(5):                                   # parameter edits: the pruning changes
        tape.set_param(f"r{k}", float(rng.uniform(0.1, 0.4)))
        walker_cells.evaluate(tape, pts)
        walker_cells.vjp(tape, pts, w)
    for k in (0, 3, 6):                                  # topology edits inside the bucket (sphere -> torus)
        edited = flatten(_scene(variant=k), source="blended pairs")
        walker_cells.evaluate(edited, pts)
        walker_cells.vjp(edited, pts, w)
    assert compile_stats()["compiles"] == before


def test_tapes_without_a_lipschitz_bound_run_the_generic_form(walker_cells, walker_generic):
    tape = C.op_tape(Op.SIN, np.random.default_rng(0))
    assert cells_unsupported(tape)
    assert walker_cells.form_for(tape, True, 10 ** 6) == "generic"
    pts = np.random.default_rng(0).uniform(-1, 1, (500, 3)).astype(np.float32)
    np.testing.assert_array_equal(walker_cells.evaluate(tape, pts)[0], walker_generic.evaluate(tape, pts)[0])
    assert JaxWalker().form_for(flatten(_scene()), True, 10 ** 5) == "cells"
    assert JaxWalker().form_for(flatten(_scene()), True, 100) == "generic"
    assert not cells_unsupported(flatten(smooth_union(sphere(1), box(0.5, 0.5, 0.5).rotate(
        (0, 0, 1), 30).translate(0.5, 0, 0), k=0.2)))


def test_operands_without_a_bound_leave_the_others_pruned(walker_cells, walker_generic):
    """A union whose operands include some without a Lipschitz bound (a pattern, an ellipsoid):
    the result's bound over a cell comes from the others, which still drop where they cannot
    matter; values, materials and gradients equal the unpruned generic form's."""
    rng = np.random.default_rng(8)
    spheres = [sphere(float(r)).translate(*rng.uniform(-1.5, 1.5, 3)) for r in rng.uniform(0.1, 0.25, 12)]
    tape = flatten(union(sphere(Param("r", 0.15)).linear_pattern((0.4, 0, 0), 4).translate(-1, -1, -1),
                         ellipsoid(0.3, 0.2, 0.1).translate(1, 1, 1), *spheres), source="mixed bounds")
    assert {"REPEAT_LINEAR", "ELLIPSOID"} <= set(tape.op_counts())
    assert cells_unsupported(tape) is None
    pts = _lattice(tape, 20, jitter=0.05)
    d, m = walker_cells.evaluate(tape, pts)
    plan = walker_cells.cells_plan
    assert plan.kept.mean() < 0.8 * plan.n_steps                       # it prunes
    gd, gm = walker_generic.evaluate(tape, pts)
    np.testing.assert_array_equal(d, gd)
    np.testing.assert_array_equal(m, gm)
    w = np.random.default_rng(2).normal(size=len(pts)).astype(np.float32)
    (cv, cp), (gv, gp) = walker_cells.vjp(tape, pts, w), walker_generic.vjp(tape, pts, w)
    np.testing.assert_array_equal(cv, gv)
    np.testing.assert_allclose(cp, gp, rtol=1e-4, atol=1e-4 * np.abs(gp).max())


def test_one_piece_cells_as_on_a_gpu_equal_the_generic_form(walker_generic):
    """The accelerator's layout (cells of one piece each, sized by the row-file cap) run here on the
    CPU: 4,096 points in one cell give the generic form's values, materials and pool gradient."""
    tape = flatten(_scene(), source="blended pairs")
    pts = _lattice(tape, 16, jitter=0.05, seed=3)
    layout = jax_cells.CellLayout(cell_points=1 << 18, piece=1 << 18, per_call=1, row_bytes=4 * 4096 * 512)
    assert jax_cells.ACCELERATOR_LAYOUT.row_bytes and jax_cells.layout_for("cpu") is jax_cells.CPU_LAYOUT
    assert jax_cells.layout_for("gpu") is jax_cells.ACCELERATOR_LAYOUT
    assert jax_cells.layout_for("cuda", 80 << 30).piece_for(4096) == 1 << 18     # an 80 GB card: 10 GB a file
    assert layout.piece_for(512) == 4096 and layout.piece_for(513) == 2048 and layout.piece_for(10 ** 9) == 512
    walker = JaxWalker(form="cells", cell_layout=layout)
    w = np.random.default_rng(4).normal(size=len(pts)).astype(np.float32)
    d, m = walker.evaluate(tape, pts)
    assert walker.cells_plan.n_cells * 4096 >= len(pts) and len(walker.cells_plan.n_groups) <= 2
    gd, gm = walker_generic.evaluate(tape, pts)
    np.testing.assert_array_equal(d, gd)
    np.testing.assert_array_equal(m, gm)
    cv, cp = walker.vjp(tape, pts, w)
    gv, gp = walker_generic.vjp(tape, pts, w)
    np.testing.assert_array_equal(cv, gv)
    np.testing.assert_allclose(cp, gp, rtol=1e-4, atol=1e-4 * np.abs(gp).max())


GROUPED = {"small cells": jax_cells.CellLayout(cell_points=64, piece=512, per_call=16, group=8),
           "one piece": jax_cells.CellLayout(cell_points=1 << 18, piece=1 << 18, per_call=1,
                                             row_bytes=4 * 4096 * 512, group=16)}


@pytest.mark.parametrize("layout", list(GROUPED), ids=list(GROUPED))
def test_grouped_steps_equal_the_generic_form(layout, walker_generic, walker_cpu):
    """Steps of one dependency level and one branch run as one group: the plan's groups are
    sound (every kept step once, one branch and level a group, levels ascending) and the results
    are the generic form's (values and materials bit for bit, gradients to summation order)."""
    tape = flatten(_scene(), source="blended pairs")
    pts = _lattice(tape, 16, jitter=0.05, seed=5)
    walker = JaxWalker(form="cells", cell_layout=GROUPED[layout])
    d, m = walker.evaluate(tape, pts)
    plan, G = walker.cells_plan, GROUPED[layout].group
    level, branch = plan.level, plan.branch
    for k in range(len(plan.n_groups)):
        grp = plan.groups[k, :plan.n_groups[k]]
        assert (grp[:, 1] >= 1).all() and (grp[:, 1] <= G).all()
        members = [plan.items[k, s:s + c, 0] for s, c in grp]
        run = np.concatenate(members)
        assert len(run) == len(set(run.tolist())) == grp[:, 1].sum()
        lv = [set(level[mm].tolist()) for mm in members]
        assert all(len(x) == 1 for x in lv) and all(len(set(branch[mm].tolist())) == 1 for mm in members)
        assert [x.pop() for x in lv] == sorted(level[mm[0]] for mm in members)
    assert plan.n_groups.mean() < 0.6 * plan.kept.mean()                 # it groups
    gd, gm = walker_generic.evaluate(tape, pts)
    # (vmapped, XLA may divide by a lane's parameter as a product with its reciprocal: 1 ULP)
    np.testing.assert_array_max_ulp(d, gd, 1)
    np.testing.assert_array_equal(m, gm)
    rd, _ = walker_cpu.evaluate(tape, pts)
    assert C.within_tolerance(rd, d, C.tape_tolerance(tape, C.SCENE_PROPAGATION), 1.0).all()
    w = np.random.default_rng(6).normal(size=len(pts)).astype(np.float32)
    cv, cp = walker.vjp(tape, pts, w)
    gv, gp = walker_generic.vjp(tape, pts, w)
    np.testing.assert_array_equal(cv, d)
    np.testing.assert_allclose(cp, gp, rtol=1e-4, atol=1e-4 * np.abs(gp).max())
    names = ["r1", "r6"]
    a, b = walker.value_and_grad(tape, pts, weights=w, names=names), \
        walker_generic.value_and_grad(tape, pts, weights=w, names=names)
    np.testing.assert_array_equal(a.value, d)
    np.testing.assert_array_equal(a.material, b.material)
    np.testing.assert_allclose(a.dx, b.dx, atol=1e-6)
    np.testing.assert_allclose(a.dpool, b.dpool, rtol=1e-4, atol=1e-4 * np.abs(b.dpool).max())
    for nm in names:
        np.testing.assert_allclose(a.per_point[nm], b.per_point[nm], atol=1e-6, err_msg=nm)


def test_grouped_edits_compile_nothing():
    """Parameter edits, topology edits and a tape of fewer steps inside the bucket: no compile."""
    walker = JaxWalker(form="cells", cell_layout=GROUPED["small cells"])
    tape = flatten(_scene(variant=4, blended=5), source="blended pairs")
    pts = _lattice(tape, 12)
    w = np.ones(len(pts), np.float32)
    walker.evaluate(tape, pts)
    walker.vjp(tape, pts, w)
    walker.value_and_grad(tape, pts, names=["r0"])
    n_steps = walker.cells_plan.n_steps
    before = compile_stats()["compiles"]
    for k in range(3):
        tape.set_param(f"r{k}", 0.1 + 0.1 * k)
        walker.evaluate(tape, pts)
        walker.vjp(tape, pts, w)
    # (all three in one capacity bucket: 64 steps, 128 rows, 128 pool slots)
    for edited in (flatten(_scene(variant=1, blended=5), source="blended pairs"),
                   flatten(_scene(blended=0), source="parts unioned")):
        walker.evaluate(edited, pts)
        walker.vjp(edited, pts, w)
        walker.value_and_grad(edited, pts, names=["r0"])
    assert walker.cells_plan.n_steps < n_steps
    assert compile_stats()["compiles"] == before
