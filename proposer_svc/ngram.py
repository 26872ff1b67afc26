"""N-gram (prompt lookup) proposer.

The last n tokens of a sequence's context are looked up in the context
itself; the tokens that followed their most recent earlier occurrence are the
draft. n runs from ``max_n`` down to ``min_n`` and the largest n with a match
wins. A request may also carry ``reference_token_ids`` (e.g. the file being
edited): for a given n, when the context has no earlier occurrence of its
last n tokens, the reference is searched for them and what followed there is
the draft. So a longer match in the reference beats a shorter one in the
context, and at equal n the context wins.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from specdec.proposer_svc.base import ContextStore, Draft, Proposer


@dataclass(frozen=True)
class NgramConfig:
    """Replica-level settings of the n-gram proposer."""

    max_draft_tokens: int = 64  # hard cap on k; the preallocated draft buffer size


@njit(cache=True)
def longest_suffix_match(haystack, context, max_n):
    """Finds the last ``n`` tokens of ``context`` in ``haystack``, n <= max_n
    as large as possible, at the most recent position that is followed by at
    least one haystack token.

    haystack: int32 [h]; context: int32 [c]. Returns (n, end): the match
    occupies ``haystack[end - n + 1 : end + 1]`` and the draft starts at
    ``end + 1 < h``; n == 0 when nothing matches. When ``haystack`` is
    ``context`` the trivial match of the context's tail with itself is
    excluded by ``end + 1 < h``.
    """
    h, c = haystack.shape[0], context.shape[0]
    best_n, best_end = 0, -1
    # Invariant: scanning ends from the most recent one down, best_end is the
    # most recent end whose match length m(end) equals best_n, and no more
    # recent end has m >= best_n; so taking only strictly longer matches keeps
    # "most recent occurrence of the longest n-gram".
    for end in range(h - 2, -1, -1):
        m = 0
        while m < max_n and m <= end and m < c and haystack[end - m] == context[c - 1 - m]:
            m += 1
        if m > best_n:
            best_n, best_end = m, end
            if m == max_n:
                break
    return best_n, best_end


@njit(cache=True)
def ngram_draft(context, reference, min_n, max_n, k, out):
    """Writes up to ``k`` draft tokens into ``out`` and returns their number.

    context: int32 [c], the prompt plus the accepted output; reference:
    int32 [r], possibly empty; out: int32 [>= k]. The draft continues the
    longest (<= max_n, >= min_n) match of the context's tail; the context's
    own match wins ties with the reference's. Drafts stop at the end of the
    source they are copied from.
    """
    n_ctx, end_ctx = longest_suffix_match(context, context, max_n)
    n_ref, end_ref = longest_suffix_match(reference, context, max_n)
    if n_ctx >= n_ref and n_ctx >= min_n:
        source, start = context, end_ctx + 1
    elif n_ref >= min_n:
        source, start = reference, end_ref + 1
    else:
        return 0
    num = max(0, min(k, source.shape[0] - start))
    for i in range(num):
        out[i] = source[start + i]
    return num


def _warm_up() -> None:
    """Compiles (or loads from cache) the matcher once, before any request."""
    out = np.empty(4, dtype=np.int32)
    tokens = np.array([1, 2, 3, 1, 2], dtype=np.int32)
    ngram_draft(tokens, tokens[:3], 1, 2, 4, out)


class NgramProposer(Proposer):
    """Prompt-lookup drafts; per-sequence state is the context and options."""

    name = "ngram"

    def __init__(self, config: NgramConfig = NgramConfig()) -> None:
        self.config = config
        self._contexts = ContextStore()
        # seq_id -> (min_n, max_n, reference_token_ids int32 [r])
        self._options: dict[str, tuple[int, int, np.ndarray]] = {}
        self._out = np.empty(config.max_draft_tokens, dtype=np.int32)
        _warm_up()

    def start(self, seq_id, context, options):
        self._contexts.start(seq_id, np.asarray(context, dtype=np.int32))
        reference = np.ascontiguousarray(options.reference_token_ids, dtype=np.int32)
        self._options[seq_id] = (options.min_n, options.max_n, reference)

    def extend(self, seq_id, token_ids):
        self._contexts.extend(seq_id, np.asarray(token_ids, dtype=np.int32))

    def propose(self, requests):
        return [self._propose_one(seq_id, k) for seq_id, k in requests]

    def _propose_one(self, seq_id: str, k: int) -> Draft:
        context = self._contexts.tokens(seq_id)  # raises UnknownSequence
        min_n, max_n, reference = self._options[seq_id]
        num = ngram_draft(context, reference, min_n, max_n,
                          min(k, self.config.max_draft_tokens), self._out)
        return Draft(self._out[:num].copy())

    def stop(self, seq_id, completed):
        self._contexts.stop(seq_id)
        self._options.pop(seq_id, None)

    def context_len(self, seq_id):
        return self._contexts.length(seq_id)

    def stats(self):
        ref_bytes = sum(ref.nbytes for _, _, ref in self._options.values())
        return {"live_sequences": float(len(self._contexts)),
                "memory_bytes": float(self._contexts.nbytes() + ref_bytes)}
