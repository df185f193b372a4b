"""The ack writer shared by the tcp and torchdist receivers: batching, heartbeats and its
two explicit endings (silenced: nothing more; flushed: the acks given, then a farewell).
Each state is set up by holding the writer inside a blocked write, never by timing."""

from __future__ import annotations

import threading

from kv_transfer.ack_writer import ACKS_PER_MESSAGE, AckWriter
from kv_transfer.tcp_connector import parse_acks
from kv_transfer.wire import Ack, decode, encode_control

BYE = encode_control({"k": "bye"})


class Wire:
    """Collects what the writer writes; ``hold`` blocks the next write until ``release``."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.messages: list[tuple[str, list[Ack]]] = []
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.gate.set()
        self.fail = fail

    def hold(self) -> None:
        self.entered.clear()
        self.gate.clear()

    def write(self, raw: bytes) -> None:
        self.entered.set()
        assert self.gate.wait(20), "the test never released the write"
        if self.fail is not None:
            raise self.fail
        msg = decode(raw)
        kind = msg.control["k"]
        self.messages.append((kind, parse_acks(msg.control) if kind == "ack" else []))

    def acks(self) -> list[Ack]:
        return [a for kind, acks in self.messages if kind == "ack" for a in acks]


def _acks(n: int, rid: str = "r") -> list[Ack]:
    return [Ack(rid, i, 0, 0, "", i + 1) for i in range(n)]


def _writer(wire: Wire, **kw) -> AckWriter:
    return AckWriter("test", 60.0, wire.write, errors=(OSError,), **kw).start()


def test_acks_are_batched_per_message_and_idle_links_get_heartbeats():
    wire = Wire()
    w = AckWriter("test", 0.001, wire.write, errors=(OSError,)).start()
    wire.hold()
    assert wire.entered.wait(20)  # idle: a heartbeat is being written
    w.send(_acks(2 * ACKS_PER_MESSAGE + 5))
    wire.gate.set()
    w.stop(flush=True)
    w.join(20)
    kinds = [k for k, _ in wire.messages]
    assert kinds[0] == "hb" and "ack" in kinds
    sizes = [len(a) for k, a in wire.messages if k == "ack"]
    assert sizes == [ACKS_PER_MESSAGE, ACKS_PER_MESSAGE, 5]
    assert wire.acks() == _acks(2 * ACKS_PER_MESSAGE + 5)


def test_flushing_stop_sends_the_given_acks_then_the_farewell_and_drops_later_ones():
    wire = Wire()
    w = _writer(wire, farewell=BYE)
    wire.hold()
    w.send(_acks(1, "a"))
    assert wire.entered.wait(20)  # the writer is inside the write of "a"
    w.send(_acks(2, "b"))
    w.stop(flush=True)
    w.send(_acks(1, "late"))  # after stop: dropped
    wire.gate.set()
    w.join(20)
    assert [k for k, _ in wire.messages] == ["ack", "ack", "bye"]
    assert [a.request_id for a in wire.acks()] == ["a", "b", "b"]


def test_silencing_stop_sends_nothing_more_even_after_a_flushing_one():
    wire = Wire()
    w = _writer(wire, farewell=BYE)
    wire.hold()
    w.send(_acks(1, "a"))
    assert wire.entered.wait(20)
    w.send(_acks(1, "b"))
    w.stop(flush=True)  # the link ended normally ...
    w.stop(flush=False)  # ... then the peer turned out to be gone
    w.stop(flush=True)  # a flush never revives a silenced writer
    wire.gate.set()
    w.join(20)
    assert [k for k, _ in wire.messages] == ["ack"]
    assert [a.request_id for a in wire.acks()] == ["a"]


def test_a_failing_write_ends_the_writer_and_reports_once():
    wire, errors = Wire(fail=OSError("peer reset")), []
    w = _writer(wire, on_error=lambda: errors.append(1))
    w.send(_acks(3))
    w.join(20)
    assert errors == [1] and wire.messages == []
    w.send(_acks(1))  # a dead writer takes acks without trouble (the link is closing)
    w.stop(flush=False)
