"""Sampling: greedy, temperature, top-k, top-p on hand-checkable vocabularies; per-request
seeds independent of the batch; stop tokens, EOS from generation_config, ignore_eos and
max_tokens through the real engine (each engine test ends with a leak check)."""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampler import argmax_rows, generator_on, sample, sample_batch

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    return LLM(str(tiny_model), block_size=4, max_num_batched_tokens=64)


def assert_no_leak(llm: LLM) -> None:
    llm.block_manager.check_integrity()
    assert llm.block_manager.num_used_blocks == 0 and not llm.has_unfinished()


def draws(logits: list[float], n: int = 500, seed: int = 0, **sp) -> Counter:
    """Token counts of `n` seeded draws from one row of logits."""
    params = SamplingParams(**sp)
    gen = torch.Generator().manual_seed(seed)
    row = torch.tensor([logits])
    return Counter(sample(row, [params], [gen])[0] for _ in range(n))


def log(ps: list[float]) -> list[float]:
    return [math.log(p) for p in ps]


# ---- the sampler on small vocabularies ---------------------------------------------
def test_greedy_takes_the_argmax_of_each_row():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [5.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 3.0]])
    params = [SamplingParams(temperature=0.0)] * 3
    assert sample(logits, params, [None] * 3) == [1, 0, 3]
    assert sample(torch.empty(0, 4), [], []) == []


def test_a_temperature_too_small_to_divide_by_is_greedy():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [5.0, 0.0, 0.0, 7.0]])
    tiny = SamplingParams(temperature=1e-300)  # logits / T would overflow to inf
    assert tiny.greedy and not SamplingParams(temperature=1e-3).greedy
    assert sample(logits, [tiny] * 2, [torch.Generator().manual_seed(0)] * 2) == [1, 3]


def test_temperature_one_follows_the_softmax():
    c = draws(log([0.25, 0.75]), n=2000, temperature=1.0)
    assert abs(c[1] / 2000 - 0.75) < 0.04 and set(c) == {0, 1}


def test_high_temperature_flattens_and_low_temperature_sharpens():
    flat = draws(log([0.1, 0.9]), n=2000, temperature=100.0)
    assert abs(flat[0] / 2000 - 0.5) < 0.05
    sharp = draws(log([0.4, 0.6]), temperature=0.01)
    assert sharp == Counter({1: 500})


def test_top_k_samples_only_the_k_most_likely():
    logits = [4.0, 3.0, 2.0, 1.0, 0.0]
    assert set(draws(logits, temperature=50.0, top_k=2)) == {0, 1}
    assert set(draws(logits, temperature=50.0, top_k=1)) == {0}
    assert set(draws(logits, temperature=50.0)) == {0, 1, 2, 3, 4}  # top_k=-1: off


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    probs = log([0.5, 0.3, 0.15, 0.05])
    assert set(draws(probs, top_p=0.5)) == {0}  # 0.5 already reaches 0.5
    assert set(draws(probs, top_p=0.6)) == {0, 1}  # 0.5 < 0.6 <= 0.8
    assert set(draws(probs, top_p=0.81)) == {0, 1, 2}
    c = draws(probs, n=2000, top_p=0.8)  # the kept mass is renormalised: 0.5 / 0.8, 0.3 / 0.8
    assert set(c) == {0, 1} and abs(c[0] / 2000 - 0.625) < 0.04


def test_top_k_and_top_p_combine():
    probs = log([0.4, 0.3, 0.2, 0.1])
    assert set(draws(probs, top_k=3, top_p=0.65)) == {0, 1}
    assert set(draws(probs, top_k=2, top_p=0.95)) == {0, 1}


def test_same_seed_same_draws_different_seed_different_draws():
    logits = [0.0] * 16
    a = [sample(torch.tensor([logits]), [SamplingParams(seed=1)], [g])[0]
         for g in [torch.Generator().manual_seed(5)] for _ in range(30)]
    b = [sample(torch.tensor([logits]), [SamplingParams(seed=1)], [g])[0]
         for g in [torch.Generator().manual_seed(5)] for _ in range(30)]
    c = [sample(torch.tensor([logits]), [SamplingParams(seed=1)], [g])[0]
         for g in [torch.Generator().manual_seed(6)] for _ in range(30)]
    assert a == b and a != c


def test_greedy_and_sampled_rows_mix_in_one_batch():
    logits = torch.tensor([[0.0, 9.0, 0.0], [0.0, 0.0, 9.0]])
    out = sample(logits, [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1)],
                 [None, torch.Generator().manual_seed(0)])
    assert out == [1, 2]


# ---- the batched sampler: distributions, exact probabilities, seeds, one host copy ----
# chi-square critical values at alpha = 1e-4 by degrees of freedom
CHI2_CRIT = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74}


def chi_square(counts: torch.Tensor, probs: list[float]) -> float:
    n = counts.sum().item()
    keep = [i for i, p in enumerate(probs) if p > 0]
    assert all(counts[i] == 0 for i in range(len(probs)) if probs[i] == 0), counts
    return sum((counts[i].item() - n * probs[i]) ** 2 / (n * probs[i]) for i in keep)


def log0(ps: list[float]) -> list[float]:
    return [math.log(p) if p > 0 else float("-inf") for p in ps]


# (model probabilities, params, the distribution the row must be sampled from)
ROW_KINDS = [
    ([0.1, 0.2, 0.3, 0.4, 0.0], dict(temperature=1.0), [0.1, 0.2, 0.3, 0.4, 0.0]),
    ([0.1, 0.2, 0.3, 0.4, 0.0], dict(temperature=0.5),  # p^2, renormalised
     [0.01 / 0.3, 0.04 / 0.3, 0.09 / 0.3, 0.16 / 0.3, 0.0]),
    ([0.4, 0.3, 0.2, 0.1, 0.0], dict(top_k=2), [4 / 7, 3 / 7, 0, 0, 0]),
    ([0.5, 0.3, 0.15, 0.05, 0.0], dict(top_p=0.8), [0.625, 0.375, 0, 0, 0]),
    # the top 3 renormalised (4/9, 3/9, 2/9) reach 0.7 after two tokens
    ([0.4, 0.3, 0.2, 0.1, 0.0], dict(top_k=3, top_p=0.7), [4 / 7, 3 / 7, 0, 0, 0]),
]


def _kind_batch(reps: int) -> tuple[torch.Tensor, list[SamplingParams]]:
    logits = torch.tensor([log0(p) for p, _, _ in ROW_KINDS for _ in range(reps)])
    return logits, [SamplingParams(**sp) for _, sp, _ in ROW_KINDS for _ in range(reps)]


def test_every_row_of_a_mixed_batch_follows_its_own_distribution():
    reps = 3000
    logits, params = _kind_batch(reps)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        ids = torch.tensor(sample(logits, params, [None] * len(params)))
    for k, (_, _, probs) in enumerate(ROW_KINDS):
        counts = torch.bincount(ids[k * reps:(k + 1) * reps], minlength=5)
        df = sum(p > 0 for p in probs) - 1
        stat = chi_square(counts, probs)
        assert stat < CHI2_CRIT[df], (k, counts.tolist(), stat)


def test_the_distribution_sampled_from_is_exact():
    logits, params = _kind_batch(1)
    out = sample_batch(logits, params, [None] * len(params), with_logprobs=True)
    want = torch.tensor([p for _, _, p in ROW_KINDS])
    torch.testing.assert_close(out.logprobs.exp(), want, atol=1e-6, rtol=1e-5)
    # greedy rows report the model's own distribution
    greedy = sample_batch(torch.tensor([[1.0, 2.0, 3.0]]), [SamplingParams(temperature=0)],
                          [None], with_logprobs=True)
    assert greedy.token_ids == [2]
    torch.testing.assert_close(greedy.logprobs, torch.log_softmax(torch.tensor([[1.0, 2.0, 3.0]]), -1))


def test_seeded_rows_draw_the_same_tokens_whatever_the_batch():
    v = 50
    row = torch.randn(v, generator=torch.Generator().manual_seed(3))
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=11)

    def run(batch: int, at: int, steps: int = 20) -> list[int]:
        gen = torch.Generator().manual_seed(11)
        out = []
        for _ in range(steps):
            logits = torch.randn(batch, v)
            logits[at] = row
            params = [SamplingParams(temperature=0.7)] * batch
            params[at] = sp
            gens = [None] * batch
            gens[at] = gen
            out.append(sample(logits, params, gens)[at])
        return out

    alone = run(1, 0)
    assert run(7, 3) == alone and run(32, 31) == alone
    assert len(set(alone)) > 3  # really sampled


def test_greedy_rows_do_not_advance_their_generator():
    gen = torch.Generator().manual_seed(5)
    before = gen.get_state()
    assert sample(torch.tensor([[0.0, 1.0], [1.0, 0.0]]),
                  [SamplingParams(temperature=0, seed=5), SamplingParams(temperature=1.0)],
                  [gen, None])[0] == 1
    assert torch.equal(gen.get_state(), before)


def test_a_generator_on_the_logits_device_is_used_as_it_is():
    gen = torch.Generator().manual_seed(9)
    assert generator_on(gen, torch.device("cpu")) is gen


def test_another_device_gets_one_twin_seeded_like_the_request():
    # 'cpu:0' is another device to the generator's 'cpu': the twin path, as for a GPU
    gen = torch.Generator().manual_seed(9)
    other = torch.device("cpu", 0)
    twin = generator_on(gen, other)
    assert twin is not gen and generator_on(gen, other) is twin
    fresh = torch.Generator().manual_seed(9)
    assert torch.equal(torch.rand(5, generator=twin), torch.rand(5, generator=fresh))
    assert torch.equal(torch.rand(5, generator=twin), torch.rand(5, generator=fresh))  # state kept


def test_one_host_copy_per_step():
    from torch.overrides import TorchFunctionMode

    class CountHostCopies(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls: list[str] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name == "numpy" and args[0].device.type == "cpu":
                pass  # a view of the CPU tensor's memory (argmax_rows), no copy
            elif name in ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__"):
                self.calls.append(name)
            return func(*args, **(kwargs or {}))

    logits, params = _kind_batch(4)
    gens = [torch.Generator().manual_seed(i) if i % 3 == 0 else None for i in range(len(params))]
    for ps in (params, [SamplingParams(temperature=0)] * len(params)):
        with CountHostCopies() as mode:
            ids = sample(logits, ps, gens)
        assert mode.calls == ["tolist"] and len(ids) == len(params)


# ---- seeds through the engine ------------------------------------------------------
def test_seeded_request_gives_the_same_tokens_alone_or_batched(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    prompt = list(range(40, 70))
    alone = llm.generate([prompt], seeded)[0].token_ids
    others = [list(range(200, 230 + 7 * i)) for i in range(3)]
    params = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),  # unseeded
              seeded,
              SamplingParams(temperature=0.8, seed=99, max_tokens=5, ignore_eos=True),
              GREEDY]
    batched = llm.generate([others[0], prompt, others[1], others[2]], params)
    assert batched[1].token_ids == alone
    assert llm.generate([prompt], seeded)[0].token_ids == alone  # and again later
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=4321, max_tokens=12,
                                ignore_eos=True)
    assert llm.generate([prompt], other_seed)[0].token_ids != alone
    assert_no_leak(llm)


# ---- stop conditions through the engine --------------------------------------------
def test_max_tokens_bounds_the_output(llm):
    for n in (1, 5):
        out = llm.generate([list(range(10, 20))], SamplingParams(temperature=0, max_tokens=n,
                                                                 ignore_eos=True))[0]
        assert len(out.token_ids) == n and out.finish_reason.value == "length"
    assert_no_leak(llm)


def test_stop_token_ids_end_the_request_at_the_first_hit(llm):
    prompt = list(range(300, 320))
    full = llm.generate([prompt], GREEDY)[0].token_ids
    stop = full[2]
    cut = full.index(stop) + 1
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                stop_token_ids=(stop,)))[0]
    assert out.token_ids == full[:cut] and out.finish_reason.value == "stop"
    assert_no_leak(llm)


@pytest.fixture(scope="module")
def eos_model(tiny_model, tmp_path_factory, llm):
    """The tiny model with generation_config.json's EOS set to a token greedy decoding
    emits (config.json keeps the original EOS, so the engine must read generation_config)."""
    prompt = list(range(500, 520))
    full = llm.generate([prompt], GREEDY)[0].token_ids
    d = tmp_path_factory.mktemp("eos_model")
    for f in tiny_model.iterdir():
        shutil.copy(f, d / f.name)
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen["eos_token_id"] != full[3]
    gen["eos_token_id"] = [full[3], 1999]
    (d / "generation_config.json").write_text(json.dumps(gen))
    return d, prompt, full


def test_eos_from_generation_config_stops_unless_ignore_eos(eos_model):
    d, prompt, full = eos_model
    eos_llm = LLM(str(d), block_size=4)
    assert full[3] in eos_llm.config.model.eos_token_ids
    out = eos_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8))[0]
    cut = full.index(full[3]) + 1
    assert out.token_ids == full[:cut] and out.finish_reason.value == "stop"
    out = eos_llm.generate([prompt], GREEDY)[0]
    assert out.token_ids == full and out.finish_reason.value == "length"
    assert_no_leak(eos_llm)


def test_argmax_rows_is_torch_argmax_ties_and_nan_included():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 3, (33, 2048), generator=g).float()  # many ties: the first wins
    x[1, :] = 1.0
    x[2, 7], x[3, 900], x[3, 5] = float("inf"), float("nan"), float("nan")
    for t in (x, x[:, ::2], x.double()):  # fp32 (through numpy), strided, fp64 (torch)
        assert torch.equal(argmax_rows(t), t.argmax(dim=-1))
        assert argmax_rows(t).dtype == torch.long
