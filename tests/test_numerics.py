"""Scorer replicas that compute different bits: each says its arithmetic
(ModelInfo.numerics, a hash of a fixed probe's logits), and a sequence that
moves keeps to replicas of the arithmetic that made its tokens while one is
up (gateway/numerics.py). A sequence moved between two arithmetics could take
another token at a near-tie than plain decoding on either would."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from conftest import ENGINE, start_stack
from test_gateway_round import _params, _Tokenizer

from specdec.client import make_request, stream
from specdec.engine.base import ForwardItem, numerics_fingerprint
from specdec.engine.config import EngineConfig
from specdec.engine.factory import build_engine
from specdec.gateway.clients import Connections
from specdec.gateway.discovery import ReplicaSet
from specdec.gateway.placement import Placement
from specdec.gateway.sequence import Sequence
from specdec.protos.v1 import specdec_pb2 as pb
from specdec.protos.v1 import specdec_pb2_grpc as pb_grpc

#: two GEMM paths of different bits (engine/gemm_select.SAME_BITS), both our own kernels: invariant on any CPU
SIMD, NUMBA = "simd", "numba"


def _engine(model: str, gemm: str):
    return build_engine(EngineConfig(model=model, dtype="float32", gemm=gemm, kv_capacity_tokens=2048,
                                     num_threads=1))


@pytest.mark.skipif(ENGINE not in ("auto", "llama"), reason="the GEMM paths are the Llama engine's")
def test_the_fingerprint_names_the_arithmetic_and_leaves_the_cache_as_it_was(stories_path):
    simd = _engine(stories_path, SIMD)
    # a live sequence beside the probe: its cache and the pool's free tokens are as before
    simd.ensure_capacity("live", 8)
    simd.forward([ForwardItem("live", np.arange(1, 6, dtype=np.int32), 1)])
    free = simd.free_tokens()
    first = numerics_fingerprint(simd)
    assert len(first) == 16 and int(first, 16) >= 0
    assert simd.cached_len("live") == 5 and simd.free_tokens() == free
    assert numerics_fingerprint(simd) == first  # the same engine, the same bits
    assert numerics_fingerprint(_engine(stories_path, "simd-l1")) == first  # another path of simd's bits
    assert numerics_fingerprint(_engine(stories_path, NUMBA)) != first  # other bits


def test_a_pool_too_small_for_the_probe_serves_without_a_fingerprint(stories_path):
    """A scorer whose KV pool cannot hold the probe's tokens starts and says
    no fingerprint ("": unknown to gateways) instead of failing."""
    from specdec.scorer_svc.server import replica_numerics

    tiny = build_engine(EngineConfig(model=stories_path, dtype="float32", kv_capacity_tokens=16, num_threads=1))
    assert replica_numerics(tiny) == "" and tiny.free_tokens() == 16
    assert len(replica_numerics(_engine(stories_path, SIMD))) == 16


def _sequence(seq_id: str) -> Sequence:
    return Sequence(seq_id, _params(), _Tokenizer(), (2,), 512)


def test_a_sequence_counts_a_change_of_arithmetic_only_when_its_tokens_had_another():
    seq = _sequence("s")
    assert seq.computed_by("") is None and seq.numerics is None  # a scorer that does not say
    assert seq.computed_by("x") is None and seq.numerics == "x"  # its first answer: the arithmetic of its tokens
    seq.scorer_moved = True
    assert seq.computed_by("x") == "same" and not seq.scorer_moved
    seq.scorer_moved = True
    assert seq.computed_by("y") == "changed" and seq.numerics == "y"
    assert seq.computed_by("y") is None  # from now on its tokens are y's
    assert seq.final_stats().scorer_numerics_changes == 1


def test_a_moving_sequence_goes_to_a_replica_of_its_arithmetic_while_one_is_up():
    """The ring's next replica computes otherwise: the move skips it for one
    that computes alike, and takes it only when no such one is up."""
    addrs = ["a:1", "b:1", "c:1"]
    conns = Connections()
    placement = Placement(ReplicaSet("scorer", addrs), {}, conns)
    for addr, numerics in zip(addrs, ("x", "y", "x")):
        placement.numerics.heard(addr, numerics)
    # sequences whose ring owner is a:1 and whose next replica on the ring is b:1 (the other arithmetic)
    ring = placement.scorers
    seqs = [seq for seq in map(_sequence, ["s"] * 300)
            if ring.pick(seq.seq_id) == "a:1" and ring.pick(seq.seq_id, {"a:1"}) == "b:1"]
    assert len(seqs) >= 5
    groups, unplaced = placement.by_scorer(seqs)
    assert set(groups) == {"a:1"} and not unplaced
    for seq in seqs:
        assert seq.computed_by("x") is None
    conns.mark_down("a:1", 60)
    groups, _ = placement.by_scorer(seqs)
    assert set(groups) == {"c:1"}  # not the ring's b:1
    assert all(seq.scorer_moved and seq.computed_by("x") == "same" for seq in seqs)
    conns.mark_down("c:1", 60)
    groups, _ = placement.by_scorer(seqs)
    assert set(groups) == {"b:1"}  # none of x is up: the ring's next, counted as a change
    assert all(seq.computed_by("y") == "changed" for seq in seqs)
    # a replica that leaves is forgotten: a new one at its address may compute otherwise
    placement.numerics.forget("b:1")
    assert placement.numerics.differing("x") == set()


PROMPTS = ["Once upon a time", "Tom had a red ball.", "The sun was hot. The sun was hot. The",
           "Lily went to the park with her mom.", "One day, a little girl", "The cat sat on the mat.",
           "Ben and his dog", "There was a big tree", "Sam liked to play", "The bird sang a song.",
           "Mia found a box", "It was a sunny day"]


def _info(addr: str) -> pb.ModelInfo:
    with grpc.insecure_channel(addr) as ch:
        return pb_grpc.ScorerStub(ch).GetModelInfo(pb.ModelInfoRequest(), timeout=10)


def _metric(stack, key: str) -> float:
    return stack.by_name("gateway")[0].metrics().get(key, 0.0)


def _run_killing(stack, candidates) -> tuple[list, object]:
    """All PROMPTS at once (EOS ignored); once every request has had a delta
    (so each sequence's tokens came from some replica's arithmetic), the
    candidate scorer holding most live sequences is killed. (results, the
    killed one)."""
    killed: list = []
    started: set[str] = set()
    lock = threading.Lock()

    def kill():
        deadline = time.monotonic() + 60  # the gauge is set at the end of the round that sent the delta
        while time.monotonic() < deadline:
            samples = stack.by_name("gateway")[0].metrics()
            load = [samples.get(f'specdec_gateway_replica_sequences{{kind="scorer",replica="{s.addr}"}}', 0)
                    for s in candidates]
            victim = candidates[int(np.argmax(load))]
            if max(load) > 0:
                victim.kill()
                killed.append(victim)
                return
            time.sleep(0.05)

    def one(prompt):
        def delta(_):
            with lock:
                last = prompt not in started and len(started) == len(PROMPTS) - 1
                started.add(prompt)
            if last:
                kill()
        request = make_request(prompt, max_tokens=96, method="ngram", k=4, draft_length=pb.DRAFT_LENGTH_FIXED)
        request.ignore_eos = True
        return stream(stack.gateway_addr, request, on_delta=delta)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(one, PROMPTS))
    assert killed, "no candidate scorer held a live sequence"
    return results, killed[0]


@pytest.mark.skipif(ENGINE not in ("auto", "llama"), reason="the GEMM paths are the Llama engine's")
def test_sequences_of_a_killed_scorer_move_to_a_replica_of_their_arithmetic(stories_path, tmp_path_factory):
    """Three real scorers, two on simd and one on numba (other bits). A simd
    replica dies mid-run: its sequences go on on the other simd one, no
    request's tokens mix arithmetics. Then the last simd replica dies
    mid-run: its sequences can only go to numba, and say so."""
    stack = start_stack(stories_path, tmp_path_factory, "numerics", num_scorers=3, methods="ngram", metrics=True,
                        scorer_args_each=[["--gemm", SIMD], ["--gemm", NUMBA], ["--gemm", SIMD]])
    try:
        scorers = stack.by_name("scorer")
        fingerprints = [_info(s.addr).numerics for s in scorers]
        assert fingerprints[0] == fingerprints[2] != fingerprints[1] != ""
        deadline = time.monotonic() + 30  # the gateway asks each replica when it discovers it
        while _metric(stack, "specdec_gateway_scorer_numerics_kinds") != 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _metric(stack, "specdec_gateway_scorer_numerics_kinds") == 2

        results, victim = _run_killing(stack, [scorers[0], scorers[2]])
        assert all(len(r.token_ids) == 96 for r in results)
        assert [r.stats.scorer_numerics_changes for r in results] == [0] * len(PROMPTS)
        assert _metric(stack, 'specdec_gateway_scorer_numerics_moves_total{outcome="same"}') > 0
        assert _metric(stack, 'specdec_gateway_scorer_numerics_moves_total{outcome="changed"}') == 0

        survivor = scorers[2] if victim is scorers[0] else scorers[0]
        results, _ = _run_killing(stack, [survivor])
        assert all(len(r.token_ids) == 96 for r in results)
        changed = [r.stats.scorer_numerics_changes for r in results]
        assert sum(changed) > 0 and max(changed) == 1  # one other arithmetic to go to
        assert _metric(stack, 'specdec_gateway_scorer_numerics_moves_total{outcome="changed"}') == sum(changed)
    finally:
        stack.stop()
