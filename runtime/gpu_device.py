"""The GPU device layer: the device on runtime.gpu_adapter's adapter, the fixed kernel table and
the pipeline cache, and the buffers the walkers dispatch on.

Owns the pipeline cache keyed by (kernel, register variant) (``KernelSet``: each pipeline
created at most once per process, when a request first needs it, the request's missing ones in
parallel through ``create_compute_pipeline_async`` from worker threads, since wgpu-native resolves
that call synchronously; on hardware each is also dispatched once, empty, so lazy drivers compile
in those threads, see ``_warm_policy``; after the first request the rest are queued in the
background unless ``build_in_background(False)``; hit / miss / creation counters; a progress
line for a long wait moves by the clock, predicted from the kernels' sizes and a per-thread
compile rate, a default per adapter kind, then learnt per machine in
``~/.cache/taperay/compile_rate.json``), the process's one device context (``get_context``,
``current_context``) and the storage buffers written by the bytes that changed (``Buffer``).
wgpu-py exposes no pipeline cache to persist across processes (wgpu-native's header has the
feature flag but no call to make one); drivers keep their own shader caches.

Shader text is only ever the committed files of ``shaders/`` concatenated in a fixed order (the
generated headers, one register-capacity file, the bindings, the interpreter, a kernel file); no
WGSL is formatted here and nothing a scene contains reaches shader text.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import queue
import sys
import threading
import time
import weakref
from concurrent.futures import Future, wait
from dataclasses import dataclass

import numpy as np

from .opcodes import REG_CAPS
from .shading import PACK_LEN
from .tape import TaperayError
from .gpu_adapter import DEVICE_LIMITS, get_adapter, load_wgpu, adapter_info, take_device
from .jit_cache import user_cache_dir
from .wgsl_header import HEADER_NAME, RENDER_NAME, SHADER_DIR, regcap_name

WG = 64                       # workgroup size (bindings.wgsl)
MAX_GROUPS_X = 65535          # dispatches beyond this many workgroups go 2D
UNIFORM_BYTES = 32 + 16 + 16 + 64 + 4 * PACK_LEN   # bindings.wgsl: struct Uniforms
MIN_BUFFER = 256
READ_STAGING_MIN = 1 << 16    # bytes of _read's first staging buffer
COUNTERS_BYTES = 64           # bindings.wgsl: counters (overflow, unfinished, prune.wgsl's four, path.wgsl's
                              # one, nine unused)
N_BINDINGS = 11
CELLS_KEEPING = ("march_cells", "light_cells", "surface", "surface_cells", "shade", "resolve",  # passes that
                 "cells_image")                                        # leave the pruned cells in out_u alone
WORKGROUP_PER_ITEM = ("prune_wave", "prune_wave_cells")   # kernels dispatched a workgroup per item (tile)
RESUMABLE = ("march", "light", "march_cells", "light_cells")   # kernels that save their state and are
                                                                 # dispatched until done
# the path tracer (path.wgsl): a sample's first kernel, then rounds of a trace kernel (each path
# to its end, or to U.iter_budget where it saves its state and goes on in the next round; on the
# tape's records or, _cells, on its pruned cells' tapes) and path_accumulate (adds the ended
# paths and counts the rest) until no path is left; tonemap draws the picture of the sums
PATH_GENERATE, PATH_ACCUMULATE, PATH_TONEMAP = "path_generate", "path_accumulate", "path_tonemap"
PATH_TRACE, PATH_TRACE_CELLS = "path_trace", "path_trace_cells"
PATH_F_WORDS, PATH_U_WORDS = 36, 6      # path.wgsl: a path's state, floats in out_f and words in out_u
# Loop-iteration limits per invocation (bindings.wgsl: U.iter_cap, U.iter_budget). Mesa's gallivm
# (lavapipe / llvmpipe) stops every kernel's loops after 65535 iterations in all, so a software
# adapter gets a cap below that (an evaluation needing more is refused as overflow) and a budget
# after which march / light resume in the next dispatch; hardware gets no cap and a budget that
# keeps each dispatch short (watchdogs).
SOFTWARE_ITER_CAP, SOFTWARE_ITER_BUDGET = 60_000, 40_000
HARDWARE_ITER_CAP, HARDWARE_ITER_BUDGET = 0xFFFFFFFF, 1 << 22

# U.extra.w's byte in the uniforms: the level each prune_tiles pass works on (GpuWalker.encode copies it in).
UNIFORM_LEVEL_BYTE = 60

# kernel -> (kernel file, built per register variant). Tape-free kernels get one pipeline. A file
# "a+b" is a's text, then b's (the path kernels reuse the render kernels' march functions).
KERNELS: dict[str, tuple[str, bool]] = {
    "eval_points": ("kernels_points.wgsl", True),
    "gradient_points": ("kernels_points.wgsl", True),
    "field_image": ("kernels_points.wgsl", True),
    "march": ("kernels_render.wgsl", True),
    "surface": ("kernels_render.wgsl", True),
    "light": ("kernels_render.wgsl", True),
    "march_cells": ("kernels_render.wgsl", True),
    "surface_cells": ("kernels_render.wgsl", True),
    "light_cells": ("kernels_render.wgsl", True),
    "slice": ("kernels_render.wgsl", True),
    "shade": ("kernels_render.wgsl", False),
    "resolve": ("kernels_render.wgsl", False),
    "prune_tiles": ("prune.wgsl", True),
    "prune_cells": ("prune.wgsl", True),
    "prune_image_cells": ("prune.wgsl", True),
    "prune_wave": ("prune.wgsl", True),
    "prune_wave_cells": ("prune.wgsl", True),
    "pruned_image": ("prune.wgsl", True),
    "cells_image": ("prune.wgsl", True),
    "pruned_points": ("prune.wgsl", True),
    "path_generate": ("kernels_render.wgsl+path.wgsl", False),
    "path_trace": ("kernels_render.wgsl+path.wgsl", True),
    "path_trace_cells": ("kernels_render.wgsl+path.wgsl", True),
    "path_accumulate": ("kernels_render.wgsl+path.wgsl", False),
    "path_tonemap": ("kernels_render.wgsl+path.wgsl", False),
}
# the one render pipeline of the set: a viewer's present pass (a packed RGB image drawn onto a
# window's texture), one per texture format (KernelSet.present_pipeline)
PRESENT_FILE = "present.wgsl"

# pipeline-overridable constants per kernel: march and light need distances only (the hit's
# material comes from the surface pass), so their interpreter is built without material ids; their
# _cells pipelines and surface's (the same entry points, KERNEL_ENTRY) evaluate an arithmetic
# tape's pruned cell tapes instead (interpreter.wgsl FIELD_CELLS, packed.wgsl cell_eval, with
# material ids in surface_cells and the path tracer's path_trace_cells); prune_cells is
# prune_tiles folding constant operands into the march cells' tapes (prune.wgsl FOLD_CONSTANTS)
# and taking the union rule on sub-cells (UNION_BOUND), prune_image_cells the same for image cells without the rule (their kept images
# run no faster for it, and their first image slower: H200, 16^2 x 3 cells, 1.61 -> 1.80 ms),
# prune_wave_cells prune_wave's level 0 of either
KERNEL_CONSTANTS: dict[str, dict[str, bool]] = {
    "march": {"WITH_MATERIALS": False}, "light": {"WITH_MATERIALS": False},
    "march_cells": {"WITH_MATERIALS": False, "FIELD_CELLS": True},
    "light_cells": {"WITH_MATERIALS": False, "FIELD_CELLS": True},
    "surface_cells": {"FIELD_CELLS": True}, "path_trace_cells": {"FIELD_CELLS": True},
    "prune_cells": {"FOLD_CONSTANTS": True, "UNION_BOUND": True},
    "prune_image_cells": {"FOLD_CONSTANTS": True},
    "prune_wave_cells": {"FOLD_CONSTANTS": True}}
KERNEL_ENTRY = {"march_cells": "march", "light_cells": "light",   # kernel -> entry point, where they differ
                "surface_cells": "surface", "path_trace_cells": "path_trace", "prune_cells": "prune_tiles",
                "prune_image_cells": "prune_tiles", "prune_wave_cells": "prune_wave"}
PRELUDE_BEFORE_REGCAP = (HEADER_NAME,)
PRELUDE_AFTER_REGCAP = (RENDER_NAME, "bindings.wgsl", "interpreter.wgsl", "packed.wgsl")
RATE_FILE = user_cache_dir("compile_rate.json")
# weighted WGSL characters (_compile_weight) one thread compiles per second, before this machine's
# own are learnt: a hardware GPU's driver compiles at creation (H200: 56 pipelines in 3.0-6.3 s on
# 16 threads, 100-210 k/s), a software rasteriser JITs at the first dispatch and creates faster
# (lavapipe: 56 in 4.7-7 s on 2 threads, 0.7-1.1 M/s)
DEFAULT_RATE_HARDWARE = 150_000.0
DEFAULT_RATE_SOFTWARE = 800_000.0
RATE_KEY_PREFIX = "per thread | "   # (the rate file's keys; once an aggregate rate was kept unprefixed)
PROGRESS_MIN_SECONDS = 1.0    # a pipeline build predicted shorter shows no progress line


# callables started (each returns a started thread) while a hardware adapter's kernels build:
# runtime/gpu_pruning.py registers its wave planner here
BUILD_COMPANIONS: list = []


class GpuError(TaperayError):
    """The GPU failed (device lost, out of memory, driver error): callers fall back to the CPU."""


# ------------------------------------------------------------------------------------ kernels
def _shader_text(file: str, cap: int) -> str:
    """The module of a KERNELS file entry: the prelude, then the entry's files ("a+b": a, then b)."""
    names = (*PRELUDE_BEFORE_REGCAP, regcap_name(cap), *PRELUDE_AFTER_REGCAP, *file.split("+"))
    return "\n".join((SHADER_DIR / n).read_text() for n in names)


def variant_for(n_regs: int) -> int:
    """The smallest register-capacity variant holding ``n_regs`` registers."""
    for cap in REG_CAPS:
        if n_regs <= cap:
            return cap
    raise TaperayError(f"the tape needs {n_regs} registers; the GPU kernels hold at most {max(REG_CAPS)}")


@dataclass
class KernelStats:
    shader_modules_created: int = 0
    pipelines_created: int = 0          # by requests and by the background, each (kernel, variant) once
    cache_hits: int = 0                 # pipeline() found the pipeline made
    cache_misses: int = 0               # (kernel, variant)s a request was the first to ask for: it created them
    background_waits: int = 0           # (kernel, variant)s a request waited for the background to finish
    build_seconds: float = 0.0          # time requests waited for pipelines
    predicted_seconds: float = 0.0      # what those waits were predicted to take

    def as_dict(self) -> dict:
        return dict(self.__dict__)


Key = tuple[str, int | None]


class KernelSet:
    """The walker's pipelines, cached by (kernel, variant), each created at most once, when a
    request first needs it.

    ``ensure(keys)`` creates the missing ones of a request in parallel (worker threads, largest
    first) and waits for them; ``pipeline`` returns one (creating it if no request asked first).
    With ``background`` on, the first request also queues every other (kernel, variant) behind
    the requests' own, so that after ``settle()`` no later request (an edit that needs another
    register variant, the cells passes of a scene's second frame) creates one; at the
    interpreter's exit the queue is dropped and only the creations under way are waited for.
    """

    def __init__(self, device, adapter_key: str, software: bool = False, progress: bool = False,
                 warm: bool = True, background: bool = True, companions: list | None = None):
        wgpu = load_wgpu()
        self.device = device
        self.adapter_key = adapter_key
        self.software = software
        self.progress = progress
        self.warm = warm
        self.background = background
        self.stats = KernelStats()
        self._lock = threading.Lock()
        self._module_lock = threading.Lock()
        ro, rw = "read-only-storage", "storage"
        kinds = [ro, ro, ro, ro, ro, "uniform", ro, rw, rw, rw, rw]
        self.bind_group_layout = device.create_bind_group_layout(entries=[
            {"binding": i, "visibility": wgpu.ShaderStage.COMPUTE, "buffer": {"type": k}}
            for i, k in enumerate(kinds)])
        self.pipeline_layout = device.create_pipeline_layout(bind_group_layouts=[self.bind_group_layout])
        self._modules: dict[tuple[str, int], object] = {}
        self._sources: dict[tuple[str, int], str] = {}
        self._pipelines: dict[Key, object] = {}
        self._present_module = None                 # the present pass's module, and its pipeline per format
        self._present: dict[str, object] = {}
        self._futures: dict[Key, Future] = {}       # every (kernel, variant) asked for (each once)
        self._started: set[Key] = set()             # ... whose creation a worker began
        self._queued_in_background: set[Key] = set()
        self._background_queued = False
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._workers: list[threading.Thread] = []
        self._n_workers = max(1, min(len(self.keys()), os.cpu_count() or 1))
        self._closed = False
        self._companions = list(companions or [])   # threads joined before the first dispatch
        if warm:
            self._warm_bindings()
        _OPEN_SETS.add(self)

    @staticmethod
    def keys() -> list[Key]:
        """Every (kernel, variant) there is."""
        return [(k, cap) for k, (_, per_variant) in KERNELS.items()
                for cap in (REG_CAPS if per_variant else (None,))]

    @staticmethod
    def key(kernel: str, variant: int | None) -> Key:
        """The cache key of ``kernel`` in register ``variant`` (tape-free kernels have one)."""
        return kernel, variant if KERNELS[kernel][1] else None

    def created_keys(self) -> set[Key]:
        """The (kernel, variant)s whose pipelines exist."""
        with self._lock:
            return set(self._pipelines)

    def _module_key(self, kernel: str, variant: int | None) -> tuple[str, int]:
        return KERNELS[kernel][0], REG_CAPS[0] if variant is None else variant

    def _source(self, mkey: tuple[str, int]) -> str:
        src = self._sources.get(mkey)
        if src is None:
            src = self._sources[mkey] = _shader_text(*mkey)
        return src

    def _module(self, mkey: tuple[str, int]):
        with self._module_lock:
            if mkey not in self._modules:
                self._modules[mkey] = self.device.create_shader_module(label=f"{mkey[0]}@{mkey[1]}",
                                                                       code=self._source(mkey))
                self.stats.shader_modules_created += 1
            return self._modules[mkey]

    def weight(self, key: Key) -> float:
        """The predicted compile cost of the pipeline ``key`` (_compile_weight of its module's text)."""
        return _compile_weight(self._source(self._module_key(*key)), key[1])

    def _create(self, kernel: str, variant: int | None):
        module = self._module(self._module_key(kernel, variant))
        promise = self.device.create_compute_pipeline_async(
            label=f"{kernel}@{variant}", layout=self.pipeline_layout,
            compute={"module": module, "entry_point": KERNEL_ENTRY.get(kernel, kernel),
                     "constants": KERNEL_CONSTANTS.get(kernel, {})})
        pipe = promise.sync_wait()
        if self.warm:
            self._warm(pipe)
        return pipe

    def _warm(self, pipe):
        """Dispatch ``pipe`` once over no items and wait: drivers that compile lazily at the first
        dispatch (Mesa lavapipe JITs there) compile now, in the creating thread, not in the frame."""
        enc = self.device.create_command_encoder()
        cp = enc.begin_compute_pass()
        cp.set_pipeline(pipe)
        cp.set_bind_group(0, self._warm_group)
        cp.dispatch_workgroups(1, 1, 1)
        cp.end()
        self.device.queue.submit([enc.finish()])
        self.device.queue.read_buffer(self._warm_buffers[0], 0, 4)   # waits for the dispatch

    def _warm_bindings(self):
        """A bind group of small zeroed buffers (uniform n_items = 0: every invocation returns)."""
        wgpu = load_wgpu()
        usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC
        bufs = [self.device.create_buffer(size=MIN_BUFFER, usage=usage) for _ in range(5)]
        bufs.append(self.device.create_buffer(size=max(MIN_BUFFER, UNIFORM_BYTES), usage=wgpu.BufferUsage.UNIFORM))
        bufs += [self.device.create_buffer(size=MIN_BUFFER, usage=usage) for _ in range(N_BINDINGS - 6)]
        self._warm_buffers = bufs
        self._warm_group = self.device.create_bind_group(
            layout=self.bind_group_layout,
            entries=[{"binding": i, "resource": {"buffer": b, "offset": 0, "size": b.size}}
                     for i, b in enumerate(bufs)])

    # -- the workers
    def _schedule(self, key: Key, priority: int) -> Future:
        """The future of ``key``'s pipeline, queued at ``priority`` (0: a request's, 1: the
        background's; a key queued by the background and then asked for is queued again at 0).
        Called holding the lock."""
        fut = self._futures.get(key)
        if fut is None:
            fut = self._futures[key] = Future()
        if key not in self._started and not self._closed:
            self._queue.put((priority, next(self._order), key))
            if len(self._workers) < self._n_workers:
                worker = threading.Thread(target=self._work, name="taperay-pipelines")
                self._workers.append(worker)
                worker.start()
        return fut

    def _work(self):
        while True:
            _, _, key = self._queue.get()
            if key is None:
                return
            with self._lock:
                if key in self._started:
                    continue            # (queued twice: by the background, then by a request)
                self._started.add(key)
                fut = self._futures[key]
            try:
                pipe = self._create(*key)
            except Exception as e:      # a driver that cannot compile the kernel
                fut.set_exception(GpuError(f"building GPU kernel {key[0]} ({key[1]} registers) failed: {e}"))
                continue
            with self._lock:
                self._pipelines[key] = pipe
                self.stats.pipelines_created += 1
            fut.set_result(pipe)

    def close(self):
        """Drop the queued creations and wait for those under way (the interpreter's exit, a
        device loss)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while True:
                try:
                    _, _, key = self._queue.get_nowait()
                except queue.Empty:
                    break
                if key is not None and key not in self._started:
                    self._futures[key].cancel()
            for _ in self._workers:
                self._queue.put((-1, next(self._order), None))
            workers = list(self._workers)
        for worker in workers:
            if worker is not threading.current_thread():
                worker.join()

    # -- requests
    def ensure(self, keys) -> None:
        """Make the pipelines of the (kernel, variant)s ``keys`` exist: the missing ones created in
        parallel, largest first, and waited for (with a progress line on stderr moving by the
        clock, when the set was built with ``progress`` and the wait is predicted to take a
        while). The first request that creates any also queues the rest in the background (with
        ``background``) and waits for the companions (the wave planner's compile)."""
        keys = list(dict.fromkeys(self.key(*k) for k in keys))
        with self._lock:
            missing = [k for k in keys if k not in self._pipelines]
            if not missing:
                return
            if self._closed:
                raise GpuError("the GPU kernel set was closed (the device was lost or the process is ending)")
            fresh = [k for k in missing if k not in self._futures]
            self.stats.cache_misses += len(fresh)
            self.stats.background_waits += sum(k in self._queued_in_background for k in missing)
            learn = bool(fresh) and not self._background_queued and len(fresh) == len(missing)
            futures = [self._schedule(k, 0) for k in sorted(missing, key=lambda k: -self.weight(k))]
        t0 = time.perf_counter()
        predicted = predict_seconds([self.weight(k) for k in missing], self._n_workers,
                                     load_rate(self.adapter_key, self.software))
        show = self.progress and predicted >= PROGRESS_MIN_SECONDS and sys.stderr is sys.__stderr__
        line = ProgressLine(len(missing), predicted) if show else None
        while True:
            done, pending = wait(futures, timeout=0.05)
            if line:
                line.update(len(done))
            if not pending:
                break
        if line:
            line.finish()
        seconds = time.perf_counter() - t0
        self.stats.build_seconds += seconds
        self.stats.predicted_seconds += predicted
        for f in futures:
            f.result()                  # (raises the GpuError of a kernel that failed)
        if learn:
            store_rate(self.adapter_key, measured_rate([self.weight(k) for k in fresh], self._n_workers, seconds))
        self._after_first_request(keys)

    def _after_first_request(self, keys: list[Key]):
        with self._lock:
            companions, self._companions = self._companions, []
            queue_rest = self.background and not self._background_queued
        if queue_rest:
            self.queue_rest({v for _, v in keys})
        for job in companions:
            job.join()

    def queue_rest(self, variants=()) -> None:
        """Queue, behind every request's, the creation of each (kernel, variant) not asked for
        yet: those in ``variants`` first, then the largest first."""
        with self._lock:
            self._background_queued = True
            rest = sorted((k for k in self.keys() if k not in self._futures),
                          key=lambda k: (k[1] not in variants, -self.weight(k)))
            for k in rest:
                self._queued_in_background.add(k)
                self._schedule(k, 1)

    def settle(self) -> None:
        """Wait until every pipeline asked for, by requests or the background, exists."""
        with self._lock:
            futures = list(self._futures.values())
        wait(futures)

    def pipeline(self, kernel: str, variant: int | None):
        """The pipeline of ``kernel`` for register ``variant``, created now if no request asked
        for it yet (``ensure`` first creates a request's pipelines in parallel)."""
        key = self.key(kernel, variant)
        with self._lock:
            pipe = self._pipelines.get(key)
            if pipe is not None:
                self.stats.cache_hits += 1
                return pipe
        self.ensure([key])
        return self._pipelines[key]

    @property
    def present_formats(self) -> tuple[str, ...]:
        """The texture formats whose present pipeline exists (none until a viewer presents)."""
        with self._module_lock:
            return tuple(sorted(self._present))

    def present_pipeline(self, texture_format: str):
        """The present pass's render pipeline (shaders/present.wgsl: a viewer draws an image held
        as packed RGB words onto a window texture of ``texture_format``), made on first need,
        once per format, and counted with the rest."""
        with self._module_lock:
            pipe = self._present.get(texture_format)
            if pipe is not None:
                self.stats.cache_hits += 1
                return pipe
            if self._present_module is None:
                self._present_module = self.device.create_shader_module(
                    label="present", code=(SHADER_DIR / PRESENT_FILE).read_text())
                self.stats.shader_modules_created += 1
            module = self._present_module
            pipe = self._present[texture_format] = self.device.create_render_pipeline(
                label=f"present@{texture_format}", layout="auto",
                vertex={"module": module, "entry_point": "vs_main"},
                primitive={"topology": "triangle-list"},
                fragment={"module": module, "entry_point": "fs_main", "targets": [{"format": texture_format}]})
            self.stats.pipelines_created += 1
            return pipe

    def __len__(self) -> int:
        with self._lock:
            return len(self._pipelines)


_OPEN_SETS: "weakref.WeakSet[KernelSet]" = weakref.WeakSet()


def _close_open_sets():
    """At the interpreter's exit, before its threads are joined: the background's queue dropped."""
    for ks in list(_OPEN_SETS):
        ks.close()


# (concurrent.futures' own thread pools register the same way: this runs before the
# interpreter joins the worker threads, so they end after the creation under way)
threading._register_atexit(_close_open_sets)


class ProgressLine:
    """``building GPU kernels [#####-----] 3/5  0.4 s of ~1 s`` on stderr, moving by the clock."""

    def __init__(self, total: int, predicted: float):
        self.total, self.predicted, self.t0 = total, max(predicted, 1e-3), time.perf_counter()

    def _write(self, frac: float, done: int, tail: str):
        bar = "#" * int(frac * 24)
        sys.stderr.write(f"\rbuilding GPU kernels [{bar:<24}] {done}/{self.total}  {tail}")
        sys.stderr.flush()

    def update(self, done: int):
        el = time.perf_counter() - self.t0
        frac = min(max(el / self.predicted, done / self.total), 0.99)
        self._write(frac, done, f"{el:4.1f} s of ~{max(self.predicted, el):.1f} s")

    def finish(self):
        self._write(1.0, self.total, f"{time.perf_counter() - self.t0:4.1f} s\n")


def _compile_weight(source: str, variant: int | None) -> float:
    """Predicted compile cost of one pipeline: its WGSL size, times a register-file factor (a
    larger private register array costs the compilers more; measured ~3x from 16 to 256 on lavapipe)."""
    return len(source) * (1.0 + (variant or 0) / 128.0)


def predict_seconds(weights: list[float], workers: int, rate: float) -> float:
    """Seconds to create pipelines of these weights on ``workers`` threads, each compiling
    ``rate`` weight per second: the largest alone, or the whole shared out, whichever is longer."""
    if not weights:
        return 0.0
    return max(max(weights), sum(weights) / min(workers, len(weights))) / rate


def measured_rate(weights: list[float], workers: int, seconds: float) -> float:
    """The per-thread rate that predict_seconds would have needed to predict ``seconds``."""
    return predict_seconds(weights, workers, 1.0) / max(seconds, 1e-3)


def load_rate(key: str, software: bool = False) -> float:
    """The compile rate learnt on this machine for the adapter ``key``, else the default of its
    kind (DEFAULT_RATE_SOFTWARE for a software rasteriser, DEFAULT_RATE_HARDWARE for a GPU)."""
    default = DEFAULT_RATE_SOFTWARE if software else DEFAULT_RATE_HARDWARE
    try:
        rate = float(json.loads(RATE_FILE.read_text())[RATE_KEY_PREFIX + key])
        return rate if rate > 0 else default
    except (OSError, ValueError, KeyError, TypeError):
        return default


def store_rate(key: str, rate: float):
    """Learn ``rate`` for the adapter ``key``: the first measurement as it is, later ones averaged
    (geometric mean) with what was learnt, so that one slow or fast build moves the prediction
    half way."""
    try:
        data = json.loads(RATE_FILE.read_text()) if RATE_FILE.exists() else {}
        if not isinstance(data, dict):
            data = {}
        old = data.get(RATE_KEY_PREFIX + key)
        if isinstance(old, (int, float)) and old > 0:
            rate = math.sqrt(old * rate)
        data[RATE_KEY_PREFIX + key] = rate
        RATE_FILE.parent.mkdir(parents=True, exist_ok=True)
        RATE_FILE.write_text(json.dumps(data, indent=1, sort_keys=True))
    except (OSError, ValueError):
        pass   # a read-only home: the next process predicts from the default again


# ------------------------------------------------------------------------------------ context
class GpuContext:
    """The process's device and kernel set (one per process; rebuilt only after a device loss)."""

    def __init__(self, progress: bool):
        self.dropped = False            # (drop_context: after a device loss; walkers move to a new one)
        adapter = get_adapter()
        if adapter is None:
            raise GpuError("no GPU adapter found (no Vulkan / Metal / DX12 driver)")
        self.adapter = adapter
        self.info = adapter_info()
        try:
            self.device = take_device()
        except Exception as e:
            raise GpuError(f"could not open the GPU device {self.info['name']}: {e}") from e
        self.limits = {k: self.device.limits[k.replace("_", "-")] for k in DEVICE_LIMITS}
        warm = _warm_policy(self.info)
        key = f"{self.info['name']} | {self.info['driver']} | {self.info['backend']} | warm={warm}"
        # the jobs of BUILD_COMPANIONS (the wave planner's Numba compile) in threads of their own
        # while the first request's kernels build, not on a software rasteriser
        # (GpuWalker.wave_max_tiles) nor for a one-shot command (build_in_background(False): its
        # frame does without them); joined before the first dispatch, since after it they would
        # slow the first frames (the GIL)
        companions = _background_build and not self.info["software"]
        jobs = [start() for start in BUILD_COMPANIONS] if companions else []
        self.kernels = KernelSet(self.device, key, self.info["software"], progress, warm, _background_build,
                                 jobs)


def _warm_policy(info: dict) -> bool:
    """Whether startup also runs each pipeline once (``TAPERAY_GPU_WARM=1/0`` decides; default: on
    hardware, where it costs milliseconds because drivers compile at creation, and off on software
    rasterisers, whose lazy per-pipeline JIT (~1-4 s each on lavapipe) would make startup ~40 s)."""
    env = os.environ.get("TAPERAY_GPU_WARM", "").strip()
    if env in ("0", "1"):
        return env == "1"
    return not info["software"]


_context: GpuContext | None = None
_context_lock = threading.Lock()
_background_build = True


def build_in_background(on: bool) -> None:
    """Whether kernel sets made from now on queue, after their first request, every pipeline no
    request has asked for (``KernelSet``: on by default, so a long-lived process's later requests
    and edits find theirs made; a one-shot command line turns it off, and creates only what it
    draws), and whether the context starts BUILD_COMPANIONS (off: a one-shot command's frame
    does without the wave planner, runtime.gpu_pruning, rather than wait for its compile)."""
    global _background_build
    _background_build = bool(on)


def builds_in_background() -> bool:
    """What build_in_background last set (on by default)."""
    return _background_build


def get_context(progress: bool = False) -> GpuContext:
    """The process's device context, made on the first call (one device, one kernel set)."""
    global _context
    with _context_lock:
        if _context is None:
            _context = GpuContext(progress)
        return _context


def drop_context(ctx: GpuContext):
    """Forget ``ctx`` after a device loss: the walkers on it move to a new context on their next call."""
    global _context
    ctx.dropped = True
    with _context_lock:
        if _context is ctx:
            _context = None
    ctx.kernels.close()


def kernels(progress: bool = False) -> KernelSet:
    """The process's kernel set (its pipelines made as requests need them)."""
    return get_context(progress).kernels


# ------------------------------------------------------------------------------------ buffers
class Buffer:
    """A storage buffer grown by doubling, but never past ``limit`` bytes (the adapter's binding
    limit: the whole buffer is bound), with a host mirror so uploads write only changed bytes."""

    def __init__(self, device, usage, label: str, limit: int):
        self.device, self.usage, self.label, self.limit = device, usage, label, limit
        self.capacity = 0
        self.buffer = None
        self.mirror = np.zeros(0, np.uint8)
        self.bytes_written = 0
        self.bytes_compared = 0             # bytes sync compared with the mirror (to find what to write)
        self.held: list[np.ndarray] = []    # read-only arrays the buffer holds from its start

    def ensure(self, nbytes: int) -> bool:
        """Room for ``nbytes``; True when the buffer was (re)created."""
        if self.buffer is not None and nbytes <= self.capacity:
            return False
        cap = max(MIN_BUFFER, self.capacity)
        while cap < nbytes:
            cap *= 2
        cap = max(nbytes, min(cap, self.limit // 4 * 4))
        self.buffer = self.device.create_buffer(label=self.label, size=cap, usage=self.usage)
        self.capacity = cap
        self.mirror = np.zeros(0, np.uint8)
        self.held = []
        return True

    def sync(self, data: np.ndarray):
        """Make the buffer hold ``data`` (bytes) from its start, writing only the span that differs
        (the bytes after it are left as they are). A read-only array (a frozen tape's,
        runtime.tape.freeze; a kept schedule or cell layout) that the buffer was synced to since
        its last write is not compared again: every frame syncs the tape (the 100,000-bolt bin's
        is 10 MB), and an image's pruning syncs the instrs buffer to the tape and its schedule in
        turn."""
        if not data.flags.writeable and any(data is h for h in self.held):
            return
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        self.ensure(max(raw.size, 4))
        n = raw.size
        if n == 0:
            return
        old = self.mirror
        m = min(old.size, n)
        self.bytes_compared += m
        span = _differing_span(old[:m], raw[:m])
        if span is None and n <= old.size:
            if not data.flags.writeable:
                self.held = self.held[-3:] + [data]
            return
        lo = span[0] & ~3 if span else m & ~3
        hi = n if n > old.size else min(n, (span[1] + 3) & ~3)
        self.write(lo, raw[lo:hi])
        # (what the buffer holds: beyond ``data``, a longer content's rest)
        self.mirror = np.concatenate([raw, old[n:]])
        self.held = [] if data.flags.writeable else [data]

    def write(self, offset: int, raw: np.ndarray):
        self.held = []
        raw = np.ascontiguousarray(raw).view(np.uint8)
        pad = (-raw.size) % 4
        if pad:
            raw = np.concatenate([raw, np.zeros(pad, np.uint8)])
        self.device.queue.write_buffer(self.buffer, offset, raw)
        self.bytes_written += raw.size


def _differing_span(a: np.ndarray, b: np.ndarray) -> tuple[int, int] | None:
    """(first, one past the last) byte index where the equal-sized uint8 arrays differ, or None.
    Compared eight bytes at a time, with no index array (a whole new 10 MB tape differs
    everywhere)."""
    n = a.size
    w = n // 8 * 8
    words = a[:w].view(np.uint64) != b[:w].view(np.uint64)
    tail = np.flatnonzero(a[w:] != b[w:])
    if words.any():
        first = 8 * int(words.argmax())
        first += int(np.flatnonzero(a[first:first + 8] != b[first:first + 8])[0])
    elif tail.size:
        first = w + int(tail[0])
    else:
        return None
    if tail.size:
        return first, w + int(tail[-1]) + 1
    last = 8 * (w // 8 - 1 - int(words[::-1].argmax()))
    return first, last + int(np.flatnonzero(a[last:last + 8] != b[last:last + 8])[-1]) + 1


def current_context() -> GpuContext | None:
    """The process's device context now (a device loss replaces it)."""
    return _context
