"""Proposer micro-benchmark: our numba SuffixProposer against arctic-inference's
SuffixDecodingCache (C++) on the same recorded token streams.

Workloads (SmolLM2 tokenizer; several requests in sequence so the global tree
of finished outputs matters):
  code       prompt = the start of a Python stdlib file, output = what follows
  edit       prompt = a code chunk, output = the chunk with identifiers renamed
  synthetic  phrases drawn from a shared phrase bank (cross-request repeats)

For every request the context grows by a fixed schedule (recorded once from
our proposer: accepted draft tokens + 1, as in greedy verification), so every
implementation sees identical contexts: per call we time the update
(extend / add_active_response) and the speculation, and compare the drafts.
"Accepted" counts draft tokens that equal the true continuation.

arctic-inference runs in its own virtualenv (it is not a project
dependency), driven by this same file in ``--driver`` mode:
    python -m venv /tmp/arctic-venv
    PIP_CONSTRAINT=/tmp/constraints.txt /tmp/arctic-venv/bin/pip install \
        torch==2.13.0 arctic-inference numpy

``--upkeep N`` measures instead the global trie's upkeep while its cache
fills from empty: a SuffixProposer (1000 cached requests, depth 64) finishes
2 requests a round, each with an output of 496 tokens of stdlib text (N in
all), and the round's stops, which put the outputs into the global trie and
evict the oldest, are timed (the worst round shows the trie's arrays growing);
``--baseline-src DIR`` times another copy of the proposer_svc package too,
each code in its own process. Then the same as a served replica does it
(cache_between_messages): the stops queue the outputs and the upkeep runs
in the servicer's slices (``between_messages(UPKEEP_SLICE_S)`` until none is
left; a copy without budgets: one ``between_messages()`` a round), each call
timed: its longest is what a message arriving during upkeep may wait (the
rest of one slice), against the whole round's upkeep before. The calls are
also told apart by what they did: a hash shard's doubling (or a step of
one), a compaction of the pool (or a step of one), an eviction (or a step
of one), or only inserts.

``--arena-compact 32,256,1024`` times instead one compaction of the pool
of live requests' tries (suffix.RequestArena, on the message path when a
context outgrows its region and the pool is full): 2B requests opened
(contexts of 100-1200 tokens of stdlib text), every other one closed, then
the first compaction (which packs the B live ones) is timed, ARENA_REPEATS
fresh arenas per B (with ``--baseline-src``, the other copy's too, each code
in its own process, in turns).

``--rounds 32,256`` times instead B sequences' rounds in process, as
bench_proposer.py drives them through a server (prompts of 256 tokens,
3 tokens appended and k=5 asked a round, released after 512 and opened
again on new text, releases spread over the rounds), with the global trie
first filled to its default size (1000 outputs): per round, the drafting (``advance``) and
the rest (the released sequences' stops and new opens, then
``between_messages()`` until the global trie's upkeep is done), each in
us per sequence-round; ROUNDS_TIMED rounds after ROUNDS_WARM (with
``--baseline-src``, the other copy's too, each code in its own process,
in turns, twice).

Usage:
    python benchmarks/bench_suffix_micro.py [--arctic-python /tmp/arctic-venv/bin/python]
        [--repeats 3] [--k 8] [--out bench_results/suffix_micro.json]
    python benchmarks/bench_suffix_micro.py --upkeep 2400 [--baseline-src /tmp/old/proposer_svc]
        [--out bench_results/suffix_upkeep.json]
    python benchmarks/bench_suffix_micro.py --arena-compact 32,256,1024 [--baseline-src /tmp/old/proposer_svc]
        [--out bench_results/suffix_arena_compact.json]
    python benchmarks/bench_suffix_micro.py --rounds 32,256 [--baseline-src /tmp/old/proposer_svc]
        [--out bench_results/suffix_rounds.json]
"""
from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from package_copy import LOAD_PROPOSER_SVC

MAX_TREE_DEPTH = 64
MAX_SPEC_FACTOR = 1.0
MIN_TOKEN_PROB = 0.1


# ------------------------------------------------------------------ streams
def _stdlib_sources(count: int) -> list[str]:
    """Deterministic choice of larger stdlib modules (code repeats itself)."""
    root = Path(os.__file__).parent
    files = sorted(p for p in root.glob("*.py") if 12_000 < p.stat().st_size < 200_000)
    step = max(1, len(files) // count)
    return [files[i].read_text(errors="replace") for i in range(0, step * count, step)][:count]


def _code_requests(tok, count: int) -> list[tuple[list[int], list[int]]]:
    requests = []
    for text in _stdlib_sources(count):
        ids = tok.encode(text)
        requests.append((ids[:768], ids[768:768 + 384]))
    return requests


def _edit_requests(tok, count: int) -> list[tuple[list[int], list[int]]]:
    requests = []
    for text in _stdlib_sources(2 * count)[count:]:
        chunk = text[2000:4500]
        edited = chunk.replace("self", "this").replace("return", "yield")
        prompt = tok.encode("Rename self to this and return to yield:\n" + chunk + "\n---\n")
        requests.append((prompt, tok.encode(edited)[:512]))
    return requests


def _synthetic_requests(count: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    rng = np.random.default_rng(seed)
    bank = [rng.integers(0, 49152, int(rng.integers(4, 24))).tolist() for _ in range(64)]

    def stream(n_phrases: int) -> list[int]:
        out: list[int] = []
        for i in rng.zipf(1.5, n_phrases):
            out += bank[int(i - 1) % len(bank)] + rng.integers(0, 49152, 2).tolist()
        return out

    return [(stream(20), stream(25)) for _ in range(count)]


def build_workloads(num_requests: int) -> dict[str, list[tuple[list[int], list[int]]]]:
    from specdec.models import default_model, load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(default_model()))
    return {"code": _code_requests(tok, num_requests),
            "edit": _edit_requests(tok, num_requests),
            "synthetic": _synthetic_requests(num_requests)}


def _accepted(draft: list[int], truth: list[int]) -> int:
    n = 0
    for d, t in zip(draft, truth):
        if d != t:
            break
        n += 1
    return n


def record_schedule(requests, k: int, max_cached: int) -> list[list[int]]:
    """Per request, the context growth per round when our suffix drafts are
    verified greedily against the recorded output (accepted + 1 tokens)."""
    from specdec.proposer_svc.base import SeqOptions
    from specdec.proposer_svc.suffix import SuffixConfig, SuffixProposer

    prop = SuffixProposer(SuffixConfig(max_cached, MAX_TREE_DEPTH))
    schedule = []
    for r, (prompt, output) in enumerate(requests):
        prop.start(str(r), np.array(prompt, dtype=np.int32), SeqOptions())
        steps, pos = [], 0
        while pos < len(output):
            draft = prop.propose([(str(r), k)])[0].token_ids.tolist()
            step = min(_accepted(draft, output[pos:]) + 1, len(output) - pos)
            prop.extend(str(r), np.array(output[pos:pos + step], dtype=np.int32))
            steps.append(step)
            pos += step
        prop.stop(str(r), completed=True)
        schedule.append(steps)
    return schedule


# ------------------------------------------------------------------ drivers
def run_ours(method: str, requests, schedule, k: int, max_cached: int) -> dict:
    """Replays the schedule on one of our proposers; times every call."""
    from specdec.proposer_svc.base import SeqOptions
    from specdec.proposer_svc.hybrid import HybridConfig, HybridProposer
    from specdec.proposer_svc.ngram import NgramProposer
    from specdec.proposer_svc.suffix import SuffixConfig, SuffixProposer

    suffix_config = SuffixConfig(max_cached, MAX_TREE_DEPTH)
    prop = {"suffix": lambda: SuffixProposer(suffix_config),
            "ngram": NgramProposer,
            "hybrid": lambda: HybridProposer(HybridConfig(suffix=suffix_config))}[method]()
    opts = SeqOptions(max_tree_depth=MAX_TREE_DEPTH, max_spec_factor=MAX_SPEC_FACTOR,
                      min_token_prob=MIN_TOKEN_PROB)
    clock = time.perf_counter_ns
    drafts, start_ns, update_ns, spec_ns = [], [], [], []
    gc.disable()
    for r, ((prompt, output), steps) in enumerate(zip(requests, schedule)):
        seq, out = str(r), np.array(output, dtype=np.int32)
        t0 = clock()
        prop.start(seq, np.array(prompt, dtype=np.int32), opts)
        start_ns.append(clock() - t0)
        pos = 0
        for step in steps:
            t0 = clock()
            draft = prop.propose([(seq, k)])[0]
            spec_ns.append(clock() - t0)
            drafts.append(draft.token_ids.tolist())
            t0 = clock()
            prop.extend(seq, out[pos:pos + step])
            update_ns.append(clock() - t0)
            pos += step
        prop.stop(seq, completed=True)
    gc.enable()
    return {"drafts": drafts, "start_ns": start_ns, "update_ns": update_ns, "spec_ns": spec_ns,
            "memory_bytes": prop.stats().get("memory_bytes", 0.0)}


def run_arctic(requests, schedule, k: int, max_cached: int) -> dict:
    """The same replay on arctic-inference (run inside its virtualenv)."""
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    cache = SuffixDecodingCache(max_tree_depth=MAX_TREE_DEPTH, max_cached_requests=max_cached)
    clock = time.perf_counter_ns
    drafts, start_ns, update_ns, spec_ns = [], [], [], []
    gc.disable()
    for r, ((prompt, output), steps) in enumerate(zip(requests, schedule)):
        full = np.array(prompt + output, dtype=np.int32)
        out = np.array(output, dtype=np.int32)
        t0 = clock()
        cache.start_request(r, full[:len(prompt)])
        start_ns.append(clock() - t0)
        pos = 0
        for step in steps:
            context = full[:len(prompt) + pos]
            t0 = clock()
            draft = cache.speculate(r, context, max_spec_tokens=k, max_spec_factor=MAX_SPEC_FACTOR,
                                    min_token_prob=MIN_TOKEN_PROB)
            spec_ns.append(clock() - t0)
            drafts.append(list(draft.token_ids))
            t0 = clock()
            cache.add_active_response(r, out[pos:pos + step])
            update_ns.append(clock() - t0)
            pos += step
        cache.stop_request(r)
    gc.enable()
    memory = cache._global_tree.estimate_memory()  # private, the only memory gauge it has
    return {"drafts": drafts, "start_ns": start_ns, "update_ns": update_ns, "spec_ns": spec_ns,
            "memory_bytes": float(memory)}


def _driver_main(in_path: str, out_path: str) -> None:
    job = json.loads(Path(in_path).read_text())
    run = run_arctic(job["requests"], job["schedule"], job["k"], job["max_cached"])
    Path(out_path).write_text(json.dumps(run))


def run_arctic_subprocess(python: str, requests, schedule, k: int, max_cached: int) -> dict:
    """One timed replay on arctic-inference, in its own virtualenv."""
    with tempfile.TemporaryDirectory() as tmp:
        job = {"k": k, "max_cached": max_cached, "requests": requests, "schedule": schedule}
        in_path, out_path = Path(tmp, "job.json"), Path(tmp, "result.json")
        in_path.write_text(json.dumps(job))
        subprocess.run([python, __file__, "--driver", str(in_path), str(out_path)], check=True)
        return json.loads(out_path.read_text())


# ------------------------------------------------------------------ upkeep
UPKEEP_OUTPUT, UPKEEP_PER_ROUND, UPKEEP_CACHED = 512, 2, 1000

#: loads ``specdec.proposer_svc`` from argv[1] (a copy of the package) before
#: running this file's upkeep driver with the rest of the command line
_BOOT = LOAD_PROPOSER_SVC + """
import os, runpy
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))  # its sibling modules, as when run directly
runpy.run_path(sys.argv[0], run_name="__main__")
"""


CacheState = tuple[np.ndarray, bool, bool, np.ndarray, tuple[int | None, int]]


def _cache_state(glob) -> CacheState:
    """(hash shard sizes, a doubling under way, a compaction under way,
    (slot, time base, start) of each cached output, (the oldest output's
    slot, its tokens evicted)) of a _GlobalCache (a copy that doubles
    shards, compacts or evicts at once has no ``_doubling``,
    ``_compaction`` or ``evicted``)."""
    from specdec.proposer_svc.suffix import S_START, S_TIME, T_SIZE

    slots = np.fromiter(glob.fifo, dtype=np.int64, count=len(glob.fifo))
    cached = np.stack([slots, glob.trie.seqs[slots, S_TIME], glob.trie.seqs[slots, S_START]])
    return (glob.trie.shards[:, T_SIZE].copy(), getattr(glob.trie, "_doubling", None) is not None,
            getattr(glob.trie, "_compaction", None) is not None, cached,
            (glob.fifo[0] if glob.fifo else None, getattr(glob, "evicted", 0)))


def _moved_any(glob, cached: np.ndarray) -> bool:
    """Whether an output of cached ((slot, time base, start) columns, as
    _cache_state) is still in its slot at another start: the pool was
    compacted."""
    from specdec.proposer_svc.suffix import S_START, S_TIME

    slots, times, starts = cached
    seqs = glob.trie.seqs
    return bool(((seqs[slots, S_TIME] == times) & (seqs[slots, S_START] != starts)).any())


def _call_kind(glob, before: CacheState) -> str:
    """What a between_messages call did, from _cache_state before and after
    it, the first that holds of: "double" (a hash shard doubled, or a step
    of a doubling), "compact" (outputs moved in the pool, or a step of a
    compaction), "evict" (the oldest output left, or a step of that), or
    "insert" (only inserts)."""
    sizes, doubling, compacting, cached, oldest = before
    after_sizes, after_doubling, after_compacting, _, after_oldest = _cache_state(glob)
    if doubling or after_doubling or (after_sizes != sizes).any():
        return "double"
    if compacting or after_compacting or _moved_any(glob, cached):
        return "compact"
    return "evict" if oldest[0] is not None and after_oldest != oldest else "insert"


def run_upkeep(outputs: np.ndarray, served: bool) -> dict[str, list]:
    """Each round: UPKEEP_PER_ROUND requests open (the first 16 tokens of a
    row of outputs, int32 [n, UPKEEP_OUTPUT], as the prompt), get the rest and
    finish; timed (ms): each round's stops and upkeep ("rounds") and, served,
    each between_messages call ("calls", what each did in "kinds")."""
    from specdec.proposer_svc.base import SeqOptions
    from specdec.proposer_svc.suffix import SuffixConfig, SuffixProposer

    try:  # a copy whose upkeep runs in slices
        from specdec.proposer_svc.server import UPKEEP_SLICE_S
        slice_s: float | None = UPKEEP_SLICE_S
    except ImportError:
        slice_s = None
    prop = SuffixProposer(SuffixConfig(UPKEEP_CACHED, MAX_TREE_DEPTH, cache_between_messages=served))
    rounds, calls, kinds = [], [], []
    gc.disable()
    for r in range(0, len(outputs), UPKEEP_PER_ROUND):
        seqs = [str(i) for i in range(r, min(r + UPKEEP_PER_ROUND, len(outputs)))]
        for seq in seqs:
            prop.start(seq, outputs[int(seq), :16], SeqOptions())
            prop.extend(seq, outputs[int(seq), 16:])
        t0 = time.perf_counter()
        for seq in seqs:
            prop.stop(seq, completed=True)
        while served:
            before = _cache_state(prop._global)
            t1 = time.perf_counter()
            left = prop.between_messages(slice_s) if slice_s is not None else prop.between_messages()
            calls.append(1e3 * (time.perf_counter() - t1))
            kinds.append(_call_kind(prop._global, before))
            if not left:
                break
        rounds.append(1e3 * (time.perf_counter() - t0))
    gc.enable()
    return {"rounds": rounds, "calls": calls, "kinds": kinds}


def _upkeep_driver(in_path: str, out_path: str) -> None:
    outputs = np.load(in_path)
    Path(out_path).write_text(json.dumps({"stops": run_upkeep(outputs, False), "served": run_upkeep(outputs, True)}))


CALL_KINDS = ("insert", "evict", "double", "compact")


def _by_kind(calls: np.ndarray, kinds: list[str]) -> dict[str, dict]:
    """Count, p99 and max (ms) of the calls of each kind (none: {})."""
    found = {}
    for kind in CALL_KINDS if kinds else ():
        ms = calls[np.array(kinds) == kind]
        found[kind] = {"calls": len(ms), "p99_ms": float(np.percentile(ms, 99)) if len(ms) else float("nan"),
                       "max_ms": float(ms.max()) if len(ms) else float("nan")}
    return found


def upkeep_main(count: int, baseline_src: str | None, out: str) -> None:
    from bench_proposer import token_stream

    stream = token_stream(count * UPKEEP_OUTPUT)
    outputs = stream[:count * UPKEEP_OUTPUT].reshape(count, UPKEEP_OUTPUT)
    results = {"outputs": count, "output_len": UPKEEP_OUTPUT, "per_round": UPKEEP_PER_ROUND,
               "cached_requests": UPKEEP_CACHED, "baseline_src": baseline_src, "rows": {}}
    with tempfile.TemporaryDirectory() as tmp:
        np.save(Path(tmp, "outputs.npy"), outputs)
        for label, src in (("baseline", baseline_src), ("this", None)):
            if label == "baseline" and not src:
                continue
            result = Path(tmp, f"{label}.json")
            driver = [__file__, "--upkeep-driver", str(Path(tmp, "outputs.npy")), str(result)]
            subprocess.run([sys.executable, *(["-c", _BOOT, src] if src else []), *driver], check=True)
            timed = json.loads(result.read_text())
            for mode in ("stops", "served"):
                ms = np.array(timed[mode]["rounds"])
                full = ms[UPKEEP_CACHED // UPKEEP_PER_ROUND:]  # rounds once the cache is full (evictions too)
                calls = np.array(timed[mode]["calls"] or [np.nan])
                results["rows"][f"{label} {mode}"] = {
                    "rounds": len(ms), "mean_ms": float(ms.mean()), "p50_ms": float(np.median(ms)),
                    "p99_ms": float(np.percentile(ms, 99)), "max_ms": float(ms.max()), "max_round": int(ms.argmax()),
                    "full_mean_ms": float(full.mean()) if len(full) else None,
                    "calls": len(timed[mode]["calls"]), "call_p99_ms": float(np.percentile(calls, 99)),
                    "call_max_ms": float(calls.max()), "calls_by_kind": _by_kind(calls, timed[mode]["kinds"])}
    print("rounds: a round's stops and upkeep; calls (served): each between_messages call, what a message "
          "arriving during upkeep may wait")
    print(f"{'code':16s} {'rounds':>6s} {'mean ms':>8s} {'p50':>6s} {'p99':>6s} {'max':>7s} {'at round':>8s} "
          f"{'full mean':>9s} {'calls':>6s} {'call p99':>8s} {'call max':>8s}")
    for label, r in results["rows"].items():
        print(f"{label:16s} {r['rounds']:6d} {r['mean_ms']:8.2f} {r['p50_ms']:6.2f} {r['p99_ms']:6.2f} "
              f"{r['max_ms']:7.1f} {r['max_round']:8d} {r['full_mean_ms'] or float('nan'):9.2f} "
              f"{r['calls']:6d} {r['call_p99_ms']:8.2f} {r['call_max_ms']:8.1f}")
    print(f"\nserved calls by what they did: count, p99 / max ms\n{'code':16s} "
          + " ".join(f"{kind:>22s}" for kind in CALL_KINDS))
    for label, r in results["rows"].items():
        if r["calls_by_kind"]:
            print(f"{label:16s} " + " ".join(
                f"{k['calls']:6d} {k['p99_ms']:7.2f} / {k['max_ms']:5.1f}" for k in r["calls_by_kind"].values()))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


ARENA_REPEATS = 4


def _in_process(driver_flag: str, spec: dict, src: str | None, tmp: str):
    """Runs this file's driver ``driver_flag`` on spec in a child process
    (with the proposer_svc copy in src, if any); its JSON result."""
    spec_path, result = Path(tmp, "spec.json"), Path(tmp, "result.json")
    spec_path.write_text(json.dumps(spec))
    driver = [__file__, driver_flag, str(spec_path), str(result)]
    subprocess.run([sys.executable, *(["-c", _BOOT, src] if src else []), *driver], check=True)
    return json.loads(result.read_text())


def _arena_driver(in_path: str, out_path: str) -> None:
    """The arena-compaction timings of the proposer_svc this process loaded."""
    from specdec.proposer_svc.base import SeqOptions
    from specdec.proposer_svc.suffix import RequestArena

    spec = json.loads(Path(in_path).read_text())
    text = np.load(spec["text"])
    rng = np.random.default_rng(0)
    ms = []
    for _ in range(ARENA_REPEATS):
        arena, at = RequestArena(MAX_TREE_DEPTH), 0
        slots = []
        for _ in range(2 * spec["live"]):
            n = int(rng.integers(100, 1200))
            slots.append(arena.open(text[at:at + n], MAX_TREE_DEPTH, SeqOptions()))
            at = (at + n) % (len(text) - 1200)
        for slot in slots[::2]:
            arena.close(slot)
        start = time.perf_counter()
        arena._compact(1000)
        ms.append(1e3 * (time.perf_counter() - start))
    Path(out_path).write_text(json.dumps(ms))


def arena_main(sizes: list[int], baseline_src: str | None, out: str) -> None:
    from bench_proposer import token_stream

    results: dict = {"repeats": ARENA_REPEATS, "baseline_src": baseline_src, "rows": {}}
    codes = [("baseline", baseline_src)] * bool(baseline_src) + [("this", None)]
    with tempfile.TemporaryDirectory() as tmp:
        np.save(Path(tmp, "text.npy"), token_stream(400_000).astype(np.int32))
        for live in sizes:
            for _ in range(2):  # the codes in turns, twice
                for label, src in codes:
                    ms = _in_process("--arena-driver", {"text": str(Path(tmp, "text.npy")), "live": live}, src, tmp)
                    results["rows"].setdefault(f"{label} B={live}", []).extend(ms)
    print(f"one compaction of the live requests' pool, ms ({2 * ARENA_REPEATS} fresh arenas each)")
    print(f"{'code':18s} {'median':>7s} {'min':>7s} {'max':>7s}")
    for label, ms in results["rows"].items():
        print(f"{label:18s} {np.median(ms):7.2f} {min(ms):7.2f} {max(ms):7.2f}")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


ROUNDS_WARM, ROUNDS_TIMED = 200, 1000


def _rounds_driver(in_path: str, out_path: str) -> None:
    """The --rounds timings of the proposer_svc this process loaded."""
    from bench_proposer import APPEND, OUTPUT_LEN, PROMPT_LEN, K

    from specdec.proposer_svc.base import SeqOptions
    from specdec.proposer_svc.suffix import SuffixConfig, SuffixProposer

    spec = json.loads(Path(in_path).read_text())
    text, b = np.load(spec["text"]), spec["batch"]
    span = PROMPT_LEN + OUTPUT_LEN
    next_slice = itertools.cycle(range(0, len(text) - span, span))  # (the text may run out: wraps around)
    # a served replica's defaults (as bench_proposer.py's processes), the global trie filled to its size
    prop = SuffixProposer(SuffixConfig(cache_between_messages=True))
    opts = SeqOptions(min_token_prob=MIN_TOKEN_PROB)
    for i in range(prop.config.max_cached_requests):
        at = next(next_slice)
        prop.start(f"f{i}", text[at:at + PROMPT_LEN], opts)
        prop.extend(f"f{i}", text[at + PROMPT_LEN:at + span])
        prop.stop(f"f{i}", completed=True)
    prop.between_messages()
    # per sequence: [id, slice start, tokens held, release at]; the first ones end early (spread releases)
    seqs = []
    for i in range(b):
        at = next(next_slice)
        prop.start(f"s{i}-{at}", text[at:at + PROMPT_LEN], opts)
        seqs.append([f"s{i}-{at}", at, PROMPT_LEN, PROMPT_LEN + max(APPEND, OUTPUT_LEN * (i + 1) // b)])
    advance, upkeep = [], []
    bounds, ks = np.arange(0, APPEND * b + 1, APPEND, dtype=np.int64), np.full(b, K, dtype=np.int64)
    gc.disable()
    for _ in range(ROUNDS_WARM + ROUNDS_TIMED):
        tokens = np.concatenate([text[at + held:at + held + APPEND] for _, at, held, _ in seqs]).astype(np.int32)
        context_lens = np.array([held + APPEND for _, _, held, _ in seqs], dtype=np.int64)
        t0 = time.perf_counter()
        prop.advance([s[0] for s in seqs], tokens, bounds, context_lens, ks)
        t1 = time.perf_counter()
        for i, s in enumerate(seqs):
            s[2] += APPEND
            if s[2] >= s[3]:
                prop.stop(s[0], completed=True)
                at = next(next_slice)
                prop.start(f"s{i}-{at}", text[at:at + PROMPT_LEN], opts)
                seqs[i] = [f"s{i}-{at}", at, PROMPT_LEN, span]
        prop.between_messages()
        advance.append(1e6 * (t1 - t0) / b)
        upkeep.append(1e6 * (time.perf_counter() - t1) / b)
    gc.enable()
    Path(out_path).write_text(json.dumps({"advance_us": advance[ROUNDS_WARM:], "upkeep_us": upkeep[ROUNDS_WARM:]}))


def rounds_main(sizes: list[int], baseline_src: str | None, out: str) -> None:
    from bench_proposer import OUTPUT_LEN, PROMPT_LEN, token_stream

    from specdec.proposer_svc.suffix import SuffixConfig

    cached = SuffixConfig().max_cached_requests
    results: dict = {"warm": ROUNDS_WARM, "timed": ROUNDS_TIMED, "cached": cached,
                     "baseline_src": baseline_src, "rows": {}}
    codes = [("baseline", baseline_src)] * bool(baseline_src) + [("this", None)]
    # text for the cache and every sequence's slices (about 1/171 of B released a round; wraps around if short)
    need = cached + max(sizes) * (1 + (ROUNDS_WARM + ROUNDS_TIMED) // 100)
    with tempfile.TemporaryDirectory() as tmp:
        np.save(Path(tmp, "text.npy"), token_stream(need * (PROMPT_LEN + OUTPUT_LEN)).astype(np.int32))
        for b in sizes:
            for _ in range(2):  # the codes in turns, twice
                for label, src in codes:
                    timed = _in_process("--rounds-driver", {"text": str(Path(tmp, "text.npy")), "batch": b}, src, tmp)
                    results["rows"].setdefault(f"{label} B={b}", []).append(
                        {"advance_us": float(np.mean(timed["advance_us"])),
                         "upkeep_us": float(np.mean(timed["upkeep_us"]))})
    print(f"in-process rounds, us per sequence-round (mean of {ROUNDS_TIMED} rounds; each code's runs in turns); "
          "upkeep: stops, opens and the global trie's upkeep")
    print(f"{'code':16s} {'advance':>16s} {'upkeep':>16s}")
    for label, runs in results["rows"].items():
        advance = ", ".join(f"{r['advance_us']:.2f}" for r in runs)
        upkeep = ", ".join(f"{r['upkeep_us']:.2f}" for r in runs)
        print(f"{label:16s} {advance:>16s} {upkeep:>16s}")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


# ------------------------------------------------------------------ report
def _summary(runs: list[dict], output_tokens: list[list[int]], schedule) -> dict:
    """Latencies (µs) of the fastest repeat (this 2-core machine is shared,
    so slower repeats measure the neighbours), and the acceptance of the
    drafts (identical across repeats)."""
    best = min(runs, key=lambda r: np.mean(r["spec_ns"]) + np.mean(r["update_ns"]))
    truths = [out[pos:] for out, steps in zip(output_tokens, schedule)
              for pos in np.cumsum([0] + steps[:-1])]
    accepted = [_accepted(d, t) for d, t in zip(best["drafts"], truths)]
    spec, update = np.array(best["spec_ns"]) / 1e3, np.array(best["update_ns"]) / 1e3
    return {"calls": len(spec), "spec_us_mean": float(spec.mean()),
            "spec_us_p50": float(np.percentile(spec, 50)),
            "spec_us_p99": float(np.percentile(spec, 99)),
            "update_us_mean": float(update.mean()),
            "update_us_p50": float(np.percentile(update, 50)),
            "start_us_mean": float(np.mean(best["start_ns"]) / 1e3),
            "draft_len_mean": float(np.mean([len(d) for d in best["drafts"]])),
            "accepted_per_call": float(np.mean(accepted)),
            "memory_bytes": best["memory_bytes"], "drafts": best["drafts"]}


def _print_table(results: dict) -> None:
    cols = ("impl", "calls", "spec µs", "spec p50", "spec p99", "update µs", "update p50",
            "start µs", "draft len", "acc/call", "same as arctic")
    print(" | ".join(f"{c:>10}" for c in cols))
    for workload, impls in results["workloads"].items():
        print(f"-- {workload}")
        for impl, s in impls.items():
            same = s.get("identical_to_arctic")
            print(" | ".join(f"{v:>10}" for v in (
                impl, s["calls"], f"{s['spec_us_mean']:.1f}", f"{s['spec_us_p50']:.1f}",
                f"{s['spec_us_p99']:.1f}", f"{s['update_us_mean']:.1f}",
                f"{s['update_us_p50']:.1f}", f"{s['start_us_mean']:.0f}",
                f"{s['draft_len_mean']:.2f}", f"{s['accepted_per_call']:.2f}",
                "-" if same is None else f"{same:.1%}")))
    for workload, ratio in results["arctic_over_ours"].items():
        print(f"{workload}: arctic/ours latency (means), speculate {ratio['spec']:.2f}x, "
              f"update {ratio['update']:.2f}x, spec+update {ratio['total']:.2f}x, "
              f"start {ratio['start']:.2f}x; medians: speculate {ratio['spec_p50']:.2f}x, "
              f"update {ratio['update_p50']:.2f}x")


def _sizes(parser: argparse.ArgumentParser, flag: str, value: str, what: str) -> list[int]:
    """The comma-separated counts >= 1 of ``flag`` (a clear error otherwise)."""
    try:
        sizes = [int(b) for b in value.split(",") if b.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        parser.error(f"{flag}: comma-separated numbers of {what} >= 1, got {value!r}")
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16, help="requests per workload")
    parser.add_argument("--k", type=int, default=8, help="draft tokens asked per call")
    parser.add_argument("--max-cached", type=int, default=8, help="max_cached_requests")
    parser.add_argument("--repeats", type=int, default=3, help="timed replays (best kept)")
    parser.add_argument("--arctic-python", default="/tmp/arctic-venv/bin/python")
    parser.add_argument("--upkeep", type=int, metavar="N",
                        help="time the global trie's upkeep over N outputs, the cache filling from empty")
    parser.add_argument("--arena-compact", metavar="B,B,...",
                        help="time one compaction of the live requests' pool at these numbers of live requests")
    parser.add_argument("--rounds", metavar="B,B,...",
                        help="time in-process rounds of B sequences, the global trie full (drafting and upkeep)")
    parser.add_argument("--baseline-src", help="--upkeep, --arena-compact, --rounds: another proposer_svc package "
                                               "directory to time too")
    parser.add_argument("--out", help="JSON results (default bench_results/suffix_micro.json; with --upkeep, "
                                      "--arena-compact, --rounds: suffix_upkeep.json, suffix_arena_compact.json, "
                                      "suffix_rounds.json there)")
    parser.add_argument("--driver", nargs=2, metavar=("IN", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--upkeep-driver", nargs=2, metavar=("IN", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--arena-driver", nargs=2, metavar=("IN", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--rounds-driver", nargs=2, metavar=("IN", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    for driver, run in (("driver", _driver_main), ("upkeep_driver", _upkeep_driver), ("arena_driver", _arena_driver),
                        ("rounds_driver", _rounds_driver)):  # a child process of this file's
        if getattr(args, driver):
            run(*getattr(args, driver))
            return
    if args.rounds:
        rounds_main(_sizes(parser, "--rounds", args.rounds, "sequences"), args.baseline_src,
                    args.out or "bench_results/suffix_rounds.json")
        return
    if args.arena_compact:
        arena_main(_sizes(parser, "--arena-compact", args.arena_compact, "live requests"), args.baseline_src,
                   args.out or "bench_results/suffix_arena_compact.json")
        return
    if args.upkeep:
        upkeep_main(args.upkeep, args.baseline_src, args.out or "bench_results/suffix_upkeep.json")
        return
    args.out = args.out or "bench_results/suffix_micro.json"

    workloads = build_workloads(args.requests)
    have_arctic = Path(args.arctic_python).exists()
    if not have_arctic:
        print(f"arctic-inference venv not found at {args.arctic_python}: ours only", file=sys.stderr)
    results: dict = {"config": {"k": args.k, "max_cached_requests": args.max_cached,
                                "max_tree_depth": MAX_TREE_DEPTH, "max_spec_factor": MAX_SPEC_FACTOR,
                                "min_token_prob": MIN_TOKEN_PROB, "repeats": args.repeats},
                     "workloads": {}, "arctic_over_ours": {}}
    impl_names = ("suffix", "ngram", "hybrid") + (("arctic",) if have_arctic else ())
    for name, reqs in workloads.items():
        schedule = record_schedule(reqs, args.k, args.max_cached)
        runs: dict[str, list[dict]] = {impl: [] for impl in impl_names}
        for _ in range(args.repeats):  # interleaved, so neighbours' load hits all alike
            for impl in impl_names:
                runs[impl].append(
                    run_arctic_subprocess(args.arctic_python, reqs, schedule, args.k,
                                          args.max_cached) if impl == "arctic"
                    else run_ours(impl, reqs, schedule, args.k, args.max_cached))
        outputs = [out for _, out in reqs]
        impls = {impl: _summary(runs[impl], outputs, schedule) for impl in impl_names}
        if have_arctic:
            ref = impls["arctic"]["drafts"]
            for s in impls.values():
                s["identical_to_arctic"] = float(np.mean([a == b for a, b in zip(s["drafts"], ref)]))
            ours, theirs = impls["suffix"], impls["arctic"]
            results["arctic_over_ours"][name] = {
                "spec": theirs["spec_us_mean"] / ours["spec_us_mean"],
                "update": theirs["update_us_mean"] / ours["update_us_mean"],
                "total": (theirs["spec_us_mean"] + theirs["update_us_mean"])
                / (ours["spec_us_mean"] + ours["update_us_mean"]),
                "start": theirs["start_us_mean"] / ours["start_us_mean"],
                "spec_p50": theirs["spec_us_p50"] / ours["spec_us_p50"],
                "update_p50": theirs["update_us_p50"] / ours["update_us_p50"]}
        for s in impls.values():
            del s["drafts"]
        results["workloads"][name] = impls
    _print_table(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
