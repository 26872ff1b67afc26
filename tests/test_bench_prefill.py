"""benchmarks/bench_prefill.py on stories260K, with this tree's own engine
package as the baseline (so the two must agree bit for bit): each engine in
a child of its own, asked for its rounds in turns; the table printed, the
JSON written, a baseline that is no engine package refused."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_prefill.py"


def test_bench_prefill_times_this_engine_and_a_baseline_copy_in_turns(stories_path, tmp_path):
    out = tmp_path / "prefill.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", stories_path, "--baseline-src", str(ROOT / "engine"),
                           "--prompts", "9,20", "--batches", "3", "--context", "8", "--rounds", "2", "--reps", "1",
                           "--threads", "1", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["identical"] is True and result["rounds"] == 2
    assert result["gemm"]["baseline"] == result["gemm"]["this"]  # the baseline runs the path this engine took
    assert [(r["kind"], r["size"]) for r in result["rows"]] == [("prefill_ms", 9), ("prefill_ms", 20),
                                                               ("batch_ms", 3)]
    for row in result["rows"]:
        assert row["this_ms"] > 0 and row["baseline_ms"] > 0 and row["speedup"] > 0, row
    assert "prefill 20 tokens" in proc.stdout and "decode step, 3 sequences" in proc.stdout
    assert "identical logits: True" in proc.stdout and "CPU:" in proc.stdout
    bad = subprocess.run([sys.executable, str(SCRIPT), "--baseline-src", str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "--baseline-src" in bad.stderr
