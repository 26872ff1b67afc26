"""Model drafts against copy drafts, end to end (real processes, real gRPC):
plain decoding (none), ngram, suffix, draft and draft_hybrid (fixed length,
and each also with the adaptive length, the gateway's default, that plans
by the draft's own confidence or, for copies, by their acceptance so far
and decodes plainly where they do not pay) on open-ended chat prompts and on bench_e2e's overlap
prompts, single stream and --streams concurrent streams; ms per draft step
and per verify; transformers assisted generation
(``generate(assistant_model=<same draft>)``) and, given --vllm-python, vLLM
draft-model speculation with the same draft and vLLM's EAGLE-3 with the same
head (or what vLLM said when it refused one), in the same run. Every
speculative output is checked token for token against plain decoding.
Writes JSON and a PNG chart (needs the ``bench`` extra: matplotlib).

    flock /tmp/specdec-bench.lock python benchmarks/bench_draft.py [--draft DIR] [--eagle3 HEAD] \\
        [--model M] [--k 5] [--max-tokens 96] [--streams 8] [--overlap ahead] [--draft-threads N] \\
        [--repeats 3] [--vllm-python PY] [--out bench_results/draft.json]

Without --draft and --eagle3 only plain decoding and the copy methods
run (fixed and adaptive draft length).

--repeats N runs the single-stream rows N times, all methods in turns each
time (on a shared 2-core machine adjacent runs differ by 10 % and more):
each row reports its median run and lists every run's tokens/s; the mixed
set adds up each method's median runs.

The draft must share the target's tokenizer (e.g. made by `specdec distill`).
With --eagle3 (an EAGLE-3 head for the target, e.g. `specdec distill --kind
eagle3`) the eagle3 method runs too, and its rows give the target features
relayed per round and per prompt token. Either of --draft and --eagle3 may
be left out.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_e2e import PROMPTS as OVERLAP_PROMPTS
from bench_e2e import chat_ids, run_concurrent, run_single

from specdec.engine.config import GEMM_CHOICES
from specdec.launcher import Stack
from specdec.limits import COLOCATED_DRAFT_THREADS, HEAD_PROJECTION_DTYPES
from specdec.models import default_model, load_tokenizer, resolve_model
from specdec.proposer_svc.registry import MODEL_METHODS

CHAT_PROMPTS = {
    "story": "Write a short story about a fox who learns to share.",
    "explain": "Explain why the sky is blue in simple words.",
    "tips": "Give me five tips for sleeping better.",
    "poem": "Write a poem about the sea at night.",
    "email": "Write a friendly email inviting my team to a picnic on Saturday.",
    "recipe": "How do I make a simple tomato soup?",
}
#: single-stream runs: (method, draft length)
SINGLE = [("none", "fixed"), ("ngram", "fixed"), ("ngram", "adaptive"), ("suffix", "fixed"), ("suffix", "adaptive"),
          ("draft", "fixed"), ("draft", "adaptive"), ("draft_hybrid", "fixed"), ("draft_hybrid", "adaptive")]
#: --streams runs: (method, draft length)
CONCURRENT = [("none", "fixed"), ("ngram", "fixed"), ("ngram", "adaptive"), ("draft", "fixed"), ("draft", "adaptive"),
              ("draft_hybrid", "fixed"), ("draft_hybrid", "adaptive")]
#: with --eagle3
EAGLE3_SINGLE = [("eagle3", "fixed"), ("eagle3", "adaptive")]
VLLM_RUNNER = Path(__file__).with_name("vllm_draft.py")
#: a peer's row -> specdec's single-stream row of the same method (fixed draft length, as the peers draft)
PEER_METHODS = {"hf_plain": "chat/none", "hf_assisted": "chat/draft", "vllm_plain": "chat/none",
                "vllm_draft_model": "chat/draft", "vllm_eagle3": "chat/eagle3"}


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")),
                platform.processor())


def run_hf_assisted(target: str, draft: str, prompts: dict[str, list[int]], k: int, max_tokens: int) -> dict:
    """transformers greedy generate with and without assistant_model=draft."""
    import torch
    from transformers import AutoModelForCausalLM

    src = resolve_model(target)
    model = AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.float32, **src.hf_kwargs()).eval()
    assistant = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
    assistant.generation_config.num_assistant_tokens = k
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    out = {}
    for name, kwargs in (("hf_plain", {}), ("hf_assisted", {"assistant_model": assistant})):
        tokens, wall = 0, 0.0
        for ids in prompts.values():
            x = torch.tensor([ids])
            start = time.perf_counter()
            with torch.inference_mode():
                y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
                                   pad_token_id=model.generation_config.eos_token_id, **kwargs)
            wall += time.perf_counter() - start
            tokens += y.shape[1] - len(ids)
        out[name] = {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall}
    return out


def run_vllm(python: str, target: str, draft: str | None, eagle3: str | None, prompts: dict[str, list[int]], k: int,
             max_tokens: int) -> dict:
    """vLLM plain, draft-model and EAGLE-3 speculation (those given), in
    vLLM's own interpreter (benchmarks/vllm_draft.py); {"error": ...} when it
    cannot run at all, a method's {"error": ...} when vLLM refused that one."""
    job = {"target": target, "draft": draft, "eagle3": eagle3, "prompts": list(prompts.values()), "k": k,
           "max_tokens": max_tokens}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    # not from the checkout: vLLM imports packages (e.g. `kernels`) that its top-level folders would shadow
    done = subprocess.run([python, str(VLLM_RUNNER.resolve()), f.name], capture_output=True, text=True,
                          cwd=tempfile.gettempdir())
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"rc {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def proposer_compute(stack: Stack) -> tuple[float, float]:
    """Seconds the stack's proposer processes spent handling Propose
    messages so far, and how many (``specdec_proposer_batch_seconds``)."""
    metrics = [service.metrics() for service in stack.by_name("proposer")]
    return (sum(m.get("specdec_proposer_batch_seconds_sum", 0.0) for m in metrics),
            sum(m.get("specdec_proposer_batch_seconds_count", 0.0) for m in metrics))


def timings(r: dict) -> dict:
    """ms per draft step (one draft token), per propose call (the gateway's
    view: gRPC included) and per verify; the proposer's own compute per
    call (its batch_seconds metric: the servicer and the drafting, no
    network); target features relayed per round."""
    rounds = max(r["rounds"], 1)
    calls = r.get("proposer_calls", 0)
    return {"ms_per_draft_step": 1000 * r["propose_s"] / r["draft_tokens"] if r["draft_tokens"] else None,
            "ms_per_propose": 1000 * r["propose_s"] / rounds, "ms_per_verify": 1000 * r["verify_s"] / rounds,
            "ms_proposer_compute_per_call": 1000 * r["proposer_compute_s"] / calls if calls else None,
            "feature_bytes_per_round": r.get("feature_bytes", 0) / rounds}


def mixed(results: dict) -> dict:
    """Tokens/s of each single-stream method over both workloads together."""
    out = {}
    for key, r in results["single"].items():
        wl, method = key.split("/", 1)
        acc = out.setdefault(method, {"tokens": 0, "wall_s": 0.0})
        acc["tokens"] += r["tokens"]
        acc["wall_s"] += r["wall_s"]
    return {m: {**v, "tok_s": v["tokens"] / v["wall_s"]} for m, v in out.items()}


def chart(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = {"chat, 1 stream": {k.split("/", 1)[1]: v["tok_s"] for k, v in results["single"].items()
                                 if k.startswith("chat/")},
              "overlap, 1 stream": {k.split("/", 1)[1]: v["tok_s"] for k, v in results["single"].items()
                                    if k.startswith("overlap/")},
              f"chat, {results['streams']} streams": {k.split("/", 1)[1]: v["tok_s"]
                                                      for k, v in results["concurrent"].items()
                                                      if k.startswith("chat/")},
              f"overlap, {results['streams']} streams": {k.split("/", 1)[1]: v["tok_s"]
                                                         for k, v in results["concurrent"].items()
                                                         if k.startswith("overlap/")}}
    for name, r in results.get("hf", {}).items():
        groups["chat, 1 stream"][name] = r["tok_s"]
    for name, r in results.get("vllm", {}).items():
        if isinstance(r, dict) and "tok_s" in r:
            groups["chat, 1 stream"][name] = r["tok_s"]
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4.5), sharey=False)
    for ax, (title, bars) in zip(axes, groups.items()):
        ax.bar(range(len(bars)), list(bars.values()), color="#4477aa")
        ax.set_xticks(range(len(bars)), list(bars), rotation=60, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("tokens/s")
    drafts = " + ".join(f"{name} {Path(results[name]).name}" for name in ("draft", "eagle3") if results.get(name))
    fig.suptitle(f"{Path(results['model']).name} + {drafts}, k={results['k']}, "
                 f"{results['cpu']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=default_model())
    ap.add_argument("--draft", default=None, help="draft model directory (shares the target's tokenizer)")
    ap.add_argument("--eagle3", default=None, help="an EAGLE-3 head directory for the target: adds eagle3 rows")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--streams", type=int, default=8, help="concurrent streams (0: single stream only)")
    ap.add_argument("--skip-hf", action="store_true", help="leave out transformers assisted generation")
    ap.add_argument("--draft-dtype", choices=list(HEAD_PROJECTION_DTYPES), default=None,
                    help="the draft model's dtype (default: float32; float32 or bfloat16) and the eagle3 head's "
                         "projection weights (default: limits.HEAD_PROJECTION_DTYPE)")
    ap.add_argument("--draft-threads", type=int, default=COLOCATED_DRAFT_THREADS,
                    help="the draft model's CPU threads (specdec proposer --draft-threads; default: as specdec "
                         "serve's, limits.COLOCATED_DRAFT_THREADS)")
    ap.add_argument("--decode-ahead", choices=["on", "off"], default="on",
                    help="the scorer's decode-ahead (specdec scorer --decode-ahead)")
    ap.add_argument("--overlap", choices=["off", "on", "always", "ahead"], default="on",
                    help="the gateway's overlapped rounds (specdec gateway --overlap; ahead: drafting ahead)")
    ap.add_argument("--vllm-python", default=None, help="python of a virtualenv with vLLM: compare with its "
                                                        "draft-model and EAGLE-3 speculation (target given as "
                                                        "--vllm-target)")
    ap.add_argument("--vllm-target", default=None, help="the target as vLLM loads it (default: --model)")
    ap.add_argument("--scorer-gemm", default="auto", choices=list(GEMM_CHOICES),
                    help="the scorer's --gemm (auto: the selector's choice), e.g. to compare a path as before")
    ap.add_argument("--repeats", type=int, default=1,
                    help="single-stream rows: runs of all methods in turns; each row reports its median run")
    ap.add_argument("--out", default="bench_results/draft.json")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    single = [(m, length) for m, length in SINGLE if args.draft or m not in MODEL_METHODS]
    single += EAGLE3_SINGLE if args.eagle3 else []
    concurrent = [(m, length) for m, length in CONCURRENT if args.draft or m not in MODEL_METHODS]
    concurrent += EAGLE3_SINGLE if args.eagle3 else []

    tok = load_tokenizer(resolve_model(args.model))
    encode = (lambda t: chat_ids(tok, t)) if getattr(tok, "chat_template", None) else \
        (lambda t: list(tok(t)["input_ids"]))
    workloads = {"chat": {n: encode(t) for n, t in CHAT_PROMPTS.items()},
                 "overlap": {n: encode(t) for n, t in OVERLAP_PROMPTS.items()}}
    results: dict = {"cpu": cpu_model(), "model": args.model, "draft": args.draft, "eagle3": args.eagle3, "k": args.k,
                     "decode_ahead": args.decode_ahead, "overlap": args.overlap, "scorer_gemm": args.scorer_gemm,
                     "draft_dtype": args.draft_dtype or "float32", "draft_threads": args.draft_threads,
                     "max_tokens": args.max_tokens, "streams": args.streams, "single": {}, "concurrent": {}}
    print(f"CPU: {results['cpu']}\ntarget {args.model}, draft {args.draft}, eagle3 {args.eagle3}, k={args.k}, "
          f"{args.max_tokens} tokens, scorer gemm {args.scorer_gemm}", flush=True)
    methods = ",".join(dict.fromkeys(m for m, _ in single if m != "none"))
    # no global cache of finished outputs: every variant runs the same prompts, and the suffix-family ones after
    # the first would copy its identical outputs
    with Stack(model=args.model, methods=methods, draft_model=args.draft, eagle3=args.eagle3,
               draft_dtype=args.draft_dtype, draft_threads=args.draft_threads,
               extra_proposer_args=["--max-cached-requests", "0"],
               extra_scorer_args=["--decode-ahead", args.decode_ahead, "--gemm", args.scorer_gemm],
               extra_gateway_args=["--overlap", args.overlap], metrics=True,
               log_dir=tempfile.mkdtemp(prefix="bench-draft-")) as stack:
        runs: dict[str, list[dict]] = {}
        for repeat in range(args.repeats):
            for wl, prompts in workloads.items():
                plain = None
                for method, length in single:
                    before = proposer_compute(stack)
                    r = run_single(stack.gateway_addr, prompts, method, args.k, args.max_tokens, length)
                    r["proposer_compute_s"], r["proposer_calls"] = (
                        after - start for after, start in zip(proposer_compute(stack), before))
                    ids = {n: p["token_ids"] for n, p in r["per_prompt"].items()}
                    plain = plain or ids
                    r["identical_to_plain"] = ids == plain
                    r.update(timings(r))
                    r["prompt_tokens"] = sum(map(len, prompts.values()))
                    runs.setdefault(f"{wl}/{r['method']}", []).append(r)
                    print(f"  run {repeat + 1}/{args.repeats} {wl}/{r['method']}: {r['tok_s']:.1f} tok/s", flush=True)
        for key, rows in runs.items():
            ordered = sorted(rows, key=lambda r: r["tok_s"])
            results["single"][key] = {**ordered[len(ordered) // 2], "runs_tok_s": [r["tok_s"] for r in rows],
                                      "identical_to_plain": all(r["identical_to_plain"] for r in rows)}
        for wl, prompts in workloads.items():
            for method, length in concurrent if args.streams > 0 else ():
                r = run_concurrent(stack.gateway_addr, list(prompts.values()), args.streams, method, args.k,
                                   args.max_tokens, length)
                results["concurrent"][f"{wl}/{r['method']}"] = {k: v for k, v in r.items() if k != "token_ids"}
    results["mixed"] = mixed(results)
    if args.draft and not args.skip_hf:
        results["hf"] = run_hf_assisted(args.model, args.draft, workloads["chat"], args.k, args.max_tokens)
    if (args.draft or args.eagle3) and args.vllm_python:
        results["vllm"] = run_vllm(args.vllm_python, args.vllm_target or args.model, args.draft, args.eagle3,
                                   workloads["chat"], args.k, args.max_tokens)
    report(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for r in results["single"].values():
        for p in r["per_prompt"].values():
            p.pop("token_ids")
    out.write_text(json.dumps(results, indent=2))
    try:
        chart(results, out.with_suffix(".png"))
        print(f"wrote {out} and {out.with_suffix('.png')}")
    except ImportError:
        print(f"wrote {out} (no chart: install the bench extra, matplotlib)", file=sys.stderr)


def report(results: dict) -> None:
    print(f"\n{'workload/method':26} {'tok/s':>7} {'x plain':>7} {'acc len':>7} {'ms/draft':>8} {'ms/prop':>7} "
          f"{'ms/p-call':>9} {'ms/verify':>9} {'feat B/round':>12} {'feat B/prompt tok':>17} same")
    print("(ms/prop: the gateway's wait for drafts per round; ms/p-call: the proposer's own handling time per call)")
    for key, r in results["single"].items():
        base = results["single"][key.split("/")[0] + "/none"]["tok_s"]
        step = f"{r['ms_per_draft_step']:8.1f}" if r["ms_per_draft_step"] is not None else f"{'-':>8}"
        compute = r.get("ms_proposer_compute_per_call")
        compute_col = f"{compute:9.1f}" if compute is not None else f"{'-':>9}"
        # feature bytes: the prompt's rows on the first touch, then each round's output rows
        per_prompt_tok = r.get("feature_bytes", 0) / max(r["prompt_tokens"] + r["tokens"], 1)
        print(f"{key:26} {r['tok_s']:7.1f} {r['tok_s'] / base:7.2f} {r['mean_accepted_length']:7.2f} {step} "
              f"{r['ms_per_propose']:7.1f} {compute_col} {r['ms_per_verify']:9.1f} "
              f"{r['feature_bytes_per_round']:12,.0f} {per_prompt_tok:17,.0f} {r['identical_to_plain']}"
              + (f"  runs {' '.join(f'{t:.1f}' for t in r['runs_tok_s'])}" if len(r["runs_tok_s"]) > 1 else ""))
    print("\nboth workloads together (mixed set):")
    for method, r in results["mixed"].items():
        print(f"  {method:24} {r['tok_s']:7.1f} tok/s")
    if results["concurrent"]:
        print(f"\n{results['streams']} concurrent streams:")
    for key, r in results["concurrent"].items():
        print(f"  {key:24} {r['tok_s']:7.1f} tok/s  mean acc len {r['mean_accepted_length']:.2f}")
    peers = {**results.get("hf", {}), **results.get("vllm", {})}
    if peers:
        print("\npeers, the same chat prompts, single stream (x: specdec's tok/s of the same method over the peer's):")
    for name, r in peers.items():
        if isinstance(r, dict) and "tok_s" in r:
            ours = results["single"].get(PEER_METHODS.get(name, ""))
            versus = f"  specdec {PEER_METHODS[name]} {ours['tok_s'] / r['tok_s']:.2f}x" if ours else ""
            accepted = f"  mean acc len {r['mean_accepted_length']:.2f}" if "mean_accepted_length" in r else ""
            print(f"  chat/{name:19} {r['tok_s']:7.1f} tok/s{accepted}{versus}")
        elif isinstance(r, dict) and "error" in r:
            print(f"  chat/{name:19} refused: {r['error']}")
    if "error" in results.get("vllm", {}):
        print(f"  vllm: {results['vllm']['error']}")


if __name__ == "__main__":
    main()
