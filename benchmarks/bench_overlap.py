"""Overlapped rounds against lock-step (issue 16): aggregate tokens/s of 1, 8
and 32 concurrent greedy streams of one copy method (``--method``: ngram,
the default, suffix or hybrid) through a real scorer and a real proposer
that answers each Propose message ``--added-latency-ms`` later (0, 5, 20
ms: a remote or model-based proposer), with the gateway's ``--overlap``
off (lock-step), on (two cohorts while the cost model says it pays), always
(two cohorts) and ahead (the next round drafted during verification).

One scorer, one proposer per latency and one gateway per (latency, mode),
all started once; for each stream count, every (latency, mode) row runs once
a repeat, in turns, ``--repeats`` times, and the median is shown. Every
row's tokens are checked against lock-step's at the first latency. The
ratio and loss columns (against lock-step at the same latency, the same mode
at the first latency, lock-step at the first latency) are medians of each
repeat's own ratios: the rows they compare ran a minute apart at most, not
a latency block apart (this VM drifts by more than the 5 % the goal allows
between blocks). "overlapped" counts the gateway's overlapped steps in a
run (median), and the JSON keeps the gateway's fitted Verify cost after each
run (what ``--overlap on`` decides with). Prints a table with the CPU model and writes JSON.

``--method none`` measures plain decoding the same way (the proposer, serving
ngram, is never asked): the cohorts then have nothing to overlap.
``--plain-share 0.5`` has the first half of the streams decode plainly beside
the others' ``--method``: a mixed batch, whose plain sequences ``on`` lets
ride in every Verify while the others form the two cohorts.

``--requests-per-stream N`` has each stream send N requests one after
another, through the prompts in turn: at one stream, 8 covers every
prompt (most of SmolLM2's are chat: 1.85 tokens a round lock-step) where 1 sends only
the first (which copies, ~4.8).

``--baseline-src DIR`` measures another copy of the gateway package in the
same run (benchmarks/package_copy.py): every mode but off (or those of
``--baseline-modes``) gets a second gateway per latency running DIR's code,
its rows named ``MODE@baseline``, taking turns with the others in every
repeat; "vs base" is the median of a mode's ratios to its baseline row
within each repeat. "ahead" counts the rounds that drafted ahead (``--overlap ahead``,
or ``on`` choosing to). "CPU ms s/p/g" is the CPU time (user + system,
every thread, from /proc) the scorer, the proposer and the gateway spent
during a run per sequence-round (a round, at one stream): on two cores,
work beside a Verify slows it.

``--scorer-cpus 0`` runs the scorer alone on those CPUs (its engine threads
one per CPU) and the proposers, the gateways and this client on the others
(each process's CPUs are written to the JSON): a remote proposer's and a
gateway's work then no longer shares the Verify's cores, as beside a GPU
scorer or on machines of their own.

    flock /tmp/specdec-bench.lock python benchmarks/bench_overlap.py \\
        [--model PATH] [--latencies 0,5,20] [--streams 1,8,32] [--max-tokens 96] [--modes off,on,always,ahead] \\
        [--requests-per-stream 1] [--baseline-src /tmp/base/gateway [--baseline-modes on]] [--scorer-cpus 0]
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from specdec.client import make_request, stream
from specdec.launcher import Stack, free_port, wait_serving
from specdec.models import load_tokenizer, resolve_model
from specdec.proposer_svc.registry import COPY_METHODS
from specdec.protos.v1 import specdec_pb2 as pb

sys.path.insert(0, str(Path(__file__).parent))
from bench_e2e import PROMPTS as CHAT_PROMPTS  # noqa: E402
from bench_e2e import chat_ids  # noqa: E402
from bench_proposer import cpu_seconds  # noqa: E402
from package_copy import RUN_CLI, load_package  # noqa: E402

STORY_PROMPTS = ["Once upon a time", "Tom saw a big dog. The dog was happy. Tom saw a big dog. The",
                 "Lily went to the park with her mom.", "The sun was hot. The sun was hot. The",
                 "Ben had a red ball. He liked to play with it every day."]
MODES = ["off", "on", "always", "ahead"]
BASELINE = "@baseline"  # a mode's row measured on --baseline-src's gateway package
#: with --method none: what the (never asked) proposer serves, so that every row's services are alike
PLAIN_PROPOSER_METHOD = "ngram"


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")),
                "unknown")


def prompt_ids(model: str) -> list[list[int]]:
    tokenizer = load_tokenizer(resolve_model(model))
    if tokenizer.chat_template:
        return [chat_ids(tokenizer, text) for text in CHAT_PROMPTS.values()]
    return [list(tokenizer(text)["input_ids"]) for text in STORY_PROMPTS]


def start_services(stack: Stack, latencies: list[float], modes: list[str], baseline_src: str | None = None,
                   method: str = "ngram", proposer_args: list[str] | None = None) -> dict[tuple[float, str], str]:
    """A proposer per latency and a gateway per (latency, mode) beside the
    stack's scorer (modes named ``MODE@baseline`` run the gateway package in
    baseline_src); returns their gateway addresses."""
    scorer = stack.by_name("scorer")[0].addr
    served = PLAIN_PROPOSER_METHOD if method == "none" else method  # plain decoding asks no proposer
    gateways = {}
    for latency in latencies:
        proposer = stack._spawn(f"proposer-{latency:g}ms", ["proposer", "--methods", served,
                                                             "--added-latency-ms", str(latency),
                                                             *(proposer_args or [])], free_port())
        wait_serving(proposer.addr, proposer.proc, 300, proposer.name, None)
        for mode in modes:
            overlap = mode.removesuffix(BASELINE)
            command = ([sys.executable, "-c", load_package("gateway") + RUN_CLI, str(baseline_src)]
                       if mode.endswith(BASELINE) else None)
            gateway = stack._spawn(f"gateway-{latency:g}ms-{mode}", [
                "gateway", "--model", stack.model, "--scorer", scorer, "--proposer", f"{served}={proposer.addr}",
                "--default-method", method, "--overlap", overlap], free_port(), command)
            gateways[latency, mode] = gateway.addr
    for service in stack.by_name("gateway-"):
        wait_serving(service.addr, service.proc, 300, service.name, None)
    return gateways


#: the gateway's counters of each kind of step: overlapped (two cohorts) and
#: drafting ahead (a gateway older than that counter reads 0)
STEP_COUNTERS = {"overlapped_steps": "specdec_gateway_overlapped_steps_total",
                 "ahead_rounds": "specdec_gateway_ahead_rounds_total"}


def step_counts(gateway) -> dict[str, float]:
    """The gateway's overlapped steps and rounds drafting ahead so far."""
    samples = gateway.metrics()
    return {key: samples.get(name, 0.0) for key, name in STEP_COUNTERS.items()}


def verify_fit(gateway) -> dict[str, float]:
    """The gateway's fitted Verify cost (ms fixed, ms per token fed), what
    ``--overlap on`` decides with."""
    samples = gateway.metrics()
    return {part: 1000 * v for key, v in samples.items() for part in ("fixed", "per_token")
            if key.startswith("specdec_gateway_verify_cost_seconds{") and f'part="{part}"' in key}


def request(ids: list[int], k: int, max_tokens: int, method: str = "ngram", draft_length: str = "adaptive"):
    r = make_request(ids, max_tokens=max_tokens, method=method, k=k,
                     draft_length=pb.DRAFT_LENGTH_FIXED if draft_length == "fixed" else pb.DRAFT_LENGTH_ADAPTIVE)
    r.ignore_eos = True  # every stream makes max_tokens
    return r


def stream_prompts(prompts: list[list[int]], streams: int, per_stream: int) -> list[list[list[int]]]:
    """The prompts each stream sends, one after another: request m of
    stream i is prompt (i + m * streams) mod len(prompts)."""
    return [[prompts[(i + m * streams) % len(prompts)] for m in range(per_stream)] for i in range(streams)]


def stream_methods(method: str, streams: int, plain_share: float) -> list[str]:
    """The method each stream asks for: the first floor(plain_share x
    streams) decode plainly (none), the others ask ``method``."""
    plain = int(plain_share * streams)
    return ["none"] * plain + [method] * (streams - plain)


def run(addr: str, prompts: list[list[int]], streams: int, k: int, max_tokens: int, per_stream: int = 1,
        method: str = "ngram", plain_share: float = 0.0, draft_length: str = "adaptive") -> dict:
    jobs = list(zip(stream_prompts(prompts, streams, per_stream), stream_methods(method, streams, plain_share)))
    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        gens = [g for gs in pool.map(lambda job: [stream(addr, request(ids, k, max_tokens, job[1], draft_length))
                                                  for ids in job[0]], jobs) for g in gs]
    wall = time.perf_counter() - start
    tokens = sum(len(g.token_ids) for g in gens)
    rounds = sum(g.stats.rounds for g in gens)
    return {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall, "rounds": rounds,
            "mean_accepted_length": tokens / rounds,
            "draft_tokens_per_round": sum(g.stats.draft_tokens for g in gens) / rounds,
            "accepted_per_draft_token": (sum(g.stats.accepted_tokens for g in gens)
                                         / max(1, sum(g.stats.draft_tokens for g in gens))),
            "propose_ms_per_round": 1000 * sum(g.stats.propose_s for g in gens) / rounds,
            "verify_ms_per_round": 1000 * sum(g.stats.verify_s for g in gens) / rounds,
            "token_ids": [g.token_ids for g in gens]}


#: the processes whose CPU time per round a run reports
CPU_PARTS = ("scorer", "proposer", "gateway")


def cpu_readings(pids: dict[str, int]) -> dict[str, float | None]:
    return {part: cpu_seconds(pid) for part, pid in pids.items()}


def cpu_ms_per_round(before: dict[str, float | None], after: dict[str, float | None], rounds: int) -> dict:
    """Each process's CPU ms per round (rounds: the streams' sequence-rounds)
    between two cpu_readings (None where /proc could not be read)."""
    return {part: (None if before[part] is None or after[part] is None or not rounds
                   else 1e3 * (after[part] - before[part]) / rounds) for part in before}  # type: ignore[operator]


def _median_or_none(values: list[float | None]) -> float | None:
    return None if None in values else statistics.median(values)  # type: ignore[type-var]


def parse_cpus(text: str) -> set[int]:
    """CPU numbers from a list like ``0`` or ``0-1,4`` (taskset's -c form)."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        low, high = int(first), int(last or first)
        if high < low:
            raise ValueError(f"{part!r}: a range runs from low to high")
        cpus.update(range(low, high + 1))
    return cpus


def split_cpus(text: str, available: set[int]) -> tuple[set[int], set[int]]:
    """(the scorer's CPUs, everyone else's) for --scorer-cpus TEXT; ValueError
    naming the flag when TEXT is malformed, names a CPU this process may not
    run on, or leaves none for the others."""
    try:
        scorer = parse_cpus(text)
    except ValueError:
        raise ValueError(f"--scorer-cpus: {text!r} is not a CPU list like 0 or 0-1,4") from None
    if not scorer or not scorer <= available:
        raise ValueError(f"--scorer-cpus: {text!r} names CPUs this process may not run on (it may run on "
                         f"{sorted(available)})")
    if not available - scorer:
        raise ValueError(f"--scorer-cpus: {text!r} leaves no CPU for the proposers, gateways and client")
    return scorer, available - scorer


def process_cpus(pids: dict[str, int]) -> dict[str, list[int]]:
    """The CPUs each process may run on."""
    return {part: sorted(os.sched_getaffinity(pid)) for part, pid in pids.items()}


def _ratio(runs: list[dict], baseline: list[dict]) -> float:
    """Median over the repeats of tok/s against the baseline's in the same repeat."""
    return statistics.median(r["tok_s"] / b["tok_s"] for r, b in zip(runs, baseline))


def _cpu(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="/work/shared/models/stories260K")
    ap.add_argument("--latencies", default="0,5,20", help="proposer's added latency per message, ms")
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--method", default="ngram", choices=["none", *COPY_METHODS],
                    help="the copy method every stream asks for (the proposer serves it alone); none: plain "
                         "decoding (the proposer is never asked)")
    ap.add_argument("--plain-share", type=float, default=0.0,
                    help="the share of the streams that decode plainly (method none) beside the others, e.g. 0.5: "
                         "a mixed batch (--overlap on lets those ride in every Verify)")
    ap.add_argument("--draft-length", default="adaptive", choices=["adaptive", "fixed"],
                    help="the requests' speculation.draft_length: fixed asks k drafts every round (adaptive trims "
                         "them to what pays, which with a slow proposer is often none)")
    ap.add_argument("--max-tokens", type=int, default=96, help="tokens per request (EOS ignored)")
    ap.add_argument("--requests-per-stream", type=int, default=1,
                    help="requests each stream sends one after another, through the prompts in turn (8 at one "
                         "stream: every prompt, not only the first)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES),
                    help="gateway --overlap values (off, the reference, among them)")
    ap.add_argument("--scorer-args", default="",
                    help="more arguments for the scorer, e.g. '--device cuda --dtype bfloat16' (a GPU scorer, whose "
                         "short Verify is the case overlap is for)")
    ap.add_argument("--proposer-args", default="",
                    help="more arguments for the proposers, e.g. '--max-cached-requests 0' (suffix and hybrid: no "
                         "global tree, which would otherwise hold the answers of earlier repeats of the same prompts)")
    ap.add_argument("--baseline-src",
                    help="another gateway package directory (e.g. git archive main gateway | tar -x -C /tmp/base, "
                         "then /tmp/base/gateway): every mode but off (or --baseline-modes) also runs on it, in "
                         "the same repeats, as MODE@baseline")
    ap.add_argument("--baseline-modes", help="the modes --baseline-src runs (default: every mode but off)")
    ap.add_argument("--scorer-cpus",
                    help="CPUs the scorer runs on alone, e.g. 0 (its engine then uses one thread per CPU); the "
                         "proposers, gateways and this client run on the others, so their work does not share the "
                         "Verify's cores (as beside a GPU scorer, or with a remote proposer)")
    ap.add_argument("--out", default="bench_results/overlap.json")
    args = ap.parse_args()
    available = os.sched_getaffinity(0)
    scorer_cpus, other_cpus = available, available
    if args.scorer_cpus is not None:
        try:
            scorer_cpus, other_cpus = split_cpus(args.scorer_cpus, available)
        except ValueError as err:
            ap.error(str(err))
    if not 0.0 <= args.plain_share <= 1.0:
        ap.error(f"--plain-share: a share from 0 to 1, got {args.plain_share}")
    if args.requests_per_stream < 1:
        ap.error(f"--requests-per-stream: must be >= 1, got {args.requests_per_stream}")
    latencies = [float(x) for x in args.latencies.split(",")]
    streams = [int(x) for x in args.streams.split(",")]
    prompts = prompt_ids(args.model)
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown or "off" not in modes:
        ap.error(f"--modes: {'unknown ' + repr(unknown[0]) if unknown else 'off (lock-step) is missing'}; "
                 f"choose from {','.join(MODES)}")
    if args.baseline_modes is not None and not args.baseline_src:
        ap.error("--baseline-modes: needs --baseline-src (the gateway package they run on)")
    if args.baseline_src:
        if not Path(args.baseline_src, "loop.py").is_file():
            ap.error(f"--baseline-src: {args.baseline_src} is not a gateway package directory (no loop.py)")
        candidates = [m for m in modes if m != "off"]
        again = candidates if args.baseline_modes is None else args.baseline_modes.split(",")
        if not set(again) <= set(candidates):
            ap.error(f"--baseline-modes: choose from the measured modes but off ({','.join(candidates)})")
        modes += [m + BASELINE for m in modes if m in again]
    cpu = cpu_model()
    result = {"model": args.model, "cpu": cpu, "scorer_args": args.scorer_args,
              "proposer_args": args.proposer_args, "baseline_src": args.baseline_src,
              "method": args.method, "plain_share": args.plain_share,
              "draft_length": args.draft_length, "k": args.k, "max_tokens": args.max_tokens,
              "requests_per_stream": args.requests_per_stream, "repeats": args.repeats,
              "scorer_cpus": args.scorer_cpus, "rows": []}
    log_dir = tempfile.mkdtemp(prefix="specdec-bench-overlap-")
    os.sched_setaffinity(0, scorer_cpus)  # the scorer (and the stack's idle default gateway) inherit these
    print(f"CPU: {cpu}; scorer arguments: {args.scorer_args or '-'}; scorer CPUs {sorted(scorer_cpus)}, the "
          f"others' {sorted(other_cpus)}\nstarting the services on {args.model}; "
          f"logs in {log_dir}", file=sys.stderr)
    with Stack(model=args.model, num_proposers=0, default_method="none", log_dir=log_dir, metrics=True,
               extra_scorer_args=shlex.split(args.scorer_args)) as stack:
        os.sched_setaffinity(0, other_cpus)  # the proposers and gateways started below, and the client
        gateways = start_services(stack, latencies, modes, args.baseline_src, args.method,
                                  shlex.split(args.proposer_args))
        services = {service.addr: service for service in stack.by_name("gateway-")}
        scorer_pid = stack.by_name("scorer")[0].proc.pid
        proposer_pids = {latency: stack.by_name(f"proposer-{latency:g}ms")[0].proc.pid for latency in latencies}
        result["process_cpus"] = process_cpus({"scorer": scorer_pid, "proposer": proposer_pids[latencies[0]],
                                               "gateway": services[gateways[latencies[0], modes[0]]].proc.pid,
                                               "client": os.getpid()})
        for addr in set(gateways.values()):
            run(addr, prompts, 2, args.k, 8, method=args.method)  # warm up
        combos = [(latency, mode) for latency in latencies for mode in modes]
        for n in streams:
            samples: dict[tuple[float, str], list[dict]] = {combo: [] for combo in combos}
            for rep in range(args.repeats):  # every (latency, mode) once a repeat, in turns
                for latency, mode in combos[rep % len(combos):] + combos[:rep % len(combos)]:
                    gateway = services[gateways[latency, mode]]
                    pids = {"scorer": scorer_pid, "proposer": proposer_pids[latency], "gateway": gateway.proc.pid}
                    before, cpu_before = step_counts(gateway), cpu_readings(pids)
                    sample = run(gateway.addr, prompts, n, args.k, args.max_tokens, args.requests_per_stream,
                                 args.method, args.plain_share, args.draft_length)
                    sample.update((key, count - before[key]) for key, count in step_counts(gateway).items())
                    sample["verify_fit"] = verify_fit(gateway)
                    sample["cpu_ms_per_round"] = cpu_ms_per_round(cpu_before, cpu_readings(pids), sample["rounds"])
                    samples[latency, mode].append(sample)
            reference = samples[latencies[0], "off"][0]["token_ids"]
            for latency, mode in combos:
                runs = samples[latency, mode]
                row = {"latency_ms": latency, "streams": n, "mode": mode,
                       "tok_s": statistics.median(r["tok_s"] for r in runs),
                       "tok_s_runs": [r["tok_s"] for r in runs],
                       "identical_to_lock_step": all(r["token_ids"] == reference for r in runs),
                       # ratios within a repeat (the rows it compares ran minutes apart at most), median
                       "vs_off": _ratio(runs, samples[latency, "off"]),
                       "loss_vs_same_mode_0ms": 1 - _ratio(runs, samples[latencies[0], mode]),
                       "vs_off_0ms": _ratio(runs, samples[latencies[0], "off"]),
                       # against the same mode on --baseline-src's gateway, paired within each repeat
                       "vs_baseline": (_ratio(runs, samples[latency, mode + BASELINE])
                                       if (latency, mode + BASELINE) in samples else None)}
                row["verify_fit_runs"] = [r["verify_fit"] for r in runs]
                row["cpu_ms_per_round"] = {part: _median_or_none([r["cpu_ms_per_round"][part] for r in runs])
                                           for part in CPU_PARTS}
                for key in ("tokens", "mean_accepted_length", "propose_ms_per_round", "verify_ms_per_round",
                            "draft_tokens_per_round", "accepted_per_draft_token", *STEP_COUNTERS):
                    row[key] = statistics.median(r[key] for r in runs)
                result["rows"].append(row)
                print(f"  {latency:g} ms, {n} streams, overlap {mode}: {row['tok_s']:.1f} tok/s",
                      file=sys.stderr)

    result["rows"].sort(key=lambda r: (latencies.index(r["latency_ms"]), r["streams"]))
    mix = f" ({100 * args.plain_share:g}% of the streams plain)" if args.plain_share else ""
    print(f"\nOverlapped rounds vs lock-step: {args.model}, {args.method} k={args.k} {args.draft_length}{mix}, "
          f"{args.requests_per_stream} x {args.max_tokens} tokens per stream, median of {args.repeats} "
          "(ratios: median of the repeats' own)"
          f"\nCPU: {cpu}" + (f"; the scorer alone on CPUs {sorted(scorer_cpus)}, the others on {sorted(other_cpus)}"
                              if args.scorer_cpus is not None else ""))
    print(f"{'latency':>8}{'streams':>8}{'overlap':>15}{'tok/s':>9}{'vs off':>8}{'loss vs 0ms':>12}"
          f"{'vs off@0ms':>11}{'propose ms':>11}{'verify ms':>10}{'acc len':>8}{'drafts':>7}{'acc/draft':>10}"
          f"{'identical':>10}{'overlapped':>11}{'ahead':>6}{'vs base':>8}{'CPU ms s/p/g':>20}")
    for r in result["rows"]:
        print(f"{r['latency_ms']:>6g}ms{r['streams']:>8}{r['mode']:>15}{r['tok_s']:>9.1f}{r['vs_off']:>7.2f}x"
              f"{100 * r['loss_vs_same_mode_0ms']:>11.1f}%{r['vs_off_0ms']:>10.2f}x"
              f"{r['propose_ms_per_round']:>11.2f}{r['verify_ms_per_round']:>10.2f}"
              f"{r['mean_accepted_length']:>8.2f}{r['draft_tokens_per_round']:>7.2f}{r['accepted_per_draft_token']:>10.2f}"
              f"{str(r['identical_to_lock_step']):>10}{r['overlapped_steps']:>11.0f}{r['ahead_rounds']:>6.0f}"
              + (f"{r['vs_baseline']:>7.2f}x" if r["vs_baseline"] is not None else f"{'-':>8}")
              + f"{'/'.join(_cpu(r['cpu_ms_per_round'][part]) for part in CPU_PARTS):>20}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
