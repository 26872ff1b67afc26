"""A float32 GEMM for small row counts written for the shapes of decoding:
each output is the dot product of an input row and a weight row, computed by
the same compiled loop whatever the number of rows, so a row's result never
depends on the rows beside it (row-count invariance by construction; the
selector still checks it on the machine, ``gemm_select.invariance_failure``).

Why: a decode step multiplies one row by every weight of the model, which is
a matrix-vector product bound by memory bandwidth. BLAS libraries tune for
larger GEMMs: on 2 cores of an AVX2 AMD EPYC, oneDNN's prepacked float32
path read SmolLM2's 537 MB of projection weights at ~11 GB/s and MKL at ~8,
while a sum over the same bytes reads at ~26 GB/s. This kernel streams each
weight row once per pair of input rows and reaches ~18 GB/s there (1 row:
29 ms against oneDNN's 50; 6 rows: 40 ms against 56;
``python benchmarks/bench_forward.py`` prints the selector's timings).

Layout and order of operations: the weight is kept as [out, in] float32,
out zero-padded to a multiple of ``OUT_BLOCK``. The kernel takes the input
rows two at a time (an odd last row is paired with a zero row) and the
outputs ``OUT_BLOCK`` at a time, and computes those 8 dot products in one
loop over ``in``; with reassociation allowed, LLVM vectorises that loop
along ``in`` with one vector accumulator per dot product, the same for each
of the 8, and every (row pair, output block) runs
the same loop: so each output's summation order is fixed by ``in`` alone.
Threads (numba ``prange``) split the output blocks, never a dot product.

Only float32: bfloat16 weights take oneDNN where the CPU computes bfloat16
natively, and anywhere else this path is refused for them by name.
"""
from __future__ import annotations

import threading

import numba
import numpy as np

#: Outputs computed together (weight rows streamed side by side; ``_block`` is written for 4).
OUT_BLOCK = 4

_FASTMATH = {"reassoc", "contract"}
# numba's "workqueue" threading layer (where neither OpenMP nor TBB loads)
# must not be entered by two threads at once; engines in one process take turns.
_LAUNCH = threading.Lock()


@numba.njit(nogil=True, fastmath=_FASTMATH, cache=True, inline="always")
def _block(x, w, out, o, r):
    """out[r:r+2, o:o+4] = x[r:r+2] @ w[o:o+4].T, one loop over in."""
    w0 = w[o]
    w1 = w[o + 1]
    w2 = w[o + 2]
    w3 = w[o + 3]
    xa = x[r]
    xb = x[r + 1]
    a0 = a1 = a2 = a3 = np.float32(0.0)
    b0 = b1 = b2 = b3 = np.float32(0.0)
    for k in range(x.shape[1]):
        u = xa[k]
        v = xb[k]
        a0 += u * w0[k]
        a1 += u * w1[k]
        a2 += u * w2[k]
        a3 += u * w3[k]
        b0 += v * w0[k]
        b1 += v * w1[k]
        b2 += v * w2[k]
        b3 += v * w3[k]
    out[r, o] = a0
    out[r, o + 1] = a1
    out[r, o + 2] = a2
    out[r, o + 3] = a3
    out[r + 1, o] = b0
    out[r + 1, o + 1] = b1
    out[r + 1, o + 2] = b2
    out[r + 1, o + 3] = b3


@numba.njit(nogil=True, fastmath=_FASTMATH, cache=True, parallel=True)
def _gemm(x, w, out, chunks):
    """out = x @ w.T for x [R, in], w [out, in] (out a multiple of
    OUT_BLOCK), out [R, out]; the output blocks split into `chunks` ranges
    run in parallel. An odd last row goes through the same loop paired with
    a zero row (in a scratch pair), so it sums exactly like the others."""
    rows = x.shape[0]
    even = rows - rows % 2
    blocks = w.shape[0] // OUT_BLOCK
    per = (blocks + chunks - 1) // chunks
    for c in numba.prange(chunks):
        pair = np.zeros((2, x.shape[1]), np.float32)
        pair_out = np.empty((2, w.shape[0]), np.float32)
        if even < rows:
            pair[0] = x[even]
        for blk in range(c * per, min(blocks, (c + 1) * per)):
            for r in range(0, even, 2):
                _block(x, w, out, OUT_BLOCK * blk, r)
            if even < rows:
                _block(pair, w, pair_out, OUT_BLOCK * blk, 0)
                for j in range(OUT_BLOCK * blk, OUT_BLOCK * (blk + 1)):
                    out[even, j] = pair_out[0, j]


def pad_weight(weight: np.ndarray) -> np.ndarray:
    """float32 [out, in] -> contiguous [out rounded up to OUT_BLOCK, in], zero
    rows added; the weight itself (no copy) when it already is."""
    out = -(-weight.shape[0] // OUT_BLOCK) * OUT_BLOCK
    if out == weight.shape[0] and weight.flags.c_contiguous:
        return weight
    padded = np.zeros((out, weight.shape[1]), np.float32)
    padded[:weight.shape[0]] = weight
    return padded


def gemm(x: np.ndarray, weight: np.ndarray, chunks: int) -> np.ndarray:
    """x float32 [R, in] (contiguous) @ the padded weight's transpose ->
    float32 [R, padded out]."""
    out = np.empty((x.shape[0], weight.shape[0]), np.float32)
    with _LAUNCH:
        _gemm(x, weight, out, chunks)
    return out


def warm_up() -> None:
    """Compiles (or loads from numba's cache) the kernel for the argument
    types ``gemm`` passes, so the first forward pass does not wait."""
    gemm(np.zeros((1, 8), np.float32), np.zeros((OUT_BLOCK, 8), np.float32), 1)
