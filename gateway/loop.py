"""The speculative decoding loop. Every round, for all live sequences at once:

    propose: each proposer replica gets one message with its sequences' new
             tokens and draft budgets, and answers with draft tokens;
    verify:  each scorer replica gets one Verify call with its sequences'
             drafts (and the whole context on a sequence's first touch);
    commit:  output tokens are appended, stop conditions applied, deltas
             streamed to the clients.

A proposer that is slow, down or wrong only costs drafts (the round goes on
with zero drafts); a lost scorer replica costs a re-prefill on another one.
Neither changes a token.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc
import numpy as np

from specdec.gateway import metrics
from specdec.gateway.adaptive import AcceptanceEstimate, CostModel, plan_draft_lengths
from specdec.gateway.clients import Connections
from specdec.gateway.discovery import ReplicaSet
from specdec.gateway.sequence import RequestFailed, Sequence
from specdec.protos.v1 import specdec_pb2 as pb

log = logging.getLogger(__name__)

NO_DRAFTS = np.zeros(0, dtype=np.int32)


@dataclass
class LoopConfig:
    propose_timeout_s: float = 0.5
    verify_timeout_s: float = 120.0
    replica_down_s: float = 5.0  # keep new work off a replica whose call failed
    max_stalled_rounds: int = 200  # rounds without progress before a request fails
    stall_sleep_s: float = 0.05
    adaptive_draft_length: bool = True  # default for requests that do not choose


@dataclass
class _Drafts:
    token_ids: np.ndarray  # int32 [n]
    probs: list  # SparseProbs messages, empty for one-hot drafts


class SpecLoop:
    def __init__(self, scorers: ReplicaSet, proposers: dict[str, ReplicaSet], vocab_size: int,
                 config: LoopConfig | None = None) -> None:
        self.scorers = scorers
        self.proposers = proposers  # method -> replicas serving it
        self.vocab_size = vocab_size
        self.config = config or LoopConfig()
        self.conns = Connections()
        self._live: list[Sequence] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._proposer_releases: dict[str, list[pb.SequenceRelease]] = {}
        self._scorer_releases: dict[str, list[str]] = {}
        self._placement = metrics.Placement()
        self._costs: dict[str, CostModel] = {}  # Verify time per scorer replica
        self._acceptance: dict[str, AcceptanceEstimate] = {}  # per method: young sequences' prior

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run())

        def on_change(added: set[str], removed: set[str]) -> None:  # called from discovery threads
            for addr in removed:
                loop.call_soon_threadsafe(lambda a=addr: loop.create_task(self.conns.drop(a)))
                loop.call_soon_threadsafe(self._forget_replica, addr)

        for replicas in [self.scorers, *self.proposers.values()]:
            replicas.subscribe(on_change)

    def _forget_replica(self, addr: str) -> None:
        if self._costs.pop(addr, None) is not None:
            for part in ("fixed", "per_token"):
                try:
                    metrics.VERIFY_COST.remove(addr, part)
                except KeyError:
                    pass

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.conns.close()

    def submit(self, seq: Sequence) -> None:
        seq.acceptance.parent = self._acceptance.setdefault(seq.params.method, AcceptanceEstimate(decay=0.995))
        self._live.append(seq)
        self._wake.set()

    # ----------------------------------------------------------- the rounds

    async def _run(self) -> None:
        while True:
            if not self._live:
                metrics.LIVE.set(0)
                self._placement.update({})
                self._wake.clear()
                await self._flush_releases()
                await self._wake.wait()
            try:
                await self._round()
            except Exception:  # a bug must not strand every request
                log.exception("round failed")
                for seq in self._live:
                    seq.fail(RequestFailed("INTERNAL", "internal error in the gateway loop"))
                self._retire()

    async def _round(self) -> None:
        self._retire()
        live = list(self._live)
        if not live:
            return
        metrics.LIVE.set(len(live))
        start = time.perf_counter()
        drafts = await self._propose(live)
        proposed = time.perf_counter()
        progressed = await self._verify(live, drafts)
        end = time.perf_counter()
        metrics.PHASE_SECONDS.labels("propose").observe(proposed - start)
        metrics.PHASE_SECONDS.labels("verify").observe(end - proposed)
        metrics.ROUND_SECONDS.observe(end - start)
        self._update_placement(live)
        self._retire()
        if not progressed:
            await asyncio.sleep(self.config.stall_sleep_s)

    # -------------------------------------------------------------- propose

    async def _propose(self, live: list[Sequence]) -> dict[str, _Drafts]:
        """Draft tokens per seq_id; missing entries mean zero drafts."""
        by_addr: dict[str, list[Sequence]] = {}
        for seq in live:
            replicas = self.proposers.get(seq.params.method)
            if replicas is None or seq.draft_budget() == 0:
                continue
            if seq.proposer_addr not in replicas.addresses():
                if seq.proposer_addr is not None:  # its replica went away
                    metrics.MOVES.labels("proposer").inc()
                seq.proposer_addr, seq.proposer_len = replicas.pick(seq.seq_id, self.conns.down()), 0
            if seq.proposer_addr is not None:
                by_addr.setdefault(seq.proposer_addr, []).append(seq)
        results = await asyncio.gather(*(self._propose_on(a, seqs) for a, seqs in by_addr.items()))
        drafts: dict[str, _Drafts] = {}
        for r in results:
            drafts.update(r)
        return drafts

    async def _propose_on(self, addr: str, seqs: list[Sequence]) -> dict[str, _Drafts]:
        request = pb.ProposeRequest(releases=self._proposer_releases.pop(addr, []))
        for seq in seqs:
            request.sequences.append(self._sequence_update(seq))
        start = time.perf_counter()
        try:
            response = await self.conns.proposer_stream(addr).exchange(request, self.config.propose_timeout_s)
        except Exception as e:  # any proposer failure only costs this round's drafts
            log.warning("proposer %s failed (%s): %d sequences go on without drafts",
                        addr, type(e).__name__, len(seqs))
            self.conns.mark_down(addr, self.config.replica_down_s)
            metrics.REPLICA_FAILURES.labels("proposer", addr).inc()
            metrics.MOVES.labels("proposer").inc(len(seqs))
            for seq in seqs:
                seq.proposer_addr, seq.proposer_len = None, 0
            return {}
        elapsed = time.perf_counter() - start
        drafts = {}
        for seq, draft in zip(seqs, response.drafts):
            seq.stats.propose_s += elapsed
            if draft.status != pb.SEQUENCE_STATUS_OK:
                seq.proposer_len = 0  # re-open next round
                continue
            seq.proposer_len = len(seq.tokens)
            checked = self._checked_drafts(seq, draft)
            seq.acceptance.proposed(len(seq.tokens), checked.token_ids.tolist())
            drafts[seq.seq_id] = checked
        return drafts

    def _sequence_update(self, seq: Sequence) -> pb.SequenceUpdate:
        p = seq.params
        update = pb.SequenceUpdate(seq_id=seq.seq_id, context_len=len(seq.tokens),
                                   num_speculative_tokens=seq.draft_budget())
        if seq.proposer_len == 0:
            update.open = True
            update.token_ids.extend(seq.tokens)
            update.options.CopyFrom(pb.ProposerOptions(
                method=p.method, min_n=p.min_n, max_n=p.max_n, reference_token_ids=p.reference_ids,
                max_tree_depth=p.max_tree_depth, max_spec_factor=p.max_spec_factor,
                min_token_prob=p.min_token_prob))
        else:
            update.token_ids.extend(seq.tokens[seq.proposer_len:])
        return update

    def _checked_drafts(self, seq: Sequence, draft: pb.Draft) -> _Drafts:
        """A proposer returning garbage (too many drafts, ids outside the
        vocabulary, malformed probabilities) costs its drafts, nothing else."""
        ids = np.asarray(draft.token_ids, dtype=np.int32)
        bad = (len(ids) > seq.draft_budget() or (len(ids) and (ids.min() < 0 or ids.max() >= self.vocab_size))
               or (len(draft.probs) not in (0, len(ids))))
        if bad:
            log.warning("proposer %s sent invalid drafts for %s; dropped", seq.proposer_addr, seq.seq_id)
            metrics.INVALID_DRAFTS.labels(seq.proposer_addr).inc()
            return _Drafts(NO_DRAFTS, [])
        return _Drafts(ids, list(draft.probs))

    # --------------------------------------------------------------- verify

    async def _verify(self, live: list[Sequence], drafts: dict[str, _Drafts]) -> bool:
        """Runs the round's Verify calls; True if any sequence made progress."""
        by_addr: dict[str, list[Sequence]] = {}
        for seq in live:
            if seq.scorer_addr not in self.scorers.addresses() or seq.scorer_addr in self.conns.down():
                if seq.scorer_addr is not None:  # its replica went away or is failing
                    metrics.MOVES.labels("scorer").inc()
                seq.scorer_addr, seq.scorer_primed = self.scorers.pick(seq.seq_id, self.conns.down()), False
            if seq.scorer_addr is None:
                self._stall(seq, RequestFailed("UNAVAILABLE", "no scorer replica is available"))
                continue
            by_addr.setdefault(seq.scorer_addr, []).append(seq)
        outcomes = await asyncio.gather(*(self._verify_on(a, seqs, drafts) for a, seqs in by_addr.items()))
        return any(outcomes)

    async def _verify_on(self, addr: str, seqs: list[Sequence], drafts: dict[str, _Drafts]) -> bool:
        await self._flush_scorer_releases(addr)
        cost = self._costs.setdefault(addr, CostModel())
        fed = self._trim_drafts(seqs, drafts, cost)
        # the fit describes verification rounds; prefill costs per token differ
        decode_only = all(seq.scorer_primed for seq in seqs)
        request = pb.VerifyRequest()
        for seq in seqs:
            d = drafts.get(seq.seq_id, _Drafts(NO_DRAFTS, []))
            p = seq.params
            v = request.sequences.add(
                seq_id=seq.seq_id, context_len=len(seq.tokens), draft_token_ids=d.token_ids.tolist(),
                draft_probs=d.probs, verify_strategy=p.verify_strategy, accept_policy=p.accept_policy)
            v.sampling.temperature, v.sampling.top_k, v.sampling.top_p = p.temperature, p.top_k, p.top_p
            v.sampling.seed = p.seed
            if not seq.scorer_primed:
                v.context_token_ids.extend(seq.tokens)
        start = time.perf_counter()
        try:
            response = await self.conns.scorer(addr).Verify(request, timeout=self.config.verify_timeout_s)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:  # a request that got past our checks
                for seq in seqs:
                    seq.fail(RequestFailed("INVALID_ARGUMENT", e.details()))
                return True
            log.warning("scorer %s failed (%s); its %d sequences move", addr, e.code().name, len(seqs))
            self.conns.mark_down(addr, self.config.replica_down_s)
            metrics.REPLICA_FAILURES.labels("scorer", addr).inc()
            metrics.MOVES.labels("scorer").inc(len(seqs))
            for seq in seqs:
                seq.scorer_addr, seq.scorer_primed = None, False
                self._stall(seq, RequestFailed("UNAVAILABLE", f"scorer call failed: {e.code().name}"))
            return False
        rpc_s = time.perf_counter() - start
        if decode_only:
            cost.observe(fed, response.compute_s)
        progressed = False
        for seq, result in zip(seqs, response.results):
            seq.stats.verify_s += response.compute_s
            seq.stats.network_s += max(0.0, rpc_s - response.compute_s)
            if result.status == pb.SEQUENCE_STATUS_OK:
                seq.scorer_primed, seq.retries = True, 0
                k = len(drafts[seq.seq_id].token_ids) if seq.seq_id in drafts else 0
                before = seq.num_output
                seq.commit(list(result.output_token_ids), k, result.num_accepted)
                _count_round(seq, before, k, result.num_accepted)
                progressed = True
            elif result.status == pb.SEQUENCE_STATUS_UNKNOWN_SEQUENCE:
                seq.scorer_primed = False  # re-prefill from our history next round
                progressed = True
            elif result.status == pb.SEQUENCE_STATUS_INVALID:
                seq.fail(RequestFailed("INVALID_ARGUMENT", result.message))
            else:
                self._stall(seq, RequestFailed("RESOURCE_EXHAUSTED", result.message))
        return progressed

    def _trim_drafts(self, seqs: list[Sequence], drafts: dict[str, _Drafts], cost: CostModel) -> int:
        """Keeps the draft tokens worth verifying on this scorer replica this
        round (adaptive sequences only); returns the tokens the call feeds."""
        base = [1 if seq.scorer_primed else len(seq.tokens) for seq in seqs]
        proposed = [len(drafts[s.seq_id].token_ids) if s.seq_id in drafts else 0 for s in seqs]
        adaptive = [s.params.adaptive for s in seqs]
        if any(adaptive) and any(proposed):
            # fixed-length sequences' drafts are part of the round's cost, not candidates
            estimate = cost.estimate()
            if estimate is not None:
                metrics.VERIFY_COST.labels(seqs[0].scorer_addr, "fixed").set(estimate[0])
                metrics.VERIFY_COST.labels(seqs[0].scorer_addr, "per_token").set(estimate[1])
            plan = plan_draft_lengths([s.acceptance.gains(p if a else 0)
                                       for s, p, a in zip(seqs, proposed, adaptive)],
                                      [b + (0 if a else p) for b, p, a in zip(base, proposed, adaptive)],
                                      estimate)
            for seq, keep, n, a in zip(seqs, plan, proposed, adaptive):
                if a and keep < n:
                    d = drafts[seq.seq_id]
                    drafts[seq.seq_id] = _Drafts(d.token_ids[:keep], d.probs[:keep])
                    metrics.TRIMMED_DRAFTS.labels(seq.params.method).inc(n - keep)
        return sum(base) + sum(len(drafts[s.seq_id].token_ids) for s in seqs if s.seq_id in drafts)

    def _update_placement(self, live: list[Sequence]) -> None:
        counts: dict[tuple[str, str], int] = {}
        for seq in live:
            for kind, addr in (("proposer", seq.proposer_addr), ("scorer", seq.scorer_addr)):
                if addr is not None and not seq.done:
                    counts[kind, addr] = counts.get((kind, addr), 0) + 1
        self._placement.update(counts)

    def _stall(self, seq: Sequence, error: RequestFailed) -> None:
        """A round without progress for seq; after too many the request fails."""
        seq.retries += 1
        if seq.retries > self.config.max_stalled_rounds:
            seq.fail(error)

    # ------------------------------------------------------------- releases

    def _retire(self) -> None:
        """Drops finished, failed and cancelled sequences; their proposer state
        and KV cache are released with the next messages to those replicas."""
        keep = []
        for seq in self._live:
            if not seq.done:
                keep.append(seq)
                continue
            _count_end(seq)
            if seq.proposer_addr is not None and seq.proposer_len:
                completed = seq.finish_reason != pb.FINISH_REASON_UNSPECIFIED
                self._proposer_releases.setdefault(seq.proposer_addr, []).append(
                    pb.SequenceRelease(seq_id=seq.seq_id, completed=completed))
            if seq.scorer_addr is not None and seq.scorer_primed:
                self._scorer_releases.setdefault(seq.scorer_addr, []).append(seq.seq_id)
        self._live = keep

    async def _flush_releases(self) -> None:
        for addr in list(self._scorer_releases):
            await self._flush_scorer_releases(addr)
        for addr, releases in list(self._proposer_releases.items()):
            self._proposer_releases.pop(addr)
            try:
                await self.conns.proposer_stream(addr).exchange(
                    pb.ProposeRequest(releases=releases), self.config.propose_timeout_s)
            except Exception:
                pass  # a broken stream drops the replica's state anyway

    async def _flush_scorer_releases(self, addr: str) -> None:
        seq_ids = self._scorer_releases.pop(addr, [])
        if seq_ids:
            try:
                await self.conns.scorer(addr).Release(pb.ReleaseRequest(seq_ids=seq_ids), timeout=10)
            except grpc.aio.AioRpcError as e:
                log.warning("release on scorer %s failed: %s", addr, e.code().name)


def _count_round(seq: Sequence, output_before: int, num_drafts: int, num_accepted: int) -> None:
    method = seq.params.method
    if seq.stats.rounds == 1:
        metrics.TTFT.observe(seq.stats.ttft_s)
    metrics.ROUNDS.labels(method).inc()
    metrics.OUTPUT_TOKENS.labels(method).inc(max(0, seq.num_output - output_before))
    metrics.DRAFT_TOKENS.labels(method).inc(num_drafts)
    metrics.ACCEPTED_TOKENS.labels(method).inc(num_accepted)


def _count_end(seq: Sequence) -> None:
    if seq.failed:
        outcome = seq.failure_code
    elif seq.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
        outcome = pb.FinishReason.Name(seq.finish_reason).removeprefix("FINISH_REASON_").lower()
    else:
        outcome = "cancelled"
    metrics.REQUESTS.labels(outcome).inc()
    metrics.PROMPT_TOKENS.inc(seq.num_prompt)
    metrics.LATENCY.observe(time.perf_counter() - seq.started)
