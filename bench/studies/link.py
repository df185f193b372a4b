"""Link emulation: make the KV link as slow, relative to compute, as on a GPU cluster.

On a CPU box the loopback "link" is hundreds of times faster than prefill compute; on
an H200 + InfiniBand cluster moving a prompt's KV takes a sizeable fraction of its
prefill time. A study therefore caps every link with the pacer (``transfer.link_gbps``)
at the rate that gives a chosen **transfer/compute ratio** R for a reference prompt:

    kv_bytes   = prompt_tokens * kv_bytes_per_token            (all layers, K and V)
    transfer_s = kv_bytes * 8 / (link_gbps * 1e9)
    R          = transfer_s / prefill_s   =>   link_gbps = kv_bytes * 8 / (R * prefill_s) / 1e9

R = 0.15 is H200 + 400 Gb/s InfiniBand-like. The pacer is a token bucket whose burst
lets a frame leave once its bytes are earned; its default 4 MiB burst would let a tiny
model's whole prompt through unpaced, so emulation also sets the burst to one KV block.
The trace records when each frame was *written* (instantly on loopback); to analyse an
emulated link, :func:`emulate_link_spans` stretches every ``kv_send`` span to the time
its bytes occupy the emulated link.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from engine.quantiles import median
from engine.tracing import TraceEvent

DEFAULT_RATIO = 0.15  # H200 + InfiniBand-like transfer/compute ratio
REFERENCE_PROMPT_TOKENS = 512
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def transfer_seconds(nbytes: float, link_gbps: float) -> float:
    """Seconds ``nbytes`` occupy a link of ``link_gbps`` Gbit/s."""
    if not link_gbps > 0:
        raise ValueError(f"link_gbps must be > 0, got {link_gbps}")
    return nbytes * 8 / (link_gbps * 1e9)


def link_gbps_for_ratio(kv_bytes: float, prefill_s: float, ratio: float) -> float:
    """The link rate (Gbit/s) at which moving ``kv_bytes`` takes ``ratio * prefill_s``."""
    if not (kv_bytes > 0 and prefill_s > 0 and ratio > 0):
        raise ValueError(f"need kv_bytes, prefill_s, ratio > 0; got {kv_bytes}, {prefill_s}, {ratio}")
    return kv_bytes * 8 / (ratio * prefill_s) / 1e9


def ratio_for_link(kv_bytes: float, prefill_s: float, link_gbps: float) -> float:
    """Transfer/compute ratio of a prompt whose KV is ``kv_bytes`` on a ``link_gbps`` link."""
    if not prefill_s > 0:
        raise ValueError(f"prefill_s must be > 0, got {prefill_s}")
    return transfer_seconds(kv_bytes, link_gbps) / prefill_s


def burst_mb(kv_bytes_per_token: int, block_size: int) -> float:
    """Token-bucket depth of one KV block, in MiB (so pacing bites on small models)."""
    return kv_bytes_per_token * block_size / float(1 << 20)


@dataclass(frozen=True)
class Reference:
    """Measured compute of the model: one reference prefill and one decode step."""

    prompt_tokens: int
    prefill_s: float
    decode_step_s: float
    kv_bytes_per_token: int  # in the serving dtype

    @property
    def kv_bytes(self) -> int:
        return self.prompt_tokens * self.kv_bytes_per_token

    def prefill_estimate_s(self, prompt_tokens: int) -> float:
        """Linear estimate of an idle prefill (for latency-alone / slowdown only)."""
        return self.prefill_s * prompt_tokens / self.prompt_tokens


@dataclass(frozen=True)
class LinkEmulation:
    """The emulated link every study configuration runs at (recorded in each result)."""

    link_gbps: float
    transfer_compute_ratio: float  # of the reference prompt at link_gbps
    source: str  # "ratio" (from --transfer-compute-ratio) | "link-gbps" (given)
    reference: Reference
    burst_mb: float

    @classmethod
    def from_ratio(cls, ref: Reference, ratio: float, block_size: int) -> LinkEmulation:
        gbps = link_gbps_for_ratio(ref.kv_bytes, ref.prefill_s, ratio)
        return cls(gbps, ratio, "ratio", ref, burst_mb(ref.kv_bytes_per_token, block_size))

    @classmethod
    def from_gbps(cls, ref: Reference, link_gbps: float, block_size: int) -> LinkEmulation:
        ratio = ratio_for_link(ref.kv_bytes, ref.prefill_s, link_gbps)
        return cls(link_gbps, ratio, "link-gbps", ref, burst_mb(ref.kv_bytes_per_token, block_size))

    @property
    def reference_transfer_s(self) -> float:
        return transfer_seconds(self.reference.kv_bytes, self.link_gbps)

    def config_values(self) -> dict[str, float]:
        """ServeConfig overrides that cap every link at the emulated rate."""
        return {"transfer.link_gbps": self.link_gbps, "transfer.burst_mb": self.burst_mb}

    def to_dict(self) -> dict:
        out = asdict(self)
        out["reference_transfer_ms"] = self.reference_transfer_s * 1e3
        return out

    def describe(self) -> str:
        r = self.reference
        return (f"link {self.link_gbps * 1e3:.1f} Mbit/s: transfer/compute ratio "
                f"{self.transfer_compute_ratio:.3g} for a {r.prompt_tokens}-token prompt "
                f"(prefill {r.prefill_s * 1e3:.1f} ms, KV {r.kv_bytes / 1024:.0f} KiB, "
                f"transfer {self.reference_transfer_s * 1e3:.1f} ms)")


def measure_reference(model_dir: str | Path, *, prompt_tokens: int = REFERENCE_PROMPT_TOKENS,
                      dtype: str = "float32", threads: int = 1, repeats: int = 3) -> Reference:
    """Median prefill time of a ``prompt_tokens`` prompt and of one decode step, on an
    in-process engine with ``threads`` torch threads (what one worker is given)."""
    import torch

    from engine.llm import LLM
    from engine.request import SamplingParams

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        llm = LLM(str(model_dir), max_num_batched_tokens=prompt_tokens,
                  max_prefill_chunk=prompt_tokens, enable_prefix_caching=False, dtype=dtype,
                  kv_cache_memory_bytes=64 << 20, max_model_len=prompt_tokens + 64, device="cpu")
        vocab = llm.config.model.vocab_size
        decode_tokens = 16

        def prompt(i: int) -> list[int]:
            return [1 + (7 * k + 13 * i) % (vocab - 1) for k in range(prompt_tokens)]

        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        many = SamplingParams(temperature=0.0, max_tokens=1 + decode_tokens, ignore_eos=True)
        llm.generate([prompt(0)], one)  # warm-up: allocator, kernels
        pre, dec = [], []
        for i in range(1, repeats + 1):
            t0 = time.perf_counter()
            llm.generate([prompt(i)], one)
            t1 = time.perf_counter()
            llm.generate([prompt(i + repeats)], many)
            t2 = time.perf_counter()
            pre.append(t1 - t0)
            dec.append(max(1e-6, (t2 - t1) - (t1 - t0)) / decode_tokens)
        per_token = llm.config.model.kv_bytes_per_token * DTYPE_BYTES[dtype] // 4
        return Reference(prompt_tokens, median(pre), median(dec), per_token)
    finally:
        torch.set_num_threads(old)


def emulate_link_spans(events: Sequence[TraceEvent], link_gbps: float) -> list[TraceEvent]:
    """Events with each ``kv_send`` lasting at least its bytes' time on the emulated link.

    Frames on one link are serialised: a frame's emulated span starts when it was
    written or when the previous frame's span ends, whichever is later (the pacer let
    it go once its bytes were earned, so this only fixes rounding and bursts).
    """
    out: list[TraceEvent] = []
    busy_until: dict[str, float] = {}
    sends = sorted((e for e in events if e.phase == "kv_send" and e.bytes), key=lambda e: e.start)
    stretched = {}
    for e in sends:
        start = max(e.start, busy_until.get(e.worker, e.start))
        end = max(e.end, start + transfer_seconds(e.bytes or 0, link_gbps))
        busy_until[e.worker] = end
        stretched[id(e)] = replace(e, start=start, end=end)
    for e in events:
        out.append(stretched.get(id(e), e))
    return out
