"""How a worker's tokens reach the client: the control plane's delivery model.

A step's tokens leave the worker at the step's end. They reach the router ``token_s``
later when the path is free; after a delivery the path is busy for ``gap_s`` (the router
applies the events and asks again), and what the worker produces meanwhile goes with the
next delivery, coalesced; every ``stall_every``-th delivery holds the path ``stall_s``
longer (the stalls of a busy event loop or a thread waiting for the GIL): by ``stall_s``
(``stall_shape`` "fixed") or by ``stall_s`` times the next of a fixed sequence of
exponential quantiles with mean 1 ("exp": stalls of many sizes, so the figures above the
stalls' share, e.g. an ITL p99, are not all one height). ``scope`` says
what one path is: ``"router"`` -- every worker pushes one message per step and the
router's event loop and detokenizer thread take what queued meanwhile as one batch (the
per-step control channel) -- ``"worker"`` -- the router long-polls each worker (one
poll returns every event of that worker; ``poll_timeout_s``: an empty poll returns after
it and the next one is armed ``gap_s`` later) -- or ``"request"`` -- each stream is its
own path (a reader that takes what accumulated since its last read). ``first_token_s``: a prefill step's end to the router
having the first token. The figures come from the real service at idle
(sim/measure_control.py) or are assumed (analytic and synthetic calibrations).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

SCOPES = ("router", "worker", "request")
STALL_SHAPES = ("fixed", "exp")
# the "exp" stalls' multipliers: the 64 mid-quantiles of an exponential with mean 1, in a
# scrambled fixed order (41 is prime to 64: every one once per 64 stalls)
_N = 64
_Q = [-math.log(1.0 - (i + 0.5) / _N) for i in range(_N)]
EXP_STALLS = tuple(_Q[(41 * k) % _N] / (sum(_Q) / _N) for k in range(_N))


@dataclass(frozen=True)
class Delivery:
    first_token_s: float
    token_s: float
    gap_s: float = 0.0
    scope: str = "request"
    poll_timeout_s: float | None = None
    stall_s: float = 0.0  # every stall_every-th delivery holds the path this much longer
    stall_every: int = 0  # 0: never
    stall_shape: str = "fixed"

    def __post_init__(self) -> None:
        if self.stall_shape not in STALL_SHAPES:
            raise ValueError(f"Delivery.stall_shape must be one of {STALL_SHAPES}, "
                             f"got {self.stall_shape!r}")
        if self.stall_every < 0:
            raise ValueError(f"Delivery.stall_every must be >= 0, got {self.stall_every}")
        for name in ("first_token_s", "token_s", "gap_s", "stall_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"Delivery.{name} must be a finite number >= 0, got {v!r}")
        if self.scope not in SCOPES:
            raise ValueError(f"Delivery.scope must be one of {SCOPES}, got {self.scope!r}")
        if self.poll_timeout_s is not None and not self.poll_timeout_s > 0:
            raise ValueError(f"Delivery.poll_timeout_s must be > 0, got {self.poll_timeout_s}")

    @property
    def coalesces(self) -> bool:
        return self.gap_s > 0 or (self.stall_every > 0 and self.stall_s > 0)

    def arrivals(self, ends: np.ndarray) -> np.ndarray:
        """When the tokens of steps ending at ``ends`` (sorted) reach the router; the path
        is free before the first one."""
        ends = np.asarray(ends, dtype=float)
        if not self.coalesces or len(ends) == 0:
            return ends + self.token_s
        out = np.empty_like(ends)
        armed, gap, timeout = ends[0], self.gap_s, self.poll_timeout_s
        cycle = None if timeout is None else timeout + gap
        i, n, count, every = 0, len(ends), 0, self.stall_every
        sizes = EXP_STALLS if self.stall_shape == "exp" else (1.0,)
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
            count += 1
            armed = taken + gap
            if every and count % every == 0:
                armed += self.stall_s * sizes[(count // every) % len(sizes)]
            i = j
        return out

    def to_dict(self) -> dict:
        return {"first_token_s": self.first_token_s, "token_s": self.token_s,
                "gap_s": self.gap_s, "scope": self.scope, "poll_timeout_s": self.poll_timeout_s,
                "stall_s": self.stall_s, "stall_every": self.stall_every,
                "stall_shape": self.stall_shape}


LAG_Q = (10, 25, 50, 75, 90, 95, 99)  # quantiles of a token's delay after its step
ITL_Q = (10, 50, 90, 99)  # and of the client's inter-token gaps


def _quantiles(streams, arrivals) -> np.ndarray:
    lags = np.concatenate([a - e for (e, _), a in zip(streams, arrivals, strict=True)])
    itl = np.concatenate([np.diff(a) for a in arrivals])
    return np.concatenate([np.percentile(lags, LAG_Q), np.percentile(itl, ITL_Q)])


def fit_delivery(streams: list[tuple[np.ndarray, np.ndarray]], *, first_token_s: float,
                 scope: str, poll_timeout_s: float | None, offset_s: float = 0.0,
                 ) -> tuple[Delivery, float]:
    """The delivery figures that best reproduce measured streams: each is (step ends,
    client arrival times) of one request's decode tokens on an idle service. The fit
    matches distributions, not token by token (the real stalls come at random): the
    quantiles of each token's delay after its step and of the client's inter-token gaps,
    each group weighing half (the gaps are what a client sees; weighed per quantile, the
    seven delays outvoted the four gaps and the fit took a coalescing gap above the
    median inter-token gap, which then set every simulated ITL). Which steps go together
    depends on the gaps alone and ``token_s`` only shifts the delays, so for each
    (``gap_s``, stall) on a grid the best ``token_s`` follows in closed form; returned
    with that weighted mean absolute difference. The grid's steps (10% in the gap, 36% in
    the stall) are then refined around the best point, one figure at a time: a gap near
    the decode step sets the simulated ITL p50, and the 10% grid put it up to 14% off.
    ``offset_s`` is subtracted from ``token_s`` (work the simulator already counts in the
    step after the measured end)."""
    target = _quantiles(streams, [a for _, a in streams])
    nl = len(LAG_Q)

    def scored(d: Delivery) -> tuple[float, Delivery]:
        d = replace(d, token_s=0.0)
        got = _quantiles(streams, [d.arrivals(e) for e, _ in streams])
        # token_s shifts every delay quantile and no gap: the best shift in closed form
        tok = max(float(np.median(target[:nl] - got[:nl])), 0.0)
        got[:nl] += tok
        diff = np.abs(got - target)
        return (0.5 * float(np.mean(diff[:nl])) + 0.5 * float(np.mean(diff[nl:])),
                replace(d, token_s=tok))

    gap_grid, stall_grid = np.geomspace(1e-4, 0.03, 60), np.geomspace(1e-3, 0.03, 12)
    gaps = np.concatenate([[0.0], gap_grid])
    stalls = [(0.0, 0, "fixed")] + [(float(st), n, shape) for n in (4, 8, 16, 32)
                                    for st in stall_grid for shape in STALL_SHAPES]
    best = min((scored(Delivery(first_token_s, 0.0, float(gap), scope, poll_timeout_s,
                                stall_s, every, shape))
                for gap in gaps for stall_s, every, shape in stalls), key=lambda t: t[0])
    for _ in range(2):  # between the grid's neighbours of the best, a figure at a time
        for name, step in (("gap_s", gap_grid[1] / gap_grid[0]),
                           ("stall_s", stall_grid[1] / stall_grid[0])):
            x = getattr(best[1], name)
            if x > 0:
                best = min([best] + [scored(replace(best[1], **{name: float(v)}))
                                     for v in np.geomspace(x / step, x * step, 21)],
                           key=lambda t: t[0])
    err, d = best
    return replace(d, token_s=max(d.token_s - offset_s, 0.0)), err
