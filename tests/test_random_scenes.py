"""Random CSG scenes from the public modelling API through `mesh` and a heat `simulate` on the
defaults (``taperay bench random-scenes`` runs 200): each ends closed and simulated, or with one
clear error (a TaperayError), never another exception."""
import pytest

pytest.importorskip("tetgen")
pytest.importorskip("skimage")

from taperay.tools.bench_random_scenes import FALLBACK, FINER, run_scene  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(8))
def test_a_random_scene_meshes_and_simulates_or_says_why(seed):
    row = run_scene(seed)
    assert row["mesh"] in ("closed manifold", "error"), row
    assert row["simulate"] in ("ok", FINER, FALLBACK, "error"), row
    if "error" in (row["mesh"], row["simulate"]):
        assert row["message"] and "\n" not in row["message"].strip(), row
