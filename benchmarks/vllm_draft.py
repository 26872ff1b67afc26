"""vLLM plain decoding and draft-model speculation on given prompts, greedy;
run by bench_draft.py in vLLM's own virtualenv (it imports nothing of
specdec). Reads a JSON job file ({target, draft, prompts: [[ids]], k,
max_tokens}) and prints one JSON line: {"vllm_plain": {...},
"vllm_draft_model": {...}} with tokens, wall_s and tok_s each.

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
              enforce_eager=True, gpu_memory_utilization=MEMORY_FRACTION)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], params)  # warm-up
    tokens, wall = 0, 0.0
    for ids in prompts:  # one stream, like bench_draft's single-stream runs
        start = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        wall += time.perf_counter() - start
        tokens += len(out[0].outputs[0].token_ids)
    del llm
    gc.collect()
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall}


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    spec = {"method": "draft_model", "model": job["draft"], "num_speculative_tokens": job["k"]}
    result = {"vllm_plain": run(job["target"], job["prompts"], job["max_tokens"], None),
              "vllm_draft_model": run(job["target"], job["prompts"], job["max_tokens"], spec)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
