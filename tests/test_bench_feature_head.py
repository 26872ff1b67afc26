"""benchmarks/bench_feature_head.py on stories260K with a random EAGLE-3 head
written by the test: it runs, writes its JSON, and the steps after a target
decode step and the cold steps (the caches refilled with other data before
each) are timed separately from the warm ones."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from feature_heads import write_eagle3_head

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_feature_head.py"


def test_bench_feature_head_times_warm_and_cold_steps_and_writes_json(stories_path, tmp_path):
    head = write_eagle3_head(tmp_path / "head", Path(stories_path), [1, 3, 4])
    out = tmp_path / "feature_head.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", stories_path, "--eagle3", str(head),
                           "--prefix", "32", "--reps", "3", "--accepted", "1.5", "--projection-dtype", "bfloat16",
                           "--evict-mb", "8", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["projection_dtype"] == "bfloat16" and result["evict_mb"] == 8.0
    for key in ("target_decode_ms", "head_chain_step_ms", "head_catchup_4_rows_ms", "head_chain_step_cold_ms",
                "head_catchup_4_rows_cold_ms", "head_chain_step_after_target_ms",
                "head_catchup_4_rows_after_target_ms", "target_step_weight_mb"):
        assert result[key] > 0, key
    # the share from the unrounded times: the rounded ones give it to within their rounding
    assert result["chain_step_after_target_share_of_decode"] == pytest.approx(
        result["head_chain_step_after_target_ms"] / result["target_decode_ms"], rel=0.01)
    assert result["feature_bytes_per_position"] == 2 * 3 * 64  # stories260K: hidden 64, three layers, bfloat16
    assert result["feature_bytes_per_round"] == round(1.5 * result["feature_bytes_per_position"])
    assert "cold ms" in proc.stdout and "after target" in proc.stdout and "head chain step" in proc.stdout


def test_bench_feature_head_refuses_a_non_positive_eviction_naming_the_flag(stories_path, tmp_path):
    head = write_eagle3_head(tmp_path / "head", Path(stories_path), [1, 3, 4])
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", stories_path, "--eagle3", str(head),
                           "--evict-mb", "0", "--out", str(tmp_path / "x.json")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "--evict-mb: must be > 0" in proc.stderr, proc.stderr[-2000:]
