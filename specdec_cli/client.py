"""A small synchronous client of the Gateway, used by `specdec generate`,
the tests and the benchmarks."""
from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from specdec.protos.v1 import specdec_pb2 as pb
from specdec.protos.v1 import specdec_pb2_grpc as pb_grpc
from specdec.security import ClientTls, sync_channel
from specdec.servers import CHANNEL_OPTIONS

FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                  pb.FINISH_REASON_UNSPECIFIED: None}


@dataclass
class Generation:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: pb.GenerationStats = field(default_factory=pb.GenerationStats)  # set by the last message
    wall_s: float = 0.0
    messages: int = 0  # GenerateResponse messages received (plain decoding: one per Verify call)

    def to_json(self) -> dict:
        s = self.stats
        return {
            "text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
            "stats": {
                "rounds": s.rounds, "draft_tokens": s.draft_tokens, "accepted_tokens": s.accepted_tokens,
                "mean_accepted_length": round(s.mean_accepted_length, 4),
                "acceptance_by_position": [round(a, 4) for a in s.acceptance_by_position],
                "prompt_tokens": s.prompt_tokens, "output_tokens": s.output_tokens,
                "propose_s": round(s.propose_s, 6), "verify_s": round(s.verify_s, 6),
                "network_s": round(s.network_s, 6), "ttft_s": round(s.ttft_s, 6),
                "wall_s": round(self.wall_s, 6), "feature_bytes": s.feature_bytes,
                "scorer_numerics_changes": s.scorer_numerics_changes,
            },
        }


def make_request(prompt: str | list[int] | None = None, *, chat: list[tuple[str, str]] | None = None,
                 max_tokens: int | None = None, method: str = "", k: int | None = None,
                 temperature: float = 0.0, top_p: float = 0.0, top_k: int = 0, seed: int | None = None,
                 stop: Sequence[str] = (), reference_text: str = "", **speculation) -> pb.GenerateRequest:
    request = pb.GenerateRequest(stop=list(stop))
    if chat is not None:
        request.chat.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in chat)
    elif isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    if max_tokens is not None:
        request.max_tokens = max_tokens
    request.sampling.temperature, request.sampling.top_p, request.sampling.top_k = temperature, top_p, top_k
    if seed is not None:
        request.sampling.seed = seed
    request.speculation.method = method
    request.speculation.reference_text = reference_text
    if k is not None:
        request.speculation.num_speculative_tokens = k
    for name, value in speculation.items():
        setattr(request.speculation, name, value)
    return request


def stream(addr: str, request: pb.GenerateRequest, timeout: float = 600.0, on_delta=None,
           tls: ClientTls | None = None, api_key: str | None = None) -> Generation:
    """Runs one Generate call; on_delta(text) is called for each text delta.
    tls: speak TLS (None: plaintext); api_key: sent as a Bearer token.
    Raises grpc.RpcError on failure."""
    gen = Generation()
    start = time.perf_counter()
    metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
    with sync_channel(addr, tls, CHANNEL_OPTIONS) as channel:
        for response in pb_grpc.GatewayStub(channel).Generate(request, timeout=timeout, metadata=metadata):
            gen.messages += 1
            gen.text += response.text
            gen.token_ids.extend(response.token_ids)
            if on_delta is not None and response.text:
                on_delta(response.text)
            if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                gen.finish_reason = FINISH_REASONS[response.finish_reason]
                gen.stats = response.stats
    gen.wall_s = time.perf_counter() - start
    return gen


def generate_command(args) -> int:
    reference = open(args.reference_file).read() if args.reference_file else ""
    request = make_request(
        None if args.chat else args.prompt, chat=[("user", args.prompt)] if args.chat else None,
        max_tokens=args.max_tokens, method=args.method, k=args.k, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop, reference_text=reference)
    if args.draft_length:
        request.speculation.draft_length = pb.DraftLength.Value(f"DRAFT_LENGTH_{args.draft_length.upper()}")

    def echo(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        gen = stream(args.addr, request, args.timeout, on_delta=None if args.json else echo,
                     tls=ClientTls(ca=args.tls_ca) if args.tls_ca else None,
                     api_key=args.api_key or os.environ.get("SPECDEC_API_KEY") or None)
    except grpc.RpcError as e:
        print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(gen.to_json()))
    else:
        print("\n" + summary_line(gen), file=sys.stderr)
    return 0


def summary_line(gen) -> str:
    """`specdec generate`'s closing line: tokens, time and rate, then the
    first token's wait (the prompt's prefill, the gateway's ``ttft_s``) and
    the rate after it, which is what speculation changes: on a short answer
    the prefill can be most of the time."""
    s = gen.stats
    line = (f"[{gen.finish_reason}] {s.output_tokens} tokens in {gen.wall_s:.2f} s "
            f"({s.output_tokens / max(gen.wall_s, 1e-9):.1f} tok/s")
    after = s.wall_s - s.ttft_s
    if s.output_tokens > 1 and s.ttft_s > 0 and after > 0:
        line += f"; first token after {_wait(s.ttft_s)}, then {(s.output_tokens - 1) / after:.1f} tok/s"
    return line + f"), {s.rounds} rounds, mean accepted length {s.mean_accepted_length:.2f}"


def _wait(seconds: float) -> str:
    """A wait as the summary prints it: seconds, or milliseconds below 0.1 s
    (a short prompt's first token on a fast machine read "0.00 s")."""
    return f"{seconds:.2f} s" if seconds >= 0.1 else f"{1e3 * seconds:.1f} ms"


def health_command(args) -> int:
    """`specdec health`: 0 when the service at --addr reports SERVING."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    tls = None
    if args.tls_ca or args.tls_client_cert:
        tls = ClientTls(args.tls_ca, args.tls_client_cert, args.tls_client_key, args.tls_server_name)
    try:
        with sync_channel(args.addr, tls, []) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                               timeout=args.timeout).status
    except grpc.RpcError as e:
        print(f"{args.addr}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    print(f"{args.addr}: {name}")
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1
