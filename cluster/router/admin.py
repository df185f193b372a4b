"""RouterAdmin: the router's calls outside a request's path (cluster/router/router.py holds the
path): the tokenizer's helpers, client aborts, worker liveness, health, stats, traces
and shutdown."""

from __future__ import annotations

import asyncio
import time

from cluster.router.pool import WorkerHandle
from cluster.router.types import ClusterStats, ErrorCode, RouterError


class RouterAdmin:
    """Mixed into Router, whose state (pools, flights, admission, pump) it reads."""

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text).input_ids)

    def detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    @property
    def workers(self) -> list[WorkerHandle]:
        """Every distinct worker (a colocated engine plays both roles)."""
        seen: dict[int, WorkerHandle] = {}
        for w in self.prefill + self.decode + self.switching:
            seen.setdefault(id(w), w)
        return list(seen.values())

    @property
    def waiting_admission(self) -> int:
        return len(self.admission)

    @property
    def num_inflight(self) -> int:
        """Requests this router serves now (admitted or waiting)."""
        return len(self.flights)

    async def abort(self, request_id: str) -> bool:
        flight = self.flights.get(request_id)
        if flight is None:
            return False
        self.fail(flight, RouterError(ErrorCode.CANCELLED, "aborted by the client"))
        return True

    def mark_dead(self, w: WorkerHandle) -> None:
        """`w` stopped answering: re-dispatch its legs; the pump re-adopts it once back."""
        self.pump.mark_dead(w)

    async def switch_role(self, worker_id: str, role: str, *, drain_timeout_s: float = 300.0,
                          poll_s: float = 0.01) -> float:
        """Move a live worker to the other pool without restarting it (a RoleWorker,
        cluster/launch/role_worker.py): it leaves its pool at once (placement and
        admission see it no more), its legs finish there, then it changes role and joins
        the other pool. Returns the switch's duration in seconds. A worker that does not
        drain within `drain_timeout_s`, or the last live one of its role, stays where it
        was (RouterError)."""
        if role not in ("prefill", "decode"):
            raise RouterError(ErrorCode.INVALID_ARGUMENT,
                              f"role must be 'prefill' or 'decode', got {role!r}")
        w = next((w for w in self.prefill + self.decode if w.worker_id == worker_id), None)
        if w is None:
            raise RouterError(ErrorCode.INVALID_ARGUMENT, f"no worker {worker_id!r} in either pool"
                              + (" (it is switching already)" if any(
                                  s.worker_id == worker_id for s in self.switching) else ""))
        if w.role == role:
            return 0.0
        old, new = (self.prefill, self.decode) if w.role == "prefill" else \
            (self.decode, self.prefill)
        if not any(o.alive for o in old if o is not w):
            raise RouterError(ErrorCode.INVALID_ARGUMENT,
                              f"{worker_id} is the last live {w.role} worker")
        t0 = time.monotonic()
        old.remove(w)
        self.switching.append(w)
        try:
            while w.legs or self.admission.core.promised_on(w) or \
                    self._reserving.of(id(w))[0]:
                if time.monotonic() - t0 > drain_timeout_s:
                    raise RouterError(ErrorCode.DEADLINE_EXCEEDED,
                                      f"{worker_id} still holds {len(w.legs)} leg(s) after "
                                      f"{drain_timeout_s:g}s: it stays a {w.role} worker")
                await asyncio.sleep(poll_s)
            info = await w.actor.switch_role.remote(role)  # (over Ray: not a hot command)
        except BaseException:
            self.switching.remove(w)
            old.append(w)
            raise
        self.switching.remove(w)
        w.role = info.role
        w.refresh(info)
        w.load = w.stats = None  # the other role's load comes with its next message
        new.append(w)
        self.admission.wake_head()
        return time.monotonic() - t0

    def wake_admission(self) -> None:
        """Decode capacity may have freed: the head of the admission queue asks again."""
        self.admission.wake_head()

    def healthy(self) -> bool:
        return self.serving and any(w.alive for w in self.prefill) and any(
            w.alive for w in self.decode)

    async def stats(self) -> ClusterStats:
        await self.start()
        workers = await self.pump.collect_stats()
        return ClusterStats(
            tuple(workers), router_queue_depth=len(self.admission),
            num_inflight=self.num_inflight, serving=self.healthy(),
            admission_contended_tokens=dict(self.admission.core.contended_tokens),
        )

    async def drain_traces(self) -> list[dict]:
        """Trace events recorded by every live worker since the last call (plain dicts)."""
        return await self.pump.collect_traces()

    async def shutdown(self, drain_timeout_s: float = 10.0) -> None:
        self.serving = False
        end = time.monotonic() + drain_timeout_s
        while self.flights and time.monotonic() < end:
            await asyncio.sleep(0.05)
        for flight in list(self.flights.values()):
            self.fail(flight, RouterError(ErrorCode.UNAVAILABLE, "server shut down"))
        await self.pump.stop()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self.on_shutdown is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.on_shutdown)
            self.on_shutdown = None

