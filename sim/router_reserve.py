"""The simulated router's reserve sent with the add (cluster/router/router.py ``_decode_at_once``
and ``_reserve_reply`` on the simulated clock).

With ``RouterConfig.reserve_with_add`` on and nobody waiting for admission, a new leg's
decode ``reserve`` and prefill ``add`` go out at the same instant, to the first decode
worker in the admission's order that has no reserve in flight (the admission's or one
sent this way) and room for the prompt by its last load message (cluster/router/pool.py
``has_room``, the router's rule; the view is what the simulated worker published at its
last step start, sim/decode.py). With ``pipelined_reserves`` reserves in flight do not
stop another: the worker with the least KV usage counting the blocks they ask for (then
the fewest of them; then the first in the admission's decode order), among those with
room for the prompt after them. The answer: granted, nothing more; cannot fit,
RESOURCE_EXHAUSTED; refused, the leg ends on the prefill worker and a new leg queues for
admission with the refusal counted in its round when no room was freed since it was
asked. KV that overtakes its reserve waits on the decode worker (sim/decode.py).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from sim.adapters import ReservesInFlight, decode_task, has_room
from sim.router_upkeep import RouterUpkeep

if TYPE_CHECKING:
    from sim.admission import SimAdmission
    from sim.decode import SimDecode
    from sim.router import Flight


class ReserveWithAdd(RouterUpkeep):
    """SimRouter's reserve-with-add (a base class: it reads and sets the router's state;
    one chain of bases, RouterUpkeep <- ReserveWithAdd <- SimRouter, as mypyc needs)."""

    # set by SimRouter.__init__ (declared here for the type checker and mypyc)
    admission: SimAdmission
    reserving: ReservesInFlight
    promisable: dict[str, int]
    same_size: bool  # every decode worker has the same blocks and block size

    def place(self, flight: Flight, decode: SimDecode) -> None:
        raise NotImplementedError

    def dispatch(self, flight: Flight, refused: tuple | None = None) -> None:
        raise NotImplementedError

    def end_leg(self, f: Flight, ended: tuple = ()) -> None:
        raise NotImplementedError

    def fail(self, f: Flight, error: str) -> None:
        raise NotImplementedError

    def decode_at_once(self, prompt_len: int) -> SimDecode | None:
        """cluster/router/router.py _decode_at_once (every simulated prefill worker is alive)."""
        adm = self.admission
        if not self.cfg.reserve_with_add or len(adm):
            return None
        busy, reserving, view = adm.core.busy, self.reserving, self.promisable
        if self.cfg.pipelined_reserves:
            return self._least_promised(prompt_len)
        for w in adm.candidates()[0]:
            if id(w) not in busy and id(w) not in reserving and \
                    has_room(view[w.worker_id], w.bm.block_size, prompt_len):
                return w
        return None

    def _least_promised(self, prompt_len: int) -> SimDecode | None:
        """cluster/router/router.py _least_promised over the admission's order of the decode
        workers (every one: none dies here): the least KV usage by the last load, counting
        the reserves in flight (then the fewest of them), among those with room; the
        first in that order of those tied. The order is asked for only when there is a
        tie (it is a sort); the key, ``(usage, n)``, is compared field by field, and most
        arrivals find no reserve in flight anywhere and ask the ledger nothing."""
        reserving, view = self.reserving, self.promisable
        none = not reserving
        if none and self.same_size:
            return self._most_free(prompt_len)
        workers: list[SimDecode] = self.sim.decode  # (typed: mypyc reads their fields natively)
        best: list[SimDecode] = []  # those with the least key so far
        best_usage, best_n = 0.0, 0
        for w in workers:
            n, blocks = (0, 0) if none else reserving.of(id(w))
            bm = w.bm
            free, total = view[w.worker_id], bm.num_blocks
            if not has_room(free - blocks, bm.block_size, prompt_len):
                continue
            usage = 1.0 - free / total + blocks / total
            if not best or usage < best_usage or (usage == best_usage and n < best_n):
                best, best_usage, best_n = [w], usage, n
            elif usage == best_usage and n == best_n:
                best.append(w)
        if len(best) > 1:
            return next(w for w in self.admission.candidates()[0] if w in best)
        return best[0] if best else None

    def _most_free(self, prompt_len: int) -> SimDecode | None:
        """``_least_promised`` with no reserve in flight, on decode workers of one size
        (blocks, block size): the key is (1 - free / total, 0), so the least is the most
        free blocks and ties are equal free counts (distinct counts of one total never
        round to one usage); has_room grows with free, so when the most free has no room
        none has. The same choice, without a loop in Python per worker."""
        view = self.promisable
        frees = list(view.values())  # (in the order of sim.decode: the dict was built so)
        most = max(frees)
        if not has_room(most, self.sim.decode[0].bm.block_size, prompt_len):
            return None
        if frees.count(most) == 1:
            return self.sim.decode[frees.index(most)]
        return next(w for w in self.admission.candidates()[0] if view[w.worker_id] == most)

    def reserve_with_add(self, f: Flight, decode: SimDecode) -> None:
        """Send the leg's reserve to ``decode`` and its add to a prefill worker, now."""
        blocks = self.reserving.sent(id(decode), f.leg_prompt_len, decode.bm.block_size)
        req = f.req
        task = decode_task(f.leg_id, f.leg_prompt_len, req.max_tokens - f.generated,
                           req.tenant)
        reply = partial(self._reserve_answer, f, decode, f.leg_id, self.admission.core.round,
                        blocks)
        self.sim.emit(decode.command, decode.reserve, task, reply)
        self.place(f, decode)

    def _reserve_answer(self, f: Flight, w: SimDecode, leg: str, round_: int, blocks: int,
                        ok: bool, error: str | None) -> None:  # (on the worker: travels back)
        self.sim.emit(self._reserve_reply, f, w, leg, round_, blocks, ok, error)

    def _reserve_reply(self, f: Flight, w: SimDecode, leg: str, round_: int, blocks: int,
                       ok: bool, error: str | None) -> None:
        """cluster/router/router.py _reserve_reply (a simulated worker never dies)."""
        self.reserving.answered(id(w), blocks)
        if ok or f.leg_id != leg or f.done:
            return  # (an ended leg's end aborted it on both workers)
        self.held[w.worker_id].discard(leg)  # it holds nothing of the leg: no abort to it
        fresh = round_ == self.admission.core.round  # no room freed since it was asked
        self.end_leg(f)
        if error is not None:
            return self.fail(f, f"RESOURCE_EXHAUSTED: {error}")
        self.dispatch(f, (w, self.admission.core.round if fresh else -1))
