"""End-to-end throughput of the whole stack (real processes, real gRPC) on the
default model, in one run:

* single stream: plain decoding (method none), naive, ngram (k=5), suffix and
  hybrid on a prompt set with high input-output overlap (rewrite / continue /
  extract-from-text tasks), plus transformers `generate` on the same model;
* concurrency: aggregate tokens/s of 1, 8 and 32 concurrent greedy streams,
  plain against ngram;
* each speculative method with a fixed draft length (every draft verified)
  and with the adaptive one (drafts trimmed to what pays off, --draft-lengths).

Every speculative run is checked token for token against plain decoding.
Prints tables and writes JSON (--out).

    python benchmarks/bench_e2e.py [--model M] [--dtype float32] [--max-tokens 96]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from specdec.client import make_request, stream
from specdec.launcher import Stack
from specdec.models import default_model, load_tokenizer, resolve_model
from specdec.proposer_svc.registry import SUFFIX_METHODS
from specdec.protos.v1 import specdec_pb2 as pb

DOC = ("The Riverside Community Garden opened in April 2019 on a former parking lot owned by the city. "
       "It has 48 raised beds, a tool shed, two rain barrels and a compost area run by volunteers. "
       "Members pay 25 dollars per season and must work four hours each month. The garden manager is "
       "Maria Lopez, and the volunteer coordinator is Sam Okafor. Last year the garden donated 1,200 pounds "
       "of vegetables to the Eastside Food Bank.")
CODE = '''def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for v in values:
        total += (v - m) ** 2
    return total / len(values)
'''

PROMPTS = {
    "rewrite": f"Rewrite the following text exactly, but replace the word 'garden' with 'park':\n\n{DOC}",
    "extract": f"{DOC}\n\nQuote the sentence of the text above that names the garden manager, word for word.",
    "continue": "Continue the list in the same format until the end of the month:\n"
                "- Monday, March 2: team meeting at 9:00 in room 4B\n"
                "- Tuesday, March 3: team meeting at 9:00 in room 4B\n"
                "- Wednesday, March 4: team meeting at 9:00 in room 4B\n"
                "- Thursday, March 5: team meeting at 9:00 in room 4B\n",
    "code-edit": f"Here is a Python file:\n\n```python\n{CODE}```\n\n"
                 "Rewrite the whole file with type hints added to both functions. Output only the code.",
    "json": f"{DOC}\n\nCopy the text above into a JSON object with one key \"text\" whose value is the text.",
}


PEOPLE = [("Ana Silva", "Finance", "March 3, 2021", "Tom Baker"),
          ("Wei Chen", "Research", "July 19, 2018", "Priya Nair"),
          ("Omar Haddad", "Sales", "January 8, 2022", "Lena Vogel"),
          ("Grace Kim", "Legal", "October 30, 2019", "Tom Baker"),
          ("Luis Ortega", "Research", "May 14, 2020", "Priya Nair"),
          ("Emma Novak", "Support", "June 2, 2023", "Ravi Patel"),
          ("Yusuf Demir", "Finance", "August 21, 2017", "Tom Baker"),
          ("Sara Lind", "Sales", "February 9, 2024", "Lena Vogel")]


def repeated_prompts() -> dict[str, str]:
    """The same extraction task over many similar documents, then a growing
    multi-turn-style request: outputs repeat across requests, which the
    suffix proposer's global tree learns from."""
    prompts = {}
    for name, dept, start, manager in PEOPLE:
        doc = (f"Staff note. {name} joined the {dept} department on {start}. {name.split()[0]} reports "
               f"to {manager}. The badge for {name} was issued on the first day.")
        prompts[f"extract-{name.split()[0].lower()}"] = (
            f"{doc}\n\nExtract the employee record as JSON with the keys \"name\", \"department\", "
            f"\"start_date\" and \"manager\". Output only the JSON.")
    history = ""
    for i, (name, dept, _, _) in enumerate(PEOPLE[:4]):
        history += f"- {name} ({dept})\n"
        prompts[f"turn-{i}"] = (f"Here is the staff list so far:\n{history}\nRepeat the whole list in the "
                                f"same format and add one new person at the end.")
    return prompts


WORKLOADS = {"overlap": lambda: PROMPTS, "repeated": repeated_prompts}


def chat_ids(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=False)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


DRAFT_LENGTH = {"fixed": pb.DRAFT_LENGTH_FIXED, "adaptive": pb.DRAFT_LENGTH_ADAPTIVE}


def label(method: str, draft_length: str) -> str:
    return method if method in ("none", "naive") or draft_length == "fixed" else f"{method}+adaptive"


def run_single(addr: str, prompts: dict[str, list[int]], method: str, k: int, max_tokens: int,
               draft_length: str = "fixed") -> dict:
    rows = {}
    for name, ids in prompts.items():
        gen = stream(addr, make_request(ids, max_tokens=max_tokens, method=method, k=k,
                                        draft_length=DRAFT_LENGTH[draft_length]))
        s = gen.stats
        rows[name] = {"tokens": s.output_tokens, "wall_s": s.wall_s, "tok_s": s.output_tokens / s.wall_s,
                      "rounds": s.rounds, "draft_tokens": s.draft_tokens,
                      "mean_accepted_length": s.mean_accepted_length,
                      "acceptance_by_position": list(s.acceptance_by_position),
                      "propose_s": s.propose_s, "verify_s": s.verify_s, "network_s": s.network_s,
                      "feature_bytes": s.feature_bytes, "token_ids": gen.token_ids}
    tokens = sum(r["tokens"] for r in rows.values())
    wall = sum(r["wall_s"] for r in rows.values())
    rounds = sum(r["rounds"] for r in rows.values())
    return {"method": label(method, draft_length), "k": k, "per_prompt": rows, "tokens": tokens, "wall_s": wall,
            "tok_s": tokens / wall, "mean_accepted_length": tokens / rounds,
            "propose_s": sum(r["propose_s"] for r in rows.values()),
            "verify_s": sum(r["verify_s"] for r in rows.values()),
            "network_s": sum(r["network_s"] for r in rows.values()), "rounds": rounds,
            "feature_bytes": sum(r["feature_bytes"] for r in rows.values()),
            "draft_tokens": sum(r["draft_tokens"] for r in rows.values())}


def run_concurrent(addr: str, prompt_list: list[list[int]], streams: int, method: str, k: int,
                   max_tokens: int, draft_length: str = "fixed") -> dict:
    jobs = [prompt_list[i % len(prompt_list)] for i in range(streams)]
    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        gens = list(pool.map(lambda ids: stream(addr, make_request(
            ids, max_tokens=max_tokens, method=method, k=k, draft_length=DRAFT_LENGTH[draft_length])), jobs))
    wall = time.perf_counter() - start
    tokens = sum(len(g.token_ids) for g in gens)
    return {"streams": streams, "method": label(method, draft_length), "k": k, "tokens": tokens, "wall_s": wall,
            "tok_s": tokens / wall, "token_ids": [g.token_ids for g in gens],
            "mean_accepted_length": statistics.mean(g.stats.mean_accepted_length for g in gens)}


def run_transformers(model: str, prompts: dict[str, list[int]], max_tokens: int, dtype: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    src = resolve_model(model)
    hf = AutoModelForCausalLM.from_pretrained(src.path, dtype=getattr(torch, dtype), **src.hf_kwargs()).eval()
    tokens, wall, outs = 0, 0.0, {}
    with torch.inference_mode():
        for name, ids in prompts.items():
            x = torch.tensor([ids])
            start = time.perf_counter()
            out = hf.generate(x, max_new_tokens=max_tokens, do_sample=False,
                              attention_mask=torch.ones_like(x), pad_token_id=0)
            wall += time.perf_counter() - start
            outs[name] = out[0, len(ids):].tolist()
            tokens += len(outs[name])
    return {"method": "transformers.generate", "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "token_ids": outs}


def variants(methods: list[str], policies: list[str]) -> list[tuple[str, str]]:
    """(method, draft-length policy) pairs; plain and naive have no drafts to trim."""
    out = []
    for m in methods:
        out += [(m, "fixed")] if m in ("none", "naive") else [(m, p) for p in policies]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=default_model())
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--engine", default="auto", choices=["auto", "hf"])
    ap.add_argument("--workload", default="overlap", choices=sorted(WORKLOADS),
                    help="overlap: rewrite/continue/extract prompts; repeated: similar requests in sequence")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--methods", default="none,naive,ngram,suffix,hybrid")
    ap.add_argument("--concurrency", default="1,8,32", help="stream counts for the aggregate table ('' skips)")
    ap.add_argument("--concurrency-max-tokens", type=int, default=160,
                    help="tokens per stream in the concurrency table (long enough that decoding, not prefill, "
                         "dominates)")
    ap.add_argument("--draft-lengths", default="fixed,adaptive",
                    help="draft-length policies to run for the speculative methods")
    ap.add_argument("--max-cached-requests", type=int, default=None,
                    help="the proposers' global cache of finished outputs (suffix, hybrid). Default 0 for the "
                         "overlap workload: every variant runs the same prompts, and with a cache the variants "
                         "after the first suffix-family one would copy its identical outputs; 1000 for the "
                         "repeated workload, whose point is that cache (then name one suffix-family variant)")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--gemm", default="auto", help="the scorer's --gemm (auto: the selector's choice)")
    ap.add_argument("--out", default="bench_results/e2e.json")
    args = ap.parse_args()

    tokenizer = load_tokenizer(resolve_model(args.model))
    prompts = {name: chat_ids(tokenizer, text) for name, text in WORKLOADS[args.workload]().items()}
    methods = [m for m in args.methods.split(",") if m]
    policies = [p for p in args.draft_lengths.split(",") if p]
    if not policies or set(policies) - set(DRAFT_LENGTH):
        raise SystemExit(f"--draft-lengths: choose from {sorted(DRAFT_LENGTH)}")
    cached = args.max_cached_requests
    if cached is None:
        cached = 1000 if args.workload == "repeated" else 0
    suffix_family = [v for v in variants(methods, policies) if v[0] in SUFFIX_METHODS]
    if cached > 0 and len(suffix_family) > 1:
        raise SystemExit(f"--max-cached-requests {cached}: with a global cache only one suffix-family variant may "
                         f"run (it would copy the identical outputs of the others); got "
                         f"{', '.join(label(*v) for v in suffix_family)} (choose one with --methods and "
                         f"--draft-lengths, or --max-cached-requests 0)")
    result = {"gemm": args.gemm, "model": args.model, "workload": args.workload, "dtype": args.dtype,
              "max_tokens": args.max_tokens,
              "k": args.k, "machine": platform.processor() or platform.machine(), "max_cached_requests": cached,
              "single": [], "concurrent": []}
    log_dir = tempfile.mkdtemp(prefix="specdec-bench-")
    print(f"starting the stack on {args.model} ({args.dtype}); logs in {log_dir}", file=sys.stderr)
    with Stack(model=args.model, dtype=args.dtype, engine=args.engine, log_dir=log_dir,
               methods="naive,ngram,suffix,hybrid",
               extra_proposer_args=["--max-cached-requests", str(cached)],
               extra_scorer_args=["--gemm", args.gemm]) as stack:
        addr = stack.gateway_addr
        stream(addr, make_request(next(iter(prompts.values())), max_tokens=8, method="none"))  # warm up
        for method, policy in variants(methods, policies):
            k = 0 if method == "none" else args.k
            print(f"  single stream: {label(method, policy)} k={k}", file=sys.stderr)
            result["single"].append(run_single(addr, prompts, method, k, args.max_tokens, policy))
        for n in [int(c) for c in args.concurrency.split(",") if c]:
            for method, policy in variants(["none", "ngram"], policies):
                k = 0 if method == "none" else args.k
                print(f"  {n} concurrent streams: {label(method, policy)}", file=sys.stderr)
                result["concurrent"].append(run_concurrent(addr, list(prompts.values()), n, method, k,
                                                           args.concurrency_max_tokens, policy))
    if not args.no_transformers:
        print("  transformers generate", file=sys.stderr)
        result["transformers"] = run_transformers(args.model, prompts, args.max_tokens, args.dtype)

    plain = next(r for r in result["single"] if r["method"] == "none")
    for r in result["single"]:
        r["speedup_vs_plain"] = r["tok_s"] / plain["tok_s"]
        r["identical_to_plain"] = all(r["per_prompt"][n]["token_ids"] == plain["per_prompt"][n]["token_ids"]
                                      for n in prompts)
    print(f"\nSingle stream, workload {args.workload}: {len(prompts)} prompts x {args.max_tokens} tokens, "
          f"{args.model} ({args.dtype})")
    print(f"{'method':<22}{'k':>3}{'tok/s':>9}{'speedup':>9}{'mean acc len':>14}{'propose s':>11}"
          f"{'verify s':>10}{'network s':>11}{'identical':>11}")
    for r in result["single"]:
        print(f"{r['method']:<22}{r['k']:>3}{r['tok_s']:>9.2f}{r['speedup_vs_plain']:>8.2f}x"
              f"{r['mean_accepted_length']:>14.2f}{r['propose_s']:>11.3f}{r['verify_s']:>10.3f}"
              f"{r['network_s']:>11.3f}{str(r['identical_to_plain']):>11}")
    if "transformers" in result:
        t = result["transformers"]
        t["identical_to_plain"] = all(t["token_ids"][n] == plain["per_prompt"][n]["token_ids"] for n in prompts)
        t["plain_over_transformers"] = plain["tok_s"] / t["tok_s"]
        print(f"{'transformers.generate':<22}{'':>3}{t['tok_s']:>9.2f}{t['tok_s'] / plain['tok_s']:>8.2f}x"
              f"{'':>14}{'':>11}{'':>10}{'':>11}{str(t['identical_to_plain']):>11}")
        print(f"our plain decoding / transformers generate = {t['plain_over_transformers']:.2f}x")
    if result["concurrent"]:
        print(f"\nAggregate throughput, {args.concurrency_max_tokens} tokens per stream")
        print(f"{'streams':>8}{'method':>16}{'tok/s':>10}{'vs plain':>10}{'mean acc len':>14}{'identical':>11}")
        by = {(r["streams"], r["method"]): r for r in result["concurrent"]}
        for r in result["concurrent"]:
            p = by[(r["streams"], "none")]
            r["identical_to_plain"] = r["token_ids"] == p["token_ids"]
            r["speedup_vs_plain"] = r["tok_s"] / p["tok_s"]
            print(f"{r['streams']:>8}{r['method']:>16}{r['tok_s']:>10.2f}{r['speedup_vs_plain']:>9.2f}x"
                  f"{r['mean_accepted_length']:>14.2f}{str(r['identical_to_plain']):>11}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
