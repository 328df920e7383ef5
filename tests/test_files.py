"""Tape and scene files: round trips, every class of damaged or hostile file, atomic saving."""
from __future__ import annotations

import struct
import zlib
from pathlib import Path

import msgpack
import numpy as np
import pytest

from taperay.runtime.tape import MATERIAL_DTYPE, Op, TapeError, TaperayError
from taperay.scenegraph import Material, Param, box, flatten, sphere, torus
from taperay.scenegraph import files
from taperay.scenegraph.files import (FileFormatError, load_file, load_scene_file, load_tape_file,
                                      save_scene, save_tape)
from taperay.scenegraph.vm import load_vm

DATA = Path(__file__).parent / "data"


def _scene():
    red = Material("red", (0.9, 0.1, 0.1), 0.3)
    return (sphere(Param("radius", 1.0)).material(red)
            | box(0.5).translate(1.5, 0, 0)
            | torus(1.0, 0.25).rotate((1, 0, 0), 90).translate(0, 2, 0))


def _pattern_scene():
    placements = np.random.default_rng(0).uniform(-2, 2, (40, 3))
    return (sphere(0.2).instances(placements) - box(0.5)
            | box(0.1).grid_pattern((0.5, 0.5, 0.5), (3, 2, 2)).translate(0, 0, 3)
            | sphere(0.3).linear_pattern((1, 0, 0), 5).translate(0, -3, 0))


def _tapes():
    return {"flattened": flatten(_scene(), source="scene"), "patterns": flatten(_pattern_scene()),
            "sphere.vm": load_vm(DATA / "sphere.vm"), "prospero.vm": load_vm(DATA / "prospero.vm")}


def _assert_same_tape(a, b):
    assert a.instrs.dtype == b.instrs.dtype
    np.testing.assert_array_equal(a.instrs.view(np.uint32), b.instrs.view(np.uint32))
    assert a.params.tobytes() == b.params.tobytes()
    assert a.materials.tobytes() == b.materials.tobytes()
    assert a.instances.tobytes() == b.instances.tobytes() and a.bvh.tobytes() == b.bvh.tobytes()
    assert a.n_regs == b.n_regs and a.instance_count == b.instance_count and a.names == b.names
    np.testing.assert_array_equal(a.bounds, b.bounds)


def _body(tape_path) -> dict:
    root = msgpack.unpackb(Path(tape_path).read_bytes(), raw=False)
    return root["body"]


def _container(body, *, crc=None, **header) -> bytes:
    """A container around ``body`` with a correct checksum unless ``crc`` is given."""
    root = {"format": "taperay", "version": 1, "kind": "tape",
            "crc32": zlib.crc32(msgpack.packb(body, use_bin_type=True)) if crc is None else crc,
            "body": body}
    root.update(header)
    return msgpack.packb(root, use_bin_type=True)


def _expect_error(path, *fragments, loader=load_tape_file, cls=FileFormatError):
    with pytest.raises(cls) as info:
        loader(path)
    msg = str(info.value)
    assert str(path) in msg, msg
    for f in fragments:
        assert f in msg, msg
    return msg


@pytest.fixture
def good_tape_file(tmp_path):
    p = tmp_path / "good.tape"
    save_tape(load_vm(DATA / "sphere.vm"), p)
    return p


# -- round trips --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["flattened", "patterns", "sphere.vm", "prospero.vm"])
def test_tape_round_trip(tmp_path, name):
    tape = _tapes()[name]
    if name == "patterns":
        assert len(tape.instances) == 40 and len(tape.bvh) > 0
    p = tmp_path / f"t{files.TAPE_EXT}"
    save_tape(tape, p)
    back = load_tape_file(p)
    _assert_same_tape(tape, back)
    assert back.source == str(p)
    _assert_same_tape(tape, load_file(p))


def test_material_names_survive_a_tape_file(tmp_path):
    tape = flatten(_scene())
    assert tape.material_names == ("default", "red")       # (id 0: the scene's default material)
    save_tape(tape, tmp_path / "named.tape")
    assert load_tape_file(tmp_path / "named.tape").material_names == ("default", "red")


def test_tape_round_trip_keeps_names_and_materials(tmp_path):
    tape = flatten(_scene())
    assert "radius" in tape.names and len(tape.materials) >= 2
    p = tmp_path / "named.tape"
    save_tape(tape, p)
    back = load_tape_file(p)
    assert back.names == tape.names
    back.set_param("radius", 2.0)
    assert back.params[back.names["radius"]] == 2.0


@pytest.mark.parametrize("make", [_scene, _pattern_scene])
def test_scene_round_trip(tmp_path, make):
    scene = make()
    p = tmp_path / f"s{files.SCENE_EXT}"
    save_scene(scene, p)
    back = load_scene_file(p)
    assert back.to_dict() == scene.to_dict()
    assert load_file(p).to_dict() == scene.to_dict()
    _assert_same_tape(flatten(back), flatten(scene))


def test_path_tracer_materials_round_trip(tmp_path):
    """A scene and a tape keep every material field (metal, glass, emitter); a scene file's
    material without the fields after roughness (written before them) loads with the defaults,
    and a tape file whose materials have the first record layout (colour, roughness) too."""
    glass = Material("glass", (1.0, 0.9, 0.9), 0.0, transmission=1.0, ior=1.45)
    lamp = Material("lamp", (0.0, 0.0, 0.0), emission=(4.0, 3.0, 2.0), specular=0.0)
    gold = Material("gold", (0.9, 0.7, 0.3), 0.25, metallic=1.0)
    scene = sphere(1).material(glass) | box(0.5).translate(2, 0, 0).material(lamp) | torus(1, 0.2).material(gold)
    save_scene(scene, tmp_path / "m.scene")
    back = flatten(load_scene_file(tmp_path / "m.scene"))
    assert back.materials.tobytes() == flatten(scene).materials.tobytes()
    save_tape(back, tmp_path / "m.tape")
    assert load_tape_file(tmp_path / "m.tape").materials.tobytes() == back.materials.tobytes()
    d = sphere(1).material(Material("old", (0.1, 0.2, 0.3), 0.4)).to_dict()
    d["material"] = {k: d["material"][k] for k in ("name", "color", "roughness")}
    from taperay.scenegraph.nodes import node_from_dict
    assert node_from_dict(d).mat == Material("old", (0.1, 0.2, 0.3), 0.4)
    body = _body(tmp_path / "m.tape")
    body["layouts"]["materials"] = files.layout_of(files.MATERIAL_DTYPE_1)
    body["materials"] = np.array([((0.1, 0.2, 0.3), 0.4)] * len(back.materials), files.MATERIAL_DTYPE_1).tobytes()
    (tmp_path / "old.tape").write_bytes(_container(body))
    old = load_tape_file(tmp_path / "old.tape").materials
    np.testing.assert_allclose(old["color"], [(0.1, 0.2, 0.3)] * len(old), rtol=1e-6)
    assert old["ior"].tolist() == [1.5] * len(old) and old["transmission"].tolist() == [0.0] * len(old)


def test_kind_mismatch_is_reported(tmp_path, good_tape_file):
    scene_path = tmp_path / "s.scene"
    save_scene(_scene(), scene_path)
    _expect_error(scene_path, "'scene'", "'tape'")
    _expect_error(good_tape_file, "'tape'", "'scene'", loader=load_scene_file)


# -- damaged files ------------------------------------------------------------------------------
def test_missing_file_and_directory(tmp_path):
    _expect_error(tmp_path / "nope.tape", "cannot read")
    _expect_error(tmp_path, "cannot read")


def test_empty_file(tmp_path):
    p = tmp_path / "empty.tape"
    p.write_bytes(b"")
    _expect_error(p, "empty")


@pytest.mark.slow
def test_every_truncation_is_rejected(tmp_path, good_tape_file):
    data = good_tape_file.read_bytes()
    p = tmp_path / "cut.tape"
    for n in range(1, len(data)):
        p.write_bytes(data[:n])
        _expect_error(p)


@pytest.mark.slow
def test_every_single_byte_corruption_is_rejected(tmp_path, good_tape_file):
    data = good_tape_file.read_bytes()
    p = tmp_path / "flip.tape"
    for i in range(len(data)):
        for flip in (0x01, 0x80):
            bad = bytearray(data)
            bad[i] ^= flip
            p.write_bytes(bytes(bad))
            with pytest.raises(TaperayError) as info:
                load_tape_file(p)
            assert str(p) in str(info.value)


def test_checksum_mismatch_is_named(tmp_path, good_tape_file):
    body = _body(good_tape_file)
    body["params"] = np.float32([2.0]).tobytes()            # a different sphere radius
    p = tmp_path / "crc.tape"
    p.write_bytes(_container(body, crc=zlib.crc32(b"something else")))
    _expect_error(p, "checksum mismatch")


def test_a_large_corrupted_file_is_reported_as_corrupted(tmp_path):
    """A body past Checksum.THREAD_BYTES is checked in a thread while the tape is built and
    validated; a flipped byte is still reported as a checksum mismatch, also where it breaks
    the tape (a BVH node skipping backwards) before the checksum is known."""
    rng = np.random.default_rng(3)
    n = 40_000
    p = tmp_path / "big.tape"
    save_tape(flatten(sphere(0.1).instances(rng.uniform(-5, 5, (n, 3)))), p)
    data = p.read_bytes()
    assert len(data) > files.Checksum.THREAD_BYTES
    assert len(load_tape_file(p).instances) == n
    tape = load_tape_file(p)
    skip_at = data.find(tape.bvh[10:11].tobytes()) + 12      # node 10's skip, in the file
    for where, flip in ((len(data) // 2, 0x01), (skip_at + 3, 0x80)):
        bad = bytearray(data)
        bad[where] ^= flip
        q = tmp_path / f"bad{where}.tape"
        q.write_bytes(bytes(bad))
        _expect_error(q, "checksum mismatch")
    body = _body(p)
    bvh = bytearray(body["bvh"])
    bvh[10 * 32 + 15] ^= 0x80                                # the same defect under a correct checksum
    q.write_bytes(_container(body | {"bvh": bytes(bvh)}))
    _expect_error(q, "skips to", cls=TapeError)


def test_a_body_encoded_otherwise_is_checked_by_its_canonical_encoding(tmp_path, good_tape_file):
    """The checksum is read over the body's bytes as they are in the file (no encoding again);
    a body encoded otherwise than this module writes it (here n_regs as a uint8, not a fixint)
    is checked by its canonical encoding, as the format says, or by its bytes as they are."""
    body = _body(good_tape_file)
    canonical = msgpack.packb(body, use_bin_type=True)
    field = b"\xa6n_regs" + msgpack.packb(body["n_regs"])
    assert canonical.count(field) == 1 and body["n_regs"] < 128
    wide = canonical.replace(field, b"\xa6n_regs\xcc" + bytes([body["n_regs"]]))
    root = _container(body).replace(canonical, wide)
    assert root != _container(body)
    p = tmp_path / "wide.tape"
    p.write_bytes(root)
    _assert_same_tape(load_tape_file(p), load_tape_file(good_tape_file))
    p.write_bytes(root.replace(msgpack.packb(zlib.crc32(canonical)), msgpack.packb(zlib.crc32(wide))))
    _assert_same_tape(load_tape_file(p), load_tape_file(good_tape_file))
    p.write_bytes(root.replace(msgpack.packb(zlib.crc32(canonical)), msgpack.packb(zlib.crc32(wide) ^ 1)))
    _expect_error(p, "checksum mismatch")


def test_trailing_garbage(tmp_path, good_tape_file):
    p = tmp_path / "extra.tape"
    p.write_bytes(good_tape_file.read_bytes() + b"\x00")
    _expect_error(p, "extra data")


@pytest.mark.parametrize("root, fragment", [
    ([1, 2, 3], "root is a list"),
    (7, "root is a int"),
    ("taperay", "root is a str"),
    ({"format": "other"}, "format 'other'"),
    ({"format": "taperay", "version": 2, "kind": "tape", "crc32": 0, "body": {}}, "version 2"),
    ({"format": "taperay", "version": True, "kind": "tape", "crc32": 0, "body": {}}, "version True"),
    ({"format": "taperay", "version": 1, "kind": "tape", "crc32": 0, "body": []}, "body is a list"),
    ({"format": "taperay", "version": 1, "kind": "tape", "crc32": "x", "body": {}}, "crc32"),
    ({"format": "taperay", "version": 1, "kind": "tape", "crc32": 0, "body": {}, "more": 1}, "unexpected"),
    ({"format": "taperay", "version": 1, "kind": "picture", "crc32": 0, "body": {}}, "'picture'"),
])
def test_bad_containers(tmp_path, root, fragment):
    p = tmp_path / "bad.tape"
    p.write_bytes(msgpack.packb(root, use_bin_type=True))
    _expect_error(p, fragment)


def test_wrong_version_names_both_versions(tmp_path, good_tape_file):
    p = tmp_path / "v2.tape"
    p.write_bytes(_container(_body(good_tape_file), version=2))
    msg = _expect_error(p)
    assert "version 2" in msg and f"version {files.VERSION}" in msg


def _mutated(good_tape_file, **changes):
    body = _body(good_tape_file)
    for k, v in changes.items():
        if v is KeyError:
            del body[k]
        else:
            body[k] = v
    return body


@pytest.mark.parametrize("changes, fragment", [
    ({"instrs": KeyError}, "missing ['instrs']"),
    ({"extra": 1}, "unexpected ['extra']"),
    ({"instrs": [1, 2, 3]}, "'instrs' must be binary"),
    ({"instrs": b"\x00" * 33}, "not a multiple of the 32-byte record"),
    ({"params": b"\x00" * 3}, "not a multiple of the 4-byte record"),
    ({"materials": b"\x00" * 17}, f"not a multiple of the {MATERIAL_DTYPE.itemsize}-byte record"),
    ({"layouts": {**files.LAYOUTS, "instrs": [["op", "<u4", []]]}}, "layouts differ from this taperay's (instrs)"),
    ({"layouts": {**files.LAYOUTS, "materials": [["color", "<f8", [3]], ["roughness", "<f4", []]]}},
     "(materials)"),
    ({"layouts": "v1"}, "layouts differ"),
    ({"instances": b"\x00" * 31}, "not a multiple of the 32-byte record"),
    ({"n_regs": "4"}, "'n_regs' must be an integer"),
    ({"n_regs": True}, "'n_regs' must be an integer"),
    ({"n_regs": 1 << 40}, "'n_regs' must be an integer"),
    ({"instance_count": -1}, "'instance_count' must be an integer"),
    ({"bounds": [0, 0, 0]}, "'bounds' must be 6 numbers"),
    ({"bounds": ["a"] * 6}, "'bounds' must be 6 numbers"),
    ({"names": [1]}, "'names' must be a map"),
    ({"names": {"r": "zero"}}, "not a list of integers"),
    ({"names": {"r": [0, "1"]}}, "not a list of integers"),
])
def test_bad_tape_bodies(tmp_path, good_tape_file, changes, fragment):
    p = tmp_path / "body.tape"
    p.write_bytes(_container(_mutated(good_tape_file, **changes)))
    _expect_error(p, fragment)


@pytest.mark.parametrize("changes, fragment", [
    ({"n_regs": 1000}, "registers"),
    ({"names": {"r": [99]}}, "points outside the pool"),
    ({"names": {"r": []}}, "points outside the pool"),
    ({"bounds": [0, 0, 0, 1, 1, float("inf")]}, "bounds are not finite"),
    ({"params": np.float32([np.nan]).tobytes()}, "NaN"),
    ({"materials": b""}, "0 materials"),
])
def test_well_formed_but_invalid_tapes_fail_validation(tmp_path, good_tape_file, changes, fragment):
    p = tmp_path / "invalid.tape"
    p.write_bytes(_container(_mutated(good_tape_file, **changes)))
    with pytest.raises(TapeError) as info:
        load_tape_file(p)
    assert str(p) in str(info.value) and fragment in str(info.value)


def test_validator_failure_names_the_record(tmp_path, good_tape_file):
    instrs = load_tape_file(good_tape_file).instrs.copy()
    instrs[0]["op"] = Op.ADD                 # the first record reads registers nobody wrote
    body = _mutated(good_tape_file, instrs=instrs.tobytes())
    p = tmp_path / "rec.tape"
    p.write_bytes(_container(body))
    with pytest.raises(TapeError) as info:
        load_tape_file(p)
    assert info.value.record == 0 and info.value.source == str(p)
    assert "before it is written" in str(info.value)


def test_a_loaded_tape_is_read_only_and_edited_through_set_param(tmp_path):
    """A validated tape's arrays are read-only (runtime.tape.freeze), so its validation record
    and its content key cannot go stale; set_param writes a copy, and the key follows the edit."""
    from taperay.runtime.tape import content_key
    p = tmp_path / "param.tape"
    save_tape(flatten(sphere(Param("r", 0.5))), p)
    tape = load_tape_file(p)
    key = content_key(tape)
    with pytest.raises(ValueError, match="read-only"):
        tape.params[0] = 1.0
    before = tape.params
    tape.set_param("r", 0.75)
    assert tape.params is not before and np.array_equal(before, load_tape_file(p).params)
    assert np.all(tape.params[tape.names["r"]] == np.float32(0.75))
    assert content_key(tape) != key and content_key(load_tape_file(p)) == key


# -- hostile files ------------------------------------------------------------------------------
@pytest.mark.parametrize("data", [
    b"\xc6\xff\xff\xff\xff" + b"x" * 16,                     # bin32 declaring 4 GiB
    b"\xdd\xff\xff\xff\xff" + b"\xc0" * 16,                  # array32 declaring 2^32-1 items
    b"\xdf\xff\xff\xff\xff" + b"\xa1k\xc0" * 4,              # map32 declaring 2^32-1 pairs
    b"\xdb\xff\xff\xff\xff" + b"s" * 16,                     # str32 declaring 4 GiB
    b"\x81\xa4body\xc6\x7f\xff\xff\xff" + b"x",              # nested huge bin
    b"\x91" * 100_000 + b"\xc0",                             # nesting 100,000 deep
    b"\x81\xa1k" * 2000 + b"\xc0",                           # maps nested 2,000 deep
    b"\xd4\x01\x00",                                         # ext type
    b"\xc1",                                                 # never-used byte
    b"\x81\x01\x02",                                         # integer map key
    bytes(range(256)),                                       # garbage
])
def test_hostile_msgpack(tmp_path, data):
    p = tmp_path / "hostile.tape"
    p.write_bytes(data)
    _expect_error(p, "msgpack")


def test_deeply_nested_field_with_valid_checksum(tmp_path, good_tape_file):
    deep = 0
    for _ in range(1000):     # msgpack decodes up to 1,024 levels
        deep = {"instrs": deep}
    p = tmp_path / "deep.tape"
    p.write_bytes(_container(_mutated(good_tape_file, instrs=deep)))
    _expect_error(p, "'instrs' must be binary")


def test_oversized_file_is_refused_before_reading(tmp_path, good_tape_file, monkeypatch):
    monkeypatch.setattr(files, "MAX_FILE_BYTES", 64)
    _expect_error(good_tape_file, "exceeds the limit")


def test_hostile_scene_bodies(tmp_path):
    p = tmp_path / "bad.scene"
    for body, fragment in [({"kind": "teapot"}, "teapot"), ({"kind": 3}, "kind"),
                           ({"kind": "sphere", "numbers": [-1.0]}, "must be > 0"),
                           ({"kind": "sphere", "numbers": "1"}, "numbers"),
                           ({"kind": "union", "children": [{"kind": "sphere", "numbers": [1]}] * 2,
                             "material": {"name": "m", "color": [1, 2], "roughness": 0}}, "material")]:
        p.write_bytes(_container(body, kind="scene"))
        _expect_error(p, "bad scene", fragment, loader=load_scene_file)


def test_deep_scene_is_refused_on_save_and_nothing_written(tmp_path):
    node = sphere(1.0)
    for _ in range(600):      # each level is a map inside a list: deeper than msgpack's 1,024 limit
        node = node.translate(0.1, 0, 0)
    p = tmp_path / "deep.scene"
    with pytest.raises(TaperayError, match="nested too deeply"):
        save_scene(node, p)
    assert list(tmp_path.iterdir()) == []


# -- atomic saving ------------------------------------------------------------------------------
def test_save_leaves_only_the_target(tmp_path):
    p = tmp_path / "a.tape"
    save_tape(load_vm(DATA / "hi.vm"), p)
    save_tape(load_vm(DATA / "quarter.vm"), p)     # overwrite
    assert [q.name for q in tmp_path.iterdir()] == ["a.tape"]
    _assert_same_tape(load_tape_file(p), load_vm(DATA / "quarter.vm"))


@pytest.mark.parametrize("fail_at", ["fsync", "replace"])
def test_failed_save_keeps_the_old_file_and_no_partial_file(tmp_path, monkeypatch, fail_at):
    p = tmp_path / "keep.tape"
    old = load_vm(DATA / "hi.vm")
    save_tape(old, p)
    before = p.read_bytes()

    def boom(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(files.os, fail_at, boom)
    with pytest.raises(TaperayError, match="No space left"):
        save_tape(load_vm(DATA / "prospero.vm"), p)
    monkeypatch.undo()
    assert p.read_bytes() == before
    assert [q.name for q in tmp_path.iterdir()] == ["keep.tape"]


def test_interrupted_save_cleans_up(tmp_path, monkeypatch):
    p = tmp_path / "int.tape"

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(files.os, "replace", interrupt)
    with pytest.raises(KeyboardInterrupt):
        save_tape(load_vm(DATA / "hi.vm"), p)
    assert list(tmp_path.iterdir()) == []


def test_invalid_tape_is_not_saved(tmp_path):
    tape = load_vm(DATA / "hi.vm")
    tape.n_regs = 0
    p = tmp_path / "invalid.tape"
    with pytest.raises(TapeError):
        save_tape(tape, p)
    assert not p.exists()


def test_unwritable_directory(tmp_path):
    """A folder that cannot be made (a file stands in its place) is refused, naming the output;
    missing folders are made (as for every output: runtime.outputs)."""
    (tmp_path / "a file").write_text("x")
    p = tmp_path / "a file" / "dir.tape"
    with pytest.raises(TaperayError, match="dir.tape: cannot write"):
        save_tape(load_vm(DATA / "hi.vm"), p)
    made = tmp_path / "no" / "such" / "dir.tape"
    save_tape(load_vm(DATA / "hi.vm"), made)
    assert made.is_file()


def test_file_layout_is_documented_msgpack(good_tape_file):
    """The container is plain msgpack with the documented fields (other tools can read it)."""
    root = msgpack.unpackb(good_tape_file.read_bytes(), raw=False)
    assert (root["format"], root["version"], root["kind"]) == ("taperay", 1, "tape")
    body = root["body"]
    assert root["crc32"] == zlib.crc32(msgpack.packb(body, use_bin_type=True))
    tape = load_vm(DATA / "sphere.vm")
    records = [struct.unpack_from("<8I", body["instrs"], 32 * i) for i in range(len(tape))]
    assert records == [tuple(int(v) for v in r) for r in tape.as_columns()]
    assert len(body["instrs"]) == 32 * len(tape)
    assert body["params"] == tape.params.astype("<f4").tobytes()
    assert body["bounds"] == [-1.0, -1.0, -1.0, 1.0, 1.0, 1.0]


def test_a_frozen_tapes_key_is_kept_until_its_arrays_change(tmp_path, monkeypatch):
    """content_key hashes a frozen tape once (the 100,000-bolt bin's 10 MB cost a hash per frame
    before); a tape given a new array, or one made writable again, is hashed anew."""
    import dataclasses
    from taperay.runtime import tape as tape_module
    tape = flatten(sphere(Param("r", 0.5)) | torus(1.0, 0.2))
    tape_module.VALIDATED.check(tape)                      # (as every walker does before drawing it)
    assert not tape.params.flags.writeable
    key = tape_module.content_key(tape)
    hashed = []
    real_hash = hash
    monkeypatch.setattr(tape_module, "hash", lambda v: hashed.append(1) or real_hash(v), raising=False)
    assert tape_module.content_key(tape) == key and not hashed
    tape.params.flags.writeable = True
    tape.params[0] += 1.0
    assert tape_module.content_key(tape) != key and hashed
    other = dataclasses.replace(tape, params=tape.params.copy())
    hashed.clear()
    tape_module.content_key(other)
    assert hashed                                          # (a tape never frozen is hashed each time)


# -- op numbering -------------------------------------------------------------------------------
def test_a_tape_file_written_with_todays_table_still_loads():
    """tests/data/machined_part.tape was written by save_tape with the op table of its day (its
    ``opcodes`` map names each number's op): it loads as the scene flattens now, whatever the
    table's numbering has become since."""
    from taperay.scenes import machined_part
    _assert_same_tape(load_tape_file(DATA / "machined_part.tape"), flatten(machined_part.scene))


def test_a_file_names_its_ops_and_loads_after_a_renumbering(tmp_path, good_tape_file):
    body = _body(good_tape_file)
    assert body["opcodes"] == {op.name: int(op) for op in Op}
    want = load_tape_file(good_tape_file)
    # the same file as a taperay with every op numbered 1000 higher would have written it
    instrs = np.frombuffer(body["instrs"], want.instrs.dtype).copy()
    instrs["op"] += 1000
    p = tmp_path / "renumbered.tape"
    p.write_bytes(_container(_mutated(good_tape_file, instrs=instrs.tobytes(),
                                      opcodes={k: v + 1000 for k, v in body["opcodes"].items()})))
    _assert_same_tape(load_tape_file(p), want)


def test_a_file_without_an_op_map_has_the_first_numbering(tmp_path, good_tape_file):
    """A file of the first format (no ``opcodes``, its records numbered by OPCODES_1) loads as the
    same tape today, whatever today's numbers are."""
    assert files.OPCODES_1.keys() <= Op.__members__.keys()
    want = load_tape_file(good_tape_file)
    instrs = np.frombuffer(_body(good_tape_file)["instrs"], want.instrs.dtype).copy()
    instrs["op"] = [files.OPCODES_1[Op(int(o)).name] for o in instrs["op"]]
    assert not np.array_equal(instrs["op"], want.instrs["op"])    # (today's numbering differs)
    p = tmp_path / "old.tape"
    p.write_bytes(_container(_mutated(good_tape_file, instrs=instrs.tobytes(), opcodes=KeyError)))
    _assert_same_tape(load_tape_file(p), want)


@pytest.mark.parametrize("opcodes, fragment", [
    ({"WARP_DRIVE": 3}, "unknown to this taperay"),
    ("v1", "'opcodes' must map op names to integers"),
    ({"SPHERE": 0, "BOX": 0}, "taken twice"),
    ({"SPHERE": 40}, "is not in the file's 'opcodes'"),
])
def test_bad_op_maps_are_named(tmp_path, good_tape_file, opcodes, fragment):
    p = tmp_path / "ops.tape"
    p.write_bytes(_container(_mutated(good_tape_file, opcodes=opcodes)))
    _expect_error(p, fragment)
