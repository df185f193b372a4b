"""TransferConfig: every knob of a connector, validated once, never mutated."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NoReturn

from kv_transfer.pacing import SEND_POLICIES
from kv_transfer.registry import CONNECTORS
from kv_transfer.send_queue import SEND_QUEUES
from kv_transfer.wire import (
    CHECKSUM_ALGOS,
    CHECKSUM_FUNCS,
    MAX_HEADER_BYTES,
    PREAMBLE,
    resolve_checksum,
)


class FrozenWeights(dict):
    """A read-only dict (unlike MappingProxyType it pickles, for Ray and multiprocessing)."""

    def _readonly(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError("TransferConfig.tenant_weights is read-only; use dataclasses.replace")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _readonly  # type: ignore[assignment]

    def __reduce__(self) -> tuple[type, tuple[dict[str, float]]]:
        return (FrozenWeights, (dict(self),))


@dataclass(frozen=True)
class TransferConfig:
    """Connector configuration shared by both sides of a link.

    Credits and pacing count payload bytes. ``secret`` authenticates TCP links; it is
    excluded from ``repr`` so it never ends up in logs.
    """

    connector: str = "inproc"  # kv_transfer.registry.CONNECTORS
    send_policy: str = "eager"  # kv_transfer.pacing.SEND_POLICIES
    rate_bytes_per_s: float = 0.0  # per link, "paced" only
    # the emulated link beneath every policy (kv_transfer/emulated_link.py; studies):
    # 0 = the transport's own rate / latency
    link_rate_bytes_per_s: float = 0.0
    link_latency_s: float = 0.0
    burst_bytes: int = 4 << 20  # token-bucket depth, "paced" only
    credit_window_bytes: int = 256 << 20  # max unreleased payload bytes per link
    send_queue: str = "fcfs"  # kv_transfer.send_queue.SEND_QUEUES
    tenant_weights: Mapping[str, float] = field(default_factory=dict, hash=False)
    default_tenant_weight: float = 1.0
    max_frame_bytes: int = 64 << 20  # bigger chunks are split (by layer, then token)
    coalesce_bytes: int = 1 << 20  # small frames are batched into one write up to this
    failure_timeout_s: float = 10.0  # dead/hung peer -> requests failed within this
    # a TCP peer must finish the HMAC handshake within this (in total, not per read), and
    # at most this many unauthenticated connections are served at once (others wait)
    handshake_timeout_s: float = 5.0
    max_pending_connections: int = 16
    bind_host: str = "127.0.0.1"  # the tcp listener's interface
    tcp_port: int = 0  # 0 = ephemeral
    secret: bytes = field(default=b"", repr=False)
    # "auto": xxh3_64 if the xxhash package is installed (several GB/s), else zlib crc32
    checksum: str = "auto"
    require_expect: bool = False  # discard unannounced requests (never in the service: its
    # KV may overtake the reserve, decode_worker/early_kv.py holds it)
    socket_buffer_bytes: int = 4 << 20
    # nixl connector: "none" lets UCX use its shared-memory transports, which cannot
    # report a dead peer (pdserve's heartbeats and per-write leases do); "peer" keeps UCX
    # to transports that can (tcp, rdma). docs/design-nixl.md
    nixl_ucx_error_handling: str = "none"
    # the producer (prefill_worker/engine.py): a prompt's final chunk is handed over as its
    # step launches and leaves in ``layerwise_groups`` groups of layers, each once computed
    # (KVChunk.layers_ready; docs/design.md §4); off: after the step, whole
    layerwise: bool = False
    layerwise_groups: int = 8

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"TransferConfig.{name} {why}")

        for name, registry in (("connector", CONNECTORS), ("send_policy", SEND_POLICIES),
                               ("send_queue", SEND_QUEUES)):
            if getattr(self, name) not in registry:
                raise bad(name, f"must be a registered name ({registry.unknown(getattr(self, name))})")
        if SEND_POLICIES.get(self.send_policy).needs_rate and not (
            math.isfinite(self.rate_bytes_per_s) and self.rate_bytes_per_s > 0
        ):
            raise bad("rate_bytes_per_s", f"must be > 0 for send_policy={self.send_policy!r}, "
                      f"got {self.rate_bytes_per_s}")
        if not (math.isfinite(self.link_rate_bytes_per_s) and self.link_rate_bytes_per_s >= 0):
            raise bad("link_rate_bytes_per_s", f"must be >= 0, got {self.link_rate_bytes_per_s}")
        if not (math.isfinite(self.link_latency_s) and self.link_latency_s >= 0):
            raise bad("link_latency_s", f"must be >= 0, got {self.link_latency_s}")
        if self.rate_bytes_per_s < 0:
            raise bad("rate_bytes_per_s", f"must be >= 0, got {self.rate_bytes_per_s}")
        if self.burst_bytes <= 0:
            raise bad("burst_bytes", f"must be > 0, got {self.burst_bytes}")
        if self.max_frame_bytes < (64 << 10):
            raise bad("max_frame_bytes", f"must be >= 64 KiB, got {self.max_frame_bytes}")
        if self.credit_window_bytes < self.max_frame_bytes:
            raise bad(
                "credit_window_bytes",
                f"must be >= max_frame_bytes ({self.max_frame_bytes}), got {self.credit_window_bytes}",
            )
        if self.coalesce_bytes < 0:
            raise bad("coalesce_bytes", f"must be >= 0, got {self.coalesce_bytes}")
        if not (math.isfinite(self.failure_timeout_s) and self.failure_timeout_s > 0):
            raise bad("failure_timeout_s", f"must be > 0, got {self.failure_timeout_s}")
        if not (math.isfinite(self.handshake_timeout_s) and self.handshake_timeout_s > 0):
            raise bad("handshake_timeout_s", f"must be > 0, got {self.handshake_timeout_s}")
        if self.max_pending_connections < 1:
            raise bad("max_pending_connections", f"must be >= 1, got {self.max_pending_connections}")
        if not 0 <= self.tcp_port <= 65535:
            raise bad("tcp_port", f"must be in [0, 65535], got {self.tcp_port}")
        if not self.bind_host:
            raise bad("bind_host", "must be non-empty")
        if not isinstance(self.secret, bytes):
            raise bad("secret", "must be bytes")
        if CONNECTORS.get(self.connector).requires_secret and len(self.secret) < 16:
            raise bad("secret", f"must be at least 16 bytes for connector={self.connector!r}")
        if self.checksum != "auto" and self.checksum not in CHECKSUM_ALGOS:
            raise bad("checksum", f"must be 'auto' or one of {CHECKSUM_ALGOS}, got {self.checksum!r}")
        if resolve_checksum(self.checksum) not in CHECKSUM_FUNCS:
            raise bad("checksum", f"{self.checksum!r} needs the xxhash package")
        if self.nixl_ucx_error_handling not in ("none", "peer"):
            raise bad("nixl_ucx_error_handling",
                      f"must be 'none' or 'peer', got {self.nixl_ucx_error_handling!r}")
        if not isinstance(self.layerwise, bool):
            raise bad("layerwise", f"must be a bool, got {self.layerwise!r}")
        if isinstance(self.layerwise_groups, bool) or not (
                isinstance(self.layerwise_groups, int) and self.layerwise_groups >= 1):
            raise bad("layerwise_groups", f"must be an int >= 1, got {self.layerwise_groups!r}")
        if self.socket_buffer_bytes < 0:
            raise bad("socket_buffer_bytes", f"must be >= 0, got {self.socket_buffer_bytes}")
        if not (math.isfinite(self.default_tenant_weight) and self.default_tenant_weight > 0):
            raise bad("default_tenant_weight", f"must be > 0, got {self.default_tenant_weight}")
        weights = dict(self.tenant_weights)
        for tenant, w in weights.items():
            if not isinstance(tenant, str) or not (
                isinstance(w, int | float) and math.isfinite(w) and w > 0
            ):
                raise bad("tenant_weights", f"needs str -> positive weight, got {tenant!r}: {w!r}")
        # freeze the mapping so the config stays immutable after creation
        object.__setattr__(self, "tenant_weights", FrozenWeights(weights))

    def share_of(self, share: float) -> TransferConfig:
        """This config with ``share`` (0 < share <= 1) of its per-link budget: pacing
        rate, emulated link rate, burst and credit window (frames shrink with the window
        when needed, never below 64 KiB), for one of the rank links that together carry
        a TP worker pair's KV (``kv_transfer.heads.HeadTransfer.share``)."""
        if not (isinstance(share, int | float) and 0 < share <= 1):
            raise ValueError(f"a link's share of the transfer budget must be in (0, 1], got {share!r}")
        if share == 1:
            return self
        window = int(self.credit_window_bytes * share)
        frame = max(64 << 10, min(self.max_frame_bytes, window))
        return replace(
            self, rate_bytes_per_s=self.rate_bytes_per_s * share,
            link_rate_bytes_per_s=self.link_rate_bytes_per_s * share,
            burst_bytes=max(1, int(self.burst_bytes * share)),
            max_frame_bytes=frame, credit_window_bytes=max(frame, window))

    @property
    def checksum_algo(self) -> str:
        """The checksum this process writes into frame headers (``auto`` resolved)."""
        return resolve_checksum(self.checksum)

    def tenant_weight(self, tenant: str) -> float:
        return float(self.tenant_weights.get(tenant, self.default_tenant_weight))

    @property
    def link_emulated(self) -> bool:
        return self.link_rate_bytes_per_s > 0 or self.link_latency_s > 0

    @property
    def max_payload_bytes(self) -> int:
        """Largest payload of one frame: the frame limit minus header room."""
        return self.max_frame_bytes - MAX_HEADER_BYTES - PREAMBLE.size
