"""How long the ``simd-gguf`` path takes to find a GGUF model's projections
among its file's blocks (``gemm_gguf.GgufBlocks``: index every quantised row
of the file, then find and check, bit for bit, each weight's rows), which
every float32 engine of a GGUF model does at its start. With --baseline
(another ``gemm_gguf.py``, e.g. an older commit's: ``git show
a6f2e10:engine/gemm_gguf.py > /tmp/old.py``) both take turns, their order
alternating between rounds (the machine's speed drifts between minutes).

    python benchmarks/bench_gguf_find.py --model smollm2-135m-instruct-q4_1 --rounds 4 --baseline /tmp/old.py

Prints a table (median seconds of the rounds after the first, which warms
the page cache and the kernels) and writes JSON to --out (default
bench_results/gguf_find.json).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from bench_attention import load_baseline

from specdec.engine import gemm_gguf
from specdec.engine.checkpoint import Checkpoint
from specdec.engine.gemm_select import cpu_model
from specdec.models import default_model


def find_seconds(module, gguf: str, weights: list) -> float:
    """Seconds to index the file and find every weight's blocks."""
    started = time.perf_counter()
    blocks = module.GgufBlocks(gguf)
    for w in weights:
        blocks.find(w)
    return time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=default_model(), help="a GGUF model (directory, .gguf file or shared name)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--baseline", default=None, help="another gemm_gguf.py to time in turns")
    ap.add_argument("--out", default="bench_results/gguf_find.json")
    args = ap.parse_args()
    if args.rounds < 2:
        ap.error(f"--rounds must be at least 2 (the first warms up), got {args.rounds}")
    checkpoint = Checkpoint.load(args.model)
    if checkpoint.gguf is None:
        ap.error(f"--model {args.model} is not a GGUF model")
    weights = [t for name, t in checkpoint.state_dict.items() if t.dim() == 2 and "embed_tokens" not in name]
    versions = {"this": gemm_gguf}
    if args.baseline:
        versions["baseline"] = load_baseline(args.baseline, "gemm_gguf_baseline")
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores); {checkpoint.gguf}, {len(weights)} weights", flush=True)
    rounds: dict[str, list[float]] = {name: [] for name in versions}
    order = list(versions)
    for r in range(args.rounds):
        for name in (order if r % 2 == 0 else order[::-1]):
            rounds[name].append(round(find_seconds(versions[name], checkpoint.gguf, weights), 3))
        print(f"  round {r + 1}: " + ", ".join(f"{n} {rounds[n][-1]:.2f} s" for n in order), flush=True)
    median = {name: statistics.median(times[1:]) for name, times in rounds.items()}
    print(f"\n{'version':<10} {'seconds':>8}")
    for name in order:
        print(f"{name:<10} {median[name]:>8.2f}")
    result = {"cpu": cpu_model(), "cores": os.cpu_count(), "model": args.model, "gguf": checkpoint.gguf,
              "weights": len(weights), "rounds": rounds, "median_s": median}
    if "baseline" in median:
        result["this_over_baseline"] = round(median["this"] / median["baseline"], 3)
        print(f"this / baseline: {result['this_over_baseline']:.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
