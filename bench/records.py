"""What a client saw of one request: :class:`RequestRecord`, built by the bench client
(bench/client.py, over gRPC or HTTP) and the in-process router driver
(bench/router_driver.py), aggregated by :func:`bench.metrics.compute_metrics`.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from cluster.ttft_phases import TTFT_PHASES, ttft_phases

PHASES: tuple[str, ...] = ("queue", "prefill", "transfer", "decode")  # server-side, in order
# TTFT_PHASES: the TTFT's phases, in order (RequestRecord.ttft_phases), re-exported
__all__ = ["PHASES", "TTFT_PHASES", "RequestRecord", "phase_times"]


@dataclass(frozen=True)
class RequestRecord:
    """What the client saw of one request; times are ``time.monotonic()`` seconds.

    ``token_times`` holds one arrival time per output token (the first is the TTFT
    point); ``output_len`` overrides ``len(token_times)`` when tokens arrive in bursts.
    ``*_s`` phase times are optional server-side durations; ``latency_alone_s`` is the
    E2EL the request would see on an idle system (for slowdown).
    """

    request_id: str
    prompt_len: int
    send_time: float
    token_times: tuple[float, ...] = ()
    output_len: int | None = None
    end_time: float | None = None
    tenant: str = "default"
    kind: str = "default"
    success: bool = True
    finish_reason: str = ""
    error: str = ""
    queue_s: float | None = None
    prefill_s: float | None = None
    transfer_s: float | None = None
    decode_s: float | None = None
    admission_s: float | None = None  # router clock: arrival -> the first token's leg sent
    router_ttft_s: float | None = None  # router clock: arrival -> first token
    latency_alone_s: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_times", t := tuple(self.token_times))
        last = t[-1] if t else self.send_time
        for name, ok in (
            ("request_id", bool(self.request_id)),
            ("prompt_len", self.prompt_len >= 0),
            ("token_times", not t or (t[0] >= self.send_time and min(self.itls, default=0) >= 0)),
            ("output_len", self.output_len is None or self.output_len >= len(t)),
            ("end_time", self.end_time is None or self.end_time >= last),
        ):
            if not ok:
                raise ValueError(f"RequestRecord.{name} is invalid: {getattr(self, name)!r}")

    @property
    def n_out(self) -> int:
        return len(self.token_times) if self.output_len is None else self.output_len

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.send_time if self.token_times else None

    @property
    def e2el(self) -> float | None:
        end = self.end_time if self.end_time is not None else (self.token_times or (None,))[-1]
        return None if end is None else end - self.send_time

    @property
    def tpot(self) -> float | None:
        ttft, e2el = self.ttft, self.e2el
        if self.n_out <= 1 or ttft is None or e2el is None:
            return None
        return (e2el - ttft) / (self.n_out - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in pairwise(self.token_times)]

    def ttft_phases(self) -> dict[str, float] | None:
        """The TTFT split into TTFT_PHASES, None without the server's phase times: the
        rule of cluster/ttft_phases.py (the router's histograms use it too). admission
        (router clock), prefill_queue and prefill_compute (the prefill worker's),
        control (the router's TTFT less those) and delivery (the client's TTFT less the
        router's); they add up to the client's TTFT by construction."""
        return ttft_phases(self.ttft, self.router_ttft_s, self.admission_s, self.queue_s,
                           self.prefill_s)


def phase_times(usage: Any) -> dict[str, float | None]:
    """``queue_s`` .. ``decode_s``, ``admission_s`` and the router's TTFT of a request's final
    usage (``cluster.router.types.Usage``), as RequestRecord keyword arguments; all None
    without one."""
    out = {f"{p}_s": getattr(usage, f"{p}_s", None) if usage else None for p in PHASES}
    out["admission_s"] = getattr(usage, "admission_s", None) if usage else None
    out["router_ttft_s"] = getattr(usage, "ttft_s", None) if usage else None
    return out
