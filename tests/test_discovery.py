"""Replica discovery: consistent hashing in ReplicaSet, EndpointSlice events
applied by KubernetesDiscovery, and its list+watch thread.

The EndpointSlice objects are JSON files in tests/fixtures/endpointslices/
shaped exactly like the API server's (see the README there). The watch-loop
test runs the real ``kubernetes.watch.Watch`` over a fake API object that
serves those recorded lists and event streams as HTTP responses.
"""
from __future__ import annotations

import json
import random
import threading
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.models import V1EndpointSliceList
from kubernetes.client.rest import ApiException

from specdec.gateway.discovery import KubernetesDiscovery, ReplicaSet, StaticDiscovery

FIXTURES = Path(__file__).parent / "fixtures" / "endpointslices"
SCORER_SVC = "demo-specdec-scorer"
NGRAM_SVC = "demo-specdec-proposer-ngram"
SUFFIX_SVC = "demo-specdec-proposer-suffix"
KEYS = [f"seq-{i}" for i in range(2000)]


def load(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def owners(replica_set: ReplicaSet, keys=KEYS) -> dict[str, str | None]:
    return {key: replica_set.pick(key) for key in keys}


class Recorder:
    """A subscriber that keeps every (added, removed) it is called with."""

    def __init__(self) -> None:
        self.changes: list[tuple[set[str], set[str]]] = []
        self.changed = threading.Condition()

    def __call__(self, added: set[str], removed: set[str]) -> None:
        with self.changed:
            self.changes.append((added, removed))
            self.changed.notify_all()

    def wait_for(self, count: int, timeout: float = 10.0) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.changes) >= count, timeout), self.changes


def addrs(*hosts: str, port: int) -> set[str]:
    return {f"{host}:{port}" for host in hosts}


# -- ReplicaSet --------------------------------------------------------------


def test_replica_set_reports_added_and_removed_and_notifies_only_on_change():
    rs = ReplicaSet("scorer", ["b:1", "a:1"])
    rec = Recorder()
    rs.subscribe(rec)
    assert rs.addresses() == ["a:1", "b:1"]
    assert rs.set_addresses(["b:1", "c:1"]) == ({"c:1"}, {"a:1"})
    assert rs.set_addresses(iter(["c:1", "b:1"])) == (set(), set())
    assert rs.addresses() == ["b:1", "c:1"]
    assert rec.changes == [({"c:1"}, {"a:1"})]


def test_failing_subscriber_does_not_stop_the_others():
    rs = ReplicaSet("scorer")
    rec = Recorder()
    rs.subscribe(lambda added, removed: 1 / 0)
    rs.subscribe(rec)
    rs.set_addresses(["a:1"])
    assert rec.changes == [({"a:1"}, set())]


def test_pick_is_deterministic_and_handles_empty_and_excluded():
    rs = ReplicaSet("p", ["a:1", "b:1", "c:1"])
    assert ReplicaSet("empty").pick("seq-1") is None
    first = owners(rs)
    assert owners(ReplicaSet("p", ["c:1", "a:1", "b:1"])) == first  # order-free, stable
    assert set(first.values()) == {"a:1", "b:1", "c:1"}
    assert rs.pick("seq-1", exclude={"a:1", "b:1", "c:1"}) is None
    assert rs.pick("seq-1", exclude={"a:1", "b:1"}) == "c:1"


def test_pick_with_exclude_equals_pick_after_removal():
    """Excluding a failed replica sends each key where it will live once that
    replica is gone, so a failover does not move the key twice."""
    full = ReplicaSet("p", [f"10.0.0.{i}:50052" for i in range(5)])
    without = ReplicaSet("p", [f"10.0.0.{i}:50052" for i in range(5) if i != 2])
    for key in KEYS:
        assert full.pick(key, exclude={"10.0.0.2:50052"}) == without.pick(key)


def test_keys_spread_evenly():
    rs = ReplicaSet("p", [f"10.0.0.{i}:50052" for i in range(4)])
    counts: dict[str, int] = {}
    for owner in owners(rs).values():
        counts[owner] = counts.get(owner, 0) + 1
    assert len(counts) == 4
    assert all(0.15 * len(KEYS) < c < 0.35 * len(KEYS) for c in counts.values()), counts


def test_adding_a_replica_moves_about_one_nth_of_the_keys_all_to_it():
    rs = ReplicaSet("p", [f"10.0.0.{i}:50052" for i in range(4)])
    before = owners(rs)
    rs.set_addresses(rs.addresses() + ["10.0.0.9:50052"])
    after = owners(rs)
    moved = [key for key in KEYS if before[key] != after[key]]
    assert all(after[key] == "10.0.0.9:50052" for key in moved)
    assert {k for k, v in after.items() if v == "10.0.0.9:50052"} == set(moved)
    # expected 1/5 of 2000 = 400; the ring's spread keeps it well inside this
    assert 0.10 * len(KEYS) < len(moved) < 0.30 * len(KEYS), len(moved)


def test_removing_a_replica_moves_exactly_its_keys():
    rs = ReplicaSet("p", [f"10.0.0.{i}:50052" for i in range(5)])
    before = owners(rs)
    rs.set_addresses([a for a in rs.addresses() if a != "10.0.0.3:50052"])
    after = owners(rs)
    moved = {key for key in KEYS if before[key] != after[key]}
    assert moved == {key for key in KEYS if before[key] == "10.0.0.3:50052"}
    assert moved  # the replica did own keys
    assert "10.0.0.3:50052" not in after.values()


def test_concurrent_updates_and_picks_see_one_consistent_ring():
    a, b = ["a:1", "b:1"], ["c:1", "d:1", "e:1"]
    rs = ReplicaSet("p", a)
    stop = threading.Event()
    errors: list[object] = []

    def writer():
        while not stop.is_set():
            rs.set_addresses(b)
            rs.set_addresses(a)

    def reader():
        for key in KEYS:
            picked = rs.pick(key)
            if picked not in a + b:
                errors.append(picked)

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join()
    stop.set()
    threads[0].join()
    assert errors == []


def test_static_discovery_sets_the_fixed_addresses():
    scorers, ngram = ReplicaSet("scorer"), ReplicaSet("ngram")
    disc = StaticDiscovery({"scorer": (scorers, ["127.0.0.1:50051"]),
                            "ngram": (ngram, ["127.0.0.1:50052", "127.0.0.1:50062"])})
    assert scorers.addresses() == []
    disc.start()
    assert scorers.addresses() == ["127.0.0.1:50051"]
    assert ngram.addresses() == ["127.0.0.1:50052", "127.0.0.1:50062"]
    disc.stop()
    assert ngram.addresses() == ["127.0.0.1:50052", "127.0.0.1:50062"]


# -- KubernetesDiscovery.handle_event -----------------------------------------


@pytest.fixture
def cluster():
    """Discovery of the scorer and the n-gram proposer Services, with a
    recording subscriber on each replica set."""
    scorers, ngram = ReplicaSet("scorer"), ReplicaSet("ngram")
    rec_scorer, rec_ngram = Recorder(), Recorder()
    scorers.subscribe(rec_scorer)
    ngram.subscribe(rec_ngram)
    disc = KubernetesDiscovery("specdec", {SCORER_SVC: scorers, NGRAM_SVC: ngram})
    return disc, scorers, ngram, rec_scorer, rec_ngram


def test_added_slice_uses_the_port_named_grpc(cluster):
    disc, scorers, _, rec_scorer, _ = cluster
    disc.handle_event("ADDED", load("scorer-h8d2x.json"))  # ports: metrics 9090, grpc 50051
    assert scorers.addresses() == ["10.244.1.10:50051", "10.244.2.11:50051"]
    assert rec_scorer.changes == [(addrs("10.244.1.10", "10.244.2.11", port=50051), set())]


def test_terminating_endpoint_is_dropped_even_when_reported_ready(cluster):
    disc, scorers, _, rec_scorer, _ = cluster
    disc.handle_event("ADDED", load("scorer-h8d2x.json"))
    disc.handle_event("MODIFIED", load("scorer-h8d2x-terminating.json"))
    assert scorers.addresses() == ["10.244.1.10:50051"]
    assert rec_scorer.changes[-1] == (set(), {"10.244.2.11:50051"})


def test_slice_lifecycle_over_two_slices_of_one_service(cluster):
    disc, _, ngram, _, rec = cluster
    disc.handle_event("ADDED", load("ngram-4xk2p.json"))
    assert ngram.addresses() == sorted(addrs("10.244.1.20", "10.244.1.21", "10.244.2.22", port=50052))

    disc.handle_event("ADDED", load("ngram-9qz7m.json"))  # .31 has nil conditions: ready
    assert set(ngram.addresses()) == addrs(
        "10.244.1.20", "10.244.1.21", "10.244.2.22", "10.244.3.30", "10.244.3.31", port=50052)

    disc.handle_event("MODIFIED", load("ngram-4xk2p-modified.json"))  # .21 not ready, .22 terminating
    assert set(ngram.addresses()) == addrs("10.244.1.20", "10.244.3.30", "10.244.3.31", port=50052)

    disc.handle_event("DELETED", load("ngram-9qz7m.json"))
    assert ngram.addresses() == ["10.244.1.20:50052"]

    disc.handle_event("DELETED", load("ngram-4xk2p-modified.json"))
    assert ngram.addresses() == []

    assert rec.changes == [
        (addrs("10.244.1.20", "10.244.1.21", "10.244.2.22", port=50052), set()),
        (addrs("10.244.3.30", "10.244.3.31", port=50052), set()),
        (set(), addrs("10.244.1.21", "10.244.2.22", port=50052)),
        (set(), addrs("10.244.3.30", "10.244.3.31", port=50052)),
        (set(), {"10.244.1.20:50052"}),
    ]


def test_endpoint_going_unready_moves_exactly_its_sequences(cluster):
    disc, _, ngram, _, _ = cluster
    disc.handle_event("ADDED", load("ngram-4xk2p.json"))
    disc.handle_event("ADDED", load("ngram-9qz7m.json"))
    before = owners(ngram)
    disc.handle_event("MODIFIED", load("ngram-4xk2p-modified.json"))
    after = owners(ngram)
    gone = addrs("10.244.1.21", "10.244.2.22", port=50052)
    moved = {key for key in KEYS if before[key] != after[key]}
    assert moved == {key for key in KEYS if before[key] in gone}
    assert len(moved) > 0.2 * len(KEYS)  # two of five replicas left


def test_repeated_and_unrelated_events_change_nothing(cluster):
    disc, scorers, ngram, rec_scorer, rec_ngram = cluster
    disc.handle_event("ADDED", load("scorer-h8d2x.json"))
    disc.handle_event("MODIFIED", load("scorer-h8d2x.json"))  # same content again
    disc.handle_event("ADDED", load("kube-dns-7bq4n.json"))  # not a target Service
    disc.handle_event("BOOKMARK", load("ngram-4xk2p.json"))  # not a change event
    disc.handle_event("DELETED", load("ngram-9qz7m.json"))  # never seen
    assert len(rec_scorer.changes) == 1
    assert rec_ngram.changes == []
    assert ngram.addresses() == []


def test_kubernetes_model_objects_are_accepted(cluster):
    disc, _, ngram, _, _ = cluster
    api = client.ApiClient()
    model = api.deserialize(json.dumps(load("ngram-4xk2p-modified.json")), "V1EndpointSlice",
                            "application/json")
    disc.handle_event("ADDED", model)
    assert ngram.addresses() == ["10.244.1.20:50052"]


def test_single_unnamed_port_and_ipv6_addresses():
    scorers, suffix = ReplicaSet("scorer"), ReplicaSet("suffix")
    disc = KubernetesDiscovery("specdec", {SCORER_SVC: scorers, SUFFIX_SVC: suffix})
    disc.handle_event("ADDED", load("suffix-r2d2q-unnamed-port.json"))
    disc.handle_event("ADDED", load("scorer-v6m4k-ipv6.json"))
    assert suffix.addresses() == ["10.244.2.40:50052"]
    assert scorers.addresses() == ["[fd00:10:244:1::a]:50051"]


def test_slice_without_the_named_port_contributes_nothing():
    ngram = ReplicaSet("ngram")
    disc = KubernetesDiscovery("specdec", {NGRAM_SVC: ngram}, port_name="http")
    disc.handle_event("ADDED", load("ngram-4xk2p.json"))  # two ports, neither named http
    assert ngram.addresses() == []
    metrics = KubernetesDiscovery("specdec", {NGRAM_SVC: ngram}, port_name="metrics")
    metrics.handle_event("ADDED", load("ngram-4xk2p.json"))
    assert ngram.addresses() == sorted(addrs("10.244.1.20", "10.244.1.21", "10.244.2.22", port=9090))


def test_constructor_rejects_bad_arguments():
    with pytest.raises(ValueError):
        KubernetesDiscovery("specdec", {})
    with pytest.raises(ValueError):
        KubernetesDiscovery("specdec", {NGRAM_SVC: ReplicaSet("ngram")}, resync_s=0)


def test_label_selector_names_exactly_the_target_services(cluster):
    disc = cluster[0]
    assert disc.label_selector == f"kubernetes.io/service-name in ({NGRAM_SVC},{SCORER_SVC})"


# -- the list+watch thread ----------------------------------------------------


class FakeWatchResponse:
    """The streaming HTTP response (urllib3, ``_preload_content=False``) that
    ``kubernetes.watch.Watch`` reads: one JSON event per line. When
    ``hold_open`` the stream then blocks like a quiet watch until the Watch
    shuts the socket down or closes the response."""

    status = 200

    def __init__(self, lines: list[str], hold_open: bool) -> None:
        self._lines = lines
        self._hold_open = hold_open
        self._closed = threading.Event()
        sock = type("Sock", (), {"shutdown": lambda _self, how: self._closed.set()})()
        self.connection = type("Conn", (), {"sock": sock})()

    def stream(self, amt=None, decode_content=False):
        for line in self._lines:
            yield (line + "\n").encode()
        if self._hold_open:
            self._closed.wait(30.0)

    def close(self) -> None:
        self._closed.set()

    def release_conn(self) -> None:
        pass


class FakeDiscoveryApi:
    """Stands in for the API server behind ``DiscoveryV1Api``: list calls
    return the recorded lists in order (after ``list_errors`` failures), watch
    calls the recorded event streams in order; the last stream stays open."""

    def __init__(self, lists: list[str], watches: list[str], list_errors: int = 0) -> None:
        self._lists = [load(name) for name in lists]
        self._watches = [(FIXTURES / name).read_text().splitlines() for name in watches]
        self._list_errors = list_errors
        self.list_calls: list[dict] = []
        self.watch_calls: list[dict] = []

    def list_namespaced_endpoint_slice(self, namespace: str, **kwargs) -> V1EndpointSliceList:
        assert namespace == "specdec"
        if kwargs.get("watch"):
            self.watch_calls.append(kwargs)
            lines = self._watches.pop(0)
            return FakeWatchResponse(lines, hold_open=not self._watches)
        self.list_calls.append(kwargs)
        if self._list_errors:
            self._list_errors -= 1
            raise ApiException(status=500, reason="Internal Server Error")
        return client.ApiClient().deserialize(json.dumps(self._lists.pop(0)), "V1EndpointSliceList",
                                              "application/json")


def test_watch_loop_lists_watches_relists_after_410_and_stops():
    scorers, ngram = ReplicaSet("scorer"), ReplicaSet("ngram")
    rec_scorer, rec_ngram = Recorder(), Recorder()
    scorers.subscribe(rec_scorer)
    ngram.subscribe(rec_ngram)
    api = FakeDiscoveryApi(lists=["watch-list-1.json", "watch-list-2.json"],
                           watches=["watch-events-1.jsonl", "watch-events-2.jsonl"])
    disc = KubernetesDiscovery("specdec", {SCORER_SVC: scorers, NGRAM_SVC: ngram}, api=api, resync_s=7)
    disc.start()
    try:
        rec_scorer.wait_for(2)  # listed, then deleted by the second watch
        rec_ngram.wait_for(4)
    finally:
        disc.stop()
    assert disc._thread is None

    assert rec_scorer.changes == [(addrs("10.244.1.10", "10.244.2.11", port=50051), set()),
                                  (set(), addrs("10.244.1.10", "10.244.2.11", port=50051))]
    assert rec_ngram.changes == [
        (addrs("10.244.1.20", "10.244.1.21", "10.244.2.22", port=50052), set()),  # list 1
        (addrs("10.244.3.30", "10.244.3.31", port=50052), set()),  # ADDED second slice
        (set(), addrs("10.244.1.21", "10.244.2.22", port=50052)),  # MODIFIED: unready, terminating
        (set(), addrs("10.244.3.30", "10.244.3.31", port=50052)),  # relist after 410: slice gone
    ]
    assert scorers.addresses() == [] and ngram.addresses() == ["10.244.1.20:50052"]

    selector = f"kubernetes.io/service-name in ({NGRAM_SVC},{SCORER_SVC})"
    assert [c["label_selector"] for c in api.list_calls + api.watch_calls] == [selector] * 4
    # each watch resumes from the resourceVersion of the list before it
    assert [c["resource_version"] for c in api.watch_calls] == ["1004", "1012"]
    assert all(c["timeout_seconds"] == 7 for c in api.watch_calls)


def test_watch_loop_retries_after_api_errors():
    ngram = ReplicaSet("ngram")
    rec = Recorder()
    ngram.subscribe(rec)
    api = FakeDiscoveryApi(lists=["watch-list-1.json"], watches=["watch-events-2.jsonl"], list_errors=2)
    disc = KubernetesDiscovery("specdec", {NGRAM_SVC: ngram}, api=api)
    disc.start()
    try:
        rec.wait_for(1)
    finally:
        disc.stop()
    assert len(api.list_calls) == 3  # two failures, then the successful list
    assert set(ngram.addresses()) == addrs("10.244.1.20", "10.244.1.21", "10.244.2.22", port=50052)


def test_start_twice_is_an_error():
    disc = KubernetesDiscovery("specdec", {NGRAM_SVC: ReplicaSet("ngram")},
                               api=FakeDiscoveryApi(["watch-list-1.json"], ["watch-events-2.jsonl"]))
    disc.start()
    try:
        with pytest.raises(RuntimeError):
            disc.start()
    finally:
        disc.stop()


def test_random_event_sequences_match_a_direct_recomputation():
    """Applying any sequence of slice events equals recomputing the ready
    set from the slices that currently exist."""
    rng = random.Random(7)
    versions = {"ngram-4xk2p": ["ngram-4xk2p.json", "ngram-4xk2p-modified.json"],
                "ngram-9qz7m": ["ngram-9qz7m.json"]}
    ready = {"ngram-4xk2p.json": addrs("10.244.1.20", "10.244.1.21", "10.244.2.22", port=50052),
             "ngram-4xk2p-modified.json": {"10.244.1.20:50052"},
             "ngram-9qz7m.json": addrs("10.244.3.30", "10.244.3.31", port=50052)}
    ngram = ReplicaSet("ngram")
    disc = KubernetesDiscovery("specdec", {NGRAM_SVC: ngram})
    live: dict[str, str] = {}
    for _ in range(300):
        slice_name = rng.choice(sorted(versions))
        if slice_name in live and rng.random() < 0.4:
            disc.handle_event("DELETED", load(live.pop(slice_name)))
        else:
            event_type = "MODIFIED" if slice_name in live else "ADDED"
            live[slice_name] = rng.choice(versions[slice_name])
            disc.handle_event(event_type, load(live[slice_name]))
        assert set(ngram.addresses()) == set().union(*(ready[f] for f in live.values()))
