"""Drives a PrefillEngine and a DecodeEngine in one process over the inproc connector."""

from __future__ import annotations

import itertools
import os
from dataclasses import replace

import torch

from decode_worker.engine import DecodeEngine
from decode_worker.scheduler import DecodeSchedulerConfig
from engine.config import CacheConfig, EmulateConfig, EngineConfig, SchedulerConfig
from engine.loader import load_model_config
from engine.request import SamplingParams
from kv_transfer.config import TransferConfig
from kv_transfer.registry import make_receiver, make_sender
from prefill_worker.engine import PrefillEngine
from prefill_worker.scheduler import PrefillSchedulerConfig
from runtime.messages import DecodeTask, EventKind, PrefillTask

_ids = itertools.count()


def engine_cfg(model_dir, block_size: int, prefix: bool = True,
               emulate: EmulateConfig | None = None) -> EngineConfig:
    """``emulate``: on the emulated accelerator (its shape's KV in bfloat16)."""
    model = load_model_config(model_dir)
    return EngineConfig(str(model_dir), model, CacheConfig(block_size, None, 1 << 30, prefix),
                        SchedulerConfig(max_model_len=1024),
                        dtype="bfloat16" if emulate else "float32", emulate=emulate)


class PDPair:
    def __init__(self, model_dir, p_block=16, d_block=16, chunk=16, budget=64,
                 p_blocks=256, d_blocks=256, send_policy="eager", fairness="fcfs",
                 headroom=64, stream_interval=1, emulate: EmulateConfig | None = None,
                 overlap: bool | None = None, layerwise: int | None = None):
        """``overlap``: the decode engine's host one step ahead (None: on where the
        environment sets PDSERVE_TEST_OVERLAP=1, so any test can run both ways).
        ``layerwise``: the final chunk sent in this many layer groups (0: off; None: the
        environment's PDSERVE_TEST_LAYERWISE, else off)."""
        if overlap is None:
            overlap = os.environ.get("PDSERVE_TEST_OVERLAP") == "1"
        if layerwise is None:
            layerwise = int(os.environ.get("PDSERVE_TEST_LAYERWISE", "0"))
        n = next(_ids)
        tcfg = TransferConfig(connector="inproc", send_policy=send_policy)
        self.receiver = make_receiver(tcfg, name=f"d{n}")
        self.sender = make_sender(tcfg, name=f"p{n}")
        self.prefill = PrefillEngine(
            "prefill-0", engine_cfg(model_dir, p_block, emulate=emulate),
            PrefillSchedulerConfig(max_num_batched_tokens=budget, max_prefill_chunk=chunk,
                                   fairness_policy=fairness),
            self.sender, p_blocks, layerwise_groups=layerwise)
        self.decode = DecodeEngine(
            "decode-0", engine_cfg(model_dir, d_block, emulate=emulate),
            DecodeSchedulerConfig(max_model_len=1024, headroom_tokens=headroom,
                                  overlap=overlap),
            self.receiver, d_blocks, stream_interval=stream_interval)
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, str] = {}
        self.events: list = []

    def submit(self, rid: str, prompt: list[int], sp: SamplingParams) -> bool:
        eos = self.prefill.config.model.eos_token_ids
        if not self.decode.reserve(DecodeTask(rid, len(prompt), sp, eos)):
            return False
        self.prefill.add(PrefillTask(rid, tuple(prompt), sp, self.receiver.endpoint, eos))
        self.outputs[rid] = []
        return True

    def step(self) -> None:
        for ev in self.prefill.step() + self.decode.step():
            self.events.append(ev)
            if ev.kind in (EventKind.FIRST_TOKEN, EventKind.TOKENS):
                self.outputs[ev.leg_id].extend(ev.token_ids)
                if ev.finish_reason:
                    self.finished[ev.leg_id] = ev.finish_reason
                    if ev.kind == EventKind.FIRST_TOKEN:
                        self.decode.abort(ev.leg_id)
            elif ev.kind in (EventKind.FAILED, EventKind.PREEMPTED):
                self.finished[ev.leg_id] = ev.kind

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if all(r in self.finished for r in self.outputs) and not self.prefill.has_work \
                    and not self.decode.has_work:
                return
            before = len(self.events)
            self.step()
            if len(self.events) == before:  # KV or acks are on a link thread: wait, not spin
                self.receiver.wait(0.01)
        raise AssertionError("P/D pair did not finish")

    def leak_check(self) -> None:
        for eng in (self.prefill, self.decode):
            eng.bm.check_integrity()
            assert eng.bm.num_used_blocks == 0, f"{eng.worker_id} leaked blocks"
        assert not self.prefill.jobs and not self.prefill.scheduler.has_work
        assert self.prefill.kv_in_flight == 0, "prefill legs still hold KV to send"
        assert not self.decode.scheduler.pending and not self.decode.scheduler.running

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


# prompts of mixed lengths across chunk and block boundaries (the streams tests')
STREAM_PROMPTS = [list(range(1, 41)), [9] * 5, [100 + i for i in range(23)], [5, 6, 7]]


def streams(pair: PDPair, prompts, sp: SamplingParams) -> tuple[list, list]:
    """Run ``prompts`` through ``pair`` to the end: each one's tokens and its log-probs'
    token ids; then the leak check, and the pair is closed."""
    for i, p in enumerate(prompts):
        assert pair.submit(f"r{i}", p, sp)
    pair.run()
    outs = [pair.outputs[f"r{i}"] for i in range(len(prompts))]
    lps = [[lp.token_id for e in pair.events if e.leg_id == f"r{i}" and e.logprobs
            for lp in e.logprobs] for i in range(len(prompts))]
    pair.leak_check()
    pair.close()
    return outs, lps


def corrupt_once(pair: PDPair, request_id: str, seq_no: int = 1) -> list[int]:
    """Flip one bit of that chunk's payload after its export, before framing (the wire's
    own checksum is of these bytes), once; the list gets its seq_no when it happened."""
    send, hit = pair.sender.send, []

    def corrupting_send(chunk, dest):
        if chunk.request_id == request_id and chunk.seq_no == seq_no and not hit:
            chunk = chunk.resolved()  # the export's bytes, gathered
            chunk.payload.view(torch.uint8).view(-1)[777] ^= 0x04
            hit.append(chunk.seq_no)
        return send(chunk, dest=dest)

    pair.sender.send = corrupting_send
    return hit


def greedy(max_tokens: int = 10) -> SamplingParams:
    return replace(SamplingParams(temperature=0.0, max_tokens=max_tokens), ignore_eos=True)
