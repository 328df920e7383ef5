"""Where the runtime's Numba kernels are cached on disk: a per-user directory.

Numba keeps compiled kernels beside their sources (``__pycache__``) unless told otherwise, which a
non-editable install into a read-only ``site-packages`` cannot write. The runtime's jitted modules
(camera, shading, twin and the modules that import them before defining their own kernels) import
this module first, so every kernel's cache lives in ``$NUMBA_CACHE_DIR`` where the user set it,
else in ``user_cache_dir("numba")`` (``~/.cache/taperay/numba``). Numba names each entry by the
source file's path and checks its stamp, so installs and checkouts side by side do not mix, and a
cold compile happens once per user and source version.
"""
from __future__ import annotations

import os
from pathlib import Path

import numba

__all__ = ["user_cache_dir", "numba_cache_dir"]


def user_cache_dir(name: str) -> Path:
    """``$XDG_CACHE_HOME/taperay/<name>`` (``~/.cache/taperay/<name>``): a per-user cache folder."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "taperay" / name


def numba_cache_dir() -> Path:
    """The folder Numba caches the runtime's kernels in (set on this module's import)."""
    return Path(numba.config.CACHE_DIR)


if not numba.config.CACHE_DIR:          # ($NUMBA_CACHE_DIR, where set, wins)
    numba.config.CACHE_DIR = str(user_cache_dir("numba"))
