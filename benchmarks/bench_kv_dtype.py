"""Decode steps and 6-row verifications of the engine with a float32 and a
bfloat16 KV cache (``kv_dtype``), taking turns after the same contexts.

A decode step reads every projection weight once and, in its attention,
every cached key and value of every layer: after C tokens SmolLM2 reads
C x 46 KB of float32 KV (30 layers, 3 kv heads of 64) beside its 270 MB of
bfloat16 weights, 46 MB after 1000 tokens. A bfloat16 cache halves that
part, and with --batch B sequences decoded together the attention reads B
times as much (the weights once). Each round, for each context length, each engine (their order
alternating between rounds) prefills the same random context (not timed),
then runs --steps decode steps and one 6-row verification (k = 5 drafts);
a row gives the median over rounds of each engine's ms per step and of the
bfloat16 / float32 ratio computed round by round (the machine's speed
drifts between minutes: only ratios of one round compare).

    python benchmarks/bench_kv_dtype.py --dtype bfloat16 --contexts 256,1000,2000 --rounds 7
    python benchmarks/bench_kv_dtype.py --dtype bfloat16 --contexts 1000 --batch 8 --rounds 5

Prints a table and writes JSON to --out (default bench_results/kv_dtype.json).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from bench_forward import engine_greedy

from specdec.engine.base import ForwardItem
from specdec.engine.config import DTYPE_NAMES, KV_DTYPE_NAMES
from specdec.engine.gemm_select import cpu_model
from specdec.engine.kv_pool import KV_DTYPES, KVPool, default_num_threads
from specdec.engine.llama import Checkpoint, LlamaEngine
from specdec.models import default_model

VERIFY_ROWS = 6  # a k = 5 verification


def time_context(engine: LlamaEngine, context: np.ndarray, steps: int, batch: int,
                 verify_rows: Sequence[int] = (VERIFY_ROWS,)) -> tuple[float, ...]:
    """(ms per decode step, then the ms of one verification of each row
    count in verify_rows) of `batch` sequences together, each after `context`
    (prefilled, not timed); each verification appends its rows after the
    one before (a few tokens more context); the sequences are released after."""
    seqs = [f"bench{i}" for i in range(batch)]
    for seq in seqs:
        engine.ensure_capacity(seq, len(context) + steps + sum(verify_rows))
        engine.forward([ForwardItem(seq, context, 0)])
    tokens = np.resize(context, batch).astype(np.int32)  # [batch]: each sequence's next token
    start = time.perf_counter()
    for _ in range(steps):
        logits = engine.forward([ForwardItem(seq, tokens[i:i + 1], 1) for i, seq in enumerate(seqs)]).logits
        tokens = logits.argmax(-1).numpy().astype(np.int32)
    decode_ms = (time.perf_counter() - start) / steps * 1e3
    verify_ms = []
    for n in verify_rows:
        rows = np.resize(context, n).astype(np.int32)
        start = time.perf_counter()
        engine.forward([ForwardItem(seq, rows, n) for seq in seqs])
        verify_ms.append((time.perf_counter() - start) * 1e3)
    for seq in seqs:
        engine.release(seq)
    return (decode_ms, *verify_ms)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=default_model())
    ap.add_argument("--dtype", default="bfloat16", choices=list(DTYPE_NAMES))
    ap.add_argument("--contexts", default="256,1000,2000", help="cached tokens before the timed steps")
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per context and round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together, each after the context")
    ap.add_argument("--threads", type=int, default=default_num_threads())
    ap.add_argument("--out", default="bench_results/kv_dtype.json")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    if min(contexts) < 1 or args.steps < 1 or args.rounds < 1 or args.batch < 1:
        ap.error("--contexts, --steps, --rounds and --batch: positive")

    checkpoint = Checkpoint.load(args.model)
    capacity = args.batch * (max(contexts) + args.steps + VERIFY_ROWS + 16) + 64
    engines = {kv: LlamaEngine(checkpoint, args.dtype, kv_capacity_tokens=capacity, num_threads=args.threads,
                               kv_dtype=kv) for kv in KV_DTYPE_NAMES}
    spec = engines["float32"].spec
    bytes_per_token = {kv: KVPool.bytes_per_token(len(engines[kv].layers), spec.num_kv_heads, spec.head_dim,
                                                  KV_DTYPES[kv]) for kv in engines}
    rng = np.random.default_rng(0)
    inputs = {c: rng.integers(0, engines["float32"].facts.vocab_size, c).astype(np.int32) for c in contexts}
    warm = inputs[min(contexts)][:16].tolist()
    same_start = {kv: engine_greedy(e, warm, 8) for kv, e in engines.items()}  # warm-up, and a sanity look
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores); {args.model}, {args.dtype} weights, GEMM "
          f"{engines['float32'].gemm}, {args.threads} threads; {args.batch} sequence(s) together; {args.rounds} "
          f"rounds of {args.steps} decode steps + one {VERIFY_ROWS}-row verification per context; load average "
          f"{os.getloadavg()[0]:.1f}")
    times: dict[tuple[int, str], list[tuple[float, float]]] = {(c, kv): [] for c in contexts for kv in engines}
    for r in range(args.rounds):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for c in contexts:
            for kv in order:
                times[c, kv].append(time_context(engines[kv], inputs[c], args.steps, args.batch))
    rows = []
    print(f"\n{'context':>7} {'f32 KV ms/step':>14} {'bf16 KV ms/step':>15} {'bf16/f32':>8} "
          f"{'f32 verify6 ms':>14} {'bf16 verify6 ms':>15} {'bf16/f32':>8}")
    for c in contexts:
        f32, b16 = times[c, "float32"], times[c, "bfloat16"]
        row = {"context": c,
               "decode_ms": {kv: statistics.median(t[0] for t in times[c, kv]) for kv in engines},
               "verify6_ms": {kv: statistics.median(t[1] for t in times[c, kv]) for kv in engines},
               "decode_ratio": statistics.median(b[0] / f[0] for b, f in zip(b16, f32)),
               "verify6_ratio": statistics.median(b[1] / f[1] for b, f in zip(b16, f32)),
               "rounds": {kv: times[c, kv] for kv in engines},
               "kv_mb_read_per_step": {kv: args.batch * c * bytes_per_token[kv] / 1e6 for kv in engines}}
        rows.append(row)
        print(f"{c:>7} {row['decode_ms']['float32']:>14.2f} {row['decode_ms']['bfloat16']:>15.2f} "
              f"{row['decode_ratio']:>8.3f} {row['verify6_ms']['float32']:>14.2f} "
              f"{row['verify6_ms']['bfloat16']:>15.2f} {row['verify6_ratio']:>8.3f}")
    print(f"\nKV bytes per token: float32 {bytes_per_token['float32']:,}, bfloat16 {bytes_per_token['bfloat16']:,}; "
          f"first greedy tokens the same in both: {same_start['float32'] == same_start['bfloat16']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu_model(), "model": args.model, "dtype": args.dtype, "threads": args.threads,
                               "batch": args.batch,
                               "gemm": engines["float32"].gemm, "steps": args.steps, "rounds": args.rounds,
                               "kv_bytes_per_token": bytes_per_token, "rows": rows,
                               "torch": torch.__version__}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
