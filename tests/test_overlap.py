"""The gateway's overlapped rounds (gateway/loop.py).

Unit tests around a scripted proposer and scorer that take time: the
proposer drafts one cohort while the scorer verifies the other, every
sequence still goes propose → verify → commit in order, and the output is
lock-step's; ``--overlap on`` splits, or drafts ahead, only when the
measured costs say so.

System tests with real processes over gRPC on stories260K, the gateway run
with ``--overlap always`` or ``ahead`` (against stories260K's cheap Verify,
``on`` chooses between lock-step and drafting ahead by the measured times,
which the machine's load sways): greedy output of every method and draft length, in
concurrent streams, equals transformers greedy; seeded sampling gives the
same tokens with overlap as without. A proposer killed mid-run: test_faults.py."""
from __future__ import annotations

import asyncio
import itertools
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import assert_same_as_greedy, hf_greedy, hf_model, start_stack

from specdec.client import make_request, stream
from specdec.gateway.costs import overlap_pays
from specdec.gateway.discovery import ReplicaSet
from specdec.gateway.loop import LoopConfig, Overlap, SpecLoop
from specdec.gateway.request import GenParams
from specdec.gateway.sequence import Sequence
from specdec.limits import GREEDY
from specdec.protos.v1 import specdec_pb2 as pb

SCORER, PROPOSER = "scorer-a:1", "proposer-a:1"
VOCAB = 100


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def _target(context: list[int]) -> int:
    """The scripted target model's greedy next token."""
    return (3 * context[-1] + len(context)) % VOCAB


class _Calls:
    """(kind, seq_ids, start, end, drafts accepted) of every call, in a shared clock."""

    def __init__(self) -> None:
        self.log: list[tuple[str, frozenset[str], float, float, int]] = []
        self.sent: list[tuple[bool, bool]] = []  # per VerifySequence: (it had drafts, skip_decode_ahead)

    def overlapping(self) -> list[tuple[frozenset[str], frozenset[str]]]:
        """(proposed seq_ids, verified seq_ids) of each propose call that was
        in flight while a Verify call was."""
        proposes = [c for c in self.log if c[0] == "propose"]
        verifies = [c for c in self.log if c[0] == "verify"]
        return [(p[1], v[1]) for p in proposes for v in verifies if p[2] < v[3] and v[2] < p[3]]


class _SlowProposer:
    """A proposer stream that answers after ``latency_s`` with drafts of the
    target's continuation, of varied length and now and then wrong at the
    end, keeping every sequence's tokens as a real proposer does."""

    def __init__(self, calls: _Calls, latency_s: float, open_s: float = 0.0) -> None:
        self.calls, self.latency_s, self.open_s = calls, latency_s, open_s  # open_s: more for a message that opens
        self.tokens: dict[str, list[int]] = {}
        self.rounds = 0
        self.budgets: list[int] = []  # every num_speculative_tokens asked for
        self.made: dict[str, list[tuple[int, list[int]]]] = {}  # seq_id -> (context length, draft) of each answer

    async def exchange(self, request: pb.ProposeRequest, timeout_s: float) -> pb.ProposeResponse:
        start = time.perf_counter()
        await asyncio.sleep(self.latency_s + (self.open_s if any(u.open for u in request.sequences) else 0.0))
        self.rounds += 1
        response = pb.ProposeResponse(batch_id=request.batch_id)
        cols = request.round  # the held sequences' updates as columns (ProposeRequest.round)
        at = list(itertools.accumulate(cols.token_counts, initial=0))
        held = [pb.SequenceUpdate(seq_id=s, token_ids=cols.token_ids[at[i]:at[i + 1]], context_len=cols.context_lens[i],
                                  num_speculative_tokens=cols.num_speculative_tokens[i])
                for i, s in enumerate(cols.seq_ids)]
        if request.HasField("round"):
            response.round.SetInParent()
        for u in held + list(request.sequences):
            if u.open:
                self.tokens[u.seq_id] = []
            context = self.tokens[u.seq_id]
            context.extend(u.token_ids)
            self.budgets.append(u.num_speculative_tokens)
            assert len(context) == u.context_len, "the proposer saw tokens out of order"
            draft, guess = [], list(context)
            length = self.rounds % (u.num_speculative_tokens + 1)
            for i in range(length):
                wrong = i == length - 1 and self.rounds % 3 == 0
                draft.append((_target(guess) + wrong) % VOCAB)
                guess.append(draft[-1])
            self.made.setdefault(u.seq_id, []).append((len(context), draft))
            if any(u is h for h in held):
                response.round.draft_counts.append(len(draft))
                response.round.token_ids.extend(draft)
            else:
                response.drafts.add(seq_id=u.seq_id, status=pb.SEQUENCE_STATUS_OK, token_ids=draft)
        self.calls.log.append(("propose", frozenset(u.seq_id for u in held + list(request.sequences)),
                               start, time.perf_counter(), 0))
        return response


class _SlowScorer:
    """Greedy verification against ``_target``, taking ``fixed_s +
    per_token_s`` per row fed (and saying so in compute_s)."""

    def __init__(self, calls: _Calls, fixed_s: float, per_token_s: float) -> None:
        self.calls, self.fixed_s, self.per_token_s = calls, fixed_s, per_token_s
        self.contexts: dict[str, list[int]] = {}
        self.verified: list[tuple[str, int, list[int]]] = []  # (seq_id, context length, draft) of each non-empty draft

    async def Verify(self, request, timeout=None):
        start = time.perf_counter()
        for v in request.sequences:
            if v.context_token_ids:
                self.contexts[v.seq_id] = list(v.context_token_ids)
            self.calls.sent.append((len(v.draft_token_ids) > 0, v.skip_decode_ahead))
        rows = sum(1 + len(v.draft_token_ids) + len(v.context_token_ids) for v in request.sequences)
        compute_s = self.fixed_s + self.per_token_s * rows
        await asyncio.sleep(compute_s)
        results = []
        for v in request.sequences:
            context = self.contexts[v.seq_id]
            assert len(context) == v.context_len, "verified on a context the gateway did not commit"
            if v.draft_token_ids:
                self.verified.append((v.seq_id, len(context), list(v.draft_token_ids)))
            output = []
            for token in v.draft_token_ids:
                if token != _target(context + output):
                    break
                output.append(token)
            num_accepted = len(output)
            output.append(_target(context + output))
            context.extend(output)
            results.append(pb.VerifyResult(seq_id=v.seq_id, status=pb.SEQUENCE_STATUS_OK,
                                           output_token_ids=output, num_accepted=num_accepted))
        self.calls.log.append(("verify", frozenset(v.seq_id for v in request.sequences),
                               start, time.perf_counter(), sum(r.num_accepted for r in results)))
        return pb.VerifyResponse(results=results, compute_s=compute_s)

    async def Release(self, request, timeout=None):
        for seq_id in request.seq_ids:
            self.contexts.pop(seq_id, None)
        return pb.ReleaseResponse()


def _params(prompt: list[int], k: int, max_tokens: int, method: str = "ngram", strategy: int = GREEDY) -> GenParams:
    return GenParams(prompt_ids=prompt, max_tokens=max_tokens, stop=[], ignore_eos=True,
                     temperature=0.0 if strategy == GREEDY else 0.8, top_k=0, top_p=1.0, seed=1, method=method,
                     num_speculative_tokens=k, min_n=1, max_n=4, max_tree_depth=64, max_spec_factor=1.0,
                     min_token_prob=0.1, verify_strategy=strategy, accept_policy=0, adaptive=False)


def _expected(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    while len(tokens) < len(prompt) + max_tokens:
        tokens.append(_target(tokens))
    return tokens


def _prompt(i: int, prompt_len: int = 3) -> list[int]:
    return [5 + i, 7, 11 + i] + [(13 + j) % VOCAB for j in range(prompt_len - 3)]


def _generate(overlap: Overlap, num_seqs: int = 4, max_tokens: int = 24, latency_s: float = 0.02,
              fixed_s: float = 0.0, per_token_s: float = 0.001, k: int = 3, prompt_len: int = 3,
              method: str = "ngram", strategy: int = GREEDY, open_s: float = 0.0,
              plain: frozenset[int] = frozenset()):
    """Runs num_seqs sequences to the end; returns (their tokens, the call log).
    Every draft verified must be one the proposer made for the sequence's
    committed context (or the rest of one made before, past the tokens
    committed since: drafting ahead). The sequences numbered in ``plain``
    decode plainly (method none) beside the others."""
    calls = _Calls()
    proposer, scorer = _SlowProposer(calls, latency_s, open_s), _SlowScorer(calls, fixed_s, per_token_s)

    def params(i: int) -> GenParams:
        if i in plain:
            return _params(_prompt(i, prompt_len), 0, max_tokens, "none", strategy)
        return _params(_prompt(i, prompt_len), k, max_tokens, method, strategy)

    async def run():
        loop = SpecLoop(ReplicaSet("scorer", [SCORER]), {method: ReplicaSet(method, [PROPOSER])},
                        vocab_size=VOCAB, config=LoopConfig(overlap=overlap, stall_sleep_s=0.0))
        loop.conns.scorer = lambda addr: scorer  # type: ignore[method-assign]
        loop.conns.proposer_stream = lambda addr: proposer  # type: ignore[method-assign]
        seqs = [Sequence(f"r{i}", params(i), _Tokenizer(), (), 512) for i in range(num_seqs)]
        for seq in seqs:
            loop.submit(seq)
        for _ in range(10 * max_tokens):
            if all(s.done for s in seqs):
                break
            await loop._round()
        assert all(s.done and not s.failed for s in seqs)
        return {s.seq_id: s.tokens for s in seqs}

    outputs = asyncio.run(run())
    for seq_id, context_len, draft in scorer.verified:
        tokens = outputs[seq_id]
        assert any(at <= context_len and made[:context_len - at] == tokens[at:context_len]
                   and made[context_len - at:][:len(draft)] == draft for at, made in proposer.made[seq_id]), \
            f"{seq_id} verified a draft made for another context at {context_len}: {draft}"
    return list(outputs.values()), calls


def test_proposer_drafts_one_cohort_while_the_scorer_verifies_the_other():
    outputs, calls = _generate(Overlap.ALWAYS)
    assert outputs == [_expected([5 + i, 7, 11 + i], 24) for i in range(4)]
    overlapping = calls.overlapping()
    assert len(overlapping) >= 5, "no propose call ran while a Verify did"
    for proposed, verified in overlapping:
        assert proposed and verified and not proposed & verified, "a sequence was proposed while verified"
    sizes = [len(seq_ids) for kind, seq_ids, *_ in calls.log]
    assert sizes[:6] == [2] * 6 and max(sizes) == 2, f"the cohorts are not halves: {sizes}"


def test_lock_step_never_overlaps_and_gives_the_same_output():
    """The control: with overlap off the same scripted calls never overlap
    (so the test above fails on a lock-step loop), and the tokens agree."""
    overlapped, _ = _generate(Overlap.ALWAYS)
    lock_step, calls = _generate(Overlap.OFF)
    assert calls.overlapping() == []
    assert lock_step == overlapped


def test_one_sequence_runs_lock_step():
    outputs, calls = _generate(Overlap.ALWAYS, num_seqs=1)
    assert outputs == [_expected([5, 7, 11], 24)]
    assert calls.overlapping() == []


@pytest.mark.parametrize("latency_s,fixed_s,per_token_s,overlaps", [
    (0.005, 0.0, 0.002, True),  # a CPU-like scorer: rows cost, a half Verify costs half
    # a GPU-like scorer: a half batch costs a whole one, the proposer is much quicker (too quick to draft ahead:
    # 1 % of a Verify, ten times under AHEAD_PROPOSE_SHARE, so that a loaded machine's event-loop delays, which
    # the proposer's measured time includes, do not make drafting ahead pay; at 2 ms of 60 they once did in CI)
    (0.001, 0.1, 0.0, False),
])
def test_overlap_on_follows_the_measured_costs(latency_s, fixed_s, per_token_s, overlaps):
    """--overlap on splits only when the fitted costs say two cohorts win
    (at first, without figures, it tries)."""
    outputs, calls = _generate(Overlap.ON, num_seqs=6, max_tokens=40, latency_s=latency_s,
                               fixed_s=fixed_s, per_token_s=per_token_s)
    assert outputs == [_expected([5 + i, 7, 11 + i], 40) for i in range(6)]
    second_half = calls.log[len(calls.log) // 2][2]  # the cost model has its figures by then
    late = [(p, v) for p, v in calls.overlapping()
            if min(c[2] for c in calls.log if c[1] in (p, v)) >= second_half]
    assert bool(late) == overlaps


@pytest.mark.parametrize("overlap,halves", [(Overlap.ON, False), (Overlap.ALWAYS, True)])
def test_plain_decoding_is_never_split_into_cohorts_unless_always(overlap, halves):
    """Sequences that ask no proposer (method none) have nothing to overlap:
    with ``on`` every Verify carries all of them (before, their propose time
    was never measured, so two cohorts were tried for good: half batches);
    ``always`` still splits, as asked."""
    outputs, calls = _generate(overlap, num_seqs=6, max_tokens=24, k=0, method="none")
    assert outputs == [_expected([5 + i, 7, 11 + i], 24) for i in range(6)]
    assert not [c for c in calls.log if c[0] == "propose"]
    sizes = [len(seq_ids) for kind, seq_ids, *_ in calls.log if kind == "verify"]
    assert (max(sizes) == 3) if halves else (set(sizes) == {6}), sizes


@pytest.mark.parametrize("overlap", [Overlap.ON, Overlap.ALWAYS])
def test_sequences_that_ask_no_proposer_ride_in_every_verify_beside_two_cohorts(overlap):
    """Two plain sequences (method none) beside four whose proposer is slow
    enough for two cohorts: with ``on`` the plain ones ride in every Verify
    (they wait for no draft) and the drafting ones still alternate; before,
    the plain ones were one cohort's, decoded in every other Verify.
    ``always`` keeps them in the cohorts, as asked."""
    outputs, calls = _generate(overlap, num_seqs=6, max_tokens=24, latency_s=0.01, plain=frozenset({0, 1}))
    assert outputs == [_expected(_prompt(i), 24) for i in range(6)]
    overlapping = calls.overlapping()
    assert overlapping, "no step overlapped: nothing to ride beside"
    first = min(int(i.rsplit("/", 1)[1]) for _, ids, *_ in calls.log for i in ids)

    def numbers(wire_ids: frozenset[str]) -> set[int]:  # (a wire seq_id is GATEWAY/COUNT, counted as submitted)
        return {int(i.rsplit("/", 1)[1]) - first for i in wire_ids}

    for proposed, verified in overlapping:
        assert not proposed & verified and not numbers(proposed) & {0, 1}
    verifies = [numbers(ids) for kind, ids, *_ in calls.log if kind == "verify"]
    with_plain = [i for i, ids in enumerate(verifies) if 0 in ids]
    assert len(with_plain) == 24  # one token a Verify, no drafts
    if overlap is Overlap.ON:
        assert with_plain == list(range(24)), with_plain  # from the first step on, beside the first cohort's propose
        assert all(1 in verifies[i] for i in with_plain)
        assert any(len(ids & {2, 3, 4, 5}) == 2 for ids in verifies)
    else:  # every other Verify (until the drafting ones, which accept drafts, are done)
        assert with_plain[:6] == [0, 2, 4, 6, 8, 10], with_plain


def test_overlap_pays_when_the_proposer_fits_between_a_verify_s_fixed_cost_and_its_whole():
    cpu = (0.001, 0.0001)  # 1 ms + 0.1 ms per row
    assert overlap_pays(0.005, cpu, 200)  # 5 ms proposer, 21 ms Verify: hidden behind half of it
    assert not overlap_pays(0.0002, cpu, 200)  # a proposer cheaper than a Verify's fixed part
    assert not overlap_pays(0.05, cpu, 200)  # a proposer slower than the whole Verify
    gpu = (0.02, 0.00001)  # 20 ms + 10 µs per row: half a batch costs almost a whole one
    assert not overlap_pays(0.005, gpu, 256)
    assert overlap_pays(0.03, gpu, 2048)  # a slow proposer and a large batch: 60 ms against 70 ms


# ------------------------------------------------------------ real processes

PROMPTS = ["Once upon a time",
           "Tom saw a big dog. The dog was happy. Tom saw a big dog. The dog was happy. Tom saw a big"]
METHODS = ["ngram", "suffix", "hybrid", "draft"]  # draft: stories260K drafting for itself
MAX_TOKENS = 40


def _overlap_stack(path, tmp_path_factory, overlap: str):
    from specdec.proposer_svc.registry import COPY_METHODS

    # drafting ahead: proposers 10 ms slow, as a remote or model proposer is: against stories260K's few-ms
    # Verify, waiting for fresh drafts then never pays, and the rounds use drafts proposed ahead (with
    # proposers as fast as the Verify, waiting often pays, and whether a run drafts ahead is up to timing)
    # (a proposer call timed out on a loaded CI machine costs its replica 5 s of drafts, longer than the test:
    # the timeout is generous, as the other stack tests' that count accepted drafts)
    slow = ["--added-latency-ms", "10"] if overlap == "ahead" else []
    return start_stack(path, tmp_path_factory, f"overlap-{overlap}", methods=",".join([*COPY_METHODS, "draft"]),
                       draft_model=path, metrics=True,
                       extra_gateway_args=["--overlap", overlap, "--propose-timeout-ms", "5000"],
                       extra_proposer_args=slow)


@pytest.fixture(scope="module", params=["always", "ahead"])
def overlap_stack(request, stories_path, tmp_path_factory):
    stack = _overlap_stack(stories_path, tmp_path_factory, request.param)
    stack.overlap = request.param
    yield stack
    stack.stop()


def _overlapped_steps(stack) -> float:
    """Overlapped steps (always), or drafts verified that were proposed
    ahead (ahead), so far."""
    samples = stack.by_name("gateway")[0].metrics()
    if stack.overlap == "ahead":
        return sum(v for k, v in samples.items() if k.startswith("specdec_gateway_ahead_drafts_total{"))
    return samples.get("specdec_gateway_overlapped_steps_total", 0.0)


def _concurrently(addr: str, requests: list) -> list:
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda r: stream(addr, r), requests))


def test_greedy_identity_with_overlap_for_every_method_and_k(overlap_stack, stories_path):
    # the prompt that repeats itself verifies every draft (draft_length fixed), so its drafts are accepted
    # whatever the gateway's cost fit makes of 24 sequences on a loaded machine (adaptive lengths may verify
    # none: clean-clone CI once saw 0 accepted); the other runs adaptive
    cases = [(prompt, method, k) for prompt in PROMPTS for method in METHODS for k in (1, 3, 8)]
    lengths = {PROMPTS[0]: pb.DRAFT_LENGTH_ADAPTIVE, PROMPTS[1]: pb.DRAFT_LENGTH_FIXED}
    steps = _overlapped_steps(overlap_stack)
    gens = _concurrently(overlap_stack.gateway_addr,
                         [make_request(p, max_tokens=MAX_TOKENS, method=m, k=k, draft_length=lengths[p])
                          for p, m, k in cases])
    assert _overlapped_steps(overlap_stack) > steps + 10, "the gateway did not overlap its rounds"
    for (prompt, method, k), gen in zip(cases, gens):
        expected = hf_greedy(stories_path, tuple(hf_model(stories_path)[1](prompt)["input_ids"]), MAX_TOKENS)
        assert_same_as_greedy(stories_path, gen, expected, MAX_TOKENS)
        assert gen.stats.draft_tokens <= k * gen.stats.rounds, (method, k)
    for method in METHODS:  # every proposer's drafts were used
        accepted = sum(g.stats.accepted_tokens for (p, m, _), g in zip(cases, gens) if m == method and p == PROMPTS[1])
        assert accepted > 0, (method, _gateway_warnings(overlap_stack))


def _gateway_warnings(stack) -> list[str]:
    with open(stack.by_name("gateway")[0].log_path, errors="replace") as f:
        return [line.strip() for line in f if "WARNING" in line][-10:]


def test_seeded_sampling_with_overlap_is_reproducible_and_equals_lock_step(overlap_stack):
    """Concurrent streams run overlapped; a stream alone runs lock-step (one
    live sequence has nothing to overlap with; drafting ahead, only
    target-match requests draft ahead, alone too, and their output does not
    depend on the drafts). ngram and draft: their drafts
    depend on the sequence alone (suffix and hybrid also learn from earlier
    outputs, so with sampling a later run draws on other drafts: the same
    distribution, other tokens). The drafts are of a fixed length: the
    adaptive length follows measured costs, which the machine's load moves,
    and rejection sampling's output depends on the drafts verified.

    Drafting ahead, a draft proposed ahead is used only where it holds and
    where waiting for fresh drafts did not pay (measured costs again, hence
    the stack's slow proposers): should a concurrent run use none, it is run
    again, up to three times (each run must equal lock-step all the same)."""
    addr = overlap_stack.gateway_addr
    strategies = [pb.VERIFY_STRATEGY_REJECTION, pb.VERIFY_STRATEGY_TARGET_MATCH]  # target-match drafts ahead
    requests = [make_request(PROMPTS[i % 2], max_tokens=24, method=m, k=2, temperature=0.9, top_p=0.95,
                             seed=100 + i, verify_strategy=strategies[i // 2 % 2], draft_length=pb.DRAFT_LENGTH_FIXED)
                for i, m in enumerate(["ngram", "draft"] * 4)]
    steps = _overlapped_steps(overlap_stack)
    lock_step = [stream(addr, r).token_ids for r in requests]
    if overlap_stack.overlap == "always":
        assert _overlapped_steps(overlap_stack) == steps  # alone: lock-step
    for _ in range(3):
        overlapped = [g.token_ids for g in _concurrently(addr, requests)]
        assert overlapped == lock_step
        if _overlapped_steps(overlap_stack) > steps:
            break
    assert _overlapped_steps(overlap_stack) > steps
    assert [g.token_ids for g in _concurrently(addr, requests)] == lock_step
    assert len({tuple(t) for t in overlapped}) > 2  # seeds (and prompts) matter


# ------------------------------------------------------------ drafting ahead

def _waited(calls: _Calls) -> list[bool]:
    """For each Verify call after the first: whether a propose call ran
    wholly between the Verify before it and its start (the round waited for
    drafts), rather than alongside the Verify before (drafting ahead)."""
    verifies = [c for c in calls.log if c[0] == "verify"]
    proposes = [c for c in calls.log if c[0] == "propose"]
    return [any(before[3] <= p[2] and p[3] <= v[2] for p in proposes) for before, v in zip(verifies, verifies[1:])]


def _verifies_inside_proposes(calls: _Calls, since: float = 0.0) -> list[int]:
    """For each propose call started after ``since``: the Verify calls that
    ran wholly inside it."""
    verifies = [c for c in calls.log if c[0] == "verify"]
    proposes = [c for c in calls.log if c[0] == "propose" and c[2] >= since]
    return [sum(p[2] < v[2] and v[3] < p[3] for v in verifies) for p in proposes]


def _ahead_used(calls: _Calls) -> int:
    """Verify calls that accepted drafts without waiting for a proposer:
    drafts proposed ahead, while the Verify before them ran."""
    verifies = [c for c in calls.log if c[0] == "verify"]
    return sum(not waited and v[4] > 0 for waited, v in zip(_waited(calls), verifies[1:]))


@pytest.mark.parametrize("num_seqs,k", [(1, 3), (4, 3), (3, 1), (2, 8)])
def test_drafting_ahead_gives_lock_step_output_with_drafts_proposed_during_verification(num_seqs, k, monkeypatch):
    """A proposer quicker than a Verify (8 ms against 20 ms and more): it
    drafts the sequences being verified, and the next rounds verify those
    drafts, without waiting for the proposer, where they still hold. Rounds
    never wait for fresh drafts here (whether that pays is the cost model's
    call, which load on the machine sways:
    test_drafting_ahead_waits_for_fresh_drafts_only_when_they_pay)."""
    monkeypatch.setattr(SpecLoop, "_fresh_drafts_pay", lambda self, live, drafts, optional: False)
    outputs, calls = _generate(Overlap.AHEAD, num_seqs=num_seqs, max_tokens=40, k=k, latency_s=0.008,
                               fixed_s=0.02, per_token_s=0.0005)
    assert outputs == [_expected([5 + i, 7, 11 + i], 40) for i in range(num_seqs)]
    same = [(p, v) for p, v in calls.overlapping() if p & v]
    assert len(same) >= 4, "the proposer did not draft the sequences being verified"
    assert not any(_waited(calls))
    assert _ahead_used(calls) >= 3, "no round verified drafts proposed ahead without waiting"


def test_a_proposer_slower_than_the_scorer_does_not_hold_the_rounds_drafting_ahead():
    """A proposer taking 20 ms against a Verify of ~3-12 ms (a GPU scorer
    and a remote or model proposer): the rounds go on while its exchange is
    in flight (several Verify calls during one propose call; a round waiting
    for it, as drafting ahead did before, allows one), the next exchange to
    the replica is built only once the one before is answered (the scripted
    proposer checks every update against the tokens it holds), its drafts
    are verified where they still hold when they land (asked to cover the
    rounds it stays in flight), and the output is lock-step's. Sequences
    that end while an exchange is in flight leave nothing behind, and one
    that joins while an exchange is in flight is opened by a later one."""
    calls = _Calls()
    proposer, scorer = _SlowProposer(calls, 0.02), _SlowScorer(calls, 0.0, 0.001)
    lengths = [12, 32, 52, 30]

    async def run():
        loop = SpecLoop(ReplicaSet("scorer", [SCORER]), {"ngram": ReplicaSet("ngram", [PROPOSER])},
                        vocab_size=VOCAB, config=LoopConfig(overlap=Overlap.AHEAD, stall_sleep_s=0.0))
        loop.conns.scorer = lambda addr: scorer  # type: ignore[method-assign]
        loop.conns.proposer_stream = lambda addr: proposer  # type: ignore[method-assign]
        seqs = [Sequence(f"r{i}", _params(_prompt(i), 3, n), _Tokenizer(), (), 512) for i, n in enumerate(lengths)]
        for seq in seqs[:3]:
            loop.submit(seq)
        for rounds in range(2000):
            if all(s.done for s in seqs):
                break
            if rounds == 10:
                loop.submit(seqs[3])
            await loop._round()
        loop._retire()
        held = dict(loop._ahead)
        await asyncio.sleep(0.1)  # exchanges still in flight land
        return [s.tokens for s in seqs], held, dict(loop._ahead)

    outputs, held, after = asyncio.run(run())
    assert outputs == [_expected(_prompt(i), n) for i, n in enumerate(lengths)]
    assert held == {} and after == {}, "drafts ahead kept for sequences that ended"
    during = _verifies_inside_proposes(calls)
    assert max(during) >= 2, f"the rounds waited for the proposer: Verify calls per propose call {during}"
    assert _ahead_used(calls) >= 1, "no drafts proposed ahead were verified"
    assert max(proposer.budgets) > 2 * 3 + 1, "drafts ahead were not asked to cover the rounds in flight"


@pytest.mark.parametrize("num_seqs,fixed_s", [(1, 0.004), (4, 0.0)])
def test_overlap_on_drafts_ahead_when_the_proposer_is_slower_than_the_verify(num_seqs, fixed_s):
    """The default, --overlap on, with a 20 ms proposer against a Verify of
    ~5-8 ms (one sequence) or ~4-16 ms (four): lock-step rounds would wait
    for it every round, and cohorts too (the proposer, run twice, is the
    bottleneck; one sequence has none to overlap). Once the costs are
    measured the rounds draft ahead: Verify calls run inside propose calls,
    drafts ahead are verified, the output is lock-step's (four sequences
    start in cohorts, before there are figures: their last cohort's drafts
    are verified by the first round drafting ahead). Lock-step, the same
    run has no Verify inside a propose call and no draft ahead."""
    outputs, calls = _generate(Overlap.ON, num_seqs=num_seqs, max_tokens=40, latency_s=0.02, fixed_s=fixed_s,
                               per_token_s=0.001)
    assert outputs == [_expected(_prompt(i), 40) for i in range(num_seqs)]
    second_half = calls.log[len(calls.log) // 2][2]  # the costs are measured by then
    during = _verifies_inside_proposes(calls, since=second_half)
    assert sum(during) >= 3, f"the rounds waited for the proposer: Verify calls per propose call {during}"
    assert _ahead_used(calls) >= 2, "no drafts proposed ahead were verified"


@pytest.mark.parametrize("method,strategy,latency_s,fixed_s,open_s", [
    ("draft", GREEDY, 0.02, 0.0, 0.0),  # a model's draft tokens ahead cost a forward each
    ("ngram", pb.VERIFY_STRATEGY_REJECTION, 0.02, 0.0, 0.0),  # its sample depends on the drafts
    ("ngram", GREEDY, 0.001, 0.04, 0.0),  # a proposer too quick to be worth hiding (2.5 % of the Verify)
    ("ngram", GREEDY, 0.001, 0.04, 0.04),  # the same, its open slow: the open does not tell the rounds after
])
def test_overlap_on_keeps_lock_step_rounds_where_drafting_ahead_does_not_fit(method, strategy, latency_s, fixed_s,
                                                                             open_s):
    """One sequence (no cohorts): --overlap on drafts ahead only for copy
    methods whose output does not depend on the drafts, and only when the
    proposer's time is a share of the Verify's worth hiding; else every
    round proposes, then verifies."""
    outputs, calls = _generate(Overlap.ON, num_seqs=1, max_tokens=30, latency_s=latency_s, fixed_s=fixed_s,
                               per_token_s=0.001, method=method, strategy=strategy, open_s=open_s)
    assert outputs == [_expected(_prompt(0), 30)]
    assert len([c for c in calls.log if c[0] == "propose"]) >= 5
    assert calls.overlapping() == []


def test_rounds_switching_between_cohorts_and_drafting_ahead_verify_only_drafts_of_the_committed_context(
        monkeypatch):
    """--overlap on may switch from cohorts to drafting ahead and back as
    the measured costs move. A round drafting ahead verifies the cohort
    proposed by the step before it; were those drafts left behind, the
    next overlapped step would verify them on a context they were not made
    for (which sampled requests must never do; _generate checks every
    verified draft against the proposer's answers)."""
    modes = itertools.cycle([False, False, True])
    monkeypatch.setattr(SpecLoop, "_drafts_ahead", lambda self, live: next(modes))
    monkeypatch.setattr(SpecLoop, "_overlap_pays", lambda self, live: True)
    outputs, calls = _generate(Overlap.ON, num_seqs=4, max_tokens=40, latency_s=0.005, per_token_s=0.001)
    assert outputs == [_expected(_prompt(i), 40) for i in range(4)]
    assert calls.overlapping()


def test_ahead_pays_when_the_proposer_takes_a_share_of_the_verify_worth_hiding():
    from specdec.gateway.costs import AHEAD_PROPOSE_SHARE, ahead_pays

    verify = 0.040
    assert ahead_pays(0.020, verify)  # a remote or model-speed proposer: half the Verify
    assert not ahead_pays(0.001, verify)  # a local copy proposer beside a CPU Verify
    assert ahead_pays(1.2 * AHEAD_PROPOSE_SHARE * verify, verify)
    assert not ahead_pays(0.8 * AHEAD_PROPOSE_SHARE * verify, verify)


def test_drafting_ahead_waits_for_fresh_drafts_only_when_they_pay():
    """A proposer much slower than a Verify: after the first rounds (no
    figures yet: it waits) the rounds go on with the drafts proposed ahead
    and never wait; a proposer much quicker than a Verify with a large fixed
    part (a GPU-like scorer): sequences without a draft ahead wait for one."""
    _, slow = _generate(Overlap.AHEAD, num_seqs=4, max_tokens=40, latency_s=0.03, per_token_s=0.0002)
    half = len([c for c in slow.log if c[0] == "verify"]) // 2
    assert half > 5 and sum(_waited(slow)) <= 2
    _, quick = _generate(Overlap.AHEAD, num_seqs=4, max_tokens=40, latency_s=0.002, fixed_s=0.03,
                         per_token_s=0.0)
    assert sum(_waited(quick)) >= 5


@pytest.mark.parametrize("overlap", [Overlap.AHEAD, Overlap.ON])
def test_a_round_goes_on_without_fresh_drafts_where_the_proposer_is_as_slow_as_a_plain_verify(overlap):
    """One sequence, a 20 ms proposer against a ~25 ms Verify (SmolLM2 on 2
    CPU cores and a remote proposer): a round whose draft ahead the output
    contradicted verifies at once, without drafts, while the proposer drafts
    ahead beside it; that draft is verified the round after where its first
    token is the one the round output (where it is not, a fresh draft
    waited for would have brought nothing either). The rule that counted
    only the round at hand waited for fresh drafts after most
    contradictions here (12 of 19 rounds); in bench_overlap (SmolLM2, one
    stream) it lost 12.1 % of tokens/s at 20 ms against 7.9 % with it (most
    of the rest was the scorer's decode-ahead step: skip_decode_ahead). A
    quick proposer beside a Verify with a large fixed part is still waited
    for (test_drafting_ahead_waits_for_fresh_drafts_only_when_they_pay)."""
    outputs, calls = _generate(overlap, num_seqs=1, max_tokens=60, latency_s=0.02, fixed_s=0.02,
                               per_token_s=0.001)
    assert outputs == [_expected(_prompt(0), 60)]
    waited = _waited(calls)
    assert sum(waited) <= 2, f"rounds waited for fresh drafts: {waited}"  # (before the times are measured)
    assert _ahead_used(calls) >= 8, "drafts proposed beside a Verify were not verified"


def test_a_prefill_does_not_hold_the_rounds_after_it_waiting_for_drafts():
    """Long prompts make the first Verify a slow prefill (0.24 s here)
    against ~3 ms rounds after it, with a 30 ms proposer: waiting for fresh
    drafts never pays once the rounds are measured (with 10 ms, two busy
    loops on the machine stretched the rounds enough that it did, 7 times,
    in some runs). A prefill counted in the measured Verify time made the
    rounds after it wait (10 of them here)."""
    outputs, calls = _generate(Overlap.AHEAD, num_seqs=4, max_tokens=40, latency_s=0.03, per_token_s=0.0002,
                               prompt_len=300)
    assert outputs == [_expected(_prompt(i, 300), 40) for i in range(4)]
    assert sum(_waited(calls)) <= 2  # the rounds before a decode round was measured


def test_fresh_drafts_pay_when_their_tokens_outweigh_the_wait():
    from specdec.gateway.costs import fresh_drafts_pay

    # 4 sequences expecting 1.5 tokens each from a 40 ms Verify: 150 tokens/s
    assert fresh_drafts_pay(0.005, 0.040, 6.0, 1.0)  # +1 token for 5 ms: 156 tokens/s
    assert not fresh_drafts_pay(0.020, 0.040, 6.0, 1.0)  # +1 token for 20 ms: 117 tokens/s
    assert not fresh_drafts_pay(0.001, 0.040, 6.0, 0.0)  # nothing to gain
    # one sequence, 5 ms waited for 2 tokens against a 25 ms Verify: worth it on this round alone...
    assert fresh_drafts_pay(0.005, 0.025, 1.0, 2.0)
    assert fresh_drafts_pay(0.020, 0.025, 1.0, 2.0)
    # ...but not at 20 ms once going on keeps most of them for the next round (the proposer drafts ahead
    # beside the Verify), waiting keeps less (a tail that holds only if this round accepts all)
    assert fresh_drafts_pay(0.005, 0.025, 1.0, 2.0, kept_tokens=1.0, deferred_tokens=1.8)
    assert not fresh_drafts_pay(0.020, 0.025, 1.0, 2.0, kept_tokens=1.0, deferred_tokens=1.8)
    # the rows the fresh drafts add to the Verify count against waiting
    assert not fresh_drafts_pay(0.005, 0.025, 1.0, 2.0, kept_tokens=1.0, deferred_tokens=1.8, rows_s=0.015)


def test_a_decode_ahead_step_pays_where_the_next_call_rarely_starts_with_an_accepted_draft():
    from specdec.gateway.costs import decode_ahead_pays

    assert decode_ahead_pays(0.0, 0.002, 0.020)  # plain decoding: the step hides the gap, nothing to lose
    assert decode_ahead_pays(0.9, 0.030, 0.020)  # a gap longer than the step: the step is done by then
    # SmolLM2, one stream drafting ahead: ~2 ms gaps against ~20 ms steps
    assert not decode_ahead_pays(0.5, 0.002, 0.020)  # half the calls after would wait 18 ms for it
    assert decode_ahead_pays(0.05, 0.002, 0.020)  # 1.9 ms saved against 0.9 lost


def test_decode_ahead_hints_learn_from_the_calls_after_draft_less_ones():
    from specdec.drafts import NO_DRAFT, Draft
    from specdec.gateway.costs import DecodeAheadHints

    hints = DecodeAheadHints()
    copy, plain = (Sequence(f"s-{m}", _params(_prompt(0), 3, 20, method=m), _Tokenizer(), (), 512)
                   for m in ("ngram", "none"))
    draft = Draft(np.array([1, 2, 3], dtype=np.int32))
    step = (0.020, 0.001)  # the replica's Verify fit: ~21 ms for a one-row step
    assert hints.skips(SCORER, [copy], {copy.seq_id: NO_DRAFT}, step, 0.0, now=0.0) == set()  # nothing known
    hints.answered([copy], {copy.seq_id: NO_DRAFT}, {copy.seq_id: 0}, now=0.021)
    assert hints.skips(SCORER, [copy], {copy.seq_id: draft}, step, 0.0, now=0.023) == set()  # drafts: no step
    hints.answered([copy], {copy.seq_id: draft}, {copy.seq_id: 2}, now=0.045)  # after a draft-less call: accepted
    assert hints.drafted_after_plain == {"ngram": 1.0} and hints.gap_s[SCORER] == pytest.approx(0.002)
    assert hints.skips(SCORER, [copy], {copy.seq_id: NO_DRAFT}, step, 0.0, now=0.047) == {copy.seq_id}
    assert hints.skips(SCORER, [copy], {copy.seq_id: NO_DRAFT}, None, 0.0, now=0.047) == set()  # no fit yet
    # a gap (with the RPC overhead) as long as the step: the step costs nothing
    assert hints.skips(SCORER, [copy], {copy.seq_id: NO_DRAFT}, step, 0.030, now=0.049) == set()
    # plain decoding: the call after a draft-less one never has drafts
    for i in range(3):
        hints.answered([plain], {plain.seq_id: NO_DRAFT}, {plain.seq_id: 0}, now=0.1 + i * 0.02)
    assert hints.drafted_after_plain["none"] == 0.0
    assert hints.skips(SCORER, [plain, copy], {plain.seq_id: NO_DRAFT, copy.seq_id: NO_DRAFT}, step, 0.0,
                       now=0.2) == {copy.seq_id}
    hints.forget(copy.seq_id)
    hints.answered([copy], {copy.seq_id: draft}, {copy.seq_id: 3}, now=0.3)  # not after a draft-less call now
    assert hints.drafted_after_plain["ngram"] == 1.0


@pytest.mark.parametrize("overlap,latency_s,skips", [(Overlap.AHEAD, 0.02, True), (Overlap.OFF, 0.0, True),
                                                      (Overlap.OFF, 0.02, False)])
def test_draft_less_calls_ask_the_scorer_for_no_step_ahead_where_drafts_follow(overlap, latency_s, skips):
    """One sequence against a ~25 ms Verify. The calls without drafts (a
    draft ahead contradicted, or the proposer had none) are mostly followed
    by calls whose first draft is accepted. Drafting ahead beside a 20 ms
    proposer, or lock-step with a quick one, the next call comes right
    after the answer, so once the gateway has the scorer's fit those calls
    ask for no decode-ahead step, which would make the next call wait for
    it (SmolLM2 on 2 cores of an AMD EPYC: ~45 ms rounds instead of ~24).
    Lock-step with a 20 ms proposer, the step is done before the next call
    comes: nothing to skip. Calls with drafts never ask (the scorer decodes
    ahead only after draft-less ones); the output is lock-step's."""
    outputs, calls = _generate(overlap, num_seqs=1, max_tokens=60, latency_s=latency_s, fixed_s=0.02,
                               per_token_s=0.001)
    assert outputs == [_expected(_prompt(0), 60)]
    assert not any(skip for drafted, skip in calls.sent if drafted)
    plain = [skip for drafted, skip in calls.sent if not drafted]
    if skips:
        assert sum(plain) >= 3, f"draft-less calls asking for no step ahead: {plain}"
    else:
        assert len(plain) >= 3 and not any(plain), plain


def test_drafting_ahead_asks_for_two_rounds_and_a_target_token_only_where_drafts_cannot_change_output():
    from specdec.gateway.wire import propose_request

    def budget(k: int, strategy: int, ahead: bool = True, features: tuple[int, ...] = (), in_flight: int = 0) -> int:
        params = _params([5, 7, 11], k, 40)
        params.verify_strategy = strategy
        seq = Sequence("r", params, _Tokenizer(), (), 512)
        seq.rounds_in_flight = in_flight
        seq.proposer_len = len(seq.tokens)  # held by the proposer: its update travels as columns
        if features:  # an eagle3/mtp proposer opened it, holding the features of all but the newest token
            seq.proposer_opened(features, len(seq.tokens) - 1)
        message = propose_request([seq], [], ahead).request
        if message.sequences:  # methods with features travel as one update each
            return message.sequences[0].num_speculative_tokens
        return list(message.round.num_speculative_tokens)[0]

    assert budget(3, GREEDY) == 7 and budget(3, pb.VERIFY_STRATEGY_TARGET_MATCH) == 7
    assert budget(3, GREEDY, features=(1, 3, 4)) == 7  # feature methods draft ahead too
    assert budget(8, GREEDY) == 16  # 2k + 1 capped at MAX_SPECULATIVE_TOKENS
    assert budget(3, GREEDY, in_flight=2) == 9  # a proposer slower than the Verify: a token per round it outlasts
    assert budget(6, GREEDY, in_flight=5) == 16
    assert budget(3, GREEDY, ahead=False, in_flight=2) == 3
    assert budget(3, pb.VERIFY_STRATEGY_REJECTION) == 3  # its sample depends on the drafts: lock-step
    assert budget(3, GREEDY, ahead=False) == 3


def test_only_copy_drafts_ahead_are_asked_to_cover_the_rounds_a_slow_exchange_outlasts():
    """A 30 ms proposer against a 5 ms Verify outlasts ~5 rounds: a copy
    method's draft ahead is asked for 5 tokens more (they cost it nothing);
    a model's is not (each token is a forward of the draft model)."""
    async def run():
        loop = SpecLoop(ReplicaSet("scorer", [SCORER]), {"ngram": ReplicaSet("ngram", [PROPOSER])},
                        vocab_size=VOCAB, config=LoopConfig(overlap=Overlap.AHEAD))
        loop._propose_s, loop._verify_s, loop._verify_measured = 0.03, 0.005, True
        copy, model = (Sequence(f"r{i}", _params(_prompt(i), 3, 40), _Tokenizer(), (), 512) for i in range(2))
        model.model_drafted = 1.0  # its drafts carried a model's probabilities

        async def exchange(addr, seqs):
            return None

        loop._exchange_ahead = exchange  # type: ignore[method-assign]
        loop._draft_ahead([copy, model])
        await asyncio.gather(*(f.task for f in loop._in_flight.values()))
        return copy.rounds_in_flight, model.rounds_in_flight, copy.propose_budget(True), model.propose_budget(True)

    assert asyncio.run(run()) == (5, 0, 12, 7)
