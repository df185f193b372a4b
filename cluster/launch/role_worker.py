"""RoleWorker: a pool worker that changes role live (`pdserve serve --planner`).

It holds both ends of the KV link (a sender for the prefill role, a receiver for the
decode role, whose endpoint it always serves) and one runner: the weights and the KV
memory. `switch_role` runs on its loop between two steps, once the engine holds no leg
and no KV send (the router drained it: cluster/router/admin.py `switch_role`): the other
role's engine is built over the same runner (prefill_worker/worker.py and
decode_worker/worker.py `build_engine`), the channel takes that role's commands, and the
answer is the worker's new WorkerInfo. Nothing is reloaded; the prefix cache of a prefill engine is dropped with
it (its blocks are the new engine's free memory).

Both roles share one EngineConfig (the launcher checks the block sizes agree): the runner
keeps the compile mode of the role it started in, so a worker that started as prefill
decodes without decode graphs after a switch.
"""

from __future__ import annotations

import time
from typing import Any

import ray

from decode_worker import worker as decode_role
from kv_transfer.registry import make_receiver, make_sender
from prefill_worker import worker as prefill_role
from runtime.messages import WorkerInfo, WorkerLoad
from runtime.spec import WorkerSpec
from runtime.worker import ACTOR_CONCURRENCY, WorkerBase, advertised

ROLE_SWITCH_ROLES = ("prefill", "decode")


class RoleWorker(WorkerBase):
    def __init__(self, specs: dict[str, WorkerSpec], role: str):
        if role not in ROLE_SWITCH_ROLES or set(specs) != set(ROLE_SWITCH_ROLES):
            raise ValueError(f"a RoleWorker needs a prefill and a decode spec and starts as "
                             f"one of {ROLE_SWITCH_ROLES}, got {sorted(specs)} / {role!r}")
        super().__init__(specs[role])
        self.specs = specs
        p, d = specs["prefill"], specs["decode"]
        self.sender = make_sender(p.transfer, **p.connector_kwargs())
        self.receiver = make_receiver(d.transfer, **d.connector_kwargs())
        if self.faults is not None and self.faults.has_kv_faults:
            self.sender.wrap_transports(self.faults.wrap_transport)
        self.switches = 0
        self.start(lambda: self._build(role, None))
        self.receiver.set_arrival_hook(self.loop.wake)

    @property
    def role(self) -> str:
        return self.spec.role

    def _build(self, role: str, runner: Any):
        if role == "prefill":
            return prefill_role.build_engine(self.specs[role], self.cfg, self.sender,
                                             self.num_blocks, self.tracer, False, runner)
        return decode_role.build_engine(self.specs[role], self.cfg, self.receiver,
                                        self.num_blocks, self.tracer, self.faults, 1, runner)

    def _role_module(self):
        return prefill_role if self.role == "prefill" else decode_role

    def channel_commands(self) -> dict:
        return {**super().channel_commands(),
                **self._role_module().channel_commands(self.engine, self.loop.command)}

    def load(self) -> WorkerLoad:
        return self._role_module().load(self.engine)

    def endpoint(self) -> str:
        return advertised(self.receiver.endpoint) if self.role == "decode" else ""

    def switch_role(self, role: str) -> WorkerInfo:
        """Become a `role` worker over the same runner; raises while a leg is still held
        here (the router drains the worker first) or for a role it cannot take."""
        if role not in ROLE_SWITCH_ROLES:
            raise ValueError(f"role must be one of {ROLE_SWITCH_ROLES}, got {role!r}")

        def swap() -> float:
            old = self.engine
            if role == self.role:
                return 0.0
            if old.has_work or getattr(old, "kv_in_flight", 0):  # (a prefill's sends too)
                raise RuntimeError(f"{self.spec.worker_id} still holds legs as a {self.role} "
                                   "worker: drain it before switching")
            t0 = time.monotonic()
            engine = self._build(role, old.runner)
            self.engine = self.loop.engine = engine
            self.spec = self.specs[role]
            if self.channel is not None:
                self.channel.set_role(role, self.channel_commands())
            self.switches += 1
            return time.monotonic() - t0

        self.loop.call(swap)
        return self.ready()

    def kv_deliver(self, msg: dict, payload: Any = None) -> list:
        return self.receiver.deliver(msg, payload)

    def shutdown(self) -> None:
        super().shutdown()
        self.sender.close()
        self.receiver.close()


RemoteRoleWorker = ray.remote(max_concurrency=ACTOR_CONCURRENCY)(RoleWorker)
