"""The ``draft`` proposer: a small causal LM sharing the target's tokenizer,
run on the shared model runtime (``specdec.engine``), drafts for every
sequence of a round together.

Per sequence the draft engine holds a KV cache of ``cached`` tokens: a prefix
of the context plus the draft tokens it fed itself last round. Invariant
(between calls): ``engine.cached_len(seq) == len(state.cached)``.

One ``propose`` call:

1. catch-up: each sequence's cache is rolled back to its longest prefix that
   still agrees with the context (rejected drafts go, accepted ones stay) and
   the context tokens after it are fed (the new accepted tokens, or the
   whole context on a sequence's first round); the same ragged forward gives
   the logits of the first draft position;
2. one ragged forward per further draft step, feeding every sequence's
   previous draft token.

Token choice (``choose_tokens``): the argmax at temperature 0; otherwise a
sample from the draft's own top-K at the request's temperature, renormalised,
with the uniform fixed by the request's seed and the token's position. The K
probabilities are sent along in both cases: the scorer's rejection sampling
stays exact with them (it verifies against q; greedy verification ignores
q), and the gateway's adaptive draft length reads the draft's confidence
from them.

Draft length adapts to the draft's own confidence: a draft stops where the
product of its tokens' draft probabilities falls below the request's
``min_token_prob``; that product summed over the draft is its expected
number of accepted tokens (``ScoredDraft.score``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from specdec.drafts import EMPTY_DRAFT_TOKENS, Draft
from specdec.engine.base import Engine, ForwardItem, PoolExhausted
from specdec.limits import is_greedy
from specdec.proposer_svc import draft_ops
from specdec.proposer_svc.base import ContextStore, Proposer, SeqOptions
from specdec.proposer_svc.model_settings import DraftConfig

_MASK64 = (1 << 64) - 1
#: Mixed into the seed so that draft randomness is not the scorer's.
DRAFT_RANDOM_STREAM = 0xD7AF7


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def seeded_uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) fixed by (seed, position)."""
    z = _splitmix64((_splitmix64(seed ^ DRAFT_RANDOM_STREAM) + position) & _MASK64)
    return (z >> 11) / float(1 << 53)


@dataclass
class TokenChoice:
    """One draft position's token and what the draft thinks of it."""

    token: int
    prob: float  # the draft's probability of the token (its confidence)
    sparse_ids: np.ndarray  # int32 [K]: the draft's top-K, the support of q
    sparse_probs: np.ndarray  # float32 [K], sums to 1

    def to_target_ids(self, head_ids: np.ndarray) -> "TokenChoice":
        """The same choice with logits columns turned into target token ids
        (a reduced draft head: column j is token head_ids[j])."""
        return TokenChoice(int(head_ids[self.token]), self.prob, head_ids[self.sparse_ids], self.sparse_probs)


def choose_tokens(logits: torch.Tensor, temperatures: list[float], seeds: list[int],
                  positions: list[int], top_k: int) -> list[TokenChoice]:
    """One token per logits row (float32 [n, V]): the argmax at temperature 0,
    else a seeded sample from the row's top-K at its temperature. Either way
    the row's top-K, renormalised at that temperature (1 when greedy), goes
    along as the sparse q: the scorer's rejection sampling needs it, and the
    gateway reads the draft's confidence from it (greedy verification ignores
    q, so greedy output does not depend on it)."""
    choices: list[TokenChoice] = []
    scale = [1.0 if is_greedy(t) else t for t in temperatures]
    greedy_probs, top_values, top_ids = _top_k(logits, scale, min(top_k, logits.shape[-1]))
    for row, (t, seed, pos) in enumerate(zip(temperatures, seeds, positions)):
        values, ids = top_values[row], top_ids[row]  # [K], [K], descending
        q = np.exp(values - values[0])  # float64 [K]: the softmax of the top K
        q32 = (q / q.sum()).astype(np.float32)
        q32 /= q32.sum()
        sparse_ids = ids.astype(np.int32)
        if is_greedy(t):
            choices.append(TokenChoice(int(ids[0]), float(greedy_probs[row]), sparse_ids, q32))
            continue
        j = int(np.searchsorted(np.cumsum(q32, dtype=np.float64), seeded_uniform(seed, pos), side="right"))
        j = min(j, int(np.flatnonzero(q32)[-1]))  # rounding at the top end
        choices.append(TokenChoice(int(ids[j]), float(q32[j]), sparse_ids, q32))
    return choices


def _top_k(logits: torch.Tensor, scale: list[float], k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(each row's greedy probability float64 [n], its k largest logits over
    its scale float64 [n, k] descending, their columns int64 [n, k]). A CPU
    draft's logits in numpy: a few one-row torch ops cost ~0.2 ms a draft
    step there, more than a Q8_0 head's GEMMs; a GPU draft's on the device,
    then one copy to the host."""
    if logits.device.type == "cpu":
        return draft_ops.top_k(np.ascontiguousarray(logits.float().numpy()), np.asarray(scale, np.float64), k)
    greedy_probs = torch.softmax(logits.double(), dim=-1).max(dim=-1).values
    by = torch.tensor(scale, dtype=torch.float64, device=logits.device)
    values, ids = torch.topk(logits.double() / by[:, None], k, dim=-1)
    return greedy_probs.cpu().numpy(), values.cpu().numpy(), ids.cpu().numpy()


@dataclass
class ScoredDraft:
    draft: Draft
    score: float  # expected accepted tokens: sum over the draft of its cumulative draft probability


@dataclass
class _SeqState:
    options: SeqOptions
    cached: np.ndarray = field(default_factory=lambda: EMPTY_DRAFT_TOKENS)  # int32: tokens in the KV cache


@dataclass
class DraftRun:
    """One sequence's draft being built in this call."""

    seq_id: str
    context: np.ndarray  # int32 [n]
    budget: int  # most draft tokens
    min_prob: float  # stop below this cumulative draft probability
    tokens: list[int] = field(default_factory=list)
    fed: int = 0  # draft tokens fed to the engine
    cum_prob: float = 1.0
    score: float = 0.0
    sparse: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    stopped: bool = False

    def add(self, choice: TokenChoice) -> None:
        cum = self.cum_prob * choice.prob
        if cum < self.min_prob:
            self.stopped = True
            return
        self.cum_prob, self.score = cum, self.score + cum
        self.tokens.append(choice.token)
        self.sparse.append((choice.sparse_ids, choice.sparse_probs))
        self.stopped = len(self.tokens) >= self.budget

    def draft(self) -> Draft:
        ids = np.asarray(self.tokens, dtype=np.int32)
        if not self.sparse:
            return Draft(ids)
        return Draft(ids, tuple(s[0] for s in self.sparse), tuple(s[1] for s in self.sparse))


class DraftModelProposer(Proposer):
    """Drafts with a small LM on an engine the proposer owns (see module doc)."""

    name = "draft"

    def __init__(self, engine: Engine, config: DraftConfig = DraftConfig()) -> None:
        if config.top_k < 1 or config.max_batch < 1:
            raise ValueError(f"draft top_k and max_batch must be >= 1, got {config.top_k}, {config.max_batch}")
        self.engine = engine
        # before the first round: a GPU draft compiles its kernels and captures its graphs here, not
        # while a gateway waits (its proposer deadline is far shorter than a compile)
        engine.prepare(config.max_batch)
        self.config = config
        self._head_ids = None if config.head_token_ids is None else np.asarray(config.head_token_ids, np.int32)
        self._contexts = ContextStore()
        self._seqs: dict[str, _SeqState] = {}

    def start(self, seq_id, context, options):
        self.stop(seq_id, completed=False)
        self._contexts.start(seq_id, context)
        self._seqs[seq_id] = _SeqState(options)

    def extend(self, seq_id, token_ids):
        self._contexts.extend(seq_id, token_ids)

    def stop(self, seq_id, completed):
        self._contexts.stop(seq_id)
        if self._seqs.pop(seq_id, None) is not None:
            self.engine.release(seq_id)

    def context_len(self, seq_id):
        return self._contexts.length(seq_id)

    def propose(self, requests):
        return [s.draft for s in self.propose_scored(requests)]

    def propose_scored(self, requests: list[tuple[str, int]]) -> list[ScoredDraft]:
        """Drafts with their expected accepted tokens; raises UnknownSequence."""
        contexts = [self._contexts.tokens(seq_id) for seq_id, _ in requests]  # raises UnknownSequence
        out = [ScoredDraft(Draft(EMPTY_DRAFT_TOKENS), 0.0) for _ in requests]
        if len(requests) > self.config.max_batch:
            return out
        runs: list[tuple[int, DraftRun]] = []
        items: list[ForwardItem] = []
        for i, ((seq_id, k), context) in enumerate(zip(requests, contexts)):
            run = self._open_run(seq_id, k, context)
            if run is not None:
                keep = len(self._seqs[seq_id].cached)
                runs.append((i, run))
                items.append(ForwardItem(seq_id, context[keep:].copy(), 1))
        self._draft_steps([r for _, r in runs], items)
        for i, run in runs:
            self._seqs[run.seq_id].cached = np.concatenate(
                [run.context, np.asarray(run.tokens[:run.fed], dtype=np.int32)])
            out[i] = ScoredDraft(run.draft(), run.score)
        return out

    def _open_run(self, seq_id: str, k: int, context: np.ndarray) -> DraftRun | None:
        """Rolls seq_id's cache back to what the context still agrees with and
        reserves room for the draft; None when there is no room for one."""
        state = self._seqs[seq_id]
        budget = min(k, self.engine.facts.max_model_len - len(context) + 1)
        if budget < 1 or len(context) == 0:
            return None
        keep = _common_prefix(state.cached, context, limit=len(context) - 1)
        if keep < self.engine.cached_len(seq_id):
            self.engine.truncate(seq_id, keep)
        state.cached = context[:keep].copy()
        try:
            self.engine.ensure_capacity(seq_id, len(context) + budget - 1)
        except PoolExhausted:  # no drafts this round; the KV of others stays
            self.engine.release(seq_id)
            state.cached = EMPTY_DRAFT_TOKENS
            return None
        return DraftRun(seq_id, context, budget, state.options.min_token_prob)

    def _draft_steps(self, runs: list[DraftRun], items: list[ForwardItem]) -> None:
        """One ragged forward per draft step until every run stopped."""
        limit = self.config.vocab_limit
        while items:
            logits = self.engine.forward(items).logits  # [len(items), V]
            if limit is not None and logits.shape[-1] > limit:
                logits = logits[:, :limit]
            opts = [self._seqs[r.seq_id].options for r in runs]
            choices = choose_tokens(logits, [o.temperature for o in opts], [o.seed for o in opts],
                                    [len(r.context) + len(r.tokens) for r in runs], self.config.top_k)
            if self._head_ids is not None:
                choices = [c.to_target_ids(self._head_ids) for c in choices]
            next_runs, next_items = [], []
            for run, choice in zip(runs, choices):
                run.add(choice)
                if not run.stopped:
                    run.fed += 1
                    next_runs.append(run)
                    next_items.append(ForwardItem(run.seq_id, np.asarray(run.tokens[-1:], dtype=np.int32), 1))
            runs, items = next_runs, next_items

    def stats(self):
        return {"live_sequences": float(len(self._seqs)), "memory_bytes": float(self._contexts.nbytes()),
                "kv_free_tokens": float(self.engine.free_tokens())}


def _common_prefix(a: np.ndarray, b: np.ndarray, limit: int) -> int:
    """Length of the longest common prefix of a and b, at most limit."""
    n = min(len(a), len(b), limit)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n
