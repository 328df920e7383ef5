"""The guard of every ``GpuWalker`` method that uses the device, in a module of its own so that
runtime/gpu.py and the walker's pruned passes (runtime/gpu_pruning.py's ``GpuPrunedPasses``,
which gpu.py imports) both decorate with it without importing each other."""
from __future__ import annotations

import functools

from .tape import TaperayError


def guarded(method):
    """A GpuWalker method that uses the device, or a method of an object that dispatches through
    one held as its ``walker`` (runtime/gpu_pruning.py's GpuPrunedPasses, runtime/path_tracing.py's
    GpuPathTracer): picks up a rebuilt
    context after a device loss and turns every driver / wgpu failure into GpuError (a
    TaperayError the CLI falls back on)."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        walker = getattr(self, "walker", self)
        walker.ensure_context()
        try:
            return method(self, *args, **kwargs)
        except TaperayError:
            raise
        except Exception as e:
            walker.device_lost(e)
    return call
