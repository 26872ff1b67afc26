"""benchmarks/bench_start.py on stories260K: real scorer processes started
both ways in turns, the table printed, the JSON written, the record kept
where asked; then an eagle3 proposer's starts, and a draft proposer's."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from feature_heads import write_eagle3_head

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_start.py"


def test_bench_start_starts_scorers_both_ways_in_turns_and_writes_json(stories_path, tmp_path):
    out, records = tmp_path / "start.json", tmp_path / "records"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--models", stories_path, "--rounds", "1",
                           "--records", str(records), "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    [row] = result["rows"]
    assert row["model"] == stories_path and result["rounds"] == 1
    assert len(row["rounds"]["transformers"]) == len(row["rounds"]["record"]) == 1
    assert all(s > 0 for s in (*row["rounds"]["transformers"], *row["rounds"]["record"]))
    assert row["record_over_transformers"] > 0
    assert len(list(records.glob("stories260K-*.json"))) == 1  # the record the "record" starts read
    assert "record / transformers" in proc.stdout and "CPU:" in proc.stdout
    head = write_eagle3_head(tmp_path / "head", Path(stories_path), None)
    e3 = subprocess.run([sys.executable, str(SCRIPT), "--models", stories_path, "--rounds", "1", "--eagle3", str(head),
                         "--records", str(records), "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert e3.returncode == 0, e3.stderr[-3000:]
    [row] = json.loads(out.read_text())["rows"]
    assert row["service"] == f"eagle3 proposer of {head}" and all(len(v) == 1 for v in row["rounds"].values())
    assert "starting an eagle3 proposer" in e3.stdout
    draft = subprocess.run([sys.executable, str(SCRIPT), "--models", stories_path, "--rounds", "1", "--draft",
                            stories_path, "--records", str(records), "--out", str(out)],
                           capture_output=True, text=True, timeout=600)
    assert draft.returncode == 0, draft.stderr[-3000:]
    [row] = json.loads(out.read_text())["rows"]
    assert row["service"] == f"draft proposer of {stories_path}" and set(row["rounds"]) == {"checked", "remembered"}
    assert row["remembered_over_checked"] > 0 and "remembered / checked" in draft.stdout
    assert len(list((records / "tokenizers").glob("stories260K-*.json"))) == 2  # its class, the pair's check
    bad = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--rounds" in bad.stderr
