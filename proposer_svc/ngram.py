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

import numpy as np

from specdec.drafts import Draft
from specdec.limits import MAX_SPECULATIVE_TOKENS
from specdec.proposer_svc.base import (
    BranchBatch,
    ContextStore,
    DraftBatch,
    Proposer,
    SeqOptions,
    bounds_of,
    by_frequency,
    njit_leaf,
)


@njit_leaf
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


@njit_leaf
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


@njit_leaf
def ngram_batch(pool, starts, lens, ref_pool, ref_starts, ref_lens, min_ns, max_ns, slots, ref_slots,
                context_lens, ks, in_sync, out, offsets):
    """``ngram_draft`` for n sequences held in a ContextStore (contexts in
    ``pool``, references in ``ref_pool``; slots, ref_slots, context_lens, ks:
    int64 [n]). Writes in_sync (bool [n]: length == context_lens[i], or that
    is 0), the drafts into out (int32 [>= sum of ks]) at offsets (int64 [n + 1]).
    """
    num = 0
    for i in range(slots.shape[0]):
        s, r = slots[i], ref_slots[i]
        offsets[i] = num
        in_sync[i] = context_lens[i] == 0 or lens[s] == context_lens[i]
        if in_sync[i] and ks[i] > 0:
            context = pool[starts[s]:starts[s] + lens[s]]
            reference = ref_pool[ref_starts[r]:ref_starts[r] + ref_lens[r]]
            num += ngram_draft(context, reference, min_ns[s], max_ns[s], ks[i], out[num:])
    offsets[slots.shape[0]] = num


@njit_leaf
def _branch(scratch, h, t, reference, min_n, max_n, length, j, pos, tok, starts, ids, m):
    """Drafts after ``scratch[:h] + [t]`` into branch m (see ngram_branches);
    returns the branches there are now (m + 1 when it drafted anything)."""
    scratch[h] = t
    num = ngram_draft(scratch[:h + 1], reference, min_n, max_n, length, ids[starts[m]:])
    if num == 0:
        return m
    pos[m], tok[m] = j, t
    starts[m + 1] = starts[m] + num
    return m + 1


@njit_leaf
def ngram_branches(context, reference, draft, ranked, min_n, max_n, width, depth, length, scratch,
                   pos, tok, starts, ids):
    """Branches of ``draft`` (RoundUpdates.branch_width): at each position
    j <= min(depth, len(draft)), up to ``width`` tokens t other than
    ``draft[j]``, each with its draft of at most ``length`` tokens after
    ``context + draft[:j] + [t]`` (exactly what ``ngram_draft`` makes there;
    tokens it makes no draft after are skipped). Returns their number m.

    Which t: those that followed the earlier occurrences of the context's
    last n tokens, the longest n first (they continue the longest matches),
    the most recent first; then, when ``min_n <= 1`` (a single token
    matches), ``ranked``'s (int32 [u]: the context's distinct tokens, the
    most frequent first).

    context: int32 [c]; reference: int32 [r]; draft: int32 [d]; scratch:
    int32 [>= c + d + 1]; pos, tok: int32 [>= (depth + 1) * width] (the
    branches' j and t); starts: int64 [>= (depth + 1) * width + 1], starts[0]
    set by the caller, branch b's draft in ids[starts[b]:starts[b + 1]];
    ids: int32 [>= (depth + 1) * width * length].
    """
    c, d = context.shape[0], draft.shape[0]
    for i in range(c):
        scratch[i] = context[i]
    for i in range(d):
        scratch[c + i] = draft[i]
    m = 0
    for j in range(min(depth, d) + 1):
        h = c + j
        exclude = draft[j] if j < d else -1
        first = m  # this position's branches are m's from here; their tokens are distinct
        for n in range(max_n - 1, max(min_n - 1, 1) - 1, -1):
            for end in range(h - 2, n - 2, -1):  # haystack[end - n + 1 : end + 1] against the last n tokens
                same = True
                for q in range(n):
                    if scratch[end - q] != scratch[h - 1 - q]:
                        same = False
                        break
                t = scratch[end + 1]
                if not same or t == exclude:
                    continue
                seen = False
                for b in range(first, m):
                    seen = seen or tok[b] == t
                if not seen:
                    m = _branch(scratch, h, t, reference, min_n, max_n, length, j, pos, tok, starts, ids, m)
                    if m - first == width:
                        break
            if m - first == width:
                break
        if min_n <= 1:
            for u in range(ranked.shape[0]):
                if m - first == width:
                    break
                t = ranked[u]
                seen = t == exclude
                for b in range(first, m):
                    seen = seen or tok[b] == t
                if not seen:
                    m = _branch(scratch, h, t, reference, min_n, max_n, length, j, pos, tok, starts, ids, m)
        if j < d:
            scratch[h] = draft[j]  # (_branch wrote its tokens there)
    return m


_WARM_UP = "__warm_up__"  # the warm-up's sequence id (it lives only inside the constructor)


class NgramProposer(Proposer):
    """Prompt-lookup drafts; per-sequence state is the context, the reference
    and (min_n, max_n), by the context's ContextStore slot."""

    name = "ngram"

    def __init__(self) -> None:
        self._contexts = ContextStore()
        self._references = ContextStore()  # never extended
        self._n_range = np.zeros((16, 2), dtype=np.int64)  # by context slot: (min_n, max_n)
        self._out = np.empty(MAX_SPECULATIVE_TOKENS, dtype=np.int32)
        self._warm_up()

    def _warm_up(self) -> None:
        """Compiles (or loads from numba's cache) the matchers before any
        request, through the very calls a round makes on the arrays it passes:
        numba compiles once per argument layout (a strided column of
        ``_n_range`` is not a contiguous array), and a first round that
        compiles takes longer than a gateway waits for drafts."""
        tokens = np.array([1, 2, 3, 1, 2], dtype=np.int32)
        self.start(_WARM_UP, tokens, SeqOptions())
        self._propose_one(_WARM_UP, 4)
        one = np.ones(1, dtype=np.int64)
        batch = self.advance([_WARM_UP], tokens[:1], np.array([0, 1], dtype=np.int64), one * 6, one * 4)
        self.branches([_WARM_UP], batch.token_ids, batch.offsets, one * 4, one, 2)
        self.stop(_WARM_UP, completed=False)

    def start(self, seq_id, context, options):
        slot = self._contexts.start(seq_id, np.asarray(context, dtype=np.int32))
        self._references.start(seq_id, np.asarray(options.reference_token_ids, dtype=np.int32))
        if slot >= len(self._n_range):
            self._n_range = np.concatenate([self._n_range, np.zeros_like(self._n_range)])
        self._n_range[slot] = options.min_n, options.max_n

    def extend(self, seq_id, token_ids):
        self._contexts.extend(seq_id, np.asarray(token_ids, dtype=np.int32))

    def propose(self, requests):
        return [self._propose_one(seq_id, k) for seq_id, k in requests]

    def _propose_one(self, seq_id: str, k: int) -> Draft:
        context = self._contexts.tokens(seq_id)  # raises UnknownSequence
        min_n, max_n = self._n_range[self._contexts.slot(seq_id)].tolist()
        num = ngram_draft(context, self._references.tokens(seq_id), min_n, max_n,
                          min(k, MAX_SPECULATIVE_TOKENS), self._out)
        return Draft(self._out[:num].copy())

    def advance(self, seq_ids, tokens, bounds, context_lens, ks):
        ctx, refs = self._contexts, self._references
        slots = ctx.slots(seq_ids)
        ks = np.minimum(ks, MAX_SPECULATIVE_TOKENS)
        ctx.append_many(slots, tokens, bounds)
        in_sync = np.empty(len(seq_ids), dtype=np.bool_)
        out, offsets = np.empty(int(ks.sum()), dtype=np.int32), np.empty(len(seq_ids) + 1, dtype=np.int64)
        ngram_batch(ctx.pool, ctx.starts, ctx.lens, refs.pool, refs.starts, refs.lens,
                    self._n_range[:, 0], self._n_range[:, 1], slots, refs.slots(seq_ids), context_lens, ks,
                    in_sync, out, offsets)
        return DraftBatch(in_sync, out[:offsets[-1]], offsets)

    def branches(self, seq_ids, drafts, offsets, ks, depths, width):
        n = len(seq_ids)
        depths = np.minimum(depths, np.maximum(ks - 1, 0))
        lengths = ks - depths - 1
        most = int(((depths + 1) * width * (lengths > 0)).sum())
        pos, tok = np.empty(most, dtype=np.int32), np.empty(most, dtype=np.int32)
        starts = np.zeros(most + 1, dtype=np.int64)
        ids = np.empty(int(((depths + 1) * width * np.maximum(lengths, 0)).sum()), dtype=np.int32)
        counts = np.zeros(n, dtype=np.int64)
        m = 0
        for i, seq_id in enumerate(seq_ids):
            if depths[i] <= 0 or lengths[i] <= 0:
                continue
            context = self._contexts.tokens(seq_id)
            draft = drafts[offsets[i]:offsets[i + 1]]
            min_n, max_n = self._n_range[self._contexts.slot(seq_id)].tolist()
            ranked = by_frequency(context) if min_n <= 1 else context[:0]
            scratch = np.empty(len(context) + len(draft) + 1, dtype=np.int32)
            found = ngram_branches(context, self._references.tokens(seq_id), draft, ranked, min_n, max_n,
                                   width, int(depths[i]), int(lengths[i]), scratch, pos[m:], tok[m:], starts[m:], ids)
            counts[i] = found
            m += found
        return BranchBatch(bounds_of(counts), pos[:m], tok[:m], starts[:m + 1], ids[:starts[m]])

    def stop(self, seq_id, completed):
        self._contexts.stop(seq_id)
        self._references.stop(seq_id)

    def context_len(self, seq_id):
        return self._contexts.length(seq_id)

    def stats(self):
        return {"live_sequences": float(len(self._contexts)),
                "memory_bytes": float(self._contexts.nbytes() + self._references.nbytes())}
