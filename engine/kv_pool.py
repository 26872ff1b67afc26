"""Paged KV cache pool for the Llama runner: storage allocated once at start-up,
per-sequence block tables, rollback by length, and attention over the pages.

Layout (one tensor pair for all layers, zero-filled, float32, or bfloat16
on CPU: ``kv_dtype``):

    key_cache    [layers, num_blocks + 1, kv_heads, head_dim, block_size]
    value_cache  [layers, num_blocks + 1, kv_heads, block_size, head_dim]

(the last block is ``scratch_block``, never a sequence's).

A bfloat16 pool stores each key and value rounded to bfloat16 (nearest,
ties to even, as torch rounds: ``kv_bits``) and its kernels widen them
exactly on every read (``simd.load``, ``simd.element``): half the bytes a
decode step's attention reads and half the memory per token, and the
attention of a bfloat16 pool is, bit for bit, that of a float32 pool whose
keys and values were rounded first, so row invariance holds as for float32.

Token ``t`` of a sequence lives in block ``table[t // block_size]`` at offset
``t % block_size``. Keys are stored transposed inside a block: one dimension
of 16 consecutive tokens' keys is one vector, so the scores of 16 keys are
16 lanes of head_dim multiply-adds (no horizontal sums; the block size is a
multiple of ``simd.LANES`` on CPU). Each token's value vector is contiguous,
so a weighted value is one vectorised FMA row.

Why paged: sequences grow by a few tokens per round and shrink on rollback;
fixed-size blocks make both O(1) bookkeeping, never move cached data, and let
a full pool refuse a request up front instead of failing half-way.

Invariants:
- a block belongs to at most one sequence; every other block is in ``_free``;
- ``len(table) * block_size >= length`` for every sequence (reserved >= cached);
- ``ensure_capacity`` allocates everything asked or changes nothing;
- only whole blocks past a sequence's length are returned by ``truncate``.

Row invariance (what keeps speculation lossless): the attention output of a
query row depends only on its query vector, its position and its sequence's
cached keys and values, never on how many other rows (drafts, other
sequences) share the pass. ``_paged_attention`` guarantees it by
construction: each (row, query head) is computed from the row's visible keys
only, in ascending position order, with loops whose trip counts depend on the
row's position alone, so the compiled code takes the same path (vector body
and remainder alike) whatever else is in the batch. A score is one chain of
fused multiply-adds over the head dimensions in order, LANES keys at a time
(``_scores4``); a weighted value is, per dimension, one chain of fused
multiply-adds over the keys in position order, then times 1 / (sum of the
weights) (``_values4``, ``_values1``): explicit vectors (engine.simd), one
fixed order for every key. They are inlined into ``_attend_pieces``, whose
fast-math flags (for the softmax's loops) numba puts on scalar float calls
and on binary float operations: the vector FMA calls keep none, and the one
vector operation that takes them, the product by 1 / sum, is a lone rounding
stored as it is. Keys are cut at fixed absolute positions (``KEY_CHUNK``):
a query that sees keys of several chunks gets each piece's max, sum and
weighted values, merged in key order (``_merge_pieces``); whether and where
it is cut depends on its position and window alone. Threads only split the
pieces between them.

Sharing within a sequence: the query heads of one kv head, over all the new
rows of one sequence (a decode row's query heads; a verification chunk: k + 1
rows of them), read the same keys and values. A unit is up to ``PACK`` of
those queries (``attention_units``). Its scores are computed four queries at
a time (``_scores4``: each key vector loaded once for the four, a unit of
fewer repeats its last query into the spare chains), and its weighted values
one query after another over a tile of ``VALUE_TILE`` keys, so a tile's
values are read from memory once for the unit and from L1 for the rest.
Whether a query shares its unit changes what is loaded when, never an
operation on its numbers: the same bits.

Why chains and not partial sums: with LANES-lane vectors (two registers each
on AVX2) four partial sums per query (the kernels before) left no registers
to share a key vector between queries, and a lone query's chain of 64 steps
waits on the multiply-add's latency; four queries' chains side by side keep
both FMA units busy (figures: ``PACK``'s comment).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numba
import numpy as np
import psutil
import torch
import torch.nn.functional as F
from numba.core import types
from numba.extending import overload

from specdec.engine import kernel_cache
from specdec.engine.base import PoolExhausted
from specdec.engine.config import KV_DTYPE_NAMES
from specdec.engine.gemm_numba import LAUNCH_LOCK, set_team
from specdec.engine.simd import (
    LANES,
    bits,
    element,
    fma,
    load,
    mul,
    pow2,
    prefetch_l1,
    splat,
    store,
    zeros,
)

#: Below this many (query row, head, visible key) triples the attention runs
#: on the calling thread only; a launch of numba's threads costs more than it
#: saves (SmolLM2's shapes on 2 threads of an AMD EPYC: no faster at ~600
#: triples, 1.45x faster at ~4600, a decode row after 512 tokens).
PARALLEL_MIN_WORK = 1 << 10
#: The pool's storage dtypes by name (``kv_dtype``; bfloat16 on CPU only).
KV_DTYPES = {name: getattr(torch, name) for name in KV_DTYPE_NAMES}
#: Queries (rows x query heads of one kv head, one sequence) a unit holds:
#: their scores are computed together (``_scores4``), their values tile by
#: tile. Against the kernels before (a decode row's queries one unit each,
#: four partial sums per score and per value), SmolLM2's attention (9 query
#: heads, 3 kv heads of 64 dimensions, 30 layers) took 0.61-0.69x the time
#: for a decode row after 100-2000 cached tokens, 0.58-0.78x for two rows and
#: 0.53-0.63x for six (2 threads of an AMD EPYC of CPU family 25, the two
#: modules in turns in one process: ``benchmarks/bench_attention.py
#: --baseline``). Larger packs (6, 9, 12, 18 queries: each key and value read
#: by fewer units, fewer units to share out) measured within the noise.
PACK = 4
#: Keys whose values a unit's queries take one after another (``_attend_pieces``):
#: 64 keys of 64 float32 dimensions are 16 KB, in L1 for the unit's next query.
VALUE_TILE = 64
#: Keys are cut into pieces of work at the multiples of this many absolute
#: positions (``key_chunk``: whole blocks): a query whose visible keys span
#: pieces gets each piece's max, sum and weighted values, merged in key order
#: (``_merge_pieces``), so its bits depend on its position alone, and the
#: pieces of a decode row's few units share out over the threads. A query
#: that sees keys of one chunk only is computed as before the cut. A decode
#: row after 1000 / 2000 tokens took 0.86x / 0.80x the time of whole units
#: (SmolLM2's shapes, 2 threads of an AMD EPYC, ``bench_attention.py
#: --baseline``); 256 was no better there and cost six-row chunks 4-25%.
KEY_CHUNK = 512

# Reassociation lets LLVM vectorize the dot products and sums; every loop a
# row's result depends on has the same trip count for that row in any batch,
# so the compiled code takes the same path and the result is reproducible.
_FASTMATH = {"reassoc", "contract"}


@dataclass
class PagedBatch:
    """Where a forward pass's new tokens go and which keys each row sees.

    A *row* is one new token; rows are grouped by sequence in batch order."""

    block_tables: np.ndarray  # int32 [B, max_blocks]: each sequence's blocks, padded with 0
    row_seq: np.ndarray  # int32 [T]: batch index of each row
    row_pos: np.ndarray  # int32 [T]: absolute position of each row in its sequence
    slot_block: np.ndarray  # int64 [T]: block receiving each row's key/value
    slot_offset: np.ndarray  # int64 [T]: offset inside that block
    attention_work: int  # sum over rows of (row_pos + 1): visible keys per head
    _units: dict = field(default_factory=dict, repr=False)  # group -> attention_units (same for every layer)
    _rows: dict = field(default_factory=dict, repr=False)  # device -> DeviceRows

    def rows(self, device: torch.device) -> "DeviceRows":
        """This batch's placement as tensors on ``device``, copied once."""
        if device not in self._rows:
            def put(a: np.ndarray) -> torch.Tensor:
                return torch.from_numpy(a).to(device)
            self._rows[device] = DeviceRows(slot_block=put(self.slot_block), slot_offset=put(self.slot_offset),
                                            tables=put(self.block_tables), row_seq=put(self.row_seq),
                                            row_pos=put(self.row_pos))
        return self._rows[device]

    def units(self, group: int, kv_heads: int) -> np.ndarray:
        """``attention_units`` of this batch, computed once per shape."""
        key = (group, kv_heads)
        if key not in self._units:
            self._units[key] = attention_units(self.row_seq, group, kv_heads)
        return self._units[key]


@dataclass
class DeviceRows:
    """A batch's row placement as tensors on the pool's device (PagedBatch's
    fields of the same names), for the GPU kernels; a captured CUDA graph
    keeps one in static buffers (engine.cuda_graph)."""

    slot_block: torch.Tensor  # int64 [T]
    slot_offset: torch.Tensor  # int64 [T]
    tables: torch.Tensor  # int32 [B, W]
    row_seq: torch.Tensor  # int32 [T]
    row_pos: torch.Tensor  # int32 [T]


class KVPool:
    """Fixed paged storage for the keys and values of every layer."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity_tokens: int,
                 block_size: int = 16, device: str = "cpu", num_threads: int = 1,
                 kv_dtype: torch.dtype = torch.float32) -> None:
        if kv_dtype not in KV_DTYPES.values():
            raise ValueError(f"kv_dtype {kv_dtype}: one of {', '.join(KV_DTYPES)}")
        if kv_dtype != torch.float32 and torch.device(device).type != "cpu":
            raise ValueError(f"kv_dtype {kv_dtype}: only on CPU (the GPU kernels read float32 caches)")
        if capacity_tokens < block_size:
            raise ValueError(f"KV capacity {capacity_tokens} is below one block ({block_size} tokens)")
        if torch.device(device).type == "cpu" and block_size % LANES:
            raise ValueError(f"block_size {block_size}: on CPU a multiple of {LANES} (the attention's vector width)")
        self.block_size = block_size
        self.num_blocks = capacity_tokens // block_size
        self.capacity_tokens = self.num_blocks * block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        #: one block past the allocatable ones, never any sequence's: the rows
        #: that pad a captured CUDA graph's batch write and read it (engine.cuda_graph)
        self.scratch_block = self.num_blocks
        self.key_cache = torch.zeros(num_layers, self.num_blocks + 1, num_kv_heads, head_dim, block_size,
                                     dtype=kv_dtype, device=device)  # keys transposed per block
        self.value_cache = torch.zeros(num_layers, self.num_blocks + 1, num_kv_heads, block_size, head_dim,
                                       dtype=kv_dtype, device=device)
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))  # popped from the end
        self._tables: dict[str, list[int]] = {}  # seq_id -> its blocks, in token order
        self._lengths: dict[str, int] = {}  # seq_id -> tokens cached
        self._num_threads = num_threads
        if self.key_cache.device.type == "cpu":
            self._layer_arrays = [(_numpy(self.key_cache[i]), _numpy(self.value_cache[i])) for i in range(num_layers)]
            _warm_up(self._layer_arrays[0])

    # ---- sizing -------------------------------------------------------------

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                        kv_dtype: torch.dtype = torch.float32) -> int:
        """Bytes of keys + values one token takes in every layer."""
        return 2 * num_layers * num_kv_heads * head_dim * kv_dtype.itemsize

    @staticmethod
    def tokens_for_memory_fraction(fraction: float, bytes_per_token: int, device: str = "cpu") -> int:
        """Tokens that fit in ``fraction`` of the memory available now: free
        GPU memory on CUDA, available RAM otherwise."""
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {fraction}")
        if torch.device(device).type == "cuda":
            available = torch.cuda.mem_get_info(torch.device(device))[0]
        else:
            available = psutil.virtual_memory().available
        return int(fraction * available) // bytes_per_token

    # ---- bookkeeping ----------------------------------------------------------

    def ensure_capacity(self, seq_id: str, total_len: int) -> None:
        """Reserves blocks so ``seq_id`` can hold ``total_len`` tokens, creating
        it if new. Raises PoolExhausted and changes nothing when short."""
        table = self._tables.get(seq_id, [])
        missing = -(-total_len // self.block_size) - len(table)
        if missing > len(self._free):
            raise PoolExhausted(
                f"{seq_id!r}: needs {missing} more KV blocks of {self.block_size} tokens, {len(self._free)} free")
        if seq_id not in self._tables:
            self._tables[seq_id] = table
            self._lengths[seq_id] = 0
        for _ in range(max(missing, 0)):
            table.append(self._free.pop())

    def cached_len(self, seq_id: str) -> int:
        return self._lengths.get(seq_id, 0)

    def reserved_len(self, seq_id: str) -> int:
        """Tokens ``seq_id`` can hold without another ``ensure_capacity``."""
        return len(self._tables.get(seq_id, ())) * self.block_size

    def truncate(self, seq_id: str, length: int) -> None:
        """Keeps the first ``length`` cached tokens and frees the blocks past
        them; later tokens are overwritten when the sequence grows again."""
        if seq_id not in self._tables:
            raise KeyError(f"unknown sequence {seq_id!r}")
        if not 0 <= length <= self._lengths[seq_id]:
            raise ValueError(f"{seq_id!r}: cannot truncate {self._lengths[seq_id]} cached tokens to {length}")
        table = self._tables[seq_id]
        keep = -(-length // self.block_size)
        self._free.extend(reversed(table[keep:]))
        del table[keep:]
        self._lengths[seq_id] = length

    def release(self, seq_id: str) -> bool:
        table = self._tables.pop(seq_id, None)
        if table is None:
            return False
        del self._lengths[seq_id]
        self._free.extend(reversed(table))
        return True

    def free_tokens(self) -> int:
        return len(self._free) * self.block_size

    def num_sequences(self) -> int:
        return len(self._tables)

    # ---- one forward pass ---------------------------------------------------------

    def plan(self, seq_ids: list[str], num_new: list[int]) -> PagedBatch:
        """Places ``num_new[i]`` new tokens after each sequence's cached ones.
        Capacity must have been ensured; nothing changes until ``commit``."""
        B = len(seq_ids)
        tables = [self._tables[s] for s in seq_ids]
        starts = np.array([self._lengths[s] for s in seq_ids], dtype=np.int64)
        counts = np.asarray(num_new, dtype=np.int64)
        for s, table, start, n in zip(seq_ids, tables, starts, counts):
            if start + n > len(table) * self.block_size:
                raise ValueError(f"{s!r}: {start} + {n} tokens exceed the ensured capacity "
                                 f"{len(table) * self.block_size}")
        block_tables = np.zeros((B, max(len(t) for t in tables)), dtype=np.int32)
        for b, table in enumerate(tables):
            block_tables[b, :len(table)] = table
        row_seq = np.repeat(np.arange(B, dtype=np.int32), counts)
        first_row = np.cumsum(counts) - counts
        row_pos = (np.arange(len(row_seq)) - np.repeat(first_row - starts, counts)).astype(np.int32)
        slot_block = block_tables[row_seq, row_pos // self.block_size].astype(np.int64)
        return PagedBatch(
            block_tables=block_tables, row_seq=row_seq, row_pos=row_pos,
            slot_block=slot_block, slot_offset=(row_pos % self.block_size).astype(np.int64),
            attention_work=int(row_pos.sum()) + len(row_pos))

    def commit(self, seq_ids: list[str], num_new: list[int]) -> None:
        """Counts the tokens a finished forward pass wrote as cached."""
        for s, n in zip(seq_ids, num_new):
            self._lengths[s] += n

    @property
    def num_threads(self) -> int:
        """Threads the CPU attention may split over."""
        return self._num_threads

    def cache_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Every layer's key and value caches as numpy views [layers, ...]
        (CPU only), for kernels that index them by layer (engine.gguf_layers)."""
        return _numpy(self.key_cache), _numpy(self.value_cache)

    def layer_arrays(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """One layer's key and value caches as numpy views (CPU only), for
        kernels that write them (engine.cpu_ops)."""
        return self._layer_arrays[layer]

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, batch: PagedBatch | DeviceRows) -> None:
        """Stores the new rows' keys and values.

        key, value: float32 [T, kv_heads, head_dim]"""
        if self.key_cache.device.type == "cpu":  # one numba call: index_put costs ~2x per layer at batch 1
            slots = (batch.slot_block, batch.slot_offset) if isinstance(batch, PagedBatch) else \
                (batch.slot_block.numpy(), batch.slot_offset.numpy())
            _write_rows(*self._layer_arrays[layer], key.numpy(), value.numpy(), *slots)
            return
        from specdec.engine import gpu_ops  # Triton: imported only where it runs

        rows = self.device_rows(batch)
        gpu_ops.write_kv(key, value, self.key_cache[layer], self.value_cache[layer], rows.slot_block,
                         rows.slot_offset)

    def device_rows(self, batch: PagedBatch | DeviceRows) -> DeviceRows:
        """batch's placement on this pool's device."""
        return batch.rows(self.key_cache.device) if isinstance(batch, PagedBatch) else batch

    def attend_triton(self, layer: int, query: torch.Tensor, batch: PagedBatch | DeviceRows,
                      window: int = 0) -> torch.Tensor:
        """``attend`` through the Triton kernel (engine.gpu_ops, row-invariant
        by construction) on the pool's device: CUDA, or CPU under
        TRITON_INTERPRET=1. Arguments as for ``attend``."""
        from specdec.engine import gpu_ops  # Triton: imported only where it runs

        if self.key_cache.dtype != torch.float32:
            raise ValueError(f"kv_dtype {self.key_cache.dtype}: the Triton attention reads float32 caches")
        rows = self.device_rows(batch)
        return gpu_ops.paged_attention(query, self.key_cache[layer], self.value_cache[layer], rows.tables,
                                       rows.row_seq, rows.row_pos, window)

    def attend(self, layer: int, query: torch.Tensor, batch: PagedBatch, window: int = 0) -> torch.Tensor:
        """Causal attention of every row over its own sequence's cached keys
        (the new rows must have been written), row-invariant (module doc).

        query: float32 [T, heads, head_dim], already multiplied by the softmax scale
        window: 0, or a sliding window: a row at position p sees keys > p - window
        returns float32 [T, heads, head_dim]"""
        assert query.dtype == torch.float32 and query.is_contiguous() and query.device.type == "cpu"
        return torch.from_numpy(self.attend_array(layer, query.numpy(), batch, window))

    def attend_array(self, layer: int, query: np.ndarray, batch: PagedBatch, window: int = 0) -> np.ndarray:
        """``attend`` on a C-contiguous float32 numpy query, returning numpy."""
        assert query.shape[1] % self.num_kv_heads == 0 and query.shape[2] == self.head_dim
        out = np.empty_like(query)
        units = batch.units(query.shape[1] // self.num_kv_heads, self.num_kv_heads)
        args = (query, *self._layer_arrays[layer], batch.block_tables, batch.row_seq, batch.row_pos, window, units)
        if self._num_threads == 1 or batch.attention_work * query.shape[1] < PARALLEL_MIN_WORK:
            _paged_attention(*args, out)
        else:
            with LAUNCH_LOCK:
                set_team(self._num_threads)
                _paged_attention_parallel(*args, self._num_threads, out)
        return out

    def attend_sdpa(self, layer: int, query: torch.Tensor, batch: PagedBatch, window: int = 0) -> torch.Tensor:
        """The same attention through torch ``scaled_dot_product_attention`` on
        keys gathered into a padded [B, kv_heads, max_len, head_dim] batch: runs on
        any device, but a row's result may depend on the batch's padded
        shapes, so it is not row-invariant. Arguments as for ``attend``."""
        T, H, D = query.shape
        dev = query.device
        tables = torch.from_numpy(batch.block_tables).to(dev).long()
        B, nblk = tables.shape
        L = nblk * self.block_size
        keys = self.key_cache[layer][tables].permute(0, 2, 1, 4, 3).reshape(B, self.num_kv_heads, L, D).float()
        values = self.value_cache[layer][tables].transpose(1, 2).reshape(B, self.num_kv_heads, L, D).float()
        row_seq = torch.from_numpy(batch.row_seq).to(dev).long()
        row_pos = torch.from_numpy(batch.row_pos).to(dev).long()
        counts = torch.bincount(row_seq, minlength=B)
        row_local = torch.arange(T, device=dev) - (torch.cumsum(counts, 0) - counts)[row_seq]
        n_max = int(counts.max())
        q = query.new_zeros(B, n_max, H, D)
        q[row_seq, row_local] = query
        pos = torch.full((B, n_max), -1, dtype=torch.long, device=dev)  # -1: a padding row sees nothing
        pos[row_seq, row_local] = row_pos
        key_pos = torch.arange(L, device=dev)
        mask = key_pos <= pos[:, :, None]
        if window > 0:
            mask &= key_pos > pos[:, :, None] - window
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask[:, None],
                                             scale=1.0, enable_gqa=True)
        return out.transpose(1, 2)[row_seq, row_local]


def _numpy(cache: torch.Tensor) -> np.ndarray:
    """A CPU cache tensor as a numpy view: float32 as it is, bfloat16 as its
    uint16 bit patterns (numpy has no bfloat16)."""
    return cache.view(torch.int16).numpy().view(np.uint16) if cache.dtype == torch.bfloat16 else cache.numpy()


def kv_bits(cache, x):
    """What a cache array stores for the float32 x (numba only, ``overload``)."""
    raise NotImplementedError("kv_bits runs inside numba kernels only")


@overload(kv_bits, inline="always")
def _kv_bits(cache, x):
    """x itself in a float32 cache; in a bfloat16 one (uint16 bits) x rounded
    to the nearest bfloat16, ties to even, as torch's ``.to(torch.bfloat16)``
    rounds; a NaN becomes the quiet NaN 0x7FC0 (torch's scalar rule; its
    vector code gives other NaN bits)."""
    if cache.dtype == types.uint16:
        def to_bits(cache, x):
            u = bits(np.float32(x))
            if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                return np.uint16(0x7FC0)
            return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
        return to_bits
    return lambda cache, x: x


def default_num_threads() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _warm_up(caches: tuple[np.ndarray, np.ndarray]) -> None:
    """Compiles (or loads from numba's cache) the attention kernel and the
    KV write for the argument types ``attend`` and ``write`` pass (caches:
    a layer's, for their dtype), so the first request does not wait."""
    one = np.zeros((1, 1, 1), np.float32)
    kv = caches[0].dtype
    key_cache, value_cache = np.zeros((1, 1, 1, LANES), kv), np.zeros((1, 1, LANES, 1), kv)
    _write_rows(key_cache, value_cache, one, one, np.zeros(1, np.int64), np.zeros(1, np.int64))
    args = (one, key_cache, value_cache,
            np.zeros((1, 1), np.int32), np.zeros(1, np.int32), np.zeros(1, np.int32), 0,
            attention_units(np.zeros(1, np.int32), 1, 1))
    _paged_attention(*args, one)
    with LAUNCH_LOCK:
        set_team(1)
        _paged_attention_parallel(*args, 1, one)


# e^x for x <= 0 as 2^k * e^r, k = round(x / ln 2), |r| <= ln(2) / 2: r by
# Cody-Waite reduction, e^r by its degree-7 Taylor polynomial (error < 1e-8),
# 2^k from its exponent bits, so that a loop of them vectorises (libm's expf does not).
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693145751953125)  # ln 2 = _LN2_HI + _LN2_LO; _LN2_HI * k is exact
_LN2_LO = np.float32(1.428606765330187e-06)


@numba.njit(nogil=True, cache=True)
def _write_rows(key_cache, value_cache, key, value, slot_block, slot_offset):
    """key_cache[slot_block[t], :, :, slot_offset[t]] = key[t] and
    value_cache[slot_block[t], :, slot_offset[t]] = value[t] for every row
    t; caches as the pool's layers hold them, key and value [T, kv_heads,
    head_dim] (any strides)."""
    for t in range(key.shape[0]):
        b, o = slot_block[t], slot_offset[t]
        for h in range(key.shape[1]):
            for d in range(key.shape[2]):
                key_cache[b, h, d, o] = kv_bits(key_cache, key[t, h, d])
                value_cache[b, h, o, d] = kv_bits(value_cache, value[t, h, d])


@numba.njit(fastmath=_FASTMATH, inline="always", cache=True)
def exp_nonpositive(x):
    x = max(x, np.float32(-87.0))  # e^-87 ~ 1.6e-38: still a normal float32
    k = np.floor(x * _LOG2E + np.float32(0.5))
    r = x - k * _LN2_HI - k * _LN2_LO
    p = np.float32(1.0 / 5040)
    for c in (1.0 / 720, 1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1.0, 1.0):
        p = p * r + np.float32(c)
    return p * pow2(np.int32(k))  # k >= -126: 2^k is a normal float32


@numba.njit(nogil=True, cache=True, inline="always")
def _scores4(query, r0, h0, r1, h1, r2, h2, r3, h3, key_cache, block, g, ahead, scores, column):
    """scores[j, column:column + bs] = the scores of query[rj, hj] (j = 0..3)
    against the bs keys of one block, kv head g.

    query [T, H, D] float32; key_cache [blocks, kv_heads, D, bs] (keys
    transposed); scores [4, ...] float32. Each score is one chain of fused multiply-adds over d = 0..D-1
    in order, LANES keys a vector: each key vector is loaded once for the four
    queries, and a query's operations are the same whatever its neighbours.
    Block `ahead`'s keys are fetched into L1 meanwhile (the unit's next block)."""
    D = query.shape[2]
    bs = key_cache.shape[3]
    base = (block * key_cache.shape[1] + g) * D * bs
    fetch = (ahead * key_cache.shape[1] + g) * D * bs
    for lane0 in range(0, bs, LANES):
        a0 = a1 = a2 = a3 = zeros()
        for d in range(D):
            at = d * bs + lane0
            prefetch_l1(key_cache, fetch + at)
            k = load(key_cache, base + at)
            a0 = fma(a0, splat(query[r0, h0, d]), k)
            a1 = fma(a1, splat(query[r1, h1, d]), k)
            a2 = fma(a2, splat(query[r2, h2, d]), k)
            a3 = fma(a3, splat(query[r3, h3, d]), k)
        store(scores[0], column + lane0, a0)
        store(scores[1], column + lane0, a1)
        store(scores[2], column + lane0, a2)
        store(scores[3], column + lane0, a3)


@numba.njit(nogil=True, cache=True, inline="always")
def _values4(weights, lo, hi, key_rows, value_cache, acc, c):
    """acc[c:c + 4 LANES] += weights[x] * the value at flat offset key_rows[x]
    + c (its dimensions c..c + 4 LANES - 1), x = lo..hi-1 in order: four
    vectors, each one chain of fused multiply-adds over the keys."""
    a0, a1, a2, a3 = load(acc, c), load(acc, c + LANES), load(acc, c + 2 * LANES), load(acc, c + 3 * LANES)
    for x in range(lo, hi):
        w = splat(weights[x])
        at = key_rows[x] + c
        a0 = fma(a0, w, load(value_cache, at))
        a1 = fma(a1, w, load(value_cache, at + LANES))
        a2 = fma(a2, w, load(value_cache, at + 2 * LANES))
        a3 = fma(a3, w, load(value_cache, at + 3 * LANES))
    store(acc, c, a0)
    store(acc, c + LANES, a1)
    store(acc, c + 2 * LANES, a2)
    store(acc, c + 3 * LANES, a3)


@numba.njit(nogil=True, cache=True, inline="always")
def _values1(weights, lo, hi, key_rows, value_cache, acc, c):
    """``_values4`` for one vector of dimensions (c..c + LANES - 1): the same chain per dimension."""
    a0 = load(acc, c)
    for x in range(lo, hi):
        a0 = fma(a0, splat(weights[x]), load(value_cache, key_rows[x] + c))
    store(acc, c, a0)


@numba.njit(nogil=True, cache=True)
def attention_units(row_seq, group, kv_heads):
    """The attention's units for a batch: int32 [U, 4] rows (first row of the
    sequence's run, kv head, first query, queries). A sequence's rows (a run
    of equal row_seq) and the `group` query heads of kv head g form R * group
    queries, query i being row first + i // group, head g * group + i %
    group; they go PACK at a time (the last unit of a run and kv head may
    hold fewer)."""
    T = row_seq.shape[0]
    units = np.empty((T * group * kv_heads, 4), np.int32)  # at most one unit per query
    u = 0
    start = 0
    while start < T:
        end = start + 1
        while end < T and row_seq[end] == row_seq[start]:
            end += 1
        queries = (end - start) * group
        for g in range(kv_heads):
            for q0 in range(0, queries, PACK):
                units[u, 0] = start
                units[u, 1] = g
                units[u, 2] = q0
                units[u, 3] = min(PACK, queries - q0)
                u += 1
        start = end
    units = units[:u].copy()
    return units


@numba.njit(nogil=True, cache=True)
def _attention_pieces(units, row_seq, row_pos, window, bs, group):
    """The pieces of work of a call: int64 [P, 3] rows (unit, first key,
    end key), each unit's keys cut at the multiples of ``key_chunk(bs)``
    (absolute positions: a query's cut never depends on the batch), the
    unit's pieces in key order and one after another."""
    chunk = key_chunk(bs)
    count = 0
    for u in range(units.shape[0]):
        first, last = _unit_keys(units, u, row_pos, window, bs, group)
        count += last // chunk - first // chunk + 1
    pieces = np.empty((count, 3), np.int64)
    p = 0
    for u in range(units.shape[0]):
        first, last = _unit_keys(units, u, row_pos, window, bs, group)
        for c in range(first // chunk, last // chunk + 1):
            pieces[p, 0] = u
            pieces[p, 1] = max(c * chunk, first)
            pieces[p, 2] = min((c + 1) * chunk, last + 1)
            p += 1
    return pieces


@numba.njit(nogil=True, cache=True)
def _shares(units, pieces, chunks):
    """int64 [chunks + 1]: share c is pieces bounds[c]..bounds[c + 1]-1, runs
    in order whose work (keys x (queries + PACK): each key's value is read
    once for a unit, its score and weighted value computed per query) is
    each as near to an equal part of the whole as a cut between pieces gets."""
    cost = np.empty(pieces.shape[0] + 1, np.float64)  # cost[p]: the work of pieces 0..p-1
    cost[0] = 0.0
    for p in range(pieces.shape[0]):
        cost[p + 1] = cost[p] + (pieces[p, 2] - pieces[p, 1]) * (units[pieces[p, 0], 3] + PACK)
    bounds = np.empty(chunks + 1, np.int64)
    bounds[0] = 0
    p = 0
    for c in range(1, chunks):
        goal = cost[pieces.shape[0]] * c / chunks
        while p < pieces.shape[0] and cost[p + 1] <= goal:
            p += 1
        if p < pieces.shape[0] and goal - cost[p] > cost[p + 1] - goal:
            p += 1  # the cut after piece p is nearer the goal
        bounds[c] = p
    bounds[chunks] = pieces.shape[0]
    return bounds


@numba.njit(nogil=True, cache=True, inline="always")
def _unit_keys(units, u, row_pos, window, bs, group):
    """(first key, last key) a unit reads: from the block of its first
    query's first visible key to its last query's position (the unit's rows
    are in position order, so are their windows)."""
    run, q0, nq = units[u, 0], units[u, 2], units[u, 3]
    lo = row_pos[run + q0 // group]
    first = (max(0, lo - window + 1) if window > 0 else 0) // bs * bs
    return first, row_pos[run + (q0 + nq - 1) // group]


@numba.njit(nogil=True, cache=True, inline="always")
def key_chunk(bs):
    """Keys a piece of work spans at most: KEY_CHUNK rounded down to whole
    blocks, at least one block."""
    return max(1, KEY_CHUNK // bs) * bs


@numba.njit(nogil=True, fastmath=_FASTMATH, error_model="numpy", cache=True)
def _attend_pieces(query, key_cache, value_cache, block_tables, row_seq, row_pos, window, units, pieces,
                   piece_begin, piece_end, out, part_max, part_sum, part_acc):
    """Softmax attention over the pieces piece_begin..piece_end-1 of
    ``pieces`` (``_attention_pieces``: keys first..end-1 of a unit, up to
    PACK queries, rows x query heads of one kv head and sequence).

    query [T, H, D] float32 (pre-scaled); key_cache [num_blocks, kv_heads,
    D, bs], value_cache [num_blocks, kv_heads, bs, D]; block_tables int32
    [B, max_blocks]; row_seq, row_pos int32 [T]; out [T, H, D] float32.

    Per piece: the scores of its blocks (``_scores4``); per query, over its
    n visible keys in the piece, in position order, their max, the weights
    e^(s - max) and their sum; then the weighted values, a tile of
    VALUE_TILE keys at a time for each query in turn (``_values4`` for four
    vectors of dimensions, ``_values1`` for the rest, scalar chains in the
    same order when D is not a multiple of LANES). A query whose visible keys
    lie in one chunk has them all here: it is written to ``out``, times
    1 / sum. Any other query leaves its max, sum and weighted values (not
    divided) in part_max[p, j], part_sum[p, j] (0: no visible key here) and
    part_acc[p, j] for ``_merge_pieces``."""
    T, H, D = query.shape
    kv_heads = key_cache.shape[1]
    bs = key_cache.shape[3]
    chunk = key_chunk(bs)
    group = H // kv_heads
    scores = np.empty((PACK + 3, chunk), np.float32)  # + 3: a last group of four's spare chains
    key_rows = np.empty(chunk, np.int64)  # flat offset of each column's key's value vector
    acc = np.empty((PACK, D), np.float32)
    rows = np.empty(PACK + 3, np.int64)
    heads = np.empty(PACK + 3, np.int64)
    lows = np.empty(PACK, np.int64)  # each query's visible columns: lows[j]..highs[j]-1
    highs = np.empty(PACK, np.int64)
    invs = np.empty(PACK, np.float32)
    whole = np.empty(PACK, np.bool_)  # the query's visible keys all lie in this piece
    four = D - D % (4 * LANES)
    vector_values = D % LANES == 0
    for p in range(piece_begin, piece_end):
        unit, k_lo, k_hi = pieces[p, 0], pieces[p, 1], pieces[p, 2]
        run, g, q0, nq = units[unit, 0], units[unit, 1], units[unit, 2], units[unit, 3]
        for j in range(PACK + 3):  # past the unit's queries its last is repeated (spare chains)
            i = q0 + min(j, nq - 1)
            rows[j] = run + i // group
            heads[j] = g * group + i % group
        table = block_tables[row_seq[rows[0]]]
        first_blk = k_lo // bs
        last_blk = (k_hi - 1) // bs
        for blk_i in range(first_blk, last_blk + 1):
            column = (blk_i - first_blk) * bs
            start = (table[blk_i] * kv_heads + g) * bs * D  # flat offset of the block's values [bs, D]
            for j in range(0, nq, 4):  # the block's keys from L1 after the first four
                _scores4(query, rows[j], heads[j], rows[j + 1], heads[j + 1], rows[j + 2], heads[j + 2], rows[j + 3],
                         heads[j + 3], key_cache, table[blk_i], g, table[min(blk_i + 1, last_blk)], scores[j:j + 4],
                         column)
            for o in range(bs):
                key_rows[column + o] = start + o * D
        tile_lo, tile_hi = chunk, 0
        for j in range(nq):
            pos = row_pos[rows[j]]
            first = max(0, pos - window + 1) if window > 0 else 0
            whole[j] = first // chunk == pos // chunk
            a, b = max(first, k_lo), min(pos + 1, k_hi)
            acc[j, :] = 0.0
            if a >= b:  # none of its keys in this piece
                lows[j], highs[j] = 0, 0
                part_sum[p, j] = 0.0
                continue
            lows[j], highs[j] = a - first_blk * bs, b - first_blk * bs
            tile_lo, tile_hi = min(tile_lo, lows[j]), max(tile_hi, highs[j])
            weights = scores[j, lows[j]:highs[j]]  # a view from 0: the loops below vectorise
            m = weights[0]
            for i in range(1, weights.shape[0]):
                m = max(m, weights[i])
            total = np.float32(0.0)
            for i in range(weights.shape[0]):
                weights[i] = exp_nonpositive(weights[i] - m)
                total += weights[i]
            invs[j] = np.float32(1.0) / total
            part_max[p, j] = m
            part_sum[p, j] = total
        if vector_values:
            for c in range(0, D, LANES):
                if c < four and c % (4 * LANES):
                    continue  # inside a group of four that _values4 took
                for x0 in range(tile_lo, tile_hi, VALUE_TILE):
                    for j in range(nq):
                        a, b = max(x0, lows[j]), min(x0 + VALUE_TILE, highs[j])
                        if a >= b:
                            continue
                        if c < four:
                            _values4(scores[j], a, b, key_rows, value_cache, acc[j], c)
                        else:
                            _values1(scores[j], a, b, key_rows, value_cache, acc[j], c)
            for j in range(nq):
                if highs[j] == lows[j]:
                    continue
                if whole[j]:
                    at = (rows[j] * H + heads[j]) * D
                    inv = splat(invs[j])
                    for c in range(0, D, LANES):
                        store(out, at + c, mul(load(acc[j], c), inv))
                else:
                    part_acc[p, j, :] = acc[j]
            continue
        for j in range(nq):
            if highs[j] == lows[j]:
                continue
            for d in range(D):
                v = np.float32(0.0)
                for x in range(lows[j], highs[j]):
                    v = v + scores[j, x] * element(value_cache, key_rows[x] + d)
                if whole[j]:
                    out[rows[j], heads[j], d] = v * invs[j]
                else:
                    part_acc[p, j, d] = v


@numba.njit(nogil=True, error_model="numpy", cache=True)
def _merge_pieces(units, pieces, row_pos, window, bs, group, part_max, part_sum, part_acc, out):
    """Every query whose visible keys span chunks (``_attend_pieces`` left
    its pieces' parts): with M the largest of its pieces' maxima and s_p =
    e^(max_p - M), out = (sum_p s_p acc_p) / (sum_p s_p sum_p), both sums
    over its pieces in key order (per dimension one chain of fused
    multiply-adds, LANES dimensions a vector; separate products and sums
    for a remainder of D % LANES), then times 1 / the sum. No fast-math:
    each operation rounds as written."""
    chunk = key_chunk(bs)
    D = out.shape[2]
    vectors = D - D % LANES  # dimensions taken LANES at a time (fused multiply-adds); the rest one by one
    p0 = 0
    while p0 < pieces.shape[0]:
        unit = pieces[p0, 0]
        p1 = p0 + 1
        while p1 < pieces.shape[0] and pieces[p1, 0] == unit:
            p1 += 1
        run, g, q0, nq = units[unit, 0], units[unit, 1], units[unit, 2], units[unit, 3]
        for j in range(nq):
            i = q0 + j
            row, head = run + i // group, g * group + i % group
            pos = row_pos[row]
            first = max(0, pos - window + 1) if window > 0 else 0
            if first // chunk == pos // chunk:
                continue  # written whole by its one piece
            top = np.float32(-np.inf)
            for p in range(p0, p1):
                if part_sum[p, j] > 0.0:
                    top = max(top, part_max[p, j])
            total = np.float32(0.0)
            dst = out[row, head]
            dst[:] = 0.0
            for p in range(p0, p1):
                if part_sum[p, j] > 0.0:
                    s = exp_nonpositive(part_max[p, j] - top)
                    total = total + part_sum[p, j] * s
                    part = part_acc[p, j]
                    sv = splat(s)
                    for c in range(0, vectors, LANES):
                        store(dst, c, fma(load(dst, c), sv, load(part, c)))
                    for d in range(vectors, D):
                        dst[d] = dst[d] + part[d] * s
            inv = np.float32(1.0) / total
            iv = splat(inv)
            for c in range(0, vectors, LANES):
                store(dst, c, mul(load(dst, c), iv))
            for d in range(vectors, D):
                dst[d] = dst[d] * inv
        p0 = p1


@numba.njit(nogil=True, cache=True)
def _pieces_and_parts(query, key_cache, row_seq, row_pos, window, units):
    """(block size, query heads per kv head, ``_attention_pieces``, and the
    parts ``_attend_pieces`` leaves for ``_merge_pieces``: max, sum [P, PACK]
    and weighted values [P, PACK, D] of each piece's queries)."""
    bs = key_cache.shape[3]
    group = query.shape[1] // key_cache.shape[1]
    pieces = _attention_pieces(units, row_seq, row_pos, window, bs, group)
    part_max = np.empty((pieces.shape[0], PACK), np.float32)
    part_sum = np.empty((pieces.shape[0], PACK), np.float32)
    part_acc = np.empty((pieces.shape[0], PACK, query.shape[2]), np.float32)
    return bs, group, pieces, part_max, part_sum, part_acc


@numba.njit(nogil=True, cache=True)
def _paged_attention(query, key_cache, value_cache, block_tables, row_seq, row_pos, window, units, out):
    """Softmax attention of every unit (``attention_units``: up to PACK
    queries, rows x query heads of one kv head and sequence) on the calling
    thread: ``_attend_pieces`` then ``_merge_pieces``. Arrays as there."""
    bs, group, pieces, part_max, part_sum, part_acc = _pieces_and_parts(query, key_cache, row_seq, row_pos, window,
                                                                        units)
    _attend_pieces(query, key_cache, value_cache, block_tables, row_seq, row_pos, window, units, pieces, 0,
                   pieces.shape[0], out, part_max, part_sum, part_acc)
    _merge_pieces(units, pieces, row_pos, window, bs, group, part_max, part_sum, part_acc, out)


@numba.njit(nogil=True, parallel=True, cache=True)
def _paged_attention_parallel(query, key_cache, value_cache, block_tables, row_seq, row_pos, window, units,
                              chunks, out):
    """``_paged_attention`` with the pieces shared out to `chunks` parallel
    calls (numba threads), each a run of pieces of about equal work
    (``_shares``), merged after on the calling thread."""
    bs, group, pieces, part_max, part_sum, part_acc = _pieces_and_parts(query, key_cache, row_seq, row_pos, window,
                                                                        units)
    bounds = _shares(units, pieces, chunks)
    for c in numba.prange(chunks):
        _attend_pieces(query, key_cache, value_cache, block_tables, row_seq, row_pos, window, units, pieces,
                       bounds[c], bounds[c + 1], out, part_max, part_sum, part_acc)
    _merge_pieces(units, pieces, row_pos, window, bs, group, part_max, part_sum, part_acc, out)


kernel_cache.refresh(globals())  # numba keys its cache by this file only: flush it when any kernel source changed
