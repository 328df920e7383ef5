"""The runtime's Numba kernels are cached in a per-user folder (runtime.jit_cache), which a
non-editable install into a read-only site-packages can use, and $NUMBA_CACHE_DIR still wins,
under a key of the sources they depend on; the twin's interpreter is compiled once, by a helper
process on an empty cache, and called by its address; a compile longer than
compile_progress.PROGRESS_AFTER_SECONDS shows a line moving by the clock, a load from the disk
cache none."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from taperay.runtime import jit_cache

CACHE_PATH = ("import taperay.runtime.twin as t, taperay.runtime.shading as s\n"
              "print(t._eval_kernel._cache._cache_path); print(s._shade._cache._cache_path)")


def _python(code: str, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    environ.update(env)
    return subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True,
                          timeout=300, check=True)


def test_kernels_cache_under_the_users_cache_folder(tmp_path):
    paths = _python(CACHE_PATH, XDG_CACHE_HOME=str(tmp_path)).stdout.split()
    assert len(paths) == 2
    assert all(p.startswith(str(tmp_path / "taperay" / "numba")) for p in paths), paths


def test_numba_cache_dir_wins(tmp_path):
    paths = _python(CACHE_PATH, XDG_CACHE_HOME=str(tmp_path / "xdg"),
                    NUMBA_CACHE_DIR=str(tmp_path / "mine")).stdout.split()
    assert all(p.startswith(str(tmp_path / "mine")) for p in paths), paths


def test_a_compile_shows_its_progress_and_a_cache_load_none(tmp_path):
    (tmp_path / "kern.py").write_text(textwrap.dedent("""
        from taperay.runtime import jit_cache
        from numba import njit

        @njit(cache=True)
        def kern(x):
            s = 0.0
            for i in range(x.shape[0]):
                s += x[i] * x[i]
            return s
    """))
    code = textwrap.dedent("""
        import time, numpy as np
        from taperay.runtime import compile_progress
        compile_progress.PROGRESS_AFTER_SECONDS = 0.0
        compile_progress.show_compile_progress()
        import kern
        kern.kern(np.ones(4))
        time.sleep(0.5)
    """)
    env = dict(XDG_CACHE_HOME=str(tmp_path / "cache"), PYTHONPATH=f"{tmp_path}{os.pathsep}"
               + os.environ.get("PYTHONPATH", ""))
    first = _python(code, **env).stderr
    assert "compiling CPU kernels [" in first and "1/1" in first, first
    later = _python(code, **env).stderr
    assert "compiling CPU kernels" not in later, later


def test_numba_is_loaded_when_a_kernel_first_runs():
    """Importing the runtime, the scene graph and the GPU walker and loading a scene import no
    Numba; the first twin evaluation loads it, and kernels calling kernels of other modules
    compile as Numba kernels (the modules' names rebound to the dispatchers)."""
    code = textwrap.dedent("""
        import sys
        import taperay.runtime.gpu, taperay.runtime.walkers, taperay.runtime.path_tracing
        from taperay.runtime import cells, jit_cache, twin
        from taperay.scenegraph.loading import load_tape
        tape = load_tape("scenes/machined_part.py")
        print("numba" in sys.modules, jit_cache.numba_loaded(), type(twin._eval_kernel).__name__)
        from taperay.runtime.cpu import CpuWalker
        d = CpuWalker().evaluate(tape, [[0.0, 0.0, 0.0], [9.0, 9.0, 9.0]])[0]
        print("numba" in sys.modules, jit_cache.numba_loaded(), type(twin._eval_kernel).__name__,
              type(cells.eval_run).__name__, bool(d[1] > d[0]))
    """)
    lines = _python(code).stdout.splitlines()
    assert lines[0].split() == ["False", "False", "_Declared"], lines
    assert lines[1].split() == ["True", "True", "CPUDispatcher", "CPUDispatcher", "True"], lines


def test_the_cache_folder_is_keyed_on_the_sources_and_old_keys_are_removed(tmp_path):
    """Numba's cache folder is <base>/<source_key>: a hash of the jitted modules and the modules
    they import (the op table and numbers among them), so an edit of any of them loads nothing
    stale; only the KEEP_KEYS most recently used key folders stay."""
    base = tmp_path / "numba"
    for i in range(6):          # key folders of earlier sources, oldest first
        old = base / f"{i:016x}"
        old.mkdir(parents=True)
        os.utime(old, (1_000_000 + i, 1_000_000 + i))
    code = ("from taperay.runtime import jit_cache as j\n"
            "print(j.numba_cache_dir()); print(j.source_key()); print(j.KEEP_KEYS)\n"
            "print(' '.join(p.name for p in j.keyed_sources()))")
    folder, key, keep, sources = _python(code, NUMBA_CACHE_DIR=str(base)).stdout.splitlines()
    assert folder == str(base / key)
    assert {"twin.py", "interval_kernels.py", "pruner.py", "pruned_eval.py", "cells.py", "pruned_march.py", "opcodes.py",
            "op_numbers.py", "tape.py", "shading.py", "camera.py"} <= set(sources.split())
    assert sorted(p.name for p in base.iterdir()) == sorted([key] + [f"{i:016x}" for i in range(6 - int(keep) + 1, 6)])


@pytest.mark.slow
def test_the_interpreter_is_compiled_once_by_a_helper_process(tmp_path):
    """On an empty cache the kernels call the interpreter through its address (no copy of it
    linked into them), and a helper process compiles it while this one compiles the kernels: this
    process loads it from the disk cache."""
    code = textwrap.dedent("""
        from taperay.runtime import twin
        from taperay.runtime.cpu import CpuWalker
        from taperay.scenegraph.loading import load_tape
        tape = load_tape("scenes/machined_part.py")
        d, m = CpuWalker().evaluate(tape, [[0.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
        print(bool(d[1] > d[0]))
        print(sum(twin._run_block.stats.cache_hits.values()), sum(twin._run_block.stats.cache_misses.values()))
        (sig,) = twin._eval_kernel.signatures
        print(sum(ln.startswith("define") and "_run_block" in ln
                  for ln in twin._eval_kernel.inspect_llvm(sig).splitlines()))
    """)
    lines = _python(code, XDG_CACHE_HOME=str(tmp_path)).stdout.splitlines()
    assert lines == ["True", "1 0", "0"], lines


def test_a_kernel_compiled_ahead_by_a_helper_is_loaded_from_the_cache(tmp_path):
    """compile_ahead on an empty cache: a helper process compiles the kernel while this one goes
    on, and the kernel's first call loads the helper's result (a cache hit, no compile here);
    once cached, nothing is started."""
    code = textwrap.dedent("""
        import numpy as np
        from taperay.runtime import jit_cache, opcodes
        from taperay.runtime.twin_culls import live_in
        cols = np.zeros((3, 8), np.int32)
        reads = np.zeros((len(opcodes.OPS) + 1, 3), np.bool_)
        writes = np.zeros(len(opcodes.OPS) + 1, np.bool_)
        ahead = jit_cache.compile_ahead(live_in, cols, reads, writes)
        print(ahead.started)
        ahead.wait()
        print(live_in(cols, reads, writes).shape)
        print(sum(live_in.stats.cache_hits.values()), sum(live_in.stats.cache_misses.values()))
        print(jit_cache.compile_ahead(live_in, cols, reads, writes).started)
    """)
    lines = _python(code, XDG_CACHE_HOME=str(tmp_path)).stdout.splitlines()
    assert lines == ["True", "(4, 4)", "1 0", "False"], lines


def test_array_type_facts_are_equal_exactly_where_numbas_types_are():
    """array_type_facts keys work by argument types: over arrays of every layout, dtype,
    dimension count and writeability, two arrays' facts are equal where numba.typeof's are."""
    import numba
    base = np.arange(48, dtype=np.float32).reshape(4, 12)
    frozen = base.copy()
    frozen.flags.writeable = False
    rec = np.zeros(3, np.dtype([("a", "<f4"), ("b", "<u4")]))
    arrays = [base, base.T, base[:, ::2], base[0], frozen, frozen[1:], base.astype(np.float64),
              base.astype(np.int32), rec, rec.view(np.float32), np.float32(0) + base[:1, :1],
              np.zeros((2, 3, 4), np.float32), np.zeros((0, 8), np.float32), np.empty(0, np.int64),
              np.frombuffer(bytes(17), np.uint8)[1:].view(np.float32)]
    for a in arrays:
        for b in arrays:
            same_facts = jit_cache.array_type_facts(a) == jit_cache.array_type_facts(b)
            assert same_facts == (numba.typeof(a) == numba.typeof(b)), (numba.typeof(a), numba.typeof(b))
