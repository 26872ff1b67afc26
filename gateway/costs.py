"""Verify cost per scorer replica, and the plan of which draft tokens a
Verify call carries (adaptive draft length, gateway/adaptive.py).

``plan_drafts`` is pure: it decides how many of each sequence's proposed
draft tokens to keep and how many tokens the call will feed; the caller
applies the plan and, once the call returns, feeds its time back with
``VerifyCosts.observe``.

``overlap_pays`` uses the same fit (plus the call's measured RPC overhead)
to decide whether the loop's overlapped rounds (gateway/loop.py) beat
lock-step ones; ``ahead_pays`` whether drafting ahead does;
``DecodeAheadHints`` for which draft-less sequences a Verify asks the scorer
not to decode ahead.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import accumulate
from operator import mul

from specdec.drafts import ONE_HOT_METHODS, Draft
from specdec.gateway import metrics
from specdec.gateway.adaptive import CostModel, plan_draft_lengths, plan_draft_steps
from specdec.gateway.sequence import Sequence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftPlan:
    """Draft tokens to keep per sequence of one Verify call."""

    keep: dict[str, int]  # seq_id -> draft tokens to verify
    tokens_fed: int  # rows the call feeds the model: prefill or 1, plus the kept drafts
    decode_only: bool  # every sequence is primed (the cost fit describes such rounds only)


def plan_drafts(seqs: list[Sequence], drafts: dict[str, Draft],
                estimate: tuple[float, float] | None) -> DraftPlan:
    """Keeps the draft tokens worth verifying this round (adaptive sequences
    only; fixed-length ones keep all theirs, their drafts are part of the
    round's cost, not candidates). Mutates nothing."""
    base = [1 if seq.scorer_primed else len(seq.tokens) for seq in seqs]
    proposed = [len(drafts[s.seq_id]) for s in seqs]
    adaptive = [s.params.adaptive for s in seqs]
    keep = list(proposed)
    if any(adaptive) and any(proposed):
        lengths = plan_draft_lengths([draft_gains(s, drafts[s.seq_id]) if a else []
                                      for s, a in zip(seqs, adaptive)],
                                     [b + (0 if a else p) for b, p, a in zip(base, proposed, adaptive)],
                                     estimate)
        keep = [min(n, p) if a else p for n, p, a in zip(lengths, proposed, adaptive)]
    return DraftPlan(keep={s.seq_id: n for s, n in zip(seqs, keep)}, tokens_fed=sum(base) + sum(keep),
                     decode_only=all(s.scorer_primed for s in seqs))


def draft_gains(seq: Sequence, draft: Draft) -> list[float]:
    """Acceptance probability of each token of the draft (non-increasing).
    A model draft says how sure it is: position j is accepted with the
    product of its tokens' draft probabilities q up to j (the draft's own
    confidence, which knows this very context). A one-hot draft has only the
    sequence's history of acceptance (``AcceptanceEstimate``)."""
    confidence = draft.confidence()
    if confidence is None:
        return seq.acceptance.gains(len(draft))
    return list(accumulate(confidence, mul))


def apply_plan(seqs: list[Sequence], drafts: dict[str, Draft], plan: DraftPlan) -> dict[str, Draft]:
    """The drafts the plan keeps (counting what it trimmed)."""
    kept = {}
    for seq in seqs:
        draft = drafts[seq.seq_id]
        kept[seq.seq_id] = draft.truncated(plan.keep[seq.seq_id])
        if len(kept[seq.seq_id]) < len(draft):
            metrics.TRIMMED_DRAFTS.labels(seq.params.method).inc(len(draft) - len(kept[seq.seq_id]))
    return kept


#: Overlapped rounds must promise at least this much less time per round
#: than lock-step ones to be chosen (noise in the fits must not flip the mode).
OVERLAP_MARGIN = 0.95


def overlap_pays(propose_s: float, verify: tuple[float, float], tokens: float) -> bool:
    """Whether two cohorts, one verified while the other is proposed, move
    every sequence one round on sooner than a lock-step round.

    propose_s: wall time of one propose phase; verify: (fixed_s, per_token_s)
    wall time of a Verify call; tokens: rows a Verify of all sequences feeds.
    Lock-step costs ``P + V(T)``; the two cohorts cost two steps of
    ``max(V(T/2), P)`` (a proposer's time is taken as independent of the
    batch: latency-bound, the conservative case). So they pay when the
    proposer takes longer than the fixed part of a Verify (a GPU scorer, where
    half a batch costs almost a whole one, needs a slow proposer) and less
    than a whole Verify (else the proposer, run twice, is the bottleneck)."""
    fixed, per_token = verify
    lock_step = propose_s + fixed + per_token * tokens
    overlapped = 2 * max(fixed + per_token * tokens / 2, propose_s)
    return overlapped < OVERLAP_MARGIN * lock_step


#: ``--overlap on`` drafts ahead (copy methods) while the proposer's time
#: exceeds this share of the Verify's. Lock-step pays the proposer in every
#: round (P/(P+V) of the time, 9 % at the threshold); below it drafting
#: ahead has little to hide and loses about as much to rounds whose draft
#: ahead the outcome contradicts and, on a local stack, to a proposer
#: computing on the scorer's cores beside it (the README's SmolLM2 run on
#: an AMD EPYC: at P/V ≈ 0.11, 8 streams with 5 ms and 32 with 20 ms added
#: to the proposer, ``on`` drafting ahead read 0.96x and 1.03x lock-step).
AHEAD_PROPOSE_SHARE = 0.1


def ahead_pays(propose_s: float, verify_s: float) -> bool:
    """Whether ``--overlap on`` should draft ahead (loop.py) rather than run
    lock-step rounds: the proposer's time is a share of the Verify's worth
    hiding. (No hysteresis is needed: the proposer's time is measured in the
    mode the rounds are in, and beside a Verify on the same cores it only
    grows.)"""
    return propose_s > AHEAD_PROPOSE_SHARE * verify_s


def fresh_drafts_pay(propose_s: float, verify_s: float, base_tokens: float, gain_tokens: float,
                     kept_tokens: float = 0.0, deferred_tokens: float = 0.0, rows_s: float = 0.0) -> bool:
    """Whether a round should wait for the proposers (drafting ahead, loop.py).

    Without waiting the round takes ``V`` (verify_s) and is expected to yield
    ``base_tokens`` (each sequence's next token plus the expected accepted
    drafts it already has); waiting ``P`` (propose_s) for fresh drafts of the
    sequences that have none adds ``gain_tokens`` expected accepted drafts,
    and ``rows_s`` to the Verify (the rows those drafts add to it, at the
    scorer's fitted cost per row: milliseconds on a CPU at 8 streams, next
    to nothing on a GPU at a small batch).

    What each choice leaves the next round counts too, in the accepted
    tokens its drafts are expected to bring then: waiting, the fresh drafts'
    tails (they are asked for two rounds) hold where this round accepts all
    of them and the token after (``kept_tokens``); going on, the proposers
    draft ahead beside this Verify for the sequences left without, and those
    drafts hold where they begin with the tokens this round outputs
    (``deferred_tokens``). A fresh draft whose first token is wrong brings
    nothing, waited for or not: going on, the rest of a right one is
    verified a round later, and a slow proposer's wait becomes a plain
    step's token. (A per-round log of one SmolLM2 stream, a 20 ms proposer
    against a ~25 ms Verify: the rule without the next round's drafts waited
    5 times a 96-token request, 3 of them for fresh drafts that accepted
    nothing; the A/B with bench_overlap is in the README.)

    Wait when that raises the tokens per second:
    ``(base + gain + kept) / (V + P + rows) > (base + deferred) / V``."""
    return ((base_tokens + gain_tokens + kept_tokens) * verify_s
            > (base_tokens + deferred_tokens) * (verify_s + propose_s + rows_s))


def decode_ahead_pays(drafted_after_plain: float, gap_s: float, step_s: float) -> bool:
    """Whether the scorer's decode-ahead step after a draft-less call
    (scorer_svc/scheduler.py) is expected to save time rather than cost it.

    The step runs in the gap (``gap_s``) between the call's answer and the
    sequence's next call, and takes ``step_s``. Where the next call brings
    no drafts, or its first draft is rejected, the step's token answers it:
    what ran in the gap is saved. Where its first draft is accepted (chance
    ``drafted_after_plain``), the drafts after it need a pass of their own
    once the step ends, where one pass would have verified them all: the
    part of the step the gap does not hide is lost. (SmolLM2 on 2 cores of
    an AMD EPYC, one stream drafting ahead with a 20 ms proposer: ~2 ms
    gaps against ~20 ms steps, and each drafted round after a draft-less
    one took ~45 ms instead of ~24.)"""
    p = drafted_after_plain
    return (1 - p) * min(gap_s, step_s) >= p * max(0.0, step_s - gap_s)


class DecodeAheadHints:
    """Which draft-less sequences of a Verify call ask the scorer for no
    decode-ahead step after it (``VerifySequence.skip_decode_ahead``), by
    ``decode_ahead_pays`` with what the gateway measures: per scorer
    replica the gap from a sequence's answer to its next call (plus the
    call's RPC overhead), the step's time from the replica's Verify fit, and
    per method how often a call after a draft-less one had its first draft
    accepted (copy work drafting ahead: most such calls; plain decoding:
    none). Until all three are known, nothing is asked."""

    DECAY = 0.9

    def __init__(self) -> None:
        self.gap_s: dict[str, float] = {}  # scorer addr -> moving average (gateway side)
        self.drafted_after_plain: dict[str, float] = {}  # method -> moving average of the event above
        self._last: dict[str, tuple[float, bool]] = {}  # seq_id -> (its last answer's time, that call draft-less)

    def skips(self, addr: str, seqs: list[Sequence], drafts: dict[str, Draft],
              step: tuple[float, float] | None, overhead_s: float, now: float) -> set[str]:
        """The seq_ids of this call's draft-less sequences to ask for no step
        ahead; step: the replica's Verify fit (fixed_s, per_token_s). Takes
        the gaps since the sequences' last answers as samples."""
        gaps = [now - self._last[s.seq_id][0] for s in seqs if s.seq_id in self._last]
        if gaps:
            self.gap_s[addr] = moving_average(self.gap_s.get(addr), sum(gaps) / len(gaps), self.DECAY)
        plain = [s for s in seqs if not drafts[s.seq_id]]
        gap = self.gap_s.get(addr)
        if not plain or step is None or gap is None:
            return set()
        step_s = step[0] + step[1] * len(plain)  # one pass over the call's draft-less sequences
        return {s.seq_id for s in plain
                if (p := self.drafted_after_plain.get(s.params.method)) is not None
                and not decode_ahead_pays(p, gap + overhead_s, step_s)}

    def answered(self, seqs: list[Sequence], drafts: dict[str, Draft], num_accepted: dict[str, int],
                 now: float) -> None:
        """Learns from a call's answers (num_accepted: of the sequences
        answered OK): for each that followed a draft-less call, whether its
        first draft was accepted."""
        for seq in seqs:
            if seq.seq_id not in num_accepted:
                continue
            last = self._last.get(seq.seq_id)
            if last is not None and last[1]:
                event = float(bool(drafts[seq.seq_id]) and num_accepted[seq.seq_id] > 0)
                method = seq.params.method
                self.drafted_after_plain[method] = moving_average(
                    self.drafted_after_plain.get(method), event, self.DECAY)
            self._last[seq.seq_id] = (now, not drafts[seq.seq_id])

    def forget(self, seq_id: str) -> None:
        self._last.pop(seq_id, None)


def moving_average(average: float | None, value: float, decay: float = 0.9) -> float:
    """Exponential moving average (the value itself when there is none yet)."""
    return value if average is None else decay * average + (1 - decay) * value


class VerifyCosts:
    """The Verify time of each scorer replica (``CostModel``), fed with every
    decode-only call and exported as specdec_gateway_verify_cost_seconds;
    and each replica's RPC overhead (call time beyond the scorer's compute)."""

    OVERHEAD_DECAY = 0.9

    def __init__(self) -> None:
        self.models: dict[str, CostModel] = {}
        self.overhead_s: dict[str, float] = {}

    def estimate(self, addr: str) -> tuple[float, float] | None:
        model = self.models.get(addr)
        estimate = model.estimate() if model is not None else None
        if estimate is not None:
            metrics.VERIFY_COST.labels(addr, "fixed").set(estimate[0])
            metrics.VERIFY_COST.labels(addr, "per_token").set(estimate[1])
        return estimate

    def wall_estimate(self, addr: str) -> tuple[float, float] | None:
        """(fixed_s, per_token_s) of a whole Verify call as the gateway waits
        for it: the fit plus the RPC overhead."""
        estimate = self.estimate(addr)
        if estimate is None:
            return None
        return estimate[0] + self.overhead_s.get(addr, 0.0), estimate[1]

    def wall_measured(self, addr: str) -> dict[int, float]:
        """A whole Verify call's seconds by the rows it fed, where measured
        (``CostModel.measured``), the RPC overhead added."""
        model = self.models.get(addr)
        overhead = self.overhead_s.get(addr, 0.0)
        return {} if model is None else {rows: s + overhead for rows, s in model.measured().items()}

    def observe(self, addr: str, plan: DraftPlan, compute_s: float, rpc_s: float) -> None:
        overhead = max(0.0, rpc_s - compute_s)
        d = self.OVERHEAD_DECAY
        self.overhead_s[addr] = d * self.overhead_s.get(addr, overhead) + (1 - d) * overhead
        if plan.decode_only:
            self.models.setdefault(addr, CostModel()).observe(plan.tokens_fed, compute_s)

    def forget(self, addr: str) -> None:
        """Drops a replica that discovery removed."""
        self.overhead_s.pop(addr, None)
        if self.models.pop(addr, None) is not None:
            for part in ("fixed", "per_token"):
                try:
                    metrics.VERIFY_COST.remove(addr, part)
                except KeyError:
                    pass


def copy_drafts_pay(offered: float, gains: list[float], propose_s: float, verify: tuple[float, float],
                    overhead_s: float, plain_steps: int) -> bool:
    """Whether asking a copy proposer for a draft this round is expected to
    beat plain decoding, in output tokens per second.

    Asking costs an exchange (``propose_s``) before a one-pass Verify of the
    sequence's next token and of the draft tokens worth verifying (the
    draft comes with chance ``offered``, its j-th token accepted with
    ``gains[j - 1]``, non-increasing), ``verify`` = (fixed_s, per_token_s)
    of the scorer's compute per pass and ``overhead_s`` the call's RPC
    overhead:

        rate(j) = (1 + offered * sum(gains[:j])) / (propose_s + overhead_s + fixed + per_token * (1 + offered * j))

    Not asking, one Verify call decodes ``plain_steps`` tokens, a pass each
    (``Sequence.decode_steps``):

        plain = plain_steps / (overhead_s + plain_steps * (fixed + per_token))

    Asking pays when some j beats plain. (SmolLM2 on 2 cores of an AMD EPYC,
    GEMM simd-gguf: a ~5 ms pass, ~1 ms a row more, ~1 ms an exchange; n-gram
    drafts on chat prompts, offered about half the time and their first
    token right a fifth of it, do not pay: greedy ngram ran at 0.78x plain
    decoding there; copy prompts' long matches do, 1.24x.)"""
    fixed, per_token = verify
    plain = plain_steps / (overhead_s + plain_steps * (fixed + per_token))
    expected = rows = 1.0
    for g in gains:
        expected += offered * g
        rows += offered
        if expected > plain * (propose_s + overhead_s + fixed + per_token * rows):
            return True
    return False


class CopyGates:
    """Which adaptive sequences drafting by copies alone (a copy method's,
    ``ONE_HOT_METHODS``, and a model-and-copy method's whose model is planned
    to draft nothing: ``Sequence.drafts_by_copying``) ask their proposer
    for a draft this round, and which decode plainly
    (``planned_budget`` 0: no exchange where no other sequence on the
    replica asks, several tokens a Verify call, no drafting ahead), by
    ``copy_drafts_pay`` with what the loop measures: the propose phase's
    wall time, the sequence's scorer replica's Verify fit and RPC overhead,
    and the sequence's own acceptance and share of rounds its proposer
    offered a draft. A copy costs its proposer no forward, but every round
    that asks pays an exchange and verifies one token a call: against a
    fast scorer, drafts that seldom hold cost more than they bring.

    A sequence decoding plainly learns nothing of its drafts, and a context
    may start to copy (an answer quoting its prompt): after EXPLORE_EVERY
    plain rounds it asks once (``exploring``; a round drafting ahead asks
    beside its plain Verify instead, and the next round verifies what that
    brings where ``held_draft_pays``). Each exploration that does not open
    the gate doubles the wait up to EXPLORE_MAX_EVERY rounds (lower than
    ``DraftBudgets``': exploring costs a copy proposer no forward, and a copy
    missed is long); one that does starts it over. Until the times are
    measured, and for a sequence its proposer or scorer does not hold yet,
    every sequence asks."""

    EXPLORE_EVERY = 4
    EXPLORE_MAX_EVERY = 8

    def __init__(self) -> None:
        self._idle: dict[str, int] = {}  # seq_id -> plain rounds since it last asked
        self._every: dict[str, int] = {}  # seq_id -> plain rounds before its next exploration
        self.exploring: set[str] = set()  # this round's explorations (planned_budget None)
        self._steps: dict[str, int] = {}  # seq_id -> tokens a plain call would bring it this round

    def plan(self, seqs: list[Sequence], costs: VerifyCosts, propose_s: float | None, plain_steps: int) -> None:
        """Sets ``planned_budget`` of the copy methods' sequences of ``seqs``
        for this round: 0 (decode plainly) or None (ask for the whole budget).

        A Verify call decodes several tokens only where none of its
        sequences verifies drafts (``SpecLoop._verify_on``): on a scorer
        replica where another sequence drafts (a model method's, one being
        prefilled, a copy that pays), decoding plainly is one token a call,
        and is weighed as such."""
        self.exploring.clear()
        self._steps.clear()
        candidates: list[tuple[Sequence, tuple[float, float]]] = []
        busy: set[str | None] = set()  # scorer replicas some sequence of which verifies drafts this round
        for seq in seqs:
            if not seq.drafts_by_copying:
                if seq.params.num_speculative_tokens or not seq.scorer_primed:
                    busy.add(seq.scorer_addr)
                continue
            seq.planned_budget = None
            k = seq.num_speculative_tokens()
            verify = costs.estimate(seq.scorer_addr) if seq.scorer_addr is not None else None
            if (not seq.params.adaptive or k == 0 or seq.features.layers or not seq.scorer_primed
                    or not seq.proposer_len or propose_s is None or verify is None):
                busy.add(seq.scorer_addr)
                continue
            candidates.append((seq, verify))
        exchange = propose_s or 0.0  # (known where there are candidates)

        def pays(seq: Sequence, verify: tuple[float, float]) -> bool:
            steps = self._steps[seq.seq_id] = 1 if seq.scorer_addr in busy else seq.plain_steps(plain_steps)
            return copy_drafts_pay(seq.drafts_offered, seq.acceptance.gains(seq.num_speculative_tokens()),
                                   exchange, verify, costs.overhead_s.get(seq.scorer_addr or "", 0.0), steps)

        asking = {seq.seq_id for seq, verify in candidates if pays(seq, verify)}
        busy |= {seq.scorer_addr for seq, _ in candidates if seq.seq_id in asking}
        asking |= {seq.seq_id for seq, verify in candidates  # beside those, plain is a token a call
                   if seq.seq_id not in asking and seq.scorer_addr in busy and pays(seq, verify)}
        for seq, verify in candidates:
            if log.isEnabledFor(logging.DEBUG):
                log.debug("copy gate %s: offered %.2f, gains %s, propose %.2f ms, verify %.2f ms + %.2f ms/token, "
                          "overhead %.2f ms, %d plain tokens a call: %s", seq.seq_id, seq.drafts_offered,
                          [round(g, 2) for g in seq.acceptance.gains(seq.num_speculative_tokens())],
                          1e3 * exchange, 1e3 * verify[0], 1e3 * verify[1],
                          1e3 * costs.overhead_s.get(seq.scorer_addr or "", 0.0), self._steps[seq.seq_id],
                          "asks" if seq.seq_id in asking else "plain")
            if seq.seq_id in asking:
                self._idle[seq.seq_id], self._every[seq.seq_id] = 0, self.EXPLORE_EVERY
                continue
            idle, every = self._idle.get(seq.seq_id, 0) + 1, self._every.get(seq.seq_id, self.EXPLORE_EVERY)
            if idle < every:
                self._idle[seq.seq_id] = idle
                seq.planned_budget = 0
                metrics.PLAIN_ROUNDS.labels(seq.params.method).inc()
            else:
                self._idle[seq.seq_id], self._every[seq.seq_id] = 0, min(2 * every, self.EXPLORE_MAX_EVERY)
                self.exploring.add(seq.seq_id)

    def held_draft_pays(self, seq: Sequence, length: int, costs: VerifyCosts, plain_steps: int,
                        continues: bool = False) -> bool:
        """Whether a sequence decoding plainly this round should verify a
        draft of ``length`` tokens it already holds (drafted ahead beside
        the Verify before): ``copy_drafts_pay`` with the exchange paid and
        the draft there. A draft that ``continues`` tokens it got right (a
        draft ahead still holding after the tokens committed since it was
        proposed: a copy under way) has its j-th token right with ``cont **
        j``, not a fresh draft's chance (the overlap prompts, SmolLM2: with
        a fresh draft's, the gate let copies go by, 2.04 accepted tokens a
        round against 2.56 never gated). Where it pays, the sequence asks
        this round (``planned_budget`` None)."""
        addr = seq.scorer_addr
        verify = costs.estimate(addr) if addr is not None else None
        if not length or addr is None or verify is None:
            return False
        cont = seq.acceptance.cont
        gains = [cont ** j for j in range(1, length + 1)] if continues else seq.acceptance.gains(length)
        steps = self._steps.get(seq.seq_id, seq.plain_steps(plain_steps))
        if copy_drafts_pay(1.0, gains, 0.0, verify, costs.overhead_s.get(addr, 0.0), steps):
            seq.planned_budget = None
            return True
        return False

    def forget(self, seq_id: str) -> None:
        self._idle.pop(seq_id, None)
        self._every.pop(seq_id, None)


class DraftBudgets:
    """How many draft tokens to ask a model proposer for (adaptive sequences
    whose drafts carry the model's probabilities: ``Sequence.model_drafts``):
    each proposer replica's propose time is fitted as ``fixed + per_step *
    steps`` (steps: the longest model-made draft it answered), and ``plan_draft_steps``
    weighs it against the Verify time and the sequences' acceptance so far.
    A copy proposer's time does not grow with the draft length; it is not
    planned (its sequences ask for their whole budget, as before). A feature
    head's (eagle3, mtp) is: asked for nothing, its sequence still takes the
    target's features (several tokens per Verify, as plain decoding: the
    scorer answers a row for each), and they wait in the gateway
    (``FeatureRelay.pending``) for the next message, so the rounds between
    send the head nothing and pay no head forward; the message that asks
    again (an exploration) relays them all and the head catches up on them
    in one forward. On 2 AVX2 cores of an AMD EPYC, where SmolLM2 decodes a
    token in ~9 ms and a head round with a 3-row Verify costs ~21 ms for
    ~1.5 tokens, that keeps eagle3 at 0.89-0.99x plain decoding instead of
    0.53x of it (bench_draft; the README gives the figures).

    When the plan asks for nothing, a round asks for one token anyway after
    EXPLORE_EVERY idle rounds: acceptance is only learnt from drafts made,
    and a context the model starts to follow must be noticed. Each such
    exploration that the plan does not follow (it goes on asking for
    nothing) doubles the wait, up to EXPLORE_MAX_EVERY rounds; a plan that
    asks for drafts by itself starts it over. A draft that does not pay on a
    workload (a weak draft on chat, on a CPU) then costs a forward every 64
    rounds instead of every 8: exploring at a fixed 8 cost a third to a half
    of such a replica's propose time (bench_draft's chat prompts, SmolLM2 and
    a 4-layer draft, AMD EPYC: 1.15 / 0.82 s per 6 prompts against 0.80 /
    0.28 s never exploring)."""

    EXPLORE_EVERY = 8
    EXPLORE_MAX_EVERY = 64

    def __init__(self) -> None:
        self.models: dict[str, CostModel] = {}
        # the last fit of each replica: rounds planned to one length cannot refit it (their steps do not
        # vary), and the fit must not vanish when the plan starts to work
        self._fits: dict[str, tuple[float, float]] = {}
        self._idle_rounds: dict[str, int] = {}
        self._explore_every: dict[str, int] = {}  # idle rounds before the next exploration
        self._last_k: dict[str, int] = {}  # the K planned last (what a sequence that opens gets)
        self._model_methods: dict[str, set[str]] = {}  # methods seen drafting with a model on the replica
        self._after_idle: dict[str, bool] = {}  # this round's plan follows one that asked for nothing

    def observe(self, addr: str, steps: int, seconds: float) -> None:
        """One answered propose call of ``addr`` whose longest draft had
        ``steps`` tokens (a call that drafted nothing tells nothing of a step).
        A call planned right after rounds that asked for nothing is left
        out: the scorer may be decoding ahead meanwhile (those rounds'
        Verify had no drafts) and the two share the CPU, so it would tell the
        cost of a draft step during decode-ahead, not in rounds that draft
        (on 2 cores of an AMD EPYC such calls turned the fit into ~12-16 ms
        fixed + 0 per step, against ~5 ms + 2.5 ms/step with decode-ahead
        off: the plan then never asked for a draft). Nor does the loop
        give it a call that opened a sequence: the model runs over the whole
        prompt there, a prefill's cost that fitted as steps had made a
        draft step read ~6 ms (SmolLM2's 4-layer bfloat16 draft on an AMD
        EPYC; ~2 ms in process, choosing tokens included)."""
        if self._after_idle.get(addr):
            return
        model = self.models.setdefault(addr, CostModel())
        model.observe(steps, seconds)
        # calls of one draft length cannot split a call's time from a step's (a feature head asked for k
        # every round): then all of it per step, right at that length, which is what a plan weighs
        fit = model.estimate() or model.proportional()
        if fit is not None:
            self._fits[addr] = fit

    def plan(self, addr: str, seqs: list[Sequence], verify: tuple[float, float] | None,
             measured: dict[int, float] | None = None) -> None:
        """Sets ``planned_budget`` of ``seqs`` (those proposed on ``addr`` this
        round; ``verify``: the scorer's wall-time fit, ``measured``: its
        measured times by rows fed, ``VerifyCosts.wall_measured``): the
        planned K for the adaptive ones with model drafts, None
        (their whole budget) for the others and while a fit is missing; and
        ``planned_model_steps`` of the adaptive ones of a model-and-copy
        method (draft_hybrid): the same K, planned from the acceptance of
        their model-made drafts alone (their copies cost no forward and keep
        the whole budget: a hybrid whose model does not pay drafts by copying
        only instead of paying forwards for nothing, and its copies are then
        gated as the n-gram method's are: where K is 0, ``planned_budget``
        stays what ``CopyGates`` planned for it this round, 0 where its
        copies do not pay either, and it decodes plainly). Their model runs
        in the same forwards as the others' on that replica, so one K serves
        both.

        A sequence without drafts of its own yet (an open) has no history:
        it gets the replica's K (this round's, else the last one planned
        there) when its method is known to draft with a model there (a
        model-and-copy method, or a method whose sequences' drafts on that
        replica came from a model), so a new request on a replica whose
        model does not pay does not run it over its prompt and its whole
        budget (SmolLM2 and a 4-layer draft on copy prompts, AMD EPYC: the
        opens were most of the hybrid's model forwards); where that K is 0
        and no sequence on the replica has drafts of its own, they explore
        as planned sequences do (``_explored``), so a request that comes
        after the plan fell to nothing still finds out that its own
        context is one the model follows."""
        after_idle, self._after_idle[addr] = self._idle_rounds.get(addr, 0) > 0, False
        planned: list[Sequence] = []
        mixed: list[Sequence] = []
        opening: list[Sequence] = []
        fresh: list[Sequence] = []
        model_methods = self._model_methods.setdefault(addr, set())
        gated: dict[str, int | None] = {}  # a model-and-copy sequence -> its copies' gate this round (CopyGates)
        for seq in seqs:
            if seq.mixes_model_and_copies:
                gated[seq.seq_id] = seq.planned_budget
            seq.planned_model_steps = None
            if seq.params.method not in ONE_HOT_METHODS:  # (a copy method's: CopyGates, each round)
                seq.planned_budget = None
            if not seq.params.adaptive or seq.num_speculative_tokens() == 0:
                continue
            if seq.mixes_model_and_copies:
                (mixed if seq.proposer_len else opening).append(seq)
            elif seq.model_drafts:
                planned.append(seq)
                model_methods.add(seq.params.method)
            elif seq.model_drafted is None and seq.params.method in model_methods:
                fresh.append(seq)
        propose = self._fits.get(addr)
        if not (planned or mixed) or verify is None or propose is None:
            last = self._last_k.get(addr)
            if last == 0 and (opening or fresh) and verify is not None and propose is not None:
                # only sequences without drafts of their own: they explore as planned ones do (without, a
                # request that came after the replica's plan fell to nothing would never draft)
                last = self._explored(addr, 0)
                self._after_idle[addr] = after_idle
            for seq in opening:
                seq.planned_model_steps = last
            for seq in fresh:
                seq.planned_budget = last
            return
        gains = ([s.acceptance.gains(s.num_speculative_tokens()) for s in planned]
                 + [s.model_acceptance.gains(s.num_speculative_tokens()) for s in mixed])
        k = plan_draft_steps(gains, sum(1 if s.scorer_primed else len(s.tokens) for s in seqs), verify, propose,
                             measured)
        k = self._last_k[addr] = self._explored(addr, k)
        self._after_idle[addr] = after_idle
        for seq in planned + fresh:
            seq.planned_budget = k
        for seq in mixed + opening:
            seq.planned_model_steps = k
            if k == 0:  # its model drafts nothing: its copies go as their gate said (CopyGates)
                seq.planned_budget = gated.get(seq.seq_id)
        metrics.PLANNED_DRAFT_STEPS.labels(addr).set(k)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("draft budgets on %s: propose %.2f ms + %.2f ms/step, verify %.2f ms + %.2f ms/token, "
                      "first gains %s: asking %d", addr, 1e3 * propose[0], 1e3 * propose[1], 1e3 * verify[0],
                      1e3 * verify[1], [round(g[0], 2) for g in gains[:4] if g], k)

    def _explored(self, addr: str, k: int) -> int:
        """The plan's K, or 1 where this round explores (class doc)."""
        every = self._explore_every.get(addr, self.EXPLORE_EVERY)
        if k > 0:
            self._idle_rounds[addr], self._explore_every[addr] = 0, self.EXPLORE_EVERY
            return k
        idle = self._idle_rounds.get(addr, 0) + 1
        if idle < every:
            self._idle_rounds[addr] = idle
            return 0
        self._idle_rounds[addr], self._explore_every[addr] = 0, min(2 * every, self.EXPLORE_MAX_EVERY)
        return 1

    def forget(self, addr: str) -> None:
        """Drops a replica that discovery removed."""
        for table in (self.models, self._fits, self._idle_rounds, self._explore_every, self._last_k,
                      self._model_methods, self._after_idle):
            table.pop(addr, None)
