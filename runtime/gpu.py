"""The GPU walker: ``GpuWalker``, the tape on the fixed WGSL kernel set (wgpu).

Owns ``GpuWalker`` (the CpuWalker API plus ``upload`` / ``set_param``: edits are buffer writes of
the changed bytes, never compiles; a frame's passes go in one submission with one wait, and
march and light are resumed over several dispatches when a per-invocation iteration budget runs
out, and run their interpreter without material ids (the
pipeline constants of ``gpu_device.KERNEL_CONSTANTS``; a ``surface`` pass evaluates the hit's
material); a method that uses the device turns a device loss into ``GpuError``,
runtime/gpu_guard.py) and its dispatch plumbing, public where passes kept outside the walker
dispatch through it (``uniforms``, ``prepare_outputs``, ``encode``, ``submit``,
``check_counters``, ``run_and_read``, ``run_kernels``, ``write_points``, ``read_buffer``,
``read_output``; the buffers ``tape_buffers``, ``points_buffer``, ``out_f``, ``out_u``): the
walker's interval-pruned passes (pruned images, pruned point sets, march / light / render over
pruned cells of the march box: runtime/gpu_pruning.py's ``GpuPrunedPasses``, held as
``GpuWalker.pruned``, whose public names the walker serves as its own), the path tracer's
(runtime/path_tracing.py ``GpuPathTracer``) and ``GpuProfiler``'s. ``GpuProfiler`` times a
walker's passes for the benchmarks (GPU time without host work or read-back), from what
``GpuWalker.frame_plan`` and the pruned passes set up. The device, the kernel table, the pipeline
cache (each pipeline made when a pass first needs it) and its counters are runtime/gpu_device.py's.
The GPU's self-check against the twin is runtime/conformance.py's ``gpu_self_check``.
"""
from __future__ import annotations

import time

import numpy as np

from .camera import Camera, auto_camera
from .gpu_device import (adapter_info, Buffer, CELLS_KEEPING, COUNTERS_BYTES, GpuContext,
                         drop_context, get_adapter, get_context, GpuError, HARDWARE_ITER_BUDGET,
                         HARDWARE_ITER_CAP, kernels, KERNELS, KernelSet, MAX_GROUPS_X, MIN_BUFFER,
                         READ_STAGING_MIN, RESUMABLE, SOFTWARE_ITER_BUDGET, SOFTWARE_ITER_CAP,
                         UNIFORM_BYTES, UNIFORM_LEVEL_BYTE, variant_for, WG, load_wgpu, WORKGROUP_PER_ITEM)
from .gpu_guard import guarded
from .gpu_pruning import IMAGE_CELLS, LOWERED_CELLS, MARCH_CELLS, GpuPrunedPasses
from .pruning import PRUNE_MIN_RECORDS, cell_tape
from .shading import PACK_LEN, RenderSettings
from .tape import CellsTooLarge, Tape, TaperayError, VALIDATED, content_key, gradient_eps, point_array

__all__ = ["GpuWalker", "GpuProfiler", "GpuError", "KernelSet", "adapter_info", "kernels", "KERNELS", "IMAGE_CELLS"]


TAPE_ARRAYS = ("instrs", "params", "materials", "instances", "bvh")
COUNT_UNFINISHED = 1                    # bindings.wgsl: the counters' word of unfinished items


# ------------------------------------------------------------------------------------ walker
class _Pruned:
    """A name of ``GpuWalker`` served by its pruned passes (``walker.pruned``, a
    ``gpu_pruning.GpuPrunedPasses``): read and set there. On the class, the pruned passes'
    own (``GpuWalker.march_cells_for`` is ``GpuPrunedPasses.march_cells_for``)."""

    def __set_name__(self, owner, name: str):
        self.name = name

    def __get__(self, walker, owner=None):
        return getattr(GpuPrunedPasses if walker is None else walker.pruned, self.name)

    def __set__(self, walker, value):
        setattr(walker.pruned, self.name, value)


class GpuWalker:
    """The tape on the GPU: the same API and results as ``CpuWalker`` (float32), plus uploads.

    Every array returned is float32 / uint32 / int32 like the twin's. Tapes are validated, then
    uploaded as buffer writes of the bytes that changed; the kernels are the process's one set.
    The interval-pruned passes are ``self.pruned`` (``gpu_pruning.GpuPrunedPasses``), whose public
    methods, knobs and counters the walker serves as its own (``_Pruned``).
    """

    name = "gpu"
    capabilities = frozenset({"evaluate", "gradient", "render", "upload"})   # (runtime.walkers.CAPABILITIES)

    # served by self.pruned: pruned images, point sets and their diagnostics; the march cells
    sign_image, field_image_pruned, evaluate_pruned = _Pruned(), _Pruned(), _Pruned()
    prune_levels, prune_levels_points, image_cell_levels, march_cell_levels = _Pruned(), _Pruned(), _Pruned(), _Pruned()
    march_cells_for, path_cells, drop_kept_cells = _Pruned(), _Pruned(), _Pruned()
    # ... and their knobs (the arenas grown to after an overflow, ...) and counters
    arena_words, point_arena_words, cell_arena_words = _Pruned(), _Pruned(), _Pruned()
    wave_max_tiles, pixel_variant_cap, cells_too_large = _Pruned(), _Pruned(), _Pruned()
    image_cell_builds, march_cell_builds, register_refusals = _Pruned(), _Pruned(), _Pruned()

    def __init__(self, progress: bool = False, context: GpuContext | None = None):
        """``progress``: show the kernels' build on stderr when a request waits long for it.
        ``context``: the device context to run on (a ``gpu_device.GpuContext``; None: the
        process's, ``gpu_device.get_context``); after a device loss the walker moves to the
        process's new one."""
        self.context = context or get_context(progress)
        self._validated = VALIDATED
        self._counts = {"points_evaluated": 0, "images_rendered": 0, "waits": 0}
        self._bytes_read: dict[str, int] = {}   # by buffer label (_submit_and_read)
        self._dispatched: dict[str, int] = {}   # by kernel (encode)
        self.resumed_dispatches = 0
        self._finished_at_once = True        # the last resumable passes needed no resume (_dispatch)
        self._uploaded: int | None = None    # id() of the tape the buffers hold
        self._init_buffers()
        self.pruned = GpuPrunedPasses(self)

    def _init_buffers(self):
        """The walker's buffers, empty, on its context's device: ``tape_buffers`` (one per tape
        array), ``points_buffer``, ``out_f`` and ``out_u`` public (the passes that dispatch
        through the walker read and write them), the rest its own."""
        wgpu = load_wgpu()
        dev = self.context.device
        st = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST | wgpu.BufferUsage.COPY_SRC
        limit = self.context.limits["max_storage_buffer_binding_size"]
        self.tape_buffers = {n: Buffer(dev, st, n, limit) for n in TAPE_ARRAYS}
        self.points_buffer = Buffer(dev, st, "points", limit)
        self.out_f = Buffer(dev, st, "out_f", limit)
        self.out_u = Buffer(dev, st, "out_u", limit)
        self._accum = Buffer(dev, st, "accum", limit)
        self._uniform = Buffer(dev, wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST, "uniforms", limit)
        self._counters = Buffer(dev, st, "counters", limit)
        self._watched = Buffer(dev, wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST, "watched counts", limit)
        self._staging = None                 # _read's mappable buffer
        self._bind_group = None
        self._bind_key = None
        self._uploaded = None
        self.last_counters = np.zeros(COUNTERS_BYTES // 4, np.uint32)   # the last check_counters read
        self._rendered: set[int] = set()     # content keys of the scene tapes rendered (render)
        software = self.context.info["software"]
        self.iteration_limits = ((SOFTWARE_ITER_CAP, SOFTWARE_ITER_BUDGET) if software
                             else (HARDWARE_ITER_CAP, HARDWARE_ITER_BUDGET))

    def ensure_context(self):
        """After a device loss the process's context is rebuilt: pick it up, with new buffers
        (runtime.gpu_guard's ``guarded`` calls it before each device method)."""
        if self.context.dropped:
            self.context = get_context()
            self._init_buffers()
            self.pruned.reset()

    # -- facts
    @staticmethod
    def available() -> bool:
        """Whether a GPU adapter exists (lavapipe counts); building kernels is not attempted."""
        try:
            return get_adapter() is not None
        except ImportError:
            return False

    @property
    def adapter_name(self) -> str:
        return self.context.info["name"] + (" (software)" if self.context.info["software"] else "")

    @property
    def info(self) -> dict:
        return dict(self.context.info, limits=dict(self.context.limits))

    @property
    def device(self):
        """The wgpu device the walker's buffers and kernels live on (a viewer presents from it)."""
        return self.context.device

    @property
    def kernels(self) -> KernelSet:
        return self.context.kernels

    def stats(self) -> dict:
        """Kernel-cache counters plus the bytes this walker has written to tape buffers, and its
        ``points_evaluated`` (by ``evaluate``), ``images_rendered`` (by ``render`` and
        ``render_on_device``), ``waits`` (submissions waited for: each a round trip to the GPU),
        ``dispatches`` (the passes encoded, by pipeline: "kernel@variant", or "kernel" for the
        kernels of one pipeline),
        ``bytes_read`` (read back, by buffer: the tape arrays' names, "points", "out_f", "out_u",
        "counters", "watched counts" (run_kernels' ``watch``), a path image's "path sums"), ``bytes_compared`` (by
        buffer, each of the walker's: compared with its host copy to find the bytes to write; a
        frozen tape's array the buffer holds already is not), ``tape_buffer_bytes`` (each tape array's buffer
        size) and ``kept_cells`` (the pruned cells kept in out_u for the next frame or image:
        None, or their "kind" (frame, image, path) and, for an image's, its pixel pass's
        "variant")."""
        out = dict(self._counts, **self.context.kernels.stats.as_dict())
        out["pipelines"] = len(self.context.kernels)
        out["tape_bytes_written"] = self.tape_bytes_written
        out["bytes_read"] = dict(self._bytes_read)
        out["dispatches"] = dict(self._dispatched)
        out["bytes_compared"] = {b.label: b.bytes_compared for b in self._buffers()}
        out["tape_buffer_bytes"] = {n: b.capacity for n, b in self.tape_buffers.items()}
        out["kept_cells"] = self.pruned.kept_cells_facts()
        return out

    @property
    def tape_bytes_written(self) -> int:
        """The bytes written to the tape buffers so far (uploads and edits)."""
        return sum(b.bytes_written for b in self.tape_buffers.values())

    def _buffers(self) -> list[Buffer]:
        return [*self.tape_buffers.values(), self.points_buffer, self.out_f, self.out_u, self._accum, self._uniform,
                self._counters, self._watched]

    # -- tapes
    def _check(self, tape: Tape):
        self._validated.check(tape)
        variant = variant_for(tape.n_regs)
        limit = self.context.limits["max_storage_buffer_binding_size"]
        for name in TAPE_ARRAYS:
            nbytes = getattr(tape, name).nbytes
            if nbytes > limit:
                raise TaperayError(f"{tape.source or 'tape'}: {name} take {nbytes} bytes; the GPU binds at "
                                   f"most {limit} bytes per buffer")
        return variant

    @guarded
    def upload(self, tape: Tape) -> int:
        """Validate ``tape`` and make the GPU buffers hold it (writing only changed bytes).
        Returns the register variant its kernels use."""
        variant = self._check(tape)
        for name in TAPE_ARRAYS:
            self.tape_buffers[name].sync(getattr(tape, name))
        self._uploaded = id(tape)
        return variant

    @guarded
    def set_param(self, tape: Tape, name: str, value) -> None:
        """Set a named parameter on ``tape`` (``Tape.set_param``: refitting its bounds when it came
        from a scene); when ``tape`` is the one on the GPU, write just the 4 bytes of each slot
        holding it, or, when the refit changed more, the spans that differ (else the next use
        uploads the difference)."""
        refitted = tape.set_param(name, value)
        buf = self.tape_buffers["params"]
        if self._uploaded != id(tape):
            return
        if refitted or buf.mirror.size < tape.params.nbytes:
            self.upload(tape)
            return
        for slot in sorted(set(int(i) for i in tape.names[name])):
            chunk = tape.params[slot:slot + 1].view(np.uint8)
            buf.write(4 * slot, chunk)
            buf.mirror[4 * slot: 4 * slot + 4] = chunk

    @guarded
    def set_material(self, tape: Tape, name: str, **fields) -> None:
        """Set fields of the material ``name`` on ``tape`` (``Tape.set_material``); when ``tape`` is
        the one on the GPU, write the bytes of the records that changed (else the next use
        uploads them). No pipeline is made: the kernels read the materials buffer."""
        tape.set_material(name, **fields)
        if self._uploaded == id(tape):
            self.tape_buffers["materials"].sync(tape.materials)

    # -- dispatch plumbing; public where the pruned passes (gpu_pruning.GpuPrunedPasses), the path
    # tracer (path_tracing.GpuPathTracer) and GpuProfiler dispatch through it: uniforms,
    # prepare_outputs, encode, submit, check_counters / last_counters, run_and_read, read_output,
    # and below, run_kernels, write_points, read_buffer
    def _bind(self, accum: Buffer | None = None):
        """The bind group of the walker's buffers (accum: ``accum`` where given, a path image's sums)."""
        bufs = [self.tape_buffers[n].buffer for n in TAPE_ARRAYS] + [
            self._uniform.buffer, self.points_buffer.buffer, self.out_f.buffer, self.out_u.buffer,
            (accum or self._accum).buffer, self._counters.buffer]
        if self._bind_key is None or any(a is not b for a, b in zip(bufs, self._bind_key)):
            self._bind_group = self.context.device.create_bind_group(
                layout=self.context.kernels.bind_group_layout,
                entries=[{"binding": i, "resource": {"buffer": b, "offset": 0, "size": b.size}}
                         for i, b in enumerate(bufs)])
            self._bind_key = bufs         # (the buffers themselves, held: a freed one's id() may come again)
        return self._bind_group

    def uniforms(self, tape: Tape, n_items: int, width=0, height=0, sample=0, rect=(0, 0, 0, 0),
                  extra=(0, 0, 0, 0), camera=None, settings=None) -> np.ndarray:
        """The Uniforms struct (bindings.wgsl) as uint32 words; word 7 (resume) set per dispatch."""
        u = np.zeros(UNIFORM_BYTES // 4, np.uint32)
        u[:7] = (len(tape.instrs), n_items, width, height, sample, *self.iteration_limits)
        f = u.view(np.float32)
        f[8:12] = rect
        f[12:16] = extra
        if camera is not None:
            f[16:32] = camera
        if settings is not None:
            f[32:32 + PACK_LEN] = settings
        return u

    def prepare_outputs(self, n_f: int, n_u: int, n_accum: int = 0):
        limit = self.context.limits["max_storage_buffer_binding_size"]
        need = max(4 * n_f, 4 * n_u, 16 * n_accum)
        if need > limit:
            raise TaperayError(f"this request needs a {need >> 20} MiB GPU buffer; the adapter binds at most "
                               f"{limit >> 20} MiB (render a smaller image or use the CPU walker)")
        self.out_f.ensure(4 * max(n_f, 1))
        self.out_u.ensure(4 * max(n_u, 1))
        self._accum.ensure(16 * max(n_accum, 1))
        self.points_buffer.ensure(MIN_BUFFER)
        self._uniform.ensure(UNIFORM_BYTES)
        self._counters.ensure(COUNTERS_BYTES)

    def encode(self, passes: list[tuple], variant: int, uniforms: np.ndarray, resume: int = 0, repeat: int = 1,
               watch_resumable: bool = False):
        """Write the uniforms and zeroed counters; return the command buffer of the (kernel,
        n_items) passes, ``repeat`` times in a row (each repeat clears the counters first). With
        ``watch_resumable`` each resumable pass's unfinished count goes to the watched counts
        (the k-th such pass's to word k: its counters' word cleared before it, copied after). A pass
        (kernel, n_items, level) is preceded by copying ``level`` from the level table in the
        points buffer into U.extra.w (_pruned_setup writes the table); a pass (kernel, n_items,
        level or None, variant) runs in that register variant instead of ``variant``. Passes other than a
        frame's on cells may overwrite the pruned cells kept in out_u: they are forgotten
        (``pruned.drop_kept_cells``)."""
        if any(k not in CELLS_KEEPING for k, *_ in passes):
            self.pruned.drop_kept_cells()
        self.context.kernels.ensure([(kernel, (more + [None, None])[1] or variant) for kernel, _, *more in passes])
        dev = self.context.device
        uniforms[7] = resume
        self._uniform.write(0, uniforms)
        self._counters.write(0, np.zeros(COUNTERS_BYTES // 4, np.uint32))
        bg = self._bind()
        enc = dev.create_command_encoder()
        for r in range(repeat):
            if r:
                enc.clear_buffer(self._counters.buffer, 0, COUNTERS_BYTES)
            watched = 0
            for kernel, n, *more in passes:
                level, pass_variant = (more + [None, None])[:2]
                self._count_dispatch(kernel, pass_variant or variant)
                if level is not None:
                    enc.copy_buffer_to_buffer(self.points_buffer.buffer, 4 * level, self._uniform.buffer,
                                              UNIFORM_LEVEL_BYTE, 4)
                watch = watch_resumable and kernel in RESUMABLE
                if watch:
                    enc.clear_buffer(self._counters.buffer, 4 * COUNT_UNFINISHED, 4)
                groups = max(1, n if kernel in WORKGROUP_PER_ITEM else -(-n // WG))
                gx = min(groups, MAX_GROUPS_X)
                cp = enc.begin_compute_pass()
                cp.set_pipeline(self.context.kernels.pipeline(kernel, pass_variant or variant))
                cp.set_bind_group(0, bg)
                cp.dispatch_workgroups(gx, -(-groups // gx), 1)
                cp.end()
                if watch:
                    enc.copy_buffer_to_buffer(self._counters.buffer, 4 * COUNT_UNFINISHED, self._watched.buffer,
                                              4 * watched, 4)
                    watched += 1
        return enc.finish()

    def _count_dispatch(self, kernel: str, variant: int | None):
        label = f"{kernel}@{variant}" if KERNELS[kernel][1] else kernel
        self._dispatched[label] = self._dispatched.get(label, 0) + 1

    def submit(self, passes: list[tuple], variant: int, uniforms: np.ndarray, resume: int = 0):
        """Submits the passes ``encode`` writes, without waiting (check_counters waits)."""
        self.context.device.queue.submit([self.encode(passes, variant, uniforms, resume)])

    def _dispatch(self, tape: Tape, passes: list[tuple[str, int]], variant: int, uniforms: np.ndarray,
                  read: tuple | None = None) -> np.ndarray | None:
        """Run the (kernel, n_items) passes in order and return ``read`` (as _submit_and_read's)
        read back after them. Passes with a resumable one (march, light) among them are first
        run all in one submission with one wait, where the last such call finished every pixel
        and the sample is the first (it writes the accumulator, later samples add to it); if a
        resumable pass left pixels unfinished there, they run again as below. Otherwise each
        resumable pass runs in one submission with the passes before it, then alone (resume
        set) until no pixel is unfinished, a wait after each submission. An evaluation that hit
        the iteration cap is a TaperayError naming the tape. The pipelines of every pass are
        made first, in parallel."""
        self.context.kernels.ensure([(kernel, variant) for kernel, _ in passes])
        resumable = sum(kernel in RESUMABLE for kernel, _ in passes)
        if resumable and self._finished_at_once and uniforms[4] == 0:
            self._watched.ensure(4 * resumable)
            reads = [(self._counters, np.uint32, COUNTERS_BYTES // 4, 0), (self._watched, np.uint32, resumable, 0)]
            out = self._submit_and_read([self.encode(passes, variant, uniforms, watch_resumable=True)],
                                        *reads, *([read] if read is not None else []))
            self._counters_checked(tape, out[0])
            if not out[1].any():
                return out[2] if read is not None else None
        self._finished_at_once = True
        batch: list[tuple[str, int]] = []
        for kernel, n in passes:
            batch.append((kernel, n))
            if kernel not in RESUMABLE:
                continue
            resume = 0
            while True:
                self.submit(batch, variant, uniforms, resume)
                if self.check_counters(tape) == 0:
                    break
                batch, resume = [(kernel, n)], 1
                self.resumed_dispatches += 1
                self._finished_at_once = False
            batch = []
        if batch and read is not None:
            return self.run_and_read(tape, batch, variant, uniforms, read)
        if batch:
            self.submit(batch, variant, uniforms, 0)
            self.check_counters(tape)
        return None if read is None else self._read(*read)

    def check_counters(self, tape: Tape) -> int:
        """Waits for the GPU; raises on overflow; returns the unfinished pixel count. The counters
        read stay in ``last_counters`` (the pruning passes' words: prune.wgsl's, named in gpu_pruning)."""
        return self._counters_checked(tape, self._read(self._counters, np.uint32, COUNTERS_BYTES // 4))

    def _counters_checked(self, tape: Tape, c: np.ndarray) -> int:
        """check_counters on counters ``c`` read back."""
        self.last_counters = c
        if c[0]:
            raise TaperayError(
                f"{tape.source or 'tape'}: one evaluation of this tape needs more than {self.iteration_limits[0]} "
                f"interpreter steps, the most this GPU adapter ({self.context.info['name']}) runs per "
                f"invocation ({int(c[0])} evaluations stopped); use the CPU walker")
        return int(c[1])

    def _read(self, buf: Buffer, dtype, count: int, offset_items: int = 0) -> np.ndarray:
        """``count`` items of ``dtype`` (4-byte) from ``buf``, waiting for the GPU: copied into a
        mappable staging buffer kept by the walker (grown by doubling; wgpu's queue.read_buffer
        creates and destroys one per call), mapped and copied out."""
        if count == 0:
            return np.zeros(0, dtype)
        return self._submit_and_read([], (buf, dtype, count, offset_items))[0]

    @guarded
    def read_output(self, which: str, count: int, offset: int = 0) -> np.ndarray:
        """``count`` words of an output buffer from word ``offset``, as the last pass left them:
        "f" (out_f, float32: point values, march results, an image's values) or "u" (out_u,
        uint32: march results, pruned tiles' and cells' headers and tapes, a sign image's bits).
        For diagnostics of the passes (tests read the pruned headers and arenas)."""
        if which not in ("f", "u"):
            raise TaperayError(f"read_output: which is 'f' or 'u', got {which!r}")
        return self._read(self.out_f if which == "f" else self.out_u,
                          np.float32 if which == "f" else np.uint32, count, offset)

    def _submit_and_read(self, commands: list, *reads: tuple) -> list[np.ndarray]:
        """Submit the command buffers ``commands``, then copy each read (buffer, dtype, count,
        offset in items; 4-byte items) into the staging buffer and wait for it, once: the arrays
        read, in order."""
        wgpu = load_wgpu()
        dev = self.context.device
        sizes = [count * np.dtype(dtype).itemsize for _, dtype, count, _ in reads]
        self._counts["waits"] += 1
        for (buf, *_), size in zip(reads, sizes):
            self._bytes_read[buf.label] = self._bytes_read.get(buf.label, 0) + size
        nbytes = sum(sizes)
        if self._staging is None or self._staging.size < nbytes:
            size = max(READ_STAGING_MIN, self._staging.size if self._staging is not None else 0)
            while size < nbytes:
                size *= 2
            self._staging = dev.create_buffer(label="read-back", size=size,
                                              usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)
        enc = dev.create_command_encoder()
        at = 0
        for (buf, dtype, count, offset_items), size in zip(reads, sizes):
            enc.copy_buffer_to_buffer(buf.buffer, offset_items * np.dtype(dtype).itemsize, self._staging, at, size)
            at += size
        dev.queue.submit(commands + [enc.finish()])
        self._staging.map_sync(wgpu.MapMode.READ, 0, nbytes)
        try:
            mapped = self._staging.read_mapped(0, nbytes, copy=False)
            out, at = [], 0
            for (_, dtype, count, _), size in zip(reads, sizes):
                out.append(np.frombuffer(mapped, dtype, count, at).copy())
                at += size
            return out
        finally:
            self._staging.unmap()

    def run_and_read(self, tape: Tape, passes: list[tuple], variant: int, uniforms: np.ndarray,
                      read: tuple) -> np.ndarray:
        """Non-resumable ``passes`` and the read-back of ``read`` (as _submit_and_read's) in one
        submission and one wait, the counters read and checked with it (check_counters): what
        a pruned image reads, without a wait between its pixel pass and its bits."""
        counters, data = self._submit_and_read([self.encode(passes, variant, uniforms, 0)],
                                               (self._counters, np.uint32, COUNTERS_BYTES // 4, 0), read)
        self._counters_checked(tape, counters)
        return data

    def device_lost(self, e: Exception):
        """A driver / wgpu failure ``e``: drop the process's context (the next call rebuilds it)
        and raise GpuError (a TaperayError the command line falls back on); runtime.gpu_guard's
        ``guarded`` calls it."""
        drop_context(self.context)
        raise GpuError(f"the GPU failed ({self.context.info['name']}): {e}") from e

    def _run_points(self, tape: Tape, points: np.ndarray, kernel: str, per_point: int,
                    out_dtypes: tuple, extra=(0, 0, 0, 0)) -> list[np.ndarray]:
        """Run a point kernel (``per_point`` items per point) in chunks that fit the binding
        limit; returns, per dtype in ``out_dtypes`` (out_f, out_u), the concatenated outputs."""
        variant = self.upload(tape)
        pts = np.ascontiguousarray(np.asarray(points, np.float32).reshape(-1, 3))
        limit = self.context.limits["max_storage_buffer_binding_size"]
        chunk = max(1, min(limit // 12, limit // (4 * per_point)))
        outs: list[list[np.ndarray]] = [[] for _ in out_dtypes]
        for s in range(0, len(pts), chunk):
            part = pts[s:s + chunk]
            n_items = per_point * len(part)
            self.prepare_outputs(n_items, n_items)
            self.points_buffer.sync(part)
            self._dispatch(tape, [(kernel, n_items)], variant, self.uniforms(tape, n_items, extra=extra))
            for o, (buf, dtype) in zip(outs, zip((self.out_f, self.out_u), out_dtypes)):
                o.append(self._read(buf, dtype, n_items))
        return [np.concatenate(o) for o in outs]

    # -- the CpuWalker API
    @guarded
    def evaluate(self, tape: Tape, points) -> tuple[np.ndarray, np.ndarray]:
        """(N,) float32 distances and (N,) uint32 material ids at the (N, 3) points."""
        pts = point_array(points, "evaluate")
        self._counts["points_evaluated"] += len(pts)
        if len(pts) == 0:
            self.upload(tape)
            return np.zeros(0, np.float32), np.zeros(0, np.uint32)
        d, m = self._run_points(tape, pts, "eval_points", 1, (np.float32, np.uint32))
        return d, m

    @guarded
    def gradient(self, tape: Tape, points, eps: float | None = None) -> np.ndarray:
        """(N, 3) float32 central differences; eps defaults to 1e-3 of the bounds diagonal."""
        pts = point_array(points, "gradient", np.float32)
        e = gradient_eps(tape, eps)
        n = len(pts)
        if n == 0:
            self.upload(tape)
            return np.zeros((0, 3), np.float32)
        (d,) = self._run_points(tape, pts, "gradient_points", 6, (np.float32,), extra=(0, e, 0, 0))
        d = d.reshape(n, 6)
        return ((d[:, :3] - d[:, 3:]) / (np.float32(2) * e)).astype(np.float32)

    @guarded
    def field_image(self, tape: Tape, width: int, height: int, rect=(-1.0, 1.0, -1.0, 1.0),
                    z: float = 0.0) -> np.ndarray:
        """(H, W) float32 field on the plane z = const; rect = (x0, x1, y0, y1); pixel centres;
        row 0 is y = y1 (the top), column 0 is x = x0."""
        if width < 1 or height < 1:
            raise TaperayError(f"field_image: size {width}x{height} must be at least 1x1")
        variant = self.upload(tape)
        n = width * height
        self.prepare_outputs(n, 1)
        u = self.uniforms(tape, n, width, height, rect=[float(v) for v in rect], extra=(z, 0, 0, 0))
        self._dispatch(tape, [("field_image", n)], variant, u)
        return self._read(self.out_f, np.float32, n).reshape(height, width)

    def _image_setup(self, tape: Tape, camera: Camera | None, width: int, height: int,
                     settings: RenderSettings | None, view: str):
        if width < 1 or height < 1:
            raise TaperayError(f"image size {width}x{height} must be at least 1x1")
        settings = settings or RenderSettings()
        packed = settings.pack(tape, view)
        camera = camera or auto_camera(tape.bounds)
        variant = self.upload(tape)
        n = width * height
        self.prepare_outputs(8 * n, 9 * n, n)
        return camera, packed, variant, n

    def _frame(self, tape: Tape, camera: Camera | None, width: int, height: int,
               settings: RenderSettings | None, view: str, passes: list[str], cells, samples: int = 1,
               final: tuple[str, ...] = (), read: tuple | None = None) -> tuple[Camera, np.ndarray | None]:
        """Dispatches ``passes`` (kernel names, n pixels each) for each of ``samples`` jittered
        samples (the first the pixel centre, as the twin renders), then the ``final`` passes; on
        the pruned cell tapes when march_cells_for(tape, cells) says so (pruned before the first
        sample, or kept from the last frame of the same tape bytes, settings and size while no
        other pass has run: a camera that moves re-uses them). Returns the camera used and
        ``read`` (as _submit_and_read's) read back with the last submission (None without)."""
        camera, packed, variant, n = self._image_setup(tape, camera, width, height, settings, view)
        frame = [(k, n) for k in passes]
        cells = self.pruned.march_cells_for(tape, cells) if any(k in ("march", "light") for k in passes) else None
        desc = None
        if cells is not None:
            desc = self.pruned.frame_cells(tape, packed, variant, n, cells)
            frame = self.pruned.on_cells(tape, frame)
        rng = np.random.default_rng(0)
        for s in range(samples):
            jitter = (0.0, 0.0) if s == 0 else tuple(rng.uniform(-0.5, 0.5, 2))
            u = self.uniforms(tape, n, width, height, sample=s, extra=(0, 0, *jitter),
                               camera=camera.pack(), settings=packed)
            if desc is not None:
                u[12] = desc                # U.extra.x: the bits of the cell descriptor's word
            last = s == samples - 1
            data = self._dispatch(tape, frame + ([(k, n) for k in final] if last else []), variant, u,
                                  read if last else None)
        return camera, data

    @guarded
    def march(self, tape: Tape, camera: Camera, width: int, height: int,
              settings: RenderSettings | None = None, view: str = "shade", cells="auto") -> dict:
        """Primary rays by the camera's pixel convention: t (H,W) f32 (inf = miss), hit, steps int32,
        mat uint32, grad (H,W,3) f32 (field gradient at the hit), normal, dirs, eye. ``cells``
        (None, "auto" or (g0, levels)): an arithmetic tape is marched on its pruned cell tapes
        (packed.wgsl cell_eval; the same bits)."""
        camera, _ = self._frame(tape, camera, width, height, settings, view, ["march", "surface"], cells)
        return self._march_result(camera, width, height)

    def _march_result(self, camera: Camera, width: int, height: int) -> dict:
        n = width * height
        f = self._read(self.out_f, np.float32, 4 * n).reshape(height, width, 4)
        u = self._read(self.out_u, np.uint32, 4 * n).reshape(height, width, 4)
        g = np.ascontiguousarray(f[..., 1:4])
        norm = np.linalg.norm(g, axis=-1, keepdims=True)
        eye, dirs = camera.rays(width, height)
        return dict(t=np.ascontiguousarray(f[..., 0]), hit=u[..., 2] != 0, steps=u[..., 0].astype(np.int32),
                    mat=np.ascontiguousarray(u[..., 1]), grad=g,
                    normal=np.where(norm > 0, g / np.where(norm > 0, norm, 1), 0).astype(np.float32),
                    dirs=dirs, eye=eye)

    @guarded
    def light(self, tape: Tape, camera: Camera, width: int, height: int,
              settings: RenderSettings | None = None, view: str = "shade", cells="auto") -> dict:
        """March, then the key light's visibility and ambient occlusion: the march dict plus
        shadow and ao (H, W) float32 (1 on misses). ``cells`` as march."""
        camera, _ = self._frame(tape, camera, width, height, settings, view, ["march", "surface", "light"], cells)
        n = width * height
        out = self._march_result(camera, width, height)
        sa = self._read(self.out_f, np.float32, 4 * n, 4 * n).reshape(height, width, 4)
        out["shadow"], out["ao"] = np.ascontiguousarray(sa[..., 0]), np.ascontiguousarray(sa[..., 1])
        return out

    @guarded
    def render(self, tape: Tape, camera: Camera | None, width: int, height: int, view: str = "shade",
               settings: RenderSettings | None = None, samples: int = 1, cells="auto") -> np.ndarray:
        """(H, W, 3) uint8 image of ``view`` (one of shading.VIEWS). ``samples`` > 1 accumulates
        jittered sub-pixel samples (the first is the pixel centre, as the twin renders).
        ``cells`` as march; a scene tape that is not arithmetic is rendered on cells too, as its
        lowering to arithmetic where it has one (``render_tape``), or by its own records where the
        lowered tape's cells exceed the adapter's binding limit. With ``cells`` "auto" a scene
        tape is lowered from its second render on: the first frame comes at once, on its own
        records (the lowering is not made for it), and the lowering (host work, and cells to
        build) pays off over the frames that follow, as while the camera moves. A slider's move
        is a new content, drawn on its own records: its lowering and cells cost more than they
        save on one frame (docs/VIEWER.md)."""
        rgb = self._render(tape, camera, width, height, view, settings, samples, cells, read=True)
        n = width * height
        return rgb.view(np.uint8)[:3 * n].reshape(height, width, 3)

    @guarded
    def render_on_device(self, tape: Tape, camera: Camera | None, width: int, height: int, view: str = "shade",
                         settings: RenderSettings | None = None, samples: int = 1, cells="auto"):
        """``render`` without the read-back: the image stays on the GPU, as its RGB bytes packed
        into 32-bit words (pixel i's channel c is byte 3 i + c), in the returned (wgpu buffer,
        byte offset). The buffer is the walker's and holds the image until its next call; a
        viewer presents it from there (tools/view_window.py)."""
        self._render(tape, camera, width, height, view, settings, samples, cells, read=False)
        return self.out_u.buffer, 32 * width * height

    def _render(self, tape: Tape, camera: Camera | None, width: int, height: int, view: str,
                settings: RenderSettings | None, samples: int, cells, read: bool) -> np.ndarray | None:
        """The passes of ``render``; the packed RGB words read back when ``read``."""
        if samples < 1:
            raise TaperayError(f"render: samples must be >= 1, got {samples}")
        self._counts["images_rendered"] += 1
        run = self.render_tape(tape, view, cells) if not isinstance(cells, str) or self._rendered_before(tape) \
            else tape
        n = width * height
        rgb_words = (self.out_u, np.uint32, (3 * n + 3) // 4, 8 * n)     # (resolve packs RGB bytes)
        for run, run_cells in self._render_plans(tape, run, cells):
            try:
                return self._frame(run, camera, width, height, settings, view, _view_passes(view), run_cells,
                                   samples, final=("resolve",), read=rgb_words if read else None)[1]
            except CellsTooLarge:
                if run is tape:
                    raise
                self.cells_too_large.add((content_key(run), run_cells))

    # -- dispatch for passes kept outside the walker (runtime/path_tracing.py's GpuPathTracer)
    @guarded
    def run_kernels(self, tape: Tape, kernels: list[str], variant: int | None, uniforms: np.ndarray,
                    accum: Buffer | None = None, watch: str | None = None, read: tuple[str, int] | None = None,
                    check: bool = True) -> tuple[np.ndarray | None, np.ndarray, np.ndarray | None]:
        """One submission of ``kernels`` in order, each over ``uniforms``' item count (word 1, a
        thread an item) in register ``variant``, with ``uniforms`` written and accum bound to
        ``accum`` (a buffer on this walker's device, e.g. a path image's sums) where given, and
        one wait. With ``check`` the counters are zeroed first, read back and checked (an
        evaluation past the iteration cap is a TaperayError naming ``tape``); before each
        ``watch`` pass the counters' unfinished word is zeroed and after it copied out. ``read``
        ("f" or "u", count: out_f's or out_u's first words) is read back with it. Returns (the
        counters or None, the unfinished word after each ``watch`` pass, what ``read`` read or
        None)."""
        self._uniform.write(0, uniforms)
        if check:
            self._counters.write(0, np.zeros(COUNTERS_BYTES // 4, np.uint32))
        bg = self._bind(accum)
        enc = self.context.device.create_command_encoder()
        groups = max(1, -(-int(uniforms[1]) // WG))
        gx = min(groups, MAX_GROUPS_X)
        watched = kernels.count(watch) if watch is not None else 0
        if watched:
            self._watched.ensure(4 * watched)
        done = 0
        for kernel in kernels:
            if kernel == watch:
                enc.clear_buffer(self._counters.buffer, 4 * COUNT_UNFINISHED, 4)
            self._count_dispatch(kernel, variant)
            cp = enc.begin_compute_pass()
            cp.set_pipeline(self.context.kernels.pipeline(kernel, variant))
            cp.set_bind_group(0, bg)
            cp.dispatch_workgroups(gx, -(-groups // gx), 1)
            cp.end()
            if kernel == watch:
                enc.copy_buffer_to_buffer(self._counters.buffer, 4 * COUNT_UNFINISHED, self._watched.buffer,
                                          4 * done, 4)
                done += 1
        reads = [(self._counters, np.uint32, COUNTERS_BYTES // 4, 0)] if check else []
        if watched:
            reads.append((self._watched, np.uint32, watched, 0))
        if read is not None:
            reads.append((self.out_f, np.float32, read[1], 0) if read[0] == "f" else (self.out_u, np.uint32, read[1], 0))
        out = self._submit_and_read([enc.finish()], *reads)
        counters = out.pop(0) if check else None
        live = out.pop(0) if watched else np.zeros(0, np.uint32)
        if check:
            self._counters_checked(tape, counters)
        return counters, live, (out[0] if read is not None else None)

    def write_points(self, words: np.ndarray) -> None:
        """Make the points buffer hold ``words`` (4-byte items; only changed bytes are written)."""
        self.points_buffer.sync(words)

    @guarded
    def read_buffer(self, buf: Buffer, dtype, count: int, offset_items: int = 0) -> np.ndarray:
        """``count`` 4-byte items of ``dtype`` from ``buf`` (one of this walker's device's
        buffers, e.g. a path image's sums), waiting for the GPU."""
        return self._read(buf, dtype, count, offset_items)

    def _render_plans(self, tape: Tape, run: Tape, cells) -> list[tuple[Tape, object]]:
        """The (tape, cells) a render tries in turn: the lowered tape ``run`` on LOWERED_CELLS,
        then on MARCH_CELLS (with "auto"; those whose cells were too large for ``run`` before
        left out), then the scene's own records; or (run, cells) alone."""
        if run is tape:
            return [(tape, cells)]
        tries = [LOWERED_CELLS, MARCH_CELLS] if isinstance(cells, str) else [cells]
        key = content_key(run)
        return [(run, c) for c in tries if (key, c) not in self.cells_too_large] + [(tape, cells)]

    def _rendered_before(self, tape: Tape) -> bool:
        """Whether a tape of this content was rendered before by this walker (and note it)."""
        key = content_key(tape)
        seen = key in self._rendered
        if len(self._rendered) > 64:
            self._rendered.clear()
        self._rendered.add(key)
        return seen

    @staticmethod
    def render_tape(tape: Tape, view: str = "shade", cells="auto") -> Tape:
        """The tape ``render`` runs for ``tape`` (with "auto", from the second render of its
        content on): itself, or, for a scene tape of at least pruning.PRUNE_MIN_RECORDS records
        with march cells on (``cells`` not None) and a view that marches, its lowering to
        arithmetic (pruning.cell_tape, runtime.lowering: the plain union of its primitives,
        without cull boxes), whose cells prune it."""
        if cells is None or view == "slice" or len(tape.instrs) < PRUNE_MIN_RECORDS:
            return tape
        return cell_tape(tape) or tape      # (an arithmetic tape is its own cell tape)


    def frame_plan(self, tape: Tape, camera: Camera | None, width: int, height: int, view: str = "shade",
                   cells="auto", settings: RenderSettings | None = None) -> tuple:
        """One sample of render(``view``, ``settings``) set up, not run (GpuProfiler.frame_seconds
        times it): (the tape it runs (render_tape, with the cells render would use), the register
        variant, the passes (march ... resolve; on the pruned cells where the frame prunes) and
        their uniforms, and the (passes, uniforms) that pruned the march cells just now, or None
        where the frame is not pruned)."""
        run = self.render_tape(tape, view, cells)
        if run is not tape and isinstance(cells, str):
            cells = next(c for r, c in self._render_plans(tape, run, cells) if r is run)
        camera, packed, variant, n = self._image_setup(run, camera, width, height, settings, view)
        frame = [(k, n) for k in _view_passes(view) + ["resolve"]]
        u = self.uniforms(run, n, width, height, camera=camera.pack(), settings=packed)
        cells = self.pruned.march_cells_for(run, cells) if view != "slice" else None
        if cells is None:
            return run, variant, frame, u, None
        desc, passes, cu = self.pruned.march_cell_passes(run, packed, variant, n, cells)
        u[12] = desc                        # U.extra.x: the bits of the cell descriptor's word
        return run, variant, self.pruned.on_cells(run, frame), u, (passes, cu)


# ------------------------------------------------------------------------------------ timers
class GpuProfiler:
    """GPU time of a ``GpuWalker``'s passes, without host work or read-back, for the benchmarks
    (tools/bench_gpu.py, bench_prune_gpu.py): ``image_seconds`` (a 2D image, unpruned, pruned
    over tiles or on flat cells, or their pruning passes alone), ``frame_seconds`` (a render
    sample and its march cells' pruning) and ``points_seconds`` (a point evaluation, pruned or
    not). Each encodes the passes once, and ``repeat`` times in a row in one command buffer,
    submits each and waits: (t_repeat - t_1) / (repeat - 1)."""

    def __init__(self, walker: GpuWalker):
        self.walker = walker

    def _time_passes(self, tape: Tape, passes: list[tuple], variant: int, uniforms: np.ndarray,
                     repeat: int) -> float:
        """GPU seconds of one run of ``passes``: encoded once and ``repeat`` times in a row, one
        command buffer each, submitted and waited for (after a warm-up of the single one):
        (t_repeat - t_1) / (repeat - 1)."""
        w = self.walker

        def run(k: int) -> float:
            cb = w.encode(passes, variant, uniforms, 0, repeat=k)
            t0 = time.perf_counter()
            w.context.device.queue.submit([cb])
            w.check_counters(tape)
            return time.perf_counter() - t0

        run(1)
        t1 = run(1)
        return max(run(repeat) - t1, 0.0) / (repeat - 1)

    @guarded
    def image_seconds(self, tape: Tape, width: int, height: int, rect=(-1.0, 1.0, -1.0, 1.0), z: float = 0.0,
                      tiles=None, sign: bool = False, repeat: int = 8, tile_passes_only: bool = False,
                      levels: int | None = None, cells=None) -> float:
        """GPU time of one image, without host work or reading it back: the image's passes are
        encoded once, and ``repeat`` times in a row, as one command buffer each; each is then
        submitted and waited for; returns (t_repeat - t_1) / (repeat - 1). ``tiles`` None: the
        unpruned field_image kernel; else the pruned image (``sign`` as sign_image), or with
        ``tile_passes_only`` its prune_tiles passes alone (with ``levels``, only those of the first
        ``levels`` tile levels). ``cells`` (g0, levels): the image on kept flat cells (sign_image's
        ``cells``: the cells_image pass), or with ``tile_passes_only`` the passes that prune them."""
        w = self.walker
        if repeat < 2:
            raise TaperayError(f"image_seconds: repeat must be >= 2, got {repeat}")
        if cells is None and tiles is None:
            variant = w.upload(tape)
            n = width * height
            w.prepare_outputs(n, 1)
            u = w.uniforms(tape, n, width, height, rect=[float(v) for v in rect], extra=(z, 0, 0, 0))
            passes = [("field_image", n)]
        else:
            variant, passes, u = w.pruned.image_passes(tape, width, height, rect, z, tiles, cells, sign,
                                                       tile_passes_only, levels)
        return self._time_passes(tape, passes, variant, u, repeat)

    @guarded
    def frame_seconds(self, tape: Tape, camera: Camera | None, width: int, height: int, view: str = "shade",
                      cells="auto", repeat: int = 8, settings: RenderSettings | None = None,
                      time_cells: bool = True) -> dict:
        """GPU time of one sample of render(``view``, ``settings``) (of its render_tape, on the
        cells render would use), as image_seconds ((t_K - t_1) / (K - 1), K = ``repeat`` runs encoded in one
        command buffer; no host work or read-back): "cells", the
        prune_cells passes over the march cells (0 when the frame is not pruned or ``time_cells``
        is off: they take seconds a run on a software adapter), and "frame",
        the frame's passes (march, light, shade, resolve). A frame that needs more than one
        dispatch (march / light's iteration budget) is a TaperayError."""
        w = self.walker
        if repeat < 2:
            raise TaperayError(f"frame_seconds: repeat must be >= 2, got {repeat}")
        tape, variant, frame, u, pruning = w.frame_plan(tape, camera, width, height, view, cells, settings)
        out = {"cells": 0.0}
        if pruning is not None and time_cells:
            out["cells"] = self._time_passes(tape, pruning[0], variant, pruning[1], repeat)
        w.submit(frame, variant, u)
        if w.check_counters(tape):
            raise TaperayError(f"frame_seconds: a {width}x{height} {view} frame of {tape.source or 'tape'} "
                               "needs more than one dispatch on this adapter")
        out["frame"] = self._time_passes(tape, frame, variant, u, repeat)
        return out

    @guarded
    def points_seconds(self, tape: Tape, points, pruned: bool = True, cells: int | None = None,
                       levels: int = 1, repeat: int = 8) -> float:
        """GPU time of one evaluation of (at most one chunk of) points, as image_seconds: the passes
        (pruned: the cell levels and pruned_points, after one evaluate_pruned that sizes the arena;
        else eval_points) encoded ``repeat`` times in one command buffer, (t_repeat - t_1) /
        (repeat - 1); no host bucketing, upload or read-back."""
        w = self.walker
        if repeat < 2:
            raise TaperayError(f"points_seconds: repeat must be >= 2, got {repeat}")
        pts = w.pruned.checked_chunk(points, cells, levels, "points_seconds")
        n = len(pts)
        if pruned:
            variant, passes, u = w.pruned.points_passes(tape, pts, cells, levels)
        else:
            variant = w.upload(tape)
            w.prepare_outputs(n, n)
            w.write_points(pts)
            u = w.uniforms(tape, n)
            passes = [("eval_points", n)]
        return self._time_passes(tape, passes, variant, u, repeat)


def _view_passes(view: str) -> list[str]:
    """The kernels of one sample of ``view`` (resolve follows the last sample)."""
    if view == "slice":
        return ["slice"]
    if view in ("shade", "section"):
        return ["march", "surface", "light", "shade"]
    return ["march", "shade"]   # the other views' colours do not read the material
