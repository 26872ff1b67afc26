#!/usr/bin/env bash
# Sets up the environment and runs the default test suite (everything but the
# suites marked slow). Extra arguments go to pytest, e.g. `-m slow`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
if [ "$#" -eq 0 ]; then set -- -m "not slow"; fi
# Test files run side by side, one per worker (a file's module fixtures stay in
# one process): as many workers as cores, at most 4 (each loads its own models);
# SPECDEC_TEST_WORKERS=0 runs everything in this process.
workers="${SPECDEC_TEST_WORKERS:-$(python -c 'import os; print(min(4, len(os.sched_getaffinity(0))))')}"
if ! [[ "$workers" =~ ^[0-9]+$ ]]; then
  echo "SPECDEC_TEST_WORKERS must be a whole number of workers (0: one process), not '$workers'" >&2
  exit 2
fi
if [ "$workers" -gt 1 ]; then set -- -n "$workers" --dist loadfile "$@"; fi
python -m pytest -q --durations=25 "$@"  # the slowest 25: what to look at when the run grows
