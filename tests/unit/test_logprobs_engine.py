"""Log-probs through engine.LLM and the in-process P/D engines on the tiny model in fp32,
against transformers: the sampled tokens' log-probs, ranks and top-N (ids and values), and
every prompt token's, equal transformers' log_softmax of its logits to 1e-5, for any chunk
and block size, mixed in batches with requests that ask for none; what a step costs with
and without them; the prefix cache and preemption."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine import LLM, SamplingParams
from engine.logprobs import LOGPROBS_MODES
from engine.request import Request
from runtime.messages import EventKind
from tests.logprobs_ref import check_entry, check_prompt, hf_logits, hf_logprobs
from tests.pd_harness import PDPair

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(1, 2000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def check_output(model_dir, out, n: int, prompt_n: int | None) -> None:
    """Every output token's (and with prompt_n every prompt token's) log-probs equal
    transformers' raw ones over the whole sequence."""
    ref = hf_logprobs(model_dir, out.prompt_token_ids + out.token_ids)
    p = len(out.prompt_token_ids)
    assert len(out.logprobs) == len(out.token_ids)
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        check_entry(lp, ref[p - 1 + i], tok, n)
        assert lp.rank == 1  # greedy: the chosen token is the most likely
    if prompt_n is None:
        assert out.prompt_logprobs is None
    else:
        check_prompt(out.prompt_logprobs, ref, out.prompt_token_ids, prompt_n)


@pytest.mark.parametrize(("chunk", "block"), [(1, 4), (7, 16), (64, 8)])
def test_greedy_and_prompt_logprobs_equal_transformers(tiny_model, chunk, block):
    llm = LLM(str(tiny_model), block_size=block, max_prefill_chunk=chunk,
              max_num_batched_tokens=64)
    prompts = [prompt(n, seed=n) for n in (1, 6, 19, 40)]
    params = [replace(GREEDY, logprobs=3, prompt_logprobs=2),
              GREEDY,  # no log-probs: batched with the others, pays nothing, gets none
              replace(GREEDY, logprobs=0),
              replace(GREEDY, logprobs=5, prompt_logprobs=0)]
    outs = llm.generate(prompts, params)
    check_output(tiny_model, outs[0], 3, 2)
    assert outs[1].logprobs is None and outs[1].prompt_logprobs is None
    check_output(tiny_model, outs[2], 0, None)
    check_output(tiny_model, outs[3], 5, 0)
    assert outs[0].prompt_logprobs == (None,)  # a one-token prompt has nothing to report
    assert llm.block_manager.num_used_blocks == 0
    llm.block_manager.check_integrity()


def processed(logits_row: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """transformers' warpers (temperature, top-k, top-p): the distribution sampled from."""
    x = TemperatureLogitsWarper(sp.temperature)(None, logits_row[None])
    if sp.top_k > 0:
        x = TopKLogitsWarper(sp.top_k)(None, x)
    if sp.top_p < 1:
        x = TopPLogitsWarper(sp.top_p)(None, x)
    return x.log_softmax(dim=-1)[0]


@pytest.mark.parametrize("sp", [
    SamplingParams(temperature=0.7, max_tokens=12, seed=5, ignore_eos=True, logprobs=8),
    SamplingParams(temperature=1.3, top_k=5, max_tokens=12, seed=6, ignore_eos=True,
                   logprobs=8),  # N > k: the tail of the top-N is -inf
    SamplingParams(temperature=0.9, top_k=40, top_p=0.6, max_tokens=12, seed=7,
                   ignore_eos=True, logprobs=4),
])
@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_sampled_tokens_report_the_distribution_of_the_mode(tiny_model, sp, mode):
    sp = replace(sp, logprobs_mode=mode)
    llm = LLM(str(tiny_model), block_size=8, max_prefill_chunk=5)
    p = prompt(11, seed=1)
    # a greedy request in the same batch keeps its raw distribution in either mode
    out, greedy = llm.generate([p, p], [sp, replace(GREEDY, logprobs=2)])
    logits = hf_logits(tiny_model, p + out.token_ids)
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = logits[len(p) - 1 + i]
        want = row.log_softmax(dim=-1) if mode == "raw" else processed(row, sp)
        check_entry(lp, want, tok, sp.logprobs)
        assert lp.logprob > float("-inf")  # it was drawn from that distribution
    check_output(tiny_model, greedy, 2, None)


def test_prompt_logprobs_skip_the_prefix_cache_and_others_still_hit_it(tiny_model):
    llm = LLM(str(tiny_model), block_size=8, max_prefill_chunk=16)
    p = prompt(40, seed=2)
    llm.generate([p], GREEDY)  # caches the prompt's full blocks
    want = replace(GREEDY, prompt_logprobs=1)
    r = llm.add_request(p, want)
    while llm.has_unfinished():
        llm.step()
    assert r.prefix_hit_tokens == 0  # a cached prefix has no logits: computed again
    check_prompt(r.prompt_logprobs, hf_logprobs(tiny_model, p), p, 1)
    plain = llm.add_request(p, GREEDY)
    llm.step()
    assert plain.prefix_hit_tokens == 32  # its blocks were cached as usual
    while llm.has_unfinished():
        llm.step()
    assert llm.block_manager.num_used_blocks == 0
    llm.block_manager.check_integrity()


def test_preempted_requests_report_each_token_once(tiny_model):
    # 4 requests of 10 + 14 tokens (6 blocks of 4 each) in 12 blocks: decode preempts
    llm = LLM(str(tiny_model), block_size=4, num_blocks=12, max_prefill_chunk=4,
              max_num_batched_tokens=16)
    sp = replace(GREEDY, max_tokens=14, logprobs=2, prompt_logprobs=1)
    reqs = [llm.add_request(prompt(10, seed=s), sp) for s in range(4)]
    while llm.has_unfinished():
        llm.step()
    assert sum(r.num_preemptions for r in reqs) > 0
    for r in reqs:
        out = type("Out", (), {"prompt_token_ids": r.prompt_token_ids,
                               "token_ids": r.output_token_ids, "logprobs": r.output_logprobs,
                               "prompt_logprobs": r.prompt_logprobs_tuple()})
        check_output(tiny_model, out, 2, 1)
    assert llm.block_manager.num_used_blocks == 0
    llm.block_manager.check_integrity()


def test_a_prefill_preempted_before_its_first_token_starts_its_prompt_logprobs_over():
    r = Request("r", [1, 2, 3, 4], SamplingParams(prompt_logprobs=0))
    r.prompt_logprobs = [None, object()]  # half the prompt done
    assert r.wants_prompt_logprobs and not r.may_use_prefix_cache
    r.reset_for_recompute()
    assert r.prompt_logprobs is None
    r.output_token_ids = [9]  # after the first token they are complete: kept, cache on
    r.prompt_logprobs = [None, 1, 2, 3]
    r.reset_for_recompute()
    assert r.prompt_logprobs == [None, 1, 2, 3] and r.may_use_prefix_cache


def test_pd_engines_send_logprobs_with_their_tokens(tiny_model):
    pd = PDPair(tiny_model, p_block=16, d_block=8, chunk=7, budget=32)
    p = prompt(30, seed=4)
    sp = replace(GREEDY, logprobs=4, prompt_logprobs=3)
    assert pd.submit("a", p, sp) and pd.submit("b", prompt(9, seed=5), GREEDY)
    pd.run()
    events = [e for e in pd.events if e.leg_id == "a"
              and e.kind in (EventKind.FIRST_TOKEN, EventKind.TOKENS)]
    first = events[0]
    assert first.kind == EventKind.FIRST_TOKEN and first.prompt_logprobs is not None
    assert all(e.prompt_logprobs is None for e in events[1:])
    lps = [lp for e in events for lp in e.logprobs]
    out = type("Out", (), {"prompt_token_ids": p, "token_ids": pd.outputs["a"],
                           "logprobs": lps, "prompt_logprobs": first.prompt_logprobs})
    check_output(tiny_model, out, 4, 3)
    assert all(e.logprobs is None and e.prompt_logprobs is None for e in pd.events
               if e.leg_id == "b")
    pd.leak_check()
    pd.close()


class _HostCopies:
    """Counts what leaves the device (tolist / cpu / item) after the forward (the CPU
    reference attention reads its metadata on the host: not sampling's cost) and the
    log-softmax passes."""

    def __init__(self, monkeypatch):
        self.copied: list[int] = []
        self.passes: list[tuple[int, ...]] = []
        for name in ("tolist", "cpu", "item"):
            real = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._count(real))
        real_ls = torch.Tensor.log_softmax
        monkeypatch.setattr(torch.Tensor, "log_softmax",
                            lambda t, *a, **k: (self.passes.append(tuple(t.shape)),
                                                real_ls(t, *a, **k))[1])

    def _count(self, real):
        def wrapped(t, *a, **k):
            if "attention" not in sys._getframe(1).f_code.co_filename:
                self.copied.append(t.numel())
            return real(t, *a, **k)
        return wrapped


def test_a_step_copies_ids_alone_unless_asked_then_one_small_copy(tiny_model, monkeypatch):
    llm = LLM(str(tiny_model), block_size=8, max_prefill_chunk=64)
    vocab = llm.config.model.vocab_size
    plain = [llm.add_request(prompt(n, seed=n), replace(GREEDY, temperature=t))
             for n, t in ((5, 0.0), (9, 0.8))]
    llm.step()  # both prefills sample their first token
    spy = _HostCopies(monkeypatch)
    llm.step()  # two decodes, nobody asks for log-probs
    assert spy.copied == [2] and spy.passes == []  # the two ids, nothing else
    monkeypatch.undo()
    asking = llm.add_request(prompt(12, seed=3), replace(GREEDY, logprobs=5, prompt_logprobs=4))
    spy = _HostCopies(monkeypatch)
    llm.step()  # two decodes + a whole 12-token prompt with its log-probs
    # one copy: 3 ids, 1 sampled row of (value, rank, 5 ids, 5 values), 11 prompt rows
    # of (value, rank, 4 ids, 4 values)
    assert spy.copied == [3 + 1 * 12 + 11 * 10]
    assert spy.passes == [(1, vocab), (11, vocab)]  # one pass over each row that asks
    assert max(spy.copied) < vocab
    monkeypatch.undo()
    while llm.has_unfinished():
        llm.step()
    assert len(asking.output_logprobs) == len(asking.output_token_ids)
    assert all(not r.output_logprobs for r in plain)
    llm.block_manager.check_integrity()


def test_logprob_fields_are_checked():
    with pytest.raises(ValueError, match="logprobs must be"):
        SamplingParams(logprobs=-1)
    with pytest.raises(ValueError, match="prompt_logprobs must be"):
        SamplingParams(prompt_logprobs=True)
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        SamplingParams(logprobs_mode="logits")
