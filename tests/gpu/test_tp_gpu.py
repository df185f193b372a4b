"""Tensor parallelism on CUDA: greedy output of TP = 2 equal to transformers' (fp32). With
two GPUs: NCCL, one GPU per rank. With one: both ranks on it over gloo
(PDSERVE_TP_ONE_GPU=1), which checks the CUDA path of the sharded model, not NCCL."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from engine import LLM, SamplingParams  # noqa: E402
from tests.unit.test_engine_exactness import prompt  # noqa: E402

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _hf(model_dir, prompts):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    with torch.inference_mode():
        return [m.generate(torch.tensor([p]).cuda(), max_new_tokens=12, min_new_tokens=12,
                           do_sample=False, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]


@pytest.mark.parametrize("one_gpu", [False, True], ids=["nccl", "one-gpu-gloo"])
def test_tp2_on_cuda_matches_transformers(tiny_model, monkeypatch, one_gpu):
    if not one_gpu and torch.cuda.device_count() < 2:
        pytest.skip("NCCL TP = 2 needs two GPUs")
    if one_gpu:
        monkeypatch.setenv("PDSERVE_TP_ONE_GPU", "1")
    prompts = [prompt(n, seed=n) for n in (5, 17, 45, 130)]
    with LLM(str(tiny_model), device="cuda", dtype="float32", block_size=16,
             max_prefill_chunk=13, tensor_parallel_size=2) as llm:
        outs = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        assert llm.block_manager.num_used_blocks == 0
    assert outs == _hf(tiny_model, prompts)
