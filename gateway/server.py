"""The Gateway gRPC servicer: validates Generate requests, hands them to the
speculative loop and streams the deltas back, turned into GenerateResponse
messages here at the edge."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from specdec.gateway.admission import Admission, admission_from_args
from specdec.gateway.clients import Connections
from specdec.gateway.discovery import KubernetesDiscovery, ReplicaSet, StaticDiscovery
from specdec.gateway.loop import LoopConfig, Overlap, SpecLoop
from specdec.gateway.request import InvalidArgument, ModelLimits, parse_request
from specdec.gateway.sequence import Delta, FinishReason, RequestFailed, Sequence
from specdec.limits import MAX_BRANCH_WIDTH, MAX_DECODE_STEPS
from specdec.protos.v1 import specdec_pb2 as pb
from specdec.protos.v1 import specdec_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from specdec.servers import ServerSecurity

log = logging.getLogger(__name__)

_FINISH_REASONS = {FinishReason.STOP: pb.FINISH_REASON_STOP, FinishReason.LENGTH: pb.FINISH_REASON_LENGTH}


def to_response(delta: Delta) -> pb.GenerateResponse:
    response = pb.GenerateResponse(request_id=delta.request_id, text=delta.text, token_ids=delta.token_ids)
    if delta.finish_reason is not None:
        response.finish_reason = _FINISH_REASONS[delta.finish_reason]
    if delta.stats is not None:
        response.stats.CopyFrom(pb.GenerationStats(**dataclasses.asdict(delta.stats)))
    return response


class GatewayServicer(pb_grpc.GatewayServicer):
    def __init__(self, loop: SpecLoop, tokenizer, limits: ModelLimits, default_method: str,
                 default_num_speculative_tokens: int, default_adaptive: bool = True) -> None:
        self.loop = loop
        self.tokenizer = tokenizer
        self.limits = limits
        self.methods = ("none", *sorted(loop.proposers))
        self.default_method = default_method
        self.default_num_speculative_tokens = default_num_speculative_tokens
        self.default_adaptive = default_adaptive  # --draft-length: for requests that do not choose

    def sequence(self, request: pb.GenerateRequest) -> Sequence:
        """A validated request as a new (not yet submitted) Sequence; raises
        InvalidArgument naming the bad field. The HTTP API builds its
        sequences here too."""
        params = parse_request(request, self.tokenizer, self.limits, self.methods, self.default_method,
                               self.default_num_speculative_tokens, self.default_adaptive)
        return Sequence(request.request_id or uuid.uuid4().hex[:16], params, self.tokenizer,
                        self.limits.eos_token_ids, self.limits.max_model_len)

    async def Generate(self, request: pb.GenerateRequest, context):
        try:
            seq = self.sequence(request)
        except InvalidArgument as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            async for delta in run_sequence(self.loop, seq):
                yield to_response(delta)
        except RequestFailed as e:
            await context.abort(grpc.StatusCode[e.code], str(e))


async def run_sequence(loop: SpecLoop, seq: Sequence) -> AsyncIterator[Delta]:
    """Submits `seq` to the loop and yields its deltas, the last one with a
    finish reason; a failure raises RequestFailed. Leaving early (the client
    cancelled or went away) cancels the sequence, and the loop frees its
    state (the scorer's KV cache, the proposer's). Shared by the gRPC and
    the HTTP API."""
    loop.submit(seq)
    try:
        while True:
            item = await seq.out.get()
            if isinstance(item, RequestFailed):
                raise item
            yield item
            if item.finish_reason is not None:
                return
    finally:
        if not seq.done:
            seq.cancelled = True


def build_discovery(args) -> tuple[ReplicaSet, dict[str, ReplicaSet], StaticDiscovery | KubernetesDiscovery]:
    """Replica sets of the scorer and of each proposer method, kept current by
    static addresses or by watching Kubernetes EndpointSlices."""
    scorers = ReplicaSet("scorer")
    if args.discovery == "static":
        if not args.scorer:
            raise SystemExit("--scorer ADDR[,ADDR] is required with --discovery static")
        targets = {"scorer": (scorers, _split(args.scorer))}
        proposers = {}
        for spec in args.proposer or []:
            method, addrs = _method_spec(spec, "--proposer")
            proposers[method] = ReplicaSet(f"proposer-{method}")
            targets[f"proposer-{method}"] = (proposers[method], _split(addrs))
        return scorers, proposers, StaticDiscovery(targets)
    if not args.scorer_service:
        raise SystemExit("--scorer-service is required with --discovery kubernetes")
    k8s_targets = {args.scorer_service: scorers}
    proposers = {}
    for spec in args.proposer_service or []:
        method, service = _method_spec(spec, "--proposer-service")
        proposers[method] = ReplicaSet(f"proposer-{method}")
        k8s_targets[service] = proposers[method]
    return scorers, proposers, KubernetesDiscovery(args.namespace, k8s_targets)


def _split(addrs: str) -> list[str]:
    return [a.strip() for a in addrs.split(",") if a.strip()]


def _method_spec(spec: str, flag: str) -> tuple[str, str]:
    method, sep, value = spec.partition("=")
    if not sep or not method or not value:
        raise SystemExit(f"{flag} takes METHOD=VALUE, got {spec!r}")
    return method, value


async def fetch_limits(loop: SpecLoop, tokenizer, wait_s: float) -> ModelLimits:
    """Asks a scorer replica for the model's facts, waiting for one to come up."""
    now = asyncio.get_running_loop().time
    deadline, next_log = now() + wait_s, now()
    while True:
        addr = loop.scorers.pick("model-info")
        if addr is not None:
            try:
                info = await loop.conns.scorer(addr).GetModelInfo(pb.ModelInfoRequest(), timeout=5)
                eos = set(info.eos_token_ids)
                if tokenizer.eos_token_id is not None:
                    eos.add(tokenizer.eos_token_id)
                return ModelLimits(info.vocab_size, info.max_model_len, tuple(sorted(eos)))
            except grpc.aio.AioRpcError as e:
                if now() >= next_log:  # (asked every 0.2 s: a scorer loading its model is seen at once)
                    log.info("waiting for scorer %s: %s", addr, e.code().name)
                    next_log = now() + 5.0
        if now() > deadline:
            raise SystemExit(f"no scorer answered GetModelInfo within {wait_s:.0f} s")
        await asyncio.sleep(0.2)


async def serve(args) -> None:
    from specdec.models import load_tokenizer, resolve_model
    from specdec.security import client_tls_from_args
    from specdec.servers import Server, server_security, start_metrics

    if not 1 <= args.decode_steps <= MAX_DECODE_STEPS:
        raise SystemExit(f"--decode-steps must be in 1..{MAX_DECODE_STEPS}, got {args.decode_steps}")
    if not 0 <= args.decode_chunk_ms < float("inf"):
        raise SystemExit(f"--decode-chunk-ms must be >= 0, got {args.decode_chunk_ms}")
    if not 0 <= args.ahead_branches <= MAX_BRANCH_WIDTH:
        raise SystemExit(f"--ahead-branches must be in 0..{MAX_BRANCH_WIDTH}, got {args.ahead_branches}")
    if args.max_stalled_rounds < 0:
        raise SystemExit(f"--max-stalled-rounds must be >= 0, got {args.max_stalled_rounds}")
    tokenizer = load_tokenizer(resolve_model(args.model))
    admission = admission_from_args(args, lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]))
    security = server_security(args, api_keys=True)
    server = Server(args.host, args.port, ["Gateway"], security, [admission])
    scorers, proposers, discovery = build_discovery(args)
    discovery.start()
    loop = SpecLoop(scorers, proposers, vocab_size=0,
                    config=LoopConfig(propose_timeout_s=args.propose_timeout_ms / 1000,
                                      overlap=Overlap(args.overlap), decode_steps=args.decode_steps,
                                      decode_chunk_s=args.decode_chunk_ms / 1000,
                                      ahead_branch_width=args.ahead_branches,
                                      max_stalled_rounds=args.max_stalled_rounds),
                    conns=Connections(client_tls_from_args(args)))
    limits = await fetch_limits(loop, tokenizer, args.scorer_wait_s)
    loop.vocab_size = limits.vocab_size
    if args.default_method != "none" and args.default_method not in proposers:
        raise SystemExit(f"--default-method {args.default_method!r} has no --proposer for it")
    servicer = GatewayServicer(loop, tokenizer, limits, args.default_method, args.default_k,
                               default_adaptive=args.draft_length == "adaptive")
    pb_grpc.add_GatewayServicer_to_server(servicer, server.server)
    loop.start()
    start_metrics(args.metrics_port)
    log.info("gateway: methods %s, model context %d", servicer.methods, limits.max_model_len)
    http = await start_http(servicer, args, security, admission) if args.http_port else None
    print(f"gateway listening on {args.host}:{server.port}", flush=True)

    async def stop():
        """Drain: refuse new requests, let live ones finish within the grace
        period, end the rest with UNAVAILABLE (their KV caches are freed)."""
        admission.close()
        if not await admission.wait_idle(args.drain_grace_s):
            log.warning("drain: requests still running after %.0f s; ending them", args.drain_grace_s)
        if http is not None:
            await http.stop()
        discovery.stop()
        await loop.stop()
        await admission.wait_idle(5.0)  # their handlers send UNAVAILABLE

    await server.run_until_signal(on_stop=stop)


async def start_http(servicer: GatewayServicer, args, security: ServerSecurity, admission: Admission):
    """The OpenAI-compatible HTTP API (gateway/http_api.py), served from this
    event loop on --http-port, with the gRPC port's TLS certificate and API keys."""
    from specdec.gateway.http_api import HttpServer, build_app

    app = build_app(servicer, args.model, security.api_keys, admission)
    http = HttpServer(app, args.host, args.http_port, security.tls)
    await http.start()
    scheme = "https" if security.tls else "http"
    print(f"gateway HTTP (OpenAI API) on {scheme}://{args.host}:{http.port}/v1", flush=True)
    return http
