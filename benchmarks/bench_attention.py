"""The paged attention's kernels alone (``engine/kv_pool.py``), on a model's
attention shapes (SmolLM2-135M's by default: 9 query heads, 3 kv heads of 64
dimensions, 30 layers), after each context, for decode rows and verification
chunks; against a baseline measured in the same run, in turns:

* ``--baseline PATH``: another version's ``kv_pool.py`` (e.g. from ``git
  worktree add /tmp/old <commit>``: ``/tmp/old/engine/kv_pool.py``), loaded
  beside this one; every output is checked against it (closeness: the two may
  sum in other orders);
* always: the floor the machine puts on it: the cached keys and values of
  every layer read once at the copy bandwidth measured here, and the
  multiply-adds at one core's FMA peak measured here, times the threads.

    python benchmarks/bench_attention.py [--baseline PATH] [--contexts 100,250,500,1000,2000] [--rows 1,2,6]

Prints the CPU model and a table (ms per pass over all layers, medians of
--reps in turns); writes JSON (--out).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

import numba
import numpy as np
import torch
from bench_forward import copy_bandwidth_gbs

from specdec.engine import kv_pool
from specdec.engine.config import EngineConfig
from specdec.engine.gemm_numba import LAUNCH_LOCK, set_team
from specdec.engine.gemm_select import cpu_model
from specdec.engine.simd import fma, load, store, zeros

BLOCK = EngineConfig.block_size  # the engine's default KV block


def load_baseline(path: str, name: str = "kv_pool_baseline") -> ModuleType:
    """An engine file from another checkout (a kv_pool.py here) as its own
    module `name` (it imports this tree's other engine modules; numba caches
    its kernels beside that file, apart from this tree's)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--baseline {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@numba.njit(nogil=True)
def _fma_chains(x, n, out):
    """Six independent LANES-lane FMA chains, n steps: one core's multiply-add peak."""
    a0 = a1 = a2 = a3 = a4 = a5 = zeros()
    u, v = load(x, 0), load(x, 16)
    for _ in range(n):
        a0, a1, a2 = fma(a0, u, v), fma(a1, u, v), fma(a2, u, v)
        a3, a4, a5 = fma(a3, u, v), fma(a4, u, v), fma(a5, u, v)
    store(out, 0, a0)
    store(out, 16, a1)
    store(out, 32, a2)
    store(out, 48, a3)
    store(out, 64, a4)
    store(out, 80, a5)


def fma_peak_gmacs(steps: int = 20_000_000) -> float:
    """One core's float32 multiply-adds per second (G), fastest of three."""
    x, out = np.full(32, 0.5, np.float32), np.empty(96, np.float32)
    _fma_chains(x, 10, out)
    best = min(_timed(lambda: _fma_chains(x, steps, out)) for _ in range(3))
    return steps * 6 * 16 / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def make_pool(args, context: int, rows: int) -> tuple[kv_pool.KVPool, kv_pool.PagedBatch, np.ndarray]:
    """A pool holding `context` random cached tokens of one sequence and `rows` new ones, and their queries."""
    pool = kv_pool.KVPool(args.layers, args.kv_heads, args.head_dim, context + rows + BLOCK, block_size=BLOCK,
                          num_threads=args.threads, kv_dtype=kv_pool.KV_DTYPES[args.kv_dtype])
    g = torch.Generator().manual_seed(context * 7 + rows)
    pool.key_cache.copy_(torch.randn(pool.key_cache.shape, generator=g))
    pool.value_cache.copy_(torch.randn(pool.value_cache.shape, generator=g))
    pool.ensure_capacity("s", context + rows)
    pool.commit(["s"], [context])
    batch = pool.plan(["s"], [rows])
    query = (torch.randn(rows, args.heads, args.head_dim, generator=g) * args.head_dim ** -0.5).numpy()
    return pool, batch, query


def attend_all(module: ModuleType, pool: kv_pool.KVPool, batch: kv_pool.PagedBatch, query: np.ndarray,
               threads: int) -> list[np.ndarray]:
    """Every layer's attention through `module`'s kernels (the split the pool would choose: threads past
    PARALLEL_MIN_WORK)."""
    units = module.attention_units(batch.row_seq, query.shape[1] // pool.num_kv_heads, pool.num_kv_heads)
    parallel = threads > 1 and batch.attention_work * query.shape[1] >= module.PARALLEL_MIN_WORK
    # versions before the key pieces (KEY_CHUNK) took the units to run as (first, step)
    old_split = () if hasattr(module, "KEY_CHUNK") else (0, 1)
    outs = []
    for layer in range(pool.key_cache.shape[0]):
        out = np.empty_like(query)
        args = (query, *pool.layer_arrays(layer), batch.block_tables, batch.row_seq, batch.row_pos, 0, units)
        if parallel:
            with LAUNCH_LOCK:
                set_team(threads)
                module._paged_attention_parallel(*args, threads, out)
        else:
            module._paged_attention(*args, *old_split, out)
        outs.append(out)
    return outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default=None, help="another version's engine/kv_pool.py, timed in turns")
    ap.add_argument("--contexts", default="100,250,500,1000,2000", help="cached tokens before the new rows")
    ap.add_argument("--rows", default="1,2,6", help="new rows of the sequence (1: decoding, k + 1: verification)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--kv-dtype", default="float32", choices=sorted(kv_pool.KV_DTYPES))
    ap.add_argument("--threads", type=int, default=kv_pool.default_num_threads())
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default="bench_results/attention.json")
    args = ap.parse_args()
    try:
        contexts = [int(c) for c in args.contexts.split(",")]
        rows_list = [int(r) for r in args.rows.split(",")]
    except ValueError:
        ap.error("--contexts and --rows take comma-separated integers")
    if min(contexts) < 1 or min(rows_list) < 1:
        ap.error("--contexts and --rows must be >= 1")
    if args.heads % args.kv_heads or args.reps < 1 or args.threads < 1:
        ap.error("--heads must be a multiple of --kv-heads; --reps and --threads >= 1")
    baseline = load_baseline(args.baseline) if args.baseline else None
    versions = {"this": kv_pool} | ({"baseline": baseline} if baseline else {})

    bandwidth = copy_bandwidth_gbs()
    peak = fma_peak_gmacs()
    kv_bytes = 2 * kv_pool.KV_DTYPES[args.kv_dtype].itemsize * args.kv_heads * args.head_dim  # per token and layer
    print(f"CPU: {cpu_model()}; {args.threads} threads; copy bandwidth {bandwidth:.1f} GB/s; one core's FMA peak "
          f"{peak:.1f} G multiply-adds/s; {args.layers} layers x {args.heads} heads ({args.kv_heads} kv heads) x "
          f"{args.head_dim}, {args.kv_dtype} KV")
    results = []
    header = f"{'context':>7} {'rows':>4} {'floor ms':>8} {'this ms':>8} {'GMAC/s':>7}"
    if baseline:
        header += f" {'baseline ms':>11} {'this/base':>9} {'max |diff|':>10}"
    print(header)
    for context in contexts:
        for rows in rows_list:
            pool, batch, query = make_pool(args, context, rows)
            ref = attend_all(kv_pool, pool, batch, query, args.threads)
            diff = 0.0
            if baseline:
                other = attend_all(baseline, pool, batch, query, args.threads)
                diff = max(float(np.abs(a - b).max()) for a, b in zip(ref, other))
                if diff > 1e-4:
                    raise SystemExit(f"context {context}, rows {rows}: the baseline's outputs differ by {diff:.2e}")
            times: dict[str, list[float]] = {name: [] for name in versions}
            for _ in range(args.reps):
                for name, module in versions.items():
                    times[name].append(_timed(lambda m=module: attend_all(m, pool, batch, query, args.threads)))
            med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            visible = sum(context + r + 1 for r in range(rows))  # keys each new row sees
            macs = 2 * args.layers * args.heads * visible * args.head_dim  # scores and values
            floor = max(args.layers * (context + rows) * kv_bytes / bandwidth / 1e6,
                        macs / (peak * args.threads) / 1e6)
            row = {"context": context, "rows": rows, "floor_ms": floor, "ms": med,
                   "gmacs": macs / med["this"] / 1e6, "max_abs_diff": diff,
                   "times_ms": {name: [t * 1e3 for t in ts] for name, ts in times.items()}}
            line = f"{context:>7} {rows:>4} {floor:>8.2f} {med['this']:>8.2f} {row['gmacs']:>7.1f}"
            if baseline:
                row["ratio"] = med["this"] / med["baseline"]
                line += f" {med['baseline']:>11.2f} {row['ratio']:>9.3f} {diff:>10.1e}"
            print(line, flush=True)
            results.append(row)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu_model(), "threads": args.threads, "copy_bandwidth_gbs": bandwidth,
                               "fma_peak_gmacs_per_core": peak, "baseline": args.baseline,
                               "shape": {"layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads,
                                         "head_dim": args.head_dim, "kv_dtype": args.kv_dtype},
                               "rows": results}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
