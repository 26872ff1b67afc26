"""benchmarks/bench_gguf_find.py on SmolLM2's GGUF file: this code and a
baseline file (a copy of this one) indexed and searched in turns, the table
printed, the JSON written."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_gguf_find.py"


@pytest.mark.smollm
def test_bench_gguf_find_times_this_code_and_a_baseline_in_turns(smollm_path, tmp_path):
    out, baseline = tmp_path / "gguf_find.json", tmp_path / "old" / "gemm_gguf.py"
    baseline.parent.mkdir()
    shutil.copy(ROOT / "engine" / "gemm_gguf.py", baseline)  # as `git show C:engine/gemm_gguf.py > F` gives it
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", smollm_path, "--rounds", "2",
                           "--baseline", str(baseline), "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["weights"] == 30 * 7 + 1  # 7 projections a layer and the LM head
    assert {name: len(times) for name, times in result["rounds"].items()} == {"this": 2, "baseline": 2}
    assert result["median_s"]["this"] > 0 and result["this_over_baseline"] > 0
    assert "this / baseline" in proc.stdout and "CPU:" in proc.stdout
    bad = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "1"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--rounds" in bad.stderr
