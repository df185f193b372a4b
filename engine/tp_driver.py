"""Driving a tensor-parallel group: rank 0 runs the scheduler and the sampler; before each
step it broadcasts the step's SeqChunks, and every rank runs the same forward on its
shard (the all-reduces inside keep them in lockstep). Ranks > 0 sit in `serve_rank`.

Rank 0's `runner.kv` (GroupKV) speaks for the group. By default its export gathers every
rank's heads into whole-head tensors `[L, 2, T, KVH, D]` and an import scatters each rank
its heads. A worker of the service instead moves each rank's own heads over that rank's
own KV link (runtime/tp_links.py installs hooks here): rank 0 then exports and imports
only its own heads, and the other ranks do theirs on its word.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
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
        # per-rank KV links (runtime/tp_links.py): (block_ids, start, end) -> rank 0's
        # heads, after telling the ranks to export theirs; (block_ids, start, data,
        # layer_start, head_start) -> True when `data` was another rank's and it imported it
        self.export_hook = None
        self.import_hook = None

    def __getattr__(self, name: str):
        return getattr(self.local, name)

    def export_tokens(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        """KV of tokens [start, end), every KV head: `[L, 2, T, KVH, D]` on the CPU (rank
        0's heads only with per-rank links)."""
        try:
            if self.export_hook is not None:
                return self.export_hook(block_ids, start, end)
            self.group.send((EXPORT, tuple(block_ids), start, end))
            return gather_heads(self.local.export_tokens(block_ids, start, end), self.group,
                                self.shards)
        except RuntimeError as e:
            raise self.on_error(e) from e

    def export_async(self, block_ids: Sequence[int], start: int, end: int) -> PendingExport:
        return PendingExport(self.export_tokens(block_ids, start, end))

    def import_tokens(self, block_ids: Sequence[int], start: int, data: torch.Tensor,
                      layer_start: int = 0, head_start: int | None = None) -> None:
        """Write KV `data` `[L', 2, T, H', D]` of the model's heads [head_start, +H'):
        whole-head data is scattered, each rank getting its heads; with per-rank links
        `data` is rank 0's own heads, or another rank's chunk that rank then imports."""
        try:
            if self.import_hook is not None and self.import_hook(
                    block_ids, start, data, layer_start, head_start):
                return
            if data.shape[3] != self.shards[0].num_kv_heads or head_start:
                self.local.import_tokens(block_ids, start, data, layer_start, head_start)
                return
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
        # set before the base init: its warm-up steps come through `run`
        self.group = group
        self.describe_failure = describe_failure  # () -> str | None: which rank died
        self.on_failure = None  # (TPGroupError) -> None: e.g. end the process for a restart
        self.failed: TPGroupError | None = None
        # Start-up's warm-up runs on every rank at once, each rank its own steps (their
        # all-reduces pair up): rank 0 broadcasts none of them, or the other ranks, busy
        # warming up, would meet its STEP broadcast in their own collectives.
        self._broadcast = False
        super().__init__(config, num_blocks)
        self._broadcast = True
        self.kv = GroupKV(self.kv, group, _shards(group, config), self.fail)

    def run(self, chunks: list[SeqChunk]) -> StepLogits:
        if not chunks or not self._broadcast:
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


def serve_rank(runner: ModelRunner, group: TPGroup,
               handlers: Mapping[str, Callable[[tuple], None]] | None = None) -> None:
    """Ranks > 0: run what rank 0 sends until it sends STOP (or dies: the collective
    raises, and so does this). `handlers`: further message kinds (e.g. the KV links')."""
    shards = _shards(group, runner.config)
    handlers = handlers or {}
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
        elif kind in handlers:
            handlers[kind](msg)
        else:
            raise TPGroupError(f"unknown tensor-parallel message {kind!r}")


def make_runner(config: EngineConfig, num_blocks: int | None = None,
                describe_failure=None) -> ModelRunner:
    """The runner of this process: a plain ModelRunner without TP (and on ranks > 0,
    which then call `serve_rank`), a DriverRunner on rank 0; with `config.emulate`, the
    emulated accelerator's runner (engine/emulate/runner.py)."""
    if config.emulate is not None:
        from engine.emulate.runner import EmulatedRunner

        return EmulatedRunner(config, num_blocks)  # type: ignore[return-value]
    group, _ = rank_shard(config)  # TPGroupError when TP is asked outside a group
    if group is not None and group.rank == 0:
        return DriverRunner(config, num_blocks, group, describe_failure)
    return ModelRunner(config, num_blocks)
