"""The JAX walker: the tape evaluated in JAX, differentiable w.r.t. the parameter pool and the point.

Owns ``JaxWalker`` (evaluate / value_and_grad / vjp / jvp / sensitivities), the two forms of the
evaluator, the XLA compile counter (``compile_stats``), the persistent compilation cache setting and
the CPU compiler options (``CPU_COMPILER_OPTIONS``, passed only where the installed jaxlib takes them).

Forms (``JaxWalker(form=...)``; "auto" picks per tape, docs/JAX.md gives the measurements):
  * "trace": a structure-specialised trace. A Python pass over the records at trace time emits the
    tape's operations; the program is cached by the tape's *structure* (instruction words, pool
    size, registers, BVH shape, instance count), never by parameter values: the pool, the BVH boxes
    and the instance transforms are arguments, so a parameter edit compiles nothing. Every op of
    runtime.opcodes is supported.
  * "generic": one interpreter compiled per capacity bucket (records, value rows, pool size and
    point count, each rounded up a power-of-two ladder), so a topology edit inside a bucket
    compiles nothing. The tape is rewritten into single-assignment form (every value a record
    writes, point coordinates included, gets its own row; PUSH / POP become renamings), the
    forward pass is a ``fori_loop`` over the records writing one row each (in place: the row file
    is never copied per record), and its reverse mode is a custom VJP that sweeps the records
    backwards once, applying each record's local VJP. Supported: arithmetic, shapes but the
    polygons, point ops, combines, culls (evaluated without their jump, which leaves values
    unchanged: the flattener's culls are exact), FIELD_RESULT and patterns (unrolled: each copy
    the twin evaluates gets its point, its body's steps and its clipped value as steps:
    ``PatternStep``); a tape with instance lists or polygons raises TaperayError naming the
    record (the "auto" form then traces). A shape moved alone (PUSH TRANSLATE shape POP, the
    translation's parameters right before the shape's, as the flattener writes a moved part) is
    one step (``MovedShape``): the same operations, one step and four rows fewer (XLA may round
    a value 1 ULP differently, as it does between the forms).

Points are padded up a ladder (powers of two from ``LADDER_MIN``) with copies of the first point
and processed in chunks (``lax.map`` / ``lax.scan`` over chunks), so memory stays bounded and a new
point count inside a rung compiles nothing.

Semantics follow the twin (runtime/cpu.py) record for record, including its choices where the op
table is silent (materials, NaN propagation of MIN / MAX, ROUND in float32, COMPARE, the pattern
cells and bounds). Patterns evaluate the same copies as the twin (the nearest cell and its
neighbour; 2 x 2 x 2 for grids) with no skipping (skipping is exact, so values agree); an instance
list is evaluated densely over all its leaves in blocks of ``LEAF_BLOCK`` (cost linear in the
leaves: the twin's BVH walk is exact, so the least value and its material, first of ties in tree
order, are the same). Transcendentals are XLA's float32 approximations (within the conformance
tolerances of runtime.conformance). Derivatives: where an op is not differentiable the derivative
is JAX's convention written in ``runtime.opcodes.DERIVATIVES``; norms have derivative 0 at 0 (no
NaN from an inside box or a point at a shape's centre).
"""
from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass, field as dc_field
from pathlib import Path
from typing import NamedTuple

import numpy as np

# a CUDA jaxlib takes 75 % of the GPU's memory at its first use unless told not to; the GPU walker
# (wgpu) shares that GPU in the same process, so JAX allocates as it goes (a user's setting wins)
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from .jit_cache import default_xla_flag, usable_cores  # noqa: E402

# on a GPU, XLA runs the steps' loops and switches as command buffers (CUDA graphs) rather than one
# launch and a host round trip each: the cells' vjp at 2,037 records 0.40 -> 0.25 s on an H100
# (docs/JAX.md); added unless the user's XLA_FLAGS already say how command buffers are used
default_xla_flag("xla_gpu_enable_command_buffer", "+WHILE,+CONDITIONAL")
# XLA runs a CPU program on one core: the cell form spreads a call's pieces over host devices, one
# a core (docs/JAX.md); added unless the user's XLA_FLAGS already say how many
HOST_DEVICES = usable_cores()
default_xla_flag("xla_force_host_platform_device_count", HOST_DEVICES)

import jax  # noqa: E402  (after the allocator and XLA settings)
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from . import jax_cells
from .jax_cells import CellLayout, CellsRunner, layout_for
from .memo import Kept
from .opcodes import OPS, POLY_OPS, Family, Op
from .tape import VALIDATED, Tape, TaperayError, point_array, pool_tangents

__all__ = ["JaxWalker", "Gradients", "compile_stats", "LADDER_MIN", "CHUNK", "LEAF_BLOCK", "cache_dir",
           "generic_unsupported", "cells_unsupported", "compiler_options", "cpu_options_accepted"]

LADDER_MIN = 4096     # the smallest padded point count; above it, powers of two
CHUNK = 16384         # points a chunk of the trace form (the program maps over chunks)
LEAF_BLOCK = 8        # instance-list leaves evaluated together (a scan over blocks beyond that)
GENERIC_ROWS_BYTES = 64 << 20   # the generic form's row file per chunk (chooses its chunk)

_f32 = np.float32
F0, F1, F2, FH, FQ = _f32(0), _f32(1), _f32(2), _f32(0.5), _f32(0.25)
INF = _f32(np.inf)
TWO_PI = _f32(2 * np.pi)

# ----------------------------------------------------------------------------- compile accounting
_COUNTS = {"compiles": 0, "cache_hits": 0, "traces": 0}
_COUNT_LOCK = threading.Lock()


def _on_duration(event: str, duration_secs: float, **kwargs) -> None:
    key = {"/jax/core/compile/backend_compile_duration": "compiles",
           "/jax/core/compile/jaxpr_trace_duration": "traces"}.get(event)
    if key:
        with _COUNT_LOCK:
            _COUNTS[key] += 1


def _on_event(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        with _COUNT_LOCK:
            _COUNTS["cache_hits"] += 1


jax.monitoring.register_event_duration_secs_listener(_on_duration)
jax.monitoring.register_event_listener(_on_event)


def compile_stats() -> dict:
    """Process-wide counts from JAX's monitoring hooks: ``compiles`` (XLA programs built, loads from
    the persistent cache included), ``cache_hits`` (of those, loaded from the persistent cache) and
    ``traces`` (jaxprs traced). Differences between two calls count what happened in between."""
    with _COUNT_LOCK:
        return dict(_COUNTS)


# ----------------------------------------------------------------------------- persistent cache
def cache_dir() -> Path:
    """The per-user directory of JAX's persistent compilation cache: $TAPERAY_JAX_CACHE, else
    $XDG_CACHE_HOME/taperay/jax (~/.cache/taperay/jax)."""
    env = os.environ.get("TAPERAY_JAX_CACHE")
    if env and env not in ("0", "off"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "taperay" / "jax"


def _enable_persistent_cache(setting) -> str | None:
    """Point JAX's persistent compilation cache at ``setting`` (a path; True / None: cache_dir();
    False or TAPERAY_JAX_CACHE=0/off: leave it off). A cache directory the user configured in JAX
    is kept. Returns the directory in use (None: off)."""
    if setting is False or (setting is None and os.environ.get("TAPERAY_JAX_CACHE") in ("0", "off")):
        return None
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    path = cache_dir() if setting in (None, True) else Path(setting).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return str(path)


# ----------------------------------------------------------------------------- float32 helpers
def _fmin(a, b):
    """The twin's MIN: b if b < a or b is NaN, else a (NaN propagates; ties give a)."""
    return jnp.where((b < a) | (b != b), b, a)


def _fmax(a, b):
    return jnp.where((b > a) | (b != b), b, a)


def _sqrt0(s):
    """sqrt of a sum of squares with derivative 0 where it is 0 (jnp.sqrt's is infinite there)."""
    pos = s > 0
    return jnp.where(pos, jnp.sqrt(jnp.where(pos, s, F1)), s)


def _len3(x, y, z):
    return _sqrt0(x * x + y * y + z * z)


def _round(x):
    """ROUND in float32, as the twin: r = floor(|x|); r += 1 if |x| - r >= 0.5; sign of x."""
    ax = jnp.abs(x)
    r = jnp.floor(ax)
    r = jnp.where(ax - r >= FH, r + F1, r)
    return jnp.where(x >= F0, r, -r)


def _box(x, y, z, hx, hy, hz):
    qx, qy, qz = jnp.abs(x) - hx, jnp.abs(y) - hy, jnp.abs(z) - hz
    outside = _len3(jnp.maximum(qx, F0), jnp.maximum(qy, F0), jnp.maximum(qz, F0))
    return outside + jnp.minimum(jnp.maximum(qx, jnp.maximum(qy, qz)), F0)


def _cap2(dx, dy):
    ox, oy = jnp.maximum(dx, F0), jnp.maximum(dy, F0)
    return jnp.minimum(jnp.maximum(dx, dy), F0) + _sqrt0(ox * ox + oy * oy)


def _capped_cone(x, y, z, h, r1, r2):
    qx = _sqrt0(x * x + y * y)
    qy = z
    k2x, k2y = r2 - r1, F2 * h
    cax = qx - jnp.minimum(qx, jnp.where(qy < F0, r1, r2))
    cay = jnp.abs(qy) - h
    t = ((r2 - qx) * k2x + (h - qy) * k2y) / (k2x * k2x + k2y * k2y)
    t = jnp.minimum(jnp.maximum(t, F0), F1)
    cbx = qx - r2 + k2x * t
    cby = qy - h + k2y * t
    s = jnp.where((cbx < F0) & (cay < F0), -F1, F1)
    return s * _sqrt0(jnp.minimum(cax * cax + cay * cay, cbx * cbx + cby * cby))


def _capsule(x, y, z, ax, ay, az, bx, by, bz, r):
    pax, pay, paz = x - ax, y - ay, z - az
    bax, bay, baz = bx - ax, by - ay, bz - az
    bb = bax * bax + bay * bay + baz * baz
    pos = bb > F0
    h = jnp.where(pos, jnp.minimum(jnp.maximum((pax * bax + pay * bay + paz * baz) / jnp.where(pos, bb, F1),
                                               F0), F1), F0)
    return _len3(pax - bax * h, pay - bay * h, paz - baz * h) - r


def _ellipsoid(x, y, z, rx, ry, rz):
    k0 = _len3(x / rx, y / ry, z / rz)
    k1 = _len3(x / (rx * rx), y / (ry * ry), z / (rz * rz))
    zero = k1 == F0
    return jnp.where(zero, -jnp.minimum(rx, jnp.minimum(ry, rz)), k0 * (k0 - F1) / jnp.where(zero, F1, k1))


def _poly(v, x, y):
    """Signed distance to the closed polygon v (nv, 2) at (x, y), even-odd inside, vectorised over
    the edges (the twin's loop: edge i runs from vertex i to vertex i - 1)."""
    vi = v
    vj = jnp.roll(v, 1, axis=0)
    vix, viy = vi[:, 0:1], vi[:, 1:2]
    ex, ey = vj[:, 0:1] - vix, vj[:, 1:2] - viy
    wx, wy = x[None] - vix, y[None] - viy
    ee = ex * ex + ey * ey
    pos = ee > F0
    t = jnp.where(pos, jnp.minimum(jnp.maximum((wx * ex + wy * ey) / jnp.where(pos, ee, F1), F0), F1), F0)
    bx, by = wx - ex * t, wy - ey * t
    d0 = (x - v[0, 0]) * (x - v[0, 0]) + (y - v[0, 1]) * (y - v[0, 1])
    d = jnp.minimum(d0, jnp.min(bx * bx + by * by, axis=0))
    c1 = y[None] >= viy
    c2 = y[None] < vj[:, 1:2]
    c3 = ex * wy > ey * wx
    flips = jnp.sum(((c1 & c2 & c3) | (~c1 & ~c2 & ~c3)).astype(jnp.int32), axis=0)
    s = jnp.where(flips % 2 == 1, -F1, F1)
    return s * _sqrt0(d)


def _qrot_conj(w, qx, qy, qz, x, y, z):
    """conj(q) * v * q for a unit quaternion q = (w, qx, qy, qz) (the twin's operation order)."""
    ux, uy, uz = -qx, -qy, -qz
    tx = F2 * (uy * z - uz * y)
    ty = F2 * (uz * x - ux * z)
    tz = F2 * (ux * y - uy * x)
    return (x + w * tx + (uy * tz - uz * ty),
            y + w * ty + (uz * tx - ux * tz),
            z + w * tz + (ux * ty - uy * tx))


def _rand(a, b):
    """RAND: the integer hash of the bits of a and b (uint32 arithmetic wraps as the twin's masks)."""
    x = lax.bitcast_convert_type(a, jnp.uint32)
    y = lax.bitcast_convert_type(b, jnp.uint32)
    h = (x * jnp.uint32(0x9E3779B1)) ^ (y + jnp.uint32(0x7F4A7C15))
    h = (h ^ (h >> 16)) * jnp.uint32(0x45D9F3B)
    h = (h ^ (h >> 16)) * jnp.uint32(0x45D9F3B)
    h = h ^ (h >> 16)
    return lax.stop_gradient((h >> 8).astype(jnp.float32) / _f32(16777216.0))


def _mod(a, b):
    r = jnp.fmod(a, b)
    return jnp.where(r < F0, r + jnp.abs(b), r)


def _compare(a, b):
    nan = (a != a) | (b != b)
    return jnp.where(a < b, -F1, jnp.where(a > b, F1, jnp.where(nan, a + b, F0)))


# arithmetic ops reading registers: value rule (the material is mat[a] but for MIN / MAX)
_ARITH = {
    Op.COPY: lambda a, b, c: a,
    Op.NEG: lambda a, b, c: -a,
    Op.ABS: lambda a, b, c: jnp.abs(a),
    Op.RECIP: lambda a, b, c: F1 / a,
    Op.SQRT: lambda a, b, c: jnp.sqrt(a),
    Op.SQUARE: lambda a, b, c: a * a,
    Op.FLOOR: lambda a, b, c: jnp.floor(a),
    Op.CEIL: lambda a, b, c: jnp.ceil(a),
    Op.ROUND: lambda a, b, c: _round(a),
    Op.SIN: lambda a, b, c: jnp.sin(a),
    Op.COS: lambda a, b, c: jnp.cos(a),
    Op.TAN: lambda a, b, c: jnp.tan(a),
    Op.ASIN: lambda a, b, c: jnp.arcsin(a),
    Op.ACOS: lambda a, b, c: jnp.arccos(a),
    Op.ATAN: lambda a, b, c: jnp.arctan(a),
    Op.EXP: lambda a, b, c: jnp.exp(a),
    Op.LN: lambda a, b, c: jnp.log(a),
    Op.NOT: lambda a, b, c: jnp.where(a == F0, F1, F0),
    Op.ADD: lambda a, b, c: a + b,
    Op.SUB: lambda a, b, c: a - b,
    Op.MUL: lambda a, b, c: a * b,
    Op.DIV: lambda a, b, c: a / b,
    Op.MIN: lambda a, b, c: _fmin(a, b),
    Op.MAX: lambda a, b, c: _fmax(a, b),
    Op.ATAN2: lambda a, b, c: jnp.arctan2(a, b),
    Op.COMPARE: lambda a, b, c: _compare(a, b),
    Op.MOD: lambda a, b, c: _mod(a, b),
    Op.AND: lambda a, b, c: jnp.where(a == F0, a, b),
    Op.OR: lambda a, b, c: jnp.where(a != F0, a, b),
    Op.MIX: lambda a, b, c: a + (b - a) * c,
    Op.RAND: lambda a, b, c: _rand(a, b),
}


def _from_reference(spec):
    """The value rule of an arithmetic op written above by none: jax.numpy's function of the name
    of its table reference, a numpy ufunc (np.tanh -> jnp.tanh)."""
    f, n = getattr(jnp, spec.reference.__name__), len(spec.reads)
    return (lambda a, b, c: f(a)) if n == 1 else (lambda a, b, c: f(a, b)) if n == 2 else (lambda a, b, c: f(a, b, c))


_ARITH.update({op: _from_reference(spec) for op, spec in OPS.items()
               if op not in _ARITH and spec.family is Family.ARITH and spec.reads
               and isinstance(spec.reference, np.ufunc) and hasattr(jnp, spec.reference.__name__)})


def _shape(op: Op, prm, nv: int, x, y, z):
    """A shape's distance at the local point (not yet times the scale); prm(k) = pool[param + k]."""
    if op is Op.SPHERE:
        return _len3(x, y, z) - prm(0)
    if op is Op.BOX:
        return _box(x, y, z, prm(0), prm(1), prm(2))
    if op is Op.ROUND_BOX:
        rr = prm(3)
        return _box(x, y, z, prm(0) - rr, prm(1) - rr, prm(2) - rr) - rr
    if op is Op.CYLINDER:
        return _cap2(_sqrt0(x * x + y * y) - prm(0), jnp.abs(z) - prm(1))
    if op is Op.CAPPED_CONE:
        return _capped_cone(x, y, z, prm(0), prm(1), prm(2))
    if op is Op.CAPSULE:
        return _capsule(x, y, z, *(prm(k) for k in range(7)))
    if op is Op.TORUS:
        qx = _sqrt0(x * x + y * y) - prm(0)
        return _sqrt0(qx * qx + z * z) - prm(1)
    if op is Op.ELLIPSOID:
        return _ellipsoid(x, y, z, prm(0), prm(1), prm(2))
    if op is Op.PLANE:
        return x * prm(0) + y * prm(1) + z * prm(2) - prm(3)
    if op is Op.EXTRUDE_POLY:
        v = jnp.stack([prm(1 + k) for k in range(2 * nv)]).reshape(nv, 2)
        return _cap2(_poly(v, x, y), jnp.abs(z) - prm(0))
    if op is Op.REVOLVE_POLY:
        v = jnp.stack([prm(k) for k in range(2 * nv)]).reshape(nv, 2)
        return _poly(v, _sqrt0(x * x + y * y), z)
    raise AssertionError(op)


def _point_op(op: Op, prm, x, y, z, s):
    """A point op's new (x, y, z, scale); prm(k) = pool[param + k]."""
    if op is Op.TRANSLATE:
        return x - prm(0), y - prm(1), z - prm(2), s
    if op is Op.ELONGATE:
        tx, ty, tz = prm(0), prm(1), prm(2)
        return (x - jnp.minimum(jnp.maximum(x, -tx), tx), y - jnp.minimum(jnp.maximum(y, -ty), ty),
                z - jnp.minimum(jnp.maximum(z, -tz), tz), s)
    if op is Op.ROTATE:
        return (*_qrot_conj(prm(0), prm(1), prm(2), prm(3), x, y, z), s)
    if op is Op.SCALE:
        k = prm(0)
        return x / k, y / k, z / k, s * k
    if op is Op.MIRROR:
        nx, ny, nz, d = prm(0), prm(1), prm(2), prm(3)
        dp = x * nx + y * ny + z * nz
        k = F2 * (dp - d)
        under = dp < d
        return (jnp.where(under, x - k * nx, x), jnp.where(under, y - k * ny, y),
                jnp.where(under, z - k * nz, z), s)
    raise AssertionError(op)


def _combine(op: Op, prm, va, ma, vb, mb):
    """A combine op's (value, material) from its operands; prm(k) = pool[param + k]."""
    if op is Op.OFFSET:
        return va - prm(0), ma
    if op is Op.SHELL:
        return jnp.abs(va) - prm(0), ma
    if op is Op.UNION:
        return _fmin(va, vb), jnp.where(vb < va, mb, ma)
    if op is Op.INTERSECT:
        return _fmax(va, vb), jnp.where(vb > va, mb, ma)
    if op is Op.XOR:
        return _fmax(_fmin(va, vb), -_fmax(va, vb)), jnp.where(vb < va, mb, ma)
    if op is Op.DIFFERENCE:
        return _fmax(va, -vb), ma
    k = prm(0)
    if op is Op.SMOOTH_UNION:
        x, y, sg, m = va, vb, F1, jnp.where(vb < va, mb, ma)
    elif op is Op.SMOOTH_INTERSECT:
        x, y, sg, m = -va, -vb, -F1, jnp.where(vb > va, mb, ma)
    else:
        x, y, sg, m = -va, vb, -F1, ma
    h = jnp.maximum(k - jnp.abs(x - y), F0) / k
    return sg * (_fmin(x, y) - h * h * k * FQ), m


def _cull_box(prm, x, y, z, s):
    x0, y0, z0, x1, y1, z1 = (prm(k) for k in range(6))
    return _box(x - (x0 + x1) * FH, y - (y0 + y1) * FH, z - (z0 + z1) * FH,
                (x1 - x0) * FH, (y1 - y0) * FH, (z1 - z0) * FH) * s


def _cells(t, cnt):
    """The twin's _cells: nearest index c, its neighbour c2 (int32) and min |t - k| over the
    unchecked k (inf if none), for a float32 count ``cnt`` (a whole number >= 1)."""
    n = cnt.astype(jnp.int32)
    tc = jnp.where(t >= _f32(-1), t, _f32(-1))
    tc = jnp.where(tc > cnt, cnt, tc)
    c = jnp.clip(_round(tc).astype(jnp.int32), 0, n - 1)
    step = jnp.where(tc >= c.astype(jnp.float32), 1, -1)
    c2 = c + step
    c2 = jnp.where((c2 < 0) | (c2 > n - 1), c - step, c2)
    c2 = jnp.where(n == 1, c, c2)
    lo, hi = jnp.minimum(c, c2), jnp.maximum(c, c2)
    bnd = jnp.where(lo - 1 >= 0, jnp.abs(t - (lo - 1).astype(jnp.float32)), INF)
    bnd = jnp.where(hi + 1 <= n - 1, jnp.minimum(bnd, jnp.abs((hi + 1).astype(jnp.float32) - t)), bnd)
    return c, c2, bnd


def _where_finite(bnd, f):
    """f(bnd) where bnd is finite, else +inf (no copy left unchecked), with finite derivatives: f's
    are taken at 0 there, not at inf (whose product with the zero cotangent would be NaN)."""
    finite = bnd < INF
    return jnp.where(finite, f(jnp.where(finite, bnd, F0)), INF)


def _pattern_copies(op: Op, P, x, y, z, s):
    """The copies a pattern evaluates at points (x, y, z, scale s), as the twin: the nearest cell and
    its neighbour (2 x 2 x 2 for a grid, x fastest). -> (px, py, pz, ps): each copy's point
    (copies, C); idx: each copy's instance index (float32); lbound: the bound of the copies not
    evaluated (C,). ``P(k)``: the pattern's k-th parameter."""
    if op is Op.REPEAT_LINEAR:
        dx, dy, dz, cnt, e = (P(k) for k in range(5))
        dd = dx * dx + dy * dy + dz * dz
        dlen = jnp.sqrt(dd)
        t = (x * dx + y * dy + z * dz) / dd
        c0, c1, bnd = _cells(t, cnt)
        lbound = _where_finite(bnd, lambda b: (b * dlen - e) * s)
        k = jnp.stack([c0, c1]).astype(jnp.float32)
        px, py, pz = x[None] - k * dx, y[None] - k * dy, z[None] - k * dz
        ps = jnp.broadcast_to(s, k.shape)
        idx = k
    elif op is Op.REPEAT_POLAR:
        cnt, cx, cy, cz, R = (P(k) for k in range(5))
        n = cnt.astype(jnp.int32)
        phic = jnp.arctan2(cy, cx)
        sct = (jnp.arctan2(y, x) - phic) * cnt / TWO_PI
        r = _round(sct).astype(jnp.int32)
        step = jnp.where(sct >= r.astype(jnp.float32), 1, -1)
        cells = jnp.stack([jnp.mod(r, n), jnp.mod(r + step, n)])
        bnd = jnp.full(x.shape, INF)
        for kk in (jnp.minimum(r, r + step) - 1, jnp.maximum(r, r + step) + 1):
            th = TWO_PI * jnp.mod(kk, n).astype(jnp.float32) / cnt
            cs, sn = jnp.cos(th), jnp.sin(th)
            bnd = jnp.minimum(bnd, _len3(x - (cs * cx - sn * cy), y - (sn * cx + cs * cy), z - cz))
        bnd = jnp.where(n >= 3, bnd, INF)
        lbound = _where_finite(bnd, lambda b: (b - R) * s)
        th = TWO_PI * cells.astype(jnp.float32) / cnt
        cs, sn = jnp.cos(th), jnp.sin(th)
        px, py = cs * x[None] + sn * y[None], cs * y[None] - sn * x[None]
        pz, ps = jnp.broadcast_to(z, th.shape), jnp.broadcast_to(s, th.shape)
        idx = cells.astype(jnp.float32)
    else:   # REPEAT_GRID: the 2 x 2 x 2 cells, x fastest
        lbound = jnp.full(x.shape, INF)
        rows = []
        for ax, coord in enumerate((x, y, z)):
            sa, cnt, e = P(ax), P(3 + ax), P(6 + ax)
            c0, c1, bnd = _cells(coord / sa, cnt)
            lbound = jnp.minimum(lbound, _where_finite(bnd, lambda b: (b * jnp.abs(sa) - e) * s))
            rows.append((c0, c1))
        its = [(bx, by, bz) for bz in (0, 1) for by in (0, 1) for bx in (0, 1)]
        ci = [jnp.stack([rows[ax][bits[ax]] for bits in its]) for ax in range(3)]
        fi = [q.astype(jnp.float32) for q in ci]
        px, py, pz = x[None] - fi[0] * P(0), y[None] - fi[1] * P(1), z[None] - fi[2] * P(2)
        ps = jnp.broadcast_to(s, px.shape)
        nx, ny = P(3).astype(jnp.int32), P(4).astype(jnp.int32)
        idx = (ci[0] + nx * (ci[1] + ny * ci[2])).astype(jnp.float32)
    return px, py, pz, ps, idx, lbound


def _copy_bound(op: Op, P, px, py, pz, ps):
    """The pattern's bound of one copy's cell at the copy's point: a copy's value is clipped to it."""
    if op is Op.REPEAT_LINEAR:
        dx, dy, dz, e = P(0), P(1), P(2), P(4)
        return (jnp.abs(px * dx + py * dy + pz * dz) / jnp.sqrt(dx * dx + dy * dy + dz * dz) - e) * ps
    if op is Op.REPEAT_POLAR:
        return (_len3(px - P(1), py - P(2), pz - P(3)) - P(4)) * ps
    return _box(px, py, pz, P(6), P(7), P(8)) * ps


# ----------------------------------------------------------------------------- the trace form
@dataclass
class _State:
    """What the trace holds at a record: registers (value, material), the point (x, y, z, scale),
    the point stack, the innermost pattern's instance index, the culls awaiting their target
    (target -> [(mask, saved state)]) and the mask of the points a pending cull has taken."""
    regs: dict
    p: tuple
    stack: list = dc_field(default_factory=list)
    index: object = None
    pending: dict = dc_field(default_factory=dict)
    dead: object = None

    def child(self, p, index) -> "_State":
        return _State(dict(self.regs), p, list(self.stack), index, {}, self.dead)


class _Trace:
    """The structure-specialised evaluator of one tape structure: ``field(pool, nodes, inst, x, y,
    z)`` -> (value, material) at (C,) points, emitting the records' operations at trace time."""

    def __init__(self, tape: Tape):
        self.cols = [tuple(int(v) for v in row) for row in tape.as_columns()]
        self.leaves = {}
        for i, row in enumerate(self.cols):
            if row[0] == Op.INSTANCES:
                first, count = row[6], row[2]
                nodes = np.arange(first, first + count)
                inst = tape.bvh["instance"][first:first + count]
                self.leaves[i] = (nodes[inst >= 0], inst[inst >= 0].astype(np.int64))

    def field(self, pool, nodes, inst, x, y, z):
        st = _State({}, (x, y, z, jnp.ones_like(x)))
        self._env = (pool, nodes, inst)
        self._run(0, len(self.cols), st)
        return st.regs[0]

    def _prm(self, off):
        pool = self._env[0]
        return lambda k: pool[off + k]

    def _land(self, target, st):
        """At a cull's target: the points it took get back the state they had at the cull."""
        for mask, (regs, p, stack) in reversed(st.pending.pop(target)):
            for r, (v, m) in regs.items():
                cur = st.regs.get(r)
                if cur is not None and cur is not regs[r]:
                    st.regs[r] = (jnp.where(mask, v, cur[0]), jnp.where(mask, m, cur[1]))
            st.p = tuple(jnp.where(mask, a, b) for a, b in zip(p, st.p))
            st.stack = [tuple(jnp.where(mask, a, b) for a, b in zip(f0, f1)) for f0, f1 in zip(stack, st.stack)]
        masks = [m for lst in st.pending.values() for m, _ in lst]
        dead = None
        for m in masks:
            dead = m if dead is None else dead | m
        st.dead = dead

    def _run(self, i, end, st):
        cols = self.cols
        while i < end:
            if i in st.pending:
                self._land(i, st)
            op_i, dst, a, b, c, prm, aux, jump = cols[i]
            op = Op(op_i)
            fam = OPS[op].family
            x, y, z, s = st.p
            P = self._prm(prm)
            if op in (Op.VAR_X, Op.VAR_Y, Op.VAR_Z):
                st.regs[dst] = (st.p[op_i], jnp.zeros(x.shape, jnp.int32))
            elif op is Op.CONST:
                st.regs[dst] = (jnp.broadcast_to(P(0), x.shape), jnp.zeros(x.shape, jnp.int32))
            elif op is Op.INSTANCE_INDEX:
                idx = st.index if st.index is not None else jnp.zeros(x.shape, jnp.float32)
                st.regs[dst] = (jnp.broadcast_to(idx, x.shape), jnp.zeros(x.shape, jnp.int32))
            elif fam is Family.ARITH:
                va, ma = st.regs[a]
                vb, mb = st.regs.get(b, (None, None)) if "b" in OPS[op].reads else (None, None)
                vc = st.regs[c][0] if "c" in OPS[op].reads else None
                v = _ARITH[op](va, vb, vc)
                if op is Op.MIN:
                    m = jnp.where(vb < va, mb, ma)
                elif op is Op.MAX:
                    m = jnp.where(vb > va, mb, ma)
                else:
                    m = ma
                st.regs[dst] = (v, m)
            elif fam is Family.SHAPE:
                d = _shape(op, P, a, x, y, z) * s
                st.regs[dst] = (d, jnp.full(x.shape, aux, jnp.int32))
            elif op is Op.PUSH:
                st.stack.append(st.p)
            elif op is Op.POP:
                st.p = st.stack.pop()
            elif fam is Family.POINT:
                st.p = _point_op(op, P, x, y, z, s)
            elif fam is Family.COMBINE:
                va, ma = st.regs[a]
                vb, mb = st.regs[b] if "b" in OPS[op].reads else (None, None)
                st.regs[dst] = _combine(op, P, va, ma, vb, mb)
            elif op in (Op.REPEAT_LINEAR, Op.REPEAT_POLAR, Op.REPEAT_GRID):
                self._pattern(i, st)
                i = jump + 1
                continue
            elif op is Op.INSTANCES:
                self._instances(i, st)
                i = jump + 1
                continue
            elif op is Op.CULL_BOX:
                bb = _cull_box(P, x, y, z, s)
                mask = bb >= st.regs[a][0] + P(6)
                if st.dead is not None:
                    mask = mask & ~st.dead
                st.regs[dst] = (bb, jnp.full(x.shape, aux, jnp.int32))
                st.pending.setdefault(jump, []).append((mask, (dict(st.regs), st.p, list(st.stack))))
                st.dead = mask if st.dead is None else st.dead | mask
            elif op is Op.FIELD_RESULT:
                st.regs[dst] = (st.regs[a][0] * s, jnp.full(x.shape, aux, jnp.int32))
            else:
                raise TaperayError(f"record {i}: {op.name} outside a pattern")
            i += 1
        if end in st.pending:
            self._land(end, st)

    def _body(self, i, st):
        """The pattern body of record i as a function of the copy's point and instance index."""
        end = self.cols[i][7]
        a_end = self.cols[end][2]

        def body(px, py, pz, ps, idx):
            sub = st.child((px, py, pz, ps), idx)
            self._run(i + 1, end, sub)
            return sub.regs[a_end]
        return body

    def _pattern(self, i, st):
        op, prm, end = Op(self.cols[i][0]), self.cols[i][5], self.cols[i][7]
        P = self._prm(prm)
        px, py, pz, ps, idx, lbound = _pattern_copies(op, P, *st.p)
        vals, mats = jax.vmap(self._body(i, st))(px, py, pz, ps, idx)
        v = jnp.maximum(vals, _copy_bound(op, P, px, py, pz, ps))
        acc, m = v[0], mats[0]
        for k in range(1, v.shape[0]):
            upd = v[k] < acc
            acc, m = jnp.where(upd, v[k], acc), jnp.where(upd, mats[k], m)
        st.regs[self.cols[end][1]] = (_fmin(acc, lbound), m)

    def _instances(self, i, st):
        """Dense: every leaf of the list, max(body, b, c), the least (first in tree order on ties)."""
        prm, end = self.cols[i][5], self.cols[i][7]
        P = self._prm(prm)
        _, nodes, inst = self._env
        x, y, z, s = st.p
        leaf_nodes, leaf_inst = self.leaves[i]
        n_leaves = len(leaf_nodes)
        if n_leaves == 0:                 # (no leaf: the list's value is +inf, as the twin's)
            st.regs[self.cols[end][1]] = (jnp.full(x.shape, INF), jnp.zeros(x.shape, jnp.int32))
            return
        blocks = -(-n_leaves // LEAF_BLOCK) if n_leaves > LEAF_BLOCK else 1
        width = min(n_leaves, LEAF_BLOCK)
        pad = blocks * width - n_leaves
        ln = np.concatenate([leaf_nodes, np.repeat(leaf_nodes[-1:], pad)]).reshape(blocks, width)
        li = np.concatenate([leaf_inst, np.repeat(leaf_inst[-1:], pad)]).reshape(blocks, width)
        valid = (np.arange(blocks * width) < n_leaves).reshape(blocks, width)
        x0, y0, z0, x1, y1, z1 = (P(k) for k in range(6))
        ccx, ccy, ccz = (x0 + x1) * FH, (y0 + y1) * FH, (z0 + z1) * FH
        chx, chy, chz = (x1 - x0) * FH, (y1 - y0) * FH, (z1 - z0) * FH
        body = jax.vmap(self._body(i, st))

        def block(carry, xs):
            acc, m = carry
            nb, ib, ok, kf = xs
            col = lambda arr, j: arr[:, j][:, None]   # noqa: E731
            b = _box(x[None] - col(nb, 0), y[None] - col(nb, 1), z[None] - col(nb, 2),
                     col(nb, 3), col(nb, 4), col(nb, 5)) * s[None]
            sk = col(ib, 7)
            lx, ly, lz = _qrot_conj(col(ib, 0), col(ib, 1), col(ib, 2), col(ib, 3),
                                    x[None] - col(ib, 4), y[None] - col(ib, 5), z[None] - col(ib, 6))
            lx, ly, lz = lx / sk, ly / sk, lz / sk
            ls = s[None] * sk
            cd = _box(lx - ccx, ly - ccy, lz - ccz, chx, chy, chz) * (sk * s[None])
            vals, mats = body(lx, ly, lz, ls, jnp.broadcast_to(kf[:, None], lx.shape))
            v = jnp.where(ok[:, None], jnp.maximum(vals, jnp.maximum(b, cd)), INF)
            for k in range(v.shape[0]):
                upd = v[k] < acc
                acc, m = jnp.where(upd, v[k], acc), jnp.where(upd, mats[k], m)
            return (acc, m), None

        xs = (nodes[ln], inst[li], jnp.asarray(valid), jnp.asarray(li.astype(np.float32)))
        init = (jnp.full(x.shape, INF), jnp.zeros(x.shape, jnp.int32))
        if blocks == 1:
            (acc, m), _ = block(init, tuple(a[0] for a in xs))
        else:
            (acc, m), _ = lax.scan(block, init, xs)
        st.regs[self.cols[end][1]] = (acc, m)


def _structure_key(tape: Tape) -> tuple:
    """What a traced program depends on besides the argument values (never the parameters)."""
    return (tape.instrs.tobytes(), len(tape.params), tape.n_regs, len(tape.instances),
            tape.bvh["skip"].tobytes(), tape.bvh["instance"].tobytes())


def _ladder(n: int) -> int:
    return max(LADDER_MIN, 1 << max(int(n) - 1, 1).bit_length())


@dataclass
class Gradients:
    """``JaxWalker.value_and_grad``'s result (numpy, float32).

    value (N,), material (N,) uint32, dx (N, 3): the spatial gradient df/dx at each point;
    dpool (P,): sum_i w_i df_i/dtheta for every pool entry (w the weights, default 1);
    dnamed: name -> dpool . d(pool)/d(name) for the names asked (the weighted total per named
    parameter: its own slots and those a scene's refit derives from it, ``runtime.tape.pool_tangents``);
    per_point: name -> (N,) df_i/dname at each point (forward mode), for the names asked."""
    value: np.ndarray
    material: np.ndarray
    dx: np.ndarray
    dpool: np.ndarray
    dnamed: dict
    per_point: dict


# On the CPU, the older loop emitters instead of the new fusion emitters: measured on 2 cores, the
# gradient program of a 105-record tape compiled in 18 s instead of 82 s and ran 4x faster
# (docs/JAX.md). A jaxlib whose CPU compiler has no such option (jax 0.11's: "No such compile
# option") gets none.
CPU_COMPILER_OPTIONS = {"xla_cpu_use_fusion_emitters": False}


@functools.cache
def cpu_options_accepted() -> bool:
    """Whether this jaxlib's CPU compiler takes CPU_COMPILER_OPTIONS: one tiny program compiled
    with them, once per process (an option it does not know is an INVALID_ARGUMENT error)."""
    try:
        jax.jit(lambda x: x + 1, compiler_options=CPU_COMPILER_OPTIONS).lower(np.float32(0)).compile()
    except Exception:        # (jax's runtime error class has moved between versions)
        return False
    return True


def compiler_options() -> dict | None:
    """XLA options of the walker's programs: CPU_COMPILER_OPTIONS on the CPU where the compiler
    takes them, else none."""
    if jax.default_backend() == "cpu" and cpu_options_accepted():
        return CPU_COMPILER_OPTIONS
    return None


class _Program:
    """The jitted functions of one tape structure (trace form) or one capacity bucket (generic)."""

    def __init__(self, field, chunk: int, field_jvp=None):
        self.field, self.chunk, self.field_jvp = field, chunk, field_jvp
        opts = compiler_options()
        self.values = jax.jit(self._values, compiler_options=opts)
        self.grads = jax.jit(self._grads, compiler_options=opts)
        self.vjp = jax.jit(self._vjp, compiler_options=opts)
        self.jvp = jax.jit(self._jvp, compiler_options=opts)

    def _split(self, pts, w=None):
        """Points (and weights) as chunks: (M / c, c, 3), c = min(M, the program's chunk)."""
        c = min(pts.shape[0], self.chunk)
        return pts.reshape(-1, c, 3) if w is None else (pts.reshape(-1, c, 3), w.reshape(-1, c))

    def _f(self, args, pts):
        return self.field(*args, pts[:, 0], pts[:, 1], pts[:, 2])

    def _tangent(self, args, t, pc):
        """df/dpool . t at the chunk pc (the form's own forward sweep where it has one)."""
        if self.field_jvp is not None:
            return self.field_jvp(args[0], t, *args[1:], pc[:, 0], pc[:, 1], pc[:, 2])
        return jax.jvp(lambda pool_: self._f((pool_,) + tuple(args[1:]), pc)[0], (args[0],), (t,))

    def _values(self, args, pts):
        d, m = lax.map(lambda pc: self._f(args, pc), self._split(pts))
        return d.reshape(-1), m.reshape(-1)

    def _grads(self, args, pts, w, tangents):
        pool = args[0]

        def step(acc, xs):
            pc, wc = xs

            def f(pool_, pc_):
                return self._f((pool_,) + tuple(args[1:]), pc_)
            d, back, m = jax.vjp(f, pool, pc, has_aux=True)
            dp, dpc = jax.vmap(back)(jnp.stack([wc, jnp.ones_like(wc)]))   # (one sweep, two cotangents)
            per = lax.map(lambda t: self._tangent(args, t, pc)[1], tangents,
                          batch_size=max(1, jax_cells.TANGENT_FILES_BYTES // GENERIC_ROWS_BYTES))
            return acc + dp[0], (d, m, dpc[1], per)

        dpool, (d, m, dx, per) = lax.scan(step, jnp.zeros_like(pool),
                                          self._split(pts, w))
        return (d.reshape(-1), m.reshape(-1), dx.reshape(-1, 3), dpool,
                jnp.moveaxis(per, 1, 0).reshape(tangents.shape[0], pts.shape[0]))

    def _vjp(self, args, pts, w):
        pool = args[0]

        def step(acc, xs):
            pc, wc = xs
            d, back = jax.vjp(lambda pool_: self._f((pool_,) + tuple(args[1:]), pc)[0], pool)
            return acc + back(wc)[0], d

        dpool, d = lax.scan(step, jnp.zeros_like(pool), self._split(pts, w))
        return d.reshape(-1), dpool

    def _jvp(self, args, pts, dpool):
        d, t = lax.map(lambda pc: self._tangent(args, dpool, pc), self._split(pts))
        return d.reshape(-1), t.reshape(-1)


# ----------------------------------------------------------------------------- the generic form
class PatternStep(NamedTuple):
    """A generic step of a pattern that is no record of the tape: a pattern's copies are unrolled
    into steps (its body's steps once per copy). ``kind``: "copy" (the point of copy ``aux``, a
    point step), "first" (copy 0's value clipped by its cell's bound: max(body, bound)), "next"
    (a later copy's, kept where below the running least: its material then, the first copy's on
    ties), "rest" (the least with the bound of the copies not evaluated, at the pattern's point);
    "index" (INSTANCE_INDEX in copy ``aux``'s body, at the pattern's point); ``pattern``: the
    REPEAT_* op. ``family`` and ``reads`` as the op table's entries."""
    kind: str
    pattern: Op

    @property
    def family(self) -> Family:
        return Family.POINT if self.kind == "copy" else Family.COMBINE

    @property
    def reads(self) -> str:
        return {"copy": "", "first": "a", "next": "ab", "rest": "a", "index": ""}[self.kind]


class MovedShape(NamedTuple):
    """A generic step of a shape record at its point translated by the TRANSLATE record right
    before it (PUSH TRANSLATE shape POP, the translation's three parameters right before the
    shape's in the pool: its parameter window starts at the translation's): the translation
    and the shape as one step, the same operations. ``family`` and ``reads`` the shape's."""
    shape: Op

    @property
    def family(self) -> Family:
        return Family.SHAPE

    @property
    def reads(self) -> str:
        return ""


_PATTERNS = (Op.REPEAT_LINEAR, Op.REPEAT_POLAR, Op.REPEAT_GRID)
_COPIES = {Op.REPEAT_LINEAR: 2, Op.REPEAT_POLAR: 2, Op.REPEAT_GRID: 8}
UNROLLED_STEPS_MAX = 1 << 16     # a tape whose patterns unroll to more generic steps gets the trace form

# Each supported op is one branch: (operands (3, C), their materials (3, C), point (4, C), params
# (GENERIC_PARAMS,)) -> (4, C) rows and their materials: a value op writes [v, 0, 0, 0] (rows past
# the first belong to later records, which write them again), a point op (x, y, z, scale).
GENERIC_PARAMS = 10     # (a moved capsule's 3 + 7; a grid pattern's nine)
_MOVED_SHAPES = (Op.SPHERE, Op.BOX, Op.ROUND_BOX, Op.CYLINDER, Op.CAPPED_CONE, Op.CAPSULE, Op.TORUS)
_GENERIC_OPS = ([Op.VAR_X, Op.VAR_Y, Op.VAR_Z, Op.CONST] + list(_ARITH)
                + [o for o in Op if OPS[o].family is Family.SHAPE and o not in POLY_OPS]
                + [MovedShape(o) for o in _MOVED_SHAPES]
                + [Op.TRANSLATE, Op.ROTATE, Op.SCALE, Op.MIRROR, Op.ELONGATE]
                + [o for o in Op if OPS[o].family is Family.COMBINE] + [Op.CULL_BOX, Op.FIELD_RESULT])
_RECORD_STEPS = len(_GENERIC_OPS)       # (the programs of a tape without patterns have these branches only)
_GENERIC_OPS += [PatternStep(kind, op) for op in _PATTERNS for kind in ("copy", "first", "next", "rest", "index")]
_BRANCH = {op: k for k, op in enumerate(_GENERIC_OPS)}
_MOVED_OPS = frozenset(int(o) for o in _MOVED_SHAPES)
_GENERIC_SKIP = (Op.PUSH, Op.POP, *_PATTERNS, Op.REPEAT_END, Op.INSTANCE_INDEX)   # renamings; patterns unrolled
_GENERIC_RECORDS = np.array([int(o) for o in (*_GENERIC_OPS, *_GENERIC_SKIP) if isinstance(o, Op)])


def cells_unsupported(tape: Tape) -> str | None:
    """Why the cell form cannot run ``tape`` (the generic form's reason, or no Lipschitz bound of
    its result: ``jax_cells.cells_unsupported``), or None."""
    why = generic_unsupported(tape)
    if why:
        return why
    g = _generic_tape(tape)
    return jax_cells.cells_unsupported(g.prog[:g.n_steps], tape.params, g.result, _GENERIC_OPS)


def _unsupported_record(tape: Tape) -> str | None:
    ops = tape.instrs["op"]
    bad = np.flatnonzero(~np.isin(ops, _GENERIC_RECORDS))
    if len(bad):
        return f"record {bad[0]}: {Op(int(ops[bad[0]])).name} is not supported by the generic JAX form"
    return None


def generic_unsupported(tape: Tape) -> str | None:
    """Why the generic form cannot run ``tape`` (the first record it does not support), or None."""
    why = _unsupported_record(tape)
    if why:
        return why
    try:
        _generic_tape(tape)                 # (INSTANCE_INDEX outside a pattern, patterns unrolled too far)
    except TaperayError as e:
        return str(e)
    return None


def _value_rows(v, m):
    z = jnp.zeros_like(v)
    zm = jnp.zeros_like(m)
    return jnp.stack([v, z, z, z]), jnp.stack([m, zm, zm, zm])


def _pattern_branch(step: PatternStep):
    def run(vals, mats, p, prm, aux):
        P = lambda k: prm[k]    # noqa: E731
        op = step.pattern
        if step.kind == "copy":
            px, py, pz, ps, _, _ = _pattern_copies(op, P, *p)
            return jnp.stack([px[aux], py[aux], pz[aux], ps[aux]]), jnp.zeros((4,) + p.shape[1:], jnp.int32)
        if step.kind == "index":
            return _value_rows(_pattern_copies(op, P, *p)[4][aux], jnp.zeros(p.shape[1:], jnp.int32))
        if step.kind == "rest":
            return _value_rows(_fmin(vals[0], _pattern_copies(op, P, *p)[5]), mats[0])
        v = jnp.maximum(vals[1 if step.kind == "next" else 0], _copy_bound(op, P, *p))
        if step.kind == "first":
            return _value_rows(v, mats[0])
        upd = v < vals[0]
        return _value_rows(jnp.where(upd, v, vals[0]), jnp.where(upd, mats[1], mats[0]))
    return run


def _moved_shape_branch(step: MovedShape):
    def run(vals, mats, p, prm, aux):
        x, y, z, s = _point_op(Op.TRANSLATE, lambda k: prm[k], p[0], p[1], p[2], p[3])
        return _value_rows(_shape(step.shape, lambda k: prm[3 + k], 0, x, y, z) * s, jnp.broadcast_to(aux, x.shape))
    return run


def _branch(op: Op):
    if isinstance(op, PatternStep):
        return _pattern_branch(op)
    if isinstance(op, MovedShape):
        return _moved_shape_branch(op)

    def run(vals, mats, p, prm, aux):
        P = lambda k: prm[k]    # noqa: E731
        x, y, z, s = p[0], p[1], p[2], p[3]
        zero = jnp.zeros(x.shape, jnp.int32)
        if op in (Op.VAR_X, Op.VAR_Y, Op.VAR_Z):
            return _value_rows(p[int(op)], zero)
        if op is Op.CONST:
            return _value_rows(jnp.broadcast_to(prm[0], x.shape), zero)
        fam = OPS[op].family
        if fam is Family.ARITH:
            va, vb, vc = vals[0], vals[1], vals[2]
            ma, mb = mats[0], mats[1]
            m = jnp.where(vb < va, mb, ma) if op is Op.MIN else (jnp.where(vb > va, mb, ma) if op is Op.MAX else ma)
            return _value_rows(_ARITH[op](va, vb, vc), m)
        if fam is Family.SHAPE:
            return _value_rows(_shape(op, P, 0, x, y, z) * s, jnp.broadcast_to(aux, x.shape))
        if fam is Family.POINT:
            return jnp.stack(_point_op(op, P, x, y, z, s)), jnp.zeros((4,) + x.shape, jnp.int32)
        if fam is Family.COMBINE:
            return _value_rows(*_combine(op, P, vals[0], mats[0], vals[1], mats[1]))
        if op is Op.CULL_BOX:
            return _value_rows(_cull_box(P, x, y, z, s), jnp.broadcast_to(aux, x.shape))
        return _value_rows(vals[0] * s, jnp.broadcast_to(aux, x.shape))      # FIELD_RESULT
    return run


_BRANCHES = [_branch(op) for op in _GENERIC_OPS]


def _branches(bucket: tuple) -> list:
    """The branches of a capacity bucket's programs: the patterns' steps only where its tapes have
    patterns (bucket[3]), so that the programs of the others compile without them."""
    return _BRANCHES if bucket[3] else _BRANCHES[:_RECORD_STEPS]


def _bucket(n: int, least: int) -> int:
    return max(least, 1 << max(int(n) - 1, 1).bit_length())


class _Steps:
    """The generic steps of a tape's records (``cols``: ``Tape.as_columns`` as lists), patterns
    unrolled: ``rows`` (one tuple a step: ``_GenericTape.prog``'s columns), ``n_rows`` (value
    rows used) and ``result`` (the result's row)."""

    def __init__(self, cols: list):
        self._cols = cols
        self.rows: list = []
        self.n_rows = 4
        regs: dict = {}
        self._emit(0, len(cols), regs, (0, 1, 2, 3), [], None)
        self.result = regs[0]

    def _step(self, op, point, param, ra=0, rb=0, rc=0, mat=0) -> int:
        """Appends one step; -> its first output row (a point step writes four)."""
        out = self.n_rows
        self.rows.append((_BRANCH[op], ra, rb, rc, *point, param, mat, out))
        self.n_rows += 4 if jax_cells.op_spec(op).family is Family.POINT else 1
        if len(self.rows) > UNROLLED_STEPS_MAX:
            raise TaperayError(f"the tape's patterns unroll to more than {UNROLLED_STEPS_MAX} generic steps")
        return out

    def _emit(self, i: int, end: int, regs: dict, point: tuple, stack: list, copy) -> None:
        """The steps of records i..end-1 at ``point`` (rows of x, y, z, scale); ``regs``: register ->
        row, updated; ``copy``: (pattern op, its point, its param offset, copy number) inside a
        pattern's body, else None."""
        cols = self._cols
        while i < end:
            op_i, dst, a, b, c, param, aux, jump = cols[i]
            op = Op(op_i)
            if op is Op.PUSH:
                stack.append(point)
            elif op is Op.POP:
                point = stack.pop()
            elif op in _PATTERNS:
                self._pattern(i, regs, point, stack)
                i = jump + 1
                continue
            elif self._moved_shape(i, end):
                shape, sdst, _, _, _, _, saux, _ = cols[i + 1]
                regs[sdst] = self._step(MovedShape(Op(shape)), point, param, mat=saux)
                i += 2          # (the POP after it restores the point)
                continue
            elif op is Op.INSTANCE_INDEX:
                if copy is None:
                    raise TaperayError(f"record {i}: INSTANCE_INDEX outside a pattern is not supported by the "
                                       "generic JAX form")
                pattern, at, pattern_param, k = copy
                regs[dst] = self._step(PatternStep("index", pattern), at, pattern_param, mat=k)
            else:
                reads = OPS[op].reads
                ra, rb, rc = (regs[r] if f in reads else 0 for f, r in zip("abc", (a, b, c)))
                mat = aux if OPS[op].family is Family.SHAPE or op in (Op.CULL_BOX, Op.FIELD_RESULT) else 0
                out = self._step(op, point, param, ra, rb, rc, mat)
                if OPS[op].family is Family.POINT:
                    point = (out, out + 1, out + 2, out + 3)
                else:
                    regs[dst] = out
            i += 1

    def _moved_shape(self, i: int, end: int) -> bool:
        """Records i, i + 1, i + 2 are TRANSLATE, a shape of ``_MOVED_SHAPES`` whose parameters
        follow the translation's, and POP (so the moved point serves that shape only)."""
        cols = self._cols
        if i + 2 >= end or cols[i][0] != Op.TRANSLATE or cols[i + 2][0] != Op.POP:
            return False
        shape = cols[i + 1]
        return shape[0] in _MOVED_OPS and shape[5] == cols[i][5] + 3

    def _pattern(self, i: int, regs: dict, point: tuple, stack: list) -> None:
        """A pattern's copies unrolled (as the twin evaluates them: the nearest cell and its
        neighbour, 2 x 2 x 2 for a grid): each copy's point, the body at it, the running least of
        the copies' clipped values; then the bound of the copies not evaluated."""
        op, param, end = Op(self._cols[i][0]), self._cols[i][5], self._cols[i][7]
        dst, body_result = self._cols[end][1], self._cols[end][2]
        acc = None
        for k in range(_COPIES[op]):
            c = self._step(PatternStep("copy", op), point, param, mat=k)
            copy = (c, c + 1, c + 2, c + 3)
            sub = dict(regs)
            self._emit(i + 1, end, sub, copy, list(stack), (op, point, param, k))
            if acc is None:
                acc = self._step(PatternStep("first", op), copy, param, ra=sub[body_result])
            else:
                acc = self._step(PatternStep("next", op), copy, param, ra=acc, rb=sub[body_result])
        regs[dst] = self._step(PatternStep("rest", op), point, param, ra=acc)


class _GenericTape:
    """A tape in the generic form's single-assignment layout. Columns of ``prog`` (int32, one row a
    step): branch, rows of a, b, c, rows of the point (x, y, z, scale: four consecutive rows, as a
    point step writes them), param offset, material
    (shapes, culls, FIELD_RESULT; a pattern's copy number), first output row. Rows 0-2 hold the
    point, row 3 the scale 1. A pattern is unrolled: its body's steps once per copy it evaluates
    (``PatternStep``). ``bucket`` (steps, rows, pool size: each rounded up a power-of-two ladder;
    1 where the tape has patterns, else 0)."""

    def __init__(self, tape: Tape):
        why = _unsupported_record(tape)
        if why:
            raise TaperayError(why)
        steps = _Steps(tape.as_columns().tolist())
        self.result = steps.result
        self.n_steps = len(steps.rows)
        self.bucket = (_bucket(self.n_steps, 64), _bucket(steps.n_rows + 4, 64),
                       _bucket(len(tape.params) + GENERIC_PARAMS, 64),
                       int(tape.has_patterns()))
        self.prog = np.zeros((self.bucket[0], 11), np.int32)
        self.prog[:self.n_steps] = steps.rows
        self.chunk = max(256, min(CHUNK, 1 << (GENERIC_ROWS_BYTES // (8 * self.bucket[1])).bit_length() - 1))

    def args(self, tape: Tape) -> tuple:
        pool = np.zeros(self.bucket[2], np.float32)
        pool[:len(tape.params)] = tape.params
        return (pool, self.prog, np.array([self.n_steps, self.result], np.int32))


_GENERIC_TAPES = Kept(16)


def _generic_tape(tape: Tape) -> _GenericTape:
    """``_GenericTape(tape)``, kept for the last 16 record lists (it depends on the records and the
    number of parameters only; read, not changed)."""
    return _GENERIC_TAPES.get((tape.instrs.tobytes(), len(tape.params)), lambda: _GenericTape(tape))


def _generic_sweep(bucket: tuple):
    """The generic form's forward sweep of one capacity bucket: (gather, forward), gather(V, M, row)
    -> a step's operand values, materials and point rows; forward(pool, prog, head, x, y, z) ->
    (V, M), every row's values and materials (rows, points)."""
    n_rows = bucket[1]

    def gather(V, M, row):
        ia, ib, ic = row[1], row[2], row[3]
        vals = jnp.stack([V[ia], V[ib], V[ic]])
        mats = jnp.stack([M[ia], M[ib], M[ic]])
        return vals, mats, lax.dynamic_slice(V, (row[4], 0), (4, V.shape[1]))    # (the point's rows: consecutive)

    def forward(pool, prog, head, x, y, z):
        V = jnp.zeros((n_rows, x.shape[0]), jnp.float32)
        V = V.at[0].set(x).at[1].set(y).at[2].set(z).at[3].set(jnp.ones_like(x))
        M = jnp.zeros((n_rows, x.shape[0]), jnp.int32)

        def step(t, vm):
            V, M = vm
            row = prog[t]
            vals, mats, p = gather(V, M, row)
            prm = lax.dynamic_slice(pool, (row[8],), (GENERIC_PARAMS,))
            out, outm = lax.switch(row[0], _branches(bucket), vals, mats, p, prm, row[9])
            return lax.dynamic_update_slice(V, out, (row[10], 0)), lax.dynamic_update_slice(M, outm, (row[10], 0))

        V, M = lax.fori_loop(0, head[0], step, (V, M))
        return V, M

    return gather, forward


def _generic_field(bucket: tuple):
    """The generic interpreter of one capacity bucket: field(pool, prog, head, x, y, z) ->
    (value, material), reverse mode by a custom VJP sweeping the steps backwards once."""
    gather, forward = _generic_sweep(bucket)

    @jax.custom_vjp
    def field(pool, prog, head, x, y, z):
        V, M = forward(pool, prog, head, x, y, z)
        return V[head[1]], M[head[1]]

    def fwd(pool, prog, head, x, y, z):
        V, M = forward(pool, prog, head, x, y, z)
        return (V[head[1]], M[head[1]]), (V, M, pool, prog, head)

    # on a CPU, a step no point of the chunk's adjoints reach is skipped (as the cells' reverse
    # sweep skips it; a GPU keeps one conditional a step)
    skip_unreached = jax.default_backend() == "cpu"

    def bwd(res, cts):
        V, M, pool, prog, head = res
        g = cts[0]
        G = jnp.zeros_like(V).at[head[1]].set(g)
        dpool = jnp.zeros_like(pool)

        def step(k, gd):
            G, dpool = gd
            t = head[0] - 1 - k
            row = prog[t]
            prm = lax.dynamic_slice(pool, (row[8],), (GENERIC_PARAMS,))
            gout = lax.dynamic_slice(G, (row[10], 0), (4, V.shape[1]))

            def pull_back(G, dpool):
                vals, mats, p = gather(V, M, row)
                dvals, dp, dprm = jax_cells.step_vjp(_branches(bucket), row[0], row[9], vals, mats, p, prm, gout)
                for j, r in enumerate((row[1], row[2], row[3])):
                    G = G.at[r].add(dvals[j])
                for j in range(4):
                    G = G.at[row[4 + j]].add(dp[j])
                cur = lax.dynamic_slice(dpool, (row[8],), (GENERIC_PARAMS,))
                return G, lax.dynamic_update_slice(dpool, cur + dprm, (row[8],))
            if not skip_unreached:
                return pull_back(G, dpool)
            return lax.cond(jnp.any(gout != 0), pull_back, lambda G, dpool: (G, dpool), G, dpool)

        G, dpool = lax.fori_loop(0, head[0], step, (G, dpool))
        return dpool, None, None, G[0], G[1], G[2]

    field.defvjp(fwd, bwd)

    def field_jvp(pool, dpool, prog, head, x, y, z):
        """(value, tangent along dpool): the steps swept forward with their tangent rows."""
        V, M = forward(pool, prog, head, x, y, z)
        T = jnp.zeros_like(V)

        def step(t, T):
            row = prog[t]
            vals, mats, p = gather(V, M, row)
            tv, _, tp = gather(T, M, row)
            prm = lax.dynamic_slice(pool, (row[8],), (GENERIC_PARAMS,))
            tprm = lax.dynamic_slice(dpool, (row[8],), (GENERIC_PARAMS,))
            tout = jax_cells.step_tangent(_branches(bucket), row[0], row[9], vals, mats, p, prm, tv, tp, tprm)
            return lax.dynamic_update_slice(T, tout, (row[10], 0))

        T = lax.fori_loop(0, head[0], step, T)
        return V[head[1]], T[head[1]]

    return field, field_jvp


def _cell_devices() -> list:
    """The devices the cell form spreads a call's pieces over: every host device on the CPU (one a
    core: ``HOST_DEVICES``), JAX's default device on an accelerator."""
    return jax.devices() if jax.default_backend() == "cpu" else jax.devices()[:1]


def _device_bytes() -> int | None:
    """The memory of JAX's default device, where its backend says (None on the CPU)."""
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except (RuntimeError, NotImplementedError, AttributeError):
        return None
    return stats.get("bytes_limit")


# ----------------------------------------------------------------------------- the walker
class JaxWalker:
    """The tape in JAX (float32): values, materials and derivatives w.r.t. the point and the pool.

    ``form``: "trace" (structure-specialised), "generic" (one program per capacity bucket) or
    "auto" (the generic form where it supports the tape and the tape is large, else the trace;
    docs/JAX.md). ``cache``: the persistent compilation cache directory (None: ``cache_dir()``
    unless TAPERAY_JAX_CACHE=0; False: off). ``cell_layout``: how the cell form cuts a call
    (``jax_cells.CellLayout``; None: ``layout_for`` JAX's default backend)."""

    name = "jax"
    capabilities = frozenset({"evaluate", "gradient", "derivatives"})   # (runtime.walkers.CAPABILITIES)
    FORMS = ("auto", "trace", "generic", "cells")
    GENERIC_FROM = 200      # "auto": records from which values take the generic form (docs/JAX.md)
    CELLS_FROM = 8192       # "auto": points from which the generic form runs cell by cell (docs/JAX.md)
    CELLS_MIN_STEPS = 32    # "auto": generic steps from which it does (fewer: little to prune, the plan costs more)

    def __init__(self, form: str = "auto", cache=None, cell_layout: CellLayout | None = None):
        if form not in self.FORMS:
            raise TaperayError(f"unknown JAX walker form {form!r} (forms: {', '.join(self.FORMS)})")
        self.form = form
        self.cell_layout = cell_layout
        self.cache = _enable_persistent_cache(cache)
        self._programs: dict = {}
        self._points_evaluated = 0
        self._cells = None

    @staticmethod
    def available() -> bool:
        return True

    @staticmethod
    def compiles() -> dict:
        """compile_stats(): process-wide XLA compile counts (see there)."""
        return compile_stats()

    def stats(self) -> dict:
        """``points_evaluated`` (by ``evaluate``), ``programs`` (the programs this walker holds:
        one per tape structure traced, one per capacity bucket of the generic form) and the
        process-wide ``compile_stats()``."""
        return dict(compile_stats(), points_evaluated=self._points_evaluated, programs=len(self._programs))

    def set_param(self, tape: Tape, name: str, value) -> None:
        """Set a named parameter on ``tape`` (``Tape.set_param``); the pool is an argument of the
        programs, so the next call sees the edit and compiles nothing."""
        tape.set_param(name, value)

    def render(self, tape: Tape, camera, width: int, height: int, view: str = "shade", settings=None,
               cells="auto"):
        """Not a capability of this walker: a TaperayError naming the walkers that render."""
        raise TaperayError("the jax walker evaluates points and their derivatives; it does not render "
                           "(render with the cpu or gpu walker)")

    # ------------------------------------------------------------------ preparation
    def form_for(self, tape: Tape, derivatives: bool = False, n_points: int | None = None) -> str:
        """The form running ``tape``: this walker's, or for "auto" the generic one where it
        supports the tape and either derivatives are asked for (of a tape without patterns: a
        small patterned tape's generic programs compile for many seconds, its trace in about one)
        or the tape has GENERIC_FROM records or more, else the trace; the generic form runs cell by
        cell ("cells") where the tape has a bound over a cell (``jax_cells.cells_unsupported``),
        CELLS_MIN_STEPS generic steps or more, and there are CELLS_FROM points or more. "cells"
        asked for on a tape without a bound runs the generic form.
        (Measured: the trace's compile grows with the records and is long for reverse mode; its
        steady values are the fastest on small tapes; cells skip what cannot matter.)"""
        form = self.form
        if form == "auto":
            large = len(tape) >= self.GENERIC_FROM
            if not ((large or (derivatives and not tape.has_patterns())) and generic_unsupported(tape) is None):
                return "trace"
            many = n_points is not None and n_points >= self.CELLS_FROM
            form = "cells" if many and _generic_tape(tape).n_steps >= self.CELLS_MIN_STEPS else "generic"
        if form == "cells":
            return "generic" if cells_unsupported(tape) else "cells"
        return form

    @property
    def cells_plan(self):
        """The ``jax_cells.CellPlan`` of this walker's last call run cell by cell (None before)."""
        return self._cells.last_plan if self._cells is not None else None

    def _cells_run(self, tape: Tape, points, what: str):
        """(runner, generic layout, float32 points) where the cell form runs this call, else None
        ("auto" and "cells" run ``evaluate``, ``vjp`` and ``value_and_grad`` cell by cell)."""
        if self.form not in ("auto", "cells"):
            return None
        pts = point_array(points, what, np.float32)
        VALIDATED.check(tape)
        if len(pts) == 0 or self.form_for(tape, what != "evaluate", len(pts)) != "cells":
            return None
        if self._cells is None:
            layout = self.cell_layout or layout_for(jax.default_backend(), _device_bytes())
            self._cells = CellsRunner(_GENERIC_OPS, _branches, GENERIC_PARAMS, layout,
                                      compiler_options(), _cell_devices())
        return self._cells, _generic_tape(tape), pts

    def _program(self, tape: Tape, n_points: int, derivatives: bool):
        VALIDATED.check(tape)
        form = self.form_for(tape, derivatives)
        if form in ("generic", "cells"):
            from_generic = _generic_tape(tape)
            key = ("generic",) + from_generic.bucket
            prog = self._programs.get(key)
            if prog is None:
                field, field_jvp = _generic_field(from_generic.bucket)
                prog = self._programs[key] = _Program(field, from_generic.chunk, field_jvp)
            args = from_generic.args(tape)
        else:
            key = ("trace",) + _structure_key(tape)
            prog = self._programs.get(key)
            if prog is None:
                prog = self._programs[key] = _Program(_Trace(tape).field, CHUNK)
            args = _trace_args(tape)
        return prog, args, _ladder(n_points)

    def _points(self, tape: Tape, points, what: str):
        pts = point_array(points, what, np.float32)
        prog, args, m = self._program(tape, len(pts), what != "evaluate")
        padded = np.empty((m, 3), np.float32)
        padded[:len(pts)] = pts
        padded[len(pts):] = pts[0] if len(pts) else 0.0
        return prog, args, padded, len(pts)

    def _weights(self, weights, n: int, m: int) -> np.ndarray:
        w = np.zeros(m, np.float32)
        if weights is None:
            w[:n] = 1.0
        else:
            wa = np.asarray(weights, np.float32)
            if wa.shape != (n,):
                raise TaperayError(f"weights must be ({n},), got {wa.shape}")
            w[:n] = wa
        return w

    # ------------------------------------------------------------------ the API
    def evaluate(self, tape: Tape, points) -> tuple[np.ndarray, np.ndarray]:
        """(N,) float32 distances and (N,) uint32 material ids at the (N, 3) points."""
        cells = self._cells_run(tape, points, "evaluate")
        if cells is not None:
            runner, generic, pts = cells
            self._points_evaluated += len(pts)
            d, m = runner.evaluate(generic, tape, pts)
            return d, m.astype(np.uint32)
        prog, args, pts, n = self._points(tape, points, "evaluate")
        self._points_evaluated += n
        if n == 0:
            return np.zeros(0, np.float32), np.zeros(0, np.uint32)
        d, m = prog.values(args, pts)
        return np.asarray(d)[:n], np.asarray(m)[:n].astype(np.uint32)

    def gradient(self, tape: Tape, points, eps: float | None = None) -> np.ndarray:
        """(N, 3) float32 df/dx, exact (``eps`` is accepted for CpuWalker's signature, unused)."""
        return self.value_and_grad(tape, points, names=()).dx

    def value_and_grad(self, tape: Tape, points, weights=None, names=None) -> Gradients:
        """Values, materials, df/dx (N, 3), the weighted pool gradient sum_i w_i df_i/dtheta (P,)
        and, for ``names`` (None: every named parameter), its total per name and per point
        df_i/dname (N,) (forward mode, one pass per name; a name's pool direction counts the slots
        a scene's refit derives from it, ``runtime.tape.pool_tangents``)."""
        names = sorted(tape.names) if names is None else list(names)
        for nm in names:
            if nm not in tape.names:
                raise TaperayError(f"no parameter named {nm!r} (have: {', '.join(sorted(tape.names)) or 'none'})")
        by_name = pool_tangents(tape, names)
        cells = self._cells_run(tape, points, "value_and_grad")
        if cells is not None:
            runner, generic, pts = cells
            n = len(pts)
            tangents = np.zeros((len(names), generic.bucket[2]), np.float32)
            for k, nm in enumerate(names):
                tangents[k, :len(tape.params)] = by_name[nm]
            d, m, dx, dpool, per = runner.grads(generic, tape, pts, self._weights(weights, n, n), tangents)
        else:
            prog, args, pts, n = self._points(tape, points, "value_and_grad")
            tangents = np.zeros((len(names), len(args[0])), np.float32)
            for k, nm in enumerate(names):
                tangents[k, :len(tape.params)] = by_name[nm]
            w = self._weights(weights, n, len(pts))
            d, m, dx, dpool, per = prog.grads(args, pts, w, tangents)
        dpool = np.asarray(dpool)[:len(tape.params)]
        per = np.asarray(per)
        return Gradients(np.asarray(d)[:n], np.asarray(m)[:n].astype(np.uint32), np.asarray(dx)[:n], dpool,
                         {nm: float(np.dot(dpool.astype(np.float64), by_name[nm])) for nm in names},
                         {nm: per[k, :n] for k, nm in enumerate(names)})

    def vjp(self, tape: Tape, points, weights) -> tuple[np.ndarray, np.ndarray]:
        """(values (N,), sum_i w_i df_i/dtheta (P,)): one forward and one reverse sweep, the
        adjoint a shape optimisation needs (w: the (N,) weights, e.g. an FEM adjoint's)."""
        cells = self._cells_run(tape, points, "vjp")
        if cells is not None:
            runner, generic, pts = cells
            d, dpool = runner.vjp(generic, tape, pts, self._weights(weights, len(pts), len(pts)))
            return d, dpool[:len(tape.params)]
        prog, args, pts, n = self._points(tape, points, "vjp")
        w = self._weights(weights, n, len(pts))
        d, dpool = prog.vjp(args, pts, w)
        return np.asarray(d)[:n], np.asarray(dpool)[:len(tape.params)]

    def jvp(self, tape: Tape, points, dpool) -> tuple[np.ndarray, np.ndarray]:
        """(values (N,), df/dtheta . dpool (N,)): forward mode along one pool direction (P,)."""
        prog, args, pts, n = self._points(tape, points, "jvp")
        t = np.zeros(len(args[0]), np.float32)
        dp = np.asarray(dpool, np.float32)
        if dp.shape != (len(tape.params),):
            raise TaperayError(f"dpool must be ({len(tape.params)},), got {dp.shape}")
        t[:len(dp)] = dp
        d, tan = prog.jvp(args, pts, t)
        return np.asarray(d)[:n], np.asarray(tan)[:n]

    def sensitivities(self, tape: Tape, points, names=None) -> dict:
        """name -> (N,) df_i/dname at each point, for ``names`` (None: every named parameter)."""
        return self.value_and_grad(tape, points, names=names).per_point


def _trace_args(tape: Tape) -> tuple:
    """The trace form's array arguments: the pool, the BVH boxes as (centre, half size) rows (the
    twin's float32 operations) and the instances as (q, t, s) rows (at least one row each)."""
    bvh = tape.bvh
    nodes = np.zeros((max(len(bvh), 1), 6), np.float32)
    if len(bvh):
        with np.errstate(over="ignore", invalid="ignore"):
            nodes[:len(bvh), 0:3] = (bvh["lo"] + bvh["hi"]) * FH
            nodes[:len(bvh), 3:6] = (bvh["hi"] - bvh["lo"]) * FH
    inst = np.zeros((max(len(tape.instances), 1), 8), np.float32)
    if len(tape.instances):
        inst[:len(tape.instances)] = np.ascontiguousarray(tape.instances).view(np.float32).reshape(-1, 8)
    return (np.asarray(tape.params, np.float32), nodes, inst)
