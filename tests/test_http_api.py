"""The gateway's OpenAI-compatible HTTP API over a real stack on stories260K:
the official `openai` client gets the gRPC API's greedy output, raw HTTP
(httpx) checks the SSE framing, error bodies and status codes, a client
that disconnects mid-stream frees its KV cache, and concurrent streams
equal solo runs."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from conftest import start_stack

from specdec.client import make_request, stream
from specdec.launcher import free_port
from specdec.limits import MAX_HTTP_CHOICES

#: A tiny chat template for stories260K (which has none), in a copy of the
#: model directory, so that chat requests run on the test model.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
PROMPT = "Once upon a time"
CHAT = [("system", "You tell stories."), ("user", "Tell me about a dog.")]


@pytest.fixture(scope="module")
def chat_model(stories_path, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("stories-chat")
    for f in Path(stories_path).iterdir():
        if f.name != "tokenizer_config.json":
            (path / f.name).symlink_to(f)
    config = json.loads((Path(stories_path) / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return str(path)


@pytest.fixture(scope="module")
def stack(chat_model, tmp_path_factory):
    s = start_stack(chat_model, tmp_path_factory, "http", methods="naive,ngram,suffix", http_port=free_port(),
                    metrics=True)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_url, api_key="unused", max_retries=0, timeout=120)


def _grpc_chat(stack, **kwargs):
    return stream(stack.gateway_addr, make_request(chat=CHAT, **kwargs))


def _messages():
    return [{"role": r, "content": c} for r, c in CHAT]


def test_models_and_health(stack, chat_model):
    models = httpx.get(f"{stack.http_url}/models").json()
    assert [m["id"] for m in models["data"]] == [chat_model]
    assert models["data"][0]["max_model_len"] == 512
    assert httpx.get(stack.http_url.removesuffix("/v1") + "/health").json() == {"status": "ok"}


@pytest.mark.parametrize("method,k", [("none", 0), ("ngram", 3), ("suffix", 5)])
def test_completions_greedy_equal_grpc(stack, client, chat_model, method, k):
    expected = stream(stack.gateway_addr, make_request(PROMPT, max_tokens=40, method=method, k=k))
    spec = {"method": method, "num_speculative_tokens": k}
    got = client.completions.create(model=chat_model, prompt=PROMPT, max_tokens=40, temperature=0,
                                    extra_body={"speculation": spec})
    assert got.choices[0].text == expected.text
    assert got.choices[0].finish_reason == expected.finish_reason
    usage = got.to_dict()["usage"]
    assert usage["prompt_tokens"] == expected.stats.prompt_tokens
    assert usage["completion_tokens"] == len(expected.token_ids)
    speculation = usage["speculation"]
    assert speculation["rounds"] >= 1
    assert speculation["mean_accepted_length"] == pytest.approx(len(expected.token_ids) / speculation["rounds"])
    assert speculation["accepted_tokens"] <= speculation["draft_tokens"]
    assert speculation["scorer_numerics_changes"] == expected.stats.scorer_numerics_changes == 0  # one replica
    if method == "none":
        assert speculation["draft_tokens"] == 0 and speculation["acceptance_by_position"] == []

    chunks = list(client.completions.create(model=chat_model, prompt=PROMPT, max_tokens=40, temperature=0,
                                            stream=True, extra_body={"speculation": spec}))
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == expected.finish_reason


def test_token_id_prompt_equals_text_prompt(stack, client, chat_model):
    from specdec.models import load_tokenizer, resolve_model

    token_ids = load_tokenizer(resolve_model(chat_model))(PROMPT)["input_ids"]
    text = client.completions.create(model=chat_model, prompt=PROMPT, max_tokens=24, temperature=0)
    by_ids = client.completions.create(model=chat_model, prompt=token_ids, max_tokens=24, temperature=0)
    assert by_ids.choices[0].text == text.choices[0].text
    assert by_ids.usage.prompt_tokens == text.usage.prompt_tokens == len(token_ids)


@pytest.mark.parametrize("streaming", [False, True])
def test_chat_greedy_equals_grpc(stack, client, chat_model, streaming):
    expected = _grpc_chat(stack, max_tokens=48, method="ngram", k=4)
    kwargs = dict(model=chat_model, messages=_messages(), max_completion_tokens=48, temperature=0,
                  extra_body={"speculation": {"method": "ngram", "num_speculative_tokens": 4}})
    if not streaming:
        got = client.chat.completions.create(**kwargs)
        assert got.choices[0].message.role == "assistant"
        assert got.choices[0].message.content == expected.text
        assert got.choices[0].finish_reason == expected.finish_reason
        assert got.usage.completion_tokens == len(expected.token_ids)
        return
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_strings_and_n_choices(stack, client, chat_model):
    expected = stream(stack.gateway_addr, make_request(PROMPT, max_tokens=48, stop=["."]))
    got = client.completions.create(model=chat_model, prompt=PROMPT, max_tokens=48, temperature=0, stop=".", n=3)
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert all(c.text == expected.text and c.finish_reason == "stop" for c in got.choices)
    assert got.usage.completion_tokens == 3 * len(expected.token_ids)
    chunks = list(client.chat.completions.create(model=chat_model, messages=_messages(), max_tokens=24,
                                                 temperature=0, n=2, stream=True))
    texts, roles = ["", ""], [[], []]
    for c in chunks:
        (choice,) = c.choices
        texts[choice.index] += choice.delta.content or ""
        roles[choice.index].append(choice.delta.role)
    assert texts == [_grpc_chat(stack, max_tokens=24).text] * 2
    assert all(r[0] == "assistant" and set(r[1:]) <= {None} for r in roles)  # the role once, first
    # sampled choices with a seed: choice i samples with seed + i, like the gRPC API with that seed
    sampled = client.completions.create(model=chat_model, prompt=PROMPT, max_tokens=24, temperature=1.0,
                                        seed=7, n=2, extra_body={"speculation": {"method": "none"}})
    for i, choice in enumerate(sampled.choices):
        alone = stream(stack.gateway_addr, make_request(PROMPT, max_tokens=24, temperature=1.0, seed=7 + i,
                                                        method="none"))
        assert choice.text == alone.text


def test_sse_framing(stack, chat_model):
    body = {"model": chat_model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    r = httpx.post(f"{stack.http_url}/completions", json=body, timeout=60)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e.strip()]
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 16
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert set(chunks[-1]["usage"]["speculation"]) == {"rounds", "draft_tokens", "accepted_tokens",
                                                       "mean_accepted_length", "acceptance_by_position",
                                                       "scorer_numerics_changes"}


#: body fields -> the `param` of the 400 (the gRPC bad-input cases of
#: test_e2e_stories.py, plus the HTTP-only ones)
BAD_COMPLETIONS = {
    "empty prompt": ({"prompt": ""}, "prompt"),
    "no prompt": ({}, "prompt"),
    "empty token ids": ({"prompt": []}, "prompt"),
    "negative max_tokens": ({"max_tokens": -3}, "max_tokens"),
    "zero max_tokens": ({"max_tokens": 0}, "max_tokens"),
    "huge max_tokens": ({"max_tokens": 10**9}, "max_tokens"),
    "k too large": ({"speculation": {"method": "ngram", "num_speculative_tokens": 17}},
                    "speculation.num_speculative_tokens"),
    "k negative": ({"speculation": {"method": "ngram", "num_speculative_tokens": -1}},
                   "speculation.num_speculative_tokens"),
    "min_n > max_n": ({"speculation": {"method": "ngram", "min_n": 4, "max_n": 2}}, "speculation.min_n"),
    "unknown method": ({"speculation": {"method": "telepathy"}}, "speculation.method"),
    "unknown speculation field": ({"speculation": {"telepathy": 1}}, "speculation"),
    "prompt too long": ({"prompt": "dog " * 600}, "prompt"),
    "out-of-vocab ids": ({"prompt": [1, 5, 100000]}, "prompt"),
    "negative token id": ({"prompt": [1, -5]}, "prompt"),
    "negative temperature": ({"temperature": -1.0}, "temperature"),
    "top_p above 1": ({"temperature": 1.0, "top_p": 1.5}, "top_p"),
    "text temperature": ({"temperature": "hot"}, "temperature"),
    "unknown draft_length": ({"speculation": {"method": "ngram", "draft_length": 7}}, "speculation.draft_length"),
    "unknown accept_policy": ({"speculation": {"method": "ngram", "accept_policy": 9}}, "speculation.accept_policy"),
    "logprobs": ({"logprobs": 2}, "logprobs"),
    "echo": ({"echo": True}, "echo"),
    "logit_bias": ({"logit_bias": {"5": 100}}, "logit_bias"),
    "presence_penalty": ({"presence_penalty": 0.5}, "presence_penalty"),
    "unknown field": ({"telepathy": True}, "telepathy"),
    "n too large": ({"n": MAX_HTTP_CHOICES + 1}, "n"),
    "two prompts": ({"prompt": ["a", "b"]}, "prompt"),
    "negative seed": ({"seed": -1}, "seed"),
    "negative top_k": ({"top_k": -2}, "top_k"),
    "continuous usage": ({"stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    "empty stop": ({"stop": [""]}, "stop"),
}
BAD_CHAT = {
    "no messages": ({"messages": []}, "messages"),
    "bad role": ({"messages": [{"role": "wizard", "content": "Hi"}]}, "messages[0].role"),
    "tools": ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    "response_format": ({"response_format": {"type": "json_object"}}, "response_format"),
    "logprobs": ({"logprobs": True}, "logprobs"),
    "image part": ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
                   "messages[0].content[0]"),
    "zero max_completion_tokens": ({"max_completion_tokens": 0}, "max_completion_tokens"),
}


def _check_still_serving(stack, chat_model):
    ok = httpx.post(f"{stack.http_url}/completions", timeout=60,
                    json={"model": chat_model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("case", sorted(BAD_COMPLETIONS))
def test_bad_completion_is_400_naming_the_field(stack, chat_model, case):
    fields, param = BAD_COMPLETIONS[case]
    body = {"model": chat_model, "prompt": PROMPT, "max_tokens": 8, **fields}
    if case == "no prompt":
        del body["prompt"]
    for streaming in (False, True):
        r = httpx.post(f"{stack.http_url}/completions", json={**body, "stream": streaming}, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == param and error["message"].startswith(param)
    _check_still_serving(stack, chat_model)


@pytest.mark.parametrize("case", sorted(BAD_CHAT))
def test_bad_chat_is_400_naming_the_field(stack, chat_model, case):
    fields, param = BAD_CHAT[case]
    r = httpx.post(f"{stack.http_url}/chat/completions", timeout=60,
                   json={"model": chat_model, "messages": _messages(), **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    _check_still_serving(stack, chat_model)


def test_other_errors_have_openai_shape(stack, chat_model):
    r = httpx.post(f"{stack.http_url}/completions", json={"model": "gpt-4", "prompt": PROMPT})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.post(f"{stack.http_url}/completions", content=b"{not json", timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    r = httpx.get(f"{stack.http_url}/engines")
    assert r.status_code == 404 and "error" in r.json()
    with pytest.raises(openai.BadRequestError) as info:  # the openai client reads the shape too
        openai.OpenAI(base_url=stack.http_url, api_key="unused", max_retries=0).completions.create(
            model=chat_model, prompt=PROMPT, temperature=-1)
    assert info.value.param == "temperature"


def _live(service) -> float:
    return service.metrics()["specdec_scorer_live_sequences"]


def _live_once_settled(scorer, timeout_s: float = 30.0) -> float:
    """The scorer's live sequences once none is left, or at the deadline
    (a finished request's Release reaches the scorer after its last token)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _live(scorer) != 0:
        time.sleep(0.1)
    return _live(scorer)


def test_disconnect_mid_stream_frees_the_kv_cache(stack, chat_model):
    scorer = stack.by_name("scorer")[0]
    gateway = stack.by_name("gateway")[0]
    cancelled = 'specdec_gateway_requests_total{outcome="cancelled"}'
    before = gateway.metrics().get(cancelled, 0.0)
    assert _live_once_settled(scorer) == 0  # the earlier tests' sequences released
    body = {"model": chat_model, "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True, "temperature": 0,
            "stream": True, "speculation": {"method": "none"}}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{stack.http_url}/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            assert _live(scorer) == 1  # generation is under way
    assert _live_once_settled(scorer) == 0
    assert gateway.metrics()[cancelled] == before + 1


def test_concurrent_streaming_clients_equal_solo(stack, client, chat_model):
    prompts = [f"{PROMPT} there was a {w}" for w in ("dog", "cat", "bird", "girl")] * 8  # 32 streams

    def run(prompt: str) -> str:
        chunks = client.completions.create(model=chat_model, prompt=prompt, max_tokens=32, temperature=0,
                                           stream=True)
        return "".join(c.choices[0].text for c in chunks if c.choices)

    solo = {p: run(p) for p in set(prompts)}
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(run, prompts))
    assert together == [solo[p] for p in prompts]
    assert together == [stream(stack.gateway_addr, make_request(p, max_tokens=32)).text for p in prompts]


def test_full_kv_pool_is_429_and_no_scorer_is_503(chat_model, tmp_path_factory):
    # a refused request first waits out its stalled rounds (the pool may free): 20 x 50 ms here, not 200
    small = start_stack(chat_model, tmp_path_factory, "http-small-pool", methods="naive", default_method="naive",
                        kv_tokens=64, http_port=free_port(), extra_gateway_args=["--max-stalled-rounds", "20"])
    try:
        url = f"{small.http_url}/completions"
        too_long = {"prompt": "dog " * 150, "max_tokens": 8, "temperature": 0}  # fits the context, not the pool
        for streaming in (False, True):
            r = httpx.post(url, json={**too_long, "stream": streaming}, timeout=120)
            assert r.status_code == 429, r.text
            assert r.json()["error"]["code"] == "resource_exhausted"
        fits = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        assert httpx.post(url, json=fits, timeout=120).json()["usage"]["completion_tokens"] == 8
        small.by_name("scorer")[0].kill()
        r = httpx.post(url, json=fits, timeout=120)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "unavailable"
    finally:
        small.stop()


def test_deltas_waiting_together_join_per_choice_in_order():
    """A stream that fell behind sends a choice's waiting deltas as one chunk
    (texts and tokens in order, the last finish reason), choices kept apart."""
    from specdec.gateway.http_api import _coalesced
    from specdec.gateway.sequence import Delta, FinishReason

    batch = [(0, Delta("r", "Once", [1])), (0, Delta("r", " upon", [2])), (1, Delta("r", "A", [7])),
             (0, Delta("r", " a", [3], FinishReason.LENGTH))]
    out = _coalesced(batch)
    assert [(i, d.text, d.token_ids, d.finish_reason) for i, d in out] == [
        (0, "Once upon", [1, 2], None), (1, "A", [7], None), (0, " a", [3], FinishReason.LENGTH)]
    assert _coalesced(batch[:2] + batch[3:])[0][1].finish_reason == FinishReason.LENGTH
