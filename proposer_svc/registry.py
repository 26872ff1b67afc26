"""Builds the proposers a replica serves, by method name, with default configs."""
from __future__ import annotations

from specdec.proposer_svc.base import NaiveProposer, Proposer
from specdec.proposer_svc.hybrid import HybridConfig, HybridProposer
from specdec.proposer_svc.ngram import NgramProposer
from specdec.proposer_svc.suffix import SuffixConfig, SuffixProposer

#: method names accepted by `build_proposers` (and in requests)
SUPPORTED_METHODS = ("naive", "ngram", "suffix", "hybrid")

_FACTORIES = {
    "naive": lambda suffix: NaiveProposer(),
    "ngram": lambda suffix: NgramProposer(),
    "suffix": SuffixProposer,
    "hybrid": lambda suffix: HybridProposer(HybridConfig(suffix=suffix)),
}


def build_proposers(methods: list[str], suffix: SuffixConfig | None = None) -> dict[str, Proposer]:
    """One proposer per distinct method, keyed by its name; `suffix` configures
    the suffix trees of the suffix and hybrid proposers.

    Raises ValueError naming the first unsupported method.
    """
    unknown = [m for m in methods if m not in _FACTORIES]
    if unknown:
        raise ValueError(f"unsupported proposer method {unknown[0]!r}; "
                         f"supported: {', '.join(SUPPORTED_METHODS)}")
    suffix = suffix or SuffixConfig()
    return {m: _FACTORIES[m](suffix) for m in dict.fromkeys(methods)}
