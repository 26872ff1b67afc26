"""benchmarks/bench_gemm_ceiling.py on SmolLM2's layer shapes: the core's
peak measured, every row count timed against it, the 6-row floor stated,
the JSON written; bad arguments named."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gemm_ceiling.py"


def test_bench_gemm_ceiling_times_rows_against_the_peak_and_writes_json(smollm_path, tmp_path):
    out = tmp_path / "ceiling.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", smollm_path, "--rows", "6,2", "--reps", "2",
                           "--layouts", "wide", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["shapes"] == [[960, 576], [576, 576], [3072, 576], [576, 1536]]  # SmolLM2's fused projections
    assert result["macs_per_row"] == 576 * (960 + 576 + 3072) + 576 * 1536
    assert list(result["rows"]) == ["1", "2", "6"] and result["peak_macs_per_s"] > 0
    one = result["rows"]["1"]
    assert one["x_one_row"] == 1.0
    for n, row in result["rows"].items():
        assert row["ms"] > 0 and 0 < row["share_of_peak"]
        assert row["macs_per_s"] == pytest.approx(result["macs_per_row"] * int(n) / (row["ms"] / 1e3))
        assert row["ms_at_peak"] == pytest.approx(1e3 * result["macs_per_row"] * int(n) / result["peak_macs_per_s"])
        assert row["floor_x_one_row"] == pytest.approx(max(row["ms_at_peak"], one["ms"]) / one["ms"])
        assert list(row["layouts_x_one_row"]) == ["wide"] and row["layouts_x_one_row"]["wide"] > 0
    assert "CPU:" in proc.stdout and "a 6-row pass at this core's peak" in proc.stdout
    assert "wide x 1 row" in proc.stdout
    for args, named in ((["--rows", "2,x"], "--rows"), (["--rows", "0"], "--rows"), (["--reps", "0"], "--reps"),
                        (["--layouts", "wide,sideways"], "--layouts: sideways")):
        bad = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and named in bad.stderr
