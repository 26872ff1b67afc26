"""Times the training steps of ``specdec distill`` (--kind eagle3, the
default, or draft; steps per minute decide how good a head or draft a
--minutes budget gives).

The target answers --answers recipe prompts first (``distill.teacher_data``,
as the command does; sampled at its default temperature, --max-new-tokens), then child
processes time --steps AdamW steps of batch --batch-size over that data in
two forms, alternating, each from the same initial head:

- per sequence: one forward per sequence of the batch (the form before the
  packed forward; the same loss and gradient);
- packed: every sequence of the batch in one forward (eagle3:
  ``distill_eagle3.Pack``; draft: right-padded under an attention mask,
  ``distill.distill_loss``, a 2-layer draft as the README's command makes).

and with glibc's default malloc settings or ``engine.memory.keep_freed_memory``
(a child each: the setting is per process). Per row: median seconds a step,
steps a minute, page faults a step (minor, from getrusage), and the speed
against per-sequence/default of the same run. Prints the CPU model.

    python benchmarks/bench_distill_step.py                 # SmolLM2, 64 answers, 20 steps, 3 rounds
    python benchmarks/bench_distill_step.py --answers 32 --steps 10 --reps 1
    python benchmarks/bench_distill_step.py --kind draft

Writes JSON to --out (default bench_results/distill_step.json).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from specdec.distill_args import DEFAULT_DRAFT_VOCAB, DEFAULT_LR, KINDS, TEACHER_TEMPERATURE, DistillConfig

FORMS = ("per-sequence", "packed")
MEMORY = ("default", "keep")


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def child(args) -> None:
    """Times both forms in this process (memory setting args.memory); one JSON line."""
    from specdec.distill import distill_loss, student_from_target, trainable
    from specdec.distill_eagle3 import Eagle3Student, eagle3_layers, eagle3_loss, hot_tokens
    from specdec.engine.checkpoint import load_hf_model
    from specdec.engine.memory import keep_freed_memory

    applied = keep_freed_memory() if args.memory == "keep" else False
    torch.set_num_threads(args.threads)
    target = load_hf_model(args.model)
    data = torch.load(args.child, weights_only=False)
    hot = hot_tokens(data, target.config.vocab_size, args.draft_vocab)
    t2d_index = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
    t2d_index[hot] = torch.arange(len(hot))
    order = torch.randperm(len(data["tokens"]), generator=torch.Generator().manual_seed(0)).tolist()

    def batch_loss(student, rows):
        if args.kind == "draft":
            return distill_loss(student, data, rows)
        return eagle3_loss(student, data, rows, t2d_index)

    def loss_of(student, rows, form):
        if form == "packed":
            return batch_loss(student, rows)[0]
        parts = [batch_loss(student, [r]) for r in rows]
        return sum(loss * n for loss, n in parts) / max(sum(n for _, n in parts), 1)

    def new_student():
        if args.kind == "draft":
            return student_from_target(target, args.layers)
        return Eagle3Student(target, eagle3_layers(target), hot).train()

    students = {form: new_student() for form in FORMS}
    optimizers = {form: torch.optim.AdamW(trainable(st), lr=DEFAULT_LR[args.kind]) for form, st in students.items()}
    times: dict[str, list[float]] = {form: [] for form in FORMS}
    faults: dict[str, list[int]] = {form: [] for form in FORMS}
    for step in range(args.warmup + args.steps):
        rows = [order[(step * args.batch_size + i) % len(order)] for i in range(args.batch_size)]
        for form in FORMS:
            student, optimizer = students[form], optimizers[form]
            f0, t0 = _faults(), time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bfloat16"):
                loss = loss_of(student, rows, form)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable(student), 1.0)
            optimizer.step()
            if step >= args.warmup:
                times[form].append(time.perf_counter() - t0)
                faults[form].append(_faults() - f0)
    print(json.dumps({"memory": args.memory, "applied": applied,
                      "forms": {f: {"s_per_step": statistics.median(times[f]),
                                    "faults_per_step": statistics.median(faults[f])} for f in FORMS}}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="target (default: the project's default model)")
    p.add_argument("--kind", default="eagle3", choices=list(KINDS))
    p.add_argument("--layers", type=int, default=DistillConfig.layers,
                   help="draft: decoder layers kept from the target")
    p.add_argument("--answers", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="timed steps per form and child")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=3, help="rounds of the two children (default, keep)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--draft-vocab", type=int, default=DEFAULT_DRAFT_VOCAB, help="eagle3: the head's draft vocabulary")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="the student's matmuls (auto: distill's --train-dtype auto)")
    p.add_argument("--memory", choices=MEMORY, help=argparse.SUPPRESS)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="JSON (default bench_results/distill_step_KIND.json)")
    args = p.parse_args()
    from specdec.engine.gemm_select import cpu_model, native_bf16
    from specdec.models import default_model

    args.model = args.model or default_model()
    args.out = args.out or f"bench_results/distill_step_{args.kind}.json"
    if args.dtype == "auto":
        args.dtype = "bfloat16" if native_bf16() else "float32"
    if args.child:
        child(args)
        return

    from specdec.distill import teacher_data
    from specdec.distill_eagle3 import eagle3_layers
    from specdec.engine.checkpoint import load_hf_model
    from specdec.models import load_tokenizer, resolve_model

    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores, native bfloat16: {native_bf16()}); model {args.model}; "
          f"--kind {args.kind}; student matmuls {args.dtype}", flush=True)
    target = load_hf_model(args.model)
    cfg = DistillConfig(args.model, "unused", samples=args.answers, max_new_tokens=args.max_new_tokens,
                        threads=args.threads, kind="eagle3", teacher_temperature=TEACHER_TEMPERATURE)
    t0 = time.perf_counter()
    data = teacher_data(target, load_tokenizer(resolve_model(args.model)), cfg, lambda *_: None,
                        eagle3_layers(target))
    lengths = [len(t) for t in data["tokens"]]
    print(f"data: {len(lengths)} answers in {time.perf_counter() - t0:.0f} s, sequences of "
          f"{statistics.mean(lengths):.0f} tokens on average (max {max(lengths)})", flush=True)
    runs: dict[str, list[dict]] = {m: [] for m in MEMORY}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.pt"
        torch.save(data, path)
        for rep in range(args.reps):
            for memory in MEMORY:
                cmd = [sys.executable, __file__, "--child", str(path), "--memory", memory, "--model", args.model,
                       "--kind", args.kind, "--layers", str(args.layers),
                       "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch-size",
                       str(args.batch_size), "--threads", str(args.threads), "--draft-vocab",
                       str(args.draft_vocab), "--dtype", args.dtype]
                done = subprocess.run(cmd, capture_output=True, text=True, check=True)
                runs[memory].append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(f"round {rep + 1} {memory}: " + ", ".join(
                    f"{f} {r['s_per_step']:.3f} s" for f, r in runs[memory][-1]["forms"].items()), flush=True)
    base = statistics.median(r["forms"]["per-sequence"]["s_per_step"] for r in runs["default"])
    rows = []
    for memory in MEMORY:
        for form in FORMS:
            s = statistics.median(r["forms"][form]["s_per_step"] for r in runs[memory])
            pf = statistics.median(r["forms"][form]["faults_per_step"] for r in runs[memory])
            rows.append({"form": form, "memory": memory, "s_per_step": round(s, 4),
                         "steps_per_min": round(60 / s, 1), "faults_per_step": pf, "x_baseline": round(base / s, 2)})
    print(f"\n{'form':13s} {'malloc':8s} {'s/step':>7s} {'steps/min':>9s} {'faults/step':>11s} {'x base':>6s}")
    for r in rows:
        print(f"{r['form']:13s} {r['memory']:8s} {r['s_per_step']:7.3f} {r['steps_per_min']:9.1f} "
              f"{r['faults_per_step']:11.0f} {r['x_baseline']:6.2f}")
    print("(medians over rounds of each child's median step; x base: against per-sequence with glibc's defaults)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu_model(), "model": args.model, "kind": args.kind, "answers": len(lengths),
                               "mean_tokens": statistics.mean(lengths), "batch_size": args.batch_size,
                               "dtype": args.dtype, "threads": args.threads, "steps": args.steps,
                               "reps": args.reps, "rows": rows, "runs": runs}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
