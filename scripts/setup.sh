#!/usr/bin/env bash
# Creates .venv and installs specdec with its test dependencies (CPU torch).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "${PYTHON:-python3}" -m venv .venv
fi
. .venv/bin/activate
export PIP_CONSTRAINT="$PWD/scripts/constraints.txt"
export PIP_DISABLE_PIP_VERSION_CHECK=1
echo "[setup] installing torch 2.13.0 (CPU) and specdec[test]"
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[test]"
echo "[setup] done: $(python -c 'import specdec, torch; print("specdec", specdec.__version__, "torch", torch.__version__)')"
