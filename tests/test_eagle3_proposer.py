"""The eagle3 and mtp proposers as a real process over the real Propose
stream, on stories260K: a random EAGLE-3 head written by the test in the
public layout and a random MTP layer added to a copy of the checkpoint load
and serve. The test plays the gateway: it verifies drafts greedily with the
target (transformers), or by rejection sampling on a real scorer process,
and relays the target's features for the new context positions, packed as
the wire carries them (bfloat16 rows, by position)."""
from __future__ import annotations

import queue
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from feature_heads import bf16_bytes, target_features, write_eagle3_head, write_mtp_target
from safetensors.torch import load_file
from test_e2e_sampling import PROMPT as REPEATING_PROMPT
from test_e2e_sampling import TEMPERATURE, TOP_K, _exact_joint, _marginal, chi_square_p_value

from specdec.launcher import free_port, wait_serving
from specdec.protos.v1 import specdec_pb2 as pb
from specdec.protos.v1 import specdec_pb2_grpc as pb_grpc

LAYERS = [1, 3, 4]  # stories260K has 5 decoder layers; 5 = the last, before the final norm
PROMPTS = [[1, 403, 407, 261, 378, 285, 429, 267, 376, 433, 261], [1, 365, 1215 % 512, 300, 275, 411, 263]]


class ProposeStream:
    """One Propose bidi stream (sequences live as long as their stream)."""

    def __init__(self, stub) -> None:
        self._requests: queue.Queue = queue.Queue()
        self._responses = stub.Propose(iter(self._requests.get, None))

    def exchange(self, *updates: pb.SequenceUpdate) -> list[pb.Draft]:
        self._requests.put(pb.ProposeRequest(sequences=list(updates)))
        return list(next(self._responses).drafts)

    def close(self) -> None:
        self._requests.put(None)


@pytest.fixture(scope="module")
def served(stories_path, tmp_path_factory):
    """A proposer process serving eagle3 (head written by the test) and mtp
    (the MTP layer of a copy of stories260K written by the test), and ngram."""
    root = tmp_path_factory.mktemp("heads")
    head = write_eagle3_head(root / "eagle3", Path(stories_path), LAYERS)
    target = write_mtp_target(root / "target-mtp", Path(stories_path))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "proposer", "--methods", "eagle3,mtp,ngram",
                             "--eagle3", str(head), "--target-model", str(target), "--port", str(port)])
    try:
        wait_serving(f"127.0.0.1:{port}", proc, 180, "proposer")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield {"stub": pb_grpc.ProposerStub(channel), "head": head, "proc": proc}
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def scorer(stories_path):
    """A scorer process on stories260K (the test plays the gateway between it and the proposer)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "scorer", "--model", stories_path,
                             "--kv-tokens", "16384", "--port", str(port)])
    try:
        wait_serving(f"127.0.0.1:{port}", proc, 180, "scorer")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield pb_grpc.ScorerStub(channel)
    finally:
        proc.terminate()
        proc.wait(30)


def _open(seq_id: str, prompt: list[int], k: int, **options) -> pb.SequenceUpdate:
    options.setdefault("min_token_prob", 0.0)  # random heads are unsure: keep every draft
    return pb.SequenceUpdate(seq_id=seq_id, open=True, token_ids=prompt, context_len=len(prompt),
                             num_speculative_tokens=k, options=pb.ProposerOptions(**options))


def _features(target, context: list[int], layers: list[int], start: int) -> pb.Features:
    """The features of positions start .. len(context) - 2, as the gateway relays them."""
    rows = target_features(target, context, layers)[start:len(context) - 1]
    return pb.Features(start=start, rows=len(rows), dim=rows.shape[1], data=bf16_bytes(rows))


@torch.inference_mode()
def _verify_greedy(target, context: list[int], draft: list[int]) -> list[int]:
    """Output tokens of a greedy verification: the drafts the target agrees
    with, then its own next token."""
    pred = target(torch.tensor([context + draft])).logits[0, len(context) - 1:].argmax(-1).tolist()
    accepted = 0
    while accepted < len(draft) and draft[accepted] == pred[accepted]:
        accepted += 1
    return draft[:accepted] + [pred[accepted]]


def _play(stream: ProposeStream, target, seq_id: str, prompt: list[int], k: int, rounds: int,
          layers: list[int], **options) -> list[pb.Draft]:
    """Rounds of propose -> greedy verify -> relay (tokens and features);
    the drafts of every round after the first (which has no features yet)."""
    (first,) = stream.exchange(_open(seq_id, prompt, k, **options))
    assert first.status == pb.SEQUENCE_STATUS_OK, first.message
    assert list(first.feature_layers) == layers and first.features_from == 0
    assert len(first.token_ids) == 0  # no features yet: no drafts
    context, draft, drafts = list(prompt), [], []
    for _ in range(rounds):
        out = _verify_greedy(target, context, draft)
        have = drafts[-1].features_from if drafts else 0
        context += out
        update = pb.SequenceUpdate(seq_id=seq_id, token_ids=out, context_len=len(context),
                                   num_speculative_tokens=k, features=_features(target, context, layers, have))
        (d,) = stream.exchange(update)
        assert d.status == pb.SEQUENCE_STATUS_OK, d.message
        assert d.features_from == len(context) - 1  # holds features up to context_len - 2
        drafts.append(d)
        draft = list(d.token_ids)
    return drafts


def test_a_random_eagle3_head_in_the_public_layout_serves_well_formed_deterministic_drafts(served, target):
    for prompt in PROMPTS:
        runs = []
        for attempt in range(2):
            stream = ProposeStream(served["stub"])
            runs.append(_play(stream, target, f"e{attempt}", prompt, 4, 4, LAYERS, method="eagle3"))
            stream.close()
        for d in runs[0]:
            assert len(d.token_ids) == 4 and all(0 <= t < 512 for t in d.token_ids)
            # greedy drafts carry the head's own top-K (its confidence, for the adaptive draft length):
            # each draft token is the most probable there
            assert len(d.probs) == 4
            assert all(sp.probs[list(sp.token_ids).index(t)] == max(sp.probs) for t, sp in zip(d.token_ids, d.probs))
        assert [list(d.token_ids) for d in runs[0]] == [list(d.token_ids) for d in runs[1]]


def test_a_sequence_opened_on_the_whole_context_drafts_what_the_incremental_one_does(served, target):
    """KV catch-up: features relayed round by round give the drafts that one
    open with every feature at once gives."""
    stream = ProposeStream(served["stub"])
    prompt = PROMPTS[0]
    drafts = _play(stream, target, "inc", prompt, 3, 3, LAYERS, method="eagle3")
    context = list(prompt)
    draft: list[int] = []
    for d in [None, *drafts[:-1]]:
        context += _verify_greedy(target, context, list(d.token_ids) if d else draft)
    fresh = _open("fresh", context, 3, method="eagle3")
    fresh.features.CopyFrom(_features(target, context, LAYERS, 0))
    (got,) = stream.exchange(fresh)
    assert list(got.token_ids) == list(drafts[-1].token_ids)
    stream.close()


def test_sampled_drafts_carry_sparse_q_over_target_ids_and_follow_the_seed(served, target):
    d2t = load_file(str(served["head"] / "model.safetensors"))["d2t"]
    hot = set((torch.arange(len(d2t)) + d2t).tolist())  # the target ids the head can draft
    runs = {}
    for seed in (5, 5, 6):
        stream = ProposeStream(served["stub"])
        runs.setdefault(seed, []).append(_play(stream, target, f"s{seed}", PROMPTS[1], 4, 3, LAYERS,
                                               method="eagle3", temperature=0.8, seed=seed))
        stream.close()
    for d in runs[5][0]:
        assert len(d.probs) == len(d.token_ids) == 4
        for tok, sp in zip(d.token_ids, d.probs):
            assert tok in sp.token_ids and set(sp.token_ids) <= hot and len(sp.token_ids) == 8
            assert sum(sp.probs) <= 1 + 1e-5 and min(sp.probs) > 0
    same = [[list(d.token_ids) for d in run] for run in runs[5]]
    assert same[0] == same[1]
    assert same[0] != [list(d.token_ids) for d in runs[6][0]]


def test_a_random_mtp_layer_in_the_target_checkpoint_serves(served, target):
    stream = ProposeStream(served["stub"])
    drafts = _play(stream, target, "m", PROMPTS[0], 3, 3, [5], method="mtp")
    assert all(len(d.token_ids) == 3 and all(0 <= t < 512 for t in d.token_ids) for d in drafts)
    stream.close()


def test_bad_options_and_malformed_features_are_invalid_naming_the_field(served, target):
    stream = ProposeStream(served["stub"])
    prompt = PROMPTS[0]
    good = _features(target, prompt, LAYERS, 0)
    (d,) = stream.exchange(_open("x", prompt, 2, method="eagle4"))
    assert d.status == pb.SEQUENCE_STATUS_INVALID and "options.method" in d.message
    cases = {
        "features.dim": pb.Features(start=0, rows=good.rows, dim=good.dim - 1, data=good.data),
        "features.data": pb.Features(start=0, rows=good.rows, dim=good.dim, data=good.data[:-2]),
        "features.start": pb.Features(start=3, rows=1, dim=good.dim, data=good.data[:2 * good.dim]),
        "features.rows": pb.Features(start=0, rows=len(prompt) + 1, dim=good.dim,
                                     data=good.data + bytes(4 * good.dim)),
    }
    nan = np.frombuffer(good.data, dtype="<u2").copy()
    nan[0] = 0x7FC0  # bfloat16 NaN
    cases["features.data: non-finite"] = pb.Features(start=0, rows=good.rows, dim=good.dim, data=nan.tobytes())
    for i, (field, features) in enumerate(cases.items()):
        update = _open(f"bad{i}", prompt, 2, method="eagle3")
        if field == "features.start":  # a gap after rows already held
            (ok,) = stream.exchange(_open(f"bad{i}", prompt, 0, method="eagle3"))
            first = pb.Features(start=0, rows=1, dim=good.dim, data=good.data[:2 * good.dim])
            stream.exchange(pb.SequenceUpdate(seq_id=f"bad{i}", features=first))
            update = pb.SequenceUpdate(seq_id=f"bad{i}", num_speculative_tokens=2)
        update.features.CopyFrom(features)
        (d,) = stream.exchange(update)
        assert d.status == pb.SEQUENCE_STATUS_INVALID and field in d.message, (field, d.message)
    ngram = _open("ng", prompt, 2, method="ngram")
    ngram.features.CopyFrom(good)
    (d,) = stream.exchange(ngram)
    assert d.status == pb.SEQUENCE_STATUS_INVALID and "features" in d.message
    # the others are still served
    drafts = _play(stream, target, "after", prompt, 2, 1, LAYERS, method="eagle3")
    assert len(drafts[0].token_ids) == 2
    stream.close()


def _sample_two(proposer_stub, scorer, target, prompt: list[int], seed: int, k: int = 4) -> tuple[list[int], int]:
    """Two output tokens through propose -> verify (rejection sampling)
    rounds with eagle3 drafts sampled at the request temperature; the
    prompt's features go with the open. Returns (tokens, drafts verified)."""
    seq_id, stream = f"t{seed}", ProposeStream(proposer_stub)
    update = _open(seq_id, prompt, k, method="eagle3", temperature=TEMPERATURE, seed=seed)
    update.features.CopyFrom(_features(target, prompt, LAYERS, 0))
    tokens: list[int] = []
    drafted = 0
    while len(tokens) < 2:
        (draft,) = stream.exchange(update)
        assert draft.status == pb.SEQUENCE_STATUS_OK and len(draft.probs) == len(draft.token_ids) > 0, draft.message
        v = pb.VerifySequence(seq_id=seq_id, context_len=len(prompt) + len(tokens), draft_token_ids=draft.token_ids,
                              draft_probs=draft.probs, verify_strategy=pb.VERIFY_STRATEGY_REJECTION)
        v.sampling.temperature, v.sampling.top_k, v.sampling.seed = TEMPERATURE, TOP_K, seed
        if not tokens:
            v.context_token_ids.extend(prompt)
        result = scorer.Verify(pb.VerifyRequest(sequences=[v])).results[0]
        assert result.status == pb.SEQUENCE_STATUS_OK, result.message
        out = list(result.output_token_ids)
        context = prompt + tokens + out
        update = pb.SequenceUpdate(seq_id=seq_id, token_ids=out, context_len=len(context), num_speculative_tokens=k,
                                   features=_features(target, context, LAYERS, draft.features_from))
        tokens, drafted = tokens + out, drafted + len(draft.token_ids)
    stream.close()
    scorer.Release(pb.ReleaseRequest(seq_ids=[seq_id]))
    return tokens[:2], drafted


def _sampling_check(served, scorer, target, stories_path, n: int) -> None:
    from transformers import AutoTokenizer

    prompt = list(AutoTokenizer.from_pretrained(stories_path)(REPEATING_PROMPT)["input_ids"])
    joint = _exact_joint(stories_path, prompt)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda s: _sample_two(served["stub"], scorer, target, prompt, s),
                                range(30_000, 30_000 + n)))
    assert sum(r[1] for r in results) > 0
    for i, p in enumerate((_marginal(joint, 0), _marginal(joint, 1))):
        assert chi_square_p_value(Counter(r[0][i] for r in results), p, n) > 1e-3
    assert _sample_two(served["stub"], scorer, target, prompt, 30_000) == results[0]  # a seed reproduces


def test_sampled_eagle3_drafts_with_sparse_q_keep_the_target_distribution(served, scorer, target, stories_path):
    _sampling_check(served, scorer, target, stories_path, n=300)


@pytest.mark.slow
def test_sampled_eagle3_drafts_distribution_many_samples(served, scorer, target, stories_path):
    _sampling_check(served, scorer, target, stories_path, n=3000)
