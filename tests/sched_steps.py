"""Drive a colocated engine Scheduler step by step with a fake runner (no model): the
requests, the scheduler over a small BlockManager, one step, a drain and the leak check
shared by tests/unit/test_block_manager.py, test_block_manager_prefix.py and
test_scheduler_lifecycle.py."""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.request import Request, SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput

FAKE_TOKEN = 7


def make(rid: str, n: int, max_tokens: int = 4, base: int = 100, **sp) -> Request:
    """A request whose prompt is `n` distinct tokens starting at `base`."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **sp)
    return Request(rid, list(range(base, base + n)), params)


def sched(num_blocks: int, block_size: int = 4, prefix: bool = True, **cfg) -> Scheduler:
    cfg.setdefault("max_model_len", num_blocks * block_size)
    return Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, block_size, prefix))


def step(s: Scheduler, tokens: dict[str, int] | None = None) -> SchedulerOutput:
    """One step with a fake runner: every sampled row gets FAKE_TOKEN (or `tokens[rid]`)."""
    out = s.schedule()
    sampled = {
        i.request.request_id: (tokens or {}).get(i.request.request_id, FAKE_TOKEN)
        for i in out.items
        if i.to_chunk().sample
    }
    s.update(out, sampled)
    s.bm.check_integrity()
    return out


def run_to_end(s: Scheduler, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if not s.has_unfinished:
            return
        step(s)
    raise AssertionError("scheduler did not drain")


def assert_no_leak(s: Scheduler) -> None:
    s.bm.check_integrity()
    assert s.bm.num_used_blocks == 0
    assert not s.has_unfinished
