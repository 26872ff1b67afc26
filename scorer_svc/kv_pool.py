"""Paged KV cache pool for the Llama runner: storage allocated once at start-up,
per-sequence block tables, rollback by length, and attention over the pages.

Layout (one tensor pair for all layers, zero-filled, float32 on CPU):

    key_cache   [layers, num_blocks, kv_heads, head_dim, block_size]  keys transposed per block
    value_cache [layers, num_blocks, kv_heads, block_size, head_dim]

Token ``t`` of a sequence lives in block ``table[t // block_size]`` at offset
``t % block_size``. Keys are stored transposed so that the scores of one
block are ``head_dim`` vector FMAs ``block_size`` lanes wide.

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
construction: one serial routine computes each (row, head) by walking the
row's visible keys block by block, in ascending order, with the same block
boundaries whatever else is in the batch; a masked lane never takes part in
the sums. Threads only split the (row, head) units between them.
"""
from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numba
import numpy as np
import psutil
import torch
import torch.nn.functional as F

from specdec.scorer_svc.engine import PoolExhausted

#: Below this many (query row, head, visible key) triples the attention runs
#: on the calling thread only; a thread hand-off costs more than it saves.
PARALLEL_MIN_WORK = 1 << 16

# Reassociation lets LLVM vectorize the lane loops; every loop a row's result
# depends on has the same trip count for that row in any batch, so the
# compiled code takes the same path and the result is reproducible. No
# nnan/ninf: masked scores are -inf.
_FASTMATH = {"reassoc", "contract"}


@dataclass
class PagedBatch:
    """Where a forward pass's new tokens go and which keys each row sees.

    A *row* is one new token; rows are grouped by sequence in batch order."""

    block_tables: np.ndarray  # int32 [B, max_blocks]: each sequence's blocks, padded with 0
    row_seq: np.ndarray  # int32 [T]: batch index of each row
    row_pos: np.ndarray  # int32 [T]: absolute position of each row in its sequence
    slot_block: torch.Tensor  # int64 [T]: block receiving each row's key/value
    slot_offset: torch.Tensor  # int64 [T]: offset inside that block
    attention_work: int  # sum over rows of (row_pos + 1): visible keys per head


class KVPool:
    """Fixed paged storage for the keys and values of every layer."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity_tokens: int,
                 block_size: int = 16, device: str = "cpu", num_threads: int = 1) -> None:
        if capacity_tokens < block_size:
            raise ValueError(f"KV capacity {capacity_tokens} is below one block ({block_size} tokens)")
        self.block_size = block_size
        self.num_blocks = capacity_tokens // block_size
        self.capacity_tokens = self.num_blocks * block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (num_layers, self.num_blocks, num_kv_heads)
        self.key_cache = torch.zeros(*shape, head_dim, block_size, dtype=torch.float32, device=device)
        self.value_cache = torch.zeros(*shape, block_size, head_dim, dtype=torch.float32, device=device)
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))  # popped from the end
        self._tables: dict[str, list[int]] = {}  # seq_id -> its blocks, in token order
        self._lengths: dict[str, int] = {}  # seq_id -> tokens cached
        self._workers = ThreadPoolExecutor(num_threads - 1) if num_threads > 1 else None
        self._num_threads = num_threads

    # ---- sizing -------------------------------------------------------------

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes of float32 keys + values one token takes in every layer."""
        return 2 * num_layers * num_kv_heads * head_dim * 4

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
                f"{seq_id}: needs {missing} more KV blocks of {self.block_size} tokens, {len(self._free)} free")
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
            raise ValueError(f"{seq_id}: cannot truncate {self._lengths[seq_id]} cached tokens to {length}")
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
            slot_block=torch.from_numpy(slot_block).to(self.key_cache.device),
            slot_offset=torch.from_numpy((row_pos % self.block_size).astype(np.int64)).to(self.key_cache.device),
            attention_work=int(row_pos.sum()) + len(row_pos))

    def commit(self, seq_ids: list[str], num_new: list[int]) -> None:
        """Counts the tokens a finished forward pass wrote as cached."""
        for s, n in zip(seq_ids, num_new):
            self._lengths[s] += n

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, batch: PagedBatch) -> None:
        """Stores the new rows' keys and values.

        key, value: float32 [T, kv_heads, head_dim]"""
        self.key_cache[layer, batch.slot_block, :, :, batch.slot_offset] = key
        self.value_cache[layer, batch.slot_block, :, batch.slot_offset, :] = value

    def attend(self, layer: int, query: torch.Tensor, batch: PagedBatch, window: int = 0) -> torch.Tensor:
        """Causal attention of every row over its own sequence's cached keys
        (the new rows must have been written), row-invariant (module doc).

        query: float32 [T, heads, head_dim], already multiplied by the softmax scale
        window: 0, or a sliding window: a row at position p sees keys > p - window
        returns float32 [T, heads, head_dim]"""
        assert query.dtype == torch.float32 and query.is_contiguous() and query.device.type == "cpu"
        assert query.shape[1] % self.num_kv_heads == 0 and query.shape[2] == self.head_dim
        out = torch.empty_like(query)
        args = (query.numpy(), self.key_cache[layer].numpy(), self.value_cache[layer].numpy(),
                batch.block_tables, batch.row_seq, batch.row_pos, window)
        work = batch.attention_work * query.shape[1]
        if self._workers is None or work < PARALLEL_MIN_WORK:
            _paged_attention(*args, 0, 1, out.numpy())
        else:
            n = self._num_threads
            jobs = [self._workers.submit(_paged_attention, *args, i, n, out.numpy()) for i in range(1, n)]
            _paged_attention(*args, 0, n, out.numpy())
            for job in jobs:
                job.result()
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
        keys = self.key_cache[layer][tables].permute(0, 2, 1, 4, 3).reshape(B, self.num_kv_heads, L, D)
        values = self.value_cache[layer][tables].permute(0, 2, 1, 3, 4).reshape(B, self.num_kv_heads, L, D)
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


def default_num_threads() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@numba.njit(nogil=True, fastmath=_FASTMATH, cache=True)
def _paged_attention(query, key_cache, value_cache, block_tables, row_seq, row_pos, window,
                     unit_begin, unit_step, out):
    """Online-softmax attention for the (row, head) units unit_begin,
    unit_begin + unit_step, ...; unit u is row u // heads, head u % heads.

    query [T, H, D] float32 (pre-scaled); key_cache [num_blocks, Hkv, D, bs];
    value_cache [num_blocks, Hkv, bs, D]; block_tables int32 [B, max_blocks];
    row_seq, row_pos int32 [T]; out [T, H, D] float32.

    Per unit: for each block holding visible keys, in ascending order, score
    all bs lanes, take the max over the visible lanes [lo, hi), rescale the
    running sum and accumulator once, then add the visible lanes one by one."""
    T, H, D = query.shape
    kv_heads = key_cache.shape[1]
    bs = key_cache.shape[3]
    group = H // kv_heads
    scores = np.empty(bs, np.float32)
    acc = np.empty(D, np.float32)
    for unit in range(unit_begin, T * H, unit_step):
        row = unit // H
        head = unit % H
        g = head // group
        pos = row_pos[row]
        first = max(0, pos - window + 1) if window > 0 else 0
        table = block_tables[row_seq[row]]
        q = query[row, head]
        m = np.float32(-np.inf)
        total = np.float32(0.0)
        acc[:] = 0.0
        for blk_i in range(first // bs, pos // bs + 1):
            keys = key_cache[table[blk_i], g]  # [D, bs]
            values = value_cache[table[blk_i], g]  # [bs, D]
            scores[:] = 0.0
            for d in range(D):
                qd = q[d]
                for j in range(bs):
                    scores[j] += qd * keys[d, j]
            lo = max(first - blk_i * bs, 0)
            hi = min(pos - blk_i * bs + 1, bs)
            m_new = m
            for j in range(lo, hi):
                m_new = max(m_new, scores[j])
            alpha = np.float32(math.exp(m - m_new))  # 0 on the first block (m = -inf)
            total *= alpha
            for d in range(D):
                acc[d] *= alpha
            for j in range(lo, hi):
                p = np.float32(math.exp(scores[j] - m_new))
                total += p
                for d in range(D):
                    acc[d] += p * values[j, d]
            m = m_new
        inv = np.float32(1.0) / total
        for d in range(D):
            out[row, head, d] = acc[d] * inv
