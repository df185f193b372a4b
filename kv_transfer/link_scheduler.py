"""LinkScheduler: per-link decision of which queued frames may be written *now*.

It combines, in this order: the send policy's hold (``at_end``), the queue discipline
(``fcfs``/``wfq``), the credit window (max unreleased bytes in flight) and the pacer.
No threads and no I/O: the sender's link thread asks ``next_batch(now)``, writes what it
gets, and sleeps for the returned delay or until an enqueue/ack wakes it. Tests drive it
step by step with a ``ManualClock``.
"""

from __future__ import annotations

from kv_transfer.config import TransferConfig
from kv_transfer.pacing import Pacer, get_send_policy
from kv_transfer.send_queue import QueuedFrame, SendQueue, make_send_queue


class LinkScheduler:
    def __init__(self, cfg: TransferConfig, *, pacer: Pacer | None = None) -> None:
        policy = get_send_policy(cfg.send_policy)
        self.hold_until_final = policy.hold_until_final
        self.pacer: Pacer = pacer if pacer is not None else policy.make_pacer(cfg)
        self.queue: SendQueue = make_send_queue(cfg.send_queue, cfg.tenant_weight)
        self.window = cfg.credit_window_bytes
        self.coalesce = cfg.coalesce_bytes
        self._held: dict[str, list[QueuedFrame]] = {}
        self.inflight_bytes = 0  # written, not yet acked by the receiver
        self.queued_bytes = 0  # eligible, waiting in the discipline
        self.held_bytes = 0  # at_end: waiting for the request's final chunk
        self.peak_inflight_bytes = 0

    def enqueue(self, frame: QueuedFrame, *, completes_request: bool) -> None:
        """Queue a frame; ``completes_request``: it is the request's last frame."""
        if not self.hold_until_final:
            self._push(frame)
            return
        held = self._held.setdefault(frame.request_id, [])
        held.append(frame)
        self.held_bytes += frame.nbytes
        if completes_request:
            for f in self._held.pop(frame.request_id):
                self.held_bytes -= f.nbytes
                self._push(f)

    def _push(self, frame: QueuedFrame) -> None:
        self.queue.push(frame)
        self.queued_bytes += frame.nbytes

    def next_batch(self, now: float) -> tuple[list[QueuedFrame], float | None]:
        """Frames to write now (coalesced up to ``coalesce_bytes``), moved to in-flight.

        When nothing may go, returns ``([], delay)``: the pacer's wait in seconds, or None
        when only an enqueue or an ack can change the answer.
        """
        batch: list[QueuedFrame] = []
        total = 0
        while True:
            f = self.queue.peek()
            if f is None:
                return batch, None
            if batch and total + f.nbytes > self.coalesce:
                return batch, None
            # a frame never pushes in-flight bytes past the window; config guarantees
            # window >= max frame, so an idle link always admits the next frame
            if self.inflight_bytes and self.inflight_bytes + f.nbytes > self.window:
                return batch, None
            wait = self.pacer.delay(f.nbytes, now)
            if wait > 0:
                return batch, (None if batch else wait)
            self.pacer.consume(f.nbytes, now)
            self.queue.pop()
            self.queued_bytes -= f.nbytes
            self.inflight_bytes += f.nbytes
            self.peak_inflight_bytes = max(self.peak_inflight_bytes, self.inflight_bytes)
            batch.append(f)
            total += f.nbytes

    def on_ack(self, nbytes: int) -> None:
        """Credit returned: ``nbytes`` of in-flight payload were released (or dropped)."""
        self.inflight_bytes -= nbytes
        assert self.inflight_bytes >= 0, "more credit returned than was in flight"

    def abort(self, request_id: str) -> list[QueuedFrame]:
        """Drop the request's held and queued frames (in-flight ones await their ack)."""
        dropped = self._held.pop(request_id, [])
        self.held_bytes -= sum(f.nbytes for f in dropped)
        queued = self.queue.remove_request(request_id)
        self.queued_bytes -= sum(f.nbytes for f in queued)
        return dropped + queued

    def drain(self) -> list[QueuedFrame]:
        """Drop everything held and queued (the link failed or closed)."""
        dropped = [f for fs in self._held.values() for f in fs]
        self._held.clear()
        while len(self.queue):
            dropped.append(self.queue.pop())
        self.held_bytes = self.queued_bytes = 0
        return dropped

    @property
    def has_pending(self) -> bool:
        return bool(len(self.queue) or self._held)
