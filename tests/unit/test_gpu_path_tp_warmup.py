"""Issue 37, item 1: rank 0 of a tensor-parallel group builds its DriverRunner with the
start-up warm-up enabled (as on CUDA with the Triton kernels): the warm-up steps come
through `DriverRunner.run` before the base init returns, and they must neither fail
(`failed` read before it is set) nor be broadcast (the other ranks run their own warm-up
at the same time; a STEP broadcast would meet their all-reduces)."""

from __future__ import annotations

import pytest

from engine import model_runner as runner_mod
from engine import tp_driver
from engine.config import CacheConfig, EngineConfig, Shard
from engine.loader import load_model_config
from engine.tp_driver import STEP, DriverRunner


class _Group:
    """Rank 0 of a one-rank group that records what it would broadcast."""

    rank, size = 0, 1

    def __init__(self):
        self.sent: list[tuple] = []

    def send(self, message: tuple) -> None:
        self.sent.append(message)

    def agree_min(self, value: int) -> int:
        return value


@pytest.fixture()
def driver(tiny_model, monkeypatch):
    group = _Group()
    monkeypatch.setattr(runner_mod, "rank_shard", lambda cfg: (group, Shard.of(cfg.model)))
    monkeypatch.setattr(tp_driver, "rank_shard", lambda cfg: (group, Shard.of(cfg.model)))
    warmed: list[int] = []
    real_warm = runner_mod.ModelRunner.warmup

    def warmup(self):
        warmed.append(len(group.sent))
        real_warm(self)

    monkeypatch.setattr(runner_mod, "warms_kernels", lambda runner: True)
    monkeypatch.setattr(runner_mod.ModelRunner, "warmup", warmup)
    cfg = EngineConfig(str(tiny_model), load_model_config(tiny_model), CacheConfig(4, 64))
    runner = tp_driver.make_runner(cfg, num_blocks=64)
    return runner, group, warmed


def test_rank_zero_warms_up_without_broadcasting(driver):
    runner, group, warmed = driver
    assert isinstance(runner, DriverRunner)
    assert warmed == [0]  # the kernel warm-up ran, inside the base init
    assert group.sent == []  # and rank 0 broadcast none of its steps
    assert runner.failed is None
    # serving steps are broadcast: one STEP per step, its chunks without sampling
    from engine.model_runner import SeqChunk

    step = runner.run([SeqChunk("r", (1, 2, 3), 0, (1,), sample=True)])
    assert step.sample_ids == ["r"] and step.logits.shape[0] == 1
    assert [m[0] for m in group.sent] == [STEP]
    assert [c.sample for c in group.sent[0][1]] == [False]
    assert runner.kv.local.data[:, :, 0].abs().sum() == 0  # the warm-up cleared block 0
