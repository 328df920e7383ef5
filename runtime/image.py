"""Image files: ``write_png`` writes an RGB (or grey) uint8 array atomically.

The file appears complete or not at all (``runtime.outputs.write_atomic``): a reader never sees half
an image, and a failed write leaves the old file.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from .outputs import write_atomic
from .tape import TaperayError

__all__ = ["write_png"]


def write_png(path, rgb) -> Path:
    """Write (H, W, 3) or (H, W) uint8 ``rgb`` to ``path`` as PNG (folders are created)."""
    a = np.asarray(rgb)
    if a.dtype != np.uint8 or not (a.ndim == 2 or (a.ndim == 3 and a.shape[2] == 3)) or a.size == 0:
        raise TaperayError(f"write_png: expected a non-empty (H, W, 3) or (H, W) uint8 array, "
                           f"got {a.dtype} {a.shape}")
    image = Image.fromarray(np.ascontiguousarray(a))
    return Path(write_atomic(path, lambda tmp: image.save(tmp, format="PNG")))
