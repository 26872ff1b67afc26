"""The ``eagle3`` and ``mtp`` proposers: a feature head (``eagle3.FeatureHead``)
drafting from the target's hidden states, which the gateway relays from the
scorer with the tokens they belong to.

Per sequence the proposer holds the context, the head's KV cache and the
target features it has not fed yet. Invariant (between calls): the cache
holds head rows ``base .. p - 1`` and ``pending`` the features of positions
``p .. p + len(pending) - 1``; the features the gateway sends next start at
``p + len(pending)`` (``features_from``). A head row i needs ``f_i`` and the
token ``x_{i+1}``, so with a context of n tokens rows up to n - 2 can run.

One ``propose`` call:

1. catch-up: every sequence feeds its runnable pending rows ``p .. q``
   (q = min(n - 2, last feature)), all sequences in one ragged forward;
   the last row's output predicts ``x_{q+2}``;
2. where q == n - 2 that is the first draft token; each further step feeds
   the previous draft token with the head's own output hidden state of the
   previous row, one ragged forward per step (chain drafting, as EAGLE);
3. the cache is cut back to rows ``base .. q - 1``: the draft rows used the
   head's own features, and row q is recomputed next round so that its
   output is at hand again (``f_q`` stays pending).

Token choice is the draft proposer's (``draft.choose_tokens``): argmax at
temperature 0, else a sample from the head's top-K at the request's
temperature seeded by request seed and position, sent with its sparse
probabilities; draft-vocabulary ids are mapped to target ids first.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from specdec.drafts import EMPTY_DRAFT_TOKENS, Draft
from specdec.proposer_svc.base import ContextStore, Proposer, SeqOptions, UnknownSequence
from specdec.proposer_svc.draft import DraftRun, TokenChoice, choose_tokens
from specdec.proposer_svc.eagle3 import FeatureHead, HeadCache, HeadItem
from specdec.proposer_svc.model_settings import HeadConfig


class FeatureGap(ValueError):
    """Features that leave a gap or run past the context; the message names the field."""


@dataclass
class _SeqState:
    options: SeqOptions
    cache: HeadCache
    pending: torch.Tensor  # bfloat16 [m, head.spec.feature_dim]: features of positions p .. p + m - 1 (wire values)
    started: bool = False  # features received (base is fixed by the first ones)

    @property
    def next_row(self) -> int:
        """p: the position of the next head row."""
        return self.cache.base + self.cache.length


@dataclass
class _Catchup:
    """One sequence's part of a round."""

    index: int  # in the request list
    seq_id: str
    run: DraftRun | None  # None: catch up only (its features lag behind its tokens)
    last_row: int  # q
    feedback: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [1, hidden]


class FeatureDraftProposer(Proposer):
    """Drafts with a feature head (module doc); ``name`` is "eagle3" or "mtp"."""

    def __init__(self, name: str, head: FeatureHead, config: HeadConfig = HeadConfig()) -> None:
        if config.top_k < 1 or config.max_batch < 1:
            raise ValueError(f"top_k and max_batch must be >= 1, got {config.top_k}, {config.max_batch}")
        self.name = name
        self.head = head
        self.config = config
        # the head may read a layer twice (vLLM's default (2, L // 2, L - 3) on a 5-layer target is
        # (2, 2, 2)): each layer travels once and is repeated here
        spec = head.spec
        self.feature_layers = tuple(dict.fromkeys(spec.feature_layers))
        self.feature_dim = spec.target_hidden_size * len(self.feature_layers)
        hidden = np.arange(spec.target_hidden_size)
        self._columns = (None if self.feature_layers == spec.feature_layers else np.concatenate(
            [self.feature_layers.index(layer) * spec.target_hidden_size + hidden for layer in spec.feature_layers]))
        self._contexts = ContextStore()
        self._seqs: dict[str, _SeqState] = {}

    def start(self, seq_id, context, options):
        self._contexts.start(seq_id, context)
        spec = self.head.spec
        self._seqs[seq_id] = _SeqState(options, HeadCache(spec.num_kv_heads, spec.head_dim),
                                       torch.zeros(0, spec.feature_dim, dtype=torch.bfloat16))

    def extend(self, seq_id, token_ids):
        self._contexts.extend(seq_id, token_ids)

    def stop(self, seq_id, completed):
        self._contexts.stop(seq_id)
        self._seqs.pop(seq_id, None)

    def context_len(self, seq_id):
        return self._contexts.length(seq_id)

    def features_from(self, seq_id: str) -> int:
        """The context position of the next feature row this sequence needs."""
        st = self._state(seq_id)
        return st.next_row + len(st.pending)

    def add_features(self, seq_id: str, start: int, rows: np.ndarray) -> None:
        """Target features (float32 [r, feature_dim]) of positions start ..
        start + r - 1. The first ones fix where the head's cache starts (a
        window of a long prompt); rows already held are skipped (a re-prefill
        resends them); a gap or a row past the context raises FeatureGap."""
        st = self._state(seq_id)
        n = self._contexts.length(seq_id)
        if start + len(rows) > n:
            raise FeatureGap(f"features.rows: positions {start}..{start + len(rows) - 1} run past the context "
                             f"({n} tokens)")
        if not st.started:
            st.cache.base, st.started = start, True
        want = self.features_from(seq_id)
        if start > want:
            raise FeatureGap(f"features.start: {start} leaves a gap; this sequence needs position {want} next")
        if self._columns is not None:  # [r, head's feature_dim]
            rows = rows[:, self._columns]
        fresh = torch.from_numpy(np.ascontiguousarray(rows[want - start:])).to(torch.bfloat16)  # exact: wire values
        if len(fresh):
            st.pending = torch.cat([st.pending, fresh])

    def propose(self, requests):
        contexts = [self._contexts.tokens(seq_id) for seq_id, _ in requests]  # raises UnknownSequence
        out = [Draft(EMPTY_DRAFT_TOKENS) for _ in requests]
        if len(requests) > self.config.max_batch:
            return out
        parts, items = self._catchup_items(requests, contexts)
        if not items:
            return out
        feedback, logits = self.head.forward(items)
        ends = torch.cumsum(torch.tensor([len(it.token_ids) for it in items]), 0) - 1
        drafting = []
        for part, end, row_logits in zip(parts, ends, logits):
            part.feedback = feedback[end:end + 1]
            if part.run is not None:
                drafting.append((part, row_logits))
        self._chain([p for p, _ in drafting], torch.stack([lg for _, lg in drafting]) if drafting else None)
        for part in parts:
            st = self._seqs[part.seq_id]
            st.cache.length = part.last_row - st.cache.base  # rows base .. q - 1 (module doc, step 3)
            if part.run is not None:
                out[part.index] = part.run.draft()
        return out

    def _catchup_items(self, requests, contexts) -> tuple[list[_Catchup], list[HeadItem]]:
        """Each sequence's runnable pending rows p .. q as a head item; the
        features that fed them leave ``pending`` except f_q (module doc)."""
        parts, items = [], []
        for i, ((seq_id, k), context) in enumerate(zip(requests, contexts)):
            st = self._seqs[seq_id]
            p, n = st.next_row, len(context)
            q = min(n - 2, p + len(st.pending) - 1)
            if q < p:
                continue
            rows = st.pending[:q - p + 1]
            st.pending = st.pending[q - p:]
            run = DraftRun(seq_id, context, k, st.options.min_token_prob) if q == n - 2 and k > 0 else None
            parts.append(_Catchup(i, seq_id, run, q))
            items.append(HeadItem(st.cache, torch.from_numpy(context[p + 1:q + 2].astype(np.int64)),
                                  self.head.fuse(rows.float())))
        return parts, items

    def _chain(self, parts: list[_Catchup], logits: torch.Tensor | None) -> None:
        """Chain drafting from each part's last catch-up row: logits
        [len(parts), draft_vocab] predict its first draft token."""
        while parts and logits is not None:
            for part, choice in zip(parts, self._choose(parts, logits)):
                assert part.run is not None
                part.run.add(choice)
            parts = [p for p in parts if p.run is not None and not p.run.stopped]
            if not parts:
                return
            items = [HeadItem(self._seqs[p.seq_id].cache, torch.tensor(p.run.tokens[-1:], dtype=torch.int64),
                              p.feedback) for p in parts if p.run is not None]
            feedback, logits = self.head.forward(items)
            for j, part in enumerate(parts):
                part.feedback = feedback[j:j + 1]

    def _choose(self, parts: list[_Catchup], logits: torch.Tensor) -> list[TokenChoice]:
        """One token per part in target ids (draft-vocabulary ids mapped)."""
        runs = [p.run for p in parts if p.run is not None]
        opts = [self._seqs[r.seq_id].options for r in runs]
        choices = choose_tokens(logits, [o.temperature for o in opts], [o.seed for o in opts],
                                [len(r.context) + len(r.tokens) for r in runs], self.config.top_k)
        to_target = self.head.draft_to_target
        return [replace(c, token=int(to_target[c.token]),
                        sparse_ids=None if c.sparse_ids is None else to_target[c.sparse_ids].numpy().astype(np.int32))
                for c in choices]

    def _state(self, seq_id: str) -> _SeqState:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequence(seq_id) from None

    def stats(self):
        held = sum(st.cache.nbytes() + st.pending.nbytes for st in self._seqs.values())
        return {"live_sequences": float(len(self._seqs)), "memory_bytes": float(self._contexts.nbytes() + held)}
