"""Triton kernels of ``verify.py``: one program per sequence, one launch per strategy.

Per strategy present in the batch, ``_verify_kernel`` is launched once over
the sequences of that strategy (their ids in ``seq_ids``), specialised on
the strategy at compile time. Sampled strategies first get their rows'
filter statistics from one launch of ``sampling_triton`` (one program per
target row), so a sequence program only streams the rows it decides on:

    GREEDY / TARGET_MATCH  the target's own token (argmax / race) of row n,
                           n = 0, 1, ... while it equals draft n;
    REJECTION / TOPP       scalar acceptance tests of drafts 0, 1, ... (one
                           logit each), then one race over the stop row.

The formulas (and the random stream, ``rng_triton.py``) are those of the
torch reference in ``verify.py``; the tests compare the two token for token.
Imported only when a Triton kernel is launched (see ``rng_triton.py``).
"""
import torch
import triton
import triton.language as tl

from specdec.kernels import rng, sampling_triton
from specdec.kernels.rng_triton import exponential_noise, stream_key, uniform
from specdec.kernels.sampling_triton import filtered_probs, row_argmax
from specdec.kernels.types import (
    GREEDY,
    POLICY_ACCEPT_ALL,
    POLICY_NORMAL,
    REJECTION,
    TARGET_MATCH,
    TOPP,
    FilterStats,
    RaggedLayout,
    SamplingTensors,
    SparseDraftProbs,
    VerifyOutput,
    effective_strategy,
)

_GREEDY = tl.constexpr(GREEDY)
_REJECTION = tl.constexpr(REJECTION)
_TARGET_MATCH = tl.constexpr(TARGET_MATCH)
_TOPP = tl.constexpr(TOPP)
_POLICY_NORMAL = tl.constexpr(POLICY_NORMAL)
_POLICY_ACCEPT_ALL = tl.constexpr(POLICY_ACCEPT_ALL)
_ACCEPT = tl.constexpr(rng.ACCEPT)
_SAMPLE = tl.constexpr(rng.SAMPLE)


@triton.jit
def _prob_of(row_ptr, x, V, temperature, row_max, threshold, norm):
    """p(x) of one row for a scalar token id; 0 for ids outside [0, V)."""
    in_vocab = (x >= 0) & (x < V)
    logit = tl.load(row_ptr + x, mask=in_vocab, other=float("-inf"))
    e = tl.exp(tl.div_rn(logit, temperature) - row_max)
    return tl.where(e >= threshold, tl.div_rn(e, norm), 0.0)


@triton.jit
def _race(row_ptr, V, temperature, row_max, threshold, norm, key,
          draft, q_ids, q_probs,  # draft distribution q to subtract: one-hot at draft, or sparse
          RESIDUAL: tl.constexpr, HAS_Q: tl.constexpr, BLOCK: tl.constexpr):
    """Exponential race over one row: argmax_v w[v] / E[v], E = Exp(1) noise of key.

    w = p, or with RESIDUAL w = max(p - q, 0) (falling back to p where that
    is zero everywhere). An all-zero q (draft = -1, masked q_ids) makes the
    residual race the plain race. Ties go to the lowest index.
    """
    best = -1.0
    best_idx = 0
    best_residual = -1.0
    residual_idx = 0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < V
        probs = filtered_probs(row_ptr, offs, V, temperature, row_max, threshold, norm)
        noise = exponential_noise(key, offs)
        keys = tl.where(valid, tl.div_rn(probs, noise), -1.0)
        block_best = tl.max(keys, axis=0)
        take = block_best > best  # strict: an earlier block wins ties
        best_idx = tl.where(take, start + tl.argmax(keys, axis=0, tie_break_left=True), best_idx)
        best = tl.where(take, block_best, best)
        if RESIDUAL:
            if HAS_Q:
                q = tl.sum(tl.where(offs[:, None] == q_ids[None, :], q_probs[None, :], 0.0), axis=1)
            else:
                q = tl.where(offs == draft, 1.0, 0.0)
            keys = tl.where(valid, tl.div_rn(tl.maximum(probs - q, 0.0), noise), -1.0)
            block_best = tl.max(keys, axis=0)
            take = block_best > best_residual
            residual_idx = tl.where(take, start + tl.argmax(keys, axis=0, tie_break_left=True), residual_idx)
            best_residual = tl.where(take, block_best, best_residual)
    if RESIDUAL:
        best_idx = tl.where(best_residual > 0, residual_idx, best_idx)
    return best_idx


@triton.jit
def _target_token(logits_ptr, logits_stride, V, row, row_max_ptr, threshold_ptr, norm_ptr,
                  temperature, seed, position, STRATEGY: tl.constexpr, BLOCK: tl.constexpr):
    """The target's own token of a row: argmax (GREEDY) or a draw from p (TARGET_MATCH)."""
    row_ptr = logits_ptr + row * logits_stride
    if STRATEGY == _GREEDY:
        token = row_argmax(row_ptr, V, BLOCK)
    else:
        token = _race(row_ptr, V, temperature, tl.load(row_max_ptr + row), tl.load(threshold_ptr + row),
                      tl.load(norm_ptr + row), stream_key(seed, position, _SAMPLE),
                      -1, tl.full((1,), -1, tl.int32), tl.zeros((1,), tl.float32), False, False, BLOCK)
    return token


@triton.jit
def _accepts(logits_ptr, logits_stride, V, row, row_max_ptr, threshold_ptr, norm_ptr,
             temperature, seed, position, x, q_ids_ptr, q_probs_ptr, q_width, draft_index,
             STRATEGY: tl.constexpr, HAS_Q: tl.constexpr, Q_PAD: tl.constexpr):
    """Acceptance test of draft x, scored by the given target row.

    REJECTION: u < p(x) / q(x), u ~ U(0, 1) from (seed, position, ACCEPT); as
    u < 1, q == p always accepts and p(x) == 0 always rejects. A draft
    missing from its own sparse q counts as one-hot. TOPP (lossy): p(x) > 0.
    """
    p_x = _prob_of(logits_ptr + row * logits_stride, x, V, temperature, tl.load(row_max_ptr + row),
                   tl.load(threshold_ptr + row), tl.load(norm_ptr + row))
    if STRATEGY == _TOPP:
        passed = p_x > 0
    else:
        q_x = 1.0
        if HAS_Q:
            slots = tl.arange(0, Q_PAD)
            ids = tl.load(q_ids_ptr + draft_index * q_width + slots, mask=slots < q_width, other=-1)
            probs = tl.load(q_probs_ptr + draft_index * q_width + slots, mask=slots < q_width, other=0.0)
            q_x = tl.sum(tl.where(ids == x, probs, 0.0), axis=0)
            q_x = tl.where(q_x > 0, q_x, 1.0)
        u = uniform(stream_key(seed, position, _ACCEPT), tl.zeros((), tl.int32))
        passed = u < tl.div_rn(p_x, q_x)
    return passed


@triton.jit
def _verify_kernel(
    logits_ptr,  # float32 [R, V]
    logits_stride,
    V,
    row_max_ptr,  # float32 [R]: filter stats (sampled strategies only)
    threshold_ptr,  # float32 [R]
    norm_ptr,  # float32 [R]
    temperature_ptr,  # float32 [B]
    seed_ptr,  # int64 [B]
    position_ptr,  # int64 [B]
    policy_ptr,  # int32 [B]
    num_draft_ptr,  # int64 [B]
    draft_start_ptr,  # int64 [B]
    draft_ids_ptr,  # int32 [N]
    q_ids_ptr,  # int32 [N, q_width] (HAS_Q)
    q_probs_ptr,  # float32 [N, q_width] (HAS_Q)
    q_width,
    seq_ids_ptr,  # int64 [G]: the sequences of this strategy
    out_ptr,  # int32 [B, max_k + 1], prefilled with -1
    out_stride,
    num_accepted_ptr,  # int32 [B]
    STRATEGY: tl.constexpr,
    HAS_Q: tl.constexpr,
    Q_PAD: tl.constexpr,
    OUT_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.load(seq_ids_ptr + tl.program_id(0))
    k = tl.load(num_draft_ptr + b)
    draft_start = tl.load(draft_start_ptr + b)
    row_start = draft_start + b  # k + 1 rows per sequence before this one's
    policy = tl.load(policy_ptr + b)
    temperature = tl.load(temperature_ptr + b)
    seed = tl.load(seed_ptr + b)
    position = tl.load(position_ptr + b)
    n = tl.where(policy == _POLICY_ACCEPT_ALL, k, 0)  # number accepted
    if (STRATEGY == _GREEDY) or (STRATEGY == _TARGET_MATCH):
        token = _target_token(logits_ptr, logits_stride, V, row_start + n, row_max_ptr, threshold_ptr,
                              norm_ptr, temperature, seed, position + n, STRATEGY, BLOCK)
        x = tl.load(draft_ids_ptr + draft_start + n, mask=n < k, other=-1)
        matching = (policy == _POLICY_NORMAL) & (token == x)
        while matching:
            n += 1
            token = _target_token(logits_ptr, logits_stride, V, row_start + n, row_max_ptr, threshold_ptr,
                                  norm_ptr, temperature, seed, position + n, STRATEGY, BLOCK)
            x = tl.load(draft_ids_ptr + draft_start + n, mask=n < k, other=-1)
            matching = token == x
    else:  # REJECTION or TOPP: test drafts, then one race over the stop row
        scanning = (policy == _POLICY_NORMAL) & (n < k)
        while scanning:
            x = tl.load(draft_ids_ptr + draft_start + n)
            passed = _accepts(logits_ptr, logits_stride, V, row_start + n, row_max_ptr, threshold_ptr,
                              norm_ptr, temperature, seed, position + n, x, q_ids_ptr, q_probs_ptr, q_width,
                              draft_start + n, STRATEGY, HAS_Q, Q_PAD)
            n += passed.to(tl.int64)
            scanning = passed & (n < k)
        recover = (STRATEGY == _REJECTION) & (policy == _POLICY_NORMAL) & (n < k)
        slots = tl.arange(0, Q_PAD)
        q_mask = recover & (slots < q_width)
        q_ids = tl.load(q_ids_ptr + (draft_start + n) * q_width + slots, mask=q_mask, other=-1)
        q_probs = tl.load(q_probs_ptr + (draft_start + n) * q_width + slots, mask=q_mask, other=0.0)
        draft = tl.load(draft_ids_ptr + draft_start + n, mask=recover, other=-1)
        row = row_start + n
        token = _race(logits_ptr + row * logits_stride, V, temperature, tl.load(row_max_ptr + row),
                      tl.load(threshold_ptr + row), tl.load(norm_ptr + row),
                      stream_key(seed, position + n, _SAMPLE), draft, q_ids, q_probs,
                      STRATEGY == _REJECTION, HAS_Q, BLOCK)
    offs = tl.arange(0, OUT_PAD)
    accepted = tl.load(draft_ids_ptr + draft_start + offs, mask=offs < n, other=-1)
    tl.store(out_ptr + b * out_stride + offs, tl.where(offs == n, token, accepted), mask=offs <= n)
    tl.store(num_accepted_ptr + b, n.to(tl.int32))


def verify_groups(target_logits: torch.Tensor,  # float32 [R, V]
                  draft_token_ids: torch.Tensor,  # int32 [N]
                  layout: RaggedLayout,
                  sampling: SamplingTensors,  # [B]
                  draft_probs: SparseDraftProbs | None,
                  groups: list[tuple[int, torch.Tensor]],  # (strategy, int64 [G] sequence ids)
                  output: VerifyOutput,
                  ) -> None:
    """Fills output: one filter-stats launch over the rows if any group samples,
    then one ``_verify_kernel`` launch per strategy group."""
    vocab_size = target_logits.shape[1]
    assert target_logits.stride(1) == 1
    stats = _row_filter_stats(target_logits, layout, sampling, groups)
    draft_ids = _nonempty(draft_token_ids.contiguous())
    if draft_probs is None:
        q_ids, q_probs, q_width = draft_ids, target_logits, 0  # never read
    else:
        q_ids, q_probs = _nonempty(draft_probs.token_ids.contiguous()), _nonempty(draft_probs.probs.contiguous())
        q_width = draft_probs.token_ids.shape[1]
    per_seq = [t.contiguous() for t in (sampling.temperature, sampling.seed, sampling.position,
                                        sampling.accept_policy, layout.num_draft, layout.draft_start)]
    for strategy, seqs in groups:
        _verify_kernel[(seqs.numel(),)](
            target_logits, target_logits.stride(0), vocab_size,
            stats.row_max, stats.threshold, stats.norm, *per_seq,
            draft_ids, q_ids, q_probs, q_width, seqs.contiguous(),
            output.output_token_ids, output.output_token_ids.stride(0), output.num_accepted,
            STRATEGY=strategy, HAS_Q=draft_probs is not None,
            Q_PAD=triton.next_power_of_2(max(q_width, 1)),
            OUT_PAD=triton.next_power_of_2(layout.max_k + 1),
            BLOCK=sampling_triton.block_size(vocab_size, sampling_triton.BLOCK))


def _nonempty(tensor: torch.Tensor) -> torch.Tensor:
    """tensor, or one element of padding when it is empty (e.g. no drafts in the
    batch): every load from it is then masked, but the pointer stays valid."""
    return tensor if tensor.numel() else torch.zeros(1, dtype=tensor.dtype, device=tensor.device)


def _row_filter_stats(target_logits: torch.Tensor,  # float32 [R, V]
                      layout: RaggedLayout, sampling: SamplingTensors,
                      groups: list[tuple[int, torch.Tensor]]) -> FilterStats:
    """Filter stats of every target row; rows of GREEDY sequences are skipped
    (temperature 0 for the stats kernel)."""
    num_rows = target_logits.shape[0]
    if all(strategy == GREEDY for strategy, _ in groups):
        dummy = torch.zeros(num_rows, dtype=torch.float32, device=target_logits.device)
        return FilterStats(dummy, dummy, dummy)
    seq_of_row = torch.repeat_interleave(
        torch.arange(layout.num_draft.numel(), device=target_logits.device), layout.num_draft + 1,
        output_size=num_rows)
    sampled = effective_strategy(sampling) != GREEDY
    temperature = torch.where(sampled, sampling.temperature, 0.0)
    return sampling_triton.filter_stats(target_logits, temperature[seq_of_row].contiguous(),
                                        sampling.top_k[seq_of_row].contiguous(),
                                        sampling.top_p[seq_of_row].contiguous())
