"""Triton kernel of ``sampling.filter_stats``: one program per row, no sort.

Both thresholds are found by a multi-probe bisection over the float32 bit
patterns of ``e`` in [0, 1] (non-negative floats order like their bits): each
pass over the row counts (top-k) or sums (top-p) the e at or above PROBES
candidate thresholds at once and keeps the bracket [largest passing, smallest
failing], so about 8 passes (16 probes) pin the exact threshold value that the
sort-based reference finds.

Imported only when a Triton kernel is launched (see ``rng_triton.py``).
"""
import os

import torch
import triton
import triton.language as tl

from specdec.kernels.types import FilterStats

# Under TRITON_INTERPRET every block step is a round of numpy calls, so larger
# blocks amortise the Python overhead there; results do not depend on them.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK = 4096 if _INTERPRETED else 1024  # vocabulary entries per step of a plain pass
SEARCH_BLOCK = 4096 if _INTERPRETED else 256  # entries per step of a bisection pass (x PROBES)
PROBES = 64 if _INTERPRETED else 16  # candidate thresholds per bisection pass


# Every pass below computes e = exp(logits / T - row_max) of a block, exactly as
# sampling.unnormalised_probs, written out inline: the interpreter re-patches
# triton.language on every device-function call, which dominates test time
# when done once per block.


@triton.jit
def filtered_probs(row_ptr, offs, V, temperature, row_max, threshold, norm):
    """The target probabilities p of a block of one row (see sampling.py)."""
    logits = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf"))
    e = tl.exp(tl.div_rn(logits, temperature) - row_max)  # unnormalised_probs, inlined
    return tl.where(e >= threshold, tl.div_rn(e, norm), 0.0)


@triton.jit
def row_argmax(row_ptr, V, BLOCK: tl.constexpr):
    """Index of the largest logit of a row (lowest index among ties), int32."""
    best = float("-inf")
    best_idx = 0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        logits = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf"))
        block_best = tl.max(logits, axis=0)
        block_idx = start + tl.argmax(logits, axis=0, tie_break_left=True)
        take = block_best > best  # strict: an earlier block wins ties
        best_idx = tl.where(take, block_idx, best_idx)
        best = tl.where(take, block_best, best)
    return best_idx


@triton.jit
def _row_max(row_ptr, V, BLOCK: tl.constexpr):
    best = float("-inf")
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        logits = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf"))
        best = tl.maximum(best, tl.max(logits, axis=0))
    return best


@triton.jit
def _kept_mass(row_ptr, V, temperature, row_max, threshold, BLOCK: tl.constexpr):
    """float64 sum of the e >= threshold of a row."""
    mass = tl.zeros((), tl.float64)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        logits = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf"))
        e = tl.exp(tl.div_rn(logits, temperature) - row_max)  # unnormalised_probs, inlined
        mass += tl.sum(tl.where(e >= threshold, e, 0.0).to(tl.float64), axis=0)
    return mass


@triton.jit
def _largest_passing(row_ptr, V, temperature, row_max, lo, target,
                     BY_MASS: tl.constexpr, BLOCK: tl.constexpr, PROBES: tl.constexpr):
    """Largest float32 bit pattern t with pred(t): (mass if BY_MASS else count)
    of the e >= t reaches target. Requires pred(lo); pred fails above 1.0.
    lo: int64 scalar; returns int64 scalar (an e value's bits)."""
    hi = tl.full((), 0x3F800001, tl.int64)  # float32 bits just above 1.0
    fractions = tl.arange(0, PROBES).to(tl.int64) + 1
    while hi - lo > 1:
        probes = lo + ((hi - lo) * fractions) // (PROBES + 1)  # [PROBES], in [lo, hi)
        candidates = probes.to(tl.int32).to(tl.float32, bitcast=True)
        reach = tl.zeros((PROBES,), tl.float64)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            logits = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf"))
            e = tl.exp(tl.div_rn(logits, temperature) - row_max)  # unnormalised_probs, inlined
            kept = (e[:, None] >= candidates[None, :]) & (offs < V)[:, None]
            if BY_MASS:
                reach += tl.sum(tl.where(kept, e[:, None].to(tl.float64), 0.0), axis=0)
            else:
                reach += tl.sum(kept.to(tl.float64), axis=0)
        passing = reach >= target  # monotone: a prefix of the probes
        lo = tl.max(tl.where(passing, probes, lo), axis=0)
        hi = tl.min(tl.where(passing, hi, probes), axis=0)
    return lo


@triton.jit
def _filter_stats_kernel(
    logits_ptr,  # float32 [R, V]
    logits_stride,
    V,
    temperature_ptr,  # float32 [R]
    top_k_ptr,  # int32 [R]
    top_p_ptr,  # float32 [R]
    row_max_ptr,  # float32 [R] out
    threshold_ptr,  # float32 [R] out
    norm_ptr,  # float32 [R] out
    BLOCK: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr,
    PROBES: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * logits_stride
    temperature = tl.load(temperature_ptr + row)
    row_max = 0.0
    threshold = 0.0
    norm = 1.0
    if temperature > 0:  # temperature-0 rows are greedy: no filter
        row_max = tl.div_rn(_row_max(row_ptr, V, BLOCK), temperature)
        top_k = tl.load(top_k_ptr + row)
        top_p = tl.load(top_p_ptr + row)
        bits = tl.zeros((), tl.int64)  # threshold 0.0: everything kept
        if (top_k > 0) & (top_k < V):
            bits = _largest_passing(row_ptr, V, temperature, row_max, bits, top_k.to(tl.float64),
                                    False, SEARCH_BLOCK, PROBES)
        if (top_p > 0) & (top_p < 1):
            top_k_threshold = bits.to(tl.int32).to(tl.float32, bitcast=True)
            mass = _kept_mass(row_ptr, V, temperature, row_max, top_k_threshold, BLOCK)
            bits = _largest_passing(row_ptr, V, temperature, row_max, bits, top_p.to(tl.float64) * mass,
                                    True, SEARCH_BLOCK, PROBES)
        threshold = bits.to(tl.int32).to(tl.float32, bitcast=True)
        norm = _kept_mass(row_ptr, V, temperature, row_max, threshold, BLOCK).to(tl.float32)
    tl.store(row_max_ptr + row, row_max)
    tl.store(threshold_ptr + row, threshold)
    tl.store(norm_ptr + row, norm)


def block_size(vocab_size: int, cap: int) -> int:
    """Power-of-two block no larger than cap nor needlessly larger than the row."""
    return min(cap, triton.next_power_of_2(max(vocab_size, 1)))


def filter_stats(logits: torch.Tensor,  # float32 [R, V]
                 temperature: torch.Tensor,  # float32 [R]
                 top_k: torch.Tensor,  # int32 [R]
                 top_p: torch.Tensor,  # float32 [R]
                 ) -> FilterStats:
    """Launches one program per row; see sampling.filter_stats."""
    num_rows, vocab_size = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    for t, dtype in ((temperature, torch.float32), (top_k, torch.int32), (top_p, torch.float32)):
        assert t.dtype == dtype and t.shape == (num_rows,) and t.is_contiguous()
    stats = FilterStats(*(torch.empty(num_rows, dtype=torch.float32, device=logits.device) for _ in range(3)))
    if num_rows > 0:
        _filter_stats_kernel[(num_rows,)](
            logits, logits.stride(0), vocab_size, temperature, top_k, top_p,
            stats.row_max, stats.threshold, stats.norm,
            BLOCK=block_size(vocab_size, BLOCK), SEARCH_BLOCK=block_size(vocab_size, SEARCH_BLOCK),
            PROBES=PROBES)
    return stats
