"""``--train-dtype auto`` and ``--teacher-dtype auto``: the student's matmul
dtype and the dtype the target answers in, each chosen by timing on the
machine that distills.

Native bfloat16 is not a speed-up everywhere. On 2 cores of an AMD EPYC a
bfloat16 matmul runs ~2x float32's; on an Intel Xeon with AVX512-BF16 and no
AMX (family 6, model 207) ``vdpbf16ps`` does as many multiply-adds a cycle as
float32 FMAs and the casts autocast adds cost more than the halved bytes
save: ``python benchmarks/bench_distill_step.py --answers 32 --steps 10
--reps 1 --dtype D`` timed an eagle3 step on SmolLM2 at 0.655 s in float32
against 1.064 s in bfloat16 there (1.62x). Choosing by the CPU's flags cost
that machine ~40 % of the steps of a ``--minutes`` budget.

So where the CPU has native bfloat16 (elsewhere bfloat16 is emulated:
float32, unmeasured), ``auto`` times ``WARM + TIMED`` optimiser steps in
each dtype, in turns, on copies of the student (the run's own student,
optimiser and random state are left as they were), and keeps bfloat16 only
where its median step takes at most ``BF16_MARGIN`` of float32's: a
near-tie goes to float32, whose result does not depend on the CPU's
bfloat16 rounding. The verdict is cached on disk (``cache_dir``) keyed by
the CPU (model and flags), torch, the threads and the step's shape, so a
seed gives the same student on that machine in every run, and a resumed
run keeps the dtype its checkpoint was trained in (``resolved``).

The teacher's dtype (``--teacher-dtype auto``, ``choose_teacher``) is
measured the same way, on decode steps of the engine the target answers
with: on that Intel Xeon the flags' choice, bfloat16, answered at 339
tokens/s against float32's 421 (``python benchmarks/bench_teacher.py
--answers 384 --widths 128 --dtypes float32,bfloat16``, same run), while on
an AMD EPYC (family 26) bfloat16 answered ~1.25x faster."""
from __future__ import annotations

import copy
import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

#: bfloat16 only where its step takes at most this share of float32's.
BF16_MARGIN = 0.9
#: Steps in each dtype not timed (the first allocates and warms oneDNN's kernels), then timed.
WARM, TIMED = 1, 2
#: Rounds of (float32, bfloat16) steps in turns.
ROUNDS = 2
#: The teacher's decode steps (all ``TEACHER_BATCH`` answers in flight) in
#: each dtype and round: not timed (the first runs oneDNN's first calls), timed.
TEACHER_WARM, TEACHER_TIMED = 1, 3
#: Where verdicts are cached (default ~/.cache/specdec/train_dtype).
CACHE_ENV = "SPECDEC_TRAIN_DTYPE_CACHE_DIR"
CACHE_VERSION = 1


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "specdec" / "train_dtype")


def machine_key() -> dict:
    """What a verdict depends on besides the work timed: the CPU (model and
    flags), torch and the threads."""
    from specdec.engine.gemm_select import cpu_flags, cpu_model

    return {"version": CACHE_VERSION, "cpu": cpu_model(),
            "cpu_flags": hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:12],
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def _key(student: torch.nn.Module, shape: dict) -> dict:
    params = sorted(f"{name}:{'x'.join(map(str, p.shape))}:{int(p.requires_grad)}"
                    for name, p in student.named_parameters())
    return {**machine_key(), "params": hashlib.sha256("\n".join(params).encode()).hexdigest()[:16], **shape}


def _cache_file(key: dict) -> Path:
    return cache_dir() / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20] + ".json")


def optimizer_step(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                   loss_of: Callable[[], tuple[torch.Tensor, int]], dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """One training step, as ``specdec distill`` trains: the loss (and the
    tokens it covers, ``loss_of()``) under ``dtype`` autocast (the forward
    only), then backward, gradients clipped to norm 1 and the optimiser's
    step in float32."""
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        loss, n = loss_of()
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    return loss, n


def step_seconds(student: torch.nn.Module, loss_of: Callable[[torch.nn.Module], tuple[torch.Tensor, int]],
                 dtype: torch.dtype, steps: int) -> list[float]:
    """Seconds of each of ``steps`` training steps (``optimizer_step`` with
    ``loss_of(model)``) of a copy of the student in ``dtype``."""
    model = copy.deepcopy(student)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-6)
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer_step(params, optimizer, lambda: loss_of(model), dtype)
        seconds.append(time.perf_counter() - start)
    return seconds


def measure(student: torch.nn.Module, loss_of: Callable[[torch.nn.Module], tuple[torch.Tensor, int]]) -> dict:
    """Median seconds a step in float32 and in bfloat16 (``step_seconds``,
    ``ROUNDS`` rounds in turns, the first ``WARM`` steps of each round not
    counted); torch's random state is left as it was."""
    rng = torch.get_rng_state()
    timed: dict[str, list[float]] = {"float32": [], "bfloat16": []}
    try:
        for _ in range(ROUNDS):
            for name in timed:
                timed[name] += step_seconds(student, loss_of, getattr(torch, name), WARM + TIMED)[WARM:]
    finally:
        torch.set_rng_state(rng)
    return {name: statistics.median(s) for name, s in timed.items()}


def choose(student: torch.nn.Module, loss_of: Callable[[torch.nn.Module], tuple[torch.Tensor, int]],
           shape: dict, log: Callable[[str], None]) -> torch.dtype:
    """``--train-dtype auto`` for this student and loss (``loss_of(model)``
    -> (loss, tokens) of one batch): float32 where the
    CPU has no native bfloat16; else the cached verdict for this machine and
    shape, or a fresh measurement (``measure``), logged and cached."""
    from specdec.engine.gemm_select import native_bf16

    if not native_bf16():
        return torch.float32
    return getattr(torch, _verdict(_key(student, shape), "training dtype", "--train-dtype", "a step",
                                   lambda: measure(student, loss_of), log))


def choose_teacher(key: dict, step_seconds: Callable[[str, int], list[float]], log: Callable[[str], None]) -> str:
    """``--teacher-dtype auto``: "float32" where the CPU has no native
    bfloat16; else the cached verdict for this machine and ``key`` (the
    target and what its answering looks like), or a fresh one:
    ``step_seconds(dtype, n)`` gives the seconds of each of n decode steps
    of the teacher's engine in that dtype; ``ROUNDS`` rounds in turns of
    ``TEACHER_WARM`` untimed and ``TEACHER_TIMED`` timed steps each, and
    bfloat16 only where its median step takes at most ``BF16_MARGIN`` of
    float32's. Logged and cached."""
    from specdec.engine.gemm_select import native_bf16

    if not native_bf16():
        return "float32"

    def timings() -> dict[str, float]:
        timed: dict[str, list[float]] = {"float32": [], "bfloat16": []}
        for _ in range(ROUNDS):
            for name in timed:
                timed[name] += step_seconds(name, TEACHER_WARM + TEACHER_TIMED)[TEACHER_WARM:]
        return {name: statistics.median(s) for name, s in timed.items()}

    return _verdict({**machine_key(), "what": "teacher", **key}, "teacher dtype", "--teacher-dtype",
                    "a decode step", timings, log)


def _verdict(key: dict, what: str, flag: str, unit: str, timings: Callable[[], dict[str, float]],
             log: Callable[[str], None]) -> str:
    """The cached verdict ("float32" or "bfloat16") for ``key``, else one
    from ``timings()`` (median seconds of ``unit`` in each dtype): bfloat16
    only at <= ``BF16_MARGIN`` of float32's; logged as ``what`` and cached."""
    path = _cache_file(key)
    try:
        cached = json.loads(path.read_text())
        if cached.get("key") == key:
            log(f"{what}: {cached['dtype']} ({flag} auto; measured before on this CPU: "
                f"{_timings(cached['ms'])}; cache {path})")
            return str(cached["dtype"])
    except (OSError, ValueError, KeyError, AttributeError):
        pass
    start = time.monotonic()
    seconds = timings()
    dtype = "bfloat16" if seconds["bfloat16"] <= BF16_MARGIN * seconds["float32"] else "float32"
    ms = {name: round(1e3 * s, 1) for name, s in seconds.items()}
    log(f"{what}: {dtype} ({flag} auto; {unit} {_timings(ms)}, measured in "
        f"{time.monotonic() - start:.0f} s; bfloat16 only at <= {BF16_MARGIN:.0%} of float32's)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".partial")
        tmp.write_text(json.dumps({"key": key, "dtype": dtype, "ms": ms}, indent=1))
        tmp.replace(path)
    except OSError as e:  # a read-only home: measured again next run
        log(f"{what}: not cached ({e})")
    return dtype


def _timings(ms: dict) -> str:
    return ", ".join(f"{name} {value:.1f} ms" for name, value in ms.items())


def resolved(choice: str, state: dict | None, auto: Callable[[], torch.dtype]) -> torch.dtype:
    """The dtype a run trains in: a given one as given; ``auto`` the one a
    resumed checkpoint (``state``) trained in, else ``auto()``."""
    if choice != "auto":
        return getattr(torch, choice)
    if state is not None and state.get("train_dtype"):
        return getattr(torch, state["train_dtype"])
    return auto()
