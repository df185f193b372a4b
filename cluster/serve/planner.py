"""The live planner (`pdserve serve --planner`): the P:D split that fits the traffic now.

Every `pools.planner_window_s` the planner takes the window's arrivals (prompt and output
lengths, times: what the router saw; requests from before it still waiting for their first
token count as arriving at its start), asks the simulator how each split of the same
workers would have served them (an advisor that sim/ registers, since cluster/ never
imports it: sim/plan.py `advise_splits`, run in a process of its own so the router's loop
and CPU are not its), and moves one worker between the pools (`Router.switch_role`) when
another split serves the window clearly better:

- its SLO goodput beats the current split's by more than `planner_margin` (relative),
- the same target won `planner_confirm` windows in a row (no flapping on one window),
- `planner_dwell_s` passed since the last switch, and the window held at least
  `planner_min_requests` arrivals (a cold start's trickle decides nothing).

Each decision is logged with its reason and the simulated figures of the current and
the target split, and counted (`pdserve:planner_decisions_total{action}`). `PlannerCore`
is the rule (synchronous, no I/O: windows and scores in, a decision out); `Planner`
drives it on the router's loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from typing import Any

log = logging.getLogger(__name__)
ACTIONS = ("hold", "to_prefill", "to_decode", "failed")


@dataclass(frozen=True)
class PlannerConfig:
    window_s: float = 30.0
    dwell_s: float = 60.0
    margin: float = 0.1
    confirm: int = 2
    min_requests: int = 20
    slos_ms: tuple[tuple[str, float], ...] = (("ttft", 500.0), ("tpot", 50.0))

    def __post_init__(self) -> None:
        if self.window_s <= 0 or self.dwell_s < 0 or self.margin < 0 or self.confirm < 1 \
                or self.min_requests < 1:
            raise ValueError(f"bad planner settings: {self}")


@dataclass(frozen=True)
class Arrival:
    t: float  # time.monotonic() at the router
    prompt_len: int
    max_tokens: int
    tenant: str = "default"


@dataclass(frozen=True)
class Window:
    """What the advisor simulates: the arrivals (offsets from the window's start) on
    `prefill + decode` workers."""

    arrivals: tuple[tuple[float, int, int, str], ...]  # (offset s, prompt, output, tenant)
    duration_s: float
    prefill: int
    decode: int
    slos_ms: tuple[tuple[str, float], ...] = (("ttft", 500.0), ("tpot", 50.0))

    @property
    def workers(self) -> int:
        return self.prefill + self.decode


@dataclass(frozen=True)
class SplitScore:
    prefill: int
    decode: int
    goodput_rps: float
    ttft_p99_ms: float
    itl_p99_ms: float

    @property
    def split(self) -> str:
        return f"{self.prefill}P{self.decode}D"


@dataclass(frozen=True)
class Decision:
    action: str  # one of ACTIONS but "failed"
    reason: str
    current: SplitScore | None = None
    target: SplitScore | None = None


# (window, serve config as a dict) -> a score per split; set by sim/plan.py's import
Advisor = Callable[[Window, dict], Sequence[SplitScore]]
_ADVISOR: Advisor | None = None


def register_advisor(advisor: Advisor) -> None:
    global _ADVISOR
    _ADVISOR = advisor


def advisor() -> Advisor:
    if _ADVISOR is None:
        raise RuntimeError("pools.planner needs the simulator (the sim package): it "
                           "registers the planner's advisor when `pdserve` starts")
    return _ADVISOR


def best_of(scores: Sequence[SplitScore]) -> SplitScore:
    """The highest goodput; ties: the lower TTFT p99, then fewer prefill workers."""
    return min(scores, key=lambda s: (-s.goodput_rps, s.ttft_p99_ms, s.prefill))


@dataclass
class PlannerCore:
    cfg: PlannerConfig
    last_switch: float = -float("inf")
    windows: int = 0
    _streak: tuple[tuple[int, int] | None, int] = (None, 0)

    def decide(self, window: Window, scores: Sequence[SplitScore], now: float) -> Decision:
        self.windows += 1
        cur = next((s for s in scores if (s.prefill, s.decode) == (window.prefill,
                                                                    window.decode)), None)
        if len(window.arrivals) < self.cfg.min_requests:
            self._streak = (None, 0)
            return Decision("hold", f"{len(window.arrivals)} arrivals in the window, fewer "
                            f"than {self.cfg.min_requests}", cur)
        if not scores or cur is None:
            return Decision("hold", "no simulated score for the current split", cur)
        best = best_of(scores)
        if (best.prefill, best.decode) == (cur.prefill, cur.decode) or \
                best.goodput_rps <= cur.goodput_rps * (1 + self.cfg.margin):
            self._streak = (None, 0)
            return Decision("hold", f"{cur.split} is within {self.cfg.margin:.0%} of the best "
                            f"({best.split})", cur, best)
        key = (best.prefill, best.decode)
        n = self._streak[1] + 1 if self._streak[0] == key else 1
        self._streak = (key, n)
        if n < self.cfg.confirm:
            return Decision("hold", f"{best.split} won {n} of the {self.cfg.confirm} windows "
                            "in a row a switch needs", cur, best)
        if now - self.last_switch < self.cfg.dwell_s:
            return Decision("hold", f"{now - self.last_switch:.0f}s since the last switch, "
                            f"the dwell is {self.cfg.dwell_s:g}s", cur, best)
        action = "to_prefill" if best.prefill > cur.prefill else "to_decode"
        return Decision(action, f"{best.split} serves the window at {best.goodput_rps:.2f} "
                        f"req/s within the SLOs against {cur.goodput_rps:.2f} for {cur.split}",
                        cur, best)

    def switched(self, now: float) -> None:
        self.last_switch = now
        self._streak = (None, 0)


@dataclass
class Planner:
    """Drives PlannerCore on the router's loop: `observe` each arrival (the router's
    `on_arrival`), `run` until cancelled."""

    router: Any
    cfg: PlannerConfig
    serve_config: dict
    advise: Advisor = field(default_factory=advisor)
    metrics: Any = None  # cluster.metrics.ServiceMetrics (its planner counter), or None
    core: PlannerCore = field(init=False)
    decisions: list[tuple[float, Decision, float | None]] = field(default_factory=list)
    _arrivals: deque = field(default_factory=deque)

    def __post_init__(self) -> None:
        self.core = PlannerCore(self.cfg)

    def observe(self, spec: Any) -> None:
        self._arrivals.append(Arrival(time.monotonic(), len(spec.prompt_token_ids),
                                      spec.sampling.max_tokens, spec.tenant))

    def window(self, now: float) -> Window:
        start = now - self.cfg.window_s
        while self._arrivals and self._arrivals[0].t < start:
            self._arrivals.popleft()
        r = self.router
        # what arrived before the window and still waits for its first token is the
        # window's backlog: it arrives at the window's start (a split that fell behind
        # is simulated behind)
        backlog = tuple((0.0, len(f.spec.prompt_token_ids), f.spec.sampling.max_tokens,
                         f.spec.tenant) for f in list(r.flights.values())
                        if f.arrival < start and f.first_token_at is None and not f.done)
        arr = backlog + tuple((a.t - start, a.prompt_len, a.max_tokens, a.tenant)
                              for a in self._arrivals)
        return Window(arr, self.cfg.window_s, len(r.prefill), len(r.decode), self.cfg.slos_ms)

    async def step(self, pool: ProcessPoolExecutor | None = None) -> Decision:
        """One window: simulate, decide, act."""
        now = time.monotonic()
        w = self.window(now)
        loop = asyncio.get_running_loop()
        scores: Sequence[SplitScore] = ()
        if len(w.arrivals) >= self.cfg.min_requests and not self.router.switching:
            scores = await loop.run_in_executor(pool, self.advise, w, self.serve_config)
        d = self.core.decide(w, scores, now)
        took = None
        if d.action != "hold":
            took = await self._move(d)
        self._record(d, took)
        return d

    async def _move(self, d: Decision) -> float | None:
        r = self.router
        role, src = ("prefill", r.decode) if d.action == "to_prefill" else ("decode", r.prefill)
        alive = [w for w in src if w.alive]
        if len(alive) < 2:
            return None
        w = min(alive, key=lambda w: (len(w.legs), w.worker_id))
        try:
            took = await r.switch_role(w.worker_id, role)
        except Exception as e:  # noqa: BLE001 - logged and counted; the planner goes on
            log.warning("planner: moving %s to %s failed: %s", w.worker_id, role, e)
            self._record(Decision("failed", str(e), d.current, d.target), None)
            return None
        self.core.switched(time.monotonic())
        log.info("planner: %s is a %s worker now (%.0f ms, drain included)", w.worker_id,
                 role, took * 1e3)
        return took

    def _record(self, d: Decision, took: float | None) -> None:
        self.decisions.append((time.monotonic(), d, took))
        count = getattr(self.metrics, "planner_decision", None)
        if count is not None:
            count(d.action)
        fig = "; ".join(f"{s.split}: {s.goodput_rps:.2f} req/s, TTFT p99 {s.ttft_p99_ms:.0f} "
                        f"ms, ITL p99 {s.itl_p99_ms:.1f} ms" for s in (d.current, d.target)
                        if s is not None)
        log.info("planner: %s: %s%s", d.action, d.reason, f" ({fig})" if fig else "")

    async def run(self) -> None:
        # the simulator runs in a process of its own (spawned: this one holds Ray's and
        # grpc's threads), so its CPU is not the router loop's
        pool = ProcessPoolExecutor(1, mp_context=get_context("spawn"))
        try:
            while True:
                await asyncio.sleep(self.cfg.window_s)
                try:
                    await self.step(pool)
                except asyncio.CancelledError:
                    raise
                except Exception:  # noqa: BLE001 - one bad window stops nothing
                    log.exception("planner: a window failed")
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
