"""One request's life inside the gateway: its token history, where its state
lives (which proposer and scorer replica), stop conditions, streaming deltas
and statistics.

Plain domain types only: a sequence emits ``Delta``s (and ``RequestFailed``)
on its queue; the gRPC servicer turns them into ``GenerateResponse``
messages at the edge (gateway/server.py)."""
from __future__ import annotations

import asyncio
import enum
import itertools
import secrets
import time
from dataclasses import dataclass, field

from specdec.drafts import MODEL_AND_COPY_METHODS, ONE_HOT_METHODS
from specdec.gateway import metrics
from specdec.gateway.adaptive import AcceptanceEstimate
from specdec.gateway.request import GenParams
from specdec.limits import FEATURE_VALUE_BYTES, MAX_SPECULATIVE_TOKENS
from specdec.protos.v1 import specdec_pb2 as pb

_ids = itertools.count()
#: Sequence ids on scorers and proposers are this gateway process's random
#: instance id and a counter: two gateways sharing replicas never touch each
#: other's sequences, whatever request ids clients send.
INSTANCE_ID = secrets.token_hex(8)


class FinishReason(str, enum.Enum):
    """Why a request ended normally."""

    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens or the model's context


@dataclass(frozen=True)
class FinalStats:
    """A request's figures, sent with its last delta."""

    prompt_tokens: int
    output_tokens: int
    rounds: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_by_position: list[float]
    mean_accepted_length: float
    propose_s: float
    verify_s: float
    network_s: float
    wall_s: float
    ttft_s: float
    feature_bytes: int
    scorer_numerics_changes: int


@dataclass(frozen=True)
class Delta:
    """What one round adds to a request's stream: new output tokens, the text
    that can no longer change, and on the last delta why it ended and its
    figures."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stats: FinalStats | None = None


@dataclass
class Stats:
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    proposed_at: list[int] = field(default_factory=list)  # per draft position
    accepted_at: list[int] = field(default_factory=list)
    propose_s: float = 0.0
    verify_s: float = 0.0
    network_s: float = 0.0
    ttft_s: float = 0.0
    feature_bytes: int = 0  # target features relayed to the proposer
    numerics_changes: int = 0  # moves to a scorer of other arithmetic than the one that made the tokens so far

    def record_round(self, num_drafts: int, num_accepted: int) -> None:
        self.rounds += 1
        self.draft_tokens += num_drafts
        self.accepted_tokens += num_accepted
        while len(self.proposed_at) < num_drafts:
            self.proposed_at.append(0)
            self.accepted_at.append(0)
        for i in range(num_drafts):
            self.proposed_at[i] += 1
            self.accepted_at[i] += i < num_accepted


@dataclass(frozen=True)
class FeatureBlock:
    """Target feature rows of consecutive context positions, as a scorer
    sent them (the proto's Features): row r is position start + r."""

    start: int
    rows: int
    dim: int  # values per row: hidden size * number of layers
    data: bytes  # rows * dim bfloat16 bit patterns, little-endian, row-major

    @property
    def end(self) -> int:
        """The position after the last row."""
        return self.start + self.rows

    @property
    def row_bytes(self) -> int:
        return self.dim * FEATURE_VALUE_BYTES

    def tail(self, first: int) -> FeatureBlock:
        """The rows of positions first .. end - 1 (all of them when first <= start)."""
        skip = min(self.rows, max(0, first - self.start))
        return FeatureBlock(self.start + skip, self.rows - skip, self.dim, self.data[skip * self.row_bytes:])

    def then(self, other: FeatureBlock) -> FeatureBlock:
        """This block followed by other (which starts at self.end)."""
        return FeatureBlock(self.start, self.rows + other.rows, self.dim, self.data + other.data)


@dataclass
class FeatureRelay:
    """A sequence's target features on their way from its scorer to its
    proposer (methods that draft from the target's hidden states).

    The proposer says, when it opens the sequence, which layers it drafts
    from and from which position it needs rows (``opened``). Invariant:
    ``received`` is the first position whose row no scorer has sent since
    then; ``pending`` holds the rows sent and not yet relayed, one
    contiguous block ending at ``received``. A round's Verify returns the
    rows of the positions it ran (scorer_svc/scheduler.py), so between rounds
    ``received`` = context_len - 1: everything but the newest token."""

    layers: tuple[int, ...] = ()  # empty: the method drafts from no features
    received: int = 0
    pending: FeatureBlock | None = None

    def opened(self, layers: tuple[int, ...], features_from: int) -> None:
        """The proposer (re)opened the sequence: it needs rows of layers
        from position features_from on (rows not yet relayed are dropped)."""
        self.layers, self.received, self.pending = layers, features_from, None

    def context_rows(self, context_len: int) -> int:
        """max_context_features of a (re-)prefill: the context positions
        from ``received`` on (at least the last one)."""
        return max(1, context_len - self.received)

    def receive(self, block: FeatureBlock | None) -> None:
        """Keeps a scorer's rows for the next relay (rows already received
        are dropped; rows after a gap, which a scorer's message budget made,
        replace the pending ones)."""
        if block is None or block.end <= self.received:
            return
        block = block.tail(self.received)
        if self.pending is not None and block.start == self.pending.end:
            block = self.pending.then(block)
        self.pending, self.received = block, block.end

    def take(self, budget: int, alone: bool) -> FeatureBlock | None:
        """The pending rows if they fit in budget bytes (else they wait for
        the next round); when alone (the first relay of a message) rows that
        cannot fit at all are cut to the last ones that do."""
        block = self.pending
        if block is None:
            return None
        if len(block.data) > budget:
            if not alone:
                return None
            block = block.tail(block.end - budget // block.row_bytes)
        self.pending = None
        return block


class IncrementalDecoder:
    """The text of a growing token list, without decoding all of it each
    round (which is quadratic in the output length).

    It keeps the exact text of a prefix (a checkpoint) and decodes only a
    window from a few tokens before the checkpoint: the text is the
    checkpoint's text plus what the window adds beyond the checkpoint. The
    context tokens make tokenizers that drop a word's leading space at the
    start of a decode, or that merge bytes into one character, give the same
    text as decoding everything. A checkpoint is only set where that holds
    and the text around it is clean; otherwise the full decode is used.

    Byte-fallback tokenizers decode a run of byte tokens as a whole, so one
    bad byte garbles its whole run. Where the output holds such garbage
    (U+FFFD), the text may differ from a full decode inside the garbled part
    only; text without it is always exact."""

    CONTEXT = 8  # tokens decoded before the checkpoint

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._reset()

    def _reset(self) -> None:
        self._at = 0  # checkpoint: token count whose text is known exactly
        self._text = ""  # decode(tokens[:_at])
        self._head = ""  # decode(tokens[_at - CONTEXT:_at])

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def text(self, ids: list[int]) -> str:
        if self._at > len(ids):  # tokens were taken back (a stop string)
            self._reset()
        start = max(0, self._at - self.CONTEXT)
        window = self._decode(ids[start:])
        if not window.startswith(self._head):
            self._reset()
            return self._decode(ids)
        text = self._text + window[len(self._head):]
        if len(ids) - self._at > 3 * self.CONTEXT:
            self._advance(ids, text, start)
        return text

    def _advance(self, ids: list[int], text: str, start: int) -> None:
        at = len(ids) - self.CONTEXT
        part = self._decode(ids[start:at])
        head = self._decode(ids[max(0, at - self.CONTEXT):at])
        if not part.startswith(self._head) or "\ufffd" in part or "\ufffd" in head:
            return
        known = self._text + part[len(self._head):]
        if text.startswith(known):
            self._at, self._text, self._head = at, known, head


#: ``Sequence.model_drafts`` from this share of its recent drafts (moving
#: average, decay 0.8) made by a model: after one copy a hybrid's sequence
#: needs four model drafts in a row to count again
MODEL_DRAFTED = 0.9
# verification strategies whose output does not depend on the drafts
_DRAFT_INDEPENDENT = (pb.VERIFY_STRATEGY_GREEDY, pb.VERIFY_STRATEGY_TARGET_MATCH)


class RequestFailed(Exception):
    """Ends a request with a gRPC status (code name, message)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Sequence:
    def __init__(self, request_id: str, params: GenParams, tokenizer, eos_token_ids: tuple[int, ...],
                 max_model_len: int) -> None:
        self.request_id = request_id
        self.seq_id = f"{INSTANCE_ID}/{next(_ids)}"
        self.params = params
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.tokens: list[int] = list(params.prompt_ids)  # context: prompt + output
        self.num_prompt = len(params.prompt_ids)
        self.out: asyncio.Queue[Delta | RequestFailed] = asyncio.Queue()
        self.finish_reason: FinishReason | None = None  # set when the request ended normally
        self.cancelled = False
        self.failed = False
        self.failure_code = ""  # gRPC code name when failed
        self.stats = Stats()
        self.started = time.perf_counter()
        self._text = ""  # decoded output text so far
        self._decoder = IncrementalDecoder(tokenizer)
        self._emitted_chars = 0
        self._emitted_tokens = 0
        # where the sequence's state lives
        self.scorer_addr: str | None = None
        self.scorer_primed = False  # the scorer holds this sequence's KV cache
        # the arithmetic (ModelInfo.numerics) that made its tokens: moves keep to it where they can
        self.numerics: str | None = None
        self.scorer_moved = False  # it left a scorer replica, and no Verify has answered since
        self.proposer_addr: str | None = None
        self.proposer_len = 0  # tokens the proposer holds; 0 = must (re)open
        self.retries = 0  # consecutive rounds without progress (pool full, no replica, scorer busy)
        self.features = FeatureRelay()  # target features for the proposer (eagle3, mtp)
        self.acceptance = AcceptanceEstimate()  # how well this sequence's drafts do
        # how well its model-made drafts do (those with probabilities: a hybrid's copies are left out)
        self.model_acceptance = AcceptanceEstimate()
        self.drafts_offered = 1.0  # moving average: how often its proposer answered with any draft
        # moving average: how often its drafts carried a model's probabilities (draft, eagle3; a hybrid's
        # copies carry none)
        self.model_drafted: float | None = None
        # draft tokens this round asks for (costs.DraftBudgets; a copy method's: costs.CopyGates); None: all
        self.planned_budget: int | None = None
        # a model-and-copy method's model steps this round (costs.DraftBudgets); None: the whole budget
        self.planned_model_steps: int | None = None
        # drafting ahead: rounds after the next one that its exchange is expected to stay in flight (a
        # proposer slower than the scorer, gateway/loop.py): its draft is asked to cover their tokens too
        # (copy methods only: a model draft's tokens cost a step each)
        self.rounds_in_flight = 0

    # ------------------------------------------------------------- queries

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.cancelled or self.failed

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt

    def num_speculative_tokens(self) -> int:
        """This round's draft budget: the request's, cut so that a round never
        makes more output than max_tokens or the context allow."""
        return max(0, min(self.params.num_speculative_tokens, self._tokens_left() - 1))

    def _tokens_left(self) -> int:
        """Output tokens the request may still make (max_tokens, the context)."""
        return min(self.params.max_tokens - self.num_output, self.max_model_len - len(self.tokens))

    def decode_steps(self, most: int) -> int:
        """Tokens one Verify call may decode for this sequence (plain
        decoding, VerifySequence.decode_steps): up to ``most`` for a sequence
        that drafts nothing this round (method none, or a proposer asked for
        nothing: ``planned_budget``; a feature head's sequence too: the
        scorer answers the target's features of every position decoded) and
        whose scorer holds its context (a first touch answers one token: the
        first token comes as early as without), cut so that a call never
        makes more output than max_tokens or the context allow; 1 otherwise."""
        drafting = self.params.num_speculative_tokens and self.planned_budget != 0
        if drafting or not self.scorer_primed:
            return 1
        return self.plain_steps(most)

    def plain_steps(self, most: int) -> int:
        """Tokens a plain decoding call would decode for it: up to ``most``,
        cut to what max_tokens and the context allow."""
        return max(1, min(most, self._tokens_left()))

    @property
    def may_draft_ahead(self) -> bool:
        """Whether drafts proposed before the last round's outcome may be used
        (drafting ahead, gateway/loop.py): only where the output cannot depend
        on which drafts were verified — greedy or target-match verification
        with the normal accept policy (rejection sampling's result depends on
        the drafts, and a seeded request must come out the same every time).
        Feature methods draft ahead too: a draft ahead is proposed from the
        committed context, whose target features (all but the newest
        token's) the proposer already holds, exactly as a lock-step one."""
        p = self.params
        return p.verify_strategy in _DRAFT_INDEPENDENT and p.accept_policy == pb.ACCEPT_POLICY_NORMAL

    @property
    def model_drafts(self) -> bool:
        """Its drafts come from a model (not from a copy, nor from a hybrid
        that copies where it can): each draft token costs its proposer a forward."""
        return self.model_drafted is not None and self.model_drafted >= MODEL_DRAFTED

    @property
    def copies_plainly(self) -> bool:
        """A sequence drafting by copies only that asks its proposer for
        nothing this round (``planned_budget`` 0 from ``costs.CopyGates``):
        it decodes plainly, several tokens a call, verifying no draft (in
        rounds that draft ahead, its proposer is still asked beside the
        Verify)."""
        return self.drafts_by_copying and self.planned_budget == 0

    @property
    def drafts_by_copying(self) -> bool:
        """Its drafts are copies alone (no forward behind them): a copy
        method's, or a model-and-copy method's whose model was last planned
        to draft nothing (``planned_model_steps`` 0, ``DraftBudgets``), which
        then drafts as the n-gram method does and is gated as it is
        (``CopyGates``)."""
        return self.params.method in ONE_HOT_METHODS or (self.mixes_model_and_copies
                                                         and self.planned_model_steps == 0)

    @property
    def mixes_model_and_copies(self) -> bool:
        """Its method drafts from a model or a copy (``MODEL_AND_COPY_METHODS``):
        its model's steps are planned apart from its copies."""
        return self.params.method in MODEL_AND_COPY_METHODS

    def propose_budget(self, ahead: bool) -> int:
        """Draft tokens to ask the proposer for: this round's budget (cut to
        ``planned_budget`` when the adaptive length planned one), or when
        drafting ahead enough for this round, its target token and the next
        round (2k + 1), and a token more for each round its exchange is
        expected to outlast (``rounds_in_flight``: the rounds before its
        answer lands commit at least a token each), at most
        MAX_SPECULATIVE_TOKENS."""
        k = self.num_speculative_tokens()
        if ahead and k:
            return min(2 * k + 1 + self.rounds_in_flight, MAX_SPECULATIVE_TOKENS)
        return k if self.planned_budget is None else min(k, self.planned_budget)

    def proposer_opened(self, feature_layers: tuple[int, ...], features_from: int) -> None:
        """The proposer answered this sequence's open, declaring the target
        features it drafts from. Rows of positions before the pending
        token's are only computed by a prefill: when the proposer needs any,
        the scorer re-prefills the sequence (same tokens, KV cache rebuilt)."""
        self.features.opened(feature_layers, features_from)
        if feature_layers and features_from < len(self.tokens) - 1:
            self.scorer_primed = False

    def relay_features(self, budget: int, alone: bool) -> FeatureBlock | None:
        """The pending feature rows for this round's update to the proposer
        (FeatureRelay.take), counted in the stats and metrics."""
        block = self.features.take(budget, alone)
        if block is not None:
            self.stats.feature_bytes += len(block.data)
            metrics.FEATURE_BYTES.labels(self.params.method).inc(len(block.data))
        return block

    # -------------------------------------------------------------- commit

    def commit(self, output_token_ids: list[int], num_drafts: int, num_accepted: int) -> None:
        """Appends a round's output tokens, applies the stop conditions and
        streams the delta."""
        if self.stats.rounds == 0:
            self.stats.ttft_s = time.perf_counter() - self.started
        self.stats.record_round(num_drafts, num_accepted)
        for _ in range(len(output_token_ids) - num_accepted - 1):  # decode_steps: a round per target step
            self.stats.record_round(0, 0)
        for token in output_token_ids:
            self.tokens.append(token)
            if not self.params.ignore_eos and token in self.eos_token_ids:
                self.finish_reason = FinishReason.STOP
                break
            if self.num_output >= self.params.max_tokens or len(self.tokens) >= self.max_model_len:
                self.finish_reason = FinishReason.LENGTH
                break
        self.acceptance.resolve(self.tokens)
        self.model_acceptance.resolve(self.tokens)
        self._text = self._decoder.text(self.tokens[self.num_prompt:])
        self._apply_stop_strings()
        self._emit()

    def _apply_stop_strings(self) -> None:
        """Ends the text before the first stop string; the tokens are kept up
        to the one that completed it (later tokens of the round are dropped)."""
        if not self.params.stop:
            return
        longest = max(map(len, self.params.stop))
        start = max(0, self._emitted_chars - longest)
        hits = [(i, i + len(s)) for s, i in ((s, self._text.find(s, start)) for s in self.params.stop) if i >= 0]
        if not hits:
            return
        cut, end = min(hits)
        output = self.tokens[self.num_prompt:]
        for n in range(self._emitted_tokens + 1, len(output) + 1):
            if len(self.tokenizer.decode(output[:n], skip_special_tokens=True)) >= end:
                del self.tokens[self.num_prompt + n:]
                break
        self._text = self._text[:cut]
        self.finish_reason = FinishReason.STOP

    def _emit(self) -> None:
        """Streams new tokens and the text that can no longer change: a
        trailing partial UTF-8 character or a possible stop-string prefix is
        held back until the next round (or the end)."""
        safe = len(self._text)
        if not self.done:
            if self._text.endswith("\ufffd"):
                safe = len(self._text.rstrip("\ufffd"))
            for s in self.params.stop:
                for n in range(min(len(s) - 1, safe), 0, -1):
                    if self._text[:safe].endswith(s[:n]):
                        safe -= n
                        break
        delta = Delta(
            request_id=self.request_id,
            text=self._text[self._emitted_chars:max(safe, self._emitted_chars)],
            token_ids=self.tokens[self.num_prompt + self._emitted_tokens:],
            finish_reason=self.finish_reason,
            stats=self.final_stats() if self.done else None)
        self._emitted_chars = max(safe, self._emitted_chars)
        self._emitted_tokens = self.num_output
        if delta.text or delta.token_ids or self.done:
            self.out.put_nowait(delta)

    def fail(self, error: RequestFailed) -> None:
        self.failed = True
        self.failure_code = error.code
        self.out.put_nowait(error)

    def final_stats(self) -> FinalStats:
        s = self.stats
        return FinalStats(
            prompt_tokens=self.num_prompt, output_tokens=self.num_output, rounds=s.rounds,
            draft_tokens=s.draft_tokens, accepted_tokens=s.accepted_tokens,
            acceptance_by_position=[a / p for a, p in zip(s.accepted_at, s.proposed_at)],
            mean_accepted_length=self.num_output / s.rounds if s.rounds else 0.0,
            propose_s=s.propose_s, verify_s=s.verify_s, network_s=s.network_s,
            wall_s=time.perf_counter() - self.started, ttft_s=s.ttft_s, feature_bytes=s.feature_bytes,
            scorer_numerics_changes=s.numerics_changes)

    def computed_by(self, numerics: str) -> str | None:
        """A scorer of arithmetic ``numerics`` answered the sequence's
        Verify ("": a scorer that does not say). After a move: "same" or
        "changed" (the replica computes otherwise than the one that made the
        tokens so far, counted in the stats); else None."""
        moved, self.scorer_moved = self.scorer_moved, False
        if not numerics:
            return None
        before, self.numerics = self.numerics, numerics
        if before is None or before == numerics:
            return "same" if moved and before is not None else None
        self.stats.numerics_changes += 1
        return "changed"
