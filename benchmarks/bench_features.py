"""What target features (EAGLE-3 / MTP drafting) cost: bytes per round and
per prompt token, the scorer's extra time to return them, and the share of a
round they would take on a 10 Gbit/s network.

For B in --batches sequences with a cached prefix, a verification round of
q = k + 1 rows each (k = --k drafts) runs with no features (the plain path)
and with --layers (default: EAGLE-3's low / middle / high layer); then a
prefill of --prompt-tokens tokens, with and without. "extra" is the feature
run's time over the plain one, including the bfloat16 conversion and the
protobuf serialisation of the rows (what the scorer adds to its answer).
"net 10G" is the time the round's feature bytes take over two 10 Gbit/s
hops (scorer -> gateway -> proposer), as a share of the plain round.
Computed alongside: the same bytes for an 8B target (hidden 4096).

    flock /tmp/specdec-bench.lock python benchmarks/bench_features.py

Prints a table and writes JSON to --out (default bench_results/features.json).
Times are the minimum over --reps runs.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch

from specdec.engine.base import ForwardItem
from specdec.engine.config import EngineConfig
from specdec.engine.factory import build_engine
from specdec.engine.gemm_select import cpu_model
from specdec.limits import FEATURE_VALUE_BYTES
from specdec.models import default_model
from specdec.protos.v1 import specdec_pb2 as pb

LINK_BYTES_PER_S = 10e9 / 8  # 10 Gbit/s
HOPS = 2  # scorer -> gateway -> proposer
TARGET_8B_HIDDEN = 4096


def eagle3_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's usual low / middle / high layers (as vLLM picks them)."""
    return tuple(sorted({2, num_layers // 2, num_layers - 3}))  # fewer on a tiny model


def timed_round(engine, items: list[ForwardItem], layers: tuple[int, ...]) -> float:
    """Seconds of one forward over items (then rolled back), features turned
    into the wire's bfloat16 bytes and serialised when layers are given."""
    lens = {it.seq_id: engine.cached_len(it.seq_id) for it in items}
    for it in items:  # as the scheduler does before every pass
        engine.ensure_capacity(it.seq_id, lens[it.seq_id] + len(it.token_ids))
    start = time.perf_counter()
    out = engine.forward(items, feature_layers=layers)
    if layers:
        bits = out.features.to(torch.bfloat16).contiguous().view(torch.int16).numpy()
        offset = 0
        for it in items:  # one Features message per sequence, as the servicer builds them
            rows = bits[offset:offset + len(it.token_ids)]
            offset += len(it.token_ids)
            pb.Features(start=0, rows=len(rows), dim=rows.shape[1], data=rows.tobytes()).SerializeToString()
    elapsed = time.perf_counter() - start
    for seq_id, n in lens.items():
        engine.truncate(seq_id, n)
    return elapsed


def best(fn, reps: int) -> float:
    return min(fn() for _ in range(reps))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="target (default: the project's default model)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="bench_results/features.json")
    args = ap.parse_args()

    model = args.model or default_model()
    engine = build_engine(EngineConfig(model, dtype=args.dtype, kv_capacity_tokens=16384))
    facts = engine.facts
    layers = eagle3_layers(facts.num_layers)
    row_bytes = FEATURE_VALUE_BYTES * facts.hidden_size * len(layers)
    row_bytes_8b = FEATURE_VALUE_BYTES * TARGET_8B_HIDDEN * len(layers)
    rng = np.random.default_rng(0)
    q = args.k + 1
    print(f"CPU: {cpu_model()}; {platform.machine()}; torch threads {torch.get_num_threads()}")
    print(f"model {model} ({args.dtype}), hidden {facts.hidden_size}, {facts.num_layers} layers, "
          f"feature layers {layers}: {row_bytes} B per position (8B target: {row_bytes_8b} B)")

    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        items = []
        for i in range(b):
            seq = f"b{b}-{i}"
            engine.ensure_capacity(seq, 64)
            engine.forward([ForwardItem(seq, rng.integers(3, facts.vocab_size, 64).astype(np.int32), 0)])
            items.append(ForwardItem(seq, rng.integers(3, facts.vocab_size, q).astype(np.int32), q))
        plain = best(lambda: timed_round(engine, items, ()), args.reps)
        feats = best(lambda: timed_round(engine, items, layers), args.reps)
        nbytes = b * q * row_bytes
        rows.append({"kind": "round", "batch": b, "rows_per_seq": q, "plain_ms": plain * 1e3,
                     "features_ms": feats * 1e3, "feature_bytes": nbytes,
                     "net_10g_share": HOPS * nbytes / LINK_BYTES_PER_S / plain,
                     "feature_bytes_8b": b * q * row_bytes_8b})
        for it in items:
            engine.release(it.seq_id)
    n = args.prompt_tokens

    def prefill(with_layers: tuple[int, ...]) -> float:
        item = ForwardItem("prompt", rng.integers(3, facts.vocab_size, n).astype(np.int32), 1)
        elapsed = timed_round(engine, [item], with_layers)
        engine.release("prompt")
        return elapsed

    plain = best(lambda: prefill(()), args.reps)
    feats = best(lambda: prefill(layers), args.reps)
    rows.append({"kind": "prefill", "batch": 1, "rows_per_seq": n, "plain_ms": plain * 1e3,
                 "features_ms": feats * 1e3, "feature_bytes": n * row_bytes,
                 "net_10g_share": HOPS * n * row_bytes / LINK_BYTES_PER_S / plain,
                 "feature_bytes_8b": n * row_bytes_8b})

    print(f"{'kind':8} {'B':>3} {'rows':>5} {'plain ms':>9} {'+feat ms':>9} {'extra':>7} "
          f"{'bytes':>10} {'net 10G':>8} {'bytes 8B':>10}")
    for r in rows:
        print(f"{r['kind']:8} {r['batch']:3d} {r['rows_per_seq']:5d} {r['plain_ms']:9.2f} {r['features_ms']:9.2f} "
              f"{r['features_ms'] / r['plain_ms'] - 1:7.1%} {r['feature_bytes']:10d} {r['net_10g_share']:8.2%} "
              f"{r['feature_bytes_8b']:10d}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "cpu": cpu_model(), "model": model, "dtype": args.dtype, "hidden_size": facts.hidden_size,
        "num_layers": facts.num_layers, "feature_layers": layers, "row_bytes": row_bytes,
        "row_bytes_8b": row_bytes_8b, "k": args.k, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
