"""bf16 on CUDA through the whole engine (Triton kernels) against transformers, as
tests/unit/test_bf16_numerics.py does on CPU: teacher-forced log-probs and top-1 agreement
at positions up to 4k within 2x of transformers' own bf16 error; and the engine's loading
and device handling on a real GPU (meta build, cuda:N, loop threads)."""

from __future__ import annotations

import threading

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

pytest.importorskip("triton")

from engine import LLM, SamplingParams  # noqa: E402
from tests.unit.test_bf16_numerics import (  # noqa: E402
    assert_bf16_as_close_as_transformers,
    make_sharp_models,
)

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def sharp_models(model_dirs, tmp_path_factory) -> dict:
    return make_sharp_models(model_dirs, tmp_path_factory.mktemp("sharp"))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bf16_on_cuda_is_as_close_as_transformers(sharp_models, arch, backend):
    errs = assert_bf16_as_close_as_transformers(sharp_models[arch], "cuda", backend)
    print(f"{arch} {backend}: {errs}")


def test_bf16_weights_load_straight_to_the_gpu(tiny_model):
    llm = LLM(str(tiny_model), device="cuda", dtype="bfloat16", num_blocks=64)
    params = list(llm.runner.model.parameters())
    assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in params)
    inv = llm.runner.model.inv_freq(llm.runner.device)
    assert inv.dtype == torch.float32 and inv.device.type == "cuda"


def test_a_loop_thread_runs_the_engine_on_the_runners_device(tiny_model):
    # the runner binds every thread that calls it; run generation from a fresh thread
    llm = LLM(str(tiny_model), device="cuda:0", dtype="float32", num_blocks=64)
    prompts = [list(range(5, 40)), list(range(100, 117))]
    want = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    got: list = []
    t = threading.Thread(target=lambda: got.append(
        [o.token_ids for o in llm.generate(prompts, GREEDY)]))
    t.start()
    t.join()
    assert got == [want]
    llm.block_manager.check_integrity()
    assert llm.block_manager.num_used_blocks == 0


def _variants(fn) -> int:
    return sum(len(entry[0]) for entry in fn.device_caches.values())


def test_serving_compiles_no_kernel_variant_after_warmup(tiny_model):
    from engine.attention import triton_decode, triton_ops, triton_prefill

    kernels = {"decode": triton_decode._decode_kernel,
               "reduce": triton_decode._decode_reduce_kernel,
               "prefill": triton_prefill._prefill_kernel, "write_kv": triton_ops._write_kv_kernel}
    llm = LLM(str(tiny_model), device="cuda", dtype="bfloat16", num_blocks=2048,
              max_num_batched_tokens=256, max_prefill_chunk=97)
    after_warmup = {k: _variants(f) for k, f in kernels.items()}
    assert all(after_warmup.values()), after_warmup
    g = torch.Generator().manual_seed(0)
    # batches of 1..24 sequences, contexts 3..2000 (tables of 1..126 blocks, 1..n splits)
    lengths = [3, 17, 1, 64, 500, 2000, 33, 128, 999] + torch.randint(
        1, 700, (15,), generator=g).tolist()
    prompts = [torch.randint(1, 2000, (n,), generator=g).tolist() for n in lengths]
    for i in range(0, len(prompts), 6):
        llm.generate(prompts[i:i + 6], SamplingParams(temperature=0, max_tokens=20,
                                                      ignore_eos=True))
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert {k: _variants(f) for k, f in kernels.items()} == after_warmup
