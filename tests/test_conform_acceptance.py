"""Issue 3's acceptance run as tests: `taperay conform --random 2000` and `taperay conform SCENE`
for every scene pass on the GPU walker (lavapipe in CI): every op within its tolerance, hit masks
and depths within theirs. The exit status is the verdict."""
from pathlib import Path

import pytest

from taperay.tools.cli import main

SCENES = sorted(p for p in (Path(__file__).resolve().parents[1] / "scenes").glob("*.py") if p.name != "__init__.py")


@pytest.mark.slow
def test_conform_random_2000_passes(walker_gpu, capsys):
    assert main(["conform", "--random", "2000", "--walkers", "gpu"]) == 0, capsys.readouterr().out[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("scene", SCENES, ids=lambda p: p.stem)
def test_conform_scene_passes(walker_gpu, scene, capsys):
    assert main(["conform", str(scene), "--walkers", "gpu"]) == 0, capsys.readouterr().out[-2000:]
