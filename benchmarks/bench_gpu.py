"""The Llama engine on a GPU: its row-invariant Triton kernels, eagerly and
replayed as CUDA graphs, against transformers ``generate`` on the same GPU
in the same dtype.

Rows, single stream (greedy, --tokens new tokens after a --prompt-tokens
prompt): ms per decode step and tokens/s of transformers ``generate``, the
engine eager (every kernel launched from Python) and the engine with CUDA
graphs (engine.cuda_graph); whether the engine's tokens equal transformers'
(cuBLAS sums in another order, so a bfloat16 near-tie may differ; eager and
graphs must be equal, and the script fails if not). Then the cost of
verifying 5 drafts (one 6-row forward) relative to one decode step, and
batched steps of B sequences: decode (one token each) with graphs and
eagerly, verification (6 tokens each) with graphs. ``--fused`` adds the
same rows with the engine's fused small steps (fuse_gpu_steps). Engines with
graphs first capture all of them as the scorer does at start-up
(LlamaEngine.prepare): their number, seconds and memory are printed.
Then the steps of an EAGLE-3 round, whose passes also return the states of
three feature layers (--features, default EAGLE-3's low/mid/high of the
model): a decode step and a 6-row verification with features, per run,
beside the same steps without (graphs with features are captured the first
time such a pass comes, in the warm-up).

    python benchmarks/bench_gpu.py                          # SmolLM2 if found, bfloat16
    python benchmarks/bench_gpu.py --shapes smollm2         # SmolLM2-135M's shapes, random weights

``--shapes smollm2`` builds SmolLM2-135M's architecture (30 layers, hidden
576, vocabulary 49152) with seeded random weights: a machine without the
model file times the same kernels on the same shapes (the tokens then mean
nothing, but eager, graphs and transformers still must agree).

Prints a table and writes JSON to --out (default bench_results/gpu.json).
Times are the minimum over --reps runs.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from specdec.engine.base import ForwardItem
from specdec.engine.checkpoint import Checkpoint
from specdec.engine.llama import LlamaEngine
from specdec.proposer_svc.eagle3 import default_eagle3_layers

#: (name, CUDA graphs, fuse_gpu_steps) of the engine runs; the fused two with --fused only
RUNS = (("eager", False, False), ("graphs", True, False), ("eager fused", False, True), ("graphs fused", True, True))
nan = float("nan")
#: the scorer's default --max-batch-size and --max-tokens-per-forward: the graphs prepare captures
PREPARE_SEQS, PREPARE_TOKENS = 256, 512


def smollm2_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                       num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, max_position_embeddings=8192,
                       rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def load_model(args):
    """(transformers model float32 on CPU, prompt ids, description)."""
    from transformers import AutoModelForCausalLM

    if args.shapes == "smollm2":
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(smollm2_config()).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02) if p.dim() > 1 else p.uniform_(0.8, 1.2)
        prompt = torch.randint(3, 49152, (args.prompt_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
        return model, prompt, "SmolLM2-135M shapes, random weights"
    from specdec.models import load_tokenizer, resolve_model, shared_models_dir

    path = args.model or str(shared_models_dir() / "smollm2-135m-instruct-q4_1")
    src = resolve_model(path)
    model = AutoModelForCausalLM.from_pretrained(src.path, dtype="float32", **src.hf_kwargs()).eval()
    text = ("The scorer verifies the guesses of many sequences in one batched forward pass, so speculation pays "
            "only when checking several tokens costs about as much as one. ") * 8
    prompt = load_tokenizer(src)(text)["input_ids"][:args.prompt_tokens]
    return model, prompt, path


#: "cuda", or "cpu" under TRITON_INTERPRET=1 (a smoke test of this script: Triton kernels interpreted, no graphs)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def hf_decode(model, prompt: list[int], n: int, reps: int) -> tuple[float, list[int]]:
    """Best seconds of ``generate`` (n tokens, greedy, no early stop) and its tokens."""
    ids = torch.tensor([prompt], device=DEVICE)
    kwargs = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids),
                  pad_token_id=0)
    best, out = float("inf"), None
    with torch.inference_mode():
        model.generate(ids, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        for _ in range(reps):
            sync()
            t = time.perf_counter()
            out = model.generate(ids, **kwargs)
            sync()
            best = min(best, time.perf_counter() - t)
    assert out is not None
    return best, out[0, len(prompt):].tolist()


def engine_decode(engine: LlamaEngine, prompt: list[int], n: int, reps: int) -> tuple[float, float, list[int]]:
    """Best seconds of prefill + n greedy decode steps, best seconds of the
    decode steps alone, and the tokens; each step's token goes to the host
    (as the scorer's verification needs it)."""
    best_total, best_steps, tokens = float("inf"), float("inf"), []
    for rep in range(reps + 1):  # the first run warms up (Triton compiles, graphs capture)
        seq = f"s{rep}"
        engine.ensure_capacity(seq, len(prompt) + n + 1)
        sync()
        t0 = time.perf_counter()
        logits = engine.forward([ForwardItem(seq, np.asarray(prompt, np.int32), 1)]).logits
        out = [int(logits[-1].argmax())]
        t1 = time.perf_counter()
        for _ in range(n - 1):
            logits = engine.forward([ForwardItem(seq, np.asarray(out[-1:], np.int32), 1)]).logits
            out.append(int(logits[-1].argmax()))
        t2 = time.perf_counter()
        engine.release(seq)
        if rep:
            best_total, best_steps = min(best_total, t2 - t0), min(best_steps, (t2 - t1) / (n - 1))
        tokens = out
    return best_total, best_steps, tokens


def step_ms(engine: LlamaEngine, seqs: list[str], rows: int, reps: int, features: tuple[int, ...] = ()) -> float:
    """Median ms of one forward of ``rows`` new tokens for each of seqs (their
    caches already filled), asking for the states of the features layers,
    rolled back after each."""
    times = []
    for _ in range(reps + 3):
        items = [ForwardItem(s, np.ones(rows, np.int32), rows) for s in seqs]
        lengths = [engine.cached_len(s) for s in seqs]
        for s, n in zip(seqs, lengths):
            engine.ensure_capacity(s, n + rows)
        sync()
        t = time.perf_counter()
        out = engine.forward(items, feature_layers=features)
        out.logits.sum().item()
        if features:
            out.features.float().sum().item()  # the states reach the host, as the scorer sends them
        times.append(time.perf_counter() - t)
        for s, n in zip(seqs, lengths):
            engine.truncate(s, n)
    return 1e3 * float(np.median(times[3:]))


def empty_cache() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def prefill(engine: LlamaEngine, seqs: list[str], prompt: list[int]) -> None:
    for s in seqs:
        engine.ensure_capacity(s, len(prompt))
        engine.forward([ForwardItem(s, np.asarray(prompt, np.int32), 0)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model directory or id (default: the shared SmolLM2)")
    ap.add_argument("--shapes", choices=["smollm2"], help="random weights of this architecture instead of a model")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--fused", action="store_true",
                    help="also run the engine with fuse_gpu_steps (gpu_ops's fused small steps)")
    ap.add_argument("--features", help="feature layers of the EAGLE-3 rows, e.g. 2,15,27 (default: EAGLE-3's "
                                       "low/mid/high of the model); 'none' leaves those rows out")
    ap.add_argument("--out", default="bench_results/gpu.json")
    args = ap.parse_args()
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("bench_gpu: no CUDA device (TRITON_INTERPRET=1 runs it on CPU, as a smoke test)")
    model, prompt, what = load_model(args)
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (TRITON_INTERPRET=1)"
    print(f"GPU: {gpu}; torch {torch.__version__}; model: {what}; prompt {len(prompt)} tokens, {args.tokens} new")
    results: dict = {"gpu": gpu, "torch": torch.__version__, "model": what, "prompt_tokens": len(prompt),
                     "tokens": args.tokens, "rows": []}
    batches = [int(b) for b in args.batches.split(",")]
    n_layers = model.config.num_hidden_layers
    features = () if args.features == "none" else tuple(dict.fromkeys(  # a small model's low/mid/high may coincide
        default_eagle3_layers(n_layers) if not args.features else (int(i) for i in args.features.split(","))))
    results["feature_layers"] = list(features)
    feature_lines = [f"| dtype | run | decode step ms | with features {list(features)} | verify 6 rows ms | "
                     "with features |", "| --- " * 6 + "|"]
    header = ("| dtype | run | ms / decode step | tok/s | x transformers | same tokens as transformers | "
              "verify 6 rows / decode step |")
    lines = [header, "| --- " * 7 + "|"]
    batch_lines = ["| dtype | B | graphs ms / decode step | eager ms / decode step | graphs tok/s | "
                   "graphs ms / verify step (6 rows each) | verify / decode (graphs) |", "| --- " * 7 + "|"]
    captures: list[str] = []
    for dtype in args.dtypes.split(","):
        hf = copy.deepcopy(model).to(DEVICE, getattr(torch, dtype))
        hf_s, hf_tokens = hf_decode(hf, prompt, args.tokens, args.reps)
        hf_ms = 1e3 * hf_s / args.tokens
        del hf
        empty_cache()
        lines.append(f"| {dtype} | transformers generate | {hf_ms:.2f} | {1e3 / hf_ms:.0f} | 1.00 | | |")
        row = {"dtype": dtype, "transformers_ms_per_token": hf_ms}
        tokens_by_run = {}
        for run, graphs, fused in RUNS[:4 if args.fused else 2]:
            if graphs and DEVICE != "cuda":
                continue
            kernels = "auto" if DEVICE == "cuda" else "triton"
            engine = LlamaEngine(Checkpoint.of_model(model, what), dtype, device=DEVICE, kv_capacity_tokens=1 << 16,
                                 gemm=kernels, attention="triton", cuda_graphs=graphs, fuse_gpu_steps=fused)
            if graphs:  # the scorer's start-up (LlamaEngine.prepare): every graph a default scorer can need
                before, start = torch.cuda.memory_reserved(), time.perf_counter()
                engine.prepare(PREPARE_SEQS, PREPARE_TOKENS)
                capture_s, capture_mib = time.perf_counter() - start, (torch.cuda.memory_reserved() - before) / 2**20
                captures.append(f"{dtype} {run}: {len(engine.graphs.captured())} graphs in {capture_s:.1f} s, "
                                f"{capture_mib:.0f} MiB")
                row[f"{run}_capture"] = dict(graphs=len(engine.graphs.captured()), seconds=capture_s,
                                             reserved_mib=capture_mib)
            total_s, steps_s, tokens = engine_decode(engine, prompt, args.tokens, args.reps)
            tokens_by_run[run] = tokens
            ms = 1e3 * total_s / args.tokens
            same = tokens == hf_tokens
            first = next((i for i, (a, b) in enumerate(zip(tokens, hf_tokens)) if a != b), None)
            prefill(engine, ["v"], prompt)
            decode = step_ms(engine, ["v"], 1, 20)
            verify = step_ms(engine, ["v"], 6, 20)
            lines.append(f"| {dtype} | engine {run} | {ms:.2f} (steps {1e3 * steps_s:.2f}) | {1e3 / ms:.0f} | "
                         f"{hf_ms / ms:.2f} | {'yes' if same else f'no (first at {first})'} | "
                         f"{verify / decode:.2f} ({verify:.2f} / {decode:.2f} ms) |")
            row[run] = dict(ms_per_token=ms, step_ms=1e3 * steps_s, vs_transformers=hf_ms / ms, same_tokens=same,
                            first_difference=first, decode_step_ms=decode, verify6_ms=verify)
            if features:
                decode_f, verify_f = step_ms(engine, ["v"], 1, 20, features), step_ms(engine, ["v"], 6, 20, features)
                feature_lines.append(f"| {dtype} | engine {run} | {decode:.2f} | {decode_f:.2f} | {verify:.2f} | "
                                     f"{verify_f:.2f} |")
                row[run].update(decode_step_features_ms=decode_f, verify6_features_ms=verify_f)
            for b in batches:
                seqs = [f"b{b}_{i}" for i in range(b)]
                prefill(engine, seqs, prompt)
                cell = row.setdefault("batches", {}).setdefault(str(b), {})
                cell[run] = step_ms(engine, seqs, 1, 10)
                cell[f"{run}_verify6"] = step_ms(engine, seqs, 6, 10)
                for s in seqs:
                    engine.release(s)
            del engine
            empty_cache()
        for eager, graphs in (("eager", "graphs"), ("eager fused", "graphs fused")):
            if tokens_by_run.get(graphs, tokens_by_run.get(eager)) != tokens_by_run.get(eager):
                raise SystemExit(f"bench_gpu: {dtype}: graph replay changed a token (the invariant is broken)")
        for b, r in row["batches"].items():
            for suffix in ("", " fused") if args.fused else ("",):
                graph_ms, graph_verify = r.get("graphs" + suffix, nan), r.get(f"graphs{suffix}_verify6", nan)
                batch_lines.append(f"| {dtype}{suffix} | {b} | {graph_ms:.2f} | {r['eager' + suffix]:.2f} | "
                                   f"{int(b) * 1e3 / graph_ms:.0f} | {graph_verify:.2f} | "
                                   f"{graph_verify / graph_ms:.2f} |")
        results["rows"].append(row)
    print("\n".join(lines))
    print("\nbatched decode steps (one token per sequence, prompt cached):")
    print("\n".join(batch_lines))
    if features:
        print(f"\nan EAGLE-3 round's passes, returning the states of layers {list(features)} (single stream):")
        print("\n".join(feature_lines))
    if captures:
        print(f"\nstart-up capture (prepare({PREPARE_SEQS}, {PREPARE_TOKENS}): the scorer's defaults):")
        print("\n".join(captures))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
