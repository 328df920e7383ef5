"""One entry point from a path to a tape: ``load_tape(path)`` for every scene source we accept.

Sources: a Python scene file exposing ``scene`` (a Node), a saved scene (``.scene``) or tape
(``.tape``) file, or a Fidget ``.vm`` program. Every failure is a ``TaperayError`` naming the file.
"""
from __future__ import annotations

import os
import runpy
from pathlib import Path

from taperay.runtime.tape import Tape, TaperayError

from .flatten import flatten
from .nodes import Node

__all__ = ["load_tape", "load_scene_module", "scene_namespace", "SOURCE_SUFFIXES"]

SOURCE_SUFFIXES = (".py", ".scene", ".tape", ".vm")


def scene_namespace(path: Path) -> tuple[Node, dict]:
    """Run a scene .py file: its ``scene`` Node (``scene`` may be a function returning one) and
    the names it defined (a ``study`` beside ``scene``, say)."""
    try:
        ns = runpy.run_path(str(path), run_name="taperay_scene")
        node = ns.get("scene")
        if callable(node) and not isinstance(node, Node):
            node = node()
    except TaperayError as e:
        raise TaperayError(f"{path}: {e}") from None
    except SystemExit as e:   # (sys.exit in a scene file ends the scene, not the command)
        raise TaperayError(f"{path}: the scene file called sys.exit({e.code!r}) instead of defining `scene`") from None
    except Exception as e:  # a user's scene file may fail in any way; report it as theirs
        where = f"{path}:{line}" if (line := _line_in(e, path)) else f"{path}"
        raise TaperayError(f"{where}: the scene file raised {type(e).__name__}: {e}") from None
    if not isinstance(node, Node):
        raise TaperayError(f"{path}: defines no `scene` node (got {type(node).__name__})")
    return node, ns


def _line_in(error: BaseException, path: Path) -> int | None:
    """The last line of ``path`` that ``error``'s traceback passed through (a SyntaxError's own
    line), or None."""
    if isinstance(error, SyntaxError) and error.lineno:
        return error.lineno
    line, tb, name = None, error.__traceback__, os.path.realpath(path)
    while tb is not None:
        if os.path.realpath(tb.tb_frame.f_code.co_filename) == name:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def load_scene_module(path: Path) -> Node:
    """Run a scene .py file and return its ``scene`` Node."""
    return scene_namespace(path)[0]


def load_tape(path, balance_chains: bool = False) -> Tape:
    """The tape of a scene source (.py, .vm, .scene, .tape); ``balance_chains``: a .vm program's
    MIN / MAX chains rebuilt shallow (vm.load_vm)."""
    path = Path(path)
    if not path.exists():
        raise TaperayError(f"{path}: no such file")
    if path.is_dir():
        raise TaperayError(f"{path}: is a directory, not a scene file")
    suffix = path.suffix.lower()
    if suffix == ".py":
        return flatten(load_scene_module(path), source=str(path))
    if suffix == ".vm":
        from .vm import load_vm
        return load_vm(path, balance_chains=balance_chains)
    if suffix in (".scene", ".tape"):
        from .files import load_file
        obj = load_file(path)
        return obj if isinstance(obj, Tape) else flatten(obj, source=str(path))
    raise TaperayError(f"{path}: unknown scene type {suffix!r} (expected one of {', '.join(SOURCE_SUFFIXES)})")
