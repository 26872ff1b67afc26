"""benchmarks/bench_kv_dtype.py on stories260K: both caches timed after each
context, the table printed, the JSON written with per-round times."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_kv_dtype.py"


def test_bench_kv_dtype_times_both_caches_in_turns_and_writes_json(stories_path, tmp_path):
    out = tmp_path / "kv_dtype.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", stories_path, "--dtype", "float32",
                           "--contexts", "20,70", "--steps", "3", "--rounds", "2", "--threads", "1", "--batch", "3",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["kv_bytes_per_token"] == {"float32": 2 * 5 * 4 * 8 * 4, "bfloat16": 2 * 5 * 4 * 8 * 2}
    assert [r["context"] for r in result["rows"]] == [20, 70] and result["batch"] == 3
    assert result["rows"][1]["kv_mb_read_per_step"]["float32"] == 3 * 70 * 1280 / 1e6
    for row in result["rows"]:
        for kv in ("float32", "bfloat16"):
            assert len(row["rounds"][kv]) == 2 and row["decode_ms"][kv] > 0 and row["verify6_ms"][kv] > 0
        assert row["decode_ratio"] > 0 and row["verify6_ratio"] > 0
    assert "bf16 KV ms/step" in proc.stdout
    bad = subprocess.run([sys.executable, str(SCRIPT), "--contexts", "0"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "--contexts" in bad.stderr
