"""The tape: record dtypes, the ``Tape`` container and the validator that proves a tape safe.

A tape is flat arrays of fixed-size records (``INSTR_DTYPE`` instructions, a float32 parameter
pool, ``MATERIAL_DTYPE`` materials) plus a few header numbers. The WGSL structs in
``shaders/generated_tape.wgsl`` are generated from these dtypes; ``validate`` rejects, with the
record index and the reason, every tape a kernel could not run safely (registers, stack depths,
jump targets, parameter ranges, reads of unwritten registers).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .opcodes import (LOOP_CAP, MAX_POLY_VERTS, OPS, POLY_OPS, REG_CAPS, REPEATS,
                      STACK_CAP, Family, Op, OpSpec)

__all__ = ["pool_tangents", "INSTR_DTYPE", "MATERIAL_DTYPE", "MATERIAL_DEFAULTS", "material_array",
           "material_problem", "INSTANCE_DTYPE", "BVH_DTYPE", "Tape", "TaperayError", "TapeError",
           "CellsTooLarge", "validate", "content_key", "freeze", "quat_matrices",
           "ValidatedTapes", "VALIDATED", "derived", "Op", "OPS", "OpSpec", "Family", "STACK_CAP", "LOOP_CAP",
           "REG_CAPS", "MAX_INSTRS",
           "MAX_PARAMS", "instr_array", "point_array", "gradient_eps", "pattern_counts", "param_count"]

INSTR_DTYPE = np.dtype([(name, "<u4") for name in
                        ("op", "dst", "a", "b", "c", "param", "aux", "jump")])
# a surface material (runtime/path_tracing.py reads every field; the march's shading colour and
# roughness only): base colour (linear RGB), GGX roughness, emitted radiance (linear RGB), metallic,
# specular (a dielectric's reflectance at normal incidence is 0.08 specular; 0: Lambertian),
# index of refraction and transmission (1: smooth glass, 0: opaque); pad fills the record to
# WGSL's 16-byte struct alignment
MATERIAL_DTYPE = np.dtype([("color", "<f4", (3,)), ("roughness", "<f4"), ("emission", "<f4", (3,)),
                           ("metallic", "<f4"), ("specular", "<f4"), ("ior", "<f4"), ("transmission", "<f4"),
                           ("pad", "<f4")])
# the value of each field a material record is built without (material_array)
MATERIAL_DEFAULTS = {"color": (0.7, 0.7, 0.72), "roughness": 0.5, "emission": (0.0, 0.0, 0.0), "metallic": 0.0,
                     "specular": 0.5, "ior": 1.5, "transmission": 0.0, "pad": 0.0}
# one rigid + uniform-scale placement of an instance-list body: world = t + q * (s * local)
INSTANCE_DTYPE = np.dtype([("q", "<f4", (4,)), ("t", "<f4", (3,)), ("s", "<f4")])
# a BVH node over instances, depth-first preorder; skip = index just past the subtree;
# instance = index into Tape.instances for a leaf, -1 for an inner node
BVH_DTYPE = np.dtype([("lo", "<f4", (3,)), ("skip", "<u4"), ("hi", "<f4", (3,)), ("instance", "<i4")])

MAX_INSTRS = 1 << 22          # 128 MiB of instructions; also bounded by the device's binding limit
MAX_PARAMS = 1 << 26
MAX_MATERIALS = 1 << 16


class TaperayError(Exception):
    """Every error a user can cause (bad files, bad scenes, tapes too large, no GPU)."""


class CellsTooLarge(TaperayError):
    """The pruned tapes of a march's cells do not fit: the GPU's binding limit, or the CPU twin's
    memory cap. Renders that chose the cells themselves fall back to fewer cells or none."""


class TapeError(TaperayError):
    """A tape failed validation: ``record`` is the instruction index (or None for the header)."""

    def __init__(self, reason: str, record: int | None = None, source: str | None = None):
        self.reason, self.record, self.source = reason, record, source
        where = f"{source}: " if source else ""
        where += f"record {record}: " if record is not None else ""
        super().__init__(where + reason)


def instr_array(n: int) -> np.ndarray:
    return np.zeros(n, INSTR_DTYPE)


def material_array(colors, roughness=MATERIAL_DEFAULTS["roughness"], **fields) -> np.ndarray:
    """MATERIAL_DTYPE records, one per colour of ``colors`` ((n, 3)); ``roughness`` and the other
    fields (``metallic=``, ``emission=`` ...) broadcast over them, MATERIAL_DEFAULTS' where not given."""
    colors = np.asarray(colors, np.float64).reshape(-1, 3)
    unknown = set(fields) - set(MATERIAL_DTYPE.names)
    if unknown:
        raise TaperayError(f"material fields {sorted(unknown)} do not exist (have: {', '.join(MATERIAL_DTYPE.names)})")
    out = np.zeros(len(colors), MATERIAL_DTYPE)
    for name in MATERIAL_DTYPE.names:
        out[name] = {"color": colors, "roughness": roughness}.get(name, fields.get(name, MATERIAL_DEFAULTS[name]))
    return out


def material_problem(materials: np.ndarray) -> str | None:
    """Why MATERIAL_DTYPE records are out of range (the first material that is), or None:
    roughness, metallic and specular in [0, 1], emission >= 0, transmission 0 or 1, a glass's
    (transmission 1) ior >= 1."""
    checks = (("roughness", lambda m: (m["roughness"] >= 0) & (m["roughness"] <= 1), "must lie in [0, 1]"),
              ("metallic", lambda m: (m["metallic"] >= 0) & (m["metallic"] <= 1), "must lie in [0, 1]"),
              ("specular", lambda m: (m["specular"] >= 0) & (m["specular"] <= 1), "must lie in [0, 1]"),
              ("emission", lambda m: np.all(m["emission"] >= 0, axis=-1), "must be >= 0"),
              ("transmission", lambda m: (m["transmission"] == 0) | (m["transmission"] == 1), "must be 0 or 1"),
              ("ior", lambda m: (m["transmission"] == 0) | (m["ior"] >= 1), "of a glass must be >= 1"))
    for name, ok, why in checks:
        bad = np.flatnonzero(~ok(materials))
        if len(bad):
            return f"material {int(bad[0])}: {name} {materials[name][bad[0]].tolist()} {why}"
    return None


def _material_records(materials) -> np.ndarray:
    """``materials`` as MATERIAL_DTYPE records; a structured array of fewer fields (an older record
    layout's: color, roughness) is read by field name, the others MATERIAL_DEFAULTS'."""
    a = np.asarray(materials)
    if a.dtype.names is None or a.dtype == MATERIAL_DTYPE or not set(a.dtype.names) < set(MATERIAL_DTYPE.names):
        return np.ascontiguousarray(a, MATERIAL_DTYPE)
    return material_array(a["color"] if "color" in a.dtype.names else np.tile(MATERIAL_DEFAULTS["color"], (len(a), 1)),
                          **{n: a[n] for n in a.dtype.names if n != "color"})


@dataclass
class Tape:
    """A flattened scene: records, parameter pool, materials, instance lists and their BVH. Once
    validated (every walker and the file loader validate through VALIDATED), its arrays are
    read-only (``freeze``): change a parameter with ``set_param``, anything else by building a new
    tape (``dataclasses.replace`` with new arrays)."""
    instrs: np.ndarray                      # INSTR_DTYPE records
    params: np.ndarray                      # float32 parameter pool
    materials: np.ndarray                   # MATERIAL_DTYPE records, indexed by material id
    n_regs: int                             # registers the tape uses
    bounds: np.ndarray                      # (2, 3) float32: min and max corner of the surface
    names: dict[str, list[int]] = field(default_factory=dict)  # named parameter -> pool slots holding it
    instance_count: int = 1                 # primitive instances the tape stands for
    source: str = ""                        # where it came from (file / scene name)
    instances: np.ndarray = field(default_factory=lambda: np.zeros(0, INSTANCE_DTYPE))
    bvh: np.ndarray = field(default_factory=lambda: np.zeros(0, BVH_DTYPE))
    material_names: tuple[str, ...] = ()    # the name of each material id (empty: unnamed)
    # flatten's: the tape of the same scene with one named parameter changed (None: not from a scene)
    refit: Callable[[str, float], "Tape"] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        self.instrs = np.ascontiguousarray(self.instrs, INSTR_DTYPE)
        with np.errstate(over="ignore"):    # (past float32: inf, which validate() refuses by name)
            self.params = np.ascontiguousarray(self.params, np.float32)
            self.materials = _material_records(self.materials)
            self.bounds = np.asarray(self.bounds, np.float32).reshape(2, 3)
        self.instances = np.ascontiguousarray(np.zeros(0, INSTANCE_DTYPE) if self.instances is None
                                              else self.instances, INSTANCE_DTYPE)
        self.bvh = np.ascontiguousarray(np.zeros(0, BVH_DTYPE) if self.bvh is None else self.bvh, BVH_DTYPE)
        self.material_names = tuple(self.material_names)

    def __len__(self) -> int:
        return len(self.instrs)

    def has_patterns(self) -> bool:
        """Whether the tape holds a REPEAT_* loop (an instance list is not one)."""
        return bool(np.isin(self.instrs["op"], [op for op in REPEATS if op != Op.INSTANCES]).any())

    def op_counts(self) -> dict[str, int]:
        ops, counts = np.unique(self.instrs["op"], return_counts=True)
        return {Op(int(o)).name: int(c) for o, c in zip(ops, counts)}

    def set_param(self, name: str, value) -> bool:
        """Set a named parameter. A tape flattened from a scene is refitted: the scene is flattened
        again with the new value, so cull boxes, pattern extents and BVH boxes follow the edit and
        culling stays exact; returns True when anything but the parameter's own slots changed
        (the caller uploads the differences), False when only those slots were written. A tape
        without its scene (read from a .tape file, built by hand) gets its slots written and keeps
        the bounds it has: an edit that grows a part past them needs the scene. Its instance lists'
        upper bounds (a capsule proven inside the body for the values it was flattened with) are
        turned off, since an edit may shrink the body off its capsule: their walks start from +inf
        again (exact, slower)."""
        if name not in self.names:
            raise TaperayError(f"no parameter named {name!r} (have: {', '.join(sorted(self.names)) or 'none'})")
        slots = self.names[name]
        if self.refit is None:
            params = self.params.copy()           # (a validated tape's arrays are read-only: freeze)
            params[slots] = np.float32(value)
            bounded = self.instrs["param"][self.instrs["op"] == Op.INSTANCES]
            bounded = bounded[params[bounded + 12] >= 0]
            params[bounded + 12] = -1.0           # (r < 0: no capsule; opcodes.py)
            self.params = params
            return bool(len(bounded))
        new = self.refit(name, value)
        expected = self.params.copy()
        expected[slots] = np.float32(value)
        refitted = not (np.array_equal(new.instrs, self.instrs) and np.array_equal(new.bvh, self.bvh)
                        and np.array_equal(new.instances, self.instances)
                        and new.params.tobytes() == expected.tobytes())
        for f in ("instrs", "params", "n_regs", "bounds", "names", "instance_count",
                  "instances", "bvh", "refit"):      # (materials: the tape's own, set_material's edits kept)
            setattr(self, f, getattr(new, f))
        return refitted

    def set_material(self, name: str, **fields) -> np.ndarray:
        """Set fields (``color=``, ``roughness=``, ``emission=``, ``metallic=``, ``specular=``,
        ``ior=``, ``transmission=``) of every material record named ``name`` (material_names): a
        new materials array, the other records unchanged. Returns the material ids edited."""
        ids = np.flatnonzero(np.array([n == name for n in self.material_names], bool))
        if not len(ids):
            raise TaperayError(f"no material named {name!r} (have: {', '.join(n for n in self.material_names if n) or 'none'})")
        unknown = set(fields) - (set(MATERIAL_DTYPE.names) - {"pad"})
        if unknown:
            raise TaperayError(f"material {name!r}: no field {sorted(unknown)[0]!r} "
                               f"(have: {', '.join(n for n in MATERIAL_DTYPE.names if n != 'pad')})")
        mats = self.materials.copy()             # (a validated tape's arrays are read-only: freeze)
        try:
            for f, v in fields.items():
                mats[f][ids] = v
        except (TypeError, ValueError) as e:
            raise TaperayError(f"material {name!r}: {e}") from None
        bad = ("a material field is not finite" if not all(np.all(np.isfinite(mats[f])) for f in MATERIAL_DTYPE.names)
               else material_problem(mats))
        if bad:
            raise TaperayError(f"material {name!r}: {bad}")
        self.materials = mats
        return ids

    def as_columns(self) -> np.ndarray:
        """The instructions as a contiguous (n, 8) uint32 array (what the kernels read)."""
        return self.instrs.view(np.uint32).reshape(-1, 8)


def param_count(spec: OpSpec, a: int) -> int:
    """The parameters a record of ``spec``'s op reads (a polygon's: its fixed ones and 2 a vertex
    words, ``a`` its field a)."""
    if spec.op in POLY_OPS:
        return POLY_OPS[spec.op] + 2 * int(a)
    return spec.n_params


def validate(tape: Tape, reg_cap: int = max(REG_CAPS)) -> Tape:
    """Prove ``tape`` safe for every walker or raise ``TapeError`` naming the record and reason."""
    src = tape.source or None
    ins = tape.instrs
    if ins.dtype != INSTR_DTYPE:
        raise TapeError(f"instruction dtype {ins.dtype} is not the tape's record dtype", None, src)
    n = len(ins)
    if n == 0:
        raise TapeError("the tape is empty", None, src)
    if n > MAX_INSTRS:
        raise TapeError(f"{n} instructions exceed the limit of {MAX_INSTRS}", None, src)
    if len(tape.params) > MAX_PARAMS:
        raise TapeError(f"{len(tape.params)} parameters exceed the limit of {MAX_PARAMS}", None, src)
    if not 1 <= tape.n_regs <= reg_cap:
        raise TapeError(f"the tape needs {tape.n_regs} registers; kernels hold 1..{reg_cap}", None, src)
    if len(tape.materials) == 0 or len(tape.materials) > MAX_MATERIALS:
        raise TapeError(f"{len(tape.materials)} materials (need 1..{MAX_MATERIALS})", None, src)
    if tape.material_names and (len(tape.material_names) != len(tape.materials)
                                or not all(isinstance(n, str) for n in tape.material_names)):
        raise TapeError(f"{len(tape.material_names)} material names for {len(tape.materials)} materials", None, src)
    if not all(np.all(np.isfinite(tape.materials[f])) for f in MATERIAL_DTYPE.names):
        raise TapeError("a material holds a non-finite number", None, src)
    bad = material_problem(tape.materials)
    if bad:
        raise TapeError(bad, None, src)
    if not np.all(np.isfinite(tape.bounds)):
        raise TapeError("the bounds are not finite", None, src)
    for name, slots in tape.names.items():
        if not isinstance(name, str) or not isinstance(slots, (list, tuple)) or not slots or not all(
                isinstance(i, (int, np.integer)) and 0 <= i < len(tape.params) for i in slots):
            raise TapeError(f"named parameter {name!r} points outside the pool ({slots!r})", None, src)
    if np.isnan(tape.params).any():
        raise TapeError(f"parameter {int(np.flatnonzero(np.isnan(tape.params))[0])} is NaN", None, src)

    n_params, n_regs, n_mats = len(tape.params), tape.n_regs, len(tape.materials)
    cols = tape.as_columns().tolist()
    written = 0                      # bitset of definitely-written registers
    pending: dict[int, int] = {}     # jump target -> registers written on the jumping path
    depth = 0                        # point-stack depth
    depth_at: dict[int, int] = {}
    loops: list[int] = []            # open REPEAT_* indices
    loop_depth: list[int] = []       # point-stack depth where each open pattern began
    encl = _enclosing_loops(cols)    # innermost pattern body holding each record (-1: none)
    for i, (op, dst, a, b, c, param, aux, jump) in enumerate(cols):
        if i in pending:
            written &= pending.pop(i)
            if depth_at.pop(i) != depth:
                raise TapeError("a cull jumps to a record at a different point-stack depth", i, src)
        try:
            spec = OPS[Op(op)]
        except ValueError:
            raise TapeError(f"unknown opcode {op}", i, src) from None
        for fld, r in zip(("a", "b", "c"), (a, b, c)):
            if fld in spec.reads:
                if r >= n_regs:
                    raise TapeError(f"{spec.op.name} reads register {r} of {n_regs}", i, src)
                if not written >> r & 1:
                    raise TapeError(f"{spec.op.name} reads register {r} before it is written", i, src)
        if spec.writes and dst >= n_regs:
            raise TapeError(f"{spec.op.name} writes register {dst} of {n_regs}", i, src)
        if spec.op in POLY_OPS and not 3 <= a <= MAX_POLY_VERTS:
            raise TapeError(f"{spec.op.name} has {a} vertices (need 3..{MAX_POLY_VERTS})", i, src)
        k = param_count(spec, a)
        if k and param + k > n_params:
            raise TapeError(f"{spec.op.name} reads parameters {param}..{param + k - 1} of {n_params}", i, src)
        if spec.family is Family.SHAPE and aux >= n_mats:
            raise TapeError(f"{spec.op.name} uses material {aux} of {n_mats}", i, src)
        if spec.op in (Op.CULL_BOX, Op.FIELD_RESULT) and aux >= n_mats:
            raise TapeError(f"{spec.op.name} uses material {aux} of {n_mats}", i, src)
        if spec.op is Op.PUSH:
            depth += 1
            if depth > STACK_CAP:
                raise TapeError(f"point stack deeper than {STACK_CAP}", i, src)
        elif spec.op is Op.POP:
            depth -= 1
            if depth < 0:
                raise TapeError("POP without a matching PUSH", i, src)
        elif spec.op in REPEATS:
            if spec.op is Op.INSTANCES:
                _check_instances(tape, aux, a, param, i, src)
            if not i < jump < n or cols[jump][0] != Op.REPEAT_END or cols[jump][7] != i:
                raise TapeError(f"{spec.op.name} jump {jump} is not its REPEAT_END", i, src)
            loops.append(i)
            loop_depth.append(depth)
            if len(loops) > LOOP_CAP:
                raise TapeError(f"patterns nested deeper than {LOOP_CAP}", i, src)
            if spec.op is not Op.INSTANCES:
                _check_pattern(spec.op, tape.params[param:param + k], i, src)
        elif spec.op is Op.REPEAT_END:
            if not loops or loops[-1] != jump:
                raise TapeError(f"REPEAT_END jump {jump} does not close the innermost pattern", i, src)
            loops.pop()
            if loop_depth.pop() != depth:
                raise TapeError("a pattern body leaves the point stack unbalanced (PUSH without POP)", i, src)
        elif spec.op is Op.CULL_BOX:
            if not i < jump <= n:
                raise TapeError(f"cull jump target {jump} outside ({i}, {n}]", i, src)
            if jump < n and encl[jump] != encl[i]:
                raise TapeError("a cull jumps out of or into a pattern body", i, src)
            if jump == n:
                raise TapeError("a cull jumps past the end of the tape", i, src)
            path = written | (1 << dst)
            pending[jump] = pending.get(jump, path) & path
            if depth_at.setdefault(jump, depth) != depth:
                raise TapeError("culls to one target at different stack depths", i, src)
        if spec.writes:
            written |= 1 << dst
    if pending:
        raise TapeError("a jump target lies past the end", None, src)
    if depth:
        raise TapeError(f"{depth} PUSH without POP at the end of the tape", n - 1, src)
    if loops:
        raise TapeError("a pattern is not closed", loops[-1], src)
    if not written & 1:
        raise TapeError("the tape never writes its result register 0", n - 1, src)
    return tape


def point_array(points, what: str, dtype=None) -> np.ndarray:
    """``points`` as an (N, 3) array (the walkers' point argument), or TaperayError naming ``what``."""
    pts = np.asarray(points) if dtype is None else np.asarray(points, dtype)
    if pts.ndim != 2 or pts.shape[1] != 3:
        raise TaperayError(f"{what}: points must be (N, 3), got {pts.shape}")
    return pts


def gradient_eps(tape: Tape, eps: float | None) -> np.float32:
    """The central-difference step of the walkers' gradient: ``eps``, or 1e-3 of the bounds diagonal."""
    if eps is None:
        eps = 1e-3 * max(float(np.linalg.norm(tape.bounds[1] - tape.bounds[0])), 1e-3)
    return np.float32(eps)


def quat_matrices(q: np.ndarray) -> np.ndarray:
    """(N, 3, 3) rotation matrices of (N, 4) unit quaternions (w, x, y, z): the rotations of
    INSTANCE_DTYPE's q and of ROTATE's parameters."""
    w, x, y, z = (q[:, i] for i in range(4))
    return np.stack([1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
                     2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
                     2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)], -1).reshape(-1, 3, 3)


_ARRAYS = ("instrs", "params", "materials", "bounds", "instances", "bvh")


def freeze(tape: Tape) -> Tape:
    """Make the tape's arrays read-only (in place; returns the tape). ``ValidatedTapes.check``
    freezes every tape it has validated, so a tape that was validated cannot change behind the
    record: edits go through ``Tape.set_param`` (which writes a copy) or build a new tape."""
    for name in _ARRAYS:
        getattr(tape, name).flags.writeable = False
    return tape


def derived(tape: Tape, name: str, source: np.ndarray, make):
    """``make()``, kept on the tape under ``name`` while the tape holds the same frozen ``source``
    array (a writable one may change in place: made again at every call). The twin keeps its
    per-tape arrays this way (the BVH as its walk reads it, the split culls' registers)."""
    memo = tape.__dict__.get(name)
    if memo is not None and memo[0] is source and not source.flags.writeable:
        return memo[1]
    value = make()
    tape.__dict__[name] = (source, value)
    return value


def content_key(tape: Tape) -> int:
    """A hash of everything a tape's evaluation depends on (its content, not its identity: an
    edited tape gets a new key): the key of the walkers' and pruning's per-tape caches. It reads
    every byte (10 MB for the 100,000-bolt bin, some 3 ms), so a frozen tape (``freeze``) keeps
    its key for as long as it holds the same read-only arrays."""
    arrays = tuple(getattr(tape, name) for name in _ARRAYS)
    sizes = (tape.n_regs, len(tape.materials))
    frozen = not any(a.flags.writeable for a in arrays)
    memo = tape.__dict__.get("_content_key")
    if frozen and memo is not None and memo[1] == sizes and all(a is b for a, b in zip(memo[0], arrays)):
        return memo[2]
    key = hash((tape.instrs.tobytes(), tape.params.tobytes(), tape.n_regs, tape.bvh.tobytes(),
                tape.instances.tobytes(), len(tape.materials), tape.bounds.tobytes()))
    if frozen:
        tape.__dict__["_content_key"] = (arrays, sizes, key)    # (the arrays kept: no id is reused)
    return key


class ValidatedTapes:
    """A record of the tapes validated, by content (at most 65 kept): ``check`` runs ``validate``
    once per distinct tape. One record (VALIDATED) serves the whole process: the walkers and the
    file loader, so a tape read from a file is not validated again by the walker it is drawn on."""

    def __init__(self):
        self._keys: set[int] = set()

    @staticmethod
    def key(tape: Tape) -> int:
        """content_key plus what else validate reads: the materials, the names and the dtypes."""
        return hash((content_key(tape), tape.materials.tobytes(), tape.materials.dtype.str,
                     tuple((k, tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in tape.names.items()),
                     tuple(getattr(tape, a).dtype.str for a in ("instrs", "params", "instances", "bvh"))))

    def check(self, tape: Tape) -> None:
        """Freeze the tape, then validate it unless a tape of the same content was."""
        key = self.key(freeze(tape))             # (frozen first: its content key is then kept)
        if key not in self._keys:
            validate(tape)
            if len(self._keys) > 64:
                self._keys.clear()
            self._keys.add(key)


VALIDATED = ValidatedTapes()


def _enclosing_loops(cols: list) -> list[int]:
    """For each record, the REPEAT_* / INSTANCES whose body holds it (its REPEAT_END included)."""
    out, open_ = [], []
    for op, *_ in cols:
        if op == Op.REPEAT_END and open_:
            out.append(open_.pop())
            continue
        out.append(open_[-1] if open_ else -1)
        if op in REPEATS:
            open_.append(len(out) - 1)
    return out


def pattern_counts(op: Op, prm: np.ndarray) -> np.ndarray:
    """A REPEAT_* record's copy counts from its parameters ``prm`` (linear, polar: one; grid:
    three, one an axis), as float32 parameters."""
    return {Op.REPEAT_LINEAR: prm[3:4], Op.REPEAT_POLAR: prm[0:1], Op.REPEAT_GRID: prm[3:6]}[op]


def _check_pattern(op: Op, prm: np.ndarray, i: int, src):
    if not np.all(np.isfinite(prm)):
        raise TapeError(f"{op.name} has non-finite parameters", i, src)
    counts = pattern_counts(op, prm)
    if np.any(counts < 1) or np.any(counts != np.round(counts)) or np.any(counts > 1 << 24):
        raise TapeError(f"{op.name} counts {counts.tolist()} must be whole numbers in 1..2^24", i, src)


def _check_instances(tape: Tape, first: int, count: int, param: int, i: int, src):
    """An INSTANCES record's BVH range (in bounds, skips forward within the range, leaves valid) and
    parameters (opcodes.py: a finite child box and capsule; with a capsule, a grid of whole
    positive counts whose representatives are instances of this record's leaves)."""
    bvh = tape.bvh
    if count < 1 or first + count > len(bvh):
        raise TapeError(f"INSTANCES uses BVH nodes {first}..{first + count - 1} of {len(bvh)}", i, src)
    nodes = bvh[first:first + count]
    idx = np.arange(first, first + count)
    bad = np.flatnonzero((nodes["skip"] <= idx) | (nodes["skip"] > first + count))
    if bad.size:
        raise TapeError(f"BVH node {int(idx[bad[0]])} skips to {int(nodes['skip'][bad[0]])}, "
                        f"outside ({int(idx[bad[0]])}, {first + count}]", i, src)
    named = nodes["instance"]                     # (a leaf's instance, -1 for an inner node)
    if named.min() < -1 or named.max() >= len(tape.instances):
        raise TapeError(f"a BVH node of INSTANCES names an instance outside 0..{len(tape.instances) - 1}", i, src)
    leaf = named >= 0
    if np.any(leaf & (nodes["skip"] != idx + 1)):
        raise TapeError("a BVH leaf must skip to the next node", i, src)
    if not (np.all(np.isfinite(nodes["lo"])) and np.all(np.isfinite(nodes["hi"]))):
        raise TapeError("a BVH box is not finite", i, src)
    words = np.ascontiguousarray(tape.instances).view(np.float32).reshape(-1, 8)   # q (4), t (3), s: whole rows
    if not (np.isfinite(words).all() and words[:, 7].min() > 0):
        raise TapeError("an instance transform is not finite or has scale <= 0", i, src)
    fixed = OPS[Op.INSTANCES].n_params             # (the words before the grid's representatives)
    head = tape.params[param:param + fixed].astype(np.float64)
    if not np.all(np.isfinite(head)) or np.any(head[:3] > head[3:6]):
        raise TapeError("INSTANCES' child box or capsule is not finite, or its box is inverted", i, src)
    if head[12] < 0:
        return
    dims = head[17:20]
    if head[16] <= 0 or np.any(dims < 1) or np.any(dims != np.round(dims)) or dims.prod() > 1 << 24:
        raise TapeError(f"INSTANCES' grid has cell edge {head[16]} and counts {dims.tolist()}: need an edge > 0 "
                        "and whole counts >= 1", i, src)
    cells = int(dims.prod())
    if param + fixed + cells > len(tape.params):
        raise TapeError(f"INSTANCES' grid of {cells} cells reads parameters past the pool's {len(tape.params)}", i, src)
    reps = tape.params[param + fixed:param + fixed + cells]
    listed = np.zeros(len(tape.instances) + 1, bool)      # (the last entry: anything else)
    listed[nodes["instance"][leaf]] = True
    whole = (reps >= 0) & (reps < len(tape.instances)) & (reps == np.floor(reps))
    ok = listed[np.where(whole, reps, len(tape.instances)).astype(np.int64)]
    if not ok.all():
        bad = int(np.flatnonzero(~ok)[0])
        raise TapeError(f"INSTANCES' grid cell {bad} names {reps[bad]:g}, not an instance of its list", i, src)


def pool_tangents(tape: "Tape", names, rel: float = 1e-2) -> dict:
    """name -> (P,) d(pool)/d(name). A named parameter owns its slots (tape.names) but a refit may
    derive other slots from it too (a pattern's extent, a bound): those slots carry part of the
    field's derivative (a linear pattern of boxes: half of it on the box's own faces). The derived
    slots' rates come from central differences of the refitted pool (they are linear in the
    parameter where the flattener computes extents); the owned slots get exactly 1. A tape
    without its scene, or whose refit changes the pool's layout, gets the owned slots only."""
    out = {}
    for nm in names:
        t = np.zeros(len(tape.params), np.float64)
        own = tape.names[nm]
        v = float(tape.params[own[0]])
        refit = getattr(tape, "refit", None)
        if refit is not None:
            h = rel * max(abs(v), 1e-3 * float(np.max(np.asarray(tape.bounds[1]) - np.asarray(tape.bounds[0]))))
            try:
                a, b = refit(nm, v + h), refit(nm, v - h)
            except TaperayError:
                a = b = None
            if a is not None and len(a.params) == len(tape.params) == len(b.params) \
                    and np.array_equal(a.instrs, tape.instrs):
                t = (a.params.astype(np.float64) - b.params.astype(np.float64)) / (2 * h)
                t[np.abs(t) < 1e-3] = 0.0               # (float32 round-off of untouched slots)
        t[own] = 1.0
        out[nm] = t.astype(np.float32)
    return out
