"""The cost model: seconds for everything the simulator does not run for real, and for
every step of the emulated accelerator (engine/emulate/), which asks the same questions.

``CostModel`` is what the simulated workers and the emulated device ask: a prefill batch's compute, a run of
decode steps, sampling, KV export/import, per-step runtime overhead, a link's write time,
control-plane latencies. :class:`TableCosts` answers from a measured calibration
(interpolation over its grids); ``engine.costs.analytic.RooflineCosts`` from hardware figures.

Prefill batch model (tables): ``T(batch) = T1(sum C, 0) + sum_i [T1(C_i, P_i) - T1(C_i, 0)]``
-- weights and the chunk-local work scale with the batch's tokens, attention over earlier
context is added per chunk. Decode: ``T(B, L)`` with ``L`` the mean attended context.
Both are bilinear over the measured grid; the calibration reports their error on points
off the grid and on mixed batches. A query outside a grid raises CalibrationError.
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from engine.costs.calibration import Calibration, CalibrationError
from engine.costs.delivery import Delivery

ROLES = ("prefill", "decode")
SMALL_RUN = 16  # runs of decode steps up to this long are computed on plain floats


@dataclass(frozen=True)
class LinkCost:
    """One write of ``n`` bytes holds the link for ``latency_s + n / bytes_per_s``."""

    name: str
    latency_s: float
    bytes_per_s: float

    def write_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class Limits:
    """What a simulated configuration can ask for (checked against the calibration)."""

    max_batch_tokens: int  # prefill: tokens of one step
    max_prefill_seqs: int
    max_decode_seqs: int
    max_model_len: int
    link: str


class CostModel(ABC):
    """Seconds for the simulator. ``label`` goes into every output."""

    calibration: Calibration
    label: str

    @abstractmethod
    def prefill_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        """Compute of one prefill step over chunks ``(C, P)``: C new tokens after P."""

    @abstractmethod
    def decode_run_s(self, batch: int, context: int, longest: int,
                     steps: int) -> Sequence[float]:
        """Durations of ``steps`` consecutive decode steps of ``batch`` requests whose
        attended tokens total ``context`` (the longest: ``longest``) in the first step,
        each step one token more each; the same figures, bit for bit, whether asked one
        step at a time or as a run."""

    @abstractmethod
    def sample_s(self, rows: int) -> float: ...

    @abstractmethod
    def kv_export_s(self, tokens: int) -> float: ...

    @abstractmethod
    def kv_import_s(self, tokens: int) -> float: ...

    @abstractmethod
    def step_overhead_s(self, role: str, items: int) -> float:
        """Runtime cost of one engine step beyond the model (scheduler, bookkeeping)."""

    @abstractmethod
    def link(self, name: str) -> LinkCost: ...

    @abstractmethod
    def check_covers(self, limits: Limits) -> None:
        """CalibrationError naming the first entry that cannot answer ``limits``."""

    @abstractmethod
    def leg_join_s(self) -> float:
        """What a decode step that legs join (their KV just taken in) costs beyond the
        steady step: on the tiny model on CPU, 0.57 ms at batch 1 in one process
        (calibrated) and 0.64 ms in the service under load, every op of that step 2-5x
        slower than in the next (the worker waited for the KV; its caches are cold)."""

    def handoff_extra_s(self, leg_id: str) -> float:
        """What a leg's KV handoff takes beyond the modelled export, link and intake. No
        calibration has such a term (0); a cost model fitted to a run under load draws the
        unexplained part of that run's handoffs per leg (tools/sim_scaled.py). Asked only where
        ``handoff_spread``."""
        return 0.0

    @property
    def handoff_spread(self) -> bool:
        return False

    def arrival_extra_s(self, request_id: str) -> tuple[float, float]:
        """What a request's dispatch (the router's add reaching its prefill worker) and its
        first token's delivery take beyond the modelled messages, as (dispatch, first
        token): no calibration has such a term; a cost model fitted to a run under load
        draws one real request's pair of that run per request (tools/sim_scaled.py). Asked only
        where ``arrival_spread``."""
        return 0.0, 0.0

    @property
    def arrival_spread(self) -> bool:
        return False

    def prefill_extra_s(self, first: bool = False) -> float:
        """What the next prefill step (``first``: one with a request's first chunk) takes
        beyond its modelled compute: no calibration has such a term (0); a cost model
        fitted to a run under load draws it from that run's steps (tools/sim_scaled.py). Asked
        only where ``prefill_spread``."""
        return 0.0

    @property
    def prefill_spread(self) -> bool:
        return False

    def decode_s(self, batch: int, context: int, longest: int | None = None) -> float:
        """One step; ``longest`` defaults to the mean context (a uniform batch)."""
        longest = -(-context // batch) if longest is None else longest
        return float(self.decode_run_s(batch, context, longest, 1)[0])

    @property
    def rpc_s(self) -> float:
        return self.calibration.number("control.rpc_s")

    @property
    def client_s(self) -> float:
        return self.calibration.number("control.client_s")

    @property
    def idle_wait_s(self) -> float:
        return self.calibration.number("control.idle_wait_s", minimum=1e-9)

    @property
    def delivery(self) -> Delivery:
        """How tokens reach the router (engine/costs/delivery.py), from ``control.delivery``."""
        d = getattr(self, "_delivery", None)
        if d is None:
            cal, key = self.calibration, "control.delivery"
            timeout = cal.get(key).get("poll_timeout_s")
            try:
                d = Delivery(cal.number(f"{key}.first_token_s"), cal.number(f"{key}.token_s"),
                             cal.number(f"{key}.gap_s"), str(cal.get(f"{key}.scope")),
                             None if timeout is None else float(timeout),
                             cal.number(f"{key}.stall_s"), int(cal.number(f"{key}.stall_every")),
                             str(cal.get(f"{key}.stall_shape")))
            except ValueError as e:
                raise CalibrationError(f"{cal.source}: entry {key!r}: {e}") from None
            self._delivery = d
        return d


def _axis(cal: Calibration, dotted: str) -> list[float]:
    xs = cal.get(dotted)
    if not isinstance(xs, list) or not xs or any(b <= a for a, b in pairwise(xs)):
        raise CalibrationError(f"{cal.source}: {dotted!r} must be a non-empty increasing list")
    return [float(x) for x in xs]


class Grid2D:
    """Bilinear interpolation over a measured grid ``seconds[i][j]`` at ``(x_i, y_j)``."""

    def __init__(self, cal: Calibration, name: str, x: str, y: str):
        self.name, self.source = name, cal.source
        self.xn, self.yn = x, y
        self.xs, self.ys = _axis(cal, f"{name}.{x}"), _axis(cal, f"{name}.{y}")
        rows = cal.get(f"{name}.seconds")
        if len(rows) != len(self.xs) or any(len(r) != len(self.ys) for r in rows):
            raise CalibrationError(f"{cal.source}: {name}.seconds must be "
                                   f"{len(self.xs)} x {len(self.ys)}")
        self.v = np.array([[np.nan if c is None else float(c) for c in r] for r in rows])

    def _bracket(self, axis: list[float], q: float, what: str) -> tuple[int, float]:
        if not axis[0] <= q <= axis[-1]:
            raise CalibrationError(
                f"{self.source}: {self.name} query {what}={q:g} is outside the calibrated "
                f"range [{axis[0]:g}, {axis[-1]:g}] (entry '{self.name}.{what}')")
        if len(axis) == 1:
            return 0, 0.0
        i = min(bisect.bisect_right(axis, q) - 1, len(axis) - 2)
        return i, (q - axis[i]) / (axis[i + 1] - axis[i])

    def _cell(self, i: int, j: int) -> float:
        v = self.v[i, j]
        if np.isnan(v):
            raise CalibrationError(
                f"{self.source}: entry '{self.name}.seconds' at {self.xn}={self.xs[i]:g}, "
                f"{self.yn}={self.ys[j]:g} was not measured")
        return float(v)

    def __call__(self, x: float, y: float) -> float:
        i, wx = self._bracket(self.xs, x, self.xn)
        j, wy = self._bracket(self.ys, y, self.yn)
        i1, j1 = min(i + 1, len(self.xs) - 1), min(j + 1, len(self.ys) - 1)
        a = self._cell(i, j) * (1 - wy) + (self._cell(i, j1) * wy if wy else 0.0)
        b = self._cell(i1, j) * (1 - wy) + (self._cell(i1, j1) * wy if wy else 0.0)
        return a * (1 - wx) + b * wx if wx else a

    def along_y(self, x: float, ys: np.ndarray) -> np.ndarray:
        """Vectorised ``self(x, y)`` for many ``y`` (rows without gaps)."""
        i, wx = self._bracket(self.xs, x, self.xn)
        self._bracket(self.ys, float(ys.min()), self.yn)
        self._bracket(self.ys, float(ys.max()), self.yn)
        i1 = min(i + 1, len(self.xs) - 1)
        for row in {i, i1}:
            if np.isnan(self.v[row]).any():
                j = int(np.flatnonzero(np.isnan(self.v[row]))[0])
                self._cell(row, j)  # raises, naming the unmeasured cell
        a = np.interp(ys, self.ys, self.v[i])
        return a if not wx else a * (1 - wx) + np.interp(ys, self.ys, self.v[i1]) * wx


class Curve:
    """Piecewise-linear ``seconds(x)`` over measured points; outside them an error."""

    def __init__(self, cal: Calibration, name: str):
        self.name, self.source = name, cal.source
        self.xs = _axis(cal, f"{name}.x")
        ys = cal.get(f"{name}.seconds")
        if len(ys) != len(self.xs) or any(y is None for y in ys):
            raise CalibrationError(f"{cal.source}: {name}.seconds must have one value per x")
        self.ys = [float(y) for y in ys]

    def __call__(self, x: float) -> float:
        if not self.xs[0] <= x <= self.xs[-1]:
            raise CalibrationError(
                f"{self.source}: {self.name} query x={x:g} is outside the calibrated range "
                f"[{self.xs[0]:g}, {self.xs[-1]:g}] (entry '{self.name}.x')")
        return float(np.interp(x, self.xs, self.ys))


class TableCosts(CostModel):
    """Costs measured on a machine (``pdserve calibrate``), interpolated."""

    def __init__(self, cal: Calibration):
        if cal.kind not in ("measured", "synthetic"):
            raise CalibrationError(f"{cal.source}: TableCosts needs tables (a measured or "
                                   f"synthetic calibration), not {cal.kind!r}")
        self.calibration = cal
        self.label = cal.label
        self.prefill = Grid2D(cal, "prefill", "chunk", "context")
        self.decode = Grid2D(cal, "decode", "batch", "context")
        stat = cal.get("decode.context_stat")
        if stat not in ("mean", "max"):
            raise CalibrationError(f"{cal.source}: decode.context_stat must be 'mean' (paged "
                                   f"attention) or 'max' (padded to the longest), got {stat!r}")
        self.padded = stat == "max"
        self.sampling = Curve(cal, "sampling")
        self.export = Curve(cal, "kv_export")
        self.import_ = Curve(cal, "kv_import")
        self.overheads = {r: Curve(cal, f"overheads.{r}_step") for r in ROLES}
        self.join_s = cal.number("overheads.decode_join_s")
        self._base: dict[int, float] = {}  # T1(C, 0), asked for every chunk

    def _t0(self, c: int) -> float:
        t = self._base.get(c)
        if t is None:
            t = self._base[c] = self.prefill(c, 0)
        return t

    def prefill_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        total = self._t0(sum(c for c, _ in chunks))
        for c, p in chunks:
            if p:  # attention over earlier context (noise can make it look negative)
                total += max(0.0, self.prefill(c, p) - self._t0(c))
        return total

    def decode_run_s(self, batch: int, context: int, longest: int,
                     steps: int) -> np.ndarray:
        if self.padded:  # the attention pads every sequence to the longest one
            return self.decode.along_y(batch, longest + np.arange(steps, dtype=float))
        mean = (context + batch * np.arange(steps, dtype=float)) / batch
        return self.decode.along_y(batch, mean)

    def sample_s(self, rows: int) -> float:
        return self.sampling(rows)

    def kv_export_s(self, tokens: int) -> float:
        return self.export(tokens)

    def kv_import_s(self, tokens: int) -> float:
        return self.import_(tokens)

    def step_overhead_s(self, role: str, items: int) -> float:
        return self.overheads[role](items)

    def leg_join_s(self) -> float:
        return self.join_s

    def link(self, name: str) -> LinkCost:
        links = self.calibration.get("links")
        if name not in links:
            raise CalibrationError(f"{self.calibration.source}: missing entry 'links.{name}' "
                                   f"(it has {sorted(links)})")
        return LinkCost(name, self.calibration.number(f"links.{name}.latency_s"),
                        self.calibration.number(f"links.{name}.bytes_per_s", minimum=1.0))

    def check_covers(self, limits: Limits) -> None:
        ml = limits.max_model_len
        self.prefill(limits.max_batch_tokens, 0)
        self.prefill(1, ml - 1)
        self.decode(limits.max_decode_seqs, ml)
        self.decode(1, 1)
        self.sampling(limits.max_prefill_seqs)
        self.sampling(limits.max_decode_seqs)
        self.export(ml)
        self.import_(ml)
        self.overheads["prefill"](limits.max_prefill_seqs)
        self.overheads["decode"](limits.max_decode_seqs)
        self.link(limits.link)
        _ = self.rpc_s, self.client_s, self.idle_wait_s, self.delivery

