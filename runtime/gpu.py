"""The GPU walker: the fixed WGSL kernel set on wgpu, built once per process, and ``GpuWalker``.

Owns adapter / device selection (``adapter_info``: name, backend, whether it is a software
rasteriser such as Mesa lavapipe / llvmpipe), the startup build of EVERY pipeline (all asked for at
once through ``create_compute_pipeline_async``, from a thread pool because wgpu-native resolves
that call synchronously; on hardware each pipeline is also dispatched once, empty, so lazy
drivers compile at startup, see ``_warm_policy``; a progress line moves by the clock, predicted
from the kernels' sizes and a per-machine compile rate kept in ``~/.cache/taperay/compile_rate.json``;
nothing dispatches before the build is done), the pipeline cache keyed by (kernel, register
variant) with hit / miss / creation counters, ``GpuWalker`` (the CpuWalker API plus ``upload`` /
``set_param``: edits are buffer writes of the changed bytes, never compiles; march and light are
resumed over several dispatches when a per-invocation iteration budget runs out, and run their
interpreter without material ids (the pipeline constants of ``KERNEL_CONSTANTS``; a ``surface``
pass evaluates the hit's material); pruned 2D images over one to four tile levels and pruned point
sets over cells of the points (``evaluate_pruned``), march / light / render of arithmetic tapes
over hierarchical 3D cells of the march box (``march_cells``, the ``_cells`` pipelines), all
shaders/prune.wgsl + packed.wgsl, with their arena grown when it overflows; ``gpu_seconds`` / ``gpu_seconds_points``, GPU time without host work or
read-back) and ``gpu_self_check``.

Shader text is only ever the committed files of ``shaders/`` concatenated in a fixed order (the
generated headers, one register-capacity file, the bindings, the interpreter, a kernel file); no
WGSL is formatted here and nothing a scene contains reaches shader text.
"""
from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .camera import Camera, auto_camera
from .opcodes import REG_CAPS
from .shading import PACK_LEN, RenderSettings
from .tape import Tape, TaperayError, ValidatedTapes, gradient_eps, point_array
from .wgsl_header import HEADER_NAME, RENDER_NAME, SHADER_DIR, regcap_name

__all__ = ["GpuWalker", "GpuError", "KernelSet", "adapter_info", "kernels", "gpu_self_check",
           "KERNELS", "SelfCheck"]

WG = 64                       # workgroup size (bindings.wgsl)
MAX_GROUPS_X = 65535          # dispatches beyond this many workgroups go 2D
UNIFORM_BYTES = 32 + 16 + 16 + 64 + 4 * PACK_LEN   # bindings.wgsl: struct Uniforms
MIN_BUFFER = 256
COUNTERS_BYTES = 16           # bindings.wgsl: counters (overflow, unfinished, prune.wgsl arena, refusals)
N_BINDINGS = 11
RESUMABLE = ("march", "light", "march_cells", "light_cells")   # kernels that save their state and are
                                                                 # dispatched until done
# Loop-iteration limits per invocation (bindings.wgsl: U.iter_cap, U.iter_budget). Mesa's gallivm
# (lavapipe / llvmpipe) stops every kernel's loops after 65535 iterations in all, so a software
# adapter gets a cap below that (an evaluation needing more is refused as overflow) and a budget
# after which march / light resume in the next dispatch; hardware gets no cap and a budget that
# keeps each dispatch short (watchdogs).
SOFTWARE_ITER_CAP, SOFTWARE_ITER_BUDGET = 60_000, 40_000
HARDWARE_ITER_CAP, HARDWARE_ITER_BUDGET = 0xFFFFFFFF, 1 << 22

# Pruned images (shaders/prune.wgsl): default tile levels, coarse to fine (pixels); at most
# MAX_TILE_LEVELS (their sizes fill one vec4 of the uniforms); header words per tile; the counters'
# arena words (bump pointer, refusals); U.extra.w, the level each prune_tiles pass works on.
PRUNE_TILES = (64, 16, 4)
MAX_TILE_LEVELS = 4
PRUNE_HEADER_WORDS = 3
PRUNE_ARENA, PRUNE_ARENA_FULL = 2, 3
UNIFORM_LEVEL_BYTE = 60

# kernel -> (kernel file, built per register variant). Tape-free kernels get one pipeline.
KERNELS: dict[str, tuple[str, bool]] = {
    "eval_points": ("kernels_points.wgsl", True),
    "gradient_points": ("kernels_points.wgsl", True),
    "field_image": ("kernels_points.wgsl", True),
    "march": ("kernels_render.wgsl", True),
    "surface": ("kernels_render.wgsl", True),
    "light": ("kernels_render.wgsl", True),
    "march_cells": ("kernels_render.wgsl", True),
    "light_cells": ("kernels_render.wgsl", True),
    "slice": ("kernels_render.wgsl", True),
    "shade": ("kernels_render.wgsl", False),
    "resolve": ("kernels_render.wgsl", False),
    "prune_tiles": ("prune.wgsl", True),
    "pruned_image": ("prune.wgsl", True),
    "pruned_points": ("prune.wgsl", True),
}
# pipeline-overridable constants per kernel: march and light need distances only (the hit's
# material comes from the surface pass), so their interpreter is built without material ids; their
# _cells pipelines (the same entry points, KERNEL_ENTRY) evaluate an arithmetic tape's pruned cell
# tapes instead (interpreter.wgsl FIELD_CELLS, packed.wgsl cell_value)
KERNEL_CONSTANTS: dict[str, dict[str, bool]] = {
    "march": {"WITH_MATERIALS": False}, "light": {"WITH_MATERIALS": False},
    "march_cells": {"WITH_MATERIALS": False, "FIELD_CELLS": True},
    "light_cells": {"WITH_MATERIALS": False, "FIELD_CELLS": True}}
KERNEL_ENTRY = {"march_cells": "march", "light_cells": "light"}   # kernel -> entry point, where they differ
PRELUDE_BEFORE_REGCAP = (HEADER_NAME,)
PRELUDE_AFTER_REGCAP = (RENDER_NAME, "bindings.wgsl", "interpreter.wgsl", "packed.wgsl")
RATE_FILE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "taperay" / "compile_rate.json"
DEFAULT_RATE = 60_000.0       # weighted WGSL characters compiled per second, before any measurement


def tile_levels(tiles) -> tuple[int, ...]:
    """The tile levels of a pruned image: ``tiles`` is one size or sizes coarse to fine, pixels."""
    sizes = (tiles,) if isinstance(tiles, (int, np.integer)) else tuple(tiles)
    if not 1 <= len(sizes) <= MAX_TILE_LEVELS:
        raise TaperayError(f"pruned image: {len(sizes)} tile levels; give 1 to {MAX_TILE_LEVELS} sizes")
    if not all(isinstance(s, (int, np.integer)) and 1 <= s <= 1 << 16 for s in sizes):
        raise TaperayError(f"pruned image: tile sizes {sizes} must be whole numbers of pixels in 1..65536")
    if any(b >= a for a, b in zip(sizes, sizes[1:])):
        raise TaperayError(f"pruned image: tile sizes {sizes} must shrink from level to level")
    return tuple(int(s) for s in sizes)


# Pruned point evaluation (GpuWalker.evaluate_pruned): level-0 cells over the points' bounding box
# (at most POINT_CELLS, and at most one per POINT_MIN_PER_CELL points), each finer level splitting
# a cell 4 ways per axis the points span; the points buffer's words per point (x y z, cell, index);
# points per dispatch (the index is a float: exact below 2^24).
POINT_CELLS = 1024
POINT_MIN_PER_CELL = 256
POINT_WORDS = 5
POINT_CHUNK = 1 << 24


def _grid_coord(x, lo, scale, top):
    """clamp(floor((x - lo) * scale), 0, top) (NaN: 0)."""
    t = (np.float64(x) - lo) * scale
    if not t > 0.0:
        return 0
    if t >= top:
        return np.int64(top)
    return np.int64(t)


def _bucket_points(pts, lo, scale, g0, shift, fan, n_levels, n_tiles, offsets, out_words):
    """Counting sort of the points by finest cell. Per point and axis r the finest-grid
    coordinate i_r = _grid_coord(x, lo, scale, g0[r] << shift - 1); the
    level-0 cell (i >> shift) over the g0 grid, then per finer level m the digit of the
    4-way split (fan[r] is 4 or 1). out_words: the level table, the boxes of every cell of
    every level (lo.xyz hi.xyz; empty: +inf / -inf; NaN along an axis holding a NaN), then
    per sorted point x y z, its finest cell, its index q (floats). Returns nothing."""
    N = pts.shape[0]
    qq = fan[0] * fan[1] * fan[2]
    fine = np.empty(N, np.int64)
    top = np.empty(3, np.float64)
    for r in range(3):
        top[r] = (g0[r] << shift) - 1
    for q in range(N):
        i0 = _grid_coord(pts[q, 0], lo[0], scale[0], top[0])
        i1 = _grid_coord(pts[q, 1], lo[1], scale[1], top[1])
        i2 = _grid_coord(pts[q, 2], lo[2], scale[2], top[2])
        c = ((i2 >> shift) * g0[1] + (i1 >> shift)) * g0[0] + (i0 >> shift)
        for m in range(1, n_levels):
            sh = 2 * (n_levels - 1 - m)
            c = c * qq + (((i2 >> sh) & 3) * fan[1] + ((i1 >> sh) & 3)) * fan[0] + ((i0 >> sh) & 3)
        fine[q] = c
    nf = n_tiles[n_levels - 1]
    count = np.zeros(nf + 1, np.int64)
    for q in range(N):
        count[fine[q] + 1] += 1
    for c in range(nf):
        count[c + 1] += count[c]
    for l in range(4):
        out_words[l] = l
    for l in range(n_levels):
        for t in range(n_tiles[l]):
            b = 4 + 6 * (offsets[l] + t)
            for r in range(3):
                out_words[b + r] = np.inf
                out_words[b + 3 + r] = -np.inf
    base = 4 + 6 * (offsets[n_levels - 1] + n_tiles[n_levels - 1])
    for q in range(N):
        c = fine[q]
        at = count[c]
        count[c] += 1
        w = base + POINT_WORDS * at
        b = 4 + 6 * (offsets[n_levels - 1] + c)
        for r in range(3):
            x = pts[q, r]
            out_words[w + r] = x
            if x != x:
                out_words[b + r] = np.nan
                out_words[b + 3 + r] = np.nan
            else:   # (a NaN bound stays NaN: both compares are false)
                if x < out_words[b + r]:
                    out_words[b + r] = x
                if x > out_words[b + 3 + r]:
                    out_words[b + 3 + r] = x
        out_words[w + 3] = c
        out_words[w + 4] = q
    for l in range(n_levels - 2, -1, -1):   # a cell's box: the union of its sub-cells'
        for t in range(n_tiles[l]):
            b = 4 + 6 * (offsets[l] + t)
            for k in range(qq):
                s = 4 + 6 * (offsets[l + 1] + t * qq + k)
                if out_words[s] > out_words[s + 3]:
                    continue   # empty
                for r in range(3):
                    a, z = out_words[s + r], out_words[s + 3 + r]
                    if a != a or out_words[b + r] != out_words[b + r]:
                        out_words[b + r] = np.nan
                        out_words[b + 3 + r] = np.nan
                    else:
                        out_words[b + r] = min(out_words[b + r], a)
                        out_words[b + 3 + r] = max(out_words[b + 3 + r], z)


def _finite_bounds(pts, lo, hi):
    """lo, hi: per axis the range of the finite coordinates (0, 0 where there is none)."""
    for r in range(3):
        lo[r], hi[r] = np.inf, -np.inf
    for q in range(pts.shape[0]):
        for r in range(3):
            x = np.float64(pts[q, r])
            if x - x == 0.0:    # finite
                lo[r] = min(lo[r], x)
                hi[r] = max(hi[r], x)
    for r in range(3):
        if lo[r] > hi[r]:
            lo[r], hi[r] = 0.0, 0.0


_point_jit: tuple | None = None


def _point_kernels():
    """(_finite_bounds, _bucket_points) through Numba, compiled on first use (cached on disk)."""
    global _point_jit
    if _point_jit is None:
        from numba import njit
        jit = njit(cache=True, error_model="numpy", fastmath=False)
        global _grid_coord
        _grid_coord = jit(_grid_coord)
        _point_jit = (jit(_finite_bounds), jit(_bucket_points))
    return _point_jit


def point_cells(pts: np.ndarray, levels: int, cells: int):
    """The cell levels of evaluate_pruned over (N, 3) float32 points: (tiles per level, the points
    buffer's float32 words: level table, cell boxes, sorted points with their cell and index;
    the word where the points start). Level 0: a grid over the bounding box of the finite
    coordinates, about ``cells`` cells shared among the axes the points span; each finer level
    splits a cell 4 ways per such axis (levels whose cells would outnumber the points 4 to 1, or
    beyond MAX_TILE_LEVELS, are dropped). A cell's box is the range of
    its points, so every point lies in its cell's box exactly."""
    n = len(pts)
    pts = np.ascontiguousarray(pts, np.float32)
    bounds, bucket = _point_kernels()
    lo, hi = np.zeros(3), np.zeros(3)
    bounds(pts, lo, hi)
    span = hi > lo
    d = int(span.sum())
    target = max(1, int(cells))
    per_axis = max(1, int(round(target ** (1.0 / d)))) if d else 1
    g0 = np.where(span, per_axis, 1).astype(np.int64)
    levels = max(1, min(levels, MAX_TILE_LEVELS)) if d else 1
    fan = np.where(span, 4, 1).astype(np.int64)
    qq = int(fan.prod())
    while levels > 1 and int(g0.prod()) * qq ** (levels - 1) > 4 * max(n, 1):
        levels -= 1
    shift = 2 * (levels - 1)
    scale = np.where(span, (g0 << shift) / np.where(span, hi - lo, 1.0), 0.0)
    n_tiles = np.array([int(g0.prod()) * qq ** m for m in range(levels)], np.int64)
    offsets = np.concatenate([[0], np.cumsum(n_tiles)[:-1]]).astype(np.int64)
    first = 4 + 6 * int(n_tiles.sum())
    words = np.empty(first + POINT_WORDS * n, np.float32)
    bucket(pts, lo, scale.astype(np.float64), g0, shift, fan, levels, n_tiles, offsets, words)
    return [int(c) for c in n_tiles], words, first


# Pruned march and light (GpuWalker.march / light / render of an arithmetic tape): MARCH_CELLS =
# (g0, levels), g0^3 level-0 cells over the march box, each finer level splitting a cell 4 x 4 x 4
# (packed.wgsl cell_value); "auto" prunes tapes of at least MARCH_CELLS_MIN_RECORDS records.
MARCH_CELLS = (8, 2)
MARCH_CELLS_MIN_RECORDS = 64
CELL_DESCRIPTOR_WORDS = 9


@functools.lru_cache(maxsize=8)
def _march_cells_cached(lo: tuple, hi: tuple, g0: int, levels: int):
    counts, words, desc = march_cells(lo, hi, g0, levels)
    words.flags.writeable = False
    return counts, words, desc


def march_cells(lo, hi, g0: int, levels: int):
    """The cells of a pruned march over the box lo..hi: (cells per level, the points buffer's
    float32 words, the descriptor's first word; packed.wgsl cell_value reads them). Level 0: g0^3
    grid cells (id i + g0 (j + g0 k)) and the outside cell (box NaN); level m + 1: 64 sub-cells per
    level-m cell (the outside cell's empty). A grid cell's box is its float64 extent grown by
    1e-4 of its size plus 1e-6 of |lo| + |hi| (so a point whose rounded index names a neighbour
    still lies in the box), in float32, clipped to its parent's box: a sub-cell's tape, pruned
    from its parent's over its box, is exact wherever it is used."""
    lo, hi = np.asarray(lo, np.float64), np.asarray(hi, np.float64)
    size0 = np.where(hi > lo, (hi - lo) / g0, 1.0)
    slack = 1e-6 * (np.abs(lo) + np.abs(hi))
    c = np.arange(g0 ** 3)
    ijk = np.stack([c % g0, c // g0 % g0, c // (g0 * g0)], 1)
    c = np.arange(64)
    local = np.stack([c % 4, c // 4 % 4, c // 16], 1)   # sub-cell (i j k) of id i + 4 (j + 4 k)
    grid_boxes, boxes = [], []
    for m in range(levels):
        size = size0 / 4.0 ** m
        margin = 1e-4 * size + slack
        box = np.concatenate([lo + ijk * size - margin, lo + (ijk + 1) * size + margin], 1).astype(np.float32)
        if m:   # within the parent's box
            parent = np.repeat(grid_boxes[-1], 64, 0)
            box[:, :3] = np.maximum(box[:, :3], parent[:, :3])
            box[:, 3:] = np.minimum(box[:, 3:], parent[:, 3:])
        grid_boxes.append(box)
        outside = np.full((1, 6), np.nan, np.float32) if m == 0 else \
            np.tile(np.array([np.inf] * 3 + [-np.inf] * 3, np.float32), (64 * len(boxes[-1]) - len(box), 1))
        boxes.append(np.concatenate([box, outside]))
        if m + 1 < levels:
            ijk = (ijk[:, None, :] * 4 + local[None]).reshape(-1, 3)
    desc = 4 + 6 * sum(len(b) for b in boxes)
    words = np.empty(desc + CELL_DESCRIPTOR_WORDS, np.float32)
    words[:4] = np.arange(4)
    words[4:desc] = np.concatenate(boxes).ravel()
    words[desc:desc + 3] = lo
    words[desc + 3:desc + 6] = size0 / 4.0 ** (levels - 1)
    words[desc + 6:].view(np.uint32)[:2] = g0, levels   # (the header base: GpuWalker._prune_cells)
    return [len(b) for b in boxes], words, desc


def level_tile_counts(sizes: tuple[int, ...], width: int, height: int) -> list[int]:
    """Tiles per level: level 0 covers the image; a level-l tile has ceil(size_l / size_l+1)^2
    sub-tiles (runtime/pruning.py's nesting; those beyond the image are empty)."""
    counts = [-(-width // sizes[0]) * -(-height // sizes[0])]
    for a, b in zip(sizes, sizes[1:]):
        counts.append(counts[-1] * (-(-a // b)) ** 2)
    return counts


class GpuError(TaperayError):
    """The GPU failed (device lost, out of memory, driver error): callers fall back to the CPU."""


# ------------------------------------------------------------------------------------ adapter
_adapter_lock = threading.Lock()
_adapter = None
_adapter_tried = False


def _wgpu():
    import wgpu
    return wgpu


def _get_adapter():
    global _adapter, _adapter_tried
    with _adapter_lock:
        if not _adapter_tried:
            _adapter_tried = True
            try:
                _adapter = _wgpu().gpu.request_adapter_sync(power_preference="high-performance")
            except Exception:   # no Vulkan / Metal / DX12 driver at all: the walker is absent
                _adapter = None
        return _adapter


def adapter_info() -> dict | None:
    """The adapter the walker uses (None without one): name, vendor, backend, type, software."""
    a = _get_adapter()
    if a is None:
        return None
    info = dict(a.info)
    name = info.get("device") or info.get("description") or "unknown"
    text = " ".join(str(info.get(k, "")) for k in ("vendor", "device", "description")).lower()
    return dict(name=name, vendor=info.get("vendor", ""), backend=info.get("backend_type", ""),
                adapter_type=info.get("adapter_type", ""), driver=info.get("description", ""),
                software=("llvmpipe" in text or "lavapipe" in text or info.get("adapter_type") == "CPU"))


# ------------------------------------------------------------------------------------ kernels
def _shader_text(file: str, cap: int) -> str:
    names = (*PRELUDE_BEFORE_REGCAP, regcap_name(cap), *PRELUDE_AFTER_REGCAP, file)
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
    pipelines_created: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    build_seconds: float = 0.0
    predicted_seconds: float = 0.0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class KernelSet:
    """Every pipeline of the walker, created at construction, cached by (kernel, variant)."""

    def __init__(self, device, adapter_key: str, progress: bool = False, warm: bool = True):
        wgpu = _wgpu()
        self.device = device
        self.adapter_key = adapter_key
        self.warm = warm
        self.stats = KernelStats()
        self._lock = threading.Lock()
        self._ready = threading.Event()
        ro, rw = "read-only-storage", "storage"
        kinds = [ro, ro, ro, ro, ro, "uniform", ro, rw, rw, rw, rw]
        self.bind_group_layout = device.create_bind_group_layout(entries=[
            {"binding": i, "visibility": wgpu.ShaderStage.COMPUTE, "buffer": {"type": k}}
            for i, k in enumerate(kinds)])
        self.pipeline_layout = device.create_pipeline_layout(bind_group_layouts=[self.bind_group_layout])
        self._modules: dict[tuple[str, int], object] = {}
        self._sources: dict[tuple[str, int], str] = {}
        self._pipelines: dict[tuple[str, int | None], object] = {}
        self._build(progress)

    @staticmethod
    def keys() -> list[tuple[str, int | None]]:
        """Every (kernel, variant) the startup build creates."""
        return [(k, cap) for k, (_, per_variant) in KERNELS.items()
                for cap in (REG_CAPS if per_variant else (None,))]

    def _module_key(self, kernel: str, variant: int | None) -> tuple[str, int]:
        return KERNELS[kernel][0], REG_CAPS[0] if variant is None else variant

    def _module(self, mkey: tuple[str, int]):
        if mkey not in self._modules:
            src = _shader_text(*mkey)
            self._sources[mkey] = src
            self._modules[mkey] = self.device.create_shader_module(label=f"{mkey[0]}@{mkey[1]}", code=src)
            self.stats.shader_modules_created += 1
        return self._modules[mkey]

    def _create(self, kernel: str, variant: int | None):
        module = self._module(self._module_key(kernel, variant))
        promise = self.device.create_compute_pipeline_async(
            label=f"{kernel}@{variant}", layout=self.pipeline_layout,
            compute={"module": module, "entry_point": KERNEL_ENTRY.get(kernel, kernel),
                     "constants": KERNEL_CONSTANTS.get(kernel, {})})
        pipe = promise.sync_wait()
        with self._lock:
            self.stats.pipelines_created += 1
        if self.warm:
            self._warm(pipe)
        return pipe

    def _warm(self, pipe):
        """Dispatch ``pipe`` once over no items and wait: drivers that compile lazily at the first
        dispatch (Mesa lavapipe JITs there) compile now, at startup, not in the first frame."""
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
        wgpu = _wgpu()
        usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC
        bufs = [self.device.create_buffer(size=MIN_BUFFER, usage=usage) for _ in range(5)]
        bufs.append(self.device.create_buffer(size=max(MIN_BUFFER, UNIFORM_BYTES), usage=wgpu.BufferUsage.UNIFORM))
        bufs += [self.device.create_buffer(size=MIN_BUFFER, usage=usage) for _ in range(N_BINDINGS - 6)]
        self._warm_buffers = bufs
        self._warm_group = self.device.create_bind_group(
            layout=self.bind_group_layout,
            entries=[{"binding": i, "resource": {"buffer": b, "offset": 0, "size": b.size}}
                     for i, b in enumerate(bufs)])

    def _build(self, progress: bool):
        t0 = time.perf_counter()
        keys = self.keys()
        for k in keys:   # parse + validate every module first (naga; fast)
            self._module(self._module_key(*k))
        self._warm_bindings()
        weights = {k: _compile_weight(self._sources[self._module_key(*k)], k[1]) for k in keys}
        workers = max(1, min(len(keys), os.cpu_count() or 1))
        rate = _load_rate(self.adapter_key)
        self.stats.predicted_seconds = sum(weights.values()) / rate
        # largest first, so the parallel build ends together
        order = sorted(keys, key=lambda k: -weights[k])
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="taperay-compile") as pool:
            futures = {k: pool.submit(self._create, *k) for k in order}
            line = _ProgressLine(len(keys), self.stats.predicted_seconds) if progress else None
            while not all(f.done() for f in futures.values()):
                if line:
                    line.update(sum(f.done() for f in futures.values()))
                time.sleep(0.05)
            if line:
                line.finish()
            for k, f in futures.items():
                try:
                    self._pipelines[k] = f.result()
                except Exception as e:   # a driver that cannot compile the kernels
                    raise GpuError(f"building GPU kernel {k[0]} ({k[1]} registers) failed: {e}") from e
        self.stats.build_seconds = time.perf_counter() - t0
        _store_rate(self.adapter_key, sum(weights.values()) / self.stats.build_seconds)
        self._ready.set()

    def pipeline(self, kernel: str, variant: int | None):
        """The pipeline of ``kernel`` for register ``variant``. All exist after startup: a miss here
        is counted (and creates one) and tests prove there are none."""
        self._ready.wait()
        key = (kernel, variant if KERNELS[kernel][1] else None)
        with self._lock:
            pipe = self._pipelines.get(key)
            if pipe is not None:
                self.stats.cache_hits += 1
                return pipe
            self.stats.cache_misses += 1
        pipe = self._create(*key)
        with self._lock:
            self._pipelines[key] = pipe
        return pipe

    def __len__(self) -> int:
        return len(self._pipelines)


class _ProgressLine:
    """``building GPU kernels [#####-----] 12/20  3.1 s of ~6 s`` on stderr, moving by the clock."""

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


def _load_rate(key: str) -> float:
    try:
        rate = float(json.loads(RATE_FILE.read_text())[key])
        return rate if rate > 0 else DEFAULT_RATE
    except (OSError, ValueError, KeyError, TypeError):
        return DEFAULT_RATE


def _store_rate(key: str, rate: float):
    try:
        data = json.loads(RATE_FILE.read_text()) if RATE_FILE.exists() else {}
        if not isinstance(data, dict):
            data = {}
        data[key] = rate
        RATE_FILE.parent.mkdir(parents=True, exist_ok=True)
        RATE_FILE.write_text(json.dumps(data, indent=1, sort_keys=True))
    except (OSError, ValueError):
        pass   # a read-only home: the next process predicts from the default again


# ------------------------------------------------------------------------------------ context
class _Context:
    """The process's device and kernel set (one per process; rebuilt only after a device loss)."""

    def __init__(self, progress: bool):
        adapter = _get_adapter()
        if adapter is None:
            raise GpuError("no GPU adapter found (no Vulkan / Metal / DX12 driver)")
        self.adapter = adapter
        self.info = adapter_info()
        want = ("max_storage_buffer_binding_size", "max_buffer_size")
        limits = {k: adapter.limits[k.replace("_", "-")] for k in want}
        try:
            self.device = adapter.request_device_sync(label="taperay", required_limits=limits)
        except Exception as e:
            raise GpuError(f"could not open the GPU device {self.info['name']}: {e}") from e
        self.limits = {k: self.device.limits[k.replace("_", "-")] for k in want}
        warm = _warm_policy(self.info)
        key = f"{self.info['name']} | {self.info['driver']} | {self.info['backend']} | warm={warm}"
        self.kernels = KernelSet(self.device, key, progress, warm)


def _warm_policy(info: dict) -> bool:
    """Whether startup also runs each pipeline once (``TAPERAY_GPU_WARM=1/0`` decides; default: on
    hardware, where it costs milliseconds because drivers compile at creation, and off on software
    rasterisers, whose lazy per-pipeline JIT (~1-4 s each on lavapipe) would make startup ~40 s)."""
    env = os.environ.get("TAPERAY_GPU_WARM", "").strip()
    if env in ("0", "1"):
        return env == "1"
    return not info["software"]


_context: _Context | None = None
_context_lock = threading.Lock()


def _get_context(progress: bool = False) -> _Context:
    global _context
    with _context_lock:
        if _context is None:
            _context = _Context(progress)
        return _context


def _drop_context(ctx: _Context):
    global _context
    with _context_lock:
        if _context is ctx:
            _context = None


def kernels(progress: bool = False) -> KernelSet:
    """The process's kernel set, built on first use (every pipeline, in parallel)."""
    return _get_context(progress).kernels


# ------------------------------------------------------------------------------------ buffers
class _Buffer:
    """A storage buffer grown by doubling, with a host mirror so uploads write only changed bytes."""

    def __init__(self, device, usage, label: str):
        self.device, self.usage, self.label = device, usage, label
        self.capacity = 0
        self.buffer = None
        self.mirror = np.zeros(0, np.uint8)
        self.bytes_written = 0

    def ensure(self, nbytes: int) -> bool:
        """Room for ``nbytes``; True when the buffer was (re)created."""
        if self.buffer is not None and nbytes <= self.capacity:
            return False
        cap = max(MIN_BUFFER, self.capacity)
        while cap < nbytes:
            cap *= 2
        self.buffer = self.device.create_buffer(label=self.label, size=cap, usage=self.usage)
        self.capacity = cap
        self.mirror = np.zeros(0, np.uint8)
        return True

    def sync(self, data: np.ndarray):
        """Make the buffer hold ``data`` (bytes), writing only the span that differs."""
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        self.ensure(max(raw.size, 4))
        n = raw.size
        if n == 0:
            return
        old = self.mirror
        if old.size >= n:
            diff = np.flatnonzero(old[:n] != raw)
            if diff.size == 0:
                self.mirror = raw.copy() if old.size != n else old
                return
            lo, hi = int(diff[0]) & ~3, min(n, (int(diff[-1]) + 4) & ~3)
        else:
            lo, hi = 0, n
        self.write(lo, raw[lo:hi])
        self.mirror = raw.copy()

    def write(self, offset: int, raw: np.ndarray):
        raw = np.ascontiguousarray(raw).view(np.uint8)
        pad = (-raw.size) % 4
        if pad:
            raw = np.concatenate([raw, np.zeros(pad, np.uint8)])
        self.device.queue.write_buffer(self.buffer, offset, raw)
        self.bytes_written += raw.size


_TAPE_ARRAYS = ("instrs", "params", "materials", "instances", "bvh")


def _guarded(method):
    """A GpuWalker method that uses the device: picks up a rebuilt context after a device loss and
    turns every driver / wgpu failure into GpuError (a TaperayError the CLI falls back on)."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        self._ensure_context()
        try:
            return method(self, *args, **kwargs)
        except TaperayError:
            raise
        except Exception as e:
            self._lost(e)
    return call


# ------------------------------------------------------------------------------------ walker
class GpuWalker:
    """The tape on the GPU: the same API and results as ``CpuWalker`` (float32), plus uploads.

    Every array returned is float32 / uint32 / int32 like the twin's. Tapes are validated, then
    uploaded as buffer writes of the bytes that changed; the kernels are the process's one set.
    """

    name = "gpu"

    def __init__(self, progress: bool = False):
        self._ctx = _get_context(progress)
        self._validated = ValidatedTapes()
        self.resumed_dispatches = 0
        self._uploaded: int | None = None    # id() of the tape the buffers hold
        self._init_buffers()

    def _init_buffers(self):
        wgpu = _wgpu()
        dev = self._ctx.device
        st = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST | wgpu.BufferUsage.COPY_SRC
        self._tape_bufs = {n: _Buffer(dev, st, n) for n in _TAPE_ARRAYS}
        self._points = _Buffer(dev, st, "points")
        self._out_f = _Buffer(dev, st, "out_f")
        self._out_u = _Buffer(dev, st, "out_u")
        self._accum = _Buffer(dev, st, "accum")
        self._uniform = _Buffer(dev, wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST, "uniforms")
        self._counters = _Buffer(dev, st, "counters")
        self._bind_group = None
        self._bind_key = None
        self._uploaded = None
        self._arena_words = 0                # pruned images: the arena grown to after an overflow
        self._point_arena_words = 0          # evaluate_pruned: the same
        self._cell_arena_words = 0           # pruned march cells: the same
        software = self._ctx.info["software"]
        self._iter_limits = ((SOFTWARE_ITER_CAP, SOFTWARE_ITER_BUDGET) if software
                             else (HARDWARE_ITER_CAP, HARDWARE_ITER_BUDGET))

    def _ensure_context(self):
        """After a device loss the process's context is rebuilt: pick it up, with new buffers."""
        if self._ctx is not _context:
            self._ctx = _get_context()
            self._init_buffers()

    # -- facts
    @staticmethod
    def available() -> bool:
        """Whether a GPU adapter exists (lavapipe counts); building kernels is not attempted."""
        try:
            return _get_adapter() is not None
        except ImportError:
            return False

    @property
    def adapter_name(self) -> str:
        return self._ctx.info["name"] + (" (software)" if self._ctx.info["software"] else "")

    @property
    def info(self) -> dict:
        return dict(self._ctx.info, limits=dict(self._ctx.limits))

    @property
    def kernels(self) -> KernelSet:
        return self._ctx.kernels

    def stats(self) -> dict:
        """Kernel-cache counters plus the bytes this walker has written to tape buffers."""
        out = self._ctx.kernels.stats.as_dict()
        out["pipelines"] = len(self._ctx.kernels)
        out["tape_bytes_written"] = sum(b.bytes_written for b in self._tape_bufs.values())
        return out

    # -- tapes
    def _check(self, tape: Tape):
        self._validated.check(tape)
        variant = variant_for(tape.n_regs)
        limit = self._ctx.limits["max_storage_buffer_binding_size"]
        for name in _TAPE_ARRAYS:
            nbytes = getattr(tape, name).nbytes
            if nbytes > limit:
                raise TaperayError(f"{tape.source or 'tape'}: {name} take {nbytes} bytes; the GPU binds at "
                                   f"most {limit} bytes per buffer")
        return variant

    @_guarded
    def upload(self, tape: Tape) -> int:
        """Validate ``tape`` and make the GPU buffers hold it (writing only changed bytes).
        Returns the register variant its kernels use."""
        variant = self._check(tape)
        for name in _TAPE_ARRAYS:
            self._tape_bufs[name].sync(getattr(tape, name))
        self._uploaded = id(tape)
        return variant

    @_guarded
    def set_param(self, tape: Tape, name: str, value) -> None:
        """Set a named parameter on ``tape`` (``Tape.set_param``: refitting its bounds when it came
        from a scene); when ``tape`` is the one on the GPU, write just the 4 bytes of each slot
        holding it, or, when the refit changed more, the spans that differ (else the next use
        uploads the difference)."""
        refitted = tape.set_param(name, value)
        buf = self._tape_bufs["params"]
        if self._uploaded != id(tape):
            return
        if refitted or buf.mirror.size != tape.params.nbytes:
            self.upload(tape)
            return
        for slot in sorted(set(int(i) for i in tape.names[name])):
            chunk = tape.params[slot:slot + 1].view(np.uint8)
            buf.write(4 * slot, chunk)
            buf.mirror[4 * slot: 4 * slot + 4] = chunk

    # -- dispatch plumbing
    def _bind(self):
        bufs = [self._tape_bufs[n].buffer for n in _TAPE_ARRAYS] + [
            self._uniform.buffer, self._points.buffer, self._out_f.buffer, self._out_u.buffer,
            self._accum.buffer, self._counters.buffer]
        key = tuple(id(b) for b in bufs)
        if key != self._bind_key:
            self._bind_group = self._ctx.device.create_bind_group(
                layout=self._ctx.kernels.bind_group_layout,
                entries=[{"binding": i, "resource": {"buffer": b, "offset": 0, "size": b.size}}
                         for i, b in enumerate(bufs)])
            self._bind_key = key
        return self._bind_group

    def _uniforms(self, tape: Tape, n_items: int, width=0, height=0, sample=0, rect=(0, 0, 0, 0),
                  extra=(0, 0, 0, 0), camera=None, settings=None) -> np.ndarray:
        """The Uniforms struct (bindings.wgsl) as uint32 words; word 7 (resume) set per dispatch."""
        u = np.zeros(UNIFORM_BYTES // 4, np.uint32)
        u[:7] = (len(tape.instrs), n_items, width, height, sample, *self._iter_limits)
        f = u.view(np.float32)
        f[8:12] = rect
        f[12:16] = extra
        if camera is not None:
            f[16:32] = camera
        if settings is not None:
            f[32:32 + PACK_LEN] = settings
        return u

    def _prepare_outputs(self, n_f: int, n_u: int, n_accum: int = 0):
        limit = self._ctx.limits["max_storage_buffer_binding_size"]
        need = max(4 * n_f, 4 * n_u, 16 * n_accum)
        if need > limit:
            raise TaperayError(f"this request needs a {need >> 20} MiB GPU buffer; the adapter binds at most "
                               f"{limit >> 20} MiB (render a smaller image or use the CPU walker)")
        self._out_f.ensure(4 * max(n_f, 1))
        self._out_u.ensure(4 * max(n_u, 1))
        self._accum.ensure(16 * max(n_accum, 1))
        self._points.ensure(MIN_BUFFER)
        self._uniform.ensure(UNIFORM_BYTES)
        self._counters.ensure(COUNTERS_BYTES)

    def _encode(self, passes: list[tuple], variant: int, uniforms: np.ndarray, resume: int, repeat: int = 1):
        """Write the uniforms and zeroed counters; return the command buffer of the (kernel,
        n_items) passes, ``repeat`` times in a row (each repeat clears the counters first). A pass
        (kernel, n_items, level) is preceded by copying ``level`` from the level table in the
        points buffer into U.extra.w (_pruned_setup writes the table)."""
        dev = self._ctx.device
        uniforms[7] = resume
        self._uniform.write(0, uniforms)
        self._counters.write(0, np.zeros(COUNTERS_BYTES // 4, np.uint32))
        bg = self._bind()
        enc = dev.create_command_encoder()
        for r in range(repeat):
            if r:
                enc.clear_buffer(self._counters.buffer, 0, COUNTERS_BYTES)
            for kernel, n, *level in passes:
                if level:
                    enc.copy_buffer_to_buffer(self._points.buffer, 4 * level[0], self._uniform.buffer,
                                              UNIFORM_LEVEL_BYTE, 4)
                groups = max(1, -(-n // WG))
                gx = min(groups, MAX_GROUPS_X)
                cp = enc.begin_compute_pass()
                cp.set_pipeline(self._ctx.kernels.pipeline(kernel, variant))
                cp.set_bind_group(0, bg)
                cp.dispatch_workgroups(gx, -(-groups // gx), 1)
                cp.end()
        return enc.finish()

    def _submit(self, passes: list[tuple], variant: int, uniforms: np.ndarray, resume: int):
        self._ctx.device.queue.submit([self._encode(passes, variant, uniforms, resume)])

    def _dispatch(self, tape: Tape, passes: list[tuple[str, int]], variant: int, uniforms: np.ndarray):
        """Run the (kernel, n_items) passes in order. Resumable passes (march, light) are
        dispatched again until no pixel is unfinished; an evaluation that hit the iteration cap
        is a TaperayError naming the tape."""
        pending: list[tuple[str, int]] = []
        for kernel, n in passes + [("", 0)]:
            if kernel in RESUMABLE or not kernel:
                if pending:
                    self._submit(pending, variant, uniforms, 0)
                    self._check_counters(tape)
                    pending = []
                if not kernel:
                    break
                resume = 0
                while True:
                    self._submit([(kernel, n)], variant, uniforms, resume)
                    if self._check_counters(tape) == 0:
                        break
                    resume = 1
                    self.resumed_dispatches += 1
            else:
                pending.append((kernel, n))

    def _check_counters(self, tape: Tape) -> int:
        """Waits for the GPU; raises on overflow; returns the unfinished pixel count."""
        c = np.frombuffer(self._ctx.device.queue.read_buffer(self._counters.buffer, 0, COUNTERS_BYTES), np.uint32)
        if c[0]:
            raise TaperayError(
                f"{tape.source or 'tape'}: one evaluation of this tape needs more than {self._iter_limits[0]} "
                f"interpreter steps, the most this GPU adapter ({self._ctx.info['name']}) runs per "
                f"invocation ({int(c[0])} evaluations stopped); use the CPU walker")
        return int(c[1])

    def _read(self, buf: _Buffer, dtype, count: int, offset_items: int = 0) -> np.ndarray:
        itemsize = np.dtype(dtype).itemsize
        if count == 0:
            return np.zeros(0, dtype)
        raw = self._ctx.device.queue.read_buffer(buf.buffer, offset_items * itemsize, count * itemsize)
        return np.frombuffer(raw, dtype, count).copy()

    def _lost(self, e: Exception):
        _drop_context(self._ctx)
        raise GpuError(f"the GPU failed ({self._ctx.info['name']}): {e}") from e

    def _run_points(self, tape: Tape, points: np.ndarray, kernel: str, per_point: int,
                    out_dtypes: tuple, extra=(0, 0, 0, 0)) -> list[np.ndarray]:
        """Run a point kernel (``per_point`` items per point) in chunks that fit the binding
        limit; returns, per dtype in ``out_dtypes`` (out_f, out_u), the concatenated outputs."""
        variant = self.upload(tape)
        pts = np.ascontiguousarray(np.asarray(points, np.float32).reshape(-1, 3))
        limit = self._ctx.limits["max_storage_buffer_binding_size"]
        chunk = max(1, min(limit // 12, limit // (4 * per_point)))
        outs: list[list[np.ndarray]] = [[] for _ in out_dtypes]
        for s in range(0, len(pts), chunk):
            part = pts[s:s + chunk]
            n_items = per_point * len(part)
            self._prepare_outputs(n_items, n_items)
            self._points.sync(part)
            self._dispatch(tape, [(kernel, n_items)], variant, self._uniforms(tape, n_items, extra=extra))
            for o, (buf, dtype) in zip(outs, zip((self._out_f, self._out_u), out_dtypes)):
                o.append(self._read(buf, dtype, n_items))
        return [np.concatenate(o) for o in outs]

    # -- the CpuWalker API
    @_guarded
    def evaluate(self, tape: Tape, points) -> tuple[np.ndarray, np.ndarray]:
        """(N,) float32 distances and (N,) uint32 material ids at the (N, 3) points."""
        pts = point_array(points, "evaluate")
        if len(pts) == 0:
            self.upload(tape)
            return np.zeros(0, np.float32), np.zeros(0, np.uint32)
        d, m = self._run_points(tape, pts, "eval_points", 1, (np.float32, np.uint32))
        return d, m

    @_guarded
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

    @_guarded
    def field_image(self, tape: Tape, width: int, height: int, rect=(-1.0, 1.0, -1.0, 1.0),
                    z: float = 0.0) -> np.ndarray:
        """(H, W) float32 field on the plane z = const; rect = (x0, x1, y0, y1); pixel centres;
        row 0 is y = y1 (the top), column 0 is x = x0."""
        if width < 1 or height < 1:
            raise TaperayError(f"field_image: size {width}x{height} must be at least 1x1")
        variant = self.upload(tape)
        n = width * height
        self._prepare_outputs(n, 1)
        u = self._uniforms(tape, n, width, height, rect=[float(v) for v in rect], extra=(z, 0, 0, 0))
        self._dispatch(tape, [("field_image", n)], variant, u)
        return self._read(self._out_f, np.float32, n).reshape(height, width)

    def _pruned_setup(self, tape: Tape, width: int, height: int, rect, z: float, tiles, sign: bool):
        """(variant, passes, uniforms, arena words) of a pruned image: prune_tiles once per tile
        level, coarse to fine, then pruned_image over 8 x 8 pixel blocks; out_u holds the tile
        headers and an arena of ``self._arena_words`` (shaders/prune.wgsl)."""
        if width < 1 or height < 1:
            raise TaperayError(f"pruned image: size {width}x{height} must be at least 1x1")
        sizes = tile_levels(tiles)
        variant = self.upload(tape)
        counts = level_tile_counts(sizes, width, height)
        header = PRUNE_HEADER_WORDS * sum(counts)
        limit = self._ctx.limits["max_storage_buffer_binding_size"] // 4
        if header + len(tape.instrs) > limit:
            raise TaperayError(f"pruned image: tiles {sizes} at {width}x{height} make {sum(counts)} tiles, whose "
                               f"headers alone exceed the adapter's {limit >> 18} MiB binding limit; use larger tiles")
        # the arena grown to after an overflow, else a guess per image: level 0's scratch plus a
        # sixteenth of the tape per level-0 tile, and 64 words per tile
        guess = counts[0] * (len(tape.instrs) // 4 + 8) + 64 * sum(counts)
        arena = min(self._arena_words or guess, limit - header)
        n = width * height
        self._prepare_outputs(n, header + arena)
        camera = np.zeros(16, np.float32)
        camera[:len(sizes)] = sizes
        u = self._uniforms(tape, n, width, height, rect=[float(v) for v in rect],
                           extra=(z, len(sizes), 1.0 if sign else 0.0, 0), camera=camera)
        u[20] = arena                       # U.camera[1].x: the arena's size in words
        self._points.sync(np.arange(MAX_TILE_LEVELS, dtype=np.float32))   # the levels the passes copy
        blocks = -(-width // 8) * -(-height // 8)
        passes = [("prune_tiles", c, level) for level, c in enumerate(counts)] + [("pruned_image", 64 * blocks)]
        return variant, passes, u, arena

    def _pruned_image(self, tape: Tape, width: int, height: int, rect, z: float, tiles,
                      sign: bool) -> np.ndarray:
        """The tile levels and the pixel pass in one submission; (H, W) float32 out_f. When a
        tile found no arena room the image is discarded and run again with a larger arena (kept
        for later calls), up to the adapter's binding limit, past which it is a TaperayError."""
        while True:
            variant, passes, u, arena = self._pruned_setup(tape, width, height, rect, z, tiles, sign)
            self._submit(passes, variant, u, 0)
            self._check_counters(tape)
            c = self._read(self._counters, np.uint32, 4)
            if not c[PRUNE_ARENA_FULL]:
                break
            limit = self._ctx.limits["max_storage_buffer_binding_size"] // 4
            header = PRUNE_HEADER_WORDS * sum(level_tile_counts(tile_levels(tiles), width, height))
            if header + arena >= limit:
                raise TaperayError(f"{tape.source or 'tape'}: the pruned tapes of tiles {tile_levels(tiles)} at "
                                   f"{width}x{height} need more than the adapter's {limit >> 18} MiB binding "
                                   "limit; use larger tiles or the CPU walker")
            self._arena_words = max(2 * arena, int(c[PRUNE_ARENA]))
        return self._read(self._out_f, np.float32, width * height).reshape(height, width)

    @_guarded
    def sign_image(self, tape: Tape, width: int, height: int, rect=(-1.0, 1.0, -1.0, 1.0),
                   z: float = 0.0, tiles=PRUNE_TILES) -> np.ndarray:
        """(H, W) bool: True where the field is < 0, with field_image's pixel centres. Arithmetic
        tapes are pruned on the GPU (shaders/prune.wgsl) per tile of each level of ``tiles`` (one
        size, or sizes coarse to fine, pixels; each level prunes its parent's pruned tape): tiles
        whose interval is decided are filled without evaluating below them, the others' pixels
        evaluate their finest tile's pruned tape (exact: the values of field_image). Other
        tapes: field_image < 0."""
        from .pruning import is_arithmetic
        if not is_arithmetic(tape):
            return self.field_image(tape, width, height, rect, z) < 0
        return self._pruned_image(tape, width, height, rect, z, tiles, True) < 0

    @_guarded
    def field_image_pruned(self, tape: Tape, width: int, height: int, rect=(-1.0, 1.0, -1.0, 1.0),
                           z: float = 0.0, tiles=PRUNE_TILES) -> np.ndarray:
        """(H, W) float32 field, every pixel evaluated with its finest tile's pruned tape (tile
        levels as sign_image): bit-identical to field_image. Non-arithmetic tapes: field_image."""
        from .pruning import is_arithmetic
        if not is_arithmetic(tape):
            return self.field_image(tape, width, height, rect, z)
        return self._pruned_image(tape, width, height, rect, z, tiles, False)

    @_guarded
    def prune_levels(self, tape: Tape, width: int, height: int, rect=(-1.0, 1.0, -1.0, 1.0),
                     z: float = 0.0, tiles=PRUNE_TILES, sign: bool = False) -> list[dict]:
        """Runs the pruned image of an arithmetic tape and reads back its tile headers: per level,
        the tile size, tiles, tiles decided inside / outside, tiles with a pruned tape and their
        mean length in records; plus (in each entry) the arena words the image used."""
        self._pruned_image(tape, width, height, rect, z, tiles, sign)
        sizes = tile_levels(tiles)
        counts = level_tile_counts(sizes, width, height)
        hdr = self._read(self._out_u, np.uint32, PRUNE_HEADER_WORDS * sum(counts)).reshape(-1, 3)
        used = int(self._read(self._counters, np.uint32, 4)[PRUNE_ARENA])
        out, at = [], 0
        for size, count in zip(sizes, counts):
            h = hdr[at:at + count]
            at += count
            cls = h[:, 2]   # prune.wgsl: 0 ambiguous, 1 inside, 2 outside, 3 failed, 4 empty
            taped = cls == 0 if sign else cls <= 2
            out.append(dict(tile=size, tiles=int((cls != 4).sum()), inside=int((cls == 1).sum()),
                            outside=int((cls == 2).sum()), with_tape=int(taped.sum()),
                            mean_length=float(h[taped, 1].mean()) if taped.any() else 0.0, arena_words=used))
        return out

    def _point_chunk(self) -> int:
        """Points per evaluate_pruned dispatch: their words, their cells' boxes and headers (finer
        levels: at most 4 cells a point, 16/3 over the levels, plus level 0's) fit the binding
        limit, the index fits a float."""
        limit = self._ctx.limits["max_storage_buffer_binding_size"] // 4
        return max(1, min(POINT_CHUNK, limit // (POINT_WORDS + 6 * 6 + 3 * 6)))

    def _points_setup(self, tape: Tape, pts: np.ndarray, cells, levels: int):
        """(variant, passes, uniforms, arena words, header words) of the pruned points of one chunk
        (the points buffer written: level table, cell boxes, sorted points): prune_tiles once
        per cell level, coarse to fine, then pruned_points (shaders/prune.wgsl, points mode)."""
        variant = self.upload(tape)
        n = len(pts)
        if cells is None:
            cells = min(POINT_CELLS, max(1, n // POINT_MIN_PER_CELL))
        counts, words, first = point_cells(pts, levels, cells)
        header = PRUNE_HEADER_WORDS * sum(counts)
        limit = self._ctx.limits["max_storage_buffer_binding_size"] // 4
        if header + len(tape.instrs) > limit or len(words) > limit or sum(counts) >= 1 << 24:
            raise TaperayError(f"evaluate_pruned: {sum(counts)} cells for {n} points exceed the adapter's "
                               f"{limit >> 18} MiB binding limit; use fewer cells")
        self._points.ensure(4 * len(words))
        self._points.write(0, words)
        self._points.mirror = np.zeros(0, np.uint8)    # (the next sync writes everything)
        boxes = words[4:first].reshape(-1, 6)
        filled = int((~(boxes[:, 0] > boxes[:, 3])).sum())
        filled0 = int((~(boxes[:counts[0], 0] > boxes[:counts[0], 3])).sum())
        guess = filled0 * (len(tape.instrs) // 4 + 8) + 64 * filled
        arena = min(self._point_arena_words or guess, limit - header)
        self._prepare_outputs(n, header + arena)
        camera = np.zeros(16, np.float32)
        camera[:len(counts)] = counts       # points mode: the cells of each level
        u = self._uniforms(tape, n, extra=(0.0, len(counts), 2.0, 0), camera=camera)
        u[20] = arena                       # U.camera[1].x: the arena's size in words
        u[21] = first                       # U.camera[1].y: the points' first word
        passes = [("prune_tiles", c, level) for level, c in enumerate(counts)] + [("pruned_points", n)]
        return variant, passes, u, arena, header

    def _pruned_points(self, tape: Tape, pts: np.ndarray, cells, levels: int) -> np.ndarray:
        """One chunk's values in the caller's order; the arena grown and the points run again when
        a cell found no room (as _pruned_image)."""
        while True:
            variant, passes, u, arena, header = self._points_setup(tape, pts, cells, levels)
            self._submit(passes, variant, u, 0)
            self._check_counters(tape)
            c = self._read(self._counters, np.uint32, 4)
            if not c[PRUNE_ARENA_FULL]:
                return self._read(self._out_f, np.float32, len(pts))
            limit = self._ctx.limits["max_storage_buffer_binding_size"] // 4
            if header + arena >= limit:
                raise TaperayError(f"{tape.source or 'tape'}: the pruned tapes of {len(pts)} points' cells need "
                                   f"more than the adapter's {limit >> 18} MiB binding limit; use fewer cells "
                                   "or GpuWalker.evaluate")
            self._point_arena_words = max(2 * arena, int(c[PRUNE_ARENA]))

    @staticmethod
    def _point_args(cells, levels):
        if cells is not None and not (isinstance(cells, (int, np.integer)) and 1 <= cells <= 1 << 22):
            raise TaperayError(f"evaluate_pruned: cells must be a whole number in 1..{1 << 22}, got {cells!r}")
        if not (isinstance(levels, (int, np.integer)) and 1 <= levels <= MAX_TILE_LEVELS):
            raise TaperayError(f"evaluate_pruned: levels must be 1..{MAX_TILE_LEVELS}, got {levels!r}")

    @_guarded
    def evaluate_pruned(self, tape: Tape, points, cells: int | None = None,
                        levels: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """(N,) float32 values and (N,) uint32 material ids at the (N, 3) points, as evaluate, bit
        for bit. An arithmetic tape is pruned on the GPU (shaders/prune.wgsl) per cell of a grid
        over the points' bounding box: the host sorts the points by cell (counting sort) and finds
        each cell's box (the range of its points); prune_tiles prunes the full tape over each
        level-0 cell's box (``cells`` of them, default min(POINT_CELLS, N / POINT_MIN_PER_CELL),
        shared among the axes the points span), each of ``levels`` - 1 finer levels its parent's
        tape over 4 sub-cells per such axis; pruned_points runs each point on its finest cell's
        tape, a warp's points sharing a cell. Other tapes: evaluate."""
        from .pruning import is_arithmetic
        pts = point_array(points, "evaluate_pruned")
        self._point_args(cells, levels)
        if not is_arithmetic(tape) or len(pts) == 0:
            return self.evaluate(tape, pts)
        pts = np.ascontiguousarray(pts, np.float32)
        chunk = self._point_chunk()
        d = np.concatenate([self._pruned_points(tape, pts[s:s + chunk], cells, levels)
                            for s in range(0, len(pts), chunk)])
        return d, np.zeros(len(pts), np.uint32)

    @_guarded
    def prune_levels_points(self, tape: Tape, points, cells: int | None = None, levels: int = 1) -> list[dict]:
        """evaluate_pruned of an arithmetic tape (one chunk of points), then its cells' headers read
        back: per level, the cells, cells with points, decided inside / outside, and the mean
        pruned tape length in records over the cells with points; plus the arena words used."""
        self._point_args(cells, levels)
        pts = np.ascontiguousarray(point_array(points, "prune_levels_points", np.float32))
        if not 1 <= len(pts) <= self._point_chunk():
            raise TaperayError(f"prune_levels_points: 1..{self._point_chunk()} points, got {len(pts)}")
        self.evaluate_pruned(tape, pts, cells, levels)
        _, passes, _, _, _ = self._points_setup(tape, pts, cells, levels)   # (the same cells)
        return [dict(cells=len(h), with_points=int(taped.sum()), inside=int((h[:, 2] == 1).sum()),
                     outside=int((h[:, 2] == 2).sum()),
                     mean_length=float(h[taped, 1].mean()) if taped.any() else 0.0, arena_words=used)
                for h, taped, used in self._cell_headers([p[1] for p in passes[:-1]], 0)]

    def _cell_headers(self, counts: list[int], base: int):
        """Per level of points-mode cells (``counts`` of them, headers from out_u word ``base``):
        its (cells, 3) headers, which cells have a pruned tape, the arena words used."""
        hdr = self._read(self._out_u, np.uint32, PRUNE_HEADER_WORDS * sum(counts), base).reshape(-1, 3)
        used = int(self._read(self._counters, np.uint32, 4)[PRUNE_ARENA])
        out, at = [], 0
        for count in counts:
            h = hdr[at:at + count]
            at += count
            out.append((h, h[:, 2] <= 2, used))   # prune.wgsl: 0 ambiguous, 1 inside, 2 outside, 3 failed, 4 empty
        return out

    @_guarded
    def march_cell_levels(self, tape: Tape, settings: RenderSettings | None = None, view: str = "shade",
                          cells=MARCH_CELLS) -> list[dict]:
        """Prunes an arithmetic tape over the cells of its march box (as march does) and reads
        their headers back: per level, the cells, those with a pruned tape (the outside cell's
        empty sub-cells have none) and their mean length in records, plus the arena words used."""
        cells = self._march_cells_for(tape, cells)
        if cells is None:
            raise TaperayError(f"{tape.source or 'tape'}: march cells are for arithmetic tapes only")
        variant = self.upload(tape)
        counts = self._prune_cells(tape, (settings or RenderSettings()).pack(tape, view), variant, 0, cells)[1]
        return [dict(cells=len(h), with_tape=int(taped.sum()),
                     mean_length=float(h[taped, 1].mean()) if taped.any() else 0.0, arena_words=used)
                for h, taped, used in self._cell_headers(counts, 0)]

    def _time_passes(self, tape: Tape, passes: list[tuple], variant: int, uniforms: np.ndarray,
                     repeat: int) -> float:
        """GPU seconds of one run of ``passes``: encoded once and ``repeat`` times in a row, one
        command buffer each, submitted and waited for (after a warm-up of the single one):
        (t_repeat - t_1) / (repeat - 1)."""
        def run(k: int) -> float:
            cb = self._encode(passes, variant, uniforms, 0, repeat=k)
            t0 = time.perf_counter()
            self._ctx.device.queue.submit([cb])
            self._check_counters(tape)
            return time.perf_counter() - t0

        run(1)
        t1 = run(1)
        return max(run(repeat) - t1, 0.0) / (repeat - 1)

    @_guarded
    def gpu_seconds_points(self, tape: Tape, points, pruned: bool = True, cells: int | None = None,
                           levels: int = 1, repeat: int = 8) -> float:
        """GPU time of one evaluation of (at most one chunk of) points, as gpu_seconds: the passes
        (pruned: the cell levels and pruned_points, after one evaluate_pruned that sizes the arena;
        else eval_points) encoded ``repeat`` times in one command buffer, (t_repeat - t_1) /
        (repeat - 1); no host bucketing, upload or read-back."""
        if repeat < 2:
            raise TaperayError(f"gpu_seconds_points: repeat must be >= 2, got {repeat}")
        self._point_args(cells, levels)
        pts = np.ascontiguousarray(point_array(points, "gpu_seconds_points", np.float32))
        if not 1 <= len(pts) <= self._point_chunk():
            raise TaperayError(f"gpu_seconds_points: 1..{self._point_chunk()} points, got {len(pts)}")
        n = len(pts)
        if pruned:
            self.evaluate_pruned(tape, pts, cells, levels)   # sizes the arena
            variant, passes, u, _, _ = self._points_setup(tape, pts, cells, levels)
        else:
            variant = self.upload(tape)
            self._prepare_outputs(n, n)
            self._points.sync(pts)
            u = self._uniforms(tape, n)
            passes = [("eval_points", n)]
        return self._time_passes(tape, passes, variant, u, repeat)

    @_guarded
    def gpu_seconds(self, tape: Tape, width: int, height: int, rect=(-1.0, 1.0, -1.0, 1.0), z: float = 0.0,
                    tiles=None, sign: bool = False, repeat: int = 8, tile_passes_only: bool = False,
                    levels: int | None = None) -> float:
        """GPU time of one image, without host work or reading it back: the image's passes are
        encoded once, and ``repeat`` times in a row, as one command buffer each; each is then
        submitted and waited for; returns (t_repeat - t_1) / (repeat - 1). ``tiles`` None: the
        unpruned field_image kernel; else the pruned image (``sign`` as sign_image), or with
        ``tile_passes_only`` its prune_tiles passes alone (with ``levels``, only those of the first
        ``levels`` tile levels)."""
        if repeat < 2:
            raise TaperayError(f"gpu_seconds: repeat must be >= 2, got {repeat}")
        if tiles is None:
            variant = self.upload(tape)
            n = width * height
            self._prepare_outputs(n, 1)
            u = self._uniforms(tape, n, width, height, rect=[float(v) for v in rect], extra=(z, 0, 0, 0))
            passes = [("field_image", n)]
        else:
            self._pruned_image(tape, width, height, rect, z, tiles, sign)   # sizes the arena
            variant, passes, u, _ = self._pruned_setup(tape, width, height, rect, z, tiles, sign)
            if tile_passes_only:
                passes = passes[:-1] if levels is None else passes[:max(1, min(levels, len(passes) - 1))]
        return self._time_passes(tape, passes, variant, u, repeat)

    @staticmethod
    def _march_cells_for(tape: Tape, cells) -> tuple[int, int] | None:
        """The (g0, levels) of a pruned march of ``tape``, or None: ``cells`` None (off), "auto"
        (MARCH_CELLS for arithmetic tapes of at least MARCH_CELLS_MIN_RECORDS records) or
        (g0, levels) (any arithmetic tape)."""
        from .pruning import is_arithmetic
        if cells is None or not is_arithmetic(tape):
            return None
        if isinstance(cells, str) and cells == "auto":
            return MARCH_CELLS if len(tape.instrs) >= MARCH_CELLS_MIN_RECORDS else None
        ok = (isinstance(cells, tuple) and len(cells) == 2 and all(isinstance(v, (int, np.integer)) for v in cells)
              and 1 <= cells[0] <= 64 and 1 <= cells[1] <= MAX_TILE_LEVELS)
        if not ok:
            raise TaperayError(f"cells must be None, 'auto' or (g0 in 1..64, levels in 1..{MAX_TILE_LEVELS}), "
                               f"got {cells!r}")
        return int(cells[0]), int(cells[1])

    def _prune_cells(self, tape: Tape, packed: np.ndarray, variant: int, n: int, cells: tuple[int, int]):
        """Prunes ``tape`` over the cells (march_cells) of the march box in ``packed``: prune_tiles
        once per level (points mode) in a submission of its own, the headers and arena in out_u
        after the n pixels' outputs (from word 9n), the arena grown and the cells run again on
        overflow. Returns the cell descriptor's word in the points buffer (U.extra.x of the
        _cells kernels), the cells per level and the (passes, uniforms) that pruned them."""
        from .cpu import _packed
        g0, levels = cells
        lo, hi = np.asarray(_packed(packed, "box_lo", "box_hi"), np.float64).reshape(2, 3)
        counts, words, desc = _march_cells_cached(tuple(lo), tuple(hi), g0, levels)   # (the same box each frame)
        words = words.copy()
        base = 9 * n
        words[desc + 8:].view(np.uint32)[0] = base
        header = PRUNE_HEADER_WORDS * sum(counts)
        limit = self._ctx.limits["max_storage_buffer_binding_size"] // 4
        if base + header + len(tape.instrs) > limit or len(words) > limit or sum(counts) >= 1 << 24:
            raise TaperayError(f"pruned march: {sum(counts)} cells {cells} at {n} pixels exceed the adapter's "
                               f"{limit >> 18} MiB binding limit; use fewer cells or levels")
        self._points.sync(words)
        filled = 1 + sum(g0 ** 3 * 64 ** m for m in range(levels))   # (not the outside cell's empty sub-cells)
        camera = np.zeros(16, np.float32)
        camera[:levels] = counts
        u = self._uniforms(tape, 0, extra=(0.0, levels, 2.0, 0), camera=camera)
        u[22] = base                        # U.camera[1].z: the headers' first word
        passes = [("prune_tiles", c, level) for level, c in enumerate(counts)]
        while True:
            guess = counts[0] * (len(tape.instrs) // 4 + 8) + 64 * filled
            arena = min(self._cell_arena_words or guess, limit - base - header)
            self._prepare_outputs(8 * n, base + header + arena, n)
            u[20] = arena                   # U.camera[1].x: the arena's size in words
            self._submit(passes, variant, u, 0)
            self._check_counters(tape)
            c = self._read(self._counters, np.uint32, 4)
            if not c[PRUNE_ARENA_FULL]:
                return desc, counts, (passes, u)
            if base + header + arena >= limit:
                raise TaperayError(f"{tape.source or 'tape'}: the pruned tapes of the march cells {cells} need "
                                   f"more than the adapter's {limit >> 18} MiB binding limit; use fewer cells")
            self._cell_arena_words = max(2 * arena, int(c[PRUNE_ARENA]))

    @staticmethod
    def _on_cells(passes: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """A frame's passes on the pruned cell tapes: march and light as their _cells pipelines;
        no surface pass (an arithmetic tape's material is 0 everywhere, as march_cells writes)."""
        return [(k + "_cells" if k in ("march", "light") else k, m) for k, m in passes if k != "surface"]

    @_guarded
    def gpu_seconds_frame(self, tape: Tape, camera: Camera | None, width: int, height: int, view: str = "shade",
                          cells="auto", repeat: int = 8) -> dict:
        """GPU time of one sample of render(``view``), as gpu_seconds ((t_K - t_1) / (K - 1), K =
        ``repeat`` runs encoded in one command buffer; no host work or read-back): "cells", the
        prune_tiles passes over the march cells (0 when the frame is not pruned), and "frame",
        the frame's passes (march, light, shade, resolve). A frame that needs more than one
        dispatch (march / light's iteration budget) is a TaperayError."""
        if repeat < 2:
            raise TaperayError(f"gpu_seconds_frame: repeat must be >= 2, got {repeat}")
        camera, packed, variant, n = self._image_setup(tape, camera, width, height, None, view)
        frame = [(k, n) for k in _view_passes(view) + ["resolve"]]
        u = self._uniforms(tape, n, width, height, camera=camera.pack(), settings=packed)
        out = {"cells": 0.0}
        cells = self._march_cells_for(tape, cells) if view != "slice" else None
        if cells is not None:
            desc, _, (passes, cu) = self._prune_cells(tape, packed, variant, n, cells)
            out["cells"] = self._time_passes(tape, passes, variant, cu, repeat)
            u[12] = desc
            frame = self._on_cells(frame)
        self._submit(frame, variant, u, 0)
        if self._check_counters(tape):
            raise TaperayError(f"gpu_seconds_frame: a {width}x{height} {view} frame of {tape.source or 'tape'} "
                               "needs more than one dispatch on this adapter")
        out["frame"] = self._time_passes(tape, frame, variant, u, repeat)
        return out

    def _image_setup(self, tape: Tape, camera: Camera | None, width: int, height: int,
                     settings: RenderSettings | None, view: str):
        if width < 1 or height < 1:
            raise TaperayError(f"image size {width}x{height} must be at least 1x1")
        settings = settings or RenderSettings()
        packed = settings.pack(tape, view)
        camera = camera or auto_camera(tape.bounds)
        variant = self.upload(tape)
        n = width * height
        self._prepare_outputs(8 * n, 9 * n, n)
        return camera, packed, variant, n

    def _frame(self, tape: Tape, camera: Camera | None, width: int, height: int,
               settings: RenderSettings | None, view: str, passes: list[str], cells, samples: int = 1,
               final: tuple[str, ...] = ()) -> Camera:
        """Dispatches ``passes`` (kernel names, n pixels each) for each of ``samples`` jittered
        samples (the first the pixel centre, as the twin renders), then the ``final`` passes; on
        the pruned cell tapes when _march_cells_for(tape, cells) says so (pruned once, before the
        first sample). Returns the camera used."""
        camera, packed, variant, n = self._image_setup(tape, camera, width, height, settings, view)
        frame = [(k, n) for k in passes]
        cells = self._march_cells_for(tape, cells) if any(k in ("march", "light") for k in passes) else None
        desc = None
        if cells is not None:
            desc = self._prune_cells(tape, packed, variant, n, cells)[0]
            frame = self._on_cells(frame)
        rng = np.random.default_rng(0)
        for s in range(samples):
            jitter = (0.0, 0.0) if s == 0 else tuple(rng.uniform(-0.5, 0.5, 2))
            u = self._uniforms(tape, n, width, height, sample=s, extra=(0, 0, *jitter),
                               camera=camera.pack(), settings=packed)
            if desc is not None:
                u[12] = desc                # U.extra.x: the bits of the cell descriptor's word
            self._dispatch(tape, frame + ([(k, n) for k in final] if s == samples - 1 else []), variant, u)
        return camera

    @_guarded
    def march(self, tape: Tape, camera: Camera, width: int, height: int,
              settings: RenderSettings | None = None, view: str = "shade", cells="auto") -> dict:
        """Primary rays by the camera's pixel convention: t (H,W) f32 (inf = miss), hit, steps int32,
        mat uint32, grad (H,W,3) f32 (field gradient at the hit), normal, dirs, eye. ``cells``
        (None, "auto" or (g0, levels)): an arithmetic tape is marched on its pruned cell tapes
        (packed.wgsl cell_value; the same bits)."""
        camera = self._frame(tape, camera, width, height, settings, view, ["march", "surface"], cells)
        return self._march_result(camera, width, height)

    def _march_result(self, camera: Camera, width: int, height: int) -> dict:
        n = width * height
        f = self._read(self._out_f, np.float32, 4 * n).reshape(height, width, 4)
        u = self._read(self._out_u, np.uint32, 4 * n).reshape(height, width, 4)
        g = np.ascontiguousarray(f[..., 1:4])
        norm = np.linalg.norm(g, axis=-1, keepdims=True)
        eye, dirs = camera.rays(width, height)
        return dict(t=np.ascontiguousarray(f[..., 0]), hit=u[..., 2] != 0, steps=u[..., 0].astype(np.int32),
                    mat=np.ascontiguousarray(u[..., 1]), grad=g,
                    normal=np.where(norm > 0, g / np.where(norm > 0, norm, 1), 0).astype(np.float32),
                    dirs=dirs, eye=eye)

    @_guarded
    def light(self, tape: Tape, camera: Camera, width: int, height: int,
              settings: RenderSettings | None = None, view: str = "shade", cells="auto") -> dict:
        """March, then the key light's visibility and ambient occlusion: the march dict plus
        shadow and ao (H, W) float32 (1 on misses). ``cells`` as march."""
        camera = self._frame(tape, camera, width, height, settings, view, ["march", "surface", "light"], cells)
        n = width * height
        out = self._march_result(camera, width, height)
        sa = self._read(self._out_f, np.float32, 4 * n, 4 * n).reshape(height, width, 4)
        out["shadow"], out["ao"] = np.ascontiguousarray(sa[..., 0]), np.ascontiguousarray(sa[..., 1])
        return out

    @_guarded
    def render(self, tape: Tape, camera: Camera | None, width: int, height: int, view: str = "shade",
               settings: RenderSettings | None = None, samples: int = 1, cells="auto") -> np.ndarray:
        """(H, W, 3) uint8 image of ``view`` (one of shading.VIEWS). ``samples`` > 1 accumulates
        jittered sub-pixel samples (the first is the pixel centre, as the twin renders).
        ``cells`` as march."""
        if samples < 1:
            raise TaperayError(f"render: samples must be >= 1, got {samples}")
        self._frame(tape, camera, width, height, settings, view, _view_passes(view), cells, samples,
                    final=("resolve",))
        n = width * height
        rgba = self._read(self._out_u, np.uint32, n, 8 * n)
        return rgba.view(np.uint8).reshape(height, width, 4)[..., :3].copy()


def _view_passes(view: str) -> list[str]:
    """The kernels of one sample of ``view`` (resolve follows the last sample)."""
    if view == "slice":
        return ["slice"]
    if view in ("shade", "section"):
        return ["march", "surface", "light", "shade"]
    return ["march", "shade"]   # the other views' colours do not read the material


# ------------------------------------------------------------------------------------ self-check
@dataclass
class SelfCheck:
    """GPU vs CPU on a small render: passed when the images agree within the tolerances."""
    passed: bool
    mismatch_fraction: float          # pixels differing by more than ``level_tolerance``
    max_level_difference: int
    first_pixel: tuple[int, int] | None
    adapter: str
    seconds: float
    detail: dict = field(default_factory=dict)

    def __str__(self) -> str:
        where = f", first at row/col {self.first_pixel}" if self.first_pixel else ""
        return (f"{'passed' if self.passed else 'FAILED'} on {self.adapter}: "
                f"{100 * self.mismatch_fraction:.2f}% of pixels differ (max {self.max_level_difference} "
                f"levels{where}) in {self.seconds:.2f} s")


SELF_CHECK_SIZE = (40, 30)
SELF_CHECK_MAX_FRACTION = 0.02   # pixels allowed to differ (silhouettes, shadow edges)
SELF_CHECK_LEVELS = 2            # 8-bit levels a pixel may differ by (float32 vs float64 colour)


def gpu_self_check(walker: GpuWalker | None = None, tape: Tape | None = None) -> SelfCheck:
    """Render a small shaded image of ``tape`` (default: conformance's reference scene, which uses
    every op family) on the GPU and on the CPU twin and report how far they disagree."""
    from .conformance import compare_images, reference_tape
    from .cpu import CpuWalker
    t0 = time.perf_counter()
    walker = walker or GpuWalker()
    tape = tape or reference_tape()
    w, h = SELF_CHECK_SIZE
    cam = auto_camera(tape.bounds)
    try:
        gpu_img = walker.render(tape, cam, w, h, view="shade")
    except GpuError as e:
        return SelfCheck(False, 1.0, 255, None, walker.adapter_name, time.perf_counter() - t0, {"error": str(e)})
    cpu_img = CpuWalker().render(tape, cam, w, h, view="shade")
    cmp = compare_images(cpu_img, gpu_img, SELF_CHECK_LEVELS)
    passed = cmp["mismatch_fraction"] <= SELF_CHECK_MAX_FRACTION
    return SelfCheck(passed, cmp["mismatch_fraction"], cmp["max_level_difference"], cmp["first_pixel"],
                     walker.adapter_name, time.perf_counter() - t0, cmp)
