"""The runtime's Numba kernels: loaded on first use, cached on disk in a per-user directory.

**Loaded on first use.** The runtime's jitted functions are declared with this module's ``njit``
(Numba's options) and loops with its ``prange``; importing them imports no Numba. The first call
of any of them (or a look at a Numba attribute of one, ``.py_func``, ``_cache``) runs
``load_numba``: Numba is imported, every function declared so far becomes its
``numba.njit(**options)`` dispatcher and the runtime's modules' globals that named them (and
``prange``) name the dispatchers (and ``numba.prange``), so that kernels calling kernels compile
as Numba kernels. Functions declared after that are handed to Numba at once. A process that
draws on the GPU alone never imports Numba (about 0.8 s on a 2-core EPYC).

**Cached on disk.** Numba keeps compiled kernels beside their sources (``__pycache__``) unless
told otherwise, which a non-editable install into a read-only ``site-packages`` cannot write.
``load_numba`` sets Numba's cache folder to ``$NUMBA_CACHE_DIR`` where the user set it, else to
``user_cache_dir("numba")`` (``~/.cache/taperay/numba``), before any dispatcher is made. Numba
names each entry by the source file's path and checks its stamp, so installs and checkouts side
by side do not mix, and a cold compile happens once per user and source version.
"""
from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

__all__ = ["user_cache_dir", "numba_cache_dir", "njit", "prange", "load_numba", "numba_loaded"]

_PACKAGE = __name__.rsplit(".", 2)[0] + "."      # the runtime's modules: their globals are rebound
_LOCK = threading.RLock()
_DECLARED: list[_Declared] = []                  # declared before Numba was loaded, in order
_NUMBA: list = []                                # [the numba module] once loaded


def user_cache_dir(name: str) -> Path:
    """``$XDG_CACHE_HOME/taperay/<name>`` (``~/.cache/taperay/<name>``): a per-user cache folder."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "taperay" / name


def numba_cache_dir() -> Path:
    """The folder Numba caches the runtime's kernels in (loads Numba)."""
    return Path(load_numba().config.CACHE_DIR)


def numba_loaded() -> bool:
    """Whether this process has loaded Numba for the runtime's kernels."""
    return bool(_NUMBA)


class _Declared:
    """A function declared for ``numba.njit(**options)`` before Numba was loaded: calling it, or
    asking it for a Numba attribute, loads Numba and goes to its dispatcher."""

    def __init__(self, func, options: dict):
        self.py_func = func
        self.options = options
        self.dispatcher = None
        self.__name__ = func.__name__
        self.__qualname__ = func.__qualname__
        self.__module__ = func.__module__
        self.__doc__ = func.__doc__

    def __call__(self, *args, **kwargs):
        load_numba()
        return self.dispatcher(*args, **kwargs)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        load_numba()
        return getattr(self.dispatcher, name)

    def __repr__(self) -> str:
        return f"<jitted {self.__qualname__} (Numba not loaded yet)>"


def njit(*args, **options):
    """``numba.njit`` (the same use: ``@njit`` or ``@njit(**options)``), handed to Numba when it
    is loaded (``load_numba``)."""
    if args and callable(args[0]) and len(args) == 1 and not options:
        return _declare(args[0], {})
    if args:
        raise TypeError("njit: options by keyword only (signatures are not used here)")
    return lambda func: _declare(func, options)


def _declare(func, options: dict):
    with _LOCK:
        if _NUMBA:
            return _NUMBA[0].njit(**options)(func)
        declared = _Declared(func, options)
        _DECLARED.append(declared)
        return declared


def prange(*args):
    """``numba.prange`` in a jitted function (the name is rebound when Numba is loaded); ``range``
    if called from Python before that."""
    return range(*args)


def load_numba():
    """Import Numba (once per process, thread-safe), set its cache folder, make every declared
    function's dispatcher and rebind the runtime's modules' globals that name a declared function
    or ``prange``. Returns the numba module."""
    if _NUMBA:
        return _NUMBA[0]
    with _LOCK:
        if _NUMBA:
            return _NUMBA[0]
        import numba
        if not numba.config.CACHE_DIR:          # ($NUMBA_CACHE_DIR, where set, wins)
            numba.config.CACHE_DIR = str(user_cache_dir("numba"))
        for declared in _DECLARED:
            declared.dispatcher = numba.njit(**declared.options)(declared.py_func)
        placeholder = prange
        real = {id(d): d.dispatcher for d in _DECLARED}
        real[id(placeholder)] = numba.prange
        for name, module in list(sys.modules.items()):
            if not name.startswith(_PACKAGE) or module is None or name == __name__:
                continue
            names = vars(module)
            for key, value in list(names.items()):
                if id(value) in real and (value is placeholder or isinstance(value, _Declared)):
                    names[key] = real[id(value)]
        _DECLARED.clear()
        _NUMBA.append(numba)
        return numba
