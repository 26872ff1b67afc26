"""Forward passes of the Llama engine as CUDA graphs.

A forward pass of a small model on a GPU is a few hundred kernel launches of
microseconds each; launched one by one from Python, the host's launch work
(tens of microseconds for a Triton kernel) is the pass's time, not the GPU's.
A captured graph replays the whole pass in one launch.

Which passes: every batch of at most ``MAX_ROWS`` new tokens (decode steps,
verifications of k + 1 tokens per sequence, short prefills) that asks for no
final hidden states. One graph per (padded rows, padded sequences, feature
layers), rows and sequences rounded up to a power of two, captured the first
time such a batch comes, or all of them at start-up (``capture_all``).
Passes that ask for the states of feature layers (EAGLE-3 and MTP rounds:
the scorer returns the target's features) have graphs of their own, which
also copy those states, [T_pad, layers x hidden] in the engine's dtype, into
one features buffer their graphs share; without them every such round ran
eagerly, a Python launch per kernel. Its inputs live in one static int32
buffer, filled by one host-to-device copy per pass:

    [tokens | positions | row sequences | slot blocks | slot offsets | logits rows]  each [T_pad]
    [block tables]                                                                    [B_pad + 1, W]

W = max_model_len / block_size, so any sequence's table fits. Padding rows
take token 0 at position 0 of the extra last table row, whose only block is
the pool's scratch block (KVPool.scratch_block, which no sequence owns): they
write and read nothing of a real sequence. The graph computes logits for all
T_pad rows (the LM head over a few hundred rows costs microseconds on a GPU)
into the first T_pad rows of one float32 [MAX_ROWS, vocab] buffer that every
graph shares (graphs replay one at a time); the rows the items asked for are
gathered into a new tensor right after the replay (the features' first T
rows likewise). The graphs' other
intermediates live in one shared memory pool too, so many graphs cost little
more memory than the largest.

The graph runs the engine's own eager kernels (engine.gpu_ops), each
row-invariant, so a row's logits are bitwise those of the eager pass, whatever
the padding: tests/test_gpu_engine.py checks it.
"""
from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from specdec.engine.base import ForwardItem
from specdec.engine.kv_pool import DeviceRows, PagedBatch

if TYPE_CHECKING:
    from specdec.engine.llama import LlamaEngine

#: Batches of more new tokens than this run eagerly (long prefills: there the
#: GPU's work dwarfs the launches).
MAX_ROWS = 512
_FIELDS = 6  # per-row fields of the static buffer (module doc)


def bucket(n: int) -> int:
    """n rounded up to a power of two."""
    return 1 << max(n - 1, 0).bit_length()


def graph_keys(max_seqs: int, max_tokens: int) -> list[tuple[int, int]]:
    """Every (padded rows, padded sequences) of a graphed batch of at most
    max_seqs sequences and max_tokens new tokens: each sequence brings at
    least one row, so the sequences' bucket never exceeds the rows'."""
    top_rows = min(MAX_ROWS, bucket(max_tokens))
    return [(1 << r, 1 << s) for r in range(top_rows.bit_length())
            for s in range(min(1 << r, bucket(max_seqs)).bit_length())]


#: a graph's key: (padded rows, padded sequences, feature layers)
Key = tuple[int, int, tuple[int, ...]]


@dataclass
class _Graph:
    replay: Callable[[], None]  # replays the captured pass (its graph's replay)
    host: np.ndarray  # int32, the static buffer's next contents
    device: torch.Tensor  # int32, the static buffer the graph reads
    logits: torch.Tensor  # float32 [T_pad, vocab], the graph's output: a view of the shared buffer
    features: torch.Tensor | None  # [T_pad, layers x hidden] when it has feature layers: a view of theirs


class ForwardGraphs:
    """The CUDA graphs of one engine's forward passes (module doc)."""

    def __init__(self, engine: LlamaEngine) -> None:
        self.engine = engine
        self.width = -(-engine.max_model_len // engine.pool.block_size)
        self._graphs: dict[Key, _Graph] = {}
        self._mem_pool: Any = None  # the graphs' one memory pool (graph_pool_handle), made at the first capture
        self._logits: torch.Tensor | None = None  # float32 [MAX_ROWS, vocab], every graph's output rows
        #: [MAX_ROWS, layers x hidden] in the engine's dtype per number of feature layers: their graphs' states
        self._features: dict[int, torch.Tensor] = {}

    def takes(self, items: list[ForwardItem]) -> bool:
        """Whether a graph runs this batch: at most MAX_ROWS new tokens."""
        return sum(len(it.token_ids) for it in items) <= MAX_ROWS

    def capture_all(self, max_seqs: int, max_tokens: int,
                    feature_layers: tuple[int, ...] = ()) -> list[tuple[int, int]]:
        """Captures the graph of every (padded rows, padded sequences) a batch
        of at most max_seqs sequences and max_tokens new tokens can take
        (graph_keys: at most 54), with these feature layers, the largest
        first, so the smaller ones reuse its pool memory. Returns the keys."""
        keys = graph_keys(max_seqs, max_tokens)
        for rows, seqs in sorted(keys, reverse=True):
            if (rows, seqs, feature_layers) not in self._graphs:
                self._capture(rows, seqs, feature_layers)
        return keys

    def captured(self, feature_layers: tuple[int, ...] = ()) -> list[tuple[int, int]]:
        """(padded rows, padded sequences) of the graphs with these feature
        layers captured so far."""
        return sorted((rows, seqs) for rows, seqs, layers in self._graphs if layers == feature_layers)

    def run(self, tokens: np.ndarray, batch: PagedBatch, logit_rows: np.ndarray,
            feature_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits float32 [len(logit_rows), vocab] of a batch planned by the
        pool, and with feature_layers the states of every row's [T, layers x
        hidden] (Engine.forward's)."""
        T, B = len(tokens), len(batch.block_tables)
        key = (bucket(T), bucket(B), feature_layers)
        g = self._graphs.get(key) or self._capture(*key)
        rows, host = key[0], g.host
        self._fill_padding(host, key[0], key[1])
        fields = host[:_FIELDS * rows].reshape(_FIELDS, rows)
        fields[0, :T] = tokens
        fields[1, :T] = batch.row_pos
        fields[2, :T] = batch.row_seq
        fields[3, :T] = batch.slot_block
        fields[4, :T] = batch.slot_offset
        fields[5, :len(logit_rows)] = logit_rows
        tables = host[_FIELDS * rows:].reshape(key[1] + 1, self.width)
        tables[:B, :batch.block_tables.shape[1]] = batch.block_tables
        g.device.copy_(torch.from_numpy(host))  # pageable source: the host may refill it once this returns
        g.replay()
        picked = g.device[5 * rows:5 * rows + len(logit_rows)]
        # new tensors: the next replay may overwrite the shared buffers
        return g.logits.index_select(0, picked), (None if g.features is None else g.features[:T].clone())

    def _fill_padding(self, host: np.ndarray, rows: int, seqs: int) -> None:
        """The whole buffer as padding rows (module doc)."""
        host[:] = 0
        fields = host[:_FIELDS * rows].reshape(_FIELDS, rows)
        fields[2] = seqs  # the extra table row
        fields[3] = self.engine.pool.scratch_block
        host[_FIELDS * rows:].reshape(seqs + 1, self.width)[seqs, 0] = self.engine.pool.scratch_block

    def _capture(self, rows: int, seqs: int, feature_layers: tuple[int, ...] = ()) -> _Graph:
        engine = self.engine
        dev = engine.device
        if self._logits is None:
            self._logits = torch.empty(MAX_ROWS, engine.lm_head.out_features, dtype=torch.float32, device=dev)
        out = self._logits[:rows]
        feats = None
        if feature_layers:
            n = len(feature_layers)
            if n not in self._features:
                self._features[n] = torch.empty(MAX_ROWS, n * engine.spec.hidden_size, dtype=engine.dtype,
                                                device=dev)
            feats = self._features[n][:rows]
        host = np.zeros(_FIELDS * rows + (seqs + 1) * self.width, dtype=np.int32)
        self._fill_padding(host, rows, seqs)
        ints = torch.from_numpy(host).to(dev)
        fields = ints[:_FIELDS * rows].view(_FIELDS, rows)

        def step() -> None:
            # every tensor the graph reads is a view of ``ints`` or made inside it
            placed = DeviceRows(slot_block=fields[3].long(), slot_offset=fields[4].long(),
                                tables=ints[_FIELDS * rows:].view(seqs + 1, self.width), row_seq=fields[2],
                                row_pos=fields[1])
            normed, states = engine._final_rows(fields[0].long(), fields[1].long(), placed, feature_layers, None)
            if feats is not None:  # in the engine's dtype, as eagerly (torch.cat(states, 1).to(engine.dtype))
                feats.copy_(torch.cat(states, dim=1))
            out.copy_(engine.lm_head(normed))  # the head's dtype widened to float32, as eagerly (.float())

        self._graphs[(rows, seqs, feature_layers)] = g = _Graph(replay=self._record(step), host=host, device=ints,
                                                                 logits=out, features=feats)
        return g

    def _record(self, step: Callable[[], None]) -> Callable[[], None]:
        """Captures step, a pass reading and writing only static buffers, as
        a CUDA graph, after a warm-up on a side stream that compiles its
        kernels outside the capture; returns the graph's replay. (The only
        CUDA-specific step: a test replaces it with step itself, to run the
        rest on CPU.) The garbage collector waits until the capture ends:
        torch no longer collects when a capture begins, and an unreachable
        engine's graphs destroyed during one invalidate it (seen on an H100:
        "operation not permitted when stream is capturing (function reset)",
        the capture then failing in the next kernel launch)."""
        dev = self.engine.device
        if self._mem_pool is None:
            self._mem_pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        collecting = gc.isenabled()
        gc.disable()  # a graph the collector frees mid-capture (a dropped engine's) would invalidate this one
        try:
            with torch.cuda.graph(graph, pool=self._mem_pool):
                step()
        finally:
            if collecting:
                gc.enable()
        return graph.replay
