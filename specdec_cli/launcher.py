"""Starting the whole stack as separate processes on loopback (`specdec
serve`, the integration tests and the benchmarks use it).

Each service is its own `python -m specdec.cli <service>` process. The
launcher waits until each reports SERVING through grpc.health.v1, and stops
them all (SIGTERM, then SIGKILL) when it exits; children also die with it
(PR_SET_PDEATHSIG), so no process is left behind.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def wait_serving(addr: str, proc: subprocess.Popen | None, timeout_s: float, name: str) -> None:
    """Polls the health service until SERVING; fails early if proc exits."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(addr) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode} before serving")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} at {addr} not SERVING after {timeout_s:.0f} s")
            time.sleep(0.2)


@dataclass
class Service:
    name: str
    addr: str
    proc: subprocess.Popen
    metrics_port: int = 0  # Prometheus /metrics on 127.0.0.1 (0: off)

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
    engine: str = "auto"
    kv_tokens: int | None = None
    default_method: str = "ngram"
    default_k: int = 5
    log_level: str = "WARNING"
    extra_gateway_args: list[str] = field(default_factory=list)
    log_dir: str | None = None  # children's output goes to files here, else inherited
    metrics: bool = False  # give every service a Prometheus port (Service.metrics())
    services: list[Service] = field(default_factory=list)

    @property
    def gateway_addr(self) -> str:
        return next(s.addr for s in self.services if s.name == "gateway")

    def by_name(self, prefix: str) -> list[Service]:
        return [s for s in self.services if s.name.startswith(prefix)]

    def _spawn(self, name: str, args: list[str], port: int) -> Service:
        cmd = [sys.executable, "-m", "specdec.cli", *args, "--port", str(port), "--log-level", self.log_level]
        metrics_port = free_port() if self.metrics else 0
        if metrics_port:
            cmd += ["--metrics-port", str(metrics_port)]
        out = None
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            out = open(os.path.join(self.log_dir, f"{name}.log"), "w")
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None,
                                preexec_fn=_die_with_parent)
        service = Service(name, f"127.0.0.1:{port}", proc, metrics_port)
        self.services.append(service)
        return service

    def start(self, timeout_s: float = 300.0) -> "Stack":
        try:
            scorers = []
            for i in range(self.num_scorers):
                args = ["scorer", "--model", self.model, "--dtype", self.dtype, "--engine", self.engine]
                if self.kv_tokens:
                    args += ["--kv-tokens", str(self.kv_tokens)]
                scorers.append(self._spawn(f"scorer{i}", args, free_port()))
            proposers = [self._spawn(f"proposer{i}", ["proposer", "--methods", self.methods], free_port())
                         for i in range(self.num_proposers)]
            for s in proposers + scorers:
                wait_serving(s.addr, s.proc, timeout_s, s.name)
            gw_args = ["gateway", "--model", self.model, "--scorer", ",".join(s.addr for s in scorers),
                       "--default-method", self.default_method, "--default-k", str(self.default_k),
                       *self.extra_gateway_args]
            if proposers:
                replicas = ",".join(p.addr for p in proposers)
                for method in self.methods.split(","):
                    gw_args += ["--proposer", f"{method}={replicas}"]
            gateway = self._spawn("gateway", gw_args, self.gateway_port or free_port())
            wait_serving(gateway.addr, gateway.proc, timeout_s, "gateway")
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


def serve_command(args) -> int:
    """`specdec serve`: runs the stack until Ctrl-C or SIGTERM."""
    stack = Stack(model=args.model, dtype=args.dtype, methods=args.methods, gateway_port=args.port,
                  engine=args.engine, kv_tokens=args.kv_tokens, default_method=args.default_method,
                  default_k=args.default_k, log_level=args.log_level)
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        if not stopping:
            stopping = True
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    print(f"starting scorer ({args.model}), proposers ({args.methods}) and gateway ...", flush=True)
    try:
        stack.start()
        print(f"specdec gateway ready at {stack.gateway_addr}", flush=True)
        print(f"try: specdec generate --addr {stack.gateway_addr} 'Once upon a time'", flush=True)
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
