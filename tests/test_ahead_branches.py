"""Branches of drafts proposed ahead (RoundUpdates.branch_width,
``--ahead-branches``): where the round's outcome leaves a draft proposed
ahead, the next round takes the branch that the committed tokens follow
instead of going on without a draft.

- ``drafts.held_after``: the draft, a branch, or nothing;
- ``ngram_branches``: each branch is exactly the draft ngram makes after its
  token, the tokens chosen as its docstring says (a reference written out
  here);
- hybrid: its n-gram half's branches of the draft it kept;
- ``SuffixProposer.branches``: each branch is the draft a reference written
  out here makes (suffix_reference's trees, the branch's own occurrence
  counted), its tokens those that follow the tries' matches;
- ``SuffixProposer.ahead`` (RoundUpdates.ahead_ks): a draft ahead that ends
  within the round being verified goes on with the reference's draft after
  it; hybrid's too, ngram's stand;
- the proposer servicer: branches answered in entry order as columns, bad
  branch fields named;
- the gateway's wire: asked for only drafting ahead, for few sequences (the
  round's k with every draft ahead);
  parsed, a misfit refused;
- the loop (scripted proposer and scorer): a contradicted draft ahead is
  followed by its branch without waiting, and the output is lock-step's;
- real processes on stories260K (``--overlap ahead``, the proposer 1 ms slower;
  ngram, suffix and hybrid): greedy output equals transformers' at k in {1, 3, 8} in concurrent
  streams, and branches were verified.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import assert_same_as_greedy, hf_greedy, hf_model, start_stack
from test_overlap import (
    PROPOSER,
    SCORER,
    _Calls,
    _expected,
    _params,
    _prompt,
    _SlowProposer,
    _SlowScorer,
    _target,
    _Tokenizer,
)

from specdec.client import make_request, stream
from specdec.drafts import NO_BRANCHES, NO_DRAFT, Branches, Draft, held_after
from specdec.gateway import metrics
from specdec.gateway.discovery import ReplicaSet
from specdec.gateway.loop import LoopConfig, Overlap, SpecLoop
from specdec.gateway.sequence import Sequence
from specdec.gateway.wire import propose_request, proposer_answers
from specdec.limits import AHEAD_BRANCH_BUDGET, AHEAD_BRANCH_MAX_SEQUENCES, MAX_BRANCH_WIDTH
from specdec.proposer_svc.base import SeqOptions
from specdec.proposer_svc.hybrid import HybridProposer
from specdec.proposer_svc.ngram import NgramProposer, ngram_draft
from specdec.proposer_svc.registry import build_proposers
from specdec.proposer_svc.server import ProposerServicer
from specdec.proposer_svc.suffix import SuffixConfig, SuffixProposer
from specdec.proposer_svc.suffix_reference import (
    ReferenceSuffixProposer,
    RefNode,
    build_tree,
    draft_path,
    find_node,
    max_draft_len,
    speculate,
)
from specdec.protos.v1 import specdec_pb2 as pb


def _ids(*tokens: int) -> np.ndarray:
    return np.array(tokens, dtype=np.int32)


# ------------------------------------------------------------- held_after

def test_held_after_takes_the_draft_or_the_branch_the_committed_tokens_follow():
    draft = Draft(_ids(1, 2, 3, 4, 5))
    branches = Branches.of({(0, 9): [7, 8], (2, 6): [5, 4, 3], (5, 0): [11]})
    assert held_after(draft, branches, [1, 2]).token_ids.tolist() == [3, 4, 5]  # the draft holds
    assert held_after(draft, branches, [9]).token_ids.tolist() == [7, 8]  # left at position 0
    assert held_after(draft, branches, [1, 2, 6, 5]).token_ids.tolist() == [4, 3]  # the branch, past its first
    assert held_after(draft, branches, [1, 2, 3, 4, 5, 0]).token_ids.tolist() == [11]  # past the draft's end
    assert held_after(draft, branches, [1, 2, 6, 9]) is NO_DRAFT  # the branch contradicted too
    assert held_after(draft, branches, [1, 8]) is NO_DRAFT  # no branch there
    assert held_after(draft, NO_BRANCHES, [9]) is NO_DRAFT
    assert len(held_after(draft, branches, [9, 7, 8])) == 0  # nothing of the branch left


def test_branches_are_well_formed_within_the_budget_and_the_vocabulary():
    branches = Branches.of({(0, 9): [7, 8], (1, 3): [99, 5, 4]})
    assert branches.is_well_formed(3, 100) and NO_BRANCHES.is_well_formed(0, 1)
    assert not branches.is_well_formed(2, 100)  # a branch longer than the budget
    assert not branches.is_well_formed(3, 99)  # a token outside the vocabulary
    assert not Branches.of({(0, 1): [-1]}).is_well_formed(3, 100)


# ---------------------------------------------------------- ngram branches

def _reference_branches(context: list[int], draft: list[int], min_n: int, max_n: int, width: int, depth: int,
                        length: int) -> list[tuple[int, int, list[int]]]:
    """ngram_branches' docstring, written out: at each position j, the tokens
    that followed the earlier occurrences of the last n tokens (longest n
    first, most recent first), then the context's tokens by frequency (ties:
    the smaller id), skipping draft[j] and tokens with no draft after them."""
    out = []
    tokens, counts = np.unique(np.array(context, dtype=np.int32), return_counts=True)
    by_frequency = tokens[np.argsort(-counts, kind="stable")].tolist()
    for j in range(min(depth, len(draft)) + 1):
        text = context + draft[:j]
        h = len(text)
        candidates = [text[end + 1] for n in range(max_n - 1, max(min_n - 1, 1) - 1, -1)
                      for end in range(h - 2, n - 2, -1) if text[end - n + 1:end + 1] == text[h - n:]]
        if min_n <= 1:
            candidates += by_frequency
        chosen: list[int] = []
        for t in candidates:
            if len(chosen) == width or t in chosen or (j < len(draft) and t == draft[j]):
                continue
            buf = np.empty(length, dtype=np.int32)
            num = ngram_draft(np.array(text + [t], dtype=np.int32), np.zeros(0, dtype=np.int32), min_n, max_n,
                              length, buf)
            if num:
                chosen.append(t)
                out.append((j, t, buf[:num].tolist()))
    return out


@pytest.mark.parametrize("seed,min_n,width,depth", [(0, 1, 4, 3), (1, 1, 16, 5), (2, 2, 3, 2), (3, 3, 8, 4)])
def test_ngram_branches_are_the_drafts_ngram_makes_after_the_likeliest_tokens(seed, min_n, width, depth):
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(0, 40, size=int(rng.integers(2, 6))).tolist() for _ in range(6)]
    proposer = NgramProposer()
    checked = 0
    for s in range(6):
        context: list[int] = []
        while len(context) < 60 + 20 * s:
            context += phrases[int(rng.integers(6))] if rng.random() < 0.7 else [int(rng.integers(40))]
        seq_id = f"s{s}"
        proposer.start(seq_id, _ids(*context), SeqOptions(min_n=min_n, max_n=4))
        one = np.ones(1, dtype=np.int64)
        budget = 2 * depth + 1
        batch = proposer.advance([seq_id], _ids(), np.zeros(2, dtype=np.int64), one * 0, one * budget)
        made = proposer.branches([seq_id], batch.token_ids, batch.offsets, one * budget, one * depth, width)
        draft = batch.token_ids.tolist()
        got = [(int(made.positions[b]), int(made.tokens[b]), made.token_ids[made.starts[b]:made.starts[b + 1]].tolist())
               for b in range(made.offsets[0], made.offsets[1])]
        assert got == _reference_branches(context, draft, min_n, 4, width, depth, budget - depth - 1)
        checked += len(got)
    assert checked > 10  # branches were made, and compared


def test_ngram_branches_cover_a_token_that_only_a_branch_continues():
    """After "1 2 3 ... 1 2" the draft is 3 4; where the target writes 1 2 7 the
    context's "7 8 9" makes the branch (0, 7) -> 8 9."""
    proposer = NgramProposer()
    proposer.start("a", _ids(1, 2, 3, 4, 5, 7, 8, 9, 6, 1, 2), SeqOptions())
    one = np.ones(1, dtype=np.int64)
    batch = proposer.advance(["a"], _ids(), np.zeros(2, dtype=np.int64), one * 0, one * 5)
    made = proposer.branches(["a"], batch.token_ids, batch.offsets, one * 5, one * 2, 16)
    branches = Branches(made.positions, made.tokens, made.starts, made.token_ids)
    assert batch.token_ids.tolist() == [3, 4, 5, 7, 8]
    assert branches.find(0, 7).tolist() == [8, 9]
    assert branches.find(0, 3) is None  # the draft's own token
    assert held_after(Draft(batch.token_ids), branches, [7]).token_ids.tolist() == [8, 9]


def test_hybrid_answers_its_ngram_half_s_branches_of_the_draft_it_kept():
    """hybrid's branches of the draft it kept are the ones its n-gram matcher
    makes after each outcome of that draft, and there are some."""
    text = _ids(1, 2, 3, 4, 5, 7, 8, 9, 6, 1, 2, 3, 4, 5, 7, 8, 1, 2)
    hybrid, ngram = HybridProposer(), NgramProposer()
    hybrid.start("a", text, SeqOptions())
    ngram.start("a", text, SeqOptions())
    one = np.ones(1, dtype=np.int64)
    batch = hybrid.advance(["a"], _ids(), np.zeros(2, dtype=np.int64), one * 0, one * 6)
    assert len(batch.token_ids) > 2
    other = _ids(5, 7, 8, 1, 2, 3)  # a draft the n-gram half would not make (e.g. the suffix half's)
    bounds = np.array([0, len(other)], dtype=np.int64)
    for draft, offsets in ((batch.token_ids, batch.offsets), (other, bounds)):
        made = hybrid.branches(["a"], draft, offsets, one * 6, one * 2, 8)
        want = ngram.branches(["a"], draft, offsets, one * 6, one * 2, 8)
        assert len(made.positions) > 0
        for got, expected in zip((made.offsets, made.positions, made.tokens, made.starts, made.token_ids),
                                 (want.offsets, want.positions, want.tokens, want.starts, want.token_ids)):
            assert got.tolist() == expected.tolist()


# --------------------------------------------------------- suffix branches

def _suffix_draft_after(local: RefNode, glob: RefNode, text: list[int], depth: int, k: int) -> list[int]:
    """SuffixProposer.branches' draft after ``text`` (the context + a branch's
    tokens), written out over trees of the context (local) and of the cached
    outputs (glob): as suffix_reference.speculate, but a match in the local
    tree counts one more occurrence of itself, the branch's own (its
    first token's probability is count(child) / (count + 1))."""
    opts = SeqOptions()
    best: tuple[float, int, int] = (0.0, 0, 0)
    tokens: list[int] = []
    for m in range(1, min(depth, len(text)) + 1):
        node = find_node(local, text[len(text) - m:])
        if node is None:
            break
        found, score = draft_path(RefNode(node.count + 1, node.stamp, node.children),
                                  max_draft_len(m, k, opts.max_spec_factor), opts.min_token_prob)
        if found and (score, len(found), m) >= best:
            best, tokens = (score, len(found), m), found
    g_tokens, g_score = speculate(glob, text, depth, k, opts.max_spec_factor, opts.min_token_prob)
    return tokens if (best[0], len(tokens)) >= (g_score, len(g_tokens)) else g_tokens


def _following(trees: list[RefNode], text: list[int], depth: int) -> set[int]:
    """The tokens that follow the suffixes of text in the trees."""
    found: set[int] = set()
    for tree in trees:
        for m in range(1, min(depth, len(text)) + 1):
            node = find_node(tree, text[len(text) - m:])
            if node is None:
                break
            found |= set(node.children)
    return found


def _suffix_case(seed: int, cached: int, depth_tree: int) -> tuple[Callable[[int], list[int]], SuffixProposer, RefNode]:
    """Text of a few phrases over 40 tokens (text(n): at least n tokens of
    it), a SuffixProposer that cached ``cached`` finished outputs of it,
    and the reference's global tree of the same outputs."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(0, 40, size=int(rng.integers(2, 6))).tolist() for _ in range(6)]

    def text(n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            out += phrases[int(rng.integers(6))] if rng.random() < 0.7 else [int(rng.integers(40))]
        return out

    proposer = SuffixProposer(SuffixConfig(max_cached_requests=cached, max_tree_depth=depth_tree))
    reference = ReferenceSuffixProposer(cached, depth_tree)
    for q, output in enumerate([text(40) for _ in range(cached)]):
        for p in (proposer, reference):
            p.start(f"o{q}", _ids(*output[:5]), SeqOptions())
            p.extend(f"o{q}", _ids(*output[5:]))
            p.stop(f"o{q}", completed=True)
    return text, proposer, build_tree(list(reference._cached), depth_tree)


@pytest.mark.parametrize("cached", [0, 3])
def test_suffix_branches_are_the_drafts_suffix_makes_after_the_tokens_its_trees_follow_with(cached):
    """Each branch's draft is the one the docstring's written-out reference
    makes (the per-request trie of the context, the global trie of the
    cached outputs); with room for every candidate, the branches at
    position j are exactly the tokens that follow a match of the context +
    draft[:j] in either trie or occur in the context (but the draft's own)
    that a draft follows; with little room, at most ``width`` distinct ones
    of them."""
    depth_tree, checked = 16, 0
    for seed in range(8):
        text, proposer, glob = _suffix_case(seed, cached, depth_tree)
        context = text(60 + 4 * seed)
        proposer.start("a", _ids(*context), SeqOptions())
        local = build_tree([(context, 0)], depth_tree)
        one = np.ones(1, dtype=np.int64)
        depth, budget = 4, 9
        batch = proposer.advance(["a"], _ids(), np.zeros(2, dtype=np.int64), one * 0, one * budget)
        draft = batch.token_ids.tolist()
        for width in (64, 2):
            made = proposer.branches(["a"], batch.token_ids, batch.offsets, one * budget, one * depth, width)
            assert made.offsets.tolist() == [0, len(made.positions)]
            at: dict[int, list[int]] = {}
            for b in range(len(made.positions)):
                j, t = int(made.positions[b]), int(made.tokens[b])
                got = made.token_ids[made.starts[b]:made.starts[b + 1]].tolist()
                assert got == _suffix_draft_after(local, glob, context + draft[:j] + [t], depth_tree,
                                                  budget - depth - 1), (seed, j, t)
                at.setdefault(j, []).append(t)
                checked += 1
            for j in range(min(depth, len(draft)) + 1):
                candidates = {t for t in _following([local, glob], context + draft[:j], depth_tree) | set(context)
                              if (j == len(draft) or t != draft[j])
                              and _suffix_draft_after(local, glob, context + draft[:j] + [t], depth_tree,
                                                      budget - depth - 1)}
                chosen = at.get(j, [])
                assert len(chosen) == len(set(chosen)) <= width and set(chosen) <= candidates
                if width == 64:
                    assert set(chosen) == candidates, (seed, j)
    assert checked > 50  # branches were made, and compared


def test_suffix_branches_cover_a_token_that_only_a_branch_continues():
    """After "... 6 1 2" the draft is 3 4 5 (twice "1 2 3 4 5" before); where
    the target writes 1 2 7 the context's "1 2 7 8 9 6" makes the branch (0,
    7) -> 8 9 6, and past the draft's end its two continuations, by count."""
    proposer = SuffixProposer(SuffixConfig(max_cached_requests=0))
    proposer.start("a", _ids(1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 9, 1, 2, 7, 8, 9, 6, 1, 2), SeqOptions())
    one = np.ones(1, dtype=np.int64)
    batch = proposer.advance(["a"], _ids(), np.zeros(2, dtype=np.int64), one * 0, one * 9)
    made = proposer.branches(["a"], batch.token_ids, batch.offsets, one * 9, one * 4, 16)
    branches = Branches(made.positions, made.tokens, made.starts, made.token_ids)
    assert batch.token_ids.tolist() == [3, 4, 5]
    assert branches.find(0, 7).tolist() == [8, 9, 6]
    assert branches.find(0, 3) is None  # the draft's own token
    assert branches.find(3, 9).tolist() == [1, 2, 7, 8] and branches.find(3, 6).tolist() == [1, 2, 3, 4]
    assert held_after(Draft(batch.token_ids), branches, [7]).token_ids.tolist() == [8, 9, 6]


# ---------------------------------------------------- suffix drafts ahead

@pytest.mark.parametrize("cached", [0, 3])
def test_suffix_continues_a_draft_ahead_that_ends_within_the_round_being_verified(cached):
    """SuffixProposer.ahead: a draft of d <= ahead_k tokens goes on with the
    draft the written-out reference makes after the context + the draft
    (of at most K - d tokens, K the budget); a longer draft, ahead_k 0 or
    an empty draft stand. Drafts that the length cap ended (a match of m
    tokens drafts at most m) are continued and grow."""
    depth_tree, grown = 16, 0
    for seed in range(8):
        text, proposer, glob = _suffix_case(100 + seed, cached, depth_tree)
        contexts = [text(50 + 5 * i) for i in range(4)]
        seq_ids = [f"a{i}" for i in range(4)]
        for seq_id, context in zip(seq_ids, contexts):
            proposer.start(seq_id, _ids(*context), SeqOptions())
        n = len(seq_ids)
        ks = np.array([11, 11, 11, 7], dtype=np.int64)
        ahead_ks = np.array([5, 1, 0, 3], dtype=np.int64)
        batch = proposer.advance(seq_ids, _ids(), np.zeros(n + 1, dtype=np.int64), np.zeros(n, dtype=np.int64), ks)
        token_ids, offsets = proposer.ahead(seq_ids, batch.token_ids, batch.offsets, ks, ahead_ks)
        for i, context in enumerate(contexts):
            draft = batch.token_ids[batch.offsets[i]:batch.offsets[i + 1]].tolist()
            got = token_ids[offsets[i]:offsets[i + 1]].tolist()
            want = draft
            if 0 < len(draft) <= ahead_ks[i]:
                want = draft + _suffix_draft_after(build_tree([(context, 0)], depth_tree), glob, context + draft,
                                                   depth_tree, int(ks[i]) - len(draft))
            assert got == want, (seed, i)
            assert len(got) <= ks[i]
            grown += len(got) > len(draft)
    assert grown >= 4  # drafts were continued, and compared (12 without the global trie, 6 with)


def test_suffix_continues_the_draft_the_length_cap_ended_from_the_grown_match():
    """After "... 6 1 2" the draft is 3 4 5 (the match "6 1 2" drafts at most
    3); drafting ahead of a round of k = 5 it goes on with what the method
    drafts after "... 6 1 2 3 4 5": "1 2 3 4 5" was followed by 6 and 9
    (9 the latest), then "1 2 7 8 9" (6 tokens at most, the budget's
    rest). hybrid continues its drafts the same way (its suffix half)."""
    text = _ids(1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 9, 1, 2, 7, 8, 9, 6, 1, 2)
    one = np.ones(1, dtype=np.int64)
    suffix, hybrid = SuffixProposer(SuffixConfig(max_cached_requests=0)), HybridProposer()
    for proposer in (suffix, hybrid):
        proposer.start("a", text, SeqOptions())
    batch = suffix.advance(["a"], _ids(), np.zeros(2, dtype=np.int64), one * 0, one * 11)
    assert batch.token_ids.tolist() == [3, 4, 5]
    token_ids, offsets = suffix.ahead(["a"], batch.token_ids, batch.offsets, one * 11, one * 5)
    assert token_ids.tolist() == [3, 4, 5, 9, 1, 2, 7, 8, 9] and offsets.tolist() == [0, 9]
    assert suffix.ahead(["a"], batch.token_ids, batch.offsets, one * 11, one * 2)[0].tolist() == [3, 4, 5]
    assert suffix.ahead(["a"], batch.token_ids, batch.offsets, one * 11, one * 0)[0].tolist() == [3, 4, 5]
    assert hybrid.ahead(["a"], batch.token_ids, batch.offsets, one * 11, one * 5)[0].tolist() == token_ids.tolist()
    assert NgramProposer().ahead(["a"], batch.token_ids, batch.offsets, one * 11, one * 5) is None


# ---------------------------------------------------------------- servicer

def _opened(methods: dict[str, str], text: list[int]):
    proposers = build_proposers(sorted(set(methods.values())))
    handle = ProposerServicer(proposers).handle
    handle(pb.ProposeRequest(sequences=[
        pb.SequenceUpdate(seq_id=s, open=True, token_ids=text, context_len=len(text),
                          options=pb.ProposerOptions(method=m)) for s, m in methods.items()]))
    return handle


def test_the_servicer_answers_branches_in_entry_order_and_names_bad_branch_fields():
    text = [1, 2, 3, 4, 5, 7, 8, 9, 6, 1, 2, 3, 9, 9, 1]
    methods = {"a": "ngram", "s": "suffix", "b": "ngram"}
    handle = _opened(methods, text)
    reference = NgramProposer()
    reference.start("r", _ids(*text, 2), SeqOptions())
    one = np.ones(1, dtype=np.int64)
    batch = reference.advance(["r"], _ids(), np.zeros(2, dtype=np.int64), one * 0, one * 7)
    expected = reference.branches(["r"], batch.token_ids, batch.offsets, one * 7, one * 3, 4)
    n_expected = len(expected.positions)
    assert n_expected > 4
    suffix = SuffixProposer()
    suffix.start("r", _ids(*text, 2), SeqOptions())
    s_batch = suffix.advance(["r"], _ids(), np.zeros(2, dtype=np.int64), one * 0, one * 7)
    s_expected = suffix.branches(["r"], s_batch.token_ids, s_batch.offsets, one * 7, one * 3, 4)
    assert len(s_expected.positions) > 0

    def round_(width: int, depths: list[int], ks: list[int] | None = None, first: bool = False) -> pb.RoundDrafts:
        return handle(pb.ProposeRequest(round=pb.RoundUpdates(
            seq_ids=["a", "s", "b"], token_counts=[1, 1, 0] if first else [0, 0, 0], token_ids=[2, 2] if first else [],
            context_lens=[16, 16, 15], num_speculative_tokens=ks or [7, 7, 7], branch_width=width,
            branch_depths=depths))).round

    out = round_(4, [3, 3, 0], first=True)  # a and s append a token
    assert list(out.draft_counts)[0] == len(batch.token_ids)
    assert list(out.branch_counts) == [n_expected, len(s_expected.positions), 0]  # b asked for none
    assert list(out.branch_positions) == expected.positions.tolist() + s_expected.positions.tolist()
    assert list(out.branch_tokens) == expected.tokens.tolist() + s_expected.tokens.tolist()
    assert list(out.branch_lens) == np.diff(expected.starts).tolist() + np.diff(s_expected.starts).tolist()
    assert list(out.branch_token_ids) == expected.token_ids.tolist() + s_expected.token_ids.tolist()
    b_first = round_(4, [0, 0, 3], [0, 0, 7])
    assert b_first.branch_counts[0] == 0 and b_first.branch_counts[2] > 0
    for width, depths, field in [(MAX_BRANCH_WIDTH + 1, [1, 1, 1], "round.branch_width"),
                                 (-1, [1, 1, 1], "round.branch_width"),
                                 (4, [1, 1], "round.branch_depths")]:
        bad = round_(width, depths, [0, 0, 0])
        assert list(bad.statuses) == [pb.SEQUENCE_STATUS_INVALID] * 3 and {m.split(":")[0] for m in bad.messages} == {
            field}
    one_bad = round_(4, [0, 0, 7], [0, 0, 7])  # a depth must leave the branch a token of the budget
    assert list(one_bad.statuses) == [pb.SEQUENCE_STATUS_OK, pb.SEQUENCE_STATUS_OK, pb.SEQUENCE_STATUS_INVALID]
    assert one_bad.messages[2].startswith("round.branch_depths")



def test_the_servicer_continues_drafts_ahead_by_method_and_names_bad_ahead_fields():
    """RoundUpdates.ahead_ks: suffix's draft continued (as SuffixProposer.ahead),
    ngram's as it was; a bad length or value named."""
    text = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 9, 1, 2, 7, 8, 9, 6, 1, 2]
    handle = _opened({"n": "ngram", "s": "suffix"}, text)

    def round_(ks: list[int], aheads: list[int]) -> pb.RoundDrafts:
        return handle(pb.ProposeRequest(round=pb.RoundUpdates(
            seq_ids=["n", "s"], token_counts=[0, 0], context_lens=[20, 20], num_speculative_tokens=ks,
            ahead_ks=aheads))).round

    plain = round_([11, 11], [])
    out = round_([11, 11], [5, 5])
    assert list(plain.draft_counts)[1] == 3 and list(out.draft_counts) == [plain.draft_counts[0], 9]
    assert list(out.token_ids)[-9:] == [3, 4, 5, 9, 1, 2, 7, 8, 9]
    assert list(out.token_ids)[:out.draft_counts[0]] == list(plain.token_ids)[:plain.draft_counts[0]]
    bad = round_([11, 11], [5])
    assert list(bad.statuses) == [pb.SEQUENCE_STATUS_INVALID] * 2
    assert {m.split(":")[0] for m in bad.messages} == {"round.ahead_ks"}
    one_bad = round_([11, 5], [5, 5])  # the round's k + 1 tokens must fit the budget
    assert list(one_bad.statuses) == [pb.SEQUENCE_STATUS_OK, pb.SEQUENCE_STATUS_INVALID]
    assert one_bad.messages[1].startswith("round.ahead_ks")


# -------------------------------------------------------------------- wire

def _held(seq_id: str, k: int = 3, method: str = "ngram") -> Sequence:
    seq = Sequence(seq_id, _params([5, 7, 11], k, 24, method), _Tokenizer(), (), 512)
    seq.proposer_len = len(seq.tokens)
    return seq


def test_the_gateway_asks_for_branches_only_drafting_ahead_for_few_sequences():
    few = [_held(f"s{i}") for i in range(AHEAD_BRANCH_MAX_SEQUENCES)]
    asked = propose_request(few, [], ahead=True, branch_width=6).request.round
    assert asked.branch_width == 6 and list(asked.branch_depths) == [3] * len(few)
    assert list(asked.num_speculative_tokens) == [7] * len(few)  # 2k + 1: a branch gets 7 - 3 - 1 = 3 tokens
    lock_step = propose_request(few, [], ahead=False, branch_width=6).request.round
    assert lock_step.branch_width == 0 and not lock_step.branch_depths
    assert not propose_request(few, [], ahead=True, branch_width=0).request.round.branch_depths
    assert list(asked.ahead_ks) == [3] * len(few) and not lock_step.ahead_ks  # the round's k, drafting ahead
    most = [_held(f"s{i}") for i in range(AHEAD_BRANCH_MAX_SEQUENCES)]
    shared = propose_request(most, [], ahead=True, branch_width=MAX_BRANCH_WIDTH).request.round
    assert shared.branch_width == min(MAX_BRANCH_WIDTH, AHEAD_BRANCH_BUDGET // AHEAD_BRANCH_MAX_SEQUENCES)
    assert len(shared.branch_depths) == AHEAD_BRANCH_MAX_SEQUENCES
    many = [_held(f"s{i}") for i in range(AHEAD_BRANCH_MAX_SEQUENCES + 1)]
    assert not propose_request(many, [], ahead=True, branch_width=6).request.round.branch_depths
    sampled = _held("x")
    sampled.params = _params([5, 7, 11], 3, 24, strategy=pb.VERIFY_STRATEGY_REJECTION)  # may not draft ahead
    assert list(propose_request([few[0], sampled], [], True, 6).request.round.branch_depths) == [3, 0]
    assert list(propose_request([few[0], sampled], [], True, 6).request.round.ahead_ks) == [3, 0]


def test_the_gateway_reads_each_sequences_branches_and_refuses_a_misfit():
    seqs = [_held("a"), _held("b")]
    message = propose_request(seqs, [], ahead=True, branch_width=4)
    response = pb.ProposeResponse(round=pb.RoundDrafts(
        draft_counts=[2, 1], token_ids=[1, 2, 3], branch_counts=[2, 1], branch_positions=[0, 1, 0],
        branch_tokens=[9, 8, 7], branch_lens=[2, 0, 1], branch_token_ids=[4, 5, 6]))
    (_, a), (_, b) = proposer_answers(message, response)
    assert a.branches.find(0, 9).tolist() == [4, 5] and a.branches.find(1, 8).tolist() == []
    assert len(a.branches) == 2 and len(b.branches) == 1 and b.branches.find(0, 7).tolist() == [6]
    assert a.branches.find(0, 7) is None
    for misfit in [dict(branch_counts=[2]), dict(branch_lens=[2, 0, 2]), dict(branch_tokens=[9, 8])]:
        broken = pb.ProposeResponse()
        broken.CopyFrom(response)
        for name, values in misfit.items():
            broken.round.ClearField(name)
            getattr(broken.round, name).extend(values)
        with pytest.raises(ValueError, match="branches"):
            proposer_answers(message, broken)


# -------------------------------------------------------------------- loop

class _BranchingProposer(_SlowProposer):
    """The scripted proposer, answering branches too: at each position j up
    to the depth asked, the target's own token there (where the draft's is
    another) with the target's continuation after it. So every draft ahead
    that the outcome leaves has a branch that holds."""

    def __init__(self, calls: _Calls, latency_s: float) -> None:
        super().__init__(calls, latency_s)
        self.branched = 0

    async def exchange(self, request, timeout_s):
        response = await super().exchange(request, timeout_s)
        cols = request.round
        if not cols.branch_width:
            return response
        for i, seq_id in enumerate(cols.seq_ids):
            context_len, draft = self.made[seq_id][-1]
            context = self.tokens[seq_id][:context_len]
            length = cols.num_speculative_tokens[i] - cols.branch_depths[i] - 1
            count = 0
            for j in range(min(cols.branch_depths[i], len(draft)) + 1 if cols.branch_depths[i] else 0):
                t = _target(context + draft[:j])
                if j < len(draft) and draft[j] == t:
                    continue
                tail = _expected(context + draft[:j] + [t], length)[context_len + j + 1:]
                response.round.branch_positions.append(j)
                response.round.branch_tokens.append(t)
                response.round.branch_lens.append(len(tail))
                response.round.branch_token_ids.extend(tail)
                count += 1
            response.round.branch_counts.append(count)
            self.branched += count
        return response


MAX_BRANCHING_TOKENS = 120  # per sequence of the scripted loop


def _run_branching(width: int) -> tuple[list[list[int]], _Calls, int]:
    """Two sequences drafting ahead behind the branching proposer (20 ms
    against a ~5 ms Verify: no round waits for it); returns their tokens,
    the call log and the drafts verified from branches."""
    calls = _Calls()
    proposer, scorer = _BranchingProposer(calls, 0.02), _SlowScorer(calls, 0.004, 0.0005)
    counted = metrics.AHEAD_BRANCH_DRAFTS.labels("ngram")
    before = counted._value.get()

    async def run():
        loop = SpecLoop(ReplicaSet("scorer", [SCORER]), {"ngram": ReplicaSet("ngram", [PROPOSER])}, vocab_size=100,
                        config=LoopConfig(overlap=Overlap.AHEAD, stall_sleep_s=0.0, ahead_branch_width=width))
        loop.conns.scorer = lambda addr: scorer  # type: ignore[method-assign]
        loop.conns.proposer_stream = lambda addr: proposer  # type: ignore[method-assign]
        seqs = [Sequence(f"r{i}", _params(_prompt(i), 3, MAX_BRANCHING_TOKENS), _Tokenizer(), (), 512)
                for i in range(2)]
        for seq in seqs:
            loop.submit(seq)
        for _ in range(600):
            if all(s.done for s in seqs):
                break
            await loop._round()
        return [s.tokens for s in seqs]

    outputs = asyncio.run(run())
    assert (proposer.branched > 0) == (width > 0)
    return outputs, calls, int(counted._value.get() - before)


def test_a_round_whose_draft_ahead_the_outcome_left_verifies_the_branch_it_followed():
    """The scripted proposer's drafts are now and then wrong at their end.
    With branches, the round after such a draft verifies the branch the
    outcome followed (the target's own continuation: accepted); without,
    it goes on without drafts. So branches take fewer rounds, and the output
    is lock-step's either way."""
    plain, plain_calls, plain_branch_drafts = _run_branching(0)
    branched, branched_calls, branch_drafts = _run_branching(4)
    assert plain == branched == [_expected(_prompt(i), MAX_BRANCHING_TOKENS) for i in range(2)]
    assert plain_branch_drafts == 0 and branch_drafts >= 10
    rounds = [sum(c[0] == "verify" for c in calls.log) for calls in (plain_calls, branched_calls)]
    assert rounds[1] < 0.9 * rounds[0], rounds  # (AMD EPYC, 4 runs: 53-59 rounds without, 41-42 with)


# ---------------------------------------------------------- real processes

PROMPTS = ["Once upon a time", "Lily went to the park with her mom."]


@pytest.fixture(scope="module")
def branching_stack(stories_path, tmp_path_factory):
    """ngram drafting ahead with branches, the proposer 1 ms slower: about
    stories260K's Verify, so that most exchanges land by the round after
    (a proposer much slower than that spans several rounds, whose outputs
    seldom still follow one draft and its branches: 10 ms gave 0-3 branch
    drafts a run)."""
    stack = start_stack(stories_path, tmp_path_factory, "branches", methods="ngram,suffix,hybrid", metrics=True,
                        extra_gateway_args=["--overlap", "ahead", "--ahead-branches", "16"],
                        # no global suffix tree: suffix and hybrid would copy the earlier cases' answers of the
                        # same prompts
                        extra_proposer_args=["--added-latency-ms", "1", "--max-cached-requests", "0"])
    yield stack
    stack.stop()


@pytest.mark.parametrize("method", ["ngram", "suffix", "hybrid"])
def test_greedy_identity_drafting_ahead_with_branches(branching_stack, stories_path, method):
    """Two streams at a time (the gateway asks for branches in messages of
    at most AHEAD_BRANCH_MAX_SEQUENCES sequences drafting ahead); hybrid
    answers its n-gram half's branches, suffix its tries'. A fixed draft
    length: adaptive, copies against this tiny model's cheap steps mostly
    decode plainly (CopyGates), leaving few branches to count."""
    cases = [(prompt, k) for k in (1, 3, 8) for prompt in PROMPTS]
    with ThreadPoolExecutor(AHEAD_BRANCH_MAX_SEQUENCES) as pool:
        gens = list(pool.map(lambda c: stream(branching_stack.gateway_addr,
                                              make_request(c[0], max_tokens=48, method=method, k=c[1],
                                                           draft_length=pb.DRAFT_LENGTH_FIXED)), cases))
    for (prompt, _), gen in zip(cases, gens):
        expected = hf_greedy(stories_path, tuple(hf_model(stories_path)[1](prompt)["input_ids"]), 48)
        assert_same_as_greedy(stories_path, gen, expected, 48)
    samples = branching_stack.by_name("gateway")[0].metrics()
    # drafts verified from branches (AMD EPYC, two streams at a time: ngram 22-31 and hybrid 8-40 in 12 runs,
    # suffix 17-28 in 4; suffix branching only on its tries' alternatives made 3-10). Without branches: 0
    assert samples.get(f'specdec_gateway_ahead_branch_drafts_total{{method="{method}"}}', 0.0) >= 5
