"""Times verify() per strategy: Triton kernels against the torch reference.

Each case is one batched verify call over B sequences with k drafts each
(B * (k + 1) target rows of V logits), the way the scorer calls it: input
checks, grouping, filter statistics and the strategy kernel included. On
CUDA both backends run on the GPU (timed with CUDA events); on CPU the
torch reference (``verify_reference``) and the scorer's CPU path
(``verify``: the torch reference, except that all-greedy batches are
scanned on the host) run.

    python benchmarks/bench_kernels.py            # B 1/32/256, V 49152/128256, k 5
    python benchmarks/bench_kernels.py --quick    # B 1/32, V 49152, fewer repeats

Prints a table and writes JSON to --out (default bench_results/kernels.json).
On CPU the table also gives the process CPU time of the reference (all
threads), which other processes on a shared machine disturb less than the
wall time.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from specdec.kernels import (
    GREEDY,
    REJECTION,
    TARGET_MATCH,
    TOPP,
    SamplingTensors,
    SparseDraftProbs,
    verify,
    verify_reference,
)

STRATEGIES = {"greedy": GREEDY, "rejection": REJECTION, "rejection-sparse": REJECTION,
              "target_match": TARGET_MATCH, "topp": TOPP}
SPARSE_WIDTH = 8  # draft-probability entries per draft for rejection-sparse


def make_case(strategy: str, num_seqs: int, vocab: int, k: int, device: str, temperature: float,
              top_k: int, top_p: float, seed: int = 0):
    """Random logits; drafts equal the row's argmax 70% of the time (a realistic
    acceptance mix), else random tokens."""
    g = torch.Generator().manual_seed(seed)
    rows = num_seqs * (k + 1)
    logits = torch.randn(rows, vocab, generator=g) * 3
    draft_rows = torch.arange(rows).view(num_seqs, k + 1)[:, :k].flatten()
    guesses = torch.randint(0, vocab, (draft_rows.numel(),), generator=g)
    right = torch.rand(draft_rows.numel(), generator=g) < 0.7
    drafts = torch.where(right, logits[draft_rows].argmax(-1), guesses).to(torch.int32)
    cu = (torch.arange(1, num_seqs + 1) * k).to(torch.int32)
    full = lambda value, dtype: torch.full((num_seqs,), value, dtype=dtype)
    sampling = SamplingTensors(
        temperature=full(0.0 if strategy == "greedy" else temperature, torch.float32),
        top_k=full(top_k, torch.int32), top_p=full(top_p, torch.float32),
        seed=torch.arange(num_seqs, dtype=torch.int64), position=full(100, torch.int64),
        strategy=full(STRATEGIES[strategy], torch.int32), accept_policy=full(0, torch.int32))
    draft_probs = None
    if strategy == "rejection-sparse":
        ids = torch.randint(0, vocab, (drafts.numel(), SPARSE_WIDTH), generator=g, dtype=torch.int32)
        ids[:, 0] = drafts
        probs = torch.rand(drafts.numel(), SPARSE_WIDTH, generator=g)
        draft_probs = SparseDraftProbs(ids.to(device), (probs / probs.sum(-1, keepdim=True)).to(device))
    sampling = SamplingTensors(*(getattr(sampling, name).to(device) for name in sampling.__dataclass_fields__))
    return logits.to(device), drafts.to(device), cu.to(device), sampling, draft_probs


def time_ms(fn: Callable[[], object], repeats: int, device: str) -> tuple[float, float | None]:
    """Median wall time of fn in milliseconds after one warm-up call, and on
    CPU the median process CPU time too (all threads; less sensitive than wall
    time to other processes sharing the cores)."""
    fn()
    wall, cpu = [], []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            wall.append(start.elapsed_time(end))
        else:
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall.append((time.perf_counter() - t0) * 1000)
            cpu.append((time.process_time() - c0) * 1000)
    return statistics.median(wall), statistics.median(cpu) if cpu else None


def run(args: argparse.Namespace) -> list[dict]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = []
    for vocab in args.vocab_sizes:
        for num_seqs in args.batch_sizes:
            for strategy in args.strategies:
                case = make_case(strategy, num_seqs, vocab, args.k, device, args.temperature, args.top_k, args.top_p)
                reference_ms, reference_cpu_ms = time_ms(lambda: verify_reference(*case), args.repeats, device)
                row = {"strategy": strategy, "batch": num_seqs, "vocab": vocab, "k": args.k, "device": device,
                       "reference_ms": reference_ms, "reference_cpu_ms": reference_cpu_ms, "triton_ms": None,
                       "cpu_path_ms": None}
                if device == "cpu":
                    row["cpu_path_ms"] = time_ms(lambda: verify(*case, use_triton=False), args.repeats, device)[0]
                if device == "cuda":
                    row["triton_ms"] = time_ms(lambda: verify(*case, use_triton=True), args.repeats, device)[0]
                results.append(row)
                print_row(row)
    return results


HEADER = (f"{'strategy':<17} {'B':>4} {'V':>7} {'reference ms':>13} {'(cpu ms)':>10} {'cpu path ms':>12} "
          f"{'triton ms':>10} {'speedup':>8}")


def print_row(row: dict) -> None:
    optional = lambda value: "-" if value is None else f"{value:.3f}"
    speedup = "-" if row["triton_ms"] is None else f"{row['reference_ms'] / row['triton_ms']:.1f}x"
    print(f"{row['strategy']:<17} {row['batch']:>4} {row['vocab']:>7} {row['reference_ms']:>13.3f} "
          f"{optional(row['reference_cpu_ms']):>10} {optional(row['cpu_path_ms']):>12} "
          f"{optional(row['triton_ms']):>10} {speedup:>8}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="B 1/32, V 49152, 3 repeats")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--vocab-sizes", type=int, nargs="+", default=[49152, 128256])
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    parser.add_argument("--k", type=int, default=5, help="drafts per sequence")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per case (default 5, quick 3)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--out", type=Path, default=Path("bench_results/kernels.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.batch_sizes, args.vocab_sizes = [1, 32], [49152]
    if args.repeats is None:
        args.repeats = 3 if args.quick else 5
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"verify() on {device}: k={args.k}, temperature={args.temperature}, top_k={args.top_k}, "
          f"top_p={args.top_p} (greedy at temperature 0), median of {args.repeats}")
    print(HEADER)
    results = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()}
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine(),
            "torch": torch.__version__, "threads": torch.get_num_threads()}
    args.out.write_text(json.dumps({"config": config, "meta": meta, "results": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
