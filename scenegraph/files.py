"""Tape and scene files: one msgpack container, validated on load, written atomically.

A file is one msgpack map::

    {"format": "taperay", "version": 1, "kind": "tape" | "scene", "crc32": int, "body": {...}}

``crc32`` is the CRC-32 of the msgpack encoding of ``body`` (as this module writes it: canonical
msgpack, binary as bin, strings as str). A reader takes it over the body's bytes as they are in
the file (no second encoding of megabytes of records), and over the canonical encoding only
where those differ. A tape body holds the record arrays as raw little-endian
bytes (``instrs``: ``INSTR_DTYPE``, ``params``: float32, ``materials``: ``MATERIAL_DTYPE``,
``instances``: ``INSTANCE_DTYPE``, ``bvh``: ``BVH_DTYPE``), the record layouts they were written
with (``layouts``: name -> [[field, format, shape], ...]), and the header: ``n_regs``, ``bounds``
(6 numbers: min then max corner), ``names`` (parameter name -> pool slots), ``instance_count``,
``material_names`` (each material id's name; optional) and ``opcodes`` (op name -> the number its records carry), so a file keeps its meaning when the
op table is renumbered: loading maps each record's number to today's through the op's name (a
file without ``opcodes`` was written with ``OPCODES_1``, the numbering of the first format), and
a file whose materials have the first record layout (``MATERIAL_DTYPE_1``: colour, roughness)
loads with the later fields at their defaults.
A scene body is ``Node.to_dict()``.

Loading trusts nothing: size limits are checked before reading, msgpack runs with limits derived
from the file size (no allocation bombs, nesting bounded by msgpack's own stack), every field is
type- and size-checked, and a tape goes through ``runtime.tape.validate``. Every defect raises
``FileFormatError`` (a ``TaperayError``) naming the file and what is wrong. Saving goes
through ``runtime.outputs.write_bytes``: a reader never sees a partial file and a failed write
leaves the old one. Conventional extensions: ``.tape`` and ``.scene``.
"""
from __future__ import annotations

import os
import threading
import zlib
from pathlib import Path

import msgpack
import numpy as np

from taperay.runtime.outputs import write_bytes
from taperay.runtime.tape import (BVH_DTYPE, INSTANCE_DTYPE, INSTR_DTYPE, MATERIAL_DTYPE,
                                  MAX_INSTRS, MAX_MATERIALS, MAX_PARAMS, VALIDATED, Op, Tape,
                                  TaperayError, validate)

from .nodes import node_from_dict

__all__ = ["FileFormatError", "FORMAT", "VERSION", "TAPE_EXT", "SCENE_EXT", "MAX_FILE_BYTES",
           "save_tape", "load_tape_file", "save_scene", "load_scene_file", "load_file"]

FORMAT = "taperay"
VERSION = 1
TAPE_EXT = ".tape"
SCENE_EXT = ".scene"
MAX_NAMES = 1 << 20              # named parameters in one tape
MAX_STR = 1 << 16                # bytes of one string (a name, a kind)
MAX_INSTANCES = 1 << 24          # records of an explicit instance list
# the record arrays of a tape: body key -> (Tape attribute dtype, most records a file may hold)
RECORDS = {"instrs": (INSTR_DTYPE, MAX_INSTRS), "params": (np.dtype("<f4"), MAX_PARAMS),
           "materials": (MATERIAL_DTYPE, MAX_MATERIALS), "instances": (INSTANCE_DTYPE, MAX_INSTANCES),
           "bvh": (BVH_DTYPE, 2 * MAX_INSTANCES)}
# the largest tape a file may hold, plus room for names and the container
MAX_FILE_BYTES = sum(dt.itemsize * n for dt, n in RECORDS.values()) + (64 << 20)

_TAPE_KEYS = {*RECORDS, "layouts", "n_regs", "bounds", "names", "instance_count"}
_OPTIONAL_TAPE_KEYS = {"opcodes", "material_names"}
# the op numbering of files written before they carried their own ``opcodes`` map (frozen: never
# edit it when the table changes; the table is free to renumber because files name their ops)
OPCODES_1 = dict(
    VAR_X=0, VAR_Y=1, VAR_Z=2, CONST=3, COPY=4, NEG=5, ABS=6, RECIP=7, SQRT=8, SQUARE=9, FLOOR=10,
    CEIL=11, ROUND=12, SIN=13, COS=14, TAN=15, ASIN=16, ACOS=17, ATAN=18, EXP=19, LN=20, NOT=21,
    ADD=22, SUB=23, MUL=24, DIV=25, MIN=26, MAX=27, ATAN2=28, COMPARE=29, MOD=30, AND=31, OR=32,
    MIX=33, RAND=34, INSTANCE_INDEX=35, SPHERE=40, BOX=41, ROUND_BOX=42, CYLINDER=43,
    CAPPED_CONE=44, CAPSULE=45, TORUS=46, ELLIPSOID=47, PLANE=48, EXTRUDE_POLY=49, REVOLVE_POLY=50,
    PUSH=60, POP=61, TRANSLATE=62, ROTATE=63, SCALE=64, MIRROR=65, ELONGATE=66, UNION=70,
    INTERSECT=71, DIFFERENCE=72, XOR=73, SMOOTH_UNION=74, SMOOTH_INTERSECT=75,
    SMOOTH_DIFFERENCE=76, OFFSET=77, SHELL=78, REPEAT_LINEAR=80, REPEAT_POLAR=81, REPEAT_GRID=82,
    REPEAT_END=83, INSTANCES=84, CULL_BOX=90, FIELD_RESULT=95)


class FileFormatError(TaperayError):
    """A tape or scene file is unreadable, truncated, corrupted, hostile or of another version."""

    def __init__(self, path, reason: str):
        self.path, self.reason = str(path), reason
        super().__init__(f"{path}: {reason}")


def layout_of(dt: np.dtype) -> list:
    """A record dtype as msgpack-friendly data: [[field, base format, shape], ...] ("" for a scalar)."""
    if dt.names is None:
        return [["", dt.str, []]]
    return [[name, dt.fields[name][0].base.str, list(dt.fields[name][0].shape)] for name in dt.names]


LAYOUTS = {key: layout_of(dt) for key, (dt, _) in RECORDS.items()}
# the material record of files written before it held the path tracer's fields (frozen: read by
# field name, the fields it lacks take MATERIAL_DEFAULTS)
MATERIAL_DTYPE_1 = np.dtype([("color", "<f4", (3,)), ("roughness", "<f4")])
_OLDER_LAYOUTS = {"materials": {str(layout_of(MATERIAL_DTYPE_1)): MATERIAL_DTYPE_1}}


# -- writing ------------------------------------------------------------------------------------
def _pack(kind: str, body: dict, path) -> bytes:
    try:
        body_bytes = msgpack.packb(body, use_bin_type=True)
        return msgpack.packb({"format": FORMAT, "version": VERSION, "kind": kind,
                              "crc32": zlib.crc32(body_bytes), "body": body}, use_bin_type=True)
    except ValueError as e:          # msgpack: "recursion limit exceeded"
        raise TaperayError(f"{path}: cannot encode the {kind}: nested too deeply ({e})") from None
    except (TypeError, OverflowError) as e:
        raise TaperayError(f"{path}: cannot encode the {kind}: {e}") from None


def save_tape(tape: Tape, path) -> None:
    """Write ``tape`` to ``path`` (conventionally ``*.tape``) atomically; it is validated first."""
    validate(tape)
    body = {key: np.ascontiguousarray(getattr(tape, key), dt).tobytes() for key, (dt, _) in RECORDS.items()}
    body.update(layouts=LAYOUTS, n_regs=int(tape.n_regs),
                bounds=[float(v) for v in np.asarray(tape.bounds, np.float32).ravel()],
                names={str(k): [int(i) for i in v] for k, v in tape.names.items()},
                instance_count=int(tape.instance_count), opcodes={op.name: int(op) for op in Op},
                material_names=list(tape.material_names))
    write_bytes(path, _pack("tape", body, path))


def save_scene(node, path) -> None:
    """Write the scene tree ``node`` (its ``to_dict()``) to ``path`` (``*.scene``) atomically."""
    try:
        body = node.to_dict()
    except RecursionError:
        raise TaperayError(f"{path}: cannot encode the scene: nested too deeply") from None
    write_bytes(path, _pack("scene", body, path))


# -- reading ------------------------------------------------------------------------------------
def _read_container(path, kinds: tuple[str, ...]) -> tuple[str, dict, "Checksum"]:
    """Read, decode and check the container of ``path``; return its kind, its body and the body's
    checksum check, running (``Checksum``: the caller verifies it)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_FILE_BYTES:
                raise FileFormatError(path, f"file of {size} bytes exceeds the limit of {MAX_FILE_BYTES}")
            # (a size + 1 buffer, not MAX_FILE_BYTES: allocating that took 3 ms a read; a file that grew
            # since fstat is refused by decoding; a pipe, whose size is 0, is read up to the limit)
            data = f.read(size + 1 if size else MAX_FILE_BYTES + 1)
    except OSError as e:
        raise FileFormatError(path, f"cannot read: {e.strerror or e}") from None
    if not data:
        raise FileFormatError(path, "the file is empty")
    root, body_bytes = _decode(path, data)
    if not isinstance(root, dict):
        raise FileFormatError(path, f"not a taperay file (the root is a {type(root).__name__}, not a map)")
    if root.get("format") != FORMAT:
        raise FileFormatError(path, f"not a taperay file (format {root.get('format')!r})")
    version = root.get("version")
    if version != VERSION or isinstance(version, bool):
        raise FileFormatError(path, f"file format version {version!r}; this taperay reads version {VERSION}")
    kind = root.get("kind")
    if kind not in kinds:
        raise FileFormatError(path, f"holds a {kind!r}, not a {' or '.join(map(repr, kinds))}")
    extra = set(root) - {"format", "version", "kind", "crc32", "body"}
    if extra:
        raise FileFormatError(path, f"unexpected container fields {sorted(map(str, extra))}")
    body = root.get("body")
    if not isinstance(body, dict):
        raise FileFormatError(path, f"the body is a {type(body).__name__}, not a map")
    crc = root.get("crc32")
    if not isinstance(crc, int) or isinstance(crc, bool):
        raise FileFormatError(path, "missing or malformed crc32")
    return kind, body, Checksum(path, crc, body, body_bytes)


class Checksum:
    """The CRC-32 check of a container's body. Over a large body (the 100,000-bolt bin's 9.4 MB:
    3.5 ms) it runs in a thread, since zlib releases the GIL, while the caller builds and
    validates what the body holds. ``verify`` waits for it and raises on a mismatch. A loader
    verifies before it returns, and before it reports any other defect of the body, so that a
    corrupted file is reported as such."""

    THREAD_BYTES = 1 << 20

    def __init__(self, path, stored: int, body, body_bytes):
        self.path, self.stored, self.body = path, stored, body
        self.computed = None
        self.thread = None
        if body_bytes is not None and len(body_bytes) >= self.THREAD_BYTES:
            self.thread = threading.Thread(target=self._compute, args=(body_bytes,), daemon=True)
            self.thread.start()
        elif body_bytes is not None:
            self._compute(body_bytes)

    def _compute(self, body_bytes):
        self.computed = zlib.crc32(body_bytes)

    def verify(self) -> None:
        if self.thread is not None:
            self.thread.join()
        actual = self.computed
        if actual != self.stored:     # (encoded otherwise than this module writes it: the canonical encoding's)
            try:
                actual = zlib.crc32(msgpack.packb(self.body, use_bin_type=True))
            except (TypeError, ValueError, OverflowError) as e:
                raise FileFormatError(self.path, f"the body cannot be re-encoded: {e}") from None
        if actual != self.stored:
            raise FileFormatError(self.path, f"checksum mismatch (stored {self.stored:#010x}, computed "
                                             f"{actual:#010x}): the file is corrupted")

    def verified(self, build):
        """``build()`` (what the body holds), returned once the checksum is verified; a defect
        ``build`` raises is reported only when the checksum holds."""
        try:
            out = build()
        except TaperayError:
            self.verify()
            raise
        self.verify()
        return out


def _decode(path, data: bytes):
    """The container's root object and the bytes its "body" value was encoded in (None when the
    root is not a map), through msgpack with limits derived from the file size. The checksum is
    computed over those bytes: a file as this module writes it needs no encoding again."""
    n = len(data)
    limits = dict(raw=False, strict_map_key=True, use_list=True, max_str_len=min(n, MAX_STR),
                  max_bin_len=n, max_array_len=n, max_map_len=n, max_ext_len=0)
    try:
        unpacker = msgpack.Unpacker(max_buffer_size=n, **limits)
        unpacker.feed(data)
        try:
            n_keys = unpacker.read_map_header()
        except Exception:     # not a map: decoded whole below, for the error that names it
            return msgpack.unpackb(data, **limits), None
        root, body_bytes = {}, None
        for _ in range(n_keys):
            key = unpacker.unpack()
            start = unpacker.tell()
            root[key] = unpacker.unpack()
            if key == "body":
                body_bytes = memoryview(data)[start:unpacker.tell()]
        if unpacker.tell() != n:
            raise ValueError(f"{n - unpacker.tell()} bytes of extra data after the container")
        return root, body_bytes
    except Exception as e:   # msgpack reports bad data with ValueError subclasses and others
        reason = str(e) or type(e).__name__
        raise FileFormatError(path, f"not a valid taperay file (msgpack: {reason})") from None


def _records(path, body, key, dtype: np.dtype, limit: int) -> np.ndarray:
    raw = body[key]
    if not isinstance(raw, bytes):
        raise FileFormatError(path, f"{key!r} must be binary, got {type(raw).__name__}")
    if len(raw) % dtype.itemsize:
        raise FileFormatError(path, f"{key!r} holds {len(raw)} bytes, not a multiple of the "
                                    f"{dtype.itemsize}-byte record")
    if len(raw) // dtype.itemsize > limit:
        raise FileFormatError(path, f"{key!r} holds {len(raw) // dtype.itemsize} records (limit {limit})")
    return np.frombuffer(raw, dtype)        # (read-only, as every validated tape's arrays: freeze)


def _int(path, body, key, lo: int, hi: int) -> int:
    v = body[key]
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise FileFormatError(path, f"{key!r} must be an integer in {lo}..{hi}, got {v!r}")
    return v


def load_file(path):
    """Read a ``.tape`` or ``.scene`` file (whichever it holds): a validated ``Tape`` or a scene node."""
    kind, body, checksum = _read_container(path, ("tape", "scene"))
    return checksum.verified(lambda: _tape_from_body(path, body) if kind == "tape" else _scene_from_body(path, body))


def load_tape_file(path) -> Tape:
    """Read a ``.tape`` file written by ``save_tape``; the tape returned is validated."""
    _, body, checksum = _read_container(path, ("tape",))
    return checksum.verified(lambda: _tape_from_body(path, body))


def load_scene_file(path):
    """Read a ``.scene`` file written by ``save_scene``; returns the scene's root node."""
    _, body, checksum = _read_container(path, ("scene",))
    return checksum.verified(lambda: _scene_from_body(path, body))


def _tape_from_body(path, body: dict) -> Tape:
    missing, extra = _TAPE_KEYS - set(body), set(body) - _TAPE_KEYS - _OPTIONAL_TAPE_KEYS
    if missing or extra:
        raise FileFormatError(path, f"tape body fields: missing {sorted(missing)}, unexpected "
                                    f"{sorted(map(str, extra))}")
    theirs = body["layouts"] if isinstance(body["layouts"], dict) else {}
    dtypes = {key: dt if theirs.get(key) == LAYOUTS[key] else _OLDER_LAYOUTS.get(key, {}).get(str(theirs.get(key)))
              for key, (dt, _) in RECORDS.items()}
    if set(theirs) != set(LAYOUTS) or None in dtypes.values():
        differ = sorted(k for k in LAYOUTS if dtypes[k] is None)
        raise FileFormatError(path, f"record layouts differ from this taperay's ({', '.join(differ) or 'extra entries'}): "
                                    f"file {body['layouts']!r:.200}, expected {LAYOUTS!r:.200}")
    arrays = {key: _records(path, body, key, dtypes[key], limit) for key, (_, limit) in RECORDS.items()}
    arrays["instrs"] = _renumbered(path, arrays["instrs"], body.get("opcodes", OPCODES_1))
    bounds = body["bounds"]
    if (not isinstance(bounds, list) or len(bounds) != 6
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in bounds)):
        raise FileFormatError(path, f"'bounds' must be 6 numbers, got {bounds!r:.80}")
    names = body["names"]
    if not isinstance(names, dict) or len(names) > MAX_NAMES:
        raise FileFormatError(path, "'names' must be a map of at most 2^20 entries")
    for k, v in names.items():
        if not isinstance(k, str) or not isinstance(v, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in v):
            raise FileFormatError(path, f"named parameter {k!r}: slots {v!r:.80} are not a list of integers")
    material_names = body.get("material_names", [])
    if not isinstance(material_names, list) or not all(isinstance(n, str) and len(n) <= MAX_STR for n in material_names):
        raise FileFormatError(path, f"'material_names' must be a list of strings, got {material_names!r:.80}")
    tape = Tape(**arrays, n_regs=_int(path, body, "n_regs", 1, 1 << 16), bounds=bounds, names=dict(names),
                material_names=tuple(material_names),
                instance_count=_int(path, body, "instance_count", 0, (1 << 63) - 1),
                source=str(path))
    VALIDATED.check(tape)      # (the walker that draws it then finds it validated)
    return tape


def _renumbered(path, instrs: np.ndarray, opcodes) -> np.ndarray:
    """The records with each op number the file wrote (``opcodes``: its name -> number map)
    replaced by today's number of the op of that name."""
    if not isinstance(opcodes, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in opcodes.items()):
        raise FileFormatError(path, f"'opcodes' must map op names to integers, got {opcodes!r:.80}")
    unknown = sorted(k for k in opcodes if k not in Op.__members__)
    if unknown:
        raise FileFormatError(path, f"the file's ops {unknown[:5]} are unknown to this taperay")
    table = np.full(max(opcodes.values(), default=0) + 1, 0xFFFFFFFF, np.uint32)
    for name, number in opcodes.items():
        if number < 0 or table[number] != 0xFFFFFFFF:
            raise FileFormatError(path, f"'opcodes': number {number} of {name} is negative or taken twice")
        table[number] = Op[name]
    ops = instrs["op"]
    mapped = table[np.minimum(ops, len(table) - 1)]
    bad = np.flatnonzero((ops >= len(table)) | (mapped == 0xFFFFFFFF))
    if len(bad):
        raise FileFormatError(path, f"record {int(bad[0])}: op number {int(ops[bad[0]])} is not in the file's 'opcodes'")
    out = instrs.copy()
    out["op"] = mapped
    return out


def _scene_from_body(path, body: dict):
    try:
        return node_from_dict(body)
    except TaperayError as e:
        raise FileFormatError(path, f"bad scene: {e}") from None
    except RecursionError:
        raise FileFormatError(path, "bad scene: the node tree is nested too deeply") from None
