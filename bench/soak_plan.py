"""The soak's workload: its config and the seeded request plan (bench/soak.py runs it).

Requests mix chat, long-document and shared-prefix prompts (mostly greedy) with Poisson
arrivals; a ``cancel_rate`` share is cancelled, the target phases taking turns so each
one is hit (mid-prefill targets go to long documents first, whose prefill lasts).

``pressure`` sizes the requests against the KV pools (``pool_tokens``: 2-3 requests fit
on each side, outputs long enough to outgrow their decode promise, so running requests
preempt each other) and adds, from a second seeded stream (the plain plan is unchanged):
Abort RPCs aimed at every phase (``ABORT_PHASES``), client deadlines, clients reusing
the ids of requests that ended, and a drain that the last arrivals run into.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, replace
from typing import Any, Protocol

PHASES = ("queued", "prefill", "transfer", "decode")
# queued: waiting for a decode reservation (pool full); admission: between the front door
# and a reservation in place (an Abort sent right behind its Generate races the reserve)
ABORT_PHASES = ("queued", "admission", "prefill", "transfer", "decode")
TERMINAL = ("finished", "aborted", "CANCELLED", "DEADLINE_EXCEEDED", "UNAVAILABLE",
            "RESOURCE_EXHAUSTED")
KINDS = ("chat", "long", "shared")
DRAIN_BURST = 6  # requests that arrive together just before the drain starts


@dataclass(frozen=True)
class SoakConfig:
    addr: str = "127.0.0.1:50051"
    requests: int = 1000
    rate: float = 8.0  # requests per second (Poisson arrivals)
    cancel_rate: float = 0.3
    kill_every_s: float | None = None
    max_kills: int | None = None  # None: keep killing every kill_every_s until the end
    kill_roles: tuple[str, ...] = ("decode", "prefill")
    max_restarts: int = 2  # kills per actor (the service's pools.max_restarts)
    ray_address: str | None = "auto"
    actor_tag: str | None = None  # which service when a Ray cluster runs several
    model: str | None = None  # model dir (or "tiny") for the exact-token check
    # an emulated service (pdserve serve --emulate PROFILE --model-shape SHAPE): the
    # exact-token check against engine.LLM on the same emulated device
    emulate: str | None = None
    model_shape: str | None = None
    metrics_url: str | None = None
    deadline_s: float = 300.0
    quiesce_timeout_s: float = 120.0
    restart_timeout_s: float = 300.0
    seed: int = 0
    mix: tuple[float, float, float] = (0.6, 0.2, 0.2)  # chat, long, shared-prefix
    prompt_scale: float = 1.0
    output_scale: float = 1.0
    greedy_share: float = 0.9
    token: str | None = None
    tls_ca: str | None = None
    progress: bool = False  # a tqdm bar on stderr (the CLI turns it on)
    # --pressure: requests sized to the pools, aborts, deadlines, id reuse, a drain
    pressure: bool = False
    pool_tokens: int | None = None  # tokens of the smallest KV pool (None: from GetStats)
    block_size: int = 16  # to turn GetStats' block counts into tokens
    abort_rate: float = 0.0  # share aborted with the Abort RPC (ABORT_PHASES take turns)
    client_deadline_rate: float = 0.0  # share sent with a short client deadline
    reuse_rate: float = 0.0  # share that reuses the id of an earlier, ended request
    drain: bool = False  # drain the service near the end (needs a service the soak runs)
    drain_share: float = 0.1  # the last arrivals, which come after the drain started

    def __post_init__(self) -> None:
        if self.requests < 1 or self.rate <= 0 or not 0 <= self.cancel_rate <= 1:
            raise ValueError("requests >= 1, rate > 0 and cancel_rate in [0, 1]")
        if self.kill_every_s is not None and self.kill_every_s <= 0:
            raise ValueError("kill_every_s must be > 0")
        if len(self.mix) != 3 or min(self.mix) < 0 or sum(self.mix) <= 0:
            raise ValueError("mix is three non-negative weights (chat, long, shared)")
        if not set(self.kill_roles) <= {"prefill", "decode"} or not self.kill_roles:
            raise ValueError("kill_roles must be prefill and/or decode")
        if min(self.deadline_s, self.quiesce_timeout_s, self.prompt_scale,
               self.output_scale) <= 0:
            raise ValueError("deadline, quiesce timeout and scales must be > 0")
        shares = (self.abort_rate, self.client_deadline_rate, self.reuse_rate, self.drain_share)
        if min(shares) < 0 or self.cancel_rate + sum(shares[:3]) > 1 or self.drain_share >= 1:
            raise ValueError("cancel, abort, client-deadline and reuse rates are shares of "
                             "the requests (>= 0, together <= 1); drain_share in [0, 1)")
        if self.pool_tokens is not None and self.pool_tokens < 64:
            raise ValueError(f"pool_tokens must be >= 64, got {self.pool_tokens}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")


@dataclass(frozen=True)
class SoakRequest:
    request_id: str
    kind: str
    arrival_s: float
    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float
    ignore_eos: bool
    seed: int | None = None
    cancel_phase: str | None = None  # target phase, None = not cancelled
    cancel_after_s: float = 0.0  # queued / prefill: seconds after the call starts
    cancel_after_tokens: int = 0  # transfer (1) / decode (>= 2)
    cancel_frac: float = 0.5  # prefill, remote: this share of the kind's median TTFT
    key: str = ""  # unique in the plan (a reused id is not): records and checks use it
    abort_phase: str | None = None  # Abort RPC aimed at this phase (ABORT_PHASES)
    client_deadline_s: float | None = None  # the Generate call's own deadline
    reuses: str | None = None  # key of the earlier request whose id this one sends again
    after_drain: bool = False  # arrives after the drain started: UNAVAILABLE expected

    def __post_init__(self) -> None:
        if not self.key:
            object.__setattr__(self, "key", self.request_id)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def aimed_phase(self) -> str | None:
        """The phase a cancel or an abort of this request aims at."""
        return self.cancel_phase or self.abort_phase


def build_plan(cfg: SoakConfig, vocab_size: int, max_model_len: int) -> list[SoakRequest]:
    """The seeded workload (same config + model limits -> the same requests)."""
    rng = random.Random(cfg.seed)
    ps, os_ = cfg.prompt_scale, cfg.output_scale

    def n(lo: int, hi: int, scale: float) -> int:
        return max(1, round(rng.randint(lo, hi) * scale))

    def ids(k: int) -> list[int]:
        return [rng.randrange(1, vocab_size) for _ in range(k)]

    pool = cfg.pool_tokens if cfg.pressure else None
    if pool is not None:  # a shared prefix of whole blocks, so the prefix cache can hold it
        prefixes = [ids(max(cfg.block_size, pool // 6 // cfg.block_size * cfg.block_size))
                    for _ in range(3)]
    else:
        prefixes = [ids(max(1, round(256 * ps))) for _ in range(4)]
    kinds = rng.choices(KINDS, weights=cfg.mix, k=cfg.requests)
    phase_of = _cancel_phases(rng, kinds, round(cfg.cancel_rate * cfg.requests))
    plan, t = [], 0.0
    for i, kind in enumerate(kinds):
        if pool is not None:
            prompt, out = _pressure_sizes(rng, kind, pool, prefixes, ids)
        elif kind == "chat":
            prompt, out = ids(n(8, 96, ps)), n(4, 24, os_)
        elif kind == "long":
            prompt, out = ids(n(400, 1500, ps)), n(2, 8, os_)
        else:
            prompt, out = rng.choice(prefixes) + ids(n(8, 48, ps)), n(4, 16, os_)
        phase = phase_of.get(i)
        if phase in ("transfer", "decode"):
            out = max(out, 8)  # still running when the client acts on its first tokens
        prompt = prompt[: max(1, max_model_len - out - 1)]
        greedy = rng.random() < cfg.greedy_share
        plan.append(SoakRequest(
            request_id=f"soak-{cfg.seed}-{i:05d}", kind=kind, arrival_s=t,
            prompt=tuple(prompt), max_tokens=out, temperature=0.0 if greedy else 0.8,
            ignore_eos=rng.random() < 0.7, seed=None if greedy else rng.randrange(1 << 30),
            cancel_phase=phase,
            cancel_after_s=rng.uniform(0.0, 0.02) if phase == "queued" else
            rng.uniform(0.05, 0.6),
            cancel_after_tokens=1 if phase == "transfer" else rng.randint(2, out // 2)
            if phase == "decode" else 0,
            cancel_frac=rng.uniform(0.2, 0.9)))
        t += rng.expovariate(cfg.rate)
    return _with_pressure_events(cfg, plan) if cfg.pressure else plan


def queued_refusal(plan: list[SoakRequest]) -> dict[str, Any]:
    """A ``refuse_admission`` fault (kv_transfer/faults.py) for the requests whose cancel
    or abort aims at "queued": the decode workers answer "no room" to every reserve of
    their legs, so each one waits in the router's admission queue until the soak acts
    on it. A decode pool with room admits a request in one reserve round trip (under a
    millisecond over the control channel), faster than the phase probe polls, so without
    this a "queued" cancel lands there only when the pool happens to be full. Requests
    whose id a later one reuses are left out (the later one would never be admitted)."""
    reused = {r.request_id for r in plan if r.reuses is not None}
    ids = sorted({r.request_id for r in plan if r.aimed_phase == "queued"} - reused)
    if not ids:
        raise ValueError("the plan aims no cancel or abort at 'queued'")
    return {"kind": "refuse_admission",
            "request_filter": "^(?:" + "|".join(map(re.escape, ids)) + ")#"}


def _pressure_sizes(rng: random.Random, kind: str, pool: int, prefixes: list[list[int]],
                    ids) -> tuple[list[int], int]:
    """Prompt and output sized to a pool of ``pool`` tokens: each request promises a
    quarter to a half of a pool (2-3 fit on either side), and many outputs outgrow the
    decode promise (prompt + 64 tokens of headroom) by up to a third of the pool, so
    running requests run the pool dry and preempt each other. No request needs more
    than three quarters of a pool on its own."""
    if kind == "chat":
        return ids(rng.randint(pool // 10, pool // 4)), rng.randint(8, pool // 2)
    if kind == "long":
        return ids(rng.randint(pool // 3, pool // 2)), rng.randint(2, 12)
    return rng.choice(prefixes) + ids(rng.randint(8, pool // 8)), rng.randint(8, pool // 3)


def _cancel_phases(rng: random.Random, kinds: list[str], n: int) -> dict[int, str]:
    """Which requests are cancelled, and the phase each targets: the phases take turns;
    mid-prefill cancels go to long documents first (their prefill lasts longest)."""
    chosen = rng.sample(range(len(kinds)), n)
    phases = {i: PHASES[j % len(PHASES)] for j, i in enumerate(chosen)}
    longs = [i for i in chosen if kinds[i] == "long" and phases[i] != "prefill"]
    for i in [i for i in chosen if phases[i] == "prefill" and kinds[i] != "long"]:
        if not longs:
            break
        j = longs.pop()  # swap targets: this long document is cancelled mid-prefill
        phases[i], phases[j] = phases[j], "prefill"
    return phases


def _with_pressure_events(cfg: SoakConfig, plan: list[SoakRequest]) -> list[SoakRequest]:
    """Aborts, client deadlines, reused ids and the drain, from their own seeded stream."""
    rng = random.Random(cfg.seed * 7919 + 104729)
    n = len(plan)
    after_drain = set(range(n - round(cfg.drain_share * n), n)) if cfg.drain else set()
    free = [i for i in range(n) if i not in after_drain and plan[i].cancel_phase is None]
    rng.shuffle(free)
    take = lambda rate: [free.pop() for _ in range(min(len(free), round(rate * n)))]  # noqa: E731
    aborts, deadlines, reuses = take(cfg.abort_rate), take(cfg.client_deadline_rate), \
        take(cfg.reuse_rate)
    out = list(plan)
    for j, i in enumerate(sorted(aborts)):
        r, phase = out[i], ABORT_PHASES[j % len(ABORT_PHASES)]
        max_tokens = max(r.max_tokens, 8) if phase in ("transfer", "decode") else r.max_tokens
        out[i] = replace(
            r, abort_phase=phase, max_tokens=max_tokens,
            prompt=r.prompt[: max(1, len(r.prompt) - (max_tokens - r.max_tokens))],
            cancel_after_s={"admission": rng.uniform(0.0, 0.005),
                            "queued": rng.uniform(0.02, 0.3)}.get(phase, rng.uniform(0.05, 0.6)),
            cancel_after_tokens=1 if phase == "transfer" else rng.randint(2, max_tokens // 2)
            if phase == "decode" else 0)
    for k, i in enumerate(deadlines):  # half expire mid-request, half only if it stalls
        out[i] = replace(out[i], client_deadline_s=rng.uniform(0.005, 0.1) if k % 2 else
                         rng.uniform(0.3, 3.0))
    reused: set[int] = set()
    for j in sorted(reuses):
        # ids whose end the server reports (a client-side cancel or deadline ends the
        # stream here before the server has heard of it: ALREADY_EXISTS would be right)
        earlier = [i for i in range(j) if i not in reused and i not in reuses
                   and i not in after_drain and out[i].cancel_phase is None
                   and out[i].client_deadline_s is None]
        if earlier:
            i = rng.choice(earlier)
            reused.add(i)
            out[j] = replace(out[j], request_id=out[i].request_id, reuses=out[i].key)
    if after_drain:  # a burst right before the drain: it finds a full pool and a queue
        at = out[min(after_drain)].arrival_s
        for i in range(max(0, min(after_drain) - DRAIN_BURST), min(after_drain)):
            out[i] = replace(out[i], arrival_s=at - 0.05)
    return [replace(out[i], after_drain=True) if i in after_drain else out[i] for i in range(n)]


class SoakRun(Protocol):
    """What the reports read of a finished run (bench.soak.SoakRunner is one)."""

    cfg: SoakConfig
    records: dict[str, Any]  # request key -> bench.soak_report.RequestRecord
    hooks: Any  # bench.soak_probes.SoakHooks
    kills: list[Any]  # bench.soak_chaos.KillRecord
    phase_probe: Any
