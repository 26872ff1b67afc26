"""benchmarks/bench_proposer.py through real proposer processes: the rows per
method and B, the fan-out rows with each replica's compute and CPU time, the
JSON; and the CPU-time reading it rests on."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_proposer.py"
sys.path.insert(0, str(SCRIPT.parent))


def test_cpu_seconds_reads_a_process_s_cpu_time_and_the_rows_divide_it_by_rounds():
    import bench_proposer as bench

    before = bench.cpu_seconds(os.getpid())
    end = time.process_time() + 0.2
    while time.process_time() < end:  # burn 0.2 s of CPU in this process
        pass
    after = bench.cpu_seconds(os.getpid())
    assert before is not None and after is not None and after - before >= 0.15
    assert bench.cpu_seconds(2 ** 22 + 7) is None  # no such process
    assert bench.replica_cpu_ms([1.0, 2.0], [1.5, 2.25], 10) == [50.0, 25.0]
    assert bench.replica_cpu_ms([1.0, None], [1.5, 2.1], 10) is None
    assert bench.replica_cpu_ms([1.0], [1.5], 0) is None


def test_bench_proposer_measures_methods_batches_and_replicas_and_writes_json(tmp_path):
    out = tmp_path / "proposer.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--methods", "ngram,suffix", "--batch-sizes", "2,6",
                           "--replicas", "1,2", "--seconds", "0.5", "--fill-cache", "0", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    # one replica: every B; fan-out: the largest B only
    assert [(r["method"], r["batch"], r["replicas"]) for r in rows] == [
        ("ngram", 2, 1), ("ngram", 6, 1), ("suffix", 2, 1), ("suffix", 6, 1), ("ngram", 6, 2), ("suffix", 6, 2)]
    for r in rows:
        assert r["rounds"] > 0 and r["ms_per_round"] > 0 and r["drafts_per_seq_round"] > 0
        assert len(r["replica_compute_ms"]) == len(r["replica_cpu_ms"]) == r["replicas"]
        assert all(c > 0 for c in r["replica_compute_ms"]) and all(c >= 0 for c in r["replica_cpu_ms"])
        assert sum(r["replica_cpu_ms"]) > 0  # the replicas did the rounds' work
    assert "replica compute ms | CPU ms" in proc.stdout
