"""bf16 through the whole engine against transformers, teacher-forced over a long prompt.

Exact greedy equality is not a sound test in bf16, so the engine's bf16 error is measured
against the same error of transformers' own bf16 model (both against transformers in
fp32, the truth): teacher-forced log-probabilities of the prompt's next tokens and top-1
agreement at positions spread up to ~4k. Rotary frequencies rounded to bf16 make the
angles drift with the position (0.4% of the frequency: radians by position 4k), which
these checks see clearly; fp32 stays exact (tests/unit/test_engine_exactness.py).
"""

from __future__ import annotations

import functools
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.loader import load_model_config
from engine.model_runner import ModelRunner, SeqChunk

PROMPT_LEN = 4000
CHUNK = 125  # logits at positions 124, 249, ..., 3999 (32 rows)
BLOCK = 16


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_sharp_models(model_dirs, root) -> dict:
    """The tiny models with q/k projections x4: attention scores 16x larger, so attention
    is sharp and depends on the relative positions (the random tiny model's attention is
    nearly uniform and would not notice a rotary error)."""
    out = {}
    for arch in ("llama", "qwen2"):
        d = root / f"sharp-{arch}"
        d.mkdir()
        for f in model_dirs[arch].iterdir():
            shutil.copy(f, d / f.name)
        w = load_file(d / "model.safetensors")
        for name in w:
            if ".q_proj." in name or ".k_proj." in name:
                w[name] = w[name] * 4
        save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
        out[arch] = d
    return out


@pytest.fixture(scope="module")
def sharp_models(model_dirs, tmp_path_factory) -> dict:
    return make_sharp_models(model_dirs, tmp_path_factory.mktemp("sharp"))


@functools.lru_cache(maxsize=1)
def _prompt(vocab: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(7)
    return tuple(torch.randint(1, vocab, (PROMPT_LEN,), generator=g).tolist())


def hf_logits(model_dir, ids: tuple[int, ...], dtype: torch.dtype, device: str = "cpu"
              ) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids], device=device)).logits[0].float().cpu()  # [T, V]


def engine_logits(model_dir, ids: tuple[int, ...], dtype: str, device: str = "cpu",
                  backend: str = "auto") -> torch.Tensor:
    """Logits at the last token of every CHUNK-token prefill chunk: `[T // CHUNK, V]`."""
    model = load_model_config(model_dir)
    blocks = -(-len(ids) // BLOCK)
    cfg = EngineConfig(str(model_dir), model, CacheConfig(BLOCK, blocks + 1),
                       SchedulerConfig(max_model_len=len(ids) + 1), device=device,
                       dtype=dtype, attention_backend=backend)
    runner = ModelRunner(cfg, blocks + 1)
    table = tuple(range(1, blocks + 1))
    rows = []
    for start in range(0, len(ids), CHUNK):
        chunk = SeqChunk("r", ids[start:start + CHUNK], start, table, sample=True)
        rows.append(runner.execute([chunk])[1][0].cpu())
    return torch.stack(rows)


def compare(logits: torch.Tensor, ref: torch.Tensor, targets: torch.Tensor) -> tuple[float, float]:
    """(mean |log p(target) - ref log p(target)|, top-1 agreement) over the rows."""
    lp = torch.log_softmax(logits, -1).gather(1, targets[:, None])
    lp_ref = torch.log_softmax(ref, -1).gather(1, targets[:, None])
    agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    return (lp - lp_ref).abs().mean().item(), agree


def assert_bf16_as_close_as_transformers(d, device: str = "cpu", backend: str = "auto"
                                         ) -> dict[str, float]:
    """The engine's bf16 teacher-forced errors against transformers fp32 (on the CPU, the
    truth) are within 2x + 0.01 of transformers' own bf16 on `device`, overall and over
    the later half of the positions (a drifting rotary angle grows with them)."""
    model = load_model_config(d)
    assert model.max_position_embeddings >= PROMPT_LEN
    ids = _prompt(model.vocab_size)
    rows = torch.arange(CHUNK - 1, PROMPT_LEN - 1, CHUNK)  # the last row has no target
    targets = torch.tensor(ids)[rows + 1]
    truth = hf_logits(d, ids, torch.float32)[rows]
    hf = hf_logits(d, ids, torch.bfloat16, device)[rows]
    ours = engine_logits(d, ids, "bfloat16", device, backend)[: len(rows)]
    hf_err, hf_agree = compare(hf, truth, targets)
    err, agree = compare(ours, truth, targets)
    late = slice(len(rows) // 2, None)
    err_late, _ = compare(ours[late], truth[late], targets[late])
    hf_late, _ = compare(hf[late], truth[late], targets[late])
    # bf16 noise is comparable across implementations; rounded rope frequencies are not
    assert err <= 2 * hf_err + 0.01, (err, hf_err)
    assert agree >= hf_agree - 0.1, (agree, hf_agree)
    assert err_late <= 2 * hf_late + 0.01, (err_late, hf_late)
    return {"logprob_err": err, "hf_logprob_err": hf_err, "top1": agree, "hf_top1": hf_agree}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bf16_engine_is_as_close_to_fp32_as_transformers_bf16(sharp_models, arch):
    assert_bf16_as_close_as_transformers(sharp_models[arch])


def test_fp32_engine_matches_transformers_at_long_positions(sharp_models):
    d = sharp_models["llama"]
    ids = _prompt(load_model_config(d).vocab_size)
    rows = torch.arange(CHUNK - 1, PROMPT_LEN, CHUNK)
    ours = engine_logits(d, ids, "float32")
    truth = hf_logits(d, ids, torch.float32)[rows]
    torch.testing.assert_close(ours, truth, atol=2e-4, rtol=0)
