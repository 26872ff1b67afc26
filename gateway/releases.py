"""Freeing the state of ended sequences on their replicas, batched: proposer
releases ride on the next Propose message to that replica, scorer releases
go in one Release call before the next Verify to that replica (or when the
gateway goes idle)."""
from __future__ import annotations

import asyncio
import logging

import grpc

from specdec.gateway.clients import Connections, closed_under_us
from specdec.gateway.sequence import Sequence
from specdec.gateway.wire import propose_request
from specdec.protos.v1 import specdec_pb2 as pb

log = logging.getLogger(__name__)


class Releases:
    def __init__(self, conns: Connections) -> None:
        self.conns = conns
        self._proposer: dict[str, list[tuple[str, bool]]] = {}  # addr -> (seq_id, completed)
        self._scorer: dict[str, list[str]] = {}  # addr -> seq_ids

    def add(self, seq: Sequence) -> None:
        """Queues the release of an ended sequence's state (completed: it
        finished normally, so a proposer may remember its output)."""
        if seq.proposer_addr is not None and seq.proposer_len:
            self._proposer.setdefault(seq.proposer_addr, []).append((seq.seq_id, seq.finish_reason is not None))
        # also when not yet primed: its first Verify may still be running there,
        # and the scorer frees it when that job ends (releasing nothing is harmless)
        if seq.scorer_addr is not None:
            self._scorer.setdefault(seq.scorer_addr, []).append(seq.seq_id)

    def pending_proposer(self, addr: str) -> bool:
        """Whether releases wait for the next Propose message to addr."""
        return bool(self._proposer.get(addr))

    def take_proposer(self, addr: str) -> list[tuple[str, bool]]:
        """The releases for a Propose message about to go to addr."""
        return self._proposer.pop(addr, [])

    async def flush_scorer(self, addr: str) -> None:
        seq_ids = self._scorer.pop(addr, [])
        if seq_ids:
            try:
                await self.conns.scorer(addr).Release(pb.ReleaseRequest(seq_ids=seq_ids), timeout=10)
            except asyncio.CancelledError:
                if closed_under_us():  # the replica was dropped: nothing to free there
                    return
                # the loop was stopped mid-call (drain): keep them for stop()'s
                # last flush, or the scorer holds their KV until idle expiry
                self._scorer.setdefault(addr, []).extend(seq_ids)
                raise
            except grpc.aio.AioRpcError as e:  # the scorer's idle expiry frees them
                log.warning("release on scorer %s failed: %s", addr, e.code().name)

    async def flush_all(self, propose_timeout_s: float) -> None:
        for addr in list(self._scorer):
            await self.flush_scorer(addr)
        for addr in list(self._proposer):
            releases = self.take_proposer(addr)
            try:
                message = propose_request([], releases)
                await self.conns.proposer_stream(addr).exchange(message.request, propose_timeout_s)
            except asyncio.CancelledError:
                self._proposer.setdefault(addr, []).extend(releases)
                raise
            except Exception:
                pass  # a broken stream drops the replica's state anyway
