"""The float32 CPU forward pass's small steps as single numba calls.

A decode step of a small model runs each of these 30-60 times on one row,
where torch spends more on dispatch than on arithmetic: the RMSNorm of
``llama.rms_norm`` is eight torch ops (~40 us a call on one row, 2.5 ms per
SmolLM2 decode step), RoPE, the softmax scale and the KV write about ten.
Here each is one call of a few microseconds. They take and return numpy
arrays: the engine keeps its fused path's stream in numpy between numba
calls (``LlamaEngine._decoder_arrays``), where each torch op or tensor/array
conversion would add a microsecond of dispatch.

Row invariance (llama's module doc): every loop a row's result depends on
runs over that row alone with a trip count set by the model's widths, so
the compiled code (vector body and remainder) is the same whatever the row
count; reassociation only changes the order inside a row's sum, the same
order for every row.
"""
from __future__ import annotations

import numba
import numpy as np

from specdec.engine import kernel_cache
from specdec.engine.kv_pool import exp_nonpositive, kv_bits

_FASTMATH = {"reassoc", "contract"}


@numba.njit(nogil=True, fastmath=_FASTMATH, cache=True, inline="always")
def _norm_row(row, weight, eps, out):
    """out = weight * (row / sqrt(mean(row^2) + eps)), transformers' order."""
    n = row.shape[0]
    total = np.float32(0.0)
    for k in range(n):
        total += row[k] * row[k]
    inv = np.float32(1.0) / np.sqrt(total / np.float32(n) + eps)
    for k in range(n):
        out[k] = weight[k] * (row[k] * inv)


@numba.njit(nogil=True, fastmath=_FASTMATH, cache=True)
def _rms_norm(x, weight, eps, out):
    """out[r] = ``_norm_row`` of x[r]."""
    for r in range(x.shape[0]):
        _norm_row(x[r], weight, eps, out[r])


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float | np.float32) -> np.ndarray:
    """RMSNorm of float32 [T, n] rows (llama.rms_norm in one call); weight float32 [n]."""
    out = np.empty_like(x)
    _rms_norm(x, weight, np.float32(eps), out)
    return out


@numba.njit(nogil=True, fastmath=_FASTMATH, cache=True)
def _add_rms_norm(h, delta, weight, eps, h_out, out):
    """h_out = h + delta; out = ``_norm_row`` of each row of h_out (the norm
    of the stored sums, so the same bits as the add and the norm apart)."""
    for r in range(h.shape[0]):
        for k in range(h.shape[1]):
            h_out[r, k] = h[r, k] + delta[r, k]
        _norm_row(h_out[r], weight, eps, out[r])


def add_rms_norm(h: np.ndarray, delta: np.ndarray, weight: np.ndarray,
                 eps: np.float32) -> tuple[np.ndarray, np.ndarray]:
    """(h + delta, rms_norm(h + delta)) of float32 [T, n] rows in one call:
    the residual add and the next layer's (or the final) norm, where numpy's
    add and ``rms_norm`` apart cost two calls and ~2 us more a layer's step
    on one row (gpu_ops.add_rms_norm is the GPU's). h is not changed (the
    engine keeps references to the stream: feature layers)."""
    h_out = np.empty_like(h)
    out = np.empty_like(h)
    _add_rms_norm(h, delta, weight, eps, h_out, out)
    return h_out, out


@numba.njit(nogil=True, fastmath=_FASTMATH, cache=True)
def _rope_scale_write(qkv, heads, kv_heads, cos, sin, row_pos, rotate, scale,
                      key_cache, value_cache, slot_block, slot_offset, q_out):
    """qkv [T, heads + 2 kv_heads, D] -> q_out [T, heads, D] rotated and
    scaled; rotated keys and the values written to one layer's caches (as
    kv_pool lays them out: key_cache [blocks, kv_heads, D, block_size],
    value_cache [blocks, kv_heads, block_size, D]; float32, or bfloat16 bits
    as uint16, rounded: ``kv_pool.kv_bits``) at each row's slot. cos, sin
    [max_len, D] as llama.rope_tables gives them."""
    T = qkv.shape[0]
    D = qkv.shape[2]
    half = D // 2
    key = np.empty(D, np.float32)  # a rotated key, before the cache stores it (kv_pool.kv_bits)
    for t in range(T):
        c = cos[row_pos[t]]
        s = sin[row_pos[t]]
        blk = slot_block[t]
        off = slot_offset[t]
        for h in range(heads + kv_heads):
            x = qkv[t, h]
            if h < heads:
                dst = q_out[t, h]
                f = scale
            else:
                dst = key
                f = np.float32(1.0)
            if rotate:
                for d in range(half):
                    dst[d] = (x[d] * c[d] + x[d + half] * s[d]) * f
                for d in range(half, D):
                    dst[d] = (x[d] * c[d] + x[d - half] * s[d]) * f
            else:
                for d in range(D):
                    dst[d] = x[d] * f
            if h >= heads:
                for d in range(D):
                    key_cache[blk, h - heads, d, off] = kv_bits(key_cache, key[d])
        for h in range(kv_heads):
            x = qkv[t, heads + kv_heads + h]
            for d in range(D):
                value_cache[blk, h, off, d] = kv_bits(value_cache, x[d])


def rope_scale_write(qkv: np.ndarray, heads: int, kv_heads: int, cos: np.ndarray, sin: np.ndarray,
                     row_pos: np.ndarray, rotate: bool, scale: float, key_cache: np.ndarray,
                     value_cache: np.ndarray, slot_block: np.ndarray, slot_offset: np.ndarray) -> np.ndarray:
    """The attention's queries, float32 [T, heads, D], rotated (if rotate)
    and multiplied by scale; the rows' keys (rotated) and values stored in
    one layer's caches. qkv: float32 [T, heads + 2 kv_heads, D]."""
    q = np.empty((qkv.shape[0], heads, qkv.shape[2]), np.float32)
    _rope_scale_write(qkv, heads, kv_heads, cos, sin, row_pos, rotate, np.float32(scale),
                      key_cache, value_cache, slot_block, slot_offset, q)
    return q


@numba.njit(nogil=True, fastmath=_FASTMATH, error_model="numpy", cache=True)
def _silu_mul(gate_up, out):
    """out[r] = silu(gate) * up for gate_up[r] = [gate | up]; silu(g) =
    g / (1 + e^-g), with e^-|g| from the vectorisable exponential. numpy's
    error model (a division by zero gives inf, not an exception; 1 + e > 0
    anyway) is what lets LLVM vectorise the loop: 6 rows of SmolLM2's 1536
    took 34 us scalar, 5 us vectorised (AMD EPYC), bit for bit the same."""
    width = out.shape[1]
    for r in range(gate_up.shape[0]):
        row = gate_up[r]
        for j in range(width):
            g = row[j]
            e = exp_nonpositive(-abs(g))  # e^-|g|
            sig = np.float32(1.0) / (np.float32(1.0) + e) if g >= 0 else e / (np.float32(1.0) + e)
            out[r, j] = g * sig * row[width + j]


def silu_mul(gate_up: np.ndarray) -> np.ndarray:
    """SwiGLU's silu(gate) * up of float32 [T, 2 W] ([gate | up]) -> [T, W]."""
    out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), np.float32)
    _silu_mul(gate_up, out)
    return out


def warm_up(kv_dtype: type[np.float32] | type[np.uint16] = np.float32) -> None:
    """Compiles (or loads from numba's cache) the kernels for the argument
    types the engine passes (kv_dtype: its pool's cache arrays', float32 or
    uint16 for bfloat16 bits)."""
    x = np.zeros((1, 8), np.float32)
    rms_norm(x, np.ones(8, np.float32), 1e-5)
    add_rms_norm(x, x, np.ones(8, np.float32), np.float32(1e-5))
    silu_mul(x)
    table = np.zeros((1, 4), np.float32)
    key_cache: np.ndarray = np.zeros((1, 1, 4, 1), kv_dtype)
    value_cache: np.ndarray = np.zeros((1, 1, 1, 4), kv_dtype)
    rope_scale_write(np.zeros((1, 3, 4), np.float32), 1, 1, table, table, np.zeros(1, np.int32), True, 1.0,
                     key_cache, value_cache, np.zeros(1, np.int64), np.zeros(1, np.int64))


kernel_cache.refresh(globals())  # numba keys its cache by this file only: flush it when any kernel source changed
