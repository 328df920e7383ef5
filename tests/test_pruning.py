"""Interval evaluation and per-tile pruning on the CPU (runtime.pruning).

* every op's float32 interval contains the float64 reference's values and the CPU twin's float32
  values at points sampled in its operand intervals; it is "may be NaN" wherever the reference
  (runtime.intervals) says so, and its MIN / MAX / AND / OR choices are the reference's;
* pruned tapes give bit-identical values and materials to the full tape at points of their box
  (random arithmetic tapes using every op, and prospero);
* the pruned images and points equal the CPU twin bit for bit, for every model; prospero's sign
  image at 1024^2 matches the reference PNG.
"""
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from PIL import Image

from taperay.runtime import twin
from taperay.runtime.intervals import INTERVAL_OPS, choice
from taperay.runtime.opcodes import OPS, Family, Op
from taperay.runtime.pruning import (evaluate_pruned, field_image_pruned, interval_eval, interval_op,
                                     is_arithmetic, prune, sign_image)
from taperay.runtime.tape import INSTR_DTYPE, Tape, TaperayError, material_array
from taperay.scenegraph.vm import load_vm
from taperay.runtime.shading import RenderSettings

EXACT = RenderSettings(cell_skip=False)   # marches on cells without empty-space skipping: the whole tape's steps

DATA = Path(__file__).parent / "data"
MODELS = ["quarter", "hi", "sphere", "tanglecube", "prospero"]
ARITH = [o for o in Op if OPS[o].family is Family.ARITH]
WITH_OPERANDS = [o for o in ARITH if OPS[o].reads]
F32 = np.float32


def bits(v):
    return np.asarray(v, np.float32).view(np.uint32)


def tape_of(rows, consts, n_regs, bounds=((-2, -2, -2), (2, 2, 2))):
    """rows: (op, dst, a, b, c, param)."""
    ins = np.zeros(len(rows), INSTR_DTYPE)
    for i, r in enumerate(rows):
        for f, v in zip(("op", "dst", "a", "b", "c", "param"), r):
            ins[i][f] = int(v)
    mats = material_array([(0.5, 0.5, 0.5)], 0.5)
    return Tape(ins, np.array(consts or [0.0], np.float32), mats, n_regs, np.array(bounds, np.float32))


# ---------------------------------------------------------------------------------------------
# one op at a time

bound = st.one_of(st.floats(-50, 50, width=32), st.sampled_from([0.0, -1.0, 1.0, 0.5, -0.5, np.pi / 2]))
interval = st.tuples(bound, st.one_of(st.just(0.0), st.floats(0, 0.5, width=32), st.floats(0, 20, width=32))).map(
    lambda cw: (F32(cw[0]), F32(F32(cw[0]) + F32(cw[1]))))
with_inf = st.one_of(interval, st.tuples(st.sampled_from([-np.inf, -1.0, 0.0]), st.sampled_from([0.0, 1.0, np.inf])).map(
    lambda lh: (F32(lh[0]), F32(lh[1]))))


def _samples(iv, rng, n=96):
    lo, hi = (float(v) for v in iv)
    if not (np.isfinite(lo) and np.isfinite(hi)):
        inner = np.clip(rng.normal(0, 1e3, n), lo, hi)
    else:
        inner = rng.uniform(lo, hi, n)
    extra = [lo, hi, min(max(0.0, lo), hi)]                  # the ends, and 0 where inside
    return np.concatenate([extra, inner]).astype(np.float32)


def _op_tape(op):
    """r1 = x, r2 = y, r3 = z; r0 = op(r1, r2, r3): the CPU twin's point values of the op."""
    return tape_of([(Op.VAR_X, 1, 0, 0, 0, 0), (Op.VAR_Y, 2, 0, 0, 0, 0), (Op.VAR_Z, 3, 0, 0, 0, 0),
                    (op, 0, 1, 2, 3, 0)], [0.0], 4)


def _check_op(walker_cpu, op, ivs, seed):
    rng = np.random.default_rng(seed)
    nargs = len(OPS[op].reads)
    ivs = ivs[:nargs] + [(F32(0), F32(0))] * (3 - nargs)
    lo, hi, ch = interval_op(op, *ivs)
    lo, hi, ch = float(lo), float(hi), int(ch)
    ref = [(np.array(a, np.float64), np.array(b, np.float64)) for a, b in ivs]
    with np.errstate(all="ignore"):
        rlo, rhi = INTERVAL_OPS[op](*ref)
    finite = all(np.isfinite(v) for iv in ivs[:nargs] for v in iv)
    if np.isnan(rlo):
        assert np.isnan(lo) and np.isnan(hi), (op.name, ivs, lo, hi)
    if finite:                                    # NaN only where the reference has it
        assert np.isnan(lo) == bool(np.isnan(rlo)), (op.name, ivs, lo, hi, rlo, rhi)
    if op in (Op.MIN, Op.MAX, Op.AND, Op.OR):
        assert ch == int(choice(op, *ref[:2])), (op.name, ivs, ch)
    if np.isnan(lo):
        assert np.isnan(hi)
        return
    assert lo <= hi
    pts = np.stack([_samples(iv, rng) for iv in ivs], 1)
    mixed = pts.copy()
    mixed[:, 0] = pts[rng.permutation(len(pts)), 0]           # other pairings of a with b, c
    pts = np.concatenate([pts, mixed])
    with np.errstate(all="ignore"):
        v64 = OPS[op].reference(*(pts[:, i].astype(np.float64) for i in range(nargs)))
    v32, mat = walker_cpu.evaluate(_op_tape(op), pts)
    for name, v in (("float64 reference", v64), ("CPU twin", v32)):
        assert not np.isnan(v).any(), f"{op.name}: NaN {name} value not flagged by {lo, hi} on {ivs}"
        bad = (v < lo) | (v > hi)
        assert not bad.any(), (op.name, name, ivs, (lo, hi), pts[bad][:3], v[bad][:3])


@pytest.mark.parametrize("op", WITH_OPERANDS, ids=lambda o: o.name)
@settings(max_examples=60, deadline=None)
@given(ivs=st.lists(interval, min_size=3, max_size=3), seed=st.integers(0, 2**32 - 1))
def test_interval_op_contains_sampled_values_and_matches_reference(walker_cpu, op, ivs, seed):
    _check_op(walker_cpu, op, ivs, seed)


@pytest.mark.parametrize("op", WITH_OPERANDS, ids=lambda o: o.name)
@settings(max_examples=25, deadline=None)
@given(ivs=st.lists(with_inf, min_size=3, max_size=3), seed=st.integers(0, 2**32 - 1))
def test_interval_op_with_infinite_bounds(walker_cpu, op, ivs, seed):
    _check_op(walker_cpu, op, ivs, seed)


def test_hidden_nan_cases_are_flagged():
    """Points can be NaN here although the endpoints are not: the evaluator says "may be NaN"."""
    inf = F32(np.inf)
    cases = [(Op.ADD, (F32(1), inf), (-inf, F32(-1))), (Op.SUB, (F32(1), inf), (F32(1), inf)),
             (Op.MUL, (F32(-1), F32(1)), (F32(1), inf)), (Op.TAN, (F32(0), inf), None)]
    for op, a, b in cases:
        lo, hi, _ = interval_op(op, a, b)
        assert np.isnan(lo) and np.isnan(hi), op.name


def test_nan_operands_propagate_as_the_reference_says():
    nan = (F32(np.nan), F32(np.nan))
    one, zero = (F32(1), F32(2)), (F32(0), F32(0))
    assert np.isnan(interval_op(Op.ADD, one, nan)[0])
    assert np.isnan(interval_op(Op.MIN, nan, one)[0]) and interval_op(Op.MIN, nan, one)[2] == 0
    assert interval_op(Op.AND, zero, nan)[:2] == (0, 0)           # a == 0: b never read
    assert np.isnan(interval_op(Op.AND, one, nan)[0])
    lo, hi, ch = interval_op(Op.OR, one, nan)                     # a != 0: value a
    assert (lo, hi, ch) == (1, 2, 1)


@pytest.mark.parametrize("op", WITH_OPERANDS, ids=lambda o: o.name)
def test_may_be_nan_operand_bounds_every_value(walker_cpu, op):
    """An operand whose interval is NaN may hold anything, NaN included: the result interval is
    NaN too, or holds the op's value for every such operand (NOT of NaN is 0, of 0 is 1)."""
    rng = np.random.default_rng(int(op))
    anything = np.array([np.nan, 0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, 1e30, -1e-30], np.float32)
    for slot in range(len(OPS[op].reads)):
        ivs = [(F32(-2), F32(3))] * 3
        ivs[slot] = (F32(np.nan), F32(np.nan))
        lo, hi, _ = interval_op(op, *ivs)
        if np.isnan(lo):
            continue
        pts = rng.uniform(-2, 3, (len(anything), 3)).astype(np.float32)
        pts[:, slot] = anything
        v, _ = walker_cpu.evaluate(_op_tape(op), pts)
        assert not np.isnan(v).any() and np.all((v >= lo) & (v <= hi)), (op.name, slot, (lo, hi), v)


# ---------------------------------------------------------------------------------------------
# random arithmetic tapes

def random_tape(seed, n=40, n_regs=6):
    """An arithmetic tape using every op (registers reused, MIN / MAX frequent)."""
    rng = np.random.default_rng(seed)
    consts = [0.0, 1.0, -1.0, 0.5, 2.0] + list(rng.uniform(-2, 2, 4))
    rows = [(Op.VAR_X, 1, 0, 0, 0, 0), (Op.VAR_Y, 2, 0, 0, 0, 0), (Op.VAR_Z, 3, 0, 0, 0, 0)]
    written = {1, 2, 3}
    pool = [o for o in ARITH if o not in (Op.VAR_X, Op.VAR_Y, Op.VAR_Z)] + [Op.MIN, Op.MAX] * 6 + [Op.AND, Op.OR]
    for i in range(n):
        op = pool[rng.integers(len(pool))]
        dst = 0 if i == n - 1 else int(rng.integers(n_regs))
        a, b, c = (int(rng.choice(sorted(written))) for _ in range(3))
        rows.append((op, dst, a, b, c, rng.integers(len(consts)) if op is Op.CONST else 0))
        written.add(dst)
    return tape_of(rows, consts, n_regs)


def _box_points(lo, hi, rng, n=200):
    corners = np.array([[lo[0] if i & 1 else hi[0], lo[1] if i & 2 else hi[1], lo[2] if i & 4 else hi[2]]
                        for i in range(8)])
    return np.concatenate([corners, rng.uniform(lo, hi, (n, 3))]).astype(np.float32)


def _random_box(rng):
    c = rng.uniform(-1.5, 1.5, 3)
    w = rng.choice([0.0, 0.01, 0.1, 0.5, 2.0]) * rng.uniform(0, 1, 3)
    return (c - w).astype(np.float32), (c + w).astype(np.float32)


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_random_tape_interval_contains_values_and_pruning_is_exact(walker_cpu, seed):
    rng = np.random.default_rng(seed)
    tape = random_tape(seed)
    for _ in range(4):
        lo, hi = _random_box(rng)
        ilo, ihi, ch, sides = interval_eval(tape, lo, hi)
        pts = _box_points(lo, hi, rng)
        v, m = walker_cpu.evaluate(tape, pts)
        if not np.isnan(ilo[0]):
            assert not np.isnan(v).any() and np.all(v >= ilo[0]) and np.all(v <= ihi[0]), (seed, lo, hi)
        sibling = prune(tape, ch[0])
        short = prune(tape, ch[0], sides[0])
        assert len(short) <= len(sibling) <= len(tape)
        for t in (sibling, short):
            pv, pm = walker_cpu.evaluate(t, pts)
            np.testing.assert_array_equal(bits(pv), bits(v))
            np.testing.assert_array_equal(pm, m)


def test_pruning_shortens_and_keeps_registers():
    # r0 = max(x, 1): decided on x < 1 (CHOICE_B: COPY r0 <- r1) and x >= 1 (CHOICE_A: r0 <- r2)
    tape = tape_of([(Op.VAR_X, 2, 0, 0, 0, 0), (Op.CONST, 1, 0, 0, 0, 0), (Op.VAR_Y, 3, 0, 0, 0, 0),
                    (Op.SQUARE, 3, 3, 0, 0, 0), (Op.MAX, 0, 2, 1, 0, 0)], [1.0], 4)
    lo, hi, ch, _ = interval_eval(tape, [[-1, 0, 0], [2, 0, 0], [0, 0, 0]], [[0.5, 1, 0], [3, 1, 0], [2, 1, 0]])
    assert ch[:, 4].tolist() == [2, 1, 0]
    below, above, both = (prune(tape, c) for c in ch)
    assert below.instrs[["op", "dst", "a"]].tolist() == [(Op.CONST, 1, 0), (Op.COPY, 0, 1)]
    assert above.instrs[["op", "dst", "a"]].tolist() == [(Op.VAR_X, 2, 0), (Op.COPY, 0, 2)]
    assert both.instrs["op"].tolist() == [Op.VAR_X, Op.CONST, Op.MAX]      # the dead SQUARE goes
    assert below.n_regs == tape.n_regs and below.params[0] == 1.0


def _union_tape(op, read_twice=False):
    """r0 = op(op(a, b), c) with s = 1 for MIN, -1 for MAX: a = 10 s x, b = s (y + 5), c = s (y + 1).
    Over x, y in [0, 1] the inner op keeps both a and b, and the outer op both of its operands,
    yet b never decides r0: the union's bound (MIN: r0 <= 2; MAX: r0 >= -2) lies beyond b.
    read_twice: r0 += the inner op's value, which then matters beyond the union."""
    s = 1.0 if op == Op.MIN else -1.0
    rows = [(Op.VAR_X, 1, 0, 0, 0, 0), (Op.CONST, 2, 0, 0, 0, 0), (Op.MUL, 1, 1, 2, 0, 0),     # a
            (Op.VAR_Y, 3, 0, 0, 0, 0), (Op.CONST, 4, 0, 0, 0, 1), (Op.ADD, 4, 3, 4, 0, 0),
            (Op.CONST, 5, 0, 0, 0, 2), (Op.MUL, 4, 4, 5, 0, 0),                                # b
            (op, 1, 1, 4, 0, 0),                                                               # inner
            (Op.CONST, 4, 0, 0, 0, 3), (Op.ADD, 3, 3, 4, 0, 0), (Op.MUL, 3, 3, 5, 0, 0),       # c
            (op, 0, 1, 3, 0, 0)]
    if read_twice:
        rows.append((Op.ADD, 0, 0, 1, 0, 0))
    return tape_of(rows, [10 * s, 5.0, s, 1.0], 6)


@pytest.mark.parametrize("op", [Op.MIN, Op.MAX])
def test_the_union_bound_drops_what_never_decides_the_union(walker_cpu, op):
    tape = _union_tape(op)
    lo, hi, ch, sides = interval_eval(tape, [0, 0, 0], [1, 1, 0])
    assert ch[0, 8] == ch[0, 12] == 0                       # the sibling rule keeps every operand
    assert len(prune(tape, ch[0])) == len(tape)
    short = prune(tape, ch[0], sides[0])
    # b's records (its CONST 5, ADD, MUL) go; the inner op becomes r1 <- r1 and goes too
    assert short.instrs["op"].tolist() == [Op.VAR_X, Op.CONST, Op.MUL, Op.VAR_Y, Op.CONST, Op.CONST, Op.ADD,
                                           Op.MUL, op]
    # read twice, the inner op's value matters beyond the union: b stays
    twice = _union_tape(op, read_twice=True)
    _, _, ch2, sides2 = interval_eval(twice, [0, 0, 0], [1, 1, 0])
    kept = prune(twice, ch2[0], sides2[0])
    assert len(kept) == len(twice)
    pts = _box_points(np.zeros(3, np.float32), np.array([1, 1, 0], np.float32), np.random.default_rng(1), 400)
    for full, pruned in ((tape, short), (twice, kept)):
        np.testing.assert_array_equal(bits(walker_cpu.evaluate(pruned, pts)[0]), bits(walker_cpu.evaluate(full, pts)[0]))


@pytest.mark.parametrize("seed", range(3))
def test_prospero_pruned_tapes_are_exact_in_their_tiles(walker_cpu, seed):
    tape = load_vm(DATA / "prospero.vm")
    rng = np.random.default_rng(seed)
    size = [0.5, 0.1, 0.02][seed]
    c = rng.uniform(-1, 1 - size, (6, 3)).astype(np.float32)
    c[:, 2] = 0
    step = np.array([size, size, 0], np.float32)
    lo, hi, ch, sides = interval_eval(tape, c, c + step)
    for k in range(len(c)):
        short, sibling = prune(tape, ch[k], sides[k]), prune(tape, ch[k])
        assert len(short) <= len(sibling) < len(tape)
        assert size < 0.5 or len(short) < len(sibling)     # tiles a quarter of the image: the union rule drops more
        pts = _box_points(c[k], c[k] + step, rng, 300)
        v, m = walker_cpu.evaluate(tape, pts)
        pv, pm = walker_cpu.evaluate(short, pts)
        np.testing.assert_array_equal(bits(pv), bits(v))
        np.testing.assert_array_equal(pm, m)
        assert np.all(v >= lo[k]) and np.all(v <= hi[k])


# ---------------------------------------------------------------------------------------------
# images and points against the CPU twin

@pytest.mark.parametrize("model", MODELS)
def test_models_field_and_sign_images_equal_the_cpu_twin(walker_cpu, model):
    tape = load_vm(DATA / f"{model}.vm")
    w, h, rect, z = 150, 97, (-1.1, 1.05, -0.95, 1.2), 0.3 if model in ("sphere", "tanglecube") else 0.0
    ref = walker_cpu.field_image(tape, w, h, rect, z)
    for tiles in [(256, 64, 16, 4), (32, 8), (16,)]:
        f = field_image_pruned(tape, w, h, rect, z, tiles=tiles)
        np.testing.assert_array_equal(bits(f), bits(ref))
        np.testing.assert_array_equal(sign_image(tape, w, h, rect, z, tiles=tiles), ref < 0)


def test_random_tapes_images_and_points_equal_the_cpu_twin(walker_cpu):
    rng = np.random.default_rng(5)
    for seed in range(12):
        tape = random_tape(seed, n=80)            # longer than PRUNE_MIN_RECORDS: voxels
        ref = walker_cpu.field_image(tape, 40, 33, (-2, 2, -1.5, 1.7), 0.25)
        f = field_image_pruned(tape, 40, 33, (-2, 2, -1.5, 1.7), 0.25, tiles=(16, 4))
        np.testing.assert_array_equal(bits(f), bits(ref))
        np.testing.assert_array_equal(sign_image(tape, 40, 33, (-2, 2, -1.5, 1.7), 0.25, tiles=(16, 4)), ref < 0)
        pts = rng.uniform(-2.5, 2.5, (3000, 3)).astype(np.float32)
        pts[::50] = np.round(pts[::50])                     # zeros and ties
        d, m = evaluate_pruned(tape, pts, grid=4)
        rd, rm = walker_cpu.evaluate(tape, pts)
        np.testing.assert_array_equal(bits(d), bits(rd))
        np.testing.assert_array_equal(m, rm)


@pytest.mark.parametrize("model", ["sphere", "tanglecube", "prospero"])
def test_models_evaluate_pruned_equals_the_cpu_twin(walker_cpu, model):
    tape = load_vm(DATA / f"{model}.vm")
    pts = np.random.default_rng(1).uniform(-1.3, 1.3, (20000, 3)).astype(np.float32)
    pts[:3] = [np.nan, 0, 0], [np.inf, 0, 0], [0, 0, -np.inf]
    d, m = evaluate_pruned(tape, pts)
    rd, rm = walker_cpu.evaluate(tape, pts)
    np.testing.assert_array_equal(bits(d), bits(rd))
    np.testing.assert_array_equal(m, rm)


def test_prospero_sign_image_matches_the_reference_png():
    """Pixel centres of the PNG are linspace(-1, 1, 1024): the rect is widened by half a step."""
    ref = np.asarray(Image.open(DATA / "prospero_1024.png")) == 255
    n = 1024
    h = 1.0 / (n - 1)
    stats = {}
    inside = sign_image(load_vm(DATA / "prospero.vm"), n, n, rect=(-1 - h, 1 + h, -1 - h, 1 + h), stats=stats)
    assert inside.shape == (n, n) and inside.dtype == bool
    differ = inside != ref
    assert differ.mean() <= 1e-4, int(differ.sum())
    if differ.any():                                      # only where f is at float32 rounding
        from test_vm import eval_ssa
        xs = np.linspace(-1, 1, n)
        X, Y = np.meshgrid(xs, -xs)
        pts = np.stack([X[differ], Y[differ], np.zeros(differ.sum())], 1)
        assert np.all(np.abs(eval_ssa((DATA / "prospero.vm").read_text(), pts)) < 1e-5)
    lengths = [lv["mean_length"] for lv in stats["levels"]]
    assert stats["image"] <= stats["records"] and all(a > b for a, b in zip(lengths, lengths[1:]))


# ---------------------------------------------------------------------------------------------
# fallback and errors

def _sphere_tape():
    ins = np.zeros(1, INSTR_DTYPE)
    ins[0]["op"] = Op.SPHERE
    return Tape(ins, np.array([0.7], np.float32), material_array([(0.5, 0.5, 0.5)], 0.5), 1,
                np.array([[-1, -1, -1], [1, 1, 1]], np.float32))


def test_non_arithmetic_tapes_fall_back_to_the_unpruned_walker(walker_cpu):
    tape = _sphere_tape()
    assert not is_arithmetic(tape) and is_arithmetic(load_vm(DATA / "quarter.vm"))
    ref = walker_cpu.field_image(tape, 20, 20)
    np.testing.assert_array_equal(bits(field_image_pruned(tape, 20, 20)), bits(ref))
    np.testing.assert_array_equal(sign_image(tape, 20, 20), ref < 0)
    pts = np.random.default_rng(0).uniform(-1, 1, (100, 3))
    for got, want in zip(evaluate_pruned(tape, pts), walker_cpu.evaluate(tape, pts)):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(TaperayError, match="non-arithmetic"):
        interval_eval(tape, [0, 0, 0], [1, 1, 1])


def test_bad_arguments_raise_taperay_errors():
    tape = load_vm(DATA / "quarter.vm")
    for bad in [dict(tiles=(4, 16)), dict(tiles=(0,)), dict(tiles=())]:
        with pytest.raises(TaperayError):
            sign_image(tape, 8, 8, **bad)
    with pytest.raises(TaperayError):
        field_image_pruned(tape, 0, 8)
    with pytest.raises(TaperayError):
        evaluate_pruned(tape, np.zeros((4, 2)))
    with pytest.raises(TaperayError):
        prune(tape, np.zeros(3, np.uint8))
    with pytest.raises(TaperayError, match="sides"):
        prune(tape, np.zeros(len(tape), np.uint8), np.zeros((len(tape), 2), np.float32))
    with pytest.raises(TaperayError):
        interval_op(Op.VAR_X, (0, 1))


# -- the 3D march ------------------------------------------------------------------------------
def _same_march(a, b):
    return all(np.array_equal(a[k], b[k], equal_nan=True) for k in ("t", "hit", "steps", "mat", "grad", "normal"))


@pytest.mark.parametrize("model", ["sphere.vm", "tanglecube.vm"])
@pytest.mark.parametrize("view", ["shade", "section"])
@pytest.mark.parametrize("levels", [1, 2])
def test_march_pruned_is_the_twins_march_bit_for_bit(walker_cpu, model, view, levels):
    from taperay.runtime.camera import auto_camera
    from taperay.runtime.pruning import march_pruned
    tape = load_vm(DATA / model)
    cam = auto_camera(tape.bounds)
    assert _same_march(walker_cpu.march(tape, cam, 40, 30, view=view),
                       march_pruned(tape, cam, 40, 30, EXACT, view=view, grid=5, levels=levels))


def test_march_pruned_of_a_long_program_prunes_and_stays_exact(walker_cpu):
    from taperay.runtime.camera import auto_camera
    from taperay.runtime.pruning import CellTapes, march_pruned
    from taperay.tools.bench_prune import spheres_program
    tape = load_vm(spheres_program(60, seed=2))
    cam = auto_camera(tape.bounds)
    a = walker_cpu.march(tape, cam, 48, 36)
    assert a["hit"].mean() > 0.05
    assert _same_march(a, march_pruned(tape, cam, 48, 36, EXACT, levels=1))
    assert _same_march(a, march_pruned(tape, cam, 48, 36, EXACT))
    cells = CellTapes(tape, tape.bounds[0], tape.bounds[1], 4)
    mins = tape.instrs["op"] == Op.MIN
    assert (cells.choices[mins, :-1] != 0).mean() > 0.5   # most MIN records decided in most cells
    assert not cells.choices[:, -1].any()                  # outside the grid: the whole tape
    fine = CellTapes(tape, tape.bounds[0], tape.bounds[1], 4, levels=2)
    lengths, fine_lengths = cells.end - cells.first, fine.end - fine.first
    assert len(fine_lengths) == 4 ** 3 * 64 + 1 and fine_lengths[-1] == lengths[-1]
    assert fine_lengths[:-1].mean() < 0.5 * lengths[:-1].mean()   # sub-cells prune further
    with pytest.raises(TaperayError):
        march_pruned(tape, cam, 8, 8, levels=3)


@pytest.mark.parametrize("seed", range(4))
def test_march_pruned_of_random_tapes(walker_cpu, seed):
    from taperay.runtime.camera import auto_camera
    from taperay.runtime.pruning import march_pruned
    tape = random_tape(seed)
    cam = auto_camera(tape.bounds)
    a = walker_cpu.march(tape, cam, 32, 24)
    assert _same_march(a, march_pruned(tape, cam, 32, 24, EXACT, grid=3))
    assert _same_march(a, march_pruned(tape, cam, 32, 24, EXACT))


@pytest.mark.parametrize("op", [Op.SIN, Op.COS, Op.TAN, Op.ASIN, Op.ACOS, Op.ATAN, Op.EXP, Op.LN])
def test_unary_intervals_do_not_read_the_b_register(op):
    """A unary op's b field may name a register holding anything (in a pruned tape, one never
    written): a NaN there must not make the result "may be NaN"."""
    nan = (np.float32(np.nan), np.float32(np.nan))
    a = (np.float32(0.25), np.float32(0.5))
    lo, hi, _ = interval_op(op, a, b=nan)
    assert (lo, hi) == tuple(interval_op(op, a, b=a)[:2]) and not np.isnan(lo) and not np.isnan(hi)
    assert np.isnan(interval_op(Op.ATAN2, a, b=nan)[0])


def test_sub_cell_tapes_are_deterministic():
    """The sub-cells are pruned in a lengths pass and a writing pass that must agree."""
    from taperay.runtime.pruning import CellTapes
    tape = random_tape(3)
    lo, hi = tape.bounds[0] - 1.3, tape.bounds[1] + 1.3
    a, b = CellTapes(tape, lo, hi, 3, levels=2), CellTapes(tape, lo, hi, 3, levels=2)
    assert np.array_equal(a.first, b.first) and np.array_equal(a.fcode, b.fcode)


def test_twin_render_marches_long_arithmetic_tapes_on_cells(walker_cpu, monkeypatch):
    """CpuWalker.render(cells="auto") takes march_pruned for a long arithmetic tape (the same
    image as cells=None), the plain march for a short one; bad cells are TaperayErrors."""
    from taperay.runtime import pruned_march
    from taperay.tools.bench_prune import spheres_program
    calls = []
    real = pruned_march.march_pruned
    monkeypatch.setattr(pruned_march, "march_pruned", lambda *a, **k: calls.append(k) or real(*a, **k))
    tape = load_vm(spheres_program(20, seed=1))
    for view in ("shade", "normals"):
        np.testing.assert_array_equal(walker_cpu.render(tape, None, 40, 30, view=view, settings=EXACT),
                                      walker_cpu.render(tape, None, 40, 30, view=view, cells=None, settings=EXACT))
    assert len(calls) == 2
    np.testing.assert_array_equal(walker_cpu.render(tape, None, 40, 30, cells=(3, 1), settings=EXACT),
                                  walker_cpu.render(tape, None, 40, 30, cells=None, settings=EXACT))
    assert calls[-1] == dict(grid=3, levels=1)
    walker_cpu.render(load_vm(DATA / "sphere.vm"), None, 16, 12)     # short: the plain march
    assert len(calls) == 3
    with pytest.raises(TaperayError):
        walker_cpu.render(tape, None, 8, 8, cells="yes")


@pytest.mark.parametrize("shadows", ["hard", "soft"])
@pytest.mark.parametrize("view", ["shade", "section"])
def test_light_pruned_is_the_twins_light_pass_bit_for_bit(walker_cpu, shadows, view):
    from taperay.runtime.camera import auto_camera
    from taperay.runtime.pruning import light_pruned, march_pruned
    from taperay.runtime.shading import RenderSettings
    from taperay.tools.bench_prune import spheres_program
    tape = load_vm(spheres_program(60, seed=2))
    cam = auto_camera(tape.bounds)
    settings = RenderSettings(shadows=shadows, cell_skip=False)
    packed = settings.pack(tape, view)
    mr = march_pruned(tape, cam, 40, 30, settings, view)
    ref = twin.light_pass(tape, packed, mr)
    got = light_pruned(tape, packed, mr)
    assert (ref["shadow"] < 1).sum() >= 10 and (ref["ao"] < 1).sum() >= 10   # (shadows and occlusion to compare)
    for k in ("shadow", "ao"):
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)
    image = walker_cpu.render(tape, cam, 40, 30, view, settings)      # (cells="auto": pruned)
    np.testing.assert_array_equal(image, walker_cpu.render(tape, cam, 40, 30, view, settings, cells=None))


# -- empty-space skipping on cells (RenderSettings.cell_skip) ---------------------------------------
def _skipping_march(tape, cam, w, h, monkeypatch, **kw):
    """march_pruned with cell_skip on, recording every skip (o, d, t, skip_to) and how many field
    values the cells computed."""
    from taperay.runtime import pruning
    skips, values = [], [0]
    real_skip, real_eval = pruning.CellTapes.skip_to, pruning.CellTapes.evaluate

    def skip_to(self, o, d, t, live, pts, eps, scale, cone=0.0):
        to = real_skip(self, o, d, t, live, pts, eps, scale, cone)
        rows = live[to >= 0]
        skips.append((o[np.zeros(rows.size, np.int64)] if len(o) == 1 else o[rows], d[rows], t[rows].copy(),
                      to[to >= 0]))
        return to

    def evaluate(self, pts):
        values[0] += len(pts)
        return real_eval(self, pts)
    monkeypatch.setattr(pruning.CellTapes, "skip_to", skip_to)
    monkeypatch.setattr(pruning.CellTapes, "evaluate", evaluate)
    settings = RenderSettings(cell_skip=kw.pop("skip", True), hit_cone=kw.pop("cone", 0.0))
    out = pruning.march_pruned(tape, cam, w, h, settings, **kw)
    return out, skips, values[0]


@pytest.mark.parametrize("levels", [1, 2])
def test_cell_skipping_passes_no_hit_and_keeps_the_surface(walker_cpu, monkeypatch, levels):
    """Every stretch of ray a skip jumps over lies in cells proven empty: the field, sampled
    densely along it, is at least hit_eps everywhere (rounding aside), so no hit is passed; the
    image keeps the unskipped march's hits (silhouettes aside) and depths within conformance's
    tolerance, with far fewer field values."""
    from taperay.runtime import conformance as C
    from taperay.runtime.camera import auto_camera
    from taperay.tools.bench_prune import spheres_program
    tape = load_vm(spheres_program(60, seed=2))
    cam = auto_camera(tape.bounds)
    eps = float(RenderSettings().pack(tape)[1])
    ref, _, ref_values = _skipping_march(tape, cam, 48, 36, monkeypatch, skip=False, levels=levels)
    got, skips, values = _skipping_march(tape, cam, 48, 36, monkeypatch, levels=levels)
    o, d, t, to = (np.concatenate(x) for x in zip(*skips))
    assert len(t) > 400 and (to > t).all()
    f = np.linspace(0, 1, 33, dtype=np.float32)
    seg = (o[:, None] + (t[:, None] + f * (to - t)[:, None])[..., None] * d[:, None]).reshape(-1, 3)
    assert walker_cpu.evaluate(tape, seg)[0].min() >= eps * (1 - 1e-3)
    assert (ref["hit"] != got["hit"]).mean() <= C.HIT_MASK_MAX and ref["hit"].mean() > 0.05
    both = ref["hit"] & got["hit"]
    assert np.abs(ref["t"][both] - got["t"][both]).max() <= C.DEPTH_TOL_EPS * eps
    assert values < (0.6 if levels == 2 else 1.0) * ref_values   # (4^3 cells alone prove little empty)


def test_a_skip_over_cells_that_hold_the_surface_is_caught(walker_cpu, monkeypatch):
    """The check above fails for a wrong rule: skipping every cell whose interval was evaluated
    (any lower bound, not one of at least hit_eps) passes points where f < hit_eps."""
    from taperay.runtime import pruning
    from taperay.runtime.camera import auto_camera
    from taperay.tools.bench_prune import spheres_program
    tape = load_vm(spheres_program(60, seed=2))
    cam = auto_camera(tape.bounds)
    eps = float(RenderSettings().pack(tape)[1])
    real = pruning.CellTapes.skip_to
    monkeypatch.setattr(pruning.CellTapes, "skip_to",
                        lambda self, o, d, t, live, p, e, s, c=0.0: real(self, o, d, t, live, p, np.float32(-np.inf), s, c))
    _, skips, _ = _skipping_march(tape, cam, 48, 36, monkeypatch)
    o, d, t, to = (np.concatenate(x) for x in zip(*skips))
    f = np.linspace(0, 1, 33, dtype=np.float32)
    seg = (o[:, None] + (t[:, None] + f * (to - t)[:, None])[..., None] * d[:, None]).reshape(-1, 3)
    assert walker_cpu.evaluate(tape, seg)[0].min() < eps


def test_cell_skipping_steps_do_not_hang_on_the_entrys_last_bits(monkeypatch):
    """A ray enters the march on the grid's face, so its first point's cell index is -1 or 0 by
    the last bit of the entry's t (the GPU's division may round it otherwise: Vulkan allows 2.5
    ulp). The lookup clamps such an index to the boundary cell, whose grown box decides: entries
    moved by up to 4 ulp take the same steps (without the clamp 11 % of these pixels did not)."""
    from taperay.runtime import pruned_march
    from taperay.runtime.camera import auto_camera
    from taperay.tools.bench_prune import spheres_program
    tape = load_vm(spheres_program(60, seed=2))
    cam = auto_camera(tape.bounds)
    base = pruned_march.march_pruned(tape, cam, 48, 36, RenderSettings())
    real, rng = pruned_march.ray_slabs, np.random.default_rng(1)

    def moved_slabs(ro, rd, box):
        t, tfar = real(ro, rd, box)
        bits = t.view(np.int32).copy()
        bits[t > 0] += rng.integers(-4, 5, int((t > 0).sum())).astype(np.int32)
        return bits.view(np.float32), tfar
    monkeypatch.setattr(pruned_march, "ray_slabs", moved_slabs)
    moved = pruned_march.march_pruned(tape, cam, 48, 36, RenderSettings())
    assert (base["t"] > 0).any()
    assert (moved["steps"] == base["steps"]).mean() >= 0.999
    np.testing.assert_array_equal(moved["hit"], base["hit"])


def test_a_hit_cone_ends_rays_at_the_cones_width_on_both_marches(walker_cpu, monkeypatch):
    """RenderSettings.hit_cone: a primary ray hits where f < max(hit_eps, hit_cone t). The twin's
    march and march_pruned (cells without skipping) agree bit for bit; every hit lies within the
    cone's threshold and every pixel hit without the cone is hit with it, in fewer steps or as
    many. With cell skipping, the skipped stretches hold no point below the threshold at its t."""
    from taperay.runtime import pruning
    from taperay.runtime.camera import auto_camera
    from taperay.tools.bench_prune import spheres_program
    tape = load_vm(spheres_program(60, seed=2))
    cam = auto_camera(tape.bounds)
    cone = RenderSettings(hit_cone=0.004, cell_skip=False)
    eps = float(cone.pack(tape)[1])
    plain = walker_cpu.march(tape, cam, 48, 36, RenderSettings(cell_skip=False))
    got = walker_cpu.march(tape, cam, 48, 36, cone)
    cells = pruning.march_pruned(tape, cam, 48, 36, cone)
    for k in ("t", "hit", "steps"):
        np.testing.assert_array_equal(cells[k], got[k])
    assert (got["hit"] >= plain["hit"]).all() and got["hit"].sum() > plain["hit"].sum()
    assert (got["steps"] <= plain["steps"]).all() and got["steps"].sum() < plain["steps"].sum()
    hit = got["hit"]
    pts = (np.asarray(got["eye"], np.float32) + got["t"][hit][:, None]
           * np.asarray(got["dirs"], np.float32).reshape(36, 48, 3)[hit]).astype(np.float32)
    f = walker_cpu.evaluate(tape, pts)[0]
    assert (f < np.maximum(eps, 0.004 * got["t"][hit])).all()
    with pytest.raises(TaperayError, match="hit_cone"):
        RenderSettings(hit_cone=-0.1)

    out, skips, _ = _skipping_march(tape, cam, 48, 36, monkeypatch, cone=0.004)
    o, d, t, to = (np.concatenate(x) for x in zip(*skips))
    assert len(t) > 100
    s = np.linspace(0, 1, 33, dtype=np.float32)
    ts = t[:, None] + s * (to - t)[:, None]
    seg = (o[:, None] + ts[..., None] * d[:, None]).reshape(-1, 3)
    thr = np.maximum(eps, np.float32(0.004) * ts.reshape(-1))
    assert (walker_cpu.evaluate(tape, seg)[0] >= thr * (1 - 1e-3)).all()
    assert (out["hit"] >= plain["hit"]).all()
