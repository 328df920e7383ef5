"""Choosing a walker: ``walker("auto" | "cpu" | "gpu")`` built and ready, and ``run_on``, which
redoes a piece of work on the CPU twin when the GPU fails under ``auto``.

``auto`` uses the GPU walker when a hardware adapter exists (a software one such as Mesa's
lavapipe runs the kernels slower than the twin), its kernels build and ``gpu_self_check`` (the
GPU against the CPU twin, runtime/conformance.py) passes; otherwise, whatever went wrong on the
GPU path, the CPU twin, with the reason logged. ``gpu`` without a working GPU is a user error
(``TaperayError``).
"""
from __future__ import annotations

import contextlib
from typing import Callable

from .conformance import gpu_self_check
from .cpu import CpuWalker
from .tape import TaperayError

__all__ = ["WALKER_KINDS", "walker", "run_on"]

WALKER_KINDS = ("auto", "cpu", "gpu")


def _quiet(message: str) -> None:
    pass


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
        return CpuWalker(progress=progress)
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
    return CpuWalker(progress=progress)


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
        chosen = CpuWalker()
        return chosen, work(chosen)
