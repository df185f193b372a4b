"""Typed worker stats: what a worker actor's `stats()` answers the router.

Every numeric field is also a figure of the API's `WorkerStats.extra` under its own name
(`figures()`), which is what metrics, soak reports and studies read.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields


@dataclass(frozen=True)
class EngineStats:
    """Load of any worker engine (the colocated one reports just this)."""

    role: str  # "prefill" | "decode" | "colocated"
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    num_steps: int = 0
    mean_step_s: float = 0.0
    loop_error: str = ""  # the last failed step of the worker loop ("" if none)
    send_queue_depth: int = 0  # legs with KV still queued or in flight (prefill)
    faults: Mapping[str, int] = field(default_factory=dict)  # fault_<kind> -> fired (tests)
    tensor_parallel_size: int = 1  # ranks (actors) of this worker
    # the garbage collector in the worker's process since it started (runtime/gc_pauses.py)
    gc_collections: int = 0
    gc_full_collections: int = 0
    gc_pause_s: float = 0.0
    gc_max_pause_s: float = 0.0
    # an emulated accelerator (engine/emulate/device.py): its label ("" on a real device),
    # device seconds and wall seconds since it started, and the host's lag behind it
    emulated: str = ""
    device_busy_s: float = 0.0
    device_wall_s: float = 0.0
    host_lag_s: float = 0.0  # summed over the steps that continued the one before
    host_lag_steps: int = 0
    host_lag_p50_s: float = 0.0  # of the latest steps (engine/emulate/device.py LAG_WINDOW)
    host_lag_p99_s: float = 0.0
    process_cpu_s: float = 0.0  # the worker process's CPU seconds (every thread) so far

    @property
    def device_busy_ratio(self) -> float:
        """Device time over wall time since the emulated device started (0 on a real one)."""
        return self.device_busy_s / self.device_wall_s if self.device_wall_s else 0.0

    @property
    def queue_depth(self) -> int:
        """Requests this worker holds that are not running yet."""
        return self.num_waiting

    def figures(self) -> dict[str, float]:
        """Every numeric figure by name (bools and the role excluded), fault counters too."""
        out = {f.name: float(getattr(self, f.name)) for f in fields(self)
               if isinstance(getattr(self, f.name), int | float)
               and not isinstance(getattr(self, f.name), bool)}
        out.update({k: float(v) for k, v in self.faults.items()})
        if self.device_wall_s:  # an emulated device
            out["device_busy_ratio"] = self.device_busy_ratio
        return out


DEVICE_FIELDS = ("device_busy_s", "device_wall_s", "host_lag_s", "host_lag_steps",
                 "host_lag_p50_s", "host_lag_p99_s")
COUNTED_CPU = "process_cpu_s"


def device_stats(runner: object) -> dict:
    """The emulated device's fields of a worker's stats ({} for a real device)."""
    if not getattr(runner, "samples_itself", False):
        return {}
    s = runner.stats()  # type: ignore[attr-defined]
    return {"emulated": runner.label, COUNTED_CPU: time.process_time(), **{k: type(getattr(EngineStats, k))(s[k])  # type: ignore[attr-defined]
                                         for k in DEVICE_FIELDS}}


@dataclass(frozen=True)
class PrefillStats(EngineStats):
    jobs: int = 0  # legs held here: queued, prefilling or sending KV
    outstanding_prefill_tokens: int = 0
    chunk_cap: int = 0  # the chunk policy's current cap
    chunk_sizes: Mapping[int, int] = field(default_factory=dict)  # size -> chunks run
    kv_bytes_sent: float = 0.0
    kv_frames_sent: float = 0.0
    kv_send_queue_s: float = 0.0
    kv_transfer_s: float = 0.0
    kv_inflight_bytes: float = 0.0
    kv_queued_bytes: float = 0.0
    kv_send_failures: float = 0.0

    @property
    def queue_depth(self) -> int:
        return self.jobs


@dataclass(frozen=True)
class DecodeStats(EngineStats):
    kv_blocks_promisable: int = 0  # free blocks not owed to any reservation
    kv_cache_usage_perc: float = 0.0
    kv_checksum_failures: int = 0
    kv_duplicate_frames: int = 0
    kv_rx_active_requests: int = 0
    kv_early_held_chunks: int = 0  # chunks held for legs whose reserve has not come yet
    kv_early_held_bytes: int = 0
    kv_early_dropped_chunks: int = 0  # held chunks dropped (refused/aborted/expired/...)
    kv_reserves_refused: int = 0
