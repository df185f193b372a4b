"""The `transfer` section of ServeConfig (cluster/config.py): how KV moves from prefill
to decode workers (connector, send policy and pacing, credit window, send queue, an
emulated link) and the bounds of the KV a decode worker holds for a leg whose reserve
has not come yet (early_kv_*). cluster/worker_specs.py turns it into TransferConfig and
the decode workers' EarlyKVConfig.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from cluster.config_fields import Section, opt
from kv_transfer.pacing import SEND_POLICIES
from kv_transfer.registry import CONNECTORS
from kv_transfer.send_queue import SEND_QUEUES


@dataclass(frozen=True)
class TransferSection(Section):
    NAME: ClassVar[str] = "transfer"
    connector: str = opt("tcp", "KV transfer connector", choices=CONNECTORS)
    send_policy: str = opt("eager", "when chunk KV leaves", choices=SEND_POLICIES)
    rate_gbps: float | None = opt(None, "pacing rate per link in Gbit/s (required by the "
                                  "pacing send policies, e.g. paced)", gt=0)
    burst_mb: float = opt(4.0, "pacing burst (token-bucket depth) in MiB", gt=0)
    credit_window_mb: float = opt(64.0, "unacknowledged KV bytes per link in MiB", gt=0)
    credit_window_chunks: float = opt(2.0, "credit window floor, in the KV bytes of one "
                                      "prefill chunk of the model (max_prefill_chunk tokens "
                                      "x its KV bytes per token); 0 = credit_window_mb alone",
                                      ge=0)
    send_queue: str = opt("fcfs", "order of queued KV sends", choices=SEND_QUEUES)
    link_gbps: float | None = opt(None, "emulated link rate in Gbit/s beneath every send "
                                  "policy (studies; kv_transfer/emulated_link.py)", gt=0)
    link_latency_us: float = opt(0.0, "emulated link one-way latency in microseconds "
                                 "(frames and acks)", ge=0)
    bind_host: str = opt("127.0.0.1", "interface the tcp connector listens on")
    failure_timeout_s: float = opt(10.0, "a silent peer fails its requests after this", gt=0)
    # KV that reaches a decode worker before the leg's reserve (pools.reserve_with_add) is
    # held there until the reserve comes (decode_worker/early_kv.py's EarlyKVConfig)
    early_kv_leg_mb: float = opt(64.0, "KV a decode worker holds for one leg whose reserve "
                                 "it has not seen yet, in MiB (beyond it the leg fails)", gt=0)
    early_kv_leg_chunks: int = opt(4096, "KV chunks held for one such leg", ge=1)
    early_kv_total_mb: float = opt(256.0, "KV held for all such legs of a decode worker "
                                   "together, in MiB", gt=0)
    early_kv_total_chunks: int = opt(16384, "KV chunks held for all such legs together", ge=1)
    early_kv_ttl_s: float = opt(30.0, "how long held KV waits for its leg's reserve before "
                                "it is dropped", gt=0)

    def _check(self) -> None:
        paced = SEND_POLICIES.get(self.send_policy).needs_rate
        if paced and self.rate_gbps is None:
            raise self._bad("rate_gbps", f"must be set when send_policy is {self.send_policy!r}")
        if not paced and self.rate_gbps is not None:
            raise self._bad("rate_gbps", f"paces a pacing send_policy only, not "
                            f"{self.send_policy!r} (link_gbps emulates the link beneath every policy)")
        for kind in ("mb", "chunks"):
            leg, total = f"early_kv_leg_{kind}", f"early_kv_total_{kind}"
            if getattr(self, leg) > getattr(self, total):
                raise self._bad(leg, f"must be <= transfer.{total} ({getattr(self, total)!r})")
