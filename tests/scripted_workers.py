"""Scripted fake worker actors: a real Router with no Ray and no model. The router's
unit tests (tests/unit/test_router_*.py and others) script races with them, and
tools/control_plane_micro.py measures the front door alone over them, so they live here,
where both may import them (bench may not import tests/, which is not a package of pdserve).

A FakeActor answers the calls the router makes (`reserve`, `add`, `abort`, ...) the way a
worker does, over a real in-process control channel (runtime/channel.py `ChannelServer`,
the router's `WorkerChannel` at its ``inproc://`` address), including the parts that
decide router races: a decode
worker has a fixed number of reservation slots, aborts of unknown ids leave a tombstone
that drops the id's next `reserve`/`add` (as the real engines do), and every call is
recorded. Tests script the worker side by sending events (`emit`, `send`: one step
message each) and by the `on_reserve` / `on_add` hooks (which may await, to hold a call
in flight).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

from cluster.router.channel import CHANNEL_COMMANDS
from cluster.router.pool import WorkerHandle
from cluster.router.router import Router, RouterConfig
from engine.request import FinishReason
from runtime.channel import ChannelServer
from runtime.messages import EventKind, WorkerEvent, WorkerInfo
from runtime.stats import EngineStats


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return asyncio.ensure_future(self.fn(*args))  # runs even if nobody awaits, like Ray


def _command(fn):
    """A channel command that runs the coroutine `fn(*args)` as a task at once (even if
    nobody awaits it), answered through a Future as the worker loop answers."""
    def run(*args) -> Future:
        fut: Future = Future()

        async def call() -> None:
            try:
                fut.set_result(await fn(*args))
            except asyncio.CancelledError:
                fut.set_exception(RuntimeError("the worker's call was cancelled"))
                raise
            except Exception as e:  # noqa: BLE001 - the caller gets it
                fut.set_exception(e)

        asyncio.ensure_future(call())
        return fut
    return run


class FakeActor:
    """Answers like a worker actor; `on_reserve` / `on_add` script the races."""

    def __init__(self, worker_id: str, slots: int | None = None, block_size: int = 0, *,
                 role: str):
        self.worker_id = worker_id
        self.slots = slots  # decode: reservations it can hold (None: unlimited)
        self.budget: int | None = None  # decode: prompt tokens it can hold (None: unlimited)
        self.sizes: dict[str, int] = {}
        self.block_size = block_size
        self.calls: list[tuple[str, object]] = []
        self.held: set[str] = set()  # decode reservations / prefill jobs
        self.tombstones: set[str] = set()
        self.ended: set[str] = set()  # legs whose end this worker already reported
        self.on_reserve = self.on_add = None
        self.channel = ChannelServer(worker_id, role, b"", {
            "hello": lambda: worker_id,
            **{name: _command(getattr(self, f"_{name}")) for name in CHANNEL_COMMANDS}})

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(getattr(self, f"_{name}"))

    async def _ready(self):
        return WorkerInfo(self.worker_id, "fake", num_blocks=100, block_size=self.block_size,
                          endpoint=f"fake://{self.worker_id}", channel=self.channel.inproc)

    async def _reserve(self, task):
        self.calls.append(("reserve", task.leg_id))
        if self.on_reserve:
            await self.on_reserve(task)
        if self.block_size and task.prompt_len + 1 > 100 * self.block_size:
            raise ValueError(f"prompt of {task.prompt_len} tokens cannot fit this decode "
                             "worker's KV cache")
        if task.leg_id in self.tombstones:
            self.tombstones.discard(task.leg_id)
            return False
        if self.slots is not None and len(self.held) >= self.slots:
            return False
        if self.budget is not None and sum(self.sizes.get(leg, 0) for leg in self.held) \
                + task.prompt_len > self.budget:  # (summed only then: the micro bench's
            return False                          # CPU is the front door's)
        self.held.add(task.leg_id)
        self.sizes[task.leg_id] = task.prompt_len
        return True

    async def _add(self, task):
        self.calls.append(("add", task.leg_id))
        if self.on_add:
            await self.on_add(task)
        if task.leg_id in self.tombstones:  # its abort overtook it: dropped
            self.tombstones.discard(task.leg_id)
            return
        if task.leg_id not in self.ended:  # a hook may have served it already
            self.held.add(task.leg_id)

    async def _set_decode_pressure(self, pressure):
        self.calls.append(("set_decode_pressure", pressure))

    async def _keepalive(self, request_ids):
        self.calls.append(("keepalive", tuple(request_ids)))
        return len(request_ids)

    async def _abort(self, request_id):
        self.calls.append(("abort", request_id))
        if request_id in self.held:
            self.held.discard(request_id)
            return True
        self.tombstones.add(request_id)
        return False

    async def _switch_role(self, role):
        """A RoleWorker's switch: refused while it holds a leg, as the real one does."""
        self.calls.append(("switch_role", role))
        if self.held:
            raise RuntimeError(f"{self.worker_id} still holds legs {sorted(self.held)}")
        self.channel.set_role(role, self.channel.commands)
        return WorkerInfo(self.worker_id, role, num_blocks=100, block_size=self.block_size,
                          endpoint=f"fake://{self.worker_id}" if role == "decode" else "",
                          channel=self.channel.inproc)

    async def _stats(self):
        return EngineStats(role="fake", num_running=len(self.held))

    # ---- the worker side, scripted by tests ---------------------------------------
    def emit(self, kind: EventKind, leg_id: str, tokens: tuple[int, ...] = (),
             finish_reason: str | None = None, message: str = "") -> None:
        """Report an event; one that ends the leg here frees what it held."""
        if kind in (EventKind.PREFILL_DONE, EventKind.PREEMPTED, EventKind.FAILED) or finish_reason is not None:
            self.held.discard(leg_id)
            self.ended.add(leg_id)
        reason = FinishReason(finish_reason) if finish_reason is not None else None
        self.send(WorkerEvent(kind, leg_id, self.worker_id, tokens, finish_reason=reason,
                              message=message))

    def send(self, *events: WorkerEvent) -> None:
        """One step message with `events` (as is: nothing is freed here), published at
        the next turn of the loop: as a worker's step follows the commands before it, its
        message follows their replies."""
        asyncio.get_running_loop().call_soon(self.channel.publish, list(events))

    def calls_of(self, name: str) -> list:
        return [arg for call, arg in self.calls if call == name]


def fake_worker(worker_id: str, role: str, slots: int | None = None,
                block_size: int = 0) -> WorkerHandle:
    """A FakeActor's handle, its channel's address known (as a launcher's is)."""
    w = WorkerHandle(worker_id, role, FakeActor(worker_id, slots, block_size, role=role))
    w.channel = w.actor.channel.inproc
    return w


def make_router(decode_slots: int | None = None, n_decode: int = 1, block_size: int = 0,
                **cfg) -> tuple[Router, WorkerHandle, list[WorkerHandle]]:
    prefill = fake_worker("prefill-0", "prefill")
    decode = [fake_worker(f"decode-{i}", "decode", decode_slots, block_size)
              for i in range(n_decode)]
    for w in decode:
        w.refresh(WorkerInfo(w.worker_id, "decode", num_blocks=100, block_size=block_size,
                             endpoint=f"fake://{w.worker_id}", channel=w.channel))
    router = Router([prefill], decode, RouterConfig(**cfg), tokenizer=None,
                    vocab_size=100, max_model_len=1000)
    return router, prefill, decode


def serve_leg(prefill: WorkerHandle, decode: WorkerHandle, leg_id: str,
              tokens: tuple[int, ...] = (7, 8)) -> None:
    """What the two workers report for a served leg: first token, prefill done, the rest
    of the tokens from decode (the last one finishes the request)."""
    prefill.actor.emit(EventKind.FIRST_TOKEN, leg_id, tokens[:1])
    prefill.actor.emit(EventKind.PREFILL_DONE, leg_id)
    if len(tokens) > 1:
        decode.actor.emit(EventKind.TOKENS, leg_id, tokens[1:], finish_reason="length")


async def until(cond, what: str, bound_s: float = 10.0) -> None:
    """Yield to the loop until `cond()` holds; the bound only turns a hang into a failure."""
    loop = asyncio.get_running_loop()
    end = loop.time() + bound_s
    while not cond():
        if loop.time() >= end:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.002)


async def collect(agen) -> list[int]:
    """Every token of a stream of TokenDeltas, read to its end."""
    return [t for d in [d async for d in agen] for t in d.token_ids]
