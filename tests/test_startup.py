"""What a fresh process's GPU walker makes, and when (runtime/gpu_device.py KernelSet): a request
makes the pipelines of the passes it runs and no others, each once; a second frame and edits of
the drawn scene make none; with the background on, the first request queues the rest, after
which no request makes one. Also the stage timings ``taperay bench startup`` reads from the
command line."""
import numpy as np
import pytest

from taperay.runtime import conformance as C
from taperay.runtime import gpu_device
from taperay.scenegraph import Param, box, flatten, sphere

pytestmark = pytest.mark.gpu


@pytest.fixture
def fresh_kernels(walker_gpu, monkeypatch):
    """A function giving a GpuWalker on a new, empty kernel set (as a new process has) over the
    suite's device; the suite's own set is put back afterwards."""
    ctx = walker_gpu.context
    made = []

    def make(background: bool):
        from taperay.runtime.gpu import GpuWalker
        ks = gpu_device.KernelSet(ctx.device, "test | " + ctx.kernels.adapter_key, ctx.info["software"],
                                  warm=ctx.kernels.warm, background=background)
        made.append(ks)
        monkeypatch.setattr(ctx, "kernels", ks)
        return GpuWalker(), ks

    yield make
    for ks in made:
        ks.close()


def _scene(extra: bool = False):
    node = sphere(Param("r", 0.4)) | box(0.3).translate(0.5, 0, 0)
    if extra:
        node = node | sphere(0.2).translate(0, 0.6, 0)
    return flatten(node.translate(0.1, 0, 0))


@pytest.mark.slow
def test_a_render_makes_only_its_passes_pipelines_and_edits_make_none(fresh_kernels, tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_device, "RATE_FILE", tmp_path / "compile_rate.json")
    walker, ks = fresh_kernels(background=False)
    tape = _scene()
    assert len(tape.instrs) < 64          # (below PRUNE_MIN_RECORDS: every frame on its own records)
    variant = gpu_device.variant_for(tape.n_regs)
    assert len(ks) == 0
    first = walker.render(tape, None, 16, 12)
    passes = {("march", variant), ("surface", variant), ("light", variant), ("shade", None), ("resolve", None)}
    assert ks.created_keys() == passes
    assert ks.stats.pipelines_created == ks.stats.cache_misses == len(passes)
    assert ks.stats.shader_modules_created == 1          # (all five kernels are in one file)
    # a second frame, a parameter edit and a topology edit of the same size: nothing made
    np.testing.assert_array_equal(walker.render(tape, None, 16, 12), first)
    walker.set_param(tape, "r", 0.3)
    walker.render(tape, None, 16, 12)
    edited = _scene(extra=True)
    assert gpu_device.variant_for(edited.n_regs) == variant
    walker.render(edited, None, 16, 12)
    assert ks.created_keys() == passes and ks.stats.pipelines_created == len(passes)
    assert ks.stats.cache_misses == len(passes) and ks.stats.cache_hits > 0
    # another kind of request makes its own, once
    walker.evaluate(tape, np.zeros((3, 3)))
    walker.evaluate(tape, np.ones((3, 3)))
    assert ks.created_keys() == passes | {("eval_points", variant)}
    # what the wait took taught this machine's rate
    assert gpu_device.load_rate(ks.adapter_key, ks.software) not in (gpu_device.DEFAULT_RATE_HARDWARE,
                                                                      gpu_device.DEFAULT_RATE_SOFTWARE)


@pytest.mark.slow
def test_the_background_makes_the_rest_once_and_later_requests_make_none(fresh_kernels, tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_device, "RATE_FILE", tmp_path / "compile_rate.json")
    walker, ks = fresh_kernels(background=True)
    small = C.wide_tape(np.random.default_rng(8), 8)
    walker.evaluate(small, np.zeros((2, 3)))
    assert ks.stats.cache_misses == 1       # the request made its own; the rest are queued behind it
    ks.settle()
    keys = gpu_device.KernelSet.keys()
    assert ks.created_keys() == set(keys) and ks.stats.pipelines_created == len(keys)
    for n in (40, 200):                     # other register variants: made by the background
        walker.evaluate(C.wide_tape(np.random.default_rng(n), n), np.zeros((2, 3)))
    assert ks.stats.cache_misses == 1 and ks.stats.pipelines_created == len(keys)


def test_closing_drops_the_queue_and_refuses_requests(fresh_kernels):
    walker, ks = fresh_kernels(background=False)
    ks.close()
    with pytest.raises(gpu_device.GpuError, match="closed"):
        walker.evaluate(C.wide_tape(np.random.default_rng(8), 8), np.zeros((2, 3)))
    assert ks.stats.pipelines_created == 0


def test_stage_timings_are_read_from_the_command_line():
    from taperay.tools.bench_startup import parse_timings
    line = "timings:   load 2.1 ms, flatten/validate 10.9 ms, walker 1.09 s, pipelines 320.8 ms, frame 6.99 s, " \
           "write 24.7 ms (total 8.43 s)"
    assert parse_timings("records: 3\n" + line + "\n") == pytest.approx(
        {"load": 0.0021, "flatten/validate": 0.0109, "walker": 1.09, "pipelines": 0.3208, "frame": 6.99,
         "write": 0.0247})


def test_prepare_opens_the_device_in_a_thread_and_the_walker_uses_it(walker_gpu):
    from taperay.runtime import walkers
    assert walkers.prepare("cpu") is None              # the twin needs no device
    opening = walkers.prepare("gpu", build_rest=True)
    assert walkers.prepare("gpu", build_rest=True) is opening     # (a second call starts nothing more)
    opening.join(timeout=120)
    assert not opening.is_alive()
    assert walkers.walker("gpu").context is gpu_device.current_context() is walker_gpu.context
    from taperay.runtime import gpu_adapter
    assert gpu_adapter.opened_ahead() == 0             # (a context was open: no second device)


def test_the_device_opened_ahead_is_the_one_the_context_takes():
    """gpu_adapter.open_device (prepare's thread, before it imports the device layer) opens the
    device once; take_device hands it out once, then opens new ones (after a device loss)."""
    from taperay.runtime import gpu_adapter
    assert gpu_adapter.opened_ahead() == 0
    ahead = gpu_adapter.open_device()
    assert ahead is not None and gpu_adapter.open_device() is ahead and gpu_adapter.opened_ahead() == 1
    assert gpu_adapter.take_device() is ahead and gpu_adapter.opened_ahead() == 0
    other = gpu_adapter.take_device()
    assert other is not ahead
    assert other.limits["max-storage-buffer-binding-size"] == ahead.limits["max-storage-buffer-binding-size"]


def test_a_one_shot_command_does_not_start_the_wave_planner(monkeypatch):
    from pathlib import Path

    from taperay.runtime import gpu_pruning
    from taperay.scenegraph.vm import load_vm
    tape = load_vm(Path(__file__).parent / "data" / "prospero.vm")     # (a tape prune_wave takes)
    planner = gpu_pruning.WavePlanner()                # (as a fresh process has it: not compiled)
    monkeypatch.setattr(gpu_pruning, "WAVE_PLANNER", planner)
    background = gpu_device.builds_in_background()
    try:
        gpu_device.build_in_background(False)
        assert gpu_pruning.wave_schedule(tape) is None
        assert planner.loader is None                  # no compile started, none to wait for at exit
        gpu_device.build_in_background(True)
        assert gpu_pruning.wave_schedule(tape) is None     # (a long-lived process starts it, and goes on)
        assert planner.loader is not None
        planner.loader.join()
    finally:
        gpu_device.build_in_background(background)


def test_a_gpu_render_process_loads_no_numba(tmp_path):
    """`taperay render --walker gpu` of a scene and of a .vm program's 2D image runs no twin kernel,
    so the process never imports Numba (runtime.jit_cache loads it on a kernel's first call)."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    code = ("import sys\nfrom taperay.runtime import jit_cache\nfrom taperay.tools import cli\n"
            f"cli.main(['render', r'{root}/scenes/machined_part.py', '--walker', 'gpu', '--size', '32x24', "
            f"'-o', r'{tmp_path}/a.png'])\n"
            f"cli.main(['render', r'{root}/tests/data/prospero.vm', '--2d', '--walker', 'gpu', '--size', '64', "
            f"'-o', r'{tmp_path}/b.png'])\n"
            "print('numba' in sys.modules, jit_cache.numba_loaded())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True)
    assert out.stdout.splitlines()[-1] == "False False", out.stdout + out.stderr
    assert (tmp_path / "a.png").exists() and (tmp_path / "b.png").exists()
