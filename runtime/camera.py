"""Cameras and the one pixel convention every walker uses.

Owns ``Camera`` (a pinhole: eye, target, up, vertical field of view), ``auto_camera`` (frame a
bounds box) and the ray of each pixel. The convention, shared by the CPU twin and the WGSL kernels:

  * the image is ``height`` rows of ``width`` columns, row 0 at the TOP;
  * the ray of pixel (row, col) starts at ``eye`` and passes through the pixel CENTRE;
  * with ``forward = normalize(target - eye)``, ``right = normalize(cross(forward, up))``,
    ``up' = cross(right, forward)``, ``aspect = width / height`` and ``th = tan(fov/2)``::

        ndc_x = (2 * (col + 0.5) / width - 1) * aspect * th
        ndc_y = (1 - 2 * (row + 0.5) / height) * th
        dir   = normalize(forward + ndc_x * right + ndc_y * up')

    computed in float32 from the numbers of ``Camera.pack()`` (so the GPU uses the same inputs).

``Camera.pack()`` is 16 float32, laid out as four vec4s for WGSL::

    [ eye.x eye.y eye.z tan_half_fov | right.xyz 0 | up'.xyz 0 | forward.xyz 0 ]
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .jit_cache import njit, prange
from .tape import TaperayError

__all__ = ["Camera", "auto_camera", "CAMERA_PACK_LEN"]

CAMERA_PACK_LEN = 16


@dataclass
class Camera:
    eye: tuple[float, float, float]
    target: tuple[float, float, float]
    up: tuple[float, float, float] = (0.0, 0.0, 1.0)
    fov_deg: float = 40.0

    def basis(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(forward, right, up') unit vectors (float64). An ``up`` parallel to the view falls back
        to +y (or +x) so a camera looking straight down still has a basis."""
        eye, target = np.asarray(self.eye, float), np.asarray(self.target, float)
        fwd = target - eye
        if not np.all(np.isfinite(fwd)) or np.linalg.norm(fwd) == 0:
            raise TaperayError(f"camera: eye {self.eye} and target {self.target} must differ and be finite")
        if not 0 < self.fov_deg < 180:
            raise TaperayError(f"camera: field of view {self.fov_deg} must lie in (0, 180) degrees")
        fwd /= np.linalg.norm(fwd)
        for up in (np.asarray(self.up, float), np.array([0.0, 1.0, 0.0]), np.array([1.0, 0.0, 0.0])):
            right = np.cross(fwd, up)
            if np.linalg.norm(right) > 1e-6 * max(np.linalg.norm(up), 1e-30):
                break
        right /= np.linalg.norm(right)
        return fwd, right, np.cross(right, fwd)

    def _tan_half_fov(self) -> float:
        return math.tan(math.radians(self.fov_deg) / 2)

    def pack(self) -> np.ndarray:
        fwd, right, up = self.basis()
        return np.array([*self.eye, self._tan_half_fov(), *right, 0, *up, 0, *fwd, 0], np.float32)

    def pixel_angle(self, height: int) -> float:
        """The angle a pixel row spans at the image centre, 2 tan(fov / 2) / height: the
        RenderSettings.hit_cone whose threshold is a pixel's footprint along the ray."""
        return 2 * self._tan_half_fov() / height

    def rays(self, width: int, height: int) -> tuple[np.ndarray, np.ndarray]:
        """(origin (3,) float32, directions (height, width, 3) float32) by the pixel convention."""
        if width < 1 or height < 1:
            raise TaperayError(f"image size {width}x{height} must be at least 1x1")
        pk = self.pack()
        d = np.empty((height, width, 3), np.float32)
        _pixel_rays(pk, d)
        return pk[0:3].copy(), d


@njit(cache=True, error_model="numpy", fastmath=False)
def pixel_ray(pk, width, height, x, y):
    """The unit direction through the image point (x, y) in pixels (x from the left edge, y from
    the top; a pixel's centre is col + 0.5, row + 0.5), by the convention's formula in float32 in
    the order written, from Camera.pack()'s numbers (kernels_render.wgsl camera_dir)."""
    f32 = np.float32
    th = pk[3]
    aspect = f32(width) / f32(height)
    ndc_y = (f32(1) - f32(2) * y / f32(height)) * th
    ndc_x = (f32(2) * x / f32(width) - f32(1)) * aspect * th
    dx = pk[12] + ndc_x * pk[4] + ndc_y * pk[8]
    dy = pk[13] + ndc_x * pk[5] + ndc_y * pk[9]
    dz = pk[14] + ndc_x * pk[6] + ndc_y * pk[10]
    n = np.sqrt(dx * dx + dy * dy + dz * dz)
    return dx / n, dy / n, dz / n


@njit(parallel=True, cache=True, error_model="numpy", fastmath=False)
def _pixel_rays(pk, d):
    """pixel_ray at every pixel centre, into d (height, width, 3)."""
    f32 = np.float32
    height, width = d.shape[0], d.shape[1]
    for row in prange(height):
        for col in range(width):
            d[row, col, 0], d[row, col, 1], d[row, col, 2] = pixel_ray(pk, width, height, f32(col) + f32(0.5),
                                                                       f32(row) + f32(0.5))


def auto_camera(bounds, azimuth_deg: float = 35.0, elevation_deg: float = 25.0,
                fov_deg: float = 40.0) -> Camera:
    """A camera looking at the centre of the (2, 3) ``bounds`` box (z up) from far enough that
    the box's bounding sphere fits the vertical field of view. Azimuth is measured from the front
    (-y) towards +x, elevation up from the xy plane."""
    b = np.asarray(bounds, float).reshape(2, 3)
    if not np.all(np.isfinite(b)):
        raise TaperayError(f"auto_camera: bounds {b.tolist()} are not finite")
    centre = b.mean(0)
    radius = max(np.linalg.norm(b[1] - b[0]) / 2, 1e-3)
    dist = radius / math.sin(math.radians(fov_deg) / 2) * 1.05
    az, el = math.radians(azimuth_deg), math.radians(elevation_deg)
    offset = np.array([math.cos(el) * math.sin(az), -math.cos(el) * math.cos(az), math.sin(el)])
    return Camera(tuple((centre + dist * offset).tolist()), tuple(centre.tolist()), (0.0, 0.0, 1.0), fov_deg)
