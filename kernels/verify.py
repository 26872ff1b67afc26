"""Verification of draft tokens against the target model, for a ragged batch.

Vocabulary (every name in kernels/ uses it):

    draft tokens     tokens a proposer guessed. Sequence b has k_b >= 0 of them;
                     the batch's drafts are flattened into ``draft_token_ids``
                     with ``cu_num_draft_tokens`` (inclusive cumulative k_b).
    draft_probs q    the distribution each draft was drawn from: sparse (K ids
                     and probabilities per draft) or absent (one-hot, q(x) = 1).
    target_logits    k_b + 1 rows per sequence; row i scores the token at
                     position ``position + i`` given the context and drafts
                     0..i-1. Row k_b is the bonus row.
    target_probs p   softmax(logits / temperature) after top-k and top-p
                     (``sampling.py``).
    accepted tokens  the longest prefix of the drafts that passes the test.
    recovered token  the token drawn at the first rejected position.
    bonus token      the token drawn from the bonus row when every draft passes.
    output tokens    the accepted tokens followed by exactly one recovered or
                     bonus token: what the round appends to the sequence.

Strategies (x_i: draft i, p_i / q_i: target / draft probs of row i):

    GREEDY        accept while x_i == argmax(logits_i); the recovered and bonus
                  tokens are argmaxes (temperature and filters are ignored).
                  Lossless at temperature 0.
    REJECTION     (Leviathan et al. 2023; Chen et al. 2023) accept x_i with
                  probability min(1, p_i(x_i) / q_i(x_i)); the recovered token
                  is drawn from normalise(max(p_i - q_i, 0)), the bonus from p_k.
                  The output tokens are distributed exactly as sampling from p.
    TARGET_MATCH  draw y_i ~ p_i and accept while x_i == y_i; the recovered (or
                  bonus) token is y at the stop. Lossless, and token for token
                  equal to plain sampling with the same seed.
    TOPP          LOSSY, opt-in only: accept x_i when p_i(x_i) > 0, i.e. x_i lies
                  in the target's top-k / top-p set (disabled top-p counts as
                  1.0: any draft of non-zero probability passes); the recovered
                  and bonus tokens are drawn from p.

Rows with temperature 0 are GREEDY whatever their strategy. Accept policies
(debugging): ACCEPT_ALL accepts every draft (bonus drawn after the last,
LOSSY); REJECT_ALL accepts none and outputs the plain decoding of row 0.

Randomness comes from ``rng.py``: a draw depends only on the sequence's seed,
the absolute position of the token decided and its purpose, so a seeded
request gives the same tokens in any batch, at any row, on either backend.
The Triton kernels (``verify_triton.py``) and this file's torch reference
compute the same formulas; they agree token for token, except in the
vanishing case where float rounding of exp/log (which differs between
backends by an ulp) decides a near-tie of ~1e-7 relative size.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import numpy as np
import torch

from specdec.kernels import rng
from specdec.kernels.sampling import filter_stats_reference, filtered_probs, filtered_probs_at
from specdec.kernels.types import (
    GREEDY,
    POLICY_ACCEPT_ALL,
    POLICY_NORMAL,
    REJECTION,
    STRATEGIES,
    TARGET_MATCH,
    TOPP,
    FilterStats,
    RaggedLayout,
    SamplingTensors,
    SparseDraftProbs,
    VerifyOutput,
    effective_strategy,
)


def verify(target_logits: torch.Tensor,  # float32 [num_draft_tokens + B, V]
           draft_token_ids: torch.Tensor,  # int32 [num_draft_tokens]
           cu_num_draft_tokens: torch.Tensor,  # int32 [B], inclusive cumulative sum of k_b
           sampling: SamplingTensors,
           draft_probs: SparseDraftProbs | None = None,  # None: all drafts one-hot
           use_triton: bool | None = None,  # None: Triton on CUDA tensors, torch otherwise
           ) -> VerifyOutput:
    """Verifies every sequence's drafts.

    Sequence b owns target rows ``cu[b-1] + b .. cu[b] + b`` (k_b + 1 rows).
    Draft ids outside [0, V) are simply rejected. With Triton: one
    filter-statistics launch over the target rows (when any sequence
    samples), then one verification launch per strategy present. Without:
    the torch reference, except that a CPU batch where every sequence is
    greedy is scanned on the host (``_verify_greedy_on_host``, same tokens).
    """
    if use_triton is None:
        use_triton = target_logits.is_cuda
    _check_inputs(target_logits, draft_token_ids, cu_num_draft_tokens, sampling, draft_probs)
    if not use_triton and target_logits.device.type == "cpu" and _all_greedy(sampling):
        return _verify_greedy_on_host(target_logits, draft_token_ids, cu_num_draft_tokens)
    return _verify_groups(target_logits, draft_token_ids, cu_num_draft_tokens, sampling, draft_probs, use_triton)


def verify_reference(target_logits: torch.Tensor,  # float32 [num_draft_tokens + B, V]
                     draft_token_ids: torch.Tensor,  # int32 [num_draft_tokens]
                     cu_num_draft_tokens: torch.Tensor,  # int32 [B]
                     sampling: SamplingTensors,
                     draft_probs: SparseDraftProbs | None = None,
                     ) -> VerifyOutput:
    """The torch reference of ``verify`` (vectorised over sequences; also
    for all-greedy batches, which ``verify`` scans on the host)."""
    _check_inputs(target_logits, draft_token_ids, cu_num_draft_tokens, sampling, draft_probs)
    return _verify_groups(target_logits, draft_token_ids, cu_num_draft_tokens, sampling, draft_probs,
                          use_triton=False)


def _verify_groups(target_logits: torch.Tensor, draft_token_ids: torch.Tensor, cu_num_draft_tokens: torch.Tensor,
                   sampling: SamplingTensors, draft_probs: SparseDraftProbs | None, use_triton: bool,
                   ) -> VerifyOutput:
    """One verification per strategy present (Triton launches or the torch reference)."""
    layout = RaggedLayout.build(cu_num_draft_tokens)
    num_seqs = cu_num_draft_tokens.numel()
    output = VerifyOutput(
        output_token_ids=torch.full((num_seqs, layout.max_k + 1), -1, dtype=torch.int32,
                                    device=target_logits.device),
        num_accepted=torch.zeros(num_seqs, dtype=torch.int32, device=target_logits.device))
    groups = _group_by_strategy(effective_strategy(sampling))
    if use_triton:
        from specdec.kernels import verify_triton  # deferred: see rng_triton.py

        verify_triton.verify_groups(target_logits, draft_token_ids, layout, sampling, draft_probs,
                                    groups, output)
        return output
    for strategy, seqs in groups:
        tokens, num_accepted = _verify_group_reference(
            strategy, target_logits, draft_token_ids, layout.select(seqs), sampling.select(seqs),
            draft_probs)
        output.output_token_ids[seqs] = tokens.to(torch.int32)
        output.num_accepted[seqs] = num_accepted.to(torch.int32)
    return output


def _all_greedy(sampling: SamplingTensors) -> bool:
    """Every sequence verified GREEDY under the normal accept policy."""
    greedy = (effective_strategy(sampling) == GREEDY) & (sampling.accept_policy == POLICY_NORMAL)
    return bool(greedy.all())  # host sync (deliberate): picks the path; CPU tensors here


def _verify_greedy_on_host(target_logits: torch.Tensor,  # float32 [num_draft_tokens + B, V], CPU
                           draft_token_ids: torch.Tensor,  # int32 [num_draft_tokens]
                           cu_num_draft_tokens: torch.Tensor,  # int32 [B]
                           ) -> VerifyOutput:
    """GREEDY for a CPU batch of greedy sequences: ``greedy_on_host`` in
    VerifyOutput's tensors. With the reference's dozen small tensor ops a
    plain decoding step's verification cost ~0.3-1 ms, now ~30-70 us
    (``benchmarks/bench_kernels.py``)."""
    ends = cu_num_draft_tokens.tolist()
    outputs, accepted = greedy_on_host(target_logits.numpy(), draft_token_ids.tolist(), ends)
    max_k = max((end - start for start, end in zip([0, *ends], ends)), default=0)
    output_token_ids = torch.full((len(ends), max_k + 1), -1, dtype=torch.int32)
    tokens = output_token_ids.numpy()  # a view, written in place
    for b, output in enumerate(outputs):
        tokens[b, :len(output)] = output
    return VerifyOutput(output_token_ids=output_token_ids, num_accepted=torch.tensor(accepted, dtype=torch.int32))


def greedy_on_host(logits: np.ndarray,  # float32 [num_draft_tokens + B, V]
                   drafts: list[int],  # [num_draft_tokens], sequence after sequence
                   ends: list[int],  # [B]: cumulative draft counts
                   ) -> tuple[list[list[int]], list[int]]:
    """GREEDY verification with host integers: per sequence the accepted
    drafts and the argmax at the first mismatch (or the bonus token), and
    the number accepted; the reference's scan (accept while x_i ==
    argmax(logits_i)), one numpy argmax per row read. numpy's argmax takes
    the first of equal maxima, as torch's does, and reads a 49152-wide row
    in ~3 us where torch's takes ~45. The scheduler calls it directly for
    an all-greedy CPU batch (no sampling tensors to build)."""
    outputs: list[list[int]] = []
    accepted: list[int] = []
    start = 0
    for b, end in enumerate(ends):
        i, output = 0, []  # rows of sequence b: start + b .. end + b; row i follows drafts 0..i-1
        while True:
            token = int(logits[start + b + i].argmax())
            output.append(token)
            if start + i == end or drafts[start + i] != token:
                break
            i += 1
        outputs.append(output)
        accepted.append(i)
        start = end
    return outputs, accepted


def sample(logits: torch.Tensor,  # float32 [B, V]
           sampling: SamplingTensors,
           use_triton: bool | None = None,
           ) -> torch.Tensor:  # int32 [B]
    """Plain decoding of one token per row: ``verify`` with no drafts.

    Argmax at temperature 0, else a draw from p with the same random stream
    as every strategy's recovered / bonus token at ``sampling.position``.
    ``sampling.strategy`` and ``accept_policy`` are ignored.
    """
    num_seqs = logits.shape[0]
    no_drafts = torch.zeros(0, dtype=torch.int32, device=logits.device)
    cu = torch.zeros(num_seqs, dtype=torch.int32, device=logits.device)
    plain = replace(sampling, strategy=torch.full_like(sampling.strategy, TARGET_MATCH),
                    accept_policy=torch.full_like(sampling.accept_policy, POLICY_NORMAL))
    return verify(logits, no_drafts, cu, plain, use_triton=use_triton).output_token_ids[:, 0]


def _group_by_strategy(strategy: torch.Tensor,  # int32 [B]
                       ) -> list[tuple[int, torch.Tensor]]:  # (strategy, int64 [G] sequence ids)
    order = torch.argsort(strategy, stable=True)
    # Host sync (deliberate): one launch per strategy present needs the counts.
    counts = torch.bincount(strategy.long(), minlength=max(STRATEGIES) + 1).tolist()
    assert counts[0] == 0 and len(counts) == max(STRATEGIES) + 1, "sampling.strategy out of range"
    groups, offset = [], 0
    for value, count in enumerate(counts):
        if count:
            groups.append((value, order[offset:offset + count]))
            offset += count
    return groups


def _check_inputs(target_logits: torch.Tensor, draft_token_ids: torch.Tensor,
                  cu_num_draft_tokens: torch.Tensor, sampling: SamplingTensors,
                  draft_probs: SparseDraftProbs | None) -> None:
    num_seqs, num_draft = cu_num_draft_tokens.numel(), draft_token_ids.numel()
    assert target_logits.dtype == torch.float32 and target_logits.dim() == 2
    assert target_logits.shape[0] == num_draft + num_seqs, "one target row per draft plus one per sequence"
    assert draft_token_ids.dtype == torch.int32 and draft_token_ids.dim() == 1
    assert cu_num_draft_tokens.dtype == torch.int32 and cu_num_draft_tokens.dim() == 1
    expected = {"temperature": torch.float32, "top_k": torch.int32, "top_p": torch.float32,
                "seed": torch.int64, "position": torch.int64, "strategy": torch.int32,
                "accept_policy": torch.int32}
    for name, dtype in expected.items():
        tensor = getattr(sampling, name)
        assert tensor.dtype == dtype and tensor.shape == (num_seqs,), f"sampling.{name}"
    if draft_probs is not None:
        assert draft_probs.token_ids.dtype == torch.int32 and draft_probs.probs.dtype == torch.float32
        assert draft_probs.token_ids.dim() == 2 and draft_probs.token_ids.shape[0] == num_draft
        assert draft_probs.probs.shape == draft_probs.token_ids.shape


# ------------------------------------------------------------ torch reference

def _verify_group_reference(strategy: int, target_logits: torch.Tensor,  # float32 [R, V]
                            draft_token_ids: torch.Tensor,  # int32 [N]
                            layout: RaggedLayout,  # of the group's G sequences
                            sampling: SamplingTensors,  # [G]
                            draft_probs: SparseDraftProbs | None,
                            ) -> tuple[torch.Tensor, torch.Tensor]:  # [G, max_k + 1], [G]
    """Output tokens and number accepted of the sequences of one strategy."""
    drafts = _DraftReader(draft_token_ids, draft_probs, layout)
    if strategy == GREEDY:
        def argmax_at(sub: torch.Tensor, i: int) -> torch.Tensor:
            return target_logits[layout.row_start[sub] + i].argmax(dim=-1)

        num_accepted, tokens = _scan_matches(layout, sampling, drafts, argmax_at)
    elif strategy == TARGET_MATCH:
        def sample_at(sub: torch.Tensor, i: int) -> torch.Tensor:
            probs = _target_probs(target_logits, layout, sampling, sub, i)
            return _race(probs, sampling.seed[sub], sampling.position[sub] + i)

        num_accepted, tokens = _scan_matches(layout, sampling, drafts, sample_at)
    else:
        num_accepted = _scan_acceptance(layout, sampling, _acceptance_test(
            strategy, target_logits, layout, sampling, drafts))
        everyone = torch.arange(layout.num_draft.numel(), device=target_logits.device)
        probs = _target_probs(target_logits, layout, sampling, everyone, num_accepted)
        recover = ((sampling.accept_policy == POLICY_NORMAL) & (num_accepted < layout.num_draft)
                   & (strategy == REJECTION))
        # Where nothing is recovered q stays 0, so the residual race is the plain race on p.
        draft_q = drafts.dense_probs(num_accepted, recover, probs.shape[1])
        tokens = _race(probs, sampling.seed, sampling.position + num_accepted, draft_q)
    return drafts.output_tokens(num_accepted, tokens), num_accepted


class _DraftReader:
    """Reads a group's drafts and draft probabilities at per-sequence offsets."""

    def __init__(self, draft_token_ids: torch.Tensor,  # int32 [N]
                 draft_probs: SparseDraftProbs | None, layout: RaggedLayout):
        # One padding slot at index N (id -1, probability 0) past the last draft.
        self._ids = torch.cat([draft_token_ids.long(), draft_token_ids.new_full((1,), -1).long()])
        # sparse q with the same padding slot: (ids int64 [N + 1, K], probs float32 [N + 1, K])
        self._q: tuple[torch.Tensor, torch.Tensor] | None = None
        if draft_probs is not None:
            width = draft_probs.token_ids.shape[1]
            self._q = (torch.cat([draft_probs.token_ids.long(), self._ids.new_full((1, width), -1)]),
                       torch.cat([draft_probs.probs, draft_probs.probs.new_zeros((1, width))]))
        self._layout = layout

    def _index(self, sub: torch.Tensor, offset: torch.Tensor | int) -> torch.Tensor:
        """Flat draft index of sub's draft at offset; N (the padding slot) past k."""
        valid = offset < self._layout.num_draft[sub]
        return torch.where(valid, self._layout.draft_start[sub] + offset, self._ids.numel() - 1)

    def token(self, sub: torch.Tensor, offset: torch.Tensor | int) -> torch.Tensor:  # int64 [M]
        """Draft token at offset of the sequences in sub; -1 past their last draft."""
        return self._ids[self._index(sub, offset)]

    def prob_of_draft(self, sub: torch.Tensor, offset: int) -> torch.Tensor:  # float32 [M]
        """q(x) of the draft x at offset (< k); 1 for one-hot drafts.

        A draft missing from its own sparse q (q(x) = 0, which the proposer
        promises never happens) is treated as one-hot.
        """
        if self._q is None:
            return torch.ones(sub.numel(), device=sub.device)
        q_ids, q_probs = self._q
        index = self._index(sub, offset)
        same = q_ids[index] == self._ids[index][:, None]
        q_x = torch.where(same, q_probs[index], 0.0).sum(dim=-1)
        return torch.where(q_x > 0, q_x, 1.0)

    def dense_probs(self, offset: torch.Tensor,  # int64 [G]
                    rows: torch.Tensor,  # bool [G]: which sequences get their q
                    vocab_size: int,
                    ) -> torch.Tensor:  # float32 [G, V], zero rows where not rows
        """The draft distribution q of each sequence's draft at offset, dense."""
        everyone = torch.arange(offset.numel(), device=offset.device)
        index = self._index(everyone, offset)
        if self._q is None:
            ids = self._ids[index][:, None]
            weights = torch.ones_like(ids, dtype=torch.float32)
        else:
            ids, weights = self._q[0][index], self._q[1][index]
        keep = rows[:, None] & (ids >= 0) & (ids < vocab_size)
        dense = torch.zeros(offset.numel(), vocab_size, dtype=torch.float32, device=offset.device)
        return dense.scatter_add_(1, torch.where(keep, ids, 0), torch.where(keep, weights, 0.0))

    def output_tokens(self, num_accepted: torch.Tensor,  # int64 [G]
                      tokens: torch.Tensor,  # int64 [G], recovered or bonus
                      ) -> torch.Tensor:  # int64 [G, max_k + 1]
        """Accepted drafts, then the recovered / bonus token, then -1."""
        everyone = torch.arange(num_accepted.numel(), device=num_accepted.device)
        offsets = torch.arange(self._layout.max_k + 1, device=num_accepted.device)
        accepted = self.token(everyone[:, None], offsets[None, :])
        n = num_accepted[:, None]
        return torch.where(offsets < n, accepted, torch.where(offsets == n, tokens[:, None], -1))


def _target_rows(target_logits: torch.Tensor,  # float32 [R, V]
                 layout: RaggedLayout, sampling: SamplingTensors,
                 sub: torch.Tensor,  # int64 [M], sequences of the group
                 offset: torch.Tensor | int,  # row offset of each sequence
                 ) -> tuple[torch.Tensor, torch.Tensor, FilterStats]:
    """Row ``offset`` of the sequences in sub: logits [M, V], temperature [M], filter stats."""
    logits = target_logits[layout.row_start[sub] + offset]
    temperature = sampling.temperature[sub]
    return logits, temperature, filter_stats_reference(logits, temperature, sampling.top_k[sub], sampling.top_p[sub])


def _target_probs(target_logits: torch.Tensor, layout: RaggedLayout, sampling: SamplingTensors,
                  sub: torch.Tensor, offset: torch.Tensor | int) -> torch.Tensor:  # float32 [M, V]
    """Target probs p of row ``offset`` of the sequences in sub."""
    return filtered_probs(*_target_rows(target_logits, layout, sampling, sub, offset))


def _race(probs: torch.Tensor,  # float32 [M, V]
          seed: torch.Tensor,  # int64 [M]
          position: torch.Tensor,  # int64 [M], absolute position of the token drawn
          draft_q: torch.Tensor | None = None,  # float32 [M, V]
          ) -> torch.Tensor:  # int64 [M]
    """Exponential race: a draw from probs, or from normalise(max(probs - q, 0)).

    If the residual is zero everywhere (q == p up to rounding, where rejection
    has probability 0) the draw falls back to probs. Only tokens with p > 0
    can win, so when filters keep few tokens the race runs over those alone
    (in ascending id order, so ties still go to the lowest id): the same
    noise per id, hence the same winner as over the whole vocabulary.
    """
    key = rng.stream_key(seed, position, rng.SAMPLE)
    index, valid = _support(probs)  # int64 [M or 1, C], bool [M, C] or None
    if valid is not None:
        probs = torch.where(valid, probs.gather(1, index), 0.0)
        draft_q = None if draft_q is None else draft_q.gather(1, index)
    noise = rng.exponential_noise(key, index)
    plain = (probs / noise).argmax(dim=-1)
    if draft_q is not None:
        residual = (probs - draft_q).clamp_min_(0.0).div_(noise)
        recovered = residual.argmax(dim=-1)
        found = residual.gather(1, recovered[:, None]).squeeze(1) > 0
        plain = torch.where(found, recovered, plain)
    return plain if valid is None else index.gather(1, plain[:, None]).squeeze(1)


def _support(probs: torch.Tensor,  # float32 [M, V]
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ids a race must cover: the ids with p > 0 of each row, ascending
    (int64 [M, C], padded; valid bool [M, C]) when C <= V / 2, else every id
    (int64 [1, V], valid None)."""
    kept = probs > 0
    counts = kept.sum(dim=1)
    width = int(counts.max())  # host sync: the reference runs on the host
    num_rows, vocab = probs.shape
    if 2 * width > vocab:
        return torch.arange(vocab, device=probs.device)[None, :], None
    rows, ids = kept.nonzero(as_tuple=True)  # row-major: ids ascend within a row
    slots = torch.arange(rows.numel(), device=probs.device) - (counts.cumsum(0) - counts)[rows]
    index = torch.zeros(num_rows, width, dtype=torch.int64, device=probs.device)
    valid = torch.zeros(num_rows, width, dtype=torch.bool, device=probs.device)
    index[rows, slots] = ids
    valid[rows, slots] = True
    return index, valid


def _acceptance_test(strategy: int, target_logits: torch.Tensor, layout: RaggedLayout,
                     sampling: SamplingTensors, drafts: _DraftReader,
                     ) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """accepts(sub, i) -> bool [M]: does draft i of the sequences in sub pass?"""
    def accepts(sub: torch.Tensor, i: int) -> torch.Tensor:
        p_x = filtered_probs_at(*_target_rows(target_logits, layout, sampling, sub, i), drafts.token(sub, i))
        if strategy == TOPP:
            return p_x > 0
        key = rng.stream_key(sampling.seed[sub], sampling.position[sub] + i, rng.ACCEPT)
        u = rng.uniform(key, torch.zeros_like(key))
        # u < 1 always, so q == p accepts; p(x) == 0 always rejects.
        return u < p_x / drafts.prob_of_draft(sub, i)

    return accepts


def _scan_acceptance(layout: RaggedLayout, sampling: SamplingTensors,
                     accepts: Callable[[torch.Tensor, int], torch.Tensor],
                     ) -> torch.Tensor:  # int64 [G], number accepted
    """Applies accepts draft by draft until each sequence's first rejection."""
    policy, k = sampling.accept_policy, layout.num_draft
    num_accepted = torch.where(policy == POLICY_ACCEPT_ALL, k, 0)
    scanning = (policy == POLICY_NORMAL) & (k > 0)
    for i in range(layout.max_k):
        sub = scanning.nonzero().squeeze(1)
        if sub.numel() == 0:
            break
        passed = accepts(sub, i)
        num_accepted[sub[passed]] = i + 1
        scanning[sub] = passed & (i + 1 < k[sub])
    return num_accepted


def _scan_matches(layout: RaggedLayout, sampling: SamplingTensors, drafts: _DraftReader,
                  target_token: Callable[[torch.Tensor, int], torch.Tensor],
                  ) -> tuple[torch.Tensor, torch.Tensor]:  # int64 [G] accepted, int64 [G] token
    """GREEDY / TARGET_MATCH: the target picks its own token at each row
    (target_token(sub, i)); drafts are accepted while they equal it, and the
    target's token at the stop is the recovered / bonus token."""
    policy, k = sampling.accept_policy, layout.num_draft
    num_accepted = torch.where(policy == POLICY_ACCEPT_ALL, k, 0)
    tokens = torch.full_like(k, -1)
    pending = torch.ones_like(k, dtype=torch.bool)
    for i in range(layout.max_k + 1):
        sub = (pending & (num_accepted == i)).nonzero().squeeze(1)
        if sub.numel() == 0:
            continue
        chosen = target_token(sub, i)
        tokens[sub] = chosen
        match = (policy[sub] == POLICY_NORMAL) & (chosen == drafts.token(sub, i))
        num_accepted[sub[match]] = i + 1
        pending[sub[~match]] = False
    return num_accepted, tokens
