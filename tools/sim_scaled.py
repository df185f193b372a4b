"""A cost model whose compute is scaled by measured contention factors, one per role.

On a shared machine the same step costs more while other processes run -- other users,
and on a small box the service's own workers, router and client. A calibration taken at
one moment is brought to the conditions of a run by a factor per role: a prefill
worker's compute (model steps, KV export, its step overhead) and a decode worker's
(model steps, KV import, sampling, its step overhead); optionally the control plane's
latencies (``control``: the per-message latency and every delivery figure), which are CPU
work of the router and the workers' threads under the same contention; optionally the KV
links (``link``: latency and seconds per byte of a write, the connector's threads under the
same contention). ``delivery`` replaces the idle delivery figures by ones fitted under load
(then ``control`` scales only the per-message latency). tools/sim_validate.py measures all
of them on a separate run of the same configuration and load: the real workers' mean step
time over the simulator's, the real dispatch latency over the simulated one, the real KV
handoff over the simulated one (or, ``handoff``, each leg's real handoff less the
simulated one at the idle link, drawn per leg), and the delivery fitted to that run's
token streams.

A single factor per role cannot hold a step whose cost under load is mostly fixed (a
prefill of 36 tokens here: 0.47 ms of calibrated compute, 1.6 ms in the real worker's
span) as well as a long one (1.1x). ``steps`` replaces it, per role, by a :class:`StepFit`
measured on the same kind of run from the workers' trace spans: the step's compute as
``scale * calibrated + offset_s`` and a per-step overhead of ``overhead_s`` (what the
real step spends after the traced compute, before its next step).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from engine.costs.delivery import Delivery
from engine.costs.model import ROLES, CostModel, Limits, LinkCost

SPREAD_DRAWS = 1 << 16  # the draws cycle after this many steps
# the draws follow the real steps' own order in runs of this many (a circular block
# bootstrap): consecutive real chunks of a prompt were alike (lag-1 correlation of their
# residuals 0.35-0.54 here, the host slow for tens of ms at a time), so a long prompt's
# sum varied 2-5.6x more than independent draws gave, and its TTFT p99 came out low
SPREAD_BLOCK = 32
JOINS = {"prefill": "with a first chunk", "decode": "legs join"}  # StepFit.join_s, per role


def runs_first_chunk(chunks: Sequence[tuple[int, int]]) -> bool:
    """Whether a prefill step of (chunk tokens, context) items runs a request's first chunk
    (one at context 0): the steps ``StepFit.join_s`` adds to, as fitted and as simulated."""
    return any(p == 0 for _, p in chunks)


class _Draws:
    """A role's step spread drawn in call order: a fixed stream of ``SPREAD_DRAWS`` draws
    from ``spread`` (the real steps' residuals in the order they ran), seeded, taken in
    turn and cycling after the last: runs of ``block`` consecutive residuals from random
    starts (wrapping at the end), so the draws keep the real steps' correlation in time."""

    def __init__(self, spread: Sequence[float], seed, block: int = SPREAD_BLOCK) -> None:
        values = np.asarray(spread, dtype=float)
        starts = np.random.default_rng(seed).integers(0, len(values),
                                                      size=-(-SPREAD_DRAWS // block))
        idx = (starts[:, None] + np.arange(block)[None, :]).ravel()[:SPREAD_DRAWS]
        self.values = values[idx % len(values)]
        self.at = 0

    def take(self, n: int) -> np.ndarray:
        idx = np.arange(self.at, self.at + n) % SPREAD_DRAWS
        self.at = (self.at + n) % SPREAD_DRAWS
        return self.values[idx]


@dataclass(frozen=True)
class StepFit:
    """A role's step under load: compute ``scale * calibrated + offset_s`` per step,
    ``overhead_s`` per step in place of the calibrated overhead, and ``join_s`` more in a
    step that legs join (decode) or that runs a request's first chunk (prefill: a chunk at
    context 0; the arrival's dispatch and reserve run beside it). ``spread_s``: the real
    steps less the fitted one (median 0), in the order they ran; each simulated step adds
    one drawn at random, in runs of consecutive ones (``SPREAD_BLOCK``), so the machine's
    stalls reach the tail and the median step stays the fit.
    ``join_spread_s``: the same of the real prefill steps with a first chunk, drawn for
    such steps (``spread_s`` then holds the others'): under load a first chunk mostly
    meets a worker that idled, whose step is slow and spread wide (here a 128-token first
    chunk after 50 ms or more idle took 4.4-18 ms, p10-p90, against 2.7-4.4 ms back to
    back); from one pool, a long prompt's later chunks drew those stalls. Empty: every step
    draws from ``spread_s``. ``between_s`` (prefill): more in a step without a first chunk,
    one that follows the worker's step before it at once: what the real loop spends
    between two steps before the next span (taking commands and I/O, ``schedule()``),
    which the worker's step time does not count; a first chunk's wait before its span is
    its dispatch's (a request's dispatch is timed to its first span's start)."""

    scale: float
    offset_s: float
    overhead_s: float
    join_s: float = 0.0
    spread_s: tuple[float, ...] = ()
    join_spread_s: tuple[float, ...] = ()
    between_s: float = 0.0

    def __post_init__(self) -> None:
        if not (self.scale > 0 and self.offset_s >= 0 and self.overhead_s >= 0
                and self.join_s >= 0 and self.between_s >= 0):
            raise ValueError(f"a step fit needs scale > 0 and offsets >= 0, got {self}")
        for name in ("spread_s", "join_spread_s"):
            xs = tuple(float(x) for x in getattr(self, name))
            if not all(math.isfinite(x) for x in xs):
                raise ValueError(f"a step fit's spread must be finite ({name})")
            object.__setattr__(self, name, xs)

    def to_dict(self) -> dict:
        return {"scale": self.scale, "offset_s": self.offset_s, "overhead_s": self.overhead_s,
                "join_s": self.join_s, "spread_s": [round(x, 7) for x in self.spread_s],
                "join_spread_s": [round(x, 7) for x in self.join_spread_s],
                "between_s": self.between_s}


class ScaledCosts(CostModel):
    def __init__(self, base: CostModel, factors: Mapping[str, float], why: str,
                 delivery: Delivery | None = None,
                 steps: Mapping[str, StepFit] | None = None,
                 handoff: Sequence[float] = (),
                 arrival: Sequence[tuple[float, float]] = (), seed: int = 0):
        if set(factors) - {"control", "link"} != set(ROLES) or \
                not all(f > 0 for f in factors.values()):
            raise ValueError(f"contention factors must be > 0 for each of {ROLES}, "
                             f"got {dict(factors)}")
        if steps and set(steps) - set(ROLES):
            raise ValueError(f"step fits are per role of {ROLES}, got {sorted(steps)}")
        self.base, self.factors = base, dict(factors)
        self.steps = dict(steps or {})
        # one stream of draws per role in call order, fixed by ``seed``: a simulation is
        # repeatable, and another seed is another draw of the same terms (a repeat of the
        # real run)
        self.seed = seed
        self._draws = {role: _Draws(st.spread_s, [seed, i] if i else seed)
                       for i, role in enumerate(("decode", "prefill"))
                       if (st := self.steps.get(role)) is not None and st.spread_s}
        if (st := self.steps.get("prefill")) is not None and st.join_spread_s:
            self._draws["prefill-first"] = _Draws(st.join_spread_s, [seed, 2])
        if not all(math.isfinite(x) for x in handoff):
            raise ValueError("a handoff spread must be finite")
        self._handoff = sorted(max(float(x), 0.0) for x in handoff)
        pairs = [(float(d), float(f)) for d, f in arrival]
        if not all(math.isfinite(x) for p in pairs for x in p):
            raise ValueError("an arrival spread must be finite")
        self._arrival = sorted(pairs)
        self.calibration = base.calibration
        fc = self.factors.setdefault("control", 1.0)
        fl = self.factors.setdefault("link", 1.0)
        compute = ", ".join(
            f"{r} {st.scale:.2f}x + {st.offset_s * 1e3:.2f} ms per step, overhead "
            f"{st.overhead_s * 1e3:.2f} ms"
            f"{f', a step {JOINS[r]} +{st.join_s * 1e3:.2f} ms' if st.join_s else ''}"
            f"{f', a later chunk +{st.between_s * 1e3:.2f} ms before it' if st.between_s else ''}"
            f"{f', spread drawn from {len(st.spread_s)} real steps' if st.spread_s else ''}"
            f"{f' ({len(st.join_spread_s)} {JOINS[r]} apart)' if st.join_spread_s else ''}"
            if (st := self.steps.get(r)) else
            f"x{self.factors[r]:.2f} {r}" for r in ROLES)
        self.label = (f"{base.label}; compute {compute}, control "
                      f"plane x{fc:.2f}, KV link x{fl:.2f}"
                      f"{', delivery fitted under load' if delivery else ''}"
                      f"{f', KV handoff spread drawn from {len(handoff)} real legs' if handoff else ''}"
                      f"{f', dispatch and first-token delivery drawn from {len(pairs)} real requests' if pairs else ''}"
                      f" ({why})")
        d = base.delivery
        self._delivery = delivery or replace(
            d, first_token_s=d.first_token_s * fc, token_s=d.token_s * fc, gap_s=d.gap_s * fc)

    @property
    def rpc_s(self) -> float:
        return self.base.rpc_s * self.factors["control"]

    def prefill_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        st = self.steps.get("prefill")
        if st is not None:
            extra = st.join_s if runs_first_chunk(chunks) else st.between_s
            return self.base.prefill_s(chunks) * st.scale + st.offset_s + extra
        return self.base.prefill_s(chunks) * self.factors["prefill"]

    def decode_run_s(self, batch: int, context: int, longest: int,
                     steps: int) -> Sequence[float]:
        run = np.asarray(self.base.decode_run_s(batch, context, longest, steps))
        st = self.steps.get("decode")
        if st is None:
            return run * self.factors["decode"]
        run = run * st.scale + st.offset_s
        draws = self._draws.get("decode")
        if draws is not None:
            run = np.maximum(run + draws.take(len(run)), 0.0)
        return run

    def sample_s(self, rows: int) -> float:  # both roles sample; decode does it every step
        return self.base.sample_s(rows) * self.factors["decode"]

    def kv_export_s(self, tokens: int) -> float:
        return self.base.kv_export_s(tokens) * self.factors["prefill"]

    def kv_import_s(self, tokens: int) -> float:
        return self.base.kv_import_s(tokens) * self.factors["decode"]

    def step_overhead_s(self, role: str, items: int) -> float:
        st = self.steps.get(role)
        if st is not None:
            return st.overhead_s
        return self.base.step_overhead_s(role, items) * self.factors[role]

    def leg_join_s(self) -> float:
        st = self.steps.get("decode")
        return st.join_s if st is not None else self.base.leg_join_s()

    @property
    def prefill_spread(self) -> bool:
        return "prefill" in self._draws or "prefill-first" in self._draws

    def prefill_extra_s(self, first: bool = False) -> float:
        """The next draw of the prefill steps' spread (0 without one); a step with a first
        chunk draws from those steps' own spread where the fit kept it apart."""
        draws = self._draws.get("prefill-first") if first else None
        draws = draws or self._draws.get("prefill")
        return float(draws.take(1)[0]) if draws is not None else 0.0

    @property
    def handoff_spread(self) -> bool:
        return bool(self._handoff)

    def handoff_extra_s(self, leg_id: str) -> float:
        """One of the measured legs' unexplained handoffs (clipped at 0), picked by a hash of
        the leg's id (and the seed): the same leg gets the same draw in every run of one
        seed, whatever the order."""
        h = self._handoff
        return h[self._pick(leg_id, len(h))] if h else 0.0

    @property
    def arrival_spread(self) -> bool:
        return bool(self._arrival)

    def arrival_extra_s(self, request_id: str) -> tuple[float, float]:
        """One measured request's unexplained (dispatch, first-token delivery), the two
        together: an arrival into an idle service is slow at both (each a chain of
        wake-ups on this host), one into a busy one fast at both. Picked by a hash of the
        request's id as ``handoff_extra_s``; may be negative (faster than the model)."""
        a = self._arrival
        return a[self._pick(f"arrival:{request_id}", len(a))] if a else (0.0, 0.0)

    def _pick(self, key: str, n: int) -> int:
        return zlib.crc32(f"{self.seed}:{key}".encode() if self.seed else key.encode()) * n >> 32

    def link(self, name: str) -> LinkCost:
        c, f = self.base.link(name), self.factors["link"]
        return LinkCost(c.name, c.latency_s * f, c.bytes_per_s / f)

    def check_covers(self, limits: Limits) -> None:
        self.base.check_covers(limits)
