"""Transport security and request admission at the gRPC edge, shared by the
three services:

- TLS server credentials that re-read the certificate files when they change
  (Kubernetes rotates Secrets in place), with optional client-certificate
  verification (mutual TLS: scorer and proposers accept only the gateway);
- TLS channel credentials for the gateway's and the CLI's channels;
- an interceptor that answers a message that does not parse with
  INVALID_ARGUMENT (gRPC's default is UNKNOWN) on every service;
- an interceptor that requires an API key (``authorization: Bearer KEY``) on
  the gateway, keys kept only as SHA-256 digests and compared in constant
  time; health and reflection stay open.

Nothing here knows about speculation: the servers install these at start.
"""
from __future__ import annotations

import hashlib
import hmac
import inspect
import logging
import os
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

#: Services that never need an API key (probes and tooling).
OPEN_SERVICE_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


# ---- TLS ---------------------------------------------------------------------------


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def _mtimes(*paths: str | None) -> tuple[float, ...]:
    return tuple(os.stat(p).st_mtime_ns if p else 0 for p in paths)


@dataclass(frozen=True)
class ServerTls:
    """--tls-cert/--tls-key (PEM) serve TLS; --tls-client-ca (PEM) makes it
    mutual: clients must present a certificate signed by that CA."""

    cert: str
    key: str
    client_ca: str | None = None

    def check(self) -> None:
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-client-ca", self.client_ca)):
            if path and not os.path.isfile(path):
                raise SystemExit(f"{flag}: no such file: {path}")

    def _configuration(self):
        return grpc.ssl_server_certificate_configuration(
            [(_read(self.key), _read(self.cert))], root_certificates=_read(self.client_ca))

    def credentials(self) -> grpc.ServerCredentials:
        """Credentials that gRPC asks for a fresh configuration on each new
        handshake; files are re-read only when one of them changed, so a
        rotated certificate takes effect without a restart."""
        self.check()
        state = {"mtimes": _mtimes(self.cert, self.key, self.client_ca)}
        lock = threading.Lock()

        def fetch():
            with lock:
                try:
                    now = _mtimes(self.cert, self.key, self.client_ca)
                    if now == state["mtimes"]:
                        return None  # unchanged: keep the current configuration
                    config = self._configuration()
                except (OSError, ValueError) as e:  # half-written during rotation: retry on the next handshake
                    log.warning("TLS files changed but cannot be read yet (%s); keeping the old ones", e)
                    return None
                state["mtimes"] = now
                log.info("TLS certificate reloaded from %s", self.cert)
                return config

        return grpc.dynamic_ssl_server_credentials(
            self._configuration(), fetch, require_client_authentication=self.client_ca is not None)


class CertReloader:
    """Keeps an ssl.SSLContext serving the certificate files' current content:
    poll() re-loads them into the same context when they changed, so new
    handshakes get a rotated certificate without a restart (the HTTP port's
    counterpart of ServerTls.credentials)."""

    def __init__(self, tls: ServerTls, context: ssl.SSLContext) -> None:
        self.tls, self.context = tls, context
        self._mtimes = _mtimes(tls.cert, tls.key)

    def poll(self) -> bool:
        """True when the certificate was re-loaded."""
        try:
            now = _mtimes(self.tls.cert, self.tls.key)
            if now == self._mtimes:
                return False
            self.context.load_cert_chain(self.tls.cert, self.tls.key)
        except (OSError, ssl.SSLError) as e:  # half-written during rotation: retry on the next poll
            log.warning("TLS files changed but cannot be loaded yet (%s); keeping the old ones", e)
            return False
        self._mtimes = now
        log.info("TLS certificate reloaded from %s", self.tls.cert)
        return True


def server_tls_from_args(args) -> ServerTls | None:
    cert, key = getattr(args, "tls_cert", None), getattr(args, "tls_key", None)
    client_ca = getattr(args, "tls_client_ca", None)
    if not cert and not key:
        if client_ca:
            raise SystemExit("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if not (cert and key):
        raise SystemExit("--tls-cert and --tls-key go together")
    return ServerTls(cert, key, client_ca)


@dataclass(frozen=True)
class ClientTls:
    """How a client verifies a server (--tls-ca; None: the system roots) and,
    for mutual TLS, the certificate it presents (--tls-client-cert/-key).
    server_name overrides the name checked against the server's certificate
    (e.g. when dialling a pod IP)."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(_read(self.ca), _read(self.key), _read(self.cert))

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def client_tls_from_args(args) -> ClientTls | None:
    """The gateway's outgoing TLS: --upstream-tls-ca (and for mutual TLS
    --tls-client-cert/--tls-client-key); None when none is given."""
    ca = getattr(args, "upstream_tls_ca", None)
    cert, key = getattr(args, "tls_client_cert", None), getattr(args, "tls_client_key", None)
    if bool(cert) != bool(key):
        raise SystemExit("--tls-client-cert and --tls-client-key go together")
    if not (ca or cert):
        return None
    for flag, path in (("--upstream-tls-ca", ca), ("--tls-client-cert", cert), ("--tls-client-key", key)):
        if path and not os.path.isfile(path):
            raise SystemExit(f"{flag}: no such file: {path}")
    return ClientTls(ca, cert, key, getattr(args, "upstream_tls_server_name", None))


def aio_channel(addr: str, tls: ClientTls | None, options: list) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(addr, options=options)
    return grpc.aio.secure_channel(addr, tls.credentials(), options=[*options, *tls.options()])


def sync_channel(addr: str, tls: ClientTls | None, options: list) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(addr, options=options)
    return grpc.secure_channel(addr, tls.credentials(), options=[*options, *tls.options()])


# ---- interceptors ------------------------------------------------------------------


class _Undecodable:
    """Stands for a request message that did not parse."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _safe_deserializer(deserialize):
    if deserialize is None:
        return None

    def run(data: bytes):
        try:
            return deserialize(data)
        except Exception as e:  # noqa: BLE001 - any parse failure is the client's bad input
            return _Undecodable(e)

    return run


async def _abort_undecodable(context, request: _Undecodable) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"request: the message does not parse as this method's request type "
                        f"({type(request.error).__name__})")


async def _checked_stream(requests, context):
    async for request in requests:
        if isinstance(request, _Undecodable):
            await _abort_undecodable(context, request)
        yield request


def _rewrap(handler: grpc.RpcMethodHandler, unary_unary=None, unary_stream=None, stream_unary=None,
            stream_stream=None) -> grpc.RpcMethodHandler:
    """handler with its behaviour replaced by the one of its own kind given
    (the others must be None) and a request deserializer that never raises."""
    kwargs = dict(request_deserializer=_safe_deserializer(handler.request_deserializer),
                  response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary_unary, **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(unary_stream, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(stream_unary, **kwargs)
    return grpc.stream_stream_rpc_method_handler(stream_stream, **kwargs)


async def _drain(result):
    """Yields what a unary-response-stream behaviour produces, whether it is
    an async generator or a coroutine that writes through the context."""
    if inspect.isasyncgen(result):
        async for item in result:
            yield item
    else:
        await result


def guard_decoding(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """handler, answering INVALID_ARGUMENT for a request that does not parse."""
    if handler.unary_unary:
        inner_uu = handler.unary_unary

        async def unary_unary(request, context):
            if isinstance(request, _Undecodable):
                await _abort_undecodable(context, request)
            return await inner_uu(request, context)

        return _rewrap(handler, unary_unary=unary_unary)
    if handler.unary_stream:
        inner_us = handler.unary_stream

        async def unary_stream(request, context):
            if isinstance(request, _Undecodable):
                await _abort_undecodable(context, request)
            async for item in _drain(inner_us(request, context)):
                yield item

        return _rewrap(handler, unary_stream=unary_stream)
    if handler.stream_unary:
        inner_su = handler.stream_unary

        async def stream_unary(requests, context):
            return await inner_su(_checked_stream(requests, context), context)

        return _rewrap(handler, stream_unary=stream_unary)
    inner_ss = handler.stream_stream

    async def stream_stream(requests, context):
        async for item in _drain(inner_ss(_checked_stream(requests, context), context)):
            yield item

    return _rewrap(handler, stream_stream=stream_stream)


def _refuse(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A handler of handler's kind that ends the call with code at once."""

    async def unary(request, context):
        await context.abort(code, details)

    async def streaming(request, context):
        await context.abort(code, details)
        yield  # pragma: no cover - makes this an async generator

    return _rewrap(handler, unary_unary=unary, unary_stream=streaming, stream_unary=unary,
                   stream_stream=streaming)


class DecodeGuard(grpc.aio.ServerInterceptor):
    """Every method answers INVALID_ARGUMENT when its request does not parse."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        return None if handler is None else guard_decoding(handler)


def hash_key(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    """API keys read from a file (one per line; blank lines and lines starting
    with # ignored), kept only as SHA-256 digests. The file is re-read when it
    changes, so revoking a key takes effect without a restart."""

    def __init__(self, path: str) -> None:
        if not os.path.isfile(path):
            raise SystemExit(f"--api-keys: no such file: {path}")
        self.path = path
        self._mtime = -1
        self._digests: list[bytes] = []
        self._lock = threading.Lock()
        self._reload()
        if not self._digests:
            raise SystemExit(f"--api-keys: {path} holds no key")

    def _reload(self) -> None:
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except OSError as e:
            log.warning("cannot stat the API key file (%s); keeping the loaded keys", e)
            return
        if mtime == self._mtime:
            return
        lines = Path(self.path).read_text().splitlines()
        self._digests = [hash_key(k.strip()) for k in lines if k.strip() and not k.lstrip().startswith("#")]
        self._mtime = mtime
        log.info("API keys: %d loaded from %s", len(self._digests), self.path)

    def valid(self, key: str) -> bool:
        """Constant time in the key: every stored digest is compared."""
        with self._lock:
            self._reload()
            digest = hash_key(key)
            match = False
            for stored in self._digests:
                match |= hmac.compare_digest(stored, digest)
            return match


def bearer_key(metadata) -> str | None:
    for name, value in metadata or ():
        if name == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer "):].strip()
    return None


class ApiKeyAuth(grpc.aio.ServerInterceptor):
    """Requires ``authorization: Bearer KEY`` on every method but health and
    reflection: UNAUTHENTICATED when missing or unknown."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_SERVICE_PREFIXES):
            return handler
        key = bearer_key(handler_call_details.invocation_metadata)
        if key is None:
            return _refuse(handler, grpc.StatusCode.UNAUTHENTICATED,
                           "authorization: missing API key (send 'authorization: Bearer KEY')")
        if not self.keys.valid(key):
            return _refuse(handler, grpc.StatusCode.UNAUTHENTICATED, "authorization: unknown API key")
        return handler
