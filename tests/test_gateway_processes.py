"""Gateway processes beside a shared scorer and proposer.

Graceful drain on SIGTERM: new requests are refused with UNAVAILABLE, live
streams finish within the grace period, the rest end with UNAVAILABLE and
their KV caches are freed on the scorer. Isolation: two gateways sharing
replicas never touch each other's sequences."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from conftest import start_stack

from specdec.client import make_request, stream
from specdec.launcher import free_port, wait_serving
from specdec.models import TOKENIZER_CACHE_ENV


@pytest.fixture(scope="module")
def backend(stories_path, tmp_path_factory):
    """Scorer + proposer (and a gateway we do not use) with metrics."""
    stack = start_stack(stories_path, tmp_path_factory, "drain", methods="ngram", metrics=True)
    yield stack
    stack.stop()


class _Gateway:
    def __init__(self, backend, tmp_path, model: str, grace_s: float) -> None:
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        proposer = backend.by_name("proposer")[0].addr
        self.log = open(tmp_path / f"gateway-{self.port}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specdec.cli", "gateway", "--model", model, "--port", str(self.port),
             "--scorer", backend.by_name("scorer")[0].addr, "--proposer", f"ngram={proposer}",
             "--drain-grace-s", str(grace_s)], stdout=self.log, stderr=subprocess.STDOUT)
        wait_serving(self.addr, self.proc, 120, "gateway")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        self.log.close()


def _long(max_tokens: int):
    request = make_request("Once upon a time", max_tokens=max_tokens, method="ngram")
    request.ignore_eos = True
    return request


class _Streaming:
    """A Generate call on a thread; `started` is set at its first delta."""

    def __init__(self, addr: str, request) -> None:
        self.started = threading.Event()
        self.result = self.error = None
        self.thread = threading.Thread(target=self._run, args=(addr, request), daemon=True)
        self.thread.start()

    def _run(self, addr, request):
        try:
            self.result = stream(addr, request, timeout=300, on_delta=lambda _: self.started.set())
        except grpc.RpcError as e:
            self.error = e
        self.started.set()

    def join(self):
        self.thread.join(300)
        assert not self.thread.is_alive()
        return self


def _scorer_live(backend) -> float:
    return backend.by_name("scorer")[0].metrics()["specdec_scorer_live_sequences"]


def test_sigterm_lets_live_streams_finish_and_refuses_new_ones(backend, stories_path, tmp_path):
    solo = stream(backend.gateway_addr, _long(300), timeout=300)
    gateway = _Gateway(backend, tmp_path, stories_path, grace_s=120)
    try:
        live = _Streaming(gateway.addr, _long(300))
        assert live.started.wait(120)
        gateway.proc.send_signal(signal.SIGTERM)
        with pytest.raises(grpc.RpcError) as e:  # while draining (or once stopped): UNAVAILABLE
            stream(gateway.addr, make_request("Once", max_tokens=2), timeout=60)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        live.join()
        assert live.error is None, live.error
        assert live.result.token_ids == solo.token_ids and live.result.finish_reason == "length"
        assert gateway.proc.wait(60) == 0
    finally:
        gateway.close()


def test_streams_past_the_grace_period_end_unavailable_and_free_their_kv(backend, stories_path, tmp_path):
    gateway = _Gateway(backend, tmp_path, stories_path, grace_s=0.2)
    try:
        live = _Streaming(gateway.addr, _long(480))
        assert live.started.wait(120)
        gateway.proc.send_signal(signal.SIGTERM)
        live.join()
        if live.error is None:  # finished 480 tokens within 0.2 s: nothing to test on this machine
            pytest.skip("the request finished within the grace period")
        assert live.error.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in live.error.details()
        assert gateway.proc.wait(60) == 0
        deadline = time.monotonic() + 30
        while _scorer_live(backend) != 0:  # the gateway released its sequence before exiting
            assert time.monotonic() < deadline, "the drained sequence's KV cache was not freed"
            time.sleep(0.05)
    finally:
        gateway.close()


def test_two_gateways_sharing_replicas_never_mix_sequences(backend, stories_path, tmp_path):
    """Clients of two gateways send the same request id at the same time:
    sequence ids are namespaced per gateway, so each output is its solo run."""
    # prompts of one token length: a mixed-up sequence would not even show as a
    # context-length mismatch
    prompts = ["Once upon a tree", "The little dog ran", "Lily and Tom played", "One day a bird"]
    solo = [stream(backend.gateway_addr, make_request(p, max_tokens=40, method="ngram"), timeout=300).token_ids
            for p in prompts]
    # two fresh gateways: the same request ids arrive in the same order at both
    gateways = [_Gateway(backend, tmp_path, stories_path, grace_s=1) for _ in range(2)]
    try:
        calls = []
        for i in range(len(prompts)):
            for g, j in zip(gateways, (i, (i + 1) % len(prompts))):  # different prompts, same request id
                request = make_request(prompts[j], max_tokens=40, method="ngram")
                request.request_id = "same-id"
                calls.append((j, _Streaming(g.addr, request)))
        for i, call in calls:
            call.join()
            assert call.error is None, call.error
            assert call.result.token_ids == solo[i]
    finally:
        for g in gateways:
            g.close()


def _maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_a_gateway_maps_no_torch_once_its_tokenizer_class_is_known(backend, stories_path, tmp_path, monkeypatch):
    """The gateway needs only the tokenizer: the first start on a model asks
    AutoTokenizer (which imports torch) and remembers its class; a later one
    loads that class directly, never maps torch, and serves the same tokens."""
    monkeypatch.setenv(TOKENIZER_CACHE_ENV, str(tmp_path / "tokenizers"))  # children inherit it
    request = make_request("Once upon a tree", max_tokens=24, method="ngram")
    want = stream(backend.gateway_addr, request, timeout=300).token_ids
    for first in (True, False):
        gateway = _Gateway(backend, tmp_path, stories_path, grace_s=1)
        try:
            assert _maps_torch(gateway.proc.pid) is first  # the check sees torch where it is there
            assert stream(gateway.addr, request, timeout=300).token_ids == want
        finally:
            gateway.close()
        assert len(list((tmp_path / "tokenizers").glob("*.json"))) == 1


def test_free_port_avoids_the_ephemeral_range_and_never_repeats():
    from specdec import launcher

    lo, hi = launcher._ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert not any(lo <= p <= hi for p in ports)


def test_a_service_whose_port_is_taken_before_it_binds_starts_again_on_new_ones(stories_path, tmp_path,
                                                                               monkeypatch):
    """The CI failure this guards against: between the launcher choosing a
    port and the child binding it, another socket took it, and the child
    exited. Here the scorer's metrics port is taken on purpose. The gateway,
    started beside the scorer with its first address, is started again with
    the new one."""
    import socket

    from specdec import launcher

    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    real, calls = launcher.free_port, []

    def first_metrics_port_taken() -> int:
        calls.append(1)
        return taken if len(calls) == 2 else real()  # call 1: the scorer's gRPC port, 2: its metrics port

    monkeypatch.setattr(launcher, "free_port", first_metrics_port_taken)
    stack = launcher.Stack(model=stories_path, methods="ngram", metrics=True, log_dir=str(tmp_path))
    try:
        stack.start()
        scorer = stack.by_name("scorer")[0]
        assert scorer.metrics_port != taken and f"--metrics-port {taken}" not in " ".join(scorer.cmd)
        assert scorer.metrics()["specdec_scorer_live_sequences"] == 0
        gateway = stack.by_name("gateway")[0]
        assert gateway.cmd[gateway.cmd.index("--scorer") + 1] == scorer.addr and len(stack.services) == 3
        result = stream(stack.gateway_addr, _long(4), timeout=120)
        assert len(result.token_ids) == 4
    finally:
        stack.stop()
        squatter.close()


def test_a_scorer_binds_its_metrics_port_before_its_grpc_server_starts(stories_path, monkeypatch):
    """The CI failure of the test above: the scorer started its gRPC thread,
    said SERVING, and only then found its metrics port taken and exited; the
    launcher had seen it serve and started no new one, and the gateway waited
    for it until the launcher gave up (300 s). Every port is bound before
    the health service can say SERVING: when the metrics port is taken, no
    gRPC server ever started."""
    import threading

    from specdec import servers
    from specdec.cli import build_parser
    from specdec.scorer_svc import server as scorer_server

    grpc_threads_then = []

    def taken(port: int) -> None:
        grpc_threads_then.extend(t.name for t in threading.enumerate() if t.name == "scorer-grpc")
        raise OSError(98, "Address already in use")

    monkeypatch.setattr(servers, "start_metrics", taken)
    args = build_parser().parse_args(["scorer", "--model", stories_path, "--port", str(free_port()),
                                      "--metrics-port", "1"])
    with pytest.raises(OSError, match="Address already in use"):
        scorer_server.serve(args)
    assert grpc_threads_then == []
    assert not any(t.name == "scorer-grpc" for t in threading.enumerate())


def test_waiting_for_a_gateway_fails_at_once_when_a_service_it_needs_has_exited(tmp_path):
    """A gateway whose scorer died would wait for it for --scorer-wait-s
    (600 s) and never serve; the launcher says which service exited instead
    of timing out."""
    from specdec import launcher

    gateway = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    scorer_proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    scorer_proc.wait()
    scorer = launcher.Service("scorer0", f"127.0.0.1:{free_port()}", scorer_proc, log_path=str(tmp_path / "s.log"))
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"gateway waits for scorer0, which exited with code 3 \(its log: "):
            wait_serving(f"127.0.0.1:{free_port()}", gateway, 60, "gateway", needs=[scorer])
        assert time.monotonic() - start < 30
        assert gateway.poll() is None
    finally:
        gateway.kill()
        gateway.wait()


def test_a_gateway_started_before_its_scorer_serves_once_the_scorer_is_up(stories_path, tmp_path):
    """The launcher starts the gateway beside the scorer: a gateway whose
    scorer is not listening yet asks again every 0.2 s (logging the wait at
    most every 5 s) and serves as soon as the scorer answers."""
    from specdec import launcher

    gw_port, scorer_port = free_port(), free_port()
    log = tmp_path / "gateway.log"
    with open(log, "w") as out:
        gateway = subprocess.Popen([sys.executable, "-m", "specdec.cli", "gateway", "--model", stories_path,
                                    "--port", str(gw_port), "--scorer", f"127.0.0.1:{scorer_port}",
                                    "--default-method", "none", "--log-level", "INFO"],
                                   stdout=out, stderr=subprocess.STDOUT)
    scorer = None
    try:
        deadline = time.monotonic() + 60
        while "waiting for scorer" not in log.read_text():
            assert gateway.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        time.sleep(3.0)  # ~15 more asks
        assert log.read_text().count("waiting for scorer") == 1
        scorer = subprocess.Popen([sys.executable, "-m", "specdec.cli", "scorer", "--model", stories_path,
                                   "--port", str(scorer_port)], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        launcher.wait_serving(f"127.0.0.1:{gw_port}", gateway, 120, "gateway")
        request = make_request("Once upon a time", max_tokens=4, method="none")
        request.ignore_eos = True
        assert len(stream(f"127.0.0.1:{gw_port}", request, timeout=60).token_ids) == 4
    finally:
        for proc in (gateway, scorer):
            if proc is not None:
                proc.kill()
                proc.wait(30)


def test_a_gateway_that_exits_only_after_the_scorer_serves_is_started_again(stories_path, tmp_path, monkeypatch):
    """The race CI met: the gateway gave up on the loading scorer but was
    still exiting when the scorer came up (alive at Stack.start's check,
    gone by the time it is waited for). Simulated by ending the first
    gateway just before it is waited for: the stack starts it once more."""
    from specdec import launcher

    ended = []

    def wait(addr, proc, timeout_s, name, tls=None, needs=()):
        if name == "gateway" and not ended:
            ended.append(proc)
            proc.kill()
            proc.wait()
        return wait_serving(addr, proc, timeout_s, name, tls, needs)

    monkeypatch.setattr(launcher, "wait_serving", wait)
    stack = launcher.Stack(model=stories_path, methods="ngram", log_dir=str(tmp_path))
    try:
        stack.start()
        gateways = stack.by_name("gateway")
        assert len(ended) == 1 and len(gateways) == 1 and gateways[0].proc is not ended[0]
        assert len(stream(stack.gateway_addr, _long(4), timeout=120).token_ids) == 4
    finally:
        stack.stop()


def test_a_gateway_that_gave_up_on_a_loading_scorer_is_started_again(stories_path, tmp_path, monkeypatch):
    """Stack.start starts the gateway beside the scorer: a gateway whose
    --scorer-wait-s ran out while the scorer loaded is started again once
    the scorer serves, and the stack comes up and generates."""
    from specdec import launcher

    spawned = []
    spawn = launcher.Stack._spawn_gateway
    monkeypatch.setattr(launcher.Stack, "_spawn_gateway", lambda self, *a: spawned.append(spawn(self, *a)) or
                        spawned[-1])
    stack = launcher.Stack(model=stories_path, methods="ngram", log_dir=str(tmp_path),
                           extra_gateway_args=["--scorer-wait-s", "0.1"])
    try:
        stack.start()
        first, last = spawned[0], spawned[-1]
        assert len(spawned) == 2 and first.proc.returncode not in (None, 0)  # it gave up, exit code of SystemExit
        assert stack.services[-1] is last and len(stack.services) == 3
        result = stream(stack.gateway_addr, _long(4), timeout=120)
        assert len(result.token_ids) == 4
    finally:
        stack.stop()
