"""The decoder layers of a GGUF model's forward pass in one numba call.

The fused CPU path (``LlamaEngine._decoder_arrays``) runs a layer as nine
kernel calls from Python: four GEMMs, RoPE with the KV write, the
attention, SiLU and two residual adds with their norms. On one row each
kernel computes for a few to a few tens of microseconds, and each call
costs a few more in Python around it (the wrappers, their output arrays,
numba's unboxing of its arguments): SmolLM2's 30 layers spent ~1.6 ms of an
~8 ms decode step between kernels (2 AVX2 cores of an AMD EPYC, timed in
place). ``decode_layers`` runs the same kernels, with the same arguments, in
the same order, from one numba function: the same bits (tested against the
Python loop), without that time.

It takes the layers it can: every projection read from GGUF blocks
(``gemm_gguf.QuantWeight``) without a bias, no query/key norms, and
batches whose rows one launch of a layout's kernel computes
(``gemm_gguf.pieces``: on a CPU where one layout serves every row count,
as AVX2's narrow one, any batch; else those the selector's layouts split
take the Python loop). Each GEMM is chosen inside by codes, its blocks' kind
and the layout the selector chose for the row count (``gemm_by``, which
compiles the "table" layout's kernels only on a CPU that runs them), so the
loop is compiled once and cached like every other kernel (numba cannot
cache a function that takes kernels as arguments: each process compiled
it again, ~7 s). Anything else takes the Python loop.

SmolLM2 (Q4_1 GGUF) on 2 AVX2 cores of an AMD EPYC (family 25), the Python
loop and this call in turns in one process, 14 blocks of 48 forwards each
(``/work/exp/s49/ab_layers.py``): 0.82-0.93x the forward's time at one row
(median of eight runs ~0.87), 0.86-0.92x at two, 0.90-0.95x at three,
0.89x at four, 0.91x at six.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numba
import numpy as np
from numba import types
from numba.extending import overload

from specdec.engine import cpu_ops, gemm_gguf, kernel_cache, kv_pool


@dataclass
class LayerArrays:
    """The model's per-layer arrays, stacked ([L, ...], built once): each
    projection's blocks, the norms, RoPE and window flags; each projection's
    block kind and outputs (the same in every layer)."""

    qkv: tuple[np.ndarray, np.ndarray, np.ndarray]  # qs, d, m [L, ...]
    o: tuple[np.ndarray, np.ndarray, np.ndarray]
    gate_up: tuple[np.ndarray, np.ndarray, np.ndarray]
    down: tuple[np.ndarray, np.ndarray, np.ndarray]
    kinds: np.ndarray  # int64 [4]: each projection's block kind (``KINDS``): qkv, o, gate_up, down
    out_features: np.ndarray  # int64 [4]: each projection's outputs (never padded here)
    input_norms: np.ndarray  # float32 [L, hidden]
    post_norms: np.ndarray  # float32 [L, hidden]
    rope: np.ndarray  # bool [L]
    window: np.ndarray  # int64 [L]


def not_taken(layers) -> str | None:
    """Why the layers cannot go through ``decode_layers`` (module doc), or
    None where they can."""
    for role in ("qkv", "o", "gate_up", "down"):
        lins = [getattr(layer, role) for layer in layers]
        quants = [lin._quant for lin in lins]
        if any(q is None for q in quants):
            return f"{role}: not read from GGUF blocks (GEMM path {lins[0].path.name})"
        if any(lin._bias_array is not None for lin in lins):
            return f"{role}: a bias"
        if len({(q.kind, q.qs.dtype, q.qs.shape, q.d.shape, q.m.shape) for q in quants}) != 1:
            return f"{role}: blocks of several kinds or shapes across layers"
        if quants[0].d.shape[0] != lins[0].out_features:  # padded outputs: the Python loop cuts them
            return f"{role}: padded outputs"
    if any(layer.q_norm is not None for layer in layers):
        return "query/key norms"
    return None


def layer_arrays(layers) -> LayerArrays | None:
    """The layers as ``decode_layers`` takes them, or None where some layer
    cannot go that way (``not_taken``). Each projection's blocks move into one
    array of every layer's (numba indexes it by layer; a typed list of
    arrays compiles its methods for each array type in every process,
    ~0.5 s each), and its layers' weights become views of it: no copy stays."""
    if not_taken(layers) is not None:
        return None
    roles = ("qkv", "o", "gate_up", "down")

    def stacked(role: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lins = [getattr(layer, role) for layer in layers]
        quants = [lin._quant for lin in lins]
        qs, d, m = (np.stack([getattr(q, name) for q in quants]) for name in ("qs", "d", "m"))
        for i, (lin, q) in enumerate(zip(lins, quants)):
            lin._quant = replace(q, qs=qs[i], d=d[i], m=m[i])
        return qs, d, m

    return LayerArrays(
        qkv=stacked("qkv"), o=stacked("o"), gate_up=stacked("gate_up"), down=stacked("down"),
        kinds=np.array([KINDS[getattr(layers[0], role)._quant.kind] for role in roles], dtype=np.int64),
        out_features=np.array([getattr(layers[0], role).out_features for role in roles], dtype=np.int64),
        input_norms=np.stack([layer.input_norm.numpy() for layer in layers]),
        post_norms=np.stack([layer.post_norm.numpy() for layer in layers]),
        rope=np.array([layer.rope for layer in layers], dtype=np.bool_),
        window=np.array([layer.window for layer in layers], dtype=np.int64))


#: ``gemm_by``'s codes of the block kinds and the layouts.
KINDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}
LAYOUT_CODES = {"table": 0, "wide": 1, "narrow": 2}


def layout(rows: int) -> int | None:
    """The layout code (``LAYOUT_CODES``) every GEMM of a ``rows``-row batch
    runs, where ``gemm_gguf.gemm`` runs them in one launch (``pieces``: one
    row count, or neighbouring parts of one layout), else None."""
    pieces = gemm_gguf.pieces(rows)
    return LAYOUT_CODES[pieces[0][2]] if len(pieces) == 1 else None


def gemm_by(x, qs, d, m, out, chunks, kind, layout):
    """``gemm_gguf.LAYOUTS[layout][kind]`` by codes (numba only, ``overload``)."""
    raise NotImplementedError("gemm_by runs inside numba functions only")


@overload(gemm_by)
def _gemm_by(x, qs, d, m, out, chunks, kind, layout):
    table = "table" in gemm_gguf.RUNNABLE  # its kernels compile only where the CPU has the lane permutes
    if qs.dtype == types.int8:  # Q8_0 (its "table" entry groups six rows as the table layout does)
        def q8_0(x, qs, d, m, out, chunks, kind, layout):
            if layout == 0:
                gemm_gguf._gemm_q8_0_table(x, qs, d, m, out, chunks)
            elif layout == 1:
                gemm_gguf._gemm_q8_0(x, qs, d, m, out, chunks)
            else:
                gemm_gguf._gemm_q8_0_narrow(x, qs, d, m, out, chunks)
        return q8_0
    if table:
        def q4_table(x, qs, d, m, out, chunks, kind, layout):
            if kind == 0:
                if layout == 0:
                    gemm_gguf._gemm_q4_0_pick(x, qs, d, m, out, chunks)
                elif layout == 1:
                    gemm_gguf._gemm_q4_0(x, qs, d, m, out, chunks)
                else:
                    gemm_gguf._gemm_q4_0_narrow(x, qs, d, m, out, chunks)
            elif layout == 0:
                gemm_gguf._gemm_q4_1_pick(x, qs, d, m, out, chunks)
            elif layout == 1:
                gemm_gguf._gemm_q4_1(x, qs, d, m, out, chunks)
            else:
                gemm_gguf._gemm_q4_1_narrow(x, qs, d, m, out, chunks)
        return q4_table

    def q4(x, qs, d, m, out, chunks, kind, layout):
        if kind == 0:
            if layout == 1:
                gemm_gguf._gemm_q4_0(x, qs, d, m, out, chunks)
            else:
                gemm_gguf._gemm_q4_0_narrow(x, qs, d, m, out, chunks)
        elif layout == 1:
            gemm_gguf._gemm_q4_1(x, qs, d, m, out, chunks)
        else:
            gemm_gguf._gemm_q4_1_narrow(x, qs, d, m, out, chunks)
    return q4


@numba.njit(nogil=True, cache=True)
def decode_layers(h, x, eps, input_norms, post_norms, final_norm, qkv, o, gate_up, down, kinds, layout,
                  widths, chunks, heads, kv_heads, head_dim, cos, sin, row_pos, rope, scale, key_caches, value_caches,
                  slot_block, slot_offset, block_tables, row_seq, window, units, attention_chunks, feature_at,
                  features):
    """Every layer on the stream h [T, hidden] whose first input norm is x;
    returns (h, its final norm). ``features[feature_at[i]]`` gets the stream
    after layer i where feature_at[i] >= 0. The steps and their arguments
    are ``LlamaEngine._decoder_arrays``'s."""
    T = h.shape[0]
    layers = input_norms.shape[0]
    for i in range(layers):
        qkv_out = np.empty((T, widths[0]), np.float32)
        gemm_by(x, qkv[0][i], qkv[1][i], qkv[2][i], qkv_out, chunks, kinds[0], layout)
        q = np.empty((T, heads, head_dim), np.float32)
        kc = key_caches[i]  # [L, ...] -> the layer's
        vc = value_caches[i]
        cpu_ops._rope_scale_write(qkv_out.reshape(T, heads + 2 * kv_heads, head_dim), heads, kv_heads, cos, sin,
                                  row_pos, rope[i], scale, kc, vc, slot_block, slot_offset, q)
        attended = np.empty_like(q)
        if attention_chunks > 1:
            kv_pool._paged_attention_parallel(q, kc, vc, block_tables, row_seq, row_pos, window[i], units,
                                              attention_chunks, attended)
        else:
            kv_pool._paged_attention(q, kc, vc, block_tables, row_seq, row_pos, window[i], units, attended)
        o_out = np.empty((T, widths[1]), np.float32)
        gemm_by(attended.reshape(T, heads * head_dim), o[0][i], o[1][i], o[2][i], o_out, chunks, kinds[1], layout)
        h_next = np.empty_like(h)
        cpu_ops._add_rms_norm(h, o_out, post_norms[i], eps, h_next, x)
        h = h_next
        gate_up_out = np.empty((T, widths[2]), np.float32)
        gemm_by(x, gate_up[0][i], gate_up[1][i], gate_up[2][i], gate_up_out, chunks, kinds[2], layout)
        inner = gate_up_out.shape[1] // 2
        act = np.empty((T, inner), np.float32)
        cpu_ops._silu_mul(gate_up_out, act)
        down_out = np.empty((T, widths[3]), np.float32)
        gemm_by(act, down[0][i], down[1][i], down[2][i], down_out, chunks, kinds[3], layout)
        h_next = np.empty_like(h)
        following = input_norms[i + 1] if i + 1 < layers else final_norm
        cpu_ops._add_rms_norm(h, down_out, following, eps, h_next, x)
        h = h_next
        if feature_at[i] >= 0:
            features[feature_at[i]] = h
    return h, x


kernel_cache.refresh(globals())  # numba keys its cache by this file only: flush it when any kernel source changed
