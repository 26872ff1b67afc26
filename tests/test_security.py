"""Transport security, API keys and undecodable input, on real processes.

Certificates are made here with `cryptography` (a CA, and a leaf for
127.0.0.1/localhost usable as server and client certificate). TLS tests run
on proposer processes (no model to load); the end-to-end test runs a whole
stories260K stack with mutual TLS inside and API keys on the gateway."""
from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import random
import ssl
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from conftest import hf_greedy, start_stack
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.launcher import StackTls, free_port, wait_serving
from specdec.protos.v1 import specdec_pb2 as pb
from specdec.protos.v1 import specdec_pb2_grpc as pb_grpc
from specdec.security import ClientTls, sync_channel

# a fresh channel per call must do a fresh handshake (no shared subchannel)
FRESH = [("grpc.use_local_subchannel_pool", 1)]


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_pki(folder: Path, name: str) -> tuple[str, str, str]:
    """(ca.pem, leaf.pem, leaf.key) under folder/name: a CA and a leaf it signed
    for 127.0.0.1 and localhost, valid for server and client authentication."""
    folder = folder / name
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"specdec test CA {name}")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = folder / "ca.pem", folder / "leaf.pem", folder / "leaf.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(_pem_key(key))
    return tuple(str(p) for p in paths)  # type: ignore[return-value]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    return {name: make_pki(root, name) for name in ("a", "b")}


def _health(addr: str, tls: ClientTls | None, timeout: float = 5.0) -> int:
    with sync_channel(addr, tls, FRESH) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout).status


def _refused(addr: str, tls: ClientTls | None) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        _health(addr, tls, timeout=3.0)
    return e.value.code()


class _Proposer:
    """A proposer process with the given extra arguments."""

    def __init__(self, tmp_path: Path, *args: str, ready_tls: ClientTls | None = None) -> None:
        self.addr = f"127.0.0.1:{free_port()}"
        self.log = open(tmp_path / f"proposer-{self.addr.split(':')[1]}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specdec.cli", "proposer", "--methods", "ngram", "--port",
             self.addr.split(":")[1], *args], stdout=self.log, stderr=subprocess.STDOUT)
        wait_serving(self.addr, self.proc, 120, "proposer", ready_tls)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def test_tls_port_refuses_plaintext_and_unknown_ca(pki, tmp_path):
    ca, cert, key = pki["a"]
    other_ca = pki["b"][0]
    p = _Proposer(tmp_path, "--tls-cert", cert, "--tls-key", key, ready_tls=ClientTls(ca=ca))
    try:
        assert _health(p.addr, ClientTls(ca=ca)) == health_pb2.HealthCheckResponse.SERVING
        assert _refused(p.addr, None) == grpc.StatusCode.UNAVAILABLE  # plaintext client
        assert _refused(p.addr, ClientTls(ca=other_ca)) == grpc.StatusCode.UNAVAILABLE  # wrong CA
    finally:
        p.stop()


def test_mutual_tls_refuses_client_without_certificate(pki, tmp_path):
    ca, cert, key = pki["a"]
    b_ca, b_cert, b_key = pki["b"]
    client = ClientTls(ca=ca, cert=cert, key=key)
    p = _Proposer(tmp_path, "--tls-cert", cert, "--tls-key", key, "--tls-client-ca", ca, ready_tls=client)
    try:
        assert _health(p.addr, client) == health_pb2.HealthCheckResponse.SERVING
        assert _refused(p.addr, ClientTls(ca=ca)) == grpc.StatusCode.UNAVAILABLE  # no client certificate
        # a certificate from another CA is not the gateway's
        assert _refused(p.addr, ClientTls(ca=ca, cert=b_cert, key=b_key)) == grpc.StatusCode.UNAVAILABLE
        # the chart's probe command: `specdec health` over mutual TLS, checking the name
        probe = [sys.executable, "-m", "specdec.cli", "health", "--addr", p.addr, "--tls-ca", ca]
        with_cert = probe + ["--tls-client-cert", cert, "--tls-client-key", key, "--tls-server-name", "localhost"]
        ok = subprocess.run(with_cert, capture_output=True, text=True, timeout=60)
        assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stderr
        assert subprocess.run(probe, capture_output=True, timeout=60).returncode == 1
        wrong_name = with_cert[:-1] + ["other.example"]
        assert subprocess.run(wrong_name, capture_output=True, timeout=60).returncode == 1
    finally:
        p.stop()


def test_certificate_rotation_without_restart(pki, tmp_path):
    """The server's certificate files are replaced in place (as a Kubernetes
    Secret update does): new connections get the new certificate."""
    a_ca, a_cert, a_key = pki["a"]
    b_ca, b_cert, b_key = pki["b"]
    live = tmp_path / "live"
    live.mkdir()
    cert, key = live / "tls.crt", live / "tls.key"
    cert.write_bytes(Path(a_cert).read_bytes())
    key.write_bytes(Path(a_key).read_bytes())
    p = _Proposer(tmp_path, "--tls-cert", str(cert), "--tls-key", str(key), ready_tls=ClientTls(ca=a_ca))
    try:
        pid = p.proc.pid
        assert _refused(p.addr, ClientTls(ca=b_ca)) == grpc.StatusCode.UNAVAILABLE
        time.sleep(0.05)  # distinct mtimes on coarse filesystems
        key.write_bytes(Path(b_key).read_bytes())
        cert.write_bytes(Path(b_cert).read_bytes())
        deadline = time.monotonic() + 30
        while True:
            try:
                assert _health(p.addr, ClientTls(ca=b_ca), timeout=3.0) == health_pb2.HealthCheckResponse.SERVING
                break
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert _refused(p.addr, ClientTls(ca=a_ca)) == grpc.StatusCode.UNAVAILABLE  # old certificate gone
        assert p.proc.pid == pid and p.proc.poll() is None  # same process: no restart
    finally:
        p.stop()


def test_tls_flags_checked_at_start(pki, tmp_path):
    ca, cert, key = pki["a"]
    for args, message in [(["--tls-cert", cert], "--tls-cert and --tls-key go together"),
                          (["--tls-cert", cert, "--tls-key", str(tmp_path / "missing.key")], "--tls-key"),
                          (["--tls-client-ca", ca], "--tls-client-ca needs --tls-cert")]:
        proc = subprocess.run([sys.executable, "-m", "specdec.cli", "proposer", "--port", "0", *args],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and message in proc.stderr, (args, proc.stderr[-2000:])


# ---- undecodable messages ---------------------------------------------------------

GARBAGE = [b"\xff\xff\xff\xff", b"\x0a\x05ab", b"\x08", bytes(range(200, 256))]


def _raw_unary(channel: grpc.Channel, method: str, data: bytes, metadata=None) -> grpc.StatusCode:
    call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
    try:
        call(data, timeout=10, metadata=metadata)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def _raw_unary_stream(channel: grpc.Channel, method: str, data: bytes, metadata=None) -> grpc.StatusCode:
    call = channel.unary_stream(method, request_serializer=None, response_deserializer=None)
    try:
        for _ in call(data, timeout=30, metadata=metadata):
            pass
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def test_undecodable_messages_are_invalid_argument_on_proposer(tmp_path):
    p = _Proposer(tmp_path)
    try:
        with grpc.insecure_channel(p.addr) as channel:
            call = channel.stream_stream("/specdec.v1.Proposer/Propose", request_serializer=None,
                                         response_deserializer=None)
            for data in GARBAGE:
                with pytest.raises(grpc.RpcError) as e:
                    list(call(iter([data]), timeout=10))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
                assert "request" in e.value.details()
            # and the proposer still serves a well-formed stream
            good = pb_grpc.ProposerStub(channel).Propose(iter([pb.ProposeRequest(batch_id=1)]), timeout=10)
            assert [r.batch_id for r in good] == [1]
    finally:
        p.stop()


# ---- the whole stack: mutual TLS inside, API keys on the gateway ------------------


@pytest.fixture(scope="module")
def secure_stack(stories_path, pki, tmp_path_factory):
    ca, cert, key = pki["a"]
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text("# test keys\nkey-one\n\nkey-two\n")
    stack = start_stack(stories_path, tmp_path_factory, "secure", methods="ngram",
                        tls=StackTls(cert, key, ca), api_keys_file=str(keys), http_port=free_port())
    yield stack, keys
    stack.stop()


def _request(prompt_ids: list[int], max_tokens: int = 24, method: str = "ngram") -> pb.GenerateRequest:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt_ids), max_tokens=max_tokens)
    request.speculation.method = method
    return request


def _assert_target_greedy(gen, model_path: str) -> None:
    """The whole output is the target's greedy continuation (the prompt runs
    to the length limit, so there is no stop to compare)."""
    assert gen.finish_reason == "length"
    assert gen.token_ids == hf_greedy(model_path, tuple(PROMPT), 24)


def _generate(addr: str, request: pb.GenerateRequest, tls: ClientTls | None, key: str | None):
    from specdec.client import stream

    return stream(addr, request, timeout=120, tls=tls, api_key=key)


PROMPT = [1, 403, 407, 261, 378, 344, 287, 427]


def test_secure_stack_generates_the_target_greedy_output(secure_stack, stories_path, pki):
    stack, _ = secure_stack
    tls = ClientTls(ca=pki["a"][0])
    _assert_target_greedy(_generate(stack.gateway_addr, _request(PROMPT), tls, "key-one"), stories_path)
    with pytest.raises(grpc.RpcError) as e:  # plaintext to the gateway's TLS port
        _generate(stack.gateway_addr, _request(PROMPT), None, "key-one")
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_internal_services_accept_only_the_gateway(secure_stack, pki):
    """Scorer and proposer run mutual TLS: a client with the CA but without
    the gateway's certificate cannot reach them."""
    stack, _ = secure_stack
    ca = pki["a"][0]
    for service in stack.by_name("scorer") + stack.by_name("proposer"):
        assert _refused(service.addr, ClientTls(ca=ca)) == grpc.StatusCode.UNAVAILABLE, service.name
        assert _refused(service.addr, None) == grpc.StatusCode.UNAVAILABLE, service.name


def test_api_keys_missing_wrong_and_revoked(secure_stack, pki):
    stack, keys = secure_stack
    tls = ClientTls(ca=pki["a"][0])
    for key, message in [(None, "missing API key"), ("nope", "unknown API key"), ("key-one ", None)]:
        if message is None:  # surrounding whitespace in the header is not part of the key
            assert _generate(stack.gateway_addr, _request(PROMPT, 4), tls, key).token_ids
            continue
        with pytest.raises(grpc.RpcError) as e:
            _generate(stack.gateway_addr, _request(PROMPT, 4), tls, key)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and message in e.value.details()
    # health and reflection stay open without a key
    assert _health(stack.gateway_addr, tls) == health_pb2.HealthCheckResponse.SERVING
    # revoke key-one, keep key-two: takes effect without a restart
    keys.write_text("key-two\n")
    os.utime(keys, ns=(time.time_ns(), time.time_ns() + 10**9))
    with pytest.raises(grpc.RpcError) as e:
        _generate(stack.gateway_addr, _request(PROMPT, 4), tls, "key-one")
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert _generate(stack.gateway_addr, _request(PROMPT, 4), tls, "key-two").token_ids
    keys.write_text("key-one\nkey-two\n")
    os.utime(keys, ns=(time.time_ns(), time.time_ns() + 2 * 10**9))


def test_http_api_serves_https_with_the_same_api_keys(secure_stack, stories_path, pki):
    """The OpenAI HTTP API on the TLS stack: HTTPS with the gateway's
    certificate, the gRPC port's API keys, /health open."""
    import httpx

    stack, _ = secure_stack
    url, ca = stack.http_url, pki["a"][0]
    assert url.startswith("https://")
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    with httpx.Client(verify=ca, timeout=120) as client:
        assert client.get(url.removesuffix("/v1") + "/health").status_code == 200
        for headers, message in [({}, "missing API key"), ({"Authorization": "Bearer nope"}, "unknown API key")]:
            refused = client.post(f"{url}/completions", json=body, headers=headers)
            assert refused.status_code == 401 and message in refused.json()["error"]["message"]
        ok = client.post(f"{url}/completions", json=body, headers={"Authorization": "Bearer key-two"})
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == 24
    with pytest.raises(httpx.HTTPError):  # plaintext to the HTTPS port
        httpx.post(url.replace("https://", "http://") + "/completions", json=body, timeout=30)
    with pytest.raises(httpx.HTTPError):  # a client that does not trust the CA
        httpx.post(f"{url}/completions", json=body, timeout=30, verify=pki["b"][0])


def test_undecodable_messages_are_invalid_argument_on_every_service(stories_stack):
    methods = {"scorer": ["/specdec.v1.Scorer/Verify", "/specdec.v1.Scorer/Release",
                          "/specdec.v1.Scorer/GetModelInfo"],
               "gateway": ["/specdec.v1.Gateway/Generate"]}
    for prefix, names in methods.items():
        for service in stack_services(stories_stack, prefix):
            with grpc.insecure_channel(service.addr) as channel:
                for name in names:
                    send = _raw_unary_stream if name.endswith("Generate") else _raw_unary
                    for data in GARBAGE:
                        code = send(channel, name, data)
                        assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, data, code)


def stack_services(stack, prefix):
    services = stack.by_name(prefix)
    assert services, prefix
    return services


INTS = [0, 1, 3, 17, -1, -(2**31), 2**31 - 1]
FLOATS = [0.0, 0.5, 1.0, -1.0, 2.0, 1e30, float("nan"), float("inf"), -float("inf")]
STRINGS = ["", "ngram", "suffix", "bogus", "\x00", "Once upon a time", "\uffff" * 3, "a" * 40]


def _randomize(message, rng: random.Random, depth: int = 0) -> None:
    """Fills message's fields (every scalar type, nested messages, repeated
    fields and oneofs) with random values, extreme ones included."""
    from google.protobuf.descriptor import FieldDescriptor as F

    for field in message.DESCRIPTOR.fields:
        if rng.random() < 0.4:
            continue
        if field.type == F.TYPE_MESSAGE:
            if depth < 3:
                count = rng.randrange(3) if field.is_repeated else 1
                for _ in range(count):
                    child = getattr(message, field.name).add() if field.is_repeated \
                        else getattr(message, field.name)
                    _randomize(child, rng, depth + 1)
                    if not field.is_repeated:
                        child.SetInParent()
            continue
        if field.type in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
            pool = FLOATS
        elif field.type == F.TYPE_BOOL:
            pool = [False, True]
        elif field.type == F.TYPE_STRING:
            pool = STRINGS
        elif field.type == F.TYPE_BYTES:
            pool = [b"", b"\xff" * 5]
        elif field.type == F.TYPE_ENUM:
            pool = [v.number for v in field.enum_type.values] + [99]
        elif field.type in (F.TYPE_UINT32, F.TYPE_UINT64, F.TYPE_FIXED32, F.TYPE_FIXED64):
            pool = [0, 1, 5, 2**32 - 1]
        else:
            pool = INTS + [rng.randrange(512)]
        if field.is_repeated:
            getattr(message, field.name).extend(rng.choice(pool) for _ in range(rng.randrange(6)))
        else:
            setattr(message, field.name, rng.choice(pool))


def _mutate(rng: random.Random) -> bytes:
    """One malformed Generate request: random bytes, a truncated message, or
    a message whose fields take random values of their types."""
    kind = rng.randrange(3)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    request = _request([rng.randrange(512) for _ in range(rng.randrange(1, 8))], rng.randrange(1, 8))
    _randomize(request, rng)
    if request.HasField("max_tokens") and not 0 < request.max_tokens <= 64:
        request.max_tokens = rng.choice([0, -1, 2**31 - 1, 8])  # bounded work for the accepted ones
    data = request.SerializeToString()
    if kind == 1 and len(data) > 1:
        return data[:rng.randrange(1, len(data))]
    return data


def test_fuzzed_requests_get_only_clear_statuses(stories_stack, stories_path):
    """600 malformed Generate requests (random bytes, truncated messages,
    random field values), 8 at a time: the gateway answers each with OK,
    INVALID_ARGUMENT or RESOURCE_EXHAUSTED, never crashes, and then serves a
    normal request exactly."""
    rng = random.Random(1234)
    payloads = [_mutate(rng) for _ in range(600)]
    addr = stories_stack.gateway_addr
    with grpc.insecure_channel(addr) as channel:
        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda data: _raw_unary_stream(channel, "/specdec.v1.Gateway/Generate", data),
                                  payloads))
    allowed = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
    bad = [(i, c) for i, c in enumerate(codes) if c not in allowed]
    assert not bad, bad[:10]
    assert codes.count(grpc.StatusCode.INVALID_ARGUMENT) > 100  # the fuzz did reach the checks
    assert all(s.proc.poll() is None for s in stories_stack.services)
    _assert_target_greedy(_generate(addr, _request(PROMPT), None, None), stories_path)


def test_https_certificate_rotation_without_restart(pki, tmp_path):
    """The HTTP API's certificate files are replaced in place: new HTTPS
    connections get the new certificate, from the same server."""
    import httpx

    from specdec.gateway.http_api import CERT_POLL_S, HttpServer
    from specdec.security import ServerTls

    async def app(scope, receive, send):  # the smallest ASGI app: 200 "ok"
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    a_ca, a_cert, a_key = pki["a"]
    b_ca, b_cert, b_key = pki["b"]
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(Path(a_cert).read_bytes())
    key.write_bytes(Path(a_key).read_bytes())

    async def get(url: str, ca: str) -> int:
        async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=ca), timeout=10) as client:
            return (await client.get(url)).status_code

    async def run() -> None:
        server = HttpServer(app, "127.0.0.1", 0, ServerTls(str(cert), str(key)))
        await server.start()
        url = f"https://127.0.0.1:{server.port}/"
        try:
            assert await get(url, a_ca) == 200
            with pytest.raises(httpx.HTTPError):
                await get(url, b_ca)
            await asyncio.sleep(0.05)  # distinct mtimes on coarse filesystems
            key.write_bytes(Path(b_key).read_bytes())
            cert.write_bytes(Path(b_cert).read_bytes())
            await asyncio.sleep(3 * CERT_POLL_S)
            assert await get(url, b_ca) == 200
            with pytest.raises(httpx.HTTPError):  # old certificate gone
                await get(url, a_ca)
        finally:
            await server.stop()

    asyncio.run(run())
