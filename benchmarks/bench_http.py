"""Throughput of the gateway's OpenAI-compatible HTTP API against its gRPC
API, same stack, same run: aggregate output tokens/s of 1 and 32 concurrent
greedy streams (ngram, the default method), each API measured --repeats
times in alternation and the best kept. The HTTP client reads the
server-sent events with httpx (as light as the gRPC Python client); every
HTTP text is checked against the gRPC text of the same request.

Each run also records the CPU seconds spent per output token by the
benchmark's own client process and by each service process (gateway,
scorer, proposer; read from /proc through psutil before and after the run),
so a gap between the two APIs can be placed: in the gateway's HTTP layer or
in the client, which shares this machine's cores with the stack.

Prints the CPU model and a table, writes JSON (--out).

    flock /tmp/specdec-bench.lock python benchmarks/bench_http.py [--model M] [--max-tokens 96]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

from specdec.client import make_request, stream
from specdec.launcher import Stack, free_port
from specdec.models import default_model

PROMPTS = [
    "Continue the list in the same format until the end of the month:\n"
    "- Monday, March 2: team meeting at 9:00 in room 4B\n- Tuesday, March 3: team meeting at 9:00 in room 4B\n",
    "Write a short story about a robot who learns to paint.",
    "Explain in three sentences why the sky is blue.",
    "List ten fruits, one per line, each with its colour.",
]


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")),
                "unknown")


def grpc_text(addr: str, prompt: str, max_tokens: int) -> tuple[str, int]:
    gen = stream(addr, make_request(prompt, max_tokens=max_tokens))
    return gen.text, len(gen.token_ids)


def http_text(http: httpx.Client, url: str, model: str, prompt: str, max_tokens: int) -> tuple[str, int]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    text, tokens = [], 0
    with http.stream("POST", f"{url}/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                text.append(chunk["choices"][0]["text"])
            else:
                tokens = chunk["usage"]["completion_tokens"]
    return "".join(text), tokens


def cpu_seconds(procs: dict[str, psutil.Process]) -> dict[str, float]:
    """User + system CPU seconds so far of each process (threads included)."""
    out = {}
    for name, proc in procs.items():
        t = proc.cpu_times()
        out[name] = t.user + t.system
    return out


def run(call, streams: int, procs: dict[str, psutil.Process] | None = None) -> dict:
    """streams concurrent calls; with procs, the CPU µs per output token each
    of them spent during the run."""
    jobs = [PROMPTS[i % len(PROMPTS)] for i in range(streams)]
    procs = procs or {}
    before = cpu_seconds(procs)
    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(call, jobs))
    wall = time.perf_counter() - start
    after = cpu_seconds(procs)
    tokens = sum(n for _, n in results)
    return {"streams": streams, "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "cpu_us_per_token": {n: 1e6 * (after[n] - before[n]) / max(tokens, 1) for n in procs},
            "texts": [t for t, _ in results]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=default_model())
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--streams", default="1,32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench_results/http.json")
    args = ap.parse_args()
    cpu = cpu_model()
    print(f"CPU: {cpu}  model: {args.model}  max_tokens: {args.max_tokens}", flush=True)
    stack = Stack(model=args.model, methods="ngram", http_port=free_port(), log_dir=tempfile.mkdtemp())
    rows = []
    with stack, httpx.Client(timeout=600, limits=httpx.Limits(max_connections=64)) as http:
        apis = {
            "grpc": lambda p: grpc_text(stack.gateway_addr, p, args.max_tokens),
            "http": lambda p: http_text(http, stack.http_url, args.model, p, args.max_tokens),
        }
        procs = {"client": psutil.Process(), **{s.name: psutil.Process(s.proc.pid) for s in stack.services}}
        for call in apis.values():  # warm-up: compile, connect, fill caches
            run(call, 4)
        for streams in (int(s) for s in args.streams.split(",")):
            best: dict[str, dict] = {}
            for _ in range(args.repeats):
                for api, call in apis.items():
                    result = run(call, streams, procs)
                    if api not in best or result["tok_s"] > best[api]["tok_s"]:
                        best[api] = result
            assert best["http"]["texts"] == best["grpc"]["texts"], "HTTP text differs from gRPC text"
            ratio = best["http"]["tok_s"] / best["grpc"]["tok_s"]
            rows.append({"streams": streams, "grpc_tok_s": best["grpc"]["tok_s"], "http_tok_s": best["http"]["tok_s"],
                         "http_vs_grpc": ratio, "tokens": best["grpc"]["tokens"],
                         "cpu_us_per_token": {api: best[api]["cpu_us_per_token"] for api in apis}})
    print(f"\n{'streams':>7} {'gRPC tok/s':>11} {'HTTP tok/s':>11} {'HTTP/gRPC':>10}")
    for r in rows:
        print(f"{r['streams']:>7} {r['grpc_tok_s']:>11.1f} {r['http_tok_s']:>11.1f} {r['http_vs_grpc']:>10.3f}")
    print("\nCPU µs per output token (the fastest run of each API):")
    names = list(rows[0]["cpu_us_per_token"]["grpc"]) if rows else []
    print(f"{'streams':>7} {'API':>5} " + " ".join(f"{n:>12}" for n in names))
    for r in rows:
        for api, cpu_us in r["cpu_us_per_token"].items():
            print(f"{r['streams']:>7} {api:>5} " + " ".join(f"{cpu_us[n]:>12.0f}" for n in names))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"cpu": cpu, "model": args.model, "max_tokens": args.max_tokens,
                                          "repeats": args.repeats, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
