"""Shared plumbing of the three gRPC servers: health checking, reflection,
Prometheus metrics, graceful shutdown on SIGINT / SIGTERM."""
from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.limits import MAX_MESSAGE_BYTES
from specdec.protos.v1 import specdec_pb2
from specdec.security import ApiKeyAuth, ApiKeys, DecodeGuard, ServerTls, server_tls_from_args

log = logging.getLogger(__name__)

#: gRPC message size limit for every server and channel
#: (specdec.limits.MAX_MESSAGE_BYTES: prompts of long contexts and target
#: features can exceed the 4 MB default).
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def start_metrics(port: int) -> None:
    """Serves Prometheus metrics on http://0.0.0.0:port/metrics (0: off)."""
    if port:
        from prometheus_client import start_http_server

        start_http_server(port)
        log.info("metrics on :%d/metrics", port)


@dataclass(frozen=True)
class ServerSecurity:
    """What a server's port requires: TLS (mutual when tls.client_ca is set)
    and, on the gateway, API keys."""

    tls: ServerTls | None = None
    api_keys: ApiKeys | None = None


def server_security(args, api_keys: bool = False) -> ServerSecurity:
    """From the --tls-* (and, when api_keys, --api-keys) flags of a service."""
    keys_file = getattr(args, "api_keys", None) if api_keys else None
    return ServerSecurity(server_tls_from_args(args), ApiKeys(keys_file) if keys_file else None)


class Server:
    """A grpc.aio server with health and reflection for `service_names`.
    Every method answers INVALID_ARGUMENT to a message that does not parse."""

    def __init__(self, host: str, port: int, service_names: list[str],
                 security: ServerSecurity | None = None,
                 interceptors: list[grpc.aio.ServerInterceptor] | None = None) -> None:
        """interceptors run after the API key check and before the decode guard."""
        security = security or ServerSecurity()
        interceptors = [*(interceptors or []), DecodeGuard()]
        if security.api_keys is not None:
            interceptors.insert(0, ApiKeyAuth(security.api_keys))
        self.server = grpc.aio.server(options=CHANNEL_OPTIONS, interceptors=interceptors)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        full_names = [specdec_pb2.DESCRIPTOR.services_by_name[n].full_name for n in service_names]
        reflection.enable_server_reflection(
            [*full_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        self._names = ["", *full_names]
        address = f"{host}:{port}"
        self.tls = security.tls is not None
        self.port = (self.server.add_secure_port(address, security.tls.credentials()) if security.tls
                     else self.server.add_insecure_port(address))
        if self.port == 0:
            raise SystemExit(f"cannot bind {host}:{port}")

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in self._names:
            await self.health.set(name, status)

    async def run_until_signal(self, on_stop=None, grace_s: float = 5.0) -> None:
        """Starts the server, marks it SERVING, waits for SIGINT/SIGTERM, then
        marks it NOT_SERVING and stops gracefully."""
        await self.server.start()
        await self.set_serving(True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("stopping")
        await self.set_serving(False)
        if on_stop is not None:
            result = on_stop()
            if asyncio.iscoroutine(result):
                await result
        await self.server.stop(grace_s)
