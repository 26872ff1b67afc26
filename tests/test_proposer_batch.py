"""The batched proposer servicer (one Proposer.advance per method and message)
against the per-sequence proposer API: many sequences per message, opens,
updates, releases (completed ones feed the suffix global tree, at once or,
as a served replica does, in upkeep run while no message waits, bounded
when messages come back to back), re-opens after UNKNOWN_SEQUENCE, and bad
updates in the middle of a batch, in-process and through a real proposer
process over gRPC."""
from __future__ import annotations

import asyncio
import queue
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest

from specdec.launcher import free_port, wait_serving
from specdec.proposer_svc.base import SeqOptions
from specdec.proposer_svc.registry import ReplicaSettings, build_proposers
from specdec.proposer_svc.server import MESSAGE_WAIT_SECONDS, UNKNOWN_MESSAGE, ProposerServicer
from specdec.proposer_svc.suffix import SuffixConfig, SuffixProposer
from specdec.protos.v1 import specdec_pb2 as pb
from specdec.protos.v1 import specdec_pb2_grpc as pb_grpc

DRAFTING = ["ngram", "suffix", "hybrid"]
METHODS = [*DRAFTING, "naive"]  # naive: its batched advance (no drafts) against the per-sequence API
OK, UNKNOWN, INVALID = pb.SEQUENCE_STATUS_OK, pb.SEQUENCE_STATUS_UNKNOWN_SEQUENCE, pb.SEQUENCE_STATUS_INVALID


def _text(rng: np.random.Generator, length: int) -> list[int]:
    """Tokens drawn from a few shared phrases (so every method drafts)."""
    phrases = [list(range(10 * p, 10 * p + 3 + p % 5)) for p in range(8)]
    out: list[int] = []
    while len(out) < length:
        out.extend(phrases[int(rng.integers(len(phrases)))] if rng.random() < 0.8 else [int(rng.integers(100))])
    return out[:length]


class Driver:
    """Rounds of Propose messages over many sequences, each checked against
    reference proposers driven one call at a time with the same inputs."""

    def __init__(self, exchange, seed: int, served: bool = False, columns: bool = False) -> None:
        self.exchange = exchange  # ProposeRequest -> ProposeResponse
        self.columns = columns  # plain updates go in ProposeRequest.round (every other round)
        self.rounds = 0
        self.rng = np.random.default_rng(seed)
        # served: the proposer caches finished outputs between messages (as `specdec proposer` does)
        self.reference = build_proposers(METHODS, _settings(served))
        self.tokens: dict[str, list[int]] = {}  # seq_id -> its whole text
        self.sent: dict[str, int] = {}  # seq_id -> tokens the proposer holds (0: open next)
        self.method: dict[str, str] = {}
        self.next_id = 0
        self.drafted = 0

    def add(self, count: int) -> None:
        for _ in range(count):
            seq_id = f"s{self.next_id}"
            self.next_id += 1
            self.tokens[seq_id] = _text(self.rng, 400)
            self.sent[seq_id], self.method[seq_id] = 0, METHODS[self.next_id % len(METHODS)]

    def update(self, seq_id: str, k: int) -> pb.SequenceUpdate:
        """The next update of seq_id (opening it with 20..60 tokens, else 1..4 more)."""
        n = self.sent[seq_id]
        if n == 0:
            end = int(self.rng.integers(20, 60))
            return pb.SequenceUpdate(seq_id=seq_id, open=True, token_ids=self.tokens[seq_id][:end], context_len=end,
                                     num_speculative_tokens=k, options=pb.ProposerOptions(
                                         method=self.method[seq_id], min_token_prob=0.1))
        end = n + int(self.rng.integers(1, 5))
        return pb.SequenceUpdate(seq_id=seq_id, token_ids=self.tokens[seq_id][n:end], context_len=end,
                                 num_speculative_tokens=k)

    def round(self, releases: list[tuple[str, bool]] = (), extra: list[pb.SequenceUpdate] = (),
              skip: str = "") -> pb.ProposeResponse:
        """Sends the extra updates, then every live sequence's but skip's, and
        checks the drafts of the latter against the reference."""
        gone = {s for s, _ in releases} | {skip}
        updates = list(extra) + [self.update(s, int(self.rng.integers(0, 9))) for s in self.tokens if s not in gone]
        self.rounds += 1
        # every other round, the plain updates (not the extra ones) go as columns
        plain = updates[len(extra):]
        in_columns = [u for u in plain if not u.open] if self.columns and self.rounds % 2 else []
        in_sequences = list(extra) + [u for u in plain if u.open or not in_columns]
        request = pb.ProposeRequest(releases=[pb.SequenceRelease(seq_id=s, completed=c) for s, c in releases],
                                    sequences=in_sequences)
        if in_columns:
            request.round.CopyFrom(as_columns(in_columns))
        response = self.exchange(request)
        assert [d.seq_id for d in response.drafts] == [u.seq_id for u in in_sequences]
        assert response.HasField("round") == bool(in_columns)
        for seq_id, completed in releases:
            self.reference[self.method.pop(seq_id)].stop(seq_id, completed)
            del self.tokens[seq_id], self.sent[seq_id]
        ours = list(zip(in_columns, column_drafts(response.round, len(in_columns))))
        ours += list(zip(in_sequences[len(extra):], response.drafts[len(extra):]))
        assert len(ours) == len(plain)
        for u, d in ours:
            assert d.status == OK, (u.seq_id, d.message)
            prop = self.reference[self.method[u.seq_id]]
            if u.open:
                prop.start(u.seq_id, np.array(u.token_ids, dtype=np.int32), SeqOptions(min_token_prob=0.1))
            else:
                prop.extend(u.seq_id, np.array(u.token_ids, dtype=np.int32))
            self.sent[u.seq_id] = u.context_len
        for u, d in ours:
            k = u.num_speculative_tokens
            expected = self.reference[self.method[u.seq_id]].propose([(u.seq_id, k)])[0].truncated(k)
            assert list(d.token_ids) == expected.token_ids.tolist(), u.seq_id
            self.drafted += len(expected.token_ids)
        for prop in self.reference.values():
            prop.between_messages()
        return response

    def scenario(self) -> None:
        """Opens, rounds, completed and cancelled releases (the suffix global
        tree fills), bad updates and a desynchronised sequence mid-batch (only
        they fail), and the re-open that follows."""
        self.add(40)
        for _ in range(6):
            self.round()
        done = list(self.tokens)[:10]
        self.round(releases=[(s, i % 3 != 0) for i, s in enumerate(done)])
        self.add(10)
        for _ in range(4):
            self.round()
        live = list(self.tokens)
        victim, holder = live[3], live[5]
        bad_len = self.update(victim, 3)
        bad_len.context_len += 1  # a length the proposer does not hold
        extra = [pb.SequenceUpdate(seq_id=holder, token_ids=[1], num_speculative_tokens=99),
                 pb.SequenceUpdate(seq_id=holder, token_ids=[-4], num_speculative_tokens=2),
                 bad_len,
                 pb.SequenceUpdate(seq_id="", num_speculative_tokens=2),
                 pb.SequenceUpdate(seq_id="nobody", token_ids=[1], num_speculative_tokens=2)]
        response = self.round(extra=extra, skip=victim)
        assert [d.status for d in response.drafts[:len(extra)]] == [INVALID, INVALID, UNKNOWN, INVALID, UNKNOWN]
        assert [d.message.split(":")[0] for d in response.drafts[:2]] == ["num_speculative_tokens", "token_ids"]
        assert len(response.drafts[2].token_ids) == 0
        # the proposer dropped victim: its next update is refused, then it re-opens
        self.sent[victim] = self.sent[victim] + len(bad_len.token_ids)
        response = self.exchange(pb.ProposeRequest(sequences=[self.update(victim, 3)]))
        assert response.drafts[0].status == UNKNOWN
        self.sent[victim] = 0
        self.reference[self.method[victim]].stop(victim, False)
        for _ in range(3):
            self.round()
        assert self.drafted > 100


def as_columns(updates: list[pb.SequenceUpdate]) -> pb.RoundUpdates:
    """Plain updates as a ProposeRequest.round."""
    return pb.RoundUpdates(seq_ids=[u.seq_id for u in updates], token_counts=[len(u.token_ids) for u in updates],
                           token_ids=[t for u in updates for t in u.token_ids],
                           context_lens=[u.context_len for u in updates],
                           num_speculative_tokens=[u.num_speculative_tokens for u in updates])


def column_drafts(answer: pb.RoundDrafts, n: int) -> list[pb.Draft]:
    """A ProposeResponse.round as one Draft message per entry."""
    assert len(answer.draft_counts) == n and sum(answer.draft_counts) == len(answer.token_ids)
    assert len(answer.statuses) in (0, n) and len(answer.messages) == len(answer.statuses)
    bounds = np.cumsum([0, *answer.draft_counts])
    return [pb.Draft(status=answer.statuses[i] if answer.statuses else OK,
                     message=answer.messages[i] if answer.messages else "",
                     token_ids=answer.token_ids[bounds[i]:bounds[i + 1]]) for i in range(n)]


def _settings(served: bool) -> ReplicaSettings:
    return ReplicaSettings(SuffixConfig(cache_between_messages=served))


def _bad_updates_named(exchange) -> None:
    """Bad updates in one message: each INVALID with its field named, the good ones served."""
    good = pb.SequenceUpdate(seq_id="g", open=True, token_ids=[1, 2, 3, 1, 2], context_len=5,
                             num_speculative_tokens=2, options=pb.ProposerOptions(method="ngram"))
    bad = [pb.SequenceUpdate(seq_id="b1", open=True, token_ids=[1], num_speculative_tokens=99,
                             options=pb.ProposerOptions(method="ngram")),
           pb.SequenceUpdate(seq_id="b2", open=True, token_ids=[1, -2], options=pb.ProposerOptions(method="ngram")),
           pb.SequenceUpdate(seq_id="", num_speculative_tokens=1),
           pb.SequenceUpdate(seq_id="b3", open=True, token_ids=[1], options=pb.ProposerOptions(method="nope")),
           pb.SequenceUpdate(seq_id="b4", open=True, token_ids=[1],
                             options=pb.ProposerOptions(method="ngram", min_n=3, max_n=2)),
           pb.SequenceUpdate(seq_id="b5", open=True, token_ids=[1], num_speculative_tokens=2, model_steps=3,
                             options=pb.ProposerOptions(method="ngram"))]
    response = exchange(pb.ProposeRequest(sequences=[bad[0], bad[1], good, *bad[2:]]))
    statuses = [(d.status, d.message) for d in response.drafts]
    assert statuses[2] == (OK, "") and list(response.drafts[2].token_ids) == [3, 1]
    for (status, message), field in zip(statuses[:2] + statuses[3:],
                                        ["num_speculative_tokens", "token_ids", "seq_id", "options.method",
                                         "options.min_n", "model_steps"]):
        assert status == INVALID and message.startswith(field), message
    follow = exchange(pb.ProposeRequest(sequences=[
        pb.SequenceUpdate(seq_id=s, token_ids=[3], context_len=6, num_speculative_tokens=2) for s in ("b1", "g")]))
    assert [d.status for d in follow.drafts] == [UNKNOWN, OK]  # nothing of b1 was opened
    assert list(follow.drafts[1].token_ids) == [1, 2]
    for steps in (3, -1):  # model_steps beyond the round's budget: refused, the sequence kept
        refused = exchange(pb.ProposeRequest(sequences=[
            pb.SequenceUpdate(seq_id="g", context_len=6, num_speculative_tokens=2, model_steps=steps)]))
        assert refused.drafts[0].status == INVALID and refused.drafts[0].message.startswith("model_steps"), steps
    kept = exchange(pb.ProposeRequest(sequences=[  # a method without a model ignores it
        pb.SequenceUpdate(seq_id="g", context_len=6, num_speculative_tokens=2, model_steps=0)]))
    assert kept.drafts[0].status == OK and list(kept.drafts[0].token_ids) == [1, 2]


def test_a_sequence_named_twice_in_one_message_is_updated_in_order():
    """Its updates apply one after the other (each length check sees the
    previous one), as if sent in two messages."""
    handle = ProposerServicer(build_proposers(DRAFTING)).handle
    for method in DRAFTING:
        opts = pb.ProposerOptions(method=method, min_token_prob=0.1)
        response = handle(pb.ProposeRequest(sequences=[
            pb.SequenceUpdate(seq_id="d", open=True, token_ids=[1, 2, 3, 1], context_len=4, options=opts),
            pb.SequenceUpdate(seq_id="d", token_ids=[2], context_len=5, num_speculative_tokens=2),
            pb.SequenceUpdate(seq_id="d", token_ids=[3, 1], context_len=7, num_speculative_tokens=2),
            pb.SequenceUpdate(seq_id="d", open=True, token_ids=[7, 8, 7], context_len=3, options=opts,
                              num_speculative_tokens=1)]))
        assert [d.status for d in response.drafts] == [OK] * 4, [d.message for d in response.drafts]
        assert list(response.drafts[3].token_ids) == [8]


@pytest.mark.parametrize("seed,columns", [(0, False), (1, False), (0, True), (1, True)])
def test_batched_servicer_drafts_as_the_per_sequence_api(seed, columns):
    servicer = ProposerServicer(build_proposers(METHODS))
    Driver(servicer.handle, seed, columns=columns).scenario()


def test_bad_columns_are_named_and_fail_alone():
    """ProposeRequest.round: columns that do not fit together fail every
    entry (INVALID, the field named); a bad entry fails alone; an unknown
    sequence is UNKNOWN; the good entries draft as in a SequenceUpdate."""
    proposers = build_proposers(["ngram"])
    proposers["draft"] = build_proposers(["ngram"])["ngram"]  # stands in for a method with sampled drafts
    handle = ProposerServicer(proposers).handle
    text = [1, 2, 3, 1, 2]
    handle(pb.ProposeRequest(sequences=[
        pb.SequenceUpdate(seq_id=s, open=True, token_ids=text, context_len=5,
                          options=pb.ProposerOptions(method="draft" if s == "m" else "ngram")) for s in "abcdm"]))

    def answer(**cols) -> list[tuple[int, str, list[int]]]:
        response = handle(pb.ProposeRequest(round=pb.RoundUpdates(**cols)))
        return [(d.status, d.message, list(d.token_ids)) for d in column_drafts(response.round, len(cols["seq_ids"]))]

    shape = answer(seq_ids=["a", "b"], token_counts=[1, 1], token_ids=[3], context_lens=[6, 6],
                   num_speculative_tokens=[2, 2])
    assert [(s, m.split(":")[0]) for s, m, _ in shape] == [(INVALID, "round.token_ids")] * 2
    shape = answer(seq_ids=["a", "b"], token_counts=[1], token_ids=[3], context_lens=[6, 6],
                   num_speculative_tokens=[2, 2])
    assert [(s, m.split(":")[0]) for s, m, _ in shape] == [(INVALID, "round.token_counts")] * 2
    # nothing was applied: a and b still hold 5 tokens
    mixed = answer(seq_ids=["a", "b", "c", "nobody", "d", "d", "m", ""],
                   token_counts=[1, 1, 1, 1, 1, 1, 1, 1], token_ids=[3, 3, -3, 3, 3, 3, 3, 3],
                   context_lens=[6, 6, 6, 6, 6, 6, 6, 6], num_speculative_tokens=[2, 99, 2, 2, 2, 2, 2, 2])
    assert mixed[0] == (OK, "", [1, 2])
    assert [(s, m.split(":")[0]) for s, m, _ in mixed[1:]] == [
        (INVALID, "round.num_speculative_tokens"), (INVALID, "round.token_ids"), (UNKNOWN, UNKNOWN_MESSAGE),
        (INVALID, "round.seq_ids"), (INVALID, "round.seq_ids"), (INVALID, "round.seq_ids"),
        (INVALID, "round.seq_ids")]
    assert all(not toks for _, _, toks in mixed[1:])
    # the failed entries changed nothing; a desynchronised one is dropped
    again = answer(seq_ids=["b", "c", "a"], token_counts=[1, 1, 1], token_ids=[3, 3, 1], context_lens=[6, 6, 9],
                   num_speculative_tokens=[2, 2, 2])
    assert [(s, t) for s, _, t in again] == [(OK, [1, 2]), (OK, [1, 2]), (UNKNOWN, [])]


def test_batched_servicer_names_bad_fields():
    _bad_updates_named(ProposerServicer(build_proposers(METHODS)).handle)


#: idle time a real proposer process gets after a message that completes
#: sequences: its upkeep for them (a few ms) runs while no message waits
UPKEEP_IDLE_S = 1.0


def test_real_proposer_process_batches_as_the_per_sequence_api():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "proposer", "--methods", ",".join(METHODS),
                             "--port", str(port)])
    requests: queue.Queue = queue.Queue()
    try:
        addr = f"127.0.0.1:{port}"
        wait_serving(addr, proc, 120, "proposer")
        with grpc.insecure_channel(addr) as channel:
            responses = pb_grpc.ProposerStub(channel).Propose(iter(requests.get, None))

            def exchange(request: pb.ProposeRequest) -> pb.ProposeResponse:
                requests.put(request)
                response = next(responses)
                if any(r.completed for r in request.releases):
                    # the replica puts finished outputs into the global tree while no message waits (the
                    # reference, between its messages, at once): the next message sent straight away found
                    # that upkeep unfinished once in a CI run, and the rounds after it drafted otherwise
                    time.sleep(UPKEEP_IDLE_S)
                return response

            Driver(exchange, seed=2, served=True, columns=True).scenario()
            _bad_updates_named(exchange)
            requests.put(None)
    finally:
        proc.terminate()
        proc.wait(30)


class InProcessStream:
    """A Propose stream of a servicer driven in-process. grpc resumes the
    servicer once an answer is written; here a message is either
    ``queued``: read (so waiting) before the servicer resumes, as when the
    gateway answers back to back, or sent ``after_idle``: the servicer has
    been idle (running upkeep) for idle_s first."""

    def __init__(self, servicer: ProposerServicer) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._read = asyncio.Event()  # the servicer read the message queued last
        self.responses = servicer.Propose(self._requests(), None)

    async def _requests(self):
        while (request := await self._queue.get()) is not None:
            self._read.set()
            yield request
        self._read.set()

    async def queued(self, message: pb.ProposeRequest, pause_s: float = 0.0) -> pb.ProposeResponse:
        """(Not the first message: the servicer reads ahead once started.)"""
        self._read.clear()
        await self._queue.put(message)
        await self._read.wait()
        await asyncio.sleep(pause_s)
        return await self.responses.__anext__()

    async def after_idle(self, message: pb.ProposeRequest, idle_s: float = 0.05) -> pb.ProposeResponse:
        return await self.after(message, asyncio.sleep(idle_s))

    async def after(self, message: pb.ProposeRequest, idle) -> pb.ProposeResponse:
        """Sent once the servicer has been idle until ``idle`` (a coroutine) returned."""
        answer = asyncio.ensure_future(self.responses.__anext__())
        await idle
        await self._queue.put(message)
        return await answer

    async def end(self) -> None:
        """Ends the stream (its end read before the servicer resumes)."""
        self._read.clear()
        await self._queue.put(None)
        await self._read.wait()
        with pytest.raises(StopAsyncIteration):
            await self.responses.__anext__()


OUTPUT = [40, 41, 42, 43, 44, 45, 46, 47]
SUFFIX = pb.ProposerOptions(method="suffix")
# a finishes with OUTPUT; b ends with its start, which it holds nowhere else:
# b drafts OUTPUT[4:7] once OUTPUT is in the global trie, nothing before
OPEN_A = pb.ProposeRequest(sequences=[pb.SequenceUpdate(seq_id="a", open=True, token_ids=[1, 2, 3], context_len=3,
                                                        options=SUFFIX)])
FINISH_A = pb.ProposeRequest(sequences=[pb.SequenceUpdate(seq_id="a", token_ids=OUTPUT, context_len=11)])
RELEASE_A_OPEN_B = pb.ProposeRequest(
    releases=[pb.SequenceRelease(seq_id="a", completed=True)],
    sequences=[pb.SequenceUpdate(seq_id="b", open=True, token_ids=[9, 8, *OUTPUT[:4]], context_len=6,
                                 num_speculative_tokens=3, options=SUFFIX)])
ASK_B = pb.ProposeRequest(sequences=[pb.SequenceUpdate(seq_id="b", context_len=6, num_speculative_tokens=3)])


def _drafts(response: pb.ProposeResponse) -> list[int]:
    return list(response.drafts[0].token_ids)


async def _release_a(stream: InProcessStream) -> list[int]:
    """b's drafts in the message that releases a."""
    await stream.after_idle(OPEN_A)
    await stream.after_idle(FINISH_A)
    return _drafts(await stream.after_idle(RELEASE_A_OPEN_B))


@pytest.mark.parametrize("served", [False, True])
def test_finished_outputs_reach_the_global_tree_once_the_stream_is_idle(served):
    """A served replica puts a completed sequence's output into the suffix
    global tree after answering the message that released it, while no
    message waits (off the round's critical path); a message already
    waiting is answered first, without it. Otherwise at once."""
    servicer = ProposerServicer(build_proposers(["suffix"], _settings(served)))
    proposer = servicer.proposers["suffix"]

    async def drive() -> None:
        stream = InProcessStream(servicer)
        assert await _release_a(stream) == ([] if served else OUTPUT[4:7])
        assert _drafts(await stream.queued(ASK_B)) == ([] if served else OUTPUT[4:7])
        assert proposer.upkeep_progress() == ((1, 0) if served else (1, 1))
        assert _drafts(await stream.after_idle(ASK_B)) == OUTPUT[4:7]
        assert proposer.upkeep_progress() == (1, 1)
        await stream.end()

    asyncio.run(drive())


@pytest.mark.parametrize("bound", ["messages", "seconds"])
def test_upkeep_postponed_too_long_runs_before_the_next_message(bound):
    """Messages back to back postpone upkeep (each is waiting when the
    servicer is back) only so far: once max_postponed messages more are
    answered, or at the first answer after it waited max_delay_s, it runs
    before the next message is handled."""
    servicer = ProposerServicer(build_proposers(["suffix"], _settings(True)))
    upkeep = servicer.upkeep
    upkeep.max_postponed, upkeep.max_delay_s = (2, float("inf")) if bound == "messages" else (100, 0.02)

    async def drive() -> None:
        stream = InProcessStream(servicer)
        assert await _release_a(stream) == []
        if bound == "messages":
            assert _drafts(await stream.queued(ASK_B)) == []
            assert _drafts(await stream.queued(ASK_B)) == []  # postponed past 2 messages,
            assert _drafts(await stream.queued(ASK_B)) == OUTPUT[4:7]  # not past a third
        else:
            assert _drafts(await stream.queued(ASK_B)) == []
            assert _drafts(await stream.queued(ASK_B, pause_s=0.04)) == OUTPUT[4:7]
        await stream.end()

    asyncio.run(drive())


@pytest.mark.parametrize("how", ["stream end", "stream closed"])
def test_upkeep_left_is_done_when_the_stream_ends(how):
    """Outputs released in messages back to back, their upkeep postponed,
    are all in the global tree once the stream, the last one open, ends or
    is closed (the servicer's finally, as on a cancelled RPC): none is lost."""
    servicer = ProposerServicer(build_proposers(["suffix"], _settings(True)))
    servicer.upkeep.max_postponed = 100
    proposer = servicer.proposers["suffix"]

    async def drive() -> None:
        stream = InProcessStream(servicer)
        await _release_six(stream)
        assert proposer.upkeep_progress()[1] == 0
        if how == "stream end":
            await stream.end()
        else:
            await stream.responses.aclose()

    asyncio.run(drive())
    assert proposer.upkeep_progress() == (6, 6) and proposer.stats()["cached_requests"] == 6
    for i, out in enumerate(SIX.values()):
        proposer.start(f"probe{i}", np.array([7, *out[:3]], dtype=np.int32), SeqOptions())
        assert proposer.propose([(f"probe{i}", 3)])[0].token_ids.tolist() == out[3:6]


class SlowUpkeepSuffix(SuffixProposer):
    """A served suffix proposer whose upkeep takes at least step_s a slice:
    each sliced between_messages call sleeps, then caches one output."""

    def __init__(self, step_s: float) -> None:
        super().__init__(SuffixConfig(cache_between_messages=True))
        self.step_s = step_s

    def between_messages(self, budget_s=None):
        if budget_s is None:
            return super().between_messages()
        time.sleep(self.step_s)
        return super().between_messages(0.0)  # one step: one output of up to INSERT_CHUNK tokens


def _wait_samples() -> tuple[float, float]:
    """specdec_proposer_message_wait_seconds' (count, sum) so far."""
    get = MESSAGE_WAIT_SECONDS.collect()[0].samples
    by_name = {s.name: s.value for s in get}
    return by_name["specdec_proposer_message_wait_seconds_count"], by_name["specdec_proposer_message_wait_seconds_sum"]


def test_message_wait_counts_each_message_and_the_overdue_upkeep_it_waited_for():
    """A message read while overdue upkeep runs (forced after every answer:
    max_postponed 0) waits for it: the wait histogram counts every message
    handled, and its sum holds at least the upkeep's forced sleep."""
    step_s = 0.02
    servicer = ProposerServicer({"suffix": SlowUpkeepSuffix(step_s)})
    servicer.upkeep.max_postponed, servicer.upkeep.max_delay_s = 0, float("inf")
    count0, sum0 = _wait_samples()

    async def drive() -> None:
        stream = InProcessStream(servicer)
        await _release_a(stream)  # 3 messages; a's output queued by the last one
        assert _drafts(await stream.queued(ASK_B)) == OUTPUT[4:7]  # read before the overdue upkeep ran
        await stream.end()

    asyncio.run(drive())
    count, total = _wait_samples()
    assert count - count0 == 4
    assert total - sum0 >= step_s


async def _release_six(stream: InProcessStream) -> None:
    """Six sequences opened, finished and released as completed, the
    releases back to back: their outputs' upkeep queued, postponed."""
    await stream.after_idle(pb.ProposeRequest(sequences=[
        pb.SequenceUpdate(seq_id=s, open=True, token_ids=[1], context_len=1, options=SUFFIX) for s in SIX]))
    await stream.after_idle(pb.ProposeRequest(sequences=[
        pb.SequenceUpdate(seq_id=s, token_ids=out, context_len=9) for s, out in SIX.items()]))
    for seq_id in SIX:
        await stream.queued(pb.ProposeRequest(releases=[pb.SequenceRelease(seq_id=seq_id, completed=True)]))


async def _end(stream: InProcessStream, how: str) -> None:
    if how == "stream end":
        await stream.end()
    else:
        await stream.responses.aclose()


async def _until_done(proposer: SuffixProposer) -> None:
    """Returns once every output queued is in the global trie (the test's timeout bounds it)."""
    while proposer.upkeep_progress()[1] < proposer.upkeep_progress()[0]:
        await asyncio.sleep(0.005)


SIX = {f"s{i}": [100 + 10 * i + j for j in range(8)] for i in range(6)}
PROBE_B = pb.ProposeRequest(sequences=[pb.SequenceUpdate(seq_id="b", open=True, token_ids=[7, *SIX["s5"][:3]],
                                                         context_len=4, num_speculative_tokens=3, options=SUFFIX)])
ASK_PROBE = pb.ProposeRequest(sequences=[pb.SequenceUpdate(seq_id="b", context_len=4, num_speculative_tokens=3)])


def _unforced(step_s: float) -> tuple[SlowUpkeepSuffix, ProposerServicer]:
    """A servicer over a slow-upkeep suffix proposer whose upkeep is never forced (no overdue bound)."""
    proposer = SlowUpkeepSuffix(step_s=step_s)
    servicer = ProposerServicer({"suffix": proposer})
    servicer.upkeep.max_postponed, servicer.upkeep.max_delay_s = 100, float("inf")
    return proposer, servicer


async def _two_streams_six_released(servicer: ProposerServicer) -> tuple[InProcessStream, InProcessStream]:
    """Two open streams: an idle one, and one that has released SIX's outputs."""
    other, stream = InProcessStream(servicer), InProcessStream(servicer)
    await other.after_idle(pb.ProposeRequest())
    await _release_six(stream)
    return other, stream


@pytest.mark.parametrize("how", ["stream end", "stream closed"])
def test_upkeep_left_by_a_stream_waits_for_the_other_streams_messages(how):
    """A stream that ends with upkeep left, while another stream is open,
    leaves it to slices (upkeep is replica-wide): a message on the other
    stream is answered before it is all done, and it is all done
    afterwards, the other stream still open."""
    proposer, servicer = _unforced(step_s=0.01)

    async def drive() -> None:
        other, stream = await _two_streams_six_released(servicer)
        assert proposer.upkeep_progress() == (6, 0)
        await _end(stream, how)
        assert _drafts(await other.queued(PROBE_B)) == []  # answered before s5's output is cached
        assert proposer.upkeep_progress()[1] < 6
        assert _drafts(await other.after(ASK_PROBE, _until_done(proposer))) == SIX["s5"][3:6]
        await other.end()

    asyncio.run(drive())
    assert proposer.stats()["cached_requests"] == 6


def test_upkeep_left_by_a_stream_is_done_while_the_other_streams_are_idle():
    """Upkeep a stream left when it ended, another stream open, is not all
    done at its end, but in slices while the streams still open send nothing."""
    proposer, servicer = _unforced(step_s=0.001)

    async def drive() -> None:
        other, stream = await _two_streams_six_released(servicer)
        await stream.end()
        assert proposer.upkeep_progress() == (6, 0)  # not all at once at the end
        await _until_done(proposer)
        assert _drafts(await other.queued(PROBE_B)) == SIX["s5"][3:6]
        await other.end()

    asyncio.run(drive())


def test_real_proposer_caches_every_output_released_back_to_back():
    """Through a real proposer process: many completed releases in messages
    sent without waiting for answers (each waits when the servicer is back:
    upkeep postponed, then forced); on a stream opened once the first ended,
    every output is drafted from its method's global tree: none was lost."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "proposer", "--methods", "suffix,hybrid",
                             "--port", str(port)])
    outputs = {f"s{i}": [1000 * (i + 1) + j for j in range(200)] for i in range(40)}
    method = {s: ("suffix", "hybrid")[i % 2] for i, s in enumerate(outputs)}
    first = [pb.ProposeRequest(sequences=[
                 pb.SequenceUpdate(seq_id=s, open=True, token_ids=[1], context_len=1,
                                   options=pb.ProposerOptions(method=method[s])) for s in outputs]),
             pb.ProposeRequest(sequences=[pb.SequenceUpdate(seq_id=s, token_ids=out, context_len=201)
                                          for s, out in outputs.items()]),
             *[pb.ProposeRequest(releases=[pb.SequenceRelease(seq_id=s, completed=True)]) for s in outputs]]
    probes = pb.ProposeRequest(sequences=[
        pb.SequenceUpdate(seq_id=f"probe-{s}", open=True, token_ids=[7, *out[50:54]], context_len=5,
                          num_speculative_tokens=3, options=pb.ProposerOptions(method=method[s]))
        for s, out in outputs.items()])
    try:
        addr = f"127.0.0.1:{port}"
        wait_serving(addr, proc, 120, "proposer")
        with grpc.insecure_channel(addr) as channel:
            stub = pb_grpc.ProposerStub(channel)
            answers = list(stub.Propose(iter(first)))  # all sent at once; ends when the stream does
            assert len(answers) == len(first)
            drafts = next(stub.Propose(iter([probes]))).drafts
        assert [list(d.token_ids) for d in drafts] == [out[54:57] for out in outputs.values()]
    finally:
        proc.terminate()
        proc.wait(30)


def test_naive_batched_round_checks_lengths_and_drafts_nothing():
    """naive's one-call round: in-sync sequences get an empty draft, one whose
    held length differs is dropped (UNKNOWN_SEQUENCE), as for every method."""
    handle = ProposerServicer(build_proposers(["naive"])).handle
    opts = pb.ProposerOptions(method="naive")
    handle(pb.ProposeRequest(sequences=[
        pb.SequenceUpdate(seq_id=s, open=True, token_ids=[1, 2, 3], context_len=3, options=opts) for s in "abc"]))
    response = handle(pb.ProposeRequest(sequences=[
        pb.SequenceUpdate(seq_id="a", token_ids=[4], context_len=4, num_speculative_tokens=3),
        pb.SequenceUpdate(seq_id="b", token_ids=[4, 5], context_len=9, num_speculative_tokens=3),
        pb.SequenceUpdate(seq_id="c", token_ids=[4, 5], num_speculative_tokens=3)]))
    assert [d.status for d in response.drafts] == [OK, UNKNOWN, OK]
    assert all(len(d.token_ids) == 0 for d in response.drafts)
    follow = handle(pb.ProposeRequest(sequences=[
        pb.SequenceUpdate(seq_id=s, token_ids=[6], context_len=n, num_speculative_tokens=1)
        for s, n in (("a", 5), ("b", 6), ("c", 6))]))
    assert [d.status for d in follow.drafts] == [OK, UNKNOWN, OK]  # b was dropped; a and c held every token
