"""The scorer's continuous-batching scheduler and servicer over a real engine
(stories260K): merged concurrent calls, chunked prefill, rollback, pool
exhaustion, hidden states, field-naming errors over real gRPC."""
from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest
import torch
from conftest import ENGINE, assert_features_match, bf16_values, hf_greedy, hf_layer_states, hf_model, random_model

from specdec.engine.config import EngineConfig
from specdec.engine.factory import build_engine
from specdec.kernels import GREEDY, POLICY_NORMAL, TARGET_MATCH
from specdec.protos.v1 import specdec_pb2 as pb
from specdec.protos.v1 import specdec_pb2_grpc as pb_grpc
from specdec.scorer_svc.scheduler import OK, RESOURCE_EXHAUSTED, UNKNOWN_SEQUENCE, JobSpec, Scheduler
from specdec.scorer_svc.server import ScorerServicer

PROMPT = "Once upon a time"


class CountingEngine:
    """The real engine, with its forward passes counted (not replaced)."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.forwards: list[list[int]] = []  # tokens per item, per forward

    def forward(self, items, return_hidden_states=False, feature_layers=()):
        self.forwards.append([len(i.token_ids) for i in items])
        return self._engine.forward(items, return_hidden_states, feature_layers)

    def __getattr__(self, name):
        return getattr(self._engine, name)


@pytest.fixture(scope="module")
def engine(stories_path):
    return build_engine(EngineConfig(stories_path, kv_capacity_tokens=4096, engine=ENGINE))


@pytest.fixture
def counting(engine):
    return CountingEngine(engine)


def spec(seq_id, context=None, context_len=0, drafts=(), hidden=False, layers=(), max_context=0) -> JobSpec:
    ctx = None if context is None else np.asarray(context, np.int32)
    return JobSpec(seq_id=seq_id, context=ctx, context_len=len(ctx) if ctx is not None else context_len,
                   draft_token_ids=np.asarray(drafts, np.int32), draft_probs=None, temperature=0.0,
                   top_k=0, top_p=1.0, seed=0, strategy=GREEDY, accept_policy=POLICY_NORMAL,
                   return_hidden_states=hidden, feature_layers=tuple(layers), max_context_features=max_context)


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


def test_greedy_batches_skip_the_sampling_tensors_and_give_the_same_tokens(stories_path, engine, monkeypatch):
    """An all-greedy CPU batch is verified by the host scan straight from the
    job specs (``kernels.verify.greedy_on_host``), not through ``verify``'s
    sampling tensors: the same tokens as plain greedy, right and wrong
    drafts; a batch with a sampled sequence, or a greedy one under another
    accept policy, still goes through ``verify``."""
    import dataclasses

    import specdec.scorer_svc.scheduler as scheduler_module
    from specdec.kernels import POLICY_ACCEPT_ALL, REJECTION

    calls = []
    real = scheduler_module.verify
    monkeypatch.setattr(scheduler_module, "verify", lambda *a, **k: calls.append(1) or real(*a, **k))
    prompt = prompt_ids(stories_path)
    expected = hf_greedy(stories_path, tuple(prompt), 16)
    oracle = lambda tokens: expected[len(tokens) - len(prompt):][:4]
    wrong = lambda tokens: [(t + 1) % 512 for t in oracle(tokens)]

    async def run():
        sched = Scheduler(engine, max_batch_size=8, max_tokens_per_forward=64)
        try:
            right = await greedy_with_drafts(sched, "g-r", prompt, 16, oracle)
            bad = await greedy_with_drafts(sched, "g-w", prompt, 16, wrong)
            assert not calls
            sampled = dataclasses.replace(spec("g-s", context=prompt), temperature=1.0, strategy=REJECTION)
            accept_all = dataclasses.replace(spec("g-a", context=prompt, drafts=[1, 2]),
                                             accept_policy=POLICY_ACCEPT_ALL)
            for odd in (sampled, accept_all):
                (r, o), _, _ = await sched.verify([spec(f"g-{len(calls)}", context=prompt), odd])
                assert r.status == o.status == OK and r.output_token_ids == expected[:1]
            assert o.output_token_ids[:2] == [1, 2]  # accept_all took the drafts
            forced, _, _ = await sched.verify([spec("g-f", context=prompt, drafts=[1, 2])])
            return right, bad, forced
        finally:
            sched.stop()

    right, bad, forced = asyncio.run(run())
    assert right == expected and bad == expected
    assert len(calls) == 2
    assert forced[0].output_token_ids[0] == expected[0]  # greedy: the drafts [1, 2] stop at the first


def test_transformers_fallback_engine_gives_plain_greedy(tmp_path):
    """The fallback engine (a model family the Llama runner does not run: GPT-2)
    under the scheduler: drafts right and wrong, two sequences at once, give
    exactly transformers' greedy `generate`."""
    from transformers import GPT2Config

    from specdec.engine.hf_engine import HFEngine

    model = random_model(GPT2Config(vocab_size=64, n_positions=128, n_embd=32, n_layer=2, n_head=2))
    model.save_pretrained(tmp_path)
    engine = build_engine(EngineConfig(str(tmp_path), kv_capacity_tokens=1024))
    assert isinstance(engine, HFEngine)
    prompts = {"a": [1, 5, 9, 3, 7, 5, 9], "b": [2, 60, 33, 33, 4]}
    n = 24
    with torch.inference_mode():
        expected = {name: model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False,
                                         attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                         pad_token_id=0)[0, len(p):].tolist()
                    for name, p in prompts.items()}
    assert all(len(e) == n for e in expected.values())

    def oracle(name):
        return lambda tokens: expected[name][len(tokens) - len(prompts[name]):][:4]

    def wrong(name):
        return lambda tokens: [(t + 1) % 64 for t in oracle(name)(tokens)]

    async def run():
        sched = Scheduler(engine, max_batch_size=8, max_tokens_per_forward=64)
        try:
            return await asyncio.gather(greedy_with_drafts(sched, "ra", prompts["a"], n, oracle("a")),
                                        greedy_with_drafts(sched, "wb", prompts["b"], n, wrong("b")),
                                        greedy_with_drafts(sched, "wa", prompts["a"], n, wrong("a")))
        finally:
            sched.stop()

    right_a, wrong_b, wrong_a = asyncio.run(run())
    assert right_a == wrong_a == expected["a"] and wrong_b == expected["b"]


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
    small = build_engine(EngineConfig(stories_path, kv_capacity_tokens=64, engine=ENGINE))
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


IDLE_S = 2.0  # idle expiry in the test below


def test_idle_sequences_expire_and_free_their_kv_cache(stories_path, engine):
    """A sequence that nobody verifies for idle_timeout_s (its gateway died)
    gives its KV cache back; one that keeps being verified stays; the expired
    one asking again is told to re-prefill, and re-prefill gives the same
    tokens as a sequence that never expired."""
    prompt = prompt_ids(stories_path)
    free_at_start = engine.free_tokens()

    async def run():
        sched = Scheduler(engine, max_batch_size=8, max_tokens_per_forward=64, idle_timeout_s=IDLE_S)
        try:
            (a,), _, _ = await sched.verify([spec("a", context=prompt)])
            (b,), _, _ = await sched.verify([spec("b", context=prompt)])
            held = engine.free_tokens()
            # b is verified back to back (a few ms apart, far below IDLE_S), a never,
            # until the worker expires a: waits on that state, not on a sleep
            deadline = asyncio.get_running_loop().time() + 120
            i = 0
            while sched.live_sequences == 2:
                assert asyncio.get_running_loop().time() < deadline, "a never expired"
                (b,), _, _ = await sched.verify([spec("b", context_len=len(prompt) + 1 + i)])
                assert b.status == OK
                i += 1
                await asyncio.sleep(IDLE_S / 40)  # paced: b's context must stay inside the model's 512
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
    # row i: the final-norm hidden state at the position that predicted output token i,
    # i.e. positions len(prompt) - 1 .. len(prompt) + 1 of prompt + the two accepted drafts
    model, _ = hf_model(stories_path)
    with torch.inference_mode():
        out = model(torch.tensor([prompt + expected[:2]]), output_hidden_states=True)
    reference = out.hidden_states[-1][0, len(prompt) - 1:].numpy()  # [3, hidden], after the final norm
    np.testing.assert_allclose(r.hidden_states, reference, rtol=1e-4, atol=1e-4)


def test_features_cover_every_context_position_but_the_newest(stories_path, engine):
    """Chunked first touch, then rounds with right and wrong drafts, next to a
    sequence asking other layers in the same passes: the rows returned cover
    positions 0 .. context_len - 2 once each, are in the order asked, and equal
    transformers' hidden states within bfloat16 rounding. A first touch with
    max_context_features returns only the last positions."""
    prompt = prompt_ids(stories_path) * 8  # ~40 tokens: several 17-token chunks
    expected = hf_greedy(stories_path, tuple(prompt), 20)
    layers, other_layers = (5, 1, 3), (0,)

    async def run():
        sched = Scheduler(engine, max_batch_size=4, max_tokens_per_forward=17)
        tokens, got = list(prompt), []
        try:
            drafts = expected[:3]
            results, _, _ = await sched.verify([spec("f", context=tokens, drafts=drafts, layers=layers),
                                                spec("o", context=prompt[:9], layers=other_layers)])
            while True:
                r = results[0]
                assert r.status == OK, r.message
                got.append(r.features)
                tokens += r.output_token_ids
                done = len(tokens) - len(prompt)
                if done >= 16:
                    break
                right = expected[done:done + 4]
                drafts = right if len(got) % 2 else [(t + 1) % 512 for t in right]  # right and wrong
                results, _, _ = await sched.verify([spec("f", context_len=len(tokens), drafts=drafts,
                                                         layers=layers)])
            windowed, _, _ = await sched.verify([spec("w", context=prompt, layers=layers, max_context=5)])
            return tokens, got, results, windowed[0]
        finally:
            sched.stop()

    tokens, got, _, windowed = asyncio.run(run())
    assert tokens[len(prompt):] == expected[:len(tokens) - len(prompt)]
    starts = [f.start for f in got]
    assert starts[0] == 0 and all(f.bits.shape[1] == 3 * 64 for f in got)
    assert [s + len(f.bits) for s, f in zip(starts, got)] == starts[1:] + [len(tokens) - 1]  # contiguous
    want = hf_layer_states(hf_model(stories_path)[0], tokens[:-1])
    rows = bf16_values(np.concatenate([f.bits for f in got])).view(len(tokens) - 1, 3, 64)
    for j, layer in enumerate(layers):
        assert_features_match(rows[:, j], want[layer])
    assert windowed.features.start == len(prompt) - 5 and len(windowed.features.bits) == 5
    assert_features_match(bf16_values(windowed.features.bits).view(5, 3, 64)[:, 0],
                          hf_layer_states(hf_model(stories_path)[0], prompt)[5][-5:])


def test_context_features_are_cut_to_the_message_budget():
    """Each asking sequence keeps its k + 1 round rows; first touches share
    what is left, in call order, keeping at least their last position."""
    from specdec.scorer_svc.scheduler import cap_context_features

    row = 2 * 64 * 2  # bytes of one row: hidden 64, 2 layers
    specs = [spec("a", context=range(1, 101), drafts=[1, 2], layers=(1, 2), max_context=61),  # 3 fixed rows
             spec("b", context_len=50, drafts=[1], layers=(1, 2)),  # 2 fixed rows
             spec("c", context=range(1, 41), layers=(1, 2), max_context=30),  # 1 fixed row
             spec("d", context=range(1, 41), layers=(3, 4)),  # 1 fixed row, nothing left
             spec("e", context=range(1, 41))]  # no features: untouched
    cap_context_features(specs, 64, budget_bytes=row * (7 + 60 + 20))
    assert [s.max_context_features for s in specs] == [61, 0, 21, 1, 0]
    cap_context_features(specs[:1], 64, budget_bytes=10**9)
    assert specs[0].max_context_features == 61  # never more than asked


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
    "sequences[0].feature_layers[1]": pb.VerifySequence(seq_id="x", context_token_ids=[1], feature_layers=[1, 6]),
    "sequences[0].feature_layers: a layer appears twice": pb.VerifySequence(
        seq_id="x", context_token_ids=[1], feature_layers=[3, 1, 3]),
    "sequences[0].feature_layers: at most 4": pb.VerifySequence(
        seq_id="x", context_token_ids=[1], feature_layers=[0, 1, 2, 3, 4]),
    "sequences[0].max_context_features": pb.VerifySequence(
        seq_id="x", context_token_ids=[1], feature_layers=[1], max_context_features=-1),
    "sequences[0].decode_steps: must be in 0..16": pb.VerifySequence(
        seq_id="x", context_token_ids=[1], decode_steps=17),
    "sequences[0].decode_steps: 4 tokens in one call only without draft_token_ids": pb.VerifySequence(
        seq_id="x", context_token_ids=[1], draft_token_ids=[3], decode_steps=4),
    "sequences[0].decode_steps: 2 tokens in one call only without return_hidden_states": pb.VerifySequence(
        seq_id="x", context_token_ids=[1], feature_layers=[1], return_hidden_states=True, decode_steps=2),
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


def test_release_during_a_job_frees_after_the_job(stories_path):
    """A Release that arrives while the sequence's Verify is still running
    (a gateway shutting down) is applied when the job ends: the job's pages
    are never freed under it, and the KV cache does not leak."""
    prompt = prompt_ids(stories_path) * 12  # ~60 tokens: several 17-token prefill chunks
    engine = build_engine(EngineConfig(stories_path, kv_capacity_tokens=4096, engine=ENGINE))  # its own pool
    free_at_start = engine.free_tokens()

    async def run():
        sched = Scheduler(engine, max_batch_size=4, max_tokens_per_forward=17)
        try:
            verify = asyncio.create_task(sched.verify([spec("r", context=prompt)]))
            await asyncio.sleep(0)  # the Verify is queued before the Release
            released = await sched.release(["r"])
            (result,), _, _ = await verify
            return released, result, sched.live_sequences
        finally:
            sched.stop()

    released, result, live = asyncio.run(run())
    assert released == 1
    assert result.status == OK and result.output_token_ids == hf_greedy(stories_path, tuple(prompt), 1)
    assert live == 0 and engine.free_tokens() == free_at_start


def _ahead_count(outcome: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("specdec_scorer_decode_ahead_total", {"outcome": outcome}) or 0.0


async def _decode(sched, seq_id, prompt, n, drafts_fn=lambda tokens: [], **sampling):
    """Like greedy_with_drafts, with sampling fields replaced (a seeded draw)."""
    from dataclasses import replace

    tokens = list(prompt)
    job = replace(spec(seq_id, context=tokens, drafts=drafts_fn(tokens)), **sampling)
    while True:
        (r,), _, _ = await sched.verify([job])
        assert r.status == OK, r.message
        tokens += r.output_token_ids
        if len(tokens) - len(prompt) >= n:
            return tokens[len(prompt):len(prompt) + n]
        job = replace(spec(seq_id, context_len=len(tokens), drafts=drafts_fn(tokens)), **sampling)


def test_decode_ahead_gives_plain_greedy_and_is_used(stories_path, engine):
    """Plain decoding with decode-ahead: every Verify after the first is
    answered by the step run ahead of it, and the tokens are plain greedy."""
    prompt = prompt_ids(stories_path)
    expected = hf_greedy(stories_path, tuple(prompt), 24)
    used, discarded = _ahead_count("used"), _ahead_count("discarded")
    free_at_start = engine.free_tokens()

    async def run():
        sched = Scheduler(engine, decode_ahead=True)
        try:
            tokens = await _decode(sched, "plain", prompt, 24)
            await asyncio.sleep(0.2)  # the step ahead of the Verify we never send
            released = await sched.release(["plain"])
            return tokens, released
        finally:
            sched.stop()

    tokens, released = asyncio.run(run())
    assert tokens == expected and released == 1
    # 24 rounds: the 23 after the first take a step run ahead (rarely one
    # arrives before the worker starts its step: then it runs as usual)
    assert _ahead_count("used") - used >= 12
    assert _ahead_count("discarded") - discarded == 1  # the step ahead of the end, freed with the sequence
    assert engine.free_tokens() == free_at_start


def test_decode_ahead_is_used_by_greedy_verifies_whatever_their_seed_and_filters(stories_path, engine):
    """At temperature 0 the step ahead's token does not depend on the seed,
    top-k or top-p: a greedy client that sends no seed (each call then gets
    a random one) still takes it, and the tokens are plain greedy."""
    from dataclasses import replace

    prompt = prompt_ids(stories_path)
    expected = hf_greedy(stories_path, tuple(prompt), 16)
    used, discarded = _ahead_count("used"), _ahead_count("discarded")

    async def run():
        sched = Scheduler(engine, decode_ahead=True)
        tokens = list(prompt)
        try:
            for i in range(16):
                job = spec("seedless", **({"context": tokens} if i == 0 else {"context_len": len(tokens)}))
                job = replace(job, seed=1000 + i, top_k=i % 3, top_p=[1.0, 0.5][i % 2],
                              strategy=[GREEDY, TARGET_MATCH][i % 2])
                (r,), _, _ = await sched.verify([job])
                assert r.status == OK, r.message
                tokens += r.output_token_ids
            return tokens[len(prompt):]
        finally:
            sched.stop()

    assert asyncio.run(run()) == expected
    assert _ahead_count("used") - used >= 8
    assert _ahead_count("discarded") - discarded <= 1  # at most the step ahead of the end


def _alternate_drafts(prompt, reference):
    """Rounds cycling draft-less, right drafts (from reference) and wrong ones."""
    def drafts(tokens):
        done = len(tokens) - len(prompt)
        right = reference[done:][:3]
        if done % 3 == 0 or not right:
            return []
        return right if done % 3 == 1 else [(t + 1) % 512 for t in right]
    return drafts


class _PassClock(CountingEngine):
    """The real engine, and the scheduler module's ``time``: perf_counter
    jumps PASS_S in each forward pass, so a call's compute_s says how many
    passes it was charged (whatever the passes really took)."""

    PASS_S = 1000.0

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.offset = 0.0

    def perf_counter(self) -> float:
        return time.perf_counter() + self.offset

    def monotonic(self) -> float:
        return time.monotonic()

    def forward(self, items, return_hidden_states=False, feature_layers=()):
        out = super().forward(items, return_hidden_states, feature_layers)
        self.offset += self.PASS_S
        return out


def test_a_call_pays_a_decode_ahead_pass_once_however_many_of_its_sequences_it_ran(stories_path, engine,
                                                                                    monkeypatch):
    """Eight plain sequences in one Verify a round, decode-ahead on: the
    steps run ahead of a round are one pass over all eight, and the call
    that takes them is charged that pass once (its compute_s feeds the
    gateway's Verify cost model; charged once per sequence, a round of 8
    read as 8 passes). The tokens stay plain greedy."""
    from specdec.scorer_svc import scheduler as scheduler_module

    clock = _PassClock(engine)
    monkeypatch.setattr(scheduler_module, "time", clock)
    prompt = prompt_ids(stories_path)
    expected = hf_greedy(stories_path, tuple(prompt), 6)
    used = _ahead_count("used")
    ids = [f"s{i}" for i in range(8)]

    async def run():
        sched = Scheduler(clock, decode_ahead=True)
        try:
            tokens = {i: list(prompt) for i in ids}
            charged = []  # passes charged to each call
            for r in range(6):
                specs = [spec(i, **({"context": tokens[i]} if r == 0 else {"context_len": len(tokens[i])}))
                         for i in ids]
                results, compute_s, _ = await sched.verify(specs)
                for i, res in zip(ids, results):
                    assert res.status == OK, res.message
                    tokens[i] += res.output_token_ids
                charged.append(compute_s / clock.PASS_S)
                await asyncio.sleep(0.2)  # the steps ahead of the next round
            await sched.release(ids)
            return tokens, charged
        finally:
            sched.stop()

    tokens, charged = asyncio.run(run())
    assert all(t[len(prompt):] == expected for t in tokens.values())
    assert _ahead_count("used") - used >= 8 * 4  # most rounds took the steps run ahead
    assert [round(c) for c in charged] == [1] * 6, charged  # one pass each: the prefill, then the steps ahead


def test_decode_ahead_starts_a_greedy_verify_with_drafts(stories_path, engine):
    """Greedy rounds alternating draft-less and drafted (right and wrong
    drafts): a drafted Verify after a draft-less one starts from the step run
    ahead (it decides the first draft) instead of rolling it back; the output
    is plain greedy."""
    prompt = prompt_ids(stories_path)
    expected = hf_greedy(stories_path, tuple(prompt), 30)
    used, discarded = _ahead_count("used"), _ahead_count("discarded")

    async def run():
        sched = Scheduler(engine, decode_ahead=True)
        try:
            return await _decode(sched, "mixed", prompt, 30, _alternate_drafts(prompt, expected))
        finally:
            sched.stop()

    assert asyncio.run(run()) == expected
    assert _ahead_count("used") - used >= 4
    assert _ahead_count("discarded") - discarded == 0


def test_a_call_asking_for_no_step_ahead_gets_none(stories_path, engine):
    """The rounds of the test above, every call asking for no decode-ahead
    step (VerifySequence.skip_decode_ahead, what the gateway asks where
    drafts follow): no step runs ahead of any call, each draft-less call is
    counted as skipped, and the output is plain greedy."""
    from dataclasses import replace

    prompt = prompt_ids(stories_path)
    expected = hf_greedy(stories_path, tuple(prompt), 30)
    used, discarded, skipped = _ahead_count("used"), _ahead_count("discarded"), _ahead_count("skipped")
    drafts_fn, draft_less = _alternate_drafts(prompt, expected), []

    def counted(tokens):
        drafts = drafts_fn(tokens)
        draft_less.append(not drafts)
        return drafts

    async def run():
        sched = Scheduler(engine, decode_ahead=True)
        try:
            tokens = list(prompt)
            job = replace(spec("noahead", context=tokens, drafts=counted(tokens)), skip_decode_ahead=True)
            while len(tokens) - len(prompt) < 30:
                (r,), _, _ = await sched.verify([job])
                assert r.status == OK, r.message
                tokens += r.output_token_ids
                await asyncio.sleep(0.05)  # time enough for a step ahead, were one started
                job = replace(spec("noahead", context_len=len(tokens), drafts=counted(tokens)), skip_decode_ahead=True)
            await sched.release(["noahead"])
            return tokens[len(prompt):len(prompt) + 30]
        finally:
            sched.stop()

    assert asyncio.run(run()) == expected
    assert _ahead_count("used") == used and _ahead_count("discarded") == discarded
    assert _ahead_count("skipped") - skipped == sum(draft_less[:-1]) >= 4  # (the last call is never sent)


def test_skip_decode_ahead_travels_into_the_job():
    from specdec.scorer_svc.server import job_spec

    for skip in (False, True):
        seq = pb.VerifySequence(seq_id="x", context_token_ids=[1, 5], skip_decode_ahead=skip)
        assert job_spec(seq, 0, vocab_size=512, max_model_len=512, num_layers=5).skip_decode_ahead is skip


@pytest.mark.parametrize("strategy", ["rejection", "target_match"])
def test_decode_ahead_with_sampled_drafts_gives_the_same_tokens(stories_path, engine, strategy):
    """Sampled rounds alternating draft-less and drafted: the same tokens
    with decode-ahead as without. Rejection sampling rolls the step back
    (its first draft's test is not the step's draw); target-match starts from
    it (it accepts a draft exactly when it equals that draw) and, being token
    for token plain sampling, also equals plain seeded decoding."""
    from specdec.kernels import REJECTION, TARGET_MATCH

    prompt = prompt_ids(stories_path)
    sampling = dict(temperature=0.9, top_k=40, top_p=0.95, seed=5,
                    strategy=REJECTION if strategy == "rejection" else TARGET_MATCH)
    used, discarded = _ahead_count("used"), _ahead_count("discarded")

    async def run(ahead: bool, drafts_fn=lambda tokens: []):
        sched = Scheduler(engine, decode_ahead=ahead)
        try:
            return await _decode(sched, f"{strategy}{ahead}", prompt, 30, drafts_fn, **sampling)
        finally:
            sched.stop()

    plain = asyncio.run(run(False))
    drafts_fn = _alternate_drafts(prompt, plain)
    without = asyncio.run(run(False, drafts_fn))
    assert asyncio.run(run(True, drafts_fn)) == without
    if strategy == "rejection":
        assert _ahead_count("discarded") - discarded >= 1
    else:
        assert without == plain
        assert _ahead_count("discarded") - discarded == 0 and _ahead_count("used") - used >= 4


@pytest.mark.parametrize("temperature", [0.8, 1.3])
def test_decode_ahead_draws_the_same_sampled_tokens(stories_path, engine, temperature):
    """A seeded sampled request: the same tokens with decode-ahead as without
    (the step ahead draws with the request's seed at the same position), and
    two sequences at once each get their own."""
    from specdec.kernels import REJECTION

    prompt = prompt_ids(stories_path)
    sampling = dict(temperature=temperature, top_k=50, top_p=0.95, seed=11, strategy=REJECTION)

    async def run(ahead: bool):
        sched = Scheduler(engine, decode_ahead=ahead)
        try:
            return await asyncio.gather(_decode(sched, f"s{ahead}", prompt, 20, **sampling),
                                        _decode(sched, f"t{ahead}", prompt, 20, **{**sampling, "seed": 12}))
        finally:
            sched.stop()

    without, with_ahead = asyncio.run(run(False)), asyncio.run(run(True))
    assert with_ahead == without
    assert without[0] != without[1]  # the seeds matter: the test compares real draws


def test_decode_ahead_serves_feature_rounds_with_the_same_tokens_and_feature_rows(stories_path, engine):
    """EAGLE-3/MTP rounds (feature_layers named) alternating draft-less,
    right and wrong drafts: with decode-ahead the steps run ahead are used
    (never discarded) and every answer carries the same tokens and the same
    feature rows, bit for bit, as without it."""
    prompt = prompt_ids(stories_path)
    expected = hf_greedy(stories_path, tuple(prompt), 30)
    layers = (1, 3, 5)

    def drafts_fn(tokens, i):  # round i: none, right, none, wrong, ...
        right = expected[len(tokens) - len(prompt):][:3]
        return [[], right, [], [(t + 1) % 512 for t in right]][i % 4]

    async def run(ahead: bool):
        sched = Scheduler(engine, decode_ahead=ahead)
        tokens, answers = list(prompt), []
        try:
            job = spec(f"feat{ahead}", context=tokens, drafts=drafts_fn(tokens, 0), layers=layers)
            while len(tokens) - len(prompt) < 30:
                (r,), _, _ = await sched.verify([job])
                assert r.status == OK, r.message
                answers.append((r.output_token_ids, r.features.start, r.features.bits.tobytes()))
                tokens += r.output_token_ids
                job = spec(f"feat{ahead}", context_len=len(tokens), drafts=drafts_fn(tokens, len(answers)),
                           layers=layers)
            return tokens[len(prompt):len(prompt) + 30], answers
        finally:
            sched.stop()

    without = asyncio.run(run(False))
    used, discarded = _ahead_count("used"), _ahead_count("discarded")
    with_ahead = asyncio.run(run(True))
    assert without[0] == expected and with_ahead == without
    assert _ahead_count("used") - used >= 4 and _ahead_count("discarded") - discarded <= 1


async def _decode_steps(sched, seq_id, prompt, n, steps, **sampling):
    """Decodes n tokens asking ``steps`` tokens per call; returns (tokens,
    tokens per call)."""
    from dataclasses import replace

    tokens, per_call = list(prompt), []
    job = replace(spec(seq_id, context=tokens), decode_steps=steps, **sampling)
    while len(tokens) - len(prompt) < n:
        (r,), _, _ = await sched.verify([job])
        assert r.status == OK and r.num_accepted == 0, r.message
        tokens += r.output_token_ids
        per_call.append(len(r.output_token_ids))
        job = replace(spec(seq_id, context_len=len(tokens)), decode_steps=steps, **sampling)
    return tokens[len(prompt):len(prompt) + n], per_call


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_decode_steps_give_the_tokens_of_as_many_calls(stories_path, engine, ahead, temperature):
    """decode_steps=4: each call answers 4 tokens, one forward pass each
    (merged with a one-token-per-call sequence's passes), and the tokens are
    those of one-token calls: plain greedy, or the same seeded draws; with
    decode-ahead, the step run ahead counts as a call's first token."""
    from specdec.kernels import REJECTION

    prompt = prompt_ids(stories_path)
    sampling = dict(temperature=temperature, top_k=50, top_p=0.95, seed=5, strategy=REJECTION) if temperature else {}
    counting = CountingEngine(engine)
    used = _ahead_count("used")

    async def run(steps: int):
        sched = Scheduler(counting, decode_ahead=ahead)
        try:
            out = await asyncio.gather(_decode_steps(sched, f"m{steps}", prompt, 20, steps, **sampling),
                                       _decode_steps(sched, f"o{steps}", prompt, 12, 1, **sampling))
            await sched.release([f"m{steps}", f"o{steps}"])
            return out
        finally:
            sched.stop()

    (one, one_calls), _ = asyncio.run(run(1))
    counting.forwards.clear()
    (four, four_calls), (other, _) = asyncio.run(run(4))
    assert four == one and other == one[:12]
    if not temperature:
        assert one == hf_greedy(stories_path, tuple(prompt), 20)
    assert one_calls == [1] * 20 and four_calls == [4] * 5
    assert max(map(len, counting.forwards)) == 2  # the two sequences shared passes
    assert sum(n == 1 for f in counting.forwards for n in f) >= 19  # one pass per token after the prefill
    if ahead:
        assert _ahead_count("used") > used


@pytest.mark.parametrize("ahead", [False, True])
def test_decode_steps_with_feature_layers_answer_the_feature_rows_of_as_many_calls(stories_path, engine, ahead):
    """A feature head's sequence decoding plainly (asked for no draft) gets
    4 tokens per call, and the call answers the target's feature rows of
    every position its passes ran: bit for bit the rows that one-token calls
    answer, in one contiguous block (with decode-ahead too, whose finished
    step leads the call's rows)."""
    from dataclasses import replace

    prompt = prompt_ids(stories_path)
    layers = (1, 3)

    async def run(steps: int):
        sched = Scheduler(engine, decode_ahead=ahead)
        seq = f"fsteps{steps}{ahead}"
        tokens, answers = list(prompt), []
        try:
            job = spec(seq, context=tokens, layers=layers)
            while len(tokens) - len(prompt) < 17:
                (r,), _, _ = await sched.verify([job])
                assert r.status == OK and r.num_accepted == 0, r.message
                answers.append((r.features.start, len(r.output_token_ids), r.features.bits))
                tokens += r.output_token_ids
                job = replace(spec(seq, context_len=len(tokens), layers=layers), decode_steps=steps)
                if ahead:  # the step ahead ends before the next call: the call takes its finished result
                    await asyncio.sleep(0.3)
            await sched.release([seq])
            return tokens[len(prompt):len(prompt) + 17], answers
        finally:
            sched.stop()

    one, one_answers = asyncio.run(run(1))
    four, four_answers = asyncio.run(run(4))
    assert four == one == hf_greedy(stories_path, tuple(prompt), 17)
    assert [tokens for _, tokens, _ in four_answers] == [1, 4, 4, 4, 4]  # the first touch answers one token
    # the prompt's rows, then per call one row per token, each block where the one before ended
    assert four_answers[0][0] == 0 and len(four_answers[0][2]) == len(prompt)
    for (start, _, rows), (next_start, tokens, next_rows) in zip(four_answers, four_answers[1:]):
        assert next_start == start + len(rows) and len(next_rows) == tokens
    one_rows, four_rows = (np.concatenate([rows for _, _, rows in a]) for a in (one_answers, four_answers))
    assert four_rows.shape == one_rows.shape and (four_rows == one_rows).all()


def test_decode_steps_stop_after_an_end_of_sequence_token(stories_path, engine):
    """A call asking 8 tokens ends with the first end-of-sequence token (here
    the 3rd greedy token, declared one); the next call goes on from there."""
    import dataclasses

    prompt = prompt_ids(stories_path)
    expected = hf_greedy(stories_path, tuple(prompt), 8)
    eos = expected[2]
    assert eos not in expected[:2]
    counting = CountingEngine(engine)
    counting.facts = dataclasses.replace(engine.facts, eos_token_ids=(eos,))

    async def run():
        sched = Scheduler(counting)
        try:
            (r,), _, _ = await sched.verify([dataclasses.replace(spec("e", context=prompt), decode_steps=8)])
            (r2,), _, _ = await sched.verify([dataclasses.replace(spec("e", context_len=len(prompt) + 3),
                                                                  decode_steps=2)])
            await sched.release(["e"])
            return r, r2
        finally:
            sched.stop()

    r, r2 = asyncio.run(run())
    assert r.status == OK and r.output_token_ids == expected[:3]
    assert r2.status == OK and r2.output_token_ids == expected[3:5]


def test_decode_steps_over_grpc(scorer_addr):
    """The field travels: a Verify over real gRPC with decode_steps=3 answers
    3 tokens, those of three one-token calls."""
    with grpc.insecure_channel(scorer_addr) as ch:
        stub = pb_grpc.ScorerStub(ch)
        context = [1, 5, 9]
        many = stub.Verify(pb.VerifyRequest(sequences=[pb.VerifySequence(
            seq_id="steps3", context_token_ids=context, decode_steps=3)]), timeout=30).results[0]
        tokens = list(context)
        for i in range(3):
            seq = (pb.VerifySequence(seq_id="steps1", context_token_ids=tokens) if i == 0
                   else pb.VerifySequence(seq_id="steps1", context_len=len(tokens)))
            tokens += stub.Verify(pb.VerifyRequest(sequences=[seq]), timeout=30).results[0].output_token_ids
        stub.Release(pb.ReleaseRequest(seq_ids=["steps3", "steps1"]), timeout=30)
    assert many.status == pb.SEQUENCE_STATUS_OK and many.num_accepted == 0
    assert list(many.output_token_ids) == tokens[3:] and len(tokens) == 6
