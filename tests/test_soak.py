"""Soak and chaos through benchmarks/soak.py (slow: minutes of load). The
script exits 1 when the run broke the contract: an error, a wrong token, a
KV cache left behind, fewer kills than asked."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py"

pytestmark = pytest.mark.slow


def _run(tmp_path, *args: str) -> dict:
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), *args, "--out", str(out)], capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_soak_mixed_methods_every_output_equals_its_solo_run(stories_path, tmp_path):
    result = _run(tmp_path, "--model", stories_path, "--minutes", "3", "--streams", "64")
    assert result["errors"] == 0 and result["wrong_outputs"] == 0
    assert result["outcomes"]["OK"] > 100 and result["scorer_live_sequences_at_end"] == 0


def test_chaos_kills_never_give_a_wrong_token(stories_path, tmp_path):
    result = _run(tmp_path, "--model", stories_path, "--minutes", "3", "--streams", "32", "--kills", "20")
    assert result["wrong_outputs"] == 0 and result["errors"] == 0 and len(result["kills"]) == 20
    assert result["outcomes"]["OK"] > 100
