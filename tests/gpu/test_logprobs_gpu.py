"""Log-probs on CUDA (Triton backend, fp32): the engine's sampled and prompt log-probs
equal transformers' on the CPU, and the sampler's packed rows equal a CPU computation."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from engine import LLM, SamplingParams  # noqa: E402
from engine.sampler import sample_batch  # noqa: E402
from tests.logprobs_ref import check_entry, hf_logprobs  # noqa: E402

pytestmark = pytest.mark.gpu
ATOL = 1e-4  # GPU fp32 kernels vs the CPU reference
DEV = torch.device("cuda", 0)


def test_engine_logprobs_on_cuda_equal_transformers(tiny_model):
    llm = LLM(str(tiny_model), device="cuda", dtype="float32", block_size=16,
              max_prefill_chunk=13)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 2000, (n,), generator=g).tolist() for n in (5, 45)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=4,
                        prompt_logprobs=3)
    for out in llm.generate(prompts, [sp, replace(sp, prompt_logprobs=None)]):
        ref = hf_logprobs(tiny_model, out.prompt_token_ids + out.token_ids)
        p = len(out.prompt_token_ids)
        for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            check_entry(lp, ref[p - 1 + i], tok, 4, atol=ATOL)
        if out.prompt_logprobs is not None:
            for i in range(1, p):
                check_entry(out.prompt_logprobs[i], ref[i - 1], out.prompt_token_ids[i], 3,
                            atol=ATOL)
    assert llm.block_manager.num_used_blocks == 0


def test_sampler_packs_rows_on_cuda_like_the_cpu():
    logits = torch.randn(6, 32000, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0, logprobs=5), SamplingParams(temperature=0),
              SamplingParams(temperature=0.8, top_k=50, seed=3, logprobs=2),
              SamplingParams(temperature=0.8, top_p=0.9, seed=4, logprobs=0,
                             logprobs_mode="raw"),
              SamplingParams(temperature=0.5), SamplingParams(temperature=0, logprobs=20)]
    out = sample_batch(logits.to(DEV), params, [None] * 6)
    raw = logits.log_softmax(dim=-1)
    assert out.token_logprobs[1] is None and out.token_logprobs[4] is None
    for row in (0, 3, 5):  # greedy rows and the raw-mode row: the model's distribution
        check_entry(out.token_logprobs[row], raw[row], out.token_ids[row],
                    params[row].logprobs, atol=1e-5)
    lp = out.token_logprobs[2]
    assert lp.logprob > float("-inf") and lp.rank <= 50 and len(lp.top) == 2
