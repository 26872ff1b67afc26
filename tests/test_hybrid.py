"""Hybrid proposer (n-gram + suffix, better expected acceptance wins), the
registry, and reference drafting on an edit-like task for every method."""
import numpy as np
import pytest

from specdec.proposer_svc.base import NaiveProposer, SeqOptions, UnknownSequence
from specdec.proposer_svc.hybrid import HybridConfig, HybridProposer, ngram_score
from specdec.proposer_svc.ngram import NgramProposer
from specdec.proposer_svc.registry import COPY_METHODS, MODEL_METHODS, build_proposers
from specdec.proposer_svc.suffix import SuffixConfig, SuffixProposer


def _arr(tokens):
    return np.asarray(tokens, dtype=np.int32)


def _draft(prop, seq_id="s", k=8):
    return prop.propose([(seq_id, k)])[0].token_ids.tolist()


def test_ngram_score_is_expected_accepted_tokens():
    assert ngram_score(0, 0.7) == 0.0
    assert ngram_score(3, 0.5) == pytest.approx(0.5 + 0.25 + 0.125)


def test_long_copy_beats_short_suffix_draft():
    # suffix: match "9" once -> at most 1 token (spec factor 1), score 1/2;
    # n-gram copies k tokens after the most recent "9"
    context = [9, 1, 2, 3, 4, 5, 9]
    prop = HybridProposer()
    prop.start("s", _arr(context), SeqOptions(min_n=1, max_n=2))
    assert _draft(prop, k=5) == [1, 2, 3, 4, 5]


def test_confident_suffix_draft_beats_recent_copy():
    prop = HybridProposer()
    for i in range(3):  # three finished outputs agree: "5 6" -> 7 8
        prop.start(f"old{i}", _arr([0]), SeqOptions())
        prop.extend(f"old{i}", _arr([5, 6, 7, 8]))
        prop.stop(f"old{i}", completed=True)
    prop.start("s", _arr([5, 6, 9, 5, 6]), SeqOptions(max_n=2))
    assert prop.ngram.propose([("s", 3)])[0].token_ids.tolist() == [9, 5, 6]
    # n-gram: 0.8 + 0.64 + 0.512 = 1.95 expected; suffix: 1 + 1 = 2
    assert _draft(prop, k=3) == [7, 8]


def test_suffix_fills_in_when_ngram_has_nothing():
    prop = HybridProposer()
    prop.start("old", _arr([0]), SeqOptions())
    prop.extend("old", _arr([40, 41, 42]))
    prop.stop("old", completed=True)
    prop.start("s", _arr([1, 40]), SeqOptions())
    assert _draft(prop) == [41]


def test_equal_expected_acceptance_goes_to_suffix():
    # n-gram: most recent "1" -> 3; suffix: most frequent "1" -> 2, p = 2/4
    context = [1, 2, 1, 2, 1, 3, 1]
    for q, expected in ((0.5, [2]), (0.6, [3])):
        prop = HybridProposer(HybridConfig(ngram_token_prob=q))
        prop.start("s", _arr(context), SeqOptions(max_n=1))
        assert _draft(prop, k=1) == expected, q


def test_invalid_token_prob_rejected():
    with pytest.raises(ValueError, match="ngram_token_prob"):
        HybridProposer(HybridConfig(ngram_token_prob=0.0))


def test_lifecycle_is_forwarded_to_both():
    prop = HybridProposer(HybridConfig(suffix=SuffixConfig(max_cached_requests=2)))
    prop.start("a", _arr([1, 2]), SeqOptions())
    prop.extend("a", _arr([3, 4]))
    assert prop.context_len("a") == 4 == prop.ngram.context_len("a")
    prop.stop("a", completed=True)
    stats = prop.stats()
    assert stats["cached_requests"] == 1 and stats["live_sequences"] == 0
    assert stats["memory_bytes"] > 0
    for call in (lambda: prop.propose([("a", 1)]), lambda: prop.extend("a", _arr([1])),
                 lambda: prop.context_len("a")):
        with pytest.raises(UnknownSequence):
            call()


def _count_accepted(draft, truth):
    accepted = 0
    for d, t in zip(draft, truth):
        if d != t:
            break
        accepted += 1
    return accepted


def simulate_edit_task(proposer_factory, use_reference, seed=0, k=6):
    """Greedy-like loop at the algorithm level: the target's continuation is a
    lightly edited copy of a reference; returns the accepted draft tokens."""
    rng = np.random.default_rng(seed)
    reference = rng.integers(100, 400, 300).astype(np.int32)
    target = reference.copy()
    for pos in rng.choice(len(target), 12, replace=False):
        target[pos] = rng.integers(400, 500)  # edits: tokens absent from the prompt
    prompt = rng.integers(0, 100, 40).astype(np.int32)
    prop = proposer_factory()
    opts = SeqOptions(reference_token_ids=reference if use_reference else _arr([]))
    prop.start("edit", prompt, opts)
    produced, accepted_total = 0, 0
    while produced < len(target):
        draft = prop.propose([("edit", k)])[0].token_ids.tolist()
        accepted = _count_accepted(draft, target[produced:].tolist())
        step = min(accepted + 1, len(target) - produced)  # + one target token
        prop.extend("edit", target[produced:produced + step])
        produced += step
        accepted_total += accepted
    return accepted_total


@pytest.mark.parametrize("factory", [NgramProposer, SuffixProposer, HybridProposer])
def test_reference_raises_acceptance_on_edit_task(factory):
    without = simulate_edit_task(factory, use_reference=False)
    with_ref = simulate_edit_task(factory, use_reference=True)
    assert without < 30 and with_ref > 150, (without, with_ref)


def test_registry_builds_every_copy_method():
    proposers = build_proposers(list(COPY_METHODS) + ["ngram"])
    assert list(proposers) == list(COPY_METHODS)
    for name, prop in proposers.items():
        assert prop.name == name
        prop.start("s", _arr([1, 2, 3, 1, 2]), SeqOptions())
        draft = _draft(prop, k=2)
        assert draft == ([] if isinstance(prop, NaiveProposer) else [3, 1])


def test_registry_refuses_model_methods_without_a_draft_model():
    for method in MODEL_METHODS:
        with pytest.raises(ValueError, match="--draft-model"):
            build_proposers(["ngram", method])


def test_registry_rejects_unknown_methods():
    with pytest.raises(ValueError, match="'eagle'"):
        build_proposers(["ngram", "eagle"])
