"""The Proposer gRPC servicer: translates the batched bidi stream into plain
calls on the proposer algorithms (which never see protobuf messages)."""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from prometheus_client import Counter, Gauge, Histogram

from specdec.drafts import ONE_HOT_METHODS, Draft
from specdec.limits import (
    DEFAULT_MAX_N,
    DEFAULT_MAX_SPEC_FACTOR,
    DEFAULT_MAX_TREE_DEPTH,
    DEFAULT_MIN_N,
    MAX_BRANCH_WIDTH,
    MAX_SPECULATIVE_TOKENS,
)
from specdec.proposer_svc.base import BranchBatch, DraftBatch, Proposer, SeqOptions, bounds_of
from specdec.protos.v1 import specdec_pb2 as pb
from specdec.protos.v1 import specdec_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from specdec.servers import ServerSecurity

log = logging.getLogger(__name__)

PROPOSE_BATCHES = Counter("specdec_proposer_batches_total", "Propose messages handled")
DRAFT_TOKENS = Counter("specdec_proposer_draft_tokens_total", "Draft tokens returned", ["method"])
LIVE_SEQUENCES = Gauge("specdec_proposer_live_sequences", "Sequences with proposer state")
BATCH_SECONDS = Histogram("specdec_proposer_batch_seconds", "Compute time per Propose message")
MESSAGE_WAIT_SECONDS = Histogram(
    "specdec_proposer_message_wait_seconds",
    "Time a Propose message waits from its delivery by the event loop (its read completed) until it is "
    "handled: behind upkeep slices and other streams' turns; a wait while the loop runs one step (an upkeep "
    "step, another message) ends before delivery and is not seen",
    buckets=(5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, float("inf")))
PROPOSER_STATE = Gauge("specdec_proposer_state", "Proposer gauges: memory_bytes, tree_nodes, "
                       "cached_requests, live_sequences", ["method", "key"])
STATE_EVERY_S = 1.0  # how often the proposer gauges are refreshed
#: deferred upkeep (Proposer.between_messages) runs while no message waits,
#: in slices of about this long: a message that arrives meanwhile waits for
#: the rest of one slice (or of the step it overruns in: see between_messages)
UPKEEP_SLICE_S = 0.0005
#: turns of the event loop after each slice: a message that has arrived
#: reaches its read task only a few turns later (grpc's poller, then the
#: read's own awaits). bench_proposer.py --ahead --burst 2 --gap-ms 10,
#: suffix B=256, AMD EPYC: the second round of a burst took 1.07 ms longer
#: than the first with 1 turn, 0.37 with 4, 0.27 with 10 (0.22 with 20)
UPKEEP_YIELDS = 10
#: upkeep queued while handling message m is done once message m +
#: UPKEEP_MAX_POSTPONED is answered, or at the first answer after it has
#: waited UPKEEP_MAX_DELAY_S, even when messages come back to back: it
#: cannot fall behind without bound
UPKEEP_MAX_POSTPONED = 8
UPKEEP_MAX_DELAY_S = 0.05


UNKNOWN_MESSAGE = "no proposer state for this sequence; re-open it"


class InvalidUpdate(ValueError):
    """A sequence update is malformed; the message names the field."""


def _checked(update: pb.SequenceUpdate) -> tuple[int, list[int]]:
    """The update's num_speculative_tokens and token ids, validated."""
    if not update.seq_id:
        raise InvalidUpdate("seq_id: must not be empty")
    k = update.num_speculative_tokens
    if not 0 <= k <= MAX_SPECULATIVE_TOKENS:
        raise InvalidUpdate(f"num_speculative_tokens: must be in 0..{MAX_SPECULATIVE_TOKENS}, got {k}")
    tokens = list(update.token_ids)
    if tokens and min(tokens) < 0:
        raise InvalidUpdate("token_ids: negative token id")
    if update.HasField("model_steps"):
        if not 0 <= update.model_steps <= k:
            raise InvalidUpdate(f"model_steps: must be in 0..num_speculative_tokens ({k}), got {update.model_steps}")
    return k, tokens


class _Round:
    """One method's sequences of a message, gathered for ``Proposer.advance``."""

    __slots__ = ("drafts", "seq_ids", "tokens", "counts", "context_lens", "ks", "features")

    def __init__(self) -> None:
        self.drafts: list[pb.Draft] = []  # each sequence's message in the response
        self.seq_ids: list[str] = []
        self.tokens: list[int] = []  # new tokens of all, concatenated
        self.counts: list[int] = []  # new tokens of each
        self.context_lens: list[int] = []
        self.ks: list[int] = []
        self.features: list[tuple[int, np.ndarray] | None] = []  # (start, float32 [rows, dim]) of each

    def add(self, draft: pb.Draft, seq_id: str, tokens: list[int], context_len: int, k: int,
            features: tuple[int, np.ndarray] | None = None) -> None:
        self.drafts.append(draft)
        self.seq_ids.append(seq_id)
        self.tokens.extend(tokens)
        self.counts.append(len(tokens))
        self.context_lens.append(context_len)
        self.ks.append(k)
        self.features.append(features)


class _Batch(NamedTuple):
    """One method's plain updates of a message, as ``Proposer.advance`` takes them."""

    msgs: list[pb.Draft]  # each sequence's message in the response
    seq_ids: list[str]
    tokens: np.ndarray  # int32 [total]: the new tokens of all, concatenated
    bounds: np.ndarray  # int64 [n + 1]: sequence i's are tokens[bounds[i]:bounds[i + 1]]
    context_lens: np.ndarray  # int64 [n]
    ks: np.ndarray  # int64 [n]


def _options(msg: pb.ProposerOptions, methods: dict[str, Proposer]) -> SeqOptions:
    """Zero means "default" (specdec.limits) for the knobs that cannot be
    zero; min_token_prob is taken as sent (the gateway always fills it)."""
    if msg.method not in methods:
        raise InvalidUpdate(f"options.method: unknown or not served here: {msg.method!r} "
                            f"(served: {sorted(methods)})")
    min_n, max_n = msg.min_n or DEFAULT_MIN_N, msg.max_n or DEFAULT_MAX_N
    if not 1 <= min_n <= max_n:
        raise InvalidUpdate(f"options.min_n/max_n: need 1 <= min_n <= max_n, got {min_n}, {max_n}")
    depth = msg.max_tree_depth or DEFAULT_MAX_TREE_DEPTH
    if depth < 1:
        raise InvalidUpdate(f"options.max_tree_depth: must be >= 1, got {depth}")
    factor = msg.max_spec_factor or DEFAULT_MAX_SPEC_FACTOR
    prob = msg.min_token_prob
    if factor <= 0 or not 0.0 <= prob <= 1.0:
        raise InvalidUpdate("options.max_spec_factor must be > 0 and min_token_prob in [0, 1]")
    if not 0.0 <= msg.temperature < float("inf"):
        raise InvalidUpdate(f"options.temperature: must be finite and >= 0, got {msg.temperature}")
    return SeqOptions(min_n=min_n, max_n=max_n, max_tree_depth=depth,
                      max_spec_factor=factor, min_token_prob=prob,
                      reference_token_ids=np.asarray(msg.reference_token_ids, dtype=np.int32),
                      temperature=msg.temperature, seed=msg.seed)


def _feature_rows(msg: pb.Features, dim: int) -> np.ndarray:
    """A Features message as float32 [rows, dim] (bfloat16 on the wire)."""
    if msg.start < 0 or msg.rows < 0:
        raise InvalidUpdate(f"features.start/rows: must be >= 0, got {msg.start}, {msg.rows}")
    if msg.dim != dim:
        raise InvalidUpdate(f"features.dim: this method reads {dim} values per row, got {msg.dim}")
    if len(msg.data) != 2 * msg.rows * msg.dim:
        raise InvalidUpdate(f"features.data: {len(msg.data)} bytes, rows * dim * 2 = {2 * msg.rows * msg.dim}")
    bits = np.frombuffer(msg.data, dtype="<u2").astype(np.uint32) << 16  # bfloat16 bit patterns, little-endian
    rows = bits.view(np.float32).reshape(msg.rows, msg.dim)
    if not np.isfinite(rows).all():
        raise InvalidUpdate("features.data: non-finite values")
    return rows


def _ints(field, dtype) -> np.ndarray:
    """A repeated integer field as a numpy array (np.array reads upb's
    container about 10x faster than np.fromiter: 4 against 47 us for 768
    ids)."""
    return np.array(field, dtype=dtype)


def _columns_shape_error(cols: pb.RoundUpdates, n: int) -> str:
    """Why a RoundUpdates' columns do not fit together ("" when they do)."""
    for name in ("token_counts", "context_lens", "num_speculative_tokens"):
        if len(getattr(cols, name)) != n:
            return f"round.{name}: {len(getattr(cols, name))} entries for {n} seq_ids"
    counts = cols.token_counts
    if n and min(counts) < 0:
        return "round.token_counts: negative count"
    if sum(counts) != len(cols.token_ids):
        return f"round.token_ids: {len(cols.token_ids)} tokens, token_counts add up to {sum(counts)}"
    if not 0 <= cols.branch_width <= MAX_BRANCH_WIDTH:
        return f"round.branch_width: must be in 0..{MAX_BRANCH_WIDTH}, got {cols.branch_width}"
    if len(cols.branch_depths) not in (0, n):
        return f"round.branch_depths: {len(cols.branch_depths)} entries for {n} seq_ids (or none)"
    if len(cols.ahead_ks) not in (0, n):
        return f"round.ahead_ks: {len(cols.ahead_ks)} entries for {n} seq_ids (or none)"
    return ""


def _flat_drafts(method: str, result: DraftBatch) -> tuple[np.ndarray, np.ndarray]:
    """A one-hot method's drafts as (token_ids int32 [total], offsets int64
    [n + 1]), also when its advance returned them one by one (the default
    Proposer.advance does)."""
    if result.drafts is None:
        return result.token_ids, result.offsets
    if any(d.probs for d in result.drafts):  # (a bug: its drafts cannot travel as columns)
        raise RuntimeError(f"method {method!r} is one-hot but returned drafts with probabilities")
    offsets = bounds_of(np.array([len(d) for d in result.drafts], dtype=np.int64))
    tokens = np.concatenate([d.token_ids for d in result.drafts]) if result.drafts else np.zeros(0)
    return tokens.astype(np.int32, copy=False), offsets


def _fill_branches(out: pb.RoundDrafts, n: int, branched: list[tuple[np.ndarray, BranchBatch]]) -> None:
    """Writes the branches of a round's entries (each method's BranchBatch
    with the entries it is for) as RoundDrafts.branch_* columns, in entry
    order. Only messages that ask for branches come here: a few sequences."""
    per_entry: dict[int, tuple[BranchBatch, int]] = {}  # entry -> (its batch, its index there)
    for entries, made in branched:
        per_entry.update((j, (made, i)) for i, j in enumerate(entries.tolist()))
    counts = [0] * n
    for j, (made, i) in sorted(per_entry.items()):
        first, last = int(made.offsets[i]), int(made.offsets[i + 1])
        counts[j] = last - first
        out.branch_positions.extend(made.positions[first:last].tolist())
        out.branch_tokens.extend(made.tokens[first:last].tolist())
        out.branch_lens.extend(np.diff(made.starts[first:last + 1]).tolist())
        out.branch_token_ids.extend(made.token_ids[made.starts[first]:made.starts[last]].tolist())
    out.branch_counts.extend(counts)


def _fill_draft(msg: pb.Draft, draft: Draft) -> None:
    """Writes a domain draft into its wire message."""
    msg.token_ids.extend(draft.token_ids.tolist())
    for ids, probs in zip(draft.prob_token_ids, draft.probs):
        msg.probs.add(token_ids=ids.tolist(), probs=probs.tolist())


async def _read_one(messages) -> tuple[pb.ProposeRequest | None, float]:
    """The stream's next message (None at its end) and when it arrived
    (time.perf_counter() once read: a message that reaches the socket while
    the event loop is busy counts from when the loop delivers it)."""
    try:
        request = await messages.__anext__()
    except StopAsyncIteration:
        request = None
    return request, time.perf_counter()


class _Inbox:
    """A stream's messages, each read ahead in a task of its own, so that the
    servicer sees whether one waits while it runs upkeep."""

    def __init__(self, requests) -> None:
        self._messages = requests.__aiter__()
        self._next = asyncio.ensure_future(_read_one(self._messages))
        self.arrived = 0.0  # when the message get() returned last arrived (time.perf_counter())

    def waiting(self) -> bool:
        """A message (or the stream's end or failure) has arrived and waits."""
        return self._next.done()

    async def get(self) -> pb.ProposeRequest | None:
        """The next message (None: the stream ended); raises what reading raised."""
        request, self.arrived = await self._next
        if request is not None:
            self._next = asyncio.ensure_future(_read_one(self._messages))
        return request

    def close(self) -> None:
        if not self._next.done():
            self._next.cancel()
        elif not self._next.cancelled():
            self._next.exception()  # (retrieved: no "never retrieved" warning)


class _Upkeep:
    """The proposers' deferred upkeep (``Proposer.between_messages``), off
    the rounds' critical path: run in slices while no message waits, and
    before a message only once overdue (UPKEEP_MAX_*)."""

    def __init__(self, proposers: list[Proposer]) -> None:
        self.proposers = proposers
        self.max_postponed, self.max_delay_s = UPKEEP_MAX_POSTPONED, UPKEEP_MAX_DELAY_S
        # after each handled message, oldest first: (when, each proposer's units of upkeep queued then)
        self._marks: deque[tuple[float, list[int]]] = deque()

    def note(self) -> None:
        """Notes the upkeep queued so far (after a message is handled)."""
        self._marks.append((time.monotonic(), [p.upkeep_progress()[0] for p in self.proposers]))

    def pending(self) -> bool:
        return any(queued > done for queued, done in (p.upkeep_progress() for p in self.proposers))

    def run_slice(self) -> None:
        """About UPKEEP_SLICE_S of upkeep, of the first proposer with some left."""
        for proposer in self.proposers:
            queued, done = proposer.upkeep_progress()
            if queued > done:
                proposer.between_messages(UPKEEP_SLICE_S)
                return

    def run_overdue(self) -> None:
        """Once a message is answered: the upkeep queued by the messages
        more than max_postponed before it, or more than max_delay_s ago."""
        marks, target = self._marks, None
        too_old = time.monotonic() - self.max_delay_s
        while marks and (len(marks) > self.max_postponed or marks[0][0] < too_old):
            target = marks.popleft()[1]
        for proposer, queued in zip(self.proposers, target or ()):
            while proposer.upkeep_progress()[1] < queued:
                proposer.between_messages(UPKEEP_SLICE_S)

    def flush(self) -> None:
        for proposer in self.proposers:
            proposer.between_messages()


class ProposerServicer(pb_grpc.ProposerServicer):
    """Serves the methods in `proposers`; per-sequence state lives in them."""

    def __init__(self, proposers: dict[str, Proposer], added_latency_s: float = 0.0) -> None:
        self.proposers = proposers
        self.added_latency_s = added_latency_s  # benchmarks: a remote or model-based proposer's delay
        self._method_of: dict[str, str] = {}  # seq_id -> method name
        self._owner: dict[str, object] = {}  # seq_id -> the stream that opened it
        self._featured = {m for m, p in proposers.items() if p.feature_layers}  # methods that take features
        self._state_at = float("-inf")  # when the proposer gauges were last refreshed
        self.upkeep = _Upkeep(list(proposers.values()))
        self._inboxes: set[_Inbox] = set()  # of the open streams
        self._left_upkeep: asyncio.Task | None = None  # slices of the upkeep a stream left (_after_stream)

    async def Propose(self, request_iterator, context):
        """Sequences belong to the stream that opened them: when the stream
        ends (the gateway went away or reset it) their state is freed and
        the upkeep left is done (``_after_stream``). Upkeep runs between messages: the overdue
        part once the answer is on its way (as all of it did before: it
        overlaps the answer's trip and the gateway's turn), the rest while
        no message waits (``_next``)."""
        owner = object()
        inbox = _Inbox(request_iterator)
        self._inboxes.add(inbox)
        try:
            while (request := await self._next(inbox)) is not None:
                start = time.perf_counter()
                MESSAGE_WAIT_SECONDS.observe(start - inbox.arrived)
                response = self.handle(request, owner)
                self.upkeep.note()
                response.compute_s = time.perf_counter() - start
                BATCH_SECONDS.observe(response.compute_s)
                PROPOSE_BATCHES.inc()
                self._refresh_state()
                if self.added_latency_s:
                    await asyncio.sleep(self.added_latency_s)
                yield response
                self.upkeep.run_overdue()
        finally:
            self._inboxes.discard(inbox)
            inbox.close()
            for seq_id in [s for s, o in self._owner.items() if o is owner]:
                self._stop(seq_id, completed=False)
            self._after_stream()
            LIVE_SEQUENCES.set(len(self._method_of))

    def _after_stream(self) -> None:
        """The upkeep left when a stream has ended: all of it at once when no
        stream is left open (no message can wait for it), else in slices
        like any other (it is replica-wide, its marks too): from now until a
        message waits, then by the stream that answers it (``_next``) and
        under the overdue bound; the last stream to end flushes the rest."""
        if not self._inboxes:
            self.upkeep.flush()
        elif self.upkeep.pending() and (self._left_upkeep is None or self._left_upkeep.done()):
            self._left_upkeep = asyncio.ensure_future(self._upkeep_while_idle())

    async def _next(self, inbox: _Inbox) -> pb.ProposeRequest | None:
        """The stream's next message (None at its end), once the upkeep left
        is done or a message waits on any stream."""
        await self._upkeep_while_idle()
        return await inbox.get()

    async def _upkeep_while_idle(self) -> None:
        """Upkeep in slices until none is left or a message waits on any
        stream, each slice followed by up to UPKEEP_YIELDS turns of the
        event loop (which may deliver one)."""
        while self.upkeep.pending() and not self._waiting():
            self.upkeep.run_slice()
            for _ in range(UPKEEP_YIELDS):
                await asyncio.sleep(0)
                if self._waiting():
                    break

    def _waiting(self) -> bool:
        return any(i.waiting() for i in self._inboxes)

    def handle(self, request: pb.ProposeRequest, owner: object = None) -> pb.ProposeResponse:
        """Applies releases, then the round's columns (``_columns``), then the
        updates in order: opens at once, the others gathered into one
        ``advance`` per method (their new tokens and drafts together). A
        sequence named again in the message first runs
        what is gathered, so updates apply as if sent one by one. In a
        message that names each sequence once, the plain updates (the usual
        round, see ``_plain_rounds``) are gathered and run first: sequences
        are independent, so that changes no result."""
        for release in request.releases:
            self._stop(release.seq_id, release.completed)
        response = pb.ProposeResponse(batch_id=request.batch_id)
        if request.HasField("round"):
            response.round.SetInParent()
            self._columns(request.round, response.round)
        updates = request.sequences
        seq_ids = [u.seq_id for u in updates]
        add = response.drafts.add
        msgs = [add(seq_id=s) for s in seq_ids]
        one_by_one = list(range(len(seq_ids)))
        if len(set(seq_ids)) == len(seq_ids):
            rounds, one_by_one = self._plain_rounds(updates, seq_ids, msgs)
            for method, batch in rounds.items():
                self._advance(method, *batch)
        self._handle_in_order([updates[j] for j in one_by_one], [msgs[j] for j in one_by_one], owner)
        LIVE_SEQUENCES.set(len(self._method_of))
        return response

    def _columns(self, cols: pb.RoundUpdates, out: pb.RoundDrafts) -> None:
        """A message's column updates (ProposeRequest.round): checked with a
        few vectorised passes, then one ``advance`` per method, the drafts
        answered as columns. A malformed set of columns fails every entry
        (INVALID, the field named); a bad entry fails alone."""
        seq_ids = list(cols.seq_ids)
        n = len(seq_ids)
        status = np.full(n, pb.SEQUENCE_STATUS_OK, dtype=np.int64)
        messages = [""] * n
        why = _columns_shape_error(cols, n)
        if why:
            out.draft_counts.extend([0] * n)
            out.statuses.extend([pb.SEQUENCE_STATUS_INVALID] * n)
            out.messages.extend([why] * n)
            return
        counts, tokens = _ints(cols.token_counts, np.int64), _ints(cols.token_ids, np.int32)
        context_lens, ks = _ints(cols.context_lens, np.int64), _ints(cols.num_speculative_tokens, np.int64)

        def fail(rows: np.ndarray, code: int, message: str) -> None:
            for j in np.flatnonzero(rows & (status == pb.SEQUENCE_STATUS_OK)).tolist():
                status[j], messages[j] = code, message

        fail((ks < 0) | (ks > MAX_SPECULATIVE_TOKENS), pb.SEQUENCE_STATUS_INVALID,
             f"round.num_speculative_tokens: must be in 0..{MAX_SPECULATIVE_TOKENS}")
        fail(context_lens < 0, pb.SEQUENCE_STATUS_INVALID, "round.context_lens: must be >= 0")
        depths = _ints(cols.branch_depths, np.int64) if cols.branch_width and len(cols.branch_depths) else None
        if depths is not None:
            fail((depths < 0) | ((depths > 0) & (depths >= ks)), pb.SEQUENCE_STATUS_INVALID,
                 "round.branch_depths: must be in 0..num_speculative_tokens - 1")
        aheads = _ints(cols.ahead_ks, np.int64) if len(cols.ahead_ks) else None
        if aheads is not None:
            fail((aheads < 0) | ((aheads > 0) & (aheads >= ks)), pb.SEQUENCE_STATUS_INVALID,
                 "round.ahead_ks: must be in 0..num_speculative_tokens - 1")
        if len(tokens) and tokens.min() < 0:
            fail(np.bincount(np.repeat(np.arange(n), counts)[tokens < 0], minlength=n) > 0,
                 pb.SEQUENCE_STATUS_INVALID, "round.token_ids: negative token id")
        if len(set(seq_ids)) < n or "" in seq_ids:
            seen: dict[str, int] = {}
            for s in seq_ids:
                seen[s] = seen.get(s, 0) + 1
            fail(np.array([seen[s] > 1 for s in seq_ids]), pb.SEQUENCE_STATUS_INVALID,
                 "round.seq_ids: named twice in one message")
            fail(np.array([not s for s in seq_ids]), pb.SEQUENCE_STATUS_INVALID, "round.seq_ids: must not be empty")
        methods = [self._method_of.get(s, "") for s in seq_ids]
        kinds = set(methods)
        if "" in kinds:
            fail(np.array([not m for m in methods]), pb.SEQUENCE_STATUS_UNKNOWN_SEQUENCE, UNKNOWN_MESSAGE)
        if kinds - {"", *ONE_HOT_METHODS}:
            fail(np.array([m not in ONE_HOT_METHODS for m in methods]), pb.SEQUENCE_STATUS_INVALID,
                 "round.seq_ids: its method drafts with probabilities or features; send its updates in sequences")
        # one advance per method over its valid entries; drafts placed back in entry order
        draft_counts = np.zeros(n, dtype=np.int64)
        found: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (entries, drafts, their offsets)
        branched: list[tuple[np.ndarray, BranchBatch]] = []  # (entries, their branches)
        ok = status == pb.SEQUENCE_STATUS_OK
        by_name = np.array(methods) if len(kinds) > 1 else None
        for method in sorted(kinds & set(ONE_HOT_METHODS)):
            rows = ok if by_name is None else ok & (by_name == method)
            entries = np.flatnonzero(rows)
            if not len(entries):
                continue
            result = self.proposers[method].advance([seq_ids[j] for j in entries.tolist()],
                                                    tokens[np.repeat(rows, counts)], bounds_of(counts[entries]),
                                                    context_lens[entries], ks[entries])
            for j in entries[~result.in_sync].tolist():
                self._stop(seq_ids[j], completed=False)
                status[j], messages[j] = pb.SEQUENCE_STATUS_UNKNOWN_SEQUENCE, UNKNOWN_MESSAGE
            drafts, offsets = _flat_drafts(method, result)
            in_sync = result.in_sync & (status[entries] == pb.SEQUENCE_STATUS_OK)
            if aheads is not None and (aheads[entries] * in_sync).any():
                continued = self.proposers[method].ahead([seq_ids[j] for j in entries.tolist()], drafts, offsets,
                                                         ks[entries], aheads[entries] * in_sync)
                if continued is not None:
                    drafts, offsets = continued
            draft_counts[entries] = np.diff(offsets)
            found.append((entries, drafts, offsets))
            DRAFT_TOKENS.labels(method).inc(len(drafts))
            if depths is not None:
                wanted = np.where(in_sync, depths[entries], 0)
                if wanted.any():
                    made = self.proposers[method].branches([seq_ids[j] for j in entries.tolist()], drafts, offsets,
                                                           ks[entries], wanted, cols.branch_width)
                    if made is not None:
                        branched.append((entries, made))
        out.draft_counts.extend(draft_counts.tolist())
        if len(found) == 1 and len(found[0][0]) == n:
            out.token_ids.extend(found[0][1].tolist())
        elif found:
            starts = bounds_of(draft_counts)
            flat = np.empty(int(starts[-1]), dtype=np.int32)
            for entries, drafts, offsets in found:
                sizes = np.diff(offsets)
                flat[np.repeat(starts[entries] - offsets[:-1], sizes) + np.arange(len(drafts))] = drafts
            out.token_ids.extend(flat.tolist())
        if branched:
            _fill_branches(out, n, branched)
        if (status != pb.SEQUENCE_STATUS_OK).any():
            out.statuses.extend(status.tolist())
            out.messages.extend(messages)

    def _plain_rounds(self, updates, seq_ids: list[str], msgs: list[pb.Draft]) -> tuple[dict[str, _Batch], list[int]]:
        """Gathers by method the *plain* updates of a message: no open, no
        features, a known sequence of a method without feature_layers, valid k
        and tokens (the usual round). Found with a few vectorised passes: a
        per-update Python step is a round's main cost. Returns them and the
        indices of the others, for ``_handle_in_order``."""
        n = len(seq_ids)
        fields = [(u.open or u.HasField("features"), u.token_ids, u.num_speculative_tokens, u.context_len,
                   u.HasField("model_steps"), u.model_steps) for u in updates]
        method_of, featured = self._method_of, self._featured
        methods = ["" if f[0] else method_of.get(s, "") for s, f in zip(seq_ids, fields)]  # "": not plain
        odd = np.array([not m or m in featured for m in methods], dtype=bool)
        counts = np.fromiter([len(f[1]) for f in fields], dtype=np.int64, count=n)
        tokens = np.fromiter(itertools.chain.from_iterable([f[1] for f in fields]), dtype=np.int32,
                             count=int(counts.sum()))
        ks = np.fromiter([f[2] for f in fields], dtype=np.int64, count=n)
        context_lens = np.fromiter([f[3] for f in fields], dtype=np.int64, count=n)
        odd |= (ks < 0) | (ks > MAX_SPECULATIVE_TOKENS)
        capped = np.fromiter([f[4] for f in fields], dtype=bool, count=n)
        if capped.any():  # SequenceUpdate.model_steps
            model_steps = np.fromiter([f[5] for f in fields], dtype=np.int64, count=n)
            odd |= capped & ((model_steps < 0) | (model_steps > ks))
            for j in np.flatnonzero(~odd & capped).tolist():
                self.proposers[methods[j]].limit_model_steps(seq_ids[j], int(model_steps[j]))
        if len(tokens) and tokens.min() < 0:
            odd[np.repeat(np.arange(n), counts)[tokens < 0]] = True
        rounds: dict[str, _Batch] = {}
        if not odd.any() and len(set(methods)) == 1:  # one method, all plain
            rounds[methods[0]] = _Batch(msgs, seq_ids, tokens, bounds_of(counts), context_lens, ks)
        else:
            plain = np.flatnonzero(~odd)
            by_method: dict[str, list[int]] = {}
            for j in plain.tolist():
                by_method.setdefault(methods[j], []).append(j)
            token_row = np.repeat(np.arange(n), counts)
            for method, rows in by_method.items():
                take = np.array(rows, dtype=np.int64)
                rounds[method] = _Batch([msgs[j] for j in rows], [seq_ids[j] for j in rows],
                                        tokens[np.isin(token_row, take)], bounds_of(counts[take]),
                                        context_lens[take], ks[take])
        return rounds, np.flatnonzero(odd).tolist()

    def _handle_in_order(self, updates, msgs: list[pb.Draft], owner: object) -> None:
        """Updates one by one (opens, features, bad or repeated sequences):
        opens at once, the others gathered into one ``advance`` per method; a
        sequence named again first runs what is gathered."""
        rounds: dict[str, _Round] = {}
        gathered: set[str] = set()
        method_of = self._method_of
        for update, msg in zip(updates, msgs):
            seq_id = update.seq_id
            if seq_id in gathered:
                self._advance_all(rounds)
                rounds, gathered = {}, set()
            try:
                k, tokens = _checked(update)
                if update.open:
                    method = self._open(update, tokens, owner)
                    tokens = []
                    if self.proposers[method].feature_layers:
                        msg.feature_layers.extend(self.proposers[method].feature_layers)
                elif seq_id in method_of:
                    method = method_of[seq_id]
                else:
                    msg.status, msg.message = pb.SEQUENCE_STATUS_UNKNOWN_SEQUENCE, UNKNOWN_MESSAGE
                    continue
                if update.HasField("model_steps"):
                    self.proposers[method].limit_model_steps(seq_id, update.model_steps)
                features = self._features(update, method)
            except InvalidUpdate as e:
                msg.status, msg.message = pb.SEQUENCE_STATUS_INVALID, str(e)
                continue
            if method not in rounds:
                rounds[method] = _Round()
            rounds[method].add(msg, seq_id, tokens, update.context_len, k, features)
            gathered.add(seq_id)
        self._advance_all(rounds)

    def _advance_all(self, rounds: dict[str, _Round]) -> None:
        for method, batch in rounds.items():
            if self.proposers[method].feature_layers:
                self._advance_with_features(method, batch)
            else:
                self._advance(method, batch.drafts, batch.seq_ids, np.array(batch.tokens, dtype=np.int32),
                              bounds_of(np.array(batch.counts, dtype=np.int64)),
                              np.array(batch.context_lens, dtype=np.int64), np.array(batch.ks, dtype=np.int64))

    def _advance(self, method: str, msgs: list[pb.Draft], seq_ids: list[str], tokens: np.ndarray,
                 bounds: np.ndarray, context_lens: np.ndarray, ks: np.ndarray) -> None:
        """Runs one method's round (arrays as ``Proposer.advance``) and writes
        its drafts into their messages."""
        result = self.proposers[method].advance(seq_ids, tokens, bounds, context_lens, ks)
        for j in np.flatnonzero(~result.in_sync).tolist():
            self._stop(seq_ids[j], completed=False)
            msg = msgs[j]
            msg.status, msg.message = pb.SEQUENCE_STATUS_UNKNOWN_SEQUENCE, UNKNOWN_MESSAGE
        if result.drafts is not None:
            for msg, ok, draft in zip(msgs, result.in_sync.tolist(), result.drafts):
                if ok:
                    _fill_draft(msg, draft)
            DRAFT_TOKENS.labels(method).inc(sum(len(d.token_ids) for d in result.drafts))
            return
        flat, offsets = result.token_ids.tolist(), result.offsets.tolist()
        for j in np.flatnonzero(np.diff(result.offsets)).tolist():
            msgs[j].token_ids.extend(flat[offsets[j]:offsets[j + 1]])
        DRAFT_TOKENS.labels(method).inc(len(flat))

    def _advance_with_features(self, method: str, batch: _Round) -> None:
        """A round of a method that drafts from target features: each
        sequence's tokens, then its feature rows (placed by position), then
        one ``propose`` for all of them; every answer says from which
        position the sequence needs features next."""
        proposer = self.proposers[method]
        wanted: list[tuple[int, str, int]] = []  # (index in batch, seq_id, k)
        bounds = bounds_of(np.array(batch.counts)).tolist()
        for j, (msg, seq_id) in enumerate(zip(batch.drafts, batch.seq_ids)):
            if bounds[j + 1] > bounds[j]:
                proposer.extend(seq_id, np.array(batch.tokens[bounds[j]:bounds[j + 1]], dtype=np.int32))
            if batch.context_lens[j] and proposer.context_len(seq_id) != batch.context_lens[j]:
                self._stop(seq_id, completed=False)
                msg.status, msg.message = pb.SEQUENCE_STATUS_UNKNOWN_SEQUENCE, UNKNOWN_MESSAGE
                continue
            features = batch.features[j]
            if features is not None:
                start, rows = features
                try:
                    proposer.add_features(seq_id, start, rows)
                except ValueError as e:
                    msg.status, msg.message = pb.SEQUENCE_STATUS_INVALID, str(e)
                    continue
            msg.features_from = proposer.features_from(seq_id)
            if batch.ks[j] > 0:
                wanted.append((j, seq_id, batch.ks[j]))
        for (j, _, k), draft in zip(wanted, proposer.propose([(seq_id, k) for _, seq_id, k in wanted])):
            _fill_draft(batch.drafts[j], draft.truncated(k))
            DRAFT_TOKENS.labels(method).inc(len(batch.drafts[j].token_ids))

    def _refresh_state(self) -> None:
        """Exports each proposer's stats() (bounded memory, tree size) at most
        once per STATE_EVERY_S."""
        now = time.monotonic()
        if now - self._state_at < STATE_EVERY_S:
            return
        self._state_at = now
        for method, proposer in self.proposers.items():
            for key, value in proposer.stats().items():
                PROPOSER_STATE.labels(method, key).set(value)

    def _stop(self, seq_id: str, completed: bool) -> None:
        method = self._method_of.pop(seq_id, None)
        self._owner.pop(seq_id, None)
        if method is not None:
            self.proposers[method].stop(seq_id, completed)

    def _features(self, update: pb.SequenceUpdate, method: str) -> tuple[int, np.ndarray] | None:
        """The update's target features as (start, float32 [rows, dim]), or None."""
        if not (update.HasField("features") and update.features.rows):
            return None
        proposer = self.proposers[method]
        if not proposer.feature_layers:
            raise InvalidUpdate(f"features: method {method!r} drafts from no target features")
        return update.features.start, _feature_rows(update.features, proposer.feature_dim)

    def _open(self, update: pb.SequenceUpdate, tokens: list[int], owner: object) -> str:
        """(Re-)opens a sequence with its whole context; returns its method."""
        options = _options(update.options, self.proposers)
        self._stop(update.seq_id, completed=False)
        method = update.options.method
        self.proposers[method].start(update.seq_id, np.array(tokens, dtype=np.int32), options)
        self._method_of[update.seq_id] = method
        self._owner[update.seq_id] = owner
        return method


async def serve(host: str, port: int, methods: list[str], settings, metrics_port: int = 0,
                security: ServerSecurity | None = None, added_latency_s: float = 0.0) -> None:
    """Serves `methods` built from `settings` (registry.ReplicaSettings)."""
    from specdec.proposer_svc.registry import build_proposers
    from specdec.servers import Server, start_metrics

    try:
        proposers = build_proposers(methods, settings)
    except ValueError as e:
        raise SystemExit(f"--methods: {e}") from None
    server = Server(host, port, ["Proposer"], security)
    pb_grpc.add_ProposerServicer_to_server(ProposerServicer(proposers, added_latency_s), server.server)
    start_metrics(metrics_port)
    log.info("proposer serving %s on %s:%d", sorted(proposers), host, server.port)
    print(f"proposer listening on {host}:{server.port}", flush=True)
    await server.run_until_signal()
