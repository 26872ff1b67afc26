"""Verification kernels (Triton) and their torch references.

``verify`` checks the draft tokens of a ragged batch against the target
logits (see ``verify.py`` for the vocabulary and the strategies);
``sampling`` holds the temperature / top-k / top-p filters; ``rng`` the
counter-based random stream both backends share. Triton modules
(``*_triton.py``) are imported only when a kernel is launched.
"""
from specdec.kernels.sampling import (
    filter_stats,
    filter_stats_reference,
    filtered_probs,
    filtered_probs_at,
)
from specdec.kernels.types import (
    GREEDY,
    POLICY_ACCEPT_ALL,
    POLICY_NORMAL,
    POLICY_REJECT_ALL,
    REJECTION,
    TARGET_MATCH,
    TOPP,
    FilterStats,
    SamplingTensors,
    SparseDraftProbs,
    VerifyOutput,
)
from specdec.kernels.verify import sample, verify, verify_reference

__all__ = [
    "GREEDY", "REJECTION", "TARGET_MATCH", "TOPP",
    "POLICY_NORMAL", "POLICY_ACCEPT_ALL", "POLICY_REJECT_ALL",
    "SamplingTensors", "SparseDraftProbs", "VerifyOutput",
    "verify", "verify_reference", "sample",
    "FilterStats", "filter_stats", "filter_stats_reference", "filtered_probs", "filtered_probs_at",
]
