"""SuffixDecoding proposer (Oliaro et al., arXiv 2411.04975) over
bounded-depth suffix tries with counts, in numba over flat numpy arrays.

Each sequence has a per-request trie over its reference tokens, prompt and
output (growing as tokens are accepted); one global trie holds the outputs of
the last ``max_cached_requests`` requests that finished normally. Both are
matched against the context's last tokens and the best-scoring draft wins.

Trie semantics (see ``suffix_reference.py`` for the plain-Python definition): for
each stream S and each start j, every prefix u of S[j : j + D] is a node,
``count(u)`` is its number of occurrences and ``stamp(u)`` the time its
latest occurrence was completed (token i of a stream with time base b is seen
at time b + i).

Layout. No Python object per node: row ``c`` of the int32 array ``nodes``
holds node c's fields (columns below), ``stamps[c]`` its stamp; children are
found through an open-addressing hash table keyed by (parent, token) and
chained in a doubly linked sibling list (used only to re-pick the best child
after a count decreases). Tokens live in one int32 ``pool``; row s of
``seqs`` gives stream s's start in the pool, the number of its tokens
inserted so far and its time base.

Leaf compression. A node seen once (count 1) implies a chain of count-1
descendants that simply follows its single occurrence; such a node is stored
as a *leaf* (``LSEQ >= 0``) pointing at that occurrence (stream, position of
its last token) and its descendants are not stored. When a second occurrence
arrives, the leaf is *materialised* (becomes an explicit node with count 2)
and its old continuation becomes a new leaf one level down. So typical text
costs about one node per token plus one per repeated substring.

Invariants:
- node 0 is the root (depth 0); depth(c) = depth(parent(c)) + 1 <= D;
- a leaf has count 1, no stored children, and
  pool[start(LSEQ) + LPOS] == TOK; its implicit chain continues with the
  stream's next tokens while depth <= D and the stream has them;
- count(explicit c) = number of occurrences of its string; explicit nodes of
  count 1 exist only after an eviction;
- BEST(c) is the child with the largest (count, stamp), or -1;
- an *active* node list holds, by increasing depth, the explicit nodes of
  depth < D matching the suffixes of a growing stream;
- the hash table is at most half full; free node rows are chained via NEXT.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np
from numba import njit

from specdec.proposer_svc.base import Draft, Proposer, SeqOptions, UnknownSequence

# columns of `nodes`
TOK, PARENT, COUNT, DEPTH, BEST, FIRST, NEXT, PREV, LSEQ, LPOS = range(10)
NUM_FIELDS = 10
# entries of `hdr` (int64 [4])
H_USED, H_FREE, H_LIVE, H_KEYS = range(4)
# columns of `seqs` (int64 [S, 3])
S_START, S_LEN, S_TIME = range(3)

ROOT = 0
_EMPTY = -1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
#: guards ceil(m * factor) against round-off (10 * 0.3 -> 3.0000000000000004)
SPEC_FACTOR_EPS = 1e-9


# ---------------------------------------------------------------- hash table
@njit(cache=True, inline="always")
def _key(parent, tok):
    return (np.int64(parent) << 32) | np.int64(tok)


@njit(cache=True, inline="always")
def _home(key, mask):
    return np.int64(((np.uint64(key) * _GOLDEN) >> np.uint64(32)) & np.uint64(mask))


@njit(cache=True)
def _child(hkeys, hvals, parent, tok):
    """The child of ``parent`` reached by ``tok``, or -1."""
    key = _key(parent, tok)
    mask = hkeys.shape[0] - 1
    i = _home(key, mask)
    while hkeys[i] != _EMPTY:
        if hkeys[i] == key:
            return hvals[i]
        i = (i + 1) & mask
    return -1


@njit(cache=True)
def _hash_put(hkeys, hvals, key, val):
    mask = hkeys.shape[0] - 1
    i = _home(key, mask)
    while hkeys[i] != _EMPTY:
        i = (i + 1) & mask
    hkeys[i] = key
    hvals[i] = val


@njit(cache=True)
def _hash_del(hkeys, hvals, key):
    """Linear-probing delete with backward shift (no tombstones)."""
    mask = hkeys.shape[0] - 1
    i = _home(key, mask)
    while hkeys[i] != key:
        i = (i + 1) & mask
    hkeys[i] = _EMPTY
    j = i
    while True:
        j = (j + 1) & mask
        if hkeys[j] == _EMPTY:
            return
        # the entry at j may fill the hole at i if i lies on its probe path
        if ((j - _home(hkeys[j], mask)) & mask) >= ((j - i) & mask):
            hkeys[i], hvals[i] = hkeys[j], hvals[j]
            hkeys[j] = _EMPTY
            i = j


@njit(cache=True)
def rehash(old_keys, old_vals, new_keys, new_vals):
    """Moves every entry into a (larger, empty) table."""
    for i in range(old_keys.shape[0]):
        if old_keys[i] != _EMPTY:
            _hash_put(new_keys, new_vals, old_keys[i], old_vals[i])


# ----------------------------------------------------------------- node rows
@njit(cache=True)
def _new_child(nodes, stamps, hkeys, hvals, hdr, parent, tok, lseq, lpos, stamp):
    """Allocates a count-1 child (a leaf when lseq >= 0) and links it."""
    c = hdr[H_FREE]
    if c >= 0:
        hdr[H_FREE] = nodes[c, NEXT]
    else:
        c = hdr[H_USED]
        hdr[H_USED] += 1
    hdr[H_LIVE] += 1
    nodes[c, TOK], nodes[c, PARENT], nodes[c, COUNT] = tok, parent, 1
    nodes[c, DEPTH] = nodes[parent, DEPTH] + 1
    nodes[c, BEST], nodes[c, FIRST] = -1, -1
    nodes[c, LSEQ], nodes[c, LPOS] = lseq, lpos
    stamps[c] = stamp
    first = nodes[parent, FIRST]
    nodes[c, NEXT], nodes[c, PREV] = first, -1
    if first >= 0:
        nodes[first, PREV] = c
    nodes[parent, FIRST] = c
    _hash_put(hkeys, hvals, _key(parent, tok), c)
    hdr[H_KEYS] += 1
    return c


@njit(cache=True)
def _free_child(nodes, hkeys, hvals, hdr, c):
    """Unlinks node c from its parent and puts its row on the free list."""
    parent, nxt, prev = nodes[c, PARENT], nodes[c, NEXT], nodes[c, PREV]
    if prev >= 0:
        nodes[prev, NEXT] = nxt
    else:
        nodes[parent, FIRST] = nxt
    if nxt >= 0:
        nodes[nxt, PREV] = prev
    _hash_del(hkeys, hvals, _key(parent, nodes[c, TOK]))
    hdr[H_KEYS] -= 1
    hdr[H_LIVE] -= 1
    nodes[c, NEXT] = hdr[H_FREE]
    hdr[H_FREE] = c


@njit(cache=True)
def _child_incremented(nodes, parent, c):
    """c's count just grew and its stamp is now the newest: it may be best."""
    b = nodes[parent, BEST]
    if b < 0 or nodes[c, COUNT] >= nodes[b, COUNT]:
        nodes[parent, BEST] = c


@njit(cache=True)
def _repick_best(nodes, stamps, parent):
    best = -1
    c = nodes[parent, FIRST]
    while c >= 0:
        if best < 0 or nodes[c, COUNT] > nodes[best, COUNT] or (
                nodes[c, COUNT] == nodes[best, COUNT] and stamps[c] > stamps[best]):
            best = c
        c = nodes[c, NEXT]
    nodes[parent, BEST] = best


# ------------------------------------------------------------------ updates
@njit(cache=True)
def _step(nodes, stamps, hkeys, hvals, hdr, pool, seqs, parent, tok, seq, pos, now, max_depth):
    """Counts one more occurrence of parent's string + tok, ending at (seq, pos).

    Returns the explicit node now matching it, or -1 if it lies in a leaf.
    """
    c = nodes[parent, BEST]  # usually the continuation: skips the hash probe
    if c < 0 or nodes[c, TOK] != tok:
        c = _child(hkeys, hvals, parent, tok)
    if c < 0:
        c = _new_child(nodes, stamps, hkeys, hvals, hdr, parent, tok, seq, pos, now)
        _child_incremented(nodes, parent, c)
        return -1
    if nodes[c, LSEQ] >= 0:  # materialise the leaf: its chain continues below
        old_seq, old_pos = nodes[c, LSEQ], nodes[c, LPOS]
        nodes[c, LSEQ], nodes[c, LPOS] = -1, -1
        if nodes[c, DEPTH] < max_depth and old_pos + 1 < seqs[old_seq, S_LEN]:
            nxt = pool[seqs[old_seq, S_START] + old_pos + 1]
            g = _new_child(nodes, stamps, hkeys, hvals, hdr, c, nxt, old_seq, old_pos + 1,
                           seqs[old_seq, S_TIME] + old_pos + 1)
            nodes[c, BEST] = g
    nodes[c, COUNT] += 1
    stamps[c] = now
    _child_incremented(nodes, parent, c)
    return c


@njit(cache=True)
def append_tokens(nodes, stamps, hkeys, hvals, hdr, pool, seqs, seq, end, active, n_active,
                  max_depth):
    """Inserts stream ``seq``'s tokens from position seqs[seq, S_LEN] up to
    ``end`` (already written in the pool), stopping early when the node or
    hash arrays might overflow; returns the new seqs[seq, S_LEN].

    active: int32 [max_depth + 1], its first n_active[0] entries the stream's
    active nodes (updated in place).
    """
    start, base = seqs[seq, S_START], seqs[seq, S_TIME]
    scratch = np.empty(max_depth + 1, dtype=np.int32)
    pos = seqs[seq, S_LEN]
    while pos < end:
        if (hdr[H_USED] + max_depth + 2 > nodes.shape[0]
                or 2 * (hdr[H_KEYS] + max_depth + 2) > hkeys.shape[0]):
            break
        tok = pool[start + pos]
        seqs[seq, S_LEN] = pos + 1
        num = 0
        c = _step(nodes, stamps, hkeys, hvals, hdr, pool, seqs, ROOT, tok, seq, pos, base + pos,
                  max_depth)
        if c >= 0 and nodes[c, DEPTH] < max_depth:
            scratch[num] = c
            num += 1
        for i in range(n_active[0]):
            c = _step(nodes, stamps, hkeys, hvals, hdr, pool, seqs, active[i], tok, seq, pos,
                      base + pos, max_depth)
            if c >= 0 and nodes[c, DEPTH] < max_depth:
                scratch[num] = c
                num += 1
        active[:num] = scratch[:num]
        n_active[0] = num
        pos += 1
    return seqs[seq, S_LEN]


@njit(cache=True)
def remove_stream(nodes, stamps, hkeys, hvals, hdr, pool, seqs, seq, max_depth):
    """Subtracts every occurrence in stream ``seq`` (fully inserted) and frees
    the nodes left with count 0. Stamps stay valid as long as the removed
    stream is the oldest one (FIFO eviction): the latest occurrence of any
    surviving node lies in a newer stream.
    """
    start, n = seqs[seq, S_START], seqs[seq, S_LEN]
    for j in range(n):
        node = ROOT
        for i in range(j, min(j + max_depth, n)):
            c = _child(hkeys, hvals, node, pool[start + i])
            if nodes[c, LSEQ] >= 0:  # a leaf: this very occurrence
                _free_child(nodes, hkeys, hvals, hdr, c)
                if nodes[node, BEST] == c:
                    _repick_best(nodes, stamps, node)
                break
            nodes[c, COUNT] -= 1
            # a node reaching 0 keeps only the child on this walk (the others
            # reached 0 on earlier walks); its row is reused only by inserts
            if nodes[c, COUNT] == 0:
                _free_child(nodes, hkeys, hvals, hdr, c)
            if nodes[node, BEST] == c:
                _repick_best(nodes, stamps, node)
            node = c
    seqs[seq, S_LEN] = 0


# -------------------------------------------------------------- speculation
@njit(cache=True)
def _draft_from(nodes, pool, seqs, node, off, max_depth, cap, min_token_prob, out):
    """Follows the best path from ``node`` (``off`` tokens into its leaf
    chain); returns (number of tokens written to out, score)."""
    num, score, prob = 0, 0.0, 1.0
    while num < cap:
        if nodes[node, LSEQ] >= 0:  # inside a leaf chain: probability ratio 1
            seq = nodes[node, LSEQ]
            pos = nodes[node, LPOS] + off + 1
            if nodes[node, DEPTH] + off + 1 > max_depth or pos >= seqs[seq, S_LEN]:
                break
            if prob < min_token_prob:
                break
            out[num] = pool[seqs[seq, S_START] + pos]
            off += 1
        else:
            b = nodes[node, BEST]
            if b < 0:
                break
            prob *= nodes[b, COUNT] / nodes[node, COUNT]
            if prob < min_token_prob:
                break
            out[num] = nodes[b, TOK]
            node, off = b, 0
        num += 1
        score += prob
    return num, score


@njit(cache=True)
def _max_draft_len(match_len, k, max_spec_factor):
    return min(k, math.ceil(match_len * max_spec_factor - SPEC_FACTOR_EPS))


@njit(cache=True)
def _walk(nodes, hkeys, hvals, pool, seqs, tokens, max_depth):
    """Locates ``tokens`` in the tree: (node, tokens past it in its leaf
    chain), or (-1, 0) when absent."""
    node, off = ROOT, 0
    for i in range(tokens.shape[0]):
        if nodes[node, LSEQ] >= 0:
            seq = nodes[node, LSEQ]
            pos = nodes[node, LPOS] + off + 1
            if (nodes[node, DEPTH] + off + 1 > max_depth or pos >= seqs[seq, S_LEN]
                    or pool[seqs[seq, S_START] + pos] != tokens[i]):
                return -1, 0
            off += 1
        else:
            node = _child(hkeys, hvals, node, tokens[i])
            if node < 0:
                return -1, 0
    return node, off


@njit(cache=True)
def _keep_if_better(num, score, match_len, best, tmp, out):
    """best: float64 [3] = (score, length, match length) of the draft in out."""
    if num == 0:
        return
    if score > best[0] or (score == best[0] and (
            num > best[1] or (num == best[1] and match_len >= best[2]))):
        out[:num] = tmp[:num]
        best[0], best[1], best[2] = score, num, match_len


@njit(cache=True)
def speculate_walk(nodes, hkeys, hvals, pool, seqs, max_depth, context, max_match, k,
                   max_spec_factor, min_token_prob, out, best):
    """Best draft over the suffixes of ``context`` (int32 [c]) of length
    <= max_match found by walking from the root; writes out (int32 [>= k]) and
    best (float64 [3]: score, length, match length)."""
    tmp = np.empty(k, dtype=np.int32)
    best[:] = 0.0
    c = context.shape[0]
    for m in range(1, min(max_match, c) + 1):
        node, off = _walk(nodes, hkeys, hvals, pool, seqs, context[c - m:], max_depth)
        if node < 0:
            break
        num, score = _draft_from(nodes, pool, seqs, node, off, max_depth,
                                 _max_draft_len(m, k, max_spec_factor), min_token_prob, tmp)
        _keep_if_better(num, score, m, best, tmp, out)


@njit(cache=True)
def speculate_active(nodes, pool, seqs, max_depth, active, n_active, k, max_spec_factor,
                     min_token_prob, out, best):
    """Like ``speculate_walk`` for a tree that contains the context itself:
    its suffixes with a continuation are exactly the active nodes (the others
    are the context's own leaf chain, or at depth max_depth)."""
    tmp = np.empty(k, dtype=np.int32)
    best[:] = 0.0
    for i in range(n_active):
        node = active[i]
        m = nodes[node, DEPTH]
        num, score = _draft_from(nodes, pool, seqs, node, 0, max_depth,
                                 _max_draft_len(m, k, max_spec_factor), min_token_prob, tmp)
        _keep_if_better(num, score, m, best, tmp, out)


# ----------------------------------------------------------- Python handle
class SuffixTrie:
    """Owns one trie's arrays and grows them; streams are numbered 0..S-1.

    Only the last stream written to the pool may grow (``pool_end`` is the end
    of the used part of the pool).
    """

    def __init__(self, max_depth: int, num_streams: int, node_capacity: int = 256,
                 pool_capacity: int = 256) -> None:
        self.max_depth = max_depth
        self.nodes = np.zeros((max(node_capacity, 2 * max_depth + 4), NUM_FIELDS), dtype=np.int32)
        self.stamps = np.zeros(self.nodes.shape[0], dtype=np.int64)
        hash_size = 1 << max(4, (2 * self.nodes.shape[0] - 1).bit_length())
        self.hkeys = np.full(hash_size, _EMPTY, dtype=np.int64)
        self.hvals = np.zeros(hash_size, dtype=np.int32)
        self.hdr = np.array([1, -1, 1, 0], dtype=np.int64)  # root allocated
        self.nodes[ROOT] = -1
        self.nodes[ROOT, COUNT] = self.nodes[ROOT, DEPTH] = 0
        self.pool = np.zeros(max(pool_capacity, 16), dtype=np.int32)
        self.pool_end = 0
        self.seqs = np.zeros((num_streams, 3), dtype=np.int64)

    # -- streams
    def open_stream(self, seq: int, time_base: int, capacity: int) -> None:
        """Places empty stream ``seq`` at the end of the pool."""
        self.reserve_pool(capacity)
        self.seqs[seq] = (self.pool_end, 0, time_base)

    def append(self, seq: int, tokens: np.ndarray, active: np.ndarray,
               n_active: np.ndarray) -> None:
        """Appends tokens (int32 [m]) to stream ``seq``, the last one in the
        pool, and inserts them. active: int32 [max_depth + 1] and n_active:
        int64 [1] hold the stream's active nodes (in/out)."""
        self.reserve_pool(len(tokens))
        self.pool[self.pool_end:self.pool_end + len(tokens)] = tokens
        self.pool_end += len(tokens)
        end = self.pool_end - int(self.seqs[seq, S_START])
        while append_tokens(self.nodes, self.stamps, self.hkeys, self.hvals, self.hdr, self.pool,
                            self.seqs, seq, end, active, n_active, self.max_depth) < end:
            self._grow()

    def remove(self, seq: int) -> None:
        remove_stream(self.nodes, self.stamps, self.hkeys, self.hvals, self.hdr, self.pool,
                      self.seqs, seq, self.max_depth)

    def tokens(self, seq: int) -> np.ndarray:
        """Stream ``seq``'s inserted tokens (a view, int32 [n])."""
        start, n = int(self.seqs[seq, S_START]), int(self.seqs[seq, S_LEN])
        return self.pool[start:start + n]

    def reserve_pool(self, extra: int) -> None:
        if self.pool_end + extra > len(self.pool):
            grown = np.zeros(max(2 * len(self.pool), self.pool_end + extra), dtype=np.int32)
            grown[:self.pool_end] = self.pool[:self.pool_end]
            self.pool = grown

    def compact_pool(self, live: list[int]) -> None:
        """Packs the streams in ``live`` (in this order) at the pool start."""
        packed = np.concatenate([self.tokens(s) for s in live]) if live else self.pool[:0]
        starts = np.cumsum([0] + [int(self.seqs[s, S_LEN]) for s in live])
        self.pool[:len(packed)] = packed
        for s, begin in zip(live, starts):
            self.seqs[s, S_START] = begin
        self.pool_end = len(packed)

    # -- capacity
    def _grow(self) -> None:
        need = int(self.hdr[H_USED]) + self.max_depth + 2
        if need > len(self.nodes):
            size = max(2 * len(self.nodes), need)
            nodes = np.zeros((size, NUM_FIELDS), dtype=np.int32)
            nodes[:len(self.nodes)] = self.nodes
            stamps = np.zeros(size, dtype=np.int64)
            stamps[:len(self.stamps)] = self.stamps
            self.nodes, self.stamps = nodes, stamps
        if 2 * (int(self.hdr[H_KEYS]) + self.max_depth + 2) > len(self.hkeys):
            keys = np.full(2 * len(self.hkeys), _EMPTY, dtype=np.int64)
            vals = np.zeros(2 * len(self.hkeys), dtype=np.int32)
            rehash(self.hkeys, self.hvals, keys, vals)
            self.hkeys, self.hvals = keys, vals

    def live_nodes(self) -> int:
        return int(self.hdr[H_LIVE])

    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.nodes, self.stamps, self.hkeys, self.hvals,
                                      self.pool, self.seqs, self.hdr))

    # -- drafts
    def speculate_walk(self, context: np.ndarray, max_match: int, k: int, max_spec_factor: float,
                       min_token_prob: float, out: np.ndarray, best: np.ndarray) -> None:
        speculate_walk(self.nodes, self.hkeys, self.hvals, self.pool, self.seqs, self.max_depth,
                       context, max_match, k, max_spec_factor, min_token_prob, out, best)

    def speculate_active(self, active: np.ndarray, n_active: int, k: int, max_spec_factor: float,
                         min_token_prob: float, out: np.ndarray, best: np.ndarray) -> None:
        speculate_active(self.nodes, self.pool, self.seqs, self.max_depth, active, n_active, k,
                         max_spec_factor, min_token_prob, out, best)


# ------------------------------------------------------------------ proposer
@dataclass(frozen=True)
class SuffixConfig:
    """Replica-level settings of the suffix proposer."""

    max_cached_requests: int = 1000  # finished outputs in the global trie (0: no global trie)
    max_tree_depth: int = 64  # depth of every trie; caps the per-request max_tree_depth


REFERENCE_STREAM, CONTEXT_STREAM = 0, 1


class _Request:
    """Per-request trie: stream 0 the reference tokens, stream 1 the context
    (prompt + accepted output, growing at the end of the pool)."""

    def __init__(self, context: np.ndarray, options: SeqOptions, config_depth: int) -> None:
        self.depth = min(options.max_tree_depth, config_depth)
        if self.depth < 1:
            raise ValueError(f"max_tree_depth must be >= 1, got {options.max_tree_depth}")
        self.max_spec_factor = options.max_spec_factor
        self.min_token_prob = options.min_token_prob
        self.prompt_len = len(context)
        reference = np.ascontiguousarray(options.reference_token_ids, dtype=np.int32)
        size = len(reference) + len(context)
        self.trie = SuffixTrie(self.depth, 2, node_capacity=2 * size + 64,
                               pool_capacity=size + 64)
        self.active = np.zeros(self.depth + 1, dtype=np.int32)
        self.n_active = np.zeros(1, dtype=np.int64)
        self.trie.open_stream(REFERENCE_STREAM, 0, len(reference))
        self.trie.append(REFERENCE_STREAM, reference, self.active, self.n_active)
        self.n_active[0] = 0
        self.trie.open_stream(CONTEXT_STREAM, len(reference), len(context))
        self.extend(context)

    def extend(self, tokens: np.ndarray) -> None:
        self.trie.append(CONTEXT_STREAM, tokens, self.active, self.n_active)

    def context(self) -> np.ndarray:
        return self.trie.tokens(CONTEXT_STREAM)


class _GlobalCache:
    """Global trie over the outputs of finished requests, evicted FIFO (which
    keeps stamps exact, see ``remove_stream``)."""

    def __init__(self, max_requests: int, max_depth: int) -> None:
        self.max_requests = max_requests
        self.trie = SuffixTrie(max_depth, max_requests)
        self.fifo: deque[int] = deque()  # stream slots, oldest first
        self.free_slots = list(range(max_requests - 1, -1, -1))
        self.clock = 0  # tokens ever inserted: the next stream's time base
        self._active = np.zeros(max_depth + 1, dtype=np.int32)
        self._n_active = np.zeros(1, dtype=np.int64)

    def add(self, output: np.ndarray) -> None:
        while len(self.fifo) >= self.max_requests:
            self._evict_oldest()
        if self.trie.pool_end + len(output) > len(self.trie.pool):
            self.trie.compact_pool(list(self.fifo))
        slot = self.free_slots.pop()
        self.trie.open_stream(slot, self.clock, len(output))
        self._n_active[0] = 0
        self.trie.append(slot, output, self._active, self._n_active)
        self.fifo.append(slot)
        self.clock += len(output)

    def _evict_oldest(self) -> None:
        slot = self.fifo.popleft()
        self.trie.remove(slot)
        self.free_slots.append(slot)


class SuffixProposer(Proposer):
    """SuffixDecoding drafts from a per-request trie and a global trie.

    Scores: a draft token's probability is the product of count(child) /
    count(parent) along the path; a draft's score is the sum over its
    tokens. Best draft: highest score, then longer, then from the per-request
    trie, then the longer match. ``suffix_reference.ReferenceSuffixProposer``
    is the executable definition.
    """

    name = "suffix"

    def __init__(self, config: SuffixConfig = SuffixConfig()) -> None:
        self.config = config
        self._requests: dict[str, _Request] = {}
        self._global = (_GlobalCache(config.max_cached_requests, config.max_tree_depth)
                        if config.max_cached_requests > 0 else None)
        _warm_up()

    def start(self, seq_id, context, options):
        self._requests[seq_id] = _Request(np.ascontiguousarray(context, dtype=np.int32), options,
                                          self.config.max_tree_depth)

    def extend(self, seq_id, token_ids):
        self._request(seq_id).extend(np.ascontiguousarray(token_ids, dtype=np.int32))

    def propose(self, requests):
        return [draft for draft, _ in self.propose_scored(requests)]

    def propose_scored(self, requests: list[tuple[str, int]]) -> list[tuple[Draft, float]]:
        """Drafts with their scores (the sum of the draft tokens'
        probabilities, an estimate of the number accepted)."""
        return [self._propose_one(self._request(seq_id), k) for seq_id, k in requests]

    def _propose_one(self, req: _Request, k: int) -> tuple[Draft, float]:
        if k <= 0:
            return Draft(np.zeros(0, dtype=np.int32)), 0.0
        local_out, local_best = np.empty(k, dtype=np.int32), np.zeros(3)
        req.trie.speculate_active(req.active, int(req.n_active[0]), k, req.max_spec_factor,
                                  req.min_token_prob, local_out, local_best)
        glob = self._global
        if glob is not None and glob.fifo:
            context = req.context()
            out, best = np.empty(k, dtype=np.int32), np.zeros(3)
            glob.trie.speculate_walk(context[max(0, len(context) - req.depth):], req.depth, k,
                                     req.max_spec_factor, req.min_token_prob, out, best)
            if (best[0], best[1]) > (local_best[0], local_best[1]):
                return Draft(out[:int(best[1])]), float(best[0])
        return Draft(local_out[:int(local_best[1])]), float(local_best[0])

    def stop(self, seq_id, completed):
        req = self._requests.pop(seq_id, None)
        if req is None or not completed or self._global is None:
            return
        output = req.context()[req.prompt_len:]
        if len(output):
            self._global.add(output)

    def context_len(self, seq_id):
        return len(self._request(seq_id).context())

    def stats(self):
        tries = [r.trie for r in self._requests.values()]
        cached = 0
        if self._global is not None:
            tries.append(self._global.trie)
            cached = len(self._global.fifo)
        return {"live_sequences": float(len(self._requests)),
                "cached_requests": float(cached),
                "tree_nodes": float(sum(t.live_nodes() for t in tries)),
                "memory_bytes": float(sum(t.nbytes() for t in tries))}

    def _request(self, seq_id: str) -> _Request:
        try:
            return self._requests[seq_id]
        except KeyError:
            raise UnknownSequence(seq_id) from None


def _warm_up() -> None:
    """Compiles (or loads from numba's cache) every kernel once."""
    trie = SuffixTrie(4, 2)
    active, n_active = np.zeros(5, dtype=np.int32), np.zeros(1, dtype=np.int64)
    for seq in (0, 1):
        trie.open_stream(seq, 0, 6)
        n_active[0] = 0
        trie.append(seq, np.array([1, 2, 1, 2, 3, 1], dtype=np.int32), active, n_active)
    out, best = np.empty(2, dtype=np.int32), np.zeros(3)
    trie.speculate_active(active, int(n_active[0]), 2, 1.0, 0.1, out, best)
    trie.speculate_walk(trie.tokens(1), 4, 2, 1.0, 0.1, out, best)
    trie.remove(0)
    trie._grow()
