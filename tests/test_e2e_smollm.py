"""End to end on the default model (SmolLM2-135M GGUF): greedy output of every
method and draft length equals transformers greedy `generate`, for prompts
that do and do not repeat themselves."""
from __future__ import annotations

import threading

import pytest
from conftest import assert_same_as_greedy, hf_greedy, hf_model, start_stack

from specdec.client import make_request, stream
from specdec.engine.gemm_select import native_bf16
from specdec.protos.v1 import specdec_pb2 as pb

pytestmark = pytest.mark.smollm

MAX_TOKENS = 32
PROMPTS = {
    # high input-output overlap: the answer copies the prompt
    "copy": "Copy this list exactly: apples, pears, plums, cherries, grapes, lemons. "
            "Copy: apples, pears, plums, cherries, grapes, lemons. Copy: apples,",
    # little overlap
    "open": "The history of the printing press begins",
}


@pytest.fixture(scope="module")
def smollm_stack(smollm_path, tmp_path_factory):
    # the reference model (for `expected`) loads beside the stack: each takes ~20 s, mostly on one core
    loading = threading.Thread(target=hf_model, args=(smollm_path,))
    loading.start()
    try:
        stack = start_stack(smollm_path, tmp_path_factory, "smollm", methods="naive,ngram")
    finally:
        loading.join()
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def expected(smollm_path, smollm_stack):
    tok = hf_model(smollm_path)[1]
    return {name: (ids := tuple(tok(text)["input_ids"]), hf_greedy(smollm_path, ids, MAX_TOKENS))
            for name, text in PROMPTS.items()}


@pytest.mark.parametrize("prompt", sorted(PROMPTS))
@pytest.mark.parametrize("method,k", [pytest.param("naive", 1, marks=pytest.mark.slow), ("naive", 3),
                                      pytest.param("naive", 8, marks=pytest.mark.slow), ("ngram", 1),
                                      pytest.param("ngram", 3, marks=pytest.mark.slow), ("ngram", 8)])
def test_greedy_matches_transformers_on_smollm(smollm_stack, smollm_path, expected, prompt, method, k):
    prompt_ids, reference = expected[prompt]
    copies = method == "ngram" and prompt == "copy"
    # the copy prompt's drafts are counted below: a fixed draft length asks for them every round (adaptive,
    # CopyGates may decode a round plainly where they do not pay: the other prompts test that path)
    options = {"draft_length": pb.DRAFT_LENGTH_FIXED} if copies else {}
    gen = stream(smollm_stack.gateway_addr,
                 make_request(list(prompt_ids), max_tokens=MAX_TOKENS, method=method, k=k, **options))
    assert_same_as_greedy(smollm_path, gen, reference, MAX_TOKENS)
    if copies:
        assert gen.stats.accepted_tokens >= 5 and gen.stats.rounds < len(gen.token_ids)


def test_chat_prompt_uses_the_chat_template(smollm_stack, smollm_path):
    tok = hf_model(smollm_path)[1]
    messages = [("system", "You are terse."), ("user", "Name three colours.")]
    rendered = tok.apply_chat_template([{"role": r, "content": c} for r, c in messages],
                                       add_generation_prompt=True, tokenize=False)
    ids = tuple(tok(rendered, add_special_tokens=False)["input_ids"])
    gen = stream(smollm_stack.gateway_addr, make_request(chat=messages, max_tokens=16, method="ngram", k=3))
    assert gen.stats.prompt_tokens == len(ids)
    assert_same_as_greedy(smollm_path, gen, hf_greedy(smollm_path, ids, 16), 16)
    assert gen.text == tok.decode(gen.token_ids, skip_special_tokens=True)


def test_ignore_eos_keeps_generating_past_eos(smollm_stack, smollm_path):
    """The chat answer ends with EOS (stories260K never emits one: its stories
    are separated by BOS); with ignore_eos the same tokens come through that
    EOS and generation goes on to max_tokens."""
    from conftest import hf_eos_ids

    messages = [("user", "Answer with one word, yes or no: is the sky blue?")]
    ended = stream(smollm_stack.gateway_addr, make_request(chat=messages, max_tokens=200, method="ngram", k=3))
    assert ended.finish_reason == "stop" and ended.token_ids[-1] in hf_eos_ids(smollm_path)
    n = len(ended.token_ids) + 8
    request = make_request(chat=messages, max_tokens=n, method="ngram", k=3)
    request.ignore_eos = True
    past = stream(smollm_stack.gateway_addr, request)
    assert past.finish_reason == "length" and len(past.token_ids) == n
    assert past.token_ids[:len(ended.token_ids)] == ended.token_ids


# the slow suite (a minute of start-up and decoding here; minutes where bfloat16 is emulated): the engine's
# bfloat16 row-invariance tests on SmolLM2 (test_llama_engine.py), which are what keeps this true, stay in
# every CPU's default run
@pytest.mark.slow
def test_bfloat16_speculation_equals_bfloat16_plain_decoding(smollm_path, tmp_path_factory, expected):
    """The serving default for speed is bfloat16 (oneDNN): there the target is the
    bfloat16 model, and speculative output must equal its own plain decoding."""
    stack = start_stack(smollm_path, tmp_path_factory, "smollm-bf16", dtype="bfloat16",
                        methods="ngram,suffix")
    # without native bfloat16 (an AVX2-only CPU) every bfloat16 GEMM is emulated, several times slower:
    # there one prompt and two methods (the engine's own bfloat16 invariance tests run on every CPU)
    native = native_bf16()
    prompts = list(expected.values()) if native else [expected["copy"]]
    methods = [("ngram", 3), ("ngram", 8), ("suffix", 5)] if native else [("ngram", 8), ("suffix", 5)]
    try:
        for prompt_ids, _ in prompts:
            req = lambda method, k: make_request(list(prompt_ids), max_tokens=MAX_TOKENS, method=method, k=k)
            plain = stream(stack.gateway_addr, req("none", 0)).token_ids
            for method, k in methods:
                assert stream(stack.gateway_addr, req(method, k)).token_ids == plain
    finally:
        stack.stop()
