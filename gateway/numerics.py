"""Which arithmetic each scorer replica computes, so that a sequence that
moves keeps the arithmetic that made its tokens.

Each scorer says its arithmetic's fingerprint (``ModelInfo.numerics``, a
hash of the logits of a fixed probe: ``engine.base.numerics_fingerprint``).
Replicas of one model can compute different bits: another CPU kind (AVX2 or
AVX-512 kernels), another GEMM path chosen by timing, another dtype. Each
replica alone is lossless against plain decoding on itself, but a sequence
that moves between two of them mid-answer may take another token at a
near-tie than either would have alone. So a moving sequence goes to a
replica of its own fingerprint when one is up, and only otherwise to
another (``Sequence.numerics``, GenerationStats.scorer_numerics_changes,
``specdec_gateway_scorer_numerics_moves_total``).

The book learns a replica's fingerprint from GetModelInfo as soon as the
replica is discovered (retried while it starts) and from every Verify
answer (a replica restarted at the same address may compute otherwise).
"""
from __future__ import annotations

import asyncio
import logging

import grpc

from specdec.gateway import metrics
from specdec.gateway.clients import Connections
from specdec.gateway.discovery import ReplicaSet
from specdec.protos.v1 import specdec_pb2 as pb

log = logging.getLogger(__name__)

#: seconds between GetModelInfo tries at a replica that does not answer yet
LEARN_RETRY_S = 1.0
#: each GetModelInfo try's deadline
LEARN_TIMEOUT_S = 5.0


class ScorerNumerics:
    """Scorer replica address -> its numerics fingerprint, where known."""

    def __init__(self, scorers: ReplicaSet, conns: Connections) -> None:
        self.scorers = scorers
        self.conns = conns
        self._by_addr: dict[str, str] = {}
        self._learning: dict[str, asyncio.Task] = {}
        self._warned: frozenset[tuple[str, str]] = frozenset()

    def heard(self, addr: str, fingerprint: str) -> None:
        """A replica's answer named its fingerprint ("" from a scorer that
        does not say: nothing is learnt)."""
        if fingerprint and self._by_addr.get(addr) != fingerprint:
            self._by_addr[addr] = fingerprint
            self._publish()

    def forget(self, addr: str) -> None:
        """The replica went away (a new one at its address may differ)."""
        task = self._learning.pop(addr, None)
        if task is not None:
            task.cancel()
        if self._by_addr.pop(addr, None) is not None:
            self._publish()

    def differing(self, fingerprint: str) -> set[str]:
        """The replicas known to compute otherwise than ``fingerprint``."""
        return {addr for addr, f in self._by_addr.items() if f != fingerprint}

    def learn(self, addr: str) -> None:
        """Asks the replica its fingerprint in the background (until it
        answers or leaves the replica set)."""
        if addr not in self._by_addr and addr not in self._learning:
            self._learning[addr] = asyncio.get_running_loop().create_task(self._ask(addr))

    def learn_all(self) -> None:
        for addr in self.scorers.addresses():
            self.learn(addr)

    async def _ask(self, addr: str) -> None:
        try:
            while addr in self.scorers.addresses() and addr not in self._by_addr:
                try:
                    info = await self.conns.scorer(addr).GetModelInfo(pb.ModelInfoRequest(),
                                                                      timeout=LEARN_TIMEOUT_S)
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(LEARN_RETRY_S)
                    continue
                if not info.numerics:
                    return  # a scorer that does not say: its answers will not either
                self.heard(addr, info.numerics)
        finally:
            self._learning.pop(addr, None)

    async def stop(self) -> None:
        tasks = list(self._learning.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _publish(self) -> None:
        """The number of distinct fingerprints among the known replicas (a
        gauge), and a warning when replicas of another arithmetic appear."""
        kinds = set(self._by_addr.values())
        metrics.SCORER_NUMERICS_KINDS.set(len(kinds))
        pairs = frozenset(self._by_addr.items())
        if len(kinds) > 1 and not pairs <= self._warned:
            self._warned = pairs
            by_kind = {f: sorted(a for a, g in self._by_addr.items() if g == f) for f in sorted(kinds)}
            log.warning("scorer replicas compute different bits (numerics %s): a sequence moved between them may "
                        "take another token at a near-tie; moves keep to the same numerics while a replica of "
                        "it is up. Give every replica the same --gemm and --dtype on one CPU kind to avoid it",
                        "; ".join(f"{f} at {', '.join(addrs)}" for f, addrs in by_kind.items()))
