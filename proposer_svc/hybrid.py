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

from specdec.proposer_svc.base import Draft, Proposer
from specdec.proposer_svc.ngram import NgramConfig, NgramProposer
from specdec.proposer_svc.suffix import SuffixConfig, SuffixProposer


@dataclass(frozen=True)
class HybridConfig:
    """Settings of the hybrid proposer and of the two it combines."""

    ngram: NgramConfig = field(default_factory=NgramConfig)
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
        self.ngram = NgramProposer(config.ngram)
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

    def _better(self, ngram_draft: Draft, suffix_draft: Draft, suffix_score: float) -> Draft:
        q = self.config.ngram_token_prob
        if ngram_score(len(ngram_draft.token_ids), q) > suffix_score:
            return ngram_draft
        return suffix_draft

    def stop(self, seq_id, completed):
        self.ngram.stop(seq_id, completed)
        self.suffix.stop(seq_id, completed)

    def context_len(self, seq_id):
        return self.suffix.context_len(seq_id)

    def stats(self):
        ngram, suffix = self.ngram.stats(), self.suffix.stats()
        return {**suffix, "memory_bytes": ngram["memory_bytes"] + suffix["memory_bytes"]}
