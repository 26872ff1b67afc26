"""The proposer protocol shared by every drafting method.

Vocabulary: a sequence's *context* is its prompt plus the output tokens
accepted so far; *draft tokens* are guesses of the tokens that follow it.

A proposer keeps per-sequence state that is updated incrementally:

    start(seq_id, context, options)   # open a sequence with its whole context
    extend(seq_id, token_ids)         # append tokens accepted since last time
    propose([(seq_id, k), ...])       # up to k draft tokens per sequence
    stop(seq_id, completed)           # free the state (completed: the request
                                      # finished normally, its output may be
                                      # remembered, e.g. by a global tree)

Algorithms never see gRPC messages: the servicer converts them into these
plain calls. Arrays are numpy int32.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class SeqOptions:
    """Per-request proposer knobs (validated by the gateway and the servicer)."""

    min_n: int = 1  # n-gram: shortest match length, >= 1
    max_n: int = 4  # n-gram: longest match length, >= min_n
    max_tree_depth: int = 64  # suffix: longest suffix matched
    max_spec_factor: float = 1.0  # suffix: drafts <= ceil(match_len * factor)
    min_token_prob: float = 0.1  # suffix: cut a path below this probability
    # Token ids of the request's reference text (also drafted from); int32 [r]
    reference_token_ids: np.ndarray = field(
        default_factory=lambda: np.zeros(0, dtype=np.int32))


@dataclass
class Draft:
    """Draft tokens for one sequence."""

    token_ids: np.ndarray  # int32 [n], n <= k
    # Sparse draft probabilities (draft models only): for each draft position
    # the K token ids with non-zero probability and their probabilities.
    # None means one-hot drafts (n-gram, suffix).
    prob_token_ids: np.ndarray | None = None  # int32 [n, K]
    probs: np.ndarray | None = None  # float32 [n, K]


EMPTY_DRAFT_TOKENS = np.zeros(0, dtype=np.int32)


class UnknownSequence(KeyError):
    """The proposer holds no state for this sequence id."""


class Proposer(abc.ABC):
    """One drafting method. Subclasses are constructed from their own config."""

    #: the method name used in requests ("ngram", "suffix", ...)
    name: str = ""

    @abc.abstractmethod
    def start(self, seq_id: str, context: np.ndarray, options: SeqOptions) -> None:
        """Opens (or resets) a sequence with its whole context (int32 [n])."""

    @abc.abstractmethod
    def extend(self, seq_id: str, token_ids: np.ndarray) -> None:
        """Appends accepted tokens (int32 [m]); raises UnknownSequence."""

    @abc.abstractmethod
    def propose(self, requests: list[tuple[str, int]]) -> list[Draft]:
        """Up to k draft tokens for each (seq_id, k); raises UnknownSequence."""

    @abc.abstractmethod
    def stop(self, seq_id: str, completed: bool) -> None:
        """Frees a sequence's state; unknown ids are ignored."""

    @abc.abstractmethod
    def context_len(self, seq_id: str) -> int:
        """Length of the context the proposer holds; raises UnknownSequence."""

    def stats(self) -> dict[str, float]:
        """Replica-level gauges (memory in bytes, live sequences, ...)."""
        return {}


class ContextStore:
    """Growable per-sequence int32 token buffers, shared by simple proposers.

    Invariant: ``buf[seq][:lengths[seq]]`` is the sequence's context.
    """

    def __init__(self) -> None:
        self._bufs: dict[str, np.ndarray] = {}
        self._lens: dict[str, int] = {}

    def start(self, seq_id: str, context: np.ndarray) -> None:
        n = len(context)
        buf = np.empty(max(64, 2 * n), dtype=np.int32)
        buf[:n] = context
        self._bufs[seq_id] = buf
        self._lens[seq_id] = n

    def extend(self, seq_id: str, token_ids: np.ndarray) -> None:
        buf = self._buf(seq_id)
        n, m = self._lens[seq_id], len(token_ids)
        if n + m > len(buf):
            grown = np.empty(max(2 * len(buf), n + m), dtype=np.int32)
            grown[:n] = buf[:n]
            self._bufs[seq_id] = buf = grown
        buf[n:n + m] = token_ids
        self._lens[seq_id] = n + m

    def tokens(self, seq_id: str) -> np.ndarray:
        """A view of the context (int32 [n]); valid until the next extend."""
        return self._buf(seq_id)[: self._lens[seq_id]]

    def length(self, seq_id: str) -> int:
        self._buf(seq_id)
        return self._lens[seq_id]

    def stop(self, seq_id: str) -> None:
        self._bufs.pop(seq_id, None)
        self._lens.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._bufs)

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._bufs.values())

    def _buf(self, seq_id: str) -> np.ndarray:
        try:
            return self._bufs[seq_id]
        except KeyError:
            raise UnknownSequence(seq_id) from None


class NaiveProposer(Proposer):
    """The speculation path with zero drafts: a baseline and a test."""

    name = "naive"

    def __init__(self) -> None:
        self._contexts = ContextStore()

    def start(self, seq_id, context, options):
        self._contexts.start(seq_id, context)

    def extend(self, seq_id, token_ids):
        self._contexts.extend(seq_id, token_ids)

    def propose(self, requests):
        for seq_id, _ in requests:
            self._contexts.length(seq_id)  # raises UnknownSequence
        return [Draft(EMPTY_DRAFT_TOKENS) for _ in requests]

    def stop(self, seq_id, completed):
        self._contexts.stop(seq_id)

    def context_len(self, seq_id):
        return self._contexts.length(seq_id)
