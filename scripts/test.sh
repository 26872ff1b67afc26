#!/usr/bin/env bash
# Sets up the environment and runs the default test suite (everything but the
# suites marked slow). Extra arguments go to pytest, e.g. `-m slow`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
if [ "$#" -eq 0 ]; then set -- -m "not slow"; fi
python -m pytest -q --durations=25 "$@"  # the slowest 25: what to look at when the run grows
