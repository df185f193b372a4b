"""A simulated KV link (one per prefill -> decode pair, as the real sender keeps one per
destination): the real ``LinkScheduler`` decides which queued frames leave and when
(send policy hold, fcfs/wfq queue, credit window, pacer on the simulated clock); the
cost model says how long a write holds the link.

A sender's link thread loops ``next_batch(now)`` -> write -> ``next_batch``; a frame is
delivered when its write ends; its credit returns when the decode worker takes it (the
start of its next step, kv_transfer/receiver.py ``release``) plus the link latency. A
leg's sends are finished once its final frame is queued and every frame acked
(kv_transfer/sender.py ``_on_acks``): the prefill worker then reports PREFILL_DONE.

An emulated link (``transfer.link_gbps`` / ``link_latency_us``, kv_transfer/emulated_link.py)
sits beneath the same scheduler: a write holds the link thread for ``n / rate``, the
frames then reach the real transport ``latency`` later, one write after the other (its
cost from the cost model), and acks come back ``latency`` later too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from sim.adapters import LinkScheduler, QueuedFrame, piece_layout

if TYPE_CHECKING:
    from sim.cluster import Simulation
    from sim.decode import SimDecode
    from sim.prefill import SimPrefill


class SimLink:
    def __init__(self, sim: Simulation, src: SimPrefill, dst: SimDecode):
        self.sim, self.loop = sim, sim.loop
        self.src, self.dst = src, dst
        self.name = f"link:{src.worker_id}->{dst.worker_id}"
        self.cost = sim.link_cost
        plan = sim.plan
        self.sched = LinkScheduler(plan.transfer)
        self.layers, self.kvb = plan.num_layers, plan.kv_bytes_per_token
        self.max_payload = plan.transfer.max_payload_bytes
        self.busy = False
        t = plan.transfer
        self.emu_rate, self.emu_latency = t.link_rate_bytes_per_s, t.link_latency_s
        self.emulated = t.link_emulated
        self.ack_latency_s = self.cost.latency_s + self.emu_latency
        self._inner_free = 0.0  # when the real transport under an emulated link is free
        self._wake_version = 0
        self._outstanding: dict[str, list] = {}  # leg -> [frames not acked, final queued]
        self._layouts: dict[int, tuple] = {}  # tokens of a chunk -> its piece_layout
        self.bytes_sent = 0
        self.frames_sent = 0

    def send(self, leg_id: str, tenant: str, seq_no: int, start: int, end: int,
             first_token: int | None) -> None:
        """Queue one chunk (``first_token`` set: the leg's final chunk), split in frames."""
        now = self.loop.now
        layout = self._layouts.get(end - start)
        if layout is None:  # (a chunk size this link has not split yet)
            layout = self._layouts[end - start] = piece_layout(end - start, self.layers,
                                                               self.kvb, self.max_payload)
        final = first_token is not None
        for i, (nbytes, off, ntok, _, layer_end) in enumerate(layout):
            last = final and i == len(layout) - 1
            piece = Piece(leg_id, seq_no, i, start + off, start + off + ntok, layer_end,
                          first_token if last else None, nbytes, self)
            self.sched.enqueue(QueuedFrame(leg_id, tenant, nbytes, now, item=piece,
                                           key=(leg_id, seq_no, i)), completes_request=last)
        state = self._outstanding.setdefault(leg_id, [0, False])
        state[0] += len(layout)
        state[1] = state[1] or final
        self.kick()

    def kick(self) -> None:
        """The link thread wakes: write what the scheduler lets go now."""
        if self.busy:
            return
        now = self.loop.now
        batch, wait = self.sched.next_batch(now)
        if batch:
            nbytes = sum(f.nbytes for f in batch)
            self.busy = True
            if not self.emulated:
                self.loop.at(now + self.cost.write_s(nbytes), self._written, batch, now)
                return
            wire_end = now + (nbytes / self.emu_rate if self.emu_rate > 0 else 0.0)
            start = max(wire_end + self.emu_latency, self._inner_free)
            self._inner_free = start + self.cost.write_s(nbytes)
            self.loop.at(wire_end, self._wire_done, batch, now)
            self.loop.at(self._inner_free, self._arrived, batch)
        elif wait is not None:
            self._wake_version += 1
            self.loop.at(now + wait, self._wake, self._wake_version)

    def _wake(self, version: int) -> None:
        if version == self._wake_version:
            self.kick()

    def _written(self, batch: list[QueuedFrame], t0: float) -> None:
        self._wire_done(batch, t0, kick=False)
        self._arrived(batch)
        self.kick()

    def _wire_done(self, batch: list[QueuedFrame], t0: float, kick: bool = True) -> None:
        """The link thread's write returned (on an emulated link: its bytes left the wire)."""
        self.busy = False
        now = self.loop.now
        self.bytes_sent += sum(f.nbytes for f in batch)
        self.frames_sent += len(batch)
        if self.sim.tracer is not None:
            for f in batch:
                self.sim.tracer.span(f.request_id, "kv_send", self.name, t0, now,
                                     bytes=f.nbytes)
        if kick:
            self.kick()

    def _arrived(self, batch: list[QueuedFrame]) -> None:
        self.dst.deliver([f.item for f in batch])

    def ack(self, piece: Piece, kept: bool) -> None:
        """Credit of ``piece`` is back; ``kept``: the decode worker took it (else dropped)."""
        self.sched.on_ack(piece.nbytes)
        state = self._outstanding.get(piece.leg_id)
        if state is not None:
            if not kept:
                del self._outstanding[piece.leg_id]
                self.sched.abort(piece.leg_id)
                self.src.send_failed(piece.leg_id, "receiver discarded frame")
            else:
                state[0] -= 1
                if state[1] and state[0] == 0:
                    del self._outstanding[piece.leg_id]
                    self.src.send_finished(piece.leg_id)
        self.kick()

    def abort(self, leg_id: str) -> None:
        """Drop the leg's held and queued frames (in-flight ones still return credit)."""
        self._outstanding.pop(leg_id, None)
        self.sched.abort(leg_id)
        self.kick()


class Piece(NamedTuple):  # (after SimLink: mypyc builds the field types first)
    """One frame on the wire: a token range of some layers of one leg's chunk."""

    leg_id: str
    seq_no: int
    part: int
    token_start: int
    token_end: int
    layer_end: int
    first_token: int | None  # the final piece only
    nbytes: int
    link: SimLink
