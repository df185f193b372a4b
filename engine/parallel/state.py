"""This process's tensor-parallel group (one per process, as torch.distributed's default
group is): its rank, the group that all-reduces activations (gloo on CPU, NCCL on CUDA)
and a gloo group that carries the steps rank 0 broadcasts.

The two groups have different timeouts: a worker rank waits for its next step as long
as the engine is idle (hours), while a collective inside a step that does not finish in
`STEP_TIMEOUT` means a rank is stuck. A rank that dies closes its connections, so its
peers' pending and next collectives fail at once (no timeout needed).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from engine.config import Shard

if TYPE_CHECKING:
    from engine.config import EngineConfig

STEP_TIMEOUT = timedelta(minutes=10)
IDLE_TIMEOUT = timedelta(days=30)


class TPGroupError(RuntimeError):
    """A rank of a tensor-parallel group died or failed; the group is unusable."""


@dataclass
class TPGroup:
    rank: int
    size: int
    device: torch.device
    group: dist.ProcessGroup  # activations (all-reduce)
    cpu_group: dist.ProcessGroup  # steps, KV gathers (gloo)

    # ---- control (rank 0 -> every rank) -------------------------------------------------
    def send(self, message: object) -> None:
        """Rank 0: broadcast one pickled message (length, then bytes) to every rank."""
        data = torch.frombuffer(bytearray(pickle.dumps(message, protocol=5)), dtype=torch.uint8)
        dist.broadcast(torch.tensor([data.numel()], dtype=torch.int64), 0, group=self.cpu_group)
        dist.broadcast(data, 0, group=self.cpu_group)

    def recv(self) -> object:
        """Ranks > 0: the next message rank 0 sends (waits as long as the engine idles)."""
        n = torch.empty(1, dtype=torch.int64)
        dist.broadcast(n, 0, group=self.cpu_group)
        data = torch.empty(int(n.item()), dtype=torch.uint8)
        dist.broadcast(data, 0, group=self.cpu_group)
        return pickle.loads(data.numpy().tobytes())

    def gather(self, obj: object) -> list | None:
        """Every rank's picklable `obj` to rank 0 (a list by rank); None on the others."""
        out = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.cpu_group)
        return out

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. KV blocks: every rank has as many)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())


_current: TPGroup | None = None


def current_group() -> TPGroup | None:
    """This process's TP group, None when it runs without tensor parallelism."""
    return _current


def rank_shard(config: EngineConfig) -> tuple[TPGroup | None, Shard]:
    """This process's group (None without TP) and the slice of `config.model` it holds."""
    size = config.tensor_parallel_size
    if size == 1:
        return None, Shard.of(config.model)
    group = _current
    if group is None or group.size != size:
        raise TPGroupError(
            f"tensor_parallel_size={size} needs this process to be a rank of a group of that "
            "size (engine.LLM, or a worker group of the "
            f"service); it is {'in none' if group is None else f'in one of {group.size}'}")
    return group, Shard.of(config.model, size, group.rank)


def init_group(rank: int, size: int, store: dist.Store, device: torch.device,
               backend: str | None = None) -> TPGroup:
    """Join the group of `size` ranks that meet at `store` (a TCPStore rank 0 serves).
    Every rank calls this; it returns once all have joined. `backend`: NCCL on CUDA and
    gloo on CPU unless given (gloo on CUDA: ranks may share one GPU, for checks)."""
    global _current
    if _current is not None:
        raise RuntimeError(f"this process is already rank {_current.rank} of a "
                           f"tensor-parallel group of {_current.size}")
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                            timeout=STEP_TIMEOUT)
    cpu = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    _current = TPGroup(rank, size, device, dist.group.WORLD, cpu)
    return _current


def destroy_group() -> None:
    """Leave the group (every process group of this process); a no-op outside one."""
    global _current
    if _current is None:
        return
    _current = None
    if dist.is_initialized():
        dist.destroy_process_group()
