"""vLLM plain decoding, draft-model and EAGLE-3 speculation on given
prompts, greedy; run by bench_draft.py in vLLM's own virtualenv (it imports
nothing of specdec). Reads a JSON job file ({target, draft, eagle3, prompts:
[[ids]], k, max_tokens}; draft and eagle3 may be null) and prints one JSON
line: {"vllm_plain": {...}, "vllm_draft_model": {...}, "vllm_eagle3": {...}}
with tokens, wall_s and tok_s each, or {"error": ...} for a method vLLM
refused (what it said), so one refusal does not hide the other rows.

    /work/venvs/vllm/bin/python benchmarks/vllm_draft.py JOB.json
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time

# vLLM's CPU backend reserves one core for its front end and binds its OpenMP threads to the rest: on the
# 2-core machines of this project that is one thread, where specdec's scorer uses every core. Both cores,
# like ours (override from the environment).
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
#: share of the machine's memory vLLM's CPU backend may reserve (its default, 0.92, fails where other processes
#: hold memory; SmolLM2's weights and a 2048-token KV cache need far less)
MEMORY_FRACTION = float(os.environ.get("VLLM_BENCH_MEMORY_FRACTION", "0.3"))


def run(target: str, prompts: list[list[int]], max_tokens: int, speculative_config: dict | None) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=target, dtype="float32", max_model_len=2048, speculative_config=speculative_config,
              enforce_eager=True, gpu_memory_utilization=MEMORY_FRACTION, disable_log_stats=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], params)  # warm-up
    before = spec_counts(llm)
    tokens, wall = 0, 0.0
    for ids in prompts:  # one stream, like bench_draft's single-stream runs
        start = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        wall += time.perf_counter() - start
        tokens += len(out[0].outputs[0].token_ids)
    drafts, accepted = (after - then for after, then in zip(spec_counts(llm), before))
    del llm
    gc.collect()
    result = {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall}
    if speculative_config is not None and drafts > 0:  # vLLM's own count: drafts verified, draft tokens accepted
        result["mean_accepted_length"] = 1.0 + accepted / drafts
    return result


def spec_counts(llm) -> tuple[float, float]:
    """vLLM's counters of speculative rounds (drafts verified) and accepted
    draft tokens so far; zeros where it keeps none."""
    counts = {"vllm:spec_decode_num_drafts": 0.0, "vllm:spec_decode_num_accepted_tokens": 0.0}
    try:
        metrics = llm.get_metrics()
    except Exception:  # an older vLLM without get_metrics: no acceptance reported
        return 0.0, 0.0
    for metric in metrics:
        if metric.name in counts:
            counts[metric.name] += float(getattr(metric, "value", 0.0))
    return counts["vllm:spec_decode_num_drafts"], counts["vllm:spec_decode_num_accepted_tokens"]


def refusal(error: BaseException) -> str:
    """What vLLM said when it refused a configuration: the exception's last
    line, and the root cause's when it was raised from another."""
    said = f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"
    root = error.__cause__ or error.__context__
    return f"{said} (from {refusal(root)})" if root is not None and root is not error else said


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    runs = {"vllm_plain": None}
    if job.get("draft"):
        runs["vllm_draft_model"] = {"method": "draft_model", "model": job["draft"], "num_speculative_tokens": job["k"]}
    if job.get("eagle3"):
        runs["vllm_eagle3"] = {"method": "eagle3", "model": job["eagle3"], "num_speculative_tokens": job["k"]}
    result = {}
    for name, spec in runs.items():
        try:
            result[name] = run(job["target"], job["prompts"], job["max_tokens"], spec)
        except Exception as error:  # a refusal is a result: say what vLLM said and go on
            result[name] = {"error": refusal(error)}
        print(f"{name}: {result[name]}", file=sys.stderr, flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
