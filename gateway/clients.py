"""Connections from the gateway to proposer and scorer replicas: one channel
per replica address, one long-lived Propose stream per proposer replica, and
a short 'down' list for replicas whose calls just failed."""
from __future__ import annotations

import asyncio
import itertools
import logging
import time

import grpc

from specdec.protos.v1 import specdec_pb2 as pb
from specdec.protos.v1 import specdec_pb2_grpc as pb_grpc
from specdec.security import ClientTls, aio_channel
from specdec.servers import CHANNEL_OPTIONS

log = logging.getLogger(__name__)


def closed_under_us() -> bool:
    """Inside `except asyncio.CancelledError`: True when our own task is not
    being cancelled, i.e. gRPC aborted the call because its channel was closed
    (discovery dropped the replica). Such a call failed; it must not end the
    caller's task (the gateway loop) as a cancellation would."""
    task = asyncio.current_task()
    return task is not None and not task.cancelling()


class ProposerStream:
    """The Propose bidi stream to one replica, one message in flight at a
    time. Any failure, a timeout included, resets the stream: the caller then
    re-opens the replica's sequences on the next round."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._stub = pb_grpc.ProposerStub(channel)
        self._call: grpc.aio.StreamStreamCall | None = None
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()

    async def exchange(self, request: pb.ProposeRequest, timeout_s: float) -> pb.ProposeResponse:
        """Sends one message and waits for its response. Raises on timeout or a
        broken stream (the stream is then reset: the caller must re-open the
        replica's sequences)."""
        async with self._lock:
            if self._call is None:
                self._call = self._stub.Propose()
            call = self._call
            request.batch_id = next(self._ids)
            try:
                async with asyncio.timeout(timeout_s):  # (cheaper than wait_for: no task per await)
                    await call.write(request)
                    response = await call.read()
                if response is grpc.aio.EOF:
                    raise ConnectionError("proposer closed the stream")
                if response.batch_id != request.batch_id:
                    raise ConnectionError("proposer answered out of order")
                return response
            except asyncio.CancelledError:
                if self._call is not call:  # reset() (replica dropped) cancelled the call, not our task
                    raise ConnectionError("proposer stream was reset") from None
                self.reset()
                raise
            except BaseException:
                self.reset()
                raise

    def reset(self) -> None:
        if self._call is not None:
            self._call.cancel()
        self._call = None


#: gRPC's default reconnect backoff grows to 120 s, so a replica that died and
#: came back on the same address stayed unreachable for minutes; replicas are
#: few and on a fast network: retry connecting every second or so.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class Connections:
    """Channels (and proposer streams) keyed by address, created on demand."""

    def __init__(self, tls: ClientTls | None = None) -> None:
        self.tls = tls  # None: plaintext
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._streams: dict[str, ProposerStream] = {}
        self._scorers: dict[str, pb_grpc.ScorerStub] = {}  # a stub builds a callable per rpc: once per channel
        self._down_until: dict[str, float] = {}

    def channel(self, addr: str) -> grpc.aio.Channel:
        if addr not in self._channels:
            self._channels[addr] = aio_channel(addr, self.tls, [*CHANNEL_OPTIONS, *RECONNECT_OPTIONS])
        return self._channels[addr]

    def scorer(self, addr: str) -> pb_grpc.ScorerStub:
        if addr not in self._scorers:
            self._scorers[addr] = pb_grpc.ScorerStub(self.channel(addr))
        return self._scorers[addr]

    def proposer_stream(self, addr: str) -> ProposerStream:
        if addr not in self._streams:
            self._streams[addr] = ProposerStream(self.channel(addr))
        return self._streams[addr]

    def mark_down(self, addr: str, for_s: float) -> None:
        """Keeps new sequences off a replica whose call just failed."""
        log.warning("replica %s marked down for %.1f s", addr, for_s)
        self._down_until[addr] = time.monotonic() + for_s
        stream = self._streams.get(addr)
        if stream is not None:
            stream.reset()

    def down(self) -> set[str]:
        now = time.monotonic()
        return {a for a, t in self._down_until.items() if t > now}

    async def drop(self, addr: str, grace_s: float | None = None) -> None:
        """Closes everything to a replica that discovery removed; calls still
        in flight get grace_s to end on their own (they are aborted after)."""
        stream = self._streams.pop(addr, None)
        if stream is not None:
            stream.reset()
        self._scorers.pop(addr, None)
        channel = self._channels.pop(addr, None)
        if channel is not None:
            await channel.close(grace_s)

    async def close(self) -> None:
        for addr in list(self._channels):
            await self.drop(addr)
