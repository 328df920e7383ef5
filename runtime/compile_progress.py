"""The line that shows a first Numba compile's progress by the clock.

``show_compile_progress()`` (``CpuWalker(progress=True)``, the command line's walker) writes
``compiling CPU kernels [#####---] 1/2  31.0 s of ~60 s`` on stderr while Numba compiles a kernel
for more than ``PROGRESS_AFTER_SECONDS``: gpu_device's build line, moving by the clock against
``COLD_COMPILE_SECONDS``, the measured cold compile of each top-level kernel (stderr not a
terminal: the finished line alone). A load from the disk cache (runtime.jit_cache) compiles
nothing and shows nothing.
"""
from __future__ import annotations

import sys
import threading
import time

from numba.core import event

from .gpu_device import ProgressLine       # (the GPU build's line; gpu_device imports no wgpu)

__all__ = ["show_compile_progress", "PROGRESS_AFTER_SECONDS", "COLD_COMPILE_SECONDS"]

PROGRESS_AFTER_SECONDS = 1.0    # a compile shorter than this shows no line
# seconds of a cold compile of each top-level kernel, measured (2-core EPYC, docs/PERFORMANCE.md
# "Cold compile"; _run_block, _image_tiles, _points_kernel, _prune_subcells, _cells_points_kernel: the
# wait for the helper process compiling it, after the kernels);
# the progress line's prediction, the default for a kernel not listed
COLD_COMPILE_SECONDS = {"cull_saves": 2.0, "_pixel_rays": 0.6, "light_kernel": 7.1, "_shade": 0.8, "_rgb8": 0.1,
                        "march_kernel": 4.4, "loop_enter": 1.1, "copy_bound": 0.6, "compact_instances": 1.0,
                        "undo_swaps": 0.3, "_run_block": 0.5, "_eval_kernel": 3.0, "_image_top": 9.7,
                        "_image_tiles": 7.0, "_lanes_kernel": 7.5, "_points_kernel": 1.5, "_prune_cells": 1.1,
                        "_prune_subcells": 3.7, "_cells_points_kernel": 3.7}
COLD_COMPILE_DEFAULT = 3.0


class _CompileLine(ProgressLine):
    """The GPU build's line, labelled for Numba's compile."""

    def _write(self, frac: float, done: int, tail: str):
        sys.stderr.write(f"\rcompiling CPU kernels [{'#' * int(frac * 24):<24}] {done}/{self.total}  {tail}")
        sys.stderr.flush()


class _CompileWatch(event.Listener):
    """Numba's compile events: the top-level compiles (those not inside another) of one burst
    (compiles with less than a tenth of a second between them), shown by a ticking thread."""

    def __init__(self):
        self.lock = threading.Lock()
        self.depth = 0
        self.started = self.finished = 0
        self.predicted = 0.0
        self.ticker: threading.Thread | None = None

    def on_start(self, ev):
        with self.lock:
            self.depth += 1
            if self.depth > 1:
                return
            name = getattr(ev.data["dispatcher"], "__name__", "")
            self.started += 1
            self.predicted += COLD_COMPILE_SECONDS.get(name, COLD_COMPILE_DEFAULT)
            if self.ticker is None:
                self.ticker = threading.Thread(target=self._tick, name="taperay-compile-line", daemon=True)
                self.ticker.start()

    def on_end(self, ev):
        with self.lock:
            self.depth -= 1
            if self.depth == 0:
                self.finished += 1

    def _tick(self):
        t0, line, idle_since = time.perf_counter(), None, None
        while True:
            time.sleep(0.1)
            with self.lock:
                busy, started, finished, predicted = self.depth > 0, self.started, self.finished, self.predicted
                if not busy and idle_since is not None and time.perf_counter() - idle_since >= 0.1:
                    self.ticker, self.started, self.finished, self.predicted = None, 0, 0, 0.0
                    break
            idle_since = None if busy else (idle_since or time.perf_counter())
            if line is None and time.perf_counter() - t0 >= PROGRESS_AFTER_SECONDS \
                    and sys.stderr is sys.__stderr__:
                line = _CompileLine(started, predicted)
                line.t0 = t0
            if line is not None:
                line.total, line.predicted = started, predicted
                if sys.stderr.isatty():          # (in a log: the finished line alone)
                    line.update(finished)
        if line is not None:
            line.finish()


_WATCH: list[_CompileWatch] = []


def show_compile_progress() -> None:
    """From now on, show this process's Numba compiles of more than PROGRESS_AFTER_SECONDS on
    stderr (once per process; a later call changes nothing)."""
    if not _WATCH:
        _WATCH.append(_CompileWatch())
        event.register("numba:compile", _WATCH[0])
