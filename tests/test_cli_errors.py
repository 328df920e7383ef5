"""What the command line does with a careful user's and an adversary's inputs, as one table: each
case is the arguments, the exit status, a pattern the one error line must match and, where it
matters, what must still be true of the files afterwards (nothing lost, nothing left behind)."""
import os
import re
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from taperay.tools import cli

SCENE = """
import taperay as tr
scene = tr.sphere(tr.Param("r", 0.5))
"""

RAISES = """
import taperay as tr
def scene():
    raise ValueError("boom")
"""

DEEP = """
import taperay as tr
node = tr.sphere(1)
for i in range(400):
    node = node.translate(0.001, 0, 0)
scene = node
"""

HEAT = """
import taperay as tr
from taperay.solvers import Heat
scene = (tr.box(1, 0.2, 0.2).material(tr.Material("steel", (0.6, 0.6, 0.6)))
         | tr.box(0.05, 0.2, 0.2).material(tr.Material("hot", (0.9, 0.2, 0.1))).translate(1, 0, 0))
study = Heat(conductivity=1.0, fixed_temperature={"hot": 100.0}, convection={"steel": (5.0, 20.0)})
"""


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A folder of inputs: scene files, point arrays, a previous output."""
    monkeypatch.chdir(tmp_path)
    Path("scene.py").write_text(SCENE)
    Path("raises.py").write_text(RAISES)
    Path("exits.py").write_text("import sys\nsys.exit(0)\n")
    Path("deep.py").write_text(DEEP)
    Path("heat.py").write_text(HEAT)
    Path("nu.py").write_text(HEAT.replace("from taperay.solvers import Heat", "from taperay.solvers import Elasticity")
                             .replace("study = Heat(", "study = Elasticity(E=1.0, nu=0.7, fixed={'hot': None}) #"))
    Path("lid.py").write_text(HEAT.replace("fixed_temperature={\"hot\"", "fixed_temperature={\"lid\""))
    import taperay as tr
    tr.save_tape(tr.flatten(tr.sphere(tr.Param("r", 0.5))), "ball.tape")
    np.save("points.npy", np.array([[0, 0, 0], [1, 0, 0]], np.float32))
    np.save("nan.npy", np.array([[0, 0, 0], [np.nan, 0, 0], [np.inf, 0, 0]], np.float32))
    with open("huge.npy", "wb") as fh:           # a header declaring 10^11 rows over 48 bytes
        np.lib.format.write_array_header_1_0(fh, {"descr": "<f4", "fortran_order": False, "shape": (10**11, 3)})
        fh.write(bytes(48))
    Path("long.vm").write_text("_0 var-x\n_1 var-y\n" + "".join(f"_{i} add _{i - 1} _{i - 2}\n"
                                                                for i in range(2, 270_000)))
    Path("old.npy").write_bytes(b"the previous output")
    os.mkfifo("fifo.png")
    Path("real.png").write_bytes(b"a previous picture")
    os.symlink("real.png", "link.png")
    return tmp_path


@dataclass
class Case:
    argv: str
    code: int
    message: str | None                   # a regex the one error line must match (None: no error)
    after: Callable[[Path], None] | None = None
    patch: Callable | None = None         # (monkeypatch) -> None, before the command
    id: str = field(default="")


def _unchanged(name, content):
    def check(_):
        assert Path(name).read_bytes() == content
    return check


def _absent(*names):
    def check(_):
        for n in names:
            assert not Path(n).exists(), n
    return check


def _link_kept(_):
    assert Path("link.png").is_symlink() and os.readlink("link.png") == "real.png"
    assert Path("real.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _fail_np_save(monkeypatch):
    import errno

    def save(*a, **k):
        raise OSError(errno.EFBIG, "File too large")
    monkeypatch.setattr(np, "save", save)


def _little_memory(monkeypatch):
    from taperay.runtime import resources
    monkeypatch.setattr(resources, "available_memory", lambda: 1 << 30)


CASES = [
    # outputs: nothing lost
    Case("render scene.py -o scene.py --size 8", 2, r"^taperay: error: scene\.py: is an input of this command",
         _unchanged("scene.py", SCENE.encode()), id="render over its scene"),
    Case("eval scene.py points.npy -o scene.py", 2, r"scene\.py: is an input", id="eval over its scene"),
    Case("eval scene.py points.npy -o points.npy", 2, r"points\.npy: is an input", id="eval over its points"),
    Case("render scene.py -o /dev/null --size 8", 2, r"/dev/null: is a device; outputs replace regular files only",
         id="device"),
    Case("render scene.py -o fifo.png --size 8", 2, r"fifo\.png: is a pipe", id="pipe"),
    Case("render scene.py -o . --size 8", 2, r"is a directory", id="folder"),
    Case("render scene.py -o link.png --size 8 --walker cpu", 0, None, _link_kept, id="link written through"),
    Case("eval scene.py points.npy -o old.npy --walker cpu", 2, r"old\.npy: cannot write: File too large",
         _unchanged("old.npy", b"the previous output"), _fail_np_save, id="failed write keeps the old file"),
    Case("render scene.py --set q=1 -o new/deeper/a.png --size 8", 2, r"scene\.py: --set q=1: no parameter named 'q'",
         _absent("new"), id="failed command removes its folders"),
    Case("render scene.py -o x.png --size 16384", 2,
         r"--size 16384x16384 needs about .* of memory \(an estimate\), and 1\.07 GB is available", patch=_little_memory,
         id="image memory"),
    # error lines: the user's faults as theirs, with file and line
    Case("info raises.py", 2, r"^taperay: error: raises\.py:4: the scene file raised ValueError: boom$", id="scene() raises"),
    Case("info exits.py", 2, r"exits\.py: the scene file called sys\.exit\(0\)", id="scene calls sys.exit"),
    Case("info deep.py", 0, None, id="400 transforms deep"),
    Case("eval scene.py huge.npy -o v.npy", 2, r"huge\.npy: not a readable \.npy array", _absent("v.npy"),
         id="npy header larger than the file"),
    Case("eval scene.py nan.npy -o v.npy", 2, r"nan\.npy: 2 points are NaN or infinite \(the first in row 1\)",
         id="NaN points"),
    Case("render scene.py --set r=nan -o a.png", 2, r"--set 'r=nan': expected NAME=VALUE with a finite number",
         id="--set NaN"),
    Case("info long.vm", 2, r"long\.vm: 270,001 lines exceed the importer's limit of 262,144", id=".vm too long"),
    # checks before work
    Case("simulate heat.py -o r.vtu --section s.png --section-plane w=3", 2, r"--section-plane 'w=3': the axis is x, y or z",
         _absent("r.vtu"), id="section plane before the solve"),
    Case("simulate heat.py -o x.py", 2, r"x\.py: the result is written by meshio, which knows no \.py files",
         id="simulate output format before the solve"),
    Case("simulate heat.py -o r.vtu --json r.vtu", 2, r"r\.vtu: is an input", id="two outputs in one file"),
    Case("simulate heat.py -o r.vtu --resolution 0", 2, r"--resolution 0: ", _absent("r.vtu"), id="resolution 0"),
    Case("mesh scene.py -o s.stl --resolution 100000", 2, r"--resolution 100000: .* needs? about .* of memory",
         id="resolution past memory"),
    Case("simulate nu.py -o r.vtu", 2, r"nu\.py: .*nu = 0\.7: Poisson's ratio must lie in -1 < nu < 0\.5",
         id="Poisson's ratio 0.7"),
    Case("simulate lid.py -o r.vtu", 2, r"lid\.py: study: .*no material named 'lid'.*steel", _absent("r.vtu"),
         id="study names a missing material"),
    Case("optimize heat.py --objective max_temperature --max-steps 0 -o best.scene", 2,
         r"--max-steps 0: give 1 or more", _absent("best.scene"), id="max-steps 0"),
    Case("optimize ball.tape --objective volume -o best.scene", 2, r"ball\.tape: is a tape", id="optimize a tape"),
    Case("view scene.py", 2, r"scene\.py: no display to open a window on", patch=lambda mp: [
        mp.delenv("DISPLAY", raising=False), mp.delenv("WAYLAND_DISPLAY", raising=False)], id="view without a display"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_cli_case(case, work, capsys, monkeypatch):
    if case.patch:
        case.patch(monkeypatch)
    rc = cli.main(case.argv.split())
    out, err = capsys.readouterr()
    assert rc == case.code, (out, err)
    if case.message is None:
        assert err.strip() == "" or "error" not in err, err
    else:
        assert len(err.strip().splitlines()) == 1, err        # one line, never a traceback
        assert re.search(case.message, err.strip()), err
    if case.after:
        case.after(work)


def test_outputs_share_one_mode(work, capsys):
    """A new PNG, scene and tape file get the same mode: 0o666 less the umask."""
    import taperay as tr
    mask = os.umask(0o022)
    os.umask(mask)
    tape = tr.flatten(tr.sphere(1))
    tr.save_tape(tape, "a.tape")
    tr.save_scene(tr.sphere(1), "a.scene")
    tr.write_png("a.png", np.zeros((2, 2, 3), np.uint8))
    for name in ("a.tape", "a.scene", "a.png"):
        assert stat.S_IMODE(os.stat(name).st_mode) == 0o666 & ~mask, name


def test_an_existing_output_keeps_its_mode(work):
    import taperay as tr
    Path("kept.png").write_bytes(b"x")
    os.chmod("kept.png", 0o640)
    tr.write_png("kept.png", np.zeros((2, 2, 3), np.uint8))
    assert stat.S_IMODE(os.stat("kept.png").st_mode) == 0o640


def test_a_reader_that_leaves_early_is_not_an_error(work):
    """`taperay info --json | head -c 1`: no error line (exit status 141, as SIGPIPE gives). The
    scene's 6,000 named parameters make the JSON larger than a pipe's buffer."""
    Path("many.py").write_text("import taperay as tr\nscene = tr.union(*[tr.sphere(tr.Param(f'radius_{i}', 0.1))"
                               ".translate(i, 0, 0) for i in range(6000)])\n")
    proc = subprocess.run(f"{sys.executable} -m taperay.tools.cli info many.py --json | head -c 1",
                          shell=True, capture_output=True, text=True, timeout=120)
    assert proc.stdout == "{"
    assert proc.stderr == "", proc.stderr
