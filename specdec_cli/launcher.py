"""Starting the whole stack as separate processes on loopback (`specdec
serve`, the integration tests and the benchmarks use it).

Each service is its own `python -m specdec.cli <service>` process. The
launcher waits until each reports SERVING through grpc.health.v1, and stops
them all (SIGTERM, then SIGKILL) when it exits; children also die with it
(PR_SET_PDEATHSIG, which the child sets on itself: see `die_with_launcher`),
so no process is left behind.
"""
from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.gateway.clients import RECONNECT_OPTIONS
from specdec.limits import (
    COLOCATED_DRAFT_THREADS,
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    HEAD_PROJECTION_DTYPE,
    MAX_DECODE_STEPS,
)
from specdec.security import ClientTls, sync_channel

_handed_out: set[int] = set()  # ports free_port gave this process: never twice


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback TCP port that is free now, for a child to listen on.

    Not from the kernel's ephemeral range: a port from there can be taken by
    any outgoing connection between this call and the child's bind (a CI run
    lost a proposer's metrics port that way). Never the same port twice in
    this process. The child may still lose the race: `Stack.start` starts it
    again on new ports when it reports "Address already in use"."""
    lo, _ = _ephemeral_range()
    low = 10000 if lo > 12000 else 1024
    for _ in range(200):
        port = random.randint(low, lo - 1)
        if port not in _handed_out and _bindable(port):
            _handed_out.add(port)
            return port
    with socket.socket() as s:  # a crowded machine: whatever the kernel gives
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _handed_out.add(port)
    return port


def lost_port_race(service: "Service") -> bool:
    """Whether the service exited because a port it was given was taken."""
    if service.proc.poll() is None or not service.log_path:
        return False
    try:
        with open(service.log_path, errors="replace") as f:
            log = f.read()
    except OSError:
        return False
    return any(m in log for m in ("Address already in use", "Failed to bind", "cannot bind"))


#: Set in a child's environment: the launcher's pid, the parent it dies with.
PARENT_PID_ENV = "SPECDEC_PARENT_PID"


def die_with_launcher() -> None:
    """Called first thing in a child: SIGTERM when the launcher dies. The
    child does it itself (not a preexec_fn) so that spawning runs no Python
    between fork and exec: a gRPC process that forks while its threads hold
    locks can abort the child (seen under chaos restarts)."""
    parent = os.environ.pop(PARENT_PID_ENV, None)
    if parent is None:
        return
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != int(parent):  # the launcher died before we could ask
        os.kill(os.getpid(), signal.SIGTERM)


@dataclass(frozen=True)
class StackTls:
    """TLS for a whole stack: every service serves cert/key; scorers and
    proposers accept only clients with a certificate signed by ca, and the
    gateway presents cert/key to them (mutual TLS) and verifies them with ca."""

    cert: str
    key: str
    ca: str

    def client(self) -> ClientTls:
        """How a client outside the stack (or the launcher) verifies it."""
        return ClientTls(ca=self.ca)

    def internal_client(self) -> ClientTls:
        return ClientTls(ca=self.ca, cert=self.cert, key=self.key)

    def server_args(self, mutual: bool) -> list[str]:
        return ["--tls-cert", self.cert, "--tls-key", self.key, *(["--tls-client-ca", self.ca] if mutual else [])]

    def upstream_args(self) -> list[str]:
        return ["--upstream-tls-ca", self.ca, "--tls-client-cert", self.cert, "--tls-client-key", self.key]


#: Seconds between ``wait_serving``'s health checks.
SERVING_POLL_S = 0.1


def wait_serving(addr: str, proc: subprocess.Popen | None, timeout_s: float, name: str,
                 tls: ClientTls | None = None, needs: Sequence[Service] = ()) -> None:
    """Polls the health service until SERVING; fails early if proc exits, or
    one of the services it ``needs`` does (a gateway whose scorer died would
    wait for it until --scorer-wait-s, 600 s by default, and never serve).
    Each check opens a fresh channel: a channel whose connection failed
    (nothing listens yet) waits out gRPC's reconnect backoff before it tries
    again, 0.2-1 s even with RECONNECT_OPTIONS (the default: 1 s, growing
    1.6x), so a service could serve for up to a second before a long-lived
    channel saw it; a fresh one sees it within SERVING_POLL_S. A stories260K
    stack's whole start did not measurably change (14 rounds in turns with the
    one-channel wait: 4.29 s against 4.46, paired ratio 0.99; AMD EPYC, a
    throwaway script); a start's own timing (``bench_start.py``) did."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{name} exited with code {proc.returncode} before serving")
        for dead in [s for s in needs if s.proc.poll() is not None]:
            raise RuntimeError(f"{name} waits for {dead.name}, which exited with code {dead.proc.returncode}"
                               + (f" (its log: {dead.log_path})" if dead.log_path else ""))
        with sync_channel(addr, tls, RECONNECT_OPTIONS) as channel:
            try:
                status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                                   timeout=2).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} at {addr} not SERVING after {timeout_s:.0f} s")
        time.sleep(SERVING_POLL_S)


@dataclass
class Service:
    name: str
    addr: str
    proc: subprocess.Popen
    metrics_port: int = 0  # Prometheus /metrics on 127.0.0.1 (0: off)
    cmd: list[str] = field(default_factory=list)  # how it was started (restart runs it again)
    log_path: str | None = None

    def metrics(self) -> dict[str, float]:
        """The service's current Prometheus samples, keyed like
        ``name{label="value",...}`` (as exposed, labels in exposition order)."""
        import urllib.request

        if not self.metrics_port:
            raise RuntimeError(f"{self.name} was started without a metrics port")
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            return parse_metrics(r.read().decode())

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _popen(cmd: list[str], log_path: str | None, mode: str) -> subprocess.Popen:
    out = None
    if log_path:
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        out = open(log_path, mode)
    env = {**os.environ, PARENT_PID_ENV: str(os.getpid())}
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None, env=env)


def parse_metrics(text: str) -> dict[str, float]:
    """Samples of a Prometheus text exposition, ``{'name{labels}': value}``."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


@dataclass
class Stack:
    """Scorer(s), proposer(s) and a gateway as child processes."""

    model: str
    dtype: str = "float32"
    methods: str = "naive,ngram"
    num_scorers: int = 1
    num_proposers: int = 1
    gateway_port: int = 0
    http_port: int = 0  # the gateway's OpenAI-compatible HTTP API on 127.0.0.1 (0: off)
    engine: str = "auto"
    kv_tokens: int | None = None
    kv_dtype: str = "auto"  # the scorers' --kv-dtype
    default_method: str = "ngram"
    default_k: int = DEFAULT_NUM_SPECULATIVE_TOKENS  # the gateway's --default-k
    log_level: str = "WARNING"
    extra_gateway_args: list[str] = field(default_factory=list)
    extra_scorer_args: list[str] = field(default_factory=list)
    # more arguments for scorer i alone (e.g. replicas of different --gemm paths); beyond the list: none
    scorer_args_each: list[list[str]] = field(default_factory=list)
    # a draft proposer process of its own serves the model-draft methods
    # (registry.MODEL_METHODS) with this draft LM; the other proposers the rest
    draft_model: str | None = None
    eagle3: str | None = None  # the copying proposers also serve eagle3 with this EAGLE-3 head directory
    draft_dtype: str | None = None  # the draft model's dtype and the heads' projection weights (None: dtype)
    extra_proposer_args: list[str] = field(default_factory=list)
    extra_draft_args: list[str] = field(default_factory=list)  # the draft proposer's only, e.g. --draft-device cuda
    # --draft-threads of the proposers that draft with a model (draft model, eagle3/mtp head; None: their default)
    draft_threads: int | None = COLOCATED_DRAFT_THREADS
    log_dir: str | None = None  # children's output goes to files here, else inherited
    metrics: bool = False  # give every service a Prometheus port (Service.metrics())
    tls: StackTls | None = None  # None: plaintext everywhere
    api_keys_file: str | None = None  # the gateway requires a key from this file
    services: list[Service] = field(default_factory=list)

    @property
    def gateway_addr(self) -> str:
        return next(s.addr for s in self.services if s.name == "gateway")

    @property
    def http_url(self) -> str:
        """Base URL of the OpenAI API (``.../v1``), when started with http_port."""
        if not self.http_port:
            raise RuntimeError("the stack was started without an HTTP port")
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.http_port}/v1"

    def by_name(self, prefix: str) -> list[Service]:
        return [s for s in self.services if s.name.startswith(prefix)]

    def _spawn(self, name: str, args: list[str], port: int, command: list[str] | None = None) -> Service:
        """Starts ``specdec ARGS`` (``command``: what runs the command line
        instead, e.g. a benchmark's copy of a package, benchmarks/package_copy.py)."""
        cmd = [*(command or [sys.executable, "-m", "specdec.cli"]), *args, "--port", str(port),
               "--log-level", self.log_level]
        if self.tls:
            cmd += self.tls.server_args(mutual=name != "gateway")
        metrics_port = free_port() if self.metrics else 0
        if metrics_port:
            cmd += ["--metrics-port", str(metrics_port)]
        log_path = os.path.join(self.log_dir, f"{name}.log") if self.log_dir else None
        service = Service(name, f"127.0.0.1:{port}", _popen(cmd, log_path, "w"), metrics_port, cmd, log_path)
        self.services.append(service)
        return service

    def _respawn_gateway(self, gateway: Service, *backends) -> Service:
        """Stops the gateway (if it still runs) and starts a new one (``_spawn_gateway``'s arguments)."""
        gateway.stop()
        self.services.remove(gateway)
        return self._spawn_gateway(*backends)

    def _wait(self, service: Service, timeout_s: float, tls: ClientTls | None, fixed_port: bool = False,
              needs: Sequence[Service] = ()) -> None:
        """Waits until the service serves; a service that lost one of its
        ports to another socket before binding it is started again on new
        ones (twice at most). Fails as soon as one it ``needs`` exits."""
        for attempt in range(3):
            try:
                wait_serving(service.addr, service.proc, timeout_s, service.name, tls, needs)
                return
            except RuntimeError:
                if attempt == 2 or not lost_port_race(service):
                    raise
            self._respawn_on_new_ports(service, fixed_port)

    def _respawn_on_new_ports(self, service: Service, fixed_port: bool) -> None:
        cmd = list(service.cmd)
        flags = ["--metrics-port"] + ([] if fixed_port else ["--port"])
        for flag in flags:
            if flag in cmd:
                cmd[cmd.index(flag) + 1] = str(free_port())
        print(f"{service.name} lost a port to another socket before binding it; starting it again on new ports",
              file=sys.stderr, flush=True)
        service.cmd = cmd
        service.addr = f"127.0.0.1:{cmd[cmd.index('--port') + 1]}"
        if "--metrics-port" in cmd:
            service.metrics_port = int(cmd[cmd.index("--metrics-port") + 1])
        service.proc = _popen(cmd, service.log_path, "w")

    def restart(self, service: Service, timeout_s: float = 300.0) -> None:
        """Starts a stopped or killed service again on the same port and
        waits until it serves (chaos tests: the gateway finds it again).
        Call it from a thread that outlives the service: children die with
        the thread that started them (PR_SET_PDEATHSIG)."""
        if service.proc.poll() is None:
            raise RuntimeError(f"{service.name} is still running")
        service.proc = _popen(service.cmd, service.log_path, "a")
        tls = self.tls.internal_client() if self.tls else None
        if service.name == "gateway":
            tls = self.tls.client() if self.tls else None
        wait_serving(service.addr, service.proc, timeout_s, service.name, tls)

    def _split_methods(self) -> tuple[list[str], list[str]]:
        """(methods of the copying proposers, methods of the draft proposer
        process); the latter is empty without a draft model."""
        from specdec.proposer_svc.registry import MODEL_METHODS

        methods = self.methods.split(",")
        if not self.draft_model:
            return methods, []
        return ([m for m in methods if m not in MODEL_METHODS],
                [m for m in methods if m in MODEL_METHODS])

    def _proposer_args(self, methods: list[str]) -> list[str]:
        args = ["proposer", "--methods", ",".join(methods), *self.extra_proposer_args]
        if self.eagle3 and "eagle3" in methods:
            args += ["--eagle3", self.eagle3]
        if "eagle3" in methods or "mtp" in methods:  # feature heads read the target's embeddings
            args += ["--target-model", self.model, "--draft-dtype", self.draft_dtype or HEAD_PROJECTION_DTYPE,
                     *self._threads()]
        return args

    def _draft_proposer_args(self, methods: list[str]) -> list[str]:
        assert self.draft_model is not None
        return [*self._proposer_args(methods), "--draft-model", self.draft_model, "--target-model", self.model,
                "--draft-dtype", self.draft_dtype or self.dtype, *self._threads(), *self.extra_draft_args]

    def _threads(self) -> list[str]:
        """A model-drafting proposer's --draft-threads (a draft model's, a feature head's)."""
        return [] if self.draft_threads is None else ["--draft-threads", str(self.draft_threads)]

    def _spawn_gateway(self, scorers: list[Service], copy_methods: list[str], proposers: list[Service],
                       draft_methods: list[str], drafters: list[Service]) -> Service:
        args = ["gateway", "--model", self.model, "--scorer", ",".join(s.addr for s in scorers),
                "--default-method", self.default_method, "--default-k", str(self.default_k),
                *self.extra_gateway_args]
        if self.http_port:
            args += ["--http-port", str(self.http_port)]
        for methods, replicas in ((copy_methods, proposers), (draft_methods, drafters)):
            for method in methods if replicas else ():
                args += ["--proposer", f"{method}={','.join(p.addr for p in replicas)}"]
        if self.tls:
            args += self.tls.upstream_args()
        if self.api_keys_file:
            args += ["--api-keys", self.api_keys_file]
        return self._spawn("gateway", args, self.gateway_port or free_port())

    def start(self, timeout_s: float = 300.0) -> "Stack":
        try:
            scorers = []
            for i in range(self.num_scorers):
                args = ["scorer", "--model", self.model, "--dtype", self.dtype, "--engine", self.engine,
                        "--kv-dtype", self.kv_dtype]
                if self.kv_tokens:
                    args += ["--kv-tokens", str(self.kv_tokens)]
                args += self.extra_scorer_args
                args += self.scorer_args_each[i] if i < len(self.scorer_args_each) else []
                scorers.append(self._spawn(f"scorer{i}", args, free_port()))
            copy_methods, draft_methods = self._split_methods()
            proposers = [self._spawn(f"proposer{i}", self._proposer_args(copy_methods), free_port())
                         for i in range(self.num_proposers if copy_methods else 0)]
            drafters = [self._spawn("proposer-draft", self._draft_proposer_args(draft_methods), free_port())
                        for _ in draft_methods[:1]]
            backends = proposers + drafters + scorers
            # The gateway starts beside them, not after: its start (imports, the tokenizer) takes as long as a
            # small scorer's, and it waits for a scorer itself (fetch_limits). A stories260K stack came up in
            # ~11 s with the gateway after the others, in ~7 with it beside them (AMD EPYC, 2 cores).
            gateway = self._spawn_gateway(scorers, copy_methods, proposers, draft_methods, drafters)
            addrs = [s.addr for s in backends]
            for s in backends:
                self._wait(s, timeout_s, self.tls.internal_client() if self.tls else None)
            # one lost a port race and moved (tell the gateway), or the gateway gave up waiting for a scorer
            # (--scorer-wait-s) while a slow one loaded: start it again
            respawn = lambda: self._respawn_gateway(gateway, scorers, copy_methods, proposers, draft_methods,
                                                    drafters)
            if [s.addr for s in backends] != addrs or gateway.proc.poll() is not None:
                gateway = respawn()
            try:
                self._wait(gateway, timeout_s, self.tls.client() if self.tls else None,
                           fixed_port=bool(self.gateway_port), needs=backends)
            except RuntimeError:
                if gateway.proc.poll() is None:
                    raise
                # it gave up on the scorers but was still exiting when they came up: once more, now that they
                # serve (a gateway that fails for another reason fails again)
                gateway = respawn()
                self._wait(gateway, timeout_s, self.tls.client() if self.tls else None,
                           fixed_port=bool(self.gateway_port), needs=backends)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for s in reversed(self.services):
            s.stop()

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def head_feature_layers(head_dir: str, model: str) -> tuple[int, ...]:
    """The target layers an EAGLE-3 head reads, sorted, each once (as the
    scorer asks its engine for them): its config's, else EAGLE-3's default
    for the target's layer count in the model's config.json. () where
    neither can be read: the eagle3 proposer names what is wrong with the
    head, and the scorer captures those graphs the first time a round asks."""
    import json
    from pathlib import Path

    from specdec.models import resolve_model
    from specdec.proposer_svc.eagle3 import eagle3_layer_ids

    try:
        config = json.loads((Path(head_dir) / "config.json").read_text())
        target = json.loads((Path(resolve_model(model).path) / "config.json").read_text())
        return tuple(sorted(set(eagle3_layer_ids(config, int(target["num_hidden_layers"])))))
    except (OSError, ValueError, KeyError, TypeError):
        return ()


def serve_command(args) -> int:
    """`specdec serve`: runs the stack until Ctrl-C or SIGTERM."""
    tls = None
    if args.tls_cert or args.tls_key or args.tls_ca:
        if not (args.tls_cert and args.tls_key and args.tls_ca):
            raise SystemExit("serve: --tls-cert, --tls-key and --tls-ca go together")
        tls = StackTls(args.tls_cert, args.tls_key, args.tls_ca)
    if not 1 <= args.decode_steps <= MAX_DECODE_STEPS:  # refused here, not by a gateway started minutes later
        raise SystemExit(f"serve: --decode-steps must be in 1..{MAX_DECODE_STEPS}, got {args.decode_steps}")
    if not 0 <= args.decode_chunk_ms < float("inf"):
        raise SystemExit(f"serve: --decode-chunk-ms must be >= 0, got {args.decode_chunk_ms}")
    if args.draft_threads < 1:  # likewise, not by a draft proposer started after the scorer
        raise SystemExit(f"serve: --draft-threads must be >= 1, got {args.draft_threads}")
    if args.draft_model:
        from specdec.cli import check_draft_dtype

        check_draft_dtype("serve", args.draft_dtype)
    from specdec.engine.factory import check_device

    try:
        check_device(args.device)  # likewise, not by a scorer started after the proposers
    except ValueError as e:
        raise SystemExit(f"serve: --device: {e}") from None
    methods = args.methods
    if args.draft_model:  # a draft proposer process serves these
        from specdec.proposer_svc.registry import MODEL_METHODS

        methods = ",".join(dict.fromkeys([*methods.split(","), *MODEL_METHODS]))
    if args.eagle3:  # the EAGLE-3 head runs in the copying proposers
        methods = ",".join(dict.fromkeys([*methods.split(","), "eagle3"]))
    scorer_args = ["--device", args.device]
    if args.device == "cuda" and args.eagle3:  # the head's rounds replay graphs captured before serving
        layers = head_feature_layers(args.eagle3, args.model)
        if layers:
            scorer_args += ["--feature-layers", ",".join(map(str, layers))]
    stack = Stack(model=args.model, dtype=args.dtype, methods=methods, gateway_port=args.port,
                  http_port=args.http_port,
                  engine=args.engine, kv_tokens=args.kv_tokens, kv_dtype=args.kv_dtype,
                  default_method=args.default_method,
                  default_k=args.default_k, log_level=args.log_level, tls=tls, api_keys_file=args.api_keys,
                  draft_model=args.draft_model, eagle3=args.eagle3, draft_dtype=args.draft_dtype,
                  draft_threads=args.draft_threads,
                  extra_gateway_args=["--decode-steps", str(args.decode_steps),
                                      "--decode-chunk-ms", str(args.decode_chunk_ms)],
                  extra_scorer_args=scorer_args)
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        if not stopping:
            stopping = True
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    print(f"starting scorer ({args.model}), proposers ({methods}) and gateway ...", flush=True)
    try:
        stack.start()
        print(f"specdec gateway ready at {stack.gateway_addr}", flush=True)
        extra = (f" --tls-ca {args.tls_ca}" if tls else "") + (" --api-key KEY" if args.api_keys else "")
        print(f"try: specdec generate --addr {stack.gateway_addr}{extra} 'Once upon a time'", flush=True)
        if args.http_port:
            print(f"specdec OpenAI-compatible HTTP API ready at {stack.http_url}", flush=True)
        while all(s.proc.poll() is None for s in stack.services):
            time.sleep(0.5)
        dead = [s.name for s in stack.services if s.proc.poll() is not None]
        print(f"service(s) exited: {', '.join(dead)}; stopping the rest", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stopping ...", flush=True)
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stack.stop()
