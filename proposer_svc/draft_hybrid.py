"""``draft_hybrid``: model drafts and copy drafts (n-gram, suffix) asked
together, the draft with more expected accepted tokens kept (FastDeploy's
``hybrid`` is MTP + n-gram).

All three scores are in one unit, expected accepted draft tokens: the model
draft's is the sum of its cumulative draft probabilities (``ScoredDraft``),
the suffix draft's the same under its trie's frequencies, an n-gram draft's
``q + q^2 + ... + q^n`` (see ``hybrid``). Long verbatim copies win on copy
work (rewrite, extract, edit), the model elsewhere. Ties go to the model.

A copy draft that fills the sequence's whole budget (k tokens of verbatim
continuation) is kept without running the model for that sequence: the model
could at most match it, and its k steps (a forward each) would sit on the
round's critical path for nothing. On copy work that is most rounds; the
model's cache catches up in one forward when it drafts again. Nor does the
model run for a shorter copy worth at least what the model's own drafts of
that sequence have recently been worth (``model_expect``, a running mean of
their scores): most rounds of copy work find a copy of a few tokens, and the
model would rarely beat it. A sequence without a copy always asks the model,
so its running mean keeps learning.

An adaptive gateway caps the model's tokens per round apart from the copies'
(``SequenceUpdate.model_steps``, ``limit_model_steps``), planned from the
model's cost and the acceptance of the model-made drafts alone: a copy costs
no forward and keeps the whole budget, so where the model does not pay for
its forwards (a weak draft on a CPU) the hybrid drafts by copying only,
instead of paying forwards for nothing.
"""
from __future__ import annotations

from specdec.proposer_svc.base import Draft, Proposer
from specdec.proposer_svc.draft import DraftModelProposer
from specdec.proposer_svc.hybrid import HybridConfig, ngram_score
from specdec.proposer_svc.ngram import NgramProposer
from specdec.proposer_svc.suffix import SuffixProposer

#: weight of the newest model score in a sequence's running mean (model_expect)
MODEL_EXPECT_WEIGHT = 0.5


class DraftHybridProposer(Proposer):
    """Each wrapped proposer keeps its own state for every sequence."""

    name = "draft_hybrid"

    def __init__(self, model: DraftModelProposer, config: HybridConfig) -> None:
        self.model = model
        self.config = config
        self.ngram = NgramProposer()
        self.suffix = SuffixProposer(config.suffix)
        self._parts: tuple[Proposer, ...] = (self.model, self.ngram, self.suffix)
        self.model_skipped = 0  # sequence-rounds answered by a copy without the model
        # per sequence: running mean of its model drafts' scores (absent until the model drafts for it)
        self.model_expect: dict[str, float] = {}
        self._model_steps: dict[str, int] = {}  # per sequence: this round's cap on model steps (limit_model_steps)

    def start(self, seq_id, context, options):
        for part in self._parts:
            part.start(seq_id, context, options)
        self.model_expect.pop(seq_id, None)

    def extend(self, seq_id, token_ids):
        for part in self._parts:
            part.extend(seq_id, token_ids)

    def propose(self, requests):
        ngram = self.ngram.propose(requests)
        suffix = self.suffix.propose_scored(requests)
        q = self.config.ngram_token_prob
        copies: list[tuple[float, Draft]] = [  # the better copy draft; ties go to the suffix draft
            max((s_score, s_draft), (ngram_score(len(n.token_ids), q), n), key=lambda c: c[0])
            for n, (s_draft, s_score) in zip(ngram, suffix)]
        steps = self._model_steps
        budgets = [min(k, steps.pop(seq_id, k)) for seq_id, k in requests]
        asked = [i for i, ((seq_id, _), m, (score, copy)) in enumerate(zip(requests, budgets, copies))
                 if self._asks_model(seq_id, m, len(copy.token_ids), score)]
        self.model_skipped += len(requests) - len(asked)
        out = [copy for _, copy in copies]
        for i, m in zip(asked, self.model.propose_scored([(requests[i][0], budgets[i]) for i in asked])):
            seq_id = requests[i][0]
            expect = self.model_expect.get(seq_id)
            self.model_expect[seq_id] = m.score if expect is None else (
                MODEL_EXPECT_WEIGHT * m.score + (1 - MODEL_EXPECT_WEIGHT) * expect)
            if m.score >= copies[i][0]:  # ties go to the model
                out[i] = m.draft
        return out

    def _asks_model(self, seq_id: str, steps: int, copy_len: int, copy_score: float) -> bool:
        """Whether the model drafts for seq_id this round (at most ``steps``
        tokens), given its best copy draft: never with no steps, always
        without a copy, never for a copy at least as long as the model may
        make, else while the copy is worth less than the model's recent
        drafts."""
        if steps == 0:
            return False
        if copy_len == 0:
            return True
        return copy_len < steps and copy_score < self.model_expect.get(seq_id, float("inf"))

    def limit_model_steps(self, seq_id, steps):
        self._model_steps[seq_id] = steps

    def advance(self, seq_ids, tokens, bounds, context_lens, ks):
        try:
            return super().advance(seq_ids, tokens, bounds, context_lens, ks)
        finally:  # a cap is for one round: one whose sequence drafted nothing (k = 0, out of sync) goes too
            self._model_steps.clear()

    def stop(self, seq_id, completed):
        for part in self._parts:
            part.stop(seq_id, completed)
        self.model_expect.pop(seq_id, None)
        self._model_steps.pop(seq_id, None)

    def between_messages(self, budget_s=None):  # (the suffix part is the one with upkeep)
        return self.suffix.between_messages(budget_s)

    def upkeep_progress(self):
        return self.suffix.upkeep_progress()

    def context_len(self, seq_id):
        return self.model.context_len(seq_id)

    def stats(self):
        model, ngram, suffix = self.model.stats(), self.ngram.stats(), self.suffix.stats()
        return {**model, **suffix, "memory_bytes": model["memory_bytes"] + ngram["memory_bytes"]
                + suffix["memory_bytes"], "model_skipped": self.model_skipped}
