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

Each head step is timed three ways:

- warm: back to back, its weights stay in the caches;
- after a target step: before each timed call, untimed, one target decode
  step of the engine above runs, as a Verify runs between two rounds of a
  co-located proposer; what of the head the caches keep then is what a
  stack's proposer finds (on a CPU whose last-level cache holds the
  target's weights and the head's, most of the head);
- cold: before each timed call, untimed, the benchmark reads ``--evict-mb``
  of other data (default: the bytes of the weights one target decode step
  reads, as its GEMM path stores them: a GGUF model's blocks; twice that
  where the machine's last-level cache would hold them both, so that the
  head starts from memory).

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
from bench_forward import decode_weight_bytes

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


def target_step(engine: LlamaEngine, prefix: int):
    """A callable running one decode step after a prefix of ``prefix``
    tokens (rolled back each time)."""
    engine.ensure_capacity("t", prefix + 1)
    engine.forward([ForwardItem("t", np.arange(1, prefix + 1, dtype=np.int32) % 100, 1)])

    def step():
        engine.ensure_capacity("t", prefix + 1)  # truncate may free the last block
        engine.forward([ForwardItem("t", np.asarray([7], dtype=np.int32), 1)])
        engine.truncate("t", prefix)
    return step


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


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size (sysfs; 0 where unknown)."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return max(sizes, default=0)


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
                   help="megabytes read before each cold step (default: the bytes of the weights a target decode "
                        "step reads, at least twice the last-level cache)")
    p.add_argument("--out", default="bench_results/feature_head.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.evict_mb is not None and args.evict_mb <= 0:
        p.error(f"--evict-mb: must be > 0, got {args.evict_mb}")
    checkpoint = Checkpoint.load(args.model)
    engine = LlamaEngine(checkpoint, "float32", kv_capacity_tokens=4096, num_threads=1)
    step_bytes = decode_weight_bytes(engine)
    llc = last_level_cache_bytes()
    evict_mb = args.evict_mb if args.evict_mb is not None else max(step_bytes, 2 * llc) / (1 << 20)
    head = load_eagle3(args.eagle3, args.model, args.projection_dtype)
    head.set_threads(1)
    target = target_step(engine, args.prefix)
    target_ms = median_ms(target, args.reps)
    chain_ms = head_ms(head, args.prefix, 1, args.reps)
    catchup_ms = head_ms(head, args.prefix, 4, args.reps)
    chain_after_ms = head_ms(head, args.prefix, 1, args.reps, target)
    catchup_after_ms = head_ms(head, args.prefix, 4, args.reps, target)
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
        "target_step_weight_mb": round(step_bytes / (1 << 20), 1), "last_level_cache_mb": round(llc / (1 << 20), 1),
        "head_chain_step_after_target_ms": round(chain_after_ms, 3),
        "head_catchup_4_rows_after_target_ms": round(catchup_after_ms, 3),
        "chain_step_after_target_share_of_decode": round(chain_after_ms / target_ms, 4),
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
          f"head projections {args.projection_dtype}; a target decode step reads {step_bytes / (1 << 20):.0f} MB "
          f"of weights, last-level cache {llc / (1 << 20):.0f} MB; cold: {evict_mb:.0f} MB read before each step")
    after = "after target"
    print(f"{'step':<34}{'warm ms':>10}{after:>14}{'cold ms':>10}   share of a target decode step")
    print(f"{'target decode (1 token)':<34}{target_ms:>10.3f}")
    print(f"{'head chain step (1 draft token)':<34}{chain_ms:>10.3f}{chain_after_ms:>14.3f}{chain_cold_ms:>10.3f}   "
          f"{100 * chain_ms / target_ms:.1f}% / {100 * chain_after_ms / target_ms:.1f}% / "
          f"{100 * chain_cold_ms / target_ms:.1f}%")
    print(f"{'head catch-up (4 accepted rows)':<34}{catchup_ms:>10.3f}{catchup_after_ms:>14.3f}"
          f"{catchup_cold_ms:>10.3f}")
    print(f"feature bytes per context position: {row_bytes} (this target), {row_bytes_8b} (8B target, hidden 4096)")
    for key in ("feature_bytes_per_round", "feature_bytes_per_round_8b", "link_us_per_round_8b_at_10gbit"):
        if key in result:
            print(f"{key}: {result[key]}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
