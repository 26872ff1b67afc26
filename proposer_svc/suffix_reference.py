"""Obviously-correct (and slow) SuffixDecoding: the definition that the numba
proposer in ``suffix.py`` is tested against.

A *tree* of depth D over a set of token *streams*: for every stream S and
every start j, each prefix u of S[j : j + D] is a node; ``count(u)`` is the
number of occurrences of u (over all streams), and ``stamp(u)`` the latest
time at which an occurrence of u was completed, where token i of a stream
inserted at time base b is seen at time b + i.

A draft for a match of the context's last m tokens (node u, |u| = m) follows
the most frequent child (ties: the larger stamp, i.e. the most recently seen)
while the product of count(child) / count(parent) stays >= min_token_prob,
with at most min(k, ceil(m * max_spec_factor)) tokens; its score is the sum
of these products. The best draft maximises (score, length, match length);
between the per-request tree and the global tree, (score, length) decides
and ties go to the per-request tree.

Trees here are rebuilt from their streams on every call; nothing is
incremental, so nothing can drift.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from specdec.drafts import Draft
from specdec.proposer_svc.base import Proposer, SeqOptions, UnknownSequence
from specdec.proposer_svc.suffix import SPEC_FACTOR_EPS


def max_draft_len(match_len: int, k: int, max_spec_factor: float) -> int:
    """Draft tokens allowed for a match of ``match_len`` tokens."""
    return min(k, math.ceil(match_len * max_spec_factor - SPEC_FACTOR_EPS))


@dataclass
class RefNode:
    count: int = 0
    stamp: int = -1
    children: dict[int, "RefNode"] = field(default_factory=dict)


def build_tree(streams: list[tuple[list[int], int]], max_depth: int) -> RefNode:
    """A trie of every substring of length <= max_depth of the streams.

    streams: (tokens, time base) pairs.
    """
    root = RefNode()
    for tokens, base in streams:
        for j in range(len(tokens)):
            node = root
            for i in range(j, min(j + max_depth, len(tokens))):
                node = node.children.setdefault(tokens[i], RefNode())
                node.count += 1
                node.stamp = max(node.stamp, base + i)
    return root


def find_node(root: RefNode, tokens: list[int]) -> RefNode | None:
    node = root
    for tok in tokens:
        child = node.children.get(tok)
        if child is None:
            return None
        node = child
    return node


def draft_path(node: RefNode, cap: int, min_token_prob: float) -> tuple[list[int], float]:
    tokens: list[int] = []
    score, prob = 0.0, 1.0
    while len(tokens) < cap and node.children:
        tok, child = max(node.children.items(), key=lambda kv: (kv[1].count, kv[1].stamp))
        prob *= child.count / node.count
        if prob < min_token_prob:
            break
        tokens.append(tok)
        score += prob
        node = child
    return tokens, score


def speculate(root: RefNode, context: list[int], max_match: int, k: int,
              max_spec_factor: float, min_token_prob: float) -> tuple[list[int], float]:
    """Best (draft tokens, score) over the context's suffixes found in the tree."""
    best: tuple[float, int, int] = (0.0, 0, 0)  # (score, len, match_len)
    best_tokens: list[int] = []
    for m in range(1, min(max_match, len(context)) + 1):
        node = find_node(root, context[len(context) - m:])
        if node is None:
            break
        tokens, score = draft_path(node, max_draft_len(m, k, max_spec_factor), min_token_prob)
        if tokens and (score, len(tokens), m) >= best:
            best, best_tokens = (score, len(tokens), m), tokens
    return best_tokens, best[0]


@dataclass
class _RefSeq:
    context: list[int]
    prompt_len: int
    options: SeqOptions


class ReferenceSuffixProposer(Proposer):
    """Same behaviour as ``suffix.SuffixProposer``, rebuilt from scratch each
    call. ``max_cached_requests`` finished outputs are kept, oldest evicted."""

    name = "suffix"

    def __init__(self, max_cached_requests: int, max_tree_depth: int = 64) -> None:
        self.max_cached_requests = max_cached_requests
        self.max_tree_depth = max_tree_depth
        self._seqs: dict[str, _RefSeq] = {}
        self._cached: deque[tuple[list[int], int]] = deque()  # (output, time base)
        self._clock = 0  # tokens ever inserted into the global tree

    def start(self, seq_id, context, options):
        self._seqs[seq_id] = _RefSeq([int(t) for t in context], len(context), options)

    def extend(self, seq_id, token_ids):
        self._seq(seq_id).context.extend(int(t) for t in token_ids)

    def propose(self, requests):
        return [self._propose_one(seq_id, k) for seq_id, k in requests]

    def _propose_one(self, seq_id: str, k: int) -> Draft:
        seq = self._seq(seq_id)
        opts = seq.options
        depth = min(opts.max_tree_depth, self.max_tree_depth)
        reference = [int(t) for t in opts.reference_token_ids]
        local = build_tree([(reference, 0), (seq.context, len(reference))], depth)
        glob = build_tree(list(self._cached), self.max_tree_depth)
        args = (seq.context, depth, k, opts.max_spec_factor, opts.min_token_prob)
        local_tokens, local_score = speculate(local, *args)
        global_tokens, global_score = speculate(glob, *args)
        if (local_score, len(local_tokens)) >= (global_score, len(global_tokens)):
            return Draft(np.array(local_tokens, dtype=np.int32))
        return Draft(np.array(global_tokens, dtype=np.int32))

    def stop(self, seq_id, completed):
        seq = self._seqs.pop(seq_id, None)
        if seq is None or not completed or self.max_cached_requests <= 0:
            return
        output = seq.context[seq.prompt_len:]
        if not output:
            return
        while len(self._cached) >= self.max_cached_requests:
            self._cached.popleft()
        self._cached.append((output, self._clock))
        self._clock += len(output)

    def context_len(self, seq_id):
        return len(self._seq(seq_id).context)

    def _seq(self, seq_id: str) -> _RefSeq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequence(seq_id) from None
