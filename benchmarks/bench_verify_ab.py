"""Decode steps and verifications (by default 6 rows: k = 5 drafts)
through the engine, per GEMM path, taking turns: each round, each path's
engine (their order alternating) prefills the same random context (not
timed), then runs --steps decode steps and one verification of each --rows
count (``bench_kv_dtype.time_context``), so that the machine's slow and
fast minutes (shared memory bandwidth moves these figures by a third) fall
on all paths alike. Prints the median ms of each and the median of the
rounds' verify / decode ratios (issue goal: a k = 5 verification within
1.15x a decode step; short ones, as adaptive draft lengths and model
drafts' confidence cuts make, should cost less), and writes JSON.
bench_forward.py times the same passes one configuration after another;
bench_decode_ab.py decodes whole answers in turns; bench_kv_dtype.py
compares KV cache dtypes so.

    python benchmarks/bench_verify_ab.py --paths auto,numba1,simd,simd-l1 --rounds 11
    python benchmarks/bench_verify_ab.py --dtype bfloat16 --paths auto,simd,simd-dpbf16,simd-l1
    python benchmarks/bench_verify_ab.py --paths auto --rows 2,3,4,6
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import numpy as np
from bench_kv_dtype import VERIFY_ROWS, time_context

from specdec.engine.config import DTYPE_NAMES, GEMM_CHOICES
from specdec.engine.gemm_select import cpu_model
from specdec.engine.kv_pool import default_num_threads
from specdec.engine.llama import Checkpoint, LlamaEngine
from specdec.models import default_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=default_model())
    ap.add_argument("--dtype", default="float32", choices=list(DTYPE_NAMES))
    ap.add_argument("--paths", default="auto,numba1,simd,simd-l1", help="GEMM paths (auto: the selector's)")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per round")
    ap.add_argument("--context", type=int, default=128, help="cached tokens before the timed steps")
    ap.add_argument("--rows", default=str(VERIFY_ROWS), help="rows of the timed verifications (drafts + 1), "
                    "comma-separated")
    ap.add_argument("--threads", type=int, default=default_num_threads())
    ap.add_argument("--out", default="bench_results/verify_ab.json")
    args = ap.parse_args()
    if min(args.rounds, args.steps, args.context) < 1:
        ap.error("--rounds, --steps and --context: positive")
    try:
        verify_rows = [int(n) for n in args.rows.split(",")]
    except ValueError:
        ap.error(f"--rows: {args.rows!r} is not a comma-separated list of row counts")
    if min(verify_rows) < 1:
        ap.error("--rows: positive row counts")
    paths = args.paths.split(",")
    if unknown := [p for p in paths if p not in GEMM_CHOICES]:
        ap.error(f"--paths: {', '.join(unknown)} not among {', '.join(GEMM_CHOICES)}")
    checkpoint = Checkpoint.load(args.model, args.dtype)
    capacity = args.context + args.steps + sum(verify_rows) + 64
    engines = {p: LlamaEngine(checkpoint, args.dtype, gemm=p, kv_capacity_tokens=capacity, num_threads=args.threads)
               for p in paths}
    context = np.random.default_rng(0).integers(0, checkpoint.config.vocab_size, args.context).astype(np.int32)
    times: dict[str, list[tuple[float, ...]]] = {p: [] for p in paths}  # per round: decode ms, verify ms per row count
    for r in range(args.rounds + 1):  # round 0 warms up, untimed
        for p in (paths if r % 2 == 0 else paths[::-1]):
            t = time_context(engines[p], context, args.steps, 1, verify_rows)
            if r:
                times[p].append(t)
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores); {args.dtype}, {args.threads} threads, context "
          f"{args.context}, {args.rounds} rounds of {args.steps} decode steps + one verification of each of "
          f"{', '.join(map(str, verify_rows))} rows")
    print(f"{'path':22} {'decode ms':>10}" + "".join(f" {f'verify{n} ms':>11} {f'verify{n}/decode':>15}"
                                                   for n in verify_rows))
    rows = {}
    for p, engine in engines.items():
        rounds = times[p]
        rows[p] = {"gemm": engine.gemm, "decode_ms": statistics.median(t[0] for t in rounds),
                   "verify_ms": {n: statistics.median(t[1 + i] for t in rounds) for i, n in enumerate(verify_rows)},
                   "verify_over_decode": {n: statistics.median(t[1 + i] / t[0] for t in rounds)
                                          for i, n in enumerate(verify_rows)},
                   "rounds": rounds}
        label = f"{p}->{engine.gemm}" if p == "auto" else p
        print(f"{label:22} {rows[p]['decode_ms']:10.2f}" + "".join(
            f" {rows[p]['verify_ms'][n]:11.2f} {rows[p]['verify_over_decode'][n]:15.2f}" for n in verify_rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu_model(), "args": vars(args), "paths": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
