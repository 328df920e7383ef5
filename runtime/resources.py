"""The machine's memory, asked before heavy work: ``check_memory(need, what)`` refuses a job whose
estimated need exceeds the memory available now, with both figures in the message.
"""
from __future__ import annotations

import os

from .tape import TaperayError

__all__ = ["available_memory", "check_memory", "format_bytes"]


def available_memory() -> int:
    """Bytes of memory available to a new allocation now: Linux's ``MemAvailable`` (page cache that
    can be dropped included), else the free physical pages."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62                       # (unknown: nothing is refused)


def format_bytes(n: float) -> str:
    """``1.2 GB`` style (powers of 1000)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.3g} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    raise AssertionError


def check_memory(need: float, what: str, hint: str = "") -> None:
    """Raise ``TaperayError`` when ``need`` bytes (an estimate) exceed the memory available now;
    ``what`` names the job ("--size 16384x16384: the image"), ``hint`` says how to shrink it."""
    have = available_memory()
    if need > have:
        raise TaperayError(f"{what} needs about {format_bytes(need)} of memory (an estimate), and "
                           f"{format_bytes(have)} is available" + (f"; {hint}" if hint else ""))
