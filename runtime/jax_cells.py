"""The JAX walker's generic form run cell by cell: each cell of points runs only the records that
can matter there, and the result equals the unpruned generic form's.

Owns ``CellPlan`` (the points bucketed into grid cells and the steps each cell keeps),
``CellsProgram`` (the jitted programs of one capacity bucket: values, the pool gradient, df/dx
and forward tangents), ``CellsRunner`` (plans a call and runs it in calls of pieces), the
Lipschitz bounds (``lipschitz_rows``) and ``cells_unsupported`` (why a tape gets no cells). The
generic form's ops and branches come from runtime.jax_walker, which runs this module.

Which steps a cell keeps. The tape (the generic form's single-assignment steps) ends in a min /
max tree: UNION, INTERSECT, MIN and MAX steps whose operands are read once, from the result down.
An operand whose value is above the result's at every point of the cell changes neither the
result, nor its material, nor its derivatives (in a min / max tree, removing such an operand
changes only nodes that stay above the result; the selected path and its ties stay), so the cell
drops it: its parent reads the other operand twice (``min(a, a) = a``, a's material, the whole
derivative to a) and the steps only the dropped operand read go. The test is exact in the reals
and has slack for float32:
  * upper bound of the result over the cell, from the tree's operands up: an operand's value at
    the cell's centre plus L times the cell's half diagonal (L its Lipschitz bound in the
    point; inf where it has none), a min step's the least of its operands', a max step's the
    largest (so an operand without a bound, a pattern's say, stops none of the others dropping
    under a min);
  * lower bound of an operand: its value at the centre minus its own L times the half diagonal;
  * Lipschitz bounds (``lipschitz_rows``): shapes but ellipsoids and polygons, culls and the
    combines are 1-Lipschitz (a plane |n|), through translations, scales, elongations, rotations
    (|q|^2) and mirrors; arithmetic, ellipsoids, patterns and FIELD_RESULT have none, and a
    tape whose result has no upper bound is not cut into cells (the generic form runs it);
  * an operand is dropped where its lower bound exceeds the upper bound by ``MARGIN`` times
    (the scene's extent + |value| + (upper bound - value) + 1): float32 rounding of the values
    stays far below;
  * a max step whose operand is dropped is above the result as well and is dropped with it (its
    own lower bound may not show it, and reading its other operand twice would lower it).
The centres' values come from one forward sweep of every step at the centres, grouped as the
layout groups (``CellsProgram.rows``).
Where an operand's value is NaN the unpruned form returns NaN and a cell that dropped it does
not (the twin's culls skip such subtrees too).

Running the cells: a cell's points are split into pieces (the last one padded with copies of a
point); a call's pieces are split evenly over the runner's devices (on a CPU, one host device a
core: XLA runs a program on one core; ``jax.shard_map``, one program), and each device runs its
share in a ``lax.scan`` that carries
one row file (rows x piece), never cleared (each piece writes every row before it reads it; the
reverse sweep clears each output row once read, so its adjoint file comes back zero, and skips a
step whose output rows' adjoints are zero at every point of the piece: a min's operand no point
selects adds nothing). Each
piece runs its cell's kept steps (``items``: step and rewrite) through the generic form's
branches, in groups (``groups``): up to ``CellLayout.group`` steps of one branch whose operands
are all ready (one dependency level: 1 + the highest level of the steps whose rows it reads)
run as one step, the branch vmapped over them (levels ascending forward, descending in reverse);
with groups of one, the steps run one by one in tape order. The programs depend on the generic
capacity bucket and the layout only: no parameter edit and no topology edit inside the bucket
compiles anything.

How large cells, pieces and groups are (``CellLayout``) depends on the device. On a CPU the steps
cost their arithmetic, so small cells that keep few steps win, run one step at a time (a group's
padding lanes and its gathered copies of the rows cost more than the loop: ``CPU_LAYOUT``: 512
points a cell and a piece, 16 pieces a call and host device (``LARGE_CALLS`` times as many where a
plan fills such calls), groups of one). On a GPU a step costs its launch
whatever the piece's size, and the pieces run one after another, so the fewest pieces and the
fewest steps win (``ACCELERATOR_LAYOUT``: one piece of up to 262,144 points, as many as keep the
row file within an eighth of the device's memory, at least ``ACCELERATOR_ROW_BYTES``; groups of
16 steps): docs/JAX.md has the figures.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from .memo import Kept
from .opcodes import OPS, Family, Op
from .tape import Tape

__all__ = ["CellPlan", "CellsProgram", "CellsRunner", "CellLayout", "CPU_LAYOUT", "ACCELERATOR_LAYOUT",
           "layout_for", "cells_unsupported", "lipschitz_rows", "cell_grid", "op_spec", "step_tangent", "step_vjp",
           "MARGIN", "LARGE_CALLS", "TANGENT_FILES_BYTES", "PointLayout", "point_layout"]

MARGIN = 1e-4         # relative to the scene's extent: the drop test's slack for float32 rounding
LARGE_CALLS = 4       # a call of this many times the layout's pieces where a plan has as many (see CellsRunner)
TANGENT_FILES_BYTES = 1 << 30   # a forward-mode sweep's tangent row files at once (names in batches), at least
CENTRES = 512         # cell centres a call of the rows program
ACCELERATOR_ROW_BYTES = 1 << 31   # a GPU piece's row file (rows x piece float32) may take this much at least


class CellLayout(NamedTuple):
    """How a call is cut: about ``cell_points`` points a cell (the grid's size; at most a piece's), pieces of at most
    ``piece`` points (a cell's run; a larger cell runs as several pieces), ``per_call`` pieces a
    call; ``row_bytes``: where set, the piece shrinks (powers of two) until its row file fits;
    ``group``: steps run as one (of one level and one branch; 1: one by one, in tape order)."""
    cell_points: int
    piece: int
    per_call: int
    row_bytes: int | None = None
    group: int = 1

    def piece_for(self, n_rows: int) -> int:
        """Points a piece for a bucket of ``n_rows`` rows."""
        if self.row_bytes is None:
            return self.piece
        fit = max(1, self.row_bytes // (4 * n_rows))
        return max(512, min(self.piece, 1 << (fit.bit_length() - 1)))


CPU_LAYOUT = CellLayout(cell_points=512, piece=512, per_call=16)
ACCELERATOR_LAYOUT = CellLayout(cell_points=1 << 18, piece=1 << 18, per_call=1, row_bytes=ACCELERATOR_ROW_BYTES,
                                group=16)


def layout_for(backend: str, device_bytes: int | None = None) -> CellLayout:
    """The layout for JAX's default backend name ("cpu", "gpu", "cuda", "rocm", "tpu", ...); on an
    accelerator with ``device_bytes`` of memory, a row file may take an eighth of it (the reverse
    sweep holds three files: values, materials, adjoints)."""
    if backend == "cpu":
        return CPU_LAYOUT
    if device_bytes:
        return ACCELERATOR_LAYOUT._replace(row_bytes=max(ACCELERATOR_ROW_BYTES, device_bytes // 8))
    return ACCELERATOR_LAYOUT


_MINMAX = {Op.UNION: "min", Op.MIN: "min", Op.INTERSECT: "max", Op.MAX: "max"}
_LIP1_SHAPES = {Op.SPHERE, Op.BOX, Op.ROUND_BOX, Op.CYLINDER, Op.CAPPED_CONE, Op.CAPSULE, Op.TORUS}
_LIP_COMBINE = {Op.UNION, Op.INTERSECT, Op.DIFFERENCE, Op.XOR, Op.OFFSET, Op.SHELL, Op.SMOOTH_UNION,
                Op.SMOOTH_INTERSECT, Op.SMOOTH_DIFFERENCE, Op.MIN, Op.MAX, Op.COPY}


def op_spec(op):
    """The op table's entry of a generic step's op (its ``family`` and ``reads``); a step that is no
    record of the tape (a pattern's: runtime.jax_walker.PatternStep) carries its own."""
    return OPS[op] if isinstance(op, Op) else op


def step_tangent(branches, branch, aux, vals, mats, p, prm, tv, tp, tprm):
    """The tangent rows of one generic step (forward mode): its op's branch (number ``branch``,
    material ``aux``) differentiated by jax.jvp in its operand values ``vals``, point ``p`` and
    parameters ``prm`` along their tangents ``tv``, ``tp``, ``tprm`` (the generic form's jvp sweep;
    the cells' runs it over a group, ``branches`` vmapped)."""
    def branch_jvp(fn):
        def run(vals, p, prm, tv, tp, tprm):
            return jax.jvp(lambda v_, p_, q_: fn(v_, mats, p_, q_, aux)[0], (vals, p, prm), (tv, tp, tprm))[1]
        return run
    return lax.switch(branch, [branch_jvp(fn) for fn in branches], vals, p, prm, tv, tp, tprm)


def step_vjp(branches, branch, aux, vals, mats, p, prm, gout):
    """The cotangents (values, point, parameters) of one generic step (reverse mode): its op's
    branch (number ``branch``, material ``aux``) pulled back by jax.vjp from its output rows'
    cotangent ``gout`` (the generic form's reverse sweep; the cells' runs it over a group,
    ``branches`` vmapped)."""
    def branch_vjp(fn):
        def run(vals, p, prm, gout):
            _, back = jax.vjp(lambda v_, p_, q_: fn(v_, mats, p_, q_, aux)[0], vals, p, prm)
            return back(gout)
        return run
    return lax.switch(branch, [branch_vjp(fn) for fn in branches], vals, p, prm, gout)


_LIPSCHITZ = Kept(16)


def lipschitz_rows(steps: np.ndarray, pool: np.ndarray, generic_ops) -> dict:
    """A Lipschitz bound in the point of every value row of the generic layout's ``steps`` (rows as
    in ``_GenericTape``): shapes, culls and combines under the point ops; inf where a row's value
    comes through an op without one (arithmetic, ellipsoids, FIELD_RESULT). ``generic_ops``: the
    generic form's ops by branch number. Kept for the last 16 (steps, pool): read, not changed."""
    return _LIPSCHITZ.get((steps.tobytes(), np.asarray(pool).tobytes(), id(generic_ops)),
                          lambda: _lipschitz_rows(steps, pool, generic_ops))


def _lipschitz_rows(steps: np.ndarray, pool: np.ndarray, generic_ops) -> dict:
    lip = {0: 1.0}        # point rows (their first row) -> the point's factor
    val: dict[int, float] = {}
    for row in steps.tolist():
        op = generic_ops[row[0]]
        ra, rb, px, prm, out = row[1], row[2], row[4], row[8], row[10]
        lam = lip.get(px, np.inf)
        fam = op_spec(op).family
        if fam is Family.POINT:
            if op is Op.ROTATE:
                q = pool[prm:prm + 4].astype(np.float64)
                lam = lam * float(q @ q)
            elif op is Op.MIRROR:
                n = pool[prm:prm + 3].astype(np.float64)
                lam = lam * (1.0 + 4.0 * float(n @ n))
            elif op not in (Op.TRANSLATE, Op.SCALE, Op.ELONGATE):
                lam = np.inf
            lip[out] = lam
        elif getattr(op, "shape", op) in _LIP1_SHAPES or op is Op.CULL_BOX:     # (a moved shape's: its shape's)
            val[out] = lam
        elif op is Op.PLANE:
            n = pool[prm:prm + 3].astype(np.float64)
            val[out] = lam * float(np.sqrt(n @ n))
        elif op in _LIP_COMBINE:
            reads = op_spec(op).reads
            val[out] = max(val.get(ra, np.inf), val.get(rb, np.inf) if "b" in reads else 0.0)
        else:
            val[out] = np.inf
    return val


def cells_unsupported(steps: np.ndarray, pool: np.ndarray, result: int, generic_ops) -> str | None:
    """Why cells cannot prune these steps (None: they can): the result has no upper bound over a
    cell (``_Structure.upper``: none of a min's operands, or one of a max's, has a Lipschitz bound)."""
    if not np.isfinite(_upper_bounded(_structure(steps, result, generic_ops), result,
                                      lipschitz_rows(steps, pool, generic_ops))):
        return "no Lipschitz bound (arithmetic, ellipsoids, patterns or a transform without one)"
    return None


class _Structure:
    """What the plan needs of one tape structure: the min / max tree (its operand rows and the
    parent step of each) and the value rows each step reads."""

    def __init__(self, steps: np.ndarray, result: int, generic_ops):
        ops = [generic_ops[b] for b in steps[:, 0].tolist()]
        self.n = len(steps)
        producer, readers, written_by = set(), {}, {}
        self.value_reads = []
        self.level = np.zeros(self.n, np.int64)       # 1 + the highest level of the steps it reads (0: none)
        for s, (op, row) in enumerate(zip(ops, steps.tolist())):
            reads = "" if op is Op.CULL_BOX else op_spec(op).reads    # (the generic cull reads no value)
            rr = [row[1 + k] for k, f in enumerate("abc") if f in reads]
            self.value_reads.append(rr)
            for r in set(rr):
                readers[r] = readers.get(r, 0) + 1
            self.level[s] = max([self.level[written_by[r]] + 1 for r in rr + row[4:8] if r in written_by], default=0)
            point = op_spec(op).family is Family.POINT
            for j in range(4 if point else 1):
                written_by[row[10] + j] = s
            if not point:
                producer.add(row[10])
        # the min / max tree from the result down: operands read once, by a tree step
        on_tree = {result}
        self.parent = {}          # operand row -> (parent step, side 0 = a / 1 = b)
        self.tree = []            # the tree's steps, children first: ("min" | "max", output row, a row, b row)
        for s in range(self.n - 1, -1, -1):
            row = steps[s]
            if ops[s] in _MINMAX and int(row[10]) in on_tree and int(row[1]) != int(row[2]):
                self.tree.append((_MINMAX[ops[s]], int(row[10]), int(row[1]), int(row[2])))
                for side, r in enumerate((int(row[1]), int(row[2]))):
                    if readers.get(r, 0) == 1 and r in producer:
                        on_tree.add(r)
                        self.parent[r] = (s, side)
        self.tree.reverse()

    def upper(self, result: int, leaf):
        """An upper bound of the result row from its operands' (``leaf(row)``, e.g. their value at
        a cell's centre plus their Lipschitz bound times its half diagonal): a min step's is the
        least of its operands', a max step's the largest; inf where none holds."""
        up: dict = {}
        for kind, out, a, b in self.tree:
            ua, ub = (up[r] if r in up else leaf(r) for r in (a, b))
            up[out] = np.minimum(ua, ub) if kind == "min" else np.maximum(ua, ub)
        return up[result] if result in up else leaf(result)


def _upper_bounded(st: _Structure, result: int, lips: dict) -> float:
    """0 where the result has an upper bound over a cell (``_Structure.upper``), else inf."""
    return st.upper(result, lambda r: 0.0 if np.isfinite(lips.get(r, np.inf)) else np.inf)


_STRUCTURES = Kept(16)


def _structure(steps: np.ndarray, result: int, generic_ops) -> _Structure:
    return _STRUCTURES.get((steps.tobytes(), result), lambda: _Structure(steps, result, generic_ops))


def cell_grid(n_points: int, cell_points: int) -> int:
    """Cells per axis of the grid over the points' box: a power of two (so that a lattice of a power of
    two points a side splits evenly), for about ``cell_points`` points a cell."""
    return 1 << max(0, int(round(np.log2(max(n_points / cell_points, 1.0)) / 3)))


class PointLayout(NamedTuple):
    """A point set's cells and pieces (``point_layout``). The cells of a grid over the points' box
    (``cell_grid``): ``order`` the point indices sorted by cell (stable), ``first`` / ``counts``
    each occupied cell's first position in that order and its count, ``cmin`` / ``cmax`` its
    points' box ((K, 3) float64). Pieces of at most ``piece`` points, a cell's points in runs:
    ``cell_of`` (n_pieces,) each piece's cell, ``index`` (n_pieces, piece) point indices (the
    padding repeats a piece's first point), ``valid`` (n_pieces, piece) bool, ``point_slot`` /
    ``point_index`` the valid slots of the flattened pieces and the point in each, and
    ``piece_points`` (n_pieces, piece, 3) float32 the points in their slots."""
    order: np.ndarray
    first: np.ndarray
    counts: np.ndarray
    cmin: np.ndarray
    cmax: np.ndarray
    cell_of: np.ndarray
    index: np.ndarray
    valid: np.ndarray
    point_slot: np.ndarray
    point_index: np.ndarray
    piece_points: np.ndarray


class _SamePoints:
    """A point set as a ``Kept`` key: hashed by a sample of its points, equal to a key holding the
    same points (compared whole). It holds a copy: the caller's array may change in place."""
    __slots__ = ("points", "_hash")

    def __init__(self, points: np.ndarray):
        self.points = points.copy()
        self._hash = hash((points.shape, points[::max(1, len(points) // 256)].tobytes()))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return (isinstance(other, _SamePoints) and self.points.shape == other.points.shape
                and np.array_equal(self.points, other.points))


_LAYOUTS = Kept(2)


def point_layout(points: np.ndarray, cell_points: int, piece: int) -> PointLayout:
    """The ``PointLayout`` of ``points`` for cells of about ``cell_points`` points and pieces of
    ``piece``. Kept for the last 2 point sets, found again by comparing the points (FEM and
    optimisation loops call with the same points; an array changed in place is laid out again);
    its arrays are shared: read, not changed."""
    xyz = np.ascontiguousarray(points, np.float32)
    return _LAYOUTS.get((cell_points, piece, _SamePoints(xyz)), lambda: _point_layout(xyz, cell_points, piece))


def _point_layout(xyz: np.ndarray, cell_points: int, piece: int) -> PointLayout:
    """``point_layout`` computed."""
    order, first, counts, cmin, cmax = _bucket_points(xyz, cell_points)
    pieces = -(-counts // piece)
    cell_of = np.repeat(np.arange(len(first)), pieces)
    start = np.repeat(first, pieces) + (np.arange(len(cell_of)) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * piece
    stop = np.minimum(start + piece, np.repeat(first + counts, pieces))
    pos = start[:, None] + np.arange(piece)[None, :]
    valid = pos < stop[:, None]
    index = order[np.where(valid, pos, start[:, None])]
    point_slot = np.flatnonzero(valid.reshape(-1))
    layout = PointLayout(order, first, counts, cmin, cmax, cell_of, index, valid, point_slot,
                         index.reshape(-1)[point_slot], np.take(xyz, index, axis=0))
    for a in layout:
        a.setflags(write=False)
    return layout


def _bucket_points(points: np.ndarray, cell_points: int):
    """The cells of ``point_layout`` (order, first, counts, cmin, cmax). (Column by column:
    numpy's reductions along the short axis of an (N, 3) array are some 30x slower.)"""
    xyz = np.ascontiguousarray(points.T)
    lo, hi = xyz.min(1).astype(np.float64), xyz.max(1).astype(np.float64)
    n = xyz.shape[1]
    g = cell_grid(n, cell_points)
    if g == 1:
        return np.arange(n), np.zeros(1, np.int64), np.array([n]), lo[None], hi[None]
    size = np.maximum((hi - lo) / g, 1e-30)
    i, j, k = (np.clip(((xyz[a] - lo[a]) / size[a]).astype(np.int64), 0, g - 1) for a in range(3))
    cid = (i * g + j) * g + k
    order = np.argsort(cid.astype(np.int16) if g ** 3 <= 1 << 15 else cid, kind="stable")   # (int16: a radix sort)
    ids = cid[order]
    first = np.flatnonzero(np.concatenate(([True], ids[1:] != ids[:-1])))
    counts = np.diff(np.append(first, len(ids)))
    sorted_xyz = np.take(xyz, order, axis=1)
    cmin = np.minimum.reduceat(sorted_xyz, first, axis=1).T.astype(np.float64)
    cmax = np.maximum.reduceat(sorted_xyz, first, axis=1).T.astype(np.float64)
    return order, first, counts, cmin, cmax


def _liveness(st: _Structure, steps: np.ndarray, result: int, rewrite: np.ndarray) -> np.ndarray:
    """(cells, steps) bool: the steps each cell needs, from the result down (a rewritten parent,
    per ``rewrite``, does not need the operand it no longer reads). The cells are bits of one
    Python int per row (a step costs a few integer operations whatever the number of cells)."""
    K, S = rewrite.shape
    steps_rewritten = np.flatnonzero(rewrite.any(0)).tolist()
    cols = rewrite[:, steps_rewritten]
    drops = dict(zip(steps_rewritten, zip(_bits(cols == 1), _bits(cols == 2))))
    outs, point_rows = steps[:, 10].tolist(), steps[:, 4].tolist()
    live_row = {result: (1 << K) - 1}
    live = [0] * S
    for s in range(S - 1, -1, -1):
        lv = live_row.get(outs[s], 0)
        if not lv:
            continue
        live[s] = lv
        rr = st.value_reads[s]
        drop_b, drop_a = drops.get(s, (0, 0)) if len(rr) >= 2 else (0, 0)
        for k, r in enumerate(rr):
            need = lv & ~(drop_a if k == 0 else drop_b if k == 1 else 0)
            live_row[r] = live_row.get(r, 0) | need
        if point_rows[s]:
            live_row[point_rows[s]] = live_row.get(point_rows[s], 0) | lv
    nbytes = (K + 7) // 8
    packed = np.frombuffer(b"".join(v.to_bytes(nbytes, "little") for v in live), np.uint8).reshape(S, nbytes)
    return np.unpackbits(packed, axis=1, count=K, bitorder="little").T.astype(bool)


def _bits(mask: np.ndarray) -> list[int]:
    """Each column of a (K, n) bool array as the bits of a Python int (row i: bit i)."""
    packed = np.ascontiguousarray(np.packbits(mask, axis=0, bitorder="little").T)
    return [int.from_bytes(col.tobytes(), "little") for col in packed]


class CellPlan:
    """The cells of ``points`` (a grid over their box) and what each keeps of ``steps`` (the
    generic layout, unpadded; ``result`` its result row). ``rows_at(centres)`` gives every row's
    value at the (K, 3) cell centres ((rows, K), the generic forward's). Pieces of at most
    ``piece`` points run one cell's kept steps: ``index``, ``valid``, ``point_slot``,
    ``point_index`` and ``piece_points`` are the points' ``PointLayout``'s, ``items``
    (n_pieces, n_steps_bucket, 2) int32 (step, rewrite: 0 none, 1 b <- a, 2 a <- b), the kept
    steps in groups: ``groups`` (n_pieces, n_steps_bucket, 2) int32 (first item, count), ``n_groups``
    (n_pieces,). A group is at most ``group`` steps of one branch and one dependency level (none
    reads another's rows), sorted by level: a group runs as one step over its members. ``level``
    and ``branch`` (n_steps,): each step's dependency level and branch number."""

    def __init__(self, steps: np.ndarray, result: int, pool: np.ndarray, points: np.ndarray, rows_at,
                 piece: int, steps_bucket: int, generic_ops, cell_points: int, extent: float = 1.0,
                 group: int = 1):
        n, S = len(points), len(steps)
        lay = point_layout(points, cell_points, piece)
        counts, cmin, cmax = lay.counts, lay.cmin, lay.cmax
        K = len(counts)
        centre = ((cmin + cmax) * 0.5).astype(np.float32)
        half = np.sqrt((((cmax - cmin) * 0.5) ** 2).sum(1)) * (1 + 1e-6)
        st = _structure(steps, result, generic_ops)
        rewrite = np.zeros((K, S), np.int8)
        gone: dict[int, np.ndarray] = {}
        lips = lipschitz_rows(steps, pool, generic_ops)
        bounded = [r for r in st.parent if np.isfinite(lips.get(r, np.inf))]
        if bounded and np.isfinite(_upper_bounded(st, result, lips)):
            V = np.asarray(rows_at(centre), np.float64)
            cv = V[result]
            with np.errstate(invalid="ignore"):
                upper = st.upper(result, lambda r: V[r] + lips.get(r, np.inf) * half)
                slack = MARGIN * (extent + np.abs(cv) + (upper - cv) + 1.0)
            lr = np.array([lips[r] for r in bounded])
            above = V[bounded] - lr[:, None] * half > upper + slack     # (operands, cells)
            gone = {bounded[i]: above[i] for i in np.flatnonzero(above.any(1))}
        # where a max's operand is above the result, so is the max (where both of a min's, the min),
        # though its own bound may not show it: its parent drops it rather than it its operand
        none = np.zeros(K, bool)
        for kind, out, a, b in st.tree:
            if out in st.parent and (a in gone or b in gone):
                ga, gb = gone.get(a, none), gone.get(b, none)
                gone[out] = gone.get(out, none) | ((ga | gb) if kind == "max" else (ga & gb))
        # a dropped operand's parent reads the other operand twice, unless the parent is dropped too
        for r, g_r in gone.items():
            s, side = st.parent[r]
            keep = g_r & ~gone.get(int(steps[s, 10]), none)
            rewrite[keep, s] = 1 if side == 1 else 2
        live = _liveness(st, steps, result, rewrite)
        kept = live.sum(1)
        self.kept, self.n_cells, self.n_points = kept, K, n
        self.point_steps = int((kept * counts).sum())
        self.n_steps = S
        cell_of = lay.cell_of
        self.index, self.valid, self.piece_points = lay.index, lay.valid, lay.piece_points
        self.point_slot, self.point_index = lay.point_slot, lay.point_index
        items, groups, n_groups = _grouped(live, rewrite, _group_keys(st, steps, generic_ops, group), group,
                                           steps_bucket)
        self.point_groups = int((n_groups * counts).sum())
        one_each = len(cell_of) == K          # (a piece a cell: no copy)
        self.items, self.groups = (items, groups) if one_each else (items[cell_of], groups[cell_of])
        self.n_groups = n_groups[cell_of].astype(np.int32)
        self.level, self.branch = st.level[:S], np.asarray(steps[:, 0])


def _group_keys(st: _Structure, steps: np.ndarray, generic_ops, group: int) -> np.ndarray:
    """Each step's group key: (dependency level, branch) for groups, none for groups of one (the
    steps in tape order)."""
    return st.level * len(generic_ops) + steps[:, 0] if group > 1 else np.zeros(len(steps), np.int64)


def _grouped(live: np.ndarray, rewrite: np.ndarray, key: np.ndarray, group: int, steps_bucket: int):
    """(items, groups, n_groups) of cells (``CellPlan``'s, one row a cell) from their (K, S) ``live``
    steps and ``rewrite``s: the kept steps sorted by (key, step), cut into groups of at most
    ``group`` of one key."""
    K, S = live.shape
    kept = live.sum(1)
    if group == 1:          # (the CPU's layout: each kept step a group, in tape order; no sort)
        c, s = np.nonzero(live)
        rank = np.arange(len(c)) - np.repeat(np.cumsum(kept) - kept, kept)
        items = np.zeros((K, steps_bucket, 2), np.int32)
        items[c, rank, 0] = s
        items[c, rank, 1] = rewrite[c, s]
        groups = np.zeros((K, steps_bucket, 2), np.int32)
        groups[c, rank, 0] = rank
        groups[c, rank, 1] = 1
        return items, groups, kept
    step_order = np.argsort(np.where(live, key * S + np.arange(S), np.iinfo(np.int64).max), axis=1)
    ks = np.take_along_axis(np.where(live, key, -1), step_order, 1)
    j = np.arange(S)
    first_of_run = np.ones((K, S), bool)
    first_of_run[:, 1:] = ks[:, 1:] != ks[:, :-1]
    last_of_run = np.ones((K, S), bool)
    last_of_run[:, :-1] = first_of_run[:, 1:]
    run_first = np.maximum.accumulate(np.where(first_of_run, j, 0), axis=1)
    run_last = np.minimum.accumulate(np.where(last_of_run, j, S)[:, ::-1], axis=1)[:, ::-1]
    starts = ((j - run_first) % group == 0) & (j < kept[:, None])
    n_groups = starts.sum(1)
    c, at = np.nonzero(starts)
    rank = np.arange(len(c)) - np.repeat(np.cumsum(n_groups) - n_groups, n_groups)
    groups = np.zeros((K, steps_bucket, 2), np.int32)
    groups[c, rank, 0] = at
    groups[c, rank, 1] = np.minimum(group, run_last[c, at] - at + 1)
    items = np.zeros((K, steps_bucket, 2), np.int32)
    items[:, :S, 0] = step_order
    items[:, :S, 1] = np.take_along_axis(rewrite, step_order, 1)
    return items, groups, n_groups


def _every_step(steps: np.ndarray, result: int, generic_ops, group: int, steps_bucket: int):
    """(items, groups, n_groups) running every step of ``steps`` (no cell, no rewrite): what the
    rows at the cells' centres run."""
    S = len(steps)
    st = _structure(steps, result, generic_ops)
    items, groups, n_groups = _grouped(np.ones((1, S), bool), np.zeros((1, S), np.int8),
                                       _group_keys(st, steps, generic_ops, group), group, steps_bucket)
    return items[0], groups[0], n_groups[0].astype(np.int32)


def _no_materials(vals):
    """The operands' materials where no material file is kept (M None: the values' sweeps of a
    vjp, the reverse and tangent sweeps): zeros, which no branch's value reads."""
    return jnp.zeros(vals.shape, jnp.int32)


def _single_steps(branches, n_prm: int, P: int):
    """The step functions of groups of one step (forward, backward, tangent): a group's row, its
    operands gathered, its branch switched on, its output rows written as one slice. A material
    file ``M`` of None: none kept (values only)."""
    def one(prog, items, grp, pool):
        """A group of one step: its row, operand rows a / b (rewritten) and parameters."""
        item = items[grp[0]]
        row = prog[item[0]]
        ia = jnp.where(item[1] == 2, row[2], row[1])
        ib = jnp.where(item[1] == 1, row[1], row[2])
        return row, ia, ib, lax.dynamic_slice(pool, (row[8],), (n_prm,))

    def one_gather(V, M, row, ia, ib):
        """A step's operand rows a / b / c, their materials, and its point's four rows: consecutive
        (a point step writes x, y, z, scale in a row each), read as one slice."""
        vals = jnp.stack([V[ia], V[ib], V[row[3]]])
        mats = _no_materials(vals) if M is None else jnp.stack([M[ia], M[ib], M[row[3]]])
        return vals, mats, lax.dynamic_slice(V, (row[4], 0), (4, V.shape[1]))

    def one_forward(pool, prog, items, grp, V, M):
        row, ia, ib, prm = one(prog, items, grp, pool)
        vals, mats, p = one_gather(V, M, row, ia, ib)
        out, outm = lax.switch(row[0], branches, vals, mats, p, prm, row[9])
        return (lax.dynamic_update_slice(V, out, (row[10], 0)),
                None if M is None else lax.dynamic_update_slice(M, outm, (row[10], 0)))

    def one_backward(pool, prog, items, grp, V, M, G, dpool):
        row, ia, ib, prm = one(prog, items, grp, pool)
        gout = lax.dynamic_slice(G, (row[10], 0), (4, P))

        def pull_back(G, dpool):
            vals, mats, p = one_gather(V, M, row, ia, ib)
            dvals, dp, dprm = step_vjp(branches, row[0], row[9], vals, mats, p, prm, gout)
            # one scatter after the reads: the output rows cleared (g - g), the operands' added
            out = row[10]
            targets = jnp.stack([out, out + 1, out + 2, out + 3, ia, ib, row[3], row[4], row[5], row[6], row[7]])
            G = G.at[targets].add(jnp.concatenate([-gout, dvals, dp]), mode="promise_in_bounds")
            cur = lax.dynamic_slice(dpool, (row[8],), (n_prm,))
            return G, lax.dynamic_update_slice(dpool, cur + dprm, (row[8],))
        # a step none of whose piece's points' adjoints reach (a min's operand no point selects)
        # adds nothing: skipped (a NaN adjoint is not zero, and runs)
        return lax.cond(jnp.any(gout != 0), pull_back, lambda G, dpool: (G, dpool), G, dpool)

    def one_tangent(pool, tpool, prog, items, grp, V, M, T):
        row, ia, ib, prm = one(prog, items, grp, pool)
        vals, mats, p = one_gather(V, M, row, ia, ib)
        tv, _, tp = one_gather(T, M, row, ia, ib)
        tprm = lax.dynamic_slice(tpool, (row[8],), (n_prm,))
        tout = step_tangent(branches, row[0], row[9], vals, mats, p, prm, tv, tp, tprm)
        return lax.dynamic_update_slice(T, tout, (row[10], 0))

    return one_forward, one_backward, one_tangent


def _grouped_steps(branches, widths, group: int, n_prm: int, n_rows: int, scratch_prm: int):
    """The step functions of groups of up to ``group`` steps (forward, backward, tangent): the
    members' rows gathered, the branch vmapped over them, their output rows scattered back (lanes past
    the count write the scratch rows and parameters). A material file ``M`` of None: none kept."""
    scratch = n_rows - 4
    lanes, four, window = jnp.arange(group), jnp.arange(4), jnp.arange(n_prm)
    vbranches = [jax.vmap(fn) for fn in branches]

    def members(prog, items, grp, pool):
        """A group's rows: branch, rows (group, 11), operand rows a / b / c (rewritten), parameters,
        output rows (group, 4: scratch past the group's count and past the op's outputs), lanes
        inside the count."""
        valid = lanes < grp[1]
        it = items[grp[0] + jnp.where(valid, lanes, 0)]
        rows = prog[it[:, 0]]
        ia = jnp.where(it[:, 1] == 2, rows[:, 2], rows[:, 1])
        ib = jnp.where(it[:, 1] == 1, rows[:, 1], rows[:, 2])
        branch = rows[0, 0]
        out = jnp.where(valid[:, None] & (four < widths[branch])[None, :], rows[:, 10:11] + four, scratch + four)
        reads = jnp.stack([ia, ib, rows[:, 3]], 1)
        return branch, rows, reads, pool[rows[:, 8:9] + window], out, valid

    def group_gather(V, M, rows, reads):
        vals = V[reads]
        return vals, _no_materials(vals) if M is None else M[reads], V[rows[:, 4:8]]

    def group_forward(pool, prog, items, grp, V, M):
        branch, rows, reads, prm, out, _ = members(prog, items, grp, pool)
        vals, mats, p = group_gather(V, M, rows, reads)
        o, om = lax.switch(branch, vbranches, vals, mats, p, prm, rows[:, 9])
        return V.at[out].set(o), None if M is None else M.at[out].set(om)

    def group_backward(pool, prog, items, grp, V, M, G, dpool):
        branch, rows, reads, prm, out, valid = members(prog, items, grp, pool)
        vals, mats, p = group_gather(V, M, rows, reads)
        gout = jnp.where((out < scratch)[:, :, None], G[out], 0.0)

        dvals, dp, dprm = step_vjp(vbranches, branch, rows[:, 9], vals, mats, p, prm, gout)
        # one scatter after the reads: the output rows cleared (g - g), the operands' added
        targets = jnp.where(valid[:, None], jnp.concatenate([out, reads, rows[:, 4:8]], 1), scratch)
        G = G.at[targets].add(jnp.concatenate([-gout, dvals, dp], 1))
        return G, dpool.at[jnp.where(valid, rows[:, 8], scratch_prm)[:, None] + window].add(dprm)

    def group_tangent(pool, tpool, prog, items, grp, V, M, T):
        branch, rows, reads, prm, out, _ = members(prog, items, grp, pool)
        vals, mats, p = group_gather(V, M, rows, reads)
        tv, _, tp = group_gather(T, M, rows, reads)
        tout = step_tangent(vbranches, branch, rows[:, 9], vals, mats, p, prm, tv, tp,
                            tpool[rows[:, 8:9] + window])
        return T.at[out].set(tout)

    return group_forward, group_backward, group_tangent


def _sweeps(steps, P: int, n_rows: int, scratch_prm: int, tangent_bytes: int):
    """The cell programs (values, vjp, grads) of a piece of ``P`` points over the groups' ``steps``
    (forward, backward, tangent), each a scan over a call's pieces carrying one row file; and
    ``rows``: every row's values at a piece of any size (the cells' centres), one forward sweep.
    ``grads`` sweeps the forward tangents of as many names together as keep their row files
    within ``tangent_bytes``, batch after batch."""
    step_forward, step_backward, step_tangent_rows = steps
    scratch = n_rows - 4
    tangent_batch = max(1, tangent_bytes // (4 * n_rows * P))    # (names swept together: their files fit)

    def start(V, pts):
        return V.at[0:3].set(pts.T).at[3].set(jnp.ones(pts.shape[0], jnp.float32))

    def forward(pool, prog, items, groups, n, V, M, pts):
        V = start(V, pts)
        return lax.fori_loop(0, n, lambda t, vm: step_forward(pool, prog, items, groups[t], *vm), (V, M))

    def backward(pool, prog, items, groups, n, V, G, dpool, g, result):
        """G comes and goes all zero: a step's output rows are cleared once read (the scratch rows
        and parameters after the sweep)."""
        G = G.at[result].set(g)
        G, dpool = lax.fori_loop(0, n, lambda k, gd: step_backward(pool, prog, items, groups[n - 1 - k], V, None, *gd),
                                 (G, dpool))
        dx = G[0:3]
        return G.at[0:4].set(0.0).at[scratch:].set(0.0), dpool.at[scratch_prm:].set(0.0), dx

    def tangent(pool, tpool, prog, items, groups, n, V, T):
        T = T.at[0:4].set(0.0)
        return lax.fori_loop(0, n, lambda t, T: step_tangent_rows(pool, tpool, prog, items, groups[t], V, None, T), T)

    def files():
        return jnp.zeros((n_rows, P), jnp.float32), jnp.zeros((n_rows, P), jnp.int32)

    def values(pool, prog, items, groups, n_groups, pts, result):
        def one(vm, xs):
            it, gr, n, pc = xs
            V, M = forward(pool, prog, it, gr, n, *vm, pc)
            return (V, M), (V[result], M[result])
        _, (d, m) = lax.scan(one, files(), (items, groups, n_groups, pts))
        return d, m

    def vjp(pool, prog, items, groups, n_groups, pts, w, result):
        def one(carry, xs):
            V, G, dpool = carry
            it, gr, n, pc, wc = xs
            V, _ = forward(pool, prog, it, gr, n, V, None, pc)
            G, dpool, _ = backward(pool, prog, it, gr, n, V, G, dpool, wc, result)
            return (V, G, dpool), V[result]
        V = jnp.zeros((n_rows, P), jnp.float32)
        (_, _, dpool), d = lax.scan(one, (V, jnp.zeros_like(V), jnp.zeros_like(pool)),
                                    (items, groups, n_groups, pts, w))
        return d, dpool

    def grads(pool, prog, items, groups, n_groups, pts, w, tangents, result, unit_weights=False):
        """``unit_weights``: every point's weight is 1 (0 past a piece's points), so df/dx comes
        from the weighted reverse sweep itself (a point's adjoint is its weight times df/dx); else
        from a second sweep with weights 1."""
        def one(carry, xs):
            V, M, G, dpool = carry
            it, gr, n, pc, wc = xs
            V, M = forward(pool, prog, it, gr, n, V, M, pc)
            G, dpool, dx = backward(pool, prog, it, gr, n, V, G, dpool, wc, result)
            if not unit_weights:
                G, _, dx = backward(pool, prog, it, gr, n, V, G, jnp.zeros_like(pool), jnp.ones_like(wc), result)
            per = lax.map(lambda t: tangent(pool, t, prog, it, gr, n, V, jnp.zeros_like(V))[result], tangents,
                          batch_size=tangent_batch)
            return (V, M, G, dpool), (V[result], M[result], dx.T, per)
        V, M = files()
        (_, _, _, dpool), (d, m, dx, per) = lax.scan(one, (V, M, jnp.zeros_like(V), jnp.zeros_like(pool)),
                                                      (items, groups, n_groups, pts, w))
        return d, m, dx, dpool, per

    def rows(pool, prog, items, groups, n, pts):
        return forward(pool, prog, items, groups, n, jnp.zeros((n_rows, pts.shape[0]), jnp.float32), None, pts)[0]

    return values, vjp, grads, rows


class CellsProgram:
    """The jitted cell programs of one generic capacity bucket: pieces of ``piece`` points, ``per_call``
    pieces a call (a scan over them carrying one row file, never cleared: every row a piece reads
    it wrote first). ``values``, ``vjp`` (weights -> the pool gradient), ``grads`` (values,
    materials, df/dx, the weighted pool gradient, forward tangents along pool directions) and
    ``rows`` (the centres' rows for the plan).

    A piece runs its groups (``CellPlan.groups``) one after another. Groups of one step (``group``
    1) run as the generic form runs a step (its 4 output rows written as one slice; the steps in
    tape order, so a value op's zeros past its row are written over by the later steps owning
    them). Larger groups run each as one step of ``group`` lanes: its members' rows gathered
    (group x rows x piece), the group's branch vmapped over them, their output rows scattered
    back (the backward sweep: groups in reverse order, the branch's VJP vmapped, the adjoints
    scatter-added). The lanes past a group's count repeat its
    first member and write the scratch rows (the bucket's last 4: the layout leaves them free)
    and the pool's last ``n_prm`` slots (past the parameters), cleared after each sweep. A value
    op writes its first output row only (its members' other rows belong to steps of other groups)."""

    def __init__(self, bucket: tuple, piece: int, per_call: int, group: int, generic_ops, branches,
                 n_prm: int, compiler_options, devices: list, tangent_bytes: int):
        self.bucket, self.piece, self.per_call, self.group = bucket, piece, per_call, group
        self.devices = devices
        n_rows, P = bucket[1], piece
        scratch_prm = bucket[2] - n_prm
        if group == 1:
            steps = _single_steps(branches, n_prm, P)
        else:
            widths = jnp.asarray([4 if op_spec(op).family is Family.POINT else 1 for op in generic_ops], jnp.int32)
            steps = _grouped_steps(branches, widths, group, n_prm, n_rows, scratch_prm)
        values, vjp, grads, rows = _sweeps(steps, P, n_rows, scratch_prm, tangent_bytes)
        jit = functools.partial(jax.jit, compiler_options=compiler_options)
        spread = _spread(self.devices)
        self.values = jit(spread(values, 4))
        self.vjp = jit(spread(vjp, 5, 1))
        self.grads = jit(lambda *a, unit_weights=False: spread(functools.partial(grads, unit_weights=unit_weights),
                                                               5, 3)(*a), static_argnames="unit_weights")
        self.rows = jit(rows)


def _spread(devices: list):
    """spread(fn, n_split, pooled=None): ``fn`` (pool, prog, then ``n_split`` per-piece arrays, then
    arguments every device takes whole) run with its pieces split evenly over ``devices`` (one
    program, each device its share: XLA runs a CPU program on one core). Its outputs are per
    piece, but for output number ``pooled`` (a pool gradient), which comes back one row a device
    (their sum is the gradient)."""
    mesh = Mesh(np.array(devices), ("pieces",))
    split, whole = PartitionSpec("pieces"), PartitionSpec()

    def spread(fn, n_split: int, pooled: int | None = None):
        def local(*args):
            out = list(fn(*args))
            if pooled is not None:
                out[pooled] = out[pooled][None]
            return tuple(out)

        def run(*args):
            n_whole = len(args) - 2 - n_split
            specs = (whole, whole) + (split,) * n_split + (whole,) * n_whole
            return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=split, check_vma=False)(*args)
        return run
    return spread


class CellsRunner:
    """The cell form over the generic form's programs (kept per capacity bucket): plans a call's
    cells (``layout``: CPU_LAYOUT or ACCELERATOR_LAYOUT) and runs them in calls of pieces;
    results scattered back to the points.
    ``generic_ops``, ``branches``, ``n_prm``: the generic form's ops by branch number, its branch
    functions of a capacity bucket (``branches(bucket)``) and its parameter window; a call's
    ``generic`` has the generic layout's ``bucket``, ``n_steps``, ``result`` and ``args(tape)``;
    ``devices``: those a call's pieces are split over (JAX's first device where None)."""

    def __init__(self, generic_ops, branches, n_prm: int, layout: CellLayout, compiler_options=None, devices=None):
        self.generic_ops, self.branches, self.n_prm, self.layout = generic_ops, branches, n_prm, layout
        self.compiler_options = compiler_options
        self.devices = list(devices or jax.devices()[:1])
        self._programs: dict = {}
        self.last_plan: CellPlan | None = None

    def program(self, bucket: tuple) -> CellsProgram:
        prog = self._programs.get(bucket)
        if prog is None:
            prog = self._programs[bucket] = CellsProgram(bucket, self.layout.piece_for(bucket[1]),
                                                         self.layout.per_call, self.layout.group,
                                                         self.generic_ops, self.branches(bucket), self.n_prm,
                                                         self.compiler_options, self.devices,
                                                         max(TANGENT_FILES_BYTES, self.layout.row_bytes or 0))
        return prog

    def plan(self, generic, tape: Tape, pts: np.ndarray) -> tuple[CellsProgram, tuple, CellPlan]:
        prog = self.program(generic.bucket)
        args = generic.args(tape)
        pool, steps_all = args[0], args[1]
        every = _every_step(steps_all[:generic.n_steps], generic.result, self.generic_ops, prog.group,
                            generic.bucket[0])

        def rows_at(centres):
            out = []
            for s in range(0, len(centres), CENTRES):
                c = np.empty((CENTRES, 3), np.float32)
                part = centres[s:s + CENTRES]
                c[:len(part)] = part
                c[len(part):] = part[0]
                out.append(np.asarray(prog.rows(pool, steps_all, *every, c))[:, :len(part)])
            return np.concatenate(out, 1)
        b = tape.bounds
        extent = float(np.linalg.norm(b[1] - b[0])) if np.all(np.isfinite(b)) else 1.0
        plan = CellPlan(steps_all[:generic.n_steps], generic.result, tape.params, pts, rows_at, prog.piece,
                        generic.bucket[0], self.generic_ops, min(self.layout.cell_points, prog.piece), extent=extent,
                        group=prog.group)
        self.last_plan = plan
        return prog, args, plan

    def _run(self, plan: CellPlan, program, *per_piece) -> list:
        """``program`` over the plan's pieces, in calls of the layout's per_call pieces a device, or
        ``LARGE_CALLS`` times as many where the plan fills such calls (fewer dispatches; one more
        program shape), the last call padded with empty pieces: its outputs, each the calls'
        concatenated (pieces first; a pool gradient one row a device and call)."""
        n, per_call = len(plan.n_groups), self.layout.per_call * len(self.devices)
        if n >= LARGE_CALLS * per_call:
            per_call *= LARGE_CALLS
        calls = []
        for s in range(0, n, per_call):
            blocks = []
            for a in per_piece:
                blk = np.zeros((per_call,) + a.shape[1:], a.dtype)
                blk[:min(n, s + per_call) - s] = a[s:s + per_call]
                blocks.append(blk)
            calls.append(program(*blocks))
        return [np.concatenate([np.asarray(c[k]) for c in calls]) for k in range(len(calls[0]))]

    @staticmethod
    def _at_points(plan: CellPlan, per_piece: np.ndarray) -> np.ndarray:
        """(pieces, piece, ...) results (padded calls included) -> (points, ...): each point's."""
        out = np.empty((plan.n_points,) + per_piece.shape[2:], per_piece.dtype)
        flat = per_piece[:len(plan.n_groups)].reshape((-1,) + per_piece.shape[2:])
        out[plan.point_index] = flat[plan.point_slot]
        return out

    def _pieces(self, plan: CellPlan, w: np.ndarray | None = None) -> tuple:
        """The plan's per-piece arrays: items, groups, group counts, points, and weights (0 past a
        piece's points) where given."""
        out = (plan.items, plan.groups, plan.n_groups, plan.piece_points)
        if w is None:
            return out
        wp = np.zeros(plan.valid.shape, np.float32)
        wp.reshape(-1)[plan.point_slot] = w[plan.point_index]
        return out + (wp,)

    def evaluate(self, generic, tape: Tape, pts: np.ndarray):
        prog, args, plan = self.plan(generic, tape, pts)
        d, m = self._run(plan, lambda *a: prog.values(args[0], args[1], *a, generic.result), *self._pieces(plan))
        return self._at_points(plan, d), self._at_points(plan, m)

    def vjp(self, generic, tape: Tape, pts: np.ndarray, w: np.ndarray):
        prog, args, plan = self.plan(generic, tape, pts)
        d, dpool = self._run(plan, lambda *a: prog.vjp(args[0], args[1], *a, generic.result),
                             *self._pieces(plan, w))
        return self._at_points(plan, d), dpool.sum(0, dtype=np.float64).astype(np.float32)

    def grads(self, generic, tape: Tape, pts: np.ndarray, w: np.ndarray, tangents: np.ndarray):
        prog, args, plan = self.plan(generic, tape, pts)
        unit = bool(np.all(w == 1))         # (df/dx from the weighted sweep: JaxWalker's default weights)
        d, m, dx, dpool, per = self._run(
            plan, lambda *a: prog.grads(args[0], args[1], *a, tangents, generic.result, unit_weights=unit),
            *self._pieces(plan, w))
        return (self._at_points(plan, d), self._at_points(plan, m), self._at_points(plan, dx),
                dpool.sum(0, dtype=np.float64).astype(np.float32),
                np.ascontiguousarray(self._at_points(plan, np.moveaxis(per, 1, 2)).T))
