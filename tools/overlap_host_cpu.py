"""The decode worker's host CPU per token, by part (issue 39's note): the decode
engine's own Python (scheduling, inputs, events; a free runner), serial and overlapped,
and the emulated runner's host work per decode row (llama-3-8b, the KV pattern's reads
and writes into the real cache), beside the cost model's device time per row. One torch
thread, as a worker of ``cpus_per_worker`` 1; CPU time of the calling thread.

    python -m tools.overlap_host_cpu MODEL_DIR      # any small model dir (its config)
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import decode_worker.engine as de
from decode_worker.scheduler import DecodeSchedulerConfig
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.emulate.offline import emulated_engine_config
from engine.emulate.runner import EmulatedRunner
from engine.execute import Sampled, ScheduledItem, StepLaunch
from engine.loader import load_model_config
from engine.request import Request, RequestStatus, SamplingParams
from kv_transfer.base import KVChunk, KVReceiver, ReceiveEvents
from runtime.messages import DecodeTask


class _Rx(KVReceiver):
    endpoint = "free://decode"

    def __init__(self):
        self.ev = ReceiveEvents()

    def poll(self):
        ev, self.ev = self.ev, ReceiveEvents()
        return ev

    def release(self, chunk): pass

    def abort(self, request_id): pass

    def expect(self, request_id): pass

    def stats(self): return {}

    def close(self): pass


class _FreeRunner:
    """No device and no KV: what is left is the engine's own Python."""

    samples_itself = True

    class kv:  # noqa: N801 - the runner's attribute
        @staticmethod
        def import_tokens(*a, **k): pass

    def launch(self, items):
        for it in items:
            it.to_chunk()  # what a runner builds per row
        out = [Sampled(it.request, 11) for it in items]
        return StepLaunch(lambda: out)


def engine_python(model_dir: str, batch: int, overlap: bool) -> float:
    model = load_model_config(model_dir)
    cfg = EngineConfig(model_dir, model, CacheConfig(16, None, 1 << 30, False),
                       SchedulerConfig(max_model_len=1024))
    real, de.make_runner = de.make_runner, lambda *a, **k: _FreeRunner()
    rx = _Rx()
    try:
        eng = de.DecodeEngine("d", cfg, DecodeSchedulerConfig(
            max_num_seqs=batch, max_model_len=1024, overlap=overlap), rx, batch * 12)
    finally:
        de.make_runner = real
    sp = SamplingParams(temperature=0.0, max_tokens=129, ignore_eos=True)
    for i in range(batch):
        assert eng.reserve(DecodeTask(f"r{i}", 32, sp))
        rx.ev.chunks.append(KVChunk(f"r{i}", 0, 0, 32, torch.zeros(model.num_layers, 2, 32,
                                                                    1, 1),
                                    is_final=True, first_token=5))
        rx.ev.completed.append(f"r{i}")
    eng.step()
    eng.step()
    c0, n = time.process_time(), 0
    while eng.has_work:
        n += sum(len(e.token_ids) for e in eng.step())
    return (time.process_time() - c0) / n


def emulated_row(batch: int, ctx: int, steps: int = 40) -> tuple[float, float]:
    """The emulated runner's host CPU per decode row (the median step's, on this thread:
    the KV state's gather, the hash chain, the draw, the KV words' write) and the cost
    model's device time per row, at ``batch`` rows of context ``ctx``."""
    cfg = emulated_engine_config("h200", "llama-3-8b", max_model_len=256)
    bs = cfg.cache.block_size
    per = -(-(ctx + steps + 1) // bs)
    runner = EmulatedRunner(cfg, batch * per + 8)
    reqs = []
    for i in range(batch):
        q = Request(f"r{i}", [1] * ctx, SamplingParams(temperature=0.0, max_tokens=200))
        q.output_token_ids = [5]
        q.block_ids = list(range(i * per, (i + 1) * per))
        q.num_cached_tokens, q.status = ctx, RequestStatus.RUNNING
        reqs.append(q)
    cpu = []
    for _ in range(steps):
        items = [ScheduledItem(q, q.num_cached_tokens, 1, False) for q in reqs]
        c0 = time.thread_time()
        launch = runner.launch(items)
        cpu.append(time.thread_time() - c0)
        for s in launch.result():
            s.request.num_cached_tokens += 1
            s.request.output_token_ids.append(s.token_id)
    return statistics.median(cpu) / batch, runner.costs.decode_s(batch, batch * ctx, ctx) / batch


def main() -> None:
    model_dir = sys.argv[1]
    torch.set_num_threads(1)  # as a worker of cpus_per_worker 1 (the service's default)
    for batch in (64, 256):
        for overlap in (False, True):
            us = engine_python(model_dir, batch, overlap) * 1e6
            print(f"decode engine Python, batch {batch}, overlap {'on' if overlap else 'off'}: "
                  f"{us:.1f} us CPU per token")
    for batch, ctx in ((64, 160), (256, 48)):
        host, dev = emulated_row(batch, ctx)
        print(f"emulated runner (llama-3-8b), batch {batch}, context {ctx}: host {host * 1e6:.1f} "
              f"us per row (median step); device {dev * 1e6:.1f} us per row (cost model)")


if __name__ == "__main__":
    main()
