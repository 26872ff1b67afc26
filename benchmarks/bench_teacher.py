"""Times the data phase of ``specdec distill``: the target answering the
recipe's prompts (``distill.teacher_data``, eagle3 features on, sampled at
the default temperature) in each --teacher-dtype and with each number of
answers in flight (``distill.TEACHER_BATCH``), one child process a row,
all rows in the same run, so the figures compare. Per row: answer tokens
a second, against float32 at 32 in flight (the old setting), and peak RSS.
Prints the CPU model.

    python benchmarks/bench_teacher.py                       # SmolLM2, 256 answers of <= 96 tokens a row
    python benchmarks/bench_teacher.py --answers 64 --widths 32,128 --dtypes float32

Writes JSON to --out (default bench_results/teacher.json).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from specdec.distill_args import TEACHER_DTYPES, DistillConfig


def child(args) -> None:
    """One row in this process: one JSON line."""
    import torch

    import specdec.distill as distill
    from specdec.distill_eagle3 import eagle3_layers
    from specdec.engine.checkpoint import load_hf_model
    from specdec.models import load_tokenizer, resolve_model

    torch.set_num_threads(args.threads)
    target, tokenizer = load_hf_model(args.model), load_tokenizer(resolve_model(args.model))
    distill.TEACHER_BATCH = args.width
    cfg = DistillConfig(args.model, "unused", samples=args.answers, max_new_tokens=args.max_new_tokens,
                        threads=args.threads, kind="eagle3", teacher_dtype=args.dtype)
    start = time.perf_counter()
    data = distill.teacher_data(target, tokenizer, cfg, lambda *_: None, eagle3_layers(target))
    seconds = time.perf_counter() - start
    tokens = sum(len(t) - s - 1 for t, s in zip(data["tokens"], data["start"]))
    print(json.dumps({"dtype": distill.teacher_dtype(cfg, target), "width": args.width, "tokens": tokens,
                      "seconds": seconds, "tok_s": tokens / seconds,
                      "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="target (default: the project's default model)")
    p.add_argument("--answers", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--widths", default="32,128", help="answers in flight, comma-separated")
    p.add_argument("--dtypes", default="float32,bfloat16", help=f"of {TEACHER_DTYPES}, comma-separated")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="bench_results/teacher.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--width", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    from specdec.models import default_model

    args.model = args.model or default_model()
    if args.child:
        child(args)
        return
    from specdec.engine.gemm_select import cpu_model, native_bf16

    dtypes = args.dtypes.split(",")
    bad = [d for d in dtypes if d not in TEACHER_DTYPES]
    if bad:
        p.error(f"--dtypes: {bad} not in {TEACHER_DTYPES}")
    widths = [int(w) for w in args.widths.split(",")]
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores, native bfloat16: {native_bf16()}); model {args.model}; "
          f"{args.answers} answers of <= {args.max_new_tokens} tokens a row, {args.threads} threads", flush=True)
    rows = []
    for dtype in dtypes:
        for width in widths:
            done = subprocess.run([sys.executable, __file__, "--child", "--model", args.model, "--answers",
                                   str(args.answers), "--max-new-tokens", str(args.max_new_tokens), "--threads",
                                   str(args.threads), "--width", str(width), "--dtype", dtype],
                                  capture_output=True, text=True, check=True)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"  {rows[-1]['dtype']:9} {width:4} in flight: {rows[-1]['tok_s']:7.0f} tok/s", flush=True)
    base = next((r["tok_s"] for r in rows if r["dtype"] == "float32" and r["width"] == 32), None)
    print(f"\n{'dtype':10}{'in flight':>10}{'tok/s':>9}{'x f32/32':>10}{'peak RSS GB':>13}")
    for r in rows:
        ratio = f"{r['tok_s'] / base:.2f}" if base else "-"
        print(f"{r['dtype']:10}{r['width']:>10}{r['tok_s']:>9.0f}{ratio:>10}{r['peak_rss_gb']:>13.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu_model(), "model": args.model, "answers": args.answers,
                               "max_new_tokens": args.max_new_tokens, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
