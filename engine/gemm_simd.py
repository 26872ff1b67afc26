"""A GEMM for few rows (float32 arithmetic, or bfloat16 dot products) whose order of operations is written in the
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
the selector's timings on the machine it runs on). Where the prefetches
should put the weight depends on the CPU: on a newer AMD EPYC (CPU family
26) prefetching PREFETCH_AHEAD_L1 values ahead into L1 (``l1``, the
"simd-l1" path) streamed SmolLM2's float32 projections faster, at 1 / 6
rows a median 11.0 / 12.2 ms against 12.4 / 14.5 into L2 (15 turns, a
throwaway microbenchmark of both in one process; another run 12.5 / 14.6
against 13.3 / 16.0), and bfloat16 weights alike within 4 %. A prefetch
changes no value, so both compute the same bits and the selector times
both.

bfloat16 weights (uint16 bit patterns) are read as such and widened to
float32 in registers (a shift: exact), so a step reads half the bytes; the
arithmetic and its order are the float32 kernel's. This needs no native
bfloat16 instruction: it runs alike on every x86 CPU numba targets.

bfloat16 activations too (``pairs``, the "simd-dpbf16" path; only on CPUs
with AVX512-BF16): the input rows are rounded to bfloat16 (as torch rounds)
and every step is one ``vdpbf16ps`` over 2 LANES values (``engine.simd.mac``
on pairs): each float32 lane adds the exact products of its pair, the odd
element's first, rounding after each (the instruction's architectural
definition), then the lanes are reduced as above. Half the arithmetic
instructions per weight: at 6 rows the float32 kernel is bound by its 24
multiply-adds per 16 weights, this one is not. Its one-row pass streams as
fast only with two prefetches per cache line (``_prefetch4``). Row-count
invariant by construction like the rest; its numbers are bfloat16
activations' (transformers' bfloat16), not float32's.

Layout: weights [out, in] float32 or bfloat16 bits, out padded to OUT_BLOCK
and in to LANES (2 LANES for pairs: ``pad_weight``). Rows go six at a time (``_rows6``: 6 rows x 4 outputs, 24
accumulators); the 1-5 rows left over take ``_rows3``, ``_rows2`` and
``_rows1`` (one row; 1 x 4, two steps per loop turn), so a short
verification (adaptive draft lengths, a model draft's confidence cut) does
the arithmetic of its own rows: against a zero-padded group of six, 2-4
rows ran 5-10 % faster (float32 weights) and 2-5 % (bfloat16 pairs) over
SmolLM2's shapes on an AMD EPYC (family 26; a throwaway microbenchmark of
both in turns; ``python benchmarks/bench_verify_ab.py --rows 2,3,4,6``
times it through the engine). Threads (numba ``prange``) split the output
blocks, never a dot product; within a block the weight rows stay in cache
across the groups of rows.
"""
from __future__ import annotations

import numba
import numpy as np

from specdec.engine import kernel_cache
from specdec.engine.gemm_numba import LAUNCH_LOCK, OUT_BLOCK, set_team
from specdec.engine.simd import LANES, mac, operand, prefetch_l1, prefetch_l2, total, width, zeros

#: How far ahead of the step (in weight values, flat) the weight is prefetched into L2 ("simd").
PREFETCH_AHEAD = 4096
#: The same into L1 ("simd-l1", ``l1``): a shorter way, as L1 holds less.
PREFETCH_AHEAD_L1 = 2048
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
def _into_l2(w, i):
    """Prefetch w's value PREFETCH_AHEAD past flat index i into L2 ("simd")."""
    prefetch_l2(w, i + PREFETCH_AHEAD)


@numba.njit(nogil=True, cache=True, inline="always")
def _into_l1(w, i):
    """Prefetch w's value PREFETCH_AHEAD_L1 past flat index i into L1 ("simd-l1")."""
    prefetch_l1(w, i + PREFETCH_AHEAD_L1)


@numba.njit(nogil=True, cache=True, inline="always")
def _prefetch4(w, i0, i1, i2, i3, step, l1):
    """Prefetch the four weight rows' values ahead of i0..i3 with ``l1``
    (``_into_l2`` or ``_into_l1``: a function argument, so each kernel is
    compiled for one of them; a boolean tested at every step cost ~8 % of a
    one-row pass in a throwaway microbenchmark), one prefetch per LANES
    values of a step: twice per cache line when a step reads whole lines
    (pairs). Once per line, a one-row pass over bfloat16 pairs streamed ~40 %
    slower on an AMD EPYC (its prefetches are hints, and apparently dropped
    when the core is out of fill buffers)."""
    for p in range(0, step, LANES):
        l1(w, i0 + p)
        l1(w, i1 + p)
        l1(w, i2 + p)
        l1(w, i3 + p)


@numba.njit(nogil=True, cache=True, inline="always")
def _step1(x, w, xr, w0, w1, w2, w3, k, a0, a1, a2, a3, l1):
    """One step of ``_rows1``: the four accumulators after the values k .. k + width(x)."""
    _prefetch4(w, w0 + k, w1 + k, w2 + k, w3 + k, width(x), l1)
    u = operand(x, xr + k, x)
    return (mac(a0, u, operand(w, w0 + k, x)), mac(a1, u, operand(w, w1 + k, x)),
            mac(a2, u, operand(w, w2 + k, x)), mac(a3, u, operand(w, w3 + k, x)))


@numba.njit(nogil=True, cache=True, inline="always")
def _rows1(x, w, out, o, r, l1):
    """out[r, o:o+4] = x[r] @ w[o:o+4].T (x, w C-contiguous, in a multiple of
    width(x)); two steps per loop turn (more loads in flight: the pair
    steps stream closer to the float32 ones' speed), the order unchanged."""
    n = x.shape[1]
    xr = r * n
    w0, w1, w2, w3 = o * n, (o + 1) * n, (o + 2) * n, (o + 3) * n
    a0 = a1 = a2 = a3 = zeros()
    step = width(x)
    k = 0
    while k + step < n:
        a0, a1, a2, a3 = _step1(x, w, xr, w0, w1, w2, w3, k, a0, a1, a2, a3, l1)
        a0, a1, a2, a3 = _step1(x, w, xr, w0, w1, w2, w3, k + step, a0, a1, a2, a3, l1)
        k += 2 * step
    if k < n:
        a0, a1, a2, a3 = _step1(x, w, xr, w0, w1, w2, w3, k, a0, a1, a2, a3, l1)
    _store4(out, r, o, a0, a1, a2, a3)


@numba.njit(nogil=True, cache=True, inline="always")
def _rows2(x, w, out, o, r, l1):
    """out[r:r+2, o:o+4] = x[r:r+2] @ w[o:o+4].T, each output summed as ``_rows1`` sums it."""
    n = x.shape[1]
    x0, x1 = r * n, (r + 1) * n
    w0, w1, w2, w3 = o * n, (o + 1) * n, (o + 2) * n, (o + 3) * n
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = zeros()
    for k in range(0, n, width(x)):
        _prefetch4(w, w0 + k, w1 + k, w2 + k, w3 + k, width(x), l1)
        v0 = operand(w, w0 + k, x)
        v1 = operand(w, w1 + k, x)
        v2 = operand(w, w2 + k, x)
        v3 = operand(w, w3 + k, x)
        u = operand(x, x0 + k, x)
        a00, a01, a02, a03 = mac(a00, u, v0), mac(a01, u, v1), mac(a02, u, v2), mac(a03, u, v3)
        u = operand(x, x1 + k, x)
        a10, a11, a12, a13 = mac(a10, u, v0), mac(a11, u, v1), mac(a12, u, v2), mac(a13, u, v3)
    _store4(out, r, o, a00, a01, a02, a03)
    _store4(out, r + 1, o, a10, a11, a12, a13)


@numba.njit(nogil=True, cache=True, inline="always")
def _rows3(x, w, out, o, r, l1):
    """out[r:r+3, o:o+4] = x[r:r+3] @ w[o:o+4].T, each output summed as ``_rows1`` sums it."""
    n = x.shape[1]
    x0, x1, x2 = r * n, (r + 1) * n, (r + 2) * n
    w0, w1, w2, w3 = o * n, (o + 1) * n, (o + 2) * n, (o + 3) * n
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = a20 = a21 = a22 = a23 = zeros()
    for k in range(0, n, width(x)):
        _prefetch4(w, w0 + k, w1 + k, w2 + k, w3 + k, width(x), l1)
        v0 = operand(w, w0 + k, x)
        v1 = operand(w, w1 + k, x)
        v2 = operand(w, w2 + k, x)
        v3 = operand(w, w3 + k, x)
        u = operand(x, x0 + k, x)
        a00, a01, a02, a03 = mac(a00, u, v0), mac(a01, u, v1), mac(a02, u, v2), mac(a03, u, v3)
        u = operand(x, x1 + k, x)
        a10, a11, a12, a13 = mac(a10, u, v0), mac(a11, u, v1), mac(a12, u, v2), mac(a13, u, v3)
        u = operand(x, x2 + k, x)
        a20, a21, a22, a23 = mac(a20, u, v0), mac(a21, u, v1), mac(a22, u, v2), mac(a23, u, v3)
    _store4(out, r, o, a00, a01, a02, a03)
    _store4(out, r + 1, o, a10, a11, a12, a13)
    _store4(out, r + 2, o, a20, a21, a22, a23)


@numba.njit(nogil=True, cache=True, inline="always")
def _rows6(x, w, out, o, r, l1):
    """out[r:r+6, o:o+4] = x[r:r+6] @ w[o:o+4].T, each output summed as ``_rows1`` sums it."""
    n = x.shape[1]
    x0, x1, x2, x3, x4, x5 = r * n, (r + 1) * n, (r + 2) * n, (r + 3) * n, (r + 4) * n, (r + 5) * n
    w0, w1, w2, w3 = o * n, (o + 1) * n, (o + 2) * n, (o + 3) * n
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = a20 = a21 = a22 = a23 = zeros()
    a30 = a31 = a32 = a33 = a40 = a41 = a42 = a43 = a50 = a51 = a52 = a53 = zeros()
    for k in range(0, n, width(x)):
        _prefetch4(w, w0 + k, w1 + k, w2 + k, w3 + k, width(x), l1)
        v0 = operand(w, w0 + k, x)
        v1 = operand(w, w1 + k, x)
        v2 = operand(w, w2 + k, x)
        v3 = operand(w, w3 + k, x)
        u = operand(x, x0 + k, x)
        a00, a01, a02, a03 = mac(a00, u, v0), mac(a01, u, v1), mac(a02, u, v2), mac(a03, u, v3)
        u = operand(x, x1 + k, x)
        a10, a11, a12, a13 = mac(a10, u, v0), mac(a11, u, v1), mac(a12, u, v2), mac(a13, u, v3)
        u = operand(x, x2 + k, x)
        a20, a21, a22, a23 = mac(a20, u, v0), mac(a21, u, v1), mac(a22, u, v2), mac(a23, u, v3)
        u = operand(x, x3 + k, x)
        a30, a31, a32, a33 = mac(a30, u, v0), mac(a31, u, v1), mac(a32, u, v2), mac(a33, u, v3)
        u = operand(x, x4 + k, x)
        a40, a41, a42, a43 = mac(a40, u, v0), mac(a41, u, v1), mac(a42, u, v2), mac(a43, u, v3)
        u = operand(x, x5 + k, x)
        a50, a51, a52, a53 = mac(a50, u, v0), mac(a51, u, v1), mac(a52, u, v2), mac(a53, u, v3)
    _store4(out, r, o, a00, a01, a02, a03)
    _store4(out, r + 1, o, a10, a11, a12, a13)
    _store4(out, r + 2, o, a20, a21, a22, a23)
    _store4(out, r + 3, o, a30, a31, a32, a33)
    _store4(out, r + 4, o, a40, a41, a42, a43)
    _store4(out, r + 5, o, a50, a51, a52, a53)


@numba.njit(nogil=True, cache=True, inline="always")
def _rows_left(x, w, out, o, r, left, l1):
    """out[r:r+left, o:o+4] for the 1..5 rows left after the groups of six:
    ``_rows3``, ``_rows2`` and ``_rows1`` passes (the weight rows come from
    cache after the first), so a short verification does the arithmetic of
    its own rows, not of a zero-padded six."""
    if left >= 3:
        _rows3(x, w, out, o, r, l1)
        r += 3
        left -= 3
    if left == 2:
        _rows2(x, w, out, o, r, l1)
    elif left == 1:
        _rows1(x, w, out, o, r, l1)


@numba.njit(nogil=True, cache=True, inline="always")
def _gemm(x, w, out, chunks, l1):
    """out = x @ w.T for x [R, in], w [out, in] (out a multiple of OUT_BLOCK,
    in of LANES), out [R, out]; the output blocks split into `chunks` ranges
    run in parallel. Rows six at a time, the rest by ``_rows_left``. Inlined
    into ``_gemm_l2`` / ``_gemm_l1``, where ``l1`` is a constant: a function
    passed in from Python costs ~6.5 us a call to unbox (~6-9 % of a
    one-row SmolLM2 pass, measured against constant prefetches)."""
    rows = x.shape[0]
    whole = rows - rows % GROUP
    blocks = w.shape[0] // OUT_BLOCK
    per = (blocks + chunks - 1) // chunks
    for c in numba.prange(chunks):
        for blk in range(c * per, min(blocks, (c + 1) * per)):
            for o in range(OUT_BLOCK * blk, OUT_BLOCK * (blk + 1), OUTS):
                for r in range(0, whole, GROUP):
                    _rows6(x, w, out, o, r, l1)
                _rows_left(x, w, out, o, whole, rows - whole, l1)


@numba.njit(nogil=True, cache=True, parallel=True)
def _gemm_l2(x, w, out, chunks):
    """``_gemm`` prefetching into L2 ("simd")."""
    _gemm(x, w, out, chunks, _into_l2)


@numba.njit(nogil=True, cache=True, parallel=True)
def _gemm_l1(x, w, out, chunks):
    """``_gemm`` prefetching into L1 ("simd-l1")."""
    _gemm(x, w, out, chunks, _into_l1)


@numba.njit(nogil=True, cache=True, error_model="numpy")
def _round_bf16(x, out):
    """out[r, :in] = x's rows rounded to bfloat16 (nearest, ties to even, as
    torch rounds; NaN stays NaN) as bit patterns; out's padding is left alone."""
    bits = x.view(np.uint32)
    for r in range(x.shape[0]):
        for i in range(x.shape[1]):
            u = np.uint32(bits[r, i])
            rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
            nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
            out[r, i] = np.uint16(0x7FC0 if nan else rounded)


def round_bf16(x: np.ndarray, padded_width: int) -> np.ndarray:
    """float32 [R, in] -> uint16 bfloat16 bit patterns [R, padded_width], zeros after in."""
    out = np.zeros((x.shape[0], padded_width), np.uint16)
    _round_bf16(np.ascontiguousarray(x, dtype=np.float32), out)
    return out


def step(pairs: bool) -> int:
    """Input values per step of the kernels: 2 LANES bfloat16 values in a pair
    step (AVX512-BF16 dot products), else LANES float32 lanes."""
    return 2 * LANES if pairs else LANES


def padded_in(in_features: int, pairs: bool = False) -> int:
    """`in` rounded up to a multiple of the kernels' step."""
    return -(-in_features // step(pairs)) * step(pairs)


def pad_weight(weight: np.ndarray, pairs: bool = False) -> np.ndarray:
    """float32 (or bfloat16 bits as uint16) [out, in] -> contiguous [out
    rounded up to OUT_BLOCK, in rounded up to the step (``padded_in``)],
    zeros added; the weight itself (no copy) when it already is."""
    out = -(-weight.shape[0] // OUT_BLOCK) * OUT_BLOCK
    width = padded_in(weight.shape[1], pairs)
    if (out, width) == weight.shape and weight.flags.c_contiguous:
        return weight
    padded = np.zeros((out, width), weight.dtype)
    padded[:weight.shape[0], :weight.shape[1]] = weight
    return padded


def gemm(x: np.ndarray, weight: np.ndarray, chunks: int, pairs: bool = False, l1: bool = False) -> np.ndarray:
    """x float32 [R, in] @ the padded weight's transpose -> float32 [R, padded
    out]. weight: float32, or uint16 holding bfloat16 bit patterns (half the
    bytes to read; each value widened to float32 exactly, then summed as a
    float32 weight would be: same order, so just as row-count invariant).

    pairs (bfloat16 weights padded for it, and ``has_dpbf16()`` only): x is
    rounded to bfloat16 first and every step is AVX512-BF16's dot product of
    2 LANES bfloat16 values (``simd.mac`` on pairs): half the instructions of
    the float32 arithmetic, bfloat16 activations (as a bfloat16 model runs in
    transformers), and again one fixed order per output, whatever the rows.

    l1: prefetch the weight into L1 instead of L2 (the same bits)."""
    if pairs:
        assert weight.dtype == np.uint16 and weight.shape[1] % step(True) == 0
        x = round_bf16(x, weight.shape[1])
    else:
        if x.shape[1] != weight.shape[1]:
            x = np.pad(x, ((0, 0), (0, weight.shape[1] - x.shape[1])))
        x = np.ascontiguousarray(x, dtype=np.float32)
        assert weight.dtype in (np.float32, np.uint16) and weight.shape[1] % LANES == 0
    assert weight.flags.c_contiguous
    out = np.empty((x.shape[0], weight.shape[0]), np.float32)
    with LAUNCH_LOCK:
        set_team(chunks)
        (_gemm_l1 if l1 else _gemm_l2)(x, weight, out, chunks)
    return out


kernel_cache.refresh(globals())  # numba keys its cache by this file only: flush it when any kernel source changed
