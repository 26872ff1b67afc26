"""benchmarks/bench_verify_ab.py on stories260K: every path timed each round,
the table printed, the JSON written with per-round times."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_verify_ab.py"


def test_bench_verify_ab_times_every_path_in_turns_and_writes_json(stories_path, tmp_path):
    out = tmp_path / "verify_ab.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", stories_path, "--paths", "auto,simd,simd-l1",
                           "--rounds", "2", "--steps", "3", "--context", "20", "--threads", "1", "--rows", "2,6",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert list(result["paths"]) == ["auto", "simd", "simd-l1"]
    for name, row in result["paths"].items():
        assert row["gemm"] == name or name == "auto"
        assert len(row["rounds"]) == 2 and all(len(t) == 3 for t in row["rounds"])  # decode, verify2, verify6
        assert row["decode_ms"] > 0 and set(row["verify_ms"]) == set(row["verify_over_decode"]) == {"2", "6"}
        assert all(ms > 0 for ms in row["verify_ms"].values())
        assert row["verify_over_decode"]["6"] == pytest.approx(statistics.median(t[2] / t[0] for t in row["rounds"]))
    assert "verify2/decode" in proc.stdout and "verify6/decode" in proc.stdout and "CPU:" in proc.stdout
    bad = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--rounds" in bad.stderr
    bad = subprocess.run([sys.executable, str(SCRIPT), "--paths", "simd,fast"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "--paths: fast" in bad.stderr
    for rows in ("2,x", "0,6"):
        bad = subprocess.run([sys.executable, str(SCRIPT), "--rows", rows], capture_output=True, text=True,
                             timeout=120)
        assert bad.returncode == 2 and "--rows" in bad.stderr
