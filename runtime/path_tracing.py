"""Progressive path tracing: the integrator's settings, its reference on the twin, and the
accumulation both walkers share.

Owns ``PathSettings`` (environment radiance, bounce limit, Russian roulette, the sequence's
seed), the twin's path kernel (``_path_kernel``, Numba float32, the reference of
shaders/path.wgsl: the same integrator drawing the same random numbers), ``path_sums`` (one
walker's sums over a run of samples) and ``PathImage`` (progressive accumulation: each ``add``
adds samples; a camera, setting or scene edit needs a new one). The march, normals, hit
material and march box are the walkers' own (RenderSettings, twin._trace / _gradients,
kernels_render.wgsl trace_step / tetra); nothing here changes shader text.

Integrator (both walkers): per pixel and sample, a primary ray through the pixel jittered
uniformly over its area; at each hit the material's emission (``PathSettings.emission``, by
material name: the material record holds no emission) times the throughput is added, then a
diffuse surface of the material's colour (the cosine-weighted bounce's weight is the albedo),
the next ray cosine-weighted about the normal from p + 4 hit_eps n; a ray that leaves the
march box or spends max_steps sees the constant environment. Russian roulette from bounce
``roulette_from`` on (survival max(throughput) capped at 0.95); a path ends, absorbed, after
``max_bounces`` hits. Random numbers: the PCG hash (Jarzynski and Olano 2020) chained over
(seed, 8 bounce + dimension, sample, pixel), 24 bits each; dimensions 0, 1 jitter, 2, 3 the
bounce direction, 4 the roulette.

Per pixel the sums hold the radiance's three channels and the square of the samples' mean over
rgb (``luminance`` here), so that ``PathImage.tile_stats`` gives a tile's mean and its standard
error from the samples themselves.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numba import njit

from . import twin
from .camera import Camera, auto_camera, pixel_ray
from .shading import RenderSettings
from .tape import Tape, TaperayError, VALIDATED

__all__ = ["PathSettings", "PathImage", "path_sums", "pcg_hash", "path_random"]

F32 = np.float32
_MASK = 0xFFFFFFFF
_DIM_JITTER, _DIM_BOUNCE, _DIM_ROULETTE = 0, 2, 4
_ROULETTE_CAP = F32(0.95)


@dataclass(frozen=True)
class PathSettings:
    environment: tuple[float, float, float] = (1.0, 1.0, 1.0)   # the constant environment's radiance
    max_bounces: int = 8            # hits after which a path ends (absorbed)
    roulette_from: int = 3          # Russian roulette at bounces >= this
    seed: int = 0                   # the random sequence (< 2^24)
    # material name -> the radiance its surfaces emit (linear RGB); the others emit none
    emission: dict[str, tuple[float, float, float]] = field(default_factory=dict)

    def __post_init__(self):
        env = np.asarray(self.environment, float)
        if env.shape != (3,) or not np.all(np.isfinite(env)) or np.any(env < 0):
            raise TaperayError(f"path settings: environment {self.environment} must be 3 finite values >= 0")
        if not (1 <= self.max_bounces <= 1024 and 1 <= self.roulette_from <= 1024):
            raise TaperayError("path settings: max_bounces and roulette_from must lie in 1..1024")
        if not (0 <= self.seed < 1 << 24):
            raise TaperayError(f"path settings: seed {self.seed} must lie in 0..2^24-1")
        for name, rgb in self.emission.items():
            e = np.asarray(rgb, float)
            if e.shape != (3,) or not np.all(np.isfinite(e)) or np.any(e < 0):
                raise TaperayError(f"path settings: emission of {name!r} {rgb} must be 3 finite values >= 0")

    def emission_table(self, tape: Tape) -> np.ndarray:
        """(materials, 3) float32: each material id's emitted radiance (tape.material_names)."""
        table = np.zeros((max(len(tape.materials), 1), 3), F32)
        names = list(tape.material_names)
        for name, rgb in self.emission.items():
            if name not in names:
                raise TaperayError(f"path settings: no material named {name!r} to emit "
                                   f"(have: {', '.join(n for n in names if n) or 'none'})")
            table[[i for i, n in enumerate(names) if n == name]] = rgb
        return table


# ----------------------------------------------------------------------------- sampler
@njit(cache=True)
def pcg_hash(v):
    """PCG's output permutation of a 32-bit state (path.wgsl pcg_hash), in int64 words."""
    state = (v * 747796405 + 2891336453) & _MASK
    word = (((state >> ((state >> 28) + 4)) ^ state) * 277803737) & _MASK
    return (word >> 22) ^ word


@njit(cache=True)
def path_random(seed, pixel, sample, bounce, dim):
    """The float32 in [0, 1) of (pixel, sample, bounce, dimension) (path.wgsl path_random)."""
    h = pcg_hash((pcg_hash((pcg_hash((pcg_hash(seed) + 8 * bounce + dim) & _MASK) + sample) & _MASK)
                  + pixel) & _MASK)
    return F32(h >> 8) * F32(5.9604644775390625e-08)


@njit(cache=True, error_model="numpy", fastmath=False)
def _cosine_dir(n0, n1, n2, u1, u2):
    """A cosine-weighted unit direction about the unit normal n (path.wgsl cosine_dir)."""
    s = F32(1) if n2 >= F32(0) else F32(-1)
    a = F32(-1) / (s + n2)
    b = n0 * n1 * a
    t10, t11, t12 = F32(1) + s * n0 * n0 * a, s * b, -s * n0
    t20, t21, t22 = b, s + n1 * n1 * a, -n1
    r = np.sqrt(u1)
    phi = F32(6.2831854820251465) * u2
    x = r * np.cos(phi)
    y = r * np.sin(phi)
    z = np.sqrt(max(F32(1) - u1, F32(0)))
    return x * t10 + y * t20 + z * n0, x * t11 + y * t21 + z * n1, x * t12 + y * t22 + z * n2


# ----------------------------------------------------------------------------- the twin's kernel
@njit(nogil=True, cache=True, error_model="numpy", fastmath=False)
def _path_kernel(tp, n_regs, sec, cam, box, eps, neps, max_steps, step_scale, colors, emit, env, max_bounces,
                 roulette_from, seed, first, count, sums, thread, n_threads):
    """Thread ``thread``'s tiles of samples first .. first+count-1, added into sums (H, W, 4):
    the rays of a tile's sample are traced together, one bounce at a time (twin._trace), the
    paths that go on compacted to the front."""
    H, W = sums.shape[0], sums.shape[1]
    n_save = tp[7]
    n_mat = colors.shape[0]
    dirs = np.empty((H, W, 3), F32)       # (only its shape: the tiles)
    eps4 = F32(4) * eps
    o = np.empty(3, F32)
    dv = np.empty(3, F32)
    for tile in range(thread, twin._tile_count(dirs), n_threads):
        r0, r1, c0, c1, ws, ws1, ro, rd, grad, t, tfar, steps, hit, mat, res, idx, pix, rhint = \
            twin._tile_setup(tile, dirs, n_regs, n_save)
        thr = np.empty((3, twin.BLOCK), F32)
        rad = np.empty((3, twin.BLOCK), F32)
        for sample in range(first, first + count):
            n = 0
            for row in range(r0, r1):
                for col in range(c0, c1):
                    p = row * W + col
                    jx = path_random(seed, p, sample, np.int64(0), _DIM_JITTER)
                    jy = path_random(seed, p, sample, np.int64(0), _DIM_JITTER + 1)
                    dv[0], dv[1], dv[2] = pixel_ray(cam, W, H, F32(col) + jx, F32(row) + jy)
                    for r in range(3):
                        o[r] = cam[r]
                        ro[r, n] = cam[r]
                        rd[r, n] = dv[r]
                        thr[r, n] = F32(1)
                        rad[r, n] = F32(0)
                    t[n], tfar[n] = twin._slab(o, dv, box)
                    pix[0, n], pix[1, n] = row, col
                    n += 1
            bounce = np.int64(0)
            while n > 0:
                for q in range(n):
                    rhint[0, q], rhint[1, q] = 0, 0
                twin._trace(tp, sec, ws, ws1, n, ro, rd, t, tfar, eps, F32(0), max_steps, step_scale, F32(0),
                            steps, hit, mat, res, idx, rhint)
                m = 0
                for q in range(n):                  # misses see the environment; hits to the front
                    if not hit[q]:
                        for r in range(3):
                            rad[r, q] += thr[r, q] * env[r]
                        _finish(sums, pix, rad, q)
                        continue
                    for r in range(3):
                        ro[r, m] = ro[r, q] + t[q] * rd[r, q]
                        thr[r, m], rad[r, m] = thr[r, q], rad[r, q]
                    mat[m], pix[0, m], pix[1, m] = mat[q], pix[0, q], pix[1, q]
                    m += 1
                hint = ws[twin.WS_HINT]
                for q in range(m):
                    hint[0, q], hint[1, q] = 0, 0
                twin._gradients(tp, sec, ws, ws1, m, ro, neps, grad)
                bounce += 1
                n = 0
                for q in range(m):                  # the bounce; the paths that go on to the front
                    gl = twin._len3(grad[0, q], grad[1, q], grad[2, q])
                    if not gl > F32(0):
                        _finish(sums, pix, rad, q)
                        continue
                    nx, ny, nz = grad[0, q] / gl, grad[1, q] / gl, grad[2, q] / gl
                    c = colors[min(mat[q], n_mat - 1)]
                    e = emit[min(mat[q], n_mat - 1)]
                    for r in range(3):
                        rad[r, q] += thr[r, q] * e[r]
                        thr[r, q] *= c[r]
                    if bounce >= max_bounces:
                        _finish(sums, pix, rad, q)
                        continue
                    p = pix[0, q] * W + pix[1, q]
                    if bounce >= roulette_from:
                        keep = min(max(thr[0, q], max(thr[1, q], thr[2, q])), _ROULETTE_CAP)
                        if not path_random(seed, p, sample, bounce, _DIM_ROULETTE) < keep:
                            _finish(sums, pix, rad, q)
                            continue
                        for r in range(3):
                            thr[r, q] /= keep
                    u1 = path_random(seed, p, sample, bounce, _DIM_BOUNCE)
                    u2 = path_random(seed, p, sample, bounce, _DIM_BOUNCE + 1)
                    dv[0], dv[1], dv[2] = _cosine_dir(nx, ny, nz, u1, u2)
                    o[0], o[1], o[2] = ro[0, q] + eps4 * nx, ro[1, q] + eps4 * ny, ro[2, q] + eps4 * nz
                    t0, t1 = twin._slab(o, dv, box)
                    if not t0 <= t1:
                        for r in range(3):
                            rad[r, q] += thr[r, q] * env[r]
                        _finish(sums, pix, rad, q)
                        continue
                    for r in range(3):
                        ro[r, n], rd[r, n] = o[r], dv[r]
                        thr[r, n], rad[r, n] = thr[r, q], rad[r, q]
                    pix[0, n], pix[1, n] = pix[0, q], pix[1, q]
                    t[n], tfar[n] = t0, t1
                    n += 1


@njit(nogil=True, cache=True, error_model="numpy", fastmath=False)
def _finish(sums, pix, rad, q):
    """Add path q's radiance (and its mean over rgb, squared) to its pixel's sums."""
    row, col = pix[0, q], pix[1, q]
    y = (rad[0, q] + rad[1, q] + rad[2, q]) / F32(3)
    for r in range(3):
        sums[row, col, r] += rad[r, q]
    sums[row, col, 3] += y * y


def _twin_sums(tape: Tape, camera: Camera, width: int, height: int, settings: RenderSettings,
               path: PathSettings, first: int, count: int) -> np.ndarray:
    packed = settings.pack(tape, "shade")
    VALIDATED.check(tape)
    sums = np.zeros((height, width, 4), F32)
    colors = np.ascontiguousarray(tape.materials["color"], F32)
    if len(colors) == 0:
        colors = np.full((1, 3), 0.5, F32)
    twin._on_threads(_path_kernel, twin._kernel_tape(tape), tape.n_regs, twin._section(packed), camera.pack(),
                     twin._packed(packed, "box_lo", "box_hi").reshape(2, 3), twin._packed(packed, "hit_eps"),
                     twin._packed(packed, "normal_eps"), int(twin._packed(packed, "max_steps")),
                     twin._packed(packed, "step_scale"), colors, path.emission_table(tape),
                     np.asarray(path.environment, F32),
                     path.max_bounces, path.roulette_from, path.seed, first, count, sums)
    return sums


def path_sums(walker, tape: Tape, camera: Camera, width: int, height: int, settings: RenderSettings,
              path: PathSettings, first: int, count: int) -> np.ndarray:
    """(H, W, 4) float32 sums over samples first .. first+count-1 of the path tracer on ``walker``
    (a CpuWalker: the twin's kernel; a GpuWalker: the path kernel): radiance rgb, and the
    samples' mean over rgb squared."""
    if width < 1 or height < 1:
        raise TaperayError(f"image size {width}x{height} must be at least 1x1")
    if first < 0 or count < 1 or first + count > 1 << 24:
        raise TaperayError(f"path samples {first}..{first + count - 1} must lie in 0..2^24-1")
    name = getattr(walker, "name", None)
    if name == "gpu":
        return walker.path_samples(tape, camera, width, height, settings, path, first, count)
    if name == "cpu":
        return _twin_sums(tape, camera, width, height, settings, path, first, count)
    raise TaperayError(f"the path tracer runs on the cpu and gpu walkers, not on {name or type(walker).__name__!r}")


class PathImage:
    """A progressive path-traced image on one walker: ``add(n)`` traces n more samples per
    pixel and adds them in; ``mean()`` is the radiance so far, ``rgb8()`` the picture. The
    camera, settings and tape are fixed for its life: after an edit make a new one."""

    def __init__(self, walker, tape: Tape, camera: Camera | None, width: int, height: int,
                 settings: RenderSettings | None = None, path: PathSettings | None = None):
        self.walker, self.tape = walker, tape
        self.camera = camera or auto_camera(tape.bounds)
        self.width, self.height = width, height
        self.settings = settings or RenderSettings()
        self.path = path or PathSettings()
        self.samples = 0
        self.sums = np.zeros((height, width, 4), np.float64)

    def add(self, count: int) -> PathImage:
        """Trace ``count`` more samples per pixel (the next ones of the sequence)."""
        self.sums += path_sums(self.walker, self.tape, self.camera, self.width, self.height, self.settings,
                               self.path, self.samples, count)
        self.samples += count
        return self

    def mean(self) -> np.ndarray:
        """(H, W, 3) float32 mean radiance per pixel."""
        if self.samples == 0:
            raise TaperayError("path image: no samples yet (call add)")
        return (self.sums[..., :3] / self.samples).astype(np.float32)

    def rgb8(self) -> np.ndarray:
        """(H, W, 3) uint8: the mean radiance clamped to [0, 1], gamma 1/2.2 (kernels_render.wgsl
        view_colour's display curve), rounded."""
        c = np.clip(self.mean().astype(np.float64), 0.0, 1.0) ** (1 / 2.2)
        return np.round(c * 255).astype(np.uint8)

    def tile_stats(self, tile: int) -> tuple[np.ndarray, np.ndarray]:
        """Per ``tile`` x ``tile`` pixel block (whole blocks only): the mean of the samples'
        luminance (their mean over rgb) and its standard error, from each pixel's sample variance
        (the pixels' samples are independent; a tile's mean is the mean of its pixels' means)."""
        if self.samples < 2:
            raise TaperayError("path image: a standard error needs at least 2 samples")
        s = self.samples
        th, tw = self.height // tile, self.width // tile
        y_sum = self.sums[..., :3].sum(-1) / 3
        m = y_sum / s
        var = np.maximum(self.sums[..., 3] / s - m * m, 0.0) * s / (s - 1)
        crop = (slice(0, th * tile), slice(0, tw * tile))
        means = m[crop].reshape(th, tile, tw, tile).mean((1, 3))
        se = np.sqrt((var[crop] / s).reshape(th, tile, tw, tile).sum((1, 3))) / (tile * tile)
        return means, se
