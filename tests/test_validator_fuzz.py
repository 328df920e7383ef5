"""Fuzzing the gatekeepers: random and mutated tapes through ``runtime.tape.validate``, damaged and
hostile files through the file loader. The only acceptable failure is a ``TaperayError``; the
deadlines catch hangs."""
from __future__ import annotations

import zlib
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from taperay.runtime.tape import (BVH_DTYPE, INSTANCE_DTYPE, MATERIAL_DTYPE, Op, Tape, TapeError,
                                  TaperayError, instr_array, material_array, validate)
from taperay.scenegraph import box, flatten, sphere, torus
from taperay.scenegraph.files import load_file, save_scene, save_tape
from taperay.scenegraph.vm import load_vm

DATA = Path(__file__).parent / "data"
FIELDS = ("op", "dst", "a", "b", "c", "param", "aux", "jump")
FUZZ = settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.too_slow,
                                                                          HealthCheck.function_scoped_fixture])

U32 = st.integers(0, 2**32 - 1)
SMALL = st.integers(0, 24)
FIELD_VALUE = st.one_of(SMALL, SMALL, SMALL, U32, st.sampled_from([2**31 - 1, 2**31, 2**32 - 1]))
OPCODE = st.one_of(st.sampled_from([int(o) for o in Op]), st.integers(0, 127), U32)
FLOAT = st.floats(width=32, allow_nan=True, allow_infinity=True)


def _base_tapes() -> list[Tape]:
    """Valid tapes that use every structural feature: culls, patterns, instances, points ops."""
    parts = (sphere(0.5) | box(0.3).translate(1, 0, 0) | torus(0.4, 0.1).translate(0, 1, 0)
             | sphere(0.2).translate(0, 0, 1) | box(0.2).translate(1, 1, 0))   # (five leaves: a cull)
    scenes = [
        parts,
        sphere(0.3).linear_pattern((1, 0, 0), 5) | box(0.2).translate(1, 0, 0).polar_pattern(6).translate(0, 0, 2),
        box(0.1).grid_pattern((0.5, 0.5, 0.5), (3, 2, 2)).smooth_union(sphere(0.4), 0.1),
        sphere(0.2).instances(np.random.default_rng(0).uniform(-2, 2, (20, 3))) - box(0.5),
        parts.linear_pattern((0, 0, 3), 2).rotate((0, 0, 1), 30),
    ]
    return [flatten(s, source="fuzz") for s in scenes] + [load_vm(DATA / "hi.vm")]


BASES = _base_tapes()


def _records(dtype, max_records=4):
    """Arbitrary bytes viewed as records: NaNs, infinities, huge counts, negative indices."""
    return st.integers(0, max_records).flatmap(
        lambda k: st.binary(min_size=k * dtype.itemsize, max_size=k * dtype.itemsize)).map(
        lambda raw: np.frombuffer(raw, dtype).copy())


def _mostly(good, bad):
    """Usually a well-formed value (so fuzzing reaches the per-record checks), sometimes anything."""
    return st.one_of(good, good, good, good, bad)


FINITE = st.floats(-100, 100, width=32)
GOOD_MATERIALS = st.integers(1, 3).map(lambda k: material_array([(0.5, 0.5, 0.5)] * k, 0.5))


@st.composite
def random_tapes(draw) -> Tape:
    rows = draw(st.lists(st.tuples(OPCODE, *[FIELD_VALUE] * 7), min_size=1, max_size=24))
    instrs = instr_array(len(rows))
    instrs.view(np.uint32).reshape(-1, 8)[:] = np.array(rows, np.uint64).astype(np.uint32)
    params = np.array(draw(st.lists(_mostly(FINITE, FLOAT), max_size=40)), np.float32)
    names = draw(_mostly(st.just({}), st.dictionaries(st.text(max_size=4), st.lists(
        st.integers(-2, 40), max_size=3), max_size=3)))
    return Tape(instrs=instrs, params=params, materials=draw(_mostly(GOOD_MATERIALS, _records(MATERIAL_DTYPE))),
                n_regs=draw(_mostly(st.integers(1, 24), st.integers(-1, 300))),
                bounds=np.array(draw(st.lists(_mostly(FINITE, FLOAT), min_size=6, max_size=6)), np.float32),
                names=names, instances=draw(_records(INSTANCE_DTYPE)), bvh=draw(_records(BVH_DTYPE)))


def _validate_or_tape_error(tape: Tape):
    try:
        validate(tape)
    except TapeError as e:
        assert e.record is None or 0 <= e.record < len(tape.instrs), e
        return False
    return True


@pytest.mark.slow
@FUZZ
@given(random_tapes())
def test_random_tapes_only_raise_tape_errors(tape):
    _validate_or_tape_error(tape)


@st.composite
def mutants(draw) -> Tape:
    """A valid tape with a few instruction fields and parameters overwritten."""
    t = BASES[draw(st.integers(0, len(BASES) - 1))]
    tape = Tape(instrs=t.instrs.copy(), params=t.params.copy(), materials=t.materials, n_regs=t.n_regs,
                bounds=t.bounds, names=t.names, instances=t.instances, bvh=t.bvh, source="mutant")
    for where, field, value in draw(st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(FIELDS),
                                                       FIELD_VALUE), min_size=1, max_size=4)):
        tape.instrs[where % len(tape.instrs)][field] = value if field != "op" else value % 128
    for where, value in draw(st.lists(st.tuples(st.integers(0, 10**6), FLOAT), max_size=2)):
        if len(tape.params):
            tape.params[where % len(tape.params)] = value
    return tape


@pytest.mark.slow
@FUZZ
@given(mutants())
def test_mutated_tapes_only_raise_tape_errors(tape):
    _validate_or_tape_error(tape)


@pytest.fixture(scope="module")
def cpu_walker():
    """The twin, compiled before the deadlines start (its first call may JIT-compile for minutes)."""
    walker = pytest.importorskip("taperay.runtime.cpu").CpuWalker()
    walker.evaluate(BASES[0], np.zeros((1, 3), np.float32))
    return walker


@pytest.mark.slow
@settings(FUZZ, max_examples=200)
@given(mutants())
def test_mutants_that_pass_validation_run_safely_on_the_cpu_walker(cpu_walker, tape):
    """What the validator lets through must run: no exception, no crash, materials in range."""
    if not _validate_or_tape_error(tape):
        return
    pts = np.random.default_rng(0).uniform(-3, 3, (32, 3)).astype(np.float32)
    dist, mat = cpu_walker.evaluate(tape, pts)
    assert dist.shape == (32,) and mat.shape == (32,)
    assert np.all(mat < len(tape.materials))


def test_base_tapes_are_valid():
    """The mutation test starts from valid tapes (else it would test nothing but rejection)."""
    for t in BASES:
        validate(t)
    ops = {Op(int(o)) for t in BASES for o in t.instrs["op"]}
    assert {Op.CULL_BOX, Op.REPEAT_LINEAR, Op.REPEAT_POLAR, Op.REPEAT_GRID, Op.INSTANCES,
            Op.REPEAT_END, Op.PUSH, Op.POP} <= ops


# -- files --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    out = {}
    for i, t in enumerate(BASES[:2]):
        save_tape(t, d / f"t{i}.tape")
        out[f"t{i}"] = (d / f"t{i}.tape").read_bytes()
    save_scene(sphere(1.0) | box(0.5).translate(1, 0, 0), d / "s.scene")
    out["s"] = (d / "s.scene").read_bytes()
    return out


def _load_expecting_taperay_error(tmp_path, data: bytes):
    p = tmp_path / "fuzz.bin"
    p.write_bytes(data)
    try:
        load_file(p)
    except TaperayError as e:
        assert str(p) in str(e)


BYTE_EDIT = st.tuples(st.sampled_from(["flip", "insert", "delete", "truncate", "set"]),
                      st.integers(0, 10**6), st.integers(0, 255))


@pytest.mark.slow
@FUZZ
@given(st.sampled_from(["t0", "t1", "s"]), st.lists(BYTE_EDIT, min_size=1, max_size=4))
def test_damaged_files_only_raise_taperay_errors(tmp_path, saved, which, edits):
    data = bytearray(saved[which])
    for kind, where, value in edits:
        i = where % max(len(data), 1)
        if kind == "flip" and data:
            data[i] ^= 1 << (value % 8)
        elif kind == "insert":
            data.insert(i, value)
        elif kind == "delete" and data:
            del data[i]
        elif kind == "truncate":
            del data[i:]
        elif kind == "set" and data:
            data[i] = value
    _load_expecting_taperay_error(tmp_path, bytes(data))


MSGPACK_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(), st.text(max_size=8),
              st.binary(max_size=40), st.sampled_from(["tape", "scene", "sphere", "union", "kind"])),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.one_of(st.text(max_size=8),
                                                      st.sampled_from(["kind", "numbers", "children",
                                                                       "material", "instrs", "names"])),
                                            inner, max_size=4)),
    max_leaves=30)


def _container(kind: str, body) -> bytes:
    return msgpack.packb({"format": "taperay", "version": 1, "kind": kind,
                          "crc32": zlib.crc32(msgpack.packb(body, use_bin_type=True)), "body": body},
                         use_bin_type=True)


@pytest.mark.slow
@FUZZ
@given(st.sampled_from(["tape", "scene"]), MSGPACK_VALUES)
def test_random_bodies_with_valid_checksums_only_raise_taperay_errors(tmp_path, kind, body):
    _load_expecting_taperay_error(tmp_path, _container(kind, body))


@pytest.mark.slow
@FUZZ
@given(st.sampled_from(["t0", "t1"]), st.sampled_from(
    ["instrs", "params", "materials", "instances", "bvh", "layouts", "n_regs", "bounds", "names",
     "instance_count"]), MSGPACK_VALUES)
def test_tape_bodies_with_one_field_replaced_only_raise_taperay_errors(tmp_path, saved, which, key, value):
    body = msgpack.unpackb(saved[which], raw=False)["body"]
    body[key] = value
    _load_expecting_taperay_error(tmp_path, _container("tape", body))


@pytest.mark.slow
@FUZZ
@given(MSGPACK_VALUES, st.sampled_from(["kind", "numbers", "children", "material"]))
def test_scene_bodies_with_one_field_replaced_only_raise_taperay_errors(tmp_path, saved, value, key):
    body = msgpack.unpackb(saved["s"], raw=False)["body"]
    body[key] = value
    _load_expecting_taperay_error(tmp_path, _container("scene", body))


@pytest.mark.parametrize("where", ["bounds", "params", "materials"])
def test_numbers_past_float32_become_inf_without_a_numpy_warning(where):
    """A tape built from float64 numbers too large for float32 (a damaged file's, a script's) holds
    inf there, and building it warns of nothing; validate refuses non-finite bounds and materials
    by name (a parameter may be infinite: a .vm constant can be)."""
    import warnings
    big = 1e300
    instrs = instr_array(1)
    instrs["op"] = Op.SPHERE
    params = np.array([big if where == "params" else 0.5])
    mats = np.array([((big if where == "materials" else 0.5, 0.5, 0.5), 0.5)],
                    [("color", "<f8", (3,)), ("roughness", "<f8")])
    bounds = np.array([[-big if where == "bounds" else -1.0] * 3, [1.0] * 3])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tape = Tape(instrs, params, mats, 1, bounds)
    if where == "params":
        assert np.isinf(tape.params[0])
        validate(tape)
    else:
        with pytest.raises(TapeError, match="(not |non-)finite"):
            validate(tape)
