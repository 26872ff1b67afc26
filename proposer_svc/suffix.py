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
holds node c's fields (columns below), ``stamps[c]`` its stamp (stamps and
the GEN column are kept only by a trie that removes streams, see
``SuffixTrie``); children are found through an open-addressing hash
``table`` keyed by (parent, token) and chained in a doubly linked sibling
list (used only to re-pick the best child after a count decreases). Tokens
live in one int32 ``pool``; row s of ``seqs`` gives stream s's start in the
pool, the number of its tokens inserted so far and its time base. The
per-request tries of all live requests are regions of one such set of arrays
(``RequestArena``), so a round of many requests is one kernel call.

Leaf compression. A node seen once (count 1) implies a chain of count-1
descendants that simply follows its single occurrence; such a node is stored
as a *leaf* (``LSEQ >= 0``) pointing at that occurrence (stream, position of
its last token) and its descendants are not stored. When a second occurrence
arrives, the leaf is *materialised* (becomes an explicit node with count 2)
and its old continuation becomes a new leaf one level down. So typical text
costs about one node per token plus one per repeated substring.

Invariants:
- node 0 (of a trie's rows) is the root, depth 0; depth(c) =
  depth(parent(c)) + 1 <= D;
- a leaf has count 1, no stored children, and
  pool[start(LSEQ) + LPOS] == TOK; its implicit chain continues with the
  stream's next tokens while depth <= D and the stream has them;
- count(explicit c) = number of occurrences of its string; explicit nodes of
  count 1 exist only after an eviction;
- BEST(c) is the child with the largest (count, stamp), or -1; the root's
  (never drafted from: matches have >= 1 token) only has to be one of its
  children or -1 after removals (a lookup shortcut). In a trie that removes
  streams, a node whose best child lost occurrences may instead hold a mark
  (``_lost(c)``, ``_STALE``) until a draft reads it (``_best``): best
  children are settled lazily, where they are read. There, an unmarked
  node's GAP (but the root's, see above) is at most count(BEST) minus the
  largest count of its other children (0 when none), so a removal that
  leaves it >= 1 leaves BEST the best child, with no mark;
- FIRST/NEXT chain each node's children; PREV links them back only in a
  trie with stamps (the two serve ``remove_stream``; the per-request tries
  never remove a stream and keep neither);
- an *active* node list holds, by increasing depth, the explicit nodes of
  depth < D matching the suffixes of a growing stream;
- each hash shard is at most half full (see the hash table); free node
  rows are chained via NEXT.
"""
from __future__ import annotations

import math
import mmap
import os
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
from numba import njit

from specdec.drafts import Draft
from specdec.proposer_svc.base import (
    BranchBatch,
    DraftBatch,
    Proposer,
    SeqOptions,
    UnknownSequence,
    bounds_of,
    by_frequency,
    njit_leaf,
)

# columns of `nodes`: first the fields an insert or a draft reads at every
# step, so that they usually share a cache line; GEN (the row's generation,
# bumped when it is freed: see follow_global) and GAP (see the invariants)
# only in a trie that removes streams, whose rows have NUM_FIELDS + 2 columns
TOK, COUNT, BEST, LSEQ, LPOS, DEPTH, PARENT, FIRST, NEXT, PREV, GEN, GAP = range(12)
NUM_FIELDS = 10
# entries of `hdr` (int64 [5]): H_TIGHT the number of tight hash shards (see
# the hash table), H_POOL_END the end of the used part of the pool
H_USED, H_FREE, H_LIVE, H_TIGHT, H_POOL_END = range(5)
# columns of a hash table's shards (int64 [S, 4]; see the hash table)
T_BASE, T_SIZE, T_KEYS, T_LIMIT = range(4)
# columns of `seqs` (int64 [S, 3]; a RequestArena's has S_CAP too: [S, 4])
S_START, S_LEN, S_TIME, S_CAP = range(4)

# the streams of a per-request trie
REFERENCE_STREAM, CONTEXT_STREAM = 0, 1

ROOT = 0
_EMPTY = -1
_STALE = -2  # BEST of a node whose best child is picked again when read (remove_stream; see _best)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_LOW32 = np.uint64(0xFFFFFFFF)
#: guards ceil(m * factor) against round-off (10 * 0.3 -> 3.0000000000000004)
SPEC_FACTOR_EPS = 1e-9


# ---------------------------------------------------------------- hash table
# The table is int64 [rows, 2]: row i holds a key (_EMPTY: free) and its
# value, so that a probe reads one cache line. Its keys are spread over
# *shards*, rows of an int64 [S, 4] array (columns T_*): shard s is the
# open-addressing table table[base:base + size] (size a power of 2) holding
# keys keys. It is *tight* when keys > limit (at most size / 2 - (max_depth
# + 2), see _limit): one more insert step (at most max_depth + 2 new keys)
# could leave it more than half full; hdr[H_TIGHT] counts the tight shards,
# and inserts stop while there is one. Shards grow one at a time, each a
# rehash of its own keys only, so a large table never doubles (and
# rehashes) in one go. A per-request trie has one shard; the global trie
# TABLE_SHARDS.
@njit(cache=True, inline="always")
def _key(parent, tok):
    return (np.int64(parent) << 32) | np.int64(tok)


@njit(cache=True, inline="always")
def _hashed(key, num_shards):
    """key's hash scaled to the number of shards: its shard in the top 32
    bits, the fraction left below (see _home)."""
    return ((np.uint64(key) * _GOLDEN) >> np.uint64(32)) * np.uint64(num_shards)


@njit(cache=True, inline="always")
def _home_in(x, size):
    """The home slot of hashed key x (_hashed) in a shard of size rows."""
    return np.int64(((x & _LOW32) * np.uint64(size)) >> np.uint64(32))


@njit(cache=True, inline="always")
def _home(shards, key):
    """(shard, home slot in the shard) of key: the hash's top 32 bits scaled
    to the number of shards pick the shard, the fraction left scaled to its
    size the home. So homes keep their order when a shard doubles (home h
    becomes 2h or 2h + 1) and ``rehash`` writes the new rows almost
    sequentially."""
    x = _hashed(key, shards.shape[0])
    s = np.int64(x >> np.uint64(32))
    return s, _home_in(x, shards[s, T_SIZE])


@njit(cache=True, inline="always")
def _at(base, i):
    """Table row base + i as an unsigned index (numba then skips the check
    for a negative index: a third of a probe's time)."""
    return np.uint64(base + i)


@njit_leaf
def _child(table, shards, parent, tok):
    """The child of ``parent`` reached by ``tok``, or -1."""
    key = _key(parent, tok)
    s, i = _home(shards, key)
    base, mask = shards[s, T_BASE], shards[s, T_SIZE] - 1
    while table[_at(base, i), 0] != _EMPTY:
        if table[_at(base, i), 0] == key:
            return table[_at(base, i), 1]
        i = (i + 1) & mask
    return -1


@njit(cache=True, inline="always")
def _lost(c):
    """BEST of a node whose best child c lost occurrences in remove_stream
    and lives: <= -3, and _lost(_lost(c)) = c (see _best)."""
    return -3 - c


@njit(cache=True, inline="always")
def _find_child(nodes, table, shards, parent, tok):
    """As _child, trying parent's best child first (usually the one wanted:
    that skips the hash probe, a cache miss in a large trie)."""
    c = nodes[parent, BEST]
    if c <= _lost(0):  # a mark of remove_stream's: c is still the likeliest
        c = _lost(c)
    if c < 0 or nodes[c, TOK] != tok:
        c = _child(table, shards, parent, tok)
    return c


@njit_leaf
def _hash_put(table, shards, hdr, key, val):
    s, i = _home(shards, key)
    base, mask = shards[s, T_BASE], shards[s, T_SIZE] - 1
    while table[_at(base, i), 0] != _EMPTY:
        i = (i + 1) & mask
    table[_at(base, i), 0] = key
    table[_at(base, i), 1] = val
    shards[s, T_KEYS] += 1
    if shards[s, T_KEYS] == shards[s, T_LIMIT] + 1:
        hdr[H_TIGHT] += 1


@njit_leaf
def _hash_del(table, shards, hdr, key):
    """Linear-probing delete with backward shift (no tombstones)."""
    s, i = _home(shards, key)
    base, mask = shards[s, T_BASE], shards[s, T_SIZE] - 1
    while table[_at(base, i), 0] != key:
        i = (i + 1) & mask
    if shards[s, T_KEYS] == shards[s, T_LIMIT] + 1:
        hdr[H_TIGHT] -= 1
    shards[s, T_KEYS] -= 1
    table[_at(base, i), 0] = _EMPTY
    j = i
    while True:
        j = (j + 1) & mask
        moved = table[_at(base, j), 0]
        if moved == _EMPTY:
            return
        # the entry at j may fill the hole at i if i lies on its probe path
        if ((j - _home(shards, moved)[1]) & mask) >= ((j - i) & mask):
            table[_at(base, i), 0], table[_at(base, i), 1] = moved, table[_at(base, j), 1]
            table[_at(base, j), 0] = _EMPTY
            i = j


@njit(cache=True)
def rehash(table, num_shards, old, r0, r1, base, size):
    """Puts the entries of rows r0..r1 - 1 of old (int64 [m, 2]: a shard's
    rows) into the shard of size rows being built at table[base:base + size]
    (rows not holding one of old's are _EMPTY; old may be other rows of table)."""
    mask = size - 1
    for r in range(r0, r1):
        key = old[r, 0]
        if key != _EMPTY:
            i = _home_in(_hashed(key, num_shards), size)
            while table[_at(base, i), 0] != _EMPTY:
                i = (i + 1) & mask
            table[_at(base, i), 0], table[_at(base, i), 1] = key, old[r, 1]


def _resize_shard(table: np.ndarray, shards: np.ndarray, s: int, base: int, size: int, room: int) -> None:
    """Moves shard s to table[base:base + size] (its old rows may be among
    them), with room keys per insert step (max_depth + 2)."""
    at = int(shards[s, T_BASE])
    old = table[at:at + int(shards[s, T_SIZE])].copy()
    table[base:base + size] = _EMPTY
    shards[s, T_BASE], shards[s, T_SIZE], shards[s, T_LIMIT] = base, size, _limit(s, len(shards), size, room)
    rehash(table, len(shards), old, 0, len(old), base, size)


def _limit(s: int, num_shards: int, size: int, room: int) -> int:
    """Keys shard s of size rows holds before it is tight. The shards'
    maximum loads fall from 1/2 (shard 0) towards 3/8 geometrically, so that
    they grow at moments spread over a quarter of the keys added while the
    table doubles (with one load for all, they would double within a few
    percent of the keys added, 2M keys: 30-45 ms a round)."""
    return max(int(size * 0.5 * 0.75 ** (s / num_shards)) - room, 0)


# ----------------------------------------------------------------- node rows
@njit_leaf
def _new_child(nodes, stamps, table, shards, hdr, parent, tok, lseq, lpos, stamp):
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
    first = nodes[parent, FIRST]
    nodes[c, NEXT], nodes[c, PREV] = first, -1
    if stamps.shape[0]:  # stamps and PREV links serve stream removal only (no stamps: neither kept)
        stamps[c] = stamp
        if first >= 0:
            nodes[first, PREV] = c
    nodes[parent, FIRST] = c
    _hash_put(table, shards, hdr, _key(parent, tok), c)
    return c


@njit_leaf
def _free_child(nodes, table, shards, hdr, c):
    """Unlinks node c from its parent and puts its row on the free list."""
    parent, nxt, prev = nodes[c, PARENT], nodes[c, NEXT], nodes[c, PREV]
    if prev >= 0:
        nodes[prev, NEXT] = nxt
    else:
        nodes[parent, FIRST] = nxt
    if nxt >= 0:
        nodes[nxt, PREV] = prev
    _hash_del(table, shards, hdr, _key(parent, nodes[c, TOK]))
    hdr[H_LIVE] -= 1
    nodes[c, NEXT] = hdr[H_FREE]
    hdr[H_FREE] = c


@njit_leaf
def _child_incremented(nodes, parent, c):
    """c's count just grew and its stamp is now the newest: it may be best
    (a parent marked by remove_stream stays marked: see _best); rows with a
    GAP column keep the parent's (see the invariants)."""
    b = nodes[parent, BEST]
    if b == -1 or (b >= 0 and nodes[c, COUNT] >= nodes[b, COUNT]):
        if nodes.shape[1] > GAP:  # (b, the best before, has the largest count of the others)
            nodes[parent, GAP] = (nodes[parent, GAP] + 1 if b == c
                                  else nodes[c, COUNT] - (nodes[b, COUNT] if b >= 0 else 0))
        nodes[parent, BEST] = c
    elif nodes.shape[1] > GAP and b >= 0 and nodes[b, COUNT] - nodes[c, COUNT] < nodes[parent, GAP]:
        nodes[parent, GAP] = nodes[b, COUNT] - nodes[c, COUNT]  # (written only when lower: rows stay clean)


@njit_leaf
def _repick_best(nodes, stamps, parent):
    """parent's best child read among all its children, and its GAP."""
    best, second = -1, 0  # second: the largest count of the children but best
    c = nodes[parent, FIRST]
    while c >= 0:
        if best < 0 or nodes[c, COUNT] > nodes[best, COUNT] or (
                nodes[c, COUNT] == nodes[best, COUNT] and stamps[c] > stamps[best]):
            if best >= 0:
                second = max(second, nodes[best, COUNT])
            best = c
        else:
            second = max(second, nodes[c, COUNT])
        c = nodes[c, NEXT]
    nodes[parent, BEST] = best
    nodes[parent, GAP] = nodes[best, COUNT] - second if best >= 0 else 0


# ------------------------------------------------------------------ updates
@njit_leaf
def _step_new(nodes, stamps, table, shards, hdr, pool, seqs, parent, c, tok, seq, pos, now, max_depth):
    """Counts one more occurrence of parent's string + tok, ending at (seq,
    pos), where that child c (_find_child's) is absent (-1) or a leaf: a new
    leaf, or the leaf materialised. Returns the explicit node now matching
    it, or -1 if it lies in a leaf. (The usual step, on an explicit child,
    is written out in append_tokens.)
    """
    if c < 0:
        c = _new_child(nodes, stamps, table, shards, hdr, parent, tok, seq, pos, now)
        _child_incremented(nodes, parent, c)
        return -1
    # materialise the leaf: its chain continues below
    old_seq, old_pos = nodes[c, LSEQ], nodes[c, LPOS]
    nodes[c, LSEQ], nodes[c, LPOS] = -1, -1
    if nodes[c, DEPTH] < max_depth and old_pos + 1 < seqs[old_seq, S_LEN]:
        nxt = pool[seqs[old_seq, S_START] + old_pos + 1]
        g = _new_child(nodes, stamps, table, shards, hdr, c, nxt, old_seq, old_pos + 1,
                       seqs[old_seq, S_TIME] + old_pos + 1)
        nodes[c, BEST] = g
        if nodes.shape[1] > GAP:
            nodes[c, GAP] = 1  # (its one child's count)
    nodes[c, COUNT] += 1
    if stamps.shape[0]:
        stamps[c] = now
    _child_incremented(nodes, parent, c)
    return c


@njit_leaf
def append_tokens(nodes, stamps, table, shards, hdr, pool, seqs, seq, root, end, active, n_active,
                  max_depth, scratch):
    """Inserts stream ``seq``'s tokens from position seqs[seq, S_LEN] up to
    ``end`` (already written in the pool) into the tree under ``root``,
    stopping early when the node rows might run out or a hash shard is
    tight; returns the new seqs[seq, S_LEN].

    active: int32 [max_depth + 1], its first n_active[0] entries the stream's
    active nodes (updated in place); scratch: int32 [>= max_depth + 1], work space.
    """
    start, base = seqs[seq, S_START], seqs[seq, S_TIME]
    pos = seqs[seq, S_LEN]
    while pos < end:
        if hdr[H_USED] + max_depth + 2 > nodes.shape[0] or hdr[H_TIGHT] > 0:
            break
        tok = pool[start + pos]
        seqs[seq, S_LEN] = pos + 1
        now = base + pos
        num = 0
        for j in range(-1, n_active[0]):  # the root, then the active nodes
            parent = root if j < 0 else active[j]
            c = _find_child(nodes, table, shards, parent, tok)
            # the usual step written out: a call per step (arrays passed)
            # costs more than the step itself
            if c >= 0 and nodes[c, LSEQ] < 0:  # an explicit child: one more occurrence
                nodes[c, COUNT] += 1
                if stamps.shape[0]:
                    stamps[c] = now
                _child_incremented(nodes, parent, c)
            else:
                c = _step_new(nodes, stamps, table, shards, hdr, pool, seqs, parent, c, tok, seq, pos, now, max_depth)
            if c >= 0 and nodes[c, DEPTH] < max_depth:
                scratch[num] = c
                num += 1
        for j in range(num):
            active[j] = scratch[j]
        n_active[0] = num
        pos += 1
    return seqs[seq, S_LEN]


@njit(cache=True, inline="always")
def _best(nodes, stamps, node):
    """node's best child (-1: none), settled first if remove_stream marked
    it: the child c it lost occurrences of when c still holds more than half
    of the node's occurrences (its siblings then hold at most count(node) -
    count(c) < count(c) between them, whatever was inserted since), else the
    best of all its children (read one by one)."""
    b = nodes[node, BEST]
    if b >= -1:
        return b
    c = _lost(b)
    if b <= _lost(0) and 2 * nodes[c, COUNT] > nodes[node, COUNT]:
        nodes[node, BEST] = c
        nodes[node, GAP] = 2 * nodes[c, COUNT] - nodes[node, COUNT]
    else:
        _repick_best(nodes, stamps, node)
    return nodes[node, BEST]


@njit(cache=True)
def remove_stream(nodes, stamps, table, shards, hdr, pool, seqs, seq, first, stop, max_depth):
    """Subtracts the occurrences in stream ``seq`` (fully inserted) that
    start at positions first..stop - 1, those before first subtracted
    already, and frees the nodes left with count 0, bumping their rows'
    generation (GEN; see follow_global). The trie is then the one of the
    stream's tokens from stop on (and of the other streams). Stamps stay
    valid as long as the removed occurrences are the oldest ones (FIFO
    eviction, from the stream's start): the latest occurrence of any
    surviving node lies later in the stream or in a newer one.

    The occurrences are visited as append_tokens inserted them, token by
    token from first: the active nodes (explicit, depth < max_depth)
    matching the suffixes of the stream so far that start before stop, each
    stepped by the next token (past stop, until none is left). A step
    does not depend on the others of its token, so their cache misses
    overlap (one walk from the root per suffix would wait for each level).
    Decrements commute, and a node reaches count 0 only at the visit of its
    last occurrence, so the order changes nothing.

    Best children are not settled here but where a draft reads them
    (``_best``): nodes with thousands of children lose occurrences of their
    best child many times a stream and in stream after stream, and most of
    those touched are read rarely or never before they lose more (settling
    each once per removal took ~58% of a removal's time). A node whose count
    reaches 0 has no occurrence left, nor has any node below it: all are
    freed by the end. A node whose best child c lost an occurrence keeps it
    while its GAP (one less) stays >= 1: c's count still exceeds every
    sibling's. Else it gets BEST _lost(c) (still tried first by
    _find_child), or _STALE once c is freed; the root is never marked (see
    the module invariants).
    """
    start, n = seqs[seq, S_START], seqs[seq, S_LEN]
    active, scratch = np.empty(max_depth + 1, dtype=np.int32), np.empty(max_depth + 1, dtype=np.int32)
    n_active = 0
    for i in range(first, n):
        if i >= stop and n_active == 0:  # the occurrences started before stop are all visited
            break
        tok = pool[start + i]
        num = 0
        for j in range(-1 if i < stop else 0, n_active):  # the root only where an occurrence starts
            node = ROOT if j < 0 else active[j]
            c = _find_child(nodes, table, shards, node, tok)
            # one occurrence less (written out, as in append_tokens); a leaf: this very one
            leaf = nodes[c, LSEQ] >= 0
            if not leaf:
                nodes[c, COUNT] -= 1
            if nodes[node, BEST] == c and node != ROOT:  # still the best while GAP >= 1, else marked: settled when read
                nodes[node, GAP] -= 1
                if nodes[node, GAP] < 1:
                    nodes[node, BEST] = _lost(c)
            # a node reaching 0 keeps the children that this stream's pending
            # occurrences still reach (their hash keys); rows are reused only by inserts
            if leaf or nodes[c, COUNT] == 0:
                _free_child(nodes, table, shards, hdr, c)
                nodes[c, GEN] += 1
                if nodes[node, BEST] == _lost(c):
                    nodes[node, BEST] = _STALE
                elif nodes[node, BEST] == c:  # (the root's: never settled)
                    nodes[node, BEST] = -1
            if not leaf and nodes[c, DEPTH] < max_depth:
                scratch[num] = c
                num += 1
        for j in range(num):  # (element by element: a slice costs a refcount here, see base.njit_leaf)
            active[j] = scratch[j]
        n_active = num


@njit(cache=True)
def pack_streams(pool, seqs, live, i, at, budget, room):
    """Moves streams live[i], live[i + 1], ... (int64 [m], in pool order:
    their starts increasing) down to the pool from ``at`` on, each
    seqs[s, room] tokens after the one before (``room``: S_LEN, a stream
    as long as its tokens, or S_CAP, a region with room to grow), until the
    next would take the tokens moved past ``budget`` (at least one is
    moved); returns (the next i, where it goes). A stream moves whole, its
    start set once it is at its new place: its tokens are at
    seqs[s, S_START] before and after."""
    moved = 0
    while i < live.shape[0]:
        s = live[i]
        start, n = seqs[s, S_START], seqs[s, room]
        if start != at:
            if moved > 0 and moved + n > budget:
                break
            for j in range(n):  # upwards: correct where the new place overlaps the old (at < start)
                pool[at + j] = pool[start + j]
            seqs[s, S_START] = at
            moved += n
        at += n
        i += 1
    return i, at


# -------------------------------------------------------------- speculation
@njit_leaf
def _draft_from(nodes, stamps, pool, seqs, node, off, max_depth, cap, min_token_prob, out, prob=1.0, score=0.0):
    """Follows the best path from ``node`` (``off`` tokens into its leaf
    chain), settling the best children it reads (``_best``); returns
    (number of tokens written to out, score). prob and score: the path's
    probability and score so far (see _draft_at_end)."""
    num = 0
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
            b = _best(nodes, stamps, node)
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


@njit_leaf
def _step_match(nodes, table, shards, pool, seqs, max_depth, node, off, tok):
    """Where the string at (node, off) followed by tok lies in the tree:
    (node, tokens past it in its leaf chain), or (-1, 0) when absent."""
    if nodes[node, LSEQ] >= 0:
        seq = nodes[node, LSEQ]
        pos = nodes[node, LPOS] + off + 1
        if (nodes[node, DEPTH] + off + 1 > max_depth or pos >= seqs[seq, S_LEN]
                or pool[seqs[seq, S_START] + pos] != tok):
            return -1, 0
        return node, off + 1
    return _find_child(nodes, table, shards, node, tok), 0


@njit_leaf
def _walk(nodes, table, shards, pool, seqs, tokens, max_depth):
    """Locates ``tokens`` in the tree: (node, tokens past it in its leaf
    chain), or (-1, 0) when absent."""
    node, off = ROOT, 0
    for i in range(tokens.shape[0]):
        node, off = _step_match(nodes, table, shards, pool, seqs, max_depth, node, off, tokens[i])
        if node < 0:
            return -1, 0
    return node, off


@njit_leaf
def _keep_if_better(num, score, match_len, best, tmp, out):
    """best: float64 [3] = (score, length, match length) of the draft in out."""
    if num == 0:
        return
    if score > best[0] or (score == best[0] and (
            num > best[1] or (num == best[1] and match_len >= best[2]))):
        for j in range(num):
            out[j] = tmp[j]
        best[0], best[1], best[2] = score, num, match_len


@njit(cache=True, inline="always")
def _latest(nodes, stamps, seqs, node, off):
    """When the latest occurrence of the string at (node, off) (as _walk
    gives it) was completed: its stamp, or in a leaf chain its one occurrence's."""
    if nodes[node, LSEQ] >= 0:
        return seqs[nodes[node, LSEQ], S_TIME] + nodes[node, LPOS] + off
    return stamps[node]


# A sequence's matches in the global trie. The global trie does not contain
# the sequence's context, so its suffixes found there are kept per sequence:
# entry i of (node, off, gen) lists is where context[c - i - 1 : c] lies (as
# _walk gives it; gen is the node row's generation then), for i < n, and
# context[c - n - 1 : c] is absent or n = max_match. The strings present form
# a prefix of the list because a trie of all windows holds every suffix of a
# string it holds. Appending token t maps entry i to entry i + 1 (one step
# each, no walks from the root). The trie changes between rounds: a node
# freed by an eviction (its generation bumped) ends the list there (the
# strings past it have no occurrence left either), a leaf materialised by an
# add moves the entries inside its chain to the explicit nodes now below it,
# and adds can make longer suffixes present: after a truncation, or when the
# longest listed string has an occurrence added since the lists were last
# brought up to date (a new occurrence of a longer suffix holds one of it),
# the list is extended with walks from the root.
# Drafts then come from the listed positions exactly as from walks of every
# suffix: O(max_match) steps a round instead of O(max_match^2).
@njit_leaf
def follow_global(nodes, stamps, table, shards, pool, seqs, max_depth, context, max_match, old_len, since,
                  lst_node, lst_off, lst_gen, n):
    """Brings the lists of a sequence whose context was context[:old_len]
    (old_len < 0: no list yet) to the context (int32 [c]), the lists last
    brought up to date at the trie's clock ``since`` (SuffixTrie.clock);
    returns the new n."""
    c = context.shape[0]
    cut = old_len < 0
    if old_len < 0:
        n, old_len = 0, c
    keep = 0
    while keep < n:  # entries still live, leaf offsets re-resolved
        node, off = lst_node[keep], lst_off[keep]
        if nodes[node, GEN] != lst_gen[keep]:
            cut = True
            break
        if off > 0 and nodes[node, LSEQ] < 0:  # the leaf was materialised: walk its part below
            past, off = off, 0
            for j in range(old_len - past, old_len):
                node, off = _step_match(nodes, table, shards, pool, seqs, max_depth, node, off, context[j])
                if node < 0:
                    break
            if node < 0:  # (cannot happen: the string still has its occurrence)
                cut = True
                break
            lst_node[keep], lst_off[keep], lst_gen[keep] = node, off, nodes[node, GEN]
        keep += 1
    n = keep
    ends_now = False  # the list is known to hold every suffix the trie holds now
    for j in range(old_len, c):  # one step per appended token
        tok = context[j]
        node, off = _step_match(nodes, table, shards, pool, seqs, max_depth, ROOT, 0, tok)
        i = 0
        while node >= 0:
            nxt_node, nxt_off = (lst_node[i], lst_off[i]) if i < n else (-1, 0)
            lst_node[i], lst_off[i], lst_gen[i] = node, off, nodes[node, GEN]
            i += 1
            if i == max_match or nxt_node < 0:
                break
            # _step_match written out (a call per step costs more than the step)
            node, off = nxt_node, nxt_off + 1
            if nodes[node, LSEQ] < 0:
                node, off = _find_child(nodes, table, shards, node, tok), 0
            elif (nodes[node, DEPTH] + off > max_depth or nodes[node, LPOS] + off >= seqs[nodes[node, LSEQ], S_LEN]
                  or pool[seqs[nodes[node, LSEQ], S_START] + nodes[node, LPOS] + off] != tok):
                node, off = -1, 0
        # a failed step shows the next longer suffix absent now; a list that
        # ran out extends the token before's, known to end there or not
        ends_now = node < 0 or i == max_match or ends_now
        n = i
    if not ends_now and (cut or n == 0 or _latest(nodes, stamps, seqs, lst_node[n - 1], lst_off[n - 1]) >= since):
        while n < min(max_match, c):  # longer suffixes may be present now
            node, off = _walk(nodes, table, shards, pool, seqs, context[c - n - 1:], max_depth)
            if node < 0:
                break
            lst_node[n], lst_off[n], lst_gen[n] = node, off, nodes[node, GEN]
            n += 1
    return n


@njit_leaf
def speculate_listed(nodes, stamps, pool, seqs, max_depth, lst_node, lst_off, n, k, max_spec_factor,
                     min_token_prob, floor, out, best, tmp):
    """Best draft over a sequence's listed matches (follow_global), as if
    every suffix of length <= max_match were walked from the root; writes out
    (int32 [>= k]) and best (float64 [3]: score, length, match length); tmp:
    int32 [>= k], work space.

    Only drafts that could beat a draft of score ``floor`` (ties: the
    longer) are looked for. A match of length m drafts at most
    L(m) = _max_draft_len(m) tokens, so its score is <= L(m) and, at a score
    of exactly L(m), its length is L(m) <= the length of any draft scoring
    L(m). Longest matches first, then: once L(m) <= max(floor, best score) no
    shorter match can win (L grows with m, and among equals the longer match
    wins), and the walks of the short matches are skipped."""
    best[:] = 0.0
    for i in range(n - 1, -1, -1):
        limit = _max_draft_len(i + 1, k, max_spec_factor)
        if limit <= max(floor, best[0]):
            break
        num, score = _draft_from(nodes, stamps, pool, seqs, lst_node[i], lst_off[i], max_depth, limit,
                                 min_token_prob, tmp)
        _keep_if_better(num, score, i + 1, best, tmp, out)


@njit_leaf
def speculate_active(nodes, stamps, pool, seqs, max_depth, active, n_active, k, max_spec_factor,
                     min_token_prob, out, best, tmp):
    """Best draft over the context's suffixes in a tree that contains the
    context itself: its suffixes with a continuation are exactly the active
    nodes (the others are the context's own leaf chain, or at depth
    max_depth). Writes out, best and tmp as speculate_listed."""
    best[:] = 0.0
    for i in range(n_active):
        node = active[i]
        m = nodes[node, DEPTH]
        num, score = _draft_from(nodes, stamps, pool, seqs, node, 0, max_depth,
                                 _max_draft_len(m, k, max_spec_factor), min_token_prob, tmp)
        _keep_if_better(num, score, m, best, tmp, out)


# ------------------------------------------------------ rounds of requests
# The per-request tries of all live sequences live in one set of shared
# arrays (see RequestArena): request s owns a region of node rows
# (nodes[nbase[s]:nbase[s] + ncap[s]], its root at local row 0) and a region
# of the hash table, its one shard tshards[s] (base and size), both power-of-2
# sized, node ids local to the region; its two streams are rows
# 2 * s + REFERENCE_STREAM / CONTEXT_STREAM of a shared ``seqs`` over a shared
# pool. So each trie is a plain SuffixTrie view for the kernels above, a round
# of many requests is one kernel call over plain arrays, and opening or
# closing a request only hands regions out or back.

#: arena_round reads ahead the first rows the request this many places later will need
TOUCH_AHEAD = 4


@njit_leaf
def _touch(nodes, table, shards, active, n_active, tok):
    """Reads what inserting tok into a trie reads first: for its root and
    active nodes, the row, the best child's row and the hash slot of (node,
    tok) with the child it holds. The reads of one level do not depend on
    each other, so their cache misses overlap (numba has no prefetch)."""
    acc = 0
    for j in range(-1, n_active):
        a = ROOT if j < 0 else active[j]
        key = _key(a, tok)
        s, home = _home(shards, key)
        at = _at(shards[s, T_BASE], home)
        b = nodes[a, BEST]
        c = table[at, 1] if table[at, 0] == key else b
        acc += (nodes[c, COUNT] if c >= 0 else 0) + (nodes[b, TOK] if b >= 0 else 0)
    return acc


@njit_leaf
def arena_round(nodes, table, hdrs, nbase, ncap, tshards, pool, pool_hdr, seqs, depths, factors, min_probs,
                active, n_active, slots, tokens, bounds, ends, context_lens, ks, g_nodes, g_table, g_shards, g_pool,
                g_seqs, g_stamps, g_depth, g_clock, use_global, g_lists, g_n, g_len, g_seen, in_sync, out, offsets,
                scores, first, sink, no_stamps, bests, scratch):
    """For i = first.. in order: appends tokens[bounds[i]:bounds[i + 1]] to
    the context stream of the request in slot slots[i] and inserts them (as
    SuffixTrie.append), then, when its context length equals context_lens[i]
    (0: not checked; in_sync[i] says) and ks[i] > 0, drafts: the per-request
    trie's best draft, or the global trie's (g_*, searched when use_global)
    when it scores higher (ties: the longer). Drafts go to out (int32 [>= sum
    of ks]) at offsets (int64 [n + 1], offsets[first] set), their scores
    (float64 [n]) to scores. Inserting and drafting one request after the
    other keeps its rows in cache between the two.

    hdrs: int64 [slots, 5], each request's trie header; tshards: int64
    [slots, 1, 4], each request's hash shard; pool_hdr: int64 [5],
    H_POOL_END the end of the pool's used part. ends: int64 [n], the context
    length once i's tokens are in the pool (-1: not yet; in/out). Returns the
    first i that needs room, for the caller to grow the pool (ends[i] < 0) or
    the request's regions, and to call again from i; n when all are done.
    Before request i, the first rows request i + TOUCH_AHEAD needs are read
    (``_touch``; sink: int64 [1], written so that the reads are kept).

    The global trie's matches of slot s (see follow_global): g_lists int32
    [slots, 3, max_depth + 1] its (node, off, gen) lists, g_n [slots] their
    length, g_len [slots] the context length they are for (-1: none yet),
    g_seen [slots] the trie's clock (g_clock, see SuffixTrie.clock) then.

    Work space (it allocates nothing: see base.njit_leaf): no_stamps int64 [0] (a
    per-request trie's stamps), bests float64 [2, 3], scratch int32 [3, >=
    max(max_depth + 1, the largest k)].
    """
    local_best, g_best = bests[0], bests[1]
    touched = 0
    for i in range(first, slots.shape[0]):
        s, k = slots[i], ks[i]
        ctx = 2 * s + CONTEXT_STREAM
        ahead = i + TOUCH_AHEAD
        if ahead < slots.shape[0] and bounds[ahead + 1] > bounds[ahead]:
            t = slots[ahead]
            touched += _touch(nodes[nbase[t]:nbase[t] + ncap[t]], table, tshards[t], active[t], n_active[t],
                              tokens[bounds[ahead]])
        if ends[i] < 0:
            length, num = seqs[ctx, S_LEN], bounds[i + 1] - bounds[i]
            if length + num > seqs[ctx, S_CAP]:  # move the stream to a larger region at the pool's end
                cap, at, old = 2 * (length + num), pool_hdr[H_POOL_END], seqs[ctx, S_START]
                if at + cap > pool.shape[0]:
                    return i
                for j in range(length):  # (element by element: a slice copy may allocate a temporary)
                    pool[at + j] = pool[old + j]
                seqs[ctx, S_START], seqs[ctx, S_CAP] = at, cap
                pool_hdr[H_POOL_END] = at + cap
            at = seqs[ctx, S_START] + length
            for j in range(num):
                pool[at + j] = tokens[bounds[i] + j]
            ends[i] = length + num
        trie = nodes[nbase[s]:nbase[s] + ncap[s]]
        if append_tokens(trie, no_stamps, table, tshards[s], hdrs[s], pool, seqs, ctx, ROOT, ends[i], active[s],
                         n_active[s:s + 1], depths[s], scratch[0]) < ends[i]:
            return i
        num = offsets[i]
        length = seqs[ctx, S_LEN]
        in_sync[i] = context_lens[i] == 0 or length == context_lens[i]
        scores[i] = 0.0
        if in_sync[i] and k > 0:
            speculate_active(trie, no_stamps, pool, seqs, depths[s], active[s], n_active[s], k, factors[s],
                             min_probs[s], out[num:num + k], local_best, scratch[1])
            drafted, score = int(local_best[1]), local_best[0]
            if use_global and score < k:  # (k tokens of probability 1 cannot be beaten)
                start, lst = seqs[ctx, S_START], g_lists[s]
                g_n[s] = follow_global(g_nodes, g_stamps, g_table, g_shards, g_pool, g_seqs, g_depth,
                                       pool[start:start + length], depths[s], g_len[s], g_seen[s], lst[0], lst[1],
                                       lst[2], g_n[s])
                g_len[s], g_seen[s] = length, g_clock
                g_out = scratch[2]
                speculate_listed(g_nodes, g_stamps, g_pool, g_seqs, g_depth, lst[0], lst[1], g_n[s], k, factors[s],
                                 min_probs[s], local_best[0], g_out, g_best, scratch[1])
                if g_best[0] > local_best[0] or (g_best[0] == local_best[0] and g_best[1] > local_best[1]):
                    drafted, score = int(g_best[1]), g_best[0]
                    for j in range(drafted):
                        out[num + j] = g_out[j]
            num += drafted
            scores[i] = score
        offsets[i + 1] = num
    sink[0] = touched
    return slots.shape[0]


# ------------------------------------------------- branches of a draft ahead
# SuffixProposer.branches: where the target's next tokens leave a draft,
# the draft the method would make there. For a draft d of the context C and
# a position j, the strings C + d[:j] + [t] are not in the tries: their
# matches are found by stepping the context's matches (a per-request trie's
# active nodes, the global trie's lists of follow_global) through d[:j] and
# t, as follow_global steps its lists through appended tokens (entry i the
# suffix of length i + 1; the present ones are a prefix of the list).

@njit_leaf
def _stepped(nodes, table, shards, pool, seqs, max_depth, src_node, src_off, n, tok, max_match, dst_node, dst_off):
    """The matches of a string's suffixes followed by tok, written to dst,
    from the string's (src's first n entries): entry 0 is [tok] from the
    root, entry i + 1 src's entry i stepped by tok, up to the first absent
    or max_match entries; returns their number."""
    node, off = _step_match(nodes, table, shards, pool, seqs, max_depth, ROOT, 0, tok)
    i = 0
    while node >= 0:
        dst_node[i], dst_off[i] = node, off
        i += 1
        if i > n or i == max_match:
            break
        node, off = _step_match(nodes, table, shards, pool, seqs, max_depth, src_node[i - 1], src_off[i - 1], tok)
    return i


@njit_leaf
def _draft_at_end(nodes, stamps, pool, seqs, node, off, max_depth, cap, min_token_prob, out):
    """_draft_from at the match (node, off) of a suffix of C + e in a
    per-request trie holding the context C but not e: once e were
    inserted, the suffix would have one more occurrence, at the context's
    end, with no continuation, so the first token's probability is
    count(child) / (count + 1), and a match inside a leaf chain (count 1)
    would be a node of count 2 whose one child is the chain's next token."""
    if cap <= 0:
        return 0, 0.0
    if nodes[node, LSEQ] >= 0:
        seq = nodes[node, LSEQ]
        pos = nodes[node, LPOS] + off + 1
        if nodes[node, DEPTH] + off + 1 > max_depth or pos >= seqs[seq, S_LEN]:
            return 0, 0.0
        prob = 1.0 / 2.0
        out[0] = pool[seqs[seq, S_START] + pos]
        nxt, nxt_off = node, off + 1
    else:
        b = _best(nodes, stamps, node)
        if b < 0:
            return 0, 0.0
        prob = nodes[b, COUNT] / (nodes[node, COUNT] + 1)
        out[0] = nodes[b, TOK]
        nxt, nxt_off = b, 0
    if prob < min_token_prob:
        return 0, 0.0
    num, score = _draft_from(nodes, stamps, pool, seqs, nxt, nxt_off, max_depth, cap - 1, min_token_prob, out[1:],
                             prob, prob)
    return num + 1, score


@njit_leaf
def _likeliest_child(nodes, pool, seqs, max_depth, node, off, exclude, tried, n_tried):
    """The token after the match (node, off) with the most occurrences (ties:
    the child made last), other than exclude and tried[:n_tried]; -1: none."""
    if nodes[node, LSEQ] >= 0:  # a leaf chain: its one next token
        seq = nodes[node, LSEQ]
        pos = nodes[node, LPOS] + off + 1
        if nodes[node, DEPTH] + off + 1 > max_depth or pos >= seqs[seq, S_LEN]:
            return -1
        t = pool[seqs[seq, S_START] + pos]
        for q in range(n_tried):
            if tried[q] == t:
                return -1
        return t if t != exclude else -1
    best, best_count = -1, 0
    c = nodes[node, FIRST]
    while c >= 0:  # (siblings: the latest made first)
        t, count = nodes[c, TOK], nodes[c, COUNT]
        if count > best_count and t != exclude:
            seen = False
            for q in range(n_tried):
                seen = seen or tried[q] == t
            if not seen:
                best, best_count = t, count
        c = nodes[c, NEXT]
    return best


@njit_leaf
def _branch_draft(nodes, table, shards, pool, seqs, depth, l_node, l_off, nl, g_nodes, g_table, g_shards, g_pool,
                  g_seqs, g_stamps, g_depth, use_global, g_node, g_off, ng, tok, length, factor, min_prob, no_stamps,
                  t_node, t_off, out, bests, scratch):
    """The draft (written to out, int32 [>= length]) of at most length
    tokens that arena_round would make after a string followed by tok (tok
    < 0: after the string), the string's matches given (l: the per-request
    trie's, nl entries; g: the global trie's, ng), the string and tok not
    in the per-request trie; returns its length. t_node, t_off: work space."""
    best, g_best, tmp, g_out = bests[0], bests[1], scratch[0], scratch[1]
    best[:] = 0.0
    if tok >= 0:
        n = _stepped(nodes, table, shards, pool, seqs, depth, l_node, l_off, nl, tok, depth, t_node, t_off)
        m_node, m_off = t_node, t_off
    else:
        n, m_node, m_off = nl, l_node, l_off
    for i in range(n):  # (as speculate_active over the active nodes then)
        num, score = _draft_at_end(nodes, no_stamps, pool, seqs, m_node[i], m_off[i], depth,
                                   _max_draft_len(i + 1, length, factor), min_prob, tmp)
        _keep_if_better(num, score, i + 1, best, tmp, out)
    drafted = int(best[1])
    if use_global and best[0] < length:
        if tok >= 0:
            n = _stepped(g_nodes, g_table, g_shards, g_pool, g_seqs, g_depth, g_node, g_off, ng, tok, depth, t_node,
                         t_off)
            m_node, m_off = t_node, t_off
        else:
            n, m_node, m_off = ng, g_node, g_off
        speculate_listed(g_nodes, g_stamps, g_pool, g_seqs, g_depth, m_node, m_off, n, length, factor, min_prob,
                         best[0], g_out, g_best, tmp)
        if g_best[0] > best[0] or (g_best[0] == best[0] and g_best[1] > best[1]):
            drafted = int(g_best[1])
            for j in range(drafted):
                out[j] = g_out[j]
    return drafted


@njit_leaf
def _context_matches(active, n_active, pool, seqs, s, depth, g_nodes, g_table, g_shards, g_pool, g_seqs, g_stamps,
                     g_depth, g_clock, use_global, g_lists, g_n, g_len, g_seen, l_node, l_off, g_node, g_off):
    """The matches of slot s's context: its active nodes (l) and its lists
    in the global trie (g, brought up to date first as arena_round does);
    returns (nl, ng), their numbers."""
    nl = n_active[s]
    for q in range(nl):  # by increasing depth
        l_node[q], l_off[q] = active[s, q], 0
    ng = 0
    if use_global:
        ctx = 2 * s + CONTEXT_STREAM
        start, c = seqs[ctx, S_START], seqs[ctx, S_LEN]
        lst = g_lists[s]
        g_n[s] = follow_global(g_nodes, g_stamps, g_table, g_shards, g_pool, g_seqs, g_depth, pool[start:start + c],
                               depth, g_len[s], g_seen[s], lst[0], lst[1], lst[2], g_n[s])
        g_len[s], g_seen[s] = c, g_clock
        ng = g_n[s]
        for q in range(ng):
            g_node[q], g_off[q] = lst[0, q], lst[1, q]
    return nl, ng


@njit_leaf
def _step_matches(nodes, table, shards, pool, seqs, depth, g_nodes, g_table, g_shards, g_pool, g_seqs, g_depth,
                  use_global, l_node, l_off, nl, g_node, g_off, ng, tok, t_node, t_off):
    """Both lists of matches (_context_matches) stepped by tok, in place;
    returns their new numbers (t_node, t_off: work space)."""
    nl = _stepped(nodes, table, shards, pool, seqs, depth, l_node, l_off, nl, tok, depth, t_node, t_off)
    for q in range(nl):
        l_node[q], l_off[q] = t_node[q], t_off[q]
    if use_global:
        ng = _stepped(g_nodes, g_table, g_shards, g_pool, g_seqs, g_depth, g_node, g_off, ng, tok, depth, t_node,
                      t_off)
        for q in range(ng):
            g_node[q], g_off[q] = t_node[q], t_off[q]
    return nl, ng


@njit_leaf
def arena_branches(nodes, table, nbase, ncap, tshards, pool, seqs, depths, factors, min_probs, active, n_active,
                   slots, drafts, offsets, branch_depths, lengths, width, g_nodes, g_table, g_shards, g_pool, g_seqs,
                   g_stamps, g_depth, g_clock, use_global, g_lists, g_n, g_len, g_seen, ranked, r_offsets, pos, tok,
                   starts, ids, counts, no_stamps, lists, bests, scratch, tried):
    """Branches of the drafts ``drafts[offsets[i]:offsets[i + 1]]`` of the
    requests in slots (SuffixProposer.branches): at each position j <=
    min(branch_depths[i], the draft's length), up to ``width`` tokens t
    other than the draft's own, each with the draft of at most lengths[i]
    tokens that arena_round would make after the context + draft[:j] + [t]
    (tokens it makes no draft after are skipped; the probabilities count the
    new tokens' suffixes once more, at the context's end: _draft_at_end).

    Which t: the tokens that follow the matches of the context +
    draft[:j] in the per-request trie, then in the global trie, the longest
    match first, each match's by decreasing count; then
    ``ranked[r_offsets[i]:r_offsets[i + 1]]``'s (int32: sequence i's
    context's tokens, the most frequent first, base.by_frequency: a token
    no match continues, where the target's next token often falls, still
    gets the draft of its own short match); at most tried.shape[0] tried a
    position.

    Writes counts[i] (sequence i's branches), pos and tok (int32 [>= their
    number]: branch b's j and t), starts (int64 [>= their number + 1],
    starts[0] set: branch b's draft is ids[starts[b]:starts[b + 1]]) and
    ids; returns the number of branches. Work space: lists int32 [6, >=
    max_depth + 1], tried int32 [>= 1], bests float64 [2, 3], scratch int32
    [2, >= max(lengths)].
    """
    l_node, l_off, g_node, g_off, t_node, t_off = lists[0], lists[1], lists[2], lists[3], lists[4], lists[5]
    m = 0
    for i in range(slots.shape[0]):
        counts[i] = 0
        if branch_depths[i] <= 0 or lengths[i] <= 0:
            continue
        s, length = slots[i], lengths[i]
        depth, factor, min_prob = depths[s], factors[s], min_probs[s]
        trie, shards = nodes[nbase[s]:nbase[s] + ncap[s]], tshards[s]
        nl, ng = _context_matches(active, n_active, pool, seqs, s, depth, g_nodes, g_table, g_shards, g_pool, g_seqs,
                                  g_stamps, g_depth, g_clock, use_global, g_lists, g_n, g_len, g_seen, l_node, l_off,
                                  g_node, g_off)
        draft = drafts[offsets[i]:offsets[i + 1]]
        d = draft.shape[0]
        first_m = m
        for j in range(min(branch_depths[i], d) + 1):
            exclude = draft[j] if j < d else -1
            first, n_tried = m, 0
            # the per-request trie's matches (longest first), the global trie's, then ranked's tokens
            for where in range(3):
                n = nl if where == 0 else ng if where == 1 else r_offsets[i + 1] - r_offsets[i]
                for e in range(n):
                    while m - first < width and n_tried < tried.shape[0]:
                        if where == 0:
                            t = _likeliest_child(trie, pool, seqs, depth, l_node[nl - 1 - e], l_off[nl - 1 - e],
                                                 exclude, tried, n_tried)
                        elif where == 1:
                            t = _likeliest_child(g_nodes, g_pool, g_seqs, g_depth, g_node[ng - 1 - e],
                                                 g_off[ng - 1 - e], exclude, tried, n_tried)
                        else:
                            t = ranked[r_offsets[i] + e]
                            for q in range(n_tried):
                                if tried[q] == t:
                                    t = -1
                                    break
                            if t == exclude:
                                t = -1
                        if t < 0:
                            break
                        tried[n_tried] = t
                        n_tried += 1
                        num = _branch_draft(trie, table, shards, pool, seqs, depth, l_node, l_off, nl, g_nodes,
                                            g_table, g_shards, g_pool, g_seqs, g_stamps, g_depth, use_global, g_node,
                                            g_off, ng, t, length, factor, min_prob, no_stamps, t_node, t_off,
                                            ids[starts[m]:starts[m] + length], bests, scratch)
                        if num > 0:
                            pos[m], tok[m] = j, t
                            starts[m + 1] = starts[m] + num
                            m += 1
                        if where == 2:  # (one token a ranked entry)
                            break
            if j < d:  # the matches of the context + draft[:j + 1]
                nl, ng = _step_matches(trie, table, shards, pool, seqs, depth, g_nodes, g_table, g_shards, g_pool,
                                       g_seqs, g_depth, use_global, l_node, l_off, nl, g_node, g_off, ng, draft[j],
                                       t_node, t_off)
        counts[i] = m - first_m
    return m


@njit_leaf
def arena_ahead(nodes, table, nbase, ncap, tshards, pool, seqs, depths, factors, min_probs, active, n_active, slots,
                drafts, offsets, ks, ahead_ks, g_nodes, g_table, g_shards, g_pool, g_seqs, g_stamps, g_depth, g_clock,
                use_global, g_lists, g_n, g_len, g_seen, out, out_offsets, no_stamps, lists, bests, scratch):
    """Drafts ahead (RoundUpdates.ahead_ks): sequence i's draft
    ``drafts[offsets[i]:offsets[i + 1]]`` (d tokens), followed, when
    0 < d <= ahead_ks[i] (the draft ends within the round being verified),
    by the draft of at most ks[i] - d tokens that arena_round would make
    after the context + draft (_branch_draft): its first token guesses
    that round's target token, the rest is the next round's draft if the
    round accepts the whole draft. So a draft that the length cap (a match
    of m tokens drafts at most ceil(m * max_spec_factor)) ended still
    reaches into the next round, from the match that the round's tokens
    grow. Writes out (int32 [>= sum of ks]) at out_offsets (int64 [n + 1],
    out_offsets[0] set). Work space as arena_branches' (scratch int32 [2,
    >= max(ks)])."""
    l_node, l_off, g_node, g_off, t_node, t_off = lists[0], lists[1], lists[2], lists[3], lists[4], lists[5]
    for i in range(slots.shape[0]):
        at, d = out_offsets[i], offsets[i + 1] - offsets[i]
        for j in range(d):
            out[at + j] = drafts[offsets[i] + j]
        num = d
        if 0 < d <= ahead_ks[i] and d < ks[i]:
            s = slots[i]
            depth = depths[s]
            trie, shards = nodes[nbase[s]:nbase[s] + ncap[s]], tshards[s]
            nl, ng = _context_matches(active, n_active, pool, seqs, s, depth, g_nodes, g_table, g_shards, g_pool,
                                      g_seqs, g_stamps, g_depth, g_clock, use_global, g_lists, g_n, g_len, g_seen,
                                      l_node, l_off, g_node, g_off)
            for j in range(d):
                nl, ng = _step_matches(trie, table, shards, pool, seqs, depth, g_nodes, g_table, g_shards, g_pool,
                                       g_seqs, g_depth, use_global, l_node, l_off, nl, g_node, g_off, ng,
                                       drafts[offsets[i] + j], t_node, t_off)
            num += _branch_draft(trie, table, shards, pool, seqs, depth, l_node, l_off, nl, g_nodes, g_table,
                                 g_shards, g_pool, g_seqs, g_stamps, g_depth, use_global, g_node, g_off, ng, -1,
                                 ks[i] - d, factors[s], min_probs[s], no_stamps, t_node, t_off,
                                 out[at + d:at + ks[i]], bests, scratch)
        out_offsets[i + 1] = at + num


# ----------------------------------------------------------- Python handle
#: address space reserved for each large array of the tries (a
#: RequestArena's node and hash rows; the global trie's node rows, hash
#: rows and stamps, its pool a node row's share), committed by the OS only
#: as rows are first written (see _reserve): a quarter of the machine's
#: memory, at most 1 GiB (22M global-trie node rows; B=256 sequences of ~1k
#: tokens use about 1M arena rows, 1000 cached outputs of ~500 tokens about
#: 2M global rows). The cap keeps several proposers' reservations small where
#: the kernel counts address space (vm.overcommit_memory=2) and on hosts
#: whose RAM a container's limit does not show
RESERVE_BYTES = min(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4, 1 << 30)
#: tokens tried at a draft position, per branch asked for there
#: (SuffixProposer.branches): a token the method makes no draft after costs
#: a try and gives no branch
BRANCH_TRIES_PER_WIDTH = 2
#: tokens of an output inserted into the global trie in one step of its
#: upkeep (_GlobalCache.work), so that a step rarely overruns a slice of
#: upkeep between messages: 0.05 ms (median), 0.4 ms (p99; 64 tokens: 0.10,
#: 0.8) at depth 64 with 1000 cached outputs of 512 tokens of stdlib text,
#: AMD EPYC
INSERT_CHUNK = 32
#: tokens of the oldest output whose occurrences leave the global trie in
#: one step of its eviction (_GlobalCache.work): an output's whole took 0.9
#: ms (mean), 2.6 (p99), up to 4.7 as one step (bench_suffix_micro.py --upkeep)
EVICT_CHUNK = 64
#: hash shards of the global trie: a shard's growth rehashes 1/TABLE_SHARDS
#: of the keys (about 130k at 2M nodes). (B=256 rounds in-process, same
#: run: 10-20% slower with 64 shards than with 1 or 16.)
TABLE_SHARDS = 16
#: rows of a doubling hash shard of the global trie rehashed in one step of
#: upkeep (SuffixTrie.grow_step; twice as many new rows cleared in one):
#: a doubling at once took 4-9 ms at 2M nodes (bench_suffix_micro.py --upkeep)
REHASH_CHUNK = 8192
#: tokens of the global trie's streams moved down in one step of the pool's
#: compaction (SuffixTrie.compact_step; a stream moves whole, a longer one
#: alone): 0.03 ms (mean), 0.05 (p99) with caches cold, 16 steps for 1000
#: cached outputs of 496 tokens (8192: 63 steps of 0.01 ms; AMD EPYC). The
#: whole pool in one step (Python) made the upkeep calls that compacted take
#: 2.5-2.7 ms at most, 0.8-0.9 in steps (bench_suffix_micro.py --upkeep)
COMPACT_CHUNK = 32768


def _reserve(rows: int, row_shape: tuple[int, ...], dtype: type, huge: bool = False) -> np.ndarray:
    """An array of ``rows`` rows of ``row_shape`` over anonymous memory: it
    reads as zeros and the OS commits a page when it is first written, so a
    large reservation costs nothing until used and using more of it costs
    only the pages touched."""
    nbytes = rows * math.prod(row_shape) * np.dtype(dtype).itemsize
    # 4 KiB pages unless huge (MADV_HUGEPAGE, numpy's choice for its large
    # arrays): a transparent huge page faulted in mid-round cost up to 5-8 ms
    # here (B=256 round p99 6-7 ms against 3.1 with 4 KiB pages, same run)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    if huge:
        try:
            memory.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):  # no transparent huge pages here (not Linux, or not in this kernel)
            pass
    return np.frombuffer(memory, dtype=dtype).reshape(rows, *row_shape)


def _moved(array: np.ndarray, rows: int, used: int, huge: bool = False) -> np.ndarray:
    """A reservation of ``rows`` rows holding ``array``'s first ``used``."""
    grown = _reserve(rows, array.shape[1:], array.dtype.type, huge)
    grown[:used] = array[:used]
    return grown


class SuffixTrie:
    """Owns one trie's arrays and grows them; streams are numbered 0..S-1.

    Only the last stream written to the pool may grow (``pool_end`` is the end
    of the used part of the pool, ``pool_cap`` the part it may use before a
    compaction).

    Growth never copies while the reservations last (``reserve_bytes`` each,
    see _reserve): node rows and stamps are used in order from the start of
    theirs, the pool's capacity doubles in place, and the hash table is
    TABLE_SHARDS shards in a reservation of TABLE_SHARDS + 1 slots of R rows
    (R = shard_rows), each shard in one slot, doubling one tight shard at a
    time. (Doubling whole arrays, a 2M-node trie's node rows, stamps and
    hash table, cost an upkeep round 378 ms: bench_suffix_micro.py
    --upkeep.) Past a reservation, its rows move once to one twice as large.

    A tight shard doubles in steps (``grow_step``): it is rebuilt in the
    *spare* slot (the one no shard uses), REHASH_CHUNK rows at a time, then
    takes that slot and leaves its own as the spare. Between two steps its
    old rows serve every read: nothing may write to the trie until the
    doubling is done (inserts stop while a shard is tight; the caller runs
    no removal meanwhile: ``needs_growth``).

    The pool is compacted in steps too (``start_compaction``,
    ``compact_step``): the live streams, in pool order, move down to its
    start, oldest first, COMPACT_CHUNK tokens a step (or one longer stream
    alone), each stream whole in one step: between two steps every stream's
    tokens are at seqs[s, S_START], the moved ones' at their new place, so
    reads and drafts are those of before. Nothing may write to the pool
    until the compaction is done (the caller writes no stream meanwhile:
    ``compacting``); its last step ends the used part after the last stream,
    with room for the ``extra`` tokens it was started with.
    """

    def __init__(self, max_depth: int, num_streams: int, reserve_bytes: int | None = None,
                 num_shards: int | None = None) -> None:
        """reserve_bytes and num_shards: RESERVE_BYTES and TABLE_SHARDS when None."""
        self.max_depth = max_depth
        reserve = RESERVE_BYTES if reserve_bytes is None else reserve_bytes
        num_shards = TABLE_SHARDS if num_shards is None else num_shards
        room = max_depth + 2  # node rows and hash keys an insert step may add
        node_rows = max(reserve // (4 * (NUM_FIELDS + 2)), 256, 2 * room)
        # huge pages (faulted in by upkeep only: drafts never write these
        # rows): inserts and evictions about 15% faster than over 4 KiB pages
        self.nodes = _reserve(node_rows, (NUM_FIELDS + 2,), np.int32, huge=True)  # with GEN and GAP
        self.stamps = _reserve(node_rows, (), np.int64, huge=True)
        self.hdr = np.array([1, -1, 1, 0, 0], dtype=np.int64)  # root allocated, pool empty
        self.nodes[ROOT] = -1
        self.nodes[ROOT, COUNT] = self.nodes[ROOT, DEPTH] = 0
        # hash shards: each at least twice room + 1 rows (an empty shard is not tight)
        first = 1 << max(4, (2 * room + 1).bit_length())
        self.shard_rows = max(first, 1 << (max(reserve // (16 * num_shards), 1).bit_length() - 1))
        # (4 KiB pages: a huge page per shard would commit 2 MiB for each)
        self.table = _reserve((num_shards + 1) * self.shard_rows, (2,), np.int64)  # hash table: (key, child) rows
        self.shards = np.zeros((num_shards, 4), dtype=np.int64)
        for s in range(num_shards):
            _resize_shard(self.table, self.shards, s, s * self.shard_rows, first, room)
        self.spare = num_shards * self.shard_rows  # base of the slot no shard uses
        self._spare_rows = 0  # rows of the spare slot written (committed) so far
        # the shard doubling into the spare slot: (shard, new size, new rows cleared, old rows rehashed)
        self._doubling: tuple[int, int, int, int] | None = None
        # the compaction under way: (its live streams, the next to move, where it goes, room to leave)
        self._compaction: tuple[np.ndarray, int, int, int] | None = None
        self.pool = _reserve(node_rows, (), np.int32)
        self.pool_cap = 256
        self.seqs = np.zeros((num_streams, 3), dtype=np.int64)
        # 1 + the latest time of an appended token: streams are appended in time
        # order (a later one's tokens are seen at times >= the clock then), as
        # _GlobalCache does (see follow_global)
        self.clock = 0

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
        self.write(seq, tokens)
        self.insert(seq, self.pool_end - int(self.seqs[seq, S_START]), active, n_active)

    def write(self, seq: int, tokens: np.ndarray) -> None:
        """Writes tokens (int32 [m]) after stream ``seq``'s, the last ones in
        the pool, without inserting them (``insert`` does)."""
        self.reserve_pool(len(tokens))
        self.pool[self.pool_end:self.pool_end + len(tokens)] = tokens
        self.pool_end += len(tokens)

    def insert(self, seq: int, end: int, active: np.ndarray, n_active: np.ndarray) -> None:
        """Inserts stream ``seq``'s written tokens up to position ``end``
        (as ``append``), growing at once when needed."""
        while self.insert_some(seq, end, active, n_active) < end:
            self.grow()

    def insert_some(self, seq: int, end: int, active: np.ndarray, n_active: np.ndarray) -> int:
        """Inserts stream ``seq``'s written tokens up to position ``end``, or
        fewer if the trie needs growth first (``needs_growth``); returns how
        many of its tokens are inserted. Between two calls the trie is the
        one of the tokens inserted so far, drafts may read it: the clock
        follows them."""
        done = int(append_tokens(self.nodes, self.stamps, self.table, self.shards, self.hdr, self.pool,
                                 self.seqs, seq, ROOT, end, active, n_active, self.max_depth,
                                 np.empty(self.max_depth + 1, dtype=np.int32)))
        self.clock = max(self.clock, int(self.seqs[seq, S_TIME]) + done)
        return done

    def remove(self, seq: int, first: int, stop: int) -> None:
        """Removes stream ``seq``'s occurrences starting at first..stop - 1
        (those before removed already; see remove_stream); the stream is
        empty once stop is its length."""
        remove_stream(self.nodes, self.stamps, self.table, self.shards, self.hdr, self.pool,
                      self.seqs, seq, first, stop, self.max_depth)
        if stop == self.seqs[seq, S_LEN]:
            self.seqs[seq, S_LEN] = 0

    def tokens(self, seq: int) -> np.ndarray:
        """Stream ``seq``'s inserted tokens (a view, int32 [n])."""
        start, n = int(self.seqs[seq, S_START]), int(self.seqs[seq, S_LEN])
        return self.pool[start:start + n]

    def reserve_pool(self, extra: int) -> None:
        """Makes room for ``extra`` more tokens at the pool's end."""
        assert self._compaction is None, "no write to the pool while it is compacted"
        if self.pool_end + extra > self.pool_cap:
            self.pool_cap = max(2 * self.pool_cap, self.pool_end + extra)
            if self.pool_cap > len(self.pool):
                self.pool = _moved(self.pool, max(2 * len(self.pool), self.pool_cap), self.pool_end)

    # -- compaction
    @property
    def compacting(self) -> bool:
        """A compaction is under way: no stream may be written."""
        return self._compaction is not None

    def start_compaction(self, live: np.ndarray, extra: int) -> None:
        """Starts packing the streams in ``live`` (int64 [m], every one
        whole: its written tokens all inserted) at the pool start, with room
        for ``extra`` more tokens after them; compact_step moves them."""
        starts = self.seqs[live, S_START]
        assert (starts[1:] >= starts[:-1]).all(), "live streams in pool order: each moves down into garbage"
        self._compaction = (live, 0, 0, extra)

    def compact_step(self) -> bool:
        """Moves the compaction's next streams, COMPACT_CHUNK tokens or one
        longer stream (pack_streams); True while some are left."""
        assert self._compaction is not None
        live, i, at, extra = self._compaction
        i, at = pack_streams(self.pool, self.seqs, live, i, at, COMPACT_CHUNK, S_LEN)
        self._compaction = (live, int(i), int(at), extra)
        if i < len(live):
            return True
        self._compaction = None
        self.pool_end = int(at)
        self.reserve_pool(extra)
        return False

    # -- capacity
    def needs_growth(self) -> bool:
        """Inserts stop until grown: the node rows might run out, or a hash
        shard is tight (also while it doubles: no write may come before
        the doubling is done)."""
        return bool(self.hdr[H_USED] + self.max_depth + 2 > len(self.nodes) or self.hdr[H_TIGHT] > 0)

    def grow(self) -> None:
        """All the growth needed now, at once (see grow_step)."""
        while self.grow_step():
            pass

    def grow_step(self) -> bool:
        """A step of growth towards room for max_depth + 2 more nodes and
        their hash keys; True while some is left. Node rows and stamps past
        their reservation move to one twice as large in one step; a tight
        hash shard doubles in steps of REHASH_CHUNK rows (past R rows, every
        shard moves to a reservation of 2R rows a shard first, in its first)."""
        room, used = self.max_depth + 2, int(self.hdr[H_USED])
        if used + room > len(self.nodes):
            rows = max(2 * len(self.nodes), used + room)
            self.nodes, self.stamps = _moved(self.nodes, rows, used, True), _moved(self.stamps, rows, used, True)
        elif self._doubling is not None:
            self._double_some()
        elif (tight := np.flatnonzero(self.shards[:, T_KEYS] > self.shards[:, T_LIMIT])).size:
            s = int(tight[0])
            size = 2 * int(self.shards[s, T_SIZE])
            if size > self.shard_rows:
                self._spread_shards(2 * self.shard_rows)
            self._doubling = (s, size, 0, 0)
            self._double_some()
        return self.needs_growth()

    def _double_some(self) -> None:
        """Clears 2 * REHASH_CHUNK more rows of the doubling shard's new
        rows (in the spare slot), or rehashes REHASH_CHUNK more of its old
        ones; after the last, the shard takes the spare slot."""
        assert self._doubling is not None
        s, size, cleared, moved = self._doubling
        base, old_base, old_size = self.spare, int(self.shards[s, T_BASE]), int(self.shards[s, T_SIZE])
        if cleared < size:
            end = min(cleared + 2 * REHASH_CHUNK, size)
            self.table[base + cleared:base + end] = _EMPTY
            self._doubling = (s, size, end, moved)
            self._spare_rows = max(self._spare_rows, end)
            return
        end = min(moved + REHASH_CHUNK, old_size)
        rehash(self.table, len(self.shards), self.table[old_base:old_base + old_size], moved, end, base, size)
        self._doubling = (s, size, cleared, end)
        if end == old_size:  # done: the shard moves to its new rows at once
            limit = _limit(s, len(self.shards), size, self.max_depth + 2)
            self.shards[s, T_BASE], self.shards[s, T_SIZE], self.shards[s, T_LIMIT] = base, size, limit
            self.spare, self._spare_rows, self._doubling = old_base, old_size, None
            self.hdr[H_TIGHT] = int((self.shards[:, T_KEYS] > self.shards[:, T_LIMIT]).sum())

    def _spread_shards(self, shard_rows: int) -> None:
        """Moves the hash shards to a reservation of shard_rows rows a shard,
        shard s to slot s, the spare slot last (a shard's rows keep their
        order: homes depend on its size only)."""
        num_shards = len(self.shards)
        table = _reserve((num_shards + 1) * shard_rows, (2,), np.int64)
        for s in range(num_shards):
            at, size = int(self.shards[s, T_BASE]), int(self.shards[s, T_SIZE])
            table[s * shard_rows:s * shard_rows + size] = self.table[at:at + size]
            self.shards[s, T_BASE] = s * shard_rows
        self.table, self.shard_rows, self.spare = table, shard_rows, num_shards * shard_rows
        self._spare_rows = 0

    def live_nodes(self) -> int:
        return int(self.hdr[H_LIVE])

    def nbytes(self) -> int:
        """Bytes of the rows in use (the reservations' committed part)."""
        used = int(self.hdr[H_USED])
        table_rows = int(self.shards[:, T_SIZE].sum()) + self._spare_rows
        return (used * (self.nodes[:1].nbytes + self.stamps.itemsize) + table_rows * self.table[:1].nbytes
                + self.pool_cap * self.pool.itemsize
                + sum(a.nbytes for a in (self.seqs, self.hdr, self.shards)))


# ------------------------------------------------------------------ proposer
@dataclass(frozen=True)
class SuffixConfig:
    """Replica-level settings of the suffix proposer."""

    max_cached_requests: int = 1000  # finished outputs in the global trie (0: no global trie)
    max_tree_depth: int = 64  # depth of every trie; caps the per-request max_tree_depth
    # False: a finished output enters the global trie at once (stop). True (a
    # served replica): it waits for between_messages, which the servicer calls
    # in slices while no message waits, so inserting it and evicting the
    # oldest (ms each at depth 64) overlap the gateway's verification instead
    # of delaying the round that released it, which then drafts without it.
    cache_between_messages: bool = False


class _Regions:
    """Power-of-2 sized regions of rows of a reserved array (``_reserve``),
    handed out and back by size: freed regions are reused by the next region
    of their size, new ones are cut at the end of the rows cut so far. A
    region keeps its offset for its life.

    Growth: cutting a region commits only its own pages; the rows cut so
    far are never copied while the reservation (``reserve_bytes``) lasts.
    (Doubling one array whose rows were all written cost a round at B=256
    130-170 ms: the new array's every page faulted in and written, the old
    rows copied.) Past the reservation the rows move once to a reservation
    twice as large.
    """

    def __init__(self, row_shape: tuple[int, ...], dtype: type, fill: int, reserve_bytes: int) -> None:
        row_bytes = math.prod(row_shape) * np.dtype(dtype).itemsize
        self.array = _reserve(max(reserve_bytes // row_bytes, 1024), row_shape, dtype)
        self.fill = fill  # what a fresh (or freed) region holds
        self.end = 0  # rows cut so far: the array's rows past it are untouched (zeros)
        self._free: dict[int, list[int]] = {}  # size -> offsets of free regions

    def take(self, size: int) -> int:
        """A region of ``size`` rows holding ``fill``; returns its offset."""
        free = self._free.get(size)
        if free:
            return free.pop()
        if self.end + size > len(self.array):
            grown = _reserve(max(2 * len(self.array), self.end + size), self.array.shape[1:], self.array.dtype.type)
            grown[:self.end] = self.array[:self.end]
            self.array = grown
        if self.fill:
            self.array[self.end:self.end + size] = self.fill
        self.end += size
        return self.end - size

    def give_back(self, offset: int, size: int) -> None:
        self.array[offset:offset + size] = self.fill
        self._free.setdefault(size, []).append(offset)

    def nbytes(self) -> int:
        """Bytes of the rows cut so far (the memory the regions use)."""
        return self.end * self.array[:1].nbytes


class RequestArena:
    """The per-request tries of all live requests in shared arrays (see
    arena_round): node and hash-table regions by slot, the streams' tokens
    in one pool, plus per-slot settings and active nodes.

    Invariants: a live slot s has a node region of ncap[s] rows at nbase[s]
    (its root at local row 0, header hdrs[s]) and a hash region, the one
    shard tshards[s, 0] (base, size, keys, limit; see the hash table);
    streams 2s (reference, time base 0)
    and 2s + 1 (context, time base the reference's length), each in its own
    pool region of S_CAP tokens (regions of closed slots and moved streams
    are garbage, reclaimed when the pool is compacted);
    active[s, :n_active[s]] are the context's active nodes. Per-request
    tries never lose an occurrence, so they keep no stamps (nor PREV links).
    g_lists[s, :, :g_n[s]] are the slot's matches in the global trie (see
    follow_global), for its first g_len[s] tokens and the trie's clock
    g_seen[s].
    """

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self._nodes = _Regions((NUM_FIELDS,), np.int32, 0, RESERVE_BYTES)
        self._table = _Regions((2,), np.int64, _EMPTY, RESERVE_BYTES)
        self.pool = np.zeros(1024, dtype=np.int32)
        self.pool_hdr = np.zeros(5, dtype=np.int64)  # H_POOL_END: end of the pool's used part
        self.seqs = np.zeros((32, 4), dtype=np.int64)  # by stream: 2 * slot + REFERENCE/CONTEXT_STREAM
        self.hdrs = np.zeros((16, 5), dtype=np.int64)  # by slot, as SuffixTrie.hdr
        self.nbase, self.ncap = np.zeros(16, dtype=np.int64), np.zeros(16, dtype=np.int64)
        self.tshards = np.zeros((16, 1, 4), dtype=np.int64)  # by slot: its one hash shard
        self.depths = np.zeros(16, dtype=np.int64)
        self.factors = np.zeros(16)
        self.min_probs = np.zeros(16)
        self.active = np.zeros((16, max_depth + 1), dtype=np.int32)
        self.n_active = np.zeros(16, dtype=np.int64)
        self.g_lists = np.zeros((16, 3, max_depth + 1), dtype=np.int32)
        self.g_n, self.g_len, self.g_seen = (np.zeros(16, dtype=np.int64) for _ in range(3))
        self._free: list[int] = []  # slots to reuse
        self._num_slots = 0  # slots ever handed out
        self._sink = np.zeros(1, dtype=np.int64)  # see arena_round
        # arena_round's work space (see there; wider when a round asks for more drafts)
        self._bests, self._scratch = np.zeros((2, 3)), np.zeros((3, max_depth + 1), dtype=np.int32)

    def open(self, context: np.ndarray, depth: int, options: SeqOptions) -> int:
        """A slot with a new request's trie over its reference and context."""
        slot = self._free.pop() if self._free else self._new_slot()
        self.depths[slot], self.factors[slot] = depth, options.max_spec_factor
        self.min_probs[slot] = options.min_token_prob
        self.g_n[slot], self.g_len[slot] = 0, -1
        reference = np.ascontiguousarray(options.reference_token_ids, dtype=np.int32)
        self._place(2 * slot + REFERENCE_STREAM, reference, 0, len(reference))
        self._place(2 * slot + CONTEXT_STREAM, context, len(reference), max(64, 2 * len(context)))
        size = len(reference) + len(context)
        ncap = 1 << max(8, (2 * size + 2 * depth + 4).bit_length())
        self.nbase[slot], self.ncap[slot] = self._nodes.take(ncap), ncap
        self.tshards[slot, 0] = (self._table.take(2 * ncap), 2 * ncap, 0, ncap - depth - 2)
        self.hdrs[slot] = (1, -1, 1, 0, 0)  # the root allocated
        root = self._nodes.array[self.nbase[slot]]
        root[:] = -1
        root[COUNT] = root[DEPTH] = 0
        for row, end in ((2 * slot + REFERENCE_STREAM, len(reference)), (2 * slot + CONTEXT_STREAM, len(context))):
            self.n_active[slot] = 0
            while append_tokens(self._trie(slot), _NO_STAMPS, self._table.array, self.tshards[slot],
                                self.hdrs[slot], self.pool, self.seqs, row, ROOT, end, self.active[slot],
                                self.n_active[slot:slot + 1], depth, self._scratch[0]) < end:
                self._grow(slot)
        return slot

    def close(self, slot: int) -> None:
        """Gives the slot's regions back."""
        self._nodes.give_back(int(self.nbase[slot]), int(self.ncap[slot]))
        self._table.give_back(int(self.tshards[slot, 0, T_BASE]), int(self.tshards[slot, 0, T_SIZE]))
        self.ncap[slot] = 0
        self.tshards[slot] = 0
        self.hdrs[slot] = 0
        self.seqs[2 * slot:2 * slot + 2] = 0
        self._free.append(slot)

    def context(self, slot: int) -> np.ndarray:
        """The slot's context (a view, int32 [n]; valid until the next round)."""
        row = 2 * slot + CONTEXT_STREAM
        start, n = int(self.seqs[row, S_START]), int(self.seqs[row, S_LEN])
        return self.pool[start:start + n]

    def live_nodes(self) -> int:
        return int(self.hdrs[:, H_LIVE].sum())

    def nbytes(self) -> int:
        return self._nodes.nbytes() + self._table.nbytes() + sum(
            a.nbytes for a in (self.pool, self.pool_hdr, self.seqs, self.hdrs, self.nbase, self.ncap, self.tshards,
                               self.depths, self.factors, self.min_probs, self.active, self.n_active,
                               self.g_lists, self.g_n, self.g_len, self.g_seen))

    def round(self, slots: np.ndarray, tokens: np.ndarray, bounds: np.ndarray, context_lens: np.ndarray,
              ks: np.ndarray, glob: SuffixTrie | None) -> tuple[DraftBatch, np.ndarray]:
        """arena_round over all of slots (int64 [n]), growing arrays between
        calls; the drafts and their scores (float64 [n])."""
        n = len(slots)
        ends, in_sync, scores = np.full(n, -1, dtype=np.int64), np.empty(n, dtype=np.bool_), np.empty(n)
        out, offsets = np.empty(int(ks.sum()), dtype=np.int32), np.zeros(n + 1, dtype=np.int64)
        if n and ks.max() > self._scratch.shape[1]:
            self._scratch = np.zeros((3, int(ks.max())), dtype=np.int32)
        g = glob if glob is not None else _NO_TRIE
        i = 0
        while (i := arena_round(self._nodes.array, self._table.array, self.hdrs, self.nbase, self.ncap,
                                self.tshards, self.pool, self.pool_hdr, self.seqs, self.depths, self.factors,
                                self.min_probs, self.active, self.n_active, slots, tokens, bounds, ends,
                                context_lens, ks, g.nodes, g.table, g.shards, g.pool, g.seqs, g.stamps, g.max_depth,
                                g.clock, glob is not None, self.g_lists, self.g_n, self.g_len, self.g_seen, in_sync,
                                out, offsets, scores, i, self._sink, _NO_STAMPS, self._bests,
                                self._scratch)) < n:
            if ends[i] < 0:
                row = 2 * int(slots[i]) + CONTEXT_STREAM
                self._compact(2 * int(self.seqs[row, S_LEN] + bounds[i + 1] - bounds[i]))
            else:
                self._grow(int(slots[i]))
        return DraftBatch(in_sync, out[:offsets[-1]], offsets), scores

    def branches(self, slots: np.ndarray, drafts: np.ndarray, offsets: np.ndarray, depths: np.ndarray,
                 lengths: np.ndarray, width: int, glob: SuffixTrie | None) -> BranchBatch:
        """arena_branches over all of slots (int64 [n]): at most ``width``
        branches at each position j <= depths[i] of sequence i's draft, each
        with a draft of at most lengths[i] tokens (depths, lengths: int64 [n])."""
        n = len(slots)
        wanted = (depths > 0) & (lengths > 0)
        most = int(((depths + 1) * width * wanted).sum())
        pos, tok = np.empty(most, dtype=np.int32), np.empty(most, dtype=np.int32)
        starts = np.zeros(most + 1, dtype=np.int64)
        ids = np.empty(int(((depths + 1) * width * np.maximum(lengths, 0) * wanted).sum()), dtype=np.int32)
        counts = np.zeros(n, dtype=np.int64)
        by_slot = [by_frequency(self.context(int(slots[i]))) if wanted[i] else _NO_TOKENS for i in range(n)]
        ranked = np.concatenate(by_slot) if by_slot else _NO_TOKENS
        sizes = np.array([len(r) for r in by_slot], dtype=np.int64)
        g = glob if glob is not None else _NO_TRIE
        m = arena_branches(self._nodes.array, self._table.array, self.nbase, self.ncap, self.tshards, self.pool,
                           self.seqs, self.depths, self.factors, self.min_probs, self.active, self.n_active, slots,
                           np.ascontiguousarray(drafts, dtype=np.int32), offsets, depths, lengths, width, g.nodes,
                           g.table, g.shards, g.pool, g.seqs, g.stamps, g.max_depth, g.clock, glob is not None,
                           self.g_lists, self.g_n, self.g_len, self.g_seen, ranked, bounds_of(sizes), pos, tok, starts,
                           ids, counts, _NO_STAMPS,
                           *self._work(int(lengths.max(initial=0))),
                           np.zeros(BRANCH_TRIES_PER_WIDTH * width, dtype=np.int32))
        return BranchBatch(bounds_of(counts), pos[:m], tok[:m], starts[:m + 1], ids[:starts[m]])

    def ahead(self, slots: np.ndarray, drafts: np.ndarray, offsets: np.ndarray, ks: np.ndarray,
              ahead_ks: np.ndarray, glob: SuffixTrie | None) -> tuple[np.ndarray, np.ndarray]:
        """arena_ahead over all of slots (int64 [n]): the drafts (int32, at
        offsets int64 [n + 1]) continued where they end within the round
        being verified (ahead_ks, ks: int64 [n]); (token_ids, offsets)."""
        out, out_offsets = np.empty(int(ks.sum()), dtype=np.int32), np.zeros(len(slots) + 1, dtype=np.int64)
        g = glob if glob is not None else _NO_TRIE
        arena_ahead(self._nodes.array, self._table.array, self.nbase, self.ncap, self.tshards, self.pool, self.seqs,
                    self.depths, self.factors, self.min_probs, self.active, self.n_active, slots,
                    np.ascontiguousarray(drafts, dtype=np.int32), offsets, ks, ahead_ks, g.nodes, g.table, g.shards,
                    g.pool, g.seqs, g.stamps, g.max_depth, g.clock, glob is not None, self.g_lists, self.g_n,
                    self.g_len, self.g_seen, out, out_offsets, _NO_STAMPS, *self._work(int(ks.max(initial=0))))
        return out[:out_offsets[-1]], out_offsets

    def _work(self, longest: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Work space of arena_branches and arena_ahead: lists, bests, scratch."""
        return (np.zeros((6, self.max_depth + 1), dtype=np.int32), np.zeros((2, 3)),
                np.zeros((2, max(longest, 1)), dtype=np.int32))

    def _trie(self, slot: int) -> np.ndarray:
        return self._nodes.array[self.nbase[slot]:self.nbase[slot] + self.ncap[slot]]

    def _grow(self, slot: int) -> None:
        """Moves the slot's trie to regions with room for depth + 2 more nodes
        (and their hash keys), as SuffixTrie.grow."""
        hdr, room = self.hdrs[slot], int(self.depths[slot]) + 2
        if hdr[H_USED] + room > self.ncap[slot]:
            used, old, size = int(hdr[H_USED]), int(self.nbase[slot]), int(self.ncap[slot])
            base = self._nodes.take(2 * size)
            nodes = self._nodes.array
            nodes[base:base + used] = nodes[old:old + used]
            self._nodes.give_back(old, size)
            self.nbase[slot], self.ncap[slot] = base, 2 * size
        if hdr[H_TIGHT]:
            shard = self.tshards[slot]
            old, size = int(shard[0, T_BASE]), int(shard[0, T_SIZE])
            base = self._table.take(2 * size)  # (may move the table: read .array after it)
            _resize_shard(self._table.array, shard, 0, base, 2 * size, room)
            self._table.give_back(old, size)
            hdr[H_TIGHT] = 0

    def _new_slot(self) -> int:
        slot = self._num_slots
        self._num_slots += 1
        if slot == len(self.depths):
            for name in ("hdrs", "nbase", "ncap", "tshards", "depths", "factors", "min_probs", "active",
                         "n_active", "g_lists", "g_n", "g_len", "g_seen", "seqs"):
                a = getattr(self, name)
                setattr(self, name, np.concatenate([a, np.zeros_like(a)]))
        return slot

    def _place(self, row: int, tokens: np.ndarray, time_base: int, cap: int) -> None:
        """Gives stream ``row`` a region of cap tokens at the pool's end and
        writes ``tokens`` there (not yet inserted)."""
        if self.pool_hdr[H_POOL_END] + cap > len(self.pool):
            self._compact(cap)
        at = int(self.pool_hdr[H_POOL_END])
        self.pool[at:at + len(tokens)] = tokens
        self.seqs[row] = (at, 0, time_base, cap)
        self.pool_hdr[H_POOL_END] = at + cap

    def _compact(self, extra: int) -> None:
        """Packs the live streams' regions (S_CAP tokens each) at the start of
        the pool in one pass (pack_streams, in place), then doubles the pool
        if they and ``extra`` more tokens fill more than half of it. On the
        message path: Python over every region into a new pool took 2.24 ms
        (median) at 256 live requests, 7.7 at 1024; this 0.74 and 1.75
        (bench_suffix_micro.py --arena-compact 32,256,1024 --baseline-src,
        AMD EPYC)."""
        live = np.flatnonzero(self.seqs[:, S_CAP] > 0)
        live = live[np.argsort(self.seqs[live, S_START])]
        _, at = pack_streams(self.pool, self.seqs, live, 0, 0, len(self.pool), S_CAP)
        if 2 * (at + extra) > len(self.pool):
            pool = np.zeros(2 * (at + extra), dtype=np.int32)
            pool[:at] = self.pool[:at]
            self.pool = pool
        self.pool_hdr[H_POOL_END] = at


class _GlobalCache:
    """Global trie over the outputs of finished requests, evicted FIFO (which
    keeps stamps exact, see ``remove_stream``).

    Outputs wait in a queue (``queue``) and enter the trie in steps
    (``work``): the occurrences of the oldest output that start in its
    next EVICT_CHUNK tokens leave (an eviction, in steps), the next
    INSERT_CHUNK tokens of the output being inserted enter (fewer when the
    trie must grow first), a step of the trie's growth
    (``SuffixTrie.grow_step``: before any other), or, when the next output
    does not fit in the pool, a step of its compaction (``compact_step``:
    until done, before any but growth; ``fifo`` is in pool order: outputs
    are written at the pool's end one at a time and compaction keeps their
    order). Between steps the trie is valid and drafts may read it: the
    oldest output being evicted is a stream of its tokens not yet evicted
    (a suffix of it: its evicted occurrences were the oldest, stamps stay
    exact), the output being inserted a stream of its tokens inserted so
    far (the newest, not evicted before it is whole), and ``fifo`` lists it
    once whole.
    """

    def __init__(self, max_requests: int, max_depth: int) -> None:
        self.max_requests = max_requests
        self.trie = SuffixTrie(max_depth, max_requests)
        self.fifo: deque[int] = deque()  # stream slots of whole outputs, oldest first
        self.free_slots = list(range(max_requests - 1, -1, -1))
        self.clock = 0  # tokens ever inserted or being inserted: the next stream's time base
        self.waiting: deque[np.ndarray] = deque()  # outputs queued, not yet being inserted, oldest first
        self.queued = 0  # outputs ever queued
        self.done = 0  # of those, the ones whole in the trie (in queue order)
        self.evicted = 0  # tokens of the oldest output (fifo[0]) whose occurrences have left the trie
        self._slot = -1  # stream slot of the output being inserted (-1: none)
        self._active = np.zeros(max_depth + 1, dtype=np.int32)  # that stream's active nodes
        self._n_active = np.zeros(1, dtype=np.int64)

    def add(self, output: np.ndarray) -> None:
        """Puts output (int32 [m]) into the trie now, after the ones queued."""
        self.queue(output)
        self.work(None)

    def queue(self, output: np.ndarray) -> None:
        self.waiting.append(output)
        self.queued += 1

    def work(self, deadline: float | None) -> bool:
        """Steps until every queued output is in the trie, or (deadline not
        None) until time.perf_counter() passes deadline; True while some are
        left. At least one step: a call overruns its deadline by at most one
        (each is bounded: see the class)."""
        while self.done < self.queued:
            self._step()
            if deadline is not None and time.perf_counter() >= deadline:
                break
        return self.done < self.queued

    def _evicts_next(self) -> bool:
        return self._slot < 0 and len(self.fifo) >= self.max_requests

    def _step(self) -> None:
        trie = self.trie
        if trie.needs_growth():  # first: no write may come while a shard doubles
            trie.grow_step()
            return
        if trie.compacting:  # nor while the pool is compacted
            trie.compact_step()
            return
        if self._evicts_next():
            self._evict_some()
            return
        if self._slot < 0:
            output = self.waiting[0]
            if trie.pool_end + len(output) > trie.pool_cap:  # the pool is full: compact it first (in steps)
                trie.start_compaction(np.fromiter(self.fifo, dtype=np.int64, count=len(self.fifo)), len(output))
                return
            self.waiting.popleft()
            self._slot = self.free_slots.pop()
            trie.open_stream(self._slot, self.clock, len(output))
            trie.write(self._slot, output)
            self._n_active[0] = 0
            self.clock += len(output)
        slot = self._slot
        length = trie.pool_end - int(trie.seqs[slot, S_START])
        trie.insert_some(slot, min(int(trie.seqs[slot, S_LEN]) + INSERT_CHUNK, length), self._active, self._n_active)
        if trie.seqs[slot, S_LEN] == length:
            self.fifo.append(slot)
            self._slot = -1
            self.done += 1

    def _evict_some(self) -> None:
        """The oldest output's occurrences starting in its next EVICT_CHUNK
        tokens leave the trie; once none is left, its slot is free."""
        slot = self.fifo[0]
        length = int(self.trie.seqs[slot, S_LEN])
        stop = min(self.evicted + EVICT_CHUNK, length)
        self.trie.remove(slot, self.evicted, stop)
        self.evicted = stop
        if stop == length:
            self.fifo.popleft()
            self.free_slots.append(slot)
            self.evicted = 0


class SuffixProposer(Proposer):
    """SuffixDecoding drafts from a per-request trie and a global trie.

    Scores: a draft token's probability is the product of count(child) /
    count(parent) along the path; a draft's score is the sum over its
    tokens. Best draft: highest score, then longer, then from the per-request
    trie, then the longer match. ``suffix_reference.ReferenceSuffixProposer``
    is the executable definition. Every call, one sequence or a round of
    many, runs the same arena kernels.
    """

    name = "suffix"

    def __init__(self, config: SuffixConfig = SuffixConfig()) -> None:
        self.config = config
        self._arena = RequestArena(config.max_tree_depth)
        self._slot: dict[str, int] = {}  # seq_id -> its arena slot
        self._prompt_len: dict[str, int] = {}
        self._global = (_GlobalCache(config.max_cached_requests, config.max_tree_depth)
                        if config.max_cached_requests > 0 else None)
        _warm_up()

    def start(self, seq_id, context, options):
        depth = min(options.max_tree_depth, self.config.max_tree_depth)
        if depth < 1:
            raise ValueError(f"max_tree_depth must be >= 1, got {options.max_tree_depth}")
        self.stop(seq_id, completed=False)
        context = np.ascontiguousarray(context, dtype=np.int32)
        self._slot[seq_id] = self._arena.open(context, depth, options)
        self._prompt_len[seq_id] = len(context)

    def extend(self, seq_id, token_ids):
        tokens = np.ascontiguousarray(token_ids, dtype=np.int32)
        zero = np.zeros(1, dtype=np.int64)
        self._round([seq_id], tokens, np.array([0, len(tokens)], dtype=np.int64), zero, zero)

    def advance(self, seq_ids, tokens, bounds, context_lens, ks):
        batch, _ = self.advance_scored(seq_ids, tokens, bounds, context_lens, ks)
        return batch

    def advance_scored(self, seq_ids: list[str], tokens: np.ndarray, bounds: np.ndarray, context_lens: np.ndarray,
                       ks: np.ndarray) -> tuple[DraftBatch, np.ndarray]:
        """``advance`` with the drafts' scores (float64 [n], as propose_scored)."""
        return self._round(seq_ids, tokens, bounds, context_lens, ks)

    def propose(self, requests):
        return [draft for draft, _ in self.propose_scored(requests)]

    def propose_scored(self, requests: list[tuple[str, int]]) -> list[tuple[Draft, float]]:
        """Drafts with their scores (the sum of the draft tokens'
        probabilities, an estimate of the number accepted)."""
        n = len(requests)
        ks = np.array([max(k, 0) for _, k in requests], dtype=np.int64)
        batch, scores = self._round([s for s, _ in requests], np.zeros(0, dtype=np.int32),
                                    np.zeros(n + 1, dtype=np.int64), np.zeros(n, dtype=np.int64), ks)
        off = batch.offsets.tolist()
        return [(Draft(batch.token_ids[off[i]:off[i + 1]].copy()), float(scores[i])) for i in range(n)]

    def _slots(self, seq_ids: list[str]) -> np.ndarray:
        try:
            return np.array([self._slot[s] for s in seq_ids], dtype=np.int64)
        except KeyError as e:
            raise UnknownSequence(e.args[0]) from None

    def _round(self, seq_ids: list[str], tokens: np.ndarray, bounds: np.ndarray, context_lens: np.ndarray,
               ks: np.ndarray) -> tuple[DraftBatch, np.ndarray]:
        slots = self._slots(seq_ids)
        glob = self._global
        return self._arena.round(slots, tokens, bounds, context_lens, ks,
                                 glob.trie if glob is not None and glob.fifo else None)

    def branches(self, seq_ids, drafts, offsets, ks, depths, width):
        """The drafts the method would make where the target's tokens leave
        each draft (RequestArena.branches: the tokens that follow the tries'
        matches there by count, then the context's most frequent)."""
        slots = self._slots(seq_ids)
        depths = np.minimum(depths, np.maximum(ks - 1, 0))
        glob = self._global
        return self._arena.branches(slots, drafts, offsets, depths, ks - depths - 1, width,
                                    glob.trie if glob is not None and glob.fifo else None)

    def ahead(self, seq_ids, drafts, offsets, ks, ahead_ks):
        """Each draft that ends within the round being verified, continued by
        the draft the method would make once it is appended
        (RequestArena.ahead: where the length cap of a short match ended it,
        the grown match drafts on)."""
        glob = self._global
        return self._arena.ahead(self._slots(seq_ids), drafts, offsets, ks, ahead_ks,
                                 glob.trie if glob is not None and glob.fifo else None)

    def stop(self, seq_id, completed):
        slot = self._slot.pop(seq_id, None)
        if slot is None:
            return
        prompt_len = self._prompt_len.pop(seq_id)
        output = self._arena.context(slot)[prompt_len:].copy()
        self._arena.close(slot)
        if completed and self._global is not None and len(output):
            if self.config.cache_between_messages:
                self._global.queue(output)
            else:
                self._global.add(output)

    def between_messages(self, budget_s=None):
        """Puts finished outputs into the global trie (evicting the oldest), in
        steps of at most INSERT_CHUNK tokens inserted or EVICT_CHUNK evicted,
        of COMPACT_CHUNK tokens moved in the pool's compaction, or of the
        trie's growth (see _GlobalCache)."""
        glob = self._global
        if glob is None:
            return False
        return glob.work(None if budget_s is None else time.perf_counter() + budget_s)

    def upkeep_progress(self):
        """Finished outputs queued for the global trie, and those in it."""
        glob = self._global
        return (0, 0) if glob is None else (glob.queued, glob.done)

    def context_len(self, seq_id):
        try:
            return len(self._arena.context(self._slot[seq_id]))
        except KeyError:
            raise UnknownSequence(seq_id) from None

    def stats(self):
        glob = self._global
        tries = [self._arena] if glob is None else [self._arena, glob.trie]
        cached = 0 if glob is None else len(glob.fifo)
        return {"live_sequences": float(len(self._slot)),
                "cached_requests": float(cached),
                "tree_nodes": float(sum(t.live_nodes() for t in tries)),
                "memory_bytes": float(sum(t.nbytes() for t in tries))}


def _warm_up() -> None:
    """Compiles (or loads from numba's cache) every kernel once."""
    trie = SuffixTrie(4, 2, reserve_bytes=0)
    active, n_active = np.zeros(5, dtype=np.int32), np.zeros(1, dtype=np.int64)
    for seq in (0, 1):
        trie.open_stream(seq, 0, 6)
        n_active[0] = 0
        trie.append(seq, np.array([1, 2, 1, 2, 3, 1], dtype=np.int32), active, n_active)
    trie.remove(0, 0, 6)
    trie.start_compaction(np.array([1], dtype=np.int64), 0)
    while trie.compact_step():
        pass
    trie.grow()
    arena = RequestArena(4)
    slot = arena.open(np.array([1, 2, 1, 2, 3], dtype=np.int32), 4, SeqOptions(max_tree_depth=4))
    one = np.ones(1, dtype=np.int64)
    batch, _ = arena.round(np.array([slot]), np.array([1], dtype=np.int32), np.array([0, 1]), one * 6, one * 2, trie)
    arena.branches(np.array([slot]), batch.token_ids, batch.offsets, one, one, 2, trie)
    arena.ahead(np.array([slot]), batch.token_ids, batch.offsets, one * 2, one, trie)
    arena.close(slot)


#: stands in for the global trie of a proposer without one (never searched)
_NO_TRIE = SuffixTrie(1, 1, reserve_bytes=0, num_shards=1)
#: the stamps of a trie that keeps none (RequestArena's)
_NO_STAMPS = np.zeros(0, dtype=np.int64)
_NO_TOKENS = np.zeros(0, dtype=np.int32)
