"""``specdec distill``'s command line and configuration, apart from the
training code (specdec_cli/distill.py) so that every command's parser is
built without loading torch: importing distill.py for its parser cost each
process (scorer, proposer, gateway) ~1.9 s of its start."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

TEACHER_TEMPERATURE = 0.7  # the target's answers: near its greedy text, still varied
WARMUP_STEPS = 20  # the learning rate's linear warm-up (at most a tenth of --steps)
LR_SCHEDULES = ("cosine", "constant")
TRAIN_DTYPES = ("auto", "float32", "bfloat16")  # auto: bfloat16 autocast where it measures faster (distill_dtype)
TEACHER_DTYPES = TRAIN_DTYPES  # the target answering: auto = bfloat16 where it measures faster (distill_dtype)
KINDS = ("draft", "eagle3")
#: eagle3: target tokens kept in the head's draft vocabulary (capped at the target's)
DEFAULT_DRAFT_VOCAB = 4096
#: --lr's default per --kind. A draft's peak rate of 1e-3 beat 3e-4 on SmolLM2
#: (AMD EPYC, 2 cores, the s17 greedy answers, 4 layers, 4096-id head):
#: held-out mean accepted length at k=5 1.48 -> 1.67 after 300 steps, and
#: 1.94 after a 30-minute run (1010 steps; 3e-4 gave 1.74 in 984 steps on
#: another day). An eagle3 head's peak rate of 2e-3 beat 1e-3 and 3e-4 on
#: SmolLM2 (2 cores of an Intel Xeon, CPU model 207; the same 2400 answers,
#: 2024 steps each, the count a 30-minute run trains there): held-out mean
#: accepted length at k=5 2.142 against 2.102 and 1.925
#: (benchmarks/bench_distill_lr.py; sixty-fourth session, README).
DEFAULT_LR = {"draft": 1e-3, "eagle3": 2e-3}
#: --batch-size's default per --kind (answers a training step reads). An
#: eagle3 head learns more per answer read in small batches: on SmolLM2 (2
#: cores of an Intel Xeon, CPU model 207; the same 2400 answers, 6400 of
#: them read, peak rate 2e-3) 800 steps of 8, 1600 of 4 and 3200 of 2 gave
#: held-out 1.964 / 1.976 / 2.039 on the 48 held-out prompts after the
#: command's 8 (seed 1: 1.951 / 2.005 / 2.026), at 0.074 / 0.078 / 0.087 s an
#: answer; the 30-minute command at batch 2 gave 2.152 there against 2.095
#: for 2024 steps of 8. Measured by throwaway runs that train and measure as
#: benchmarks/bench_distill_lr.py --batch-sizes --more-held-out 48 does
#: (sixty-fifth session, README).
DEFAULT_BATCH = {"draft": 8, "eagle3": 2}


@dataclass(frozen=True)
class DistillConfig:
    target: str
    out: str
    # a draft's decoder layers, kept from the target. 2 reached the held-out
    # acceptance of 4 in a 30-minute SmolLM2 run (1.95 in 2179 steps against
    # 1.94 in 1010, the same greedy answers and rate) and costs less a round
    # (bench_draft chat, k=5: 6.9 against 10.0 ms of proposer time, separate
    # runs; AMD EPYC, 2 cores, twentieth session)
    layers: int = 2
    minutes: float = 20.0
    steps: int = 0  # 0: until the time budget ends
    samples: int = 0  # target answers generated; 0: as many as fit in distill.AUTO_DATA_SHARE of --minutes
    max_new_tokens: int = 128
    batch_size: int = DEFAULT_BATCH["draft"]  # the command line's default depends on --kind (DEFAULT_BATCH)
    lr: float = DEFAULT_LR["draft"]  # the command line's default depends on --kind (DEFAULT_LR)
    seed: int = 0
    device: str = "cpu"
    threads: int = 1  # torch threads (1 is fastest for small drafts on a shared machine)
    kind: str = "draft"  # "draft": a small LM (layers of the target); "eagle3": an EAGLE-3 head
    # draft: > 0 reduces the draft's head to this many target ids (draft_vocab.json), 0 keeps the full head;
    # eagle3: the head's draft vocabulary (0: DEFAULT_DRAFT_VOCAB)
    draft_vocab: int = 0
    teacher_temperature: float = TEACHER_TEMPERATURE  # the target's answers; 0: greedy (argmax)
    lr_schedule: str = "cosine"  # LR_SCHEDULES
    train_dtype: str = "auto"  # TRAIN_DTYPES: the student's matmuls (weights and optimiser stay float32)
    teacher_dtype: str = "auto"  # TEACHER_DTYPES: the target's weights and activations while it answers


def add_parser(sub) -> None:
    p = sub.add_parser("distill", help="train a small draft model or an EAGLE-3 head for a target (offline)")
    p.add_argument("--target", required=True, help="the target model (HF id, directory or .gguf)")
    p.add_argument("--out", required=True, help="output directory (a Hugging Face checkpoint, or an EAGLE-3 "
                                                "head in the public layout)")
    p.add_argument("--kind", default="draft", choices=list(KINDS),
                   help="draft: a small LM made of target layers; eagle3: an EAGLE-3 head (serve with --eagle3)")
    p.add_argument("--layers", type=int, default=DistillConfig.layers,
                   help="draft: decoder layers kept from the target")
    p.add_argument("--minutes", type=float, default=DistillConfig.minutes,
                   help="time budget: the target's answers plus training (the acceptance measurement follows)")
    p.add_argument("--steps", type=int, default=0,
                   help="train exactly this many steps (reproducible with --samples N); 0: until --minutes")
    p.add_argument("--samples", type=int, default=DistillConfig.samples,
                   help="target answers to train on; 0 (default): as many as the target makes in half of --minutes "
                        "(the model card's command then names the count made, which gives the same data again)")
    p.add_argument("--max-new-tokens", type=int, default=DistillConfig.max_new_tokens)
    p.add_argument("--batch-size", type=int, default=None,
                   help="answers a training step reads (default: " + ", ".join(
                       f"{kind} {batch}" for kind, batch in DEFAULT_BATCH.items()) + ")")
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default: " + ", ".join(f"{kind} {lr:g}" for kind, lr in DEFAULT_LR.items())
                   + ")")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", choices=["cpu"], help="training device (CPU only for now)")
    p.add_argument("--threads", type=int, default=DistillConfig.threads, help="torch threads")
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="draft: > 0 keeps this many target ids in the draft's head (written to draft_vocab.json; "
                        "a draft step then computes a smaller head), 0 the full vocabulary; eagle3: the head's "
                        f"draft vocabulary, the most frequent target tokens in the data (0: {DEFAULT_DRAFT_VOCAB})")
    p.add_argument("--teacher-temperature", type=float, default=TEACHER_TEMPERATURE,
                   help="temperature of the target's training answers; 0: its greedy answers (the text greedy "
                        "requests are served, so drafts for greedy serving learn exactly it)")
    p.add_argument("--lr-schedule", default=DistillConfig.lr_schedule, choices=list(LR_SCHEDULES),
                   help=f"cosine: warm up over {WARMUP_STEPS} steps, then decay to 0 at the end of --steps or "
                        "--minutes; constant: --lr throughout")
    p.add_argument("--train-dtype", default=DistillConfig.train_dtype, choices=list(TRAIN_DTYPES),
                   help="the student's matmuls: auto = bfloat16 (autocast; weights and optimiser stay float32) "
                        "where the CPU has native bfloat16 and a few timed steps run faster in it (the verdict "
                        "is cached per CPU and shape), else float32")
    p.add_argument("--teacher-dtype", default=DistillConfig.teacher_dtype, choices=list(TEACHER_DTYPES),
                   help="the target's dtype while it answers (the data phase): auto = bfloat16 where the CPU has "
                        "native bfloat16 and a few timed decode steps of the answering engine run faster in it "
                        "(the verdict is cached per CPU and target; a resumed run keeps its answers' dtype), "
                        "else float32; the acceptance measurement always uses the target as loaded")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")


def config_from_args(args) -> DistillConfig:
    lr = DEFAULT_LR[args.kind] if args.lr is None else args.lr
    batch_size = DEFAULT_BATCH[args.kind] if args.batch_size is None else args.batch_size
    return DistillConfig(args.target, args.out, args.layers, args.minutes, args.steps, args.samples,
                         args.max_new_tokens, batch_size, lr, args.seed, args.device, args.threads,
                         args.kind, args.draft_vocab, args.teacher_temperature, args.lr_schedule,
                         args.train_dtype, args.teacher_dtype)


def distill_command(args) -> int:
    cfg = config_from_args(args)
    if not math.isfinite(cfg.minutes) or cfg.minutes <= 0 or cfg.steps < 0 or cfg.samples < 0 or cfg.draft_vocab < 0:
        raise SystemExit("--minutes must be > 0, --steps >= 0, --samples >= 0 (0: for half of --minutes), "
                         "--draft-vocab >= 0")
    if not math.isfinite(cfg.lr) or cfg.lr <= 0:
        raise SystemExit(f"--lr must be > 0, got {cfg.lr}")
    if cfg.batch_size < 1:
        raise SystemExit(f"--batch-size must be >= 1, got {cfg.batch_size}")
    if not math.isfinite(cfg.teacher_temperature) or cfg.teacher_temperature < 0:
        raise SystemExit(f"--teacher-temperature must be >= 0 (0: greedy answers), got {cfg.teacher_temperature}")
    from specdec.distill import distill  # (torch and the engine: only this command loads them)

    card = distill(cfg, resume=args.resume)
    print(json.dumps(card))
    return 0
