"""benchmarks/soak.py's chaos schedule, unit-tested with a stand-in stack
whose restarts take a set time (the soak itself, with real processes, is in
test_soak.py, marked slow): every kill asked for happens even when restarts
run past the deadline, and the load goes on until the last restart has
served AFTER_LAST_KILL_S."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import soak  # noqa: E402


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class FakeReplica:
    def __init__(self, name: str) -> None:
        self.name = name
        self.kills = 0

    def kill(self) -> None:
        self.kills += 1


class FakeStack:
    """Two scorers and two proposers; a restart takes `restart_s` of the clock."""

    def __init__(self, clock: FakeClock, restart_s: float) -> None:
        self.clock, self.restart_s = clock, restart_s
        self.replicas = [FakeReplica(n) for n in ("scorer0", "scorer1", "proposer0", "proposer1")]

    def by_name(self, prefix: str) -> list[FakeReplica]:
        return [r for r in self.replicas if r.name.startswith(prefix)]

    def restart(self, replica: FakeReplica) -> None:
        self.clock.now += self.restart_s


def run_schedule(monkeypatch, kills: int, minutes: float, restart_s: float) -> tuple[soak.ChaosMonkey, float, float]:
    """Drives the monkey as soak.main's loop does (a step every 0.2 s while
    the load runs); returns it, the deadline and when the load stopped."""
    clock = FakeClock()
    monkeypatch.setattr(soak.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(soak.time, "sleep", clock.sleep)
    deadline = clock.now + minutes * 60
    monkey = soak.ChaosMonkey(FakeStack(clock, restart_s), kills, deadline)
    while clock.now < deadline or monkey.load_on(clock.now):
        monkey.step(clock.now)
        clock.now += 0.2
    return monkey, deadline, clock.now


@pytest.mark.parametrize("restart_s", [0.5, 12.0, 40.0])
def test_every_kill_happens_and_the_load_outlasts_the_last_restart(monkeypatch, restart_s):
    monkey, deadline, stopped = run_schedule(monkeypatch, kills=20, minutes=3, restart_s=restart_s)
    assert len(monkey.log) == 20
    assert stopped >= monkey.last_restart + soak.AFTER_LAST_KILL_S
    if restart_s == 0.5:  # quick restarts: every kill before the deadline, the load stops at it
        assert all(at < deadline for at, _, _ in monkey.log)
        assert stopped < deadline + 0.2 + soak.AFTER_LAST_KILL_S
    if restart_s == 40.0:  # 20 restarts of 40 s cannot fit 3 minutes: the rest follow one another at once
        assert stopped > deadline
        late = [at for at, _, _ in monkey.log if at >= deadline]
        assert late and all(b - a < restart_s + 2.0 + 0.5 for a, b in zip(late, late[1:]))


def test_no_kills_asked_no_load_past_the_deadline(monkeypatch):
    monkey, deadline, stopped = run_schedule(monkeypatch, kills=0, minutes=1, restart_s=5.0)
    assert monkey.log == [] and stopped < deadline + 0.2
