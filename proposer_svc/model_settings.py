"""Replica-level settings of the model-based proposers (draft and
draft_hybrid, eagle3 and mtp), apart from their torch code: the registry
and a proposer that serves only copying methods (ngram, suffix, hybrid)
never load torch, which took ~2 s of such a proposer's start."""
from __future__ import annotations

from dataclasses import dataclass

from specdec.engine.config import EngineConfig
from specdec.limits import DEFAULT_DRAFT_MAX_BATCH, DEFAULT_DRAFT_TOP_K


@dataclass(frozen=True)
class DraftConfig:
    """Replica-level settings of the draft proposer."""

    top_k: int = DEFAULT_DRAFT_TOP_K  # sampled drafts: support of q
    max_batch: int = DEFAULT_DRAFT_MAX_BATCH  # more sequences in one call: no drafts
    # draft logits columns at or past this id are never drafted (the target's
    # vocabulary when the draft's head is larger); None: the whole head
    vocab_limit: int | None = None
    # a reduced draft head: logits column j is target token head_token_ids[j]
    # (the engine was built with the same ids); None: column j is token j
    head_token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class HeadConfig:
    """Replica-level settings of a feature-head proposer."""

    top_k: int = DEFAULT_DRAFT_TOP_K  # sampled drafts: support of q
    max_batch: int = DEFAULT_DRAFT_MAX_BATCH  # more sequences in one call: no drafts


@dataclass(frozen=True)
class DraftModelSettings:
    """What ``specdec proposer --draft-model ...`` asks for."""

    engine: EngineConfig  # the draft model and how to run it
    target_model: str  # the target whose tokenizer the draft must share
    draft: DraftConfig = DraftConfig()
