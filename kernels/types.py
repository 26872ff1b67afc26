"""The data the verification and sampling kernels exchange: per-sequence
sampling tensors, sparse draft probabilities, the ragged layout of a batch,
the filter statistics of target rows, and the strategy numbers.

Both backends (the torch references in ``verify.py`` / ``sampling.py`` and
the Triton kernels in ``*_triton.py``) import this module; the references
import the Triton modules only when a kernel is launched, so imports run one
way: types <- triton kernels <- references.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from specdec.limits import GREEDY, POLICY_ACCEPT_ALL, POLICY_NORMAL, POLICY_REJECT_ALL, REJECTION, TARGET_MATCH, TOPP

__all__ = ["GREEDY", "REJECTION", "TARGET_MATCH", "TOPP", "STRATEGIES", "POLICY_NORMAL", "POLICY_ACCEPT_ALL",
           "POLICY_REJECT_ALL", "SamplingTensors", "SparseDraftProbs", "VerifyOutput", "RaggedLayout",
           "FilterStats", "effective_strategy"]

STRATEGIES = (GREEDY, REJECTION, TARGET_MATCH, TOPP)


@dataclass
class SamplingTensors:  # one row per sequence, B sequences
    temperature: torch.Tensor  # float32 [B], 0 = greedy
    top_k: torch.Tensor  # int32 [B], 0 = disabled
    top_p: torch.Tensor  # float32 [B], 0 or 1 = disabled
    seed: torch.Tensor  # int64 [B] (a uint64 seed reinterpreted as two's complement)
    position: torch.Tensor  # int64 [B], context length before this round
    strategy: torch.Tensor  # int32 [B], GREEDY..TOPP
    accept_policy: torch.Tensor  # int32 [B]

    def to(self, device: torch.device) -> SamplingTensors:
        """The same parameters on ``device`` (the tensors themselves where they are there already)."""
        return SamplingTensors(*(getattr(self, f.name).to(device) for f in fields(self)))

    def select(self, index: torch.Tensor) -> SamplingTensors:
        """The rows of the sequences in index (int64 [G])."""
        return SamplingTensors(*(getattr(self, f.name)[index] for f in fields(self)))


@dataclass
class SparseDraftProbs:
    token_ids: torch.Tensor  # int32 [num_draft_tokens, K]; padding entries have prob 0
    probs: torch.Tensor  # float32 [num_draft_tokens, K]

    def to(self, device: torch.device) -> SparseDraftProbs:
        return SparseDraftProbs(self.token_ids.to(device), self.probs.to(device))


@dataclass
class VerifyOutput:
    output_token_ids: torch.Tensor  # int32 [B, max_k + 1], -1 padded
    num_accepted: torch.Tensor  # int32 [B]


@dataclass
class RaggedLayout:
    """Where each sequence's drafts and target rows lie (B sequences)."""
    num_draft: torch.Tensor  # int64 [B], k_b
    draft_start: torch.Tensor  # int64 [B], index of draft 0 in draft_token_ids
    row_start: torch.Tensor  # int64 [B], index of row 0 in target_logits
    max_k: int  # max_b k_b (0 for an empty batch)

    @staticmethod
    def build(cu_num_draft_tokens: torch.Tensor) -> RaggedLayout:  # int32 [B]
        cu = cu_num_draft_tokens.long()
        num_draft = torch.diff(cu, prepend=cu.new_zeros(1))
        draft_start = cu - num_draft
        # Host sync (deliberate): the output width depends on the longest draft.
        max_k = int(num_draft.max()) if cu.numel() else 0
        row_start = draft_start + torch.arange(cu.numel(), device=cu.device)
        return RaggedLayout(num_draft, draft_start, row_start, max_k)

    def select(self, index: torch.Tensor) -> RaggedLayout:  # int64 [G]
        return RaggedLayout(self.num_draft[index], self.draft_start[index], self.row_start[index], self.max_k)



@dataclass
class FilterStats:
    row_max: torch.Tensor  # float32 [R]: max_v logits[r, v] / temperature[r]
    threshold: torch.Tensor  # float32 [R]: smallest kept e; 0 when no filter is on
    norm: torch.Tensor  # float32 [R]: sum of kept e (accumulated in float64)



def effective_strategy(sampling: SamplingTensors) -> torch.Tensor:  # int32 [B]
    """The strategy each sequence is verified with: GREEDY at temperature 0."""
    greedy = torch.full_like(sampling.strategy, GREEDY)
    return torch.where(sampling.temperature > 0, sampling.strategy, greedy)
