"""Failure semantics: a proposer that is killed, slow or wrong, and a scorer
replica that dies, never change a token; cancelled requests free their state;
no scorer left ends a request with UNAVAILABLE."""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from conftest import start_stack
from specdec.client import make_request, stream
from specdec.protos.v1 import specdec_pb2 as pb
from specdec.protos.v1 import specdec_pb2_grpc as pb_grpc
from specdec.proposer_svc.base import Draft, NaiveProposer
from specdec.proposer_svc.server import ProposerServicer

PROMPTS = ["Once upon a time", "Tom had a red ball.", "The sun was hot. The sun was hot. The",
           "Lily went to the park with her mom."]
LONG = 160


def _run_all(addr, method="ngram", k=4, max_tokens=LONG, on_first=None):
    """Runs all PROMPTS concurrently; on_first() fires once, on the first delta."""
    fired = threading.Event()

    def one(prompt):
        def delta(_):
            if on_first is not None and not fired.is_set():
                fired.set()
                on_first()
        return stream(addr, make_request(prompt, max_tokens=max_tokens, method=method, k=k),
                      on_delta=delta).token_ids

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


def _model_info(addr) -> pb.ModelInfo:
    with grpc.insecure_channel(addr) as ch:
        return pb_grpc.ScorerStub(ch).GetModelInfo(pb.ModelInfoRequest(), timeout=10)


def _busiest(stack, kind: str):
    """The replica of ``kind`` holding the most live sequences right now,
    read from the gateway's specdec_gateway_replica_sequences gauge."""
    replicas = stack.by_name(kind)
    for _ in range(40):  # the gauge is set at the end of the round that sent the first delta
        samples = stack.by_name("gateway")[0].metrics()

        def load(service):
            key = f'specdec_gateway_replica_sequences{{kind="{kind}",replica="{service.addr}"}}'
            return samples.get(key, 0.0)
        victim = max(replicas, key=load)
        if load(victim) > 0:
            return victim
        time.sleep(0.05)
    raise AssertionError(f"no {kind} replica holds a live sequence: {samples}")


def _run_killing_busiest(stack, kind: str):
    """Runs all PROMPTS, killing the busiest ``kind`` replica on the first
    delta; returns (outputs, the killed service)."""
    killed = []

    def kill_busiest():
        killed.append(_busiest(stack, kind))
        killed[0].kill()
    outputs = _run_all(stack.gateway_addr, on_first=kill_busiest)
    assert killed and killed[0].proc.poll() is not None
    return outputs, killed[0]


def _moves(stack, kind: str) -> float:
    return stack.by_name("gateway")[0].metrics().get(f'specdec_gateway_sequence_moves_total{{kind="{kind}"}}', 0.0)


def test_killing_a_proposer_replica_mid_generation_changes_nothing(stories_path, tmp_path_factory):
    stack = start_stack(stories_path, tmp_path_factory, "two-proposers", num_proposers=2, metrics=True,
                        methods="ngram", extra_gateway_args=["--propose-timeout-ms", "2000"])
    try:
        undisturbed = _run_all(stack.gateway_addr)
        assert _moves(stack, "proposer") == 0
        disturbed, victim = _run_killing_busiest(stack, "proposer")
        assert _moves(stack, "proposer") > 0  # its sequences really did move
        assert disturbed == undisturbed
        again = _run_all(stack.gateway_addr)  # the survivor serves everyone
        assert again == undisturbed
        # the gateway's request counters saw all twelve requests and their tokens
        samples = stack.by_name("gateway")[0].metrics()
        ended = sum(v for k, v in samples.items() if k.startswith("specdec_gateway_requests_total{"))
        assert ended == 3 * len(PROMPTS)
        tokens = sum(map(len, undisturbed + disturbed + again))
        assert samples['specdec_gateway_output_tokens_total{method="ngram"}'] == tokens
        assert samples['specdec_gateway_accepted_tokens_total{method="ngram"}'] > 0
    finally:
        stack.stop()


def test_killing_a_scorer_replica_mid_generation_changes_nothing(stories_path, tmp_path_factory):
    stack = start_stack(stories_path, tmp_path_factory, "two-scorers", num_scorers=2, methods="ngram",
                        metrics=True)
    try:
        undisturbed = _run_all(stack.gateway_addr)
        scorers = stack.by_name("scorer")
        for s in scorers:
            assert _model_info(s.addr).kv_capacity_tokens > 0
        disturbed, victim = _run_killing_busiest(stack, "scorer")
        assert _moves(stack, "scorer") > 0  # its sequences were re-prefilled elsewhere
        assert disturbed == undisturbed
        scorers.remove(victim)
        scorers[0].kill()
        with pytest.raises(grpc.RpcError) as info:
            stream(stack.gateway_addr, make_request("Once upon a time", max_tokens=8), timeout=120)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        stack.stop()


class _CountingProposer(NaiveProposer):
    name = "ngram"

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def propose(self, requests):
        self.calls += 1
        return self.bad_drafts(requests)


class _GarbageProposer(_CountingProposer):
    """Deliberately wrong: out-of-vocabulary ids, too many drafts, random ids."""

    rng = np.random.default_rng(0)

    def bad_drafts(self, requests):
        out = []
        for i, (_, k) in enumerate(requests):
            kind = (self.calls + i) % 3
            if kind == 0:
                ids = np.full(k, 10**6, dtype=np.int32)  # outside every vocabulary
            elif kind == 1:
                ids = np.arange(k + 5, dtype=np.int32) % 500  # more than asked for
            else:
                ids = self.rng.integers(0, 512, size=k).astype(np.int32)  # wrong guesses
            out.append(Draft(ids))
        return out


class _SlowProposer(_CountingProposer):
    def bad_drafts(self, requests):
        time.sleep(0.3)  # beyond the gateway's propose timeout
        return [Draft(np.array([1, 2, 3], dtype=np.int32)[:k]) for _, k in requests]


class _InProcessProposer:
    """A real gRPC Proposer server (in a thread) around a deliberately bad proposer."""

    def __init__(self, proposer) -> None:
        self.proposer = proposer
        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)
        self._thread.start()
        assert self._ready.wait(30)

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._server = grpc.aio.server()
        pb_grpc.add_ProposerServicer_to_server(ProposerServicer({"ngram": self.proposer}), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        self._stop = asyncio.Event()
        self._ready.set()
        await self._stop.wait()
        await self._server.stop(0)

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


@pytest.mark.parametrize("bad", [_GarbageProposer, _SlowProposer])
def test_wrong_or_slow_proposer_changes_nothing(stories_path, tmp_path_factory, bad):
    proposer = _InProcessProposer(bad())
    stack = start_stack(stories_path, tmp_path_factory, f"bad-{bad.__name__}", num_proposers=0,
                        methods="ngram", extra_gateway_args=[
                            "--proposer", f"ngram=127.0.0.1:{proposer.port}", "--propose-timeout-ms", "100"])
    try:
        reference = [stream(stack.gateway_addr, make_request(p, max_tokens=40, method="none")).token_ids
                     for p in PROMPTS]
        got = _run_all(stack.gateway_addr, method="ngram", k=4, max_tokens=40)
        assert got == reference
        assert proposer.proposer.calls > 0
    finally:
        stack.stop()
        proposer.stop()


def test_cancelled_request_frees_its_kv_cache(stories_stack):
    scorer = stories_stack.by_name("scorer")[0].addr
    before = _model_info(scorer)
    with grpc.insecure_channel(stories_stack.gateway_addr) as ch:
        call = pb_grpc.GatewayStub(ch).Generate(_long_request())
        next(call)  # generation is under way
        assert _model_info(scorer).live_sequences == before.live_sequences + 1
        call.cancel()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        info = _model_info(scorer)
        if info.live_sequences == before.live_sequences and info.kv_free_tokens == before.kv_free_tokens:
            break
        time.sleep(0.1)
    assert info.live_sequences == before.live_sequences
    assert info.kv_free_tokens == before.kv_free_tokens


def _long_request() -> pb.GenerateRequest:
    request = make_request("Once upon a time", max_tokens=400, method="ngram", k=3)
    request.ignore_eos = True
    return request
