"""The paged KV pool: block bookkeeping, exhaustion without side effects,
rollback, release/reuse, and attention over the pages (vs a plain softmax
reference, and row invariance)."""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import psutil
import pytest
import torch

from specdec.engine import kv_pool
from specdec.engine.base import PoolExhausted
from specdec.engine.kv_pool import PACK, PARALLEL_MIN_WORK, KVPool, attention_units

LAYERS, KV_HEADS, HEAD_DIM, BS = 2, 2, 8, 16


def make_pool(capacity_tokens: int = 64, num_threads: int = 1, head_dim: int = HEAD_DIM,
              kv_dtype: torch.dtype = torch.float32) -> KVPool:
    return KVPool(LAYERS, KV_HEADS, head_dim, capacity_tokens, block_size=BS, num_threads=num_threads,
                  kv_dtype=kv_dtype)


def snapshot(pool: KVPool) -> tuple:
    return (pool.free_tokens(), pool.num_sequences(), dict(pool._lengths),
            {s: list(t) for s, t in pool._tables.items()})


# ---- bookkeeping --------------------------------------------------------------


def test_ensure_capacity_reserves_whole_blocks():
    pool = make_pool(256)
    assert pool.free_tokens() == 256
    pool.ensure_capacity("a", 17)  # 2 blocks of 16
    assert pool.cached_len("a") == 0 and pool.reserved_len("a") == 32
    assert pool.free_tokens() == 224
    pool.ensure_capacity("a", 32)  # already covered
    assert pool.free_tokens() == 224
    pool.ensure_capacity("a", 33)
    assert pool.reserved_len("a") == 48 and pool.free_tokens() == 208
    assert pool.cached_len("unknown") == 0 and pool.reserved_len("unknown") == 0


def test_cpu_block_size_is_a_multiple_of_the_attention_vector():
    with pytest.raises(ValueError, match="block_size 8"):
        KVPool(LAYERS, KV_HEADS, HEAD_DIM, 64, block_size=8)
    assert KVPool(LAYERS, KV_HEADS, HEAD_DIM, 64, block_size=32).num_blocks == 2


def test_exhaustion_raises_and_changes_nothing():
    pool = make_pool(64)  # 4 blocks
    pool.ensure_capacity("a", 32)
    pool.ensure_capacity("b", 16)
    before = snapshot(pool)
    with pytest.raises(PoolExhausted):
        pool.ensure_capacity("new", 17)  # needs 2 blocks, 1 free
    with pytest.raises(PoolExhausted):
        pool.ensure_capacity("a", 80)  # growing a live sequence past the pool
    assert snapshot(pool) == before
    assert pool.reserved_len("new") == 0 and pool.num_sequences() == 2
    pool.ensure_capacity("new", 16)  # what does fit still works
    assert pool.free_tokens() == 0


def test_release_frees_capacity_for_reuse():
    pool = make_pool(64)
    pool.ensure_capacity("a", 64)
    with pytest.raises(PoolExhausted):
        pool.ensure_capacity("b", 1)
    assert pool.release("a") is True
    assert pool.release("a") is False
    assert pool.free_tokens() == 64 and pool.cached_len("a") == 0
    pool.ensure_capacity("b", 64)
    assert pool.reserved_len("b") == 64


def test_truncate_frees_blocks_past_the_kept_length():
    pool = make_pool(256)
    pool.ensure_capacity("a", 44)
    pool.plan(["a"], [44])
    pool.commit(["a"], [44])
    assert pool.cached_len("a") == 44
    pool.truncate("a", 20)  # keeps 2 blocks
    assert pool.cached_len("a") == 20 and pool.reserved_len("a") == 32
    assert pool.free_tokens() == 224
    pool.truncate("a", 20)  # no-op
    with pytest.raises(ValueError):
        pool.truncate("a", 21)  # cannot grow by truncation
    with pytest.raises(KeyError):
        pool.truncate("zzz", 0)
    pool.truncate("a", 0)
    assert pool.cached_len("a") == 0 and pool.free_tokens() == 256 and pool.num_sequences() == 1


def test_plan_places_ragged_rows_after_each_prefix():
    pool = make_pool(256)
    for seq, n in (("a", 15), ("b", 33)):
        pool.ensure_capacity(seq, n)
        pool.plan([seq], [n])
        pool.commit([seq], [n])
    pool.ensure_capacity("a", 17)
    pool.ensure_capacity("b", 34)
    batch = pool.plan(["a", "b"], [2, 1])
    assert batch.row_seq.tolist() == [0, 0, 1]
    assert batch.row_pos.tolist() == [15, 16, 33]
    ta, tb = pool._tables["a"], pool._tables["b"]
    assert batch.slot_block.tolist() == [ta[0], ta[1], tb[2]]
    assert batch.slot_offset.tolist() == [15, 0, 1]
    assert batch.block_tables[0, :2].tolist() == ta and batch.block_tables[1, :3].tolist() == tb
    assert pool.cached_len("a") == 15  # plan changes nothing
    with pytest.raises(ValueError, match="capacity"):
        pool.plan(["a"], [18])  # 15 + 18 > 32 reserved


def test_memory_fraction_sizing(monkeypatch):
    per_token = KVPool.bytes_per_token(30, 3, 64)
    assert per_token == 2 * 30 * 3 * 64 * 4
    assert KVPool.bytes_per_token(30, 3, 64, torch.bfloat16) == per_token // 2
    available = psutil.virtual_memory().available
    assert KVPool.tokens_for_memory_fraction(0.01, per_token) > 0  # the real reading
    # the arithmetic on a pinned reading (other processes move the real one)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=available))
    small = KVPool.tokens_for_memory_fraction(0.01, per_token)
    assert small == int(0.01 * available) // per_token
    assert KVPool.tokens_for_memory_fraction(0.02, per_token) == int(0.02 * available) // per_token
    with pytest.raises(ValueError):
        KVPool.tokens_for_memory_fraction(1.5, per_token)


# ---- attention --------------------------------------------------------------


@dataclass
class Sequence:
    """Random per-position keys, values and (pre-scaled) queries of one sequence."""

    keys: torch.Tensor  # [layers, n, kv_heads, head_dim]
    values: torch.Tensor  # [layers, n, kv_heads, head_dim]
    queries: torch.Tensor  # [n, heads, head_dim]


def random_sequences(lengths: dict[str, int], heads: int, head_dim: int = HEAD_DIM, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return {s: Sequence(torch.randn(LAYERS, n, KV_HEADS, head_dim, generator=g),
                        torch.randn(LAYERS, n, KV_HEADS, head_dim, generator=g),
                        torch.randn(n, heads, head_dim, generator=g) * head_dim ** -0.5)
            for s, n in lengths.items()}


def feed(pool: KVPool, seqs: dict[str, Sequence], rows: dict[str, tuple[int, int]]):
    """One pass like the engine's: each sequence is rolled back (or first
    filled) to `start`, then positions [start, end) are written as new rows.
    Returns the PagedBatch and the new rows' queries [T, heads, head_dim]."""
    for s, (start, _) in rows.items():
        if pool.cached_len(s) > start:
            pool.truncate(s, start)
        elif pool.cached_len(s) < start:
            feed(pool, seqs, {s: (pool.cached_len(s), start)})
    names = list(rows)
    counts = [rows[s][1] - rows[s][0] for s in names]
    for s in names:
        pool.ensure_capacity(s, rows[s][1])
    batch = pool.plan(names, counts)
    for layer in range(LAYERS):
        pool.write(layer, torch.cat([seqs[s].keys[layer, slice(*rows[s])] for s in names]),
                   torch.cat([seqs[s].values[layer, slice(*rows[s])] for s in names]), batch)
    pool.commit(names, counts)
    return batch, torch.cat([seqs[s].queries[slice(*rows[s])] for s in names]).contiguous()


def reference_attention(seq: Sequence, layer: int, q: torch.Tensor, pos: int, window: int) -> torch.Tensor:
    """Plain float64 softmax attention of one row; q: [heads, head_dim] -> [heads, head_dim]."""
    group = q.shape[0] // KV_HEADS
    keys = seq.keys[layer, :pos + 1].transpose(0, 1).repeat_interleave(group, 0).double()  # [heads, pos+1, D]
    values = seq.values[layer, :pos + 1].transpose(0, 1).repeat_interleave(group, 0).double()
    scores = torch.einsum("hd,htd->ht", q.double(), keys)
    if window:
        scores[:, :max(0, pos + 1 - window)] = float("-inf")
    return torch.einsum("ht,htd->hd", scores.softmax(-1), values).float()


@pytest.mark.parametrize("window", [0, 5, 20])
@pytest.mark.parametrize("sdpa", [False, True], ids=["paged", "sdpa"])
@pytest.mark.parametrize("head_dim", [8, 48, 64])  # values as scalars / vectors: two chunks and one / two chunks
def test_attention_matches_softmax_reference(window, sdpa, head_dim):
    heads = 6  # 3 query heads per kv head
    pool = make_pool(256, head_dim=head_dim)
    seqs = random_sequences({"a": 1, "b": 13, "c": 8, "d": 45}, heads, head_dim=head_dim)
    # a lone first token, a verify chunk, a prefill, and rows whose keys span three blocks (a window
    # of 20 starts inside the first or the second)
    rows = {"a": (0, 1), "b": (7, 13), "c": (0, 8), "d": (28, 45)}
    batch, q = feed(pool, seqs, rows)
    names = list(rows)
    for layer in range(LAYERS):
        out = (pool.attend_sdpa if sdpa else pool.attend)(layer, q, batch, window)
        for row, (b, pos) in enumerate(zip(batch.row_seq, batch.row_pos)):
            want = reference_attention(seqs[names[b]], layer, q[row], int(pos), window)
            torch.testing.assert_close(out[row], want, atol=1e-5, rtol=1e-5)


def test_attention_row_is_bitwise_independent_of_the_batch():
    heads = 4
    pool = make_pool(256, head_dim=64)
    seqs = random_sequences({"a": 40, "b": 23, "c": 57}, heads, head_dim=64)
    alone = {}
    for s in seqs:
        n = seqs[s].queries.shape[0]
        batch, q = feed(pool, seqs, {s: (n - 1, n)})
        alone[s] = pool.attend(1, q, batch)[0]
    batch, q = feed(pool, seqs, {"b": (6, 23), "a": (39, 40), "c": (27, 57)})
    out = pool.attend(1, q, batch)
    assert torch.equal(out[16], alone["b"])  # last row of a 17-row verify chunk
    assert torch.equal(out[17], alone["a"])  # a decode row next to it
    assert torch.equal(out[-1], alone["c"])  # last row of a prefill chunk


def test_attention_units_pack_a_sequences_queries_per_kv_head():
    """A sequence's rows x query heads of one kv head go PACK at a time (the
    last unit of a run holds the rest): a decode row's query heads are one
    unit, so its keys and values are read once for all of them."""
    row_seq = np.array([0, 1, 1, 1, 1, 1, 1, 2], np.int32)  # a decode row, a 6-row chunk, a decode row
    units = attention_units(row_seq, 3, 2).tolist()  # 3 query heads per kv head, 2 kv heads
    chunk = [[1, g, q, min(PACK, 18 - q)] for g in range(2) for q in range(0, 18, PACK)]
    assert units == [[0, g, 0, 3] for g in range(2)] + chunk + [[7, g, 0, 3] for g in range(2)]
    assert attention_units(np.zeros(2, np.int32), 2, 1).tolist() == [[0, 0, 0, PACK]]


@pytest.mark.parametrize("window", [0, 5, 20, 70])
@pytest.mark.parametrize("head_dim", [6, 48, 64, 80])  # scalar values / three one-vector passes / one group of
# four vectors / a group and one vector more
def test_packed_queries_give_every_row_the_bits_it_gets_alone(window, head_dim):
    """Rows of a 7-row chunk after 143 cached keys (21 queries per kv head:
    five packs, the last partial; values over three tiles of VALUE_TILE
    keys), with and without a window (one that starts inside a tile), equal
    bitwise the same rows computed as decode rows one at a time, and the
    chunk computed one query per unit."""
    heads = 6
    pool = make_pool(256, head_dim=head_dim)
    seqs = random_sequences({"a": 150}, heads, head_dim=head_dim, seed=5)
    batch, q = feed(pool, seqs, {"a": (143, 150)})
    assert max(u[3] for u in batch.units(heads // KV_HEADS, KV_HEADS)) == PACK  # the packed kernel runs
    together = pool.attend(1, q, batch, window)
    singles = np.array([[0, g, i, 1] for g in range(KV_HEADS) for i in range(7 * heads // KV_HEADS)], np.int32)
    apart = np.empty_like(q.numpy())
    kv_pool._paged_attention(q.numpy(), *pool.layer_arrays(1), batch.block_tables, batch.row_seq, batch.row_pos,
                             window, singles, apart)
    assert torch.equal(torch.from_numpy(apart), together)
    for r in range(7):
        one, q1 = feed(pool, seqs, {"a": (143 + r, 144 + r)})
        assert torch.equal(pool.attend(1, q1, one, window)[0], together[r]), f"row {r}"


CHUNK = kv_pool.KEY_CHUNK


@pytest.mark.parametrize("window", [0, 20, CHUNK + 44, 3 * CHUNK])  # none / in one chunk / from an earlier one / all
@pytest.mark.parametrize("head_dim", [6, 64])  # scalar values / one group of four vectors
@pytest.mark.parametrize("rows", [(CHUNK - 3, CHUNK + 4), (2 * CHUNK + 78, 2 * CHUNK + 85)])  # across a cut / past two
def test_queries_across_key_chunks_get_their_bits_alone_and_the_softmax(rows, head_dim, window):
    """Past KEY_CHUNK keys a query's attention is merged from pieces cut at
    absolute positions: a 7-row chunk's rows (some of them within one chunk,
    some across a cut) equal bitwise the rows computed one query per unit,
    as decode rows one at a time and on two threads, and stay within float32
    rounding of the float64 softmax."""
    heads = 6
    pool = make_pool(3 * CHUNK, head_dim=head_dim)
    threaded = make_pool(3 * CHUNK, num_threads=2, head_dim=head_dim)
    seqs = random_sequences({"a": 2 * CHUNK + 100}, heads, head_dim=head_dim, seed=9)
    batch, q = feed(pool, seqs, {"a": rows})
    b2, _ = feed(threaded, seqs, {"a": rows})
    together = pool.attend(1, q, batch, window)
    assert b2.attention_work * heads >= PARALLEL_MIN_WORK  # the threaded path really runs
    assert torch.equal(threaded.attend(1, q, b2, window), together)
    n = rows[1] - rows[0]
    singles = np.array([[0, g, i, 1] for g in range(KV_HEADS) for i in range(n * heads // KV_HEADS)], np.int32)
    apart = np.empty_like(q.numpy())
    kv_pool._paged_attention(q.numpy(), *pool.layer_arrays(1), batch.block_tables, batch.row_seq, batch.row_pos,
                             window, singles, apart)
    assert torch.equal(torch.from_numpy(apart), together)
    for r in range(n):
        pos = rows[0] + r
        one, q1 = feed(pool, seqs, {"a": (pos, pos + 1)})
        assert torch.equal(pool.attend(1, q1, one, window)[0], together[r]), f"row {r}"
        want = reference_attention(seqs["a"], 1, q[r], pos, window)
        torch.testing.assert_close(together[r], want, atol=1e-5, rtol=1e-5)


def test_key_pieces_are_cut_at_absolute_positions_and_shared_in_runs_of_equal_work():
    """A decode row's units (one per kv head) after 2 KEY_CHUNK + 276 keys
    are cut at the multiples of KEY_CHUNK, in key order (with a window, from
    the block of its first key); two or three threads get runs of pieces
    whose work differs by less than one piece's."""
    chunk = CHUNK
    n = 2 * chunk + 276
    row_seq, row_pos = np.zeros(1, np.int32), np.array([n - 1], np.int32)
    units = attention_units(row_seq, 3, 3)
    pieces = kv_pool._attention_pieces(units, row_seq, row_pos, 0, BS, 3)
    cuts = [(0, chunk), (chunk, 2 * chunk), (2 * chunk, n)]
    assert pieces.tolist() == [[u, a, b] for u in range(3) for a, b in cuts]
    window = kv_pool._attention_pieces(units, row_seq, row_pos, n - 40, BS, 3)  # first key 40: block 2 (BS 16)
    assert window[:3].tolist() == [[0, 32, chunk], [0, chunk, 2 * chunk], [0, 2 * chunk, n]]
    for threads in (2, 3):
        bounds = kv_pool._shares(units, pieces, threads).tolist()
        assert bounds[0] == 0 and bounds[-1] == len(pieces) and bounds == sorted(bounds)
        work = [sum(int(pieces[p, 2] - pieces[p, 1]) for p in range(a, b)) for a, b in zip(bounds, bounds[1:])]
        assert max(work) - min(work) <= chunk, (threads, work)


def test_threads_split_work_without_changing_results():
    heads = 8
    seqs = random_sequences({"a": 300, "b": 200}, heads, seed=3)
    rows = {"a": (150, 300), "b": (100, 200)}
    serial, threaded = make_pool(1024, num_threads=1), make_pool(1024, num_threads=2)
    b1, q = feed(serial, seqs, rows)
    b2, _ = feed(threaded, seqs, rows)
    assert b2.attention_work * heads >= PARALLEL_MIN_WORK  # the threaded path really runs
    assert torch.equal(serial.attend(0, q, b1), threaded.attend(0, q, b2))


# ---- bfloat16 storage ------------------------------------------------------------


def test_bf16_pool_is_cpu_only_and_refuses_other_dtypes():
    with pytest.raises(ValueError, match="kv_dtype torch.bfloat16: only on CPU"):
        KVPool(LAYERS, KV_HEADS, HEAD_DIM, 64, device="cuda", kv_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="kv_dtype torch.float16: one of float32, bfloat16"):
        make_pool(kv_dtype=torch.float16)
    pool = make_pool(kv_dtype=torch.bfloat16)
    assert pool.key_cache.dtype == pool.value_cache.dtype == torch.bfloat16
    pool.ensure_capacity("a", 1)
    with pytest.raises(ValueError, match="Triton attention reads float32"):
        pool.attend_triton(0, torch.zeros(1, 2, HEAD_DIM), pool.plan(["a"], [1]))


def test_bf16_pool_stores_keys_and_values_rounded_as_torch_rounds():
    """Ties to even, values past bfloat16's range, infinities: the stored
    bits are torch's ``.to(torch.bfloat16)`` of the float32 rows; a NaN stays
    a NaN (torch's own NaN bits differ between its scalar and vector code)."""
    pool = make_pool(kv_dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    key = torch.randn(5, KV_HEADS, HEAD_DIM, generator=g)
    special = torch.tensor([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00001,
                            0x80000001], dtype=torch.int64).to(torch.int32).view(torch.float32)
    key[0, 0] = special  # two ties (to even: down, up), a round up, overflow to inf, inf, -inf, NaN, -denormal
    value = -key.flip(0)
    pool.ensure_capacity("a", 5)
    batch = pool.plan(["a"], [5])
    pool.write(1, key, value, batch)
    blocks, offsets = batch.slot_block, batch.slot_offset
    got_k = pool.key_cache[1][blocks, :, :, offsets]  # [5, kv_heads, head_dim]
    got_v = pool.value_cache[1][blocks, :, offsets]
    for got, want in ((got_k, key), (got_v, value)):
        nan = want.isnan()
        assert nan.sum() == 1 and torch.equal(got.isnan(), nan)
        assert torch.equal(got[~nan].view(torch.int16), want[~nan].to(torch.bfloat16).view(torch.int16))
    assert got_k[0, 0, 0].item() == 1.0 and got_k[0, 0, 1].item() == 1.015625  # the two ties


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("head_dim", [8, 48, 64])  # values read one by one (simd.element) / as vectors (simd.load)
@pytest.mark.parametrize("num_threads", [1, 2])
def test_bf16_pool_attends_bitwise_as_a_float32_pool_of_the_rounded_rows(window, head_dim, num_threads):
    """Widening is exact, so a bfloat16 pool's attention is a float32 pool's
    over keys and values rounded to bfloat16 first: the same bits, hence the
    same row invariance (and close to the float32 pool's own attention)."""
    heads = 6
    seqs = random_sequences({"a": 1, "b": 13, "c": 8, "d": 45}, heads, head_dim=head_dim, seed=7)
    rounded = {s: Sequence(q.keys.to(torch.bfloat16).float(), q.values.to(torch.bfloat16).float(), q.queries)
               for s, q in seqs.items()}
    rows = {"a": (0, 1), "b": (7, 13), "c": (0, 8), "d": (28, 45)}
    bf16 = make_pool(256, num_threads, head_dim, torch.bfloat16)
    b1, q = feed(bf16, seqs, rows)
    f32 = make_pool(256, num_threads, head_dim)
    b2, _ = feed(f32, rounded, rows)
    exact = make_pool(256, num_threads, head_dim)
    b3, _ = feed(exact, seqs, rows)
    for layer in range(LAYERS):
        got = bf16.attend(layer, q, b1, window)
        assert torch.equal(got, f32.attend(layer, q, b2, window))
        torch.testing.assert_close(got, exact.attend(layer, q, b3, window), atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(bf16.attend_sdpa(layer, q, b1, window), got, atol=1e-5, rtol=1e-5)
