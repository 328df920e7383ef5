"""Image files: ``write_png`` writes an RGB (or grey) uint8 array atomically.

The file appears complete or not at all: it is written to a temporary file in the same folder and
renamed over the target, so a reader never sees half an image.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from .tape import TaperayError

__all__ = ["write_png"]


def write_png(path, rgb) -> Path:
    """Write (H, W, 3) or (H, W) uint8 ``rgb`` to ``path`` as PNG (folders are created)."""
    a = np.asarray(rgb)
    if a.dtype != np.uint8 or not (a.ndim == 2 or (a.ndim == 3 and a.shape[2] == 3)) or a.size == 0:
        raise TaperayError(f"write_png: expected a non-empty (H, W, 3) or (H, W) uint8 array, "
                           f"got {a.dtype} {a.shape}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())         # (mkstemp makes it 0600; a new file's usual mode)
        with os.fdopen(fd, "wb") as fh:
            Image.fromarray(np.ascontiguousarray(a)).save(fh, format="PNG")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
