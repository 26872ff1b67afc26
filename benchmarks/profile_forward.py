"""Where a decode step's time goes: torch.profiler over single-row forward
passes of LlamaEngine, the GEMMs alone, and what is left (the glue: norms,
RoPE, attention, the KV write, Python).

    python benchmarks/profile_forward.py                    # the engine as it runs
    python benchmarks/profile_forward.py --gemm onednn --torch-ops   # the engine before its CPU kernels
    python benchmarks/profile_forward.py --dtype bfloat16

Prints the CPU model, ms per decode step (fastest and median of --steps),
ms of the step's projections alone (every GEMM of a step on a random row,
fastest of 10), and torch.profiler's table of the ops by self CPU time;
writes JSON to --out. numba kernels (the paged attention, and with the
default path the GEMMs and small steps) are not torch ops: they are in the
step's wall time, not in the table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from specdec.engine.base import ForwardItem
from specdec.engine.gemm_select import cpu_model
from specdec.engine.kv_pool import default_num_threads
from specdec.engine.llama import Checkpoint, LlamaEngine
from specdec.models import default_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=default_model())
    ap.add_argument("--gemm", default="auto")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--torch-ops", action="store_true", help="the small steps as torch ops (before engine.cpu_ops)")
    ap.add_argument("--threads", type=int, default=default_num_threads())
    ap.add_argument("--context", type=int, default=64, help="cached tokens before the profiled steps")
    ap.add_argument("--rows", type=int, default=1, help="new rows per step (1: decoding, k + 1: verification)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="bench_results/profile_forward.json")
    args = ap.parse_args()

    engine = LlamaEngine(Checkpoint.load(args.model), args.dtype, kv_capacity_tokens=4096, gemm=args.gemm,
                         num_threads=args.threads, fuse_small_steps=not args.torch_ops)
    engine.ensure_capacity("s", args.context + (args.steps * 3 + 20) * args.rows)
    engine.forward([ForwardItem("s", list(range(100, 100 + args.context)), 1)])

    def step() -> None:
        engine.forward([ForwardItem("s", [200] * args.rows, args.rows)])

    for _ in range(3):
        step()
    walls = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        walls.append((time.perf_counter() - t0) * 1e3)
    linears = [engine.lm_head] + [lin for layer in engine.layers for lin in (layer.qkv, layer.o, layer.gate_up,
                                                                              layer.down)]
    xs = {d: torch.randn(args.rows, d).to(engine.dtype) for d in {lin.in_features for lin in linears}}
    gemm_ms = []
    for _ in range(10):
        t0 = time.perf_counter()
        for lin in linears:
            lin(xs[lin.in_features])
        gemm_ms.append((time.perf_counter() - t0) * 1e3)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step()
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    torch_ms = sum(e.self_cpu_time_total for e in ops) / 1e3 / args.steps

    label = f"gemm {engine.gemm}, {'torch ops' if not engine.fused else 'cpu_ops kernels'}"
    print(f"CPU: {cpu_model()}; {args.threads} threads; {args.dtype}; {label}; {args.rows} row(s) per step after "
          f"{args.context} cached tokens")
    print(f"step: {min(walls):.1f} ms fastest, {statistics.median(walls):.1f} ms median of {args.steps}")
    print(f"the step's GEMMs alone: {min(gemm_ms):.1f} ms; torch ops (self CPU, all threads) per step: "
          f"{torch_ms:.1f} ms")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "cpu": cpu_model(), "threads": args.threads, "dtype": args.dtype, "gemm": engine.gemm,
        "fused": engine.fused, "rows": args.rows,
        "step_ms_min": min(walls), "step_ms_median": statistics.median(walls), "gemm_ms": min(gemm_ms),
        "torch_ops_ms_per_step": torch_ms,
        "ops": [{"name": e.key, "calls_per_step": e.count / args.steps,
                 "self_ms_per_step": e.self_cpu_time_total / 1e3 / args.steps} for e in ops[:30]]}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
