"""A float32 GEMM for few rows whose order of operations is written in the
kernel, not chosen by the compiler: row-count invariant by construction on
every CPU, and the fastest decode and verification steps measured here.

Why another kernel. ``gemm_numba``'s loops are vectorised by LLVM under
fast-math (reassociation): each output's summation order is whatever vector
width and interleave LLVM picks for that loop, so a one-row loop and a
six-row loop may sum differently (the selector checks, and refuses "numba1"
where they do). Here the vector arithmetic is explicit (``engine.simd``'s
intrinsics) and no fast-math flag is set, so LLVM may not reorder it:

    acc = 0 (LANES float32 lanes)
    for k in 0, LANES, 2 LANES, ... < in:    acc = fma(x[k:k+LANES], w[o, k:k+LANES], acc)
    out = sum of acc's lanes, halves added pairwise (lanes 0..7 + 8..15, then 4, 2, 1)

Every kernel (one row, six rows) computes every output exactly so, with one
fused multiply-add per lane and step: the bits of a row never depend on the
rows beside it, the thread count or the kernel that ran it. ``in`` is padded
with zeros to a multiple of LANES (adding 0 * 0 changes no sum).

Speed. A six-row step does six times the arithmetic of a one-row step on the
same weight bytes; on 2 cores of an AVX-512 AMD EPYC it became limited by
memory stalls, not by the multiply-adds: the core's demand loads sat behind
24 multiply-adds per weight line. Prefetching the weight ``PREFETCH_AHEAD``
values ahead into L2 (not L1) keeps enough lines in flight: SmolLM2's
projections at 6 rows went from ~26 ms (numba6, prefetching into L1) to
~17 ms, and at 1 row from ~19 ms (numba1) to ~16 ms, so verifying 5 drafts
costs about one decode step (``python benchmarks/bench_forward.py`` prints
the selector's timings on the machine it runs on).

bfloat16 weights (uint16 bit patterns) are read as such and widened to
float32 in registers (a shift: exact), so a step reads half the bytes; the
arithmetic and its order are the float32 kernel's. This needs no native
bfloat16 instruction: it runs alike on every x86 CPU numba targets.

Layout: weights [out, in] float32 or bfloat16 bits, out padded to OUT_BLOCK and in to LANES
(``pad_weight``). Rows go six at a time (``_rows6``: 6 rows x 4 outputs, 24
accumulators); one left-over row takes ``_rows1`` (1 x 4), more left-over
rows a zero-padded group of six. Threads (numba ``prange``) split the output
blocks, never a dot product; within a block the weight rows stay in cache
across the groups of rows.
"""
from __future__ import annotations

import numba
import numpy as np

from specdec.engine.gemm_numba import LAUNCH_LOCK, OUT_BLOCK
from specdec.engine.simd import LANES, fma, load, prefetch_l2, total, zeros

#: How far ahead of the step (in weight values, flat) the weight is prefetched into L2.
PREFETCH_AHEAD = 4096
#: Rows of a full group (``_rows6``).
GROUP = 6
#: Outputs per kernel call (both kernels).
OUTS = 4

@numba.njit(nogil=True, cache=True, inline="always")
def _store4(out, r, o, a0, a1, a2, a3):
    """out[r, o:o+4] = the four accumulators' totals."""
    out[r, o] = total(a0)
    out[r, o + 1] = total(a1)
    out[r, o + 2] = total(a2)
    out[r, o + 3] = total(a3)


@numba.njit(nogil=True, cache=True, inline="always")
def _rows1(x, w, out, o, r):
    """out[r, o:o+4] = x[r] @ w[o:o+4].T (x, w C-contiguous, in a multiple of LANES)."""
    n = x.shape[1]
    xr = r * n
    w0, w1, w2, w3 = o * n, (o + 1) * n, (o + 2) * n, (o + 3) * n
    a0 = a1 = a2 = a3 = zeros()
    for k in range(0, n, LANES):
        prefetch_l2(w, w0 + k + PREFETCH_AHEAD)
        prefetch_l2(w, w1 + k + PREFETCH_AHEAD)
        prefetch_l2(w, w2 + k + PREFETCH_AHEAD)
        prefetch_l2(w, w3 + k + PREFETCH_AHEAD)
        u = load(x, xr + k)
        a0 = fma(a0, u, load(w, w0 + k))
        a1 = fma(a1, u, load(w, w1 + k))
        a2 = fma(a2, u, load(w, w2 + k))
        a3 = fma(a3, u, load(w, w3 + k))
    _store4(out, r, o, a0, a1, a2, a3)


@numba.njit(nogil=True, cache=True, inline="always")
def _rows6(x, w, out, o, r):
    """out[r:r+6, o:o+4] = x[r:r+6] @ w[o:o+4].T, each output summed as ``_rows1`` sums it."""
    n = x.shape[1]
    x0, x1, x2, x3, x4, x5 = r * n, (r + 1) * n, (r + 2) * n, (r + 3) * n, (r + 4) * n, (r + 5) * n
    w0, w1, w2, w3 = o * n, (o + 1) * n, (o + 2) * n, (o + 3) * n
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = a20 = a21 = a22 = a23 = zeros()
    a30 = a31 = a32 = a33 = a40 = a41 = a42 = a43 = a50 = a51 = a52 = a53 = zeros()
    for k in range(0, n, LANES):
        prefetch_l2(w, w0 + k + PREFETCH_AHEAD)
        prefetch_l2(w, w1 + k + PREFETCH_AHEAD)
        prefetch_l2(w, w2 + k + PREFETCH_AHEAD)
        prefetch_l2(w, w3 + k + PREFETCH_AHEAD)
        v0 = load(w, w0 + k)
        v1 = load(w, w1 + k)
        v2 = load(w, w2 + k)
        v3 = load(w, w3 + k)
        u = load(x, x0 + k)
        a00, a01, a02, a03 = fma(a00, u, v0), fma(a01, u, v1), fma(a02, u, v2), fma(a03, u, v3)
        u = load(x, x1 + k)
        a10, a11, a12, a13 = fma(a10, u, v0), fma(a11, u, v1), fma(a12, u, v2), fma(a13, u, v3)
        u = load(x, x2 + k)
        a20, a21, a22, a23 = fma(a20, u, v0), fma(a21, u, v1), fma(a22, u, v2), fma(a23, u, v3)
        u = load(x, x3 + k)
        a30, a31, a32, a33 = fma(a30, u, v0), fma(a31, u, v1), fma(a32, u, v2), fma(a33, u, v3)
        u = load(x, x4 + k)
        a40, a41, a42, a43 = fma(a40, u, v0), fma(a41, u, v1), fma(a42, u, v2), fma(a43, u, v3)
        u = load(x, x5 + k)
        a50, a51, a52, a53 = fma(a50, u, v0), fma(a51, u, v1), fma(a52, u, v2), fma(a53, u, v3)
    _store4(out, r, o, a00, a01, a02, a03)
    _store4(out, r + 1, o, a10, a11, a12, a13)
    _store4(out, r + 2, o, a20, a21, a22, a23)
    _store4(out, r + 3, o, a30, a31, a32, a33)
    _store4(out, r + 4, o, a40, a41, a42, a43)
    _store4(out, r + 5, o, a50, a51, a52, a53)


@numba.njit(nogil=True, cache=True, parallel=True)
def _gemm(x, w, out, chunks):
    """out = x @ w.T for x [R, in], w [out, in] (out a multiple of OUT_BLOCK,
    in of LANES), out [R, out]; the output blocks split into `chunks` ranges
    run in parallel. Rows six at a time; one left-over row alone, more in a
    zero-padded scratch group of six."""
    rows = x.shape[0]
    whole = rows - rows % GROUP
    left = rows - whole
    blocks = w.shape[0] // OUT_BLOCK
    per = (blocks + chunks - 1) // chunks
    for c in numba.prange(chunks):
        group = np.zeros((GROUP, x.shape[1]), np.float32)
        group_out = np.empty((GROUP, w.shape[0]), np.float32)
        for j in range(left):
            group[j] = x[whole + j]
        for blk in range(c * per, min(blocks, (c + 1) * per)):
            for o in range(OUT_BLOCK * blk, OUT_BLOCK * (blk + 1), OUTS):
                for r in range(0, whole, GROUP):
                    _rows6(x, w, out, o, r)
                if left == 1:
                    _rows1(x, w, out, o, whole)
                elif left > 1:
                    _rows6(group, w, group_out, o, 0)
                    for j in range(left):
                        for i in range(o, o + OUTS):
                            out[whole + j, i] = group_out[j, i]


def padded_in(in_features: int) -> int:
    """`in` rounded up to a multiple of LANES."""
    return -(-in_features // LANES) * LANES


def pad_weight(weight: np.ndarray) -> np.ndarray:
    """float32 (or bfloat16 bits as uint16) [out, in] -> contiguous [out
    rounded up to OUT_BLOCK, in rounded up to LANES], zeros added; the weight
    itself (no copy) when it already is."""
    out = -(-weight.shape[0] // OUT_BLOCK) * OUT_BLOCK
    width = padded_in(weight.shape[1])
    if (out, width) == weight.shape and weight.flags.c_contiguous:
        return weight
    padded = np.zeros((out, width), weight.dtype)
    padded[:weight.shape[0], :weight.shape[1]] = weight
    return padded


def gemm(x: np.ndarray, weight: np.ndarray, chunks: int) -> np.ndarray:
    """x float32 [R, in] @ the padded weight's transpose -> float32 [R, padded
    out]. weight: float32, or uint16 holding bfloat16 bit patterns (half the
    bytes to read; each value widened to float32 exactly, then summed as a
    float32 weight would be: same order, so just as row-count invariant)."""
    if x.shape[1] != weight.shape[1]:
        x = np.pad(x, ((0, 0), (0, weight.shape[1] - x.shape[1])))
    x = np.ascontiguousarray(x, dtype=np.float32)
    assert weight.dtype in (np.float32, np.uint16) and weight.flags.c_contiguous and weight.shape[1] % LANES == 0
    out = np.empty((x.shape[0], weight.shape[0]), np.float32)
    with LAUNCH_LOCK:
        _gemm(x, weight, out, chunks)
    return out

