"""The Llama engine's GPU kernels (Triton), each row-invariant by construction.

On a GPU, cuBLAS chooses its GEMM kernel (tile shape, split-K, GEMV) by the
row count, and torch's reductions split a row by the tensor's shape, so a
verification chunk of k + 1 rows need not give a row the bits that plain
decoding gives it alone: speculation could flip a greedy token at a
near-tie. These kernels fix every choice that decides a row's arithmetic:

- ``linear``: x W^T (+ b) with one tile shape (``BLOCK_M`` x ``BLOCK_N`` x
  ``BLOCK_K``) and one K order for every row count, no split-K: row r of the
  output is the same sequence of fused multiply-adds whether x has 1 or 500
  rows (the matrix unit's tile instruction computes each output from its own
  row and column; rows past M are masked zeros and touch nothing else).
  float32 inputs multiply in IEEE float32 (no TF32).
- ``rms_norm``: one program per row, the whole row in one block.
- ``write_kv``: each row's key and value into its slot of the paged cache
  (no index_put: nothing for a CUDA graph to trip on).
- ``paged_attention``: one program per (row, query head), over the row's
  visible keys in ascending blocks of the paged cache (kv_pool's layout),
  online softmax in float32: the trip count and the order depend on the
  row's position alone.

Element-wise steps (RoPE, SiLU times up, residual adds, casts) stay torch
ops: each output element is a function of its own inputs on any device.

The kernels also run on CPU tensors under ``TRITON_INTERPRET=1`` (tests).
``TRITON_INTERPRET`` must be set before this module is imported. There
``linear`` multiplies a tile as explicit products summed along K
(``ROWWISE``), not ``tl.dot``: the interpreter computes ``tl.dot`` with
numpy's BLAS, whose kernels may give a row other bits at another place in
the tile (OpenBLAS on an AVX-512 AMD EPYC: rows 6-15 of a 16-row tile
differ from the same row at row 0), which a GPU's tile instruction never
does.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from specdec.engine.gemm_select import GemmPath, Linear

#: linear's one tile shape (module doc); num_warps / num_stages fixed with it.
BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64
LINEAR_WARPS, LINEAR_STAGES = 4, 3
#: the kernels run in Triton's interpreter (module doc: linear's products then row by row)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, ROWWISE: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                    other=0.0)
        b = tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K),
                    other=0.0)
        if ROWWISE:  # the interpreter's: each row's sums in one order wherever it sits (module doc)
            acc += tl.sum(a.to(tl.float32)[:, None, :] * b.to(tl.float32)[None, :, :], axis=2)
        elif IEEE:
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in out_dtype (x's
    by default); x and weight in one dtype, float32 accumulation."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], (x.shape, weight.shape)
    assert x.dtype == weight.dtype, (x.dtype, weight.dtype)
    x = x if x.stride(1) == 1 else x.contiguous()
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device)
    if M == 0:
        return y
    grid = (triton.cdiv(N, BLOCK_N), triton.cdiv(M, BLOCK_M))
    _linear_kernel[grid](x, weight, bias if bias is not None else weight, y, M, N, K,
                         x.stride(0), weight.stride(0), y.stride(0),
                         HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, ROWWISE=INTERPRETED,
                         BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, num_warps=LINEAR_WARPS, num_stages=LINEAR_STAGES)
    return y


#: The GEMM path of ``TritonLinear`` (gemm="triton").
TRITON_PATH = GemmPath("triton", "triton", 1)


class TritonLinear(Linear):
    """A ``gemm_select.Linear`` computed by ``linear``: y = x W^T + b (no
    CPU layout: the weight as given, on its device)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        # not Linear.__init__: that lays weights out for the CPU kernels
        self.path = TRITON_PATH
        self.min_rows = 1
        self.weight = weight.contiguous()
        self.bias = None if bias is None else bias.contiguous()
        self._bias_array = None
        self.out_features, self.in_features = weight.shape
        self.onednn = self.numba = self.pairs = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] -> [T, out], x's dtype"""
        return linear(x, self.weight, self.bias)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, N, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    # transformers' order: normalise in float32, cast to x's dtype, then scale
    y = w * (x32 * inv).to(x.dtype)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x [T, n] (llama.rms_norm's order of operations);
    the result in the dtype weight * x promotes to."""
    assert x.dim() == 2 and x.shape[1] == weight.shape[0]
    x = x if x.stride(1) == 1 else x.contiguous()
    T, n = x.shape
    y = torch.empty(T, n, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if T:
        _rms_norm_kernel[(T,)](x, weight, y, n, x.stride(0), y.stride(0), eps, BLOCK=triton.next_power_of_2(n))
    return y


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_block_ptr, slot_offset_ptr, stride_kt, stride_kh,
                     stride_vt, stride_vh, stride_cb, stride_ch, stride_vcb, stride_vch, head_dim,
                     BLOCK_D: tl.constexpr, BS: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    blk = tl.load(slot_block_ptr + t).to(tl.int64)
    off = tl.load(slot_offset_ptr + t)
    d = tl.arange(0, BLOCK_D)
    dmask = d < head_dim
    key = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=dmask, other=0.0)
    value = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=dmask, other=0.0)
    tl.store(kc_ptr + blk * stride_cb + h * stride_ch + d * BS + off, key, mask=dmask)  # keys transposed
    tl.store(vc_ptr + blk * stride_vcb + h * stride_vch + off * head_dim + d, value, mask=dmask)


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_block: torch.Tensor, slot_offset: torch.Tensor) -> None:
    """key_cache[slot_block[t], :, :, slot_offset[t]] = key[t] and
    value_cache[slot_block[t], :, slot_offset[t]] = value[t] for every row t.

    key, value: float32 [T, kv_heads, head_dim] (last dim contiguous);
    caches: one layer of the pool (``paged_attention``'s layout)."""
    T, Hkv, D = key.shape
    assert key.stride(2) == 1 and value.stride(2) == 1 and key_cache.is_contiguous() and value_cache.is_contiguous()
    if T:
        _write_kv_kernel[(T, Hkv)](key, value, key_cache, value_cache, slot_block, slot_offset,
                                   key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                                   key_cache.stride(0), key_cache.stride(1), value_cache.stride(0),
                                   value_cache.stride(1), D, BLOCK_D=triton.next_power_of_2(D),
                                   BS=key_cache.shape[-1])


@triton.jit
def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, row_seq_ptr, row_pos_ptr, out_ptr,
                            stride_qt, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_tb,
                            stride_ot, stride_oh, window, group, head_dim,
                            BLOCK_D: tl.constexpr, BS: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // group
    seq = tl.load(row_seq_ptr + t)
    pos = tl.load(row_pos_ptr + t)
    d = tl.arange(0, BLOCK_D)
    dmask = d < head_dim
    s_off = tl.arange(0, BS)
    q = tl.load(q_ptr + t * stride_qt + h * stride_qh + d, mask=dmask, other=0.0)
    first = pos * 0
    if window > 0:
        first = tl.maximum(pos - window + 1, 0)
    m = tl.full([], float("-inf"), tl.float32)
    denom = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for j in range(first // BS, pos // BS + 1):
        blk = tl.load(tables_ptr + seq * stride_tb + j).to(tl.int64)
        # keys are stored transposed per block: [head_dim, BS]
        k = tl.load(k_ptr + blk * stride_kb + kvh * stride_kh + d[:, None] * BS + s_off[None, :],
                    mask=dmask[:, None], other=0.0)
        key_pos = j * BS + s_off
        scores = tl.where((key_pos <= pos) & (key_pos >= first), tl.sum(q[:, None] * k, axis=0), float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new)
        v = tl.load(v_ptr + blk * stride_vb + kvh * stride_vh + s_off[:, None] * head_dim + d[None, :],
                    mask=dmask[None, :], other=0.0)
        denom = denom * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, (acc / denom).to(out_ptr.dtype.element_ty), mask=dmask)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    tables: torch.Tensor, row_seq: torch.Tensor, row_pos: torch.Tensor,
                    window: int = 0, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Causal attention of each row over its sequence's cached keys
    (KVPool.attend's contract, on the pool's device).

    query: float32 [T, heads, head_dim], already scaled; key_cache [blocks,
    kv_heads, head_dim, block_size] and value_cache [blocks, kv_heads,
    block_size, head_dim]: one layer of the pool; tables int32 [B, W];
    row_seq, row_pos int32 [T]. Returns float32 [T, heads, head_dim]."""
    T, H, D = query.shape
    assert query.dtype == torch.float32 and query.stride(2) == 1
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    block_size = key_cache.shape[-1]
    out = torch.empty(query.shape, dtype=out_dtype, device=query.device)
    if T:
        _paged_attention_kernel[(T, H)](
            query, key_cache, value_cache, tables, row_seq, row_pos, out,
            query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1),
            value_cache.stride(0), value_cache.stride(1), tables.stride(0), out.stride(0), out.stride(1),
            window, H // key_cache.shape[1], D, BLOCK_D=triton.next_power_of_2(D), BS=block_size)
    return out


# ---- fused small steps (LlamaEngine(fuse_gpu_steps=True)) --------------------------
#
# The steps between the GEMMs as one kernel each instead of several torch
# ops: RoPE + the softmax scale + the KV write (``rope_write``), SiLU times up
# (``silu_mul``), the residual add + the next RMSNorm (``add_rms_norm``). Each
# program computes one row's values from that row alone, like the kernels
# above. They compute in float32 and round once, so in bfloat16 their bits
# differ from the torch ops' (which round after each op), within rounding.


@triton.jit
def _rope_write_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, kc_ptr, vc_ptr, slot_block_ptr, slot_offset_ptr,
                       stride_qkv, stride_cos, stride_qt, stride_qh, stride_cb, stride_ch, stride_vcb, stride_vch,
                       num_heads, num_kv_heads, head_dim, scale,
                       ROPE: tl.constexpr, BLOCK_D: tl.constexpr, BS: tl.constexpr):
    t = tl.program_id(0)
    j = tl.program_id(1)  # < num_heads: a query head, else a kv head
    d = tl.arange(0, BLOCK_D)
    dmask = d < head_dim
    row = qkv_ptr + t * stride_qkv + j * head_dim
    x = tl.load(row + d, mask=dmask, other=0.0).to(tl.float32)
    if ROPE:
        half = head_dim // 2
        swapped = tl.load(row + (d + half) % head_dim, mask=dmask, other=0.0).to(tl.float32)
        pos = tl.load(pos_ptr + t)
        cos = tl.load(cos_ptr + pos * stride_cos + d, mask=dmask, other=0.0)
        sin = tl.load(sin_ptr + pos * stride_cos + d, mask=dmask, other=0.0)
        x = x * cos + swapped * sin
    if j < num_heads:
        tl.store(q_ptr + t * stride_qt + j * stride_qh + d, x * scale, mask=dmask)
    else:
        kvh = j - num_heads
        blk = tl.load(slot_block_ptr + t).to(tl.int64)
        off = tl.load(slot_offset_ptr + t)
        tl.store(kc_ptr + blk * stride_cb + kvh * stride_ch + d * BS + off, x, mask=dmask)  # keys transposed
        value = tl.load(row + num_kv_heads * head_dim + d, mask=dmask, other=0.0).to(tl.float32)
        tl.store(vc_ptr + blk * stride_vcb + kvh * stride_vch + off * head_dim + d, value, mask=dmask)


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, row_pos: torch.Tensor,
               key_cache: torch.Tensor, value_cache: torch.Tensor, slot_block: torch.Tensor,
               slot_offset: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
               rope: bool = True) -> torch.Tensor:
    """One decoder layer's attention inputs from its fused qkv projection
    [T, (heads + 2 kv_heads) * head_dim]: the keys rotated and written to
    their slots (``write_kv``'s layout), the values written, the queries
    rotated and multiplied by ``scale`` returned, float32 [T, heads, head_dim].
    cos, sin: llama.rope_tables' [max_len, head_dim] (sin signed); rope False:
    a layer without positions (NoPE)."""
    T = qkv.shape[0]
    assert qkv.stride(1) == 1 and cos.is_contiguous() and sin.is_contiguous()
    q = torch.empty(T, num_heads, head_dim, dtype=torch.float32, device=qkv.device)
    if T:
        _rope_write_kernel[(T, num_heads + num_kv_heads)](
            qkv, cos, sin, row_pos, q, key_cache, value_cache, slot_block, slot_offset,
            qkv.stride(0), cos.stride(0), q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1),
            value_cache.stride(0), value_cache.stride(1), num_heads, num_kv_heads, head_dim, scale,
            ROPE=rope, BLOCK_D=triton.next_power_of_2(head_dim), BS=key_cache.shape[-1])
    return q


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, width, stride_gu, stride_out, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < width
    gate = tl.load(gu_ptr + t * stride_gu + c, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + t * stride_gu + width + c, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + t * stride_out + c, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's middle: silu(gate) * up of [T, 2 width] = [gate | up] -> [T, width], gate_up's dtype."""
    T, two_width = gate_up.shape
    width = two_width // 2
    assert gate_up.stride(1) == 1
    out = torch.empty(T, width, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if T:
        _silu_mul_kernel[(T, triton.cdiv(width, block))](gate_up, out, width, gate_up.stride(0), out.stride(0),
                                                          BLOCK=block)
    return out


@triton.jit
def _add_rms_norm_kernel(h_ptr, d_ptr, w_ptr, h_out_ptr, y_ptr, N, stride_h, stride_d, stride_ho, stride_y, eps,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    h = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0)
    delta = tl.load(d_ptr + row * stride_d + cols, mask=mask, other=0.0)
    # the residual stream in its own dtype (torch's add: float32 sum, one rounding)
    summed = (h.to(tl.float32) + delta.to(tl.float32)).to(h.dtype)
    tl.store(h_out_ptr + row * stride_ho + cols, summed, mask=mask)
    x32 = summed.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = w * (x32 * inv).to(h.dtype)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta)): the residual add and the next norm
    in one pass over each row of [T, n]."""
    assert h.shape == delta.shape and h.stride(1) == 1 and delta.stride(1) == 1
    T, n = h.shape
    h_out = torch.empty_like(h)
    y = torch.empty(T, n, dtype=torch.promote_types(h.dtype, weight.dtype), device=h.device)
    if T:
        _add_rms_norm_kernel[(T,)](h, delta, weight, h_out, y, n, h.stride(0), delta.stride(0), h_out.stride(0),
                                   y.stride(0), eps, BLOCK=triton.next_power_of_2(n))
    return h_out, y
