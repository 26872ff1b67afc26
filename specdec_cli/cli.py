"""The `specdec` command line.

    specdec serve [--model M] [--port P]        whole stack on loopback
    specdec scorer|proposer|gateway ...          one service each (Helm runs these)
    specdec generate [--addr A] [--json] PROMPT  stream a generation
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import NoReturn

DEFAULT_SCORER_PORT = 50051
DEFAULT_PROPOSER_PORT = 50052
DEFAULT_GATEWAY_PORT = 50050
DEFAULT_HTTP_PORT = 8000
CPU_METHODS = "naive,ngram,suffix,hybrid"
#: OpenMP settings a proposer process starts with unless its environment sets
#: them (``main``). Its model drafts run a few short parallel regions per
#: round; OpenMP's default keeps the threads spinning after each, on cores
#: the scorer then verifies on. On 2 cores of an AMD EPYC with the scorer,
#: SmolLM2 chat at k=5 (6 prompts x 96 tokens, two runs each): eagle3 18.3 /
#: 18.4 s -> 17.6 / 14.7 s, its proposer's CPU time 9.3 -> 3.2-4.1 s; draft
#: 23.2 / 20.9 -> 21.4 / 19.2 s, CPU 14.4 -> 5.9-6.5 s. The scorer keeps the
#: default: its forward runs hundreds of regions back to back, and sleeping
#: threads slow it.
PROPOSER_OPENMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def _layer_list(text: str) -> tuple[int, ...]:
    """--feature-layers: comma-separated layer indices, in increasing order
    (as the scorer asks its engine for a batch's layers), each once."""
    try:
        layers = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated integers: {text!r}") from None
    if len(set(layers)) != len(layers):
        raise argparse.ArgumentTypeError(f"a layer appears twice in {text!r}")
    return tuple(sorted(layers))


def _port(text: str) -> int:
    """A port argument: 0..65535 (gRPC would take 70000 as 70000 - 65536 and
    bind that port, while the command printed the one asked for)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535, not {port}")
    return port


def _address(text: str) -> str:
    """--addr: HOST:PORT with a port 1..65535 (gRPC would dial 70000 as
    70000 - 65536), or a gRPC target with a scheme (unix:, dns:, ipv4:, ipv6:)."""
    if text.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
        return text
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise argparse.ArgumentTypeError(f"not HOST:PORT: {text!r}")
    if _port(port) == 0:
        raise argparse.ArgumentTypeError(f"port 0 in {text!r}: dial the port the service bound")
    return text


def _add_common(p: argparse.ArgumentParser, port: int) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in a container)")
    p.add_argument("--port", type=_port, default=port, help="gRPC port (0: pick a free one)")
    p.add_argument("--metrics-port", type=_port, default=0, help="Prometheus /metrics port (0: off)")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--tls-cert", help="serve TLS with this PEM certificate (chain); reloaded when it changes")
    p.add_argument("--tls-key", help="the PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", help="mutual TLS: accept only clients with a certificate signed by "
                                           "this PEM CA (scorer/proposers: the gateway's)")


def _add_draft_args(p: argparse.ArgumentParser) -> None:
    """Flags of the model-draft methods (draft, draft_hybrid) and the feature heads (eagle3, mtp)."""
    from specdec.engine.config import DEVICES, DTYPE_NAMES
    from specdec.limits import (
        DEFAULT_DRAFT_MAX_BATCH,
        DEFAULT_DRAFT_TOP_K,
        HEAD_PROJECTION_DTYPE,
        HEAD_PROJECTION_DTYPES,
    )
    from specdec.models import default_model

    p.add_argument("--draft-model", default=None,
                   help="draft/draft_hybrid: the draft LM (HF id, directory or .gguf); must share the "
                        "target's tokenizer")
    p.add_argument("--target-model", default=default_model(),
                   help="draft/draft_hybrid: the scorer's model, whose tokenizer the draft must share; eagle3: "
                        "the target whose embeddings the head shares; mtp: the target checkpoint carrying "
                        "the MTP layers")
    p.add_argument("--eagle3", metavar="DIR", default=None,
                   help="eagle3: an EAGLE-3 head for --target-model in the public layout (config.json + "
                        "model.safetensors or pytorch_model.bin, as vLLM/SGLang load it)")
    p.add_argument("--draft-device", "--device", dest="draft_device", default="cpu", choices=list(DEVICES))
    p.add_argument("--draft-dtype", "--dtype", dest="draft_dtype", default=None,
                   choices=list(dict.fromkeys([*DTYPE_NAMES, *HEAD_PROJECTION_DTYPES])),
                   help="the draft model's dtype (float32, the default, or bfloat16); eagle3/mtp: the head's "
                        f"projection weights (default: {HEAD_PROJECTION_DTYPE}; q8_0 / q4_1: quantised at load, "
                        "fewer bytes a draft step reads; float32 arithmetic; drafts may differ slightly, output never)")
    p.add_argument("--draft-kv-tokens", type=int, default=None, help="draft model's KV pool size in tokens")
    p.add_argument("--draft-threads", type=int, default=None,
                   help="CPU threads of the draft model's (and the eagle3/mtp head's) GEMMs and attention (default: "
                        "as the scorer's --threads: the cores this process may run on; 1 for a model too small to "
                        "gain from more)")
    p.add_argument("--draft-top-k", type=int, default=DEFAULT_DRAFT_TOP_K,
                   help="sampled drafts come from the draft's (or head's) K most likely tokens (sent with their "
                        "probabilities)")
    p.add_argument("--draft-max-batch", type=int, default=DEFAULT_DRAFT_MAX_BATCH,
                   help="a round with more sequences than this gets no model or head drafts (plain decoding)")


def check_draft_dtype(command: str, dtype: str | None) -> None:
    """SystemExit when a draft model (--draft-model) would get a dtype only a head's projections take."""
    from specdec.engine.config import DTYPE_NAMES

    if dtype is not None and dtype not in DTYPE_NAMES:
        raise SystemExit(f"{command}: --draft-dtype {dtype} quantises an eagle3/mtp head's projections; a draft "
                         f"model (--draft-model) runs in {' or '.join(DTYPE_NAMES)}")


def replica_settings(args):
    """The proposer's ReplicaSettings from its parsed flags."""
    from specdec.engine.config import EngineConfig
    from specdec.limits import HEAD_PROJECTION_DTYPE
    from specdec.proposer_svc.model_settings import DraftConfig, DraftModelSettings, HeadConfig
    from specdec.proposer_svc.registry import FeatureHeadSettings, ReplicaSettings
    from specdec.proposer_svc.suffix import SuffixConfig

    draft = None
    if args.draft_model:
        check_draft_dtype("proposer", args.draft_dtype)
        draft = DraftModelSettings(
            EngineConfig(args.draft_model, dtype=args.draft_dtype or "float32", device=args.draft_device,
                         kv_capacity_tokens=args.draft_kv_tokens, num_threads=args.draft_threads),
            target_model=args.target_model, draft=DraftConfig(top_k=args.draft_top_k, max_batch=args.draft_max_batch))
    heads = FeatureHeadSettings(args.target_model, args.eagle3, HeadConfig(args.draft_top_k, args.draft_max_batch),
                                args.draft_dtype or HEAD_PROJECTION_DTYPE, threads=args.draft_threads)
    return ReplicaSettings(SuffixConfig(max_cached_requests=args.max_cached_requests, cache_between_messages=True),
                           draft, heads)


def build_parser() -> argparse.ArgumentParser:
    from specdec.engine.config import (
        DEFAULT_KV_CAPACITY_TOKENS,
        DTYPE_NAMES,
        ENGINE_KINDS,
        GEMM_CHOICES,
        KV_DTYPE_CHOICES,
    )
    from specdec.gateway.admission import AdmissionConfig
    from specdec.limits import (
        AHEAD_BRANCH_BUDGET,
        AHEAD_BRANCH_MAX_SEQUENCES,
        COLOCATED_DRAFT_THREADS,
        DEFAULT_AHEAD_BRANCH_WIDTH,
        DEFAULT_DECODE_CHUNK_MS,
        DEFAULT_DECODE_STEPS,
        DEFAULT_MAX_STALLED_ROUNDS,
        DEFAULT_NUM_SPECULATIVE_TOKENS,
        HEAD_PROJECTION_DTYPE,
        HEAD_PROJECTION_DTYPES,
        MAX_BRANCH_WIDTH,
        MAX_DECODE_STEPS,
        MAX_SPECULATIVE_TOKENS,
        STALL_SLEEP_S,
    )
    from specdec.models import default_model

    admit = AdmissionConfig()
    req = admit.requests

    parser = argparse.ArgumentParser(prog="specdec", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("scorer", help="run the scorer (target model) service")
    _add_common(p, DEFAULT_SCORER_PORT)
    p.add_argument("--model", default=default_model(), help="HF id, directory or .gguf file")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--kv-tokens", type=int, default=None,
                   help=f"KV pool size in tokens (default {DEFAULT_KV_CAPACITY_TOKENS})")
    p.add_argument("--kv-memory-fraction", type=float, default=None,
                   help="KV pool size as a fraction of free memory (instead of --kv-tokens)")
    p.add_argument("--kv-dtype", default="auto", choices=list(KV_DTYPE_CHOICES),
                   help="KV cache storage: auto = --dtype on CPU, float32 on a GPU; bfloat16 (CPU only) rounds "
                        "each key and value to bfloat16, half the bytes per cached token and per attention read; "
                        "plain decoding and verification still compute the same rows")
    p.add_argument("--gemm", default="auto", choices=list(GEMM_CHOICES),
                   help="CPU GEMM path: auto = the fastest path that keeps rows bitwise independent of "
                        "the row count on this CPU (checked and timed at start, cached); a path name "
                        "forces it, or refuses to start if it breaks that invariance here")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads of the engine's GEMMs and attention (default: the cores this process may "
                        "run on; 1 for a model too small to gain from more)")
    p.add_argument("--max-batch-size", type=int, default=256, help="sequences per forward pass")
    p.add_argument("--max-tokens-per-forward", type=int, default=512, help="token budget per forward")
    p.add_argument("--decode-ahead", choices=["on", "off"], default="on",
                   help="when idle after answering a Verify with no drafts, run those sequences' next decode "
                        "step before their next Verify arrives (hides the round trip of plain decoding; the "
                        "tokens are the same), unless the Verify asked for none (skip_decode_ahead)")
    p.add_argument("--idle-timeout-s", type=float, default=600.0,
                   help="free the KV cache of a sequence not verified for this long (a gateway that "
                        "died); 0: never")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--feature-layers", type=_layer_list, default=(), metavar="L,L,...",
                   help="on a GPU, also capture at start the CUDA graphs of passes returning these layers' "
                        "states (the layers the EAGLE-3 / MTP heads of your proposers ask for, e.g. 2,15,27); "
                        "other layer sets get theirs the first time a round asks for them")
    p.add_argument("--max-model-len", type=int, default=None, help="cap the model's context (tokens)")
    p.add_argument("--engine", default="auto", choices=list(ENGINE_KINDS),
                   help="auto: own Llama runner when the architecture allows, else transformers; "
                        "llama: own runner or refuse; hf: transformers")

    p = sub.add_parser("proposer", help="run a proposer service")
    _add_common(p, DEFAULT_PROPOSER_PORT)
    p.add_argument("--methods", default=CPU_METHODS, help="comma-separated methods to serve")
    p.add_argument("--max-cached-requests", type=int, default=1000,
                   help="suffix/hybrid: finished outputs kept in the global tree (oldest evicted)")
    # benchmarks only (bench_overlap.py): answer each Propose message this much later
    p.add_argument("--added-latency-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    _add_draft_args(p)

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
    p.add_argument("--default-k", type=int, default=DEFAULT_NUM_SPECULATIVE_TOKENS,
                   help="num_speculative_tokens (draft tokens per round) of requests that name none")
    p.add_argument("--propose-timeout-ms", type=float, default=500.0,
                   help="a proposer slower than this costs the round its drafts")
    p.add_argument("--max-stalled-rounds", type=int, default=DEFAULT_MAX_STALLED_ROUNDS,
                   help="rounds in a row a request may make no progress (KV pool full, no scorer replica), each "
                        f"followed by a {STALL_SLEEP_S * 1000:.0f} ms pause, before it fails with "
                        "RESOURCE_EXHAUSTED or UNAVAILABLE")
    p.add_argument("--overlap", default="on", choices=["on", "always", "ahead", "off"],
                   help="on: while it pays (measured), verify one half of the sequences while the proposers "
                        "draft the other half, so proposer time leaves the critical path, and where that does "
                        "not pay but the proposer takes over a tenth of the Verify's time, draft ahead as "
                        "below (copy methods); always: whenever "
                        "two or more sequences are live; ahead: while a round is verified, the proposers draft the "
                        "next one (budget 2k+1), used where the round's outcome confirms it; the round waits "
                        "for fresh drafts, or for a proposer slower than the Verify, only where that pays "
                        "(greedy and target-match requests); off: lock-step rounds")
    p.add_argument("--ahead-branches", type=int, default=DEFAULT_AHEAD_BRANCH_WIDTH,
                   help="drafting ahead: besides each draft, ask the proposer for this many branches per draft "
                        "position (likely tokens where the round's outcome may leave the draft, each with the "
                        "draft after it), so a round whose draft ahead the outcome contradicts still finds "
                        f"one (0 to {MAX_BRANCH_WIDTH}; 0: none; ngram, suffix and hybrid answer them; only in "
                        f"messages with at most {AHEAD_BRANCH_MAX_SEQUENCES} sequences drafting ahead, "
                        f"{AHEAD_BRANCH_BUDGET} branches per position in all)")
    p.add_argument("--decode-steps", type=int, default=DEFAULT_DECODE_STEPS,
                   help="plain decoding (method none): tokens one Verify call decodes at most (1 to "
                        f"{MAX_DECODE_STEPS}); the per-token round trip is paid once a call, and a call's tokens "
                        "stream to the client together")
    p.add_argument("--decode-chunk-ms", type=float, default=DEFAULT_DECODE_CHUNK_MS,
                   help="plain decoding: a Verify call decodes as many tokens as the scorer's passes take in "
                        "this time (measured on the calls before), 1 to --decode-steps; 0: always --decode-steps")
    p.add_argument("--draft-length", default="adaptive", choices=["adaptive", "fixed"],
                   help="adaptive: verify only the drafts whose expected acceptance pays for their "
                        "cost on the scorer (measured online); fixed: every draft, up to k. "
                        "Requests may choose (speculation.draft_length)")
    p.add_argument("--http-port", type=_port, default=0,
                   help="OpenAI-compatible HTTP API port (/v1/chat/completions, ...); 0: off")
    p.add_argument("--scorer-wait-s", type=float, default=600.0, help="wait this long for a scorer at start")
    p.add_argument("--api-keys", metavar="FILE",
                   help="require 'authorization: Bearer KEY' with a key from FILE (one per line; re-read "
                        "when it changes); health and reflection stay open")
    p.add_argument("--drain-grace-s", type=float, default=30.0,
                   help="on SIGTERM: refuse new requests, let live ones finish this long, then end them "
                        "with UNAVAILABLE")
    p.add_argument("--max-live-requests", type=int, default=admit.max_live, help="requests generating at once")
    p.add_argument("--max-queued-requests", type=int, default=admit.max_queued,
                   help="requests waiting for a live slot; beyond this RESOURCE_EXHAUSTED at once")
    p.add_argument("--key-max-concurrent", type=int, default=0,
                   help="with --api-keys: requests running at once per key (0: no limit)")
    p.add_argument("--key-tokens-per-minute", type=int, default=0,
                   help="with --api-keys: output tokens per minute per key (0: no limit)")
    p.add_argument("--max-request-bytes", type=int, default=req.max_request_bytes, help="largest request message")
    p.add_argument("--max-stop-strings", type=int, default=req.max_stop_strings, help="stop strings per request")
    p.add_argument("--max-stop-chars", type=int, default=req.max_stop_chars, help="characters per stop string")
    p.add_argument("--max-chat-messages", type=int, default=req.max_chat_messages, help="chat messages per request")
    p.add_argument("--max-reference-tokens", type=int, default=req.max_reference_tokens,
                   help="tokens of speculation.reference_text per request")
    p.add_argument("--upstream-tls-ca", metavar="PEM",
                   help="speak TLS to scorers and proposers, verifying them with this CA")
    p.add_argument("--tls-client-cert", metavar="PEM", help="mutual TLS: the gateway's client certificate")
    p.add_argument("--tls-client-key", metavar="PEM", help="mutual TLS: the key of --tls-client-cert")
    p.add_argument("--upstream-tls-server-name", help="name to verify in upstream certificates "
                                                     "(default: the host dialled)")

    p = sub.add_parser("serve", help="start scorer, proposers and gateway on loopback")
    p.add_argument("--model", default=default_model(), help="HF id, directory or .gguf file")
    p.add_argument("--port", type=_port, default=DEFAULT_GATEWAY_PORT, help="gateway port")
    p.add_argument("--http-port", type=_port, default=DEFAULT_HTTP_PORT,
                   help="gateway's OpenAI-compatible HTTP port (0: off)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--kv-dtype", default="auto", choices=list(KV_DTYPE_CHOICES),
                   help="the scorer's KV cache storage (its --kv-dtype; auto: --dtype on CPU)")
    p.add_argument("--methods", default=CPU_METHODS, help="proposer methods to serve")
    p.add_argument("--draft-model", default=None,
                   help="also start a draft proposer process serving draft and draft_hybrid with this draft "
                        "LM (shares the model's tokenizer)")
    p.add_argument("--eagle3", metavar="DIR", default=None,
                   help="also serve eagle3 with this EAGLE-3 head for the model (public layout)")
    p.add_argument("--draft-dtype", default=None, choices=list(dict.fromkeys([*DTYPE_NAMES, *HEAD_PROJECTION_DTYPES])),
                   help="the draft model's dtype (default: --dtype; float32 or bfloat16) and the eagle3 head's "
                        f"projection weights (default: {HEAD_PROJECTION_DTYPE}; q8_0 / q4_1: quantised at load, "
                        "fewer bytes a draft step reads)")
    p.add_argument("--draft-threads", type=int, default=COLOCATED_DRAFT_THREADS,
                   help="the draft proposer's CPU threads (its --draft-threads): on one machine the scorer "
                        "uses every core, and a draft on more threads waits for them (limits.py, "
                        "COLOCATED_DRAFT_THREADS)")
    p.add_argument("--default-method", default="ngram")
    p.add_argument("--default-k", type=int, default=DEFAULT_NUM_SPECULATIVE_TOKENS)
    p.add_argument("--decode-steps", type=int, default=DEFAULT_DECODE_STEPS,
                   help=f"the gateway's --decode-steps: plain decoding's most tokens per Verify call (1 to "
                        f"{MAX_DECODE_STEPS})")
    p.add_argument("--decode-chunk-ms", type=float, default=DEFAULT_DECODE_CHUNK_MS,
                   help="the gateway's --decode-chunk-ms: plain decoding's scorer time a call (0: always "
                        "--decode-steps tokens)")
    p.add_argument("--engine", default="auto", choices=list(ENGINE_KINDS))
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="the scorer's device (cuda: the row-invariant Triton kernels and CUDA graphs)")
    p.add_argument("--kv-tokens", type=int, default=None)
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("--tls-cert", help="every service serves TLS with this PEM certificate, which must name "
                                      "127.0.0.1 (and whatever name clients dial)")
    p.add_argument("--tls-key", help="the PEM key of --tls-cert")
    p.add_argument("--tls-ca", help="the PEM CA that signed --tls-cert: scorer and proposers accept only the "
                                    "gateway (mutual TLS, the gateway presents --tls-cert)")
    p.add_argument("--api-keys", metavar="FILE", help="the gateway requires a key from FILE (one per line)")

    p = sub.add_parser("health", help="exit 0 if a service reports SERVING (a probe that speaks TLS)")
    p.add_argument("--addr", required=True, type=_address, help="HOST:PORT of the service")
    p.add_argument("--tls-ca", metavar="PEM", help="speak TLS, verifying the service with this CA")
    p.add_argument("--tls-client-cert", metavar="PEM", help="mutual TLS: the client certificate to present")
    p.add_argument("--tls-client-key", metavar="PEM", help="mutual TLS: the key of --tls-client-cert")
    p.add_argument("--tls-server-name", help="name to verify in the service's certificate")
    p.add_argument("--timeout", type=float, default=5.0)

    from specdec.distill_args import add_parser as add_distill_parser

    add_distill_parser(sub)

    p = sub.add_parser("generate", help="generate text through a running gateway")
    p.add_argument("prompt", help="prompt text (a user message with --chat)")
    p.add_argument("--addr", default=f"127.0.0.1:{DEFAULT_GATEWAY_PORT}", type=_address)
    p.add_argument("--chat", action="store_true", help="send the prompt as a chat message")
    p.add_argument("--method", "-m", default="",
                   help="none, naive, ngram, suffix, hybrid, draft, draft_hybrid, eagle3, mtp "
                        "(any method the gateway has a --proposer for)")
    p.add_argument("-k", type=int, default=None,
                   help=f"num_speculative_tokens: draft tokens per round (0..{MAX_SPECULATIVE_TOKENS})")
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
    p.add_argument("--tls-ca", metavar="PEM", help="speak TLS to the gateway, verifying it with this CA")
    p.add_argument("--api-key", default=None, help="API key for a gateway started with --api-keys "
                                                  "(default: $SPECDEC_API_KEY)")
    p.add_argument("--timeout", type=float, default=600.0)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["proposer"]:  # a proposer process: before torch and numba load OpenMP
        for name, value in PROPOSER_OPENMP_ENV.items():
            os.environ.setdefault(name, value)
    from specdec.launcher import die_with_launcher

    die_with_launcher()
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        from specdec.client import generate_command

        return generate_command(args)
    if args.command == "health":
        from specdec.client import health_command

        return health_command(args)
    if args.command == "distill":
        from specdec.distill_args import distill_command

        return distill_command(args)
    from specdec.servers import setup_logging

    setup_logging(args.log_level)
    if args.command == "serve":
        from specdec.launcher import serve_command

        return serve_command(args)
    if args.command == "scorer":
        from specdec.scorer_svc.server import serve as serve_scorer

        serve_scorer(args)
    elif args.command == "proposer":
        from specdec.proposer_svc.server import serve as serve_proposer

        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        from specdec.servers import server_security

        asyncio.run(serve_proposer(args.host, args.port, methods, replica_settings(args), args.metrics_port,
                                   server_security(args), args.added_latency_ms / 1000))
    elif args.command == "gateway":
        from specdec.gateway.server import serve as serve_gateway

        asyncio.run(serve_gateway(args))
    if argv is None:  # the process's entry point: a service that stopped cleanly
        _exit_without_teardown()
    return 0


def _exit_without_teardown() -> NoReturn:
    """Ends a service's process once it has stopped (servers stopped, worker
    threads joined) without the interpreter's teardown: unloading torch,
    transformers and grpc took 0.5-0.9 s of every service's stop (a process
    that had only imported torch: 0.5 s; AMD EPYC), and a stack stops three
    or more."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
