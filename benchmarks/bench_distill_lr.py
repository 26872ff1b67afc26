"""Held-out acceptance of ``specdec distill`` by peak learning rate and
batch size, at a fixed number of training steps on the same answers.

A distill run keeps its training data (the target's answers, their top-K
distributions and, for an eagle3 head, the target's features) in
``DIR/distill-data.pt``. This trains a fresh student on that data for
--steps steps at each --lrs rate and each --batch-sizes size (a later size
trains on as many answers as the first: --steps x first / size steps), one
after the other in this process, each
exactly as the command trains (``distill._student``, AdamW, the warm-up and
cosine of ``distill.lr_at`` over the steps, ``distill_dtype.optimizer_step``
in --train-dtype, the same seed and batch order), then measures the held-out
mean accepted length at k=5 as the command's last step does (its 8
held-out prompts), and with --more-held-out N on the N held-out prompts
that follow them in the recipe's order: 8 prompts (~250 rounds) tell two
heads apart only by ~0.05, more prompts by less. With --steps
fixed the figures do not depend on the machine's speed that day (a
30-minute run's steps do): the same data, seed and steps give the same
head. Prints the CPU model and a table; writes JSON.

    specdec distill --target M --out DIR --kind eagle3 --minutes 30 --samples 2400 ...   # the data
    python benchmarks/bench_distill_lr.py --data DIR --steps 2024 --lrs 3e-4,1e-3,2e-3
    python benchmarks/bench_distill_lr.py --data DIR --steps 800 --lrs 2e-3 --batch-sizes 8,4,2

Writes --out (default bench_results/distill_lr.json).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    from specdec.distill_args import DEFAULT_BATCH, KINDS, DistillConfig

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="a distill run's --out directory (or its distill-data.pt)")
    p.add_argument("--model", default=None, help="the target (default: the project's default model)")
    p.add_argument("--kind", default="eagle3", choices=list(KINDS))
    p.add_argument("--layers", type=int, default=DistillConfig.layers, help="draft: decoder layers")
    p.add_argument("--draft-vocab", type=int, default=0, help="as distill's --draft-vocab")
    p.add_argument("--steps", type=int, default=2024, help="training steps at each rate (of the first batch size)")
    p.add_argument("--lrs", default="3e-4,1e-3,2e-3", help="peak learning rates, comma-separated")
    p.add_argument("--batch-sizes", default=None,
                   help="answers a step reads, comma-separated; a later size trains on as many answers as the "
                        "first (default: the kind's, " + ", ".join(f"{k} {b}" for k, b in DEFAULT_BATCH.items())
                        + ")")
    p.add_argument("--seed", type=int, default=DistillConfig.seed)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--train-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--held-out-tokens", type=int, default=64,
                   help="tokens of each held-out answer (distill: min(--max-new-tokens, 64))")
    p.add_argument("--more-held-out", type=int, default=0,
                   help="also measure on this many held-out prompts after the command's (0: none; up to "
                        "the held-out topics' count less the command's)")
    p.add_argument("--save", default=None, help="keep each head / draft in SAVE/batch-B-lr-RATE (default: none kept)")
    p.add_argument("--out", default="bench_results/distill_lr.json")
    args = p.parse_args()
    try:
        lrs = [float(x) for x in args.lrs.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--lrs: comma-separated numbers, got {args.lrs!r}") from None
    if not lrs or any(not lr > 0 for lr in lrs):
        raise SystemExit(f"--lrs: rates must be > 0, got {args.lrs!r}")
    try:
        batches = [int(x) for x in (args.batch_sizes or str(DEFAULT_BATCH[args.kind])).split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--batch-sizes: comma-separated integers, got {args.batch_sizes!r}") from None
    if not batches or any(b < 1 for b in batches):
        raise SystemExit(f"--batch-sizes: sizes must be >= 1, got {args.batch_sizes!r}")
    if args.steps < 1:
        raise SystemExit(f"--steps must be >= 1, got {args.steps}")
    if args.held_out_tokens < 1:
        raise SystemExit(f"--held-out-tokens must be >= 1, got {args.held_out_tokens}")
    if args.more_held_out < 0:
        raise SystemExit(f"--more-held-out must be >= 0, got {args.more_held_out}")

    from specdec import distill_dtype
    from specdec.distill import (
        ACCEPTANCE_K,
        DATA_FILE,
        HELD_OUT_PROMPTS,
        HELD_OUT_TOPICS,
        _student,
        draft_vocab,
        held_out_prompts,
        lr_at,
        mean_accepted_length,
        prompts,
        trainable,
    )
    from specdec.engine.checkpoint import load_hf_model
    from specdec.engine.gemm_select import cpu_model, native_bf16, set_torch_threads
    from specdec.engine.memory import keep_freed_memory
    from specdec.models import default_model, load_tokenizer, resolve_model

    path = Path(args.data)
    path = path / DATA_FILE if path.is_dir() else path
    if not path.exists():
        raise SystemExit(f"--data: {path} does not exist (run specdec distill first; it writes {DATA_FILE})")
    model = args.model or default_model()
    set_torch_threads(args.threads)
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores, native bfloat16: {native_bf16()}); model {model}; "
          f"--kind {args.kind}; {args.steps} steps of batch {batches[0]} at each rate (batch b: the same "
          f"answers in {args.steps} x {batches[0]} / b steps), batch sizes {batches}; "
          f"matmuls {args.train_dtype}", flush=True)
    target = load_hf_model(model)
    tokenizer = load_tokenizer(resolve_model(model))
    data = torch.load(path, weights_only=False)["data"]
    if args.kind == "eagle3" and "features" not in data:
        raise SystemExit(f"--data: {path} has no target features: a --kind draft run made it (use --kind draft)")
    keep_freed_memory()
    dtype = getattr(torch, args.train_dtype)
    held_out = held_out_prompts(tokenizer)
    more = prompts(tokenizer, HELD_OUT_TOPICS)[HELD_OUT_PROMPTS:HELD_OUT_PROMPTS + args.more_held_out]
    if len(more) < args.more_held_out:
        raise SystemExit(f"--more-held-out: at most {len(more)} held-out prompts follow the command's "
                         f"{HELD_OUT_PROMPTS} for this tokenizer, got {args.more_held_out}")
    print(f"data: {len(data['tokens'])} answers from {path}", flush=True)
    rows = []
    for batch_size, lr in ((b, lr) for b in batches for lr in lrs):
        steps = max(1, round(args.steps * batches[0] / batch_size))
        cfg = DistillConfig(model, "unused", layers=args.layers, steps=steps, batch_size=batch_size,
                            lr=lr, seed=args.seed, threads=args.threads, kind=args.kind,
                            draft_vocab=args.draft_vocab)
        torch.manual_seed(cfg.seed)  # as distill: the student's initial weights, then the batch order
        head_ids = draft_vocab(data, tokenizer, cfg.draft_vocab) if cfg.kind == "draft" and cfg.draft_vocab \
            else None
        student, loss_of = _student(cfg, target, data, head_ids)
        params = trainable(student)
        optimizer = torch.optim.AdamW(params, lr=lr)
        order = torch.randperm(len(data["tokens"]), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
        losses, started = [], time.perf_counter()
        for step in range(cfg.steps):
            batch = [order[(step * cfg.batch_size + i) % len(order)] for i in range(cfg.batch_size)]
            for group in optimizer.param_groups:
                group["lr"] = lr_at(cfg, step, step / cfg.steps)
            loss, _ = distill_dtype.optimizer_step(params, optimizer,
                                                   functools.partial(loss_of, student, data, batch), dtype)
            losses.append(loss.item())
            if (step + 1) % 100 == 0 or step + 1 == cfg.steps:
                per_step = (time.perf_counter() - started) / (step + 1)
                print(f"  batch {batch_size}, lr {lr:g}: step {step + 1}/{cfg.steps}, loss (last 100) "
                      f"{statistics.mean(losses[-100:]):.4f}, {per_step:.3f} s a step", flush=True)
        train_s = time.perf_counter() - started
        student.eval()
        with tempfile.TemporaryDirectory() as tmp:
            where = Path(args.save) / f"batch-{batch_size}-lr-{lr:g}" if args.save else Path(tmp)
            where.mkdir(parents=True, exist_ok=True)
            if cfg.kind == "eagle3":
                from specdec.distill_eagle3 import eagle3_accepted_length

                student.save(where)

                def measure(prompt_ids):
                    return eagle3_accepted_length(target, where, model, prompt_ids, ACCEPTANCE_K,
                                                  args.held_out_tokens)
            else:
                if args.save:
                    student.save_pretrained(where)

                def measure(prompt_ids):
                    return mean_accepted_length(target, student, tokenizer, max_new_tokens=args.held_out_tokens,
                                                head_ids=head_ids, prompt_ids=prompt_ids)
            accepted = measure(held_out)
            accepted_more = measure(more) if more else None
        rows.append({"batch_size": batch_size, "lr": lr, "steps": cfg.steps, "train_s": round(train_s, 1),
                     "s_per_step": round(train_s / cfg.steps, 4),
                     "final_loss_last100": round(statistics.mean(losses[-100:]), 4),
                     "held_out_accepted_k5": round(accepted, 4),
                     "more_held_out_accepted_k5": None if accepted_more is None else round(accepted_more, 4)})
        print(f"batch {batch_size}, lr {lr:g}: held-out mean accepted length at k={ACCEPTANCE_K} {accepted:.3f}"
              + (f"; on {len(more)} more held-out prompts {accepted_more:.3f}" if more else ""), flush=True)
    print(f"\n{'batch':>5s} {'peak lr':>8s} {'steps':>6s} {'s/step':>7s} {'train s':>8s} {'loss (last 100)':>16s} "
          f"{'held-out k=5':>13s}" + (f" {f'{len(more)} more':>8s}" if more else ""))
    for r in rows:
        print(f"{r['batch_size']:5d} {r['lr']:8g} {r['steps']:6d} {r['s_per_step']:7.3f} {r['train_s']:8.1f} "
              f"{r['final_loss_last100']:16.4f} {r['held_out_accepted_k5']:13.3f}"
              + (f" {r['more_held_out_accepted_k5']:8.3f}" if more else ""))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu_model(), "model": model, "data": str(path), "kind": args.kind,
                               "answers": len(data["tokens"]), "batch_sizes": batches,
                               "train_dtype": args.train_dtype, "threads": args.threads, "seed": args.seed,
                               "held_out_prompts": len(held_out), "more_held_out_prompts": len(more),
                               "held_out_tokens": args.held_out_tokens, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
