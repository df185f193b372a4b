"""SimOptions: the simulator's knobs that are not ServeConfig keys (yet).

``placement`` picks a prefill placement policy by its registry name (None: what the
router does today for the configuration: prefix affinity when prefix caching is on);
``stats_refresh_s`` is how often the router's view of decode KV usage is refreshed
(None: as the service does -- every second while ``server.metrics_port`` serves
/metrics, otherwise never, so all decode workers look empty and are asked in order).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sim.adapters import BUCKET_NAMES, DECODE_ORDERS, PREFILL_PLACEMENTS

STEPPING = ("fast", "exact")


@dataclass(frozen=True)
class SimOptions:
    placement: str | None = None
    length_buckets: tuple[int, ...] = (256, 1024, 4096)
    decode_order: str = "least-kv-usage"
    interconnect: str | None = None  # link cost entry (default: transfer.connector)
    decode_stepping: str = "fast"
    stats_refresh_s: float | None = None
    trace: bool = False
    max_concurrency: int | None = None  # the client's cap on requests in flight (bench's)
    extra: dict = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.placement is not None and self.placement not in PREFILL_PLACEMENTS:
            raise ValueError(f"placement must be one of {sorted(PREFILL_PLACEMENTS)}, got "
                             f"{self.placement!r}")
        if self.decode_order not in DECODE_ORDERS:
            raise ValueError(f"decode_order must be one of {sorted(DECODE_ORDERS)}, got "
                             f"{self.decode_order!r}")
        if self.decode_stepping not in STEPPING:
            raise ValueError(f"decode_stepping must be one of {STEPPING}, got "
                             f"{self.decode_stepping!r}")
        if self.stats_refresh_s is not None and not self.stats_refresh_s > 0:
            raise ValueError(f"stats_refresh_s must be > 0, got {self.stats_refresh_s}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not 1 <= len(self.length_buckets) < len(BUCKET_NAMES):
            raise ValueError(f"length_buckets takes 1..{len(BUCKET_NAMES) - 1} thresholds")
