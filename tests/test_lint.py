"""Static checks run as part of the suite, so CI fails on a lint or type
error: ruff (pyproject's [tool.ruff]) on the whole tree, mypy on the
installed `specdec` namespace (scripts/typecheck.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_clean():
    proc = _run(sys.executable, "-m", "ruff", "check", ".")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_clean():
    proc = _run(sys.executable, "scripts/typecheck.py")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
