"""Times one feature-head draft step against one target decode step, the
way the proposer and the scorer run them, and states the feature traffic.

- target decode step: ``LlamaEngine.forward`` of one new token after a
  cached prefix (the scorer's plain-decoding step), float32, the GEMM path
  the engine chooses on this CPU;
- head chain step: ``FeatureHead.forward`` of one row after a cached prefix
  of the same length (one chained draft token: embedding + own feature,
  one layer, logits over the draft vocabulary);
- head catch-up: the rows of one round's accepted tokens (fc over the
  relayed features + the layer), 4 rows.

Each head step is timed warm (back to back: its weights stay in the
caches) and cold: before each timed call, untimed, the benchmark reads as
many bytes as the target's weights, which is what a Verify on the same
machine reads between two rounds of a co-located proposer, so the head
starts from memory as it does in a stack (``--evict-mb`` changes the size).

Feature traffic: bytes per context position (bfloat16, hidden * layers) for
this target and for an 8B target (hidden 4096, 3 layers), and per round at
the measured mean accepted length, with its share of a round at 10 Gbit/s.

    python benchmarks/bench_feature_head.py --eagle3 HEAD_DIR [--model M] [--projection-dtype bfloat16]

Prints a table and writes JSON to --out (default bench_results/feature_head.json).
Times are the median of --reps runs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from specdec.engine.base import ForwardItem
from specdec.engine.gemm_select import cpu_model
from specdec.engine.llama import Checkpoint, LlamaEngine
from specdec.limits import HEAD_PROJECTION_DTYPES
from specdec.models import default_model
from specdec.proposer_svc.eagle3 import HeadCache, HeadItem, load_eagle3

LINK_GBITS = 10.0


def median_ms(fn, reps: int, before=None) -> float:
    """Median wall time of fn in ms; before (untimed) runs ahead of each call."""
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def target_decode_ms(engine: LlamaEngine, prefix: int, reps: int) -> float:
    """One decode step after a prefix of ``prefix`` tokens (rolled back each time)."""
    engine.ensure_capacity("t", prefix + 1)
    engine.forward([ForwardItem("t", np.arange(1, prefix + 1, dtype=np.int32) % 100, 1)])

    def step():
        engine.ensure_capacity("t", prefix + 1)  # truncate may free the last block
        engine.forward([ForwardItem("t", np.asarray([7], dtype=np.int32), 1)])
        engine.truncate("t", prefix)
    return median_ms(step, reps)


def head_ms(head, prefix: int, rows: int, reps: int, before=None) -> float:
    """Rows fed after a cached prefix (rows = 1: one chain step), rolled back each time."""
    spec = head.spec
    cache = HeadCache(spec.num_kv_heads, spec.head_dim)
    head.forward([HeadItem(cache, torch.arange(prefix) % 100, torch.randn(prefix, spec.hidden_size))])
    feats = torch.randn(rows, spec.feature_dim)

    def step():
        head.forward([HeadItem(cache, torch.arange(rows) % 100,
                               head.fuse(feats) if rows > 1 else torch.randn(1, spec.hidden_size))])
        cache.length = prefix
    return median_ms(step, reps, before)


def evictor(megabytes: float):
    """A callable that reads ``megabytes`` of memory (the caches then hold that, not the head)."""
    buffer = np.ones(max(1, int(megabytes * (1 << 20)) // 4), np.float32)
    return lambda: float(buffer.sum())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=default_model())
    p.add_argument("--eagle3", required=True, help="an EAGLE-3 head for --model (public layout)")
    p.add_argument("--prefix", type=int, default=256, help="cached context tokens")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--accepted", type=float, default=None, help="mean accepted length (for bytes per round)")
    p.add_argument("--projection-dtype", choices=list(HEAD_PROJECTION_DTYPES), default="float32",
                   help="the head's projection weights (specdec proposer --draft-dtype)")
    p.add_argument("--evict-mb", type=float, default=None,
                   help="megabytes read before each cold step (default: the target's float32 weights)")
    p.add_argument("--out", default="bench_results/feature_head.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    checkpoint = Checkpoint.load(args.model)
    evict_mb = args.evict_mb if args.evict_mb is not None else sum(
        4 * v.numel() for v in checkpoint.state_dict.values()) / (1 << 20)
    engine = LlamaEngine(checkpoint, "float32", kv_capacity_tokens=4096, num_threads=1)
    head = load_eagle3(args.eagle3, args.model, args.projection_dtype)
    head.set_threads(1)
    target_ms = target_decode_ms(engine, args.prefix, args.reps)
    chain_ms = head_ms(head, args.prefix, 1, args.reps)
    catchup_ms = head_ms(head, args.prefix, 4, args.reps)
    cold = evictor(evict_mb)
    chain_cold_ms = head_ms(head, args.prefix, 1, args.reps, cold)
    catchup_cold_ms = head_ms(head, args.prefix, 4, args.reps, cold)
    row_bytes = 2 * head.spec.feature_dim
    row_bytes_8b = 2 * 4096 * 3
    result = {
        "cpu": cpu_model(), "model": args.model, "head": args.eagle3, "prefix": args.prefix, "threads": 1,
        "target_decode_ms": round(target_ms, 3), "head_chain_step_ms": round(chain_ms, 3),
        "head_catchup_4_rows_ms": round(catchup_ms, 3), "chain_step_share_of_decode": round(chain_ms / target_ms, 4),
        "projection_dtype": args.projection_dtype, "evict_mb": round(evict_mb, 1),
        "head_chain_step_cold_ms": round(chain_cold_ms, 3), "head_catchup_4_rows_cold_ms": round(catchup_cold_ms, 3),
        "chain_step_cold_share_of_decode": round(chain_cold_ms / target_ms, 4),
        "draft_vocab": head.draft_vocab_size, "feature_layers": list(head.spec.feature_layers),
        "feature_bytes_per_position": row_bytes, "feature_bytes_per_position_8b": row_bytes_8b,
    }
    if args.accepted:
        per_round = args.accepted * row_bytes
        result["feature_bytes_per_round"] = round(per_round)
        result["feature_bytes_per_round_8b"] = round(args.accepted * row_bytes_8b)
        result["link_us_per_round_8b_at_10gbit"] = round(args.accepted * row_bytes_8b * 8 / (LINK_GBITS * 1e3), 2)
    print(f"CPU: {result['cpu']}  model: {args.model}  prefix {args.prefix} tokens, 1 thread, "
          f"head projections {args.projection_dtype}; cold: {evict_mb:.0f} MB read before each step")
    print(f"{'step':<34}{'warm ms':>10}{'cold ms':>10}")
    print(f"{'target decode (1 token)':<34}{target_ms:>10.3f}")
    print(f"{'head chain step (1 draft token)':<34}{chain_ms:>10.3f}{chain_cold_ms:>10.3f}   "
          f"{100 * chain_ms / target_ms:.1f}% / {100 * chain_cold_ms / target_ms:.1f}% of decode")
    print(f"{'head catch-up (4 accepted rows)':<34}{catchup_ms:>10.3f}{catchup_cold_ms:>10.3f}")
    print(f"feature bytes per context position: {row_bytes} (this target), {row_bytes_8b} (8B target, hidden 4096)")
    for key in ("feature_bytes_per_round", "feature_bytes_per_round_8b", "link_us_per_round_8b_at_10gbit"):
        if key in result:
            print(f"{key}: {result[key]}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
