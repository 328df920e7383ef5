"""Progressive path tracing: the integrator's settings, its reference on the twin, and the
accumulation both walkers share.

Owns ``PathSettings`` (environment radiance, bounce limit, Russian roulette, light sampling, the
sampler and its seed), the light samples' data (``emitter_spheres``, ``light_data``: the GPU's
points buffer for the path kernels), the integrator's scalar pieces (the sampler, the material model, its sampling
and the MIS weight: jitted, float32, each mirrored by a function of shaders/path.wgsl of the same
name), the twin's path kernel (``_path_kernel``, Numba float32, the reference of path.wgsl: the
same integrator drawing the same random numbers; the GPU's is path.wgsl's kernels)
and ``PathImage`` (progressive accumulation on either walker: each ``add`` adds samples, the
GPU's sums staying on the GPU; a camera, setting or scene edit needs a new one). The march's hit threshold, normals and march box are
the walkers' own (RenderSettings, twin_march.trace_rays / gradients, kernels_render.wgsl trace_step /
tetra); nothing here changes shader text. Materials are the tape's MATERIAL_DTYPE records, so a
material edit is a buffer write.

Integrator (both walkers), per pixel and sample:

- a primary ray through the pixel jittered uniformly over its area, sphere-traced through the
  tape; a ray inside a glass traces the negated field (its surface from within);
- at a hit (normal: the field's gradient, tetrahedron taps), the material's emission times the
  throughput is added, weighted by the power heuristic against the light samples' pdf of the
  ray's direction from the hit it left (1 after glass or without light samples); after
  ``max_bounces`` hits the path ends there;
- glass (transmission 1): smooth dielectric; reflect with the exact Fresnel reflectance, else
  refract (Snell; the colour tints the transmitted throughput); no light sampling;
- other materials: a Lambertian base ``color (1 - metallic) (1 - Fd)`` under a GGX microfacet
  lobe (alpha = roughness^2, at least ALPHA_MIN; Smith's separable shadowing; Schlick's Fresnel
  from F0 = mix(0.08 specular, color, metallic) to F90 = mix(specular, 1, metallic); Fd the
  dielectric part's F at the view angle); a light sample (``light_data``): with the
  environment's share the environment's (uniform on the sphere, or a map pixel drawn by its
  marginal and conditional CDFs: runtime/environment.py), else a uniform direction in the cone
  that an emitter's bounding sphere (``emitter_spheres``) subtends, the emitter picked in
  proportion to its power (emission times radius squared);
  its shadow ray traced through the same tape adds the environment where it leaves, or the
  emission of the surface it hits, times f cos over the light pdf (the mixture's, over all
  cones holding the direction) and the power heuristic's weight against the BSDF's pdf; then
  a BSDF sample (the GGX lobe, normals drawn from
  D cos, with probability max(F(view)) / (max(F(view)) + max(diffuse)), else cosine-weighted),
  its throughput weight f cos / pdf of the two lobes' mixture;
- a ray that leaves the march box or spends max_steps sees the environment (the constant,
  times the map's pixel in its direction where there is a map), weighted as a hit's emission;
- Russian roulette from bounce ``roulette_from`` on (survival max(throughput) capped at 0.95,
  the survivors divided by it).

Random numbers (``path_random``): per (pixel, bounce) the dimensions go in pairs, each pair a 2D
Sobol sequence over the samples with Burley's (2020) hash-based Owen scrambling, its sample index
shuffled and its dimensions scrambled by a PCG hash (Jarzynski and Olano 2020) of (seed, bounce,
pair, pixel): each pixel's first 2^k samples of a pair are a (0, k, 2)-net, and pixels, bounces
and pairs are decorrelated. ``PathSettings.sampler`` "hash" draws independent numbers instead
(the PCG hash chained over seed, 8 bounce + dimension, sample, pixel). 24 bits each, computed in
32-bit integers by both walkers. Bounce 0's dimensions 0, 1 jitter the pixel; at hit b, 0, 1 draw
the BSDF direction, 2, 3 the light direction, 4 the lobe (or glass's reflect / refract), 5 the
roulette, 6 the light sample's environment or emitter.

Per pixel the sums hold the radiance's three channels and the square of the samples' mean over
rgb (``luminance`` here), so that ``PathImage.tile_stats`` gives a tile's mean and its standard
error from the samples themselves.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import weakref

import numpy as np

from . import twin, twin_field, twin_march, twin_ops, twin_threads
from .camera import Camera, auto_camera, pixel_ray
from .environment import EnvironmentMap
from .gpu_guard import guarded
from .gpu_device import (Buffer, GpuError, PATH_ACCUMULATE, PATH_F_WORDS, PATH_GENERATE, PATH_TONEMAP, PATH_TRACE,
                         PATH_TRACE_CELLS, load_wgpu)
from .jit_cache import njit
from .shading import RenderSettings
from .tape import Tape, TaperayError, VALIDATED, content_key

__all__ = ["PathSettings", "PathImage", "pcg_hash", "path_random", "hash_random", "sobol_owen", "reverse_bits",
           "emitter_spheres", "light_data",
           "ALPHA_MIN", "SAMPLERS"]

F32 = np.float32
_MASK = 0xFFFFFFFF
_DIM_JITTER = 0                      # bounce 0: 0, 1
_DIM_BSDF, _DIM_LIGHT, _DIM_LOBE, _DIM_ROULETTE, _DIM_PICK = 0, 2, 4, 5, 6   # at a hit: pairs 0 1, 2 3, 4 5, 6
_ROULETTE_CAP = F32(0.95)
ALPHA_MIN = F32(0.002)               # the least GGX alpha (roughness 0: a near-mirror)
_PI = F32(np.pi)
_INV_PI = F32(1 / np.pi)
_TWO_PI = F32(2 * np.pi)
_INV_4PI = F32(1 / (4 * np.pi))      # the light sample's pdf (uniform on the sphere)
_COS_MIN = F32(1e-4)                 # the least cosine of the view direction the BSDF uses
SAMPLERS = ("sobol", "hash")
LIGHTS_HEADER = 8                    # light_data's words before the emitter records
EMITTER_WORDS = 8                    # light_data's words per emitter
MAX_EMITTERS = 64
EMITTER_GRID = 48
_EMITTER_CACHE: dict = {}
FLAG_LIGHT, FLAG_HASH = 1, 2          # path.wgsl PATH_FLAG_LIGHT, PATH_FLAG_HASH


@dataclass(frozen=True)
class PathSettings:
    """The integrator's settings (the scene's materials are the tape's records): the
    environment's radiance (a constant, times an equirectangular map where one is given), the
    bounce limit, where Russian roulette starts, the sampler and its seed, and which light
    samples opaque hits take (the environment, the emitters; the map's by importance or
    uniformly)."""
    environment: tuple[float, float, float] = (1.0, 1.0, 1.0)   # the environment's radiance (scales a map)
    max_bounces: int = 8            # hits after which a path ends (absorbed)
    roulette_from: int = 3          # Russian roulette at bounces >= this
    seed: int = 0                   # the random sequence (< 2^24)
    light_samples: bool = True      # next-event estimation toward the lights (MIS)
    sampler: str = "sobol"          # "sobol": scrambled Sobol pairs; "hash": independent numbers
    emitter_samples: bool = True    # light samples toward emissive surfaces too (with light_samples)
    environment_map: EnvironmentMap | None = field(default=None, compare=False)  # times environment
    environment_sampling: str = "importance"    # the map's light samples: "importance" or "uniform"

    def __post_init__(self):
        env = np.asarray(self.environment, float)
        if env.shape != (3,) or not np.all(np.isfinite(env)) or np.any(env < 0):
            raise TaperayError(f"path settings: environment {self.environment} must be 3 finite values >= 0")
        if not (1 <= self.max_bounces <= 1024 and 1 <= self.roulette_from <= 1024):
            raise TaperayError("path settings: max_bounces and roulette_from must lie in 1..1024")
        if not (0 <= self.seed < 1 << 24):
            raise TaperayError(f"path settings: seed {self.seed} must lie in 0..2^24-1")
        if self.environment_map is not None and not isinstance(self.environment_map, EnvironmentMap):
            raise TaperayError("path settings: environment_map must be an EnvironmentMap (runtime.environment)")
        if self.environment_sampling not in ("importance", "uniform"):
            raise TaperayError(f"path settings: environment_sampling {self.environment_sampling!r} must be "
                               "'importance' or 'uniform'")
        if self.sampler not in SAMPLERS:
            raise TaperayError(f"path settings: sampler {self.sampler!r} must be one of {', '.join(SAMPLERS)}")

    def flags(self) -> int:
        """The settings' switches as path.wgsl's PATH_FLAG_* bits (U.extra.w of the path kernel)."""
        return (FLAG_LIGHT if self.light_samples else 0) | (FLAG_HASH if self.sampler == "hash" else 0)


# ----------------------------------------------------------------------------- sampler
@njit(cache=True)
def pcg_hash(v):
    """PCG's output permutation of a 32-bit state (path.wgsl pcg_hash), in int64 words."""
    state = (v * 747796405 + 2891336453) & _MASK
    word = (((state >> ((state >> 28) + 4)) ^ state) * 277803737) & _MASK
    return (word >> 22) ^ word


@njit(cache=True)
def reverse_bits(x):
    """The 32-bit word x with its bits in reverse order (WGSL reverseBits)."""
    x = ((x >> 1) & 0x55555555) | ((x & 0x55555555) << 1)
    x = ((x >> 2) & 0x33333333) | ((x & 0x33333333) << 2)
    x = ((x >> 4) & 0x0F0F0F0F) | ((x & 0x0F0F0F0F) << 4)
    x = ((x >> 8) & 0x00FF00FF) | ((x & 0x00FF00FF) << 8)
    return ((x >> 16) | (x << 16)) & _MASK


@njit(cache=True)
def laine_karras(x, seed):
    """Burley's (2020) Laine-Karras permutation of a bit-reversed word: each bit flipped by a hash
    of the bits below it and the seed (path.wgsl laine_karras); products wrap mod 2^64 first,
    whose low 32 bits are the u32 product's."""
    x = (x + seed) & _MASK
    x ^= (x * 0x6c50b47c) & _MASK
    x ^= (x * 0xb82f1e52) & _MASK
    x ^= (x * 0xc7afe638) & _MASK
    x ^= (x * 0x8d22f6e6) & _MASK
    return x


@njit(cache=True)
def _sobol1_reversed(i):
    """The second Sobol dimension of index i, bit-reversed: its generator matrix is Pascal's
    triangle mod 2, so bit j of the result is the parity of the index bits k whose positions hold
    j's bits (Lucas), a superset sum over the five position bits (path.wgsl sobol1_reversed)."""
    i ^= (i >> 1) & 0x55555555
    i ^= (i >> 2) & 0x33333333
    i ^= (i >> 4) & 0x0F0F0F0F
    i ^= (i >> 8) & 0x00FF00FF
    i ^= (i >> 16) & 0x0000FFFF
    return i


@njit(cache=True)
def sobol_owen(index, dim, seed):
    """Sobol dimension ``dim`` (0 or 1) of point ``index`` under Burley's hash-based nested
    uniform (Owen) scrambling with ``seed``, as a 32-bit word (path.wgsl sobol_owen)."""
    z = _sobol1_reversed(index) if dim == 1 else index
    return reverse_bits(laine_karras(z, seed))


@njit(cache=True)
def hash_random(seed, pixel, sample, bounce, dim):
    """The independent sampler (PathSettings.sampler "hash"): the PCG hash chained over (seed,
    8 bounce + dimension, sample, pixel), 24 bits (path.wgsl hash_random)."""
    h = pcg_hash((pcg_hash((pcg_hash((pcg_hash(seed) + 8 * bounce + dim) & _MASK) + sample) & _MASK)
                  + pixel) & _MASK)
    return F32(h >> 8) * F32(5.9604644775390625e-08)


@njit(cache=True)
def path_random(seed, pixel, sample, bounce, dim):
    """The float32 in [0, 1) of (pixel, sample, bounce, dimension) (path.wgsl path_random): the
    dimensions go in pairs (0 1, 2 3, ...), each pair a 2D scrambled Sobol sequence over the
    samples, the pair's seed a PCG hash of (seed, bounce, pair, pixel) that shuffles the sample
    index (nested uniform scrambling of its bit-reversal) and scrambles each dimension; 24 bits."""
    pair = pcg_hash((pcg_hash((pcg_hash(seed) + 8 * bounce + (dim >> 1)) & _MASK) + pixel) & _MASK)
    index = reverse_bits(laine_karras(reverse_bits(sample), pair))
    x = sobol_owen(index, dim & 1, pcg_hash((pair + 1 + (dim & 1)) & _MASK))
    return F32(x >> 8) * F32(5.9604644775390625e-08)


@njit(cache=True)
def _random(hashed, seed, pixel, sample, bounce, dim):
    """path_random, or hash_random where ``hashed`` (the sampler setting)."""
    if hashed:
        return hash_random(seed, pixel, sample, bounce, dim)
    return path_random(seed, pixel, sample, bounce, dim)


# ----------------------------------------------------------------------------- the material model
_JIT = dict(cache=True, error_model="numpy", fastmath=False)


@njit(**_JIT)
def _frame_dir(n0, n1, n2, x, y, z):
    """The direction x t1 + y t2 + z n of the orthonormal basis (t1, t2, n) about the unit n (Duff
    et al. 2017; path.wgsl frame_dir)."""
    s = F32(1) if n2 >= F32(0) else F32(-1)
    a = F32(-1) / (s + n2)
    b = n0 * n1 * a
    t10, t11, t12 = F32(1) + s * n0 * n0 * a, s * b, -s * n0
    t20, t21, t22 = b, s + n1 * n1 * a, -n1
    return x * t10 + y * t20 + z * n0, x * t11 + y * t21 + z * n1, x * t12 + y * t22 + z * n2


@njit(**_JIT)
def _cosine_dir(n0, n1, n2, u1, u2):
    """A cosine-weighted unit direction about the unit normal n (path.wgsl cosine_dir)."""
    r = np.sqrt(u1)
    phi = _TWO_PI * u2
    return _frame_dir(n0, n1, n2, r * np.cos(phi), r * np.sin(phi), np.sqrt(max(F32(1) - u1, F32(0))))


@njit(**_JIT)
def _ggx_half(n0, n1, n2, a2, u1, u2):
    """A GGX microfacet normal about n drawn from D(h) cos(theta_h) (path.wgsl ggx_half)."""
    c2 = (F32(1) - u1) / (F32(1) + (a2 - F32(1)) * u1)
    c = np.sqrt(c2)
    s = np.sqrt(max(F32(1) - c2, F32(0)))
    phi = _TWO_PI * u2
    return _frame_dir(n0, n1, n2, s * np.cos(phi), s * np.sin(phi), c)


@njit(**_JIT)
def _uniform_dir(u1, u2):
    """A uniform direction on the unit sphere (path.wgsl uniform_dir)."""
    z = F32(1) - F32(2) * u1
    r = np.sqrt(max(F32(1) - z * z, F32(0)))
    phi = _TWO_PI * u2
    return r * np.cos(phi), r * np.sin(phi), z


@njit(**_JIT)
def _smith_g1(c, a2):
    return F32(2) * c / (c + np.sqrt(a2 + (F32(1) - a2) * c * c))


@njit(**_JIT)
def _lobes(mat, co):
    """(diffuse albedo rgb, F0 rgb, F90, alpha^2, the GGX lobe's sampling probability) of the
    material record at view cosine co (path.wgsl lobes)."""
    c, rough, metal, spec = mat["color"], mat["roughness"], mat["metallic"], mat["specular"]
    f0d = F32(0.08) * spec
    w = F32(1) - co
    w5 = w * w * w * w * w
    kd_scale = (F32(1) - metal) * (F32(1) - (f0d + (spec - f0d) * w5))
    f90 = spec + (F32(1) - spec) * metal
    kd0, kd1, kd2 = c[0] * kd_scale, c[1] * kd_scale, c[2] * kd_scale
    f00 = f0d + (c[0] - f0d) * metal
    f01 = f0d + (c[1] - f0d) * metal
    f02 = f0d + (c[2] - f0d) * metal
    fs = max(f00, max(f01, f02))
    fs = fs + (f90 - fs) * w5
    fd = max(kd0, max(kd1, kd2))
    ps = fs / (fs + fd) if fs + fd > F32(0) else F32(0)
    a = max(rough * rough, ALPHA_MIN)
    return kd0, kd1, kd2, f00, f01, f02, f90, a * a, ps


@njit(**_JIT)
def _bsdf(mat, n0, n1, n2, o0, o1, o2, i0, i1, i2):
    """(f rgb times cos(n, wi), the sampling pdf of wi) of an opaque material, view wo = o, light
    wi = i, unit normal n; zero when wi is below the surface (path.wgsl bsdf)."""
    co = max(n0 * o0 + n1 * o1 + n2 * o2, _COS_MIN)
    ci = n0 * i0 + n1 * i1 + n2 * i2
    if not ci > F32(0):
        return F32(0), F32(0), F32(0), F32(0)
    kd0, kd1, kd2, f00, f01, f02, f90, a2, ps = _lobes(mat, co)
    h0, h1, h2 = o0 + i0, o1 + i1, o2 + i2
    hl = np.sqrt(h0 * h0 + h1 * h1 + h2 * h2)
    h0, h1, h2 = h0 / hl, h1 / hl, h2 / hl
    nh = max(n0 * h0 + n1 * h1 + n2 * h2, F32(0))
    vh = max(o0 * h0 + o1 * h1 + o2 * h2, _COS_MIN)
    q = nh * nh * (a2 - F32(1)) + F32(1)
    d = a2 / (_PI * q * q)
    g = _smith_g1(co, a2) * _smith_g1(ci, a2)
    w = F32(1) - vh
    w5 = w * w * w * w * w
    spec = d * g / (F32(4) * co)                  # (times ci: f's 1 / (4 co ci) times ci)
    diff = ci * _INV_PI
    pdf = (F32(1) - ps) * diff + ps * d * nh / (F32(4) * vh)
    return ((kd0 * diff + spec * (f00 + (f90 - f00) * w5)), (kd1 * diff + spec * (f01 + (f90 - f01) * w5)),
            (kd2 * diff + spec * (f02 + (f90 - f02) * w5)), pdf)


@njit(**_JIT)
def _sample_bsdf(mat, n0, n1, n2, o0, o1, o2, u0, u1, u2):
    """A direction drawn from the opaque material's sampling (the GGX lobe with its probability,
    else cosine-weighted; path.wgsl sample_bsdf)."""
    co = max(n0 * o0 + n1 * o1 + n2 * o2, _COS_MIN)
    _, _, _, _, _, _, _, a2, ps = _lobes(mat, co)
    if u0 < ps:
        h0, h1, h2 = _ggx_half(n0, n1, n2, a2, u1, u2)
        vh2 = F32(2) * (o0 * h0 + o1 * h1 + o2 * h2)
        return vh2 * h0 - o0, vh2 * h1 - o1, vh2 * h2 - o2
    return _cosine_dir(n0, n1, n2, u1, u2)


@njit(**_JIT)
def _power_weight(pa, pb):
    """The power heuristic's weight of a sample of pdf pa against another strategy's pb."""
    a2 = pa * pa
    return a2 / (a2 + pb * pb)


@njit(**_JIT)
def _fresnel_dielectric(c, eta):
    """(reflectance, cos of the refracted angle) at incidence cosine c >= 0 and relative index
    eta = n_incident / n_transmitted; reflectance 1 under total internal reflection."""
    s2 = eta * eta * (F32(1) - c * c)
    if s2 >= F32(1):
        return F32(1), F32(0)
    ct = np.sqrt(F32(1) - s2)
    rs = (eta * c - ct) / (eta * c + ct)
    rp = (c - eta * ct) / (c + eta * ct)
    return F32(0.5) * (rs * rs + rp * rp), ct


# ----------------------------------------------------------------------------- light samples
@njit(**_JIT)
def _cone(lights, k, x0, x1, x2):
    """(axis, cos of the half angle, 1 - that cos) of the cone from x that emitter k's bounding
    sphere subtends; cos -2 when x lies within the sphere (the whole sphere of directions;
    path.wgsl cone)."""
    b = LIGHTS_HEADER + EMITTER_WORDS * k
    a0, a1, a2 = lights[b] - x0, lights[b + 1] - x1, lights[b + 2] - x2
    r = lights[b + 3]
    d2 = a0 * a0 + a1 * a1 + a2 * a2
    if not d2 > r * r * F32(1.0001):
        return F32(0), F32(0), F32(1), F32(-2), F32(2)
    dl = np.sqrt(d2)
    s2 = r * r / d2
    c = np.sqrt(F32(1) - s2)
    return a0 / dl, a1 / dl, a2 / dl, c, s2 / (F32(1) + c)


@njit(**_JIT)
def env_pixel(lights, d0, d1, d2):
    """(row, column, sin theta) of the environment map's pixel in direction d (environment.py's
    mapping; path.wgsl env_pixel)."""
    w, h = np.int64(lights[2]), np.int64(lights[3])
    z = min(max(d2, F32(-1)), F32(1))
    theta = F32(np.arccos(z))
    phi = F32(np.arctan2(d1, d0))
    row = min(max(np.int64(theta * _INV_PI * F32(h)), 0), h - 1)
    col = min(max(np.int64((phi + _PI) / _TWO_PI * F32(w)), 0), w - 1)
    return row, col, np.sqrt(max(F32(1) - z * z, F32(0)))


@njit(**_JIT)
def _env_radiance(lights, env, d0, d1, d2):
    """The environment's radiance in direction d: the constant ``env``, times the map's pixel
    where there is a map (path.wgsl env_radiance)."""
    if lights[2] == F32(0):
        return env[0], env[1], env[2]
    row, col, _ = env_pixel(lights, d0, d1, d2)
    b = np.int64(lights[4]) + 3 * (row * np.int64(lights[2]) + col)
    return env[0] * lights[b], env[1] * lights[b + 1], env[2] * lights[b + 2]


@njit(**_JIT)
def env_pdf(lights, d0, d1, d2):
    """The environment light sample's pdf of direction d: uniform on the sphere, or the map's
    importance sampling (its pixel's probability over the pixel's solid angle; path.wgsl
    env_pdf)."""
    if lights[7] == F32(0):
        return _INV_4PI
    w, h = np.int64(lights[2]), np.int64(lights[3])
    row, col, st = env_pixel(lights, d0, d1, d2)
    if not st > F32(0):
        return F32(0)
    m, c = np.int64(lights[5]), np.int64(lights[6]) + row * (w + 1)
    p = (lights[m + row + 1] - lights[m + row]) * (lights[c + col + 1] - lights[c + col])
    return p * F32(w * h) / (F32(2) * _PI * _PI * st)


@njit(**_JIT)
def _cdf_find(lights, base, n, u):
    """The i in [0, n) with cdf[i] <= u < cdf[i + 1] of the CDF at lights[base .. base + n]
    (0 then 1 at its ends; path.wgsl cdf_find)."""
    lo, hi = np.int64(0), n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if lights[base + mid] <= u:
            lo = mid
        else:
            hi = mid
    return lo


@njit(**_JIT)
def sample_env(lights, u1, u2):
    """The environment light sample's direction: uniform on the sphere, or a pixel drawn by
    the marginal and conditional CDFs and a uniform point in it (path.wgsl sample_env)."""
    if lights[7] == F32(0):
        return _uniform_dir(u1, u2)
    w, h = np.int64(lights[2]), np.int64(lights[3])
    m = np.int64(lights[5])
    row = _cdf_find(lights, m, h, u1)
    dv = (u1 - lights[m + row]) / (lights[m + row + 1] - lights[m + row])
    c = np.int64(lights[6]) + row * (w + 1)
    col = _cdf_find(lights, c, w, u2)
    du = (u2 - lights[c + col]) / (lights[c + col + 1] - lights[c + col])
    theta = (F32(row) + dv) / F32(h) * _PI
    phi = (F32(col) + du) / F32(w) * _TWO_PI - _PI
    st = np.sin(theta)
    return st * np.cos(phi), st * np.sin(phi), np.cos(theta)


@njit(**_JIT)
def _light_pdf(lights, x0, x1, x2, d0, d1, d2):
    """The light sample's pdf (solid angle) of direction d from x: the environment's share
    (lights[1]) times its pdf, and the emitters' share spread over them by their probabilities,
    each the uniform pdf of its cone where d lies in it (path.wgsl light_pdf)."""
    n = np.int64(lights[0])
    pdf = lights[1] * env_pdf(lights, d0, d1, d2)
    if n == 0:
        return pdf
    cones = F32(0)
    for k in range(n):
        a0, a1, a2, c, omc = _cone(lights, k, x0, x1, x2)
        pk = lights[LIGHTS_HEADER + EMITTER_WORDS * k + 4]
        if c < F32(-1):
            cones += pk * _INV_4PI
        elif d0 * a0 + d1 * a1 + d2 * a2 >= c:
            cones += pk / (_TWO_PI * omc)
    return pdf + (F32(1) - lights[1]) * cones


@njit(**_JIT)
def _sample_light(lights, x0, x1, x2, u0, u1, u2):
    """A light sample's direction from x: the environment's (sample_env) with probability
    lights[1], else a uniform direction in the cone of an emitter picked by u0 from their
    probabilities (path.wgsl sample_light)."""
    n = np.int64(lights[0])
    pe = lights[1]
    if n == 0 or u0 < pe:
        return sample_env(lights, u1, u2)
    u = (u0 - pe) / (F32(1) - pe)
    k = np.int64(0)
    while k < n - 1 and not u < lights[LIGHTS_HEADER + EMITTER_WORDS * k + 5]:
        k += 1
    a0, a1, a2, c, omc = _cone(lights, k, x0, x1, x2)
    if c < F32(-1):
        return _uniform_dir(u1, u2)
    ct = F32(1) - u1 * omc
    st = np.sqrt(max(F32(1) - ct * ct, F32(0)))
    phi = _TWO_PI * u2
    return _frame_dir(a0, a1, a2, st * np.cos(phi), st * np.sin(phi), ct)


def _grid_components(mask: np.ndarray) -> np.ndarray:
    """Labels of the 6-connected components of a 3D boolean grid (-1 outside it): each point's
    label the least flat index of its component, by propagating minima to neighbours."""
    big = mask.size
    lab = np.where(mask, np.arange(mask.size).reshape(mask.shape), big)
    while True:
        new = lab.copy()
        for axis in range(3):
            lo = [slice(None)] * 3
            hi = [slice(None)] * 3
            lo[axis], hi[axis] = slice(0, -1), slice(1, None)
            lo, hi = tuple(lo), tuple(hi)
            new[hi] = np.minimum(new[hi], lab[lo])
            new[lo] = np.minimum(new[lo], lab[hi])
        new = np.where(mask, new, big)
        if np.array_equal(new, lab):
            return np.where(mask, lab, -1)
        lab = new


def emitter_spheres(tape: Tape) -> np.ndarray:
    """(K, 5) float32 rows (centre xyz, radius, material id): bounding spheres of the tape's
    emissive surfaces. The field and material are evaluated on an EMITTER_GRID^3 grid over the
    tape's bounds; the grid points within half a cell diagonal of the surface and of a material
    of emission > 0 fall into connected pieces (6-neighbours), each piece's sphere about its
    box's centre through the farthest of its points, grown by that half diagonal. Where the
    pieces would be more than MAX_EMITTERS, each material gets one sphere over all its points
    (and the first MAX_EMITTERS are kept). Cached per tape content and set of emissive
    materials (a parameter edit, or an emission turned on or off, gives a new list). A surface
    the grid misses is still found by the paths' own bounces (the light samples' pdf is the
    same sphere list)."""
    emissive = np.flatnonzero(np.max(tape.materials["emission"], axis=-1) > 0) if len(tape.materials) else []
    key = (content_key(tape), tuple(emissive))       # (content_key leaves the materials out)
    got = _EMITTER_CACHE.get(key)
    if got is not None:
        return got
    pieces, whole = [], []
    if len(emissive):
        lo, hi = tape.bounds.astype(np.float64)
        pad = 0.02 * max(float(np.max(hi - lo)), 1e-3)
        lo, hi = lo - pad, hi + pad
        g = EMITTER_GRID
        axes = [np.linspace(lo[i], hi[i], g) for i in range(3)]
        half = 0.5 * float(np.linalg.norm((hi - lo) / (g - 1)))
        pts = np.stack(np.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3).astype(np.float32)
        d, m = twin.evaluate_field(tape, pts)
        near = np.abs(d) <= half

        def sphere_of(q, mid):
            q = q.astype(np.float64)
            centre = (q.min(0) + q.max(0)) / 2
            return [*centre, np.sqrt(np.max(np.sum((q - centre) ** 2, axis=1))) + half, mid]
        for mid in emissive:
            mask = near & (m == mid)
            if not mask.any():
                continue
            whole.append(sphere_of(pts[mask], mid))
            labels = _grid_components(mask.reshape(g, g, g)).reshape(-1)
            pieces += [sphere_of(pts[labels == k], mid) for k in np.unique(labels[mask])]
    rows = pieces if len(pieces) <= MAX_EMITTERS else whole
    out = np.asarray(rows, np.float32).reshape(-1, 5)[:MAX_EMITTERS]
    if len(_EMITTER_CACHE) > 16:
        _EMITTER_CACHE.clear()
    _EMITTER_CACHE[key] = out
    return out


def light_data(tape: Tape, path: PathSettings) -> np.ndarray:
    """The float32 words both walkers sample lights from (the GPU's points buffer for the path
    kernel; path.wgsl reads the same words): [0] the number of emitters K, [1] the probability
    of an environment light sample (1 without emitters, 0 in a black environment, else 1/2),
    [2 .. 7) the environment map's width (0: none), height and the offsets of its radiance,
    marginal and conditional CDFs (EnvironmentMap.words), [7] 1 where the map is importance
    sampled, then K emitter records of EMITTER_WORDS (centre xyz, radius, the probability of
    picking it, the sum of the probabilities up to it, 0, 0), then the map's words. An emitter
    is picked in proportion to its material's largest emission channel times its radius
    squared (its power, were it a sphere)."""
    spheres = emitter_spheres(tape) if path.emitter_samples else np.zeros((0, 5), np.float32)
    env_map = path.environment_map
    dark = not np.any(np.asarray(path.environment, float) > 0) or (env_map is not None and env_map.dark)
    head = np.zeros(LIGHTS_HEADER, np.float32)
    head[0] = len(spheres)
    head[1] = 1.0 if len(spheres) == 0 else (0.0 if dark else 0.5)
    records = np.zeros((len(spheres), EMITTER_WORDS), np.float32)
    if len(spheres):
        power = np.max(tape.materials["emission"][spheres[:, 4].astype(np.int64)], axis=-1) * spheres[:, 3] ** 2
        prob = power.astype(np.float64) / power.sum()
        records[:, :4] = spheres[:, :4]
        records[:, 4] = prob
        records[:, 5] = np.cumsum(prob)
        records[-1, 5] = 1.0
    parts = [head, records.reshape(-1)]
    if env_map is not None:
        map_head, body = env_map.words(LIGHTS_HEADER + records.size)
        head[2:7] = map_head
        head[7] = 1.0 if path.environment_sampling == "importance" else 0.0
        parts.append(body)
    return np.concatenate(parts)


# ----------------------------------------------------------------------------- the twin's kernel
# A tile's paths live in arrays of BLOCK entries, the live ones at the front, handed to the
# kernel's pieces as tuples: paths = (ro, rd, t, tfar, side, thr, rad, prev_pdf, prev_p, pix)
# (the ray, its slab and the side it marches; the throughput and the radiance so far; the BSDF
# pdf of the ray's direction, 0: no MIS, and the hit it left; the pixel), traced = trace_rays'
# out (steps, hit, mat, res, idx, rhint), hits = (mat, grad, w_emit, goes_on, next_o, next_d) (a
# hit's material, the field's gradient, the MIS weight of its emission, whether its path goes
# on, its next ray's origin and direction), shadows = ((s_ro, s_rd, s_side, s_t, s_tfar), s_add,
# s_path, s_traced) (a bounce's shadow rays, the radiance each carries, its path, trace_rays'
# out for them).
@njit(nogil=True, **_JIT)
def _path_kernel(tp, n_regs, sec, cam, box, march, scene, path, samples, sums, thread, n_threads):
    """Thread ``thread``'s tiles of samples first .. first+count-1 (``samples``), added into sums
    (H, W, 4); march = (eps, neps, max_steps, step_scale) (the hit threshold, the gradient's tap
    distance, the march's step limit and scale), scene = (mats, env, lights) (the materials, the
    environment's constant, light_data's words), path = (max_bounces, roulette_from,
    light_samples, hashed, seed) (PathSettings'). The rays of a tile's sample (_camera_rays) are
    traced together, one bounce at a time (the twin's march, twin_march.trace_rays, side -1
    inside a glass; _resolve_hits), each hit scattered (_scatter_hits, _next_rays), the shadow
    rays of a bounce traced together after it (_add_shadow_light), the paths that go on
    compacted to the front (_compact_paths)."""
    eps, neps, max_steps, step_scale = march
    first, count = samples
    H, W = sums.shape[0], sums.shape[1]
    n_save = tp[7]
    dirs = np.empty((H, W, 3), F32)       # (only its shape: the tiles)
    eps4 = F32(4) * eps
    B = twin_field.BLOCK
    rule = (eps, F32(0), max_steps, step_scale, F32(0))      # (trace_rays': no hit cone, no penumbra)
    for tile in range(thread, twin_march.tile_count(dirs), n_threads):
        r0, r1, c0, c1, ws, ws1, ro, rd, grad, t, tfar, steps, hit, mat, res, idx, pix, rhint = \
            twin_march.tile_setup(tile, dirs, n_regs, n_save)
        hint = ws[twin_field.WS_HINT]
        side, prev_pdf, w_emit = np.empty(B, F32), np.empty(B, F32), np.empty(B, F32)
        thr, rad, prev_p = np.empty((3, B), F32), np.empty((3, B), F32), np.empty((3, B), F32)
        goes_on = np.empty(B, np.bool_)
        paths = (ro, rd, t, tfar, side, thr, rad, prev_pdf, prev_p, pix)
        traced = (steps, hit, mat, res, idx, rhint)
        hits = (mat, grad, w_emit, goes_on, np.empty((3, B), F32), np.empty((3, B), F32))
        s_rays = (np.empty((3, B), F32), np.empty((3, B), F32), np.ones(B, F32), np.empty(B, F32), np.empty(B, F32))
        s_hint = np.zeros((2, B), np.int64)
        s_traced = (np.empty(B, np.int32), np.empty(B, np.bool_), np.empty(B, np.uint32), res,
                    np.empty(B, np.int64), s_hint)
        shadows = (s_rays, np.empty((3, B), F32), np.empty(B, np.int64), s_traced)
        for sample in range(first, first + count):
            n = _camera_rays(cam, box, path, sample, (r0, r1, c0, c1), W, H, paths)
            bounce = np.int64(0)
            while n > 0:
                for q in range(n):
                    rhint[0, q], rhint[1, q] = 0, 0
                twin_march.trace_rays(tp, sec, ws, ws1, n, (ro, rd, side, t, tfar), rule, traced)
                m = _resolve_hits(n, scene, sums, paths, traced, w_emit)
                for q in range(m):
                    hint[0, q], hint[1, q] = 0, 0
                twin_march.gradients(tp, sec, ws, ws1, m, ro, neps, grad)
                bounce += 1
                ns = _scatter_hits(m, bounce, sample, W, box, eps4, scene, path, paths, hits, shadows)
                _next_rays(m, bounce, sample, W, box, scene, path, paths, hits)
                if ns > 0:                  # the shadow rays: unoccluded ones add their light
                    for k in range(ns):
                        s_hint[0, k], s_hint[1, k] = 0, 0
                    twin_march.trace_rays(tp, sec, ws, ws1, ns, s_rays, rule, s_traced)
                    _add_shadow_light(ns, scene, rad, shadows)
                n = _compact_paths(m, sums, paths, goes_on)


@njit(nogil=True, **_JIT)
def _camera_rays(cam, box, path, sample, rect, W, H, paths):
    """The primary rays of sample ``sample`` through the pixels of rect = (r0, r1, c0, c1) (rows
    r0:r1, columns c0:c1 of W x H), each jittered over its pixel (bounce 0's _DIM_JITTER pair),
    into the front of paths: throughput 1, no radiance, outside, no MIS. Returns their count."""
    max_bounces, roulette_from, light_samples, hashed, seed = path
    ro, rd, t, tfar, side, thr, rad, prev_pdf, prev_p, pix = paths
    r0, r1, c0, c1 = rect
    o = np.empty(3, F32)
    dv = np.empty(3, F32)
    n = np.int64(0)
    for row in range(r0, r1):
        for col in range(c0, c1):
            p = row * W + col
            jx = _random(hashed, seed, p, sample, np.int64(0), _DIM_JITTER)
            jy = _random(hashed, seed, p, sample, np.int64(0), _DIM_JITTER + 1)
            dv[0], dv[1], dv[2] = pixel_ray(cam, W, H, F32(col) + jx, F32(row) + jy)
            for r in range(3):
                o[r] = cam[r]
                ro[r, n] = cam[r]
                rd[r, n] = dv[r]
                thr[r, n] = F32(1)
                rad[r, n] = F32(0)
            t[n], tfar[n] = twin_march.slab(o, dv, box)
            side[n], prev_pdf[n] = F32(1), F32(0)
            pix[0, n], pix[1, n] = row, col
            n += 1
    return n


@njit(nogil=True, **_JIT)
def _mis_weight(lights, bsdf_pdf, x0, x1, x2, d0, d1, d2):
    """The power heuristic's weight of light reached along d by a BSDF sample of pdf bsdf_pdf
    from x, against the light samples' pdf of d from x (1 where bsdf_pdf is 0: after glass or
    without light samples)."""
    if bsdf_pdf > F32(0):
        return _power_weight(bsdf_pdf, _light_pdf(lights, x0, x1, x2, d0, d1, d2))
    return F32(1)


@njit(nogil=True, **_JIT)
def _add_environment(lights, env, w, d0, d1, d2, thr, rad, q):
    """Add path q's throughput times the environment's radiance in direction d, times w, to the
    path's radiance."""
    e0, e1, e2 = _env_radiance(lights, env, d0, d1, d2)
    rad[0, q] += thr[0, q] * e0 * w
    rad[1, q] += thr[1, q] * e1 * w
    rad[2, q] += thr[2, q] * e2 * w


@njit(nogil=True, **_JIT)
def _resolve_hits(n, scene, sums, paths, traced, w_emit):
    """What the n paths' traced rays reached: a miss adds the environment (weighted against the
    light samples from the hit it left) and finishes its path; the hits go to the front, each
    ray's origin moved to its hit, with the MIS weight of the hit's emission (w_emit). Returns
    the hits' count."""
    mats, env, lights = scene
    ro, rd, t, tfar, side, thr, rad, prev_pdf, prev_p, pix = paths
    steps, hit, mat, res, idx, rhint = traced
    n_mat = mats.shape[0]
    m = np.int64(0)
    for q in range(n):                  # misses see the environment; hits to the front
        if not hit[q]:
            w = _mis_weight(lights, prev_pdf[q], prev_p[0, q], prev_p[1, q], prev_p[2, q], rd[0, q], rd[1, q], rd[2, q])
            _add_environment(lights, env, w, rd[0, q], rd[1, q], rd[2, q], thr, rad, q)
            _finish(sums, pix, rad, q)
            continue
        e = mats[min(mat[q], n_mat - 1)]["emission"]
        w_emit[m] = F32(1)
        if e[0] + e[1] + e[2] > F32(0):
            w_emit[m] = _mis_weight(lights, prev_pdf[q], prev_p[0, q], prev_p[1, q], prev_p[2, q],
                                    rd[0, q], rd[1, q], rd[2, q])
        for r in range(3):
            ro[r, m] = ro[r, q] + t[q] * rd[r, q]
            rd[r, m] = rd[r, q]
            thr[r, m], rad[r, m] = thr[r, q], rad[r, q]
        mat[m], pix[0, m], pix[1, m] = mat[q], pix[0, q], pix[1, q]
        m += 1
    return m


@njit(nogil=True, **_JIT)
def _scatter_hits(m, bounce, sample, W, box, eps4, scene, path, paths, hits, shadows):
    """Hit ``bounce`` (from 1) of the m paths at the front: each adds its emission times w_emit
    and, unless its path ends there (no normal, the bounce limit, a BSDF sample of pdf 0), turns
    (goes_on), its next ray's origin (4 eps off the surface) and direction in next_o, next_d:
    glass reflects or refracts (smooth dielectric: the Fresnel reflectance picks, the colour
    tints what is transmitted; no MIS after it); other materials set up a light sample's shadow
    ray (into shadows, with light samples on: the throughput times f cos over the light pdf
    times the power heuristic's weight) and draw a BSDF sample (the throughput times f cos /
    pdf; the pdf and the hit kept for the next hit's MIS). Returns the shadow rays' count."""
    mats, env, lights = scene
    max_bounces, roulette_from, light_samples, hashed, seed = path
    ro, rd, t, tfar, side, thr, rad, prev_pdf, prev_p, pix = paths
    mat, grad, w_emit, goes_on, next_o, next_d = hits
    s_rays, s_add, s_path, s_traced = shadows
    s_ro, s_rd, s_side, s_t, s_tfar = s_rays
    n_mat = mats.shape[0]
    ns = np.int64(0)
    for q in range(m):                  # each hit's light sample and bounce
        goes_on[q] = False
        gl = twin_ops.len3(grad[0, q], grad[1, q], grad[2, q])
        if not gl > F32(0):
            continue
        nx, ny, nz = grad[0, q] / gl, grad[1, q] / gl, grad[2, q] / gl
        mt = mats[min(mat[q], n_mat - 1)]
        e = mt["emission"]
        for r in range(3):
            rad[r, q] += thr[r, q] * e[r] * w_emit[q]
        if bounce >= max_bounces:
            continue
        p = pix[0, q] * W + pix[1, q]
        wo0, wo1, wo2 = -rd[0, q], -rd[1, q], -rd[2, q]
        u0 = _random(hashed, seed, p, sample, bounce, _DIM_LOBE)
        u1 = _random(hashed, seed, p, sample, bounce, _DIM_BSDF)
        u2 = _random(hashed, seed, p, sample, bounce, _DIM_BSDF + 1)
        if mt["transmission"] == F32(1):          # smooth glass
            c = nx * wo0 + ny * wo1 + nz * wo2
            s = F32(1) if c > F32(0) else F32(-1)
            eta = F32(1) / mt["ior"] if c > F32(0) else mt["ior"]
            mx, my, mz = s * nx, s * ny, s * nz
            c = s * c
            fr, ct = _fresnel_dielectric(c, eta)
            if u0 < fr:
                c2 = F32(2) * c
                d0, d1, d2 = c2 * mx - wo0, c2 * my - wo1, c2 * mz - wo2
                off = eps4
                side[q] = s
            else:
                kt = eta * c - ct
                d0, d1, d2 = kt * mx - eta * wo0, kt * my - eta * wo1, kt * mz - eta * wo2
                off = -eps4
                side[q] = -s
                tint = mt["color"]
                for r in range(3):
                    thr[r, q] *= tint[r]
            o0, o1, o2 = ro[0, q] + off * mx, ro[1, q] + off * my, ro[2, q] + off * mz
            prev_pdf[q] = F32(0)
        else:
            if light_samples:
                l0, l1, l2 = _sample_light(lights, ro[0, q], ro[1, q], ro[2, q],
                                           _random(hashed, seed, p, sample, bounce, _DIM_PICK),
                                           _random(hashed, seed, p, sample, bounce, _DIM_LIGHT),
                                           _random(hashed, seed, p, sample, bounce, _DIM_LIGHT + 1))
                f0, f1, f2, pdf = _bsdf(mt, nx, ny, nz, wo0, wo1, wo2, l0, l1, l2)
                pl = _light_pdf(lights, ro[0, q], ro[1, q], ro[2, q], l0, l1, l2)
                if pdf > F32(0) and pl > F32(0):
                    w = _power_weight(pl, pdf) / pl
                    s_add[0, ns] = thr[0, q] * f0 * w
                    s_add[1, ns] = thr[1, q] * f1 * w
                    s_add[2, ns] = thr[2, q] * f2 * w
                    s_ro[0, ns] = ro[0, q] + eps4 * nx
                    s_ro[1, ns] = ro[1, q] + eps4 * ny
                    s_ro[2, ns] = ro[2, q] + eps4 * nz
                    s_rd[0, ns], s_rd[1, ns], s_rd[2, ns] = l0, l1, l2
                    s_t[ns], s_tfar[ns] = twin_march.slab(s_ro[:, ns], s_rd[:, ns], box)
                    s_path[ns] = q
                    ns += 1
            d0, d1, d2 = _sample_bsdf(mt, nx, ny, nz, wo0, wo1, wo2, u0, u1, u2)
            f0, f1, f2, pdf = _bsdf(mt, nx, ny, nz, wo0, wo1, wo2, d0, d1, d2)
            if not pdf > F32(0):
                continue
            thr[0, q] *= f0 / pdf
            thr[1, q] *= f1 / pdf
            thr[2, q] *= f2 / pdf
            prev_pdf[q] = pdf if light_samples else F32(0)
            for r in range(3):
                prev_p[r, q] = ro[r, q]
            side[q] = F32(1)
            o0, o1, o2 = ro[0, q] + eps4 * nx, ro[1, q] + eps4 * ny, ro[2, q] + eps4 * nz
        next_o[0, q], next_o[1, q], next_o[2, q] = o0, o1, o2
        next_d[0, q], next_d[1, q], next_d[2, q] = d0, d1, d2
        goes_on[q] = True
    return ns


@njit(nogil=True, **_JIT)
def _next_rays(m, bounce, sample, W, box, scene, path, paths, hits):
    """Which of the m paths that turned at hit ``bounce`` (goes_on) go on along their next ray
    (next_o + t next_d), taking it and its slab as their ray: not once the throughput is 0, nor
    where Russian roulette (from bounce roulette_from) ends them (the survivors' throughput
    divided by their chance), nor where the ray leaves the march box at once (it sees the
    environment, weighted as a hit's emission)."""
    mats, env, lights = scene
    max_bounces, roulette_from, light_samples, hashed, seed = path
    ro, rd, t, tfar, side, thr, rad, prev_pdf, prev_p, pix = paths
    mat, grad, w_emit, goes_on, next_o, next_d = hits
    o = np.empty(3, F32)
    dv = np.empty(3, F32)
    for q in range(m):
        if not goes_on[q]:
            continue
        goes_on[q] = False
        keep = max(thr[0, q], max(thr[1, q], thr[2, q]))
        if not keep > F32(0):
            continue
        if bounce >= roulette_from:
            keep = min(keep, _ROULETTE_CAP)
            if not _random(hashed, seed, pix[0, q] * W + pix[1, q], sample, bounce, _DIM_ROULETTE) < keep:
                continue
            for r in range(3):
                thr[r, q] /= keep
        for r in range(3):
            o[r], dv[r] = next_o[r, q], next_d[r, q]
        t0, t1 = twin_march.slab(o, dv, box)
        if not t0 <= t1:                # (leaves the box at once: the environment)
            w = _mis_weight(lights, prev_pdf[q], ro[0, q], ro[1, q], ro[2, q], dv[0], dv[1], dv[2])
            _add_environment(lights, env, w, dv[0], dv[1], dv[2], thr, rad, q)
            continue
        for r in range(3):
            ro[r, q], rd[r, q] = o[r], dv[r]
        t[q], tfar[q] = t0, t1
        goes_on[q] = True


@njit(nogil=True, **_JIT)
def _add_shadow_light(ns, scene, rad, shadows):
    """The ns traced shadow rays' light: each adds the radiance it carries times the environment
    where it leaves, or times the emission of the surface it hits, to its path's radiance."""
    mats, env, lights = scene
    s_rays, s_add, s_path, s_traced = shadows
    s_ro, s_rd, s_side, s_t, s_tfar = s_rays
    s_steps, s_hit, s_mat, s_res, s_idx, s_hint = s_traced
    n_mat = mats.shape[0]
    for k in range(ns):
        q = s_path[k]
        if not s_hit[k]:
            e0, e1, e2 = _env_radiance(lights, env, s_rd[0, k], s_rd[1, k], s_rd[2, k])
            rad[0, q] += s_add[0, k] * e0
            rad[1, q] += s_add[1, k] * e1
            rad[2, q] += s_add[2, k] * e2
            continue
        e = mats[min(s_mat[k], n_mat - 1)]["emission"]
        for r in range(3):
            rad[r, q] += s_add[r, k] * e[r]


@njit(nogil=True, **_JIT)
def _compact_paths(m, sums, paths, goes_on):
    """Of the first m paths, finish the ones that end (_finish) and move the ones that go on to
    the front. Returns their count."""
    ro, rd, t, tfar, side, thr, rad, prev_pdf, prev_p, pix = paths
    n = np.int64(0)
    for q in range(m):
        if not goes_on[q]:
            _finish(sums, pix, rad, q)
            continue
        for r in range(3):
            ro[r, n], rd[r, n] = ro[r, q], rd[r, q]
            thr[r, n], rad[r, n] = thr[r, q], rad[r, q]
        pix[0, n], pix[1, n] = pix[0, q], pix[1, q]
        t[n], tfar[n], side[n], prev_pdf[n] = t[q], tfar[q], side[q], prev_pdf[q]
        for r in range(3):
            prev_p[r, n] = prev_p[r, q]
        n += 1
    return n


@njit(nogil=True, **_JIT)
def _finish(sums, pix, rad, q):
    """Add path q's radiance (and its mean over rgb, squared) to its pixel's sums."""
    row, col = pix[0, q], pix[1, q]
    y = (rad[0, q] + rad[1, q] + rad[2, q]) / F32(3)
    for r in range(3):
        sums[row, col, r] += rad[r, q]
    sums[row, col, 3] += y * y


def _twin_sums(tape: Tape, camera: Camera, width: int, height: int, settings: RenderSettings,
               path: PathSettings, first: int, count: int) -> np.ndarray:
    """(H, W, 4) float32 sums over samples first .. first+count-1 on the twin (_path_kernel)."""
    packed = settings.pack(tape, "shade")
    VALIDATED.check(tape)
    sums = np.zeros((height, width, 4), F32)
    value = twin.settings_value
    twin_threads.on_threads(_path_kernel, twin.kernel_tape(tape), tape.n_regs, twin.section_words(packed),
                            camera.pack(), value(packed, "box_lo", "box_hi").reshape(2, 3),
                            (value(packed, "hit_eps"), value(packed, "normal_eps"), int(value(packed, "max_steps")),
                             value(packed, "step_scale")),
                            (np.ascontiguousarray(tape.materials), np.asarray(path.environment, F32),
                             light_data(tape, path)),
                            (path.max_bounces, path.roulette_from, bool(path.light_samples), path.sampler == "hash",
                             path.seed), (first, count), sums)
    return sums


PATH_FIRST_ROUNDS = 4                   # the GPU path tracer's rounds in a walker's first submission
PATH_MAX_ROUNDS = 64                    # ... and the most in one
COUNT_PATH_PAUSES = 6                   # path.wgsl: the counters' word of traces paused by the budget


class GpuPathTracer:
    """The path tracer on a ``GpuWalker`` (shaders/path.wgsl), one per walker
    (``gpu_path_tracer``), through the walker's public dispatch (``upload``, ``uniforms``,
    ``prepare_outputs``, ``write_points``, ``path_cells``, ``run_kernels``, ``read_buffer``): a
    path image's sums kept on the GPU (``accumulation``), ``add`` into them, ``read`` /
    ``rgb8`` reading them. Holds ``rounds``, the rounds per submission: what the last sample
    needed, or one fewer than the last submission's (PATH_FIRST_ROUNDS at first, at most
    PATH_MAX_ROUNDS), shared by the walker's path images."""

    def __init__(self, walker):
        self.walker = walker
        self.rounds = PATH_FIRST_ROUNDS

    @guarded
    def accumulation(self, width: int, height: int) -> Buffer:
        """A path image's sums on the GPU, zeroed (WebGPU zeroes a new buffer): per pixel the
        radiance rgb and the square of each sample's mean over rgb, summed over the samples that
        ``add`` adds."""
        wgpu = load_wgpu()
        n = width * height
        limit = self.walker.context.limits["max_storage_buffer_binding_size"]
        if 16 * n > limit:
            raise TaperayError(f"a {width}x{height} path image needs {16 * n >> 20} MiB of sums; the adapter binds "
                               f"at most {limit >> 20} MiB (draw a smaller image or use the CPU walker)")
        buf = Buffer(self.walker.device, wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC, "path sums", limit)
        buf.ensure(16 * n)
        return buf

    def _own(self, sums: Buffer) -> Buffer:
        if sums.device is not self.walker.device:
            raise GpuError("this path image's sums were on a GPU device that is gone: make a new PathImage")
        return sums

    @guarded
    def add(self, sums: Buffer, tape: Tape, camera: Camera, width: int, height: int,
            settings: RenderSettings | None, path: PathSettings, first: int, count: int) -> dict:
        """Add samples first .. first+count-1 to ``sums`` (``accumulation``'s); no image is read
        back. Per wave of pixels (as many as out_f holds the state of) and sample:
        path_generate, then rounds of path_trace and path_accumulate until no path is left;
        after each submission of rounds the counters and the paths left after each round are
        read (``rounds`` rounds a submission). An arithmetic tape of at least PRUNE_MIN_RECORDS
        records is traced on its pruned march cells' tapes (path_trace_cells; the same field
        values, pruning is exact in a cell), pruned once and kept while nothing else uses out_u
        (``GpuWalker.path_cells``); other tapes on their own records. The light samples' data
        (``light_data``) is synced into the points buffer after the cells' layout. A path is not
        refused for its length; one field evaluation past the adapter's iteration cap is a
        TaperayError. Returns the counts of this add: "rounds" (trace / accumulate rounds
        dispatched), "pauses" (traces stopped by the iteration budget, to go on) and
        "cell_prunes" (the cells pruned, not kept from an earlier add)."""
        walker = self.walker
        self._own(sums)
        settings = settings or RenderSettings()
        packed = settings.pack(tape, "shade")
        variant = walker.upload(tape)
        n = width * height
        limit = walker.context.limits["max_storage_buffer_binding_size"]
        wave = min(n, limit // (4 * PATH_F_WORDS))
        desc, layout_words, u_base, pruned = walker.path_cells(tape, packed, variant, wave)
        counts = {"rounds": 0, "pauses": 0, "cell_prunes": int(pruned)}
        lights = light_data(tape, path)
        walker.write_points(np.concatenate([layout_words, lights]) if len(layout_words) else lights)
        trace = PATH_TRACE if desc is None else PATH_TRACE_CELLS
        walker.kernels.ensure([(k, variant) for k in (PATH_GENERATE, trace, PATH_ACCUMULATE)])
        env = np.asarray(path.environment, np.float32)
        cam = camera.pack()
        cam[7] = path.roulette_from                  # U.camera[1].w; [2].w, [3].w: the bits of the paths' state's
        cam[[11, 15]] = np.array([u_base, len(layout_words)], np.uint32).view(np.float32)   # and the lights' first words
        for s in range(first, first + count):
            for base in range(0, n, wave):
                u = walker.uniforms(tape, min(wave, n - base), width, height, sample=s,
                                    rect=(*env, path.max_bounces), extra=(0, 0, path.seed, path.flags()),
                                    camera=cam, settings=packed)
                u[12:14] = desc or 0, base       # (U.extra.x, .y's bits: the cells' descriptor, the wave's first pixel)
                first_rounds, rounds = [PATH_GENERATE], 0
                while True:
                    k = self.rounds
                    counters, live, _ = walker.run_kernels(tape, first_rounds + [trace, PATH_ACCUMULATE] * k, variant,
                                                           u, accum=sums, watch=PATH_ACCUMULATE)
                    counts["pauses"] += int(counters[COUNT_PATH_PAUSES])
                    counts["rounds"] += k
                    if live[-1] == 0:
                        break
                    rounds += k
                    first_rounds = []
                needed = rounds + int(np.argmax(live == 0)) + 1
                self.rounds = min(max(needed, self.rounds - 1), PATH_MAX_ROUNDS)
        return counts

    @guarded
    def read(self, sums: Buffer, width: int, height: int) -> np.ndarray:
        """(H, W, 4) float32: ``sums`` read back."""
        return self.walker.read_buffer(self._own(sums), np.float32, 4 * width * height).reshape(height, width, 4)

    @guarded
    def rgb8(self, sums: Buffer, tape: Tape, width: int, height: int, samples: int) -> np.ndarray:
        """(H, W, 3) uint8: the picture of ``sums`` over ``samples`` samples, tonemapped on the GPU
        (path_tonemap: the mean clamped to [0, 1], gamma 1/2.2, rounded) and read back."""
        walker = self.walker
        n = width * height
        walker.prepare_outputs(1, (3 * n + 3) // 4)
        walker.drop_kept_cells()
        walker.kernels.ensure([(PATH_TONEMAP, None)])
        u = walker.uniforms(tape, n, width, height, sample=samples)
        words = walker.run_kernels(tape, [PATH_TONEMAP], None, u, accum=self._own(sums), check=False,
                                   read=("u", (3 * n + 3) // 4))[2]
        return words.view(np.uint8)[:3 * n].reshape(height, width, 3)


_GPU_PATH_TRACERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def gpu_path_tracer(walker) -> GpuPathTracer:
    """The ``GpuPathTracer`` of GPU walker ``walker`` (made on first use, kept while the walker
    lives)."""
    tracer = _GPU_PATH_TRACERS.get(walker)
    if tracer is None:
        tracer = _GPU_PATH_TRACERS[walker] = GpuPathTracer(walker)
    return tracer


class PathImage:
    """A progressive path-traced image on one walker: ``add(n)`` traces n more samples per
    pixel and adds them in; ``mean()`` is the radiance so far, ``rgb8()`` the picture. The
    camera, settings and tape are fixed for its life: after an edit make a new one. On the GPU
    walker the sums stay on the GPU (``GpuPathTracer.accumulation``): ``add`` reads nothing
    back, ``sums`` / ``mean`` / ``tile_stats`` read them, ``rgb8`` tonemaps there and reads the
    picture; on the twin they are a float64 array, each ``add``'s float32 sums added in.
    ``stats()`` counts the GPU's work for this image."""

    def __init__(self, walker, tape: Tape, camera: Camera | None, width: int, height: int,
                 settings: RenderSettings | None = None, path: PathSettings | None = None):
        name = getattr(walker, "name", None)
        if name not in ("cpu", "gpu"):
            raise TaperayError(f"the path tracer runs on the cpu and gpu walkers, not on "
                               f"{name or type(walker).__name__!r}")
        if width < 1 or height < 1:
            raise TaperayError(f"image size {width}x{height} must be at least 1x1")
        self.walker, self.tape = walker, tape
        self.camera = camera or auto_camera(tape.bounds)
        self.width, self.height = width, height
        self.settings = settings or RenderSettings()
        self.path = path or PathSettings()
        self.samples = 0
        self._on_gpu = name == "gpu"
        self._gpu = gpu_path_tracer(walker) if self._on_gpu else None
        self._sums = self._gpu.accumulation(width, height) if self._on_gpu else np.zeros((height, width, 4))
        self._counts = {"rounds": 0, "pauses": 0, "cell_prunes": 0}

    def add(self, count: int) -> PathImage:
        """Trace ``count`` more samples per pixel (the next ones of the sequence)."""
        first = self.samples
        if count < 1 or first + count > 1 << 24:
            raise TaperayError(f"path samples {first}..{first + count - 1} must lie in 0..2^24-1")
        args = (self.tape, self.camera, self.width, self.height, self.settings, self.path, first, count)
        if self._on_gpu:
            for k, v in self._gpu.add(self._sums, *args).items():
                self._counts[k] += v
        else:
            self._sums += _twin_sums(*args)
        self.samples += count
        return self

    @property
    def sums(self) -> np.ndarray:
        """(H, W, 4) float64 sums over the samples: radiance rgb, and the samples' mean over rgb
        squared (read back from the GPU there)."""
        if self._on_gpu:
            return self._gpu.read(self._sums, self.width, self.height).astype(np.float64)
        return self._sums

    def stats(self) -> dict:
        """The GPU's work for this image's adds so far (zeros on the twin): "rounds" (path_trace /
        path_accumulate rounds dispatched), "pauses" (traces stopped by the adapter's iteration
        budget, to go on in the next round) and "cell_prunes" (the pruned march cells built for
        it, not kept from an earlier add)."""
        return dict(self._counts)

    def mean(self) -> np.ndarray:
        """(H, W, 3) float32 mean radiance per pixel."""
        if self.samples == 0:
            raise TaperayError("path image: no samples yet (call add)")
        return (self.sums[..., :3] / self.samples).astype(np.float32)

    def rgb8(self) -> np.ndarray:
        """(H, W, 3) uint8: the mean radiance clamped to [0, 1], gamma 1/2.2 (kernels_render.wgsl
        view_colour's display curve), rounded; on the GPU walker computed there (path.wgsl
        path_tonemap, float32: a channel may round to the neighbouring level)."""
        if self.samples == 0:
            raise TaperayError("path image: no samples yet (call add)")
        if self._on_gpu:
            return self._gpu.rgb8(self._sums, self.tape, self.width, self.height, self.samples)
        c = np.clip(self.mean().astype(np.float64), 0.0, 1.0) ** (1 / 2.2)
        return np.round(c * 255).astype(np.uint8)

    def tile_stats(self, tile: int) -> tuple[np.ndarray, np.ndarray]:
        """Per ``tile`` x ``tile`` pixel block (whole blocks only): the mean of the samples'
        luminance (their mean over rgb) and its standard error, from each pixel's sample variance
        (the pixels' samples are independent; a tile's mean is the mean of its pixels' means)."""
        if self.samples < 2:
            raise TaperayError("path image: a standard error needs at least 2 samples")
        s = self.samples
        sums = self.sums
        th, tw = self.height // tile, self.width // tile
        y_sum = sums[..., :3].sum(-1) / 3
        m = y_sum / s
        var = np.maximum(sums[..., 3] / s - m * m, 0.0) * s / (s - 1)
        crop = (slice(0, th * tile), slice(0, tw * tile))
        means = m[crop].reshape(th, tile, tw, tile).mean((1, 3))
        se = np.sqrt((var[crop] / s).reshape(th, tile, tw, tile).sum((1, 3))) / (tile * tile)
        return means, se
