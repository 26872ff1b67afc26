"""The gateway's OpenAI-compatible HTTP API: ``POST /v1/chat/completions``,
``POST /v1/completions``, ``GET /v1/models`` and ``GET /health``.

It runs in the gateway's process and event loop, next to the gRPC servicer
(Starlette app, uvicorn server, server-sent events by sse-starlette). A body
is translated into a ``GenerateRequest`` and validated by the same
``parse_request`` as a gRPC request; its sequences run through the same
``run_sequence``. So the two APIs give the same output for the same request.

Translation rules (docs in README.md, "OpenAI-compatible HTTP"):

- every field is either used, accepted because it cannot change the output
  (``user``, ``metadata``, ...), accepted at its neutral value only
  (``logprobs: false``, ``frequency_penalty: 0``, ...), or refused with 400
  naming it; nothing is silently ignored;
- ``temperature`` defaults to 1.0 as in OpenAI's API (the gRPC default is 0);
- ``n`` > 1 runs n sequences (at most ``MAX_HTTP_CHOICES``); with a ``seed``
  choice i samples with ``seed + i``;
- ``speculation`` takes the gRPC ``SpeculationParams`` fields by name;
- errors have OpenAI's shape, ``{"error": {"message", "type", "param",
  "code"}}``: INVALID_ARGUMENT -> 400 with ``param`` the field,
  RESOURCE_EXHAUSTED -> 429, UNAVAILABLE -> 503.

Each cross-cutting concern has one place: a check in front of every route
(an API key) is a Starlette middleware in ``build_app``; TLS is uvicorn's
``ssl_certfile`` / ``ssl_keyfile`` in ``HttpServer``'s config.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import orjson
import uvicorn
from google.protobuf import json_format
from sse_starlette.event import ServerSentEvent
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from specdec.gateway.admission import Admission, Refused
from specdec.gateway.sequence import Delta, FinalStats, RequestFailed, Sequence
from specdec.gateway.server import GatewayServicer, run_sequence
from specdec.limits import MAX_HTTP_CHOICES
from specdec.protos.v1 import specdec_pb2 as pb
from specdec.security import ApiKeys, CertReloader, ServerTls, bearer_key
from specdec.validation import InvalidArgument

log = logging.getLogger(__name__)

#: HTTP status of a failed request, by gRPC code name.
HTTP_STATUS = {"INVALID_ARGUMENT": 400, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503}
_ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error",
                503: "service_unavailable_error"}
#: OpenAI's default temperature (the gRPC API's is 0, greedy).
DEFAULT_TEMPERATURE = 1.0

#: Fields accepted at any value: they never change the output.
_NO_EFFECT = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "stream_options"}
#: Fields accepted at their neutral value only; other values change results
#: in ways specdec does not implement.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
    "frequency_penalty": (None, 0), "presence_penalty": (None, 0), "logit_bias": (None, {}),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}), "suffix": (None, ""), "repetition_penalty": (None, 1),
    "min_tokens": (None, 0),
}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream", "ignore_eos",
           "speculation"}
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens"}
_COMPLETION_FIELDS = _COMMON | {"prompt"}


class FastJSONResponse(JSONResponse):
    """JSONResponse rendered by orjson (several times faster than json)."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class ApiError(Exception):
    """A request that ends in an OpenAI-shaped error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": _ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> FastJSONResponse:
        return FastJSONResponse(self.body(), status_code=self.status)


def _invalid(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_argument")


def _failure(error: RequestFailed) -> ApiError:
    return ApiError(HTTP_STATUS.get(error.code, 500), str(error), code=error.code.lower())


def _refused(refusal: Refused, plan: Plan) -> Response:
    """An admission refusal: 400 naming the field, 429 with Retry-After, 503."""
    if refusal.code == grpc.StatusCode.INVALID_ARGUMENT:
        return _from_invalid(InvalidArgument(str(refusal)), plan).response()
    response = _failure(RequestFailed(refusal.code.name, str(refusal))).response()
    if refusal.retry_s is not None:
        response.headers["Retry-After"] = str(max(1, math.ceil(refusal.retry_s)))
    return response


# ------------------------------------------------------------ request body


@dataclass
class Plan:
    """A translated body: the gRPC request of choice 0 and how to answer."""

    request: pb.GenerateRequest
    chat: bool
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    max_tokens_field: str = "max_tokens"  # the body's name for it (errors name it)
    seeds: list[int] = field(default_factory=list)  # per choice, when the body has a seed

    def requests(self) -> list[pb.GenerateRequest]:
        """One request per choice (choice i samples with seed + i)."""
        out = []
        for i in range(self.n):
            r = pb.GenerateRequest()
            r.CopyFrom(self.request)
            r.request_id = f"{self.request.request_id}-{i}" if self.n > 1 else self.request.request_id
            if self.seeds:
                r.sampling.seed = self.seeds[i]
            out.append(r)
        return out


def _number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise _invalid(name, f"must be a number, got {value!r}")
    return value


def _int(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise _invalid(name, f"must be an integer, got {value!r}")
    return value


def _bool(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise _invalid(name, f"must be true or false, got {value!r}")
    return bool(value)


def _check_fields(body: dict, allowed: set[str]) -> None:
    for name, value in body.items():
        if name in allowed or name in _NO_EFFECT:
            continue
        if name in _NEUTRAL:
            if value not in _NEUTRAL[name]:
                raise _invalid(name, f"not supported by specdec (only {_NEUTRAL[name][-1]!r} is)")
            continue
        raise _invalid(name, "unknown or unsupported field")


def _chat_prompt(messages: Any) -> pb.ChatPrompt:
    if not isinstance(messages, list) or not messages:
        raise _invalid("messages", "must be a non-empty list of messages")
    prompt = pb.ChatPrompt()
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _invalid(where, "must be an object with role and content")
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise _invalid(f"{where}.{extra[0]}", "not supported by specdec (messages take role and content)")
        content = m.get("content") or ""
        if isinstance(content, list):  # content parts: text only
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _invalid(f"{where}.content[{j}]", "only text parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str) or not isinstance(m.get("role"), str):
            raise _invalid(where, "role and content must be strings")
        prompt.messages.add(role=m["role"], content=content)
    return prompt


def _set_prompt(request: pb.GenerateRequest, prompt: Any) -> None:
    """A completion prompt: a string, token ids, or a list of one of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        request.text = prompt
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(not -(2**31) <= t < 2**31 for t in prompt):
            raise _invalid("prompt", "token ids must be 32-bit integers")
        request.token_ids.ids.extend(prompt)
        if not prompt:
            request.token_ids.SetInParent()
    elif prompt is None:
        raise _invalid("prompt", "is required")
    else:
        raise _invalid("prompt", "must be a string or a list of token ids (one prompt per request)")


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise _invalid("stop", "must be a string or a list of strings")


def translate(body: Any, chat: bool) -> Plan:
    """An OpenAI request body as a gRPC GenerateRequest plus how to answer;
    raises ApiError (400) naming the first bad field. The model's own checks
    (lengths, vocabulary, ranges) follow in parse_request."""
    if not isinstance(body, dict):
        raise _invalid("body", "must be a JSON object")
    body = {k: v for k, v in body.items() if v is not None}
    _check_fields(body, _CHAT_FIELDS if chat else _COMPLETION_FIELDS)
    request = pb.GenerateRequest(request_id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:16])
    plan = Plan(request, chat)
    if chat:
        request.chat.CopyFrom(_chat_prompt(body.get("messages")))
    else:
        _set_prompt(request, body.get("prompt"))
    if chat and "max_completion_tokens" in body:
        plan.max_tokens_field = "max_completion_tokens"
    max_tokens = _int(body, plan.max_tokens_field)
    if max_tokens is not None:
        if max_tokens < 1:
            raise _invalid(plan.max_tokens_field, f"must be >= 1, got {max_tokens}")
        request.max_tokens = min(max_tokens, 2**31 - 1)  # larger ones fail the context check all the same
    request.stop.extend(_stop(body.get("stop")))
    request.ignore_eos = _bool(body, "ignore_eos")
    temperature = _number(body, "temperature")
    request.sampling.temperature = DEFAULT_TEMPERATURE if temperature is None else temperature
    request.sampling.top_p = _number(body, "top_p") or 0.0
    top_k = _int(body, "top_k") or 0
    if not -1 <= top_k < 2**31:
        raise _invalid("top_k", f"must be >= 0 (0 or -1: off), got {top_k}")
    request.sampling.top_k = max(top_k, 0)
    plan.n = _int(body, "n") or 1
    if not 1 <= plan.n <= MAX_HTTP_CHOICES:
        raise _invalid("n", f"must be in 1..{MAX_HTTP_CHOICES}, got {plan.n}")
    seed = _int(body, "seed")
    if seed is not None:
        if not 0 <= seed < 2**63:
            raise _invalid("seed", f"must be in [0, 2**63), got {seed}")
        plan.seeds = [seed + i for i in range(plan.n)]
    plan.stream = _bool(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise _invalid("stream_options", "takes include_usage only")
    plan.include_usage = _bool(options, "include_usage")
    if "speculation" in body:
        if not isinstance(body["speculation"], dict):
            raise _invalid("speculation", "must be an object with SpeculationParams fields")
        try:
            json_format.ParseDict(body["speculation"], request.speculation)
        except json_format.ParseError as e:
            raise _invalid("speculation", str(e)) from None
    return plan


def _http_field(grpc_field: str, plan: Plan) -> str:
    """The body's name of a field parse_request named."""
    head, dot, rest = grpc_field.partition(".")
    if head == "sampling":
        return rest
    if head in ("chat", "text", "token_ids") or (head == "prompt" and plan.chat):
        if grpc_field.startswith("chat.messages["):
            return "messages" + grpc_field[len("chat.messages"):]
        return "messages" if plan.chat else "prompt"
    if head == "max_tokens":
        return plan.max_tokens_field
    if head.startswith("stop["):
        return "stop"
    return grpc_field


def _from_invalid(error: InvalidArgument, plan: Plan) -> ApiError:
    grpc_field, _, message = str(error).partition(": ")
    return _invalid(_http_field(grpc_field, plan), message)


# ------------------------------------------------------------ generation


#: The deltas ready at one event-loop turn, as (choice index, delta) in order.
Batch = list[tuple[int, Delta]]


async def _merged(servicer: GatewayServicer, seqs: list[Sequence]) -> AsyncIterator[Batch]:
    """The deltas of all choices, as they come, in batches: each batch holds
    every delta ready when the first of it arrived (so a stream that falls
    behind the loop's rounds catches up in one chunk, not one per round).
    A failure raises RequestFailed after the deltas before it. Leaving early
    cancels every choice."""
    if len(seqs) == 1:  # the common case, without a task hop
        seq = seqs[0]
        stream = run_sequence(servicer.loop, seq)
        async for delta in stream:
            batch, failure = [(0, delta)], None
            while delta.finish_reason is None and not seq.out.empty():
                try:  # returns at once: an item is waiting
                    delta = await anext(stream)
                except RequestFailed as e:
                    failure = e
                    break
                batch.append((0, delta))
            yield batch
            if failure is not None:
                raise failure
        return
    queue: asyncio.Queue[tuple[int, Delta | RequestFailed]] = asyncio.Queue()

    async def pump(i: int, seq: Sequence) -> None:
        try:
            async for delta in run_sequence(servicer.loop, seq):
                queue.put_nowait((i, delta))
        except RequestFailed as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, seq)) for i, seq in enumerate(seqs)]
    try:
        running = len(seqs)
        while running:
            ready = [await queue.get()]
            while not queue.empty():
                ready.append(queue.get_nowait())
            deltas: Batch = []
            for i, item in ready:
                if isinstance(item, RequestFailed):
                    if deltas:
                        yield deltas
                    raise item
                deltas.append((i, item))
                running -= item.finish_reason is not None
            yield deltas
    finally:
        for task in tasks:
            task.cancel()


def _coalesced(batch: Batch) -> Batch:
    """batch with each run of one choice's consecutive deltas joined into one
    delta (texts and token ids concatenated; the last one's finish reason
    and stats)."""
    out: Batch = []
    for i, delta in batch:
        if out and out[-1][0] == i:
            last = out[-1][1]
            delta = Delta(last.request_id, last.text + delta.text, last.token_ids + delta.token_ids,
                          delta.finish_reason, delta.stats)
            out[-1] = (i, delta)
        else:
            out.append((i, delta))
    return out


def usage(stats: list[FinalStats]) -> dict:
    """OpenAI's usage plus a ``speculation`` object. With n > 1 the counts
    are summed over the choices and acceptance_by_position is the mean of
    the choices that drafted at that position."""
    completion = sum(s.output_tokens for s in stats)
    rounds = sum(s.rounds for s in stats)
    longest = max(len(s.acceptance_by_position) for s in stats)
    by_position = []
    for p in range(longest):
        values = [s.acceptance_by_position[p] for s in stats if p < len(s.acceptance_by_position)]
        by_position.append(sum(values) / len(values))
    return {
        "prompt_tokens": stats[0].prompt_tokens, "completion_tokens": completion,
        "total_tokens": stats[0].prompt_tokens + completion,
        "speculation": {
            "rounds": rounds, "draft_tokens": sum(s.draft_tokens for s in stats),
            "accepted_tokens": sum(s.accepted_tokens for s in stats),
            "mean_accepted_length": completion / rounds if rounds else 0.0,
            "acceptance_by_position": by_position,
            # moves to a scorer replica of other arithmetic (GenerationStats.scorer_numerics_changes)
            "scorer_numerics_changes": sum(s.scorer_numerics_changes for s in stats),
        },
    }


class Completions:
    """One endpoint's answers (chat or text completions) for a served model."""

    def __init__(self, servicer: GatewayServicer, model: str, chat: bool,
                 admission: Admission | None = None) -> None:
        self.servicer = servicer
        self.admission = admission  # the gRPC API's limits, live cap and drain
        self.model = model
        self.chat = chat
        self.object = "chat.completion" if chat else "text_completion"

    def _start(self, body: Any) -> tuple[Plan, list[Sequence]]:
        plan = translate(body, self.chat)
        model = body.get("model")
        if model is not None and model != self.model:
            raise ApiError(404, f"model {model!r} is not served here (GET /v1/models lists {self.model!r})",
                           param="model", code="model_not_found")
        try:
            return plan, [self.servicer.sequence(r) for r in plan.requests()]
        except InvalidArgument as e:
            raise _from_invalid(e, plan) from None

    def _choice(self, index: int, text: str, finish: str | None, stream: bool, first: bool) -> dict:
        if not self.chat:
            return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        if stream:
            delta: dict[str, str] = {"role": "assistant", "content": text} if first else {"content": text}
            return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish}

    async def handle(self, request: Request) -> Response:
        try:
            body = orjson.loads(await request.body())
        except ValueError:
            return _invalid("body", "is not valid JSON").response()
        try:
            plan, seqs = self._start(body)
        except ApiError as e:
            return e.response()
        events = _merged(self.servicer, seqs)
        if self.admission is not None:  # one admission for the request, its n choices included
            key = bearer_key([(k, v) for k, v in request.headers.items()])
            events = self.admission.guard(plan.request, key, events,
                                          lambda batch: sum(len(d.token_ids) for _, d in batch))
        try:  # the first event decides the status: a stream that fails at once is a plain error
            first = await anext(events)
        except RequestFailed as e:
            return _failure(e).response()
        except Refused as r:
            return _refused(r, plan)
        head = {"id": plan.request.request_id, "created": int(time.time()), "model": self.model}
        if plan.stream:
            return EventSourceResponse(self._stream(plan, head, first, events), sep="\n", ping=3600)
        return await self._collect(plan, head, first, events)

    async def _collect(self, plan: Plan, head: dict, first: Batch, events: AsyncIterator[Batch]) -> Response:
        texts = [""] * plan.n
        finish: list[str | None] = [None] * plan.n
        stats: list[FinalStats | None] = [None] * plan.n

        def add(i: int, delta: Delta) -> None:
            texts[i] += delta.text
            if delta.finish_reason is not None:
                finish[i], stats[i] = delta.finish_reason.value, delta.stats

        for i, delta in first:
            add(i, delta)
        try:
            async for batch in events:
                for i, delta in batch:
                    add(i, delta)
        except RequestFailed as e:
            return _failure(e).response()
        choices = [self._choice(i, texts[i], finish[i], False, True) for i in range(plan.n)]
        final = [s for s in stats if s is not None]
        return FastJSONResponse({**head, "object": self.object, "choices": choices, "usage": usage(final)})

    async def _stream(self, plan: Plan, head: dict, first: Batch, events: AsyncIterator[Batch]) -> AsyncIterator[bytes]:
        """Server-sent events: one chunk per choice for each batch of deltas
        (a choice's deltas waiting together are joined, and the batch's
        events go out in one write), the usage chunk when asked for, then
        ``[DONE]``. A failure after the first chunk is sent as an error event
        (the status is already 200)."""
        chunk = {**head, "object": self.object + ("" if not self.chat else ".chunk")}
        if plan.include_usage:
            chunk["usage"] = None
        started = [False] * plan.n
        stats: list[FinalStats] = []

        def event(i: int, delta: Delta) -> bytes:
            finish = None
            if delta.finish_reason is not None:
                finish = delta.finish_reason.value
                assert delta.stats is not None
                stats.append(delta.stats)
            choice = self._choice(i, delta.text, finish, True, not started[i])
            started[i] = True
            return _sse({**chunk, "choices": [choice]})

        try:
            yield b"".join(event(i, delta) for i, delta in _coalesced(first))
            async for batch in events:
                yield b"".join(event(i, delta) for i, delta in _coalesced(batch))
        except RequestFailed as e:
            yield _sse(_failure(e).body())
        else:
            if plan.include_usage:
                yield _sse({**chunk, "choices": [], "usage": usage(stats)})
        yield ServerSentEvent("[DONE]", sep="\n").encode()


def _sse(data: dict) -> bytes:
    """One server-sent event whose data is data as JSON."""
    return ServerSentEvent(orjson.dumps(data).decode(), sep="\n").encode()


# ------------------------------------------------------------ app and server


class _RequireApiKey:
    """ASGI middleware: every route but /health needs ``Authorization: Bearer
    KEY`` with a key the gateway accepts (the same keys as gRPC); else 401."""

    def __init__(self, app, keys: ApiKeys) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
            key = bearer_key(headers)
            if key is None or not self.keys.valid(key):
                why = "missing API key (send 'Authorization: Bearer KEY')" if key is None else "unknown API key"
                await ApiError(401, f"authorization: {why}", code="unauthorized").response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(servicer: GatewayServicer, model: str, api_keys: ApiKeys | None = None,
              admission: Admission | None = None) -> Starlette:
    """The Starlette app of the OpenAI API for `model` (the name clients send
    and /v1/models lists); with api_keys every route but /health needs one;
    admission applies the gRPC API's limits, live cap and drain."""
    async def models(request: Request) -> Response:
        return FastJSONResponse({"object": "list", "data": [{
            "id": model, "object": "model", "created": 0, "owned_by": "specdec",
            "max_model_len": servicer.limits.max_model_len}]})

    async def health(request: Request) -> Response:
        return FastJSONResponse({"status": "ok"})

    async def not_found(request: Request, exc: Exception) -> Response:
        return ApiError(404, f"no route {request.method} {request.url.path}", code="not_found").response()

    routes = [
        Route("/v1/chat/completions", Completions(servicer, model, True, admission).handle, methods=["POST"]),
        Route("/v1/completions", Completions(servicer, model, False, admission).handle, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    middleware = [Middleware(_RequireApiKey, keys=api_keys)] if api_keys is not None else []
    return Starlette(routes=routes, exception_handlers={404: not_found}, middleware=middleware)


#: how often the HTTPS port checks its certificate files for a rotation
CERT_POLL_S = 1.0


class HttpServer:
    """uvicorn serving an app inside the running event loop (no thread, no
    extra process), on a socket bound at construction (port 0: a free one).
    tls: HTTPS with the gateway's certificate; like the gRPC port, a rotated
    certificate reaches new connections without a restart (files polled every
    CERT_POLL_S)."""

    def __init__(self, app: Callable, host: str, port: int, tls: ServerTls | None = None) -> None:
        self.socket = socket.create_server((host, port))
        self.port = self.socket.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                ssl_certfile=tls.cert if tls else None, ssl_keyfile=tls.key if tls else None)
        config.load()  # builds config.ssl, the context every HTTPS handshake uses
        self.certs = CertReloader(tls, config.ssl) if tls is not None and config.ssl is not None else None
        self.server = _LoopServer(config)
        self._task: asyncio.Task | None = None
        self._watch: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self.server.serve(sockets=[self.socket]))
        while not self.server.started:
            if self._task.done():
                self._task.result()  # raises why it stopped
                raise SystemExit("the HTTP server stopped at start")
            await asyncio.sleep(0.01)
        if self.certs is not None:
            self._watch = asyncio.create_task(self._watch_certs(self.certs))

    @staticmethod
    async def _watch_certs(certs: CertReloader) -> None:
        while True:
            await asyncio.sleep(CERT_POLL_S)
            certs.poll()

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        self.server.should_exit = True
        if self._task is not None:
            await self._task


class _LoopServer(uvicorn.Server):
    """Leaves SIGINT/SIGTERM to the gateway, which stops this server."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield
