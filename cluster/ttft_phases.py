"""The TTFT split into its phases: one rule for the router's histograms
(``pdserve:ttft_phase_seconds``, cluster/metrics.py) and the bench's tables
(bench/records.py ``RequestRecord.ttft_phases``). Torch-free, dependency-free.

Each phase is a duration on the clock that saw it (monotonic within its process):
admission (router: the admission queue and the decode reservation), prefill_queue and
prefill_compute (the prefill worker: waiting for its first chunk, then the chunks up to
the first token), control (the router's TTFT less those: the add's trip to the worker
and the first token's trip back, event loops included) and delivery (the client's TTFT
less the router's: the front door and the network both ways). pdserve streams the first
token from the prefill worker, so the KV transfer and decode admission fall on the
second token. The phases add up to the client's TTFT by construction.
"""

from __future__ import annotations

SERVER_PHASES: tuple[str, ...] = ("admission", "prefill_queue", "prefill_compute", "control")
TTFT_PHASES: tuple[str, ...] = (*SERVER_PHASES, "delivery")


def server_phases(router_ttft_s: float | None, admission_s: float | None,
                  queue_s: float | None, prefill_s: float | None) -> dict[str, float] | None:
    """The router-side phases (SERVER_PHASES) of a request whose first token came from a
    prefill; None otherwise (no first token, no prefill, or a time missing)."""
    if any(v is None for v in (router_ttft_s, admission_s, queue_s, prefill_s)):
        return None
    if not (router_ttft_s > 0 and prefill_s > 0):  # type: ignore[operator]
        return None
    return {"admission": admission_s, "prefill_queue": queue_s, "prefill_compute": prefill_s,
            "control": router_ttft_s - admission_s - queue_s - prefill_s}  # type: ignore[operator]


def ttft_phases(ttft_s: float | None, router_ttft_s: float | None, admission_s: float | None,
                queue_s: float | None, prefill_s: float | None) -> dict[str, float] | None:
    """The client's TTFT ``ttft_s`` split into TTFT_PHASES (they sum to it); None where
    :func:`server_phases` is None or the client saw no first token."""
    server = server_phases(router_ttft_s, admission_s, queue_s, prefill_s)
    if server is None or ttft_s is None:
        return None
    return {**server, "delivery": ttft_s - router_ttft_s}  # type: ignore[operator]
