"""Plain greedy decoding of the engine through several GEMM paths, and of
transformers ``generate``, taking turns: one decode of each per round, many
rounds, so that the machine's slow and fast moments (memory bandwidth shared
with other tenants moves these bandwidth-bound figures by ±30% from minute to
minute) fall on all of them alike. Prints the median and best tokens/s per
engine and each one's median ratio to transformers (computed round by
round), and writes JSON. ``--stack on,off`` adds plain decoding through a
local stack (real processes and gRPC, method "none", EOS ignored, the
scorer's GEMM path chosen as it chooses it, its --decode-ahead on or off)
and its median ratio to the first engine path, round by round.
``--kv-dtypes float32,bfloat16`` runs each path with each KV cache dtype
(the engine's kv_dtype), every engine row then with its median ratio to the
first; ``--prompt-tokens N`` decodes after a prompt of N tokens (the sample
prompt repeated), where the attention's share of a step has grown.

    python benchmarks/bench_decode_ab.py --paths auto,onednn,numba,numba1 --rounds 9 --stack on,off
    python benchmarks/bench_decode_ab.py --dtype bfloat16 --paths auto --kv-dtypes float32,bfloat16 \
        --prompt-tokens 1000 --rounds 9
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import tempfile
import time

import torch
from bench_forward import PROMPT, copy_bandwidth_gbs, decode_weight_bytes, engine_greedy, hf_greedy

from specdec.client import make_request, stream
from specdec.engine.config import KV_DTYPE_CHOICES
from specdec.engine.gemm_select import GemmRefused, cpu_model
from specdec.engine.kv_pool import default_num_threads
from specdec.engine.llama import Checkpoint, LlamaEngine
from specdec.launcher import Stack
from specdec.models import default_model, load_tokenizer, resolve_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=default_model())
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--paths", default="auto,onednn,numba,numba1", help="GEMM paths (auto: the selector's)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=default_num_threads())
    ap.add_argument("--stack", default="", help="decode-ahead values (on,off) of stack rows; '' for none")
    ap.add_argument("--kv-dtypes", default="auto",
                    help=f"KV cache dtypes of each engine path, comma-separated ({', '.join(KV_DTYPE_CHOICES)})")
    ap.add_argument("--prompt-tokens", type=int, default=0,
                    help="decode after this many prompt tokens (the sample prompt repeated); 0: the sample prompt")
    ap.add_argument("--out", default="bench_results/decode_ab.json")
    args = ap.parse_args()
    if not set(args.kv_dtypes.split(",")) <= set(KV_DTYPE_CHOICES):
        ap.error(f"--kv-dtypes: comma-separated names from {', '.join(KV_DTYPE_CHOICES)} (got {args.kv_dtypes!r})")
    if args.prompt_tokens < 0:
        ap.error(f"--prompt-tokens: 0 or more (got {args.prompt_tokens})")
    with contextlib.ExitStack() as stacks:
        run_rounds(args, stacks)


def stack_runner(stacks: contextlib.ExitStack, args, prompt: list[int], ahead: str):
    stack = stacks.enter_context(Stack(model=args.model, dtype=args.dtype, log_dir=tempfile.mkdtemp(),
                                       extra_scorer_args=["--threads", str(args.threads), "--decode-ahead", ahead]))

    def once() -> list[int]:
        request = make_request(prompt, max_tokens=args.tokens, method="none")
        request.ignore_eos = True
        return list(stream(stack.gateway_addr, request).token_ids)
    return once


def run_rounds(args, stacks: contextlib.ExitStack) -> None:
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    src = resolve_model(args.model)
    dtype = getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(src.path, dtype=dtype, **src.hf_kwargs()).eval()
    checkpoint = Checkpoint.of_model(hf, args.model)
    prompt = list(load_tokenizer(src)(PROMPT)["input_ids"])
    if args.prompt_tokens:
        prompt = (prompt * (args.prompt_tokens // len(prompt) + 1))[:args.prompt_tokens]
    runners, refused = {"transformers": lambda: hf_greedy(hf, prompt, args.tokens)}, {}
    engines = {}
    kv_dtypes = args.kv_dtypes.split(",")
    for path, kv_dtype in itertools.product(args.paths.split(","), kv_dtypes):
        try:
            engine = LlamaEngine(checkpoint, args.dtype, kv_capacity_tokens=len(prompt) + args.tokens + 64,
                                 gemm=path, num_threads=args.threads, kv_dtype=kv_dtype)
        except GemmRefused as e:
            refused[path] = str(e)
            print(f"{path}: refused: {e}")
            continue
        label = (f"engine {path}" + (f"->{engine.gemm}" if path == "auto" else "")
                 + (f", kv {kv_dtype}" if len(kv_dtypes) > 1 else ""))
        engines[label] = engine
        runners[label] = (lambda e: lambda: engine_greedy(e, prompt, args.tokens))(engine)
    for ahead in [a for a in args.stack.split(",") if a]:
        runners[f"stack, ahead {ahead}"] = stack_runner(stacks, args, prompt, ahead)
    reference = runners["transformers"]()
    for label, run in runners.items():  # warm-up, and every engine's tokens are transformers'
        tokens = run()
        if tokens != reference:
            print(f"{label}: tokens differ from transformers' at "
                  f"{next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), len(reference))}"
                  f" ({len(tokens)} tokens, transformers {len(reference)})")
    bandwidth = copy_bandwidth_gbs()
    limit = bandwidth * 1e9 / decode_weight_bytes(next(iter(engines.values()))) if engines else None
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores); copy bandwidth {bandwidth:.1f} GB/s; "
          f"{args.rounds} rounds of {args.tokens} tokens after {len(prompt)}, {args.threads} threads, load average "
          f"{os.getloadavg()[0]:.1f}")
    rates: dict[str, list[float]] = {label: [] for label in runners}
    for _ in range(args.rounds):
        for label, run in runners.items():
            t0 = time.perf_counter()
            n = len(run())
            rates[label].append(n / (time.perf_counter() - t0))
    hf_rates = rates["transformers"]
    first_engine = next(iter(engines), None)
    rows = []
    print(f"\n{'engine':24s} {'median tok/s':>12s} {'best':>7s} {'x HF (median of rounds)':>24s} {'% BW limit':>10s}")
    for label, r in rates.items():
        ratio = statistics.median(a / b for a, b in zip(r, hf_rates))
        pct = 100 * statistics.median(r) / limit if limit else None
        row = {"engine": label, "kv_dtype": engines[label].kv_dtype if label in engines else None,
               "median_tokens_per_s": statistics.median(r), "best_tokens_per_s": max(r),
               "rates": r, "median_ratio_to_transformers": ratio, "pct_of_bandwidth_limit_median": pct}
        vs = ""
        if label.startswith("engine") and label != first_engine and len(engines) > 1:
            row["median_ratio_to_first_engine"] = statistics.median(a / b for a, b in zip(r, rates[first_engine]))
            vs = f"  {row['median_ratio_to_first_engine']:.3f} x {first_engine} (median of rounds)"
        if label.startswith("stack") and first_engine:
            row["median_ratio_to_" + first_engine.replace(" ", "_")] = statistics.median(
                a / b for a, b in zip(r, rates[first_engine]))
            vs = f"  {row['median_ratio_to_' + first_engine.replace(' ', '_')]:.3f} x {first_engine} (median of rounds)"
        rows.append(row)
        print(f"{label:24s} {statistics.median(r):12.1f} {max(r):7.1f} {ratio:24.2f} "
              f"{'' if pct is None else f'{pct:9.0f}%'}{vs}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"cpu": cpu_model(), "model": args.model, "dtype": args.dtype, "threads": args.threads,
                   "prompt_tokens": len(prompt), "kv_dtypes": kv_dtypes,
                   "bandwidth_gbs": bandwidth, "bandwidth_limit_tok_s": limit, "rows": rows,
                   "refused": refused}, f, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
