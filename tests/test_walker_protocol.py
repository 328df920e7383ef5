"""The walker contract (runtime.walkers.Walker): the CPU, GPU and JAX walkers each satisfy the
protocol, with signatures that take the protocol's arguments, declare capabilities from
runtime.walkers.CAPABILITIES (the ones tests/conftest.py parametrises by), count the points they
evaluate in stats(), and edit a tape by set_param so that the next call sees the edit."""
import inspect

import numpy as np
import pytest

from taperay.runtime.tape import TaperayError
from taperay.runtime.walkers import CAPABILITIES, Walker
from taperay.scenegraph import Param, flatten, sphere

from conftest import WALKER_CAPABILITIES, walkers_with

PROTOCOL_METHODS = ("evaluate", "render", "set_param", "stats")


def _protocol_parameters(method: str) -> list[str]:
    return [p for p in inspect.signature(getattr(Walker, method)).parameters if p != "self"]


@pytest.mark.needs("evaluate")
def test_every_walker_keeps_the_protocol(walkers_all):
    w = walkers_all
    assert isinstance(w, Walker)
    assert w.name in WALKER_CAPABILITIES and w.capabilities == WALKER_CAPABILITIES[w.name]
    assert isinstance(w.capabilities, frozenset) and w.capabilities <= set(CAPABILITIES)
    for method in PROTOCOL_METHODS:
        own = inspect.signature(getattr(w, method)).parameters
        assert all(p in own for p in _protocol_parameters(method)), (w.name, method, list(own))
    for capability, methods in (("gradient", ("gradient",)),
                                ("render", ("march", "light", "field_image", "sign_image")),
                                ("derivatives", ("value_and_grad", "vjp", "jvp", "sensitivities")),
                                ("upload", ("upload",))):
        if capability in w.capabilities:
            assert all(callable(getattr(w, m, None)) for m in methods), (w.name, capability)


def test_an_object_missing_a_method_is_not_a_walker(walker_cpu):
    class NoStats:
        name, capabilities = "x", frozenset({"evaluate"})

        def evaluate(self, tape, points): ...

        def render(self, tape, camera, width, height, view="shade", settings=None, cells="auto"): ...

        def set_param(self, tape, name, value): ...

    assert not isinstance(NoStats(), Walker)
    NoStats.stats = lambda self: {}
    assert isinstance(NoStats(), Walker)


def test_walkers_are_chosen_by_capability():
    assert walkers_with(("evaluate",)) == ["cpu", "gpu", "jax"]
    assert walkers_with(("render",)) == ["cpu", "gpu"]
    assert walkers_with(("evaluate",), graded=True) == ["gpu", "jax"]
    assert walkers_with(("derivatives",)) == ["jax"]


@pytest.mark.needs("evaluate")
def test_stats_count_points_and_set_param_is_seen_by_the_next_call(walkers_all):
    tape = flatten(sphere(Param("r", 1.0)))
    pts = np.array([[0, 0, 2], [0, 0, 0.5], [3, 0, 0]], np.float32)
    before = walkers_all.stats()["points_evaluated"]
    d, _ = walkers_all.evaluate(tape, pts)
    assert walkers_all.stats()["points_evaluated"] == before + 3
    np.testing.assert_allclose(d, [1.0, -0.5, 2.0], atol=1e-6)
    walkers_all.set_param(tape, "r", 1.5)
    np.testing.assert_allclose(walkers_all.evaluate(tape, pts)[0], [0.5, -1.0, 1.5], atol=1e-6)


@pytest.mark.needs("evaluate")
def test_render_is_an_image_or_a_taperay_error_by_capability(walkers_all):
    tape = flatten(sphere(1.0))
    if "render" in walkers_all.capabilities:
        before = walkers_all.stats()["images_rendered"]
        img = walkers_all.render(tape, None, 16, 12)
        assert img.shape == (12, 16, 3) and img.dtype == np.uint8 and img.std() > 0
        assert walkers_all.stats()["images_rendered"] == before + 1
    else:
        with pytest.raises(TaperayError, match="does not render"):
            walkers_all.render(tape, None, 16, 12)


@pytest.mark.needs("evaluate")
def test_every_walker_evaluates_a_scene_as_the_twin_does(walkers_graded, walker_cpu):
    """Shapes, point ops, a smooth union, culled unions and patterns: each walker's values within
    the conformance tolerance of the scene's ops, its materials as conformance allows."""
    from taperay.runtime import conformance as C
    from taperay.scenegraph import box, smooth_union, torus, union
    tape = flatten(union(smooth_union(sphere(0.45).translate(0.3, 0, 0), box(0.3, 0.2, 0.4).rotate((0, 0, 1), 30),
                                      k=0.1),
                         torus(0.5, 0.1).translate(0, 0, 0.5),
                         sphere(0.1).linear_pattern((0.3, 0, 0), 5).translate(0, -0.8, 0)), source="shared scene")
    pts = np.random.default_rng(5).uniform(-1.5, 1.5, (400, 3)).astype(np.float32)
    (d, m), (dw, mw) = walker_cpu.evaluate(tape, pts), walkers_graded.evaluate(tape, pts)
    assert dw.dtype == np.float32 and mw.dtype == np.uint32 and dw.shape == (400,)
    assert C.within_tolerance(d, dw, C.scene_tolerance(tape), 1.5).all()
    assert np.mean(m != mw) <= C.MATERIAL_MAX
