"""Shared plumbing of the three gRPC servers: health checking, reflection,
Prometheus metrics, graceful shutdown on SIGINT / SIGTERM."""
from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.protos.v1 import specdec_pb2

log = logging.getLogger(__name__)

#: gRPC message size limit for every server and channel (prompts of long
#: contexts and hidden states can exceed the 4 MB default).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
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


class Server:
    """A grpc.aio server with health and reflection for `service_names`."""

    def __init__(self, host: str, port: int, service_names: list[str]) -> None:
        self.server = grpc.aio.server(options=CHANNEL_OPTIONS)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        full_names = [specdec_pb2.DESCRIPTOR.services_by_name[n].full_name for n in service_names]
        reflection.enable_server_reflection(
            [*full_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        self._names = ["", *full_names]
        self.port = self.server.add_insecure_port(f"{host}:{port}")
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
