"""Output files: the one way taperay writes a file that a user named.

``check_output(path, inputs)`` runs before any work and returns where the file will be written:
a symbolic link is written through (its target is replaced, the link stays a link); a folder, a
device, a pipe or anything else that is not a regular file is refused, and so is any of the
command's own inputs (the same file by name, by link or by hard link). ``write_atomic`` then writes
the file beside its target under a temporary name with the target's suffix (so writers that infer
the format from the name work), flushes it to disk and renames it over the target: the old file
survives any failure, and the error names the file. Every output gets one mode: an existing
file keeps its permission bits, a new one gets ``0o666`` less the umask (as ``open`` would).
"""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import Callable, Iterable

from .tape import TaperayError

__all__ = ["check_output", "write_atomic", "write_bytes", "write_text"]


def _target(path) -> Path:
    """``path`` with every symbolic link resolved (a dangling link: the file it names)."""
    return Path(os.path.realpath(os.fspath(path)))


def _is_same_file(a: Path, b: Path) -> bool:
    if a == b:
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:            # (one of them does not exist)
        return False


def check_output(path, inputs: Iterable = ()) -> Path:
    """Refuse ``path`` as an output before any work (``TaperayError`` naming it and the reason):
    anything but a regular file or nothing; one of ``inputs``; a folder that cannot hold it. Returns
    the file that will be replaced (links resolved). Folders are not created here."""
    shown = Path(path)
    if os.fspath(path) == "" or shown.name in ("", ".", ".."):
        raise TaperayError(f"{shown}: is a directory; give a file name")
    target = _target(path)
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:
        raise TaperayError(f"{shown}: cannot write: {e.strerror or e}") from None
    if mode is not None:
        if stat.S_ISDIR(mode):
            raise TaperayError(f"{shown}: is a directory; give a file name")
        if not stat.S_ISREG(mode):
            kind = ("a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else
                    "a pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
            raise TaperayError(f"{shown}: is {kind}; outputs replace regular files only")
    for given in inputs:
        if given is not None and _is_same_file(target, _target(given)):
            raise TaperayError(f"{shown}: is an input of this command ({given}); give another output name")
    folder = target.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise TaperayError(f"{shown}: cannot write: {folder} is not a directory")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise TaperayError(f"{shown}: cannot write: permission denied in {folder}")
    return target


def write_atomic(path, write: Callable[[Path], object]) -> Path:
    """Write ``path`` by ``write(tmp)``, which must create the file ``tmp`` (beside the target, same
    suffix); then replace the target by it in one rename. Links are written through; a target that
    is not a regular file is refused; folders are created. On any failure the temporary file is
    removed, the old target is left as it was, and an ``OSError`` becomes a ``TaperayError`` naming
    ``path``. Returns ``path``."""
    shown = Path(path)
    target = check_output(shown)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.stem}-", suffix=target.suffix, dir=target.parent)
        os.close(fd)
    except OSError as e:
        raise TaperayError(f"{shown}: cannot write: {e.strerror or e}") from None
    tmp = Path(tmp_name)
    try:
        write(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp, _mode_for(target))
        os.replace(tmp, target)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise TaperayError(f"{shown}: cannot write: {e.strerror or e}") from None
        raise
    _sync_folder(target.parent)
    return shown


def write_bytes(path, data: bytes) -> Path:
    """``write_atomic`` of ``data``."""
    return write_atomic(path, lambda tmp: tmp.write_bytes(data))


def write_text(path, text: str) -> Path:
    """``write_atomic`` of ``text`` (UTF-8)."""
    return write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def _mode_for(target: Path) -> int:
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        mask = os.umask(0o022)
        os.umask(mask)
        return 0o666 & ~mask


def _sync_folder(folder: Path) -> None:
    """Make the rename durable where the platform allows it."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
