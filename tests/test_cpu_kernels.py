"""The float32 CPU kernels of the shared model runtime (engine.gemm_numba,
engine.cpu_ops): each agrees with the torch formulation it replaces, and a
row's result is bitwise the same whatever rows share the call (what keeps
speculation lossless, llama's module doc)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from specdec.engine import cpu_ops, gemm_numba, gemm_select, gemm_simd
from specdec.engine.gemm_select import GEMM_PATHS, Linear, check_row_counts, path_failure
from specdec.engine.llama import apply_rope, rms_norm, rope_inv_freq, rope_tables
from specdec.engine.simd import has_dpbf16


def rows_alone_equal_rows_together(fn, x: torch.Tensor) -> None:
    """fn applied to all of x equals, bitwise, fn applied to each row alone
    and to every prefix of x (row counts 1 .. len(x))."""
    together = fn(x)
    for r in range(len(x)):
        assert torch.equal(fn(x[r:r + 1])[0], together[r]), f"row {r} alone"
    for n in range(1, len(x)):
        assert torch.equal(fn(x[:n]), together[:n]), f"first {n} rows"


NUMBA_PATHS = list(gemm_numba.GROUP_ROWS)
#: Paths whose rows are invariant by construction; "numba1" only where the
#: compiler vectorises its one-row loop like the two-row one (the check decides).
INVARIANT_BY_CONSTRUCTION = ("numba", "numba6")


@pytest.mark.parametrize("path", NUMBA_PATHS)
@pytest.mark.parametrize("out_features,in_features", [(12, 16), (13, 37), (96, 576), (5, 3), (10, 200)])
@pytest.mark.parametrize("threads", [1, 2])
def test_numba_gemm_matches_torch_and_keeps_rows_invariant(out_features, in_features, threads, path):
    """13 rows: every remainder of both paths' row groups (2 and 6), and for
    numba6 in = 200 and 576 meet the chunked loop with and without a tail."""
    gen = torch.Generator().manual_seed(out_features)
    w = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen)
    x = torch.randn(13, in_features, generator=gen)
    torch.set_num_threads(threads)
    try:
        linear = Linear(w, b, GEMM_PATHS[path])
        assert linear.threads == threads
        y = linear(x)
        assert y.shape == (13, out_features)
        torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-4)  # sums of up to 576 products ~1
        try:
            rows_alone_equal_rows_together(linear, x)
        except AssertionError:
            if path in INVARIANT_BY_CONSTRUCTION:
                raise
            # where a lone row sums differently here, the selector must refuse the path
            assert path_failure(GEMM_PATHS[path], [("w", w, b)], check_row_counts(16), torch.float32)
    finally:
        torch.set_num_threads(2)


@pytest.mark.parametrize("path", NUMBA_PATHS)
def test_numba_gemm_splits_outputs_not_dot_products(path):
    """The thread count changes which thread computes an output block, never
    its sum: 1, 2 and 3 chunks give the same bits."""
    w = gemm_numba.pad_weight(np.random.default_rng(0).standard_normal((50, 300)).astype(np.float32))
    x = np.random.default_rng(1).standard_normal((8, 300)).astype(np.float32)
    outs = [gemm_numba.gemm(x, w, chunks, path) for chunks in (1, 2, 3)]
    assert w.shape[0] % gemm_numba.OUT_BLOCK == 0 and not w[50:].any()
    assert np.array_equal(outs[0], outs[1]) and np.array_equal(outs[0], outs[2])
    lone = [gemm_numba.gemm(x[:1], w, chunks, path) for chunks in (1, 2, 3)]  # numba1's one-row loop too
    assert np.array_equal(lone[0], lone[1]) and np.array_equal(lone[0], lone[2])


def test_numba_gemm_names_an_unknown_kernel():
    with pytest.raises(ValueError, match="no numba GEMM kernel 'numba7'"):
        gemm_numba.gemm(np.zeros((1, 8), np.float32), np.zeros((8, 8), np.float32), 1, "numba7")


def test_numba1_differs_from_numba_only_in_how_a_lone_row_runs():
    """Pairs of rows take the same loop in both paths: bitwise the same."""
    rng = np.random.default_rng(3)
    w = gemm_numba.pad_weight(rng.standard_normal((40, 576)).astype(np.float32))
    x = rng.standard_normal((6, 576)).astype(np.float32)
    assert np.array_equal(gemm_numba.gemm(x, w, 2, "numba"), gemm_numba.gemm(x, w, 2, "numba1"))


def test_numba_linear_keeps_one_copy_of_a_weight_that_needs_no_padding():
    w = torch.randn(8, 16)
    linear = Linear(w, None, GEMM_PATHS["numba"])
    assert np.shares_memory(linear._padded, w.numpy())  # no second copy of the model's weights
    padded = Linear(torch.randn(6, 16), None, GEMM_PATHS["numba"])
    assert padded._padded.shape == (8, 16) and padded.weight.shape == (6, 16)


@pytest.mark.parametrize("out_features,in_features", [(12, 16), (13, 37), (96, 576), (5, 3), (10, 200), (8, 1536)])
@pytest.mark.parametrize("threads", [1, 2])
def test_simd_gemm_matches_torch_and_keeps_rows_invariant_by_construction(out_features, in_features, threads):
    """13 rows: two groups of six and a lone row, and every prefix (left-overs
    of 1 to 5 rows: the one-, two- and three-row kernels); in = 37,
    5, 200 are padded to LANES. Invariant on every CPU: asserted, never
    left to the selector."""
    gen = torch.Generator().manual_seed(out_features)
    w = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen)
    x = torch.randn(13, in_features, generator=gen)
    torch.set_num_threads(threads)
    try:
        linear = Linear(w, b, GEMM_PATHS["simd"])
        y = linear(x)
        assert y.shape == (13, out_features) and linear.weight.shape == (out_features, in_features)
        torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
        rows_alone_equal_rows_together(linear, x)
    finally:
        torch.set_num_threads(2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features,in_features", [(13, 37), (96, 576), (8, 1536)])
def test_simd_l1_prefetches_elsewhere_and_computes_the_same_bits(out_features, in_features, dtype):
    """"simd-l1" differs from "simd" only in where its prefetches put the
    weight: every row count, both weight dtypes, bit for bit the same (so
    the selector may take whichever streams faster)."""
    gen = torch.Generator().manual_seed(in_features)
    w = torch.randn(out_features, in_features, generator=gen).to(dtype)
    b = torch.randn(out_features, generator=gen)
    x = torch.randn(13, in_features, generator=gen)
    l1, l2 = Linear(w, b, GEMM_PATHS["simd-l1"]), Linear(w, b, GEMM_PATHS["simd"])
    assert l1.l1 and not l2.l1
    for rows in (1, 2, 3, 4, 5, 6, 7, 13):
        assert torch.equal(l1(x[:rows]), l2(x[:rows]))
    rows_alone_equal_rows_together(l1, x)


def _fma32(acc: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """float32 a * b + acc rounded once: the product is exact in float64 and
    the sum in 80-bit long double, then one rounding to float32."""
    return (a.astype(np.longdouble) * b.astype(np.longdouble) + acc.astype(np.longdouble)).astype(np.float32)


def stated_order(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """gemm_simd's module doc, written with numpy: per output, LANES lane
    accumulators over in (zero-padded) in steps of LANES, then the lanes'
    halves added pairwise in float32. x [R, in], w [out, in] -> [R, out]."""
    lanes = gemm_simd.LANES
    width = gemm_simd.padded_in(x.shape[1])
    xp = np.zeros((x.shape[0], width), np.float32)
    xp[:, :x.shape[1]] = x
    wp = np.zeros((w.shape[0], width), np.float32)
    wp[:, :w.shape[1]] = w
    acc = np.zeros((x.shape[0], w.shape[0], lanes), np.float32)
    for k in range(0, width, lanes):
        acc = _fma32(acc, xp[:, None, k:k + lanes], wp[None, :, k:k + lanes])
    while acc.shape[-1] > 1:
        half = acc.shape[-1] // 2
        acc = acc[..., :half] + acc[..., half:]
    return acc[..., 0]


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 9, 11])
def test_simd_gemm_sums_in_the_order_its_doc_states(rows):
    """The summation order is the kernel's contract (what makes it row-count
    invariant on every CPU): bitwise equal to the order written with numpy."""
    rng = np.random.default_rng(rows)
    w = rng.standard_normal((24, 200)).astype(np.float32)
    x = rng.standard_normal((rows, 200)).astype(np.float32)
    got = gemm_simd.gemm(x, gemm_simd.pad_weight(w), 2)[:, :24]
    assert np.array_equal(got, stated_order(x, w))
    assert not np.array_equal(got, (x.astype(np.float64) @ w.T.astype(np.float64)).astype(np.float32))  # an order shows


def test_simd_kernels_are_entered_with_arrays_and_integers_only():
    """Each prefetch variant has its own compiled entry: a function passed
    from Python to choose one costs ~6.5 us a call to unbox (6-9 % of a
    one-row SmolLM2 pass, ~200 GEMMs), a cost no timing test would catch."""
    from numba.core import types

    w = gemm_simd.pad_weight(np.ones((16, 16), np.float32))
    for l1 in (False, True):
        gemm_simd.gemm(np.ones((1, 16), np.float32), w, 1, l1=l1)
    entries = [gemm_simd._gemm_l1, gemm_simd._gemm_l2]
    assert all(kernel.signatures for kernel in entries)
    for kernel in entries:
        for signature in kernel.signatures:
            assert all(isinstance(t, (types.Array, types.Integer)) for t in signature), signature


def test_simd_gemm_splits_outputs_not_dot_products():
    w = gemm_simd.pad_weight(np.random.default_rng(0).standard_normal((50, 300)).astype(np.float32))
    x = np.random.default_rng(1).standard_normal((8, 300)).astype(np.float32)
    assert w.shape == (56, 304) and not w[50:].any() and not w[:, 300:].any()
    for rows in (x, x[:1]):
        outs = [gemm_simd.gemm(rows, w, chunks) for chunks in (1, 2, 3)]
        assert np.array_equal(outs[0], outs[1]) and np.array_equal(outs[0], outs[2])


@pytest.mark.parametrize("path", NUMBA_PATHS)
def test_numba_gemm_refuses_bfloat16_by_saying_so(path):
    with pytest.raises(RuntimeError, match="takes torch.float32 weights on CPU only"):
        Linear(torch.zeros(4, 4, dtype=torch.bfloat16), None, GEMM_PATHS[path])


def test_simd_gemm_refuses_other_weight_dtypes_by_saying_so():
    with pytest.raises(RuntimeError, match="takes torch.float32 or torch.bfloat16 weights on CPU only"):
        Linear(torch.zeros(4, 4, dtype=torch.float16), None, GEMM_PATHS["simd"])



def test_rms_norm_matches_the_torch_formulation():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 576, generator=gen) * 3
    w = torch.randn(576, generator=gen)
    def norm(t):  # cpu_ops takes and returns numpy arrays
        return torch.from_numpy(cpu_ops.rms_norm(t.contiguous().numpy(), w.numpy(), 1e-5))
    torch.testing.assert_close(norm(x), rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-5)
    rows_alone_equal_rows_together(norm, x)


@pytest.mark.parametrize("width", [576, 960, 8, 13])
def test_add_rms_norm_gives_the_bits_of_the_add_and_the_norm_apart(width):
    # the engine's fused path adds each residual and norms the sum in one call: its stream and the next
    # layer's input must be bit for bit numpy's add and rms_norm's, for every row count (row invariance)
    rng = np.random.default_rng(width)
    h = (rng.standard_normal((7, width)) * 3).astype(np.float32)
    delta = (rng.standard_normal((7, width)) * 5).astype(np.float32)
    w = rng.standard_normal(width).astype(np.float32)
    kept = h.copy()
    for rows in (1, 2, 6, 7):
        summed, normed = cpu_ops.add_rms_norm(h[:rows], delta[:rows], w, np.float32(1e-5))
        np.testing.assert_array_equal(summed, h[:rows] + delta[:rows])
        np.testing.assert_array_equal(normed, cpu_ops.rms_norm(h[:rows] + delta[:rows], w, 1e-5))
        np.testing.assert_array_equal(normed[-1:], cpu_ops.add_rms_norm(h[rows - 1:rows], delta[rows - 1:rows],
                                                                          w, np.float32(1e-5))[1])
    np.testing.assert_array_equal(h, kept)  # the stream given is not written (the engine keeps feature rows)


def test_silu_mul_matches_torch_including_large_and_negative_gates():
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(5, 2 * 256, generator=gen) * 6
    gate_up[0, :4] = torch.tensor([-120.0, -30.0, 0.0, 95.0])
    gate, up = gate_up.chunk(2, dim=-1)
    def silu_mul(t):  # cpu_ops takes and returns numpy arrays
        return torch.from_numpy(cpu_ops.silu_mul(t.contiguous().numpy()))
    got = silu_mul(gate_up)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=2e-6, atol=1e-6)
    assert torch.isfinite(got).all()
    rows_alone_equal_rows_together(silu_mul, gate_up)


@pytest.mark.parametrize("rotate", [True, False])
def test_rope_scale_write_matches_apply_rope_and_fills_the_slots(rotate):
    heads, kv_heads, dim, blocks, block_size = 6, 2, 16, 4, 8
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, heads + 2 * kv_heads, dim, generator=gen)
    cos, sin = rope_tables(rope_inv_freq({"rope_type": "default", "rope_theta": 10000.0}, dim), 64)
    pos = np.array([3, 17, 18, 40, 41], np.int32)
    slot_block = np.array([0, 2, 2, 3, 1], np.int64)
    slot_offset = np.array([3, 1, 2, 0, 7], np.int64)
    key_cache = np.zeros((blocks, kv_heads, dim, block_size), np.float32)  # kv_pool's layouts
    value_cache = np.zeros((blocks, kv_heads, block_size, dim), np.float32)
    scale = dim ** -0.5
    q = torch.from_numpy(cpu_ops.rope_scale_write(qkv.numpy(), heads, kv_heads, cos.numpy(), sin.numpy(), pos,
                                                  rotate, scale, key_cache, value_cache, slot_block, slot_offset))
    qk = qkv[:, :heads + kv_heads]
    rotated = apply_rope(qk, cos[torch.from_numpy(pos).long()], sin[torch.from_numpy(pos).long()]) if rotate else qk
    torch.testing.assert_close(q, rotated[:, :heads] * scale, rtol=1e-6, atol=1e-6)
    for t in range(5):
        keys = torch.from_numpy(key_cache[slot_block[t], :, :, slot_offset[t]])
        torch.testing.assert_close(keys, rotated[t, heads:], rtol=1e-6, atol=1e-6)
        assert torch.equal(torch.from_numpy(value_cache[slot_block[t], :, slot_offset[t]]), qkv[t, heads + kv_heads:])
    untouched = np.ones((blocks, block_size), bool)
    untouched[slot_block, slot_offset] = False
    assert not key_cache.transpose(0, 3, 1, 2)[untouched].any()
    assert not value_cache.transpose(0, 2, 1, 3)[untouched].any()
    for t in range(5):  # one row alone gives the same bits as the batch
        alone = cpu_ops.rope_scale_write(qkv[t:t + 1].numpy(), heads, kv_heads, cos.numpy(), sin.numpy(),
                                         pos[t:t + 1], rotate, scale, np.zeros_like(key_cache),
                                         np.zeros_like(value_cache), slot_block[t:t + 1], slot_offset[t:t + 1])
        assert torch.equal(torch.from_numpy(alone[0]), q[t])


def test_rope_scale_write_stores_bfloat16_caches_rounded_as_torch_rounds():
    """Into a bfloat16 pool's caches (uint16 bits, kv_pool.KV_DTYPES): the
    float32 kernel's keys and values, each rounded as torch rounds; the
    queries are unchanged."""
    heads, kv_heads, dim, blocks, block_size = 6, 2, 16, 4, 16
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, heads + 2 * kv_heads, dim, generator=gen)
    cos, sin = rope_tables(rope_inv_freq({"rope_type": "default", "rope_theta": 10000.0}, dim), 64)
    pos = np.array([3, 17, 18, 40, 41], np.int32)
    slot_block, slot_offset = np.array([0, 2, 2, 3, 1], np.int64), np.array([3, 1, 2, 0, 7], np.int64)
    caches = {dt: (np.zeros((blocks, kv_heads, dim, block_size), dt), np.zeros((blocks, kv_heads, block_size, dim), dt))
              for dt in (np.float32, np.uint16)}
    q = {dt: cpu_ops.rope_scale_write(qkv.numpy(), heads, kv_heads, cos.numpy(), sin.numpy(), pos, True, 0.25,
                                      *caches[dt], slot_block, slot_offset) for dt in caches}
    assert np.array_equal(q[np.float32], q[np.uint16])
    for f32, bits in zip(caches[np.float32], caches[np.uint16]):
        assert np.array_equal(torch.from_numpy(f32).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16), bits)
        assert bits.any()


@pytest.mark.parametrize("rows", [1, 6, 13])
def test_simd_gemm_reads_bfloat16_weights_as_the_float32_kernel_reads_their_values(rows):
    """bfloat16 bit patterns widened in registers: bitwise the float32
    kernel on the same (bfloat16-rounded) values, hence the same stated order."""
    rng = np.random.default_rng(rows)
    w = torch.from_numpy(rng.standard_normal((40, 203)).astype(np.float32)).to(torch.bfloat16)
    x = rng.standard_normal((rows, 203)).astype(np.float32)
    bits = gemm_simd.pad_weight(w.view(torch.int16).numpy().view(np.uint16))
    assert bits.dtype == np.uint16 and bits.shape == (40, 208) and not bits[:, 203:].any()
    got = gemm_simd.gemm(x, bits, 2)[:, :40]
    assert np.array_equal(got, gemm_simd.gemm(x, gemm_simd.pad_weight(w.float().numpy()), 2)[:, :40])
    assert np.array_equal(got, stated_order(x, w.float().numpy()))


def test_the_simd_path_serves_bfloat16_linears_row_invariantly():
    """A bfloat16 Linear through simd: bfloat16 in and out, the weight kept as
    bfloat16 (half the bytes), each row bitwise the same alone or among 13."""
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(50, 37, generator=gen).to(torch.bfloat16)
    b = torch.randn(50, generator=gen).to(torch.bfloat16)
    x = torch.randn(13, 37, generator=gen).to(torch.bfloat16)
    linear = Linear(w, b, GEMM_PATHS["simd"])
    y = linear(x)
    assert y.dtype == torch.bfloat16 and linear.weight.dtype == torch.bfloat16 and linear._padded.dtype == np.uint16
    torch.testing.assert_close(y.float(), F.linear(x.float(), w.float(), b.float()), rtol=2e-2, atol=2e-2)
    rows_alone_equal_rows_together(linear, x)


@pytest.mark.parametrize("path,dtype", [("simd", torch.float32), ("simd", torch.bfloat16),
                                        ("numba", torch.float32), ("onednn", torch.float32)])
def test_a_linear_on_arrays_computes_what_it_computes_on_float32_tensors(path, dtype):
    """Linear.on_array (the engine's fused path: float32 numpy in and out)
    gives bitwise the float32-input call's result, bias included, on the
    paths the fused engine runs (any float32 path; bfloat16 weights through
    simd only)."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(70, 45, generator=gen).to(dtype)  # out not a multiple of the padded block: a sliced output
    b = torch.randn(70, generator=gen).to(dtype)
    x = torch.randn(6, 45, generator=gen)
    linear = Linear(w, b, GEMM_PATHS[path])
    got = linear.on_array(x.numpy())
    assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.shape == (6, 70) and got.flags.c_contiguous
    want = linear(x)
    assert want.dtype == torch.float32 and torch.equal(torch.from_numpy(got), want)


# ---- simd-dpbf16: bfloat16 activations, AVX512-BF16 dot products ------------------------

needs_dpbf16 = pytest.mark.skipif(not has_dpbf16(), reason="this CPU has no AVX512-BF16 (simd-dpbf16 is refused "
                                  "here: test_the_dpbf16_path_is_refused_where_the_cpu_lacks_the_instruction)")


def as_bf16_values(bits: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bit patterns -> their float32 values (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def stated_pair_order(x: np.ndarray, w_bits: np.ndarray) -> np.ndarray:
    """gemm_simd.gemm(..., pairs=True) written with numpy: x rounded to
    bfloat16; per output LANES lane accumulators over the padded input in
    steps of 2 LANES, lane i adding the products of its pair (2i + 1 first,
    then 2i, each rounded once: VDPBF16PS as Intel's manual defines it; a
    product of two bfloat16 values is exact in float32); then the lanes'
    halves added pairwise. x [R, in] float32, w_bits [out, in] -> [R, out]."""
    lanes = gemm_simd.LANES
    width = gemm_simd.padded_in(x.shape[1], pairs=True)
    xp = np.zeros((x.shape[0], width), np.float32)
    xp[:, :x.shape[1]] = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    wp = np.zeros((w_bits.shape[0], width), np.float32)
    wp[:, :w_bits.shape[1]] = as_bf16_values(w_bits)
    acc = np.zeros((x.shape[0], w_bits.shape[0], lanes), np.float32)
    for k in range(0, width, 2 * lanes):
        for parity in (1, 0):
            acc = _fma32(acc, xp[:, None, k + parity:k + 2 * lanes:2], wp[None, :, k + parity:k + 2 * lanes:2])
    while acc.shape[-1] > 1:
        half = acc.shape[-1] // 2
        acc = acc[..., :half] + acc[..., half:]
    return acc[..., 0]


def test_activations_round_to_bfloat16_as_torch_rounds_them():
    """Nearest, ties to even, infinities and overflow to infinity kept; NaN stays NaN; the padding stays 0."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((3, 70)) * 10.0 ** rng.integers(-38, 38, (3, 70))).astype(np.float32)
    ties = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x7F7FFFFF, 0x00000001, 0x80000000], np.uint32)
    x[0, :6] = ties.view(np.float32)  # halfway cases (even and odd), the largest float, a denormal, -0
    x[1, :3] = [np.inf, -np.inf, np.nan]
    got = gemm_simd.round_bf16(x, 96)
    assert got.shape == (3, 96) and got.dtype == np.uint16 and not got[:, 70:].any()
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    finite = ~np.isnan(x)
    assert np.array_equal(got[:, :70][finite], want[finite])
    assert np.isnan(as_bf16_values(got[1:2, 2:3])).all()


@needs_dpbf16
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 13])
def test_dpbf16_gemm_sums_in_the_order_its_doc_states(rows):
    """The pair order is the instruction's architectural definition, so the
    result is bitwise the numpy statement of it; and it is not the float32
    kernel's (the activations were rounded, the order differs)."""
    rng = np.random.default_rng(rows)
    w = torch.from_numpy(rng.standard_normal((40, 203)).astype(np.float32)).to(torch.bfloat16)
    bits = w.view(torch.int16).numpy().view(np.uint16)
    x = rng.standard_normal((rows, 203)).astype(np.float32)
    padded = gemm_simd.pad_weight(bits, pairs=True)
    assert padded.shape == (40, 224) and not padded[:, 203:].any()
    got = gemm_simd.gemm(x, padded, 2, pairs=True)[:, :40]
    assert np.array_equal(got, stated_pair_order(x, bits))
    assert not np.array_equal(got, gemm_simd.gemm(x, gemm_simd.pad_weight(bits), 2)[:, :40])


@needs_dpbf16
def test_dpbf16_gemm_rows_and_chunks_do_not_change_a_row():
    rng = np.random.default_rng(5)
    w = torch.from_numpy(rng.standard_normal((50, 300)).astype(np.float32)).to(torch.bfloat16)
    padded = gemm_simd.pad_weight(w.view(torch.int16).numpy().view(np.uint16), pairs=True)
    x = rng.standard_normal((14, 300)).astype(np.float32)
    together = gemm_simd.gemm(x, padded, 2, pairs=True)
    for n in range(1, 14):
        assert np.array_equal(gemm_simd.gemm(x[:n], padded, 2, pairs=True), together[:n]), f"first {n} rows"
    for r in range(14):
        assert np.array_equal(gemm_simd.gemm(x[r:r + 1], padded, 2, pairs=True)[0], together[r]), f"row {r}"
    for chunks in (1, 3):
        assert np.array_equal(gemm_simd.gemm(x, padded, chunks, pairs=True), together)


@needs_dpbf16
def test_the_dpbf16_path_serves_bfloat16_linears_row_invariantly():
    """bfloat16 in and out, the weight kept as bfloat16; the result is the
    product of the bfloat16 values to float32 precision; on arrays the same bits."""
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(70, 45, generator=gen).to(torch.bfloat16)
    b = torch.randn(70, generator=gen).to(torch.bfloat16)
    x = torch.randn(13, 45, generator=gen)
    linear = Linear(w, b, GEMM_PATHS["simd-dpbf16"])
    assert linear.weight.dtype == torch.bfloat16 and linear._padded.dtype == np.uint16
    y = linear(x)
    exact = F.linear(x.to(torch.bfloat16).double(), w.double(), b.float().double())
    torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.from_numpy(linear.on_array(x.numpy())), y)
    assert linear(x.to(torch.bfloat16)).dtype == torch.bfloat16
    rows_alone_equal_rows_together(linear, x)


def test_the_dpbf16_path_is_refused_where_the_cpu_lacks_the_instruction(monkeypatch):
    """Float32 weights and a CPU without AVX512-BF16 are refused by name;
    the selector reports either as a path this CPU cannot run."""
    w = torch.randn(32, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="simd-dpbf16 GEMM takes torch.bfloat16 weights"):
        Linear(w.float(), None, GEMM_PATHS["simd-dpbf16"])
    monkeypatch.setattr(gemm_select, "has_dpbf16", lambda: False)
    with pytest.raises(RuntimeError, match="needs AVX512-BF16"):
        Linear(w, None, GEMM_PATHS["simd-dpbf16"])
    failure = path_failure(GEMM_PATHS["simd-dpbf16"], [("w", w, None)], check_row_counts(8), torch.bfloat16)
    assert failure.startswith(gemm_select.UNSUPPORTED) and "AVX512-BF16" in failure


def test_parallel_gemms_launch_a_team_of_their_chunks():
    """A GEMM split into n chunks runs its parallel region on n numba threads,
    not on the whole pool: the pool's idle threads would hold up the join on
    a loaded machine (gemm_numba.set_team)."""
    import numba

    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 64), dtype=np.float32)
    w = gemm_numba.pad_weight(rng.standard_normal((20, 64), dtype=np.float32))
    want = x @ w.T
    for chunks in sorted({1, numba.config.NUMBA_NUM_THREADS}):
        for run in (lambda: gemm_numba.gemm(x, w, chunks, "numba"), lambda: gemm_simd.gemm(x, w, chunks)):
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)  # the pool, as a fresh thread has it
            gemm_numba._team.size = None
            assert np.allclose(run(), want, atol=1e-4)
            assert numba.get_num_threads() == chunks
