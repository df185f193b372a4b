"""The batched sampler on CUDA: each row follows its distribution, seeded rows repeat
whatever the batch (the request's CPU generator gets a twin on the GPU), one host copy."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from engine.request import SamplingParams  # noqa: E402
from engine.sampler import generator_on, sample, sample_batch  # noqa: E402
from tests.unit.test_sampler import CHI2_CRIT, ROW_KINDS, _kind_batch, chi_square  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda", 0)


def test_every_row_follows_its_distribution_on_cuda():
    reps = 3000
    logits, params = _kind_batch(reps)
    with torch.random.fork_rng(devices=[DEV]):
        torch.cuda.manual_seed(0)
        ids = torch.tensor(sample(logits.to(DEV), params, [None] * len(params)))
    for k, (_, _, probs) in enumerate(ROW_KINDS):
        counts = torch.bincount(ids[k * reps:(k + 1) * reps], minlength=5)
        stat = chi_square(counts, probs)
        assert stat < CHI2_CRIT[sum(p > 0 for p in probs) - 1], (k, counts.tolist(), stat)


def test_exact_probabilities_on_cuda():
    logits, params = _kind_batch(1)
    out = sample_batch(logits.to(DEV), params, [None] * len(params), with_logprobs=True)
    want = torch.tensor([p for _, _, p in ROW_KINDS])
    torch.testing.assert_close(out.logprobs.exp().cpu(), want, atol=1e-6, rtol=1e-5)


def test_seeded_rows_repeat_whatever_the_batch_on_cuda():
    v = 32000
    row = torch.randn(v, generator=torch.Generator().manual_seed(3)).to(DEV)
    sp = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=11)

    def run(batch: int, at: int) -> list[int]:
        gen = torch.Generator().manual_seed(11)  # as engine.request.Request makes it
        out = []
        for _ in range(16):
            logits = torch.randn(batch, v, device=DEV)
            logits[at] = row
            params = [SamplingParams(temperature=0.8)] * batch
            params[at] = sp
            gens = [None] * batch
            gens[at] = gen
            out.append(sample(logits, params, gens)[at])
        return out

    alone = run(1, 0)
    assert run(64, 17) == alone and run(256, 255) == alone and len(set(alone)) > 3
    gen = torch.Generator().manual_seed(5)
    assert generator_on(gen, DEV) is generator_on(gen, DEV)
    assert generator_on(gen, DEV).device.type == "cuda"


def test_a_sampling_step_queues_without_a_host_sync():
    """Issue 37 item 5: top-k, top-p, log-prob rows and a raw/processed mix queue their
    kernels with no stream sync (CUDA's sync-debug mode raises on one); only the step's
    one host copy, after, waits."""
    from dataclasses import replace

    from engine.sampler import sample_on_device

    base = SamplingParams(temperature=0.8, max_tokens=4)
    params = [replace(base, temperature=0.0), replace(base, top_k=3),
              replace(base, top_p=0.7, logprobs=2),
              replace(base, top_k=5, top_p=0.9, logprobs=1, logprobs_mode="raw"), base]
    gens = [None, torch.Generator().manual_seed(1), None, None, None]
    logits = torch.randn(len(params), 32000, device=DEV)
    sample_on_device(logits, params, gens)  # first use: generators, pinned blocks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sample_on_device(logits, params, gens)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.ids.shape == (len(params),) and out.packed is not None
