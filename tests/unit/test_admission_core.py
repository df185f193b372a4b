"""AdmissionCore (cluster/router/admission.py) on its own: the admission's decisions, driven by
hand with no event loop, as the router's DecodeAdmission and the simulator's SimAdmission
drive them. A fake driver records what the core asks; answers are given explicitly."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.router.admission import AdmissionCore, Waiter


@dataclass(eq=False)
class Leg:  # what the core reads of a request: its current leg and whether it ended
    leg_id: str
    done: bool = False


@dataclass(eq=False)
class Task:  # what the core reads of a DecodeTask
    leg_id: str
    tenant: str = "default"
    prompt_len: int = 1


class Driver:
    def __init__(self, workers: list[str]):
        self.workers = list(workers)
        self.asks: list[tuple[str, str, list[str]]] = []
        self.aborts: list[tuple[str, str]] = []
        self.notified: list[str] = []

    def candidates(self):
        return self.workers, True

    def ask(self, waiter: Waiter, worker: str, revoke: list[Waiter]) -> None:
        self.asks.append((waiter.task.leg_id, worker, [v.task.leg_id for v in revoke]))

    def is_alive(self, worker: str) -> bool:
        return worker in self.workers

    def abort_on(self, worker: str, leg_id: str) -> None:
        self.aborts.append((worker, leg_id))

    def notify(self, waiter: Waiter) -> None:
        self.notified.append(waiter.task.leg_id)

    def capacity(self) -> int:
        return self.room

    room = 0  # the pool's tokens, for an order that shares them by weight


def enqueue(core: AdmissionCore, name: str, arrival: float) -> Waiter:
    w = core.enqueue(Leg(name), arrival, Task(name))
    core.pump()
    return w


def test_each_waiter_asks_another_worker_and_the_heads_grant_is_kept_at_once() -> None:
    d = Driver(["w0", "w1"])
    core = AdmissionCore(d)
    a, b = enqueue(core, "a", 0.0), enqueue(core, "b", 1.0)
    assert d.asks == [("a", "w0", []), ("b", "w1", [])]  # two reserves in flight
    core.answered(a, "w0", True, core.round)
    assert core.take(a) == "w0"  # the head's grant: kept
    core.leave(a)
    core.answered(b, "w1", True, core.round)
    assert core.take(b) == "w1" and not core.busy
    core.leave(b)
    assert len(core) == 0 and d.aborts == []


def test_a_later_grant_stays_tentative_and_goes_back_when_the_head_needs_its_worker() -> None:
    d = Driver(["w0", "w1"])
    core = AdmissionCore(d)
    a, b = enqueue(core, "a", 0.0), enqueue(core, "b", 1.0)
    core.answered(b, "w1", True, core.round)
    assert b.held == "w1" and core.take(b) is None  # a may still need w1
    core.answered(a, "w0", False, core.round)  # refused: a asks w1, b's room goes back
    assert d.asks[-2:] == [("a", "w1", ["b"]), ("b", "w0", [])] and b.held is None
    core.answered(b, "w0", True, core.round)  # a was refused by w0: b keeps it
    assert core.take(b) == "w0"
    core.leave(b)
    core.answered(a, "w1", True, core.round)
    assert core.take(a) == "w1"
    core.leave(a)
    assert len(core) == 0 and not core.busy


def test_a_waiter_refused_by_every_worker_blocks_those_behind_it() -> None:
    d = Driver(["w0", "w1"])
    core = AdmissionCore(d)
    big = enqueue(core, "big", 0.0)
    core.answered(big, "w0", False, core.round)
    core.answered(big, "w1", False, core.round)
    assert big.blocked
    enqueue(core, "small", 1.0)
    assert [a[0] for a in d.asks] == ["big", "big"]  # small asks no one
    core.wake_head()  # capacity may have freed: a new round, big asks again first
    assert d.asks[-1] == ("big", "w0", [])
    assert [a[0] for a in d.asks].count("small") == 0


def test_a_refusal_from_an_older_round_does_not_count_and_a_late_grant_is_released() -> None:
    d = Driver(["w0"])
    core = AdmissionCore(d)
    a = enqueue(core, "a", 0.0)
    asked_in = core.round
    core.wake_head()  # a leg ended meanwhile
    core.answered(a, "w0", False, asked_in)
    assert not a.blocked and d.asks[-1] == ("a", "w0", [])  # it asks again at once
    a.flight.done = True  # its request ended while that reserve was in flight
    core.answered(a, "w0", True, core.round)
    assert d.aborts == [("w0", "a")] and a.held is None
    core.leave(a)
    assert len(core) == 0 and not core.busy


def test_a_worker_is_promised_while_a_reserve_is_on_it_or_its_grant_is_not_taken() -> None:
    """What a worker leaving its pool (Router.switch_role) drains besides its legs: a
    reserve in flight on it, a tentative grant there, and a kept grant that its leg has
    not taken yet (the leg lands on the worker a loop turn after the answer)."""
    d = Driver(["w0", "w1"])
    core = AdmissionCore(d)
    a, b = enqueue(core, "a", 0.0), enqueue(core, "b", 1.0)
    assert core.promised_on("w0") and core.promised_on("w1")  # both asked
    core.answered(b, "w1", True, core.round)
    assert b.held == "w1" and id("w1") not in core.busy and core.promised_on("w1")
    core.answered(a, "w0", True, core.round)
    assert a.granted == "w0" and not core.busy and core.promised_on("w0")
    assert core.take(a) == "w0"
    core.leave(a)
    assert not core.promised_on("w0") and core.promised_on("w1")
    assert core.take(b) == "w1"
    core.leave(b)
    assert not core.promised_on("w0") and not core.promised_on("w1") and len(core) == 0
