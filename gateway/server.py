"""The Gateway gRPC servicer: validates Generate requests, hands them to the
speculative loop and streams the deltas back."""
from __future__ import annotations

import asyncio
import logging
import uuid

import grpc

from specdec.gateway.discovery import KubernetesDiscovery, ReplicaSet, StaticDiscovery
from specdec.gateway.loop import LoopConfig, SpecLoop
from specdec.gateway.request import InvalidArgument, ModelLimits, parse_request
from specdec.gateway.sequence import RequestFailed, Sequence
from specdec.protos.v1 import specdec_pb2 as pb
from specdec.protos.v1 import specdec_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class GatewayServicer(pb_grpc.GatewayServicer):
    def __init__(self, loop: SpecLoop, tokenizer, limits: ModelLimits,
                 default_method: str, default_k: int) -> None:
        self.loop = loop
        self.tokenizer = tokenizer
        self.limits = limits
        self.methods = ("none", *sorted(loop.proposers))
        self.default_method = default_method
        self.default_k = default_k

    async def Generate(self, request: pb.GenerateRequest, context):
        try:
            params = parse_request(request, self.tokenizer, self.limits, self.methods,
                                   self.default_method, self.default_k,
                                   self.loop.config.adaptive_draft_length)
        except InvalidArgument as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        seq = Sequence(request.request_id or uuid.uuid4().hex[:16], params, self.tokenizer,
                       self.limits.eos_token_ids, self.limits.max_model_len)
        self.loop.submit(seq)
        try:
            while True:
                item = await seq.out.get()
                if isinstance(item, RequestFailed):
                    await context.abort(grpc.StatusCode[item.code], str(item))
                yield item
                if item.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    return
        finally:
            if not seq.done:  # client cancelled or deadline passed: the loop releases its state
                seq.cancelled = True


def build_discovery(args) -> tuple[ReplicaSet, dict[str, ReplicaSet], object]:
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
    deadline = asyncio.get_running_loop().time() + wait_s
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
                log.info("waiting for scorer %s: %s", addr, e.code().name)
        if asyncio.get_running_loop().time() > deadline:
            raise SystemExit(f"no scorer answered GetModelInfo within {wait_s:.0f} s")
        await asyncio.sleep(1.0)


async def serve(args) -> None:
    from specdec.models import load_tokenizer, resolve_model
    from specdec.servers import Server, start_metrics

    server = Server(args.host, args.port, ["Gateway"])
    tokenizer = load_tokenizer(resolve_model(args.model))
    scorers, proposers, discovery = build_discovery(args)
    discovery.start()
    loop = SpecLoop(scorers, proposers, vocab_size=0, config=LoopConfig(
        propose_timeout_s=args.propose_timeout_ms / 1000,
        adaptive_draft_length=args.draft_length == "adaptive"))
    limits = await fetch_limits(loop, tokenizer, args.scorer_wait_s)
    loop.vocab_size = limits.vocab_size
    if args.default_method != "none" and args.default_method not in proposers:
        raise SystemExit(f"--default-method {args.default_method!r} has no --proposer for it")
    servicer = GatewayServicer(loop, tokenizer, limits, args.default_method, args.default_k)
    pb_grpc.add_GatewayServicer_to_server(servicer, server.server)
    loop.start()
    start_metrics(args.metrics_port)
    log.info("gateway: methods %s, model context %d", servicer.methods, limits.max_model_len)
    print(f"gateway listening on {args.host}:{server.port}", flush=True)

    async def stop():
        discovery.stop()
        await loop.stop()

    await server.run_until_signal(on_stop=stop)
