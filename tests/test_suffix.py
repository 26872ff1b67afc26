"""Suffix decoding: the numba proposer against the plain-Python reference,
hand-built cases for every rule, and the trie's structure after evictions."""
import numpy as np
import pytest

from specdec.proposer_svc import suffix
from specdec.proposer_svc.base import SeqOptions, UnknownSequence
from specdec.proposer_svc.suffix import SuffixConfig, SuffixProposer, SuffixTrie
from specdec.proposer_svc.suffix_reference import ReferenceSuffixProposer, build_tree


def _arr(tokens):
    return np.asarray(tokens, dtype=np.int32)


def _draft(prop, seq_id="s", k=8):
    return prop.propose([(seq_id, k)])[0].token_ids.tolist()


def _drafts_as_reference(prop, streams, probes, depth, opts, label) -> int:
    """Checks every probe's drafts (k = 2, 6) against the reference
    proposer holding ``streams`` as its cached outputs; returns the checks."""
    reference = ReferenceSuffixProposer(len(streams), depth)
    reference._cached.extend(streams)
    checked = 0
    for seq_id, context in probes.items():
        reference.start(seq_id, context, opts)
        for k in (2, 6):
            assert _draft(prop, seq_id, k) == _draft(reference, seq_id, k), (label, seq_id, k)
            checked += 1
    return checked


def _pair(max_cached_requests=4, max_tree_depth=64):
    return (SuffixProposer(SuffixConfig(max_cached_requests, max_tree_depth)),
            ReferenceSuffixProposer(max_cached_requests, max_tree_depth))


def _both(props, method, *args):
    return [getattr(p, method)(*args) for p in props]


# ------------------------------------------------------------ hand-built cases
def test_repeat_in_prompt_is_drafted():
    prop = SuffixProposer()
    prop.start("s", _arr([1, 2, 3, 4, 5, 9, 1, 2, 3]), SeqOptions())
    assert _draft(prop, k=2) == [4, 5]
    assert _draft(prop, k=8) == [4, 5, 9]  # match "1 2 3": at most 3 tokens (factor 1)


def test_no_match_gives_empty_draft():
    prop = SuffixProposer()
    prop.start("s", _arr([1, 2, 3, 4]), SeqOptions())
    assert _draft(prop) == []
    prop.start("e", _arr([]), SeqOptions())
    assert _draft(prop, "e") == []
    prop.extend("e", _arr([7, 7]))
    assert _draft(prop, "e") == [7]


def test_spec_factor_caps_draft_length():
    context = [5, 1, 2, 3, 4, 6, 7, 8, 5]  # tail "5" matches once (m=1)
    for factor, expected in ((1.0, [1]), (2.5, [1, 2, 3]), (0.5, [1])):
        prop = SuffixProposer()
        prop.start("s", _arr(context), SeqOptions(max_spec_factor=factor))
        assert _draft(prop, k=8) == expected, factor


def test_min_token_prob_cuts_the_path():
    # "1" (4x, tail included) -> 2 (3x): 3/4; "1 2" -> 4 (2 of 3): 1/2;
    # "1 2 4" -> 1: 1/2; "1 2 4 1" (2x) -> 2 (1x): 1/4
    context = [1, 2, 3, 1, 2, 4, 1, 2, 4, 1]
    for min_prob, expected in ((0.2, [2, 4, 1, 2]), (0.3, [2, 4, 1]), (0.6, [2]), (0.8, [])):
        prop = SuffixProposer()
        prop.start("s", _arr(context), SeqOptions(min_token_prob=min_prob, max_spec_factor=4))
        assert _draft(prop) == expected, min_prob


def test_depth_limit_bounds_matches_and_drafts():
    context = [1, 2, 3, 4, 5, 6, 0, 1, 2, 3]
    prop = SuffixProposer()
    prop.start("s", _arr(context), SeqOptions(max_tree_depth=3))
    assert _draft(prop) == [4]  # only "3" or "2 3" fit with a child in depth 3
    prop.start("s", _arr(context), SeqOptions(max_tree_depth=4))
    assert _draft(prop) == [4, 5]  # "2 3" -> 4 5 reaches depth 4
    prop.start("s", _arr(context), SeqOptions(max_tree_depth=64))
    assert _draft(prop) == [4, 5, 6]
    capped = SuffixProposer(SuffixConfig(max_tree_depth=4))
    capped.start("s", _arr(context), SeqOptions(max_tree_depth=64))
    assert _draft(capped) == [4, 5]


def test_equal_counts_prefer_the_most_recent_continuation():
    prop = SuffixProposer()
    prop.start("s", _arr([7, 1, 8, 7, 2, 8, 7]), SeqOptions(min_token_prob=0.0))
    assert _draft(prop, k=1) == [2]


def test_equal_scores_prefer_the_longer_match():
    # "2" -> 2 (2 of 4) and "2 2" -> 1 (1 of 2): both score 1/2, one token
    prop = SuffixProposer()
    prop.start("s", _arr([2, 2, 1, 0, 1, 2, 2]), SeqOptions())
    assert _draft(prop, k=1) == [1]


def test_reference_tokens_are_drafted_from():
    prop = SuffixProposer()
    opts = SeqOptions(reference_token_ids=_arr([10, 11, 12, 13, 14]))
    prop.start("s", _arr([1, 2, 10, 11]), opts)
    assert _draft(prop) == [12, 13]
    prop.extend("s", _arr([12, 13]))
    assert _draft(prop) == [14]  # the reference ends there


def test_global_tree_remembers_completed_outputs_only():
    prop = SuffixProposer(SuffixConfig(max_cached_requests=4))
    prop.start("a", _arr([1, 2]), SeqOptions())
    prop.extend("a", _arr([20, 21, 22, 23]))
    prop.stop("a", completed=False)
    prop.start("b", _arr([3, 20, 21]), SeqOptions())
    assert _draft(prop, "b") == []
    prop.start("a", _arr([1, 2]), SeqOptions())
    prop.extend("a", _arr([20, 21, 22, 23]))
    prop.stop("a", completed=True)
    assert _draft(prop, "b") == [22, 23]
    assert prop.stats()["cached_requests"] == 1
    # the prompt of a finished request is not remembered
    prop.start("c", _arr([9, 1]), SeqOptions())
    assert _draft(prop, "c") == []


def test_eviction_drops_the_oldest_output():
    prop = SuffixProposer(SuffixConfig(max_cached_requests=2))
    for i, out in enumerate(([30, 31, 32], [40, 41, 42], [50, 51, 52])):
        prop.start(f"r{i}", _arr([0]), SeqOptions())
        prop.extend(f"r{i}", _arr(out))
        prop.stop(f"r{i}", completed=True)
    assert prop.stats()["cached_requests"] == 2
    drafts = {}
    for first in (30, 40, 50):
        prop.start("q", _arr([1, first, first + 1]), SeqOptions())
        drafts[first] = _draft(prop, "q")
    assert drafts == {30: [], 40: [42], 50: [52]}


def test_global_tree_disabled():
    prop = SuffixProposer(SuffixConfig(max_cached_requests=0))
    prop.start("a", _arr([1]), SeqOptions())
    prop.extend("a", _arr([5, 6, 7]))
    prop.stop("a", completed=True)
    prop.start("b", _arr([5, 6]), SeqOptions())
    assert _draft(prop, "b") == [] and prop.stats()["cached_requests"] == 0


def _with_cached_output(output):
    prop = SuffixProposer(SuffixConfig(max_cached_requests=2))
    prop.start("old", _arr([0]), SeqOptions())
    prop.extend("old", _arr(output))
    prop.stop("old", completed=True)
    return prop


def test_higher_score_wins_between_trees():
    prop = _with_cached_output([5, 6, 8])
    # local "5 6" -> 9 with p 1/2 (its tail occurrence counts); global p 1
    prop.start("b", _arr([5, 6, 9, 5, 6]), SeqOptions())
    assert _draft(prop, "b", k=1) == [8]


def test_per_request_tree_wins_ties_with_global_tree():
    # global "5 6" -> 8 or 7 (the newer): p 1/2, as local "5 6" -> 9
    prop = _with_cached_output([5, 6, 8, 5, 6, 7])
    prop.start("b", _arr([5, 6, 9, 5, 6]), SeqOptions())
    assert _draft(prop, "b", k=1) == [9]


def test_longer_global_match_found_after_an_add():
    """A sequence's global matches are kept between rounds; an output added
    since that holds a longer suffix of its context is found (the longest
    listed match gained an occurrence), also without new tokens."""
    props = _pair(max_cached_requests=4)
    for prop in props:
        prop.start("a", _arr([0]), SeqOptions())
        prop.extend("a", _arr([8, 9, 20, 21]))
        prop.stop("a", completed=True)
        prop.start("q", _arr([1, 7, 8, 9]), SeqOptions())
    assert _draft(props[0], "q", k=3) == _draft(props[1], "q", k=3) == [20, 21]  # "8 9" once
    for prop in props:
        # "8 9" -> 30 twice, 20 and 10 once; "7 8 9" -> 10 11 8
        prop.start("b", _arr([0]), SeqOptions())
        prop.extend("b", _arr([7, 8, 9, 10, 11, 8, 9, 30, 31, 8, 9, 30, 31]))
        prop.stop("b", completed=True)
    assert _draft(props[0], "q", k=3) == _draft(props[1], "q", k=3) == [10, 11, 8]
    _both(props, "extend", "q", _arr([10]))
    assert _draft(props[0], "q", k=3) == _draft(props[1], "q", k=3) == [11, 8, 9]


def test_longer_global_match_added_since_is_found_when_new_tokens_extend_every_match():
    """The new token extends every listed match (the list runs out, it does
    not fail): a longer suffix that an output added since holds is still
    looked for, and wins ("6 7 8 9" drafts 60 61; "7 8 9" would draft 70)."""
    props = _pair(max_cached_requests=4)
    for prop in props:
        prop.start("a", _arr([0]), SeqOptions())
        prop.extend("a", _arr([7, 8, 50]))
        prop.stop("a", completed=True)
        prop.start("q", _arr([1, 6, 7, 8]), SeqOptions())
    assert _draft(props[0], "q", k=2) == _draft(props[1], "q", k=2) == [50]
    for prop in props:
        for seq_id, output in (("b", [6, 7, 8, 9, 60, 61]), ("c", [7, 8, 9, 70, 7, 8, 9, 70])):
            prop.start(seq_id, _arr([0]), SeqOptions())
            prop.extend(seq_id, _arr(output))
            prop.stop(seq_id, completed=True)
    _both(props, "extend", "q", _arr([9]))
    assert _draft(props[0], "q", k=2) == _draft(props[1], "q", k=2) == [60, 61]


def test_lifecycle_errors_and_stats():
    prop = SuffixProposer()
    prop.start("a", _arr([1, 2, 1]), SeqOptions())
    assert prop.context_len("a") == 3
    prop.extend("a", _arr([2]))
    assert prop.context_len("a") == 4
    stats = prop.stats()
    assert stats["live_sequences"] == 1 and stats["tree_nodes"] > 0
    assert stats["memory_bytes"] > 0
    assert _draft(prop, "a", k=0) == []
    with pytest.raises(ValueError, match="max_tree_depth"):
        prop.start("b", _arr([1]), SeqOptions(max_tree_depth=0))
    prop.stop("a", completed=False)
    prop.stop("a", completed=True)  # unknown: ignored
    for call in (lambda: prop.extend("a", _arr([1])), lambda: prop.propose([("a", 2)]),
                 lambda: prop.context_len("a")):
        with pytest.raises(UnknownSequence):
            call()


def test_memory_is_about_one_node_per_token_on_text_without_repeats():
    rng = np.random.default_rng(3)
    prop = SuffixProposer()
    prop.start("s", rng.permutation(5000).astype(np.int32), SeqOptions())
    # without leaf compression this would be ~64 nodes per token
    assert prop.stats()["tree_nodes"] == 5000 + 2  # one leaf per token + two roots


# ----------------------------------------------------- against the reference
def _random_session(seed, steps=60):
    """Random interleaved requests on a tiny vocabulary; every draft of the
    numba proposer must equal the reference's."""
    rng = np.random.default_rng(seed)
    vocab = int(rng.integers(2, 7))
    props = _pair(max_cached_requests=int(rng.integers(1, 4)),
                  max_tree_depth=int(rng.choice([3, 5, 8, 64])))
    live: list[str] = []
    checked = 0
    for step in range(steps):
        action = rng.random()
        if action < 0.2 or not live:
            seq_id = f"r{step}"
            reference = rng.integers(0, vocab, int(rng.integers(0, 12))) if rng.random() < 0.4 else []
            opts = SeqOptions(max_tree_depth=int(rng.choice([2, 4, 6, 64])),
                              max_spec_factor=float(rng.choice([0.3, 0.5, 1.0, 2.0])),
                              min_token_prob=float(rng.choice([0.0, 0.1, 0.3, 0.6])),
                              reference_token_ids=_arr(reference))
            _both(props, "start", seq_id, _arr(rng.integers(0, vocab, int(rng.integers(0, 25)))),
                  opts)
            live.append(seq_id)
        elif action < 0.3:
            seq_id = live.pop(int(rng.integers(len(live))))
            _both(props, "stop", seq_id, bool(rng.random() < 0.8))
        else:
            seq_id = live[int(rng.integers(len(live)))]
            _both(props, "extend", seq_id, _arr(rng.integers(0, vocab, int(rng.integers(1, 6)))))
        for seq_id in live:
            k = int(rng.integers(1, 10))
            got, want = _draft(props[0], seq_id, k), _draft(props[1], seq_id, k)
            assert got == want, (seed, step, seq_id)
            assert props[0].context_len(seq_id) == props[1].context_len(seq_id)
            checked += 1
    return props[0], checked


@pytest.mark.parametrize("seed", range(12))
def test_matches_reference_on_random_sessions(seed):
    _, checked = _random_session(seed)
    assert checked > 50


def test_matches_reference_with_real_overlap_lengths():
    """Longer streams with copies of earlier chunks, as in real text."""
    rng = np.random.default_rng(99)
    props = _pair(max_cached_requests=3)
    chunks = [rng.integers(0, 50, 12) for _ in range(6)]
    for r in range(6):
        stream = np.concatenate([chunks[i] for i in rng.integers(0, 6, 5)]).astype(np.int32)
        stream[rng.integers(0, len(stream), 4)] = rng.integers(0, 50, 4)
        _both(props, "start", "r", stream[:10], SeqOptions(max_spec_factor=2.0))
        for pos in range(10, len(stream), 3):
            for k in (3, 8):
                assert _draft(props[0], "r", k) == _draft(props[1], "r", k), (r, pos)
            _both(props, "extend", "r", stream[pos:pos + 3])
        _both(props, "stop", "r", True)


# --------------------------------------------------------- trie structure
def _count_in_trie(trie: SuffixTrie, tokens: list[int]) -> int:
    node, off = suffix._walk(trie.nodes, trie.table, trie.shards, trie.pool, trie.seqs,
                             _arr(tokens), trie.max_depth)
    if node < 0:
        return 0
    if trie.nodes[node, suffix.LSEQ] >= 0:
        return 1
    return int(trie.nodes[node, suffix.COUNT])


def _check_trie(trie: SuffixTrie, streams: list[list[int]]):
    """Every substring's count equals the reference trie's; no stray nodes."""
    root = build_tree([(s, 0) for s in streams], trie.max_depth)
    explicit = 0
    stack = [([], root)]
    while stack:
        prefix, node = stack.pop()
        for tok, child in node.children.items():
            path = prefix + [tok]
            assert _count_in_trie(trie, path) == child.count, path
            explicit += child.count >= 2
            stack.append((path, child))
    live = trie.live_nodes()
    assert int(trie.shards[:, suffix.T_KEYS].sum()) == live - 1  # every node but the root is keyed
    rows = [trie.table[base:base + size] for base, size in trie.shards[:, :2].tolist()]
    assert sum(int((r[:, 0] != -1).sum()) for r in rows) == live - 1
    # with FIFO eviction some count-1 nodes may stay explicit, never more nodes
    # than substrings; without eviction exactly explicit + leaves
    return explicit, live


def test_trie_counts_exact_after_inserts_and_fifo_evictions():
    rng = np.random.default_rng(5)
    depth = 6
    cache = suffix._GlobalCache(max_requests=3, max_depth=depth)
    kept: list[list[int]] = []
    for _ in range(12):
        out = rng.integers(0, 3, int(rng.integers(1, 30))).astype(np.int32)
        cache.add(out)
        kept = (kept + [out.tolist()])[-3:]
        _check_trie(cache.trie, kept)
        for slot, stream in zip(cache.fifo, kept):
            assert cache.trie.tokens(slot).tolist() == stream
    while cache.fifo:  # evicting everything frees every node
        cache._evict_some()
    assert cache.trie.live_nodes() == 1 and int(cache.trie.shards[:, suffix.T_KEYS].sum()) == 0


def _slot_streams(trie: SuffixTrie, slots: list[int]) -> list[tuple[list[int], int]]:
    """The streams in slots, as (tokens, time base)."""
    return [(trie.tokens(s).tolist(), int(trie.seqs[s, suffix.S_TIME])) for s in slots]


def _check_best_children(trie: SuffixTrie, streams: list[tuple[list[int], int]]):
    """Every explicit node but the root (see the module invariants) has the
    reference's best child over streams ((tokens, time base) each): the
    most frequent, ties to the most recent; read as a draft reads it
    (``_best``, settling a node marked by an eviction), on a copy of the rows
    so that the marks stay for the trie's next steps (of the rows in use: the
    whole reservation, up to 1 GiB, made one test take ~2 minutes)."""
    nodes = trie.nodes[:int(trie.hdr[suffix.H_USED])].copy()
    stack = [([], build_tree(streams, trie.max_depth))]
    checked = 0
    while stack:
        prefix, ref = stack.pop()
        for tok, child in ref.children.items():
            stack.append((prefix + [tok], child))
        if not prefix or not ref.children:
            continue
        node, _ = suffix._walk(trie.nodes, trie.table, trie.shards, trie.pool, trie.seqs, _arr(prefix), trie.max_depth)
        if trie.nodes[node, suffix.LSEQ] < 0:
            best_tok = max(ref.children.items(), key=lambda kv: (kv[1].count, kv[1].stamp))[0]
            assert nodes[suffix._best(nodes, trie.stamps, node), suffix.TOK] == best_tok, prefix
            # GAP (settled or kept unmarked) bounds how far the best child's count leads its siblings'
            counts = sorted((child.count for child in ref.children.values()), reverse=True)
            assert nodes[node, suffix.GAP] <= counts[0] - (counts[1] if len(counts) > 1 else 0), prefix
            checked += 1
    return checked


def test_best_children_exact_after_many_fifo_evictions():
    """Evictions subtract a stream token by token and mark the nodes whose
    best child lost occurrences; a read settles a mark (the child kept
    when still a majority, else picked among all): after each eviction,
    every best child read is the reference's, marks left from evictions
    before and inserts since included. Skewed small vocabularies and long
    repeats give both kinds of marks and of settling."""
    rng = np.random.default_rng(11)
    cache = suffix._GlobalCache(max_requests=4, max_depth=7)
    phrases = [rng.integers(0, 6, int(rng.integers(3, 12))) for _ in range(5)]
    checked, lost, stale = 0, 0, 0
    for _ in range(40):
        parts = [phrases[int(i)] if rng.random() < 0.6 else rng.integers(0, 3, 4) for i in rng.integers(0, 5, 6)]
        cache.add(np.concatenate(parts).astype(np.int32))
        slots = list(cache.fifo)
        best = cache.trie.nodes[:int(cache.trie.hdr[suffix.H_USED]), suffix.BEST]
        lost += int((best <= suffix._lost(0)).sum())
        stale += int((best == suffix._STALE).sum())
        _check_trie(cache.trie, [cache.trie.tokens(s).tolist() for s in slots])
        checked += _check_best_children(cache.trie, _slot_streams(cache.trie, slots))
    assert checked > 1000 and lost > 100 and stale > 10


def test_an_eviction_marks_a_best_child_only_once_its_lead_is_gone():
    """After "1" is followed by 2 three times and by 3 once, evicting one
    "1 2" leaves 2 ahead (2 against 1): still the best, no mark. Evicting
    another makes a tie, which only a read can settle (the newer, 3)."""
    trie = SuffixTrie(max_depth=4, num_streams=1, reserve_bytes=0, num_shards=1)
    active, n_active = np.zeros(5, dtype=np.int32), np.zeros(1, dtype=np.int64)
    trie.open_stream(0, 0, 8)
    trie.append(0, _arr([1, 2, 1, 2, 1, 2, 1, 3]), active, n_active)

    def node(tokens):
        return suffix._walk(trie.nodes, trie.table, trie.shards, trie.pool, trie.seqs, _arr(tokens), 4)[0]

    one = node([1])
    assert trie.nodes[one, suffix.BEST] == node([1, 2]) and trie.nodes[one, suffix.GAP] == 2
    trie.remove(0, 0, 2)  # the occurrences starting at positions 0 and 1
    assert trie.nodes[one, suffix.BEST] == node([1, 2]) and trie.nodes[one, suffix.GAP] == 1
    trie.remove(0, 2, 4)
    assert trie.nodes[one, suffix.BEST] < -1  # marked
    assert suffix._best(trie.nodes, trie.stamps, one) == node([1, 3])


def test_trie_growth_keeps_counts():
    """Past reservations of nothing (their floors), node rows, stamps, pool
    and hash shards move to larger ones while a stream is inserted."""
    rng = np.random.default_rng(6)
    trie = SuffixTrie(max_depth=5, num_streams=1, reserve_bytes=0, num_shards=2)
    rows, shard_rows = len(trie.nodes), trie.shard_rows
    active, n_active = np.zeros(6, dtype=np.int32), np.zeros(1, dtype=np.int64)
    trie.open_stream(0, 0, 0)
    stream: list[int] = []
    for _ in range(60):
        chunk = rng.integers(0, 6, int(rng.integers(1, 20))).astype(np.int32)
        trie.append(0, chunk, active, n_active)
        stream += chunk.tolist()
    assert len(trie.nodes) > rows and trie.shard_rows > shard_rows and trie.tokens(0).tolist() == stream
    explicit, live = _check_trie(trie, [stream])
    assert live <= 1 + explicit + len(stream)  # root + repeated substrings + leaves


def test_compaction_leaves_streams_before_the_first_gap_in_place(monkeypatch):
    """A compaction with nothing to reclaim moves no stream and grows the
    pool for the room asked; after a stream in the middle is removed, the
    stream before it stays, those after move down one a step (COMPACT_CHUNK
    = 4 tokens, each stream longer), the first onto a place overlapping its
    old one. After every step each stream reads back at its start and the
    counts are exact; the used part ends after the last."""
    monkeypatch.setattr(suffix, "COMPACT_CHUNK", 4)
    rng = np.random.default_rng(8)
    trie = SuffixTrie(max_depth=4, num_streams=4)
    active, n_active = np.zeros(5, dtype=np.int32), np.zeros(1, dtype=np.int64)
    streams = [rng.integers(0, 4, n).astype(np.int32) for n in (50, 40, 70, 30)]
    for seq, tokens in enumerate(streams):
        trie.open_stream(seq, 100 * seq, len(tokens))
        n_active[0] = 0
        trie.append(seq, tokens, active, n_active)

    def compacted(live: list[int], extra: int) -> int:
        steps = 0
        trie.start_compaction(np.array(live, dtype=np.int64), extra)
        while trie.compacting:
            trie.compact_step()
            steps += 1
            assert [trie.tokens(s).tolist() for s in live] == [streams[s].tolist() for s in live]
            _check_trie(trie, [streams[s].tolist() for s in live])
        return steps

    assert compacted([0, 1, 2, 3], 100) == 1 and trie.seqs[:, suffix.S_START].tolist() == [0, 50, 90, 160]
    assert trie.pool_end == 190 and trie.pool_cap == 512
    trie.remove(1, 0, 40)
    assert compacted([0, 2, 3], 300) == 2 and trie.seqs[[0, 2, 3], suffix.S_START].tolist() == [0, 50, 120]
    assert trie.pool_end == 150 and trie.pool_cap == 512


@pytest.mark.parametrize("reserve_bytes", [None, 1])
def test_global_trie_grows_and_drafts_as_the_reference(reserve_bytes, monkeypatch):
    """The global trie's hash shards (8 here) double in place one at a time
    as outputs are cached and evicted; with reservations of 1 byte its node
    rows, stamps, pool and hash rows also move to larger ones. Drafts from
    it stay the reference's after every output, and its counts exact."""
    monkeypatch.setattr(suffix, "TABLE_SHARDS", 8)
    if reserve_bytes:
        monkeypatch.setattr(suffix, "RESERVE_BYTES", reserve_bytes)
    rng = np.random.default_rng(17)
    props = _pair(max_cached_requests=5, max_tree_depth=12)
    trie = props[0]._global.trie
    first_size, rows, shard_rows = int(trie.shards[0, suffix.T_SIZE]), len(trie.nodes), trie.shard_rows
    phrases = [rng.integers(0, 40, int(rng.integers(3, 15))) for _ in range(12)]
    outputs = []
    for r in range(30):
        parts = [phrases[i] for i in rng.integers(0, 12, 8)] + [rng.integers(0, 40, 20)]
        outputs.append(np.concatenate(parts).astype(np.int32))
        _both(props, "start", f"w{r}", _arr([0]), SeqOptions())
        _both(props, "extend", f"w{r}", outputs[-1])
        _both(props, "stop", f"w{r}", True)
        for _ in range(4):  # probes: a slice of a recent output, perhaps changed
            out = outputs[-int(rng.integers(1, min(len(outputs), 7) + 1))]
            at = int(rng.integers(0, len(out) - 4))
            probe = out[at:at + int(rng.integers(2, 10))].copy()
            if rng.random() < 0.3:
                probe[int(rng.integers(len(probe)))] = rng.integers(0, 40)
            _both(props, "start", "q", probe, SeqOptions(max_spec_factor=2.0, min_token_prob=0.0))
            for k in (1, 4, 9):
                assert _draft(props[0], "q", k) == _draft(props[1], "q", k), (r, probe.tolist(), k)
    assert int(trie.shards[:, suffix.T_SIZE].min()) >= 4 * first_size  # every shard doubled, twice or more
    if reserve_bytes:
        assert len(trie.nodes) > rows and trie.shard_rows > shard_rows
    _check_trie(trie, [trie.tokens(s).tolist() for s in props[0]._global.fifo])
    _check_best_children(trie, _slot_streams(trie, list(props[0]._global.fifo)))


def _global_streams(glob) -> list[tuple[list[int], int]]:
    """The global trie's streams as (tokens, time base): whole outputs, the
    oldest without its tokens evicted so far, and the one being inserted."""
    slots = list(glob.fifo) + ([glob._slot] if glob._slot >= 0 else [])
    streams = _slot_streams(glob.trie, slots)
    if glob.evicted:
        tokens, time_base = streams[0]
        streams[0] = (tokens[glob.evicted:], time_base + glob.evicted)
    return streams


def _held_tokens(glob) -> int:
    return sum(len(tokens) for tokens, _ in _global_streams(glob))


@pytest.mark.parametrize("reserve_bytes", [None, 1])
def test_upkeep_in_steps_keeps_the_global_trie_exact_and_drafts_as_the_reference(reserve_bytes, monkeypatch):
    """A served replica's finished outputs wait for between_messages, which
    with a budget of 0 runs one step a call: a step of the trie's growth
    (REHASH_CHUNK = 4 rows of a doubling hash shard; small shards here, so
    they double many times), the occurrences starting in the next
    EVICT_CHUNK = 3 tokens of the oldest output leaving, or at most
    INSERT_CHUNK = 5 tokens of the output being inserted. After every step
    the global trie's counts and best children are exact over the outputs
    in it, the part not evicted so far of the oldest and the part inserted
    so far of the next, also with a shard half doubled; drafts,
    also of probes opened before (their global matches are kept between
    calls), are the reference's over those streams; at the end the newest
    outputs are all cached, in order. With reservations of 1 byte, the
    shards also move to larger slots (each time in a doubling's first step)."""
    monkeypatch.setattr(suffix, "INSERT_CHUNK", 5)
    monkeypatch.setattr(suffix, "REHASH_CHUNK", 4)
    monkeypatch.setattr(suffix, "EVICT_CHUNK", 3)
    if reserve_bytes:
        monkeypatch.setattr(suffix, "RESERVE_BYTES", reserve_bytes)
    rng = np.random.default_rng(21)
    depth = 8
    prop = SuffixProposer(SuffixConfig(max_cached_requests=3, max_tree_depth=depth, cache_between_messages=True))
    glob, trie = prop._global, prop._global.trie
    first_size, shard_rows = int(trie.shards[:, suffix.T_SIZE].max()), trie.shard_rows
    phrases = [rng.integers(0, 8, int(rng.integers(3, 9))) for _ in range(6)]
    outputs = [np.concatenate([phrases[i] for i in rng.integers(0, 6, 6)]).astype(np.int32) for _ in range(7)]
    for r, output in enumerate(outputs):
        prop.start(f"w{r}", _arr([0]), SeqOptions())
        prop.extend(f"w{r}", output)
        prop.stop(f"w{r}", completed=True)
    assert prop.upkeep_progress() == (7, 0) and prop.stats()["cached_requests"] == 0
    opts = SeqOptions(max_spec_factor=2.0, min_token_prob=0.0)
    probes = {f"q{i}": outputs[i][3:3 + int(rng.integers(2, 6))] for i in range(1, 7)}
    for seq_id, context in probes.items():
        prop.start(seq_id, context, opts)
    kinds = {"grow": 0, "evict": 0, "insert": 0}
    checked, half_doubled, half_evicted = 0, 0, 0
    left = True
    while left:
        kind = "grow" if trie.needs_growth() else "evict" if glob._evicts_next() else "insert"
        cached, held = len(glob.fifo), _held_tokens(glob)
        left = prop.between_messages(budget_s=0.0)
        kinds[kind] += 1
        if kind == "grow":  # one step a call
            assert (len(glob.fifo), _held_tokens(glob)) == (cached, held)
        elif kind == "evict":
            assert 1 <= held - _held_tokens(glob) <= 3 and len(glob.fifo) >= cached - 1
        else:
            assert 1 <= _held_tokens(glob) - held <= 5
        streams = _global_streams(glob)
        _check_trie(trie, [tokens for tokens, _ in streams])
        _check_best_children(trie, streams)
        assert trie.clock == max(time_base + len(tokens) for tokens, time_base in streams)
        if not glob.fifo:  # (the global trie is searched once an output is whole in it)
            continue
        half_doubled += trie.needs_growth()
        half_evicted += glob.evicted > 0
        checked += _drafts_as_reference(prop, streams, probes, depth, opts, kinds)
    assert kinds["evict"] >= sum(-(-len(o) // 3) for o in outputs[:4]) and half_evicted
    assert kinds["insert"] >= sum(-(-len(o) // 5) for o in outputs)
    assert int(trie.shards[:, suffix.T_SIZE].min()) > first_size and half_doubled and checked > 100
    assert (trie.shard_rows > shard_rows) == bool(reserve_bytes)
    assert prop.upkeep_progress() == (7, 7) and not prop.between_messages()
    assert [trie.tokens(s).tolist() for s in glob.fifo] == [o.tolist() for o in outputs[-3:]]


def test_pool_compaction_in_steps_keeps_every_output_readable_and_drafts_as_the_reference(monkeypatch):
    """When the next output does not fit in the global trie's pool (256
    tokens at first), the cached outputs move down to its start in steps
    (one a between_messages call with a budget of 0) of at most
    COMPACT_CHUNK = 16 tokens or one longer output alone, each output whole,
    some onto places overlapping their old ones, some steps moving several;
    the last step leaves room for the next output (the pool grows once
    here). After every step each cached output reads back whole at its
    start, counts and best children are exact, drafts (also of probes
    opened before) are the reference's, and no output is being inserted
    while a compaction is under way."""
    monkeypatch.setattr(suffix, "COMPACT_CHUNK", 16)
    rng = np.random.default_rng(26)
    depth = 6
    prop = SuffixProposer(SuffixConfig(max_cached_requests=6, max_tree_depth=depth, cache_between_messages=True))
    glob, trie = prop._global, prop._global.trie
    phrases = [rng.integers(0, 6, int(rng.integers(2, 7))) for _ in range(5)]
    outputs = [np.concatenate([phrases[i] for i in rng.integers(0, 5, int(rng.choice([1, 1, 2, 10, 14])))])
               .astype(np.int32) for _ in range(24)]
    for r, output in enumerate(outputs):
        prop.start(f"w{r}", _arr([0]), SeqOptions())
        prop.extend(f"w{r}", output)
        prop.stop(f"w{r}", completed=True)
    opts = SeqOptions(max_spec_factor=2.0, min_token_prob=0.0)
    probes = {f"q{i}": outputs[i][1:1 + int(rng.integers(2, 6))] for i in range(4, 24, 3)}
    for seq_id, context in probes.items():
        prop.start(seq_id, context, opts)
    compactions, steps, overlapping, several, checked = 0, 0, 0, 0, 0
    left = True
    while left:
        compacting, starts = trie.compacting, trie.seqs[:, suffix.S_START].copy()
        left = prop.between_messages(budget_s=0.0)
        if compacting:  # a step of it
            steps += 1
            moved = [s for s in glob.fifo if trie.seqs[s, suffix.S_START] != starts[s]]
            sizes = [int(trie.seqs[s, suffix.S_LEN]) for s in moved]
            assert sum(sizes) <= 16 or len(moved) == 1, sizes
            overlapping += sum(int(starts[s] - trie.seqs[s, suffix.S_START]) < n for s, n in zip(moved, sizes))
            several += len(moved) > 1
        else:
            compactions += trie.compacting  # (a step that starts one moves nothing)
        assert not trie.compacting or glob._slot < 0
        cached = outputs[glob.done - len(glob.fifo):glob.done]
        assert [trie.tokens(s).tolist() for s in glob.fifo] == [o.tolist() for o in cached]
        streams = _global_streams(glob)
        _check_trie(trie, [tokens for tokens, _ in streams])
        _check_best_children(trie, streams)
        if not glob.fifo:
            continue
        checked += _drafts_as_reference(prop, streams, probes, depth, opts, steps)
    assert compactions >= 3 and steps >= 2 * compactions and overlapping and several and checked > 100
    assert trie.pool_cap == 512 and prop.upkeep_progress() == (24, 24)
    assert [trie.tokens(s).tolist() for s in glob.fifo] == [o.tolist() for o in outputs[-6:]]


def test_an_upkeep_call_with_time_left_does_it_all():
    """Every step is bounded (evictions too, in EVICT_CHUNK pieces): a call
    with a budget far from spent evicts and inserts until no output waits."""
    prop = SuffixProposer(SuffixConfig(max_cached_requests=2, max_tree_depth=8, cache_between_messages=True))
    outputs = [_arr(np.arange(100 * i, 100 * i + 150) % 97) for i in range(4)]
    for r, output in enumerate(outputs):
        prop.start(f"w{r}", _arr([0]), SeqOptions())
        prop.extend(f"w{r}", output)
        prop.stop(f"w{r}", completed=True)
    assert not prop.between_messages(budget_s=60.0) and prop.upkeep_progress() == (4, 4)
    glob = prop._global
    assert [glob.trie.tokens(s).tolist() for s in glob.fifo] == [o.tolist() for o in outputs[2:]]


# ------------------------------------------------------ rounds of many requests
@pytest.mark.parametrize("seed", range(4))
def test_rounds_draft_as_one_sequence_at_a_time(seed, monkeypatch):
    """advance_scored over many live requests at once (one arena, one kernel
    call a round, regions growing and the pool compacting mid-round) drafts
    what the reference does driven one call at a time, with the scores
    propose_scored gives for each request on its own."""
    compactions = []
    compact = suffix.RequestArena._compact
    monkeypatch.setattr(suffix.RequestArena, "_compact", lambda arena, extra: (compactions.append(extra),
                                                                                compact(arena, extra)))
    _check_rounds(seed)
    assert compactions


def test_the_arena_packs_its_live_regions_in_place():
    """RequestArena._compact moves every live stream's region (with its room
    to grow) down over the closed ones' in pool order: contexts unchanged,
    regions back to back from 0, the pool kept while half of it is free and
    doubled when the regions and the room asked for fill more than half."""
    rng = np.random.default_rng(3)
    arena = suffix.RequestArena(8)
    slots = [arena.open(_arr(rng.integers(0, 20, int(rng.integers(1, 300)))), 8,
                        SeqOptions(reference_token_ids=_arr(rng.integers(0, 20, int(rng.integers(0, 50))))))
             for _ in range(12)]
    for slot in slots[::3]:
        arena.close(slot)
    live = [s for i, s in enumerate(slots) if i % 3]
    contexts = {s: arena.context(s).tolist() for s in live}
    rows = [r for r in range(len(arena.seqs)) if arena.seqs[r, suffix.S_CAP] > 0]
    caps = {r: int(arena.seqs[r, suffix.S_CAP]) for r in rows}
    order = sorted(rows, key=lambda r: arena.seqs[r, suffix.S_START])
    size = len(arena.pool)
    assert arena.pool_hdr[suffix.H_POOL_END] > sum(caps.values()) and 2 * sum(caps.values()) <= size
    arena._compact(0)
    starts = np.cumsum([0] + [caps[r] for r in order])
    assert [int(arena.seqs[r, suffix.S_START]) for r in order] == starts[:-1].tolist()
    assert arena.pool_hdr[suffix.H_POOL_END] == starts[-1] and len(arena.pool) == size
    assert {s: arena.context(s).tolist() for s in live} == contexts
    arena._compact(size)
    assert len(arena.pool) == 2 * (starts[-1] + size) and arena.pool_hdr[suffix.H_POOL_END] == starts[-1]
    assert {s: arena.context(s).tolist() for s in live} == contexts


@pytest.mark.parametrize("seed", range(2))
def test_rounds_draft_the_same_when_the_arena_outgrows_its_reservation(seed, monkeypatch):
    """As above with a reservation of 1024 rows (see _Regions): the arena's
    region arrays move to larger reservations mid-round, every request's
    trie with them, and drafts stay the reference's round after round."""
    monkeypatch.setattr(suffix, "RESERVE_BYTES", 1)
    batched = _check_rounds(seed)
    assert len(batched._arena._nodes.array) >= 4 * 1024 and len(batched._arena._table.array) >= 4 * 1024


def _check_rounds(seed: int) -> SuffixProposer:
    rng = np.random.default_rng(seed)
    vocab, depth = int(rng.integers(3, 12)), int(rng.choice([4, 64]))
    batched = SuffixProposer(SuffixConfig(max_cached_requests=3, max_tree_depth=depth))
    single = SuffixProposer(SuffixConfig(max_cached_requests=3, max_tree_depth=depth))
    reference = ReferenceSuffixProposer(3, depth)
    live: list[str] = []
    for step in range(25):
        if step == 0 or rng.random() < 0.3:
            for j in range(int(rng.integers(1, 8))):
                seq_id = f"r{step}-{j}"
                opts = SeqOptions(max_spec_factor=float(rng.choice([0.5, 1.0, 2.0])), min_token_prob=0.1,
                                  reference_token_ids=_arr(rng.integers(0, vocab, int(rng.integers(0, 30)))))
                _both((batched, single, reference), "start", seq_id,
                      _arr(rng.integers(0, vocab, int(rng.integers(1, 60)))), opts)
                live.append(seq_id)
        if rng.random() < 0.2:
            seq_id = live.pop(int(rng.integers(len(live))))
            _both((batched, single, reference), "stop", seq_id, bool(rng.random() < 0.8))
        chunks = [_arr(rng.integers(0, vocab, int(rng.integers(0, 9)))) for _ in live]
        ks = np.array(rng.integers(0, 9, len(live)), dtype=np.int64)
        bounds = np.cumsum([0] + [len(c) for c in chunks]).astype(np.int64)
        lens = np.array([single.context_len(s) + len(c) for s, c in zip(live, chunks)], dtype=np.int64)
        batch, scores = batched.advance_scored(live, np.concatenate([_arr([]), *chunks]), bounds, lens, ks)
        assert batch.in_sync.all()
        for i, (seq_id, chunk) in enumerate(zip(live, chunks)):
            _both((single, reference), "extend", seq_id, chunk)
            k = int(ks[i])
            got = batch.token_ids[batch.offsets[i]:batch.offsets[i + 1]].tolist()
            if k:
                assert got == _draft(reference, seq_id, k), (seed, step, seq_id)
                draft, score = single.propose_scored([(seq_id, k)])[0]
                assert got == draft.token_ids.tolist() and scores[i] == score
            else:
                assert got == []
    gauges = ("live_sequences", "cached_requests", "tree_nodes")
    assert [batched.stats()[g] for g in gauges] == [single.stats()[g] for g in gauges]
    for seq_id in live:
        _both((batched, single), "stop", seq_id, False)
    assert batched.stats()["live_sequences"] == 0 and batched.stats()["tree_nodes"] == single.stats()["tree_nodes"]
    return batched


def test_released_trees_are_freed():
    """Stopping a request frees its nodes: the live count drops and later
    requests reuse the rows instead of growing the arrays."""
    prop = SuffixProposer(SuffixConfig(max_cached_requests=0))
    rng = np.random.default_rng(8)
    prop.start("a", _arr(rng.integers(0, 50, 3000)), SeqOptions())
    prop.start("b", _arr(rng.integers(0, 50, 10)), SeqOptions())
    grown = prop.stats()
    assert grown["tree_nodes"] > 3000
    prop.stop("a", completed=False)
    assert prop.stats()["tree_nodes"] < 60
    prop.start("c", _arr(rng.integers(0, 50, 3000)), SeqOptions())
    assert prop.stats()["memory_bytes"] < 1.1 * grown["memory_bytes"]  # a's node rows reused
    prop.stop("b", completed=False)
    prop.stop("c", completed=True)
    assert prop.stats()["tree_nodes"] == 0 and prop.stats()["live_sequences"] == 0
