"""The fixed kernel set: every pipeline created at most once, cached by (kernel, variant), never
created again whatever the process loads or edits once made; shader text only from the committed
files; the build's progress is predicted from a per-machine compile rate. (What a fresh process
makes, and when: tests/test_startup.py.)"""
import re

import numpy as np
import pytest

from taperay.runtime import conformance as C
from taperay.runtime import gpu_device
from taperay.runtime.opcodes import REG_CAPS, Op
from taperay.runtime.wgsl_header import SHADER_DIR

pytestmark = pytest.mark.gpu


def test_every_pipeline_is_made_once(walker_gpu):
    """The suite's walker has had every pipeline queued (conftest): each made exactly once, and
    asking for them all again makes none."""
    ks = walker_gpu.kernels
    keys = gpu_device.KernelSet.keys()
    per_variant = sum(1 for _, v in gpu_device.KERNELS.values() if v)
    assert len(keys) == per_variant * len(REG_CAPS) + len(gpu_device.KERNELS) - per_variant
    ks.queue_rest()
    ks.settle()
    # (a viewer's present pass, where one ran in this process, is counted with them)
    present = len(ks.present_formats)
    assert len(ks) == len(keys) and ks.created_keys() == set(keys)
    assert ks.stats.pipelines_created == len(keys) + present
    assert ks.stats.shader_modules_created == (len({f for f, _ in gpu_device.KERNELS.values()}) * len(REG_CAPS)
                                               + (present > 0))
    misses = ks.stats.cache_misses
    ks.ensure(keys)
    assert [ks.pipeline(*k) for k in keys] and ks.stats.pipelines_created == len(keys) + present
    assert ks.stats.cache_misses == misses


def test_shader_text_is_only_the_committed_files():
    """Every module is the fixed files concatenated: nothing formatted, nothing from a scene."""
    for file, _ in gpu_device.KERNELS.values():
        for cap in REG_CAPS:
            names = (*gpu_device.PRELUDE_BEFORE_REGCAP, f"generated_regcap_{cap}.wgsl",
                     *gpu_device.PRELUDE_AFTER_REGCAP, *file.split("+"))
            assert gpu_device._shader_text(file, cap) == "\n".join((SHADER_DIR / n).read_text() for n in names)
    for module in ("gpu.py", "gpu_pruning.py"):
        source = (SHADER_DIR.parent / "runtime" / module).read_text()
        assert ".format(" not in source
        assert not re.search(r'f"[^"\n]*(fn |@compute|var<|struct )', source)


def _random_edit(walker, rng, tape, step):
    """One of: a named parameter moved, a pattern resized, nodes added / removed (a random tape of
    another size), a whole other tape (one op's tape). Returns the tape to evaluate next."""
    kind = step % 4
    if kind == 0:
        tape = tape if tape.names else _named_pattern_tape(rng)
        walker.set_param(tape, "r", float(rng.uniform(0.1, 0.4)))
        return tape
    if kind == 1:
        tape = _named_pattern_tape(rng)
        rep = np.flatnonzero(tape.instrs["op"] == int(Op.REPEAT_LINEAR))[0]
        tape.params[tape.instrs[rep]["param"] + 3] = float(rng.integers(1, 7))
        return tape
    if kind == 2:
        return C.random_tape(rng, depth=int(rng.integers(1, 5)))
    return C.op_tape(Op(rng.choice(list(Op))), rng)


def _named_pattern_tape(rng):
    b = C.TapeBuilder()
    begin = b.row(Op.REPEAT_LINEAR, params=[0.5, 0.0, 0.0, 3, 0.3])
    slot = len(b.params)
    b.row(Op.SPHERE, 1, params=[0.2])
    b.rows[begin][7] = b.row(Op.REPEAT_END, 0, a=1, jump=begin)
    tape = b.tape(C.random_materials(rng), [[-1.0] * 3, [2.0] * 3], "named")
    tape.names = {"r": [slot]}
    return tape


def test_zero_compiles_across_100_random_edits(walker_gpu, walker_cpu):
    ks = walker_gpu.kernels
    created = (ks.stats.shader_modules_created, ks.stats.pipelines_created)
    misses = ks.stats.cache_misses
    hits = ks.stats.cache_hits
    rng = np.random.default_rng(42)
    tape = _named_pattern_tape(rng)
    pts = rng.uniform(-1.5, 1.5, (4, 3)).astype(np.float32)
    variants = set()
    for step in range(100):
        tape = _random_edit(walker_gpu, rng, tape, step)
        variants.add(gpu_device.variant_for(tape.n_regs))
        d = walker_gpu.evaluate(tape, pts)[0]
        if step % 10 == 0:
            assert np.allclose(d, walker_cpu.evaluate(tape, pts)[0], atol=1e-4, rtol=1e-5, equal_nan=True)
    assert (ks.stats.shader_modules_created, ks.stats.pipelines_created) == created
    assert ks.stats.cache_misses == misses
    assert ks.stats.cache_hits >= hits + 100
    assert len(variants) >= 1


def test_wide_tapes_switch_variants_without_compiling(walker_gpu):
    ks = walker_gpu.kernels
    created, misses = ks.stats.pipelines_created, ks.stats.cache_misses
    for n in (8, 40, 200):
        walker_gpu.evaluate(C.wide_tape(np.random.default_rng(n), n), np.zeros((2, 3)))
    assert ks.stats.pipelines_created == created and ks.stats.cache_misses == misses


def test_compile_rate_starts_from_the_adapter_kind_and_is_learnt_per_machine(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_device, "RATE_FILE", tmp_path / "taperay" / "compile_rate.json")
    assert gpu_device.load_rate("machine A") == gpu_device.DEFAULT_RATE_HARDWARE
    assert gpu_device.load_rate("machine A", software=True) == gpu_device.DEFAULT_RATE_SOFTWARE
    gpu_device.store_rate("machine A", 1234.5)
    gpu_device.store_rate("machine B", 99.0)
    assert gpu_device.load_rate("machine A") == 1234.5 and gpu_device.load_rate("machine B") == 99.0
    gpu_device.store_rate("machine A", 4 * 1234.5)         # a later build moves it half way (geometric)
    assert gpu_device.load_rate("machine A") == pytest.approx(2 * 1234.5)
    (tmp_path / "taperay" / "compile_rate.json").write_text("not json")
    assert gpu_device.load_rate("machine A") == gpu_device.DEFAULT_RATE_HARDWARE


def test_a_new_machine_predicts_its_build_from_the_adapter_kind(walker_gpu):
    """Every pipeline's build as a new machine predicts it, against what was measured: an H200 (16
    threads) built all 56 in 3.0-6.3 s, lavapipe here (2 threads) in 4.7-7 s. (The H200 once
    predicted 168.6 s from one rate for every adapter.)"""
    weights = [walker_gpu.kernels.weight(k) for k in gpu_device.KernelSet.keys()]
    hardware = gpu_device.predict_seconds(weights, 16, gpu_device.DEFAULT_RATE_HARDWARE)
    software = gpu_device.predict_seconds(weights, 2, gpu_device.DEFAULT_RATE_SOFTWARE)
    assert 3.0 / 2 <= hardware <= 6.3 * 2 and 4.7 / 2 <= software <= 7 * 2, (hardware, software)
    # the rate learnt from a build predicts that build again
    rate = gpu_device.measured_rate(weights[:5], 16, 0.8)
    assert gpu_device.predict_seconds(weights[:5], 16, rate) == pytest.approx(0.8)


def test_progress_line_moves_by_the_clock(capsys, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(gpu_device.time, "perf_counter", lambda: now[0])
    line = gpu_device.ProgressLine(total=20, predicted=10.0)
    line.update(0)
    now[0] += 5.0
    line.update(0)            # nothing finished yet, but half the predicted time has passed
    line.finish()
    err = capsys.readouterr().err
    frames = err.split("\r")
    assert "[" + " " * 24 + "]" in frames[1] and "0.0 s of ~10.0 s" in frames[1]
    assert "#" * 12 in frames[2] and "5.0 s of ~10.0 s" in frames[2]
    assert "20/20" in frames[3] and err.endswith("\n")
