"""Admission control: request limits, per-key concurrency and token rate,
the gateway-wide live cap with its bounded queue. Unit tests of the pieces,
then a real stories260K stack whose gateway runs with small limits."""
from __future__ import annotations

import threading
import time

import grpc
import httpx
import pytest
from conftest import start_stack

from specdec.client import make_request, stream
from specdec.gateway.admission import RequestLimits, TokenBucket
from specdec.launcher import free_port
from specdec.protos.v1 import specdec_pb2 as pb

# ---- units ---------------------------------------------------------------------------


def test_request_limits_name_the_field():
    limits = RequestLimits(max_request_bytes=1000, max_stop_strings=2, max_stop_chars=5, max_chat_messages=2,
                           max_reference_tokens=10)
    words = len  # one token per character: the check must count, not guess

    def check(**fields):
        request = pb.GenerateRequest(**fields)
        return limits.check(request, words)

    assert check(text="hi", stop=["a", "b"]) is None
    assert check(text="x" * 2000).startswith("request: ")
    assert check(text="hi", stop=["a", "b", "c"]).startswith("stop: 3 strings")
    assert check(text="hi", stop=["a", "toolong"]).startswith("stop[1]: 7 characters")
    chat = pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="x")] * 3)
    assert check(chat=chat).startswith("chat.messages: 3 messages")
    ok = pb.GenerateRequest(text="hi")
    ok.speculation.reference_text = "r" * 10
    assert limits.check(ok, words) is None
    ok.speculation.reference_text = "r" * 11
    assert limits.check(ok, words).startswith("speculation.reference_text: 11 tokens")
    # text longer than the limit but fewer tokens is accepted
    assert limits.check(ok, lambda text: 3) is None


def test_token_bucket_debt_and_refill():
    bucket = TokenBucket(per_minute=60, at=0.0)  # one token per second
    assert bucket.wait_s(0.0) == 0
    bucket.spend(70, 0.0)  # 10 tokens of debt
    assert bucket.wait_s(0.0) == pytest.approx(10.0)
    assert bucket.wait_s(5.0) == pytest.approx(5.0)
    assert bucket.wait_s(9.5) == pytest.approx(0.5)
    assert bucket.wait_s(10.0) == 0
    assert bucket.wait_s(1000.0) == 0 and bucket.level == 60  # never more than a minute's worth


# ---- the real gateway ----------------------------------------------------------------

KEYS = ["k-busy", "k-other", "k-queued", "k-late", "k-rate", "k-fresh"]


@pytest.fixture(scope="module")
def limited_stack(stories_path, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text("\n".join(KEYS) + "\n")
    stack = start_stack(stories_path, tmp_path_factory, "limited", methods="ngram", metrics=True,
                        api_keys_file=str(keys), http_port=free_port(),
                        extra_gateway_args=["--max-live-requests", "2", "--max-queued-requests", "1",
                                            "--key-max-concurrent", "1", "--key-tokens-per-minute", "300",
                                            "--max-stop-strings", "4"])
    yield stack
    stack.stop()


def _long(max_tokens: int = 400) -> pb.GenerateRequest:
    request = make_request("Once upon a time", max_tokens=max_tokens, method="ngram")
    request.ignore_eos = True
    return request


def _gauge(stack, name: str) -> float:
    return stack.by_name("gateway")[0].metrics().get(name, 0.0)


def _wait(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.02)


class _Background:
    """A Generate call on a thread; result or error kept."""

    def __init__(self, addr: str, request: pb.GenerateRequest, key: str) -> None:
        self.result = self.error = None
        self.thread = threading.Thread(target=self._run, args=(addr, request, key), daemon=True)
        self.thread.start()

    def _run(self, addr, request, key):
        try:
            self.result = stream(addr, request, timeout=300, api_key=key)
        except grpc.RpcError as e:
            self.error = e

    def join(self):
        self.thread.join(300)
        assert not self.thread.is_alive()
        return self


def _refused(addr, request, key) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        stream(addr, request, timeout=60, api_key=key)
    return e.value


def test_request_limit_refused_with_field_and_others_served(limited_stack):
    addr = limited_stack.gateway_addr
    request = make_request("Once upon a time", max_tokens=4, stop=["a", "b", "c", "d", "e"])
    e = _refused(addr, request, "k-other")
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith("stop: 5 strings")
    # the HTTP API applies the same limits
    body = {"prompt": "Once upon a time", "max_tokens": 4, "stop": ["a", "b", "c", "d", "e"]}
    answer = httpx.post(f"{limited_stack.http_url}/completions", json=body, timeout=60,
                        headers={"Authorization": "Bearer k-other"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "stop", answer.text
    assert stream(addr, make_request("Once upon a time", max_tokens=4), api_key="k-other").token_ids


def test_per_key_concurrency_and_live_cap_with_bounded_queue(limited_stack):
    addr = limited_stack.gateway_addr
    busy = _Background(addr, _long(), "k-busy")
    _wait(lambda: _gauge(limited_stack, "specdec_gateway_admitted_requests") == 1, "first request admitted")
    e = _refused(addr, make_request("Once", max_tokens=2), "k-busy")  # same key, one running
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "already has 1 requests running" in e.details()
    answer = httpx.post(f"{limited_stack.http_url}/completions", timeout=60,  # the same key over HTTP
                        json={"prompt": "Once", "max_tokens": 2}, headers={"Authorization": "Bearer k-busy"})
    assert answer.status_code == 429 and "already has 1 requests running" in answer.json()["error"]["message"]
    assert int(answer.headers["Retry-After"]) >= 1
    other = _Background(addr, _long(), "k-other")  # the second live slot
    _wait(lambda: _gauge(limited_stack, "specdec_gateway_admitted_requests") == 2, "second request admitted")
    queued = _Background(addr, _long(8), "k-queued")  # waits for a slot
    _wait(lambda: _gauge(limited_stack, "specdec_gateway_queued_requests") == 1, "third request queued")
    start = time.monotonic()
    e = _refused(addr, make_request("Once", max_tokens=2), "k-late")  # slots and queue full: at once
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "the gateway is full" in e.details()
    assert time.monotonic() - start < 30  # refused without waiting for a slot (generous: shared machine)
    for call in (busy, other, queued):
        call.join()
        assert call.error is None, call.error
    assert len(busy.result.token_ids) == 400 and len(queued.result.token_ids) == 8
    assert _gauge(limited_stack, "specdec_gateway_queued_requests") == 0
    assert _gauge(limited_stack, "specdec_gateway_admitted_requests") == 0


def test_per_key_token_rate_refuses_with_retry_hint_then_resets(limited_stack):
    addr = limited_stack.gateway_addr
    stream(addr, _long(290), api_key="k-rate")  # most of the key's 300 tokens per minute
    error = None
    for _ in range(40):  # each request adds debt faster than 5 tokens/s refill
        try:
            stream(addr, _long(30), timeout=120, api_key="k-rate")
        except grpc.RpcError as e:
            error = e
            break
    assert error is not None, "the token rate limit never refused"
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "tokens per minute" in error.details()
    retry_ms = int(dict(error.trailing_metadata())["retry-after-ms"])
    assert 0 < retry_ms <= 60_000
    # another key is not affected
    assert stream(addr, make_request("Once", max_tokens=2), api_key="k-fresh").token_ids
    time.sleep(retry_ms / 1000 + 0.2)
    assert stream(addr, make_request("Once", max_tokens=2), api_key="k-rate").token_ids
