"""Small steps of CPU drafting as single numba calls: a feature head's RoPE
and attention (``eagle3.FeatureHead``), the top-K of draft logits
(``draft.choose_tokens``).

A chain step of SmolLM2's head is five one-row GEMMs and about sixty torch
ops between them (norms, RoPE, the cache write, attention, SwiGLU), each
a few microseconds of dispatch: with the GEMMs in Q8_0 blocks the ops took
more than the GEMMs (a chain step ~1 ms on one thread of an Intel Xeon,
CPU model 207, 0.45 ms of it GEMM). Here RoPE and the attention over a
sequence's cache are one call each; the norms and SwiGLU are the engine's
(``engine.cpu_ops``). The head drafts; its values need not match torch's bit
for bit (verification decides the output), only closely (tested).
"""
from __future__ import annotations

import numba
import numpy as np

from specdec.engine import kernel_cache
from specdec.engine.kv_pool import exp_nonpositive

_FASTMATH = {"reassoc", "contract", "arcp"}


@numba.njit(nogil=True, fastmath=_FASTMATH, cache=True)
def _rope(x, positions, inv_freq):
    """Rotates every head of x [T, heads, D] in place, row t at position
    positions[t]: the half-split pairs (x[j], x[j + D/2]) by the angle
    position * inv_freq[j] (``llama.apply_rope``'s rotation)."""
    half = inv_freq.shape[0]
    for t in range(x.shape[0]):
        pos = np.float32(positions[t])
        for j in range(half):
            angle = pos * inv_freq[j]
            c, s = np.cos(angle), np.sin(angle)
            for h in range(x.shape[1]):
                a, b = x[t, h, j], x[t, h, j + half]
                x[t, h, j] = a * c - b * s
                x[t, h, j + half] = b * c + a * s


def rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> None:
    """RoPE of float32 x [T, heads, D] in place (positions int64 [T], inv_freq float32 [D / 2])."""
    _rope(x, positions, inv_freq)


@numba.njit(nogil=True, fastmath=_FASTMATH, cache=True)
def _attend(q, keys, values, n, scale, out):
    """Causal attention of q [m, H, D], the last m of a sequence's n cached
    rows (keys, values [Hkv, capacity, D], query heads grouped over their kv
    head): row i sees cached rows 0 .. n - m + i. out [m, H, D]."""
    m, heads, dim = q.shape
    group = heads // keys.shape[0]
    scores = np.empty(n, np.float32)
    for i in range(m):
        seen = n - m + i + 1
        for h in range(heads):
            kv = h // group
            top = np.float32(-np.inf)
            for j in range(seen):
                dot = np.float32(0.0)
                for d in range(dim):
                    dot += q[i, h, d] * keys[kv, j, d]
                dot *= scale
                scores[j] = dot
                top = max(top, dot)
            total = np.float32(0.0)
            for j in range(seen):
                e = np.exp(scores[j] - top)
                scores[j] = e
                total += e
            for d in range(dim):
                out[i, h, d] = np.float32(0.0)
            for j in range(seen):
                w = scores[j] / total
                for d in range(dim):
                    out[i, h, d] += w * values[kv, j, d]


def attend(q: np.ndarray, keys: np.ndarray, values: np.ndarray, n: int, scale: float) -> np.ndarray:
    """``_attend``: float32 [m, H, D] of the last m rows of n cached ones."""
    out = np.empty_like(q)
    _attend(q, keys, values, n, np.float32(scale), out)
    return out


@numba.njit(nogil=True, fastmath=_FASTMATH, cache=True)
def _sum_exp(row, top):
    """sum of e^(row[j] - top) over a float32 row (top its largest value), float32 (vectorised)."""
    total = np.float32(0.0)
    for j in range(row.shape[0]):
        total += exp_nonpositive(row[j] - top)
    return total


@numba.njit(nogil=True, cache=True)
def _top_k(rows, scale, greedy, values, ids):
    """Per row of rows float32 [n, V]: greedy[r] = the largest softmax
    probability (float32 sums: a confidence, not a sampling weight), values[r] / ids[r] = the k = values.shape[1]
    largest rows[r] / scale[r] (float64, descending; the lower column first
    among equals) and their columns."""
    k = values.shape[1]
    for r in range(rows.shape[0]):
        row = rows[r]
        top = row[0]
        for j in range(row.shape[0]):
            top = max(top, row[j])
        greedy[r] = 1.0 / _sum_exp(row, top)
        filled = 0  # the k largest values, raw (the order of row / scale, scale > 0), then scaled
        for j in range(row.shape[0]):
            v = row[j]
            if filled == k and v <= values[r, k - 1]:
                continue
            at = filled if filled < k else k - 1  # insertion point, from the end
            while at > 0 and values[r, at - 1] < v:
                values[r, at], ids[r, at] = values[r, at - 1], ids[r, at - 1]
                at -= 1
            values[r, at], ids[r, at] = v, j
            filled = min(filled + 1, k)
        for i in range(k):
            values[r, i] = values[r, i] / scale[r]


def top_k(rows: np.ndarray, scale: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``_top_k`` of float32 rows [n, V] (k <= V; scale float64 [n])."""
    n = rows.shape[0]
    greedy, values, ids = np.empty(n), np.empty((n, k)), np.empty((n, k), np.int64)
    _top_k(rows, scale, greedy, values, ids)
    return greedy, values, ids


def warm_up() -> None:
    """Compiles (or loads from numba's cache) the kernels for the types the head passes."""
    x = np.zeros((1, 2, 4), np.float32)
    rope(x, np.zeros(1, np.int64), np.ones(2, np.float32))
    cache = np.zeros((1, 2, 4), np.float32)
    attend(x, cache, cache, 1, 1.0)
    top_k(np.zeros((1, 4), np.float32), np.ones(1), 2)


kernel_cache.refresh(globals())  # numba keys its cache by this file only: flush it when any kernel source changed
