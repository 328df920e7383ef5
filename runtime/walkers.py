"""Choosing a walker: ``walker("auto" | "cpu" | "gpu")`` built and ready, and ``run_on``, which
redoes a piece of work on the CPU twin when the GPU fails under ``auto``.

``auto`` uses the GPU walker when a hardware adapter exists (a software one such as Mesa's
lavapipe runs the kernels slower than the twin), its kernels build and ``gpu_self_check`` (the
GPU against the CPU twin, runtime/conformance.py) passes; otherwise, whatever went wrong on the
GPU path, the CPU twin, with the reason logged. On Linux, where no GPU device node exists and no
Vulkan driver list is given in the environment, ``auto`` takes the twin without importing wgpu
(a software adapter is all it could find). ``gpu`` without a working GPU is a user error
(``TaperayError``).

Owns the walker contract too: ``Walker``, the protocol the CPU twin (runtime/cpu.py), the GPU
walker (runtime/gpu.py) and the JAX walker (runtime/jax_walker.py) implement, and the names of
``CAPABILITIES`` a walker may declare (what it can do beyond the protocol's methods).
"""
from __future__ import annotations

import contextlib
import glob
import os
import sys
import threading
from typing import Callable, Protocol, runtime_checkable

import numpy as np

from .tape import Tape, TaperayError

__all__ = ["WALKER_KINDS", "CAPABILITIES", "Walker", "walker", "prepare", "run_on", "no_gpu_device"]

# what a walker can do, declared in its ``capabilities`` (a frozenset of these names)
CAPABILITIES = {
    "evaluate": "evaluate(tape, points): float32 values and uint32 material ids at (N, 3) points",
    "gradient": "gradient(tape, points, eps): (N, 3) float32 gradients of the field",
    "render": "render, march, light, field_image and sign_image: images by the camera's pixel convention",
    "derivatives": "value_and_grad, vjp, jvp and sensitivities: exact derivatives w.r.t. the pool",
    "upload": "the tape held in device buffers: upload(tape), edits written as the changed bytes",
}


@runtime_checkable
class Walker(Protocol):
    """The contract every walker keeps. ``name`` says which it is (cpu, gpu, jax);
    ``capabilities`` which of ``CAPABILITIES`` it has; a method outside them (``render`` on a
    walker without "render") raises ``TaperayError`` saying so. ``stats()`` is a dict of counters
    (each walker's own, ``points_evaluated`` in all); ``set_param`` edits the tape (and whatever
    copy of it the walker holds) so that the next call sees the edit, compiling nothing."""

    name: str
    capabilities: frozenset[str]

    def evaluate(self, tape: Tape, points) -> tuple[np.ndarray, np.ndarray]: ...

    def render(self, tape: Tape, camera, width: int, height: int, view: str = "shade",
               settings=None, cells="auto") -> np.ndarray: ...

    def set_param(self, tape: Tape, name: str, value) -> None: ...

    def stats(self) -> dict: ...

WALKER_KINDS = ("auto", "cpu", "gpu")
# the device nodes a hardware GPU's driver opens on Linux (Mesa's render nodes, NVIDIA's, WSL's)
GPU_DEVICE_NODES = ("/dev/dri/renderD*", "/dev/nvidiactl", "/dev/nvidia[0-9]*", "/dev/dxg")
VULKAN_DRIVER_VARIABLES = ("VK_DRIVER_FILES", "VK_ICD_FILENAMES", "VK_ADD_DRIVER_FILES")


def no_gpu_device() -> str | None:
    """Why ``auto`` need not open wgpu at all (about half a second of imports and adapter
    probing): on Linux, with no Vulkan driver list given in the environment, no GPU device node
    exists, so the only adapter wgpu could find is a software one. None: probe as usual."""
    if not sys.platform.startswith("linux") or any(os.environ.get(v) for v in VULKAN_DRIVER_VARIABLES):
        return None
    if any(glob.glob(pattern) for pattern in GPU_DEVICE_NODES):
        return None
    return ("this machine has no GPU device (/dev/dri/renderD*, /dev/nvidia*), so a GPU adapter could only "
            "be a software rasteriser, slower than the CPU twin (--walker gpu uses it anyway)")


def _quiet(message: str) -> None:
    pass


def prepare(kind: str = "auto", progress: bool = False, build_rest: bool = True) -> threading.Thread | None:
    """Start opening the GPU device that ``walker(kind)`` will ask for in a thread of its own
    (wgpu's import, the adapter, the device: about a second on a hardware driver, mostly inside
    the driver, outside the GIL), so that it overlaps the caller's imports and scene loading;
    ``walker(kind)`` then finds it open, or waits for it. Nothing for the twin, where ``auto``
    would not probe a GPU, or under ``auto`` on a software adapter. The thread is not a daemon: an
    interpreter that exits the usual way waits for it rather than tearing down while it is inside
    the driver (the console script, tools.cli.run, leaves without a teardown at all).
    ``build_rest``: gpu_device.build_in_background for the kernel set it makes (a one-shot
    command passes False). Returns the thread (the process's one: a later call returns it
    again), or None where nothing is opened."""
    if kind not in ("gpu", "auto") or (kind == "auto" and no_gpu_device() is not None):
        return None
    with _opening_lock:
        if _opening:
            return _opening[0]
        _opening.append(threading.Thread(target=_open_device, args=(kind, progress, build_rest),
                                         name="taperay-open-device"))
    _opening[0].start()
    return _opening[0]


_opening: list[threading.Thread] = []      # prepare's one thread
_opening_lock = threading.Lock()


def _open_device(kind: str, progress: bool, build_rest: bool) -> None:
    try:
        from . import gpu_adapter
        info = gpu_adapter.adapter_info()        # (the driver's part first, outside the GIL, while the
        if info is not None and (kind == "gpu" or not info["software"]):   # main thread imports)
            opened = sys.modules.get(f"{__package__}.gpu_device")
            if opened is None or opened.current_context() is None:    # (a process's first device)
                gpu_adapter.open_device()
            from . import gpu_device
            gpu_device.build_in_background(build_rest)
            gpu_device.kernels(progress)
    except Exception:      # (walker() opens it again and reports what went wrong)
        pass


def _twin(progress: bool):
    from .cpu import CpuWalker
    return CpuWalker(progress=progress)


def walker(kind: str = "auto", *, log: Callable[[str], None] | None = None, progress: bool = False,
           step: Callable[[str], contextlib.AbstractContextManager] | None = None):
    """The walker ``kind`` asks for, built and ready.

    ``log`` receives one line saying why ``auto`` fell back to the twin; ``progress`` shows the
    GPU kernels' build, or the CPU twin's first compile, on stderr when a request waits long for it; ``step(text)`` is a context manager shown while the
    self-check runs (the command line's spinner).

        >>> w = walker("auto")          # GpuWalker on a checked hardware GPU, else CpuWalker
    """
    if kind not in WALKER_KINDS:
        raise TaperayError(f"unknown walker {kind!r} (choose from {', '.join(WALKER_KINDS)})")
    log = log or _quiet
    step = step or (lambda text: contextlib.nullcontext())
    if kind == "cpu":
        return _twin(progress)
    no_device = no_gpu_device() if kind == "auto" else None
    if no_device is not None:
        log(f"walker:    cpu, because {no_device}")
        return _twin(progress)
    try:
        from . import gpu
    except ImportError as e:  # wgpu is missing from this install
        reason = f"the GPU walker cannot be imported ({e})"
    else:
        if not gpu.GpuWalker.available():
            reason = "no GPU adapter found"
        elif kind == "auto" and gpu.adapter_info()["software"]:
            reason = (f"the GPU adapter, {gpu.adapter_info()['name']}, is a software rasteriser, "
                      "slower than the CPU twin (--walker gpu uses it anyway)")
        else:
            try:
                built = gpu.GpuWalker(progress=progress)   # (its kernels are made as requests need them)
                if kind == "gpu":
                    return built
                from .conformance import gpu_self_check
                with step("GPU self-check against the CPU twin"):
                    check = gpu_self_check(built)
                if check.passed:
                    return built
                reason = f"GPU self-check {check}"
            except gpu.GpuError as e:
                reason = str(e)
            except Exception as e:   # auto never fails for want of a GPU: any GPU fault means the CPU
                if kind == "gpu":
                    raise
                reason = f"the GPU path failed ({type(e).__name__}: {e})"
    if kind == "gpu":
        raise TaperayError(f"gpu walker unavailable: {reason}")
    log(f"walker:    cpu, because {reason}")
    return _twin(progress)


def run_on(chosen, kind: str, work: Callable, log: Callable[[str], None] | None = None):
    """``(walker, work(walker))``; under ``kind == "auto"`` a GPU failure mid-run (device lost, out
    of memory) is logged and the work is redone on the CPU twin, which is then the walker
    returned."""
    if kind != "auto" or chosen.name == "cpu":
        return chosen, work(chosen)
    from .gpu import GpuError
    try:
        return chosen, work(chosen)
    except GpuError as e:
        (log or _quiet)(f"walker:    cpu, because the GPU failed: {e}")
        chosen = _twin(False)
        return chosen, work(chosen)
