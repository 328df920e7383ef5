"""BENCHMARK-ONLY: the written-out WGSL baseline of one tape, compiled and run through the GPU walker.

``BaselineKernel(walker, tape, kernels)`` compiles the walker's own kernels (``eval_points``,
``march``, ``light``, ``slice``) with the interpreter's ``run_tape`` replaced by the tape written
out (``tools.baseline_wgsl.module_source``, the scene written once for every module), on the walker's device with its pipeline layout, and
reports how long that took. ``evaluate`` / ``render`` then run the walker's own ``evaluate`` /
``render`` — its buffers, uniforms, bind group, passes, resumption and read-back — with the
written-out pipelines put in place of the interpreter's for the duration of the call
(``installed``), so the two sides of ``taperay bench gpu`` differ only in the scene function.
This is the one place outside the walker's startup build that creates shader modules, and only for
the benchmarks' comparison (interpreter vs code written out per scene); the walkers never do.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import numpy as np

from taperay.runtime.tape import Tape, TaperayError

from .baseline_wgsl import scene_function, splice

__all__ = ["BaselineKernel", "POINT_KERNELS", "FRAME_KERNELS", "WRITTEN_OUT_KERNELS"]

POINT_KERNELS = ("eval_points",)
FRAME_KERNELS = ("march", "surface", "light")   # every view but slice (shade / resolve read no tape)
WRITTEN_OUT_KERNELS = ("eval_points", "march", "surface", "light", "slice")   # the kernels that call run_tape


class BaselineKernel:
    """One tape written out as WGSL in the walker's ``kernels`` (a subset of
    ``WRITTEN_OUT_KERNELS``), compiled on ``walker``'s device.

    ``source_chars``: the size of the generated text (all modules); ``generate_seconds``: writing
    it; ``compile_seconds``: shader modules + pipeline creation; ``first_dispatch_seconds``: the
    first use (one point, a 1x1 frame per view family), where drivers that compile lazily (Mesa
    lavapipe) do their work.
    """

    def __init__(self, walker, tape: Tape, culls: bool = True, kernels=POINT_KERNELS):
        from taperay.runtime import gpu_device
        unknown = sorted(set(kernels) - set(WRITTEN_OUT_KERNELS))
        if unknown or not kernels:
            raise TaperayError(f"baseline kernels {unknown or '()'}: choose from {', '.join(WRITTEN_OUT_KERNELS)}")
        self.walker, self.tape, self.kernels = walker, tape, tuple(kernels)
        self.variant = walker.upload(tape)
        files: dict[str, list[str]] = {}
        for k in self.kernels:
            files.setdefault(gpu_device.KERNELS[k][0], []).append(k)
        t0 = time.perf_counter()
        scene = scene_function(tape, culls)
        sources = {f: splice(scene, f) for f in files}
        self.generate_seconds = time.perf_counter() - t0
        self.source_chars = sum(len(s) for s in sources.values())
        ks = walker.kernels
        self._pipelines = {}
        t0 = time.perf_counter()
        for f, names in files.items():
            module = ks.device.create_shader_module(label=f"baseline {f} {tape.source}", code=sources[f])
            for k in names:
                self._pipelines[(k, self.variant)] = ks.device.create_compute_pipeline(
                    label=f"baseline {k}", layout=ks.pipeline_layout,
                    compute={"module": module, "entry_point": k, "constants": gpu_device.KERNEL_CONSTANTS.get(k, {})})
        self.compile_seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        if "eval_points" in self.kernels:
            self.evaluate(np.zeros((1, 3), np.float32))
        if "march" in self.kernels:
            self.render(None, 1, 1, "shade" if "light" in self.kernels else "normals")
        if "slice" in self.kernels:
            self.render(None, 1, 1, "slice")
        self.first_dispatch_seconds = time.perf_counter() - t0

    @contextmanager
    def installed(self):
        """The walker's kernel set serving the written-out pipelines for this tape's register
        variant (the interpreter's are put back on exit)."""
        self.walker.kernels.ensure(list(self._pipelines))     # (the interpreter's, made on first need)
        table = self.walker.kernels._pipelines
        saved = {key: table[key] for key in self._pipelines}
        table.update(self._pipelines)
        try:
            yield
        finally:
            table.update(saved)

    def evaluate(self, points) -> tuple[np.ndarray, np.ndarray]:
        """(N,) float32 distances and (N,) uint32 materials: ``GpuWalker.evaluate``, written out."""
        with self.installed():
            return self.walker.evaluate(self.tape, points)

    def render(self, camera, width: int, height: int, view: str = "shade", settings=None,
               samples: int = 1) -> np.ndarray:
        """(H, W, 3) uint8: ``GpuWalker.render``, written out (``march`` / ``light`` / ``slice``
        must be among the kernels the view runs)."""
        need = {"slice": ("slice",), "shade": FRAME_KERNELS, "section": FRAME_KERNELS}.get(view, ("march",))
        missing = [k for k in need if k not in self.kernels]
        if missing:
            raise TaperayError(f"baseline render {view!r}: kernels {', '.join(missing)} were not written out")
        with self.installed():      # (cells=None: the tape's own records, which were written out)
            return self.walker.render(self.tape, camera, width, height, view=view, settings=settings,
                                      samples=samples, cells=None)
