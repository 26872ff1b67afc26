"""``specdec distill``: make a small draft model (``--kind draft``) or an
EAGLE-3 head (``--kind eagle3``, ``distill_eagle3``) for a target that has none.

Recipe (all offline; nothing but the target and this package is needed):

1. data: prompts the recipe generates from fixed word lists (instructions
   for a chat model, story openings otherwise), answered by the *target
   itself* (sampled at ``--teacher-temperature``, seeded; 0 = its greedy
   answers, the text greedy serving drafts for), ``TEACHER_BATCH``
   answers at a time through the serving engine in ``--teacher-dtype``
   (``teacher_dtype``); the target's top-``TEACHER_TOP_K``
   next-token distribution at every answer position is kept;
2. student: the target's embeddings, final norm and LM head plus ``--layers``
   of its decoder layers (evenly spaced, first and last included); the
   embeddings and head stay frozen (the draft keeps the target's token space,
   and a step costs a third less); with ``--draft-vocab N`` the student's
   logits and the teacher's distribution are both restricted to the N ids
   the served head keeps (``head_targets``), so training computes the head
   the proposer serves, at N/V of the full head's cost;
3. training: cross-entropy of the student against the target's (top-K,
   renormalised) distribution, AdamW, until ``--steps`` or until
   ``--minutes`` (counted from the start of step 1, data included) are up;
   the learning rate warms up over ``WARMUP_STEPS`` and then follows a
   cosine to 0 at the end of the budget (``lr_at``; ``--lr-schedule
   constant`` keeps it); matmuls in bfloat16 with float32 weights and
   optimiser (autocast) where that measured faster (``--train-dtype``,
   ``distill_dtype``);
   a checkpoint (student, optimiser, step; the data is written once
   beside it, ``DATA_FILE``) every ``CHECKPOINT_EVERY_S`` seconds, so ``--resume`` loses at most that
   (also while step 1 makes the data: the finished answers are kept, each
   written once, in parts, ``ANSWERS_PART``, removed once the data is whole);
4. acceptance: greedy speculation simulated on held-out prompts (target
   greedy answers, student drafts of k tokens), printed and written to the
   model card;
5. output: a standard Hugging Face checkpoint (config.json,
   model.safetensors, tokenizer files) plus README.md, the model card, and
   with ``--draft-vocab N`` a draft_vocab.json keeping N target ids in the
   draft's head (the draft proposer then computes only those rows).

``--kind eagle3`` keeps steps 1, 3 and 5's shape with an EAGLE-3 head as the
student (its features, draft vocabulary, chained loss and public layout are
described in ``distill_eagle3``); its acceptance is measured with the saved
head served by the proposer's own code.

A fixed ``--seed`` with a fixed ``--steps`` gives the same draft (also
across an interrupted run resumed with ``--resume``).
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from specdec import distill_dtype
from specdec.distill_args import DEFAULT_DRAFT_VOCAB, WARMUP_STEPS, DistillConfig
from specdec.proposer_svc.draft_model import DRAFT_VOCAB_FILE

TEACHER_TOP_K = 32  # target probabilities kept per position
#: target answers generated at once (one engine forward per token of all of
#: them). SmolLM2 on 2 cores (AMD EPYC family 26), ``python
#: benchmarks/bench_teacher.py --answers 768``: float32 603 tokens/s at 32,
#: 678 at 128; bfloat16 757 at 32, 744 at 128 (that row's peak RSS 9 GB
#: against 3: bfloat16 through oneDNN at 128 sometimes holds far more
#: memory). The 30-minute eagle3 distill answered at ~910 tokens/s in
#: bfloat16 at 128, against ~585 in float32 at 32 in an earlier session
TEACHER_BATCH = 128
#: the rows a forward the teacher's GEMM path is chosen for (``teacher_engine``):
#: fixed, not the number in flight, so that no run (resumed, or with fewer
#: answers to make) answers through another path, and so with other bits
TEACHER_GEMM_ROWS = {TEACHER_BATCH: 1.0}
CHECKPOINT_EVERY_S = 60.0
CHECKPOINT_FILE = "distill-checkpoint.pt"
#: the finished data, written once beside the checkpoint, which then holds
#: only the training state (a checkpoint that held the data rewrote it every
#: minute: ~3.7 GB for an eagle3 run's 6500 answers and their features;
#: 1.5 GB took 1.2 s to save on an AMD EPYC)
DATA_FILE = "distill-data.pt"
#: while the target answers, each checkpoint writes the answers finished
#: since the one before to a part of its own and names every part: an answer
#: is written once (a checkpoint that held them all rewrote every answer
#: made so far each minute, up to ~3.7 GB a save in an 85-minute eagle3 run)
ANSWERS_PART = "distill-answers-{:05d}.pt"
ACCEPTANCE_K = 5  # draft length of the final acceptance measurement
#: --samples 0 (the default): the target answers for this share of --minutes
#: (answers in flight then finish), training gets the rest. A fixed count
#: spends a machine-dependent share: 2600 SmolLM2 answers took 17.2 minutes
#: on one 2-core AMD EPYC and 8.6 on a newer one (CPU family 26). There a
#: 30-minute eagle3 head reached held-out 2.13 with half (4758 answers, 1800
#: steps) against 2.02 with the 2600 (2489 steps); with the teacher faster
#: since, 0.6 gave 1.98 (7083 answers, 1219 steps) against 0.5's 2.06 (6150,
#: 1810) on the same machine kind a day apart (fortieth session)
AUTO_DATA_SHARE = 0.5
#: --samples 0 with sampled answers: at most this many times the recipe's
#: prompts (each prompt answered anew with its own seed); greedy answers
#: stop at one per prompt (a second would be the same text)
AUTO_ANSWERS_PER_PROMPT = 8

TOPICS = ["rivers", "a lost key", "the moon", "baking bread", "a small robot", "winter", "friendship",
          "learning to swim", "a busy city", "the ocean", "an old map", "gardening", "a rainy day",
          "music", "a mountain trip", "honey bees", "a new school", "the stars", "cooking pasta", "a storm",
          "a train journey", "saving money", "a haunted house", "playing chess", "the first day of spring",
          "a lighthouse keeper", "recycling", "a lost puppy", "healthy breakfast", "a dragon", "the internet",
          "writing a letter", "an island", "a football match", "time management", "a snowman",
          "the solar system", "a kind neighbour", "camping in the woods",
          # everyday life, work, science and places: the instructions below turn each into many requests
          "drinking enough water", "a job interview", "moving to a new town", "learning a language",
          "riding a bicycle", "a birthday gift", "public transport", "a rainy weekend at home", "cleaning the kitchen",
          "a first day at work", "electric cars", "the water cycle", "photosynthesis", "earthquakes",
          "how airplanes fly", "dinosaurs", "the human heart", "vaccines", "clouds", "magnets", "rainbows",
          "the history of paper", "ancient Egypt", "the printing press", "computers", "smartphones",
          "video games", "social media", "a team project", "a difficult decision", "running a marathon",
          "yoga", "a farmers market", "coffee", "tea", "chocolate", "a vegetable garden", "a wedding",
          "a museum visit", "a road trip", "a broken phone", "an old photograph", "a lazy cat", "a brave knight",
          "a space station", "a pirate ship", "a talking tree", "a secret door", "a village festival",
          "the northern lights", "penguins", "elephants", "owls", "forests", "deserts at night", "a waterfall",
          "a quiet morning", "making friends", "being patient", "saying sorry", "public speaking",
          "studying for exams", "budgeting for a holiday", "a small business", "customer service",
          "climate change", "solar power", "a new hobby", "painting", "playing the guitar", "reading books"]
HELD_OUT_TOPICS = ["a quiet library", "volcanoes", "a birthday party", "the desert"]
INSTRUCTIONS = ["Write a short story about {}.", "Explain {} to a child.", "Give three tips about {}.",
                "Write a poem about {}.", "Describe {} in a few sentences.",
                "What should I know about {}?", "Write a short letter to a friend about {}.",
                "List five facts about {}.", "Why do people care about {}?",
                "Write a short conversation between two people about {}.",
                "How would you explain {} step by step?", "Summarize {} in one paragraph.",
                "Write a diary entry about {}.", "What are the good and bad sides of {}?",
                "Give me some advice about {}.",
                # everyday requests of other kinds (practical, factual, messages): a draft trained on the
                # kinds above alone accepted 1.9-2.5 on stories, poems and diaries but 1.4-1.7 on
                # explanations, tips and emails (twenty-first session)
                "Write a short email to a colleague about {}.", "How do I get started with {}?",
                "Explain how {} works.", "What are some common mistakes people make with {}?",
                "Write a short speech about {}.", "What is the most interesting thing about {}?",
                "Make a simple checklist for {}.", "Write a short news report about {}.",
                "Give me a step-by-step guide to {}.", "Answer in two sentences: why does {} matter?"]
STORY_OPENINGS = ["Once upon a time, there was {}.", "One day, a girl found {}.", "Tom liked {}.",
                  "The little dog saw {}.", "Lily and her mom talked about {}."]
#: the recipe's prompts are asked in this seeded order (not cfg.seed: the data set is the recipe's), so that
#: any number of samples spreads over topics and instructions
PROMPT_ORDER_SEED = 1234
#: held-out prompts of the final acceptance measurement (spread over the held-out topics and instructions)
HELD_OUT_PROMPTS = 8


def prompts(tokenizer, topics: list[str]) -> list[list[int]]:
    """The recipe's prompts for ``topics`` as token ids, in the recipe's
    seeded order: chat instructions when the tokenizer has a chat template,
    story openings otherwise."""
    if getattr(tokenizer, "chat_template", None):
        texts = [i.format(t) for t in topics for i in INSTRUCTIONS]
        rendered = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                  tokenize=False) for t in texts]
        encoded = [list(tokenizer(r, add_special_tokens=False)["input_ids"]) for r in rendered]  # as the gateway
    else:
        encoded = [list(tokenizer(o.format(t))["input_ids"]) for t in topics for o in STORY_OPENINGS]
    order = torch.randperm(len(encoded), generator=torch.Generator().manual_seed(PROMPT_ORDER_SEED))
    return [encoded[i] for i in order.tolist()]


def prompts_digest(prompt_ids: list[list[int]]) -> str:
    """A short fingerprint of the recipe's prompts in their order: a
    checkpoint's answer i is only taken back (``--resume``) for the same
    prompt i."""
    return hashlib.sha256(json.dumps(prompt_ids).encode()).hexdigest()[:16]


def held_out_prompts(tokenizer) -> list[list[int]]:
    """The final acceptance measurement's prompts: ``HELD_OUT_PROMPTS`` of the
    held-out topics' (no training prompt names those topics)."""
    return prompts(tokenizer, HELD_OUT_TOPICS)[:HELD_OUT_PROMPTS]


def student_from_target(target, layers: int):
    """A float32 copy of the target keeping ``layers`` evenly spaced decoder
    layers (first and last included) and all of its embeddings, norm and head;
    the embeddings and head are frozen (``trainable`` lists what trains)."""
    import copy

    n = target.config.num_hidden_layers
    if not 1 <= layers <= n:
        raise ValueError(f"--layers: must be in 1..{n}, got {layers}")
    keep = sorted({round(i * (n - 1) / max(layers - 1, 1)) for i in range(layers)})
    student = copy.deepcopy(target)
    if getattr(student, "hf_quantizer", None) is not None:  # GGUF: dequantised on load, the copy is plain float
        student.hf_quantizer, student.is_quantized, student.quantization_method = None, False, None
        if hasattr(student.config, "quantization_config"):
            del student.config.quantization_config
    student.model.layers = torch.nn.ModuleList([student.model.layers[i] for i in keep])
    for j, layer in enumerate(student.model.layers):
        layer.self_attn.layer_idx = j
    student.config.num_hidden_layers = len(keep)
    if getattr(student.config, "layer_types", None):
        student.config.layer_types = [student.config.layer_types[i] for i in keep]
    for frozen in (student.get_input_embeddings(), student.get_output_embeddings()):
        frozen.weight.requires_grad_(False)  # the target's token space stays; only the layers learn
    return student.train()


def trainable(student) -> list[torch.nn.Parameter]:
    return [p for p in student.parameters() if p.requires_grad]


def lr_at(cfg: DistillConfig, step: int, progress: float) -> float:
    """The learning rate of training step ``step`` (0-based) when ``progress``
    (0..1) of the budget is spent (steps done / --steps, or training time /
    the time --minutes leaves it): a linear warm-up over ``WARMUP_STEPS``
    (at most a tenth of --steps), then a cosine from --lr to 0 at the end of
    the budget; "constant" keeps --lr."""
    if cfg.lr_schedule == "constant":
        return cfg.lr
    warmup = min(WARMUP_STEPS, cfg.steps // 10) if cfg.steps else WARMUP_STEPS
    ramp = min(1.0, (step + 1) / warmup) if warmup else 1.0
    return cfg.lr * ramp * 0.5 * (1.0 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))


def teacher_dtype(cfg: DistillConfig, target, log: Callable[[str], None] = lambda _: None,
                  made_with: str | None = None) -> str:
    """The dtype the target answers in (--teacher-dtype) where the Llama
    runner runs it; the transformers fallback keeps the loaded model's.
    ``auto``: the dtype of the answers a resumed run already has
    (``made_with``), else float32 on a CPU without native bfloat16 (emulated
    bfloat16 is slower, not faster), else the one whose decode steps measure
    faster on this machine (``measured_teacher_dtype``). bfloat16 answers
    differ from float32's little: greedy tokens agree at 97.4 % of 2246
    sampled answer positions, mean KL(float32 || bfloat16) 0.0011 nats
    (twenty-fifth session). The acceptance measurement uses the target as
    loaded."""
    from specdec.engine.llama import unsupported_reason

    if unsupported_reason(target.config):
        return str(target.dtype).removeprefix("torch.")
    if cfg.teacher_dtype != "auto":
        return cfg.teacher_dtype
    return made_with or measured_teacher_dtype(cfg, target, log)


def answered_in(recipe: dict | None) -> str | None:
    """The dtype the answers a checkpoint keeps were made in (its recipe's;
    float32 for answers kept before --teacher-dtype existed); None: none kept."""
    return None if recipe is None else str(recipe.get("--teacher-dtype", "float32"))


#: --teacher-dtype auto's verdicts taken in this process (key -> dtype): the
#: data and the model card ask once each
_TEACHER_VERDICTS: dict[str, str] = {}
#: --teacher-dtype auto times decode steps this many tokens into each answer's context: few, as the prefill
#: is not what it times (48 took 7-18 s of a 27 s measurement, SmolLM2; attention over a longer context is a
#: small share of a step's work)
TEACHER_PROBE_TOKENS = 8
#: the decode steps it times at most, per dtype
PROBE_STEPS = distill_dtype.ROUNDS * (distill_dtype.TEACHER_WARM + distill_dtype.TEACHER_TIMED)


def measured_teacher_dtype(cfg: DistillConfig, target, log: Callable[[str], None]) -> str:
    """``--teacher-dtype auto`` on the Llama runner: ``distill_dtype.choose_teacher``
    timing decode steps of the teacher's own engine (``teacher_engine``,
    ``TEACHER_BATCH`` answers in flight, with the features the student
    reads) in each dtype. Native bfloat16 is not faster everywhere: on 2
    cores of an AMD EPYC (family 26) it answered ~1.25x faster than float32
    (``bench_teacher.py --answers 768``: 757 against 603 tokens/s at 32 in
    flight); on 2 cores of an Intel Xeon with AVX512-BF16 and no AMX (family
    6, model 207) 339 against 421 at 128 (``bench_teacher.py --answers 384
    --widths 128 --dtypes float32,bfloat16``), where the CPU's flags alone
    had chosen bfloat16. The verdict is cached on disk per CPU, torch,
    threads and target, so a seed gives the same answers on that machine."""
    from specdec.engine.gemm_select import set_torch_threads

    layers = _feature_layers(cfg, target)
    key = {"target": str(cfg.target), "answers": TEACHER_BATCH, "feature_layers": list(layers),
           "config": hashlib.sha256(target.config.to_json_string(use_diff=False).encode()).hexdigest()[:16]}
    threads = torch.get_num_threads()
    set_torch_threads(cfg.threads)  # the threads the answers run on, which the verdict is keyed by
    try:
        memo = json.dumps({**distill_dtype.machine_key(), **key}, sort_keys=True)
        if memo not in _TEACHER_VERDICTS:
            engines: dict[str, object] = {}
            step_seconds = functools.partial(_teacher_step_seconds, target, cfg, layers, engines)
            _TEACHER_VERDICTS[memo] = distill_dtype.choose_teacher(key, step_seconds, log)
        return _TEACHER_VERDICTS[memo]
    finally:
        set_torch_threads(threads)


@torch.inference_mode()
def _teacher_step_seconds(target, cfg: DistillConfig, layers: tuple[int, ...], engines: dict, dtype: str,
                          steps: int) -> list[float]:
    """Seconds of each of ``steps`` decode steps of the teacher's engine in
    ``dtype`` with ``TEACHER_BATCH`` answers in flight. The engine is built
    once into ``engines``, its answers ``TEACHER_PROBE_TOKENS`` seeded token
    ids into their contexts (prefilled once, not timed); each call's steps
    go on from the last's (room for ``PROBE_STEPS``)."""
    from specdec.engine.base import ForwardItem

    seqs = [f"probe-{i}" for i in range(TEACHER_BATCH)]
    vocab = target.config.vocab_size
    if dtype not in engines:
        length = TEACHER_PROBE_TOKENS + PROBE_STEPS
        engine = teacher_engine(target, cfg.target, dtype, TEACHER_BATCH * (length + 64), cfg.threads)
        rng = np.random.default_rng(0)
        for seq in seqs:
            engine.ensure_capacity(seq, length)
        engine.forward([ForwardItem(seq, rng.integers(0, vocab, TEACHER_PROBE_TOKENS).astype(np.int32), 1)
                        for seq in seqs], feature_layers=layers)
        engines[dtype] = engine, rng
    engine, rng = engines[dtype]
    seconds = []
    for _ in range(steps):
        feed = rng.integers(0, vocab, len(seqs)).astype(np.int32)
        start = time.perf_counter()
        engine.forward([ForwardItem(seq, feed[i:i + 1], 1) for i, seq in enumerate(seqs)], feature_layers=layers)
        seconds.append(time.perf_counter() - start)
    return seconds


@torch.inference_mode()
def teacher_data(target, tokenizer, cfg: DistillConfig, log, feature_layers: tuple[int, ...] = (),
                 resume: dict | None = None, save: Callable[[dict], None] | None = None,
                 deadline: float | None = None) -> dict:
    """Target answers to the recipe's prompts and the target's top-K
    next-token distribution (its logits as it generated, before temperature)
    at every answer position: row ``j`` of top_ids/top_logp predicts token
    ``start + j + 1``.
    Returns {"tokens": [list[int]], "start": [int] (last prompt position),
    "top_ids": [int32 [m, K]], "top_logp": [float32 [m, K]]}, and with
    feature_layers "features": [bfloat16 [len(tokens) - 1, len(feature_layers)
    * hidden]], the target's hidden states after those layers at every
    position but the last, from the same forwards (as the scorer computes
    and sends them: no second pass over the data); answer i of the list
    answers prompt i of the recipe's order.

    The answers come from the serving engine (``teacher_engine``: the Llama
    runner where it runs the target), ``TEACHER_BATCH`` of them in flight:
    a finished answer's place goes to the next prompt at once. On 2 cores
    that makes ~4x the tokens per minute of ``transformers.generate`` in
    batches of 8, so the same minutes give the student far more text.

    Answer i draws its tokens with uniforms of its own generator (seeded by
    cfg.seed and i, ``answer_generator``), and the engine's rows do not
    depend on the batch, so an answer is the same whatever else is in
    flight: a seed gives the same data, and so does a run resumed from a
    checkpoint. cfg.samples answers, or with cfg.samples 0 the answers
    begun before ``deadline`` (``time.monotonic()``; prompts 0, 1, ... in
    the recipe's order, at most ``_auto_limit``), then the ones in flight
    finish. ``save`` (if given) is called every ``CHECKPOINT_EVERY_S``
    seconds and at the end with {"answers": {i: answer i}, "recipe": the
    options an answer depends on and a digest of the prompt list}, what
    ``resume`` takes back (refused when those options or prompts differ);
    answers in flight at a checkpoint are not in it (a resumed run starts
    them again: at most a few seconds of the target's work)."""
    from specdec.engine.base import ForwardItem

    all_prompts = prompts(tokenizer, TOPICS)
    made_with = {"--teacher-dtype": answered_in(resume["recipe"]), **resume["recipe"]} if resume else {}
    dtype = teacher_dtype(cfg, target, log, made_with.get("--teacher-dtype"))
    recipe = {"--target": cfg.target, "--seed": cfg.seed, "--teacher-temperature": cfg.teacher_temperature,
              "--max-new-tokens": cfg.max_new_tokens, "--kind": cfg.kind,
              "--teacher-dtype": dtype}  # what an answer depends on
    recipe["prompts"] = prompts_digest(all_prompts)  # and which prompt answer i answers
    if resume:
        if made_with.get("prompts") != recipe["prompts"]:
            raise SystemExit("--resume: the checkpoint's answers answer another list of the recipe's prompts "
                             "(made by a specdec whose word lists differ); run again without --resume")
        differ = [flag for flag, value in recipe.items() if made_with.get(flag) != value]
        if differ:
            was = ", ".join(f"{flag} {made_with.get(flag)}" for flag in differ)
            raise SystemExit(f"--resume: the checkpoint's answers were made with other {', '.join(differ)} "
                             f"({was}); run again with those or without --resume")
    answers: dict[int, dict] = dict(resume["answers"]) if resume else {}
    todo = [i for i in range(cfg.samples or _auto_limit(cfg, len(all_prompts))) if i not in answers]
    if not cfg.samples and deadline is None:
        raise ValueError("teacher_data: cfg.samples 0 (answers until a deadline) needs the deadline")
    width = min(TEACHER_BATCH, max(len(todo), 1))
    longest = max(map(len, all_prompts)) + cfg.max_new_tokens
    engine = teacher_engine(target, cfg.target, dtype, width * (longest + 64), cfg.threads)  # + 64: whole KV blocks
    eos = tokenizer.eos_token_id
    of = f"/{cfg.samples}" if cfg.samples else ""
    if answers:
        log(f"data: resumed with {len(answers)}{of} target answers")
    log(f"data: the target answers in {dtype}, {width} at a time")
    if not cfg.samples:
        log(f"data: target answers for {AUTO_DATA_SHARE:.0%} of --minutes (--samples 0), at most {len(todo)} more")
    live: dict[int, dict] = {}  # answer index -> {"prompt", "answer", "ids", "logp", "feed", "feats", "gen"}
    admitted, started, reported, saved = 0, time.monotonic(), time.monotonic(), time.monotonic()
    made = sum(len(a["tokens"]) - a["start"] - 1 for a in answers.values())
    made_before = made
    while admitted < len(todo) or live:
        if deadline is not None and not cfg.samples and time.monotonic() >= deadline:
            del todo[admitted:]  # the time for answers is up: the ones in flight finish
            if not live:
                break
        while len(live) < width and admitted < len(todo):
            index = todo[admitted]
            prompt = all_prompts[index % len(all_prompts)]
            engine.ensure_capacity(f"teacher-{index}", len(prompt) + cfg.max_new_tokens)
            live[index] = {"prompt": prompt, "answer": [], "ids": [], "logp": [], "feed": prompt, "feats": [],
                           "gen": answer_generator(cfg.seed, index)}
            admitted += 1
        out = engine.forward([ForwardItem(f"teacher-{i}", np.asarray(s["feed"], np.int32), 1)
                              for i, s in live.items()], feature_layers=feature_layers)
        if feature_layers:  # out.features: [fed tokens of all items, in item order, width]
            fed = np.cumsum([0] + [len(s["feed"]) for s in live.values()])
            for j, s in enumerate(live.values()):
                s["feats"].append(out.features[fed[j]:fed[j + 1]].to(torch.bfloat16))
        logits = out.logits.float()  # [len(live), V], one row per sequence, admission order
        top = torch.log_softmax(logits, -1).topk(TEACHER_TOP_K, dim=-1)  # [B, K]
        if cfg.teacher_temperature > 0:
            uniforms = torch.cat([torch.rand(1, generator=s["gen"]) for s in live.values()])  # [B]
            drawn = draw(torch.softmax(logits / cfg.teacher_temperature, -1), uniforms)
        else:  # greedy answers: the text a greedy request's drafts are checked against
            drawn = logits.argmax(-1)
        for row, (index, s) in enumerate(list(live.items())):
            token = int(drawn[row])
            s["answer"].append(token)
            s["ids"].append(top.indices[row].int())
            s["logp"].append(top.values[row])
            s["feed"] = [token]
            if token == eos or len(s["answer"]) == cfg.max_new_tokens:
                engine.release(f"teacher-{index}")
                del live[index]
                answer = {"tokens": s["prompt"] + s["answer"], "start": len(s["prompt"]) - 1,
                          "top_ids": torch.stack(s["ids"]), "top_logp": torch.stack(s["logp"])}
                if feature_layers:  # every position but the last answer token (never fed)
                    answer["features"] = torch.cat(s["feats"])
                answers[index] = answer
                made += len(s["answer"])
        finished = admitted == len(todo) and not live
        if save is not None and (finished or time.monotonic() - saved >= CHECKPOINT_EVERY_S):
            save({"answers": answers, "recipe": recipe})
            saved = time.monotonic()
        if time.monotonic() - reported >= 10 or finished:
            reported = time.monotonic()
            elapsed = reported - started
            log(f"data: {len(answers)}{of} target answers, {made} tokens, "
                f"{(made - made_before) / max(elapsed, 1e-9):.0f} tok/s, {elapsed:.0f}s")
    if not answers:
        raise SystemExit(f"distill: no target answer was begun within {AUTO_DATA_SHARE:.0%} of --minutes "
                         f"{cfg.minutes}; give more --minutes or a --samples count")
    keys = ["tokens", "start", "top_ids", "top_logp"] + (["features"] if feature_layers else [])
    return {key: [answers[i][key] for i in sorted(answers)] for key in keys}


def _auto_limit(cfg: DistillConfig, num_prompts: int) -> int:
    """The most answers --samples 0 makes (see AUTO_ANSWERS_PER_PROMPT)."""
    return num_prompts * (AUTO_ANSWERS_PER_PROMPT if cfg.teacher_temperature > 0 else 1)


def answer_generator(seed: int, index: int) -> torch.Generator:
    """The generator of answer ``index``'s draws (one uniform per token).
    (torch's CPU generator keeps 32 bits of a seed: the pair is mixed into
    32 bits, not packed into 64.)"""
    return torch.Generator().manual_seed(int(np.random.SeedSequence([seed, index]).generate_state(1)[0]))


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` [B, V] (rows summing to ~1), drawn by
    inverting each row's cumulative distribution at ``uniforms`` [B] (in
    [0, 1)): seeded uniforms give the same draws.
    (torch.multinomial takes ~33 ms for 32 rows of a 49k vocabulary on 2
    cores, a third of a teacher step; this takes ~1 ms.)"""
    cdf = probs.float().cumsum(-1)  # [B, V]
    u = uniforms.float()[:, None] * cdf[:, -1:]  # [B, 1], scaled to the row's total
    return torch.searchsorted(cdf, u, right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)


def teacher_engine(target, name: str, dtype: str, kv_capacity_tokens: int, threads: int):
    """An engine over the already loaded target (no second load): the Llama
    runner in ``dtype`` where it runs the model, its GEMM path the fastest
    for ``TEACHER_GEMM_ROWS``, not serving's batch-1 choice (SmolLM2 in
    bfloat16 on an AMD EPYC, family 26, where serving had picked simd-l1:
    ``python benchmarks/bench_teacher.py --answers 384 --widths 128
    --dtypes bfloat16`` answered at 776-791 tokens/s against 560 with
    serving's pick, in turns; SmolLM2 in float32 on 2 AVX2 cores of an AMD
    EPYC, family 25: oneDNN at 275 tokens/s where serving's preference for
    the fused kinds had kept simd-gguf at 197, so a batch job's rows drop
    that preference: ``LlamaEngine``), else the transformers engine (the
    model's own dtype: ``teacher_dtype``)."""
    from specdec.engine.checkpoint import Checkpoint
    from specdec.engine.hf_engine import HFEngine
    from specdec.engine.llama import LlamaEngine, unsupported_reason

    if unsupported_reason(target.config):
        return HFEngine(target, name, dtype, kv_capacity_tokens)
    return LlamaEngine(Checkpoint.of_model(target, name), dtype, kv_capacity_tokens=kv_capacity_tokens,
                       num_threads=threads, gemm_rows=TEACHER_GEMM_ROWS)


def head_targets(top_ids: torch.Tensor,  # int [m, K]: the teacher's top-K target ids
                 top_logp: torch.Tensor,  # [m, K]: their log-probabilities
                 t2d_index: torch.Tensor | None,  # int64 [V]: the head's id of each target id, -1 if none
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The teacher's top-K distribution in a head's own ids, restricted to
    the ids it has and renormalised: (ids int64 [m', K], probs [m', K] with 0
    where the head lacks the id, ok bool [m]: the rows kept, those where the
    head has any of the K). t2d_index None: the full vocabulary."""
    t_p = torch.softmax(top_logp.float(), -1)  # [m, K]
    if t2d_index is None:
        return top_ids.long(), t_p, torch.ones(len(t_p), dtype=torch.bool)
    d_ids = t2d_index[top_ids.long()]  # [m, K]
    t_p = t_p * (d_ids >= 0)
    mass = t_p.sum(-1, keepdim=True)
    ok = mass[:, 0] > 0
    return d_ids[ok].clamp(min=0), t_p[ok] / mass[ok], ok


def distill_loss(student, data: dict, rows: list[int], head_ids: torch.Tensor | None = None,
                 t2d_index: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """Cross-entropy of the student against the target's renormalised top-K
    distribution on the answer positions of ``rows``; (mean loss, positions).
    The sequences run as one batch, right-padded, under an attention mask:
    each row sees only its own sequence. head_ids (int64 [V']: the target
    ids a reduced head keeps, t2d_index its inverse): the student's logits
    over those only, the teacher's restricted to them (``head_targets``),
    as the draft proposer serves the reduced head; the LM head then costs
    V'/V of the full one's (the largest matmul of a few-layer student)."""
    head = student.get_output_embeddings().weight  # [V, hidden], frozen
    if head_ids is not None:
        head = head[head_ids]  # [V', hidden]
    inputs = [data["tokens"][r][:-1] for r in rows]
    width = max(map(len, inputs))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, seq in enumerate(inputs):
        ids[b, :len(seq)] = torch.tensor(seq)
        mask[b, :len(seq)] = 1
    hidden = student.model(ids, attention_mask=mask).last_hidden_state  # [B, width, hidden]
    answers = torch.cat([hidden[b, data["start"][r]:len(inputs[b])] for b, r in enumerate(rows)])  # [m, hidden]
    ids_k, t_p, ok = head_targets(torch.cat([data["top_ids"][r] for r in rows]),
                                  torch.cat([data["top_logp"][r] for r in rows]), t2d_index)
    logp = torch.log_softmax(torch.nn.functional.linear(answers[ok], head).float(), -1)  # [m', V']
    return -(t_p * logp.gather(1, ids_k)).sum() / max(int(ok.sum()), 1), int(ok.sum())


def draft_vocab(data: dict, tokenizer, size: int) -> list[int]:
    """The ``size`` target ids the draft head keeps (sorted): special tokens,
    then the ids most frequent in the target's answers and top-K lists."""
    counts = torch.zeros(len(tokenizer), dtype=torch.float64)  # [V]
    for seq, top in zip(data["tokens"], data["top_ids"]):
        counts.index_add_(0, torch.tensor(seq), torch.ones(len(seq), dtype=torch.float64))
        counts.index_add_(0, top.flatten().long(), torch.ones(top.numel(), dtype=torch.float64))
    counts[[i for i in tokenizer.all_special_ids if i < len(counts)]] = math.inf
    return sorted(counts.topk(min(size, len(counts))).indices.tolist())


@torch.inference_mode()
def mean_accepted_length(target, student, tokenizer, k: int = ACCEPTANCE_K, max_new_tokens: int = 64,
                         head_ids: list[int] | None = None, prompt_ids: list[list[int]] | None = None) -> float:
    """Greedy speculation simulated on the held-out prompts (or
    ``prompt_ids``): per round the student drafts k tokens greedily (from
    head_ids only, when given), the accepted ones are its longest prefix
    agreeing with the target's greedy answer, plus one target token."""
    suppress = None if head_ids is None else sorted(set(range(len(tokenizer))) - set(head_ids))
    lengths = []
    for p in held_out_prompts(tokenizer) if prompt_ids is None else prompt_ids:
        ids = torch.tensor([p])
        answer = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=tokenizer.eos_token_id)[0, len(p):]
        pos = 0
        while pos < len(answer):
            ctx = torch.cat([ids[0], answer[:pos]])
            draft = student.generate(ctx[None], attention_mask=torch.ones(1, len(ctx), dtype=torch.long),
                                     do_sample=False, max_new_tokens=k, suppress_tokens=suppress,
                                     pad_token_id=tokenizer.eos_token_id)[0, len(ctx):]
            accepted = 0
            while accepted < len(draft) and pos + accepted < len(answer) and draft[accepted] == answer[pos + accepted]:
                accepted += 1
            lengths.append(accepted + 1)
            pos += accepted + 1
    return sum(lengths) / len(lengths)


def _progress(step: int, total: int | None, loss: float, tok_s: float, eta_s: float) -> str:
    frac = step / total if total else 0.0
    bar = "#" * int(30 * frac) + "-" * (30 - int(30 * frac))
    return (f"\r[{bar}] step {step}{f'/{total}' if total else ''} loss {loss:.4f} "
            f"{tok_s:,.0f} tok/s ETA {eta_s / 60:.1f} min ")


def distill(cfg: DistillConfig, resume: bool = False, log=print) -> dict:
    """Runs the recipe; returns the model card's facts. Torch's thread count
    is cfg.threads while it runs, and denormals are flushed to zero."""
    threads = torch.get_num_threads()
    try:
        return _distill(cfg, resume, log)
    finally:
        torch.set_num_threads(threads)
        torch.set_flush_denormal(False)


def _distill(cfg: DistillConfig, resume: bool, log) -> dict:
    from specdec.engine.checkpoint import load_hf_model
    from specdec.engine.gemm_select import set_torch_threads
    from specdec.engine.memory import keep_freed_memory
    from specdec.models import load_tokenizer, resolve_model

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    set_torch_threads(cfg.threads)
    ckpt_path = out / CHECKPOINT_FILE
    torch.manual_seed(cfg.seed)
    target = load_hf_model(cfg.target)
    tokenizer = load_tokenizer(resolve_model(cfg.target))
    step, trained_s, data_s = 0, 0.0, 0.0
    state = torch.load(ckpt_path, weights_only=False) if resume and ckpt_path.exists() else None
    if state and "teacher" in state:  # a checkpoint of the target's answers: the data goes on from it
        state, teacher = None, state
    else:
        teacher = None
    if state:
        (data, dtype_used), data_s = _resumed_data(out, state), state["data_s"]
        dtype_used = dtype_used or teacher_dtype(cfg, target, log)  # (a DATA_FILE from before it was kept)
    else:
        saver = _AnswerSaver(out, time.monotonic() - (teacher["data_s"] if teacher else 0.0), teacher)
        dtype_used = teacher_dtype(cfg, target, log, answered_in(saver.resumed and saver.resumed["recipe"]))
        data = teacher_data(target, tokenizer, cfg, log, _feature_layers(cfg, target), resume=saver.resumed,
                            save=saver, deadline=None if cfg.samples else
                            saver.started + AUTO_DATA_SHARE * cfg.minutes * 60)
        data_s = time.monotonic() - saver.started
        # before the first checkpoint that leans on it
        _save_atomically(out / DATA_FILE, {"data": data, "teacher_dtype": dtype_used})
    # each training step reuses the last one's memory instead of faulting it in again. Only now: set while
    # the target answered in bfloat16 (oneDNN), it made the first 30 s of answers ~10x slower and the
    # process hold ~15 GB instead of ~3 (SmolLM2, 128 answers at a time, AMD EPYC family 26)
    keep_freed_memory()
    head_ids = draft_vocab(data, tokenizer, cfg.draft_vocab) if cfg.kind == "draft" and cfg.draft_vocab else None
    student, loss_of = _student(cfg, target, data, head_ids)
    optimizer = torch.optim.AdamW(trainable(student), lr=cfg.lr)
    gen = torch.Generator().manual_seed(cfg.seed)
    order = torch.randperm(len(data["tokens"]), generator=gen).tolist()
    chose = time.monotonic()
    dtype = distill_dtype.resolved(cfg.train_dtype, state,
                                   lambda: _measured_train_dtype(cfg, student, loss_of, data, order, log))
    chose_s = time.monotonic() - chose  # counted against the budget
    if state:
        student.load_state_dict(state["student"])
        optimizer.load_state_dict(state["optimizer"])
        step, trained_s = state["step"], state["trained_s"]
        torch.set_rng_state(state["rng"])
        log(f"resumed at step {step} ({trained_s / 60:.1f} min trained)")
    else:  # the data is whole in DATA_FILE: a checkpoint of the training leaves the answers' parts unneeded
        _save_checkpoint(ckpt_path, student, optimizer, data_s, 0, 0.0, dtype)
        for part in out.glob(ANSWERS_PART.replace("{:05d}", "*")):
            part.unlink()
    budget_s = cfg.minutes * 60 - data_s - chose_s  # --minutes covers the target's answers and the training
    started, saved = time.monotonic() - trained_s, time.monotonic()
    tokens_seen = 0
    log(f"training in {str(dtype).removeprefix('torch.')} (--train-dtype {cfg.train_dtype}), "
        f"learning rate {cfg.lr} ({cfg.lr_schedule})")
    while (cfg.steps and step < cfg.steps) or (not cfg.steps and time.monotonic() - started < budget_s):
        rows = [order[(step * cfg.batch_size + i) % len(order)] for i in range(cfg.batch_size)]
        progress = step / cfg.steps if cfg.steps else (time.monotonic() - started) / max(budget_s, 1e-9)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(cfg, step, progress)
        loss, n = distill_dtype.optimizer_step(trainable(student), optimizer,
                                               functools.partial(loss_of, student, data, rows), dtype)
        step, tokens_seen = step + 1, tokens_seen + n
        elapsed = time.monotonic() - started
        tok_s = tokens_seen / max(elapsed - trained_s, 1e-9)
        eta = (elapsed / step * (cfg.steps - step)) if cfg.steps else budget_s - elapsed
        sys.stderr.write(_progress(step, cfg.steps or None, loss.item(), tok_s, max(eta, 0.0)))
        sys.stderr.flush()
        if time.monotonic() - saved >= CHECKPOINT_EVERY_S:
            _save_checkpoint(ckpt_path, student, optimizer, data_s, step, elapsed, dtype)
            saved = time.monotonic()
    sys.stderr.write("\n")
    trained_s = time.monotonic() - started  # the card's training time: the measurement below is not training
    _save_checkpoint(ckpt_path, student, optimizer, data_s, step, trained_s, dtype)
    measured = time.monotonic()
    student.eval()
    if cfg.kind == "eagle3":
        from specdec.distill_eagle3 import eagle3_accepted_length

        student.save(out)
        held_out = held_out_prompts(tokenizer)
        accepted = eagle3_accepted_length(target, out, cfg.target, held_out, ACCEPTANCE_K,
                                          min(cfg.max_new_tokens, 64))
        shape = {"feature_layers": list(student.layers), "draft_vocab_size": len(student.hot)}
    else:
        accepted = mean_accepted_length(target, student, tokenizer, max_new_tokens=min(cfg.max_new_tokens, 64),
                                        head_ids=head_ids)
        student.save_pretrained(out)
        tokenizer.save_pretrained(out)
        if head_ids is not None:
            (out / DRAFT_VOCAB_FILE).write_text(json.dumps({"target_ids": head_ids}))
        shape = {"num_layers": student.config.num_hidden_layers}
    log(f"{cfg.kind} mean accepted length at k={ACCEPTANCE_K} on held-out prompts: {accepted:.3f}")
    card = {"config": asdict(cfg), "steps": step, "data_minutes": round(data_s / 60, 2),
            "train_minutes": round(trained_s / 60, 2),
            "acceptance_minutes": round((time.monotonic() - measured) / 60, 2),
            "mean_accepted_length_k5": round(accepted, 4), "teacher_top_k": TEACHER_TOP_K,
            "train_dtype_used": str(dtype).removeprefix("torch."),
            "teacher_dtype_used": dtype_used, **shape,
            "examples": len(data["tokens"])}
    _write_card(out, cfg, card)
    return card


def _feature_layers(cfg: DistillConfig, target) -> tuple[int, ...]:
    """The target layers whose hidden states the student reads (none for a draft model)."""
    if cfg.kind == "draft":
        return ()
    from specdec.distill_eagle3 import eagle3_layers

    return eagle3_layers(target)


def _student(cfg: DistillConfig, target, data: dict, head_ids: list[int] | None = None):
    """The student of cfg.kind and its loss (student, data, rows) -> (mean
    loss, positions); eagle3 reads data["features"] (teacher_data's); a
    draft with head_ids (its reduced head's target ids) trains that head."""
    if cfg.kind == "draft":
        student = student_from_target(target, cfg.layers)
        if head_ids is None:
            return student, distill_loss
        ids = torch.tensor(head_ids)
        index = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
        index[ids] = torch.arange(len(ids))
        return student, lambda st, d, rows: distill_loss(st, d, rows, ids, index)
    from specdec.distill_eagle3 import Eagle3Student, eagle3_loss, hot_tokens

    layers = _feature_layers(cfg, target)
    if "features" not in data:
        raise SystemExit("--resume: the checkpoint's data has no target features (an older specdec made it); "
                         "run again without --resume")
    hot = hot_tokens(data, target.config.vocab_size, cfg.draft_vocab or DEFAULT_DRAFT_VOCAB)
    student = Eagle3Student(target, layers, hot).train()
    t2d_index = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
    t2d_index[student.hot] = torch.arange(len(student.hot))
    return student, lambda st, d, rows: eagle3_loss(st, d, rows, t2d_index)


class _AnswerSaver:
    """The checkpoints of step 1 (``teacher_data``'s ``save``): each writes
    the answers finished since the one before to a part of its own
    (``ANSWERS_PART``), then the checkpoint, which names every part and the
    recipe; ``resumed`` is what such a checkpoint (or one of an older
    specdec, with the answers inside) holds, for ``teacher_data``'s
    ``resume``. A part missing is refused, naming it."""

    def __init__(self, out: Path, started: float, checkpoint: dict | None) -> None:
        self.out, self.started = out, started
        self.parts: list[str] = []  # the parts written, in order
        self.written: set[int] = set()  # the answers in them
        self.resumed: dict | None = None
        if checkpoint is None:
            return
        teacher = checkpoint["teacher"]
        if "answers" in teacher:  # an older specdec's: written to a part at the first save
            self.resumed = teacher
            return
        answers: dict[int, dict] = {}
        for name in teacher["parts"]:
            if not (out / name).exists():
                raise SystemExit(f"--resume: {out / name}, a part of the target answers the checkpoint names, "
                                 "is missing; run again without --resume")
            answers.update(torch.load(out / name, weights_only=False))
        self.parts, self.written = list(teacher["parts"]), set(answers)
        self.resumed = {"answers": answers, "recipe": teacher["recipe"]}

    def __call__(self, partial: dict) -> None:
        new = {i: a for i, a in partial["answers"].items() if i not in self.written}
        if new:
            name = ANSWERS_PART.format(len(self.parts))
            _save_atomically(self.out / name, new)
            self.parts.append(name)
            self.written.update(new)
        _save_atomically(self.out / CHECKPOINT_FILE, {
            "teacher": {"parts": list(self.parts), "recipe": partial["recipe"]},
            "data_s": time.monotonic() - self.started})


def _resumed_data(out: Path, state: dict) -> tuple[dict, str | None]:
    """The data a training checkpoint trains on: DATA_FILE's (or, from an
    older specdec, the checkpoint's own, then written to DATA_FILE, as the
    checkpoints that follow leave it out), and the dtype the target answered
    in where DATA_FILE says it (None: written before it did)."""
    if "data" in state:
        _save_atomically(out / DATA_FILE, {"data": state["data"]})
        return state["data"], None
    if not (out / DATA_FILE).exists():
        raise SystemExit(f"--resume: {out / DATA_FILE}, the data the checkpoint trains on, is missing; "
                         "run again without --resume")
    saved = torch.load(out / DATA_FILE, weights_only=False)
    return saved["data"], saved.get("teacher_dtype")


def _save_checkpoint(path: Path, student, optimizer, data_s: float, step: int, trained_s: float,
                     dtype: torch.dtype) -> None:
    """The training state (and the dtype it trains in: a resumed --train-dtype
    auto keeps it); the data it trains on is in DATA_FILE beside it."""
    _save_atomically(path, {"student": student.state_dict(), "optimizer": optimizer.state_dict(),
                            "data_s": data_s, "step": step, "trained_s": trained_s, "rng": torch.get_rng_state(),
                            "train_dtype": str(dtype).removeprefix("torch.")})


def _measured_train_dtype(cfg: DistillConfig, student, loss_of, data: dict, order: list[int], log) -> torch.dtype:
    """--train-dtype auto for a fresh run: ``distill_dtype.choose`` timing
    training steps of the run's first batch (on copies of the student)."""
    rows = [order[i % len(order)] for i in range(cfg.batch_size)]
    return distill_dtype.choose(student, lambda model: loss_of(model, data, rows),
                                {"kind": cfg.kind, "batch_size": cfg.batch_size,
                                 "max_new_tokens": cfg.max_new_tokens}, log)


def _save_atomically(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".partial")
    torch.save(state, tmp)
    tmp.replace(path)  # atomic: a crash mid-save keeps the previous checkpoint


def _write_card(out: Path, cfg: DistillConfig, card: dict) -> None:
    shape = (["--layers", str(cfg.layers)] if cfg.kind == "draft" else
             ["--kind", "eagle3"])
    command = "specdec distill " + " ".join(shlex.quote(a) for a in [
        "--target", cfg.target, "--out", cfg.out, *shape, "--minutes", str(cfg.minutes),
        "--steps", str(cfg.steps), "--samples", str(cfg.samples or card["examples"]),  # the count made: same data
        "--max-new-tokens", str(cfg.max_new_tokens),
        "--batch-size", str(cfg.batch_size), "--lr", str(cfg.lr), "--seed", str(cfg.seed),
        "--threads", str(cfg.threads), "--draft-vocab", str(cfg.draft_vocab),
        "--teacher-temperature", str(cfg.teacher_temperature), "--lr-schedule", cfg.lr_schedule,
        "--train-dtype", cfg.train_dtype,
        "--teacher-dtype", card["teacher_dtype_used"]])  # as resolved here: the same answers anywhere
    if cfg.kind == "draft":
        title = "Draft model"
        student = (f"the target's embeddings, final norm and LM head and {card['num_layers']} of its decoder "
                   f"layers (evenly spaced)")
        head = (f"reduced to {cfg.draft_vocab} target ids ({DRAFT_VOCAB_FILE}: the most frequent in the "
                "answers and the target's top-K, special tokens first)" if cfg.draft_vocab else "the full vocabulary")
    else:
        title = "EAGLE-3 head"
        student = (f"one EAGLE-3 decoder layer over the target's hidden states of layers "
                   f"{card['feature_layers']} (output of decoder layer i; vLLM reads "
                   f"eagle_aux_hidden_state_layer_ids this way, SGLang adds 1), in the public layout vLLM and "
                   f"SGLang load; token embeddings shared with the target")
        head = f"a draft vocabulary of {card['draft_vocab_size']} target tokens (d2t)"
    answers = (f"sampled at temperature {cfg.teacher_temperature}, seed {cfg.seed}" if cfg.teacher_temperature > 0
               else "greedy")
    (out / "README.md").write_text(f"""# {title} for {cfg.target}

Made by `specdec distill` (specdec_cli/distill.py):

    {command}

- Student: {student}; trained for {card['steps']} steps ({card['train_minutes']} min).
- Training data: {card['examples']} answers of the target itself ({answers}, in
  {card['teacher_dtype_used']}) to prompts the
  recipe generates from its fixed word lists (chat instructions or story openings); no other data.
  Loss: cross-entropy against the target's renormalised top-{TEACHER_TOP_K} next-token distribution
  at every answer position. AdamW, learning rate {cfg.lr} ({cfg.lr_schedule}), matmuls in
  {card['train_dtype_used']}.
- Draft head: {head}.
- Mean accepted length at k={ACCEPTANCE_K} (greedy, held-out prompts): {card['mean_accepted_length_k5']}.

```json
{json.dumps(card, indent=2)}
```
""")
