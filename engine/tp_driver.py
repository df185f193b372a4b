"""Driving a tensor-parallel group: rank 0 runs the scheduler and the sampler; before each
step it broadcasts the step's SeqChunks, and every rank runs the same forward on its
shard (the all-reduces inside keep them in lockstep). Ranks > 0 sit in `serve_rank`.

KV export and import (prefill -> decode transfer) go through rank 0 as whole-head
tensors `[L, 2, T, KVH, D]`: an export gathers every rank's heads, an import scatters
each rank's heads to it. So any connector carries a TP group's KV unchanged and the
two pools may use different TP sizes (frames carrying a KV-head range, so that each
rank sends its own heads, avoid the gather; see kv_transfer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.distributed as dist

from engine.config import EngineConfig, Shard, torch_dtype
from engine.kv_cache import KVCache, PendingExport
from engine.model_runner import ModelRunner, SeqChunk, StepLogits
from engine.parallel.state import TPGroup, TPGroupError, rank_shard

STEP, EXPORT, IMPORT, STOP = "step", "export", "import", "stop"


def _shards(group: TPGroup, config: EngineConfig) -> list[Shard]:
    return [Shard.of(config.model, group.size, r) for r in range(group.size)]


class GroupKV:
    """Rank 0's view of the group's KV cache: whole heads in, whole heads out. Everything
    else (the per-layer views the forward writes, wait_imports) is rank 0's own cache."""

    def __init__(self, local: KVCache, group: TPGroup, shards: list[Shard], on_error):
        self.local, self.group, self.shards = local, group, shards
        self.on_error = on_error  # (RuntimeError) -> TPGroupError: the driver's `fail`

    def __getattr__(self, name: str):
        return getattr(self.local, name)

    def export_tokens(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        """KV of tokens [start, end), every KV head: `[L, 2, T, KVH, D]` on the CPU."""
        try:
            self.group.send((EXPORT, tuple(block_ids), start, end))
            return gather_heads(self.local.export_tokens(block_ids, start, end), self.group,
                                self.shards)
        except RuntimeError as e:
            raise self.on_error(e) from e

    def export_async(self, block_ids: Sequence[int], start: int, end: int) -> PendingExport:
        return PendingExport(self.export_tokens(block_ids, start, end))

    def import_tokens(self, block_ids: Sequence[int], start: int, data: torch.Tensor,
                      layer_start: int = 0) -> None:
        """Write whole-head KV `data` `[L', 2, T, KVH, D]`: each rank gets its heads."""
        try:
            self.group.send((IMPORT, tuple(block_ids), start, tuple(data.shape),
                             str(data.dtype).removeprefix("torch."), layer_start))
            part = scatter_heads(data, self.group, self.shards)
        except RuntimeError as e:
            raise self.on_error(e) from e
        self.local.import_tokens(block_ids, start, part, layer_start)


def gather_heads(part: torch.Tensor, group: TPGroup, shards: list[Shard]) -> torch.Tensor | None:
    """Every rank's `[L, 2, T, kvh, D]` to rank 0, joined along the head dim (a KV head
    held by several ranks taken once); None on the other ranks."""
    part = part.contiguous()
    if group.rank != 0:
        dist.gather(part, None, dst=0, group=group.cpu_group)
        return None
    parts = [torch.empty_like(part) for _ in shards]
    dist.gather(part, parts, dst=0, group=group.cpu_group)
    return torch.cat([p for p, s in zip(parts, shards, strict=True) if s.kv_owner], dim=3)


def scatter_heads(data: torch.Tensor | None, group: TPGroup, shards: list[Shard],
                  shape: tuple[int, ...] = (), dtype: torch.dtype | None = None
                  ) -> torch.Tensor:
    """Rank 0's whole-head `data` -> each rank's heads `[L, 2, T, kvh, D]`."""
    me = shards[group.rank]
    n = me.kv_heads[1] - me.kv_heads[0]
    if group.rank == 0:
        out = data[:, :, :, slice(*me.kv_heads)].contiguous()
        parts = [data[:, :, :, slice(*s.kv_heads)].contiguous() for s in shards]
        dist.scatter(out, parts, src=0, group=group.cpu_group)
        return out
    out = torch.empty(shape[:3] + (n,) + shape[4:], dtype=dtype)
    dist.scatter(out, None, src=0, group=group.cpu_group)
    return out


class DriverRunner(ModelRunner):
    """Rank 0's ModelRunner: each step and KV transfer is sent to the other ranks first.
    A rank that dies fails the step with TPGroupError (naming it where the group knows
    its processes); the group is unusable from then on."""

    def __init__(self, config: EngineConfig, num_blocks: int | None, group: TPGroup,
                 describe_failure=None):
        super().__init__(config, num_blocks)  # (its warm-up runs on every rank at once)
        self.group = group
        self.describe_failure = describe_failure  # () -> str | None: which rank died
        self.on_failure = None  # (TPGroupError) -> None: e.g. end the process for a restart
        self.failed: TPGroupError | None = None
        self.kv = GroupKV(self.kv, group, _shards(group, config), self.fail)

    def run(self, chunks: list[SeqChunk]) -> StepLogits:
        if not chunks:
            return super().run(chunks)
        if self.failed is not None:
            raise self.failed
        try:
            self.group.send((STEP, [replace(c, sample=False, all_logits=False)
                                    for c in chunks]))
            return super().run(chunks)
        except RuntimeError as e:
            raise self.fail(e) from e

    def fail(self, error: BaseException) -> TPGroupError:
        if self.failed is not None:
            return self.failed
        what = self.describe_failure() if self.describe_failure else None
        self.failed = TPGroupError(
            f"tensor-parallel group of {self.group.size} failed: "
            f"{what or 'a rank stopped answering'} ({type(error).__name__}: {error})")
        if self.on_failure is not None:
            self.on_failure(self.failed)
        return self.failed

    def stop_ranks(self) -> None:
        """Tell the other ranks to leave `serve_rank` (nothing if the group has failed)."""
        if self.failed is None:
            self.group.send((STOP,))


def serve_rank(runner: ModelRunner, group: TPGroup) -> None:
    """Ranks > 0: run what rank 0 sends until it sends STOP (or dies: the collective
    raises, and so does this)."""
    shards = _shards(group, runner.config)
    while True:
        msg = group.recv()
        kind = msg[0]
        if kind == STOP:
            return
        if kind == STEP:
            runner.run(msg[1])
        elif kind == EXPORT:
            _, block_ids, start, end = msg
            gather_heads(runner.kv.export_tokens(block_ids, start, end), group, shards)
        elif kind == IMPORT:
            _, block_ids, start, shape, dtype, layer_start = msg
            part = scatter_heads(None, group, shards, shape, torch_dtype(dtype))
            runner.kv.import_tokens(block_ids, start, part, layer_start)
        else:
            raise TPGroupError(f"unknown tensor-parallel message {kind!r}")


def make_runner(config: EngineConfig, num_blocks: int | None = None,
                describe_failure=None) -> ModelRunner:
    """The runner of this process: a plain ModelRunner without TP (and on ranks > 0,
    which then call `serve_rank`), a DriverRunner on rank 0."""
    group, _ = rank_shard(config)  # TPGroupError when TP is asked outside a group
    if group is not None and group.rank == 0:
        return DriverRunner(config, num_blocks, group, describe_failure)
    return ModelRunner(config, num_blocks)
