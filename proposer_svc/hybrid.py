"""Hybrid proposer: the n-gram and suffix proposers asked together, the draft
with more expected accepted tokens used.

"Better" is measured in one unit, the expected number of accepted draft
tokens. A suffix draft's score is exactly that estimate under its trie's
frequencies (the sum over draft positions of the path probability). An
n-gram draft carries no probabilities; each copied token is taken to be
accepted, given the previous ones were, with probability
``ngram_token_prob`` = q, so n tokens are worth q + q^2 + ... + q^n. So a
short confident suffix draft beats a long n-gram copy only when its
frequencies back it more than q per token does, and a long verbatim copy
(e.g. from the request's reference text) beats a short suffix draft. Ties go
to the suffix draft, the one with evidence behind its score.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from specdec.drafts import Draft
from specdec.proposer_svc.base import DraftBatch, Proposer
from specdec.proposer_svc.ngram import NgramProposer
from specdec.proposer_svc.suffix import SuffixConfig, SuffixProposer


@dataclass(frozen=True)
class HybridConfig:
    """Settings of the hybrid proposer and of the suffix proposer it wraps (the
n-gram proposer has no replica-level settings)."""

    suffix: SuffixConfig = field(default_factory=SuffixConfig)
    # q: assumed acceptance of each copied token, in (0, 1]; 0.8 gave the most
    # accepted tokens on benchmarks/bench_suffix_micro.py's code, edit and
    # synthetic streams (0.5 .. 1.0 tried)
    ngram_token_prob: float = 0.8


def ngram_score(num_tokens: int, token_prob: float) -> float:
    """Expected accepted tokens of an n-gram draft: sum of q^i, i = 1..n."""
    return sum(token_prob ** i for i in range(1, num_tokens + 1))


class HybridProposer(Proposer):
    """Both proposers keep their own state for every sequence."""

    name = "hybrid"

    def __init__(self, config: HybridConfig = HybridConfig()) -> None:
        if not 0.0 < config.ngram_token_prob <= 1.0:
            raise ValueError(f"ngram_token_prob must be in (0, 1], got {config.ngram_token_prob}")
        self.config = config
        self.ngram = NgramProposer()
        self.suffix = SuffixProposer(config.suffix)

    def start(self, seq_id, context, options):
        self.ngram.start(seq_id, context, options)
        self.suffix.start(seq_id, context, options)

    def extend(self, seq_id, token_ids):
        self.ngram.extend(seq_id, token_ids)
        self.suffix.extend(seq_id, token_ids)

    def propose(self, requests):
        ngram_drafts = self.ngram.propose(requests)
        suffix_drafts = self.suffix.propose_scored(requests)
        return [self._better(ngram_draft, suffix_draft, suffix_score)
                for ngram_draft, (suffix_draft, suffix_score) in zip(ngram_drafts, suffix_drafts)]

    def advance(self, seq_ids, tokens, bounds, context_lens, ks):
        ngram = self.ngram.advance(seq_ids, tokens, bounds, context_lens, ks)
        suffix, suffix_scores = self.suffix.advance_scored(seq_ids, tokens, bounds, context_lens, ks)
        q = self.config.ngram_token_prob
        table = [ngram_score(n, q) for n in range(int(ks.max(initial=0)) + 1)]  # by draft length
        n_off, s_off = ngram.offsets.tolist(), suffix.offsets.tolist()
        n_ids, s_ids = ngram.token_ids.tolist(), suffix.token_ids.tolist()
        out: list[int] = []
        offsets = [0]
        for i, score in enumerate(suffix_scores.tolist()):
            if table[n_off[i + 1] - n_off[i]] > score:
                out.extend(n_ids[n_off[i]:n_off[i + 1]])
            else:
                out.extend(s_ids[s_off[i]:s_off[i + 1]])
            offsets.append(len(out))
        return DraftBatch(ngram.in_sync & suffix.in_sync, np.array(out, dtype=np.int32),
                          np.array(offsets, dtype=np.int64))

    def branches(self, seq_ids, drafts, offsets, ks, depths, width):
        """Its n-gram half's branches, of whichever draft the round kept: the
        draft the n-gram matcher makes after each likely outcome (its
        suffix half branches too; which half's serve hybrid better is not
        measured)."""
        return self.ngram.branches(seq_ids, drafts, offsets, ks, depths, width)

    def ahead(self, seq_ids, drafts, offsets, ks, ahead_ks):
        """Its suffix half's continuation of whichever draft the round kept
        (an n-gram draft ends within the round only where no match goes on)."""
        return self.suffix.ahead(seq_ids, drafts, offsets, ks, ahead_ks)

    def _better(self, ngram_draft: Draft, suffix_draft: Draft, suffix_score: float) -> Draft:
        q = self.config.ngram_token_prob
        if ngram_score(len(ngram_draft.token_ids), q) > suffix_score:
            return ngram_draft
        return suffix_draft

    def stop(self, seq_id, completed):
        self.ngram.stop(seq_id, completed)
        self.suffix.stop(seq_id, completed)

    def between_messages(self, budget_s=None):
        return self.suffix.between_messages(budget_s)

    def upkeep_progress(self):
        return self.suffix.upkeep_progress()

    def context_len(self, seq_id):
        return self.suffix.context_len(seq_id)

    def stats(self):
        ngram, suffix = self.ngram.stats(), self.suffix.stats()
        return {**suffix, "memory_bytes": ngram["memory_bytes"] + suffix["memory_bytes"]}
