"""Whole-engine greedy output with the Triton backend == the torch backend (CUDA, fp32)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

pytest.importorskip("triton")

from engine import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    # shorter than a block, one block, block + 1, several chunks, long
    return [torch.randint(1, 2000, (n,), generator=g).tolist() for n in (5, 16, 17, 45, 130)]


@pytest.mark.parametrize(("block_size", "chunk"), [(16, 13), (8, 64)], ids=["bs16-c13", "bs8-c64"])
def test_greedy_triton_equals_torch(tiny_model, block_size, chunk):
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(tiny_model), attention_backend=backend, device="cuda", dtype="float32",
                  block_size=block_size, max_prefill_chunk=chunk)
        assert llm.runner.backend.name == backend
        outs[backend] = [o.token_ids for o in llm.generate(prompts(), GREEDY)]
        assert llm.block_manager.num_used_blocks == 0
    assert outs["triton"] == outs["torch"]
    assert all(len(t) > 0 for t in outs["triton"])
