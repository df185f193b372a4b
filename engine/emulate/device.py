"""The emulated device's timeline and its host accounting.

One queue, as a GPU stream: work submitted at ``now`` starts when the device is free
(``start = max(now, free_at)``), holds it for its cost and ends at ``free_at``; the host
waits for an end with ``time.sleep`` (the GIL is free: the worker's other threads, its
KV links and channel, run meanwhile). A step submitted late starts late. Beside it runs one copy engine (``copy``), as a GPU's
side-stream copies overlap its kernels: the copies of a layer-wise export (each layer
group's KV to the host while the step's later layers compute) queue there, each after
its group's compute; and a decode worker's KV imports, as the CUDA cache's side
stream runs them (engine/kv_cache.py): each after the steps queued before it, and a
step that reads their blocks waits for them (``submit(after=)``). Whole-chunk exports
stay on the step queue (``submit``), as the simulator accounts them.

Accounting, as a worker reports it (GetStats, /metrics, bench):

- **busy**: device seconds over wall seconds since the device was made;
- **host lag**: for a step that continues the step before it (a request of this step was
  in the one before: its inputs depended on that step's end), how long after the device
  went idle the host submitted it -- time the device sat idle waiting for the host. A
  step after an idle spell (nothing to run) counts as idle, not lag.
"""

from __future__ import annotations

import time
from collections import deque

from engine.quantiles import percentiles

LAG_WINDOW = 4096  # the host lags kept for the percentiles (the latest steps)


class DeviceEvent:
    """The end of a piece of device work (a KV export's copy): ``query`` / ``synchronize``
    as a ``torch.cuda.Event``, so engine.kv_cache.PendingExport takes it as one."""

    def __init__(self, device: EmulatedDevice, at: float):
        self.device, self.at = device, at

    def query(self) -> bool:
        return self.device.clock() >= self.at

    def synchronize(self) -> None:
        self.device.wait(self.at)


class EmulatedDevice:
    def __init__(self, clock=time.monotonic, sleep=time.sleep, time_scale: float = 1.0):
        """``time_scale``: every cost given is taken that many times (EmulateConfig's)."""
        self.clock, self.sleep = clock, sleep
        self.time_scale = time_scale
        self.created = clock()
        self.free_at = self.created
        self.busy_s = 0.0
        self.steps = 0
        self.lags: deque[float] = deque(maxlen=LAG_WINDOW)
        self.lag_s = 0.0  # over every continuing step
        self.lag_steps = 0
        self.copy_free_at = self.created
        self.copy_s = 0.0

    def copy(self, cost_s: float, after: float) -> float:
        """Queue ``cost_s`` of copy-engine work that may start at ``after`` (its data's
        compute end on the step queue); returns when it ends. Not counted as busy."""
        cost_s *= self.time_scale
        self.copy_free_at = max(after, self.copy_free_at, self.clock()) + cost_s
        self.copy_s += cost_s
        return self.copy_free_at

    def submit(self, cost_s: float, continues: bool = False, after: float = 0.0) -> float:
        """Queue ``cost_s`` of work now; returns when it ends. ``continues``: a step that
        follows its predecessor's results (its submission lag is the host's); ``after``:
        it may not start before then (copy-engine work whose data it reads)."""
        cost_s *= self.time_scale
        now = self.clock()
        if continues:
            lag = max(0.0, now - self.free_at)
            self.lags.append(lag)
            self.lag_s += lag
            self.lag_steps += 1
        self.free_at = max(now, self.free_at, after) + cost_s
        self.busy_s += cost_s
        self.steps += 1
        return self.free_at

    def wait(self, at: float) -> None:
        """Block the calling thread (not the GIL) until the device's clock reaches ``at``."""
        left = at - self.clock()
        if left > 0:
            self.sleep(left)

    def stats(self) -> dict[str, float]:
        wall = max(self.clock() - self.created, 1e-9)
        lag = percentiles(list(self.lags), (50, 99)) if self.lags else {}
        return {"device_busy_s": self.busy_s, "device_wall_s": wall,
                "device_busy_ratio": min(1.0, self.busy_s / wall),
                "device_steps": float(self.steps), "device_copy_s": self.copy_s,
                "host_lag_s": self.lag_s, "host_lag_steps": float(self.lag_steps),
                "host_lag_p50_s": float(lag.get(50, 0.0)),
                "host_lag_p99_s": float(lag.get(99, 0.0))}
