"""What a client saw of one request: :class:`RequestRecord`, built by the bench client
(bench/client.py, over gRPC or HTTP) and the in-process router driver
(bench/router_driver.py), aggregated by :func:`bench.metrics.compute_metrics`.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import Any

PHASES: tuple[str, ...] = ("queue", "prefill", "transfer", "decode")  # server-side, in order
# the TTFT's phases, in order (RequestRecord.ttft_phases): each on the clock that saw it
TTFT_PHASES: tuple[str, ...] = ("admission", "prefill_queue", "prefill_compute", "control",
                                "delivery")


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
        """The TTFT split into TTFT_PHASES, None without the server's phase times.

        admission (router clock: the admission queue and the decode reservation),
        prefill_queue and prefill_compute (the prefill worker's clock: waiting for its
        first chunk, then the chunks up to the first token), control (the router's TTFT
        less those: the add's trip to the worker and the first token's trip back, loops
        included) and delivery (the client's TTFT less the router's: the front door and
        the network both ways). pdserve streams the first token from the prefill worker,
        so the KV transfer and decode admission fall on the second token (`transfer_s`).
        The phases add up to the client's TTFT by construction."""
        ttft = self.ttft
        parts = (self.admission_s, self.queue_s, self.prefill_s, self.router_ttft_s)
        if ttft is None or any(v is None for v in parts) or not self.router_ttft_s:
            return None
        adm, queue, prefill, router = parts  # type: ignore[misc]
        return {"admission": adm, "prefill_queue": queue, "prefill_compute": prefill,
                "control": router - adm - queue - prefill, "delivery": ttft - router}


def phase_times(usage: Any) -> dict[str, float | None]:
    """``queue_s`` .. ``decode_s``, ``admission_s`` and the router's TTFT of a request's final
    usage (``cluster.router.types.Usage``), as RequestRecord keyword arguments; all None
    without one."""
    out = {f"{p}_s": getattr(usage, f"{p}_s", None) if usage else None for p in PHASES}
    out["admission_s"] = getattr(usage, "admission_s", None) if usage else None
    out["router_ttft_s"] = getattr(usage, "ttft_s", None) if usage else None
    return out
