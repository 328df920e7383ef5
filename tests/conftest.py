"""Shared pytest fixtures: the walkers (``walker_cpu``; ``walkers_all`` once the other walkers exist)."""
import pytest

from taperay.runtime.cpu import CpuWalker


@pytest.fixture(scope="session")
def walker_cpu():
    """The Numba reference walker."""
    return CpuWalker()
