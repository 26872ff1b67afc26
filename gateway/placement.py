"""Where each sequence's state lives: the proposer replica that holds its
tokens and the scorer replica that holds its KV cache.

A sequence stays on its replicas while they are up; when one goes away
(discovery) or is marked down (a failed call), the hash ring picks the next
one and the sequence re-opens there (the proposer from its whole context, the
scorer with a re-prefill). Moving costs time, never tokens. A sequence that
moves between scorers goes to one of the same arithmetic as the replica that
made its tokens while one is up (``numerics.ScorerNumerics``), skipping on
the ring those known to compute otherwise.
"""
from __future__ import annotations

from specdec.gateway import metrics
from specdec.gateway.clients import Connections
from specdec.gateway.discovery import ReplicaSet
from specdec.gateway.numerics import ScorerNumerics
from specdec.gateway.sequence import Sequence


class Placement:
    def __init__(self, scorers: ReplicaSet, proposers: dict[str, ReplicaSet], conns: Connections) -> None:
        self.scorers = scorers
        self.proposers = proposers  # method -> replicas serving it
        self.conns = conns
        self.numerics = ScorerNumerics(scorers, conns)
        self._gauge = metrics.PlacementGauge()

    def by_proposer(self, live: list[Sequence]) -> dict[str, list[Sequence]]:
        """The sequences that want drafts this round, by proposer replica
        (placing those whose replica is new or gone)."""
        groups: dict[str, list[Sequence]] = {}
        for seq in live:
            replicas = self.proposers.get(seq.params.method)
            if replicas is None or seq.num_speculative_tokens() == 0:
                continue
            if seq.proposer_addr not in replicas.addresses():
                if seq.proposer_addr is not None:  # its replica went away
                    metrics.MOVES.labels("proposer").inc()
                seq.proposer_addr, seq.proposer_len = replicas.pick(seq.seq_id, self.conns.down()), 0
            if seq.proposer_addr is not None:
                groups.setdefault(seq.proposer_addr, []).append(seq)
        return groups

    def by_scorer(self, live: list[Sequence]) -> tuple[dict[str, list[Sequence]], list[Sequence]]:
        """The sequences by scorer replica (placing those whose replica is
        new, gone or down), and those no replica is left for."""
        groups: dict[str, list[Sequence]] = {}
        unplaced = []
        for seq in live:
            if seq.scorer_addr not in self.scorers.addresses() or seq.scorer_addr in self.conns.down():
                if seq.scorer_addr is not None:  # its replica went away or is failing
                    metrics.MOVES.labels("scorer").inc()
                    seq.scorer_moved = True
                seq.scorer_addr, seq.scorer_primed = self._pick_scorer(seq), False
            if seq.scorer_addr is None:
                unplaced.append(seq)
            else:
                groups.setdefault(seq.scorer_addr, []).append(seq)
        return groups, unplaced

    def _pick_scorer(self, seq: Sequence) -> str | None:
        """The sequence's replica on the ring, skipping those down and,
        while another is up, those known to compute otherwise than the
        replica that made its tokens."""
        down = self.conns.down()
        other = self.numerics.differing(seq.numerics) if seq.numerics is not None else set()
        if other:
            addr = self.scorers.pick(seq.seq_id, down | other)
            if addr is not None:
                return addr
        return self.scorers.pick(seq.seq_id, down)

    @staticmethod
    def proposer_lost(seqs: list[Sequence]) -> None:
        """The replica's call failed: the sequences re-open (there or elsewhere)."""
        metrics.MOVES.labels("proposer").inc(len(seqs))
        for seq in seqs:
            seq.proposer_addr, seq.proposer_len = None, 0

    @staticmethod
    def scorer_lost(seq: Sequence) -> None:
        """The replica's call failed: the sequence re-prefills on another one."""
        metrics.MOVES.labels("scorer").inc()
        seq.scorer_addr, seq.scorer_primed, seq.scorer_moved = None, False, True

    def publish(self, live: list[Sequence]) -> None:
        """Live sequences per replica, for specdec_gateway_replica_sequences."""
        counts: dict[tuple[str, str], int] = {}
        for seq in live:
            for kind, addr in (("proposer", seq.proposer_addr), ("scorer", seq.scorer_addr)):
                if addr is not None and not seq.done:
                    counts[kind, addr] = counts.get((kind, addr), 0) + 1
        self._gauge.update(counts)
