"""The scorer's continuous-batching scheduler and servicer over a real engine
(stories260K): merged concurrent calls, chunked prefill, rollback, pool
exhaustion, hidden states, field-naming errors over real gRPC."""
from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from conftest import ENGINE, hf_greedy, hf_model
from specdec.kernels import GREEDY, POLICY_NORMAL
from specdec.protos.v1 import specdec_pb2 as pb
from specdec.protos.v1 import specdec_pb2_grpc as pb_grpc
from specdec.scorer_svc.scheduler import OK, RESOURCE_EXHAUSTED, UNKNOWN_SEQUENCE, JobSpec, Scheduler
from specdec.scorer_svc.server import ScorerServicer, build_engine

PROMPT = "Once upon a time"


class CountingEngine:
    """The real engine, with its forward passes counted (not replaced)."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.forwards: list[list[int]] = []  # tokens per item, per forward

    def forward(self, items, return_hidden_states=False):
        self.forwards.append([len(i.token_ids) for i in items])
        return self._engine.forward(items, return_hidden_states)

    def __getattr__(self, name):
        return getattr(self._engine, name)


@pytest.fixture(scope="module")
def engine(stories_path):
    return build_engine(stories_path, "float32", 4096, "cpu", ENGINE)


@pytest.fixture
def counting(engine):
    return CountingEngine(engine)


def spec(seq_id, context=None, context_len=0, drafts=(), hidden=False) -> JobSpec:
    ctx = None if context is None else np.asarray(context, np.int32)
    return JobSpec(seq_id=seq_id, context=ctx, context_len=len(ctx) if ctx is not None else context_len,
                   draft_token_ids=np.asarray(drafts, np.int32), draft_probs=None, temperature=0.0,
                   top_k=0, top_p=1.0, seed=0, strategy=GREEDY, accept_policy=POLICY_NORMAL,
                   return_hidden_states=hidden)


def prompt_ids(path):
    return list(hf_model(path)[1](PROMPT)["input_ids"])


async def greedy_with_drafts(sched, seq_id, prompt, n, drafts_fn):
    """Decodes n tokens through the scheduler, drafting with drafts_fn(tokens)."""
    tokens = list(prompt)
    results, _, _ = await sched.verify([spec(seq_id, context=tokens, drafts=drafts_fn(tokens))])
    while True:
        (r,) = results
        assert r.status == OK, r.message
        tokens += r.output_token_ids
        if len(tokens) - len(prompt) >= n:
            return tokens[len(prompt):len(prompt) + n]
        results, _, _ = await sched.verify([spec(seq_id, context_len=len(tokens), drafts=drafts_fn(tokens))])


def test_drafts_right_and_wrong_give_plain_greedy(stories_path, counting):
    prompt = prompt_ids(stories_path)
    expected = hf_greedy(stories_path, tuple(prompt), 24)
    oracle = lambda tokens: expected[len(tokens) - len(prompt):][:5]  # always right
    wrong = lambda tokens: [(t + 1) % 512 for t in oracle(tokens)]  # always wrong

    async def run():
        sched = Scheduler(counting, max_batch_size=8, max_tokens_per_forward=64)
        try:
            right = await greedy_with_drafts(sched, "r", prompt, 24, oracle)
            bad = await greedy_with_drafts(sched, "w", prompt, 24, wrong)
            return right, bad
        finally:
            sched.stop()

    right, bad = asyncio.run(run())
    assert right == expected and bad == expected


def test_concurrent_calls_merge_into_shared_forwards(stories_path, counting):
    prompt = prompt_ids(stories_path)

    async def run():
        sched = Scheduler(counting, max_batch_size=16, max_tokens_per_forward=512)
        try:
            # 8 callers, 8 sequences each with a different number of drafts (0..7)
            calls = [sched.verify([spec(f"s{i}", context=prompt, drafts=[5] * i)]) for i in range(8)]
            return await asyncio.gather(*calls)
        finally:
            sched.stop()

    results = asyncio.run(run())
    expected = hf_greedy(stories_path, tuple(prompt), 8)
    for (r,), _, _ in results:
        assert r.status == OK and r.output_token_ids == expected[:len(r.output_token_ids)]
    assert len(counting.forwards) < 8  # merged: fewer forwards than callers
    assert max(len(f) for f in counting.forwards) > 1  # some forward held several sequences
    # a ragged forward: items of different lengths side by side
    assert any(len(set(f)) > 1 for f in counting.forwards)


def test_chunked_prefill_equals_single_prefill(stories_path, engine):
    prompt = prompt_ids(stories_path) * 12  # ~60 tokens

    async def run(budget):
        counting = CountingEngine(engine)
        sched = Scheduler(counting, max_batch_size=4, max_tokens_per_forward=budget)
        try:
            out = await greedy_with_drafts(sched, f"chunk{budget}", prompt, 8, lambda t: [])
            return out, counting.forwards
        finally:
            sched.stop()

    whole, f_whole = asyncio.run(run(512))
    chunked, f_chunked = asyncio.run(run(17))
    assert whole == chunked == hf_greedy(stories_path, tuple(prompt), 8)
    assert max(sum(f) for f in f_chunked) <= 17 and len(f_chunked) > len(f_whole)


def test_pool_exhaustion_is_reported_and_never_evicts(stories_path):
    small = build_engine(stories_path, "float32", 64, "cpu", ENGINE)
    prompt = prompt_ids(stories_path)

    async def run():
        sched = Scheduler(small, max_batch_size=8, max_tokens_per_forward=64)
        try:
            (a,), _, _ = await sched.verify([spec("a", context=prompt * 8)])
            (b,), _, _ = await sched.verify([spec("b", context=prompt * 8)])
            # a keeps working after b was refused
            (a2,), _, _ = await sched.verify([spec("a", context_len=len(prompt) * 8 + 1)])
            released = await sched.release(["a"])
            (b2,), _, _ = await sched.verify([spec("b", context=prompt * 8)])
            (u,), _, _ = await sched.verify([spec("nobody", context_len=5)])
            return a, b, a2, released, b2, u
        finally:
            sched.stop()

    a, b, a2, released, b2, unknown = asyncio.run(run())
    assert a.status == OK and a2.status == OK
    assert b.status == RESOURCE_EXHAUSTED and "KV" in b.message
    assert released == 1 and b2.status == OK
    assert unknown.status == UNKNOWN_SEQUENCE


def test_idle_sequences_expire_and_free_their_kv_cache(stories_path, engine):
    """A sequence that nobody verifies for idle_timeout_s (its gateway died)
    gives its KV cache back; one that keeps being verified stays; the expired
    one asking again is told to re-prefill, and re-prefill gives the same
    tokens as a sequence that never expired."""
    prompt = prompt_ids(stories_path)
    free_at_start = engine.free_tokens()

    async def run():
        sched = Scheduler(engine, max_batch_size=8, max_tokens_per_forward=64, idle_timeout_s=0.6)
        try:
            (a,), _, _ = await sched.verify([spec("a", context=prompt)])
            (b,), _, _ = await sched.verify([spec("b", context=prompt)])
            held = engine.free_tokens()
            for i in range(8):  # b is touched every 0.15 s, a is not
                await asyncio.sleep(0.15)
                (b,), _, _ = await sched.verify([spec("b", context_len=len(prompt) + 1 + i)])
                assert b.status == OK
            (late,), _, _ = await sched.verify([spec("a", context_len=len(prompt) + 1)])
            again, _, _ = await sched.verify([spec("a", context=prompt + a.output_token_ids)])
            live = sched.live_sequences
            await sched.release(["a", "b"])
            return a, late, again[0], held, live
        finally:
            sched.stop()

    a, late, again, held, live = asyncio.run(run())
    assert held < free_at_start
    assert late.status == UNKNOWN_SEQUENCE and "resend" in late.message
    assert again.status == OK and live == 2
    expected = hf_greedy(stories_path, tuple(prompt), 2)
    assert a.output_token_ids + again.output_token_ids == expected
    assert engine.free_tokens() == free_at_start


def test_hidden_states_for_output_positions(stories_path, counting):
    prompt = prompt_ids(stories_path)
    expected = hf_greedy(stories_path, tuple(prompt), 3)

    async def run():
        sched = Scheduler(counting)
        try:
            return await sched.verify([spec("h", context=prompt, drafts=expected[:2], hidden=True)])
        finally:
            sched.stop()

    (r,), _, _ = asyncio.run(run())
    assert r.num_accepted == 2 and r.hidden_states.shape == (3, counting.facts.hidden_size)
    assert np.isfinite(r.hidden_states).all()


@pytest.fixture(scope="module")
def scorer_addr(engine):
    """A real Scorer gRPC server in this process (own event loop thread)."""
    import threading

    state = {}
    ready = threading.Event()

    async def serve():
        server = grpc.aio.server()
        sched = Scheduler(engine)
        pb_grpc.add_ScorerServicer_to_server(ScorerServicer(engine, sched), server)
        state["port"] = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        state["stop"] = asyncio.Event()
        state["loop"] = asyncio.get_running_loop()
        ready.set()
        await state["stop"].wait()
        await server.stop(0)
        sched.stop()

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    assert ready.wait(30)
    yield f"127.0.0.1:{state['port']}"
    state["loop"].call_soon_threadsafe(state["stop"].set)
    thread.join(10)


BAD_VERIFY = {
    "sequences[0].seq_id": pb.VerifySequence(context_token_ids=[1, 2]),
    "sequences[0].draft_token_ids": pb.VerifySequence(seq_id="x", context_token_ids=[1], draft_token_ids=[1] * 17),
    "sequences[0].context_token_ids[1]": pb.VerifySequence(seq_id="x", context_token_ids=[1, 999]),
    "sequences[0].context_len": pb.VerifySequence(seq_id="x"),
    "sequences[0].draft_probs": pb.VerifySequence(seq_id="x", context_token_ids=[1], draft_token_ids=[3],
                                                  draft_probs=[pb.SparseProbs(), pb.SparseProbs()]),
    "sequences[0].sampling.temperature": pb.VerifySequence(
        seq_id="x", context_token_ids=[1], sampling=pb.SamplingParams(temperature=-1)),
    "sequences[0]: context_len": pb.VerifySequence(seq_id="x", context_token_ids=[1] * 600),
}


@pytest.mark.parametrize("field", sorted(BAD_VERIFY))
def test_verify_rejects_bad_fields_by_name(scorer_addr, field):
    with grpc.insecure_channel(scorer_addr) as ch:
        stub = pb_grpc.ScorerStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            stub.Verify(pb.VerifyRequest(sequences=[BAD_VERIFY[field]]), timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in info.value.details()
        ok = stub.Verify(pb.VerifyRequest(sequences=[pb.VerifySequence(seq_id="fine", context_token_ids=[1, 5])]),
                         timeout=30)
        assert ok.results[0].status == pb.SEQUENCE_STATUS_OK
        stub.Release(pb.ReleaseRequest(seq_ids=["fine"]), timeout=30)
