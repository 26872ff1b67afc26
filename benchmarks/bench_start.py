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
The record is written before the first round, by one start.

    python benchmarks/bench_start.py --models ../shared/models/stories260K,smollm2-135m-instruct-q4_1 --rounds 3
    python benchmarks/bench_start.py --models smollm2-135m-instruct-q4_1 --eagle3 HEAD --rounds 3

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
from specdec.models import CHECKPOINT_CACHE_ENV

WAYS = ("transformers", "record")


def start_seconds(model: str, records: str, timeout_s: float, eagle3: str | None = None) -> float:
    """Seconds from spawning a scorer of `model` (an eagle3 proposer of head
    `eagle3` for target `model`, where given; checkpoint records in `records`,
    or "off") to its health check answering SERVING; stops it."""
    port = free_port()
    env = dict(os.environ, **{CHECKPOINT_CACHE_ENV: records})
    service = (["scorer", "--model", model] if eagle3 is None else
               ["proposer", "--methods", "eagle3", "--eagle3", eagle3, "--target-model", model])
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", *service, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        try:
            wait_serving(f"127.0.0.1:{port}", proc, timeout_s, f"{service[0]} of {model}")
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
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a start may take")
    ap.add_argument("--out", default="bench_results/start.json")
    args = ap.parse_args()
    models = [m for m in args.models.split(",") if m]
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    if not models:
        ap.error("--models names no model")
    records = args.records or tempfile.mkdtemp(prefix="specdec-records-")
    service = "scorer" if args.eagle3 is None else f"eagle3 proposer of {args.eagle3}"
    article = "a" if args.eagle3 is None else "an"
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores); starting {article} {service}; records in {records}",
          flush=True)
    rows = []
    for model in models:
        start_seconds(model, records, args.timeout, args.eagle3)  # writes the record (and any GGUF copy, kernel caches)
        rounds: dict[str, list[float]] = {way: [] for way in WAYS}
        for r in range(args.rounds):
            for way in (WAYS if r % 2 == 0 else WAYS[::-1]):
                rounds[way].append(round(start_seconds(model, "off" if way == "transformers" else records,
                                                       args.timeout, args.eagle3), 3))
            print(f"  {model} round {r + 1}: " + ", ".join(f"{w} {rounds[w][-1]:.2f} s" for w in WAYS), flush=True)
        ratios = [b / a for a, b in zip(rounds["transformers"], rounds["record"])]
        rows.append({"model": model, "service": service, "rounds": rounds,
                     "median_s": {w: statistics.median(rounds[w]) for w in WAYS},
                     "record_over_transformers": round(statistics.median(ratios), 3)})
    print(f"\n{'model':<48} {'transformers s':>14} {'record s':>9} {'record / transformers':>22}")
    for row in rows:
        print(f"{Path(row['model']).name:<48} {row['median_s']['transformers']:>14.2f} "
              f"{row['median_s']['record']:>9.2f} {row['record_over_transformers']:>22.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu_model(), "cores": os.cpu_count(), "rounds": args.rounds, "rows": rows},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
