"""Every example scene in scenes/ (the registry: each module's ``scene`` and ``TEST``) flattens,
stands for the instances it declares, and renders on every walker like its golden image.

Golden images live in tests/golden/, made on lavapipe by ``pytest tests/test_scenes.py
--regenerate`` (the GPU walker must be present for that); a render differs from its golden when
more than ``TEST['golden_tolerance']`` (default 1 %) of its pixels differ by more than 16/255.
"""
from pathlib import Path

import numpy as np
import pytest

from taperay.scenegraph import flatten
from taperay.scenegraph.loading import load_scene_module

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).resolve().parent / "golden"
SCENES = sorted(p for p in (ROOT / "scenes").glob("*.py") if p.name != "__init__.py")


def scene_test(path):
    import runpy
    return runpy.run_path(str(path))["TEST"]


@pytest.fixture(scope="module", params=SCENES, ids=lambda p: p.stem)
def scene(request):
    path = request.param
    return path.stem, flatten(load_scene_module(path), source=str(path)), scene_test(path)


def test_every_scene_declares_how_it_is_tested():
    assert len(SCENES) >= 3
    for path in SCENES:
        spec = scene_test(path)
        assert {"size", "instances"} <= set(spec), path.name


def test_scene_stands_for_its_declared_instances(scene):
    name, tape, spec = scene
    assert tape.instance_count == spec["instances"], name


@pytest.mark.slow
def test_scene_renders_like_its_golden_image(scene, walkers_all, request, tmp_path):
    from PIL import Image
    name, tape, spec = scene
    w, h = spec["size"]
    img = walkers_all.render(tape, None, w, h)
    assert img.shape == (h, w, 3) and img.dtype == np.uint8
    golden = GOLDEN / f"{name}.png"
    if request.config.getoption("--regenerate"):
        if walkers_all.name != "gpu":
            pytest.skip("golden images are made on the GPU walker (lavapipe)")
        GOLDEN.mkdir(exist_ok=True)
        Image.fromarray(img).save(golden)
    if not golden.exists():
        pytest.fail(f"no golden image {golden.name}; run pytest tests/test_scenes.py --regenerate on lavapipe")
    ref = np.asarray(Image.open(golden).convert("RGB"))
    differs = np.abs(img.astype(int) - ref.astype(int)).max(-1) > 16
    fraction = differs.mean()
    if fraction > spec.get("golden_tolerance", 0.01):
        Image.fromarray(img).save(tmp_path / f"{name}-{walkers_all.name}.png")
        pytest.fail(f"{name} on {walkers_all.name}: {fraction:.2%} of pixels differ from {golden.name} "
                    f"(render saved in {tmp_path})")
