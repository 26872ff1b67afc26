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
    advance(seq_ids, tokens, ...)     # one round of many sequences at once:
                                      # extend each, check its length, draft

Algorithms never see gRPC messages: the servicer converts them into these
plain calls. Arrays are numpy int32; drafts are ``specdec.drafts.Draft``.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field

import numpy as np
from numba import njit

from specdec.drafts import NO_DRAFT, Draft
from specdec.limits import (
    DEFAULT_MAX_N,
    DEFAULT_MAX_SPEC_FACTOR,
    DEFAULT_MAX_TREE_DEPTH,
    DEFAULT_MIN_N,
    DEFAULT_MIN_TOKEN_PROB,
)


@dataclass(frozen=True)
class SeqOptions:
    """Per-request proposer knobs (validated by the gateway and the servicer)."""

    min_n: int = DEFAULT_MIN_N  # n-gram: shortest match length, >= 1
    max_n: int = DEFAULT_MAX_N  # n-gram: longest match length, >= min_n
    max_tree_depth: int = DEFAULT_MAX_TREE_DEPTH  # suffix: longest suffix matched
    max_spec_factor: float = DEFAULT_MAX_SPEC_FACTOR  # suffix: drafts <= ceil(match_len * factor)
    min_token_prob: float = DEFAULT_MIN_TOKEN_PROB  # suffix: cut a path below this probability
    # Token ids of the request's reference text (also drafted from); int32 [r]
    reference_token_ids: np.ndarray = field(
        default_factory=lambda: np.zeros(0, dtype=np.int32))
    temperature: float = 0.0  # draft: the request's temperature (0: greedy drafts)
    seed: int = 0  # draft: the request's seed (sampled drafts depend on it and the position)


@dataclass(frozen=True)
class DraftBatch:
    """The drafts of one ``advance`` call, for n sequences.

    One-hot drafts travel flat: sequence i's are
    ``token_ids[offsets[i]:offsets[i + 1]]``; ``drafts`` is set instead when
    the method's drafts carry probabilities. A sequence whose length did not
    match (``in_sync[i]`` False) has no draft.
    """

    in_sync: np.ndarray  # bool [n]: the held context has the expected length
    token_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))  # int32 [total]
    offsets: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=np.int64))  # int64 [n + 1]
    drafts: list[Draft] | None = None  # per sequence, when drafts carry probabilities


@dataclass
class BranchBatch:
    """The branches of one ``branches`` call, for n sequences (see
    ``specdec.drafts.Branches``): sequence i's are entries
    ``offsets[i]:offsets[i + 1]``; branch b leaves the draft at position
    ``positions[b]`` with token ``tokens[b]``, and its draft is
    ``token_ids[starts[b]:starts[b + 1]]``."""

    offsets: np.ndarray  # int64 [n + 1]
    positions: np.ndarray  # int32 [m]
    tokens: np.ndarray  # int32 [m]
    starts: np.ndarray  # int64 [m + 1]
    token_ids: np.ndarray  # int32 [total]


def bounds_of(counts: np.ndarray) -> np.ndarray:
    """Segment bounds (int64 [n + 1]) of n consecutive segments of ``counts``."""
    bounds = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=bounds[1:])
    return bounds


def by_frequency(context: np.ndarray) -> np.ndarray:
    """The context's distinct tokens, the most frequent first (ties: the
    smaller id; int32 [u]): the tokens a method branches on where its
    matches offer no more (ngram_branches, arena_branches)."""
    tokens, counts = np.unique(context, return_counts=True)
    return tokens[np.argsort(-counts, kind="stable")].astype(np.int32)


class UnknownSequence(KeyError):
    """The proposer holds no state for this sequence id."""


class Proposer(abc.ABC):
    """One drafting method. Subclasses are constructed from their own config."""

    #: the method name used in requests ("ngram", "suffix", ...)
    name: str = ""
    #: target layers whose hidden states the method drafts from (the proto's
    #: Draft.feature_layers: 0 embeddings, i output of decoder layer i); () none
    feature_layers: tuple[int, ...] = ()
    #: values per feature row: the target's hidden size times len(feature_layers)
    feature_dim: int = 0

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

    def add_features(self, seq_id: str, start: int, rows: np.ndarray) -> None:
        """Takes target features (float32 [r, feature_dim]) of context
        positions start .. start + r - 1; ValueError naming the field when
        they do not fit. Only methods with feature_layers take any."""
        raise ValueError(f"features: method {self.name!r} drafts from no target features")

    def features_from(self, seq_id: str) -> int:
        """The context position of the next feature row the sequence needs."""
        return 0

    def stats(self) -> dict[str, float]:
        """Replica-level gauges (memory in bytes, live sequences, ...)."""
        return {}

    def between_messages(self, budget_s: float | None = None) -> bool:
        """Deferred upkeep (e.g. caching finished outputs), in the order it
        was queued: all of it (budget_s None), or steps until budget_s
        seconds have passed (a step may overrun it). True while some is
        left. The servicer runs it in slices while no message waits (off the
        rounds' critical path). Nothing by default."""
        return False

    def upkeep_progress(self) -> tuple[int, int]:
        """(units of deferred upkeep ever queued, units done): the servicer
        bounds how long upkeep may wait with them. (0, 0) by default."""
        return (0, 0)

    def limit_model_steps(self, seq_id: str, steps: int) -> None:
        """Caps the model's draft tokens for seq_id in its next propose
        (SequenceUpdate.model_steps) in a method that drafts from a model or
        a copy (draft_hybrid); its copies keep the whole budget. Others
        ignore it."""
        return None

    def branches(self, seq_ids: list[str], drafts: np.ndarray, offsets: np.ndarray, ks: np.ndarray,
                 depths: np.ndarray, width: int) -> BranchBatch | None:
        """Branches of the drafts an ``advance`` just made (drafting ahead,
        RoundUpdates.branch_width): for sequence i, whose draft is
        ``drafts[offsets[i]:offsets[i + 1]]`` (int32, offsets int64 [n + 1]),
        at each position j <= min(depths[i], its draft's length), up to
        ``width`` likely tokens t other than the draft's own, each with the
        draft of at most ``ks[i] - depths[i] - 1`` tokens that the method
        would make after ``draft[:j] + [t]``; depths, ks: int64 [n]. None:
        the method makes no branches (the default)."""
        return None

    def ahead(self, seq_ids: list[str], drafts: np.ndarray, offsets: np.ndarray, ks: np.ndarray,
              ahead_ks: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """Drafting ahead (RoundUpdates.ahead_ks): the drafts an ``advance``
        just made (sequence i's ``drafts[offsets[i]:offsets[i + 1]]``, int32,
        offsets int64 [n + 1]), each that ends within the first
        ``ahead_ks[i] + 1`` tokens (the round being verified: its drafts and
        target token; 0: not drafting ahead) continued by what the method
        would draft once it is appended, to at most ``ks[i]`` tokens in all;
        (token_ids, offsets) as advance's. None: the drafts stand (the
        default: a method that drafts its whole budget where it can)."""
        return None

    def advance(self, seq_ids: list[str], tokens: np.ndarray, bounds: np.ndarray, context_lens: np.ndarray,
                ks: np.ndarray) -> DraftBatch:
        """One round of n open sequences: appends ``tokens[bounds[i]:bounds[i + 1]]``
        (int32, bounds int64 [n + 1]) to each in order, then drafts up to
        ``ks[i]`` (int64 [n]) tokens for each whose context length equals
        ``context_lens[i]`` (int64 [n]; 0: not checked). Same results as
        ``extend`` on each, then ``propose`` on the in-sync ones with k > 0;
        methods override it to do a round in a few calls. Raises
        UnknownSequence (before changing anything) for an id it does not hold.
        """
        for seq_id in seq_ids:
            self.context_len(seq_id)
        for i, seq_id in enumerate(seq_ids):
            if bounds[i + 1] > bounds[i]:
                self.extend(seq_id, tokens[bounds[i]:bounds[i + 1]])
        in_sync = np.array([not n or self.context_len(s) == n for s, n in zip(seq_ids, context_lens.tolist())],
                           dtype=bool)
        wanted = [i for i in range(len(seq_ids)) if in_sync[i] and ks[i] > 0]
        drafts = [NO_DRAFT] * len(seq_ids)
        for i, draft in zip(wanted, self.propose([(seq_ids[i], int(ks[i])) for i in wanted])):
            drafts[i] = draft.truncated(int(ks[i]))
        return DraftBatch(in_sync, drafts=drafts)


#: compiles a numba kernel that allocates nothing without numba's reference
#: counting (NRT). With it, a call of a kernel that is not inlined increfs
#: and decrefs each array argument, and so does each slice a kernel takes:
#: two atomic operations each, 13 % of a suffix proposer's samples at B=256
#: (perf, AMD EPYC). Such a kernel cannot allocate (numba refuses to compile
#: one that does); its callers pass it work space.
njit_leaf = njit(cache=True, _nrt=False)  # type: ignore[call-overload]  # (numba's stubs omit _nrt)


@njit_leaf
def _append_many(pool, starts, lens, slots, tokens, bounds):
    """Appends tokens[bounds[i]:bounds[i + 1]] to slot slots[i], in order
    (the slots have room: ContextStore.append_many reserved it)."""
    for i in range(slots.shape[0]):
        s = slots[i]
        at = starts[s] + lens[s]
        for j in range(bounds[i], bounds[i + 1]):
            pool[at] = tokens[j]
            at += 1
        lens[s] += bounds[i + 1] - bounds[i]


class ContextStore:
    """Per-sequence int32 token buffers, shared by simple proposers: one pool,
    a slot per sequence (so numba can walk many sequences in one call).

    Invariant: ``pool[starts[s] : starts[s] + lens[s]]`` is the context of the
    sequence in slot s, ``lens[s] <= caps[s]``, and live slots' regions
    ``[starts[s], starts[s] + caps[s])`` do not overlap; regions of stopped or
    moved slots are garbage, reclaimed when the pool is compacted.
    """

    def __init__(self) -> None:
        self.slot_of: dict[str, int] = {}
        self._free: list[int] = []  # slots to reuse
        self.pool = np.zeros(1024, dtype=np.int32)
        self.pool_end = 0  # end of the used part of the pool
        self.starts = np.zeros(16, dtype=np.int64)  # by slot
        self.lens = np.zeros(16, dtype=np.int64)
        self.caps = np.zeros(16, dtype=np.int64)

    def start(self, seq_id: str, context: np.ndarray) -> int:
        """Opens (or resets) a sequence; returns its slot."""
        self.stop(seq_id)
        slot = self._free.pop() if self._free else self._new_slot()
        n = len(context)
        self._place(slot, max(64, 2 * n))
        self.pool[self.starts[slot]:self.starts[slot] + n] = context
        self.lens[slot] = n
        self.slot_of[seq_id] = slot
        return slot

    def extend(self, seq_id: str, token_ids: np.ndarray) -> None:
        slot = self.slot(seq_id)
        n, m = int(self.lens[slot]), len(token_ids)
        self._reserve(slot, n + m)
        at = int(self.starts[slot]) + n
        self.pool[at:at + m] = token_ids
        self.lens[slot] = n + m

    def append_many(self, slots: np.ndarray, tokens: np.ndarray, bounds: np.ndarray) -> None:
        """Appends tokens[bounds[i]:bounds[i + 1]] to slot slots[i] (int64 [n]), in order."""
        totals = self.lens.copy()
        np.add.at(totals, slots, np.diff(bounds))
        for slot in np.unique(slots[totals[slots] > self.caps[slots]]).tolist():
            self._reserve(slot, int(totals[slot]))
        _append_many(self.pool, self.starts, self.lens, slots, tokens, bounds)

    def tokens(self, seq_id: str) -> np.ndarray:
        """A view of the context (int32 [n]); valid until the next extend."""
        slot = self.slot(seq_id)
        return self.pool[self.starts[slot]:self.starts[slot] + self.lens[slot]]

    def length(self, seq_id: str) -> int:
        return int(self.lens[self.slot(seq_id)])

    def slot(self, seq_id: str) -> int:
        try:
            return self.slot_of[seq_id]
        except KeyError:
            raise UnknownSequence(seq_id) from None

    def slots(self, seq_ids: list[str]) -> np.ndarray:
        """The slots of ``seq_ids`` (int64 [n]); raises UnknownSequence."""
        try:
            return np.array([self.slot_of[s] for s in seq_ids], dtype=np.int64)
        except KeyError as e:
            raise UnknownSequence(e.args[0]) from None

    def stop(self, seq_id: str) -> None:
        slot = self.slot_of.pop(seq_id, None)
        if slot is not None:
            self.lens[slot] = self.caps[slot] = 0
            self._free.append(slot)

    def __len__(self) -> int:
        return len(self.slot_of)

    def nbytes(self) -> int:
        return self.pool.nbytes + self.starts.nbytes + self.lens.nbytes + self.caps.nbytes

    def _new_slot(self) -> int:
        slot = len(self.slot_of) + len(self._free)
        if slot == len(self.starts):
            self.starts, self.lens, self.caps = (np.concatenate([a, np.zeros_like(a)])
                                                 for a in (self.starts, self.lens, self.caps))
        return slot

    def _reserve(self, slot: int, total: int) -> None:
        """Moves the slot to a region of >= total tokens when it is smaller."""
        if total <= self.caps[slot]:
            return
        n, old = int(self.lens[slot]), int(self.starts[slot])
        self.caps[slot] = 0  # not live while it moves: compaction skips it
        tokens = self.pool[old:old + n].copy()
        self._place(slot, 2 * total)
        self.pool[self.starts[slot]:self.starts[slot] + n] = tokens

    def _place(self, slot: int, cap: int) -> None:
        """Gives the slot a fresh region of cap tokens at the pool's end."""
        if self.pool_end + cap > len(self.pool):
            self._compact(cap)
        self.starts[slot], self.caps[slot] = self.pool_end, cap
        self.pool_end += cap

    def _compact(self, extra: int) -> None:
        """Packs the live regions at the start of a pool with room for extra more."""
        live = [s for s in self.slot_of.values() if self.caps[s] > 0]
        used = int(sum(self.caps[s] for s in live))
        pool = np.zeros(max(len(self.pool), 2 * (used + extra)), dtype=np.int32)
        at = 0
        for s in live:
            start, n = int(self.starts[s]), int(self.lens[s])
            pool[at:at + n] = self.pool[start:start + n]
            self.starts[s] = at
            at += int(self.caps[s])
        self.pool, self.pool_end = pool, at


class NaiveProposer(Proposer):
    """The speculation path with zero drafts: a baseline and a test."""

    name = "naive"

    def __init__(self) -> None:
        self._contexts = ContextStore()

    def start(self, seq_id, context, options):
        self._contexts.start(seq_id, np.asarray(context, dtype=np.int32))

    def extend(self, seq_id, token_ids):
        self._contexts.extend(seq_id, token_ids)

    def propose(self, requests):
        for seq_id, _ in requests:
            self._contexts.length(seq_id)  # raises UnknownSequence
        return [NO_DRAFT for _ in requests]

    def advance(self, seq_ids, tokens, bounds, context_lens, ks):
        slots = self._contexts.slots(seq_ids)  # raises UnknownSequence
        self._contexts.append_many(slots, tokens, bounds)
        lens = self._contexts.lens[slots]
        return DraftBatch((context_lens == 0) | (lens == context_lens), offsets=np.zeros(len(seq_ids) + 1, np.int64))

    def stop(self, seq_id, completed):
        self._contexts.stop(seq_id)

    def context_len(self, seq_id):
        return self._contexts.length(seq_id)
