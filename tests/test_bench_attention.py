"""benchmarks/bench_attention.py on small shapes, with this tree's own
kv_pool.py as the baseline (so the two must agree bit for bit): the table
printed, the JSON written, bad arguments refused."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_attention.py"


def test_bench_attention_times_this_kernel_and_a_baseline_in_turns(tmp_path):
    out = tmp_path / "attention.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--baseline", str(ROOT / "engine" / "kv_pool.py"),
                           "--contexts", "20,40", "--rows", "1,3", "--layers", "2", "--heads", "4", "--kv-heads", "2",
                           "--head-dim", "16", "--reps", "2", "--threads", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["copy_bandwidth_gbs"] > 0 and result["fma_peak_gmacs_per_core"] > 0
    assert [(r["context"], r["rows"]) for r in result["rows"]] == [(20, 1), (20, 3), (40, 1), (40, 3)]
    for row in result["rows"]:
        assert row["max_abs_diff"] == 0.0  # the same kernels
        assert len(row["times_ms"]["this"]) == len(row["times_ms"]["baseline"]) == 2
        assert row["ms"]["this"] > 0 and row["ratio"] > 0 and row["floor_ms"] > 0 and row["gmacs"] > 0
    assert "this/base" in proc.stdout and "CPU:" in proc.stdout
    bad = subprocess.run([sys.executable, str(SCRIPT), "--contexts", "0"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "--contexts" in bad.stderr
