"""The prefill step's first token goes out before its KV is handed to the connector
(prefill_worker/engine.py): the step exports its chunks, the next step hands them over in
order, an abort in between still hands them over first (the sender drops them; a TP
group's ranks stay paired), and an idle worker does not poll the connector. Greedy
tokens stay the colocated engine's, and nothing leaks."""

from __future__ import annotations

from engine import LLM
from runtime.messages import EventKind
from tests.pd_harness import PDPair, greedy


class Recording:
    """The real sender, with the engine's calls to it logged in order."""

    def __init__(self, sender, log: list):
        self._sender, self._log = sender, log

    def send(self, chunk, *, dest):
        self._log.append(("send", chunk.request_id, chunk.seq_no, chunk.is_final))
        self._sender.send(chunk, dest=dest)

    def poll(self):
        self._log.append(("poll",))
        return self._sender.poll()

    def abort(self, request_id):
        self._log.append(("abort", request_id))
        self._sender.abort(request_id)

    def __getattr__(self, name):
        return getattr(self._sender, name)


def _pair(tiny_model) -> tuple[PDPair, list]:
    pair = PDPair(tiny_model, chunk=64, budget=64)
    log: list = []
    pair.prefill.sender = Recording(pair.prefill.sender, log)
    return pair, log


PROMPT = list(range(3, 43))  # 40 tokens: one chunk, the final one


def test_the_first_token_is_reported_before_its_kv_is_handed_over(tiny_model):
    pair, log = _pair(tiny_model)
    assert pair.prefill.step() == [] and log == []  # idle: the connector is not polled
    pair.submit("r", PROMPT, greedy(6))
    events = pair.prefill.step()
    assert [e.kind for e in events] == [EventKind.FIRST_TOKEN]
    assert log == [] and pair.prefill.kv_in_flight == 1  # exported, not yet handed over
    pair.prefill.step()
    assert log[:2] == [("send", "r", 0, True), ("poll",)]
    pair.outputs["r"].extend(events[0].token_ids)
    pair.run()
    ref = LLM(str(tiny_model), block_size=16).generate([PROMPT], greedy(6))[0].token_ids
    assert pair.outputs["r"] == ref
    pair.leak_check()
    pair.close()


def test_an_abort_before_the_handoff_hands_the_chunk_over_first_and_frees_everything(
        tiny_model):
    pair, log = _pair(tiny_model)
    pair.submit("r", PROMPT, greedy(6))
    assert [e.kind for e in pair.prefill.step()] == [EventKind.FIRST_TOKEN]
    assert pair.prefill.abort("r")
    assert log == [("send", "r", 0, True), ("abort", "r")]
    pair.decode.abort("r")
    pair.outputs.pop("r")
    pair.run()
    assert pair.prefill.kv_in_flight == 0 and not pair.prefill.jobs
    assert pair.prefill.step() == [] and log[-1] == ("abort", "r")  # nothing left to poll
    pair.leak_check()
    pair.close()


def test_a_hand_off_that_fails_fails_every_leg_and_frees_them(tiny_model):
    """The connector breaks with two legs' chunks waiting for their hand-off: the step
    raises, and failing the legs (what the loop does next) still reports each as FAILED
    and frees its blocks, though the rest of the hand-off fails too."""
    pair = PDPair(tiny_model, chunk=64, budget=128)
    for rid in ("a", "b"):
        pair.submit(rid, PROMPT, greedy(6))
    assert [e.kind for e in pair.prefill.step()] == [EventKind.FIRST_TOKEN] * 2
    pair.sender.close()
    try:
        pair.prefill.step()
        raise AssertionError("a step with a closed connector must fail")
    except RuntimeError:
        pass
    events = pair.prefill.fail_all("engine step failed")
    assert sorted((e.kind, e.leg_id) for e in events) == [
        (EventKind.FAILED, "a"), (EventKind.FAILED, "b")]
    assert pair.prefill.kv_in_flight == 0 and not pair.prefill.jobs
    assert pair.prefill.bm.num_used_blocks == 0
    pair.prefill.bm.check_integrity()
    for rid in ("a", "b"):
        pair.decode.abort(rid)
    pair.receiver.close()


def test_every_chunk_of_a_batched_step_is_counted(tiny_model):
    """`chunk_sizes` (the `pdserve:prefill_chunk_tokens` histogram) counts each chunk of a
    step that batches several prompts, not its last alone."""
    pair = PDPair(tiny_model, chunk=16, budget=64)
    prompts = [list(range(1, 1 + n)) for n in (5, 9, 16, 23)]
    for i, p in enumerate(prompts):
        assert pair.submit(f"r{i}", p, greedy(2))
    pair.run()
    sizes = pair.prefill.stats().chunk_sizes
    assert sum(int(size) * n for size, n in sizes.items()) == sum(map(len, prompts))
    assert sum(sizes.values()) == 5  # 23 tokens in chunks of 16: two; the rest one each
