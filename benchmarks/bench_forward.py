"""Times LlamaEngine forward passes the way the scorer runs them, and plain
greedy decoding against transformers ``generate``.

Forward grid: for each (dtype, GEMM path), batch B in {1, 8, 32} sequences
with a cached prefix of 64-128 tokens each, and q in {1, 2, 4, 8, 16} new
tokens per sequence (q = 1 is plain decoding, q = k + 1 verifies k drafts),
logits for all B * q rows. The "x q=1" column is the cost of verifying q
tokens relative to decoding one: speculation pays when it stays near 1.

Decode: single-stream greedy decoding of --decode-tokens tokens (prefill
included, stopping early only if transformers emits EOS) with each engine
configuration and with transformers ``generate`` in float32 and bfloat16
(on every CPU: the simd path reads bfloat16 weights without native
bfloat16 instructions; oneDNN emulates them where the CPU lacks them); tokens/s, the ratio to
transformers in the same dtype, the share of the memory-bandwidth limit (a
decode step reads every projection weight once: limit = measured copy
bandwidth / weight bytes; the bandwidth is the median of measurements at
the start, after each dtype's rows and at the end, as it moves within a
run), the cost of verifying 5 drafts (6 rows) relative
to one decode step, and whether the tokens are the same.

Stack: the same greedy decoding through the whole local stack (scorer,
proposer and gateway processes, gRPC, method "none": plain decoding) against
the engine alone in this process, same dtype, prompt and token count, when
the scorer would run on as many threads as --threads (its default); goal:
within 5%. The engine alone runs in turns with the stack (one engine run,
one stack run, --decode-reps times) and the ratio is of the fastest of each:
this VM's speed drifts by a fifth between minutes, so an engine row timed
before the stack started is no baseline for it. Beside it, the median (and
range) of the ratios of each stack run to the engine run just before it,
which follows that drift closer. With it, the CPU ms each
process spent per token (client, gateway, proposer, scorer; psutil) beside
the engine alone's: on a 2-core machine every ms of glue outside the
forward is taken from the GEMM threads.

Also printed: the CPU model, the measured bandwidth, and for each engine the
GEMM path the selector chose (engine.gemm_select: one path for every
projection shape, each path's invariance verdict and timings).

    python benchmarks/bench_forward.py                       # SmolLM2, full grid
    python benchmarks/bench_forward.py --batches 1,8 --queries 1,2,6 --reps 2

Prints tables and writes JSON to --out (default bench_results/forward.json).
Wall times are the minimum over --reps runs (other processes on a shared
machine only ever add time); CPU is the process CPU time of that run (all
threads).
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from specdec.client import make_request, stream
from specdec.engine.base import ForwardItem
from specdec.engine.gemm_select import GemmRefused, cpu_model, native_bf16, set_torch_threads, summary
from specdec.engine.kv_pool import default_num_threads
from specdec.engine.llama import Checkpoint, LlamaEngine
from specdec.launcher import Stack
from specdec.limits import MAX_DECODE_STEPS
from specdec.models import default_model, load_tokenizer, resolve_model

PROMPT = ("The old lighthouse keeper climbed the stairs every evening to light the lamp. One night, "
          "a storm rolled in from the sea and")


def copy_bandwidth_gbs(mib: int = 512, reps: int = 5) -> float:
    """GB/s of a large tensor copy (bytes read + bytes written), fastest of reps."""
    src = torch.ones(mib << 18)  # float32, mib MiB
    dst = torch.empty_like(src)
    best = min(timed(lambda: dst.copy_(src))[0] for _ in range(reps))
    return 2 * src.nbytes / best / 1e9


def with_bandwidth(decode_rows: list[dict], bandwidth_gbs: float) -> None:
    """Sets the bandwidth limit of each engine row (tok/s: bandwidth_gbs over
    the weight bytes one decode step reads, its ``weight_bytes``: fewer than
    the dtype's where simd-gguf reads a GGUF model's blocks) and each
    engine's and transformers' share of it (transformers reads the dtype's
    dense weights: the ``dense_weight_bytes`` of the first engine row of its
    dtype)."""
    limits: dict[str, float] = {}
    for r in decode_rows:
        if "weight_bytes" in r:
            r["bandwidth_limit_tok_s"] = bandwidth_gbs * 1e9 / r["weight_bytes"]
            limits.setdefault(r["dtype"], bandwidth_gbs * 1e9 / r.get("dense_weight_bytes", r["weight_bytes"]))
    for r in decode_rows:
        limit = r.get("bandwidth_limit_tok_s") or (limits.get(r["dtype"]) if r["engine"] == "transformers generate"
                                                   else None)
        if limit:
            r["pct_of_bandwidth_limit"] = 100 * r["tokens_per_s"] / limit


def decode_weight_bytes(engine: LlamaEngine, dense: bool = False) -> int:
    """Bytes of every projection weight one decode step reads (layers + LM
    head): a GGUF model's blocks where its GEMM path reads them
    (``Linear.nbytes``); dense: the engine dtype's, whatever the path."""
    linears = [engine.lm_head] + [lin for layer in engine.layers
                                  for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    if dense:
        return sum(lin.out_features * lin.in_features for lin in linears) * engine.dtype.itemsize
    return sum(lin.nbytes for lin in linears)


def timed(fn) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of fn()."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def bench_forward(engine: LlamaEngine, batch: int, queries: list[int], reps: int, seed: int) -> list[dict]:
    """Forward times for batch sequences with 64-128 cached tokens, q new tokens each."""
    rng = np.random.default_rng(seed)
    vocab = engine.facts.vocab_size
    seqs = [f"b{batch}-{i}" for i in range(batch)]
    prefixes = rng.integers(64, 129, size=batch)
    for seq, n in zip(seqs, prefixes):
        engine.ensure_capacity(seq, int(n))
    engine.forward([ForwardItem(s, rng.integers(0, vocab, n).astype(np.int32), 0) for s, n in zip(seqs, prefixes)])
    rows = []
    for q in queries:
        items = [ForwardItem(s, rng.integers(0, vocab, q).astype(np.int32), q) for s in seqs]

        def once():
            engine.forward(items)

        samples = []
        for _ in range(reps + 1):  # the first run warms up
            for seq, n in zip(seqs, prefixes):
                engine.truncate(seq, int(n))
                engine.ensure_capacity(seq, int(n) + q)
            samples.append(timed(once))
        wall, cpu = min(samples[1:])
        rows.append({"batch": batch, "q": q, "rows": batch * q, "wall_ms": wall * 1e3, "cpu_ms": cpu * 1e3,
                     "median_wall_ms": statistics.median(s[0] for s in samples[1:]) * 1e3,
                     "tokens_per_s": batch * q / wall})
    for seq in seqs:
        engine.release(seq)
    base = {r["batch"]: r["wall_ms"] for r in rows if r["q"] == 1}
    for r in rows:
        r["vs_q1"] = r["wall_ms"] / base[r["batch"]] if r["batch"] in base else None
    return rows


def engine_greedy(engine: LlamaEngine, prompt: list[int], n: int) -> list[int]:
    seq = "decode"
    engine.ensure_capacity(seq, len(prompt) + n)
    out = []
    logits = engine.forward([ForwardItem(seq, np.asarray(prompt, dtype=np.int32), 1)]).logits
    while len(out) < n:
        out.append(int(logits[-1].argmax()))
        if len(out) < n:
            logits = engine.forward([ForwardItem(seq, np.asarray(out[-1:], dtype=np.int32), 1)]).logits
    engine.release(seq)
    return out


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0)
    return out[0, len(prompt):].tolist()


def best_rate(fn, reps: int) -> tuple[float, list[int]]:
    """(tokens/s of the fastest of reps runs, the tokens)."""
    rate, tokens, _ = best_run(fn, reps)
    return rate, tokens


def best_run(fn, reps: int) -> tuple[float, list[int], float]:
    """(tokens/s of the fastest of reps runs, the tokens, this process's CPU
    ms per token over all reps)."""
    tokens = fn()  # warm-up
    runs = [timed(fn) for _ in range(reps)]
    return len(tokens) / min(w for w, _ in runs), tokens, 1e3 * sum(c for _, c in runs) / (reps * len(tokens))


def process_cpu_s(procs: dict) -> dict[str, float]:
    """User + system CPU seconds so far of each psutil process (its threads included)."""
    return {name: sum(proc.cpu_times()[:2]) for name, proc in procs.items()}


def thread_cpu_s(procs: dict) -> dict[tuple[str, int], float]:
    """User + system CPU seconds so far of each thread of each psutil process, by (process name, thread id)."""
    out = {}
    for name, proc in procs.items():
        for t in proc.threads():
            out[(name, t.id)] = t.user_time + t.system_time
    return out


def cpu_per_call(spent: dict[tuple[str, int], float], scorer: str, gemm_threads: int, calls: int) -> dict[str, float]:
    """CPU ms per Verify call of what a stack spends besides the scorer's
    passes: ``spent`` is CPU seconds by (process, thread); the scorer's
    ``gemm_threads`` busiest threads run its passes (its worker and the
    kernels' team), its other threads (gRPC, metrics) and every other
    process count here, a process's threads summed."""
    ranked = sorted((v for (name, _), v in spent.items() if name == scorer), reverse=True)
    out = {f"{scorer} besides its passes": sum(ranked[gemm_threads:])}
    for (name, _), v in spent.items():
        if name != scorer:
            out[name] = out.get(name, 0.0) + v
    return {name: 1e3 * v / max(calls, 1) for name, v in out.items()}


def stack_row(model: str, dtype: str, prompt: list[int], n: int, reps: int, engine_row: dict,
              engine_run: Callable[[], list[int]], threads: int, decode_ahead: str = "on",
              env: dict[str, str] | None = None, decode_steps: int | None = None) -> dict:
    """Plain greedy decoding of n tokens through a local stack (gRPC, method
    "none", EOS ignored, the scorer on ``threads`` threads like the engine
    alone) in turns with the engine alone (engine_run() -> its tokens;
    engine_row: its decode row); with the gateway's per-round split of the
    fastest run: scorer compute, and the rest of the round.
    decode_ahead: the scorer's --decode-ahead; env: variables the stack's
    processes start with (e.g. OpenMP's), this process's own unchanged;
    decode_steps: a fixed count of tokens per Verify call (the gateway's
    --decode-steps with --decode-chunk-ms 0); None: the gateway's defaults
    (as many as its passes take in 50 ms, up to 16)."""
    import psutil

    stats = []
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        stack = Stack(model=model, dtype=dtype, log_dir=tempfile.mkdtemp(),
                      extra_scorer_args=["--threads", str(threads), "--decode-ahead", decode_ahead],
                      extra_gateway_args=[] if decode_steps is None else
                      ["--decode-steps", str(decode_steps), "--decode-chunk-ms", "0"]).start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        calls = []

        def once() -> list[int]:
            request = make_request(prompt, max_tokens=n, method="none")
            request.ignore_eos = True
            gen = stream(stack.gateway_addr, request)
            stats.append(gen.stats)
            calls.append(gen.messages)  # plain decoding: the gateway answers each Verify call with a message
            return list(gen.token_ids)

        procs = {"client": psutil.Process(), **{s.name: psutil.Process(s.proc.pid) for s in stack.services}}
        once()  # warm-up, not counted below
        engine_run()  # the engine's caches were cold while the stack started
        stack_s, engine_s, spent = [], [], dict.fromkeys(procs, 0.0)
        by_thread: dict[tuple[str, int], float] = {}
        for _ in range(reps):  # in turns: both see the same minutes of this machine
            engine_s.append(timed(engine_run)[0])
            # the engine's OpenMP threads spin on after its last region (~4.5 ms on an Intel Xeon): let them
            # stop, or their CPU counts as the client's
            time.sleep(0.02)
            before = process_cpu_s(procs)  # the stack's runs only (this process also ran the engine)
            threads_before = thread_cpu_s(procs)
            started = time.perf_counter()
            tokens = once()
            stack_s.append(time.perf_counter() - started)
            spent = {name: spent[name] + v - before[name] for name, v in process_cpu_s(procs).items()}
            for key, v in thread_cpu_s(procs).items():
                by_thread[key] = by_thread.get(key, 0.0) + v - threads_before.get(key, 0.0)
    finally:
        stack.stop()
    rate, engine_rate = len(tokens) / min(stack_s), len(engine_row["engine_tokens"]) / min(engine_s)
    # each stack run against the engine run just before it: the median of these
    # pairs follows the machine's drift, which the ratio of the two minima does not
    paired = sorted((len(tokens) / s) / (len(engine_row["engine_tokens"]) / e) for e, s in zip(engine_s, stack_s))
    cpu = {name: 1e3 * v / (reps * len(tokens)) for name, v in spent.items()}
    scorer = next(s.name for s in stack.services if s.name.startswith("scorer"))
    per_call = cpu_per_call(by_thread, scorer, threads, sum(calls[1:]))
    agree = next((i for i, (a, b) in enumerate(zip(tokens, engine_row["engine_tokens"])) if a != b), len(tokens))
    best = min(stats[1:] or stats, key=lambda s: s.wall_s)
    rounds = max(best.rounds, 1)
    label = (f"stack, ahead {decode_ahead}, steps {decode_steps or 'auto'}"
             + "".join(f", {k}={v}" for k, v in (env or {}).items()))
    return {"engine": label, "decode_ahead": decode_ahead, "decode_steps": decode_steps, "env": env or {},
            "dtype": dtype,
            "gemm": engine_row["gemm"], "tokens": len(tokens),
            "tokens_per_s": rate, "vs_engine_alone": rate / engine_rate, "engine_in_turns_tok_s": engine_rate,
            "vs_engine_alone_paired": {"median": statistics.median(paired), "low": paired[0], "high": paired[-1]},
            "agree_with_engine": agree, "threads": threads,
            "ms_per_round": 1000 * best.wall_s / rounds, "verify_ms_per_round": 1000 * best.verify_s / rounds,
            "network_ms_per_round": 1000 * best.network_s / rounds,
            "cpu_ms_per_token": cpu, "engine_alone_cpu_ms_per_token": engine_row["cpu_ms_per_token"],
            "verify_calls_per_answer": sum(calls[1:]) / reps, "cpu_ms_per_call_besides_passes": per_call}


def print_forward(label: str, rows: list[dict]) -> None:
    print(f"\n== forward: {label} (wall ms, min of reps; x q=1 = cost relative to one decode step)")
    print(f"{'batch':>5} {'q':>3} {'rows':>5} {'wall ms':>9} {'cpu ms':>9} {'x q=1':>6} {'tok/s':>8}")
    for r in rows:
        print(f"{r['batch']:>5} {r['q']:>3} {r['rows']:>5} {r['wall_ms']:>9.1f} {r['cpu_ms']:>9.1f} "
              f"{r['vs_q1']:>6.2f} {r['tokens_per_s']:>8.1f}")


def bench_config(checkpoint: Checkpoint, dtype: str, gemm: str, args, prompt: list[int],
                 hf_tokens: list[int], hf_rate: float,
                 torch_ops: bool = False) -> tuple[dict, list[dict], Callable[[], list[int]] | None]:
    """(the decode row, the forward rows, the decode run as a callable) of
    one dtype / GEMM path; a path this machine refuses gives a decode row
    saying so, no forward rows and no callable.
    torch_ops: the small steps between GEMMs as torch ops (the engine
    before engine.cpu_ops), not the float32 CPU kernels."""
    batches = [int(b) for b in args.batches.split(",")]
    queries = sorted({1, 6, *(int(q) for q in args.queries.split(","))})
    capacity = max(batches) * (128 + max(queries)) + 1024
    decode: dict = {"engine": "LlamaEngine", "dtype": dtype, "gemm": gemm}
    t0 = time.perf_counter()
    try:
        engine = LlamaEngine(checkpoint, dtype, kv_capacity_tokens=capacity, gemm=gemm, num_threads=args.threads,
                             fuse_small_steps=not torch_ops)
    except GemmRefused as e:
        print(f"\n== {dtype} / {gemm}: refused: {e}")
        return {**decode, "refused": str(e)}, [], None
    report = engine.gemm_report or {}
    print(f"\n== {dtype} / {gemm}: engine built in {time.perf_counter() - t0:.1f} s; KV cache {engine.kv_dtype}; "
          f"GEMM path {engine.gemm} "
          f"for every projection shape ({', '.join(report.get('key', {}).get('shapes', {}))}); "
          f"selection {report.get('select_s', 0.0):.1f} s (0: cached)\n   {summary(report)}")
    rate, tokens, cpu_ms = best_run(lambda: engine_greedy(engine, prompt, len(hf_tokens)), args.decode_reps)
    agree = next((i for i, (a, b) in enumerate(zip(tokens, hf_tokens)) if a != b), len(tokens))
    rows = [r for b in batches for r in bench_forward(engine, b, queries, args.reps, seed=b)]
    for r in rows:
        r.update(dtype=dtype, gemm=engine.gemm)
    verify6 = next(r["vs_q1"] for r in rows if r["batch"] == 1 and r["q"] == 6) if 1 in batches else None
    label = f"{gemm}->{engine.gemm}" if gemm == "auto" else gemm
    decode.update(gemm=label + ("+torch-ops" if torch_ops else ""), kv_dtype=engine.kv_dtype, tokens=len(tokens),
                  tokens_per_s=rate, vs_transformers=rate / hf_rate, weight_bytes=decode_weight_bytes(engine),
                  dense_weight_bytes=decode_weight_bytes(engine, dense=True),
                  verify6_vs_decode=verify6, agree_with_hf=agree,
                  gemm_report=report, engine_tokens=tokens, cpu_ms_per_token=cpu_ms)
    return decode, rows, lambda: engine_greedy(engine, prompt, len(hf_tokens))


def print_decode(rows: list[dict], n: int, reps: int) -> None:
    print(f"\n== single-stream greedy decode (batch 1), up to {n} tokens (prefill included), best of {reps}")
    print(f"{'engine':<22} {'dtype':<9} {'gemm':<13} {'tok/s':>7} {'vs HF':>6} {'% BW lim':>8} "
          f"{'verify6/decode':>14}  first tokens equal to HF's")
    for r in rows:
        if "vs_engine_alone" in r:
            pair = r["vs_engine_alone_paired"]
            print(f"{r['engine']:<22} {r['dtype']:<9} {r['gemm']:<13} {r['tokens_per_s']:>7.1f}   "
                  f"{r['vs_engine_alone']:.3f} x the engine alone in turns ({r['engine_in_turns_tok_s']:.1f} tok/s; "
                  f"goal >= 0.95; median of the {reps} pairs {pair['median']:.3f}, "
                  f"{pair['low']:.3f}-{pair['high']:.3f}); tokens equal to the engine's: "
                  f"{r['agree_with_engine']}/{r['tokens']}; per round {r['ms_per_round']:.1f} ms, of which "
                  f"scorer compute {r['verify_ms_per_round']:.1f}, gRPC and queue {r['network_ms_per_round']:.1f}; "
                  f"CPU ms per token: " + ", ".join(f"{k} {v:.1f}" for k, v in r["cpu_ms_per_token"].items())
                  + f" (the engine alone: {r['engine_alone_cpu_ms_per_token']:.1f}); CPU ms per Verify call "
                  f"({r['verify_calls_per_answer']:.1f} calls an answer) besides the scorer's passes: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_ms_per_call_besides_passes"].items()))
            continue
        if "refused" in r:
            print(f"{r['engine']:<22} {r['dtype']:<9} {r['gemm']:<13} refused: {r['refused']}")
            continue
        pct = f"{r['pct_of_bandwidth_limit']:.0f}%" if "pct_of_bandwidth_limit" in r else "-"
        v6 = f"{r['verify6_vs_decode']:.2f}" if r.get("verify6_vs_decode") else "-"
        print(f"{r['engine']:<22} {r['dtype']:<9} {r['gemm']:<13} {r['tokens_per_s']:>7.1f} "
              f"{r.get('vs_transformers', 1.0):>6.2f} {pct:>8} {v6:>14}  {r['agree_with_hf']}/{r['tokens']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=default_model())
    ap.add_argument("--configs", default="float32:auto,bfloat16:auto",
                    help="dtype:gemm pairs (gemm: auto or a forced path; bfloat16 only where native), "
                         "each optionally :torch-ops (the small steps as torch ops, as before engine.cpu_ops), "
                         "e.g. float32:auto,float32:onednn:torch-ops for the engine before and after its CPU kernels")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--queries", default="1,2,4,6,8,16", help="(1 and 6 always run)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--decode-reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=default_num_threads())
    ap.add_argument("--no-stack", dest="stack", action="store_false",
                    help="skip plain decoding through the whole local stack")
    ap.add_argument("--stack-decode-ahead", default="on,off",
                    help="the whole-stack row's scorer --decode-ahead values, one row each")
    ap.add_argument("--stack-decode-steps", default="auto",
                    help="the whole-stack rows' tokens per Verify call, one row each: auto (the gateway's "
                         "defaults: as many as its passes take in --decode-chunk-ms 50, up to 16) or a fixed "
                         "count (--decode-steps N --decode-chunk-ms 0), e.g. auto,1,4,16")
    ap.add_argument("--stack-env", default="",
                    help="';'-separated environments for more whole-stack rows, each 'K=V,K=V' (e.g. "
                         "'GOMP_SPINCOUNT=20000;GOMP_SPINCOUNT=2000'); the stack's own defaults always run")
    ap.add_argument("--out", default="bench_results/forward.json")
    args = ap.parse_args()
    configs = [(c.split(":") + [""])[:3] for c in args.configs.split(",")]  # dtype, gemm, "torch-ops" or ""
    if not all(v.strip() == "auto" or v.strip().isdigit() and 1 <= int(v) <= MAX_DECODE_STEPS
               for v in args.stack_decode_steps.split(",")):
        ap.error(f"--stack-decode-steps: comma-separated values, auto or in 1..{MAX_DECODE_STEPS} "
                 f"(got {args.stack_decode_steps!r})")
    stack_envs = [e.split(",") for e in args.stack_env.split(";") if e]
    if any("=" not in kv or not kv.partition("=")[0] for env in stack_envs for kv in env):
        ap.error(f"--stack-env: each environment is 'K=V,K=V', environments separated by ';' (got {args.stack_env!r})")
    if any(extra not in ("", "torch-ops") for _, _, extra in configs):
        ap.error("--configs: each entry is dtype:gemm or dtype:gemm:torch-ops")
    set_torch_threads(args.threads)  # transformers runs on as many threads as the engines

    from transformers import AutoModelForCausalLM

    src = resolve_model(args.model)
    t0 = time.perf_counter()
    hf = {"float32": AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.float32, **src.hf_kwargs()).eval()}
    hf["bfloat16"] = copy.deepcopy(hf["float32"]).to(torch.bfloat16)
    checkpoint = Checkpoint.of_model(hf["float32"], args.model)  # engines cast it to their dtype
    print(f"loaded {args.model} in {time.perf_counter() - t0:.1f} s; {args.threads} threads")
    prompt = list(load_tokenizer(src)(PROMPT)["input_ids"])
    # this VM's copy bandwidth has read 35 and 67 GB/s minutes apart: measured at the start, after each
    # dtype's rows and at the end, the median taken
    bandwidths = [copy_bandwidth_gbs()]
    load = os.getloadavg()
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores, native bfloat16: {native_bf16()}); "
          f"copy bandwidth {bandwidths[0]:.1f} GB/s (read + write; measured again later); load average {load[0]:.1f}")

    results = {"model": args.model, "threads": args.threads, "cpu": cpu_model(), "machine": platform.machine(),
               "cpu_count": os.cpu_count(), "torch": torch.__version__,
               "load_average_start": load, "forward": [], "decode": []}
    for dtype in sorted({d for d, _, _ in configs}):
        hf_rate, hf_tokens = best_rate(lambda: hf_greedy(hf[dtype], prompt, args.decode_tokens), args.decode_reps)
        hf_row = {"engine": "transformers generate", "dtype": dtype, "gemm": "-", "tokens": len(hf_tokens),
                  "tokens_per_s": hf_rate, "agree_with_hf": len(hf_tokens)}
        results["decode"].append(hf_row)
        for gemm, extra in [(g, e) for d, g, e in configs if d == dtype]:
            decode, rows, engine_run = bench_config(checkpoint, dtype, gemm, args, prompt, hf_tokens, hf_rate,
                                                    torch_ops=extra == "torch-ops")
            results["decode"].append(decode)
            results["forward"] += rows
            if rows:
                print_forward(f"{dtype} / {decode['gemm']}", rows)
            if gemm == "auto" and not extra and engine_run is not None and args.stack:  # not refused
                for env in [{}] + [dict(kv.split("=", 1) for kv in e) for e in stack_envs]:
                    for ahead, steps in itertools.product(args.stack_decode_ahead.split(","),
                                                          [None if v.strip() == "auto" else int(v)
                                                           for v in args.stack_decode_steps.split(",")]):
                        results["decode"].append(stack_row(args.model, dtype, prompt, args.decode_tokens,
                                                           args.decode_reps, decode, engine_run, args.threads,
                                                           ahead, env, steps))
        bandwidths.append(copy_bandwidth_gbs())
    results["load_average_end"] = os.getloadavg()
    results["bandwidth_gbs"], results["bandwidth_measurements_gbs"] = statistics.median(bandwidths), bandwidths
    with_bandwidth(results["decode"], results["bandwidth_gbs"])
    print(f"\nCPU: {cpu_model()}; copy bandwidth {results['bandwidth_gbs']:.1f} GB/s, the median of "
          f"{', '.join(f'{b:.1f}' for b in bandwidths)} (start, after each dtype); load average {load[0]:.1f} at "
          f"start, {results['load_average_end'][0]:.1f} at end ({os.cpu_count()} cores)")
    print_decode(results["decode"], args.decode_tokens, args.decode_reps)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
