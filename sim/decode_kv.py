"""A simulated decode worker's KV intake: decode_worker/engine.py DecodeEngine._take_kv and
its EarlyKV (decode_worker/early_kv.py) on the simulated clock.

Arrived pieces wait in the inbox for the start of the next step, which writes them
(allocation per piece, credit back to the link) and starts the legs whose KV is complete.
A piece of a leg with no reservation here yet (its reserve went with the prefill's add,
sim/router_reserve.py, and the KV overtook it) is held, unreleased (its credit stays with
the sender), until the reserve runs: granted, the held pieces are written at the next
step, before anything newer; refused, they are released and the leg's later pieces are
dropped. An abort drops them (their credit comes back as dropped, the sender's leg
fails), as do later pieces of a leg aborted or expired here. Not modelled: EarlyKV's
byte/chunk bounds and its expiry (a simulated reserve always comes, rpc_s after its add).

``KVIntake`` is SimDecode's base (sim/decode.py): it reads and sets the worker's inbox,
scheduler and the ``early`` / ``closed`` maps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sim.adapters import startable, take_kv_piece
from sim.decode_runs import RunCutter

if TYPE_CHECKING:
    from sim.link import Piece


class KVIntake(RunCutter):
    # set by SimDecode.__init__ (declared here for the type checker and mypyc)
    early: dict[str, list[Piece]]
    closed: set[str]
    started: dict[str, float]
    num_layers: int
    kvb: int
    handoff_spread: bool

    def deliver(self, pieces: list[Piece]) -> None:
        if self.handoff_spread:  # a leg's last piece waits its drawn extra (costs.py)
            now, costs, keep = self.loop.now, self.costs, []
            for p in pieces:
                extra = costs.handoff_extra_s(p.leg_id) if p.first_token is not None else 0.0
                if extra > 0:
                    self.loop.at(now + extra, self._arrive, [p])
                else:
                    keep.append(p)
            if not keep:
                return
            pieces = keep
        self._arrive(pieces)

    def _arrive(self, pieces: list[Piece]) -> None:
        self.inbox.extend(pieces)
        self._cut()
        self.wake()  # the KV doorbell ends a nap at once

    def _take_kv(self, now: float) -> float:
        """DecodeEngine._take_kv: write every arrived piece, return its credit, start the
        legs whose KV is complete; returns the seconds the imports take."""
        seconds = 0.0
        inbox, self.inbox = self.inbox, []
        sched, early, closed = self.sched, self.early, self.closed
        for p in inbox:
            leg = p.leg_id
            if leg in sched.pending:
                kept = take_kv_piece(sched, leg, p.token_start, p.token_end, p.layer_end,
                                     self.num_layers, p.first_token)
            elif leg in closed or sched.find_running(leg) is not None:
                kept = False  # (the receiver closed its id: dropped)
            else:  # no reservation (yet): held, unreleased
                early.setdefault(leg, []).append(p)
                continue
            n = p.token_end - p.token_start
            if kept and n:  # a piece split by layer carries a share of the tokens' bytes
                seconds += self.costs.kv_import_s(max(1, round(p.nbytes / self.kvb)))
            self.loop.at(now + p.link.ack_latency_s, p.link.ack, p, kept)
        tracer = self.sim.tracer
        for leg in startable(sched):
            sched.start(leg)
            self.started[leg] = now + seconds
            if tracer is not None:
                tracer.span(leg, "decode_admit", self.worker_id, now + seconds, now + seconds)
        return seconds

    def early_reserved(self, leg: str, ok: bool) -> None:
        """EarlyKV.on_reserve: granted, the held pieces go first into the next step's
        intake; refused, they are released (credit back) and later ones are dropped."""
        held = self.early.pop(leg, None)
        if ok:
            self.closed.discard(leg)
            if held:
                self.inbox[:0] = held
            return
        self.closed.add(leg)
        for p in held or ():
            self.loop.at(self.loop.now + p.link.ack_latency_s, p.link.ack, p, True)

    def early_closed(self, leg: str) -> None:
        """The leg was aborted or failed here: what is held of it and what comes later is
        dropped (the receiver closes its id)."""
        self.closed.add(leg)
        for p in self.early.pop(leg, None) or ():
            self.loop.at(self.loop.now + p.link.ack_latency_s, p.link.ack, p, False)
