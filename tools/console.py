"""The terminal output every command shares: a rich ``console`` (piped output kept wide) and
``step``, a transient spinner with the elapsed time while a long step runs. A leaf module: it
imports nothing of taperay's, so the command line and the benchmarks both use it."""
from __future__ import annotations

import contextlib
import sys

__all__ = ["console", "step"]


def console(stderr: bool = False):
    """Rich console; piped output is not squeezed into 80 columns (the conformance tables are wide)."""
    from rich.console import Console
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, highlight=False, soft_wrap=True,
                   width=None if stream.isatty() else 200)


@contextlib.contextmanager
def step(text: str):
    """A transient spinner with elapsed time on stderr while a long step runs."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console(stderr=True), transient=True) as progress:
        progress.add_task(text, total=None)
        yield
