"""The gateway's edge towards proposers and scorers: domain values (drafts,
sequences, verdicts) to and from the Propose and Verify messages. The round
itself (gateway/loop.py) sees only the domain types."""
from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from specdec.drafts import NO_BRANCHES, ONE_HOT_METHODS, Branches, Draft
from specdec.gateway.sequence import FeatureBlock, Sequence
from specdec.limits import (
    AHEAD_BRANCH_BUDGET,
    AHEAD_BRANCH_MAX_SEQUENCES,
    FEATURE_BYTES_PER_MESSAGE,
    FEATURE_VALUE_BYTES,
)
from specdec.protos.v1 import specdec_pb2 as pb


class Status(enum.Enum):
    """What became of one sequence's Verify in a round."""

    OK = "ok"  # output tokens to commit
    UNKNOWN_SEQUENCE = "unknown_sequence"  # the scorer lost its KV cache: re-prefill
    INVALID = "invalid"  # the request is bad: fail it
    RESOURCE_EXHAUSTED = "resource_exhausted"  # KV pool full: retry later
    BUSY = "busy"  # a Verify for it is still in flight on the scorer: retry later
    SCORER_FAILED = "scorer_failed"  # the call failed: move to another replica
    NO_SCORER = "no_scorer"  # no replica to place it on


_STATUS = {
    pb.SEQUENCE_STATUS_OK: Status.OK,
    pb.SEQUENCE_STATUS_UNKNOWN_SEQUENCE: Status.UNKNOWN_SEQUENCE,
    pb.SEQUENCE_STATUS_INVALID: Status.INVALID,
    pb.SEQUENCE_STATUS_RESOURCE_EXHAUSTED: Status.RESOURCE_EXHAUSTED,
    pb.SEQUENCE_STATUS_BUSY: Status.BUSY,
}


@dataclass(frozen=True)
class Verdict:
    """One sequence's outcome of the verify step, for the commit step."""

    seq: Sequence
    status: Status
    num_drafts: int = 0  # draft tokens sent for verification
    output_token_ids: tuple[int, ...] = ()  # accepted drafts + one target token (OK only)
    num_accepted: int = 0
    message: str = ""
    features: FeatureBlock | None = None  # target features the scorer returned (OK only)


def sequence_update(seq: Sequence, ahead: bool = False) -> pb.SequenceUpdate:
    """The sequence's tokens since the proposer last saw it (all of them, with
    its options, when the proposer must open it); ahead: ask for drafts
    ahead (``Sequence.propose_budget``)."""
    p = seq.params
    update = pb.SequenceUpdate(seq_id=seq.seq_id, context_len=len(seq.tokens),
                               num_speculative_tokens=seq.propose_budget(ahead))
    if seq.planned_model_steps is not None and not ahead:
        update.model_steps = min(seq.planned_model_steps, update.num_speculative_tokens)
    if seq.proposer_len == 0:
        update.open = True
        update.token_ids.extend(seq.tokens)
        update.options.CopyFrom(pb.ProposerOptions(
            method=p.method, min_n=p.min_n, max_n=p.max_n, reference_token_ids=p.reference_ids,
            max_tree_depth=p.max_tree_depth, max_spec_factor=p.max_spec_factor,
            min_token_prob=p.min_token_prob, temperature=p.temperature, seed=p.seed))
    else:
        update.token_ids.extend(seq.tokens[seq.proposer_len:])
    return update


@dataclass(frozen=True)
class ProposeMessage:
    """One Propose message and which sequence went where in it."""

    request: pb.ProposeRequest
    in_round: list[Sequence]  # their plain updates are request.round's columns, in this order
    in_sequences: list[Sequence]  # one SequenceUpdate each in request.sequences, in this order


@dataclass(frozen=True)
class ProposerAnswer:
    """A proposer's answer for one sequence that it holds (status OK)."""

    draft: Draft
    # the answer to an open: (feature_layers, features_from) it declared
    features: tuple[tuple[int, ...], int] = ((), 0)
    # drafting ahead: the draft's branches (RoundUpdates.branch_width), unchecked
    branches: Branches = NO_BRANCHES


def in_columns(seq: Sequence) -> bool:
    """Whether the sequence's update may travel in ProposeRequest.round: the
    proposer holds it (no open) and its method drafts one-hot, from no
    features."""
    return seq.proposer_len > 0 and seq.params.method in ONE_HOT_METHODS and not seq.features.layers


def propose_request(seqs: list[Sequence], releases: list[tuple[str, bool]],
                    ahead: bool = False, branch_width: int = 0) -> ProposeMessage:
    """One Propose message (asking for drafts ahead for the sequences that
    may use them when ``ahead``, and for up to ``branch_width`` branches per
    position of each such draft in the columns, ``branch_depths``, when they
    are AHEAD_BRANCH_MAX_SEQUENCES at most, AHEAD_BRANCH_BUDGET in all):
    releases (seq_id, completed) first, then the
    plain updates of one-hot methods as columns (request.round: a round of
    many sequences is then a few packed fields), then the other updates
    (opens, methods with sampled drafts or features), each with the target
    features that arrived for it (none on an open: the proposer's answer
    says what it needs), FEATURE_BYTES_PER_MESSAGE at most in all (the rest
    waits for the next round)."""
    in_round: list[Sequence] = []
    in_sequences: list[Sequence] = []
    for seq in seqs:
        (in_round if in_columns(seq) else in_sequences).append(seq)
    updates = []
    budget = FEATURE_BYTES_PER_MESSAGE
    for seq in in_sequences:
        update = sequence_update(seq, ahead and seq.may_draft_ahead)
        block = None if update.open else seq.relay_features(budget, alone=budget == FEATURE_BYTES_PER_MESSAGE)
        if block is not None:
            update.features.CopyFrom(pb.Features(start=block.start, rows=block.rows, dim=block.dim,
                                                 data=block.data))
            budget -= len(block.data)
        updates.append(update)
    request = pb.ProposeRequest(
        releases=[pb.SequenceRelease(seq_id=seq_id, completed=completed) for seq_id, completed in releases],
        sequences=updates)
    if in_round:
        cols = request.round
        cols.seq_ids.extend([seq.seq_id for seq in in_round])
        news = [seq.tokens[seq.proposer_len:] for seq in in_round]
        cols.token_counts.extend([len(t) for t in news])
        cols.token_ids.extend([t for new in news for t in new])
        cols.context_lens.extend([len(seq.tokens) for seq in in_round])
        budgets = [seq.propose_budget(ahead and seq.may_draft_ahead) for seq in in_round]
        cols.num_speculative_tokens.extend(budgets)
        if ahead:  # the round being verified: its budget k, which the first k + 1 tokens of a draft ahead cover
            aheads = [min(seq.num_speculative_tokens(), budget - 1) if seq.may_draft_ahead and budget else 0
                      for seq, budget in zip(in_round, budgets)]
            if any(aheads):
                cols.ahead_ks.extend(aheads)
        depths = [branch_depth(seq) if seq.may_draft_ahead else 0 for seq in in_round] if ahead and branch_width else []
        branching = sum(d > 0 for d in depths)
        if 0 < branching <= AHEAD_BRANCH_MAX_SEQUENCES:
            cols.branch_width = min(branch_width, AHEAD_BRANCH_BUDGET // branching)
            cols.branch_depths.extend(depths)
    return ProposeMessage(request, in_round, in_sequences)


def branch_depth(seq: Sequence) -> int:
    """The last position of a draft ahead worth branches at: this round's
    budget k (its output leaves the draft at position k at the latest), cut so
    that a branch has a token left in the budget drafting ahead asks for."""
    return max(0, min(seq.num_speculative_tokens(), seq.propose_budget(True) - 2))


def proposer_answers(message: ProposeMessage,
                     response: pb.ProposeResponse) -> list[tuple[Sequence, ProposerAnswer | None]]:
    """Each sequence of the message with its answer (None: the proposer holds
    no state for it or refused the update; re-open it). Raises ValueError
    when the response does not fit the message (a faulty proposer)."""
    if len(response.drafts) != len(message.in_sequences):
        raise ValueError(f"{len(response.drafts)} drafts for {len(message.in_sequences)} sequence updates")
    answers: list[tuple[Sequence, ProposerAnswer | None]] = []
    if message.in_round:
        cols, n = response.round, len(message.in_round)
        counts = cols.draft_counts
        if len(counts) != n or sum(counts) != len(cols.token_ids) or (cols.statuses and len(cols.statuses) != n):
            raise ValueError(f"round drafts do not fit the {n} sequences of the round")
        flat = np.array(cols.token_ids, dtype=np.int32)  # (as proposer_svc.server._ints)
        bounds = np.cumsum([0, *counts]).tolist()
        ok = [s == pb.SEQUENCE_STATUS_OK for s in cols.statuses] if cols.statuses else [True] * n
        branches = _round_branches(cols, n)
        answers += [(seq, ProposerAnswer(Draft(flat[bounds[i]:bounds[i + 1]]), branches=branches[i]) if ok[i] else None)
                    for i, seq in enumerate(message.in_round)]
    for seq, msg in zip(message.in_sequences, response.drafts):
        answers.append((seq, ProposerAnswer(draft_from_message(msg), (tuple(msg.feature_layers), msg.features_from))
                        if msg.status == pb.SEQUENCE_STATUS_OK else None))
    return answers


def _round_branches(cols: pb.RoundDrafts, n: int) -> list[Branches]:
    """Each sequence's branches from RoundDrafts.branch_* (none when absent).
    Raises ValueError when the columns do not fit together."""
    if not cols.branch_counts:
        return [NO_BRANCHES] * n
    counts, lens = np.array(cols.branch_counts, dtype=np.int64), np.array(cols.branch_lens, dtype=np.int64)
    m = len(cols.branch_positions)
    if (len(counts) != n or counts.min() < 0 or counts.sum() != m or len(cols.branch_tokens) != m
            or len(lens) != m or (m and lens.min() < 0) or lens.sum() != len(cols.branch_token_ids)):
        raise ValueError(f"round branches do not fit the {n} sequences of the round")
    positions, tokens = np.array(cols.branch_positions, dtype=np.int32), np.array(cols.branch_tokens, dtype=np.int32)
    starts, flat = np.cumsum([0, *lens.tolist()], dtype=np.int64), np.array(cols.branch_token_ids, dtype=np.int32)
    bounds = np.cumsum([0, *counts.tolist()]).tolist()
    return [Branches(positions[b:e], tokens[b:e], starts[b:e + 1], flat) if e > b else NO_BRANCHES
            for b, e in zip(bounds, bounds[1:])]


def draft_from_message(msg: pb.Draft) -> Draft:
    return Draft(np.asarray(msg.token_ids, dtype=np.int32),
                 tuple(np.asarray(p.token_ids, dtype=np.int32) for p in msg.probs),
                 tuple(np.asarray(p.probs, dtype=np.float32) for p in msg.probs))


def verify_request(seqs: list[Sequence], drafts: dict[str, Draft], decode_steps: dict[str, int] | None = None,
                   skip_decode_ahead: set[str] | frozenset[str] = frozenset()) -> pb.VerifyRequest:
    """One Verify call: each sequence's drafts, and its whole context when the
    scorer does not hold it yet; decode_steps: tokens to decode per sequence
    (plain decoding; absent: one); skip_decode_ahead: the sequences after
    which the scorer should not decode ahead (``costs.DecodeAheadHints``)."""
    request = pb.VerifyRequest()
    for seq in seqs:
        p = seq.params
        d = drafts[seq.seq_id]
        v = request.sequences.add(
            seq_id=seq.seq_id, context_len=len(seq.tokens), draft_token_ids=d.token_ids.tolist(),
            verify_strategy=p.verify_strategy, accept_policy=p.accept_policy)
        for ids, probs in zip(d.prob_token_ids, d.probs):
            v.draft_probs.add(token_ids=ids.tolist(), probs=probs.tolist())
        v.sampling.temperature, v.sampling.top_k, v.sampling.top_p = p.temperature, p.top_k, p.top_p
        v.sampling.seed = p.seed
        if not seq.scorer_primed:
            v.context_token_ids.extend(seq.tokens)
        if decode_steps and decode_steps.get(seq.seq_id, 1) > 1:
            v.decode_steps = decode_steps[seq.seq_id]
        if seq.seq_id in skip_decode_ahead:
            v.skip_decode_ahead = True
        if seq.features.layers:
            v.feature_layers.extend(seq.features.layers)
            if not seq.scorer_primed:
                v.max_context_features = seq.features.context_rows(len(seq.tokens))
    return request


def verdicts_from_response(seqs: list[Sequence], drafts: dict[str, Draft],
                           response: pb.VerifyResponse) -> list[Verdict]:
    return [Verdict(seq, _STATUS.get(r.status, Status.RESOURCE_EXHAUSTED), len(drafts[seq.seq_id]),
                    tuple(r.output_token_ids), r.num_accepted, r.message, _feature_block(r))
            for seq, r in zip(seqs, response.results)]


def _feature_block(result: pb.VerifyResult) -> FeatureBlock | None:
    """The result's features; None without any, or when their sizes disagree
    (a broken scorer costs the proposer rows, never a token)."""
    f = result.features
    if not result.HasField("features") or f.start < 0 or len(f.data) != f.rows * f.dim * FEATURE_VALUE_BYTES:
        return None
    return FeatureBlock(f.start, f.rows, f.dim, f.data)
