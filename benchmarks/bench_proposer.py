"""Proposer service benchmark: the cost of one round through a real proposer
process and its real bidi Propose stream on loopback, as the gateway drives it.

B live sequences (prompts cut from Python stdlib sources, tokenized with the
SmolLM2 tokenizer) are opened on the first round; every later round
appends each sequence's next 3 true tokens and asks k=5 drafts. Updates of
held sequences travel as columns (ProposeRequest.round), as the gateway
sends them; ``--no-columns`` sends one SequenceUpdate each (the format
before), and so does ``--baseline-no-columns`` to a ``--baseline-src``
older than the columns (before d43a469). Otherwise the baseline is sent
columns too: driven the old way, the very same code measured ngram B=256
at 7.3-8.4 us/seq-round against 4.7-5.7 (AMD EPYC). A sequence
that runs out of text is released as completed (so suffix/hybrid's global
tree fills) and re-opened on a new slice. The first sequences run out after
1/B, 2/B, ... of a whole output, so that releases and opens spread over the
rounds as in a server's steady state (about B / 171 of each a round), not
all B in one round. Each method reads its own part of the text, row after
row, so that a suffix tree does not hold the text it drafts for unless the
stream wraps around. Each row runs ``--seconds``. Before the rows, ``--fill-cache
N`` (default 1000, the proposer's default ``--max-cached-requests``) sends N
finished sequences of new text through each replica for every suffix-family
method, so that the rows measure a server whose global tree is full, as in
its steady state (0: start empty).

Reported per (method, B): ms per round (build the round's message as a
gateway would, then one exchange: write the message, read the response, as
gateway/clients.ProposerStream does), µs per sequence-round (round / B), the
exchange alone in µs per sequence-round (from writing the built message to
the response: the proposer service's part, transport included) and the
proposer's compute share (its reported compute_s / round); the 99th
percentile and the worst round (ms) show stalls the mean hides (e.g. an
array of the proposer's growing in one round). From each replica's
Prometheus /metrics, read before and after the row's measured rounds: how
long a message waited from its arrival until the proposer handled it
(specdec_proposer_message_wait_seconds, all replicas: the mean, and the
upper edges of the buckets that hold the 99th percentile and the longest;
"-" for code without the metric).

``--replicas 1,2,4`` (fan-out): the B sequences of one method are spread over
n proposer processes with the gateway's own consistent hashing
(gateway.discovery.ReplicaSet.pick, as gateway/placement.py places them) and
each replica gets its part concurrently (asyncio.gather, as gateway/loop.py's
_propose); reported: round time, each replica's mean compute_s (wall time
in its handler, which grows when more processes than cores share the
machine) and each replica process's CPU time per round (user + system from
/proc/PID/stat, gRPC threads included: the work it was given, whatever the
number of cores).

``--gap-ms G`` waits G ms after each exchange before the next round, as a
gateway waits for the scorer's verification (10-40 ms on a GPU): work a
proposer does between messages (caching finished outputs in the suffix
global trie) then leaves the measured exchange, which is the proposer's
share of the round's critical path. 0 (the default): back-to-back rounds.
Rows still last ``--seconds`` of wall time, gaps included.

``--ahead`` builds the row's messages before it (the workload never
depends on the answers; building them takes up to ``--seconds`` more, the
row ends early if they run out) and sends each round's the moment the
answers of the round before are in, as the gateway's ``--overlap ahead``
sends its drafts-ahead message: the proposer finds the next message
waiting as soon as it has answered, and what it does between messages
(upkeep) cannot hide behind the client's building of the next. With
``--gap-ms G --burst N`` rounds go in bursts of N so, G ms between bursts:
``--burst 2`` is the gateway's ahead loop (fresh drafts waited for, then
the drafts ahead sent at once; then the verification), where upkeep can
wait for the gap.

``--baseline-src DIR`` runs the same rows also against another copy of the
``proposer_svc`` package (e.g. main's:
``git archive main proposer_svc | tar -x -C /tmp/main-src``), in the same run;
``--src DIR`` takes the code under test from such a copy too.

Usage:
    flock /tmp/specdec-bench.lock python benchmarks/bench_proposer.py \
        [--methods ngram,suffix,hybrid] [--batch-sizes 1,32,256] [--seconds 5] [--gap-ms 20 | --ahead] \
        [--replicas 1,2,4] [--baseline-src /tmp/main-src/proposer_svc] [--out bench_results/proposer.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
from package_copy import LOAD_PROPOSER_SVC, RUN_CLI

from specdec.gateway.clients import ProposerStream
from specdec.gateway.discovery import ReplicaSet
from specdec.launcher import free_port, parse_metrics, wait_serving
from specdec.proposer_svc.registry import SUFFIX_METHODS
from specdec.protos.v1 import specdec_pb2 as pb
from specdec.security import aio_channel

PROMPT_LEN = 256  # tokens of each sequence's prompt
OUTPUT_LEN = 512  # tokens appended before the sequence is released and re-opened
APPEND = 3  # tokens appended per round
K = 5  # drafts asked per round
TIMEOUT_S = 60.0
WAIT_METRIC = "specdec_proposer_message_wait_seconds"

#: runs a proposer with ``specdec.proposer_svc`` taken from argv[1] (a
#: baseline copy of the package), the rest of the command line as `specdec`'s
_BOOT = LOAD_PROPOSER_SVC + RUN_CLI


# ------------------------------------------------------------------ text
def token_stream(min_tokens: int) -> np.ndarray:
    """Real text as one int32 token stream: Python stdlib sources, SmolLM2
    tokenizer (the default model's, as benchmarks/bench_suffix_micro.py)."""
    from specdec.models import default_model, load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(default_model()))
    root = Path(os.__file__).parent
    files = sorted(p for p in root.rglob("*.py") if 12_000 < p.stat().st_size < 200_000
                   and not {"test", "tests", "site-packages", "dist-packages"} & set(p.relative_to(root).parts))
    ids: list[int] = []
    for path in files:
        ids.extend(tok.encode(path.read_text(errors="replace")))
        if len(ids) >= min_tokens:
            break
    return np.asarray(ids, dtype=np.int32)


@dataclass
class Seq:
    """One live sequence: its slice of the stream and how far it got."""

    seq_id: str
    start: int  # stream offset of its prompt
    end: int  # context length at which it is released
    sent: int = 0  # tokens the proposer holds (0: open next round)


@dataclass
class Workload:
    """B sequences over one token stream, each sliding through its own slice."""

    stream: np.ndarray
    batch: int
    method: str
    generation: int = 0  # slices handed out before (by earlier rows too)
    columns: bool = True  # held sequences' updates as columns (ProposeRequest.round); False: one message each
    seqs: list[Seq] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.seqs = [self._fresh(i, OUTPUT_LEN * (i + 1) // self.batch) for i in range(self.batch)]

    def _fresh(self, i: int, output_len: int = OUTPUT_LEN) -> Seq:
        """Sequence i's next slice: slices do not overlap until the stream
        wraps around (so the global tree does not hold the very text)."""
        slices = len(self.stream) // (PROMPT_LEN + OUTPUT_LEN)
        start = (self.generation % slices) * (PROMPT_LEN + OUTPUT_LEN)
        self.generation += 1
        return Seq(f"{self.method}-{i}-{self.generation}", start, PROMPT_LEN + max(APPEND, output_len))

    def request(self, seqs: list[Seq], releases: list[str]) -> pb.ProposeRequest:
        """The round's message for ``seqs``: opens as SequenceUpdates, the
        others' updates as columns (ProposeRequest.round), as the gateway
        sends them (gateway/wire.propose_request)."""
        req = pb.ProposeRequest()
        req.releases.extend(pb.SequenceRelease(seq_id=s, completed=True) for s in releases)
        held = [s for s in seqs if s.sent]
        for s in ([] if self.columns else held):
            u = req.sequences.add(seq_id=s.seq_id, context_len=s.sent + APPEND, num_speculative_tokens=K)
            u.token_ids.extend(self.stream[s.start + s.sent:s.start + s.sent + APPEND].tolist())
            s.sent += APPEND
        held = held if self.columns else []
        for s in seqs:
            if s.sent == 0:
                u = req.sequences.add(seq_id=s.seq_id, open=True, context_len=PROMPT_LEN, num_speculative_tokens=K)
                u.token_ids.extend(self.stream[s.start:s.start + PROMPT_LEN].tolist())
                u.options.method, u.options.min_token_prob = self.method, 0.1
                s.sent = PROMPT_LEN
        if held:
            cols = req.round
            cols.seq_ids.extend([s.seq_id for s in held])
            cols.token_counts.extend([APPEND] * len(held))
            at = np.array([s.start + s.sent for s in held])
            cols.token_ids.extend(self.stream[(at[:, None] + np.arange(APPEND)).ravel()].tolist())
            cols.context_lens.extend([s.sent + APPEND for s in held])
            cols.num_speculative_tokens.extend([K] * len(held))
            for s in held:
                s.sent += APPEND
        return req

    def recycle(self) -> list[str]:
        """Replaces the sequences that ran out of text; returns their ids (to
        release as completed)."""
        done = []
        for i, s in enumerate(self.seqs):
            if s.sent >= s.end:
                done.append(s.seq_id)
                self.seqs[i] = self._fresh(i)
        return done


# ------------------------------------------------------------- processes
class Proposers:
    """n proposer processes serving `methods` (from `src` when given)."""

    def __init__(self, n: int, methods: str, src: str | None, log_dir: str) -> None:
        self.procs, self.addrs, self.metrics_ports = [], [], []
        for i in range(n):
            port, metrics_port = free_port(), free_port()
            cli = ["proposer", "--methods", methods, "--port", str(port), "--log-level", "WARNING",
                   "--metrics-port", str(metrics_port)]
            cmd = ([sys.executable, "-c", _BOOT, src, *cli] if src else [sys.executable, "-m", "specdec.cli", *cli])
            log = open(os.path.join(log_dir, f"proposer{i}-{port}.log"), "w")
            self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
            self.addrs.append(f"127.0.0.1:{port}")
            self.metrics_ports.append(metrics_port)
        for proc, addr in zip(self.procs, self.addrs):
            wait_serving(addr, proc, 120, f"proposer {addr}")

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait(10)


async def fill_cache(addrs: list[str], workload: Workload, count: int) -> None:
    """Opens, completes and releases ``count`` sequences of new text (the
    workload's next slices, whole outputs) on every replica, a message of
    workload.batch sequences at a time."""
    for addr in addrs:
        channel = aio_channel(addr, None, [])
        stream = ProposerStream(channel)
        for _ in range(0, count, workload.batch):
            seqs = [workload._fresh(i) for i in range(workload.batch)]
            opens, outputs = pb.ProposeRequest(), pb.ProposeRequest()
            for seq in seqs:
                prompt, end = seq.start + PROMPT_LEN, seq.start + PROMPT_LEN + OUTPUT_LEN
                u = opens.sequences.add(seq_id=seq.seq_id, open=True, token_ids=workload.stream[seq.start:prompt],
                                        context_len=PROMPT_LEN)
                u.options.method = workload.method
                outputs.sequences.add(seq_id=seq.seq_id, token_ids=workload.stream[prompt:end],
                                      context_len=PROMPT_LEN + OUTPUT_LEN)
            releases = pb.ProposeRequest(releases=[pb.SequenceRelease(seq_id=seq.seq_id, completed=True)
                                                   for seq in seqs])
            for request in (opens, outputs, releases):
                await stream.exchange(request, TIMEOUT_S)
        stream.reset()
        await channel.close()


class Waits(NamedTuple):
    """The replicas' message-wait histograms added up, so far."""

    buckets: dict[float, float]  # bucket upper edge (s, +inf included) -> messages (cumulative)
    total_s: float  # the waits' sum


def message_waits(metrics_ports: list[int]) -> Waits:
    """The replicas' WAIT_METRIC so far (no buckets: the code under test
    does not export it)."""
    import urllib.request

    buckets: dict[float, float] = {}
    total_s = 0.0
    for port in metrics_ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            samples = parse_metrics(r.read().decode())
        for key, value in samples.items():
            if key.startswith(f"{WAIT_METRIC}_bucket{{"):
                edge = float(key.split('le="', 1)[1].split('"', 1)[0])
                buckets[edge] = buckets.get(edge, 0.0) + value
        total_s += samples.get(f"{WAIT_METRIC}_sum", 0.0)
    return Waits(buckets, total_s)


def wait_summary(before: Waits, after: Waits) -> dict:
    """Mean wait (ms) of the messages between two ``message_waits``, and the
    upper edges (ms) of the buckets holding their 99th percentile and their
    longest; None without the metric or messages."""
    edges = sorted(after.buckets)
    counts = [after.buckets[e] - before.buckets.get(e, 0.0) for e in edges]
    if not counts or not counts[-1]:
        return {"wait_mean_ms": None, "wait_p99_le_ms": None, "wait_max_le_ms": None}
    total = counts[-1]
    p99 = next(e for e, c in zip(edges, counts) if c >= 0.99 * total)
    longest = next(e for e, c in zip(edges, counts) if c >= total)
    return {"wait_mean_ms": 1e3 * (after.total_s - before.total_s) / total,
            "wait_p99_le_ms": 1e3 * p99, "wait_max_le_ms": 1e3 * longest}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process pid so far (Linux /proc), or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14 and 15


def replica_cpu_ms(before: list[float | None], after: list[float | None], rounds: int) -> list[float] | None:
    """Each replica's CPU ms per round between two cpu_seconds readings."""
    if not rounds or None in before or None in after:
        return None
    return [1e3 * (a - b) / rounds for a, b in zip(after, before)]  # type: ignore[operator]


async def run_row(addrs: list[str], metrics_ports: list[int], pids: list[int], workload: Workload, seconds: float,
                  gap_s: float, ahead: bool, burst: int) -> dict:
    """Rounds for ``seconds`` (after one opening round and one warm round),
    ``gap_s`` apart (ahead: every ``burst`` rounds), the messages built
    before the rounds when ``ahead``; the sequences go to replicas by the
    gateway's hash ring. The replicas' message waits are read from
    metrics_ports (their /metrics) around the measured rounds."""
    ring = ReplicaSet("bench", addrs)
    channels = {a: aio_channel(a, None, []) for a in addrs}
    streams = {a: ProposerStream(channels[a]) for a in addrs}
    by_replica = {a: [] for a in addrs}
    for s in workload.seqs:
        by_replica[ring.pick(s.seq_id)].append(s)

    def build() -> dict[str, tuple[pb.ProposeRequest, int]]:
        """The round's message for each replica, with its number of sequences."""
        releases = workload.recycle()
        if releases:
            by_replica.clear()
            by_replica.update({a: [] for a in addrs})
            for s in workload.seqs:
                by_replica[ring.pick(s.seq_id)].append(s)
        return {a: (workload.request(by_replica[a], [r for r in releases if ring.pick(r) == a]), len(by_replica[a]))
                for a in addrs}

    async def ask(addr: str, request: pb.ProposeRequest, num_seqs: int) -> tuple[float, int, float]:
        sent = time.perf_counter()
        response = await streams[addr].exchange(request, TIMEOUT_S)
        took = time.perf_counter() - sent
        assert len(response.drafts) + len(response.round.draft_counts) == num_seqs
        bad = [d for d in response.drafts if d.status != pb.SEQUENCE_STATUS_OK]
        assert not bad and not response.round.statuses, (bad, response.round.messages)
        return response.compute_s, sum(len(d.token_ids) for d in response.drafts) + len(response.round.token_ids), \
            took

    built: deque[dict[str, tuple[pb.ProposeRequest, int]]] = deque()  # (ahead) the rounds' messages
    if ahead:
        t_built = time.perf_counter() + seconds
        while time.perf_counter() < t_built or len(built) < 3:
            built.append(build())
    count = 0  # rounds so far

    async def one_round() -> tuple[float, list[float], int, float]:
        nonlocal count
        count += 1
        start = time.perf_counter()
        messages = built.popleft() if ahead else build()
        found = await asyncio.gather(*(ask(a, *messages[a]) for a in addrs))
        wall = time.perf_counter() - start
        if gap_s and (not ahead or count % burst == 0):
            await asyncio.sleep(gap_s)  # the scorer's verification
        return wall, [c for c, _, _ in found], sum(n for _, n, _ in found), max(e for _, _, e in found)

    for _ in range(2):  # open, then one warm round
        await one_round()
    rounds, computes, exchanges, drafts = [], [], [], 0
    waits_before = message_waits(metrics_ports)
    cpu_before = [cpu_seconds(pid) for pid in pids]
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end and (built or not ahead):
        wall, compute, n, exchange = await one_round()
        rounds.append(wall)
        computes.append(compute)
        exchanges.append(exchange)
        drafts += n
    cpu_ms = replica_cpu_ms(cpu_before, [cpu_seconds(pid) for pid in pids], len(rounds))
    waits = wait_summary(waits_before, message_waits(metrics_ports))
    for s in streams.values():
        s.reset()
    for c in channels.values():
        await c.close()
    round_s = float(np.mean(rounds))
    compute = np.asarray(computes)  # [rounds, replicas]
    return {"method": workload.method, "batch": workload.batch, "replicas": len(addrs), "rounds": len(rounds),
            "ms_per_round": 1e3 * round_s, "median_ms_per_round": 1e3 * float(np.median(rounds)),
            "p99_ms_per_round": 1e3 * float(np.percentile(rounds, 99)), "max_ms_per_round": 1e3 * float(max(rounds)),
            "us_per_seq_round": 1e6 * round_s / workload.batch,
            "exchange_us_per_seq_round": 1e6 * float(np.mean(exchanges)) / workload.batch,
            "compute_share": float(compute.max(axis=1).mean() / round_s),
            "replica_compute_ms": [1e3 * float(c) for c in compute.mean(axis=0)], "replica_cpu_ms": cpu_ms,
            "drafts_per_seq_round": drafts / (len(rounds) * workload.batch), **waits}


def bench(label: str, src: str | None, methods: list[str], batches: list[int], replicas: list[int],
          seconds: float, gap_s: float, fill: int, stream: np.ndarray, log_dir: str, columns: bool,
          ahead: bool, burst: int) -> list[dict]:
    rows = []
    for n in replicas:
        procs = Proposers(n, ",".join(methods), src, log_dir)
        # slices handed out per method: each method starts in its own part of the
        # text and goes on from there, so its rows do not read what it cached
        slices = len(stream) // (PROMPT_LEN + OUTPUT_LEN)
        handed_out = {m: i * slices // len(methods) for i, m in enumerate(methods)}
        try:
            for method in [m for m in methods if m in SUFFIX_METHODS] if fill else []:
                workload = Workload(stream, 100, method, handed_out[method])
                asyncio.run(fill_cache(procs.addrs, workload, fill))
                handed_out[method] = workload.generation
            for method in methods:
                for b in (batches if n == 1 else [max(batches)]):
                    workload = Workload(stream, b, method, handed_out[method], columns=columns)
                    pids = [p.pid for p in procs.procs]
                    row = asyncio.run(run_row(procs.addrs, procs.metrics_ports, pids, workload, seconds, gap_s, ahead,
                                              burst))
                    handed_out[method] = workload.generation
                    row["code"], row["columns"] = label, columns
                    rows.append(row)
                    print(f"  {label:9s} {method:7s} B={b:<4d} replicas={n}: {row['ms_per_round']:8.2f} ms/round "
                          f"{row['us_per_seq_round']:7.1f} us/seq-round  p99 {row['p99_ms_per_round']:7.2f} ms  "
                          f"max {row['max_ms_per_round']:7.2f} ms  compute share {row['compute_share']:.2f}  "
                          f"wait mean {_ms(row['wait_mean_ms'])} p99<= {_ms(row['wait_p99_le_ms'])} "
                          f"max<= {_ms(row['wait_max_le_ms'])} ms",
                          flush=True)
        finally:
            procs.stop()
    return rows


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")


def git_commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent).stdout.strip()


def print_table(rows: list[dict]) -> None:
    print(f"\n{'code':9s} {'method':7s} {'B':>4s} {'repl':>4s} {'ms/round':>9s} {'p99 ms':>8s} {'max ms':>8s} "
          f"{'us/seq-rnd':>10s} {'exchange':>8s} {'compute':>7s} {'wait ms':>7s} {'p99<=':>6s} {'max<=':>6s}  "
          f"replica compute ms | CPU ms")
    for r in rows:
        print(f"{r['code']:9s} {r['method']:7s} {r['batch']:4d} {r['replicas']:4d} {r['ms_per_round']:9.2f} "
              f"{r['p99_ms_per_round']:8.2f} {r['max_ms_per_round']:8.2f} {r['us_per_seq_round']:10.1f} "
              f"{r['exchange_us_per_seq_round']:8.1f} {r['compute_share']:7.2f} {_ms(r['wait_mean_ms']):>7s} "
              f"{_ms(r['wait_p99_le_ms']):>6s} {_ms(r['wait_max_le_ms']):>6s}  "
              f"{' '.join(f'{c:.2f}' for c in r['replica_compute_ms'])} | "
              f"{' '.join(f'{c:.2f}' for c in r.get('replica_cpu_ms') or []) or '-'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="ngram,suffix,hybrid")
    ap.add_argument("--batch-sizes", default="1,32,256")
    ap.add_argument("--replicas", default="1", help="comma-separated replica counts (fan-out rows use the largest B)")
    ap.add_argument("--seconds", type=float, default=5.0, help="per row")
    ap.add_argument("--gap-ms", type=float, default=0.0, help="wait between rounds (the scorer's verification)")
    ap.add_argument("--ahead", action="store_true",
                    help="build the rounds' messages first, send each the moment the round before is answered")
    ap.add_argument("--burst", type=int, default=1, help="--ahead with --gap-ms: rounds back to back between gaps")
    ap.add_argument("--fill-cache", type=int, default=1000,
                    help="finished sequences sent first to fill the suffix global tree (0: none)")
    ap.add_argument("--baseline-src", help="another proposer_svc package directory to measure in the same run")
    ap.add_argument("--src", help="the proposer_svc package directory under test (default: the installed one), "
                                  "e.g. a snapshot, so that edits during a queued run do not leak in")
    ap.add_argument("--no-columns", action="store_true",
                    help="send every update as its own SequenceUpdate (the message format before "
                         "ProposeRequest.round), not the held sequences' as columns")
    ap.add_argument("--baseline-no-columns", action="store_true",
                    help="the baseline code predates ProposeRequest.round (d43a469): send it one SequenceUpdate each")
    ap.add_argument("--out", default="bench_results/proposer.json")
    args = ap.parse_args()
    methods = args.methods.split(",")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    replicas = [int(n) for n in args.replicas.split(",")]
    cpu = cpu_model()
    print(f"CPU: {cpu}; {os.cpu_count()} cores; commit {git_commit()}", flush=True)
    fills = args.fill_cache * len([m for m in methods if m in SUFFIX_METHODS])
    stream = token_stream((fills + 8 * max(batches)) * (PROMPT_LEN + OUTPUT_LEN))
    print(f"text: {len(stream)} tokens", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as log_dir:
        if args.baseline_src:
            rows += bench("baseline", args.baseline_src, methods, batches, replicas, args.seconds, args.gap_ms / 1e3,
                          args.fill_cache, stream, log_dir, not args.baseline_no_columns, args.ahead, args.burst)
        rows += bench("this", args.src, methods, batches, replicas, args.seconds, args.gap_ms / 1e3, args.fill_cache,
                      stream, log_dir, not args.no_columns, args.ahead, args.burst)
    print_table(rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "cpu": cpu, "commit": git_commit(), "baseline_src": args.baseline_src, "src": args.src,
        "seconds_per_row": args.seconds, "gap_ms": args.gap_ms, "ahead": args.ahead, "burst": args.burst,
        "fill_cache": args.fill_cache, "prompt_len": PROMPT_LEN, "append": APPEND, "k": K, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
