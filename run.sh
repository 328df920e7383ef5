#!/usr/bin/env bash
# The main job: set up .venv and render the showcase scene to out/machined_part.png, printing what
# it did and how long it took. Extra arguments go to `taperay render` (e.g. --size 1280x720).
set -euo pipefail
cd "$(dirname "$0")"
source tools/setup_env.sh
ensure_venv .
ensure_runtime_dir
exec .venv/bin/taperay render scenes/machined_part.py -o out/machined_part.png "$@"
