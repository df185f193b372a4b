"""KV transfer of tensor-parallel workers: every rank sends or receives its own KV heads
over its own link (frames carrying a KV-head range, kv_transfer.heads); rank 0, which
runs the scheduler, coordinates the other ranks over the group's control channel.

    P TP2 -> D TP1:  P rank 0 --heads [0, H/2)--> D      (two streams, one per rank;
                     P rank 1 --heads [H/2, H)--> D       D completes when they tile H)
    P TP1 -> D TP2:  P --[0, H/2)--> D rank 0, P --[H/2, H)--> D rank 1   (the chunk cut)
    P TP2 -> D TP2:  P rank i --> D rank i                                  (zero copy)

A TP decode worker's endpoint is its ranks' receiver endpoints joined by "|", rank order;
a prefill rank cuts each chunk into what each decode rank needs (`transfer_plan`) and
gives each link its share of the pair's budget (`set_link_share`).

Prefill (rank 0's engine is unchanged): its export (GroupKV.export_hook) tells every
rank to export its heads of the same tokens; its `send` tells every rank to send them;
`poll` gathers every rank's send events, and a leg is finished once every rank that
sends for it has finished (failed as soon as one fails; the others are aborted).
Decode: `poll` gathers every rank's arrived chunks; another rank's chunk reaches the
engine as a stand-in (same fields, an unread payload) whose import and release rank 0
forwards to that rank; a leg is complete once every rank's receiver completed it.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from engine.config import torch_dtype
from engine.parallel.state import TPGroup
from engine.tp_driver import DriverRunner
from kv_transfer.base import KVChunk, KVReceiver, KVSender, ReceiveEvents, SendEvents
from kv_transfer.heads import HeadRange, rank_heads, sends_of, transfer_plan
from kv_transfer.wire import chunks_for_heads

SEP = "|"
_FIELDS = ("request_id", "seq_no", "token_start", "token_end", "is_final", "first_token",
           "tenant", "layer_start")


def join_endpoints(endpoints: Sequence[str]) -> str:
    return SEP.join(endpoints)


def split_endpoints(endpoint: str) -> list[str]:
    """A decode worker's receiver endpoints by rank (one for a one-rank worker)."""
    return endpoint.split(SEP)


def _sum_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in parts:
        for k, v in p.items():
            if isinstance(v, int | float) and not isinstance(v, bool):
                # a leg in flight on several ranks is one request
                out[k] = max(out.get(k, 0), v) if k.startswith("active") else out.get(k, 0) + v
            else:
                out.setdefault(k, v)
    return out


class HeadSender:
    """One rank's sender: sends its KV heads to a decode worker of any TP size. For a
    one-rank prefill worker and a one-rank decode worker it is the plain sender."""

    def __init__(self, sender: KVSender, num_kv_heads: int, tp: int = 1, rank: int = 0):
        self.sender, self.tp, self.rank = sender, tp, rank
        self.heads: HeadRange = rank_heads(num_kv_heads, tp, rank)

    def __getattr__(self, name: str):
        return getattr(self.sender, name)

    def senders_for(self, dest: str) -> set[int]:
        """The prefill ranks that send anything to `dest` (replicas of a head may not)."""
        plan = transfer_plan(self.heads.total, self.tp, len(split_endpoints(dest)))
        return {t.prefill_rank for t in plan}

    def send(self, chunk: KVChunk, *, dest: str) -> None:
        dests = split_endpoints(dest)
        if self.tp == 1 and len(dests) == 1:
            self.sender.send(chunk, dest=dest)
            return
        chunk = dataclasses.replace(chunk, head_start=self.heads.start,
                                    num_kv_heads=self.heads.total)
        sends = sends_of(transfer_plan(self.heads.total, self.tp, len(dests)), self.rank)
        share = getattr(self.sender, "set_link_share", None)
        for t in sends if share is not None else ():
            share(dests[t.decode_rank], t.share)
        self.sender.send_many(chunks_for_heads(chunk, sends, dests))


class _Coordinator:
    """Rank 0's messages to the other ranks: a failing collective fails the group (the
    runner's `fail`: the worker then restarts), like one inside a step."""

    runner: DriverRunner

    def _send(self, message: tuple) -> None:
        try:
            self.runner.group.send(message)
        except RuntimeError as e:
            raise self.runner.fail(e) from e

    def _gather(self) -> list:
        try:
            return self.runner.group.gather(None)
        except RuntimeError as e:
            raise self.runner.fail(e) from e


class GroupSender(_Coordinator):
    """Rank 0's sender of a TP prefill worker (see the module doc)."""

    def __init__(self, local: HeadSender, runner: DriverRunner):
        self.local, self.group, self.runner = local, runner.group, runner
        self.waiting: dict[str, set[int]] = {}  # leg -> ranks yet to finish sending it
        runner.kv.export_hook = self._export

    def __getattr__(self, name: str):
        return getattr(self.local, name)

    def _export(self, block_ids, start: int, end: int) -> torch.Tensor:
        self._send(("tx_export", tuple(block_ids), start, end))
        return self.runner.kv.local.export_tokens(block_ids, start, end)

    def send(self, chunk: KVChunk, *, dest: str) -> None:
        self._send(("tx_send", {f: getattr(chunk, f) for f in _FIELDS}, dest))
        self.waiting.setdefault(chunk.request_id, self.local.senders_for(dest))
        self.local.send(chunk, dest=dest)

    def poll(self) -> SendEvents:
        self._send(("tx_poll",))
        ev = self.local.poll()
        parts = self._gather()
        parts[0] = (ev.finished, ev.failed, ev.records)
        out = SendEvents()
        for rank, (finished, failed, records) in enumerate(parts):
            out.records += records
            for leg, why in failed:
                if self.waiting.pop(leg, None) is not None:
                    self.abort(leg)
                    out.failed.append((leg, f"rank {rank}: {why}"))
            for leg in finished:
                left = self.waiting.get(leg)
                if left is not None:
                    left.discard(rank)
                    if not left:
                        del self.waiting[leg]
                        out.finished.append(leg)
        return out

    def abort(self, request_id: str) -> None:
        self.waiting.pop(request_id, None)
        self._send(("tx_abort", request_id))
        self.local.abort(request_id)

    def stats(self) -> dict[str, Any]:
        self._send(("tx_stats",))
        parts = self._gather()
        parts[0] = self.local.stats()
        return _sum_stats(parts)


class GroupReceiver(_Coordinator):
    """Rank 0's receiver of a TP decode worker (see the module doc)."""

    def __init__(self, local: KVReceiver, runner: DriverRunner):
        self.local, self.group, self.runner = local, runner.group, runner
        self.remote: dict[int, tuple[int, int]] = {}  # id(stand-in chunk) -> (rank, index)
        self.payloads: dict[int, tuple[int, int]] = {}  # id(its payload) -> (rank, index)
        self.done: dict[str, set[int]] = {}  # leg -> ranks whose receiver completed it
        runner.kv.import_hook = self._import

    def __getattr__(self, name: str):
        return getattr(self.local, name)

    def poll(self) -> ReceiveEvents:
        self._send(("rx_poll",))
        ev = self.local.poll()
        parts = self._gather()
        out = ReceiveEvents(list(ev.chunks), list(ev.failed), [])
        completed = {0: ev.completed}
        for rank in range(1, self.group.size):
            metas, done, failed = parts[rank]
            for index, fields, shape, dtype in metas:
                stand_in = KVChunk(payload=torch.empty(shape, dtype=torch_dtype(dtype)),
                                   **fields)
                self.remote[id(stand_in)] = self.payloads[id(stand_in.payload)] = (rank, index)
                out.chunks.append(stand_in)
            out.failed += [(leg, f"rank {rank}: {why}") for leg, why in failed]
            completed[rank] = done
        for rank, legs in completed.items():
            for leg in legs:
                ranks = self.done.setdefault(leg, set())
                ranks.add(rank)
                if len(ranks) == self.group.size:
                    del self.done[leg]
                    out.completed.append(leg)
        return out

    def _import(self, block_ids, start: int, data: torch.Tensor, layer_start: int,
                head_start: int | None) -> bool:
        key = self.payloads.get(id(data))
        if key is None:
            return False  # rank 0's own chunk
        self._send(("rx_import", *key, tuple(block_ids), start, layer_start))
        return True

    def release(self, chunk: KVChunk) -> None:
        key = self.remote.pop(id(chunk), None)
        if key is None:
            self.local.release(chunk)
            return
        self.payloads.pop(id(chunk.payload), None)
        self._send(("rx_release", *key))

    def expect(self, request_id: str) -> None:
        self._send(("rx_expect", request_id))
        self.local.expect(request_id)

    def abort(self, request_id: str) -> None:
        self.done.pop(request_id, None)
        self._send(("rx_abort", request_id))
        self.local.abort(request_id)

    def stats(self) -> dict[str, Any]:
        self._send(("rx_stats",))
        parts = self._gather()
        parts[0] = self.local.stats()
        return _sum_stats(parts)


class RankLinks:
    """A rank > 0's side: its sender (prefill) or receiver (decode), driven by rank 0's
    messages inside `serve_rank` (`handlers`)."""

    def __init__(self, sender: HeadSender | None = None, receiver: KVReceiver | None = None):
        self.sender, self.receiver = sender, receiver
        # tx_exports not yet sent, oldest first: rank 0 exports a step's chunks in the step
        # and sends them, in the same order, at the next step's start
        self.exported: deque[torch.Tensor] = deque()
        self.arrived: dict[int, KVChunk] = {}  # index -> chunk rank 0 has yet to place
        self.next_index = 0

    def handlers(self, runner, group: TPGroup) -> dict[str, Callable[[tuple], None]]:
        kv, me = runner.kv, group.rank

        def export(msg):
            self.exported.append(kv.export_tokens(msg[1], msg[2], msg[3]))

        def send(msg):
            self.sender.send(KVChunk(payload=self.exported.popleft(), **msg[1]), dest=msg[2])

        def tx_poll(msg):
            ev = self.sender.poll()
            group.gather((ev.finished, ev.failed, ev.records))

        def rx_poll(msg):
            ev = self.receiver.poll()
            metas = []
            for chunk in ev.chunks:
                self.arrived[self.next_index] = chunk
                fields = {f: getattr(chunk, f) for f in _FIELDS}
                fields.update(head_start=chunk.head_start, num_kv_heads=chunk.num_kv_heads)
                metas.append((self.next_index, fields, tuple(chunk.payload.shape),
                              str(chunk.payload.dtype).removeprefix("torch.")))
                self.next_index += 1
            group.gather((metas, ev.completed, ev.failed))

        def rx_import(msg):
            _, rank, index, block_ids, start, layer_start = msg
            if rank == me:
                c = self.arrived[index]
                kv.import_tokens(block_ids, start, c.payload, layer_start, c.head_start)

        def rx_release(msg):
            if msg[1] == me:
                self.receiver.release(self.arrived.pop(msg[2]))

        link = self.sender if self.sender is not None else self.receiver
        return {
            "tx_export": export, "tx_send": send, "tx_poll": tx_poll,
            "tx_abort": lambda msg: self.sender.abort(msg[1]),
            "tx_stats": lambda msg: group.gather(link.stats()),
            "rx_poll": rx_poll, "rx_import": rx_import, "rx_release": rx_release,
            "rx_expect": lambda msg: self.receiver.expect(msg[1]),
            "rx_abort": lambda msg: self.receiver.abort(msg[1]),
            "rx_stats": lambda msg: group.gather(link.stats()),
        }

