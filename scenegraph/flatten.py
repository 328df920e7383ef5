"""``flatten(scene) -> Tape``: the scene graph written as tape records.

Owns register allocation (a node writes register ``dst`` and uses only registers above it), the
bounds of every node (in the node's own frame), the bounding-volume hierarchy that wraps plain
unions in exact CULL_BOX records, the parameter pool (named ``Param``s get stable slots) and the
material table. Patterns become one REPEAT_* ... REPEAT_END loop whatever their count, so a
pattern of 10^6 instances is a handful of records.
"""
from __future__ import annotations

import contextlib

import math
import sys
from dataclasses import dataclass, field

import numpy as np

from taperay.runtime.lowering import NotLowerable, lower
from taperay.runtime.pruning import interval_eval
from taperay.runtime.tape import INSTR_DTYPE, REG_CAPS, VALIDATED, Op, Tape, TaperayError

from .instancing import fixed_array, one_flatten, placed_bounds, placed_bvh, placed_params, shape_capsule
from .nodes import DEFAULT_MATERIAL, Material, Node, Param, box, param_values

__all__ = ["flatten", "node_bounds"]

INF = math.inf
_SHAPE_OPS = {"sphere": Op.SPHERE, "box": Op.BOX, "rounded_box": Op.ROUND_BOX, "cylinder": Op.CYLINDER,
              "capped_cone": Op.CAPPED_CONE, "capsule": Op.CAPSULE, "torus": Op.TORUS,
              "ellipsoid": Op.ELLIPSOID, "plane": Op.PLANE, "extrude": Op.EXTRUDE_POLY,
              "revolve": Op.REVOLVE_POLY}
_COMBINE_OPS = {"union": (Op.UNION, None), "intersection": (Op.INTERSECT, None),
                "difference": (Op.DIFFERENCE, None), "xor": (Op.XOR, None),
                "smooth_union": (Op.SMOOTH_UNION, "k"), "smooth_intersection": (Op.SMOOTH_INTERSECT, "k"),
                "smooth_difference": (Op.SMOOTH_DIFFERENCE, "k")}
MAX_SCENE_DEPTH = 5000   # levels of nesting flatten takes (a chain of transforms, say)
_FRAMES_PER_LEVEL = 8    # Python frames the emitter and the bounds spend per level, with room
_LEAF_CULL_MIN = 3   # unions of fewer children are chained without cull records
CHEAP_PRIMITIVES = 2   # BVH groups of at most this many primitives get no cull record
_EXPLICIT_PATTERN_MAX = 256   # overlapping patterns up to this count become explicit unions


# -- bounds ------------------------------------------------------------------------------------
def _box(lo, hi):
    return np.array([lo, hi], np.float64)


def _corners(b):
    return np.array([[b[i >> 0 & 1, 0], b[i >> 1 & 1, 1], b[i >> 2 & 1, 2]] for i in range(8)])


def _cross(u, v):
    """u x v for one vector u (3,) and vectors v (..., 3): np.cross's arithmetic, without its
    axis handling (a refit rotates a few corners many times)."""
    x, y, z = v[..., 0], v[..., 1], v[..., 2]
    return np.stack([u[1] * z - u[2] * y, u[2] * x - u[0] * z, u[0] * y - u[1] * x], -1)


def _quat_rotate(q, v):
    """Vectors v (..., 3) rotated by the unit quaternion q (w, x, y, z)."""
    w, x, y, z = q
    u = np.array([x, y, z])
    v = np.asarray(v, float)
    return v + 2 * _cross(u, _cross(u, v) + w * v)


def _transform_box(b, t, q, s):
    if not np.all(np.isfinite(b)):
        return _box([-INF] * 3, [INF] * 3)
    c = _quat_rotate(q, _corners(b) * s) + t
    return _box(c.min(0), c.max(0))


def node_bounds(n: Node, cache: dict | None = None) -> np.ndarray:
    """(2,3) float64 box holding the node's surface, in the node's own frame (inf: unbounded)."""
    cache = {} if cache is None else cache
    entry = cache.get(id(n))
    if entry is None:      # the node is kept alive with its entry, so its id cannot be reused
        entry = cache[id(n)] = (n, _bounds(n, cache))
    return entry[1]


def _bounds(n: Node, cache) -> np.ndarray:
    v, k = n.values(), n.kind
    kid = [node_bounds(c, cache) for c in n.children]
    if k == "sphere":
        return _box([-v[0]] * 3, [v[0]] * 3)
    if k in ("box", "rounded_box", "ellipsoid"):
        return _box(-v[:3], v[:3])
    if k == "cylinder":
        return _box([-v[0], -v[0], -v[1]], [v[0], v[0], v[1]])
    if k == "capped_cone":
        r = max(v[1], v[2])
        return _box([-r, -r, -v[0]], [r, r, v[0]])
    if k == "capsule":
        a, b, r = v[:3], v[3:6], v[6]
        return _box(np.minimum(a, b) - r, np.maximum(a, b) + r)
    if k == "torus":
        return _box([-v[0] - v[1], -v[0] - v[1], -v[1]], [v[0] + v[1], v[0] + v[1], v[1]])
    if k == "plane":
        return _box([-INF] * 3, [INF] * 3)
    if k == "field":
        return _box(v[:3], v[3:6])
    if k == "extrude":
        xy = v[1:].reshape(-1, 2)
        return _box([*xy.min(0), -v[0]], [*xy.max(0), v[0]])
    if k == "revolve":
        rz = v.reshape(-1, 2)
        r = np.abs(rz[:, 0]).max()
        return _box([-r, -r, rz[:, 1].min()], [r, r, rz[:, 1].max()])
    if k in ("union", "xor"):
        return _box(np.min([b[0] for b in kid], 0), np.max([b[1] for b in kid], 0))
    if k == "smooth_union":
        b = _box(np.min([b[0] for b in kid], 0), np.max([b[1] for b in kid], 0))
        return b + np.array([[-v[0] / 4] * 3, [v[0] / 4] * 3])
    if k in ("intersection", "smooth_intersection"):
        return _box(np.max([b[0] for b in kid], 0), np.min([b[1] for b in kid], 0))
    if k in ("difference", "smooth_difference"):
        return kid[0]
    if k == "offset":
        return kid[0] + np.array([[-v[0]] * 3, [v[0]] * 3])
    if k == "shell":
        return kid[0] + np.array([[-v[0]] * 3, [v[0]] * 3])
    if k == "transform":
        return _transform_box(kid[0], v[:3], v[3:7], v[7])
    if k == "mirror":
        nrm, d = v[:3], v[3]
        b = kid[0]
        if not np.all(np.isfinite(b)):
            return b
        c = _corners(b)
        refl = c - 2 * ((c @ nrm) - d)[:, None] * nrm
        allc = np.vstack([c, refl])
        return _box(allc.min(0), allc.max(0))
    if k == "elongate":
        return kid[0] + np.array([-v[:3], v[:3]])
    if k == "linear_pattern":
        d, cnt = v[:3], v[3]
        ends = np.array([np.zeros(3), d * (cnt - 1)])
        return _box(kid[0][0] + ends.min(0), kid[0][1] + ends.max(0))
    if k == "polar_pattern":
        b = kid[0]
        c = _corners(b)
        rho = np.hypot(c[:, 0], c[:, 1]).max()
        return _box([-rho, -rho, b[0, 2]], [rho, rho, b[1, 2]])
    if k == "grid_pattern":
        s, cnt = v[:3], v[3:6]
        return _box(kid[0][0], kid[0][1] + s * (cnt - 1))
    if k == "instances":
        if not np.all(np.isfinite(kid[0])):
            return kid[0]
        return placed_bounds(kid[0], n.array)
    raise AssertionError(k)


# -- emission ----------------------------------------------------------------------------------
_POINT_KINDS = ("transform", "mirror", "elongate")


class _Memo:
    """What one flatten keeps for the next flatten of a scene sharing nodes with it (``Tape.set_param``'s
    refit, the viewer's topology edits): per node, the named ``Param``s in it and whether it is
    fixed (no placement or field array that could still change); its box, and the records it
    emitted from each emitter state, for the parameter values they were made with; the nodes made
    from it on the way (a pattern's recentred copy, its box, its explicit copies). A node whose
    parameters read as before, emitted from the same state, has its records copied instead of
    emitted again, so a slider move re-emits only the nodes holding its parameter. The memo keeps
    the last one's entries whose nodes are in the new scene with their values unchanged."""
    CARRIED_MAX = 4      # entries carried unused, at most this many times those used (then none)

    def __init__(self, last: "_Memo | None"):
        self.last = last                       # read during the flatten, dropped after it
        self.facts: dict[int, tuple] = {}      # id -> (node, its Params, fixed)
        self.bounds = _CarriedBounds(self)     # id -> (node, box, values)
        self.emitted: dict[tuple, tuple] = {}  # (id, values, emitter state) -> (node, replay ...)
        self.derived: dict[tuple, tuple] = {}  # (tag, id, values) -> (node, made node)

    def node_facts(self, n: Node) -> tuple:
        """(the distinct named Params in ``n``'s tree, whether its tree is fixed)."""
        entry = self.facts.get(id(n))
        if entry is None and self.last is not None:
            entry = self.last.facts.get(id(n))
            if entry is not None:
                self.facts[id(n)] = entry
        if entry is None:
            params, fixed = [], _own_arrays_fixed(n)
            for v in n.numbers:
                if isinstance(v, Param) and v not in params:
                    params.append(v)
            for c in n.children:
                kid_params, kid_fixed = self.node_facts(c)
                params += [v for v in kid_params if v not in params]
                fixed = fixed and kid_fixed
            entry = self.facts[id(n)] = (n, tuple(params), fixed)
        return entry[1:]

    def values(self, n: Node) -> tuple | None:
        """The numbers ``n``'s Params read as now, or None where its tree is not fixed."""
        params, fixed = self.node_facts(n)
        return tuple(float(v) for v in params) if fixed else None

    def carried(self, table: str, key, n: Node):
        """The last memo's entry ``key`` of ``table`` (taken into this one), or None."""
        if self.last is None:
            return None
        entry = getattr(self.last, table).get(key)
        if entry is not None and entry[0] is n:
            getattr(self, table)[key] = entry
            return entry
        return None

    def made(self, tag: str, n: Node, make, own: bool = False) -> Node:
        """``make()``, a node derived from ``n`` (tag names how), the same node as the last
        flatten's where ``n``'s values are the same (so its records can be copied); ``own``:
        where ``n``'s own numbers are (what ``make`` reads of ``n``; its children are kept as
        they are)."""
        values = self.values(n)
        if values is None:
            return make()
        key = (tag, id(n), tuple(float(v) for v in n.numbers) if own else values)
        entry = self.derived.get(key) or self.carried("derived", key, n)
        if entry is None:
            entry = self.derived[key] = (n, make())
        return entry[1]

    def close(self, scene: Node) -> None:
        """Keep the last memo's entries whose nodes are in ``scene`` (or made from them) with
        the values they were made with, unless they outnumber this flatten's own; then drop the
        last memo."""
        last, self.last = self.last, None
        if last is None:
            return
        alive = {id(m) for root in [scene, *(e[1] for e in self.derived.values())] for m in root.walk()}

        def current(n: Node, values) -> bool:
            return id(n) in alive and values is not None and values == self.values(n)
        kept = [(self.facts, k, e) for k, e in last.facts.items() if k not in self.facts and k in alive]
        kept += [(self.bounds, k, e) for k, e in last.bounds.items() if k not in self.bounds and current(e[0], e[2])]
        kept += [(self.emitted, k, e) for k, e in last.emitted.items() if k not in self.emitted
                 and current(e[0], k[-1])]
        kept += [(self.derived, k, e) for k, e in last.derived.items() if k not in self.derived
                 and current(e[0], k[2])]
        if len(kept) <= self.CARRIED_MAX * (len(self.emitted) + len(self.bounds)) + 64:
            for table, key, entry in kept:
                dict.__setitem__(table, key, entry)


class _CarriedBounds(dict):
    """node_bounds' cache for one flatten: id -> (node, box, the values it read), answered from
    the last memo's where the node reads the same values."""

    def __init__(self, memo: _Memo):
        super().__init__()
        self.memo = memo

    def get(self, key, default=None):
        entry = dict.get(self, key)
        if entry is None and self.memo.last is not None:
            old = dict.get(self.memo.last.bounds, key)
            if old is not None and old[2] is not None and old[2] == self.memo.values(old[0]):
                dict.__setitem__(self, key, old)
                entry = old
        return default if entry is None else entry

    def __setitem__(self, key, entry):
        dict.__setitem__(self, key, (*entry, self.memo.values(entry[0])))


def _own_arrays_fixed(n: Node) -> bool:
    """Whether the node's own arrays (an instance list's placements, a field's tape) cannot
    change: read-only and owning their data."""
    arrays = [n.array] if n.array is not None else [n.tape.instrs, n.tape.params] if n.tape is not None else []
    return all(fixed_array(a) for a in arrays)


class _Emitter:
    def __init__(self, cull: bool, memo: _Memo):
        self.cull = cull
        self.memo = memo
        self.rows: list[list] = []
        self.params: list[float] = []
        self.names: dict[str, list[int]] = {}
        self.param_values: dict[str, float] = {}
        self.materials: list[Material] = [DEFAULT_MATERIAL]
        self.max_reg = 0
        self.instances: list[np.ndarray] = []
        self.bvh: list[np.ndarray] = []
        self.bvh_nodes = 0           # nodes in self.bvh's arrays (the next list's first node)
        self.instance_rows = 0       # placements in self.instances' arrays
        self.subtracted = False      # whether what is emitted now enters the field negated (a cut)
        self.lists = (self.rows, self.params, self.materials, self.bvh, self.instances)

    def bounds(self, n):
        return node_bounds(n, self.memo.bounds)

    def state(self) -> tuple:
        """What a node's records depend on besides the node, its values, its register and its
        material: the cut parity, culling, and where they land in each table."""
        return (self.subtracted, self.cull, len(self.rows), len(self.params), len(self.materials), len(self.bvh),
                self.bvh_nodes, self.instance_rows)

    def emit(self, n: Node, dst: int, mat: int) -> int:
        """Emit ``n`` into register ``dst``; returns the number of primitive instances it stands
        for. The records of a node emitted by the last flatten from the same state with the same
        values are copied from it (``_Memo``)."""
        values = self.memo.values(n)
        if values is None:
            return self.emit_node(n, dst, mat)
        key = (id(n), dst, mat, *self.state(), values)
        entry = self.memo.emitted.get(key) or self.memo.carried("emitted", key, n)
        if entry is not None and entry[-1][2][:len(self.materials)] == self.materials:
            count = self.replay(n, entry, values)
            self.memo.emitted[key] = (*entry[:-1], self.lists)    # (the same records, now in these lists)
            return count
        p0 = len(self.params)
        outer_max, self.max_reg = self.max_reg, 0
        count = self.emit_node(n, dst, mat)
        inner_max, self.max_reg = self.max_reg, max(outer_max, self.max_reg)
        params = self.memo.node_facts(n)[0]
        named = sorted((slot, name) for name in {v.name for v in params} for slot in self.names.get(name, ())
                       if slot >= p0)
        self.memo.emitted[key] = (n, len(self.rows), len(self.params), len(self.materials), len(self.bvh),
                                  self.bvh_nodes, self.instance_rows, inner_max, count, tuple(named), self.lists)
        return count

    def replay(self, n: Node, entry: tuple, values: tuple) -> int:
        """Append the records (pool entries, materials, instance lists) a memo entry names, from
        the emitter that made them."""
        _, r1, p1, m1, l1, bvh_nodes, instance_rows, inner_max, count, named, (rows, params, mats, bvh, inst) = entry
        l0 = len(self.bvh)
        self.rows.extend(rows[len(self.rows):r1])
        self.params.extend(params[len(self.params):p1])
        self.materials.extend(mats[len(self.materials):m1])
        self.bvh.extend(bvh[l0:l1])
        self.instances.extend(inst[l0:l1])
        self.bvh_nodes, self.instance_rows = bvh_nodes, instance_rows
        self.max_reg = max(self.max_reg, inner_max)
        for slot, name in named:
            self.names.setdefault(name, []).append(slot)
        for v, x in zip(self.memo.node_facts(n)[0], values):
            self.param_values[v.name] = x
        return count

    def pool(self, values) -> int:
        off = len(self.params)
        if isinstance(values, np.ndarray):   # plain numbers (an instance list's grid): no loop
            self.params.extend(values.tolist())
            return off
        for v in values:
            if isinstance(v, Param):
                self.names.setdefault(v.name, []).append(len(self.params))
                self.param_values[v.name] = float(v)
            self.params.append(float(v))
        return off

    def row(self, op, dst=0, a=0, b=0, c=0, param=0, aux=0, jump=0) -> int:
        self.max_reg = max(self.max_reg, dst)
        self.rows.append([int(op), dst, a, b, c, param, aux, jump])
        return len(self.rows) - 1

    def material_id(self, m: Material) -> int:
        for i, known in enumerate(self.materials):
            if known == m:
                return i
        self.materials.append(m)
        return len(self.materials) - 1

    def emit_node(self, n: Node, dst: int, mat: int) -> int:
        """``emit``'s records made anew."""
        if n.mat is not None:
            mat = self.material_id(n.mat)
        k = n.kind
        if k in _SHAPE_OPS:
            nums = n.numbers
            count = 0
            if k == "extrude":
                count = (len(nums) - 1) // 2
            elif k == "revolve":
                count = len(nums) // 2
            self.row(_SHAPE_OPS[k], dst, a=count, param=self.pool(nums), aux=mat)
            return 1
        if k == "field":
            self.emit_field(n.tape, dst, mat)
            return 1
        if k == "union" and len(n.children) >= _LEAF_CULL_MIN:
            return self.emit_culled_union(list(n.children), dst, mat)
        if k in _COMBINE_OPS:
            op, knum = _COMBINE_OPS[k]
            kparam = self.pool(n.numbers) if knum else 0
            margin = n.value(0) if k == "smooth_union" else 0.0
            total = self.emit(n.children[0], dst, mat)
            cut = k == "difference"       # (a smooth one blends the bound within its radius: boxed)
            for child in n.children[1:]:
                if k == "smooth_union":   # chain order matters for smin: cull child by child
                    total += self.emit_cull_wrapped(child, dst, mat, margin, op, kparam)
                else:
                    self.subtracted ^= cut
                    total += self.emit(child, dst + 1, mat)
                    self.subtracted ^= cut
                    self.row(op, dst, a=dst, b=dst + 1, param=kparam)
            return total
        if k in ("offset", "shell"):
            total = self.emit(n.children[0], dst, mat)
            self.row(Op.OFFSET if k == "offset" else Op.SHELL, dst, a=dst, param=self.pool(n.numbers))
            return total
        if k in _POINT_KINDS:
            # a chain of point ops (t.rotate(...).translate(...)) shares one PUSH / POP: nothing
            # reads p between an inner POP and the outer one
            self.row(Op.PUSH)
            while True:
                self.emit_point_op(n)
                n = n.children[0]
                if n.kind not in _POINT_KINDS:
                    break
                if n.mat is not None:
                    mat = self.material_id(n.mat)
            total = self.emit(n, dst, mat)
            self.row(Op.POP)
            return total
        if k in ("linear_pattern", "polar_pattern", "grid_pattern"):
            return self.emit_pattern(n, dst, mat)
        if k == "instances":
            return self.emit_instances(n, dst, mat)
        raise AssertionError(k)

    def emit_point_op(self, n: Node):
        """The point ops of one transform / mirror / elongate node (identity parts left out)."""
        if n.kind == "transform":
            t, q, s = n.numbers[:3], n.numbers[3:7], n.numbers[7]
            named = lambda vs: any(isinstance(x, Param) for x in vs)
            if named(t) or any(float(x) for x in t):
                self.row(Op.TRANSLATE, param=self.pool(t))
            if named(q) or [float(x) for x in q] != [1, 0, 0, 0]:
                self.row(Op.ROTATE, param=self.pool(q))
            if named([s]) or float(s) != 1:
                self.row(Op.SCALE, param=self.pool([s]))
        else:
            self.row(Op.MIRROR if n.kind == "mirror" else Op.ELONGATE, param=self.pool(n.numbers))

    def emit_field(self, sub: Tape, dst: int, mat: int):
        """Append an arithmetic sub-tape, its registers moved up by ``dst`` (its result, register
        0, lands in ``dst``), its constants appended to the pool; then give it the material."""
        rows = sub.instrs.copy()
        for fld in ("dst", "a", "b", "c"):
            rows[fld] += np.uint32(dst)
        rows["param"] += np.uint32(len(self.params))
        self.params.extend(sub.params.tolist())
        self.rows.extend(list(r) for r in rows.tolist())
        self.max_reg = max(self.max_reg, dst + sub.n_regs - 1)
        self.row(Op.FIELD_RESULT, dst, a=dst, aux=mat)

    def emit_pattern(self, n: Node, dst: int, mat: int) -> int:
        child = n.children[0]
        b = self.bounds(child)
        if not np.all(np.isfinite(b)):
            raise TaperayError(f"{n.kind}: the repeated shape is unbounded (a plane?); patterns need bounded shapes")
        v = n.values()
        centre = (b[0] + b[1]) / 2
        if n.kind != "polar_pattern" and np.abs(centre).max() > 1e-6 * (1 + np.abs(b).max()):
            # translations commute with linear/grid repetition: centre the copy in its cell
            recentred = self.memo.made("recentred", n, lambda: Node(
                n.kind, n.numbers, (child.translate(*-centre),)).translate(*centre))
            return self.emit(recentred, dst, mat)
        # Only the nearest cell and its neighbour (per axis) are evaluated; every other copy is
        # bounded from below. That bound must stay positive, or a point inside a copy that was not
        # evaluated would read as outside: copies may overlap at most one neighbouring cell.
        if n.kind == "linear_pattern":
            d = v[:3]
            dn = d / np.linalg.norm(d)
            e = np.abs(_corners(b) @ dn).max()
            extra, op, count = [e], Op.REPEAT_LINEAR, int(v[3])
            fits = count <= 2 or e < 0.999 * np.linalg.norm(d)
        elif n.kind == "polar_pattern":
            c = (b[0] + b[1]) / 2
            radius = np.linalg.norm(b[1] - b[0]) / 2
            extra, op, count = [*c, radius], Op.REPEAT_POLAR, int(v[0])
            fits = count <= 2 or radius < 0.999 * np.hypot(c[0], c[1]) * math.sin(math.pi / count)
        else:
            e = np.abs(b).max(0)
            extra, op, count = list(e), Op.REPEAT_GRID, int(np.prod(v[3:6]))
            fits = bool(np.all((v[3:6] <= 2) | (e < 0.999 * v[:3])))
        if not fits:
            if count > _EXPLICIT_PATTERN_MAX:
                raise TaperayError(
                    f"{n.kind} of {count}: each copy reaches past its neighbouring cell (extent "
                    f"{np.round(extra, 4).tolist()}); widen the spacing or shrink the repeated shape")
            return self.emit(self.memo.made("explicit", n, lambda: _explicit_copies(n), own=True), dst, mat)
        boxed = not self.subtracted and _needs_own_box(n)
        if boxed:      # max(pattern, its box): the box's distance where it exceeds the copies' bound
            lo, hi = self.bounds(n)
            self.emit(self.memo.made("box", n, lambda: box(*((hi - lo) / 2)).translate(*((lo + hi) / 2))), dst, mat)
        at = dst + 1 if boxed else dst
        begin = self.row(op, param=self.pool([*n.numbers, *extra]))
        inner = self.emit(child, at + 1, mat)
        end = self.row(Op.REPEAT_END, at, a=at + 1, jump=begin)
        self.rows[begin][7] = end
        if boxed:
            self.row(Op.INTERSECT, dst, a=at, b=dst)
        return inner * count

    def emit_instances(self, n: Node, dst: int, mat: int) -> int:
        child = n.children[0]
        b = self.bounds(child)
        if not np.all(np.isfinite(b)):
            raise TaperayError("instances: the instanced shape is unbounded (a plane?); instances need bounded shapes")
        first_node, first_inst = self.bvh_nodes, self.instance_rows
        bvh = placed_bvh(b, n.array, first_node, first_inst)
        if not self.cull:   # inner boxes never reject: every leaf box is tested (O(N) a point)
            bvh = bvh.copy()        # (placed_bvh may hand out its remembered, read-only tree)
            inner = bvh["instance"] < 0
            bvh["lo"][inner], bvh["hi"][inner] = -3e38, 3e38
        self.instances.append(n.array)
        self.bvh.append(bvh)
        self.bvh_nodes += len(bvh)
        self.instance_rows += len(n.array)
        # (unculled: no representatives' bound either, so that culled == unculled tests the bound)
        prm = self.pool(placed_params(b, inner_capsule(child) if self.cull else None, n.array, first_inst))
        begin = self.row(Op.INSTANCES, a=len(bvh), aux=first_node, param=prm)
        inner = self.emit(child, dst + 1, mat)
        end = self.row(Op.REPEAT_END, dst, a=dst + 1, jump=begin)
        self.rows[begin][7] = end
        return inner * len(n.array)

    def emit_cull_wrapped(self, child: Node, run: int, mat: int, margin: float, op, kparam) -> int:
        """``run = op(run, child)`` with the child skipped where its box cannot change ``run``.
        A child of at most ``CHEAP_PRIMITIVES`` primitives (under point transforms) is not
        wrapped: it costs about what the cull's own box test and intersection cost, and the twin's
        blocks that split at a cull pay more (docs/PERFORMANCE.md, assembly)."""
        box = self.bounds_of(child)
        if not np.all(np.isfinite(box)) or _too_cheap_to_cull(child):
            total = self.emit_group(child, run + 1, mat)
            self.row(op, run, a=run, b=run + 1, param=kparam)
            return total
        if not self.cull:   # the same field, never skipping: no running value is ever +inf below
            margin = INF
        cull = self.row(Op.CULL_BOX, run + 1, a=run, param=self.pool([*box[0], *box[1], margin]), aux=mat)
        total = self.emit_group(child, run + 2, mat)
        self.row(Op.INTERSECT, run + 1, a=run + 2, b=run + 1)
        self.rows[cull][7] = self.row(op, run, a=run, b=run + 1, param=kparam)
        return total

    def emit_group(self, item, dst: int, mat: int) -> int:
        return self.emit_bvh(item, dst, mat) if isinstance(item, tuple) else self.emit(item, dst, mat)

    def emit_bvh(self, tree: tuple, dst: int, mat: int) -> int:
        left, right = tree[0], tree[1]
        total = self.emit_group(left, dst, mat)
        return total + self.emit_cull_wrapped(right, dst, mat, 0.0, Op.UNION, 0)

    def emit_culled_union(self, children: list[Node], dst: int, mat: int) -> int:
        boxes = np.array([self.bounds(c) for c in children])
        finite = np.all(np.isfinite(boxes.reshape(len(children), -1)), axis=1)
        unbounded = [c for c, f in zip(children, finite) if not f]
        bounded = [c for c, f in zip(children, finite) if f]
        total = 0
        first = True
        for c in unbounded:
            total += self.emit(c, dst if first else dst + 1, mat)
            if not first:
                self.row(Op.UNION, dst, a=dst, b=dst + 1)
            first = False
        if not bounded:
            return total
        tree = _build_bvh(bounded, boxes[finite])
        if first:
            return total + self.emit_group(tree, dst, mat)
        return total + self.emit_cull_wrapped(tree, dst, mat, 0.0, Op.UNION, 0)

    def bounds_of(self, item):
        if isinstance(item, tuple):
            return item[2]
        return self.bounds(item)


def _needs_own_box(n: Node) -> bool:
    """Whether a linear or grid pattern is bounded by its own box as well (emit_pattern): the
    bound its record gives the copies it does not evaluate counts only the distance along its
    axes (a row's, however far beside the row), so a dense pattern would read as near everywhere
    beside it, and a march would crawl there and take those readings for hits. Not for a polar
    pattern (its bound is a distance already), nor where every copy is evaluated (at most 2 along
    each axis), nor where a named parameter lies in the pattern (its spacing, count or shape): a
    tape without its scene keeps its boxes through parameter edits (Tape.set_param), and a box
    would then cut a copy that grew. (emit_pattern does not box a pattern a plain difference cuts
    away either: negated, a bound too low only over-states the field inside the material, where
    no march goes.)"""
    if n.kind == "polar_pattern" or n.params():
        return False
    counts = n.values()[3:4] if n.kind == "linear_pattern" else n.values()[3:6]
    return bool(np.any(np.asarray(counts) > 2))


def _explicit_copies(n: Node) -> Node:
    """A pattern whose copies overlap beyond one cell, written as a union of transformed copies."""
    child, v = n.children[0], n.values()
    if n.kind == "linear_pattern":
        copies = [child.translate(*(v[:3] * k)) for k in range(int(v[3]))]
    elif n.kind == "polar_pattern":
        copies = [child.rotate((0, 0, 1), 360.0 * k / v[0]) for k in range(int(v[0]))]
    else:
        idx = np.stack(np.meshgrid(*[np.arange(int(c)) for c in v[3:6]], indexing="ij"), -1).reshape(-1, 3)
        copies = [child.translate(*(v[:3] * i)) for i in idx]
    return Node("union", (), tuple(copies))


def _too_cheap_to_cull(item) -> bool:
    """True for a BVH group or node of at most ``CHEAP_PRIMITIVES`` leaves, each one shape
    record under point transforms (depth first, stopping at the first leaf too many)."""
    stack, leaves = [item], 0
    while stack:
        item = stack.pop()
        if isinstance(item, tuple):
            stack += item[:2]
            continue
        while isinstance(item, Node) and item.kind in _POINT_KINDS:
            item = item.children[0]
        leaves += 1
        if leaves > CHEAP_PRIMITIVES or not (isinstance(item, Node) and item.kind in _SHAPE_OPS):
            return False
    return True


def _build_bvh(items: list, boxes: np.ndarray):
    """Binary tree of (left, right, box) tuples by median split on the longest centroid axis."""
    if len(items) == 1:
        return items[0]
    centres = boxes.mean(axis=1)
    axis = int(np.argmax(np.ptp(centres, axis=0)))
    order = np.argsort(centres[:, axis], kind="stable")
    half = len(items) // 2
    lo, hi = order[:half], order[half:]
    left = _build_bvh([items[i] for i in lo], boxes[lo])
    right = _build_bvh([items[i] for i in hi], boxes[hi])
    box = np.array([boxes[:, 0].min(0), boxes[:, 1].max(0)])
    return (left, right, box)


def inner_capsule(n) -> tuple[np.ndarray, np.ndarray, float] | None:
    """(a, b, r): a capsule (every point within r of the segment ab) inside the node's solid, in
    its frame, or None where none is known. With it, an instance's value at p is at most
    max(0, |p - ab| - r) (a value never exceeds the distance to a point of the solid outside it,
    and is <= 0 inside it), the upper bound the INSTANCES walk starts from. Taken from the shapes
    (``shape_capsule``), else proven numerically (``proven_inner_ball``)."""
    found = shape_capsule(n)
    return found if found is not None else proven_inner_ball(n)


def proven_inner_ball(n, samples: int = 12) -> tuple[np.ndarray, np.ndarray, float] | None:
    """A ball inside the node's solid, proven by interval arithmetic on the node's lowering to
    arithmetic (``runtime.lowering``): the deepest of samples^3 grid points over its box, and the
    largest cube about it (halving from the sampled depth) whose interval lies below zero, the
    ball inscribed in that cube. None for nodes holding arithmetic fields (their values need not
    stay below the true distance), nodes the lowering refuses, or where no cube is proven."""
    if any(m.kind == "field" for m in n.walk()):
        return None
    box = node_bounds(n)
    if not np.all(np.isfinite(box)):
        return None
    try:
        low = lower(flatten(n, source="instanced body"))
        axes = [np.linspace(box[0, r], box[1, r], samples + 2)[1:-1] for r in range(3)]
        pts = np.stack(np.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3)
        hi = interval_eval(low, pts, pts, fields=True)[1]
        best = None
        for i in np.argsort(np.where(np.isnan(hi), np.inf, hi))[:8]:
            if not hi[i] < 0:
                break
            h = -float(hi[i]) / np.sqrt(3.0)
            for _ in range(4):
                hi_b = interval_eval(low, pts[i] - h, pts[i] + h, fields=True)[1]
                if hi_b[0] < 0:
                    break
                h /= 2
            else:
                continue
            if best is None or h > best[2]:
                best = (pts[i].astype(np.float64), pts[i].astype(np.float64), h * (1 - 2.0 ** -10))
        return best
    except (NotLowerable, TaperayError):
        return None


@contextlib.contextmanager
def _recursion_room(frames: int):
    """Python's recursion limit raised to leave ``frames`` more frames, for the duration."""
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(old + frames)
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


def _joined(arrays: list[np.ndarray]) -> np.ndarray | None:
    """The instance lists' arrays end to end (one list: its array itself, no copy; none: None)."""
    return None if not arrays else arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def flatten(scene: Node, source: str = "", cull: bool = True, params: dict[str, float] | None = None,
            reuse: Tape | None = None) -> Tape:
    """Flatten a scene node into a validated ``Tape`` (result in register 0; its arrays read-only,
    as every validated tape's: ``runtime.tape.freeze``).

    ``cull=False`` gives the same field evaluated without skipping: CULL_BOX records whose margin
    is +inf never jump, and instance BVHs whose inner boxes never reject. ``params`` gives named
    ``Param``s other values than their own (None: those of a flatten under way, else their own).
    ``reuse``: a tape flattened before from a scene sharing nodes with this one (a topology edit's
    last scene): the records of a shared node emitted from the same place with the same values
    are copied from it, not made again. The tape keeps a ``refit`` that flattens the scene again
    with one parameter changed, reusing this flatten's records the same way (only the nodes
    holding the parameter are emitted anew), which ``Tape.set_param`` uses so that bounds
    follow edits.
    """
    last = reuse.refit.memo if reuse is not None and isinstance(reuse.refit, _Refit) and reuse.refit.cull == cull \
        else None
    return _flatten(scene, source, cull, params, last)


def _flatten(scene: Node, source: str, cull: bool, params: dict[str, float] | None, last: _Memo | None) -> Tape:
    """``flatten``, reusing the records ``last`` (a memo of an earlier flatten, or None) keeps."""
    if not isinstance(scene, Node):
        raise TaperayError(f"{source or 'scene'}: expected a scene node, got {type(scene).__name__}")
    depth = scene.depth()
    if depth > MAX_SCENE_DEPTH:
        raise TaperayError(f"{source or 'scene'}: the scene graph is {depth} levels deep; flatten takes at most "
                           f"{MAX_SCENE_DEPTH} (nest fewer transforms or combine children in one union)")
    memo = _Memo(last)
    em = _Emitter(cull, memo)
    with param_values(params) if params is not None else contextlib.nullcontext(), one_flatten(), \
            _recursion_room(depth * _FRAMES_PER_LEVEL):   # (the emitter and the bounds recurse per level)
        instances = em.emit(scene, 0, 0)
        b = em.bounds(scene)
        if not np.all(np.isfinite(b)):   # unbounded (planes): frame the bounded leaves, else a unit box
            finite = [em.bounds(n) for n in scene.walk() if not n.children and np.all(np.isfinite(em.bounds(n)))]
            b = np.array([np.min([f[0] for f in finite], 0), np.max([f[1] for f in finite], 0)]) if finite \
                else _box([-1] * 3, [1] * 3)
        memo.close(scene)
    instrs = np.array([tuple(r) for r in em.rows], INSTR_DTYPE)
    mats = np.concatenate([m.record() for m in em.materials])
    n_regs = em.max_reg + 1
    if n_regs > max(REG_CAPS):
        raise TaperayError(f"{source or 'scene'}: needs {n_regs} registers, kernels hold {max(REG_CAPS)}; "
                           "the scene graph is nested too deeply")
    tape = Tape(instrs, np.array(em.params, np.float32), mats, n_regs, b.astype(np.float32),
                names=em.names, instance_count=int(instances), source=source,
                instances=_joined(em.instances), bvh=_joined(em.bvh),
                material_names=tuple(m.name for m in em.materials),
                refit=_Refit(scene, source, cull, em.param_values, memo))
    VALIDATED.check(tape)       # (frozen and recorded: the walker that draws it finds it validated)
    return tape


@dataclass(frozen=True)
class _Refit:
    """A flattened scene and the parameter values it was flattened with: called with one changed
    parameter, it flattens the scene again from the records its memo keeps (the new tape carries
    the updated refit)."""
    scene: Node
    source: str
    cull: bool
    values: dict[str, float]
    memo: _Memo = field(repr=False, compare=False)

    def __call__(self, name: str, value: float) -> Tape:
        return _flatten(self.scene, self.source, self.cull, {**self.values, name: float(value)}, self.memo)
