#!/usr/bin/env bash
# Set up and run the tests in CI mode: the GPU walker must be present (Mesa lavapipe counts; it is
# installed with apt when no Vulkan driver is), and so must PETSc (built into .venv when missing).
# Tests run in one process per core (pytest-xdist; a process out of tests takes over another's
# queued ones: --dist worksteal); extra arguments go to pytest (e.g. -n 0).
set -euo pipefail
cd "$(dirname "$0")"
source tools/setup_env.sh
ensure_vulkan
ensure_xvfb
ensure_venv '.[test]'
ensure_petsc
ensure_runtime_dir
export TAPERAY_REQUIRE_GPU=1 TAPERAY_REQUIRE_PETSC=1
exec .venv/bin/python -m pytest -n auto --dist worksteal "$@"
