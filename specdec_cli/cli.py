"""The `specdec` command line.

    specdec serve [--model M] [--port P]        whole stack on loopback
    specdec scorer|proposer|gateway ...          one service each (Helm runs these)
    specdec generate [--addr A] [--json] PROMPT  stream a generation
"""
from __future__ import annotations

import argparse
import asyncio
import sys

DEFAULT_SCORER_PORT = 50051
DEFAULT_PROPOSER_PORT = 50052
DEFAULT_GATEWAY_PORT = 50050
CPU_METHODS = "naive,ngram,suffix,hybrid"


def _add_common(p: argparse.ArgumentParser, port: int) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in a container)")
    p.add_argument("--port", type=int, default=port, help="gRPC port (0: pick a free one)")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (0: off)")
    p.add_argument("--log-level", default="INFO")


def build_parser() -> argparse.ArgumentParser:
    from specdec.models import default_model

    parser = argparse.ArgumentParser(prog="specdec", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("scorer", help="run the scorer (target model) service")
    _add_common(p, DEFAULT_SCORER_PORT)
    p.add_argument("--model", default=default_model(), help="HF id, directory or .gguf file")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--kv-tokens", type=int, default=None, help="KV pool size in tokens (default 32768)")
    p.add_argument("--kv-memory-fraction", type=float, default=None,
                   help="KV pool size as a fraction of free memory (instead of --kv-tokens)")
    p.add_argument("--gemm", default="auto", choices=["auto", "onednn", "aten"],
                   help="CPU GEMM path: auto = oneDNN (fast, flat up to ~8 rows); aten = MKL float32 "
                        "(closest to transformers, slower)")
    p.add_argument("--max-batch-size", type=int, default=256, help="sequences per forward pass")
    p.add_argument("--max-tokens-per-forward", type=int, default=512, help="token budget per forward")
    p.add_argument("--idle-timeout-s", type=float, default=600.0,
                   help="free the KV cache of a sequence not verified for this long (a gateway that "
                        "died); 0: never")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--engine", default="auto", choices=["auto", "hf"],
                   help="auto: own Llama runner when the architecture allows; hf: transformers")

    p = sub.add_parser("proposer", help="run a proposer service")
    _add_common(p, DEFAULT_PROPOSER_PORT)
    p.add_argument("--methods", default=CPU_METHODS, help="comma-separated methods to serve")
    p.add_argument("--max-cached-requests", type=int, default=1000,
                   help="suffix/hybrid: finished outputs kept in the global tree (oldest evicted)")

    p = sub.add_parser("gateway", help="run the gateway service")
    _add_common(p, DEFAULT_GATEWAY_PORT)
    p.add_argument("--model", default=default_model(), help="model whose tokenizer to use")
    p.add_argument("--discovery", default="static", choices=["static", "kubernetes"])
    p.add_argument("--scorer", help="static: scorer address(es), comma-separated")
    p.add_argument("--proposer", action="append", metavar="METHOD=ADDR[,ADDR]",
                   help="static: proposer replicas serving METHOD (repeatable)")
    p.add_argument("--namespace", default="default", help="kubernetes: namespace of the Services")
    p.add_argument("--scorer-service", help="kubernetes: the scorer's Service name")
    p.add_argument("--proposer-service", action="append", metavar="METHOD=SERVICE",
                   help="kubernetes: the Service of METHOD's proposers (repeatable)")
    p.add_argument("--default-method", default="ngram", help="method when a request names none")
    p.add_argument("--default-k", type=int, default=5, help="draft tokens per round by default")
    p.add_argument("--propose-timeout-ms", type=float, default=500.0,
                   help="a proposer slower than this costs the round its drafts")
    p.add_argument("--draft-length", default="adaptive", choices=["adaptive", "fixed"],
                   help="adaptive: verify only the drafts whose expected acceptance pays for their "
                        "cost on the scorer (measured online); fixed: every draft, up to k. "
                        "Requests may choose (speculation.draft_length)")
    p.add_argument("--scorer-wait-s", type=float, default=600.0, help="wait this long for a scorer at start")

    p = sub.add_parser("serve", help="start scorer, proposers and gateway on loopback")
    p.add_argument("--model", default=default_model(), help="HF id, directory or .gguf file")
    p.add_argument("--port", type=int, default=DEFAULT_GATEWAY_PORT, help="gateway port")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--methods", default=CPU_METHODS, help="proposer methods to serve")
    p.add_argument("--default-method", default="ngram")
    p.add_argument("--default-k", type=int, default=5)
    p.add_argument("--engine", default="auto", choices=["auto", "hf"])
    p.add_argument("--kv-tokens", type=int, default=None)
    p.add_argument("--log-level", default="WARNING")

    p = sub.add_parser("generate", help="generate text through a running gateway")
    p.add_argument("prompt", help="prompt text (a user message with --chat)")
    p.add_argument("--addr", default=f"127.0.0.1:{DEFAULT_GATEWAY_PORT}")
    p.add_argument("--chat", action="store_true", help="send the prompt as a chat message")
    p.add_argument("--method", "-m", default="", help="none, naive, ngram, suffix, hybrid")
    p.add_argument("-k", type=int, default=None, help="draft tokens per round (0..16)")
    p.add_argument("--max-tokens", "-n", type=int, default=None)
    p.add_argument("--temperature", "-t", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--reference-file", help="text the proposers may also draft from")
    p.add_argument("--draft-length", choices=["adaptive", "fixed"], default=None,
                   help="verify only the drafts worth their cost, or all of them (default: the gateway's)")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    p.add_argument("--timeout", type=float, default=600.0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        from specdec.client import generate_command

        return generate_command(args)
    from specdec.servers import setup_logging

    setup_logging(args.log_level)
    if args.command == "serve":
        from specdec.launcher import serve_command

        return serve_command(args)
    if args.command == "scorer":
        from specdec.scorer_svc.server import serve

        if args.kv_tokens is not None and args.kv_memory_fraction is not None:
            raise SystemExit("give --kv-tokens or --kv-memory-fraction, not both")
        serve(args)
    elif args.command == "proposer":
        from specdec.proposer_svc.server import serve

        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        asyncio.run(serve(args.host, args.port, methods, args.metrics_port, args.max_cached_requests))
    elif args.command == "gateway":
        from specdec.gateway.server import serve

        asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
