"""The modelling API: one data-driven ``Node`` class whose kinds are rows of ``KINDS``.

A node is (kind, numbers, children, material). Primitives, booleans, transforms, modifiers and
patterns are all rows of one table that says which opcode a kind flattens to and how its numbers
are named — no class per shape. Numbers may be plain floats or named ``Param``s (free parameters
a slider or optimiser moves). ``to_dict`` / ``node_from_dict`` are the scene-file body.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from taperay.runtime.tape import (INSTANCE_DTYPE, INSTR_DTYPE, MATERIAL_DEFAULTS, MATERIAL_DTYPE, Tape, TaperayError,
                                  material_array, material_problem, validate)

__all__ = ["Node", "Param", "Material", "KINDS", "node_from_dict", "with_params", "sphere", "box", "rounded_box",
           "cylinder", "capped_cone", "capsule", "torus", "ellipsoid", "plane", "extrude", "revolve",
           "union", "intersection", "difference", "xor", "smooth_union", "smooth_intersection",
           "smooth_difference", "DEFAULT_MATERIAL"]


@dataclass(frozen=True)
class Param:
    """A named free parameter: usable wherever a node takes a number; stable name in the tape.

    Its number is ``value``, unless a flatten with other values is under way (``param_values``):
    that is how ``Tape.set_param`` refits cull boxes, pattern extents and BVH boxes to an edit.
    """
    name: str
    value: float

    def __float__(self) -> float:
        values = _PARAM_VALUES.get()
        return float(self.value if values is None else values.get(self.name, self.value))


_PARAM_VALUES: ContextVar[dict[str, float] | None] = ContextVar("taperay_param_values", default=None)


@contextmanager
def param_values(values: dict[str, float] | None):
    """Within the block, every ``Param`` named in ``values`` reads as that value."""
    token = _PARAM_VALUES.set(values)
    try:
        yield
    finally:
        _PARAM_VALUES.reset(token)


@dataclass(frozen=True)
class Material:
    """A named surface material (a MATERIAL_DTYPE record of the tape): base colour (linear RGB in
    [0, 1]), roughness (GGX, 0 mirror-smooth .. 1), metallic (0 dielectric .. 1 metal), emission
    (the radiance the surface emits, linear RGB >= 0), specular (a dielectric's reflectance at
    normal incidence is 0.08 specular; 0: a Lambertian surface), and, for smooth glass,
    transmission 1 with its index of refraction ``ior`` (the colour then tints the light it lets
    through). The march's shading reads colour and roughness; the path tracer every field.

    Boundary conditions of simulations attach to materials by ``name``.
    """
    name: str
    color: tuple[float, float, float] = MATERIAL_DEFAULTS["color"]
    roughness: float = MATERIAL_DEFAULTS["roughness"]
    metallic: float = MATERIAL_DEFAULTS["metallic"]
    emission: tuple[float, float, float] = MATERIAL_DEFAULTS["emission"]
    specular: float = MATERIAL_DEFAULTS["specular"]
    ior: float = MATERIAL_DEFAULTS["ior"]
    transmission: float = MATERIAL_DEFAULTS["transmission"]

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise TaperayError(f"a material's name must be a non-empty string, got {self.name!r} "
                               "(Material(name, color, roughness, metallic, emission, ...))")
        for f in ("color", "emission"):
            if np.shape(getattr(self, f)) != (3,):
                raise TaperayError(f"material {self.name!r}: {f} must be 3 numbers, got {getattr(self, f)!r}")
        try:
            rec = self.record()
        except (TypeError, ValueError):
            raise TaperayError(f"material {self.name!r}: its fields must be numbers ({self!r})") from None
        bad = ("a field is not finite" if not all(np.all(np.isfinite(rec[f])) for f in MATERIAL_DTYPE.names)
               else material_problem(rec))
        if bad:
            raise TaperayError(f"material {self.name!r}: {bad.split(': ', 1)[-1]}")

    def record(self) -> np.ndarray:
        """The material as a (1,) MATERIAL_DTYPE array (what flatten writes into the tape)."""
        return material_array([self.color], self.roughness, metallic=self.metallic, emission=self.emission,
                              specular=self.specular, ior=self.ior, transmission=self.transmission)

    def to_dict(self) -> dict:
        return {"name": self.name, "color": [float(c) for c in self.color], "roughness": float(self.roughness),
                "metallic": float(self.metallic), "emission": [float(c) for c in self.emission],
                "specular": float(self.specular), "ior": float(self.ior), "transmission": float(self.transmission)}


DEFAULT_MATERIAL = Material("default")


@dataclass(frozen=True)
class Kind:
    name: str
    family: str                 # shape | combine | modifier | transform | pattern | group
    numbers: tuple[str, ...]    # names of the node's numbers (a trailing '*' = variable list)
    children: int               # -1: any number >= 1


KINDS: dict[str, Kind] = {k.name: k for k in [
    Kind("sphere", "shape", ("r",), 0),
    Kind("box", "shape", ("hx", "hy", "hz"), 0),
    Kind("rounded_box", "shape", ("hx", "hy", "hz", "r"), 0),
    Kind("cylinder", "shape", ("r", "h"), 0),
    Kind("capped_cone", "shape", ("h", "r1", "r2"), 0),
    Kind("capsule", "shape", ("ax", "ay", "az", "bx", "by", "bz", "r"), 0),
    Kind("torus", "shape", ("R", "r"), 0),
    Kind("ellipsoid", "shape", ("rx", "ry", "rz"), 0),
    Kind("plane", "shape", ("nx", "ny", "nz", "d"), 0),
    Kind("extrude", "shape", ("h", "xy*"), 0),
    Kind("revolve", "shape", ("rz*",), 0),
    Kind("union", "combine", (), -1),
    Kind("intersection", "combine", (), -1),
    Kind("difference", "combine", (), -1),
    Kind("xor", "combine", (), 2),
    Kind("smooth_union", "combine", ("k",), -1),
    Kind("smooth_intersection", "combine", ("k",), -1),
    Kind("smooth_difference", "combine", ("k",), -1),
    Kind("offset", "modifier", ("r",), 1),
    Kind("shell", "modifier", ("t",), 1),
    Kind("transform", "transform", ("tx", "ty", "tz", "qw", "qx", "qy", "qz", "s"), 1),
    Kind("mirror", "transform", ("nx", "ny", "nz", "d"), 1),
    Kind("elongate", "transform", ("hx", "hy", "hz"), 1),
    Kind("linear_pattern", "pattern", ("dx", "dy", "dz", "n"), 1),
    Kind("polar_pattern", "pattern", ("n",), 1),
    Kind("grid_pattern", "pattern", ("sx", "sy", "sz", "nx", "ny", "nz"), 1),
    Kind("instances", "pattern", (), 1),     # placements in Node.array (INSTANCE_DTYPE)
    Kind("field", "shape", ("x0", "y0", "z0", "x1", "y1", "z1"), 0),   # arithmetic tape in Node.tape
]}


def _num(v):
    if isinstance(v, Param):
        if not isinstance(v.name, str) or not v.name:
            raise TaperayError(f"a parameter needs a non-empty name, got {v.name!r}")
        return Param(v.name, float(v.value))
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise TaperayError(f"expected a number or Param, got {v!r}") from None
    if not math.isfinite(f):
        raise TaperayError(f"expected a finite number, got {v!r}")
    return f


def _quat_axis_angle(axis, degrees):
    a = np.asarray(axis, float)
    n = np.linalg.norm(a)
    if n == 0:
        raise TaperayError("rotation axis is zero")
    h = math.radians(float(degrees)) / 2
    return (math.cos(h), *(a / n * math.sin(h)))


@dataclass(frozen=True, eq=False)
class Node:
    """One node of a scene tree: a shape, a boolean, a transform, a pattern or a field. Build
    them with the functions of this module (``sphere``, ``union``, ...) and the methods below
    (``translate``, ``linear_pattern``, ``material`` ...); ``flatten`` turns a tree into a tape.
    Numbers may be ``Param``s: named values that an optimiser or a slider moves later."""
    kind: str
    numbers: tuple = ()
    children: tuple["Node", ...] = ()
    mat: Material | None = None
    array: np.ndarray | None = None     # per-instance placements of an "instances" node
    tape: Tape | None = None            # the arithmetic sub-tape of a "field" node

    def __post_init__(self):
        spec = KINDS.get(self.kind)
        if spec is None:
            raise TaperayError(f"unknown node kind {self.kind!r}")
        if (self.kind == "instances") != (self.array is not None):
            raise TaperayError("only an instances node carries a placement array, and it must")
        if (self.kind == "field") != (self.tape is not None):
            raise TaperayError("only a field node carries an arithmetic tape, and it must")
        if self.array is not None and (self.array.dtype != INSTANCE_DTYPE or self.array.ndim != 1 or not len(self.array)):
            raise TaperayError("instance placements must be a non-empty INSTANCE_DTYPE array")
        nums = tuple(_num(v) for v in self.numbers)
        object.__setattr__(self, "numbers", nums)
        fixed = [n for n in spec.numbers if not n.endswith("*")]
        variable = len(fixed) != len(spec.numbers)
        if len(nums) < len(fixed) or (not variable and len(nums) != len(fixed)):
            raise TaperayError(f"{self.kind} takes numbers {spec.numbers}, got {len(nums)}")
        if variable and (len(nums) - len(fixed)) % 2:
            raise TaperayError(f"{self.kind}: the vertex list needs pairs of numbers")
        for c in self.children:
            if not isinstance(c, Node):
                raise TaperayError(f"{self.kind}: child {c!r} is not a scene node")
        if spec.children >= 0 and len(self.children) != spec.children:
            raise TaperayError(f"{self.kind} takes {spec.children} children, got {len(self.children)}")
        if spec.children < 0 and not self.children:
            raise TaperayError(f"{self.kind} needs at least one child")
        _check_values(self)

    # -- values --------------------------------------------------------------------------------
    def value(self, i: int) -> float:
        """The node's i-th number as a float (a ``Param`` reads as its current value)."""
        return float(self.numbers[i])

    def values(self) -> np.ndarray:
        """All the node's numbers as float64 (``Param``s read as their current values)."""
        return np.array([float(v) for v in self.numbers], np.float64)

    # -- booleans ------------------------------------------------------------------------------
    def __or__(self, other): return union(self, other)
    def __and__(self, other): return intersection(self, other)
    def __sub__(self, other): return difference(self, other)
    def __xor__(self, other): return xor(self, other)

    def smooth_union(self, other, k):
        """``smooth_union(self, other, k=k)``."""
        return smooth_union(self, other, k=k)

    def smooth_intersection(self, other, k):
        """``smooth_intersection(self, other, k=k)``."""
        return smooth_intersection(self, other, k=k)

    def smooth_difference(self, other, k):
        """``smooth_difference(self, other, k=k)``."""
        return smooth_difference(self, other, k=k)

    # -- transforms and modifiers --------------------------------------------------------------
    def translate(self, x, y=0.0, z=0.0):
        """This node moved by (x, y, z) (or one 3-sequence ``x``)."""
        if isinstance(x, (tuple, list, np.ndarray)):
            x, y, z = x
        return Node("transform", (x, y, z, 1, 0, 0, 0, 1), (self,))

    def rotate(self, axis, degrees):
        """This node rotated by ``degrees`` about ``axis`` (a 3-vector through the origin).

            >>> cylinder(0.2, 1).rotate((1, 0, 0), 90)     # now along y
        """
        return Node("transform", (0, 0, 0, *_quat_axis_angle(axis, degrees), 1), (self,))

    def rotate_quat(self, w, x, y, z):
        """This node rotated by the unit quaternion (w, x, y, z)."""
        return Node("transform", (0, 0, 0, w, x, y, z, 1), (self,))

    def scale(self, s):
        """This node scaled uniformly by ``s`` (distances scale with it, so they stay exact)."""
        return Node("transform", (0, 0, 0, 1, 0, 0, 0, s), (self,))

    def mirror(self, normal=(1, 0, 0), d=0.0):
        """This node's half dot(p, n) >= d mirrored across the plane dot(p, n) = d."""
        n = np.asarray(normal, float)
        n = n / np.linalg.norm(n)
        return Node("mirror", (*n, d), (self,))

    def elongate(self, hx, hy=0.0, hz=0.0):
        """This node stretched: its centre slab widened by 2 hx, 2 hy, 2 hz along x, y, z."""
        return Node("elongate", (hx, hy, hz), (self,))

    def offset(self, r):
        """This node grown by ``r`` (shrunk where r < 0): its distance minus r."""
        return Node("offset", (r,), (self,))

    def shell(self, t):
        """A hollow skin of half thickness ``t`` about this node's surface: |distance| - t."""
        return Node("shell", (t,), (self,))

    def material(self, m: Material):
        """This node with material ``m`` (what the renderer colours it, and what boundary
        conditions attach to by name)."""
        if not isinstance(m, Material):
            raise TaperayError(f"material must be a Material, got {m!r}")
        return Node(self.kind, self.numbers, self.children, m, self.array, self.tape)

    # -- patterns ------------------------------------------------------------------------------
    def linear_pattern(self, step, count):
        """``count`` copies of this node at k * step, k = 0 .. count - 1 (O(1) to evaluate
        whatever the count: domain repetition)."""
        return Node("linear_pattern", (*step, count), (self,))

    def polar_pattern(self, count):
        """``count`` copies rotated about the z axis."""
        return Node("polar_pattern", (count,), (self,))

    def grid_pattern(self, spacing, counts):
        """Copies at (i sx, j sy, k sz) for i, j, k below counts (nx, ny, nz); O(1) to evaluate."""
        return Node("grid_pattern", (*spacing, *counts), (self,))

    def instances(self, translations, rotations=None, scales=None):
        """Copies of this node at arbitrary placements: (N,3) translations, optional (N,4) unit
        quaternions (w,x,y,z) and (N,) scales. Walked through a BVH; no per-copy records."""
        return Node("instances", (), (self,), None, placements(translations, rotations, scales))

    # -- files ---------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The node as plain data (what a ``.scene`` file stores; ``node_from_dict`` reads it)."""
        d = {"kind": self.kind,
             "numbers": [{"param": v.name, "value": v.value} if isinstance(v, Param) else v
                         for v in self.numbers]}
        if self.children:
            d["children"] = [c.to_dict() for c in self.children]
        if self.array is not None:
            d["placements"] = self.array.tobytes()
        if self.tape is not None:
            d["tape"] = {"instrs": self.tape.instrs.tobytes(), "params": self.tape.params.tobytes(),
                         "n_regs": self.tape.n_regs}
        if self.mat is not None:
            d["material"] = self.mat.to_dict()
        return d

    def walk(self) -> Iterable["Node"]:
        """This node and every node below it, depth first (pre-order; no recursion, so any depth)."""
        stack = [self]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(reversed(n.children))

    def depth(self) -> int:
        """Levels from this node to its deepest leaf (a leaf: 1)."""
        deepest, stack = 0, [(self, 1)]
        while stack:
            n, d = stack.pop()
            deepest = max(deepest, d)
            stack.extend((c, d + 1) for c in n.children)
        return deepest

    def params(self) -> dict[str, float]:
        """The named ``Param``s anywhere in this tree: name -> value."""
        return {v.name: v.value for n in self.walk() for v in n.numbers if isinstance(v, Param)}

    def __repr__(self):
        inner = ", ".join(repr(c) for c in self.children)
        return f"{self.kind}({', '.join(f'{v:g}' if isinstance(v, float) else repr(v) for v in self.numbers[:4])}" \
               f"{'…' if len(self.numbers) > 4 else ''}{'; ' + inner if inner else ''})"


def placements(translations, rotations=None, scales=None) -> np.ndarray:
    """An INSTANCE_DTYPE array from (N,3) translations, optional (N,4) unit quaternions (w,x,y,z)
    and optional (N,) uniform scales; read-only (a node's placements do not change, so flatten
    digests them once: scenegraph.instancing)."""
    t = np.asarray(translations, np.float64)
    if t.ndim != 2 or t.shape[1] != 3 or len(t) == 0:
        raise TaperayError(f"instance translations must be an (N,3) array with N >= 1, got shape {t.shape}")
    n = len(t)
    q = np.tile([1.0, 0, 0, 0], (n, 1)) if rotations is None else np.asarray(rotations, np.float64)
    s = np.ones(n) if scales is None else np.broadcast_to(np.asarray(scales, np.float64), (n,))
    if q.shape != (n, 4):
        raise TaperayError(f"instance rotations must be an ({n},4) quaternion array, got shape {q.shape}")
    norms = np.linalg.norm(q, axis=1)
    if not (np.all(np.isfinite(t)) and np.all(np.isfinite(q)) and np.all(np.isfinite(s))):
        raise TaperayError("instance placements hold a non-finite number")
    if np.any(np.abs(norms - 1) > 1e-4):
        raise TaperayError(f"instance rotation {int(np.argmax(np.abs(norms - 1)))} is not a unit quaternion")
    if np.any(s <= 0):
        raise TaperayError(f"instance scale {int(np.argmax(s <= 0))} is not > 0")
    out = np.zeros(n, INSTANCE_DTYPE)
    out["q"], out["t"], out["s"] = q / norms[:, None], t, s
    out.flags.writeable = False
    return out


def _check_values(n: Node):
    v = n.values()
    k = n.kind
    positive = {"sphere": [0], "box": [0, 1, 2], "rounded_box": [0, 1, 2, 3], "cylinder": [0, 1],
                "capped_cone": [0], "capsule": [6], "torus": [0, 1], "ellipsoid": [0, 1, 2],
                "extrude": [0], "smooth_union": [0], "smooth_intersection": [0],
                "smooth_difference": [0], "shell": [0], "transform": [7]}.get(k, [])
    for i in positive:
        if not v[i] > 0:
            raise TaperayError(f"{k}: {KINDS[k].numbers[i]} must be > 0, got {v[i]:g}")
    if k == "rounded_box" and v[3] > min(v[:3]):
        raise TaperayError("rounded_box: rounding radius exceeds a half extent")
    if k == "capped_cone" and (v[1] < 0 or v[2] < 0 or v[1] + v[2] == 0):
        raise TaperayError("capped_cone: radii must be >= 0 and not both 0")
    if k in ("plane", "mirror") and not np.isclose(np.linalg.norm(v[:3]), 1, atol=1e-5):
        raise TaperayError(f"{k}: normal must be a unit vector")
    if k == "transform" and not np.isclose(np.linalg.norm(v[3:7]), 1, atol=1e-5):
        raise TaperayError("transform: rotation quaternion must have unit length")
    if k == "elongate" and np.any(v < 0):
        raise TaperayError("elongate: half lengths must be >= 0")
    if k in ("extrude", "revolve"):
        nverts = (len(v) - (1 if k == "extrude" else 0)) // 2
        if not 3 <= nverts <= 1024:
            raise TaperayError(f"{k}: a profile needs 3..1024 vertices, got {nverts}")
    counts = {"linear_pattern": v[3:4], "polar_pattern": v[0:1], "grid_pattern": v[3:6]}.get(k)
    if counts is not None and (np.any(counts < 1) or np.any(counts != np.round(counts)) or np.any(counts > 1 << 24)):
        raise TaperayError(f"{k}: counts must be whole numbers in 1..2^24, got {counts.tolist()}")
    if k == "linear_pattern" and not np.any(v[:3]):
        raise TaperayError("linear_pattern: the step vector is zero")
    if k == "grid_pattern" and np.any(v[:3] <= 0):
        raise TaperayError("grid_pattern: spacings must be > 0")


def node_from_dict(d, depth: int = 0) -> Node:
    """Rebuild a node tree from ``Node.to_dict`` output; any defect raises ``TaperayError``."""
    if depth > 10_000:
        raise TaperayError("scene tree nested too deeply")
    if not isinstance(d, dict) or not isinstance(d.get("kind"), str):
        raise TaperayError(f"a scene node must be a map with a 'kind' string, got {type(d).__name__}")
    nums = d.get("numbers", [])
    if not isinstance(nums, list):
        raise TaperayError(f"{d['kind']}: 'numbers' must be a list")
    numbers = []
    for v in nums:
        if isinstance(v, dict):
            if not isinstance(v.get("param"), str) or not isinstance(v.get("value"), (int, float)):
                raise TaperayError(f"{d['kind']}: a parameter needs a 'param' name and a numeric 'value'")
            numbers.append(Param(v["param"], v["value"]))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            numbers.append(v)
        else:
            raise TaperayError(f"{d['kind']}: bad number {v!r}")
    kids = d.get("children", [])
    if not isinstance(kids, list):
        raise TaperayError(f"{d['kind']}: 'children' must be a list")
    mat = d.get("material")
    if mat is not None:
        try:     # (fields after roughness: files written before them have none, so the defaults)
            color = tuple(float(c) for c in mat["color"])
            emission = tuple(float(c) for c in mat.get("emission", MATERIAL_DEFAULTS["emission"]))
            if len(color) != 3 or len(emission) != 3 or not all(map(math.isfinite, color + emission)):
                raise ValueError
            mat = Material(str(mat["name"]), color, float(mat["roughness"]),
                           **{f: float(mat.get(f, MATERIAL_DEFAULTS[f])) for f in ("metallic", "specular", "ior",
                                                                                     "transmission")},
                           emission=emission)
        except (KeyError, TypeError, ValueError, AttributeError, TaperayError):
            raise TaperayError(f"{d['kind']}: bad material {mat!r}") from None
    array = None
    if "placements" in d:
        raw = d["placements"]
        if not isinstance(raw, bytes) or len(raw) % INSTANCE_DTYPE.itemsize:
            raise TaperayError(f"{d['kind']}: placements must be bytes of whole INSTANCE_DTYPE records")
        rec = np.frombuffer(raw, INSTANCE_DTYPE)
        if len(rec):
            placements(rec["t"], rec["q"], rec["s"])   # validates; the stored records are kept bit-exact
            array = rec.copy()
    tape = None
    if "tape" in d:
        t = d["tape"]
        try:
            raw_i, raw_p, n_regs = t["instrs"], t["params"], int(t["n_regs"])
            if not isinstance(raw_i, bytes) or not isinstance(raw_p, bytes) \
                    or len(raw_i) % INSTR_DTYPE.itemsize or len(raw_p) % 4:
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise TaperayError(f"{d['kind']}: a field tape needs instrs/params bytes and n_regs") from None
        tape = validate(Tape(np.frombuffer(raw_i, INSTR_DTYPE), np.frombuffer(raw_p, "<f4"),
                             np.zeros(1, MATERIAL_DTYPE), n_regs, np.zeros((2, 3))))
    return Node(d["kind"], tuple(numbers), tuple(node_from_dict(c, depth + 1) for c in kids), mat, array, tape)


# -- constructors ------------------------------------------------------------------------------
def sphere(r=1.0):
    """A sphere of radius ``r`` about the origin (exact distance).

        >>> sphere(Param("r", 0.5)).translate(0, 0, 1)
    """
    return Node("sphere", (r,))


def box(hx=1.0, hy=None, hz=None):
    """A box centred on the origin with half extents (hx, hy, hz); ``box(h)`` is a cube of half
    side h (exact distance)."""
    return Node("box", (hx, hx if hy is None else hy, hx if hz is None else hz))


def rounded_box(hx, hy, hz, r):
    """A box of half extents (hx, hy, hz) whose edges are rounded with radius ``r`` (the rounding
    lies inside those extents; exact distance)."""
    return Node("rounded_box", (hx, hy, hz, r))


def cylinder(r, h):
    """A capped cylinder on the z axis: radius ``r``, z in [-h, h] (exact distance)."""
    return Node("cylinder", (r, h))


def capped_cone(h, r1, r2):
    """A capped cone on the z axis: radius ``r1`` at z = -h, ``r2`` at z = +h (exact distance)."""
    return Node("capped_cone", (h, r1, r2))


def capsule(a, b, r):
    """All points within ``r`` of the segment from point ``a`` to point ``b`` (exact distance)."""
    return Node("capsule", (*a, *b, r))


def torus(R, r):
    """A ring in the xy plane about the z axis: ring radius ``R``, tube radius ``r`` (exact)."""
    return Node("torus", (R, r))


def ellipsoid(rx, ry, rz):
    """An ellipsoid with semi-axes (rx, ry, rz) about the origin (a bound of the distance, not the
    exact distance: iq's k0 (k0 - 1) / k1)."""
    return Node("ellipsoid", (rx, ry, rz))


def plane(normal=(0, 0, 1), d=0.0):
    """The half-space dot(p, n) <= d below a plane of normal ``normal`` (normalised here)."""
    n = np.asarray(normal, float)
    return Node("plane", (*(n / np.linalg.norm(n)), d))


def extrude(polygon: Sequence[Sequence[float]], h):
    """A closed polygon in the xy plane (n x 2 vertices) extruded along z over [-h, h]."""
    return Node("extrude", (h, *np.asarray(polygon, float).reshape(-1)))


def revolve(profile: Sequence[Sequence[float]]):
    """A closed profile in (radius, z) revolved about the z axis."""
    return Node("revolve", tuple(np.asarray(profile, float).reshape(-1)))


def _nary(kind, nodes, numbers=()):
    flat = []
    for n in nodes:   # flatten nested unions of the same kind so culling sees all leaves
        if isinstance(n, Node) and n.kind == kind and n.kind in ("union", "intersection") and n.mat is None:
            flat.extend(n.children)
        else:
            flat.append(n)
    return Node(kind, numbers, tuple(flat))


def union(*nodes):
    """Everything inside any of ``nodes`` (min of the distances; also ``a | b``). Large unions
    are wrapped in an exact bounding-volume hierarchy of cull records when flattened."""
    return _nary("union", nodes)


def intersection(*nodes):
    """What lies inside every one of ``nodes`` (max of the distances; also ``a & b``)."""
    return _nary("intersection", nodes)


def difference(base, *cutters):
    """``base`` with every cutter removed (max(base, -cutter); also ``a - b``).

        >>> difference(box(1, 1, 0.25), cylinder(0.3, 1))     # a plate with a hole
    """
    return Node("difference", (), (base, *cutters))


def xor(a, b):
    """What lies inside exactly one of ``a`` and ``b`` (also ``a ^ b``)."""
    return Node("xor", (), (a, b))


def smooth_union(*nodes, k):
    """A union whose seams are blended over a width ``k`` (quadratic smooth minimum)."""
    return Node("smooth_union", (k,), tuple(nodes))


def smooth_intersection(*nodes, k):
    """An intersection whose seams are blended over a width ``k``."""
    return Node("smooth_intersection", (k,), tuple(nodes))


def smooth_difference(base, *cutters, k):
    """A difference whose cut edges are blended over a width ``k``."""
    return Node("smooth_difference", (k,), (base, *cutters))


def with_params(scene: Node, values: dict[str, float]) -> Node:
    """A copy of the scene tree ``scene`` with the named ``Param``s set to ``values`` (a saved
    scene keeps the values an optimiser or a slider reached)."""
    def sub(o):
        if isinstance(o, dict):
            if "param" in o and "value" in o and o["param"] in values:
                return {**o, "value": float(values[o["param"]])}
            return {k: sub(v) for k, v in o.items()}
        if isinstance(o, list):
            return [sub(v) for v in o]
        return o
    return node_from_dict(sub(scene.to_dict()))
