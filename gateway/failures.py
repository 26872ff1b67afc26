"""What a failure costs. A proposer that fails costs its sequences this
round's drafts; a scorer replica that fails costs its sequences a move and a
re-prefill; a sequence that cannot make progress (KV pool full, no replica,
its previous Verify still in flight) waits and retries, and fails only after
``max_stalled_rounds`` such rounds in a row. None of it changes a token."""
from __future__ import annotations

import logging

from specdec.gateway import metrics
from specdec.gateway.clients import Connections
from specdec.gateway.placement import Placement
from specdec.gateway.sequence import RequestFailed, Sequence
from specdec.gateway.wire import Status, Verdict

log = logging.getLogger(__name__)


class FailurePolicy:
    def __init__(self, conns: Connections, placement: Placement, replica_down_s: float,
                 max_stalled_rounds: int) -> None:
        self.conns = conns
        self.placement = placement
        self.replica_down_s = replica_down_s  # keep new work off a replica whose call failed
        self.max_stalled_rounds = max_stalled_rounds

    def proposer_failed(self, addr: str, seqs: list[Sequence], error: BaseException) -> None:
        """The sequences go on without drafts this round and re-open next round."""
        log.warning("proposer %s failed (%s): %d sequences go on without drafts",
                    addr, type(error).__name__, len(seqs))
        self._replica_failed("proposer", addr)
        self.placement.proposer_lost(seqs)

    def scorer_failed(self, addr: str, num_seqs: int, code: str) -> None:
        """Keeps new work off the replica; its sequences' verdicts (SCORER_FAILED)
        move them in the commit step."""
        log.warning("scorer %s failed (%s); its %d sequences move", addr, code, num_seqs)
        self._replica_failed("scorer", addr)

    def _replica_failed(self, kind: str, addr: str) -> None:
        self.conns.mark_down(addr, self.replica_down_s)
        metrics.REPLICA_FAILURES.labels(kind, addr).inc()

    def settle(self, verdict: Verdict) -> bool:
        """Applies a verdict that committed nothing; True if the round still
        settled the sequence (it failed for good, or re-prefills next round)."""
        seq = verdict.seq
        if verdict.status is Status.UNKNOWN_SEQUENCE:
            seq.scorer_primed = False  # re-prefill from our history next round
            return True
        if verdict.status is Status.INVALID:
            seq.fail(RequestFailed("INVALID_ARGUMENT", verdict.message))
            return True
        if verdict.status is Status.SCORER_FAILED:
            self.placement.scorer_lost(seq)
            self.stall(seq, RequestFailed("UNAVAILABLE", f"scorer call failed: {verdict.message}"))
        elif verdict.status is Status.NO_SCORER:
            self.stall(seq, RequestFailed("UNAVAILABLE", "no scorer replica is available"))
        elif verdict.status is Status.BUSY:
            # the scorer still holds the sequence (primed stays as it is): retry the round
            self.stall(seq, RequestFailed("UNAVAILABLE", f"scorer busy with this sequence: {verdict.message}"))
        else:
            self.stall(seq, RequestFailed("RESOURCE_EXHAUSTED", verdict.message))
        return False

    def stall(self, seq: Sequence, error: RequestFailed) -> None:
        """A round without progress for seq; after too many in a row the request fails."""
        seq.retries += 1
        if seq.retries > self.max_stalled_rounds:
            seq.fail(error)
