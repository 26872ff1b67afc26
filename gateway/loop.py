"""The speculative decoding loop. Every sequence goes through rounds of

    propose: each proposer replica gets one message with its sequences' new
             tokens and draft budgets, and answers with draft tokens;
    verify:  each scorer replica gets one Verify call with its sequences'
             drafts (and the whole context on a sequence's first touch);
    commit:  output tokens are appended, stop conditions applied, deltas
             streamed to the clients.

Overlapped rounds. Lock-step, every live sequence goes propose → verify →
commit together, and the proposer's time adds to every round. With overlap
(``LoopConfig.overlap``, gateway ``--overlap``) the live sequences form two
cohorts: each step verifies the cohort proposed in the step before while the
proposers draft the other one, then commits the verified cohort. Each
sequence still goes propose → verify → commit in order, on its own tokens,
so drafts are never built on guesses and nothing is thrown away: output,
failure handling, releases and the draft plan are those of lock-step.

Why cohorts: every sequence is verified on drafts made for its committed
context, whatever the proposer is (sampled model drafts included). Why not
one pipeline per sequence: every Verify would batch whatever happens to be
ready, a batch size that drifts with timing; two cohorts keep the batches
whole and the steps readable.

The price: each Verify carries half the sequences. On a CPU scorer a Verify
costs about in proportion to its rows, so two half calls cost one whole and
a proposer faster than half a Verify costs nothing. On a GPU scorer half a
batch costs nearly as much as a whole one (the fixed part, reading the
weights, dominates), so cohorts pay only when the proposer takes longer than
that fixed part. So with ``--overlap on`` (the default) the loop splits only
while ``costs.overlap_pays`` says so, from the measured propose time and the
scorer's fitted Verify cost (``always`` splits regardless: tests, and
benchmarks of the split itself); with one live sequence, or none that asks
a proposer (plain decoding), there is nothing to overlap. Where cohorts do
not pay, ``on`` drafts ahead (below) while the proposer takes a share of the
Verify's time worth hiding (``costs.ahead_pays``), for copy methods; else
rounds are lock-step.

Drafting ahead (``--overlap ahead``). Cohorts halve the batch, which a
scorer whose Verify is bound by reading the weights (a GPU, and this CPU:
one Verify of 8 sequences costs about what one of 4 does) pays for with a
second pass. Drafting ahead keeps the batch whole: while round r is
verified, the proposers already draft round r+1 for every sequence, from
the context as it stands before the verification and with a budget of
2k + 1 (``Sequence.propose_budget``): enough to cover round r's k drafts,
its target token and round r+1's k. When round r is committed, a draft
proposed at context length n is still good if the tokens committed since n
are its first tokens; what follows them is round r+1's draft, with no wait.
That holds when round r accepted everything and its target token is the
proposer's next guess, which copy work does round after round; after a
rejection the draft ahead is contradicted and dropped. For the sequences
left without a draft the round either waits for fresh drafts (lock-step for
them) or goes on without, whichever the measured times say yields more
tokens per second (``costs.fresh_drafts_pay``: expected accepted drafts
gained against the proposer's time). The exchange drafting ahead is no
barrier: when a proposer is slower than the Verify, the rounds wait for it
only where that pays (``_settle_ahead``) and otherwise go on at the
scorer's pace, its drafts verified when they land and still hold (an
exchange expected to outlast m rounds asks for m more tokens). Proposers
keep no state that a wrong guess would need undone: they are only ever
sent committed tokens, and a replica's next message is built only once the
one in flight is answered. Only
sequences whose output cannot depend on the drafts draft ahead
(``Sequence.may_draft_ahead``: greedy and target-match verification), so
timing never changes a token, seeded sampling included; the others are
proposed lock-step within the same rounds. Feature methods (eagle3, mtp)
draft ahead like the others: the proposer drafts from the committed
context, whose features it holds, and extends its own chain past this
round's drafts.

A proposer that is slow, down or wrong only costs drafts (the round goes on
with zero drafts); a lost scorer replica costs a re-prefill on another one.
Neither changes a token. Where state lives is ``Placement``'s business, what
a failure costs ``FailurePolicy``'s, freeing state ``Releases``', the
adaptive draft length ``VerifyCosts``/``plan_drafts``' (what a model
proposer is asked for: ``DraftBudgets``'), which draft-less calls ask the
scorer for no decode-ahead step ``DecodeAheadHints``'; messages are built
and read in gateway/wire.py.
"""
from __future__ import annotations

import asyncio
import enum
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

import grpc

from specdec.drafts import NO_BRANCHES, NO_DRAFT, ONE_HOT_METHODS, Branches, Draft, held_after, leaves_at
from specdec.gateway import metrics
from specdec.gateway.adaptive import AcceptanceEstimate
from specdec.gateway.clients import Connections, closed_under_us
from specdec.gateway.costs import (
    CopyGates,
    DecodeAheadHints,
    DraftBudgets,
    VerifyCosts,
    ahead_pays,
    apply_plan,
    draft_gains,
    fresh_drafts_pay,
    moving_average,
    overlap_pays,
    plan_drafts,
)
from specdec.gateway.discovery import ReplicaSet
from specdec.gateway.failures import FailurePolicy
from specdec.gateway.placement import Placement
from specdec.gateway.releases import Releases
from specdec.gateway.sequence import RequestFailed, Sequence
from specdec.gateway.wire import (
    Status,
    Verdict,
    propose_request,
    proposer_answers,
    verdicts_from_response,
    verify_request,
)
from specdec.limits import (
    DEFAULT_AHEAD_BRANCH_WIDTH,
    DEFAULT_DECODE_CHUNK_MS,
    DEFAULT_DECODE_STEPS,
    DEFAULT_MAX_STALLED_ROUNDS,
    FIRST_DECODE_STEPS,
    STALL_SLEEP_S,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


class Overlap(str, enum.Enum):
    """When the loop overlaps rounds (gateway ``--overlap``)."""

    ON = "on"  # while the cost model says two cohorts are faster
    ALWAYS = "always"  # whenever two or more sequences are live
    OFF = "off"  # lock-step rounds
    AHEAD = "ahead"  # draft each round's successor while it is verified (whole batches)


@dataclass
class LoopConfig:
    propose_timeout_s: float = 0.5
    verify_timeout_s: float = 120.0
    replica_down_s: float = 5.0  # keep new work off a replica whose call failed
    max_stalled_rounds: int = DEFAULT_MAX_STALLED_ROUNDS  # rounds without progress before a request fails
    stall_sleep_s: float = STALL_SLEEP_S
    overlap: Overlap = Overlap.ON
    decode_steps: int = DEFAULT_DECODE_STEPS  # plain decoding: most tokens per Verify call (Sequence.decode_steps)
    # plain decoding: the scorer time a call aims at, which sets its tokens (_decode_steps; 0: decode_steps)
    decode_chunk_s: float = DEFAULT_DECODE_CHUNK_MS / 1000
    # drafting ahead: branches per draft position to ask for (RoundUpdates.branch_width; 0: none)
    ahead_branch_width: int = DEFAULT_AHEAD_BRANCH_WIDTH


class SpecLoop:
    def __init__(self, scorers: ReplicaSet, proposers: dict[str, ReplicaSet], vocab_size: int,
                 config: LoopConfig | None = None, conns: Connections | None = None) -> None:
        self.scorers = scorers
        self.proposers = proposers  # method -> replicas serving it
        self.vocab_size = vocab_size
        self.config = config or LoopConfig()
        self.conns = conns or Connections()
        self.placement = Placement(scorers, proposers, self.conns)
        self.failures = FailurePolicy(self.conns, self.placement, self.config.replica_down_s,
                                      self.config.max_stalled_rounds)
        self.releases = Releases(self.conns)
        self.costs = VerifyCosts()
        self.budgets = DraftBudgets()  # model proposers: draft tokens worth asking for
        self.gates = CopyGates()  # copy proposers: whether asking pays, or plain decoding
        self.decode_ahead = DecodeAheadHints()  # the scorer's steps ahead worth skipping
        self._acceptance: dict[str, AcceptanceEstimate] = {}  # per method: young sequences' prior
        self._model_acceptance: dict[str, AcceptanceEstimate] = {}  # the same, of model-made drafts alone
        self._live: list[Sequence] = []
        self._drafted: dict[str, Draft] = {}  # the cohort proposed last step, to verify next step
        # drafting ahead: seq_id -> (context length it was proposed at, draft of up to 2k + 1 tokens, its
        # branches: the drafts where the outcome leaves it)
        self._ahead: dict[str, tuple[int, Draft, Branches]] = {}
        # drafting ahead: proposer replica -> its exchange still in flight (one at a time), which the rounds
        # wait for only where that pays (_settle_ahead); the answers land in self._ahead
        self._in_flight: dict[str, _InFlight] = {}
        self._held_all: set[str] = set()  # sequences whose last round accepted every draft it verified
        self._verify_s: float | None = None  # moving average of a lock-step or drafting-ahead round's Verify wall time
        self._verify_measured = False  # _verify_s holds a round without prefills (not only a stand-in)
        self._propose_s: float | None = None  # moving average of a propose phase's wall time
        self._propose_measured = False  # _propose_s holds a phase without opens (not only a stand-in)
        self._tokens_per_seq = 1.0  # moving average of rows a sequence feeds a decode-only Verify
        self._plain_pass_s: float | None = None  # moving average of a plain decoding call's wall time a pass
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run())

        def on_change(added: set[str], removed: set[str]) -> None:  # called from discovery threads
            for addr in removed:
                loop.call_soon_threadsafe(self._drop_replica, addr)

        def on_scorers(added: set[str], removed: set[str]) -> None:  # their arithmetic, before a move needs it
            for addr in added:
                loop.call_soon_threadsafe(self.placement.numerics.learn, addr)

        for replicas in [self.scorers, *self.proposers.values()]:
            replicas.subscribe(on_change)
        self.scorers.subscribe(on_scorers)
        self.placement.numerics.learn_all()

    def _drop_replica(self, addr: str) -> None:
        # an in-flight Verify may still finish (its sequences then move next round)
        asyncio.get_running_loop().create_task(self.conns.drop(addr, grace_s=self.config.verify_timeout_s))
        self.costs.forget(addr)
        self.budgets.forget(addr)
        self.placement.numerics.forget(addr)

    async def stop(self) -> None:
        """Stops the rounds; sequences still live end with UNAVAILABLE and
        their proposer state and KV caches are released before the channels
        close."""
        self._stopping = True
        task = self._task
        # A single cancel can be lost: on Python 3.11 asyncio.wait_for returns
        # the result of an inner call that completed in the same step as the
        # cancellation, and the rounds then waited for work forever (a drained
        # gateway that never exited). Cancel until the task has ended.
        while task is not None and not task.done():
            task.cancel()
            self._wake.set()
            await asyncio.wait({task}, timeout=0.5)
        if task is not None and not task.cancelled() and task.exception() is not None:
            log.error("the gateway loop ended with an error", exc_info=task.exception())
        for flight in self._in_flight.values():  # drafting ahead: its drafts are of no use now
            flight.task.cancel()
        await asyncio.gather(*(f.task for f in self._in_flight.values()), return_exceptions=True)
        self._in_flight.clear()
        await self.placement.numerics.stop()
        for seq in self._live:
            if not seq.done:
                seq.fail(RequestFailed("UNAVAILABLE", "the gateway is shutting down"))
        self._retire()
        await self.releases.flush_all(self.config.propose_timeout_s)
        await self.conns.close()

    def submit(self, seq: Sequence) -> None:
        seq.acceptance.parent = self._acceptance.setdefault(seq.params.method, AcceptanceEstimate(decay=0.995))
        seq.model_acceptance.parent = self._model_acceptance.setdefault(seq.params.method,
                                                                        AcceptanceEstimate(decay=0.995))
        self._live.append(seq)
        self._wake.set()

    # ----------------------------------------------------------- the rounds

    async def _run(self) -> None:
        while not self._stopping:
            if not self._live:
                metrics.LIVE.set(0)
                self.placement.publish([])
                self._wake.clear()
                await self.releases.flush_all(self.config.propose_timeout_s)
                await self._wake.wait()
            try:
                await self._round()
            except Exception:  # a bug must not strand every request
                log.exception("round failed")
                for seq in self._live:
                    seq.fail(RequestFailed("INTERNAL", "internal error in the gateway loop"))
                self._retire()

    async def _round(self) -> None:
        """Moves the live sequences on: a lock-step round for all of them, or,
        while overlapping pays, one overlapped step."""
        live = self._retire()
        if not live:
            return
        self.gates.plan(live, self.costs, self._propose_s if self._propose_measured else None,
                        self._decode_steps())
        if self._drafts_ahead(live):
            metrics.AHEAD_ROUNDS.inc()
            progressed = await self._ahead_round(live)
        elif self._overlap_pays(live):
            metrics.OVERLAPPED_STEPS.inc()
            progressed = await self._overlapped_step(live)
        else:
            progressed = await self._lock_step_round(live)
        self.placement.publish(live)
        if not progressed:
            await asyncio.sleep(self.config.stall_sleep_s)

    async def _lock_step_round(self, live: list[Sequence]) -> bool:
        """propose → verify → commit for every live sequence (those drafted
        in an overlapped step before keep their drafts); True if any progressed."""
        clock = _RoundClock(len(live))
        drafted = self._take_drafted(live)
        drafts = await clock.timed("propose", self._propose([s for s in live if s.seq_id not in drafted]))
        verdicts = await self._timed_verify(clock, live, drafted | drafts)
        progressed = self._commit(verdicts)
        clock.end()
        return progressed

    async def _overlapped_step(self, live: list[Sequence]) -> bool:
        """Verifies the cohort drafted last step while the other cohort is
        proposed, then commits the verified one; True if any progressed (or
        nothing was due for verification)."""
        clock = _RoundClock(len(live))
        drafted = self._take_drafted(live)
        verifying = [s for s in live if s.seq_id in drafted]
        riding = self._riding(live, drafted)
        riding_ids = {s.seq_id for s in riding}
        proposing = _next_cohort([s for s in live if s.seq_id not in riding_ids], verifying)
        drafted = drafted | {s.seq_id: NO_DRAFT for s in riding}
        verdicts, self._drafted = await asyncio.gather(
            clock.timed("verify", self._verify(verifying + riding, drafted)),
            clock.timed("propose", self._propose(proposing)))
        progressed = self._commit(verdicts)
        clock.end()
        return progressed or not (verifying or riding)

    def _riding(self, live: list[Sequence], drafted: dict[str, Draft]) -> list[Sequence]:
        """With ``--overlap on``, the sequences that ride in this step's
        Verify though no cohort drafted for them: those that ask no proposer
        (``_may_propose``: method none, a copy decoded plainly, a draft
        budget used up) wait for no draft, so they decode in every Verify
        instead of every other one. (In a cohort of their own they moved at
        half the pace: 4 plain streams beside 4 whose proposer takes 30 ms,
        ``bench_overlap.py --plain-share 0.5``.) ``always`` keeps every
        sequence in one of the two cohorts, as asked."""
        if self.config.overlap is not Overlap.ON:
            return []
        return [s for s in live if s.seq_id not in drafted and not self._may_propose(s)]

    async def _ahead_round(self, live: list[Sequence]) -> bool:
        """Verifies every live sequence, with the drafts proposed ahead in the
        rounds before where they still hold (and fresh ones where waiting for
        them pays, or the sequence may not draft ahead), while the proposers
        draft ahead for the rounds after; then commits. An exchange drafting
        ahead that outlasts the Verify is waited for only where that pays
        (``_settle_ahead``): a proposer slower than the scorer does not hold
        the rounds. True if any progressed."""
        clock = _RoundClock(len(live))
        await self._settle_ahead(live)
        drafted = self._take_drafted(live)  # (the cohort an overlapped step before proposed: --overlap on)
        drafts = {seq.seq_id: drafted.get(seq.seq_id) or self._draft_from_ahead(seq) for seq in live}
        # CopyGates: waiting for a draft does not pay this round, nor verifying the draft ahead it may
        # hold: it decodes plainly, and drafts ahead beside its Verify (an exploration every round, its
        # exchange hidden), so the next round verifies a copy that starts (held_draft_pays: a draft ahead
        # that holds continues the tokens committed since it was proposed)
        plain = set()
        for s in live:
            if (s.copies_plainly or s.seq_id in self.gates.exploring) and not self.gates.held_draft_pays(
                    s, len(drafts[s.seq_id]), self.costs, self._decode_steps(),
                    continues=not drafted.get(s.seq_id)):
                plain.add(s.seq_id)
                s.planned_budget = 0
        drafts.update((i, NO_DRAFT) for i in plain)
        wait = [s for s in live if not drafts[s.seq_id] and not s.may_draft_ahead and s.seq_id not in plain]
        # those whose draft ahead was contradicted, or holds less than this round's budget (but those whose
        # exchange is still in flight: _settle_ahead chose not to wait for it, and a fresh one would queue behind)
        in_flight = {i for f in self._in_flight.values() for i in f.seq_ids}
        optional = [s for s in live if s.may_draft_ahead and len(drafts[s.seq_id]) < s.num_speculative_tokens()
                    and s.seq_id not in in_flight and s.seq_id not in plain]
        if optional and self._fresh_drafts_pay(live, drafts, optional):
            wait += optional
        if wait:
            fresh = await clock.timed("propose", self._propose(wait, ahead=True))
            drafts.update((i, d) for i, d in fresh.items() if len(d) >= len(drafts[i]))  # the longer one
        waited = {s.seq_id for s in wait}
        self._draft_ahead([s for s in live if s.may_draft_ahead and s.seq_id not in waited])
        verdicts = await self._timed_verify(clock, live, drafts)
        progressed = self._commit(verdicts)
        clock.end()
        return progressed

    def _draft_ahead(self, seqs: list[Sequence]) -> None:
        """Starts an exchange drafting ahead for the sequences on each proposer
        replica that has none in flight (its sequences keep the drafts that
        exchange brings); the answers land in ``self._ahead``."""
        # rounds (beyond the one it runs beside) the exchange is expected to take
        rounds = 0
        if self._propose_s is not None and self._verify_measured and self._verify_s:
            rounds = max(0, math.ceil(self._propose_s / self._verify_s) - 1)
        for addr, group in self.placement.by_proposer(seqs).items():
            if addr in self._in_flight:
                continue
            for seq in group:  # (copies cost no more for being longer; a model's draft tokens cost a step each)
                seq.rounds_in_flight = 0 if seq.model_drafts else rounds
            task = asyncio.get_running_loop().create_task(self._exchange_ahead(addr, group))
            self._in_flight[addr] = _InFlight(task, time.perf_counter(), {s.seq_id for s in group})

    async def _exchange_ahead(self, addr: str, seqs: list[Sequence]) -> None:
        start, opening = time.perf_counter(), _opens(seqs)
        try:
            await self._propose_on(addr, seqs, ahead=True)
        finally:
            elapsed = time.perf_counter() - start
            metrics.PHASE_SECONDS.labels("propose_ahead").observe(elapsed)
            self._observe_propose(elapsed, opening)

    def _observe_propose(self, elapsed: float, opening: bool) -> None:
        """Keeps the moving average of a propose phase's wall time. A phase
        that opened a sequence only stands in until one that did not is
        measured: an open (the whole context sent and indexed, a draft
        model's prefill) does not tell the rounds to come (its time, the
        first a gateway measures, made ``--overlap on`` draft ahead of a
        ~1.5 ms proposer against a 32 ms Verify)."""
        if not opening:
            self._propose_s = moving_average(self._propose_s if self._propose_measured else None, elapsed)
            self._propose_measured = True
        elif not self._propose_measured:
            self._propose_s = elapsed

    async def _settle_ahead(self, live: list[Sequence]) -> None:
        """Takes the answers of the exchanges drafting ahead that have ended,
        and waits for those still in flight where their expected remaining
        time buys more tokens than it costs (``costs.fresh_drafts_pay``: the
        drafts of sequences whose last round accepted every draft, which a
        draft proposed before that round's Verify still continues; until the
        times are measured, they are waited for). An open answered late
        costs what a re-open does (``Sequence.proposer_opened``; a feature
        method's proposer asks for the context's rows from a re-prefill
        either way)."""
        for addr, flight in list(self._in_flight.items()):
            if flight.task.done() or self._in_flight_pays(live, flight):
                await self._landed(addr)

    async def _landed(self, addr: str) -> None:
        """Waits for the exchange in flight to addr, if any, and forgets it
        (its answers are in by then; an error in the loop itself is raised)."""
        flight = self._in_flight.get(addr)
        if flight is None:
            return
        try:
            await flight.task
        except asyncio.CancelledError:
            if not closed_under_us():  # our own task is cancelled
                raise
            # the exchange was cancelled under us (its channel closed): its sequences only lose its drafts
        finally:
            if self._in_flight.get(addr) is flight:
                del self._in_flight[addr]

    def _in_flight_pays(self, live: list[Sequence], flight: "_InFlight") -> bool:
        """Whether waiting out the exchange's expected remaining time buys
        more tokens per second than going on without its drafts."""
        if self._propose_s is None or self._verify_s is None:
            return True
        remaining = max(0.0, self._propose_s - (time.perf_counter() - flight.started))
        expected = {s.seq_id: _expected_accepted(s) for s in live}
        coming = {s.seq_id for s in live if s.seq_id in flight.seq_ids and s.seq_id in self._held_all}
        base = sum(1.0 if i in coming else 1.0 + e for i, e in expected.items())
        return fresh_drafts_pay(remaining, self._verify_s, base, sum(expected[i] for i in coming))

    async def _timed_verify(self, clock: "_RoundClock", live: list[Sequence],
                            drafts: dict[str, Draft]) -> list[Verdict]:
        """The round's Verify calls, their wall time kept for ``_fresh_drafts_pay``
        and ``_drafts_ahead``.
        A round that prefills a sequence only stands in until one that does
        not is measured: a prefill's time does not tell the rounds to come (8
        SmolLM2 chat prompts on 2 cores of an AMD EPYC: 0.25-0.37 s against
        ~0.07 s a round; averaged in, it held the rounds of 96-token requests
        waiting for proposers they should not have waited for)."""
        decode_only = all(s.scorer_primed for s in live)
        # a call decoding several tokens a sequence (plain rounds) neither: it is no round's Verify
        several = all(not drafts.get(s.seq_id) and s.decode_steps(self._decode_steps()) > 1 for s in live)
        start = time.perf_counter()
        verdicts = await clock.timed("verify", self._verify(live, drafts))
        elapsed = time.perf_counter() - start
        if several:
            return verdicts
        if decode_only:
            self._verify_s = moving_average(self._verify_s if self._verify_measured else None, elapsed)
            self._verify_measured = True
        elif not self._verify_measured:
            self._verify_s = elapsed
        return verdicts

    def _decode_steps(self) -> int:
        """Most tokens a plain decoding call decodes for a sequence now
        (``Sequence.decode_steps``): as many passes as fit in
        ``decode_chunk_s`` at the calls' measured time a pass, 1 to
        ``decode_steps`` (FIRST_DECODE_STEPS until a call is timed; every
        call ``decode_steps`` without a chunk)."""
        most, chunk = self.config.decode_steps, self.config.decode_chunk_s
        if chunk <= 0:
            return most
        if self._plain_pass_s is None:
            return min(most, FIRST_DECODE_STEPS)
        return max(1, min(most, int(chunk / max(self._plain_pass_s, 1e-9))))

    def _draft_from_ahead(self, seq: Sequence) -> Draft:
        """What still holds of the draft proposed ahead for the sequence: the
        part after the tokens committed since, or where they leave it, the
        branch that they follow (``drafts.held_after``; NO_DRAFT when neither
        holds, or nothing of it is left), at most this round's budget."""
        entry = self._ahead.pop(seq.seq_id, None)
        if entry is None or not seq.may_draft_ahead:
            return NO_DRAFT
        start, draft, branches = entry
        committed = seq.tokens[start:]
        held = held_after(draft, branches, committed).truncated(seq.num_speculative_tokens())
        if held:
            metrics.AHEAD_DRAFTS.labels(seq.params.method).inc()
            if leaves_at(draft, committed) is not None:
                metrics.AHEAD_BRANCH_DRAFTS.labels(seq.params.method).inc()
        return held

    def _fresh_drafts_pay(self, live: list[Sequence], drafts: dict[str, Draft], optional: list[Sequence]) -> bool:
        """Whether waiting for fresh drafts for ``optional`` (sequences whose
        draft ahead is missing or short of the budget) is expected to yield
        more tokens per second than verifying at once, counting the drafts
        each choice leaves the next round (``costs.fresh_drafts_pay``; going
        on, only the sequences whose proposer replica has no exchange in
        flight get a draft ahead this round). Until both times are
        measured, it is tried."""
        if self._propose_s is None or self._verify_s is None:
            return True
        held = {s.seq_id: sum(draft_gains(s, drafts[s.seq_id])) for s in live}
        base = sum(1.0 + h for h in held.values())
        gain = sum(max(0.0, _expected_accepted(s) - held[s.seq_id]) for s in optional)
        kept = sum(_chain_gains(s, s.num_speculative_tokens() + 1) for s in optional)
        deferred = sum(_chain_gains(s, len(drafts[s.seq_id]) + 1) for s in optional
                       if s.proposer_addr not in self._in_flight)
        estimate = self._verify_estimate(live)
        rows = sum(max(0, s.num_speculative_tokens() - len(drafts[s.seq_id])) for s in optional)
        rows_s = rows * estimate[1] if estimate is not None else 0.0
        return fresh_drafts_pay(self._propose_s, self._verify_s, base, gain, kept, deferred, rows_s)

    def _take_drafted(self, live: list[Sequence]) -> dict[str, Draft]:
        """The drafts of last step's proposed cohort that are still live."""
        ids = {s.seq_id for s in live}
        drafted = {seq_id: d for seq_id, d in self._drafted.items() if seq_id in ids}
        self._drafted = {}
        return drafted

    def _drafts_ahead(self, live: list[Sequence]) -> bool:
        """Whether this round drafts ahead: always with ``ahead``; with
        ``on``, while the proposer takes a share of the Verify's time worth
        hiding (``costs.ahead_pays``) and two cohorts would not pay (they
        keep every draft fresh), for rounds whose sequences that may draft
        ahead all copy (a model's draft tokens ahead cost a forward each,
        which lock-step rounds plan: ``DraftBudgets``)."""
        if self.config.overlap is Overlap.AHEAD:
            return True
        ahead = [s for s in live if s.may_draft_ahead]
        return (self.config.overlap is Overlap.ON and bool(ahead)
                and self._propose_measured and self._verify_measured
                and self._propose_s is not None and self._verify_s is not None
                and all(s.params.method in ONE_HOT_METHODS for s in ahead)
                and ahead_pays(self._propose_s, self._verify_s)
                and not self._overlap_pays(live))

    def _overlap_pays(self, live: list[Sequence]) -> bool:
        """Two sequences or more, and overlap always, or on, some sequence
        may ask a proposer for drafts this round (``_may_propose``: else a
        half batch overlaps nothing), and the cost model of the busiest
        scorer replica says two cohorts are faster (until there are figures
        to tell, they are tried)."""
        if self.config.overlap is Overlap.OFF or len(live) < 2:
            return False
        if self.config.overlap is Overlap.ALWAYS:
            return True
        if not any(self._may_propose(s) for s in live):
            return False
        busiest = _busiest_scorer(live)
        verify = None if busiest is None else self.costs.wall_estimate(busiest[0])
        if self._propose_s is None or busiest is None or verify is None:
            return True
        return overlap_pays(self._propose_s, verify, busiest[1] * self._tokens_per_seq)

    def _may_propose(self, seq: Sequence) -> bool:
        """Whether a sequence may ask a proposer for drafts this round: a
        method some proposer serves, a draft budget left, and not a copy
        that ``CopyGates`` planned to decode plainly. (Plain decoding, method
        none, never asks: without this, its propose time never measured, two
        cohorts were tried for good, each Verify carrying half the batch:
        ``bench_overlap.py --method none``, 8 streams of SmolLM2, 0.86x
        lock-step's tokens/s.)"""
        return (seq.params.method in self.placement.proposers and seq.num_speculative_tokens() > 0
                and not seq.copies_plainly)

    # -------------------------------------------------------------- propose

    async def _propose(self, live: list[Sequence], ahead: bool = False) -> dict[str, Draft]:
        """Draft tokens for every live sequence (NO_DRAFT where its proposer
        had none, failed or sent garbage); with ``ahead``, the sequences that
        may draft ahead are asked for more and keep the whole draft in
        ``self._ahead`` (the returned drafts are this round's part)."""
        groups = self.placement.by_proposer(live)
        drafts = {seq.seq_id: NO_DRAFT for seq in live}
        if not groups:
            return drafts
        start, opening = time.perf_counter(), _opens(live)
        answered = False
        for found in await asyncio.gather(*(self._propose_on(a, seqs, ahead) for a, seqs in groups.items())):
            drafts.update(found)
            answered |= bool(found)
        if answered:  # (a phase whose every message was left out, or failed, tells no exchange's time)
            self._observe_propose(time.perf_counter() - start, opening)
        return drafts

    async def _propose_on(self, addr: str, seqs: list[Sequence], ahead: bool) -> dict[str, Draft]:
        """One exchange with a proposer replica: the drafts of its answers
        (checked) by seq_id. Sequences that ended, or moved to another
        replica, while it was in flight (drafting ahead) are left out: the
        answer's tokens and lengths are those of the message, whatever the
        rounds committed since."""
        flight = self._in_flight.get(addr)
        if flight is not None and flight.task is not asyncio.current_task():
            await self._landed(addr)  # the message must say what the proposer holds once that one is answered
        if not ahead:  # (drafting ahead hides the proposer's time: nothing to plan)
            busiest = _busiest_scorer(seqs)  # the replica whose Verify the plan weighs
            if busiest is None:
                self.budgets.plan(addr, seqs, None)
            else:
                self.budgets.plan(addr, seqs, self.costs.wall_estimate(busiest[0]),
                                  self.costs.wall_measured(busiest[0]))
            if self._nothing_to_ask(addr, seqs):
                return {}
        sent = {seq.seq_id: (len(seq.tokens), seq.propose_budget(ahead and seq.may_draft_ahead)) for seq in seqs}
        message = propose_request(seqs, self.releases.take_proposer(addr), ahead,
                                  self.config.ahead_branch_width if ahead else 0)
        start = time.perf_counter()
        try:
            response = await self.conns.proposer_stream(addr).exchange(message.request,
                                                                       self.config.propose_timeout_s)
            answers = proposer_answers(message, response)
        except Exception as e:  # any proposer failure (a misfit answer too) only costs this round's drafts
            self.failures.proposer_failed(addr, [s for s in seqs if not s.done and s.proposer_addr == addr], e)
            return {}
        elapsed = time.perf_counter() - start
        drafts = {}
        model_steps = 0  # the longest model-made draft: forwards the proposer ran (copies cost none)
        opens = False  # the call opened a sequence: its time is no draft step's (DraftBudgets.observe)
        for seq, answer in answers:
            if seq.done or seq.proposer_addr != addr:
                continue
            seq.stats.propose_s += elapsed
            if answer is None:
                seq.proposer_len = 0  # re-open next round
                continue
            if seq.proposer_len == 0:  # the answer to an open declares the features it drafts from
                seq.proposer_opened(*answer.features)
                opens = True
            context_len, budget = sent[seq.seq_id]
            seq.proposer_len = context_len
            drafting_ahead = ahead and seq.may_draft_ahead
            draft = self._checked(seq, answer.draft, budget)
            seq.acceptance.proposed(context_len, draft.token_ids.tolist())
            seq.drafts_offered = moving_average(seq.drafts_offered, float(len(draft) > 0), decay=0.8)
            if draft:
                by_model = draft.confidence() is not None
                seq.model_drafted = moving_average(seq.model_drafted, float(by_model), decay=0.8)
                if by_model:
                    seq.model_acceptance.proposed(context_len, draft.token_ids.tolist())
                    model_steps = max(model_steps, len(draft))
            if drafting_ahead:
                self._ahead[seq.seq_id] = (context_len, draft, self._checked_branches(answer.branches, budget))
                draft = draft.truncated(seq.num_speculative_tokens())
            drafts[seq.seq_id] = draft
        if not opens:
            self.budgets.observe(addr, model_steps, elapsed)
        return drafts

    def _nothing_to_ask(self, addr: str, seqs: list[Sequence]) -> bool:
        """Whether this round's message to addr can be left out: every
        sequence on it is one the proposer holds and is planned to draft
        nothing (DraftBudgets), and no releases wait for it. Its new tokens
        then go with the next message (an update carries every token since
        the proposer last saw the sequence), and so do a feature head's new
        feature rows (they wait in ``FeatureRelay.pending``), so a model
        proposer asked for nothing costs no round trip, as method none."""
        if self.releases.pending_proposer(addr):
            return False
        return all(s.planned_budget == 0 and s.proposer_len for s in seqs)

    def _verify_estimate(self, seqs: list[Sequence]) -> tuple[float, float] | None:
        """The wall-time Verify fit of the scorer replica holding most of ``seqs``."""
        busiest = _busiest_scorer(seqs)
        return None if busiest is None else self.costs.wall_estimate(busiest[0])

    def _checked_branches(self, branches: Branches, budget: int) -> Branches:
        """A draft ahead's branches where all are well formed (at most the
        budget's tokens, all inside the vocabulary), else none: a faulty
        proposer costs its branches (a branch's own token is only ever
        compared with committed ones)."""
        return branches if branches.is_well_formed(budget, self.vocab_size) else NO_BRANCHES

    def _checked(self, seq: Sequence, draft: Draft, budget: int) -> Draft:
        """A proposer returning garbage (more drafts than the budget asked,
        ids outside the vocabulary, malformed probabilities) costs its
        drafts, nothing else."""
        if draft.is_well_formed(budget, self.vocab_size):
            return draft
        log.warning("proposer %s sent invalid drafts for %s; dropped", seq.proposer_addr, seq.seq_id)
        metrics.INVALID_DRAFTS.labels(seq.proposer_addr).inc()
        return NO_DRAFT

    # --------------------------------------------------------------- verify

    async def _verify(self, live: list[Sequence], drafts: dict[str, Draft]) -> list[Verdict]:
        """The round's Verify calls, one per scorer replica; commits nothing."""
        groups, unplaced = self.placement.by_scorer(live)
        verdicts = [Verdict(seq, Status.NO_SCORER) for seq in unplaced]
        for found in await asyncio.gather(*(self._verify_on(a, seqs, drafts) for a, seqs in groups.items())):
            verdicts.extend(found)
        return verdicts

    async def _verify_on(self, addr: str, seqs: list[Sequence], drafts: dict[str, Draft]) -> list[Verdict]:
        await self.releases.flush_scorer(addr)
        plan = plan_drafts(seqs, drafts, self.costs.estimate(addr))
        kept = apply_plan(seqs, drafts, plan)
        # plain decoding, several tokens per call: only where every sequence of the call never drafts (a
        # sequence with drafts would wait for the others' extra passes)
        # (a draft from an earlier step, kept where this round's plan asks for nothing, is verified alone)
        steps = {s.seq_id: 1 if kept[s.seq_id] else s.decode_steps(self._decode_steps()) for s in seqs}
        if min(steps.values()) == 1:
            steps = {}
        start = time.perf_counter()
        skips = self.decode_ahead.skips(addr, seqs, kept, self.costs.estimate(addr),
                                        self.costs.overhead_s.get(addr, 0.0), start)
        try:
            response = await self.conns.scorer(addr).Verify(verify_request(seqs, kept, steps, skips),
                                                            timeout=self.config.verify_timeout_s)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:  # a request that got past our checks
                return [Verdict(seq, Status.INVALID, message=e.details() or "") for seq in seqs]
            self.failures.scorer_failed(addr, len(seqs), e.code().name)
            return [Verdict(seq, Status.SCORER_FAILED, message=e.code().name) for seq in seqs]
        except asyncio.CancelledError:
            if not closed_under_us():
                raise
            self.failures.scorer_failed(addr, len(seqs), "CANCELLED")
            return [Verdict(seq, Status.SCORER_FAILED, message="CANCELLED") for seq in seqs]
        answered = time.perf_counter()
        rpc_s = answered - start
        verdicts = verdicts_from_response(seqs, kept, response)
        self._note_numerics(addr, response.numerics, verdicts)
        self.decode_ahead.answered(seqs, kept, {v.seq.seq_id: v.num_accepted for v in verdicts
                                                if v.status is Status.OK}, answered)
        if not steps:  # several passes per call would not fit the one-pass cost model
            self.costs.observe(addr, plan, response.compute_s, rpc_s)
        passes = max((len(v.output_token_ids) for v in verdicts if v.status is Status.OK), default=0)
        if steps and passes > 1:  # the next calls' tokens: the chunk at this pace (_decode_steps)
            self._plain_pass_s = moving_average(self._plain_pass_s, rpc_s / passes)
            metrics.PLAIN_DECODE_STEPS.set(self._decode_steps())
        if plan.decode_only and not steps:  # prefills would not tell the rows of the rounds to come
            self._tokens_per_seq = moving_average(self._tokens_per_seq, plan.tokens_fed / len(seqs))
        for seq in seqs:
            seq.stats.verify_s += response.compute_s
            seq.stats.network_s += max(0.0, rpc_s - response.compute_s)
        return verdicts

    def _note_numerics(self, addr: str, numerics: str, verdicts: list[Verdict]) -> None:
        """The replica's arithmetic, and for each sequence it answered
        whether that is the one that made its tokens (numerics.py)."""
        self.placement.numerics.heard(addr, numerics)
        for v in verdicts:
            if v.status is not Status.OK:
                continue
            outcome = v.seq.computed_by(numerics)
            if outcome is not None:
                metrics.NUMERICS_MOVES.labels(outcome).inc()
            if outcome == "changed":
                log.warning("sequence %s moved to scorer %s, which computes otherwise (numerics %s) than the one "
                            "that made its tokens: no replica of that arithmetic was up", v.seq.seq_id, addr,
                            numerics)

    # --------------------------------------------------------------- commit

    def _commit(self, verdicts: list[Verdict]) -> bool:
        """Appends each verified sequence's output tokens (stop conditions,
        deltas); settles the others by the failure policy. True if any
        sequence made progress."""
        progressed = False
        for v in verdicts:
            if v.status is not Status.OK:
                progressed |= self.failures.settle(v)
                continue
            seq = v.seq
            seq.scorer_primed, seq.retries = True, 0
            if v.num_accepted == v.num_drafts:
                self._held_all.add(seq.seq_id)
            else:
                self._held_all.discard(seq.seq_id)
            seq.features.receive(v.features)
            before, rounds_before = seq.num_output, seq.stats.rounds
            seq.commit(list(v.output_token_ids), v.num_drafts, v.num_accepted)
            _count_round(seq, before, seq.stats.rounds - rounds_before, v.num_drafts, v.num_accepted)
            progressed = True
        return progressed

    # ------------------------------------------------------------- releases

    def _retire(self) -> list[Sequence]:
        """Drops finished, failed and cancelled sequences (their replicas'
        state is released with the next messages there); returns the live ones."""
        live = []
        for seq in self._live:
            if seq.done:
                self._ahead.pop(seq.seq_id, None)
                self._held_all.discard(seq.seq_id)
                self.decode_ahead.forget(seq.seq_id)
                self.gates.forget(seq.seq_id)
                _count_end(seq)
                self.releases.add(seq)
            else:
                live.append(seq)
        self._live = live
        return list(live)


@dataclass
class _InFlight:
    """An exchange drafting ahead, still in flight to its proposer replica."""

    task: asyncio.Task
    started: float  # perf_counter
    seq_ids: set[str]


def _next_cohort(live: list[Sequence], verifying: list[Sequence]) -> list[Sequence]:
    """The sequences to propose while ``verifying`` is verified: all the
    others, unless they outnumber it by more than one (the start, or the
    cohorts drifted apart as sequences came and went); then only half of all
    live sequences, and the rest wait one step, so the cohorts are even again."""
    busy = {s.seq_id for s in verifying}
    free = [s for s in live if s.seq_id not in busy]
    if len(free) > len(verifying) + 1:
        return free[:(len(live) + 1) // 2]
    return free


def _opens(seqs: list[Sequence]) -> bool:
    """Whether a propose message for ``seqs`` opens any (its proposer holds none of it)."""
    return any(s.proposer_len == 0 for s in seqs)


def _busiest_scorer(seqs: list[Sequence]) -> tuple[str, int] | None:
    """The scorer replica holding most of ``seqs``, and how many it holds."""
    on_scorer = Counter(s.scorer_addr for s in seqs if s.scorer_addr is not None)
    return on_scorer.most_common(1)[0] if on_scorer else None


def _expected_accepted(seq: Sequence) -> float:
    """Accepted draft tokens a fresh draft of this round's budget is
    expected to bring the sequence (how often its proposer offers any, and
    its acceptance estimate)."""
    return _chain_gains(seq, 0)


def _chain_gains(seq: Sequence, skip: int) -> float:
    """Accepted tokens expected of this round's budget of a draft's tokens
    past its first ``skip`` (a draft proposed ahead, used where the rounds'
    output matched those): the acceptance of its positions skip+1 ..
    skip+budget (a position is accepted only if every one before it is)."""
    budget = seq.num_speculative_tokens()
    return seq.drafts_offered * sum(seq.acceptance.gains(skip + budget)[skip:])


class _RoundClock:
    """Times a round (or overlapped step) and its phases
    (specdec_gateway_round/phase_seconds)."""

    def __init__(self, num_live: int) -> None:
        metrics.LIVE.set(num_live)
        self.start = time.perf_counter()

    async def timed(self, phase: str, step: Awaitable[T]) -> T:
        start = time.perf_counter()
        try:
            return await step
        finally:
            metrics.PHASE_SECONDS.labels(phase).observe(time.perf_counter() - start)

    def end(self) -> None:
        metrics.ROUND_SECONDS.observe(time.perf_counter() - self.start)


def _count_round(seq: Sequence, output_before: int, rounds: int, num_drafts: int, num_accepted: int) -> None:
    """rounds: of the sequence's stats in this commit (one, or one per token
    a decode_steps call decoded)."""
    method = seq.params.method
    if seq.stats.rounds == 1:
        metrics.TTFT.observe(seq.stats.ttft_s)
    metrics.ROUNDS.labels(method).inc(rounds)
    metrics.OUTPUT_TOKENS.labels(method).inc(max(0, seq.num_output - output_before))
    metrics.DRAFT_TOKENS.labels(method).inc(num_drafts)
    metrics.ACCEPTED_TOKENS.labels(method).inc(num_accepted)


def _count_end(seq: Sequence) -> None:
    if seq.failed:
        outcome = seq.failure_code
    elif seq.finish_reason is not None:
        outcome = seq.finish_reason.value
    else:
        outcome = "cancelled"
    metrics.REQUESTS.labels(outcome).inc()
    metrics.PROMPT_TOKENS.inc(seq.num_prompt)
    metrics.LATENCY.observe(time.perf_counter() - seq.started)
