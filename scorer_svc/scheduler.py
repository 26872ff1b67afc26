"""Continuous batching for the scorer.

Concurrent Verify calls (from any number of gateway connections) are turned
into *jobs*, one per sequence, and merged by one worker thread into forward
passes of at most `max_batch_size` sequences and `max_tokens_per_forward`
tokens. A job feeds `[pending token] + drafts` (or, on a sequence's first
touch, its whole context + drafts, in chunks when long) and is verified as
soon as its last chunk has run.

Per sequence the scorer keeps its context length and its pending token; the
KV cache always holds `context_len - 1` tokens between rounds:

    feed  = [pending] + drafts                   (k + 1 tokens)
    KV   += feed;  verify the last k + 1 logits rows -> a accepted
    KV    = KV[: context_len + a]                (pending + accepted drafts)
    context_len += a + 1;  pending = output[-1]  (recovered or bonus token)

Features (EAGLE-3 / MTP drafting). A job that names ``feature_layers`` gets
those layers' hidden states (bfloat16) of the context positions whose
tokens it ran and that are context after verification: on a first touch
positions ``len(context) - m .. context_len - 2`` (m: the context rows asked
for, ``max_context_features`` or all, cut to the message budget by
``cap_context_features``), on later rounds ``context_len_before - 1 ..
context_len - 2`` (the pending token and the accepted drafts). The newest
token (the output's last) has none: it runs next round. So a caller that
relays every answer holds features for every position but the last.

Decode-ahead (plain decoding pipelined with the gateway's round trip).
When a Verify call whose every sequence fed no drafts has been answered and
the worker has nothing else to do, it runs those sequences' next decode
step at once ("ahead" jobs: feed = [pending], the token drawn exactly as a
draft-less Verify would draw it, same seed and position). The next Verify
of such a sequence takes that token (waiting for the step if it is still
running) instead of starting a forward pass, so the network hop and the
gateway's work overlap the forward. A Verify with drafts whose acceptance
test is "equal to the target's token" (greedy, target-match sampling) starts
from the step: its token decides the first draft (rejected: it is the
output; accepted: the other drafts are verified from the next position). A
job naming feature_layers takes part too (EAGLE-3 / MTP rounds that drafted
nothing): the step keeps the pending position's feature row, which leads the
answer as a Verify's own pass would have computed it. Any
other Verify (rejection sampling with drafts, other sampling fields, other
feature layers, hidden states, another context length; at temperature 0 the
seed and filters do not matter) rolls the step back first: the KV cache
goes back to ``context_len - 1`` tokens and the round runs as without
decode-ahead. The token is computed by the same rows a Verify would run
(the engine is row-count invariant), so the output is the same either way.
A step ahead pays where the next call is draft-less or rejects its first
draft (the step's token answers it, the gap before it saved), and costs
where that call's first draft is accepted: the drafts after the step's token
need a pass of their own, once the step has ended, where one pass would have
verified them all. So a call may ask for none after it
(``VerifySequence.skip_decode_ahead``): the gateway does where it expects
drafts often enough (``costs.decode_ahead_pays``).
`specdec scorer --decode-ahead off` turns it off; the library's default is
off.

Several tokens per call (``decode_steps``, plain decoding only). A job of a
sequence that asks nothing but tokens may ask for up to n of them: when its
pass has drawn a token, the job is re-armed with that token as its feed and
runs in the next pass (with whatever else is active), until it has n tokens,
drew an end-of-sequence token, or the KV pool has no room; then the call is
answered with all of them. Each pass is exactly the draft-less job a call
at that context length would run (same rows, sampling fields, seed and
position), so the tokens are those of n calls; what is saved is n - 1 round
trips of the gateway (gRPC, its Python, the client's). A decode-ahead step
the call takes counts as its first token.

Only the worker touches the engine. The worker is a background thread by
default; `specdec scorer` runs it on the main thread instead (`run()`),
because torch's CPU kernels measured ~35 % slower when called from a
secondary thread on this machine (OpenMP thread teams are per calling thread).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from prometheus_client import Counter, Gauge, Histogram

from specdec.engine.base import Engine, ForwardItem, PoolExhausted
from specdec.kernels import SamplingTensors, SparseDraftProbs, verify
from specdec.kernels.verify import greedy_on_host
from specdec.limits import (
    FEATURE_BYTES_PER_MESSAGE,
    FEATURE_VALUE_BYTES,
    GREEDY,
    MAX_SPECULATIVE_TOKENS,
    POLICY_NORMAL,
    TARGET_MATCH,
)

log = logging.getLogger(__name__)

FORWARDS = Counter("specdec_scorer_forwards_total", "Forward passes run")
FORWARD_TOKENS = Histogram("specdec_scorer_forward_tokens", "Tokens per forward pass",
                           buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096))
FORWARD_SECONDS = Histogram("specdec_scorer_forward_seconds", "Forward + verification time per step")
ACCEPTED_TOKENS = Counter("specdec_scorer_accepted_tokens_total", "Draft tokens accepted")
DRAFT_TOKENS = Counter("specdec_scorer_draft_tokens_total", "Draft tokens verified")
LIVE_SEQUENCES = Gauge("specdec_scorer_live_sequences", "Sequences holding KV cache")
FREE_KV_TOKENS = Gauge("specdec_scorer_free_kv_tokens", "KV tokens still free")
DECODE_AHEAD = Counter("specdec_scorer_decode_ahead_total",
                       "Decode steps run ahead of their Verify (plain decoding): used by the next Verify, or "
                       "discarded (it asked for something else, or the sequence ended); skipped: not run, as "
                       "the call asked (VerifySequence.skip_decode_ahead)", ["outcome"])
EXPIRED = Counter("specdec_scorer_expired_sequences_total",
                  "Sequences whose KV cache was freed after idle_timeout_s without a Verify (a gateway "
                  "that died or lost them); a later Verify for one gets UNKNOWN_SEQUENCE and re-prefills")

# Job outcomes (mirror the proto's SequenceStatus without importing it).
OK, UNKNOWN_SEQUENCE, RESOURCE_EXHAUSTED, INVALID, BUSY = (
    "ok", "unknown_sequence", "resource_exhausted", "invalid", "busy")
# _prepare's answers besides a result or a new job: the job joined a running
# decode-ahead job, or waits for one to end before it can be prepared
_ATTACHED, _DEFERRED = "attached", "deferred"


@dataclass
class JobSpec:
    """One sequence's part of a Verify call, already validated."""

    seq_id: str
    context: np.ndarray | None  # int32 [n]: whole context on first touch / re-prefill
    context_len: int  # gateway's context length, pending token included
    draft_token_ids: np.ndarray  # int32 [k]
    draft_probs: list[tuple[np.ndarray, np.ndarray]] | None  # k x (ids int32 [K_j], probs float32 [K_j])
    temperature: float
    top_k: int
    top_p: float
    seed: int
    strategy: int  # kernels.GREEDY .. TOPP
    accept_policy: int
    return_hidden_states: bool = False
    feature_layers: tuple[int, ...] = ()  # layers whose states to return (Engine.forward), in this order
    max_context_features: int = 0  # first touch: context positions' features to return at most (0: all)
    decode_steps: int = 1  # plain decoding: tokens to decode in this call at most (one pass each)
    skip_decode_ahead: bool = False  # the caller expects drafts next call: no step ahead after this one


@dataclass(frozen=True)
class FeatureRows:
    """Feature rows of consecutive context positions."""

    start: int  # context position of the first row
    bits: np.ndarray  # uint16 [rows, len(feature_layers) * hidden]: bfloat16 bit patterns


@dataclass
class JobResult:
    status: str
    output_token_ids: list[int] = field(default_factory=list)
    num_accepted: int = 0
    hidden_states: np.ndarray | None = None  # float32 [num_accepted + 1, hidden]
    features: FeatureRows | None = None  # when feature_layers were asked for
    message: str = ""


@dataclass
class _SeqState:
    context_len: int  # tokens the gateway holds (pending included)
    pending: int  # last context token, not yet in the KV cache
    last_used: float = field(default_factory=time.monotonic)  # for idle expiry
    # decode-ahead's result, not yet taken: the KV cache then also holds the
    # pending token (context_len tokens); ahead_spec: the sampling it used
    ahead: "JobResult | None" = None
    ahead_spec: "JobSpec | None" = None
    ahead_pass: "_Pass | None" = None  # the forward pass that ran the step, charged to the call that takes it


@dataclass
class _Job:
    spec: JobSpec
    call: "_Call | None"  # None: a decode-ahead job no Verify has asked for yet
    index: int  # position of spec in the call
    feed: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # int32 tokens to run
    fed: int = 0  # how many of feed have run
    context_len_before: int = 0  # RNG position and rollback base
    feed_start: int = 0  # context position of feed[0]
    feature_start: int = 0  # context position of the first feature row to return
    features: list[torch.Tensor] = field(default_factory=list)  # bfloat16 [rows, dim] chunks from feature_start on
    ahead: bool = False  # a decode-ahead job
    prefix: list[int] = field(default_factory=list)  # drafts a decode-ahead step accepted: output's start
    prefix_features: int = 0  # feature rows of that step, already in features (the pending position's)
    decoded: list[int] = field(default_factory=list)  # decode_steps: the call's tokens of earlier passes


@dataclass
class _Finished:
    """A job whose last chunk ran (its k + 1 logits rows are the pass's next
    ones, in the order of the finished jobs)."""

    job: _Job
    hidden: torch.Tensor | None  # [k + 1, hidden] when any job of the pass asked for hidden states


@dataclass(frozen=True)
class _Pass:
    """One forward pass (with its verification), as calls are charged for it."""

    number: int  # passes run before it
    seconds: float  # its wall time


@dataclass
class _Call:
    specs: list[JobSpec]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    arrived: float = field(default_factory=time.perf_counter)
    results: list[JobResult | None] = field(default_factory=list)
    remaining: int = 0
    compute_s: float = 0.0  # the passes it used, each once (charge)
    first_step: float | None = None
    charged: set[int] = field(default_factory=set)  # numbers of the passes in compute_s

    def charge(self, step: _Pass) -> None:
        """Adds a pass's time once, however many of the call's sequences it
        ran: the gateway fits its Verify cost model to compute_s, and a call
        whose 19 sequences took their decode-ahead steps from one pass had been
        charged that pass 19 times (SmolLM2, 32 streams on 2 cores of an AMD
        EPYC: 1.2-1.5 s instead of ~0.1 s, the fit then ~0.3 s fixed and 0 per
        token)."""
        if step.number not in self.charged:
            self.charged.add(step.number)
            self.compute_s += step.seconds


class Scheduler:
    def __init__(self, engine: Engine, max_batch_size: int = 256,
                 max_tokens_per_forward: int = 512, background: bool = True,
                 idle_timeout_s: float = 600.0, decode_ahead: bool = False) -> None:
        if max_batch_size < 1 or max_tokens_per_forward < MAX_SPECULATIVE_TOKENS + 1:
            # a verification's k + 1 rows always run in one forward pass
            raise ValueError(f"max_batch_size >= 1 and max_tokens_per_forward >= {MAX_SPECULATIVE_TOKENS + 1} "
                             f"required")
        if idle_timeout_s < 0:
            raise ValueError("idle_timeout_s must be >= 0 (0: never expire)")
        self.engine = engine
        # A sequence nobody verified for this long is released: the gateway
        # that owned it died or forgot it (a live gateway touches each of its
        # sequences every round). 0 keeps sequences until released.
        self.idle_timeout_s = idle_timeout_s
        self._next_sweep = time.monotonic()
        self.max_batch_size = max_batch_size
        self.max_tokens_per_forward = max_tokens_per_forward
        self._seqs: dict[str, _SeqState] = {}
        self._busy: set[str] = set()  # sequences with a job in flight
        # released while a job was in flight: freed when that job ends (freeing
        # pages a running job still writes would hand them to another sequence)
        self._release_after: set[str] = set()
        self._inbox: queue.Queue = queue.Queue()
        self._active: list[_Job] = []
        self.decode_ahead = decode_ahead
        self._ahead_jobs: dict[str, _Job] = {}  # seq_id -> its running decode-ahead job
        self._ahead_candidates: list[JobSpec] = []  # answered draft-less; may decode ahead when idle
        self._deferred: dict[str, list[tuple[_Call, int]]] = {}  # waiting for a decode-ahead job to end
        self._passes = 0  # forward passes run so far
        self._stopped = False
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self.run, name="scorer-scheduler", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------ public API

    async def verify(self, specs: list[JobSpec]) -> tuple[list[JobResult], float, float]:
        """Runs one Verify call; returns (results, compute_s, queue_s)."""
        cap_context_features(specs, self.engine.facts.hidden_size)
        loop = asyncio.get_running_loop()
        call = _Call(specs, loop.create_future(), loop)
        self._inbox.put(("verify", call))
        return await call.future

    async def release(self, seq_ids: list[str]) -> int:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._inbox.put(("release", (seq_ids, fut, loop)))
        return await fut

    @property
    def live_sequences(self) -> int:
        return len(self._seqs)

    def stop(self) -> None:
        """Ends run(); safe from any thread and from a signal handler (it only
        sets a flag that the worker polls)."""
        self._stopped = True
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    # ---------------------------------------------------------------- worker

    def run(self) -> None:
        """The worker loop; returns after stop()."""
        while not self._stopped:
            if not self._active:  # only idle time goes to decoding ahead
                self._start_ahead()  # before the inbox: a Verify that came meanwhile joins its step
            self._ahead_candidates.clear()
            self._drain_inbox(block=not self._active)
            self._expire_idle()
            if self._active:
                try:
                    self._step()
                except Exception as e:  # never leave callers hanging
                    log.exception("forward step failed")
                    self._fail_active(e)

    def _drain_inbox(self, block: bool) -> None:
        while True:
            try:  # a blocking wait still wakes up to notice stop()
                kind, payload = self._inbox.get(block=block, timeout=0.2 if block else None)
            except queue.Empty:
                return
            block = False
            if kind == "verify":
                self._admit(payload)
            else:
                seq_ids, fut, loop = payload
                n = sum(self._release_when_idle(s) for s in seq_ids)
                loop.call_soon_threadsafe(_set_result, fut, n)

    def _expire_idle(self) -> None:
        if not self.idle_timeout_s:
            return
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + min(1.0, self.idle_timeout_s / 4)
        stale = [seq_id for seq_id, state in self._seqs.items()
                 if seq_id not in self._busy and now - state.last_used > self.idle_timeout_s]
        for seq_id in stale:
            self._release(seq_id)
        if stale:
            EXPIRED.inc(len(stale))
            log.warning("released %d sequences idle for more than %.0f s (their gateway is gone?)",
                        len(stale), self.idle_timeout_s)

    def _release_when_idle(self, seq_id: str) -> bool:
        if seq_id in self._busy:
            self._release_after.add(seq_id)
            return True
        return self._release(seq_id)

    def _release(self, seq_id: str) -> bool:
        state = self._seqs.pop(seq_id, None)
        if state is not None and state.ahead is not None:
            DECODE_AHEAD.labels("discarded").inc()
        found = self.engine.release(seq_id)
        LIVE_SEQUENCES.set(len(self._seqs))
        return found

    def _admit(self, call: _Call) -> None:
        """Turns a call into jobs: checks sequence state, reserves KV space."""
        call.results = [None] * len(call.specs)
        call.remaining = len(call.specs)  # each result settles one
        for i in range(len(call.specs)):
            self._admit_one(call, i)

    def _admit_one(self, call: _Call, index: int) -> None:
        job = _Job(call.specs[index], call, index)
        outcome = self._prepare(job)
        if isinstance(outcome, JobResult):
            self._settle(call, index, outcome)
        elif outcome == _DEFERRED:
            self._deferred.setdefault(job.spec.seq_id, []).append((call, index))
        elif outcome is None:
            self._busy.add(job.spec.seq_id)
            self._active.append(job)
        # _ATTACHED: the decode-ahead job settles it

    def _settle(self, call: _Call, index: int, result: JobResult) -> None:
        call.results[index] = result
        call.remaining -= 1
        if call.remaining == 0:
            self._finish_call(call)

    def _prepare(self, job: _Job) -> JobResult | str | None:
        """None: the job is ready to run; else a result, _ATTACHED or _DEFERRED."""
        spec = job.spec
        if spec.seq_id in self._busy:
            ahead = self._ahead_jobs.get(spec.seq_id)
            if ahead is None or ahead.call is not None:
                return JobResult(BUSY, message="a Verify for this sequence is already in flight")
            if _takes_ahead(spec, ahead.spec):
                assert job.call is not None
                ahead.call, ahead.index = job.call, job.index
                ahead.call.first_step = ahead.call.first_step or time.perf_counter()
                return _ATTACHED
            return _DEFERRED
        k = len(spec.draft_token_ids)
        state = self._seqs.get(spec.seq_id)
        if state is not None and state.ahead is not None and spec.context is None:
            assert state.ahead_spec is not None and state.ahead_pass is not None and job.call is not None
            if _takes_ahead(spec, state.ahead_spec):
                result, state.ahead, state.ahead_spec = state.ahead, None, None
                state.context_len += 1
                state.pending = result.output_token_ids[-1]
                state.last_used = time.monotonic()
                job.call.charge(state.ahead_pass)  # what the round cost, for the gateway's cost model
                DECODE_AHEAD.labels("used").inc()
                if not self._decodes_more(spec.seq_id, spec.decode_steps, result.output_token_ids,
                                          state.context_len):
                    return result
                job.decoded = list(result.output_token_ids)  # the call's first token; the others follow
                spec = job.spec = replace(spec, context_len=state.context_len)
                if result.features is not None:  # the step's row (the old pending position) leads the job's
                    job.features.append(_bfloat16_rows(result.features))
                    job.prefix_features = 1
            elif _extends_ahead(spec, state.ahead_spec):  # the step decides the first draft
                step = state.ahead
                token = step.output_token_ids[-1]
                state.ahead = state.ahead_spec = None
                state.context_len += 1
                state.pending = token
                job.call.charge(state.ahead_pass)
                DECODE_AHEAD.labels("used").inc()
                if int(spec.draft_token_ids[0]) != token:  # rejected: the step's token is the output
                    state.last_used = time.monotonic()
                    DRAFT_TOKENS.inc(k)
                    return JobResult(OK, [token], 0, features=step.features)
                # accepted: the other drafts are verified from the next position
                spec = job.spec = replace(spec, context_len=spec.context_len + 1,
                                          draft_token_ids=spec.draft_token_ids[1:])
                job.prefix = [token]
                if step.features is not None:  # the step's row (the old pending position) leads the job's
                    job.features.append(_bfloat16_rows(step.features))
                    job.prefix_features = 1
                k -= 1
            else:
                self.engine.truncate(spec.seq_id, state.context_len - 1)  # roll the step back
                state.ahead = state.ahead_spec = None
                DECODE_AHEAD.labels("discarded").inc()
        if spec.context is not None:  # first touch or re-prefill
            self._release(spec.seq_id)
            job.feed = np.concatenate([spec.context, spec.draft_token_ids]).astype(np.int32)
            job.context_len_before = len(spec.context)
            rows = spec.max_context_features or len(spec.context)
            job.feature_start = max(0, len(spec.context) - rows)
        else:
            if state is None or state.context_len != spec.context_len:
                if state is None:
                    detail = "unknown to this scorer"
                else:
                    detail = f"scorer holds context_len {state.context_len}"
                    self._release(spec.seq_id)
                return JobResult(UNKNOWN_SEQUENCE, message=f"{detail}; resend the context")
            state.last_used = time.monotonic()
            job.feed = np.concatenate([[state.pending], spec.draft_token_ids]).astype(np.int32)
            job.context_len_before = state.context_len
            job.feed_start = job.feature_start = state.context_len - 1
            job.feature_start -= job.prefix_features
        try:  # KV holds context_len - 1 tokens, the feed adds k + 1
            self.engine.ensure_capacity(spec.seq_id, job.context_len_before + k)
        except (PoolExhausted, ValueError) as e:  # ValueError: beyond the model's context
            if spec.context is not None:
                self.engine.release(spec.seq_id)
            if isinstance(e, PoolExhausted):
                return JobResult(RESOURCE_EXHAUSTED, message=f"KV cache pool full: {e}")
            return JobResult(INVALID, message=str(e))
        if spec.context is not None:
            self._seqs[spec.seq_id] = _SeqState(len(spec.context), int(spec.context[-1]))
        return None

    def _step(self) -> None:
        """One forward pass over the jobs that fit, then verification of the
        jobs whose last chunk ran."""
        start = time.perf_counter()
        items: list[ForwardItem] = []
        jobs: list[_Job] = []
        budget = self.max_tokens_per_forward
        # decode-sized work first so long prefills cannot starve it
        for job in sorted(self._active, key=lambda j: len(j.feed) - j.fed):
            if len(items) == self.max_batch_size or budget == 0:
                break
            remaining = len(job.feed) - job.fed
            num_logits = len(job.spec.draft_token_ids) + 1
            take = min(remaining, budget)
            if take < remaining:  # a prefill chunk: never split the last k + 1 rows
                take = min(take, len(job.feed) - num_logits - job.fed)
                num_logits = 0
                if take <= 0:
                    continue
            items.append(ForwardItem(job.spec.seq_id, job.feed[job.fed:job.fed + take], num_logits))
            jobs.append(job)
            budget -= take
        for job in jobs:
            if job.call is not None and job.call.first_step is None:
                job.call.first_step = start
        need_hidden = any(j.spec.return_hidden_states for j in jobs)
        layers = tuple(sorted({i for j in jobs for i in j.spec.feature_layers}))
        out = self.engine.forward(items, return_hidden_states=need_hidden, feature_layers=layers)
        FORWARDS.inc()
        FORWARD_TOKENS.observe(sum(len(i.token_ids) for i in items))
        row = 0
        fed_rows = 0  # rows of the pass before this item's
        going_on: set[int] = set()  # ids of decode_steps jobs that run another pass
        done: list[_Finished] = []
        for job, item in zip(jobs, items):
            if job.spec.feature_layers:
                assert out.features is not None  # the pass asked for the union of the jobs' layers
                _keep_features(job, out.features[fed_rows:fed_rows + len(item.token_ids)], layers)
            fed_rows += len(item.token_ids)
            job.fed += len(item.token_ids)
            if item.num_logits:
                rows = slice(row, row + item.num_logits)
                hidden = out.hidden_states[rows] if out.hidden_states is not None else None
                done.append(_Finished(job, hidden))
                row += item.num_logits
        assert row == len(out.logits)  # the engine returns exactly the items' num_logits rows, in item order
        if done:  # so the pass's logits rows are the finished jobs', in order: verified in place, no copy
            going_on = self._verify(done, out.logits)
        elapsed = time.perf_counter() - start
        FORWARD_SECONDS.observe(elapsed)
        this_pass, self._passes = _Pass(self._passes, elapsed), self._passes + 1
        for job in jobs:
            if job.call is not None:
                job.call.charge(this_pass)
        for job in (f.job for f in done if id(f.job) not in going_on):
            seq_id = job.spec.seq_id
            self._active.remove(job)
            self._busy.discard(seq_id)
            if job.ahead:
                del self._ahead_jobs[seq_id]
                if job.call is None:
                    self._seqs[seq_id].ahead_pass = this_pass
            if seq_id in self._release_after:
                self._release_after.discard(seq_id)
                self._release(seq_id)
            if job.call is not None:
                result = job.call.results[job.index]
                assert result is not None  # _verify answered every finished job
                self._settle(job.call, job.index, result)
            for call, index in self._deferred.pop(seq_id, []):
                self._admit_one(call, index)
        FREE_KV_TOKENS.set(self.engine.free_tokens())

    def _verify(self, finished: list[_Finished],
                target_logits: torch.Tensor,  # float32 [sum(k_i + 1), V]
                ) -> set[int]:
        """Batched verification of finished jobs, then KV rollback; returns
        the ids of the jobs that decode another token (decode_steps) instead
        of ending."""
        jobs = [f.job for f in finished]
        specs = [j.spec for j in jobs]
        if target_logits.device.type == "cpu" and all(_greedy(s) for s in specs):
            # as verify() would (its host scan), without building the sampling tensors (~100 us a pass)
            output_ids, num_accepted = greedy_on_host(
                target_logits.numpy(), [int(t) for s in specs for t in s.draft_token_ids],
                np.cumsum([len(s.draft_token_ids) for s in specs]).tolist())
            return self._verified(finished, output_ids, num_accepted)
        num_drafts = [len(s.draft_token_ids) for s in specs]
        draft_token_ids = torch.from_numpy(np.concatenate(
            [s.draft_token_ids for s in specs]).astype(np.int32))  # [sum(k_i)]
        cu = torch.tensor(np.cumsum(num_drafts), dtype=torch.int32)  # [B]
        sampling = SamplingTensors(
            temperature=torch.tensor([s.temperature for s in specs], dtype=torch.float32),
            top_k=torch.tensor([s.top_k for s in specs], dtype=torch.int32),
            top_p=torch.tensor([s.top_p for s in specs], dtype=torch.float32),
            seed=torch.tensor([s.seed for s in specs], dtype=torch.int64),
            position=torch.tensor([j.context_len_before for j in jobs], dtype=torch.int64),
            strategy=torch.tensor([s.strategy for s in specs], dtype=torch.int32),
            accept_policy=torch.tensor([s.accept_policy for s in specs], dtype=torch.int32),
        )
        dev = target_logits.device  # a GPU engine's logits stay on the GPU: verified there (Triton)
        probs = _sparse_draft_probs(specs)
        out = verify(target_logits, draft_token_ids.to(dev), cu.to(dev), sampling.to(dev),
                     None if probs is None else probs.to(dev))
        # one deliberate device->host sync for the whole batch
        return self._verified(finished, out.output_token_ids.tolist(), out.num_accepted.tolist())

    def _verified(self, finished: list[_Finished], output_ids: list[list[int]], num_accepted: list[int]) -> set[int]:
        """``_verify``'s bookkeeping once the batch is verified (per job its
        output tokens, at least num_accepted + 1 of them, and the drafts it
        accepted): KV rollback, results, decode_steps jobs re-armed."""
        going_on: set[int] = set()
        for f, ids, a in zip(finished, output_ids, num_accepted):
            job = f.job
            seq_id = job.spec.seq_id
            new_context_len = job.context_len_before + a + 1
            self.engine.truncate(seq_id, new_context_len - 1)
            output = ids[:a + 1]
            if job.prefix:
                output, a = job.prefix + output, a + len(job.prefix)
            hidden = None
            if job.spec.return_hidden_states and f.hidden is not None:
                hidden = f.hidden[:a + 1].float().cpu().numpy()
            features = _feature_rows(job, new_context_len) if job.spec.feature_layers else None
            result = JobResult(OK, output, a, hidden, features)
            if job.call is None:  # decode-ahead nobody asked for yet: kept for the next Verify
                state = self._seqs[seq_id]
                state.ahead, state.ahead_spec = result, job.spec
                continue
            if job.ahead:
                DECODE_AHEAD.labels("used").inc()
            self._seqs[seq_id] = _SeqState(new_context_len, output[-1])
            DRAFT_TOKENS.inc(len(job.spec.draft_token_ids) + len(job.prefix))
            ACCEPTED_TOKENS.inc(a)
            if job.decoded:
                result.output_token_ids = output = job.decoded + output
            steps = job.call.specs[job.index].decode_steps
            if steps > 1 and self._decodes_more(seq_id, steps, output, new_context_len):
                self._decode_next(job, output, new_context_len)
                going_on.add(id(job))
                continue
            job.call.results[job.index] = result
        LIVE_SEQUENCES.set(len(self._seqs))
        return going_on

    def _decodes_more(self, seq_id: str, steps: int, output: list[int], context_len: int) -> bool:
        """Whether a decode_steps job whose call has decoded ``output`` so far
        runs another pass: fewer than ``steps`` tokens, the last one not an
        end of sequence, the sequence not released meanwhile, and KV room for
        its pending token (the sequence holds context_len tokens)."""
        if len(output) >= steps or output[-1] in self.engine.facts.eos_token_ids or seq_id in self._release_after:
            return False
        try:
            self.engine.ensure_capacity(seq_id, context_len)
        except (PoolExhausted, ValueError):  # no room, or the model's context is full: answer what there is
            return False
        return True

    def _decode_next(self, job: _Job, output: list[int], context_len: int) -> None:
        """Re-arms a decode_steps job for its next token: it feeds the
        pending token at context_len, drawn as a call at that length would
        draw it (the call's sampling, seed and the new position). Feature
        rows keep accumulating from the call's first (feature_start stays):
        the call answers the rows of every position its passes ran."""
        assert job.call is not None
        job.spec = replace(job.call.specs[job.index], context=None, context_len=context_len)
        job.decoded = output
        job.feed, job.fed = np.array([output[-1]], np.int32), 0
        job.context_len_before = context_len
        job.feed_start = context_len - 1
        if job.ahead:  # a decode-ahead step this call took over: from now on the call's own job
            job.ahead = False
            del self._ahead_jobs[job.spec.seq_id]

    def _finish_call(self, call: _Call) -> None:
        queue_s = (call.first_step or time.perf_counter()) - call.arrived
        call.loop.call_soon_threadsafe(_set_result, call.future, (call.results, call.compute_s, queue_s))
        if self.decode_ahead and all(r is not None and r.status == OK and _plain(s)
                                     for s, r in zip(call.specs, call.results)):
            skipped = sum(s.skip_decode_ahead for s in call.specs)
            if skipped:
                DECODE_AHEAD.labels("skipped").inc(skipped)
            self._ahead_candidates.extend(s for s in call.specs if not s.skip_decode_ahead)

    def _start_ahead(self) -> None:
        """Runs the next decode step of the sequences just answered
        draft-less (the worker is idle): jobs with no call yet."""
        for spec in self._ahead_candidates:
            seq_id = spec.seq_id
            state = self._seqs.get(seq_id)
            if (state is None or state.ahead is not None or seq_id in self._busy
                    or state.pending in self.engine.facts.eos_token_ids):
                continue  # gone, already ahead, asked again, or probably ended
            try:
                self.engine.ensure_capacity(seq_id, state.context_len)
            except (PoolExhausted, ValueError):  # no room, or the context is full
                continue
            plain = replace(spec, context=None, context_len=state.context_len)
            job = _Job(plain, None, 0, feed=np.array([state.pending], np.int32),
                       context_len_before=state.context_len, feed_start=state.context_len - 1,
                       feature_start=state.context_len - 1, ahead=True)
            self._busy.add(seq_id)
            self._active.append(job)
            self._ahead_jobs[seq_id] = job

    def _fail_active(self, error: Exception) -> None:
        calls = [job.call for job in self._active if job.call is not None]
        calls += [call for waiting in self._deferred.values() for call, _ in waiting]
        for job in self._active:
            self._release(job.spec.seq_id)
        for call in calls:
            if not call.future.done():
                call.loop.call_soon_threadsafe(_set_exception, call.future, error)
        self._active.clear()
        self._busy.clear()
        self._release_after.clear()
        self._ahead_jobs.clear()
        self._deferred.clear()


def _plain(spec: JobSpec) -> bool:
    """A draft-less job asking for nothing but the next token (and the
    pending token's feature row, if it names feature_layers: the step ahead
    computes that row too)."""
    return not len(spec.draft_token_ids) and not spec.return_hidden_states and not spec.draft_probs


def _greedy(spec: JobSpec) -> bool:
    """Verified GREEDY under the normal accept policy (``kernels.verify``'s
    host scan: ``effective_strategy`` is GREEDY at temperature 0 or with the
    GREEDY strategy; draft probabilities do not matter to it)."""
    return (spec.strategy == GREEDY or not spec.temperature > 0) and spec.accept_policy == POLICY_NORMAL


def _same_draw(spec: JobSpec, ahead: JobSpec) -> bool:
    """Whether spec's next token is the one the decode-ahead step (run with
    `ahead`'s sampling at `ahead.context_len`) drew. At temperature 0 every
    strategy is an argmax that no seed or filter changes (a call without a
    seed gets a fresh random one, and a greedy client need not send any)."""
    if spec.context is not None or spec.context_len != ahead.context_len or spec.accept_policy != ahead.accept_policy:
        return False
    if not spec.temperature > 0 and not ahead.temperature > 0:  # effective_strategy: GREEDY
        return True
    return ((spec.temperature, spec.top_k, spec.top_p, spec.seed, spec.strategy)
            == (ahead.temperature, ahead.top_k, ahead.top_p, ahead.seed, ahead.strategy))


def _takes_ahead(spec: JobSpec, ahead: JobSpec) -> bool:
    """Whether a Verify job (spec) is answered by the decode-ahead step."""
    return _plain(spec) and spec.feature_layers == ahead.feature_layers and _same_draw(spec, ahead)


def _extends_ahead(spec: JobSpec, ahead: JobSpec) -> bool:
    """Whether a Verify job with drafts can start from the decode-ahead step:
    where a draft is accepted exactly when it equals the target's token at its
    position (greedy, or target-match sampling keyed by seed and position),
    the step's token decides the first draft, and verifying the rest from the
    next position gives the same tokens as verifying them all."""
    return (len(spec.draft_token_ids) > 0 and not spec.return_hidden_states
            and spec.feature_layers == ahead.feature_layers and not spec.draft_probs
            and spec.strategy in (GREEDY, TARGET_MATCH)
            and spec.accept_policy == POLICY_NORMAL and _same_draw(spec, ahead))


def cap_context_features(specs: list[JobSpec], hidden_size: int,
                         budget_bytes: int = FEATURE_BYTES_PER_MESSAGE) -> None:
    """Cuts first touches' context feature rows (``max_context_features``)
    so that one Verify answer carries at most budget_bytes of features.

    Every sequence asking for features is first given the rows a round always
    returns (pending token + drafts: k + 1, at most); what is left of the
    budget goes to first touches' further context rows in call order, each
    keeping its last positions. A first touch always gets at least its last
    context position. The decode rows are not cut: a call of B sequences at
    k drafts needs B * (k + 1) * row bytes (docs/features.md)."""
    def row_bytes(spec: JobSpec) -> int:
        return FEATURE_VALUE_BYTES * hidden_size * len(spec.feature_layers)

    asking = [s for s in specs if s.feature_layers]
    left = budget_bytes - sum((len(s.draft_token_ids) + 1) * row_bytes(s) for s in asking)
    for spec in asking:
        if spec.context is None:
            continue
        wanted = min(spec.max_context_features or len(spec.context), len(spec.context))
        extra = min(wanted - 1, max(0, left) // row_bytes(spec))
        spec.max_context_features = 1 + extra
        left -= extra * row_bytes(spec)


def _keep_features(job: _Job, rows: torch.Tensor, layers: tuple[int, ...]) -> None:
    """Keeps the job's feature rows of one pass (its layers, in its order,
    bfloat16) from its feature_start on.

    rows: [fed this pass, len(layers) * hidden], the pass's layers in order"""
    first = job.feed_start + job.fed  # context position of rows[0]
    rows = rows[max(0, job.feature_start - first):]
    if job.spec.feature_layers != layers:
        blocks = rows.unflatten(1, (len(layers), -1))  # [n, len(layers), hidden]
        rows = blocks[:, [layers.index(i) for i in job.spec.feature_layers]].flatten(1)
    if len(rows):
        job.features.append(rows.to(torch.bfloat16))


def _feature_rows(job: _Job, new_context_len: int) -> FeatureRows:
    """The job's feature rows of positions feature_start .. new_context_len - 2
    (the ones now context; later drafts were rejected). A row taken from a
    decode-ahead step is already on the host, the passes' rows on the
    engine's device (a GPU's): they join there, and leave it once."""
    device = job.features[-1].device
    rows = torch.cat([r.to(device) for r in job.features])[:new_context_len - 1 - job.feature_start]
    return FeatureRows(job.feature_start, rows.contiguous().view(torch.int16).cpu().numpy().view(np.uint16))


def _bfloat16_rows(features: FeatureRows) -> torch.Tensor:
    """A result's feature rows back as a bfloat16 tensor [rows, width]."""
    return torch.from_numpy(features.bits.view(np.int16).copy()).view(torch.bfloat16)


def _sparse_draft_probs(specs: list[JobSpec]) -> SparseDraftProbs | None:
    """Pads the calls' sparse draft probabilities to one [num_draft_tokens, K]
    pair; one-hot drafts become (draft id, 1.0). None when all are one-hot."""
    if not any(s.draft_probs for s in specs):
        return None
    rows = []
    for s in specs:
        if s.draft_probs:
            rows.extend(s.draft_probs)
        else:
            rows.extend((np.array([t], np.int32), np.array([1.0], np.float32)) for t in s.draft_token_ids)
    width = max(len(ids) for ids, _ in rows)
    token_ids = np.zeros((len(rows), width), np.int32)
    probs = np.zeros((len(rows), width), np.float32)
    for r, (ids, p) in enumerate(rows):
        token_ids[r, :len(ids)] = ids
        probs[r, :len(p)] = p
    return SparseDraftProbs(torch.from_numpy(token_ids), torch.from_numpy(probs))


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, error: Exception) -> None:
    if not fut.done():
        fut.set_exception(error)
