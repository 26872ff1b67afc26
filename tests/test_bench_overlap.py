"""benchmarks/bench_overlap.py: the prompts each stream sends, and a short
run on stories260K through real processes (hybrid, lock-step and ``on``, two
requests a stream one after another), its table and JSON."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_overlap.py"
sys.path.insert(0, str(SCRIPT.parent))


def test_each_stream_sends_its_requests_through_the_prompts_in_turn():
    from bench_overlap import stream_prompts

    prompts = [[i] for i in range(8)]
    assert stream_prompts(prompts, 1, 1) == [[[0]]]  # one stream, one request: the first prompt only
    assert stream_prompts(prompts, 1, 8) == [[[i] for i in range(8)]]  # every prompt
    assert stream_prompts(prompts[:4], 3, 2) == [[[0], [3]], [[1], [0]], [[2], [1]]]


def test_plain_share_makes_the_first_streams_decode_plainly():
    from bench_overlap import stream_methods

    assert stream_methods("ngram", 8, 0.0) == ["ngram"] * 8
    assert stream_methods("ngram", 8, 0.5) == ["none"] * 4 + ["ngram"] * 4
    assert stream_methods("suffix", 1, 0.5) == ["suffix"]  # floor: one stream drafts
    assert stream_methods("ngram", 3, 1.0) == ["none"] * 3


def test_cpu_ms_per_round_divides_each_process_s_cpu_time_by_the_rounds():
    from bench_overlap import cpu_ms_per_round

    before = {"scorer": 1.0, "proposer": 2.0, "gateway": None}
    after = {"scorer": 1.5, "proposer": 2.01, "gateway": 3.0}
    per_round = cpu_ms_per_round(before, after, 10)
    assert per_round["gateway"] is None  # /proc unreadable before the run
    assert per_round["scorer"] == pytest.approx(50.0) and per_round["proposer"] == pytest.approx(1.0)
    assert cpu_ms_per_round(before, after, 0) == {"scorer": None, "proposer": None, "gateway": None}


def test_scorer_cpus_split_the_cpus_or_name_the_flag():
    from bench_overlap import split_cpus

    assert split_cpus("0", {0, 1}) == ({0}, {1})
    assert split_cpus("0-1,4", {0, 1, 2, 3, 4, 5}) == ({0, 1, 4}, {2, 3, 5})
    for text, why in [("x", "not a CPU list"), ("1-0", "not a CPU list"), ("7", "may not run on"),
                      ("0-1", "leaves no CPU")]:
        with pytest.raises(ValueError, match=why) as err:
            split_cpus(text, {0, 1})
        assert "--scorer-cpus" in str(err.value)


def test_bench_overlap_runs_requests_one_after_another_and_writes_json(stories_path, tmp_path):
    out = tmp_path / "overlap.json"
    cpus = sorted(os.sched_getaffinity(0))
    pin = ["--scorer-cpus", str(cpus[0])] if len(cpus) > 1 else []  # the scorer alone on one CPU
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", stories_path, "--latencies", "0", "--streams", "1",
                           "--modes", "off,on", "--repeats", "1", "--max-tokens", "160", "--requests-per-stream", "2",
                           "--method", "hybrid", "--proposer-args", "--max-cached-requests 0", "--out", str(out),
                           *pin], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    if pin:  # every process ran where --scorer-cpus put it
        placed = result["process_cpus"]
        assert placed["scorer"] == cpus[:1], placed
        assert placed["proposer"] == placed["gateway"] == placed["client"] == cpus[1:], placed
    assert result["requests_per_stream"] == 2 and result["method"] == "hybrid"  # served by a hybrid-only proposer
    assert result["proposer_args"] == "--max-cached-requests 0"
    assert [(r["mode"], r["streams"]) for r in result["rows"]] == [("off", 1), ("on", 1)]
    assert all(r["identical_to_lock_step"] and r["tok_s"] > 0 for r in result["rows"])
    assert all(r["tokens"] == 2 * 160 for r in result["rows"])  # two requests of 160 tokens (EOS ignored)
    assert "hybrid k=5 adaptive, 2 x 160 tokens per stream" in proc.stdout
    # every process worked during the run (the scorer verified, the gateway looped). /proc counts CPU in clock
    # ticks (10 ms): with 8-token answers (~20 ms a row) the gateway's share once read 0 ticks; 160 tokens a
    # request give it several
    for row in result["rows"]:
        assert row["cpu_ms_per_round"]["scorer"] > 0 and row["cpu_ms_per_round"]["gateway"] > 0, row
        assert row["cpu_ms_per_round"]["proposer"] >= 0, row
    bad = subprocess.run([sys.executable, str(SCRIPT), "--requests-per-stream", "0"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "--requests-per-stream" in bad.stderr
    bad = subprocess.run([sys.executable, str(SCRIPT), "--scorer-cpus", "0-100000"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "--scorer-cpus" in bad.stderr


def test_bench_overlap_measures_plain_decoding_which_on_never_splits(stories_path, tmp_path):
    """--method none: streams of plain decoding through real processes; the
    proposer is never asked, and ``on`` runs them lock-step (no overlapped
    step: a cohort would overlap nothing)."""
    out = tmp_path / "overlap.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", stories_path, "--latencies", "0", "--streams", "4",
                           "--modes", "off,on", "--repeats", "1", "--max-tokens", "16", "--method", "none",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["method"] == "none" and [r["mode"] for r in result["rows"]] == ["off", "on"]
    for row in result["rows"]:
        assert row["identical_to_lock_step"] and row["tokens"] == 4 * 16, row
        assert row["overlapped_steps"] == 0 and row["draft_tokens_per_round"] == 0, row


def test_bench_overlap_runs_a_mixed_batch_of_plain_and_drafting_streams(stories_path, tmp_path):
    """--plain-share 0.5: half the streams decode plainly beside ngram
    streams through real processes; every mode gives lock-step's tokens."""
    out = tmp_path / "overlap.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", stories_path, "--latencies", "0", "--streams", "4",
                           "--modes", "off,on,always", "--repeats", "1", "--max-tokens", "16", "--plain-share", "0.5",
                           "--draft-length", "fixed", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["plain_share"] == 0.5 and result["draft_length"] == "fixed"
    assert "k=5 fixed (50% of the streams plain)" in proc.stdout
    for row in result["rows"]:
        assert row["identical_to_lock_step"] and row["tokens"] == 4 * 16, row
        assert 0 < row["draft_tokens_per_round"], row  # the ngram half drafted
    assert next(r for r in result["rows"] if r["mode"] == "always")["overlapped_steps"] > 0
    bad = subprocess.run([sys.executable, str(SCRIPT), "--plain-share", "1.5"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "--plain-share" in bad.stderr
