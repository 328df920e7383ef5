"""Re-running a scene file for ``taperay view --watch``: each run is a child process (a scene that
raises, hangs or builds an invalid tape cannot take the viewer down), polled without blocking.

``SceneWatcher(path).poll()`` notices a newer modification time, starts ``python -m
taperay.tools.scene_runner PATH OUT.tape`` and, when the child ends, returns a ``RunResult``: the
validated tape and the slider ranges the file declares (``ranges``, checked by
viewer.declared_ranges), or the error as one line naming the file (the scene's own message, a
timeout, an invalid tape).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from taperay.runtime.tape import Tape, TaperayError

__all__ = ["RunResult", "SceneWatcher", "one_line"]


@dataclass
class RunResult:
    tape: Tape | None = None
    error: str = ""
    run_ms: float = 0.0        # the child's run of the scene file and flatten, on its own clock
    ranges: dict[str, tuple[float, float]] = field(default_factory=dict)   # the file's `ranges`


class SceneWatcher:
    """Watches ``path`` (a scene .py file); ``poll()`` returns a RunResult once per completed run
    and None otherwise. A run past ``timeout`` seconds is killed and reported."""

    def __init__(self, path, timeout: float = 30.0):
        self.path = Path(path) if path is not None else None
        if self.path is None or self.path.suffix.lower() != ".py":
            raise TaperayError(f"view --watch: watches a scene .py file, not {self.path}")
        self.timeout = float(timeout)
        self._seen = self._mtime()
        self._child: subprocess.Popen | None = None
        self._started = 0.0
        self._out: Path | None = None

    @property
    def running(self) -> bool:
        return self._child is not None

    def _mtime(self) -> int:
        try:
            return self.path.stat().st_mtime_ns
        except OSError:
            return -1

    def poll(self) -> RunResult | None:
        if self._child is None:
            mtime = self._mtime()
            if mtime != self._seen and mtime != -1:
                self._seen = mtime
                self._start()
            return None
        if self._child.poll() is None:
            if time.perf_counter() - self._started > self.timeout:
                self._child.kill()
                self._child.communicate()
                self._child = None
                return RunResult(error=f"{self.path}: the scene file ran past {self.timeout:g} s and was stopped; "
                                       "the last good scene stays on screen")
            return None
        return self._finish()

    def wait(self) -> RunResult | None:
        """Poll until the run under way (if any) ends (scripts and tests)."""
        result = self.poll()
        while result is None and self._child is not None:
            time.sleep(0.02)
            result = self.poll()
        return result

    def _start(self) -> None:
        fd, out = tempfile.mkstemp(suffix=".tape", prefix="taperay-watch-")
        os.close(fd)
        self._out = Path(out)
        self._started = time.perf_counter()
        self._child = subprocess.Popen([sys.executable, "-m", "taperay.tools.scene_runner", str(self.path), out],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def _finish(self) -> RunResult:
        from taperay.scenegraph.files import load_tape_file
        stdout, stderr = self._child.communicate()
        code, self._child = self._child.returncode, None
        try:
            if code != 0:
                lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
                reason = lines[-1].strip() if lines else f"exit status {code}"
                if not reason.startswith(str(self.path)):
                    reason = f"{self.path}: {reason}"
                return RunResult(error=f"{reason} (the last good scene stays on screen)")
            try:
                tape = load_tape_file(self._out)
            except TaperayError as e:
                return RunResult(error=f"{self.path}: the scene's tape is invalid: {one_line(str(e))}")
            report = json.loads(stdout or "{}")
            return RunResult(tape=tape, run_ms=float(report.get("run_ms", 0.0)),
                             ranges={name: (lo, hi) for name, (lo, hi) in report.get("ranges", {}).items()})
        finally:
            self._out.unlink(missing_ok=True)


def one_line(text: str) -> str:
    """A message of several lines as one ("; " between them)."""
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


def main(argv=None) -> int:
    """The child: run the scene file, flatten it, check its ``ranges``, write the tape; on stdout
    the run's time and the ranges (JSON), an error on stderr as one line, exit 1."""
    from taperay.scenegraph.files import save_tape
    from taperay.scenegraph.flatten import flatten
    from taperay.scenegraph.loading import scene_namespace

    from .viewer import declared_ranges
    path, out = (Path(a) for a in (argv if argv is not None else sys.argv[1:])[:2])
    t0 = time.perf_counter()
    try:
        node, namespace = scene_namespace(path)
        tape = flatten(node, source=str(path))
        ranges = declared_ranges(path, namespace.get("ranges", {}), tape)
        run_ms = 1e3 * (time.perf_counter() - t0)
        save_tape(tape, out)
    except TaperayError as e:
        print(one_line(str(e)), file=sys.stderr)
        return 1
    print(json.dumps({"run_ms": run_ms, "ranges": ranges}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
