"""The gateway's loop driven by Kubernetes-style discovery, against real
scorer and proposer processes: EndpointSlice events add a proposer replica
mid-run (new sequences use it at once) and take one away mid-generation
(its sequences re-open elsewhere) without a wrong token."""
from __future__ import annotations

import asyncio

import pytest
from conftest import start_stack

from specdec.client import make_request
from specdec.gateway.discovery import KubernetesDiscovery, ReplicaSet
from specdec.gateway.loop import SpecLoop
from specdec.gateway.request import ModelLimits, parse_request
from specdec.gateway.sequence import Delta, Sequence
from specdec.models import load_tokenizer, resolve_model
from specdec.protos.v1 import specdec_pb2 as pb

SCORER_SVC, NGRAM_SVC = "sd-specdec-scorer", "sd-specdec-proposer-ngram"
PROMPTS = ["Once upon a time", "Tom had a red ball.", "The sun was hot. The sun was hot. The",
           "Lily went to the park with her mom.", "Ben and his dog ran fast.", "A little bird sang."]


def endpoint_slice(service: str, name: str, addrs: list[str], ready: bool = True) -> dict:
    """An EndpointSlice as the API server sends it, for loopback endpoints."""
    ports = {a.rsplit(":", 1)[1] for a in addrs}
    assert len(ports) <= 1, "one port per slice"
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
        "metadata": {"name": name, "namespace": "default",
                     "labels": {"kubernetes.io/service-name": service}},
        "endpoints": [{"addresses": [a.rsplit(":", 1)[0]],
                       "conditions": {"ready": ready, "serving": ready, "terminating": False}}
                      for a in addrs],
        "ports": [{"name": "grpc", "port": int(p), "protocol": "TCP"} for p in ports],
    }


@pytest.fixture(scope="module")
def processes(stories_path, tmp_path_factory):
    """One scorer and two ngram proposer processes (the stack's own gateway is unused)."""
    stack = start_stack(stories_path, tmp_path_factory, "k8s-discovery", num_proposers=2, methods="ngram")
    yield stack
    stack.stop()


def _sequence(tokenizer, limits, prompt: str) -> Sequence:
    # a fixed draft length: every round asks its proposer (adaptive, this tiny model's steps are too cheap
    # for copies to pay: gateway/costs.CopyGates), which is what these tests watch
    params = parse_request(make_request(prompt, max_tokens=48, method="ngram", k=4,
                                        draft_length=pb.DRAFT_LENGTH_FIXED), tokenizer, limits,
                           ("none", "ngram"), "ngram", 4)
    return Sequence("t", params, tokenizer, limits.eos_token_ids, limits.max_model_len)


def _covering(tokenizer, limits, ring: ReplicaSet, owners: set[str]) -> list[tuple[str, Sequence]]:
    """Sequences for PROMPTS, plus repeats until every address in ``owners``
    owns at least one of them on ``ring`` (ports, hence ring positions, are
    random per run: without this a run may put every sequence on one replica)."""
    out: list[tuple[str, Sequence]] = []
    for i in range(200):
        prompt = PROMPTS[i % len(PROMPTS)]
        out.append((prompt, _sequence(tokenizer, limits, prompt)))
        if i + 1 >= len(PROMPTS) and owners <= {ring.pick(s.seq_id) for _, s in out}:
            return out
    raise AssertionError(f"no sequence id lands on {owners} in 200 tries")


async def _run(loop: SpecLoop, seq: Sequence, on_round=None) -> Sequence:
    loop.submit(seq)
    while True:
        item = await seq.out.get()
        assert isinstance(item, Delta), item
        if on_round is not None:
            on_round(seq)
        if item.finish_reason:
            return seq


async def _generate(loop: SpecLoop, tokenizer, limits, prompt: str) -> Sequence:
    return await _run(loop, _sequence(tokenizer, limits, prompt))


def test_proposers_added_and_removed_through_endpointslices(processes, stories_path):
    scorer = processes.by_name("scorer")[0].addr
    p0, p1 = (s.addr for s in processes.by_name("proposer"))
    tokenizer = load_tokenizer(resolve_model(stories_path))

    async def run():
        scorers, ngram = ReplicaSet("scorer"), ReplicaSet("proposer-ngram")
        discovery = KubernetesDiscovery("default", {SCORER_SVC: scorers, NGRAM_SVC: ngram})
        discovery.handle_event("ADDED", endpoint_slice(SCORER_SVC, "scorer-a", [scorer]))
        discovery.handle_event("ADDED", endpoint_slice(NGRAM_SVC, "ngram-a", [p0]))
        loop = SpecLoop(scorers, {"ngram": ngram}, vocab_size=512)
        loop.start()
        limits = ModelLimits(512, 512, (2,))
        try:
            plain = {}
            for prompt in PROMPTS:
                seq = await _generate(loop, tokenizer, limits, prompt)
                plain[prompt] = seq.tokens[seq.num_prompt:]
                assert seq.proposer_addr == p0 and seq.stats.draft_tokens > 0
            # a second replica becomes ready: new sequences spread over both at once
            discovery.handle_event("ADDED", endpoint_slice(NGRAM_SVC, "ngram-b", [p1]))
            batch = _covering(tokenizer, limits, ngram, {p0, p1})
            seqs = await asyncio.gather(*(_run(loop, s) for _, s in batch))
            assert {s.proposer_addr for s in seqs} == {p0, p1}
            assert all(s.tokens[s.num_prompt:] == plain[p] for s, (p, _) in zip(seqs, batch))

            # p0 stops being ready mid-generation: its sequences re-open on p1
            batch = _covering(tokenizer, limits, ngram, {p0, p1})
            moved: list[str] = []

            def drop_p0_once(seq):
                if not moved and seq.proposer_addr == p0:
                    moved.append(seq.seq_id)
                    discovery.handle_event("MODIFIED", endpoint_slice(NGRAM_SVC, "ngram-a", [p0], ready=False))
            seqs = await asyncio.gather(*(_run(loop, s, drop_p0_once) for _, s in batch))
            assert moved, "no sequence was being served by p0 when it went away"
            assert ngram.addresses() == [p1]
            assert all(s.proposer_addr == p1 for s in seqs)
            assert all(s.tokens[s.num_prompt:] == plain[p] for s, (p, _) in zip(seqs, batch))
        finally:
            await loop.stop()

    asyncio.run(run())
