"""WorkerActor: the calls a worker actor answers, as the router sees them.

The router holds every worker through this protocol (cluster/router/pool.py): a Ray actor
handle of runtime.worker.WorkerBase's subclasses (or a test's scripted fake) wrapped in
its control channel (cluster/router/channel.py `ChannelActor`), which carries the hot
commands (`add`, `reserve`, `abort`, `keepalive`, `set_decode_pressure`) and forwards the
rest. Each call is `handle.<method>.remote(*args)`, an awaitable of the result. Prefill
workers answer `add` and `set_decode_pressure`, decode workers `reserve`, `keepalive`
and `kv_deliver`, a colocated engine both roles' calls.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Protocol, TypeVar

from runtime.messages import WorkerInfo
from runtime.stats import EngineStats

R_co = TypeVar("R_co", covariant=True)


class RemoteMethod(Protocol[R_co]):
    def remote(self, *args: Any) -> Awaitable[R_co]: ...


class WorkerActor(Protocol):
    ready: RemoteMethod[WorkerInfo]
    add: RemoteMethod[None]  # (PrefillTask)
    reserve: RemoteMethod[bool]  # (DecodeTask): room promised for the leg
    abort: RemoteMethod[bool]  # (leg_id)
    keepalive: RemoteMethod[int]  # (leg ids whose prefill is still on)
    set_decode_pressure: RemoteMethod[None]  # (pressure): adaptive chunk cap
    stats: RemoteMethod[EngineStats]
    drain_trace: RemoteMethod[list[dict]]
    ping: RemoteMethod[str]
    shutdown: RemoteMethod[None]
