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
out zero-padded to a multiple of ``OUT_BLOCK`` (8). The kernel takes the
input rows two at a time (an odd last row is paired with a zero row) and the
outputs 8 at a time, and computes those 16 dot products in one loop over
``in`` (``_block``; 10 loads per 16 multiply-adds, where the 2 x 4 block
before it did 6 per 8: on 2 cores of an AVX-512 AMD EPYC, SmolLM2's
projections at 1 / 6 / 32 rows went from ~24 / 31 / 73 ms to ~21 / 26 /
64 ms); with reassociation allowed, LLVM vectorises that loop along ``in``
with one vector accumulator per dot product, the same for each of the 16,
and every (row pair, output block) runs the same loop: so each output's
summation order is fixed by ``in`` alone. Threads (numba ``prange``) split
the output blocks, never a dot product.

Only float32: bfloat16 weights take oneDNN where the CPU computes bfloat16
natively, and anywhere else this path is refused for them by name.

Three GEMM paths (``GROUP_ROWS``). "numba" takes the rows two at a time as
above, row-invariant by construction. "numba1" is the same, except that a
lone row (the decode step) runs ``_block1``, the one-row form of the same
loop, instead of being paired with a zero row: half the arithmetic, and
~19 ms instead of ~21 there (~29 GB/s, against ~23 GB/s for numpy's sum of
the same bytes on one core). It is row-invariant only where LLVM vectorises
the one-row and two-row loops alike (vector width and interleave are LLVM's
choice, made per loop): it did on that EPYC for every width tried, but
nothing guarantees it, so the selector's check decides, on the machine, and
"auto" never takes it where a lone row sums differently. "numba6" takes the
rows six at a time, two outputs per pass (``_k6x2``: 12 dot products in one
loop over ``in``, which runs in chunks of ``CHUNK`` values, each chunk
vectorised the same way, then the ``in % CHUNK`` tail), the last rows padded
with zero rows to six. Six rows read each weight value once, where pairs
read it three times, so verifying k = 5 drafts costs about what one decode
step costs; a 6-row pass does 6x the arithmetic of one row, which only pays
where the CPU computes faster than it reads memory, and the selector times
both on the machine. Its 12 multiply-adds per two loads would leave the
memory idle between reads, so each chunk first prefetches the weight
``PREFETCH_AHEAD`` values further on (a prefetch changes no result).
"""
from __future__ import annotations

import threading

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from specdec.engine import kernel_cache

#: Outputs computed together (weight rows streamed side by side; ``_block`` is written for 8).
OUT_BLOCK = 8
#: Rows per kernel pass of each path's kernel ("numba", "numba1": ``_block``, "numba6": ``_k6x2``).
GROUP_ROWS = {"numba": 2, "numba1": 2, "numba6": 6}
#: Values of ``in`` per vectorised chunk of ``_k6x2`` (a whole number of cache lines).
CHUNK = 64
#: float32 values per 64-byte cache line (one prefetch each).
LINE_FLOATS = 16
#: How far ahead of a chunk (in weight values, flat) ``_k6x2`` prefetches.
PREFETCH_AHEAD = 2048

_FASTMATH = {"reassoc", "contract"}
# numba's "workqueue" threading layer (where neither OpenMP nor TBB loads)
# must not be entered by two threads at once; engines in one process (and
# gemm_simd's kernel) take turns.
LAUNCH_LOCK = threading.Lock()
_team = threading.local()  # .size: the numba thread count last set on this thread


def set_team(threads: int) -> None:
    """Sets the team of the parallel kernels this thread launches next to
    `threads` numba threads (at most numba's pool; numba keeps the count per
    launching thread). Call it under LAUNCH_LOCK, with the number of parallel
    chunks the kernel will run: by default every region takes the whole pool
    (one thread per core), and its join waits for threads that have nothing to
    do, each of which, on a loaded machine, may first wait for a time slice: a
    0.3 ms stories260K decode step on one thread took 120-160 ms with one of
    the two cores busy, and 0.3 ms with the team set to its one chunk."""
    size = max(1, min(threads, numba.config.NUMBA_NUM_THREADS))  # type: ignore[attr-defined]  # set at runtime
    if getattr(_team, "size", None) != size:
        numba.set_num_threads(size)
        _team.size = size


@intrinsic
def prefetch(typingctx, array, index):
    """Hint the CPU to bring float32 array's flat element `index` into cache
    (LLVM's prefetch: changes no value, never faults, beyond the end too)."""
    def codegen(context, builder, signature, args):
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        data = builder.bitcast(arr.data, ir.IntType(8).as_pointer())
        address = builder.gep(data, [builder.mul(args[1], context.get_constant(types.intp, 4))])
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [address.type, i32, i32, i32]), "llvm.prefetch.p0")
        builder.call(fn, [address, i32(0), i32(3), i32(1)])  # a read, kept in every cache level, data
        return context.get_dummy_value()
    return types.void(array, index), codegen


@numba.njit(nogil=True, fastmath=_FASTMATH, cache=True, inline="always")
def _block(x, w, out, o, r):
    """out[r:r+2, o:o+8] = x[r:r+2] @ w[o:o+8].T, one loop over in."""
    w0 = w[o]
    w1 = w[o + 1]
    w2 = w[o + 2]
    w3 = w[o + 3]
    w4 = w[o + 4]
    w5 = w[o + 5]
    w6 = w[o + 6]
    w7 = w[o + 7]
    xa = x[r]
    xb = x[r + 1]
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
    b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = np.float32(0.0)
    for k in range(x.shape[1]):
        v0 = w0[k]
        v1 = w1[k]
        v2 = w2[k]
        v3 = w3[k]
        v4 = w4[k]
        v5 = w5[k]
        v6 = w6[k]
        v7 = w7[k]
        u = xa[k]
        a0 += u * v0
        a1 += u * v1
        a2 += u * v2
        a3 += u * v3
        a4 += u * v4
        a5 += u * v5
        a6 += u * v6
        a7 += u * v7
        u = xb[k]
        b0 += u * v0
        b1 += u * v1
        b2 += u * v2
        b3 += u * v3
        b4 += u * v4
        b5 += u * v5
        b6 += u * v6
        b7 += u * v7
    _store8(out, r, o, a0, a1, a2, a3, a4, a5, a6, a7)
    _store8(out, r + 1, o, b0, b1, b2, b3, b4, b5, b6, b7)


@numba.njit(nogil=True, fastmath=_FASTMATH, cache=True, inline="always")
def _block1(x, w, out, o, r):
    """out[r, o:o+8] = x[r] @ w[o:o+8].T: ``_block``'s loop for one row (the
    "numba1" path; the same summation order as ``_block`` only where the
    compiler vectorises both loops alike, which the selector checks)."""
    w0 = w[o]
    w1 = w[o + 1]
    w2 = w[o + 2]
    w3 = w[o + 3]
    w4 = w[o + 4]
    w5 = w[o + 5]
    w6 = w[o + 6]
    w7 = w[o + 7]
    xa = x[r]
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
    for k in range(x.shape[1]):
        v0 = w0[k]
        v1 = w1[k]
        v2 = w2[k]
        v3 = w3[k]
        v4 = w4[k]
        v5 = w5[k]
        v6 = w6[k]
        v7 = w7[k]
        u = xa[k]
        a0 += u * v0
        a1 += u * v1
        a2 += u * v2
        a3 += u * v3
        a4 += u * v4
        a5 += u * v5
        a6 += u * v6
        a7 += u * v7
    _store8(out, r, o, a0, a1, a2, a3, a4, a5, a6, a7)


@numba.njit(nogil=True, cache=True, inline="always")
def _store8(out, r, o, a0, a1, a2, a3, a4, a5, a6, a7):
    out[r, o] = a0
    out[r, o + 1] = a1
    out[r, o + 2] = a2
    out[r, o + 3] = a3
    out[r, o + 4] = a4
    out[r, o + 5] = a5
    out[r, o + 6] = a6
    out[r, o + 7] = a7


@numba.njit(nogil=True, fastmath=_FASTMATH, cache=True, parallel=True)
def _gemm(x, w, out, chunks, lone):
    """out = x @ w.T for x [R, in], w [out, in] (out a multiple of
    OUT_BLOCK), out [R, out]; the output blocks split into `chunks` ranges
    run in parallel. An odd last row goes through ``_block1`` when `lone`
    (path "numba1"), else through ``_block`` paired with a zero row (in a
    scratch pair), so that it sums exactly like the others ("numba")."""
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
            o = OUT_BLOCK * blk
            for r in range(0, even, 2):
                _block(x, w, out, o, r)
            if even < rows:
                if lone:
                    _block1(x, w, out, o, even)
                else:
                    _block(pair, w, pair_out, o, 0)
                    for j in range(o, o + OUT_BLOCK):
                        out[even, j] = pair_out[0, j]


@numba.njit(nogil=True, fastmath=_FASTMATH, cache=True, inline="always")
def _k6x2(x, w, out, o, r):
    """out[r:r+6, o:o+2] = x[r:r+6] @ w[o:o+2].T."""
    n = x.shape[1]
    whole = n - n % CHUNK
    ahead = o * n + PREFETCH_AHEAD
    x0 = x[r]
    x1 = x[r + 1]
    x2 = x[r + 2]
    x3 = x[r + 3]
    x4 = x[r + 4]
    x5 = x[r + 5]
    w0 = w[o]
    w1 = w[o + 1]
    a00 = a01 = a10 = a11 = a20 = a21 = a30 = a31 = a40 = a41 = a50 = a51 = np.float32(0.0)
    for start in range(0, whole, CHUNK):
        for line in range(ahead + start, ahead + start + 2 * n, n):
            for q in range(0, CHUNK, LINE_FLOATS):
                prefetch(w, line + q)
        for k in range(start, start + CHUNK):
            a00 += x0[k] * w0[k]
            a01 += x0[k] * w1[k]
            a10 += x1[k] * w0[k]
            a11 += x1[k] * w1[k]
            a20 += x2[k] * w0[k]
            a21 += x2[k] * w1[k]
            a30 += x3[k] * w0[k]
            a31 += x3[k] * w1[k]
            a40 += x4[k] * w0[k]
            a41 += x4[k] * w1[k]
            a50 += x5[k] * w0[k]
            a51 += x5[k] * w1[k]
    for k in range(whole, n):
        a00 += x0[k] * w0[k]
        a01 += x0[k] * w1[k]
        a10 += x1[k] * w0[k]
        a11 += x1[k] * w1[k]
        a20 += x2[k] * w0[k]
        a21 += x2[k] * w1[k]
        a30 += x3[k] * w0[k]
        a31 += x3[k] * w1[k]
        a40 += x4[k] * w0[k]
        a41 += x4[k] * w1[k]
        a50 += x5[k] * w0[k]
        a51 += x5[k] * w1[k]
    out[r, o] = a00
    out[r, o + 1] = a01
    out[r + 1, o] = a10
    out[r + 1, o + 1] = a11
    out[r + 2, o] = a20
    out[r + 2, o + 1] = a21
    out[r + 3, o] = a30
    out[r + 3, o + 1] = a31
    out[r + 4, o] = a40
    out[r + 4, o + 1] = a41
    out[r + 5, o] = a50
    out[r + 5, o + 1] = a51



@numba.njit(nogil=True, fastmath=_FASTMATH, cache=True, parallel=True)
def _gemm6(x, w, out, chunks):
    """_gemm with rows six at a time (``_k6x2``, two outputs per pass); the
    last rows, fewer than six, go through the same call with zero rows
    beside them (a scratch group), so they sum exactly like the others."""
    rows = x.shape[0]
    whole = rows - rows % 6
    blocks = w.shape[0] // OUT_BLOCK
    per = (blocks + chunks - 1) // chunks
    for c in numba.prange(chunks):
        group = np.zeros((6, x.shape[1]), np.float32)
        group_out = np.empty((6, w.shape[0]), np.float32)
        for j in range(rows - whole):
            group[j] = x[whole + j]
        for blk in range(c * per, min(blocks, (c + 1) * per)):
            o = OUT_BLOCK * blk
            for r in range(0, rows, 6):
                src = x if r < whole else group
                dst = out if r < whole else group_out
                first = r if r < whole else 0
                for half in range(0, OUT_BLOCK, 2):
                    _k6x2(src, w, dst, o + half, first)
            for j in range(rows - whole):
                for i in range(o, o + OUT_BLOCK):
                    out[whole + j, i] = group_out[j, i]


def pad_weight(weight: np.ndarray) -> np.ndarray:
    """float32 [out, in] -> contiguous [out rounded up to OUT_BLOCK, in], zero
    rows added; the weight itself (no copy) when it already is."""
    out = -(-weight.shape[0] // OUT_BLOCK) * OUT_BLOCK
    if out == weight.shape[0] and weight.flags.c_contiguous:
        return weight
    padded = np.zeros((out, weight.shape[1]), np.float32)
    padded[:weight.shape[0]] = weight
    return padded


def gemm(x: np.ndarray, weight: np.ndarray, chunks: int, path: str = "numba") -> np.ndarray:
    """x float32 [R, in] (contiguous) @ the padded weight's transpose ->
    float32 [R, padded out], through the kernel of `path` (a GROUP_ROWS name)."""
    if path not in GROUP_ROWS:
        raise ValueError(f"no numba GEMM kernel {path!r}; one of {sorted(GROUP_ROWS)}")
    out = np.empty((x.shape[0], weight.shape[0]), np.float32)
    with LAUNCH_LOCK:
        set_team(chunks)
        if path == "numba6":
            _gemm6(x, weight, out, chunks)
        else:
            _gemm(x, weight, out, chunks, path == "numba1")
    return out


kernel_cache.refresh(globals())  # numba keys its cache by this file only: flush it when any kernel source changed
