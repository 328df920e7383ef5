"""Interval arithmetic for the arithmetic ops: the canonical float64 numpy reference.

``INTERVAL_OPS[op](a, b, c)`` maps input intervals (pairs of numpy arrays ``(lo, hi)``) to the
output interval: for an op whose ``OpSpec.interval`` is monotone, [reference(lo), reference(hi)]
(decreasing: swapped) from its ``OpSpec.reference``, NaN where the interval leaves its domain;
for any other op the named rule written here (``NAMED_RULES``: an op of neither fails at import).
An interval with NaN bounds means "may be NaN" (it contains everything and
propagates). Together with ``choice``, which says where MIN / MAX / AND / OR take one operand on
a whole interval, this is what the walkers' interval evaluators and per-tile pruning implement
(in float32, with transcendental bounds widened outward by ``WIDEN_ULPS``); tests grade them
against dense sampling and against this table.
"""
from __future__ import annotations

import numpy as np

from .opcodes import OPS, Op, _rem_euclid

__all__ = ["INTERVAL_OPS", "NAMED_RULES", "monotone_rule", "WIDEN_ULPS", "choice", "CHOICE_BOTH", "CHOICE_A", "CHOICE_B"]

WIDEN_ULPS = 2          # outward widening of sin/cos/tan/asin/acos/atan/atan2/exp/ln/sqrt bounds
CHOICE_BOTH, CHOICE_A, CHOICE_B = 0, 1, 2
PI = np.pi


def _nanmask(*ivs):
    m = False
    for lo, hi in ivs:
        m = m | np.isnan(lo) | np.isnan(hi)
    return m


def _out(lo, hi, nan):
    lo, hi = np.asarray(lo, float), np.asarray(hi, float)
    return np.where(nan, np.nan, lo), np.where(nan, np.nan, hi)


def monotone_rule(spec):
    """The interval of a monotone op from its reference, NaN where [lo, hi] leaves the domain
    (the reference evaluated at the bounds clipped into it)."""
    f, (d0, d1) = spec.reference, spec.interval.domain
    decreasing = spec.interval.monotone == "decreasing"

    def rule(a, *_):
        lo, hi = a
        with np.errstate(all="ignore"):
            f_lo, f_hi = f(np.clip(lo, d0, d1)), f(np.clip(hi, d0, d1))
        if decreasing:
            f_lo, f_hi = f_hi, f_lo
        return _out(f_lo, f_hi, _nanmask(a) | (lo < d0) | (hi > d1))
    return rule


def _neg(a, *_):
    return _out(-a[1], -a[0], _nanmask(a))


def _abs(a, *_):
    lo, hi = a
    return _out(np.where(lo >= 0, lo, np.where(hi <= 0, -hi, 0.0)),
                np.maximum(np.abs(lo), np.abs(hi)), _nanmask(a))


def _square(a, *_):
    lo, hi = _abs(a)
    return _out(lo * lo, hi * hi, _nanmask(a))


def _recip(a, *_):
    lo, hi = a
    zero = (lo <= 0) & (hi >= 0)
    both_zero = (lo == 0) & (hi == 0)
    with np.errstate(over="ignore"):
        return _out(
            np.where(zero, -np.inf, 1 / np.where(zero, 1, hi)),
            np.where(zero, np.inf, 1 / np.where(zero, 1, lo)), _nanmask(a) | both_zero)


def _sqrt(a, *_):
    lo, hi = a
    return _out(np.sqrt(np.maximum(lo, 0)), np.sqrt(np.maximum(hi, 0)), _nanmask(a) | (lo < 0))


def _sin_shifted(lo, hi, shift, f):
    """Range of f(x) = sin(x + shift) on [lo, hi] (endpoints evaluated with f itself)."""
    s_lo, s_hi = f(lo), f(hi)
    lo, hi = lo + shift, hi + shift
    wide = (hi - lo) >= 2 * PI
    # does [lo, hi] contain pi/2 + 2k pi (max) or -pi/2 + 2k pi (min)?
    has_max = np.floor((hi - PI / 2) / (2 * PI)) >= np.ceil((lo - PI / 2) / (2 * PI))
    has_min = np.floor((hi + PI / 2) / (2 * PI)) >= np.ceil((lo + PI / 2) / (2 * PI))
    out_lo = np.where(wide | has_min, -1.0, np.minimum(s_lo, s_hi))
    out_hi = np.where(wide | has_max, 1.0, np.maximum(s_lo, s_hi))
    return out_lo, out_hi


def _sin(a, *_):
    with np.errstate(invalid="ignore"):
        return _out(*_sin_shifted(a[0], a[1], 0.0, np.sin), _nanmask(a) | np.isinf(a[0]) | np.isinf(a[1]))


def _cos(a, *_):
    with np.errstate(invalid="ignore"):
        return _out(*_sin_shifted(a[0], a[1], PI / 2, np.cos), _nanmask(a) | np.isinf(a[0]) | np.isinf(a[1]))


def _tan(a, *_):
    lo, hi = a
    with np.errstate(invalid="ignore"):
        pole = np.floor((hi - PI / 2) / PI) >= np.ceil((lo - PI / 2) / PI)
        pole = pole | ((hi - lo) >= PI) | np.isinf(lo) | np.isinf(hi)
    with np.errstate(invalid="ignore"):
        t_lo, t_hi = np.tan(lo), np.tan(hi)
    return _out(np.where(pole, -np.inf, t_lo), np.where(pole, np.inf, t_hi),
                _nanmask(a) | np.isinf(lo) | np.isinf(hi))      # tan(+-inf) is NaN


def _not(a, *_):
    lo, hi = a
    anything = _nanmask(a)                       # NOT of anything, NaN included: 0 or 1
    zero_only = (lo == 0) & (hi == 0)
    has_zero = anything | ((lo <= 0) & (hi >= 0))
    return _out(np.where(zero_only, 1.0, 0.0), np.where(has_zero, 1.0, 0.0), False)


def _add(a, b, *_):
    with np.errstate(invalid="ignore"):
        lo, hi = a[0] + b[0], a[1] + b[1]
    # inf + -inf is reachable when one operand reaches +inf and the other -inf
    opposite = ((a[1] == np.inf) & (b[0] == -np.inf)) | ((a[0] == -np.inf) & (b[1] == np.inf))
    return _out(lo, hi, _nanmask(a, b) | np.isnan(lo) | np.isnan(hi) | opposite)


def _sub(a, b, *_):
    return _add(a, _neg(b))


def _mul(a, b, *_):
    with np.errstate(invalid="ignore"):
        p = np.stack([a[0] * b[0], a[0] * b[1], a[1] * b[0], a[1] * b[1]])
    # 0 * inf is reachable when one operand holds 0 and the other reaches an infinity
    zero_inf = (((a[0] <= 0) & (a[1] >= 0)) & (np.isinf(b[0]) | np.isinf(b[1]))) | \
        (((b[0] <= 0) & (b[1] >= 0)) & (np.isinf(a[0]) | np.isinf(a[1])))
    return _out(p.min(0), p.max(0), _nanmask(a, b) | np.isnan(p).any(0) | zero_inf)


def _div(a, b, *_):
    zero = (b[0] <= 0) & (b[1] >= 0)
    num_zero = (a[0] <= 0) & (a[1] >= 0)
    with np.errstate(all="ignore"):
        q = np.stack([a[i] / np.where(zero, 1, b[j]) for i in (0, 1) for j in (0, 1)])
    lo, hi = q.min(0), q.max(0)
    return _out(np.where(zero, -np.inf, lo), np.where(zero, np.inf, hi),
                _nanmask(a, b) | (zero & num_zero) | (~zero & (np.isnan(lo) | np.isnan(hi))))


def _min(a, b, *_):
    return _out(np.minimum(a[0], b[0]), np.minimum(a[1], b[1]), _nanmask(a, b))


def _max(a, b, *_):
    return _out(np.maximum(a[0], b[0]), np.maximum(a[1], b[1]), _nanmask(a, b))


def _atan2(a, b, *_):
    y, x = a, b
    corners = np.stack([np.arctan2(y[i], x[j]) for i in (0, 1) for j in (0, 1)])
    safe = (y[0] > 0) | (y[1] < 0) | (x[0] > 0)
    return _out(np.where(safe, corners.min(0), -PI), np.where(safe, corners.max(0), PI), _nanmask(a, b))


def _compare(a, b, *_):
    lt, gt = a[1] < b[0], a[0] > b[1]
    eq = (a[0] == a[1]) & (b[0] == b[1]) & (a[0] == b[0])
    lo = np.where(gt, 1.0, np.where(eq, 0.0, -1.0))
    hi = np.where(lt, -1.0, np.where(eq, 0.0, 1.0))
    lo = np.where(~lt & ~gt & ~eq & (a[0] >= b[1]), 0.0, lo)   # a >= b everywhere: never -1
    hi = np.where(~lt & ~gt & ~eq & (a[1] <= b[0]), 0.0, hi)   # a <= b everywhere: never +1
    return _out(lo, hi, _nanmask(a, b))


def _mod(a, b, *_):
    const_b = (b[0] == b[1]) & (b[0] > 0)
    # (a / bb may overflow for a tiny bb: width < bb with r_lo <= r_hi already means one period)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        bb = np.where(const_b, b[0], 1.0)
        r_lo, r_hi = _rem_euclid(a[0], bb), _rem_euclid(a[1], bb)
        one_period = const_b & (np.floor(a[1] / bb) == np.floor(a[0] / bb)) & (r_lo <= r_hi) \
            & (a[1] - a[0] < bb)
    lo = np.where(one_period, r_lo, 0.0)
    hi = np.where(one_period, r_hi, np.maximum(np.abs(b[0]), np.abs(b[1])))
    return _out(lo, hi, _nanmask(a, b) | ((b[0] <= 0) & (b[1] >= 0)) | np.isinf(a[0]) | np.isinf(a[1]))


def _and(a, b, *_):
    nonzero = (a[0] > 0) | (a[1] < 0)
    zero_only = (a[0] == 0) & (a[1] == 0)
    lo = np.where(nonzero, b[0], np.where(zero_only, 0.0, np.minimum(0.0, b[0])))
    hi = np.where(nonzero, b[1], np.where(zero_only, 0.0, np.maximum(0.0, b[1])))
    return _out(lo, hi, _nanmask(a) | (~zero_only & _nanmask(b)))


def _or(a, b, *_):
    nonzero = (a[0] > 0) | (a[1] < 0)
    zero_only = (a[0] == 0) & (a[1] == 0)
    lo = np.where(nonzero, a[0], np.where(zero_only, b[0], np.minimum(a[0], b[0])))
    hi = np.where(nonzero, a[1], np.where(zero_only, b[1], np.maximum(a[1], b[1])))
    return _out(lo, hi, _nanmask(a) | (~nonzero & _nanmask(b)))


def _mix(a, b, c):
    return _add(a, _mul(_sub(b, a), c))


def _rand(a, b, *_):
    return _out(np.zeros_like(a[0]), np.ones_like(a[0]), False)


# the hand-written float64 rules of the ops whose OpSpec.interval is a named rule
NAMED_RULES = {
    Op.ABS: _abs, Op.RECIP: _recip, Op.SQRT: _sqrt, Op.SQUARE: _square,
    Op.SIN: _sin, Op.COS: _cos, Op.TAN: _tan, Op.NOT: _not,
    Op.ADD: _add, Op.SUB: _sub, Op.MUL: _mul, Op.DIV: _div, Op.MIN: _min, Op.MAX: _max,
    Op.ATAN2: _atan2, Op.COMPARE: _compare, Op.MOD: _mod, Op.AND: _and, Op.OR: _or,
    Op.MIX: _mix, Op.RAND: _rand,
}


def _rules() -> dict:
    rules = {}
    for op, spec in OPS.items():
        if spec.interval is None:
            continue
        if spec.interval.monotone is not None:
            rules[op] = monotone_rule(spec)
        elif op in NAMED_RULES:
            rules[op] = NAMED_RULES[op]
        else:
            raise ImportError(f"runtime.intervals: {op.name} has a named interval rule in runtime.opcodes "
                              "but none here (NAMED_RULES)")
    return rules


INTERVAL_OPS = _rules()


def choice(op: Op, a, b):
    """Per interval: CHOICE_A / CHOICE_B where the op's value is one operand on the whole interval
    (the other can be pruned), CHOICE_BOTH otherwise. Ties go to ``a``, as the walkers do."""
    nan = _nanmask(a, b)
    if op is Op.MIN:
        pick = np.where(a[1] <= b[0], CHOICE_A, np.where(b[1] < a[0], CHOICE_B, CHOICE_BOTH))
    elif op is Op.MAX:
        pick = np.where(a[0] >= b[1], CHOICE_A, np.where(b[0] > a[1], CHOICE_B, CHOICE_BOTH))
    elif op is Op.AND:   # a != 0 everywhere: the value is b; a == 0 everywhere: the value is a
        pick = np.where((a[0] > 0) | (a[1] < 0), CHOICE_B,
                        np.where((a[0] == 0) & (a[1] == 0), CHOICE_A, CHOICE_BOTH))
        nan = _nanmask(a)
    elif op is Op.OR:    # a != 0 everywhere: the value is a; a == 0 everywhere: the value is b
        pick = np.where((a[0] > 0) | (a[1] < 0), CHOICE_A,
                        np.where((a[0] == 0) & (a[1] == 0), CHOICE_B, CHOICE_BOTH))
        nan = _nanmask(a)
    else:
        raise ValueError(f"{op.name} makes no choice")
    return np.where(nan, CHOICE_BOTH, pick)
