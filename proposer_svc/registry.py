"""Builds the proposers a replica serves, by method name, from the replica's
settings."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specdec.drafts import ONE_HOT_METHODS
from specdec.limits import HEAD_PROJECTION_DTYPE
from specdec.proposer_svc.base import NaiveProposer, Proposer
from specdec.proposer_svc.hybrid import HybridConfig, HybridProposer
from specdec.proposer_svc.model_settings import DraftModelSettings, HeadConfig
from specdec.proposer_svc.ngram import NgramProposer
from specdec.proposer_svc.suffix import SuffixConfig, SuffixProposer

if TYPE_CHECKING:
    from specdec.proposer_svc.draft import DraftModelProposer

#: method names accepted by `build_proposers` (and in requests)
SUPPORTED_METHODS = (*ONE_HOT_METHODS, "draft", "draft_hybrid", "eagle3", "mtp")
#: methods that run a draft model (need ReplicaSettings.draft)
MODEL_METHODS = ("draft", "draft_hybrid")
#: methods that draft from the target's hidden states (need ReplicaSettings.heads)
FEATURE_METHODS = ("eagle3", "mtp")
#: methods drafting from suffix trees, whose global tree keeps finished outputs across requests
#: (SuffixConfig.max_cached_requests, `specdec proposer --max-cached-requests`)
SUFFIX_METHODS = ("suffix", "hybrid", "draft_hybrid")
#: methods that copy from the context (no model, no settings required; one-hot drafts)
COPY_METHODS = ONE_HOT_METHODS


@dataclass(frozen=True)
class FeatureHeadSettings:
    """What ``specdec proposer --eagle3 DIR`` / ``--methods mtp`` ask for."""

    target_model: str  # the scorer's model: shared embeddings (eagle3), the MTP layers' checkpoint (mtp)
    eagle3: str | None = None  # EAGLE-3 head directory (public layout)
    head: HeadConfig = field(default_factory=HeadConfig)
    projection_dtype: str = HEAD_PROJECTION_DTYPE  # the projection weights (eagle3.HEAD_PROJECTION_DTYPES)
    # torch and GEMM threads of the head (process-wide, as --draft-threads); None: 1 for a head too small to
    # gain from more (MULTITHREAD_MIN_LAYER_BYTES), else as the engine's default
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads (--draft-threads) must be >= 1, got {self.threads}")


@dataclass(frozen=True)
class ReplicaSettings:
    """Replica-level settings (command-line flags), by the proposer that uses them."""

    suffix: SuffixConfig = field(default_factory=SuffixConfig)  # suffix trees of suffix and hybrids
    draft: DraftModelSettings | None = None  # the draft model of draft and draft_hybrid
    heads: FeatureHeadSettings | None = None  # the heads of eagle3 and mtp


def build_proposers(methods: list[str], settings: ReplicaSettings | None = None) -> dict[str, Proposer]:
    """One proposer per distinct method, keyed by its name. Raises ValueError
    naming the first unsupported method, or a model method without a draft
    model, before building any. The model methods share one draft engine."""
    settings = settings or ReplicaSettings()
    unknown = [m for m in methods if m not in SUPPORTED_METHODS]
    if unknown:
        raise ValueError(f"unsupported proposer method {unknown[0]!r}; supported: {', '.join(SUPPORTED_METHODS)}")
    wanted = list(dict.fromkeys(methods))
    model = None
    if any(m in MODEL_METHODS for m in wanted):
        if settings.draft is None:
            raise ValueError(f"{', '.join(m for m in wanted if m in MODEL_METHODS)}: needs a draft model "
                             f"(--draft-model)")
        from specdec.proposer_svc.draft_model import build_draft_proposer

        model = build_draft_proposer(settings.draft)
    built = {m: _build_feature(m, settings) for m in wanted if m in FEATURE_METHODS}
    return {m: built[m] if m in built else _build(m, settings, model) for m in wanted}


def _build_feature(method: str, settings: ReplicaSettings) -> Proposer:
    """The eagle3 proposer (--eagle3 DIR) or the mtp proposer (the target
    checkpoint's MTP layers); ValueError saying what is missing."""
    from specdec.engine.llama import MULTITHREAD_MIN_LAYER_BYTES, default_num_threads
    from specdec.proposer_svc.eagle3 import load_eagle3, load_mtp, projection_dtype_name
    from specdec.proposer_svc.feature_draft import FeatureDraftProposer

    heads = settings.heads
    if heads is None:
        raise ValueError(f"{method}: needs the target model (--target-model)")
    dtype = projection_dtype_name(heads.projection_dtype)  # ValueError naming the choices
    if method == "mtp":
        head = load_mtp(heads.target_model, dtype)
    elif heads.eagle3:
        head = load_eagle3(heads.eagle3, heads.target_model, dtype)
    else:
        raise ValueError("eagle3: needs an EAGLE-3 head (--eagle3 DIR)")
    # as the engine does for small layers: a second thread costs more than it saves (process-wide)
    threads = heads.threads or (default_num_threads() if head.weight_bytes() >= MULTITHREAD_MIN_LAYER_BYTES else 1)
    head.set_threads(threads)
    return FeatureDraftProposer(method, head, heads.head)


def _build(method: str, settings: ReplicaSettings, model: DraftModelProposer | None) -> Proposer:
    if method == "naive":
        return NaiveProposer()
    if method == "ngram":
        return NgramProposer()
    if method == "suffix":
        return SuffixProposer(settings.suffix)
    if method == "hybrid":
        return HybridProposer(HybridConfig(suffix=settings.suffix))
    assert model is not None, "build_proposers builds the draft model first"
    if method == "draft":
        return model
    from specdec.proposer_svc.draft import DraftModelProposer
    from specdec.proposer_svc.draft_hybrid import DraftHybridProposer

    # its own proposer over the same engine: sequence ids are distinct per method
    return DraftHybridProposer(DraftModelProposer(model.engine, model.config), HybridConfig(suffix=settings.suffix))
