"""The interference experiment (one implementation behind `pdserve study interference` and
`python -m tools.interference`): its workload, its phases and its summary, driven by a
scripted ``send`` instead of a service."""

from __future__ import annotations

import asyncio

import pytest

from bench.records import RequestRecord
from bench.studies.interference import InterferenceSpec, phase, summarize
from tools import interference as script


def record(req, *, gaps=(0.01, 0.03), success=True) -> RequestRecord:
    times, t = [1.0 + 0.5], 1.5
    for g in gaps:
        t += g
        times.append(t)
    return RequestRecord(req.request_id, len(req.prompt_token_ids), 1.0, tuple(times),
                         kind=req.kind, success=success)


class ScriptedSend:
    """Chats end once ``chats_wait_for`` long prompts were sent; a long prompt ends once
    the chats ended (``hang_longs``: never, as prompts still prefilling then)."""

    def __init__(self, chats_wait_for: int, hang_longs: bool = False):
        self.longs_sent = 0
        self.enough, self.chats_ended = asyncio.Event(), asyncio.Event()
        self.chats_wait_for, self.hang_longs = chats_wait_for, hang_longs

    async def __call__(self, reqs, on_done=None):
        if reqs[0].kind == "long":
            self.longs_sent += 1
            if self.longs_sent >= self.chats_wait_for:
                self.enough.set()
            await (asyncio.Event() if self.hang_longs else self.chats_ended).wait()
            return [record(r, gaps=()) for r in reqs]
        if self.chats_wait_for:
            await self.enough.wait()
        out = [record(r) for r in reqs]
        for r in out:
            if on_done is not None:
                on_done(r)
        self.chats_ended.set()
        return out


def test_alone_phase_sends_only_the_seeded_chats() -> None:
    spec = InterferenceSpec(chat=3, chat_prompt=5, chat_output=4, long=2, long_every=0.001)
    send = ScriptedSend(chats_wait_for=0)
    seen: list[RequestRecord] = []
    drive = phase(spec, "t", with_long=False)
    records = asyncio.run(drive.run(send, seen.append))
    assert drive.total == 3 and [r.request_id for r in records] == ["t-chat-0", "t-chat-1",
                                                                     "t-chat-2"]
    assert len(seen) == 3 and send.longs_sent == 0
    assert spec.chats("t") == spec.chats("t")  # seeded: the same prompts every run
    assert [len(r.prompt_token_ids) for r in spec.chats("t")] == [5, 5, 5]


def test_a_fixed_number_of_long_prompts_finish_after_the_chats_and_are_summarised() -> None:
    spec = InterferenceSpec(chat=2, long=3, long_every=0.001, long_prompt=7)
    send = ScriptedSend(chats_wait_for=3)  # the long prompts end only after the chats
    records = asyncio.run(phase(spec, "m", with_long=True).run(send, None))
    kinds = [r.kind for r in records]
    assert kinds.count("chat") == 2 and kinds.count("long") == 3 and send.longs_sent == 3
    s = summarize(records)
    assert s["itl_p50_ms"] == pytest.approx(20.0) and s["itl_max_ms"] == pytest.approx(30.0)
    assert s["long_completed"] == 3 and s["long_ttft_mean_s"] == pytest.approx(0.5)
    assert s["failed"] == 0


def test_until_the_chats_end_cancels_the_long_prompts_still_running() -> None:
    spec = InterferenceSpec(chat=2, long=0, long_every=0.001)
    send = ScriptedSend(chats_wait_for=4, hang_longs=True)
    records = asyncio.run(phase(spec, "u", with_long=True).run(send, None))
    assert send.longs_sent >= 4  # kept coming until the chats ended
    assert [r.kind for r in records] == ["chat", "chat"]  # the cancelled ones left no record


def test_summary_without_chat_gaps_is_nan_not_an_error() -> None:
    spec = InterferenceSpec(chat=1)
    s = summarize([record(spec.chats("x")[0], gaps=(), success=False)])
    assert s["itl_p99_ms"] != s["itl_p99_ms"] and s["failed"] == 1


def test_script_flags_map_onto_the_spec() -> None:
    args = script.parse_args(["--quick", "--seed", "3"])
    spec = script.spec_of(args)
    assert (args.preset, spec.long, spec.long_every, spec.chat_output) == ("small", 0, 0.25, 64)
    assert spec.seed == 3 and spec.long_prompt == 1024
    assert script.spec_of(script.parse_args([])) == InterferenceSpec()  # the README's run
    with pytest.raises(SystemExit):
        script.parse_args(["--long", "-1"])


def test_on_an_emulated_device_each_engine_holds_the_whole_workload() -> None:
    """The full workload's chats alone (8 x 640 tokens of an 8B model: 640 MiB) did not
    fit the studies' 0.25 GiB: chats were preempted and re-dispatched, and the study
    measured that. Emulated, the pool holds every request to its last token; on this
    CPU's model the base is kept."""
    from types import SimpleNamespace

    from bench.studies.interference import kv_values
    from cluster.config.serve import ServeConfig
    from engine.emulate.model_dir import emulated_model_dir
    from engine.loader import load_model_config

    spec = InterferenceSpec(chat=8, chat_prompt=128, chat_output=512, long=4,
                            long_prompt=1024, long_every=0.75)
    base = ServeConfig.from_dict({"cache": {"kv_cache_memory_gb": 0.25}})
    model = load_model_config(emulated_model_dir("llama-3-8b"))
    ctx = SimpleNamespace(opts=SimpleNamespace(emulate="h200"), model_config=model,
                          base_config=lambda: base)
    gb = kv_values(ctx, spec)["cache.kv_cache_memory_gb"]
    per_token = 32 * 2 * 8 * 128 * 2  # llama-3-8b, bf16
    assert gb * (1 << 30) >= spec.kv_tokens * per_token > 0.25 * (1 << 30)
    assert spec.kv_tokens == 8 * (128 + 512) + 4 * (1024 + 8)
    ctx.opts.emulate = None
    assert kv_values(ctx, spec) == {}
