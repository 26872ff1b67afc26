"""``draft_hybrid``: model drafts and copy drafts (n-gram, suffix) asked
together, the draft with more expected accepted tokens kept (FastDeploy's
``hybrid`` is MTP + n-gram).

All three scores are in one unit, expected accepted draft tokens: the model
draft's is the sum of its cumulative draft probabilities (``ScoredDraft``),
the suffix draft's the same under its trie's frequencies, an n-gram draft's
``q + q^2 + ... + q^n`` (see ``hybrid``). Long verbatim copies win on copy
work (rewrite, extract, edit), the model elsewhere. Ties go to the model.
"""
from __future__ import annotations

from specdec.proposer_svc.base import Draft, Proposer
from specdec.proposer_svc.draft import DraftModelProposer
from specdec.proposer_svc.hybrid import HybridConfig, ngram_score
from specdec.proposer_svc.ngram import NgramProposer
from specdec.proposer_svc.suffix import SuffixProposer


class DraftHybridProposer(Proposer):
    """Each wrapped proposer keeps its own state for every sequence."""

    name = "draft_hybrid"

    def __init__(self, model: DraftModelProposer, config: HybridConfig) -> None:
        self.model = model
        self.config = config
        self.ngram = NgramProposer()
        self.suffix = SuffixProposer(config.suffix)
        self._parts: tuple[Proposer, ...] = (self.model, self.ngram, self.suffix)

    def start(self, seq_id, context, options):
        for part in self._parts:
            part.start(seq_id, context, options)

    def extend(self, seq_id, token_ids):
        for part in self._parts:
            part.extend(seq_id, token_ids)

    def propose(self, requests):
        model = self.model.propose_scored(requests)
        ngram = self.ngram.propose(requests)
        suffix = self.suffix.propose_scored(requests)
        q = self.config.ngram_token_prob
        out = []
        for m, n, (s_draft, s_score) in zip(model, ngram, suffix):
            scored: list[tuple[float, Draft]] = [
                (m.score, m.draft), (s_score, s_draft), (ngram_score(len(n.token_ids), q), n)]
            out.append(max(scored, key=lambda c: c[0])[1])  # max keeps the first of equals
        return out

    def stop(self, seq_id, completed):
        for part in self._parts:
            part.stop(seq_id, completed)

    def between_messages(self):
        for part in self._parts:
            part.between_messages()

    def context_len(self, seq_id):
        return self.model.context_len(seq_id)

    def stats(self):
        model, ngram, suffix = self.model.stats(), self.ngram.stats(), self.suffix.stats()
        return {**model, **suffix, "memory_bytes": model["memory_bytes"] + ngram["memory_bytes"]
                + suffix["memory_bytes"]}
