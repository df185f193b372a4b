"""Seeded workload generation: arrivals, prompt/output lengths, tenants, token ids.

Arrivals follow ``vllm bench serve``: inter-arrival gaps are gamma distributed with
``shape = burstiness`` and ``scale = 1 / (rate * burstiness)`` (burstiness 1 is a Poisson
process; < 1 is burstier, > 1 more regular); ``rate = inf`` sends everything at t=0.
One ``seed`` fixes the whole workload; arrivals, lengths, tenants and token ids use
independent child streams so changing one knob does not reshuffle the others.

    spec = WorkloadSpec(num_requests=200, request_rate=4.0, mix="mixed", seed=1)
    for req in build_workload(spec): ...   # req.arrival_s, req.prompt_token_ids, ...
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

MIXES: tuple[str, ...] = ("chat", "long-doc", "mixed", "shared-prefix", "sharegpt")
Tokenizer = Callable[[str], "Sequence[int] | int"]


def _check(obj: object, **ok: bool) -> None:
    """Raise ``ValueError`` naming the first field whose check failed."""
    for name, passed in ok.items():
        if not passed:
            raise ValueError(f"{type(obj).__name__}.{name} is invalid: {getattr(obj, name)!r}")


@dataclass(frozen=True)
class LengthDist:
    """Token-length distribution: ``fixed`` (lo), ``uniform`` [lo, hi] or ``lognormal``.

    ``lognormal`` draws ``median * exp(sigma * N(0, 1))`` clipped to [lo, hi]
    (its arithmetic mean is ``median * exp(sigma**2 / 2)``).
    """

    kind: str = "fixed"
    lo: int = 1
    hi: int = 1
    median: float = 1.0
    sigma: float = 0.0

    def __post_init__(self) -> None:
        _check(self, kind=self.kind in ("fixed", "uniform", "lognormal"), lo=self.lo >= 1)
        _check(self, hi=self.hi >= self.lo, median=self.median > 0, sigma=self.sigma >= 0)

    @classmethod
    def fixed(cls, n: int) -> LengthDist:
        return cls("fixed", n, n)

    @classmethod
    def uniform(cls, lo: int, hi: int) -> LengthDist:
        return cls("uniform", lo, hi)

    @classmethod
    def lognormal(cls, median: float, sigma: float, lo: int = 1, hi: int = 1 << 20) -> LengthDist:
        return cls("lognormal", lo, hi, median, sigma)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` integer lengths, int64."""
        if self.kind == "fixed":
            return np.full(n, self.lo, dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(self.lo, self.hi + 1, size=n, dtype=np.int64)
        x = self.median * np.exp(self.sigma * rng.standard_normal(n))
        return np.clip(np.rint(x), self.lo, self.hi).astype(np.int64)


@dataclass(frozen=True)
class TenantSpec:
    """A tenant: ``share`` of the requests, fairness ``weight``, priority, TTFT deadline."""

    name: str
    share: float = 1.0
    weight: float = 1.0
    priority: int = 0
    ttft_deadline_ms: float | None = None

    def __post_init__(self) -> None:
        _check(self, name=bool(self.name), share=self.share > 0, weight=self.weight > 0)
        _check(self, ttft_deadline_ms=self.ttft_deadline_ms is None or self.ttft_deadline_ms > 0)


_CHAT = (LengthDist.uniform(64, 256), LengthDist.uniform(64, 256))
_LONG = (LengthDist.uniform(2048, 8192), LengthDist.uniform(16, 64))
_SUFFIX = (LengthDist.uniform(32, 128), LengthDist.uniform(32, 128))


@dataclass(frozen=True)
class WorkloadSpec:
    """Everything that defines a workload; equal specs give identical workloads.

    Length fields left ``None`` take the mix's defaults: chat 64..256 / 64..256;
    long-doc 2048..8192 / 16..64; mixed = chat plus ``long_fraction`` long documents;
    shared-prefix = ``num_prefix_groups`` groups, each prompt a group's ``prefix_len``
    ids + a distinct suffix (``prompt_len``, default 32..128); sharegpt = lengths of
    ``dataset_path`` conversations. Lengths are then multiplied by ``scale`` and
    clipped: prompt <= ``max_prompt_len`` and prompt + output <= ``max_model_len``.
    """

    num_requests: int = 100
    request_rate: float = math.inf
    burstiness: float = 1.0
    mix: str = "chat"
    seed: int = 0
    vocab_range: tuple[int, int] = (1, 1000)
    prompt_len: LengthDist | None = None
    output_len: LengthDist | None = None
    long_prompt_len: LengthDist | None = None
    long_output_len: LengthDist | None = None
    long_fraction: float = 0.1
    num_prefix_groups: int = 4
    prefix_len: int = 1024
    tenants: tuple[TenantSpec, ...] = field(default_factory=lambda: (TenantSpec("default"),))
    scale: float = 1.0
    max_prompt_len: int | None = None
    max_model_len: int | None = None
    dataset_path: str | None = None
    id_prefix: str = "req-"

    def __post_init__(self) -> None:
        names = [t.name for t in self.tenants]
        mpl, mml = self.max_prompt_len, self.max_model_len
        _check(self, num_requests=self.num_requests >= 1, request_rate=self.request_rate > 0)
        _check(self, burstiness=0 < self.burstiness < math.inf, mix=self.mix in MIXES)
        _check(self, vocab_range=0 <= self.vocab_range[0] < self.vocab_range[1])
        _check(self, long_fraction=0.0 <= self.long_fraction <= 1.0, scale=0 < self.scale < 1e9)
        _check(self, num_prefix_groups=self.num_prefix_groups >= 1, prefix_len=self.prefix_len >= 1)
        _check(self, tenants=len(names) >= 1 and len(set(names)) == len(names))
        _check(self, max_prompt_len=mpl is None or mpl >= 1, max_model_len=mml is None or mml >= 2)
        _check(self, dataset_path=self.mix != "sharegpt" or bool(self.dataset_path))


@dataclass(frozen=True)
class WorkloadRequest:
    """One request to send ``arrival_s`` seconds after the benchmark starts."""

    request_id: str
    arrival_s: float
    prompt_token_ids: list[int]
    max_tokens: int
    tenant: str = "default"
    priority: int = 0
    ttft_deadline_ms: float | None = None
    kind: str = "chat"
    prefix_group: int | None = None

    def __post_init__(self) -> None:
        _check(self, request_id=bool(self.request_id), arrival_s=self.arrival_s >= 0)
        _check(
            self, prompt_token_ids=len(self.prompt_token_ids) > 0, max_tokens=self.max_tokens >= 1
        )

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def arrival_times(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """``n`` arrival offsets (s), first at 0; gamma gaps with mean ``1/rate``."""
    if math.isinf(rate):
        return np.zeros(n)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def load_sharegpt(path: str | Path, tokenizer: Tokenizer | None = None) -> list[tuple[int, int]]:
    """(prompt_len, output_len) of each ShareGPT conversation's first human/gpt turn pair.

    Lengths come from ``tokenizer(text)`` (a sequence of ids or a count) or, without
    one, whitespace word counts. Pairs with either length < 4 are skipped (as vLLM).
    """
    count = _count_fn(tokenizer)
    pairs = []
    for conv in json.loads(Path(path).read_text(encoding="utf-8")):
        turns = conv.get("conversations") or conv.get("conversation") or []
        if len(turns) < 2 or turns[0].get("from") != "human":
            continue
        p, o = count(turns[0].get("value", "")), count(turns[1].get("value", ""))
        if p >= 4 and o >= 4:
            pairs.append((p, o))
    if not pairs:
        raise ValueError(f"dataset_path {path}: no usable conversations")
    return pairs


def _count_fn(tokenizer: Tokenizer | None) -> Callable[[str], int]:
    if tokenizer is None:
        return lambda text: len(text.split())
    return lambda text: out if isinstance(out := tokenizer(text), int) else len(out)


def _lengths(
    spec: WorkloadSpec, rng: np.random.Generator, tokenizer: Tokenizer | None
) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Kinds, prompt lengths and output lengths before scaling/clipping."""
    n = spec.num_requests
    if spec.mix == "sharegpt":
        pairs = load_sharegpt(spec.dataset_path or "", tokenizer)
        reps = -(-n // len(pairs))  # whole shuffled passes over the dataset, then cut
        idx = np.concatenate([rng.permutation(len(pairs)) for _ in range(reps)])[:n]
        arr = np.array(pairs, dtype=np.int64)[idx]
        return ["sharegpt"] * n, arr[:, 0], arr[:, 1]
    base = {"chat": _CHAT, "long-doc": _LONG, "mixed": _CHAT, "shared-prefix": _SUFFIX}
    p_dist = spec.prompt_len or base[spec.mix][0]
    o_dist = spec.output_len or base[spec.mix][1]
    kind = {"chat": "chat", "mixed": "chat", "long-doc": "long"}.get(spec.mix, spec.mix)
    kinds = [kind] * n
    prompt, output = p_dist.sample(rng, n), o_dist.sample(rng, n)
    if spec.mix == "mixed":
        is_long = rng.random(n) < spec.long_fraction
        lp = (spec.long_prompt_len or _LONG[0]).sample(rng, n)
        lo = (spec.long_output_len or _LONG[1]).sample(rng, n)
        prompt, output = np.where(is_long, lp, prompt), np.where(is_long, lo, output)
        kinds = ["long" if x else "chat" for x in is_long]
    return kinds, prompt, output


def _scaled(x: np.ndarray | int, scale: float) -> np.ndarray:
    return np.maximum(1, np.rint(np.asarray(x) * scale)).astype(np.int64)


def build_workload(
    spec: WorkloadSpec, *, tokenizer: Tokenizer | None = None
) -> list[WorkloadRequest]:
    """Generate ``spec.num_requests`` requests, sorted by arrival time."""
    n = spec.num_requests
    r_arr, r_len, r_ten, r_tok = (
        np.random.default_rng(s) for s in np.random.SeedSequence(spec.seed).spawn(4)
    )
    arrivals = arrival_times(n, spec.request_rate, spec.burstiness, r_arr)
    kinds, prompt, output = _lengths(spec, r_len, tokenizer)
    prompt, output = _scaled(prompt, spec.scale), _scaled(output, spec.scale)
    lo, hi = spec.vocab_range
    groups: np.ndarray | None = None
    prefixes: list[list[int]] = []
    if spec.mix == "shared-prefix":
        plen = int(_scaled(spec.prefix_len, spec.scale))
        prefixes = [
            r_tok.integers(lo, hi, size=plen).tolist() for _ in range(spec.num_prefix_groups)
        ]
        groups = r_len.integers(0, spec.num_prefix_groups, size=n)
        prompt = prompt + plen
    if spec.max_prompt_len is not None:
        prompt = np.minimum(prompt, spec.max_prompt_len)
    if spec.max_model_len is not None:
        prompt = np.minimum(prompt, spec.max_model_len - 1)
        output = np.minimum(output, spec.max_model_len - prompt)
    shares = np.array([t.share for t in spec.tenants], dtype=float)
    tenant_idx = r_ten.choice(len(spec.tenants), size=n, p=shares / shares.sum())
    width = len(str(n - 1))
    requests = []
    for i in range(n):
        t = spec.tenants[int(tenant_idx[i])]
        plen, group = int(prompt[i]), None
        if groups is not None:
            group = int(groups[i])
            pre = prefixes[group][:plen]
            ids = pre + r_tok.integers(lo, hi, size=plen - len(pre)).tolist()
        else:
            ids = r_tok.integers(lo, hi, size=plen).tolist()
        requests.append(
            WorkloadRequest(
                request_id=f"{spec.id_prefix}{i:0{width}d}",
                arrival_s=float(arrivals[i]),
                prompt_token_ids=ids,
                max_tokens=int(output[i]),
                tenant=t.name,
                priority=t.priority,
                ttft_deadline_ms=t.ttft_deadline_ms,
                kind=kinds[i],
                prefix_group=group,
            )
        )
    return requests


def summarize_workload(requests: Sequence[WorkloadRequest]) -> dict:
    """Counts and length statistics, for logs and result files."""
    if not requests:
        return {"num_requests": 0}

    def stats(x: list[int]) -> dict:
        return {"mean": float(np.mean(x)), "min": int(min(x)), "max": int(max(x))}

    return {
        "num_requests": len(requests),
        "span_s": max(r.arrival_s for r in requests),
        "prompt_len": stats([r.prompt_len for r in requests]),
        "max_tokens": stats([r.max_tokens for r in requests]),
        "kinds": dict(Counter(r.kind for r in requests)),
        "tenants": dict(Counter(r.tenant for r in requests)),
    }


def describe_workload(spec: WorkloadSpec, summary: Mapping[str, Any]) -> str:
    """One line for the console: "N requests, mix M, rate R/s, prompt mean P, output mean O"."""
    if not summary.get("num_requests"):
        return "0 requests"
    return (f"{summary['num_requests']} requests, mix {spec.mix}, rate {spec.request_rate:g}/s, "
            f"prompt mean {summary['prompt_len']['mean']:.0f}, output mean "
            f"{summary['max_tokens']['mean']:.0f}")
