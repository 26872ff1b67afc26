"""The one draft type: a proposer's guesses for one sequence in one round.

Proposers return it, the gateway checks and trims it, and the servicers turn
it into the gRPC ``Draft`` / ``draft_probs`` messages at the edge.

Pure Python and numpy: no gRPC, so every layer can import it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Proposer methods whose drafts are always one-hot (they copy from text; no
#: probabilities): their plain round updates may travel as columns
#: (ProposeRequest.round), which the gateway and the proposer servicer both
#: check against this.
ONE_HOT_METHODS = ("naive", "ngram", "suffix", "hybrid")

#: Proposer methods that draft from a model or from a copy, whichever is worth
#: more: the gateway plans their model's steps apart from their copies
#: (SequenceUpdate.model_steps), from the acceptance of their model-made drafts.
MODEL_AND_COPY_METHODS = ("draft_hybrid",)


@dataclass(frozen=True, eq=False)
class Draft:
    """Draft tokens for one sequence.

    Invariant of a well-formed draft: ``probs`` is empty (one-hot drafts:
    n-gram, suffix) or holds one entry per draft token, and
    ``prob_token_ids[j]`` and ``probs[j]`` have the same length. Position j's
    draft distribution is non-zero only at ``prob_token_ids[j]`` (draft models
    sample from their own top-K, renormalised)."""

    token_ids: np.ndarray  # int32 [n]
    prob_token_ids: tuple[np.ndarray, ...] = ()  # n x int32 [K_j], or () for one-hot drafts
    probs: tuple[np.ndarray, ...] = ()  # n x float32 [K_j], aligned with prob_token_ids

    def __len__(self) -> int:
        return len(self.token_ids)

    def truncated(self, n: int) -> Draft:
        """The first n draft tokens (with their probabilities)."""
        if n >= len(self):
            return self
        return Draft(self.token_ids[:n], self.prob_token_ids[:n], self.probs[:n])

    def after(self, n: int) -> Draft:
        """The draft tokens from position n on (with their probabilities): what
        is left of a draft once its first n tokens have become context."""
        if n == 0:
            return self
        return Draft(self.token_ids[n:], self.prob_token_ids[n:], self.probs[n:])

    def confidence(self) -> list[float] | None:
        """q(token_j), the draft's own probability of each of its tokens, or
        None for a one-hot draft (n-gram, suffix: no confidence to give)."""
        if not self.probs:
            return None
        return [float(p[ids == t].sum()) for t, ids, p in zip(self.token_ids, self.prob_token_ids, self.probs)]

    def is_well_formed(self, num_speculative_tokens: int, vocab_size: int) -> bool:
        """At most num_speculative_tokens tokens, all inside the vocabulary,
        and probabilities (if any) for every token, aligned."""
        ids = self.token_ids
        if len(ids) > num_speculative_tokens or (len(ids) and (ids.min() < 0 or ids.max() >= vocab_size)):
            return False
        if not self.probs and not self.prob_token_ids:
            return True
        return (len(self.probs) == len(self.prob_token_ids) == len(ids)
                and all(len(t) == len(p) for t, p in zip(self.prob_token_ids, self.probs)))


EMPTY_DRAFT_TOKENS = np.zeros(0, dtype=np.int32)
#: Zero draft tokens: what a sequence verifies when its proposer had nothing.
NO_DRAFT = Draft(EMPTY_DRAFT_TOKENS)


@dataclass(frozen=True, eq=False)
class Branches:
    """The branches of one draft proposed ahead (RoundUpdates.branch_width):
    branch b is the draft after ``draft[:positions[b]] + [tokens[b]]``,
    ``token_ids[starts[b]:starts[b + 1]]``; tokens[b] is not the draft's own
    token at that position, and no (position, token) pair repeats. Flat
    arrays, as they come off the wire (a draft has hundreds)."""

    positions: np.ndarray  # int32 [m]
    tokens: np.ndarray  # int32 [m]
    starts: np.ndarray  # int64 [m + 1], offsets into token_ids (which may hold other tokens around them)
    token_ids: np.ndarray  # int32 [>= starts[m]]

    @staticmethod
    def of(branches: dict[tuple[int, int], list[int]]) -> Branches:
        """From {(position, token): draft after it}."""
        lens = [len(ids) for ids in branches.values()]
        return Branches(np.array([j for j, _ in branches], dtype=np.int32),
                        np.array([t for _, t in branches], dtype=np.int32),
                        np.cumsum([0, *lens], dtype=np.int64),
                        np.array([t for ids in branches.values() for t in ids], dtype=np.int32))

    def __len__(self) -> int:
        return len(self.positions)

    def find(self, position: int, token: int) -> np.ndarray | None:
        """The draft of the branch that leaves at ``position`` with ``token``, if any."""
        hit = np.flatnonzero((self.positions == position) & (self.tokens == token))
        if not len(hit):
            return None
        b = int(hit[0])
        return self.token_ids[self.starts[b]:self.starts[b + 1]]

    def is_well_formed(self, num_speculative_tokens: int, vocab_size: int) -> bool:
        """Every branch's draft has at most num_speculative_tokens tokens, all
        inside the vocabulary."""
        if not len(self):
            return True
        ids = self.token_ids[self.starts[0]:self.starts[-1]]
        return (int(np.diff(self.starts).max()) <= num_speculative_tokens
                and (not len(ids) or (int(ids.min()) >= 0 and int(ids.max()) < vocab_size)))


_NONE32, _ZERO64 = np.zeros(0, dtype=np.int32), np.zeros(1, dtype=np.int64)
#: A draft without branches.
NO_BRANCHES = Branches(_NONE32, _NONE32, _ZERO64, _NONE32)


def leaves_at(draft: Draft, committed: list[int]) -> int | None:
    """The position where ``committed`` (the tokens that became context
    since the draft was proposed) leaves the draft: the first j with
    committed[j] != draft[j], or the draft's length when committed runs past
    it; None when committed is the draft's start."""
    ids = draft.token_ids
    j = 0  # committed[:j] == ids[:j]
    while j < len(committed) and j < len(ids) and committed[j] == ids[j]:
        j += 1
    return None if j == len(committed) else j


def held_after(draft: Draft, branches: Branches, committed: list[int]) -> Draft:
    """What still holds of a draft proposed ahead once ``committed`` tokens
    have become context after the point it was proposed at: the draft past
    them where they are its first tokens, else the branch that leaves the
    draft where they do, past the rest of them; NO_DRAFT where neither
    holds (or nothing of it is left).

    draft: up to 2k + 1 tokens; committed: the tokens since the draft's context."""
    j = leaves_at(draft, committed)
    if j is None:
        return draft.after(len(committed))
    branch = branches.find(j, committed[j])
    rest = committed[j + 1:]
    if branch is None or len(rest) > len(branch) or branch[:len(rest)].tolist() != rest:
        return NO_DRAFT
    return Draft(branch[len(rest):])
