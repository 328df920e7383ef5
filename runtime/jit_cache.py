"""The runtime's Numba kernels: loaded on first use, cached on disk in a per-user directory.

**Loaded on first use.** The runtime's jitted functions are declared with this module's ``njit``
(Numba's options) and loops with its ``prange``; importing them imports no Numba. The first call
of any of them (or a look at a Numba attribute of one, ``.py_func``, ``_cache``) runs
``load_numba``: Numba is imported, every function declared so far becomes its
``numba.njit(**options)`` dispatcher and the runtime's modules' globals that named them (and
``prange``) name the dispatchers (and ``numba.prange``), so that kernels calling kernels compile
as Numba kernels. Functions declared after that are handed to Numba at once. A process that
draws on the GPU alone never imports Numba (about 0.8 s on a 2-core EPYC).

**Cached on disk, keyed on the sources.** Numba keeps compiled kernels beside their sources
(``__pycache__``) unless told otherwise, which a non-editable install into a read-only
``site-packages`` cannot write. ``load_numba`` sets Numba's cache folder, before any dispatcher
is made, to ``<base>/<key>``: base ``$NUMBA_CACHE_DIR`` where the user set it, else
``user_cache_dir("numba")`` (``~/.cache/taperay/numba``); key a hash of every module of the
runtime that declares jitted functions and of the package's modules those import (the op table,
the opcode numbers: ``keyed_sources``). Numba checks only the stamp of the file that holds a cached
function, while a cached kernel has the functions it calls from other files (``pruning`` inlines
``twin``'s arithmetic) and the constants it read compiled in: a change to any of those sources
is a new key, so nothing stale is loaded and no ``__pycache__`` needs clearing. Numba names each
entry by the source file's path too, so installs and checkouts side by side do not mix; a cold
compile happens once per user and source version. The ``KEEP_KEYS`` most recently used key
folders are kept, older ones removed.

**Compiled once, in parallel.** A jitted function calling another links the callee and everything
below it into its own code, which LLVM optimises and turns into machine code again for every
caller. ``function_value`` hands kernels a big callee (the twin's interpreter) as a first-class
function value instead: compiled once, called through its address, and on a cold cache compiled
by a helper process while this one compiles the kernels that call it. ``compile_ahead`` starts
such a helper for any kernel whose argument types are known before its first call (the 2D
image's tile walk and the pruned points, runtime.pruned_eval; the march cells, runtime.cells).
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import threading
from pathlib import Path

__all__ = ["user_cache_dir", "numba_cache_dir", "keyed_sources", "source_key", "njit", "prange", "load_numba",
           "numba_loaded", "function_value", "quiet_function_types", "array_type_facts", "usable_cores",
           "default_xla_flag", "compile_ahead", "CompileAhead", "KEEP_KEYS"]

_PACKAGE = __name__.rsplit(".", 2)[0] + "."      # the runtime's modules: their globals are rebound
_LOCK = threading.RLock()
_DECLARED: list[_Declared] = []                  # declared before Numba was loaded, in order
_NUMBA: list = []                                # [the numba module] once loaded
_VALUES: dict = {}                               # (function, argument types) -> function_value's value
KEEP_KEYS = 4                                    # source keys' cache folders kept (the most recently used)


def user_cache_dir(name: str) -> Path:
    """``$XDG_CACHE_HOME/taperay/<name>`` (``~/.cache/taperay/<name>``): a per-user cache folder."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "taperay" / name


def numba_cache_dir() -> Path:
    """The folder Numba caches the runtime's kernels in (loads Numba)."""
    return Path(load_numba().config.CACHE_DIR)


def keyed_sources() -> list[Path]:
    """The sources ``source_key`` hashes: every module of the runtime package that declares jitted
    functions and the package's modules those import (the op table, the opcode numbers, the
    tape's constants), in name order."""
    folder = Path(__file__).parent
    texts = {p.name: p.read_bytes() for p in folder.glob("*.py")}
    names = set()
    for name, text in texts.items():
        if b"njit" in text:
            names.add(name)
            names.update(f"{m.decode()}.py" for m in re.findall(rb"^\s*from \.(\w+) import", text, re.M))
            for group in re.findall(rb"^\s*from \. import ([\w, ]+)", text, re.M):
                names.update(f"{m.strip().decode()}.py" for m in group.split(b","))
    return [folder / name for name in sorted(names & texts.keys())]


def source_key() -> str:
    """A hash of the sources a cached kernel depends on (``keyed_sources``, read whole)."""
    h = hashlib.blake2b(digest_size=8)
    for path in keyed_sources():
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _cache_folder(base: Path) -> Path:
    """``base/<source_key>``, marked as used now; the other key folders under base but the
    KEEP_KEYS - 1 most recently used removed."""
    folder = base / source_key()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        os.utime(folder)
        older = sorted((p for p in base.iterdir() if p.is_dir() and p != folder and len(p.name) == 16),
                       key=lambda p: p.stat().st_mtime, reverse=True)
        for stale in older[KEEP_KEYS - 1:]:
            shutil.rmtree(stale, ignore_errors=True)
    except OSError:
        pass            # (an unwritable base: Numba says so when it first writes)
    return folder


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
    """Import Numba (once per process, thread-safe), set its cache folder (keyed on the sources),
    make every declared function's dispatcher and rebind the runtime's modules' globals that name
    a declared function or ``prange``. Returns the numba module."""
    if _NUMBA:
        return _NUMBA[0]
    with _LOCK:
        if _NUMBA:
            return _NUMBA[0]
        import numba
        base = numba.config.CACHE_DIR or user_cache_dir("numba")     # ($NUMBA_CACHE_DIR, where set, wins)
        numba.config.CACHE_DIR = str(_cache_folder(Path(base)))
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
        globals()["prange"] = numba.prange      # (modules imported from now on take Numba's own)
        _NUMBA.append(numba)
        return numba


def function_value(func, returns: str, *examples, helper: bool = True):
    """``func`` (declared with ``njit``; its Numba return type written by ``returns`` as Numba
    writes types in signatures, e.g. "boolean", "UniTuple(int64, 2)") for the Numba types of the
    example arguments, as a first-class function value (Numba's ``FunctionType``, through its
    wrapper address protocol): a jitted function handed this value calls ``func`` through its
    address. A call of ``func`` itself would link it and everything below it into the caller's
    code, which LLVM optimises and generates again for every caller; this way ``func`` is compiled
    once, on its own.

    Typing a caller needs only the value's signature, so ``func`` is compiled (or loaded from the
    disk cache) when a caller first runs with the value. Where the disk cache lacks it and more
    than one core is free, a helper process starts compiling it at once (``python -m
    taperay.runtime.jit_cache``), in parallel with what this process compiles meanwhile (the
    callers), and the first run waits for the helper and loads its result. Made once per process
    and argument types. ``helper=False``: no helper process; this process compiles ``func`` when
    a caller first runs (``func`` small, or compiled while this process would wait anyway)."""
    numba = load_numba()
    import numba.experimental.function_type    # noqa: F401  (typeof of a tuple of these values)
    quiet_function_types()
    dispatcher = func.dispatcher if isinstance(func, _Declared) else func
    argtypes = tuple(numba.typeof(a) for a in examples)
    key = (id(dispatcher), argtypes)
    value = _VALUES.get(key)
    if value is None:
        with _LOCK:
            value = _VALUES.get(key)
            if value is None:
                result = numba.core.sigutils.normalize_signature(f"{returns}()")[1]
                signature = numba.core.typing.signature(result, *argtypes)
                value = _VALUES[key] = _compiled_function_class()(dispatcher, signature, helper)
    return value


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the system tells it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_xla_flag(name: str, value) -> None:
    """Add ``--name=value`` to XLA_FLAGS unless the flags name it already (a user's setting wins);
    read when JAX first starts a backend, so set before that."""
    flags = os.environ.get("XLA_FLAGS", "")
    if name not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --{name}={value}".strip()


def quiet_function_types() -> None:
    """Ignore Numba's warning that first-class function types are experimental (it warns wherever
    a tuple of function values is typed, at every call of a kernel taking one: ours are
    deliberate). Filters go first in the list, so that a caller's ``simplefilter("always")`` in
    force lets it through only until the next call of this; the twin calls it with every tape it
    hands its kernels (twin.kernel_tape)."""
    import warnings
    warnings.filterwarnings("ignore", "First-class function type feature is experimental",
                            load_numba().core.errors.NumbaExperimentalFeatureWarning)


def array_type_facts(a) -> tuple:
    """What Numba types an array by (``numba.typeof``: dtype, dimensions, layout, read-only,
    aligned): arrays with equal facts have equal Numba types. Cheap (numpy attributes; typeof
    costs tens of microseconds an array): a key for work that depends on arguments' types only."""
    f = a.flags
    return a.dtype, a.ndim, "C" if f.c_contiguous else "F" if f.f_contiguous else "A", f.writeable, f.aligned


def compile_ahead(func, *examples) -> CompileAhead:
    """Start compiling ``func`` (declared with ``njit``) for the Numba types of the example
    arguments in a helper process, into the disk cache, so that this process can compile other
    kernels meanwhile; ``wait()`` on the handle returned before ``func``'s first call, which then
    loads the helper's result. Nothing is started (``started`` False, ``wait()`` returns at once)
    where the disk cache holds it already, on one core (nothing would run alongside) or with an
    unwritable cache folder."""
    numba = load_numba()
    dispatcher = func.dispatcher if isinstance(func, _Declared) else func
    return _ahead(dispatcher, tuple(numba.typeof(a) for a in examples))


class CompileAhead:
    """A helper process compiling a jitted function for some argument types (compile_ahead), or
    none (``process`` None: nothing to wait for)."""

    def __init__(self, dispatcher, argtypes: tuple, process=None):
        self.dispatcher, self.argtypes, self.process = dispatcher, argtypes, process
        self.started = process is not None      # (a helper was started; ``process`` None once waited for)

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait(self) -> None:
        """Until the helper is done (shown as a compile: runtime.compile_progress's line)."""
        if self.process is None:
            return
        from numba.core import event
        with event.trigger_event("numba:compile", data=dict(dispatcher=self.dispatcher, args=self.argtypes,
                                                            return_type=None)):
            self.process.wait()
        self.process = None


def _ahead(dispatcher, argtypes: tuple) -> CompileAhead:
    """compile_ahead for a dispatcher and Numba argument types."""
    process = None if _is_cached(dispatcher, argtypes) else _compile_ahead(dispatcher, argtypes)
    return CompileAhead(dispatcher, argtypes, process)


_CLASS: list = []


def _compiled_function_class():
    """The class of function_value's values (a subclass of Numba's WrapperAddressProtocol, made
    once Numba is loaded)."""
    if not _CLASS:
        from numba.core.types import WrapperAddressProtocol

        class CompiledFunction(WrapperAddressProtocol):
            """A jitted function's compiled entry for one signature, compiled on first use."""

            def __init__(self, dispatcher, signature, helper=True):
                self.dispatcher, self._signature = dispatcher, signature
                self._address: int | None = None
                self._helper = (_ahead(dispatcher, signature.args) if helper
                                else CompileAhead(dispatcher, signature.args))

            def __wrapper_address__(self) -> int:
                if self._address is None:
                    with _LOCK:
                        if self._address is None:
                            self._address = self._compile()
                return self._address

            def signature(self):
                return self._signature

            def compiling_elsewhere(self) -> bool:
                """Whether a helper process is compiling it now (a caller may compile other
                kernels meanwhile, rather than wait)."""
                return self._helper.running()

            def _compile(self) -> int:
                self._helper.wait()
                args = self._signature.args
                self.dispatcher.compile(args)      # (the helper's result from the disk cache)
                compiled = self.dispatcher.overloads[args]
                if compiled.signature.return_type != self._signature.return_type:
                    raise TypeError(f"{self!r}: {self.dispatcher.__qualname__} returns "
                                    f"{compiled.signature.return_type}")
                return compiled.library.get_pointer_to_function(compiled.fndesc.llvm_cfunc_wrapper_name)

            def __repr__(self) -> str:
                return f"<compiled {self.dispatcher.__qualname__}{self._signature}>"

        _CLASS.append(CompiledFunction)
    return _CLASS[0]


def _is_cached(dispatcher, argtypes: tuple) -> bool:
    """Whether Numba's disk cache holds ``dispatcher`` for ``argtypes`` (or it is compiled here
    already); True where that cannot be told."""
    if argtypes in dispatcher.overloads:
        return True
    try:
        cache = dispatcher._cache
        key = cache._index_key(argtypes, dispatcher.targetctx.codegen())
        return key in cache._cache_file._load_index()
    except Exception:       # (Numba's cache internals changed: no helper, as before)
        return True


def _compile_ahead(dispatcher, argtypes: tuple):
    """A helper process compiling ``dispatcher`` for ``argtypes`` into the disk cache (None on
    one core, where nothing would run alongside it, or where the cache folder is not writable,
    where this process could not load the helper's result)."""
    if usable_cores() < 2 or not os.access(_NUMBA[0].config.CACHE_DIR, os.W_OK):
        return None
    import pickle
    import subprocess
    request = pickle.dumps((dispatcher.py_func.__module__, dispatcher.py_func.__qualname__, argtypes))
    try:
        helper = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        helper.stdin.write(request)
        helper.stdin.close()
    except OSError:
        return None
    return helper


def serve_compile_request() -> None:
    """The helper process of ``function_value``: compile the function named on stdin (module,
    qualified name, argument types; pickled) into the disk cache."""
    import importlib
    import pickle
    module, name, argtypes = pickle.loads(sys.stdin.buffer.read())
    load_numba()
    getattr(importlib.import_module(module), name).compile(argtypes)


if __name__ == "__main__":
    from taperay.runtime import jit_cache       # (the package's module, not this __main__ copy)
    jit_cache.serve_compile_request()
