"""The public namespace: ``import taperay as tr`` exposes what the README promises, each name
documented, and the README's Python example runs as written."""
import re
from pathlib import Path

import numpy as np
import pytest

import taperay as tr

README = Path(__file__).resolve().parent.parent / "README.md"


def test_every_public_name_resolves_and_has_a_docstring():
    missing = [n for n in tr.__all__ if n != "__version__" and not (getattr(tr, n).__doc__ or "").strip()]
    assert not missing, f"public names without a docstring: {missing}"


def test_node_methods_have_docstrings():
    bare = [m for m, v in vars(tr.Node).items() if callable(v) and not m.startswith("_") and not v.__doc__]
    assert not bare, bare


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no_such_name"):
        tr.no_such_name


def test_the_readme_example_runs(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README.md has no python example"
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(compile(blocks[0], "README.md example", "exec"), ns)
    np.testing.assert_allclose(ns["d"], [0.3, 1.75], atol=1e-6)
    assert ns["image"].shape == (480, 640, 3) and ns["image"].dtype == np.uint8
    assert (tmp_path / "part.png").stat().st_size > 1000
    assert ns["tape"].params[ns["tape"].names["hole"][0]] == np.float32(0.45)


@pytest.mark.parametrize("kind", ["cpu", "gpu"])
def test_set_param_is_on_every_walker(kind, request):
    walker = request.getfixturevalue(f"walker_{kind}")
    tape = tr.flatten(tr.sphere(tr.Param("r", 0.5)))
    walker.set_param(tape, "r", 0.75)
    np.testing.assert_allclose(walker.evaluate(tape, [[0, 0, 2]])[0], [1.25], atol=1e-6)


def test_the_walker_choice_names_its_reason_and_rejects_unknown_kinds():
    said = []
    chosen = tr.walker("auto", log=said.append)
    assert chosen.name in ("cpu", "gpu")
    assert chosen.name == "gpu" or (said and said[0].startswith("walker:    cpu, because"))
    with pytest.raises(tr.TaperayError, match="unknown walker"):
        tr.walker("quantum")


def test_auto_skips_the_gpu_probe_where_no_gpu_device_exists(monkeypatch, tmp_path):
    """On Linux with no GPU device node and no Vulkan driver list in the environment, auto takes
    the twin without opening wgpu and says why; a device node, or a driver list, brings the probe back."""
    import sys
    from taperay.runtime import walkers
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(walkers, "GPU_DEVICE_NODES", (str(tmp_path / "renderD*"),))
    for name in walkers.VULKAN_DRIVER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    said = []
    assert tr.walker("auto", log=said.append).name == "cpu"
    assert said == [f"walker:    cpu, because {walkers.no_gpu_device()}"] and "no GPU device" in said[0]
    monkeypatch.setenv("VK_DRIVER_FILES", "/somewhere/icd.json")
    assert walkers.no_gpu_device() is None
    monkeypatch.delenv("VK_DRIVER_FILES")
    (tmp_path / "renderD128").touch()
    assert walkers.no_gpu_device() is None
    said.clear()
    chosen = tr.walker("auto", log=said.append)                # the probe: a GPU, or the twin with its reason
    assert chosen.name == "gpu" or "no GPU device" not in said[0]
