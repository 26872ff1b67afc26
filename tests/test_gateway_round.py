"""Unit tests of the gateway's round (propose → verify → commit) around a
scripted scorer stub: how each Verify status is settled, and that the draft
plan of the adaptive draft length is pure. The system tests with real
processes are in test_e2e_stories.py, test_faults.py and test_adaptive.py."""
from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from specdec.drafts import Draft
from specdec.gateway import metrics
from specdec.gateway.costs import plan_drafts
from specdec.gateway.discovery import ReplicaSet
from specdec.gateway.loop import LoopConfig, SpecLoop
from specdec.gateway.request import GenParams
from specdec.gateway.sequence import Delta, Sequence
from specdec.limits import GREEDY
from specdec.protos.v1 import specdec_pb2 as pb

SCORER = "scorer-a:1"
PROMPT = [3, 4, 5]


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


class _ScriptedScorer:
    """Answers each Verify with the next scripted (status, output tokens)."""

    def __init__(self, script: list[tuple[int, list[int]]]) -> None:
        self.script = list(script)
        self.requests: list[pb.VerifyRequest] = []

    async def Verify(self, request, timeout=None):
        self.requests.append(request)
        status, output = self.script.pop(0)
        results = [pb.VerifyResult(seq_id=s.seq_id, status=status, output_token_ids=output,
                                   num_accepted=max(0, len(output) - 1), message="scripted")
                   for s in request.sequences]
        return pb.VerifyResponse(results=results, compute_s=0.001)

    async def Release(self, request, timeout=None):
        return pb.ReleaseResponse()


def _params(method: str = "none", num_speculative_tokens: int = 0, adaptive: bool = True) -> GenParams:
    return GenParams(prompt_ids=list(PROMPT), max_tokens=50, stop=[], ignore_eos=True, temperature=0.0,
                     top_k=0, top_p=1.0, seed=1, method=method, num_speculative_tokens=num_speculative_tokens,
                     min_n=1, max_n=4, max_tree_depth=64, max_spec_factor=1.0, min_token_prob=0.1,
                     verify_strategy=GREEDY, accept_policy=0, adaptive=adaptive)


def _loop_with(scorer: _ScriptedScorer, max_stalled_rounds: int = 200) -> SpecLoop:
    loop = SpecLoop(ReplicaSet("scorer", [SCORER]), {}, vocab_size=100,
                    config=LoopConfig(max_stalled_rounds=max_stalled_rounds, stall_sleep_s=0.0))
    loop.conns.scorer = lambda addr: scorer  # type: ignore[method-assign]
    return loop


def _run_rounds(scorer: _ScriptedScorer, rounds: int, max_stalled_rounds: int = 200) -> Sequence:
    """One greedy sequence through ``rounds`` rounds against the scripted scorer."""
    async def run():
        loop = _loop_with(scorer, max_stalled_rounds)
        seq = Sequence("r", _params(), _Tokenizer(), (2,), 512)
        loop.submit(seq)
        for _ in range(rounds):
            await loop._round()
        return seq

    return asyncio.run(run())


def _moves() -> float:
    return metrics.MOVES.labels("scorer")._value.get()


def test_busy_is_a_retry_of_the_round_not_a_lost_sequence():
    """SEQUENCE_STATUS_BUSY (a Verify for this sequence is still in flight):
    the round is retried on the same replica, the KV cache is not re-sent and
    no token changes."""
    scorer = _ScriptedScorer([(pb.SEQUENCE_STATUS_OK, [7]), (pb.SEQUENCE_STATUS_BUSY, []),
                              (pb.SEQUENCE_STATUS_BUSY, []), (pb.SEQUENCE_STATUS_OK, [8])])

    async def run():
        loop = _loop_with(scorer)
        seq = Sequence("r", _params(), _Tokenizer(), (2,), 512)
        loop.submit(seq)
        await loop._round()
        assert seq.tokens == PROMPT + [7] and seq.scorer_primed
        moves = _moves()
        for busy_rounds in (1, 2):
            await loop._round()
            assert seq.tokens == PROMPT + [7]
            assert seq.retries == busy_rounds and not seq.done
            assert seq.scorer_primed and seq.scorer_addr == SCORER
        await loop._round()
        assert seq.tokens == PROMPT + [7, 8] and seq.retries == 0
        assert _moves() == moves
        return seq

    seq = asyncio.run(run())
    first, *later = scorer.requests
    assert list(first.sequences[0].context_token_ids) == PROMPT
    assert all(not r.sequences[0].context_token_ids for r in later), "BUSY must not cause a re-prefill"
    deltas = []
    while not seq.out.empty():
        deltas.append(seq.out.get_nowait())
    assert all(isinstance(d, Delta) for d in deltas)
    assert [t for d in deltas for t in d.token_ids] == [7, 8]


def test_a_sequence_busy_for_too_long_fails_as_unavailable():
    scorer = _ScriptedScorer([(pb.SEQUENCE_STATUS_OK, [7])] + [(pb.SEQUENCE_STATUS_BUSY, [])] * 3)
    seq = _run_rounds(scorer, 4, max_stalled_rounds=2)
    assert seq.failed and seq.failure_code == "UNAVAILABLE"
    assert seq.tokens == PROMPT + [7]


def test_unknown_sequence_re_prefills_from_the_gateway_history():
    """The contrast to BUSY: a scorer that lost the sequence gets its whole
    context again next round."""
    scorer = _ScriptedScorer([(pb.SEQUENCE_STATUS_OK, [7]), (pb.SEQUENCE_STATUS_UNKNOWN_SEQUENCE, []),
                              (pb.SEQUENCE_STATUS_OK, [8])])
    seq = _run_rounds(scorer, 3)
    assert seq.tokens == PROMPT + [7, 8]
    assert list(scorer.requests[2].sequences[0].context_token_ids) == PROMPT + [7]


def test_draft_plan_is_pure_and_trims_only_adaptive_sequences():
    seqs = [Sequence("a", _params("ngram", 8, adaptive=True), _Tokenizer(), (2,), 512),
            Sequence("f", _params("ngram", 8, adaptive=False), _Tokenizer(), (2,), 512)]
    for seq in seqs:
        seq.scorer_primed = True
    ids = np.arange(10, 18, dtype=np.int32)
    drafts = {s.seq_id: Draft(ids.copy()) for s in seqs}
    # a pass that is cheap, draft tokens that are dear: adaptive drafts get cut
    plan = plan_drafts(seqs, drafts, (0.001, 1.0))
    assert all(np.array_equal(drafts[s.seq_id].token_ids, ids) for s in seqs), "planning mutated the drafts"
    assert plan.keep[seqs[0].seq_id] < 8 and plan.keep[seqs[1].seq_id] == 8
    assert plan.tokens_fed == 2 + plan.keep[seqs[0].seq_id] + 8 and plan.decode_only


def _model_draft(ids: np.ndarray, confidence: float) -> Draft:
    """A model draft whose q gives each of its tokens ``confidence``."""
    return Draft(ids, tuple(np.array([t, 99], dtype=np.int32) for t in ids),
                 tuple(np.array([confidence, 1 - confidence], dtype=np.float32) for _ in ids))


def test_model_drafts_are_trimmed_by_their_own_confidence_not_by_history():
    ids = np.arange(10, 18, dtype=np.int32)
    drafts = {"sure": _model_draft(ids, 0.97), "unsure": _model_draft(ids, 0.3), "onehot": Draft(ids)}
    assert drafts["unsure"].confidence() == pytest.approx([0.3] * 8) and drafts["onehot"].confidence() is None
    keep = {}
    for name, draft in drafts.items():
        seq = Sequence(name, _params("draft", 8), _Tokenizer(), (2,), 512)
        seq.scorer_primed = True  # the same (young) history of acceptance for all three
        keep[name] = plan_drafts([seq], {seq.seq_id: draft}, (0.01, 0.002)).keep[seq.seq_id]
    # history alone (first = cont = 0.6) keeps some of the one-hot draft; the
    # draft's own confidence keeps all of the sure draft and less of the unsure one
    assert keep["sure"] == 8 > keep["onehot"] > keep["unsure"]


def test_draft_truncation_keeps_probabilities_aligned():
    draft = Draft(np.array([4, 5, 6], dtype=np.int32),
                  tuple(np.array([t, 9], dtype=np.int32) for t in (4, 5, 6)),
                  tuple(np.array([0.75, 0.25], dtype=np.float32) for _ in range(3)))
    assert draft.is_well_formed(3, 10) and not draft.is_well_formed(2, 10) and not draft.is_well_formed(3, 6)
    cut = draft.truncated(2)
    assert cut.token_ids.tolist() == [4, 5] and len(cut.probs) == len(cut.prob_token_ids) == 2
    assert not Draft(draft.token_ids, draft.prob_token_ids[:1], draft.probs[:1]).is_well_formed(3, 10)


def test_a_proposer_stream_reset_mid_exchange_costs_drafts_not_the_loop():
    """Discovery dropping a proposer replica resets its stream while the loop
    awaits an answer: the exchange fails with ConnectionError (the round goes
    on without those drafts) instead of cancelling the gateway's loop task."""
    import grpc
    import pytest

    from specdec.gateway.clients import ProposerStream
    from specdec.protos.v1 import specdec_pb2_grpc as pb_grpc

    class _Silent(pb_grpc.ProposerServicer):
        async def Propose(self, request_iterator, context):
            async for _ in request_iterator:
                await asyncio.sleep(30)  # never answers in time
            yield pb.ProposeResponse()

    async def run():
        server = grpc.aio.server()
        pb_grpc.add_ProposerServicer_to_server(_Silent(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stream = ProposerStream(channel)
        try:
            asyncio.get_running_loop().call_later(0.2, stream.reset)
            with pytest.raises(ConnectionError):
                await stream.exchange(pb.ProposeRequest(), timeout_s=10)
        finally:
            await channel.close()
            await server.stop(0)

    asyncio.run(run())


def test_releases_cut_off_by_a_drain_are_sent_by_the_last_flush():
    """stop() cancels the loop while it may be inside a Release call (the
    idle flush): those sequence ids must reach the scorer in stop()'s last
    flush, or their KV caches stay until the scorer's idle expiry."""
    from specdec.gateway.releases import Releases

    class _SlowThenOk:
        def __init__(self) -> None:
            self.calls: list[list[str]] = []
            self.first = True

        async def Release(self, request, timeout=None):
            self.calls.append(list(request.seq_ids))
            if self.first:
                self.first = False
                await asyncio.sleep(3600)  # cancelled mid-call
            return pb.ReleaseResponse()

    scorer = _SlowThenOk()

    class _Conns:
        def scorer(self, addr):
            return scorer

    seq = Sequence("r", _params(), _Tokenizer(), (2,), 512)
    seq.scorer_addr = SCORER

    async def run() -> None:
        releases = Releases(_Conns())  # type: ignore[arg-type]
        releases.add(seq)
        task = asyncio.create_task(releases.flush_scorer(SCORER))
        while not scorer.calls:
            await asyncio.sleep(0)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        await releases.flush_all(1.0)

    asyncio.run(run())
    assert scorer.calls == [[seq.seq_id], [seq.seq_id]]


def test_a_verify_aborted_by_a_dropped_channel_is_a_scorer_failure_not_the_loops_end():
    """Discovery dropping a scorer closes its channel; gRPC then aborts the
    in-flight Verify with CancelledError inside the loop's task. That is one
    failed call (the sequence re-prefills), not a cancellation of the loop,
    which would leave every request hanging."""

    class _ChannelClosedOnce(_ScriptedScorer):
        async def Verify(self, request, timeout=None):
            if not self.requests:
                self.requests.append(request)
                raise asyncio.CancelledError()  # what grpc.aio raises when the channel closes mid-call
            return await super().Verify(request, timeout)

    scorer = _ChannelClosedOnce([(pb.SEQUENCE_STATUS_OK, [7])] * 10)

    async def run() -> Sequence:
        loop = _loop_with(scorer)
        loop.failures.replica_down_s = 0.0  # the only replica: back at once
        seq = Sequence("r", _params(), _Tokenizer(), (2,), 512)
        loop.submit(seq)
        for _ in range(4):
            await loop._round()
        return seq

    seq = asyncio.run(run())
    assert seq.tokens[len(PROMPT):] == [7, 7, 7] and not seq.done
    assert list(scorer.requests[1].sequences[0].context_token_ids) == PROMPT  # re-prefilled after the failure


def test_stop_ends_the_loop_when_a_call_swallows_the_cancellation():
    """Python 3.11's asyncio.wait_for returns the result of a call that
    completed in the same step as its cancellation, swallowing it. stop()
    arriving just as the idle flush's Release returned left the rounds
    waiting for work forever: a drained gateway that never exited (seen in
    CI). stop() must end the loop anyway."""

    class _ReleaseAnsweredAsStopped:
        def __init__(self) -> None:
            self.started = asyncio.Event()
            self.reply: asyncio.Future | None = None
            self.calls = 0

        async def Release(self, request, timeout=None):
            self.calls += 1
            if self.calls > 1:  # stop()'s own last flush
                return pb.ReleaseResponse()
            self.reply = asyncio.get_running_loop().create_future()
            self.started.set()
            return await asyncio.wait_for(self.reply, timeout)

    scorer = _ReleaseAnsweredAsStopped()

    async def run() -> bool:
        loop = _loop_with(scorer)  # type: ignore[arg-type]
        seq = Sequence("r", _params(), _Tokenizer(), (2,), 512)
        seq.scorer_addr = SCORER
        loop.releases.add(seq)
        loop.start()  # no live sequence: the loop flushes the release, then idles
        await asyncio.wait_for(scorer.started.wait(), 10)
        scorer.reply.set_result(pb.ReleaseResponse())  # the answer and the cancellation in one step
        stopping = asyncio.create_task(loop.stop())
        done, _ = await asyncio.wait({stopping}, timeout=10)
        if not done:  # the bug: the rounds go on waiting for work; end them to report it
            loop._task.cancel()
            await asyncio.wait({stopping}, timeout=10)
        return bool(done) and loop._task.done()

    assert asyncio.run(run())
    assert scorer.calls == 1  # the release was answered: nothing left for the last flush


def test_plain_updates_of_one_hot_methods_travel_as_columns():
    """propose_request: held sequences of one-hot methods go in request.round
    (their new tokens, lengths and budgets as columns), opens and the other
    methods in request.sequences; proposer_answers gives each sequence its
    draft or None (re-open), and refuses an answer that does not fit."""
    from specdec.gateway import wire

    seqs = [Sequence(name, _params(method, 3), _Tokenizer(), (), 100)
            for name, method in (("a", "ngram"), ("b", "draft"), ("c", "suffix"), ("d", "ngram"))]
    for seq in seqs[:3]:
        seq.proposer_len = 2  # held: the proposer has the first 2 of the 3 prompt tokens
    message = wire.propose_request(seqs, [("gone", True)])
    req = message.request
    name = {seq.seq_id: seq.request_id for seq in seqs}
    assert [s.request_id for s in message.in_round] == ["a", "c"]
    assert [s.request_id for s in message.in_sequences] == ["b", "d"] == [name[u.seq_id] for u in req.sequences]
    assert [name[s] for s in req.round.seq_ids] == ["a", "c"] and list(req.round.token_counts) == [1, 1]
    assert list(req.round.token_ids) == [PROMPT[2]] * 2 and list(req.round.context_lens) == [3, 3]
    assert list(req.round.num_speculative_tokens) == [3, 3]
    assert req.sequences[1].open and not req.sequences[0].open and req.releases[0].seq_id == "gone"

    response = pb.ProposeResponse(
        drafts=[pb.Draft(token_ids=[7]), pb.Draft(token_ids=[8, 9], feature_layers=[2])],
        round=pb.RoundDrafts(draft_counts=[2, 0], token_ids=[5, 6],
                             statuses=[pb.SEQUENCE_STATUS_OK, pb.SEQUENCE_STATUS_UNKNOWN_SEQUENCE],
                             messages=["", "re-open"]))
    answers = {seq.request_id: answer for seq, answer in wire.proposer_answers(message, response)}
    assert answers["a"].draft.token_ids.tolist() == [5, 6] and answers["c"] is None
    assert answers["b"].draft.token_ids.tolist() == [7]
    assert answers["d"].draft.token_ids.tolist() == [8, 9] and answers["d"].features == ((2,), 0)
    for misfit in (pb.RoundDrafts(draft_counts=[2], token_ids=[5, 6]),
                   pb.RoundDrafts(draft_counts=[2, 1], token_ids=[5, 6]),
                   pb.RoundDrafts(draft_counts=[1, 1], token_ids=[5, 6], statuses=[pb.SEQUENCE_STATUS_OK])):
        response.round.CopyFrom(misfit)
        with pytest.raises(ValueError):
            wire.proposer_answers(message, response)
    del response.drafts[1]
    response.round.CopyFrom(pb.RoundDrafts(draft_counts=[0, 0]))
    with pytest.raises(ValueError):
        wire.proposer_answers(message, response)


def test_a_scorer_stub_is_built_once_per_channel_and_dropped_with_it():
    """Building a stub costs a callable per rpc (about 10% of the gateway's CPU
    a plain decoding round); a replica that discovery dropped gets a new one."""
    from specdec.gateway.clients import Connections

    async def run():
        conns = Connections()
        first = conns.scorer(SCORER)
        assert conns.scorer(SCORER) is first
        assert conns.scorer("scorer-b:1") is not first
        await conns.drop(SCORER)
        again = conns.scorer(SCORER)
        assert again is not first and conns.scorer(SCORER) is again
        await conns.close()

    asyncio.run(run())


def test_model_proposers_are_asked_for_the_draft_tokens_that_pay():
    """DraftBudgets: only adaptive sequences whose drafts come from a model
    (a draft model or a feature head) are planned; nothing is planned until the proposer's and the scorer's
    times are fitted; a plan of zero asks for one token after EXPLORE_EVERY
    idle rounds, then after twice as many each time the plan goes on asking
    for nothing (up to EXPLORE_MAX_EVERY), and after EXPLORE_EVERY again
    once the plan has asked for drafts by itself; the plan reaches the
    proposer's message."""
    from specdec.gateway.costs import DraftBudgets
    from specdec.gateway.wire import sequence_update

    model = Sequence("model", _params("draft", 5), _Tokenizer(), (2,), 512)
    copying = Sequence("copy", _params("ngram", 5), _Tokenizer(), (2,), 512)
    fixed = Sequence("fixed", _params("draft", 5, adaptive=False), _Tokenizer(), (2,), 512)
    seqs = [model, copying, fixed]
    for seq in seqs:
        seq.scorer_primed, seq.proposer_len = True, len(seq.tokens)
    model.model_drafted = fixed.model_drafted = 1.0
    for _ in range(30):  # the model's history: its drafts' first tokens are rarely right
        model.acceptance.record(0, 5)
    budgets = DraftBudgets()
    verify = (0.020, 0.0004)
    budgets.plan("p:1", seqs, verify)
    assert [s.planned_budget for s in seqs] == [None] * 3  # the proposer's time is not fitted yet
    for steps in [1, 2, 3, 4, 5] * 4:  # 1 ms a call + 6.6 ms a draft step
        budgets.observe("p:1", steps, 0.001 + 0.0066 * steps)
    budgets.plan("p:1", seqs, None)
    assert model.planned_budget is None  # nor the scorer's
    every, most = DraftBudgets.EXPLORE_EVERY, DraftBudgets.EXPLORE_MAX_EVERY
    waits = [every, 2 * every, 4 * every, 8 * every, most, most]  # idle rounds before each exploration
    assert waits[3] == most  # (the constants as this test reads them)

    def ask(rounds: int, scorer: tuple[float, float] = verify) -> list[int]:
        asked = []
        for _ in range(rounds):
            budgets.plan("p:1", seqs, scorer)
            assert copying.planned_budget is None and fixed.planned_budget is None
            asked.append(sequence_update(model, ahead=False).num_speculative_tokens)
        return asked

    assert ask(sum(waits)) == [k for wait in waits for k in [0] * (wait - 1) + [1]]
    assert ask(3) == [0] * 3
    assert min(ask(2, scorer=(2.0, 0.0004))) > 0  # a dear Verify: the plan asks for drafts by itself
    assert ask(2 * every) == ([0] * (every - 1) + [1]) + [0] * every  # explored after EXPLORE_EVERY again
    budgets.plan("p:1", seqs, verify)
    # asked for nothing, it decodes like method none: several tokens per Verify call
    assert model.planned_budget == 0 and model.decode_steps(4) == 4 and fixed.decode_steps(4) == 1
    assert sequence_update(copying, ahead=False).num_speculative_tokens == 5
    assert sequence_update(fixed, ahead=False).num_speculative_tokens == 5
    for _ in range(30):  # the model now follows the context
        model.acceptance.record(5, 5)
    budgets.plan("p:1", seqs, verify)
    assert model.planned_budget == 5 and sequence_update(model, ahead=False).num_speculative_tokens == 5
    assert model.decode_steps(4) == 1
    assert model.propose_budget(ahead=True) == 11  # drafting ahead asks for 2k + 1 whatever the plan
    # calls that drafted nothing leave the fit alone; the fit survives rounds of one length
    for _ in range(100):
        budgets.observe("p:1", 1, 0.0076)
        budgets.observe("p:1", 0, 0.001)
    budgets.plan("p:1", seqs, verify)
    assert model.planned_budget == 5
    model.features.opened((1, 2), 0)  # a feature head is planned as well
    budgets.plan("p:1", seqs, verify)
    assert model.planned_budget == 5
    for _ in range(30):  # the head stops following the context: asked for nothing, it decodes several
        model.acceptance.record(0, 5)  # tokens per Verify (the scorer answers the features of each)
    budgets.plan("p:1", seqs, verify)
    assert model.planned_budget == 0 and model.decode_steps(4) == 4
    model.features.opened((), 0)
    model.model_drafted = 0.8  # a hybrid that just copied: it may copy far, the plan would cut it
    budgets.plan("p:1", seqs, verify)
    assert model.planned_budget is None

    model.model_drafted = 1.0
    budgets.forget("p:1")
    budgets.plan("p:1", seqs, verify)
    assert model.planned_budget is None


def test_sequences_without_drafts_yet_get_the_replicas_plan_where_their_method_drafts_with_a_model():
    """DraftBudgets: a sequence with no draft of its own yet (an open) gets
    the replica's K (this round's, else the last one planned there) once
    its method's sequences have drafted with a model on that replica, so it
    does not run the model over its prompt and its whole budget where the
    model does not pay; nothing is planned for it on another replica, for
    a copy method, or once its own drafts turn out not to be a model's."""
    from specdec.gateway.costs import DraftBudgets
    from specdec.gateway.wire import sequence_update

    model = Sequence("model", _params("draft", 5), _Tokenizer(), (2,), 512)
    model.scorer_primed, model.proposer_len, model.model_drafted = True, 2, 1.0
    for _ in range(30):  # the model's first tokens are rarely right
        model.acceptance.record(0, 5)
    new = Sequence("new", _params("draft", 5), _Tokenizer(), (2,), 512)
    copying = Sequence("copying", _params("ngram", 5), _Tokenizer(), (2,), 512)
    budgets = DraftBudgets()
    verify = (0.020, 0.0004)
    for steps in [1, 2, 3, 4, 5] * 4:  # 1 ms a call + 6.6 ms a draft step
        budgets.observe("p:1", steps, 0.001 + 0.0066 * steps)
    budgets.plan("p:1", [new, copying], verify)
    assert new.planned_budget is None  # nothing drafted with a model on the replica yet: the whole budget
    budgets.plan("p:1", [model, new, copying], verify)
    assert model.planned_budget == 0 and new.planned_budget == 0 and copying.planned_budget is None
    update = sequence_update(new, ahead=False)
    assert update.open and update.num_speculative_tokens == 0  # opened, asked for nothing
    budgets.plan("p:1", [new, copying], verify)  # alone: the last K planned on the replica
    assert new.planned_budget == 0 and copying.planned_budget is None
    budgets.plan("p:2", [new], verify)
    assert new.planned_budget is None  # another replica knows nothing of the method
    new.model_drafted = 0.0  # its drafts came from a copy after all
    budgets.plan("p:1", [model, new], verify)
    assert new.planned_budget is None


class _ModelDraftsProposer:
    """A proposer stream answering every sequence with a 2-token draft that
    carries its sparse q (a model's), every round column with a 2-token copy."""

    async def exchange(self, request, timeout=None):
        q = pb.SparseProbs(token_ids=[9], probs=[1.0])
        n = len(request.round.seq_ids)
        return pb.ProposeResponse(
            drafts=[pb.Draft(seq_id=u.seq_id, token_ids=[9, 9], probs=[q, q]) for u in request.sequences],
            round=pb.RoundDrafts(draft_counts=[2] * n, token_ids=[9] * (2 * n)))


def test_a_propose_call_that_opens_a_sequence_leaves_the_draft_fit_alone():
    """The loop gives DraftBudgets.observe no call that opened a sequence
    (the model ran over the whole prompt: a prefill, not draft steps); the
    calls of the rounds after it are observed with their longest model draft."""
    scorer = _ScriptedScorer([(pb.SEQUENCE_STATUS_OK, [9, 9, 7])] * 3)
    observed: list[int] = []

    async def run():
        loop = SpecLoop(ReplicaSet("scorer", [SCORER]), {"draft": ReplicaSet("proposer", ["p:1"])}, vocab_size=100,
                        config=LoopConfig(stall_sleep_s=0.0))
        loop.conns.scorer = lambda addr: scorer  # type: ignore[method-assign]
        loop.conns.proposer_stream = lambda addr: _ModelDraftsProposer()  # type: ignore[method-assign]
        loop.budgets.observe = lambda addr, steps, seconds: observed.append(steps)  # type: ignore[method-assign]
        seq = Sequence("r", _params("draft", 2, adaptive=False), _Tokenizer(), (2,), 512)
        loop.submit(seq)
        await loop._round()
        assert seq.proposer_len and observed == []  # opened: not observed
        for _ in range(2):
            await loop._round()
        return seq

    seq = asyncio.run(run())
    assert observed == [2, 2] and seq.tokens[len(PROMPT):] == [9, 9, 7] * 3


def test_a_hybrids_model_steps_are_planned_apart_from_its_copies():
    """DraftBudgets on a model-and-copy method (draft_hybrid): its whole
    budget stays for its copies (planned_budget None, num_speculative_tokens
    k) and its model's steps are planned from the acceptance of its
    model-made drafts alone (model_steps in the update): good copies do not
    buy model forwards, good model drafts do. An open gets the replica's K
    (this round's, else the last one planned there; none on a replica
    never planned). Not when drafting ahead, not at a fixed length."""
    from specdec.gateway.costs import DraftBudgets
    from specdec.gateway.wire import sequence_update

    hybrid = Sequence("hybrid", _params("draft_hybrid", 5), _Tokenizer(), (2,), 512)
    fixed = Sequence("fixed", _params("draft_hybrid", 5, adaptive=False), _Tokenizer(), (2,), 512)
    opening = Sequence("opening", _params("draft_hybrid", 5), _Tokenizer(), (2,), 512)
    seqs = [hybrid, fixed, opening]
    for seq in (hybrid, fixed):
        seq.scorer_primed, seq.proposer_len = True, len(seq.tokens)
        seq.model_drafted = 0.5  # half its drafts were copies
    for _ in range(30):
        hybrid.acceptance.record(5, 5)  # its drafts (copies, mostly) do well
        hybrid.model_acceptance.record(0, 5)  # its model's do not
    budgets = DraftBudgets()
    verify = (0.020, 0.0004)
    budgets.plan("p:1", [opening], verify)
    assert opening.planned_model_steps is None  # nothing planned on the replica yet: the whole budget
    assert not sequence_update(opening, ahead=False).HasField("model_steps")
    for steps in [1, 2, 3, 4, 5] * 4:  # 1 ms a call + 6.6 ms a model step
        budgets.observe("p:1", steps, 0.001 + 0.0066 * steps)
    budgets.plan("p:1", seqs, verify)
    assert hybrid.planned_model_steps == 0 and hybrid.planned_budget is None
    update = sequence_update(hybrid, ahead=False)
    assert update.num_speculative_tokens == 5 and update.HasField("model_steps") and update.model_steps == 0
    assert hybrid.decode_steps(4) == 1  # it still drafts (copies): one token per Verify call
    assert fixed.planned_model_steps is None and not sequence_update(fixed, ahead=False).HasField("model_steps")
    update = sequence_update(opening, ahead=False)  # an open: the replica's K, its copies the whole budget
    assert update.open and update.num_speculative_tokens == 5 and update.model_steps == 0
    budgets.plan("p:1", [opening], verify)  # an open alone: the last K planned on the replica
    assert opening.planned_model_steps == 0 and sequence_update(opening, ahead=False).model_steps == 0
    assert not sequence_update(hybrid, ahead=True).HasField("model_steps")  # drafting ahead hides its time
    for _ in range(30):  # its model now follows the context
        hybrid.model_acceptance.record(5, 5)
    budgets.plan("p:1", seqs, verify)
    assert hybrid.planned_model_steps == 5 and sequence_update(hybrid, ahead=False).model_steps == 5
    assert opening.planned_model_steps == 5
    budgets.plan("p:1", [opening], verify)
    assert opening.planned_model_steps == 5
    hybrid.params = dataclasses.replace(hybrid.params, num_speculative_tokens=3)  # the wire caps it at k
    update = sequence_update(hybrid, ahead=False)
    assert update.num_speculative_tokens == 3 and update.model_steps == 3


def test_propose_calls_right_after_rounds_that_asked_for_nothing_leave_the_fit_alone():
    """DraftBudgets.observe: a call planned right after a round that asked
    for nothing (the scorer may be decoding ahead on the same CPU) does not
    enter the proposer's cost fit; calls of rounds that follow drafting
    rounds do. Fails when every call is fitted."""
    from specdec.gateway.costs import DraftBudgets

    model = Sequence("model", _params("draft", 5), _Tokenizer(), (2,), 512)
    model.scorer_primed, model.proposer_len, model.model_drafted = True, len(model.tokens), 1.0
    for _ in range(30):
        model.acceptance.record(0, 5)
    budgets, verify = DraftBudgets(), (0.020, 0.0004)
    for steps in [1, 2, 3, 4, 5] * 4:
        budgets.observe("p:1", steps, 0.001 + 0.0066 * steps)
    fit = budgets._fits["p:1"]
    budgets.plan("p:1", [model], verify)
    assert model.planned_budget == 0
    for _ in range(DraftBudgets.EXPLORE_EVERY - 1):  # idle rounds, then an exploration round after them
        budgets.plan("p:1", [model], verify)
        for steps in (1, 3):
            budgets.observe("p:1", steps, 0.050)  # (slow: the CPU was shared)
    assert model.planned_budget == 1 and budgets._fits["p:1"] == fit
    for _ in range(30):
        model.acceptance.record(5, 5)
    for _ in range(10):  # rounds after drafting rounds (the exploration's too): their calls are fitted
        budgets.plan("p:1", [model], verify)
        for steps in (1, 5):
            budgets.observe("p:1", steps, 0.002 + 0.008 * steps)
    assert model.planned_budget == 5 and budgets._fits["p:1"][1] > fit[1]


def test_copy_drafts_pay_against_plain_decoding_by_the_scorers_speed():
    """costs.copy_drafts_pay: rarely offered, rarely right copies (chat) do
    not pay against a fast scorer decoding four tokens a call, but do against
    a slow one; long matches (copy work) pay against both; nothing offered
    never pays."""
    from specdec.gateway.costs import copy_drafts_pay

    chat = [0.2 * 0.5 ** j for j in range(5)]
    copy = [0.8 * 0.9 ** j for j in range(5)]
    fast, slow = (0.004, 0.001), (0.050, 0.001)  # (fixed, per token) of a pass
    exchange, overhead = 0.001, 0.0005
    assert not copy_drafts_pay(0.5, chat, exchange, fast, overhead, plain_steps=4)
    assert copy_drafts_pay(0.5, chat, exchange, slow, overhead, plain_steps=4)
    assert copy_drafts_pay(0.8, copy, exchange, fast, overhead, plain_steps=4)
    assert copy_drafts_pay(0.8, copy, exchange, slow, overhead, plain_steps=4)
    assert not copy_drafts_pay(0.0, copy, exchange, slow, overhead, plain_steps=4)
    # one plain token a call (max_tokens nearly reached) is what one draft-less round yields
    assert copy_drafts_pay(0.5, chat, exchange, fast, overhead, plain_steps=1) is False  # the exchange costs
    assert copy_drafts_pay(0.5, chat, 0.0, fast, overhead, plain_steps=1)  # a free exchange: any gain pays


def _fitted_costs(fixed: float, per_token: float):
    from specdec.gateway.costs import DraftPlan, VerifyCosts

    costs = VerifyCosts()
    for tokens in [1, 2, 3, 4, 5, 6] * 3:
        costs.observe(SCORER, DraftPlan({}, tokens, True), fixed + per_token * tokens, fixed + per_token * tokens)
    assert costs.estimate(SCORER) is not None
    return costs


def test_copy_methods_decode_plainly_while_their_drafts_do_not_pay_and_explore():
    """CopyGates: an adaptive copy-method sequence whose drafts do not pay
    asks its proposer for nothing (planned_budget 0: several tokens a Verify
    call, nothing asked in its update), asks once after EXPLORE_EVERY plain
    rounds, then after twice as many up to EXPLORE_MAX_EVERY, and asks every
    round once its drafts pay; fixed-length, feature and model sequences,
    sequences not yet held by both services, and rounds before the times are
    measured always ask."""
    from specdec.gateway.costs import CopyGates
    from specdec.gateway.wire import sequence_update

    costs = _fitted_costs(0.004, 0.001)
    chat = Sequence("chat", _params("ngram", 5), _Tokenizer(), (2,), 512)
    fixed = Sequence("fixed", _params("suffix", 5, adaptive=False), _Tokenizer(), (2,), 512)
    model = Sequence("model", _params("draft", 5), _Tokenizer(), (2,), 512)
    fresh = Sequence("fresh", _params("ngram", 5), _Tokenizer(), (2,), 512)
    seqs = [chat, fixed, model, fresh]
    for seq in seqs:
        seq.scorer_addr = SCORER
        seq.scorer_primed = True
        seq.proposer_len = len(seq.tokens) if seq is not fresh else 0
        seq.drafts_offered = 0.5
        for _ in range(30):
            seq.acceptance.record(0, 5)  # its drafts' first tokens are rarely right
    model.planned_budget = 3  # (DraftBudgets' plan: not the gates' to change)
    gates = CopyGates()
    gates.plan(seqs, costs, None, 4)
    assert [s.planned_budget for s in seqs] == [None, None, 3, None]  # no propose time measured yet
    every, most = CopyGates.EXPLORE_EVERY, CopyGates.EXPLORE_MAX_EVERY
    waits = [every, 2 * every, most, most]
    assert waits[1] == most  # (the constants as this test reads them)

    def asked(rounds: int) -> list[int]:
        out = []
        for _ in range(rounds):
            gates.plan(seqs, costs, 0.001, 4)
            assert fixed.planned_budget is None and fresh.planned_budget is None and model.planned_budget == 3
            out.append(sequence_update(chat).num_speculative_tokens)
            assert (chat.decode_steps(4), chat.copies_plainly) == ((4, True) if out[-1] == 0 else (1, False))
        return out

    assert asked(sum(waits)) == [k for wait in waits for k in [0] * (wait - 1) + [5]]
    for _ in range(30):  # the context starts to copy: its drafts now hold
        chat.acceptance.record(5, 5)
    chat.drafts_offered = 1.0
    assert asked(3) == [5] * 3
    for _ in range(30):
        chat.acceptance.record(0, 5)
    assert asked(every) == [0] * (every - 1) + [5]  # the wait started over
    chat.features.opened((1,), 0)  # (a feature method's sequence is never gated)
    assert asked(2) == [5, 5]
    chat.features.opened((), 0)
    gates.plan(seqs, _fitted_costs(0.050, 0.001), 0.001, 4)  # a slow scorer: even these drafts pay
    assert chat.planned_budget is None
    gates.forget(chat.seq_id)
    assert asked(every) == [0] * (every - 1) + [5]


def test_a_hybrid_whose_model_drafts_nothing_gates_its_copies_as_a_copy_method():
    """A draft_hybrid sequence whose model was planned to draft nothing
    (planned_model_steps 0, DraftBudgets) drafts by copies alone, and
    CopyGates gates those as the n-gram method's: where they do not pay
    either it asks for nothing (several tokens a Verify call, nothing asked
    in its update), but in the rounds either gate explores; once its model
    pays again (DraftBudgets plans K > 0) it asks whatever its copies' gate
    said. A hybrid not yet planned (planned_model_steps None) is never gated."""
    from specdec.gateway.costs import CopyGates, DraftBudgets
    from specdec.gateway.wire import sequence_update

    costs = _fitted_costs(0.004, 0.001)
    hybrid = Sequence("hybrid", _params("draft_hybrid", 5), _Tokenizer(), (2,), 512)
    hybrid.scorer_addr, hybrid.scorer_primed, hybrid.proposer_len = SCORER, True, len(hybrid.tokens)
    hybrid.drafts_offered, hybrid.model_drafted = 0.5, 0.5
    for _ in range(30):
        hybrid.acceptance.record(0, 5)  # its copies' first tokens are rarely right
        hybrid.model_acceptance.record(0, 5)  # and so are its model's
    gates, budgets, verify = CopyGates(), DraftBudgets(), (0.004, 0.001)
    for steps in [1, 2, 3, 4, 5] * 4:  # 1 ms a call + 0.5 ms a model step
        budgets.observe("p:1", steps, 0.001 + 0.0005 * steps)
    assert not hybrid.drafts_by_copying  # never planned: its model may draft
    gates.plan([hybrid], costs, 0.001, 4)
    assert hybrid.planned_budget is None

    def round_() -> tuple[int | None, int | None]:
        gates.plan([hybrid], costs, 0.001, 4)
        budgets.plan("p:1", [hybrid], verify)
        return hybrid.planned_model_steps, hybrid.planned_budget

    assert round_() == (0, None)  # the plan's first K: its model drafts nothing from now on
    assert hybrid.drafts_by_copying
    plans = []
    for _ in range(2 * DraftBudgets.EXPLORE_EVERY):
        plans.append(round_())
        if plans[-1][1] == 0:
            assert hybrid.copies_plainly and hybrid.decode_steps(4) == 4
            assert sequence_update(hybrid, ahead=False).num_speculative_tokens == 0
        else:  # an exploration: its copies' (model steps 0) or its model's (1)
            assert plans[-1] in ((0, None), (1, None)) and hybrid.decode_steps(4) == 1
    assert plans[0] == (0, 0) and plans.count((0, 0)) >= len(plans) // 2
    assert (1, None) in plans  # DraftBudgets' exploration of the model
    for _ in range(30):  # its model now follows the context: K > 0, it asks, its copies' gate aside
        hybrid.model_acceptance.record(5, 5)
    assert round_() == (5, None)
    assert not hybrid.drafts_by_copying and not hybrid.copies_plainly and hybrid.decode_steps(4) == 1
    for _ in range(30):  # its copies hold, its model's drafts do not: K 0, and the copies' gate opens
        hybrid.model_acceptance.record(0, 5)
        hybrid.acceptance.record(5, 5)
    hybrid.drafts_offered = 1.0
    assert [round_() for _ in range(3)] == [(0, None)] * 3


class _CopyProposer:
    """A copy proposer stream answering every sequence with a 3-token draft
    the scorer rejects, counting its exchanges."""

    def __init__(self) -> None:
        self.exchanges = 0

    async def exchange(self, request, timeout=None):
        self.exchanges += 1
        n = len(request.round.seq_ids)
        return pb.ProposeResponse(drafts=[pb.Draft(seq_id=u.seq_id, token_ids=[9, 9, 9]) for u in request.sequences],
                                  round=pb.RoundDrafts(draft_counts=[3] * n, token_ids=[9] * (3 * n)))


def _decoded(request) -> list:
    """A Verify's results: every sequence OK with as many tokens (7s) as it asked to decode, no draft accepted."""
    return [pb.VerifyResult(seq_id=s.seq_id, status=pb.SEQUENCE_STATUS_OK,
                            output_token_ids=[7] * max(1, s.decode_steps), num_accepted=0) for s in request.sequences]


@pytest.mark.parametrize("overlap", ["off", "ahead"])
def test_a_copy_method_whose_drafts_do_not_pay_stops_asking_and_decodes_several_tokens_a_call(overlap):
    """Through the loop's rounds: once the times are measured and its drafts
    keep failing, an ngram sequence's Verify calls decode several tokens
    and carry no draft. Lock-step rounds leave the proposer out and explore
    after CopyGates.EXPLORE_EVERY such rounds; rounds drafting ahead ask it
    beside every plain Verify (hidden) and verify none of what it brings."""
    from specdec.gateway.costs import CopyGates
    from specdec.gateway.loop import Overlap

    class Scorer(_ScriptedScorer):
        async def Verify(self, request, timeout=None):
            self.requests.append(request)
            results = _decoded(request)
            return pb.VerifyResponse(results=results, compute_s=0.004)

    scorer, proposer = Scorer([]), _CopyProposer()

    async def run():
        loop = SpecLoop(ReplicaSet("scorer", [SCORER]), {"ngram": ReplicaSet("proposer", ["p:1"])}, vocab_size=100,
                        config=LoopConfig(stall_sleep_s=0.0, overlap=Overlap(overlap), decode_steps=4))
        loop.conns.scorer = lambda addr: scorer  # type: ignore[method-assign]
        loop.conns.proposer_stream = lambda addr: proposer  # type: ignore[method-assign]
        seq = Sequence("r", _params("ngram", 3), _Tokenizer(), (2,), 512)
        seq.params = dataclasses.replace(seq.params, max_tokens=400)
        loop.submit(seq)
        for _ in range(3):
            await loop._round()
        assert proposer.exchanges >= 2 and not any(s.decode_steps > 1 for r in scorer.requests for s in r.sequences)
        loop.costs = _fitted_costs(0.004, 0.001)  # a fast scorer
        loop._propose_s, loop._propose_measured = 0.001, True
        loop._verify_s, loop._verify_measured = 0.005, True
        for _ in range(20):
            seq.acceptance.record(0, 3)
        before, calls = proposer.exchanges, len(scorer.requests)
        for _ in range(CopyGates.EXPLORE_EVERY - 1):
            await loop._round()
        plain = [r.sequences[0] for r in scorer.requests[calls:]]
        assert len(plain) == CopyGates.EXPLORE_EVERY - 1
        assert all(s.decode_steps == 4 and not len(s.draft_token_ids) for s in plain)
        await loop._round()  # explores
        return seq, proposer.exchanges - before

    seq, exchanges = asyncio.run(run())
    assert exchanges == 1 if overlap == "off" else exchanges >= CopyGates.EXPLORE_EVERY - 1
    assert metrics.PLAIN_ROUNDS.labels("ngram")._value.get() >= CopyGates.EXPLORE_EVERY - 1


def test_a_held_draft_that_continues_a_copy_is_verified_where_a_fresh_one_would_not_be():
    """CopyGates.held_draft_pays: a draft ahead still holding after the
    tokens committed since (a copy under way) is weighed by the continuation
    rate; the same draft fresh, by the sequence's first-token rate; a
    verified draft reopens the sequence's round (planned_budget None)."""
    from specdec.gateway.costs import CopyGates

    costs = _fitted_costs(0.004, 0.001)
    seq = Sequence("s", _params("ngram", 5), _Tokenizer(), (2,), 512)
    seq.scorer_addr, seq.scorer_primed, seq.proposer_len = SCORER, True, 3
    for _ in range(30):  # drafts rarely start right, but once right they go on
        seq.acceptance.record(5, 5)
        for _ in range(6):
            seq.acceptance.record(0, 5)
    assert seq.acceptance.first < 0.2 and seq.acceptance.cont > 0.9
    gates = CopyGates()
    seq.planned_budget = 0
    assert not gates.held_draft_pays(seq, 5, costs, 4)
    assert seq.planned_budget == 0
    assert not gates.held_draft_pays(seq, 0, costs, 4, continues=True)
    assert gates.held_draft_pays(seq, 5, costs, 4, continues=True)
    assert seq.planned_budget is None


def test_beside_a_sequence_that_verifies_drafts_plain_decoding_is_weighed_as_one_token_a_call():
    """CopyGates.plan: a Verify call decodes several tokens only where none
    of its sequences verifies drafts, so a copy sequence whose drafts lose
    to four plain tokens a call, but beat one, asks where a model method's
    sequence drafts on the same scorer replica (or another copy that asks),
    and decodes plainly where it is alone."""
    from specdec.gateway.costs import CopyGates

    costs = _fitted_costs(0.004, 0.001)
    costs.overhead_s[SCORER] = 0.002  # a call's RPC overhead: what several tokens a call save

    def copying(name: str) -> Sequence:
        seq = Sequence(name, _params("ngram", 5), _Tokenizer(), (2,), 512)
        seq.scorer_addr, seq.scorer_primed, seq.proposer_len, seq.drafts_offered = SCORER, True, 3, 0.5
        for _ in range(30):  # first token right about a third of the time, then mostly
            for matched in (0, 0, 0, 5):
                seq.acceptance.record(matched, 5)
        return seq

    seq = copying("alone")
    CopyGates().plan([seq], costs, 0.001, 4)
    assert seq.planned_budget == 0
    model = Sequence("model", _params("draft", 5), _Tokenizer(), (2,), 512)
    model.scorer_addr, model.scorer_primed = SCORER, True
    CopyGates().plan([seq, model], costs, 0.001, 4)
    assert seq.planned_budget is None
    model.scorer_addr = "scorer-b:1"  # on another replica it changes nothing
    CopyGates().plan([seq, model], costs, 0.001, 4)
    assert seq.planned_budget == 0
    sure = copying("sure")  # a copy that pays on the same replica
    for _ in range(30):
        sure.acceptance.record(5, 5)
    sure.drafts_offered = 1.0
    CopyGates().plan([seq, sure], costs, 0.001, 4)
    assert sure.planned_budget is None and seq.planned_budget is None


def test_a_draft_kept_from_an_earlier_step_is_never_sent_with_several_decode_steps():
    """A sequence planned to ask for nothing this round (CopyGates) may
    still hold a draft an overlapped step proposed for it before: its Verify
    verifies that draft, one pass, never asks the scorer to decode several
    tokens beside it (the scorer refuses that as INVALID_ARGUMENT, which
    would fail the request)."""
    class Scorer(_ScriptedScorer):
        async def Verify(self, request, timeout=None):
            self.requests.append(request)
            for s in request.sequences:
                if s.decode_steps > 1 and len(s.draft_token_ids):
                    raise AssertionError("decode_steps beside draft_token_ids")
            results = [pb.VerifyResult(seq_id=s.seq_id, status=pb.SEQUENCE_STATUS_OK,
                                       output_token_ids=[9, 7], num_accepted=1) for s in request.sequences]
            return pb.VerifyResponse(results=results, compute_s=0.004)

    scorer = Scorer([])

    async def run():
        loop = _loop_with(scorer)
        seq = Sequence("r", _params("ngram", 3), _Tokenizer(), (2,), 512)
        seq.scorer_addr, seq.scorer_primed, seq.proposer_len, seq.planned_budget = SCORER, True, 3, 0
        assert seq.copies_plainly and seq.decode_steps(4) == 4
        verdicts = await loop._verify_on(SCORER, [seq], {seq.seq_id: Draft(np.array([9, 9], np.int32))})
        return verdicts

    verdicts = asyncio.run(run())
    sent = scorer.requests[0].sequences[0]
    assert list(sent.draft_token_ids) == [9, 9] and sent.decode_steps <= 1
    assert verdicts[0].num_accepted == 1


@pytest.mark.parametrize("pass_ms,chunk_ms,most,want", [(5, 50, 16, (6, 10)), (40, 50, 16, (1, 1)),
                                                         (5, 50, 6, (6, 6)), (40, 0, 16, (16, 16))])
def test_plain_decoding_calls_take_as_many_tokens_as_fit_the_chunk_at_the_measured_pace(pass_ms, chunk_ms, most,
                                                                                      want):
    """Plain decoding (method none): the first calls after the first touch
    decode FIRST_DECODE_STEPS tokens; once a call is timed, as many as its
    passes take in --decode-chunk-ms (a 5 ms pass: ~10 in 50 ms; a 40 ms
    pass: one), never more than --decode-steps; a chunk of 0 keeps
    --decode-steps tokens a call."""
    from specdec.limits import FIRST_DECODE_STEPS

    class Scorer(_ScriptedScorer):  # every pass takes pass_ms
        async def Verify(self, request, timeout=None):
            self.requests.append(request)
            passes = max(max(1, s.decode_steps) for s in request.sequences)
            await asyncio.sleep(passes * pass_ms / 1000)
            results = _decoded(request)
            return pb.VerifyResponse(results=results, compute_s=passes * pass_ms / 1000)

    scorer = Scorer([])

    async def run():
        loop = SpecLoop(ReplicaSet("scorer", [SCORER]), {}, vocab_size=100,
                        config=LoopConfig(stall_sleep_s=0.0, decode_steps=most, decode_chunk_s=chunk_ms / 1000))
        loop.conns.scorer = lambda addr: scorer  # type: ignore[method-assign]
        seq = Sequence("r", _params("none", 0), _Tokenizer(), (2,), 512)
        seq.params = dataclasses.replace(seq.params, max_tokens=400)
        loop.submit(seq)
        for _ in range(5):
            await loop._round()
        return [max(1, r.sequences[0].decode_steps) for r in scorer.requests]

    steps = asyncio.run(run())
    assert metrics.PLAIN_DECODE_STEPS._value.get() == steps[-1]  # exported
    assert steps[0] == 1  # the first touch decodes one: the first token comes as early as without
    assert steps[1] == (most if chunk_ms == 0 else min(most, FIRST_DECODE_STEPS))
    assert all(want[0] <= n <= want[1] for n in steps[2:]), steps
