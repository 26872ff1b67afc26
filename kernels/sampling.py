"""Sampling filters: temperature, top-k and top-p, as per-row statistics.

The target distribution of a row with temperature ``T > 0`` is defined from
its unnormalised probabilities

    e[v] = exp(logits[v] / T - row_max),   row_max = max_v logits[v] / T

(so the most probable token has ``e == 1``) by keeping the tokens with
``e[v] >= threshold`` and normalising:

    p[v] = e[v] / norm  if e[v] >= threshold  else 0,   norm = sum of kept e.

* top-k (``0 < k < V``): threshold = the k-th largest ``e``; tokens tied
  with it are kept too. ``k <= 0`` or ``k >= V`` disables it.
* top-p (``0 < top_p < 1``), applied after top-k: the largest threshold whose
  kept mass is at least ``top_p`` times the mass top-k kept, i.e. the
  smallest set of most probable tokens reaching ``top_p`` (ties at its edge
  kept). ``top_p <= 0`` or ``>= 1`` disables it.

Masses are summed in float64: the reference and the kernel add in different
orders, and float32 sums would then disagree about the top-p edge of flat
distributions over large vocabularies.

Filters are carried as three numbers per row (``FilterStats``) rather than a
materialised ``[R, V]`` probability tensor: the verification kernels recompute
``p[v]`` on the fly from the logits. Rows with temperature 0 are greedy and
get no filter (their stats are ``row_max=0, threshold=0, norm=1``, unused).

The Triton kernel (``sampling_triton.py``) finds both thresholds by a
multi-probe bisection over the float32 bit patterns of ``e`` (exact, no
sort); the reference here uses ``torch.topk``.
"""
from __future__ import annotations

import torch

from specdec.kernels.types import FilterStats


def filter_stats(logits: torch.Tensor,  # float32 [R, V]
                 temperature: torch.Tensor,  # float32 [R], 0 = greedy (skipped)
                 top_k: torch.Tensor,  # int32 [R], 0 = disabled
                 top_p: torch.Tensor,  # float32 [R], 0 or 1 = disabled
                 use_triton: bool | None = None,  # None: Triton on CUDA tensors
                 ) -> FilterStats:
    """Per-row filter statistics, by the Triton kernel or the torch reference."""
    if use_triton is None:
        use_triton = logits.is_cuda
    if use_triton:
        from specdec.kernels import sampling_triton  # deferred: see rng_triton.py

        return sampling_triton.filter_stats(logits, temperature, top_k, top_p)
    return filter_stats_reference(logits, temperature, top_k, top_p)


def unnormalised_probs(logits: torch.Tensor,  # float32 [R, V]
                       temperature: torch.Tensor,  # float32 [R], > 0
                       row_max: torch.Tensor,  # float32 [R]
                       ) -> torch.Tensor:  # float32 [R, V]
    """e = exp(logits / T - row_max); written exactly as the kernels compute it."""
    return torch.exp(logits / temperature[:, None] - row_max[:, None])


def filtered_probs(logits: torch.Tensor,  # float32 [R, V]
                   temperature: torch.Tensor,  # float32 [R], > 0
                   stats: FilterStats,
                   ) -> torch.Tensor:  # float32 [R, V]
    """The target probabilities p after temperature, top-k and top-p."""
    e = unnormalised_probs(logits, temperature, stats.row_max)
    return torch.where(e >= stats.threshold[:, None], e / stats.norm[:, None], 0.0)


def filtered_probs_at(logits: torch.Tensor,  # float32 [R, V]
                      temperature: torch.Tensor,  # float32 [R], > 0
                      stats: FilterStats,
                      token_ids: torch.Tensor,  # int [R]; ids outside [0, V) get 0
                      ) -> torch.Tensor:  # float32 [R]
    """p[r, token_ids[r]] without materialising p."""
    vocab = logits.shape[1]
    in_vocab = (token_ids >= 0) & (token_ids < vocab)
    chosen = logits.gather(1, token_ids.long().clamp(0, vocab - 1)[:, None]).squeeze(1)
    e = torch.exp(chosen / temperature - stats.row_max)
    return torch.where(in_vocab & (e >= stats.threshold), e / stats.norm, 0.0)


def filter_stats_reference(logits: torch.Tensor,  # float32 [R, V]
                           temperature: torch.Tensor,  # float32 [R]
                           top_k: torch.Tensor,  # int32 [R]
                           top_p: torch.Tensor,  # float32 [R]
                           ) -> FilterStats:
    """Torch reference of ``filter_stats``."""
    sampled = temperature > 0
    safe_t = torch.where(sampled, temperature, 1.0)
    row_max = logits.max(dim=-1).values / safe_t
    e = unnormalised_probs(logits, safe_t, row_max)
    threshold = _top_k_threshold(e, torch.where(sampled, top_k, 0))
    threshold = _top_p_threshold(e, threshold, torch.where(sampled, top_p, 0.0))
    norm = _kept_mass(e, threshold).to(torch.float32)
    return FilterStats(row_max=torch.where(sampled, row_max, 0.0),
                       threshold=torch.where(sampled, threshold, 0.0),
                       norm=torch.where(sampled, norm, 1.0))


def _kept_mass(e: torch.Tensor,  # float32 [R, V]
               threshold: torch.Tensor,  # float32 [R]
               ) -> torch.Tensor:  # float64 [R]
    return torch.where(e >= threshold[:, None], e, 0.0).sum(dim=-1, dtype=torch.float64)


def _top_k_threshold(e: torch.Tensor,  # float32 [R, V]
                     top_k: torch.Tensor,  # int32 [R]
                     ) -> torch.Tensor:  # float32 [R]
    """The k-th largest e of rows with top-k on, 0 elsewhere."""
    threshold = torch.zeros(e.shape[0], dtype=torch.float32, device=e.device)
    rows = ((top_k > 0) & (top_k < e.shape[1])).nonzero().squeeze(1)
    if rows.numel() == 0:
        return threshold
    k = top_k[rows].long()
    largest = torch.topk(e[rows], int(k.max()), dim=-1).values  # sorted descending
    threshold[rows] = largest.gather(1, (k - 1)[:, None]).squeeze(1)
    return threshold


def _top_p_threshold(e: torch.Tensor,  # float32 [R, V]
                     top_k_threshold: torch.Tensor,  # float32 [R]
                     top_p: torch.Tensor,  # float32 [R]
                     ) -> torch.Tensor:  # float32 [R]
    """Threshold after top-p for rows with top-p on (top-k's elsewhere).

    The nucleus is found among the ``width`` largest e of a row, widening 8x
    for rows whose nucleus is larger, so typical small nuclei cost a partial
    top-k rather than a full sort.
    """
    threshold = top_k_threshold.clone()
    on = (top_p > 0) & (top_p < 1)
    rows = on.nonzero().squeeze(1)
    if rows.numel() == 0:
        return threshold
    candidates = e if rows.numel() == e.shape[0] else e[rows]  # no copy when every row is on
    target = top_p[rows].double() * _kept_mass(candidates, top_k_threshold[rows])
    vocab = e.shape[1]
    width = min(64, vocab)
    while rows.numel() > 0:
        largest = torch.topk(candidates, width, dim=-1).values  # sorted descending
        reached = (largest.cumsum(dim=-1, dtype=torch.float64) < target[:, None]).sum(dim=-1)
        if width == vocab:  # float64 rounding can leave the whole row a hair short
            reached = reached.clamp(max=vocab - 1)
        done = reached < width
        threshold[rows[done]] = largest[done].gather(1, reached[done][:, None]).squeeze(1)
        rows, target, candidates = rows[~done], target[~done], candidates[~done]
        width = min(8 * width, vocab)
    return threshold
