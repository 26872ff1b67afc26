"""Admission control at the gateway's edge, before a request reaches the loop.

Three things bound the work one client can ask for:

- **request limits** (`RequestLimits`): message size, number and length of
  stop strings, chat messages, `reference_text` tokens. Over a limit is
  INVALID_ARGUMENT naming the field.
- **per-key limits** (with ``--api-keys``): concurrent requests and output
  tokens per minute per key. Over a limit is RESOURCE_EXHAUSTED with a retry
  hint (the ``retry-after-ms`` trailing metadata and the message).
- **a gateway-wide cap on live requests** with a bounded wait queue: up to
  `max_live` requests generate, up to `max_queued` more wait for a slot, any
  further request is refused at once with RESOURCE_EXHAUSTED: memory never
  grows without bound.

The token rate is a token bucket per key: it holds up to one minute of
tokens, refills continuously, and a request is admitted while it is not in
debt; a request's output tokens are charged as they stream, so one long
request can put the key in debt and the next waits `debt / rate`.
"""
from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, TypeVar

import grpc
from prometheus_client import Counter, Gauge

from specdec.security import bearer_key, hash_key

GENERATE = "/specdec.v1.Gateway/Generate"
T = TypeVar("T")

QUEUED = Gauge("specdec_gateway_queued_requests", "Requests waiting for a live slot")
ADMITTED = Gauge("specdec_gateway_admitted_requests", "Requests holding a live slot")
REFUSED = Counter("specdec_gateway_refused_requests_total", "Requests refused at admission, by reason",
                  ["reason"])


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on one request's fields (defaults are the documented ones)."""

    max_request_bytes: int = 4 * 1024 * 1024
    max_stop_strings: int = 16
    max_stop_chars: int = 256
    max_chat_messages: int = 1024
    max_reference_tokens: int = 32768

    def check(self, request, count_tokens: Callable[[str], int]) -> str | None:
        """The first violated limit as an INVALID_ARGUMENT message naming the
        field, or None."""
        size = request.ByteSize()
        if size > self.max_request_bytes:
            return f"request: {size} bytes, more than the limit of {self.max_request_bytes}"
        if len(request.stop) > self.max_stop_strings:
            return f"stop: {len(request.stop)} strings, more than the limit of {self.max_stop_strings}"
        for i, s in enumerate(request.stop):
            if len(s) > self.max_stop_chars:
                return f"stop[{i}]: {len(s)} characters, more than the limit of {self.max_stop_chars}"
        if request.WhichOneof("prompt") == "chat" and len(request.chat.messages) > self.max_chat_messages:
            return (f"chat.messages: {len(request.chat.messages)} messages, more than the limit of "
                    f"{self.max_chat_messages}")
        reference = request.speculation.reference_text
        # a token is at least one character: only long texts need tokenizing
        if len(reference) > self.max_reference_tokens:
            n = count_tokens(reference)
            if n > self.max_reference_tokens:
                return (f"speculation.reference_text: {n} tokens, more than the limit of "
                        f"{self.max_reference_tokens}")
        return None


@dataclass
class TokenBucket:
    """Up to `per_minute` tokens, refilled at per_minute / 60 per second."""

    per_minute: float
    level: float = 0.0
    at: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.level = self.per_minute

    def _refill(self, now: float) -> None:
        self.level = min(self.per_minute, self.level + (now - self.at) * self.per_minute / 60.0)
        self.at = now

    def wait_s(self, now: float) -> float:
        """0 when a request may start, else the seconds until the debt is paid."""
        self._refill(now)
        return 0.0 if self.level >= 0 else -self.level * 60.0 / self.per_minute

    def spend(self, tokens: int, now: float) -> None:
        self._refill(now)
        self.level -= tokens


@dataclass(frozen=True)
class AdmissionConfig:
    max_live: int = 256
    max_queued: int = 1024
    key_max_concurrent: int = 0  # 0: no per-key limit
    key_tokens_per_minute: int = 0  # 0: no per-key limit
    requests: RequestLimits = RequestLimits()


class Refused(Exception):
    """A request refused at admission: a gRPC status, a message naming the
    field or the limit, and for per-key limits the seconds to wait."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_s: float | None = None) -> None:
        super().__init__(message)
        self.code, self.retry_s = code, retry_s


class Admission(grpc.aio.ServerInterceptor):
    """The limits above, for the gRPC Generate (as an interceptor; other
    methods pass) and the HTTP API (through `guard`)."""

    def __init__(self, config: AdmissionConfig, count_tokens: Callable[[str], int],
                 clock: Callable[[], float] = time.monotonic) -> None:
        if config.max_live < 1 or config.max_queued < 0:
            raise ValueError("max_live must be >= 1 and max_queued >= 0")
        self.config = config
        self.count_tokens = count_tokens
        self.clock = clock
        self._slots = asyncio.Semaphore(config.max_live)
        self._live = 0
        self._queued = 0
        self._per_key: dict[bytes, int] = defaultdict(int)
        self._buckets: dict[bytes, TokenBucket] = {}
        self._closing = False
        self._idle = asyncio.Event()
        self._idle.set()

    def close(self) -> None:
        """Refuses every new request with UNAVAILABLE (the gateway is draining)."""
        self._closing = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """Waits until no request is running or queued; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method != GENERATE:
            return handler
        key = bearer_key(handler_call_details.invocation_metadata)
        inner = handler.unary_stream

        async def generate(request, context):
            try:
                async for response in self.guard(request, key, inner(request, context),
                                                 lambda response: len(response.token_ids)):
                    yield response
            except Refused as r:
                if r.retry_s is not None:
                    context.set_trailing_metadata([("retry-after-ms", str(int(r.retry_s * 1000)))])
                await context.abort(r.code, str(r))

        return grpc.unary_stream_rpc_method_handler(
            generate, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)

    async def guard(self, request, key: str | None, items: AsyncIterator[T],
                    count_tokens: Callable[[T], int]) -> AsyncIterator[T]:
        """items (a request's responses), run under admission: raises Refused
        before the first one when the request may not start, holds a live
        slot while they stream and charges their output tokens to the key."""
        identity = hash_key(key) if key is not None else b""
        refusal = self._refusal(request, identity)
        if refusal is not None:
            code, message, retry_s = refusal
            REFUSED.labels(code.name.lower() if retry_s is None else "key_limit").inc()
            raise Refused(code, message, retry_s)
        self._per_key[identity] += 1
        self._idle.clear()
        try:
            async with self._slot():
                bucket = self._buckets.get(identity)
                async for item in items:
                    if bucket is not None:
                        bucket.spend(count_tokens(item), self.clock())
                    yield item
        finally:
            self._per_key[identity] -= 1
            if not self._per_key[identity]:
                del self._per_key[identity]
            if not self._per_key:
                self._idle.set()

    def _refusal(self, request, identity: bytes) -> tuple[grpc.StatusCode, str, float | None] | None:
        """(code, message, retry-after seconds or None) when the request may not start."""
        if self._closing:
            return grpc.StatusCode.UNAVAILABLE, "the gateway is shutting down; retry on another replica", None
        if not hasattr(request, "ByteSize"):
            return None  # did not parse: the decode guard answers
        message = self.config.requests.check(request, self.count_tokens)
        if message is not None:
            return grpc.StatusCode.INVALID_ARGUMENT, message, None
        limit = self.config.key_max_concurrent
        if limit and self._per_key.get(identity, 0) >= limit:
            return (grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"authorization: this key already has {limit} requests running (the limit); retry "
                    "when one ends", 1.0)
        if self.config.key_tokens_per_minute:
            bucket = self._buckets.setdefault(identity, TokenBucket(self.config.key_tokens_per_minute))
            wait = bucket.wait_s(self.clock())
            if wait > 0:
                return (grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"authorization: this key used its {self.config.key_tokens_per_minute} tokens per "
                        f"minute; retry in {wait:.1f} s", wait)
        if self._live >= self.config.max_live and self._queued >= self.config.max_queued:
            return (grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the gateway is full ({self.config.max_live} requests running, {self.config.max_queued} "
                    "waiting); retry later", None)
        return None

    def _slot(self):
        return _Slot(self)


class _Slot:
    """Holds one of the max_live slots; counts the wait as queued."""

    def __init__(self, admission: Admission) -> None:
        self.a = admission

    async def __aenter__(self) -> None:
        a = self.a
        a._queued += 1
        QUEUED.set(a._queued)
        try:
            await a._slots.acquire()
        finally:
            a._queued -= 1
            QUEUED.set(a._queued)
        a._live += 1
        ADMITTED.set(a._live)

    async def __aexit__(self, *exc) -> None:
        a = self.a
        a._live -= 1
        ADMITTED.set(a._live)
        a._slots.release()


def admission_from_args(args, count_tokens: Callable[[str], int]) -> Admission:
    if (args.key_max_concurrent or args.key_tokens_per_minute) and not args.api_keys:
        raise SystemExit("--key-max-concurrent/--key-tokens-per-minute need --api-keys")
    requests = RequestLimits(max_request_bytes=args.max_request_bytes, max_stop_strings=args.max_stop_strings,
                             max_stop_chars=args.max_stop_chars, max_chat_messages=args.max_chat_messages,
                             max_reference_tokens=args.max_reference_tokens)
    config = AdmissionConfig(max_live=args.max_live_requests, max_queued=args.max_queued_requests,
                             key_max_concurrent=args.key_max_concurrent,
                             key_tokens_per_minute=args.key_tokens_per_minute, requests=requests)
    try:
        return Admission(config, count_tokens)
    except ValueError as e:
        raise SystemExit(f"--max-live-requests/--max-queued-requests: {e}") from None
