"""Which torch device an engine runs on, and binding it to every thread that drives it.

Two traps of `cuda:N`:
- Inside a Ray actor given GPUs, Ray sets CUDA_VISIBLE_DEVICES to the actor's GPU(s), so
  torch sees them as cuda:0..; a cluster-wide `cuda:1` there is an invalid ordinal (or
  another actor's GPU). The actor uses its first visible device.
- In one process, tensors on cuda:1 are not enough: Triton launches on the calling
  thread's *current* device (0 unless set), and the current device is per thread. Every
  thread that runs the model, samples or copies KV must call `torch.cuda.set_device`.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Sequence

import torch

log = logging.getLogger(__name__)
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def resolve_device(
    requested: str,
    cuda_device_count: int,
    ray_gpu_ids: Sequence[str | int] | None = None,
    current: int = 0,
) -> torch.device:
    """The torch device for `requested` ('auto', 'cpu', 'cuda', 'cuda:N').

    `cuda_device_count`: devices torch sees in this process; `ray_gpu_ids`: the GPUs Ray
    assigned to this actor (`ray.get_gpu_ids()`), None outside a Ray actor; `current`:
    the process's current CUDA device, used for a bare 'cuda' outside Ray.
    """
    if not _DEVICE_RE.match(requested):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {requested!r}")
    if requested == "cpu":
        return torch.device("cpu")
    if ray_gpu_ids is not None and len(ray_gpu_ids) == 0:
        # a Ray actor given no GPU: 'auto' means CPU (GPUs it may see belong to others)
        if requested == "auto":
            return torch.device("cpu")
        raise ValueError(f"device {requested!r}, but Ray assigned this worker no GPU "
                         "(pools.gpus_per_worker is 0, or the cluster has no GPUs)")
    if requested == "auto":
        return torch.device("cuda", current if ray_gpu_ids is None else 0) \
            if cuda_device_count > 0 else torch.device("cpu")
    if cuda_device_count < 1:
        raise ValueError(f"device {requested!r}, but no CUDA device is visible")
    index = int(requested.partition(":")[2] or (current if ray_gpu_ids is None else 0))
    if ray_gpu_ids is not None:
        if index != 0:
            log.warning("device %r: inside a Ray actor the GPU is the one Ray assigned "
                        "(GPU id %s, visible as cuda:0); the index is ignored",
                        requested, ray_gpu_ids[0])
        return torch.device("cuda", 0)
    if index >= cuda_device_count:
        raise ValueError(f"device {requested!r}, but only {cuda_device_count} CUDA "
                         f"device(s) are visible (cuda:0..cuda:{cuda_device_count - 1})")
    return torch.device("cuda", index)


def local_device(requested: str, ray_gpu_ids: Sequence[str | int] | None = None) -> torch.device:
    """`resolve_device` with this process's facts."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    current = torch.cuda.current_device() if count else 0
    return resolve_device(requested, count, ray_gpu_ids, current)


class ThreadBinder:
    """Makes `device` the current CUDA device of every thread that calls it (once per
    thread: the check is a thread-local lookup). A no-op for CPU devices."""

    def __init__(self, device: torch.device, set_device=None):
        self.device = device
        self._set_device = set_device or torch.cuda.set_device
        self._local = threading.local()

    def __call__(self) -> None:
        if self.device.type != "cuda" or getattr(self._local, "bound", False):
            return
        self._set_device(self.device)
        self._local.bound = True


_pin_failed = False


def pinned_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor in page-locked memory (what non-blocking copies to and
    from a GPU need), from torch's caching host allocator, so buffers of a size seen
    before are reused, not allocated again. Where pinning is unavailable (no CUDA, or
    the OS refuses), an ordinary tensor, after one warning: copies then block, nothing else
    changes."""
    global _pin_failed
    if not _pin_failed:
        try:
            return torch.empty(tuple(shape), dtype=dtype, pin_memory=True)
        except RuntimeError as e:
            _pin_failed = True
            log.warning("pinned host memory unavailable (%s); host copies will block", e)
    return torch.empty(tuple(shape), dtype=dtype)


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on `device`, without a stream sync: on CUDA staged in
    pinned memory and copied non-blocking (`torch.tensor(values, device=cuda)` copies from
    pageable memory, and the host waits for the copy); on the CPU just the tensor."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return pinned_empty(host.shape, dtype).copy_(host).to(device, non_blocking=True)
