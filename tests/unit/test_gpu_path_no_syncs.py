"""Issue 37, item 5: a sampling step queues its kernels without waiting on the host. A
tensor made with `torch.tensor(values, device=cuda)` (a -inf scalar per top-k/top-p step,
the index of the rows that ask for log-probs, the raw/processed mask, a prompt chunk's
target ids) is a copy from pageable memory the host waits for; the sampler and the step's
log-prob pack build none (small host lists go through pinned memory:
`engine.device.to_device`). On the CPU the calls themselves are what can be checked; on a
GPU, tests/gpu/test_sampler_gpu.py runs the same step under CUDA's sync-debug mode."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.device import to_device
from engine.execute import _prompt_pack, _PromptSpan
from engine.request import Request, SamplingParams
from engine.sampler import sample_batch, sample_on_device


@pytest.fixture()
def no_device_tensors(monkeypatch):
    """Fail any `torch.tensor(..., device=...)` made while the test runs."""
    real = torch.tensor
    made: list[object] = []

    def tensor(data, *args, **kwargs):
        if kwargs.get("device") is not None:
            made.append(kwargs["device"])
            raise AssertionError(f"torch.tensor(..., device={kwargs['device']!r}) on the step path")
        return real(data, *args, **kwargs)

    monkeypatch.setattr(torch, "tensor", tensor)
    return made


def _params() -> list[SamplingParams]:
    base = SamplingParams(temperature=0.8, max_tokens=4)
    return [
        replace(base, temperature=0.0),  # greedy
        replace(base, top_k=3),  # top-k only
        replace(base, top_p=0.7, logprobs=2),  # top-p, asks for log-probs
        replace(base, top_k=5, top_p=0.9, logprobs=1, logprobs_mode="raw"),
        base,
    ]


def test_sampling_steps_make_no_tensor_from_host_values_on_the_device(no_device_tensors):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=g)
    params = _params()
    gens = [None, torch.Generator().manual_seed(1), None, None, None]
    topk_only = [p for p in params if p.top_p >= 1.0]  # the sort-free path
    for ps in (params, topk_only):
        d = sample_on_device(logits[:len(ps)], ps, gens[:len(ps)])
        assert d.ids.shape == (len(ps),)
    out = sample_batch(logits, params, gens, with_logprobs=True)
    assert out.token_ids[0] == int(logits[0].argmax())  # greedy row
    assert [lp is not None for lp in out.token_logprobs] == [False, False, True, True, False]
    # a top-k row's token is among its top 3 logits
    assert out.token_ids[1] in logits[1].topk(3).indices.tolist()
    assert no_device_tensors == []


def test_a_prompt_chunks_logprob_pack_makes_no_device_tensor(no_device_tensors):
    r = Request("a", list(range(10, 20)), SamplingParams(max_tokens=1, prompt_logprobs=2))
    span = _PromptSpan(r, 1, 4)
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(3))
    packed = _prompt_pack({"a": logits}, [span], 2, logits.device)
    assert packed.shape == (4 * (2 + 2 * 2),)
    ref = logits[:4].log_softmax(-1)
    want = ref.gather(1, torch.arange(11, 15)[:, None]).flatten().double()
    assert torch.equal(packed.view(4, -1)[:, 0], want)  # each row's target log-prob
    assert no_device_tensors == []


def test_to_device_on_the_cpu_is_the_plain_tensor():
    t = to_device([3, 1, 2], torch.long, torch.device("cpu"))
    assert t.tolist() == [3, 1, 2] and t.dtype == torch.long and not t.is_pinned()
