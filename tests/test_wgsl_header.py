"""The generated WGSL header: committed files match the tables, layouts match numpy, and every op
constant is used by the one interpreter that every kernel includes."""
import re
import subprocess
import sys

import numpy as np
import pytest

from taperay.runtime import wgsl_header
from taperay.runtime.opcodes import CLASS_RANGES, REG_CAPS, Op, check_numba_constants
from taperay.runtime.shading import PACK_FIELDS, VIEWS
from taperay.runtime.tape import BVH_DTYPE, INSTANCE_DTYPE, INSTR_DTYPE, MATERIAL_DTYPE

SHADERS = wgsl_header.SHADER_DIR


def test_committed_files_match_the_tables():
    assert wgsl_header.drifted() == []


def test_check_exits_1_on_drift_and_0_when_clean(tmp_path):
    wgsl_header.write(tmp_path)
    cmd = [sys.executable, "-m", "taperay.runtime.wgsl_header", "--check", "--dir", str(tmp_path)]
    assert subprocess.run(cmd, capture_output=True).returncode == 0
    header = tmp_path / wgsl_header.HEADER_NAME
    add = f"const OP_ADD: u32 = {int(Op.ADD)}u;"
    assert add in header.read_text()
    header.write_text(header.read_text().replace(add, f"const OP_ADD: u32 = {int(Op.ADD) + 1}u;"))
    run = subprocess.run(cmd, capture_output=True, text=True)
    assert run.returncode == 1 and wgsl_header.HEADER_NAME in run.stderr
    assert wgsl_header.drifted(tmp_path) == [wgsl_header.HEADER_NAME]


def test_header_numbers_equal_the_opcode_table():
    text = (SHADERS / wgsl_header.HEADER_NAME).read_text()
    consts = {m[0]: int(m[1]) for m in re.findall(r"const OP_(\w+): u32 = (\d+)u;", text)}
    bounds = {f"{c.name}_{end}": int(op) for c, ops in CLASS_RANGES.items() for end, op in zip(("FIRST", "LAST"), ops)}
    assert consts == {**{op.name: int(op) for op in Op}, **bounds}


def test_numba_blocks_equal_the_table_and_drift_is_found(tmp_path):
    """The Numba modules (twin.py, interval_kernels.py, pruner.py, pruned_eval.py) import the table's
    numbers from the generated runtime/op_numbers.py and carry its hash as a generated block
    (Numba's cache sees an edit of their own source only);
    a stale module or block is drift, and a module with stale numbers refuses to import."""
    for name in (*wgsl_header.NUMBA_MODULES, wgsl_header.NUMBERS_NAME):
        (tmp_path / name).write_text((wgsl_header.RUNTIME_DIR / name).read_text())
    assert wgsl_header.drifted(runtime_dir=tmp_path) == []
    numbers = tmp_path / wgsl_header.NUMBERS_NAME
    assert numbers.read_text() == wgsl_header.generate_numbers_module()
    numbers.write_text(numbers.read_text().replace(f"\nADD = {int(Op.ADD)}\n", f"\nADD = {int(Op.ADD) + 1}\n"))
    assert wgsl_header.drifted(runtime_dir=tmp_path) == [f"runtime/{wgsl_header.NUMBERS_NAME}"]
    for name in wgsl_header.NUMBA_MODULES:
        text = (tmp_path / name).read_text()
        assert wgsl_header.generate_numba_block() in text
        (tmp_path / name).write_text(text.replace("# op numbers ", "# op numbers 0"))
    assert wgsl_header.drifted(runtime_dir=tmp_path) == [f"runtime/{n}" for n in
                                                         (wgsl_header.NUMBERS_NAME, *wgsl_header.NUMBA_MODULES)]
    stale = {}
    exec(compile(wgsl_header.generate_numbers_module().replace(f"\nADD = {int(Op.ADD)}\n", "\nADD = 0\n"),
                 "block", "exec"), stale)
    with pytest.raises(ImportError, match="ADD"):
        check_numba_constants(stale, "stale")


def test_render_layout_constants_equal_the_packed_settings():
    text = (SHADERS / wgsl_header.RENDER_NAME).read_text()
    sets = {m[0]: int(m[1]) for m in re.findall(r"const SET_(\w+): u32 = (\d+)u;", text)}
    assert sets == {k.upper(): off for k, (off, _) in PACK_FIELDS.items()}
    views = {m[0]: int(m[1]) for m in re.findall(r"const VIEW_(\w+): u32 = (\d+)u;", text)}
    assert views == {v.upper(): i for i, v in enumerate(VIEWS)}


def _field_names(struct_text: str) -> list[str]:
    return re.findall(r"^\s+(\w+): ", struct_text, re.M)


@pytest.mark.parametrize("name,dtype", [("Instr", INSTR_DTYPE), ("Material", MATERIAL_DTYPE),
                                        ("Instance", INSTANCE_DTYPE), ("Bvh", BVH_DTYPE)])
def test_every_record_dtype_has_its_struct(name, dtype):
    text = (SHADERS / wgsl_header.HEADER_NAME).read_text()
    body = re.search(rf"struct {name} {{(.*?)}}", text, re.S)
    assert body, f"struct {name} missing"
    assert _field_names(body.group(1)) == list(dtype.names)
    assert f"// {dtype.itemsize} bytes" in text


def test_layouts_wgsl_cannot_mirror_are_rejected():
    with pytest.raises(ValueError, match="no WGSL"):
        wgsl_header.wgsl_struct("Bad", np.dtype([("x", "<f8")]))
    padded = np.dtype({"names": ["a", "b"], "formats": ["<f4", "<f4"], "offsets": [0, 8], "itemsize": 12})
    with pytest.raises(ValueError, match="offset"):
        wgsl_header.wgsl_struct("Padded", padded)
    # a vec3 followed by a scalar packs into 16 bytes exactly as numpy does
    assert "vec3<f32>" in wgsl_header.wgsl_struct("M", MATERIAL_DTYPE)


def test_one_register_variant_file_per_capacity():
    for cap in REG_CAPS:
        text = (SHADERS / wgsl_header.regcap_name(cap)).read_text()
        assert f"const REG_CAP: u32 = {cap}u;" in text


def test_every_kernel_module_includes_the_interpreter():
    """Every kernel module is the fixed prelude + interpreter + a kernel file (so the interpreter's
    case of each op, tests/test_op_table.py, is in every kernel)."""
    from taperay.runtime import gpu_device
    for kernel, (file, _) in gpu_device.KERNELS.items():
        for cap in REG_CAPS:
            src = gpu_device._shader_text(file, cap)
            assert (SHADERS / "interpreter.wgsl").read_text() in src
            assert f"fn {gpu_device.KERNEL_ENTRY.get(kernel, kernel)}(" in src


def test_packed_records_leave_the_immediate_flags_free():
    """packed.wgsl keeps a pruned record's op in the low 6 bits of its first byte (OP_MASK) and
    marks folded constant operands with bits 6 and 7: every arithmetic op must be below 64."""
    from taperay.runtime.opcodes import OPS, Family
    text = (SHADERS / "packed.wgsl").read_text()
    mask = int(re.search(r"const OP_MASK: u32 = 0x([0-9a-f]+)u;", text)[1], 16)
    flags = [int(re.search(rf"const {n}: u32 = 0x([0-9a-f]+)u;", text)[1], 16) for n in ("IMM_A", "IMM_B")]
    assert mask | flags[0] | flags[1] == 0xff and mask & (flags[0] | flags[1]) == 0 and flags[0] != flags[1]
    assert max(int(op) for op, spec in OPS.items() if spec.family == Family.ARITH) <= mask


def test_every_record_of_a_step_has_an_invocation():
    """prune_wave runs record j of a dependency step on invocation j of its workgroup: WAVE_WIDTH
    is at most the workgroup size, on which runtime.gpu and bindings.wgsl agree."""
    from taperay.runtime.gpu import WG
    from taperay.runtime.opcodes import WAVE_WIDTH
    assert f"const WG: u32 = {WG}u;" in (SHADERS / "bindings.wgsl").read_text()
    assert 0 < WAVE_WIDTH <= WG


def test_stale_op_blocks_are_drift(tmp_path):
    """The arithmetic ops' generated cases (runtime.op_codegen) are part of the check: a block edited
    by hand, or a table edited without regenerating, is drift; write() restores the block."""
    from taperay.runtime import op_codegen
    shaders, runtime = tmp_path / "shaders", tmp_path / "runtime"
    shaders.mkdir()
    runtime.mkdir()
    wgsl_header.write(shaders, runtime_dir=wgsl_header.RUNTIME_DIR)   # (the generated files only)
    for rel in {rel for rel, _ in op_codegen.BLOCKS} | {f"runtime/{name}" for name in wgsl_header.NUMBA_MODULES}:
        folder, name = rel.split("/")
        src = (wgsl_header.SHADER_DIR if folder == "shaders" else wgsl_header.RUNTIME_DIR) / name
        (tmp_path / folder / name).write_text(src.read_text())
    (runtime / wgsl_header.NUMBERS_NAME).write_text(wgsl_header.generate_numbers_module())
    assert wgsl_header.drifted(shaders, runtime) == []
    interp = shaders / "interpreter.wgsl"
    good = interp.read_text()
    interp.write_text(good.replace("if (op == OP_SQRT) { return sqrt(va); }", "if (op == OP_SQRT) { return va; }"))
    twin_ops = runtime / "twin_ops.py"
    twin_ops.write_text(twin_ops.read_text().replace("regs[d, j] = np.sqrt(regs[a, j])", "regs[d, j] = regs[a, j]"))
    assert wgsl_header.drifted(shaders, runtime) == ["runtime/twin_ops.py", "shaders/interpreter.wgsl"]
    wgsl_header.write(shaders, runtime)
    assert interp.read_text() == good and wgsl_header.drifted(shaders, runtime) == []
