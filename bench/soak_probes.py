"""What an in-process soak can see inside the router (a remote client cannot): a
request's phase at the moment it is cancelled or aborted, and how many legs it took
(a leg beyond the first is a redispatch: a decode preemption or a failed worker);
``SoakHooks`` bundles them with the drain and stats hooks of a service the soak runs.

The probes only read the router's state (from the soak's own thread); a request the
router does not know (yet, or any more) is ``None``/"not-routed".
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

PhaseProbe = Callable[[str], "str | None"]
LegProbe = Callable[[str], "int | None"]


@dataclass
class SoakHooks:
    """What a soak that runs the service in its own process can do besides RPCs."""

    phase_probe: PhaseProbe | None = None
    leg_probe: LegProbe | None = None
    # start a drain; returns once the server is draining, with a future of its end
    start_drain: Callable[[], concurrent.futures.Future] | None = None
    stats: Callable[[], Awaitable] | None = None  # ClusterStats, also once gRPC is down


def router_phase_probe(router, *, fine: bool = False) -> PhaseProbe:
    """A request's phase from the disaggregated router's own state.

    Coarse (the plain soak's ``PHASES``): queued (no decode reservation yet), prefill,
    transfer (one token), decode. ``fine`` (``ABORT_PHASES``) splits the time before a
    reservation: admission (accepted by the front door but not routed yet, or reserved
    and not yet on a prefill worker) and queued (routed, waiting for a decode worker).
    """

    def probe(request_id: str) -> str | None:
        f = router.flights.get(request_id)
        if f is None:
            return "admission" if fine else "not-routed"
        if f.done:
            return "ending"
        n = len(f.generated)
        on_prefill = f.prefill is not None and f.leg_id in f.prefill.legs
        if f.decode is None:
            return "admission" if fine and getattr(f, "admitted", False) else "queued"
        if n == 0:
            if on_prefill:
                return "prefill"
            return "admission" if fine else "queued"
        return "transfer" if n == 1 else "decode"

    return probe


def router_leg_probe(router) -> LegProbe:
    """The number of the request's current leg (1 = never redispatched)."""

    def probe(request_id: str) -> int | None:
        f = router.flights.get(request_id)
        return None if f is None else getattr(f, "leg", None)

    return probe
