"""A GEMM that reads a GGUF model's quantised weights as they are in the
file (Q4_1: 4.5 bits a weight, Q8_0: 8.5) and computes, bit for bit, what
``gemm_simd`` computes on the float32 weights the GGUF load dequantises.

Why the same bits. transformers dequantises a GGUF tensor with gguf-py:
Q4_1 ``d * q + m`` (d, m float16 widened to float32, q in 0..15; the
product and then the sum rounded in float32), Q8_0 ``q * d`` (q an int8).
Q4_0 ``d * (q - 8)``. A float16 has an 11-bit significand, so ``d * q``
is exact in float32, and ``fma(d, q, m)`` rounds the same exact sum once,
as the separate add does; Q4_0's and Q8_0's products are exact, computed
as gguf-py writes them (so a zero keeps its sign):
the kernels dequantise each weight in registers to the very float32 value
of the loaded model and then multiply-add it in ``gemm_simd``'s order (one
LANES-lane fused multiply-add per step, lanes reduced by ``simd.total``).
A block of 32 weights is two steps: Q4_1 keeps weights 0..15 in the low 4
bits of its 16 bytes and 16..31 in the high 4 bits, Q8_0 its 32 bytes in
order. So every output of every row is ``gemm_simd``'s on the dequantised
weight, whatever the rows beside it (tested against it bitwise), and the
model served is exactly the one transformers loads: only fewer bytes
stream through memory, which bounds a decode step on a CPU.

Which weights. ``GgufBlocks`` reads a GGUF file's Q4_0, Q4_1 and Q8_0 tensors and
finds a weight's rows among their dequantised rows (the engine fuses
projections, pads some with zero rows, and transformers permutes the rows
of q and k: rows move whole), then checks the blocks found dequantise to
the weight bit for bit. A float32 weight the file holds in another type
(F16, a K-quant: llama.cpp's Q4_0 files keep their output in Q6_K) is read
as simd-l1 reads it, the same bits; a model none of whose weights the file
holds as blocks, or a bfloat16 one, cannot take the path (the selector
refuses it, naming why).

Speed (2 cores of an AMD EPYC, CPU family 26; the throwaway
``/work/exp/s41/q/mb_q.py``: SmolLM2's 30 layers' Q4_1 projections and its
Q8_0 LM head, 115 MB against 538 MB of float32): a one-row pass 4.8 ms
against ``simd-l1``'s 13.1 on the float32 weights, six rows 7.8 against
14.7 (medians of 9, in turns). On AVX-512 CPUs a 4-bit block's 16 possible
values are computed once (the same ``fma``) and each weight picked from them
by its 4 bits (``vpermps``) for one to three rows: 2-3 % faster decode steps
through the engine (throwaway ``/work/exp/s42/ab_pick.py``, paired in one
process: 0.982 at one row, 0.968 at three), and bit for bit the same values;
groups of six rows take three outputs at a time there (``_gemm_table``: no
spilled sums), a six-row pass over SmolLM2's blocks 8.3 ms against 9.6 with
four (2 cores of an Intel Xeon, CPU model 207, AVX512-BF16; README).
On CPUs with 16 vector registers (AVX2: a LANES-lane value takes two) the
four outputs' sums spill, so there ``_gemm_narrow`` takes one or two outputs
at a time (the same sums in the same order): SmolLM2's decode steps through
the engine 0.81x the time of the wide layout as it was (its bytes split
before they were widened), six-row verification 0.59x (2 cores of an AMD
EPYC of CPU family 25 without AVX-512; throwaway ``/work/exp/s43/ab.py``);
the kernels alone against today's wide layout 0.77x at one row, 0.59x at
six (``/work/exp/s43/mb.py``).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numba
import numpy as np
import torch

from specdec.engine import kernel_cache
from specdec.engine.gemm_numba import LAUNCH_LOCK, OUT_BLOCK, set_team
from specdec.engine.gemm_simd import OUTS
from specdec.engine.simd import (
    LANES,
    add,
    half_fma,
    half_load,
    half_store,
    has_permute,
    high_nibbles,
    iota,
    load,
    low_nibbles,
    mac,
    mul,
    pick_high,
    pick_low,
    prefetch_l1,
    signed_bytes,
    splat,
    store,
    total,
    total_of_halves,
    zeros,
)
from specdec.engine.simd import fma as fma_lanes

#: Weights per GGUF block (Q4_0, Q4_1, Q8_0).
BLOCK = 32
#: Rows of a full group (``_rows6``).
GROUP = 6
assert OUT_BLOCK == 3 + 3 + 2, "_gemm_table splits an output block into three, three and two outputs"
#: Rows left after the groups of six -> the launches that take them, in order: no zero rows are added.
#: Each is one launch of the layout ``ROW_LAYOUTS`` names for its row count. The table layout runs four
#: and five rows in one pass (``_rows4_three``, ``_rows5_three``: SmolLM2's layer shapes on one core of
#: an Intel Xeon, CPU model 207, ``benchmarks/bench_gemm_ceiling.py --rows 1,2,3,4,5,6``: 2.29x / 2.52x
#: a one-row pass as three rows and then the rest, against 2.30x for six); the wide and narrow layouts
#: take them as three and the rest, not six with zero rows (2 cores of an AMD EPYC of CPU family 25,
#: SmolLM2's 211 quantised tensors, medians of 15 in three rounds, ``/work/exp/s48/mb2.py``: four rows
#: 15.9 ms against 16.6, five 16.5 against 19.9; two rows 7.7 against 9.6 padded to three, one 6.2,
#: three 8.9, six 15.5 against 17.6 as three and three).
TAIL_PARTS = ((), (1,), (2,), (3,), (4,), (5,))
#: How far ahead (bytes of quants, flat) the next blocks are prefetched into L1.
PREFETCH_AHEAD = 1024
#: From this many rows in groups of six (a prompt's prefill, a large batch) ``_gemm_narrow`` dequantises
#: each block of OUT_BLOCK outputs once into a scratch and runs every group from it (``_scratch_groups``).
#: The engine's forward against the groups run by ``_rows6_one`` (SmolLM2, 2 cores of an AMD EPYC of CPU
#: family 25, AVX2; ``benchmarks/bench_prefill.py --baseline-src``, paired in turns, three runs): a 57-token
#: prefill 1.15-1.26x as fast, 200 tokens 1.09-1.16x, a decode step of 18 sequences 1.04-1.13x, of 32
#: 1.04-1.17x; of 12 (two groups, which do not pay for filling the scratch: 0.95-0.98x in a first try)
#: the paths left as they were read 0.98-1.04x, the machine's noise.
SCRATCH_ROWS = 3 * GROUP
#: Inputs a scratch pass takes at a time: six rows' inputs and OUT_BLOCK outputs' weights of them stay in L1.
SCRATCH_K = 512
#: GGUF tensor types read (gguf.GGMLQuantizationType names) -> bytes per block.
KINDS = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


@dataclass(frozen=True)
class QuantWeight:
    """A weight [out, in] as GGUF blocks, out padded to OUT_BLOCK with zero
    blocks: Q4_0 and Q4_1 ``qs`` uint8 [out, in / 2] (16 bytes a block),
    Q8_0 int8 [out, in]; ``d`` (and Q4_1's ``m``) float32 [out, in / 32]."""

    kind: str
    qs: np.ndarray
    d: np.ndarray
    m: np.ndarray  # Q4_0, Q8_0: [1, 1] zeros (unused)
    out_features: int  # before padding

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + self.d.nbytes + (self.m.nbytes if self.kind == "Q4_1" else 0)

    def dequantized(self) -> np.ndarray:
        """float32 [out, in] as gguf-py dequantises (unpadded; ``_dequantize``)."""
        out = np.empty((self.out_features, self.d.shape[1] * BLOCK), np.float32)
        _dequantize(KIND_CODES[self.kind], self.qs, self.d, self.m, out)
        return out


#: ``_dequantize``'s codes of the kinds.
KIND_CODES = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}


def quantize(weight: np.ndarray, kind: str) -> QuantWeight:
    """A float32 weight [out, in] (in a multiple of BLOCK) as `kind` blocks
    (Q8_0, Q4_1, Q4_0), quantised by gguf-py (bit for bit llama.cpp's
    reference quantisers), out padded to OUT_BLOCK with zero blocks. For
    weights no file holds as blocks (a feature head's projections): fewer
    bytes for a GEMM to read, not the same values (``dequantized()`` gives
    the ones it computes with)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    if kind not in KINDS:
        raise ValueError(f"quantize: one of {', '.join(KINDS)}, not {kind!r}")
    w = np.asarray(weight, np.float32)
    if w.ndim != 2 or w.shape[1] % BLOCK:
        raise ValueError(f"quantize: a 2-D weight of whole {BLOCK}-value blocks, not {w.shape}")
    padded = np.zeros((-(-w.shape[0] // OUT_BLOCK) * OUT_BLOCK, w.shape[1]), np.float32)
    padded[:w.shape[0]] = w
    raw = gguf_quantize(padded, GGMLQuantizationType[kind])  # uint8 [rows, blocks * bytes]
    q = GgufBlocks._weight(kind, raw, np.arange(len(padded)))
    return QuantWeight(kind, q.qs, q.d, q.m, w.shape[0])


@numba.njit(nogil=True, cache=True)
def _dequantize_row(kind, qs, d, m, r, out):
    """Row r of blocks as gguf-py dequantises it, into out (float32 [in]):
    Q4_1 ``d * q + m``, Q4_0 ``d * (q - 8)``, Q8_0 ``q * d``, each product
    exact in float32 (module doc), so no order of operations changes a bit."""
    for b in range(d.shape[1]):
        scale = d[r, b]
        k = b * BLOCK
        if kind == 2:
            for j in range(BLOCK):
                out[k + j] = np.float32(qs[r, k + j]) * scale
        else:
            low = m[r, b] if kind == 1 else np.float32(0.0)
            for j in range(16):
                byte = qs[r, b * 16 + j]
                q0, q1 = np.float32(byte & 15), np.float32(byte >> 4)
                if kind == 1:
                    out[k + j], out[k + 16 + j] = scale * q0 + low, scale * q1 + low
                else:
                    out[k + j] = scale * (q0 - np.float32(8.0))
                    out[k + 16 + j] = scale * (q1 - np.float32(8.0))


@numba.njit(nogil=True, cache=True)
def _dequantize(kind, qs, d, m, out):
    """out (float32 [rows, in]) = the first rows of the blocks, dequantised (``_dequantize_row``)."""
    for r in range(out.shape[0]):
        _dequantize_row(kind, qs, d, m, r, out[r])


@numba.njit(nogil=True, cache=True, parallel=True)
def _first_difference(kind, qs, d, m, want, chunks):
    """The first row of want (float32 [rows, in]) whose bits the blocks'
    row does not dequantise to, or -1 (a row at a time: no copy of the
    whole; the rows split into `chunks` ranges run in parallel)."""
    rows = want.shape[0]
    per = (rows + chunks - 1) // chunks
    firsts = np.full(chunks, -1, np.int64)
    for c in numba.prange(chunks):
        row = np.empty(want.shape[1], np.float32)
        for r in range(c * per, min(rows, (c + 1) * per)):
            _dequantize_row(kind, qs, d, m, r, row)
            if not np.array_equal(row.view(np.uint32), want[r].view(np.uint32)):
                firsts[c] = r
                break
    for c in range(chunks):
        if firsts[c] >= 0:
            return firsts[c]
    return -1


@numba.njit(nogil=True, cache=True)
def _key_row(bits, salt, keys, r):
    """keys[r] = two salted sums (mod 2^64) of a row's float32 bit patterns."""
    k0 = np.uint64(0)
    k1 = np.uint64(0)
    for j in range(bits.shape[0]):
        v = np.uint64(bits[j])
        k0 += v * salt[0, j]
        k1 += v * salt[1, j]
    keys[r, 0], keys[r, 1] = k0, k1


@numba.njit(nogil=True, cache=True, parallel=True)
def _keys_of_rows(rows, salt, keys, chunks):
    """keys [R, 2] of float32 rows [R, in] (``_key_row``; `chunks` ranges of rows in parallel)."""
    count = rows.shape[0]
    per = (count + chunks - 1) // chunks
    for c in numba.prange(chunks):
        for r in range(c * per, min(count, (c + 1) * per)):
            _key_row(rows[r].view(np.uint32), salt, keys, r)


@numba.njit(nogil=True, cache=True, parallel=True)
def _keys_of_blocks(kind, qs, d, m, salt, keys, chunks):
    """keys [R, 2] of the blocks' rows as dequantised (``_key_row`` of
    ``_dequantize_row``'s values), a row at a time, `chunks` ranges of rows
    in parallel."""
    count = keys.shape[0]
    per = (count + chunks - 1) // chunks
    for c in numba.prange(chunks):
        row = np.empty(d.shape[1] * BLOCK, np.float32)
        for r in range(c * per, min(count, (c + 1) * per)):
            _dequantize_row(kind, qs, d, m, r, row)
            _key_row(row.view(np.uint32), salt, keys, r)


def _on_threads(kernel, *args):
    """Runs a row-chunked kernel (``_keys_of_rows``, ``_keys_of_blocks``,
    ``_first_difference``) as one chunk per thread torch runs on (the
    runner's ``--threads``); every row's result is the same at any count."""
    chunks = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    with LAUNCH_LOCK:
        set_team(chunks)
        return kernel(*args, chunks)


# ---- kernels ----------------------------------------------------------------------


@numba.njit(nogil=True, cache=True, inline="always")
def _q4_1(qs, d, m, o, b):
    """Output o's weights of block b, dequantised: (values 0..15, 16..31)."""
    i = (o * d.shape[1] + b) * 16
    scale, low = splat(d[o, b]), splat(m[o, b])
    prefetch_l1(qs, i + PREFETCH_AHEAD)
    return fma_lanes(low, scale, low_nibbles(qs, i)), fma_lanes(low, scale, high_nibbles(qs, i))


@numba.njit(nogil=True, cache=True, inline="always")
def _q4_0(qs, d, m, o, b):
    """Output o's weights of block b, dequantised as gguf-py does, ``d * (q -
    8)`` (exact; a zero keeps the sign d gives it): (values 0..15, 16..31)."""
    i = (o * d.shape[1] + b) * 16
    scale, eight = splat(d[o, b]), splat(np.float32(-8.0))
    prefetch_l1(qs, i + PREFETCH_AHEAD)
    return mul(add(low_nibbles(qs, i), eight), scale), mul(add(high_nibbles(qs, i), eight), scale)


@numba.njit(nogil=True, cache=True, inline="always")
def _q4_1_pick(qs, d, m, o, b):
    """``_q4_1``'s values by table: the block's 16 values ``fma(d, q, m)``
    (q = 0..15, the same roundings) computed once, each weight picked from
    them by its 4 bits (``has_permute`` CPUs)."""
    i = (o * d.shape[1] + b) * 16
    table = fma_lanes(splat(m[o, b]), splat(d[o, b]), iota())
    prefetch_l1(qs, i + PREFETCH_AHEAD)
    return pick_low(table, qs, i), pick_high(table, qs, i)


@numba.njit(nogil=True, cache=True, inline="always")
def _q4_0_pick(qs, d, m, o, b):
    """``_q4_0``'s values by table (``_q4_1_pick``'s way): ``d * (q - 8)``
    for q = 0..15, computed once."""
    i = (o * d.shape[1] + b) * 16
    table = mul(add(iota(), splat(np.float32(-8.0))), splat(d[o, b]))
    prefetch_l1(qs, i + PREFETCH_AHEAD)
    return pick_low(table, qs, i), pick_high(table, qs, i)


@numba.njit(nogil=True, cache=True, inline="always")
def _q8_0(qs, d, m, o, b):
    """Output o's weights of block b, dequantised: (values 0..15, 16..31)."""
    i = (o * d.shape[1] + b) * 32
    scale = splat(d[o, b])
    prefetch_l1(qs, i + PREFETCH_AHEAD)
    return mul(signed_bytes(qs, i), scale), mul(signed_bytes(qs, i + 16), scale)


@numba.njit(nogil=True, cache=True, inline="always")
def _rows1(x, qs, d, m, out, o, r, block):
    """out[r, o:o+4] = x[r] @ the four outputs' weights, summed as gemm_simd sums."""
    n = x.shape[1]
    xr = r * n
    a0 = a1 = a2 = a3 = zeros()
    for b in range(d.shape[1]):
        k = xr + b * 32
        l0, h0 = block(qs, d, m, o, b)
        l1, h1 = block(qs, d, m, o + 1, b)
        l2, h2 = block(qs, d, m, o + 2, b)
        l3, h3 = block(qs, d, m, o + 3, b)
        u = load(x, k)
        a0, a1, a2, a3 = mac(a0, u, l0), mac(a1, u, l1), mac(a2, u, l2), mac(a3, u, l3)
        u = load(x, k + 16)
        a0, a1, a2, a3 = mac(a0, u, h0), mac(a1, u, h1), mac(a2, u, h2), mac(a3, u, h3)
    out[r, o], out[r, o + 1], out[r, o + 2], out[r, o + 3] = total(a0), total(a1), total(a2), total(a3)


@numba.njit(nogil=True, cache=True, inline="always")
def _rows2(x, qs, d, m, out, o, r, block):
    """out[r:r+2, o:o+4], each output summed as ``_rows1`` sums it."""
    n = x.shape[1]
    x0, x1 = r * n, (r + 1) * n
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = zeros()
    for b in range(d.shape[1]):
        l0, h0 = block(qs, d, m, o, b)
        l1, h1 = block(qs, d, m, o + 1, b)
        l2, h2 = block(qs, d, m, o + 2, b)
        l3, h3 = block(qs, d, m, o + 3, b)
        for k, v0, v1, v2, v3 in ((b * 32, l0, l1, l2, l3), (b * 32 + 16, h0, h1, h2, h3)):
            u = load(x, x0 + k)
            a00, a01, a02, a03 = mac(a00, u, v0), mac(a01, u, v1), mac(a02, u, v2), mac(a03, u, v3)
            u = load(x, x1 + k)
            a10, a11, a12, a13 = mac(a10, u, v0), mac(a11, u, v1), mac(a12, u, v2), mac(a13, u, v3)
    out[r, o], out[r, o + 1], out[r, o + 2], out[r, o + 3] = total(a00), total(a01), total(a02), total(a03)
    out[r + 1, o], out[r + 1, o + 1], out[r + 1, o + 2], out[r + 1, o + 3] = \
        total(a10), total(a11), total(a12), total(a13)


@numba.njit(nogil=True, cache=True, inline="always")
def _rows3(x, qs, d, m, out, o, r, block):
    """out[r:r+3, o:o+4], each output summed as ``_rows1`` sums it."""
    n = x.shape[1]
    x0, x1, x2 = r * n, (r + 1) * n, (r + 2) * n
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = a20 = a21 = a22 = a23 = zeros()
    for b in range(d.shape[1]):
        l0, h0 = block(qs, d, m, o, b)
        l1, h1 = block(qs, d, m, o + 1, b)
        l2, h2 = block(qs, d, m, o + 2, b)
        l3, h3 = block(qs, d, m, o + 3, b)
        for k, v0, v1, v2, v3 in ((b * 32, l0, l1, l2, l3), (b * 32 + 16, h0, h1, h2, h3)):
            u = load(x, x0 + k)
            a00, a01, a02, a03 = mac(a00, u, v0), mac(a01, u, v1), mac(a02, u, v2), mac(a03, u, v3)
            u = load(x, x1 + k)
            a10, a11, a12, a13 = mac(a10, u, v0), mac(a11, u, v1), mac(a12, u, v2), mac(a13, u, v3)
            u = load(x, x2 + k)
            a20, a21, a22, a23 = mac(a20, u, v0), mac(a21, u, v1), mac(a22, u, v2), mac(a23, u, v3)
    out[r, o], out[r, o + 1], out[r, o + 2], out[r, o + 3] = total(a00), total(a01), total(a02), total(a03)
    out[r + 1, o], out[r + 1, o + 1], out[r + 1, o + 2], out[r + 1, o + 3] = \
        total(a10), total(a11), total(a12), total(a13)
    out[r + 2, o], out[r + 2, o + 1], out[r + 2, o + 2], out[r + 2, o + 3] = \
        total(a20), total(a21), total(a22), total(a23)


@numba.njit(nogil=True, cache=True, inline="always")
def _rows6(x, qs, d, m, out, o, r, block):
    """out[r:r+6, o:o+4], each output summed as ``_rows1`` sums it; the
    blocks dequantised once for the six rows."""
    n = x.shape[1]
    x0, x1, x2, x3, x4, x5 = r * n, (r + 1) * n, (r + 2) * n, (r + 3) * n, (r + 4) * n, (r + 5) * n
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = a20 = a21 = a22 = a23 = zeros()
    a30 = a31 = a32 = a33 = a40 = a41 = a42 = a43 = a50 = a51 = a52 = a53 = zeros()
    for b in range(d.shape[1]):
        l0, h0 = block(qs, d, m, o, b)
        l1, h1 = block(qs, d, m, o + 1, b)
        l2, h2 = block(qs, d, m, o + 2, b)
        l3, h3 = block(qs, d, m, o + 3, b)
        for k, v0, v1, v2, v3 in ((b * 32, l0, l1, l2, l3), (b * 32 + 16, h0, h1, h2, h3)):
            u = load(x, x0 + k)
            a00, a01, a02, a03 = mac(a00, u, v0), mac(a01, u, v1), mac(a02, u, v2), mac(a03, u, v3)
            u = load(x, x1 + k)
            a10, a11, a12, a13 = mac(a10, u, v0), mac(a11, u, v1), mac(a12, u, v2), mac(a13, u, v3)
            u = load(x, x2 + k)
            a20, a21, a22, a23 = mac(a20, u, v0), mac(a21, u, v1), mac(a22, u, v2), mac(a23, u, v3)
            u = load(x, x3 + k)
            a30, a31, a32, a33 = mac(a30, u, v0), mac(a31, u, v1), mac(a32, u, v2), mac(a33, u, v3)
            u = load(x, x4 + k)
            a40, a41, a42, a43 = mac(a40, u, v0), mac(a41, u, v1), mac(a42, u, v2), mac(a43, u, v3)
            u = load(x, x5 + k)
            a50, a51, a52, a53 = mac(a50, u, v0), mac(a51, u, v1), mac(a52, u, v2), mac(a53, u, v3)
    out[r, o], out[r, o + 1], out[r, o + 2], out[r, o + 3] = total(a00), total(a01), total(a02), total(a03)
    out[r + 1, o], out[r + 1, o + 1], out[r + 1, o + 2], out[r + 1, o + 3] = \
        total(a10), total(a11), total(a12), total(a13)
    out[r + 2, o], out[r + 2, o + 1], out[r + 2, o + 2], out[r + 2, o + 3] = \
        total(a20), total(a21), total(a22), total(a23)
    out[r + 3, o], out[r + 3, o + 1], out[r + 3, o + 2], out[r + 3, o + 3] = \
        total(a30), total(a31), total(a32), total(a33)
    out[r + 4, o], out[r + 4, o + 1], out[r + 4, o + 2], out[r + 4, o + 3] = \
        total(a40), total(a41), total(a42), total(a43)
    out[r + 5, o], out[r + 5, o + 1], out[r + 5, o + 2], out[r + 5, o + 3] = \
        total(a50), total(a51), total(a52), total(a53)


@numba.njit(nogil=True, cache=True, inline="always")
def _rows6_three(x, qs, d, m, out, o, r, block):
    """out[r:r+6, o:o+3], each output summed as ``_rows1`` sums it (the
    table layout's groups: 18 sums, three outputs' blocks and an input fit
    32 vector registers, where ``_rows6``'s 24 sums beside its blocks spill)."""
    n = x.shape[1]
    x0, x1, x2, x3, x4, x5 = r * n, (r + 1) * n, (r + 2) * n, (r + 3) * n, (r + 4) * n, (r + 5) * n
    a00 = a01 = a02 = a10 = a11 = a12 = a20 = a21 = a22 = zeros()
    a30 = a31 = a32 = a40 = a41 = a42 = a50 = a51 = a52 = zeros()
    for b in range(d.shape[1]):
        l0, h0 = block(qs, d, m, o, b)
        l1, h1 = block(qs, d, m, o + 1, b)
        l2, h2 = block(qs, d, m, o + 2, b)
        for k, v0, v1, v2 in ((b * 32, l0, l1, l2), (b * 32 + 16, h0, h1, h2)):
            u = load(x, x0 + k)
            a00, a01, a02 = mac(a00, u, v0), mac(a01, u, v1), mac(a02, u, v2)
            u = load(x, x1 + k)
            a10, a11, a12 = mac(a10, u, v0), mac(a11, u, v1), mac(a12, u, v2)
            u = load(x, x2 + k)
            a20, a21, a22 = mac(a20, u, v0), mac(a21, u, v1), mac(a22, u, v2)
            u = load(x, x3 + k)
            a30, a31, a32 = mac(a30, u, v0), mac(a31, u, v1), mac(a32, u, v2)
            u = load(x, x4 + k)
            a40, a41, a42 = mac(a40, u, v0), mac(a41, u, v1), mac(a42, u, v2)
            u = load(x, x5 + k)
            a50, a51, a52 = mac(a50, u, v0), mac(a51, u, v1), mac(a52, u, v2)
    out[r, o], out[r, o + 1], out[r, o + 2] = total(a00), total(a01), total(a02)
    out[r + 1, o], out[r + 1, o + 1], out[r + 1, o + 2] = total(a10), total(a11), total(a12)
    out[r + 2, o], out[r + 2, o + 1], out[r + 2, o + 2] = total(a20), total(a21), total(a22)
    out[r + 3, o], out[r + 3, o + 1], out[r + 3, o + 2] = total(a30), total(a31), total(a32)
    out[r + 4, o], out[r + 4, o + 1], out[r + 4, o + 2] = total(a40), total(a41), total(a42)
    out[r + 5, o], out[r + 5, o + 1], out[r + 5, o + 2] = total(a50), total(a51), total(a52)


@numba.njit(nogil=True, cache=True, inline="always")
def _rows6_two(x, qs, d, m, out, o, r, block):
    """out[r:r+6, o:o+2], each output summed as ``_rows1`` sums it (the
    table layout's last two outputs of an output block)."""
    n = x.shape[1]
    x0, x1, x2, x3, x4, x5 = r * n, (r + 1) * n, (r + 2) * n, (r + 3) * n, (r + 4) * n, (r + 5) * n
    a00 = a01 = a10 = a11 = a20 = a21 = a30 = a31 = a40 = a41 = a50 = a51 = zeros()
    for b in range(d.shape[1]):
        l0, h0 = block(qs, d, m, o, b)
        l1, h1 = block(qs, d, m, o + 1, b)
        for k, v0, v1 in ((b * 32, l0, l1), (b * 32 + 16, h0, h1)):
            u = load(x, x0 + k)
            a00, a01 = mac(a00, u, v0), mac(a01, u, v1)
            u = load(x, x1 + k)
            a10, a11 = mac(a10, u, v0), mac(a11, u, v1)
            u = load(x, x2 + k)
            a20, a21 = mac(a20, u, v0), mac(a21, u, v1)
            u = load(x, x3 + k)
            a30, a31 = mac(a30, u, v0), mac(a31, u, v1)
            u = load(x, x4 + k)
            a40, a41 = mac(a40, u, v0), mac(a41, u, v1)
            u = load(x, x5 + k)
            a50, a51 = mac(a50, u, v0), mac(a51, u, v1)
    out[r, o], out[r, o + 1] = total(a00), total(a01)
    out[r + 1, o], out[r + 1, o + 1] = total(a10), total(a11)
    out[r + 2, o], out[r + 2, o + 1] = total(a20), total(a21)
    out[r + 3, o], out[r + 3, o + 1] = total(a30), total(a31)
    out[r + 4, o], out[r + 4, o + 1] = total(a40), total(a41)
    out[r + 5, o], out[r + 5, o + 1] = total(a50), total(a51)


@numba.njit(nogil=True, cache=True, inline="always")
def _rows4_three(x, qs, d, m, out, o, r, block):
    """out[r:r+4, o:o+3], each output summed as ``_rows1`` sums it (the
    table layout's four rows: a k = 3 verification, or four left after the
    groups of six; one pass over the blocks, where three rows and then one
    took two)."""
    n = x.shape[1]
    x0, x1, x2, x3 = r * n, (r + 1) * n, (r + 2) * n, (r + 3) * n
    a00 = a01 = a02 = a10 = a11 = a12 = zeros()
    a20 = a21 = a22 = a30 = a31 = a32 = zeros()
    for b in range(d.shape[1]):
        l0, h0 = block(qs, d, m, o, b)
        l1, h1 = block(qs, d, m, o + 1, b)
        l2, h2 = block(qs, d, m, o + 2, b)
        for k, v0, v1, v2 in ((b * 32, l0, l1, l2), (b * 32 + 16, h0, h1, h2)):
            u = load(x, x0 + k)
            a00, a01, a02 = mac(a00, u, v0), mac(a01, u, v1), mac(a02, u, v2)
            u = load(x, x1 + k)
            a10, a11, a12 = mac(a10, u, v0), mac(a11, u, v1), mac(a12, u, v2)
            u = load(x, x2 + k)
            a20, a21, a22 = mac(a20, u, v0), mac(a21, u, v1), mac(a22, u, v2)
            u = load(x, x3 + k)
            a30, a31, a32 = mac(a30, u, v0), mac(a31, u, v1), mac(a32, u, v2)
    out[r, o], out[r, o + 1], out[r, o + 2] = total(a00), total(a01), total(a02)
    out[r + 1, o], out[r + 1, o + 1], out[r + 1, o + 2] = total(a10), total(a11), total(a12)
    out[r + 2, o], out[r + 2, o + 1], out[r + 2, o + 2] = total(a20), total(a21), total(a22)
    out[r + 3, o], out[r + 3, o + 1], out[r + 3, o + 2] = total(a30), total(a31), total(a32)


@numba.njit(nogil=True, cache=True, inline="always")
def _rows4_two(x, qs, d, m, out, o, r, block):
    """out[r:r+4, o:o+2], each output summed as ``_rows1`` sums it (the
    table layout's last two outputs of an output block at four rows)."""
    n = x.shape[1]
    x0, x1, x2, x3 = r * n, (r + 1) * n, (r + 2) * n, (r + 3) * n
    a00 = a01 = a10 = a11 = zeros()
    a20 = a21 = a30 = a31 = zeros()
    for b in range(d.shape[1]):
        l0, h0 = block(qs, d, m, o, b)
        l1, h1 = block(qs, d, m, o + 1, b)
        for k, v0, v1 in ((b * 32, l0, l1), (b * 32 + 16, h0, h1)):
            u = load(x, x0 + k)
            a00, a01 = mac(a00, u, v0), mac(a01, u, v1)
            u = load(x, x1 + k)
            a10, a11 = mac(a10, u, v0), mac(a11, u, v1)
            u = load(x, x2 + k)
            a20, a21 = mac(a20, u, v0), mac(a21, u, v1)
            u = load(x, x3 + k)
            a30, a31 = mac(a30, u, v0), mac(a31, u, v1)
    out[r, o], out[r, o + 1] = total(a00), total(a01)
    out[r + 1, o], out[r + 1, o + 1] = total(a10), total(a11)
    out[r + 2, o], out[r + 2, o + 1] = total(a20), total(a21)
    out[r + 3, o], out[r + 3, o + 1] = total(a30), total(a31)


@numba.njit(nogil=True, cache=True, inline="always")
def _rows5_three(x, qs, d, m, out, o, r, block):
    """out[r:r+5, o:o+3], each output summed as ``_rows1`` sums it (the
    table layout's five rows: a k = 4 verification, or five left after the
    groups of six; one pass over the blocks, where three rows and then two
    took two)."""
    n = x.shape[1]
    x0, x1, x2, x3, x4 = r * n, (r + 1) * n, (r + 2) * n, (r + 3) * n, (r + 4) * n
    a00 = a01 = a02 = a10 = a11 = a12 = a20 = a21 = zeros()
    a22 = a30 = a31 = a32 = a40 = a41 = a42 = zeros()
    for b in range(d.shape[1]):
        l0, h0 = block(qs, d, m, o, b)
        l1, h1 = block(qs, d, m, o + 1, b)
        l2, h2 = block(qs, d, m, o + 2, b)
        for k, v0, v1, v2 in ((b * 32, l0, l1, l2), (b * 32 + 16, h0, h1, h2)):
            u = load(x, x0 + k)
            a00, a01, a02 = mac(a00, u, v0), mac(a01, u, v1), mac(a02, u, v2)
            u = load(x, x1 + k)
            a10, a11, a12 = mac(a10, u, v0), mac(a11, u, v1), mac(a12, u, v2)
            u = load(x, x2 + k)
            a20, a21, a22 = mac(a20, u, v0), mac(a21, u, v1), mac(a22, u, v2)
            u = load(x, x3 + k)
            a30, a31, a32 = mac(a30, u, v0), mac(a31, u, v1), mac(a32, u, v2)
            u = load(x, x4 + k)
            a40, a41, a42 = mac(a40, u, v0), mac(a41, u, v1), mac(a42, u, v2)
    out[r, o], out[r, o + 1], out[r, o + 2] = total(a00), total(a01), total(a02)
    out[r + 1, o], out[r + 1, o + 1], out[r + 1, o + 2] = total(a10), total(a11), total(a12)
    out[r + 2, o], out[r + 2, o + 1], out[r + 2, o + 2] = total(a20), total(a21), total(a22)
    out[r + 3, o], out[r + 3, o + 1], out[r + 3, o + 2] = total(a30), total(a31), total(a32)
    out[r + 4, o], out[r + 4, o + 1], out[r + 4, o + 2] = total(a40), total(a41), total(a42)


@numba.njit(nogil=True, cache=True, inline="always")
def _rows5_two(x, qs, d, m, out, o, r, block):
    """out[r:r+5, o:o+2], each output summed as ``_rows1`` sums it (the
    table layout's last two outputs of an output block at five rows)."""
    n = x.shape[1]
    x0, x1, x2, x3, x4 = r * n, (r + 1) * n, (r + 2) * n, (r + 3) * n, (r + 4) * n
    a00 = a01 = a10 = a11 = a20 = zeros()
    a21 = a30 = a31 = a40 = a41 = zeros()
    for b in range(d.shape[1]):
        l0, h0 = block(qs, d, m, o, b)
        l1, h1 = block(qs, d, m, o + 1, b)
        for k, v0, v1 in ((b * 32, l0, l1), (b * 32 + 16, h0, h1)):
            u = load(x, x0 + k)
            a00, a01 = mac(a00, u, v0), mac(a01, u, v1)
            u = load(x, x1 + k)
            a10, a11 = mac(a10, u, v0), mac(a11, u, v1)
            u = load(x, x2 + k)
            a20, a21 = mac(a20, u, v0), mac(a21, u, v1)
            u = load(x, x3 + k)
            a30, a31 = mac(a30, u, v0), mac(a31, u, v1)
            u = load(x, x4 + k)
            a40, a41 = mac(a40, u, v0), mac(a41, u, v1)
    out[r, o], out[r, o + 1] = total(a00), total(a01)
    out[r + 1, o], out[r + 1, o + 1] = total(a10), total(a11)
    out[r + 2, o], out[r + 2, o + 1] = total(a20), total(a21)
    out[r + 3, o], out[r + 3, o + 1] = total(a30), total(a31)
    out[r + 4, o], out[r + 4, o + 1] = total(a40), total(a41)


@numba.njit(nogil=True, cache=True, inline="always")
def _rows7_three(x, qs, d, m, out, o, r, block):
    """out[r:r+7, o:o+3], each output summed as ``_rows1`` sums it (the
    table layout's last group of six with the one row after it: one pass over the
    blocks, where six rows and then one took two)."""
    n = x.shape[1]
    x0, x1, x2, x3 = r * n, (r + 1) * n, (r + 2) * n, (r + 3) * n
    x4, x5, x6 = (r + 4) * n, (r + 5) * n, (r + 6) * n
    a00 = a01 = a02 = a10 = a11 = a12 = a20 = a21 = zeros()
    a22 = a30 = a31 = a32 = a40 = a41 = a42 = a50 = zeros()
    a51 = a52 = a60 = a61 = a62 = zeros()
    for b in range(d.shape[1]):
        l0, h0 = block(qs, d, m, o, b)
        l1, h1 = block(qs, d, m, o + 1, b)
        l2, h2 = block(qs, d, m, o + 2, b)
        for k, v0, v1, v2 in ((b * 32, l0, l1, l2), (b * 32 + 16, h0, h1, h2)):
            u = load(x, x0 + k)
            a00, a01, a02 = mac(a00, u, v0), mac(a01, u, v1), mac(a02, u, v2)
            u = load(x, x1 + k)
            a10, a11, a12 = mac(a10, u, v0), mac(a11, u, v1), mac(a12, u, v2)
            u = load(x, x2 + k)
            a20, a21, a22 = mac(a20, u, v0), mac(a21, u, v1), mac(a22, u, v2)
            u = load(x, x3 + k)
            a30, a31, a32 = mac(a30, u, v0), mac(a31, u, v1), mac(a32, u, v2)
            u = load(x, x4 + k)
            a40, a41, a42 = mac(a40, u, v0), mac(a41, u, v1), mac(a42, u, v2)
            u = load(x, x5 + k)
            a50, a51, a52 = mac(a50, u, v0), mac(a51, u, v1), mac(a52, u, v2)
            u = load(x, x6 + k)
            a60, a61, a62 = mac(a60, u, v0), mac(a61, u, v1), mac(a62, u, v2)
    out[r, o], out[r, o + 1], out[r, o + 2] = total(a00), total(a01), total(a02)
    out[r + 1, o], out[r + 1, o + 1], out[r + 1, o + 2] = total(a10), total(a11), total(a12)
    out[r + 2, o], out[r + 2, o + 1], out[r + 2, o + 2] = total(a20), total(a21), total(a22)
    out[r + 3, o], out[r + 3, o + 1], out[r + 3, o + 2] = total(a30), total(a31), total(a32)
    out[r + 4, o], out[r + 4, o + 1], out[r + 4, o + 2] = total(a40), total(a41), total(a42)
    out[r + 5, o], out[r + 5, o + 1], out[r + 5, o + 2] = total(a50), total(a51), total(a52)
    out[r + 6, o], out[r + 6, o + 1], out[r + 6, o + 2] = total(a60), total(a61), total(a62)


@numba.njit(nogil=True, cache=True, inline="always")
def _rows7_two(x, qs, d, m, out, o, r, block):
    """out[r:r+7, o:o+2], each output summed as ``_rows1`` sums it (the
    table layout's last two outputs of an output block at seven rows)."""
    n = x.shape[1]
    x0, x1, x2, x3 = r * n, (r + 1) * n, (r + 2) * n, (r + 3) * n
    x4, x5, x6 = (r + 4) * n, (r + 5) * n, (r + 6) * n
    a00 = a01 = a10 = a11 = a20 = a21 = a30 = a31 = zeros()
    a40 = a41 = a50 = a51 = a60 = a61 = zeros()
    for b in range(d.shape[1]):
        l0, h0 = block(qs, d, m, o, b)
        l1, h1 = block(qs, d, m, o + 1, b)
        for k, v0, v1 in ((b * 32, l0, l1), (b * 32 + 16, h0, h1)):
            u = load(x, x0 + k)
            a00, a01 = mac(a00, u, v0), mac(a01, u, v1)
            u = load(x, x1 + k)
            a10, a11 = mac(a10, u, v0), mac(a11, u, v1)
            u = load(x, x2 + k)
            a20, a21 = mac(a20, u, v0), mac(a21, u, v1)
            u = load(x, x3 + k)
            a30, a31 = mac(a30, u, v0), mac(a31, u, v1)
            u = load(x, x4 + k)
            a40, a41 = mac(a40, u, v0), mac(a41, u, v1)
            u = load(x, x5 + k)
            a50, a51 = mac(a50, u, v0), mac(a51, u, v1)
            u = load(x, x6 + k)
            a60, a61 = mac(a60, u, v0), mac(a61, u, v1)
    out[r, o], out[r, o + 1] = total(a00), total(a01)
    out[r + 1, o], out[r + 1, o + 1] = total(a10), total(a11)
    out[r + 2, o], out[r + 2, o + 1] = total(a20), total(a21)
    out[r + 3, o], out[r + 3, o + 1] = total(a30), total(a31)
    out[r + 4, o], out[r + 4, o + 1] = total(a40), total(a41)
    out[r + 5, o], out[r + 5, o + 1] = total(a50), total(a51)
    out[r + 6, o], out[r + 6, o + 1] = total(a60), total(a61)


@numba.njit(nogil=True, cache=True, inline="always")
def _rows1_two(x, qs, d, m, out, o, r, block):
    """out[r, o:o+2], each output summed as ``_rows1`` sums it (the
    narrow layout: two outputs' blocks and sums fit 16 vector registers)."""
    xr = r * x.shape[1]
    a0 = a1 = zeros()
    for b in range(d.shape[1]):
        k = xr + b * 32
        l0, h0 = block(qs, d, m, o, b)
        l1, h1 = block(qs, d, m, o + 1, b)
        u = load(x, k)
        a0, a1 = mac(a0, u, l0), mac(a1, u, l1)
        u = load(x, k + 16)
        a0, a1 = mac(a0, u, h0), mac(a1, u, h1)
    out[r, o], out[r, o + 1] = total(a0), total(a1)


@numba.njit(nogil=True, cache=True, inline="always")
def _rows2_one(x, qs, d, m, out, o, r, block):
    """out[r:r+2, o], each summed as ``_rows1`` sums it (the narrow layout)."""
    n = x.shape[1]
    x0, x1 = r * n, (r + 1) * n
    a0 = a1 = zeros()
    for b in range(d.shape[1]):
        low, high = block(qs, d, m, o, b)
        k = b * 32
        a0, a1 = mac(a0, load(x, x0 + k), low), mac(a1, load(x, x1 + k), low)
        k += 16
        a0, a1 = mac(a0, load(x, x0 + k), high), mac(a1, load(x, x1 + k), high)
    out[r, o], out[r + 1, o] = total(a0), total(a1)


@numba.njit(nogil=True, cache=True, inline="always")
def _rows3_one(x, qs, d, m, out, o, r, block):
    """out[r:r+3, o], each summed as ``_rows1`` sums it (the narrow layout)."""
    n = x.shape[1]
    x0, x1, x2 = r * n, (r + 1) * n, (r + 2) * n
    a0 = a1 = a2 = zeros()
    for b in range(d.shape[1]):
        low, high = block(qs, d, m, o, b)
        k = b * 32
        a0, a1, a2 = mac(a0, load(x, x0 + k), low), mac(a1, load(x, x1 + k), low), mac(a2, load(x, x2 + k), low)
        k += 16
        a0, a1, a2 = mac(a0, load(x, x0 + k), high), mac(a1, load(x, x1 + k), high), mac(a2, load(x, x2 + k), high)
    out[r, o], out[r + 1, o], out[r + 2, o] = total(a0), total(a1), total(a2)


@numba.njit(nogil=True, cache=True, inline="always")
def _rows6_one(x, qs, d, m, out, o, r, block):
    """out[r:r+6, o], each summed as ``_rows1`` sums it; the block
    dequantised once for the six rows (the narrow layout)."""
    n = x.shape[1]
    x0, x1, x2, x3, x4, x5 = r * n, (r + 1) * n, (r + 2) * n, (r + 3) * n, (r + 4) * n, (r + 5) * n
    a0 = a1 = a2 = a3 = a4 = a5 = zeros()
    for b in range(d.shape[1]):
        low, high = block(qs, d, m, o, b)
        k = b * 32
        a0, a1, a2 = mac(a0, load(x, x0 + k), low), mac(a1, load(x, x1 + k), low), mac(a2, load(x, x2 + k), low)
        a3, a4, a5 = mac(a3, load(x, x3 + k), low), mac(a4, load(x, x4 + k), low), mac(a5, load(x, x5 + k), low)
        k += 16
        a0, a1, a2 = mac(a0, load(x, x0 + k), high), mac(a1, load(x, x1 + k), high), mac(a2, load(x, x2 + k), high)
        a3, a4, a5 = mac(a3, load(x, x3 + k), high), mac(a4, load(x, x4 + k), high), mac(a5, load(x, x5 + k), high)
    out[r, o], out[r + 1, o], out[r + 2, o] = total(a0), total(a1), total(a2)
    out[r + 3, o], out[r + 4, o], out[r + 5, o] = total(a3), total(a4), total(a5)


#: float32 values in a half of a LANES-lane sum (``simd.halves``), and the twelve half sums of a scratch pass
HALF = LANES // 2
PASS_SUMS = 2 * GROUP * HALF


@numba.njit(nogil=True, cache=True, inline="always")
def _scratch_pass(x, s, n, x0, s0, lane, k0, k1, acc, a):
    """Lanes lane .. lane + HALF - 1 of the sums of six rows (x from flat
    x0, rows n apart) by two outputs (their weights dequantised in s from
    flat s0, the second n after), over inputs k0 .. k1 - 1 (multiples of
    LANES): the same fused multiply-adds on those lanes, in the same order, as
    ``_rows6_one``'s; acc[a: a + PASS_SUMS] holds the twelve half sums
    (row by row, the first output's then the second's) before and after."""
    a0, a1, a2 = half_load(acc, a), half_load(acc, a + HALF), half_load(acc, a + 2 * HALF)
    a3, a4, a5 = half_load(acc, a + 3 * HALF), half_load(acc, a + 4 * HALF), half_load(acc, a + 5 * HALF)
    b0, b1, b2 = half_load(acc, a + 6 * HALF), half_load(acc, a + 7 * HALF), half_load(acc, a + 8 * HALF)
    b3, b4, b5 = half_load(acc, a + 9 * HALF), half_load(acc, a + 10 * HALF), half_load(acc, a + 11 * HALF)
    for k in range(k0 + lane, k1, LANES):
        w0, w1 = half_load(s, s0 + k), half_load(s, s0 + n + k)
        u = half_load(x, x0 + k)
        a0, b0 = half_fma(a0, u, w0), half_fma(b0, u, w1)
        u = half_load(x, x0 + n + k)
        a1, b1 = half_fma(a1, u, w0), half_fma(b1, u, w1)
        u = half_load(x, x0 + 2 * n + k)
        a2, b2 = half_fma(a2, u, w0), half_fma(b2, u, w1)
        u = half_load(x, x0 + 3 * n + k)
        a3, b3 = half_fma(a3, u, w0), half_fma(b3, u, w1)
        u = half_load(x, x0 + 4 * n + k)
        a4, b4 = half_fma(a4, u, w0), half_fma(b4, u, w1)
        u = half_load(x, x0 + 5 * n + k)
        a5, b5 = half_fma(a5, u, w0), half_fma(b5, u, w1)
    half_store(acc, a, a0), half_store(acc, a + HALF, a1), half_store(acc, a + 2 * HALF, a2)
    half_store(acc, a + 3 * HALF, a3), half_store(acc, a + 4 * HALF, a4), half_store(acc, a + 5 * HALF, a5)
    half_store(acc, a + 6 * HALF, b0), half_store(acc, a + 7 * HALF, b1), half_store(acc, a + 8 * HALF, b2)
    half_store(acc, a + 9 * HALF, b3), half_store(acc, a + 10 * HALF, b4), half_store(acc, a + 11 * HALF, b5)


@numba.njit(nogil=True, cache=True, inline="always")
def _scratch_groups(x, qs, d, m, out, blk, whole, block, s, acc):
    """out[:whole, the outputs of block blk] for `whole` rows in groups of
    six, each output summed as ``_rows1`` sums it: the block's OUT_BLOCK
    outputs dequantised once (by `block`) into s [OUT_BLOCK * in], then per
    group, per SCRATCH_K inputs, two outputs at a time, each half of their
    sums in a pass of its own (``_scratch_pass``: twelve half sums fit AVX2's
    registers beside the weights and an input, where ``_rows6_one``'s six
    whole sums leave none: each multiply-add loaded its input). acc holds
    OUT_BLOCK / 2 pairs' two passes' sums between the chunks of inputs."""
    n = x.shape[1]
    o0 = OUT_BLOCK * blk
    for j in range(OUT_BLOCK):
        for b in range(d.shape[1]):
            low, high = block(qs, d, m, o0 + j, b)
            store(s, j * n + b * BLOCK, low)
            store(s, j * n + b * BLOCK + LANES, high)
    for r in range(0, whole, GROUP):
        acc[:] = 0.0
        for k0 in range(0, n, SCRATCH_K):
            k1 = min(n, k0 + SCRATCH_K)
            for j in range(0, OUT_BLOCK, 2):
                a = j * PASS_SUMS  # pair j // 2: its two passes' sums
                _scratch_pass(x, s, n, r * n, j * n, 0, k0, k1, acc, a)
                _scratch_pass(x, s, n, r * n, j * n, HALF, k0, k1, acc, a + PASS_SUMS)
        for j in range(0, OUT_BLOCK, 2):
            a = j * PASS_SUMS
            for i in range(GROUP):
                low, high = a + i * HALF, a + PASS_SUMS + i * HALF
                out[r + i, o0 + j] = total_of_halves(half_load(acc, low), half_load(acc, high))
                low, high = low + GROUP * HALF, high + GROUP * HALF
                out[r + i, o0 + j + 1] = total_of_halves(half_load(acc, low), half_load(acc, high))


@numba.njit(nogil=True, cache=True, inline="always")
def _parts(x, out, chunks):
    """How a GEMM of x's rows into out splits: (rows, the rows in groups of
    six, the end of the three rows after them (or of the groups), OUT_BLOCK
    output blocks, blocks per parallel chunk)."""
    rows = x.shape[0]
    whole = rows - rows % GROUP
    three = whole + 3 if rows - whole >= 3 else whole
    blocks = out.shape[1] // OUT_BLOCK
    return rows, whole, three, blocks, (blocks + chunks - 1) // chunks


@numba.njit(nogil=True, cache=True, inline="always")
def _gemm(x, qs, d, m, out, chunks, block, block6):
    """out = x @ W.T for x [R, in], W the blocks' weights [out, in] (out a
    multiple of OUT_BLOCK): rows six at a time (their blocks dequantised by
    `block6`), then those left (``TAIL_PARTS``) three, two or one at a time
    (by `block`: the same values, the faster way for fewer rows); output
    blocks split into `chunks` ranges run in parallel, never a dot product."""
    rows, whole, three, blocks, per = _parts(x, out, chunks)
    for c in numba.prange(chunks):
        for blk in range(c * per, min(blocks, (c + 1) * per)):
            for o in range(OUT_BLOCK * blk, OUT_BLOCK * (blk + 1), OUTS):
                for r in range(0, whole, GROUP):
                    _rows6(x, qs, d, m, out, o, r, block6)
                _rows_left(x, qs, d, m, out, o, rows, whole, three, block)


@numba.njit(nogil=True, cache=True, inline="always")
def _rows_left(x, qs, d, m, out, o, rows, whole, three, block):
    """The rows after the groups of six (three, two, one) for outputs o ..
    o + OUTS - 1 (``_gemm``'s and ``_gemm_table``'s)."""
    if three > whole:
        _rows3(x, qs, d, m, out, o, whole, block)
    if rows - three == 2:
        _rows2(x, qs, d, m, out, o, three, block)
    elif rows - three == 1:
        _rows1(x, qs, d, m, out, o, three, block)


@numba.njit(nogil=True, cache=True, inline="always")
def _gemm_table(x, qs, d, m, out, chunks, block, block6):
    """``_gemm`` for CPUs with 32 vector registers and lane permutes (the
    table layout): the groups of six rows take each output block's outputs
    three, three and two at a time (``_rows6_three``, ``_rows6_two``: no
    spilled sums), their blocks dequantised by `block6`; four or five rows
    left (or alone: a k = 3 or 4 verification) likewise in one pass
    (``_rows4_three``, ``_rows5_three``), one left with the last group
    (``_rows7_three``: a batch of seven decoding sequences in one pass,
    where six rows and then one took two; eight rows as one pass of eight
    measured no faster than six and then two), two or three as ``_gemm``
    takes them. The same sums in the same order: the same bits.

    One to three rows (a decode step's) run by ``_gemm``, as before this
    layout grouped six rows three outputs at a time: run here (the same
    kernels for those rows) SmolLM2's decode steps of one to three rows read
    0.93-0.98x in three runs of bench_prefill.py against the engine before,
    by ``_gemm`` 0.97-1.01x in three (2 cores of an Intel Xeon, CPU model 207;
    an A/A run read 1.01-1.02x)."""
    if x.shape[0] < 4:
        _gemm(x, qs, d, m, out, chunks, block, block6)
        return
    rows, whole, three, blocks, per = _parts(x, out, chunks)
    rest = rows - whole
    # one row after a group of six: that group takes it (seven rows in one pass)
    groups = whole - GROUP if whole >= GROUP and rest == 1 else whole
    for c in numba.prange(chunks):
        for blk in range(c * per, min(blocks, (c + 1) * per)):
            o = OUT_BLOCK * blk
            for r in range(0, groups, GROUP):
                _rows6_three(x, qs, d, m, out, o, r, block6)
                _rows6_three(x, qs, d, m, out, o + 3, r, block6)
                _rows6_two(x, qs, d, m, out, o + 6, r, block6)
            if groups < whole:
                _rows7_three(x, qs, d, m, out, o, groups, block6)
                _rows7_three(x, qs, d, m, out, o + 3, groups, block6)
                _rows7_two(x, qs, d, m, out, o + 6, groups, block6)
            elif rest == 4:
                _rows4_three(x, qs, d, m, out, o, whole, block6)
                _rows4_three(x, qs, d, m, out, o + 3, whole, block6)
                _rows4_two(x, qs, d, m, out, o + 6, whole, block6)
            elif rest == 5:
                _rows5_three(x, qs, d, m, out, o, whole, block6)
                _rows5_three(x, qs, d, m, out, o + 3, whole, block6)
                _rows5_two(x, qs, d, m, out, o + 6, whole, block6)
            else:
                for o in range(OUT_BLOCK * blk, OUT_BLOCK * (blk + 1), OUTS):
                    _rows_left(x, qs, d, m, out, o, rows, whole, three, block)


@numba.njit(nogil=True, cache=True, inline="always")
def _narrow_rows_left(x, qs, d, m, out, blk, rows, whole, three, block):
    """``_gemm_narrow``'s rows after the groups of six (three, two, one) for output block blk."""
    if three > whole:
        for o in range(OUT_BLOCK * blk, OUT_BLOCK * (blk + 1)):
            _rows3_one(x, qs, d, m, out, o, whole, block)
    if rows - three == 2:
        for o in range(OUT_BLOCK * blk, OUT_BLOCK * (blk + 1)):
            _rows2_one(x, qs, d, m, out, o, three, block)
    elif rows - three == 1:
        for o in range(OUT_BLOCK * blk, OUT_BLOCK * (blk + 1), 2):
            _rows1_two(x, qs, d, m, out, o, three, block)


@numba.njit(nogil=True, cache=True, inline="always")
def _gemm_narrow(x, qs, d, m, out, chunks, block):
    """``_gemm`` for CPUs with 16 vector registers (AVX2: a LANES-lane
    value takes two): one output at a time for six, three or two rows, two
    for one row, so sums and blocks stay in registers where ``_gemm``'s four
    outputs spill them (2 cores of an AMD EPYC without AVX-512, SmolLM2's
    shapes: 1.3x faster at one row, 1.7x at six). From SCRATCH_ROWS rows
    in groups of six the groups run from a scratch of dequantised weights
    (``_scratch_groups``). The same sums in the same order: the same bits."""
    rows, whole, three, blocks, per = _parts(x, out, chunks)
    if whole >= SCRATCH_ROWS:  # its scratch is allocated here only: a decode step's launches allocate nothing
        for c in numba.prange(chunks):
            s = np.empty(OUT_BLOCK * x.shape[1], np.float32)
            acc = np.empty(OUT_BLOCK * PASS_SUMS, np.float32)
            for blk in range(c * per, min(blocks, (c + 1) * per)):
                _scratch_groups(x, qs, d, m, out, blk, whole, block, s, acc)
                _narrow_rows_left(x, qs, d, m, out, blk, rows, whole, three, block)
    else:
        for c in numba.prange(chunks):
            for blk in range(c * per, min(blocks, (c + 1) * per)):
                for r in range(0, whole, GROUP):
                    for o in range(OUT_BLOCK * blk, OUT_BLOCK * (blk + 1)):
                        _rows6_one(x, qs, d, m, out, o, r, block)
                _narrow_rows_left(x, qs, d, m, out, blk, rows, whole, three, block)


@numba.njit(nogil=True, cache=True, parallel=True)
def _gemm_q4_1(x, qs, d, m, out, chunks):
    """``_gemm`` over Q4_1 blocks."""
    _gemm(x, qs, d, m, out, chunks, _q4_1, _q4_1)


@numba.njit(nogil=True, cache=True, parallel=True)
def _gemm_q4_0(x, qs, d, m, out, chunks):
    """``_gemm`` over Q4_0 blocks."""
    _gemm(x, qs, d, m, out, chunks, _q4_0, _q4_0)


@numba.njit(nogil=True, cache=True, parallel=True)
def _gemm_q8_0(x, qs, d, m, out, chunks):
    """``_gemm`` over Q8_0 blocks."""
    _gemm(x, qs, d, m, out, chunks, _q8_0, _q8_0)


@numba.njit(nogil=True, cache=True, parallel=True)
def _gemm_q4_1_pick(x, qs, d, m, out, chunks):
    """``_gemm_table`` over Q4_1 blocks, dequantised by table (``_q4_1_pick``)."""
    _gemm_table(x, qs, d, m, out, chunks, _q4_1_pick, _q4_1_pick)


@numba.njit(nogil=True, cache=True, parallel=True)
def _gemm_q4_0_pick(x, qs, d, m, out, chunks):
    """``_gemm_table`` over Q4_0 blocks, dequantised by table (``_q4_0_pick``)."""
    _gemm_table(x, qs, d, m, out, chunks, _q4_0_pick, _q4_0_pick)


@numba.njit(nogil=True, cache=True, parallel=True)
def _gemm_q8_0_table(x, qs, d, m, out, chunks):
    """``_gemm_table`` over Q8_0 blocks."""
    _gemm_table(x, qs, d, m, out, chunks, _q8_0, _q8_0)


@numba.njit(nogil=True, cache=True, parallel=True)
def _gemm_q4_1_narrow(x, qs, d, m, out, chunks):
    """``_gemm_narrow`` over Q4_1 blocks."""
    _gemm_narrow(x, qs, d, m, out, chunks, _q4_1)


@numba.njit(nogil=True, cache=True, parallel=True)
def _gemm_q4_0_narrow(x, qs, d, m, out, chunks):
    """``_gemm_narrow`` over Q4_0 blocks."""
    _gemm_narrow(x, qs, d, m, out, chunks, _q4_0)


@numba.njit(nogil=True, cache=True, parallel=True)
def _gemm_q8_0_narrow(x, qs, d, m, out, chunks):
    """``_gemm_narrow`` over Q8_0 blocks."""
    _gemm_narrow(x, qs, d, m, out, chunks, _q8_0)


#: Each layout's compiled entries by kind, all computing the same bits:
#: "table" (AVX-512: 4-bit blocks by table, groups of six rows three outputs at
#: a time), "wide" (32 vector registers, multiply-add, four outputs at a time),
#: "narrow" (16 registers: AVX2).
LAYOUTS = {
    "table": {"Q4_0": _gemm_q4_0_pick, "Q4_1": _gemm_q4_1_pick, "Q8_0": _gemm_q8_0_table},
    "wide": {"Q4_0": _gemm_q4_0, "Q4_1": _gemm_q4_1, "Q8_0": _gemm_q8_0},
    "narrow": {"Q4_0": _gemm_q4_0_narrow, "Q4_1": _gemm_q4_1_narrow, "Q8_0": _gemm_q8_0_narrow},
}
#: The layouts this CPU can run ("table" needs AVX-512's lane permutes).
RUNNABLE = ("table", "wide", "narrow") if has_permute() else ("wide", "narrow")
#: The layout a CPU starts with: by table where it has AVX-512 (measured on AMD EPYC family 26), else narrow.
LAYOUT = "table" if has_permute() else "narrow"
#: The row counts a launch runs at (``TAIL_PARTS``): groups of six, then one to five.
LAYOUT_ROWS = (1, 2, 3, 4, 5, GROUP)
#: The layout gemm() runs each of LAYOUT_ROWS with (``use_layouts``; the CPU's default until the
#: selector has timed them on this machine: ``time_layouts``, ``choose_layouts``).
ROW_LAYOUTS = dict.fromkeys(LAYOUT_ROWS, LAYOUT)
#: A layout within this fraction of the fastest is a tie, which the CPU's default layout wins.
LAYOUT_TIE = 0.03


def time_layouts(weights: list[QuantWeight], threads: int, reps: int = 3) -> dict[str, dict[int, float]]:
    """ms of one pass over all of `weights` for each layout this CPU can run
    at each of LAYOUT_ROWS rows: the fastest of `reps`, layouts in turns (a
    drifting machine slows them alike)."""
    rng = np.random.default_rng(0)
    ms: dict[str, dict[int, float]] = {name: {} for name in RUNNABLE}
    for rows in LAYOUT_ROWS:
        xs = {n: rng.standard_normal((rows, n)).astype(np.float32) for n in {w.d.shape[1] * BLOCK for w in weights}}
        outs = [np.empty((rows, w.d.shape[0]), np.float32) for w in weights]
        best = dict.fromkeys(RUNNABLE, float("inf"))
        for rep in range(reps + 1):  # the first round compiles / warms up
            for name in RUNNABLE:
                t = time.perf_counter()
                with LAUNCH_LOCK:
                    set_team(threads)
                    for w, out in zip(weights, outs):
                        LAYOUTS[name][w.kind](xs[w.d.shape[1] * BLOCK], w.qs, w.d, w.m, out, threads)
                if rep:
                    best[name] = min(best[name], (time.perf_counter() - t) * 1e3)
        for name in RUNNABLE:
            ms[name][rows] = round(best[name], 3)
    return ms


def choose_layouts(ms: dict[str, dict[int, float]]) -> dict[int, str]:
    """The fastest layout at each row count of ``time_layouts``' timings; one
    within LAYOUT_TIE of it is a tie, which the CPU's default (LAYOUT) wins."""
    choice = {}
    for rows in LAYOUT_ROWS:
        timed = {name: t[rows] for name, t in ms.items() if rows in t}
        best = min(timed, key=lambda n: (timed[n], n != LAYOUT))
        choice[rows] = LAYOUT if LAYOUT in timed and timed[LAYOUT] <= timed[best] * (1 + LAYOUT_TIE) else best
    return choice


def use_layouts(choice: dict[int, str]) -> None:
    """Runs each row count of LAYOUT_ROWS with the layout `choice` names
    (all compute the same bits; process-wide). Raises ValueError for a
    layout this CPU cannot run or a row count that is not one of LAYOUT_ROWS."""
    for rows, name in choice.items():
        if rows not in LAYOUT_ROWS or name not in RUNNABLE:
            raise ValueError(f"gguf layouts: {rows} rows by {name!r}: row counts are {LAYOUT_ROWS}, "
                             f"layouts this CPU runs {RUNNABLE}")
    ROW_LAYOUTS.update(choice)


def pieces(rows: int) -> list[tuple[int, int, str]]:
    """(start, stop, layout) of the launches gemm() makes for `rows` rows:
    the groups of six, then ``TAIL_PARTS``' three, two or one rows, each by
    the layout ROW_LAYOUTS names for its row count; neighbours of one layout
    are one launch (a kernel splits any slice that starts at a part the same
    way)."""
    parts = [(0, rows - rows % GROUP, GROUP)] if rows >= GROUP else []
    start = parts[0][1] if parts else 0
    for n in TAIL_PARTS[rows % GROUP]:
        parts.append((start, start + n, n))
        start += n
    out: list[tuple[int, int, str]] = []
    for lo, hi, n in parts:
        if out and out[-1][2] == ROW_LAYOUTS[n]:
            out[-1] = (out[-1][0], hi, out[-1][2])
        else:
            out.append((lo, hi, ROW_LAYOUTS[n]))
    return out


def gemm(x: np.ndarray, w: QuantWeight, chunks: int) -> np.ndarray:
    """x float32 [R, in] @ w's dequantised weight, transposed -> float32 [R,
    padded out]: rows six at a time, then three, two or one (``pieces``; a
    row's outputs never depend on the rows beside it)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    assert x.shape[1] == w.d.shape[1] * BLOCK
    rows = x.shape[0]
    out = np.empty((rows, w.d.shape[0]), np.float32)
    with LAUNCH_LOCK:
        set_team(chunks)
        if rows < GROUP and len(TAIL_PARTS[rows]) == 1:  # one launch of them all: a decode step's rows
            LAYOUTS[ROW_LAYOUTS[rows]][w.kind](x, w.qs, w.d, w.m, out, chunks)
        else:
            for lo, hi, layout in pieces(rows):
                LAYOUTS[layout][w.kind](x[lo:hi], w.qs, w.d, w.m, out[lo:hi], chunks)
    return out


# ---- reading the file's blocks ------------------------------------------------------------

#: GGUF metadata value types -> their fixed size in bytes (8: string, 9: array are read apart).
_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
#: GGML type ids of the quantisations read (gguf.GGMLQuantizationType values).
_GGML_TYPES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}


def quantized_tensors(path: str | Path) -> list[tuple[str, str, np.ndarray]]:
    """(name, kind, raw blocks uint8 [rows, row bytes]) of each 2-D Q4_1 or
    Q8_0 tensor of a GGUF file (versions 2 and 3), memory-mapped. Reads the
    tensor table only, skipping the metadata (gguf's GGUFReader parses all of
    it, the tokenizer's vocabulary too: ~2.5 s for SmolLM2's file, this ~0.1)."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    buf = data.data  # a memoryview of the mapping
    pos = 0

    def u(fmt: str, size: int) -> int:
        nonlocal pos
        value = int.from_bytes(buf[pos:pos + size], "little", signed=fmt == "i")
        pos += size
        return value

    def string() -> str:
        nonlocal pos
        n = u("u", 8)
        pos += n
        return bytes(buf[pos - n:pos]).decode("utf-8", "replace")

    def skip(kind: int) -> None:
        nonlocal pos
        if kind == 8:
            n = u("u", 8)  # read before pos is (``pos += u(...)`` would add to the old pos)
            pos += n
        elif kind == 9:
            inner, count = u("u", 4), u("u", 8)
            if inner in _GGUF_SCALAR_BYTES:
                pos += count * _GGUF_SCALAR_BYTES[inner]
            else:
                for _ in range(count):
                    skip(inner)
        else:
            pos += _GGUF_SCALAR_BYTES[kind]

    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    pos = 4
    version = u("u", 4)
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version}, not 2 or 3")
    n_tensors, n_kv = u("u", 8), u("u", 8)
    alignment = 32
    for _ in range(n_kv):
        key, value_type = string(), u("u", 4)
        if key == "general.alignment" and value_type == 4:
            alignment = u("u", 4)
        else:
            skip(value_type)
    table = []
    for _ in range(n_tensors):
        name, n_dims = string(), u("u", 4)
        dims = [u("u", 8) for _ in range(n_dims)]  # innermost first
        table.append((name, dims, u("u", 4), u("u", 8)))
    start = -(-pos // alignment) * alignment
    out = []
    for name, dims, ggml, offset in table:
        kind = _GGML_TYPES.get(ggml)
        if kind is None or len(dims) != 2 or dims[0] % BLOCK:
            continue
        row = dims[0] // BLOCK * KINDS[kind]
        out.append((name, kind, data[start + offset:start + offset + dims[1] * row].reshape(dims[1], row)))
    return out


# ---- finding a weight's blocks ------------------------------------------------------------


class NoBlocks(RuntimeError):
    """A weight whose rows are not a GGUF file's Q4_1 or Q8_0 rows (the message says why)."""


def _row_keys(rows: np.ndarray, salt: np.ndarray) -> np.ndarray:
    """A 128-bit key per float32 row (bit patterns; two salted sums mod 2^64):
    the index's keys. A match is then checked bit for bit."""
    keys = np.empty((len(rows), 2), np.uint64)
    _on_threads(_keys_of_rows, np.ascontiguousarray(rows, dtype=np.float32), salt, keys)
    return keys


class GgufBlocks:
    """A GGUF file's Q4_1 and Q8_0 tensors, indexed by their dequantised rows
    (module doc). ``find`` gives a weight's QuantWeight or raises NoBlocks."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        #: (kind, raw blocks uint8 [out, blocks * bytes]) of each quantised 2-D tensor (read on the first lookup)
        self.tensors: list[tuple[str, np.ndarray]] = []
        self._index: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None  # ``_rows``
        self._salt = np.random.default_rng(0).integers(1, 2**63, size=(2, 1 << 16), dtype=np.uint64) | np.uint64(1)
        self._lock = threading.Lock()
        self._found: dict[tuple, QuantWeight | NoBlocks] = {}  # find's answers by weight

    def identity(self) -> str:
        """The file as the GEMM cache keys it: name, size, modification time."""
        st = self.path.stat()
        return f"{self.path.name}:{st.st_size}:{st.st_mtime_ns}"

    def _rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The index, built on the first lookup: every quantised row's key
        (dequantised and keyed a row at a time by ``_keys_of_blocks``; SmolLM2's
        ~200k rows) with its tensor and row, as arrays sorted by key (first
        halves, then second halves), equal keys in file order: (first halves,
        second halves, tensors, rows)."""
        with self._lock:
            if self._index is None:
                self.tensors = [(kind, raw) for _, kind, raw in quantized_tensors(self.path)]
                keys, tensors, rows = [np.empty((0, 2), np.uint64)], [np.empty(0, np.int64)], [np.empty(0, np.int64)]
                for t, (kind, raw) in enumerate(self.tensors):
                    q = self._weight(kind, raw, np.arange(raw.shape[0]))
                    keys.append(np.empty((raw.shape[0], 2), np.uint64))
                    _on_threads(_keys_of_blocks, KIND_CODES[kind], q.qs, q.d, q.m, self._salt, keys[-1])
                    tensors.append(np.full(raw.shape[0], t, np.int64))
                    rows.append(np.arange(raw.shape[0], dtype=np.int64))
                key = np.concatenate(keys)
                order = np.lexsort((key[:, 1], key[:, 0]))  # stable: equal keys stay in file order
                self._index = (key[order, 0], key[order, 1], np.concatenate(tensors)[order],
                               np.concatenate(rows)[order])
            return self._index

    def _locate(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(tensor, row) of the file's first row with each key [R, 2] (the
        lowest tensor, then row, as a dict filled in file order would give);
        tensor -1 where the file has none."""
        first, second, tensors, rows = self._rows()
        if len(first) == 0:
            return np.full(len(keys), -1, np.int64), np.zeros(len(keys), np.int64)
        lo = np.searchsorted(first, keys[:, 0], "left")
        hi = np.searchsorted(first, keys[:, 0], "right")
        at = np.minimum(lo, len(first) - 1)
        match = (hi > lo) & (second[at] == keys[:, 1])
        for r in np.nonzero((hi > lo) & ~match)[0].tolist():  # the same first half, another second: look on
            p = lo[r] + int(np.searchsorted(second[lo[r]:hi[r]], keys[r, 1], "left"))
            if p < hi[r] and second[p] == keys[r, 1]:
                at[r], match[r] = p, True
        return np.where(match, tensors[at], -1), rows[at]

    @staticmethod
    def _weight(kind: str, raw: np.ndarray, rows: np.ndarray) -> QuantWeight:
        """The QuantWeight of a tensor's rows (unpadded)."""
        blocks = raw[rows].reshape(len(rows), -1, KINDS[kind])
        d = np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16)[..., 0].astype(np.float32)
        if kind == "Q4_1":
            m = np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16)[..., 0].astype(np.float32)
            qs = np.ascontiguousarray(blocks[:, :, 4:]).reshape(len(rows), -1)
        elif kind == "Q4_0":
            m = np.zeros((1, 1), np.float32)
            qs = np.ascontiguousarray(blocks[:, :, 2:]).reshape(len(rows), -1)
        else:
            m = np.zeros((1, 1), np.float32)
            qs = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(len(rows), -1)
        return QuantWeight(kind, qs, d, m, len(rows))

    def find(self, weight: torch.Tensor) -> QuantWeight:
        """weight's rows as blocks, out padded to OUT_BLOCK; NoBlocks if
        weight is not float32, or a row is not a quantised tensor's row
        (an all-zero row is a zero block), or the blocks found do not
        dequantise to weight bit for bit. Remembered per weight (the
        selector builds a weight's Linear several times)."""
        key = (weight.data_ptr(), tuple(weight.shape), tuple(weight.stride()), weight.dtype)
        with self._lock:
            found = self._found.get(key)
        if found is None:
            try:
                found = self._find(weight)
            except NoBlocks as e:
                found = e
            with self._lock:
                self._found[key] = found
        if isinstance(found, NoBlocks):
            raise found
        return found

    def covers_any(self, weights: list[torch.Tensor]) -> bool:
        """Whether the file holds the blocks of at least one of weights."""
        for w in weights:
            try:
                self.find(w)
                return True
            except NoBlocks:
                pass
        return False

    def _find(self, weight: torch.Tensor) -> QuantWeight:
        if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK:
            raise NoBlocks(f"GGUF blocks hold float32 weights of whole {BLOCK}-value blocks, not a "
                           f"{weight.dtype} weight {tuple(weight.shape)}")
        w = np.ascontiguousarray(weight.detach().cpu().numpy())
        tensor, row = self._locate(_row_keys(w, self._salt))
        missing = np.nonzero((tensor < 0) & w.any(axis=1))[0]  # an all-zero row needs no file row
        if len(missing):
            raise NoBlocks(f"row {missing[0]} of a weight {tuple(w.shape)} is not a Q4_1 or Q8_0 row of "
                           f"{self.path.name}")
        used = np.unique(tensor[tensor >= 0]).tolist()
        kinds = {self.tensors[t][0] for t in used} or {"Q4_1"}  # all zero: zero blocks
        if len(kinds) != 1:
            raise NoBlocks(f"a weight {tuple(w.shape)} mixes quantisations ({', '.join(sorted(kinds))})")
        kind = kinds.pop()
        out = -(-len(w) // OUT_BLOCK) * OUT_BLOCK
        nb, per = w.shape[1] // BLOCK, KINDS[kind]
        raw = np.zeros((out, nb * per), np.uint8)  # zero blocks: d = m = 0, every value +0
        for t in used:
            mine = np.nonzero(tensor == t)[0]
            blocks = self.tensors[t][1]
            if blocks.shape[1] != nb * per:
                raise NoBlocks(f"row {mine[0]} of a weight {tuple(w.shape)} matched a row of another width")
            raw[mine] = blocks[row[mine]]
        q = self._weight(kind, raw, np.arange(out))
        q = QuantWeight(kind, q.qs, q.d, q.m, len(w))
        if _on_threads(_first_difference, KIND_CODES[kind], q.qs, q.d, q.m, w) >= 0:
            raise NoBlocks(f"the blocks found for a weight {tuple(w.shape)} do not dequantise to it bit for bit")
        return q


kernel_cache.refresh(globals())  # numba keys its cache by this file only: flush it when any kernel source changed
