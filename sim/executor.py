"""What the real worker engines run on in the simulator: a clock, a runner and a sender.

``StepClock`` is the engine's time.monotonic (and time.time): the event loop's time plus
the ``offset`` its current step has run so far. The runner's step is a cost, not a
model: ``launch`` prices the batch on the cost model, and the step's host sync
(``StepLaunch.result``) moves the clock to its end, so what the engine times after the
sync reads the step's end; a KV export moves it by the export's cost. The worker driver
(sim/prefill.py) zeroes the offset before ``engine.step()`` and takes it, after, as the
step's duration. Tokens are ``simulated_token``; KV payloads are empty tensors of the
chunk's token count (the simulator moves sizes, not bytes): ``SimSender`` hands each
chunk to the simulated link (sim/link.py), whose real LinkScheduler sends it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from sim.adapters import (
    KVChunk,
    KVSender,
    Sampled,
    ScheduledItem,
    SendEvents,
    StepLaunch,
    empty_payload,
    simulated_token,
)

if TYPE_CHECKING:
    from engine.costs.model import CostModel
    from sim.loop import EventLoop


class StepClock:
    __slots__ = ("loop", "offset")

    def __init__(self, loop: EventLoop):
        self.loop = loop
        self.offset = 0.0

    def __call__(self) -> float:
        return self.loop.now + self.offset


class PendingExport:
    """A KV export the simulator does not copy (engine.kv_cache.PendingExport's face)."""

    __slots__ = ("payload",)
    event = None  # nothing in flight: the sender need not wait

    def __init__(self, payload: Any):
        self.payload = payload


class SimKV:
    """The runner's ``kv``: an export costs ``kv_export_s`` of the step, on its clock."""

    def __init__(self, costs: CostModel, clock: StepClock):
        self.costs, self.clock = costs, clock
        self._export: dict[int, float] = {}  # tokens -> kv_export_s (a pure function)

    def export_async(self, block_ids: Sequence[int], start: int, end: int) -> PendingExport:
        n = end - start
        t = self._export.get(n)
        if t is None:
            t = self._export[n] = self.costs.kv_export_s(n)
        self.clock.offset += t
        return PendingExport(empty_payload(n))

    def export_layerwise(self, block_ids: Sequence[int], start: int, end: int, groups: int):
        raise NotImplementedError("the simulator sends no KV by layers (sim/prefill.py)")


class PrefillExecutor:
    """A prefill worker's runner: a step costs the cost model's prefill of its chunks,
    its per-step overhead, the sampling of its final chunks and, where the cost model
    draws one, a step's extra (engine/costs/model.py prefill_extra_s)."""

    samples_itself = True  # (engine.execute.launch_and_sample calls launch)

    def __init__(self, costs: CostModel, clock: StepClock):
        self.costs, self.clock = costs, clock
        self.kv = SimKV(costs, clock)
        self.spread = costs.prefill_spread
        self._one_chunk: dict[tuple[int, int], float] = {}  # (C, P) -> prefill_s
        self._overhead: dict[int, float] = {}  # chunks in the step -> step_overhead_s

    def launch(self, items: Sequence[ScheduledItem]) -> StepLaunch:
        costs = self.costs
        if len(items) == 1:  # a pure function of (C, P): asked once per pair
            key = (items[0].num_tokens, items[0].start)
            t = self._one_chunk.get(key)
            if t is None:
                t = self._one_chunk[key] = costs.prefill_s([key])
        else:
            t = costs.prefill_s([(i.num_tokens, i.start) for i in items])
        overhead = self._overhead.get(len(items))
        if overhead is None:
            overhead = self._overhead[len(items)] = costs.step_overhead_s("prefill", len(items))
        rows = [Sampled(i.request, simulated_token()) for i in items if i.completes_prefill]
        t += overhead + (costs.sample_s(len(rows)) if rows else 0.0)
        if self.spread:
            first = any(i.start == 0 for i in items)  # as tools/sim_scaled.py runs_first_chunk
            t = max(t + costs.prefill_extra_s(first), 0.0)
        clock = self.clock

        def sync() -> list[Sampled]:
            clock.offset += t
            return rows

        return StepLaunch(sync)


class SimSender(KVSender):
    """A prefill worker's KV sender over its simulated links (``link_to(dest)``: the
    sim/link.py SimLink to that decode worker)."""

    def __init__(self, link_to: Callable[[str], Any], kv_bytes_per_token: int):
        self.link_to, self.kvb = link_to, kv_bytes_per_token
        self._links: dict[str, Any] = {}  # leg -> the SimLink its chunks went on
        self._events = SendEvents()
        self.bytes_sent = 0

    def send(self, chunk: KVChunk, *, dest: str) -> None:
        link = self._links.get(chunk.request_id)
        if link is None:
            link = self._links[chunk.request_id] = self.link_to(dest)
        link.send(chunk.request_id, chunk.tenant, chunk.seq_no, chunk.token_start,
                  chunk.token_end, chunk.first_token if chunk.is_final else None)
        self.bytes_sent += (chunk.token_end - chunk.token_start) * self.kvb

    def finished(self, leg_id: str) -> None:
        """The link: every frame of the leg was delivered and taken."""
        self._links.pop(leg_id, None)
        self._events.finished.append(leg_id)

    def failed(self, leg_id: str, reason: str) -> None:
        self._links.pop(leg_id, None)
        self._events.failed.append((leg_id, reason))

    @property
    def has_events(self) -> bool:
        return bool(self._events.finished or self._events.failed)

    def poll(self) -> SendEvents:
        ev = self._events
        if ev.finished or ev.failed:
            self._events = SendEvents()
        return ev

    def abort(self, request_id: str) -> None:
        link = self._links.pop(request_id, None)
        if link is not None:
            link.abort(request_id)

    def stats(self) -> dict[str, Any]:
        return {"bytes_sent": self.bytes_sent, "active_requests": len(self._links)}

    def close(self) -> None:
        pass
