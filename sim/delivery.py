"""How a worker's tokens reach the client: the control plane's delivery model.

A step's tokens leave the worker at the step's end. They reach the router ``token_s``
later when the path is free; after a delivery the path is busy for ``gap_s`` (the router
applies the events and asks again), and what the worker produces meanwhile goes with the
next delivery, coalesced. ``scope`` says what one path is: ``"worker"`` -- the router
long-polls each worker (one poll returns every event of every stream of that worker;
``poll_timeout_s``: an empty poll returns after it and the next one is armed ``gap_s``
later) -- or ``"request"`` -- each stream is its own path (a reader that takes what
accumulated since its last read). ``first_token_s``: a prefill step's end to the router
having the first token. The figures come from the real service at idle
(sim/measure_control.py) or are assumed (analytic and synthetic calibrations).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

SCOPES = ("worker", "request")


@dataclass(frozen=True)
class Delivery:
    first_token_s: float
    token_s: float
    gap_s: float = 0.0
    scope: str = "request"
    poll_timeout_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("first_token_s", "token_s", "gap_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"Delivery.{name} must be a finite number >= 0, got {v!r}")
        if self.scope not in SCOPES:
            raise ValueError(f"Delivery.scope must be one of {SCOPES}, got {self.scope!r}")
        if self.poll_timeout_s is not None and not self.poll_timeout_s > 0:
            raise ValueError(f"Delivery.poll_timeout_s must be > 0, got {self.poll_timeout_s}")

    @property
    def coalesces(self) -> bool:
        return self.gap_s > 0

    def arrivals(self, ends: np.ndarray) -> np.ndarray:
        """When the tokens of steps ending at ``ends`` (sorted) reach the router; the path
        is free before the first one."""
        ends = np.asarray(ends, dtype=float)
        if not self.coalesces or len(ends) == 0:
            return ends + self.token_s
        out = np.empty_like(ends)
        armed, gap, timeout = ends[0], self.gap_s, self.poll_timeout_s
        cycle = None if timeout is None else timeout + gap
        i, n = 0, len(ends)
        while i < n:
            e = ends[i]
            if e < armed:
                taken = armed  # produced while the path was busy: taken once it is free
            elif cycle is None:
                taken = e
            else:  # armed polls time out empty and are re-armed gap_s later
                k = math.floor((e - armed) / cycle)
                phase = e - armed - k * cycle
                taken = e if phase <= timeout else armed + (k + 1) * cycle
            j = int(np.searchsorted(ends, taken, side="right"))
            out[i:j] = taken + self.token_s
            armed = taken + gap
            i = j
        return out

    def to_dict(self) -> dict:
        return {"first_token_s": self.first_token_s, "token_s": self.token_s,
                "gap_s": self.gap_s, "scope": self.scope, "poll_timeout_s": self.poll_timeout_s}


def fit_delivery(streams: list[tuple[np.ndarray, np.ndarray]], *, first_token_s: float,
                 scope: str, poll_timeout_s: float | None, offset_s: float = 0.0,
                 ) -> tuple[Delivery, float]:
    """``token_s`` and ``gap_s`` that best reproduce measured streams: each is (step ends,
    client arrival times) of one request's decode tokens on an idle service. Which steps
    go together depends on ``gap_s`` alone and ``token_s`` only shifts them, so for each
    ``gap_s`` of a fine grid the best ``token_s`` is the median residual; the pair with
    the least mean absolute error of the arrivals wins (returned with that error).
    ``offset_s`` is subtracted from ``token_s`` (work the simulator already counts in the
    step after the measured end)."""
    best: tuple[float, float, float] | None = None
    for gap in np.concatenate([[0.0], np.geomspace(5e-5, 0.05, 400)]):
        taken = Delivery(first_token_s, 0.0, float(gap), scope, poll_timeout_s)
        resid = np.concatenate([a - taken.arrivals(e) for e, a in streams])
        tok = max(float(np.median(resid)), 0.0)
        err = float(np.mean(np.abs(resid - tok)))
        if best is None or err < best[0]:
            best = (err, tok, float(gap))
    err, tok, gap = best
    return Delivery(first_token_s, max(tok - offset_s, 0.0), gap, scope, poll_timeout_s), err
