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
from typing import Any, NamedTuple

import numpy as np
from numba import njit, types
from numba.typed import List

from specdec.drafts import Draft
from specdec.proposer_svc.base import DraftBatch, Proposer, SeqOptions, UnknownSequence

# columns of `nodes`
TOK, PARENT, COUNT, DEPTH, BEST, FIRST, NEXT, PREV, LSEQ, LPOS = range(10)
NUM_FIELDS = 10
# entries of `hdr` (int64 [5]); H_POOL_END: end of the used part of the pool
H_USED, H_FREE, H_LIVE, H_KEYS, H_POOL_END = range(5)
# columns of `seqs` (int64 [S, 3])
S_START, S_LEN, S_TIME = range(3)

# the streams of a per-request trie
REFERENCE_STREAM, CONTEXT_STREAM = 0, 1

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


# ------------------------------------------------------ rounds of requests
# The per-request tries of many sequences, reached through numba typed lists
# indexed by slot (nodes_l ... n_active_l, see _TrieTable): one call per round
# instead of one per sequence. Built and updated by cached kernels too, so a
# process compiles nothing for them. (Passed one by one: the dispatcher types
# a tuple of lists slowly, ~0.4 ms a call.)
@njit(cache=True)
def new_trie_lists():
    """Empty lists of (nodes, stamps, hkeys, hvals, hdr, pool, seqs, active, n_active) by slot."""
    return (List.empty_list(types.int32[:, ::1]), List.empty_list(types.int64[::1]),
            List.empty_list(types.int64[::1]), List.empty_list(types.int32[::1]),
            List.empty_list(types.int64[::1]), List.empty_list(types.int32[::1]),
            List.empty_list(types.int64[:, ::1]), List.empty_list(types.int32[::1]),
            List.empty_list(types.int64[::1]))


@njit(cache=True)
def put_trie(nodes_l, stamps_l, hkeys_l, hvals_l, hdr_l, pool_l, seqs_l, active_l, n_active_l, slot, nodes, stamps,
             hkeys, hvals, hdr, pool, seqs, active, n_active):
    """Stores one trie's arrays (and its active nodes) in slot (== length: appended)."""
    if slot == len(nodes_l):
        nodes_l.append(nodes)
        stamps_l.append(stamps)
        hkeys_l.append(hkeys)
        hvals_l.append(hvals)
        hdr_l.append(hdr)
        pool_l.append(pool)
        seqs_l.append(seqs)
        active_l.append(active)
        n_active_l.append(n_active)
    else:
        nodes_l[slot] = nodes
        stamps_l[slot] = stamps
        hkeys_l[slot] = hkeys
        hvals_l[slot] = hvals
        hdr_l[slot] = hdr
        pool_l[slot] = pool
        seqs_l[slot] = seqs
        active_l[slot] = active
        n_active_l[slot] = n_active


@njit(cache=True)
def append_batch(nodes_l, stamps_l, hkeys_l, hvals_l, hdr_l, pool_l, seqs_l, active_l, n_active_l, depths, slots,
                 tokens, bounds, written, first):
    """Appends tokens[bounds[i]:bounds[i + 1]] to the context stream of the
    trie in slot slots[i], for i = first.. in order (as SuffixTrie.append).
    written: bool [n], the tokens already copied to the pool (in/out).
    Returns the first i whose pool (not written[i]) or node/hash arrays
    (written[i]) are full, for the caller to grow them and call again; n
    when all are inserted."""
    for i in range(first, slots.shape[0]):
        s = slots[i]
        pool, hdr, seqs = pool_l[s], hdr_l[s], seqs_l[s]
        if not written[i]:
            at, num = hdr[H_POOL_END], bounds[i + 1] - bounds[i]
            if at + num > pool.shape[0]:
                return i
            pool[at:at + num] = tokens[bounds[i]:bounds[i + 1]]
            hdr[H_POOL_END] = at + num
            written[i] = True
        end = hdr[H_POOL_END] - seqs[CONTEXT_STREAM, S_START]
        if append_tokens(nodes_l[s], stamps_l[s], hkeys_l[s], hvals_l[s], hdr, pool, seqs, CONTEXT_STREAM, end,
                         active_l[s], n_active_l[s], depths[s]) < end:
            return i
    return slots.shape[0]


@njit(cache=True)
def speculate_batch(nodes_l, pool_l, seqs_l, active_l, n_active_l, depths, factors, min_probs, slots, context_lens,
                    ks, g_nodes, g_hkeys, g_hvals, g_pool, g_seqs, g_depth, use_global, in_sync, out, offsets,
                    scores):
    """SuffixProposer._propose_one for the requests in slots (int64 [n]):
    the per-request trie's draft, or the global trie's (g_*, searched when
    use_global) when it scores higher (ties: the longer). Writes in_sync
    (bool [n]: context length == context_lens[i], or that is 0), the drafts
    into out (int32 [>= sum of ks]) at offsets (int64 [n + 1]) and their
    scores (float64 [n]); out-of-sync requests get no draft."""
    num = 0
    local_best, g_best = np.zeros(3), np.zeros(3)
    for i in range(slots.shape[0]):
        s, k = slots[i], ks[i]
        seqs = seqs_l[s]
        length = seqs[CONTEXT_STREAM, S_LEN]
        offsets[i], scores[i] = num, 0.0
        in_sync[i] = context_lens[i] == 0 or length == context_lens[i]
        if not in_sync[i] or k <= 0:
            continue
        speculate_active(nodes_l[s], pool_l[s], seqs, depths[s], active_l[s], n_active_l[s][0], k, factors[s],
                         min_probs[s], out[num:num + k], local_best)
        drafted, score = int(local_best[1]), local_best[0]
        if use_global:
            depth, start = depths[s], seqs[CONTEXT_STREAM, S_START]
            context = pool_l[s][start + max(0, length - depth):start + length]
            g_out = np.empty(k, dtype=np.int32)
            speculate_walk(g_nodes, g_hkeys, g_hvals, g_pool, g_seqs, g_depth, context, depth, k, factors[s],
                           min_probs[s], g_out, g_best)
            if g_best[0] > local_best[0] or (g_best[0] == local_best[0] and g_best[1] > local_best[1]):
                drafted, score = int(g_best[1]), g_best[0]
                out[num:num + drafted] = g_out[:drafted]
        num += drafted
        scores[i] = score
    offsets[slots.shape[0]] = num


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
        self.hdr = np.array([1, -1, 1, 0, 0], dtype=np.int64)  # root allocated, pool empty
        self.nodes[ROOT] = -1
        self.nodes[ROOT, COUNT] = self.nodes[ROOT, DEPTH] = 0
        self.pool = np.zeros(max(pool_capacity, 16), dtype=np.int32)
        self.seqs = np.zeros((num_streams, 3), dtype=np.int64)
        self.version = 0  # counts reallocations of the arrays

    @property
    def pool_end(self) -> int:
        """End of the used part of the pool (kept in hdr for the batch kernels)."""
        return int(self.hdr[H_POOL_END])

    @pool_end.setter
    def pool_end(self, end: int) -> None:
        self.hdr[H_POOL_END] = end

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
            self.grow()

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
            self.version += 1

    def compact_pool(self, live: list[int]) -> None:
        """Packs the streams in ``live`` (in this order) at the pool start."""
        packed = np.concatenate([self.tokens(s) for s in live]) if live else self.pool[:0]
        starts = np.cumsum([0] + [int(self.seqs[s, S_LEN]) for s in live])
        self.pool[:len(packed)] = packed
        for s, begin in zip(live, starts):
            self.seqs[s, S_START] = begin
        self.pool_end = len(packed)

    # -- capacity
    def grow(self) -> None:
        """Makes room for max_depth + 2 more nodes (and their hash keys)."""
        need = int(self.hdr[H_USED]) + self.max_depth + 2
        if need > len(self.nodes):
            size = max(2 * len(self.nodes), need)
            nodes = np.zeros((size, NUM_FIELDS), dtype=np.int32)
            nodes[:len(self.nodes)] = self.nodes
            stamps = np.zeros(size, dtype=np.int64)
            stamps[:len(self.stamps)] = self.stamps
            self.nodes, self.stamps = nodes, stamps
            self.version += 1
        if 2 * (int(self.hdr[H_KEYS]) + self.max_depth + 2) > len(self.hkeys):
            keys = np.full(2 * len(self.hkeys), _EMPTY, dtype=np.int64)
            vals = np.zeros(2 * len(self.hkeys), dtype=np.int32)
            rehash(self.hkeys, self.hvals, keys, vals)
            self.hkeys, self.hvals = keys, vals
            self.version += 1

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


class _TrieLists(NamedTuple):
    """numba typed lists of the per-request tries' arrays, by slot."""

    nodes: Any
    stamps: Any
    hkeys: Any
    hvals: Any
    hdr: Any
    pool: Any
    seqs: Any
    active: Any
    n_active: Any


class _TrieTable:
    """The per-request tries' arrays by slot, for the batch kernels.

    Invariant: the slot of every live request holds its trie's current arrays
    (``put`` stores them again after the trie reallocated them, as its
    ``version`` tells)."""

    def __init__(self) -> None:
        self.lists = _TrieLists(*new_trie_lists())
        self._versions: list[int] = []  # by slot: the trie version stored (-1: free)
        self.depths = np.zeros(16, dtype=np.int64)  # by slot
        self.factors = np.zeros(16)
        self.min_probs = np.zeros(16)
        self._free: list[int] = []

    def add(self, req: _Request) -> int:
        """Gives a request a slot and puts its arrays there."""
        if self._free:
            slot = self._free.pop()
        else:
            slot = len(self._versions)
            self._versions.append(-1)
            if slot == len(self.depths):
                self.depths, self.factors, self.min_probs = (np.concatenate([a, np.zeros_like(a)])
                                                             for a in (self.depths, self.factors, self.min_probs))
        self.depths[slot], self.factors[slot], self.min_probs[slot] = req.depth, req.max_spec_factor, req.min_token_prob
        self.put(slot, req)
        return slot

    def put(self, slot: int, req: _Request) -> None:
        """Stores the request's arrays unless the slot holds them already."""
        t = req.trie
        if self._versions[slot] != t.version:
            self._put(slot, t, req.active, req.n_active)
            self._versions[slot] = t.version

    def append(self, slots: np.ndarray, tokens: np.ndarray, bounds: np.ndarray, written: np.ndarray,
               first: int) -> int:
        """append_batch over these tries."""
        t = self.lists
        return append_batch(t.nodes, t.stamps, t.hkeys, t.hvals, t.hdr, t.pool, t.seqs, t.active, t.n_active,
                            self.depths, slots, tokens, bounds, written, first)

    def speculate(self, slots: np.ndarray, context_lens: np.ndarray, ks: np.ndarray, glob: SuffixTrie,
                  use_global: bool, in_sync: np.ndarray, out: np.ndarray, offsets: np.ndarray,
                  scores: np.ndarray) -> None:
        """speculate_batch over these tries and the global trie glob."""
        t = self.lists
        speculate_batch(t.nodes, t.pool, t.seqs, t.active, t.n_active, self.depths, self.factors, self.min_probs,
                        slots, context_lens, ks, glob.nodes, glob.hkeys, glob.hvals, glob.pool, glob.seqs,
                        glob.max_depth, use_global, in_sync, out, offsets, scores)

    def remove(self, slot: int) -> None:
        """Frees the slot (its arrays are dropped)."""
        self._put(slot, _NO_TRIE, _NO_ACTIVE, _NO_ACTIVE_COUNT)
        self._versions[slot] = -1
        self._free.append(slot)

    def _put(self, slot: int, t: SuffixTrie, active: np.ndarray, n_active: np.ndarray) -> None:
        lists = self.lists
        put_trie(lists.nodes, lists.stamps, lists.hkeys, lists.hvals, lists.hdr, lists.pool, lists.seqs,
                 lists.active, lists.n_active, slot, t.nodes, t.stamps, t.hkeys, t.hvals, t.hdr, t.pool, t.seqs,
                 active, n_active)


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
        self._table = _TrieTable()
        self._slot: dict[str, int] = {}
        self._global = (_GlobalCache(config.max_cached_requests, config.max_tree_depth)
                        if config.max_cached_requests > 0 else None)
        _warm_up()

    def start(self, seq_id, context, options):
        req = _Request(np.ascontiguousarray(context, dtype=np.int32), options, self.config.max_tree_depth)
        self.stop(seq_id, completed=False)
        self._requests[seq_id] = req
        self._slot[seq_id] = self._table.add(req)

    def extend(self, seq_id, token_ids):
        req = self._request(seq_id)
        req.extend(np.ascontiguousarray(token_ids, dtype=np.int32))
        self._table.put(self._slot[seq_id], req)

    def advance(self, seq_ids, tokens, bounds, context_lens, ks):
        batch, _ = self.advance_scored(seq_ids, tokens, bounds, context_lens, ks)
        return batch

    def advance_scored(self, seq_ids: list[str], tokens: np.ndarray, bounds: np.ndarray, context_lens: np.ndarray,
                       ks: np.ndarray) -> tuple[DraftBatch, np.ndarray]:
        """``advance`` with the drafts' scores (float64 [n], as propose_scored)."""
        try:
            slots = np.array([self._slot[s] for s in seq_ids], dtype=np.int64)
        except KeyError as e:
            raise UnknownSequence(e.args[0]) from None
        self._append_batch(seq_ids, slots, tokens, bounds)
        n, table, glob = len(seq_ids), self._table, self._global
        in_sync, scores = np.empty(n, dtype=np.bool_), np.empty(n)
        out, offsets = np.empty(int(ks.sum()), dtype=np.int32), np.empty(n + 1, dtype=np.int64)
        table.speculate(slots, context_lens, ks, glob.trie if glob is not None else _NO_TRIE,
                        glob is not None and bool(glob.fifo), in_sync, out, offsets, scores)
        return DraftBatch(in_sync, out[:offsets[-1]], offsets), scores

    def _append_batch(self, seq_ids: list[str], slots: np.ndarray, tokens: np.ndarray, bounds: np.ndarray) -> None:
        """Appends each request's tokens, growing its arrays where needed."""
        table = self._table
        written = np.zeros(len(seq_ids), dtype=np.bool_)
        i = 0
        while (i := table.append(slots, tokens, bounds, written, i)) < len(seq_ids):
            req = self._requests[seq_ids[i]]
            if written[i]:
                req.trie.grow()
            else:
                req.trie.reserve_pool(int(bounds[i + 1] - bounds[i]))
            table.put(int(slots[i]), req)

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
        if req is None:
            return
        self._table.remove(self._slot.pop(seq_id))
        if not completed or self._global is None:
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
    trie.grow()
    table = _TrieTable()
    req = _Request(np.array([1, 2, 1, 2, 3], dtype=np.int32), SeqOptions(max_tree_depth=4), 4)
    slots = np.array([table.add(req)])
    table.append(slots, np.array([1], dtype=np.int32), np.array([0, 1]), np.zeros(1, dtype=np.bool_), 0)
    one = np.ones(1, dtype=np.int64)
    table.speculate(slots, one * 6, one * 2, trie, True, np.empty(1, dtype=np.bool_), np.empty(2, dtype=np.int32),
                    np.empty(2, dtype=np.int64), np.empty(1))
    table.remove(int(slots[0]))


#: stand in for the global trie of a proposer without one (never searched)
#: and for the arrays of a free slot
_NO_TRIE = SuffixTrie(1, 1)
_NO_ACTIVE, _NO_ACTIVE_COUNT = np.zeros(1, dtype=np.int32), np.zeros(1, dtype=np.int64)
