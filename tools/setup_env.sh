# Sourced by run.sh and test.sh: the setup steps they share (bash, set -euo pipefail).
#   ensure_venv SPEC      create .venv (installing python3-venv with apt if Debian lacks it) and
#                         pip install -e SPEC into it (again only when pyproject.toml changed)
#   ensure_vulkan         install Mesa's Vulkan drivers (lavapipe) with apt when no Vulkan driver is
#                         present; without apt, warn and go on (GPU tests then fail in CI mode)
#   ensure_runtime_dir    XDG_RUNTIME_DIR for wgpu/Mesa, set when unset
#   ensure_xvfb           install Xvfb with apt when missing (the viewer's window test draws under it)
#   ensure_petsc          PETSc + Open MPI with apt, then petsc4py (built against them) and mpi4py into
#                         .venv, when petsc4py is missing there (simulate --solver petsc and its tests)

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"
    elif command -v sudo >/dev/null 2>&1; then sudo "$@"
    else echo "setup: need root (or sudo) for: $*" >&2; return 1
    fi
}

apt_install() {
    command -v apt-get >/dev/null 2>&1 || return 1
    echo "setup: apt-get install $*" >&2
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

ensure_venv() {
    if [ ! -x .venv/bin/python ] || ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
        rm -rf .venv
        if ! python3 -m venv .venv >/dev/null 2>&1; then
            rm -rf .venv
            apt_install python3-venv || { echo "setup: python3 -m venv failed and apt-get is unavailable" >&2; return 1; }
            python3 -m venv .venv
        fi
    fi
    # (an editable install follows the sources: pip runs again only when pyproject.toml changed since
    # SPEC was last installed, so a later ./run.sh spends no seconds on it)
    local want stamp
    want="$(cksum < pyproject.toml)"
    stamp=".venv/.installed-$(printf %s "$1" | tr -c 'A-Za-z0-9' _)"
    [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && return 0
    echo "setup: pip install -e $1 into .venv" >&2
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -e "$1" && echo "$want" > "$stamp"
}

has_vulkan_driver() {
    local d
    for d in /usr/share/vulkan/icd.d /etc/vulkan/icd.d /usr/local/share/vulkan/icd.d; do
        compgen -G "$d/*.json" >/dev/null && return 0
    done
    return 1
}

ensure_vulkan() {
    has_vulkan_driver && return 0
    apt_install mesa-vulkan-drivers libvulkan1 && return 0
    echo "setup: WARNING: no Vulkan driver and no apt-get: the GPU walker is absent (GPU tests fail in CI mode)" >&2
}

ensure_runtime_dir() {
    export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp/taperay-runtime-$(id -u)}"
    mkdir -p "$XDG_RUNTIME_DIR" && chmod 700 "$XDG_RUNTIME_DIR"
}

ensure_xvfb() {
    command -v Xvfb >/dev/null 2>&1 && return 0
    apt_install xvfb && return 0
    echo "setup: WARNING: no Xvfb and no apt-get: the viewer's window test fails in CI mode" >&2
}

PETSC_DIR_DEBIAN=/usr/lib/petscdir/petsc3.18/x86_64-linux-gnu-real

ensure_petsc() {
    .venv/bin/python -c "import petsc4py, mpi4py" >/dev/null 2>&1 && return 0
    if [ ! -d "$PETSC_DIR_DEBIAN" ] || ! command -v mpiexec >/dev/null 2>&1; then
        apt_install libpetsc-real-dev openmpi-bin gcc || { echo "setup: WARNING: no apt-get: PETSc is absent (its tests fail in CI mode)" >&2; return 0; }
    fi
    echo "setup: building petsc4py against Debian's PETSc (about 3 minutes on 2 cores)" >&2
    .venv/bin/python -m pip install --quiet --disable-pip-version-check setuptools wheel
    PETSC_DIR="$PETSC_DIR_DEBIAN" .venv/bin/python -m pip install --quiet --disable-pip-version-check \
        --no-build-isolation "petsc4py==3.18.5" mpi4py
}
