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

    def pack(self) -> np.ndarray:
        fwd, right, up = self.basis()
        th = math.tan(math.radians(self.fov_deg) / 2)
        return np.array([*self.eye, th, *right, 0, *up, 0, *fwd, 0], np.float32)

    def rays(self, width: int, height: int) -> tuple[np.ndarray, np.ndarray]:
        """(origin (3,) float32, directions (height, width, 3) float32) by the pixel convention."""
        if width < 1 or height < 1:
            raise TaperayError(f"image size {width}x{height} must be at least 1x1")
        pk = self.pack()
        eye, th, right, up, fwd = pk[0:3], pk[3], pk[4:7], pk[8:11], pk[12:15]
        f32 = np.float32
        aspect = f32(width) / f32(height)
        col = np.arange(width, dtype=np.float32)
        row = np.arange(height, dtype=np.float32)
        ndc_x = (f32(2) * (col + f32(0.5)) / f32(width) - f32(1)) * aspect * th
        ndc_y = (f32(1) - f32(2) * (row + f32(0.5)) / f32(height)) * th
        d = fwd + ndc_x[None, :, None] * right + ndc_y[:, None, None] * up
        d = d / np.sqrt(np.sum(d * d, axis=-1, keepdims=True))
        return eye.copy(), d.astype(np.float32)


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
