"""Builds the proposers a replica serves, by method name, with default configs."""
from __future__ import annotations

from specdec.proposer_svc.base import NaiveProposer, Proposer
from specdec.proposer_svc.hybrid import HybridProposer
from specdec.proposer_svc.ngram import NgramProposer
from specdec.proposer_svc.suffix import SuffixProposer

#: method names accepted by `build_proposers` (and in requests)
SUPPORTED_METHODS = ("naive", "ngram", "suffix", "hybrid")

_FACTORIES = {
    "naive": NaiveProposer,
    "ngram": NgramProposer,
    "suffix": SuffixProposer,
    "hybrid": HybridProposer,
}


def build_proposers(methods: list[str]) -> dict[str, Proposer]:
    """One proposer per distinct method, keyed by its name.

    Raises ValueError naming the first unsupported method.
    """
    unknown = [m for m in methods if m not in _FACTORIES]
    if unknown:
        raise ValueError(f"unsupported proposer method {unknown[0]!r}; "
                         f"supported: {', '.join(SUPPORTED_METHODS)}")
    return {m: _FACTORIES[m]() for m in dict.fromkeys(methods)}
