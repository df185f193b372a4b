"""The soak's workload: its config and the seeded request plan (bench/soak.py runs it).

Requests mix chat, long-document and shared-prefix prompts (mostly greedy) with Poisson
arrivals; a ``cancel_rate`` share is cancelled, the target phases taking turns so each
one is hit (mid-prefill targets go to long documents first, whose prefill lasts).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

PHASES = ("queued", "prefill", "transfer", "decode")
TERMINAL = ("finished", "CANCELLED", "UNAVAILABLE", "RESOURCE_EXHAUSTED")
KINDS = ("chat", "long", "shared")


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def build_plan(cfg: SoakConfig, vocab_size: int, max_model_len: int) -> list[SoakRequest]:
    """The seeded workload (same config + model limits -> the same requests)."""
    rng = random.Random(cfg.seed)
    ps, os_ = cfg.prompt_scale, cfg.output_scale

    def n(lo: int, hi: int, scale: float) -> int:
        return max(1, round(rng.randint(lo, hi) * scale))

    def ids(k: int) -> list[int]:
        return [rng.randrange(1, vocab_size) for _ in range(k)]

    prefixes = [ids(max(1, round(256 * ps))) for _ in range(4)]
    kinds = rng.choices(KINDS, weights=cfg.mix, k=cfg.requests)
    phase_of = _cancel_phases(rng, kinds, round(cfg.cancel_rate * cfg.requests))
    plan, t = [], 0.0
    for i, kind in enumerate(kinds):
        if kind == "chat":
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
    return plan


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
