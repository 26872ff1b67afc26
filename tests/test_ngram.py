"""N-gram (prompt lookup) proposer: matching rules, reference drafting, state."""
import numpy as np
import pytest

from specdec.limits import MAX_SPECULATIVE_TOKENS
from specdec.proposer_svc.base import SeqOptions, UnknownSequence
from specdec.proposer_svc.ngram import NgramProposer


def _arr(tokens):
    return np.asarray(tokens, dtype=np.int32)


def _draft(context, k=8, min_n=1, max_n=4, reference=()):
    prop = NgramProposer()
    opts = SeqOptions(min_n=min_n, max_n=max_n, reference_token_ids=_arr(reference))
    prop.start("s", _arr(context), opts)
    (draft,) = prop.propose([("s", k)])
    assert draft.token_ids.dtype == np.int32 and not draft.probs
    return draft.token_ids.tolist()


def _brute_force(context, reference, min_n, max_n, k):
    """Obviously-correct restatement of the rule, for random cross-checks."""
    for n in range(min(max_n, len(context)), min_n - 1, -1):
        tail = context[len(context) - n:]
        for source in (context, reference):
            ends = [e for e in range(n - 1, len(source) - 1) if source[e - n + 1:e + 1] == tail]
            if ends:
                return source[ends[-1] + 1:ends[-1] + 1 + k]
    return []


def test_most_recent_occurrence_wins():
    # "1 2" occurs twice before the tail: followed by 3 and then by 4.
    assert _draft([1, 2, 3, 9, 1, 2, 4, 9, 1, 2], k=1, max_n=2) == [4]


def test_largest_n_wins_over_more_recent_shorter_match():
    # tail "7 1 2": the 3-gram occurs early (-> 5), "1 2" alone later (-> 6).
    context = [7, 1, 2, 5, 0, 1, 2, 6, 0, 7, 1, 2]
    assert _draft(context, k=1, max_n=3) == [5]
    assert _draft(context, k=1, max_n=2) == [6]


def test_min_n_rejects_short_matches():
    context = [5, 1, 8, 2, 3, 1]  # only the 1-gram "1" matches
    assert _draft(context, k=2, min_n=1, max_n=3) == [8, 2]
    assert _draft(context, k=2, min_n=2, max_n=3) == []


def test_k_caps_and_end_of_context_stops_draft():
    context = [1, 2, 3, 4, 5, 6, 1, 2]
    assert _draft(context, k=3, max_n=2) == [3, 4, 5]
    # tail "6 1" -> follows occurrence at the very end: only one token left
    assert _draft([3, 6, 1, 4, 6, 1], k=5, max_n=2) == [4, 6, 1]
    assert _draft([4, 4, 4], k=5, max_n=2) == [4]


def test_overlapping_repeat_is_a_match():
    # the most recent "4 4" ends one before the tail: it is followed by one 4
    assert _draft([1, 4, 4, 4], k=3, max_n=2) == [4]


def test_no_match_and_tiny_contexts():
    assert _draft([1, 2, 3, 4]) == []
    assert _draft([7]) == []
    assert _draft([]) == []


def test_k_zero_and_the_draft_budget_cap():
    assert _draft([1, 2, 1], k=0) == []
    prop = NgramProposer()
    context = list(range(2, 40)) + [2]  # the match of "2" is followed by 38 tokens
    prop.start("s", _arr(context), SeqOptions())
    assert prop.propose([("s", 40)])[0].token_ids.tolist() == list(range(3, 3 + MAX_SPECULATIVE_TOKENS))


def test_reference_drafts_when_context_has_no_match():
    reference = [10, 11, 12, 13, 14, 15]
    assert _draft([1, 2, 11, 12], k=3, reference=reference) == [13, 14, 15]
    assert _draft([1, 2, 11, 12], k=3) == []


def test_context_beats_reference_at_equal_n_but_not_longer_reference_match():
    # equal n (2): the context's own continuation (5) wins
    assert _draft([3, 4, 5, 3, 4], k=1, max_n=2, reference=[3, 4, 9]) == [5]
    # the reference matches 3 tokens, the context only 2: reference wins
    assert _draft([3, 4, 5, 2, 3, 4], k=1, max_n=3, reference=[2, 3, 4, 9]) == [9]


def test_matches_brute_force_on_random_streams():
    rng = np.random.default_rng(0)
    prop = NgramProposer()
    for trial in range(300):
        vocab = int(rng.integers(2, 6))
        context = rng.integers(0, vocab, int(rng.integers(0, 40))).tolist()
        reference = rng.integers(0, vocab, int(rng.integers(0, 20))).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 6))
        k = int(rng.integers(1, 8))
        prop.start("s", _arr(context), SeqOptions(min_n=min_n, max_n=max_n,
                                                   reference_token_ids=_arr(reference)))
        got = prop.propose([("s", k)])[0].token_ids.tolist()
        assert got == _brute_force(context, reference, min_n, max_n, k), trial


def test_incremental_extend_equals_fresh_start():
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 4, 60).astype(np.int32)
    inc, fresh = NgramProposer(), NgramProposer()
    inc.start("a", tokens[:5], SeqOptions())
    pos = 5
    while pos < len(tokens):
        step = int(rng.integers(1, 5))
        inc.extend("a", tokens[pos:pos + step])
        pos = min(pos + step, len(tokens))
        fresh.start("a", tokens[:pos], SeqOptions())
        assert inc.context_len("a") == pos
        assert (inc.propose([("a", 5)])[0].token_ids.tolist()
                == fresh.propose([("a", 5)])[0].token_ids.tolist())


def test_batch_of_sequences_and_lifecycle():
    prop = NgramProposer()
    prop.start("a", _arr([1, 2, 3, 1]), SeqOptions())
    prop.start("b", _arr([5, 6, 5]), SeqOptions())
    drafts = prop.propose([("a", 2), ("b", 2)])
    assert [d.token_ids.tolist() for d in drafts] == [[2, 3], [6, 5]]
    assert prop.stats()["live_sequences"] == 2
    prop.stop("a", completed=True)
    prop.stop("a", completed=True)  # unknown ids are ignored
    with pytest.raises(UnknownSequence):
        prop.propose([("a", 2)])
    with pytest.raises(UnknownSequence):
        prop.extend("a", _arr([1]))
    with pytest.raises(UnknownSequence):
        prop.context_len("a")
    assert prop.stats()["live_sequences"] == 1
