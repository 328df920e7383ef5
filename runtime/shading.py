"""Render settings, their packed layout for the kernels, and how each view turns march results
into colour.

Owns ``RenderSettings`` (march, lights, shadows, ambient occlusion, background, section / slice
plane), ``RenderSettings.pack(tape, view)`` (the fixed float32 layout the WGSL kernels mirror) and
the colour formulas of every view (``compose``), applied to what a walker measured: the march
(t, hit, steps, material, field gradient at the hit) and, for "shade" / "section", the key
light's visibility and the ambient occlusion. The shade formula runs as a Numba kernel
(``_shade``, pixel by pixel in float64), the other views as numpy array expressions.

Packed layout (``PACK_LEN`` = 48 float32, twelve vec4s, the last three zero; ``PACK_FIELDS``
holds the offsets and a test checks them; absolute lengths derive from the tape's bounds
diagonal ``diag``)::

    0  max_steps        1  hit_eps           2  step_scale        3  normal_eps
    4  box_lo.xyz  (march box = bounds grown by margin_rel*diag)  7  shadow_mode (0 off, 1 hard, 2 soft)
    8  box_hi.xyz                                                11  soft_k
    12 key_dir.xyz (unit, towards the light)                     15  shadow_steps
    16 key_color.rgb                                             19  ao_strength (0: no AO)
    20 fill_dir.xyz (unit, towards the light)                    23  ao_dist
    24 fill_color.rgb                                            27  specular
    28 sky_color.rgb                                             31  section (1: march max(f, plane))
    32 ground_color.rgb                                          35  contour_spacing
    36 background.rgb                                            39  view (index in VIEWS)
    40 plane_n.xyz (unit)                                        43  plane_d (plane: dot(p, n) = d)
    44 cell_skip (1: a march on pruned cells steps over cells proven empty)
    45 hit_cone (primary rays: the hit threshold grows by hit_cone per unit of t)

March: a ray is clipped to the march box (t >= 0); from the entry, ``t += f * step_scale`` until
``f < hit_eps`` (hit), ``t`` passes the box exit or ``max_steps`` steps are spent (miss). A
primary ray with ``hit_cone`` > 0 hits where ``f < max(hit_eps, hit_cone * t)`` instead (cone
marching: detail thinner than about ``hit_cone * t`` ends the ray; hit_cone = the pixel's angle
makes the threshold a pixel's footprint); shadow rays keep ``hit_eps``. On pruned cells with
``cell_skip``, a step from a point in a cell whose interval's lower bound L is at least the hit
threshold takes no field value: ``t`` moves to T = max(t + L * step_scale, the cell box's exit),
provided L is at least the threshold at T, and it counts as a step.
Normals are the field gradient by the 4-tap tetrahedron (``k`` in (+,-,-), (-,-,+), (-,+,-),
(+,+,+)): ``grad = sum(k * f(p + normal_eps * k)) / (4 * normal_eps)``.

Section (view "section"): every evaluation (march, normals, shadows, AO) uses
``max(f, dot(p, plane_n) - plane_d)``; the material stays f's, so the cut face shows the material
it cuts. Slice (view "slice"): each pixel's ray meets the plane at t > 0 inside the march box.
Key-light visibility: a march from ``p + 4 hit_eps n`` along ``key_dir`` from t = 0 to the box
exit, at most ``shadow_steps``; a hit (f < hit_eps) gives 0; soft shadows (mode 2) otherwise give
``clamp(min over steps with t > 0 of soft_k * f / t, 0, 1)``, hard shadows 1. Ambient occlusion:
taps ``h_i = ao_dist (i + 1) / 5`` (i = 0..4), weights ``w_i = 0.5^i``,
``occ = sum(w_i max(h_i - f(p + h_i n), 0) / h_i) / sum(w_i)``, ``ao = max(1 - ao_strength occ, 0)``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .jit_cache import njit
from .tape import Tape, TaperayError

__all__ = ["RenderSettings", "VIEWS", "PACK_FIELDS", "PACK_LEN", "compose", "compile_shading", "to_rgb8", "heat",
           "unpack"]

VIEWS = ("shade", "normals", "depth", "steps", "gradient", "slice", "section")
SHADOW_MODES = ("off", "hard", "soft")


def _unit(v) -> tuple[float, float, float]:
    a = np.asarray(v, float)
    n = np.linalg.norm(a)
    if not np.isfinite(n) or n == 0:
        raise TaperayError(f"render settings: direction {tuple(v)} must be finite and non-zero")
    return tuple((a / n).tolist())


@dataclass
class RenderSettings:
    # march
    max_steps: int = 256
    hit_eps_rel: float = 1e-4          # hit when f < hit_eps_rel * diag
    step_scale: float = 1.0            # < 1 for fields whose Lipschitz constant exceeds 1
    # a march on pruned cells steps over a cell whose interval's lower bound is at least hit_eps
    # (no point of it is a hit: to the cell's exit, or by the bound if further), without
    # evaluating the field there; off, it takes the steps of the march on the whole tape, bit for
    # bit. Not for soft shadows (their penumbra reads every step's value).
    cell_skip: bool = True
    # primary rays hit where f < max(hit_eps, hit_cone * t) (0: f < hit_eps): a ray ends at detail
    # thinner than the cone's width there; hit_cone = a pixel's angle (e.g. 2 tan(fov / 2) /
    # height) gives each pixel's footprint, and fewer steps past sub-pixel parts
    hit_cone: float = 0.0
    normal_eps_factor: float = 2.0     # normal_eps = normal_eps_factor * hit_eps
    margin_rel: float = 0.05           # march box = bounds grown by margin_rel * diag
    # lights
    key_dir: tuple[float, float, float] = (-0.45, -0.65, 0.85)
    key_color: tuple[float, float, float] = (0.95, 0.91, 0.84)
    fill_dir: tuple[float, float, float] = (0.8, 0.1, 0.35)
    fill_color: tuple[float, float, float] = (0.22, 0.26, 0.33)
    sky_color: tuple[float, float, float] = (0.34, 0.38, 0.45)
    ground_color: tuple[float, float, float] = (0.16, 0.14, 0.13)
    specular: float = 0.25
    shadows: str = "hard"              # off | hard | soft
    soft_k: float = 8.0
    shadow_steps: int = 128
    ao_strength: float = 1.0           # 0 switches ambient occlusion off
    ao_dist_rel: float = 0.04          # the 5 AO taps reach ao_dist_rel * diag along the normal
    background: tuple[float, float, float] = (0.92, 0.93, 0.95)
    # section / slice plane: dot(p, n) = d; d None = through the bounds centre
    plane_normal: tuple[float, float, float] = (0.0, -1.0, 0.0)
    plane_offset: float | None = None
    contour_spacing_rel: float = 0.05  # slice view: contour every contour_spacing_rel * diag

    def __post_init__(self):
        if self.shadows not in SHADOW_MODES:
            raise TaperayError(f"render settings: shadows {self.shadows!r} is not one of {SHADOW_MODES}")
        if not (1 <= self.max_steps <= 1 << 20 and 1 <= self.shadow_steps <= 1 << 20):
            raise TaperayError("render settings: max_steps and shadow_steps must lie in 1..2^20")
        if not (self.hit_eps_rel > 0 and self.step_scale > 0 and self.normal_eps_factor > 0):
            raise TaperayError("render settings: hit_eps_rel, step_scale and normal_eps_factor must be > 0")
        if not (0 <= self.hit_cone < 1):
            raise TaperayError(f"render settings: hit_cone {self.hit_cone} must lie in [0, 1)")

    def pack(self, tape: Tape, view: str = "shade") -> np.ndarray:
        if view not in VIEWS:
            raise TaperayError(f"unknown view {view!r}; views are {', '.join(VIEWS)}")
        b = np.asarray(tape.bounds, np.float64)
        diag = max(float(np.linalg.norm(b[1] - b[0])), 1e-6)
        hit_eps = self.hit_eps_rel * diag
        grow = self.margin_rel * diag
        plane_n = _unit(self.plane_normal)
        plane_d = float(np.dot(plane_n, b.mean(0))) if self.plane_offset is None else float(self.plane_offset)
        values = {
            "max_steps": self.max_steps, "hit_eps": hit_eps, "step_scale": self.step_scale,
            "normal_eps": self.normal_eps_factor * hit_eps,
            "box_lo": b[0] - grow, "shadow_mode": SHADOW_MODES.index(self.shadows),
            "box_hi": b[1] + grow, "soft_k": self.soft_k,
            "key_dir": _unit(self.key_dir), "shadow_steps": self.shadow_steps,
            "key_color": self.key_color, "ao_strength": self.ao_strength,
            "fill_dir": _unit(self.fill_dir), "ao_dist": self.ao_dist_rel * diag,
            "fill_color": self.fill_color, "specular": self.specular,
            "sky_color": self.sky_color, "section": 1.0 if view == "section" else 0.0,
            "ground_color": self.ground_color, "contour_spacing": self.contour_spacing_rel * diag,
            "background": self.background, "view": VIEWS.index(view),
            "plane_n": plane_n, "plane_d": plane_d, "cell_skip": 1.0 if self.cell_skip else 0.0,
            "hit_cone": self.hit_cone,
        }
        out = np.zeros(PACK_LEN, np.float32)
        for name, (off, size) in PACK_FIELDS.items():
            out[off:off + size] = values[name]
        return out


# name -> (offset, size) in the packed settings
_ORDER = [("max_steps", 1), ("hit_eps", 1), ("step_scale", 1), ("normal_eps", 1),
          ("box_lo", 3), ("shadow_mode", 1), ("box_hi", 3), ("soft_k", 1),
          ("key_dir", 3), ("shadow_steps", 1), ("key_color", 3), ("ao_strength", 1),
          ("fill_dir", 3), ("ao_dist", 1), ("fill_color", 3), ("specular", 1),
          ("sky_color", 3), ("section", 1), ("ground_color", 3), ("contour_spacing", 1),
          ("background", 3), ("view", 1), ("plane_n", 3), ("plane_d", 1), ("cell_skip", 1),
          ("hit_cone", 1)]
PACK_FIELDS: dict[str, tuple[int, int]] = {}
for _name, _size in _ORDER:
    PACK_FIELDS[_name] = (sum(s for _, s in PACK_FIELDS.values()), _size)
PACK_LEN = -(-sum(s for _, s in PACK_FIELDS.values()) // 4) * 4    # whole vec4s (the uniforms' layout), zero-padded
del _name, _size


def unpack(packed: np.ndarray, *names: str) -> np.ndarray:
    """The named fields of packed settings, concatenated (float32)."""
    return np.concatenate([packed[PACK_FIELDS[n][0]:PACK_FIELDS[n][0] + PACK_FIELDS[n][1]] for n in names]
                          ).astype(np.float32)


def _get(packed: np.ndarray, name: str) -> np.ndarray:
    return unpack(packed, name).astype(np.float64)


_HEAT_STOPS = np.array([[0.05, 0.03, 0.20], [0.45, 0.10, 0.55], [0.90, 0.35, 0.20],
                        [1.00, 0.80, 0.30], [1.00, 1.00, 0.90]])


def heat(x: np.ndarray) -> np.ndarray:
    """Heat colour map of x in [0, 1] (dark purple -> red -> yellow -> white), piecewise linear."""
    x = np.clip(np.nan_to_num(np.asarray(x, np.float64), nan=1.0), 0, 1) * (len(_HEAT_STOPS) - 1)
    i = np.minimum(x.astype(int), len(_HEAT_STOPS) - 2)
    f = (x - i)[..., None]
    return _HEAT_STOPS[i] * (1 - f) + _HEAT_STOPS[i + 1] * f


def compose(view: str, packed: np.ndarray, materials: np.ndarray, camera_pack: np.ndarray,
            dirs: np.ndarray, march: dict | None = None, light: dict | None = None,
            slice_field: np.ndarray | None = None) -> np.ndarray:
    """Display colours (H, W, 3) float in [0, 1] of ``view`` from what a walker measured.

    * shade / section (``march`` + ``light``: shadow, ao): with n the unit gradient, v = -dir,
      base / rough the hit material's colour / roughness:
      ``amb = ground + (sky - ground) * (0.5 + 0.5 n.z)``, ``kd = max(n.key, 0) * shadow``,
      ``fd = max(n.fill, 0)``, ``spec = specular (1 - rough) max(n.normalize(key + v), 0)^(2 + 126 (1 - rough)^2)``
      (only where n.key > 0), ``linear = base (amb ao + key_color kd + fill_color fd) + key_color spec shadow``,
      shown as ``linear^(1/2.2)``; misses show ``background``.
    * normals: 0.5 + 0.5 n.  depth: grey 0.15 + 0.85 (1 - (t - near) / (far - near)) with near / far
      the eye's distance to the march box's bounding sphere.  steps: ``heat(steps / max_steps)``
      on every pixel.  gradient: |grad f| coloured green at 1, towards blue at 1/2 and red at 2
      (log2 scale).
    * slice (``slice_field``: the field where each pixel's ray meets the plane, NaN elsewhere):
      blue inside, orange outside, brightness 0.8 + 0.2 cos(2 pi f / spacing), contour lines every
      ``contour_spacing`` and a black zero contour.
    """
    bg = _get(packed, "background")
    if view == "slice":
        f = np.asarray(slice_field, np.float64)
        valid = np.isfinite(f)
        f = np.where(valid, f, 0.0)
        sp = max(float(_get(packed, "contour_spacing")[0]), 1e-12)
        base = np.where((f < 0)[..., None], [0.25, 0.45, 0.85], [0.95, 0.62, 0.28])
        col = base * (0.8 + 0.2 * np.cos(2 * np.pi * f / sp))[..., None]
        frac = np.abs(f / sp - np.round(f / sp))
        col = np.where((frac < 0.05)[..., None], col * 0.55, col)
        col = np.where((np.abs(f) < 0.06 * sp)[..., None], 0.0, col)
        return np.where(valid[..., None], col, bg)
    if march is None:
        raise TaperayError(f"view {view!r} needs march results")
    hit = march["hit"]
    if view == "steps":
        return heat(march["steps"] / _get(packed, "max_steps")[0])
    if view in ("shade", "section"):
        if light is None:
            raise TaperayError(f"view {view!r} needs light results (shadow, ao)")
        out = np.empty(hit.shape + (3,), np.float64)
        lights = np.stack([_get(packed, k) for k in ("key_dir", "fill_dir", "sky_color", "ground_color",
                                                      "key_color", "fill_color", "background")])
        _shade(hit, np.asarray(march["grad"], np.float32), march["mat"], light["shadow"], light["ao"],
               np.asarray(dirs, np.float32), materials["color"].astype(np.float64),
               materials["roughness"].astype(np.float64), lights, float(_get(packed, "specular")[0]), out)
        return out
    # the other views colour the hit pixels only (misses show the background): each array below
    # holds the hit pixels' values, in row-major order
    g = np.asarray(march["grad"], np.float64)[hit]
    glen = np.linalg.norm(g, axis=-1)
    n = g / np.where(glen > 0, glen, 1)[..., None]
    if view == "normals":
        col = 0.5 + 0.5 * n
    elif view == "depth":
        eye = np.asarray(camera_pack[:3], np.float64)
        lo, hi = _get(packed, "box_lo"), _get(packed, "box_hi")
        dist, rad = np.linalg.norm(eye - (lo + hi) / 2), np.linalg.norm(hi - lo) / 2
        near, far = max(dist - rad, 0.0), dist + rad
        t = march["t"][hit]
        col = np.repeat((0.15 + 0.85 * (1 - np.clip((t - near) / (far - near), 0, 1)))[..., None], 3, -1)
    elif view == "gradient":
        x = np.clip(np.log2(np.where(glen > 0, glen, 1e-30)), -1, 1)[..., None]
        green, blue, red = np.array([0.2, 0.75, 0.3]), np.array([0.2, 0.35, 0.95]), np.array([0.95, 0.25, 0.2])
        col = np.where(x < 0, green + (blue - green) * -x, green + (red - green) * x)
    else:
        raise TaperayError(f"unknown view {view!r}; views are {', '.join(VIEWS)}")
    out = np.empty(hit.shape + (3,), np.float64)
    out[...] = bg
    out[hit] = col
    return out


# Serial loops: a frame's shading takes milliseconds, and a parallel loop's wrappers cost its cold
# compile seconds (docs/PERFORMANCE.md, cold compile).
@njit(cache=True, error_model="numpy", fastmath=False)
def _shade(hit, grad, mat, shadow, ao, dirs, color, rough, lights, specular, out):
    """compose's shade formula (its docstring), float64, pixel by pixel into out (H, W, 3): lights
    rows key_dir, fill_dir, sky, ground, key_color, fill_color, background."""
    key, fill, sky, ground, key_col, fill_col, bg = (lights[0], lights[1], lights[2], lights[3], lights[4],
                                                     lights[5], lights[6])
    for row in range(hit.shape[0]):
        for col in range(hit.shape[1]):
            if not hit[row, col]:
                for c in range(3):
                    out[row, col, c] = bg[c]
                continue
            gx, gy, gz = np.float64(grad[row, col, 0]), np.float64(grad[row, col, 1]), np.float64(grad[row, col, 2])
            glen = np.sqrt(gx * gx + gy * gy + gz * gz)
            if not glen > 0:
                glen = 1.0
            nx, ny, nz = gx / glen, gy / glen, gz / glen
            m = min(max(np.int64(mat[row, col]), 0), color.shape[0] - 1)
            r = rough[m]
            sh, occ = np.float64(shadow[row, col]), np.float64(ao[row, col])
            ndk = nx * key[0] + ny * key[1] + nz * key[2]
            kd = max(ndk, 0.0) * sh
            fd = max(nx * fill[0] + ny * fill[1] + nz * fill[2], 0.0)
            hx = key[0] - np.float64(dirs[row, col, 0])
            hy = key[1] - np.float64(dirs[row, col, 1])
            hz = key[2] - np.float64(dirs[row, col, 2])
            hl = np.sqrt(hx * hx + hy * hy + hz * hz)
            hx, hy, hz = hx / hl, hy / hl, hz / hl
            spec = 0.0
            if ndk > 0:
                shin = 2 + 126 * (1 - r) ** 2
                spec = specular * (1 - r) * max(nx * hx + ny * hy + nz * hz, 0.0) ** shin
            up = 0.5 + 0.5 * nz
            for c in range(3):
                amb = ground[c] + (sky[c] - ground[c]) * up
                lin = color[m, c] * (amb * occ + key_col[c] * kd + fill_col[c] * fd) + key_col[c] * spec * sh
                if lin < 0:
                    lin = 0.0
                elif lin > 1:
                    lin = 1.0
                out[row, col, c] = lin ** (1 / 2.2)


def compile_shading(view: str) -> None:
    """Compile (or load from the disk cache) the kernels that turn ``view``'s measurements into
    an image (``_shade`` for shade / section, ``_rgb8``) for the types ``compose`` and ``to_rgb8``
    pass them, on a one-pixel image, without a frame: a cold render does it while a helper
    process compiles the twin's interpreter (runtime.twin.march)."""
    if view in ("shade", "section"):
        f32 = np.zeros((1, 1), np.float32)
        _shade(np.zeros((1, 1), np.bool_), np.zeros((1, 1, 3), np.float32), np.zeros((1, 1), np.uint32), f32, f32,
               np.zeros((1, 1, 3), np.float32), np.zeros((1, 3)), np.zeros(1), np.zeros((7, 3)), 0.0,
               np.empty((1, 1, 3)))
    _rgb8(np.zeros(1), np.empty(1, np.uint8))


def to_rgb8(colors: np.ndarray) -> np.ndarray:
    """Display colours in [0, 1] -> (H, W, 3) uint8: NaN 0, clipped into [0, 1] (infinities
    too), times 255, rounded to nearest (ties to even)."""
    x = np.ascontiguousarray(colors, np.float64)
    out = np.empty(x.shape, np.uint8)
    _rgb8(x.reshape(-1), out.reshape(-1))
    return out


@njit(cache=True, error_model="numpy", fastmath=False)      # (serial, as _shade)
def _rgb8(x, out):
    for i in range(x.shape[0]):
        v = x[i]
        if not v > 0:          # (NaN too)
            v = 0.0
        elif v > 1:
            v = 1.0
        out[i] = np.uint8(np.rint(v * 255))
