"""The CPU twin's threads: a pool of Python threads running the kernels' shares.

Owns ``on_threads`` (a nogil kernel on each of ``thread_count()`` threads, one pool per process)."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from .jit_cache import load_numba

__all__ = ["thread_count", "on_threads"]


def thread_count() -> int:
    """Threads the twin's kernels run on: Numba's (NUMBA_NUM_THREADS, default every core)."""
    return load_numba().get_num_threads()


_POOL: dict = {}      # (pid, threads) -> ThreadPoolExecutor


def on_threads(kernel, *args):
    """kernel(*args, thread, n_threads) on each of thread_count() threads, returning when all
    are done. The kernels are nogil loops over their share of the work, called from a pool of
    Python threads rather than written as Numba parallel loops: each parallel loop adds three
    wrappers that link, re-optimise and re-generate the whole interpreter again, a quarter of a
    cold compile (docs/PERFORMANCE.md)."""
    n = thread_count()
    if n == 1:
        kernel(*args, 0, 1)
        return
    key = (os.getpid(), n)            # (a forked child makes its own pool)
    if key not in _POOL:
        _POOL[key] = ThreadPoolExecutor(n, thread_name_prefix="taperay-twin")
    for done in [_POOL[key].submit(kernel, *args, k, n) for k in range(n)]:
        done.result()
