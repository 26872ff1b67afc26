"""How long a scorer takes to start: seconds from spawning ``specdec scorer``
(with ``--eagle3 HEAD``: an eagle3 proposer, ``specdec proposer --methods
eagle3``, which reads the target's config and embeddings) to its gRPC health
check answering SERVING (``launcher.wait_serving``: a fresh channel every
0.1 s), without a checkpoint record
(``SPECDEC_CHECKPOINT_CACHE_DIR=off``: the model loads through transformers,
as every start did before records) and with one (the start reads the
safetensors by the record, never importing transformers; engine/checkpoint.py).
Each round starts the model both ways, their order alternating between
rounds (the machine's speed drifts between minutes: compare within a round).
The record is written before the first round, by one start. With ``--draft
DIR`` a draft proposer for target MODEL is timed instead, both ways with
records: its tokenizer check (``draft_model.shared_target_vocab``: both
tokenizers loaded and compared) done at each start, its remembered answer
removed first ("checked", as every start did before), or read ("remembered").

    python benchmarks/bench_start.py --models ../shared/models/stories260K,smollm2-135m-instruct-q4_1 --rounds 3
    python benchmarks/bench_start.py --models smollm2-135m-instruct-q4_1 --eagle3 HEAD --rounds 3
    python benchmarks/bench_start.py --models smollm2-135m-instruct-q4_1 --draft DIR --rounds 3

Prints a table (median seconds and the median of the rounds' with / without
ratios) and writes JSON to --out (default bench_results/start.json).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specdec.engine.gemm_select import cpu_model
from specdec.launcher import free_port, wait_serving
from specdec.models import CHECKPOINT_CACHE_ENV, TOKENIZER_CACHE_ENV, resolve_model
from specdec.proposer_svc.draft_model import tokenizer_pair_entry

WAYS = ("transformers", "record")
#: With --draft: each start checks the draft's tokenizer against the target's
#: (its remembered check removed first, as every start did before), or reads it.
DRAFT_WAYS = ("checked", "remembered")


def service_command(model: str, eagle3: str | None = None, draft: str | None = None) -> list[str]:
    """The `specdec` arguments of the service timed: a scorer of `model`, or
    a proposer for target `model` of EAGLE-3 head `eagle3` / draft `draft`."""
    if eagle3 is not None:
        return ["proposer", "--methods", "eagle3", "--eagle3", eagle3, "--target-model", model]
    if draft is not None:
        return ["proposer", "--methods", "draft", "--draft-model", draft, "--target-model", model]
    return ["scorer", "--model", model]


def start_seconds(service: list[str], env: dict[str, str], timeout_s: float) -> float:
    """Seconds from spawning ``specdec <service>`` (with `env` added to this
    process's environment) to its health check answering SERVING; stops it."""
    port = free_port()
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", *service, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=dict(os.environ, **env))
    try:
        try:
            wait_serving(f"127.0.0.1:{port}", proc, timeout_s, f"{service[0]} of {service[2]}")
        except RuntimeError as e:  # it exited: say why
            raise RuntimeError(f"{e}: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}") from None
        return time.perf_counter() - started
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="../shared/models/stories260K,smollm2-135m-instruct-q4_1",
                    help="comma-separated models (directories, shared-models names, .gguf files)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--records", default=None, help="where the records go (default: a fresh temporary directory)")
    ap.add_argument("--eagle3", metavar="HEAD", default=None,
                    help="time an eagle3 proposer of this EAGLE-3 head (for every model given) instead of a scorer")
    ap.add_argument("--draft", metavar="DIR", default=None,
                    help="time a draft proposer of this draft model (for every model given as its target) instead, "
                         "its tokenizer check remembered or not (both with checkpoint records)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a start may take")
    ap.add_argument("--out", default="bench_results/start.json")
    args = ap.parse_args()
    models = [m for m in args.models.split(",") if m]
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    if not models:
        ap.error("--models names no model")
    if args.eagle3 is not None and args.draft is not None:
        ap.error("--eagle3 and --draft: time one service at a time")
    records = args.records or tempfile.mkdtemp(prefix="specdec-records-")
    tokenizers = str(Path(records) / "tokenizers")  # the draft's remembered tokenizer checks, beside the records
    os.environ[TOKENIZER_CACHE_ENV] = tokenizers  # this process finds the entries its children write
    service = ("scorer" if args.eagle3 is None and args.draft is None else
               f"eagle3 proposer of {args.eagle3}" if args.draft is None else f"draft proposer of {args.draft}")
    ways = DRAFT_WAYS if args.draft is not None else WAYS
    article = "a" if service.startswith(("scorer", "draft")) else "an"
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores); starting {article} {service}; records in {records}",
          flush=True)
    rows = []
    for model in models:
        command = service_command(model, args.eagle3, args.draft)
        env = {CHECKPOINT_CACHE_ENV: records, TOKENIZER_CACHE_ENV: tokenizers}
        start_seconds(command, env, args.timeout)  # writes the records (and any GGUF copy, kernel caches)
        rounds: dict[str, list[float]] = {way: [] for way in ways}
        for r in range(args.rounds):
            for way in (ways if r % 2 == 0 else ways[::-1]):
                if way == "transformers":  # nothing remembered: through transformers
                    way_env = {**env, CHECKPOINT_CACHE_ENV: "off"}
                else:
                    way_env = env
                    pair = tokenizer_pair_entry(resolve_model(args.draft), resolve_model(model)) if args.draft else None
                    if way == "checked" and pair is not None:  # as before the check was remembered
                        pair.unlink(missing_ok=True)
                rounds[way].append(round(start_seconds(command, way_env, args.timeout), 3))
            print(f"  {model} round {r + 1}: " + ", ".join(f"{w} {rounds[w][-1]:.2f} s" for w in ways), flush=True)
        ratios = [b / a for a, b in zip(rounds[ways[0]], rounds[ways[1]])]
        rows.append({"model": model, "service": service, "rounds": rounds,
                     "median_s": {w: statistics.median(rounds[w]) for w in ways},
                     f"{ways[1]}_over_{ways[0]}": round(statistics.median(ratios), 3)})
    print(f"\n{'model':<48} {ways[0] + ' s':>14} {ways[1] + ' s':>12} {ways[1] + ' / ' + ways[0]:>26}")
    for row in rows:
        print(f"{Path(row['model']).name:<48} {row['median_s'][ways[0]]:>14.2f} "
              f"{row['median_s'][ways[1]]:>12.2f} {row[f'{ways[1]}_over_{ways[0]}']:>26.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu_model(), "cores": os.cpu_count(), "rounds": args.rounds, "rows": rows},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
