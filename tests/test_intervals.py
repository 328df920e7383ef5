"""The interval reference table: every op's bounds contain densely sampled values (hypothesis),
and the min/max/and/or choices are right wherever they claim one operand."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from taperay.runtime.intervals import CHOICE_A, CHOICE_B, INTERVAL_OPS, choice
from taperay.runtime.opcodes import OPS, Op

finite = st.floats(-50, 50, allow_nan=False, allow_infinity=False)
widths = st.one_of(st.just(0.0), st.floats(0, 0.5), st.floats(0, 20))
interval = st.tuples(st.one_of(finite, st.sampled_from([0.0, -1.0, 1.0, np.pi / 2])), widths).map(
    lambda cw: (np.float64(cw[0]), np.float64(cw[0] + cw[1])))


def samples(iv, rng, n=257):
    return np.concatenate([[iv[0], iv[1]], rng.uniform(iv[0], iv[1], n)])


@pytest.mark.parametrize("op", sorted(INTERVAL_OPS, key=int), ids=lambda o: o.name)
@settings(max_examples=150, deadline=None)
@given(ivs=st.tuples(interval, interval, interval), seed=st.integers(0, 2**32 - 1))
def test_interval_contains_sampled_values(op, ivs, seed):
    rng = np.random.default_rng(seed)
    nargs = len(OPS[op].reads)
    args = [(np.array(lo), np.array(hi)) for lo, hi in ivs[:nargs]]
    lo, hi = INTERVAL_OPS[op](*args, *[None] * (3 - nargs))
    xs = [samples(a, rng) for a in args]
    with np.errstate(all="ignore"):
        v = OPS[op].reference(*xs)
    if np.isnan(lo) or np.isnan(hi):     # "may be NaN": contains everything
        assert np.isnan(lo) and np.isnan(hi)
        return
    assert not np.isnan(v).any(), f"{op.name}: NaN sample not flagged by {lo, hi}"
    assert lo <= hi
    assert np.all(v >= lo) and np.all(v <= hi), (op.name, args, lo, hi, v.min(), v.max())


@pytest.mark.parametrize("op", [Op.MIN, Op.MAX, Op.AND, Op.OR], ids=lambda o: o.name)
@settings(max_examples=200, deadline=None)
@given(a=interval, b=interval, seed=st.integers(0, 2**32 - 1))
def test_choices_pick_the_operand_that_equals_the_result(op, a, b, seed):
    rng = np.random.default_rng(seed)
    a, b = (np.array(a[0]), np.array(a[1])), (np.array(b[0]), np.array(b[1]))
    pick = choice(op, a, b)
    xa, xb = samples(a, rng), samples(b, rng)
    v = OPS[op].reference(xa, xb)
    if pick == CHOICE_A:
        np.testing.assert_array_equal(v, xa)
    elif pick == CHOICE_B:
        np.testing.assert_array_equal(v, xb)


def test_every_arithmetic_op_with_inputs_has_an_interval_rule():
    arith = {o for o, s in OPS.items() if s.family.value == "arith" and s.reads}
    assert arith <= set(INTERVAL_OPS)


@pytest.mark.parametrize("op, args, point", [
    (Op.ADD, [(1.0, np.inf), (-np.inf, -1.0)], [np.inf, -np.inf]),
    (Op.MUL, [(-1.0, 1.0), (1.0, np.inf)], [0.0, np.inf]),
    (Op.TAN, [(0.0, np.inf)], [np.inf]),
])
def test_infinite_bounds_flag_reachable_nans(op, args, point):
    lo, hi = INTERVAL_OPS[op](*[(np.array(a), np.array(b)) for a, b in args], *[None] * (3 - len(args)))
    with np.errstate(all="ignore"):
        assert np.isnan(OPS[op].reference(*[np.array(p) for p in point]))
    assert np.isnan(lo) and np.isnan(hi)
