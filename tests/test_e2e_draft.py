"""Model drafts end to end on stories260K, real processes over gRPC: the
``draft`` and ``draft_hybrid`` methods never change greedy output, the target
as its own draft accepts every draft (KV catch-up and rollback are right), a
weak draft is often rejected and still changes nothing, sampled drafts with
sparse q keep the target's distribution, and a draft with another tokenizer
is refused at start."""
from __future__ import annotations

import queue
import shutil
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import hf_greedy, hf_model, start_stack
from test_e2e_sampling import PROMPT as REPEATING_PROMPT
from test_e2e_sampling import TEMPERATURE, TOP_K, _exact_joint, _marginal, chi_square_p_value

from specdec.client import make_request, stream
from specdec.protos.v1 import specdec_pb2 as pb
from specdec.protos.v1 import specdec_pb2_grpc as pb_grpc

PROMPTS = ["Once upon a time", "Tom and Lily went to the park. They saw a big", "The cat"]
MAX_TOKENS = 40
#: every draft token verified (no confidence cut, no cost-based trimming)
FULL_DRAFTS = dict(min_token_prob=0.0, draft_length=pb.DRAFT_LENGTH_FIXED)


def make_weak_draft(target: str, out: Path, keep_layers: int = 2) -> str:
    """A copy of the target keeping its first ``keep_layers`` layers (same
    tokenizer, much worse predictions)."""
    model, _ = hf_model(target)
    import copy

    weak = copy.deepcopy(model)
    weak.model.layers = weak.model.layers[:keep_layers]
    weak.config.num_hidden_layers = keep_layers
    weak.save_pretrained(out)
    for f in Path(target).iterdir():
        if f.name.startswith("tokenizer") or f.name == "generation_config.json":
            shutil.copy(f, out / f.name)
    return str(out)


@pytest.fixture(scope="module")
def self_draft_stack(stories_path, tmp_path_factory):
    stack = start_stack(stories_path, tmp_path_factory, "selfdraft", methods="draft,draft_hybrid",
                        default_method="draft", draft_model=stories_path)
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def weak_draft_stack(stories_path, tmp_path_factory):
    weak = make_weak_draft(stories_path, tmp_path_factory.mktemp("weak-draft"))
    stack = start_stack(stories_path, tmp_path_factory, "weakdraft", methods="ngram,draft,draft_hybrid",
                        default_method="draft", draft_model=weak)
    yield stack
    stack.stop()


def _prompt_ids(path: str, text: str) -> list[int]:
    return list(hf_model(path)[1](text)["input_ids"])


@pytest.mark.parametrize("k", [1, 3, 8])
def test_target_as_its_own_draft_accepts_every_draft(self_draft_stack, stories_path, k):
    for text in PROMPTS:
        ids = _prompt_ids(stories_path, text)
        gen = stream(self_draft_stack.gateway_addr, make_request(
            ids, max_tokens=MAX_TOKENS, method="draft", k=k, **FULL_DRAFTS))
        assert gen.token_ids == hf_greedy(stories_path, tuple(ids), MAX_TOKENS)[:len(gen.token_ids)]
        s = gen.stats
        assert s.draft_tokens > 0 and s.accepted_tokens == s.draft_tokens, (text, k, s)
        # every round but the last (cut by max_tokens or EOS) yields k+1 tokens
        assert s.rounds <= -(-len(gen.token_ids) // (k + 1)) + 1


@pytest.mark.parametrize("method", ["draft", "draft_hybrid"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_weak_draft_greedy_output_is_plain_greedy(weak_draft_stack, stories_path, method, k):
    drafted = accepted = 0
    for text in PROMPTS:
        ids = _prompt_ids(stories_path, text)
        gen = stream(weak_draft_stack.gateway_addr, make_request(
            ids, max_tokens=MAX_TOKENS, method=method, k=k, **FULL_DRAFTS))
        assert gen.token_ids == hf_greedy(stories_path, tuple(ids), MAX_TOKENS)[:len(gen.token_ids)]
        assert len(gen.token_ids) > 5
        drafted, accepted = drafted + gen.stats.draft_tokens, accepted + gen.stats.accepted_tokens
    assert drafted > 0 and accepted < drafted  # the weak draft really is rejected sometimes


def test_a_draft_model_gets_a_proposer_process_of_its_own(weak_draft_stack, stories_path):
    """What `specdec serve --draft-model` starts: the copying methods on the
    usual proposer, draft and draft_hybrid on a draft proposer process (the
    only one that loads the draft); both serve through the gateway."""
    proposers = {s.name: s.cmd for s in weak_draft_stack.by_name("proposer")}
    assert set(proposers) == {"proposer0", "proposer-draft"}
    assert "--draft-model" not in proposers["proposer0"]
    assert proposers["proposer0"][proposers["proposer0"].index("--methods") + 1] == "ngram"
    draft_cmd = proposers["proposer-draft"]
    assert draft_cmd[draft_cmd.index("--methods") + 1] == "draft,draft_hybrid" and "--draft-model" in draft_cmd
    # ngram copies: a prompt that repeats itself (on one that does not, it has next to nothing to draft, and
    # nothing at all where the gateway drafts ahead: a draft ahead holds only where its first token is right)
    for method, prompt in (("ngram", "Tom saw a big dog. The dog was happy. Tom saw a big dog. The"),
                           ("draft", PROMPTS[0])):
        ids = _prompt_ids(stories_path, prompt)
        gen = stream(weak_draft_stack.gateway_addr, make_request(ids, max_tokens=MAX_TOKENS, method=method, k=3,
                                                                 draft_length=pb.DRAFT_LENGTH_FIXED))
        assert gen.token_ids == hf_greedy(stories_path, tuple(ids), MAX_TOKENS)[:len(gen.token_ids)]
        assert gen.stats.draft_tokens > 0, method


def test_adaptive_length_cuts_unconfident_drafts(weak_draft_stack, stories_path):
    """With the default min_token_prob the weak draft proposes fewer tokens
    than with the cut off, and output is still plain greedy."""
    ids = _prompt_ids(stories_path, PROMPTS[1])
    full = stream(weak_draft_stack.gateway_addr, make_request(ids, max_tokens=MAX_TOKENS, method="draft", k=8,
                                                              **FULL_DRAFTS))
    cut = stream(weak_draft_stack.gateway_addr, make_request(ids, max_tokens=MAX_TOKENS, method="draft", k=8,
                                                             min_token_prob=0.5,
                                                             draft_length=pb.DRAFT_LENGTH_FIXED))
    assert cut.token_ids == full.token_ids
    assert cut.stats.draft_tokens / cut.stats.rounds < full.stats.draft_tokens / full.stats.rounds


@pytest.mark.parametrize("method", ["draft", "draft_hybrid"])
def test_planned_budgets_of_zero_decode_like_plain_and_change_no_token(weak_draft_stack, stories_path, method):
    """The gateway's loop against the real scorer and draft proposer, with a
    draft step made (on paper) far dearer than a Verify: adaptive draft
    sequences are asked for nothing (DraftBudgets), decode several tokens
    per Verify, draft only in the exploration rounds, and every output is
    plain greedy decoding of the target. draft_hybrid sequences keep their
    whole budget for copies, their model asked for nothing
    (SequenceUpdate.model_steps) but in the exploration rounds, and those
    copies gated as a copy method's (CopyGates: where they do not pay either,
    nothing is asked)."""
    from dear_drafts import run_dear_drafts

    from specdec.gateway import metrics
    from specdec.gateway.costs import DraftBudgets
    from specdec.models import load_tokenizer, resolve_model

    scorer = weak_draft_stack.by_name("scorer")[0].addr
    proposer = weak_draft_stack.by_name("proposer-draft")[0].addr
    requests = {text: make_request(_prompt_ids(stories_path, text), max_tokens=MAX_TOKENS, method=method, k=4,
                                   min_token_prob=0.0, draft_length=pb.DRAFT_LENGTH_ADAPTIVE) for text in PROMPTS}
    run = run_dear_drafts(scorer, proposer, method, requests, load_tokenizer(resolve_model(stories_path)))
    seqs, model_drafts, messages = run.seqs, run.model_drafts, run.messages
    for seq in seqs:
        ids = tuple(seq.tokens[:seq.num_prompt])
        assert seq.tokens[seq.num_prompt:] == hf_greedy(stories_path, ids, MAX_TOKENS)
    assert metrics.PLANNED_DRAFT_STEPS.labels(proposer)._value.get() in (0, 1)
    drafted = sum(s.stats.draft_tokens for s in seqs)
    # the model drafts in the first round (its whole budget: no history yet), then one token every
    # EXPLORE_EVERY-th round
    if method == "draft":  # the rounds between decode several tokens per Verify
        assert 0 < sum(model_drafts.values()) <= len(seqs) * (1 + MAX_TOKENS // DraftBudgets.EXPLORE_EVERY)
        assert 0 < drafted <= len(seqs) * (4 + MAX_TOKENS // DraftBudgets.EXPLORE_EVERY)
        assert all(s.planned_budget in (0, 1) for s in seqs)
        # and send the proposer nothing: their tokens go with the next message that asks for a draft (an
        # open, explorations; a message a round would be at least MAX_TOKENS / 4 per sequence)
        sent = len(messages)
        assert sent <= len(seqs) * (2 + MAX_TOKENS // DraftBudgets.EXPLORE_EVERY) < len(seqs) * MAX_TOKENS / 4
    else:  # the copies keep the whole budget (n-gram copies of one token: nearly every round has one) where
        # their gate lets them ask; the model drafts by copying only while it is planned no step
        assert all(s.planned_model_steps in (0, 1) for s in seqs)
        assert all(s.planned_budget is None or (s.planned_budget == 0 and s.drafts_by_copying) for s in seqs)
        assert drafted > sum(model_drafts.values())


def test_concurrent_streams_equal_solo_runs(weak_draft_stack, stories_path):
    reqs = [make_request(_prompt_ids(stories_path, t), max_tokens=MAX_TOKENS, method=m, k=4)
            for t in PROMPTS for m in ("draft", "draft_hybrid")]
    solo = [stream(weak_draft_stack.gateway_addr, r).token_ids for r in reqs]
    with ThreadPoolExecutor(len(reqs)) as pool:
        together = list(pool.map(lambda r: stream(weak_draft_stack.gateway_addr, r).token_ids, reqs))
    assert together == solo


def test_hybrid_prefers_copies_on_copy_work(weak_draft_stack, stories_path):
    """On a prompt that repeats itself the copy drafts win often enough that
    draft_hybrid accepts more than the weak draft alone."""
    ids = _prompt_ids(stories_path, REPEATING_PROMPT + " girl named Lily. Once upon a time, there was a")
    runs = {m: stream(weak_draft_stack.gateway_addr, make_request(ids, max_tokens=MAX_TOKENS, method=m, k=6,
                                                                  **FULL_DRAFTS))
            for m in ("draft", "draft_hybrid")}
    assert runs["draft"].token_ids == runs["draft_hybrid"].token_ids
    assert runs["draft_hybrid"].stats.accepted_tokens >= runs["draft"].stats.accepted_tokens


# ------------------------------------------------------------ sparse-q sampling

class _ProposeStream:
    """One Propose bidi stream (sequences live as long as their stream)."""

    def __init__(self, stub) -> None:
        self._requests: queue.Queue = queue.Queue()
        self._responses = stub.Propose(iter(self._requests.get, None))

    def exchange(self, request: pb.ProposeRequest) -> pb.ProposeResponse:
        self._requests.put(request)
        return next(self._responses)

    def close(self) -> None:
        self._requests.put(None)


def _sample_round(proposer, scorer, prompt_ids: list[int], seed: int, k: int = 4) -> tuple[list[int], int, int]:
    """Two output tokens through propose -> verify rounds driven directly
    (the gateway does not yet send the request's temperature to proposers):
    the proposer samples drafts with sparse q, the scorer verifies them by
    rejection sampling. Returns (tokens, drafts, accepted)."""
    seq_id = f"s{seed}"
    tokens: list[int] = []
    drafted = accepted = 0
    opened, known = False, 0  # known: output tokens the proposer has been sent
    propose = _ProposeStream(proposer)
    while len(tokens) < 2:
        update = pb.SequenceUpdate(seq_id=seq_id, context_len=len(prompt_ids) + len(tokens),
                                   num_speculative_tokens=k)
        if not opened:
            update.open = True
            update.token_ids.extend(prompt_ids)
            update.options.CopyFrom(pb.ProposerOptions(method="draft", temperature=TEMPERATURE, seed=seed))
        else:
            update.token_ids.extend(tokens[known:])
        draft = propose.exchange(pb.ProposeRequest(sequences=[update])).drafts[0]
        assert draft.status == pb.SEQUENCE_STATUS_OK, draft.message
        assert len(draft.probs) == len(draft.token_ids) > 0
        for tok, sp in zip(draft.token_ids, draft.probs):
            assert tok in sp.token_ids and abs(sum(sp.probs) - 1) < 1e-5 and len(sp.token_ids) > 1
        v = pb.VerifySequence(seq_id=seq_id, context_len=len(prompt_ids) + len(tokens),
                              draft_token_ids=draft.token_ids, draft_probs=draft.probs,
                              verify_strategy=pb.VERIFY_STRATEGY_REJECTION)
        v.sampling.temperature, v.sampling.top_k, v.sampling.seed = TEMPERATURE, TOP_K, seed
        if not opened:
            v.context_token_ids.extend(prompt_ids)
        result = scorer.Verify(pb.VerifyRequest(sequences=[v])).results[0]
        assert result.status == pb.SEQUENCE_STATUS_OK, result.message
        opened, known = True, len(tokens)
        tokens += list(result.output_token_ids)
        drafted, accepted = drafted + len(draft.token_ids), accepted + result.num_accepted
    propose.close()
    scorer.Release(pb.ReleaseRequest(seq_ids=[seq_id]))
    return tokens[:2], drafted, accepted


def _sampling_check(stack, stories_path, n: int) -> None:
    prompt_ids = _prompt_ids(stories_path, REPEATING_PROMPT)
    joint = _exact_joint(stories_path, prompt_ids)
    p1, p2 = _marginal(joint, 0), _marginal(joint, 1)
    proposer_addr = stack.by_name("proposer-draft")[0].addr
    scorer_addr = stack.by_name("scorer")[0].addr
    with grpc.insecure_channel(proposer_addr) as pc, grpc.insecure_channel(scorer_addr) as sc:
        proposer, scorer = pb_grpc.ProposerStub(pc), pb_grpc.ScorerStub(sc)
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda s: _sample_round(proposer, scorer, prompt_ids, s),
                                    range(20_000, 20_000 + n)))
    drafted = sum(r[1] for r in results)
    accepted = sum(r[2] for r in results)
    assert 0 < accepted < drafted  # sampled drafts were verified, some rejected
    assert chi_square_p_value(Counter(r[0][0] for r in results), p1, n) > 1e-3
    assert chi_square_p_value(Counter(r[0][1] for r in results), p2, n) > 1e-3
    # a seed reproduces its drafts and its output
    with grpc.insecure_channel(proposer_addr) as pc, grpc.insecure_channel(scorer_addr) as sc:
        again = _sample_round(pb_grpc.ProposerStub(pc), pb_grpc.ScorerStub(sc), prompt_ids, 20_000)
    assert again == results[0]


def test_sampled_drafts_with_sparse_q_keep_the_target_distribution(weak_draft_stack, stories_path):
    _sampling_check(weak_draft_stack, stories_path, n=300)


@pytest.mark.slow
def test_sampled_drafts_distribution_many_samples(weak_draft_stack, stories_path):
    _sampling_check(weak_draft_stack, stories_path, n=3000)


# ------------------------------------------------------------------- refusals

def _proposer_exit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdec.cli", "proposer", "--port", "0", *args],
                          capture_output=True, text=True, timeout=300)


def test_draft_with_another_tokenizer_is_refused_at_start(stories_path, smollm_path):
    done = _proposer_exit("--methods", "draft", "--draft-model", stories_path, "--target-model", smollm_path)
    assert done.returncode != 0
    assert "does not share the tokenizer" in done.stderr and "vocabulary size 512 (draft) vs 49152" in done.stderr


def test_draft_method_without_a_draft_model_is_refused():
    done = _proposer_exit("--methods", "ngram,draft")
    assert done.returncode != 0 and "--draft-model" in done.stderr


def test_bad_draft_options_are_invalid_naming_the_field(self_draft_stack):
    with grpc.insecure_channel(self_draft_stack.by_name("proposer-draft")[0].addr) as channel:
        stub = pb_grpc.ProposerStub(channel)
        bad = pb.SequenceUpdate(seq_id="bad", open=True, token_ids=[1, 2, 3], num_speculative_tokens=3,
                                options=pb.ProposerOptions(method="draft", temperature=-1.0))
        good = pb.SequenceUpdate(seq_id="good", open=True, token_ids=[1, 403, 261], num_speculative_tokens=3,
                                 options=pb.ProposerOptions(method="draft"))
        drafts = next(stub.Propose(iter([pb.ProposeRequest(sequences=[bad, good])]))).drafts
    assert drafts[0].status == pb.SEQUENCE_STATUS_INVALID and "options.temperature" in drafts[0].message
    assert drafts[1].status == pb.SEQUENCE_STATUS_OK and len(drafts[1].token_ids) > 0
    assert np.all(np.asarray(drafts[1].token_ids) < 512)


def test_draft_service_killed_mid_run_changes_nothing(weak_draft_stack, stories_path):
    """Runs last in this module (it kills the module stack's proposer)."""
    import threading

    ids = _prompt_ids(stories_path, PROMPTS[0])
    max_tokens = 120
    started = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(stream, weak_draft_stack.gateway_addr,
                             make_request(ids, max_tokens=max_tokens, method="draft", k=4),
                             600.0, lambda _: started.set())
        assert started.wait(120)
        weak_draft_stack.by_name("proposer-draft")[0].kill()
        gen = future.result()
    assert gen.token_ids == hf_greedy(stories_path, tuple(ids), max_tokens)[:len(gen.token_ids)]
    assert len(gen.token_ids) > 20
