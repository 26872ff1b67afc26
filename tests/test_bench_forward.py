"""benchmarks/bench_forward.py's share of the bandwidth limit, computed once
the run's bandwidth measurements are in (the script itself loads SmolLM2
and transformers: run by hand, see its docstring)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_forward import cpu_per_call, with_bandwidth  # noqa: E402


def test_every_engine_and_transformers_row_gets_its_share_of_the_measured_limit():
    rows = [{"engine": "transformers generate", "dtype": "float32", "tokens_per_s": 20.0},
            {"engine": "LlamaEngine", "dtype": "float32", "tokens_per_s": 50.0, "weight_bytes": 500_000_000},
            {"engine": "LlamaEngine", "dtype": "float32", "gemm": "aten", "refused": "breaks invariance"},
            {"engine": "stack, ahead on, steps 4", "dtype": "float32", "tokens_per_s": 45.0},
            {"engine": "transformers generate", "dtype": "bfloat16", "tokens_per_s": 30.0},
            {"engine": "LlamaEngine", "dtype": "bfloat16", "tokens_per_s": 100.0, "weight_bytes": 250_000_000}]
    with_bandwidth(rows, 40.0)  # GB/s: 80 tok/s over 500 MB, 160 over 250 MB
    assert rows[1]["bandwidth_limit_tok_s"] == pytest.approx(80.0)
    assert [r.get("pct_of_bandwidth_limit") for r in rows] == pytest.approx([25.0, 62.5, None, None, 18.75, 62.5])
    with_bandwidth(rows, 80.0)  # measured again: every share follows
    assert rows[1]["pct_of_bandwidth_limit"] == pytest.approx(31.25) and rows[0]["pct_of_bandwidth_limit"] == 12.5


def test_a_path_reading_gguf_blocks_is_held_to_its_own_bytes_and_transformers_to_the_dense_ones():
    rows = [{"engine": "LlamaEngine", "dtype": "float32", "tokens_per_s": 200.0, "weight_bytes": 100_000_000,
             "dense_weight_bytes": 500_000_000},  # simd-gguf: blocks of a 500 MB float32 model
            {"engine": "transformers generate", "dtype": "float32", "tokens_per_s": 20.0}]
    with_bandwidth(rows, 40.0)  # 400 tok/s over the blocks, 80 over the dense weights
    assert rows[0]["bandwidth_limit_tok_s"] == pytest.approx(400.0)
    assert [r["pct_of_bandwidth_limit"] for r in rows] == pytest.approx([50.0, 25.0])


def test_cpu_per_call_leaves_out_the_scorers_busiest_threads_and_sums_every_other_process():
    spent = {("scorer0", 1): 5.0, ("scorer0", 2): 4.0, ("scorer0", 3): 0.3, ("scorer0", 4): 0.1,  # seconds
             ("gateway", 10): 0.4, ("gateway", 11): 0.1, ("client", 20): 0.05, ("proposer0", 30): 0.0}
    per_call = cpu_per_call(spent, "scorer0", 2, calls=100)
    assert per_call == pytest.approx({"scorer0 besides its passes": 4.0, "gateway": 5.0, "client": 0.5,
                                      "proposer0": 0.0})
    # one GEMM thread: the second busiest thread is the scorer's own overhead
    assert cpu_per_call(spent, "scorer0", 1, calls=100)["scorer0 besides its passes"] == pytest.approx(44.0)
    assert cpu_per_call(spent, "scorer0", 2, calls=0)["gateway"] == pytest.approx(500.0)  # no call counted: totals
