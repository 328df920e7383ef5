"""BENCHMARK-ONLY: the written-out WGSL baseline of one tape, compiled and run on the GPU walker's device.

``BaselineKernel(walker, tape)`` compiles ``tools.baseline_wgsl.module_source(tape)`` with the
walker's own device and pipeline layout (so the kernel sees the interpreter's bind group layout) and
evaluates points with it, reporting how long the compile took. This is the one place outside the
walker's startup build that creates shader modules, and only for the ``taperay bench gpu``
comparison (interpreter vs code written out per scene); the walkers never do.
"""
from __future__ import annotations

import time

import numpy as np

from taperay.runtime.tape import Tape

from .baseline_wgsl import ENTRY, module_source

__all__ = ["BaselineKernel"]


class BaselineKernel:
    """One tape written out as WGSL, compiled on ``walker``'s device.

    ``compile_seconds``: shader module + pipeline creation; ``first_dispatch_seconds``: the first
    dispatch (one point), where drivers that compile lazily (Mesa lavapipe) do their work.
    """

    def __init__(self, walker, tape: Tape, culls: bool = True):
        from taperay.runtime import gpu
        self._gpu = gpu
        self.tape = tape
        self.source = module_source(tape, culls)
        ks = walker.kernels
        self.device = ks.device
        t0 = time.perf_counter()
        module = self.device.create_shader_module(label=f"baseline {tape.source}", code=self.source)
        self.pipeline = self.device.create_compute_pipeline(
            label="baseline", layout=ks.pipeline_layout, compute={"module": module, "entry_point": ENTRY})
        self.compile_seconds = time.perf_counter() - t0
        self._layout = ks.bind_group_layout
        self._bufs: dict[str, object] = {}
        self._group = None
        t0 = time.perf_counter()
        self.evaluate(np.zeros((1, 3), np.float32))
        self.first_dispatch_seconds = time.perf_counter() - t0

    def _buffer(self, name: str, nbytes: int, usage):
        """A buffer of at least ``nbytes`` (rebinding when it has to grow)."""
        nbytes = max(self._gpu.MIN_BUFFER, -(-nbytes // 16) * 16)
        buf = self._bufs.get(name)
        if buf is None or buf.size < nbytes:
            buf = self.device.create_buffer(label=f"baseline {name}", size=nbytes, usage=usage)
            self._bufs[name] = buf
            self._group = None
        return buf

    def _bind(self, n: int):
        import wgpu
        st = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST | wgpu.BufferUsage.COPY_SRC
        params = self._buffer("params", self.tape.params.nbytes, st)
        # shaders/bindings.wgsl, in binding order; bindings the layout adds later get small
        # storage buffers of their own (the baseline kernel does not touch them)
        names = ["instrs", "params", "materials", "instances", "bvh", "uniforms", "points", "out_f",
                 "out_u", "accum"]
        names += [f"binding{i}" for i in range(len(names), self._gpu.N_BINDINGS)]
        sizes = {"params": self.tape.params.nbytes, "uniforms": self._gpu.UNIFORM_BYTES, "points": 12 * n,
                 "out_f": 4 * n, "out_u": 4 * n}
        usage = {"uniforms": wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST}
        bufs = [self._buffer(k, sizes.get(k, 0), usage.get(k, st)) for k in names]
        if self._group is None:
            self._group = self.device.create_bind_group(
                layout=self._layout,
                entries=[{"binding": i, "resource": {"buffer": b, "offset": 0, "size": b.size}}
                         for i, b in enumerate(bufs)])
            self.device.queue.write_buffer(params, 0, self.tape.params.tobytes())
        return dict(zip(names, bufs))

    def dispatch(self, n: int) -> None:
        """Run the kernel over the ``n`` points already in the points buffer and wait for it."""
        gx_total = max(1, -(-n // self._gpu.WG))
        gx = min(gx_total, self._gpu.MAX_GROUPS_X)
        enc = self.device.create_command_encoder()
        cp = enc.begin_compute_pass()
        cp.set_pipeline(self.pipeline)
        cp.set_bind_group(0, self._group)
        cp.dispatch_workgroups(gx, -(-gx_total // gx), 1)
        cp.end()
        self.device.queue.submit([enc.finish()])
        self.device.queue.read_buffer(self._bufs["out_f"], 0, 4)   # waits for the dispatch

    def load_points(self, points) -> int:
        """Upload (N, 3) points and set the item count; returns N."""
        pts = np.ascontiguousarray(np.asarray(points, np.float32).reshape(-1, 3))
        n = len(pts)
        bufs = self._bind(n)
        u = np.zeros(self._gpu.UNIFORM_BYTES // 4, np.uint32)
        u[:2] = (len(self.tape), n)
        self.device.queue.write_buffer(bufs["uniforms"], 0, u.tobytes())
        self.device.queue.write_buffer(bufs["points"], 0, pts.tobytes())
        return n

    def evaluate(self, points) -> tuple[np.ndarray, np.ndarray]:
        """(N,) float32 distances and (N,) uint32 materials, like ``GpuWalker.evaluate``."""
        n = self.load_points(points)
        self.dispatch(n)
        q = self.device.queue
        d = np.frombuffer(q.read_buffer(self._bufs["out_f"], 0, 4 * n), np.float32).copy()
        m = np.frombuffer(q.read_buffer(self._bufs["out_u"], 0, 4 * n), np.uint32).copy()
        return d, m
