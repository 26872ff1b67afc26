"""Forward passes of many rows through the engine: a prompt's prefill (the
first token's wait) and a batched decode step of many sequences (one row
each), against another copy of the engine package measured in the same run,
in turns.

    git archive HEAD engine | tar -x -C /tmp/base
    python benchmarks/bench_prefill.py --baseline-src /tmp/base/engine

Each engine runs in a child process of its own (``package_copy``: the
baseline's ``specdec.engine`` is the copy's) that loads the model once and
then times one round each time the parent asks, the two children in turns,
so a drifting machine slows both alike. A round times each prompt length's
prefill (a new sequence each time; the fastest of --reps) and each batch's
decode step (every sequence one row after --context cached tokens, rolled
back after each rep). The baseline runs the GEMM path this engine took
(the selector's timings could pick another, of other bits, for it), and
both engines' logits are compared: a change of arithmetic shows as
``identical: False``. Prints a table (medians over the
rounds, the ratio the median of the rounds' own) and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from specdec.engine.gemm_select import cpu_model
from specdec.engine.kv_pool import default_num_threads
from specdec.models import default_model

sys.path.insert(0, str(Path(__file__).parent))
from package_copy import load_package  # noqa: E402

#: the child's tail: load the engine, then one round a line on stdin, one JSON line out
CHILD = """
import hashlib, json, time
import numpy as np
from specdec.engine.base import ForwardItem
from specdec.engine.llama import Checkpoint, LlamaEngine
model, threads, prompts, batches, context, reps, gemm = json.loads(sys.argv[1])
engine = LlamaEngine(Checkpoint.load(model), "float32", kv_capacity_tokens=8192, num_threads=threads, gemm=gemm)
engine.prepare(1)
rng = np.random.default_rng(0)
ids = rng.integers(0, engine.spec.vocab_size, max(prompts + [context + 1])).astype(np.int32)
for b in range(max(batches, default=0)):
    engine.ensure_capacity(f"b{b}", context + 1)
    engine.forward([ForwardItem(f"b{b}", ids[:context], 1)])
n = 0
digest = hashlib.sha256()

def timed(items):
    start = time.perf_counter()
    out = engine.forward(items)
    return time.perf_counter() - start, out.logits.numpy()

print(json.dumps({"gemm": engine.gemm}), flush=True)
for line in sys.stdin:
    row = {"prefill_ms": {}, "batch_ms": {}}
    for p in prompts:
        best = float("inf")
        for _ in range(reps):
            n += 1
            engine.ensure_capacity(f"p{n}", p)
            dt, logits = timed([ForwardItem(f"p{n}", ids[:p], 1)])
            engine.release(f"p{n}")
            best = min(best, dt)
        digest.update(logits.tobytes())
        row["prefill_ms"][p] = 1e3 * best
    for b in batches:
        best = float("inf")
        for _ in range(reps):
            for i in range(b):
                engine.ensure_capacity(f"b{i}", context + 1)  # truncate gave back the block past the context
            dt, logits = timed([ForwardItem(f"b{i}", ids[context:context + 1], 1) for i in range(b)])
            for i in range(b):
                engine.truncate(f"b{i}", context)
            best = min(best, dt)
        digest.update(logits.tobytes())
        row["batch_ms"][b] = 1e3 * best
    row["logits_sha256"] = digest.hexdigest()
    print(json.dumps(row), flush=True)
"""


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def start(src: str | None, config: list) -> subprocess.Popen:
    """A child timing this engine (src None) or the copy at src."""
    code = (load_package("engine") if src else "import sys\n") + CHILD
    argv = [sys.executable, "-c", code] + ([src] if src else []) + [json.dumps(config)]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def ask(child: subprocess.Popen) -> dict:
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write("round\n")
    child.stdin.flush()
    line = child.stdout.readline()
    if not line:
        raise SystemExit(f"a child exited (code {child.wait()}): see its stderr above")
    return json.loads(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=default_model())
    ap.add_argument("--baseline-src", default=None, help="another copy of the engine package (a directory)")
    ap.add_argument("--prompts", default="57,200", help="prompt lengths prefilled")
    ap.add_argument("--batches", default="12,32", help="sequences of a batched decode step (one row each)")
    ap.add_argument("--context", type=int, default=64, help="cached tokens of each batched sequence")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=2, help="passes a round times of each (the fastest counts)")
    ap.add_argument("--threads", type=int, default=default_num_threads())
    ap.add_argument("--gemm", default="auto", help="this engine's GEMM path (auto: the selector's); the "
                    "baseline runs the path this engine took")
    ap.add_argument("--out", default="bench_results/prefill.json")
    args = ap.parse_args()
    if args.baseline_src and not Path(args.baseline_src, "llama.py").is_file():
        ap.error(f"--baseline-src: {args.baseline_src} is not an engine package directory (no llama.py)")
    prompts, batches = ints(args.prompts), ints(args.batches)
    config = [args.model, args.threads, prompts, batches, args.context, args.reps, args.gemm]
    names = ["this"] + (["baseline"] if args.baseline_src else [])
    children, gemm = {}, {}
    for name in names:  # one at a time: loading (and compiling) beside the other's would slow both
        if name == "baseline":  # the path this engine took (auto's timings may pick another of other bits)
            config[-1] = gemm["this"]
        children[name] = start(args.baseline_src if name == "baseline" else None, config)
        line = children[name].stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise SystemExit(f"the {name} engine's child exited (code {children[name].wait()}): see its stderr above")
        gemm[name] = json.loads(line)["gemm"]
    rounds: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            rounds[name].append(ask(children[name]))
        print(f"  round {r + 1}/{args.rounds}", file=sys.stderr)
    for child in children.values():
        child.stdin.close()  # type: ignore[union-attr]
        child.wait()

    cpu = cpu_model()
    cases = [("prefill_ms", p, f"prefill {p} tokens") for p in prompts] + \
            [("batch_ms", b, f"decode step, {b} sequences") for b in batches]
    rows = []
    for key, size, label in cases:
        row = {"case": label, "kind": key, "size": size}
        for name in names:
            row[f"{name}_ms"] = statistics.median(rd[key][str(size)] for rd in rounds[name])
        if args.baseline_src:
            row["speedup"] = statistics.median(b[key][str(size)] / t[key][str(size)]
                                               for t, b in zip(rounds["this"], rounds["baseline"]))
        rows.append(row)
    identical = (args.baseline_src is None
                 or rounds["this"][-1]["logits_sha256"] == rounds["baseline"][-1]["logits_sha256"])
    print(f"\nMany-row forward passes: {args.model}, float32, {args.threads} threads, GEMM {gemm}, "
          f"median of {args.rounds} rounds (ratio: median of the rounds' own)\nCPU: {cpu}")
    print(f"{'case':>28} {'this ms':>9}" + (f" {'baseline ms':>12} {'speedup':>8}" if args.baseline_src else ""))
    for row in rows:
        print(f"{row['case']:>28} {row['this_ms']:9.1f}"
              + (f" {row['baseline_ms']:12.1f} {row['speedup']:7.2f}x" if args.baseline_src else ""))
    if args.baseline_src:
        print(f"identical logits: {identical}")
    result = {"model": args.model, "cpu": cpu, "threads": args.threads, "gemm": gemm, "context": args.context,
              "baseline_src": args.baseline_src, "rounds": args.rounds, "reps": args.reps,
              "identical": identical, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
