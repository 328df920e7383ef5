"""Shared pytest fixtures: the walkers (``walker_cpu``, ``walker_gpu``, ``walker_jax``;
``walkers_all``, which parametrises a test over every walker that has the capabilities it asks
for, and ``walkers_graded``, the same without the twin, for tests that grade a walker against the
twin), and ``evaluate_one_by_one``. A test asks for capabilities (runtime.walkers.CAPABILITIES)
with ``@pytest.mark.needs("evaluate", ...)``; without the mark it needs "render" (the CPU and GPU
walkers). The GPU walker skips where no adapter exists, except when CI sets
TAPERAY_REQUIRE_GPU=1: then its absence is a failure; the JAX walker skips where jax is not
installed."""
import os

import numpy as np
import pytest
from hypothesis import settings as hypothesis_settings

# One pytest-xdist worker per core: each worker's twin runs on its share of the cores (one thread
# where the workers take them all), and so does its JAX cell form (one host device a core), so
# that no kernel's threads wait on another worker's. Set before anything imports Numba or JAX
# (taperay.runtime.cpu and jax_walker do); a user's setting wins.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    from taperay.runtime.jit_cache import default_xla_flag, usable_cores     # (loads neither Numba nor JAX)
    _share = str(max(1, usable_cores() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    os.environ.setdefault("NUMBA_NUM_THREADS", _share)
    default_xla_flag("xla_force_host_platform_device_count", _share)

from taperay.runtime.cpu import CpuWalker  # noqa: E402  (after the thread count)

WALKER_NAMES = ("cpu", "gpu", "jax")
# each walker's capabilities, without importing wgpu or jax to parametrise
# (tests/test_walker_protocol.py checks them against the walkers' own)
WALKER_CAPABILITIES = {"cpu": frozenset({"evaluate", "gradient", "render"}),
                       "gpu": frozenset({"evaluate", "gradient", "render", "upload"}),
                       "jax": frozenset({"evaluate", "gradient", "derivatives"})}
DEFAULT_NEEDS = ("render",)

# Property tests draw the same examples on every run ("fixed": a failure reproduces, CI's verdict
# does not depend on luck); HYPOTHESIS_PROFILE=explore draws new ones each run, to look for more.
hypothesis_settings.register_profile("fixed", derandomize=True)
hypothesis_settings.register_profile("explore", derandomize=False)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fixed"))


def pytest_configure(config):
    config.addinivalue_line("markers", "needs(*capabilities): the walker capabilities a test over walkers_all / "
                                       "walkers_graded uses (runtime.walkers.CAPABILITIES; default: render)")


def walkers_with(needs, graded: bool = False) -> list[str]:
    """The walkers' names having every capability in ``needs`` (without the twin: ``graded``)."""
    return [n for n in WALKER_NAMES if set(needs) <= WALKER_CAPABILITIES[n] and not (graded and n == "cpu")]


def pytest_generate_tests(metafunc):
    marker = metafunc.definition.get_closest_marker("needs")
    needs = marker.args if marker else DEFAULT_NEEDS
    for fixture, graded in (("walkers_all", False), ("walkers_graded", True)):
        if fixture in metafunc.fixturenames:
            metafunc.parametrize(fixture, walkers_with(needs, graded), indirect=True)


def pytest_addoption(parser):
    parser.addoption("--regenerate", action="store_true", default=False,
                     help="rewrite the golden images (tests/golden/) from the GPU walker's renders, and the "
                          "GPU self-check's stored twin image (runtime/self_check_reference.png)")


def gpu_required() -> bool:
    return os.environ.get("TAPERAY_REQUIRE_GPU") == "1"


def _absent(reason: str):
    if gpu_required():
        pytest.fail(f"TAPERAY_REQUIRE_GPU=1 but the GPU walker is absent: {reason}")
    pytest.skip(f"GPU walker absent: {reason}")


@pytest.fixture(scope="package")
def walker_cpu():
    """The Numba reference walker."""
    return CpuWalker()


@pytest.fixture(scope="package")
def walker_gpu():
    """The wgpu walker (Mesa lavapipe counts as an adapter)."""
    try:
        from taperay.runtime.gpu import GpuWalker
    except ImportError as e:
        _absent(f"wgpu is not installed ({e})")
    if not GpuWalker.available():
        _absent("no GPU adapter")
    walker = GpuWalker()
    # every pipeline made now, as a long-lived process's background makes them, so that what a
    # test counts is its own requests (tests/test_startup.py: what a fresh process makes)
    walker.kernels.queue_rest()
    walker.kernels.settle()
    return walker


@pytest.fixture(scope="package")
def walker_jax():
    """The JAX walker (skips where jax is not installed)."""
    pytest.importorskip("jax")
    from taperay.runtime.jax_walker import JaxWalker
    return JaxWalker()


@pytest.fixture
def walkers_all(request):
    """Each walker having the test's capabilities in turn (tests using it run once per walker)."""
    return request.getfixturevalue(f"walker_{request.param}")


@pytest.fixture
def walkers_graded(request):
    """Each walker but the twin having the test's capabilities, in turn: graded against the twin
    (``walker_cpu``), a test cannot compare the twin with itself."""
    return request.getfixturevalue(f"walker_{request.param}")


def evaluate_one_by_one(walker, tape, pts):
    """The field at each point evaluated alone (values, materials): blocks of one never split at
    a cull nor compact an instance list, so blocks must give these bits."""
    out = [walker.evaluate(tape, p[None]) for p in pts]
    return np.concatenate([d for d, _ in out]), np.concatenate([m for _, m in out])
