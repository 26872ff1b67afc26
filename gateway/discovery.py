"""Replica discovery: which scorer and proposer replicas are ready, and which
replica a sequence belongs to.

A ``ReplicaSet`` holds the ready addresses ("host:port") of one component (the
scorers, or the proposers of one method) and maps sequence ids to replicas by
consistent hashing, so a sequence keeps its replica (and the KV cache or
proposer state it built there) while replicas come and go:

- adding a replica to n moves only the keys the new replica takes over
  (about 1/(n+1) of them), and they all move TO the new replica;
- removing a replica moves only the keys it owned; every other key stays.

Two sources keep replica sets up to date:

- ``StaticDiscovery`` (``--discovery static``): fixed address lists.
- ``KubernetesDiscovery`` (``--discovery kubernetes``): a daemon thread that
  lists and watches ``discovery.k8s.io/v1`` EndpointSlices of the named
  Services and publishes their ready endpoints.

No gRPC here: the gateway subscribes to a replica set and opens or closes its
channels when it is told which addresses were added or removed.
"""
from __future__ import annotations

import bisect
import functools
import hashlib
import logging
import threading
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)

#: Label the EndpointSlice controller puts on every slice of a Service.
SERVICE_NAME_LABEL = "kubernetes.io/service-name"

#: Points per replica on the hash ring. More points even out the share of
#: keys each replica owns (relative spread ~ 1/sqrt(points)).
VIRTUAL_NODES = 160

#: Reconnect backoff of the watch thread after an error, doubled per failure.
BACKOFF_INITIAL_S = 0.2
BACKOFF_MAX_S = 30.0

Subscriber = Callable[[set[str], set[str]], None]


def _hash(text: str) -> int:
    """A stable 64-bit hash (Python's ``hash`` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@dataclass(frozen=True)
class _Ring:
    """An immutable consistent-hash ring.

    Invariant: ``hashes`` is sorted ascending and ``owners[i]`` is the address
    that owns the point ``hashes[i]``; every address of ``addresses`` owns
    exactly ``VIRTUAL_NODES`` points. A key belongs to the owner of the first
    point at or after its hash, wrapping around at the end.
    """

    addresses: frozenset[str]
    hashes: tuple[int, ...]
    owners: tuple[str, ...]

    @classmethod
    def build(cls, addresses: frozenset[str]) -> _Ring:
        points = sorted((_hash(f"{address}#{i}"), address)
                        for address in addresses for i in range(VIRTUAL_NODES))
        return cls(addresses, tuple(h for h, _ in points), tuple(a for _, a in points))

    def owner(self, key: str, exclude: Collection[str]) -> str | None:
        """The first owner clockwise from ``key``'s hash that is not excluded."""
        if self.addresses <= set(exclude):
            return None
        start = bisect.bisect_left(self.hashes, _hash(key))
        n = len(self.owners)
        for step in range(n):
            owner = self.owners[(start + step) % n]
            if owner not in exclude:
                return owner
        raise AssertionError("unreachable: a non-excluded address owns points")


class ReplicaSet:
    """Ready addresses ("host:port") of one component (the scorers, or the
    proposers of one method), with consistent hashing of sequence ids to
    replicas.

    Thread-safe: a watch thread updates it while asyncio code reads it.
    Readers never block (they read one immutable ring snapshot); updates are
    serialised, and subscribers are called in the updating thread, in update
    order, after the new addresses are visible to ``pick``. Subscribers must
    not block; asyncio code should hand the change to its loop with
    ``loop.call_soon_threadsafe``.
    """

    def __init__(self, name: str, addresses: Iterable[str] = ()) -> None:
        self.name = name
        self._ring = _Ring.build(frozenset())
        self._update_lock = threading.RLock()
        self._subscribers: list[Subscriber] = []
        self.set_addresses(addresses)

    def set_addresses(self, addresses: Iterable[str]) -> tuple[set[str], set[str]]:
        """Replace the addresses; returns ``(added, removed)`` and notifies the
        subscribers when either is non-empty."""
        new = frozenset(addresses)
        with self._update_lock:
            old = self._ring.addresses
            added, removed = set(new - old), set(old - new)
            if not added and not removed:
                return added, removed
            self._ring = _Ring.build(new)
            for callback in list(self._subscribers):
                self._notify(callback, added, removed)
        return added, removed

    def addresses(self) -> list[str]:
        """The current addresses, sorted."""
        return sorted(self._ring.addresses)

    def pick(self, key: str, exclude: Collection[str] = ()) -> str | None:
        """The replica that owns ``key`` (a sequence id) on the hash ring,
        skipping ``exclude``d replicas (e.g. ones that just failed): the next
        replica clockwise takes over, so the fallback is stable too. None if
        no replica is left."""
        return self._ring.owner(key, exclude)

    def subscribe(self, callback: Subscriber) -> None:
        """Call ``callback(added, removed)`` after every change."""
        with self._update_lock:
            self._subscribers.append(callback)

    def _notify(self, callback: Subscriber, added: set[str], removed: set[str]) -> None:
        # A failing subscriber must not stop the others or the watch thread.
        try:
            callback(set(added), set(removed))
        except Exception:
            log.exception("replica set %s: subscriber %r failed", self.name, callback)

    def __repr__(self) -> str:
        return f"ReplicaSet({self.name!r}, {self.addresses()!r})"


class Discovery(Protocol):
    """What the gateway starts at boot and stops at shutdown."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


class StaticDiscovery:
    """``--discovery static``: fixed address lists.

    ``targets`` maps a component name to its replica set and the addresses it
    gets when started.
    """

    def __init__(self, targets: dict[str, tuple[ReplicaSet, list[str]]]) -> None:
        self._targets = dict(targets)

    def start(self) -> None:
        for replica_set, addresses in self._targets.values():
            replica_set.set_addresses(addresses)

    def stop(self) -> None:
        """Nothing runs in the background; the replica sets keep their addresses."""


class KubernetesDiscovery:
    """``--discovery kubernetes``: keeps replica sets equal to the ready
    endpoints of Kubernetes Services, read from their EndpointSlices.

    ``targets`` maps a Service name (in ``namespace``) to the replica set to
    keep updated. A Service may have several slices; its addresses are the
    union over all its slices, keyed by slice name. An endpoint counts when
    ``conditions.ready`` is true or absent (nil means ready in the API) and it
    is not ``terminating``; its address is ``addresses[0]:port`` with the slice
    port named ``port_name`` (or the slice's only port).

    ``start`` runs a daemon thread that lists the slices (a full resync that
    also forgets slices deleted while disconnected), then watches from the
    list's resourceVersion for ``resync_s`` seconds, and repeats; on errors it
    reconnects with exponential backoff. ``api`` is a
    ``kubernetes.client.DiscoveryV1Api`` (by default built from the in-cluster
    config, falling back to the kubeconfig).
    """

    def __init__(self, namespace: str, targets: dict[str, ReplicaSet], port_name: str = "grpc",
                 api: Any = None, resync_s: float = 30.0) -> None:
        if not targets:
            raise ValueError("KubernetesDiscovery needs at least one Service to watch")
        if resync_s <= 0:
            raise ValueError(f"resync_s must be > 0, got {resync_s}")
        self.namespace = namespace
        self._targets = dict(targets)
        self._port_name = port_name
        self._api = api
        self._resync_s = resync_s
        # Service name -> slice name -> ready addresses of that slice.
        self._slices: dict[str, dict[str, frozenset[str]]] = {svc: {} for svc in self._targets}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch: Any = None  # the kubernetes.watch.Watch being streamed, if any

    @property
    def label_selector(self) -> str:
        """Selects the slices of exactly the target Services."""
        return f"{SERVICE_NAME_LABEL} in ({','.join(sorted(self._targets))})"

    def handle_event(self, event_type: str, endpoint_slice: Any) -> None:
        """Apply one watch event ("ADDED" | "MODIFIED" | "DELETED"; others
        such as "BOOKMARK" are ignored). ``endpoint_slice`` is a dict shaped
        like the API's JSON, or a ``kubernetes`` V1EndpointSlice."""
        obj = _as_json(endpoint_slice)
        service = _service_name(obj)
        if service not in self._targets or event_type not in ("ADDED", "MODIFIED", "DELETED"):
            return
        slice_name = obj["metadata"]["name"]
        with self._lock:
            slices = self._slices[service]
            if event_type == "DELETED":
                slices.pop(slice_name, None)
            else:
                slices[slice_name] = self._ready_addresses(obj)
            self._publish(service)

    def start(self) -> None:
        """Start the list+watch thread (loads the cluster config first when no
        ``api`` was given, so a missing config fails here, not in the thread)."""
        if self._thread is not None:
            raise RuntimeError("KubernetesDiscovery already started")
        if self._api is None:
            self._api = _default_api()
        self._stopping.clear()
        self._thread = threading.Thread(
            target=self._run, name=f"endpointslice-watch-{self.namespace}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread; the replica sets keep their last addresses."""
        self._stopping.set()
        watch = self._watch
        if watch is not None:
            watch.stop()  # also shuts the socket down, unblocking the read
        if self._thread is not None:
            self._thread.join(timeout=10.0)
            self._thread = None

    # -- the watch thread ---------------------------------------------------

    def _run(self) -> None:
        delay = BACKOFF_INITIAL_S
        while not self._stopping.is_set():
            try:
                resource_version = self._resync()
                self._watch_from(resource_version)
                delay = BACKOFF_INITIAL_S
            except Exception as exc:  # noqa: BLE001 - any failure: reconnect
                if getattr(exc, "status", None) == 410:
                    log.info("EndpointSlice watch expired (410 Gone); relisting")
                    continue
                log.warning("EndpointSlice discovery in %s failed (%s); retrying in %.1f s",
                            self.namespace, exc, delay)
                self._stopping.wait(delay)
                delay = min(2 * delay, BACKOFF_MAX_S)

    def _resync(self) -> str:
        """List all target slices and replace the state with them; returns the
        list's resourceVersion to watch from."""
        listing = self._api.list_namespaced_endpoint_slice(
            self.namespace, label_selector=self.label_selector,
            _request_timeout=self._resync_s + 30.0)
        objs = [_as_json(item) for item in listing.items or []]
        with self._lock:
            self._slices = {svc: {} for svc in self._targets}
            for obj in objs:
                service = _service_name(obj)
                if service in self._slices:
                    self._slices[service][obj["metadata"]["name"]] = self._ready_addresses(obj)
            for service in self._targets:
                self._publish(service)
        return listing.metadata.resource_version

    def _watch_from(self, resource_version: str) -> None:
        """Stream events until the server ends the watch (after about
        ``resync_s``) or ``stop`` is called."""
        from kubernetes import watch

        self._watch = watch.Watch()
        try:
            if self._stopping.is_set():
                return
            events = self._watch.stream(
                self._api.list_namespaced_endpoint_slice, self.namespace,
                label_selector=self.label_selector, resource_version=resource_version,
                allow_watch_bookmarks=True, timeout_seconds=max(1, int(self._resync_s)),
                # A client-side read timeout too, so a half-open connection
                # cannot block the thread forever.
                _request_timeout=self._resync_s + 30.0)
            for event in events:
                if self._stopping.is_set():
                    return
                self.handle_event(event["type"], event["raw_object"])
        finally:
            self._watch = None

    # -- helpers ------------------------------------------------------------

    def _publish(self, service: str) -> None:
        """Push a Service's union of slice addresses to its replica set
        (called with ``_lock`` held, so updates reach it in order)."""
        replica_set = self._targets[service]
        addresses = frozenset().union(*self._slices[service].values())
        added, removed = replica_set.set_addresses(addresses)
        if added or removed:
            log.info("service %s (%s): +%s -%s -> %d ready", service, replica_set.name,
                     sorted(added), sorted(removed), len(addresses))

    def _ready_addresses(self, obj: Mapping[str, Any]) -> frozenset[str]:
        port = _slice_port(obj.get("ports") or [], self._port_name)
        if port is None:
            log.warning("EndpointSlice %s has no port named %r (nor a single port); ignored",
                        obj["metadata"]["name"], self._port_name)
            return frozenset()
        return frozenset(
            _host_port(endpoint["addresses"][0], port, obj.get("addressType"))
            for endpoint in obj.get("endpoints") or []
            if endpoint.get("addresses") and _is_ready(endpoint))


def _is_ready(endpoint: Mapping[str, Any]) -> bool:
    """Ready unless ``ready`` is explicitly false (nil means ready) or the
    endpoint is terminating."""
    conditions = endpoint.get("conditions") or {}
    return conditions.get("ready") is not False and conditions.get("terminating") is not True


def _slice_port(ports: list[Mapping[str, Any]], port_name: str) -> int | None:
    """The port named ``port_name``, else the only port, else None."""
    for port in ports:
        if port.get("name") == port_name and port.get("port") is not None:
            return int(port["port"])
    if len(ports) == 1 and ports[0].get("port") is not None:
        return int(ports[0]["port"])
    return None


def _host_port(host: str, port: int, address_type: str | None) -> str:
    return f"[{host}]:{port}" if address_type == "IPv6" else f"{host}:{port}"


def _service_name(obj: Mapping[str, Any]) -> str | None:
    return ((obj.get("metadata") or {}).get("labels") or {}).get(SERVICE_NAME_LABEL)


def _as_json(endpoint_slice: Any) -> Mapping[str, Any]:
    """A dict with the API's JSON (camelCase) field names."""
    if isinstance(endpoint_slice, Mapping):
        return endpoint_slice
    return _serializer().sanitize_for_serialization(endpoint_slice)


@functools.cache
def _serializer() -> Any:
    from kubernetes import client

    return client.ApiClient()


def _default_api() -> Any:
    """A DiscoveryV1Api from the in-cluster config, else the kubeconfig."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.DiscoveryV1Api()
