"""Scripted connector ends for unit tests of one worker engine: the test decides what a
poll returns, so states (a bad chunk, a failed link, a finished send) are made on purpose."""

from __future__ import annotations

from typing import Any

from kv_transfer.base import KVChunk, KVReceiver, KVSender, ReceiveEvents, SendEvents


class ScriptedReceiver(KVReceiver):
    """Each `poll` returns the next scripted ReceiveEvents; records releases and aborts."""

    def __init__(self) -> None:
        self.script: list[ReceiveEvents] = []
        self.released: list[KVChunk] = []
        self.aborted: list[str] = []
        self.expected: list[str] = []

    @property
    def endpoint(self) -> str:
        return "scripted://decode"

    def poll(self) -> ReceiveEvents:
        return self.script.pop(0) if self.script else ReceiveEvents()

    def release(self, chunk: KVChunk) -> None:
        self.released.append(chunk)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def expect(self, request_id: str) -> None:
        self.expected.append(request_id)

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


class RecordingSender(KVSender):
    """Keeps sent chunks; `poll` reports the requests the test marks finished or failed."""

    def __init__(self) -> None:
        self.sent: list[KVChunk] = []
        self.aborted: list[str] = []
        self.events = SendEvents()

    def send(self, chunk: KVChunk, *, dest: str) -> None:
        self.sent.append(chunk)

    def poll(self) -> SendEvents:
        ev, self.events = self.events, SendEvents()
        return ev

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass
